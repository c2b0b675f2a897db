"""Layout planning: the exact memory geometry of a KV cache, computed without torch.

`plan_layout` turns a layout, a KV spec, a backend profile and a block count
into a `LayoutPlan`: every buffer's physical shape and strides, every layer's
logical view (shape, element strides, storage offset), the inline-scale views of
per-token-head modes and the views a block transfer copies. Nothing is
allocated, so a 100 GB cache plans in microseconds and ``kvpolicy dry-run``
never imports torch. `kvpolicy.engine.runtime.allocate` builds tensors that match the
plan exactly, and `kvpolicy.engine.verify` checks plans for overlapping views.

Geometry, as vLLM computes it: the backend's physical dim order for the head
order (with ``layer`` inserted for cross_layer) is allocated contiguously, and
each layer's logical view is that tensor permuted back, with layer ``i``'s view
starting at ``i * stride(layer)``. Worked example, Qwen2.5-0.5B on TRITON_ATTN,
HND, cross_layer, 176452 blocks (L=24, H=2, N=16, D=64, bf16)::

    physical (block, head, layer, kv, token, dim) = (176452, 2, 24, 2, 16, 64)
    strides                                       = (98304, 49152, 2048, 1024, 64, 1)
    layer 3's view (B, 2, N, H, D): offset 3*2048, strides (98304, 1024, 64, 49152, 1)

Padded pages (``spec.page_size_padded``): the padding is a trailing pad at the
end of the innermost ``block`` or ``layer`` unit that holds whole pages, so a
unit of ``k`` pages takes ``k * page_size_bytes``. Per-layer buffers and
cross-layer NHD thus step one page per layer of ``page_size_bytes``; cross-layer
HND, whose pages interleave by head, pads the end of each block's row. Either
way a block's row is ``L * page_size_bytes`` and the total is
``num_blocks * L * page_size_bytes``. The runtime allocates each buffer as raw
bytes and builds every view with ``as_strided``, so padded and unpadded plans
take the same path. Released vLLM's packed geometry (`BackendProfile.kv_split`
set) pads as vLLM 0.29+'s ``compute_layout_strides`` does: a head dim of size 1
(MLA) does not hold the padding out, and a padded page under LHBNC or BHLNC with
several heads, which vLLM refuses, is an `InputError`.

nvfp4 (``nvfp4``, ``nvfp4_4over6``; vLLM 0.34's FLASHINFER): vLLM views each layer as
``[B, 2H, N, D/2 + D/16]`` (K's H head slots, then V's: ``customize_spec``), and its
kernels read a dense page as two sides, K then V, each its ``H x N`` cells' fp4 data
followed by their fp8 block scales, cells in the page's head order (HND when the head
slots are outside the tokens, NHD when inside): vLLM's ``_nvfp4_kv_views`` and
``nvfp4_split_data_scale``. The plan's layer view is the data (a cell of ``D/2``
bytes), its scale views the ``D/16`` scale bytes of each cell. A layout whose layer
pages are not dense (the layer dim inside a block of several layers, BHLNC, or the
head dim outside the block, LHBNC) has no nvfp4 cells in vLLM (its forward raises),
and plans as an `InputError` saying so.

Addresses: `LayoutPlan.cell_offset` / `scale_offset` give the byte address of
one K or V cell and of its inline scale, and `LayoutPlan.vllm_allocation` the
buffers and per-layer ``[B, H, N, C]`` views as vLLM allocates them;
``tests/conformance/test_v034_geometry.py`` holds all three to vLLM 0.34.0.
"""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvpolicy.policy.backends import BackendProfile, Dim, KVSplit, nvfp4_order, packed_order
from kvpolicy.policy.errors import GeometryError, input_error
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.quant import QuantMode
from kvpolicy.policy.spec import KVCacheSpec

__all__ = [
    "BufferPlan",
    "ByteView",
    "LayerPlan",
    "LayoutPlan",
    "TensorView",
    "VllmAllocation",
    "plan_layout",
    "transfer_format",
]

SCALE_DTYPE = "float32"
SCALE_BYTES = 4
NVFP4_SCALE_DTYPE = "float8_e4m3fn"  # one scale per 16 fp4 values; a cell's scale view spans D/16 of them
_ROLE_KV_INDEX = {"k": 0, "v": 1}


