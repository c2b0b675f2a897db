"""Hugging Face ``config.json`` -> the KV cache groups a serving engine would build.

Turns the handful of fields that decide a model's KV cache (layer count, KV
heads, head size, model dtype, per-layer attention kind) into `KVCacheGroups`,
so that policy decisions can be made from a checkpoint's config alone, without
torch or the model code. Worked example, Qwen2.5-0.5B (24 layers, 14 heads,
2 KV heads, hidden 896, ``use_sliding_window: false``)::

    head_size = hidden_size // num_attention_heads = 896 // 14 = 64
    one group: kind full, 24 layers, 2 KV heads, head_size 64
    fp8_per_token_head, block 16: page_size_bytes = 2*16*2*(64+4) = 4352

Config problems are collected and reported together in one
`ModelConfigError` (fields others depend on, such as the layer count, are
checked first); a bad keyword (``kv_cache_dtype``, ``block_size``,
``tensor_parallel_size``, ``dtype``) is an `InputError`. No `KeyError`,
`TypeError` or pydantic `ValidationError` escapes for bad input.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvpolicy.policy.errors import Diagnostic, ModelConfigError, input_error
from kvpolicy.policy.files import read_capped
from kvpolicy.policy.quant import KV_CACHE_DTYPES, ModelDtype, parse_kv_cache_dtype
from kvpolicy.policy.spec import MAX_LAYERS, AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec
from kvpolicy.policy.yaml_source import INT64_MAX, INT64_MIN

__all__ = ["kv_groups_from_hf_config"]

_DICT_SOURCE = "<config>"
_CONFIG_NAME = "config.json"

_DTYPE_ALIASES: dict[str, ModelDtype] = {
    "bfloat16": ModelDtype.bfloat16,
    "bf16": ModelDtype.bfloat16,
    "float16": ModelDtype.float16,
    "fp16": ModelDtype.float16,
    "half": ModelDtype.float16,
    "float32": ModelDtype.float32,
    "fp32": ModelDtype.float32,
    "float": ModelDtype.float32,
}

# `layer_types` values written by transformers (Gemma-3, gpt-oss, Qwen3, Qwen3-Next,
# Granite-4 hybrids, LFM2). Recurrent layers (Mamba, linear attention, short conv)
# keep a state instead of paged K/V, which is all the policy needs to know.
_LAYER_TYPES: dict[str, AttentionKind] = {
    "full_attention": AttentionKind.full,
    "attention": AttentionKind.full,
    "sliding_attention": AttentionKind.sliding_window,
    "mamba": AttentionKind.mamba,
    "mamba2": AttentionKind.mamba,
    "linear_attention": AttentionKind.mamba,
    "conv": AttentionKind.mamba,
}

# NemotronH's `hybrid_override_pattern`: one character a layer; MLP and MoE
# layers ("-", "E") hold no cache at all.
_NEMOTRON_PATTERN: dict[str, AttentionKind | None] = {
    "M": AttentionKind.mamba,
    "*": AttentionKind.full,
    "-": None,
    "E": None,
}

_LAYERS_BLOCK_TYPE: dict[str, AttentionKind] = {"attention": AttentionKind.full, "mamba": AttentionKind.mamba}

_DEFAULT_MAMBA_STATE = 16

LayerKinds = list[AttentionKind | None]


def _show(value: Any) -> str:
    """User input as it appeared in JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Reader:
    """Typed access to one config mapping that records every problem instead of raising.

    ``prefix`` is ``"text_config."`` when the text model's fields are nested, so
    messages name the field as it is spelled in the file.
    """

    def __init__(self, cfg: Mapping[str, Any], top: Mapping[str, Any], where: str, prefix: str) -> None:
        self.cfg, self.top, self.where, self.prefix = cfg, top, where, prefix
        self.diagnostics: list[Diagnostic] = []

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def get(self, key: str) -> Any:
        """The value, with JSON ``null`` read as absent (configs write both)."""
        return self.cfg.get(key)

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def error(self, code: str, message: str, help: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(self.where, 0, 0, code, message, help))

    def missing(self, key: str, help: str) -> None:
        self.error("missing-field", f"missing field `{self.name(key)}`", help)

    def invalid(self, key: str, message: str, help: str | None = None) -> None:
        self.error("invalid-field", message, help or f"fix `{self.name(key)}` in the model's config.json")

    def int_field(self, key: str, *, minimum: int = 1, maximum: int = 1 << 24, required: bool = False,
                  help: str = "") -> int | None:
        """An integer in [``minimum``, ``maximum``]; None (and a diagnostic where due) otherwise."""
        value = self.get(key)
        if value is None:
            if required:
                self.missing(key, help or f"add `{self.name(key)}` to the model's config.json")
            return None
        if not _is_int(value) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            self.invalid(key, f"`{self.name(key)}` must be {what}, got `{_show(value)}`")
            return None
        if value > maximum:
            self.invalid(key, f"`{self.name(key)}` is {value}, over the sanity bound of {maximum}")
            return None
        return value

    def fail_if_any(self) -> None:
        if self.diagnostics:
            raise ModelConfigError("invalid model config", self.diagnostics)


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
    if isinstance(raw_path, bytes) or "\0" in raw_path:
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
        data = json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)
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


