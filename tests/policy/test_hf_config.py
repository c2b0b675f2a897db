"""Tests for kvpolicy.policy.hf_config: Hugging Face config.json -> KVCacheGroups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from group_shapes import G, shape
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpolicy.policy.hf_config
from kvpolicy.policy.errors import Diagnostic, InputError, ModelConfigError
from kvpolicy.policy.hf_config import kv_groups_from_hf_config, read_hf_config
from kvpolicy.policy.quant import KV_CACHE_DTYPES, ModelDtype
from kvpolicy.policy.spec import AttentionKind

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
FULL, SLIDING, MLA, MAMBA = (AttentionKind.full, AttentionKind.sliding_window, AttentionKind.mla,
                             AttentionKind.mamba)
DROP = object()  # make_config(field=DROP) removes the field


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def make_config(**fields: Any) -> dict[str, Any]:
    """A small Llama-like config; keyword fields override, DROP removes."""
    config: dict[str, Any] = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "torch_dtype": "bfloat16",
    }
    for key, value in fields.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    return config


# --- published configs -------------------------------------------------------------------------

FIXTURE_CASES = [
    pytest.param("llama-3.1-8b", [G(FULL, 32, 8, 128)], id="llama-3.1-8b"),
    pytest.param("qwen2.5-0.5b", [G(FULL, 24, 2, 64)], id="qwen2.5-0.5b-use-sliding-window-false"),
    pytest.param("mistral-7b-v0.1", [G(SLIDING, 32, 8, 128, 4096)], id="mistral-7b-v0.1-every-layer-slides"),
    pytest.param("deepseek-v2-lite", [G(MLA, 27, 1, 576)], id="deepseek-v2-lite-mla"),
    pytest.param("gpt-oss-20b", [G(SLIDING, 12, 8, 64, 128), G(FULL, 12, 8, 64)], id="gpt-oss-20b-layer-types"),
    pytest.param("jamba-v0.1", [G(MAMBA, 28, 1, 16), G(FULL, 4, 8, 128)], id="jamba-v0.1-hybrid"),
]


HYBRID_BLOCK_SIZES = {"jamba-v0.1": 80}


@pytest.mark.parametrize(("name", "expected"), FIXTURE_CASES)
def test_fixture_groups(name: str, expected: list[G]) -> None:
    groups = kv_groups_from_hf_config(FIXTURES / f"{name}.json")
    assert shape(groups) == expected
    assert all(g.num_attention_groups == 1 for g in groups.groups)
    assert all(g.spec.dtype is ModelDtype.bfloat16 for g in groups.groups)
    # vLLM raises a hybrid model's attention block size until a page holds a Mamba state (test_hybrid_block.py)
    assert all(g.spec.block_size == HYBRID_BLOCK_SIZES.get(name, 16) for g in groups.groups)


def test_fixture_counts_and_flags() -> None:
    assert kv_groups_from_hf_config(FIXTURES / "llama-3.1-8b.json").count == 1
    jamba = kv_groups_from_hf_config(FIXTURES / "jamba-v0.1.json")
    assert len(jamba.groups) == 2  # one group per kind of layer: full, Mamba
    assert jamba.count == 8  # vLLM's: 4 full and 28 Mamba layers in groups of 4 (test_model_configs.py)
    assert jamba.has_mamba
    assert not kv_groups_from_hf_config(FIXTURES / "gpt-oss-20b.json").has_mamba


@pytest.mark.parametrize(
    ("name", "kv_cache_dtype", "block_size", "page_size_bytes"),
    [
        pytest.param("qwen2.5-0.5b", "fp8_per_token_head", 16, 4352, id="qwen-fp8-per-token-head"),
        pytest.param("qwen2.5-0.5b", "auto", 16, 2 * 16 * 2 * 64 * 2, id="qwen-auto-bf16"),
        pytest.param("qwen2.5-0.5b", "int4_per_token_head", 16, 2 * 16 * 2 * (32 + 4), id="qwen-int4"),
        pytest.param("llama-3.1-8b", "auto", 16, 65536, id="llama-auto"),
        pytest.param("llama-3.1-8b", "fp8", 16, 32768, id="llama-fp8-per-tensor"),
        pytest.param("llama-3.1-8b", "auto", 32, 131072, id="llama-block-32"),
        pytest.param("deepseek-v2-lite", "auto", 16, 16 * 576 * 2, id="deepseek-mla-auto"),
        pytest.param("deepseek-v2-lite", "fp8_per_token_head", 16, 16 * (576 + 4), id="deepseek-mla-fp8-pth"),
        pytest.param("gpt-oss-20b", "fp8_e5m2", 16, 2 * 16 * 8 * 64, id="gpt-oss-fp8-e5m2"),
    ],
)
def test_page_size_bytes(name: str, kv_cache_dtype: str, block_size: int, page_size_bytes: int) -> None:
    groups = kv_groups_from_hf_config(FIXTURES / f"{name}.json", kv_cache_dtype=kv_cache_dtype,
                                      block_size=block_size)
    for group in groups.groups:
        assert group.spec.kv_cache_dtype == kv_cache_dtype
        assert group.spec.block_size == block_size
        assert group.spec.page_size_bytes == page_size_bytes


def test_mamba_stand_in_ignores_kv_cache_dtype() -> None:
    groups = kv_groups_from_hf_config(FIXTURES / "jamba-v0.1.json", kv_cache_dtype="fp8_per_token_head")
    by_kind = {g.spec.kind: g.spec for g in groups.groups}
    assert by_kind[MAMBA].kv_cache_dtype == "auto"
    assert by_kind[FULL].kv_cache_dtype == "fp8_per_token_head"
    assert by_kind[FULL].per_token_head


# --- tensor parallelism ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tp", "heads"),
    [
        pytest.param("llama-3.1-8b", 1, 8, id="llama-tp1"),
        pytest.param("llama-3.1-8b", 2, 4, id="llama-tp2"),
        pytest.param("llama-3.1-8b", 8, 1, id="llama-tp8"),
        pytest.param("llama-3.1-8b", 16, 1, id="llama-tp16-replicates"),
        pytest.param("qwen2.5-0.5b", 2, 1, id="qwen-tp2"),
        pytest.param("deepseek-v2-lite", 8, 1, id="mla-not-split"),
    ],
)
def test_tensor_parallel_heads(name: str, tp: int, heads: int) -> None:
    groups = kv_groups_from_hf_config(FIXTURES / f"{name}.json", tensor_parallel_size=tp)
    assert [g.spec.num_kv_heads for g in groups.groups] == [heads]


def test_tensor_parallel_leaves_mamba_and_mla_sizes() -> None:
    jamba = kv_groups_from_hf_config(FIXTURES / "jamba-v0.1.json", tensor_parallel_size=4)
    assert shape(jamba) == [G(MAMBA, 28, 1, 16), G(FULL, 4, 2, 128)]
    mla = kv_groups_from_hf_config(FIXTURES / "deepseek-v2-lite.json", tensor_parallel_size=4)
    assert mla.primary is not None and mla.primary.head_size == 576 and mla.primary.num_kv_heads == 1


def test_mla_tensor_parallel_must_divide_the_attention_heads() -> None:
    # vLLM splits an MLA model's query heads too (verify_with_parallel_config): DeepSeek-V2-Lite's 16 at TP 3
    # is refused by vLLM 0.28 and 0.34 (tests/conformance/test_model_configs.py, `deepseek-v2-lite-chat/tp3`)
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(FIXTURES / "deepseek-v2-lite.json", tensor_parallel_size=3)
    assert "`tensor_parallel_size` 3 does not divide `num_attention_heads` (16)" in only_diagnostic(exc.value).message


@pytest.mark.parametrize("tp", [pytest.param(8, id="tp8-does-not-divide-12"), pytest.param(16, id="tp16-not-x12")])
def test_tensor_parallel_that_does_not_fit_the_kv_heads(tp: int) -> None:
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(make_config(num_attention_heads=48, num_key_value_heads=12, head_dim=64),
                                 tensor_parallel_size=tp)
    diag = only_diagnostic(exc.value)
    assert diag.code == "invalid-field"
    assert "`tensor_parallel_size`" in diag.message
    assert "`num_key_value_heads`" in diag.message


@pytest.mark.parametrize(("name", "tp"), [pytest.param("qwen2.5-0.5b", 4, id="qwen-14-heads-tp4"),
                                          pytest.param("llama-3.1-8b", 3, id="llama-32-heads-tp3")])
def test_tensor_parallel_must_divide_the_attention_heads(name: str, tp: int) -> None:
    # vLLM's ModelConfig.verify_with_parallel_config refuses it before any KV head is replicated
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(FIXTURES / f"{name}.json", tensor_parallel_size=tp)
    diag = only_diagnostic(exc.value)
    assert "does not divide `num_attention_heads`" in diag.message


# --- input forms -------------------------------------------------------------------------------


def test_dict_path_str_and_directory_agree(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((FIXTURES / "gpt-oss-20b.json").read_text())
    results = [
        kv_groups_from_hf_config(fixture("gpt-oss-20b")),
        kv_groups_from_hf_config(FIXTURES / "gpt-oss-20b.json"),
        kv_groups_from_hf_config(str(FIXTURES / "gpt-oss-20b.json")),
        kv_groups_from_hf_config(tmp_path),
        kv_groups_from_hf_config(str(tmp_path)),
    ]
    assert all(r == results[0] for r in results)


def test_dict_input_is_not_mutated() -> None:
    config = fixture("jamba-v0.1")
    before = json.dumps(config, sort_keys=True)
    kv_groups_from_hf_config(config, tensor_parallel_size=2)
    assert json.dumps(config, sort_keys=True) == before


# --- multimodal text_config --------------------------------------------------------------------


def gemma3_config(**text: Any) -> dict[str, Any]:
    """Gemma-3-27B's shape: the text model under `text_config`, torch_dtype at the top; DROP removes."""
    text_config = {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                   "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
                   "sliding_window_pattern": 6, **text}
    text_config = {key: value for key, value in text_config.items() if value is not DROP}
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": text_config, "vision_config": {"hidden_size": 1152}, "torch_dtype": "bfloat16"}


