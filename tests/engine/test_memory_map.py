"""The block map: owners of every byte range, overlaps marked, as text and SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.engine.map_svg import render_svg
from kvpolicy.engine.memory_map import block_map, render_text
from kvpolicy.engine.plan import plan_layout
from kvpolicy.engine.verify import verify_plan
from kvpolicy.policy import KVCacheSpec, Layout, ScaleViews
from kvpolicy.policy.backends import BACKENDS

SPEC = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=2, head_size=64, kv_cache_dtype="fp8_per_token_head")
TRITON = BACKENDS["TRITON_ATTN"]


def plan(layout: str, spec: KVCacheSpec = SPEC):
    return plan_layout(Layout.parse(layout), spec, TRITON, num_blocks=4)


def test_safe_cross_layer_block_is_one_run_per_layer_and_role() -> None:
    text = render_text(plan("BLNHC"), ScaleViews.stride_aware)
    assert "!!" not in text.split("\n", 1)[1]
    assert "       0 .. 2176         2176 B  layer 0 K data+scale" in text
    assert "   15232 .. 17408        2176 B  layer 3 V data+scale" in text
    assert text.endswith("8 segments; no overlaps")


def test_unsafe_cross_layer_block_shows_the_collision() -> None:
    text = render_text(plan("BLNHC"))
    assert "!!         0 .. 2176         2176 B  32 x [64 B layer 0 K data | 4 B OVERLAP layers 0..3 k scale]" in text
    assert "layer 0 k scale and layer 1 k scale both write buffer 0 byte 64" in text


def test_segments_cover_the_block_exactly_once() -> None:
    for layout in ("LBNHC", "LBHNC", "BLNHC", "BHLNC"):
        p = plan(layout)
        segs = block_map(p, ScaleViews.stride_aware)
        covered = sum(s.end - s.start for s in segs)
        assert covered == p.num_layers * p.page_size_bytes, layout
        assert not any(s.overlap for s in segs)


def test_unquantized_block_has_no_scales() -> None:
    p = plan("BHLNC", SPEC.model_copy(update={"kv_cache_dtype": "auto"}))
    text = render_text(p)
    assert "scale" not in text.split("\n", 1)[1]
    assert "no overlaps" in text


def test_svg_marks_each_overlap_at_its_exact_bytes() -> None:
    ns = "{http://www.w3.org/2000/svg}"
    unsafe = ET.fromstring(render_svg(plan("BLNHC")))
    safe = ET.fromstring(render_svg(plan("BLNHC"), ScaleViews.stride_aware))
    marks = [r for r in unsafe.iter(f"{ns}rect") if r.get("data-kind") == "overlap"]
    # 8 bands (L0 K .. L3 V) x 32 cells: the 4 scale bytes after each cell's 64 data bytes
    assert len(marks) == 256
    assert sorted((int(r.get("data-start")), int(r.get("data-end"))) for r in marks) == \
        [(half * 2176 + k * 68 + 64, half * 2176 + k * 68 + 68) for half in range(8) for k in range(32)]
    assert not [r for r in safe.iter(f"{ns}rect") if r.get("data-kind") == "overlap"]


NS = "{http://www.w3.org/2000/svg}"


def _svg(p, views=None) -> ET.Element:
    return ET.fromstring(render_svg(p, views))


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{NS}text")]


def _luminance(colour: str) -> float:
    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_svg_has_a_legend_of_the_roles_drawn_and_a_labelled_byte_axis() -> None:
    root = _svg(plan("BLNHC"), ScaleViews.stride_aware)
    legend = next(g for g in root.iter(f"{NS}g") if g.get("id") == "legend")
    names = [t.text for t in legend.iter(f"{NS}text")]
    assert names[:2] == ["K data", "V data"] and "overlap (two layers)" in names
    axis = [t.text for t in root.iter(f"{NS}text") if t.get("data-kind") == "axis-label"]
    assert axis[0] == "0 B" and axis[-1] == "17408 B" and "8 KiB" in axis


def test_svg_labels_every_layer_and_colours_by_role_with_dark_text() -> None:
    root = _svg(plan("BLNHC"), ScaleViews.stride_aware)
    labels = [t.text for t in root.iter(f"{NS}text") if t.get("data-kind") == "layer-label"]
    assert labels == ["L0 K", "L0 V", "L1 K", "L1 V", "L2 K", "L2 V", "L3 K", "L3 V"]
    fills = [r.get("fill") for r in root.iter(f"{NS}rect") if r.get("data-kind") == "piece"]
    assert len(set(fills)) == 2 and len(fills) == 8  # K and V fills, one band each
    for t in root.iter(f"{NS}text"):
        assert _luminance(t.get("fill")) < 0.35, t.text  # dark text ...
    for f in fills:
        assert _luminance(f) > 0.6  # ... on light fills


def test_svg_names_the_colliding_writers_in_visible_text_at_the_verifiers_bytes() -> None:
    p = plan("BLNHC")
    root = _svg(p)
    writers = [t.text for t in root.iter(f"{NS}text") if t.get("data-kind") == "overlap-writers"]
    assert writers[0] == ("buffer 0 bytes 64..68, then every 68 B x 32 up to byte 2176: "
                          "written by k scale of layers 0..3")
    marks = [(int(r.get("data-start")), int(r.get("data-end"))) for r in root.iter(f"{NS}rect")
             if r.get("data-kind") == "overlap"]
    report = verify_plan(p)
    assert report.collisions and all(any(s <= c.address < e for s, e in marks) for c in report.collisions)
    width, left = 1100, 110
    x_of = {round(left + s / 17408 * width, 2) for s, _ in marks}
    drawn = {float(r.get("x")) for r in root.iter(f"{NS}rect") if r.get("data-kind") == "overlap"}
    assert drawn == x_of


def test_map_of_a_huge_spec_is_bounded() -> None:
    """96 layers x 128 heads at block 4096 (cross layer and one buffer per layer), and 4096 layers
    at the sanity bounds: a few bands per layer, an SVG of a bounded number of elements."""
    big = KVCacheSpec(num_layers=96, block_size=4096, num_kv_heads=128, head_size=128,
                      kv_cache_dtype="int8_per_token_head")
    for layout in ("BLNHC", "LBHNC"):
        p = plan_layout(Layout.parse(layout), big, TRITON, num_blocks=big.num_layers + 1)
        assert len(block_map(p)) <= 4 * big.num_layers
        root = _svg(p)
        assert sum(1 for _ in root.iter()) < 2500
        assert len(render_text(p).splitlines()) <= 62
    bounds = KVCacheSpec(num_layers=4096, block_size=4096, num_kv_heads=1024, head_size=16384,
                         kv_cache_dtype="fp8_per_token_head")
    p = plan_layout(Layout.parse("BLNHC"), bounds, TRITON, num_blocks=2)
    assert len(block_map(p, ScaleViews.stride_aware)) == 2 * 4096


def test_interleaved_cells_are_one_band_not_one_run_per_cell() -> None:
    """vLLM 0.34's packed content: K and V alternate inside each cell; one band per layer."""
    from kvpolicy.policy.backends import packed_backend

    backend = packed_backend("TRITON_ATTN")
    spec = KVCacheSpec(num_layers=2, block_size=4096, num_kv_heads=8, head_size=128)
    p = plan_layout(Layout.parse("BLNHC"), spec, backend, num_blocks=3)
    bands = block_map(p)
    assert len(bands) == 2
    assert bands[0].period == 2 * 128 * 2 and bands[0].count == 4096 * 8
    assert [p.label() for p in bands[0].pattern] == ["layer 0 K data", "layer 0 V data"]
    assert "K/V interleaved every 512 B, x 32768" in _texts(_svg(p))


