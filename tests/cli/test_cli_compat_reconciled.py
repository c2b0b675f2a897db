"""`kvpolicy compat --via NixlConnector` between two tensor-parallel sizes: vLLM's NIXL reconciles the KV heads
per rank itself (its tp_ratio), so the pair exchanges, but the answer must not claim that every byte of a block
means the same on both sides: the blocks differ, and the operator is told what differs."""

from __future__ import annotations

import json
from pathlib import Path

from cli_capture import cli

LLAMA = str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "models" / "llama-3.1-8b")
TP2_TP4 = ("compat", "0.34.0", "0.34.0", "--model", LLAMA, "--from", "tensor_parallel_size=2",
           "--to", "tensor_parallel_size=4", "--via", "NixlConnector")


def test_heads_per_rank_that_differ_are_said_when_nixl_reconciles_them(capsys) -> None:
    code, out, err = cli(capsys, *TP2_TP4)
    assert code == 0, err
    assert "every byte of a block means the same" not in out
    assert "exchange: as is through NixlConnector, which reconciles what differs itself (not byte for byte)" in out
    assert "    num_kv_heads: source 4, target 2" in out.splitlines()


def test_the_json_answer_gives_the_reason_and_the_cells_that_differ(capsys) -> None:
    code, out, _ = cli(capsys, *TP2_TP4, "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["exchange"] == "as_is"
    assert "reconciles" in report["reason"]
    assert "num_kv_heads: source 4, target 2" in report["cell_differences"]


def test_identical_blocks_through_nixl_still_say_every_byte_means_the_same(capsys) -> None:
    code, out, err = cli(capsys, "compat", "0.34.0", "0.34.0", "--model", LLAMA, "--tensor-parallel-size", "2",
                         "--via", "NixlConnector")
    assert code == 0, err
    assert "exchange: as is: every byte of a block means the same on both sides" in out
