"""The shipped rules reproduce vLLM's `use_uniform_kv_cache` gate for every input.

The reference below is vLLM's gate written by hand (docs/vllm.md, "vLLM 0.24-0.28").
Every combination of its inputs is enumerated and the engine must choose
cross_layer exactly when the gate does.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy import (
    KV_CACHE_DTYPES,
    AttentionKind,
    BackendProfile,
    ConnectorConfig,
    Context,
    Dim,
    HeadOrder,
    KVCacheGroup,
    KVCacheGroups,
    KVCacheSpec,
    Placement,
    ScaleViews,
)
from kvpolicy.policy.backends import BACKENDS
from kvpolicy.policy.errors import NoLayoutError, PolicyError
from kvpolicy.policy.releases import iter_profiles, profile_names
from kvpolicy.policy.rule_model import MemberPreferences

ENGINE = LayoutEngine.default()

# A non-MLA backend whose cross-layer order keeps layers outermost: it does not
# index KV by block stride, so cross-layer must never be chosen for it.
LAYER_MAJOR = BackendProfile(
    name="LAYER_MAJOR_ATTN",
    logical_dims=(Dim.block, Dim.kv, Dim.token, Dim.head, Dim.dim),
    per_layer_order={HeadOrder.NHD: (Dim.block, Dim.kv, Dim.token, Dim.head, Dim.dim),
                     HeadOrder.HND: (Dim.block, Dim.kv, Dim.head, Dim.token, Dim.dim)},
    cross_layer_order={HeadOrder.NHD: (Dim.layer, Dim.block, Dim.kv, Dim.token, Dim.head, Dim.dim),
                       HeadOrder.HND: (Dim.layer, Dim.block, Dim.kv, Dim.head, Dim.token, Dim.dim)},
)

NIXL_BACKENDS = {"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"}


def nixl(flag: object = None) -> ConnectorConfig:
    extra = {} if flag is None else {"enable_cross_layers_blocks": flag}
    return ConnectorConfig(name="NixlConnector", extra=extra)


def mooncake(flag: object = None) -> ConnectorConfig:
    extra = {} if flag is None else {"enable_cross_layers_blocks": flag}
    return ConnectorConfig(name="MooncakeStoreConnector", extra=extra)


OFFLOAD = ConnectorConfig(name="OffloadingConnector")
LMCACHE = ConnectorConfig(name="LMCacheConnectorV1")

CONNECTORS: dict[str, ConnectorConfig | None] = {
    "none": None,
    "offloading": OFFLOAD,
    "nixl": nixl(),
    "nixl-true": nixl("true"),
    "nixl-True-bool": nixl(True),
    "nixl-false": nixl("false"),
    "mooncake-store": mooncake(),
    "mooncake-store-true": mooncake("true"),
    "mooncake-store-bool": mooncake(True),
    "lmcache": LMCACHE,
    "p2p-nccl": ConnectorConfig(name="P2pNcclConnector"),
    "unknown-third-party": ConnectorConfig(name="AcmeConnector"),
    "multi(offloading,nixl-true)": ConnectorConfig(name="MultiConnector", connectors=(OFFLOAD, nixl("true"))),
    "multi(offloading,lmcache)": ConnectorConfig(name="MultiConnector", connectors=(OFFLOAD, LMCACHE)),
    "multi(offloading,nixl)": ConnectorConfig(name="MultiConnector", connectors=(OFFLOAD, nixl())),
    "multi(mooncake-true,offloading)": ConnectorConfig(name="MultiConnector", connectors=(mooncake("true"), OFFLOAD)),
    "multi(offloading)": ConnectorConfig(name="MultiConnector", connectors=(OFFLOAD,)),
}


def _flag(c: ConnectorConfig) -> bool:
    return str(c.extra.get("enable_cross_layers_blocks", "false")).lower() == "true"


def prefers_cross_layer(c: ConnectorConfig, ctx: Context) -> bool:
    """vLLM's `prefer_cross_layer_blocks`, connector by connector."""
    if c.name == "OffloadingConnector":
        return True
    if c.name == "NixlConnector":
        # vLLM sets the KV cache layout to HND for NIXL on non-MLA backends.
        return (_flag(c) and not ctx.groups.has_mamba and ctx.backend.name in NIXL_BACKENDS
                and not ctx.backend.mla)
    if c.name == "MooncakeStoreConnector":
        return _flag(c)
    if c.name == "MultiConnector":
        return bool(c.connectors) and all(prefers_cross_layer(m, ctx) for m in c.connectors)
    return False