def test_text_config_with_sliding_window_pattern() -> None:
    # every 6th layer (5, 11, ...) is global: 62 // 6 = 10 full, 52 sliding
    groups = kv_groups_from_hf_config(gemma3_config())
    assert shape(groups) == [G(SLIDING, 52, 16, 128, 1024), G(FULL, 10, 16, 128)]


def test_text_config_with_layer_types_and_own_dtype() -> None:
    types = ["sliding_attention"] * 5 + ["full_attention"]
    config = gemma3_config(num_hidden_layers=12, layer_types=types * 2, torch_dtype="float16")
    groups = kv_groups_from_hf_config(config)
    assert shape(groups) == [G(SLIDING, 10, 16, 128, 1024), G(FULL, 2, 16, 128)]
    # vLLM reads the top level's dtype first
    assert groups.primary is not None and groups.primary.dtype is ModelDtype.bfloat16
    del config["torch_dtype"]
    config["text_config"]["torch_dtype"] = "float32"  # then the text config's: float32, served in bfloat16
    reading = read_hf_config(config)
    assert reading.dtype is ModelDtype.bfloat16
    assert [n.code for n in reading.notes] == ["dtype-downcast"]


def test_text_config_wins_over_top_level_fields_with_a_note() -> None:
    # transformers' get_text_config hands vLLM the text_config, whatever the top level says
    config = make_config(num_hidden_layers=28, text_config={**make_config(), "num_hidden_layers": 3})
    reading = read_hf_config(config)
    assert reading.groups.primary is not None and reading.groups.primary.num_layers == 3
    assert [n.code for n in reading.notes] == ["ambiguous-config"]
    assert "`text_config.num_hidden_layers`" in reading.notes[0].message


