"""kvpolicy.engine.runtime.transfer: offload and restore whole blocks, byte for byte."""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch
from test_allocate import COMBO_IDS, COMBOS, NUM_BLOCKS, ODD, ODD_LAYOUTS, fill_random, make_plan

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.plan import LayoutPlan
from kvpolicy.engine.runtime import KVCache, allocate
from kvpolicy.policy import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec
from kvpolicy.policy.errors import InputError


def expected_rows(cache: KVCache, block: int) -> torch.Tensor:
    """Block ``block``'s (L, page) bytes straight from the raw buffers, by the plan's placement."""
    plan: LayoutPlan = cache.plan
    page, layers = plan.page_size_bytes, plan.num_layers
    if len(cache.raw) > 1:  # per_layer: page `block` of each layer's buffer
        return torch.stack([r[block * page : (block + 1) * page] for r in cache.raw])
    raw = cache.raw[0]
    if plan.physical_dims[0] == "block":  # one contiguous row per block
        return raw[block * layers * page : (block + 1) * layers * page].view(layers, page)
    # layers outermost (MLA cross_layer): page `block` of each layer's slab
    slab = plan.num_blocks * page
    return torch.stack([raw[i * slab + block * page : i * slab + (block + 1) * page] for i in range(layers)])


def check_round_trip(cache: KVCache) -> None:
    fill_random(cache, seed=3)
    before = [r.clone() for r in cache.raw]
    ids = [3, 0, 4, 1, 2]
    blocks = cache.offload(ids)
    assert blocks.fingerprint == cache.fingerprint and blocks.format == cache.block_format
    data = blocks.data
    assert data.shape == (len(ids), cache.plan.num_layers, cache.plan.page_size_bytes)
    assert data.dtype == torch.uint8 and data.device.type == "cpu"
    for j, b in enumerate(ids):
        assert torch.equal(data[j], expected_rows(cache, b)), f"block {b}"
    for r in cache.raw:
        r.zero_()
    assert cache.restore(ids, blocks).kind.value == "as_is"
    for r, b in zip(cache.raw, before, strict=True):
        assert torch.equal(r, b), "offload -> clear -> restore must give back every byte"


@pytest.mark.parametrize(("backend", "layout", "dtype"), COMBOS, ids=COMBO_IDS)
def test_offload_clear_restore_is_byte_exact(backend: str, layout: str, dtype: str) -> None:
    check_round_trip(allocate(make_plan(backend, layout, kv_cache_dtype=dtype)))


@pytest.mark.parametrize("layout", ODD_LAYOUTS)
@pytest.mark.parametrize("geo", ODD, ids=[str(g) for g in ODD])
def test_padded_and_odd_pages_round_trip_with_their_padding(layout: str, geo: dict) -> None:
    check_round_trip(allocate(make_plan("TRITON_ATTN", layout, **geo)))


def test_offloaded_blocks_restore_into_another_cache_of_the_same_format() -> None:
    src = allocate(make_plan(layout="BLNHC", kv_cache_dtype="int8_per_token_head"))
    dst = allocate(make_plan(layout="LBNHC", kv_cache_dtype="int8_per_token_head", num_blocks=9))
    assert src.transfer_format == dst.transfer_format and src.block_format == dst.block_format
    key = torch.randn(3, 2, 8)
    src.write(2, key, -key, torch.tensor([4, 5, 6]))  # block 1
    exchange = dst.restore(torch.tensor([7]), src.offload(torch.tensor([1])))
    assert exchange.kind.value == "as_is", "per_layer and cross_layer NHD rows mean the same: no transcoding"
    got_k, got_v = dst.read(2, torch.tensor([28, 29, 30]), dtype=torch.float32)  # block 7
    want_k, want_v = src.read(2, torch.tensor([4, 5, 6]), dtype=torch.float32)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_offload_accepts_int32_tensors_and_repeats() -> None:
    cache = allocate(make_plan(kv_cache_dtype="fp8"))
    fill_random(cache)
    data = cache.offload(torch.tensor([2, 2], dtype=torch.int32)).data
    assert torch.equal(data[0], data[1]) and torch.equal(data[0], expected_rows(cache, 2))
    assert cache.offload([]).data.shape == (0, 3, cache.plan.page_size_bytes)


# ---- restore refuses data of another geometry, and then writes nothing -------------------------


