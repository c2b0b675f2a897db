"""Hugging Face ``config.json`` -> the KV cache groups vLLM would build, read as vLLM reads it.

Turns the fields that decide a model's KV cache (layer count, per-layer cache kind,
KV heads per tensor-parallel rank, head size, the dtype vLLM serves) into
`KVCacheGroups`, from a checkpoint's config alone, without torch, transformers or the
model code. The config is read as transformers' config class for its ``model_type``
would present it to vLLM (class defaults, `kvpolicy.policy.hf_reader`), the text model
from ``text_config`` when there is one, each layer's cache as vLLM's model code builds
it (`kvpolicy.policy.hf_layer_kinds`) and the dtype by ``--dtype auto``'s rules
(`kvpolicy.policy.hf_dtype`). Worked example, Qwen2.5-0.5B (24 layers, 14 heads,
2 KV heads, hidden 896, ``use_sliding_window: false``)::

    head_size = hidden_size // num_attention_heads = 896 // 14 = 64
    one group: kind full, 24 layers, 2 KV heads, head_size 64
    fp8_per_token_head, block 16: page_size_bytes = 2*16*2*(64+4) = 4352

Config problems are collected and reported together in one `ModelConfigError`
(fields others depend on, such as the layer count, are checked first); a bad keyword
(``kv_cache_dtype``, ``block_size``, ``tensor_parallel_size``, ``dtype``,
``device_capability``) is an `InputError`. What kvpolicy had to assume, or where vLLM
itself would not serve the model as read, is a note: `read_hf_config` returns them,
`kv_groups_from_hf_config` issues each as a `ModelConfigWarning`.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvpolicy.policy.errors import Diagnostic, ModelConfigError, input_error
from kvpolicy.policy.files import read_capped
from kvpolicy.policy.hf_dtype import checkpoint_kv_cache_dtype, parse_dtype, served_dtype
from kvpolicy.policy.hf_layer_kinds import MAMBA_ONLY, LayerCache, layer_caches, window_tokens
from kvpolicy.policy.hf_reader import ConfigReader, LocatedFloat, is_int, show
from kvpolicy.policy.hybrid_block import hybrid_block_size
from kvpolicy.policy.quant import KV_CACHE_DTYPES, ModelDtype, parse_kv_cache_dtype
from kvpolicy.policy.spec import MAX_LAYERS, AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec
from kvpolicy.policy.yaml_source import INT64_MAX, INT64_MIN

__all__ = ["ModelConfigWarning", "ModelReading", "kv_groups_from_hf_config", "read_hf_config"]

_DICT_SOURCE = "<config>"
_CONFIG_NAME = "config.json"
_DEFAULT_MAMBA_STATE = 16

# vLLM's `is_deepseek_mla` (0.28.0 and 0.34.0 together): only these model types cache an MLA latent
_MLA_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note",
    "deepseek_mtp", "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa", "glm4_moe_lite",
    "glm4_moe_lite_mtp", "kimi_k2", "kimi_linear", "longcat_flash", "longcat_flash_ngram", "mistral_large_4",
    "pangu_ultra_moe", "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp", "bailing_hybrid_v3_mtp",
    "hy_v4", "hy_v4_mtp"})

# vLLM's CONFIG_FIELD_ALIASES["total_num_kv_heads"], first present wins
_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")

# the text model of a multimodal config whose `text_config` states no model_type of its own
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "llama4": "llama4_text", "mllama": "mllama_text_model"}

# draft models of speculative decoding: vLLM adds their layers to the target's KV cache
_DRAFT_MODEL_TYPES = frozenset({"eagle", "medusa", "mlp_speculator", "speculators", "deepseek_mtp",
                                "qwen3_next_mtp", "glm4_moe_mtp", "ernie_mtp", "longcat_flash_mtp"})


class ModelConfigWarning(UserWarning):
    """A note on a model config (an assumption, or a model vLLM would not serve as read).

    ``diagnostic`` is the located note; ``str()`` renders it like an error line."""

    def __init__(self, diagnostic: Diagnostic) -> None:
        if not isinstance(diagnostic, Diagnostic):  # (pytest-xdist rebuilds a warning from its text, and
            # takes a TypeError as "cannot": it then reports the text as a plain Warning)
            raise TypeError(f"ModelConfigWarning takes a Diagnostic, not {type(diagnostic).__name__}")
        super().__init__(diagnostic.render().replace(": error[", ": warning[", 1))
        self.diagnostic = diagnostic


@dataclass(frozen=True)
class ModelReading:
    """What `read_hf_config` read: the groups, each layer's caches, the served dtype, and the notes.

    ``layers[i]`` names the caches layer ``i`` keeps as vLLM's model code builds them
    (``full``, ``sliding_window``, ``chunked_local``, ``mamba``, or ``mla``; none for an
    MLP-only layer; two for a Falcon-H1 layer). ``notes`` are warnings: what was assumed.
    """

    groups: KVCacheGroups
    layers: tuple[tuple[str, ...], ...]
    dtype: ModelDtype
    notes: tuple[Diagnostic, ...] = ()


def _encodable(path: str) -> bool:
    """Whether the file system can name ``path``: a lone surrogate such as ``"\\ud800"`` cannot."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return False
    return True


