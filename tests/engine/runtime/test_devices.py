"""kvpolicy.engine.runtime on every device torch can see: the same plan, the same bytes.

Every test takes ``device``: ``cpu`` always, ``cuda`` where torch sees a GPU
(skipped otherwise). The CPU is the reference: a cache on ``device`` and one on
the CPU get the same random bytes and the same calls, and must then hold the
same bytes, byte for byte (the quantization arithmetic is fixed so that any
device gives the same bits: engine/runtime/quantize.py). On ``cpu`` that
compares the CPU with itself, which still runs every path below; the float64
reference checks of the CPU are in test_cache.py. Nothing here branches on
CUDA beyond choosing the device (and pinning a preallocated offload buffer,
which only a GPU transfer can use). ``meta`` caches have geometry only.

On a GPU machine: ``python3 -m pytest -q tests/engine/runtime -k "cuda or devices"``
(bench/gpu_check.sh runs it).
"""

from __future__ import annotations

import pytest
import torch
from test_allocate import fill_random, make_plan

from kvpolicy.engine.runtime import KVCache, allocate
from kvpolicy.policy.errors import InputError

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="torch sees no CUDA device (torch.cuda.is_available())")),
]
WRITE_DTYPES = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "auto"]
LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BHLNC"]
# slot mappings for write(): decode-sized with a skipped token (Python path), then over 64 slots
# (tensor path), then 20 whole blocks in token order (the block-wise prefill scatter on NHD)
SLOTS = {
    "few": [0, 7, -1, 19, 10, 5],
    "many": [*range(0, 140, 2), -1, 151],
    "blocks": [b * 4 + t for b in (9, 2, 31, 0, 17, 5, 22, 38, 11, 3, 27, 14, 6, 35, 19, 1, 24, 8, 30, 13)
               for t in range(4)],
}
NUM_BLOCKS = 40


def on(device: str, cpu_cache: KVCache) -> KVCache:
    """A cache of the same plan on ``device`` holding the CPU cache's bytes."""
    cache = allocate(cpu_cache.plan, device)
    for dst, src in zip(cache.raw, cpu_cache.raw, strict=True):
        dst.copy_(src)
    return cache


def random_cache(device: str, seed: int = 0, **plan_fields: object) -> tuple[KVCache, KVCache]:
    """(CPU cache, the same on ``device``), both holding the same random bytes, padding included."""
    cpu = allocate(make_plan(num_blocks=NUM_BLOCKS, **plan_fields))
    fill_random(cpu, seed)
    return cpu, on(device, cpu)


def assert_same_bytes(cache: KVCache, cpu: KVCache) -> None:
    for i, (r, ref) in enumerate(zip(cache.raw, cpu.raw, strict=True)):
        got = r.cpu()
        if not torch.equal(got, ref):
            bad = torch.nonzero(got != ref).flatten()
            raise AssertionError(f"buffer {i}: {bad.numel()} bytes differ from the CPU's, first at byte "
                                 f"{int(bad[0])}: {int(got[bad[0]])} vs {int(ref[bad[0]])}")


def inputs(cache: KVCache, shape_prefix: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, seed: int = 1
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU K and V of shape (*shape_prefix, H, D); some heads all zero, some with a large outlier."""
    spec = cache.plan.spec
    gen = torch.Generator().manual_seed(seed)
    shape = (*shape_prefix, spec.num_kv_heads, spec.head_size)
    key = torch.randn(shape, generator=gen) * 2
    value = torch.randn(shape, generator=gen) * 0.5
    key.view(-1, spec.head_size)[::5] = 0.0
    value.view(-1, spec.head_size)[1::7, 0] = 1e4
    return key.to(dtype), value.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU as integers of its width: compares values bit for bit (signed zeros, NaNs too)."""
    return t.cpu().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- allocate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["auto", "int8_per_token_head", "int4_per_token_head"])
@pytest.mark.parametrize("device", [*DEVICES, "meta"])
def test_allocate_matches_the_plan_on_the_device(device: str, dtype: str, layout: str) -> None:
    plan = make_plan(layout=layout, kv_cache_dtype=dtype, pad=6 if dtype == "auto" else 0)
    cache = allocate(plan, device)
    assert cache.device.type == device and all(r.device == cache.device for r in cache.raw)
    assert sum(r.numel() for r in cache.raw) == plan.total_bytes
    for bp, buf in zip(plan.buffers, cache.buffers, strict=True):
        assert buf.device == cache.device
        assert (tuple(buf.shape), buf.stride(), buf.storage_offset()) == (bp.shape, bp.strides, 0)
    for lp in plan.layers:
        view = cache.layer_view(lp.layer)
        assert view.device == cache.device
        assert (tuple(view.shape), view.stride(), view.storage_offset()) == (
            lp.view.shape, lp.view.strides, lp.view.storage_offset)
    cache.verify(geometry=False)  # tensors vs plan; the plan's own geometry does not depend on the device
    # decode-sized writes off the CPU never wait for the device (test_sync_free.py proves the path)
    assert cache.sync_free_decode == (device != "cpu")
    if device != "meta":
        assert sum(r.untyped_storage().nbytes() for r in cache.raw) == plan.total_bytes
        assert all(int(r.count_nonzero()) == 0 for r in cache.raw), "a fresh cache is zeroed"