def _no_constant(literal: str) -> float:
    raise _BadNumber(literal, "not a number JSON allows (NaN and Infinity are JavaScript, not JSON)")


def _offset_position(text: str, literal: str) -> tuple[int, int]:
    at = max(text.find(literal), 0)
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


def _short(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:12]}...{text[-6:]} ({len(text)} characters)"


def _text_reader(raw: Mapping[str, Any], where: str) -> _Reader:
    """Read the text model's fields: top level, or ``text_config`` for multimodal models."""
    top = _Reader(raw, raw, where, "")
    if top.has("num_hidden_layers"):
        return top
    nested = raw.get("text_config")
    if nested is None:
        return top
    if not isinstance(nested, Mapping):
        top.invalid("text_config", f"`text_config` must be an object, got `{_show(nested)}`")
        top.fail_if_any()
    return _Reader(nested, raw, where, "text_config.")


def _parse_dtype(value: Any) -> ModelDtype | None:
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.lower().removeprefix("torch."))
    return None


def _config_dtype(r: _Reader) -> ModelDtype:
    """The model dtype: ``torch_dtype`` (or transformers 5's ``dtype``), text config first."""
    places = [(r.cfg, r.prefix)] + ([(r.top, "")] if r.prefix else [])
    for cfg, prefix in places:
        for key in ("torch_dtype", "dtype"):
            value = cfg.get(key)
            if value is None:
                continue
            parsed = _parse_dtype(value)
            if parsed is None:
                r.error("invalid-field", f"`{prefix}{key}` is `{_show(value)}`, not a dtype K/V are computed in",
                        "use bfloat16, float16 or float32, or pass dtype= to override it")
                return ModelDtype.bfloat16
            return parsed
    return ModelDtype.bfloat16


def _check_length(r: _Reader, key: str, items: Any, num_layers: int) -> bool:
    if len(items) != num_layers:
        r.invalid(key, f"`{r.name(key)}` has {len(items)} entries but `{r.name('num_hidden_layers')}` "
                       f"is {num_layers}", "give one entry per hidden layer")
        return False
    return True


def _from_table(r: _Reader, key: str, num_layers: int, table: Mapping[str, AttentionKind | None],
                *, chars: bool = False) -> LayerKinds | None:
    """Per-layer kinds from a list of names (or a string of characters) looked up in ``table``."""
    items = r.get(key)
    if not (isinstance(items, str) if chars else isinstance(items, list)):
        want = "a string" if chars else "a list of strings"
        r.invalid(key, f"`{r.name(key)}` must be {want}, got `{_show(items)}`")
        return None
    if not _check_length(r, key, items, num_layers):
        return None
    kinds: LayerKinds = []
    for i, item in enumerate(items):
        if not isinstance(item, str) or item not in table:
            known = ", ".join(f"`{k}`" for k in table)
            r.invalid(key, f"`{r.name(key)}[{i}]` is `{_show(item)}`, which is not a known layer type",
                      f"known values: {known}")
            return None
        kinds.append(table[item])
    return kinds


