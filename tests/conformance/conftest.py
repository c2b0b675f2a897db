"""Conformance tests: the real vLLM releases, installed once into a cache outside the repo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import install_vllm
from profiled_releases import RELEASES


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
