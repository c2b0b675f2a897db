"""Encoding K/V values into cache cells and back, as vLLM 0.34's kernels do, for every `QuantMode`.

A cell is the bytes of one (token, head) for K or for V (docs/fingerprint.md, `cell_bytes`). The
per-token-head formats are vLLM's (0.24.0 to 0.34.0, int4 from 0.25.0): its
Triton write kernels ``_reshape_cache_per_token_head`` (int8, fp8) and
``_reshape_cache_int4_kernel`` (int4, after ``single_rht``) in
``vllm/v1/attention/ops/``, and the dequantization its attention kernels
apply when they read a cell. ``tests/conformance/test_cells.py`` runs each
release's own kernels and compares every byte (0.25-0.31 refuse int4 at a
head size that is not a power of two; the block-diagonal transform below is
0.32's). The operations below are theirs, in their order, each an IEEE fp32
operation (exact from bf16/fp16 inputs):

- int8 / fp8 (e4m3, 448) per token-head: ``amax = max|x|`` over the head,
  NaN ignored (Triton's max); ``scale = max(amax / QMAX, 1e-6)`` (QMAX 127 or
  448, 1e-6 as fp32); ``y = x * (1 / scale)``, a reciprocal then a multiply.
  int8 rounds half away from zero the way the kernel does, by adding
  ``+-0.5`` in fp32 and truncating; both clamp to ``[QMIN, QMAX]`` (-128 or
  -448) with NaN going to QMIN (Triton's clamp returns the bound for NaN).
  fp8 rounds to e4m3fn, nearest-even. So NaN stores QMIN and an infinity
  makes the scale infinite, every finite value of its head 0 and itself QMIN.
- int4 per token-head: first vLLM's randomized Hadamard transform: the head
  times its fixed +-1 signs (``_get_rht_signs``: ``torch.bernoulli`` from seed
  0x9E3779B9) then the unnormalized Walsh-Hadamard butterfly, both in fp32,
  block-diagonal in blocks of ``b``, the largest power of two dividing the
  head size, and the result rounded to the input's dtype. Then asymmetric
  codes: ``lo, hi`` = min and max over the head (NaN ignored);
  ``scale = max((hi - lo) / 15, 1e-6)`` (NaN -> 1e-6); zero point
  ``zp = clamp(trunc(-lo / scale +- 0.5), 0, 15)``; codes
  ``clamp(trunc(x * (1 / scale) + zp +- 0.5), 0, 15)``, the ``+- 0.5`` by the
  sign of what it is added to. Conversions to an integer saturate and send
  NaN to 0, as compiled Triton's do (cvt.rzi). Two codes a byte, the even
  index in the low nibble; the scale keeps ``zp`` in its 4 low mantissa
  bits: ``bits(scale) & ~15 | zp``.
- The cell is the codes then the fp32 scale's 4 native (little-endian) bytes.
- ``fp8_per_tensor``: ``y = x / s`` with the layer's K or V scale ``s``
  (vLLM's Triton write divides), saturated to the fp8 format's finite range
  and rounded to nearest even. NaN stays NaN (0x7F for e4m3). vLLM 0.34's
  TRITON_ATTN views every fp8 cache as e4m3fn, ``fp8_e5m2`` included; the
  cache passes the code dtype its backend writes.
- ``none``: ``x`` cast to the cache dtype (round to nearest even).

Decoding is what vLLM's attention takes as a cell's values (its output for a
one-token sequence, which the conformance tests compare), for an output
dtype ``d``: int8/fp8 per token-head, ``code * scale`` with the scale first
rounded to ``d`` (the kernel folds the V scale into the bf16/fp16 softmax
weights), the product exact in fp32, then rounded to ``d``; int4,
``scale*code - scale*zp`` in fp32 with the zero point's bits cleared from the
scale, rounded to ``d``, then the inverse transform (butterfly in fp32, the
signs, divided by ``b``) rounded to ``d``; per-tensor fp8,
``fp32(code) * s`` rounded to ``d``.

Divisors are always tensors on the data's device, never Python scalars:
CUDA turns a division by a CPU scalar into a multiplication by its
reciprocal, which is not the same rounding. On a GPU, vLLM's compiled Triton
kernels differ from these correctly rounded operations in places (fp32
division is approximate there, ``x * inv + zp`` may fuse into one FMA, int4's
rotation runs in bf16 tensor cores); kvpolicy does the same operations in
the same order on every device, which is what vLLM's kernels compute exactly
under Triton's interpreter. ``bench/gpu_check.sh`` measures the difference.

NaN-ignoring max and min are taken over copies with NaN replaced by a value
that cannot win (``nan_to_num``). K and V, and every layer of a whole-model
write, are encoded together, a `CHUNK_VALUES` chunk at a time, in scratch
reused across calls.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence

import torch

from kvpolicy.engine.runtime.scratch import Scratch
from kvpolicy.engine.runtime.words import on_device
from kvpolicy.policy.quant import QuantMode

__all__ = ["CHUNK_VALUES", "QMAX", "QMIN", "SCALE_FLOOR", "cell_bytes", "decode_cells", "encode_cells",
           "encode_chunks", "rht_block", "rht_signs", "torch_dtype"]

QMAX: dict[QuantMode, float] = {
    QuantMode.fp8_per_token_head: 448.0,
    QuantMode.int8_per_token_head: 127.0,
    QuantMode.int4_per_token_head: 15.0,
}
QMIN: dict[QuantMode, float] = {
    QuantMode.fp8_per_token_head: -448.0,
    QuantMode.int8_per_token_head: -128.0,
    QuantMode.int4_per_token_head: 0.0,
}
SCALE_FLOOR: float = struct.unpack("<f", struct.pack("<f", 1e-6))[0]
"""vLLM's ``1e-6`` as the fp32 constant its kernels compare with (9.99999997e-07)."""

