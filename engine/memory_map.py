"""A picture of one block's bytes: which layer and role owns each range, overlaps marked.

`block_map(plan)` describes block 0's bytes in every buffer (one row per layer
buffer for per_layer, one row of ``L x page`` for cross_layer) as *bands*: a
segment pattern (pieces of one period, each with the writers that touch it)
repeated ``count`` times at ``period`` bytes. Bands are built directly from the
writers' strides (`kvpolicy.engine.verify.writers`, `kvpolicy.engine.lattice`):
writers with the same strides whose offsets fall inside one innermost period
(vLLM 0.34's K and V alternating inside each cell, a cell's codes and scales)
share a band, and outer levels that continue the period fold into its count. So
the cost is ``O(W log W)`` for ``W`` writers (4 per layer) however large the
block, heads or head size; nothing is listed cell by cell.

Bands whose byte ranges meet are merged by sweeping their patterns over one
period when they share it (vLLM #48412's naive scale views: every layer's scale
lands inside layer 0's cells); the pieces written by two layers are the
overlaps, at their exact offsets. Rendered here as text for the terminal; as SVG by
`kvpolicy.engine.map_svg`.
Pure Python.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvpolicy.engine.lattice import StridedSet
from kvpolicy.engine.plan import LayoutPlan
from kvpolicy.engine.verify import GeometryReport, Writer, verify_plan, writers
from kvpolicy.policy.backends import ScaleViews

__all__ = ["Band", "Segment", "apart_note", "block_map", "render_text"]

Owner = tuple[int, str]  # (layer, role)

_MAX_INSTANCES = 1024  # outer repetitions of one band listed before they are kept as a repeat of the band
_MAX_EXPANDED = 20_000  # runs a meeting of unlike bands may list before it is drawn as one mixed range


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` (relative to its band inside a band's pattern) and who writes them."""

    buffer: int
    start: int
    end: int
    owners: tuple[Owner, ...]  # (layer, role) pairs, sorted; empty for padding

    @property
    def overlap(self) -> bool:
        return len({_unit(o) for o in self.owners}) > 1

    def label(self) -> str:
        return _owners_label(self.owners)


@dataclass(frozen=True)
class Band:
    """``pattern`` (pieces within ``[0, period)``) repeated ``count`` times from ``start``,
    and that whole group again at each of ``outer``'s ``(count, stride)`` offsets."""

    buffer: int
    start: int
    period: int
    count: int
    pattern: tuple[Segment, ...]
    outer: tuple[tuple[int, int], ...] = ()

    @property
    def span(self) -> int:
        """Bytes of one group: ``count`` periods, the last one cut at its last piece."""
        return (self.count - 1) * self.period + self.pattern[-1].end

    @property
    def end(self) -> int:
        return self.start + sum((n - 1) * s for n, s in self.outer) + self.span

    @property
    def repeats(self) -> int:
        return self.count * math.prod(n for n, _ in self.outer)

    @property
    def owners(self) -> tuple[Owner, ...]:
        return tuple(sorted({o for p in self.pattern for o in p.owners}))

    @property
    def overlap(self) -> bool:
        return any(p.overlap for p in self.pattern)

    def label(self) -> str:
        if self.repeats == 1 and len(self.pattern) == 1:
            return self.pattern[0].label()
        inner = " | ".join(f"{p.end - p.start} B {p.label()}" for p in self.pattern)
        if self.outer:  # `count` periods, that group again at each outer repeat
            again = ", ".join(f"{n} x every {s} B" for n, s in self.outer)
            return f"{self.count} x [{inner}] every {self.period} B, then {again} ({self.repeats} in all)"
        every = self.count > 1 and self.pattern[-1].end < self.period
        return f"{self.repeats} x [{inner}]" + (f" every {self.period} B" if every else "")

    def to_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer, "start": self.start, "end": self.end, "period": self.period,
                "count": self.count, "outer": [list(o) for o in self.outer],
                "owners": [list(o) for o in self.owners], "overlap": self.overlap,
                "pattern": [{"start": p.start, "end": p.end, "owners": [list(o) for o in p.owners],
                             "overlap": p.overlap} for p in self.pattern]}


