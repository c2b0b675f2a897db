"""Block exchange: whether blocks written under one layout fingerprint can be restored under another.

Three answers, from the two fingerprints (pure Python, no torch):

1. ``as_is``: every byte of a block row means the same on both sides (equal
   fingerprints, or fingerprints that differ only where no byte moves, e.g.
   two backends with one geometry).
2. ``transcode``: the cells are the same format (`kvpolicy.engine.block_format.cell_format`)
   but sit elsewhere in the row (layout, placement, head order, padding): a
   restore permutes them, byte for byte (`kvpolicy.engine.runtime.transcode`).
3. ``refused``: the cells differ (dtype, quantization, scales, heads, head size,
   block size, layers, the model's groups), or a side has no block format; no
   exact conversion exists, and `BlockExchange.error` names every field that differs.

`KVCache.restore` acts on the answer; ``kvpolicy compat`` prints it.

A connector that moves a layer's logical ``[B, H, N, C]`` view, slot by slot
(vLLM's ExampleConnector), never sees placement, head order or buffers: for it
two caches are interchangeable exactly when their `layer_view_identity` is
(the cells, the kernel's order of them and how C holds K and V), named by
`layer_view_digest`. A connector that moves raw blocks needs them as they
are (`block_digest` names that). `compare_transfer` answers for a connector:
what it moves (`transfer_unit`), and what it reconciles between peers itself
(`RECONCILED_BY`: NIXL pairs instances of different tensor-parallel sizes).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from kvpolicy.engine.agreement import Difference, check_compatible
from kvpolicy.engine.block_format import BlockFormat, block_format, cell_format, plan_of
from kvpolicy.engine.fingerprint import LayoutFingerprint
from kvpolicy.policy.errors import InputError, input_error

__all__ = [
    "LAYER_VIEW_CONNECTORS",
    "RECONCILED_BY",
    "BlockExchange",
    "ExchangeKind",
    "block_digest",
    "compare_blocks",
    "compare_transfer",
    "layer_view_digest",
    "layer_view_identity",
    "reconciled_differences",
    "transfer_unit",
]


class ExchangeKind(str, Enum):
    """How blocks move from one cache to another."""

    as_is = "as_is"
    transcode = "transcode"
    refused = "refused"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BlockExchange:
    """The answer of `compare_blocks`: the kind, every differing field, and why a refusal refuses."""

    kind: ExchangeKind
    differences: tuple[Difference, ...]  # every fingerprint field that differs, in fingerprint order
    cell_differences: tuple[Difference, ...]  # those that change what a cell holds: a refusal's reasons
    source_format: BlockFormat | None  # where each cell sits in the blocks' rows (None: no block format)
    target_format: BlockFormat | None  # ... and in the cache's
    reason: str = ""  # a refusal's cause when it is not a cell field (no block format, another format version)

    @property
    def ok(self) -> bool:
        return self.kind is not ExchangeKind.refused

    def error(self, where: str = "blocks") -> InputError:
        """The located `InputError` of a refusal (``cell-format-mismatch`` or ``transfer-geometry``)."""
        if self.cell_differences:
            n = len(self.cell_differences)
            body = "".join(f"\n    {d}" for d in self.cell_differences)
            return input_error(where, f"the blocks' cells differ from this cache's in {n} field{'s' if n > 1 else ''}"
                               f", so no exact conversion exists:{body}",
                               "restore into a cache of the same kv_cache_dtype, heads, head size, block size "
                               "and layers; kvpolicy transcodes layouts, placements, head orders and padding, "
                               "never the values", code="cell-format-mismatch")
        return input_error(where, f"blocks cannot be restored: {self.reason}",
                           "restore blocks between caches that offer block transfers, with one kvpolicy version",
                           code="transfer-geometry")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "differences": [str(d) for d in self.differences],
            "cell_differences": [d.field for d in self.cell_differences],
            "reason": self.reason,
            "source_format": None if self.source_format is None else self.source_format.to_dict(),
            "target_format": None if self.target_format is None else self.target_format.to_dict(),
        }


def compare_blocks(source: LayoutFingerprint, target: LayoutFingerprint, *, source_format: BlockFormat | None = None,
                   target_format: BlockFormat | None = None) -> BlockExchange:
    """How blocks written under ``source`` restore into a cache of ``target``.

    A side's block format, when given, is used as is; otherwise it is recovered from its
    fingerprint (`kvpolicy.engine.block_format.plan_of`). Answers are cached: a restore asks once
    per pair of layouts.
    """
    return _compare(source, target, source_format, target_format)


@functools.lru_cache(maxsize=256)
def _compare(source: LayoutFingerprint, target: LayoutFingerprint, source_format: BlockFormat | None,
             target_format: BlockFormat | None) -> BlockExchange:
    names = {"local_name": "source", "remote_name": "target"}
    result = check_compatible(source, target, **names)
    if result.format_mismatch:
        return BlockExchange(ExchangeKind.refused, result.differences, (), None, None,
                             "the fingerprints are of different formats (`format_version`)")
    cells = _cell_differences(source, target)
    try:
        src = source_format or block_format(plan_of(source))
        dst = target_format or block_format(plan_of(target))
    except InputError as exc:
        if cells:
            return BlockExchange(ExchangeKind.refused, result.differences, cells, None, None)
        return BlockExchange(ExchangeKind.refused, result.differences, (), None, None,
                             exc.diagnostics[0].message)
    if cells:
        return BlockExchange(ExchangeKind.refused, result.differences, cells, src, dst)
    kind = ExchangeKind.as_is if src == dst else ExchangeKind.transcode
    return BlockExchange(kind, result.differences, (), src, dst)


def _cell_differences(source: LayoutFingerprint, target: LayoutFingerprint) -> tuple[Difference, ...]:
    """The cell-format fields that differ between ``source`` and ``target``, each a `Difference`."""
    a, b = cell_format(source), cell_format(target)
    out = []
    for key in a:
        if a[key] == b[key]:
            continue
        if key == "code_dtype":  # derived: named only when it alone differs, by the field it comes from
            if not out:
                out.append(Difference("backend", source.backend, target.backend, "source", "target"))
            continue
        if key == "groups" and len(a[key]) == len(b[key]):
            out += [Difference(f"groups[{i}].{k}", ga[k], gb[k], "source", "target")
                    for i, (ga, gb) in enumerate(zip(a[key], b[key], strict=True)) for k in ga if ga[k] != gb[k]]
        else:
            out.append(Difference(key, a[key], b[key], "source", "target"))
    return tuple(out)


def layer_view_identity(fp: LayoutFingerprint) -> dict[str, Any]:
    """What the bytes of a layer's logical ``[B, H, N, C]`` view mean under ``fp``: the cell format
    (`cell_format`: dtype, quantization, scales, geometry, the kernel's order, the model's groups), the
    backend's logical dims (where C holds K and V: inside each cell or as K's rows then V's) and the
    format version. Placement, head order, buffers and padding are not in it: they do not change the view."""
    return {"format_version": fp.format_version, "logical_dims": list(fp.logical_dims), **cell_format(fp)}


def layer_view_digest(fp: LayoutFingerprint) -> str:
    """``sha256:<hex>`` of `layer_view_identity` as canonical JSON (sorted keys, no spaces, ASCII)."""
    text = json.dumps(layer_view_identity(fp), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def block_digest(fp: LayoutFingerprint) -> str:
    """``sha256:<hex>`` of what a block's raw bytes mean under ``fp``: its cell format and its block format
    (equal exactly when `compare_blocks` answers as is), else (no block format) the fingerprint's digest."""
    try:
        fmt: Any = block_format(plan_of(fp)).to_dict()
    except InputError:
        return fp.digest
    text = json.dumps({"format_version": fp.format_version, "cells": cell_format(fp), "block": fmt},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


# Connectors that move a layer's logical [B, H, N, C] view slot by slot, never a block's raw bytes (vLLM's
# ExampleConnector saves and loads each layer's view per slot): for them two deployments exchange when their
# `layer_view_digest` is equal, whatever their placement and head order. Every other connector (NixlConnector
# and its Pull/Push classes, OffloadingConnector, MooncakeConnector, MooncakeStoreConnector, MultiConnector,
# the LMCache connectors, any other) moves a block's bytes as they are and cannot transcode them.
LAYER_VIEW_CONNECTORS = frozenset({"ExampleConnector"})

# Fingerprint fields (``groups[]`` for any group) a connector reconciles between peers itself, so they may
# differ: vLLM's NIXL pairs a prefill and a decode instance of different tensor-parallel sizes (the KV heads
# per rank differ by its ``tp_ratio``) and, from 0.34, block sizes (``block_size_ratio``), and checks the
# remote regions' lengths against those ratios itself (``_validate_remote_agent_handshake``).
_NIXL_RECONCILED = frozenset({"num_kv_heads", "block_size", "physical_shape", "page_bytes", "groups[].page_bytes",
                              "groups[].block_size"})
RECONCILED_BY: dict[str, frozenset[str]] = {name: _NIXL_RECONCILED for name in (
    "NixlConnector", "NixlPullConnector", "NixlPushConnector")}
_DERIVED = frozenset({"physical_shape", "page_bytes", "num_buffers", "padding"})  # follow from the others


def transfer_unit(connector: str | None) -> str:
    """What ``connector`` moves: ``layer_view`` (`LAYER_VIEW_CONNECTORS`) or ``block`` (raw bytes)."""
    return "layer_view" if connector in LAYER_VIEW_CONNECTORS else "block"


def _named(diffs: tuple[Difference, ...] | list[Difference], writer: str, reader: str) -> tuple[Difference, ...]:
    """``diffs`` with the sides named by their deployments, a group's field left out where the same field of
    the whole cache is named (one group: ``groups[0].block_size`` says ``block_size`` again)."""
    top = {d.field for d in diffs}
    return tuple(replace(d, local_name=writer, remote_name=reader) for d in diffs
                 if not (d.field.startswith("groups[") and d.field.rsplit(".", 1)[-1] in top))


def _view_differences(a: LayoutFingerprint, b: LayoutFingerprint) -> list[Difference]:
    """The `layer_view_identity` fields that differ between ``a`` and ``b``."""
    x, y = layer_view_identity(a), layer_view_identity(b)
    out: list[Difference] = []
    for key in x:
        if x[key] == y[key]:
            continue
        if key == "groups" and len(x[key]) == len(y[key]):
            out += [Difference(f"groups[{i}].{k}", ga[k], gb[k]) for i, (ga, gb) in enumerate(zip(x[key], y[key],
                    strict=True)) for k in ga if ga[k] != gb[k]]
        else:
            out.append(Difference(key, x[key], y[key]))
    return out


def compare_transfer(connector: str | None, writer: LayoutFingerprint, reader: LayoutFingerprint,
                     writer_name: str = "writer", reader_name: str = "reader"
                     ) -> tuple[str, tuple[Difference, ...], str]:
    """What ``connector`` (`transfer_unit`) makes of blocks ``writer`` writes and ``reader`` reads:
    (``as_is`` or ``refused``, the fields that differ, named by the two sides, and why a refusal refuses).
    Layer views: the same `layer_view_digest`. Raw blocks: `compare_blocks` as is, nothing else (a transcode
    is a refusal here: the connector moves the bytes as they are)."""
    if transfer_unit(connector) == "layer_view":
        if layer_view_digest(writer) == layer_view_digest(reader):
            return "as_is", (), ""
        diffs = _named(_view_differences(writer, reader), writer_name, reader_name)
        return "refused", diffs, (f"a layer's [B, H, N, C] view means other bytes on each side, and {connector} "
                                  "moves views slot by slot")
    reconciled = RECONCILED_BY.get(connector or "", frozenset())
    if reconciled:
        fields = {re.sub(r"\[\d+\]", "[]", d.field) for d in check_compatible(writer, reader).differences}
        if fields and fields <= reconciled:
            return "as_is", (), ""  # what differs is what the connector reconciles itself
    ex = compare_blocks(writer, reader)
    if ex.kind is ExchangeKind.as_is:
        return "as_is", (), ""
    if ex.kind is ExchangeKind.transcode:
        diffs = _named([d for d in ex.differences if d.field not in _DERIVED] or list(ex.differences),
                       writer_name, reader_name)
        return "refused", diffs, (f"the same cells sit elsewhere in the block, and {connector or 'the connector'} "
                                  "moves raw blocks as they are: it cannot transcode")
    diffs = _named(ex.cell_differences or ex.differences, writer_name, reader_name)
    return "refused", diffs, ex.reason or "a block's cells differ"


def reconciled_differences(connector: str | None, writer: LayoutFingerprint, reader: LayoutFingerprint,
                           writer_name: str = "writer", reader_name: str = "reader"
                           ) -> tuple[tuple[Difference, ...], str]:
    """What differs between blocks ``writer`` writes and ``reader`` reads that ``connector`` reconciles itself
    (`RECONCILED_BY`), and why it may: ``((), "")`` unless `compare_transfer` answers as is while the blocks'
    bytes differ. An answer of "as is" must not read as "byte for byte" when the heads per rank differ."""
    if not RECONCILED_BY.get(connector or "") or compare_transfer(connector, writer, reader)[0] != "as_is":
        return (), ""
    ex = compare_blocks(writer, reader)
    if ex.kind is ExchangeKind.as_is:
        return (), ""
    diffs = list(ex.cell_differences) or [d for d in ex.differences if d.field not in _DERIVED] or list(ex.differences)
    return _named(diffs, writer_name, reader_name), (
        f"{connector} reconciles what differs itself (not byte for byte): vLLM's NIXL pairs instances of different "
        "tensor-parallel sizes (KV heads per rank, its tp_ratio) and block sizes (its block_size_ratio)")
