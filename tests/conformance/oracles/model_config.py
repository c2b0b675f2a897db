"""Model configs as a vLLM release reads them: the KV cache specs and groups its engine builds.

Runs under one installed release (PYTHONPATH = its site), one JSON list of cases on stdin, one
JSON result per case on stdout (`vllm_release.run_oracle`). Any release from 0.28 on: what
differs is asked of the release (which functions it has), never branched on a version.

A case::

    {"config": {...config.json...}, "tensor_parallel_size": 1, "dtype": "auto",
     "kv_cache_dtype": "auto", "block_size": 16}

The config is written to a fresh local directory (the corpus file's content travels in the case,
so a changed file is a changed case) and read as an operator's ``vllm serve <dir>`` would, with
``HF_HUB_OFFLINE=1`` and ``trust_remote_code`` off. The path, each stage vLLM's own code:

1. the engine arguments of ``vllm serve dir --dtype .. --kv-cache-dtype .. --block-size ..
   --tensor-parallel-size .. --load-format dummy --skip-tokenizer-init`` (the release's
   ``AsyncEngineArgs``); their ``create_model_config()``: the served dtype (``--dtype auto`` rules,
   float32 downcast included), architecture resolution, HF config parsing;
2. their ``create_engine_config()``, as the server builds its VllmConfig: the CacheConfig the engine
   derives (``CacheConfig.sliding_window`` = ``ModelConfig.get_sliding_window()`` for a text config
   without per-layer ``layer_types``: Mistral-7B-v0.1's and Phi-3's layers are all sliding; ``auto``
   KV cache dtype resolved), then VllmConfig's post-init: the model's config hooks
   (``MODELS_CONFIG_MAP``, the hybrid Mamba page alignment that may raise the attention block size);
3. the model class, instantiated as a worker does (``model_loader.utils.initialize_model``) under
   ``set_default_torch_dtype(model dtype)`` on the ``meta`` device: every attention / Mamba layer
   registers in the config's static forward context with its own spec parameters;
4. the executor's step after the workers load the model: ``update_block_size_for_backend(vllm_config)``
   (vLLM's base ``Platform``'s, which the CUDA platform inherits): the backends' preferred block size
   without ``--block-size``, and for a hybrid attention + Mamba model the attention block size raised
   until a page holds a Mamba state, the Mamba page padded to it (``_align_hybrid_block_size``);
5. ``v1/worker/gpu/attn_utils.get_kv_cache_spec(vllm_config)``: each layer's ``get_kv_cache_spec``
   plus the backend's customisation (the runner's code);
6. the engine core's grouping: ``get_global_kv_cache_groups`` where the release has it (0.34's
   ``kv_cache_planning``), else ``kv_cache_utils.get_kv_cache_groups`` over the merged specs
   after the release's own registry check (0.28's ``get_kv_cache_configs`` steps 1-2).

Answer: ``{"path": "instantiated", "served_dtype", "block_size", "aligned_block_size",
"mamba_page_size_padded", "mamba_cache_mode", "max_model_len", "specs": [distinct
spec dicts], "layers": [[name, spec index], ...], "groups": [{"layers": [...], "spec": {...}}],
"model_config": {ModelConfig's own view}, "warnings": [...]}``. A stage vLLM refuses answers
``{"error": "Type: message", "stage": ...}`` plus what the earlier stages gave. When only the
model class cannot be built here (stage "model"), ``model_config`` still carries ModelConfig's own
methods (``get_num_kv_heads(parallel_config)``, ``get_head_size``, ``get_sliding_window``,
``get_num_layers_by_block_type``, ``is_hybrid``, ``use_mla``): the fallback the test reports as such.

The host is `_host.HOST` whatever machine runs this (`_host.pin_host`): vLLM picks the MoE kernels of
a model by the CPU's ISA (gpt-oss's MXFP4 experts: none without AMX, so the model would not be built on an
AMD EPYC), reads the architecture for its activation ops, and probes optional packages.

STAND-INs, each needed only because this runs on a CPU without the CUDA stack:
  * the platform's ``check_and_update_config`` is a no-op while VllmConfig is built (the CPU
    platform demands triton-cpu and rewrites the cache config for CPU serving), as in v034.py;
  * distributed state: one gloo process (world size 1) whose tensor-parallel group answers the
    case's ``tensor_parallel_size`` as its world size, rank 0. Model construction only reads the
    size to split heads; no collective runs on the meta device;
  * weights live on the ``meta`` device: shapes and layer parameters are real, no memory is used;
  * torchvision and compressed-tensors, where not installed (the release sites leave them out:
    torchvision's index builds are CUDA ones that break ``import vllm`` next to a CPU torch),
    are inert stub module trees (`stub_missing_packages`): model, quantization and multimodal modules
    import names from them at import time; where one is called, the case answers the error;
  * the model registry inspects model classes in this process (`inspect_in_process`);
  * ``torch.ops._C``, where vLLM's compiled extension cannot load, answers placeholders, refusing to
    run, for the activation ops 0.28's layers look up at construction (`placeholder_compiled_ops`);
  * attention layers get the CUDA platform's Triton backends, TRITON_ATTN or TRITON_MLA
    (`triton_attention_backends`): the CPU platform's would answer for a CPU deployment (no fp8 MLA
    cache, no page padding for hybrid models). The backend customises pages and the layouts the
    KV cache layout is resolved among, never a layer's kind, heads, head size or dtype.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import traceback
import types

# stdout carries only the JSON answer: route everything else printed to fd 1 to stderr.
_ANSWER = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
from _common import answer_cases, captured_warnings, gpu_platform_config  # noqa: E402
from _host import pin_host  # noqa: E402

pin_host()  # before vLLM reads the machine: the MoE kernels it picks follow the CPU's ISA (see _host.py)


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls  # an enum member, a nested class: more of the same inert placeholder


class _Inert(metaclass=_AnyMeta):
    """Any name of the stubbed package: a class whose attributes are itself (never called here)."""

    def __init__(self, *args, **kwargs):
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _AnyMeta(name, (_Inert,), {})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in _STUBBED_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


# vLLM dependencies the release sites leave out (install_vllm.py pins what the other oracles import):
# torchvision (its index builds are CUDA ones that break `import vllm` next to a CPU torch) and
# compressed-tensors: model and quantization modules import names from them at import time. (Llava's
# module also needs openai, openai-harmony and mistral-common, whose types pydantic builds schemas
# from: no inert stub can stand in for them, so Llava answers the inspection error.)
_STUBBED_PACKAGES: set[str] = set()


def stub_missing_packages() -> None:
    """STAND-IN: the packages above, where missing, served as inert stubs, and only once vLLM's config
    modules are imported (transformers' availability checks, made at its import, still see no
    torchvision and take their torchvision-free paths)."""
    for root in ("torchvision", "compressed_tensors"):
        try:
            importlib.import_module(root)
        except ImportError:
            _STUBBED_PACKAGES.add(root)
    if _STUBBED_PACKAGES and not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())

_DIRS: dict[str, str] = {}
_DIST: dict[str, object] = {}


# The ops activation layers look up at construction (``self.op = torch.ops._C.<name>`` in 0.28's
# model_executor/layers/activation.py). Only these: other code asks `hasattr(torch.ops._C, ...)`
# to choose a path, and must keep hearing no.
_CONSTRUCTION_OPS = {"activation_lut_bf16", "fatrelu_and_mul", "gelu_and_mul", "gelu_fast", "gelu_new", "gelu_quick",
                     "gelu_tanh", "gelu_tanh_and_mul", "mul_and_silu", "relu_squared", "silu_and_mul",
                     "silu_and_mul_with_clamp", "situ_and_mul"}


class _PlaceholderOps:
    """Stands for ``torch.ops._C``: the construction ops give a function that refuses to run."""

    def __getattr__(self, name):
        if name not in _CONSTRUCTION_OPS:
            raise AttributeError(name)

        def op(*args, **kwargs):
            raise RuntimeError(f"torch.ops._C.{name} is a placeholder (vLLM's compiled ops are not loadable here)")

        return op


def placeholder_compiled_ops() -> None:
    """STAND-IN: where vLLM's compiled extension cannot load (a CUDA build on a machine without CUDA),
    ``torch.ops._C`` answers placeholders for the activation ops (only those) that 0.28's layers look
    up at construction; a model on the meta device never runs one."""
    try:
        import vllm._C  # noqa: F401
    except ImportError:
        torch.ops._C = _PlaceholderOps()


def triton_attention_backends() -> None:
    """STAND-IN: attention layers get the CUDA platform's Triton backends (TRITON_MLA for MLA layers,
    TRITON_ATTN for the rest) instead of the CPU platform's. A GPU deployment is what is decided for:
    the CPU backends refuse fp8 MLA caches and do not index KV by block stride, so vLLM cannot pad
    a hybrid model's attention pages to the Mamba page with them; the Triton ones run on every
    CUDA GPU, index by block stride, and change no layer kind, head count, head size or dtype."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def choose(selected_backend, attn_selector_config, *args, **kwargs):
        name = "TRITON_MLA" if attn_selector_config.use_mla else "TRITON_ATTN"
        return AttentionBackendEnum[name].get_path()

    current_platform.get_attn_backend_cls = choose


