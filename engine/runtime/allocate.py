"""Allocation: torch tensors laid out exactly as a `LayoutPlan` says.

Every buffer is allocated as raw zeroed bytes (``plan.buffers[i].nbytes``)
and every other tensor is an ``as_strided`` view of them, so padded pages,
cross-layer offsets and permuted dims all take the same path and the bytes
allocated equal ``plan.total_bytes``. On the ``meta`` device nothing is
allocated, which checks a plan's geometry at any size.
"""

from __future__ import annotations

import torch

from kvpolicy.engine.plan import LayoutPlan
from kvpolicy.engine.runtime.cache import KVCache
from kvpolicy.engine.runtime.quantize import torch_dtype
from kvpolicy.policy.errors import input_error
from kvpolicy.policy.quant import QuantMode

__all__ = ["allocate"]

_MAX_TENSOR_BYTES = 2**63 - 1


def allocate(plan: LayoutPlan, device: str | torch.device = "cpu") -> KVCache:
    """Allocate ``plan`` on ``device`` (``cpu``, ``cuda[:i]`` or ``meta``) and return its `KVCache`."""
    if plan.spec.quant_mode is QuantMode.nvfp4:
        raise input_error("kv_cache_dtype", f"kvpolicy plans kv_cache_dtype `{plan.spec.kv_cache_dtype}` but cannot "
                          "allocate it: its runtime has no nvfp4 quantizer (vLLM's is FlashInfer's CUDA kernel), so "
                          "a KVCache could neither write nor read its cells",
                          "use the plan (`LayoutEngine.plan`, `kvpolicy dry-run`) for its geometry, or allocate a "
                          "kv_cache_dtype the runtime writes (auto, fp8, *_per_token_head)", code="no-runtime-kernel")
    dev = _device(device)
    dtype = torch_dtype(plan.spec.cache_dtype.value)
    largest = max(b.nbytes for b in plan.buffers)
    if largest > _MAX_TENSOR_BYTES:  # torch sizes are int64: a larger buffer is a TypeError there
        raise input_error("num_blocks", f"a buffer of {largest} bytes for {plan.num_blocks} blocks is more than "
                          f"a tensor can hold ({_MAX_TENSOR_BYTES} bytes)", "plan fewer blocks",
                          code="out-of-memory")
    try:
        raw = tuple(torch.zeros(b.nbytes, dtype=torch.uint8, device=dev) for b in plan.buffers)
    except (RuntimeError, MemoryError) as exc:  # the device's allocator said no
        raise input_error("num_blocks", f"cannot allocate {plan.total_bytes} bytes for {plan.num_blocks} blocks on "
                          f"`{dev}`: {str(exc).splitlines()[0]}", "plan fewer blocks", code="out-of-memory") from None
    typed = tuple(r.view(dtype) for r in raw)
    buffers = tuple(t.as_strided(b.shape, b.strides, 0) for t, b in zip(typed, plan.buffers, strict=True))
    views = tuple(typed[lp.view.buffer].as_strided(lp.view.shape, lp.view.strides, lp.view.storage_offset)
                  for lp in plan.layers)
    cache = KVCache(plan, raw, buffers, views)
    # INVARIANT: a fresh cache matches its plan; verify() is the same check, callable later.
    # The overlap check is LayoutEngine.build's (and verify()'s on request): allocate() also
    # serves tests and demonstrations that build an unsafe layout on purpose.
    cache.verify(geometry=False)
    return cache


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise input_error("device", f"unknown device `{device}`", "use `cpu`, `cuda`, `cuda:0` or `meta`") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise input_error("device", f"device `{device}` was asked for but CUDA is not available",
                              "allocate on `cpu` or `meta`, or run where a GPU is visible")
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    elif dev.type not in ("cpu", "meta"):
        raise input_error("device", f"unsupported device `{device}`", "use `cpu`, `cuda` or `meta`")
    return dev
