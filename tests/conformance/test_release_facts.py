"""Every profiled vLLM release has exactly the facts its profile states, read from the release itself.

For each version a shipped profile lists (patch releases included), `release_facts.py` runs the
release's facts oracle and backend priorities and compares every fact the release determines
(`release_facts.DETERMINED`) with the profile's resolved facts (its own file applied to the
profiles it extends). A difference names the fact, the profile's value and the release's.
"""

from __future__ import annotations

import asked_ahead
import pytest
from release_facts import canonical, release_facts

from kvpolicy.policy.release_diff import fact_differences
from kvpolicy.policy.releases import get_profile, profile_facts, profile_names

# Every release a shipped profile lists: the resolver releases' facts read by oracles/v034.py, the gate
# family's (0.24-0.28) by oracles/v028.py through release_facts_gate.py.
PROFILED = sorted({(v, n) for n in profile_names() for v in get_profile(n).vllm_versions})


def start_ahead(items: list[pytest.Item]) -> None:
    """Each selected release's facts (five oracles, one after another) asked ahead (asked_ahead.py)."""
    import ahead

    asked_ahead.queue("release_facts", ahead.params(items, "version"), release_facts)


@pytest.mark.parametrize(("version", "profile"), PROFILED, ids=[v for v, _ in PROFILED])
def test_the_profile_states_the_releases_facts(version: str, profile: str, vllm_sites) -> None:
    facts = asked_ahead.take("release_facts", version, release_facts)
    lines = fact_differences(canonical(profile_facts(profile)), canonical(facts))
    assert not lines, f"profile `{profile}` vs vLLM {version}:\n" + "\n".join(lines)


def test_a_difference_is_named_with_both_values() -> None:
    facts = profile_facts("vllm-0.34")
    changed = {**facts, "default_block_size": 32,
               "backends": {**facts["backends"], "CPU_ATTN": {**facts["backends"]["CPU_ATTN"],
                                                              "supported_layouts": ["LBNHC"]}}}
    lines = fact_differences(canonical(facts), canonical(changed))
    assert "default_block_size: 64 -> 32" in lines
    assert "backends.CPU_ATTN.supported_layouts.None: [LBHNC] -> [LBNHC]" in lines
    assert len(lines) == 1 + 5  # the CPU backend's declaration at each capability