# --- sliding-window variants -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param({"sliding_window": 4096, "use_sliding_window": False}, [G(FULL, 4, 2, 64)],
                     id="use-sliding-window-false"),
        pytest.param({"sliding_window": None}, [G(FULL, 4, 2, 64)], id="sliding-window-null"),
        pytest.param({"sliding_window": 4096}, [G(SLIDING, 4, 2, 64, 4096)], id="mistral-every-layer"),
        pytest.param({"sliding_window": 4096, "use_sliding_window": True}, [G(SLIDING, 4, 2, 64, 4096)],
                     id="use-sliding-window-true"),
        pytest.param({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1},
                     [G(FULL, 1, 2, 64), G(SLIDING, 3, 2, 64, 4096)], id="qwen2-max-window-layers"),
        pytest.param({"sliding_window": 4096, "model_type": "gemma2"},  # Gemma2Config's head_dim default: 256
                     [G(SLIDING, 2, 2, 256, 4096), G(FULL, 2, 2, 256)], id="gemma2-alternates"),
        pytest.param({"sliding_window": 512, "sliding_window_pattern": 4},
                     [G(SLIDING, 3, 2, 64, 512), G(FULL, 1, 2, 64)], id="cohere2-pattern"),
        pytest.param({"layer_types": ["full_attention"] * 4, "sliding_window": None},
                     [G(FULL, 4, 2, 64)], id="layer-types-all-full-needs-no-window"),
    ],
)
def test_sliding_window_variants(fields: dict[str, Any], expected: list[G]) -> None:
    assert shape(kv_groups_from_hf_config(make_config(**fields))) == expected


