"""Run an oracle under an installed vLLM release, in a subprocess, and return its answers.

Nothing here imports vLLM: the oracle scripts (``oracles/<name>.py``) do, in a child
interpreter whose PYTHONPATH is the release's site (see install_vllm.py). Cases go in
as JSON on stdin; one JSON result per case comes back on stdout, in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import install_vllm  # noqa: E402

ORACLES = HERE / "oracles"

# Parent variables that must not reach vLLM: every VLLM_* (a case sets the ones it
# tests), and Python variables that would put another site or startup code in front.
_STRIPPED_PREFIXES = ("VLLM_",)
_STRIPPED = {"PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONSAFEPATH"}


class OracleError(RuntimeError):
    """The oracle subprocess failed or answered something that is not one result per case."""


def oracle_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED_PREFIXES) and k not in _STRIPPED}
    env.update(
        PYTHONPATH=str(site),
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


def run_oracle(version: str, oracle: str, cases: list[dict], timeout: float = 900) -> list[dict]:
    """Answers of ``oracles/<oracle>.py`` under vLLM ``version``, one per case, in order."""
    site = install_vllm.site_for(version)
    script = ORACLES / f"{oracle}.py"
    if not script.is_file():
        raise OracleError(f"no oracle {script}")
    proc = subprocess.run(
        [sys.executable, str(script)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=oracle_env(site),
        timeout=timeout,
        cwd=str(HERE),
    )
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
