"""kvpolicy.engine.runtime.words: runs moved as 16-byte complex128 words keep every bit pattern."""

from __future__ import annotations

import math

import pytest
import torch
from test_allocate import make_plan

from kvpolicy.engine.runtime import allocate
from kvpolicy.engine.runtime.words import GATHER_WIDTHS, SCATTER_WIDTHS, as_words, row_view, widest_word

# 8-byte patterns a float64 unit could alter if a copy ever went through arithmetic: signalling
# and quiet NaNs with payloads, both infinities, negative zero, the smallest subnormal.
_PATTERNS = [0x7FF0000000000001, 0x7FF4000000000000, 0xFFF0000000000001, 0x7FF8000000000001,
             0xFFFFFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000, 0x8000000000000000, 0x1]


def _hostile_bytes(nbytes: int) -> torch.Tensor:
    words = torch.tensor([p - (1 << 64) if p >= 1 << 63 else p for p in _PATTERNS], dtype=torch.int64)
    reps = -(-nbytes // (8 * len(_PATTERNS)))
    return words.repeat(reps).view(torch.uint8)[:nbytes].clone()


def test_widest_word_divides_every_size() -> None:
    assert widest_word([1056, 16896, 0]) == 16
    assert widest_word([1056, 16896], GATHER_WIDTHS) == 8
    assert widest_word([132, 264]) == 4
    assert widest_word([10, 20]) == 2
    assert widest_word([7]) == 1
    assert SCATTER_WIDTHS[0] == 16 and GATHER_WIDTHS[0] == 8


def test_index_copy_of_complex128_words_keeps_nan_payloads() -> None:
    src = _hostile_bytes(16 * 64)
    dst = torch.zeros(16 * 64 * 3, dtype=torch.uint8)
    rows = row_view(dst, 16 * 64, 16 * 64, 16)
    rows.index_copy_(0, torch.tensor([2, 0]), as_words(src, 16).view(1, -1).expand(2, -1).contiguous())
    assert torch.equal(dst[2 * 1024 :], src) and torch.equal(dst[:1024], src)
    assert not dst[1024 : 2 * 1024].any()


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC", "BHLNC"])
def test_restore_keeps_every_bit_pattern(layout: str) -> None:
    cache = allocate(make_plan(layout=layout, kv_cache_dtype="int8_per_token_head", head_size=28))
    assert cache.cells.word == 16
    ids = [4, 1, 3]
    data = cache.offload(ids).data
    hostile = _hostile_bytes(data.numel()).view(data.shape)
    cache.restore(ids, hostile, assume_same_layout=True)
    assert torch.equal(cache.offload(ids).data, hostile)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_offload_into_and_restore_from_unaligned_slices(layout: str) -> None:
    """Host tensors that are slices of larger ones (an odd byte offset) move the same bytes."""
    cache = allocate(make_plan(layout=layout, kv_cache_dtype="int8_per_token_head", head_size=28))
    ids = [0, 2]
    shape = cache.offload(ids).data.shape
    backing = torch.randint(0, 256, (shape.numel() + 1,), dtype=torch.uint8)
    data = backing[1:].view(shape)
    cache.restore(ids, data, assume_same_layout=True)
    out = torch.zeros(shape.numel() + 3, dtype=torch.uint8)[3:].view(shape)
    assert cache.offload(ids, out=out).data is out
    assert torch.equal(out, data)


@pytest.mark.parametrize(("layout", "head_size", "heads_per_row", "word"), [
    ("LBNHC", 28, 2, 16),  # head stride one cell: a token's two 32-byte cells are one run
    ("BLNHC", 28, 2, 16),
    ("LBNHC", 16, 2, 8),  # two 20-byte cells: a 40-byte run, 8-byte words
    ("LBHNC", 16, 1, 4),  # head-major: each 20-byte cell alone, 4-byte words
])
def test_nhd_tokens_are_one_row_of_wide_words(layout: str, head_size: int, heads_per_row: int, word: int) -> None:
    plan = make_plan(layout=layout, kv_cache_dtype="int8_per_token_head", head_size=head_size, num_kv_heads=2)
    cache = allocate(plan)
    assert cache.cells.heads_per_row == heads_per_row
    assert cache.cells.word == word
    key = torch.randn(6, 2, head_size)
    slots = torch.tensor([19, 0, 7, 8, 3, 12])
    cache.write(1, key, -key, slots)
    got_k, got_v = cache.read(1, slots, torch.float32)
    assert torch.equal(got_k, -got_v)
    assert torch.allclose(got_k, key, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC", "BHLNC"])
def test_transfers_move_whole_words(layout: str) -> None:
    """Offload gathers 8-byte words and restore scatters 16-byte ones: byte-wide elements made
    restore 9x slower than a copy (the contiguous last dim's stride of 1 once capped the word)."""
    from kvpolicy.engine.runtime.transfer import _rows

    cache = allocate(make_plan(layout=layout, kv_cache_dtype="auto", head_size=16))
    col = 0
    for tv in cache.plan.transfer:
        assert _rows(cache, tv, GATHER_WIDTHS, col)[1] == torch.int64
        assert _rows(cache, tv, GATHER_WIDTHS, col + 3)[1] == torch.uint8  # an odd host slice
        assert _rows(cache, tv, SCATTER_WIDTHS, col)[1] == torch.complex128
        col += math.prod(tv.shape[1:])