def _unit(owner: Owner) -> tuple[int, str]:
    """(layer, K|V|latent): data and scales of one cell group belong together."""
    layer, role = owner
    return layer, role.split("_")[0]


def _span(layers: list[int]) -> str:
    if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}..{layers[-1]}"
    return ("layer " if len(layers) == 1 else "layers ") + ",".join(map(str, layers))


def _owners_label(owners: tuple[Owner, ...]) -> str:
    if not owners:
        return "padding"
    units = sorted({_unit(o) for o in owners})
    roles = sorted({r for _, r in owners})
    if len(units) == 1:
        layer, kv = units[0]
        parts = sorted({r.split("_")[1] for _, r in owners})
        return f"layer {layer} {kv.upper()} " + "+".join(parts)
    return f"OVERLAP {_span(sorted({u[0] for u in units}))} " + "/".join(r.replace("_", " ") for r in roles)


def _region(plan: LayoutPlan, buffer: int) -> StridedSet:
    """Block 0's bytes in ``buffer``, from the buffer's own dims: every index but the block's at 0.

    Where a (block, layer) page is contiguous (every dim inside the innermost block or layer dim
    is a page dim) the page is taken whole, its padding included; else (LHBNC: a page is H runs
    apart) the runs alone. One run for block-outermost layouts; L pages a layer slab apart for a
    layer-outermost layout in one buffer (vLLM 0.29+'s per_layer); L x H runs for LHBNC.
    """
    buf = plan.buffers[buffer]
    elem = plan.element_size
    dims = list(zip(buf.dims, buf.shape, buf.strides, strict=True))
    run, cut = elem, len(dims)
    for k in range(len(dims) - 1, -1, -1):
        name, _n, stride = dims[k]
        if name in ("block", "layer"):
            if stride * elem == plan.page_size_bytes:  # everything inside is one padded page
                run, cut = plan.page_size_bytes, k + 1
            break
    levels = tuple((n, s * elem) for name, n, s in dims[:cut] if name != "block")
    return StridedSet(0, levels, run).normal()


def _block_stride(plan: LayoutPlan, buffer: int) -> int:
    buf = plan.buffers[buffer]
    return buf.strides[buf.dims.index("block")] * plan.element_size


