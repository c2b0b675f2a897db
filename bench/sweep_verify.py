"""Random plans through the geometry verifier: the slowest ones, to find the search's worst cases.

Every profile's backends and layouts, 1 to 4096 layers, block 1 to 4096, 1 to 1024 heads,
1 to 5000 blocks, both scale-view strategies (forcing naive views on stride-aware
backends too). Prints the worst time and every plan over ``--slow`` seconds; a plan past
``--limit`` seconds is stopped and listed at the limit. Times are wall clock on this
machine: compare runs of one machine, not numbers across machines.

    python3 bench/sweep_verify.py [--cases 200] [--seed 7] [--limit 15] [--slow 2]
"""

from __future__ import annotations

import argparse
import random
import signal
import time


class _TimedOut(Exception):
    pass


def _alarm(*_args: object) -> None:
    raise _TimedOut


def main() -> None:
    from kvpolicy.engine.plan import plan_layout
    from kvpolicy.engine.verify import verify_plan
    from kvpolicy.policy import KVCacheSpec, PolicyError
    from kvpolicy.policy.backends import ScaleViews
    from kvpolicy.policy.releases import iter_profiles

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--limit", type=int, default=15)
    parser.add_argument("--slow", type=float, default=2.0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    signal.signal(signal.SIGALRM, _alarm)
    backends = [(p.name, n, p.backend(n)) for p in iter_profiles() for n in p.backend_names()]
    dtypes = ["fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "fp8", "auto"]
    slow, ran, worst = [], 0, 0.0
    for _ in range(args.cases):
        profile, name, backend = rng.choice(backends)
        layout = rng.choice(list(backend.orders))
        layers = rng.choice([1, 2, 4, rng.randint(1, 4096)])
        block, heads = rng.randint(1, 4096), 1 if backend.mla else rng.randint(1, 1024)
        head_size = 576 if backend.mla else rng.choice([16, 64, 128, rng.randint(1, 16384)])
        try:
            spec = KVCacheSpec(kind="mla" if backend.mla else "full", num_layers=layers, block_size=block,
                               num_kv_heads=heads, head_size=head_size, kv_cache_dtype=rng.choice(dtypes))
            plan = plan_layout(layout, spec, backend, rng.randint(1, 5000))
        except (PolicyError, ValueError):  # sizes this backend cannot plan (pydantic's errors are ValueErrors)
            continue
        views = rng.choice(list(ScaleViews))
        ran += 1
        signal.alarm(args.limit)
        start = time.perf_counter()
        try:
            verify_plan(plan, views)
            took = time.perf_counter() - start
        except _TimedOut:
            took = float(args.limit)
        finally:
            signal.alarm(0)
        worst = max(worst, took)
        if took > args.slow:
            slow.append(f"{took:6.2f} s  {profile} {name} {layout} layers={layers} block={block} heads={heads} "
                        f"head_size={head_size} {spec.kv_cache_dtype} blocks={plan.num_blocks} {views.value}")
    print(f"{ran} plans verified, worst {worst:.2f} s, {len(slow)} over {args.slow} s")
    print("\n".join(slow))


if __name__ == "__main__":
    main()
