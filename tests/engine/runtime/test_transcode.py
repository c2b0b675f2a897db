"""Blocks restored across layouts and releases (kvpolicy.engine.exchange, engine.runtime.transcode).

For every pair of layouts the release profiles `issue-48412`, `vllm-0.28` and `vllm-0.34` allow
(each backend that has the kv_cache_dtype, each layout it lays out with block transfers), blocks
written with random K/V under one and restored under the other read back the same values, and
every cell (its codes and inline scale) holds the same bytes at the target plan's own addresses;
the exchange is ``as_is`` exactly when the target's rows are the source's bytes. Caches whose
cells differ are refused, naming every differing field, and keep every byte.

The cells are read through the plans' layer views (`cells_at`), never through `BlockFormat`, so the
check is independent of the transcoder. Cost: about 10 s on the 2-core CI machine (most of it the
exhaustive pairs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.block_format import CELL_FIELDS
from kvpolicy.engine.exchange import ExchangeKind, compare_blocks
from kvpolicy.engine.plan import LayoutPlan, plan_layout
from kvpolicy.engine.runtime import KVCache, OffloadedBlocks, allocate, transfer
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import AttentionKind, KVCacheSpec

PROFILES = ("issue-48412", "vllm-0.28", "vllm-0.34")
DTYPES = ("auto", "float16", "fp8", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head",
          "int4_per_token_head")
GEOMETRY = {"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_size": 16}
NUM_BLOCKS = 6
MOVED = ([4, 0, 3], [1, 5, 2])  # source blocks -> target blocks


@dataclass(frozen=True)
class Deployment:
    """One cache a release can lay out: profile, attention backend and layout."""

    profile: str
    backend: str
    layout: Layout

    def __str__(self) -> str:
        return f"{self.profile}/{self.backend}/{self.layout}"

    @property
    def mla(self) -> bool:
        return get_profile(self.profile).backend(self.backend).mla

    def plan(self, dtype: str, num_blocks: int = NUM_BLOCKS, **geometry: int) -> LayoutPlan:
        fields = {**GEOMETRY, **geometry}
        pad = fields.pop("pad", 0)
        if self.mla:
            fields.update(kind=AttentionKind.mla, num_kv_heads=1)
        spec = KVCacheSpec(kv_cache_dtype=dtype, **fields)
        if pad:
            spec = KVCacheSpec(kv_cache_dtype=dtype, page_size_padded=spec.real_page_size_bytes + pad, **fields)
        return plan_layout(self.layout, spec, get_profile(self.profile).backend(self.backend), num_blocks)


@cache
def deployments(dtype: str, backends: tuple[str, ...] | None = None) -> tuple[Deployment, ...]:
    """Every (profile, backend, layout) of `PROFILES` that has ``dtype`` and offers block transfers."""
    out = []
    for name in PROFILES:
        profile = get_profile(name)
        for backend in profile.backend_names():
            if backends is not None and backend not in backends:
                continue
            declared = profile.backends[backend].kv_cache_dtypes
            if dtype not in (declared if declared is not None else profile.kv_cache_dtypes):
                continue
            for layout in profile.backend(backend).layouts:
                dep = Deployment(name, backend, layout)
                if layout in profile.layouts and dep.plan(dtype).transfer:
                    out.append(dep)
    return tuple(out)


def written(plan: LayoutPlan, seed: int) -> KVCache:
    """A cache of ``plan`` with random K/V (bf16, as a model writes them) in every slot of every layer."""
    cache_ = allocate(plan)
    spec = plan.spec
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(plan.num_blocks * spec.block_size)
    shape = (spec.num_layers, slots.numel(), spec.num_kv_heads, spec.head_size)
    keys = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16)
    values = None if spec.kv_factor == 1 else torch.randn(shape, generator=gen).to(torch.bfloat16)
    cache_.write_layers(keys, values, slots)
    return cache_


def slots_of(blocks: list[int], block_size: int) -> list[int]:
    return [b * block_size + t for b in blocks for t in range(block_size)]


def cells_at(cache_: KVCache, layer: int, slots: list[int]) -> torch.Tensor:
    """The bytes (kv, T, H, cell_bytes) of ``layer``'s cells at ``slots``, through the plan's layer view."""
    plan = cache_.plan
    view, elem = plan.layers[layer].view, plan.element_size
    t = cache_.raw[view.buffer].as_strided((*view.shape, elem), (*(s * elem for s in view.strides), 1),
                                           view.storage_offset * elem)
    dims = list(view.dims)
    for missing in ("kv", "head"):  # MLA: one latent, no kv or head dim
        if missing not in dims:
            t, dims = t.unsqueeze(-1), [*dims, missing]
    t = t.permute([dims.index(d) for d in ("block", "token", "kv", "head", "dim")] + [len(dims)])
    n = plan.spec.block_size
    cells = t[torch.tensor([s // n for s in slots]), torch.tensor([s % n for s in slots])]  # (T, kv, H, D', elem)
    return cells.permute(1, 0, 2, 3, 4).reshape(*cells.shape[1:2], len(slots), cells.shape[2], -1)


def check_moved(src: KVCache, dst: KVCache, ids: tuple[list[int], list[int]] = MOVED) -> ExchangeKind:
    """Restore ``src``'s blocks ``ids[0]`` into ``dst``'s ``ids[1]``; every check of the module docstring."""
    others = [b for b in range(dst.plan.num_blocks) if b not in ids[1]]
    untouched = dst.offload(others).data.clone()
    blocks = src.offload(ids[0])
    exchange = dst.restore(ids[1], blocks)
    n = src.plan.spec.block_size
    s_slots, d_slots = slots_of(ids[0], n), slots_of(ids[1], n)
    for layer in range(src.plan.num_layers):
        assert torch.equal(cells_at(src, layer, s_slots), cells_at(dst, layer, d_slots)), f"layer {layer}: cells"
        want, got = src.read(layer, torch.tensor(s_slots)), dst.read(layer, torch.tensor(d_slots))
        for a, b in zip(want, got, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), f"layer {layer}: reads differ"
    assert torch.equal(dst.offload(others).data, untouched), "restore wrote outside its blocks"
    same_rows = torch.equal(dst.offload(ids[1]).data, blocks.data)
    assert exchange.kind is (ExchangeKind.as_is if same_rows else ExchangeKind.transcode), exchange
    return exchange.kind


# ---- every pair of layouts, per kv_cache_dtype ----------------------------------------------------

# TRITON_ATTN has every dtype in every profile; CPU_ATTN (vllm-0.34 reads K/V as token rows) and the
# MLA backends (one latent, no head dim) are the other geometries. The sampled test below adds the rest.
EXHAUSTIVE = {dtype: ("TRITON_ATTN",) for dtype in DTYPES}
EXHAUSTIVE["auto"] = ("TRITON_ATTN", "CPU_ATTN", "FLASHMLA")
EXHAUSTIVE["fp8"] = ("TRITON_ATTN", "CPU_ATTN", "FLASHMLA")


def exhaustive_pairs(dtype: str) -> list[tuple[Deployment, Deployment]]:
    deps = deployments(dtype, EXHAUSTIVE[dtype])
    return [(a, b) for a, b in itertools.product(deps, deps) if a.mla == b.mla]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_layout_pair_of_the_profiles_moves_blocks_exactly(dtype: str) -> None:
    sources = {dep: written(dep.plan(dtype), seed=i) for i, dep in enumerate(deployments(dtype, EXHAUSTIVE[dtype]))}
    kinds = {kind: 0 for kind in ExchangeKind}
    for src, dst in exhaustive_pairs(dtype):
        if dtype == "fp8_e5m2" and (src.backend == "TRITON_ATTN") != (dst.backend == "TRITON_ATTN"):
            continue  # other codes: test_fp8_e5m2_codes_of_triton_are_refused_elsewhere
        try:
            kinds[check_moved(sources[src], allocate(dst.plan(dtype)))] += 1
        except AssertionError as exc:
            raise AssertionError(f"{src} -> {dst}: {exc}") from None
    assert (kinds[ExchangeKind.as_is], kinds[ExchangeKind.transcode]) == EXPECTED_KINDS[dtype]


# (as_is, transcode) pairs per dtype: the figures docs/blocks.md quotes. Each dtype's own pairs include the
# identities (a cache into one of its own layout); every other as_is pair is two layouts with the same rows
# (per_layer and cross_layer NHD of issue-48412, say).
# 0.28's CPU_ATTN reads K/V as token rows as 0.34's does (issue 31), so its blocks transcode into TRITON_ATTN's
EXPECTED_KINDS = {"auto": (147, 242), "fp8": (147, 242), **{d: (35, 134) for d in DTYPES if d not in ("auto", "fp8")}}


def test_counts() -> None:
    """The figures docs/blocks.md quotes: layouts, layout pairs, profiles."""
    pairs = {dtype: len(exhaustive_pairs(dtype)) for dtype in DTYPES}
    assert sum(pairs.values()) == 1623 == sum(sum(k) for k in EXPECTED_KINDS.values()), pairs
    layouts = {(d.profile, d.backend, d.layout) for dtype in DTYPES for d in deployments(dtype, EXHAUSTIVE[dtype])}
    assert len(layouts) == 27 and {p for p, _, _ in layouts} == set(PROFILES)
    assert len(ALL_PAIRS) == 9386  # what the sampled test draws from


def test_the_reproduction_issue_48412_blocks_restore_into_a_vllm_034_cache() -> None:
    """issue-48412 decides BLNHC (cross-layer, K/V dim outside the tokens) for a 4-layer Qwen2.5-0.5B with
    the OffloadingConnector, vllm-0.34 LBHNC: both offload (8, 4, 8192). Restored as bare bytes every read
    of the 0.34 cache differed from what was written; the blocks now transcode and read back equal."""
    spec = {"num_layers": 4, "num_kv_heads": 2, "head_size": 64, "block_size": 16}
    inputs = {"spec": spec, "connector": "OffloadingConnector", "attention_backend": "TRITON_ATTN"}
    src = LayoutEngine.default("issue-48412").build(num_blocks=8, **inputs)
    dst = LayoutEngine.default("vllm-0.34").build(num_blocks=8, **inputs)
    assert (src.plan.layout, dst.plan.layout) == (Layout.BLNHC, Layout.LBHNC)
    gen = torch.Generator().manual_seed(48412)
    keys = torch.randn(4, 128, 2, 64, generator=gen).to(torch.bfloat16)
    values = torch.randn(4, 128, 2, 64, generator=gen).to(torch.bfloat16)
    slots = torch.arange(128)
    src.write_layers(keys, values, slots)
    blocks = src.offload(list(range(8)))
    assert blocks.data.shape == dst.offload(list(range(8))).data.shape == (8, 4, 8192)
    with pytest.raises(InputError, match="bare tensor") as info:
        dst.restore(list(range(8)), blocks.data)  # bytes alone: refused, not garbage
    assert info.value.diagnostics[0].code == "unbound-blocks"
    exchange = dst.restore(list(range(8)), blocks)
    assert exchange.kind is ExchangeKind.transcode
    for layer in range(4):
        k, v = dst.read(layer, slots)
        assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer]), layer
    # a peer that received the bytes and the writer's fingerprint as JSON restores them the same way
    peer = LayoutEngine.default("vllm-0.34").build(num_blocks=8, **inputs)
    assert peer.restore(list(range(8)), blocks.data, source=src.fingerprint.to_json()).kind is ExchangeKind.transcode
    received = OffloadedBlocks.received(blocks.data, src.fingerprint.to_dict())
    assert received.format == blocks.format
    assert all(torch.equal(a, b) for a, b in zip(peer.raw, dst.raw, strict=True))


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_a_restore_transcodes_a_chunk_of_blocks_at_a_time(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Blocks staged ``chunk`` at a time (the staging's zeroed padding reused across chunks) land as at once."""
    src = written(Deployment("issue-48412", "TRITON_ATTN", Layout.BLNHC).plan("int8_per_token_head"), seed=5)
    dst = allocate(Deployment("vllm-0.34", "TRITON_ATTN", Layout.LBHNC).plan("int8_per_token_head", pad=12))
    monkeypatch.setattr(transfer, "TRANSCODE_CHUNK_BYTES", chunk * dst.plan.block_row_bytes)
    for r in dst.raw:
        r.fill_(7)
    assert check_moved(src, dst, ([5, 1, 0, 4, 2], [0, 3, 5, 2, 4])) is ExchangeKind.transcode
    pages = dst.offload([0, 3, 5, 2, 4]).data  # LBHNC pads each page at its end: those 12 bytes are zero
    assert not pages[:, :, -12:].any() and pages[:, :, :-12].any()