def _jamba_kinds(r: _Reader, num_layers: int) -> LayerKinds | None:
    """Jamba: layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset``."""
    period = r.int_field("attn_layer_period", required=True)
    offset = r.int_field("attn_layer_offset", minimum=0)
    if period is None or (offset is None and r.has("attn_layer_offset")):
        return None
    offset = offset or 0
    if offset >= period:
        r.invalid("attn_layer_offset", f"`{r.name('attn_layer_offset')}` ({offset}) must be smaller than "
                                       f"`{r.name('attn_layer_period')}` ({period})")
        return None
    return [AttentionKind.full if i % period == offset else AttentionKind.mamba for i in range(num_layers)]


def _sliding_kinds(r: _Reader, num_layers: int) -> LayerKinds | None:
    """Attention-only models without `layer_types`: which layers use a sliding window.

    - ``use_sliding_window: false`` (Qwen2/2.5): full attention everywhere, whatever
      ``sliding_window`` says.
    - ``sliding_window_pattern`` p (Gemma-3, Cohere2): every p-th layer is full, the rest slide.
    - ``model_type: gemma2``: the same with p = 2 (its config states no pattern).
    - ``use_sliding_window: true`` (Qwen2): layers from ``max_window_layers`` on slide.
    - otherwise a ``sliding_window`` (Mistral-7B v0.1) slides on every layer.
    """
    full = AttentionKind.full
    use = r.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        r.invalid("use_sliding_window", f"`{r.name('use_sliding_window')}` must be true or false, "
                                        f"got `{_show(use)}`")
        return None
    if use is False or not r.has("sliding_window"):
        return [full] * num_layers
    slide = AttentionKind.sliding_window
    pattern: int | None = 2 if r.get("model_type") == "gemma2" else None
    if r.has("sliding_window_pattern"):
        pattern = r.int_field("sliding_window_pattern")
        if pattern is None:
            return None
    if pattern is not None:
        return [slide if (i + 1) % pattern else full for i in range(num_layers)]
    if use is True and r.has("max_window_layers"):
        first = r.int_field("max_window_layers", minimum=0)
        if first is None:
            return None
        return [slide if i >= first else full for i in range(num_layers)]
    return [slide] * num_layers


def _layer_kinds(r: _Reader, num_layers: int) -> LayerKinds | None:
    """Each layer's cache kind (None: no cache), from the first source the config has."""
    sources: list[tuple[str, Callable[[], LayerKinds | None]]] = [
        ("layer_types", lambda: _from_table(r, "layer_types", num_layers, _LAYER_TYPES)),
        ("hybrid_override_pattern",
         lambda: _from_table(r, "hybrid_override_pattern", num_layers, _NEMOTRON_PATTERN, chars=True)),
        ("layers_block_type", lambda: _from_table(r, "layers_block_type", num_layers, _LAYERS_BLOCK_TYPE)),
        ("attn_layer_period", lambda: _jamba_kinds(r, num_layers)),
        ("attn_layer_offset", lambda: _jamba_kinds(r, num_layers)),
    ]
    for key, read in sources:
        if r.has(key):
            kinds = read()
            if kinds is not None and all(kind is None for kind in kinds):
                r.invalid(key, f"`{r.name(key)}` gives no layer a KV cache or a Mamba state",
                          "a model needs at least one attention or Mamba layer")
                return None
            return kinds
    return _sliding_kinds(r, num_layers)


