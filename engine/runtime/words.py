"""Word views: runs of bytes moved as the widest machine word their alignment allows.

Every scatter and gather of the runtime moves whole runs of bytes (a cell, the
heads of one token, a block) with one ``index_copy_`` or ``index_select``
over a strided view of a buffer, one run a row. The kernels cost per element,
so the element is the widest word that divides every address and size:

- ``index_copy_`` (writes, restores) goes up to 16-byte words as
  ``complex128``: measured on the CPU, 26 us against 91 us for int64 words
  (1 MiB in 64 runs), close to a plain copy (18 us). A copy moves bits and
  never does arithmetic, so every pattern survives, NaN payloads included
  (`tests/engine/runtime/test_words.py`).
- ``index_select`` (offloads) is as fast with 8-byte words, and slightly
  slower with 16: transfers gather at most 8. The cells' rows serve writes and
  reads alike and take 16.
"""

from __future__ import annotations

import torch

__all__ = ["GATHER_WIDTHS", "SCATTER_WIDTHS", "as_words", "on_device", "row_view", "widest_word", "word_dtype"]

SCATTER_WIDTHS = (16, 8, 4, 2, 1)
GATHER_WIDTHS = (8, 4, 2, 1)
_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def widest_word(sizes: tuple[int, ...] | list[int], widths: tuple[int, ...] = SCATTER_WIDTHS) -> int:
    """The widest of ``widths`` that divides every byte size, stride and offset in ``sizes``."""
    return next(w for w in widths if all(s % w == 0 for s in sizes))


def word_dtype(word: int) -> torch.dtype:
    """The dtype whose elements are ``word`` bytes (``complex128`` for 16)."""
    return _DTYPES[word]


def as_words(t: torch.Tensor, word: int) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a flat tensor of ``word``-byte elements (a view, no copy)."""
    return t.view(-1).view(torch.uint8).view(_DTYPES[word])


def row_view(raw: torch.Tensor, unit: int, gap: int, word: int) -> torch.Tensor:
    """Rows of ``unit`` bytes starting every ``gap`` bytes of the flat uint8 ``raw``, as ``word``-byte elements.

    Rows overlap when ``gap < unit``; callers index only rows that are real runs.
    """
    return raw.view(_DTYPES[word]).as_strided(((raw.numel() - unit) // gap + 1, unit // word), (gap // word, 1))


def on_device(data: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype)`` on ``device``: made on the host and copied into a device tensor (one
    host-to-device copy; the form that also works under ``FakeTensorMode``, where the tests fake a GPU)."""
    host = torch.tensor(data, dtype=dtype)
    return torch.empty(host.shape, dtype=dtype, device=device).copy_(host)
