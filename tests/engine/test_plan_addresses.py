"""kvpolicy.engine.plan's byte addresses: cell_offset, scale_offset and vllm_allocation on the vllm-0.34 geometry.

tests/conformance/test_v034_geometry.py holds every number here to vLLM 0.34.0 itself; these
pin a few by hand and tie the addresses to the tensors `kvpolicy.engine.runtime.allocate` builds.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.engine.plan import plan_layout
from kvpolicy.engine.runtime.allocate import allocate
from kvpolicy.policy.backends import BACKENDS, Dim, KVSplit
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import AttentionKind, KVCacheSpec

V034 = get_profile("vllm-0.34")
QWEN = {"num_layers": 24, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def spec(**fields: object) -> KVCacheSpec:
    return KVCacheSpec(**{"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_size": 8, **fields})


def mla_spec(**fields: object) -> KVCacheSpec:
    return spec(kind=AttentionKind.mla, num_kv_heads=1, **fields)


# ---- the docs' numbers (docs/fingerprint.md) ------------------------------------------------------------------


def test_qwen_fp8_per_token_head_cross_layer_addresses() -> None:
    """Qwen2.5-0.5B, fp8_per_token_head, TRITON_ATTN, BLHNC: page 4352, a block row of 24 pages."""
    plan = plan_layout(Layout.BLHNC, spec(**QWEN, kv_cache_dtype="fp8_per_token_head"),
                       V034.backend("TRITON_ATTN"), 10)
    page = 4352
    assert plan.page_size_bytes == page
    assert plan.cell_offset(0, 0, 0, 0, 0) == (0, 0)
    assert plan.cell_offset(0, 1, 0, 0, 0) == (0, 68)  # V follows K's 64 codes and its 4-byte scale
    assert plan.scale_offset(0, 0, 0, 0, 0) == (0, 64)
    assert plan.scale_offset(0, 1, 0, 0, 0) == (0, 132)
    assert plan.cell_offset(3, 0, 0, 0, 0) == (0, 3 * page)  # layer 3's view starts 3 pages in
    assert plan.cell_offset(3, 0, 2, 0, 0) == (0, (2 * 24 + 3) * page)  # block 2's row is 24 pages
    assert plan.cell_offset(0, 0, 0, 0, 1) == (0, 16 * 136)  # HND: head 1 after 16 tokens of (K|V) cells
    assert plan.cell_offset(0, 0, 0, 5, 0) == (0, 5 * 136)
    alloc = plan.vllm_allocation
    assert alloc.buffer_bytes == (10 * 24 * page,)
    (buf,) = alloc.buffers
    assert buf.dims == ("block", "layer", "head", "token", "content")
    assert buf.shape == (10, 24, 2, 16, 136)
    assert buf.byte_strides == (24 * page, page, 16 * 136, 136, 1)
    layer3 = alloc.layers[3]
    assert layer3.dims == ("block", "head", "token", "content")
    assert (layer3.shape, layer3.byte_strides, layer3.byte_offset) == ((10, 2, 16, 136), (24 * page, 2176, 136, 1),
                                                                       3 * page)
    assert layer3.dtype == "uint8"  # vLLM's view dtype for fp8 caches


@pytest.mark.parametrize(("kv_cache_dtype", "dtype"), [("auto", "bfloat16"), ("fp8", "uint8"), ("fp8_e5m2", "uint8"),
                                                       ("int8_per_token_head", "int8"),
                                                       ("int4_per_token_head", "uint8")])
def test_vllm_view_dtype(kv_cache_dtype: str, dtype: str) -> None:
    plan = plan_layout(Layout.LBNHC, spec(kv_cache_dtype=kv_cache_dtype), V034.backend("TRITON_ATTN"), 2)
    assert {v.dtype for v in plan.vllm_allocation.layers} == {dtype}


# ---- CPU_ATTN: K's token rows, then V's ---------------------------------------------------------


def test_cpu_attn_reads_each_heads_run_as_k_rows_then_v_rows() -> None:
    cpu = V034.backend("CPU_ATTN")
    assert cpu.kv_split is KVSplit.token_rows
    assert cpu.layouts == (Layout.LBHNC, Layout.LHBNC, Layout.BLHNC, Layout.BHLNC)  # the token dim just outside C
    plan = plan_layout(Layout.LBHNC, spec(), cpu, 3)
    run = 4 * 2 * 8 * 2  # a head's N x C bytes: 4 tokens x (K|V) x 8 values x bf16
    assert plan.cell_offset(0, 0, 0, 1, 0) == (0, 8 * 2)
    assert plan.cell_offset(0, 1, 0, 0, 0) == (0, 4 * 8 * 2)  # V's rows start after K's N rows
    assert plan.cell_offset(0, 0, 0, 0, 1) == (0, run)
    # vLLM's [B, H, N, C] view is the same for CPU_ATTN as for any other backend
    assert plan.vllm_allocation.layers[0].byte_strides == (2 * run, run, 32, 2)
    with pytest.raises(InputError) as info:
        plan_layout(Layout.LBNHC, spec(), cpu, 3)
    assert info.value.diagnostics[0].code == "unsupported-layout"


def test_cpu_attn_writes_land_where_vllm_reads() -> None:
    plan = plan_layout(Layout.LBHNC, spec(), V034.backend("CPU_ATTN"), 3)
    cache = allocate(plan)
    key = torch.arange(2 * 8, dtype=torch.bfloat16).reshape(1, 2, 8)
    value = key + 100
    cache.write(1, key, value, torch.tensor([6]))  # block 1, token 2
    raw = cache.raw[0]
    for kv, data in ((0, key), (1, value)):
        for h in range(2):
            _, offset = plan.cell_offset(1, kv, 1, 2, h)
            got = raw[offset:offset + 16].view(torch.bfloat16)
            assert torch.equal(got, data[0, h]), (kv, h)


# ---- the addresses are the allocated views' -----------------------------------------------------


def _with_dtypes(names: list[str]) -> list[tuple[str, str]]:
    """Each backend with `auto`, and with `fp8_per_token_head` unless it is MLA (no per-token-head mode)."""
    return [(n, d) for n in names for d in ("auto", "fp8_per_token_head") if d == "auto" or not V034.backend(n).mla]


@pytest.mark.parametrize(("name", "kv_cache_dtype"),
                         _with_dtypes(["TRITON_ATTN", "FLASHINFER", "CPU_ATTN", "FLASHMLA"]))
def test_cell_offset_is_the_allocated_views_element(name: str, kv_cache_dtype: str) -> None:
    backend = V034.backend(name)
    s = mla_spec() if backend.mla else spec(kv_cache_dtype=kv_cache_dtype)
    for layout in backend.layouts:
        plan = plan_layout(layout, s, backend, 3)
        cache = allocate(plan)
        for lp in plan.layers:
            view = cache.layer_view(lp.layer)
            base = cache.raw[lp.view.buffer].data_ptr()
            for kv in range(s.kv_factor):
                for b in range(3):
                    for n in range(s.block_size):
                        for h in range(s.num_kv_heads):
                            at = {Dim.block: b, Dim.kv: kv, Dim.token: n, Dim.head: h, Dim.dim: 0}
                            index = tuple(at[d] for d in backend.logical_dims)
                            want = (lp.view.buffer, view[index].data_ptr() - base)
                            assert plan.cell_offset(lp.layer, kv, b, n, h) == want, (layout, lp.layer, index)
                            if s.per_token_head:
                                scale = (want[0], want[1] + s.data_bytes_per_head)
                                assert plan.scale_offset(lp.layer, kv, b, n, h) == scale


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "name", "valid"), [
    ((3, 0, 0, 0, 0), "layer", "0..2"),
    ((-1, 0, 0, 0, 0), "layer", "0..2"),
    ((0, 2, 0, 0, 0), "kv", "0..1"),
    ((0, 0, 5, 0, 0), "block", "0..4"),
    ((0, 0, 0, 4, 0), "token", "0..3"),
    ((0, 0, 0, 0, 2), "head", "0..1"),
    ((0, 0, 0, True, 0), "token", "0..3"),
    ((0, 0, 0.0, 0, 0), "block", "0..4"),
])
def test_out_of_range_indices_name_the_argument_and_range(args: tuple, name: str, valid: str) -> None:
    plan = plan_layout(Layout.BLNHC, spec(kv_cache_dtype="int8_per_token_head"), V034.backend("TRITON_ATTN"), 5)
    for method in (plan.cell_offset, plan.scale_offset):
        with pytest.raises(InputError) as info:
            method(*args)
        (diag,) = info.value.diagnostics
        assert diag.file == name
        assert valid in diag.message + (diag.help or "")


def test_mla_has_only_k() -> None:
    plan = plan_layout(Layout.LBNHC, mla_spec(), V034.backend("FLASHMLA"), 2)
    assert plan.cell_offset(1, 0, 1, 3, 0) == (0, (1 * 2 * 4 + 1 * 4 + 3) * 16)
    with pytest.raises(InputError) as info:
        plan.cell_offset(0, 1, 0, 0, 0)
    (diag,) = info.value.diagnostics
    assert diag.file == "kv" and "MLA" in (diag.help or "")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "bfloat16"])
def test_scale_offset_without_inline_scales_is_refused(kv_cache_dtype: str) -> None:
    plan = plan_layout(Layout.LBHNC, spec(kv_cache_dtype=kv_cache_dtype), V034.backend("TRITON_ATTN"), 2)
    assert plan.cell_offset(0, 1, 1, 1, 1)[0] == 0
    with pytest.raises(InputError) as info:
        plan.scale_offset(0, 0, 0, 0, 0)
    (diag,) = info.value.diagnostics
    assert (diag.file, diag.code) == ("kv_cache_dtype", "no-inline-scales")
    assert kv_cache_dtype in diag.message and "per_token_head" in (diag.help or "")


# ---- padded pages, as vLLM pads them -------------------------------------------------------------


def test_a_single_mla_head_does_not_hold_the_padding_out() -> None:
    s = mla_spec(page_size_padded=4 * 8 * 2 + 64)  # 64 bytes past the 64-byte page
    plan = plan_layout(Layout.LHBNC, s, V034.backend("FLASHMLA"), 5)
    (layer0, layer1, _) = plan.vllm_allocation.layers
    assert layer0.byte_strides[0] == 128  # every block one padded page, as vLLM's compute_layout_strides
    assert layer1.byte_offset == 5 * 128
    assert plan.total_bytes == 3 * 5 * 128


@pytest.mark.parametrize("layout", [Layout.LHBNC, Layout.BHLNC])
def test_padded_pages_between_heads_are_refused_as_vllm_refuses_them(layout: Layout) -> None:
    s = spec(page_size_padded=2 * 4 * 2 * 16 + 64)
    with pytest.raises(InputError) as info:
        plan_layout(layout, s, V034.backend("TRITON_ATTN"), 3)
    (diag,) = info.value.diagnostics
    assert (diag.file, diag.code) == ("spec.page_size_padded", "unpaddable-layout")
    assert str(layout) in diag.message and "LBHNC" in (diag.help or "")
    for ok in (Layout.LBHNC, Layout.LBNHC, Layout.BLHNC, Layout.BLNHC):
        assert plan_layout(ok, s, V034.backend("TRITON_ATTN"), 3).page_size_bytes == s.page_size_bytes


def test_the_48412_geometry_reports_its_own_dims() -> None:
    plan = plan_layout(Layout.BHLNC, spec(**QWEN), BACKENDS["TRITON_ATTN"], 7)
    (buf,) = plan.vllm_allocation.buffers
    assert buf.dims == ("block", "head", "layer", "kv", "token", "dim")
    assert buf.shape == (7, 2, 24, 2, 16, 64)
    assert plan.vllm_allocation.layers[3].byte_offset == 3 * 2048 * 2


# ---- the runtime, verifier, map and fingerprint on every vllm-0.34 geometry ---------------------


@pytest.mark.parametrize(("name", "kv_cache_dtype"), _with_dtypes(list(V034.backend_names())))
def test_every_vllm_0_34_geometry_allocates_round_trips_and_verifies(name: str, kv_cache_dtype: str) -> None:
    from kvpolicy.engine.fingerprint import fingerprint_of
    from kvpolicy.engine.memory_map import block_map
    from kvpolicy.engine.verify import verify_plan

    backend = V034.backend(name)
    s = mla_spec(page_size_padded=4 * 8 * 2 + 32) if backend.mla else spec(kv_cache_dtype=kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    for layout in backend.layouts:
        plan = plan_layout(layout, s, backend, 4)
        assert verify_plan(plan).ok, layout
        assert block_map(plan)
        # what kvpolicy's runtime writes below: cells, whatever order the backend's own kernel would give
        assert fingerprint_of(layout, s, backend, written_as="cells").digest.startswith("sha256:")
        cache = allocate(plan)
        slots = torch.tensor([0, 5, 11, 15])
        keys = torch.randn(s.num_layers, 4, s.num_kv_heads, s.head_size, generator=gen).to(torch.bfloat16)
        values = None if backend.mla else torch.randn(keys.shape, generator=gen).to(torch.bfloat16)
        cache.write_layers(keys, values, slots)
        for i in range(s.num_layers):
            k, v = cache.read(i, slots)
            if kv_cache_dtype == "auto":
                assert torch.equal(k, keys[i]), (layout, i)
                assert v is None if backend.mla else torch.equal(v, values[i]), (layout, i)
            else:
                assert torch.allclose(k.float(), keys[i].float(), atol=0.2, rtol=0.1), (layout, i)
        if plan.transfer:
            rows = cache.offload([1, 3])
            cache.restore([0, 2], rows)
            assert torch.equal(cache.offload([0, 2]).data, rows.data)
