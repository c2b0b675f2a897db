"""`kvpolicy fmt`: --check (exit 1 with a diff), --write, stdin, located errors."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from cli_capture import cli

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
