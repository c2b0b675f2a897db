"""The vLLM adapter answers vLLM's ``use_uniform_kv_cache`` from the rules, reading stand-ins of vLLM's objects.

The stand-ins below are named and shaped like vLLM's (``FullAttentionSpec``,
``KVQuantMode``, ``OffloadingConnector``...), since the adapter tells them
apart by class and attribute names only.
"""

from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.agreement import AgreementError
from kvpolicy.engine.fingerprint import fingerprint
from kvpolicy.engine.integrations import vllm as adapter
from kvpolicy.engine.integrations.vllm import StartupError, decide, make_gate, use_uniform_kv_cache, vllm_context
from kvpolicy.policy import (
    AttentionKind,
    Layout,
    NoLayoutError,
    Placement,
    ScaleViews,
    load_rules_from_texts,
)
from kvpolicy.policy.backends import BACKENDS

ROOT = Path(__file__).resolve().parents[3]


class KVQuantMode(enum.IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6


PER_TOKEN_HEAD = {KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.INT4_PER_TOKEN_HEAD}


@dataclass(frozen=True)
class AttentionSpec:
    block_size: int = 16
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: Any = "torch.bfloat16"
    kv_quant_mode: Any = KVQuantMode.NONE
    page_size_padded: int | None = None
    indexes_kv_by_block_stride: bool | None = None  # None: this stand-in does not say (older vLLM)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    pass


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 4096


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    num_kv_heads: int = 1
    head_size: int = 576


@dataclass(frozen=True)
class MambaSpec:
    block_size: int = 16
    shapes: tuple = ((64,),)
    dtypes: tuple = ("torch.float32",)


def backend(name: str, block_stride: bool | None = None) -> type:
    """A vLLM attention backend class: ``get_name()`` and maybe ``indexes_kv_by_block_stride()``."""
    attrs: dict[str, Any] = {"get_name": staticmethod(lambda: name)}
    if block_stride is not None:
        attrs["indexes_kv_by_block_stride"] = classmethod(lambda cls: block_stride)
    return type(name.title().replace("_", "") + "Backend", (), attrs)


def named(class_name: str, **attrs: Any) -> SimpleNamespace:
    """An object of a class called ``class_name``, with ``attrs``: the adapter reads class names."""
    return type(class_name, (SimpleNamespace,), {})(**attrs)


def group(spec: Any = None, be: Any = None, layers: int = 32) -> SimpleNamespace:
    """vLLM's AttentionGroup: a spec, a backend and its layer names."""
    return SimpleNamespace(kv_cache_spec=spec if spec is not None else FullAttentionSpec(),
                           backend=be if be is not None else backend("FLASH_ATTN"),
                           layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)])


class KVConnectorBase_V1:  # vLLM's name
    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        self._kv_transfer_config = SimpleNamespace(kv_connector_extra_config=dict(extra or {}))

    def _flag(self) -> bool:
        extra = self._kv_transfer_config.kv_connector_extra_config
        return str(extra.get("enable_cross_layers_blocks", "False")).lower() == "true"

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False


class OffloadingConnector(KVConnectorBase_V1):
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return True


class NixlConnector(KVConnectorBase_V1):
    @property
    def prefer_cross_layer_blocks(self) -> bool:  # vLLM also checks the backend, HND and Mamba
        return self._flag()


class MooncakeStoreConnector(KVConnectorBase_V1):
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return self._flag()


class LMCacheConnectorV1(KVConnectorBase_V1):
    pass


class ThirdPartyConnector(KVConnectorBase_V1):
    def __init__(self, prefers: bool) -> None:
        super().__init__()
        self._prefers = prefers

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return self._prefers


class MultiConnector(KVConnectorBase_V1):
    def __init__(self, *members: KVConnectorBase_V1) -> None:
        listed = [{"kv_connector": type(m).__name__,
                   "kv_connector_extra_config": m._kv_transfer_config.kv_connector_extra_config} for m in members]
        super().__init__({"connectors": listed})
        self._connectors = list(members)

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return bool(self._connectors) and all(c.prefer_cross_layer_blocks for c in self._connectors)


NIXL_ON = {"enable_cross_layers_blocks": "true"}


def one(spec: Any = None, be: Any = None) -> list[list[SimpleNamespace]]:
    return [[group(spec, be)]]


