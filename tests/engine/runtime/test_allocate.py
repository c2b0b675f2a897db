"""kvpolicy.engine.runtime.allocate: tensors that are exactly the plan.

Also home of the runtime tests' factories (`make_spec`, `make_plan`, `COMBOS`,
`fill_random`, `cell_addresses`), imported by the sibling test modules.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.engine.plan import LayoutPlan, plan_layout
from kvpolicy.engine.runtime import KVCache, allocate
from kvpolicy.policy.backends import BACKENDS
from kvpolicy.policy.errors import GeometryError, InputError
from kvpolicy.policy.layouts import Layout, Placement
from kvpolicy.policy.quant import KV_CACHE_DTYPES
from kvpolicy.policy.spec import AttentionKind, KVCacheSpec

NUM_BLOCKS = 5


def make_spec(
    *,
    kv_cache_dtype: str = "auto",
    mla: bool = False,
    num_layers: int = 3,
    block_size: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 8,
    pad: int = 0,
) -> KVCacheSpec:
    """A small spec; ``pad`` extra bytes per page set ``page_size_padded``."""
    fields = dict(
        kind=AttentionKind.mla if mla else AttentionKind.full,
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=1 if mla else num_kv_heads,
        head_size=head_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    spec = KVCacheSpec(**fields)
    return KVCacheSpec(**fields, page_size_padded=spec.real_page_size_bytes + pad) if pad else spec


def make_plan(backend: str = "TRITON_ATTN", layout: str = "LBNHC", num_blocks: int = NUM_BLOCKS,
              **spec_fields: object) -> LayoutPlan:
    profile = BACKENDS[backend]
    return plan_layout(Layout.parse(layout), make_spec(mla=profile.mla, **spec_fields), profile, num_blocks)


# the kv_cache_dtypes the runtime writes (nvfp4 is planned for vLLM 0.34's FLASHINFER only, never allocated)
RUNTIME_DTYPES = tuple(d for d in KV_CACHE_DTYPES if not d.startswith("nvfp4"))


def _combos() -> list[tuple[str, str, str]]:
    out = []
    for name, profile in BACKENDS.items():
        for placement in Placement:
            for order in profile.head_orders:
                for dtype in RUNTIME_DTYPES:
                    out.append((name, f"{placement.value}/{order.value}", dtype))
    return out


# every backend x head order it supports x placement x kv_cache_dtype
COMBOS = _combos()
COMBO_IDS = [f"{b}-{lay.replace('/', '-')}-{d}" for b, lay, d in COMBOS]

# geometries off the easy path: odd cells (2- and 1-byte word fallbacks) and padded pages
ODD = [
    # (per-token-head cells are multiples of 4 bytes: vLLM views their scales as float32)
    dict(head_size=5, kv_cache_dtype="auto"),  # bf16 cell 10 B: 2-byte words
    dict(head_size=5, kv_cache_dtype="fp8"),  # cell 5 B: bytes
    dict(head_size=3, kv_cache_dtype="fp8_e5m2"),  # cell 3 B
    dict(kv_cache_dtype="int4_per_token_head", pad=1),  # 8-byte cells, odd page
    dict(kv_cache_dtype="auto", pad=6),  # bf16 page + 6 B
    dict(kv_cache_dtype="int8_per_token_head", pad=3),
    dict(kv_cache_dtype="int4_per_token_head", pad=64),
    dict(kv_cache_dtype="fp8_per_token_head", num_kv_heads=3, pad=8),
]
ODD_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BHLNC"]


def fill_random(cache: KVCache, seed: int = 0) -> None:
    """Random bytes everywhere, padding included, so untouched bytes are recognisable."""
    gen = torch.Generator().manual_seed(seed)
    for raw in cache.raw:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def cell_addresses(plan: LayoutPlan, layer: int, slots: list[int]) -> torch.Tensor:
    """Byte addresses (kv_factor, T, H, cell_bytes) of ``layer``'s cells at ``slots``, from the plan alone."""
    spec, v, elem = plan.spec, plan.layers[layer].view, plan.element_size
    numel = plan.buffers[v.buffer].nbytes // elem
    elements = torch.arange(numel).as_strided(v.shape, v.strides, v.storage_offset)
    if "kv" not in v.dims:  # MLA (block, token, dim): add the kv and head dims of size 1
        elements = elements.unsqueeze(1).unsqueeze(3)
    blocks = torch.tensor([s // spec.block_size for s in slots], dtype=torch.int64)
    offsets = torch.tensor([s % spec.block_size for s in slots], dtype=torch.int64)
    cells = elements[blocks, :, offsets]  # (T, kv, H, D')
    cells = cells.permute(1, 0, 2, 3)
    return (cells.unsqueeze(-1) * elem + torch.arange(elem)).flatten(-2)


def expected_view(plan: LayoutPlan, layer: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Layer ``layer``'s (shape, stride, offset) the way vLLM builds it: permute a contiguous physical tensor."""
    physical = list(plan.physical_dims)
    buf = plan.buffers[0]
    t = torch.empty(buf.shape, dtype=torch.uint8, device="meta")
    logical = list(plan.layers[layer].view.dims)
    if "layer" in physical:
        t = t.permute([physical.index(d) for d in ["layer", *logical]])[layer]
    else:
        t = t.permute([physical.index(d) for d in logical])
    return tuple(t.shape), t.stride(), t.storage_offset()


@pytest.mark.parametrize(("backend", "layout", "dtype"), COMBOS, ids=COMBO_IDS)
def test_allocated_tensors_are_exactly_the_plan(backend: str, layout: str, dtype: str) -> None:
    plan = make_plan(backend, layout, kv_cache_dtype=dtype)
    cache = allocate(plan)
    assert sum(r.untyped_storage().nbytes() for r in cache.raw) == plan.total_bytes
    for bp, buf in zip(plan.buffers, cache.buffers, strict=True):
        assert (tuple(buf.shape), buf.stride(), buf.storage_offset()) == (bp.shape, bp.strides, 0)
        assert str(buf.dtype) == f"torch.{plan.spec.cache_dtype.value}"
        assert bp.strides == expected_strides_contiguous(bp.shape)
    for lp in plan.layers:
        view = cache.layer_view(lp.layer)
        got = (tuple(view.shape), view.stride(), view.storage_offset())
        assert got == (lp.view.shape, lp.view.strides, lp.view.storage_offset)
        assert got == expected_view(plan, lp.layer)
        assert view.untyped_storage().data_ptr() == cache.raw[lp.view.buffer].untyped_storage().data_ptr()
    cache.verify(geometry=False)  # every combo, the unsafe ones too: tensors vs plan


def expected_strides_contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


@pytest.mark.parametrize("layout", ODD_LAYOUTS)
@pytest.mark.parametrize("geo", ODD, ids=[str(g) for g in ODD])
def test_padded_and_odd_plans_allocate_exactly(layout: str, geo: dict) -> None:
    plan = make_plan("TRITON_ATTN", layout, **geo)
    cache = allocate(plan)
    assert sum(r.numel() for r in cache.raw) == plan.total_bytes
    for lp in plan.layers:
        view = cache.layer_view(lp.layer)
        assert (tuple(view.shape), view.stride(), view.storage_offset()) == (
            lp.view.shape, lp.view.strides, lp.view.storage_offset)


def test_vllm_sized_plan_allocates_on_meta_without_memory() -> None:
    spec = KVCacheSpec(num_layers=80, block_size=16, num_kv_heads=8, head_size=128)
    plan = plan_layout(Layout.parse("BHLNC"), spec, BACKENDS["TRITON_ATTN"], 8724)
    cache = allocate(plan, "meta")
    assert tuple(cache.buffers[0].shape) == (8724, 8, 80, 2, 16, 128)
    assert cache.raw[0].device.type == "meta" and cache.raw[0].numel() == plan.total_bytes
    cache.verify()


def test_verify_notices_a_view_that_no_longer_matches() -> None:
    cache = allocate(make_plan(layout="BLNHC"))
    views = list(cache._views)
    views[1] = cache.raw[0].view(torch.bfloat16).as_strided(views[1].shape, views[1].stride(), 0)
    cache._views = tuple(views)
    with pytest.raises(GeometryError, match=r"layer\[1\]"):
        cache.verify()


def test_decision_is_settable_and_defaults_to_none() -> None:
    cache = allocate(make_plan())
    assert cache.decision is None
    cache.decision = "chosen"
    assert cache.decision == "chosen"


@pytest.mark.parametrize("device", ["tpu", "banana", 3.5])
def test_unknown_devices_are_refused(device: object) -> None:
    with pytest.raises(InputError, match="device"):
        allocate(make_plan(), device)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="CUDA is not available"):
        allocate(make_plan(), "cuda")


def test_the_public_surface_is_explicit() -> None:
    import kvpolicy.engine.plan
    import kvpolicy.engine.runtime

    assert sorted(kvpolicy.engine.runtime.__all__) == ["KVCache", "OffloadedBlocks", "allocate", "decode_cells",
                                                       "encode_cells"]
    assert {"LayoutPlan", "plan_layout", "transfer_format"} <= set(kvpolicy.engine.plan.__all__)
    assert "naive_scale_view" not in kvpolicy.engine.plan.__all__  # a model of old backends, used by the verifier
