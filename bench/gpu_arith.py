"""On a GPU: how often compiled Triton's fp32 arithmetic differs from the correctly rounded operations
kvpolicy does (and vLLM's kernels do under Triton's interpreter, which the conformance tests run).

kvpolicy encodes with the operations of vLLM 0.34's write kernels, in their order, each correctly
rounded (engine/runtime/quantize.py), on every device. Compiled for a GPU, the same kernels may
round differently in three places; this measures each on the benchmark's data (K of 2048 tokens x
8 heads x 128, bf16, randn), with one-operation Triton kernels (not vLLM's kernels, which need a
vLLM install):

- ``div``: ``a / b`` in fp32 (Triton emits an approximate division, div.full.f32) against torch's
  correctly rounded one, for the scales ``amax / 127``, ``amax / 448``, ``(hi - lo) / 15`` and the
  reciprocals ``1 / scale``: the fraction of heads whose scale or reciprocal differs.
- ``fma``: ``x * inv + zp`` (int4) as Triton compiles it (LLVM may contract it into one fused
  multiply-add) against a multiply then an add: the fraction of values that differ, and of those
  whose int4 code (half away from zero, then truncation) changes.

    python bench/gpu_arith.py          # prints one line per figure; needs CUDA and triton

Each differing scale changes the 4 scale bytes of its cell (and possibly codes); a differing
code changes one nibble. bench/gpu_check.sh runs this after the benchmarks.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_arith: torch sees no CUDA device")
        return 3
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        print(f"gpu_arith: triton is not importable ({exc})")
        return 2

    @triton.jit
    def divide(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask, other=1.0)
        b = tl.load(b_ptr + offs, mask=mask, other=1.0)
        tl.store(out_ptr + offs, a / b, mask=mask)

    @triton.jit
    def mul_add(x_ptr, inv_ptr, zp_ptr, out_ptr, n, d, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        inv = tl.load(inv_ptr + offs // d, mask=mask, other=0.0)
        zp = tl.load(zp_ptr + offs // d, mask=mask, other=0.0)
        tl.store(out_ptr + offs, x * inv + zp, mask=mask)

    def tri_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous().view(-1), b.expand_as(a).contiguous().view(-1)
        out = torch.empty_like(a)
        divide[(triton.cdiv(a.numel(), 1024),)](a, b, out, a.numel(), BLOCK=1024)
        return out

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048 * 8, 128, generator=gen).to(torch.bfloat16).float().to(dev)
    floor = torch.tensor(1e-6, dtype=torch.float32, device=dev)
    one = torch.ones((), device=dev)
    out: dict[str, float] = {}
    amax = x.abs().amax(-1)
    for name, q in (("int8", 127.0), ("fp8", 448.0)):
        qt = torch.full_like(amax, q)
        s_torch = torch.clamp_min(amax / qt, floor)
        s_tri = torch.clamp_min(tri_div(amax, qt), floor)
        out[f"{name}_scale_differs"] = float((s_torch != s_tri).float().mean())
        inv_torch = one / s_torch
        out[f"{name}_reciprocal_differs"] = float((tri_div(one.expand_as(s_torch), s_torch) != inv_torch)
                                                  .float().mean())
    lo, hi = x.amin(-1), x.amax(-1)
    fifteen = torch.full_like(lo, 15.0)
    scale = torch.fmax((hi - lo) / fifteen, floor)
    out["int4_scale_differs"] = float((torch.fmax(tri_div(hi - lo, fifteen), floor) != scale).float().mean())
    inv = one / scale
    t = -lo / scale
    zp = torch.clamp(torch.trunc(t + torch.copysign(torch.tensor(0.5, device=dev), t)), 0, 15)
    fused = torch.empty_like(x)
    mul_add[(triton.cdiv(x.numel(), 1024),)](x, inv, zp, fused, x.numel(), x.shape[-1], BLOCK=1024)
    plain = x * inv[:, None] + zp[:, None]
    out["int4_mul_add_differs"] = float((fused != plain).float().mean())

    def code(s: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.trunc(s + torch.copysign(torch.tensor(0.5, device=dev), s)), 0, 15)

    out["int4_code_differs"] = float((code(fused) != code(plain)).float().mean())
    out["device"] = torch.cuda.get_device_name(0)  # type: ignore[assignment]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
