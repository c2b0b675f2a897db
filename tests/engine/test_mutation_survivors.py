"""Tests written for the survivors of the mutation run of issue 32 (decide, plan, block_format).

Each test pins a behaviour a surviving mutant changed and no unit test held: the fast decision path
for composite connectors, `member_preferences: agree` at weight 1, the built-in filters and the
conflict error as the trace and the CLI show them, waivers of `require` rules, the documented JSON
keys of a plan and of a block format, and the wording of planning refusals.
"""

from __future__ import annotations

import dataclasses
from datetime import date

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.block_format import block_format, plan_of
from kvpolicy.engine.decide import geometry_ref, release_ref, scopes_for
from kvpolicy.engine.fingerprint import fingerprint_of
from kvpolicy.engine.plan import naive_scale_view, plan_layout
from kvpolicy.engine.trace import LayoutChosen
from kvpolicy.policy import ConnectorConfig, Layout, NoLayoutError, load_rules_from_texts
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import KVCacheSpec
from kvpolicy.policy.waivers import today_is

SPEC = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def rules(*body: str, connector: str | None = None, extra: str = "") -> str:
    return "version: 1\n" + (f"connector: {connector}\n" if connector else "") + extra + "rules:\n" + "".join(body)


def rule(rule_id: str, effect: str, weight: int | None = None) -> str:
    return (f"  - id: {rule_id}\n    description: {rule_id}\n    {effect}\n"
            + (f"    weight: {weight}\n" if weight else ""))


def multi_engine(mode: str) -> tuple[LayoutEngine, ConnectorConfig]:
    """Offloading prefers both cross-layer layouts, LMCache both HND layouts, each at weight 1 (the default)."""
    files = {
        "global.yaml": rules(),
        "connectors/multi.yaml": rules(connector="MultiConnector", extra=f"member_preferences: {mode}\n"),
        "connectors/off.yaml": rules(rule("offl", "prefer: {placement: cross_layer}"), connector="OffloadingConnector"),
        "connectors/lm.yaml": rules(rule("lm-hnd", "prefer: {head_order: HND}"), connector="LMCacheConnectorV1"),
    }
    multi = ConnectorConfig(name="MultiConnector", connectors=(ConnectorConfig(name="OffloadingConnector"),
                                                               ConnectorConfig(name="LMCacheConnectorV1")))
    return LayoutEngine(load_rules_from_texts(files)), multi


# ------------------------------------------------------------------------------------------------ decide


@pytest.mark.parametrize("mode", ["all", "any", "sum"])
def test_the_fast_path_ranks_composite_connectors_as_the_trace_does(mode: str) -> None:
    """`explain=False` (also what counterfactuals and audits run) combines member scores like `explain=True`."""
    engine, multi = multi_engine(mode)
    slow = engine.decide(spec=SPEC, connector=multi)
    fast = engine.decide(spec=SPEC, connector=multi, explain=False)
    assert fast.layout == slow.layout
    assert fast.ranking == slow.ranking
    assert any(score > 0 for _, score in fast.ranking)


@pytest.mark.parametrize("explain", [True, False])
def test_agree_members_preferring_different_layouts_at_weight_one_conflict(explain: bool) -> None:
    """A prefer's weight is 1 by default: two members whose best layouts differ at weight 1 disagree."""
    engine, multi = multi_engine("agree")
    with pytest.raises(NoLayoutError) as info:
        engine.decide(spec=SPEC, connector=multi, explain=explain)
    text = info.value.render()
    assert ("error[removed-candidates]: rule `connector:MultiConnector:members-agree` (require, "
            "connector:MultiConnector) removed `LBHNC`, `LBNHC`") in text


def test_agree_members_preferring_the_same_layouts_decide() -> None:
    engine, _ = multi_engine("agree")
    same = ConnectorConfig(name="MultiConnector", connectors=(ConnectorConfig(name="OffloadingConnector"),
                                                              ConnectorConfig(name="OffloadingConnector")))
    assert engine.decide(spec=SPEC, connector=same).layout.placement.value == "cross_layer"


def test_the_trace_names_the_winner_it_chose() -> None:
    engine, multi = multi_engine("sum")
    d = engine.decide(spec=SPEC, connector=multi)
    [chosen] = [e for e in d.events if isinstance(e, LayoutChosen)]
    assert chosen.layout == d.layout and chosen.ranking == d.ranking
    assert d.to_dict()["layout"]["name"] == str(d.layout)