@dataclass(frozen=True)
class BufferPlan:
    """One allocation: ``nbytes`` raw bytes seen as ``shape`` in physical dim order."""

    index: int
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # elements of `dtype`; contiguous unless pages are padded
    dtype: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "dims": list(self.dims),
            "shape": list(self.shape),
            "strides": list(self.strides),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class TensorView:
    """A strided view of one buffer in elements of the cache dtype."""

    buffer: int
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int

    def stride_of(self, dim: Dim) -> int:
        """The element stride of ``dim``; 0 when the view has no such dim (MLA's kv and head)."""
        return self.strides[self.dims.index(dim.value)] if dim.value in self.dims else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer,
            "dims": list(self.dims),
            "shape": list(self.shape),
            "strides": list(self.strides),
            "storage_offset": self.storage_offset,
        }


@dataclass(frozen=True)
class ByteView:
    """A strided view of one buffer in bytes: ``dtype`` elements at ``byte_offset``.

    Scale views hold fp32 scales (one per block, token, head); transfer views
    hold the raw bytes one block transfer copies (``dtype`` uint8, last dim 1).
    """

    buffer: int
    role: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    byte_strides: tuple[int, ...]
    byte_offset: int
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer,
            "role": self.role,
            "dims": list(self.dims),
            "shape": list(self.shape),
            "byte_strides": list(self.byte_strides),
            "byte_offset": self.byte_offset,
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class VllmAllocation:
    """The cache as vLLM allocates it, in bytes: what a connector registers and a kernel is handed.

    vLLM 0.29+ allocates each `KVCacheTensor` as ``nbytes`` raw bytes and gives every
    layer a ``[B, H, N, C]`` view (``C``: a cell's K and V content, or MLA's latent)
    whose strides are the layout's permutation of ``[L, B, H, N, C]`` (vLLM's
    ``compute_layout_strides`` / ``create_kv_cache_views``). ``buffers`` are the
    allocations seen whole in that physical order (dims among ``layer``, ``block``,
    ``head``, ``token``, ``content``; role ``buffer``), ``buffer_bytes`` their sizes,
    and ``layers`` the per-layer views (role ``kv_cache``). ``dtype`` is vLLM's element
    type of the views (fp8 caches are ``uint8`` there, ``int8_per_token_head`` is
    ``int8``): the same bytes `LayoutPlan` types by what its runtime writes. A backend
    without vLLM's packed geometry (the #48412 development state) reports its own dims.
    """

    buffers: tuple[ByteView, ...]
    buffer_bytes: tuple[int, ...]
    layers: tuple[ByteView, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffers": [{**b.to_dict(), "nbytes": n} for b, n in zip(self.buffers, self.buffer_bytes, strict=True)],
            "layers": [{"layer": i, **v.to_dict()} for i, v in enumerate(self.layers)],
        }


@dataclass(frozen=True)
class LayerPlan:
    """Where one layer lives: its logical view and, for per-token-head modes, its scale views."""

    layer: int
    view: TensorView
    scales: tuple[ByteView, ...]  # stride-aware; roles "k" and "v" ("k" alone for MLA); empty if no inline scales

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "view": self.view.to_dict(),
            "scales": [s.to_dict() for s in self.scales],
        }


