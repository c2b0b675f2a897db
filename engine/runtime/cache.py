"""`KVCache`: allocated tensors that match a `LayoutPlan`, with quantized writes and reads.

``write`` follows vLLM's ``reshape_and_cache``: K and V of shape (T, H, D),
one slot per token (``block * block_size + offset``; negative skips the
token). ``write_layers`` takes every layer's K and V at once, (L, T, H, D), for
a decode step: one check, one encode and one scatter per buffer instead of L
of each. The quantization arithmetic is in `kvpolicy.engine.runtime.quantize`. A write
validates every argument before it touches the cache, so a rejected write
changes no byte; then it encodes a chunk at a time into reused scratch and
scatters whole cells (data and inline scale together) with ``index_copy_``.
"""

from __future__ import annotations

import hashlib
import math
import threading
from typing import TYPE_CHECKING, Any

import torch

from kvpolicy.engine.block_format import BlockFormat, block_format
from kvpolicy.engine.exchange import BlockExchange
from kvpolicy.engine.fingerprint import CELLS_ORDER, LayoutFingerprint, fingerprint_of
from kvpolicy.engine.plan import LayoutPlan, transfer_format
from kvpolicy.engine.runtime.blocks import FingerprintLike, OffloadedBlocks
from kvpolicy.engine.runtime.cells import CellRows
from kvpolicy.engine.runtime.checks import check_device, check_layer, check_slots, check_slots_on_device, check_values
from kvpolicy.engine.runtime.quantize import decode_cells, encode_chunks, torch_dtype
from kvpolicy.engine.runtime.scratch import Scratch
from kvpolicy.engine.runtime.transfer import offload as offload_blocks
from kvpolicy.engine.runtime.transfer import restore as restore_blocks
from kvpolicy.engine.runtime.words import on_device
from kvpolicy.policy.errors import Diagnostic, GeometryError, input_error
from kvpolicy.policy.quant import QuantMode

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["KVCache"]

_F32_TINY = torch.finfo(torch.float32).tiny
_F32_MAX = torch.finfo(torch.float32).max
_SMALL = 64  # decode-sized writes: up to this many slots (as engine.runtime.checks and cells)


