"""Oracle for the kvpolicy vLLM plugin under vLLM 0.28.0 (run UNDER the release, never in-process).

PYTHONPATH is kvpolicy's installed site (a wheel of the checkout, see ../plugin_site.py) in
front of vLLM's. stdin: JSON list of cases; stdout: one JSON result per case; logs on stderr.
Case kinds:

  {"facts": true}                 v028.py's facts (the backends' stride orders, to read layouts off)
  {"plugin": {"env": {...}, "log_level": "INFO", "version": "0.99.0"}}
      sets exactly these KVPOLICY_* / VLLM_PLUGINS variables, clears vLLM's "plugins loaded"
      flag and calls vLLM's own ``vllm.plugins.load_general_plugins()``; answers the entry
      points vLLM sees, whether ``GPUModelRunner.use_uniform_kv_cache`` (what the runner's
      ``self.use_uniform_kv_cache`` resolves to) is still vLLM's, the plugin's ``status()``,
      its log lines, or the error that stopped start-up. "version" replaces ``vllm.__version__``
      (what the plugin reads to pick a profile), to see another release handled.
  {"gate": <a v028 gate case>, "baseline": bool, "log": bool}
      v028.py's gate inputs (real VllmConfig and ModelConfig, layer specs through vLLM's
      ``get_kv_cache_spec``, ``AttentionGroup``s, the connector vLLM's factory loads for the
      config, installed where ``get_kv_transfer_group()`` finds it), then
      ``GPUModelRunner.use_uniform_kv_cache(attn_groups)`` and, with "baseline", vLLM's own gate
      saved before any plugin was loaded; each with ``get_kv_cache_layout()`` (the head order).
  {"runner": <a v028 gate case>}
      vLLM's ``GPUModelRunner.initialize_kv_cache_tensors`` on those inputs: which allocation it
      takes (``allocate_uniform_kv_caches``: cross-layer; ``_allocate_kv_cache_tensors``: per layer).

Stand-ins, each only because this runs on a CPU without the CUDA stack: v028.py's (attention
layers, attention groups, connectors built with ``__new__`` + vLLM's base ``__init__``, tiny
ModelConfig, the flashinfer stub), and for "runner" the runner object (``__new__`` plus the
three attributes the method reads before it allocates: ``cache_config``, ``attn_groups``,
``device``) whose two allocation methods record which one is called and stop there (the
real ones allocate the whole cache).
"""

from __future__ import annotations

import logging
import os
import sys
from importlib.metadata import entry_points

import v028
import vllm
import vllm.plugins
from _common import answer_cases
from v028 import (
    KVConnectorFactory,
    _build_model,
    _facts,
    _make_connector,
    _set_env_layout,
    _vllm_config,
    backend_utils,
    kv_transfer_state,
    set_current_vllm_config,
)
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

# vLLM's own gate, before any plugin: the baseline.
REAL_VERSION = vllm.__version__
ORIGINAL = KVConnectorModelRunnerMixin.__dict__["use_uniform_kv_cache"].__func__
assert GPUModelRunner.use_uniform_kv_cache is ORIGINAL
LOGGERS = ("vllm.kvpolicy", "kvpolicy")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


_LOG = _Lines()
for _name in LOGGERS:
    logging.getLogger(_name).addHandler(_LOG)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def load_plugins(case: dict) -> dict:
    for name in [k for k in os.environ if k.startswith("KVPOLICY_")] + ["VLLM_PLUGINS"]:
        os.environ.pop(name, None)
    os.environ.update(case["plugin"].get("env", {}))
    vllm.envs.disable_envs_cache()
    for name in LOGGERS:
        logging.getLogger(name).setLevel(case["plugin"].get("log_level", "INFO"))
    vllm.__version__ = case["plugin"].get("version", REAL_VERSION)
    _LOG.lines.clear()
    vllm.plugins.plugins_loaded = False
    error = None
    try:
        vllm.plugins.load_general_plugins()
    except Exception as exc:
        error = _err(exc)
    module = sys.modules.get("kvpolicy.engine.integrations.vllm_plugin")
    gate = GPUModelRunner.use_uniform_kv_cache
    return {
        "error": error,
        "entry_points": [{"name": ep.name, "value": ep.value, "dist": str(getattr(ep.dist, "_path", ""))}
                         for ep in entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP)],
        "module_file": getattr(module, "__file__", None),
        "gate_is_vllms": gate is ORIGINAL,
        "gate_id": id(gate),
        "status": module.status() if module is not None else None,
        "patches": len(module._state["patches"]) if module is not None else None,
        "log": list(_LOG.lines),
    }


def _answer(fn, attn_groups) -> dict:
    try:
        return {"uniform": bool(fn(attn_groups)), "head_order": backend_utils.get_kv_cache_layout()}
    except Exception as exc:
        return {"error": _err(exc)}


def _with_inputs(case: dict, body):
    """v028.py's gate set-up (VllmConfig, model, connector as the process-wide agent), then ``body``."""
    _set_env_layout(case.get("VLLM_KV_CACHE_LAYOUT"))
    try:
        vc = _vllm_config(case, with_model=True)
        with set_current_vllm_config(vc):
            kv_cache_config, attn_groups = _build_model(case, vc)
            conn = None
            if vc.kv_transfer_config is not None:
                conn = _make_connector(KVConnectorFactory.get_connector_class(vc.kv_transfer_config), vc,
                                       kv_cache_config)
            kv_transfer_state._KV_CONNECTOR_AGENT = conn
            return body(vc, kv_cache_config, attn_groups)
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        _set_env_layout(None)


def gate(case: dict) -> dict:
    def body(vc, kv_cache_config, attn_groups):
        out = {}
        if case.get("baseline"):
            out["vllm"] = _answer(ORIGINAL, attn_groups)
        _LOG.lines.clear()
        out["plugin"] = _answer(GPUModelRunner.use_uniform_kv_cache, attn_groups)
        if case.get("log"):
            out["log"] = list(_LOG.lines)
        return out

    try:
        return _with_inputs(case["gate"], body)
    except Exception as exc:  # refused before the gate (VllmConfig, the model's specs, the connector)
        refused = {"error": _err(exc), "before": True}
        return {"vllm": refused, "plugin": refused} if case.get("baseline") else {"plugin": refused}


class _Allocated(Exception):
    pass


def runner(case: dict) -> dict:
    """STAND-IN runner: see the module docstring."""

    def body(vc, kv_cache_config, attn_groups):
        taken = []

        def record(name):
            def allocate(*args, **kwargs):
                taken.append(name)
                raise _Allocated

            return allocate

        obj = GPUModelRunner.__new__(GPUModelRunner)
        obj.cache_config = vc.cache_config
        obj.attn_groups = attn_groups
        obj.device = "cpu"
        obj.allocate_uniform_kv_caches = record("cross_layer")
        obj._allocate_kv_cache_tensors = record("per_layer")
        try:
            obj.initialize_kv_cache_tensors(kv_cache_config, [16] * len(attn_groups))
        except _Allocated:
            pass
        return {"allocation": taken[0] if taken else None}

    try:
        return _with_inputs(case["runner"], body)
    except Exception as exc:
        return {"error": _err(exc)}


def handle(case: dict) -> dict:
    if case.get("facts"):
        return _facts(case)
    if "plugin" in case:
        return load_plugins(case)
    if "gate" in case:
        return gate(case)
    if "runner" in case:
        return runner(case)
    raise ValueError(f"unknown case kind: {sorted(case)}")


def main() -> None:
    answer_cases(handle, v028._STDOUT, lambda exc: {"error": _err(exc), "oracle": True})


if __name__ == "__main__":
    main()