# ---- writes and reads: the device's bytes are the CPU's ----------------------------------------


@pytest.mark.parametrize("slots", list(SLOTS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", WRITE_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_write_then_read_is_bit_exact_against_the_cpu(device: str, dtype: str, layout: str, slots: str) -> None:
    cpu, cache = random_cache(device, kv_cache_dtype=dtype, layout=layout)
    slot_list = SLOTS[slots]
    key, value = inputs(cpu, (len(slot_list),))
    slot_t = torch.tensor(slot_list)
    cpu.write(1, key, value, slot_t)
    cache.write(1, key.to(device), value.to(device), slot_t.to(device))
    assert_same_bytes(cache, cpu)

    kept = torch.tensor([s for s in slot_list if s >= 0])
    for out_dtype in (None, torch.float32):
        want_k, want_v = cpu.read(1, kept, dtype=out_dtype)
        got_k, got_v = cache.read(1, kept.to(device), dtype=out_dtype)
        assert got_k.device == cache.device and got_v is not None and got_v.device == cache.device
        assert got_k.dtype == want_k.dtype
        assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_write_of_several_chunks_is_bit_exact_against_the_cpu(device: str, dtype: str) -> None:
    """Over `quantize.CHUNK_VALUES` values: the encode runs chunk by chunk through reused scratch."""
    fields = dict(kv_cache_dtype=dtype, layout="LBNHC", num_layers=2, num_kv_heads=8, head_size=128,
                  block_size=16)
    cpu = allocate(make_plan(num_blocks=160, **fields))
    fill_random(cpu, 4)
    cache = on(device, cpu)
    tokens = 1200  # 2 x 1200 x 8 x 128 values: three chunks
    key, value = inputs(cpu, (tokens,), torch.float16, seed=6)
    slot_t = torch.randperm(160 * 16, generator=torch.Generator().manual_seed(7))[:tokens]
    cpu.write(0, key, value, slot_t)
    cache.write(0, key.to(device), value.to(device), slot_t.to(device))
    assert_same_bytes(cache, cpu)


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("dtype", WRITE_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_write_layers_is_bit_exact_against_the_cpu(device: str, dtype: str, layout: str, tokens: int) -> None:
    cpu, cache = random_cache(device, seed=2, kv_cache_dtype=dtype, layout=layout)
    keys, values = inputs(cpu, (cpu.plan.num_layers, tokens), seed=3)
    slots = torch.randperm(NUM_BLOCKS * 4, generator=torch.Generator().manual_seed(tokens))[:tokens]
    if tokens > 1:
        slots[1] = -1
    cpu.write_layers(keys, values, slots)
    cache.write_layers(keys.to(device), values.to(device), slots.to(device))
    assert_same_bytes(cache, cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_per_tensor_fp8_scales_give_the_cpu_bytes(device: str) -> None:
    cpu, cache = random_cache(device, kv_cache_dtype="fp8_e4m3", layout="BLNHC")
    for c in (cpu, cache):
        c.set_tensor_scales(2, 0.03, 7.0)
    key, value = inputs(cpu, (4,))
    slots = torch.tensor([3, 17, 8, 30])
    cpu.write(2, key, value, slots)
    cache.write(2, key.to(device), value.to(device), slots.to(device))
    assert_same_bytes(cache, cpu)
    assert torch.equal(_bits(cache.read(2, slots.to(device))[0]), _bits(cpu.read(2, slots)[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_on_another_device_are_refused_and_change_nothing(device: str) -> None:
    other = "meta" if device == "cpu" else "cpu"
    cpu, cache = random_cache(device, kv_cache_dtype="int8_per_token_head")
    key, value = inputs(cpu, (2,))
    slots = torch.tensor([1, 2])
    with pytest.raises(InputError, match="the cache is on"):
        cache.write(0, key.to(other), value.to(other), slots.to(device))
    with pytest.raises(InputError, match="slot_mapping"):
        cache.write(0, key.to(device), value.to(device), slots.to(other))
    with pytest.raises(InputError, match="slot_mapping"):
        cache.read(0, slots.to(other))
    assert_same_bytes(cache, cpu)


# ---- offload and restore ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["auto", "int8_per_token_head", "int4_per_token_head"])
@pytest.mark.parametrize("device", DEVICES)
def test_offload_restore_is_byte_exact_on_the_device(device: str, dtype: str, layout: str) -> None:
    cpu, cache = random_cache(device, seed=5, kv_cache_dtype=dtype, layout=layout, pad=6)
    ids = [31, 0, 7, 39, 12]
    blocks = cache.offload(ids)
    data = blocks.data
    assert data.device.type == "cpu" and data.dtype == torch.uint8
    assert data.is_pinned() == (cache.device.type == "cuda"), "offload from a GPU returns pinned memory"
    assert torch.equal(data, cpu.offload(ids).data)

    for r in cache.raw:  # clear, restore from CPU (pinned) data: every byte comes back
        r.zero_()
    cache.restore(ids, blocks)
    others = [b for b in range(NUM_BLOCKS) if b not in ids]
    assert torch.equal(cache.offload(ids).data, data)
    assert int(cache.offload(others).data.count_nonzero()) == 0, "restore wrote outside its blocks"

    for r in cache.raw:  # restore from data already on the device, into other blocks
        r.zero_()
    cache.restore(torch.tensor([1, 2, 3, 4, 5]).to(device), data.to(device), source=cpu.fingerprint)
    assert torch.equal(cache.offload([1, 2, 3, 4, 5]).data, data)


@pytest.mark.parametrize("device", DEVICES)
def test_offload_fills_a_preallocated_buffer_on_the_device(device: str) -> None:
    cpu, cache = random_cache(device, seed=6, kv_cache_dtype="fp8_per_token_head", layout="LBHNC")
    # a GPU transfer can only fill a pinned buffer asynchronously; the CPU has no pinned memory to give
    out = torch.zeros(3, cpu.plan.num_layers, cpu.plan.page_size_bytes, dtype=torch.uint8,
                      pin_memory=cache.device.type == "cuda")
    ids = torch.tensor([2, 38, 20], dtype=torch.int32)
    blocks = cache.offload(ids.to(device), out=out)
    assert blocks.data is out
    assert torch.equal(out, cpu.offload(ids).data)
    with pytest.raises(InputError, match="`out`"):
        cache.offload(ids, out=out[:2])
    # a restored block reads back the values the CPU cache reads from it
    cache.restore([9, 10, 11], blocks)
    cpu.restore([9, 10, 11], blocks)
    slots = torch.arange(36, 48)
    got_k, got_v = cache.read(0, slots.to(device), dtype=torch.float32)
    want_k, want_v = cpu.read(0, slots, dtype=torch.float32)
    assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))


@pytest.mark.parametrize(("source", "target"), [("BLNHC", "LBHNC"), ("LBHNC", "BHLNC"), ("BHLNC", "LBNHC")])
@pytest.mark.parametrize("dtype", ["auto", "int8_per_token_head"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_transcoding_restore_on_the_device_writes_the_cpus_bytes(device: str, dtype: str, source: str,
                                                                  target: str) -> None:
    """Blocks of another layout (and page padding) restore on the device as on the CPU: the same strided copy."""
    src = allocate(make_plan(layout=source, kv_cache_dtype=dtype, num_blocks=NUM_BLOCKS))
    fill_random(src, seed=7)
    cpu, cache = random_cache(device, seed=8, kv_cache_dtype=dtype, layout=target, pad=4)
    ids, into = [3, 17, 0, 39], [5, 6, 30, 1]
    blocks = src.offload(ids)
    assert cache.restore(torch.tensor(into).to(device), blocks).kind.value == "transcode"
    assert cpu.restore(into, blocks).kind.value == "transcode"
    assert_same_bytes(cache, cpu)


# ---- meta ---------------------------------------------------------------------------------------


def test_a_meta_cache_has_the_geometry_and_refuses_data() -> None:
    plan = make_plan(layout="BHLNC", kv_cache_dtype="int4_per_token_head", num_blocks=NUM_BLOCKS)
    cache = allocate(plan, "meta")
    assert cache.device.type == "meta" and cache.raw[0].is_meta
    key = torch.zeros(1, 2, 8, device="meta")
    slots = torch.tensor([0], device="meta")
    calls = {
        "write": lambda: cache.write(0, key, key, slots),
        "write_layers": lambda: cache.write_layers(key.expand(3, 1, 2, 8), key.expand(3, 1, 2, 8), slots),
        "read": lambda: cache.read(0, slots),
        "offload": lambda: cache.offload([0]),
        "restore": lambda: cache.restore([0], torch.zeros(1, 3, plan.page_size_bytes, dtype=torch.uint8)),
    }
    for name, call in calls.items():
        with pytest.raises(InputError, match="meta"):
            call()
            pytest.fail(f"{name} on a meta cache was not refused")


def test_a_vllm_sized_plan_allocates_on_meta_without_memory() -> None:
    plan = make_plan(layout="LBNHC", kv_cache_dtype="int8_per_token_head", num_layers=80, block_size=16,
                     num_kv_heads=8, head_size=128, num_blocks=20000)
    cache = allocate(plan, "meta")  # about 54 GB: nothing is allocated
    assert sum(r.numel() for r in cache.raw) == plan.total_bytes > 40e9
    cache.verify()
