"""Lint and diff over a release profile's input space, on the shipped rules and on edits of them.

The unit suites run on the `issue-48412` profile (tests/conftest.py); the tests about another
profile name it.
"""

from __future__ import annotations

import random

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.analysis import build_space, diff_rulesets, enumerate_inputs, lint
from kvpolicy.engine.inputs import build_context
from kvpolicy.engine.layout_engine import shipped_rules_dir
from kvpolicy.engine.plan import plan_layout
from kvpolicy.engine.verify import verify_plan
from kvpolicy.policy import ScaleViews, load_rules_from_texts
from kvpolicy.policy.layouts import Layout, Placement

PTH = {"fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"}
ISSUE, V034 = "issue-48412", "vllm-0.34"
GUARD = "per-token-head-forbids-cross-layer"


def shipped_texts(profile: str = ISSUE) -> dict[str, str]:
    root = shipped_rules_dir(profile)
    return {str(p.relative_to(root)): p.read_text() for p in [*root.glob("*.yaml"), *root.glob("connectors/*.yaml")]}


def without_rule(texts: dict[str, str], rule_id: str) -> dict[str, str]:
    out = {}
    for name, text in texts.items():
        if f"- id: {rule_id}\n" in text:
            start = text.index(f"  - id: {rule_id}\n")
            nxt = text.find("\n  - id: ", start + 1)
            text = text[:start] + (text[nxt + 1:] if nxt != -1 else "")
        out[name] = text
    return out


def fields(label: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in label.split(" "))


def kinds(report) -> dict[str, str | None]:
    return {lb.rule.id: lb.kind for lb in report.load_bearing}


@pytest.fixture(scope="module")
def shipped():
    return LayoutEngine.default(ISSUE).ruleset


@pytest.fixture(scope="module")
def no_pth():
    return load_rules_from_texts(without_rule(shipped_texts(), GUARD))


@pytest.fixture(scope="module")
def shipped_034():
    return LayoutEngine.default(V034).ruleset


@pytest.fixture(scope="module")
def lint_034(shipped_034):
    return lint(shipped_034, vllm_version=V034)


# ---------------------------------------------------------------------------------------------
# The #48412 development state (the unit suites' profile)


def test_shipped_rules_lint_clean(shipped) -> None:
    report = lint(shipped)
    assert report.profile == ISSUE and report.inputs_checked == len(report.space) > 2000
    assert [f.render() for f in report.findings if f.severity in ("error", "warning")] == []


def test_removing_the_per_token_head_rule_fails_lint_with_the_corrupting_inputs(no_pth) -> None:
    report = lint(no_pth)
    assert {f.code for f in report.errors} == {"unsafe-permit"}
    unsafe = {label for f in report.errors for label in f.inputs}
    assert unsafe
    for label in unsafe:
        f = fields(label)
        assert f["kv_cache_dtype"] in PTH
        assert f["scale_views"] == "assume_per_layer_contiguous"
        assert f["groups"] == "1x1"
    assert {fields(label)["kv_cache_dtype"] for label in unsafe} == PTH
    assert any("layer 0 k scale and layer 1 k scale both write" in f.message for f in report.errors)
    assert all(Layout(f.message.split("`")[1]).placement is Placement.cross_layer for f in report.errors)


def test_diff_lists_exactly_the_per_token_head_inputs(shipped, no_pth) -> None:
    report = diff_rulesets(shipped, no_pth)
    changed = {c.input.label for c in report.changes}
    unsafe = {label for f in lint(no_pth).errors for label in f.inputs}
    assert changed == unsafe  # every decision the edit changes is one the verifier rejects
    assert {c.input.to_dict()["kv_cache_dtype"] for c in report.changes} == PTH
    for c in report.changes:
        assert Layout(c.old).placement is Placement.per_layer and Layout(c.new).placement is Placement.cross_layer
        assert c.old_because == (f"{GUARD} (rules/issue-48412/global.yaml:42)",)
        assert c.new_because  # the connector preference that now wins
    assert sum(report.counts().values()) == len(report.changes)
    assert report.profile == ISSUE


def test_diff_of_identical_sets_is_empty(shipped) -> None:
    assert diff_rulesets(shipped, load_rules_from_texts(shipped_texts())).changes == ()


