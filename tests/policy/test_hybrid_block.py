"""A hybrid attention + Mamba model's block size, raised as vLLM raises it (`kvpolicy.policy.hybrid_block`).

vLLM's own figures for the corpus (every hybrid config, 0.34 and 0.28, default and explicit block size)
are held in tests/conformance/test_model_configs.py; these tests pin the arithmetic and what an operator
reads, without a release installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.policy.errors import ModelConfigError
from kvpolicy.policy.hf_config import read_hf_config
from kvpolicy.policy.hybrid_block import align_hybrid_block
from kvpolicy.policy.spec import AttentionKind

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
JAMBA = CORPUS / "jamba-v0.1"


@pytest.mark.parametrize(
    ("block_size", "mla", "expected"),
    [
        pytest.param(64, False, 128, id="vllm-0.34-default-64"),
        pytest.param(16, False, 80, id="explicit-16"),
        pytest.param(8, False, 80, id="below-the-kernel-block"),  # the kernel block (16) is the unit
        pytest.param(256, False, 256, id="already-holds-a-state"),  # never lowered
        pytest.param(16, True, 128, id="mla-floor-128"),
    ],
)
def test_alignment_arithmetic(block_size: int, mla: bool, expected: int) -> None:
    # Jamba-v0.1 on one rank: 4096 B of attention page a token, a Mamba-1 state of 311296 B
    aligned = align_hybrid_block(block_size, 4096, 311296, mla=mla)
    assert aligned.block_size == expected
    assert aligned.page_size_bytes == expected * 4096 >= 311296


@pytest.mark.parametrize(("version", "block_size", "expected"), [("0.34.0", 64, 128), ("0.34.0", 16, 80),
                                                                 ("0.28.0", 16, 80)])
def test_jamba_block_size_and_pages_are_vllms(version: str, block_size: int, expected: int) -> None:
    reading = read_hf_config(JAMBA, block_size=block_size, vllm_version=version)
    mamba, full = reading.groups.groups
    assert (mamba.spec.kind, full.spec.kind) == (AttentionKind.mamba, AttentionKind.full)
    assert full.spec.block_size == mamba.spec.block_size == expected
    assert full.spec.page_size_bytes == mamba.spec.page_size_bytes == expected * 4096  # Mamba padded to it
    note = next(n for n in reading.notes if n.code == "hybrid-block-size")
    assert note.message.startswith(f"vLLM {version} aligns the attention block size to {expected} for the Mamba "
                                   "state page: one mamba1 state is 311296 B")
    assert f"the block size asked for was {block_size}" in note.message


def test_a_block_size_that_holds_a_state_is_kept_without_a_note() -> None:
    reading = read_hf_config(JAMBA, block_size=128, vllm_version="0.34.0")
    assert {g.spec.block_size for g in reading.groups.groups} == {128}
    assert [n.code for n in reading.notes if n.code.startswith("hybrid")] == []


def test_nemotron_h_keeps_its_recurrent_state_in_float32() -> None:
    # NemotronH's vLLM config hook: --mamba-ssm-cache-dtype auto is the config's, else float32
    reading = read_hf_config(CORPUS / "nvidia-nemotron-nano-9b-v2", block_size=16, vllm_version="0.34.0")
    assert {g.spec.block_size for g in reading.groups.groups} == {1312}  # vLLM 0.34 and 0.28 alike
    bf16 = json.loads((CORPUS / "nvidia-nemotron-nano-9b-v2" / "config.json").read_text())
    halved = read_hf_config({**bf16, "mamba_ssm_cache_dtype": "bfloat16"}, block_size=16, vllm_version="0.34.0")
    assert {g.spec.block_size for g in halved.groups.groups} == {672}


def test_a_hybrid_kvpolicy_cannot_size_says_so() -> None:
    lfm2 = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "num_hidden_layers": 4, "hidden_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
            "layer_types": ["conv", "full_attention", "conv", "full_attention"]}
    reading = read_hf_config(lfm2, block_size=16, vllm_version="0.34.0")
    assert {g.spec.block_size for g in reading.groups.groups} == {16}
    assert [n.code for n in reading.notes] == ["hybrid-block-not-aligned"]
    assert "does not size the state of `lfm2`" in reading.notes[0].message


def test_a_state_no_block_size_kvpolicy_takes_could_hold_is_a_located_error() -> None:
    config = {**json.loads((JAMBA / "config.json").read_text()), "mamba_d_state": 4096}
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config(config, block_size=16, vllm_version="0.34.0")
    d = exc.value.diagnostics[0]
    assert d.file == "<config>" and "would raise the attention block size to 16400 tokens" in d.message




@pytest.mark.parametrize(("version", "expected"), [("0.28.0", 408), ("0.31.0", 408), ("0.32.0", 416), ("0.34.0", 416)])
def test_from_032_a_raised_block_size_is_rounded_to_the_kernel_block(version: str, expected: int) -> None:
    # Granite-4.0-H at --block-size 24: 394 tokens hold a state, 17 x 24 = 408; 0.32 on round it to 26 x 16
    reading = read_hf_config(CORPUS / "granite-4.0-h-tiny", block_size=24, vllm_version=version)
    assert {g.spec.block_size for g in reading.groups.groups} == {expected}