@dataclass(frozen=True)
class LayoutPlan:
    """The full geometry of one KV cache: what `kvpolicy.engine.runtime.allocate` builds."""

    layout: Layout
    spec: KVCacheSpec
    backend: BackendProfile
    num_blocks: int
    physical_dims: tuple[str, ...]
    buffers: tuple[BufferPlan, ...]
    layers: tuple[LayerPlan, ...]
    transfer: tuple[ByteView, ...]  # in layer order; their rows concatenate to one block's L pages
    total_bytes: int

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def page_size_bytes(self) -> int:
        return self.spec.page_size_bytes

    @property
    def element_size(self) -> int:
        return self.spec.cache_dtype.size_bytes

    @property
    def block_row_bytes(self) -> int:
        """Bytes one block transfer moves: every layer's page, scales and padding included."""
        return self.num_layers * self.page_size_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": str(self.layout),
            "backend": self.backend.name,
            "spec": self.spec.model_dump(mode="json"),
            "num_blocks": self.num_blocks,
            "quant_mode": self.spec.quant_mode.value,
            "cache_dtype": self.spec.cache_dtype.value,
            "cell_bytes": self.spec.cell_bytes,
            "page_size_bytes": self.page_size_bytes,
            "physical_dims": list(self.physical_dims),
            "buffers": [b.to_dict() for b in self.buffers],
            "layers": [layer.to_dict() for layer in self.layers],
            "transfer": [t.to_dict() for t in self.transfer],
            "total_bytes": self.total_bytes,
        }

    @property
    def fingerprint(self) -> str:
        """A short hash of the whole plan; equal plans have equal fingerprints."""
        return _digest(self.to_dict())

    def cell_offset(self, layer: int, kv: int, block: int, token: int, head: int) -> tuple[int, int]:
        """Where one K or V cell starts: ``(buffer index, byte offset in that buffer)``.

        ``kv`` is 0 for K and 1 for V (MLA stores one latent per token: 0 only);
        ``block``, ``token`` and ``head`` index the layer's cache. The address is the
        one vLLM's cache-write kernel is handed for that cell, taken from the layer's
        real view (its storage offset and strides), so it is right under every layout,
        cross-layer included; the conformance tests hold it to vLLM's own views. The
        cell holds the stored values and, for per-token-head modes, the inline scale
        after them (`scale_offset`). Indices are any integers (numpy's and torch's too);
        an out-of-range one is an `InputError` (``out-of-range``) naming the argument and its
        valid range, a non-integer (a bool, a float, a string) one (``invalid-index``).
        """
        view, (kv, block, token, head) = self._cell_view(layer, kv, block, token, head)
        index = (view.storage_offset + kv * view.stride_of(Dim.kv) + block * view.stride_of(Dim.block)
                 + token * view.stride_of(Dim.token) + head * view.stride_of(Dim.head))
        return view.buffer, index * self.element_size

    def scale_offset(self, layer: int, kv: int, block: int, token: int, head: int) -> tuple[int, int]:
        """Where one cell's inline fp32 scale lives: ``(buffer index, byte offset in that buffer)``.

        Per-token-head modes (``fp8/int8/int4_per_token_head``) store one fp32 scale per
        (token, head) of K and of V, right after the cell's quantized values; this is
        where the backend's scale views (vLLM's ``_ensure_scale_caches``) read it. Any
        other ``kv_cache_dtype`` has no inline scale: an `InputError`. Indices as in
        `cell_offset`.
        """
        spec = self.spec
        if spec.quant_mode is QuantMode.nvfp4:  # the cell's D/16 fp8 block scales, after its side's data
            _view, (kv, block, token, head) = self._cell_view(layer, kv, block, token, head)
            sv = self.layers[_check_layer(self, layer)].scales[kv]
            at = dict(zip(sv.dims, sv.byte_strides, strict=True))
            return sv.buffer, sv.byte_offset + block * at["block"] + token * at["token"] + head * at["head"]
        if not spec.per_token_head:
            raise input_error("kv_cache_dtype", f"kv_cache_dtype `{spec.kv_cache_dtype}` stores no inline scales",
                              "scale_offset applies to fp8_per_token_head, int8_per_token_head, "
                              "int4_per_token_head, nvfp4 and nvfp4_4over6 caches", code="no-inline-scales")
        buffer, offset = self.cell_offset(layer, kv, block, token, head)
        return buffer, offset + spec.data_bytes_per_head

    def block_row_offset(self, layer: int) -> int:
        """Where layer ``layer``'s cell (kv 0, token 0, head 0) sits inside a transferred block row, in bytes.

        A block row is the plan's transfer rows of one block concatenated in layer order
        (``block_row_bytes``); a cell of the layer is at this offset plus its kv, token and
        head byte strides. Defined for every layout, also those that offer no transfer
        (LHBNC: the layer's place in layer order).
        """
        layer = _check_layer(self, layer)
        return _row_position(self, layer, self.layers[layer].view)

    @cached_property
    def vllm_allocation(self) -> VllmAllocation:
        """This plan's bytes as vLLM allocates and views them (see `VllmAllocation`)."""
        return _vllm_allocation(self)

    def _cell_view(self, layer: int, kv: int, block: int, token: int, head: int
                   ) -> tuple[TensorView, tuple[int, int, int, int]]:
        """The layer's view and (kv, block, token, head) as checked ints (numpy-like integers accepted)."""
        spec = self.spec
        layer = _check_layer(self, layer)
        if spec.kv_factor == 1:
            kv = _check_index("kv", kv, 1, "MLA stores one latent per token: use 0")
        else:
            kv = _check_index("kv", kv, 2, "use 0 for K, 1 for V")
        indices = (kv, _check_index("block", block, self.num_blocks), _check_index("token", token, spec.block_size),
                   _check_index("head", head, spec.num_kv_heads))
        return self.layers[layer].view, indices


