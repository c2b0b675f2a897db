"""The geometry verifier: do any two writers of a KV cache touch the same byte?

Pure Python on a `LayoutPlan`; nothing is allocated. The writers are, per
layer, the K data, V data, K scales and V scales (MLA: the latent and its
scale). Scale writers are modelled with the backend's strategy:
``stride_aware`` uses the plan's own scale views; ``assume_per_layer_contiguous``
uses what vLLM's 5-D-era Triton ``_ensure_scale_caches`` built (offset 0, a
block stride of one layer page), which under the cross-layer layout puts every
layer's scales on layer 0's bytes: vLLM issue #48412.

Exact and bounded: each writer is a strided byte set (offset, (count, stride) per
dim, a contiguous run), and two sets are intersected in closed form over their
strides by `kvpolicy.engine.lattice` (a branch and bound over the levels, with
the block levels cut to one ``lcm`` period), never by listing bytes. Writers of one
role share their strides and step evenly over the layers, so each offset
difference is decided once. Cost: ``O(R^2 * L * c)`` lattice decisions for ``R``
roles (at most 4) and ``L`` layers, ``c`` a small constant, plus one entry per
colliding pair listed (at most `MAX_LISTED_COLLISIONS`, the lowest addresses; the
count is exact and costs no listing); independent of block size, heads, head size and
block count.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvpolicy.engine.lattice import StridedSet, first_shared
from kvpolicy.engine.plan import ByteView, LayoutPlan, TensorView, naive_scale_view
from kvpolicy.policy.backends import Dim, ScaleViews
from kvpolicy.policy.errors import Diagnostic, GeometryError

__all__ = ["MAX_LISTED_COLLISIONS", "Collision", "GeometryReport", "Writer", "check_plan", "refusal", "verify_plan",
           "writers"]

_KV_ROLES = {0: "k", 1: "v"}

# Colliding pairs a report lists; a forced cross-layer cache of 4096 layers with
# per-layer-contiguous scale views has ~16.7 M of them, which would take gigabytes.
MAX_LISTED_COLLISIONS = 10_000


@dataclass(frozen=True)
class Writer:
    """A set of bytes one kind of write touches: cells at a lattice of addresses.

    Address of cell ``(block, *index)`` = ``base + block*block_stride + sum(i*s)``,
    each ``run`` bytes long, in buffer ``buffer``.
    """

    layer: int
    role: str  # k_data, v_data, k_scale, v_scale
    buffer: int
    base: int
    block_stride: int
    num_blocks: int
    inner: tuple[tuple[int, int], ...]  # (count, byte stride) of the non-block dims
    run: int

    @property
    def name(self) -> str:
        return f"layer {self.layer} {self.role.replace('_', ' ')}"

    def footprint(self) -> int:
        """Bytes from the first to the last byte this writer touches in one block."""
        return sum((n - 1) * abs(s) for n, s in self.inner) + self.run

    def runs(self, blocks: int) -> list[tuple[int, int]]:
        """Merged (start, end) byte intervals for the first ``blocks`` blocks."""
        offsets = [0]
        for count, stride in self.inner:
            offsets = [o + i * stride for o in offsets for i in range(count)]
        out: list[tuple[int, int]] = []
        for b in range(blocks):
            start0 = self.base + b * self.block_stride
            for o in sorted(offsets):
                s = start0 + o
                if out and out[-1][1] == s:
                    out[-1] = (out[-1][0], s + self.run)
                else:
                    out.append((s, s + self.run))
        return out


@dataclass(frozen=True)
class Collision:
    """Two writers that share bytes; ``address`` is the first shared byte."""

    a: Writer
    b: Writer
    buffer: int
    address: int

    def describe(self) -> str:
        return f"{self.a.name} and {self.b.name} both write buffer {self.buffer} byte {self.address}"

    def to_dict(self) -> dict[str, Any]:
        return {"a": {"layer": self.a.layer, "role": self.a.role}, "b": {"layer": self.b.layer, "role": self.b.role},
                "buffer": self.buffer, "address": self.address}


@dataclass(frozen=True)
class GeometryReport:
    """The verifier's answer for one plan under one scale-view strategy."""

    layout: str
    scale_views: ScaleViews
    writers: tuple[Writer, ...]
    collisions: tuple[Collision, ...]  # the first MAX_LISTED_COLLISIONS, by address
    collision_count: int  # every colliding pair

    @property
    def ok(self) -> bool:
        return self.collision_count == 0

    @property
    def complete(self) -> bool:
        """Whether `collisions` lists every colliding pair."""
        return len(self.collisions) == self.collision_count

    def pairs(self) -> set[tuple[tuple[int, str], tuple[int, str]]]:
        """Listed colliding writer pairs as ((layer, role), (layer, role)), each pair sorted."""
        out = set()
        for c in self.collisions:
            x, y = sorted([(c.a.layer, c.a.role), (c.b.layer, c.b.role)])
            out.add((x, y))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "scale_views": self.scale_views.value, "ok": self.ok,
                "writers": len(self.writers), "collision_count": self.collision_count,
                "collisions": [c.to_dict() for c in self.collisions]}


