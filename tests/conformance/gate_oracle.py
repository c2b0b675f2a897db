"""One oracle subprocess per uniform-gate release (vLLM 0.24-0.28), answering everything the
``test_gate_*.py`` modules compare: the release's facts, vLLM's gate and head order on every
deployment of `v028_space`, and the allocations of `geometry_cases`. Answered once per test
session and shared by the modules (the vLLM import and model set-up are paid once per release).

A patch release whose modelled files are its series release's (``GATE_PATCHES``; proven in
``test_gate_decisions.py``) is asked for its facts and every ``PATCH_STRIDE``-th deployment only.

The answers are kept on this machine beside the installed release (``<cache>/<version>/answers/``),
keyed by everything they depend on: the installed release (its COMPLETE marker: version, pins,
Python), the torch the oracle runs with, the oracle's source and the cases asked. Any change to
one of them asks the release again; nothing recorded elsewhere is ever replayed.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any

from v028_space import GATE_PATCHES, UNPLANNED_DTYPES, Deployment, deployments
from vllm_release import run_oracle

from kvpolicy.engine.plan import plan_layout
from kvpolicy.engine.verify import verify_plan
from kvpolicy.policy.layouts import HeadOrder, Layout, Placement
from kvpolicy.policy.releases import ReleaseProfile, get_profile

PATCH_STRIDE = 10
# Releases whose gate gives per-token-head caches a cross-layer buffer over scale views that assume
# per-layer buffers (0.24-0.25's Triton backend): kvpolicy keeps those per layer, deliberately.
PER_LAYER_SCALE_VIEWS = {"0.24.0", "0.25.0", "0.25.1"}
LAYERS, BLOCKS = 3, 4
DIMS = {"mha": {"num_kv_heads": 2, "head_size": 64, "block_size": 16},
        "mla": {"num_kv_heads": 1, "head_size": 576, "block_size": 16}}
# FlashMLA's kernels take 64-token blocks only (get_supported_kernel_block_sizes).
BLOCK_SIZE = {"FLASHMLA": 64}


@dataclass(frozen=True)
class GateAnswers:
    version: str
    facts: dict[str, Any]
    decisions: list[tuple[Deployment, dict[str, Any]]]
    geometry: list[tuple[dict[str, Any], dict[str, Any]]]
    seconds: float  # the oracle subprocess (or reading its kept answers), wall clock

    @property
    def profile(self) -> ReleaseProfile:
        return get_profile(self.version)


def space(profile: ReleaseProfile) -> list[Deployment]:
    """Every deployment of `v028_space` over this profile's backends and kv_cache_dtypes."""
    facts_like = {"backends": {b: {"supported_kv_cache_dtypes": list(f.kv_cache_dtypes or ())}
                               for b, f in profile.backends.items()}}
    return deployments(facts_like)


def geometry_cases(profile: ReleaseProfile) -> list[dict[str, Any]]:
    """Every backend x each kv_cache_dtype it supports (that kvpolicy plans) x head order x placement it
    allocates, with the layout that allocation is (``expect``)."""
    out = []
    for name, facts in profile.backends.items():
        dtypes = [d for d in facts.kv_cache_dtypes or () if d not in UNPLANNED_DTYPES]
        for dtype, head_order, cross in itertools.product(dtypes, HeadOrder, (False, True)):
            layout = facts.allocated_layout(head_order, cross)
            if layout is None:
                continue
            dims = dict(DIMS["mla" if facts.mla else "mha"])
            dims["block_size"] = BLOCK_SIZE.get(name, dims["block_size"])
            case: dict[str, Any] = {"backend": name, "kv_cache_dtype": dtype, "head_order": head_order.value,
                                    "layout": "cross_layer" if cross else "per_layer", "num_layers": LAYERS,
                                    "num_blocks": BLOCKS, "dtype": "bfloat16", **dims, "expect": layout.value}
            if facts.mla:
                case["specs"] = [{"kind": "mla", **dims}]
            out.append(case)
    return out


@functools.cache
def gate_answers(version: str) -> GateAnswers:
    """The release's answers (one subprocess; cached for the session)."""
    profile = get_profile(version)
    decisions = space(profile)
    geometry: list[dict[str, Any]] = []
    if version in GATE_PATCHES:
        decisions = decisions[::PATCH_STRIDE]
    else:
        geometry = geometry_cases(profile)
    cases = [{"facts": True}, *(d.oracle_case() for d in decisions),
             *({k: v for k, v in c.items() if k != "expect"} for c in geometry)]
    start = time.perf_counter()
    facts, *answers = _answers(version, cases)
    seconds = time.perf_counter() - start
    return GateAnswers(version, facts, list(zip(decisions, answers[:len(decisions)])),
                       list(zip(geometry, answers[len(decisions):])), seconds)


def _answers(version: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The v028 oracle's answers to ``cases`` under ``version``, kept per machine by `run_oracle` (a
    second cache here once deleted run_oracle's answers of the same oracle and had its own deleted in
    turn, so both were asked again on every run)."""
    return run_oracle(version, "v028", cases)


@functools.cache
def overlaps(version: str, backend: str, kv_cache_dtype: str, layout: str) -> int:
    """Colliding writer pairs kvpolicy's verifier finds in vLLM's layout for this backend and dtype."""
    spec = Deployment(backend, kv_cache_dtype, "full", (("full", 1),), None, {}, None).decide_inputs(
        version)["groups"].groups[0].spec
    plan = plan_layout(Layout(layout), spec, get_profile(version).backend(backend), 4)
    return verify_plan(plan).collision_count


def deliberate(version: str, d: Deployment, ours: str, theirs: str) -> bool:
    """vLLM 0.24-0.25 allocate a per-token-head cache cross-layer over per-layer scale views; kvpolicy keeps
    it per layer in the same head order, and its verifier proves vLLM's layout overlaps."""
    if version not in PER_LAYER_SCALE_VIEWS or "per_token_head" not in d.kv_cache_dtype or "error" in (ours, theirs):
        return False
    mine, vllms = Layout(ours), Layout(theirs)
    return (vllms.placement is Placement.cross_layer and mine.placement is Placement.per_layer
            and mine.head_order is vllms.head_order and overlaps(version, d.backend, d.kv_cache_dtype, theirs) > 0)