# ---- sampled: every backend, random geometry, padding, block ids -----------------------------------

def _pairs() -> list[tuple[str, Deployment, Deployment]]:
    out = []
    for dtype in DTYPES:
        deps = deployments(dtype)
        out += [(dtype, a, b) for a, b in itertools.product(deps, deps) if a.mla == b.mla
                and not (dtype == "fp8_e5m2" and (a.backend == "TRITON_ATTN") != (b.backend == "TRITON_ATTN"))]
    return out


ALL_PAIRS = _pairs()


@settings(max_examples=60, deadline=None)
@given(pair=st.sampled_from(ALL_PAIRS), data=st.data())
def test_any_pair_of_caches_with_the_same_cells_moves_blocks_exactly(pair: tuple[str, Deployment, Deployment],
                                                                     data: st.DataObject) -> None:
    dtype, a, b = pair
    geometry = {"num_layers": data.draw(st.integers(1, 4), "layers"), "block_size": data.draw(st.integers(1, 6)),
                "num_kv_heads": data.draw(st.integers(1, 3), "heads"),
                "head_size": data.draw(st.sampled_from([16, 32]), "head_size")}
    pads = data.draw(st.tuples(st.sampled_from([0, 0, 4, 12, 64]), st.sampled_from([0, 4, 12, 64])), "pads")
    try:
        src_plan = a.plan(dtype, num_blocks=5, pad=pads[0], **geometry)
        dst_plan = b.plan(dtype, num_blocks=7, pad=pads[1], **geometry)
    except InputError:  # a padded page under a layout vLLM cannot pad (LHBNC/BHLNC with several heads)
        assume(False)
    assume(bool(src_plan.transfer and dst_plan.transfer))
    src_ids = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=5, unique=True), "source blocks")
    dst_ids = data.draw(st.lists(st.integers(0, 6), min_size=len(src_ids), max_size=len(src_ids), unique=True))
    check_moved(written(src_plan, data.draw(st.integers(0, 2**16), "seed")), allocate(dst_plan), (src_ids, dst_ids))


