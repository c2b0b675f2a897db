"""A decode-sized write on a GPU never waits for the GPU: no ``.item()``, ``.tolist()``, ``nonzero``, ``bool()``.

Every cache off the CPU takes the sync-free path (``KVCache.sync_free_decode``, set for
any device but the CPU; test_devices.py checks it on CUDA). Proved on the CPU: under
``FakeTensorMode`` tensors have shapes and no values, and a fake tensor refuses every
operation whose result the host would have to wait for (``DataDependentOutputException``,
or an error for ``nonzero``'s data-dependent shape), so a write that completes there
decided nothing on values; the host-checked path, run the same way, fails. (The fake
tensors are CPU ones: this torch build cannot copy host data into a fake CUDA tensor,
and the path does not depend on the device.) The same path runs on real CPU tensors
and must leave the bytes the host-checked path leaves, skipped tokens included.
"""

from __future__ import annotations

import pytest
import torch
from test_allocate import fill_random, make_plan
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from kvpolicy.engine.runtime import KVCache, allocate, quantize

DTYPES = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "fp8", "auto"]
LAYOUTS = ["cross_layer/NHD", "per_layer/NHD", "per_layer/HND", "BHLNC"]
SLOTS = {
    "one": [13],
    "kept": [3, 17, 8, 30],
    "skips": [-1, 17, -1, 8, 30],
    "first-skipped-only": [-1, 5],
    "all-skipped": [-1, -1, -1],
    "one-skipped": [-1],
}


def _inputs(cache: KVCache, tokens: int, fake: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    spec = cache.plan.spec
    shape = (spec.num_layers, tokens, spec.num_kv_heads, spec.head_size)
    if fake:  # values do not exist, only shapes, dtypes and devices
        return torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(tokens)
    return (torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))


@pytest.mark.parametrize("slots", list(SLOTS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_device_path_writes_the_bytes_of_the_host_path(dtype: str, layout: str, slots: str) -> None:
    host = allocate(make_plan(layout=layout, kv_cache_dtype=dtype, num_blocks=10))
    if dtype == "fp8":
        host.set_tensor_scales(1, 0.5, 3.0)
    fill_random(host)
    device = allocate(host.plan)
    device.sync_free_decode = True
    for dst, src in zip(device.raw, host.raw, strict=True):
        dst.copy_(src)
    device.set_tensor_scales(1, *(host.k_scales[1], host.v_scales[1]))
    slot_mapping = torch.tensor(SLOTS[slots])
    keys, values = _inputs(host, len(SLOTS[slots]))
    for cache in (host, device):
        cache.write_layers(keys, values, slot_mapping)
        cache.write(1, keys[0], values[0], slot_mapping)
    for a, b in zip(host.raw, device.raw, strict=True):
        assert torch.equal(a, b)


def test_the_device_path_checks_slots_on_the_device_before_writing() -> None:
    cache = allocate(make_plan(kv_cache_dtype="int8_per_token_head"))
    cache.sync_free_decode = True
    fill_random(cache)
    before = [r.clone() for r in cache.raw]
    keys, values = _inputs(cache, 3)
    for bad, message in (([1, 2, cache.num_slots], "out of range"), ([4, -1, 4], "same slot twice")):
        with pytest.raises(RuntimeError, match=message):  # the CPU runs torch._assert_async at once
            cache.write_layers(keys, values, torch.tensor(bad))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.raw, strict=True))


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # allocate()'s verify()
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_write_off_the_cpu_never_waits_for_the_device(monkeypatch, dtype: str, layout: str) -> None:
    # module-level caches of device constants must not keep fake tensors after the test
    monkeypatch.setattr(quantize, "_CONSTANTS", {})
    monkeypatch.setattr(quantize, "_SIGNS", {})
    plan = make_plan(layout=layout, kv_cache_dtype=dtype, num_blocks=10)
    with FakeTensorMode():
        cache = allocate(plan)
        cache.sync_free_decode = True  # what every non-CPU cache has
        if dtype == "fp8":
            cache.set_tensor_scales(0, 0.5, 2.0)
        for tokens in (1, 4, 64):  # vLLM pads a decode batch with -1 slots; here values are unknown anyway
            keys, values = _inputs(cache, tokens, fake=True)
            slot_mapping = torch.empty(tokens, dtype=torch.int64)
            cache.write_layers(keys, values, slot_mapping)
            cache.write(0, keys[0], values[0], slot_mapping)
        # the proof can fail: the host-checked path reads the slots on the host
        cache.sync_free_decode = False
        with pytest.raises(DataDependentOutputException):
            cache.write_layers(keys, values, slot_mapping)
