"""Oracle: the model architectures a vLLM release no longer serves, from its own model registry.

Case ``{"previously_supported": true}`` -> ``{"version": vllm.__version__, "previously_supported":
{architecture: version}}``: ``vllm/model_executor/models/registry.py``'s ``_PREVIOUSLY_SUPPORTED_MODELS``
as the release imports it, each architecture with the last vLLM version that served it (the registry's
``_raise_for_unsupported`` says "was supported in vLLM until v<version>, and is not supported anymore").
Runs under every release 0.24.0 on; imports only the registry module (no platform is resolved, no model
is built), so it needs no stand-in.
"""

from __future__ import annotations

import os
import sys

# stdout carries only the JSON answer: route everything else printed to fd 1 to stderr.
_ANSWER = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

from _common import answer_cases  # noqa: E402
from _host import pin_host  # noqa: E402

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)


def handle(case: dict) -> dict:
    if not case.get("previously_supported"):
        raise ValueError(f"unknown case {case}")
    import vllm
    from vllm.model_executor.models import registry

    previously = registry._PREVIOUSLY_SUPPORTED_MODELS
    return {"version": vllm.__version__, "previously_supported": dict(sorted(previously.items()))}


if __name__ == "__main__":
    answer_cases(handle, _ANSWER)
