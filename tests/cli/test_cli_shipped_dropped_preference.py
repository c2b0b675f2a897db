"""A shipped preference the shipped rules removed is a note in the explanation, not a warning (issue 22): vLLM
logs nothing there and the operator cannot act on it; an operator's preference, or an operator's rule removing
one, still warns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

LLAMA = str(Path(__file__).parents[1] / "fixtures" / "model_configs" / "llama-3.1-8b-instruct" / "config.json")
GATE = "uniform-kv-cache-when-the-gate-allows (global) prefers"
OPERATOR_PREFERS = """\
version: 1
rules:
  - id: site-prefers-blhnc
    description: a preference the release cannot honour
    prefer: {layout: BLHNC}
"""


def test_the_gates_own_dropped_preference_is_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.28.0", "--model", LLAMA, "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["warnings"] == [] and any(n.startswith(GATE) for n in data["notes"])
    assert GATE not in err
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.28.0", "--model", LLAMA)
    assert code == 0 and "warnings:" not in out and f"notes:\n  {GATE}" in out and "warning" not in err


def test_an_operators_dropped_preference_still_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "global.yaml").write_text(OPERATOR_PREFERS)
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.28.0", "--model", LLAMA, "--rules", str(tmp_path),
                       "--format", "json")
    data = json.loads(out)
    assert code == 0 and any(w.startswith("site-prefers-blhnc (global) prefers BLHNC") for w in data["warnings"])
