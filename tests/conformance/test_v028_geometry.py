"""kvpolicy's plans under the `vllm-0.28` profile put every byte where vLLM 0.28.0 puts it.

For every backend x each kv_cache_dtype it supports (that kvpolicy plans) x head
order x placement it allocates, the v028 oracle allocates the cache with vLLM's own
code on CPU (per layer: attn_utils._allocate_kv_cache + _reshape_kv_cache; cross-layer:
allocate_uniform_kv_caches) and reports every layer's view and where K, V and the
inline scales sit in its packed last dim. The byte address of every K, V and scale
cell of every layer, block, token and head, and the page size, must equal kvpolicy's
(`kvpolicy.engine.plan.plan_layout`). One oracle call for the module.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Any

import pytest
from v028_space import MLA_BACKENDS, UNPLANNED_DTYPES, VERSION
from vllm_release import run_oracle

from kvpolicy.engine.plan import LayoutPlan, plan_layout
from kvpolicy.policy.layouts import HeadOrder, Layout
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import KVCacheSpec

PROFILE = get_profile(VERSION)
LAYERS, BLOCKS = 3, 4
DIMS = {"mha": {"num_kv_heads": 2, "head_size": 64, "block_size": 16},
        "mla": {"num_kv_heads": 1, "head_size": 576, "block_size": 16}}
# FlashMLA's kernels take 64-token blocks only (get_supported_kernel_block_sizes).
BLOCK_SIZE = {"FLASHMLA": 64}


def _cases() -> list[dict[str, Any]]:
    out = []
    for name, facts in PROFILE.backends.items():
        dtypes = [d for d in facts.kv_cache_dtypes or () if d not in UNPLANNED_DTYPES]
        for dtype, head_order, cross in itertools.product(dtypes, HeadOrder, (False, True)):
            layout = facts.allocated_layout(head_order, cross)
            if layout is None:
                continue
            dims = dict(DIMS["mla" if facts.mla else "mha"])
            dims["block_size"] = BLOCK_SIZE.get(name, dims["block_size"])
            case: dict[str, Any] = {"backend": name, "kv_cache_dtype": dtype, "head_order": head_order.value,
                                    "layout": "cross_layer" if cross else "per_layer", "num_layers": LAYERS,
                                    "num_blocks": BLOCKS, "dtype": "bfloat16", **dims, "expect": layout.value}
            if facts.mla:
                case["specs"] = [{"kind": "mla", **dims}]
            out.append(case)
    return out


@pytest.fixture(scope="module")
def answered(vllm_sites) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], float]:
    cases = _cases()
    start = time.perf_counter()
    answers = run_oracle(VERSION, "v028", [{k: v for k, v in c.items() if k != "expect"} for c in cases])
    return list(zip(cases, answers)), time.perf_counter() - start


def _plan(case: dict[str, Any]) -> LayoutPlan:
    mla = case["backend"] in MLA_BACKENDS
    spec = KVCacheSpec(kind="mla" if mla else "full", num_layers=LAYERS, block_size=case["block_size"],
                       num_kv_heads=case["num_kv_heads"], head_size=case["head_size"], dtype="bfloat16",
                       kv_cache_dtype=case["kv_cache_dtype"])
    return plan_layout(Layout(case["expect"]), spec, PROFILE.backend(case["backend"]), BLOCKS)


# ---- addresses, (buffer, byte offset), from each side's own description


def kvpolicy_cells(plan: LayoutPlan) -> dict[tuple[str, int, int, int, int], tuple[int, int]]:
    """(role, layer, block, token, head) -> (buffer, byte address of the cell's first byte), from the plan's
    views: role "k"/"v" (MLA: "latent") from the layer's TensorView, "k_scale"/"v_scale" from its scale ByteViews."""
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
        for sv in lp.scales:
            bstride = dict(zip(sv.dims, sv.byte_strides))
            for b, n, h in itertools.product(range(plan.num_blocks), range(spec.block_size),
                                             range(spec.num_kv_heads)):
                addr = sv.byte_offset + b * bstride["block"] + n * bstride["token"] + h * bstride.get("head", 0)
                out[(f"{sv.role}_scale", lp.layer, b, n, h)] = (sv.buffer, addr)
    return out


def vllm_cells(answer: dict[str, Any], block_size: int, heads: int) -> dict[tuple[str, int, int, int, int],
                                                                          tuple[int, int]]:
    """The same map from the oracle's report: each layer's view over vLLM's logical shape ((B, H, N, C),
    MLA (B, N, C)) in byte strides, plus where K, V and the scales sit in the packed last dim C."""
    out = {}
    for layer, lv in enumerate(answer["layers"]):
        s = lv["byte_strides"]
        mla = "latent_byte_offset_in_cell" in lv
        parts = [("latent", "latent_byte_offset_in_cell")] if mla else [
            ("k", "k_byte_offset_in_cell"), ("v", "v_byte_offset_in_cell"),
            ("k_scale", "k_scale_byte_offset_in_cell"), ("v_scale", "v_scale_byte_offset_in_cell")]
        for (role, key), b, n, h in itertools.product(parts, range(BLOCKS), range(block_size), range(heads)):
            if key not in lv:
                continue
            base = lv["byte_offset"] + b * s[0] + (n * s[1] if mla else h * s[1] + n * s[2])
            out[(role, layer, b, n, h)] = (lv["buffer"], base + lv[key])
    return out


def test_every_cell_address_is_vllm_s(answered, capsys) -> None:
    pairs, oracle_s = answered
    failures = []
    counts: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    start = time.perf_counter()
    for case, answer in pairs:
        key = (case["backend"], case["kv_cache_dtype"], case["expect"])
        if "error" in answer:
            failures.append(f"{key} {case['head_order']}: vLLM refused: {answer['error']}")
            continue
        plan = _plan(case)
        ours = kvpolicy_cells(plan)
        theirs = vllm_cells(answer, case["block_size"], case["num_kv_heads"])
        scale_roles = {"k_scale", "v_scale"}
        if {r for r, *_ in ours} != {r for r, *_ in theirs}:
            failures.append(f"{key}: roles kvpolicy {sorted({r for r, *_ in ours})}, "
                            f"vLLM {sorted({r for r, *_ in theirs})}")
        equal = sum(ours.get(k) == a for k, a in theirs.items())
        counts[key][0] += equal
        counts[key][1] += len(theirs)
        if equal != len(theirs) or len(ours) != len(theirs):
            bad = next(k for k, a in theirs.items() if ours.get(k) != a)
            failures.append(f"{key} {case['head_order']}: {equal} of {len(theirs)} cells equal; first {bad}: "
                            f"kvpolicy {ours.get(bad)}, vLLM {theirs[bad]}")
        # sizes: page, buffers, and the bytes of K, V and scale inside a cell
        lv = answer["layers"][0]
        checks = {
            "page_size_bytes": (plan.page_size_bytes, answer["page_size_bytes"]),
            "buffers": ([b.nbytes for b in plan.buffers], [b["nbytes"] for b in answer["buffers"]]),
            "packed cell bytes": (plan.spec.kv_factor * plan.spec.cell_bytes, lv["cell_bytes"]),
        }
        if "k_bytes" in lv:
            checks["K/V data bytes"] = ((plan.spec.data_bytes_per_head,) * 2, (lv["k_bytes"], lv["v_bytes"]))
        if scale_roles & {r for r, *_ in theirs}:
            checks["scale bytes"] = (plan.spec.quant_mode.scale_bytes, lv["scale_bytes"])
        for what, (a, b) in checks.items():
            if a != b:
                failures.append(f"{key} {case['head_order']}: {what} kvpolicy {a}, vLLM {b}")
    plan_s = time.perf_counter() - start
    with capsys.disabled():
        print(f"\nvLLM {VERSION} geometry: {len(pairs)} allocations (oracle {oracle_s:.0f} s, kvpolicy "
              f"{plan_s:.1f} s); cell/scale addresses equal per backend x kv_cache_dtype x layout:")
        for (backend, dtype, layout), (eq, n) in sorted(counts.items()):
            print(f"  {backend:15} {dtype:20} {layout}: {eq} of {n}")
    assert not failures, "\n".join(failures[:30])


def test_the_space_covers_every_backend_dtype_and_layout(answered) -> None:
    pairs, _ = answered
    seen = {(c["backend"], c["kv_cache_dtype"], c["expect"]) for c, _ in pairs}
    for name, facts in PROFILE.backends.items():
        layouts = set(PROFILE.backend(name).layouts)
        assert {Layout(x) for b, _, x in seen if b == name} == layouts, name
        assert {d for b, d, _ in seen if b == name} == set(facts.kv_cache_dtypes) - set(UNPLANNED_DTYPES), name
    assert any(k[0] == "k_scale" for c, a in pairs for k in vllm_cells(a, c["block_size"], c["num_kv_heads"]))
