"""`kvpolicy fmt`: --check (exit 1 with a diff), --write, stdin, located errors."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from cli_capture import cli
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
UNFORMATTED = """\
rules:
  - forbid:
      placement: cross_layer   # never
    id: site-rule
    description: x
version: 1
"""
FORMATTED = """\
version: 1
rules:
  - id: site-rule
    description: x
    forbid: {placement: cross_layer}  # never
"""


def test_check_fails_with_a_diff_and_write_fixes_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(UNFORMATTED)
    code, out, err = cli(capsys, "fmt", "--check", str(tmp_path))
    assert code == 1 and f"--- {tmp_path}/global.yaml (as written)" in out and "+version: 1" in out
    assert "1 file(s) would be reformatted" in err
    assert (tmp_path / "global.yaml").read_text() == UNFORMATTED  # --check writes nothing
    code, _, err = cli(capsys, "fmt", "--write", str(tmp_path))
    assert code == 0 and f"formatted: {tmp_path}/global.yaml" in err
    assert (tmp_path / "global.yaml").read_text() == FORMATTED
    assert cli(capsys, "fmt", "--check", str(tmp_path)) == (0, "", "")


def test_the_shipped_rules_pass_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [str(d) for d in sorted((ROOT / "rules").iterdir()) if d.is_dir()]
    assert cli(capsys, "fmt", "--check", *dirs)[0] == 0


def test_one_file_or_stdin_prints_the_canonical_form(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(UNFORMATTED))
    assert cli(capsys, "fmt", "-") == (0, FORMATTED, "")


def test_errors_are_located_and_usage_is_checked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("version: 1\nrules: [\n")
    (tmp_path / "good.yaml").write_text(FORMATTED)
    code, _, err = cli(capsys, "fmt", "--check", str(tmp_path / "bad.yaml"), str(tmp_path / "good.yaml"))
    assert code == 1 and f"{tmp_path}/bad.yaml:3:1: error[yaml-syntax]" in err
    code, _, err = cli(capsys, "fmt", str(tmp_path / "bad.yaml"), str(tmp_path / "good.yaml"))
    assert code == 2 and "pass one file, or --check, --diff or --write" in err
    code, _, err = cli(capsys, "fmt", "--write", "-")
    assert code == 2 and "stdin cannot be rewritten" in err


def test_a_write_that_fails_leaves_the_rule_file_whole(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # `fmt --write` on a full disk: the file the plugin loads is the old one, not a truncated one
    import errno

    from kvpolicy.policy import files

    target = tmp_path / "rules.yaml"
    target.write_text(UNFORMATTED)

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    code, _, err = cli(capsys, "fmt", "--write", str(target))
    assert code != 0 and "No space left" in err
    assert target.read_text() == UNFORMATTED


class _EndlessStdin:
    """A stdin that never ends (`yes | kvpolicy fmt -`): reading it whole is a MemoryError, here at once."""

    class _Bytes:
        def read(self, n: int = -1) -> bytes:
            if n is None or n < 0:
                raise MemoryError("read an endless stdin whole")
            return b"a: b\n" * (n // 5 + 1)

    buffer = _Bytes()

    def read(self, n: int = -1) -> str:
        return self.buffer.read(n).decode()


@pytest.mark.parametrize("verb", ["fmt", "validate"])
def test_an_endless_stdin_is_refused_at_the_file_limit(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch, verb: str) -> None:
    monkeypatch.setattr("sys.stdin", _EndlessStdin())
    code, out, err = cli(capsys, verb, "-", *(["--no-shipped-rules"] if verb == "validate" else []))
    assert code == 1 and out == ""
    assert "<stdin>: error[too-large]: stdin is over the 1000000-byte limit" in err and "help:" in err


def test_files_the_loader_refuses_are_refused_located_and_left_alone(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    (tmp_path / "latin1.yaml").write_bytes(b"version: 1\nrules: []\n# caf\xe9\n")
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbfrules: []\nversion: 1\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, err = cli(capsys, "fmt", "--write", str(tmp_path))
    assert code == 1 and out == ""
    assert f"{tmp_path}/latin1.yaml:3:6: error[encoding]: invalid UTF-8 byte 0xe9" in err
    assert f"{tmp_path}/bom.yaml:1:1: error[bom]" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


COMMA = """\
version: 1
rules:
  - id: site-rule
    when:
      field: connector.name
      in:
        - x,y
        - z
    forbid: {placement: cross_layer}