def _load(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The parsed config and the name errors are reported under."""
    if isinstance(config, Mapping):
        return config, _DICT_SOURCE
    if not isinstance(config, str | os.PathLike):
        raise input_error(
            "config",
            f"expected a path to config.json, a directory holding one, or a dict; got `{type(config).__name__}`",
        )
    raw_path = os.fspath(config)
    if isinstance(raw_path, bytes) or "\0" in raw_path or not _encodable(raw_path):
        raise input_error("model", f"`{raw_path!r}` is not a usable path (a NUL byte, or bytes)",
                          "pass the path of a config.json, or the directory holding one, as a string")
    path = Path(raw_path)
    try:
        if path.is_dir():
            path = path / _CONFIG_NAME
    except OSError:  # a name too long, say: reading it below says why
        pass
    where = str(path)

    def fail(code: str, message: str, help: str, line: int = 0, col: int = 0) -> ModelConfigError:
        return ModelConfigError("invalid model config", [Diagnostic(where, line, col, code, message, help)])

    text, problems = read_capped(path, where, MAX_CONFIG_BYTES)
    if text is None:
        d = problems[0]
        code = d.code if d.code in ("too-large", "not-a-file") else "unreadable"
        raise fail(code, d.message.replace("the file", "the model config"),
                   d.help if d.code == "too-large" else
                   "pass a config.json, a model directory holding one, or an already-parsed dict", d.line, d.col)
    try:
        data = json.loads(text, parse_int=_bounded_int, parse_constant=_Constants(text))
    except _BadNumber as exc:
        line, col = _offset_position(text, exc.literal)
        raise fail("invalid-field", f"the number `{_short(exc.literal)}` is {exc.why}",
                   "a config.json holds integers within 64 bits and finite numbers", line, col) from None
    except json.JSONDecodeError as exc:
        raise fail("invalid-json", f"invalid JSON: {exc.msg}", "fix the JSON syntax at this position",
                   exc.lineno, exc.colno) from None
    except RecursionError:
        raise fail("invalid-json", "invalid JSON: nested too deeply", "fix the file's structure") from None
    if not isinstance(data, dict):
        raise fail("invalid-config", f"the top level must be a JSON object, got `{type(data).__name__}`",
                   "a Hugging Face config.json is one object of fields")
    return data, where


MAX_CONFIG_BYTES = 8_000_000  # a config.json is a few kilobytes; this stops reading a weights file by mistake


class _BadNumber(ValueError):
    def __init__(self, literal: str, why: str) -> None:
        super().__init__(literal)
        self.literal, self.why = literal, why


def _bounded_int(literal: str) -> int:
    """JSON integers as Python reads them, but refused beyond int64 (and never converted when longer
    than 20 digits: Python refuses to convert more than 4300 and printing a huge one fails later)."""
    if len(literal.lstrip("-")) > 20 or not INT64_MIN <= int(literal) <= INT64_MAX:
        raise _BadNumber(literal, "outside the 64-bit integer range")
    return int(literal)


# `NaN`, `Infinity` and `-Infinity` outside JSON strings: the constants Python's json module reads, and so
# transformers and vLLM (a Mamba-2 config's `time_step_limit` is `[0.0, Infinity]` as transformers saves it)
_CONSTANT_OR_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


class _Constants:
    """``parse_constant`` for one text: each constant as a `LocatedFloat` at its line and column (the
    decoder meets them in the order they appear), so a field kvpolicy reads that holds one is refused
    where it stands; one kvpolicy does not read is kept, as vLLM keeps it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.found = (m for m in _CONSTANT_OR_STRING.finditer(text) if m.group(1))

    def __call__(self, literal: str) -> float:
        match = next(self.found, None)
        at = match.start(1) if match is not None and match.group(1) == literal else max(self.text.find(literal), 0)
        line = self.text.count("\n", 0, at) + 1
        return LocatedFloat(literal, line, at - (self.text.rfind("\n", 0, at) + 1) + 1)


def _offset_position(text: str, literal: str) -> tuple[int, int]:
    at = max(text.find(literal), 0)
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


def _short(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:12]}...{text[-6:]} ({len(text)} characters)"



