"""A slow float64 reference for the cache cell encoding, and the fast path checked against it bit for bit.

The reference works on Python floats (IEEE float64), one value at a time,
following the arithmetic in `engine.runtime.quantize`'s docstring. An fp32
division is done in float64 and rounded once to fp32: for +, -, *, / that
double rounding is innocuous (53 >= 2 * 24 + 2), so it equals the fp32
operation. fp8 rounding and nibble packing are written out by hand.
Other runtime tests import `encode_ref` / `decode_ref` from here.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.quantize import decode_cells, encode_cells
from policy.quant import QuantMode

QMAX = {"fp8_per_token_head": 448.0, "int8_per_token_head": 127.0, "int4_per_token_head": 7.0}
# (mantissa bits, exponent bias, largest finite) of the two fp8 formats
FP8 = {"float8_e4m3fn": (3, 7, 448.0), "float8_e5m2": (2, 15, 57344.0)}
MIN_NORMAL = 2.0**-126  # the floor of per-token-head scales


def f32(x: float) -> float:
    """Round a float64 to the nearest fp32 (ties to even); overflow gives an infinity."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def fp8_byte(y: float, fmt: str) -> int:
    """Encode fp32 value ``y`` (already clamped to the finite range) as one fp8 byte, nearest-even."""
    man, bias, _ = FP8[fmt]
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    if a == 0:
        return sign
    exp = max(math.frexp(a)[1] - 1, 1 - bias)  # subnormals share the smallest normal exponent's quantum
    quantum = 2.0 ** (exp - man)
    q = round(a / quantum) * quantum  # Python's round is half to even; a / quantum is exact
    if q == 0:
        return sign
    qexp = math.frexp(q)[1] - 1
    if qexp < 1 - bias:  # subnormal
        return sign | int(q / 2.0 ** (1 - bias - man))
    return sign | ((qexp + bias) << man) | int((q / 2.0**qexp - 1) * 2**man)


def fp8_value(byte: int, fmt: str) -> float:
    man, bias, _ = FP8[fmt]
    sign = -1.0 if byte & 0x80 else 1.0
    exp, frac = (byte >> man) & ((1 << (7 - man)) - 1), byte & ((1 << man) - 1)
    if exp == 0:
        return sign * frac * 2.0 ** (1 - bias - man)
    return sign * (1 + frac / 2**man) * 2.0 ** (exp - bias)


def encode_ref(values: list[float], mode: str, cache_dtype: str, tensor_scale: float = 1.0) -> bytes:
    """One cell's bytes for one head's ``values`` (exact fp32 numbers) under ``mode``."""
    if mode == "none":
        if cache_dtype == "float32":
            return b"".join(struct.pack("<f", v) for v in values)
        if cache_dtype == "float16":
            return b"".join(struct.pack("<e", v) for v in values)
        # bfloat16: values come from bf16 inputs in these tests, so the top half of the fp32 is exact
        assert all(struct.pack("<f", v)[:2] == b"\0\0" for v in values)
        return b"".join(struct.pack("<f", v)[2:] for v in values)
    if mode == "fp8_per_tensor":
        fmax, s = FP8[cache_dtype][2], f32(tensor_scale)  # the cache keeps scales as fp32
        return bytes(fp8_byte(min(max(f32(v / s), -fmax), fmax), cache_dtype) for v in values)
    qmax = QMAX[mode]
    scale = max(f32(max(abs(v) for v in values) / qmax), MIN_NORMAL)
    ys = [f32(v / scale) for v in values]  # |y| <= qmax * (1 + 2**-23): the clamps below never bite
    if mode == "fp8_per_token_head":
        data = bytes(fp8_byte(min(max(y, -qmax), qmax), "float8_e4m3fn") for y in ys)
    else:
        qs = [int(min(max(round(y), -qmax), qmax)) for y in ys]
        if mode == "int4_per_token_head":
            data = bytes((qs[i] & 0xF) | ((qs[i + 1] & 0xF) << 4) for i in range(0, len(qs), 2))
        else:
            data = bytes(q & 0xFF for q in qs)
    return data + struct.pack("<f", scale)


def decode_ref(cell: bytes, mode: str, cache_dtype: str, head_size: int, tensor_scale: float = 1.0) -> list[float]:
    """The fp32 values (as floats) a cell dequantizes to."""
    if mode == "none":
        if cache_dtype == "float32":
            return list(struct.unpack(f"<{head_size}f", cell))
        if cache_dtype == "float16":
            return list(struct.unpack(f"<{head_size}e", cell))
        return [struct.unpack("<f", b"\0\0" + cell[i : i + 2])[0] for i in range(0, 2 * head_size, 2)]
    if mode == "fp8_per_tensor":
        return [f32(fp8_value(b, cache_dtype) * f32(tensor_scale)) for b in cell]
    packed = head_size // 2 if mode == "int4_per_token_head" else head_size
    (scale,) = struct.unpack("<f", cell[packed : packed + 4])
    if mode == "fp8_per_token_head":
        codes = [fp8_value(b, "float8_e4m3fn") for b in cell[:packed]]
    elif mode == "int8_per_token_head":
        codes = [b - 256 if b > 127 else b for b in cell[:packed]]
    else:
        codes = []
        for b in cell[:packed]:
            codes += [(b & 0xF) - 16 if b & 0x8 else b & 0xF, (b >> 4) - 16 if b & 0x80 else b >> 4]
    return [f32(c * scale) for c in codes]