def _refused(cache: KVCache, block_ids: object, data: object, match: str, **kw: object) -> None:
    before = [r.clone() for r in cache.raw]
    with pytest.raises(InputError, match=match):
        cache.restore(block_ids, data, **kw)  # type: ignore[arg-type]
    for r, b in zip(cache.raw, before, strict=True):
        assert torch.equal(r, b), "a refused restore wrote bytes"


def test_restore_with_the_wrong_geometry_is_refused_and_writes_nothing() -> None:
    cache = allocate(make_plan(layout="BHLNC", kv_cache_dtype="int8_per_token_head"))
    fill_random(cache)
    other_layers = allocate(make_plan(layout="BHLNC", kv_cache_dtype="int8_per_token_head", num_layers=2))
    _refused(cache, [0], other_layers.offload([0]), "num_layers: source 2, target 3")
    unquantized = allocate(make_plan(layout="BHLNC"))  # page without scales: another width
    _refused(cache, [0], unquantized.offload([0]), "cache_dtype: source bfloat16, target uint8")
    # bare bytes, vouched for, of another geometry: the shape check
    _refused(cache, [0], other_layers.offload([0]).data, "restore from uint8", assume_same_layout=True)
    good = cache.offload([0, 1]).data
    _refused(cache, [0], good, r"\(1, 3, ", assume_same_layout=True)  # two blocks of data for one id
    _refused(cache, [0, 1], good.view(torch.int8), "int8", assume_same_layout=True)
    _refused(cache, [0, 1], good.tolist(), "list")


def test_restore_refuses_same_shaped_data_of_another_format_named_by_its_deprecated_transfer_format() -> None:
    nhd = allocate(make_plan(layout="LBNHC", kv_cache_dtype="int8_per_token_head"))
    hnd = allocate(make_plan(layout="LBHNC", kv_cache_dtype="int8_per_token_head"))
    data = nhd.offload([1]).data
    assert data.shape == hnd.offload([1]).data.shape
    with pytest.warns(DeprecationWarning, match="source_format"):
        _refused(hnd, [1], data, "cannot be restored", source_format=nhd.transfer_format)
    with pytest.warns(DeprecationWarning, match="source_format"):
        hnd.restore([1], hnd.offload([1]).data, source_format=hnd.transfer_format)  # still restores its own


def test_deprecated_source_format_refuses_per_tensor_fp8_codes_of_another_format() -> None:
    """TRITON_ATTN writes per-tensor fp8 codes as e4m3 in an ``fp8_e5m2`` cache, FLASHINFER as e5m2: the same
    plan and rows, other values (up to 4.0 apart). `OffloadedBlocks` are refused; so are their bare bytes
    named by the writer's deprecated ``transfer_format``, where they were copied as is."""
    triton = allocate(make_plan("TRITON_ATTN", kv_cache_dtype="fp8_e5m2"))
    flashinfer = allocate(make_plan("FLASHINFER", kv_cache_dtype="fp8_e5m2"))
    assert triton.block_format == flashinfer.block_format
    key = torch.randn(3, 2, 8) * 3
    triton.write(0, key, -key, torch.tensor([4, 5, 6]))  # block 1
    blocks = triton.offload([1])
    _refused(flashinfer, [1], blocks, "backend: source TRITON_ATTN, target FLASHINFER")
    with pytest.warns(DeprecationWarning, match="source_format"):
        _refused(flashinfer, [1], blocks.data, "cannot be restored", source_format=triton.transfer_format)
    with pytest.warns(DeprecationWarning, match="source_format"):
        triton.restore([2], blocks.data, source_format=triton.transfer_format)  # its own format still restores
    assert torch.equal(triton.offload([2]).data, blocks.data)
    with warnings.catch_warnings():  # and FLASHINFER's own blocks into FLASHINFER
        warnings.simplefilter("ignore", DeprecationWarning)
        flashinfer.restore([2], flashinfer.offload([1]).data, source_format=flashinfer.transfer_format)


def test_offload_refuses_an_out_that_reaches_the_cache_through_another_storage() -> None:
    """An ``out`` over the cache's own bytes through a storage object of its own (here ``torch.frombuffer``
    at an address inside the cache's buffer) is refused by name, and the cache keeps every byte."""
    cache = allocate(make_plan(layout="LBNHC", kv_cache_dtype="int8_per_token_head"))
    fill_random(cache, seed=4)
    layers, page = cache.plan.num_layers, cache.plan.page_size_bytes
    raw = cache.raw[0]
    for start in (page, raw.numel() - layers * page, 0):
        memory = (ctypes.c_uint8 * (layers * page)).from_address(raw.data_ptr() + start)
        out = torch.frombuffer(memory, dtype=torch.uint8).view(1, layers, page)
        assert start == 0 or out.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()
        before = [r.clone() for r in cache.raw]
        with pytest.raises(InputError, match="`out` is a view of this cache") as exc:
            cache.offload([2], out=out)
        assert exc.value.diagnostics[0].file == "out"
        assert all(torch.equal(r, b) for r, b in zip(cache.raw, before, strict=True)), start
    apart = torch.empty(1, layers, page, dtype=torch.uint8)  # memory of its own: filled
    assert torch.equal(cache.offload([2], out=apart).data[0], expected_rows(cache, 2))


