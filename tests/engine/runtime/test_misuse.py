"""Misuse of the runtime's public calls: every user-caused failure is an `InputError` naming the argument.

Table-driven (one row a case, named by its note): the call, the argument the error must
name. Every rejected call leaves the cache's bytes as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_allocate import fill_random, make_plan, make_spec

from kvpolicy.engine import LayoutEngine, fingerprint_of
from kvpolicy.engine.runtime import KVCache, allocate
from kvpolicy.policy.backends import BACKENDS
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout

PAGE = make_plan(layout="LBNHC", kv_cache_dtype="fp8").page_size_bytes


def cache() -> KVCache:
    c = allocate(make_plan(layout="LBNHC", kv_cache_dtype="fp8", num_blocks=5))
    fill_random(c)
    return c


def kv(t: int = 1, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.ones(t, 2, 8, dtype=dtype)


def data(n: int = 1) -> torch.Tensor:
    return torch.zeros(n, 3, PAGE, dtype=torch.uint8)


S0 = torch.tensor([0])
Call = Callable[[KVCache], Any]

CASES: list[tuple[str, Call, str]] = [
    # block ids: offload and restore
    ("block id 2**70", lambda c: c.offload([2**70]), "block_ids"),
    ("block id 2**63", lambda c: c.restore([2**63], data()), "block_ids"),
    ("block id -1", lambda c: c.offload([-1]), "block_ids"),
    ("block id past the end", lambda c: c.offload([5]), "block_ids"),
    ("block id True", lambda c: c.offload([True]), "block_ids"),
    ("block id 1.0", lambda c: c.restore([1.0], data()), "block_ids"),
    ("block ids a string", lambda c: c.offload("12"), "block_ids"),
    ("block ids an int", lambda c: c.offload(3), "block_ids"),
    ("block ids a float tensor", lambda c: c.offload(torch.tensor([1.0])), "block_ids"),
    ("block ids a bool tensor", lambda c: c.offload(torch.tensor([True])), "block_ids"),
    ("block ids 2-D", lambda c: c.offload(torch.tensor([[1]])), "block_ids"),
    ("block id 2**62 in a tensor", lambda c: c.offload(torch.tensor([2**62])), "block_ids"),
    ("block ids on meta", lambda c: c.offload(torch.tensor([0], device="meta")), "block_ids"),
    ("restore a block twice", lambda c: c.restore([1, 1], data(2), assume_same_layout=True), "block_ids"),
    # transfer data
    ("restore data of another page size", lambda c: c.restore([0], torch.zeros(1, 3, PAGE + 1, dtype=torch.uint8),
                                                              assume_same_layout=True),
     "data"),
    ("restore float data", lambda c: c.restore([0], data().float(), assume_same_layout=True), "data"),
    ("restore bytes nothing binds to a layout", lambda c: c.restore([0], data()), "data"),
    ("restore bytes with two bindings", lambda c: c.restore([0], data(), source=c.fingerprint,
                                                            assume_same_layout=True), "source"),
    ("restore offloaded blocks with a source", lambda c: c.restore([0], c.offload([0]), source=c.fingerprint),
     "source"),
    ("restore bytes with a source that is no fingerprint", lambda c: c.restore([0], data(), source=["x"]),
     "source"),
    ("restore bytes of another cell format", lambda c: c.restore([0], data(), source=fingerprint_of(
        Layout.LBNHC, make_spec(kv_cache_dtype="int8_per_token_head"), BACKENDS["TRITON_ATTN"])), "data"),
    ("restore a list", lambda c: c.restore([0], [0] * PAGE), "data"),
    ("restore data on meta", lambda c: c.restore([0], data().to("meta"), assume_same_layout=True), "data"),
    ("offload into a wrong shape", lambda c: c.offload([0], out=data(2)), "out"),
    ("offload into a string", lambda c: c.offload([0], out="x"), "out"),
    ("restore another format (deprecated)", lambda c: c.restore([0], data(), source_format="other"),
     "source_format"),
    # slots
    ("slots a list", lambda c: c.write(0, kv(), kv(), [0]), "slot_mapping"),
    ("slots float", lambda c: c.write(0, kv(), kv(), torch.tensor([0.0])), "slot_mapping"),
    ("slots bool", lambda c: c.read(0, torch.tensor([True])), "slot_mapping"),
    ("slots int16", lambda c: c.write(0, kv(), kv(), torch.tensor([0], dtype=torch.int16)), "slot_mapping"),
    ("slots 2-D", lambda c: c.read(0, torch.tensor([[0]])), "slot_mapping"),
    ("slots on meta", lambda c: c.write(0, kv(), kv(), S0.to("meta")), "slot_mapping"),
    ("slot 2**62", lambda c: c.write(0, kv(), kv(), torch.tensor([2**62])), "slot_mapping"),
    ("slot past the end", lambda c: c.read(0, torch.tensor([20])), "slot_mapping"),
    ("negative slot in a read", lambda c: c.read(0, torch.tensor([-1])), "slot_mapping"),
    ("one slot for two tokens", lambda c: c.write(0, kv(2), kv(2), S0), "slot_mapping"),
    ("a slot twice", lambda c: c.write(0, kv(2), kv(2), torch.tensor([3, 3])), "slot_mapping"),
    # values
    ("key a list", lambda c: c.write(0, [[0.0]], kv(), S0), "key"),
    ("key int32", lambda c: c.write(0, kv().int(), kv(), S0), "key"),
    ("key float64", lambda c: c.write(0, kv().double(), kv(), S0), "key"),
    ("key of another head count", lambda c: c.write(0, torch.ones(1, 3, 8), kv(), S0), "key"),
    ("key 2-D", lambda c: c.write(0, torch.ones(2, 8), kv(), S0), "key"),
    ("key on meta", lambda c: c.write(0, kv().to("meta"), kv(), S0), "key"),
    ("value of another dtype", lambda c: c.write(0, kv(), kv(dtype=torch.float16), S0), "value"),
    ("value None on a K/V cache", lambda c: c.write(0, kv(), None, S0), "value"),
    ("keys of another layer count", lambda c: c.write_layers(torch.ones(2, 1, 2, 8), torch.ones(2, 1, 2, 8), S0),
     "keys"),
    # layers, read dtype, scales
    ("layer 2**70", lambda c: c.write(2**70, kv(), kv(), S0), "layer"),
    ("layer -1", lambda c: c.read(-1, S0), "layer"),
    ("layer True", lambda c: c.read(True, S0), "layer"),
    ("layer 1.0", lambda c: c.layer_view(1.0), "layer"),
    ("read into int32", lambda c: c.read(0, S0, torch.int32), "dtype"),
    ("read into a string", lambda c: c.read(0, S0, "bfloat16"), "dtype"),
    ("k_scale 0", lambda c: c.set_tensor_scales(0, 0.0, 1.0), "k_scale"),
    ("k_scale NaN", lambda c: c.set_tensor_scales(0, math.nan, 1.0), "k_scale"),
    ("v_scale -inf", lambda c: c.set_tensor_scales(0, 1.0, -math.inf), "v_scale"),
    ("k_scale 1e39: finite in float64, infinite in fp32", lambda c: c.set_tensor_scales(0, 1e39, 1.0), "k_scale"),
    ("k_scale 10**400: no float at all", lambda c: c.set_tensor_scales(0, 10**400, 1.0), "k_scale"),
    ("v_scale 1e-46: zero in fp32", lambda c: c.set_tensor_scales(0, 1.0, 1e-46), "v_scale"),
    ("v_scale 1e-40: subnormal in fp32", lambda c: c.set_tensor_scales(0, 1.0, 1e-40), "v_scale"),
    ("k_scale a string", lambda c: c.set_tensor_scales(0, "1", 1.0), "k_scale"),
    ("k_scale True", lambda c: c.set_tensor_scales(0, True, 1.0), "k_scale"),
    ("scale of layer 3", lambda c: c.set_tensor_scales(3, 1.0, 1.0), "layer"),
]


@pytest.mark.filterwarnings("ignore:restore.*source_format.*deprecated:DeprecationWarning")
@pytest.mark.parametrize(("note", "call", "argument"), CASES, ids=[c[0] for c in CASES])
def test_misuse_is_an_input_error_naming_the_argument(note: str, call: Call, argument: str) -> None:
    c = cache()
    before = [r.clone() for r in c.raw]
    scales = (c.k_scales, c.v_scales)
    with pytest.raises(InputError) as info:
        call(c)
    assert [d.file for d in info.value.diagnostics] == [argument], str(info.value)
    assert all(torch.equal(r, b) for r, b in zip(c.raw, before, strict=True)), "a rejected call changed the cache"
    assert (c.k_scales, c.v_scales) == scales


@pytest.mark.parametrize("num_blocks", [2**62, 2**61 + 1, 2**63 - 1])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_block_count_no_tensor_can_hold_is_an_input_error(num_blocks: int, device: str) -> None:
    """build(num_blocks=2**62) was a TypeError from torch.zeros (its sizes are int64)."""
    with pytest.raises(InputError) as info:
        LayoutEngine.default().build(num_blocks=num_blocks, device=device, backend="TRITON_ATTN",
                                     spec=dict(num_layers=2, block_size=16, num_kv_heads=2, head_size=64))
    assert info.value.diagnostics[0].file == "num_blocks" and "more than a tensor can hold" in str(info.value)
    with pytest.raises(InputError, match="num_blocks"):
        allocate(make_plan(num_blocks=num_blocks), device)


def test_scales_that_round_to_a_normal_fp32_are_taken_and_read_back_finite() -> None:
    """Checked in fp32, where the cache computes: a float64 a hair above fp32's max that rounds to it
    is fp32's max (accepted); 1e39 rounds to infinity (refused, above)."""
    c = allocate(make_plan(layout="LBNHC", kv_cache_dtype="fp8", num_blocks=5))
    just_above = float.fromhex("0x1.fffffe0000001p+127")  # rounds down to fp32's max
    c.set_tensor_scales(0, just_above, 1.0)
    x = torch.full((1, 2, 8), 3.0e38)
    c.write(0, x, x, S0)
    k, v = c.read(0, S0, torch.float32)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
