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
from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

from pydantic import Field, model_validator

from kvpolicy.policy.cpu_kernel import IsaRule
from kvpolicy.policy.errors import input_error
from kvpolicy.policy.layouts import LEGACY_NAMES, HeadOrder, Layout
from kvpolicy.policy.spec import Frozen

__all__ = [
    "BACKENDS",
    "DEV_48412_BACKENDS",
    "BackendProfile",
    "Dim",
    "KVSplit",
    "ScaleViews",
    "get_backend",
    "nvfp4_order",
    "packed_backend",
    "packed_order",
]


class Dim(str, Enum):
    block = "block"
    layer = "layer"
    kv = "kv"
    token = "token"
    head = "head"
    dim = "dim"

    def __str__(self) -> str:  # `print(mode)` shows `fp8`, as YAML and JSON write it
        return self.value


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

    def __str__(self) -> str:  # `print(mode)` shows `fp8`, as YAML and JSON write it
        return self.value


class KVSplit(str, Enum):
    """How a backend of released vLLM (0.27.1 on) finds K and V in its ``[B, H, N, C]`` cache view.

    The allocation is the same for every backend (the layout's permutation of
    ``[L, B, H, N, C]``, ``C = 2 x cell``); what differs is which of those bytes
    the backend's cache-write kernel is handed as K and as V, so the planner
    must know it to put a cell where vLLM does.

    ``content``: K then V inside each (token, head) content run, vLLM's
    ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` (FLASH_ATTN,
    TRITON_ATTN, FLASHINFER, FLEX_ATTENTION). ``token_rows``: each head's
    ``N x C`` run read as ``2N`` rows of ``C / 2``, K's ``N`` rows then V's,
    CPU_ATTN's ``kv_cache.view(B, H, 2N, -1).chunk(2, dim=2)``; it needs the
    token dim directly outside ``C`` (LBHNC, BLHNC, LHBNC, BHLNC).
    """

    content = "content"
    token_rows = "token_rows"

    def __str__(self) -> str:  # `print(mode)` shows `fp8`, as YAML and JSON write it
        return self.value


