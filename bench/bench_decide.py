"""Decision latency, as ratios measured in one run.

- ``decide_vs_handwritten``: `LayoutEngine.decide(ctx, explain=False)` with the
  shipped rules against a hand-written Python ``if`` chain of vLLM's gate that
  reads the same pydantic context and returns the same layout.
- ``decide_explain_vs_handwritten``: the same with the full trace recorded.
- ``decide_cold_vs_handwritten``: a fresh (equal, not identical) context each
  call, so nothing derived from the context is cached: the first decision.
- ``decide_1000_vs_shipped``: 1,000 generated rules over 20 connectors against
  the shipped rules, same inputs.
- ``load_1000_vs_safe_load``: loading and validating those 1,000 rules against
  ``yaml.safe_load`` of the same files.

    python bench/bench_decide.py [--quick]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LayoutEngine  # noqa: E402
from policy import ConnectorConfig, Context, Layout, load_rules_from_texts  # noqa: E402
from policy.backends import BACKENDS  # noqa: E402

NIXL_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"})
PER_LAYER_NHD = Layout.parse("per_layer/NHD")
PER_LAYER_HND = Layout.parse("per_layer/HND")
CROSS_NHD = Layout.parse("cross_layer/NHD")
CROSS_HND = Layout.parse("cross_layer/HND")


def _prefers(c: ConnectorConfig, ctx: Context) -> bool:
    name = c.name
    if name == "OffloadingConnector":
        return True
    if name == "NixlConnector":
        return (str(c.extra.get("enable_cross_layers_blocks", "")).lower() == "true" and not ctx.groups.has_mamba
                and ctx.backend.name in NIXL_BACKENDS)
    if name == "MooncakeStoreConnector":
        return str(c.extra.get("enable_cross_layers_blocks", "")).lower() == "true"
    if name == "MultiConnector":
        return bool(c.connectors) and all(_prefers(m, ctx) for m in c.connectors)
    return False


def _needs_hnd(c: ConnectorConfig | None) -> bool:
    return c is not None and (c.name == "NixlConnector" or any(_needs_hnd(m) for m in c.connectors))


def handwritten(ctx: Context) -> Layout:
    """vLLM's gate as the hard-coded `if` chain it replaces."""
    conn = ctx.connector
    hnd = _needs_hnd(conn) and ctx.backend.supports_hnd
    cross = (
        conn is not None
        and _prefers(conn, ctx)
        and ctx.groups.count == 1
        and ctx.groups.attention_groups == 1
        and ctx.kv.kind.is_attention
        and not ctx.groups.has_mamba
        and not (ctx.kv.per_token_head and ctx.backend.scale_views.value == "assume_per_layer_contiguous")
        and ctx.backend.indexes_kv_by_block_stride
    )
    if cross:
        return CROSS_HND if hnd else CROSS_NHD
    return PER_LAYER_HND if hnd else PER_LAYER_NHD


def contexts(engine: LayoutEngine) -> list[Context]:
    spec = {"num_layers": 32, "block_size": 16, "num_kv_heads": 8, "head_size": 128}
    cases: list[dict[str, Any]] = [
        {},
        {"connector": "OffloadingConnector"},
        {"connector": "OffloadingConnector", "kv_cache_dtype": "fp8_per_token_head"},
        {"connector": "NixlConnector"},
        {"connector": "NixlConnector", "connector_config": {"enable_cross_layers_blocks": "true"}},
        {"connector": "MooncakeStoreConnector", "connector_config": {"enable_cross_layers_blocks": True}},
        {"connector": "LMCacheConnectorV1", "kv_cache_dtype": "fp8"},
        {"connector": "MultiConnector", "connector_config": {"connectors": [
            {"kv_connector": "OffloadingConnector"},
            {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"enable_cross_layers_blocks": "true"}}]}},
    ]
    out = []
    for backend in ("TRITON_ATTN", "FLASHINFER"):
        for case in cases:
            out.append(engine.context(spec=spec, backend=backend, **case))
    return out


