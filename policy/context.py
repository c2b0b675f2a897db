"""The decision context and the field paths rules may test.

`FIELDS` is the single registry of every path a condition can name, with its
type and meaning. Validation, evaluation, the docs and the JSON Schema all
read it, so the rule language cannot drift from the models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Any

from pydantic import Field, model_validator

from kvpolicy.policy.backends import BackendProfile, ScaleViews
from kvpolicy.policy.connectors import KNOWN_CONNECTORS, ConnectorConfig
from kvpolicy.policy.cpu_kernel import CpuHost
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.quant import KV_CACHE_DTYPES, CacheDtype, ModelDtype, QuantMode
from kvpolicy.policy.releases import profile_names
from kvpolicy.policy.spec import AttentionKind, Frozen, KVCacheGroups, KVCacheSpec

__all__ = ["EXTRA_PREFIX", "FIELDS", "MISSING", "Context", "FieldSpec", "VllmOptions", "field_spec"]

EXTRA_PREFIX = "connector.extra."


class _Missing:
    """A field with no value here (no connector, an absent extra key)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<missing>"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


@dataclass(frozen=True)
class FieldSpec:
    """One testable path: its value type, its closed domain if any, and its meaning."""

    path: str
    type: str  # "bool" | "int" | "str" | "scalar"
    description: str
    get: Callable[[Context, ConnectorConfig | None], Any]
    choices: tuple[str, ...] | None = None  # closed domain of a "str" field
    nullable: bool = False

    @property
    def type_label(self) -> str:
        label = {"bool": "boolean", "int": "integer", "str": "string", "scalar": "string | number | boolean"}[
            self.type
        ]
        if self.choices is not None and len(self.choices) <= 12:
            label = "one of " + ", ".join(self.choices)
        return label + (" (may be absent)" if self.nullable else "")


def _enum(cls: type[Enum]) -> tuple[str, ...]:
    return tuple(m.value for m in cls)


def _kv(attr: str) -> Callable[[Context, ConnectorConfig | None], Any]:
    def get(ctx: Context, _c: ConnectorConfig | None) -> Any:
        value = getattr(ctx.kv, attr)
        return value.value if isinstance(value, Enum) else value

    return get


def _conn(fn: Callable[[ConnectorConfig], Any], absent: Any = MISSING) -> Callable[[Context, Any], Any]:
    return lambda _ctx, c: absent if c is None else fn(c)


def _prefers_cross_layer_blocks(c: ConnectorConfig) -> Any:
    """Given; else, for a composite, all of its members' (vLLM's MultiConnector: false once one member's
    is false, absent while one is unknown); else absent for a connector a release registers (its
    connector file's rules say when it prefers); else KVConnectorBase_V1's default, false."""
    if c.prefers_cross_layer_blocks is not None:
        return c.prefers_cross_layer_blocks
    if c.is_composite:
        members = [_prefers_cross_layer_blocks(m) for m in c.connectors]
        if any(v is False for v in members):
            return False
        return True if all(v is True for v in members) else MISSING
    return MISSING if c.name in KNOWN_CONNECTORS else False


