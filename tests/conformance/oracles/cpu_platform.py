"""Oracle: the attention backend vLLM's CPU platform selects.

Case ``{"mla": bool, "kv_cache_dtype": str | None, "selected": str | None, "amx": bool}`` -> ``{"backend":
name}``, the `AttentionBackendEnum` member whose path ``vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls``
returns for an ``AttentionSelectorConfig`` built as ``vllm.v1.attention.selector.get_attn_backend`` builds it
(head size 64, bfloat16, the case's kv_cache_dtype, no user block size, MLA or not; every other field its
default), with ``selected`` the configured backend (``--attention-backend``) or None; or ``{"error": "Type:
msg"}`` where vLLM refuses. Runs under every release 0.24.0 on.

STAND-IN: the host. ``CpuPlatform.get_cpu_architecture`` answers x86, ``torch.cpu._is_amx_tile_supported``
the case's ``amx`` (0.29 on, MLA prefers AMX_MLA with AMX tiles), and ``torch.cpu._is_avx512_supported``
true (0.33 on, CPU_ATTN's fp8 needs AVX-512 or AMX: a host that has it).
"""

from __future__ import annotations

import json
import sys

import torch
from _host import pin_host

pin_host()  # the rest of the machine is _host.HOST; each case answers AMX, as below

from vllm.platforms.cpu import CpuArchEnum, CpuPlatform  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

CpuPlatform.get_cpu_architecture = classmethod(lambda cls: CpuArchEnum.X86)  # STAND-IN: see the docstring
torch.cpu._is_avx512_supported = lambda: True

paths = {}
for member in AttentionBackendEnum:
    try:
        paths[member.get_path()] = member.name
    except Exception:  # a member with no registered class path
        pass

out = []
for case in json.load(sys.stdin):
    torch.cpu._is_amx_tile_supported = lambda amx=case["amx"]: amx
    config = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype=case["kv_cache_dtype"],
                                     block_size=None, use_mla=case["mla"])
    selected = AttentionBackendEnum[case["selected"]] if case["selected"] else None
    try:
        path = CpuPlatform.get_attn_backend_cls(selected, config)
        out.append({"backend": paths.get(path, path)})
    except Exception as exc:  # vLLM refuses: NotImplementedError (MLA before 0.28), ValueError (dtype, 0.33 on)
        out.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(out))
