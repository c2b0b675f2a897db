"""Run an oracle under an installed vLLM release, in a subprocess, and return its answers.

Nothing here imports vLLM: the oracle scripts (``oracles/<name>.py``) do, in a child
interpreter whose PYTHONPATH is the release's site (see install_vllm.py). Cases go in
as JSON on stdin; one JSON result per case comes back on stdout, in order.
"""

from __future__ import annotations

import json
import os
import re
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ahead  # noqa: E402
import install_vllm  # noqa: E402
from answer_cache import answered  # noqa: E402

ORACLES = HERE / "oracles"
SIMULATED_HOST = HERE / "simulated_host.py"

# The child's environment is named here, never inherited: vLLM, transformers, torch and the libraries
# under them read hundreds of variables (CUDA_VISIBLE_DEVICES, LD_PRELOAD, OMP_NUM_THREADS, RANK, HF_*,
# TORCHINDUCTOR_*, ...), so an answer would follow the shell it was asked from. Passed: what finds
# programs, the home and temporary directories, the loader's path (some machines need it to load
# torch), bytecode writing, and KVPOLICY_* (the variables the oracles read are in the answers' key).
_PASSED = ("PATH", "HOME", "TMPDIR", "TMP", "TEMP", "LD_LIBRARY_PATH", "PYTHONDONTWRITEBYTECODE")
_PASSED_PREFIXES = ("KVPOLICY_",)


class OracleError(RuntimeError):
    """The oracle subprocess failed or answered something that is not one result per case."""


def oracle_env(site: Path) -> dict[str, str]:
    """The whole environment of an oracle under the release installed at ``site``."""
    env = {k: v for k, v in os.environ.items() if k in _PASSED or k.startswith(_PASSED_PREFIXES)}
    env.update(
        PYTHONPATH=str(site),
        PYTHONUTF8="1",
        VLLM_TARGET_DEVICE="cpu",
        # vLLM's logs go to stderr; stdout carries only the JSON answer.
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
    )
    return env


# Answers are kept per machine beside the installed release and reused while everything they depend
# on is the same: the release's install (its COMPLETE marker: the wheel's version, the pins, Python),
# every file of the oracles and of this harness, torch, the variables the oracles read, and the cases.
# KVPOLICY_ORACLE_CACHE=0 asks the release every time. Plugin oracles (plugin_site.py) are never kept:
# their answers depend on kvpolicy's own code.
_ORACLE_ENV = ("KVPOLICY_UNPATCHED_INTERPRETER",)
# The distributions an oracle imports from the running environment rather than the release's site (the
# sites leave them to it; oracles/_host.py hides everything else there but torch's own requirements).
_ENVIRONMENT_DISTRIBUTIONS = ("pydantic", "pydantic-core", "PyYAML", "packaging")


_IMPORTED = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.MULTILINE)


def oracle_sources(script: Path) -> list[Path]:
    """The files an oracle's answers depend on: its script, the oracle and harness modules it imports
    (transitively), and this harness. Another oracle's edit keeps this one's answers (all answers
    were once keyed on every oracle file, so adding one re-asked every release for ~36 minutes)."""
    found = {script, HERE / "vllm_release.py", HERE / "install_vllm.py"}
    todo = [script]
    while todo:
        for name in _IMPORTED.findall(todo.pop().read_text(encoding="utf-8")):
            for module in (ORACLES / f"{name}.py", HERE / f"{name}.py"):
                if module.is_file() and module not in found:
                    found.add(module)
                    todo.append(module)
    return sorted(found)


def answers_file(version: str, oracle: str, cases: list[dict], host: str | None = None,
                  front: Path | None = None) -> Path | None:
    """Where the answers of ``oracle`` to ``cases`` under ``version`` are kept, named by everything they
    depend on; ``front``: a site on the path before vLLM's (kvpolicy's wheel, for the plugin's oracles),
    whose files are then part of the name. None: ``KVPOLICY_ORACLE_CACHE=0``."""
    if os.environ.get("KVPOLICY_ORACLE_CACHE", "1") == "0":
        return None
    import hashlib

    import torch

    digest = hashlib.sha256()
    marker = install_vllm.cache_root() / version / "COMPLETE"
    digest.update(marker.read_bytes())
    for path in oracle_sources(ORACLES / f"{oracle}.py"):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"torch {torch.__version__}".encode())
    for dist in _ENVIRONMENT_DISTRIBUTIONS:  # what the child takes from this environment besides torch
        try:
            digest.update(f"{dist} {metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist} -".encode())
    digest.update(json.dumps({k: os.environ.get(k) for k in _ORACLE_ENV}).encode())
    if front is not None:  # the plugin's oracles: kvpolicy's installed files, as the oracle imports them
        for path in sorted(p for p in front.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(str(path.relative_to(front)).encode() + b"\0" + path.read_bytes())
        oracle = f"{oracle}+kvpolicy"
    if host is not None:  # a simulated machine's answers, kept apart (their own name) from the real ones
        digest.update(SIMULATED_HOST.read_bytes())
        oracle = f"{oracle}@{host}"
    asked = hashlib.sha256(json.dumps(cases, sort_keys=True).encode()).hexdigest()[:24]
    return install_vllm.cache_root() / version / "answers" / f"{oracle}-{digest.hexdigest()[:24]}-{asked}.json"


def run_oracle(version: str, oracle: str, cases: list[dict], timeout: float = 900,
               host: str | None = None) -> list[dict]:
    """Answers of ``oracles/<oracle>.py`` under vLLM ``version``, one per case, in order (kept per
    machine and reused while the release, the oracle code, torch and the cases are the same).
    ``host``: on a simulated machine (a name of `simulated_host.HOSTS`), to test the oracles' host pins."""
    site = install_vllm.site_for(version)
    script = ORACLES / f"{oracle}.py"
    if not script.is_file():
        raise OracleError(f"no oracle {script}")
    kept = answers_file(version, oracle, cases, host)
    answers, _ = answered(kept, cases, lambda: _ask(version, site, script, oracle, cases, timeout, host))
    return answers


def _ask(version: str, site: Path, script: Path, oracle: str, cases: list[dict], timeout: float,
         host: str | None = None) -> list[dict]:
    command = [sys.executable, str(script)]
    if host is not None:
        command = [sys.executable, str(SIMULATED_HOST), host, str(script)]
    proc = ahead.run(command, input=json.dumps(cases), env=oracle_env(site), timeout=timeout, cwd=str(HERE))
    tail = proc.stderr[-6000:]
    if proc.returncode != 0:
        raise OracleError(f"oracle {oracle} under vLLM {version} exited {proc.returncode}:\n{tail}")
    try:
        results = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise OracleError(
            f"oracle {oracle} under vLLM {version} printed no JSON ({exc}); stdout "
            f"{proc.stdout[-2000:]!r}\nstderr:\n{tail}"
        ) from exc
    if not isinstance(results, list) or len(results) != len(cases):
        raise OracleError(
            f"oracle {oracle} under vLLM {version} answered {len(results)} results for {len(cases)} cases"
        )
    return results