def _view_dims(view: TensorView) -> list[tuple[int, int]]:
    return [(view.shape[view.dims.index(d.value)], view.stride_of(d))
            for d in (Dim.token, Dim.head) if d.value in view.dims]


def _scale_writer(layer: int, role: str, sv: ByteView, run: int = 4) -> Writer:
    inner = [(n, s) for d, n, s in zip(sv.dims, sv.shape, sv.byte_strides) if d != "block"]
    bi = sv.dims.index("block")
    return Writer(layer, f"{role}_scale", sv.buffer, sv.byte_offset, sv.byte_strides[bi], sv.shape[bi],
                  tuple(inner), run)


def writers(plan: LayoutPlan, scale_views: ScaleViews | None = None) -> tuple[Writer, ...]:
    """Every writer of ``plan``, scale writers modelled with ``scale_views``
    (default: the plan's backend's strategy)."""
    strategy = scale_views or plan.backend.scale_views
    spec, elem = plan.spec, plan.element_size
    data_run = spec.data_bytes_per_head if spec.per_token_head or _scales_apart(plan) else spec.cell_bytes
    out: list[Writer] = []
    for lp in plan.layers:
        v = lp.view
        if v.stride_of(Dim.dim) != 1:  # pragma: no cover - every backend keeps a cell contiguous
            raise GeometryError(f"layer {lp.layer}'s cells are not contiguous")
        inner = tuple((n, s * elem) for n, s in _view_dims(v))
        block_stride = v.stride_of(Dim.block) * elem
        for kv in range(spec.kv_factor):
            role = _KV_ROLES[kv]
            base = (v.storage_offset + kv * v.stride_of(Dim.kv)) * elem
            out.append(Writer(lp.layer, f"{role}_data", v.buffer, base, block_stride, plan.num_blocks, inner,
                              data_run))
        if spec.per_token_head:
            for kv in range(spec.kv_factor):
                role = _KV_ROLES[kv]
                sv = (naive_scale_view(plan, lp.layer, role) if strategy is ScaleViews.assume_per_layer_contiguous
                      else next(s for s in lp.scales if s.role == role))
                out.append(_scale_writer(lp.layer, role, sv))
        elif _scales_apart(plan):  # nvfp4: each cell's fp8 block scales, apart from its data
            out.extend(_scale_writer(lp.layer, sv.role, sv, spec.scale_bytes_per_cell) for sv in lp.scales)
    return tuple(out)


def _scales_apart(plan: LayoutPlan) -> bool:
    """The cells' scales are not at their data's tail but in scale views of their own (nvfp4)."""
    return not plan.spec.per_token_head and plan.spec.scale_bytes_per_cell > 0


def _strided(w: Writer) -> StridedSet:
    return StridedSet(w.base, ((w.num_blocks, w.block_stride), *w.inner), w.run).normal()


def _is_arithmetic(values: list[int]) -> bool:
    return len(values) < 3 or all(b - a == values[1] - values[0] for a, b in itertools.pairwise(values))


