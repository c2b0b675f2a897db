"""`kvpolicy dry-run` start-up, as a ratio measured in one run.

- ``dry_run_vs_import_torch``: the wall time of ``python -m kvpolicy.engine.cli.main
  dry-run`` (the built-in example, full explanation, counterfactuals included)
  against ``python -c "import torch"``, both as fresh subprocesses. Below 1 means
  deciding and explaining a layout costs less than merely importing torch,
  which no verb of the command line does.
- ``dry_run_plan_vs_import_torch``: the same with ``--num-blocks`` (the plan).
- ``test_vs_import_torch``: ``kvpolicy test`` (every shipped policy test case).

Both sides run from bytecode: pip compiles torch's modules when it installs
them, and Python caches the project's on first import, unless
``PYTHONDONTWRITEBYTECODE`` is set (as on the machine of bench/README.md),
which would leave only this project compiling its ~35 modules on every start
(about 70 ms). So the run compiles ``policy/`` and ``engine/`` first, as an
install or a first run would.

    python bench/bench_cli.py [--quick]
"""

from __future__ import annotations

import compileall
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _median_wall(argv: list[str], runs: int) -> float:
    """Median wall time in seconds of ``runs`` fresh subprocesses (after one warm-up for the file cache)."""
    subprocess.run(argv, cwd=ROOT, capture_output=True, check=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(quick: bool = False) -> dict[str, float]:
    """Median timings (seconds) and their ratios to ``import torch``."""
    cli = [sys.executable, "-m", "kvpolicy.engine.cli.main"]
    for package in ("policy", "engine"):  # what pip does at install time (see the module docstring)
        compileall.compile_dir(ROOT / package, quiet=1)
    n_cli, n_torch = (5, 3) if quick else (10, 5)
    t_torch = _median_wall([sys.executable, "-c", "import torch"], n_torch)
    t_dry = _median_wall([*cli, "dry-run"], n_cli)
    t_plan = _median_wall([*cli, "dry-run", "--num-blocks", "176452"], n_cli)
    t_test = _median_wall([*cli, "test"], n_cli)
    return {
        "dry_run_s": t_dry,
        "import_torch_s": t_torch,
        "dry_run_vs_import_torch": t_dry / t_torch,
        "dry_run_plan_vs_import_torch": t_plan / t_torch,
        "test_vs_import_torch": t_test / t_torch,
    }


if __name__ == "__main__":
    results = run(quick="--quick" in sys.argv)
    for key, value in results.items():
        print(f"{key:32} {value:10.3f}")
