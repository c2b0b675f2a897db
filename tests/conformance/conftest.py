"""Conformance tests: the real vLLM releases, installed once into a cache outside the repo."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ahead
import install_vllm
from profiled_releases import RELEASES


@pytest.fixture(scope="session")
def vllm_sites() -> dict[str, Path]:
    """Installed site of every release. An install failure errors the tests; never skips. Each test process
    begins at its own part of the list (`ahead.rotated`), so that on an empty cache the processes install
    side by side instead of waiting on one another's install of the same release."""
    sites = {}
    for version in ahead.rotated(list(RELEASES), *ahead.share()):
        try:
            sites[version] = install_vllm.ensure(version)
        except install_vllm.InstallError as exc:
            pytest.fail(f"installing vLLM {version} failed: {exc}", pytrace=False)
    return {version: sites[version] for version in RELEASES}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the oracles the selected tests will read, each module's ``start_ahead`` (ahead.py)."""
    try:
        ahead.workers()
    except ahead.AheadError as exc:
        raise pytest.UsageError(str(exc)) from None
    if session.config.option.collectonly:
        return  # nothing will read an answer
    selected: dict[Any, list[pytest.Item]] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_ahead"):
            selected.setdefault(module, []).append(item)
    for module, items in selected.items():
        module.start_ahead(items)
    ahead.start(*ahead.share())  # pytest -n: this process's part of the queue


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The session is over: nothing queued runs, and no oracle outlives it."""
    ahead.stop()
