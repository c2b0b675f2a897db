"""Encoding K/V values into cache cells and back, for every `QuantMode`.

A cell is the bytes of one (token, head) for K or for V (DESIGN.md). The
arithmetic is fixed so that any device gives the same bits, and a float64
reference can reproduce it (tests/engine/runtime/test_reference.py):

- ``x`` is the input cast to fp32 (exact from bf16/fp16).
- Per-token-head, ``qmax`` = 448 (fp8 e4m3), 127 (int8), 7 (int4):
  ``amax = max|x|`` over the head (exact); ``scale = max(amax / qmax, 2**-126)``,
  one correctly rounded fp32 division floored at the smallest normal fp32,
  so a scale is never zero or subnormal: a zero head stores zeros and
  dequantizes to exact zeros, never NaN.
  ``y = x / scale``, one correctly rounded fp32 division per value. Since
  the scale is normal, ``|y| <= qmax * (1 + 2**-23)``, which rounds to at
  most ``qmax``: the clamps to [-qmax, qmax] are no-ops and are not run.
  fp8: round ``y`` to e4m3fn, nearest-even (448 is its largest finite);
  int8: round half to even, to [-127, 127];
  int4: round half to even, to [-7, 7] (-8 never appears), two values a
  byte: even index in the low nibble, two's complement nibbles.
  The cell is the codes then the fp32 scale's 4 native (little-endian) bytes.
- ``fp8_per_tensor``: ``y = x / s`` with the layer's K or V scale ``s``,
  clamped to the fp8 format's finite range (vLLM saturates), then rounded.
- ``none``: ``x`` cast to the cache dtype (round to nearest even).
- Decoding multiplies in fp32: ``code * scale`` (exact before the one
  rounding, since a code has at most 8 significant bits), then casts to the
  requested dtype.

Divisors are always tensors on the data's device, never Python scalars:
CUDA turns a division by a CPU scalar into a multiplication by its
reciprocal, which is not the same rounding.

The fast path computes exactly those bits with fewer passes over memory
(`_Chunk.encode`): ``max|x|`` is an integer max over the fp32 bit patterns
with the sign bit cleared (for non-negative floats, bit order is value
order); the floor goes on ``amax`` before the division
(``max(a / q, f) == max(a, q * f) / q``: division is monotonic and ``q * f``
is exact); int4 pairs are packed through an int16 view of the int8 codes.
K and V, and every layer of a whole-model write, are encoded together, a
`CHUNK_VALUES` chunk at a time, in scratch reused across calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from engine.runtime.scratch import Scratch
from policy.quant import QuantMode

__all__ = ["CHUNK_VALUES", "QMAX", "cell_bytes", "decode_cells", "encode_cells", "encode_chunks",
           "torch_dtype"]

QMAX: dict[QuantMode, float] = {
    QuantMode.fp8_per_token_head: 448.0,
    QuantMode.int8_per_token_head: 127.0,
    QuantMode.int4_per_token_head: 7.0,
}
_SCALE_BYTES = 4
_MIN_NORMAL = 2.0**-126  # the smallest normal fp32: the floor of every per-token-head scale
# the fp32 bits of qmax * 2**-126, the floor of max|x| (see `_Chunk.encode`)
_FLOOR_BITS: dict[QuantMode, int] = {
    mode: int(torch.tensor(qmax * _MIN_NORMAL, dtype=torch.float32).view(torch.int32)) for mode, qmax in QMAX.items()
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by a `CacheDtype` / `ModelDtype` value (``bfloat16``, ``float8_e4m3fn``...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype named `{name}`")
    return dtype


CHUNK_VALUES = 1 << 20
"""Values encoded per pass (measured: 2**17 is 1.6x slower on the prefill bench, per-chunk operation
overhead; 2**21 is 1.2x slower, the working set leaves the cache). Scratch: 8 bytes a value."""


def encode_cells(
    x: torch.Tensor,
    mode: QuantMode,
    cache_dtype: torch.dtype,
    tensor_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Encode ``x`` (..., D), any float dtype, into uint8 cells (..., cell_bytes).

    ``out`` receives the cells and is allocated when not given; ``x`` is never
    modified. ``tensor_scale`` is a scalar tensor, required for
    ``fp8_per_tensor``. `encode_chunks` is the same encoding for several inputs
    at once; ``scratch`` is reused across calls when given.
    """
    head = x.shape[-1]
    cell = cell_bytes(mode, head, cache_dtype)
    if out is None:
        out = torch.empty((*x.shape[:-1], cell), dtype=torch.uint8, device=x.device)
    flat = out.view(-1, cell)
    if tensor_scale is not None:
        tensor_scale = tensor_scale.reshape(1, 1, 1, 1)
    chunks = encode_chunks([x.reshape(1, -1, head)], mode, cache_dtype, tensor_scale, scratch or Scratch(x.device))
    for _, t, cells in chunks:
        flat[t].copy_(cells.view(-1, cell))
    return out


