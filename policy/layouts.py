"""Layouts: where each layer's pages live (placement) x how a block orders its heads."""

from __future__ import annotations

from enum import Enum

from policy.spec import Frozen

__all__ = ["ALL_LAYOUTS", "HeadOrder", "Layout", "LayoutPattern", "Placement"]


class Placement(str, Enum):
    """``per_layer``: one buffer per layer. ``cross_layer``: one buffer, block outermost,
    so block ``b`` of every layer is one contiguous run (vLLM's "uniform" KV cache)."""

    per_layer = "per_layer"
    cross_layer = "cross_layer"


class HeadOrder(str, Enum):
    """``NHD``: token-major inside a block. ``HND``: head-major (NIXL requires it)."""

    NHD = "NHD"
    HND = "HND"


class Layout(Frozen):
    """One candidate layout; written ``per_layer/NHD`` in rule files and output."""

    placement: Placement
    head_order: HeadOrder

    def __str__(self) -> str:
        return f"{self.placement.value}/{self.head_order.value}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``placement/head_order``; raises ValueError naming the valid forms."""
        placement, _, order = text.partition("/")
        try:
            return cls(placement=Placement(placement), head_order=HeadOrder(order))
        except ValueError:
            valid = ", ".join(str(layout) for layout in ALL_LAYOUTS)
            raise ValueError(f"unknown layout `{text}`; valid layouts: {valid}") from None


class LayoutPattern(Frozen):
    """The layouts a rule's effect applies to; an absent key matches any value."""

    placement: Placement | None = None
    head_order: HeadOrder | None = None

    def matches(self, layout: Layout) -> bool:
        return (self.placement is None or self.placement is layout.placement) and (
            self.head_order is None or self.head_order is layout.head_order
        )

    def __str__(self) -> str:
        parts = [f"placement: {self.placement.value}"] if self.placement else []
        if self.head_order:
            parts.append(f"head_order: {self.head_order.value}")
        return "{" + ", ".join(parts) + "}" if parts else "{any layout}"


# The candidates, in the canonical order used when a rule set declares none.
ALL_LAYOUTS: tuple[Layout, ...] = tuple(
    Layout(placement=p, head_order=h) for p in Placement for h in HeadOrder
)
