"""kvpolicy.engine.plan: the geometry a layout implies, computed without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import pairwise, product

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpolicy.engine.plan import LayoutPlan, naive_scale_view, plan_layout, transfer_format
from kvpolicy.policy.backends import BACKENDS, BackendProfile
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import HeadOrder, Layout, Placement
from kvpolicy.policy.releases import get_profile, profile_names
from kvpolicy.policy.spec import AttentionKind, KVCacheSpec

TRITON = BACKENDS["TRITON_ATTN"]
MLA = BACKENDS["FLASHMLA"]


def make_spec(
    *,
    num_layers: int = 3,
    block_size: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 8,
    kv_cache_dtype: str = "auto",
    mla: bool = False,
    page_size_padded: int | None = None,
) -> KVCacheSpec:
    return KVCacheSpec(
        kind=AttentionKind.mla if mla else AttentionKind.full,
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=1 if mla else num_kv_heads,
        head_size=head_size,
        kv_cache_dtype=kv_cache_dtype,
        page_size_padded=page_size_padded,
    )


def layout(text: str) -> Layout:
    return Layout.parse(text)


def all_layouts(backend: BackendProfile) -> list[Layout]:
    return [Layout.parse(f"{p.value}/{h.value}") for p in Placement for h in backend.head_orders]


# ---- vLLM's numbers ----------------------------------------------------------------------------


def test_qwen2_5_0_5b_triton_hnd_cross_layer_matches_vllm() -> None:
    spec = make_spec(num_layers=24, block_size=16, num_kv_heads=2, head_size=64)
    plan = plan_layout(layout("BHLNC"), spec, TRITON, 176452)
    (buf,) = plan.buffers
    assert buf.shape == (176452, 2, 24, 2, 16, 64)
    assert buf.dims == ("block", "head", "layer", "kv", "token", "dim")
    assert buf.dtype == "bfloat16"
    assert plan.total_bytes == 176452 * 24 * spec.page_size_bytes == buf.nbytes


def test_llama_70b_triton_hnd_cross_layer_matches_vllm() -> None:
    spec = make_spec(num_layers=80, block_size=16, num_kv_heads=8, head_size=128)
    plan = plan_layout(layout("BHLNC"), spec, TRITON, 8724)
    assert plan.buffers[0].shape == (8724, 8, 80, 2, 16, 128)


def test_a_100_gb_plan_allocates_nothing_and_imports_no_torch() -> None:
    code = (
        "import sys, kvpolicy.engine, kvpolicy.engine.plan\n"
        "from policy.backends import BACKENDS\n"
        "from policy.layouts import Layout\n"
        "from policy.spec import KVCacheSpec\n"
        "spec = KVCacheSpec(num_layers=80, block_size=16, num_kv_heads=8, head_size=128)\n"
        "p = kvpolicy.engine.plan.plan_layout(Layout.parse('BHLNC'), spec, BACKENDS['TRITON_ATTN'], 300_000)\n"
        "assert p.total_bytes > 100e9, p.total_bytes\n"
        "assert 'torch' not in sys.modules, 'kvpolicy.engine.plan imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- geometry ----------------------------------------------------------------------------------


def test_cross_layer_views_step_one_layer_inside_each_block_row() -> None:
    spec = make_spec(num_layers=4, block_size=16, num_kv_heads=2, head_size=64)
    plan = plan_layout(layout("BLNHC"), spec, TRITON, 10)
    page_elems = spec.page_size_bytes // 2
    for lp in plan.layers:
        assert lp.view.storage_offset == lp.layer * page_elems
        assert lp.view.strides[0] == 4 * page_elems  # block stride: L pages
        assert lp.view.shape == (10, 2, 16, 2, 64)


def test_per_layer_views_are_contiguous_buffers_of_their_own() -> None:
    spec = make_spec()
    plan = plan_layout(layout("LBNHC"), spec, TRITON, 5)
    assert len(plan.buffers) == 3
    for lp in plan.layers:
        assert (lp.view.buffer, lp.view.storage_offset) == (lp.layer, 0)
        assert lp.view.strides == (2 * 4 * 2 * 8, 4 * 2 * 8, 2 * 8, 8, 1)


def test_hnd_views_put_heads_before_tokens_physically() -> None:
    plan = plan_layout(layout("LBHNC"), make_spec(), TRITON, 5)
    view = plan.layers[0].view
    assert view.dims == ("block", "kv", "token", "head", "dim")
    assert view.strides == (128, 64, 8, 32, 1)  # token stride D, head stride N*D


def test_flashinfer_hnd_cross_layer_order() -> None:
    plan = plan_layout(layout("BHLNC"), make_spec(), BACKENDS["FLASHINFER"], 5)
    assert plan.buffers[0].dims == ("block", "kv", "head", "layer", "token", "dim")
    assert plan.buffers[0].shape == (5, 2, 2, 3, 4, 8)


def test_mla_cross_layer_puts_layers_outermost_and_still_transfers_whole_pages() -> None:
    spec = make_spec(mla=True, head_size=16)
    plan = plan_layout(layout("BLNHC"), spec, MLA, 5)
    assert plan.buffers[0].shape == (3, 5, 4, 16)
    assert [lp.view.storage_offset for lp in plan.layers] == [0, 5 * 4 * 16, 2 * 5 * 4 * 16]
    (tv,) = plan.transfer
    assert tv.shape == (5, 3, spec.page_size_bytes)
    assert tv.byte_strides == (spec.page_size_bytes, 5 * spec.page_size_bytes, 1)


def test_per_token_head_scale_views_sit_at_each_cell_tail() -> None:
    spec = make_spec(num_layers=2, kv_cache_dtype="int8_per_token_head")  # cell 8 + 4 = 12 bytes
    plan = plan_layout(layout("BLNHC"), spec, TRITON, 5)
    k, v = plan.layers[1].scales
    page = spec.page_size_bytes
    assert (k.role, v.role) == ("k", "v")
    assert k.byte_offset == page + 8
    assert v.byte_offset == page + 4 * 2 * 12 + 8
    assert k.shape == (5, 4, 2) and k.byte_strides == (2 * page, 2 * 12, 12)
    assert k.dtype == "float32"


def test_naive_scale_views_of_every_cross_layer_layer_collide() -> None:
    """vLLM issue #48412: under cross_layer the naive views of all layers are the same bytes."""
    spec = make_spec(kv_cache_dtype="fp8_per_token_head")
    plan = plan_layout(layout("BLNHC"), spec, TRITON, 5)
    naive = {naive_scale_view(plan, i, "k") for i in range(spec.num_layers)}
    assert len(naive) == 1
    real = {plan.layers[i].scales[0] for i in range(spec.num_layers)}
    assert len(real) == spec.num_layers


