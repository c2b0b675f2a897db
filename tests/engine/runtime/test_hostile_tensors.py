"""Tensors of another layout (sparse, nested) passed where the cache wants dense ones: an `InputError` naming
the argument, and no byte of the cache changed, never a RuntimeError from inside torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_allocate import fill_random, make_plan

from kvpolicy.engine.runtime import KVCache, allocate
from kvpolicy.policy.errors import InputError


def _cache() -> KVCache:
    c = allocate(make_plan(layout="LBNHC", kv_cache_dtype="fp8", num_blocks=5))
    fill_random(c)
    return c


def _kv(t: int = 1) -> torch.Tensor:
    return torch.ones(t, 2, 8, dtype=torch.float32)


def _page() -> int:
    return make_plan(layout="LBNHC", kv_cache_dtype="fp8").page_size_bytes


S0 = torch.tensor([0])
CASES: list[tuple[str, Callable[[KVCache], Any], str]] = [
    ("sparse key", lambda c: c.write(0, _kv().to_sparse(), _kv(), S0), "key"),
    ("sparse value", lambda c: c.write(0, _kv(), _kv().to_sparse(), S0), "value"),
    ("nested key", lambda c: c.write(0, torch.nested.nested_tensor([_kv()[0]]), _kv(), S0), "key"),
    ("nested keys", lambda c: c.write_layers(torch.nested.nested_tensor([_kv()] * 3), None, S0), "keys"),
    ("sparse slot_mapping", lambda c: c.write(0, _kv(), _kv(), S0.to_sparse()), "slot_mapping"),
    ("sparse read slots", lambda c: c.read(0, S0.to_sparse()), "slot_mapping"),
    ("sparse block ids", lambda c: c.offload(torch.tensor([0, 1]).to_sparse()), "block_ids"),
    ("sparse restore ids", lambda c: c.restore(torch.tensor([0]).to_sparse(),
                                               torch.zeros(1, 3, _page(), dtype=torch.uint8)), "block_ids"),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors are a prototype API
@pytest.mark.parametrize(("call", "arg"), [(c, a) for _, c, a in CASES], ids=[n for n, _, _ in CASES])
def test_a_tensor_of_another_layout_is_refused_by_name(call: Callable[[KVCache], Any], arg: str) -> None:
    c = _cache()
    before = [r.clone() for r in c.raw]
    with pytest.raises(InputError) as err:
        call(c)
    assert err.value.diagnostics[0].file == arg
    assert all(torch.equal(a, b) for a, b in zip(before, c.raw, strict=True))