"""


def test_a_block_list_item_with_a_comma_stays_one_item(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(COMMA)
    assert cli(capsys, "fmt", "--write", str(tmp_path))[0] == 0
    assert "when: {field: connector.name, in: ['x,y', z]}" in (tmp_path / "global.yaml").read_text()


def test_a_file_whose_meaning_fmt_would_change_is_never_written_printed_or_diffed(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpolicy.policy import fmt

    monkeypatch.setattr(fmt, "_one_line", lambda value, flow: "x, y")  # an emitter with a bug
    target = tmp_path / "global.yaml"
    target.write_text(COMMA)
    for mode in ([], ["--check"], ["--diff"], ["--write"]):
        code, out, err = cli(capsys, "fmt", *mode, str(target))
        assert code == 1 and out == "", mode
        assert f"{target}:7:11: error[fmt-changes-meaning]: formatting would change `rules[0].when.in[0]`" in err
        assert target.read_text() == COMMA


def test_format_json_reports_each_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json

    (tmp_path / "a.yaml").write_text(UNFORMATTED)
    (tmp_path / "b.yaml").write_text(FORMATTED)
    (tmp_path / "c.yaml").write_text("version: 1\nrules: [\n")
    code, out, err = cli(capsys, "fmt", "--check", "--format", "json", str(tmp_path))
    doc = json.loads(out)
    assert code == 1 and next(iter(doc)) == "format_version"
    assert (doc["ok"], doc["mode"], doc["changed"], doc["failed"]) == (False, "check", 1, 1)
    a, b, c = doc["files"]
    assert (a["file"], a["ok"], a["changed"], a["written"]) == (f"{tmp_path}/a.yaml", True, True, False)
    assert a["diff"].startswith(f"--- {tmp_path}/a.yaml (as written)") and a["diagnostics"] == []
    assert (b["changed"], "diff" in b) == (False, False)
    assert c["ok"] is False and c["diagnostics"][0]["code"] == "yaml-syntax" and c["diagnostics"][0]["line"] == 3
    assert "error[yaml-syntax]" in err  # the errors on stderr too
    code, out, _ = cli(capsys, "fmt", "--write", "--format", "json", str(tmp_path / "a.yaml"))
    assert code == 0 and json.loads(out)["files"][0]["written"] is True
    code, out, _ = cli(capsys, "fmt", "--format", "json", str(tmp_path / "a.yaml"))
    assert code == 0 and json.loads(out)["files"][0] == {"file": f"{tmp_path}/a.yaml", "ok": True, "changed": False,
                                                         "written": False, "diagnostics": [], "formatted": FORMATTED}


def test_a_fifo_or_device_named_to_fmt_is_said_to_be_one_not_missing(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    """A FIFO named as a rule file exists: "no such file" would send the operator looking for a typo."""
    import os

    fifo = tmp_path / "rules.yaml"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null"):
        code, out, err = cli(capsys, "fmt", "--write", path)
        assert code == 1 and out == "" and f"{path}: error[not-a-file]" in err and "no such file" not in err


def test_a_dangling_link_in_a_rule_directory_is_an_error_with_a_help_line(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(FORMATTED)
    (tmp_path / "old.yaml").symlink_to(tmp_path / "moved-away.yaml")
    code, _, err = cli(capsys, "fmt", "--check", str(tmp_path))
    assert code == 1 and "old.yaml: error[unreadable]" in err
    assert "  help: " in err.split("old.yaml: error[unreadable]", 1)[1]


def test_the_formatted_text_on_stdout_is_the_file_not_an_escaped_display_of_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvpolicy fmt a.yaml > b.yaml` and an editor's `fmt -` read the text back: a bidi mark YAML allows raw
    (U+202E, U+200F, U+2066) written as `\\u202e` would be another description, the comment another comment."""
    import yaml

    text = ("version: 1\nrules:\n  - forbid:   {placement: cross_layer}\n    id: r\n"
            "    description: a\u202eb\u200fc\u2066d  # note \u202e here\n")
    (tmp_path / "g.yaml").write_text(text, encoding="utf-8")
    code, out, _ = cli(capsys, "fmt", str(tmp_path / "g.yaml"))
    assert code == 0 and yaml.safe_load(out) == yaml.safe_load(text) and "# note \u202e here" in out
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    code, out, _ = cli(capsys, "fmt", "-")
    assert code == 0 and yaml.safe_load(out)["rules"][0]["description"] == "a\u202eb\u200fc\u2066d"