# ---- refusals -----------------------------------------------------------------------------------

def expected_fields(src: KVCache, dst: KVCache) -> set[str]:
    """The cell fields (and groups' fields but their page sizes) in which the two fingerprints differ."""
    a, b = src.fingerprint.to_dict(), dst.fingerprint.to_dict()
    out = {f for f in CELL_FIELDS if a[f] != b[f]}
    for i, (ga, gb) in enumerate(zip(a["groups"], b["groups"], strict=True)):
        out |= {f"groups[{i}].{k}" for k in ga if k != "page_bytes" and ga[k] != gb[k]}
    return out


def check_refused(src: KVCache, dst: KVCache) -> set[str]:
    before = [r.clone() for r in dst.raw]
    with pytest.raises(InputError) as info:
        dst.restore([0, 1], src.offload([2, 3]))
    (diag,) = info.value.diagnostics
    assert (diag.file, diag.code) == ("data", "cell-format-mismatch"), str(info.value)
    named = {d.field for d in compare_blocks(src.fingerprint, dst.fingerprint).cell_differences}
    for field in named:
        assert f"\n    {field}: source " in diag.message, field
    assert all(torch.equal(r, b) for r, b in zip(dst.raw, before, strict=True)), "a refused restore wrote bytes"
    return named


DTYPE_PAIRS = [(a, b) for a, b in itertools.product(DTYPES, DTYPES) if a != b]


