"""Oracle for the kvpolicy vLLM plugin under vLLM 0.34.0 (run UNDER the release, never in-process).

PYTHONPATH is kvpolicy's installed site (a wheel of the checkout, see ../plugin_site.py) in
front of vLLM's. stdin: JSON list of cases; stdout: one JSON result per case (v034's answer
stream); vLLM's and kvpolicy's logs on stderr. Case kinds:

  {"plugin": {"env": {...}, "log_level": "INFO", "version": "0.99.0"}}
      sets exactly these KVPOLICY_* / VLLM_PLUGINS variables, clears vLLM's "plugins loaded"
      flag and calls vLLM's own ``vllm.plugins.load_general_plugins()`` (which discovers
      kvpolicy through its entry point and calls it); answers what is installed: the entry
      points vLLM sees (name, value, the dist-info they come from), whether the engine core's
      ``resolve_kv_cache_layout`` is still vLLM's, the plugin's ``status()``, its log lines,
      or the error that stopped start-up. "version" replaces ``vllm.__version__`` (what the plugin
      reads to pick a profile), to see an unsupported release handled.
  {"decide": <a v034 decision case>, "baseline": bool, "log": bool}
      the inputs of v034's decision case (VllmConfig, workers' reported layouts, specs through
      ``customize_attention_spec``), then ``vllm.v1.engine.core.resolve_kv_cache_layout`` (the name
      the engine core calls) and, with "baseline", vLLM's own function saved before any plugin
      was loaded, on the same objects. Each answer is a layout or the error ("before": refused
      before resolution, by VllmConfig or a worker whose backends share no layout, alike for
      both); the plugin's also
      the layout it recorded on ``cache_config.kv_cache_layout`` (where vLLM distributes it from).
  {"engine_core": <a v034 decision case>}
      vLLM's ``EngineCore._initialize_kv_caches`` itself, up to the ``set_kv_cache_layout`` RPC
      that sends the resolved layout to the workers: the layout that RPC carries.

Stand-ins, each needed only because this runs on a CPU without the CUDA stack: every one of
v034.py's (device capability, platform config, flashinfer stub, tiny ModelConfig, extensible
KV cache on a CUDA-like platform), plus for "engine_core" the model executor: an object with
the five methods ``_initialize_kv_caches`` calls before it distributes the layout
(``get_kv_cache_specs``, ``get_supported_kv_cache_layouts``, ``extensible_kv_cache_unsupported_reason``
answering None, ``set_kv_cache_layout``), since the real executor starts GPU workers; it
answers the same worker reports and specs the decision case builds. The EngineCore object is
made with ``__new__`` (its ``__init__`` starts the executor and the scheduler).
"""

from __future__ import annotations

import logging
import os
import sys
from importlib.metadata import entry_points

import v034
import vllm
import vllm.envs as envs
import vllm.plugins
from _common import answer_cases
from v034 import backend_class, build_spec, decision_config, device_capability, vllm_env
from vllm.v1.attention.backends import utils as backend_utils
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.engine import core as engine_core

REAL_VERSION = vllm.__version__
# vLLM's own resolver, before any plugin: the baseline.
ORIGINAL = backend_utils.resolve_kv_cache_layout
assert engine_core.resolve_kv_cache_layout is ORIGINAL

PLUGIN_LOGGER = "vllm.kvpolicy"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


_LOG = _Lines()
logging.getLogger(PLUGIN_LOGGER).addHandler(_LOG)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _plugin_module():
    return sys.modules.get("kvpolicy.engine.integrations.vllm_plugin")


def load_plugins(case: dict) -> dict:
    """vLLM's own plugin loading, with this case's environment."""
    for name in [k for k in os.environ if k.startswith("KVPOLICY_")] + ["VLLM_PLUGINS"]:
        os.environ.pop(name, None)
    os.environ.update(case["plugin"].get("env", {}))
    if envs._is_envs_cache_enabled():
        envs.disable_envs_cache()
    logging.getLogger(PLUGIN_LOGGER).setLevel(case["plugin"].get("log_level", "INFO"))
    # the version the plugin reads; a case may pretend to be another release (the only thing changed)
    vllm.__version__ = case["plugin"].get("version", REAL_VERSION)
    _LOG.lines.clear()
    vllm.plugins.plugins_loaded = False
    error = None
    try:
        vllm.plugins.load_general_plugins()
    except Exception as exc:
        error = _err(exc)
    module = _plugin_module()
    resolver = engine_core.resolve_kv_cache_layout
    return {
        "error": error,
        "entry_points": [{"name": ep.name, "value": ep.value, "dist": str(getattr(ep.dist, "_path", ""))}
                         for ep in entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP)],
        "module_file": getattr(module, "__file__", None),
        "core_is_vllms": resolver is ORIGINAL,
        "utils_is_core": backend_utils.resolve_kv_cache_layout is resolver,
        "wraps_vllms": getattr(resolver, "__wrapped__", None) is ORIGINAL,
        "resolver_id": id(resolver),
        "status": module.status() if module is not None else None,
        "patches": len(module._state["patches"]) if module is not None else None,
        "log": list(_LOG.lines),
    }