# --- Mamba hybrids -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param({"hybrid_override_pattern": "M-M*-M-", "num_hidden_layers": 7, "ssm_state_size": 128},
                     [G(MAMBA, 3, 1, 128), G(FULL, 1, 2, 64)], id="nemotron-h-pattern"),
        pytest.param({"layers_block_type": ["mamba", "attention", "mamba", "mamba"]},
                     [G(MAMBA, 3, 1, 16), G(FULL, 1, 2, 64)], id="layers-block-type-default-state"),
        pytest.param({"layer_types": ["linear_attention"] * 3 + ["full_attention"]},
                     [G(MAMBA, 3, 1, 16), G(FULL, 1, 2, 64)], id="qwen3-next-linear-attention"),
        pytest.param({"layer_types": ["mamba", "sliding_attention", "full_attention", "mamba"],
                      "sliding_window": 64, "mamba_d_state": 64},
                     [G(MAMBA, 2, 1, 64), G(SLIDING, 1, 2, 64, 64), G(FULL, 1, 2, 64)], id="three-kinds"),
        pytest.param({"attn_layer_period": 2, "num_hidden_layers": 4},
                     [G(FULL, 2, 2, 64), G(MAMBA, 2, 1, 16)], id="jamba-offset-defaults-to-0"),
        pytest.param({"layer_types": ["mamba"] * 4, "num_attention_heads": DROP, "hidden_size": DROP},
                     [G(MAMBA, 4, 1, 16)], id="pure-mamba-needs-no-attention-fields"),
    ],
)
def test_mamba_hybrids(fields: dict[str, Any], expected: list[G]) -> None:
    groups = kv_groups_from_hf_config(make_config(**fields))
    assert shape(groups) == expected
    assert groups.has_mamba


# --- dtype -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "keyword", "expected"),
    [
        pytest.param({}, None, ModelDtype.bfloat16, id="torch-dtype-bfloat16"),
        pytest.param({"torch_dtype": DROP}, None, ModelDtype.bfloat16, id="default-bfloat16"),
        pytest.param({"torch_dtype": "float16"}, None, ModelDtype.float16, id="float16"),
        pytest.param({"torch_dtype": "half"}, None, ModelDtype.float16, id="half"),
        pytest.param({"torch_dtype": "fp16"}, None, ModelDtype.float16, id="fp16"),
        pytest.param({"torch_dtype": "bf16"}, None, ModelDtype.bfloat16, id="bf16"),
        pytest.param({"torch_dtype": "float"}, None, ModelDtype.bfloat16, id="float-downcast"),
        pytest.param({"torch_dtype": "float32"}, None, ModelDtype.bfloat16, id="float32-downcast"),
        pytest.param({"torch_dtype": DROP, "dtype": "float16"}, None, ModelDtype.float16, id="transformers5-dtype"),
        pytest.param({"torch_dtype": "float32"}, "bfloat16", ModelDtype.bfloat16, id="keyword-overrides"),
        pytest.param({"torch_dtype": "float32"}, "auto", ModelDtype.bfloat16, id="keyword-auto-downcasts"),
        pytest.param({"torch_dtype": "bfloat16"}, "float32", ModelDtype.float32, id="keyword-upcasts"),
        pytest.param({"torch_dtype": "int8"}, "fp16", ModelDtype.float16, id="keyword-skips-bad-config-dtype"),
    ],
)
def test_model_dtype(fields: dict[str, Any], keyword: str | None, expected: ModelDtype) -> None:
    groups = kv_groups_from_hf_config(make_config(**fields), dtype=keyword)
    assert groups.primary is not None and groups.primary.dtype is expected


def test_float32_doubles_the_page() -> None:
    bf16 = kv_groups_from_hf_config(make_config()).primary
    fp32 = kv_groups_from_hf_config(make_config(), dtype="float32").primary
    assert bf16 is not None and fp32 is not None
    assert fp32.page_size_bytes == 2 * bf16.page_size_bytes


# --- config errors -----------------------------------------------------------------------------


def only_diagnostic(exc: ModelConfigError | InputError) -> Diagnostic:
    assert len(exc.diagnostics) == 1, exc.render()
    return exc.diagnostics[0]


