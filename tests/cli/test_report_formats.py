"""Every verb's machine output: ``--format json`` carries ``format_version`` and never NaN;
``--format github`` and ``--format sarif`` (validate, lint) are what CI systems read."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from cli_capture import cli

from kvpolicy.engine.cli.main import main
from kvpolicy.engine.cli.report_formats import FORMAT_VERSION, github_annotations, json_text, sarif_log
from kvpolicy.policy.errors import Diagnostic

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "rules" / "issue-48412"

# The parts of SARIF 2.1.0 (OASIS, sarif-schema-2.1.0.json) a consumer needs, with their required keys and
# enums: GitHub code scanning rejects a log without them.
SARIF_REQUIRED = {
    "type": "object",
    "required": ["version", "runs"],
    "properties": {
        "version": {"const": "2.1.0"},
        "$schema": {"type": "string", "format": "uri"},
        "runs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["tool"],
            "properties": {
                "tool": {"type": "object", "required": ["driver"], "properties": {"driver": {
                    "type": "object", "required": ["name"],
                    "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                   "rules": {"type": "array", "items": {"type": "object", "required": ["id"]}}}}}},
                "results": {"type": "array", "items": {
                    "type": "object", "required": ["message"],
                    "properties": {
                        "ruleId": {"type": "string"},
                        "level": {"enum": ["none", "note", "warning", "error"]},
                        "message": {"type": "object", "required": ["text"]},
                        "locations": {"type": "array", "items": {"type": "object", "properties": {
                            "physicalLocation": {"type": "object", "required": ["artifactLocation"], "properties": {
                                "artifactLocation": {"type": "object", "required": ["uri"]},
                                "region": {"type": "object", "properties": {
                                    "startLine": {"type": "integer", "minimum": 1},
                                    "startColumn": {"type": "integer", "minimum": 1}}}}}}}}}}}}}}},
}


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A rule directory with two located errors, one of them in a connector file."""
    (tmp_path / "connectors").mkdir()
    (tmp_path / "global.yaml").write_text(
        "version: 1\nrules:\n  - id: a\n    description: d\n    when: {field: kv.nope, eq: 1}\n"
        "    forbid: {layout: LBHNC}\n")
    (tmp_path / "connectors" / "NixlConnector.yaml").write_text(
        "version: 1\nconnector: NixlConnector\nrules:\n  - id: b\n    description: d\n"
        "    forbid: {layout: ZZZZZ}\n")
    return tmp_path



# --------------------------------------------------------------------------- json


def _verbs(tmp: Path) -> list[list[str]]:
    return [["dry-run", "--format", "json"], ["validate", "--format", "json"], ["test", "--format", "json"],
            ["lint", "--format", "json"], ["diff", str(RULES), str(RULES), "--format", "json"]]