def _inputs(case: dict):
    supported = [[layout.name for layout in get_supported_kv_cache_layouts([backend_class(n) for n in names])]
                 for names in case["workers"]]
    first = backend_class(case["workers"][0][0]) if case["workers"] and case["workers"][0] else None
    specs = [build_spec(s, backend_class(s["backend"]) if s.get("backend") else first) for s in case.get("specs", [])]
    return supported, specs


def _call(fn, vllm_config, supported, specs) -> dict:
    vllm_config.cache_config.kv_cache_layout = None
    try:
        layout = fn(vllm_config, supported, specs)
    except Exception as exc:
        return {"error": _err(exc)}
    return {"layout": layout.name, "recorded": vllm_config.cache_config.kv_cache_layout}


def decide(case: dict) -> dict:
    inner = case["decide"]
    out: dict = {}
    with device_capability(inner.get("device_capability")):
        try:
            # refused before any resolution: by VllmConfig, or by a worker whose backends share no layout
            vllm_config = decision_config(inner)
            supported, specs = _inputs(inner)
        except Exception as exc:
            refused = {"error": _err(exc), "before": True}
            return {"vllm": refused, "plugin": refused} if case.get("baseline") else {"plugin": refused}
        with vllm_env(inner.get("VLLM_KV_CACHE_LAYOUT")):
            if case.get("baseline"):
                out["vllm"] = _call(ORIGINAL, vllm_config, supported, specs)
            _LOG.lines.clear()
            out["plugin"] = _call(engine_core.resolve_kv_cache_layout, vllm_config, supported, specs)
            if case.get("log"):
                out["log"] = list(_LOG.lines)
    vllm_config.cache_config.kv_cache_layout = None
    return out


class _Distributed(Exception):
    """Raised by the stand-in executor once the engine core hands the layout to the workers."""


class _Executor:
    """STAND-IN for the model executor (see the module docstring)."""

    def __init__(self, supported, specs, workers):
        self.supported = supported
        self.specs = [{f"model.layers.{i}.attn": s for i, s in enumerate(specs)} for _ in range(workers)]
        self.layout = None

    def get_kv_cache_specs(self):
        return self.specs

    def get_supported_kv_cache_layouts(self):
        return self.supported

    def extensible_kv_cache_unsupported_reason(self, kv_cache_specs):
        return None

    def set_kv_cache_layout(self, layout, *release_specific):
        # 0.34 also passes cp_kv_cache_interleave_size; 0.29-0.32 the layout alone: what the RPC carries
        # to the workers is the layout either way
        self.layout = layout
        raise _Distributed


def engine_core_case(case: dict) -> dict:
    inner = case["engine_core"]
    with device_capability(inner.get("device_capability")):
        try:
            vllm_config = decision_config(inner)
            supported, specs = _inputs(inner)
        except Exception as exc:
            return {"error": _err(exc), "before": True}
        executor = _Executor(supported, specs, len(supported))
        core = engine_core.EngineCore.__new__(engine_core.EngineCore)
        core.model_executor = executor
        vllm_config.cache_config.kv_cache_layout = None
        out: dict = {}
        with vllm_env(inner.get("VLLM_KV_CACHE_LAYOUT")):
            try:
                core._initialize_kv_caches(vllm_config)
            except _Distributed:
                pass
            except Exception as exc:
                out["error"] = _err(exc)
        out["distributed"] = executor.layout
        out["resolved"] = vllm_config.cache_config.kv_cache_layout
    vllm_config.cache_config.kv_cache_layout = None
    return out


def handle(case: dict) -> dict:
    if "plugin" in case:
        return load_plugins(case)
    if "decide" in case:
        return decide(case)
    if "engine_core" in case:
        return engine_core_case(case)
    raise ValueError(f"unknown case kind: {sorted(case)}")


def main() -> None:
    answer_cases(handle, v034._ANSWER, lambda exc: {"error": _err(exc), "oracle": True})


if __name__ == "__main__":
    main()
