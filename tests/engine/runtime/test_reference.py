"""A slow float64 reference for the cache cell encoding, and the fast path checked against it bit for bit.

The reference works on Python floats (IEEE float64), one value at a time, and
follows vLLM 0.34's kernels as `kvpolicy.engine.runtime.quantize`'s docstring states
them, written out from that statement, not from the fast path: an fp32
operation is done in float64 and rounded once to fp32 (for +, -, *, / that
double rounding is innocuous, 53 >= 2 * 24 + 2, so it equals the fp32
operation); bf16, fp16 and fp8 rounding, saturating integer conversion,
the Hadamard butterfly and nibble packing are written out by hand. That the
statement is vLLM's is checked against vLLM's own kernels in
``tests/conformance/test_cells.py``. Other runtime tests import
`encode_ref` / `decode_ref` from here.
"""

from __future__ import annotations

import itertools
import math
import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpolicy.engine.runtime.quantize import decode_cells, encode_cells, rht_signs
from kvpolicy.policy.quant import QuantMode

QMAX = {"fp8_per_token_head": 448.0, "int8_per_token_head": 127.0, "int4_per_token_head": 15.0}
QMIN = {"fp8_per_token_head": -448.0, "int8_per_token_head": -128.0}
# (mantissa bits, exponent bias, largest finite) of the two fp8 formats
FP8 = {"float8_e4m3fn": (3, 7, 448.0), "float8_e5m2": (2, 15, 57344.0)}
FLOOR = struct.unpack("<f", struct.pack("<f", 1e-6))[0]  # vLLM's 1e-6 as an fp32 constant
# vLLM's int4 sign vector (_get_rht_signs, seed 0x9E3779B9) for a block of 128; a block of b < 128 uses the
# first b. Pinned here: a change of torch's bernoulli stream would change the format.
SIGNS_128 = ("+-++----+--++-+-++--+++-+-+--++-+---++-++-+-++---------+-------+--++-++-+-++++----+---+--++--+-+"
             "---+++----+-+-+-+++++++-++-+-++-")


def f32(x: float) -> float:
    """Round a float64 to the nearest fp32 (ties to even); overflow gives an infinity."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def bf16(x: float) -> float:
    """Round an fp32 value to the nearest bf16 (ties to even)."""
    if math.isnan(x):
        return x
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def fp16(x: float) -> float:
    try:
        return struct.unpack("<e", struct.pack("<e", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def round_to(x: float, dtype: str) -> float:
    return {"float32": f32, "bfloat16": bf16, "float16": fp16}[dtype](x)


def fp8_byte(y: float, fmt: str) -> int:
    """Encode fp32 value ``y`` (already within the finite range, or NaN) as one fp8 byte, nearest-even."""
    man, bias, _ = FP8[fmt]
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    if math.isnan(y):
        return sign | 0x7F
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
    if (fmt == "float8_e4m3fn" and byte & 0x7F == 0x7F) or (fmt == "float8_e5m2" and exp == 31 and frac):
        return math.nan
    if fmt == "float8_e5m2" and exp == 31:
        return sign * math.inf
    if exp == 0:
        return sign * frac * 2.0 ** (1 - bias - man)
    return sign * (1 + frac / 2**man) * 2.0 ** (exp - bias)


def saturating_int(x: float) -> int:
    """Float -> int32 as compiled Triton converts: truncation, saturating, NaN -> 0."""
    if math.isnan(x):
        return 0
    return max(-(2**31), min(2**31 - 1, int(x))) if math.isfinite(x) else (2**31 - 1 if x > 0 else -(2**31))


def clamp(x: float, lo: float, hi: float) -> float:
    """Triton's clamp: max then min that return the other operand for NaN, so NaN -> lo."""
    return lo if math.isnan(x) else min(max(x, lo), hi)


def half_away(x: float) -> float:
    """``where(x >= 0, x + 0.5, x - 0.5)`` in fp32."""
    return f32(x + 0.5) if x >= 0 else f32(x - 0.5)


def signs(block: int) -> list[float]:
    assert block <= 128
    return [1.0 if c == "+" else -1.0 for c in SIGNS_128[:block]]


def butterfly(xs: list[float], block: int) -> list[float]:
    """The unnormalized Walsh-Hadamard transform of every ``block`` values, each add and subtract in fp32."""
    xs = list(xs)
    h = 1
    while h < block:
        out = list(xs)
        for base in range(0, len(xs), 2 * h):
            for i in range(h):
                a, b = xs[base + i], xs[base + h + i]
                out[base + i], out[base + h + i] = f32(a + b), f32(a - b)
        xs, h = out, 2 * h
    return xs


