"""What transcoding costs a restore: `KVCache.restore` of blocks of another layout vs of its own (`run(quick)`).

Both restores write the same blocks of the same target cache from the same number of
bytes (no page padding on either side, so the source rows are exactly as long as the
target's): the plain restore gets blocks the target offloaded itself (its own format,
copied as they are), the transcoding restore blocks of the same cells that another
layout offloaded (`kvpolicy.engine.runtime.transcode`: one strided ``copy_`` into a
staging tensor, then the same scatter). Llama-3-8B-shaped caches (32 layers, 8 KV
heads, head 128, block 16), 128 blocks (32 with ``--quick``), interleaved round by
round, median of the per-round ratios:

- ``restore_transcode_bf16_vs_plain``: *time* of restoring bf16 blocks offloaded under
  ``issue-48412`` (BLNHC: cross-layer, the K/V dim outside the tokens) into a
  ``vllm-0.34`` cache (LBHNC: K and V packed in each head's content), over the plain
  restore of the same blocks. Lower is better; 1.0 = transcoding is free. 2 MiB a block.
- ``restore_transcode_int8_vs_plain``: the same for ``int8_per_token_head`` blocks
  (132-byte cells, inline scales) from ``vllm-0.28``'s per-layer LBNHC into
  ``vllm-0.34``'s LBHNC. 1.03 MiB a block.
- Context: ``transcode_{bf16,int8}_gbps`` and ``restore_plain_{bf16,int8}_gbps`` (bytes
  restored per second), ``transcode_{bf16,int8}_vs_copy`` (the permuting ``copy_`` alone, of
  one staging chunk of blocks into a preallocated tensor, over a contiguous ``copy_`` of the
  same bytes, time).

With ``--device cuda`` the caches are on the GPU and the blocks in pinned host memory,
as `KVCache.offload` returns them there.

    python bench/bench_transcode.py [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_runtime import BLOCK, HEAD, HEADS, LAYERS, _compare, _sync, resolve_device  # noqa: E402

from kvpolicy.engine.plan import plan_layout  # noqa: E402
from kvpolicy.engine.runtime import KVCache, allocate  # noqa: E402
from kvpolicy.engine.runtime.transcode import transcode_into  # noqa: E402
from kvpolicy.engine.runtime.transfer import TRANSCODE_CHUNK_BYTES  # noqa: E402
from kvpolicy.policy.layouts import Layout  # noqa: E402
from kvpolicy.policy.releases import get_profile  # noqa: E402
from kvpolicy.policy.spec import KVCacheSpec  # noqa: E402

# (key suffix, kv_cache_dtype, source (profile, layout), target (profile, layout))
CASES = [
    ("bf16", "auto", ("issue-48412", Layout.BLNHC), ("vllm-0.34", Layout.LBHNC)),
    ("int8", "int8_per_token_head", ("vllm-0.28", Layout.LBNHC), ("vllm-0.34", Layout.LBHNC)),
]


def _cache(profile: str, layout: Layout, kv_cache_dtype: str, num_blocks: int, device: torch.device) -> KVCache:
    spec = KVCacheSpec(num_layers=LAYERS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                       kv_cache_dtype=kv_cache_dtype)
    return allocate(plan_layout(layout, spec, get_profile(profile).backend("TRITON_ATTN"), num_blocks), device)


def run(quick: bool = False, device: str | torch.device = "cpu") -> dict[str, float]:
    dev = resolve_device(device)
    sync = _sync(dev)
    rounds = 5 if quick else 15
    n = 32 if quick else 128
    gen = torch.Generator().manual_seed(24)
    ids = torch.randperm(n + n // 4, generator=gen)[:n]
    out: dict[str, float] = {}
    for short, dtype, (src_profile, src_layout), (dst_profile, dst_layout) in CASES:
        src = _cache(src_profile, src_layout, dtype, n, dev)
        chunk = max(1, TRANSCODE_CHUNK_BYTES // src.plan.block_row_bytes)  # the blocks a restore stages at once
        dst = _cache(dst_profile, dst_layout, dtype, n + n // 4, dev)
        for r in src.raw:
            r.random_(0, 256)
        foreign = src.offload(torch.arange(n))
        dst.restore(ids, foreign)
        own = dst.offload(ids)  # the same cells in the target's own format
        if own.data.shape != foreign.data.shape:
            raise AssertionError("the two restores must move the same bytes")
        t_trans, t_plain, ratio = _compare(lambda d=dst, b=foreign: d.restore(ids, b),
                                           lambda d=dst, b=own: d.restore(ids, b), rounds, warmup=1, sync=sync)
        out[f"restore_transcode_{short}_vs_plain"] = 1 / ratio  # a time ratio: lower is better
        out[f"transcode_{short}_gbps"] = own.nbytes / t_trans / 1e9
        out[f"restore_plain_{short}_gbps"] = own.nbytes / t_plain / 1e9
        if not torch.equal(dst.offload(ids).data, own.data):
            raise AssertionError("the transcoding restore and the plain one left different bytes")
        rows = foreign.data.to(dev).view(n, -1)[:chunk]
        flat, staged = torch.empty_like(rows), torch.empty_like(rows)
        fmts = (foreign.format, dst.block_format)
        _, _, ratio = _compare(lambda r=rows, o=staged, fm=fmts: transcode_into(r, *fm, o),
                               lambda r=rows, f=flat: f.copy_(r), rounds * 4, warmup=1, sync=sync)
        out[f"transcode_{short}_vs_copy"] = 1 / ratio
        del src, dst, foreign, own, rows, flat
    return out


KEYS = [
    ("restore_transcode_bf16_vs_plain", "restore 128 bf16 blocks, BLNHC (issue-48412) -> LBHNC (vllm-0.34), "
     "vs plain restore (time)"),
    ("restore_transcode_int8_vs_plain", "restore 128 int8 per-token-head blocks, LBNHC (vllm-0.28) -> LBHNC "
     "(vllm-0.34), vs plain restore (time)"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 blocks and fewer rounds")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    args = parser.parse_args(argv)
    with torch.no_grad():
        results = run(args.quick, args.device)
    print("| what | ratio | better |\n|---|---|---|")
    for key, what in KEYS:
        print(f"| {what} (`{key}`) | {results[key]:.2f}x | lower |")
    print("\ncontext: " + ", ".join(f"{k}={v:.3g}" for k, v in results.items() if k not in dict(KEYS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
