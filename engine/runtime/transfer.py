"""Block transfers: copying whole blocks (every layer, inline scales and padding included) out and back.

A transferred block is its plan's transfer rows concatenated in layer order:
``L * page_size_bytes`` bytes, returned as a uint8 tensor (n, L, page_size_bytes).
Under cross_layer with the block outermost, a block is one contiguous row and
the whole transfer is one gather over the block dim; per_layer gathers one
(block, page) row per layer. Widths come from the plan, never from the
unpadded data size: leaving the scales out truncates restored blocks (vLLM
PR #48411).

Shape alone cannot tell two layouts with equal (L, page) apart (per_layer
NHD vs HND), so a cache's ``transfer_format`` names what each byte of a row
means; `restore` checks it when the caller passes the source's format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from kvpolicy.engine.plan import ByteView, LayoutPlan
from kvpolicy.engine.runtime.checks import check_block_ids, check_device
from kvpolicy.engine.runtime.words import GATHER_WIDTHS, SCATTER_WIDTHS, widest_word, word_dtype
from kvpolicy.policy.errors import input_error

__all__ = ["BlockStore", "offload", "restore"]


class BlockStore(Protocol):
    """What a transfer reads of an `kvpolicy.engine.runtime.KVCache`: its plan, device, raw buffers and
    transfer format (typed structurally: the cache depends on this module, not the reverse)."""

    plan: LayoutPlan
    device: torch.device
    raw: Sequence[torch.Tensor]
    transfer_format: str


def offload(cache: BlockStore, block_ids: torch.Tensor | Sequence[int], out: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Copy ``block_ids`` out to a CPU uint8 tensor (n, L, page_size_bytes), pinned if the cache is on CUDA.

    ``out``, when given, is a contiguous CPU uint8 tensor of that shape to fill
    instead (a preallocated, possibly pinned, staging buffer).
    """
    check_device(cache.device, "offload from")
    plan = cache.plan
    _check_transferable(plan)
    ids = check_block_ids(block_ids, plan.num_blocks, cache.device, unique=False)
    n = ids.numel()
    shape = (n, plan.num_layers, plan.page_size_bytes)
    on_cuda = cache.device.type == "cuda"
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, pin_memory=on_cuda)
    elif not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and tuple(out.shape) == shape
              and out.device.type == "cpu" and out.is_contiguous()):
        got = f"`{out.dtype}` {tuple(out.shape)} on `{out.device}`" if isinstance(out, torch.Tensor) else "not a tensor"
        raise input_error("out", f"`out` is {got}; expected a contiguous CPU uint8 tensor of shape {shape}")
    elif _shares_memory(out, cache):
        raise input_error("out", "`out` is a view of this cache's own memory: the offload would overwrite the blocks "
                          "it copies", "offload into a separate tensor (allocated by `offload` when `out` is None)")
    if n == 0:
        return out
    # On CUDA, gather into one contiguous device tensor, then one device-to-host copy into
    # `out`; on the CPU, gather straight into `out` (strided columns for per_layer).
    stage = torch.empty((n, plan.block_row_bytes), dtype=torch.uint8, device=cache.device) if on_cuda else out
    col = 0
    with torch.no_grad():
        for tv in plan.transfer:
            rows, word = _rows(cache, tv, GATHER_WIDTHS, stage.storage_offset() + col)
            width = math.prod(tv.shape[1:])
            dst = stage.view(n, plan.block_row_bytes)[:, col : col + width].view(word).view(n, *rows.shape[1:])
            if on_cuda:
                dst.copy_(rows.index_select(0, ids))
            else:
                torch.index_select(rows, 0, ids, out=dst)
            col += width
        if on_cuda:
            out.copy_(stage.view(out.shape), non_blocking=out.is_pinned())
            torch.cuda.current_stream(cache.device).synchronize()
    # INVARIANT: the rows of a transfer cover a block's L pages exactly, padding and scales included.
    assert col == plan.block_row_bytes
    return out