class BackendProfile(Frozen):
    """One attention backend's KV cache geometry in one release.

    ``orders`` maps each layout the backend can lay out to its physical dim
    order, layer dim included; the logical per-layer view is ``logical_dims``.
    With ``layer_buffers`` (vLLM 0.28's model runner, the #48412 development
    state), a layer-compact layout allocates one buffer per layer instead of
    one buffer holding every layer (vLLM 0.29+'s ``KVCacheTensor``).
    ``supported_layouts`` is what the backend declares to vLLM's resolver, most
    preferred first; None when it declares nothing (any layout, no vote).
    ``kv_split`` is set for released vLLM's packed geometry (logical
    ``[B, H, N, C]`` per layer, see `KVSplit`); None for a geometry that keeps
    K and V in a dim of their own (the #48412 development state).
    """

    name: str = Field(min_length=1)
    mla: bool = Field(default=False, description="MLA backends store one latent per token, no head dim")
    logical_dims: tuple[Dim, ...]
    orders: dict[Layout, tuple[Dim, ...]]
    layer_buffers: bool = False
    supported_layouts: tuple[Layout, ...] | None = None
    scale_views: ScaleViews = ScaleViews.stride_aware
    kv_split: KVSplit | None = None
    unplanned_kv_cache_dtypes: tuple[str, ...] = ()  # the release lays these out in a way kvpolicy does not model
    int4_heads_power_of_two: bool = False  # the release's int4 write fails at a head that is not a power of two
    # CPU_ATTN: the release's `_get_attn_isa` (kvpolicy.policy.cpu_kernel); empty: the kernel writes each cell's
    # elements contiguously where the plan puts the cell
    write_isa: tuple[IsaRule, ...] = ()

    def __hash__(self) -> int:
        return hash((self.name, self.mla, self.logical_dims, tuple(sorted(self.orders.items())),
                     self.layer_buffers, self.supported_layouts, self.scale_views, self.kv_split,
                     self.unplanned_kv_cache_dtypes, self.int4_heads_power_of_two, self.write_isa))

    @model_validator(mode="before")
    @classmethod
    def _legacy_orders(cls, data: Any) -> Any:
        """Accept the pre-0.29 form: ``per_layer_order`` / ``cross_layer_order`` by head order
        (per-layer orders without the layer dim, each layer its own buffer)."""
        if isinstance(data, dict) and ("per_layer_order" in data or "cross_layer_order" in data):
            data = dict(data)
            orders: dict[Layout, tuple[Dim, ...]] = {}
            for h, order in (data.pop("per_layer_order", None) or {}).items():
                orders[LEGACY_NAMES[f"per_layer/{HeadOrder(h).value}"]] = (Dim.layer, *order)
            for h, order in (data.pop("cross_layer_order", None) or {}).items():
                orders[LEGACY_NAMES[f"cross_layer/{HeadOrder(h).value}"]] = tuple(order)
            data.setdefault("orders", orders)
            data.setdefault("layer_buffers", True)
            data.setdefault("scale_views", ScaleViews.assume_per_layer_contiguous)
        return data

    @model_validator(mode="after")
    def _orders_are_permutations(self) -> BackendProfile:
        logical = set(self.logical_dims)
        if len(logical) != len(self.logical_dims) or Dim.layer in logical or Dim.block not in logical:
            raise ValueError("logical_dims must name each dim once, include `block` and exclude `layer`")
        for layout, order in self.orders.items():
            if sorted(order) != sorted((*self.logical_dims, Dim.layer)):
                raise ValueError(f"{layout} order {order} must permute the logical dims plus `layer`")
        return self

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """The layouts this backend has a geometry for, in vLLM's enum order."""
        return tuple(x for x in Layout if x in self.orders)

    @property
    def head_orders(self) -> tuple[HeadOrder, ...]:
        return tuple(h for h in HeadOrder if any(x.head_order is h for x in self.orders))

    @property
    def supports_hnd(self) -> bool:
        return HeadOrder.HND in self.head_orders

    @property
    def indexes_kv_by_block_stride(self) -> bool:
        """True when every block-outermost layout really puts ``block`` outermost physically."""
        cross = [order for layout, order in self.orders.items() if layout.is_block_outermost]
        return bool(cross) and all(order[0] is Dim.block for order in cross)

    def order(self, layout: Layout) -> tuple[Dim, ...]:
        """The physical order of ``layout``; an `InputError` when this backend has no geometry for it."""
        try:
            return self.orders[layout]
        except KeyError:
            have = ", ".join(str(x) for x in self.layouts)
            raise input_error("layout", f"backend `{self.name}` has no geometry for layout `{layout}`",
                              f"use one of: {have}", code="unsupported-layout") from None

    def with_scale_views(self, scale_views: ScaleViews) -> BackendProfile:
        return self.model_copy(update={"scale_views": scale_views})


_B, _L, _KV, _N, _H, _D = Dim.block, Dim.layer, Dim.kv, Dim.token, Dim.head, Dim.dim
_MHA_LOGICAL = (_B, _KV, _N, _H, _D)
_LETTER = {"L": _L, "B": _B, "H": _H, "N": _N}


def packed_order(layout: Layout, mla: bool = False, kv_split: KVSplit = KVSplit.content) -> tuple[Dim, ...] | None:
    """vLLM's physical order for ``layout`` over ``[L, B, H, N, C]``, with C read as ``kv_split`` says.

    ``content``: C is K then V, ``(..., kv, dim)``; MLA: C is the latent, ``(..., dim)``.
    ``token_rows``: the ``N x C`` run is K's rows then V's, ``(..., kv, token, dim)``; None
    when the layout does not put the token dim directly outside C (the backend cannot view it).
    """
    dims = tuple(_LETTER[c] for c in layout.value[:-1])
    if mla:
        return (*dims, _D)
    if kv_split is KVSplit.token_rows:
        return (*dims[:-1], _KV, _N, _D) if dims[-1] is _N else None
    return (*dims, _KV, _D)


