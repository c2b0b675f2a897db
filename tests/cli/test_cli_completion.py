"""`kvpolicy completion bash|zsh|fish`: scripts generated from the parser, driven in a real shell."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.engine.cli.main import build_parser

BASH = shutil.which("bash")


def _script(capsys: pytest.CaptureFixture[str], shell: str) -> str:
    code, out, err = cli(capsys, "completion", shell)
    assert code == 0 and err == ""
    return out


def _complete(script: str, words: list[str], cwd: Path | None = None) -> list[str]:
    """What bash offers for ``words`` (the last one being completed), through the script's `_kvpolicy`."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    driver = (f"{script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; "
              "COMP_LINE=\"${COMP_WORDS[*]}\"; _kvpolicy; printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run([BASH, "--norc", "--noprofile", "-c", driver], capture_output=True, text=True, check=True,
                         cwd=cwd, timeout=30)
    return [x for x in out.stdout.splitlines() if x]


@pytest.mark.skipif(BASH is None, reason="no bash here")
def test_the_bash_script_is_valid_and_completes_verbs_flags_and_values(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    script = _script(capsys, "bash")
    (tmp_path / "k.bash").write_text(script)
    subprocess.run([BASH, "-n", str(tmp_path / "k.bash")], check=True, timeout=30)  # syntax
    assert _complete(script, ["kvpolicy", "val"]) == ["validate"]
    assert _complete(script, ["kvpolicy", "dry-run", "--kv-cache-d"]) == ["--kv-cache-dtype"]
    assert set(_complete(script, ["kvpolicy", "test", "--r"])) == {"--rules", "--require-coverage", "--run"}
    assert _complete(script, ["kvpolicy", "dry-run", "--explain", ""]) == ["full", "fails", "notes"]
    assert _complete(script, ["kvpolicy", "rules", "--for"]) == ["--format"]  # an alias has its verb's flags
    assert "vllm-0.34" in _complete(script, ["kvpolicy", "lint", "--vllm-version", "vllm-0.3"])
    assert "fp8_per_token_head" in _complete(script, ["kvpolicy", "dry-run", "--kv-cache-dtype", "fp8"])
    (tmp_path / "my-rules").mkdir()
    (tmp_path / "my-notes.txt").write_text("")
    assert _complete(script, ["kvpolicy", "validate", "--rules", "my"], cwd=tmp_path) == ["my-rules"]  # dirs only
    assert _complete(script, ["kvpolicy", "dry-run", "--block-size", ""]) == []  # a number: nothing to offer


def test_every_verb_and_flag_of_the_parser_is_in_the_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    """Generated, not listed: a verb or flag added to the CLI is completed without touching completion.py."""
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    bash, fish = _script(capsys, "bash"), _script(capsys, "fish")
    offered = next(x for x in bash.splitlines() if "compgen -W" in x).split('"')[1].split()  # the verbs' line
    for name, verb in sub.choices.items():
        assert name in offered, name
        assert f"-a {name} " in fish, name
        for action in verb._actions:
            for flag in action.option_strings:
                assert flag in bash, (name, flag)


@pytest.mark.parametrize("shell, check", [("zsh", ["zsh", "-n"]), ("fish", ["fish", "--no-execute"])])
def test_the_zsh_and_fish_scripts_parse(capsys: pytest.CaptureFixture[str], tmp_path: Path, shell: str,
                                        check: list[str]) -> None:
    script = _script(capsys, shell)
    assert "kvpolicy" in script and "completion" in script
    if shell == "zsh" and BASH is not None:  # the bash script under bashcompinit: bash's syntax too
        (tmp_path / "k.sh").write_text(script)
        subprocess.run([BASH, "-n", str(tmp_path / "k.sh")], check=True, timeout=30)
    if shutil.which(check[0]) is None:
        pytest.skip(f"no {check[0]} here")
    (tmp_path / f"k.{shell}").write_text(script)
    subprocess.run([*check, str(tmp_path / f"k.{shell}")], check=True, timeout=30)


def test_an_unknown_shell_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "completion", "powershell")
    assert code == 2 and out == "" and "invalid choice: 'powershell'" in err
