"""Waivers (docs/rule-language.md, "Waivers"): an owned, dated exception to one rule.

What an operator relies on: a waiver in force makes its rule have no effect where its `when` holds, and the
decision says so (text and JSON, by file:line); a lapsed one never applies and warns; a waiver of a rule that
is not there, of an audit rule, or of a load-bearing safety guard is a located error; and no waiver can make
kvpolicy allocate an overlapping layout.
"""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.engine.decide import evaluate, scopes_for
from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.engine.verify import verify_plan
from kvpolicy.policy.errors import GeometryError, InputError, RuleLoadError
from kvpolicy.policy.layouts import Placement
from kvpolicy.policy.load import load_rules_from_texts
from kvpolicy.policy.waivers import TODAY_VARIABLE, today, today_is

ROOT = Path(__file__).resolve().parents[2]

RULES = """\
version: 1
defaults:
  layout_order: [BLNHC, LBNHC, LBHNC]
rules:
  - id: fp8-stays-per-layer
    description: our fp8 kernels read per-layer blocks
    when: {field: kv.kv_cache_dtype, eq: fp8}
    forbid: {placement: cross_layer}
  - id: audit-only
    description: rolling out
    enforcement: audit
    when: {field: kv.kv_cache_dtype, eq: fp8}
    forbid: {layout: LBNHC}
"""

WAIVER = """\
version: 1
waivers:
  - rule: fp8-stays-per-layer
    owner: kv-team@example.com
    reason: the TRITON fp8 kernel reads cross-layer blocks since INFRA-12
    expires: 2027-01-31
    when: {field: backend.name, eq: TRITON_ATTN}
"""

INPUTS = dict(spec=dict(num_layers=4, block_size=16, num_kv_heads=2, head_size=64), kv_cache_dtype="fp8",
              backend="TRITON_ATTN", vllm_version="vllm-0.34")


def engine(waivers: str = WAIVER, day: date = date(2027, 1, 1)) -> LayoutEngine:
    with today_is(day):
        return LayoutEngine(load_rules_from_texts({"global.yaml": RULES, "ops.yaml": waivers}),
                            vllm_version="vllm-0.34")


def test_a_waiver_in_force_lifts_its_rule_and_the_decision_says_where_and_who() -> None:
    d = engine().decide(**INPUTS)
    assert d.layout.placement is Placement.cross_layer  # the forbid did not act
    [w] = d.waivers
    assert w.applied and w.rule.id == "fp8-stays-per-layer" and str(w.waiver.source) == "ops.yaml:3"
    assert [str(x) for x in w.layouts] == ["BLNHC", "BLHNC", "BHLNC"]  # the candidates it would have removed
    text = d.explain()
    assert "waived:" in text and "waived at ops.yaml:3 (owner kv-team@example.com, expires 2027-01-31)" in text
    assert "(waived at ops.yaml:3)" in text  # beside the rule in the rules list
    data = d.to_dict()
    assert data["waivers"] == [{"rule": "fp8-stays-per-layer", "rule_source": "global.yaml:5", "effect": "forbid",
                                "scope": "global", "applied": True, "layouts": ["BLNHC", "BLHNC", "BHLNC"],
                                "source": "ops.yaml:3",
                                "owner": "kv-team@example.com", "expires": "2027-01-31",
                                "reason": "the TRITON fp8 kernel reads cross-layer blocks since INFRA-12"}]
    assert data["rules"]["fp8-stays-per-layer"] is True  # the condition matched; the waiver lifted its effect
    assert "BLNHC" not in data["eliminated"]


def test_a_waiver_applies_only_where_its_condition_holds() -> None:
    d = engine().decide(**{**INPUTS, "backend": "FLASH_ATTN"})
    assert d.layout.placement is Placement.per_layer and d.waivers == ()


