"""Oracle: the ISA vLLM's CPU attention writes the KV cache with (``_get_attn_isa``).

Case ``{"dtype": str, "block_size": int, "head_size": int, "kv_cache_dtype": str | None, "arch": str,
"amx": bool, "avx512": bool, "rvv": bool}`` -> ``{"isa": name}``, what
``vllm.v1.attention.backends.cpu_attn._get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)``
returns, or ``{"error": "Type: msg"}`` where it refuses. Runs under every release 0.24.0 on.

STAND-IN: the host, every case its own. ``torch.cpu._is_amx_tile_supported`` and
``torch.cpu._is_avx512_supported`` answer the case's ``amx`` and ``avx512``,
``current_platform.get_cpu_architecture`` the case's ``arch`` (vLLM's ``CpuArchEnum`` member: X86,
ARM, POWERPC, S390X, RISCV), and ``_riscv_supports_rvv`` the case's ``rvv``: the function reads
nothing else of the machine, so each release answers for hosts this one is not.
"""

from __future__ import annotations

import json
import sys
import types

import torch
from _host import pin_host

pin_host()  # the rest of the machine is _host.HOST; each case answers the ISA and architecture below

from vllm.platforms.interface import CpuArchEnum  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

ARCHES = {"x86": CpuArchEnum.X86, "arm": CpuArchEnum.ARM, "power": CpuArchEnum.POWERPC,
          "s390x": CpuArchEnum.S390X, "riscv": CpuArchEnum.RISCV}

out = []
for case in json.load(sys.stdin):
    torch.cpu._is_amx_tile_supported = lambda v=case["amx"]: v
    torch.cpu._is_avx512_supported = lambda v=case["avx512"]: v
    cpu_attn.current_platform = types.SimpleNamespace(get_cpu_architecture=lambda a=ARCHES[case["arch"]]: a)
    cpu_attn._riscv_supports_rvv = lambda v=case["rvv"]: v
    try:
        isa = cpu_attn._get_attn_isa(getattr(torch, case["dtype"]), case["block_size"], case["head_size"],
                                     case["kv_cache_dtype"])
        out.append({"isa": isa})
    except Exception as exc:  # vLLM refuses: NotImplementedError (fp8 without AVX-512/AMX, head % 32)
        out.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(out))
