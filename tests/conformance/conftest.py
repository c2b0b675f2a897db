"""Conformance tests: the real vLLM releases, installed once into a cache outside the repo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import install_vllm

RELEASES = ("0.34.0", "0.28.0", "0.27.1", "0.27.0", "0.26.0", "0.25.1", "0.25.0", "0.24.0")


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