CASES: list[tuple[str, list[list[Any]], Any, bool]] = [
    # the gate's conditions, one at a time, from a case that goes cross-layer
    ("no connector", one(), None, False),
    ("offloading, one group", one(), OffloadingConnector(), True),
    ("two KV cache groups", [[group()], [group()]], OffloadingConnector(), False),
    ("two attention groups in one KV cache group", [[group(), group(be=backend("TRITON_ATTN"))]],
     OffloadingConnector(), False),
    ("mamba only", [[group(MambaSpec(), backend("MAMBA2"))]], OffloadingConnector(), False),
    ("attention + mamba hybrid", [[group()], [group(MambaSpec(), backend("MAMBA2"))]], OffloadingConnector(), False),
    ("sliding window", one(SlidingWindowSpec()), OffloadingConnector(), True),
    ("MLA on FLASHMLA: layers outermost", one(MLAAttentionSpec(), backend("FLASHMLA")), OffloadingConnector(), False),
    ("MLA whose spec says block stride", one(MLAAttentionSpec(indexes_kv_by_block_stride=True), backend("FLASHMLA")),
     OffloadingConnector(), True),
    # quant modes
    *[(f"quant {m.name}", one(FullAttentionSpec(kv_quant_mode=m, dtype=dt)), OffloadingConnector(), ok)
      for m, dt, ok in [(KVQuantMode.NONE, "torch.bfloat16", True),
                        (KVQuantMode.FP8_PER_TENSOR, "torch.float8_e4m3fn", True),
                        (KVQuantMode.FP8_PER_TOKEN_HEAD, "torch.uint8", False),
                        (KVQuantMode.INT8_PER_TOKEN_HEAD, "torch.uint8", False),
                        (KVQuantMode.INT4_PER_TOKEN_HEAD, "torch.uint8", False),
                        # no kvpolicy geometry for NVFP4: per-layer, the conservative answer (vLLM: True)
                        (KVQuantMode.NVFP4, "torch.uint8", False)]],
    ("quant mode as a string", one(FullAttentionSpec(kv_quant_mode="fp8_per_token_head", dtype="uint8")),
     OffloadingConnector(), False),
    # indexing by block stride
    ("spec: not by block stride", one(FullAttentionSpec(indexes_kv_by_block_stride=False)), OffloadingConnector(),
     False),
    ("backend method: not by block stride", one(be=backend("TRITON_ATTN", block_stride=False)),
     OffloadingConnector(), False),
    ("backend method: by block stride", one(be=backend("FLASHINFER", block_stride=True)), OffloadingConnector(),
     True),
    # a backend kvpolicy does not know
    ("unknown backend, silent", one(be=backend("ROCM_AITER_FA")), OffloadingConnector(), False),
    ("unknown backend by block stride", one(be=backend("ROCM_AITER_FA", block_stride=True)), OffloadingConnector(),
     True),
    ("unknown backend by block stride, per-token-head",
     one(FullAttentionSpec(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, dtype="torch.uint8"),
         backend("ROCM_AITER_FA", block_stride=True)), OffloadingConnector(), False),
    # connectors
    ("nixl without the flag", one(), NixlConnector(), False),
    ("nixl with the flag", one(), NixlConnector(NIXL_ON), True),
    ("nixl with the flag, mamba hybrid", [[group()], [group(MambaSpec(), backend("MAMBA2"))]],
     NixlConnector(NIXL_ON), False),
    ("mooncake store with the flag", one(), MooncakeStoreConnector(NIXL_ON), True),
    ("mooncake store without", one(), MooncakeStoreConnector(), False),
    ("lmcache", one(), LMCacheConnectorV1(), False),
    ("multi: all prefer", one(), MultiConnector(OffloadingConnector(), NixlConnector(NIXL_ON)), True),
    ("multi: one does not", one(), MultiConnector(OffloadingConnector(), LMCacheConnectorV1()), False),
    ("multi: no members", one(), MultiConnector(), False),
    ("multi: with a third party that prefers", one(), MultiConnector(OffloadingConnector(), ThirdPartyConnector(True)),
     True),
    ("multi: with a third party that does not", one(),
     MultiConnector(OffloadingConnector(), ThirdPartyConnector(False)), False),
    ("third party that prefers", one(), ThirdPartyConnector(True), True),
    ("third party that does not", one(), ThirdPartyConnector(False), False),
    ("third party that prefers, per-token-head",
     one(FullAttentionSpec(kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD, dtype="torch.uint8")),
     ThirdPartyConnector(True), False),
    ("third party that prefers, two groups", [[group()], [group()]], ThirdPartyConnector(True), False),
    ("empty attn_groups", [], OffloadingConnector(), False),
]


