"""Run every kvpolicy benchmark in one process and print one table of ratios.

    python bench/run.py            # full run (a few minutes on 2 cores)
    python bench/run.py --quick    # within a minute
    python bench/run.py --json -   # also write the flat JSON object of ratios (- for stdout)
    python bench/run.py --device cuda   # the runtime benchmarks on a GPU (bench/README.md, "On a GPU")

Every figure is a ratio measured in the same run against its reference
(hand-written check, yaml.safe_load, `import torch`, torch `copy_` of the
same bytes, the naive eager implementation), so it does not depend on how
fast the machine is. Goals are those of the performance issue.

``--device cuda`` runs only the runtime family (bench_runtime.py) with its
cache, inputs and references on the GPU: the decision and command-line
benchmarks never touch a device, so their figures are the CPU's either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# key -> (what, goal as text, predicate on the ratio)
GOALS: dict[str, tuple[str, str, object]] = {
    "decide_vs_handwritten": ("decide(), explain=False, fresh context, vs hand-written if chain", "<= 10x",
                              lambda r: r <= 10),
    "decide_explain_vs_handwritten": ("decide(), full trace, fresh context, vs hand-written", "<= 50x",
                                      lambda r: r <= 50),
    "decide_1000_vs_shipped": ("decide() with 1,000 rules vs shipped rules", "<= 20x", lambda r: r <= 20),
    "load_1000_vs_safe_load": ("load+validate 1,000 rules vs parsing them with the same (libyaml) loader", "<= 5x",
                               lambda r: r <= 5),
    "dry_run_vs_import_torch": ("`kvpolicy dry-run` vs `python -c 'import torch'`", "<= 0.2x", lambda r: r <= 0.2),
    "write_int8_vs_copy": ("int8 per-token-head write vs copy_ (input bytes/s)", ">= 0.3x", lambda r: r >= 0.3),
    "write_fp8_vs_copy": ("fp8 per-token-head write vs copy_", ">= 0.3x", lambda r: r >= 0.3),
    "write_int4_vs_copy": ("int4 per-token-head write vs copy_", ">= 0.3x", lambda r: r >= 0.3),
    "write_vs_naive": ("per-token-head write vs naive eager implementation", ">= 5x", lambda r: r >= 5),
    "decode_write_vs_copy": ("decode write (1-16 tokens, all layers) vs single copy_ calls", "<= 3x",
                             lambda r: r <= 3),
    "offload_cross_vs_copy": ("offload 128 blocks, cross_layer, vs copy_", ">= 0.8x", lambda r: r >= 0.8),
    "offload_per_layer_vs_copy": ("offload 128 blocks, per_layer, vs copy_", ">= 0.5x", lambda r: r >= 0.5),
    "restore_cross_vs_copy": ("restore 128 blocks, cross_layer, vs copy_", ">= 0.8x", lambda r: r >= 0.8),
    "restore_per_layer_vs_copy": ("restore 128 blocks, per_layer, vs copy_", ">= 0.5x", lambda r: r >= 0.5),
    # --device cuda only: bytes read + written per second over the device's copy_ bandwidth (bench_runtime.py)
    "write_int8_vs_membw": ("int8 write, bytes read+written/s, vs device memory bandwidth", ">= 0.5x",
                            lambda r: r >= 0.5),
    "write_fp8_vs_membw": ("fp8 write vs device memory bandwidth", ">= 0.5x", lambda r: r >= 0.5),
    "write_int4_vs_membw": ("int4 write vs device memory bandwidth", ">= 0.5x", lambda r: r >= 0.5),
}


def machine(device: str = "cpu") -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    info = {"cpu": cpu, "cores": str(os.cpu_count()), "python": platform.python_version(),
            "torch": torch.__version__, "threads": str(torch.get_num_threads())}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = (f"GPU {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
                       f"compute capability {props.major}.{props.minor}")
    return info


def run(quick: bool, device: str = "cpu") -> dict[str, float]:
    import bench_runtime

    results: dict[str, float] = {}
    if device == "cpu":  # no device in these two: on a GPU run they would only repeat the CPU's figures
        import bench_cli
        import bench_decide

        results.update(bench_decide.run(quick))
        results.update(bench_cli.run(quick))
    results.update(bench_runtime.run(quick, device))
    import bench_transcode
    import torch

    with torch.no_grad():
        results.update(bench_transcode.run(quick, device))  # context: restores across layouts (issue 24)
    return results


def table(results: dict[str, float], info: dict[str, str]) -> str:
    lines = [f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, torch {info['torch']} "
             f"({info['threads']} threads)", "",
             "| what | ratio | goal | met |", "|---|---|---|---|"]
    if "gpu" in info:
        lines[1:1] = [f"device: {info['gpu']} (runtime benchmarks only; decide and CLI are CPU-only)"]
    for key, (what, goal, ok) in GOALS.items():
        if key in results:
            value = results[key]
            lines.append(f"| {what} (`{key}`) | {value:.2f}x | {goal} | {'yes' if ok(value) else 'no'} |")
    extra = sorted(set(results) - set(GOALS))
    if extra:
        lines += ["", "context: " + ", ".join(f"{k}={results[k]:.3g}" for k in extra)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; finishes within a minute")
    parser.add_argument("--json", metavar="FILE", help="write the flat JSON object of ratios (- for stdout); "
                        "with --device cuda, the context figures too")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]: where the runtime "
                        "benchmarks put the cache, inputs and copy_ references")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device}: use cpu or cuda")
    results = run(args.quick, args.device)
    print(table(results, machine(args.device)))
    if args.json:
        keys = list(GOALS) if args.device == "cpu" else sorted(results)
        ratios = {k: round(results[k], 4) for k in keys if k in results}
        text = json.dumps(ratios, indent=2, sort_keys=True)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
