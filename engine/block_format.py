"""Block formats: what each byte of a transferred KV block row means.

`KVCache.offload` moves a block as one row of ``L * page_bytes`` bytes: the
plan's transfer rows in layer order, inline scales and padding included. Two
facts give every byte of that row its meaning:

- the **cell format** (`cell_format`): what one (token, head) cell of K or V
  holds: its dtype and quantization, where its scale sits, and the geometry of
  the data it belongs to (layers, heads, head size, block size);
- the **block format** (`BlockFormat`): where each (layer, kv, token, head) cell
  starts in the row, ``layer * layer_stride + kv * kv_stride + token *
  token_stride + head * head_stride``, every cell ``cell_bytes`` contiguous
  bytes (its data, then its inline scale), the rest padding.

Worked example, 4 layers, H=2, N=16, D=64, bf16 (cell 128 B, page 8192 B):
``BLNHC`` under ``issue-48412`` (cross-layer, a K/V dim outside the tokens)
has strides layer 8192, kv 4096, token 256, head 128; ``LBHNC`` under
``vllm-0.34`` (K and V packed in each head's content) layer 8192, kv 128,
token 256, head 4096. The rows are the same size and the cells the same
format, so one is a permutation of the other (`kvpolicy.engine.exchange`).

A peer's blocks arrive with its `LayoutFingerprint` only; `plan_of` recovers
the geometry behind it from the release profiles (the one plan whose
fingerprint it is). Pure Python, no torch: ``kvpolicy compat`` reads formats.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint_of
from kvpolicy.engine.plan import LayoutPlan, plan_layout
from kvpolicy.policy.backends import Dim
from kvpolicy.policy.errors import InputError, input_error
from kvpolicy.policy.quant import ModelDtype, QuantMode
from kvpolicy.policy.spec import AttentionKind, KVCacheSpec

__all__ = ["CELL_FIELDS", "BlockFormat", "block_format", "cell_format", "code_dtype", "descriptors_per_block",
           "plan_of"]

# The fingerprint fields that say what a cell holds; transcoding never changes them.
CELL_FIELDS = ("kind", "kv_factor", "num_layers", "block_size", "num_kv_heads", "head_size", "cache_dtype",
               "quant_mode", "kv_cache_dtype", "cell_bytes", "kernel_order", "scale_placement", "scale_dtype",
               "scale_bytes", "scale_offset")


@dataclass(frozen=True)
class BlockFormat:
    """Where each cell of a transferred block row starts, in bytes (see the module docstring).

    A dim of size one has stride 0, so that two formats are equal exactly when their rows are.
    """

    num_layers: int
    kv_factor: int
    block_size: int
    num_kv_heads: int
    cell_bytes: int
    page_bytes: int
    layer_stride: int
    kv_stride: int
    token_stride: int
    head_stride: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one block row: every layer's page, scales and padding included."""
        return self.num_layers * self.page_bytes

    @property
    def cell_shape(self) -> tuple[int, int, int, int]:
        """(layers, kv, tokens, heads): the cells of one block."""
        return (self.num_layers, self.kv_factor, self.block_size, self.num_kv_heads)

    @property
    def cell_strides(self) -> tuple[int, int, int, int]:
        """The byte strides of `cell_shape`'s dims inside a row."""
        return (self.layer_stride, self.kv_stride, self.token_stride, self.head_stride)

    @property
    def padding_bytes(self) -> int:
        """Bytes of a row that belong to no cell."""
        return self.row_bytes - math.prod(self.cell_shape) * self.cell_bytes

    def cell_offset(self, layer: int, kv: int, token: int, head: int) -> int:
        """Where cell (layer, kv, token, head) starts in a block row."""
        return layer * self.layer_stride + kv * self.kv_stride + token * self.token_stride + head * self.head_stride

    def to_dict(self) -> dict[str, Any]:
        return {"row_bytes": self.row_bytes, "cell_bytes": self.cell_bytes, "page_bytes": self.page_bytes,
                "cell_shape": list(self.cell_shape), "cell_strides": list(self.cell_strides),
                "padding_bytes": self.padding_bytes}