def test_naive_scale_view_equals_the_real_one_for_per_layer_nhd() -> None:
    spec = make_spec(kv_cache_dtype="int4_per_token_head")
    plan = plan_layout(layout("LBNHC"), spec, TRITON, 5)
    for lp in plan.layers:
        for role, real in zip(("k", "v"), lp.scales, strict=True):
            assert naive_scale_view(plan, lp.layer, role) == real


def test_naive_scale_view_rejects_bad_arguments() -> None:
    plan = plan_layout(layout("LBNHC"), make_spec(), TRITON, 5)
    with pytest.raises(InputError, match="stores no inline scales"):
        naive_scale_view(plan, 0, "k")
    plan = plan_layout(layout("LBNHC"), make_spec(kv_cache_dtype="int8_per_token_head"), TRITON, 5)
    with pytest.raises(InputError, match="out of range"):
        naive_scale_view(plan, 3, "k")
    with pytest.raises(InputError, match="unknown role"):
        naive_scale_view(plan, 0, "q")


def test_transfer_rows_include_scales_and_padding() -> None:
    spec = make_spec(kv_cache_dtype="fp8_per_token_head", page_size_padded=256)
    cross = plan_layout(layout("BHLNC"), spec, TRITON, 5)
    (tv,) = cross.transfer
    assert tv.shape == (5, 3 * 256) and tv.byte_strides == (3 * 256, 1)
    per = plan_layout(layout("LBHNC"), spec, TRITON, 5)
    assert [t.shape for t in per.transfer] == [(5, 256)] * 3
    assert cross.total_bytes == per.total_bytes == 5 * 3 * 256