def _attention_geometry(r: _Reader, tp: int) -> tuple[int, int] | None:
    """(KV heads on this rank, head size) for the attention layers."""
    heads = r.int_field("num_attention_heads", required=True,
                        help="attention models state their query heads in `num_attention_heads`")
    kv_heads = r.int_field("num_key_value_heads") if r.has("num_key_value_heads") else heads
    head_dim = r.int_field("head_dim")
    if head_dim is None and not r.has("head_dim"):
        hidden = r.int_field("hidden_size", required=True,
                             help="add `head_dim`, or `hidden_size` to derive it from")
        if hidden is not None and heads is not None:
            if hidden % heads:
                r.invalid("hidden_size", f"`{r.name('hidden_size')}` ({hidden}) is not divisible by "
                                         f"`{r.name('num_attention_heads')}` ({heads})",
                          f"add `{r.name('head_dim')}` to state the head size explicitly")
            else:
                head_dim = hidden // heads
    if heads is not None and kv_heads is not None and heads % kv_heads:
        r.invalid("num_key_value_heads", f"`{r.name('num_attention_heads')}` ({heads}) is not divisible by "
                                         f"`{r.name('num_key_value_heads')}` ({kv_heads})",
                  "grouped-query attention shares each KV head among a whole number of query heads")
    if kv_heads is not None and tp > 1:
        if (tp < kv_heads and kv_heads % tp) or (tp > kv_heads and tp % kv_heads):
            r.error("invalid-field",
                    f"`tensor_parallel_size` {tp} does not fit `{r.name('num_key_value_heads')}` ({kv_heads})",
                    "tensor_parallel_size must divide the KV heads, or be a multiple of them "
                    "(then each KV head is replicated)")
    if r.diagnostics or kv_heads is None or head_dim is None:
        return None
    # vLLM replicates KV heads when there are more ranks than heads: one per rank.
    return max(1, kv_heads // tp), head_dim


def _mamba_state_size(r: _Reader) -> int:
    """The Mamba stand-in's head size: the SSM state size, which is positive."""
    for key in ("mamba_d_state", "ssm_state_size"):
        if r.has(key):
            return r.int_field(key) or _DEFAULT_MAMBA_STATE
    return _DEFAULT_MAMBA_STATE


def _build(r: _Reader, fields: list[dict[str, Any]]) -> KVCacheGroups:
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


def _check_keywords(kv_cache_dtype: str, block_size: int, tensor_parallel_size: int,
                    dtype: str | None) -> ModelDtype | None:
    """Validate the keyword inputs (`InputError`); return the dtype override, if any."""
    if not isinstance(kv_cache_dtype, str):
        raise input_error("kv_cache_dtype", f"`kv_cache_dtype` must be a string, got `{_show(kv_cache_dtype)}`",
                          f"valid values: {', '.join(KV_CACHE_DTYPES)}")
    parse_kv_cache_dtype(kv_cache_dtype, ModelDtype.bfloat16)  # raises InputError with a did-you-mean
    for name, value in (("block_size", block_size), ("tensor_parallel_size", tensor_parallel_size)):
        if not _is_int(value) or value < 1:
            raise input_error(name, f"`{name}` must be a positive integer, got `{_show(value)}`")
    if dtype is None or dtype == "auto":
        return None
    override = _parse_dtype(dtype)
    if override is None:
        raise input_error("dtype", f"unknown dtype `{_show(dtype)}`",
                          "use auto, bfloat16, float16 or float32", code="unknown-dtype")
    return override


def kv_groups_from_hf_config(
    config: str | os.PathLike[str] | dict[str, Any],
    *,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    dtype: str | None = None,
) -> KVCacheGroups:
    """The KV cache groups one tensor-parallel rank of this model needs.

    ``config`` is a path to ``config.json``, a directory holding one, or an
    already-parsed dict. Multimodal configs (Gemma-3, Llama-4, Qwen2.5-VL) are
    read from ``text_config`` when the top level has no ``num_hidden_layers``.
    ``dtype`` overrides the config's ``torch_dtype`` (``"auto"`` keeps it).

    Grouping, one `KVCacheGroup` per distinct layer kind, in order of each
    kind's first layer:

    - MLA (``kv_lora_rank`` present, DeepSeek-V2/V3): one ``mla`` group, one
      latent head of ``kv_lora_rank + qk_rope_head_dim`` (576 on DeepSeek-V3),
      never split by tensor parallelism.
    - sliding-window layers (``layer_types``, ``sliding_window_pattern``, or
      ``sliding_window`` unless ``use_sliding_window`` is false) form a
      ``sliding_window`` group, the rest a ``full`` one.
    - Mamba hybrids (Jamba's ``attn_layer_period``/``attn_layer_offset``,
      ``layers_block_type``, NemotronH's ``hybrid_override_pattern``, or
      ``mamba``/``linear_attention`` in ``layer_types``) add a ``mamba`` group.

    vLLM balances hybrid groups to equal sizes (gpt-oss: 12 groups of 2
    layers); here each kind is one group holding all its layers, which is what
    the policy needs: the number of groups and their kinds. The ``mamba``
    spec is a stand-in for the same reason: one head of the SSM state size
    (``mamba_d_state`` or ``ssm_state_size``, default 16), ``kv_cache_dtype``
    auto; its kind drives decisions, its bytes mean nothing.

    KV heads per rank are ``num_key_value_heads // tensor_parallel_size``, at
    least 1 (vLLM replicates KV heads when there are more ranks than heads).

    Raises `ModelConfigError` (every config problem at once, located at the
    config's path or ``"<config>"``) and `InputError` for a bad keyword.
    """
    override = _check_keywords(kv_cache_dtype, block_size, tensor_parallel_size, dtype)
    raw, where = _load(config)
    r = _text_reader(raw, where)
    num_layers = r.int_field("num_hidden_layers", required=True, maximum=MAX_LAYERS,
                             help="a decoder's config.json states its layer count in `num_hidden_layers`")
    model_dtype = override or _config_dtype(r)
    r.fail_if_any()
    assert num_layers is not None  # INVARIANT: fail_if_any raised otherwise
    common = {"block_size": block_size, "dtype": model_dtype}

    if r.has("kv_lora_rank"):
        lora = r.int_field("kv_lora_rank")
        rope = r.int_field("qk_rope_head_dim", required=True,
                           help="MLA caches the latent and the rope key: add `qk_rope_head_dim`")
        r.fail_if_any()
        assert lora is not None and rope is not None
        return _build(r, [{**common, "kind": AttentionKind.mla, "num_layers": num_layers, "num_kv_heads": 1,
                           "head_size": lora + rope, "kv_cache_dtype": kv_cache_dtype}])

    kinds = _layer_kinds(r, num_layers)
    r.fail_if_any()
    assert kinds is not None
    counts: dict[AttentionKind, int] = {}
    for kind in kinds:
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    has_attention = any(kind.is_attention for kind in counts)
    geometry = _attention_geometry(r, tensor_parallel_size) if has_attention else None
    window = None
    if AttentionKind.sliding_window in counts:
        window = r.int_field("sliding_window", required=True,
                             help="sliding-window layers need `sliding_window`, their window in tokens")
    state = _mamba_state_size(r) if AttentionKind.mamba in counts else None
    r.fail_if_any()

    fields = []
    for kind, count in counts.items():
        if kind is AttentionKind.mamba:
            assert state is not None
            fields.append({**common, "kind": kind, "num_layers": count, "num_kv_heads": 1,
                           "head_size": state, "kv_cache_dtype": "auto"})
        else:
            assert geometry is not None
            kv_heads, head_size = geometry
            fields.append({**common, "kind": kind, "num_layers": count, "num_kv_heads": kv_heads,
                           "head_size": head_size, "kv_cache_dtype": kv_cache_dtype,
                           "sliding_window": window if kind is AttentionKind.sliding_window else None})
    return _build(r, fields)