def test_the_last_day_is_in_force_and_the_day_after_the_rule_applies_again() -> None:
    assert engine(day=date(2027, 1, 31)).decide(**INPUTS).layout.placement is Placement.cross_layer
    lapsed = engine(day=date(2027, 2, 1))
    d = lapsed.decide(**INPUTS)
    assert d.layout.placement is Placement.per_layer
    [w] = d.waivers
    assert not w.applied
    assert any("expired on 2027-01-31" in x and "the rule applied" in x for x in d.warnings)
    [warning] = [x for x in lapsed.ruleset.warnings if x.code == "expired-waiver"]
    assert (warning.file, warning.line) == ("ops.yaml", 3)


def test_fast_path_and_trace_agree_with_waivers() -> None:
    """The winner of the fast path (no trace) is the traced one, in force or lapsed, whatever the backend."""
    for day in (date(2027, 1, 1), date(2028, 1, 1)):
        eng = engine(day=day)
        for backend in ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER"):
            ctx = eng.context(**{**INPUTS, "backend": backend})
            glob, conn = scopes_for(eng.ruleset, ctx)
            fast = evaluate(eng.ruleset, glob, conn, explain=False)
            slow = evaluate(eng.ruleset, glob, conn, explain=True)
            assert (fast.alive, fast.winner) == (slow.alive, slow.winner), (day, backend)


@pytest.mark.parametrize("waiver, code, line", [
    ("  - rule: fp8-stays-per-layr\n    owner: a\n    reason: b\n    expires: 2027-01-31\n",
     "unknown-waived-rule", 3),
    ("  - rule: audit-only\n    owner: a\n    reason: b\n    expires: 2027-01-31\n", "waiver-of-audit-rule", 3),
    ("  - rule: release-candidates\n    owner: a\n    reason: b\n    expires: 2027-01-31\n",
     "unknown-waived-rule", 3),
    ("  - rule: fp8-stays-per-layer\n    reason: b\n    expires: 2027-01-31\n", "missing-key", 3),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    expires: 2027-01-31\n", "missing-key", 3),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    reason: b\n", "missing-key", 3),
    ("  - rule: fp8-stays-per-layer\n    owner: ''\n    reason: b\n    expires: 2027-01-31\n", "invalid-value", 4),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    reason: b\n    expires: 2027-02-30\n", "invalid-value", 6),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    reason: b\n    expires: next friday\n", "invalid-waiver", 3),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    reason: b\n    expires: 1800000000\n", "invalid-waiver", 3),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    reason: b\n    expires: 2027-01-31\n    until: x\n",
     "unknown-key", 7),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    reason: b\n    expires: 2027-01-31\n"
     "    when: {field: backend.nme, eq: X}\n", "unknown-field", 7),
    ("  - rule: fp8-stays-per-layer\n    owner: a\n    reason: b\n    expires: 2027-01-31\n    when:\n",
     "empty-condition", 7),
])
def test_a_bad_waiver_is_a_located_error(waiver: str, code: str, line: int) -> None:
    with pytest.raises(RuleLoadError) as info, today_is(date(2027, 1, 1)):
        load_rules_from_texts({"global.yaml": RULES, "ops.yaml": "version: 1\nwaivers:\n" + waiver})
    found = [(d.file, d.code, d.line) for d in info.value.diagnostics]
    assert ("ops.yaml", code, line) in found, info.value.render()
    assert "Traceback" not in info.value.render()


def test_a_misspelt_rule_gets_a_did_you_mean() -> None:
    with pytest.raises(RuleLoadError) as info:
        engine(WAIVER.replace("fp8-stays-per-layer", "fp8-stays-per-layr"))
    [d] = info.value.diagnostics
    assert "did you mean `fp8-stays-per-layer`?" in (d.help or "")


def test_waivers_belong_in_a_global_file() -> None:
    conn = "version: 1\nconnector: NixlConnector\n" + WAIVER.removeprefix("version: 1\n")
    with pytest.raises(RuleLoadError) as info:
        load_rules_from_texts({"global.yaml": RULES, "connectors/nixl.yaml": conn})
    assert [d.code for d in info.value.diagnostics] == ["misplaced-waivers"]