def _shared_step(xs: list[int], ys: list[int]) -> int | None:
    """The one step both sorted offset lists advance by (0 when neither has two), or None."""
    steps = {b - a for v in (xs, ys) for a, b in itertools.pairwise(v)}
    if _is_arithmetic(xs) and _is_arithmetic(ys) and len(steps) <= 1:
        return steps.pop() if steps else 0
    return None


def _differences(xs: list[int], ys: list[int]) -> set[int]:
    """Every ``y - x``: ``O(|xs| + |ys|)`` when both are progressions with one step (a plan's layers)."""
    step = _shared_step(xs, ys)
    if step is not None:
        return {ys[0] - xs[0] + k * step for k in range(-(len(xs) - 1), len(ys))}
    return {y - x for x in xs for y in ys}


def verify_plan(plan: LayoutPlan, scale_views: ScaleViews | None = None) -> GeometryReport:
    """Report every pair of writers of ``plan`` that share a byte (first shared byte each).

    Writers of one buffer with the same levels and run (a *shape*: K and V data of every
    layer, say) differ only by their offset, so whether two of them collide, and where
    relative to the first, depends on the offset difference alone: each distinct
    difference some pair of writers has is decided once with `kvpolicy.engine.lattice`
    (exact, independent of block size, heads and head size). Pairs are counted per
    difference (in O(1) when the offsets step evenly) and listed lazily, lowest address
    first, up to `MAX_LISTED_COLLISIONS`. Cost: ``O(shapes^2 * writers)`` decisions and
    look-ups within each buffer, plus one entry per listed pair.
    """
    strategy = scale_views or plan.backend.scale_views
    ws = writers(plan, strategy)
    sets = [_strided(w) for w in ws]
    # keyed by role too: one role's offsets step evenly over the layers, K and V together need not
    shapes: dict[tuple[int, tuple[tuple[int, int], ...], int, str], dict[int, list[int]]] = {}
    for i, (w, s) in enumerate(zip(ws, sets)):
        shapes.setdefault((w.buffer, s.levels, s.run, w.role), {}).setdefault(s.offset, []).append(i)
    streams: list[Iterator[tuple[int, int, int]]] = []  # each sorted by (address, writer a, writer b), a < b
    count = 0
    by_buffer: dict[int, list[tuple[int, tuple[tuple[int, int], ...], int, str]]] = {}
    for key in shapes:  # writers of different buffers never meet: pair shapes within a buffer only
        by_buffer.setdefault(key[0], []).append(key)
    answers: dict[tuple[Any, ...], int | None] = {}
    pairs_of_shapes = [(kx, ky) for keys in by_buffer.values() for n, kx in enumerate(keys) for ky in keys[n:]]
    for kx, ky in pairs_of_shapes:
        xs, ys = shapes[kx], shapes[ky]
        x_offsets, y_offsets = sorted(xs), sorted(ys)
        shape_x = StridedSet(0, kx[1], kx[2])
        shape_y = StridedSet(0, ky[1], ky[2])
        step = _common_step(xs, ys, x_offsets, y_offsets)
        for d in sorted(_differences(x_offsets, y_offsets)):
            if kx == ky and d < 0:
                continue  # the same unordered pairs as -d
            pairs = _pair_count(xs, ys, x_offsets, y_offsets, d, kx == ky, step)
            if not pairs:  # a difference of the offsets' ranges no two writers have
                continue
            decided = (kx[1], kx[2], ky[1], ky[2], d)  # per-layer buffers repeat one question per layer
            if decided not in answers:
                answers[decided] = first_shared(shape_x, shape_y.shifted(d)) if shape_x.well_nested else \
                    _first_shared_either(shape_x, shape_y.shifted(d))
            first = answers[decided]
            if first is None:
                continue
            count += pairs
            streams.append(_pairs_at(xs, ys, x_offsets, d, first, kx == ky))
    listed = itertools.islice(heapq.merge(*streams), MAX_LISTED_COLLISIONS)
    collisions = tuple(Collision(ws[a], ws[b], ws[a].buffer, addr) for addr, a, b in listed)
    return GeometryReport(str(plan.layout), strategy, ws, collisions, count)