@pytest.mark.parametrize(("block_ids", "match"), [([0, 5], "out of range"), ([-1], "out of range"),
                                                 ([1, 1], "same block twice"), ([0.5], "sequence of ints"),
                                                 (torch.tensor([[0]]), "1-D")])
def test_restore_refuses_bad_block_ids(block_ids: object, match: str) -> None:
    cache = allocate(make_plan())
    n = len(block_ids)
    data = torch.zeros(n, 3, cache.plan.page_size_bytes, dtype=torch.uint8)
    _refused(cache, block_ids, data, match)


def test_offload_refuses_bad_block_ids_and_meta_caches() -> None:
    cache = allocate(make_plan())
    with pytest.raises(InputError, match="out of range"):
        cache.offload([NUM_BLOCKS])
    with pytest.raises(InputError, match="meta"):
        allocate(make_plan(), "meta").offload([0])


def test_offload_fills_a_preallocated_buffer_and_checks_it() -> None:
    cache = allocate(make_plan(layout="LBHNC", kv_cache_dtype="int4_per_token_head"))
    fill_random(cache)
    out = torch.zeros(2, 3, cache.plan.page_size_bytes, dtype=torch.uint8)
    assert cache.offload([4, 1], out=out).data is out
    assert torch.equal(out[0], expected_rows(cache, 4)) and torch.equal(out[1], expected_rows(cache, 1))
    with pytest.raises(InputError, match="`out`"):
        cache.offload([4], out=out)
    with pytest.raises(InputError, match="`out`"):
        cache.offload([4, 1], out=out.transpose(0, 1).contiguous().transpose(0, 1))


def test_transfers_through_the_caches_own_memory() -> None:
    """`out` (offload) or `data` (restore) viewing the cache's own bytes: torch's index ops raised a bare
    RuntimeError ("some elements of the input tensor and the written-to tensor refer to a single memory
    location"). Offloading into the cache is refused by name; restoring from it copies the data first."""
    cache = allocate(make_plan(layout="LBNHC", kv_cache_dtype="int8_per_token_head", num_blocks=NUM_BLOCKS))
    fill_random(cache, seed=4)
    shape = (1, cache.plan.num_layers, cache.plan.page_size_bytes)
    inside = cache.raw[0][: shape[1] * shape[2]].view(shape)
    before = [r.clone() for r in cache.raw]
    with pytest.raises(InputError, match="`out` is a view of this cache"):
        cache.offload([2], out=inside)
    assert all(torch.equal(r, b) for r, b in zip(cache.raw, before, strict=True))
    want = inside.clone()
    cache.restore([3], inside, assume_same_layout=True)
    assert torch.equal(cache.offload([3]).data, want)


def test_restore_refuses_blocks_of_a_model_whose_groups_differ() -> None:
    """Two caches of one plan (same layout, spec and rows) for models whose KV cache groups differ (a
    sliding-window group beside the full one): their blocks belong to other models, so a restore between
    them is refused naming ``groups`` (it was copied as is when the cell format left the groups out), and
    each cache still restores its own."""
    engine = LayoutEngine.default("vllm-0.34")
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_size=64)
    window = spec.model_copy(update={"kind": AttentionKind.sliding_window, "sliding_window": 128})
    full, hybrid = (engine.build(num_blocks=4, groups=KVCacheGroups(groups=tuple(KVCacheGroup(spec=s) for s in specs)),
                                 attention_backend="TRITON_ATTN") for specs in ((spec,), (spec, window)))
    assert full.plan == hybrid.plan and full.block_format == hybrid.block_format
    fill_random(full, seed=5)
    fill_random(hybrid, seed=6)
    _refused(hybrid, [1], full.offload([1]), "groups: source")
    _refused(full, [1], hybrid.offload([1]), "groups: source")
    _refused(hybrid, [1], full.offload([1]).data, "groups: source", source=full.fingerprint)
    assert hybrid.restore([2], hybrid.offload([1])).kind.value == "as_is"
