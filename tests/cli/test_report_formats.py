"""Every verb's machine output: ``--format json`` carries ``format_version`` and never NaN;
``--format github`` and ``--format sarif`` (validate, lint) are what CI systems read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import unquote_to_bytes

import jsonschema
import pytest
from cli_capture import cli

from kvpolicy.engine.cli.main import main
from kvpolicy.engine.cli.report_formats import FORMAT_VERSION, github_annotations, json_text, sarif_log
from kvpolicy.policy.errors import Diagnostic, shown, shown_file

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


def test_json_keys_that_are_not_strings_are_written_as_json_writes_them() -> None:
    """Capability majors key some facts (`supported_layouts_by_capability`): ints become JSON's string keys."""
    assert json.loads(json_text({8: ["LBHNC"], "name\udcff": 1})) == {"8": ["LBHNC"], "name\\xff": 1}


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
    # column 1 is a column (a rule at the start of its line), only 0 means "no column"
    log = sarif_log([("error", Diagnostic("rules/g.yaml", 2, 1, "x", "m"))], tool_version="9.9")
    (at_one,) = log["runs"][0]["results"]
    assert at_one["locations"][0]["physicalLocation"]["region"] == {"startLine": 2, "startColumn": 1}


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


# --------------------------------------------------------------------------- legal but awkward file names

# Linux file names are bytes: any but NUL and `/`. Python holds those that are not UTF-8 as lone surrogates
# (PEP 383), which a UTF-8 stdout refuses: `validate --format sarif` was a UnicodeEncodeError traceback and
# `--format github` exited 1 on clean rules. Newlines, `%`, `:` and `,` are what the formats must escape.
AWKWARD = {"not UTF-8": b"bad\xff\xfe", "newline": b"new\nline", "percent": b"p%41ct%", "colon": b"co:lon",
           "comma": b"com,ma", "space": b"sp ace"}
_TWICE = ("version: 1\nrules:\n  - id: site-no-cross\n    description: a site rule\n"
          "    forbid: {placement: cross_layer}\n  - id: site-no-cross-again\n    description: the same again\n"
          "    forbid: {placement: cross_layer}\n")
_BROKEN = "version: 1\nrules:\n  - id: site-bad\n    descriptio: typo\n    forbid: {placement: cross_layer}\n"
_CASE = ("version: 1\ncases:\n  - name: a case that fails\n    input:\n      spec: {num_layers: 32, block_size: 16, "
         "num_kv_heads: 8, head_size: 128}\n      backend: FLASH_ATTN\n    expect:\n      layout: cross_layer/NHD\n")
_V = ("--vllm-version", "issue-48412")


def _awkward_dir(tmp_path: Path, name: bytes, text: str) -> tuple[str, str]:
    """``<tmp>/dir-<name>/<name>.yaml`` holding ``text`` and ``tests/<name>.yaml`` a failing case; returns the
    directory and the rule file as the CLI takes and names them (relative to the working directory)."""
    directory = b"dir-" + name
    os.makedirs(os.path.join(os.fsencode(tmp_path), directory, b"tests"))
    for path, content in ((os.path.join(directory, name + b".yaml"), text),
                          (os.path.join(directory, b"tests", name + b".yaml"), _CASE)):
        with open(os.path.join(os.fsencode(tmp_path), path), "wb") as f:
            f.write(content.encode())
    return os.fsdecode(directory), os.fsdecode(os.path.join(directory, name + b".yaml"))


def _github_unescape(value: str) -> str:
    """A property as the Actions runner unescapes it (actions/toolkit command.ts)."""
    for escaped, char in (("%2C", ","), ("%3A", ":"), ("%0A", "\n"), ("%0D", "\r"), ("%25", "%")):
        value = value.replace(escaped, char)
    return value


