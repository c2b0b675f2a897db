"""A picture of one block's bytes: which layer and role owns each range, overlaps marked.

`block_map(plan)` lists the byte segments of block 0 in every buffer (one
row per layer buffer for per_layer, one row of ``L x page`` for cross_layer),
each with the writers that touch it; data and inline scales of one (layer, K|V)
fold into one segment when nothing else lies between them. Rendered as text
for the terminal and as SVG for a browser. Pure Python.
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from dataclasses import dataclass

from kvpolicy.engine.lattice import StridedSet
from kvpolicy.engine.plan import LayoutPlan
from kvpolicy.engine.verify import Writer, verify_plan, writers
from kvpolicy.policy.backends import ScaleViews

__all__ = ["Segment", "block_map", "render_svg", "render_text"]


@dataclass(frozen=True)
class Segment:
    buffer: int
    start: int  # byte offset inside the block's row
    end: int
    owners: tuple[tuple[int, str], ...]  # (layer, role) pairs, sorted

    @property
    def overlap(self) -> bool:
        return len({o for o in self.owners}) > 1 and len({_unit(o) for o in self.owners}) > 1

    def label(self) -> str:
        return _owners_label(self.owners)


def _unit(owner: tuple[int, str]) -> tuple[int, str]:
    """(layer, K|V|latent): data and scales of one cell group belong together."""
    layer, role = owner
    return layer, role.split("_")[0]


def _owners_label(owners: tuple[tuple[int, str], ...]) -> str:
    units = sorted({_unit(o) for o in owners})
    roles = sorted({r for _, r in owners})
    if len(units) == 1:
        layer, kv = units[0]
        parts = sorted({r.split("_")[1] for _, r in owners})
        return f"layer {layer} {kv.upper()} " + "+".join(parts)
    layers = sorted({u[0] for u in units})
    span = f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) and \
        len(layers) > 2 else "layers " + ",".join(map(str, layers))
    return f"OVERLAP {span} " + "/".join(r.replace("_", " ") for r in roles)


def _row(plan: LayoutPlan, buffer: int) -> tuple[int, int]:
    """Byte range of block 0 in ``buffer``."""
    if not plan.transfer:  # no contiguous page per block (LHBNC): block 0 spans the buffer
        return 0, plan.buffers[buffer].nbytes
    tv = plan.transfer[buffer if len(plan.buffers) > 1 else 0]
    if len(tv.shape) == 3:  # layer-outermost cross layout: the block's pages are one slab apart
        return 0, tv.byte_strides[1] * (plan.num_layers - 1) + plan.page_size_bytes
    return 0, tv.shape[1]


def block_map(plan: LayoutPlan, scale_views: ScaleViews | None = None) -> list[Segment]:
    """Segments of block 0, in (buffer, offset) order, with their owners.

    A layer's K (or V) codes and the inline scales right after them are joined into one
    strided set first, whose contiguous levels fold into one run: a stride-aware cell
    group is then a handful of runs however many tokens and heads it holds, and only
    writers that do not tile their layer's bytes (vLLM #48412's naive scale views) are
    listed cell by cell.
    """
    ws = writers(plan, scale_views)
    segments: list[Segment] = []
    buffers = sorted({w.buffer for w in ws})
    for buffer in buffers:
        lo, hi = _row(plan, buffer)
        points: list[tuple[int, int, tuple[tuple[int, str], ...]]] = []
        for owners, strided in _joined([w for w in ws if w.buffer == buffer], lo, hi):
            for s, e in _runs_within(strided, lo, hi):
                points.append((max(s, lo), min(e, hi), owners))
        segments += _fold(_sweep(buffer, points))
    return segments


def _in_row(w: Writer, lo: int, hi: int) -> StridedSet:
    """``w`` cut to the blocks that can reach ``[lo, hi)``."""
    blocks = max(1, min(w.num_blocks, (hi - w.base) // w.block_stride + 1 if w.block_stride else 1))
    return StridedSet(w.base, ((blocks, w.block_stride), *w.inner), w.run).normal()


def _joined(ws: list[Writer], lo: int, hi: int) -> list[tuple[tuple[tuple[int, str], ...], StridedSet]]:
    """Each writer cut to the row as a strided set; a unit's codes and the scales right after them joined."""
    sets = {(w.layer, w.role): _in_row(w, lo, hi) for w in ws}
    out: list[tuple[tuple[tuple[int, str], ...], StridedSet]] = []
    used: set[tuple[int, str]] = set()
    for (layer, role), d in sets.items():
        scale = (layer, role.replace("_data", "_scale"))
        sc = sets.get(scale) if role.endswith("_data") else None
        if sc is not None and sc.levels == d.levels and sc.offset == d.offset + d.run:
            out.append((((layer, role), scale), StridedSet(d.offset, d.levels, d.run + sc.run).normal()))
            used |= {(layer, role), scale}
    out += [((owner,), st) for owner, st in sets.items() if owner not in used]
    return out


