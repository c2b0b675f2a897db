"""Layout fingerprints: the canonical description of a KV cache layout that peers must share.

Two processes can exchange KV blocks, or run one model sharded over ranks,
only if their caches mean the same thing byte for byte. A `LayoutFingerprint`
is that meaning, and nothing else: the chosen placement and head order, the
backend's physical dim order for them, the shape of one buffer with the block
count left symbolic (``"B"``), the cell and page geometry, and where inline
scales live. Field by field: docs/fingerprint.md.

Deliberately left out:

- ``num_blocks``: it depends on free memory, and peers with different pools
  still exchange blocks (the shape template writes it as ``"B"``);
- the rule set and its digest: two rule sets that decide the same layout are
  compatible (`describe` reports the digest beside the fingerprint);
- the model's compute dtype and the backend's scale-view strategy, which
  change no byte of the cache.

``kernel_order`` is the order the backend's cache-write kernel gives a
block's elements: ``cells`` where each cell is its elements in a row where the
plan puts it (the GPU backends), else the ISA vLLM's CPU attention writes with
(``vec``, ``vec16``, ``amx``...), which the host CPU decides
(`kvpolicy.policy.cpu_kernel`): the same K and V are other bytes on a host
with AMX tiles.

Canonical form: `LayoutFingerprint.to_json` is JSON with sorted keys and no
spaces, built only from strings, integers, booleans, null and lists, so the
``sha256:`` digest is the same on every machine, Python version and
``PYTHONHASHSEED``. Any change to the fields or their meaning must bump
`FORMAT_VERSION`.

Pure Python, no torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any, Protocol

from kvpolicy.engine.peer_data import check_peer_value, load_peer_json
from kvpolicy.policy.backends import BackendProfile, Dim, nvfp4_order
from kvpolicy.policy.cpu_kernel import CpuHost, pick_order
from kvpolicy.policy.errors import input_error
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.quant import QuantMode
from kvpolicy.policy.spec import KVCacheGroups, KVCacheSpec

__all__ = [
    "FORMAT_VERSION",
    "NUM_BLOCKS_SYMBOL",
    "GroupFingerprint",
    "LayoutFingerprint",
    "canonical_kv_cache_dtype",
    "describe",
    "fingerprint",
    "fingerprint_of",
    "kernel_order",
]

# INVARIANT: bump on any change to the fields, their order of meaning, or how a value is derived;
# tests/engine/test_fingerprint.py pins the digest of one configuration to catch accidental changes.
FORMAT_VERSION = 2
NUM_BLOCKS_SYMBOL = "B"
SCALE_DTYPE = "float32"
NVFP4_SCALE_DTYPE = "float8_e4m3fn"
CELLS_ORDER = "cells"  # kernel_order of a backend that writes each cell contiguously where the plan puts it

# vLLM spellings of one format -> one canonical name ("auto" resolves to the cache dtype).
_KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


@dataclass(frozen=True)
class GroupFingerprint:
    """One KV cache group as a peer sees it: what it stores and how big a page is."""

    kind: str
    num_layers: int
    block_size: int
    page_bytes: int
    attention_groups: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "page_bytes": self.page_bytes,
            "attention_groups": self.attention_groups,
        }


@dataclass(frozen=True)
class LayoutFingerprint:
    """What every rank and every transfer peer must agree on; see docs/fingerprint.md."""

    placement: str
    head_order: str
    backend: str
    logical_dims: tuple[str, ...]
    physical_dims: tuple[str, ...]
    physical_shape: tuple[int | str, ...]
    num_buffers: int
    kind: str
    kv_factor: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    cache_dtype: str
    quant_mode: str
    kv_cache_dtype: str
    cell_bytes: int
    page_bytes: int
    kernel_order: str
    scale_placement: str
    scale_dtype: str | None
    scale_bytes: int
    scale_offset: int | None
    groups: tuple[GroupFingerprint, ...]
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, in a fixed key order (format_version first)."""
        out: dict[str, Any] = {"format_version": self.format_version}
        for f in fields(self):
            if f.name == "format_version":
                continue
            value = getattr(self, f.name)
            if f.name == "groups":
                value = [g.to_dict() for g in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_json(self) -> str:
        """The canonical text the digest is taken of: sorted keys, no spaces, ASCII."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of `to_json`."""
        return "sha256:" + hashlib.sha256(self.to_json().encode("ascii")).hexdigest()

    @property
    def layout(self) -> Layout:
        """The layout these bytes are in, read from the physical dims: placement and head
        order alone name three layouts each (LBHNC and LHBNC are both per_layer/HND)."""
        return _layout_of(self.placement, self.head_order, self.physical_dims)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutFingerprint:
        """Rebuild from `to_dict`'s form (a peer's handshake); raises `InputError` if it is not one."""
        if not isinstance(data, dict):
            raise input_error("fingerprint", f"a fingerprint is a JSON object, got {type(data).__name__}")
        check_peer_value(data, "fingerprint")  # a dict handed over is bounded as parsed JSON is
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            shown = json.dumps(version)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise input_error(
                "fingerprint.format_version",
                f"fingerprint format `{shown}` is not this kvpolicy's format `{FORMAT_VERSION}`",
                "run the same kvpolicy version on both sides",
                code="fingerprint-format",
            )
        stated = data.get("digest")  # dry-run's JSON writes the digest beside the fields: checked, not a field
        data = {k: v for k, v in data.items() if k != "digest"}
        expected = [f.name for f in fields(cls)]
        missing = sorted(set(expected) - set(data))
        extra = sorted(set(data) - set(expected))
        if missing or extra:
            parts = ([f"missing {', '.join(f'`{k}`' for k in missing)}"] if missing else []) + (
                [f"unknown {_keys_shown(extra)}"] if extra else [])
            raise input_error("fingerprint", "not a layout fingerprint: " + "; ".join(parts),
                              "pass LayoutFingerprint.to_dict() or to_json() from the peer")
        values = {name: data[name] for name in expected}
        bad = [name for name in expected if not _FIELD_CHECKS[name](values[name])]
        if bad:
            raise input_error("fingerprint", "not a layout fingerprint: wrong type or value for "
                              + ", ".join(f"`{name}`" for name in bad),
                              "sizes are positive integers and there is at least one group: pass "
                              "LayoutFingerprint.to_dict() or to_json() from the peer")
        try:  # `layout` parses these two: a peer's unknown pair must fail here, as an InputError
            Layout.parse(f"{values['placement']}/{values['head_order']}")
        except ValueError:
            raise input_error("fingerprint.placement", f"not a layout fingerprint: placement "
                              f"`{values['placement'][:40]!r}` with head_order `{values['head_order'][:40]!r}` "
                              "names no layout",
                              "pass LayoutFingerprint.to_dict() or to_json() from the peer") from None
        problem = _dims_problem(values)
        if problem is not None:
            raise input_error("fingerprint.physical_dims", f"not a layout fingerprint: {problem}",
                              "pass LayoutFingerprint.to_dict() or to_json() from the peer")
        for name in ("logical_dims", "physical_dims", "physical_shape"):
            values[name] = tuple(values[name])
        values["groups"] = tuple(GroupFingerprint(**g) for g in values["groups"])
        fp = cls(**values)
        if stated is not None and stated != fp.digest:
            shown = json.dumps(stated)
            raise input_error("fingerprint.digest", f"the stated digest {shown[:80]} is not these fields' digest "
                              f"`{fp.digest}`: the fingerprint was changed after it was written",
                              "pass the writer's fingerprint as it wrote it", code="fingerprint-digest")
        return fp

    @classmethod
    def from_json(cls, text: str | bytes) -> LayoutFingerprint:
        """Parse a peer's JSON (bounded in size and nesting: `kvpolicy.engine.peer_data`) and `from_dict` it."""
        return cls.from_dict(load_peer_json(text, "fingerprint"))


def _keys_shown(keys: list[str]) -> str:
    """A peer's unknown keys as a message shows them: ten at most, each cut to 40 characters."""
    shown = ", ".join(f"`{k if len(k) <= 40 else k[:40] + '...'}`" for k in keys[:10])
    return shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


_DIM_LETTERS = {"layer": "L", "block": "B", "head": "H", "token": "N"}


def _fitting_layouts(placement: str, head_order: str, physical_dims: tuple[str, ...]) -> list[Layout]:
    """The layouts with this placement and head order whose order of the dims present in
    ``physical_dims`` is theirs; a buffer of one layer has no layer dim, which is then outermost.
    ValueError if the pair names no layout."""
    legacy = Layout.parse(f"{placement}/{head_order}")
    seen = "".join(_DIM_LETTERS[d] for d in physical_dims if d in _DIM_LETTERS)
    if "L" not in seen:
        seen = "L" + seen
    return [x for x in Layout if x.placement == legacy.placement and x.head_order == legacy.head_order
            and "".join(c for c in x.value if c in seen) == seen]


def _layout_of(placement: str, head_order: str, physical_dims: tuple[str, ...]) -> Layout:
    """The layout of these bytes: the one that fits, else (MLA, no head dim: several fit, all
    with the same bytes) the placement/head_order name. ValueError if the pair names no layout."""
    fits = _fitting_layouts(placement, head_order, physical_dims)
    return fits[0] if len(fits) == 1 else Layout.parse(f"{placement}/{head_order}")


@functools.lru_cache(maxsize=64)
def _planned_orders(backend: str, placement: str, head_order: str) -> frozenset[tuple[str, ...]] | None:
    """Every physical dim order the profiles' backends named ``backend`` plan for a layout with
    this placement and head order; None when no profile knows the backend (a newer peer's)."""
    from kvpolicy.policy.releases import iter_profiles

    found: set[tuple[str, ...]] = set()
    known = False
    for profile in iter_profiles():
        if backend not in profile.backend_names():
            continue
        known = True
        b = profile.backend(backend)
        for layout in b.orders:
            if layout.placement.value == placement and layout.head_order.value == head_order:
                found.add(tuple(d.value for d in _physical_order(layout, b)[0]))
    return frozenset(found) if known else None


def _dims_problem(values: dict[str, Any]) -> str | None:
    """Why a peer's physical dims cannot describe its own placement and head order, or None."""
    dims, shape = values["physical_dims"], values["physical_shape"]
    known = {d.value for d in Dim}
    unknown = [d for d in dims if d not in known]
    if unknown:
        return f"`physical_dims` names {', '.join(repr(d[:40]) for d in unknown[:3])}, not dims of a KV cache"
    if len(set(dims)) != len(dims):
        return "`physical_dims` names a dim twice"
    if len(shape) != len(dims):
        return f"`physical_shape` has {len(shape)} sizes for {len(dims)} `physical_dims`"
    if not {"block", "token", "dim"} <= set(dims):
        return "`physical_dims` lacks block, token or dim"
    placement, head_order = values["placement"], values["head_order"]
    planned = _planned_orders(values["backend"], placement, head_order)
    if planned is not None:  # a backend some profile knows: its dims are the ones kvpolicy plans
        if tuple(dims) not in planned:
            return (f"`physical_dims` {list(dims)[:8]} is not how backend `{values['backend']}` lays out "
                    f"a {placement}/{head_order} layout in any profile")
    elif not _fitting_layouts(placement, head_order, tuple(dims)):
        return f"`physical_dims` {list(dims)[:8]} is not the order of any {placement}/{head_order} layout"
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_count(v: Any) -> bool:
    """A size every real layout has at least one of (a peer's 0 or -1 describes no cache at all)."""
    return _is_int(v) and v > 0


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_opt(check: Any) -> Any:
    return lambda v: v is None or check(v)


def _is_list(check: Any) -> Any:
    return lambda v: isinstance(v, (list, tuple)) and all(check(x) for x in v)


_GROUP_KEYS = {"kind": _is_str, "num_layers": _is_count, "block_size": _is_count, "page_bytes": _is_count,
               "attention_groups": _is_count}


def _is_group(v: Any) -> bool:
    return isinstance(v, dict) and set(v) == set(_GROUP_KEYS) and all(c(v[k]) for k, c in _GROUP_KEYS.items())


# How `from_dict` checks each field of a peer's fingerprint before trusting it.
_FIELD_CHECKS: dict[str, Any] = {
    **{name: _is_str for name in ("placement", "head_order", "backend", "kind", "cache_dtype", "quant_mode",
                                  "kv_cache_dtype", "scale_placement", "kernel_order")},
    **{name: _is_count for name in ("num_buffers", "kv_factor", "num_layers", "block_size", "num_kv_heads",
                                    "head_size", "cell_bytes", "page_bytes")},
    "scale_bytes": lambda v: _is_int(v) and v >= 0,
    "format_version": _is_int,
    "logical_dims": _is_list(_is_str),
    "physical_dims": _is_list(_is_str),
    "physical_shape": _is_list(lambda x: _is_int(x) or x == NUM_BLOCKS_SYMBOL),
    "scale_dtype": _is_opt(_is_str),
    "scale_offset": _is_opt(lambda v: _is_int(v) and v >= 0),
    "groups": lambda v: _is_list(_is_group)(v) and len(v) > 0,
}


def canonical_kv_cache_dtype(spec: KVCacheSpec) -> str:
    """vLLM's ``kv_cache_dtype`` with its aliases resolved: ``auto`` -> the cache dtype, ``fp8`` -> ``fp8_e4m3``.

    ``auto`` on a bfloat16 model and an explicit ``bfloat16`` store the same
    bytes, so peers that spell them differently still agree.
    """
    if spec.kv_cache_dtype == "auto":
        return spec.cache_dtype.value
    return _KV_CACHE_DTYPE_ALIASES.get(spec.kv_cache_dtype, spec.kv_cache_dtype)


def _physical_order(layout: Layout, backend: BackendProfile, nvfp4: bool = False) -> tuple[tuple[Dim, ...], int]:
    """The physical dims of one buffer, and whether layers get buffers of their own (1) or share one (0)."""
    order = nvfp4_order(layout) if nvfp4 else backend.order(layout)
    if backend.layer_buffers and layout.is_layer_compact:
        return order[1:], 1
    return order, 0


def kernel_order(spec: KVCacheSpec, backend: BackendProfile, host: CpuHost | None = None) -> str:
    """The order ``backend``'s cache-write kernel gives ``spec``'s blocks on ``host`` (default: this
    machine's CPU): `CELLS_ORDER`, or the byte order of the ISA the release's `_get_attn_isa` picks
    (CPU_ATTN: `vec`, whose order `vec16` writes too, `amx`...); an
    `InputError` where vLLM's kernel refuses the cache on that host."""
    if not backend.write_isa:
        return CELLS_ORDER
    return pick_order(backend.write_isa, dtype=spec.dtype.value, block_size=spec.block_size,
                    head_size=spec.head_size, kv_cache_dtype=spec.kv_cache_dtype,
                    host=host if host is not None else CpuHost.this_host())


def fingerprint_of(layout: Layout, spec: KVCacheSpec, backend: BackendProfile,
                   groups: KVCacheGroups | None = None, host: CpuHost | None = None,
                   written_as: str | None = None) -> LayoutFingerprint:
    """The fingerprint of ``layout`` for ``spec`` on ``backend``; ``groups`` defaults to ``spec`` alone;
    ``host`` is the CPU a CPU backend's kernel runs on (default: this machine's, `kernel_order`);
    ``written_as`` is the kernel order of bytes another writer than the backend's kernel wrote
    (kvpolicy's own runtime writes `CELLS_ORDER` for every backend)."""
    groups = groups if groups is not None else KVCacheGroups.single(spec)
    order, split = _physical_order(layout, backend, spec.quant_mode is QuantMode.nvfp4)
    sizes: dict[Dim, int | str] = {
        Dim.block: NUM_BLOCKS_SYMBOL,
        Dim.layer: spec.num_layers,
        Dim.kv: spec.kv_factor,
        Dim.token: spec.block_size,
        Dim.head: spec.num_kv_heads,
        Dim.dim: spec.cell_elements,
    }
    inline = spec.quant_mode.is_per_token_head
    return LayoutFingerprint(
        placement=layout.placement.value,
        head_order=layout.head_order.value,
        backend=backend.name,
        logical_dims=tuple(d.value for d in backend.logical_dims),
        physical_dims=tuple(d.value for d in order),
        physical_shape=tuple(sizes[d] for d in order),
        num_buffers=spec.num_layers if split else 1,
        kind=spec.kind.value,
        kv_factor=spec.kv_factor,
        num_layers=spec.num_layers,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        cache_dtype=spec.cache_dtype.value,
        quant_mode=spec.quant_mode.value,
        kv_cache_dtype=canonical_kv_cache_dtype(spec),
        cell_bytes=spec.cell_bytes,
        page_bytes=spec.page_size_bytes,
        kernel_order=written_as if written_as is not None else kernel_order(spec, backend, host),
        scale_placement="inline_tail" if inline else ("side_tail" if spec.scale_bytes_per_cell else "none"),
        scale_dtype=SCALE_DTYPE if inline else (NVFP4_SCALE_DTYPE if spec.scale_bytes_per_cell else None),
        scale_bytes=spec.scale_bytes_per_cell,
        scale_offset=spec.data_bytes_per_head if inline else None,
        groups=tuple(
            GroupFingerprint(g.spec.kind.value, g.spec.num_layers, g.spec.block_size, g.spec.page_size_bytes,
                             g.num_attention_groups)
            for g in groups.groups
        ),
    )


class Decided(Protocol):
    """What a fingerprint reads of a `engine.Decision` (typed structurally, so this module
    does not depend on the decision's)."""

    @property
    def layout(self) -> Layout: ...
    @property
    def context(self) -> Any: ...
    @property
    def ruleset(self) -> Any: ...


def fingerprint(decision: Decided) -> LayoutFingerprint:
    """The fingerprint of a decision's layout for its context."""
    ctx = decision.context
    return fingerprint_of(decision.layout, ctx.kv, ctx.backend, ctx.groups, ctx.options.cpu_host)


def describe(decision: Decided) -> dict[str, Any]:
    """The fingerprint, its digest and, beside them (not part of them), the rule set's digest."""
    fp = fingerprint(decision)
    return {"fingerprint": fp.to_dict(), "digest": fp.digest, "ruleset_digest": decision.ruleset.digest}
