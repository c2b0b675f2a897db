"""Typed, located access to one Hugging Face config mapping, with its config class's defaults.

vLLM never reads ``config.json`` raw: transformers builds the model type's config
class first, so a field the file leaves out takes that class's default (Gemma-3's
``text_config`` usually states neither its heads nor its ``head_dim``: 8 heads, 4 KV
heads, head size 256 come from ``Gemma3TextConfig``). `CLASS_DEFAULTS` holds those
defaults for the fields kvpolicy reads, as transformers 5.22.2 (the release vLLM
0.28.0 and 0.34.0 are installed with) defines them; a default that transformers
computes from other fields (Llama's ``head_dim = hidden_size // num_attention_heads``)
is computed by the reader's caller, not listed. A JSON ``null`` is kept as null:
it is not the default (Qwen2's ``"sliding_window": null`` means no window).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvpolicy.policy.errors import Diagnostic, ModelConfigError

__all__ = ["CLASS_DEFAULTS", "ConfigReader", "is_int", "show"]

# model_type -> ((num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_size), others):
# the constant defaults of transformers 5.22.2's config classes (`_`: none, or computed from other fields),
# read off the classes by instantiating each with other inputs and keeping what did not change
_ = None
_MAMBA2 = {"mamba_expand": 2, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_n_heads": 128}  # Bamba's, Granite's...
_COMMON = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
_TABLE: dict[str, tuple[tuple[int | None, ...], dict[str, Any]]] = {
    "llama": ((32, 32, _, _, 4096), {}),
    "mistral": ((32, 32, 8, _, 4096), {"sliding_window": 4096}),
    "mixtral": ((32, 32, 8, _, 4096), {}),
    "qwen2": ((32, 32, 32, _, 4096), {"use_sliding_window": False, "max_window_layers": 28}),
    "qwen2_moe": ((24, 16, 16, _, 2048), {"sliding_window": 0, "use_sliding_window": False, "max_window_layers": 28}),
    "qwen3": ((32, 32, 32, 128, 4096), {"use_sliding_window": False, "max_window_layers": 28}),
    "qwen3_moe": ((24, 32, 4, _, 2048), {"use_sliding_window": False}),
    "qwen3_next": ((48, 16, 2, 256, 2048), {"full_attention_interval": 4, "linear_num_key_heads": 16,
                                            "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                                            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}),
    "gemma": ((28, 16, 16, 256, 3072), {}),
    "gemma2": ((26, 8, 4, 256, 2304), {"sliding_window": 4096}),
    "gemma3_text": ((26, 8, 4, 256, 2304), {"sliding_window": 4096, "sliding_window_pattern": 6}),
    "cohere2": ((40, 64, _, _, 8192), {"sliding_window": 4096, "sliding_window_pattern": 4}),
    "exaone4": ((32, 32, 32, _, 4096), {"sliding_window": 4096, "sliding_window_pattern": 4}),
    "gpt_oss": ((36, 64, 8, 64, 2880), {"sliding_window": 128}),
    "llama4_text": ((48, 40, 8, 128, 5120), {"attention_chunk_size": 8192, "no_rope_layer_interval": 4}),
    "deepseek_v2": ((32, 32, _, 64, 4096), {"kv_lora_rank": 512, "qk_rope_head_dim": 64}),
    "deepseek_v3": ((61, 128, 128, 64, 7168), {"kv_lora_rank": 512, "qk_rope_head_dim": 64}),
    "jamba": ((32, 32, 8, _, 4096), {"attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
                                     "mamba_expand": 2, "mamba_d_conv": 4}),
    "bamba": ((32, 32, 8, _, 4096), {"mamba_d_state": 256, **_MAMBA2}),
    "nemotron_h": ((4, 32, 8, 128, 4096), {"ssm_state_size": 128, "n_groups": 8, "mamba_num_heads": 128,
                                           "mamba_head_dim": 64, "conv_kernel": 4}),
    "granitemoehybrid": ((32, 32, 32, _, 4096), {"mamba_d_state": 256, **_MAMBA2}),
    "falcon_h1": ((32, 32, 8, _, 4096), {"mamba_d_state": 256, "mamba_d_ssm": 1024, **_MAMBA2}),
    "zamba2": ((54, 32, 32, _, 2560), {"mamba_d_state": 64, "mamba_expand": 2, "mamba_d_conv": 4, "mamba_ngroups": 1,
                                       "n_mamba_heads": 8}),
    "lfm2": ((32, 32, 8, _, 2560), {}),
    "phi3": ((32, 32, _, _, 3072), {}),
    "glm4": ((40, 32, 2, 128, 4096), {}),
    "starcoder2": ((30, 24, 2, _, 3072), {}),
    "olmo2": ((32, 32, _, _, 4096), {}),
}
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    model_type: {**{k: v for k, v in zip(_COMMON, common, strict=True) if v is not None}, **others}
    for model_type, (common, others) in _TABLE.items()
}


def show(value: Any) -> str:
    """User input as it appeared in JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ConfigReader:
    """Typed access to one config mapping that records every problem instead of raising.

    ``prefix`` is ``"text_config."`` when the text model's fields are nested, so
    messages name the field as it is spelled in the file. ``model_type`` selects the
    `CLASS_DEFAULTS` a field the file leaves out takes. ``notes`` collects warnings:
    what was assumed where the config did not say. ``release`` is the vLLM version
    read for, where releases read a field differently.
    """

    def __init__(self, cfg: Mapping[str, Any], top: Mapping[str, Any], where: str, prefix: str,
                 model_type: str | None, notes: list[Diagnostic] | None = None,
                 release: tuple[int, ...] | None = None) -> None:
        self.cfg, self.top, self.where, self.prefix = cfg, top, where, prefix
        self.model_type = model_type
        self.release = release  # the vLLM release read for, (0, 28, 0); None: not said
        self.defaults = CLASS_DEFAULTS.get(model_type or "", {})
        self.diagnostics: list[Diagnostic] = []
        self.notes: list[Diagnostic] = [] if notes is None else notes
        self.assumed: dict[str, Any] = {}  # field -> the class default read for it (the file left it out)

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def get(self, key: str) -> Any:
        """The value; the config class's default when the key is absent; JSON ``null`` as None."""
        if key in self.cfg:
            return self.cfg[key]
        if key in self.defaults:
            self.assumed.setdefault(key, self.defaults[key])
        return self.defaults.get(key)

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def error(self, code: str, message: str, help: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(self.where, 0, 0, code, message, help))

    def warn(self, code: str, message: str, help: str | None = None) -> None:
        """Say what was assumed (a `Diagnostic` in `notes`, never raised)."""
        self.notes.append(Diagnostic(self.where, 0, 0, code, message, help))

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
        if not is_int(value) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            self.invalid(key, f"`{self.name(key)}` must be {what}, got `{show(value)}`")
            return None
        if value > maximum:
            self.invalid(key, f"`{self.name(key)}` is {value}, over the sanity bound of {maximum}")
            return None
        return value

    def int_list(self, key: str, *, below: int) -> list[int] | None:
        """A list of integers in [0, ``below``) (layer indices); None (and a diagnostic) otherwise."""
        items = self.get(key)
        if not isinstance(items, list) or not all(is_int(i) and 0 <= i < below for i in items):
            self.invalid(key, f"`{self.name(key)}` must be a list of layer indices below {below}, "
                              f"got `{show(items)}`")
            return None
        return items

    def say_assumed(self) -> None:
        """One note naming every field read from the config class's defaults, with its value, when the layer
        count or the hidden size is among them: a config that leaves out its size (only ``architectures`` and
        ``model_type``) is decided as that class's defaults describe a model, which is what vLLM loads, but
        likely not the checkpoint's. (Gemma-3's configs leave out their heads, and the class states them.)"""
        if not {"num_hidden_layers", "hidden_size"} & self.assumed.keys():
            return  # the model's size stated: the rest (Gemma-3's heads, a window pattern) is the class's own
        shown = ", ".join(f"`{self.name(k)}` {show(v)}" for k, v in self.assumed.items())
        self.warn("class-defaults", f"the config leaves out {len(self.assumed)} field(s) read from the defaults of "
                  f"transformers' `{self.model_type}` config class, as vLLM reads it: {shown}",
                  "state these fields in config.json as the checkpoint has them (its weights fix them)")

    def fail_if_any(self) -> None:
        if self.diagnostics:
            raise ModelConfigError("invalid model config", self.diagnostics)
