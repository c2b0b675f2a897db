"""The geometry verifier, cross-checked against real bytes, and vLLM #48412 reproduced."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.plan import naive_scale_view, plan_layout
from kvpolicy.engine.runtime import allocate
from kvpolicy.engine.verify import MAX_LISTED_COLLISIONS, Writer, refusal, verify_plan, writers
from kvpolicy.policy import (
    KV_CACHE_DTYPES,
    AttentionKind,
    GeometryError,
    KVCacheSpec,
    Layout,
    Placement,
    ScaleViews,
    load_rules_from_texts,
)
from kvpolicy.policy.backends import BACKENDS


def make_spec(kv_cache_dtype: str = "auto", mla: bool = False, **kw: object) -> KVCacheSpec:
    base: dict[str, object] = dict(num_layers=3, block_size=4, num_kv_heads=2, head_size=8)
    if mla:
        base.update(kind=AttentionKind.mla, num_kv_heads=1, head_size=16)
    base.update(kw)
    return KVCacheSpec(kv_cache_dtype=kv_cache_dtype, **base)


# the #48412 state's backends have no nvfp4 geometry (vLLM 0.34's FLASHINFER has: tests/engine/test_plan_nvfp4.py)
DEV_DTYPES = tuple(d for d in KV_CACHE_DTYPES if not d.startswith("nvfp4"))


def combos():
    for backend, dtype, placement, strategy in itertools.product(
            BACKENDS.values(), DEV_DTYPES, Placement, ScaleViews):
        for head_order in backend.head_orders:
            yield backend, dtype, Layout.parse(f"{placement.value}/{head_order.value}"), strategy


COMBOS = list(combos())


def addresses(w: Writer) -> torch.Tensor:
    """Every byte address ``w`` touches, by brute force."""
    offs = torch.zeros(1, dtype=torch.int64)
    for count, stride in w.inner:
        offs = (offs[:, None] + torch.arange(count) * stride).reshape(-1)
    blocks = torch.arange(w.num_blocks) * w.block_stride
    cells = (w.base + blocks[:, None] + offs[None, :]).reshape(-1)
    return (cells[:, None] + torch.arange(w.run)).reshape(-1)


def canary_corrupted(plan, strategy: ScaleViews) -> set[int]:
    """Write a distinct tag through every writer in order; return the writers whose
    bytes no longer hold their tag (overwritten by a later writer)."""
    cache = allocate(plan, "cpu")
    ws = writers(plan, strategy)
    for i, w in enumerate(ws):
        cache.raw[w.buffer][addresses(w)] = (i % 250) + 1
    return {i for i, w in enumerate(ws) if not bool((cache.raw[w.buffer][addresses(w)] == (i % 250) + 1).all())}


@pytest.mark.parametrize(("backend", "dtype", "layout", "strategy"), COMBOS,
                         ids=[f"{b.name}-{d}-{lay}-{s.value}" for b, d, lay, s in COMBOS])
def test_static_answer_matches_real_bytes(backend, dtype, layout, strategy) -> None:
    spec = make_spec(dtype, mla=backend.mla)
    plan = plan_layout(layout, spec, backend, num_blocks=3)
    report = verify_plan(plan, strategy)
    expected = {a for a, b in ((min(i, j), max(i, j)) for i, j in _index_pairs(report))}
    assert canary_corrupted(plan, strategy) == expected
    unsafe = (spec.per_token_head and strategy is ScaleViews.assume_per_layer_contiguous
              and layout.placement is Placement.cross_layer)
    assert report.ok is (not unsafe), report.to_dict()


def _index_pairs(report):
    index = {(w.layer, w.role): i for i, w in enumerate(report.writers)}
    return [(index[a], index[b]) for a, b in report.pairs()]


def test_reproduces_vllm_48412() -> None:
    """Qwen2.5-0.5B geometry, fp8 per-token-head, TRITON_ATTN's contiguity-assuming scale views."""
    spec = KVCacheSpec(num_layers=24, block_size=16, num_kv_heads=2, head_size=64, kv_cache_dtype="fp8_per_token_head")
    tri = BACKENDS["TRITON_ATTN"]
    cross = Layout.parse("BLNHC")
    unsafe = verify_plan(plan_layout(cross, spec, tri, 64))
    assert not unsafe.ok
    assert ((0, "k_scale"), (1, "k_scale")) in unsafe.pairs()
    assert verify_plan(plan_layout(Layout.parse("LBNHC"), spec, tri, 64)).ok
    assert verify_plan(plan_layout(cross, spec, tri, 64), ScaleViews.stride_aware).ok


