"""The CPU kernel's write order: the profile's ``CPU_ATTN.write_isa`` is each release's ``_get_attn_isa``.

For every release a profile answers for, one subprocess asks that release's own
``_get_attn_isa`` (``oracles/cpu_isa.py``, the host stubbed: x86 with and without AVX-512 and AMX
tiles, ARM, POWER, s390x, RISC-V with and without RVV) over model dtypes, block sizes, head sizes
and KV cache dtypes; kvpolicy's `pick_isa` over the profile's rules must name the same ISA, or
refuse where vLLM refuses, quoting it. That ISA is the fingerprint's ``kernel_order`` of a CPU_ATTN
cache, so a wrong rule would call two hosts' blocks interchangeable when their bytes are not.
"""

from __future__ import annotations

import itertools

import pytest
from profiled_releases import RELEASES
from vllm_release import run_oracle

from kvpolicy.policy.cpu_kernel import CpuHost, pick_isa
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.releases import get_profile

HOSTS = ("x86", "x86+avx512", "x86+amx", "x86+avx512+amx", "arm", "power", "s390x", "riscv", "riscv+rvv")
DTYPES = ("bfloat16", "float16", "float32")
BLOCK_SIZES = (16, 32, 48, 64, 128)
HEAD_SIZES = (48, 64, 80, 96, 112, 128, 256)
KV_CACHE_DTYPES = ("auto", "fp8")


def _cases() -> list[dict]:
    out = []
    for host, dtype, block, head, kv in itertools.product(HOSTS, DTYPES, BLOCK_SIZES, HEAD_SIZES, KV_CACHE_DTYPES):
        h = CpuHost.parse(host)
        out.append({"dtype": dtype, "block_size": block, "head_size": head, "kv_cache_dtype": kv,
                    "arch": h.arch.value, "amx": h.amx, "avx512": h.avx512, "rvv": h.rvv, "host": host})
    return out


@pytest.mark.parametrize("version", RELEASES)
def test_the_kernel_order_is_the_releases(version: str, vllm_sites) -> None:
    rules = get_profile(version).backend("CPU_ATTN").write_isa
    assert rules, f"profile of {version} states no write_isa for CPU_ATTN"
    cases = _cases()
    answers = run_oracle(version, "cpu_isa", [{k: v for k, v in c.items() if k != "host"} for c in cases])
    isas: set[str] = set()
    refused = 0
    for case, answer in zip(cases, answers, strict=True):
        where = (version, case, answer)
        try:
            ours = pick_isa(rules, dtype=case["dtype"], block_size=case["block_size"], head_size=case["head_size"],
                            kv_cache_dtype=case["kv_cache_dtype"], host=CpuHost.parse(case["host"]))
        except InputError as exc:
            assert "error" in answer, where
            vllm_message = answer["error"].split(": ", 1)[1]
            assert vllm_message in exc.diagnostics[0].message, where
            refused += 1
            continue
        assert answer.get("isa") == ours, where
        isas.add(ours)
    # the grid reaches every ISA the rules name and both refusals, so no rule goes unchecked
    assert isas == {r.isa for r in rules if r.isa}, (version, isas)
    assert refused > 0
