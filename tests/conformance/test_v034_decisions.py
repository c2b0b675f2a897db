"""kvpolicy's decisions equal `resolve_kv_cache_layout`'s, case by case, for every resolver release (0.29-0.34).

Each release is held to its own installed code, over the space below cut to what that release can
be given (`Release`: no extensible KV cache before 0.34, no HiSparse before 0.30, no replicated DCP
groups before 0.31): 19,962 cases for 0.29, 22,239 for 0.30, 34,704 for 0.31-0.33, 69,408 for 0.34.
0.29-0.33 refuse workers whose lists differ (an `AssertionError`: kvpolicy's `workers-disagree`).
What follows describes the 0.34 space.

vLLM decides the KV cache layout once, in the engine core, with
``resolve_kv_cache_layout(vllm_config, supported_layouts, kv_cache_specs)``
(``vllm/v1/attention/backends/utils.py``). What it reads, and the values enumerated here:

* each worker's backends (``get_supported_kv_cache_layouts`` merges one worker's
  ``supported_kv_cache_layouts()``; the core merges the workers' lists): 44 worker sets of
  TRITON_ATTN, FLASH_ATTN, FLASHINFER, FLEX_ATTENTION, CPU_ATTN (each alone, every pair
  and two triples in one worker, every ordered pair of workers, six sets of three
  workers/pipeline stages, a stage without attention) and 4 of FLASHMLA / TRITON_MLA;
* the device capability (only FLASHINFER's declaration reads it; the facts case checks
  the profile's declarations for every backend under every capability): None, 8.0, 9.0,
  10.0, 12.0 for worker sets with FLASHINFER, None and 9.0 for the others;
* the KV cache specs (the HNC shape, page size and DCP sharding of each): 12 sets of
  attention/Mamba specs (one spec; two equal groups; mixed heads; mixed heads and block
  size with equal pages; bf16 beside fp8_per_token_head; DCP-sharded target beside a
  replicated draft with a different page and with the same page; attention beside a
  Mamba state; sharded + replicated attention beside a Mamba state; FLASHINFER's nvfp4
  (2H head slots, vLLM's ``customize_spec``) at head 128 and nvfp4_4over6 at head 64;
  nvfp4 beside a bf16 spec of the same HNC shape) and 2 MLA sets (one
  spec; a sharded target beside a replicated draft);
* ``VLLM_KV_CACHE_LAYOUT``: unset, each of the six layouts, NHD, HND (9);
* the KV transfer config, through ``get_kv_connector_cache_layout`` (the connector's
  ``get_required_kvcache_layout``) and the checks ``VllmConfig`` makes on it: 27
  configurations (none; NixlConnector with transfer_mode unset, pull, push, and an
  invalid one; NixlPull/PushConnector; OffloadingConnector with and without HiSparse;
  HiSparse without a connector; MooncakeConnector; MooncakeStoreConnector;
  LMCacheConnectorV1; HiSparseConnector with and without the hisparse flag;
  ExampleHiddenStatesConnector; 11 MultiConnector member combinations, agreeing,
  requiring nothing, conflicting, nested, and holding an invalid member);
* ``enable_extensible_kv_cache``: off, on (2).

Four planes of that space are enumerated in full (69,408 cases in all), leaving out what
vLLM cannot build (a spec whose kv_cache_dtype some backend lacks: vLLM selects no backend;
kvpolicy refuses those inputs, which is checked too; an MLA spec with a non-MLA backend):

* A, the candidates: 44 worker sets x their capabilities (154 pairs) x 12 spec sets x 9
  VLLM_KV_CACHE_LAYOUT values x {no connector, OffloadingConnector} x 2 = 45,504 (the
  fp8_per_token_head set only on TRITON_ATTN, the nvfp4 sets only on FLASHINFER alone);
* B, the connectors: 7 (worker set, capability) pairs x 4 spec sets (one spec, mixed
  heads, DCP, attention + Mamba) x 9 x 27 connector configurations x 2 = 13,608;
* C, MLA: 4 worker sets x 2 capabilities x 2 MLA spec sets x 9 x 27 x 2 = 7,776;
* D, B's 7 pairs x the other 8 spec sets x 9 x {none, NixlConnector, MultiConnector
  Nixl + Offloading, MultiConnector HiSparse + Offloading} x 2 = 2,520.

One oracle subprocess answers every case (``oracles/v034.py``, which calls vLLM's own
functions), with the facts of the release and the inputs of the shipped policy tests
(``rules/vllm-0.34/tests``); kvpolicy decides each with the shipped rules
(``LayoutEngine.default``). The test takes about 80 s, most of it the oracle.
They must agree on every case: the same layout, or both refusing for the same reason. vLLM's refusals are
mapped to what kvpolicy must say (`_VLLM_ERRORS`): a `NoLayoutError` whose primary reason
(`primary_reason`: not merely one of the rules it names) is the rule that stands for vLLM's check,
or an `InputError` with the same meaning as its first code. vLLM's warning
that the connector's layout is not a candidate must show in `Decision.warnings`.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from profiled_releases import RELEASES
from vllm_release import run_oracle

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.errors import InputError, NoLayoutError, PolicyError
from kvpolicy.policy.releases import ReleaseProfile, Resolver, get_profile
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

PROFILE = "vllm-0.34"
EXPECTED_CASES = 69_408
# The resolver releases (0.29 on) held to their own resolve_kv_cache_layout: the same space, cut to
# what each can be given (`Release`); its size per release, as measured.
RESOLVER_RELEASES = tuple(v for v in RELEASES if get_profile(v).resolver is Resolver.kv_cache_layout)
# (worker set, spec set) pairs no backend of the workers can build (a kv_cache_dtype none supports): 169 in
# every resolver release; kvpolicy must refuse each as an input error
MIN_UNBUILDABLE = 150
EXPECTED_BY_RELEASE = {"0.34.0": EXPECTED_CASES, "0.33.0": 34_704, "0.32.0": 34_704, "0.31.0": 34_704,
                       "0.30.0": 22_239, "0.29.0": 19_962}


@dataclass(frozen=True)
class Release:
    """One resolver release and the part of the input space it can be given: the
    `enable_extensible_kv_cache` and HiSparse settings only where it has them (`options`),
    replicated (DCP) spec sets only where its specs have DCP sharding, connectors it registers."""

    version: str

    @property
    def profile(self) -> ReleaseProfile:
        return get_profile(self.version)

    @property
    def ext_values(self) -> tuple[bool, ...]:
        return (False, True) if "enable_extensible_kv_cache" in self.profile.options else (False,)

    def has_spec_set(self, name: str) -> bool:
        sets = SPEC_SETS | MLA_SPEC_SETS
        return "dcp_sharding" in self.profile.options or all(s.get("dcp_sharded", True) for s in sets[name])

    def has_connector(self, label: str) -> bool:
        ktc, hisparse = CONNECTORS[label]
        if hisparse and "hisparse" not in self.profile.options:
            return False
        return all(name in self.profile.connectors for name in _connector_names(ktc))


def _connector_names(ktc: dict[str, Any] | None) -> list[str]:
    if ktc is None:
        return []
    members = (ktc.get("kv_connector_extra_config") or {}).get("connectors", [])
    return [ktc["kv_connector"], *(n for m in members for n in _connector_names(m))]


NEWEST = Release("0.34.0")

# ---------------------------------------------------------------------------------------------
# The input space

NON_MLA = ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN")
MLA = ("FLASHMLA", "TRITON_MLA")
CAPABILITIES = (None, (8, 0), (9, 0), (10, 0), (12, 0))

Workers = tuple[tuple[str, ...], ...]


def _non_mla_workers() -> list[Workers]:
    singles = [((b,),) for b in NON_MLA]
    one_worker = [(pair,) for pair in itertools.combinations(NON_MLA, 2)]
    one_worker += [(("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER"),), (("FLASHINFER", "FLEX_ATTENTION", "TRITON_ATTN"),)]
    two_workers = [((a,), (b,)) for a, b in itertools.permutations(NON_MLA, 2)]
    three_workers = [
        (("FLASHINFER",), ("FLASHINFER",), ("CPU_ATTN",)),
        (("FLASHINFER",), ("CPU_ATTN",), ("CPU_ATTN",)),
        (("FLASH_ATTN",), ("FLASHINFER",), ("CPU_ATTN",)),
        (("TRITON_ATTN",), ("FLASH_ATTN",), ("FLASHINFER",)),
        (("FLASHINFER", "FLASH_ATTN"), ("FLASHINFER",), ("TRITON_ATTN",)),
        (("FLEX_ATTENTION",), ("FLASHINFER",), ("FLASHINFER",)),
    ]
    no_attention_stage = [(("FLASHINFER",), ())]
    return singles + one_worker + two_workers + three_workers + no_attention_stage


MLA_WORKERS: list[Workers] = [(("FLASHMLA",),), (("TRITON_MLA",),), (("FLASHMLA", "TRITON_MLA"),),
                              (("FLASHMLA",), ("TRITON_MLA",))]


def _capabilities(workers: Workers) -> tuple[tuple[int, int] | None, ...]:
    if any("FLASHINFER" in w for w in workers):
        return CAPABILITIES
    return (None, (9, 0))


def _full(heads: int = 8, head: int = 128, block: int = 16, **kw: Any) -> dict[str, Any]:
    return {"kind": "full", "num_kv_heads": heads, "head_size": head, "block_size": block, **kw}


_MAMBA = {"kind": "mamba", "block_size": 16, "num_kv_heads": 1, "head_size": 256}  # a 16 KiB bf16 state

SPEC_SETS: dict[str, list[dict[str, Any]]] = {
    "one": [_full()],
    "two-equal": [_full(), _full()],
    "mixed-heads": [_full(), {**_full(heads=4), "kind": "sliding_window", "sliding_window": 128}],
    "mixed-shape-same-page": [_full(8, 128, 16), _full(4, 128, 32)],
    "mixed-dtype": [_full(), _full(kv_cache_dtype="fp8_per_token_head")],
    "dcp-draft": [_full(), _full(head=64, dcp_sharded=False)],
    "dcp-draft-same-page": [_full(), _full(dcp_sharded=False)],
    "hybrid-mamba": [_full(), _MAMBA],
    "dcp-mamba": [_full(), _full(dcp_sharded=False), _MAMBA],
    # FLASHINFER's nvfp4: 2H head slots of D/2 + D/16 bytes (18432 B and 2304 B pages)
    "nvfp4": [_full(kv_cache_dtype="nvfp4")],
    "nvfp4-4over6": [_full(heads=2, head=64, kv_cache_dtype="nvfp4_4over6")],
    # 8 nvfp4 heads are 16 slots of 72 B: the same HNC shape as 16 bf16 heads of 18 (not mixed)
    "nvfp4-slots-same-hnc": [_full(kv_cache_dtype="nvfp4"), _full(heads=16, head=18)],
}
MLA_SPEC_SETS: dict[str, list[dict[str, Any]]] = {
    "mla": [{"kind": "mla", "num_kv_heads": 1, "head_size": 576, "block_size": 16}],
    "mla-dcp-draft": [{"kind": "mla", "num_kv_heads": 1, "head_size": 576, "block_size": 16},
                      {"kind": "mla", "num_kv_heads": 1, "head_size": 512, "block_size": 16, "dcp_sharded": False}],
}

ENV_LAYOUTS = (None, "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "NHD", "HND")


def _k(name: str, **extra: Any) -> dict[str, Any]:
    """One KV transfer config as vLLM takes it (``--kv-transfer-config``)."""
    return {"kv_connector": name, "kv_role": "kv_both", **({"kv_connector_extra_config": extra} if extra else {})}


def _multi(*members: dict[str, Any]) -> dict[str, Any]:
    return _k("MultiConnector", connectors=list(members))


_HISPARSE = _k("HiSparseConnector", host_pool_gib=4)

# label -> (kv_transfer_config or None, hisparse flag)
CONNECTORS: dict[str, tuple[dict[str, Any] | None, bool]] = {
    "none": (None, False),
    "none+hisparse": (None, True),
    "Nixl": (_k("NixlConnector"), False),
    "Nixl(pull)": (_k("NixlConnector", transfer_mode="pull"), False),
    "Nixl(push)": (_k("NixlConnector", transfer_mode="push"), False),
    "Nixl(bogus)": (_k("NixlConnector", transfer_mode="bogus"), False),
    "NixlPull": (_k("NixlPullConnector"), False),
    "NixlPush": (_k("NixlPushConnector"), False),
    "Offloading": (_k("OffloadingConnector"), False),
    "Offloading+hisparse": (_k("OffloadingConnector"), True),
    "Mooncake": (_k("MooncakeConnector"), False),
    "MooncakeStore": (_k("MooncakeStoreConnector"), False),
    "LMCache": (_k("LMCacheConnectorV1"), False),
    "HiSparse": (_HISPARSE, False),
    "HiSparse+hisparse": (_HISPARSE, True),
    "ExampleHiddenStates": (_k("ExampleHiddenStatesConnector"), False),
    "Multi[Nixl,Offloading]": (_multi(_k("NixlConnector"), _k("OffloadingConnector")), False),
    "Multi[Nixl(push),Mooncake]": (_multi(_k("NixlConnector", transfer_mode="push"), _k("MooncakeConnector")), False),
    "Multi[Offloading,LMCache]": (_multi(_k("OffloadingConnector"), _k("LMCacheConnectorV1")), False),
    "Multi[MooncakeStore,LMCache]": (_multi(_k("MooncakeStoreConnector"), _k("LMCacheConnectorV1")), False),
    "Multi[HiSparse,Offloading]": (_multi(_HISPARSE, _k("OffloadingConnector")), False),
    "Multi[HiSparse,Offloading]+hisparse": (_multi(_HISPARSE, _k("OffloadingConnector")), True),
    "Multi[HiSparse,Nixl]": (_multi(_HISPARSE, _k("NixlConnector")), False),
    "Multi[ExampleHiddenStates,Nixl]": (_multi(_k("ExampleHiddenStatesConnector"), _k("NixlConnector")), False),
    "Multi[Nixl,Offloading,HiSparse]": (_multi(_k("NixlConnector"), _k("OffloadingConnector"), _HISPARSE), False),
    "Multi[Multi[Nixl,Offloading],LMCache]": (
        _multi(_multi(_k("NixlConnector"), _k("OffloadingConnector")), _k("LMCacheConnectorV1")), False),
    "Multi[Nixl(bogus),Offloading]": (_multi(_k("NixlConnector", transfer_mode="bogus"), _k("OffloadingConnector")),
                                      False),
}

# Plane B's (workers, capability) pairs: one per distinct candidate list that matters to a connector.
CONNECTOR_WORKERS: list[tuple[Workers, tuple[int, int] | None]] = [
    ((("TRITON_ATTN",),), None),
    ((("FLASHINFER",),), (9, 0)),
    ((("FLASHINFER",),), (10, 0)),
    ((("FLEX_ATTENTION",),), None),
    ((("CPU_ATTN",),), None),
    ((("FLASH_ATTN",), ("FLASHINFER",)), (10, 0)),
    ((("FLASHINFER",), ("CPU_ATTN",)), (9, 0)),
]
CONNECTOR_SPEC_SETS = ("one", "mixed-heads", "dcp-draft", "hybrid-mamba")
PLANE_D_CONNECTORS = ("none", "Nixl", "Multi[Nixl,Offloading]", "Multi[HiSparse,Offloading]")


def _case(workers: Workers, cap: Any, specs: str, env: str | None, conn: str, ext: bool) -> dict[str, Any]:
    return {"workers": workers, "cap": cap, "specs": specs, "env": env, "conn": conn, "ext": ext}


def _plane_d(release: Release) -> list[dict[str, Any]]:
    """The spec sets plane B leaves out, for B's worker sets and a few connectors."""
    others = [s for s in SPEC_SETS if s not in CONNECTOR_SPEC_SETS]
    return [_case(w, c, s, e, k, x) for (w, c), s, e, k, x in itertools.product(
        CONNECTOR_WORKERS, others, ENV_LAYOUTS, PLANE_D_CONNECTORS, release.ext_values)]


