"""KV cache specs and groups: what one layer stores per block, in bytes.

Frozen models with derived ``*_bytes`` properties, after vLLM's
``kv_cache_interface.py``. Worked example, Qwen2.5-0.5B with
``fp8_per_token_head`` (H=2 KV heads, D=64, N=16 tokens a block)::

    cell_bytes      = packed_D + 4        = 64 + 4       = 68
    page_size_bytes = 2 * N * H * cell    = 2*16*2*68    = 4352
                    = real data 4096 + inline scales 2*16*2*4 = 256

``nvfp4`` / ``nvfp4_4over6`` (vLLM 0.34's FLASHINFER, ``customize_spec``): a cell is
``D/2`` fp4 bytes plus ``D/16`` fp8 block-scale bytes, and the page holds ``2H`` head
slots (K's H heads, then V's) of ``N`` cells, as vLLM's ``num_head_slots`` says. At
H=2, D=64, N=16: cell 32 + 4 = 36, page 2*16*2*36 = 2304 B. The cell is not one
contiguous run: each side (K, V) keeps its data first and its scales after
(`kvpolicy.engine.plan` places them).
"""

from __future__ import annotations

import difflib
from enum import Enum
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from kvpolicy.policy.errors import Diagnostic, InputError
from kvpolicy.policy.quant import KV_CACHE_DTYPES, CacheDtype, ModelDtype, QuantMode, parse_kv_cache_dtype
from kvpolicy.policy.value_hints import plain_message, type_hint

__all__ = ["AttentionKind", "Frozen", "KVCacheGroup", "KVCacheGroups", "KVCacheSpec", "make_model"]


