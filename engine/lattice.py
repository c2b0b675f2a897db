"""Exact overlap of two strided byte sets, in closed form over their strides.

A *strided set* is the set of bytes one view writes::

    offset + sum(i_k * stride_k for each level k) + r,   0 <= i_k < count_k,  0 <= r < run

Two sets ``A`` and ``B`` share a byte exactly when some integer combination

    sum(i_k * a_k) - sum(j_k * b_k)  lies in  [oB - oA - (runA - 1), oB - oA + (runB - 1)]

with every coefficient in its box. `meets` decides that by a branch and bound
over the levels of both sets, largest stride first, with equal strides merged
(the sum of two integer ranges is a range): for each level only the
coefficients that the smaller levels can still reach (their exact suffix
minimum and maximum) are tried. Two block levels ``S`` and ``T`` that both have
many blocks are first cut to one period ``lcm(S, T)``: a pair ``(i, j)`` with
``i*S >= lcm`` and ``j*T >= lcm`` gives the same difference as ``(i - lcm/S,
j - lcm/T)``, so one of them can be taken below its period.

Cost: a memory view's levels are well nested (each stride at least the extent
of the levels below it), so each level admits at most about
``1 + extent_below / stride`` candidates, a small constant; the block pair at
most ``min(count, lcm / stride) + 2``, at most ``num_layers + 2`` for the
layouts of a plan. So `meets` is ``O(levels * candidates)`` and does not grow
with block size, heads or head size; `first_shared` adds a binary search per
level (``O(levels^2 * log(count))`` calls of `meets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StridedSet", "first_shared", "meets"]


@dataclass(frozen=True)
class StridedSet:
    """``offset + sum(i_k * stride_k) + [0, run)``, levels as ``(count, stride)`` pairs."""

    offset: int
    levels: tuple[tuple[int, int], ...]
    run: int

    def normal(self) -> StridedSet:
        """The same bytes with non-negative strides, no trivial levels, strides ascending,
        and levels that continue a contiguous run folded into it."""
        offset, levels = self.offset, []
        for count, stride in self.levels:
            if count <= 1 or stride == 0:
                continue
            if stride < 0:
                offset += (count - 1) * stride
                stride = -stride
            levels.append((count, stride))
        levels.sort(key=lambda cs: cs[1])
        run = self.run
        while levels and levels[0][1] == run:  # contiguous: [0, run) repeated at `run` is one longer run
            run *= levels.pop(0)[0]
        return StridedSet(offset, tuple(levels), run)

    def shifted(self, delta: int) -> StridedSet:
        return StridedSet(self.offset + delta, self.levels, self.run)

    @property
    def extent(self) -> int:
        """Bytes from the first to one past the last byte (normalised sets)."""
        return sum((count - 1) * stride for count, stride in self.levels) + self.run

    @property
    def well_nested(self) -> bool:
        """Each stride at least the extent of the levels below it: bytes ascend with the index,
        outermost level first (true of every view of a non-overlapping tensor)."""
        extent = self.run
        for count, stride in sorted(self.levels, key=lambda cs: cs[1]):
            if stride < extent:
                return False
            extent += (count - 1) * stride
        return True


def _terms(a: StridedSet, b: StridedSet) -> list[list[int]]:
    """[stride, min coefficient, max coefficient] of ``sum(i*a) - sum(j*b)``, equal strides merged."""
    merged: dict[int, list[int]] = {}
    for (count, stride), sign in [(lv, 1) for lv in a.levels] + [(lv, -1) for lv in b.levels]:
        lo, hi = (0, count - 1) if sign > 0 else (-(count - 1), 0)
        if stride in merged:
            merged[stride][0] += lo
            merged[stride][1] += hi
        else:
            merged[stride] = [lo, hi]
    terms = sorted(([s, lo, hi] for s, (lo, hi) in merged.items()), key=lambda t: t[0])
    return _fold_multiples(terms)[::-1]


def _fold_multiples(terms: list[list[int]]) -> list[list[int]]:
    """Fold a term into a smaller one whose stride divides its own, where the smaller one's
    range is at least the quotient wide: ``c*m*s + d*s`` then takes every integer multiple
    of ``s`` from ``(m*lo + lo')*s`` to ``(m*hi + hi')*s``, an exact single term. Keeps the
    branch and bound from enumerating coefficient pairs that only restate one another (a
    page stride that is a multiple of a cell stride, say). ``terms`` ascend by stride."""
    out: list[list[int]] = []
    for s, lo, hi in terms:
        for t in out:
            small, small_lo, small_hi = t
            if small > 0 and s % small == 0 and small_hi - small_lo + 1 >= s // small:
                m = s // small
                t[1], t[2] = small_lo + m * lo, small_hi + m * hi
                break
        else:
            out.append([s, lo, hi])
    return out


def _reachable(terms: list[list[int]], low: int, high: int) -> bool:
    """Whether some coefficients in their ranges put ``sum(c * stride)`` in ``[low, high]``."""
    n = len(terms)
    suffix_min, suffix_max = [0] * (n + 1), [0] * (n + 1)
    for k in range(n - 1, -1, -1):
        s, lo, hi = terms[k]
        suffix_min[k] = suffix_min[k + 1] + lo * s
        suffix_max[k] = suffix_max[k + 1] + hi * s

    def search(k: int, low: int, high: int) -> bool:
        if high < low or high < suffix_min[k] or low > suffix_max[k]:
            return False
        if k == n:
            return low <= 0 <= high
        s, lo, hi = terms[k]
        first = max(lo, -((suffix_max[k + 1] - low) // s))  # ceil((low - rest_max) / s)
        last = min(hi, (high - suffix_min[k + 1]) // s)
        return any(search(k + 1, low - c * s, high - c * s) for c in range(first, last + 1))

    return search(0, low, high)


def _period_cuts(a: StridedSet, b: StridedSet) -> list[tuple[StridedSet, StridedSet]]:
    """Sub-problems equivalent to ``(a, b)`` with the outermost levels cut to one common period."""
    if not a.levels or not b.levels:
        return [(a, b)]
    (na, sa), (nb, sb) = a.levels[-1], b.levels[-1]
    if sa == sb:
        return [(a, b)]
    period = math.lcm(sa, sb)
    pa, pb = period // sa, period // sb
    if na <= pa or nb <= pb:
        return [(a, b)]
    cut_a = StridedSet(a.offset, (*a.levels[:-1], (pa, sa)), a.run)
    cut_b = StridedSet(b.offset, (*b.levels[:-1], (pb, sb)), b.run)
    return [(cut_a, b), (a, cut_b)]


def meets(a: StridedSet, b: StridedSet) -> bool:
    """Whether the normalised strided sets ``a`` and ``b`` share at least one byte."""
    if a.run <= 0 or b.run <= 0 or b.offset >= a.offset + a.extent or a.offset >= b.offset + b.extent:
        return False
    low = b.offset - a.offset - (a.run - 1)
    high = b.offset - a.offset + (b.run - 1)
    return any(_reachable(_terms(x, y), low, high) for x, y in _period_cuts(a, b))


def first_shared(a: StridedSet, b: StridedSet) -> int | None:
    """The lowest byte both normalised sets hold, or None; ``a`` must be well nested.

    Bytes of a well-nested set ascend with its index read outermost level first, so the
    lowest shared byte has, level by level, the smallest index whose prefix still meets ``b``:
    a binary search per level, each probe one `meets`.
    """
    if not meets(a, b):
        return None
    offset, levels = a.offset, list(a.levels)
    while levels:
        count, stride = levels.pop()
        lo, hi = 0, count - 1  # smallest c with the prefix [0, c] of this level meeting b
        while lo < hi:
            mid = (lo + hi) // 2
            if meets(StridedSet(offset, (*levels, (mid + 1, stride)), a.run), b):
                hi = mid
            else:
                lo = mid + 1
        offset += lo * stride
    lo, hi = 0, a.run - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(StridedSet(offset, (), mid + 1), b):
            hi = mid
        else:
            lo = mid + 1
    return offset + lo
