"""Decision latency, as ratios measured in one run.

Every ratio is timed interleaved: each round times the reference, then the
measured call, on the same inputs, and the figure is the median of the
per-round ratios (a noisy neighbour slows both sides of a round alike).

- ``decide_vs_handwritten``: `LayoutEngine.decide(ctx, explain=False)` with the
  shipped rules of the ``issue-48412`` profile against a hand-written Python ``if``
  chain of vLLM's gate there that reads the same pydantic context and returns the same layout, each call on a
  fresh (equal, not identical) context, so nothing derived from the context is
  cached: the first decision for a context, as a serving engine makes it once
  per start-up. The hand-written chain gets the same fresh contexts.
- ``decide_warm_vs_handwritten`` (context): the same with each context reused
  call after call, where the engine's per-context scope cache answers.
- ``decide_explain_vs_handwritten``: the full trace recorded, fresh contexts;
  ``decide_explain_warm_vs_handwritten`` (context) with reused ones.
- ``decide_1000_vs_shipped``: 1,000 generated rules over 20 connectors against
  the shipped rules, same inputs (fresh contexts); ``decide_1000_warm_vs_shipped``
  (context) with reused ones.
- ``load_1000_vs_safe_load``: loading and validating those 1,000 rules against
  parsing the same files with the same YAML parser kvpolicy composes with:
  libyaml's ``yaml.CSafeLoader`` when PyYAML has it (``yaml.load(text,
  Loader=yaml.CSafeLoader)``), else the pure-Python ``yaml.safe_load``
  (``yaml_c_loader`` says which: 1 or 0). ``load_1000_vs_py_safe_load``
  (context): against the pure-Python ``yaml.safe_load``.

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

from kvpolicy.engine import LayoutEngine  # noqa: E402
from kvpolicy.policy import ConnectorConfig, Context, Layout, load_rules_from_texts  # noqa: E402
from kvpolicy.policy.backends import BACKENDS  # noqa: E402

# The hand-written chain is vLLM's use_uniform_kv_cache gate as of vLLM issue #48412: the decisions are
# made under that profile (the default profile, vllm-0.34, refuses some of these contexts' inputs).
PROFILE = "issue-48412"
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


def _time_once(fn: Callable[[], object], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def _interleaved(ours: Callable[[], object], base: Callable[[], object], number: int, rounds: int
                 ) -> tuple[float, float, float]:
    """(median time of ``ours``, of ``base``, median per-round ``ours / base``), base then ours each round."""
    ours()
    base()
    t_ours, t_base, ratios = [], [], []
    for _ in range(rounds):
        b = _time_once(base, number)
        a = _time_once(ours, number)
        t_ours.append(a)
        t_base.append(b)
        ratios.append(a / b)
    return statistics.median(t_ours), statistics.median(t_base), statistics.median(ratios)


class _Fresh:
    """Equal, not identical, copies of ``ctxs``: ``next()`` gives a new list every call, made beforehand."""

    def __init__(self, ctxs: list[Context], count: int) -> None:
        self._lists = [[c.model_copy() for c in ctxs] for _ in range(count)]
        self._i = 0

    def next(self) -> list[Context]:
        out = self._lists[self._i]
        self._i += 1
        return out


def _over(ctxs: list[Context], fn: Callable[[Context], object]) -> Callable[[], None]:
    def run() -> None:
        for c in ctxs:
            fn(c)

    return run


def _cold(fresh: _Fresh, fn: Callable[[Context], object]) -> Callable[[], None]:
    def run() -> None:
        for c in fresh.next():
            fn(c)

    return run


def generated_rules(n_rules: int = 1000, n_connectors: int = 20) -> dict[str, str]:
    """A large, realistic rule set: the shipped rules plus generated connector files."""
    from kvpolicy.engine.layout_engine import shipped_rules_dir

    root = shipped_rules_dir(PROFILE)
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
    engine = LayoutEngine.default(PROFILE)
    ctxs = contexts(engine)
    for c in ctxs:  # the engine must agree with the reference it is measured against
        assert engine.decide(c, explain=False).layout == handwritten(c), c
    number, rounds = (100, 5) if quick else (300, 15)
    calls = 2 * (rounds * number + 1)  # fresh lists a cold comparison consumes (both sides, warm-up)

    def decide(c: Context) -> object:
        return engine.decide(c, explain=False)

    def explain(c: Context) -> object:
        return engine.decide(c, explain=True)

    fresh = _Fresh(ctxs, calls)
    t_fast, t_hand, cold = _interleaved(_cold(fresh, decide), _cold(fresh, handwritten), number, rounds)
    _, _, warm = _interleaved(_over(ctxs, decide), _over(ctxs, handwritten), number, rounds)
    fresh = _Fresh(ctxs, 2 * (rounds * (number // 10) + 1))
    _, _, explain_cold = _interleaved(_cold(fresh, explain), _cold(fresh, handwritten), number // 10, rounds)
    _, _, explain_warm = _interleaved(_over(ctxs, explain), _over(ctxs, handwritten), number // 10, rounds)

    texts = generated_rules()
    big = LayoutEngine(load_rules_from_texts(texts), vllm_version=PROFILE)
    big_ctxs = [c.model_copy(update={"connector": ConnectorConfig(name="P2pNcclConnector")}) for c in ctxs]
    fresh = _Fresh(big_ctxs, 2 * (rounds * number + 1))
    _, _, big_ratio = _interleaved(_cold(fresh, lambda c: big.decide(c, explain=False)), _cold(fresh, decide),
                                   number, rounds)
    _, _, big_warm = _interleaved(_over(big_ctxs, lambda c: big.decide(c, explain=False)), _over(big_ctxs, decide),
                                  number, rounds)
    c_loader = getattr(yaml, "CSafeLoader", None)
    loader = c_loader or yaml.SafeLoader
    load_rounds = 3 if quick else 7
    _, _, load = _interleaved(lambda: load_rules_from_texts(texts),
                              lambda: [yaml.load(t, Loader=loader) for t in texts.values()], 1, load_rounds)
    _, _, load_py = _interleaved(lambda: load_rules_from_texts(texts),
                                 lambda: [yaml.safe_load(t) for t in texts.values()], 1, load_rounds)

    n = len(ctxs)
    return {
        "decide_us": t_fast / n * 1e6,
        "handwritten_us": t_hand / n * 1e6,
        "decide_vs_handwritten": cold,
        "decide_warm_vs_handwritten": warm,
        "decide_explain_vs_handwritten": explain_cold,
        "decide_explain_warm_vs_handwritten": explain_warm,
        "decide_1000_vs_shipped": big_ratio,
        "decide_1000_warm_vs_shipped": big_warm,
        "load_1000_vs_safe_load": load,
        "load_1000_vs_py_safe_load": load_py,
        "yaml_c_loader": float(c_loader is not None),
        "rules_generated": float(len(big.ruleset.rules)),
        "backends": float(len(BACKENDS)),
    }


if __name__ == "__main__":
    results = run(quick="--quick" in sys.argv)
    for key, value in results.items():
        print(f"{key:32} {value:10.2f}")
