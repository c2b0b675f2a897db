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