def plan_layout(layout: Layout, spec: KVCacheSpec, backend: BackendProfile, num_blocks: int) -> LayoutPlan:
    """Compute the exact memory geometry of ``layout`` for ``spec`` on ``backend``; allocates nothing.

    Pure: returns a new plan and never mutates its inputs. The policy may
    forbid a layout (MLA cross-layer, say); the planner still plans it
    faithfully, so the verifier can show why.
    """
    _check_inputs(layout, spec, backend, num_blocks)
    nvfp4 = spec.quant_mode is QuantMode.nvfp4
    full_order = nvfp4_order(layout) if nvfp4 else backend.order(layout)
    # One buffer per layer (vLLM 0.28's runner, #48412's state) when the layer dim is outermost;
    # otherwise one buffer holds every layer (cross-layer, and every layout of vLLM 0.29+).
    split = backend.layer_buffers and layout.is_layer_compact
    order = full_order[1:] if split else full_order
    elem = spec.cache_dtype.size_bytes
    sizes = {
        Dim.block: num_blocks,
        Dim.layer: spec.num_layers,
        Dim.kv: spec.kv_factor,
        Dim.token: spec.block_size,
        Dim.head: spec.num_kv_heads,
        Dim.dim: spec.cell_elements,
    }
    packed = backend.kv_split is not None
    if packed and spec.page_size_padded is not None:
        _check_paddable(layout, spec)
    strides, numel = _physical_strides(order, sizes, spec, skip_singletons=packed)
    dtype = spec.cache_dtype.value
    shape = tuple(sizes[d] for d in order)
    dims = tuple(d.value for d in order)
    logical = backend.logical_dims
    lshape = tuple(sizes[d] for d in logical)
    lstrides = tuple(strides[d] for d in logical)
    ldims = tuple(d.value for d in logical)

    if split:
        buffers = tuple(
            BufferPlan(i, dims, shape, tuple(strides[d] for d in order), dtype, numel * elem)
            for i in range(spec.num_layers)
        )
        views = [TensorView(i, ldims, lshape, lstrides, 0) for i in range(spec.num_layers)]
    else:
        buffers = (BufferPlan(0, dims, shape, tuple(strides[d] for d in order), dtype, numel * elem),)
        views = [TensorView(0, ldims, lshape, lstrides, i * strides[Dim.layer]) for i in range(spec.num_layers)]

    if nvfp4:
        layers = tuple(_nvfp4_layer(i, layout, spec, strides, num_blocks) for i in range(spec.num_layers))
    else:
        layers = tuple(LayerPlan(i, v, _stride_aware_scales(v, spec, elem)) for i, v in enumerate(views))
    total = sum(b.nbytes for b in buffers)
    # INVARIANT: padding included, the cache is exactly num_blocks * L * page bytes.
    assert total == num_blocks * spec.num_layers * spec.page_size_bytes, (total, spec.page_size_bytes)
    return LayoutPlan(
        layout=layout,
        spec=spec,
        backend=backend,
        num_blocks=num_blocks,
        physical_dims=dims,
        buffers=buffers,
        layers=layers,
        transfer=_transfer_views(split, order, strides, sizes, spec, len(buffers)),
        total_bytes=total,
    )


def naive_scale_view(plan: LayoutPlan, layer: int, role: str) -> ByteView:
    """The scale view vLLM's 5-D-era Triton ``_ensure_scale_caches`` assumed for ``layer``.

    It ignores the layer's real view: base offset 0 in the layer's buffer, a
    block stride of one layer page, and NHD-contiguous cells inside the page.
    That is right for a per-layer NHD buffer; under cross_layer every layer's
    view lands on the same bytes (vLLM issue #48412). `kvpolicy.engine.verify` models
    the ``assume_per_layer_contiguous`` strategy with it.
    """
    spec = plan.spec
    if not spec.per_token_head:
        raise input_error("plan", f"quant mode `{spec.quant_mode.value}` stores no inline scales")
    layer = _check_layer(plan, layer)
    kv_index = _check_role(spec, role)
    cell, n, h = spec.cell_bytes, spec.block_size, spec.num_kv_heads
    if spec.kv_factor == 1:
        dims, shape, strides = ("block", "token"), (plan.num_blocks, n), (spec.page_size_bytes, cell)
    else:
        dims, shape = ("block", "token", "head"), (plan.num_blocks, n, h)
        strides = (spec.page_size_bytes, h * cell, cell)
    return ByteView(
        buffer=plan.layers[layer].view.buffer,
        role=role,
        dims=dims,
        shape=shape,
        byte_strides=strides,
        byte_offset=kv_index * n * h * cell + spec.data_bytes_per_head,
        dtype=SCALE_DTYPE,
    )


