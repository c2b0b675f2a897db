"""`kvpolicy validate`: the one-line summary when clean, every located error when not."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.load import rule_files

ROOT = Path(__file__).resolve().parents[2]
N_RULES = len(LayoutEngine.default().ruleset.rules)  # 11 when written
N_FILES = len(rule_files(ROOT / "rules" / "issue-48412"))  # 6 when written


def test_shipped_rules_are_clean(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "validate")
    assert code == 0 and err == ""
    assert re.fullmatch(rf"ok: {N_RULES} rules in {N_FILES} files \(digest sha256:[0-9a-f]{{64}}\)\n", out), out


def test_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "validate", str(ROOT / "rules" / "issue-48412"), "--format", "json")
    data = json.loads(out)
    assert code == 0
    assert data["ok"] is True and data["rules"] == N_RULES and data["files"] == N_FILES
    assert data["digest"].startswith("sha256:")


def test_broken_rules_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    shutil.copytree(ROOT / "rules" / "issue-48412", tmp_path / "r", ignore=shutil.ignore_patterns("tests"))
    root = tmp_path / "r"
    (root / "global.yaml").write_text((root / "global.yaml").read_text().replace(
        "{field: connector.present, eq: false}", "{field: connector.presnt, eq: false}"))
    (root / "connectors" / "lmcache.yaml").write_text(
        "version: 1\nconnector: LMCacheConnector\nrules:\n  - id: lmcache-keeps-per-layer\n"
        "    description: d\n    prefer: {placement: per_layer}\n    wieght: 1\n")
    code, out, err = cli(capsys, "validate", str(root), "--no-shipped-rules")
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert lines[0] == f"2 error(s) in rule set `{root}`"
    assert any(re.fullmatch(rf"{re.escape(str(root))}/global\.yaml:\d+:\d+: error\[unknown-field\]: "
                            r"unknown field `connector\.presnt`", line) for line in lines), err
    assert "  help: did you mean `connector.present`? see docs/rule-language.md for every field path" in lines
    assert "LMCacheConnector`" not in err  # any well-formed name loads; a near one warns once the set loads
    assert f"{root}/connectors/lmcache.yaml:7:5: error[unknown-key]: unknown key `wieght`" in lines
    assert "Traceback" not in err


def test_broken_rules_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text("version: 1\nrules:\n\t- id: x\n")
    code, out, err = cli(capsys, "validate", str(tmp_path), "--format", "json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert data["error"]["diagnostics"][0]["code"] == "yaml-syntax"
    assert data["error"]["diagnostics"][0]["line"] == 3
    assert "error[yaml-syntax]" in err


@pytest.mark.parametrize("argv", [["validate", "{nope}"], ["test", "{nope}"], ["dry-run", "--rules", "{nope}"],
                                  ["diff", "{nope}", "{nope}"], ["lint", "{nope}"]])
def test_a_path_that_names_nothing_is_a_usage_error_for_every_verb(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]) -> None:
    code, out, err = cli(capsys, *[a.format(nope=tmp_path / "nope") for a in argv])
    assert code == 2, err  # `validate nope` exited 1 while the other verbs exited 2
    assert out == "" and "error[usage]" in err and "nope" in err


def test_empty_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = cli(capsys, "validate", str(tmp_path))
    assert code == 1 and "error[no-rule-files]" in err


def test_warnings_are_shown_beside_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An error does not hide the warnings about the rules that did load: errors first, exit code from them."""
    (tmp_path / "connectors").mkdir()
    (tmp_path / "global.yaml").write_text(
        "version: 1\nrules:\n"
        "  - id: typo\n    description: x\n    forbid: {placement: crosslayer}\n"
        "  - id: lit\n    description: y\n    when: {field: backend.name, eq: flash_attn}\n"
        "    forbid: {placement: cross_layer}\n")
    (tmp_path / "connectors" / "n.yaml").write_text(
        "version: 1\nconnector: NixlConector\nrules:\n"
        "  - id: n\n    description: z\n    forbid: {placement: cross_layer}\n")
    code, _, err = cli(capsys, "validate", str(tmp_path))
    assert code == 1
    error = err.index(f"{tmp_path}/global.yaml:5:25: error[invalid-value]")
    assert error < err.index("warning[near-connector-name]") and error < err.index("warning[unknown-literal]")
    code, out, _ = cli(capsys, "validate", str(tmp_path), "--format", "json")
    data = json.loads(out)
    assert code == 1 and not data["ok"] and {w["code"] for w in data["warnings"]} == {"near-connector-name",
                                                                                      "unknown-literal"}
    code, out, _ = cli(capsys, "validate", str(tmp_path), "--format", "github")
    assert out.index("::error ") < out.index("::warning ") and "title=unknown-literal" in out
    code, _, err = cli(capsys, "validate", str(tmp_path / "global.yaml"))
    assert code == 1 and "error[invalid-value]" in err and "warning[unknown-literal]" in err
