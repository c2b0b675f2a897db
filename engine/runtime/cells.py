"""Finding cells: each (layer, kv, token, head) cell as one row of a word view of its buffer.

Every cell is ``cell_bytes`` contiguous bytes (the ``dim`` dim is innermost in
every backend), at a byte address that is a sum of multiples of the plan's
strides. Dividing every address by their greatest common divisor ``G`` makes
the cells rows of one strided view, ``rows[r] = buffer[r*G : r*G + cell]``, so
a whole write is one ``index_copy_`` and a read one ``index_select``. The view
is over 4-byte words when the cell size and ``G`` allow: uint8 ``index_copy_``
is several times slower on CPU. With padded pages ``G`` may be smaller than a
cell, so rows overlap; only rows that are real cells are ever indexed.
Decode-sized writes (a few tokens) spend their time on per-op overhead, not
bytes, so their token rows are computed in Python and become one tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.plan import LayoutPlan
from policy.backends import Dim

__all__ = ["CellRows"]

_SMALL = 64  # up to this many slots, row arithmetic in Python beats six tensor ops


@dataclass(frozen=True)
class _LayerRows:
    buffer: int
    base: int  # row of (block 0, kv 0, token 0, head 0)
    block: int
    kv: int
    token: int
    head: int


class CellRows:
    """Row views of the cache buffers and the row index of every cell."""

    def __init__(self, plan: LayoutPlan, raw: tuple[torch.Tensor, ...]) -> None:
        spec = plan.spec
        elem = plan.element_size
        cell = spec.cell_bytes
        steps = [lp.view.storage_offset * elem for lp in plan.layers]
        steps += [lp.view.stride_of(d) * elem for lp in plan.layers for d in (Dim.block, Dim.kv, Dim.token, Dim.head)]
        gap = math.gcd(*steps) or cell  # bytes between consecutive rows
        word = next(w for w in (4, 2, 1) if math.gcd(gap, cell) % w == 0 and all(b.nbytes % w == 0 for b in
                                                                              plan.buffers))
        self.word_bytes = word
        self.word_dtype = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        self.cell_words = cell // word
        # INVARIANT: every cell address is a multiple of `gap`, and `gap` of the word size.
        self.rows = tuple(
            r.view(self.word_dtype).as_strided(((r.numel() - cell) // gap + 1, cell // word), (gap // word, 1))
            for r in raw
        )
        self._layers = tuple(
            _LayerRows(
                buffer=lp.view.buffer,
                base=lp.view.storage_offset * elem // gap,
                block=lp.view.stride_of(Dim.block) * elem // gap,
                kv=lp.view.stride_of(Dim.kv) * elem // gap,
                token=lp.view.stride_of(Dim.token) * elem // gap,
                head=lp.view.stride_of(Dim.head) * elem // gap,
            )
            for lp in plan.layers
        )
        self._block_size = spec.block_size
        self._kv_factor = spec.kv_factor
        self._heads = spec.num_kv_heads
        self._offsets: dict[tuple[int, torch.device], torch.Tensor] = {}

    def buffer_of(self, layer: int) -> int:
        return self._layers[layer].buffer

    def index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Row indices (kv_factor, T, H) of the cells of valid ``slots`` (int64, all >= 0) in ``layer``."""
        lr = self._layers[layer]
        n = self._block_size
        if slots.numel() <= _SMALL:  # decode-sized: the token rows in Python, one tensor op after
            tokens = [(s // n) * lr.block + (s % n) * lr.token for s in slots.tolist()]
            token_rows = torch.tensor(tokens, dtype=torch.int64).to(slots.device, non_blocking=True)
        else:
            block = torch.div(slots, n, rounding_mode="floor")
            token_rows = block * lr.block + (slots - block * n) * lr.token
        return token_rows.view(1, -1, 1) + self._cell_rows(layer, slots.device)

    def _cell_rows(self, layer: int, device: torch.device) -> torch.Tensor:
        """(kv_factor, 1, H): the row of each (kv, head) cell of the layer's block 0, token 0."""
        key = (layer, device)
        rows = self._offsets.get(key)
        if rows is None:
            lr = self._layers[layer]
            kv = torch.arange(self._kv_factor, device=device).mul_(lr.kv).view(-1, 1, 1)
            head = torch.arange(self._heads, device=device).mul_(lr.head).view(1, 1, -1)
            rows = self._offsets[key] = kv + head + lr.base
        return rows
