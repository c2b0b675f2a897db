"""`kvpolicy validate FILE` and `validate -`: one rule file, located errors, then layered on the shipped rules."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from cli_capture import cli

GOOD = """\
version: 1
rules:
  - id: site-no-cross-layer
    description: site rule
    forbid: {placement: cross_layer}
"""
BAD = """\
version: 1
rules:
  - id: site-typo
    forbid: {placement: crosslayer}
"""


def test_one_file_is_checked_and_layered_on_the_shipped_rules(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    f = tmp_path / "site.yaml"
    f.write_text(GOOD)
    code, out, _ = cli(capsys, "validate", str(f), "--vllm-version", "0.34.0")
    assert code == 0
    assert out.startswith("ok: 1 rules in 1 file, a global file (digest sha256:")
    assert "layered on rules/vllm-0.34 without conflict" in out


def test_stdin_errors_are_located_at_the_given_name(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(BAD))
    code, _, err = cli(capsys, "validate", "-", "--vllm-version", "0.34.0")
    assert code == 1
    assert "<stdin>:3:5: error[missing-key]: missing required key `description`" in err
    assert "<stdin>:4:25: error[invalid-value]" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(BAD))
    code, out, _ = cli(capsys, "validate", "-", "--stdin-filename", "site/global.yaml", "--format", "github")
    assert code == 1 and "file=site/global.yaml,line=3" in out


def test_a_file_whose_id_collides_with_a_shipped_rule_fails_like_a_directory(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "global.yaml"
    f.write_text(GOOD.replace("site-no-cross-layer", "mixed-hnc-shapes-need-block-compact"))
    code, _, err = cli(capsys, "validate", str(f), "--vllm-version", "0.34.0")
    assert code == 1 and f"{f}:3:5: error[duplicate-rule-id]" in err
    assert cli(capsys, "validate", str(f), "--no-shipped-rules")[0] == 0


def test_a_connector_file_is_told_by_its_directory_or_its_connector_key(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    conn = tmp_path / "connectors"
    conn.mkdir()
    (conn / "Nixl.yaml").write_text(GOOD)  # in connectors/ without `connector:`: the directory says it is one
    code, _, err = cli(capsys, "validate", str(conn / "Nixl.yaml"))
    assert code == 1 and "error[missing-connector]" in err
    (tmp_path / "nixl.yaml").write_text(GOOD.replace("version: 1\n", "version: 1\nconnector: NixlConnector\n"))
    code, out, _ = cli(capsys, "validate", str(tmp_path / "nixl.yaml"), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["kind"] == "connector" and doc["rules"] == 1


def test_stdin_filename_without_stdin_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "site.yaml"
    f.write_text(GOOD)
    code, _, err = cli(capsys, "validate", str(f), "--stdin-filename", "x.yaml")
    assert code == 2 and "--stdin-filename: error[usage]: applies to `validate -` only" in err


MISSPELT = """\
version: 1
connector: NixlConector
rules:
  - id: nixl-likes-hnd
    description: a connector name with a typo
    when: {field: backend.name, eq: flash_attn}
    prefer: {layout: LBHNC}
"""


def test_one_files_warnings_show_in_text_as_in_json(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "connectors" / "nixl.yaml"
    f.parent.mkdir()
    f.write_text(MISSPELT)
    code, out, _ = cli(capsys, "validate", str(f), "--vllm-version", "0.34.0", "--format", "json")
    assert code == 0 and {w["code"] for w in json.loads(out)["warnings"]} >= {"near-connector-name", "unknown-literal"}
    code, out, err = cli(capsys, "validate", str(f), "--vllm-version", "0.34.0")
    assert code == 0 and out.startswith("ok: 1 rules in 1 file, a connector file")
    assert f"{f}:2:12: warning[near-connector-name]" in err and "did you mean `NixlConnector`?" in err
    assert "warning[unknown-literal]" in err and "did you mean `FLASH_ATTN`?" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(MISSPELT))
    code, out, err = cli(capsys, "validate", "-", "--stdin-filename", "site/connectors/nixl.yaml",
                         "--vllm-version", "0.34.0")
    assert code == 0 and "site/connectors/nixl.yaml:2:12: warning[near-connector-name]" in err
    assert "warning[unknown-literal]" in err
