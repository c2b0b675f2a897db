"""Conformance tests: the real vLLM releases, installed once into a cache outside the repo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import install_vllm

from kvpolicy.policy.releases import get_profile, profile_names

# Every release a shipped profile answers for, patch releases included, newest first.
RELEASES = tuple(sorted({v for n in profile_names() for v in get_profile(n).vllm_versions},
                        key=lambda v: tuple(int(p) for p in v.split(".")), reverse=True))


@pytest.fixture(scope="session")
def vllm_sites() -> dict[str, Path]:
    """Installed site of every release. An install failure errors the tests; never skips."""
    sites = {}
    for version in RELEASES:
        try:
            sites[version] = install_vllm.ensure(version)
        except install_vllm.InstallError as exc:
            pytest.fail(f"installing vLLM {version} failed: {exc}", pytrace=False)
    return sites
