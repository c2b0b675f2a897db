"""``kvpolicy compat``'s inputs read bounded and refused where typed (issue 32): a side's JSON file is read
capped, and a ``--table`` whose flags no release takes is a located usage error, not a table of `-`."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "e2e" / "tiny-llama")


def test_a_huge_side_file_is_refused_by_its_size_unread(tmp_path: Path) -> None:
    big = tmp_path / "prefill.json"
    with open(big, "wb") as f:  # sparse: 3 GB on paper, nothing on disk; reading it whole ended in MemoryError
        f.truncate(3 * 2**30)

    def cap_memory() -> None:  # 2 GB of address space: enough to decide, not to hold the file
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    run = subprocess.run([sys.executable, "-m", "kvpolicy", "compat", str(big), "vllm-0.34"], capture_output=True,
                         text=True, timeout=120, preexec_fn=cap_memory, cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-1500:]
    assert f"{big}: error[usage]" in run.stderr and "3221225472 bytes" in run.stderr


def test_a_fifo_side_is_refused_not_waited_on(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fifo = tmp_path / "side.json"
    os.mkfifo(fifo)
    code, _, err = cli(capsys, "compat", "vllm-0.34", str(fifo))
    assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize("flags, at", [
    (["--kv-cache-dtype", "fp9"], "--kv-cache-dtype"),
    (["--attention-backend", "FLASH_ATTNN"], "--attention-backend"),
    (["--backend", "NOPE"], "--attention-backend"),
    (["--model", "/nonexistent/model"], "--model"),
])
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_table_no_release_takes_is_a_located_usage_error(capsys: pytest.CaptureFixture[str], flags: list[str],
                                                           at: str, fmt: str) -> None:
    code, out, err = cli(capsys, "compat", "--table", *flags, "--format", fmt)
    assert code == 2, out
    assert "no layout" not in out
    if fmt == "json":
        diag = json.loads(out)["error"]["diagnostics"][0]
        assert diag["file"] == at and "no release profile takes" in diag["message"]
    else:
        assert f"{at}: error[usage]: no release profile takes" in err


def test_a_table_some_releases_refuse_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    # the releases run TRITON_ATTN for the example, which takes multiples of 16: those rows are `-`, and said;
    # the issue-48412 development state takes it
    code, out, err = cli(capsys, "compat", "--table", "--block-size", "8")
    assert code == 0
    assert "note: vllm-0.34 refuses the deployment these flags describe: --block-size 8" in err
    rows = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert "no layout" in rows["vllm-0.34"] and "no layout" not in rows["issue-48412"]


def test_a_side_whose_model_is_missing_is_located_at_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "compat", "vllm-0.34", "vllm-0.28", "--model", "/nonexistent/model")
    assert code == 2 and err.startswith("--model: error[usage]")


def test_a_table_of_a_real_model_still_decides(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "compat", "--table", "--model", TINY, "--format", "json")
    assert code == 0 and all(d is not None for d in json.loads(out)["deployments"][:-1])


@pytest.mark.parametrize("argv", [
    ["0.34", "0.28", "--from", "block_size=0"],
    ["0.34", "0.28", "--to", "block_size=1e9"],
    ["0.34", "0.28", "--from", "kv_transfer_config=3"],
    ["0.34", "0.28", "--from", "spec={num_layers: 2}"],
    ["0.34", "0.28", "--table"],
    ["0.34"],
])
def test_every_compat_usage_error_says_what_to_write(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """A value a side's key refuses, a missing side, sides beside --table: located at the flag, with a help line,
    in kvpolicy's words (never pydantic's `Input should be`)."""
    code, _, err = cli(capsys, "compat", *argv)
    assert code == 2 and "error[usage]" in err and "Input should be" not in err
    assert "\n  help: " in err, err
