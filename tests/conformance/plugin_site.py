"""kvpolicy installed the way vLLM finds plugins, for the plugin's conformance oracles.

vLLM discovers general plugins with ``importlib.metadata.entry_points(group="vllm.general_plugins")``,
which reads the ``entry_points.txt`` of installed distributions. To load kvpolicy exactly as
an operator's installation does, `kvpolicy_site` builds a wheel of this checkout (``pip wheel
--no-deps --no-build-isolation``, as tests/test_packaging.py does) and unpacks it into a
temporary site: the packages, the shipped rules (``kvpolicy.rules``) and
``kvpolicy-<version>.dist-info`` with the entry point pyproject.toml declares. The oracle
runs with ``PYTHONPATH=<that site>:<vLLM's site>``, so this distribution is the first
``kvpolicy`` on the path (``entry_points`` keeps the first of a name) and its modules are the
ones imported; the oracles check both.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import ahead
from answer_cache import answered
from vllm_release import HERE, ORACLES, OracleError, answers_file, install_vllm, oracle_env

ROOT = HERE.parents[1]


_BUILDING = threading.Lock()


def kvpolicy_site() -> Path:
    """A site holding this checkout's wheel, unpacked (built once per test process, by whichever of the
    threads running oracles ahead asks first: two builds at once would share setuptools' build/)."""
    with _BUILDING:
        return _built()


@functools.cache
def _built() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="kvpolicy-plugin-site-"))
    atexit.register(shutil.rmtree, tmp, True)
    # built from a copy: setuptools leaves build/ in the tree it builds, and a later `pip install .` of the
    # checkout would package that build/lib's stale files (a rule directory deleted since, say)
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".venv", "venv*",
        "mutants"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp / "wheel"), str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise OracleError(f"building kvpolicy's wheel failed:\n{proc.stderr[-3000:]}")
    wheel = next((tmp / "wheel").glob("kvpolicy-*.whl"))
    zipfile.ZipFile(wheel).extractall(tmp / "site")
    return tmp / "site"


def run_plugin_oracle(version: str, oracle: str, cases: list[dict],
                      timeout: float = 900) -> tuple[list[dict], bool]:
    """`vllm_release.run_oracle`, with kvpolicy's installed site in front of vLLM's (installed first if
    need be) and no ``KVPOLICY_*`` variable of this process (each case sets the ones it tests). The
    answers are kept under a name that covers every file of that site, so they are asked again whenever
    the checkout changes; and whether they were asked now."""
    site = install_vllm.ensure(version)
    front = kvpolicy_site()
    env = {k: v for k, v in oracle_env(site).items() if not k.startswith("KVPOLICY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(front), str(site)])

    def ask() -> list[dict]:
        proc = ahead.run([sys.executable, str(ORACLES / f"{oracle}.py")], input=json.dumps(cases), env=env,
                         timeout=timeout, cwd=str(HERE))
        tail = proc.stderr[-6000:]
        if proc.returncode != 0:
            raise OracleError(f"oracle {oracle} under vLLM {version} exited {proc.returncode}:\n{tail}")
        try:
            results = json.loads(proc.stdout)
        except json.JSONDecodeError as exc:
            raise OracleError(f"oracle {oracle} under vLLM {version} printed no JSON ({exc}):\n{tail}") from exc
        if not isinstance(results, list) or len(results) != len(cases):
            raise OracleError(f"oracle {oracle} answered {len(results)} results for {len(cases)} cases")
        return results

    return answered(answers_file(version, oracle, cases, front=front), cases, ask)


def _timed(version: str, oracle: str, cases: Callable[[str], list[dict]]) -> tuple[list[dict], str]:
    start = time.perf_counter()
    answers, asked = run_plugin_oracle(version, oracle, cases(version))
    return answers, (f"{time.perf_counter() - start:.0f} s" if asked else "kept answers")


def start_ahead(versions: Iterable[str], oracle: str, cases: Callable[[str], list[dict]]) -> None:
    """Queue ``oracle`` under each of ``versions`` for ``cases(version)`` (ahead.py); `take` collects it."""
    for version in versions:
        cases(version)  # made here, in the main thread: the job only runs the subprocess
        ahead.ahead((oracle, version), functools.partial(_timed, version, oracle, cases))


def take(version: str, oracle: str, cases: Callable[[str], list[dict]]) -> tuple[list[dict], str]:
    """The answers of ``oracle`` under ``version`` to ``cases(version)`` and how long the oracle took
    ("12 s"; "kept answers" when an earlier run of the same checkout asked it):
    queued ahead (`start_ahead`), or run now."""
    return ahead.take((oracle, version), functools.partial(_timed, version, oracle, cases))
