"""The vLLM releases the conformance suite holds kvpolicy to: every version a shipped profile lists.

A module of its own (not ``conftest``): ``from conftest import ...`` finds whichever conftest
Python imported first, which depends on the test directories a run collects.
"""

from __future__ import annotations

from kvpolicy.policy.releases import get_profile, profile_names

# Every release a shipped profile answers for, patch releases included, newest first.
RELEASES = tuple(sorted({v for n in profile_names() for v in get_profile(n).vllm_versions},
                        key=lambda v: tuple(int(p) for p in v.split(".")), reverse=True))