_FIELD_LIST: tuple[FieldSpec, ...] = (
    FieldSpec("kv.kind", "str", "what the (first) KV cache group stores", _kv("kind"), _enum(AttentionKind)),
    FieldSpec("kv.kv_cache_dtype", "str", "vLLM's `kv_cache_dtype` string", _kv("kv_cache_dtype"), KV_CACHE_DTYPES),
    FieldSpec("kv.quant_mode", "str", "quantization mode derived from kv_cache_dtype", _kv("quant_mode"),
              _enum(QuantMode)),
    FieldSpec("kv.per_token_head", "bool", "a per-token-head mode: inline fp32 scale at the tail of every cell",
              _kv("per_token_head")),
    FieldSpec("kv.quant_bits", "int", "bits per stored value; absent when unquantized",
              lambda ctx, _c: ctx.kv.quant_mode.bits if ctx.kv.quant_mode.bits is not None else MISSING,
              nullable=True),
    FieldSpec("kv.dtype", "str", "the model's compute dtype", _kv("dtype"), _enum(ModelDtype)),
    FieldSpec("kv.cache_dtype", "str", "element type of the cache tensor", _kv("cache_dtype"), _enum(CacheDtype)),
    FieldSpec("kv.num_layers", "int", "layers in the (first) group (L)", _kv("num_layers")),
    FieldSpec("kv.block_size", "int", "tokens per block (N)", _kv("block_size")),
    FieldSpec("kv.num_kv_heads", "int", "KV heads per layer (H)", _kv("num_kv_heads")),
    FieldSpec("kv.head_size", "int", "values per head (D)", _kv("head_size")),
    FieldSpec("kv.sliding_window", "int", "sliding window in tokens; absent for full attention",
              lambda ctx, _c: ctx.kv.sliding_window if ctx.kv.sliding_window is not None else MISSING,
              nullable=True),
    FieldSpec("kv.cell_bytes", "int", "bytes of one (token, head) cell, inline scale included", _kv("cell_bytes")),
    FieldSpec("kv.page_size_bytes", "int", "one layer's bytes for one block, padding included",
              _kv("page_size_bytes")),
    FieldSpec("groups.count", "int", "number of KV cache groups as vLLM's engine makes them "
              "(`len(kv_cache_config.kv_cache_groups)`): each kind of layer split into groups of one size, so "
              "Gemma-3-27B's 52 sliding + 10 full layers are 7 groups; vLLM's checks read whether it is 1",
              lambda ctx, _c: ctx.groups.count),
    FieldSpec("groups.attention_groups", "int", "attention groups summed over vLLM's KV cache groups",
              lambda ctx, _c: ctx.groups.attention_groups),
    FieldSpec("groups.has_mamba", "bool", "some group is a Mamba (state) group", lambda ctx, _c: ctx.groups.has_mamba),
    FieldSpec("groups.has_sliding_window", "bool", "some group is a sliding-window attention group",
              lambda ctx, _c: ctx.groups.has_sliding_window),
    FieldSpec("backend.name", "str", "attention backend (vLLM's enum name)", lambda ctx, _c: ctx.backend.name),
    FieldSpec("backend.mla", "bool", "an MLA backend: one latent per token, no head dim",
              lambda ctx, _c: ctx.backend.mla),
    FieldSpec("backend.indexes_kv_by_block_stride", "bool",
              "the block dim is outermost in the backend's cross-layer physical order",
              lambda ctx, _c: ctx.backend.indexes_kv_by_block_stride),
    FieldSpec("backend.scale_views", "str", "how the backend builds its inline-scale views",
              lambda ctx, _c: ctx.backend.scale_views.value, _enum(ScaleViews)),
    FieldSpec("backend.supports_hnd", "bool", "the backend has an HND (head-major) geometry",
              lambda ctx, _c: ctx.backend.supports_hnd),
    FieldSpec("vllm.profile", "str", "the vLLM release profile deciding (e.g. `vllm-0.34`)",
              lambda ctx, _c: ctx.profile, profile_names()),
    FieldSpec("env.VLLM_KV_CACHE_LAYOUT", "str",
              "vLLM's `VLLM_KV_CACHE_LAYOUT` override (a layout name, or the aliases NHD/HND); absent when unset",
              lambda ctx, _c: ctx.options.kv_cache_layout if ctx.options.kv_cache_layout is not None else MISSING,
              (*(x.value for x in Layout), "NHD", "HND"), nullable=True),
    FieldSpec("cache.enable_extensible_kv_cache", "bool", "vLLM's `enable_extensible_kv_cache`",
              lambda ctx, _c: ctx.options.enable_extensible_kv_cache),
    FieldSpec("attention.hisparse", "bool", "a HiSparse config is set (`attention_config.hisparse_config`)",
              lambda ctx, _c: ctx.options.hisparse),
    FieldSpec("worker.use_v2_model_runner", "bool",
              "the workers run vLLM's model runner V2 (`VllmConfig.use_v2_model_runner`; 0.28 defaults to it on "
              "GPUs for non-MoE models, `VLLM_USE_V2_MODEL_RUNNER` overrides)",
              lambda ctx, _c: ctx.options.use_v2_model_runner),
    FieldSpec("platform.device_capability", "int",
              "the CUDA device capability's major number (9 for Hopper, 10 for Blackwell); absent when unknown",
              lambda ctx, _c: ctx.options.device_capability if ctx.options.device_capability is not None
              else MISSING, nullable=True),
    FieldSpec("groups.mixed_hnc_shapes", "bool",
              "the attention specs differ in (heads, tokens per block, page bytes): vLLM then needs a "
              "block-compact layout", lambda ctx, _c: ctx.groups.mixed_hnc_shapes),
    FieldSpec("groups.dcp_mixed_page_sizes", "bool",
              "DCP-sharded and replicated attention specs with different page sizes (a replicated draft "
              "model under decode context parallelism)", lambda ctx, _c: ctx.groups.dcp_mixed_page_sizes),
    FieldSpec("connector.present", "bool", "a KV connector is configured (in a connector file: always true)",
              _conn(lambda c: True, absent=False)),
    FieldSpec("connector.name", "str", "the connector's class name", _conn(lambda c: c.name),
              tuple(sorted(KNOWN_CONNECTORS)), nullable=True),
    FieldSpec("connector.composite", "bool", "the connector has member connectors (MultiConnector)",
              _conn(lambda c: c.is_composite, absent=False)),
    FieldSpec("connector.members", "int", "number of member connectors", _conn(lambda c: len(c.connectors), 0)),
    FieldSpec("connector.prefers_cross_layer_blocks", "bool",
              "the connector object's own `prefer_cross_layer_blocks`, which vLLM 0.24-0.28's gate asks (the plugin "
              "reads it from a connector vLLM loads by `kv_connector_module_path`; "
              "`connector_prefers_cross_layer_blocks` on the CLI and in the library); not given: a composite's is "
              "all of its members' (absent while one is unknown), a connector no vLLM release registers has "
              "KVConnectorBase_V1's default (false), and a registered one none (its connector file's rules say "
              "when it prefers)",
              _conn(lambda c: _prefers_cross_layer_blocks(c)), nullable=True),
)

