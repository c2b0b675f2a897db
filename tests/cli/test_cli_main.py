"""The real entry point (subprocess): exit codes, --version, help on every verb, no torch import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from kvpolicy.engine.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
VERBS = ("dry-run", "validate", "test", "schema", "lint", "diff", "releases", "compat", "inspect", "fmt", "doctor",
         "completion")
ALIASES = ("rules",)  # `kvpolicy rules` is `kvpolicy inspect`


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpolicy.engine.cli.main", *argv], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)


def test_entry_point_is_declared() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvpolicy"] == "kvpolicy.engine.cli.main:main"


def test_dry_run_subprocess_and_no_torch() -> None:
    code = ("import sys\nfrom engine.cli.main import main\nrc = main(['dry-run', '--num-blocks', '16'])\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "NO-TORCH 0"
    assert out.stderr == ""


def test_no_verb_imports_torch() -> None:
    code = ("import sys, contextlib, io\nfrom engine.cli.main import main\n"
            "argvs = [['dry-run', '--format', 'json', '--num-blocks', '4'], ['validate'], ['test'], ['schema'],"
            " ['schema', '--cases'], ['--version'], ['lint'], ['diff', 'rules/issue-48412', 'rules/issue-48412']]\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    codes = [main(a) for a in argvs]\n"
            "print(codes, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "[0, 0, 0, 0, 0, 0, 0, 0] False", out.stdout + out.stderr


def test_python_m_entry_point() -> None:
    out = run("dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("built-in example: ")
    assert "layout: LBNHC" in out.stdout
    assert out.stderr == ""  # no runpy double-import warning, no traceback


def test_no_layout_via_subprocess(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "rules" / "issue-48412", tmp_path / "r", ignore=shutil.ignore_patterns("tests"))
    glob = tmp_path / "r" / "global.yaml"
    conflict = "\n  - id: conflict\n    description: d\n    require: {placement: cross_layer}\n"
    glob.write_text(glob.read_text() + conflict)
    out = run("dry-run", "--rules", str(tmp_path / "r"))
    assert out.returncode == 1
    assert "error[removed-candidates]: rule `conflict` (require, global) removed `LBNHC`" in out.stderr
    assert "Traceback" not in out.stderr


def test_usage_error_via_subprocess() -> None:
    out = run("dry-run", "--connector-config", "{not json")
    assert out.returncode == 2
    assert "kvpolicy dry-run: error: argument --connector-config: invalid JSON" in out.stderr
    assert "Traceback" not in out.stderr


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("kvpolicy 0.")


def test_no_verb_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvpolicy")
    for verb in VERBS:
        assert verb in err


def test_unknown_verb_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decide"]) == 2
    assert "invalid choice: 'decide'" in capsys.readouterr().err


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help_with_an_example(capsys: pytest.CaptureFixture[str], verb: str) -> None:
    assert main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvpolicy {verb}")
    assert "examples:\n  kvpolicy " + verb in out


def test_every_verb_is_registered() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "verb")
    assert set(sub.choices) == {*VERBS, *ALIASES}


def test_output_is_plain_text_without_color() -> None:
    out = run("dry-run", env={**os.environ, "NO_COLOR": "1"})
    assert "\x1b[" not in out.stdout
    assert "\x1b[" not in run("dry-run").stdout


def test_console_script() -> None:
    # the script `pip install` put beside this interpreter's (not whatever `kvpolicy` PATH finds first)
    script = Path(sysconfig.get_path("scripts")) / "kvpolicy"
    assert script.is_file(), f"{script} missing: install the project (pip install -e .) into this interpreter"
    out = subprocess.run([str(script), "validate"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("ok: ")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [("dry-run",), ("validate", "rules/issue-48412"), ("lint", "--format", "json"),
                                  ("--version",), ("--help",), ("validate", "--help")])
def test_output_that_cannot_be_written_is_one_error_not_a_traceback(argv: tuple[str, ...]) -> None:
    """`kvpolicy ... > /dev/full`: the disk is full, not the user's input unreadable (exit 2)."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "kvpolicy.engine.cli.main", *argv], stdout=full,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == "kvpolicy: error[write-failed]: cannot write the output: No space left on device\n"


def _cli(argv: tuple[str, ...], **streams: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpolicy.engine.cli.main", *argv], text=True, cwd=ROOT,
                          timeout=120, **streams)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_an_svg_the_disk_cannot_hold_is_write_failed_and_a_bad_path_a_usage_error(tmp_path: Path) -> None:
    proc = _cli(("dry-run", "--svg", "/dev/full"), capture_output=True)
    assert proc.returncode == 1 and "--svg: error[write-failed]: cannot write `/dev/full`" in proc.stderr
    proc = _cli(("dry-run", "--svg", str(tmp_path / "no" / "map.svg")), capture_output=True)
    assert proc.returncode == 2 and "--svg: error[usage]: cannot write" in proc.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv, code", [(("validate", "/nonexistent"), 2), (("dry-run", "--format", "json"), 0),
                                        (("--bogus",), 2), (("validate", "rules/issue-48412"), 0)])
def test_a_full_stderr_does_not_change_the_exit_code(argv: tuple[str, ...], code: int) -> None:
    """Messages that cannot be shown are dropped; the exit code still says what happened."""
    with open("/dev/full", "w") as full:
        proc = _cli(argv, stdout=subprocess.DEVNULL, stderr=full)
    assert proc.returncode == code


@pytest.mark.parametrize("argv", [("schema",), ("--help",), ("dry-run", "--format", "json")])
def test_a_closed_stdout_is_not_a_traceback(argv: tuple[str, ...]) -> None:
    """`kvpolicy schema >&-`: Python gives the program no stdout at all."""
    proc = subprocess.run(f"{sys.executable} -m kvpolicy.engine.cli.main {' '.join(argv)} >&-", shell=True,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr and proc.returncode == 0, proc.stderr