def buildable(workers: Workers, specs: str, release: Release = NEWEST) -> bool:
    """vLLM selects a backend only for a kv_cache_dtype it supports (`supported_kv_cache_dtypes`,
    checked against the profile by the facts case)."""
    dtypes = {s.get("kv_cache_dtype", "auto") for s in (SPEC_SETS | MLA_SPEC_SETS)[specs] if s["kind"] != "mamba"}
    backends = release.profile.backends
    return all(dtypes <= set(backends[b].kv_cache_dtypes or ()) for w in workers for b in w)


def input_space(release: Release = NEWEST) -> list[dict[str, Any]]:
    cases = []
    for workers in _non_mla_workers():  # plane A
        for cap, specs, env, conn, ext in itertools.product(
                _capabilities(workers), SPEC_SETS, ENV_LAYOUTS, ("none", "Offloading"), release.ext_values):
            cases.append(_case(workers, cap, specs, env, conn, ext))
    for (workers, cap), specs, env, conn, ext in itertools.product(  # plane B
            CONNECTOR_WORKERS, CONNECTOR_SPEC_SETS, ENV_LAYOUTS, CONNECTORS, release.ext_values):
        cases.append(_case(workers, cap, specs, env, conn, ext))
    for workers, cap, specs, env, conn, ext in itertools.product(  # plane C
            MLA_WORKERS, (None, (9, 0)), MLA_SPEC_SETS, ENV_LAYOUTS, CONNECTORS, release.ext_values):
        cases.append(_case(workers, cap, specs, env, conn, ext))
    return [c for c in cases + _plane_d(release) if buildable(c["workers"], c["specs"], release)
            and release.has_spec_set(c["specs"]) and release.has_connector(c["conn"])]


