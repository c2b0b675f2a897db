"""The geometry check's worst cases as a ratio to a plain default dry-run (#16 class 5).

Each case is one `kvpolicy dry-run` process, timed round by round against the
plain default dry-run in the same run: Llama-70B (80 layers, 8 KV heads, head 128)
at `--block-size 4096` with `fp8_per_token_head`, and a spec at the sanity bounds
(4096 layers, block 4096, 1024 heads, head 16384). Before the closed-form check
(engine/lattice.py) the first took ~19 s and the second never finished.

    python3 bench/bench_geometry.py [--rounds N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "llama70b_block4096_fp8pth": ("num_layers: 80\nblock_size: 4096\nnum_kv_heads: 8\nhead_size: 128\n",
                                  ["--kv-cache-dtype", "fp8_per_token_head"]),
    "sanity_bounds_fp8pth": ("num_layers: 4096\nblock_size: 4096\nnum_kv_heads: 1024\nhead_size: 16384\n",
                             ["--kv-cache-dtype", "fp8_per_token_head"]),
}


def _dry_run(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvpolicy", "dry-run", "--explain", "notes", *args],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as tmp:
        specs = {}
        for name, (text, extra) in CASES.items():
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(text)
            specs[name] = ["--spec", str(path), *extra]
        times: dict[str, list[float]] = {"plain": [], **{n: [] for n in CASES}}
        for _ in range(rounds):
            times["plain"].append(_dry_run([]))
            for name, args in specs.items():
                times[name].append(_dry_run(args))
    plain = min(times["plain"])
    print(f"plain default dry-run: {plain:.3f} s (min of {rounds})")
    for name in CASES:
        best = min(times[name])
        print(f"{name}: {best:.3f} s, {best / plain:.2f}x plain")


if __name__ == "__main__":
    main()
