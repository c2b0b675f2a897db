"""kvpolicy.engine.runtime.scratch: reused tensors, views and memos, never stale after a buffer grows."""

from __future__ import annotations

import torch
from test_reference import QMAX, encode_ref

from kvpolicy.engine.runtime import encode_cells
from kvpolicy.engine.runtime.scratch import Scratch
from kvpolicy.policy.quant import QuantMode


def test_the_same_shape_gets_the_same_view_and_names_do_not_share_memory() -> None:
    scratch = Scratch(torch.device("cpu"))
    a = scratch.get("work", (2, 3), torch.float32)
    assert scratch.get("work", (2, 3), torch.float32) is a
    b = scratch.get("other", (2, 3), torch.float32)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    small = scratch.get("work", (5,), torch.float32)  # fits: shares the flat tensor
    assert small.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert scratch.nbytes() == 2 * 6 * 4


def test_growing_a_buffer_drops_every_view_and_memo_made_before() -> None:
    scratch = Scratch(torch.device("cpu"))
    old = scratch.get("work", (4,), torch.float32)
    built = []
    memo = scratch.memo("plan", lambda: built.append(1) or old)
    assert memo is old and scratch.memo("plan", lambda: built.append(2)) is old and built == [1]
    new = scratch.get("work", (1000,), torch.float32)
    assert new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
    assert scratch.get("work", (4,), torch.float32).untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
    scratch.memo("plan", lambda: built.append(3) or new)
    assert built == [1, 3]  # rebuilt: the first memo viewed the dropped tensor


def test_encode_cells_reusing_scratch_across_shapes_and_modes_is_exact() -> None:
    scratch = Scratch(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for rows in (3, 1, 40, 2):
        for mode in QMAX:
            x = (torch.randn(rows, 8, generator=gen) * 5).to(torch.bfloat16)
            cells = encode_cells(x, QuantMode(mode), torch.uint8, scratch=scratch)
            want = [encode_ref(v, mode, "uint8", in_dtype="bfloat16") for v in x.float().tolist()]
            assert [bytes(c) for c in cells.tolist()] == want
