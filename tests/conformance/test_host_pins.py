"""The oracles answer for one machine, whatever machine runs the suite (issue 33).

vLLM reads the host while it builds what the oracles ask about: on an AMD EPYC (AVX-512, no AMX)
0.28 and 0.34 found no MoE kernel for gpt-oss's MXFP4 experts (the CPU one needs AMX) and did not
build the model, where an Intel Xeon with AMX did, so `test_model_configs.py` and
`test_hma_groups.py` failed there only. Every oracle that imports vLLM now pins the machine
(`oracles/_host.py`: the ISA queries, the architecture, ``/proc/cpuinfo``, no CUDA device, only
torch's and pydantic's packages from the running environment) and the harness names the child's
whole environment (`vllm_release.oracle_env`).

Asserted here: the affected oracle cases answer the same on simulated machines
(`simulated_host.HOSTS`: the issue's AMD EPYC with zentorch; an AVX2-only Xeon; an ARM machine
answering every ISA query yes, with a CUDA device and every package vLLM probes for) as on this one;
no variable of the parent's environment reaches an oracle unless the harness names it; and every
oracle that imports vLLM pins the host (or, for the one that must run this machine's kernels, says so).
Answers on each simulated machine are kept apart from the real ones (`run_oracle`'s ``host``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from simulated_host import HOSTS
from vllm_release import ORACLES, oracle_env, run_oracle

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
RELEASES = ("0.34.0", "0.28.0")


def _config(name: str) -> dict[str, Any]:
    return json.loads((CORPUS / name / "config.json").read_text(encoding="utf-8"))


# model_config's cases whose answer vLLM takes from the host: gpt-oss's MXFP4 and bf16 experts (the MoE
# kernel by the CPU's ISA), Qwen3-Next's gated delta net (its CPU ops by AMX), a dense model
MODEL_CASES = [
    {"config": _config(name), "tensor_parallel_size": tp, "dtype": "auto", "kv_cache_dtype": kv, "block_size": 16}
    for name, tp, kv in (("gpt-oss-20b", 1, "auto"), ("gpt-oss-20b", 4, "fp8"), ("gpt-oss-20b-bf16", 1, "auto"),
                         ("gpt-oss-20b-bf16", 4, "fp8"), ("qwen3-next-80b-a3b-instruct", 1, "auto"),
                         ("llama-3.1-8b-instruct", 1, "auto"))
]
HMA_CASES = [{"config": _config("gpt-oss-20b"), "kv_transfer_config": {"kv_connector": "ExampleConnector",
                                                                       "kv_role": "kv_both"},
              "allow_chunked_local": True, "block_size": 16, "disable_hybrid_kv_cache_manager": None}]
# v034's CPU_ATTN geometry and its own validate_configuration: fp8 only with AVX-512 or AMX (0.34)
CPU_ATTN_SWEEP = [{"geometry_sweep": {"backends": ["CPU_ATTN"], "capabilities": [[9, 0]], "per_combo": 1,
                                      "configs": [{"num_layers": 1, "num_blocks": 2, "num_kv_heads": 2,
                                                   "head_size": 64, "block_size": 32, "dtype": "bfloat16"}]}}]


def _same(oracle: str, version: str, cases: list[dict], host: str) -> None:
    here = run_oracle(version, oracle, cases, timeout=1800)
    there = run_oracle(version, oracle, cases, timeout=1800, host=host)
    for case, a, b in zip(cases, here, there, strict=True):
        label = {k: v for k, v in case.items() if k != "config"} | {"model": case.get("config", {}).get("model_type")}
        assert a == b, f"{oracle} on vLLM {version} answers otherwise on the {host} machine for {label}:\n" \
                       f"here:  {json.dumps(a)[:1500]}\nthere: {json.dumps(b)[:1500]}"


@pytest.mark.parametrize("host", sorted(HOSTS))
@pytest.mark.parametrize("version", RELEASES)
def test_model_configs_answer_for_one_machine(version: str, host: str, vllm_sites: Any) -> None:
    """gpt-oss is built (or refused) alike on every machine: the MoE kernel vLLM picks follows the pinned ISA."""
    _same("model_config", version, MODEL_CASES, host)
    built = run_oracle(version, "model_config", MODEL_CASES[:1], timeout=1800, host=host)[0]
    assert built["path"] == "instantiated", built.get("error")


@pytest.mark.parametrize("version", RELEASES)
def test_hma_groups_answer_for_one_machine(version: str, vllm_sites: Any) -> None:
    """The hybrid-manager oracle (model_config's path with a connector) on the issue's machine."""
    _same("hma_groups", version, HMA_CASES, "amd-epyc")


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_cpu_attn_validation_answers_for_one_machine(host: str, vllm_sites: Any) -> None:
    """0.34's CPU_ATTN takes an fp8 cache only with AVX-512 or AMX: an AVX2 machine would refuse it."""
    _same("v034", "0.34.0", CPU_ATTN_SWEEP, host)


def test_no_variable_of_the_parent_reaches_an_oracle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Variables vLLM, transformers or torch read (a GPU's, the loader's, threads, ranks, caches, vLLM's own)
    stay with the parent; the oracle gets the ones the harness names and the KVPOLICY_* it keys answers on."""
    hostile = {"CUDA_VISIBLE_DEVICES": "0", "LD_PRELOAD": "libiomp5.so", "OMP_NUM_THREADS": "1", "RANK": "3",
               "LOCAL_RANK": "3", "WORLD_SIZE": "8", "HF_HOME": str(tmp_path), "TRANSFORMERS_CACHE": str(tmp_path),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCH_LOGS": "+dynamo", "VLLM_KV_CACHE_LAYOUT": "HND",
               "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(tmp_path / "elsewhere"),
               "PYTHONSTARTUP": str(tmp_path / "s.py"), "LANG": "tr_TR.ISO-8859-9", "ZENDNN_MATMUL_ALGO": "FP32:1"}
    for name, value in hostile.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVPOLICY_UNPATCHED_INTERPRETER", "1")
    env = oracle_env(tmp_path)
    assert not [name for name in hostile if name in env and env[name] == hostile[name]]
    assert env["KVPOLICY_UNPATCHED_INTERPRETER"] == "1" and env["PYTHONPATH"] == str(tmp_path)


# Oracles that import vLLM yet run this machine's own compiled kernels: they cannot answer for another
# machine and read its ISA on purpose (cpu_kernel_bytes: AVX-512 kernels only where the CPU has them; its
# test compares with a committed fixture elsewhere). Every other oracle pins the host.
READS_THIS_MACHINE = {"cpu_kernel_bytes.py"}
# Modules of classes other oracles import after their own pin, never run as an oracle.
NOT_RUN = {"thirdparty_connectors.py"}


def test_every_oracle_that_imports_vllm_pins_the_host() -> None:
    """An oracle added later inherits the rule: importing vLLM (itself or through another oracle) means
    calling `_host.pin_host` before vLLM reads the machine."""
    sources = {p.name: p.read_text(encoding="utf-8") for p in ORACLES.glob("*.py")}
    pins = {name for name, text in sources.items() if re.search(r"^pin_host\(", text, re.MULTILINE)}
    imports = {name: set(re.findall(r"^(?:import|from)\s+(\w+)", text, re.MULTILINE)) for name, text in sources.items()}

    def pinned(name: str, seen: frozenset[str] = frozenset()) -> bool:
        return name in pins or any(f"{m}.py" in sources and f"{m}.py" not in seen and pinned(f"{m}.py", seen | {name})
                                   for m in imports[name])

    uses_vllm = {name for name, text in sources.items() if re.search(r"\bvllm\b", text) and not name.startswith("_")}
    unpinned = sorted(n for n in uses_vllm - READS_THIS_MACHINE - NOT_RUN if not pinned(n))
    assert unpinned == [], f"oracles reading vLLM without pinning the host: {unpinned}"
    assert not any(pinned(n) for n in READS_THIS_MACHINE)
