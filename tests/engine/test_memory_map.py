"""The block map: owners of every byte range, overlaps marked, as text and SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from kvpolicy.engine.memory_map import block_map, render_svg, render_text
from kvpolicy.engine.plan import plan_layout
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


def test_svg_is_well_formed_and_marks_overlaps_red() -> None:
    ns = "{http://www.w3.org/2000/svg}"
    unsafe = ET.fromstring(render_svg(plan("BLNHC")))
    safe = ET.fromstring(render_svg(plan("BLNHC"), ScaleViews.stride_aware))
    red = [r for r in unsafe.iter(f"{ns}rect") if r.get("fill") == "#e15759"]
    assert len(red) == 256 and all("OVERLAP" in r.find(f"{ns}title").text for r in red)
    assert not [r for r in safe.iter(f"{ns}rect") if r.get("fill") == "#e15759"]
