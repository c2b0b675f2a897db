"""What each backend takes and which connectors keep the hybrid KV cache manager: the profiles' facts
are each release's own classes' answers.

For every profiled release (patches included) and every backend its profile models, the oracle
(``oracles/backend_support.py``) asks the class for ``supported_dtypes`` / ``supports_dtype`` (the
model dtype ``validate_configuration`` checks) and ``get_supported_kernel_block_sizes()`` /
``supports_block_size`` (a user's ``--block-size``) over `BLOCK_SIZES`; the profile's
``supported_dtypes`` and ``kernel_block_sizes`` must be the same lists and give the same verdict for
every dtype and size (`BackendFacts.supports_dtype`, `.supports_block_size`). For every registered
connector name (each ``connector_modes`` value too) and a few MultiConnector configurations,
``KVConnectorFactory.supports_hma_config`` must be the profile's `ReleaseProfile.connector_supports_hma`.
One oracle call per release; answers are kept per machine.
"""

from __future__ import annotations

import functools
from typing import Any

import asked_ahead
import pytest
from profiled_releases import RELEASES
from vllm_release import run_oracle

from kvpolicy.policy.releases import KernelBlockMultiple, get_profile

BLOCK_SIZES = (1, 8, 16, 24, 32, 48, 64, 96, 128, 256, 272, 512)
DTYPES = ("float16", "bfloat16", "float32")


def _multi(*names: str) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": n, "kv_role": "kv_both"} for n in names]}}


def _connector_cases(version: str) -> list[dict[str, Any]]:
    profile = get_profile(version)
    cases: list[dict[str, Any]] = [{"kv_connector": n} for n in profile.connectors if n != "MultiConnector"]
    cases += [{"kv_connector": n, "kv_connector_extra_config": {m.key: value}}
              for n, m in profile.connector_modes.items() for value in m.classes]
    cases += [_multi(), _multi("NixlConnector", "OffloadingConnector"), _multi("NixlConnector", "LMCacheConnectorV1"),
              _multi("OffloadingConnector")]
    return cases


def start_ahead(items: list[pytest.Item]) -> None:
    """Each selected release's one oracle call asked ahead (asked_ahead.py)."""
    import ahead

    asked_ahead.queue("backend_support", ahead.params(items, "version"), _ask)


def _answers(version: str) -> list[Any]:
    return asked_ahead.take("backend_support", version, _ask)


@functools.cache
def _ask(version: str) -> list[Any]:
    profile = get_profile(version)
    return run_oracle(version, "backend_support", [
        {"backends": list(profile.backends), "dtypes": list(DTYPES), "block_sizes": list(BLOCK_SIZES)},
        {"hma": _connector_cases(version)}])


def _kernel_sizes(facts: Any) -> list[Any] | None:
    if facts.kernel_block_sizes is None:
        return None
    return [{"multiple_of": k.multiple_of} if isinstance(k, KernelBlockMultiple) else k
            for k in facts.kernel_block_sizes]


@pytest.mark.parametrize("version", RELEASES)
def test_backend_dtypes_and_block_sizes_are_the_releases(version: str, vllm_sites: Any) -> None:
    profile = get_profile(version)
    vllm = _answers(version)[0]
    wrong, compared = [], 0
    for name, facts in profile.backends.items():
        theirs = vllm[name]
        assert "error" not in theirs, f"{name} on {version}: {theirs}"
        if list(facts.supported_dtypes or ()) != theirs["supported_dtypes"]:
            wrong.append(f"{name}.supported_dtypes: vLLM {theirs['supported_dtypes']}, profile "
                         f"{facts.supported_dtypes}")
        if _kernel_sizes(facts) != theirs["kernel_block_sizes"]:
            wrong.append(f"{name}.kernel_block_sizes: vLLM {theirs['kernel_block_sizes']}, profile "
                         f"{_kernel_sizes(facts)}")
        for dtype in DTYPES:
            compared += 1
            if facts.supports_dtype(dtype) != theirs["supports_dtype"][dtype]:
                wrong.append(f"{name} supports_dtype({dtype}): vLLM {theirs['supports_dtype'][dtype]}")
        for size in BLOCK_SIZES:
            compared += 1
            if facts.supports_block_size(size) != theirs["supports_block_size"][str(size)]:
                wrong.append(f"{name} supports_block_size({size}): vLLM {theirs['supports_block_size'][str(size)]}")
    print(f"\nvLLM {version}: {len(profile.backends)} backends x ({len(DTYPES)} dtypes + {len(BLOCK_SIZES)} "
          f"block sizes) = {compared} verdicts, {compared - len(wrong)} equal")
    assert wrong == []


@pytest.mark.parametrize("version", RELEASES)
def test_connectors_keeping_the_hybrid_manager_are_the_releases(version: str, vllm_sites: Any) -> None:
    profile = get_profile(version)
    cases = _connector_cases(version)
    wrong = []
    for case, theirs in zip(cases, _answers(version)[1], strict=True):
        assert not isinstance(theirs, dict), f"{case} on {version}: {theirs}"
        ours = profile.connector_supports_hma(case["kv_connector"], case.get("kv_connector_extra_config"))
        if ours is not theirs:
            wrong.append(f"{case}: vLLM {theirs}, kvpolicy {ours}")
    print(f"\nvLLM {version}: {len(cases)} connector configurations, {len(cases) - len(wrong)} equal")
    assert wrong == []