def _bytes_of_bands(bands) -> dict[tuple[int, int], frozenset]:
    out: dict[tuple[int, int], frozenset] = {}
    for b in bands:
        starts = [b.start]
        for n, s in b.outer:
            starts = [x + i * s for x in starts for i in range(n)]
        for x in starts:
            for k in range(b.count):
                for p in b.pattern:
                    for byte in range(x + k * b.period + p.start, x + k * b.period + p.end):
                        assert (b.buffer, byte) not in out, "bands overlap each other"
                        out[(b.buffer, byte)] = frozenset(p.owners)
    return out


def _cells(p, blocks) -> dict[tuple[int, int], tuple[int, int]]:
    """Each byte of the cells of ``blocks``, from the plan's own addresses: ``(buffer, byte) -> (layer, kv)``."""
    out = {}
    for layer in range(p.num_layers):
        for kv in range(p.spec.kv_factor):
            for block in blocks:
                for token in range(p.spec.block_size):
                    for head in range(p.spec.num_kv_heads):
                        buffer, at = p.cell_offset(layer, kv, block, token, head)
                        for byte in range(at, at + p.spec.cell_bytes):
                            out[(buffer, byte)] = (layer, kv)
    return out


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(["LBNHC", "LBHNC", "BLNHC", "BHLNC", "LHBNC", "BLHNC"]), layers=st.integers(1, 4),
       block=st.sampled_from([1, 2, 4]), heads=st.integers(1, 3), head=st.sampled_from([4, 8, 12]),
       dtype=st.sampled_from(["auto", "fp8_per_token_head", "int8_per_token_head"]),
       views=st.sampled_from([ScaleViews.stride_aware, ScaleViews.assume_per_layer_contiguous]),
       packed=st.booleans())