CONFIG_ERRORS = [
    # without a model_type there is no config class to default a field the file leaves out
    pytest.param({"num_hidden_layers": DROP, "model_type": DROP}, "missing-field", "num_hidden_layers",
                 id="no-layers"),
    pytest.param({"num_hidden_layers": None}, "missing-field", "num_hidden_layers", id="null-layers"),
    pytest.param({"num_attention_heads": DROP, "model_type": DROP}, "missing-field", "num_attention_heads",
                 id="no-heads"),
    pytest.param({"num_attention_heads": None}, "missing-field", "num_attention_heads", id="null-heads"),
    pytest.param({"num_hidden_layers": 0}, "invalid-field", "num_hidden_layers", id="zero-layers"),
    pytest.param({"num_hidden_layers": "32"}, "invalid-field", "num_hidden_layers", id="string-layers"),
    pytest.param({"num_hidden_layers": 32.0}, "invalid-field", "num_hidden_layers", id="float-layers"),
    pytest.param({"num_hidden_layers": True}, "invalid-field", "num_hidden_layers", id="bool-layers"),
    pytest.param({"head_dim": -1}, "invalid-field", "head_dim", id="negative-head-dim"),
    pytest.param({"head_dim": 64.5}, "invalid-field", "head_dim", id="fractional-head-dim"),
    pytest.param({"num_key_value_heads": 0}, "invalid-field", "num_key_value_heads", id="zero-kv-heads"),
    pytest.param({"num_key_value_heads": 3}, "invalid-field", "num_key_value_heads", id="heads-not-multiple"),
    pytest.param({"num_key_value_heads": 16}, "invalid-field", "num_key_value_heads", id="more-kv-than-q"),
    pytest.param({"hidden_size": 500}, "invalid-field", "hidden_size", id="hidden-not-divisible"),
    pytest.param({"hidden_size": DROP, "model_type": DROP}, "missing-field", "hidden_size",
                 id="no-hidden-no-head-dim"),
    pytest.param({"torch_dtype": "int8"}, "invalid-field", "torch_dtype", id="unknown-torch-dtype"),
    pytest.param({"torch_dtype": 16}, "invalid-field", "torch_dtype", id="non-string-torch-dtype"),
    pytest.param({"layer_types": ["full_attention"] * 3}, "invalid-field", "layer_types", id="layer-types-short"),
    pytest.param({"layer_types": ["full_attention", "chunked", "full_attention", "full_attention"]},
                 "invalid-field", "layer_types[1]", id="layer-types-unknown"),
    pytest.param({"layer_types": "full_attention"}, "invalid-field", "layer_types", id="layer-types-not-list"),
    pytest.param({"layer_types": ["sliding_attention"] * 4}, "missing-field", "sliding_window",
                 id="sliding-without-window"),
    pytest.param({"layer_types": ["sliding_attention"] * 4, "sliding_window": 0}, "invalid-field",
                 "sliding_window", id="zero-window"),
    pytest.param({"sliding_window": 128, "use_sliding_window": "false"}, "invalid-field", "use_sliding_window",
                 id="use-sliding-window-string"),
    pytest.param({"sliding_window": 128, "sliding_window_pattern": 0}, "invalid-field", "sliding_window_pattern",
                 id="zero-pattern"),
    pytest.param({"sliding_window": 128, "use_sliding_window": True, "max_window_layers": -1}, "invalid-field",
                 "max_window_layers", id="negative-max-window-layers"),
    pytest.param({"model_type": "deepseek_v2", "kv_lora_rank": 512, "qk_rope_head_dim": None}, "missing-field",
                 "qk_rope_head_dim", id="mla-without-rope-dim"),
    pytest.param({"model_type": "deepseek_v3", "kv_lora_rank": 0, "qk_rope_head_dim": 64}, "invalid-field",
                 "kv_lora_rank", id="mla-zero-rank"),
    pytest.param({"attn_layer_period": 4, "attn_layer_offset": 4}, "invalid-field", "attn_layer_offset",
                 id="jamba-offset-too-big"),
    pytest.param({"attn_layer_offset": 1}, "missing-field", "attn_layer_period", id="jamba-offset-only"),
    pytest.param({"attn_layer_period": 0}, "invalid-field", "attn_layer_period", id="jamba-zero-period"),
    pytest.param({"attn_layer_period": 2, "mamba_d_state": 0}, "invalid-field", "mamba_d_state",
                 id="zero-mamba-state"),
    pytest.param({"hybrid_override_pattern": "M*M?"}, "invalid-field", "hybrid_override_pattern[3]",
                 id="nemotron-unknown-char"),
    pytest.param({"hybrid_override_pattern": "M*"}, "invalid-field", "hybrid_override_pattern",
                 id="nemotron-short"),
    pytest.param({"hybrid_override_pattern": "----"}, "invalid-field", "hybrid_override_pattern",
                 id="nemotron-no-cache-layer"),
    pytest.param({"layers_block_type": ["mamba", "attention", "bogus", "mamba"]}, "invalid-field",
                 "layers_block_type[2]", id="block-type-unknown"),
]


@pytest.mark.parametrize(("fields", "code", "field"), CONFIG_ERRORS)
def test_config_errors(fields: dict[str, Any], code: str, field: str) -> None:
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(make_config(**fields))
    diag = only_diagnostic(exc.value)
    assert diag.code == code
    assert f"`{field}`" in diag.message
    assert (diag.file, diag.line, diag.col) == ("<config>", 0, 0)
    assert diag.help
    assert diag.message[0].islower() or diag.message[0] == "`"
    assert not diag.message.endswith(".")