def canary_cache(layout: str):
    spec = make_spec("int8_per_token_head", num_layers=4)
    plan = plan_layout(Layout.parse(layout), spec, BACKENDS["TRITON_ATTN"], num_blocks=4)
    cache = allocate(plan, "cpu")
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(plan.num_blocks * spec.block_size)
    for layer in range(spec.num_layers):
        k = torch.randn(len(slots), spec.num_kv_heads, spec.head_size, generator=gen)
        cache.write(layer, k, -k, slots)
    return cache, slots


def naive_fill_layer0(cache) -> None:
    """What vLLM's 5-D-era Triton backend did at start-up: build layer 0's scale view
    assuming offset 0 and a one-page block stride, then fill_(1.0)."""
    for role in ("k", "v"):
        sv = naive_scale_view(cache.plan, 0, role)
        raw = cache.raw[sv.buffer]
        view = raw.view(torch.float32).as_strided(sv.shape, tuple(s // 4 for s in sv.byte_strides),
                                                  sv.byte_offset // 4)
        view.fill_(1.0)


def test_first_fill_corrupts_other_layers_under_cross_layer() -> None:
    cache, slots = canary_cache("BLNHC")
    before = [cache.read(layer, slots) for layer in range(4)]
    naive_fill_layer0(cache)
    after = [cache.read(layer, slots) for layer in range(4)]
    changed = [layer for layer in range(4) if not torch.equal(before[layer][0], after[layer][0])]
    assert set(changed) >= {1, 2, 3}, changed  # neighbouring layers' K dequantizes to garbage


def test_the_same_fill_is_harmless_per_layer() -> None:
    cache, slots = canary_cache("LBNHC")
    before = [cache.read(layer, slots) for layer in range(4)]
    naive_fill_layer0(cache)
    after = [cache.read(layer, slots) for layer in range(4)]
    for layer in (1, 2, 3):
        assert torch.equal(before[layer][0], after[layer][0])


def test_shipped_rules_never_choose_the_unsafe_layout() -> None:
    engine = LayoutEngine.default()
    for dtype in ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"):
        for conn, cfg in [("OffloadingConnector", None), ("NixlConnector", {"enable_cross_layers_blocks": "true"}),
                          ("MooncakeStoreConnector", {"enable_cross_layers_blocks": "true"})]:
            d = engine.decide(spec=dict(num_layers=4, block_size=16, num_kv_heads=2, head_size=64),
                              kv_cache_dtype=dtype, connector=conn, connector_config=cfg)
            assert d.layout.placement is Placement.per_layer


def test_engine_refuses_to_allocate_it_even_with_no_rules() -> None:
    empty = LayoutEngine(load_rules_from_texts(
        {"global.yaml": "version: 1\ndefaults:\n  layout_order: [BLNHC]\nrules: []\n"}))
    inputs = dict(spec=dict(num_layers=4, block_size=16, num_kv_heads=2, head_size=64),
                  kv_cache_dtype="fp8_per_token_head", backend="TRITON_ATTN")
    assert empty.decide(**inputs).layout.placement is Placement.cross_layer  # the rules allow it...
    with pytest.raises(GeometryError) as info:
        empty.build(num_blocks=8, **inputs)  # ...the verifier does not
    text = info.value.render()
    assert "refusing layout `BLNHC` on `TRITON_ATTN`" in text
    assert "layer 0 k scale and layer 1 k scale both write buffer 0 byte 64" in text
    # with stride-aware scale views the same layout is safe and allocates
    cache = empty.build(num_blocks=8, scale_views="stride_aware", **inputs)
    assert cache.plan.layout.placement is Placement.cross_layer


def test_kvcache_verify_reports_overlapping_views() -> None:
    spec = make_spec("int8_per_token_head")
    unsafe = allocate(plan_layout(Layout.parse("BLNHC"), spec, BACKENDS["TRITON_ATTN"], 3))
    with pytest.raises(GeometryError, match="refusing layout `BLNHC`"):
        unsafe.verify()
    unsafe.verify(geometry=False)  # the tensors themselves still match the plan
    allocate(plan_layout(Layout.parse("LBNHC"), spec, BACKENDS["TRITON_ATTN"], 3)).verify()


# ---- exact pairs: every colliding pair, held to a brute-force byte-owner map ----------------------


def byte_owners(plan, strategy: ScaleViews) -> dict[tuple[int, int], int]:
    """Every (writer a, writer b) pair, a < b, that shares a byte, with the lowest shared
    byte: by enumerating every byte each writer writes."""
    owners: dict[tuple[int, int], list[int]] = {}
    for i, w in enumerate(writers(plan, strategy)):
        for address in addresses(w).tolist():
            owners.setdefault((w.buffer, address), []).append(i)
    first: dict[tuple[int, int], int] = {}
    for (_, address), idx in owners.items():
        for a, b in itertools.combinations(sorted(set(idx)), 2):
            first[(a, b)] = min(first.get((a, b), address), address)
    return first


def reported(report) -> dict[tuple[int, int], int]:
    index = {id(w): i for i, w in enumerate(report.writers)}
    out = {}
    for c in report.collisions:
        a, b = sorted((index[id(c.a)], index[id(c.b)]))
        assert (a, b) not in out, "a pair reported twice"
        out[(a, b)] = c.address
    return out


def test_vllm_48412_lists_every_colliding_pair() -> None:
    """Under cross_layer every layer's naive K (and V) scale view lands on the same bytes:
    all 24*23/2 pairs of k scales and of v scales collide, 552 pairs, and nothing else."""
    spec = KVCacheSpec(num_layers=24, block_size=16, num_kv_heads=2, head_size=64, kv_cache_dtype="fp8_per_token_head")
    report = verify_plan(plan_layout(Layout.parse("BLNHC"), spec, BACKENDS["TRITON_ATTN"], 25))
    expected = {((i, f"{r}_scale"), (j, f"{r}_scale"))
                for r in ("k", "v") for i, j in itertools.combinations(range(24), 2)}
    assert len(report.collisions) == 552
    assert report.pairs() == expected
    assert {c.address for c in report.collisions} == {64, 2176 + 64}  # fp8 cell: 64 B of codes, then the scale


def _profile_backends():
    from kvpolicy.policy.releases import get_profile

    v034 = get_profile("vllm-0.34")
    return [*BACKENDS.values(), *(v034.backend(n) for n in v034.backend_names())]


@st.composite
def small_plans(draw):
    backend = draw(st.sampled_from(_profile_backends()))
    dtype = draw(st.sampled_from(sorted(DEV_DTYPES)))
    layout = draw(st.sampled_from(backend.layouts))
    heads = 1 if backend.mla else draw(st.integers(1, 3))
    head_size = draw(st.sampled_from([8, 16]))
    spec = KVCacheSpec(kind=AttentionKind.mla if backend.mla else AttentionKind.full,
                       num_layers=draw(st.integers(1, 4)), block_size=draw(st.integers(1, 4)),
                       num_kv_heads=heads, head_size=head_size, kv_cache_dtype=dtype)
    plan = plan_layout(layout, spec, backend, num_blocks=draw(st.integers(1, 6)))
    return plan, draw(st.sampled_from(list(ScaleViews)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_plans())
def test_collisions_equal_a_brute_force_byte_owner_map(case) -> None:
    plan, strategy = case
    report = verify_plan(plan, strategy)
    truth = byte_owners(plan, strategy)
    assert reported(report) == truth
    assert report.ok is (not truth)
    assert report.collision_count == len(truth) and report.complete
    in_order = sorted((address, a, b) for (a, b), address in truth.items())
    index = {id(w): i for i, w in enumerate(report.writers)}
    assert [(c.address, *sorted((index[id(c.a)], index[id(c.b)]))) for c in report.collisions] == in_order
    with mock.patch("kvpolicy.engine.verify.MAX_LISTED_COLLISIONS", 3):  # a capped listing: the lowest addresses
        capped = verify_plan(plan, strategy)
    assert capped.collision_count == len(truth) and capped.complete is (len(truth) <= 3)
    assert [(c.address, *sorted((index_of(capped, c.a), index_of(capped, c.b)))) for c in capped.collisions] \
        == in_order[:3]


def index_of(report, w: Writer) -> int:
    return next(i for i, x in enumerate(report.writers) if x is w)


def test_a_4096_layer_cross_layer_cache_is_counted_exactly_and_listed_in_bounded_memory() -> None:
    """Every layer's naive scale views meet on layer 0's bytes: 2 * C(4096, 2) colliding pairs.
    They are counted, not listed (listing them took gigabytes); the refusal still says how many."""
    spec = KVCacheSpec(num_layers=4096, block_size=16, num_kv_heads=8, head_size=128,
                       kv_cache_dtype="fp8_per_token_head")
    plan = plan_layout(Layout.BLNHC, spec, BACKENDS["TRITON_ATTN"], 4)
    report = verify_plan(plan)
    assert report.collision_count == 2 * 4096 * 4095 // 2 and not report.ok and not report.complete
    assert len(report.collisions) == MAX_LISTED_COLLISIONS
    assert [c.address for c in report.collisions] == sorted(c.address for c in report.collisions)
    assert report.to_dict()["collision_count"] == 16_773_120
    assert "16773120 pair(s) of views" in str(refusal(plan, report))