def _runs_within(st: StridedSet, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """The contiguous runs of ``st`` that touch ``[lo, hi)``, ascending for a well-nested set."""
    offsets = [st.offset]
    for count, stride in reversed(st.levels):
        offsets = [o + i * stride for o in offsets for i in range(count) if o + i * stride < hi]
    for o in offsets:
        if o + st.run > lo:
            yield o, o + st.run


def _sweep(buffer: int, points: list[tuple[int, int, tuple[tuple[int, str], ...]]]) -> list[Segment]:
    """Cut the runs at every boundary and name the writers covering each piece."""
    events = sorted([(s, 1, o) for s, _, owners in points for o in owners]
                    + [(e, -1, o) for _, e, owners in points for o in owners])
    active: dict[tuple[int, str], int] = {}
    out: list[Segment] = []
    prev = None
    for pos, delta, owner in events:
        if prev is not None and pos > prev and active:
            out.append(Segment(buffer, prev, pos, tuple(sorted(active))))
        active[owner] = active.get(owner, 0) + delta
        if active[owner] == 0:
            del active[owner]
        prev = pos
    return out


def _fold(raw: list[Segment]) -> list[Segment]:
    """Merge neighbours that belong to the same single (layer, K|V) and are contiguous."""
    out: list[Segment] = []
    for seg in raw:
        if out:
            prev = out[-1]
            same = not prev.overlap and not seg.overlap and \
                {_unit(o) for o in prev.owners} == {_unit(o) for o in seg.owners}
            if same and prev.end == seg.start:
                out[-1] = Segment(prev.buffer, prev.start, seg.end, tuple(sorted(set(prev.owners + seg.owners))))
                continue
        out.append(seg)
    return out


def _line(plan: LayoutPlan, segs: list[Segment], repeat: int) -> str:
    first, last = segs[0], segs[-1]
    overlap = any(s.overlap for s in segs)
    mark = "!!" if overlap else "  "
    where = f"buf {first.buffer:<3}" if len(plan.buffers) > 1 else ""
    if repeat == 1:
        what = first.label()
    else:
        unit = segs[: len(segs) // repeat]
        what = f"{repeat} x [" + " | ".join(f"{s.end - s.start} B {s.label()}" for s in unit) + "]"
    return f"{mark} {where}{first.start:>9} .. {last.end:<9} {last.end - first.start:>7} B  {what}"


def _compress(segs: list[Segment]) -> list[tuple[list[Segment], int]]:
    """Fold runs of a repeating pattern (period up to 4 segments) into one entry."""
    out: list[tuple[list[Segment], int]] = []
    i = 0
    while i < len(segs):
        best = (1, 1)
        for period in range(1, 5):
            pattern = [(s.label(), s.end - s.start) for s in segs[i:i + period]]
            if len(pattern) < period:
                break
            reps = 1
            while True:
                nxt = segs[i + reps * period: i + (reps + 1) * period]
                if [(s.label(), s.end - s.start) for s in nxt] != pattern or nxt[0].start != segs[
                        i + reps * period - 1].end:
                    break
                reps += 1
            if reps >= 3 and reps * period > best[0] * best[1]:
                best = (period, reps)
        period, reps = best
        out.append((segs[i:i + period * reps], reps))
        i += period * reps
    return out


def render_text(plan: LayoutPlan, scale_views: ScaleViews | None = None, max_lines: int = 60) -> str:
    """The block map as aligned text lines, repeating patterns folded into one line each."""
    strategy = scale_views or plan.backend.scale_views
    segs = block_map(plan, strategy)
    report = verify_plan(plan, strategy)
    head = [f"block 0 of `{plan.layout}` on {plan.backend.name} ({strategy.value} scale views), "
            f"page {plan.page_size_bytes} B x {plan.num_layers} layers; !! marks bytes two layers write:"]
    lines = [_line(plan, group, reps) for group, reps in _compress(segs)]
    if len(lines) > max_lines:
        lines = [*lines[: max_lines - 10], f"   ... {len(lines) - max_lines + 5} more lines ...", *lines[-5:]]
    n_over = sum(1 for s in segs if s.overlap)
    tail = [f"{len(segs)} segments; " + (f"{n_over} overlapping: {report.collisions[0].describe()}"
                                          if n_over or not report.ok else "no overlaps")]
    return "\n".join(head + lines + tail)


_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#bab0ac"]


def render_svg(plan: LayoutPlan, scale_views: ScaleViews | None = None, width: int = 1200) -> str:
    """The block map as an SVG document.

    Per buffer row: a lane of the bytes coloured by owning layer (V lighter than
    K), labelled where wide enough, and beneath it a lane that is red wherever
    two layers write the same bytes (at least a pixel wide, so it always shows).
    """
    strategy = scale_views or plan.backend.scale_views
    segs = block_map(plan, strategy)
    rows = sorted({s.buffer for s in segs})
    lane, flag, gap, left, top = 30, 10, 16, 70, 40
    span = max((s.end for s in segs), default=1)
    height = top + len(rows) * (lane + flag + gap) + 30
    title = f"block 0 of {plan.layout} on {plan.backend.name}, {strategy.value} scale views"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + left + 20}" height="{height}" '
           f'font-family="monospace" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="20">{html.escape(title)}</text>']

    def x_of(offset: int) -> float:
        return left + offset / span * width

    for r, buffer in enumerate(rows):
        y = top + r * (lane + flag + gap)
        row = [s for s in segs if s.buffer == buffer]
        out.append(f'<text x="4" y="{y + lane * 0.65:.0f}">buf {buffer}</text>')
        for group, _ in _compress(row):
            owner = next((o for s in group for o in s.owners if o[1].endswith("data")), group[0].owners[0])
            layer, kv = _unit(owner)
            fill = _PALETTE[layer % len(_PALETTE)]
            opacity = "0.6" if kv == "v" else "1"
            x0, x1 = x_of(group[0].start), x_of(group[-1].end)
            tip = html.escape(f"{group[0].start}..{group[-1].end}: layer {layer} {kv.upper()}")
            out.append(f'<rect x="{x0:.2f}" y="{y}" width="{max(0.5, x1 - x0):.2f}" height="{lane}" fill="{fill}" '
                       f'fill-opacity="{opacity}" stroke="white" stroke-width="0.5"><title>{tip}</title></rect>')
            if x1 - x0 > 44:
                out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + lane * 0.65:.0f}" text-anchor="middle" '
                           f'fill="white">L{layer} {kv.upper()}</text>')
        for s in (s for s in row if s.overlap):
            x0 = x_of(s.start)
            tip = html.escape(f"{s.start}..{s.end} ({s.end - s.start} B): {s.label()}")
            out.append(f'<rect x="{x0:.2f}" y="{y + lane + 1}" width="{max(1.0, x_of(s.end) - x0):.2f}" '
                       f'height="{flag}" fill="#e15759"><title>{tip}</title></rect>')
    n_over = sum(1 for s in segs if s.overlap)
    note = (f"{n_over} byte ranges written by more than one layer (red lane)" if n_over
            else "no byte is written by two layers")
    out.append(f'<text x="{left}" y="{height - 10}">{len(segs)} segments; {note}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