def _mla_context_with_unplannable_candidate():
    engine = LayoutEngine(load_rules_from_texts({"global.yaml": rules()}), vllm_version="issue-48412")
    ctx = engine.context(spec={"kind": "mla", "num_layers": 4, "num_kv_heads": 1, "head_size": 576},
                         backend="FLASHMLA")
    return engine, ctx.model_copy(update={"candidates": (Layout.LBNHC, Layout.LBHNC, Layout.BLNHC)})


def test_scope_with_env_changes_the_envs_only() -> None:
    """`Scope.with_env` (counterfactuals) is a copy: candidates and the built-in filters' state stay."""
    engine, ctx = _mla_context_with_unplannable_candidate()
    glob, _ = scopes_for(engine.ruleset, ctx)
    assert glob.no_geometry == (Layout.LBHNC,)
    assert glob.with_env({}) == glob
    moved = glob.with_env({"*": {"kv.kv_cache_dtype": "fp8"}})
    assert moved.env["kv.kv_cache_dtype"] == "fp8"
    assert (moved.candidates, moved.release, moved.geometry, moved.no_geometry) == (
        glob.candidates, glob.release, glob.geometry, glob.no_geometry)


def test_the_built_in_filters_read_as_require_rules_naming_what_they_keep_and_remove() -> None:
    _engine, ctx = _mla_context_with_unplannable_candidate()
    geometry = geometry_ref(ctx, (Layout.LBHNC,))
    assert geometry.effect == "require"
    assert geometry.description.endswith("has a geometry (a plan) for "
                                         + ", ".join(str(x) for x in ctx.backend.orders) + " only, not for LBHNC")
    release = release_ref(ctx)
    assert release.effect == "require"
    assert "that attention backend `FLASHMLA` supports, most preferred first: LBNHC, LBHNC, BLNHC" in (
        release.description)


WAIVED_REQUIRE = """\
version: 1
rules:
  - id: must-be-hnd
    description: must be HND
    require: {head_order: HND}
"""

WAIVER = """\
version: 1
waivers:
  - rule: must-be-hnd
    owner: kv-team@example.com
    reason: trying NHD
    expires: 2027-01-31
"""


def test_a_waived_require_rule_reports_the_layouts_it_would_have_removed() -> None:
    with today_is(date(2027, 1, 1)):
        engine = LayoutEngine(load_rules_from_texts({"global.yaml": WAIVED_REQUIRE, "ops.yaml": WAIVER}))
        d = engine.decide(spec=SPEC)
    [w] = d.waivers
    assert w.applied and w.scope == "global"
    assert (w.waiver.owner, str(w.waiver.source), w.waiver.expires) == (
        "kv-team@example.com", "ops.yaml:3", "2027-01-31")
    assert sorted(str(x) for x in w.layouts) == ["BLNHC", "LBNHC"]  # the NHD ones, not the ones it keeps


def test_a_conflict_names_each_removing_rule_once_with_its_code() -> None:
    files = {"global.yaml": rules(rule("no-cross", "forbid: {placement: cross_layer}"),
                                  rule("need-cross", "require: {placement: cross_layer}"))}
    with pytest.raises(NoLayoutError) as info:
        LayoutEngine(load_rules_from_texts(files)).decide(spec=SPEC)
    err = info.value
    assert [(d.code, d.message) for d in err.diagnostics if "release-candidates" not in d.message] == [
        ("removed-candidates", "rule `no-cross` (forbid, global) removed `BLNHC`, `BHLNC`"),
        ("removed-candidates", "rule `need-cross` (require, global) removed `LBHNC`, `LBNHC`"),
    ]
    assert "(relax one of them, or change the input):" in err.render()


# ------------------------------------------------------------------------------------------------- plan


def _spec(**kw) -> KVCacheSpec:
    return KVCacheSpec(**{**SPEC, **kw})


