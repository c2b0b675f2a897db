"""Corruption cannot happen silently: properties over random blocks and data, for every
layout x quant mode the shipped rules can allow (every plannable combination).

- offload then restore of any set of blocks is byte-exact, and restoring a subset
  touches no other block;
- restoring into a cache of another geometry is refused and writes nothing;
- `KVCache.verify()` holds after any sequence of writes and transfers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_allocate import COMBO_IDS, COMBOS, fill_random, make_plan

from kvpolicy.engine.runtime import allocate
from kvpolicy.policy.errors import PolicyError

BLOCKS = 6


@pytest.mark.parametrize(("backend", "layout", "dtype"), COMBOS, ids=COMBO_IDS)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_any_blocks_offload_and_restore_exactly(backend: str, layout: str, dtype: str, data: st.DataObject) -> None:
    cache = allocate(make_plan(backend, layout, kv_cache_dtype=dtype, num_blocks=BLOCKS))
    fill_random(cache, seed=data.draw(st.integers(0, 2**16)))
    before = [r.clone() for r in cache.raw]
    ids = data.draw(st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True))
    saved = cache.offload(ids)
    # scribble over the chosen blocks (through another transfer of random bytes), then restore them
    cache.restore(ids, torch.randint(0, 256, saved.data.shape, dtype=torch.uint8), assume_same_layout=True)
    cache.restore(ids, saved)
    for r, b in zip(cache.raw, before, strict=True):
        assert torch.equal(r, b)
    cache.verify(geometry=False)  # tensors still match the plan after transfers


@pytest.mark.parametrize(("backend", "layout", "dtype"), COMBOS[::7], ids=COMBO_IDS[::7])
def test_restore_into_another_geometry_is_refused_and_writes_nothing(backend: str, layout: str, dtype: str) -> None:
    src = allocate(make_plan(backend, layout, kv_cache_dtype=dtype, num_blocks=BLOCKS))
    fill_random(src, seed=1)
    other_layers = allocate(make_plan(backend, layout, kv_cache_dtype=dtype, num_blocks=BLOCKS, num_layers=4))
    fill_random(other_layers, seed=2)
    before = [r.clone() for r in other_layers.raw]
    with pytest.raises(PolicyError):
        other_layers.restore([0, 1], src.offload([0, 1]))
    for r, b in zip(other_layers.raw, before, strict=True):
        assert torch.equal(r, b)
