"""`kvpolicy dry-run --model`: configs read as vLLM reads them, and what was assumed said on stderr (issue 21)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_capture import cli

NIXL_CROSS_LAYER = ("--connector", "NixlConnector", "--connector-config", '{"enable_cross_layers_blocks": "true"}')

# Gemma-3-27B's text model: a window, and no sliding_window_pattern (Gemma3TextConfig's default, 6, applies)
GEMMA3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                              "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024}}
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 42,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584,
             "sliding_window": 4096, "torch_dtype": "float32"}
BAMBA_9B = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "num_hidden_layers": 32,
            "attn_layer_indices": [9, 18, 27], "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "mamba_d_state": 128, "torch_dtype": "bfloat16"}


def model_dir(tmp_path: Path, config: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_gemma3_default_pattern_keeps_two_groups_per_layer(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    # read as all-sliding (one group), vLLM 0.28's gate let a cross-layer Nixl connector take BHLNC
    code, out, err = cli(capsys, "dry-run", "--model", model_dir(tmp_path, GEMMA3_27B), "--vllm-version", "0.28.0",
                         *NIXL_CROSS_LAYER, "--format", "json")
    data = json.loads(out)
    assert code == 0
    assert data["layout"]["placement"] == "per_layer"
    groups = data["inputs"]["groups"]["groups"]
    assert [(g["spec"]["kind"], g["spec"]["num_layers"]) for g in groups] == [("sliding_window", 52),
                                                                              ("full", 10)]
    assert "warning[" not in err


def test_gemma2_float32_is_planned_in_bfloat16_and_said(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = cli(capsys, "dry-run", "--model", model_dir(tmp_path, GEMMA2_9B), "--vllm-version", "0.28.0",
                         "--format", "json")
    kv = json.loads(out)["inputs"]["kv"]
    assert code == 0
    assert kv["dtype"] == "bfloat16"
    assert "config.json: warning[dtype-downcast]: the config's dtype is float32; vLLM's --dtype auto serves " in err


def test_bamba_is_refused_naming_the_release_and_what_to_do(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    # vLLM 0.24-0.34 do not start BambaForCausalLM (their registry: supported until v0.23.0): no decision
    code, out, err = cli(capsys, "dry-run", "--model", model_dir(tmp_path, BAMBA_9B), "--vllm-version", "0.28.0")
    assert code == 2
    assert out == ""
    assert ("config.json: error[removed-architecture]: vLLM 0.28.0 does not serve `BambaForCausalLM` "
            "(config.json `architectures`): its model registry says it was supported until v0.23.0") in err
    assert "help: run this model on vLLM <= 0.23.0" in err


CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"


def test_a_hybrid_is_decided_with_vllms_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM 0.34 raises Jamba's attention block size from its default 64 to 128 to hold a Mamba state
    code, out, err = cli(capsys, "dry-run", "--model", str(CORPUS / "jamba-v0.1"), "--vllm-version", "0.34.0",
                         "--format", "json")
    assert code == 0 and json.loads(out)["inputs"]["kv"]["block_size"] == 128
    assert "warning[hybrid-block-size]: vLLM 0.34.0 aligns the attention block size to 128" in err


def test_gemma3_groups_are_counted_as_vllm_counts_them(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # vLLM makes 7 KV cache groups of Gemma-3-27B's 52 sliding + 10 full layers: a rule's groups.count is 7
    code, out, _ = cli(capsys, "dry-run", "--model", model_dir(tmp_path, GEMMA3_27B), "--vllm-version", "0.34.0")
    assert code == 0
    assert ("  groups:    7 KV cache group(s), 7 attention group(s) (vLLM's, each kind split into groups of equal "
            "size: sliding_window 52 layers -> 6, full 10 layers -> 1)") in out



def test_a_kv_cache_dtype_no_backend_takes_is_located_at_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Not at --attention-backend, which the operator never gave; the help lists what the backends do take."""
    deepseek = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs" / "deepseek-v2-lite-chat"
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", str(deepseek),
                         "--kv-cache-dtype", "fp8_per_token_head")
    assert code == 2 and out == ""
    assert "--kv-cache-dtype: error[unsupported-kv-cache-dtype]: no mla backend" in err
    assert "take: auto, bfloat16, float16, fp8, fp8_e4m3" in err


def test_the_default_backend_note_says_what_kvpolicy_leaves_out(capsys: pytest.CaptureFixture[str]) -> None:
    """An MLA model on the assumed SM90: vLLM would put FLASH_ATTN_MLA (not modelled) before FLASHMLA."""
    deepseek = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs" / "deepseek-v2-lite-chat"
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", str(deepseek))
    assert code == 0
    assert "backend FLASHMLA, the first of vLLM's priority list for this model that kvpolicy models (vLLM's first " \
           "SM90 choice, FLASH_ATTN_MLA, is not modelled" in err


def test_json_carries_what_the_model_reading_assumed_and_vllms_group_count(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A program reading --format json sees the hybrid alignment and the hybrid manager turned off (they were on
    stderr only), and vLLM's number of KV cache groups (`groups.count`, text output only before)."""
    configs = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--format", "json",
                       "--model", str(configs / "jamba-v0.1"))
    data = json.loads(out)
    assert code == 0 and any("warning[hybrid-block-size]" in w for w in data["warnings"])
    assert data["inputs"]["groups"]["count"] == 8
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--format", "json",
                       "--model", str(configs / "gemma-3-27b-it"))
    assert code == 0 and json.loads(out)["inputs"]["groups"]["count"] == 7
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--format", "json",
                       "--model", str(configs / "gemma-3-1b-it"), "--connector", "LMCacheConnectorV1")
    assert code == 0 and any("warning[hybrid-manager-off]" in w for w in json.loads(out)["warnings"])
