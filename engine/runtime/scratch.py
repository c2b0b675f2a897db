"""`Scratch`: reusable tensors for the runtime's writes, so a write allocates nothing once warm.

Large fresh CPU allocations page-fault on every touch, which costs more than
the arithmetic; small ones cost a call each, as do views, which a decode step
would otherwise make by the dozen. A `Scratch` keeps one flat tensor per
(name, dtype), grown on demand, the views handed out from it, and any object
built from those views (`memo`), all for one device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Scratch"]

_MAX_VIEWS = 64  # more distinct shapes than this (varying prefill lengths): start over


class Scratch:
    """Flat tensors by name, and views and memos derived from them, on ``device``.

    Not thread-safe: a `KVCache` holds a lock around each write that uses its scratch.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._memo: dict[object, Any] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` to overwrite; the same (name, dtype) shares its memory."""
        view = self._views.get((name, shape, dtype))
        if view is not None:
            return view
        numel = math.prod(shape)
        flat = self._flat.get((name, dtype))
        if flat is None or flat.numel() < numel:
            flat = self._flat[(name, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
            # INVARIANT: no view or memo outlives the flat tensor it was made from.
            self._views.clear()
            self._memo.clear()
        if len(self._views) >= _MAX_VIEWS:
            self._views.clear()
            self._memo.clear()
        view = self._views[(name, shape, dtype)] = flat[:numel].view(shape)
        return view

    def memo(self, key: object, build: Callable[[], Any]) -> Any:
        """``build()``, made once per ``key`` and dropped whenever the tensors it may view are."""
        value = self._memo.get(key)
        if value is None:
            value = build()
            if len(self._memo) >= _MAX_VIEWS:
                self._memo.clear()
            self._memo[key] = value
        return value

    def nbytes(self) -> int:
        """Bytes held: the scratch memory of the largest write so far."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())
