"""Attention backends' memory geometry, as data.

A backend is described by the names of its logical per-layer dims and the
physical order of those dims for each head order, with and without the layer
dim. From that, everything else is derived: whether the backend "indexes KV by
block stride" (the block dim comes first physically in the cross-layer order,
so one block of every layer is contiguous), and every stride the planner needs.

Dim names: ``block`` (B), ``layer`` (L), ``kv`` (2: K then V), ``token`` (N),
``head`` (H), ``dim`` (the cell, D' elements of the cache dtype).
"""

from __future__ import annotations

import difflib
from enum import Enum

from pydantic import Field, model_validator

from policy.errors import input_error
from policy.layouts import HeadOrder
from policy.spec import Frozen

__all__ = [
    "BACKENDS",
    "BackendProfile",
    "Dim",
    "ScaleViews",
    "get_backend",
]


class Dim(str, Enum):
    block = "block"
    layer = "layer"
    kv = "kv"
    token = "token"
    head = "head"
    dim = "dim"


class ScaleViews(str, Enum):
    """How a backend builds its views of the inline per-token-head scales.

    ``stride_aware`` reads the KV view's own strides and storage offset, so it
    is correct under any placement. ``assume_per_layer_contiguous`` is what
    vLLM's 5-D-era Triton backend did: base offset 0, block stride of one
    layer page. Under the cross-layer layout every layer's scale view then
    lands on the same bytes (vLLM issue #48412).
    """

    stride_aware = "stride_aware"
    assume_per_layer_contiguous = "assume_per_layer_contiguous"


class BackendProfile(Frozen):
    """One attention backend's KV cache geometry."""

    name: str = Field(min_length=1)
    mla: bool = Field(default=False, description="MLA backends store one latent per token, no head dim")
    logical_dims: tuple[Dim, ...]
    per_layer_order: dict[HeadOrder, tuple[Dim, ...]]
    cross_layer_order: dict[HeadOrder, tuple[Dim, ...]]
    scale_views: ScaleViews = ScaleViews.assume_per_layer_contiguous

    def __hash__(self) -> int:
        return hash((self.name, self.mla, self.logical_dims, tuple(sorted(self.per_layer_order.items())),
                     tuple(sorted(self.cross_layer_order.items())), self.scale_views))

    @model_validator(mode="after")
    def _orders_are_permutations(self) -> BackendProfile:
        logical = set(self.logical_dims)
        if len(logical) != len(self.logical_dims) or Dim.layer in logical or Dim.block not in logical:
            raise ValueError("logical_dims must name each dim once, include `block` and exclude `layer`")
        if set(self.per_layer_order) != set(self.cross_layer_order):
            raise ValueError("per_layer_order and cross_layer_order must cover the same head orders")
        for order in self.per_layer_order.values():
            if sorted(order) != sorted(self.logical_dims):
                raise ValueError(f"per-layer order {order} is not a permutation of {self.logical_dims}")
        for order in self.cross_layer_order.values():
            if sorted(order) != sorted((*self.logical_dims, Dim.layer)):
                raise ValueError(f"cross-layer order {order} must permute the logical dims plus `layer`")
        return self

    @property
    def head_orders(self) -> tuple[HeadOrder, ...]:
        return tuple(h for h in HeadOrder if h in self.per_layer_order)

    @property
    def supports_hnd(self) -> bool:
        return HeadOrder.HND in self.per_layer_order

    @property
    def indexes_kv_by_block_stride(self) -> bool:
        """True when every cross-layer order puts ``block`` outermost physically."""
        return all(order[0] is Dim.block for order in self.cross_layer_order.values())

    def with_scale_views(self, scale_views: ScaleViews) -> BackendProfile:
        return self.model_copy(update={"scale_views": scale_views})


_B, _L, _KV, _N, _H, _D = Dim.block, Dim.layer, Dim.kv, Dim.token, Dim.head, Dim.dim
_MHA_LOGICAL = (_B, _KV, _N, _H, _D)


def _flash_like(name: str) -> BackendProfile:
    return BackendProfile(
        name=name,
        logical_dims=_MHA_LOGICAL,
        per_layer_order={HeadOrder.NHD: (_B, _KV, _N, _H, _D), HeadOrder.HND: (_B, _KV, _H, _N, _D)},
        cross_layer_order={HeadOrder.NHD: (_B, _L, _KV, _N, _H, _D), HeadOrder.HND: (_B, _H, _L, _KV, _N, _D)},
    )


# The shipped profiles: vLLM's 5-D era geometry, every one building its scale
# views as if each layer's buffer were contiguous (as at the time of #48412).
BACKENDS: dict[str, BackendProfile] = {
    "TRITON_ATTN": _flash_like("TRITON_ATTN"),
    "FLASH_ATTN": _flash_like("FLASH_ATTN"),
    "FLASHINFER": BackendProfile(
        name="FLASHINFER",
        logical_dims=_MHA_LOGICAL,
        per_layer_order={HeadOrder.NHD: (_B, _KV, _N, _H, _D), HeadOrder.HND: (_B, _KV, _H, _N, _D)},
        cross_layer_order={HeadOrder.NHD: (_B, _L, _KV, _N, _H, _D), HeadOrder.HND: (_B, _KV, _H, _L, _N, _D)},
    ),
    "FLASHMLA": BackendProfile(
        name="FLASHMLA",
        mla=True,
        logical_dims=(_B, _N, _D),
        per_layer_order={HeadOrder.NHD: (_B, _N, _D)},
        cross_layer_order={HeadOrder.NHD: (_L, _B, _N, _D)},
    ),
}


def get_backend(name: str) -> BackendProfile:
    """The shipped profile for ``name`` (vLLM's backend enum name)."""
    try:
        return BACKENDS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(BACKENDS), n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise input_error(
            "backend",
            f"unknown backend `{name}`",
            f"{hint}known backends: {', '.join(BACKENDS)}; pass a BackendProfile for another",
            code="unknown-backend",
        ) from None
