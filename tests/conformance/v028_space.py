"""The decision input space of the uniform-gate releases (vLLM 0.24-0.28), shared by their
conformance tests (``test_gate_*.py``).

One description per deployment, turned into the v028 oracle's gate case and into
kvpolicy's `decide()` keywords, so both sides read the same inputs. The space is the
same for every gate release; each release's backends and kv_cache_dtypes (its facts)
select the part of it that release accepts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.policy.spec import KVCacheGroup, KVCacheGroups, KVCacheSpec

VERSION = "0.28.0"
# The uniform-gate releases: each minor release, and the patch releases, each with the release
# whose modelled files it shares (test_gate_decisions.py proves them identical).
GATE_SERIES = ("0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0")
GATE_PATCHES = {"0.25.1": "0.25.0", "0.27.1": "0.27.0"}
GATE_RELEASES = (*GATE_SERIES, *GATE_PATCHES)

MHA_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN")
MLA_BACKENDS = ("FLASHMLA", "TRITON_MLA")
# kv_cache_dtypes 0.28's backends accept (FLASHINFER) that kvpolicy decides but does not plan: the gate
# reads nothing of them but the spec (not per-token-head), and kvpolicy models nvfp4's bytes for vLLM
# 0.29+'s allocation only, not 0.28's per-layer (B, 2H, N, D/2 + D/16) tensors.
UNPLANNED_DTYPES = ("nvfp4", "nvfp4_4over6")

# (the other backend of a group with two attention groups)
SECOND_BACKEND = {"TRITON_ATTN": "FLASH_ATTN", "FLASH_ATTN": "TRITON_ATTN", "FLASHINFER": "TRITON_ATTN",
                  "FLEX_ATTENTION": "TRITON_ATTN", "CPU_ATTN": "TRITON_ATTN", "FLASHMLA": "TRITON_MLA",
                  "TRITON_MLA": "FLASHMLA"}

LAYERS = 2
MHA = {"num_kv_heads": 2, "head_size": 64, "block_size": 16}
MLA = {"num_kv_heads": 1, "head_size": 576, "block_size": 16}

# model shapes: name -> KV cache groups, each (kind, number of attention groups)
MHA_SHAPES: dict[str, tuple[tuple[str, int], ...]] = {
    "full": (("full", 1),),
    "sliding_window": (("sliding_window", 1),),
    "two_attention_groups": (("full", 2),),
    "full+sliding_window": (("full", 1), ("sliding_window", 1)),
    "full+mamba": (("full", 1), ("mamba", 1)),
    "mamba_only": (("mamba", 1),),
}
MLA_SHAPES: dict[str, tuple[tuple[str, int], ...]] = {
    "mla": (("mla", 1),),
    "two_attention_groups": (("mla", 2),),
}


def _multi(*members: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    return "MultiConnector", {"connectors": [{"kv_connector": n, "kv_connector_extra_config": e} for n, e in members]}


NIXL_ON = {"enable_cross_layers_blocks": "true"}
CONNECTORS: tuple[tuple[str | None, dict[str, Any]], ...] = (
    (None, {}),
    ("OffloadingConnector", {}),
    *(("OffloadingConnector", {"canonical_layout": v}) for v in (True, False, "False", "true", "", 0, 1)),
    ("NixlConnector", {}),
    *(("NixlConnector", {"enable_cross_layers_blocks": v}) for v in (True, False, "true", "True", "TRUE", "false",
                                                                       "1", 1)),
    ("NixlPullConnector", NIXL_ON),
    ("NixlPushConnector", NIXL_ON),
    ("NixlPushConnector", {}),
    ("MooncakeStoreConnector", {}),
    ("MooncakeStoreConnector", {"enable_cross_layers_blocks": "true"}),
    ("MooncakeStoreConnector", {"enable_cross_layers_blocks": True}),
    ("MooncakeConnector", {}),
    ("LMCacheConnectorV1", {}),
    ("ExampleConnector", {}),
    ("ExampleHiddenStatesConnector", {}),
    ("SimpleCPUOffloadConnector", {}),
    ("DecodeBenchConnector", {}),
    _multi(),
    _multi(("OffloadingConnector", {})),
    _multi(("OffloadingConnector", {}), ("NixlConnector", NIXL_ON)),
    _multi(("OffloadingConnector", {}), ("NixlConnector", {})),
    _multi(("OffloadingConnector", {}), ("LMCacheConnectorV1", {})),
    _multi(("OffloadingConnector", {"canonical_layout": True}), ("NixlConnector", NIXL_ON)),
    _multi(("NixlConnector", NIXL_ON), ("MooncakeStoreConnector", NIXL_ON)),
    _multi(("LMCacheConnectorV1", {}), ("MooncakeConnector", {})),
    _multi(("NixlConnector", NIXL_ON), ("ExampleHiddenStatesConnector", {})),
)
ENV_LAYOUTS = (None, "NHD", "HND")


@dataclass(frozen=True)
class Deployment:
    backend: str
    kv_cache_dtype: str
    shape: str
    groups: tuple[tuple[str, int], ...]
    connector: str | None
    extra: dict[str, Any] = field(hash=False)
    env: str | None

    @property
    def mla(self) -> bool:
        return self.backend in MLA_BACKENDS

    def label(self) -> str:
        conn = "none" if self.connector is None else f"{self.connector}{self.extra or ''}"
        return (f"{self.backend} {self.kv_cache_dtype} {self.shape} {conn} "
                f"VLLM_KV_CACHE_LAYOUT={self.env}")

    # ---- the oracle's side
    def oracle_case(self) -> dict[str, Any]:
        dims = MLA if self.mla else MHA
        specs = []
        for kind, attn_groups in self.groups:
            s: dict[str, Any] = {"kind": kind, "num_layers": LAYERS * attn_groups}
            if kind != "mamba":
                s.update(dims)
                s["backends"] = [self.backend, SECOND_BACKEND[self.backend]][:attn_groups]
            else:  # a state page below every attention page here, padded up to it as vLLM pads hybrids
                s.update(block_size=dims["block_size"], shapes=[[2, 16], [2, 8, 8]], dtypes=["bfloat16", "float32"])
            specs.append(s)
        case: dict[str, Any] = {"gate": True, "kv_cache_dtype": self.kv_cache_dtype, "use_mla": self.mla,
                                "specs": specs, "VLLM_KV_CACHE_LAYOUT": self.env}
        if self.connector is not None:
            extra = dict(self.extra)
            if "connectors" in extra:
                extra["connectors"] = [{**m, "kv_role": "kv_both"} for m in extra["connectors"]]
            case["kv_transfer_config"] = {"kv_connector": self.connector, "kv_connector_extra_config": extra}
        return case

    # ---- kvpolicy's side
    def decide_inputs(self, version: str = VERSION) -> dict[str, Any]:
        dims = MLA if self.mla else MHA
        groups = []
        for kind, attn_groups in self.groups:
            if kind == "mamba":
                spec = KVCacheSpec(kind="mamba", num_layers=LAYERS, block_size=dims["block_size"], num_kv_heads=1,
                                   head_size=64)
            else:
                spec = KVCacheSpec(kind=kind, num_layers=LAYERS * attn_groups, kv_cache_dtype=self.kv_cache_dtype,
                                   sliding_window=128 if kind == "sliding_window" else None, **dims)
            groups.append(KVCacheGroup(spec=spec, num_attention_groups=attn_groups))
        return {
            "groups": KVCacheGroups(groups=tuple(groups)),
            "backend": self.backend,
            "connector": self.connector,
            "connector_config": dict(self.extra) if self.connector is not None else None,
            "vllm_kv_cache_layout": self.env,
            "vllm_version": version,
        }


def backend_dtypes(facts: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each backend's supported_kv_cache_dtypes from the oracle's facts (nvfp4 included: decided, not planned)."""
    return {b: tuple(facts["backends"][b]["supported_kv_cache_dtypes"]) for b in (*MHA_BACKENDS, *MLA_BACKENDS)}