def test_a_plans_json_has_the_documented_keys() -> None:
    """docs/json-output.md, `plan`: the keys a consumer of `dry-run --format json --num-blocks` reads."""
    plan = plan_layout(Layout.LBNHC, _spec(kv_cache_dtype="int8_per_token_head"),
                       get_profile("vllm-0.34").backend("TRITON_ATTN"), 3)
    data = plan.to_dict()
    assert {"layout", "backend", "spec", "num_blocks", "quant_mode", "cache_dtype", "cell_bytes", "page_size_bytes",
            "physical_dims", "buffers", "layers", "transfer", "total_bytes"} <= set(data)
    assert data["quant_mode"] == "int8_per_token_head" and data["page_size_bytes"] == plan.page_size_bytes
    [buffer] = data["buffers"]
    assert buffer == {"index": 0, "dims": list(plan.buffers[0].dims), "shape": list(plan.buffers[0].shape),
                      "strides": list(plan.buffers[0].strides), "dtype": plan.buffers[0].dtype,
                      "nbytes": plan.total_bytes}
    assert set(data["layers"][1]["view"]) == {"buffer", "dims", "shape", "strides", "storage_offset"}
    assert set(data["layers"][1]["scales"][0]) == {"buffer", "role", "dims", "shape", "byte_strides", "byte_offset",
                                                   "dtype"}


def test_a_block_formats_json_has_its_strides_and_sizes() -> None:
    """The module docstring's worked example (BLNHC under issue-48412), as exchanges write it to JSON."""
    plan = plan_layout(Layout.BLNHC, _spec(), get_profile("issue-48412").backend("FLASH_ATTN"), 2)
    assert block_format(plan).to_dict() == {"row_bytes": 4 * 8192, "cell_bytes": 128, "page_bytes": 8192,
                                            "cell_shape": [4, 2, 16, 2], "cell_strides": [8192, 4096, 256, 128],
                                            "padding_bytes": 0}


def _refusal(call) -> tuple[str, str, str, str | None]:
    with pytest.raises(InputError) as info:
        call()
    [d] = info.value.diagnostics
    return d.file, d.code, d.message, d.help


def test_index_refusals_say_what_to_use() -> None:
    plan = plan_layout(Layout.LBNHC, _spec(), get_profile("vllm-0.34").backend("TRITON_ATTN"), 2)
    assert _refusal(lambda: plan.cell_offset(0, 0, 0, 0, 1.5)) == (
        "head", "invalid-index", "head must be an integer in 0..1, got float `1.5`", "use 0..1")
    mla = plan_layout(Layout.LBNHC, KVCacheSpec(kind="mla", num_layers=2, block_size=16, num_kv_heads=1,
                                                head_size=576), get_profile("vllm-0.34").backend("FLASHMLA"), 2)
    assert _refusal(lambda: mla.cell_offset(0, 1, 0, 0, 0))[1:] == (
        "out-of-range", "kv `1` is out of range (0)", "MLA stores one latent per token: use 0")


def test_naive_scale_views_refuse_caches_without_inline_scales_by_the_plan() -> None:
    plan = plan_layout(Layout.LBNHC, _spec(), get_profile("vllm-0.34").backend("TRITON_ATTN"), 2)
    where, code, message, _ = _refusal(lambda: naive_scale_view(plan, 0, "k"))
    assert (where, code, message) == ("plan", "invalid-input", "quant mode `none` stores no inline scales")


def test_a_padded_page_that_interleaves_by_head_names_nvfp4s_head_slots() -> None:
    """nvfp4 gives K and V head slots of their own: the refusal counts 2H slots, not H KV heads."""
    kv = _spec(kv_cache_dtype="nvfp4")
    kv = KVCacheSpec(**{**SPEC, "kv_cache_dtype": "nvfp4", "page_size_padded": kv.page_size_bytes + 64})
    where, code, message, hint = _refusal(
        lambda: plan_layout(Layout.LHBNC, kv, get_profile("vllm-0.34").backend("FLASHINFER"), 2))
    assert (where, code) == ("spec.page_size_padded", "unpaddable-layout")
    assert "with 4 head slots (K's 2 KV heads, then V's)" in message
    assert hint.endswith("(LBHNC, LBNHC, BLHNC, BLNHC), or unpadded pages")
    plain = _spec(page_size_padded=_spec().page_size_bytes + 64)
    _, _, message, _ = _refusal(lambda: plan_layout(Layout.LHBNC, plain, get_profile("vllm-0.34").backend(
        "TRITON_ATTN"), 2))
    assert "with 2 KV heads: the head dim lies outside the page" in message