def transfer_format(plan: LayoutPlan) -> str:
    """A hash of what each byte of a transferred block row means, independent of ``num_blocks``.

    Two caches may exchange offloaded blocks exactly when their formats match:
    same quantization and cell, and every layer's cells at the same place in
    the row. Per-layer NHD and cross-layer NHD share a format; NHD and HND do not.
    """
    spec = plan.spec
    elem = plan.element_size
    layers = [
        [_row_position(plan, lp.layer, lp.view),
         *(lp.view.stride_of(d) * elem for d in (Dim.kv, Dim.token, Dim.head))]
        for lp in plan.layers
    ]
    return _digest(
        {
            "quant_mode": spec.quant_mode.value,
            "cache_dtype": spec.cache_dtype.value,
            "kv_factor": spec.kv_factor,
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "cell_bytes": spec.cell_bytes,
            "row_bytes": plan.block_row_bytes,
            "layers": layers,
        }
    )


# The codes of a plan refused for a deployment kvpolicy decides (as vLLM does) but lays out no cache for:
# a cell layout this release has that kvpolicy does not model, or one the release itself cannot write.
DECIDED_NOT_PLANNED = ("unplanned-kv-cache-dtype", "release-fails-at-write")


def _check_inputs(layout: Layout, spec: KVCacheSpec, backend: BackendProfile, num_blocks: int) -> None:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise input_error("num_blocks", f"num_blocks must be a positive integer, got `{num_blocks!r}`",
                          "pass the number of KV cache blocks to plan, at least 1")
    if not spec.kind.is_attention:
        raise input_error("spec.kind", f"a `{spec.kind.value}` spec has no paged KV layout to plan",
                          "plan attention groups only")
    backend.order(layout)  # an InputError naming the layouts the backend has a geometry for
    if backend.mla != (spec.kv_factor == 1):
        what = "one latent per token" if backend.mla else "separate K and V per head"
        raise input_error("backend", f"backend `{backend.name}` stores {what}, which spec kind "
                          f"`{spec.kind.value}` does not match",
                          "pair MLA specs with MLA backends and the rest with the others", code="backend-mismatch")
    if spec.kv_cache_dtype in backend.unplanned_kv_cache_dtypes:
        raise input_error("kv_cache_dtype", f"kvpolicy decides kv_cache_dtype `{spec.kv_cache_dtype}` on backend "
                          f"`{backend.name}` but cannot plan it: this release lays its cells out in a way kvpolicy "
                          "does not model (the profile's `unplanned_kv_cache_dtypes`)",
                          "plan it under a release whose layout kvpolicy models (kvpolicy releases lists them), "
                          "or use another kv_cache_dtype", code="unplanned-kv-cache-dtype")
    if (backend.int4_heads_power_of_two and spec.kv_cache_dtype == "int4_per_token_head"
            and spec.head_size & (spec.head_size - 1)):
        raise input_error("kv_cache_dtype", f"this vLLM release accepts kv_cache_dtype `int4_per_token_head` on "
                          f"backend `{backend.name}` at head size {spec.head_size}, but its first cache write fails "
                          "(its Hadamard transform takes power-of-two head sizes only: `AssertionError: Requires "
                          "power-of-2 dim`); kvpolicy decides the layout vLLM would, and refuses to plan a cache "
                          "that vLLM cannot write", "use int8_per_token_head or fp8_per_token_head at this head size, "
                          "or vLLM 0.32 or later (it transforms such heads in power-of-two blocks)",
                          code="release-fails-at-write")
    if spec.quant_mode is QuantMode.nvfp4:
        _check_nvfp4_backend(spec, backend)
    elem = spec.cache_dtype.size_bytes
    if spec.page_size_bytes % elem:
        raise input_error("spec.page_size_padded",
                          f"page_size_padded {spec.page_size_bytes} is not a multiple of the "
                          f"{elem}-byte `{spec.cache_dtype.value}` element",
                          f"pad pages to a multiple of {elem} bytes")
    if spec.cell_bytes % elem:  # cannot happen for the shipped dtypes; guards D' = cell / elem
        raise GeometryError(f"cell of {spec.cell_bytes} bytes is not whole `{spec.cache_dtype.value}` elements")


def _check_nvfp4_backend(spec: KVCacheSpec, backend: BackendProfile) -> None:
    """nvfp4's geometry is modelled for vLLM 0.29+'s allocation (one `KVCacheTensor` viewed per
    layer as ``[B, 2H, N, C]``, content K/V split); a backend allocating otherwise cannot be planned."""
    if backend.kv_split is KVSplit.content and not backend.layer_buffers and not backend.mla:
        return
    how = ("per-layer buffers of vLLM 0.24-0.28's gate" if backend.layer_buffers
           else "a geometry without vLLM 0.29+'s [B, H, N, C] views")
    raise input_error("kv_cache_dtype", f"kvpolicy decides kv_cache_dtype `{spec.kv_cache_dtype}` on backend "
                      f"`{backend.name}` but cannot plan it: its nvfp4 geometry is modelled for vLLM 0.29+'s "
                      f"allocation (each layer's [B, 2H, N, D/2 + D/16] view of one KVCacheTensor), and "
                      f"`{backend.name}` here allocates {how}",
                      "plan it under a vLLM 0.29+ profile (vllm-0.34), or use a kv_cache_dtype kvpolicy plans "
                      "for this profile (auto, fp8, ...)", code="unplanned-kv-cache-dtype")