def inspect_in_process() -> None:
    """STAND-IN: the model registry inspects a model class in this process, not in a child
    (``registry._run_in_subprocess``, there to keep CUDA uninitialised in the parent: there is no
    CUDA here). The child would not see the torchvision stand-in, and each costs a vLLM import."""
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()


def config_dir(config: dict) -> str:
    """A local model directory holding exactly this config.json (one per distinct config)."""
    key = json.dumps(config, sort_keys=True)
    if key not in _DIRS:
        root = tempfile.mkdtemp(prefix="kvpolicy-model-config-")
        with open(os.path.join(root, "config.json"), "w") as f:
            f.write(key)
        _DIRS[key] = root
    return _DIRS[key]


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 600 else text[:597] + "..."


def _jsonable(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "name", None) or str(value)


_SPEC_FIELDS = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window",
                "attention_chunk_size", "shapes", "dtypes", "mamba_type", "page_size_padded", "kv_quant_mode",
                "cache_dtype_str", "dcp_sharded")


def spec_dict(spec) -> dict:
    """A spec as JSON: its class, the fields the comparison reads (those the class has), its page."""
    out = {"type": type(spec).__name__}
    for name in _SPEC_FIELDS:
        if hasattr(spec, name):
            out[name] = _jsonable(getattr(spec, name))
    try:
        out["page_size_bytes"] = int(spec.page_size_bytes)
    except Exception as exc:  # a spec whose page vLLM cannot size here says why
        out["page_size_bytes"] = _error(exc)
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        out["kv_cache_specs"] = {k: spec_dict(v) for k, v in spec.kv_cache_specs.items()}
    return out


