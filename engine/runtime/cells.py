"""Finding cells: each (layer, kv, token, head) cell as one row of a word view of its buffer.

Every cell is ``cell_bytes`` contiguous bytes (the ``dim`` dim is innermost in
every backend), at a byte address that is a sum of multiples of the plan's
strides. Where the head stride is one cell (NHD), the H cells of one (layer,
kv, token) are one run, and a row is that run instead of one cell: H times
fewer rows to index. Dividing every row address by their greatest common
divisor ``G`` makes the rows one strided view, ``rows[r] = buffer[r*G : r*G +
unit]``, so a write is one ``index_copy_`` per buffer (for every layer at once
under cross_layer, whose layers share one buffer) and a read one
``index_select``, each in the widest word the addresses allow
(`kvpolicy.engine.runtime.words`). With padded pages ``G`` may be smaller than a row,
so rows overlap; only rows that are real runs are ever indexed. The row of a
run is ``cell_rows[layer, kv, head] + token_row(slot)``, the first
precomputed for every layer; decode-sized writes (a few tokens) spend their
time on per-op overhead, not bytes, so their token rows are computed in
Python and become one tensor (one token: a Python int, no tensor at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpolicy.engine.plan import LayoutPlan
from kvpolicy.engine.runtime.words import SCATTER_WIDTHS, as_words, on_device, row_view, widest_word
from kvpolicy.policy.backends import Dim

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
        heads = spec.num_kv_heads
        # INVARIANT: with the head stride one cell in every layer, a token's H cells are contiguous.
        together = heads == 1 or all(lp.view.stride_of(Dim.head) * elem == cell for lp in plan.layers)
        self.heads_per_row = heads if together else 1
        unit = cell * self.heads_per_row  # bytes of one row
        dims = (Dim.block, Dim.kv, Dim.token) if together else (Dim.block, Dim.kv, Dim.token, Dim.head)
        steps = [lp.view.storage_offset * elem for lp in plan.layers]
        steps += [lp.view.stride_of(d) * elem for lp in plan.layers for d in dims]
        gap = math.gcd(*steps) or unit  # bytes between consecutive rows
        word = widest_word([gap, unit, *(b.nbytes for b in plan.buffers)], SCATTER_WIDTHS)
        self.word = word
        self.unit_words = unit // word
        # INVARIANT: every row address is a multiple of `gap`, and `gap` of the word size.
        self.rows = tuple(row_view(r, unit, gap, word) for r in raw)
        self._layers = tuple(
            _LayerRows(
                buffer=lp.view.buffer,
                base=lp.view.storage_offset * elem // gap,
                block=lp.view.stride_of(Dim.block) * elem // gap,
                kv=lp.view.stride_of(Dim.kv) * elem // gap,
                token=lp.view.stride_of(Dim.token) * elem // gap,
                head=0 if together else lp.view.stride_of(Dim.head) * elem // gap,
            )
            for lp in plan.layers
        )
        self._block_size = spec.block_size
        self._kv_factor = spec.kv_factor
        self._head_rows = heads // self.heads_per_row  # rows per (layer, kv, token): H, or 1 for runs
        self._offsets: dict[torch.device, torch.Tensor] = {}
        # INVARIANT: when every layer has the same block and token strides (every plan today:
        # layers differ only in buffer and offset), a slot's token row is one number for all layers.
        self._uniform = len({(lr.block, lr.token) for lr in self._layers}) == 1
        groups: list[tuple[int, int, int]] = []  # (buffer, first layer, end layer): runs sharing a buffer
        for i, lr in enumerate(self._layers):
            if groups and groups[-1][0] == lr.buffer:
                groups[-1] = (lr.buffer, groups[-1][1], i + 1)
            else:
                groups.append((lr.buffer, i, i + 1))
        self._groups = tuple(groups)
        self._layer_rows = tuple(self.rows[lr.buffer] for lr in self._layers)
        self._runs = _BlockRuns.of(plan, raw)

    def buffer_of(self, layer: int) -> int:
        return self._layers[layer].buffer

    def groups(self, first: int, end: int) -> list[tuple[int, int, int]]:
        """(buffer, lo, hi) for layers ``first..end-1``: layers ``first+lo..first+hi-1`` share ``buffer``."""
        if end - first == 1:
            return [(self._layers[first].buffer, 0, 1)]
        return [(b, max(lo, first) - first, min(hi, end) - first) for b, lo, hi in self._groups
                if lo < end and hi > first]

    def scatter(self, first: int, index: torch.Tensor, cells: torch.Tensor) -> None:
        """Write ``cells`` (n, ..., cell_bytes) uint8 to the rows ``index`` (n, ...) of layers ``first..first+n-1``.

        One ``index_copy_`` per buffer the layers share: one in all under cross_layer,
        one per layer under per_layer.
        """
        n = index.shape[0]
        words = as_words(cells, self.word).view(n, -1, self.unit_words)
        _scatter(self.rows, self._layer_rows, self.groups(first, first + n), first, index.reshape(n, -1), words)

    def whole_blocks(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The block ids (T / N,) when ``slots`` are whole blocks, each in token order (how vLLM
        fills blocks in a prefill) and the layout keeps a block's cells together; else None.

        Only prefill-sized writes are looked at: the check costs a few operations.
        """
        n = self._block_size
        if self._runs is None or slots.numel() <= _SMALL or slots.numel() % n:
            return None
        tokens = slots.view(-1, n) - self._runs.arange(slots.device)
        starts = tokens[:, :1]
        if not bool(torch.logical_and((tokens == starts).all(), (starts % n == 0).all())):
            return None
        return starts.view(-1) // n

    def scatter_blocks(self, first: int, blocks: torch.Tensor, cells: torch.Tensor) -> None:
        """Write ``cells`` (n, kv_factor, len(blocks) * N, H, cell_bytes) to whole ``blocks`` of layers first.."""
        runs, n = self._runs, cells.shape[0]
        assert runs is not None
        index = runs.base(cells.device)[first : first + n] + blocks.view(1, 1, -1) * runs.block
        words = as_words(cells, runs.word).view(n, -1, runs.unit_words)
        _scatter(runs.rows, runs.layer_rows, self.groups(first, first + n), first, index.view(n, -1), words)

    def index(self, first: int, end: int, slots: torch.Tensor, host: bool = True) -> torch.Tensor:
        """Row indices (layers, kv_factor, T, H or 1) of the cells of valid ``slots`` (int64, all >= 0).

        Layers ``first..end-1``; each index is a row of its layer's buffer: one cell, or a
        token's H cells where they are one run (``heads_per_row``). ``host``: decode-sized
        ``slots`` are read on the host (cheaper on the CPU); ``False`` keeps every step on the
        slots' device, which a GPU's decode step must not wait for.
        """
        cell_rows = self._cell_rows(slots.device)
        if first != 0 or end != len(self._layers):
            cell_rows = cell_rows[first:end]
        if not self._uniform:
            token_rows = torch.stack([self._token_rows(lr, slots, host) for lr in self._layers[first:end]])
            return cell_rows + token_rows.view(end - first, 1, -1, 1)
        lr, n = self._layers[first], self._block_size
        if host and slots.numel() == 1:  # one decode token: its row is a Python int, one tensor op in all
            s = int(slots[0])
            return cell_rows + ((s // n) * lr.block + (s % n) * lr.token)
        return cell_rows + self._token_rows(lr, slots, host).view(1, 1, -1, 1)

    def gather(self, first: int, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The bytes at rows ``index`` (n, ...) of layers ``first..first+n-1``, shaped as ``like`` (the
        cells a `scatter` of that index would write): one ``index_select`` per buffer."""
        n = index.shape[0]
        flat = index.reshape(n, -1)
        groups = self.groups(first, first + n)
        if len(groups) == 1:
            words = self.rows[groups[0][0]].index_select(0, flat.reshape(-1))
        else:
            words = torch.cat([self.rows[b].index_select(0, flat[lo:hi].reshape(-1)) for b, lo, hi in groups])
        return words.view(torch.uint8).view(like.shape)

    def _token_rows(self, lr: _LayerRows, slots: torch.Tensor, host: bool = True) -> torch.Tensor:
        """(T,): the row of (kv 0, head 0) of each slot's token, relative to the layer's base."""
        n = self._block_size
        if host and slots.numel() <= _SMALL:  # decode-sized: the token rows in Python, one tensor op after
            tokens = [(s // n) * lr.block + (s % n) * lr.token for s in slots.tolist()]
            return torch.tensor(tokens, dtype=torch.int64).to(slots.device, non_blocking=True)
        block = torch.div(slots, n, rounding_mode="floor")
        return block * lr.block + (slots - block * n) * lr.token

    def _cell_rows(self, device: torch.device) -> torch.Tensor:
        """(L, kv_factor, 1, H or 1): the row of each (layer, kv, head) of block 0, token 0."""
        rows = self._offsets.get(device)
        if rows is None:
            kv = torch.arange(self._kv_factor, device=device).view(1, -1, 1, 1)
            head = torch.arange(self._head_rows, device=device).view(1, 1, 1, -1)

            def col(field: str) -> torch.Tensor:
                return on_device([getattr(lr, field) for lr in self._layers], torch.int64, device).view(-1, 1, 1, 1)

            rows = self._offsets[device] = col("base") + kv * col("kv") + head * col("head")
        return rows


def _scatter(rows: tuple[torch.Tensor, ...], layer_rows: tuple[torch.Tensor, ...], groups: list[tuple[int, int, int]],
             first: int, index: torch.Tensor, words: torch.Tensor) -> None:
    """``rows[buffer][index[i, j]] = words[i, j]`` for layer ``first + i``: one ``index_copy_`` per group of layers."""
    n = index.shape[0]
    width = words.shape[-1]
    if len(groups) == 1:
        rows[groups[0][0]].index_copy_(0, index.reshape(-1), words.reshape(-1, width))
    elif len(groups) == n:  # a buffer per layer: unbind makes the n views in one call
        for dst, i, w in zip(layer_rows[first : first + n], index.unbind(0), words.unbind(0), strict=True):
            dst.index_copy_(0, i, w)
    else:
        for buffer, lo, hi in groups:
            rows[buffer].index_copy_(0, index[lo:hi].reshape(-1), words[lo:hi].reshape(-1, width))


class _BlockRuns:
    """Whole blocks as rows: where a layer's token stride is H cells and its head stride one cell
    (token-major, NHD), the cells of one (layer, kv, block) are one run of N * H cells.

    A prefill of whole blocks then scatters one run per (layer, kv, block) instead of one
    cell at a time: 12% faster on the prefill benchmark, and no per-cell index to build.
    """

    def __init__(self, rows: tuple[torch.Tensor, ...], word: int, unit: int, gap: int, bases: list[list[int]],
                 block: int, layer_buffers: list[int], block_size: int) -> None:
        self.rows = rows
        self.layer_rows = tuple(rows[b] for b in layer_buffers)
        self.word = word
        self.unit_words = unit // word
        self.block = block
        self._bases = bases
        self._block_size = block_size
        self._cache: dict[tuple[str, torch.device], torch.Tensor] = {}

    @classmethod
    def of(cls, plan: LayoutPlan, raw: tuple[torch.Tensor, ...]) -> _BlockRuns | None:
        spec, elem = plan.spec, plan.element_size
        cell, heads, n = spec.cell_bytes, spec.num_kv_heads, spec.block_size
        views = [lp.view for lp in plan.layers]
        if any(v.stride_of(Dim.token) * elem != heads * cell or (heads > 1 and v.stride_of(Dim.head) * elem != cell)
               for v in views):
            return None  # head-major (HND): a block's cells of one token are not together
        if len({v.stride_of(Dim.block) for v in views}) != 1:
            return None
        unit = n * heads * cell
        block = views[0].stride_of(Dim.block) * elem
        bases = [[v.storage_offset * elem + kv * v.stride_of(Dim.kv) * elem for kv in range(spec.kv_factor)]
                 for v in views]
        gap = math.gcd(block, *(b for layer in bases for b in layer)) or unit
        word = widest_word([unit, gap, *(r.numel() for r in raw)], SCATTER_WIDTHS)
        # INVARIANT: every (layer, kv, block) run starts at a multiple of `gap`, and `gap` of the word size.
        rows = tuple(row_view(r, unit, gap, word) for r in raw)
        return cls(rows, word, unit, gap, [[b // gap for b in layer] for layer in bases], block // gap,
                   [v.buffer for v in views], n)

    def base(self, device: torch.device) -> torch.Tensor:
        """(L, kv_factor, 1): the row of each (layer, kv) run of block 0."""
        t = self._cache.get(("base", device))
        if t is None:
            t = on_device(self._bases, torch.int64, device).unsqueeze(-1)
            self._cache[("base", device)] = t
        return t

    def arange(self, device: torch.device) -> torch.Tensor:
        t = self._cache.get(("arange", device))
        if t is None:
            t = self._cache[("arange", device)] = torch.arange(self._block_size, device=device)
        return t

