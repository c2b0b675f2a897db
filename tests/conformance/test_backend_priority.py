"""The default attention backend: kvpolicy's `backend_priority` is vLLM's own priority list.

With no attention backend configured, vLLM's CUDA platform tries
``_get_backend_priorities(use_mla, capability)`` in order; `kvpolicy.engine.inputs.default_backend`
takes the first of the profile's ``backend_priority`` that supports the kv_cache_dtype. For each
release, MLA or not, and device capabilities 8, 9, 10 and 12, the profile's list must be the
release's, cut to the backends the profile models (same order, nothing left out).
"""

from __future__ import annotations

import itertools

import pytest
from release_facts_gate import backend_priority_from_oracle
from v028_space import GATE_SERIES
from vllm_release import run_oracle

from kvpolicy.policy.releases import get_profile

MAJORS = (8, 9, 10, 12)


@pytest.mark.parametrize("version", [*GATE_SERIES, "0.34.0"])
def test_backend_priority_is_the_releases(version: str, vllm_sites) -> None:
    profile = get_profile(version)
    cases = [{"mla": mla, "major": major} for mla, major in itertools.product((False, True), MAJORS)]
    answers = run_oracle(version, "backend_priority", cases)
    for case, vllm_order in zip(cases, answers, strict=True):
        kind = "mla" if case["mla"] else "attention"
        ours = profile.backend_priority.get(f"{kind}@{case['major']}", profile.backend_priority[kind])
        assert list(ours) == [b for b in vllm_order if b in profile.backends], (version, case)
    if version in GATE_SERIES:  # the profile holds what the facts tool writes from these lists
        lists = {f"{'mla' if c['mla'] else 'attention'}@{c['major']}": a for c, a in zip(cases, answers)}
        assert backend_priority_from_oracle(lists, tuple(profile.backends)) == {
            k: list(v) for k, v in profile.backend_priority.items() if "@cpu" not in k}  # CUDA (test_cpu_platform)
