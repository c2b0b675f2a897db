"""Exact overlap of strided byte sets, held to enumerating their bytes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.engine.lattice import StridedSet, first_shared, meets


def bytes_of(s: StridedSet) -> set[int]:
    out = set()
    for idx in itertools.product(*(range(n) for n, _ in s.levels)):
        start = s.offset + sum(i * st for i, (_, st) in zip(idx, s.levels))
        out.update(range(start, start + s.run))
    return out


levels = st.lists(st.tuples(st.integers(1, 4), st.integers(-12, 40)), max_size=3)
sets = st.builds(StridedSet, st.integers(-30, 60), levels.map(tuple), st.integers(1, 9))


@settings(max_examples=1500, deadline=None)
@given(sets, sets)
def test_meets_is_exact_for_any_strides(a: StridedSet, b: StridedSet) -> None:
    """Strides of any sign and size, interleaved or not: the verdict is the enumeration's."""
    assert bytes_of(a.normal()) == bytes_of(a)
    assert meets(a.normal(), b.normal()) is bool(bytes_of(a) & bytes_of(b))


@st.composite
def commensurate(draw) -> StridedSet:
    """Strides that are multiples of one another (a page of cells, a block of pages), with
    counts either side of their quotients: where the search folds one term into another."""
    base = draw(st.integers(1, 6))
    lv = tuple((draw(st.integers(1, 7)), base * draw(st.integers(1, 8))) for _ in range(draw(st.integers(1, 3))))
    return StridedSet(draw(st.integers(-20, 40)), lv, draw(st.integers(1, 5)))


@settings(max_examples=1500, deadline=None)
@given(commensurate(), commensurate())
def test_meets_is_exact_where_strides_divide_one_another(a: StridedSet, b: StridedSet) -> None:
    assert meets(a.normal(), b.normal()) is bool(bytes_of(a) & bytes_of(b))


@st.composite
def nested(draw) -> StridedSet:
    """A view of a non-overlapping tensor: each stride at least the extent below it."""
    run = draw(st.integers(1, 8))
    extent, lv = run, []
    for _ in range(draw(st.integers(0, 3))):
        count, stride = draw(st.integers(1, 5)), extent + draw(st.integers(0, 7))
        lv.append((count, stride))
        extent = stride * (count - 1) + extent
    return StridedSet(draw(st.integers(0, 80)), tuple(lv), run)


@settings(max_examples=1500, deadline=None)
@given(nested(), nested())
def test_first_shared_is_the_lowest_common_byte(a: StridedSet, b: StridedSet) -> None:
    a, b = a.normal(), b.normal()
    assert a.well_nested
    common = bytes_of(a) & bytes_of(b)
    assert first_shared(a, b) == (min(common) if common else None)


def test_the_block_period_keeps_many_blocks_cheap_and_exact() -> None:
    """#48412's shape at Llama-70B scale: a naive scale view stepping one page per block
    against layer 79's real K cells stepping 80 pages: it lands on their scales from block 79
    on, never on their codes."""
    page, cell = 2 * 4096 * 8 * 132, 132
    naive = StridedSet(128, ((100_000, page), (4096 * 8, cell)), 4).normal()
    codes = StridedSet(79 * page, ((100_000, 80 * page), (4096 * 8, cell)), 128).normal()
    scales = StridedSet(79 * page + 128, ((100_000, 80 * page), (4096 * 8, cell)), 4).normal()
    assert first_shared(naive, scales) == 79 * page + 128
    assert not meets(naive, codes)