def block_format(plan: LayoutPlan) -> BlockFormat:
    """The block format of ``plan``'s transfers; an `InputError` (``transfer-geometry``) where it has none."""
    spec = plan.spec
    if not plan.transfer:
        raise input_error("layout", f"layout `{plan.layout}` keeps no page of a block contiguous (the head dim "
                          "lies outside the block dim), so kvpolicy offers no block transfer for it",
                          "offload from a block-compact layout (LBHNC, LBNHC, BLHNC, BLNHC)",
                          code="transfer-geometry")
    if spec.quant_mode is QuantMode.nvfp4:
        raise input_error("kv_cache_dtype", f"`{spec.kv_cache_dtype}` keeps a cell's scales apart from its data, "
                          "so a cell is not one run of bytes and kvpolicy has no block format for it",
                          "move such blocks between caches of one layout (the bytes as they are)",
                          code="transfer-geometry")
    elem = plan.element_size
    strides = {(lp.view.stride_of(Dim.kv) * elem, lp.view.stride_of(Dim.token) * elem,
                lp.view.stride_of(Dim.head) * elem) for lp in plan.layers}
    # INVARIANT: a plan's layers differ only in where they start (their buffer and offset).
    assert len(strides) == 1, strides
    ((kv, token, head),) = strides
    offsets = [plan.block_row_offset(i) for i in range(plan.num_layers)]
    layer = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    # INVARIANT: layer i's cells start i layer strides into the row (a page apart, or the
    # block-outermost buffer's layer stride); BlockFormat relies on it.
    assert offsets == [i * layer for i in range(len(offsets))], offsets
    shape = (spec.num_layers, spec.kv_factor, spec.block_size, spec.num_kv_heads)
    # a dim of one has no stride that means anything: 0, so that equal rows have equal formats (MLA's kv and head)
    strides = tuple(0 if size == 1 else stride for size, stride in zip(shape, (layer, kv, token, head), strict=True))
    return BlockFormat(*shape, spec.cell_bytes, spec.page_size_bytes, *strides)


def descriptors_per_block(plan: LayoutPlan) -> int:
    """The contiguous runs one block takes in the cache: what a transfer engine registers per block
    (1 when the block is outermost, one a layer otherwise; 0 where no transfer is offered)."""
    return sum(math.prod(tv.shape[1:-1]) for tv in plan.transfer)


def code_dtype(fp: LayoutFingerprint) -> str:
    """The element format of a cell's codes: the cache dtype, except per-tensor fp8 on TRITON_ATTN,
    which writes and reads every fp8 cache as ``float8_e4m3fn`` (vLLM 0.28 and 0.34), e5m2 included."""
    if fp.quant_mode == QuantMode.fp8_per_tensor.value and fp.backend == "TRITON_ATTN":
        return "float8_e4m3fn"
    return fp.cache_dtype


def cell_format(fp: LayoutFingerprint) -> dict[str, Any]:
    """What a cell of ``fp``'s blocks holds: the `CELL_FIELDS`, the codes' format (`code_dtype`) and
    the model's groups (their page sizes aside: padding moves no cell). Equal for exchangeable cells."""
    out: dict[str, Any] = {name: getattr(fp, name) for name in CELL_FIELDS}
    out["code_dtype"] = code_dtype(fp)
    out["groups"] = [{k: v for k, v in g.to_dict().items() if k != "page_bytes"} for g in fp.groups]
    return out


@functools.lru_cache(maxsize=128)
def plan_of(fp: LayoutFingerprint) -> LayoutPlan:
    """A one-block plan whose fingerprint is ``fp`` (its groups aside): the geometry behind a peer's blocks.

    Searched in every release profile that has ``fp.backend``; an `InputError`
    (``unknown-block-format``) when none lays these bytes out, e.g. a backend of a newer kvpolicy.
    """
    spec = _spec_of(fp)
    wanted = replace(fp, groups=())
    for profile in _profiles_with(fp.backend):
        backend = profile.backend(fp.backend)
        if fp.layout not in backend.orders:
            continue
        # the kernel order is the host's, not the geometry's: any host's plan is this one's
        if replace(fingerprint_of(fp.layout, spec, backend, written_as=fp.kernel_order), groups=()) == wanted:
            return plan_layout(fp.layout, spec, backend, 1)
    raise input_error("fingerprint", f"no release profile of this kvpolicy lays out `{fp.layout}` blocks of backend "
                      f"`{fp.backend}` as this fingerprint says, so the bytes cannot be interpreted",
                      "restore the `OffloadedBlocks` that `offload` returned, or run the same kvpolicy version on "
                      "both sides", code="unknown-block-format")


def _profiles_with(backend: str) -> list[Any]:
    from kvpolicy.policy.releases import iter_profiles

    return [p for p in iter_profiles() if backend in p.backend_names()]


def _spec_of(fp: LayoutFingerprint) -> KVCacheSpec:
    """The KV spec whose bytes ``fp`` describes (the model dtype only where it is the cache's)."""
    fields: dict[str, Any] = {"num_layers": fp.num_layers, "block_size": fp.block_size,
                              "num_kv_heads": fp.num_kv_heads, "head_size": fp.head_size}
    try:
        fields["kind"] = AttentionKind(fp.kind)
        if fp.quant_mode == QuantMode.none.value:
            fields.update(kv_cache_dtype="auto", dtype=ModelDtype(fp.cache_dtype))
        else:
            fields["kv_cache_dtype"] = fp.kv_cache_dtype
        spec = KVCacheSpec(**fields)
        if fp.page_bytes != spec.page_size_bytes:
            spec = KVCacheSpec(**fields, page_size_padded=fp.page_bytes)
    except (ValueError, ValidationError, InputError) as exc:
        raise input_error("fingerprint", f"the fingerprint describes no KV cache kvpolicy can lay out: "
                          f"{str(exc).splitlines()[0]}", "pass a fingerprint of a cache kvpolicy planned",
                          code="unknown-block-format") from None
    return spec