def vllm_gate(ctx: Context, *, per_token_head_guard: bool = True) -> bool:
    """vLLM's `use_uniform_kv_cache`, its conditions (1)-(6) (docs/vllm.md)."""
    if ctx.connector is None:  # (1)
        return False
    if not prefers_cross_layer(ctx.connector, ctx):  # (2)
        return False
    if ctx.groups.count != 1 or ctx.groups.attention_groups != 1:  # (3)
        return False
    if not ctx.groups.groups[0].spec.kind.is_attention:  # (4)
        return False
    if per_token_head_guard and ctx.kv.per_token_head:  # (5)
        return False
    return ctx.backend.indexes_kv_by_block_stride  # (6)


def make_spec(kind: AttentionKind = AttentionKind.full, kv_cache_dtype: str = "auto", **kw: object) -> KVCacheSpec:
    base: dict[str, object] = dict(num_layers=24, block_size=16, num_kv_heads=2, head_size=64)
    if kind is AttentionKind.mla:
        base.update(num_kv_heads=1, head_size=576)
    base.update(kw)
    return KVCacheSpec(kind=kind, kv_cache_dtype=kv_cache_dtype, **base)


def make_groups(spec: KVCacheSpec, count: int, attention_groups: int) -> KVCacheGroups:
    if count == 0:
        return KVCacheGroups()
    first = KVCacheGroup(spec=spec, num_attention_groups=attention_groups)
    others = [KVCacheGroup(spec=spec.model_copy(update={"kind": AttentionKind.sliding_window,
                                                        "sliding_window": 128}))
              for _ in range(count - 1)]
    return KVCacheGroups(groups=(first, *others))


BACKEND_PROFILES = [*BACKENDS.values(), LAYER_MAJOR]


def all_inputs():
    for (cname, conn), (count, attn), kind, dtype, backend, views in itertools.product(
        CONNECTORS.items(), [(0, 1), (1, 1), (1, 2), (2, 1)],
        [AttentionKind.full, AttentionKind.mamba, AttentionKind.mla], KV_CACHE_DTYPES,
        BACKEND_PROFILES, list(ScaleViews),
    ):
        if (kind is AttentionKind.mla and not backend.mla) or (backend.mla and kind is not AttentionKind.mla):
            continue  # MLA specs run on MLA backends only, and vice versa
        if kind is AttentionKind.mla and dtype.startswith("nvfp4"):
            continue  # nvfp4 is a K/V format: no MLA spec holds it
        spec = make_spec(kind, dtype)
        ctx = Context(kv=spec, groups=make_groups(spec, count, attn),
                      backend=backend.with_scale_views(views), connector=conn)
        yield f"{cname}|groups={count}x{attn}|{kind.value}|{dtype}|{backend.name}|{views.value}", ctx


INPUTS = list(all_inputs())


def test_the_enumeration_covers_the_gate() -> None:
    chosen = sum(vllm_gate(ctx, per_token_head_guard=ctx.backend.scale_views is ScaleViews.assume_per_layer_contiguous)
                 for _, ctx in INPUTS)
    assert len(INPUTS) > 5000
    assert 100 < chosen < len(INPUTS) / 2  # both outcomes are well represented


@pytest.mark.parametrize("views", list(ScaleViews))
def test_shipped_rules_match_vllm_gate_for_every_input(views: ScaleViews) -> None:
    mismatches = []
    for name, ctx in INPUTS:
        if ctx.backend.scale_views is not views:
            continue
        # Contiguity-assuming scale views: vLLM's gate exactly, guard (5) included.
        # Stride-aware views: per-token-head alone no longer rules cross_layer out.
        expected = vllm_gate(ctx, per_token_head_guard=views is ScaleViews.assume_per_layer_contiguous)
        decision = ENGINE.decide(ctx, explain=False)
        if (decision.layout.placement is Placement.cross_layer) != expected:
            mismatches.append(f"{name}: gate={expected} engine={decision.layout}")
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:5]}"


def test_every_shipped_profile_assumes_per_layer_contiguous_scale_views() -> None:
    # As at the time of vLLM #48412: the gate's guard applies to every shipped backend.
    assert {b.scale_views for b in BACKENDS.values()} == {ScaleViews.assume_per_layer_contiguous}