def unbuildable(release: Release = NEWEST) -> list[tuple[Workers, str]]:
    """The (worker set, spec set) pairs the space leaves out: vLLM has no backend for them."""
    return [(w, s) for w in _non_mla_workers() for s in SPEC_SETS if not buildable(w, s, release)]


# ---------------------------------------------------------------------------------------------
# The two sides


def _specs(case: dict[str, Any]) -> list[dict[str, Any]]:
    return (SPEC_SETS | MLA_SPEC_SETS)[case["specs"]]


def oracle_case(case: dict[str, Any]) -> dict[str, Any]:
    specs = []
    for s in _specs(case):
        if s["kind"] == "mamba":
            # vLLM's MambaSpec: one bf16 state of 2*N*D values (kvpolicy's page of one "head")
            specs.append({"kind": "mamba", "block_size": s["block_size"],
                          "state_elements": 2 * s["block_size"] * s["head_size"]})
        else:
            specs.append(dict(s))
    ktc, hisparse = CONNECTORS[case["conn"]]
    return {
        "workers": [list(w) for w in case["workers"]],
        "device_capability": None if case["cap"] is None else list(case["cap"]),
        "specs": specs,
        "use_mla": case["specs"] in MLA_SPEC_SETS,
        "VLLM_KV_CACHE_LAYOUT": case["env"],
        "kv_transfer_config": ktc,
        "enable_extensible_kv_cache": case["ext"],
        "hisparse": hisparse,
    }