class KVCache:
    """A KV cache laid out exactly as its plan says; built by `kvpolicy.engine.runtime.allocate`.

    ``raw`` holds the allocations (flat uint8, ``plan.buffers[i].nbytes`` each);
    ``buffers`` are the same bytes as physical-order tensors of the cache dtype;
    ``layer_view(i)`` is layer ``i``'s logical view, the tensor an attention
    backend would be handed. ``decision`` is left for the engine to attach the
    `Decision` this cache was built from.
    """

    def __init__(self, plan: LayoutPlan, raw: tuple[torch.Tensor, ...], buffers: tuple[torch.Tensor, ...],
                 views: tuple[torch.Tensor, ...]) -> None:
        self.plan = plan
        self.raw = raw
        self.buffers = buffers
        self._views = views
        self.decision: Any = None
        self.device: torch.device = raw[0].device
        self.cells = CellRows(plan, raw)
        self._block_format: BlockFormat | None = None
        self._fingerprint: tuple[object, LayoutFingerprint] | None = None  # (the decision it was made for, it)
        spec = plan.spec
        self._mode = spec.quant_mode
        self._cache_dtype = torch_dtype(spec.cache_dtype.value)
        # The fp8 format of fp8_per_tensor codes: TRITON_ATTN (vLLM 0.28 and 0.34) writes and reads every
        # fp8 cache through a view as current_platform.fp8_dtype(), float8_e4m3fn, fp8_e5m2 included.
        self._code_dtype = self._cache_dtype
        if self._mode is QuantMode.fp8_per_tensor and plan.backend.name == "TRITON_ATTN":
            self._code_dtype = torch.float8_e4m3fn
        self.transfer_format: str = _transfer_format(plan, self._code_dtype)
        self._model_dtype = torch_dtype(spec.dtype.value)
        self._k_scales = [1.0] * spec.num_layers
        self._v_scales = [1.0] * spec.num_layers
        self._scale_tensor: torch.Tensor | None = None  # the scales above on the device, made when first used
        self._scratch = Scratch(self.device)
        # Writes encode into the shared `_scratch`: two threads writing at once (different layers of
        # one cache, say) would overwrite each other's cells before they are scattered. The lock makes
        # each write's encode and scatter one step; checks run outside it.
        self._write_lock = threading.Lock()
        # Decode-sized writes (up to _SMALL slots) on a GPU never wait for it: their slots are checked on
        # the device and skipped tokens handled there (`_store_on_device`). The CPU has no device to wait
        # for, and reads its few slots on the host, which is faster there.
        self.sync_free_decode = self.device.type != "cpu"

    def __repr__(self) -> str:
        return (f"KVCache({self.plan.layout}, backend={self.plan.backend.name}, blocks={self.plan.num_blocks}, "
                f"bytes={self.plan.total_bytes}, device={self.device})")

    @property
    def num_slots(self) -> int:
        return self.plan.num_blocks * self.plan.spec.block_size

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch held for writes: a write's extra memory, bounded by the encode chunk size."""
        return self._scratch.nbytes()

    def layer_view(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s logical view, in the backend's logical dim order."""
        return self._views[check_layer(layer, self.plan.num_layers)]

    # fp8_per_tensor scales ---------------------------------------------------------------------

    @property
    def k_scales(self) -> tuple[float, ...]:
        """Per-layer K scales of ``fp8_per_tensor`` (1.0 until set); unused by other modes."""
        return tuple(self._k_scales)

    @property
    def v_scales(self) -> tuple[float, ...]:
        return tuple(self._v_scales)

    def set_tensor_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Set layer ``layer``'s per-tensor K and V scales (positive, finite as fp32: the cache divides
        and multiplies by them in fp32, as vLLM's kernels do)."""
        check_layer(layer, self.plan.num_layers)
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check_tensor_scale(name, value)
        with self._write_lock:  # a write in another thread sees the old scales or the new, never a mix
            self._k_scales[layer] = float(k_scale)
            self._v_scales[layer] = float(v_scale)
            self._scale_tensor = None

    # writes and reads --------------------------------------------------------------------------

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Store K and V (T, H, D) at ``slot_mapping`` in ``layer``, quantized as the spec says.

        MLA specs store one latent: pass it as ``key`` with ``value=None``.
        """
        check_device(self.device, "write to")
        spec = self.plan.spec
        check_layer(layer, self.plan.num_layers)
        key = check_values("key", key, (_len(key), spec.num_kv_heads, spec.head_size), self.device)
        value = self._check_value(value, key)
        parts = [key.unsqueeze(0)] if value is None else [key.unsqueeze(0), value.unsqueeze(0)]
        self._check_and_store(layer, layer + 1, parts, slot_mapping, key.shape[0])

    def write_layers(self, keys: torch.Tensor, values: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Store K and V of every layer, (L, T, H, D), at ``slot_mapping``: one call per decode step.

        The same bytes as ``write(i, keys[i], values[i], slot_mapping)`` for every layer ``i``,
        with one input check, one encode of all layers and one scatter per buffer (one in all
        under ``cross_layer``, where every layer shares a buffer). MLA: ``values=None``.
        """
        check_device(self.device, "write to")
        spec = self.plan.spec
        shape = (self.plan.num_layers, _len(keys, 1), spec.num_kv_heads, spec.head_size)
        keys = check_values("keys", keys, shape, self.device, dims="(layers, tokens, heads, head_size)")
        values = self._check_value(values, keys, "values")
        self._check_and_store(0, self.plan.num_layers, [keys] if values is None else [keys, values], slot_mapping,
                              keys.shape[1])

    def _check_and_store(self, first: int, end: int, parts: list[torch.Tensor], slot_mapping: object,
                         tokens: int) -> None:
        if self.sync_free_decode and 0 < tokens <= _SMALL:
            slots = check_slots_on_device(slot_mapping, tokens, self.num_slots, self.device)
            with self._write_lock:
                self._store_on_device(first, end, parts, slots)
        else:
            slots, skips = check_slots(slot_mapping, tokens, self.num_slots, self.device, allow_negative=True)
            with self._write_lock:
                self._store(first, end, parts, slots, skips)

    def _check_value(self, value: object, key: torch.Tensor, name: str = "value") -> torch.Tensor | None:
        if self.plan.spec.kv_factor == 1:
            if value is not None:
                call = ("write(layer, latent, None, slot_mapping)" if name == "value"
                        else "write_layers(latents, None, slot_mapping)")
                raise input_error(name, "an MLA cache stores one latent per token: pass it as `key`", f"call {call}")
            return None
        dims = "(layers, tokens, heads, head_size)" if key.dim() == 4 else "(tokens, heads, head_size)"
        return check_values(name, value, tuple(key.shape), self.device, like=key, dims=dims)

    def _store(self, first: int, end: int, parts: list[torch.Tensor], slots: torch.Tensor, skips: bool) -> None:
        """Encode ``parts`` (layers first..end-1, T, H, D each) and scatter the cells to ``slots``, chunk by chunk.

        Every argument has been checked; nothing below can fail on user input, so the
        scatter is the first write to the cache (a rejected write changes no byte).
        """
        if slots.numel() == 0:
            return
        with torch.no_grad():
            keep = None
            if skips:
                keep = torch.nonzero(slots >= 0).squeeze(1)
                if keep.numel() == 0:
                    return
                slots = slots.index_select(0, keep)
            rows = self.cells
            blocks = rows.whole_blocks(slots)  # a prefill of whole blocks: scatter a block at a time
            index = None if blocks is not None else rows.index(first, end, slots)  # (layers, kv, T, H)
            n = self.plan.spec.block_size
            chunks = encode_chunks(parts, self._mode, self._code_dtype, self._tensor_scales(first, end),
                                   self._scratch, keep, align=n if blocks is not None else 1)
            # INVARIANT: the scatters below are the only writes to the cache.
            for a, t, cells in chunks:
                if blocks is not None:
                    rows.scatter_blocks(first + a.start, blocks[t.start // n : t.stop // n], cells)
                else:
                    assert index is not None
                    whole = t.stop - t.start == slots.numel()
                    rows.scatter(first + a.start, index[a] if whole else index[a, :, t], cells)

    def _store_on_device(self, first: int, end: int, parts: list[torch.Tensor], slots: torch.Tensor) -> None:
        """`_store` for a decode-sized write without reading anything on the host.

        Every token is encoded. A skipped token (negative slot) is written too, so that no
        host decision depends on the slots: to the rows of the first kept token with that
        token's own cells (index_copy_ writes the same bytes twice), or, when no token is
        kept, to slot 0's rows with the bytes already there (gathered first).
        """
        with torch.no_grad():
            t = slots.numel()
            kept = slots >= 0
            any_kept = kept.any()
            first_kept = kept.to(torch.int32).argmax().view(1)  # 0 when none is kept
            fallback = torch.where(any_kept, slots.index_select(0, first_kept), 0)
            target = torch.where(kept, slots, fallback)
            source = torch.where(kept, torch.arange(t, device=self.device), first_kept)
            rows = self.cells
            index = rows.index(first, end, target, host=False)  # (layers, kv, T, H or 1)
            # align=t: chunks split layers, never tokens, so `source` always points inside the chunk
            chunks = encode_chunks(parts, self._mode, self._code_dtype, self._tensor_scales(first, end),
                                   self._scratch, align=t)
            # INVARIANT: the scatters below are the only writes to the cache.
            for a, _, cells in chunks:
                layer_index = index[a]
                substituted = cells.index_select(2, source)
                data = torch.where(any_kept, substituted, rows.gather(first + a.start, layer_index, substituted))
                rows.scatter(first + a.start, layer_index, data)

    def read(self, layer: int, slot_mapping: torch.Tensor, dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V (T, H, D) stored at ``slot_mapping`` in ``layer``, dequantized to ``dtype``.

        ``dtype`` defaults to the spec's model dtype. MLA caches return ``(latent, None)``.
        """
        check_device(self.device, "read from")
        spec = self.plan.spec
        check_layer(layer, self.plan.num_layers)
        if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise input_error("dtype", f"cannot read into `{dtype}`", "use bfloat16, float16 or float32")
        slots, _ = check_slots(slot_mapping, None, self.num_slots, self.device, allow_negative=False,
                               distinct=False)
        with torch.no_grad():
            index = self.cells.index(layer, layer + 1, slots)
            rows = self.cells.rows[self.cells.buffer_of(layer)]
            cells = rows.index_select(0, index.view(-1)).view(torch.uint8)
            cells = cells.view(spec.kv_factor, slots.numel(), spec.num_kv_heads, spec.cell_bytes)
            scale = self._tensor_scales(layer, layer + 1)
            out = decode_cells(cells, self._mode, spec.head_size, self._code_dtype, dtype or self._model_dtype,
                               None if scale is None else scale.view(-1, 1, 1, 1))
        return (out[0], out[1]) if spec.kv_factor == 2 else (out[0], None)

    def _tensor_scales(self, first: int, end: int) -> torch.Tensor | None:
        """``fp8_per_tensor``: the K and V scales of layers first..end-1 as (layers, kv_factor, 1, 1, 1)."""
        if self._mode is not QuantMode.fp8_per_tensor:
            return None
        scales = self._scale_tensor  # one read: set_tensor_scales may reset it from another thread
        if scales is None:  # one host-to-device copy per change of the scales, not per write
            kv = self.plan.spec.kv_factor
            values = [[k, v][:kv] for k, v in zip(self._k_scales, self._v_scales, strict=True)]
            scales = self._scale_tensor = on_device(values, torch.float32, self.device).view(-1, kv, 1, 1, 1)
        return scales[first:end]

    # transfers ---------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> LayoutFingerprint:
        """The layout fingerprint of this cache's bytes (its decision's groups once ``decision`` is attached).

        Its ``kernel_order`` is always ``cells``: this cache's `write` puts each cell's elements in a row
        where the plan says, whatever backend was planned, so a CPU_ATTN cache of kvpolicy's holds other
        bytes than vLLM's CPU kernel writes (``vec``, ``amx``) and its blocks are told apart from an engine's.
        """
        decision = self.decision
        made = self._fingerprint
        if made is None or made[0] is not decision:
            groups = decision.context.groups if decision is not None else None
            # INVARIANT: the fingerprint says what `write` wrote (TODO(#34): CPU_ATTN's kernel orders)
            made = self._fingerprint = (decision, fingerprint_of(self.plan.layout, self.plan.spec, self.plan.backend,
                                                                 groups, written_as=CELLS_ORDER))
        return made[1]

    @property
    def block_format(self) -> BlockFormat:
        """Where each cell sits in an offloaded block row; an `InputError` for a layout without block transfers."""
        if self._block_format is None:
            self._block_format = block_format(self.plan)
        return self._block_format

    def offload(self, block_ids: torch.Tensor | Sequence[int], out: torch.Tensor | None = None) -> OffloadedBlocks:
        """Copy blocks out: `OffloadedBlocks` whose ``data`` is a CPU uint8 tensor (n, L, page_size_bytes),
        pinned when the cache is on CUDA, bound to this cache's ``fingerprint`` and ``block_format``.

        ``out``: a preallocated contiguous CPU tensor of that shape to fill instead (then ``data``).
        """
        return offload_blocks(self, block_ids, out)

    def restore(self, block_ids: torch.Tensor | Sequence[int], data: OffloadedBlocks | torch.Tensor, *,
                source: FingerprintLike | None = None, assume_same_layout: bool = False,
                source_format: str | None = None) -> BlockExchange:
        """Write offloaded blocks back into ``block_ids``: as is, transcoded, or refused.

        ``data`` from `offload` carries its writer's layout: blocks of this cache's format
        are copied as they are; the same cells in another layout, placement, head order
        or padding are transcoded byte for byte; other cells (dtype, quantization,
        heads, head size, block size, layers) are an `InputError` naming every field
        that differs. A bare tensor needs ``source=`` (the writer's fingerprint, object,
        dict or JSON) or ``assume_same_layout=True``; ``source_format=`` (the writer's
        ``transfer_format``) still works, deprecated. Returns the `BlockExchange` it acted on.
        """
        return restore_blocks(self, block_ids, data, source=source, assume_same_layout=assume_same_layout,
                              source_format=source_format)

    # geometry ----------------------------------------------------------------------------------

    def verify(self, *, geometry: bool = True) -> None:
        """Raise `GeometryError` unless every tensor still has the plan's bytes, shape, strides and
        offset, and (``geometry``) no two of the plan's views write the same byte under the
        backend's scale-view strategy (`kvpolicy.engine.verify`)."""
        problems: list[str] = []
        for bp, raw, buf in zip(self.plan.buffers, self.raw, self.buffers, strict=True):
            where = f"buffer[{bp.index}]"
            if raw.dtype != torch.uint8 or raw.numel() != bp.nbytes or not raw.is_contiguous():
                problems.append(f"{where}: raw bytes `{raw.dtype}` x {raw.numel()}, plan {bp.nbytes} uint8")
            if raw.untyped_storage().nbytes() != bp.nbytes:
                problems.append(f"{where}: storage of {raw.untyped_storage().nbytes()} bytes, plan {bp.nbytes}")
            problems += _compare(where, buf, raw, bp.dtype, bp.shape, bp.strides, 0)
        for lp, view in zip(self.plan.layers, self._views, strict=True):
            v = lp.view
            problems += _compare(f"layer[{lp.layer}]", view, self.raw[v.buffer], self.plan.spec.cache_dtype.value,
                                 v.shape, v.strides, v.storage_offset)
        if problems:
            raise GeometryError("the KV cache no longer matches its plan",
                                [Diagnostic(p.split(":")[0], 0, 0, "plan-mismatch", p) for p in problems])
        if geometry:
            from kvpolicy.engine.verify import check_plan

            check_plan(self.plan)


def _transfer_format(plan: LayoutPlan, code_dtype: torch.dtype) -> str:
    """The plan's `transfer_format`, told apart by the format the cells' codes are written in where that is
    not the cache dtype (TRITON_ATTN's per-tensor fp8 codes are e4m3 in an ``fp8_e5m2`` cache): the same
    bytes of another code format are other values, which the deprecated ``restore(..., source_format=)``
    must refuse as `OffloadedBlocks` are refused (their cell formats differ in ``code_dtype``)."""
    plain = transfer_format(plan)
    if code_dtype == torch_dtype(plan.spec.cache_dtype.value):
        return plain
    codes = str(code_dtype).removeprefix("torch.")
    return hashlib.sha256(f"{plain}:codes={codes}".encode()).hexdigest()[:len(plain)]


def _check_tensor_scale(name: str, value: object) -> None:
    """``value`` as the cache uses it, in fp32: a normal, finite, positive number there.

    Checked after the conversion, not before: 1e39 is finite as a Python float but
    infinite in fp32 (every read NaN), and ``10**400`` does not even convert to a float.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise input_error(name, f"`{name}` must be a positive finite number, got `{type(value).__name__}`")
    try:
        as_float = float(value)
    except OverflowError:  # an int past float64's range
        as_float = math.inf
    stored = torch.tensor(as_float, dtype=torch.float32).item()  # IEEE rounding: past fp32's max, inf
    if not (math.isfinite(stored) and stored > 0):
        raise input_error(name, f"`{name}` must be a positive finite number in fp32, got `{_short(value)}`",
                          f"use a scale in [{_F32_TINY:.3e}, {_F32_MAX:.3e}]")
    if stored < _F32_TINY:  # subnormal in fp32: codes x / s would all saturate
        raise input_error(name, f"`{name}` `{value!r}` is below fp32's normal range, where the cache computes "
                          "with it", f"use a scale in [{_F32_TINY:.3e}, {_F32_MAX:.3e}]")


def _short(value: int | float) -> str:
    """``repr(value)``, or a description of an integer too long to print (Python refuses past 4,300 digits)."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _len(t: object, dim: int = 0) -> int:
    # a nested tensor has no sizes to read (check_values then refuses it by name)
    return int(t.shape[dim]) if isinstance(t, torch.Tensor) and not t.is_nested and t.dim() > dim else -1


def _compare(where: str, t: torch.Tensor, raw: torch.Tensor, dtype: str, shape: tuple[int, ...],
             strides: tuple[int, ...], offset: int) -> list[str]:
    got = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), t.storage_offset())
    want = (dtype, shape, strides, offset)
    out = []
    if got != want:
        out.append(f"{where}: (dtype, shape, strides, offset) {got}, plan {want}")
    if t.device == raw.device and t.device.type != "meta" and (
        t.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()
    ):
        out.append(f"{where}: not a view of its buffer's allocation")
    return out
