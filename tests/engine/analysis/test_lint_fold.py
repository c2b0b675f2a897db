"""Lint folds a finding's near-identical inputs into one line each, with exact counts (#15)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.engine.analysis.lint import fold

KEYS = ("kv_cache_dtype", "backend", "groups", "connector")
VALUES = st.sampled_from(["a", "b", "c", "d"])


def expand(line: str) -> set[tuple[tuple[str, str], ...]]:
    parts = []
    for part in line.split(" "):
        key, value = part.split("=", 1)
        values = value[1:-1].split(",") if value.startswith("{") else [value]
        parts.append([(key, v) for v in values])
    return set(itertools.product(*parts))


@given(st.sets(st.tuples(*(VALUES for _ in KEYS)), min_size=1, max_size=40))
def test_folded_lines_stand_for_exactly_the_inputs(rows) -> None:
    inputs = [tuple(zip(KEYS, row)) for row in sorted(rows)]
    groups = fold(inputs)
    assert sum(n for _, n in groups) == len(inputs)
    covered: set[tuple[tuple[str, str], ...]] = set()
    for line, n in groups:
        got = expand(line)
        assert len(got) == n and not got & covered
        covered |= got
    assert covered == set(inputs)


def test_a_full_product_folds_to_one_line() -> None:
    inputs = [(("kv_cache_dtype", d), ("backend", b), ("groups", "1x1"))
              for d in ("fp8", "int8", "int4") for b in ("FLASHINFER", "TRITON_ATTN")]
    assert fold(inputs) == (("kv_cache_dtype={fp8,int4,int8} backend={FLASHINFER,TRITON_ATTN} groups=1x1", 6),)
