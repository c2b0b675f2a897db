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
"""

from __future__ import annotations

import torch

from policy.quant import QuantMode

__all__ = ["QMAX", "decode_cells", "encode_cells", "torch_dtype"]

QMAX: dict[QuantMode, float] = {
    QuantMode.fp8_per_token_head: 448.0,
    QuantMode.int8_per_token_head: 127.0,
    QuantMode.int4_per_token_head: 7.0,
}
_SCALE_BYTES = 4
_MIN_NORMAL = 2.0**-126  # the smallest normal fp32: the floor of every per-token-head scale


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by a `CacheDtype` / `ModelDtype` value (``bfloat16``, ``float8_e4m3fn``...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype named `{name}`")
    return dtype


def encode_cells(
    x: torch.Tensor,
    mode: QuantMode,
    cache_dtype: torch.dtype,
    tensor_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode ``x`` (..., D), any float dtype, into uint8 cells (..., cell_bytes).

    ``out`` receives the cells and ``work`` (fp32, shaped like ``x``) is
    scratch; both are allocated when not given, and ``x`` is only modified
    when it is ``work`` itself. Reusing them across calls spares the CPU
    allocator's page faults, which cost more than the arithmetic.
    ``tensor_scale`` broadcasts against ``x`` and is required for
    ``fp8_per_tensor``.
    """
    packed = x.shape[-1] // 2 if mode is QuantMode.int4_per_token_head else x.shape[-1]
    data_bytes = packed if mode.is_per_token_head else x.shape[-1] * cache_dtype.itemsize
    cell_bytes = data_bytes + (_SCALE_BYTES if mode.is_per_token_head else 0)
    if out is None:
        out = torch.empty((*x.shape[:-1], cell_bytes), dtype=torch.uint8, device=x.device)
    if mode is QuantMode.none:
        out.view(cache_dtype).copy_(x)
        return out
    if work is None:
        work = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    y = work if work is x else work.copy_(x)
    if mode is QuantMode.fp8_per_tensor:
        assert tensor_scale is not None
        fmax = torch.finfo(cache_dtype).max
        out.view(cache_dtype).copy_(y.div_(tensor_scale).clamp_(-fmax, fmax))
        return out
    qmax = QMAX[mode]
    scale = torch.maximum(y.amax(-1, keepdim=True), y.amin(-1, keepdim=True).neg_())  # max |x|, no temporary
    scale.div_(_divisor(qmax, scale.device)).clamp_min_(_MIN_NORMAL)
    y.div_(scale)
    codes = out[..., :packed]
    if mode is QuantMode.fp8_per_token_head:
        codes.view(torch.float8_e4m3fn).copy_(y)
    elif mode is QuantMode.int8_per_token_head:
        codes.view(torch.int8).copy_(y.round_())
    else:
        q = y.round_().to(torch.int8)
        torch.bitwise_or(q[..., 0::2] & 0x0F, q[..., 1::2] << 4, out=codes.view(torch.int8))
    out[..., packed:].copy_(scale.view(torch.uint8))
    return out


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
