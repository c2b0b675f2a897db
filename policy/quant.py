"""KV cache quantization modes, parsed from vLLM's ``kv_cache_dtype`` strings.

An enum instead of matching on dtype strings (vLLM's ``KVQuantMode``): rules
and the runtime branch on `QuantMode`, never on the raw string.
"""

from __future__ import annotations

import difflib
from enum import Enum

from kvpolicy.policy.errors import input_error

__all__ = ["KV_CACHE_DTYPES", "CacheDtype", "ModelDtype", "QuantMode", "parse_kv_cache_dtype"]


class ModelDtype(str, Enum):
    """The dtype the model computes K and V in."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"

    @property
    def size_bytes(self) -> int:
        return 4 if self is ModelDtype.float32 else 2

    def __str__(self) -> str:  # `print(mode)` shows `fp8`, as YAML and JSON write it
        return self.value


class CacheDtype(str, Enum):
    """The element type the cache tensor is allocated with."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    float8_e4m3fn = "float8_e4m3fn"
    float8_e5m2 = "float8_e5m2"
    uint8 = "uint8"

    @property
    def size_bytes(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}.get(self.value, 1)

    def __str__(self) -> str:  # `print(mode)` shows `fp8`, as YAML and JSON write it
        return self.value


class QuantMode(str, Enum):
    """How K and V are stored in the cache.

    The three ``*_per_token_head`` modes keep one fp32 scale per (token, head)
    inline at the tail of each cell, which is what makes their memory geometry
    different from every other mode. ``nvfp4`` (vLLM's ``KVQuantMode.NVFP4``, the
    ``nvfp4`` and ``nvfp4_4over6`` kv_cache_dtypes: one byte layout, two scale
    searches) stores two fp4 values a byte and one fp8 e4m3 scale per 16 values,
    the scales of a page side apart from its data (see `KVCacheSpec`).
    """

    none = "none"
    fp8_per_tensor = "fp8_per_tensor"
    fp8_per_token_head = "fp8_per_token_head"
    int8_per_token_head = "int8_per_token_head"
    int4_per_token_head = "int4_per_token_head"
    nvfp4 = "nvfp4"

    @property
    def is_per_token_head(self) -> bool:
        return self in _PER_TOKEN_HEAD

    @property
    def bits(self) -> int | None:
        """Bits per stored value; None when unquantized (the model dtype decides)."""
        if self is QuantMode.none:
            return None
        return 4 if self in (QuantMode.int4_per_token_head, QuantMode.nvfp4) else 8

    @property
    def scale_bytes(self) -> int:
        """Bytes of inline scale per (token, head) cell: one fp32 for per-token-head."""
        return 4 if self.is_per_token_head else 0

    def scale_bytes_for(self, head_size: int) -> int:
        """Scale bytes per (token, head) of ``head_size`` values: per-token-head's inline fp32,
        nvfp4's fp8 block scales (one per 16 values, vLLM's ``nvfp4_kv_cache_full_dim``)."""
        return head_size // 16 if self is QuantMode.nvfp4 else self.scale_bytes

    def packed_head_size(self, head_size: int) -> int:
        """Stored values' bytes for one head of ``head_size`` (int4 and fp4 pack two a byte)."""
        if self in (QuantMode.int4_per_token_head, QuantMode.nvfp4):
            return head_size // 2
        return head_size

    def __str__(self) -> str:  # `print(mode)` shows `fp8`, as YAML and JSON write it
        return self.value


_PER_TOKEN_HEAD = frozenset(
    {QuantMode.fp8_per_token_head, QuantMode.int8_per_token_head, QuantMode.int4_per_token_head}
)

# vLLM's kv_cache_dtype string -> (quant mode, cache element type or None for "the model's")
_KV_CACHE_DTYPES: dict[str, tuple[QuantMode, CacheDtype | None]] = {
    "auto": (QuantMode.none, None),
    "bfloat16": (QuantMode.none, CacheDtype.bfloat16),
    "float16": (QuantMode.none, CacheDtype.float16),
    "fp8": (QuantMode.fp8_per_tensor, CacheDtype.float8_e4m3fn),
    "fp8_e4m3": (QuantMode.fp8_per_tensor, CacheDtype.float8_e4m3fn),
    "fp8_e5m2": (QuantMode.fp8_per_tensor, CacheDtype.float8_e5m2),
    "fp8_per_token_head": (QuantMode.fp8_per_token_head, CacheDtype.uint8),
    "int8_per_token_head": (QuantMode.int8_per_token_head, CacheDtype.uint8),
    "int4_per_token_head": (QuantMode.int4_per_token_head, CacheDtype.uint8),
    "nvfp4": (QuantMode.nvfp4, CacheDtype.uint8),
    "nvfp4_4over6": (QuantMode.nvfp4, CacheDtype.uint8),
}

KV_CACHE_DTYPES: tuple[str, ...] = tuple(_KV_CACHE_DTYPES)


def parse_kv_cache_dtype(value: str, model_dtype: ModelDtype) -> tuple[QuantMode, CacheDtype]:
    """Map a vLLM ``kv_cache_dtype`` string to its quant mode and cache element type.

    >>> parse_kv_cache_dtype("fp8_per_token_head", ModelDtype.bfloat16)
    (<QuantMode.fp8_per_token_head: 'fp8_per_token_head'>, <CacheDtype.uint8: 'uint8'>)

    Per-token-head caches are byte tensors: each cell is ``packed_D`` data bytes
    followed by a 4-byte fp32 scale, which no single float dtype can describe.
    """
    entry = _KV_CACHE_DTYPES.get(value)
    if entry is None:
        close = difflib.get_close_matches(str(value), KV_CACHE_DTYPES, n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise input_error(
            "kv_cache_dtype",
            f"unknown kv_cache_dtype `{value}`",
            f"{hint}valid values: {', '.join(KV_CACHE_DTYPES)}",
            code="unknown-kv-cache-dtype",
        )
    mode, cache = entry
    return mode, cache if cache is not None else CacheDtype(model_dtype.value)