def test_bands_name_the_writers_of_every_byte_exactly(layout, layers, block, heads, head, dtype, views,
                                                       packed) -> None:
    """Expanded byte by byte, the bands give each byte of block 0's cells (where the plan's
    `cell_offset` puts them) exactly the writers that touch it, whichever block's write lands
    there; any other byte drawn is padding, never a byte of another block's cells."""
    from kvpolicy.engine.memory_map import _unit
    from kvpolicy.engine.verify import writers
    from kvpolicy.policy.backends import packed_backend

    backend = packed_backend("TRITON_ATTN") if packed else TRITON
    if Layout.parse(layout) not in backend.layouts:
        return
    spec = KVCacheSpec(num_layers=layers, block_size=block, num_kv_heads=heads, head_size=head, kv_cache_dtype=dtype)
    p = plan_layout(Layout.parse(layout), spec, backend, num_blocks=layers + 1)
    block0 = _cells(p, [0])
    others = _cells(p, range(1, p.num_blocks))
    expected: dict[tuple[int, int], set] = {key: set() for key in block0}
    for w in writers(p, views):
        for s, e in w.runs(p.num_blocks):
            for byte in range(s, e):
                if (w.buffer, byte) in expected:
                    expected[(w.buffer, byte)].add((w.layer, w.role))
    got = _bytes_of_bands(block_map(p, views))
    for key, owners in got.items():
        assert key in block0 or (not owners and key not in others), key
    for key, owners in expected.items():  # a cell's codes and its scales are drawn as one piece
        drawn = got.get(key, frozenset())
        assert owners <= drawn and {_unit(o) for o in drawn} == {_unit(o) for o in owners}, key