def test_the_digest_counts_waivers_and_a_rule_set_without_any_keeps_its_own() -> None:
    plain = load_rules_from_texts({"global.yaml": RULES})
    assert load_rules_from_texts({"global.yaml": RULES, "ops.yaml": "version: 1\nwaivers: []\n"}).digest == plain.digest
    assert engine().ruleset.digest != plain.digest


def test_today_reads_the_variable_and_refuses_a_bad_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TODAY_VARIABLE, "2030-05-06")
    assert today() == date(2030, 5, 6)
    with today_is(date(2031, 1, 1)):
        assert today() == date(2031, 1, 1)
    monkeypatch.setenv(TODAY_VARIABLE, "tomorrow")
    with pytest.raises(InputError) as info:
        load_rules_from_texts({"global.yaml": RULES, "ops.yaml": WAIVER})
    assert info.value.diagnostics[0].file == TODAY_VARIABLE
    load_rules_from_texts({"global.yaml": RULES})  # no waiver: the day is never read


# -- safety: a waiver never yields an overlapping layout -----------------------------------------------

GUARD_WAIVER = """\
version: 1
waivers:
  - rule: per-token-head-forbids-cross-layer
    owner: kv-team@example.com
    reason: we know better
    expires: 2999-12-31
"""


def test_a_waiver_of_a_load_bearing_safety_guard_is_refused_when_the_rules_load(tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(GUARD_WAIVER)
    with pytest.raises(RuleLoadError) as info:
        LayoutEngine.from_path(tmp_path, vllm_version="issue-48412")  # the vLLM plugin's path
    [d] = info.value.diagnostics
    assert (d.code, d.file, d.line) == ("unwaivable-rule", f"{tmp_path}/global.yaml", 3)
    assert "safety guard" in d.message and "issue-48412" in d.message
    # the same rule is no safety guard where the backends build stride-aware scale views: waivable there
    (tmp_path / "global.yaml").write_text(GUARD_WAIVER.replace("per-token-head-forbids-cross-layer",
                                                               "cross-layer-needs-block-stride-indexing"))
    LayoutEngine.from_path(tmp_path, vllm_version="issue-48412")


def _issue_48412_with_the_guard_waived() -> LayoutEngine:
    """The #48412 rules with their guard waived, loaded past the load-time check (as a library caller could)."""
    root = ROOT / "rules" / "issue-48412"
    texts = {str(p.relative_to(root)): p.read_text() for p in (*root.glob("*.yaml"), *root.glob("connectors/*.yaml"))}
    texts["zz-ops.yaml"] = GUARD_WAIVER
    return LayoutEngine(load_rules_from_texts(texts), vllm_version="issue-48412")


WAIVED = _issue_48412_with_the_guard_waived()


CONNECTORS = [{}, {"connector": "ThirdPartyConnector", "connector_prefers_cross_layer_blocks": True},
              {"connector": "NixlConnector", "connector_config": {"enable_cross_layers_blocks": True}},
              {"connector": "OffloadingConnector"}]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(["fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"]),
       layers=st.integers(2, 6), heads=st.sampled_from([1, 2, 4]), blocks=st.integers(2, 6),
       connector=st.sampled_from(CONNECTORS))
def test_no_waiver_makes_kvpolicy_allocate_an_overlapping_layout(dtype: str, layers: int, heads: int, blocks: int,
                                                                connector: dict) -> None:
    inputs = dict(spec=dict(num_layers=layers, block_size=16, num_kv_heads=heads, head_size=64),
                  kv_cache_dtype=dtype, backend="TRITON_ATTN", scale_views="assume_per_layer_contiguous", **connector)
    try:
        cache = WAIVED.build(num_blocks=blocks, **inputs)
    except GeometryError as exc:  # the waiver let the rules pick cross-layer; the verifier refuses the bytes
        assert "refusing layout" in exc.render()
        return
    assert verify_plan(cache.plan).ok