@pytest.mark.parametrize(("source", "target"), DTYPE_PAIRS, ids=[f"{a}-to-{b}" for a, b in DTYPE_PAIRS])
def test_blocks_of_another_kv_cache_dtype_are_refused_naming_every_field(source: str, target: str) -> None:
    # a layout pair that would transcode, so only the cells stand in the way
    src = written(Deployment("issue-48412", "TRITON_ATTN", Layout.BLNHC).plan(source), seed=1)
    dst = allocate(Deployment("vllm-0.34", "TRITON_ATTN", Layout.LBHNC).plan(target))
    named = check_refused(src, dst)
    assert named == expected_fields(src, dst) and {"kv_cache_dtype"} <= named


GEOMETRY_CHANGES = [({"num_kv_heads": 4}, {"num_kv_heads"}), ({"head_size": 32}, {"head_size", "cell_bytes"}),
                    ({"block_size": 8}, {"block_size", "groups[0].block_size"}),
                    ({"num_layers": 2}, {"num_layers", "groups[0].num_layers"})]


@pytest.mark.parametrize("dtype", ["auto", "int8_per_token_head"])
@pytest.mark.parametrize(("change", "fields"), GEOMETRY_CHANGES, ids=[next(iter(c)) for c, _ in GEOMETRY_CHANGES])
def test_blocks_of_another_geometry_are_refused_naming_every_field(change: dict, fields: set[str],
                                                                   dtype: str) -> None:
    src = written(Deployment("vllm-0.28", "TRITON_ATTN", Layout.LBHNC).plan(dtype), seed=2)
    dst = allocate(Deployment("vllm-0.34", "TRITON_ATTN", Layout.BLNHC).plan(dtype, **change))
    if dtype == "int8_per_token_head" and "head_size" in change:
        fields = fields | {"scale_offset"}
    assert check_refused(src, dst) == fields == expected_fields(src, dst)


