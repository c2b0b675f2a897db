"""`kvpolicy dry-run --format json`: the release (`vllm_version`, `profile`), `layout.name` and the
`allocation` object (the bytes as vLLM allocates them), per docs/json-output.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.engine.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def dry_run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["dry-run", "--format", "json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_release_and_layout_name_on_vllm_0_34(capsys: pytest.CaptureFixture[str]) -> None:
    data = dry_run_json(capsys, "--vllm-version", "0.34.0")
    assert data["vllm_version"] == "0.34.0"
    assert data["profile"] == data["inputs"]["profile"] == "vllm-0.34"
    layout = data["layout"]
    assert set(layout) == {"name", "placement", "head_order"}
    assert layout["name"] in {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert layout["placement"] == ("cross_layer" if layout["name"].startswith("B") else "per_layer")
    assert data["ranking"][0]["layout"] == layout["name"]


def test_a_development_state_has_no_vllm_version(capsys: pytest.CaptureFixture[str]) -> None:
    data = dry_run_json(capsys, "--vllm-version", "issue-48412")
    assert data["vllm_version"] is None
    assert data["profile"] == "issue-48412"
    alloc = data["allocation"]
    assert alloc["kv_split"] is None  # a separate K/V dim: the planner's own dims, in bytes
    assert "kv" in alloc["buffers"][0]["dims"]


def test_allocation_of_the_example_is_vllms_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2.5-0.5B, fp8_per_token_head, 16-token blocks, 7 blocks, LBNHC forced by VLLM_KV_CACHE_LAYOUT."""
    data = dry_run_json(capsys, "--vllm-version", "0.34.0", "--block-size", "16", "--num-blocks", "7",
                        "--vllm-kv-cache-layout", "LBNHC")
    assert data["layout"]["name"] == "LBNHC"
    alloc = data["allocation"]
    page = 2 * 16 * 2 * 68
    assert (alloc["num_blocks"], alloc["page_size_bytes"], alloc["total_bytes"]) == (7, page, 7 * 24 * page)
    assert alloc["kv_split"] == "content"
    assert alloc["cell"] == {"bytes": 68, "k": 0, "v": 68, "k_scale": 64, "v_scale": 132}
    (buf,) = alloc["buffers"]
    assert buf == {"buffer": 0, "role": "buffer", "dims": ["layer", "block", "token", "head", "content"],
                   "shape": [24, 7, 16, 2, 136], "byte_strides": [7 * page, page, 272, 136, 1], "byte_offset": 0,
                   "dtype": "uint8", "nbytes": 7 * 24 * page}
    assert len(alloc["layers"]) == 24
    for i, layer in enumerate(alloc["layers"]):
        assert layer == {"layer": i, "buffer": 0, "role": "kv_cache", "dims": ["block", "head", "token", "content"],
                         "shape": [7, 2, 16, 136], "byte_strides": [page, 136, 272, 1], "byte_offset": i * 7 * page,
                         "dtype": "uint8"}
    # the plan (--num-blocks) and the allocation describe the same bytes
    assert data["plan"]["total_bytes"] == alloc["total_bytes"]
    assert data["plan"]["page_size_bytes"] == alloc["page_size_bytes"]


def test_cross_layer_allocation_and_the_verifiers_block_count(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 3\nblock_size: 16\nnum_kv_heads: 4\nhead_size: 128\ndtype: float16\n")
    data = dry_run_json(capsys, "--vllm-version", "0.34.0", "--spec", str(spec), "--kv-cache-dtype", "auto",
                        "--attention-backend", "FLASH_ATTN", "--connector", "none", "--vllm-kv-cache-layout", "BHLNC")
    assert data["layout"] == {"placement": "cross_layer", "head_order": "HND", "name": "BHLNC"}
    alloc = data["allocation"]
    assert "plan" not in data
    assert alloc["num_blocks"] == 3 + 1  # no --num-blocks: the blocks the verifier checks
    page = 2 * 16 * 4 * 128 * 2
    (buf,) = alloc["buffers"]
    assert buf["dims"] == ["block", "head", "layer", "token", "content"]
    assert buf["byte_strides"] == [3 * page, 3 * page // 4, page // 4, 512, 2]
    assert [x["byte_offset"] for x in alloc["layers"]] == [0, page // 4, 2 * page // 4]
    assert alloc["layers"][0]["byte_strides"] == [3 * page, 3 * page // 4, 512, 2]
    assert alloc["layers"][0]["dtype"] == "float16"
    assert alloc["cell"] == {"bytes": 256, "k": 0, "v": 256, "k_scale": None, "v_scale": None}


def test_cpu_attn_allocation_says_where_v_starts(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 2\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n")
    data = dry_run_json(capsys, "--vllm-version", "0.34.0", "--spec", str(spec), "--kv-cache-dtype", "auto",
                        "--attention-backend", "CPU_ATTN", "--connector", "none")
    alloc = data["allocation"]
    assert data["layout"]["name"] == "LBHNC"
    assert alloc["kv_split"] == "token_rows"
    assert alloc["cell"] == {"bytes": 128, "k": 0, "v": 16 * 128, "k_scale": None, "v_scale": None}
    assert alloc["layers"][0]["byte_strides"] == [2 * 16 * 256, 16 * 256, 256, 2]


def test_mla_allocation_has_one_latent(capsys: pytest.CaptureFixture[str]) -> None:
    data = dry_run_json(capsys, "--vllm-version", "0.34.0", "--model",
                        str(ROOT / "tests" / "fixtures" / "configs" / "deepseek-v2-lite.json"),
                        "--attention-backend", "TRITON_MLA", "--connector", "none", "--num-blocks", "5")
    alloc = data["allocation"]
    assert alloc["cell"]["v"] is None and alloc["cell"]["k"] == 0
    layer = alloc["layers"][0]
    assert layer["shape"][:3] == [5, 1, 64]  # [B, H=1, N, C]: the default 64-token blocks
    assert layer["shape"][3] * 2 == alloc["cell"]["bytes"] == 576 * 2


def test_every_allocation_key_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    doc = (ROOT / "docs" / "json-output.md").read_text()
    data = dry_run_json(capsys, "--vllm-version", "0.34.0")
    alloc = data["allocation"]
    keys = {"vllm_version", "profile", "allocation"} | set(alloc) | set(alloc["cell"])
    keys |= set(alloc["buffers"][0]) | set(alloc["layers"][0])
    assert sorted(k for k in keys if f"`{k}`" not in doc) == []



def test_a_number_of_blocks_beyond_64_bit_sizes_is_a_located_usage_error(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path) -> None:
    """No plan of 10**30 blocks (bytes no torch size holds, integers JSON readers round): the flag is
    named, with the most blocks that fit; that many still plan."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 24\nnum_kv_heads: 2\nhead_size: 64\nblock_size: 16\n")
    argv = ["--vllm-version", "0.30.0", "--spec", str(spec), "--attention-backend", "FLASH_ATTN"]
    code = main(["dry-run", "--format", "json", *argv, "--num-blocks", str(10**30)])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("--num-blocks: error[usage]: ") and "64-bit" in err
    assert json.loads(out)["ok"] is False
    most = (2**63 - 1) // (24 * 8192)  # 24 layers x 8192 B per block
    assert f"(at most {most} here)" in err
    data = dry_run_json(capsys, *argv, "--num-blocks", str(most))
    assert data["allocation"]["total_bytes"] <= 2**63 - 1
