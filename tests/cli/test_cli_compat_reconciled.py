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


def test_a_fleet_exchange_across_tp_sizes_says_what_nixl_reconciles(capsys, tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(f"""version: 1
defaults: {{vllm_version: "0.34.0", model: {LLAMA}, connector: NixlConnector}}
deployments:
  - {{name: prefill-tp2, tensor_parallel_size: 2}}
  - {{name: decode-tp4, tensor_parallel_size: 4}}
  - {{name: decode-tp2, tensor_parallel_size: 2}}
exchanges:
  - {{name: pd, deployments: [prefill-tp2, decode-tp4, decode-tp2]}}
""")
    code, out, err = cli(capsys, "dry-run", "--fleet", str(tmp_path / "fleet.yaml"))
    assert code == 0, err
    lines = [line.strip() for line in out.splitlines()]
    assert "prefill-tp2 -> decode-tp2: as is" in lines
    tp = next(line for line in lines if line.startswith("prefill-tp2 -> decode-tp4: "))
    assert tp.startswith("prefill-tp2 -> decode-tp4: as is (NixlConnector reconciles what differs itself")
    assert "num_kv_heads: prefill-tp2 4, decode-tp4 2" in tp
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(tmp_path / "fleet.yaml"), "--format", "json")
    pair = next(e for e in json.loads(out)["exchanges"] if (e["writer"], e["reader"]) == ("prefill-tp2", "decode-tp4"))
    assert pair["answer"] == "as_is" and pair["fields"] == ["num_kv_heads"] and "reconciles" in pair["reason"]