def test_dead_rule_and_conflict_and_not_load_bearing() -> None:
    texts = {
        "global.yaml": (
            "version: 1\nrules:\n"
            "  - id: never\n    description: huge blocks only\n"
            "    when: {field: kv.block_size, gt: 100000}\n    forbid: {block_outermost: true}\n"
            "  - id: no-lbhnc\n    description: style choice\n"
            "    when: {field: backend.mla, eq: false}\n    forbid: {layout: LBHNC}\n"
            "  - id: mla-wants-blnhc\n    description: contradiction on MLA\n"
            "    when: {field: backend.mla, eq: true}\n    require: {layout: BLNHC}\n"
            "  - id: mla-forbids-block-outermost\n    description: MLA keeps layers outermost\n"
            "    when: {field: backend.mla, eq: true}\n    forbid: {block_outermost: true}\n"
        ),
    }
    report = lint(load_rules_from_texts(texts))
    by_code = {f.code: f for f in report.findings}
    assert by_code["dead-rule"].rule.id == "never"
    assert by_code["conflict"].severity == "error"  # the shipped rules choose a layout there
    assert "`mla-wants-blnhc` (global.yaml:" in by_code["conflict"].message
    assert "`mla-forbids-block-outermost` (global.yaml:" in by_code["conflict"].message
    assert by_code["conflict"].inputs and all("backend=FLASHMLA" in label for label in by_code["conflict"].inputs)
    notes = {f.rule.id for f in report.findings if f.code == "not-load-bearing"}
    assert notes == {"no-lbhnc"}  # LBHNC is never chosen and never overlaps: removing it changes nothing
    assert kinds(report)["never"] is None and kinds(report)["mla-wants-blnhc"] is not None


def test_stride_aware_space_shows_the_rule_is_not_load_bearing() -> None:
    """Once backends build stride-aware scale views, a blunt per-token-head forbid
    protects nothing: lint says it can go (how the cross-layer speed-up comes back)."""
    texts = {"global.yaml": (
        "version: 1\nrules:\n  - id: blunt-pth\n    description: per-token-head forbids cross-layer\n"
        "    when: {field: kv.per_token_head, eq: true}\n    forbid: {block_outermost: true}\n")}
    rs = load_rules_from_texts(texts)
    fixed = list(enumerate_inputs(rs, scale_views=[ScaleViews.stride_aware]))
    assert {inp.backend.scale_views for inp in fixed} == {ScaleViews.stride_aware}

    def notes(report):
        return {f.rule.id for f in report.findings if f.code == "not-load-bearing"}

    assert notes(lint(rs, fixed)) == {"blunt-pth"}
    assert notes(lint(rs)) == set() and kinds(lint(rs))["blunt-pth"] == "safety"


# ---------------------------------------------------------------------------------------------
# Per release


def test_lint_on_vllm_034_shipped_rules_has_no_errors(lint_034) -> None:
    report = lint_034
    assert report.profile == V034
    assert [f.render() for f in report.findings if f.severity in ("error", "warning")] == []
    # the false positive this replaces: FLASHMLA chose LBHNC on #48412's geometry, which has none
    assert not any(f.code == "unsafe-permit" for f in report.findings)
    # every shipped require reproduces vLLM's decision; none of them protects bytes
    assert set(kinds(report).values()) == {"decision"}
    refusals = [f for f in report.findings if f.code == "release-refuses"]
    assert len(refusals) == 1 and refusals[0].count == report.summary["release_refuses"] > 0


def test_flashmla_under_offloading_chooses_lbhnc_and_it_verifies() -> None:
    engine = LayoutEngine.default(V034)
    decision = engine.decide(spec={"kind": "mla", "num_layers": 4, "num_kv_heads": 1, "head_size": 576},
                             attention_backend="FLASHMLA", connector="OffloadingConnector")
    assert decision.layout is Layout.LBHNC
    ctx = decision.context
    for layout in ctx.candidates:  # the packed 0.34 geometry: every layout of an MLA backend is safe
        assert verify_plan(plan_layout(layout, ctx.kv, ctx.backend, 3)).ok, layout


def test_the_per_token_head_guard_is_load_bearing_only_in_issue_48412(shipped) -> None:
    assert kinds(lint(shipped, vllm_version=ISSUE))[GUARD] == "safety"
    # the same rules over vLLM 0.34's inputs: its backends build stride-aware scale views,
    # so the guard never matches
    report = lint(shipped, vllm_version=V034)
    assert kinds(report)[GUARD] is None
    assert any(f.code == "dead-rule" and f.rule.id == GUARD for f in report.findings)
    # a blunt guard (any per-token-head mode) added to vLLM 0.34's rules only changes decisions
    # there (VLLM_KV_CACHE_LAYOUT=BLNHC no longer starts), never protects a byte
    texts = shipped_texts(V034)
    texts["guard.yaml"] = ("version: 1\nrules:\n  - id: blunt-pth\n    description: per-token-head forbids "
                           "cross-layer\n    when: {field: kv.per_token_head, eq: true}\n"
                           "    forbid: {block_outermost: true}\n")
    on_034 = lint(load_rules_from_texts(texts), vllm_version=V034)
    assert kinds(on_034)["blunt-pth"] == "decision"
    assert {f.code for f in on_034.errors} == {"conflict"}  # where vLLM 0.34 starts, the edit refuses
    assert all(fields(label)["kv_cache_dtype"] in PTH for f in on_034.errors for label in f.inputs)
    blunt = load_rules_from_texts({"global.yaml": texts["guard.yaml"]})
    assert kinds(lint(blunt, vllm_version=ISSUE))["blunt-pth"] == "safety"


