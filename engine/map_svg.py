"""The block map drawn as an SVG a person can read on paper.

One lane per buffer row: bytes coloured by role (K data, V data, their scales,
padding), each band labelled with its layers, a repeated band drawn as one
patterned rectangle with its period and count written on it, never one
rectangle per cell. Under each lane a byte axis with ticks, and a red marker
lane holding the overlapping byte ranges at their exact offsets; the writers of
every overlap are named in visible text below, with the verifier's count. The
first overlapping (or repeated) band is also drawn magnified, so a 4-byte
collision inside a 68-byte period can be seen. The number of elements is
bounded: past ``_MAX_BANDS`` bands a row is drawn in groups of consecutive
bands, past ``_MAX_ROWS`` rows the rest are left out, both said on the picture.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TypeVar

from kvpolicy.engine.memory_map import Band, Segment, apart_note, block_map
from kvpolicy.engine.plan import LayoutPlan
from kvpolicy.engine.verify import GeometryReport, verify_plan
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.layouts import LEGACY_NAMES

__all__ = ["ROLE_COLOURS", "draw", "render_svg"]

ROLE_COLOURS = {  # light fills, dark text on all of them
    "k_data": "#9ecae1", "v_data": "#fdae6b", "k_scale": "#a1d99b", "v_scale": "#c5b0d5",
    "latent_data": "#9ecae1", "latent_scale": "#a1d99b", "padding": "#eeeeee",
}
OVERLAP = "#e15759"
TEXT = "#1a1a1a"
_NAMES = {"k_data": "K data", "v_data": "V data", "k_scale": "K scale", "v_scale": "V scale",
          "latent_data": "latent", "latent_scale": "latent scale", "padding": "padding"}
_MAX_BANDS = 120  # per row, before bands are drawn in groups
_MAX_ROWS = 8
_MAX_MARKS = 64  # overlap pieces of one band drawn one by one; more are drawn as one patterned range
_MAX_NOTES = 10
LANE, LEFT, RIGHT = 44, 110, 30
T = TypeVar("T")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % (size // 4) == 0:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _role(piece: Segment) -> str:
    """The role a piece is coloured by: its data role, else its first role, else padding."""
    if not piece.owners:
        return "padding"
    roles = sorted({r for _, r in piece.owners})
    return next((r for r in roles if r.endswith("data")), roles[0])


def _layers(owners: tuple[tuple[int, str], ...] | list[tuple[int, str]]) -> str:
    layers = sorted({layer for layer, _ in owners})
    if not layers:
        return ""
    if len(layers) == 1:
        return f"L{layers[0]}"
    return f"L{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else \
        "L" + ",".join(map(str, layers))


def _short(band: Band) -> str:
    """``L3 K`` / ``L0 K+V``: the layers and K|V of a band (data owners only when it has any)."""
    owners = [o for p in band.pattern if not p.overlap for o in p.owners] or list(band.owners)
    kinds = sorted({r.split("_")[0].upper() for _, r in owners}, key=lambda k: "KVL".find(k[0]))
    return f"{_layers(owners)} {'+'.join(kinds)}".strip() or "padding"


def _repeat_note(band: Band) -> str:
    kinds = {r.split("_")[0] for p in band.pattern if not p.overlap for _, r in p.owners}
    what = "K/V interleaved" if {"k", "v"} <= kinds else "repeats"
    return f"{what} every {band.period} B, x {band.repeats}"


def _ticks(span: int, n: int = 8) -> list[int]:
    raw = max(1, span / n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    if span >= 1024:  # binary-friendly steps for byte counts
        p2 = 1 << max(0, math.ceil(math.log2(raw)))
        step = p2
    return list(range(0, span + 1, int(step)))


def _overlap_note(band: Band, piece: Segment) -> str:
    where = f"buffer {band.buffer} bytes {band.start + piece.start}..{band.start + piece.end}"
    if band.repeats > 1:
        where += f", then every {band.period} B x {band.repeats} up to byte {band.end}"
    writers = _writers(piece.owners)
    return f"{where}: written by {writers}"


def _writers(owners: tuple[tuple[int, str], ...]) -> str:
    """``layer 0 k scale, layer 3 k scale`` or ``k scale of layers 0..95``: each role with its layers."""
    by_role: dict[str, list[int]] = {}
    for layer, role in owners:
        by_role.setdefault(role, []).append(layer)
    parts = []
    for role, layers in sorted(by_role.items()):
        layers = sorted(set(layers))
        name = role.replace("_", " ")
        if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)):
            parts.append(f"{name} of layers {layers[0]}..{layers[-1]}")
        else:
            parts += [f"layer {layer} {name}" for layer in layers]
    return ", ".join(parts)


class _Canvas:
    def __init__(self, width: int) -> None:
        self.width = width
        self.defs: list[str] = []
        self.body: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, extra: str = "", tip: str = "") -> None:
        title = f"<title>{_e(tip)}</title>" if tip else ""
        self.body.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 1.0):.2f}" height="{h:.2f}" '
                         f'fill="{fill}" {extra}>{title}</rect>')

    def text(self, x: float, y: float, s: str, extra: str = "") -> None:
        fill = "" if "fill=" in extra else f'fill="{TEXT}" '
        self.body.append(f'<text x="{x:.1f}" y="{y:.1f}" {fill}{extra}>{_e(s)}</text>')


def _text_width(s: str, size: float = 12) -> float:
    return len(s) * size * 0.6


def _instance_starts(band: Band) -> list[int]:
    """Where each outer repeat of ``band`` starts (just its start when it has none)."""
    starts = [band.start]
    for n, stride in band.outer:
        starts = [x + i * stride for x in starts for i in range(n)]
    return starts


def _draw_band(c: _Canvas, band: Band, x_of, y: float) -> None:
    """One band: each piece at its bytes when it repeats at most ``_MAX_MARKS`` times; else one
    rectangle split into a stripe per role of its pattern (its period and count written on it),
    one per outer repeat when there are few (the bytes between hold other blocks or bands), the
    overlapping pieces still at their exact bytes (`_overlap_marks`)."""
    tip = f"{band.start}..{band.end}: {band.label()}"
    few = band.outer and math.prod(n for n, _ in band.outer) <= _MAX_MARKS
    starts = _instance_starts(band) if few else [band.start]
    span = band.span if few else band.end - band.start
    for start in starts:
        x0, x1 = x_of(start), x_of(start + span)
        if band.repeats == 1 or (band.count <= _MAX_MARKS and (few or not band.outer)):
            for k in range(band.count):
                base = start + k * band.period
                for p in band.pattern:
                    c.rect(x_of(base + p.start), y, x_of(base + p.end) - x_of(base + p.start), LANE,
                           OVERLAP if p.overlap else ROLE_COLOURS[_role(p)], 'stroke="none" data-kind="piece"', tip)
        else:
            roles = list(dict.fromkeys(_role(p) for p in band.pattern if not p.overlap)) or ["padding"]
            h = LANE / len(roles)
            for i, role in enumerate(roles):
                c.rect(x0, y + i * h, x1 - x0, h, ROLE_COLOURS[role], 'stroke="none" data-kind="stripe"', tip)
        c.rect(x0, y, x1 - x0, LANE, "none", f'stroke="#444" stroke-width="0.8" data-kind="band" '
               f'data-start="{start}" data-end="{start + span}" data-layers="{_e(_layers(list(band.owners)))}"')


def _interleaved(row: list[Band]) -> list[list[Band]]:
    """The row's bands (by start) in items: bands whose byte ranges interleave without sharing a byte
    (BHLNC: every layer inside each head's slab, a band per layer repeated per head) are one item."""
    items: list[list[Band]] = []
    reach = -1
    for b in row:
        if items and b.start < reach:
            items[-1].append(b)
        else:
            items.append([b])
        reach = max(reach, b.end) if len(items[-1]) > 1 else b.end
    return items


def _draw_interleaved(c: _Canvas, item: list[Band], x_of, y: float, heads: int) -> list[tuple[str, int, int]]:
    """Interleaved bands as one striped rectangle per outer repeat (a head's slab, say), each outlined
    at its bytes; the labels (`H3` when the repeat is the buffer's head stride) and their byte ranges."""
    outer = item[0].outer if all(b.outer == item[0].outer for b in item) and len(item[0].outer) == 1 else ()
    start = min(b.start for b in item)
    owners = sorted({o for b in item for o in b.owners})
    roles = list(dict.fromkeys(_role(p) for b in item for p in b.pattern if not p.overlap)) or ["padding"]
    tip = f"{start}..{max(b.end for b in item)}: {len(item)} interleaved bands of {_layers(owners)}"
    if outer and outer[0][0] <= 4 * _MAX_MARKS:
        n, stride = outer[0]
        width = max(b.start + b.span for b in item) - start
        windows = [(start + k * stride, start + k * stride + width) for k in range(n)]
        name = "H" if stride == heads else "#"
        names = [f"{name}{k}" for k in range(n)]
    else:
        windows, names = [(start, max(b.end for b in item))], [_layers(owners)]
    h = LANE / len(roles)
    for s0, e0 in windows:
        for k, role in enumerate(roles):
            c.rect(x_of(s0), y + k * h, x_of(e0) - x_of(s0), h, ROLE_COLOURS[role], 'stroke="none" data-kind="stripe"',
                   tip)
        c.rect(x_of(s0), y, x_of(e0) - x_of(s0), LANE, "none", f'stroke="#444" stroke-width="0.8" data-kind="band" '
               f'data-start="{s0}" data-end="{e0}" data-layers="{_e(_layers(owners))}"')
    return [(text, s0, e0) for text, (s0, e0) in zip(names, windows, strict=True)]


def _overlap_marks(c: _Canvas, band: Band, x_of, y: float) -> int:
    """Red marks at the exact overlapping byte ranges of ``band``; how many were drawn."""
    marks = 0
    for p in (p for p in band.pattern if p.overlap):
        tip = _overlap_note(band, p)
        if band.repeats <= _MAX_MARKS and not band.outer:
            for k in range(band.count):
                s = band.start + k * band.period
                c.rect(x_of(s + p.start), y, x_of(s + p.end) - x_of(s + p.start), 10, OVERLAP,
                       f'data-kind="overlap" data-start="{s + p.start}" data-end="{s + p.end}"', tip)
                marks += 1
        else:
            c.rect(x_of(band.start + p.start), y, x_of(band.end) - x_of(band.start + p.start), 10, OVERLAP,
                   f'data-kind="overlap-repeated" data-start="{band.start + p.start}" data-end="{band.start + p.end}" '
                   f'data-period="{band.period}" data-count="{band.repeats}"', tip)
            marks += 1
    return marks


_TICK_FONT, _TICK_GAP = 11, 6


def _tick_labels(extents: dict[int, list[int]], x_of, named: Sequence[tuple[str, int, int]] = ()
                 ) -> list[tuple[float, str]]:
    """The labels under a lane, as (centre x, text), none overprinting another.

    Layers whose byte extents overlap are one label for the group, ``L0-31``; the others one label
    each, at the middle of their bytes; ``named`` ranges (an interleaved item's heads, ``H3``) add
    theirs. Labels are placed left to right and one that would touch the previous is left out, so
    a dense row shows every k-th label; the first and last are kept where they fit.
    """
    groups: list[tuple[list[int], int, int]] = []  # (layers, start, end), by start
    for layer, (s, e) in sorted(extents.items(), key=lambda kv: (kv[1][0], kv[0])):
        if groups and s < groups[-1][2]:
            layers, gs, ge = groups[-1]
            groups[-1] = ([*layers, layer], gs, max(ge, e))
        else:
            groups.append(([layer], s, e))
    items = [(s, (x_of(s) + x_of(e)) / 2, _layers([(layer, "") for layer in layers])) for layers, s, e in groups]
    items += [(s, (x_of(s) + x_of(e)) / 2, text) for text, s, e in named]
    labels = [(x, text) for _, x, text in sorted(items)]
    placed: list[tuple[float, str]] = []
    right = -math.inf
    for n, (x, text) in enumerate(labels):
        half = _text_width(text, _TICK_FONT) / 2
        if x - half < right + _TICK_GAP:
            if n == len(labels) - 1 and placed and len(labels) > 2:  # keep the last one: drop the one before
                px, pt = placed.pop()
                right = px - _text_width(pt, _TICK_FONT) / 2 - _TICK_GAP if not placed else \
                    placed[-1][0] + _text_width(placed[-1][1], _TICK_FONT) / 2
                if x - half >= right + _TICK_GAP:
                    placed.append((x, text))
                else:
                    placed.append((px, pt))
            continue
        placed.append((x, text))
        right = x + half
    return placed


def _grouped(bands: list[T]) -> tuple[list[list[T]], int]:
    size = math.ceil(len(bands) / _MAX_BANDS)
    return [bands[i:i + size] for i in range(0, len(bands), size)], size


def draw(plan: LayoutPlan, strategy: ScaleViews, bands: list[Band], report: GeometryReport, width: int) -> str:
    """The SVG document for ``bands`` of ``plan`` (see the module docstring)."""
    c = _Canvas(width)
    rows = sorted({b.buffer for b in bands})
    over_rows = [r for r in rows if any(b.overlap for b in bands if b.buffer == r)]
    shown = rows[:_MAX_ROWS]
    if over_rows and over_rows[0] not in shown:
        shown = [*rows[:_MAX_ROWS - 1], over_rows[0]]
    legacy = next((k for k, v in LEGACY_NAMES.items() if v == plan.layout), "")
    title = f"Block 0 of {plan.layout}{f' ({legacy})' if legacy else ''} on {plan.backend.name}, " \
            f"{strategy.value} scale views"
    c.text(LEFT, 24, title, 'font-size="16" font-weight="bold"')
    n_over_pieces = sum(b.repeats * sum(1 for p in b.pattern if p.overlap) for b in bands)
    verdict = (f"OVERLAP: {n_over_pieces} byte ranges written by more than one layer "
               f"({report.collision_count} colliding writer pairs)" if n_over_pieces or not report.ok
               else "no byte is written by two layers")
    c.text(LEFT, 44, f"page {plan.page_size_bytes} B x {plan.num_layers} layers; {verdict}",
           f'font-weight="bold" fill="{"#a50f15" if n_over_pieces else "#1b5e20"}"')
    roles = sorted({_role(p) for b in bands for p in b.pattern if not p.overlap}, key=list(_NAMES).index)
    legend = ['<g id="legend">']
    lx = LEFT
    for role in [*roles, "overlap"]:
        fill = OVERLAP if role == "overlap" else ROLE_COLOURS[role]
        name = "overlap (two layers)" if role == "overlap" else _NAMES[role]
        legend.append(f'<rect x="{lx}" y="56" width="16" height="16" fill="{fill}" stroke="#444" stroke-width="0.8"/>'
                      f'<text x="{lx + 22}" y="69" fill="{TEXT}">{_e(name)}</text>')
        lx += 40 + _text_width(name)
    legend.append("</g>")
    c.body += legend
    y = 96
    zoom: Band | None = None
    geom: dict[int, tuple[float, int]] = {}
    for r in shown:
        row = [b for b in bands if b.buffer == r]
        span = max(b.end for b in row)

        def x_of(offset: float, span: int = span) -> float:
            return LEFT + offset / span * width

        layers = sorted({layer for b in row for layer, _ in b.owners})
        buf = plan.buffers[r]
        heads = buf.strides[buf.dims.index("head")] * plan.element_size if "head" in buf.dims else 0
        c.text(8, y + 18, f"buffer {r}", 'font-weight="bold"')
        c.text(8, y + 34, _layers([(layer, "") for layer in layers]) if layers else "", 'font-size="11"')
        items = _interleaved(row)
        groups, size = _grouped(items)
        named: list[tuple[str, int, int]] = []
        if size == 1:
            for item in items:
                if len(item) > 1:
                    named += _draw_interleaved(c, item, x_of, y, heads)
                    s0, e0 = min(b.start for b in item), max(b.end for b in item)
                    owners = [o for b in item for p in b.pattern if not p.overlap for o in p.owners]
                    kinds = sorted({r.split("_")[0].upper() for _, r in owners}, key=lambda k: "KVL".find(k[0]))
                    label = f"{_layers(owners)} {'+'.join(kinds)}".strip()
                    if x_of(e0) - x_of(s0) > _text_width(label, 12) + 6:
                        c.text((x_of(s0) + x_of(e0)) / 2, y + 18, label,
                               'text-anchor="middle" font-weight="bold" data-kind="layer-label"')
                    if zoom is None:
                        zoom = next((b for b in item if b.overlap), None)
                    continue
                b = item[0]
                _draw_band(c, b, x_of, y)
                label, note = _short(b), _repeat_note(b) if b.repeats > 1 else ""
                w = x_of(b.end) - x_of(b.start)
                if w > _text_width(label, 12) + 6:
                    c.text((x_of(b.start) + x_of(b.end)) / 2, y + 18, label,
                           'text-anchor="middle" font-weight="bold" data-kind="layer-label"')
                if note and w > _text_width(note, 10) + 6:
                    c.text((x_of(b.start) + x_of(b.end)) / 2, y + 34, note, 'text-anchor="middle" font-size="10"')
                if zoom is None and b.overlap:
                    zoom = b
        else:
            for g in ([b for item in its for b in item] for its in groups):
                g0, g1 = min(b.start for b in g), max(b.end for b in g)
                x0, x1 = x_of(g0), x_of(g1)
                roles = list(dict.fromkeys(_role(p) for b in g for p in b.pattern if not p.overlap)) or ["padding"]
                h = LANE / len(roles)
                for k, role in enumerate(roles):
                    c.rect(x0, y + k * h, x1 - x0, h, ROLE_COLOURS[role], 'stroke="none" data-kind="stripe"')
                c.rect(x0, y, x1 - x0, LANE, "none", f'stroke="#444" stroke-width="0.8" data-kind="band" '
                       f'data-start="{g0}" data-end="{g1}"',
                       f"{g0}..{g1}: {len(g)} bands, {_layers(list(g[0].owners + g[-1].owners))}")
                if zoom is None:
                    zoom = next((b for b in g if b.overlap), None)
        geom[r] = (y, span)
        if any(b.overlap for b in row):
            c.text(LEFT - 6, y + LANE + 12, "overlaps", 'text-anchor="end" font-size="11" font-weight="bold" '
                   'fill="#a50f15"')
        marks = 0
        for b in row:
            if b.overlap and marks < 4 * _MAX_MARKS:
                marks += _overlap_marks(c, b, x_of, y + LANE + 3)
        # layer labels beneath, every k-th layer so they never collide
        extents: dict[int, list[int]] = {}
        for b in (item[0] for item in items if len(item) == 1 or size > 1):
            for layer, _ in {o for p in b.pattern if not p.overlap for o in p.owners}:
                e = extents.setdefault(layer, [b.start, b.end])
                e[0], e[1] = min(e[0], b.start), max(e[1], b.end)
        ly = y + LANE + 28
        for x, label in _tick_labels(extents, x_of, named):
            c.text(x, ly, label, 'text-anchor="middle" font-size="11" data-kind="layer-tick"')
        # byte axis
        ay = ly + 8
        c.body.append(f'<line x1="{LEFT}" y1="{ay}" x2="{LEFT + width}" y2="{ay}" stroke="#333" data-kind="axis"/>')
        for t in _ticks(span):
            if t and span - t < span / 12:
                continue
            c.body.append(f'<line x1="{x_of(t):.1f}" y1="{ay}" x2="{x_of(t):.1f}" y2="{ay + 5}" stroke="#333"/>')
            c.text(x_of(t), ay + 17, _bytes(t), 'text-anchor="middle" font-size="11" data-kind="axis-label"')
        c.body.append(f'<line x1="{x_of(span):.1f}" y1="{ay}" x2="{x_of(span):.1f}" y2="{ay + 5}" stroke="#333"/>')
        c.text(x_of(span), ay + 17, f"{span} B", 'text-anchor="end" font-size="11" data-kind="axis-label"')
        notes = []
        if size > 1:
            notes.append(f"{len(row)} bands too many to draw one by one: drawn as {len(groups)} groups of "
                         f"{size}, each split into a stripe per role; the text map (--map) lists them")
        if notes:
            c.text(LEFT, ay + 34, "; ".join(notes), 'font-size="11" font-style="italic" data-kind="note"')
            ay += 16
        y = ay + 40
    apart = apart_note(plan)
    if apart:
        c.text(LEFT, y, apart[0].upper() + apart[1:], 'font-style="italic" data-kind="note"')
        y += 24
    if len(shown) < len(rows):
        c.text(LEFT, y, f"{len(rows) - len(shown)} more buffers not drawn ({len(rows)} in all); "
               "the text map (--map) lists every band", 'font-style="italic" data-kind="note"')
        y += 24
    if zoom is None:
        zoom = next((b for b in bands if b.repeats > 1 and len(b.pattern) > 1), None)
    if zoom is not None and zoom.buffer in geom:
        row_y, span = geom[zoom.buffer]
        zx0 = LEFT + zoom.start / span * width
        zx1 = LEFT + (zoom.start + (zoom.period * min(2, zoom.count) if zoom.repeats > 1 else zoom.end - zoom.start)) \
            / span * width
        c.rect(zx0 - 1, row_y - 3, zx1 - zx0 + 2, LANE + 6, "none", 'stroke="#1a1a1a" stroke-width="2" '
               'stroke-dasharray="4,2" data-kind="zoom-source"')
        y = _draw_zoom(c, zoom, y + 6, width)
    over = [(b, p) for b in bands for p in b.pattern if p.overlap]
    if over:
        c.text(LEFT, y + 4, f"Overlapping bytes ({report.collision_count} colliding writer pairs; "
               f"first: {report.collisions[0].describe() if report.collisions else 'none'}):",
               'font-weight="bold" data-kind="overlap-heading"')
        y += 22
        for b, p in over[:_MAX_NOTES]:
            c.text(LEFT, y, _overlap_note(b, p), 'font-size="12" data-kind="overlap-writers"')
            y += 17
        if len(over) > _MAX_NOTES:
            c.text(LEFT, y, f"... and {len(over) - _MAX_NOTES} more overlapping ranges (the text map lists them)",
                   'font-size="12" font-style="italic"')
            y += 17
    height = y + 16
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + LEFT + RIGHT}" height="{height:.0f}" '
            f'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">')
    return "\n".join([head, '<rect width="100%" height="100%" fill="white"/>',
                      "<defs>" + "".join(c.defs) + "</defs>", *c.body, "</svg>"]) + "\n"