_SCALE_BYTES = 4
_RHT_SEED = 0x9E3779B9  # vLLM's _get_rht_signs(d, round_idx=0)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by a `CacheDtype` / `ModelDtype` value (``bfloat16``, ``float8_e4m3fn``...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype named `{name}`")
    return dtype


CHUNK_VALUES = 1 << 20
"""Values encoded per pass (measured: 2**17 is 1.6x slower on the prefill bench, per-chunk operation
overhead; 2**21 is 1.2x slower, the working set leaves the cache). Scratch: about 9 bytes a value
(int4: about 11)."""


def rht_block(head_size: int) -> int:
    """The block of int4's Hadamard transform: the largest power of two dividing ``head_size``."""
    return head_size & -head_size


_SIGNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def rht_signs(block: int, device: torch.device) -> torch.Tensor:
    """vLLM's +-1.0 fp32 sign vector of int4's transform for ``block`` values (``_get_rht_signs``):
    ``2 * bernoulli(0.5) - 1`` from a CPU generator seeded 0x9E3779B9, made on the CPU, then copied."""
    key = (block, torch.device(device))
    signs = _SIGNS.get(key)
    if signs is None:
        cpu = _SIGNS.get((block, _CPU))
        if cpu is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(_RHT_SEED)
            cpu = _SIGNS[(block, _CPU)] = 2.0 * torch.bernoulli(torch.full((block,), 0.5), generator=gen) - 1.0
        signs = _SIGNS[key] = cpu if key[1] == _CPU else torch.empty(block, device=device).copy_(cpu)
    return signs


_CPU = torch.device("cpu")