def _contains(region: StridedSet, address: int) -> bool:
    """Whether ``address`` is one of ``region``'s bytes (a well-nested set: greedy from the outside)."""
    x = address - region.offset
    if x < 0:
        return False
    for n, s in reversed(region.levels):
        x -= min(x // s, n - 1) * s
    return x < region.run


def _ranges(region: StridedSet, limit: int) -> list[tuple[int, int]] | None:
    """``region``'s contiguous runs in order, or None when there are more than ``limit``."""
    if math.prod(n for n, _ in region.levels) > limit:
        return None
    starts = [region.offset]
    for n, s in reversed(region.levels):
        starts = [x + i * s for x in starts for i in range(n)]
    return [(x, x + region.run) for x in starts]


def _row(plan: LayoutPlan, buffer: int) -> tuple[int, int]:
    """First and one past the last byte of block 0 in ``buffer`` (`_region` says which bytes between)."""
    region = _region(plan, buffer)
    return region.offset, region.offset + region.extent


def _in_block0(w: Writer, region: StridedSet, block_stride: int) -> list[StridedSet]:
    """``w`` cut to the bytes it writes in block 0's ``region``, as strided sets.

    One contiguous region: every block of ``w`` that can reach it (a naive scale view's later
    blocks land in block 0's row). Else block 0 of a view stepping by the buffer's block stride
    (it lies in the region); a view that does not (a naive scale view) listed run by run over
    every block and cut to the region's runs, while that is few (`_MAX_EXPANDED`)."""
    hi = region.offset + region.extent
    if not region.levels:  # one contiguous run: every block that can reach it
        blocks = max(1, min(w.num_blocks, (hi - 1 - w.base) // w.block_stride + 1 if w.block_stride else 1))
        return [StridedSet(w.base, ((blocks, w.block_stride), *w.inner), w.run).normal()]
    if w.block_stride in (0, block_stride):
        return [StridedSet(w.base, w.inner, w.run).normal()]
    ranges = _ranges(region, _MAX_EXPANDED)
    if ranges is None or w.num_blocks * math.prod(n for n, _ in w.inner) > _MAX_EXPANDED:
        return [StridedSet(w.base, w.inner, w.run).normal()]  # a forced naive view over a huge cache: left uncut
    cut: list[tuple[int, int]] = []
    for s, e in w.runs(w.num_blocks):
        k = bisect.bisect_right(ranges, (s, math.inf)) - 1
        for lo, hi_ in ranges[max(k, 0):]:
            if lo >= e:
                break
            if hi_ > s:
                cut.append((max(s, lo), min(e, hi_)))
    return [StridedSet(s, (), e - s) for s, e in cut]


def _joined(ws: list[Writer], region: StridedSet, block_stride: int
            ) -> list[tuple[tuple[Owner, ...], StridedSet]]:
    """Each writer cut to block 0 as strided sets; a unit's codes and the scales right after them joined."""
    cuts = {(w.layer, w.role): _in_block0(w, region, block_stride) for w in ws}
    sets = {owner: c[0] for owner, c in cuts.items() if len(c) == 1}
    out: list[tuple[tuple[Owner, ...], StridedSet]] = []
    used: set[Owner] = set()
    for (layer, role), d in sets.items():
        scale = (layer, role.replace("_data", "_scale"))
        sc = sets.get(scale) if role.endswith("_data") else None
        if sc is not None and sc.levels == d.levels and sc.offset == d.offset + d.run:
            out.append((((layer, role), scale), StridedSet(d.offset, d.levels, d.run + sc.run).normal()))
            used |= {(layer, role), scale}
    out += [((owner,), st) for owner, c in cuts.items() if owner not in used for st in c]
    return out


def _sweep(buffer: int, pieces: Iterable[tuple[int, int, tuple[Owner, ...]]]) -> list[Segment]:
    """Cut the pieces at every boundary and name the writers covering each part (gaps left out)."""
    events = sorted([(s, 1, o) for s, _, owners in pieces for o in owners]
                    + [(e, -1, o) for _, e, owners in pieces for o in owners])
    active: dict[Owner, int] = {}
    out: list[Segment] = []
    prev = None
    for pos, delta, owner in events:
        if prev is not None and pos > prev and active:
            out.append(Segment(buffer, prev, pos, tuple(sorted(active))))
        active[owner] = active.get(owner, 0) + delta
        if active[owner] == 0:
            del active[owner]
        prev = pos
    return _fold(out)


def _fold(raw: list[Segment]) -> list[Segment]:
    """Merge contiguous neighbours that belong to the same single (layer, K|V), or the same owners."""
    out: list[Segment] = []
    for seg in raw:
        if out and out[-1].end == seg.start:
            prev = out[-1]
            units = {_unit(o) for o in prev.owners}
            if prev.owners == seg.owners or (len(units) == 1 and units == {_unit(o) for o in seg.owners}):
                out[-1] = Segment(prev.buffer, prev.start, seg.end, tuple(sorted(set(prev.owners + seg.owners))))
                continue
        out.append(seg)
    return out


def _group_bands(buffer: int, items: list[tuple[tuple[Owner, ...], StridedSet]]) -> list[Band]:
    """Writers with the same strides whose offsets fall inside one innermost period share a band;
    levels continuing the period fold into its count, the rest stay outer repeats."""
    by_levels: dict[tuple[tuple[int, int], ...], list[tuple[tuple[Owner, ...], StridedSet]]] = {}
    for owners, st in items:
        by_levels.setdefault(st.levels, []).append((owners, st))
    bands: list[Band] = []
    for levels, group in by_levels.items():
        group.sort(key=lambda it: (it[1].offset, it[0]))
        period = levels[0][1] if levels else 0
        i = 0
        while i < len(group):
            o0 = group[i][1].offset
            j = i + 1
            while levels and j < len(group) and group[j][1].offset + group[j][1].run <= o0 + period:
                j += 1
            pieces = [(st.offset - o0, st.offset - o0 + st.run, owners) for owners, st in group[i:j]]
            i = j
            pattern = tuple(_sweep(buffer, pieces))
            if not levels:
                bands.append(_band(buffer, o0, pattern[-1].end, 1, pattern))
                continue
            count, rest = levels[0][0], list(levels[1:])
            while rest and rest[0][1] == count * period:
                count *= rest.pop(0)[0]
            bands.append(_band(buffer, o0, period, count, pattern, tuple(rest)))
    return bands


def _band(buffer: int, start: int, period: int, count: int, pattern: tuple[Segment, ...],
          outer: tuple[tuple[int, int], ...] = ()) -> Band:
    """A band, one piece filling its whole period folded to one run, gaps between pieces as padding."""
    filled: list[Segment] = []
    for piece in pattern:
        if filled and filled[-1].end < piece.start:
            filled.append(Segment(buffer, filled[-1].end, piece.start, ()))
        filled.append(piece)
    pattern = tuple(filled)
    if count > 1 and len(pattern) == 1 and pattern[0].start == 0 and pattern[0].end == period:
        whole = period * count
        return Band(buffer, start, whole, 1, (Segment(buffer, 0, whole, pattern[0].owners),), outer)
    return Band(buffer, start, period, count, pattern, outer)


def _units(buffer: int, bands: list[Band]) -> list[list[Band]]:
    """Bands as units that never share a byte with each other inside: a band alone, or bands with one
    outer repeat ``(n, S)`` whose first instances are disjoint and lie in one window of ``S`` bytes (BHLNC:
    each head's slab holds every layer), with padding bands for the window's gaps. A unit's instances
    interleave with no other's, so the map keeps one band per writer group however many heads there
    are. A band with several outer levels, or wider than its repeat, is listed instance by instance
    when there are few (`_MAX_INSTANCES`)."""
    out: list[list[Band]] = []
    by_outer: dict[tuple[tuple[int, int], ...], list[Band]] = {}
    for b in bands:
        if len(b.outer) == 1 and b.span <= b.outer[0][1]:
            by_outer.setdefault(b.outer, []).append(b)
        elif b.outer and math.prod(n for n, _ in b.outer) <= _MAX_INSTANCES:
            out += [[one] for one in _instances(b)]
        else:
            out.append([b])
    for outer, group in by_outer.items():
        (n, stride), = outer
        group.sort(key=lambda b: (b.start, b.span))
        unit: list[Band] = []
        for b in group:
            if unit and (b.start < unit[-1].start + unit[-1].span or b.start + b.span > unit[0].start + stride):
                out.append(_window(buffer, unit, n, stride))
                unit = []
            unit.append(b)
        out.append(_window(buffer, unit, n, stride))
    return out


def _window(buffer: int, unit: list[Band], n: int, stride: int) -> list[Band]:
    """``unit`` (bands repeated ``n`` times every ``stride`` bytes) with its gaps as padding bands."""
    if len(unit) == 1:
        return unit
    out: list[Band] = []
    pos = unit[0].start
    for b in unit:
        if b.start > pos:
            out.append(_pad(buffer, pos, b.start, ((n, stride),)))
        out.append(b)
        pos = b.start + b.span
    if n > 1 and pos < unit[0].start + stride:  # between one instance and the next
        out.append(_pad(buffer, pos, unit[0].start + stride, ((n - 1, stride),) if n > 2 else ()))
    return out


def _pad(buffer: int, start: int, end: int, outer: tuple[tuple[int, int], ...] = ()) -> Band:
    return Band(buffer, start, end - start, 1, (Segment(buffer, 0, end - start, ()),), outer)


def _instances(b: Band) -> list[Band]:
    """A band's outer repeats, each a band of its own."""
    starts = [b.start]
    for n, s in b.outer:
        starts = [x + i * s for x in starts for i in range(n)]
    return [Band(b.buffer, x, b.period, b.count, b.pattern) for x in starts]


def _merge(buffer: int, cluster: list[Band]) -> list[Band]:
    """Bands whose byte ranges meet, as bands that do not: swept over one shared period when
    they have one, else listed run by run (bounded; past the bound, one mixed range)."""
    if len(cluster) == 1:
        return cluster
    s0 = min(b.start for b in cluster)
    period, count = cluster[0].period, cluster[0].count
    if all(not b.outer and b.period == period and b.count == count and b.start - s0 + b.pattern[-1].end <= period
           for b in cluster):
        pieces = [(b.start - s0 + p.start, b.start - s0 + p.end, p.owners) for b in cluster for p in b.pattern]
        return [_band(buffer, s0, period, count, tuple(_sweep(buffer, pieces)))]
    if sum(b.repeats * len(b.pattern) for b in cluster) > _MAX_EXPANDED:
        end = max(b.end for b in cluster)
        owners = tuple(sorted({o for b in cluster for o in b.owners}))
        return [Band(buffer, s0, end - s0, 1, (Segment(buffer, 0, end - s0, owners),))]
    runs = []
    for b in _expand_outer_all(cluster):
        for k in range(b.count):
            runs += [(b.start + k * b.period + p.start, b.start + k * b.period + p.end, p.owners) for p in b.pattern]
    return _recompress(buffer, _sweep(buffer, runs))


def _expand_outer_all(bands: list[Band]) -> list[Band]:
    return [one for b in bands for one in _instances(b)]


def _recompress(buffer: int, segs: list[Segment]) -> list[Band]:
    """Absolute segments as bands, a pattern of up to 4 contiguous segments repeated 3+ times folded."""
    out: list[Band] = []
    i = 0
    while i < len(segs):
        best = (1, 1)
        for period in range(1, 5):
            unit = segs[i:i + period]
            if len(unit) < period or any(a.end != b.start for a, b in itertools.pairwise(unit)):
                break
            width = unit[-1].end - unit[0].start
            key = [(s.owners, s.start - unit[0].start, s.end - unit[0].start) for s in unit]
            reps = 1
            while True:
                nxt = segs[i + reps * period: i + (reps + 1) * period]
                base = unit[0].start + reps * width
                if [(s.owners, s.start - base, s.end - base) for s in nxt] != key:
                    break
                reps += 1
            if reps >= 3 and reps * period > best[0] * best[1]:
                best = (period, reps)
        period, reps = best
        unit = segs[i:i + period]
        s0 = unit[0].start
        pattern = tuple(Segment(buffer, s.start - s0, s.end - s0, s.owners) for s in unit)
        out.append(_band(buffer, s0, pattern[-1].end, reps, pattern))
        i += period * reps
    return out


def _padded(buffer: int, bands: list[Band], ranges: list[tuple[int, int]]) -> list[Band]:
    """``bands`` with a padding band in every gap of block 0's ``ranges`` (the bytes between the
    ranges hold other blocks: no band)."""
    out: list[Band] = []
    i, pos = 0, -1
    for lo, hi in ranges:
        pos = max(pos, lo)
        while i < len(bands) and bands[i].start < hi:
            b = bands[i]
            if b.start > pos:
                out.append(_pad(buffer, pos, b.start))
            out.append(b)
            pos = max(pos, b.end)
            i += 1
        if hi > pos:
            out.append(_pad(buffer, pos, hi))
    return out + bands[i:]


def block_map(plan: LayoutPlan, scale_views: ScaleViews | None = None) -> list[Band]:
    """Bands of block 0, in (buffer, offset) order, gaps as padding bands.

    A layer's K (or V) codes and the inline scales right after them are joined into one
    strided set first; then writers sharing strides and an innermost period share a band
    (see the module docstring). Cost ``O(W log W)`` for ``W`` writers, independent of block
    size, heads and head size.
    """
    by_buffer: dict[int, list[Writer]] = {}
    for w in writers(plan, scale_views):
        by_buffer.setdefault(w.buffer, []).append(w)
    out: list[Band] = []
    for buffer, ws in sorted(by_buffer.items()):
        region = _region(plan, buffer)
        hi = region.offset + region.extent
        bands = [b for b in _group_bands(buffer, _joined(ws, region, _block_stride(plan, buffer))) if b.start < hi]
        units = sorted(_units(buffer, bands), key=lambda u: (u[0].start, max(b.end for b in u)))
        merged: list[Band] = []
        cluster: list[list[Band]] = []
        reach = -1
        for unit in units:
            if cluster and unit[0].start >= reach:
                merged += _merge_units(buffer, cluster)
                cluster = []
            cluster.append(unit)
            reach = max(reach, max(b.end for b in unit)) if len(cluster) > 1 else max(b.end for b in unit)
        if cluster:
            merged += _merge_units(buffer, cluster)
        # the bytes of block 0 not written: padding (none listed where block 0 is too many runs)
        ranges = _ranges(region, max(_MAX_INSTANCES, 4 * len(ws))) or []
        out += _padded(buffer, merged, ranges)
    return out


def _merge_units(buffer: int, cluster: list[list[Band]]) -> list[Band]:
    """A unit alone as it is; units whose byte ranges meet merged (`_merge`)."""
    if len(cluster) == 1:
        return sorted(cluster[0], key=lambda b: (b.start, b.end))
    return _merge(buffer, [b for unit in cluster for b in unit])


def apart_note(plan: LayoutPlan) -> str:
    """What the map leaves out where block 0 is not one run per buffer (per_layer in one buffer:
    a page per layer, a slab apart; LHBNC: a run per layer and head); "" where it is."""
    regions = {_region(plan, b.index) for b in plan.buffers}
    if all(not r.levels for r in regions):
        return ""
    runs = max(math.prod(n for n, _ in r.levels) for r in regions)
    run = max(r.run for r in regions)
    return (f"block 0 is {runs} runs of {run} B in each buffer; the bytes between them hold other blocks "
            "and are not drawn")


def _line(plan: LayoutPlan, band: Band) -> str:
    mark = "!!" if band.overlap else "  "
    where = f"buf {band.buffer:<3}" if len(plan.buffers) > 1 else ""
    return f"{mark} {where}{band.start:>9} .. {band.end:<9} {band.end - band.start:>7} B  {band.label()}"


def _pieces(bands: list[Band]) -> tuple[int, int]:
    """(segments, overlapping segments) the bands stand for, counted without listing them."""
    total = sum(b.repeats * len(b.pattern) for b in bands)
    over = sum(b.repeats * sum(1 for p in b.pattern if p.overlap) for b in bands)
    return total, over


def render_text(plan: LayoutPlan, scale_views: ScaleViews | None = None, max_lines: int = 60,
                report: GeometryReport | None = None) -> str:
    """The block map as aligned text lines, one per band; ``report``: the verifier's, when already run."""
    strategy = scale_views or plan.backend.scale_views
    bands = block_map(plan, strategy)
    report = report if report is not None and report.scale_views is strategy else verify_plan(plan, strategy)
    head = [f"block 0 of `{plan.layout}` on {plan.backend.name} ({strategy.value} scale views), "
            f"page {plan.page_size_bytes} B x {plan.num_layers} layers; !! marks bytes two layers write:"]
    apart = apart_note(plan)
    if apart:
        head.append(f"   ({apart})")
    lines = [_line(plan, b) for b in bands]
    if len(lines) > max_lines:
        lines = [*lines[: max_lines - 10], f"   ... {len(lines) - max_lines + 5} more lines ...", *lines[-5:]]
    total, n_over = _pieces(bands)
    tail = [f"{total} segments; " + (f"{n_over} overlapping: {report.collisions[0].describe()}"
                                     if n_over or not report.ok else "no overlaps")]
    return "\n".join(head + lines + tail)

