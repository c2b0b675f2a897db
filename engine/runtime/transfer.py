"""Block transfers: copying whole blocks (every layer, inline scales and padding included) out and back.

A transferred block is its plan's transfer rows concatenated in layer order:
``L * page_size_bytes`` bytes, a (n, L, page_size_bytes) uint8 tensor for n
blocks. Under cross_layer with the block outermost, a block is one contiguous
row and the whole transfer is one gather over the block dim; per_layer gathers
one (block, page) row per layer. Widths come from the plan, never from the
unpadded data size: leaving the scales out truncates restored blocks (vLLM
PR #48411).

Shape alone cannot tell two layouts apart (issue-48412's BLNHC and vllm-0.34's
LBHNC both offload (n, 4, 8192) for a 4-layer Qwen2.5-0.5B), so `offload`
returns `OffloadedBlocks`: the bytes bound to the writer's fingerprint and block
format. `restore` compares them with the cache's own (`kvpolicy.engine.exchange`)
before it writes a byte: the same row format is copied as is, the same cells
in another order are transcoded exactly (`kvpolicy.engine.runtime.transcode`),
other cells are refused naming every field that differs. A bare tensor says
nothing of its layout: it is restored only with ``source=`` (the writer's
fingerprint) or ``assume_same_layout=True``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Protocol

import torch

from kvpolicy.engine.block_format import BlockFormat, block_format, plan_of
from kvpolicy.engine.exchange import BlockExchange, ExchangeKind, compare_blocks
from kvpolicy.engine.fingerprint import LayoutFingerprint
from kvpolicy.engine.plan import ByteView, LayoutPlan
from kvpolicy.engine.runtime.blocks import FingerprintLike, OffloadedBlocks, as_fingerprint
from kvpolicy.engine.runtime.checks import check_block_ids, check_device
from kvpolicy.engine.runtime.transcode import transcode_into
from kvpolicy.engine.runtime.words import GATHER_WIDTHS, SCATTER_WIDTHS, widest_word, word_dtype
from kvpolicy.policy.errors import input_error

__all__ = ["BlockStore", "offload", "restore"]

TRANSCODE_CHUNK_BYTES = 8 << 20  # staging of a transcoding restore (bench/bench_transcode.py)
_UNBOUND_HELP = ("restore the `OffloadedBlocks` that `offload` returned; for bytes from a peer or a store, pass "
                 "the writer's fingerprint as `source=` (or bind them with `OffloadedBlocks.received`); "
                 "`assume_same_layout=True` if they surely come from a cache of this very layout")


class BlockStore(Protocol):
    """What a transfer reads of an `kvpolicy.engine.runtime.KVCache`: its plan, device, raw buffers and
    transfer format (typed structurally: the cache depends on this module, not the reverse)."""

    plan: LayoutPlan
    device: torch.device
    raw: Sequence[torch.Tensor]
    transfer_format: str
    fingerprint: LayoutFingerprint
    block_format: BlockFormat


def offload(cache: BlockStore, block_ids: torch.Tensor | Sequence[int], out: torch.Tensor | None = None
            ) -> OffloadedBlocks:
    """Copy ``block_ids`` out to a CPU uint8 tensor (n, L, page_size_bytes), pinned if the cache is on CUDA,
    bound to the cache's fingerprint and block format.

    ``out``, when given, is a contiguous CPU uint8 tensor of that shape to fill
    instead (a preallocated, possibly pinned, staging buffer); the result's ``data`` is ``out``.
    """
    check_device(cache.device, "offload from")
    plan = cache.plan
    _check_transferable(cache)
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
        raise input_error("out", "`out` is a view of this cache's own memory (its bytes overlap the cache's "
                          "buffers): the offload would overwrite the blocks it copies",
                          "offload into a separate tensor (allocated by `offload` when `out` is None)")
    blocks = OffloadedBlocks(out, cache.fingerprint, cache.block_format)
    if n == 0:
        return blocks
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
    return blocks


def restore(cache: BlockStore, block_ids: torch.Tensor | Sequence[int], data: OffloadedBlocks | torch.Tensor, *,
            source: FingerprintLike | None = None, assume_same_layout: bool = False,
            source_format: str | None = None) -> BlockExchange:
    """Write offloaded blocks into ``block_ids``, as is or transcoded; every check runs before any byte is written.

    ``data`` is what `offload` returned, or a bare (n, L, page) uint8 tensor with ``source``
    (the writer's fingerprint: object, dict or JSON) or ``assume_same_layout=True``.
    ``source_format`` (the writer's ``transfer_format``) is the deprecated form of the latter.
    Returns how the blocks moved (`BlockExchange`); a refusal is an `InputError`.
    """
    check_device(cache.device, "restore into")
    plan = cache.plan
    _check_transferable(cache)
    ids = check_block_ids(block_ids, plan.num_blocks, cache.device, unique=True)
    tensor, exchange = _bind(cache, data, source, assume_same_layout, source_format)
    n = ids.numel()
    fmt = exchange.source_format or cache.block_format
    want = (n, fmt.num_layers, fmt.page_bytes)
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tuple(tensor.shape) != want:
        got = (f"`{tensor.dtype}` {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor)
               else f"`{type(tensor).__name__}`")
        raise input_error("data", f"offloaded data is {got}, the blocks restore from uint8 {want}",
                          "restore blocks into a cache with the same layers and page size they came from",
                          code="transfer-geometry")
    if tensor.device not in (cache.device, torch.device("cpu")):
        raise input_error("data", f"`data` is on `{tensor.device}`; expected the CPU or `{cache.device}`")
    if n == 0:
        return exchange
    with torch.no_grad():
        src = tensor.to(cache.device).contiguous()  # blocking: `data` may be reused
        if _shares_memory(src, cache):  # blocks offloaded into the cache's own memory: copy them out first
            src = src.clone()
        if src.storage_offset() % SCATTER_WIDTHS[0]:  # an odd slice of a larger tensor: realign, so the
            # widest words apply (narrower ones would make index_copy_ several times slower)
            src = src.clone()
        rows = src.view(n, fmt.row_bytes)
        if exchange.kind is ExchangeKind.transcode:
            assert exchange.source_format is not None and exchange.target_format is not None
            _scatter_transcoded(cache, ids, rows, exchange.source_format, exchange.target_format)
        else:
            _scatter_rows(cache, ids, rows)
    return exchange


def _bind(cache: BlockStore, data: object, source: FingerprintLike | None, assume_same_layout: bool,
          source_format: str | None) -> tuple[object, BlockExchange]:
    """The tensor to restore, and how it moves into ``cache``; an `InputError` when nothing says what its
    bytes mean, or when they cannot be restored here."""
    if isinstance(data, OffloadedBlocks):
        if source is not None or assume_same_layout or source_format is not None:
            raise input_error("source", "`data` is `OffloadedBlocks`, which carry their writer's fingerprint: "
                              "`source`, `assume_same_layout` and `source_format` are for bare tensors",
                              "restore the `OffloadedBlocks` alone")
        if data.format != block_format(plan_of(data.fingerprint)):  # a format from another cache: refuse
            raise input_error("data", "these `OffloadedBlocks` carry a format that is not their fingerprint's: "
                              "their bytes would be read as another layout's", "restore what `offload` (or "
                              "`OffloadedBlocks.received`) returned, unchanged", code="unbound-blocks")
        exchange = _exchange(cache, data.fingerprint, data.format)
    elif not isinstance(assume_same_layout, bool):
        raise input_error("assume_same_layout", f"`assume_same_layout` must be True or False, got "
                          f"`{type(assume_same_layout).__name__}`", "pass True only for bytes of this very layout")
    elif not isinstance(data, torch.Tensor):
        return data, _same(cache)  # refused by the shape check, naming the type
    elif sum((source is not None, bool(assume_same_layout), source_format is not None)) > 1:
        raise input_error("source", "`source`, `assume_same_layout` and `source_format` each say what the bytes "
                          "are: pass one", "pass `source=` (the writer's fingerprint)")
    elif source is not None:
        fp = as_fingerprint(source, "source")
        exchange = _exchange(cache, fp, None)
    elif assume_same_layout:
        exchange = _same(cache)
    elif source_format is not None:
        warnings.warn("restore(..., source_format=) is deprecated: restore the `OffloadedBlocks` that offload "
                      "returns, or pass the writer's fingerprint as `source=`", DeprecationWarning, stacklevel=4)
        if source_format != cache.transfer_format:
            raise input_error("source_format", f"blocks of format `{source_format}` cannot be restored into a "
                              f"cache of format `{cache.transfer_format}`",
                              "restore the `OffloadedBlocks` that `offload` returned: they transcode between "
                              "layouts where that is exact", code="transfer-geometry")
        exchange = _same(cache)
    else:
        raise input_error("data", "`data` is a bare tensor: nothing says which layout wrote its bytes, and a block "
                          "of another layout of the same shape would be restored as garbage", _UNBOUND_HELP,
                          code="unbound-blocks")
    if not exchange.ok:
        raise exchange.error("data")
    return data.data if isinstance(data, OffloadedBlocks) else data, exchange


def _exchange(cache: BlockStore, fp: LayoutFingerprint, fmt: BlockFormat | None) -> BlockExchange:
    if fp == cache.fingerprint and fmt in (None, cache.block_format):
        return _same(cache)
    return compare_blocks(fp, cache.fingerprint, source_format=fmt, target_format=cache.block_format)


def _same(cache: BlockStore) -> BlockExchange:
    """Blocks of the cache's own format: copied as they are."""
    return BlockExchange(ExchangeKind.as_is, (), (), cache.block_format, cache.block_format)


def _scatter_rows(cache: BlockStore, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` (n, block_row_bytes) on the cache's device into blocks ``ids``: one index_copy_ a transfer view."""
    plan = cache.plan
    n = ids.numel()
    col = 0
    for tv in plan.transfer:
        rows, word = _rows(cache, tv, SCATTER_WIDTHS, src.storage_offset() + col)
        width = math.prod(tv.shape[1:])
        rows.index_copy_(0, ids, src[:, col : col + width].view(word).view(n, *rows.shape[1:]))
        col += width


def _scatter_transcoded(cache: BlockStore, ids: torch.Tensor, rows: torch.Tensor, source: BlockFormat,
                        target: BlockFormat) -> None:
    """`_scatter_rows` of ``rows`` (n, source.row_bytes) transcoded into the cache's format, a chunk of
    blocks at a time through one staging tensor (its padding zeroed once: no cell writes it). A chunk
    of at most `TRANSCODE_CHUNK_BYTES` is still in the CPU's cache when it is scattered."""
    n = ids.numel()
    per = max(1, TRANSCODE_CHUNK_BYTES // target.row_bytes)
    make = torch.zeros if target.padding_bytes else torch.empty
    stage = make((min(per, n), target.row_bytes), dtype=torch.uint8, device=rows.device)
    for start in range(0, n, per):
        k = min(per, n - start)
        transcode_into(rows[start : start + k], source, target, stage[:k])
        _scatter_rows(cache, ids[start : start + k], stage[:k])


def _shares_memory(t: torch.Tensor, cache: BlockStore) -> bool:
    """Whether ``t``'s bytes overlap one of the cache's buffers: compared by address ranges of their untyped
    storages, so memory reached through another storage object (``torch.frombuffer`` over the cache's
    address, a DLPack or NumPy round trip) counts, not only views of the same storage."""
    if t.device != cache.device or t.device.type == "meta":
        return False
    lo, hi = _address_range(t)
    return any(lo < r_hi and r_lo < hi for r_lo, r_hi in map(_address_range, cache.raw))


def _address_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) of the bytes ``t``'s untyped storage spans."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _check_transferable(cache: BlockStore) -> None:
    """An `InputError` where the plan offers no block transfer (LHBNC): `block_format` says why."""
    cache.block_format  # noqa: B018 (raises)


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