@pytest.mark.parametrize("verb", ["validate", "lint"])
@pytest.mark.parametrize("fmt", ["text", "json", "sarif", "github"])
@pytest.mark.parametrize("name", AWKWARD, ids=list(AWKWARD))
@pytest.mark.parametrize("broken", [False, True], ids=["clean", "broken"])
def test_a_rule_file_of_any_legal_name_is_reported_in_every_format(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], verb: str, fmt: str,
        name: str, broken: bool) -> None:
    """capsys's stdout is strict UTF-8, as Python's is under a UTF-8 locale: the output is written, the exit
    code is the one a plain name gets, and the file is named as each format names it (`shown` text; SARIF's
    URI from the name's bytes; GitHub's property escaped as the runner unescapes it)."""
    monkeypatch.chdir(tmp_path)
    directory, file = _awkward_dir(tmp_path, AWKWARD[name], _BROKEN if broken else _TWICE)
    code, out, err = cli(capsys, verb, directory, *_V, "--format", fmt)
    assert code == (1 if broken else 0) and "Traceback" not in err
    at = [(f"{file}", 3, 5, "missing-key"), (file, 4, 5, "unknown-key")] if broken else [(file, 3, 0, None),
                                                                                           (file, 6, 0, None)]
    if verb == "validate" and not broken:
        at = []  # clean rules: validate names no file
    if fmt == "text":
        lines = (out + err).splitlines()
        for path, line, col, code_ in at:  # one line per finding, starting with its location
            start = f"{shown_file(path)}:{line}" + (f":{col}: error[{code_}]" if code_ else ": note[")
            assert any(text.startswith(start) for text in lines), start
    elif fmt == "json":
        doc = json.loads(out)
        json.dumps(doc, ensure_ascii=False).encode("utf-8")  # no lone surrogate in any string
        sources = [f["rule"]["source"].rsplit(":", 1) for f in doc.get("findings", []) if f.get("rule")]
        found = ({(d["file"], d["line"]) for d in doc["error"]["diagnostics"]} if broken else
                 {(path, int(line)) for path, line in sources})
        # a diagnostic's `file` is the name (`shown`); a rule's `source` a location, one line (`shown_file`)
        assert found >= {((shown if broken else shown_file)(path), line) for path, line, _, _ in at}
    elif fmt == "sarif":
        log = json.loads(out)
        jsonschema.validate(log, SARIF_REQUIRED)
        uris = {unquote_to_bytes(loc["physicalLocation"]["artifactLocation"]["uri"])
                for r in log["runs"][0]["results"] for loc in r.get("locations", [])}
        assert {os.fsencode(path) for path, *_ in at} <= uris  # every byte of the name, percent-encoded
    else:
        files = []
        for command in out.splitlines():
            assert command.startswith("::") and "::" in command[2:], command
            props = command[2:].split("::", 1)[0].split(" ", 1)[1]
            files += [_github_unescape(p[5:]) for p in props.split(",") if p.startswith("file=")]
        assert {shown(path) for path, *_ in at} <= set(files)


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("name", AWKWARD, ids=list(AWKWARD))
def test_test_dry_run_and_diff_name_any_legal_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str], fmt: str, name: str) -> None:
    """The verbs that print rule sources and case locations: a failing case (exit 1), a decision's explanation
    and a diff, each naming the file as a location shows it, on one line."""
    monkeypatch.chdir(tmp_path)
    directory, file = _awkward_dir(tmp_path, AWKWARD[name], _TWICE)
    case = os.path.join(directory, "tests", os.path.basename(file))
    for argv, expected in ((["test", "--rules", directory, os.path.join(directory, "tests")], 1),
                           (["dry-run", "--rules", directory], 0),
                           (["diff", str(RULES), directory], 1)):  # exit 1: decisions change
        code, out, err = cli(capsys, *argv, *_V, "--format", fmt)
        assert code == expected and "Traceback" not in err, (argv, err)
        if fmt == "json":
            text = json.dumps(json.loads(out), ensure_ascii=False)
            text.encode("utf-8")
            assert (json.dumps(shown_file(case))[1:-1] if argv[0] == "test" else
                    json.dumps(f"{shown_file(file)}:3")[1:-1]) in text
        else:
            assert any((f"FAIL {shown_file(case)}:3: a case that fails" if argv[0] == "test" else
                        f"{shown_file(file)}:3") in line for line in out.splitlines())


def test_shown_writes_only_what_no_output_could_carry() -> None:
    name = os.fsdecode(b"bad\xff.yaml")  # as os.listdir returns it
    assert shown(name) == "bad\\xff.yaml" and shown("\ud800x") == "\\ud800x"
    assert shown("sp ace é,%:.yaml") == "sp ace é,%:.yaml" and shown("new\nline") == "new\nline"
    assert shown_file("new\nline\t\x1b.yaml") == "new\\nline\\t\\x1b.yaml" and shown_file(name) == "bad\\xff.yaml"
    d = Diagnostic(name, 3, 5, "c", "m")
    assert d.render() == "bad\\xff.yaml:3:5: error[c]: m"
    assert github_annotations([("error", d)]).startswith("::error file=bad\\xff.yaml,line=3,col=5,")
    [result] = sarif_log([("error", d)], tool_version="0")["runs"][0]["results"]
    assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "bad%FF.yaml"


@pytest.mark.parametrize("name", [b"red\x1b[31mX", b"car\rret", "ls\u2028x".encode(), b"b\x07d\x7f"],
                         ids=["escape", "cr", "line-separator", "bell-del"])
def test_a_rule_directory_of_any_legal_name_is_named_on_one_line_with_no_terminal_control(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: bytes) -> None:
    """A layer's directory is named as a location names a file (`shown_file`) wherever text output names it:
    validate's `layer N:` lines, the header of a load error, dry-run's `rule set:` line. They were written raw:
    a directory name could move the cursor, recolour or rewrite the terminal, or split the line (issue 23's
    hostile pass, class 5)."""
    monkeypatch.chdir(tmp_path)
    clean, _ = _awkward_dir(tmp_path, name, _TWICE)
    broken, _ = _awkward_dir(tmp_path, name + b"-broken", _BROKEN)
    runs = [(["validate", clean, *_V], 0), (["validate", broken, *_V], 1), (["dry-run", "--rules", clean, *_V], 0),
            (["test", "--rules", clean, os.path.join(clean, "tests"), *_V], 1)]  # and the coverage lines
    for argv, expected in runs:
        code, out, err = cli(capsys, *argv)
        assert code == expected and "Traceback" not in err
        assert not [c for c in "\x1b\r\x07\x7f\u2028\x85\x9b" if c in out + err], (argv, out + err)
        assert shown_file(clean if argv[0] == "test" else argv[-3]) in out + err, argv