def encode_cells(
    x: torch.Tensor,
    mode: QuantMode,
    cache_dtype: torch.dtype,
    tensor_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Encode ``x`` (..., D) of bf16, fp16 or fp32 into uint8 cells (..., cell_bytes).

    ``out`` receives the cells and is allocated when not given; ``x`` is never
    modified. ``tensor_scale`` is a scalar tensor, required for
    ``fp8_per_tensor``, and ``cache_dtype`` there is the fp8 format written.
    int4's transform rounds to ``x``'s dtype, so the dtype is part of the
    input. `encode_chunks` is the same encoding for several inputs at once;
    ``scratch`` is reused across calls when given.
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
    """Encode ``parts`` (P tensors (A, T, ..., D), one dtype) a chunk at a time: yield ``(a, t, cells)``.

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
    in_dtype = parts[0].dtype
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
            chunk: _Chunk = scratch.memo(("encode", shape, mode, cache_dtype, in_dtype),
                                         lambda shape=shape: _Chunk(shape, mode, cache_dtype, in_dtype, scratch))
            whole = shape[0] == a_size and shape[2] == t_size
            for dst, part in zip(chunk.inputs, parts, strict=True):
                if tokens is not None:  # skipped tokens: gather this chunk's kept ones (a chunk-sized copy)
                    dst.copy_(part[a].index_select(1, tokens[t]))
                else:
                    dst.copy_(part if whole else part[a, t])
            if mode is not QuantMode.none:
                chunk.encode(scale)
            yield a, t, chunk.cells


_INF = math.inf


class _Chunk:
    """The scratch tensors and views that encoding one chunk shape needs, made once per shape.

    ``shape`` is (a, P, t, ..., D). Making a view costs about as much as a small
    operation, and a decode step would otherwise make a dozen every call.
    """

    def __init__(self, shape: tuple[int, ...], mode: QuantMode, cache_dtype: torch.dtype, in_dtype: torch.dtype,
                 scratch: Scratch) -> None:
        head = shape[-1]
        self.mode = mode
        self.cache_dtype = cache_dtype
        self.in_dtype = in_dtype
        device = scratch.device
        self.cells = scratch.get("cells", (*shape[:-1], cell_bytes(mode, head, cache_dtype)), torch.uint8)
        if mode is QuantMode.none:
            self.inputs = [self.cells[:, p].view(cache_dtype) for p in range(shape[1])]
            return
        self.work = scratch.get("work", shape, torch.float32)
        self.inputs = [self.work[:, p] for p in range(shape[1])]
        if mode is QuantMode.fp8_per_tensor:
            self.codes = self.cells.view(cache_dtype)
            self.fmax = torch.finfo(cache_dtype).max
            if cache_dtype == torch.float8_e4m3fn:  # -NaN (0xFF) becomes the canonical NaN 0x7F
                self.code_ints = self.cells.view(torch.int8)
                self.negative_nan = scratch.get("nan", tuple(self.cells.shape), torch.bool)
            return
        rows = (*shape[:-1], 1)
        self.tmp = scratch.get("tmp", shape, torch.float32)
        self.scale = scratch.get("scale", rows, torch.float32)
        self.scale_bits = self.scale.view(torch.int32)
        self.inv = scratch.get("inv", rows, torch.float32)
        self.one = _constant(1.0, device)
        self.half = _constant(0.5, device)
        packed = mode.packed_head_size(head)
        self.tail = self.cells[..., packed:]
        self.scale_bytes = self.scale.view(torch.uint8)
        if mode is QuantMode.fp8_per_token_head:
            self.codes = self.cells[..., :packed].view(torch.float8_e4m3fn)
        elif mode is QuantMode.int8_per_token_head:
            self.codes = self.cells[..., :packed].view(torch.int8)
        if mode is not QuantMode.int4_per_token_head:
            self.qmax = _constant(QMAX[mode], device)
            return
        self.codes = self.cells[..., :packed]
        self.lo = scratch.get("lo", rows, torch.float32)
        self.zp = scratch.get("zp", rows, torch.float32)
        self.zp_int = scratch.get("zp_int", rows, torch.int32)
        self.fifteen = _constant(15.0, device)
        self.floor = _constant(SCALE_FLOOR, device)
        self.block = rht_block(head)
        self.signs = rht_signs(self.block, device).view(*(1,) * (len(shape) - 1), 1, self.block)
        self.blocks = (*shape[:-1], head // self.block, self.block)
        self.stages = self.block.bit_length() - 1
        # the rotated values rounded to the input's dtype, in the bytes of `tmp` (free by then)
        if in_dtype != torch.float32:
            self.rounded = self.tmp.view(-1).view(torch.uint8)[: math.prod(shape) * in_dtype.itemsize].view(
                in_dtype).view(shape)
        self.int4 = scratch.get("int4", shape, torch.uint8)
        self.pairs = self.int4.view(torch.int16)
        self.high = scratch.get("int4_high", tuple(self.pairs.shape), torch.int16)

    def encode(self, tensor_scale: torch.Tensor | None) -> None:
        """Encode ``work`` (overwriting it and ``tmp``) into ``cells``."""
        if self.mode is QuantMode.fp8_per_tensor:
            assert tensor_scale is not None
            self.codes.copy_(self.work.div_(tensor_scale).clamp_(-self.fmax, self.fmax))  # NaN stays NaN
            if self.cache_dtype == torch.float8_e4m3fn:
                torch.eq(self.code_ints, -1, out=self.negative_nan)
                self.code_ints.masked_fill_(self.negative_nan, 0x7F)
            return
        if self.mode is QuantMode.int4_per_token_head:
            self._encode_int4()
        else:
            self._encode_symmetric()
        self.tail.copy_(self.scale_bytes)

    def _encode_symmetric(self) -> None:
        """int8 and fp8 per token-head: ``_reshape_cache_per_token_head``."""
        work, tmp, scale = self.work, self.tmp, self.scale
        torch.abs(work, out=tmp).nan_to_num_(0.0, _INF, _INF)  # Triton's max ignores NaN
        torch.amax(tmp, -1, keepdim=True, out=scale)
        scale.div_(self.qmax).clamp_min_(SCALE_FLOOR)  # max(amax / QMAX, 1e-6); amax is never NaN here
        torch.div(self.one, scale, out=self.inv)
        work.mul_(self.inv)  # |y| <= QMAX * (1 + 3 * 2**-24), or NaN (x NaN, or x infinite: inf * 0)
        if self.mode is QuantMode.int8_per_token_head:
            # where(y >= 0, y + 0.5, y - 0.5), then the int8 store truncates: as y + 0.5 * sign(y) (one
            # rounding: 0.5 * sign is exact), except that +-0 adds 0 where the kernel adds 0.5, both
            # truncating to 0 (sign is 2.4x faster than copysign here). NaN -> QMIN, as the kernel's clamp.
            work.add_(torch.sign(work, out=tmp), alpha=0.5)
            self.codes.copy_(work.nan_to_num_(-128.0, 127.0, -128.0))
        else:
            self.codes.copy_(work.nan_to_num_(-448.0, 448.0, -448.0))  # nearest-even to e4m3fn

    def _encode_int4(self) -> None:
        """int4 per token-head: ``single_rht`` then ``_reshape_cache_int4_kernel``."""
        work, tmp = self.work, self.tmp
        # x * signs, then the butterfly: ping-pong between work and tmp, ending in work.
        src, dst = (work, tmp) if self.stages % 2 == 0 else (tmp, work)
        torch.mul(work.view(self.blocks), self.signs, out=src.view(self.blocks))
        h = 1
        while h < self.block:
            sv = src.view(-1, self.block // (2 * h), 2, h)
            dv = dst.view(-1, self.block // (2 * h), 2, h)
            torch.add(sv[:, :, 0], sv[:, :, 1], out=dv[:, :, 0])
            torch.sub(sv[:, :, 0], sv[:, :, 1], out=dv[:, :, 1])
            src, dst, h = dst, src, 2 * h
        if self.in_dtype != torch.float32:  # single_rht(x.float()).to(x.dtype)
            self.rounded.copy_(work)
            work.copy_(self.rounded)
        scale, lo, zp, inv = self.scale, self.lo, self.zp, self.inv
        torch.amin(torch.nan_to_num(work, _INF, _INF, -_INF, out=tmp), -1, keepdim=True, out=lo)
        torch.amax(torch.nan_to_num(work, -_INF, _INF, -_INF, out=tmp), -1, keepdim=True, out=scale)
        # max((hi - lo) / 15, 1e-6): fmax, so a NaN (all-infinite head) gives the floor
        torch.fmax(scale.sub_(lo).div_(self.fifteen), self.floor, out=scale)
        # zp = clamp(int(-lo / scale +- 0.5), 0, 15); the conversion saturates, NaN -> 0
        torch.div(lo, scale, out=zp).neg_()
        zp.add_(torch.copysign(self.half, zp, out=inv)).trunc_().nan_to_num_(0.0, 15.0, 0.0).clamp_(0.0, 15.0)
        self.zp_int.copy_(zp)
        zp.copy_(self.zp_int)  # int -> float: +0.0 for a zero point of 0
        torch.div(self.one, scale, out=inv)
        work.mul_(inv).add_(zp)
        work.add_(torch.sign(work, out=tmp), alpha=0.5)  # +-0.5 by the sign, as in _encode_symmetric
        self.int4.copy_(work.nan_to_num_(0.0, 15.0, 0.0).clamp_(0.0, 15.0))  # truncates, as the uint8 store
        # Pack pairs through an int16 view (little-endian: the even index is the low byte): with
        # both codes in 0..15, the low byte of pair | pair >> 4 is even | odd << 4.
        torch.bitwise_right_shift(self.pairs, 4, out=self.high)
        self.codes.copy_(self.high.bitwise_or_(self.pairs))
        self.scale_bits.bitwise_and_(-16).bitwise_or_(self.zp_int)


_CONSTANTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d fp32 tensor on ``device``: a true division everywhere (see the module docstring)."""
    key = (value, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = on_device(value, torch.float32, device)
    return t


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """vLLM's unnormalized Walsh-Hadamard butterfly in blocks of ``block`` along the last dim (fp32, new tensor)."""
    h = 1
    while h < block:
        xv = x.reshape(*x.shape[:-1], x.shape[-1] // (2 * h), 2, h)
        a, b = xv[..., 0, :], xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h *= 2
    return x


def decode_cells(
    cells: torch.Tensor,
    mode: QuantMode,
    head_size: int,
    cache_dtype: torch.dtype,
    out_dtype: torch.dtype,
    tensor_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode contiguous uint8 cells (..., cell_bytes) into values (..., head_size) of ``out_dtype``.

    ``cache_dtype`` is the fp8 format of ``fp8_per_tensor`` codes.
    """
    if mode is QuantMode.none:
        return cells.view(cache_dtype).to(out_dtype)
    if mode is QuantMode.fp8_per_tensor:
        assert tensor_scale is not None
        return (cells.view(cache_dtype).float() * tensor_scale).to(out_dtype)
    packed = mode.packed_head_size(head_size)
    codes = cells[..., :packed]
    scale = cells[..., packed : packed + _SCALE_BYTES].contiguous().view(torch.float32)
    if mode is not QuantMode.int4_per_token_head:
        values = (codes.view(torch.float8_e4m3fn) if mode is QuantMode.fp8_per_token_head
                  else codes.view(torch.int8)).float()
        if out_dtype != torch.float32:  # the attention kernel's softmax weight times the scale, in out_dtype
            scale = scale.to(out_dtype).float()
        return (values * scale).to(out_dtype)
    bits = scale.view(torch.int32)
    zp = (bits & 0xF).float()
    scale = (bits & -16).view(torch.float32)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).float()
    rotated = (nibbles * scale - zp * scale).to(out_dtype).float()
    block = rht_block(head_size)
    signs = rht_signs(block, cells.device)
    shape = rotated.shape
    values = hadamard(rotated, block).reshape(*shape[:-1], head_size // block, block) * signs
    return (values.reshape(shape) / block).to(out_dtype)
