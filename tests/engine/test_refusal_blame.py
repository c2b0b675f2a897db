"""A refusal names exactly the rules that remove what it says they remove (decision level, every profile).

`NoLayoutError` lists every rule that removed a candidate. Property: for any input kvpolicy refuses, a
rule of the rule set is named exactly when that rule alone (every other rule of every scope deleted)
removes a layout the release offers, and it is named for exactly those layouts; deleting the named rules
together makes the refusal go away unless a built-in entry (the release's candidates, the backend's
geometry, MultiConnector members that disagree) is named too. So a rule is never blamed for a layout it
does not remove, or for one the release never offered, and no rule that removes one is left out.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.decide import Scope, evaluate
from kvpolicy.policy.errors import NoLayoutError, PolicyError
from kvpolicy.policy.releases import get_profile, profile_names

ENGINES = {name: LayoutEngine.default(name) for name in profile_names()}
BUILT_IN = ("release-candidates", "backend-geometry", ":members-agree")
_NAMED = re.compile(r"rule `([^`]+)` \(\w+, ([^)]+)\) removed (.*)$")
LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")


@st.composite
def inputs(draw: Any) -> tuple[str, dict[str, Any]]:
    """A profile and `decide`'s inputs for it: a backend, an fp8 dtype or none, no connector, one or a
    MultiConnector of two, and (0.29 on) a VLLM_KV_CACHE_LAYOUT and the extensible KV cache."""
    name = draw(st.sampled_from(profile_names()))
    profile = get_profile(name)
    backend = draw(st.sampled_from(profile.backend_names()))
    mla = profile.backend(backend).mla
    spec = dict(num_layers=4, block_size=16, num_kv_heads=1 if mla else 2, head_size=576 if mla else 64)
    members = sorted(profile.connectors)
    conn = draw(st.sampled_from([None, "one", "multi"]))
    out: dict[str, Any] = dict(spec=spec, attention_backend=backend,
                               kv_cache_dtype=draw(st.sampled_from(["auto", "fp8", "fp8_per_token_head"])))
    if conn == "one":
        out["connector"] = draw(st.sampled_from(members))
    elif conn == "multi":
        pair = draw(st.lists(st.sampled_from(members), min_size=2, max_size=2))
        out.update(connector="MultiConnector", connector_config={"connectors": [{"kv_connector": m} for m in pair]})
    if name.startswith("vllm-0.3") or name == "vllm-0.29":
        out["vllm_kv_cache_layout"] = draw(st.sampled_from([None, *LAYOUTS]))
        out["enable_extensible_kv_cache"] = draw(st.booleans())
    return name, out


def _without(scope: Scope, keep: Any) -> Scope:
    """``scope`` (and its members) with only the rules ``keep(scope_label, rule)`` accepts."""
    return replace(scope, rules=tuple(r for r in scope.rules if keep(scope.label, r)),
                   members=tuple(_without(m, keep) for m in scope.members))


def _removed(order: tuple[Any, ...], full: int, alive: int) -> set[str]:
    return {str(x) for i, x in enumerate(order) if full >> i & 1 and not alive >> i & 1}


@settings(max_examples=400, deadline=None)
@given(inputs())
def test_a_refusal_names_exactly_the_rules_that_remove_a_candidate(asked: tuple[str, dict[str, Any]]) -> None:
    name, kw = asked
    engine = ENGINES[name]
    try:
        ctx = engine.context(**kw)
    except PolicyError:
        return  # an input this release refuses before deciding
    try:
        engine.decide(ctx, explain=False)
        return
    except NoLayoutError as exc:
        named: dict[tuple[str, str], set[str]] = {}
        for d in exc.diagnostics:
            m = _NAMED.search(d.message)
            assert m is not None, d.message
            named[(m.group(1), m.group(2))] = set(re.findall(r"`([^`]+)`", m.group(3)))
    ruleset = engine.ruleset
    glob, conn = engine._scopes_for(ruleset, ctx)
    order = ruleset.layout_order
    full = evaluate(ruleset, _without(glob, lambda *_: False), None, explain=False).alive  # what the release offers
    rules = [(s.label, r) for top in (glob, conn) if top is not None for s in top.walk() for r in s.rules]
    for label, rule in rules:
        def alone(lbl: str, r: Any, label: str = label, rule: Any = rule) -> bool:
            return lbl == label and r is rule
        outcome = evaluate(ruleset, _without(glob, alone), conn and _without(conn, alone), explain=False)
        removes = _removed(order, full, outcome.alive)
        assert named.get((rule.id, label), set()) == removes, (name, kw, rule.id, label, removes, named)
    if not any(b in rule_id for rule_id, _ in named for b in BUILT_IN):
        def unnamed(lbl: str, r: Any) -> bool:
            return (r.id, lbl) not in named
        outcome = evaluate(ruleset, _without(glob, unnamed), conn and _without(conn, unnamed), explain=False)
        assert outcome.winner is not None, (name, kw, sorted(named))