def test_padding_goes_after_each_page_where_pages_are_contiguous() -> None:
    spec = make_spec(page_size_padded=320)  # real page 2*4*2*8 bf16 = 256 B; padded page 160 elements
    nhd = plan_layout(layout("BLNHC"), spec, TRITON, 5)
    assert nhd.buffers[0].strides[:2] == (3 * 160, 160)  # block, layer: one padded page per layer
    hnd = plan_layout(layout("BHLNC"), spec, TRITON, 5)
    assert hnd.buffers[0].strides[:2] == (3 * 160, 3 * 2 * 4 * 8)  # pad at the end of the block row


def test_to_dict_is_json_and_fingerprints_differ_by_layout() -> None:
    spec = make_spec(kv_cache_dtype="int8_per_token_head")
    a = plan_layout(layout("BHLNC"), spec, TRITON, 5)
    b = plan_layout(layout("LBHNC"), spec, TRITON, 5)
    data = json.loads(json.dumps(a.to_dict()))
    assert data["layout"] == "BHLNC" and data["total_bytes"] == a.total_bytes
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == plan_layout(layout("BHLNC"), spec, TRITON, 5).fingerprint


def test_transfer_format_ignores_block_count_and_tells_head_orders_apart() -> None:
    spec = make_spec()
    nhd5 = plan_layout(layout("LBNHC"), spec, TRITON, 5)
    assert transfer_format(nhd5) == transfer_format(plan_layout(layout("LBNHC"), spec, TRITON, 9))
    assert transfer_format(nhd5) == transfer_format(plan_layout(layout("BLNHC"), spec, TRITON, 9))
    assert transfer_format(nhd5) != transfer_format(plan_layout(layout("LBHNC"), spec, TRITON, 5))


# ---- input checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [0, -3, 2.5, True, "8"])
def test_num_blocks_must_be_a_positive_int(num_blocks: object) -> None:
    with pytest.raises(InputError, match="num_blocks") as info:
        plan_layout(layout("LBNHC"), make_spec(), TRITON, num_blocks)  # type: ignore[arg-type]
    assert info.value.diagnostics[0].file == "num_blocks"


def test_head_order_must_be_supported_by_the_backend() -> None:
    with pytest.raises(InputError, match="has no geometry for layout `LBHNC`") as info:
        plan_layout(layout("LBHNC"), make_spec(mla=True), MLA, 5)
    assert "use one of: LBNHC, BLNHC" in info.value.render()


def test_spec_and_backend_must_agree_on_mla() -> None:
    with pytest.raises(InputError, match="backend `FLASHMLA`"):
        plan_layout(layout("LBNHC"), make_spec(), MLA, 5)
    with pytest.raises(InputError, match="backend `TRITON_ATTN`"):
        plan_layout(layout("LBNHC"), make_spec(mla=True), TRITON, 5)


def test_mamba_specs_have_no_plan() -> None:
    spec = KVCacheSpec(kind=AttentionKind.mamba, num_layers=2, block_size=4, num_kv_heads=2, head_size=8)
    with pytest.raises(InputError, match="mamba"):
        plan_layout(layout("LBNHC"), spec, TRITON, 5)


def test_padding_must_be_whole_elements() -> None:
    with pytest.raises(InputError, match="multiple of 2"):
        plan_layout(layout("LBNHC"), make_spec(page_size_padded=257), TRITON, 5)


# ---- invariants over random geometry -----------------------------------------------------------


def _cells(plan: LayoutPlan) -> dict[int, list[tuple[int, int]]]:
    """Every cell as (first byte, last byte + 1), per buffer."""
    spec, elem = plan.spec, plan.element_size
    out: dict[int, list[tuple[int, int]]] = {}
    for lp in plan.layers:
        v = lp.view
        counts = [range(v.shape[i]) for i in range(len(v.dims) - 1)]
        for idx in product(*counts):
            start = (v.storage_offset + sum(i * s for i, s in zip(idx, v.strides, strict=False))) * elem
            out.setdefault(v.buffer, []).append((start, start + spec.cell_bytes))
    return out


geometries = st.fixed_dictionaries(
    {
        "num_layers": st.integers(1, 3),
        "block_size": st.integers(1, 3),
        "num_kv_heads": st.integers(1, 3),
        "head_size": st.sampled_from([2, 4, 6, 8]),
        "kv_cache_dtype": st.sampled_from(["auto", "float16", "fp8", "int8_per_token_head", "int4_per_token_head"]),
        "pad": st.sampled_from([0, 4, 12]),
    }
)


