"""The geometry check's worst cases as a ratio to a plain default dry-run (#16 class 5).

Each case is one `kvpolicy dry-run` process, timed round by round against the
plain default dry-run in the same run: Llama-70B (80 layers, 8 KV heads, head 128)
at `--block-size 4096` with `fp8_per_token_head`, and a spec at the sanity bounds
(4096 layers, block 4096, 1024 heads, head 16384). Before the closed-form check
(engine/lattice.py) the first took ~19 s and the second never finished.

The `map_*` cases time `--map` (and `--svg`) of 96 layers x 128 heads and of
Llama-70B at block 4096 drawn cross layer; before the map was built from strides
(engine/memory_map.py) they took over 10 minutes and 6 minutes.

    python3 bench/bench_geometry.py [--rounds N] [--cases CASE ...]
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
    # the verifier's pair counting: a per-layer plan at the bounds with naive scale views (9.5 s before),
    # and a forced cross-layer map of 4096 layers whose scale views collide pairwise (16.7 M pairs; 43 s)
    "sanity_bounds_issue48412_fp8pth": ("num_layers: 4096\nblock_size: 4096\nnum_kv_heads: 1024\nhead_size: 16384\n",
                                        ["--vllm-version", "issue-48412", "--kv-cache-dtype", "fp8_per_token_head"]),
    "map_4096_layers_issue48412_cross_layer": ("num_layers: 4096\nblock_size: 16\nnum_kv_heads: 8\nhead_size: 128\n",
                                               ["--vllm-version", "issue-48412", "--kv-cache-dtype",
                                                "fp8_per_token_head", "--map-layout", "cross_layer/NHD"]),
    # --map (#16 class 5): one band per layer and role, not one run per cell
    "map_96x128": ("num_layers: 96\nblock_size: 16\nnum_kv_heads: 128\nhead_size: 128\n", ["--map"]),
    "map_96x128_fp8pth_svg": ("num_layers: 96\nblock_size: 16\nnum_kv_heads: 128\nhead_size: 128\n",
                              ["--kv-cache-dtype", "fp8_per_token_head", "--map", "--svg", "{tmp}/map.svg"]),
    "map_96x128_issue48412_overlap": ("num_layers: 96\nblock_size: 16\nnum_kv_heads: 128\nhead_size: 128\n",
                                      ["--vllm-version", "issue-48412", "--kv-cache-dtype", "int8_per_token_head",
                                       "--map-layout", "cross_layer/NHD", "--svg", "{tmp}/map.svg"]),
    "map_llama70b_block4096_cross_layer": ("num_layers: 80\nblock_size: 4096\nnum_kv_heads: 8\nhead_size: 128\n",
                                           ["--map", "--map-layout", "cross_layer/NHD", "--svg", "{tmp}/map.svg"]),
}


def _dry_run(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvpolicy", "dry-run", "--explain", "notes", *args],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="CASE",
                        help="only these cases (default: all)")
    opts = parser.parse_args()
    rounds, cases = opts.rounds, {n: CASES[n] for n in opts.cases}
    with tempfile.TemporaryDirectory() as tmp:
        specs = {}
        for name, (text, extra) in cases.items():
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(text)
            specs[name] = ["--spec", str(path), *(a.format(tmp=tmp) for a in extra)]
        times: dict[str, list[float]] = {"plain": [], **{n: [] for n in cases}}
        for _ in range(rounds):
            times["plain"].append(_dry_run([]))
            for name, args in specs.items():
                times[name].append(_dry_run(args))
    plain = min(times["plain"])
    print(f"plain default dry-run: {plain:.3f} s (min of {rounds})")
    for name in cases:
        best = min(times[name])
        print(f"{name}: {best:.3f} s, {best / plain:.2f}x plain")


if __name__ == "__main__":
    main()
