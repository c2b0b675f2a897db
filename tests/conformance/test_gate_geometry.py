"""kvpolicy's plans under each uniform-gate profile put every byte where that vLLM release puts it.

For every backend x each kv_cache_dtype it supports (that kvpolicy plans) x head order x placement
it allocates, the release's oracle (`gate_oracle.gate_answers`, the same subprocess as the
decisions) allocates the cache with vLLM's own code on CPU (per layer: attn_utils._allocate_kv_cache
+ _reshape_kv_cache; cross-layer: allocate_uniform_kv_caches) and reports, for every layer, where
each K, V, latent and inline-scale cell starts (the views vLLM's backends read them through). The
byte address of every cell of every layer, block, token and head, the page size and the buffers
must equal kvpolicy's (`kvpolicy.engine.plan.plan_layout`).

Scale views: 0.26 on, the Triton backend's are stride-aware and are the plan's. In 0.24-0.25 they
assume one contiguous NHD buffer per layer; kvpolicy models that assumption with
`kvpolicy.engine.plan.naive_scale_view` (what its verifier checks for overlaps), and those views must
be vLLM's. Where the plan's own (stride-aware) scale cells are not vLLM's there, the allocation is
one kvpolicy decides but cannot plan: listed, and held to the cases where the verifier says why.
Patch releases share their series release's geometry files (test_gate_decisions.py) and are not
allocated again.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import pytest
from gate_oracle import BLOCKS, LAYERS, GateAnswers, gate_answers
from v028_space import GATE_SERIES, MLA_BACKENDS, UNPLANNED_DTYPES

from kvpolicy.engine.plan import LayoutPlan, naive_scale_view, plan_layout
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.spec import KVCacheSpec

Cells = dict[tuple[str, int, int, int, int], tuple[int, int]]


@pytest.fixture(scope="module", params=GATE_SERIES)
def answered(request: pytest.FixtureRequest, vllm_sites: Any) -> GateAnswers:
    return gate_answers(request.param)


def _plan(answered: GateAnswers, case: dict[str, Any]) -> LayoutPlan:
    mla = case["backend"] in MLA_BACKENDS
    spec = KVCacheSpec(kind="mla" if mla else "full", num_layers=LAYERS, block_size=case["block_size"],
                       num_kv_heads=case["num_kv_heads"], head_size=case["head_size"], dtype="bfloat16",
                       kv_cache_dtype=case["kv_cache_dtype"])
    return plan_layout(Layout(case["expect"]), spec, answered.profile.backend(case["backend"]), BLOCKS)


def kvpolicy_cells(plan: LayoutPlan, naive_scales: bool = False) -> Cells:
    """(role, layer, block, token, head) -> (buffer, byte address of the cell's first byte), from the plan's
    views: role "k"/"v" (MLA: "latent") from the layer's TensorView, "k_scale"/"v_scale" from its scale
    ByteViews (``naive_scales``: `naive_scale_view`, the per-layer-contiguous assumption)."""
    elem = plan.element_size
    spec = plan.spec
    out = {}
    for lp in plan.layers:
        v = lp.view
        stride = {d: v.strides[i] for i, d in enumerate(v.dims)}
        roles = (("latent", 0),) if spec.kv_factor == 1 else (("k", 0), ("v", 1))
        for (role, kv), b, n, h in itertools.product(roles, range(plan.num_blocks), range(spec.block_size),
                                                     range(spec.num_kv_heads)):
            el = (v.storage_offset + b * stride["block"] + n * stride["token"] + h * stride.get("head", 0)
                  + kv * stride.get("kv", 0))
            out[(role, lp.layer, b, n, h)] = (v.buffer, el * elem)
        scales = [naive_scale_view(plan, lp.layer, sv.role) for sv in lp.scales] if naive_scales else lp.scales
        for sv in scales:
            bstride = dict(zip(sv.dims, sv.byte_strides))
            for b, n, h in itertools.product(range(plan.num_blocks), range(spec.block_size),
                                             range(spec.num_kv_heads)):
                addr = sv.byte_offset + b * bstride["block"] + n * bstride["token"] + h * bstride.get("head", 0)
                out[(f"{sv.role}_scale", lp.layer, b, n, h)] = (sv.buffer, addr)
    return out


def vllm_cells(answer: dict[str, Any], block_size: int, heads: int) -> Cells:
    """The same map from the oracle's report: each role's view, indexed by (block, token[, head])."""
    out = {}
    for layer, lv in enumerate(answer["layers"]):
        for role, view in lv["roles"].items():
            s = dict(zip(view["dims"], view["byte_strides"]))
            for b, n, h in itertools.product(range(BLOCKS), range(block_size), range(heads)):
                addr = view["byte_offset"] + b * s["block"] + n * s["token"] + h * s.get("head", 0)
                out[(role, layer, b, n, h)] = (lv["buffer"], addr)
    return out


def _first_difference(ours: Cells, theirs: Cells) -> str | None:
    bad = next((k for k, a in theirs.items() if ours.get(k) != a), None)
    if bad is None and len(ours) == len(theirs):
        return None
    return f"first {bad}: kvpolicy {ours.get(bad)}, vLLM {theirs.get(bad)} ({len(ours)} vs {len(theirs)} cells)"


def test_every_cell_address_is_vllm_s(answered: GateAnswers, capsys: pytest.CaptureFixture[str]) -> None:
    failures, unplannable = [], []
    counts: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for case, answer in answered.geometry:
        key = (case["backend"], case["kv_cache_dtype"], case["expect"])
        if "error" in answer:
            failures.append(f"{key} {case['head_order']}: vLLM refused: {answer['error']}")
            continue
        plan = _plan(answered, case)
        naive = plan.backend.scale_views is ScaleViews.assume_per_layer_contiguous
        theirs = vllm_cells(answer, case["block_size"], case["num_kv_heads"])
        ours = kvpolicy_cells(plan, naive_scales=naive)
        equal = sum(ours.get(k) == a for k, a in theirs.items())
        counts[key][0] += equal
        counts[key][1] += len(theirs)
        if (why := _first_difference(ours, theirs)) is not None:
            failures.append(f"{key} {case['head_order']}: {equal} of {len(theirs)} cells equal; {why}")
        elif naive and plan.spec.per_token_head:
            # the plan's own (stride-aware) scale cells, where kvpolicy's runtime writes them
            planned = kvpolicy_cells(plan)
            if (why := _first_difference(planned, theirs)) is not None:
                never = "never decided (per-token-head guard), " if case["layout"] == "cross_layer" else ""
                unplannable.append(f"{key}: {never}the plan's scales are not vLLM's ({why})")
        lv = answer["layers"][0]
        checks = {
            "page_size_bytes": (plan.page_size_bytes, answer["page_size_bytes"]),
            "buffers": ([b.nbytes for b in plan.buffers], [b["nbytes"] for b in answer["buffers"]]),
            "cell bytes": (plan.spec.kv_factor * plan.spec.cell_bytes, lv["cell_bytes"]),
        }
        if "k_bytes" in lv:
            checks["K/V data bytes"] = ((plan.spec.data_bytes_per_head,) * 2, (lv["k_bytes"], lv["v_bytes"]))
        if "scale_bytes" in lv:
            checks["scale bytes"] = (plan.spec.quant_mode.scale_bytes, lv["scale_bytes"])
        for what, (a, b) in checks.items():
            if a != b:
                failures.append(f"{key} {case['head_order']}: {what} kvpolicy {a}, vLLM {b}")
    with capsys.disabled():
        pages = sorted({(c["backend"], c["kv_cache_dtype"], a["page_size_bytes"]) for c, a in answered.geometry
                        if "error" not in a})
        print(f"\nvLLM {answered.version} geometry: {len(answered.geometry)} allocations, {len(pages)} "
              f"(backend, dtype) page sizes; cell/scale addresses equal per backend x kv_cache_dtype x layout:")
        for (backend, dtype, layout), (eq, n) in sorted(counts.items()):
            print(f"  {backend:15} {dtype:20} {layout}: {eq} of {n}")
        for line in unplannable:
            print(f"  not planned as vLLM lays it out: {line}")
    assert not failures, "\n".join(failures[:30])
    # only 0.24-0.25's Triton per-token-head caches: cross-layer (kvpolicy never decides it) and per layer
    # head-major (vLLM's NHD-contiguous scale views land in other cells' scale slots; no overlap)
    assert all(u.startswith("('TRITON_ATTN'") and ("never decided" in u or "'LBHNC'" in u) for u in unplannable)
    assert bool(unplannable) is (answered.profile.geometry.value == "kv-dim")


def test_the_space_covers_every_backend_dtype_and_layout(answered: GateAnswers) -> None:
    profile = answered.profile
    seen = {(c["backend"], c["kv_cache_dtype"], c["expect"]) for c, _ in answered.geometry}
    for name, facts in profile.backends.items():
        layouts = set(profile.backend(name).layouts)
        assert {Layout(x) for b, _, x in seen if b == name} == layouts, name
        assert {d for b, d, _ in seen if b == name} == set(facts.kv_cache_dtypes) - set(UNPLANNED_DTYPES), name
    assert any(k[0] == "k_scale" for c, a in answered.geometry
               for k in vllm_cells(a, c["block_size"], c["num_kv_heads"]))