def _common_step(xs: dict[int, list[int]], ys: dict[int, list[int]], x_offsets: list[int],
                 y_offsets: list[int]) -> int | None:
    """The step of both offset lists when each holds one writer per offset and steps evenly by it."""
    if len(x_offsets) < 2 or len(y_offsets) < 2:
        return None
    if len(xs) != sum(map(len, xs.values())) or len(ys) != sum(map(len, ys.values())):
        return None
    return _shared_step(x_offsets, y_offsets)


def _pair_count(xs: dict[int, list[int]], ys: dict[int, list[int]], x_offsets: list[int],
                y_offsets: list[int], d: int, same: bool, step: int | None) -> int:
    """How many writer pairs (x at offset o, y at o + d) there are, without listing them."""
    if same and d == 0:
        return sum(len(g) * (len(g) - 1) // 2 for g in xs.values())
    if step is not None:  # one writer per offset, both stepping by ``step``: the progressions' overlap
        shift, rest = divmod(x_offsets[0] + d - y_offsets[0], step)
        if rest:
            return 0
        return max(0, min(len(x_offsets), len(y_offsets) - shift) - max(0, -shift))
    if len(y_offsets) < len(x_offsets):  # walk the shorter list: one offset of all layers' scales, say
        return sum(len(ys[o]) * len(xs.get(o - d, ())) for o in y_offsets)
    return sum(len(xs[o]) * len(ys.get(o + d, ())) for o in x_offsets)


def _pairs_at(xs: dict[int, list[int]], ys: dict[int, list[int]], x_offsets: list[int], d: int,
              first: int, same: bool) -> Iterator[tuple[int, int, int]]:
    """The (address, a, b) of every pair at offset difference ``d``, in order, lazily (one
    offset may hold thousands of writers: all layers' scales at byte 0, say)."""
    if len(ys) < len(xs):  # walk the shorter side; addresses ascend with either
        x_offsets = [o - d for o in sorted(ys) if o - d in xs]
    for ox in x_offsets:
        partners = ys.get(ox + d)
        if not partners:
            continue
        address = ox + first
        if same and d == 0:  # unordered pairs within one group
            group = sorted(xs[ox])
            for n, a in enumerate(group):
                for b in group[n + 1:]:
                    yield address, a, b
            continue
        ordered = sorted(partners)
        for a, b in heapq.merge(*(_ordered_pairs(i, ordered) for i in sorted(xs[ox]))):
            yield address, a, b


def _ordered_pairs(i: int, partners: list[int]) -> Iterator[tuple[int, int]]:
    """``(min(i, j), max(i, j))`` for ``j`` in sorted ``partners`` (never ``i``), in order."""
    for j in partners:
        if j != i:
            yield (j, i) if j < i else (i, j)


def _first_shared_either(x: StridedSet, y: StridedSet) -> int | None:
    """`first_shared` from whichever set is well nested; a plan's views always are."""
    if y.well_nested:
        return first_shared(y, x)
    raise GeometryError("two views whose strides interleave: the verifier cannot order their bytes")  # pragma: no cover


def check_plan(plan: LayoutPlan, scale_views: ScaleViews | None = None) -> GeometryReport:
    """`verify_plan`, raising `GeometryError` naming the colliding views when any overlap."""
    report = verify_plan(plan, scale_views)
    if report.ok:
        return report
    raise refusal(plan, report)


def refusal(plan: LayoutPlan, report: GeometryReport) -> GeometryError:
    """The `GeometryError` for a report with collisions: what `LayoutEngine.build` raises."""
    shown = report.collisions[:8]
    diags = [Diagnostic("<geometry>", 0, 0, "overlapping-views", c.describe()) for c in shown]
    listed = f"the first {len(shown)}" if len(shown) < report.collision_count else "each"
    return GeometryError(
        f"refusing layout `{plan.layout}` on `{plan.backend.name}`: {report.collision_count} pair(s) of views "
        f"write the same bytes with `{report.scale_views.value}` scale views ({listed} below); a write through "
        "one corrupts the other (vLLM #48412). Choose another layout, or a backend with stride-aware scale views",
        diags,
    )