def _text_reader(raw: Mapping[str, Any], where: str, notes: list[Diagnostic],
                 release: tuple[int, ...] | None) -> ConfigReader:
    """The text model's fields: ``text_config`` when the config has one (transformers'
    ``get_text_config``, which vLLM reads), else the top level."""
    top_type = raw.get("model_type")
    top_type = top_type if isinstance(top_type, str) else None
    top = ConfigReader(raw, raw, where, "", top_type, notes, release)
    nested = raw.get("text_config")
    if nested is None:
        if top_type is None:
            top.warn("assumed-model-type", "the config states no `model_type`, which vLLM needs to load it; "
                     "read by its fields alone, without a config class's defaults",
                     "add the model's `model_type` to config.json")
        return top
    if not isinstance(nested, Mapping):
        top.invalid("text_config", f"`text_config` must be an object, got `{show(nested)}`")
        top.fail_if_any()
    text_type = nested.get("model_type")
    text_type = text_type if isinstance(text_type, str) else _TEXT_MODEL_TYPES.get(top_type or "", top_type)
    text = ConfigReader(nested, raw, where, "text_config.", text_type, notes, release)
    layers = raw.get("num_hidden_layers")
    if layers is not None and layers != text.get("num_hidden_layers"):
        text.warn("ambiguous-config", f"`num_hidden_layers` ({show(layers)}) and "
                  f"`text_config.num_hidden_layers` ({show(text.get('num_hidden_layers'))}) differ: read the "
                  "text_config, as transformers hands it to vLLM", "remove the field that does not describe the model")
    return text


def _removed_architectures(vllm_version: str | None) -> tuple[str, dict[str, str]] | None:
    """(``vLLM 0.34.0``, the architectures that release's model registry no longer implements, each with
    the last version that served it): the release profile's `previously_supported_models`, the newest
    profile's where no version is given; None for a version no profile answers for (before 0.24: Bamba
    and the other architectures the registry later dropped are read as their configs describe them)."""
    from kvpolicy.policy.releases import get_profile, match_version, profile_names

    if vllm_version is None:
        profile = get_profile(profile_names()[0])
        return f"vLLM {profile.vllm_versions[-1]}", profile.previously_supported_models
    match = match_version(vllm_version)
    if match is None:
        return None
    return f"vLLM {vllm_version.strip().removeprefix('v')}", match.profile.previously_supported_models


def _rounds_hybrid_block(vllm_version: str | None) -> bool:
    """The release profile's `hybrid_block_rounded` (the newest profile's where no version is given; False
    for a version no profile answers for)."""
    from kvpolicy.policy.releases import get_profile, match_version, profile_names

    if vllm_version is None:
        return get_profile(profile_names()[0]).hybrid_block_rounded
    match = match_version(vllm_version)
    return match is not None and match.profile.hybrid_block_rounded