@pytest.mark.parametrize(
    ("config", "code", "field"),
    [
        pytest.param({"text_config": "oops"}, "invalid-field", "text_config", id="text-config-not-object"),
        pytest.param(gemma3_config(num_attention_heads=None), "missing-field", "text_config.num_attention_heads",
                     id="nested-field-named-with-prefix"),
        pytest.param(gemma3_config(num_hidden_layers=None), "missing-field", "text_config.num_hidden_layers",
                     id="nested-layers-null"),
        pytest.param({}, "missing-field", "num_hidden_layers", id="empty-dict"),
    ],
)
def test_text_config_errors(config: dict[str, Any], code: str, field: str) -> None:
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(config)
    diag = only_diagnostic(exc.value)
    assert diag.code == code
    assert f"`{field}`" in diag.message


def test_every_config_problem_is_reported_at_once() -> None:
    config = make_config(num_attention_heads=DROP, torch_dtype="int8", num_hidden_layers=-4)
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(config)
    # the layer count and dtype are read first; heads only once the layers are known
    assert {(d.code, d.message.split("`")[1]) for d in exc.value.diagnostics} == {
        ("invalid-field", "num_hidden_layers"),
        ("invalid-field", "torch_dtype"),
    }
    config = make_config(num_attention_heads=DROP, hidden_size=DROP, layer_types=["sliding_attention"] * 4,
                         model_type=DROP)
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(config)
    assert sorted(d.message.split("`")[1] for d in exc.value.diagnostics) == [
        "hidden_size", "num_attention_heads", "sliding_window"]


def test_spec_cross_check_becomes_model_config_error() -> None:
    # int4 packs two values a byte: an odd head_dim cannot be cached that way
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(make_config(head_dim=65), kv_cache_dtype="int4_per_token_head")
    diag = only_diagnostic(exc.value)
    assert diag.code == "invalid-spec"
    assert "head_size 65 must be even" in diag.message


# --- file errors -------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(path)
    diag = only_diagnostic(exc.value)
    assert (diag.file, diag.line, diag.code) == (str(path), 0, "unreadable")


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(tmp_path)
    diag = only_diagnostic(exc.value)
    assert diag.code == "unreadable"
    assert diag.file == str(tmp_path / "config.json")


@pytest.mark.parametrize(
    ("text", "line", "col"),
    [
        pytest.param('{\n  "num_hidden_layers": 32,\n}\n', 3, 1, id="trailing-comma"),
        pytest.param('{"num_hidden_layers": 32', 1, 25, id="unterminated"),
        pytest.param("", 1, 1, id="empty-file"),
    ],
)
def test_invalid_json_is_located(tmp_path: Path, text: str, line: int, col: int) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(path)
    diag = only_diagnostic(exc.value)
    assert (diag.file, diag.line, diag.col, diag.code) == (str(path), line, col, "invalid-json")
    assert f"{path}:{line}:{col}: error[invalid-json]" in exc.value.render()


@pytest.mark.parametrize(
    ("content", "code"),
    [
        pytest.param(b"[1, 2]", "invalid-config", id="top-level-array"),
        pytest.param(b"\xff\xfe{}", "unreadable", id="not-utf8"),
    ],
)
def test_unusable_file(tmp_path: Path, content: bytes, code: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(path)
    assert only_diagnostic(exc.value).code == code


def test_file_errors_carry_the_path(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(make_config(num_key_value_heads=3)))
    with pytest.raises(ModelConfigError) as exc:
        kv_groups_from_hf_config(path)
    diag = only_diagnostic(exc.value)
    assert (diag.file, diag.line, diag.code) == (str(path), 0, "invalid-field")


# --- keyword errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "code", "field"),
    [
        pytest.param({"kv_cache_dtype": "fp9"}, "unknown-kv-cache-dtype", "kv_cache_dtype", id="unknown-kv-dtype"),
        pytest.param({"kv_cache_dtype": None}, "invalid-input", "kv_cache_dtype", id="kv-dtype-none"),
        pytest.param({"block_size": 0}, "invalid-input", "block_size", id="zero-block"),
        pytest.param({"block_size": "16"}, "invalid-input", "block_size", id="string-block"),
        pytest.param({"tensor_parallel_size": 0}, "invalid-input", "tensor_parallel_size", id="zero-tp"),
        pytest.param({"dtype": "int8"}, "unknown-dtype", "dtype", id="unknown-dtype"),
    ],
)
def test_keyword_errors(kwargs: dict[str, Any], code: str, field: str) -> None:
    with pytest.raises(InputError) as exc:
        kv_groups_from_hf_config(make_config(), **kwargs)
    diag = only_diagnostic(exc.value)
    assert (diag.file, diag.code) == (field, code)
    assert field in diag.message


