"""The torch runtime's speed, as ratios measured in one run (`run(quick)` for bench/run.py).

Every figure compares two things timed in the same process, interleaved
round by round (so a noisy neighbour slows both), and reports the median of
the per-round ratios. Conventions follow bench/run.py's goals:

- ``write_{int8,fp8,int4}_vs_copy``: throughput of `KVCache.write` (input bytes/s:
  K and V of 2048 tokens x 8 heads x 128, bf16, 8 MiB) into a Llama-3-8B-shaped
  per-token-head cache (32 layers, block 16, per_layer/NHD), over the throughput
  of torch ``copy_`` of the same 8 MiB. Higher is better; 1.0 = as fast as a copy.
  The copy's 16 MiB (source and destination) stay in the L3 cache; the write
  reads its input after the copy has evicted it and scatters into a 270 MiB
  cache. The smaller a write's own footprint, the hotter the copy stays, so
  ``copy_gbps`` (context) moves with the write: compare ``write_*_gbps`` across
  versions, the ratios within one run.
- ``write_vs_naive``: the int8 write's throughput over a naive eager
  implementation (fresh temporaries, every cell byte written by one uint8
  ``index_put_``), kept below as `naive_int8_write`. Higher is better.
- ``write_scratch_vs_input`` (context): the scratch memory a write holds
  (`KVCache.scratch_bytes`, its peak extra memory less index tensors) over the
  input bytes, after the int8 write above.
- ``decode_write_vs_copy``: *time* of one decode step's write of every layer
  (1, 4, 16 tokens; one `KVCache.write_layers` call for all 32 layers, int8
  per-token-head, cross_layer/NHD: one scatter for all layers) over the time of
  32 ``copy_`` calls, each of one layer's K and V bytes; geometric mean over the
  token counts, each also reported. Lower is better. Context: the same for
  per_layer/NHD (``_per_layer``: one scatter per layer), for a bf16 cache
  (``_auto``, ``_auto_per_layer``), and 32 `KVCache.write` calls on per_layer
  (``decode_write_loop_per_layer_vs_copy``, the measure before write_layers).
- ``offload_{cross,per_layer}_vs_copy``: throughput of `KVCache.offload` of 128
  blocks (bf16 cache, 2 MiB a block) into a preallocated CPU tensor, over ``copy_``
  of the same bytes between two contiguous tensors. Higher is better.

    python bench/bench_runtime.py [--quick]
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.plan import LayoutPlan, plan_layout  # noqa: E402
from engine.runtime import KVCache, allocate  # noqa: E402
from policy.backends import BACKENDS  # noqa: E402
from policy.layouts import Layout  # noqa: E402
from policy.spec import KVCacheSpec  # noqa: E402

LAYERS, BLOCK, HEADS, HEAD = 32, 16, 8, 128  # Llama-3-8B per rank
TOKENS = 2048
TRITON = BACKENDS["TRITON_ATTN"]


def llama_plan(kv_cache_dtype: str, layout: str, num_blocks: int) -> LayoutPlan:
    spec = KVCacheSpec(num_layers=LAYERS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                       kv_cache_dtype=kv_cache_dtype)
    return plan_layout(Layout.parse(layout), spec, TRITON, num_blocks)


def prefill_slots(num_tokens: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Slots as vLLM assigns them: whole blocks in a shuffled order, tokens in order inside each."""
    blocks = torch.randperm(num_blocks, generator=gen)[: math.ceil(num_tokens / BLOCK)]
    return (blocks.view(-1, 1) * BLOCK + torch.arange(BLOCK)).flatten()[:num_tokens]