def test_a_fingerprint_describing_no_cache_is_refused_saying_why() -> None:
    """A peer's fingerprint whose fields make no KV spec: located at `fingerprint`, the spec's own complaint."""
    fp = fingerprint_of(Layout.LBNHC, _spec(), get_profile("vllm-0.34").backend("TRITON_ATTN"))
    assert _refusal(lambda: plan_of(dataclasses.replace(fp, kind="bogus"))) == (
        "fingerprint", "unknown-block-format",
        "the fingerprint describes no KV cache kvpolicy can lay out: 'bogus' is not a valid AttentionKind",
        "pass a fingerprint of a cache kvpolicy planned")


def test_nvfp4_pages_that_are_not_dense_are_refused_quoting_vllms_error() -> None:
    kv = _spec(kv_cache_dtype="nvfp4")
    where, code, message, hint = _refusal(
        lambda: plan_layout(Layout.BHLNC, kv, get_profile("vllm-0.34").backend("FLASHINFER"), 2))
    assert (where, code) == ("layout", "nvfp4-pages-not-dense")
    assert ("reads nvfp4 K and V only from dense pages (`_nvfp4_kv_views` raises \"NVFP4 KV pages must be dense\" "
            "at the first forward)") in message
    assert hint == "use a block-compact layout (LBNHC, LBHNC, BLNHC, BLHNC)"


def test_planning_refuses_a_block_count_and_a_backend_of_the_other_kind_saying_what_to_pass() -> None:
    triton, flashmla = (get_profile("vllm-0.34").backend(name) for name in ("TRITON_ATTN", "FLASHMLA"))
    assert _refusal(lambda: plan_layout(Layout.LBNHC, _spec(), triton, 0)) == (
        "num_blocks", "invalid-input", "num_blocks must be a positive integer, got `0`",
        "pass the number of KV cache blocks to plan, at least 1")
    hint = "pair MLA specs with MLA backends and the rest with the others"
    assert _refusal(lambda: plan_layout(Layout.LBNHC, _spec(), flashmla, 1)) == (
        "backend", "backend-mismatch", "backend `FLASHMLA` stores one latent per token, which spec kind `full` does "
        "not match", hint)
    mla = KVCacheSpec(kind="mla", num_layers=2, block_size=16, num_kv_heads=1, head_size=576)
    assert _refusal(lambda: plan_layout(Layout.LBNHC, mla, triton, 1)) == (
        "backend", "backend-mismatch", "backend `TRITON_ATTN` stores separate K and V per head, which spec kind `mla` "
        "does not match", hint)


def test_int4_before_vllm_032_plans_power_of_two_heads_and_refuses_the_others() -> None:
    """vLLM 0.25-0.31 accept int4 at any head size but their Hadamard transform asserts a power of two."""
    triton = get_profile("vllm-0.25").backend("TRITON_ATTN")
    for head in (64, 128):
        plan = plan_layout(Layout.LBNHC, _spec(head_size=head, kv_cache_dtype="int4_per_token_head"), triton, 1)
        assert plan.total_bytes == 4 * plan.page_size_bytes
    where, code, message, hint = _refusal(lambda: plan_layout(
        Layout.LBNHC, _spec(head_size=96, kv_cache_dtype="int4_per_token_head"), triton, 1))
    assert (where, code) == ("kv_cache_dtype", "release-fails-at-write")
    assert "at head size 96, but its first cache write fails" in message
    assert hint == ("use int8_per_token_head or fp8_per_token_head at this head size, or vLLM 0.32 or later (it "
                    "transforms such heads in power-of-two blocks)")


def test_a_kv_cache_dtype_the_release_lays_out_unmodelled_is_refused_saying_so() -> None:
    flashinfer = get_profile("vllm-0.29").backend("FLASHINFER")
    assert _refusal(lambda: plan_layout(Layout.LBNHC, _spec(kv_cache_dtype="nvfp4"), flashinfer, 1)) == (
        "kv_cache_dtype", "unplanned-kv-cache-dtype",
        "kvpolicy decides kv_cache_dtype `nvfp4` on backend `FLASHINFER` but cannot plan it: this release lays its "
        "cells out in a way kvpolicy does not model (the profile's `unplanned_kv_cache_dtypes`)",
        "plan it under a release whose layout kvpolicy models (kvpolicy releases lists them), or use another "
        "kv_cache_dtype")