def test_unknown_kv_cache_dtype_suggests_a_fix() -> None:
    with pytest.raises(InputError) as exc:
        kv_groups_from_hf_config(make_config(), kv_cache_dtype="fp8_per_token")
    assert "did you mean `fp8_per_token_head`" in (only_diagnostic(exc.value).help or "")


def test_config_of_the_wrong_type() -> None:
    with pytest.raises(InputError) as exc:
        kv_groups_from_hf_config(42)  # type: ignore[arg-type]
    assert only_diagnostic(exc.value).file == "config"


# --- robustness --------------------------------------------------------------------------------

_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 200), st.floats(allow_nan=True), st.text(max_size=4),
    st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_small = st.one_of(st.integers(-1, 12), st.sampled_from([14, 16, 32, 64, 128, 512, 896, 4096]), _junk)
_layer_type = st.sampled_from(["full_attention", "sliding_attention", "mamba", "linear_attention", "bogus", 3])
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "num_hidden_layers": _small,
    "num_attention_heads": _small,
    "num_key_value_heads": _small,
    "hidden_size": _small,
    "head_dim": _small,
    "torch_dtype": st.one_of(st.sampled_from(["bfloat16", "float16", "half", "float", "int8"]), _junk),
    "dtype": st.one_of(st.sampled_from(["bf16", "float32"]), _junk),
    "sliding_window": _small,
    "use_sliding_window": _junk,
    "sliding_window_pattern": _small,
    "max_window_layers": _small,
    "model_type": st.sampled_from(["llama", "gemma2", "qwen2"]),
    "layer_types": st.one_of(st.lists(_layer_type, max_size=12), _junk),
    "hybrid_override_pattern": st.one_of(st.text(alphabet="M*-E?", max_size=12), _junk),
    "layers_block_type": st.one_of(st.lists(st.sampled_from(["attention", "mamba", "x"]), max_size=12), _junk),
    "attn_layer_period": _small,
    "attn_layer_offset": _small,
    "mamba_d_state": _small,
    "ssm_state_size": _small,
    "kv_lora_rank": _small,
    "qk_rope_head_dim": _small,
}
_flat_configs = st.fixed_dictionaries({}, optional=_FIELDS)
_random_configs = st.one_of(
    _flat_configs,
    st.builds(lambda top, text: {**top, "text_config": text}, _flat_configs, st.one_of(_flat_configs, _junk)),
)
_FIXTURE_NAMES = ("llama-3.1-8b", "qwen2.5-0.5b", "mistral-7b-v0.1", "deepseek-v2-lite", "gpt-oss-20b", "jamba-v0.1")
_edit = st.sampled_from(sorted(_FIELDS)).flatmap(lambda key: st.tuples(st.just(key), st.one_of(_FIELDS[key],
                                                                                              st.just(DROP))))


def _apply(base: dict[str, Any], edits: list[tuple[str, Any]]) -> dict[str, Any]:
    config = dict(base)
    for key, value in edits:
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    return config


# Random dicts rarely load; a published config with up to three fields changed, dropped or added
# exercises the paths that do, and the errors one step away from them.
_edited_configs = st.builds(
    _apply,
    st.one_of(st.sampled_from(_FIXTURE_NAMES).map(fixture), st.just(make_config()), st.just(gemma3_config())),
    st.lists(_edit, max_size=3),
)
_configs = st.one_of(_edited_configs, _random_configs)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=_configs,
    kv_cache_dtype=st.sampled_from(KV_CACHE_DTYPES),
    tp=st.one_of(st.sampled_from([1, 2, 4, 8]), st.integers(1, 16)),
    block_size=st.sampled_from([1, 16, 32]),
)
def test_any_config_loads_or_raises_model_config_error(
    config: dict[str, Any], kv_cache_dtype: str, tp: int, block_size: int
) -> None:
    try:
        reading = read_hf_config(config, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp,
                                 block_size=block_size)
    except ModelConfigError as exc:
        assert exc.diagnostics
        assert all(d.file == "<config>" and d.message and d.help for d in exc.diagnostics)
        return
    groups = reading.groups
    assert groups.count >= 1
    # every cache of every layer is in exactly one group
    assert sum(g.spec.num_layers for g in groups.groups) == sum(len(layer) for layer in reading.layers)
    assert all(g.spec.page_size_bytes > 0 for g in groups.groups)
    assert all(n.file == "<config>" and n.message and n.help for n in reading.notes)


# --- the config classes' older field names (transformers' attribute_map) --------------------------