def test_the_waived_guard_does_reach_the_verifier() -> None:
    """The property above is not vacuous: with the guard waived, the decision does pick the unsafe layout."""
    inputs = dict(spec=dict(num_layers=4, block_size=16, num_kv_heads=2, head_size=64),
                  kv_cache_dtype="fp8_per_token_head", backend="TRITON_ATTN",
                  scale_views="assume_per_layer_contiguous", connector="NixlConnector",
                  connector_config={"enable_cross_layers_blocks": True})
    d = WAIVED.decide(**inputs)
    assert d.layout.placement is Placement.cross_layer and d.waivers[0].applied
    with pytest.raises(GeometryError):
        WAIVED.build(num_blocks=4, **inputs)


# -- a waiver without `when` is the rule deleted; with one, the rule deleted where it holds -----------------

SHIPPED = LayoutEngine.default("vllm-0.34").ruleset
IDS = sorted(r.id for r in SHIPPED.rules)
CONTEXTS = [dict(kv_cache_dtype=dtype, connector=conn, vllm_kv_cache_layout=env, backend=backend)
            for dtype in ("auto", "fp8", "fp8_per_token_head")
            for conn in (None, "OffloadingConnector", "NixlConnector", "HiSparseConnector")
            for env in (None, "LBNHC", "BHLNC")
            for backend in ("FLASH_ATTN", "TRITON_ATTN")]


def _rebuilt(keep: set[str], waivers: list[tuple[Any, Any]] | None = None) -> Any:
    from kvpolicy.policy.ruleset import RuleSet

    rules = [(r.rule, r.source, r.scope) for r in SHIPPED.all_rules if r.id in keep]
    return RuleSet.build(rules, SHIPPED.layout_order, SHIPPED.member_preferences, SHIPPED.root,
                         order_declared=SHIPPED.order_declared, waivers=waivers or [], day=date(2027, 1, 1))


def _outcome(ruleset: Any, inputs: dict[str, Any]) -> tuple[int, int | None]:
    ctx = LayoutEngine(ruleset, vllm_version="vllm-0.34").context(
        spec=dict(num_layers=4, block_size=16, num_kv_heads=2, head_size=64), vllm_version="vllm-0.34",
        **{k: v for k, v in inputs.items() if v is not None})
    glob, conn = scopes_for(ruleset, ctx)
    fast = evaluate(ruleset, glob, conn, explain=False)
    slow = evaluate(ruleset, glob, conn, explain=True)
    assert (fast.alive, fast.winner) == (slow.alive, slow.winner)  # the trace never disagrees with the fast path
    return fast.alive, fast.winner


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(waived=st.sets(st.sampled_from(IDS), min_size=1, max_size=4), expired=st.booleans(),
       inputs=st.sampled_from(CONTEXTS))
def test_a_waiver_without_when_decides_as_the_rule_deleted(waived: set[str], expired: bool,
                                                           inputs: dict[str, Any]) -> None:
    from kvpolicy.policy.rule_model import Waiver
    from kvpolicy.policy.ruleset import Source

    expires = date(2026, 12, 31) if expired else date(2027, 1, 1)  # the rule set's day is 2027-01-01
    waivers = [(Waiver(rule=i, owner="o", reason="r", expires=expires), Source("w.yaml", n + 3))
               for n, i in enumerate(sorted(waived))]
    with_waivers = _rebuilt(set(IDS), waivers)
    expected = _rebuilt(set(IDS) if expired else set(IDS) - waived)
    try:
        assert _outcome(with_waivers, inputs) == _outcome(expected, inputs)
    except InputError:
        pass  # an input this profile refuses (a backend for the connector): nothing decided either way