def _patched(a: list[str], diff: str) -> list[str]:
    """``a`` with the unified ``diff`` applied (hunks in order, context checked)."""
    import re

    out: list[str] = []
    at = 0
    lines = diff.splitlines(keepends=True)[2:]
    k = 0
    while k < len(lines):
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", lines[k])
        assert m, lines[k]
        start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
        out += a[at:start]
        at = start
        k += 1
        while k < len(lines) and not lines[k].startswith("@@"):
            kind, line = lines[k][0], lines[k][1:]
            if kind in " -":
                assert a[at] == line
                at += 1
            if kind in " +":
                out.append(line)
            k += 1
    return out + a[at:]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a\n", "b\n", "c\n", "- id: r\n", "\n"]), max_size=60),
       st.lists(st.sampled_from(["a\n", "b\n", "c\n", "d\n", "- id: r\n", "\n"]), max_size=60))
def test_the_anchored_diff_turns_the_old_text_into_the_new(a: list[str], b: list[str]) -> None:
    from kvpolicy.engine.cli import formatting

    with pytest.MonkeyPatch.context() as m:
        m.setattr(formatting, "_ANCHORED_FROM", 0)  # anchored at every size
        diff = formatting.unified_diff(a, b, "old", "new")
    assert (diff == "") == (a == b)
    assert _patched(a, diff) == b


def test_check_of_a_large_rule_file_takes_seconds_not_minutes(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule file near the 1 MB limit: difflib's matcher, quadratic over its repeated lines, took half a
    minute to print `--check`'s diff; anchored on its unique lines, well under a second. Held as the work
    the matcher is given (the product of the lengths it pairs), not as a time that a busy machine breaks."""
    import difflib

    rules = "".join(f"  # rule {i}\n  - forbid:   {{placement: cross_layer}}   # why {i}\n    id: r{i}\n"
                    f"    when:\n      all:\n        - field: kv.num_layers\n          gt: {i}\n"
                    f"        - {{field: connector.name, in: [a, b]}}\n    description: >-\n      text {i}\n"
                    "      more\n\n" for i in range(3500))
    (tmp_path / "global.yaml").write_text("version: 1\nrules:\n" + rules)
    paired: list[int] = []
    matcher = difflib.SequenceMatcher

    def counted(isjunk: object = None, a: list[str] = (), b: list[str] = (), autojunk: bool = True) -> object:
        paired.append(len(a) * len(b))
        return matcher(isjunk, a, b, autojunk)

    monkeypatch.setattr(difflib, "SequenceMatcher", counted)
    code, out, _ = cli(capsys, "fmt", "--check", str(tmp_path / "global.yaml"))
    assert code == 1 and out.startswith(f"--- {tmp_path}/global.yaml (as written)")
    lines = rules.count("\n")
    assert paired and sum(paired) < 50 * lines, (sum(paired), lines)  # whole-file difflib: about lines ** 2