def _nvfp4_layer(layer: int, layout: Layout, spec: KVCacheSpec, strides: dict[Dim, int], num_blocks: int
                 ) -> LayerPlan:
    """Layer ``layer``'s nvfp4 data view and K/V scale views, where vLLM's ``_nvfp4_kv_views`` finds them.

    vLLM reads a layer's ``[B, 2H, N, F]`` view (``F = D/2 + D/16``) only when its pages are dense:
    slot and token strides ``(N*F, F)`` (HND) or ``(F, 2H*F)`` (NHD). Each side (K, V) is then
    ``H*N*F`` bytes: ``H*N`` cells of ``D/2`` data bytes, then ``H*N`` cells of ``D/16`` scale bytes,
    cell ``(h, n)`` at index ``h*N + n`` (HND) or ``n*H + h`` (NHD)."""
    h, n, f = spec.num_kv_heads, spec.block_size, spec.cell_bytes
    data, scale = spec.data_bytes_per_head, spec.scale_bytes_per_cell
    slot, token = strides[Dim.head], strides[Dim.token]
    if (slot, token) == (n * f, f):
        head_order = "HND"
    elif (slot, token) == (f, 2 * h * f):
        head_order = "NHD"
    else:
        raise input_error("layout", f"layout `{layout}` leaves the pages of a `{spec.kv_cache_dtype}` cache not dense "
                          f"({spec.num_layers} layers, {num_blocks} blocks): vLLM 0.34's FLASHINFER reads nvfp4 K and "
                          "V only from dense pages (`_nvfp4_kv_views` raises \"NVFP4 KV pages must be dense\" at "
                          "the first forward), so kvpolicy has no cell addresses to plan",
                          "use a block-compact layout (LBNHC, LBHNC, BLNHC, BLHNC)", code="nvfp4-pages-not-dense")

    def cell_strides(width: int) -> tuple[int, int]:  # (head, token) byte strides of one side's cells
        return (n * width, width) if head_order == "HND" else (width, h * width)

    offset = layer * strides.get(Dim.layer, 0)
    side = h * n * f
    data_head, data_token = cell_strides(data)
    view = TensorView(0, ("block", "head", "token", "kv", "dim"), (num_blocks, h, n, 2, data),
                      (strides[Dim.block], data_head, data_token, side, 1), offset)
    scale_head, scale_token = cell_strides(scale)
    scales = tuple(ByteView(0, role, ("block", "token", "head"), (num_blocks, n, h),
                            (strides[Dim.block], scale_token, scale_head), offset + kv * side + h * n * data,
                            NVFP4_SCALE_DTYPE)
                   for kv, role in enumerate(("k", "v")))
    return LayerPlan(layer, view, scales)


def _check_paddable(layout: Layout, spec: KVCacheSpec) -> None:
    """vLLM 0.29+ pads a page only when every dim outside the page's ``[H, N, C]`` tail is L, B or
    of size 1 (``compute_layout_strides`` asserts it): LHBNC and BHLNC with several KV heads
    interleave pages by head, so a padded page has nowhere to go."""
    if layout.is_block_compact or spec.head_slots == 1:
        return
    heads = (f"{spec.num_kv_heads} KV heads" if spec.head_slots == spec.num_kv_heads
             else f"{spec.head_slots} head slots (K's {spec.num_kv_heads} KV heads, then V's)")
    raise input_error("spec.page_size_padded",
                      f"vLLM cannot pad pages (page_size_padded {spec.page_size_padded}) under layout `{layout}` "
                      f"with {heads}: the head dim lies outside the page, between "
                      "layers or blocks (vLLM's compute_layout_strides refuses it)",
                      "use a layout with the layer and block dims outermost (LBHNC, LBNHC, BLHNC, BLNHC), "
                      "or unpadded pages", code="unpaddable-layout")