def test_space_enumerates_what_the_profile_decision_reads(shipped_034) -> None:
    space = build_space(shipped_034, vllm_version=V034)
    dims = space.dimensions
    assert dims["backend"] == ["TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLASHINFER@10", "FLEX_ATTENTION",
                               "CPU_ATTN", "FLASHMLA", "TRITON_MLA"]
    assert dims["VLLM_KV_CACHE_LAYOUT"] == ["unset", *(x.value for x in Layout)]  # NHD/HND: LBNHC/LBHNC's aliases
    assert space.stands_for["VLLM_KV_CACHE_LAYOUT"]["LBHNC"] == ["LBHNC", "HND"]
    assert dims["enable_extensible_kv_cache"] == ["false", "true"] and dims["hisparse"] == ["false", "true"]
    # group shapes the rules cannot tell apart count once: a Mamba hybrid has mixed H/N/C shapes too (vLLM
    # counts a Mamba group as one head of one state), so it stands for `mixed-hnc`
    assert "dcp-mixed" in dims["groups"] and {"mixed-hnc", "mamba-hybrid"} & set(dims["groups"])
    assert any(i.context.groups.mixed_hnc_shapes and not i.context.groups.dcp_mixed_page_sizes for i in space.inputs)
    assert set(PTH) | {"auto", "fp8"} == set(dims["kv_cache_dtype"])
    assert {"bfloat16", "float16"} <= set(space.stands_for["kv_cache_dtype"]["auto"])
    assert any("turboquant_k8v4" in v for v in space.left_out.values())
    assert "MultiConnector[NixlConnector,OffloadingConnector]" in dims["connector"]
    assert len(space) == len(space.inputs) and f"{len(space)} inputs of `{V034}`" in space.describe()
    rng = random.Random(48412)
    for inp in rng.sample(space.inputs, 200):  # every input is one an operator could give
        ctx = inp.context
        assert inp.env == ctx.env()
        again = build_context(groups=ctx.groups, attention_backend=ctx.backend.name, vllm_version=V034,
                              connector=ctx.connector, device_capability=ctx.options.device_capability,
                              vllm_kv_cache_layout=ctx.options.kv_cache_layout, hisparse=ctx.options.hisparse,
                              enable_extensible_kv_cache=ctx.options.enable_extensible_kv_cache)
        assert again == ctx
        shape = inp.to_dict()["groups"]
        assert ctx.groups.mixed_hnc_shapes is (shape in ("mixed-hnc", "dcp-mixed", "mamba-hybrid"))
        assert ctx.groups.dcp_mixed_page_sizes is (shape == "dcp-mixed")


def test_a_dimension_no_rule_reads_costs_nothing() -> None:
    rs = load_rules_from_texts({"global.yaml": "version: 1\nrules: []\n"})
    space = build_space(rs, vllm_version=V034)
    assert space.dimensions["VLLM_KV_CACHE_LAYOUT"] == ["unset"]
    assert space.dimensions["groups"] == ["1x1"]
    assert space.dimensions["connector"] == ["none", "ThirdPartyConnector"]
    # capabilities that change a backend's candidates stay
    assert "FLASHINFER@10" in space.dimensions["backend"]


def test_diff_between_two_rule_dirs_under_a_chosen_profile(shipped_034) -> None:
    rule = "extensible-kv-cache-with-connector-needs-block-compact"
    edited = load_rules_from_texts(without_rule(shipped_texts(V034), rule))
    report = diff_rulesets(shipped_034, edited, vllm_version=V034)
    assert report.profile == V034 and report.changes
    for c in report.changes:
        f = c.input.to_dict()
        assert f["enable_extensible_kv_cache"] == "true" and f["connector"] != "none"
        assert any(b.startswith(f"{rule} (rules/vllm-0.34/global.yaml:") for b in c.old_because)
        assert c.new == "no layout" or not Layout(c.new).is_block_compact
    assert diff_rulesets(shipped_034, edited, vllm_version=ISSUE).profile == ISSUE


def test_vllm_028_guard_and_runner_are_decision_load_bearing_never_safety() -> None:
    """0.28's gate keeps per-token-head caches and the V2 runner per layer: both rules reproduce
    decisions, and neither protects a byte (its backends build stride-aware scale views)."""
    report = lint(LayoutEngine.default("0.28.0").ruleset, vllm_version="0.28.0")
    assert not report.errors
    found = kinds(report)
    assert found["per-token-head-forbids-cross-layer"] == "decision"
    assert found["v2-model-runner-keeps-per-layer"] == "decision"  # the space sets use_v2_model_runner
    assert "safety" not in found.values()
    assert "use_v2_model_runner" in report.space.dimensions
