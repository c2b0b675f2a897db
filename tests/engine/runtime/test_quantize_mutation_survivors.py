"""Tests written for the survivors of the mutation run of issue 32 in `kvpolicy.engine.runtime.quantize`."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.engine.runtime.quantize import cell_bytes, decode_cells, encode_cells
from kvpolicy.policy.quant import QuantMode


@pytest.mark.parametrize("mode", [QuantMode.int8_per_token_head, QuantMode.fp8_per_token_head,
                                  QuantMode.int4_per_token_head])
@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64)])
def test_encoding_no_values_gives_no_cells(mode: QuantMode, shape: tuple[int, ...]) -> None:
    """An empty input (no tokens) encodes to an empty cell tensor, as the public `encode_cells` promises."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    cells = encode_cells(x, mode, torch.uint8)
    assert cells.shape == (*shape[:-1], cell_bytes(mode, 64, torch.uint8)) and cells.dtype == torch.uint8
    assert decode_cells(cells, mode, 64, torch.uint8, torch.bfloat16).shape == shape


@pytest.mark.parametrize("mode", [QuantMode.int8_per_token_head, QuantMode.int4_per_token_head, QuantMode.none])
def test_encoding_in_small_chunks_gives_the_bytes_of_one_pass(mode: QuantMode, monkeypatch: pytest.MonkeyPatch) -> None:
    """`encode_cells` of an input larger than `CHUNK_VALUES` goes a chunk of tokens at a time, same bytes."""
    from kvpolicy.engine.runtime import quantize

    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(32)).to(torch.bfloat16)
    dtype = torch.bfloat16 if mode is QuantMode.none else torch.uint8
    whole = encode_cells(x, mode, dtype)
    monkeypatch.setattr(quantize, "CHUNK_VALUES", 3 * 64)  # 3 of the 10 heads a pass: 4 passes, the last short
    assert torch.equal(encode_cells(x, mode, dtype), whole)