FIELDS: dict[str, FieldSpec] = {f.path: f for f in _FIELD_LIST}

_EXTRA_SPEC_DOC = "a key of vLLM's `kv_connector_extra_config`; absent when not set"


def field_spec(path: str) -> FieldSpec | None:
    """The spec of ``path``, including the open family ``connector.extra.<key>``."""
    spec = FIELDS.get(path)
    if spec is None and path.startswith(EXTRA_PREFIX) and len(path) > len(EXTRA_PREFIX):
        key = path[len(EXTRA_PREFIX):]
        spec = FieldSpec(path, "scalar", _EXTRA_SPEC_DOC, _conn(lambda c: c.extra.get(key, MISSING)), nullable=True)
    return spec


class VllmOptions(Frozen):
    """vLLM settings the layout decision reads, named as vLLM names them."""

    kv_cache_layout: str | None = Field(default=None, description="`VLLM_KV_CACHE_LAYOUT`")
    enable_extensible_kv_cache: bool = False
    hisparse: bool = Field(default=False, description="`attention_config.hisparse_config` is set")
    use_v2_model_runner: bool = Field(default=False, description="`VllmConfig.use_v2_model_runner`")
    device_capability: int | None = Field(default=None, description="CUDA capability major (FlashInfer reads it)")
    cpu_host: CpuHost | None = Field(default=None, description="the CPU vLLM's CPU attention kernel runs on, "
                                     "which orders a block's bytes (`_get_attn_isa`); None: this machine's")


class Context(Frozen):
    """Everything a rule can see: the KV spec, its groups, the backend, the connector, vLLM's settings.

    ``groups`` defaults to one group holding ``kv``. ``connector`` None means no
    KV connector is configured. ``candidates`` are the layouts the release has
    and every backend of every worker supports, most preferred first (the
    tie-break order); ``profile`` names the release profile they come from.
    ``backend`` is the backend whose geometry is planned (the first worker's
    first); ``worker_backends`` every worker's backends when there are several.
    """

    kv: KVCacheSpec
    groups: KVCacheGroups | None = None
    backend: BackendProfile
    connector: ConnectorConfig | None = None
    profile: str = "issue-48412"
    candidates: tuple[Layout, ...] = (Layout.LBNHC, Layout.LBHNC, Layout.BLNHC, Layout.BHLNC)
    options: VllmOptions = VllmOptions()
    worker_backends: tuple[tuple[str, ...], ...] | None = Field(
        default=None, description="each worker's attention backends (pipeline stages may differ), whose "
        "merged `supported_kv_cache_layouts()` are the candidates; None: one worker with `backend`")

    @model_validator(mode="after")
    def _default_groups(self) -> Context:
        if self.groups is None:
            object.__setattr__(self, "groups", KVCacheGroups.single(self.kv))
        return self

    def env(self, connector: ConnectorConfig | None = MISSING) -> dict[str, Any]:
        """Flat ``path -> value`` map seen by conditions, with ``connector.*`` bound
        to ``connector`` (a member of a composite), or to this context's own."""
        if connector is MISSING:
            return self._top_env
        return self._build_env(connector)

    @cached_property
    def _top_env(self) -> dict[str, Any]:
        return self._build_env(self.connector)

    def _build_env(self, connector: ConnectorConfig | None) -> dict[str, Any]:
        env = {path: spec.get(self, connector) for path, spec in FIELDS.items()}
        if connector is not None:
            for key, value in connector.extra.items():
                env[EXTRA_PREFIX + key] = value
        return env
