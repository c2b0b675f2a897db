"""The CPU platform's backend: `default_backend(..., device="cpu")` names what vLLM's CPU platform selects.

For every release a profile answers for, one subprocess asks that release's own
``CpuPlatform.get_attn_backend_cls`` (``oracles/cpu_platform.py``; the host stubbed with and
without AMX tiles) for attention and MLA models, with no backend configured and with each
backend the profile models configured, and kvpolicy must agree: the backend it defaults to on
``device="cpu"``, the backends it accepts there (vLLM replaces any other, "Cannot use ... on
CPU"), and the profile's ``attention@cpu`` / ``mla@cpu`` / ``mla@cpu+amx`` facts. kvpolicy models
neither CPU_MLA nor AMX_MLA, so MLA on the CPU is refused, naming what vLLM selects.
"""

from __future__ import annotations

import itertools

import pytest
from profiled_releases import RELEASES
from vllm_release import run_oracle

from kvpolicy.engine.inputs import build_context
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.releases import get_profile

DENSE = {"num_layers": 2, "num_kv_heads": 2, "head_size": 64}
MLA = {"kind": "mla", "num_layers": 2, "num_kv_heads": 1, "head_size": 576}


def _refusal(**inputs) -> str | None:
    """The error code kvpolicy refuses these inputs with (None: accepted)."""
    try:
        build_context(**inputs)
    except InputError as exc:
        return exc.diagnostics[0].code
    return None


@pytest.mark.parametrize("version", RELEASES)
def test_cpu_backend_is_the_releases(version: str, vllm_sites) -> None:
    profile = get_profile(version)
    dense_dtypes = [*profile.backends["CPU_ATTN"].kv_cache_dtypes, "fp8_per_token_head"]
    cases = [{"mla": False, "kv_cache_dtype": d, "selected": s, "amx": a}
             for d, s, a in itertools.product(dense_dtypes, [None, *profile.backends], (False, True))]
    cases += [{"mla": True, "kv_cache_dtype": "auto", "selected": None, "amx": a} for a in (False, True)]
    answers = run_oracle(version, "cpu_platform", cases)
    checked = 0
    for case, answer in zip(cases, answers, strict=True):
        vllm = answer.get("backend")
        where = (version, case, answer)
        dtype, selected = case["kv_cache_dtype"], case["selected"]
        if case["mla"]:
            key = "mla@cpu+amx" if case["amx"] else "mla@cpu"
            stated = profile.backend_priority.get(key, profile.backend_priority.get("mla@cpu"))
            assert list(stated) == ([vllm] if vllm else []), where
            if vllm is None:
                assert answer["error"].startswith("NotImplementedError"), where
            assert vllm not in profile.backends, "CPU MLA is modelled now: test its default instead"
            expected = "unmodelled-backend" if vllm else "unsupported-device"
            assert _refusal(spec=MLA, device="cpu", vllm_version=version) == expected, where
        elif dtype not in profile.backends["CPU_ATTN"].kv_cache_dtypes:
            # kvpolicy refuses a dtype CPU_ATTN lacks; vLLM refuses it too (0.33 on) or selects CPU_ATTN,
            # whose `supported_kv_cache_dtypes` lack it (0.24-0.32 check the dtype later)
            assert _refusal(spec=DENSE, kv_cache_dtype=dtype, device="cpu", vllm_version=version,
                            attention_backend=selected) in ("unsupported-kv-cache-dtype", "backend-not-on-device")
            assert vllm is None or dtype not in (profile.backends[vllm].kv_cache_dtypes or ()), where
        elif selected is None:
            ctx = build_context(spec=DENSE, kv_cache_dtype=dtype, device="cpu", vllm_version=version)
            assert ctx.backend.name == vllm, where
        else:
            refused = _refusal(spec=DENSE, kv_cache_dtype=dtype, device="cpu", vllm_version=version,
                               attention_backend=selected)
            assert refused == (None if vllm == selected else "backend-not-on-device"), where
        checked += 1
    assert checked == len(cases)