def _time_per_call(fn: Callable[[], object], number: int, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def _over(ctxs: list[Context], fn: Callable[[Context], object]) -> Callable[[], None]:
    def run() -> None:
        for c in ctxs:
            fn(c)

    return run


def generated_rules(n_rules: int = 1000, n_connectors: int = 20) -> dict[str, str]:
    """A large, realistic rule set: the shipped rules plus generated connector files."""
    from engine.layout_engine import shipped_rules_dir

    root = shipped_rules_dir()
    texts = {str(p.relative_to(root)): p.read_text() for p in [*root.glob("*.yaml"), *root.glob("connectors/*.yaml")]}
    names = sorted({"DecodeBenchConnector", "ExampleConnector", "LMCacheMPConnector", "MooncakeConnector",
                    "P2pNcclConnector", "SharedStorageConnector"})
    per = n_rules // n_connectors
    fields = [("kv.block_size", "gt", 64), ("kv.num_layers", "ge", 200), ("kv.kv_cache_dtype", "eq", "fp8_e5m2"),
              ("backend.name", "in", ["FLASHINFER"]), ("groups.count", "gt", 3)]
    for c in range(n_connectors):
        name = names[c % len(names)]
        lines = ["version: 1", f"connector: {name}", "rules:"]
        for i in range(per):
            f, op, v = fields[i % len(fields)]
            effect = ("forbid: {placement: cross_layer}" if i % 3 else "prefer: {head_order: HND}\n    weight: 2")
            lines += [f"  - id: gen-{c}-{i}", f"    description: generated rule {i} for {name}",
                      f"    when: {{field: {f}, {op}: {json.dumps(v)}}}",
                      f"    {effect}"]
        texts[f"connectors/gen_{c:02d}.yaml"] = "\n".join(lines) + "\n"
    # a composite per file would collide on connector names: fold duplicates into one file per connector
    merged: dict[str, list[str]] = {}
    for key in sorted(k for k in texts if k.startswith("connectors/gen_")):
        body = texts.pop(key)
        conn = body.split("\n")[1]
        merged.setdefault(conn, []).append(body.split("rules:\n", 1)[1])
    for i, (conn, bodies) in enumerate(sorted(merged.items())):
        name = conn.split(": ")[1]
        if f"connectors/{name}.yaml" in texts:
            continue
        texts[f"connectors/gen_{i:02d}.yaml"] = f"version: 1\n{conn}\nrules:\n" + "".join(bodies)
    return texts


def run(quick: bool = False) -> dict[str, float]:
    engine = LayoutEngine.default()
    ctxs = contexts(engine)
    for c in ctxs:  # the engine must agree with the reference it is measured against
        assert engine.decide(c, explain=False).layout == handwritten(c), c
    number, repeat = (200, 5) if quick else (1000, 9)

    t_hand = _time_per_call(_over(ctxs, handwritten), number, repeat)
    t_fast = _time_per_call(_over(ctxs, lambda c: engine.decide(c, explain=False)), number, repeat)
    t_explain = _time_per_call(_over(ctxs, lambda c: engine.decide(c, explain=True)), number // 10, repeat)
    fresh = [[c.model_copy() for c in ctxs] for _ in range(number // 10 * repeat + 1)]
    it = iter(fresh)
    t_cold = _time_per_call(lambda: [engine.decide(c, explain=False) for c in next(it)], number // 10, repeat)

    texts = generated_rules()
    big = LayoutEngine(load_rules_from_texts(texts))
    big_ctxs = [c.model_copy(update={"connector": ConnectorConfig(name="P2pNcclConnector")}) for c in ctxs]
    t_big = _time_per_call(_over(big_ctxs, lambda c: big.decide(c, explain=False)), number, repeat)
    t_small = _time_per_call(_over(big_ctxs, lambda c: engine.decide(c, explain=False)), number, repeat)
    t_load = _time_per_call(lambda: load_rules_from_texts(texts), 1, 3 if quick else 5)
    t_safe = _time_per_call(lambda: [yaml.safe_load(t) for t in texts.values()], 1, 3 if quick else 5)

    n = len(ctxs)
    return {
        "decide_us": t_fast / n * 1e6,
        "handwritten_us": t_hand / n * 1e6,
        "decide_vs_handwritten": t_fast / t_hand,
        "decide_explain_vs_handwritten": t_explain / t_hand,
        "decide_cold_vs_handwritten": t_cold / t_hand,
        "decide_1000_vs_shipped": t_big / t_small,
        "load_1000_vs_safe_load": t_load / t_safe,
        "rules_generated": float(len(big.ruleset.rules)),
        "backends": float(len(BACKENDS)),
    }


if __name__ == "__main__":
    results = run(quick="--quick" in sys.argv)
    for key, value in results.items():
        print(f"{key:32} {value:10.2f}")