def _groups(case: dict[str, Any]) -> KVCacheGroups:
    groups = []
    for s in _specs(case):
        spec = KVCacheSpec(kind=AttentionKind(s["kind"]), num_layers=2, block_size=s["block_size"],
                           num_kv_heads=s["num_kv_heads"], head_size=s["head_size"],
                           kv_cache_dtype=s.get("kv_cache_dtype", "auto"), sliding_window=s.get("sliding_window"))
        groups.append(KVCacheGroup(spec=spec, dcp_sharded=s.get("dcp_sharded", True)))
    return KVCacheGroups(groups=tuple(groups))


def _connector(ktc: dict[str, Any] | None) -> tuple[str | None, dict[str, Any] | None]:
    if ktc is None:
        return None, None
    return ktc["kv_connector"], ktc.get("kv_connector_extra_config")


def kvpolicy_inputs(case: dict[str, Any], release: Release = NEWEST) -> dict[str, Any]:
    ktc, hisparse = CONNECTORS[case["conn"]]
    name, extra = _connector(ktc)
    return {
        "groups": _groups(case),
        "worker_attention_backends": [list(w) for w in case["workers"]],
        "device_capability": None if case["cap"] is None else case["cap"][0],
        "vllm_kv_cache_layout": case["env"],
        "connector": name,
        "connector_config": extra,
        "enable_extensible_kv_cache": case["ext"],
        "hisparse": hisparse,
        "vllm_version": release.profile.name,
    }