def test_nixl_always_gets_hnd_on_head_dim_backends() -> None:
    for name, ctx in INPUTS:
        members = ctx.connector.connectors if ctx.connector and ctx.connector.connectors else (ctx.connector,)
        if any(m is not None and m.name == "NixlConnector" for m in members) and ctx.backend.supports_hnd:
            assert ENGINE.decide(ctx, explain=False).layout.head_order is HeadOrder.HND, name


def test_explain_and_fast_path_agree() -> None:
    for name, ctx in INPUTS[::37]:
        fast = ENGINE.decide(ctx, explain=False)
        full = ENGINE.decide(ctx, explain=True)
        assert fast.layout == full.layout, name
        assert fast.ranking == full.ranking, name


def _outcome(engine: LayoutEngine, ctx: Context, explain: bool) -> tuple[object, ...]:
    try:
        d = engine.decide(ctx, explain=explain)
    except NoLayoutError as exc:
        return ("refused", tuple(diag.message for diag in exc.diagnostics))
    return (d.layout, tuple(d.ranking))


def _every_profile_inputs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(profile, decide's inputs) for every shipped profile: no connector, each connector it registers, and
    MultiConnector with every ordered pair of them as members, rotated over each backend of the profile and
    the fp8 dtypes it accepts, so every connector configuration and every (backend, dtype) is asked once."""
    for profile in iter_profiles():
        members = sorted(profile.connectors)
        conns: list[tuple[str | None, dict[str, Any] | None]] = [
            (None, None), *((m, None) for m in members),
            *(("MultiConnector", {"connectors": [{"kv_connector": a}, {"kv_connector": b}]})
              for a, b in itertools.permutations(members, 2))]
        combos = []
        for name in profile.backend_names():
            accepted = profile.backends[name].kv_cache_dtypes
            spec = (dict(num_layers=4, block_size=16, num_kv_heads=1, head_size=576) if profile.backend(name).mla
                    else dict(num_layers=4, block_size=16, num_kv_heads=2, head_size=64))
            combos += [(name, spec, dtype) for dtype in ("auto", "fp8", "fp8_per_token_head")
                       if dtype == "auto" or accepted is None or dtype in accepted]
        for i in range(max(len(conns), len(combos))):
            (conn, extra), (backend, spec, dtype) = conns[i % len(conns)], combos[i % len(combos)]
            yield profile.name, dict(spec=spec, kv_cache_dtype=dtype, attention_backend=backend, connector=conn,
                                     connector_config=extra)


def test_explain_and_fast_path_agree_in_every_profile() -> None:
    """The fast path (``explain=False``, what the plugin runs) decides as the traced one in every shipped
    profile, MultiConnector members included: a `member_preferences: agree` conflict refuses in both."""
    asked: dict[str, int] = defaultdict(int)
    agree_refusals: dict[str, int] = defaultdict(int)
    differ = []
    engines = {name: LayoutEngine.default(name) for name in profile_names()}
    for name, inputs in _every_profile_inputs():
        engine = engines[name]
        try:
            ctx = engine.context(**inputs)
        except PolicyError:
            continue  # a connector this backend or release refuses: nothing to decide
        asked[name] += 1
        fast, full = _outcome(engine, ctx, explain=False), _outcome(engine, ctx, explain=True)
        if fast != full:
            differ.append(f"{name} {inputs}: fast {fast[:2]}, explained {full[:2]}")
        if full[0] == "refused" and any(":members-agree" in m for m in full[1]):
            agree_refusals[name] += 1
    assert not differ, f"{len(differ)} differ, first: {differ[:3]}"
    assert set(asked) == set(profile_names()) and min(asked.values()) > 50, dict(asked)
    agreeing = {p for p, engine in engines.items()
                if engine.ruleset.combine_mode("MultiConnector") is MemberPreferences.agree}
    assert len(agreeing) > 10 and {p for p in agreeing if agree_refusals[p]} == agreeing, dict(agree_refusals)


def test_per_token_head_with_stride_aware_views_allows_cross_layer() -> None:
    spec = make_spec(kv_cache_dtype="fp8_per_token_head")
    for views, placement in [(ScaleViews.assume_per_layer_contiguous, Placement.per_layer),
                             (ScaleViews.stride_aware, Placement.cross_layer)]:
        ctx = Context(kv=spec, backend=BACKENDS["TRITON_ATTN"].with_scale_views(views), connector=OFFLOAD)
        assert ENGINE.decide(ctx).layout.placement is placement