@pytest.mark.parametrize("model_type", ["gpt2", "gptj"])
def test_older_field_names_read_as_the_config_class_reads_them(model_type: str) -> None:
    """GPT2Config / GPTJConfig store `num_hidden_layers`, `num_attention_heads` and `hidden_size` as `n_layer`,
    `n_head` and `n_embd` (their ``attribute_map``), which vLLM reads through; so does kvpolicy (vLLM's answers:
    tests/conformance/test_model_configs.py, `gpt2` and `gpt-j-6b`)."""
    old = {"model_type": model_type, "n_layer": 6, "n_head": 12, "n_embd": 768, "torch_dtype": "float16"}
    new = {"model_type": model_type, "num_hidden_layers": 6, "num_attention_heads": 12, "hidden_size": 768,
           "torch_dtype": "float16"}
    assert read_hf_config(old, tensor_parallel_size=2).groups == read_hf_config(new, tensor_parallel_size=2).groups
    assert shape(kv_groups_from_hf_config(old)) == [G(FULL, 6, 12, 64)]
    with pytest.raises(ModelConfigError) as exc:  # a problem names the field as the file spells it
        read_hf_config({**old, "n_head": 7})
    assert "`n_embd` (768) is not divisible by `n_head` (7)" in only_diagnostic(exc.value).message


@pytest.mark.parametrize("model_type", ["mpt", "dbrx"])
def test_kv_heads_under_attn_config_are_refused_by_name(model_type: str) -> None:
    """MPT and DBRX state their KV heads in `attn_config.kv_n_heads`, which kvpolicy does not read: refused
    naming that, not as a missing `num_hidden_layers`."""
    config = {"model_type": model_type, "n_layers": 4, "n_heads": 8, "d_model": 512,
              "attn_config": {"kv_n_heads": 2}}
    with pytest.raises(ModelConfigError) as exc:
        read_hf_config(config)
    assert any(d.code == "unsupported-model" and "attn_config.kv_n_heads" in d.message for d in exc.value.diagnostics)


# --- JSON constants Python reads (NaN, Infinity) --------------------------------------------------

_READ_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim")


def _text(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=1)  # Python writes an infinite float as `Infinity`, a NaN as `NaN`


def test_infinity_in_a_mamba_field_reads_as_vllm_reads_it(tmp_path: Path) -> None:
    """transformers writes Mamba-2's default ``time_step_limit`` (0.0, inf) as ``[0.0, Infinity]``; Python's json,
    transformers and vLLM read it (tests/conformance/test_model_configs.py's ``+infinity`` variant): so does
    kvpolicy, which never reads the field."""
    config = fixture("jamba-v0.1")
    path = tmp_path / "config.json"
    path.write_text(_text({**config, "time_step_limit": [0.0, float("inf")], "time_step_floor": float("nan")}))
    assert "Infinity" in path.read_text() and "NaN" in path.read_text()
    assert read_hf_config(path).groups == read_hf_config(config).groups


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(_READ_FIELDS), constant=st.sampled_from(["NaN", "Infinity", "-Infinity"]),
       name=st.sampled_from(["llama-3.1-8b", "qwen2.5-0.5b", "jamba-v0.1"]))
def test_a_json_constant_is_kept_where_unread_and_located_where_read(field: str, constant: str, name: str) -> None:
    """Anywhere kvpolicy does not read, a constant changes nothing; in a field it reads, it is refused at the
    constant's own line and column (never a traceback, never a guess)."""
    import tempfile

    config = fixture(name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(_text({**config, "kvpolicy_unread": [1.5, float(constant)]}))
        assert read_hf_config(path).groups == read_hf_config(config).groups
        text = _text({**config, field: 0}).replace(f'"{field}": 0', f'"{field}": {constant}')
        path.write_text(text)
        with pytest.raises(ModelConfigError) as exc:
            read_hf_config(path)
    at = text.index(f'"{field}": {constant}') + len(f'"{field}": ')
    line, col = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
    [d] = [d for d in exc.value.diagnostics if f"`{field}`" in d.message]
    assert (d.code, d.line, d.col) == ("invalid-field", line, col), d.render()
    assert f"got `{constant}`" in d.message


# --- public surface ----------------------------------------------------------------------------


def test_public_api() -> None:
    assert kvpolicy.policy.hf_config.__all__ == [
        "ModelConfigWarning", "ModelReading", "kv_groups_from_hf_config", "read_hf_config"]


def test_module_never_imports_torch() -> None:
    code = "import sys, kvpolicy.policy.hf_config; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


def test_both_entry_points_take_the_same_keywords() -> None:
    """`kv_groups_from_hf_config` is `read_hf_config` without the notes: every keyword of one, with its
    default, is the other's (a keyword added to one alone would be a TypeError for its callers)."""
    import inspect

    reading = inspect.signature(read_hf_config).parameters
    groups = inspect.signature(kv_groups_from_hf_config).parameters
    assert [(p.name, p.kind, p.default) for p in reading.values()] == \
        [(p.name, p.kind, p.default) for p in groups.values()]