def _check_removed(r: ConfigReader, names: list[str], vllm_version: str | None) -> bool:
    """An error when every architecture the config names is one the release's model registry dropped:
    the release has no implementation of the model (0.28 refuses Bamba when it builds the ModelConfig,
    "was supported in vLLM until v0.23.0"; 0.34 tries its Transformers backend, which fails on Bamba's
    Mamba layers when it builds the model; kvpolicy does not model that backend). True when it did."""
    removed = _removed_architectures(vllm_version)
    if not names or removed is None or not all(n in removed[1] for n in names):
        return False
    release, last = removed[0], removed[1]
    newest = max(last[n] for n in names)
    r.error("removed-architecture", f"{release} does not serve `{'`, `'.join(names)}` (config.json "
            f"`architectures`): its model registry says {'it was' if len(names) == 1 else 'they were'} supported "
            f"until v{newest} and removed after that release; vLLM does not start this model, so no layout "
            "is decided for it",
            f"run this model on vLLM <= {newest} (kvpolicy profiles no release that old), or choose a model "
            f"{release} serves; where vLLM's Transformers backend runs it (--model-impl transformers), give its "
            "KV cache groups in a --spec file")
    return True


def _check_served(r: ConfigReader, vllm_version: str | None = None) -> None:
    """What vLLM refuses to serve and what kvpolicy does not model (errors)."""
    architectures = r.top.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        # vLLM 0.28 / 0.34's ModelConfig validates it as list[str] ("Input should be a valid list")
        r.error("invalid-field", f"`architectures` must be a list of architecture names, got "
                f"`{show(architectures)}`, which vLLM refuses", "write it as a list, e.g. [\"LlamaForCausalLM\"]")
        return
    names = list(architectures or [])
    if _check_removed(r, names, vllm_version):
        return
    types = {r.model_type, r.top.get("model_type")}
    if types & _DRAFT_MODEL_TYPES or any("Eagle" in a or a.endswith(("MTP", "MTPModel", "Medusa")) for a in names):
        r.error("unsupported-model", "a speculative-decoding draft model: vLLM adds its layers to the target "
                "model's KV cache groups, which kvpolicy does not model",
                "read the target model's config; a draft's layers can be given as groups in a --spec file")
    if r.has("block_configs") or r.get("is_heterogeneous") or r.top.get("is_heterogeneous"):
        r.error("unsupported-model", "per-layer block configs (a heterogeneous model such as Nemotron-NAS): each "
                "layer's heads and whether it has attention at all vary, which kvpolicy does not model",
                "give the KV cache groups in a --spec file")
    if r.has("compress_ratios") or r.has("compress_rates"):
        r.error("unsupported-model", "compressed sparse attention (DeepSeek-V4's `compress_ratios`): its "
                "sliding-window MLA and compressed caches are not modelled",
                "give the KV cache groups in a --spec file")
    if any(r.has(f) for f in ("global_head_dim", "num_global_key_value_heads", "per_layer_config")):
        field = next(f for f in ("global_head_dim", "num_global_key_value_heads", "per_layer_config") if r.has(f))
        r.error("unsupported-model", f"`{r.name(field)}`: the full-attention layers have their own head size or "
                "KV-head count (Gemma 4's per-layer-type geometry), which kvpolicy does not model: reading them "
                "with the sliding layers' values would decide on other geometry than vLLM's",
                "give the KV cache groups in a --spec file")
    if types & {"mpt", "dbrx"}:
        r.error("unsupported-model", f"`{r.model_type}` states its layers, heads and width under its own names "
                "(`n_layers`, `n_heads`, `d_model`) and its KV heads in `attn_config.kv_n_heads`, which kvpolicy "
                "does not read", "give the KV cache groups in a --spec file")
    if r.has("cross_attention_layers") or "whisper" in types:
        r.error("unsupported-model", "cross-attention layers (an encoder-decoder model): kvpolicy models "
                "decoder-only KV caches, and the vLLM releases it profiles do not serve Mllama",
                "give the KV cache groups in a --spec file")


def _kv_heads(r: ConfigReader, heads: int | None) -> int | None:
    if r.model_type == "falcon" and not r.get("new_decoder_architecture") and r.get("multi_query"):
        return 1  # Falcon's multi-query attention, as vLLM's FalconModelArchConfigConvertor reads it
    if r.model_type == "zamba2":
        return heads  # Zamba2's attention is multi-head: vLLM sizes it by num_attention_heads
    for key in _KV_HEAD_KEYS:
        if r.has(key):
            return r.int_field(key)
    if "num_attention_heads" in r.assumed and heads is not None:  # the class's default: as many as the heads
        r.assumed.setdefault("num_key_value_heads", heads)
    return heads


