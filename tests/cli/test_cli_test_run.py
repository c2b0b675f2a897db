"""`kvpolicy test --run PATTERN` (as `opa test --run`): only the cases whose name the regex matches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

CASES = """\
version: 1
cases:
  - name: nixl asks for LBHNC
    input: {spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}, connector: NixlConnector}
    expect: {layout: LBHNC}
  - name: offloading asks for LBHNC
    input: {spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}, connector: OffloadingConnector}
    expect: {layout: LBHNC}
  - name: no connector takes the first candidate (wrong on purpose)
    input: {spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}}
    expect: {layout: BLHNC}
"""
V = ("--vllm-version", "0.34.0")


@pytest.fixture
def cases(tmp_path: Path) -> Path:
    (tmp_path / "cases.yaml").write_text(CASES)
    return tmp_path / "cases.yaml"


def test_run_selects_by_regex_and_says_how_many(capsys: pytest.CaptureFixture[str], cases: Path) -> None:
    code, out, _ = cli(capsys, "test", str(cases), *V)
    assert code == 1 and "2 passed, 1 failed" in out  # the wrong case fails when everything runs
    code, out, _ = cli(capsys, "test", str(cases), *V, "--run", "asks for LBHNC$", "-v")
    assert code == 0, out
    assert "2 passed, 0 failed (2 of 3 cases selected by --run `asks for LBHNC$`)" in out
    assert "no connector" not in out
    code, out, _ = cli(capsys, "test", str(cases), *V, "--run", "^nixl", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["selection"] == {"run": "^nixl", "selected": 1, "of": 3}
    assert [c["name"] for c in doc["cases"]] == ["nixl asks for LBHNC"]


def test_no_case_matching_is_a_failure_that_says_so(capsys: pytest.CaptureFixture[str], cases: Path) -> None:
    code, out, err = cli(capsys, "test", str(cases), *V, "--run", "Nixl")  # case-sensitive, as opa's
    assert code == 1 and out == ""
    assert "--run: error[no-case-selected]: no case name matches `Nixl` (3 case(s) in the files run)" in err


@pytest.mark.parametrize("pattern", ["a(b", "[z-a]", "*", "x{2,1}"])
def test_a_bad_regex_is_a_usage_error_at_the_flag(capsys: pytest.CaptureFixture[str], cases: Path,
                                                   pattern: str) -> None:
    code, _, err = cli(capsys, "test", str(cases), *V, "--run", pattern)
    assert code == 2 and err.startswith("--run: error[usage]: ") and "is not a regular expression" in err
    assert "Traceback" not in err


def test_every_file_is_still_checked(capsys: pytest.CaptureFixture[str], cases: Path) -> None:
    (cases.parent / "broken.yaml").write_text("version: 1\ncases:\n  - name: x\n    input: {nope: 1}\n")
    code, _, err = cli(capsys, "test", str(cases.parent), *V, "--run", "^nixl")
    assert code == 1 and "broken.yaml" in err