def nvfp4_order(layout: Layout) -> tuple[Dim, ...]:
    """vLLM's physical order of an nvfp4 cache (0.29+): the layout's letters over ``[L, B, H', N, C]``,
    the ``2H`` head slots ``H'`` being K's heads then V's (``kv`` outside ``head``; FLASHINFER's
    ``customize_spec`` sets ``num_head_slots = 2 * num_kv_heads``)."""
    out: list[Dim] = []
    for d in packed_order(layout, mla=True)[:-1]:
        out.extend((_KV, _H) if d is _H else (d,))
    return (*out, _D)


def packed_backend(name: str, *, mla: bool = False, layouts: tuple[Layout, ...] = tuple(Layout),
                   layer_buffers: bool = False, supported_layouts: tuple[Layout, ...] | None = None,
                   scale_views: ScaleViews = ScaleViews.stride_aware,
                   kv_split: KVSplit = KVSplit.content, unplanned_kv_cache_dtypes: tuple[str, ...] = (),
                   int4_heads_power_of_two: bool = False, write_isa: tuple[IsaRule, ...] = ()) -> BackendProfile:
    """A backend of released vLLM (0.27.1 on): logical ``[B, H, N, C]`` per layer, K and V in C as
    ``kv_split`` says; a geometry for each of ``layouts`` the backend can view."""
    if mla:
        logical = (_B, _H, _N, _D)
    elif kv_split is KVSplit.token_rows:
        logical = (_B, _H, _KV, _N, _D)
    else:
        logical = (_B, _H, _N, _KV, _D)
    orders = {x: order for x in layouts if (order := packed_order(x, mla, kv_split)) is not None}
    return BackendProfile(name=name, mla=mla, logical_dims=logical, orders=orders, layer_buffers=layer_buffers,
                          supported_layouts=supported_layouts, scale_views=scale_views, kv_split=kv_split,
                          unplanned_kv_cache_dtypes=unplanned_kv_cache_dtypes,
                          int4_heads_power_of_two=int4_heads_power_of_two, write_isa=write_isa)


def _dev_48412(name: str, cross_hnd: tuple[Dim, ...]) -> BackendProfile:
    return BackendProfile(
        name=name,
        logical_dims=_MHA_LOGICAL,
        orders={
            Layout.LBNHC: (_L, _B, _KV, _N, _H, _D),
            Layout.LBHNC: (_L, _B, _KV, _H, _N, _D),
            Layout.BLNHC: (_B, _L, _KV, _N, _H, _D),
            Layout.BHLNC: cross_hnd,
        },
        layer_buffers=True,
        scale_views=ScaleViews.assume_per_layer_contiguous,
    )


# The #48412 development state (the `issue-48412` profile): a separate K/V dim
# (logged shapes `(B, 2, L, H, N, D)`), every backend building its scale views
# as if each layer's buffer were contiguous. Not a release; never a default.
DEV_48412_BACKENDS: Mapping[str, BackendProfile] = MappingProxyType({
    "TRITON_ATTN": _dev_48412("TRITON_ATTN", (_B, _H, _L, _KV, _N, _D)),
    "FLASH_ATTN": _dev_48412("FLASH_ATTN", (_B, _H, _L, _KV, _N, _D)),
    "FLASHINFER": _dev_48412("FLASHINFER", (_B, _KV, _H, _L, _N, _D)),
    "FLASHMLA": BackendProfile(
        name="FLASHMLA",
        mla=True,
        logical_dims=(_B, _N, _D),
        orders={Layout.LBNHC: (_L, _B, _N, _D), Layout.BLNHC: (_L, _B, _N, _D)},
        layer_buffers=True,
        scale_views=ScaleViews.assume_per_layer_contiguous,
    ),
})
BACKENDS = DEV_48412_BACKENDS  # read-only: a profile registry every decision shares cannot be edited in place


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