def _head_size(r: ConfigReader, heads: int | None) -> int | None:
    """vLLM's ``get_head_size``: ``head_dim`` when positive, ``hidden_size_per_head``, Zamba2's
    ``attention_head_dim``, else ``hidden_size // num_attention_heads``; a latent-attention model
    vLLM does not cache as MLA (MiniCPM3) pages ``qk_nope_head_dim + qk_rope_head_dim`` per head."""
    if r.has("kv_lora_rank") and r.has("qk_nope_head_dim") and r.has("qk_rope_head_dim"):
        nope, rope = r.int_field("qk_nope_head_dim"), r.int_field("qk_rope_head_dim")
        return None if nope is None or rope is None else nope + rope
    keys = ("attention_head_dim",) if r.model_type == "zamba2" else ("head_dim", "hidden_size_per_head")
    for key in keys:
        value = r.get(key)
        if value is not None and not (key == "head_dim" and is_int(value) and value == 0):
            return r.int_field(key)
    hidden = r.int_field("hidden_size", required=True, help="add `head_dim`, or `hidden_size` to derive it from")
    if r.model_type == "zamba2" and hidden is not None:
        hidden *= 2  # Zamba2Config: attention_hidden_size = 2 * hidden_size
    if hidden is None or heads is None:
        return None
    if hidden % heads:
        r.invalid("hidden_size", f"`{r.name('hidden_size')}` ({hidden}) is not divisible by "
                                 f"`{r.name('num_attention_heads')}` ({heads})",
                  f"add `{r.name('head_dim')}` to state the head size explicitly")
        return None
    return hidden // heads


def _heads_divide(r: ConfigReader, heads: int | None, tp: int) -> bool:
    """vLLM's ``ModelConfig.verify_with_parallel_config``: the attention heads divide by the tensor-parallel
    size (MLA models too: their heads are split, their one latent KV head is not); refused otherwise."""
    if heads is not None and heads % tp:
        r.error("invalid-field", f"`tensor_parallel_size` {tp} does not divide `{r.name('num_attention_heads')}` "
                f"({heads}), which vLLM refuses", "choose a tensor_parallel_size that divides the attention heads")
        return False
    return True


