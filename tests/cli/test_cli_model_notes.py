"""What reading a model config assumed (a `ModelConfigWarning`: a float32 Gemma-2 served in bfloat16) is tied
to its deployment or case and said as dry-run --model says it, never a raw Python warning (issue 22)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
NOTE = "warning[dtype-downcast]"


@pytest.fixture
def gemma(tmp_path: Path) -> Path:
    config = json.loads((ROOT / "tests" / "fixtures" / "model_configs" / "gemma-2-2b-it" / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(config))
    return tmp_path / "gemma"


def test_fleet_deployments_carry_their_model_notes(gemma: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(gemma.parent)
    Path("fleet.yaml").write_text("version: 1\ndeployments:\n  - name: a\n    model: gemma\n"
                                  "  - name: b\n    model: gemma\n    kv_cache_dtype: fp8\n")
    with _no_python_warning():
        code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--fleet", "fleet.yaml",
                             "--format", "json")
    assert code == 0, err
    deps = json.loads(out)["deployments"]
    assert [any(w.startswith(f"gemma/config.json: {NOTE}") for w in d["warnings"]) for d in deps] == [True, True]
    with _no_python_warning():
        code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--fleet", "fleet.yaml")
    assert f"  a: gemma/config.json: {NOTE}" in out and f"  b: gemma/config.json: {NOTE}" in out


def test_policy_test_cases_carry_their_model_notes(gemma: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = gemma.parent / "r"
    (rules / "tests").mkdir(parents=True)
    (rules / "global.yaml").write_text("version: 1\nrules: []\n")
    (rules / "tests" / "t.yaml").write_text("version: 1\ncases:\n  - name: gem\n    input: {model: ../../gemma}\n"
                                            "    expect: {layout: LBNHC}\n")
    with _no_python_warning():
        code, out, err = cli(capsys, "test", "--rules", str(rules), "--vllm-version", "0.34.0")
    assert code == 0, out + err
    assert f"t.yaml:3: gem: {rules}/tests/../../gemma/config.json: {NOTE}" in out
    with _no_python_warning():
        code, out, _ = cli(capsys, "test", "--rules", str(rules), "--vllm-version", "0.34.0", "--format", "json")
    (case,) = json.loads(out)["cases"]
    assert any(NOTE in w for w in case["warnings"])


def test_doctor_says_the_model_notes(gemma: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    with _no_python_warning():
        code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0", "--model", str(gemma), "--format", "json")
    assert code == 0
    assert any(NOTE in w for w in json.loads(out)["decision"]["warnings"])


class _no_python_warning:
    """No warning reaches Python's machinery (the CLI said it itself)."""

    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._caught = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
        assert not [w for w in self._caught if type(w.message).__name__ == "ModelConfigWarning"], self._caught