@pytest.mark.parametrize("verb", ["dry-run", "validate", "test", "lint", "diff"])
def test_every_verb_writes_one_versioned_json_document(verb: str, capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    argv = next(a for a in _verbs(tmp_path) if a[0] == verb)
    code, out, _ = cli(capsys, *argv)
    assert code == 0
    doc = json.loads(out)
    assert next(iter(doc)) == "format_version" and doc["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize("verb", ["dry-run", "validate", "test", "lint"])
def test_every_verbs_json_error_is_a_versioned_document(verb: str, broken: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = {"dry-run": ["dry-run", "--rules", str(broken)], "validate": ["validate", str(broken)],
            "test": ["test", "--rules", str(broken)], "lint": ["lint", str(broken)]}[verb]
    code, out, err = cli(capsys, *argv, "--format", "json")
    assert code == 1
    doc = json.loads(out)
    assert doc["format_version"] == FORMAT_VERSION and doc["ok"] is False
    assert doc["error"]["kind"] == "RuleLoadError" and len(doc["error"]["diagnostics"]) >= 2
    assert "error[unknown-field]" in err  # the people's copy still goes to stderr


def test_diff_json_error(broken: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "diff", str(RULES), str(broken), "--format", "json")
    assert code == 2
    assert json.loads(out)["error"]["kind"] == "RuleLoadError"


def test_schema_accepts_format_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "schema", "--format", "json")
    assert code == 0 and json.loads(out)["$id"] == "urn:kvpolicy:rule-file:1"


def test_json_never_holds_nan_or_infinity() -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            json_text({"x": bad})
    assert json.loads(json_text({"x": 1.5})) == {"x": 1.5}


# --------------------------------------------------------------------------- github


def test_github_annotations_escape_as_the_runner_unescapes() -> None:
    d = Diagnostic("rules/a,b:c.yaml", 12, 5, "unknown-field", "100% wrong\nsecond line: x, y", "fix it")
    assert github_annotations([("error", d)]) == (
        "::error file=rules/a%2Cb%3Ac.yaml,line=12,col=5,title=unknown-field::"
        "100%25 wrong%0Asecond line: x, y%0Ahelp: fix it")
    nowhere = Diagnostic("--rules", 0, 0, "usage", "bad\r")
    assert github_annotations([("warning", nowhere), ("note", nowhere)]) == (
        "::warning file=--rules,title=usage::bad%0D\n::notice file=--rules,title=usage::bad%0D")


def test_validate_github_annotates_every_problem(broken: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "validate", str(broken), "--format", "github")
    assert code == 1
    lines = out.splitlines()
    assert len(lines) >= 2 and all(line.startswith("::error file=") for line in lines)
    assert any(f"file={broken}/global.yaml,line=5,col=19," in line and "title=unknown-field::" in line
               for line in lines)
    assert any("NixlConnector.yaml,line=" in line for line in lines)


def test_validate_github_prints_nothing_when_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "validate", "--format", "github")[:2] == (0, "")


def test_lint_github_annotates_findings_at_their_rules(no_pth: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "lint", str(no_pth), "--no-shipped-rules", "--format", "github")
    assert code == 1
    lines = out.splitlines()
    assert any(line.startswith("::error ") and "title=unsafe-permit::" in line for line in lines)
    notes = [line for line in lines if line.startswith("::notice ")]
    assert notes and all(f"file={no_pth}/global.yaml,line=" in line for line in notes)


# --------------------------------------------------------------------------- sarif


def test_sarif_log_structure() -> None:
    diags = [("error", Diagnostic("rules/g.yaml", 3, 7, "unknown-field", "m", "h")),
             ("warning", Diagnostic("rules/g.yaml", 9, 0, "dead-rule", "n")),
             ("note", Diagnostic("my rules/--rules", 0, 0, "usage", "o"))]
    log = sarif_log(diags, tool_version="9.9")
    jsonschema.validate(log, SARIF_REQUIRED)
    run = log["runs"][0]
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == ["dead-rule", "unknown-field", "usage"]
    first, second, third = run["results"]
    assert first["level"] == "error" and first["message"]["text"] == "m\nhelp: h"
    assert first["locations"][0]["physicalLocation"]["region"] == {"startLine": 3, "startColumn": 7}
    assert second["locations"][0]["physicalLocation"]["region"] == {"startLine": 9}
    assert third["locations"][0]["physicalLocation"] == {"artifactLocation": {"uri": "my%20rules/--rules"}}


def test_validate_sarif(broken: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "validate", str(broken), "--format", "sarif")
    assert code == 1
    log = json.loads(out)
    jsonschema.validate(log, SARIF_REQUIRED)
    results = log["runs"][0]["results"]
    assert len(results) >= 2 and {r["level"] for r in results} == {"error"}
    assert "unknown-field" in {r["ruleId"] for r in results}
    code, out, _ = cli(capsys, "validate", "--format", "sarif")
    assert code == 0 and json.loads(out)["runs"][0]["results"] == []


def test_lint_sarif(no_pth: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "lint", str(no_pth), "--no-shipped-rules", "--format", "sarif")
    assert code == 1
    log = json.loads(out)
    jsonschema.validate(log, SARIF_REQUIRED)
    levels = {r["ruleId"]: r["level"] for r in log["runs"][0]["results"]}
    assert levels["unsafe-permit"] == "error" and levels["not-load-bearing"] == "note"


def test_text_only_verbs_refuse_ci_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dry-run", "--format", "sarif"]) == 2
    assert "invalid choice" in capsys.readouterr().err
