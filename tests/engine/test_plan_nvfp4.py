"""nvfp4 / nvfp4_4over6 (vLLM 0.34's FLASHINFER): decided as vLLM decides, planned where vLLM reads the cells.

The bytes themselves are held to vLLM 0.34.0 by tests/conformance/test_v034_geometry.py; these tests pin the
worked examples and the refusals a user meets without a vLLM install.
"""

from __future__ import annotations

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.fingerprint import fingerprint_of
from kvpolicy.engine.verify import check_plan
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.quant import QuantMode
from kvpolicy.policy.spec import KVCacheGroup, KVCacheGroups, KVCacheSpec

V034 = LayoutEngine.default("vllm-0.34")


def spec(head_size: int = 64, heads: int = 2, layers: int = 2, dtype: str = "nvfp4") -> dict:
    return {"num_layers": layers, "num_kv_heads": heads, "head_size": head_size, "block_size": 16,
            "kv_cache_dtype": dtype}


@pytest.mark.parametrize(("head_size", "page"), [(64, 2304), (128, 4608)])
@pytest.mark.parametrize("dtype", ["nvfp4", "nvfp4_4over6"])
def test_page_sizes_are_vllm_034s(head_size: int, page: int, dtype: str) -> None:
    """2H head slots of D/2 fp4 bytes + D/16 fp8 scale bytes, N tokens (the issue's 2304 B and 4608 B)."""
    kv = KVCacheSpec(**spec(head_size, dtype=dtype))
    assert kv.quant_mode is QuantMode.nvfp4 and kv.cache_dtype.value == "uint8"
    assert (kv.data_bytes_per_head, kv.scale_bytes_per_cell) == (head_size // 2, head_size // 16)
    assert kv.page_size_bytes == page and kv.hnc_shape == (4, 16, page)


@pytest.mark.parametrize("dtype", ["nvfp4", "nvfp4_4over6"])
def test_flashinfer_decides_and_plans_nvfp4(dtype: str) -> None:
    decision = V034.decide(spec=spec(), backend="FLASHINFER", kv_cache_dtype=dtype, explain=False)
    assert decision.layout is Layout.LBNHC  # vLLM's first candidate: FLASHINFER declares nothing else first
    plan = V034.plan(num_blocks=3, spec=spec(), backend="FLASHINFER", kv_cache_dtype=dtype)
    # LBNHC: the page's 4 head slots are inside each token (NHD); a side (K, V) is 2 x 16 cells of 36 B,
    # its 32 cells' 32 data bytes first (cell n*H + h), then their 4 scale bytes
    page, side = 2304, 2 * 16 * 36
    layer1 = 3 * page
    assert plan.cell_offset(1, 1, 2, 3, 1) == (0, layer1 + 2 * page + side + (3 * 2 + 1) * 32)
    assert plan.scale_offset(1, 1, 2, 3, 1) == (0, layer1 + 2 * page + side + 32 * 32 + (3 * 2 + 1) * 4)
    alloc = plan.vllm_allocation.layers[1]
    assert alloc.shape == (3, 4, 16, 36) and alloc.byte_strides == (page, 36, 4 * 36, 1)
    assert check_plan(plan).collision_count == 0


def test_head_major_layouts_place_cells_head_by_head() -> None:
    plan = V034.plan(num_blocks=2, spec=spec(), backend="FLASHINFER", vllm_kv_cache_layout="LBHNC")
    assert plan.layout is Layout.LBHNC
    # HND: cell (h, n) is cell h*N + n of its side
    assert plan.cell_offset(0, 0, 1, 3, 1) == (0, 2304 + (1 * 16 + 3) * 32)
    assert plan.scale_offset(0, 0, 1, 3, 1) == (0, 2304 + 32 * 32 + (1 * 16 + 3) * 4)


def test_a_layout_whose_pages_vllm_cannot_read_is_refused_at_plan_not_at_decide() -> None:
    """BHLNC with several layers leaves a layer's pages scattered: vLLM accepts it (FLASHINFER declares it)
    and its forward then raises; kvpolicy decides it and refuses the plan, naming vLLM's check."""
    inputs = {"spec": spec(), "backend": "FLASHINFER", "vllm_kv_cache_layout": "BHLNC"}
    assert V034.decide(explain=False, **inputs).layout is Layout.BHLNC
    with pytest.raises(InputError) as exc:
        V034.plan(num_blocks=2, **inputs)
    (d,) = exc.value.diagnostics
    assert d.code == "nvfp4-pages-not-dense" and d.file == "layout"
    assert "`nvfp4`" in d.message and "`BHLNC`" in d.message and "_nvfp4_kv_views" in d.message
    assert "LBNHC" in d.help
    # one layer: the page is dense again, as vLLM's stride check says
    assert V034.plan(num_blocks=2, **{**inputs, "spec": spec(layers=1)}).layout is Layout.BHLNC


def test_vllm_028_decides_nvfp4_but_kvpolicy_cannot_plan_it() -> None:
    v028 = LayoutEngine.default("vllm-0.28")
    inputs = {"spec": spec(), "backend": "FLASHINFER", "connector": "OffloadingConnector"}
    assert v028.decide(explain=False, **inputs).layout is Layout.BHLNC  # the gate reads no more of nvfp4
    with pytest.raises(InputError) as exc:
        v028.plan(num_blocks=2, **inputs)
    (d,) = exc.value.diagnostics
    assert (d.code, d.file) == ("unplanned-kv-cache-dtype", "kv_cache_dtype")
    assert "`nvfp4` on backend `FLASHINFER` but cannot plan it" in d.message and "vllm-0.34" in d.help


def test_the_runtime_refuses_to_allocate_nvfp4() -> None:
    with pytest.raises(InputError) as exc:
        V034.build(num_blocks=2, spec=spec(), backend="FLASHINFER")
    assert exc.value.diagnostics[0].code == "no-runtime-kernel"
    assert "no nvfp4 quantizer" in exc.value.diagnostics[0].message


@pytest.mark.parametrize(("fields", "says"), [
    ({"head_size": 72}, "multiple of 16"),
    ({"kind": "mla", "num_kv_heads": 1}, "`nvfp4_ds_mla`"),
])
def test_nvfp4_specs_vllm_cannot_hold_are_refused(fields: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        KVCacheSpec(**{**spec(), **fields})


def test_nvfp4_head_slots_count_in_vllms_hnc_shape() -> None:
    """8 nvfp4 heads are 16 slots of 72 B: the HNC shape of 16 bf16 heads of 18 values (vLLM: not mixed)."""
    nvfp4 = KVCacheSpec(**{**spec(128, heads=8), "block_size": 16})
    bf16 = KVCacheSpec(num_layers=2, num_kv_heads=16, head_size=18, block_size=16)
    groups = KVCacheGroups(groups=(KVCacheGroup(spec=nvfp4), KVCacheGroup(spec=bf16)))
    assert nvfp4.hnc_shape == bf16.hnc_shape == (16, 16, 18432) and not groups.mixed_hnc_shapes


def test_the_fingerprint_says_where_the_scales_are() -> None:
    kv = KVCacheSpec(**spec())
    fp = fingerprint_of(Layout.LBNHC, kv, V034.profile.backend("FLASHINFER"))
    assert (fp.scale_placement, fp.scale_dtype, fp.scale_bytes, fp.cell_bytes) == ("side_tail", "float8_e4m3fn", 4, 36)
    assert fp.physical_dims == ("layer", "block", "token", "kv", "head", "dim")


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
@pytest.mark.parametrize(("heads", "head_size", "pad"), [(1, 16, 0), (3, 32, 0), (2, 64, 64)])
def test_every_page_byte_is_one_cells_data_or_scale(layout: str, heads: int, head_size: int, pad: int) -> None:
    """A brute-force byte-owner map: every K/V cell's D/2 data bytes and D/16 scale bytes, of every layer and
    block, are distinct bytes, and together they are each page's bytes (padding untouched); the verifier agrees."""
    from kvpolicy.engine.plan import plan_layout

    kv = KVCacheSpec(**spec(head_size, heads=heads, layers=3))
    if pad:
        kv = kv.model_copy(update={"page_size_padded": kv.real_page_size_bytes + pad})
    plan = plan_layout(Layout[layout], kv, V034.profile.backend("FLASHINFER"), 2)
    owner: dict[int, tuple] = {}
    for layer in range(3):
        for cell in ((layer, k, b, n, h) for k in range(2) for b in range(2) for n in range(16) for h in range(heads)):
            for start, width, what in ((plan.cell_offset(*cell)[1], head_size // 2, "data"),
                                       (plan.scale_offset(*cell)[1], head_size // 16, "scale")):
                for byte in range(start, start + width):
                    assert byte not in owner, (byte, owner.get(byte), cell, what)
                    owner[byte] = (*cell, what)
    pages = {(byte // kv.page_size_bytes, byte % kv.page_size_bytes) for byte in owner}
    assert len(owner) == 3 * 2 * kv.real_page_size_bytes
    assert {offset for _, offset in pages} == set(range(kv.real_page_size_bytes))  # padding at each page's tail
    assert check_plan(plan).collision_count == 0