@settings(max_examples=80, deadline=None)
@given(geo=geometries, backend=st.sampled_from(sorted(BACKENDS)), placement=st.sampled_from(list(Placement)),
       head_order=st.sampled_from(list(HeadOrder)), num_blocks=st.integers(1, 3))
def test_cells_are_disjoint_in_bounds_and_transfers_cover_each_byte_once(
    geo: dict, backend: str, placement: Placement, head_order: HeadOrder, num_blocks: int
) -> None:
    """The historical `issue-48412` backends (the unit suite's profile), per placement and head order."""
    profile = BACKENDS[backend]
    assume(head_order in profile.head_orders)
    _check_geometry(geo, profile, Layout.parse(f"{placement.value}/{head_order.value}"), num_blocks)


RELEASE_BACKENDS = sorted({(name, b) for name in profile_names() if name != "issue-48412"
                           for b in get_profile(name).backends})


@settings(max_examples=300, deadline=None)
@given(geo=geometries, release_backend=st.sampled_from(RELEASE_BACKENDS), layout=st.sampled_from(list(Layout)),
       num_blocks=st.integers(1, 3))
def test_every_release_profiles_backends_keep_cells_disjoint_and_transfers_exact(
    geo: dict, release_backend: tuple[str, str], layout: Layout, num_blocks: int
) -> None:
    """The same invariants for every release profile's backends (0.24-0.34: stride-aware scale views,
    the six layouts of 0.29+, CPU_ATTN's kv-dim geometry), with the kv_cache_dtypes each backend takes."""
    name, backend = release_backend
    release = get_profile(name)
    profile = release.backend(backend)
    assume(layout in profile.orders and geo["kv_cache_dtype"] in release.backends[backend].kv_cache_dtypes)
    _check_geometry(geo, profile, layout, num_blocks)


def _check_geometry(geo: dict, profile: BackendProfile, layout: Layout, num_blocks: int) -> None:
    """Cells disjoint and in bounds, each scale right after its cell's data, transfers covering each byte once."""
    geo = dict(geo)
    pad = geo.pop("pad")
    # per-token-head heads need 4-byte aligned scales (head_size % 4, int4 % 8): odd cells come from the rest
    assume(not geo["kv_cache_dtype"].endswith("per_token_head")
           or geo["head_size"] % (8 if geo["kv_cache_dtype"].startswith("int4") else 4) == 0)
    base = make_spec(mla=profile.mla, **geo)
    spec = make_spec(mla=profile.mla, page_size_padded=base.real_page_size_bytes + pad, **geo) if pad else base
    try:
        plan = plan_layout(layout, spec, profile, num_blocks)
    except InputError as exc:  # vLLM's compute_layout_strides refuses padding a page the head dim leaves
        order = layout.value
        head_outside_page = order.index("H") < max(order.index("L"), order.index("B"))
        assert pad and exc.diagnostics[0].code == "unpaddable-layout" and head_outside_page, exc
        assert geo["num_kv_heads"] > 1, exc
        return

    for buf, cells in _cells(plan).items():
        cells.sort()
        assert all(a[1] <= b[0] for a, b in pairwise(cells)), "two cells overlap"
        assert cells[0][0] >= 0 and cells[-1][1] <= plan.buffers[buf].nbytes
    cell_starts = {(b, start) for b, cells in _cells(plan).items() for start, _ in cells}
    for lp in plan.layers:
        for sv in lp.scales:  # each scale is the 4 bytes after the data of one of the layer's cells
            for idx in product(*(range(n) for n in sv.shape)):
                addr = sv.byte_offset + sum(i * s for i, s in zip(idx, sv.byte_strides, strict=True))
                assert (sv.buffer, addr - spec.data_bytes_per_head) in cell_starts

    covered: dict[int, list[int]] = {}
    for tv in plan.transfer:
        for idx in product(*(range(n) for n in tv.shape)):
            addr = tv.byte_offset + sum(i * s for i, s in zip(idx, tv.byte_strides, strict=True))
            covered.setdefault(tv.buffer, []).append(addr)
    for buf, addrs in covered.items():
        assert sorted(addrs) == list(range(plan.buffers[buf].nbytes)), "transfers must cover every byte once"
    assert plan.total_bytes == num_blocks * spec.num_layers * spec.page_size_bytes