def fast_cells(values: list[list[float]], mode: str, cache_dtype: str, tensor_scale: float = 1.0) -> list[bytes]:
    """The runtime's encoding of heads ``values`` (each an fp32 list), as bytes per cell."""
    cdt = getattr(torch, cache_dtype)
    x = torch.tensor(values, dtype=torch.float32)
    if mode == "none":
        x = x.to(cdt)
    scale = torch.tensor(tensor_scale, dtype=torch.float32) if mode == "fp8_per_tensor" else None
    cells = encode_cells(x, QuantMode(mode), cdt, scale)
    return [bytes(row) for row in cells.tolist()]


# ---- the reference on hand-worked values --------------------------------------------------------


def test_fp8_reference_matches_the_format_tables() -> None:
    assert fp8_byte(448.0, "float8_e4m3fn") == 0x7E
    assert fp8_byte(-448.0, "float8_e4m3fn") == 0xFE
    assert fp8_byte(2.0**-9, "float8_e4m3fn") == 0x01  # smallest subnormal
    assert fp8_byte(1.0625, "float8_e4m3fn") == 0x38  # tie between 1.0 and 1.125 goes to even 1.0
    assert fp8_byte(1.1875, "float8_e4m3fn") == 0x3A  # tie between 1.125 and 1.25 goes to even 1.25
    assert fp8_byte(-0.0, "float8_e4m3fn") == 0x80
    assert fp8_byte(57344.0, "float8_e5m2") == 0x7B
    for byte in range(256):
        if byte & 0x7F == 0x7F:  # NaN encodings
            continue
        assert fp8_byte(fp8_value(byte, "float8_e4m3fn"), "float8_e4m3fn") == byte


def test_int8_reference_rounds_half_to_even_and_stores_the_scale_last() -> None:
    values = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -127.0, 0.0]
    cell = encode_ref(values, "int8_per_token_head", "uint8")
    assert list(cell[:8]) == [127, 2, 256 - 4, 0, 0, 2, 256 - 127, 0]
    assert struct.unpack("<f", cell[8:]) == (1.0,)  # amax 127 / 127


def test_int4_reference_packs_even_index_in_the_low_nibble() -> None:
    cell = encode_ref([7.0, -7.0, 2.5, -1.0], "int4_per_token_head", "uint8")
    assert list(cell[:2]) == [0x97, 0xF2]  # (7, -7) -> 0x9_7, (2.5 -> 2, -1) -> 0xF_2
    assert decode_ref(cell, "int4_per_token_head", "uint8", 4) == [7.0, -7.0, 2.0, -1.0]


def test_zero_head_stores_the_floor_scale_and_decodes_to_zeros() -> None:
    for mode in QMAX:
        cell = encode_ref([0.0] * 8, mode, "uint8")
        assert struct.unpack("<f", cell[-4:]) == (MIN_NORMAL,)
        assert decode_ref(cell, mode, "uint8", 8) == [0.0] * 8


# ---- the fast path against the reference ---------------------------------------------------------

HEAD = 8
finite32 = st.floats(min_value=-(2.0**125), max_value=2.0**125, allow_nan=False, allow_infinity=False, width=32)
small32 = st.floats(min_value=-(2.0**-120), max_value=2.0**-120, allow_nan=False, allow_infinity=False, width=32)
heads = st.lists(st.lists(st.one_of(finite32, small32, st.sampled_from([0.0, -0.0, 0.5, 2.5, -3.5])),
                          min_size=HEAD, max_size=HEAD), min_size=1, max_size=6)


@pytest.mark.parametrize("mode", list(QMAX))
@settings(max_examples=60, deadline=None)
@given(values=heads)
def test_fast_per_token_head_encoding_is_bit_exact(mode: str, values: list[list[float]]) -> None:
    assert fast_cells(values, mode, "uint8") == [encode_ref(v, mode, "uint8") for v in values]


@pytest.mark.parametrize("mode", list(QMAX))
@settings(max_examples=40, deadline=None)
@given(values=heads)
def test_fast_decoding_is_bit_exact(mode: str, values: list[list[float]]) -> None:
    cells = torch.tensor([list(encode_ref(v, mode, "uint8")) for v in values], dtype=torch.uint8)
    got = decode_cells(cells, QuantMode(mode), HEAD, torch.uint8, torch.float32)
    want = [decode_ref(bytes(c), mode, "uint8", HEAD) for c in cells.tolist()]
    assert got.tolist() == want


@pytest.mark.parametrize("fmt", list(FP8))
@settings(max_examples=40, deadline=None)
@given(values=heads, scale=st.sampled_from([1.0, 0.5, 3.0, 1e-3, 1e5]))
def test_fast_per_tensor_fp8_is_bit_exact(fmt: str, values: list[list[float]], scale: float) -> None:
    assert fast_cells(values, "fp8_per_tensor", fmt, scale) == [
        encode_ref(v, "fp8_per_tensor", fmt, scale) for v in values
    ]


def test_exact_ties_and_extremes_are_bit_exact() -> None:
    values = [
        [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 0.0],
        [448.0, 1.0625, 1.1875, -2.0**-9, 2.0**-10, 3 * 2.0**-11, -448.0, 0.0],
        [7.0, -6.5, 0.5, -0.5, 1.5, 2.5, 3.5, -7.0],
        [0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1e-45, -1e-45, 0.0, 0.0, 1e-45, 0.0, 0.0, 0.0],  # an amax so small amax / qmax underflows
        [3.4e38, -3.4e38, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    values = [[f32(v) for v in head] for head in values]
    for mode in QMAX:
        assert fast_cells(values, mode, "uint8") == [encode_ref(v, mode, "uint8") for v in values]