def _physical_strides(order: tuple[Dim, ...], sizes: dict[Dim, int], spec: KVCacheSpec, *,
                      skip_singletons: bool = False) -> tuple[dict[Dim, int], int]:
    """Contiguous element strides in physical order, with page padding at the innermost page-holding unit.

    With ``skip_singletons`` (vLLM's packed geometry) a page dim of size 1 does not hold
    the padding out: MLA's single head under LHBNC or BHLNC pads each page as vLLM does.
    """
    elem = spec.cache_dtype.size_bytes
    page_dims = {d for d in order if d not in (Dim.block, Dim.layer) and not (skip_singletons and sizes[d] == 1)}
    seen: set[Dim] = set()
    pad_at = None
    for d in reversed(order):
        if d in (Dim.block, Dim.layer) and page_dims <= seen and pad_at is None:
            pad_at = d
        seen.add(d)
    strides: dict[Dim, int] = {}
    acc = 1
    for d in reversed(order):
        if d is pad_at:
            pages, rest = divmod(acc * elem, spec.real_page_size_bytes)
            # INVARIANT: the unit inside the padded dim is a whole number of real pages.
            assert rest == 0, (order, acc)
            acc = pages * spec.page_size_bytes // elem
        strides[d] = acc
        acc *= sizes[d]
    return strides, acc


def _stride_aware_scales(view: TensorView, spec: KVCacheSpec, elem: int) -> tuple[ByteView, ...]:
    """Scale views derived from the layer's real view: the fp32 at each cell's tail."""
    if not spec.per_token_head:
        return ()
    roles = ("k", "v") if spec.kv_factor == 2 else ("k",)
    dims = tuple(d for d in (Dim.block, Dim.token, Dim.head) if d.value in view.dims)
    out = []
    for role in roles:
        base = (view.storage_offset + _ROLE_KV_INDEX[role] * view.stride_of(Dim.kv)) * elem
        out.append(
            ByteView(
                buffer=view.buffer,
                role=role,
                dims=tuple(d.value for d in dims),
                shape=tuple(view.shape[view.dims.index(d.value)] for d in dims),
                byte_strides=tuple(view.stride_of(d) * elem for d in dims),
                byte_offset=base + spec.data_bytes_per_head,
                dtype=SCALE_DTYPE,
            )
        )
    return tuple(out)


def _transfer_views(
    split: bool, order: tuple[Dim, ...], strides: dict[Dim, int], sizes: dict[Dim, int], spec: KVCacheSpec,
    nbuffers: int,
) -> tuple[ByteView, ...]:
    elem = spec.cache_dtype.size_bytes
    page = spec.page_size_bytes
    b = sizes[Dim.block]
    if split:
        return tuple(
            ByteView(i, "block_row", ("block", "byte"), (b, page), (strides[Dim.block] * elem, 1), 0, "uint8")
            for i in range(nbuffers)
        )
    row = spec.num_layers * page
    if order[0] is Dim.block:
        return (ByteView(0, "block_row", ("block", "byte"), (b, row), (strides[Dim.block] * elem, 1), 0, "uint8"),)
    if strides[Dim.block] * elem == page:
        # layer outermost (MLA's cross-layer order): each (block, layer) page is contiguous,
        # but a block's pages lie one buffer-slab apart.
        return (
            ByteView(0, "block_row", ("block", "layer", "byte"), (b, spec.num_layers, page),
                     (page, strides[Dim.layer] * elem, 1), 0, "uint8"),
        )
    # The head dim outside the block (vLLM's LHBNC): a page is H runs apart, and block
    # transfers are not offered for it (`KVCache.offload` says so).
    return ()