def cell_bytes(mode: QuantMode, head_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes of one cell: the codes, then the fp32 scale for per-token-head modes."""
    if mode.is_per_token_head:
        return mode.packed_head_size(head_size) + _SCALE_BYTES
    return head_size * cache_dtype.itemsize


def encode_chunks(
    parts: Sequence[torch.Tensor],
    mode: QuantMode,
    cache_dtype: torch.dtype,
    tensor_scale: torch.Tensor | None,
    scratch: Scratch,
    tokens: torch.Tensor | None = None,
    align: int = 1,
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """Encode ``parts`` (P tensors (A, T, ..., D)) a chunk at a time: yield ``(a, t, cells)``.

    ``cells`` (len(a), P, len(t), ..., cell_bytes) uint8 holds the cells of
    ``parts[p][a, t]`` at ``[:, p]``; it is scratch, overwritten by the next chunk.
    ``tokens`` (int64 indices into T) encodes only those tokens, in that order;
    ``t`` then indexes ``tokens``. Chunks of T start at multiples of ``align``
    (whole blocks, for a block-wise scatter). K and V (and every layer, for a whole-model
    write) go through one fp32 work tensor together: a decode-sized write spends
    its time on the number of torch operations, not on bytes. Large inputs go
    `CHUNK_VALUES` at a time (chunks of T, or of A when one A is small), so the
    extra memory is bounded whatever the input size. ``tensor_scale``
    (``fp8_per_tensor``) broadcasts against (A or 1, P, 1, ..., 1).
    """
    a_size = parts[0].shape[0]
    t_size = parts[0].shape[1] if tokens is None else tokens.numel()
    if a_size == 0 or t_size == 0:
        return
    inner = tuple(parts[0].shape[2:])
    per_t = len(parts) * math.prod(inner)
    step_t = min(max(1, CHUNK_VALUES // per_t), t_size)
    if step_t < t_size:
        step_t = max(align, step_t - step_t % align)
    step_a = max(1, CHUNK_VALUES // (per_t * t_size)) if step_t == t_size else 1
    for a0 in range(0, a_size, step_a):
        a = slice(a0, min(a0 + step_a, a_size))
        scale = tensor_scale[a] if tensor_scale is not None and tensor_scale.shape[0] > 1 else tensor_scale
        for t0 in range(0, t_size, step_t):
            t = slice(t0, min(t0 + step_t, t_size))
            shape = (a.stop - a.start, len(parts), t.stop - t.start, *inner)
            chunk: _Chunk = scratch.memo(("encode", shape, mode, cache_dtype),
                                         lambda shape=shape: _Chunk(shape, mode, cache_dtype, scratch))
            whole = shape[0] == a_size and shape[2] == t_size
            for dst, part in zip(chunk.inputs, parts, strict=True):
                if tokens is not None:  # skipped tokens: gather this chunk's kept ones (a chunk-sized copy)
                    dst.copy_(part[a].index_select(1, tokens[t]))
                else:
                    dst.copy_(part if whole else part[a, t])
            if mode is not QuantMode.none:
                chunk.encode(scale)
            yield a, t, chunk.cells


class _Chunk:
    """The scratch tensors and views that encoding one chunk shape needs, made once per shape.

    ``shape`` is (a, P, t, ..., D). Making a view costs about as much as a small
    operation, and a decode step would otherwise make a dozen every call.
    """

    def __init__(self, shape: tuple[int, ...], mode: QuantMode, cache_dtype: torch.dtype, scratch: Scratch) -> None:
        head = shape[-1]
        self.mode = mode
        self.cache_dtype = cache_dtype
        self.cells = scratch.get("cells", (*shape[:-1], cell_bytes(mode, head, cache_dtype)), torch.uint8)
        if mode is QuantMode.none:
            self.inputs = [self.cells[:, p].view(cache_dtype) for p in range(shape[1])]
            return
        self.work = scratch.get("work", shape, torch.float32)
        self.inputs = [self.work[:, p] for p in range(shape[1])]
        if mode is QuantMode.fp8_per_tensor:
            self.codes = self.cells.view(cache_dtype)
            return
        # max |x| per head on the int32 bit patterns: with the sign bit cleared, the order of
        # non-negative floats is that of their bits, and integer max is cheaper than float max.
        self.bits = self.work.view(torch.int32)
        self.magnitude = scratch.get("magnitude", shape, torch.int32)
        self.scale_bits = scratch.get("scale", (*shape[:-1], 1), torch.int32)
        self.scale = self.scale_bits.view(torch.float32)
        self.qmax = _divisor(QMAX[mode], scratch.device)
        packed = mode.packed_head_size(head)
        self.tail = self.cells[..., packed:]
        self.scale_bytes = self.scale.view(torch.uint8)
        if mode is QuantMode.fp8_per_token_head:
            self.codes = self.cells[..., :packed].view(torch.float8_e4m3fn)
        elif mode is QuantMode.int8_per_token_head:
            self.codes = self.cells[..., :packed].view(torch.int8)
        else:
            self.codes = self.cells[..., :packed]
            self.int4 = scratch.get("int4", shape, torch.int8)
            self.pairs = self.int4.view(torch.int16)
            self.high = scratch.get("int4_high", tuple(self.pairs.shape), torch.int16)

    def encode(self, tensor_scale: torch.Tensor | None) -> None:
        """Encode ``work`` (overwriting it) into ``cells``."""
        work = self.work
        if self.mode is QuantMode.fp8_per_tensor:
            assert tensor_scale is not None
            fmax = torch.finfo(self.cache_dtype).max
            self.codes.copy_(work.div_(tensor_scale).clamp_(-fmax, fmax))
            return
        torch.bitwise_and(self.bits, 0x7FFFFFFF, out=self.magnitude)
        torch.amax(self.magnitude, -1, keepdim=True, out=self.scale_bits)
        # max(amax / qmax, 2**-126) == max(amax, qmax * 2**-126) / qmax: division is monotonic
        # and qmax * 2**-126 is exact, so the floor goes on the bits, before the one division.
        self.scale_bits.clamp_min_(_FLOOR_BITS[self.mode])
        self.scale.div_(self.qmax)
        work.div_(self.scale)
        if self.mode is QuantMode.int4_per_token_head:
            # Round to int8 codes, then pack pairs through an int16 view (little-endian: the even
            # index is the low byte): keep each byte's low nibble, OR in the odd one shifted down
            # by 4, and the low byte of each int16 is the packed byte.
            self.int4.copy_(work.round_())
            self.pairs.bitwise_and_(0x0F0F)
            torch.bitwise_right_shift(self.pairs, 4, out=self.high)
            self.codes.copy_(self.high.bitwise_or_(self.pairs))
        else:
            self.codes.copy_(work.round_() if self.mode is QuantMode.int8_per_token_head else work)
        self.tail.copy_(self.scale_bytes)


_DIVISORS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _divisor(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d tensor on ``device``: a true division everywhere (see the module docstring)."""
    key = (value, device)
    t = _DIVISORS.get(key)
    if t is None:
        t = _DIVISORS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return t


def decode_cells(
    cells: torch.Tensor,
    mode: QuantMode,
    head_size: int,
    cache_dtype: torch.dtype,
    out_dtype: torch.dtype,
    tensor_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode contiguous uint8 cells (..., cell_bytes) into values (..., head_size) of ``out_dtype``."""
    if mode is QuantMode.none:
        return cells.view(cache_dtype).to(out_dtype)
    if mode is QuantMode.fp8_per_tensor:
        assert tensor_scale is not None
        return (cells.view(cache_dtype).float() * tensor_scale).to(out_dtype)
    packed = head_size // 2 if mode is QuantMode.int4_per_token_head else head_size
    codes = cells[..., :packed]
    scale = cells[..., packed : packed + _SCALE_BYTES].contiguous().view(torch.float32)
    if mode is QuantMode.fp8_per_token_head:
        values = codes.view(torch.float8_e4m3fn).float()
    elif mode is QuantMode.int8_per_token_head:
        values = codes.view(torch.int8).float()
    else:
        signed = codes.view(torch.int8)
        low = (codes << 4).view(torch.int8) >> 4  # arithmetic shift sign-extends the nibble
        high = signed >> 4
        values = torch.stack((low, high), dim=-1).flatten(-2).float()
    return (values * scale).to(out_dtype)