# vLLM's refusals -> what kvpolicy must answer: (error class, the rule id its NoLayoutError must
# name, or the InputError's diagnostic code).
_VLLM_ERRORS: list[tuple[str, type[PolicyError], str]] = [
    ("ValueError: No KV cache layout satisfies every supported set", NoLayoutError, "release-candidates"),
    ("AssertionError: Workers disagree on supported KV cache layouts", InputError, "workers-disagree"),
    ("ValueError: Specs with mixed HNC shapes need a block-compact layout", NoLayoutError,
     "mixed-hnc-shapes-need-block-compact"),
    ("ValueError: DCP with a replicated draft and mixed KV page sizes", NoLayoutError,
     "dcp-mixed-page-sizes-need-block-outermost"),
    ("ValueError: KV connectors with the extensible KV cache need a block-compact", NoLayoutError,
     "extensible-kv-cache-with-connector-needs-block-compact"),
    ("ValueError: VLLM_KV_CACHE_LAYOUT=", NoLayoutError, "env-layout-"),
    ("ValueError: KV cache layout mismatch", NoLayoutError, ":members-agree"),
    ("Value error, HiSparse requires a KV transfer config with HiSparseConnector", InputError,
     "hisparse-needs-connector"),
    ("Value error, Invalid NixlConnector transfer_mode", NoLayoutError, "nixl-transfer-mode-is-pull-or-push"),
]


# vLLM's legacy layout names (vllm/config/cache.py `_LAYOUT_COMPAT_ALIASES`), as its messages may show them
_LEGACY_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}
_ENV_REQUESTED = re.compile(r"VLLM_KV_CACHE_LAYOUT=(\w+) does not satisfy")


def _vllm_error_kind(error: str) -> tuple[str, type[PolicyError], str] | None:
    """vLLM's error mapped to (its text, kvpolicy's error class, the rule id or code kvpolicy must name).
    A refused ``VLLM_KV_CACHE_LAYOUT`` maps to the env-layout rule of the layout vLLM's message names, not
    to any env-layout rule."""
    for entry in _VLLM_ERRORS:
        if entry[0] in error:
            if entry[2] == "env-layout-":
                requested = _ENV_REQUESTED.search(error)
                if requested is None:
                    return None
                name = _LEGACY_NAMES.get(requested.group(1), requested.group(1))
                return entry[0], entry[1], f"env-layout-{name.lower()}"
            return entry
    return None


_RULE = re.compile(r"rule `([^`]+)`")
_REMOVED = re.compile(r"rule `([^`]+)` \([^)]*\) removed ((?:`\w+`(?:, )?)+)")


def _blamed(exc: PolicyError) -> list[str]:
    if isinstance(exc, NoLayoutError):
        return [m.group(1) for d in exc.diagnostics for m in [_RULE.search(d.message)] if m]
    return [d.code for d in exc.diagnostics]


def primary_reason(text: str) -> str | None:
    """The one reason a `NoLayoutError`'s text (its diagnostics, or the plugin's start-up error) gives for
    refusing: MultiConnector members that disagree where they are named (vLLM asks the connectors before
    it resolves a layout), else the entry whose removals leave no candidate, the entries read in the order
    the refusal lists them (the release's filter first, then the rules as they ran). A rule that only
    removes what was already gone is named too, but is not the reason; None where nothing is named."""
    removals = [(m.group(1), set(re.findall(r"`(\w+)`", m.group(2)))) for m in _REMOVED.finditer(text)]
    agree = [rule for rule, _ in removals if rule.endswith(":members-agree")]
    if agree:
        return agree[0]
    everything = set().union(*(layouts for _, layouts in removals))
    gone: set[str] = set()
    for rule, layouts in removals:
        gone |= layouts
        if gone == everything:
            return rule
    return None


def primary(exc: PolicyError) -> str | None:
    """`primary_reason` of a `NoLayoutError`; an `InputError`'s first diagnostic code."""
    if isinstance(exc, NoLayoutError):
        return primary_reason("\n".join(d.message for d in exc.diagnostics))
    return exc.diagnostics[0].code if exc.diagnostics else None


def is_reason(marker: str, reason: str | None) -> bool:
    """Whether kvpolicy's primary reason is the one vLLM's error maps to (``:members-agree`` names the
    MultiConnector scope's entry, whatever the scope's label)."""
    return reason is not None and (reason == marker or (marker.startswith(":") and reason.endswith(marker)))