def _merged(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"])
@pytest.mark.parametrize("layers", [1, 4, 32])
@pytest.mark.parametrize("packed", [True, False])
def test_block_0_is_drawn_where_the_plan_puts_it(layout, layers, packed) -> None:
    """Issue 32: under vLLM 0.29+'s per_layer layout (one buffer, layer outermost) the map drew every
    block of each layer as block 0's (bands over 5 pages) and labelled the whole picture `L0-31`.
    The text map's and the SVG's bands cover exactly block 0's cells where `cell_offset` puts them,
    each band named by the layers whose block-0 cells it holds."""
    from kvpolicy.policy.backends import packed_backend

    backend = packed_backend("TRITON_ATTN") if packed else TRITON
    if Layout.parse(layout) not in backend.layouts:
        pytest.skip(f"{backend.name} has no {layout} here")
    spec = KVCacheSpec(num_layers=layers, block_size=4, num_kv_heads=2, head_size=8,
                       kv_cache_dtype="fp8_per_token_head")
    p = plan_layout(Layout.parse(layout), spec, backend, num_blocks=layers + 1)
    cells = _cells(p, [0])
    for buffer in {b for b, _ in cells}:
        want = _merged((x, x + 1) for b, x in cells if b == buffer)
        written = [b for b in block_map(p, ScaleViews.stride_aware) if b.buffer == buffer and b.owners]
        runs = [(x + k * b.period + q.start, x + k * b.period + q.end)
                for b in written for x in _starts(b) for k in range(b.count) for q in b.pattern if q.owners]
        assert _merged(runs) == want, (buffer, layout)
        for b in written:  # a band's layers are those whose block-0 cells it holds
            held = {cells[(buffer, x)][0] for s, e in runs_of(b) for x in range(s, e)}
            assert {layer for layer, _ in b.owners} == held
    root = _svg(p, ScaleViews.stride_aware)
    drawn = [r for r in root.iter(f"{NS}rect") if r.get("data-kind") == "band" and r.get("data-layers")]
    assert drawn
    for buffer in sorted({b for b, _ in cells})[:1]:  # the first lane: its bands are block 0's cells only
        want = _merged((x, x + 1) for b, x in cells if b == buffer)
        got = _merged((int(r.get("data-start")), int(r.get("data-end"))) for r in drawn)
        assert got == want, layout
    ticks = [t.text for t in root.iter(f"{NS}text") if t.get("data-kind") == "layer-tick"]
    if layout in ("LBNHC", "LBHNC", "LHBNC") and layers > 1 and (packed or layout == "LHBNC"):
        assert f"L{layers - 1}" in ticks and f"L0-{layers - 1}" not in ticks  # one label a layer
    text = render_text(p, ScaleViews.stride_aware)
    assert f"page {p.page_size_bytes} B x {layers} layers" in text


def _starts(b) -> list[int]:
    starts = [b.start]
    for n, s in b.outer:
        starts = [x + i * s for x in starts for i in range(n)]
    return starts


def runs_of(b) -> list[tuple[int, int]]:
    return [(x + k * b.period + q.start, x + k * b.period + q.end)
            for x in _starts(b) for k in range(b.count) for q in b.pattern if q.owners]


@pytest.mark.parametrize("views", [ScaleViews.stride_aware, ScaleViews.assume_per_layer_contiguous])
def test_interleaved_heads_cost_bands_per_writer_not_per_head(views) -> None:
    """Issue 32: a BHLNC block map listed one band per (layer, head): 262,144 bands in 17 s at 512 x 512.
    Each layer's band now repeats over the heads, so the count follows the writers, whatever the heads;
    an overlapping map (naive scale views) stays bounded too."""
    from kvpolicy.policy.backends import packed_backend

    counts = {}
    for heads in (1, 8, 64):
        spec = KVCacheSpec(num_layers=16, block_size=16, num_kv_heads=heads, head_size=64,
                           kv_cache_dtype="fp8_per_token_head")
        p = plan_layout(Layout.parse("BHLNC"), spec, packed_backend("TRITON_ATTN"), num_blocks=17)
        bands = block_map(p, views)
        counts[heads] = len(bands)
        if views is ScaleViews.stride_aware:  # one band a layer (its K and V interleave), repeated per head
            assert len(bands) == spec.num_layers and all(b.repeats == 16 * heads for b in bands)
        else:  # overlapping: listed run by run while that is small, else one mixed range
            assert len(bands) <= 16 * heads * spec.num_layers
    big = KVCacheSpec(num_layers=64, block_size=16, num_kv_heads=128, head_size=128,
                      kv_cache_dtype="fp8_per_token_head")
    p = plan_layout(Layout.parse("BHLNC"), big, TRITON, num_blocks=65)  # the #48412 state: overlapping
    assert len(block_map(p, views)) <= 4 * big.num_layers
    root = _svg(p, views)
    assert sum(1 for _ in root.iter()) < 2500


def test_svg_counts_every_colliding_pair_not_the_listed_ones() -> None:
    """The verifier lists at most MAX_LISTED_COLLISIONS pairs; the drawing says how many there are
    (found by a hostile pass: 200 layers drew "10000 colliding writer pairs" for 39,800)."""
    from unittest import mock

    p = plan("BLNHC", SPEC.model_copy(update={"num_layers": 24}))  # 2 x C(24, 2) = 552 pairs
    with mock.patch("kvpolicy.engine.verify.MAX_LISTED_COLLISIONS", 5):
        text = render_svg(p)
    assert "(552 colliding writer pairs" in text and "(5 colliding" not in text