def model_config_view(mc, parallel_config) -> dict:
    """ModelConfig's own answers (the fallback path when the model class cannot be built)."""
    view: dict = {"architecture": getattr(mc, "architecture", None), "dtype": _jsonable(mc.dtype)}
    calls = {
        "is_hybrid": lambda: mc.is_hybrid,
        "use_mla": lambda: mc.use_mla,
        "is_attention_free": lambda: mc.is_attention_free,
        "total_num_kv_heads": mc.get_total_num_kv_heads,
        "num_kv_heads": lambda: mc.get_num_kv_heads(parallel_config),
        "head_size": mc.get_head_size,
        "sliding_window": mc.get_sliding_window,
        "num_layers": lambda: mc.get_num_layers(parallel_config),
        "attention_layers": lambda: mc.get_num_layers_by_block_type(parallel_config, "attention"),
        "max_model_len": lambda: mc.max_model_len,
    }
    for key, call in calls.items():
        try:
            view[key] = _jsonable(call())
        except Exception as exc:
            view[key] = {"error": _error(exc)}
    return view


def model_parallel_groups(vllm_config) -> None:
    """One gloo process (world size 1, once), then this config's model parallel groups of size 1:
    rebuilt per case, because which groups exist follows the model (the expert-parallel group
    only for MoE models, as a worker builds them from its own config)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(vllm_config):
        if not _DIST:
            store = tempfile.mkdtemp(prefix="kvpolicy-gloo-")
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{store}/init", backend="gloo")
            _DIST["done"] = True
        destroy_model_parallel()
        initialize_model_parallel(1, 1)


@contextlib.contextmanager
def tensor_parallel_size(tp: int):
    """STAND-IN: the tensor-parallel group reports ``tp`` ranks (this process is rank 0)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    saved = group.world_size
    group.world_size = tp
    try:
        yield
    finally:
        group.world_size = saved


def resolve_layout(vllm_config, specs):
    """The KV cache layout, resolved as the engine core does before grouping (0.29 on: its
    packed grouping reads it), from the layers' own backends (what each worker reports); None
    where the release has no layout resolution (0.28)."""
    try:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    except ImportError:
        return None
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config)  # what worker_base reports
    supported = [[layout.name for layout in get_supported_kv_cache_layouts(backends)]]
    return resolve_kv_cache_layout(vllm_config, supported, list(specs.values())).name


def group_layers(vllm_config, specs):
    """The engine core's grouping of the whole model's layers, as this release does it."""
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    except ImportError:
        get_global_kv_cache_groups = None
    if get_global_kv_cache_groups is not None:
        return get_global_kv_cache_groups(vllm_config, [dict(specs)])
    from vllm.v1.core import kv_cache_utils

    merged = dict(specs)
    registry = getattr(kv_cache_utils, "KVCacheSpecRegistry", None)
    if registry is not None:
        registry.check_kv_cache_spec_registry(merged)
    return kv_cache_utils.get_kv_cache_groups(vllm_config, merged)


def align_block_size(vllm_config) -> None:
    """The executor's step after the workers load the model (``uniproc_executor``, ``multiproc_executor``:
    ``current_platform.update_block_size_for_backend(vllm_config)``): the backends' preferred block size
    where ``--block-size`` is not given, then, for hybrid attention + Mamba models, the attention block
    size raised until its page holds a Mamba state, and the Mamba page padded to it
    (``_align_hybrid_block_size``). Called on vLLM's base ``Platform`` class: the CUDA platform
    inherits the method unchanged (the CPU platform, this process's, overrides it for CPU serving)."""
    from vllm.platforms.interface import Platform

    Platform.update_block_size_for_backend(vllm_config)


