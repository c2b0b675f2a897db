"""The model dtype vLLM serves a checkpoint in: ``--dtype auto`` rules, and an explicit ``--dtype``.

vLLM 0.28.0 and 0.34.0 decide alike (``config/model.py`` ``_get_and_verify_dtype`` and
``_resolve_auto_dtype``; 0.34 adds only a PowerPC CPU rule kvpolicy does not model):

1. The config's dtype: the top level's ``dtype``/``torch_dtype`` first, then the text
   config's (``ModelArchConfigConvertorBase.get_torch_dtype``). None stated: vLLM reads
   the safetensors weights' dtype, and without weights takes float32.
2. The platform's supported dtypes, in preference order: CUDA SM 8.0 on (and x86 CPUs)
   bfloat16, float16, float32; SM 6.x-7.x float16, float32. Gemma-2, Gemma-3 and GLM-4
   drop float16 (``_FLOAT16_NOT_SUPPORTED_MODELS``); a pooling model prefers float16.
3. ``auto``: a float32 checkpoint is served in the first preferred dtype (**float32 is
   downcast**: Gemma-2's ``torch_dtype: float32`` is served in bfloat16); a supported
   config dtype is kept; an unsupported one falls back to the preferred dtype.
4. An explicit dtype wins, except float16 for the models in (2), which vLLM refuses.

``--kv-cache-dtype auto`` is resolved from the checkpoint as well (`checkpoint_kv_cache_dtype`,
vLLM's ``resolve_kv_cache_dtype_string``, alike in both): a ModelOpt checkpoint's KV cache
quantization (``kv_cache_quant_algo`` or ``kv_cache_scheme``) names the cache's format.
"""

from __future__ import annotations

from typing import Any

from kvpolicy.policy.hf_reader import ConfigReader, show
from kvpolicy.policy.quant import ModelDtype

__all__ = ["DTYPE_ALIASES", "FLOAT16_UNSUPPORTED", "checkpoint_kv_cache_dtype", "parse_dtype", "served_dtype"]

DTYPE_ALIASES: dict[str, ModelDtype] = {
    "bfloat16": ModelDtype.bfloat16,
    "bf16": ModelDtype.bfloat16,
    "float16": ModelDtype.float16,
    "fp16": ModelDtype.float16,
    "half": ModelDtype.float16,
    "float32": ModelDtype.float32,
    "fp32": ModelDtype.float32,
    "float": ModelDtype.float32,
}

FLOAT16_UNSUPPORTED = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})

# vLLM's architecture suffixes that select the pooling runner (config/model.py _SUFFIX_TO_DEFAULTS)
_POOLING_SUFFIXES = ("ForTextEncoding", "EmbeddingModel", "ForSequenceClassification", "ForTokenClassification",
                     "ForRewardModeling", "RewardModel", "ClassificationModel")


# utils/torch_utils.py MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP
_MODELOPT_KV = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}


def checkpoint_kv_cache_dtype(r: ConfigReader) -> str | None:
    """The KV cache dtype ``auto`` means for this checkpoint: a ModelOpt ``quantization_config``'s KV
    cache algorithm (``fp8`` -> ``fp8_e4m3``, ``nvfp4``), else None (the model dtype)."""
    quant = r.top.get("quantization_config")
    if not isinstance(quant, dict) or not str(quant.get("quant_method", "")).startswith("modelopt"):
        return None
    inner = quant.get("quantization", quant)
    inner = inner if isinstance(inner, dict) else quant
    algo = (inner.get("kv_cache_scheme") or quant.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
            or quant.get("kv_cache_quant_algo"))
    if isinstance(algo, dict):
        if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
            algo = "fp8"
        elif algo.get("num_bits") == 4 and algo.get("type") == "float":
            algo = "nvfp4"
    if algo is None:
        return None
    resolved = _MODELOPT_KV.get(algo.lower()) if isinstance(algo, str) else None
    if resolved is None:  # vLLM logs a warning and keeps auto
        r.warn("unknown-kv-cache-quant", f"`quantization_config`'s KV cache algorithm `{show(algo)}` is not one "
               "vLLM knows (fp8, nvfp4): it keeps the model dtype, and so does kvpolicy",
               "pass kv_cache_dtype= (--kv-cache-dtype) to choose the cache's format")
    return resolved


def parse_dtype(value: Any) -> ModelDtype | None:
    if isinstance(value, str):
        return DTYPE_ALIASES.get(value.lower().removeprefix("torch."))
    return None


def _config_dtype(r: ConfigReader) -> ModelDtype | None:
    """The dtype the config states (top level first, as vLLM reads it), None when none does."""
    places = [(r.top, "")] + ([(r.cfg, r.prefix)] if r.prefix else [])
    for cfg, prefix in places:
        for key in ("dtype", "torch_dtype"):
            value = cfg.get(key)
            if value is None:
                continue
            parsed = parse_dtype(value)
            if parsed is None:
                r.error("invalid-field", f"`{prefix}{key}` is `{show(value)}`, not a dtype K/V are computed in",
                        "use bfloat16, float16 or float32, or pass dtype= to override it")
            return parsed
    return None


def _supported(model_type: str, device_capability: int | None) -> list[ModelDtype]:
    bf16, fp16, fp32 = ModelDtype.bfloat16, ModelDtype.float16, ModelDtype.float32
    dtypes = [bf16, fp16, fp32] if device_capability is None or device_capability >= 8 else \
        [fp16, fp32] if device_capability >= 6 else [fp32]
    return [d for d in dtypes if not (d is fp16 and model_type in FLOAT16_UNSUPPORTED)]


def served_dtype(r: ConfigReader, override: ModelDtype | None, device_capability: int | None) -> ModelDtype:
    """The dtype vLLM serves this model in (see the module docstring); notes say what was assumed.

    ``device_capability`` is the CUDA major version (None: SM 8.0 or later, or a CPU, where
    bfloat16 leads). Errors (a dtype vLLM refuses) go to ``r``'s diagnostics.
    """
    model_type = str(r.top.get("model_type") or "")
    if override is not None:  # the config's dtype then only feeds vLLM's log line
        if override is ModelDtype.float16 and model_type in FLOAT16_UNSUPPORTED:
            r.error("unsupported-dtype", f"vLLM refuses float16 for model type `{model_type}` "
                    "(numerical instability)", "use bfloat16 or float32")
        return override
    stated = _config_dtype(r)
    supported = _supported(model_type, device_capability)
    architectures = r.top.get("architectures")
    pooling = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith(_POOLING_SUFFIXES) for a in architectures)
    preferred = ModelDtype.float16 if pooling and ModelDtype.float16 in supported else supported[0]
    if stated is None and not r.diagnostics:
        r.warn("assumed-dtype", f"the config states no `torch_dtype`: vLLM then takes the safetensors weights' "
               f"dtype, which kvpolicy does not read; assumed {preferred.value} (what vLLM serves without weights)",
               "pass dtype= (the CLI's --dtype) with the weights' dtype")
        return preferred
    if stated is None:
        return preferred
    if stated is ModelDtype.float32 and preferred is not ModelDtype.float32:
        r.warn("dtype-downcast", f"the config's dtype is float32; vLLM's --dtype auto serves a float32 checkpoint "
               f"in {preferred.value}, and so does kvpolicy",
               "pass dtype=\"float32\" (the CLI's --dtype float32) to serve it in float32")
        return preferred
    return stated if stated in supported else preferred