def naive_int8_write(cache: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """The straightforward int8 per-token-head write: eager math with fresh temporaries,
    then every byte of every cell scattered by one uint8 ``index_put_``."""
    plan = cache.plan
    spec, view = plan.spec, plan.layers[layer].view
    raw = cache.raw[view.buffer]
    sizes = {d: s for d, s in zip(view.dims, view.strides, strict=True)}
    block = slot_mapping // spec.block_size
    offset = slot_mapping % spec.block_size
    for kv, x in enumerate((key, value)):
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / 127.0
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.clamp(torch.round(xf / scale), -127, 127).to(torch.int8)
        cells = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
        base = view.storage_offset + kv * sizes["kv"] + block * sizes["block"] + offset * sizes["token"]
        addr = (base.view(-1, 1, 1) + torch.arange(spec.num_kv_heads).view(1, -1, 1) * sizes["head"]
                + torch.arange(spec.cell_bytes).view(1, 1, -1))
        raw.index_put_((addr.flatten(),), cells.flatten())


def _time(fn: Callable[[], object], inner: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def _compare(ours: Callable[[], object], base: Callable[[], object], rounds: int, inner: int = 1,
             warmup: int = 2) -> tuple[float, float, float]:
    """(median time ours, median time base, median of per-round base/ours), interleaved."""
    for _ in range(warmup):
        ours()
        base()
    t_ours, t_base, ratios = [], [], []
    for _ in range(rounds):
        a = _time(ours, inner)
        b = _time(base, inner)
        t_ours.append(a)
        t_base.append(b)
        ratios.append(b / a)
    return statistics.median(t_ours), statistics.median(t_base), statistics.median(ratios)


def bench_writes(quick: bool) -> dict[str, float]:
    rounds = 7 if quick else 41
    num_blocks = TOKENS // BLOCK * 2
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(TOKENS, HEADS, HEAD, generator=gen).to(torch.bfloat16)
    value = torch.randn(TOKENS, HEADS, HEAD, generator=gen).to(torch.bfloat16)
    slots = prefill_slots(TOKENS, num_blocks, gen)
    nbytes = key.nbytes + value.nbytes
    src = torch.cat([key, value])
    dst = torch.empty_like(src)
    out: dict[str, float] = {}
    for short, dtype in (("int8", "int8_per_token_head"), ("fp8", "fp8_per_token_head"),
                         ("int4", "int4_per_token_head")):
        cache = allocate(llama_plan(dtype, "per_layer/NHD", num_blocks))
        t_write, t_copy, ratio = _compare(lambda c=cache: c.write(3, key, value, slots), lambda: dst.copy_(src),
                                          rounds)
        out[f"write_{short}_vs_copy"] = ratio
        out[f"write_{short}_gbps"] = nbytes / t_write / 1e9
        out.setdefault("copy_gbps", nbytes / t_copy / 1e9)
        if short == "int8":
            t_write, t_naive, _ = _compare(lambda c=cache: c.write(3, key, value, slots),
                                           lambda c=cache: naive_int8_write(c, 3, key, value, slots), rounds)
            out["write_vs_naive"] = t_naive / t_write
            out["write_scratch_vs_input"] = cache.scratch_bytes / nbytes
            fast = torch.cat([r.clone() for r in cache.raw])  # the two must agree byte for byte
            for r in cache.raw:
                r.zero_()
            naive_int8_write(cache, 3, key, value, slots)
            if not torch.equal(fast, torch.cat(list(cache.raw))):
                raise AssertionError("the naive baseline and the runtime wrote different bytes")
        del cache
    return out


DECODE_CASES = [  # (layout, kv_cache_dtype, key suffix); the first is the goal's key
    ("cross_layer/NHD", "int8_per_token_head", ""),
    ("per_layer/NHD", "int8_per_token_head", "_per_layer"),
    ("cross_layer/NHD", "auto", "_auto"),
    ("per_layer/NHD", "auto", "_auto_per_layer"),
]


def bench_decode(quick: bool) -> dict[str, float]:
    """One `KVCache.write_layers` call (all 32 layers) vs 32 ``copy_`` calls of one layer's K and V bytes each."""
    rounds = 15 if quick else 50
    num_blocks = 64
    gen = torch.Generator().manual_seed(1)
    out: dict[str, float] = {}
    for layout, dtype, suffix in DECODE_CASES:
        cache = allocate(llama_plan(dtype, layout, num_blocks))
        logs, loop_logs = [], []
        for tokens in (1, 4, 16):
            keys = torch.randn(LAYERS, tokens, HEADS, HEAD, generator=gen).to(torch.bfloat16)
            values = torch.randn(LAYERS, tokens, HEADS, HEAD, generator=gen).to(torch.bfloat16)
            slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens]
            src = torch.cat([keys[0], values[0]])
            dsts = [torch.empty_like(src) for _ in range(LAYERS)]

            def step(c: KVCache = cache, k: torch.Tensor = keys, v: torch.Tensor = values, s: torch.Tensor = slots
                     ) -> None:
                c.write_layers(k, v, s)

            def copies(src: torch.Tensor = src, dsts: list[torch.Tensor] = dsts) -> None:
                for d in dsts:
                    d.copy_(src)

            _, _, ratio = _compare(step, copies, rounds, inner=3)
            logs.append(math.log(1 / ratio))  # a time ratio: lower is better
            if not suffix:
                out[f"decode_write_vs_copy_t{tokens}"] = 1 / ratio
            if suffix == "_per_layer":  # the per-layer API, one write() per layer, for comparison

                def loop(c: KVCache = cache, k: torch.Tensor = keys, v: torch.Tensor = values,
                         s: torch.Tensor = slots) -> None:
                    for layer in range(LAYERS):
                        c.write(layer, k[layer], v[layer], s)

                _, _, ratio = _compare(loop, copies, max(5, rounds // 3), inner=3)
                loop_logs.append(math.log(1 / ratio))
        out[f"decode_write{suffix}_vs_copy"] = math.exp(sum(logs) / len(logs))
        if loop_logs:
            out["decode_write_loop_per_layer_vs_copy"] = math.exp(sum(loop_logs) / len(loop_logs))
        del cache
    return out


def bench_offload(quick: bool) -> dict[str, float]:
    rounds = 5 if quick else 15
    n, num_blocks = 128, 160
    gen = torch.Generator().manual_seed(2)
    ids = torch.randperm(num_blocks, generator=gen)[:n]
    out: dict[str, float] = {}
    dst = None
    for layout, key in (("cross_layer/NHD", "offload_cross_vs_copy"), ("per_layer/NHD", "offload_per_layer_vs_copy")):
        cache = allocate(llama_plan("auto", layout, num_blocks))
        for r in cache.raw:
            r.random_(0, 256)
        buf = torch.empty((n, LAYERS, cache.plan.page_size_bytes), dtype=torch.uint8)
        if dst is None:
            src, dst = torch.empty_like(buf).random_(0, 256), torch.empty_like(buf)
        t_off, t_copy, ratio = _compare(lambda c=cache, b=buf: c.offload(ids, out=b), lambda s=src, d=dst: d.copy_(s),
                                        rounds, warmup=1)
        out[key] = ratio
        out[key.replace("_vs_copy", "_gbps")] = buf.nbytes / t_off / 1e9
        out.setdefault("offload_copy_gbps", buf.nbytes / t_copy / 1e9)
        del cache, buf
    return out


def run(quick: bool = False) -> dict[str, float]:
    """Every runtime ratio (see the module docstring) plus context figures (GB/s, per-token-count ratios)."""
    results: dict[str, float] = {}
    with torch.no_grad():
        results.update(bench_writes(quick))
        results.update(bench_decode(quick))
        results.update(bench_offload(quick))
    return results


def machine() -> str:
    from run import machine as machine_info  # one description of the machine for every benchmark

    info = machine_info()
    return f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['threads']} threads)"


KEYS = [
    ("write_int8_vs_copy", "int8 per-token-head write vs copy_ (throughput)", "higher"),
    ("write_fp8_vs_copy", "fp8 per-token-head write vs copy_ (throughput)", "higher"),
    ("write_int4_vs_copy", "int4 per-token-head write vs copy_ (throughput)", "higher"),
    ("write_vs_naive", "int8 write vs naive eager write (throughput)", "higher"),
    ("decode_write_vs_copy", "decode write_layers (32 layers, cross_layer) vs 32 copy_ calls (time)", "lower"),
    ("decode_write_per_layer_vs_copy", "decode write_layers (32 layers, per_layer) vs 32 copy_ calls (time)", "lower"),
    ("offload_cross_vs_copy", "offload 128 blocks, cross_layer, vs copy_ (throughput)", "higher"),
    ("offload_per_layer_vs_copy", "offload 128 blocks, per_layer, vs copy_ (throughput)", "higher"),
]


def table(results: dict[str, float]) -> str:
    lines = [f"machine: {machine()}", "", "| what | ratio | better |", "|---|---|---|"]
    for key, what, better in KEYS:
        lines.append(f"| {what} (`{key}`) | {results[key]:.3f}x | {better} |")
    extra = [k for k in results if k not in dict((k, 0) for k, _, _ in KEYS)]
    lines += ["", "context: " + ", ".join(f"{k}={results[k]:.3g}" for k in extra)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run(quick="--quick" in sys.argv)))