@pytest.mark.parametrize("attn_groups, connector, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gate_cases(attn_groups: list, connector: Any, expected: bool) -> None:
    assert use_uniform_kv_cache(attn_groups, connector) is expected


def reference_gate(attn_groups: list[list[Any]], connector: Any) -> bool:
    """vLLM's gate as docs/vllm.md states it, with the #48412 per-token-head guard; stand-ins' prefer is vLLM's."""
    if connector is None or not connector.prefer_cross_layer_blocks:
        return False
    if len(attn_groups) != 1 or len(attn_groups[0]) != 1:
        return False
    g = attn_groups[0][0]
    spec = g.kv_cache_spec
    if isinstance(spec, MambaSpec) or spec.kv_quant_mode in PER_TOKEN_HEAD:
        return False
    if spec.indexes_kv_by_block_stride is not None:
        return spec.indexes_kv_by_block_stride
    said = getattr(g.backend, "indexes_kv_by_block_stride", None)
    if said is not None:
        return said()
    known = BACKENDS.get(g.backend.get_name())
    return known is not None and known.indexes_kv_by_block_stride


def _enumerated() -> list[tuple[list[list[Any]], Any]]:
    dtypes = {KVQuantMode.NONE: "torch.bfloat16", KVQuantMode.FP8_PER_TENSOR: "torch.float8_e4m3fn"}
    specs: list[tuple[Any, Any]] = []
    for mode in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR, *sorted(PER_TOKEN_HEAD)):
        dt = dtypes.get(mode, "torch.uint8")
        for flag in (None, True, False):
            for cls, names in ((FullAttentionSpec, ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "CUSTOM_ATTN")),
                               (SlidingWindowSpec, ("TRITON_ATTN",)), (MLAAttentionSpec, ("FLASHMLA", "CUTLASS_MLA"))):
                for name in names:
                    specs.append((cls(kv_quant_mode=mode, dtype=dt, indexes_kv_by_block_stride=flag), backend(name)))
    specs.append((MambaSpec(), backend("MAMBA2")))
    connectors = [None, OffloadingConnector(), LMCacheConnectorV1(), ThirdPartyConnector(True),
                  ThirdPartyConnector(False), MultiConnector(OffloadingConnector(), OffloadingConnector()),
                  MultiConnector(OffloadingConnector(), ThirdPartyConnector(False))]
    out = []
    for (spec, be), conn in itertools.product(specs, connectors):
        out.append(([[group(spec, be)]], conn))
    for conn in connectors[:4]:
        out.append(([[group()], [group(SlidingWindowSpec())]], conn))
        out.append(([[group(), group(be=backend("TRITON_ATTN"))]], conn))
    return out


def test_gate_matches_vllm_over_every_enumerated_input() -> None:
    cases = _enumerated()
    assert len(cases) > 700
    assert sum(reference_gate(g, c) for g, c in cases) > 50  # both answers are well represented
    wrong = [(g, c) for g, c in cases if use_uniform_kv_cache(g, c) is not reference_gate(g, c)]
    assert not wrong, wrong[:3]


# ---------------------------------------------------------------- what the adapter reads