def deployments(facts: dict[str, Any]) -> list[Deployment]:
    """Every backend x each of its kv_cache_dtypes x model shape x connector config x
    VLLM_KV_CACHE_LAYOUT (a Mamba-only model with ``auto`` only: it has no attention cache)."""
    out = []
    for backend, dtypes in backend_dtypes(facts).items():
        shapes = MLA_SHAPES if backend in MLA_BACKENDS else MHA_SHAPES
        for dtype, (shape, groups), (conn, extra), env in itertools.product(dtypes, shapes.items(), CONNECTORS,
                                                                            ENV_LAYOUTS):
            if shape == "mamba_only" and dtype != "auto":
                continue
            out.append(Deployment(backend, dtype, shape, groups, conn, extra, env))
    return out


def vllm_layout(backend_facts: dict[str, Any], head_order: str, uniform: bool) -> str:
    """The layout vLLM allocates, read off the backend's stride orders in the oracle's facts.

    Per layer the logical shape is ``(B, H, N, C)`` (MLA ``(B, N, C)``) permuted by
    ``get_kv_cache_stride_order()`` (the identity where it raises), one buffer per layer;
    cross-layer it is ``(L, B, H, N, C)`` permuted by the order with the layer dim.
    MLA has no head dim: H is named beside N (size 1, the same bytes).
    """
    by = backend_facts["by_layout"][head_order]
    # (B, 2, N, H, D) in 0.24-0.25: K/V in a dim of their own (K), named by where L, B, H and N go
    kv_dim = len(backend_facts["kv_cache_shape"]["auto"]) == 5
    logical = "BNC" if backend_facts["is_mla"] else "BKNHC" if kv_dim else "BHNC"
    if uniform:
        order = by["stride_order_with_layers"]
        physical = "".join(("L" + logical)[i] for i in order)
    else:
        order = by["stride_order"]
        if isinstance(order, dict):  # {"error": "NotImplementedError: "}: the runner keeps the identity
            order = list(range(len(logical)))
        physical = "L" + "".join(logical[i] for i in order)
    physical = physical.replace("K", "")
    return physical if "H" in physical else physical.replace("NC", "NHC")
