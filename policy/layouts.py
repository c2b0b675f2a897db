"""Layouts: vLLM's ``KVCacheLayout``, six stride permutations of the logical ``[L, B, H, N, C]``.

A layout is one fact, its stride permutation; everything else is derived from
it, as in vLLM's ``vllm/v1/kv_cache_layout.py``: vLLM's own properties
(``is_layer_compact``, ``is_block_outermost``, ``is_block_compact``,
``is_block_contiguous``) and kvpolicy's older vocabulary, ``placement``
(``cross_layer`` when the block dim is outermost, so block ``b`` of every layer
is one contiguous run) and ``head_order`` (``NHD`` when tokens are outside
heads inside a block, else ``HND``).

Worked example: ``BLNHC`` has stride order ``(1, 0, 3, 2, 4)``, physical
``[B, L, N, H, C]``: block outermost (cross_layer), tokens outside heads (NHD).

Releases before 0.29 named four of them by placement and head order; those
names still parse (``per_layer/NHD`` -> ``LBNHC``, ``per_layer/HND`` -> ``LBHNC``,
``cross_layer/NHD`` -> ``BLNHC``, ``cross_layer/HND`` -> ``BHLNC``, the physical
orders vLLM 0.28's backends allocate).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import Field, StrictBool, field_validator

from kvpolicy.policy.spec import Frozen

__all__ = ["ALL_LAYOUTS", "LEGACY_NAMES", "HeadOrder", "Layout", "LayoutPattern", "Placement"]

# Logical dim indices of the stride permutation, as vLLM numbers them.
DIM_L, DIM_B, DIM_H, DIM_N, DIM_C = 0, 1, 2, 3, 4


class Placement(str, Enum):
    """``per_layer``: a layer's pages are apart from other layers' (layer outside block).
    ``cross_layer``: block outermost, so block ``b`` of every layer is one contiguous run
    (vLLM's "uniform" KV cache; one transfer descriptor per block)."""

    per_layer = "per_layer"
    cross_layer = "cross_layer"

    def __str__(self) -> str:
        return self.value


class HeadOrder(str, Enum):
    """``NHD``: token-major inside a block. ``HND``: head-major (NIXL requires it)."""

    NHD = "NHD"
    HND = "HND"

    def __str__(self) -> str:
        return self.value


class Layout(str, Enum):
    """One of vLLM's six KV cache layouts; its name spells the physical dim order."""

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"

    def __str__(self) -> str:
        return self.value

    @property
    def stride_order(self) -> tuple[int, ...]:
        """Physical order of the logical ``[L, B, H, N, C]`` dims (vLLM's enum value)."""
        return tuple("LBHNC".index(c) for c in self.value)

    @property
    def is_layer_compact(self) -> bool:
        """The layer dim is outermost: each layer's pages form one region."""
        return self.stride_order[0] == DIM_L

    @property
    def is_block_outermost(self) -> bool:
        """The block dim is outermost: one block of every layer is one contiguous run."""
        return self.stride_order[0] == DIM_B

    @property
    def is_block_compact(self) -> bool:
        """L and B are the two outermost dims: each page's ``[H, N, C]`` is one contiguous run."""
        return set(self.stride_order[:2]) == {DIM_L, DIM_B}

    @property
    def is_block_contiguous(self) -> bool:
        """``[H, N, C]`` are the three innermost dims, in that order."""
        return self.stride_order[-3:] == (DIM_H, DIM_N, DIM_C)

    @property
    def placement(self) -> Placement:
        return Placement.cross_layer if self.is_block_outermost else Placement.per_layer

    @property
    def head_order(self) -> HeadOrder:
        order = self.stride_order
        return HeadOrder.NHD if order.index(DIM_N) < order.index(DIM_H) else HeadOrder.HND

    @property
    def legacy_name(self) -> str:
        """``placement/head_order``, the name releases before 0.29 used."""
        return f"{self.placement.value}/{self.head_order.value}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """A vLLM name (``LBHNC``) or a legacy ``placement/head_order``; ValueError names the valid forms."""
        if isinstance(text, Layout):
            return text
        if isinstance(text, str):
            if text in cls.__members__:
                return cls[text]
            if text in LEGACY_NAMES:
                return LEGACY_NAMES[text]
        names = ", ".join(m.value for m in cls)
        legacy = ", ".join(LEGACY_NAMES)
        raise ValueError(f"unknown layout `{text}`; layouts: {names} (legacy names: {legacy})")


LEGACY_NAMES: dict[str, Layout] = {
    "per_layer/NHD": Layout.LBNHC,
    "per_layer/HND": Layout.LBHNC,
    "cross_layer/NHD": Layout.BLNHC,
    "cross_layer/HND": Layout.BHLNC,
}

# Every layout, in vLLM's enum order (the order of the candidates when nothing else orders them).
ALL_LAYOUTS: tuple[Layout, ...] = tuple(Layout)

_PROPERTY_KEYS = ("layer_compact", "block_outermost", "block_compact", "block_contiguous")


# What a rule file may write for a layout: vLLM's names, or the legacy `placement/head_order`.
LayoutName = Literal["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC",
                     "per_layer/NHD", "per_layer/HND", "cross_layer/NHD", "cross_layer/HND"]


class LayoutPattern(Frozen):
    """The layouts a rule's effect applies to: every given key must hold (absent keys match anything).

    ``layout`` names layouts (one name or a list; legacy ``placement/head_order``
    names are accepted); the other keys test a derived property.
    """

    layout: tuple[Layout, ...] | None = Field(default=None, description="one layout name or a list of them")
    placement: Placement | None = Field(default=None, description="`per_layer` or `cross_layer` (block outermost)")
    head_order: HeadOrder | None = Field(default=None, description="`NHD` or `HND` inside a block")
    layer_compact: StrictBool | None = Field(default=None, description="vLLM's `is_layer_compact`: layer dim outermost")
    block_outermost: StrictBool | None = Field(default=None,
                                               description="vLLM's `is_block_outermost`: block dim outermost")
    block_compact: StrictBool | None = Field(default=None,
                                       description="vLLM's `is_block_compact`: L and B are the outer two dims")
    block_contiguous: StrictBool | None = Field(default=None,
                                          description="vLLM's `is_block_contiguous`: [H, N, C] innermost")

    @field_validator("layout", mode="before",
                     json_schema_input_type=LayoutName | list[LayoutName] | None)  # type: ignore[valid-type]
    @classmethod
    def _names(cls, value: Any) -> Any:
        if value is None:
            return None
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items:
            raise ValueError("`layout` needs at least one layout name")
        return tuple(Layout.parse(v) if isinstance(v, str) else v for v in items)

    def matches(self, layout: Layout) -> bool:
        if self.layout is not None and layout not in self.layout:
            return False
        if self.placement is not None and self.placement is not layout.placement:
            return False
        if self.head_order is not None and self.head_order is not layout.head_order:
            return False
        return all(
            getattr(self, key) is None or getattr(self, key) == getattr(layout, "is_" + key) for key in _PROPERTY_KEYS
        )

    def __str__(self) -> str:
        parts = []
        if self.layout is not None:
            names = [str(x) for x in self.layout]
            parts.append(f"layout: {names[0]}" if len(names) == 1 else f"layout: [{', '.join(names)}]")
        if self.placement is not None:
            parts.append(f"placement: {self.placement.value}")
        if self.head_order is not None:
            parts.append(f"head_order: {self.head_order.value}")
        for key in _PROPERTY_KEYS:
            if getattr(self, key) is not None:
                parts.append(f"{key}: {str(getattr(self, key)).lower()}")
        return "{" + ", ".join(parts) + "}" if parts else "{any layout}"