def test_context_from_vllm_objects() -> None:
    import torch

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
    ctx = vllm_context([[group(spec, backend("TRITON_ATTN"), layers=24)]], OffloadingConnector())
    assert (ctx.kv.kind, ctx.kv.num_layers, ctx.kv.kv_cache_dtype, ctx.kv.page_size_bytes) == (
        AttentionKind.full, 24, "fp8_per_token_head", 4352)
    assert ctx.backend is BACKENDS["TRITON_ATTN"]
    assert ctx.connector is not None and ctx.connector.name == "OffloadingConnector"

    ctx = vllm_context([[group(FullAttentionSpec(dtype=torch.float16))]], None)
    assert (ctx.kv.dtype.value, ctx.kv.kv_cache_dtype, ctx.connector) == ("float16", "auto", None)
    e5m2 = FullAttentionSpec(dtype=torch.float8_e5m2, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    assert vllm_context(one(e5m2), None).kv.kv_cache_dtype == "fp8_e5m2"
    window = vllm_context(one(SlidingWindowSpec(sliding_window=1024)), None).kv
    assert (window.kind, window.sliding_window) == (AttentionKind.sliding_window, 1024)
    # a Mamba group keeps vLLM's block size (its stand-in has no heads, but the block is vLLM's)
    hybrid = vllm_context([[group()], [group(MambaSpec(block_size=64), backend("MAMBA2"))]], None)
    assert [(g.spec.kind, g.spec.block_size) for g in hybrid.groups.groups][1] == (AttentionKind.mamba, 64)
    padded = vllm_context(one(FullAttentionSpec(page_size_padded=131072)), None).kv
    assert padded.page_size_bytes == 131072


def test_connector_extra_config_and_members() -> None:
    multi = MultiConnector(OffloadingConnector(), NixlConnector(NIXL_ON))
    conn = vllm_context(one(), multi).connector
    assert conn is not None and [m.name for m in conn.connectors] == ["OffloadingConnector", "NixlConnector"]
    assert conn.connectors[1].extra == {"enable_cross_layers_blocks": "true"}
    # a connector exposing kv_connector_extra_config itself, with a non-scalar value the rules cannot test
    direct = named("NixlConnector", kv_connector_extra_config={"enable_cross_layers_blocks": True,
                                                               "backends": ["UCX"]}, prefer_cross_layer_blocks=True)
    conn = vllm_context(one(be=backend("FLASHINFER")), direct).connector
    assert conn is not None and conn.extra == {"enable_cross_layers_blocks": True, "backends": "[\"UCX\"]"}
    assert use_uniform_kv_cache(one(be=backend("FLASHINFER")), direct) is True
    # a MultiConnector known only by its config (no member objects): members come from "connectors"
    listed = KVConnectorBase_V1({"connectors": [{"kv_connector": "OffloadingConnector"},
                                                {"kv_connector": "OffloadingConnector"}]})
    listed.__class__ = type("MultiConnector", (KVConnectorBase_V1,), {})
    assert [m.name for m in vllm_context(one(), listed).connector.connectors] == ["OffloadingConnector"] * 2
    assert use_uniform_kv_cache(one(), listed) is True


def test_prefer_as_a_method_and_a_failing_property(caplog: pytest.LogCaptureFixture) -> None:
    class ThirdPartyConnector:  # an older connector API: prefer_cross_layer_blocks() is a method
        def prefer_cross_layer_blocks(self) -> bool:
            return True

    assert use_uniform_kv_cache(one(), ThirdPartyConnector()) is True

    class BrokenConnector:
        @property
        def prefer_cross_layer_blocks(self) -> bool:
            raise RuntimeError("needs a running engine")

    with caplog.at_level(logging.WARNING, logger="kvpolicy"):
        assert use_uniform_kv_cache(one(), BrokenConnector()) is False
    assert "BrokenConnector.prefer_cross_layer_blocks failed" in caplog.text


def test_older_vllm_passes_cache_dtype() -> None:
    bare = named("FullAttentionSpec", block_size=16, num_kv_heads=8, head_size=128, dtype="torch.uint8")
    assert use_uniform_kv_cache(one(bare), OffloadingConnector(), cache_dtype="fp8_per_token_head") is False
    fp8 = named("FullAttentionSpec", block_size=16, num_kv_heads=8, head_size=128, dtype="torch.float8_e4m3fn")
    assert use_uniform_kv_cache(one(fp8), OffloadingConnector(), cache_dtype="fp8") is True
    assert use_uniform_kv_cache(one(fp8), OffloadingConnector()) is True  # derived from the dtype


@pytest.mark.parametrize(
    "attn_groups, cache_dtype, message",
    [
        (one(SimpleNamespace(block_size=16)), None, "is not a KV cache spec kvpolicy knows"),
        (one(FullAttentionSpec(kv_quant_mode=KVQuantMode.TURBOQUANT_K8V4, dtype="torch.uint8")), None,
         "quant mode `turboquant_k8v4` has no kvpolicy geometry"),
        (one(FullAttentionSpec(kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)), "auto", "contradicts"),
        (one(FullAttentionSpec()), "fp8_ds_mla", "kv_cache_dtype `fp8_ds_mla` has no kvpolicy geometry"),
        (one(FullAttentionSpec(block_size=0)), None, "block_size"),
        ([], None, "no KV cache groups"),
    ],
)
def test_what_kvpolicy_cannot_describe_stays_per_layer(attn_groups: list, cache_dtype: str | None, message: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpolicy"):
        assert use_uniform_kv_cache(attn_groups, OffloadingConnector(), cache_dtype=cache_dtype) is False
    assert "keeping per-layer buffers" in caplog.text and message in caplog.text


def test_unknown_backend_profile_is_conservative() -> None:
    ctx = vllm_context(one(be=backend("ROCM_AITER_FA", block_stride=True)), None)
    assert ctx.backend.name == "ROCM_AITER_FA"
    assert ctx.backend.scale_views is ScaleViews.assume_per_layer_contiguous
    assert ctx.backend.indexes_kv_by_block_stride and ctx.backend.supports_hnd
    assert not vllm_context(one(be=backend("ROCM_AITER_FA")), None).backend.indexes_kv_by_block_stride
    mla = vllm_context(one(MLAAttentionSpec(), backend("CUTLASS_MLA", block_stride=True)), None).backend
    assert mla.mla and not mla.supports_hnd and mla.indexes_kv_by_block_stride


def test_a_known_backend_follows_what_vllm_reports() -> None:
    said_no = vllm_context(one(FullAttentionSpec(indexes_kv_by_block_stride=False)), None).backend
    assert said_no.name == "FLASH_ATTN" and not said_no.indexes_kv_by_block_stride
    assert said_no.orders[Layout.BLNHC][0].value == "layer"  # layers stay outermost
    agrees = vllm_context(one(FullAttentionSpec(indexes_kv_by_block_stride=True)), None).backend
    assert agrees is BACKENDS["FLASH_ATTN"]


# ---------------------------------------------------------------- decide, engine, gate factory


def test_decide_returns_a_decision_whose_trace_names_the_connectors_own_preference() -> None:
    d = decide(one(), ThirdPartyConnector(True))
    assert d.layout.placement is Placement.cross_layer
    assert "vllm-own-preference.thirdpartyconnector" in d.explain()
    assert "<vllm:ThirdPartyConnector.prefer_cross_layer_blocks>" in d.explain()
    plain = decide(one(), OffloadingConnector())
    assert fingerprint(d) == fingerprint(plain)  # same layout, same fingerprint, whatever the reasons
    assert d.ruleset.digest != plain.ruleset.digest


def test_a_custom_engine_decides() -> None:
    text = ("version: 1\nrules:\n  - id: site-per-layer\n    description: this site keeps per-layer buffers\n"
            "    forbid: {placement: cross_layer}\n")
    engine = LayoutEngine(load_rules_from_texts({"global.yaml": text}))
    assert use_uniform_kv_cache(one(), OffloadingConnector(), engine=engine) is False
    assert use_uniform_kv_cache(one(), ThirdPartyConnector(True), engine=engine) is False  # a forbid still wins
    nothing = text + "  - id: nothing\n    description: nothing at all\n    forbid: {placement: per_layer}\n"
    with pytest.raises(NoLayoutError):
        use_uniform_kv_cache(one(), OffloadingConnector(), engine=LayoutEngine(load_rules_from_texts(
            {"global.yaml": nothing})))


PREFER_CROSS_LAYER = ("version: 1\nrules:\n  - id: site-prefers-cross-layer\n    description: this site's store "
                      "reads whole blocks\n    prefer: {placement: cross_layer}\n    weight: 50\n")


@pytest.mark.parametrize("attn_groups, requirement", [
    ([[group()], [group(SlidingWindowSpec())]], "cross-layer-needs-one-kv-cache-group"),
    ([[group(), group(be=backend("TRITON_ATTN"))]], "cross-layer-needs-one-attention-group"),
    ([[group(MambaSpec(), backend("MAMBA2"))]], "cross-layer-needs-attention-spec"),
    (one(FullAttentionSpec(indexes_kv_by_block_stride=False)), "cross-layer-needs-block-stride-indexing"),
    (one(FullAttentionSpec(kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD, dtype="torch.uint8"), backend("TRITON_ATTN")),
     "per-token-head-forbids-cross-layer"),  # issue-48412's Triton scale views: every layer's scales collide
], ids=["two KV cache groups", "two attention groups", "mamba", "not by block stride", "per-token-head, #48412"])
def test_rules_without_vllms_gate_conditions_cannot_make_vllm_allocate_cross_layer(attn_groups: list,
                                                                                   requirement: str) -> None:
    """A rule set written from scratch that prefers cross-layer: where vLLM's allocate_uniform_kv_caches
    cannot lay out the model (it asserts, shapes other backends' layers wrongly, or gives another layout),
    start-up stops naming the site rule and the missing requirement, instead of a bare AssertionError or
    a cache that is not the decided layout."""
    engine = LayoutEngine(load_rules_from_texts({"global.yaml": PREFER_CROSS_LAYER}))
    assert use_uniform_kv_cache(one(), OffloadingConnector(), engine=engine) is True  # vLLM can: the site decides
    gate = make_gate(lambda: True, OffloadingConnector, engine=engine)
    with pytest.raises(StartupError) as exc:
        gate(attn_groups)
    text = str(exc.value)
    assert "which vLLM (profile issue-48412) cannot allocate for this model; vLLM must not start" in text
    assert "global.yaml:3:5: error[vllm-requirement]: rule `site-prefers-cross-layer` (global) prefers" in text
    assert "<vllm:allocate_uniform_kv_caches>: error[vllm-requirement]: " in text and f"`{requirement}`" in text
    assert use_uniform_kv_cache(attn_groups, OffloadingConnector()) is False  # the shipped rules: per layer


def test_per_token_head_cross_layer_is_the_rules_choice_where_scale_views_are_stride_aware() -> None:
    """vLLM 0.28's backends build stride-aware scale views: its gate keeps per-token-head caches per layer
    by choice, not for safety, so a site rule may choose otherwise there."""
    engine = LayoutEngine(load_rules_from_texts({"global.yaml": PREFER_CROSS_LAYER}), vllm_version="vllm-0.28")
    pth = one(FullAttentionSpec(kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD, dtype="torch.uint8"),
              backend("TRITON_ATTN"))
    assert use_uniform_kv_cache(pth, OffloadingConnector(), engine=engine) is True


class RequiresHead(KVConnectorBase_V1):
    """An out-of-tree connector as vLLM builds it: its config kept by the base __init__ (``_vllm_config``),
    a class method that asks for a head order, the base class's prefer_cross_layer_blocks (False)."""

    def __init__(self, head_order: str | None, prefers: bool = False) -> None:
        super().__init__()
        self._vllm_config = SimpleNamespace(head_order=head_order)
        self._prefers = prefers

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return vllm_config.head_order

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return self._prefers


@pytest.mark.parametrize("connector", [RequiresHead("HND"), MultiConnector(RequiresHead("HND")),
                                       MultiConnector(NixlConnector(), RequiresHead("HND"))],
                         ids=["alone", "a MultiConnector member", "beside NIXL"])
def test_a_connector_without_rules_keeps_the_head_order_it_requires(connector: Any) -> None:
    """vLLM 0.28 fixes get_kv_cache_layout() from a connector's get_required_kvcache_layout (HND) before
    the gate: the rules must decide that head order too, or the gate stops a start-up vLLM allows."""
    engine = LayoutEngine.default("vllm-0.28")
    gate = make_gate(lambda: True, lambda: connector, engine=engine, head_order=lambda: "HND")
    assert gate(one()) is False
    d = decide(one(), connector, engine=engine)
    assert d.layout.head_order.value == "HND"
    assert any(p.rule.id == "vllm-own-layout.requireshead" and p.rule.source.file ==
               "<vllm:RequiresHead.get_required_kvcache_layout>" for p in d.preferences)
    # VLLM_KV_CACHE_LAYOUT wins over it, as in vLLM
    told = make_gate(lambda: True, lambda: connector, engine=engine, vllm_kv_cache_layout=lambda: "NHD",
                     head_order=lambda: "NHD")
    assert told(one()) is False


def test_a_multiconnector_member_without_rules_that_does_not_prefer_keeps_per_layer() -> None:
    """vLLM's MultiConnector prefers cross-layer only if every member does; a member the rules do not know
    keeps its own prefer_cross_layer_blocks, false here, however the known members prefer."""
    engine = LayoutEngine.default("vllm-0.28")
    assert use_uniform_kv_cache(one(), MultiConnector(OffloadingConnector()), engine=engine) is True
    assert use_uniform_kv_cache(one(), MultiConnector(OffloadingConnector(), RequiresHead(None)),
                                engine=engine) is False
    assert use_uniform_kv_cache(one(), MultiConnector(OffloadingConnector(), RequiresHead(None, prefers=True)),
                                engine=engine) is True
    assert use_uniform_kv_cache(one(), MultiConnector(RequiresHead(None)), engine=engine) is False
    # one that prefers, beside OffloadingConnector (whose rules prefer HND): vLLM allocates cross-layer HND; the
    # members' `agree` compares required head orders, not the cross-layer preference (a refusal before)
    d = decide(one(), MultiConnector(OffloadingConnector(), ThirdPartyConnector(True)), engine=engine)
    assert (d.layout.placement.value, d.layout.head_order.value) == ("cross_layer", "HND")


def test_rules_that_overrule_a_known_connector_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    class OffloadingConnector(KVConnectorBase_V1):  # a build whose offloading does not want cross-layer
        pass

    with caplog.at_level(logging.WARNING, logger="kvpolicy"):
        assert use_uniform_kv_cache(one(), OffloadingConnector()) is True
    assert "OffloadingConnector.prefer_cross_layer_blocks is false; the rules decide" in caplog.text


def test_make_gate_has_the_signature_of_vllms_gate() -> None:
    state: dict[str, Any] = {"connector": None}
    gate = make_gate(lambda: state["connector"] is not None, lambda: state["connector"])
    assert gate(one()) is False
    state["connector"] = OffloadingConnector()
    assert gate(one()) is True
    assert gate(one(FullAttentionSpec(dtype="torch.uint8", kv_quant_mode=None)), "int4_per_token_head") is False


def test_make_gate_can_agree_across_ranks() -> None:
    connector = OffloadingConnector()
    # a single process that never initialised torch.distributed is a world of one
    gate = make_gate(lambda: True, lambda: connector, agreement_group=lambda: None)
    assert gate(one()) is True
    # the agreement really runs: a group without torch.distributed is refused
    gate = make_gate(lambda: True, lambda: connector, agreement_group=lambda: object())
    with pytest.raises(AgreementError, match="no-process-group"):
        gate(one())
    assert gate(one(SimpleNamespace(block_size=16))) is False  # nothing to agree on: per-layer, no collective


def test_the_adapter_imports_nothing_from_vllm() -> None:
    source = (ROOT / "engine" / "integrations" / "vllm.py").read_text()
    assert "import vllm" not in source and "from vllm" not in source
    assert adapter.__name__ == "kvpolicy.engine.integrations.vllm"


def test_a_head_order_vllm_fixed_first_stops_start_up_naming_the_rule_and_vllm(tmp_path: Path) -> None:
    """0.24-0.28 fix the head order before the gate: a decision vLLM would not allocate names the rule
    that removed what vLLM allocates, and vLLM's own part (code, message, the variable to set)."""
    (tmp_path / "global.yaml").write_text(
        "version: 1\nrules:\n  - id: site-no-hnd\n    description: keep NHD\n    forbid: {layout: LBHNC}\n")
    e = LayoutEngine.from_path(tmp_path, vllm_version="0.28.0")
    d = e.decide(spec={"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}, backend="TRITON_ATTN")
    assert d.layout is Layout.LBNHC
    adapter.check_head_order(d, "NHD")  # what vLLM allocates: nothing to say
    with pytest.raises(StartupError) as info:
        adapter.check_head_order(d, "HND")
    rule, vllm = info.value.diagnostics
    assert (rule.code, rule.line, rule.message) == ("head-order-fixed", 3,
                                                    "rule `site-no-hnd` (forbid, global) removed LBHNC")
    assert (vllm.file, vllm.code) == ("<vllm>", "head-order-fixed")
    assert vllm.message.startswith("vLLM vllm-0.28 fixed the head order HND")
    assert "allocate LBHNC, not LBNHC" in vllm.message
    assert vllm.help is not None and "VLLM_KV_CACHE_LAYOUT=NHD" in vllm.help


def test_without_a_version_the_gate_decides_with_the_newest_gate_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the default profile resolves layouts (0.29+), the gate adapter falls back to the newest release
    that has the gate, never to a resolver release nor the historical seed."""
    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "0.34.0")
    assert vllm_context([[group()]], None).profile == "vllm-0.28"