def _draw_zoom(c: _Canvas, band: Band, y: float, width: int) -> float:
    """Two periods of ``band`` magnified, each piece labelled with its bytes and writers; the new y."""
    periods = min(2, band.count)
    span = band.period * periods if band.repeats > 1 else band.end - band.start

    def x_of(offset: float) -> float:
        return LEFT + offset / span * width

    c.text(LEFT, y + 12, f"Zoom: buffer {band.buffer} bytes {band.start}..{band.start + span} "
           f"(the first {periods} of {band.repeats} periods of the band at {band.start}..{band.end}, "
           "dashed box above), magnified",
           'font-weight="bold" data-kind="zoom-title"')
    y += 22
    for k in range(periods):
        for p in band.pattern:
            s, e = k * band.period + p.start, k * band.period + p.end
            fill = OVERLAP if p.overlap else ROLE_COLOURS[_role(p)]
            c.rect(x_of(s), y, x_of(e) - x_of(s), LANE, fill, 'stroke="#444" stroke-width="0.8" data-kind="zoom-piece"',
                   f"{band.start + s}..{band.start + e}: {p.label()}")
            label = f"{e - s} B " + ("overlap" if p.overlap else p.label().replace("layer ", "L"))
            if x_of(e) - x_of(s) > _text_width(label, 11) + 4:
                c.text((x_of(s) + x_of(e)) / 2, y + LANE / 2 + 4, label, 'text-anchor="middle" font-size="11"')
            elif p.overlap:
                roles = "/".join(sorted({r.replace("_", " ") for _, r in p.owners}))
                mid = (x_of(s) + x_of(e)) / 2
                anchor = "end" if mid > LEFT + width - 120 else "middle"
                c.text(mid if anchor == "middle" else x_of(e), y + LANE + 14,
                       f"{e - s} B overlap: {_layers(p.owners)} {roles}", f'text-anchor="{anchor}" '
                       'font-size="11" font-weight="bold"')
    ay = y + LANE + 22
    c.body.append(f'<line x1="{LEFT}" y1="{ay}" x2="{LEFT + width}" y2="{ay}" stroke="#333" data-kind="axis"/>')
    cuts = sorted({k * band.period + q for k in range(periods) for p in band.pattern for q in (p.start, p.end)})
    last = -1e9
    for t in cuts:
        c.body.append(f'<line x1="{x_of(t):.1f}" y1="{ay}" x2="{x_of(t):.1f}" y2="{ay + 5}" stroke="#333"/>')
        if x_of(t) - last > 40:
            c.text(x_of(t), ay + 17, str(band.start + t), 'text-anchor="middle" font-size="11" data-kind="axis-label"')
            last = x_of(t)
    return ay + 40


def render_svg(plan: LayoutPlan, scale_views: ScaleViews | None = None, width: int = 1100,
               report: GeometryReport | None = None) -> str:
    """The block map of ``plan`` as an SVG document; ``report``: the verifier's, when already run."""
    strategy = scale_views or plan.backend.scale_views
    report = report if report is not None and report.scale_views is strategy else verify_plan(plan, strategy)
    return draw(plan, strategy, block_map(plan, strategy), report, width)