def _row_position(plan: LayoutPlan, layer: int, view: TensorView) -> int:
    """Byte position of the layer's block-0 cell (0, 0, 0) inside a transferred block row."""
    addr = view.storage_offset * plan.element_size
    if len(plan.buffers) > 1:  # one buffer per layer: one row per layer, concatenated in layer order
        return view.buffer * plan.page_size_bytes + addr
    if not plan.transfer:  # no block row (LHBNC: a page is H runs apart): the layer's place in layer order
        return layer * plan.page_size_bytes
    (tv,) = plan.transfer
    if len(tv.shape) == 3:  # layer-outermost cross layout: the row is chunk `layer` of each slab
        layer_stride = tv.byte_strides[1]
        return (addr // layer_stride) * plan.page_size_bytes + addr % layer_stride
    return addr


def _check_layer(plan: LayoutPlan, layer: Any) -> int:
    return _check_index("layer", layer, plan.num_layers)


def _check_index(name: str, value: Any, size: int, why: str | None = None) -> int:
    """``value`` as an int in ``0..size-1``: any integer type (numpy's and torch's too, via ``__index__``).
    A boolean, float, string or None is an `InputError` saying it is no integer, not "out of range"."""
    valid = "0" if size == 1 else f"0..{size - 1}"
    index = None
    if not isinstance(value, bool):
        try:
            index = operator.index(value)
        except TypeError:
            pass
    if index is None:
        raise input_error(name, f"{name} must be an integer in {valid}, got {type(value).__name__} `{value!r}`",
                          why or f"use {valid}", code="invalid-index")
    if not 0 <= index < size:
        raise input_error(name, f"{name} `{index!r}` is out of range ({valid})", why or f"use {valid}",
                          code="out-of-range")
    return index


def _vllm_allocation(plan: LayoutPlan) -> VllmAllocation:
    """vLLM's raw buffers and per-layer ``[B, H, N, C]`` views of ``plan``.

    Packed geometry: the layout's permutation of ``[L, B, H, N, C]`` (``C`` = K and V
    cells, or MLA's latent) with the planner's padding rule, independent of where the
    backend finds K and V inside ``C`` (`kvpolicy.policy.backends.KVSplit`); the layer dim is
    dropped when each layer has a buffer of its own.
    """
    spec, elem = plan.spec, plan.element_size
    dtype = _vllm_dtype(spec)
    per_layer_buffers = len(plan.buffers) > 1
    if plan.backend.kv_split is None:  # not vLLM's packed geometry: the planner's own dims, in bytes
        buffers = tuple(ByteView(b.index, "buffer", b.dims, b.shape, tuple(st * elem for st in b.strides), 0, dtype)
                        for b in plan.buffers)
        layers = tuple(ByteView(lp.view.buffer, "kv_cache", lp.view.dims, lp.view.shape,
                                tuple(st * elem for st in lp.view.strides), lp.view.storage_offset * elem, dtype)
                       for lp in plan.layers)
        return VllmAllocation(buffers, tuple(b.nbytes for b in plan.buffers), layers)
    order = packed_order(plan.layout, mla=True)  # the layout's letters, then C
    if per_layer_buffers:
        order = tuple(d for d in order if d is not Dim.layer)
    # C: a head's K and V cells (MLA: the latent); nvfp4 gives K and V head slots of their own
    content = spec.cell_elements if spec.head_slots != spec.num_kv_heads else spec.kv_factor * spec.cell_elements
    sizes = {Dim.block: plan.num_blocks, Dim.layer: spec.num_layers, Dim.head: spec.head_slots,
             Dim.token: spec.block_size, Dim.dim: content}
    strides, _ = _physical_strides(order, sizes, spec, skip_singletons=True)
    names = {Dim.dim: "content"}
    dims = tuple(names.get(d, d.value) for d in order)
    buffers = tuple(ByteView(b.index, "buffer", dims, tuple(sizes[d] for d in order),
                             tuple(strides[d] * elem for d in order), 0, dtype) for b in plan.buffers)
    logical = (Dim.block, Dim.head, Dim.token, Dim.dim)
    shape = tuple(sizes[d] for d in logical)
    byte_strides = tuple(strides[d] * elem for d in logical)
    layers = []
    for lp in plan.layers:
        offset = 0 if per_layer_buffers else lp.layer * strides[Dim.layer] * elem
        # INVARIANT: the backend's split of C starts where the layer's view does.
        assert offset == lp.view.storage_offset * elem, (plan.layout, lp.layer)
        layers.append(ByteView(lp.view.buffer, "kv_cache", ("block", "head", "token", "content"), shape, byte_strides,
                               offset, dtype))
    return VllmAllocation(buffers, tuple(b.nbytes for b in plan.buffers), tuple(layers))


# vLLM's element type for a kv_cache_dtype where it differs from the cache dtype kvpolicy types
# the bytes with (vllm.utils.torch_utils.kv_cache_dtype_str_to_dtype; conformance-tested).
_VLLM_DTYPES = {
    "fp8": "uint8",
    "fp8_e4m3": "uint8",
    "fp8_e5m2": "uint8",
    "fp8_per_token_head": "uint8",
    "int8_per_token_head": "int8",
    "int4_per_token_head": "uint8",
}


def _vllm_dtype(spec: KVCacheSpec) -> str:
    return _VLLM_DTYPES.get(spec.kv_cache_dtype, spec.cache_dtype.value)


def _check_role(spec: KVCacheSpec, role: str) -> int:
    roles = ("k", "v") if spec.kv_factor == 2 else ("k",)
    if role not in roles:
        raise input_error("role", f"unknown role `{role}`", f"use one of: {', '.join(roles)}")
    return _ROLE_KV_INDEX[role]


def _digest(data: dict[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