def serve_engine_args(case: dict):
    """The engine arguments ``vllm serve <dir> --dtype .. --kv-cache-dtype .. --block-size ..
    --tensor-parallel-size .. --load-format dummy --skip-tokenizer-init`` makes (the release's own
    ``AsyncEngineArgs``). Its ``create_engine_config`` builds the VllmConfig as the server does,
    CacheConfig included: the engine, not CacheConfig's defaults, sets ``CacheConfig.sliding_window``
    to ``ModelConfig.get_sliding_window()`` when the text config has no per-layer ``layer_types``
    (Mistral-7B-v0.1, Phi-3: every layer sliding), and resolves ``--kv-cache-dtype auto``."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = {"model": config_dir(case["config"]), "dtype": case.get("dtype", "auto"),
              "kv_cache_dtype": case.get("kv_cache_dtype", "auto"),
              "tensor_parallel_size": int(case.get("tensor_parallel_size", 1)),
              "skip_tokenizer_init": True, "trust_remote_code": False, "load_format": "dummy"}
    if case.get("block_size") is not None:
        kwargs["block_size"] = case["block_size"]
    return AsyncEngineArgs(**kwargs)


def answer(case: dict) -> dict:
    from vllm.config import ParallelConfig
    from vllm.usage.usage_lib import UsageContext

    stub_missing_packages()
    inspect_in_process()
    placeholder_compiled_ops()
    triton_attention_backends()

    tp = int(case.get("tensor_parallel_size", 1))
    out: dict = {"path": "instantiated"}
    with captured_warnings() as warnings:
        out["warnings"] = warnings
        args = serve_engine_args(case)
        try:
            mc = args.create_model_config()
        except Exception as exc:
            return {**out, "path": "refused", "stage": "model_config", "error": _error(exc)}
        out["served_dtype"] = _jsonable(mc.dtype)
        out["model_config"] = model_config_view(mc, ParallelConfig(tensor_parallel_size=tp))
        try:
            with gpu_platform_config():
                vc = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        except Exception as exc:
            traceback.print_exc()
            return {**out, "path": "refused", "stage": "vllm_config", "error": _error(exc)}
        out["block_size"] = vc.cache_config.block_size
        out["max_model_len"] = vc.model_config.max_model_len
        out["model_config"] = model_config_view(vc.model_config, vc.parallel_config)
        try:
            model_parallel_groups(vc)
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.utils import initialize_model
            from vllm.utils.torch_utils import set_default_torch_dtype

            with tensor_parallel_size(tp), set_default_torch_dtype(mc.dtype), torch.device("meta"):
                initialize_model(vc)
        except Exception as exc:
            traceback.print_exc()
            return {**out, "path": "model_config_only", "stage": "model", "error": _error(exc)}
        try:
            with tensor_parallel_size(tp):
                align_block_size(vc)
        except Exception as exc:
            traceback.print_exc()
            return {**out, "path": "model_config_only", "stage": "block_size", "error": _error(exc)}
        out["aligned_block_size"] = vc.cache_config.block_size
        out["mamba_page_size_padded"] = vc.cache_config.mamba_page_size_padded
        out["mamba_cache_mode"] = _jsonable(getattr(vc.cache_config, "mamba_cache_mode", None))
        try:
            from vllm.config import set_current_vllm_config
            from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

            with tensor_parallel_size(tp), set_current_vllm_config(vc):
                specs = get_kv_cache_spec(vc)
        except Exception as exc:
            traceback.print_exc()
            return {**out, "path": "model_config_only", "stage": "specs", "error": _error(exc)}
        distinct: list[dict] = []
        layers = []
        for name, spec in specs.items():
            d = spec_dict(spec)
            if d not in distinct:
                distinct.append(d)
            layers.append([name, distinct.index(d)])
        out["specs"], out["layers"] = distinct, layers
        try:
            with set_current_vllm_config(vc):
                out["kv_cache_layout"] = resolve_layout(vc, specs)
                groups = group_layers(vc, specs)
        except Exception as exc:
            traceback.print_exc()
            return {**out, "stage": "groups", "error": _error(exc)}
        out["groups"] = [{"layers": list(g.layer_names), "spec": spec_dict(g.kv_cache_spec)} for g in groups]
    return out


def handle(case: dict) -> dict:
    result = answer(case)
    result["warnings"] = [w if len(w) <= 300 else w[:297] + "..." for w in result.get("warnings", [])[:20]]
    return result


if __name__ == "__main__":
    answer_cases(handle, _ANSWER)