def test_fp8_e5m2_codes_of_triton_are_refused_elsewhere() -> None:
    """TRITON_ATTN writes every fp8 cache as e4m3 (vLLM 0.28 and 0.34), fp8_e5m2 included; FLASHINFER writes
    e5m2. Same fingerprint fields but the backend, different codes: refused, naming `backend`."""
    plan = Deployment("vllm-0.34", "TRITON_ATTN", Layout.LBNHC).plan("fp8_e5m2")
    src = written(plan, seed=3)
    other = written(Deployment("vllm-0.34", "FLASHINFER", Layout.LBNHC).plan("fp8_e5m2"), seed=3)
    assert not torch.equal(src.raw[0], other.raw[0]), "the same values, other codes"
    assert check_refused(src, allocate(Deployment("vllm-0.34", "FLASHINFER", Layout.LBNHC).plan("fp8_e5m2"))) == {
        "backend"}


def test_a_layout_without_block_transfers_is_refused_by_name() -> None:
    src = written(Deployment("vllm-0.34", "TRITON_ATTN", Layout.LBNHC).plan("auto"), seed=4)
    lhbnc = allocate(Deployment("vllm-0.34", "TRITON_ATTN", Layout.LHBNC).plan("auto"))
    with pytest.raises(InputError, match="no block transfer"):
        lhbnc.restore([0], src.offload([0]))
    exchange = compare_blocks(src.fingerprint, lhbnc.fingerprint)
    assert exchange.kind is ExchangeKind.refused and "no block transfer" in exchange.reason


def _two_caches() -> tuple[KVCache, KVCache]:
    inputs = {"spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 16, "block_size": 4},
              "connector": "OffloadingConnector", "attention_backend": "TRITON_ATTN"}
    return (LayoutEngine.default("issue-48412").build(num_blocks=3, **inputs),
            LayoutEngine.default("vllm-0.34").build(num_blocks=3, **inputs))


def test_blocks_whose_format_is_not_their_fingerprints_are_refused() -> None:
    """Hostile review: `OffloadedBlocks(data, old.fingerprint, new.block_format)` restored as is, as garbage."""
    old, new = _two_caches()
    blocks = old.offload([0, 1, 2])
    for mixed in (OffloadedBlocks(blocks.data, old.fingerprint, new.block_format),
                  OffloadedBlocks(blocks.data, new.fingerprint, old.block_format)):
        with pytest.raises(InputError, match="not their fingerprint's") as info:
            new.restore([0, 1, 2], mixed)
        assert info.value.diagnostics[0].code == "unbound-blocks"


@pytest.mark.parametrize("value", ["no", 1, None, [True]])
def test_assume_same_layout_takes_only_a_bool(value: object) -> None:
    _, new = _two_caches()
    with pytest.raises(InputError, match="must be True or False") as info:
        new.restore([0], new.offload([0]).data, assume_same_layout=value)  # type: ignore[arg-type]
    assert info.value.diagnostics[0].file == "assume_same_layout"


def test_the_fingerprint_dry_run_prints_binds_blocks_digest_and_all() -> None:
    """`dry-run --format json`'s `fingerprint` carries its digest beside the fields: accepted and checked."""
    old, new = _two_caches()
    printed = {**old.fingerprint.to_dict(), "digest": old.fingerprint.digest}
    data = old.offload([0, 1]).data
    assert new.restore([0, 1], data, source=printed).kind is ExchangeKind.transcode
    assert OffloadedBlocks.received(data, printed).fingerprint == old.fingerprint
    with pytest.raises(InputError, match="not these fields' digest"):
        new.restore([0, 1], data, source={**printed, "num_layers": 2, "digest": "sha256:" + "0" * 64})
