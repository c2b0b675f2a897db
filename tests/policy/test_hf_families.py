"""Model families read as vLLM 0.28 / 0.34 read them (issue 21): kvpolicy.policy.hf_config.

Each config is the published model's shape, cut to the fields that decide its KV cache,
and each expectation is what vLLM's ModelConfig and model code build from it (transformers'
config-class defaults included). The conformance corpus proves the same against vLLM itself.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from group_shapes import G, shape

from kvpolicy.policy.errors import InputError, ModelConfigError
from kvpolicy.policy.hf_config import ModelConfigWarning, kv_groups_from_hf_config, read_hf_config
from kvpolicy.policy.quant import ModelDtype
from kvpolicy.policy.spec import AttentionKind

FULL, SLIDING, CHUNKED, MLA, MAMBA = (AttentionKind.full, AttentionKind.sliding_window, AttentionKind.chunked_local,
                                      AttentionKind.mla, AttentionKind.mamba)




def codes(config: dict[str, Any], **kwargs: Any) -> list[str]:
    return [n.code for n in read_hf_config(config, **kwargs).notes]


BAMBA_9B = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "num_hidden_layers": 32,
            "attn_layer_indices": [9, 18, 27], "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "mamba_d_state": 128, "mamba_n_heads": 128, "torch_dtype": "bfloat16"}
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 42,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584,
             "sliding_window": 4096, "torch_dtype": "float32"}
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
             "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                             "num_hidden_layers": 34, "sliding_window": 1024},
             "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
LLAMA4_SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "torch_dtype": "bfloat16",
                "text_config": {"model_type": "llama4_text", "num_hidden_layers": 48, "num_attention_heads": 40,
                                "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120,
                                "attention_chunk_size": 8192, "no_rope_layers": []}}


# --- the three models of issue 21 ----------------------------------------------------------


def test_bamba_attention_at_its_indices_mamba_elsewhere() -> None:
    # read for vLLM 0.23.0, the last release that serves it: no profile answers for it, so no refusal
    reading = read_hf_config(BAMBA_9B, vllm_version="0.23.0")
    assert shape(reading.groups) == [G(MAMBA, 29, 1, 128), G(FULL, 3, 8, 128)]
    assert [i for i, layer in enumerate(reading.layers) if layer == ("full",)] == [9, 18, 27]
    assert [n.code for n in reading.notes] == ["hybrid-block-size"]  # its attention block holds a Mamba state


def test_bamba_without_attention_indices_is_all_mamba() -> None:
    config = {**BAMBA_9B, "attn_layer_indices": None}  # BambaConfig: every layer linear attention
    assert shape(read_hf_config(config, vllm_version="0.23.0").groups) == [G(MAMBA, 32, 1, 128)]


@pytest.mark.parametrize("version", [None, "0.24.0", "0.28.0", "0.34.0", "0.34.1"])
def test_bamba_is_refused_for_the_releases_that_dropped_it(version: str | None) -> None:
    # vLLM 0.24-0.34's model registry lists BambaForCausalLM in _PREVIOUSLY_SUPPORTED_MODELS ("0.23.0"):
    # a layout for a model vLLM does not start is no answer (the profile's previously_supported_models)
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config(BAMBA_9B, vllm_version=version)
    (diag,) = exc.value.diagnostics
    assert diag.code == "removed-architecture"
    assert f"vLLM {version or '0.34.0'} does not serve `BambaForCausalLM`" in diag.message
    assert "supported until v0.23.0" in diag.message
    assert diag.help is not None and diag.help.startswith("run this model on vLLM <= 0.23.0")


@pytest.mark.parametrize("architectures", ["BambaForCausalLM", "LlamaForCausalLM", ["LlamaForCausalLM", 5]])
def test_architectures_not_a_list_of_names_is_refused(architectures: Any) -> None:
    # vLLM 0.28 and 0.34 refuse it in ModelConfig (list[str]: "Input should be a valid list"), asked of both
    # releases by the hostile pass; a string once hid a Bamba config from the removed-architecture check
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config({**BAMBA_9B, "architectures": architectures}, vllm_version="0.23.0")
    (diag,) = exc.value.diagnostics
    assert diag.code == "invalid-field" and "`architectures` must be a list of architecture names" in diag.message


def test_mllama_is_refused_as_the_registry_says() -> None:
    mllama = {"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama",
              "text_config": {"num_hidden_layers": 40, "cross_attention_layers": [3, 8, 13]}}
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config(mllama, vllm_version="0.24.0")
    (diag,) = exc.value.diagnostics
    assert diag.code == "removed-architecture" and "supported until v0.10.2" in diag.message


def test_a_removed_architecture_beside_a_served_one_is_read() -> None:
    # vLLM tries each architecture the config names: one it serves is enough
    reading = read_hf_config({**BAMBA_9B, "architectures": ["BambaForCausalLM", "GraniteMoeHybridForCausalLM"]},
                             vllm_version="0.34.0")
    assert shape(reading.groups) == [G(MAMBA, 29, 1, 128), G(FULL, 3, 8, 128)]


def test_architectures_a_later_release_dropped_are_refused_from_that_release_on() -> None:
    # StableLMEpochForCausalLM: removed from the registry in 0.29.0 ("supported until v0.28.0")
    stablelm = {"architectures": ["StableLMEpochForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
                "hidden_size": 256, "torch_dtype": "bfloat16", "model_type": "stablelm"}
    assert read_hf_config(stablelm, vllm_version="0.28.0").groups.count == 1
    with pytest.raises(ModelConfigError, match=r"vLLM 0\.29\.0 does not serve .*until v0\.28\.0"):
        read_hf_config(stablelm, vllm_version="0.29.0")


def test_gemma2_float32_is_served_in_bfloat16() -> None:
    reading = read_hf_config(GEMMA2_9B)
    assert reading.dtype is ModelDtype.bfloat16
    assert all(g.spec.dtype is ModelDtype.bfloat16 for g in reading.groups.groups)
    assert reading.groups.primary is not None and reading.groups.primary.page_size_bytes == 2 * 16 * 8 * 256 * 2
    assert [n.code for n in reading.notes] == ["dtype-downcast"]
    assert shape(reading.groups) == [G(SLIDING, 21, 8, 256, 4096), G(FULL, 21, 8, 256)]


@pytest.mark.parametrize(
    ("config", "dtype", "capability", "expected"),
    [
        pytest.param(GEMMA2_9B, "float32", None, ModelDtype.float32, id="explicit-float32-wins"),
        pytest.param(GEMMA2_9B, "bfloat16", None, ModelDtype.bfloat16, id="explicit-bfloat16"),
        # SM 7.x: no bfloat16; Gemma-2 refuses float16, so float32 is all that is left
        pytest.param(GEMMA2_9B, None, 7, ModelDtype.float32, id="gemma2-on-volta-stays-float32"),
        pytest.param({**GEMMA2_9B, "model_type": "llama"}, None, 7, ModelDtype.float16, id="llama-fp32-on-volta"),
        pytest.param({**GEMMA2_9B, "torch_dtype": "bfloat16", "model_type": "llama"}, None, 7, ModelDtype.float16,
                     id="bfloat16-falls-back-on-volta"),
        pytest.param({**GEMMA2_9B, "torch_dtype": "float16"}, None, None, ModelDtype.bfloat16,
                     id="gemma2-float16-checkpoint-served-in-bfloat16"),
        pytest.param({**GEMMA2_9B, "torch_dtype": "float16", "model_type": "llama"}, None, None, ModelDtype.float16,
                     id="float16-kept"),
        pytest.param({**GEMMA2_9B, "model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
                     None, None, ModelDtype.float16, id="pooling-prefers-float16"),
    ],
)
def test_served_dtype(config: dict[str, Any], dtype: str | None, capability: int | None,
                      expected: ModelDtype) -> None:
    assert read_hf_config(config, dtype=dtype, device_capability=capability).dtype is expected


def test_float16_for_gemma2_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config(GEMMA2_9B, dtype="float16")
    assert exc.value.diagnostics[0].code == "unsupported-dtype"


def test_no_dtype_in_the_config_is_said() -> None:
    config = {k: v for k, v in GEMMA2_9B.items() if k != "torch_dtype"}
    reading = read_hf_config(config)
    assert reading.dtype is ModelDtype.bfloat16
    assert [n.code for n in reading.notes] == ["assumed-dtype"]
    assert "safetensors" in reading.notes[0].message


def test_gemma3_text_config_takes_the_class_defaults() -> None:
    # Gemma3TextConfig: sliding_window_pattern 6, 8 heads, 4 KV heads, head_dim 256
    reading = read_hf_config(GEMMA3_4B)
    assert shape(reading.groups) == [G(SLIDING, 29, 4, 256, 1024), G(FULL, 5, 4, 256)]
    assert [i for i, layer in enumerate(reading.layers) if layer == ("full",)] == [5, 11, 17, 23, 29]
    assert reading.notes == ()


# --- hybrids ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param({"model_type": "jamba", "num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096},
                     [G(MAMBA, 28, 1, 16), G(FULL, 4, 8, 128)], id="jamba"),
        pytest.param({"model_type": "jamba", "num_hidden_layers": 16},  # JambaConfig: period 8, offset 4
                     [G(MAMBA, 14, 1, 16), G(FULL, 2, 8, 128)], id="jamba-class-defaults"),
        pytest.param({"model_type": "falcon_h1", "num_hidden_layers": 24, "num_attention_heads": 8,
                      "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 1024, "mamba_d_state": 256},
                     [G(FULL, 24, 2, 64), G(MAMBA, 24, 1, 256)], id="falcon-h1-both-in-every-layer"),
        pytest.param({"model_type": "nemotron_h", "num_hidden_layers": 8, "hybrid_override_pattern": "M-M*-ME*",
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096},
                     [G(MAMBA, 3, 1, 128), G(FULL, 2, 8, 128)], id="nemotron-h-mlp-moe-hold-nothing"),
        pytest.param({"model_type": "granitemoehybrid", "num_hidden_layers": 4, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "hidden_size": 4096,
                      "layer_types": ["mamba", "attention", "mamba", "mamba"]},
                     [G(MAMBA, 3, 1, 256), G(FULL, 1, 8, 128)], id="granite-4.0-h"),
        pytest.param({"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
                      "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048},
                     [G(MAMBA, 36, 1, 16), G(FULL, 12, 2, 256)], id="qwen3-next-interval-default-4"),
        pytest.param({"model_type": "zamba2", "num_hidden_layers": 6, "hidden_size": 2560, "num_attention_heads": 32,
                      "layers_block_type": ["mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba"]},
                     [G(MAMBA, 6, 1, 64), G(FULL, 2, 32, 160)], id="zamba2-hybrid-layers"),
        pytest.param({"model_type": "lfm2", "num_hidden_layers": 6, "full_attn_idxs": [2, 5],
                      "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 1024},
                     [G(MAMBA, 4, 1, 16), G(FULL, 2, 8, 32)], id="lfm2-short-conv"),
        pytest.param({"model_type": "mamba2", "num_hidden_layers": 4}, [G(MAMBA, 4, 1, 16)], id="mamba2-only"),
    ],
)
def test_hybrids(config: dict[str, Any], expected: list[G]) -> None:
    assert shape(read_hf_config({**config, "torch_dtype": "bfloat16"}).groups) == expected


# --- attention variants --------------------------------------------------------------------


def test_llama4_rope_layers_are_chunked_local() -> None:
    # vLLM keeps its hybrid KV cache manager on for them: VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE
    # defaults to 1 in 0.28 and 0.34 alike
    reading = read_hf_config(LLAMA4_SCOUT)
    assert shape(reading.groups) == [G(CHUNKED, 36, 8, 128), G(FULL, 12, 8, 128)]
    assert reading.layers[:4] == (("chunked_local",),) * 3 + (("full",),)  # NoPE every 4th layer
    assert reading.notes == ()


def test_llama4_without_a_chunk_size_is_full_attention() -> None:
    text = {**LLAMA4_SCOUT["text_config"], "attention_chunk_size": None, "num_hidden_layers": 4,
            "no_rope_layers": [1, 0, 1, 1]}
    reading = read_hf_config({**LLAMA4_SCOUT, "text_config": text})
    assert reading.layers == (("full",),) * 4 and reading.notes == ()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # head_dim absent: Llama derives hidden // heads; Qwen3's class defaults it to 128
        pytest.param({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32}, 128, id="llama-derived"),
        pytest.param({"model_type": "qwen3", "hidden_size": 2048, "num_attention_heads": 32}, 128,
                     id="qwen3-class-default"),
        pytest.param({"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "head_dim": 128}, 128,
                     id="head-dim-wins"),
        pytest.param({"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "head_dim": 0}, 64,
                     id="head-dim-zero-means-absent"),
        pytest.param({"model_type": "plamo", "hidden_size": 2048, "num_attention_heads": 32,
                      "hidden_size_per_head": 128}, 128, id="hidden-size-per-head"),
    ],
)
def test_head_size(fields: dict[str, Any], expected: int) -> None:
    config = {"num_hidden_layers": 2, "num_key_value_heads": 8, "torch_dtype": "bfloat16", **fields}
    primary = read_hf_config(config).groups.primary
    assert primary is not None and primary.head_size == expected


@pytest.mark.parametrize(
    ("fields", "tp", "heads"),
    [
        pytest.param({"num_key_value_heads": 8}, 16, 1, id="replicated-past-8-ranks"),
        pytest.param({"num_key_value_heads": 8}, 4, 2, id="split"),
        pytest.param({"num_key_value_heads": None, "multi_query_group_num": 2}, 2, 1, id="chatglm-alias"),
        pytest.param({"num_key_value_heads": None, "n_head_kv": 4}, 1, 4, id="falcon-alias"),
        pytest.param({"model_type": "falcon", "multi_query": True, "num_key_value_heads": None}, 1, 1,
                     id="falcon-multi-query"),
    ],
)
def test_kv_heads_per_rank(fields: dict[str, Any], tp: int, heads: int) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 32, "hidden_size": 4096,
              "torch_dtype": "bfloat16", **fields}
    primary = read_hf_config(config, tensor_parallel_size=tp).groups.primary
    assert primary is not None and primary.num_kv_heads == heads


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param({"model_type": "mistral", "sliding_window": 4096}, [G(SLIDING, 4, 8, 64, 4096)],
                     id="mistral-v0.1-every-layer"),
        pytest.param({"model_type": "mistral", "sliding_window": None}, [G(FULL, 4, 8, 64)], id="mistral-null"),
        pytest.param({"model_type": "mistral", "sliding_window": 0}, [G(FULL, 4, 8, 64)], id="window-0-is-none"),
        pytest.param({"model_type": "qwen3", "sliding_window": 4096, "head_dim": 64}, [G(FULL, 4, 8, 64)],
                     id="qwen3-use-sliding-window-defaults-false"),
        pytest.param({"model_type": "cohere2", "sliding_window": 4096, "head_dim": 64},  # 0.34 keeps window + 1
                     [G(SLIDING, 3, 8, 64, 4097), G(FULL, 1, 8, 64)], id="cohere2-class-pattern-4"),
        pytest.param({"model_type": "gpt_oss", "sliding_window": 128, "head_dim": 64,
                      "layer_types": ["full_attention"] * 4},  # gpt_oss.py slides even layers whatever these say
                     [G(SLIDING, 2, 8, 64, 128), G(FULL, 2, 8, 64)], id="gpt-oss-even-layers"),
    ],
)
def test_sliding_windows(fields: dict[str, Any], expected: list[G]) -> None:
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 512,
              "torch_dtype": "bfloat16", **fields}
    assert shape(read_hf_config(config, vllm_version="0.34.0").groups) == expected


@pytest.mark.parametrize(
    ("fields", "kind", "notes"),
    [
        pytest.param({"model_type": "qwen3", "max_window_layers": 0}, SLIDING, [], id="qwen3-all-slide"),
        pytest.param({"model_type": "qwen3", "max_window_layers": 2}, FULL, ["global-window"],
                     id="qwen3-some-slide-so-none-does"),
        pytest.param({"model_type": "qwen3", "max_window_layers": 4}, FULL, ["global-window"],
                     id="qwen3-none-slides"),
        pytest.param({"model_type": "qwen2_moe", "max_window_layers": 4}, FULL, ["global-window"],
                     id="qwen2-moe-odd-layers-so-none"),
        pytest.param({"model_type": "qwen3_moe"}, SLIDING, [], id="qwen3-moe-no-layer-types-all-slide"),
        pytest.param({"model_type": "qwen3", "use_sliding_window": False}, FULL, [], id="qwen3-unused-window"),
    ],
)
def test_qwen_global_window(fields: dict[str, Any], kind: AttentionKind, notes: list[str]) -> None:
    # vLLM's Qwen models pass no per-layer window: CacheConfig's, set only when every layer slides
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
              "hidden_size": 512, "sliding_window": 4096, "use_sliding_window": True, "torch_dtype": "bfloat16",
              **fields}
    reading = read_hf_config(config)
    assert [g.spec.kind for g in reading.groups.groups] == [kind]
    assert [n.code for n in reading.notes] == notes


def test_qwen2_with_a_partial_window_is_refused_as_vllm_refuses_it() -> None:
    config = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 512, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2,
              "torch_dtype": "bfloat16"}
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config(config)
    assert exc.value.diagnostics[0].code == "unsupported-model"
    assert "`max_window_layers`" in exc.value.diagnostics[0].message


# --- MLA ---------------------------------------------------------------------------------------


def test_mla_on_the_model_types_vllm_lists() -> None:
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
              "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    assert shape(read_hf_config(config, tensor_parallel_size=8).groups) == [G(MLA, 61, 1, 576)]


def test_deepseek_sparse_attention_indexer_is_said_not_modelled() -> None:
    config = {"model_type": "deepseek_v32", "num_hidden_layers": 61, "num_attention_heads": 128,
              "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048,
              "torch_dtype": "bfloat16"}
    reading = read_hf_config(config)
    assert shape(reading.groups) == [G(MLA, 61, 1, 576)]
    assert [n.code for n in reading.notes] == ["indexer-not-modelled"]


def test_kv_lora_rank_elsewhere_is_not_mla_and_says_so() -> None:
    # MiniCPM3: vLLM pages K/V of qk_nope_head_dim + qk_rope_head_dim per head (not hidden // heads = 64)
    config = {"model_type": "minicpm3", "num_hidden_layers": 2, "num_attention_heads": 40, "num_key_value_heads": 40,
              "hidden_size": 2560, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
              "torch_dtype": "bfloat16"}
    reading = read_hf_config(config)
    assert shape(reading.groups) == [G(FULL, 2, 40, 96)]
    assert [n.code for n in reading.notes] == ["not-mla"]


# --- what kvpolicy does not model --------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"model_type": "mllama",  # no architectures: Mllama's name is refused first (below)
                      "text_config": {"num_hidden_layers": 40, "cross_attention_layers": [3, 8, 13]}},
                     id="mllama-cross-attention"),
        pytest.param({"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1},
                     id="eagle-draft"),
        pytest.param({"architectures": ["DeepSeekMTPModel"], "model_type": "deepseek_mtp", "num_hidden_layers": 1},
                     id="mtp-draft"),
        pytest.param({"model_type": "whisper", "num_hidden_layers": 4}, id="whisper"),
        pytest.param({"model_type": "deepseek_v4", "num_hidden_layers": 2, "head_dim": 512,
                      "compress_ratios": [0, 4]}, id="deepseek-v4-compressed"),
        pytest.param({"model_type": "nemotron-nas", "num_hidden_layers": 2, "num_attention_heads": 8,
                      "hidden_size": 512, "block_configs": [{"attention": {"no_op": True}}] * 2},
                     id="nemotron-nas-block-configs"),
        pytest.param({"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "num_hidden_layers": 6,
                      "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
                      "sliding_window": 512}, id="gemma4-global-head-dim"),
        pytest.param({"model_type": "gemma4_text", "num_hidden_layers": 6, "num_attention_heads": 8,
                      "num_key_value_heads": 8, "num_global_key_value_heads": 2, "head_dim": 256},
                     id="num-global-kv-heads"),
    ],
)
def test_unmodelled_models_are_refused_by_name(config: dict[str, Any]) -> None:
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config(config)
    diag = exc.value.diagnostics[0]
    assert diag.code == "unsupported-model" and diag.help


# --- notes reach the caller --------------------------------------------------------------------


def test_kv_groups_from_hf_config_warns_with_each_note() -> None:
    with pytest.warns(ModelConfigWarning) as record:
        groups = kv_groups_from_hf_config(GEMMA2_9B)
    assert groups.count == 2
    warning = record[0].message
    assert isinstance(warning, ModelConfigWarning)
    assert warning.diagnostic.code == "dtype-downcast"
    assert str(warning).startswith("<config>: warning[dtype-downcast]: ")


def test_a_plain_config_warns_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv_groups_from_hf_config({**GEMMA2_9B, "torch_dtype": "bfloat16"})


# --- where releases differ -------------------------------------------------------------------

QWEN3_NEXT_INTERVAL_2 = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 8,
                         "full_attention_interval": 2, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("version", "full_layers"),
    [
        # 0.24-0.31 load Qwen3-Next with vLLM's own config class: every 4th layer full, whatever the interval
        pytest.param("0.28.0", [3, 7], id="0.28-ignores-the-interval"),
        pytest.param("0.31.0", [3, 7], id="0.31-ignores-the-interval"),
        pytest.param("0.32.0", [1, 3, 5, 7], id="0.32-reads-it"),
        pytest.param("0.34.0", [1, 3, 5, 7], id="0.34-reads-it"),
    ],
)
def test_qwen3_next_interval_by_release(version: str, full_layers: list[int]) -> None:
    reading = read_hf_config(QWEN3_NEXT_INTERVAL_2, vllm_version=version)
    assert [i for i, layer in enumerate(reading.layers) if layer == ("full",)] == full_layers
    assert [n.code for n in reading.notes] == ["hybrid-block-size"]  # no release-dependent note


def test_qwen3_next_interval_without_a_release_reads_the_newest_and_says_so() -> None:
    reading = read_hf_config(QWEN3_NEXT_INTERVAL_2)
    assert [i for i, layer in enumerate(reading.layers) if layer == ("full",)] == [1, 3, 5, 7]
    assert [n.code for n in reading.notes] == ["release-dependent", "hybrid-block-size"]


@pytest.mark.parametrize("version", ["latest", "0", "0.x.1", "1.2.3.4", 34])
def test_vllm_version_keyword_is_checked(version: Any) -> None:
    with pytest.raises(InputError) as exc:
        read_hf_config(QWEN3_NEXT_INTERVAL_2, vllm_version=version)
    assert exc.value.diagnostics[0].file == "vllm_version"


@pytest.mark.parametrize(("version", "window"), [("0.28.0", 4096), ("0.29.0", 4097), ("0.34.0", 4097)])
def test_cohere2_window_by_release(version: str, window: int) -> None:
    # commandr.py / cohere2_moe.py: a sliding layer sees [pos - sliding_window, pos] from 0.29 on
    config = {"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "num_hidden_layers": 4,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
              "sliding_window": 4096, "torch_dtype": "bfloat16"}
    reading = read_hf_config(config, vllm_version=version)
    assert reading.groups.groups[0].spec.sliding_window == window
    assert reading.notes == ()
    unsaid = read_hf_config(config)
    assert unsaid.groups.groups[0].spec.sliding_window == 4097
    assert [n.code for n in unsaid.notes] == ["release-dependent"]


# --- the KV cache dtype a checkpoint names ------------------------------------------------------

LLAMA_FP8_MODELOPT = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                      "torch_dtype": "bfloat16",
                      "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                              "kv_cache_quant_algo": "FP8"}}


def test_modelopt_checkpoint_names_its_kv_cache_dtype() -> None:
    # vLLM's resolve_kv_cache_dtype_string: --kv-cache-dtype auto takes the checkpoint's fp8 (e4m3)
    reading = read_hf_config(LLAMA_FP8_MODELOPT)
    assert reading.groups.primary is not None and reading.groups.primary.kv_cache_dtype == "fp8_e4m3"
    assert [n.code for n in reading.notes] == ["checkpoint-kv-cache-dtype"]
    explicit = read_hf_config(LLAMA_FP8_MODELOPT, kv_cache_dtype="fp8_per_token_head").groups.primary
    assert explicit is not None and explicit.kv_cache_dtype == "fp8_per_token_head"


@pytest.mark.parametrize(
    ("quant", "expected", "notes"),
    [
        pytest.param({"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 4, "type": "float"}}, "nvfp4",
                     ["checkpoint-kv-cache-dtype"], id="scheme-nvfp4"),
        pytest.param({"quant_method": "modelopt", "kv_cache_quant_algo": "int8"}, "auto", ["unknown-kv-cache-quant"],
                     id="unknown-algo-keeps-auto"),
        pytest.param({"quant_method": "fp8", "kv_cache_quant_algo": "FP8"}, "auto", [], id="not-modelopt"),
    ],
)
def test_checkpoint_kv_cache_forms(quant: dict[str, Any], expected: str, notes: list[str]) -> None:
    reading = read_hf_config({**LLAMA_FP8_MODELOPT, "quantization_config": quant})
    assert reading.groups.primary is not None and reading.groups.primary.kv_cache_dtype == expected
    assert [n.code for n in reading.notes] == notes


def test_disable_sliding_window_caches_every_layer_as_full() -> None:
    # vLLM's --disable-sliding-window clears hf_text_config.sliding_window: Gemma-2's sliding layers become full
    reading = read_hf_config(GEMMA2_9B, disable_sliding_window=True)
    assert shape(reading.groups) == [G(FULL, 42, 8, 256)]
    assert set(reading.layers) == {("full",)}
    with pytest.raises(InputError):
        read_hf_config(GEMMA2_9B, disable_sliding_window="yes")  # type: ignore[arg-type]
