"""The text and github outputs' one boundary: an operator's control characters are shown, never obeyed.

A name holding ESC could recolour or clear the operator's terminal, BEL ring it, CR overwrite the line
that says "refused", a bidirectional override reorder what a reviewer reads in a CI log. Every verb writes
through the CLI's stdout and stderr, which pass each write through `terminal_text`; these tests feed such
characters through the inputs the last hostile pass found raw in 17 outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.policy.errors import terminal_text

MODEL = Path(__file__).resolve().parents[2] / "docs" / "examples" / "models" / "qwen2.5-0.5b"
HOSTILE = "\x1b[2J\x07\r\u202e\x9b"
RAW = ("\x1b", "\x07", "\r", "\u202e", "\x9b")


def _clean(*texts: str) -> None:
    for text in texts:
        for char in RAW:
            assert char not in text, f"raw {char!r} reached the output: {text[:300]!r}"


@given(st.text())
def test_terminal_text_leaves_no_control_character_but_tab_and_newline(text: str) -> None:
    shown = terminal_text(text)
    shown.encode("utf-8")  # a lone surrogate (a file name that is not UTF-8) is escaped too
    assert all(c in "\t\n" or (c.isprintable() or c == " " or ord(c) > 0x9F)
               for c in shown if not (0x202A <= ord(c) <= 0x202E or 0x2066 <= ord(c) <= 0x2069))
    assert not any(0x202A <= ord(c) <= 0x202E or 0x2066 <= ord(c) <= 0x2069 for c in shown)
    assert not any(ord(c) < 0x20 and c not in "\t\n" for c in shown)
    assert not set(shown) & {"\u2028", "\u2029", "\u200e", "\u200f", "\u061c"}  # separators, bidi marks


def test_terminal_text_keeps_what_is_printable_and_names_what_it_escaped() -> None:
    assert terminal_text("fp8 → L0-31\tok\n") == "fp8 → L0-31\tok\n"
    assert terminal_text("a\x1b[31mb\x07\r\u202e") == "a\\x1b[31mb\\x07\\x0d\\u202e"
    # a line separator would show one diagnostic as two lines in an editor or a log viewer
    assert terminal_text("x.yaml:1:1\u2028x.yaml:9:9: error[forged]") == "x.yaml:1:1\\u2028x.yaml:9:9: error[forged]"


@pytest.mark.parametrize("argv", [
    ("dry-run", "--vllm-version", f"0.3{HOSTILE}"),
    ("dry-run", "--kv-cache-dtype", f"fp8{HOSTILE}"),
    ("dry-run", "--model", f"./no-such-model{HOSTILE}"),
    ("dry-run", "--vllm-version", "0.34", "--", f"./model{HOSTILE}", "--block-size", f"16{HOSTILE}"),
    ("validate", "--format", "github", f"rules{HOSTILE}.yaml"),
    ("compat", "vllm-0.28", f"vllm-0.3{HOSTILE}"),
    ("validate", f"rules{HOSTILE}.yaml"),
    ("inspect", f"dir{HOSTILE}"),
])
def test_operator_input_reaches_text_output_escaped(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    code, out, err = cli(capsys, *argv)
    assert code == 2, (out, err)
    _clean(out, err)
    assert "\\x1b" in out + err  # the input is still named, so the operator can find it


def test_a_refused_transfer_config_says_so_without_its_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "dry-run", "--kv-transfer-config", f"not json{HOSTILE}")
    assert code == 2 and "invalid JSON" in err
    _clean(out, err)


def test_fleet_and_case_names_reach_every_format_escaped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text('version: 1\ndeployments:\n  - name: "bad\\e[2Jname\\a"\n    vllm_version: "0.34.0"\n'
                     f'    model: {MODEL}\n')
    for fmt in ("text", "json", "junit"):
        code, out, err = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", fmt)
        _clean(out, err)
        assert code in (0, 1), (fmt, out, err)
        if fmt == "json":
            assert any(d["name"] == "bad\x1b[2Jname\x07" for d in json.loads(out)["deployments"])


@pytest.mark.parametrize(("verb", "fmt"), [("dry-run", "junit"), ("lint", "sarif"), ("lint", "github"),
                                           ("lint", "json"), ("dry-run", "json")])
@pytest.mark.parametrize("problem", ["fleet", "rules"])
def test_a_fleet_run_that_cannot_start_still_writes_its_report_in_the_format_asked(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, verb: str, fmt: str, problem: str) -> None:
    """CI redirects `--format junit|sarif|github` into a report file: a fleet file with mistakes, or rules that
    do not load, must be a report holding the located errors, not an empty file the CI reader rejects."""
    import xml.etree.ElementTree as ET

    fleet = tmp_path / "fleet.yaml"
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "global.yaml").write_text("version: 1\nrules: 3\n")
    fleet.write_text("version: 1\ndeployments: 3\n" if problem == "fleet" else
                     f'version: 1\ndeployments:\n  - name: a\n    vllm_version: "0.34.0"\n    model: {MODEL}\n')
    code, out, err = cli(capsys, verb, "--fleet", str(fleet), "--rules", str(rules), "--format", fmt)
    assert code in (1, 2) and "error[invalid-value]" in err
    shown = "fleet.yaml" if problem == "fleet" else "global.yaml"
    if fmt == "junit":
        errors = ET.fromstring(out).findall(".//error")
        assert errors and shown in errors[0].text
    elif fmt == "github":
        assert out.startswith("::error file=") and shown in out.splitlines()[0]
    else:
        assert shown in json.dumps(json.loads(out))
