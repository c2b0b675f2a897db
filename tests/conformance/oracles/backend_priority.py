"""Oracle: the attention backends vLLM's CUDA platform tries, in order, with none configured.

Case ``{"mla": bool, "major": int}`` -> the names ``vllm.platforms.cuda._get_backend_priorities``
returns for that device capability (causal, no multimodal prefix, no kv_cache_dtype: the lists
kvpolicy's profiles hold as ``backend_priority``). Runs under any release that has the function
(0.28.0, 0.34.0).

STAND-IN: ``vllm._C_stable_libtorch`` and ``vllm._C`` are empty modules: ``platforms/cuda.py``
imports the compiled ops at import time, which need libcuda; the priority function never calls them.
"""

from __future__ import annotations

import json
import sys
import types

from _host import pin_host

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)

for _name in ("vllm._C_stable_libtorch", "vllm._C"):
    sys.modules.setdefault(_name, types.ModuleType(_name))

from vllm.platforms.cuda import _get_backend_priorities  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402

cases = json.load(sys.stdin)
print(json.dumps([[b.name for b in _get_backend_priorities(c["mla"], DeviceCapability(c["major"], 0))]
                  for c in cases]))