def restore(cache: BlockStore, block_ids: torch.Tensor | Sequence[int], data: torch.Tensor, *,
            source_format: str | None = None) -> None:
    """Write ``data`` from `offload` into ``block_ids``; every check runs before any byte is written."""
    check_device(cache.device, "restore into")
    plan = cache.plan
    _check_transferable(plan)
    ids = check_block_ids(block_ids, plan.num_blocks, cache.device, unique=True)
    want = (ids.numel(), plan.num_layers, plan.page_size_bytes)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or tuple(data.shape) != want:
        got = f"`{data.dtype}` {tuple(data.shape)}" if isinstance(data, torch.Tensor) else f"`{type(data).__name__}`"
        raise input_error("data", f"offloaded data is {got}, this cache restores uint8 {want}",
                          "restore blocks into a cache with the same layers and page size they came from",
                          code="transfer-geometry")
    if source_format is not None and source_format != cache.transfer_format:
        raise input_error("source_format", f"blocks of format `{source_format}` cannot be restored into a cache "
                          f"of format `{cache.transfer_format}`",
                          "offload and restore between caches of the same layout and quantization",
                          code="transfer-geometry")
    if data.device not in (cache.device, torch.device("cpu")):
        raise input_error("data", f"`data` is on `{data.device}`; expected the CPU or `{cache.device}`")
    n = ids.numel()
    if n == 0:
        return
    with torch.no_grad():
        src = data.to(cache.device).contiguous()  # blocking: `data` may be reused
        if _shares_memory(src, cache):  # blocks offloaded into the cache's own memory: copy them out first
            src = src.clone()
        if src.storage_offset() % SCATTER_WIDTHS[0]:  # an odd slice of a larger tensor: realign, so the
            # widest words apply (narrower ones would make index_copy_ several times slower)
            src = src.clone()
        src = src.view(n, plan.block_row_bytes)
        col = 0
        for tv in plan.transfer:
            rows, word = _rows(cache, tv, SCATTER_WIDTHS, src.storage_offset() + col)
            width = math.prod(tv.shape[1:])
            rows.index_copy_(0, ids, src[:, col : col + width].view(word).view(n, *rows.shape[1:]))
            col += width


def _shares_memory(t: torch.Tensor, cache: BlockStore) -> bool:
    """Whether ``t`` is a view of one of the cache's buffers (the same storage)."""
    if t.device != cache.device:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == r.untyped_storage().data_ptr() for r in cache.raw)


def _check_transferable(plan: LayoutPlan) -> None:
    if not plan.transfer:
        raise input_error("layout", f"layout `{plan.layout}` keeps no page of a block contiguous (the head dim "
                          "lies outside the block dim), so kvpolicy offers no block transfer for it",
                          "offload from a block-compact layout (LBHNC, LBNHC, BLHNC, BLNHC)",
                          code="transfer-geometry")


def _rows(cache: BlockStore, tv: ByteView, widths: tuple[int, ...], start: int) -> tuple[torch.Tensor, torch.dtype]:
    """The transfer view ``tv`` over its buffer as rows of words, and the word's dtype.

    The word is the widest of ``widths`` dividing the view's outer strides, offset and row
    width, the block row's length, and ``start``: the byte where the view's columns begin in
    the host-side tensor's storage (a caller's ``out`` may be an odd slice). The last dim is
    contiguous bytes (stride 1), so a row moves a word at a time.
    """
    raw = cache.raw[tv.buffer]
    *outer, inner = tv.byte_strides
    # INVARIANT: transfer views end in a dim of contiguous bytes (`ByteView`, dtype uint8).
    assert inner == 1, tv
    sizes = (*outer, tv.byte_offset, tv.shape[-1], raw.numel(), start, cache.plan.block_row_bytes)
    word = widest_word(sizes, widths)
    dtype = word_dtype(word)
    shape = (*tv.shape[:-1], tv.shape[-1] // word)
    strides = (*(s // word for s in outer), 1)
    return raw.view(dtype).as_strided(shape, strides, tv.byte_offset // word), dtype