class Frozen(BaseModel):
    """Base of every input model: immutable, hashable, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any:
        """A copy with ``update`` applied, validated, and no derived value cached from the original.

        (pydantic's own copy neither re-validates nor forgets `cached_property` values.)
        """
        if not update:
            copy = super().model_copy(deep=deep)
            for name in _cached_properties(type(self)):
                copy.__dict__.pop(name, None)
            return copy
        return type(self).model_validate({**dict(self), **update})


def _cached_properties(cls: type) -> list[str]:
    return [n for k in cls.__mro__ for n, v in vars(k).items() if isinstance(v, cached_property)]


# Sanity bounds, far above any real model (vLLM's block sizes stop at a few hundred tokens):
# they turn a typo like `block_size: 100000000` into an error instead of a multi-GB plan check.
MAX_LAYERS = 4096
MAX_BLOCK_SIZE = 4096
MAX_KV_HEADS = 1024
MAX_HEAD_SIZE = 16384


class AttentionKind(str, Enum):
    """What a KV cache group stores: vLLM's spec classes ``FullAttentionSpec``, ``SlidingWindowSpec``,
    ``ChunkedLocalAttentionSpec`` (Llama-4's local layers: K/V paged as full attention's, kept per
    chunk), ``MLAAttentionSpec`` and ``MambaSpec``."""

    full = "full"
    sliding_window = "sliding_window"
    chunked_local = "chunked_local"
    mla = "mla"
    mamba = "mamba"

    @property
    def is_attention(self) -> bool:
        """Attention specs page K/V by block; Mamba keeps a recurrent state instead."""
        return self is not AttentionKind.mamba

    def __str__(self) -> str:  # `print(mode)` shows `fp8`, as YAML and JSON write it
        return self.value


class KVCacheSpec(Frozen):
    """One KV cache group's per-layer geometry."""

    kind: AttentionKind = AttentionKind.full
    num_layers: StrictInt = Field(gt=0, le=MAX_LAYERS, description="attention layers sharing this spec")
    block_size: StrictInt = Field(gt=0, le=MAX_BLOCK_SIZE, description="tokens per block (N)")
    num_kv_heads: StrictInt = Field(gt=0, le=MAX_KV_HEADS, description="KV heads per layer on this rank (H); 1 for MLA")
    head_size: StrictInt = Field(gt=0, le=MAX_HEAD_SIZE, description="values per head (D); the latent width for MLA")
    dtype: ModelDtype = ModelDtype.bfloat16
    kv_cache_dtype: str = "auto"
    sliding_window: StrictInt | None = Field(default=None, gt=0)
    page_size_padded: StrictInt | None = Field(
        default=None, gt=0, description="padded page size in bytes; wins over the computed one"
    )

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_cache_dtype(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype `{value}`; valid values: {', '.join(KV_CACHE_DTYPES)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KVCacheSpec:
        if self.quant_mode is QuantMode.int4_per_token_head and self.head_size % 2:
            raise ValueError(f"int4_per_token_head packs two values a byte: head_size {self.head_size} must be even")
        if self.quant_mode.is_per_token_head and self.quant_mode.packed_head_size(self.head_size) % 4:
            # vLLM reads each inline scale through a float32 view of the cache (TRITON_ATTN's
            # _ensure_scale_caches asserts it): the head's code bytes must be a multiple of 4
            multiple = 8 if self.quant_mode is QuantMode.int4_per_token_head else 4
            raise ValueError(
                f"{self.kv_cache_dtype} keeps a 4-byte fp32 scale after each head's codes, which vLLM reads "
                f"through a float32 view: head_size {self.head_size} must be a multiple of {multiple}"
            )
        if self.quant_mode is QuantMode.nvfp4 and self.head_size % 16:
            raise ValueError(f"{self.kv_cache_dtype} keeps one fp8 scale per 16 values: head_size {self.head_size} "
                             "must be a multiple of 16")
        if self.quant_mode is QuantMode.nvfp4 and self.kind is AttentionKind.mla:
            raise ValueError(f"{self.kv_cache_dtype} is a K/V cache format (vLLM's FLASHINFER); an MLA spec cannot "
                             "use it (vLLM's MLA format is `nvfp4_ds_mla`)")
        if self.kind is AttentionKind.mla and self.num_kv_heads != 1:
            raise ValueError("an MLA spec stores one latent head: num_kv_heads must be 1")
        # a Mamba spec's own bytes are a stand-in (`kv_groups_from_hf_config`): its padded page, vLLM's, stands
        if (self.page_size_padded is not None and self.kind is not AttentionKind.mamba
                and self.page_size_padded < self.real_page_size_bytes):
            raise ValueError(
                f"page_size_padded {self.page_size_padded} is smaller than the page's "
                f"{self.real_page_size_bytes} bytes"
            )
        return self

    @cached_property
    def _parsed(self) -> tuple[QuantMode, CacheDtype]:
        return parse_kv_cache_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def quant_mode(self) -> QuantMode:
        return self._parsed[0]

    @property
    def cache_dtype(self) -> CacheDtype:
        """Element type of the cache tensor (uint8 for per-token-head byte cells)."""
        return self._parsed[1]

    @property
    def per_token_head(self) -> bool:
        return self.quant_mode.is_per_token_head

    @property
    def kv_factor(self) -> int:
        """2 when K and V are stored separately; 1 for MLA's single latent."""
        return 1 if self.kind is AttentionKind.mla else 2

    @property
    def data_bytes_per_head(self) -> int:
        """Bytes of stored values in one (token, head) cell, scales excluded."""
        if self.quant_mode.is_per_token_head or self.quant_mode is QuantMode.nvfp4:
            return self.quant_mode.packed_head_size(self.head_size)
        return self.head_size * self.cache_dtype.size_bytes

    @property
    def scale_bytes_per_cell(self) -> int:
        """Scale bytes of one (token, head) cell: per-token-head's fp32, nvfp4's ``D/16`` fp8 block scales."""
        return self.quant_mode.scale_bytes_for(self.head_size)

    @property
    def cell_bytes(self) -> int:
        """Bytes of one (token, head) cell for K or for V, scales included."""
        return self.data_bytes_per_head + self.scale_bytes_per_cell

    @property
    def head_slots(self) -> int:
        """H of vLLM's ``[B, H, N, C]`` page view (``num_heads``): ``2H`` for nvfp4, whose
        K and V heads are separate slots (``num_head_slots``); else the KV heads."""
        return 2 * self.num_kv_heads if self.quant_mode is QuantMode.nvfp4 else self.num_kv_heads

    @property
    def cell_elements(self) -> int:
        """The cell in elements of `cache_dtype` (vLLM's D' in the backend shapes)."""
        return self.cell_bytes // self.cache_dtype.size_bytes

    @property
    def real_page_size_bytes(self) -> int:
        """One layer's bytes for one block, before padding."""
        return self.kv_factor * self.block_size * self.num_kv_heads * self.cell_bytes

    @property
    def hnc_shape(self) -> tuple[int, int, int]:
        """vLLM's ``(num_heads, num_states, page_size_bytes)`` of this spec's page, what
        ``resolve_kv_cache_layout`` compares: an attention page holds `head_slots` heads of
        ``block_size`` states; a Mamba state is one head of one state."""
        if self.kind is AttentionKind.mamba:
            return (1, 1, self.page_size_bytes)
        return (self.head_slots, self.block_size, self.page_size_bytes)

    @property
    def scale_bytes_per_page(self) -> int:
        return self.kv_factor * self.block_size * self.num_kv_heads * self.scale_bytes_per_cell

    @property
    def page_size_bytes(self) -> int:
        """One layer's bytes for one block: the padded size when set."""
        return self.page_size_padded or self.real_page_size_bytes


class KVCacheGroup(Frozen):
    """Layers that share one spec and one block table (vLLM's KV cache group)."""

    spec: KVCacheSpec
    num_attention_groups: StrictInt = Field(default=1, ge=1, description="attention backends in this group")
    dcp_sharded: bool = Field(default=True, description="sharded by decode context parallelism (a replicated "
                              "draft model's cache is not)")


class KVCacheGroups(Frozen):
    """All KV cache groups of a model; hybrid models have several.

    ``groups`` may hold one group per kind of layer (what `kv_groups_from_hf_config` reads: Gemma-3-27B is
    52 sliding-window layers and 10 full ones, two groups) or vLLM's own groups (what the plugin reads off
    the engine). `count` is vLLM's number either way: its engine core splits every kind into groups of
    one size (``_get_kv_cache_groups_uniform_page_size``: the smallest kind's layer count, or the largest's
    when that is below 1.5 times it), so Gemma-3-27B's two become ``cdiv(52, 10) + cdiv(10, 10)`` = 7
    (6 sliding + 1 full), Jamba's 4 full + 28 Mamba layers 1 + 7 = 8, gpt-oss-20b's 12 + 12 = 2.
    """

    groups: tuple[KVCacheGroup, ...] = ()

    @property
    def vllm_splits(self) -> tuple[int, ...]:
        """How many of vLLM's KV cache groups each group here becomes: all 1 when they are vLLM's already
        (a kind appears in several groups, as the 0.24-0.28 plugin reads vLLM's attention groups)."""
        sizes = [g.spec.num_layers for g in self.groups]
        if len(sizes) <= 1 or len({g.spec.kind for g in self.groups}) < len(sizes):
            return tuple(1 for _ in sizes)
        smallest, largest = min(sizes), max(sizes)
        size = largest if largest < smallest * 1.5 else smallest
        return tuple(-(-n // size) for n in sizes)

    @property
    def count(self) -> int:
        """vLLM's number of KV cache groups (`vllm_splits` summed): what ``len(kv_cache_config.kv_cache_groups)``
        is in the engine. vLLM's own checks read only whether it is 1 (0.24-0.28's cross-layer gate, the
        connectors' ``> 1``); a kind split into several groups is still one kind (`groups` has one each)."""
        return sum(self.vllm_splits)

    @property
    def attention_groups(self) -> int:
        """Attention groups summed over vLLM's KV cache groups (each split keeps its group's attention groups)."""
        return sum(n * g.num_attention_groups for n, g in zip(self.vllm_splits, self.groups, strict=True))

    @property
    def has_mamba(self) -> bool:
        return any(g.spec.kind is AttentionKind.mamba for g in self.groups)

    @property
    def has_sliding_window(self) -> bool:
        return any(g.spec.kind is AttentionKind.sliding_window for g in self.groups)

    @property
    def mixed_hnc_shapes(self) -> bool:
        """The groups' pages differ in (heads, stored states, page bytes): vLLM's HNC-shape check
        (``resolve_kv_cache_layout``) over every spec with per-layer views. An attention page holds
        ``num_kv_heads`` heads of ``block_size`` states; a Mamba state is one head of one state."""
        return len({g.spec.hnc_shape for g in self.groups}) > 1

    @property
    def dcp_mixed_page_sizes(self) -> bool:
        """DCP-sharded and replicated attention groups, with page sizes differing among all groups
        (vLLM's DCP check: Mamba states count for the page sizes, not for the sharding)."""
        sharding = {g.dcp_sharded for g in self.groups if g.spec.kind.is_attention}
        return len(sharding) > 1 and len({g.spec.page_size_bytes for g in self.groups}) > 1

    @property
    def primary(self) -> KVCacheSpec | None:
        """The first attention group's spec (the first group's if none is attention)."""
        for g in self.groups:
            if g.spec.kind.is_attention:
                return g.spec
        return self.groups[0].spec if self.groups else None

    @classmethod
    def single(cls, spec: KVCacheSpec) -> KVCacheGroups:
        return cls(groups=(KVCacheGroup(spec=spec),))


def make_model(cls: type[Frozen], where: str, data: dict[str, Any]) -> Any:
    """Build a model from user data, turning pydantic errors into one located `InputError`."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        diags = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            field = f"{where}.{loc}" if loc else where
            if err["type"] == "extra_forbidden":
                key = str(err["loc"][-1])
                close = difflib.get_close_matches(key, list(cls.model_fields), n=1)
                diags.append(Diagnostic(field, 0, 0, "unknown-field", f"unknown field `{field}`",
                                        (f"did you mean `{close[0]}`? " if close else "")
                                        + "fields: " + ", ".join(cls.model_fields)))
                continue
            msg = plain_message(err["msg"])
            shown = err.get("input")
            if err["type"] != "value_error" and isinstance(shown, (str, int, float, bool)):
                # by isinstance, bool first: a subclass of int or float (an IntEnum, numpy-like wrappers) is
                # named by its base type and shown by its base value, never looked up by its own type
                kind, base = next((k, b) for b, k in ((bool, "boolean"), (int, "integer"), (float, "number"),
                                                      (str, "string")) if isinstance(shown, b))
                value = base(shown)
                msg += f", got {kind} `{str(value).lower() if base is bool else value}`"
            hint = (f"give `{field}` a value" if err["type"] == "missing" else type_hint(err["type"], shown))
            diags.append(Diagnostic(field, 0, 0, "invalid-input", f"`{field}`: {msg}", hint))
        raise InputError(f"invalid {cls.__name__}", diags) from None
