"""The SVG block map of a deep model stays readable (issue 22, class 6): no text overprints another,
whatever the layout; interleaved layers (BHLNC) are one band label (``L0-31 K+V``) over a tick per head
(issue 32: it was one ``L0-31`` tick and no heads)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from cli_capture import cli

_TEXT = re.compile(r'<text x="([\d.]+)" y="([\d.]+)" ([^>]*)>([^<]*)</text>')


def text_boxes(svg: str) -> list[tuple[float, float, float, float, str]]:
    """Each text's box, as the renderer sizes text (0.6 em a character, cap height 0.8 em)."""
    out = []
    for m in _TEXT.finditer(svg):
        x, y, attrs, text = float(m[1]), float(m[2]), m[3], html.unescape(m[4])
        size = float(re.search(r'font-size="([\d.]+)"', attrs)[1]) if "font-size=" in attrs else 12.0
        width = len(text) * size * 0.6
        anchor = re.search(r'text-anchor="(\w+)"', attrs)
        left = x - width / 2 if anchor and anchor[1] == "middle" else x - width if anchor and anchor[1] == "end" else x
        out.append((left, y - 0.8 * size, left + width, y + 0.2 * size, text))
    return out


def overprinted(svg: str) -> list[tuple[str, str]]:
    boxes = text_boxes(svg)
    return [(a[4], b[4]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5]


def test_the_checker_sees_overprinting() -> None:
    svg = '<text x="10" y="10" font-size="11">L30</text><text x="20" y="10" font-size="11">L31</text>'
    assert overprinted(svg) == [("L30", "L31")]


@pytest.mark.parametrize("layers", [32, 80])
@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLNHC", "BHLNC"])
def test_no_label_overprints_another(layers: int, layout: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"num_layers: {layers}\nblock_size: 16\nnum_kv_heads: 8\nhead_size: 128\n")
    svg = tmp_path / "map.svg"
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--spec", str(spec), "--kv-cache-dtype", "auto",
                       "--connector", "none", "--map-layout", layout, "--svg", str(svg))
    assert code == 0, err
    text = svg.read_text()
    assert overprinted(text) == []
    ticks = re.findall(r'data-kind="layer-tick">([^<]*)<', text)
    assert ticks, "the layers are labelled"
    labels = re.findall(r'data-kind="layer-label">([^<]*)<', text)
    if layout == "BHLNC":  # each head's slab holds every layer: a tick per head, the band names the layers
        assert ticks == [f"H{h}" for h in range(8)] and labels == [f"L0-{layers - 1} K+V"]
    elif layout in ("LBNHC", "LHBNC"):  # a page (or a head's run) per layer, a slab apart: a tick per layer
        assert f"L0-{layers - 1}" not in ticks and ticks[0] == "L0" and ticks[-1] == f"L{layers - 1}"


def test_an_overlap_map_of_a_deep_model_is_readable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 32\nblock_size: 16\nnum_kv_heads: 8\nhead_size: 128\n")
    svg = tmp_path / "map.svg"
    cli(capsys, "dry-run", "--vllm-version", "issue-48412", "--spec", str(spec), "--kv-cache-dtype",
        "fp8_per_token_head", "--map-layout", "BLNHC", "--svg", str(svg))
    assert "OVERLAP" in svg.read_text() and overprinted(svg.read_text()) == []
