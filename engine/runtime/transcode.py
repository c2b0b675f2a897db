"""Transcoding block rows: the cells of one block format, byte for byte, at the places of another.

A `BlockFormat` puts every (layer, kv, token, head) cell of a block row at a sum
of byte strides, each cell ``cell_bytes`` contiguous bytes (its data, then its
inline scale). Rows of two formats holding the same cells are therefore two
strided views ``(rows, L, K, N, H, cell)`` of the same values, and transcoding
is one ``copy_`` from the one view to the other, in the widest word that every
stride, size and offset allows (`kvpolicy.engine.runtime.words`): no loop over
cells, the same operation on the CPU and on CUDA. A copy moves bits, never
does arithmetic, so every code and scale arrives as written (NaN payloads too).
The target's padding belongs to no cell: it is zero.
"""

from __future__ import annotations

import torch

from kvpolicy.engine.block_format import BlockFormat
from kvpolicy.engine.runtime.words import SCATTER_WIDTHS, widest_word, word_dtype

__all__ = ["transcode_into", "transcode_rows"]


def transcode_rows(rows: torch.Tensor, source: BlockFormat, target: BlockFormat) -> torch.Tensor:
    """``rows`` (n, source.row_bytes), contiguous uint8, as a new (n, target.row_bytes) tensor on its device."""
    make = torch.zeros if target.padding_bytes else torch.empty
    out = make((rows.shape[0], target.row_bytes), dtype=torch.uint8, device=rows.device)
    transcode_into(rows, source, target, out)
    return out


def transcode_into(rows: torch.Tensor, source: BlockFormat, target: BlockFormat, out: torch.Tensor) -> None:
    """Write the cells of ``rows`` (n, source.row_bytes) into ``out`` (n, target.row_bytes), both contiguous
    uint8 on one device; the padding bytes of ``out`` are left as they are."""
    # INVARIANT: both formats hold the same cells (kvpolicy.engine.exchange compared the cell formats).
    assert source.cell_shape == target.cell_shape and source.cell_bytes == target.cell_bytes, (source, target)
    if rows.shape[0] == 0:
        return
    sizes = [source.cell_bytes, source.row_bytes, target.row_bytes, *source.cell_strides, *target.cell_strides,
             rows.storage_offset(), out.storage_offset()]
    word = widest_word(sizes, SCATTER_WIDTHS)
    _cells(out, target, word).copy_(_cells(rows, source, word))


def _cells(rows: torch.Tensor, fmt: BlockFormat, word: int) -> torch.Tensor:
    """The cells of ``rows`` (n, fmt.row_bytes) as a (n, L, K, N, H, cell words) view of its bytes."""
    words = rows.view(word_dtype(word))
    shape = (rows.shape[0], *fmt.cell_shape, fmt.cell_bytes // word)
    strides = (fmt.row_bytes // word, *(s // word for s in fmt.cell_strides), 1)
    return words.as_strided(shape, strides, words.storage_offset())
