"""Counterfactuals: the smallest input change that would make a losing layout win.

"cross_layer/NHD would be chosen if kv.per_token_head were false". The search
changes the values rule conditions see, one field at a time, then pairs, then
triples (bounded), re-running the fast decision for each. Candidate values
come from each field's domain (booleans, enums) and from the literals the
active rules compare it with (numbers, strings, connector extras).

Two limits keep them honest advice:

- A change the release itself refuses is never proposed: a setting the profile
  does not have (`ReleaseProfile.options`), or HiSparse without one of the
  profile's HiSparse connectors where it requires one (vLLM 0.34: "HiSparse
  requires a KV transfer config with HiSparseConnector").
  Nor is a ``VLLM_KV_CACHE_LAYOUT`` value the release does not accept (0.28:
  NHD or HND only). A change of a setting (the backend, the layout variable, a
  release option) is fed back as that input (`fed_back`): proposed only when the
  tool accepts it (no non-MLA backend for an MLA model) and, with the candidates
  that backend declares, decides the layout said.
- The operator's settings (dtype, connector, backend, environment, block size)
  are searched first; a change of `FIXED` facts (the model's shape, the
  backend's geometry, the hardware) or of a `DERIVED` field (``kv.per_token_head``
  follows from ``kv_cache_dtype``) is searched only for the layouts no setting
  makes win, and is marked not actionable, so it is listed after them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from itertools import combinations, product
from typing import Any

from kvpolicy.engine.decide import Scope, evaluate
from kvpolicy.engine.trace import Counterfactual, FieldChange
from kvpolicy.policy.conditions import leaves_of, same_value
from kvpolicy.policy.context import MISSING, Context, field_spec
from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.releases import ReleaseProfile
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["DERIVED", "FIXED", "counterfactuals", "fed_back"]

# Facts of the model, the backend's geometry or the hardware: no deployment setting changes them.
FIXED = frozenset({
    "kv.kind", "kv.num_layers", "kv.num_kv_heads", "kv.head_size", "kv.sliding_window", "kv.cell_bytes",
    "kv.page_size_bytes", "groups.count", "groups.attention_groups", "groups.has_mamba", "groups.has_sliding_window",
    "groups.mixed_hnc_shapes", "groups.dcp_mixed_page_sizes", "backend.mla", "backend.indexes_kv_by_block_stride",
    "backend.scale_views", "backend.supports_hnd", "platform.device_capability", "vllm.profile",
})
# Fields derived from another input (the field an operator sets instead): no setting sets them directly,
# so a change of one is searched with the facts and marked not actionable, naming what it derives from.
DERIVED = {"kv.quant_mode": "kv.kv_cache_dtype", "kv.per_token_head": "kv.kv_cache_dtype",
           "kv.quant_bits": "kv.kv_cache_dtype", "kv.cache_dtype": "kv.kv_cache_dtype"}
# the rule fields of the release options a profile may lack (`ReleaseProfile.options`)
_OPTION_FIELDS = {"cache.enable_extensible_kv_cache": "enable_extensible_kv_cache", "attention.hisparse": "hisparse"}

MAX_CHANGES = 3
MAX_EVALUATIONS = 4000
# An evaluation costs one pass per scope. Up to this many scopes (global, the connector, its members)
# it counts as one; beyond, as `scopes // SCOPES_PER_EVALUATION`, so a MultiConnector with a
# thousand members gets a bounded search, not minutes of it, while real configs search as before.
SCOPES_PER_EVALUATION = 8
ALL_SCOPES = "*"


def _alternatives(field: str, current: Any, literals: list[Any]) -> list[Any]:
    spec = field_spec(field)
    values: list[Any] = []
    if spec is not None and spec.type == "bool":
        values = [not current] if isinstance(current, bool) else [True, False]
    elif spec is not None and spec.choices is not None and spec.path != "connector.name":
        values = list(spec.choices)
    elif spec is not None and spec.type == "int":
        for lit in literals:
            if isinstance(lit, (int, float)) and not isinstance(lit, bool):
                values += [lit - 1, lit, lit + 1]
        values = [v for v in values if v >= 0]
    else:
        values = list(literals)
        if any(isinstance(v, bool) or str(v).lower() in ("true", "false") for v in literals):
            values += [False, "false"]
    if spec is not None and spec.nullable:
        values.append(MISSING)
    out: list[Any] = []
    for v in values:
        if not same_value(v, current) and not any(same_value(v, o) for o in out):
            out.append(v)
    return out


def _knobs(glob: Scope, conn: Scope | None) -> list[tuple[str, str, list[Any]]]:
    """(scope label, field, alternative values) for every field an active rule tests."""
    literals: dict[tuple[str, str], list[Any]] = {}
    scopes = glob.walk() + (conn.walk() if conn else [])
    for scope in scopes:
        for rule in scope.rules:
            for leaf in leaves_of(rule.rule.when):
                vals = leaf.value if isinstance(leaf.value, list) else [leaf.value]
                literals.setdefault((scope.label, leaf.field), []).extend(vals)
    # INVARIANT: only `connector.*` differs between scopes; every other field is one
    # input, so it is changed everywhere at once (label "*").
    merged: dict[tuple[str, str], list[Any]] = {}
    for (label, field), lits in literals.items():
        key = (label if field.startswith("connector.") else ALL_SCOPES, field)
        merged.setdefault(key, []).extend(lits)
    env_of = {s.label: s.env for s in scopes}
    env_of[ALL_SCOPES] = glob.env
    knobs = []
    # Try what an operator can change most easily first: connector config, then the
    # KV cache settings, then the model's groups, then the backend.
    rank = {"connector": 0, "kv": 1, "groups": 2, "backend": 3}
    for (label, field), lits in sorted(merged.items(), key=lambda kv: (rank.get(kv[0][1].split(".")[0], 9), kv[0])):
        alts = _alternatives(field, env_of[label].get(field, MISSING), lits)
        if alts:
            knobs.append((label, field, alts))
    return knobs


def _refused_by(profile: ReleaseProfile | None, connectors: tuple[str, ...]) -> Callable[[str, Any], bool]:
    """Whether the release refuses to start with ``field`` set to ``value`` (the rest of the input as it is)."""

    def refused(field: str, value: Any) -> bool:
        if profile is None:
            return False
        if field == "env.VLLM_KV_CACHE_LAYOUT":  # 0.28 takes NHD/HND only (`build_context` refuses the rest)
            return value is not MISSING and str(value) not in profile.kv_cache_layout_values()
        if value is not True:
            return False
        option = _OPTION_FIELDS.get(field)
        if option is not None and option not in profile.options:
            return True
        return (field == "attention.hisparse" and profile.hisparse_requires_connector
                and not set(connectors) & set(profile.hisparse_connectors))

    return refused


# Settings whose change is fed back as the input an operator gives (`build_context`'s keyword), so a proposal
# is one the tool accepts and decides as said: the backend also changes the candidates (what it declares).
_INPUT_OF = {"backend.name": "attention_backend", "env.VLLM_KV_CACHE_LAYOUT": "vllm_kv_cache_layout",
             "cache.enable_extensible_kv_cache": "enable_extensible_kv_cache", "attention.hisparse": "hisparse",
             "worker.use_v2_model_runner": "use_v2_model_runner"}


def context_inputs(ctx: Context) -> dict[str, Any]:
    """The `build_context` keywords that build ``ctx`` again (its groups, backend, connector, release, settings)."""
    o = ctx.options
    inputs: dict[str, Any] = {
        "groups": ctx.groups, "attention_backend": ctx.backend.name, "connector": ctx.connector,
        "vllm_version": ctx.profile, "vllm_kv_cache_layout": o.kv_cache_layout,
        "enable_extensible_kv_cache": o.enable_extensible_kv_cache, "hisparse": o.hisparse,
        "use_v2_model_runner": o.use_v2_model_runner, "device_capability": o.device_capability, "cpu": o.cpu_host,
        "device": "cpu" if ctx.backend.write_isa else None,
        "worker_attention_backends": None if ctx.worker_backends is None else [list(w) for w in ctx.worker_backends],
    }
    return inputs


def fed_back(ctx: Context, changes: tuple[FieldChange, ...]) -> Context | None:
    """``ctx`` built again with ``changes`` given as inputs; None when the tool refuses that input (an MLA
    model on a non-MLA backend, a layout value the release does not take, ...). A change of a field that is
    no input of its own (a connector's extra key, a derived field) is not fed back: ``ctx`` unchanged."""
    from kvpolicy.engine.inputs import build_context

    inputs = context_inputs(ctx)
    for change in changes:
        key = _INPUT_OF.get(change.field)
        if key is None:
            continue
        inputs[key] = None if change.becomes is MISSING else change.becomes
        if key == "attention_backend" and inputs["worker_attention_backends"] is not None:
            return None  # several workers' backends: one backend name is not one input
    try:
        with warnings.catch_warnings():  # what building it says was said for the deployment itself
            warnings.simplefilter("ignore")
            return build_context(**inputs)
    except PolicyError:
        return None


def _accepted(ruleset: RuleSet, ctx: Context | None, target: int, changes: tuple[FieldChange, ...]) -> bool:
    """Whether ``changes``, fed back as inputs (`fed_back`), are accepted and make layout ``target`` win."""
    if ctx is None or not any(c.field in _INPUT_OF for c in changes):
        return True
    from kvpolicy.engine.decide import scopes_for

    again = fed_back(ctx, changes)
    if again is None:
        return False
    glob, conn = scopes_for(ruleset, again)
    extra = {}  # a connector extra key the change also sets, which the rebuilt context does not hold
    for c in changes:
        if c.field not in _INPUT_OF:
            extra.setdefault(c.scope, {})[c.field] = c.becomes
    out = evaluate(ruleset, glob.with_env(extra), conn.with_env(extra) if conn else None, explain=False)
    return out.winner is not None and ruleset.layout_order[out.winner] == ruleset.layout_order[target]


def counterfactuals(
    ruleset: RuleSet, glob: Scope, conn: Scope | None, winner: int | None, *,
    profile: ReleaseProfile | None = None, connectors: tuple[str, ...] = (), context: Context | None = None,
) -> tuple[Counterfactual, ...]:
    """One counterfactual per losing candidate: those an operator's setting makes win first (in default order),
    then those only a `FIXED` fact does (``actionable`` False), then those nothing within the bound does.
    With ``profile``, no change the release refuses is proposed (``connectors``: the configured ones); with
    ``context``, a change of a setting (`_INPUT_OF`) is proposed only when, fed back as that input, the tool
    accepts it and decides as said."""
    order = ruleset.layout_order
    refused = _refused_by(profile, connectors)
    knobs = [(label, field, [v for v in alts if not refused(field, v)]) for label, field, alts in _knobs(glob, conn)]
    knobs = [k for k in knobs if k[2]]
    env_of = {s.label: s.env for s in glob.walk() + (conn.walk() if conn else [])}
    env_of[ALL_SCOPES] = glob.env
    targets = [i for i in range(len(order)) if i != winner]
    found: dict[int, tuple[FieldChange, ...]] = {}
    fixed: set[int] = set()
    budget = [MAX_EVALUATIONS]
    cost = max(1, (1 + (len(conn.walk()) if conn else 0)) // SCOPES_PER_EVALUATION)
    settable = [k for k in knobs if k[1] not in FIXED and k[1] not in DERIVED]
    for pass_knobs, actionable in ((settable, True), (knobs, False)):
        before = set(found)
        _search(ruleset, glob, conn, pass_knobs, targets, found, env_of, budget, cost,
                lambda target, changes: _accepted(ruleset, context, target, changes))
        if not actionable:
            fixed |= set(found) - before
        if len(settable) == len(knobs):
            break  # no fixed fact is tested: the second pass would find nothing new
    ranked = sorted(targets, key=lambda i: (i not in found, i in fixed, i))
    return tuple(Counterfactual(order[i], found.get(i), actionable=i not in fixed) for i in ranked)


def _search(ruleset: RuleSet, glob: Scope, conn: Scope | None, knobs: list[tuple[str, str, list[Any]]],
            targets: list[int], found: dict[int, tuple[FieldChange, ...]], env_of: dict[str, dict[str, Any]],
            budget: list[int], cost: int, accepted: Callable[[int, tuple[FieldChange, ...]], bool]) -> None:
    """Fill ``found`` with the smallest change of ``knobs`` under which each target wins, within ``budget``,
    that ``accepted`` takes (fed back as inputs)."""
    for size in range(1, MAX_CHANGES + 1):
        if all(t in found for t in targets) or budget[0] <= 0:
            return
        for combo in combinations(knobs, size):
            for values in product(*(alts for _, _, alts in combo)):
                budget[0] -= cost
                if budget[0] < 0:
                    return
                overrides: dict[str, dict[str, Any]] = {}
                for (label, field, _), value in zip(combo, values):
                    overrides.setdefault(label, {})[field] = value
                out = evaluate(ruleset, glob.with_env(overrides), conn.with_env(overrides) if conn else None,
                               explain=False)
                if out.winner in targets and out.winner not in found:
                    changes = tuple(FieldChange(label, field, env_of[label].get(field, MISSING), value)
                                    for (label, field, _), value in zip(combo, values))
                    if accepted(out.winner, changes):
                        found[out.winner] = changes


def describe_change(change: FieldChange) -> str:
    def show(v: Any) -> str:
        return "absent" if v is MISSING else str(v).lower() if isinstance(v, bool) else str(v)

    where = f" ({change.scope})" if change.field.startswith("connector.") and change.scope != ALL_SCOPES else ""
    return f"{change.field}{where} were {show(change.becomes)} (it is {show(change.was)})"


def describe(cf: Counterfactual) -> str:
    if cf.changes is None:
        return f"{cf.layout}: no change of up to {MAX_CHANGES} inputs the rules test would make it win"
    text = f"{cf.layout} would be chosen if " + " and ".join(describe_change(c) for c in cf.changes)
    if cf.actionable:
        return text
    fields = {c.field for c in cf.changes}
    why = [f"{f} is derived from {DERIVED[f]}, not a setting" for f in sorted(fields & DERIVED.keys())]
    if (fields - DERIVED.keys()) & FIXED:
        why.insert(0, "a fact of the model, backend or hardware, not a setting")
    return text + f" ({'; '.join(why)})"


