"""Encoding K/V values into cache cells and back, for every `QuantMode`.

A cell is the bytes of one (token, head) for K or for V (DESIGN.md). The
arithmetic is fixed so that any device gives the same bits, and a float64
reference can reproduce it (tests/engine/runtime/test_reference.py):

- ``x`` is the input cast to fp32 (exact from bf16/fp16).
- Per-token-head, ``qmax`` = 448 (fp8 e4m3), 127 (int8), 7 (int4):
  ``amax = max|x|`` over the head (exact); ``scale = amax / qmax``, one
  correctly rounded fp32 division; ``scale = 1.0`` where that is 0 (a zero
  head, or an amax so small the division underflows), so a zero head
  stores zeros and dequantizes to exact zeros, never NaN.
  ``y = x / scale``, one correctly rounded fp32 division per value. Then
  fp8: clamp ``y`` to [-448, 448] and round to e4m3fn, nearest-even;
  int8: round half to even, clamp to [-127, 127];
  int4: round half to even, clamp to [-7, 7] (|y| <= 7 up to rounding, so -8
  never appears), two values a byte: even index in the low nibble, two's
  complement nibbles.
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


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by a `CacheDtype` / `ModelDtype` value (``bfloat16``, ``float8_e4m3fn``...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype named `{name}`")
    return dtype


def encode_cells(
    x: torch.Tensor, mode: QuantMode, cache_dtype: torch.dtype, tensor_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Encode ``x`` (..., D) into contiguous uint8 cells (..., cell_bytes).

    ``x`` must be fp32 for the quantized modes and may be overwritten (it is
    the caller's scratch). ``tensor_scale`` broadcasts against ``x`` and is
    required for ``fp8_per_tensor``.
    """
    if mode is QuantMode.none:
        return x.to(cache_dtype).contiguous().view(torch.uint8)
    if mode is QuantMode.fp8_per_tensor:
        assert tensor_scale is not None
        fmax = torch.finfo(cache_dtype).max
        y = x.div_(tensor_scale).clamp_(-fmax, fmax)
        return y.to(cache_dtype).view(torch.uint8)
    qmax = QMAX[mode]
    amax = torch.maximum(x.amax(-1, keepdim=True), x.amin(-1, keepdim=True).neg_())
    scale = amax.div_(amax.new_full((), qmax))
    scale.masked_fill_(scale == 0, 1.0)
    y = x.div_(scale)
    if mode is QuantMode.fp8_per_token_head:
        codes = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = y.round_().clamp_(-qmax, qmax).to(torch.int8)
        if mode is QuantMode.int4_per_token_head:
            q = (q[..., 0::2] & 0x0F) | (q[..., 1::2] << 4)
        codes = q.view(torch.uint8)
    return torch.cat((codes, scale.view(torch.uint8)), dim=-1)


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