def bits_of(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def float_of(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def encode_ref(values: list[float], mode: str, cache_dtype: str, tensor_scale: float = 1.0,
               in_dtype: str = "float32") -> bytes:
    """One cell's bytes for one head's ``values`` (exact values of ``in_dtype``) under ``mode``.

    ``cache_dtype`` is the fp8 format of ``fp8_per_tensor`` codes.
    """
    if mode == "none":
        if cache_dtype == "float32":
            return b"".join(struct.pack("<f", v) for v in values)
        if cache_dtype == "float16":
            return b"".join(struct.pack("<e", fp16(v)) for v in values)
        return b"".join(struct.pack("<f", bf16(v))[2:] for v in values)
    if mode == "fp8_per_tensor":
        fmax, s = FP8[cache_dtype][2], f32(tensor_scale)  # the cache keeps scales as fp32
        codes = [fp8_byte(v if math.isnan(v := f32(x / s)) else min(max(v, -fmax), fmax), cache_dtype)
                 for x in values]
        if cache_dtype == "float8_e4m3fn":  # the canonical NaN, as the GPU's saturating conversion stores
            codes = [0x7F if c == 0xFF else c for c in codes]
        return bytes(codes)
    if mode == "int4_per_token_head":
        return _encode_int4(values, in_dtype)
    qmax, qmin = QMAX[mode], QMIN[mode]
    amax = max((abs(v) for v in values if not math.isnan(v)), default=0.0)  # NaN ignored
    scale = max(f32(amax / qmax), FLOOR)
    inv = f32(1.0 / scale)
    ys = [f32(v * inv) for v in values]  # NaN * x and inf * 0 are NaN
    if mode == "fp8_per_token_head":
        data = bytes(fp8_byte(clamp(y, qmin, qmax), "float8_e4m3fn") for y in ys)
    else:
        data = bytes(int(clamp(half_away(y), qmin, qmax)) & 0xFF for y in ys)
    return data + struct.pack("<f", scale)


def _encode_int4(values: list[float], in_dtype: str) -> bytes:
    block = len(values) & -len(values)
    sign = signs(block)
    rotated = butterfly([v * sign[i % block] for i, v in enumerate(values)], block)
    xs = [round_to(x, in_dtype) for x in rotated]
    lo = min((x for x in xs if not math.isnan(x)), default=math.inf)
    hi = max((x for x in xs if not math.isnan(x)), default=-math.inf)
    scale = f32(f32(hi - lo) / 15.0)
    scale = FLOOR if math.isnan(scale) else max(scale, FLOOR)
    zp = clamp(float(saturating_int(half_away(f32(-lo / scale)))), 0.0, 15.0)
    inv = f32(1.0 / scale)
    qs = [int(clamp(float(saturating_int(half_away(f32(f32(x * inv) + zp)))), 0.0, 15.0)) for x in xs]
    data = bytes(qs[i] | (qs[i + 1] << 4) for i in range(0, len(qs), 2))
    return data + struct.pack("<I", (bits_of(scale) & ~15 & 0xFFFFFFFF) | int(zp))


def decode_ref(cell: bytes, mode: str, cache_dtype: str, head_size: int, tensor_scale: float = 1.0,
               out_dtype: str = "float32") -> list[float]:
    """The values (as floats) of ``out_dtype`` a cell dequantizes to."""
    if mode == "none":
        if cache_dtype == "float32":
            values = list(struct.unpack(f"<{head_size}f", cell))
        elif cache_dtype == "float16":
            values = list(struct.unpack(f"<{head_size}e", cell))
        else:
            values = [struct.unpack("<f", b"\0\0" + cell[i : i + 2])[0] for i in range(0, 2 * head_size, 2)]
        return [round_to(v, out_dtype) for v in values]
    if mode == "fp8_per_tensor":
        return [round_to(f32(fp8_value(b, cache_dtype) * f32(tensor_scale)), out_dtype) for b in cell]
    packed = head_size // 2 if mode == "int4_per_token_head" else head_size
    (bits,) = struct.unpack("<I", cell[packed : packed + 4])
    if mode == "int4_per_token_head":
        scale, zp = float_of(bits & ~15), bits & 15
        codes = [c for b in cell[:packed] for c in (b & 0xF, b >> 4)]
        rotated = [round_to(f32(f32(scale * c) - f32(scale * zp)), out_dtype) for c in codes]
        block = head_size & -head_size
        sign = signs(block)
        return [round_to(f32(v * sign[i % block] / block), out_dtype) for i, v in
                enumerate(butterfly(rotated, block))]
    scale = round_to(float_of(bits), out_dtype)  # the attention folds the scale into out_dtype weights
    if mode == "fp8_per_token_head":
        codes = [fp8_value(b, "float8_e4m3fn") for b in cell[:packed]]
    else:
        codes = [b - 256 if b > 127 else b for b in cell[:packed]]
    return [round_to(f32(c * scale), out_dtype) for c in codes]


def fast_cells(values: list[list[float]], mode: str, cache_dtype: str, tensor_scale: float = 1.0,
               in_dtype: str = "float32") -> list[bytes]:
    """The runtime's encoding of heads ``values`` (each exact in ``in_dtype``), as bytes per cell."""
    x = torch.tensor(values, dtype=torch.float32).to(getattr(torch, in_dtype))
    cdt = getattr(torch, cache_dtype)
    if mode == "none":
        x = x.to(cdt)
    scale = torch.tensor(tensor_scale, dtype=torch.float32) if mode == "fp8_per_tensor" else None
    cells = encode_cells(x, QuantMode(mode), cdt, scale)
    return [bytes(row) for row in cells.tolist()]


def exact(values: list[list[float]], dtype: str) -> list[list[float]]:
    """``values`` rounded to ``dtype`` (as the runtime's input tensor holds them)."""
    return torch.tensor(values, dtype=torch.float32).to(getattr(torch, dtype)).float().tolist()


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


def test_int8_reference_is_vllms_arithmetic_on_the_issues_examples() -> None:
    # amax 2.859375: scale fp32(2.859375 / 127) = 0.0225147...; x * (1 / scale) = -63.4999... -> -63
    # (a correctly rounded x / scale is -63.5, which half-to-even would make -64)
    cell = encode_ref([2.859375, -1.4296875] + [0.0] * 6, "int8_per_token_head", "uint8")
    assert cell[1] == 256 - 63
    assert f32(-1.4296875 / f32(2.859375 / 127)) == -63.5
    # amax 1e-5: scale max(1e-5 / 127, 1e-6) = 1e-6, code 10 (a 2**-126 floor would give 127)
    assert encode_ref([1e-5] + [0.0] * 7, "int8_per_token_head", "uint8")[0] == 10


def test_int8_reference_rounds_half_away_from_zero_and_stores_the_scale_last() -> None:
    values = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -127.0, 0.0]
    cell = encode_ref([v * 2.0**-6 for v in values], "int8_per_token_head", "uint8")  # scale 2**-6, exact
    assert list(cell[:8]) == [127, 3, 256 - 4, 1, 256 - 1, 2, 256 - 127, 0]
    assert struct.unpack("<f", cell[8:]) == (2.0**-6,)


def test_nan_and_infinities_store_what_vllms_kernels_store() -> None:
    nan, inf = math.nan, math.inf
    cell = encode_ref([nan, 1.0, -2.0, 0.0], "int8_per_token_head", "uint8")  # NaN ignored by the max, -> QMIN
    assert list(cell[:4]) == [128, 64, 256 - 127, 0] and struct.unpack("<f", cell[4:]) == (f32(2.0 / 127),)
    cell = encode_ref([inf, 1.0, -2.0, 0.0], "int8_per_token_head", "uint8")  # scale inf: finite -> 0, inf -> QMIN
    assert list(cell[:4]) == [128, 0, 0, 0] and struct.unpack("<f", cell[4:]) == (inf,)
    cell = encode_ref([nan] * 4, "fp8_per_token_head", "uint8")
    assert list(cell[:4]) == [0xFE] * 4 and struct.unpack("<f", cell[4:]) == (FLOOR,)
    assert encode_ref([nan, -nan, inf, -inf], "fp8_per_tensor", "float8_e4m3fn") == bytes([0x7F, 0x7F, 0x7E, 0xFE])


def test_int4_reference_rotates_packs_even_index_low_and_hides_the_zero_point_in_the_scale() -> None:
    # rotated values (15, 0, 2.5, 7.5): inputs signs * H r / 4 (exact), so lo 0, hi 15, scale 1, zp 0
    r = [15.0, 0.0, 2.5, 7.5]
    h = butterfly(r, 4)
    x = [v * s / 4 for v, s in zip(h, signs(4), strict=True)]
    assert butterfly([v * s for v, s in zip(x, signs(4), strict=True)], 4) == r
    cell = encode_ref(x, "int4_per_token_head", "uint8")
    assert list(cell[:2]) == [0x0F, 0x83]  # (15, 0), (2.5 -> 3, 7.5 -> 8): half away from zero
    assert struct.unpack("<I", cell[2:]) == (bits_of(1.0),)
    assert decode_ref(cell, "int4_per_token_head", "uint8", 4) == [f32(v * s / 4) for v, s in
                                                                    zip(butterfly([15.0, 0.0, 3.0, 8.0], 4), signs(4),
                                                                        strict=True)]
    # rotated (11, -4, 0, 0): lo -4, scale 1, zero point 4 in the scale's low bits; codes x + 4
    x = [v * s / 4 for v, s in zip(butterfly([11.0, -4.0, 0.0, 0.0], 4), signs(4), strict=True)]
    cell = encode_ref(x, "int4_per_token_head", "uint8")
    assert list(cell[:2]) == [0x0F, 0x44]
    assert struct.unpack("<I", cell[2:]) == (bits_of(1.0) | 4,)


def test_zero_head_stores_the_floor_scale_and_decodes_to_zeros() -> None:
    for mode in QMAX:
        cell = encode_ref([0.0] * 8, mode, "uint8")
        (bits,) = struct.unpack("<I", cell[-4:])
        assert float_of(bits & ~15) == float_of(bits_of(FLOOR) & ~15)
        assert decode_ref(cell, mode, "uint8", 8) == [0.0] * 8


def test_the_sign_vector_is_pinned() -> None:
    got = rht_signs(128, torch.device("cpu")).tolist()
    assert got == signs(128)
    assert rht_signs(32, torch.device("cpu")).tolist() == signs(32)  # a smaller block: the same stream's prefix


# ---- the fast path against the reference ---------------------------------------------------------

HEAD = 8
DTYPES = ["bfloat16", "float16", "float32"]
finite32 = st.floats(min_value=-(2.0**125), max_value=2.0**125, allow_nan=False, allow_infinity=False, width=32)
small32 = st.floats(min_value=-(2.0**-120), max_value=2.0**-120, allow_nan=False, allow_infinity=False, width=32)
special = st.sampled_from([0.0, -0.0, 0.5, 2.5, -3.5, 1e-5, 3e38, -3e38, math.nan, math.inf, -math.inf])
heads = st.lists(st.lists(st.one_of(finite32, small32, special), min_size=HEAD, max_size=HEAD), min_size=1, max_size=6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(QMAX))
@settings(max_examples=40, deadline=None)
@given(values=heads)
def test_fast_per_token_head_encoding_is_bit_exact(mode: str, dtype: str, values: list[list[float]]) -> None:
    values = exact(values, dtype)
    assert fast_cells(values, mode, "uint8", in_dtype=dtype) == [encode_ref(v, mode, "uint8", in_dtype=dtype)
                                                                 for v in values]


cell_bytes = st.lists(st.integers(0, 255), min_size=HEAD + 4, max_size=HEAD + 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(QMAX))
@settings(max_examples=30, deadline=None)
@given(values=heads, raw=st.lists(cell_bytes, min_size=1, max_size=3))
def test_fast_decoding_is_bit_exact(mode: str, dtype: str, values: list[list[float]], raw: list[list[int]]) -> None:
    """Cells the encoder writes, and arbitrary bytes (any scale, NaN codes), decode as the reference says."""
    packed = HEAD // 2 if mode == "int4_per_token_head" else HEAD
    cells = [list(encode_ref(v, mode, "uint8")) for v in exact(values, "float32")]
    cells += [r[:packed] + r[HEAD:] for r in raw]
    got = decode_cells(torch.tensor(cells, dtype=torch.uint8), QuantMode(mode), HEAD, torch.uint8,
                       getattr(torch, dtype)).float()
    want = torch.tensor([decode_ref(bytes(c), mode, "uint8", HEAD, out_dtype=dtype) for c in cells])
    assert same_values(got, want), (got, want)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN matching NaN."""
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("fmt", list(FP8))
@settings(max_examples=40, deadline=None)
@given(values=heads, scale=st.sampled_from([1.0, 0.5, 3.0, 1e-3, 1e5, 0.37]))
def test_fast_per_tensor_fp8_is_bit_exact(fmt: str, values: list[list[float]], scale: float) -> None:
    assert fast_cells(values, "fp8_per_tensor", fmt, scale) == [
        encode_ref(v, "fp8_per_tensor", fmt, scale) for v in values
    ]


def fp8_midpoints(fmt: str) -> list[float]:
    """Every midpoint between neighbouring finite non-negative values of ``fmt``: where ``x / s`` rounds
    to even and any other rounding of the quotient goes up or down."""
    finite = sorted({v for b in range(256) if math.isfinite(v := fp8_value(b, fmt)) and v >= 0})
    return [(a + b) / 2 for a, b in itertools.pairwise(finite)]


MIDPOINTS = {fmt: fp8_midpoints(fmt) for fmt in FP8}
# fp32 scales of a few significant bits (a midpoint times one is exact in bf16 too), 1 / s mostly inexact
few_bit_scales = st.builds(lambda m, e: m * 2.0**e, st.integers(1, 31).filter(lambda m: m & (m - 1)),
                           st.integers(-12, 8))


@pytest.mark.parametrize("fmt", list(FP8))
@settings(max_examples=60, deadline=None)
@given(data=st.data(), scale=st.one_of(few_bit_scales, st.floats(2.0**-20, 2.0**20, width=32)),
       dtype=st.sampled_from(DTYPES))
@example(data=None, scale=0.109375, dtype="bfloat16")  # bf16 0.0013885498046875 / 0.109375 = 6.5 * 2**-9
def test_per_tensor_fp8_divides_by_the_scale_at_ties(fmt: str, data: st.DataObject | None, scale: float,
                                                      dtype: str) -> None:
    """vLLM's Triton write divides by the layer's scale (``x / s``, one rounding), so a value whose quotient
    is exactly halfway between two fp8 codes rounds to the even one; ``x * (1 / s)`` rounds twice and lands
    on either side. Heads of such ties (midpoints times ``s``, both signs) tell the two apart."""
    mids = MIDPOINTS[fmt]
    if data is None:
        chosen = [6.5 * 2.0**-9] * HEAD
    else:
        chosen = data.draw(st.lists(st.sampled_from(mids), min_size=HEAD, max_size=HEAD))
        chosen = [m * data.draw(st.sampled_from([1.0, -1.0])) for m in chosen]
    values = exact([[m * scale for m in chosen]], dtype)
    assert fast_cells(values, "fp8_per_tensor", fmt, scale, in_dtype=dtype) == [
        encode_ref(v, "fp8_per_tensor", fmt, scale, in_dtype=dtype) for v in values
    ]


def test_per_tensor_fp8_divides_by_the_scale_on_the_issues_example() -> None:
    """bf16 0.0013885498046875 at scale 0.109375: ``x / s`` = 6.5 * 2**-9, a tie, e4m3 code 6 (even);
    ``x * (1 / s)`` lands above it, code 7."""
    x = 0.0013885498046875
    assert exact([[x]], "bfloat16") == [[x]]
    assert encode_ref([x], "fp8_per_tensor", "float8_e4m3fn", 0.109375) == bytes([6])
    assert fast_cells([[x]], "fp8_per_tensor", "float8_e4m3fn", 0.109375, in_dtype="bfloat16") == [bytes([6])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_ties_and_extremes_are_bit_exact(dtype: str) -> None:
    values = [
        [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 0.0],
        [448.0, 1.0625, 1.1875, -2.0**-9, 2.0**-10, 3 * 2.0**-11, -448.0, 0.0],
        [7.0, -6.5, 0.5, -0.5, 1.5, 2.5, 3.5, -7.0],
        [0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1e-45, -1e-45, 0.0, 0.0, 1e-45, 0.0, 0.0, 0.0],  # an amax so small amax / qmax underflows
        [3.4e38, -3.4e38, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [3.3e38] * 8,  # int4: a constant head of huge values, x * (1 / 1e-6) overflows
        [math.nan] * 8,
        [math.inf, -math.inf, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    values = exact(values, dtype)
    for mode in QMAX:
        assert fast_cells(values, mode, "uint8", in_dtype=dtype) == [
            encode_ref(v, mode, "uint8", in_dtype=dtype) for v in values], mode


@pytest.mark.parametrize("head", [96, 576, 128])
def test_int4_block_diagonal_transform_is_bit_exact(head: int) -> None:
    """Heads whose size is not a power of two rotate in blocks of the largest power of two dividing it."""
    gen = torch.Generator().manual_seed(head)
    x = (torch.randn(3, head, generator=gen) * torch.tensor([1.0, 1e3, 1e-3]).view(3, 1)).to(torch.bfloat16)
    values = x.float().tolist()
    cells = fast_cells(values, "int4_per_token_head", "uint8", in_dtype="bfloat16")
    assert cells == [encode_ref(v, "int4_per_token_head", "uint8", in_dtype="bfloat16") for v in values]
    got = decode_cells(torch.tensor([list(c) for c in cells], dtype=torch.uint8), QuantMode.int4_per_token_head, head,
                       torch.uint8, torch.bfloat16).float()
    want = torch.tensor([decode_ref(c, "int4_per_token_head", "uint8", head, out_dtype="bfloat16") for c in cells])
    assert same_values(got, want)