def _attention_geometry(r: ConfigReader, tp: int) -> tuple[int, int] | None:
    """(KV heads on this rank, head size) for the attention layers, as vLLM's ``get_num_kv_heads``."""
    heads = r.int_field("num_attention_heads", required=True,
                        help="attention models state their query heads in `num_attention_heads`")
    kv_heads = _kv_heads(r, heads)
    head_size = _head_size(r, heads)
    if heads is not None and kv_heads is not None and heads % kv_heads:
        r.invalid("num_key_value_heads", f"`{r.name('num_attention_heads')}` ({heads}) is not divisible by "
                                         f"`{r.name('num_key_value_heads')}` ({kv_heads})",
                  "grouped-query attention shares each KV head among a whole number of query heads")
    uneven = kv_heads is not None and tp > 1 and (kv_heads % tp if tp < kv_heads else tp % kv_heads)
    if _heads_divide(r, heads, tp) and uneven:
        r.error("invalid-field",
                f"`tensor_parallel_size` {tp} does not fit `{r.name('num_key_value_heads')}` ({kv_heads})",
                "tensor_parallel_size must divide the KV heads, or be a multiple of them "
                "(then each KV head is replicated)")
    if r.diagnostics or kv_heads is None or head_size is None:
        return None
    # vLLM replicates KV heads when there are more ranks than heads: one per rank.
    return max(1, kv_heads // tp), head_size


def _mamba_state_size(r: ConfigReader) -> int:
    """The Mamba stand-in's head size: the SSM state size, which is positive."""
    for key in ("mamba_d_state", "ssm_state_size"):
        if r.has(key):
            return r.int_field(key) or _DEFAULT_MAMBA_STATE
    return _DEFAULT_MAMBA_STATE


def _build(r: ConfigReader, fields: list[dict[str, Any]]) -> KVCacheGroups:
    """Build the specs; the model validators' remaining cross-checks become a `ModelConfigError`."""
    groups = []
    for spec_fields in fields:
        try:
            groups.append(KVCacheGroup(spec=KVCacheSpec(**spec_fields)))
        except ValidationError as exc:
            kind = spec_fields["kind"].value
            for err in exc.errors():
                msg = err["msg"].removeprefix("Value error, ")
                r.error("invalid-spec", f"with kv_cache_dtype `{spec_fields['kv_cache_dtype']}`, the {kind} "
                                        f"KV cache spec this config gives is invalid: {msg}",
                        "choose another kv_cache_dtype, or check the config's head fields")
    r.fail_if_any()
    return KVCacheGroups(groups=tuple(groups))


def _release(vllm_version: str | None) -> tuple[int, ...] | None:
    """``"0.28.0"`` (or ``"v0.28"``) -> ``(0, 28, 0)``; None stays None; anything else is an `InputError`."""
    if vllm_version is None:
        return None
    parts = vllm_version.removeprefix("v").split(".") if isinstance(vllm_version, str) else []
    if not 2 <= len(parts) <= 3 or not all(p.isascii() and p.isdigit() for p in parts):
        raise input_error("vllm_version", f"`vllm_version` must be a vLLM release such as 0.34.0, "
                          f"got `{show(vllm_version)}`")
    return tuple(int(p) for p in parts)


def _check_keywords(kv_cache_dtype: str, block_size: int, tensor_parallel_size: int, dtype: str | None,
                    device_capability: int | None, disable_sliding_window: bool) -> ModelDtype | None:
    """Validate the keyword inputs (`InputError`); return the dtype override, if any."""
    if not isinstance(kv_cache_dtype, str):
        raise input_error("kv_cache_dtype", f"`kv_cache_dtype` must be a string, got `{show(kv_cache_dtype)}`",
                          f"valid values: {', '.join(KV_CACHE_DTYPES)}")
    parse_kv_cache_dtype(kv_cache_dtype, ModelDtype.bfloat16)  # raises InputError with a did-you-mean
    for name, value in (("block_size", block_size), ("tensor_parallel_size", tensor_parallel_size)):
        if not is_int(value) or value < 1:
            raise input_error(name, f"`{name}` must be a positive integer, got `{show(value)}`")
    if not isinstance(disable_sliding_window, bool):
        raise input_error("disable_sliding_window", f"`disable_sliding_window` must be true or false, "
                          f"got `{show(disable_sliding_window)}`")
    if device_capability is not None and not (is_int(device_capability) and 0 < device_capability < 100):
        raise input_error("device_capability", f"`device_capability` must be a CUDA major version such as 9, "
                          f"got `{show(device_capability)}`")
    if dtype is None or dtype == "auto":
        return None
    override = parse_dtype(dtype)
    if override is None:
        raise input_error("dtype", f"unknown dtype `{show(dtype)}`",
                          "use auto, bfloat16, float16 or float32", code="unknown-dtype")
    return override


def _counts(layers: list[tuple[str, ...]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for caches in layers:
        for cache in caches:
            counts[cache] = counts.get(cache, 0) + 1
    return counts


def read_hf_config(
    config: str | os.PathLike[str] | dict[str, Any],
    *,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    dtype: str | None = None,
    device_capability: int | None = None,
    vllm_version: str | None = None,
    disable_sliding_window: bool = False,
) -> ModelReading:
    """Read a model config as vLLM 0.28 / 0.34 read it: the groups one tensor-parallel rank needs.

    ``config`` is a path to ``config.json``, a directory holding one, or an
    already-parsed dict. ``dtype`` is vLLM's ``--dtype`` (None or ``"auto"``: the
    dtype vLLM's auto rules serve, `kvpolicy.policy.hf_dtype`; an explicit dtype
    wins). ``device_capability`` is the CUDA major version those rules consult
    (None: 8.0 or later, where bfloat16 is supported; a CPU decides the same).
    ``vllm_version`` (``"0.28.0"``) is the release read for, where releases read a
    field differently (Qwen3-Next's ``full_attention_interval``: 0.32 on); None
    reads as the newest release does, with a note where that matters.
    ``disable_sliding_window`` is vLLM's ``--disable-sliding-window``: it clears the
    config's window, so sliding layers are cached as full attention.

    Grouping, one `KVCacheGroup` per distinct cache kind, in order of each kind's
    first layer:

    - MLA (``kv_lora_rank`` on a model type vLLM's ``is_deepseek_mla`` lists,
      DeepSeek-V2/V3, Kimi-K2...): one ``mla`` group, one latent head of
      ``kv_lora_rank + qk_rope_head_dim`` (576 on DeepSeek-V3), never split by
      tensor parallelism.
    - sliding-window layers form a ``sliding_window`` group, the rest a ``full`` one.
    - chunked-local layers (Llama-4's RoPE layers with ``attention_chunk_size``)
      form a ``chunked_local`` group: vLLM keeps its hybrid KV cache manager on for
      them by default (``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE`` is 1).
    - Mamba, Gated DeltaNet (linear attention) and short-convolution layers add a
      ``mamba`` group.

    vLLM splits each kind into groups of one size (Gemma-3-27B's 52 sliding and
    10 full layers: 7 groups); here each kind is one group holding all its layers,
    and `KVCacheGroups.count` (a rule's ``groups.count``) is vLLM's number of
    groups, derived from them. The ``mamba`` spec is a stand-in
    for the same reason: one head of the SSM state size (``mamba_d_state`` or
    ``ssm_state_size``, default 16), ``kv_cache_dtype`` auto; its kind drives
    decisions. Its page is vLLM's where the model also has attention: vLLM raises
    the attention block size until one page holds a Mamba state and pads the
    Mamba page to the attention page (`kvpolicy.policy.hybrid_block`, a
    ``hybrid-block-size`` note when the block size changes; the state's bytes from
    `kvpolicy.policy.hf_mamba_state`); every group then has that block size.

    KV heads per rank are ``max(1, total KV heads // tensor_parallel_size)`` (vLLM
    replicates KV heads when there are more ranks than heads); the attention heads
    must divide by ``tensor_parallel_size``, as vLLM requires.

    Not modelled (a `ModelConfigError` says so): speculative-decoding draft models
    and encoder-decoder (cross-attention) models.

    Raises `ModelConfigError` (every config problem at once, located at the
    config's path or ``"<config>"``) and `InputError` for a bad keyword.
    """
    override = _check_keywords(kv_cache_dtype, block_size, tensor_parallel_size, dtype, device_capability,
                               disable_sliding_window)
    release = _release(vllm_version)
    raw, where = _load(config)
    notes: list[Diagnostic] = []
    r = _text_reader(raw, where, notes, release)
    _check_served(r, vllm_version)
    num_layers = r.int_field("num_hidden_layers", required=True, maximum=MAX_LAYERS,
                             help="a decoder's config.json states its layer count in `num_hidden_layers`")
    model_dtype = served_dtype(r, override, device_capability)
    if kv_cache_dtype == "auto" and (from_checkpoint := checkpoint_kv_cache_dtype(r)) is not None:
        kv_cache_dtype = from_checkpoint
        r.warn("checkpoint-kv-cache-dtype", f"kv_cache_dtype auto: the checkpoint's `quantization_config` names "
               f"a {from_checkpoint} KV cache, which vLLM then allocates, and so does kvpolicy",
               "pass kv_cache_dtype= (--kv-cache-dtype) to choose another")
    r.fail_if_any()
    assert num_layers is not None  # INVARIANT: fail_if_any raised otherwise
    common = {"block_size": block_size, "dtype": model_dtype}

    if r.has("kv_lora_rank") and (r.model_type in _MLA_MODEL_TYPES or r.model_type is None):
        lora = r.int_field("kv_lora_rank")
        rope = r.int_field("qk_rope_head_dim", required=True,
                           help="MLA caches the latent and the rope key: add `qk_rope_head_dim`")
        _heads_divide(r, r.int_field("num_attention_heads", required=True,
                                     help="attention models state their query heads in `num_attention_heads`"),
                      tensor_parallel_size)
        r.fail_if_any()
        assert lora is not None and rope is not None
        if r.has("index_topk"):
            r.warn("indexer-not-modelled", f"`{r.name('index_topk')}`: DeepSeek sparse attention, where vLLM adds an "
                   "fp8 indexer key cache (its own MLA spec, uint8) beside each layer's latent; kvpolicy reads the "
                   "latent only", "give the indexer's groups in a --spec file where they matter to the decision")
        groups = _build(r, [{**common, "kind": AttentionKind.mla, "num_layers": num_layers, "num_kv_heads": 1,
                             "head_size": lora + rope, "kv_cache_dtype": kv_cache_dtype}])
        r.say_assumed()
        return ModelReading(groups, ((AttentionKind.mla.value,),) * num_layers, model_dtype, tuple(notes))
    if r.has("kv_lora_rank") and r.model_type not in MAMBA_ONLY:
        r.warn("not-mla", f"`{r.name('kv_lora_rank')}` is set, but vLLM reads only the model types its "
               f"`is_deepseek_mla` lists as MLA, and `{r.model_type}` is not one: read as K/V attention "
               "(head size `qk_nope_head_dim + qk_rope_head_dim` where both are given)",
               "if vLLM caches this model's latent, name its model_type to kvpolicy's maintainers")

    caches = layer_caches(r, num_layers)
    r.fail_if_any()
    assert caches is not None
    if disable_sliding_window:  # vLLM sets hf_text_config.sliding_window = None: no layer keeps a window
        caches = [tuple(LayerCache.full if c is LayerCache.sliding_window else c for c in layer) for layer in caches]
    layers = [tuple(c.value for c in layer) for layer in caches]
    counts = _counts(layers)
    has_attention = any(kind != LayerCache.mamba.value for kind in counts)
    geometry = _attention_geometry(r, tensor_parallel_size) if has_attention else None
    window = None
    if LayerCache.sliding_window.value in counts:
        window = r.int_field("sliding_window", required=True,
                             help="sliding-window layers need `sliding_window`, their window in tokens")
        window = window and window_tokens(r, window)
    state = _mamba_state_size(r) if LayerCache.mamba.value in counts else None
    r.fail_if_any()

    fields = []
    block_size = None
    if LayerCache.mamba.value in counts and geometry is not None:  # attention + Mamba: vLLM raises the block size
        kind = AttentionKind.mla if AttentionKind.mla.value in counts else AttentionKind.full
        block_size = hybrid_block_size(r, kind, geometry, common["block_size"], common["dtype"], kv_cache_dtype,
                                       tensor_parallel_size, rounded=_rounds_hybrid_block(vllm_version))
    common["block_size"] = block_size.block_size if block_size else common["block_size"]
    for kind_name, count in counts.items():
        kind = AttentionKind(kind_name)
        if kind is AttentionKind.mamba:
            assert state is not None
            fields.append({**common, "kind": kind, "num_layers": count, "num_kv_heads": 1,
                           "head_size": state, "kv_cache_dtype": "auto",
                           "page_size_padded": block_size.page_size_bytes if block_size else None})
        else:
            assert geometry is not None
            kv_heads, head_size = geometry
            fields.append({**common, "kind": kind, "num_layers": count, "num_kv_heads": kv_heads,
                           "head_size": head_size, "kv_cache_dtype": kv_cache_dtype,
                           "sliding_window": window if kind is AttentionKind.sliding_window else None})
    groups = _build(r, fields)
    r.say_assumed()
    return ModelReading(groups, tuple(layers), model_dtype, tuple(notes))


def kv_groups_from_hf_config(
    config: str | os.PathLike[str] | dict[str, Any],
    *,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    dtype: str | None = None,
    device_capability: int | None = None,
    vllm_version: str | None = None,
    disable_sliding_window: bool = False,
) -> KVCacheGroups:
    """The KV cache groups one tensor-parallel rank of this model needs (`read_hf_config`'s groups).

    Each note of the reading is issued as a `ModelConfigWarning` (``warnings.warn``),
    so that a caller that wants only the groups still hears what was assumed.
    """
    reading = read_hf_config(config, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                             tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                             device_capability=device_capability, vllm_version=vllm_version,
                             disable_sliding_window=disable_sliding_window)
    for note in reading.notes:
        warnings.warn(ModelConfigWarning(note), stacklevel=2)
    return reading.groups
