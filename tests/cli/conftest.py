"""Fixtures shared by the CLI tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

RULES_48412 = Path(__file__).resolve().parents[2] / "rules" / "issue-48412"


@pytest.fixture(scope="module")
def no_pth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """issue-48412's shipped rules minus the per-token-head guard: lint finds unsafe permits."""
    root = tmp_path_factory.mktemp("rules-no-pth")
    shutil.copytree(RULES_48412, root, dirs_exist_ok=True)
    text = (root / "global.yaml").read_text()
    start = text.index("  - id: per-token-head-forbids-cross-layer")
    end = text.index("  - id: cross-layer-needs-block-stride-indexing")
    (root / "global.yaml").write_text(text[:start] + text[end:])
    return root
