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
- ``write_vs_naive``: the int8 write's throughput over a straightforward eager
  implementation of the same arithmetic (fresh temporaries, one ``index_copy_``
  of each token's row of cells), kept below as `naive_int8_write`. Higher is
  better. The run checks that the runtime, writing alone into a zeroed cache,
  leaves the same bytes as the baseline does.
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
- ``restore_{cross,per_layer}_vs_copy``: the same for `KVCache.restore` of those
  blocks from that tensor. Context: ``{offload,restore}_cross_over_per_layer``,
  the cross_layer throughput over the per_layer one.

With ``--device cuda`` (`run(quick, "cuda")`) the cache, the inputs, the slot
mappings and every ``copy_`` reference are on the GPU; every timed region is
bracketed by ``torch.cuda.synchronize()`` and timed with ``perf_counter``, so
host work inside a call (launches, the runtime's host syncs) counts, as it does
for a caller. The keys above keep their meaning with "on the device" for "on the
CPU", except offload and restore: the cache is on the GPU, the host side a pinned CPU
tensor, and the reference a plain ``copy_`` of the same bytes between a contiguous
device tensor and a pinned one, in the same direction. GPU-only keys:

- ``device_copy_gbps`` (context): device memory bandwidth, bytes read plus
  bytes written per second by ``copy_`` of 1 GiB from one device tensor to another.
- ``write_{int8,fp8,int4}_vs_membw``: the write's achieved bandwidth, input bytes
  read plus cell bytes written (codes and scales) per second, over
  ``device_copy_gbps``. Higher is better; the issue's goal is 0.5x (FlashInfer's
  fused append reaches about 0.6x from 384 tokens up).
- ``write_int8_t{384,2048,16384}_vs_membw`` (context): the same for int8 at three
  prefill sizes (2048 is the goal key's write).

    python bench/bench_runtime.py [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpolicy.engine.plan import LayoutPlan, plan_layout  # noqa: E402
from kvpolicy.engine.runtime import KVCache, allocate  # noqa: E402
from kvpolicy.policy.backends import BACKENDS  # noqa: E402
from kvpolicy.policy.layouts import Layout  # noqa: E402
from kvpolicy.policy.spec import KVCacheSpec  # noqa: E402

LAYERS, BLOCK, HEADS, HEAD = 32, 16, 8, 128  # Llama-3-8B per rank
TOKENS = 2048
TRITON = BACKENDS["TRITON_ATTN"]
GPU_INNER = 10  # calls per timed region on a GPU, where one call can be a few microseconds
SWEEP_TOKENS = (384, 2048, 16384)
CPU = torch.device("cpu")
MEMBW_BYTES = 1 << 30


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
    """The straightforward eager int8 per-token-head write, the baseline of ``write_vs_naive``: vLLM's
    arithmetic (engine/runtime/quantize.py) with fresh temporaries, a head's codes and scale
    concatenated into its cell, and one ``index_copy_`` of each token's row of H cells (one index
    per token and K or V). NHD layouts only (a token's H cells adjacent), as the benchmark's."""
    plan = cache.plan
    spec, view = plan.spec, plan.layers[layer].view
    raw = cache.raw[view.buffer]
    strides = dict(zip(view.dims, view.strides, strict=True))
    row = spec.num_kv_heads * spec.cell_bytes
    assert strides["head"] == spec.cell_bytes and all(strides[d] % row == 0 for d in ("block", "kv", "token"))
    assert view.storage_offset % row == 0
    rows = raw.view(-1, row)
    dev = slot_mapping.device
    # divisors as device tensors: CUDA turns a division by a Python scalar into a multiplication by its
    # reciprocal (engine/runtime/quantize.py), which is not the runtime's rounding
    qmax = torch.tensor(127.0, device=dev)
    one = torch.tensor(1.0, device=dev)
    block = slot_mapping // spec.block_size
    offset = slot_mapping % spec.block_size
    for kv, x in enumerate((key, value)):
        xf = x.float()
        amax = torch.nan_to_num(xf.abs(), nan=0.0).amax(-1, keepdim=True)
        scale = torch.clamp_min(amax / qmax, 1e-6)
        y = xf * (one / scale)
        y = torch.where(y >= 0, y + 0.5, y - 0.5)
        q = torch.nan_to_num(y, nan=-128.0).clamp(-128, 127).to(torch.int8)
        cells = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)  # (T, H, cell)
        index = (view.storage_offset + kv * strides["kv"] + block * strides["block"] + offset * strides["token"]) // row
        rows.index_copy_(0, index, cells.view(-1, row))


Sync = Callable[[], None] | None


def _sync(device: torch.device) -> Sync:
    """What to call before and after a timed region: nothing on the CPU, a device synchronize on CUDA."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], inner: int = 1, sync: Sync = None) -> float:
    if sync is not None:
        sync()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - start) / inner


def _compare(ours: Callable[[], object], base: Callable[[], object], rounds: int, inner: int = 1,
             warmup: int = 2, sync: Sync = None) -> tuple[float, float, float]:
    """(median time ours, median time base, median of per-round base/ours), interleaved."""
    for _ in range(warmup):
        ours()
        base()
    t_ours, t_base, ratios = [], [], []
    for _ in range(rounds):
        a = _time(ours, inner, sync)
        b = _time(base, inner, sync)
        t_ours.append(a)
        t_base.append(b)
        ratios.append(b / a)
    return statistics.median(t_ours), statistics.median(t_base), statistics.median(ratios)


def bench_bandwidth(quick: bool, device: torch.device) -> float:
    """Device memory bandwidth, bytes read plus written per second, of a 1 GiB device-to-device ``copy_``."""
    sync = _sync(device)
    src = torch.empty(MEMBW_BYTES, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    t = []
    for _ in range(2):  # warm-up
        dst.copy_(src)
    for _ in range(5 if quick else 15):
        t.append(_time(lambda: dst.copy_(src), 5, sync))
    return 2 * MEMBW_BYTES / statistics.median(t)


def bench_writes(quick: bool, device: torch.device = CPU, membw: float | None = None) -> dict[str, float]:
    rounds = 7 if quick else 41
    sync = _sync(device)
    inner = 1 if sync is None else GPU_INNER
    num_blocks = TOKENS // BLOCK * 2
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(TOKENS, HEADS, HEAD, generator=gen).to(torch.bfloat16).to(device)
    value = torch.randn(TOKENS, HEADS, HEAD, generator=gen).to(torch.bfloat16).to(device)
    slots = prefill_slots(TOKENS, num_blocks, gen).to(device)
    nbytes = key.nbytes + value.nbytes
    src = torch.cat([key, value])
    dst = torch.empty_like(src)
    out: dict[str, float] = {}
    for short, dtype in (("int8", "int8_per_token_head"), ("fp8", "fp8_per_token_head"),
                         ("int4", "int4_per_token_head")):
        cache = allocate(llama_plan(dtype, "per_layer/NHD", num_blocks), device)
        t_write, t_copy, ratio = _compare(lambda c=cache: c.write(3, key, value, slots), lambda: dst.copy_(src),
                                          rounds, inner, sync=sync)
        out[f"write_{short}_vs_copy"] = ratio
        out[f"write_{short}_gbps"] = nbytes / t_write / 1e9
        out.setdefault("copy_gbps", nbytes / t_copy / 1e9)
        if membw is not None:  # bytes read (the input) plus bytes written (the cells), over the device's bandwidth
            moved = nbytes + 2 * TOKENS * HEADS * cache.plan.spec.cell_bytes
            out[f"write_{short}_vs_membw"] = moved / t_write / membw
        if short == "int8":
            t_write, t_naive, _ = _compare(lambda c=cache: c.write(3, key, value, slots),
                                           lambda c=cache: naive_int8_write(c, 3, key, value, slots), rounds,
                                           inner, sync=sync)
            out["write_vs_naive"] = t_naive / t_write
            out["write_scratch_vs_input"] = cache.scratch_bytes / nbytes
            # the runtime's bytes against the baseline's, each written alone into a zeroed cache
            for r in cache.raw:
                r.zero_()
            cache.write(3, key, value, slots)
            runtime_bytes = [r.clone() for r in cache.raw]
            for r in cache.raw:
                r.zero_()
            naive_int8_write(cache, 3, key, value, slots)
            if not all(torch.equal(a, b) for a, b in zip(runtime_bytes, cache.raw, strict=True)):
                raise AssertionError("the runtime and the eager baseline wrote different bytes")
        del cache
    return out


def bench_write_sweep(quick: bool, device: torch.device, membw: float) -> dict[str, float]:
    """GPU context: the int8 write's achieved bandwidth over the device's at several prefill sizes."""
    sync = _sync(device)
    rounds = 5 if quick else 21
    gen = torch.Generator().manual_seed(3)
    out: dict[str, float] = {}
    for tokens in SWEEP_TOKENS:
        num_blocks = math.ceil(tokens / BLOCK) * 2
        key = torch.randn(tokens, HEADS, HEAD, generator=gen).to(torch.bfloat16).to(device)
        value = torch.randn(tokens, HEADS, HEAD, generator=gen).to(torch.bfloat16).to(device)
        slots = prefill_slots(tokens, num_blocks, gen).to(device)
        src = torch.cat([key, value])
        dst = torch.empty_like(src)
        cache = allocate(llama_plan("int8_per_token_head", "per_layer/NHD", num_blocks), device)
        t_write, _, _ = _compare(lambda c=cache, k=key, v=value, s=slots: c.write(3, k, v, s),
                                 lambda s=src, d=dst: d.copy_(s), rounds, GPU_INNER, sync=sync)
        moved = src.nbytes + 2 * tokens * HEADS * cache.plan.spec.cell_bytes
        out[f"write_int8_t{tokens}_vs_membw"] = moved / t_write / membw
        del cache, key, value, src, dst
    return out


DECODE_CASES = [  # (layout, kv_cache_dtype, key suffix); the first is the goal's key
    ("cross_layer/NHD", "int8_per_token_head", ""),
    ("per_layer/NHD", "int8_per_token_head", "_per_layer"),
    ("cross_layer/NHD", "auto", "_auto"),
    ("per_layer/NHD", "auto", "_auto_per_layer"),
]


def bench_decode(quick: bool, device: torch.device = CPU) -> dict[str, float]:
    """One `KVCache.write_layers` call (all 32 layers) vs 32 ``copy_`` calls of one layer's K and V bytes each."""
    rounds = 15 if quick else 50
    sync = _sync(device)
    inner = 3 if sync is None else GPU_INNER
    num_blocks = 64
    gen = torch.Generator().manual_seed(1)
    out: dict[str, float] = {}
    for layout, dtype, suffix in DECODE_CASES:
        cache = allocate(llama_plan(dtype, layout, num_blocks), device)
        logs, loop_logs = [], []
        for tokens in (1, 4, 16):
            keys = torch.randn(LAYERS, tokens, HEADS, HEAD, generator=gen).to(torch.bfloat16).to(device)
            values = torch.randn(LAYERS, tokens, HEADS, HEAD, generator=gen).to(torch.bfloat16).to(device)
            slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens].to(device)
            src = torch.cat([keys[0], values[0]])
            dsts = [torch.empty_like(src) for _ in range(LAYERS)]

            def step(c: KVCache = cache, k: torch.Tensor = keys, v: torch.Tensor = values, s: torch.Tensor = slots
                     ) -> None:
                c.write_layers(k, v, s)

            def copies(src: torch.Tensor = src, dsts: list[torch.Tensor] = dsts) -> None:
                for d in dsts:
                    d.copy_(src)

            _, _, ratio = _compare(step, copies, rounds, inner=inner, sync=sync)
            logs.append(math.log(1 / ratio))  # a time ratio: lower is better
            if not suffix:
                out[f"decode_write_vs_copy_t{tokens}"] = 1 / ratio
            if suffix == "_per_layer":  # the per-layer API, one write() per layer, for comparison

                def loop(c: KVCache = cache, k: torch.Tensor = keys, v: torch.Tensor = values,
                         s: torch.Tensor = slots) -> None:
                    for layer in range(LAYERS):
                        c.write(layer, k[layer], v[layer], s)

                _, _, ratio = _compare(loop, copies, max(5, rounds // 3), inner=inner, sync=sync)
                loop_logs.append(math.log(1 / ratio))
        out[f"decode_write{suffix}_vs_copy"] = math.exp(sum(logs) / len(logs))
        if loop_logs:
            out["decode_write_loop_per_layer_vs_copy"] = math.exp(sum(loop_logs) / len(loop_logs))
        del cache
    return out


def bench_offload(quick: bool, device: torch.device = CPU) -> dict[str, float]:
    """Offload and restore of 128 blocks against ``copy_`` of the same bytes.

    CPU: offload into a CPU tensor, restore from it, against a CPU ``copy_``. CUDA: offload into
    a pinned CPU tensor and restore from it, against a ``copy_`` of the same bytes between a
    contiguous device tensor and pinned memory, in the same direction.
    """
    rounds = 5 if quick else 15
    sync = _sync(device)
    cuda = sync is not None
    n, num_blocks = 128, 160
    gen = torch.Generator().manual_seed(2)
    ids = torch.randperm(num_blocks, generator=gen)[:n]
    out: dict[str, float] = {}
    dev_buf = host = None
    for layout, short in (("cross_layer/NHD", "cross"), ("per_layer/NHD", "per_layer")):
        cache = allocate(llama_plan("auto", layout, num_blocks), device)
        for r in cache.raw:
            r.random_(0, 256)
        shape = (n, LAYERS, cache.plan.page_size_bytes)
        buf = _host(shape, pinned=cuda)
        if dev_buf is None:  # the references: the same bytes between a contiguous tensor on the device and host
            dev_buf, host = torch.empty_like(buf, device=device).random_(0, 256), _host(shape, pinned=cuda)
        t_off, t_copy, ratio = _compare(lambda c=cache, b=buf: c.offload(ids, out=b),
                                        lambda s=dev_buf, d=host: d.copy_(s, non_blocking=cuda), rounds, warmup=1,
                                        sync=sync)
        out[f"offload_{short}_vs_copy"] = ratio
        out[f"offload_{short}_gbps"] = buf.nbytes / t_off / 1e9
        out.setdefault("offload_copy_gbps", buf.nbytes / t_copy / 1e9)
        if cuda and not torch.equal(buf, cache.offload(ids).data):
            raise AssertionError("offload into a pinned buffer and a fresh offload disagree")
        blocks = cache.offload(ids, out=buf)  # the bytes in `buf`, bound to the cache's layout
        before = [r.clone() for r in cache.raw]
        t_res, _, ratio = _compare(lambda c=cache, b=blocks: c.restore(ids, b),
                                   lambda s=host, d=dev_buf: d.copy_(s, non_blocking=cuda), rounds, warmup=1,
                                   sync=sync)
        out[f"restore_{short}_vs_copy"] = ratio
        out[f"restore_{short}_gbps"] = buf.nbytes / t_res / 1e9
        if not all(torch.equal(a, b) for a, b in zip(before, cache.raw, strict=True)):
            raise AssertionError("restoring the offloaded blocks changed the cache")
        del cache, buf, before, blocks
    out["offload_cross_over_per_layer"] = out["offload_cross_gbps"] / out["offload_per_layer_gbps"]
    out["restore_cross_over_per_layer"] = out["restore_cross_gbps"] / out["restore_per_layer_gbps"]
    return out


def _host(shape: tuple[int, ...], pinned: bool) -> torch.Tensor:
    """A CPU uint8 tensor; pinned (page-locked) for transfers from a GPU (``empty_like`` would drop that)."""
    if pinned:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
    return torch.empty(shape, dtype=torch.uint8)


def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu`` or ``cuda[:i]`` (with its index, as the runtime's tensors carry it)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise SystemExit(f"--device {device}: use cpu or cuda")
    return dev


def run(quick: bool = False, device: str | torch.device = "cpu") -> dict[str, float]:
    """Every runtime ratio (see the module docstring) plus context figures (GB/s, per-token-count ratios)."""
    dev = resolve_device(device)
    results: dict[str, float] = {}
    with torch.no_grad():
        membw = None
        if dev.type == "cuda":
            membw = bench_bandwidth(quick, dev)
            results["device_copy_gbps"] = membw / 1e9
        results.update(bench_writes(quick, dev, membw))
        if membw is not None:
            results.update(bench_write_sweep(quick, dev, membw))
        results.update(bench_decode(quick, dev))
        results.update(bench_offload(quick, dev))
    return results


def machine(device: str | torch.device = "cpu") -> str:
    from run import machine as machine_info  # one description of the machine for every benchmark

    info = machine_info(device)
    text = f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['threads']} threads)"
    return text + (f"; {info['gpu']}" if "gpu" in info else "")


KEYS = [
    ("write_int8_vs_copy", "int8 per-token-head write vs copy_ (throughput)", "higher"),
    ("write_fp8_vs_copy", "fp8 per-token-head write vs copy_ (throughput)", "higher"),
    ("write_int4_vs_copy", "int4 per-token-head write vs copy_ (throughput)", "higher"),
    ("write_int8_vs_membw", "int8 write, bytes read+written/s, vs device copy_ bandwidth (GPU)", "higher"),
    ("write_fp8_vs_membw", "fp8 write, bytes read+written/s, vs device copy_ bandwidth (GPU)", "higher"),
    ("write_int4_vs_membw", "int4 write, bytes read+written/s, vs device copy_ bandwidth (GPU)", "higher"),
    ("write_vs_naive", "int8 write vs naive eager write (throughput)", "higher"),
    ("decode_write_vs_copy", "decode write_layers (32 layers, cross_layer) vs 32 copy_ calls (time)", "lower"),
    ("decode_write_per_layer_vs_copy", "decode write_layers (32 layers, per_layer) vs 32 copy_ calls (time)", "lower"),
    ("offload_cross_vs_copy", "offload 128 blocks, cross_layer, vs copy_ (throughput)", "higher"),
    ("offload_per_layer_vs_copy", "offload 128 blocks, per_layer, vs copy_ (throughput)", "higher"),
    ("restore_cross_vs_copy", "restore 128 blocks, cross_layer, vs copy_ (throughput)", "higher"),
    ("restore_per_layer_vs_copy", "restore 128 blocks, per_layer, vs copy_ (throughput)", "higher"),
]


def table(results: dict[str, float], device: str | torch.device = "cpu") -> str:
    lines = [f"machine: {machine(device)}", "", "| what | ratio | better |", "|---|---|---|"]
    for key, what, better in KEYS:
        if key in results:  # the _vs_membw keys exist on a GPU only
            lines.append(f"| {what} (`{key}`) | {results[key]:.3f}x | {better} |")
    extra = [k for k in results if k not in dict((k, 0) for k, _, _ in KEYS)]
    lines += ["", "context: " + ", ".join(f"{k}={results[k]:.3g}" for k in extra)]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    args = parser.parse_args()
    print(table(run(args.quick, args.device), args.device))