def _kvpolicy(engine: LayoutEngine, case: dict[str, Any], release: Release = NEWEST) -> dict[str, Any]:
    try:
        decision = engine.decide(explain=False, **kvpolicy_inputs(case, release))
    except PolicyError as exc:
        return {"error": type(exc).__name__, "blamed": _blamed(exc), "primary": primary(exc)}
    out: dict[str, Any] = {"layout": str(decision.layout)}
    if decision.context.connector is not None:
        out["warnings"] = list(decision.warnings)
    out["pages"] = [g.spec.page_size_bytes for g in decision.context.groups.groups]
    return out


def compare(case: dict[str, Any], vllm: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """None when kvpolicy agrees with vLLM on this case; else what differs."""
    if "error" in vllm:
        kind = _vllm_error_kind(vllm["error"])
        if kind is None:
            return f"vLLM refused the case in a way the test does not map: {vllm['error'][:200]}"
        _, cls, marker = kind
        if "error" not in ours:
            return f"vLLM refuses ({marker}), kvpolicy chose {ours['layout']}"
        if ours["error"] != cls.__name__:
            return f"vLLM refuses ({marker}): expected {cls.__name__}, got {ours['error']} {ours['blamed']}"
        if not is_reason(marker, ours["primary"]):
            return (f"vLLM refuses ({marker}); kvpolicy's {ours['error']} gives {ours['primary']} as its reason "
                    f"(naming {ours['blamed']})")
        return None
    if "error" in ours:
        return f"vLLM chose {vllm['layout']}, kvpolicy refused: {ours['error']} {ours['blamed']}"
    if ours["layout"] != vllm["layout"]:
        return f"layout: vLLM {vllm['layout']}, kvpolicy {ours['layout']}"
    if [s[2] for s in vllm["specs"]] != ours["pages"]:
        return f"page sizes: vLLM {[s[2] for s in vllm['specs']]}, kvpolicy {ours['pages']}"
    return _same_warnings(vllm["warnings"], ours.get("warnings", []))


_VLLM_WARNING = re.compile(r"KV connector cache layout (\w+) does not satisfy every supported set; .*"
                           r"Using (\w+) instead\.")
_OUR_WARNING = re.compile(r"prefers (\w+), which .*; the preference is dropped and (\w+) is used instead$")


def _same_warnings(vllm: list[str], ours: list[str]) -> str | None:
    """None when kvpolicy warns as vLLM does: where vLLM warns that the connector's layout is not a
    candidate and names the one it uses instead, a kvpolicy warning names the same dropped layout and the
    same layout used instead (and no other warning: MultiConnector members that asked for the same layout
    warn once each in kvpolicy, once in vLLM); where vLLM does not warn, kvpolicy does not."""
    said = [m.groups() for w in vllm if (m := _VLLM_WARNING.search(w))]
    if len(said) != sum("KV connector cache layout" in w for w in vllm):
        return f"a vLLM warning the test does not read: {vllm}"
    theirs = {(_LEGACY_NAMES.get(wanted, wanted), used) for wanted, used in said}
    mine = {m.groups() if (m := _OUR_WARNING.search(w)) else (w, None) for w in ours}
    if theirs != mine:
        return f"vLLM warned {vllm}; kvpolicy warned {ours}"
    return None


def _shown(case: dict[str, Any]) -> str:
    workers = "|".join(",".join(w) or "-" for w in case["workers"])
    cap = "-" if case["cap"] is None else f"{case['cap'][0]}.{case['cap'][1]}"
    return (f"workers={workers} cap={cap} specs={case['specs']} env={case['env'] or '-'} conn={case['conn']} "
            f"ext={int(case['ext'])}")


def _vllm_shown(answer: dict[str, Any]) -> str:
    if "error" in answer:
        return answer["error"].splitlines()[0][:110] + ("" if "\n" not in answer["error"] else
                                                         " / " + answer["error"].splitlines()[1].strip()[:90])
    return answer["layout"] + (" (warned)" if answer["warnings"] else "")


def _ours_shown(answer: dict[str, Any]) -> str:
    if "error" in answer:
        return f"{answer['error']} {answer['blamed']}"
    return answer["layout"] + (" (warned)" if answer.get("warnings") else "")


def _check_facts(facts: dict[str, Any], release: Release) -> list[str]:
    """The profile's declarations are vLLM's: what plane A's capability pruning rests on."""
    profile = release.profile
    problems = []
    if [str(x) for x in profile.default_layout_preference] != facts["default_layout_preference"]:
        problems.append(f"default preference {facts['default_layout_preference']}")
    for name in NON_MLA + MLA:
        entry = facts["backends"][name]
        if "error" in entry:
            problems.append(f"{name}: {entry['error']}")
            continue
        if entry["is_mla"] != profile.backends[name].mla:
            problems.append(f"{name}: is_mla {entry['is_mla']}")
        if entry["supported_kv_cache_dtypes"] != list(profile.backends[name].kv_cache_dtypes or ()):
            problems.append(f"{name}: supported_kv_cache_dtypes {entry['supported_kv_cache_dtypes']}")
        for cap, layouts in entry["supported_kv_cache_layouts"].items():
            major = None if cap == "none" else int(cap.split(".")[0])
            declared = profile.backends[name].declared_layouts(major)
            mine = None if declared is None else [str(x) for x in declared]
            if mine != layouts:
                problems.append(f"{name} at capability {cap}: vLLM {layouts}, profile {mine}")
    return problems


# ---------------------------------------------------------------------------------------------
# The shipped policy tests (rules/vllm-0.34/tests/*.yaml), as vLLM inputs

RULES = Path(__file__).resolve().parents[2] / "rules"
# Refusals that happen outside resolve_kv_cache_layout and VllmConfig (vLLM's backend selection).
_OUTSIDE_THE_ORACLE = {"unsupported-kv-cache-dtype"}


def _policy_cases(release: Release) -> list[Any]:
    """The shipped policy tests of the release's rules, where they decide for this release (a case
    pinned to another release's `vllm_version`, or using a setting this release lacks, is left out)."""
    from kvpolicy.engine.policy_tests import load_cases

    layers = [RULES / layer / "tests" for layer in release.profile.rules]
    cases = load_cases([d for d in layers if d.is_dir()])
    return [lc for lc in cases if lc.case.expect.error not in _OUTSIDE_THE_ORACLE and _fits(lc.case.input, release)]


def _fits(inp: Any, release: Release) -> bool:
    if inp.vllm_version is not None and get_profile(inp.vllm_version) != release.profile:
        return False
    if (inp.enable_extensible_kv_cache and release.ext_values == (False,)) or (
            inp.hisparse and "hisparse" not in release.profile.options):
        return False
    groups = inp.groups or []
    if "dcp_sharding" not in release.profile.options and any(
            not (g.get("dcp_sharded", True) if isinstance(g, dict) else g.dcp_sharded) for g in groups):
        return False
    names = [inp.connector, *(m.get("kv_connector") for m in (inp.connector_config or {}).get("connectors", []))]
    return all(n is None or n == "none" or n in release.profile.connectors for n in names)


def _oracle_spec(data: dict[str, Any], inp: Any, release: Release) -> dict[str, Any]:
    spec = dict(data.get("spec", data))
    if spec.get("kind") == "mamba":
        return {"kind": "mamba", "block_size": spec["block_size"], "state_elements": 2 * spec["block_size"]
                * spec["num_kv_heads"] * spec["head_size"]}
    if inp.kv_cache_dtype is not None:
        spec["kv_cache_dtype"] = inp.kv_cache_dtype
    if inp.block_size is not None:
        spec["block_size"] = inp.block_size
    spec.pop("num_layers", None)
    spec.setdefault("block_size", release.profile.default_block_size)
    if "dcp_sharded" in data:
        spec["dcp_sharded"] = data["dcp_sharded"]
    return spec


def _ktc(name: str | None, extra: dict[str, Any] | None) -> dict[str, Any] | None:
    if name is None or name == "none":
        return None
    extra = dict(extra or {})
    if "connectors" in extra:
        extra["connectors"] = [_ktc(m["kv_connector"], m.get("kv_connector_extra_config")) for m in extra["connectors"]]
    return _k(name, **extra)


def policy_oracle_case(inp: Any, release: Release) -> dict[str, Any]:
    """A policy test's input (`CaseInput`) as the oracle's decision case."""
    groups = inp.groups if inp.groups is not None else [{"spec": inp.spec}]
    specs = [_oracle_spec(g if isinstance(g, dict) else g.model_dump(), inp, release) for g in groups]
    workers = inp.worker_attention_backends or [[inp.attention_backend or inp.backend or "TRITON_ATTN"]]
    return {
        "workers": workers,
        "device_capability": None if inp.device_capability is None else [inp.device_capability, 0],
        "specs": specs,
        "use_mla": any(s.get("kind") == "mla" for s in specs),
        "VLLM_KV_CACHE_LAYOUT": inp.vllm_kv_cache_layout,
        "kv_transfer_config": _ktc(inp.connector, inp.connector_config),
        "enable_extensible_kv_cache": inp.enable_extensible_kv_cache,
        "hisparse": inp.hisparse,
    }


@pytest.fixture(scope="module", params=RESOLVER_RELEASES)
def oracle(request: Any, vllm_sites: Any) -> dict[str, Any]:
    """One oracle subprocess per release: the facts, the input space, the policy tests' inputs."""
    release = Release(request.param)
    start = time.perf_counter()
    cases = input_space(release)
    policy = _policy_cases(release)
    asked = ([{"facts": True}] + [oracle_case(c) for c in cases]
             + [policy_oracle_case(lc.case.input, release) for lc in policy])
    facts, *answers = run_oracle(release.version, "v034", asked)
    return {"release": release, "facts": facts, "cases": cases, "answers": answers[:len(cases)], "policy": policy,
            "policy_answers": answers[len(cases):], "seconds": time.perf_counter() - start}


def test_shipped_policy_tests_agree_with_vllm(oracle: dict[str, Any]) -> None:
    """Every case of the release's shipped policy tests that its resolver can answer: kvpolicy's
    decision is vLLM's (and, under the rules' own newest release, what the case expects, which
    `kvpolicy test` checks)."""
    from kvpolicy.engine.policy_tests import run_case

    release = oracle["release"]
    ruleset = LayoutEngine.default(vllm_version=release.version).ruleset
    diffs = []
    for lc, vllm in zip(oracle["policy"], oracle["policy_answers"]):
        result = run_case(ruleset, lc, release.profile.name)
        if release == NEWEST:
            assert result.passed, (lc.location, result.failures)
        ours = ({"layout": str(result.layout)} if result.error is None else
                {"error": type(result.error).__name__, "blamed": _blamed(result.error),
                 "primary": primary(result.error)})
        if "error" in vllm:
            kind = _vllm_error_kind(vllm["error"])
            ok = kind is not None and ours.get("error") == kind[1].__name__ and is_reason(kind[2], ours["primary"])
        else:
            ok = ours.get("layout") == vllm["layout"]
        if not ok:
            diffs.append(f"{lc.location} {lc.case.name}: vLLM {_vllm_shown(vllm)}, kvpolicy {_ours_shown(ours)}")
    assert len(oracle["policy"]) >= 25  # 0.29 answers 29 of the shipped cases (the rest pin 0.34.0)
    assert not diffs, "\n".join(diffs)


def test_decisions_equal_vllms(oracle: dict[str, Any]) -> None:
    start = time.perf_counter()
    release: Release = oracle["release"]
    cases, answers, facts = oracle["cases"], oracle["answers"], oracle["facts"]
    expected = EXPECTED_BY_RELEASE[release.version]
    assert len(cases) == expected, f"the space of {release.version} is stated as {expected}; it has {len(cases)}"
    oracle_s = oracle["seconds"]
    assert not (bad := _check_facts(facts, release)), bad

    engine = LayoutEngine.default(vllm_version=release.version)
    ours = [_kvpolicy(engine, c, release) for c in cases]
    unbuilt = [(w, s) for w, s in unbuildable(release) if release.has_spec_set(s)]
    assert len(unbuilt) >= MIN_UNBUILDABLE, unbuilt  # the check below is not an empty loop
    for workers, specs in unbuilt:  # what vLLM cannot build, kvpolicy refuses as an input error
        refused = _kvpolicy(engine, _case(workers, None, specs, None, "none", False), release)
        assert refused.get("blamed") == ["unsupported-kv-cache-dtype"], (workers, specs, refused)
    diffs = [(c, v, o, why) for c, v, o in zip(cases, answers, ours) if (why := compare(c, v, o)) is not None]
    total_s = time.perf_counter() - start + oracle_s

    outcomes = Counter(a.get("layout") or (_vllm_error_kind(a["error"]) or ("unmapped",))[-1] for a in answers)
    differing = {id(c) for c, *_ in diffs}
    layouts = sum(1 for c, a in zip(cases, answers) if "layout" in a and id(c) not in differing)
    refusals = len(cases) - len(diffs) - layouts
    print(f"\nvLLM {release.version} resolve_kv_cache_layout vs kvpolicy `{release.profile.name}`: "
          f"{len(cases) - len(diffs)} of {len(cases)} cases agree: {layouts} the same layout (and page sizes), "
          f"{refusals} the same refusal (vLLM's error mapped to the rule kvpolicy names); {len(diffs)} differ; "
          f"oracle {oracle_s:.1f} s, total {total_s:.1f} s")
    print(f"  space: {len(_non_mla_workers())} + {len(MLA_WORKERS)} worker sets, capabilities "
          f"{[None if c is None else f'{c[0]}.{c[1]}' for c in CAPABILITIES]}, "
          f"{len(SPEC_SETS)} + {len(MLA_SPEC_SETS)} spec sets, {len(ENV_LAYOUTS)} VLLM_KV_CACHE_LAYOUT values, "
          f"{len(CONNECTORS)} connector configurations, enable_extensible_kv_cache on/off")
    print("  vLLM's outcomes: " + ", ".join(f"{k} {n}" for k, n in outcomes.most_common()))
    warned = sum(1 for a in answers if any("KV connector cache layout" in w for w in a.get("warnings", ())))
    print(f"  vLLM warned that the connector's layout is not a candidate in {warned} cases")
    if diffs:
        lines = [f"{len(diffs)} of {len(cases)} cases differ; the first 25:",
                 f"{'inputs':<118} | {'vLLM':<40} | kvpolicy"]
        for case, v, o, why in diffs[:25]:
            lines.append(f"{_shown(case):<118} | {_vllm_shown(v):<40} | {_ours_shown(o)}")
            lines.append(f"{'':<118}   -> {why}")
        kinds = Counter(why.split(":")[0] for *_, why in diffs)
        lines.append("by kind: " + json.dumps(dict(kinds.most_common(10))))
        pytest.fail("\n".join(lines), pytrace=False)
    # the agreement is mostly on layouts vLLM chose, not only on refusals (each release's space: 36-42 % layouts)
    assert layouts >= len(cases) // 4, (layouts, refusals)
