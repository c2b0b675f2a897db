"""vLLM 0.34 oracle: run under the installed release (PYTHONPATH = its site).

Reads a JSON list of cases on stdin, writes one JSON result per case on stdout.
Case kinds (see notes/conformance-contract.md):
  {"facts": true}                  what the release declares (backends, dtypes, connectors)
  {"workers": [...], "specs": ...} a layout decision, by resolve_kv_cache_layout
  {"backend": ..., "layout": ...}  geometry, by vLLM's own allocation path
  {"geometry_sweep": {...}}        geometry of every backend x dtype x layout vLLM accepts

Everything is computed by vLLM's own functions and objects. Stand-ins, each needed
only because this runs on a CPU without the CUDA stack:
  * current_platform.get_device_capability: patched to the case's capability (the
    CPU platform has none); it is what backends read in supported_kv_cache_layouts.
  * current_platform.check_and_update_config: a no-op while VllmConfig is built. The
    CPU platform refuses to configure vLLM without triton-cpu, and the engine whose
    decision we reproduce runs on a GPU platform anyway. get_hisparse_backend_cls
    answers as the CUDA platform does, so hisparse configs validate.
  * flashinfer: the FLASHINFER backend module imports names from the flashinfer
    package at import time (a CUDA JIT package, not installed). A stub module tree,
    whose attributes are inert placeholders, is put in sys.modules only if the real
    import fails; none of it is called by supported_kv_cache_layouts/customize_spec.
  * model_config: a real ModelConfig built from a tiny local config.json (llama,
    or deepseek_v2 for use_mla), with no weights and no tokenizer.
  * VllmConfig._resolve_extensible_kv_cache: runs with current_platform.is_cuda_alike()
    answering True, as it does on the CUDA platform; the CPU platform refuses an
    explicitly requested enable_extensible_kv_cache ("only supported on CUDA and
    ROCm"). Every other check of that method runs unchanged.
  * the attention layer's model dtype for kv_cache_dtype "auto": kv_cache_dtype_str_to_dtype
    gets an object with only .dtype (the case's dtype), which is all it reads.
  * geometry's K/V split: the backend impl methods that split a cache
    (TritonAttentionImpl._ensure_scale_caches / _pth_key_value_caches) are called on
    a bare object carrying only the attributes they read, not a constructed impl.
  * geometry's "writes": each backend impl's own do_kv_cache_update (after the layer's
    own bind_kv_cache) runs on an impl built with __new__ plus the attributes it reads;
    the cache-write kernels it calls (reshape_and_cache_flash, the Triton and CPU ones,
    concat_and_cache_mla, flashinfer's nvfp4_quantize_append_paged_kv_cache_with_slot_mapping)
    are recorders of the K/V/scale tensors they are handed. FLASHINFER's NVFP4 impl is
    built as on SM80/90/120 (nvfp4_fa2), whose writer takes vLLM's `_nvfp4_kv_views`:
    the data and block-scale views its forward reads on every device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import sys
import tempfile
import types
import typing

# stdout carries only the JSON answer: route everything else printed to fd 1 to stderr.
_ANSWER = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
from _host import pin_host  # noqa: E402

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)
from _common import (  # noqa: E402
    STUBBED,
    answer_cases,
    backend_class,
    captured_warnings,
    device_capability,
    gpu_platform_config,
)

BACKENDS = ["TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLASHMLA", "TRITON_MLA", "FLEX_ATTENTION", "CPU_ATTN"]
CONNECTORS = [
    "NixlConnector",
    "OffloadingConnector",
    "MooncakeStoreConnector",
    "MooncakeConnector",
    "LMCacheConnectorV1",
    "MultiConnector",
    "HiSparseConnector",
]
CAPABILITIES = [None, (8, 0), (9, 0), (10, 0), (12, 0)]


# ---------------------------------------------------------------------------
# stand-ins
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def vllm_env(value):
    """VLLM_KV_CACHE_LAYOUT for this case; vllm.envs reads os.environ lazily."""
    import vllm.envs as envs

    old = os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    if value is not None:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = value
    if envs._is_envs_cache_enabled():
        envs.disable_envs_cache()
    try:
        yield
    finally:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        if old is not None:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = old


_MODEL_CONFIGS: dict[tuple[bool, bool], object] = {}

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
_DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "torch_dtype": "bfloat16",
}


def model_config(use_mla, hisparse=False):
    """A real ModelConfig from a tiny local config.json (no weights, no tokenizer):
    llama, or deepseek_v2 for use_mla; with index_topk (a DSA model) for hisparse."""
    key = (use_mla, hisparse)
    if key not in _MODEL_CONFIGS:
        from vllm.config import ModelConfig

        hf = dict(_DEEPSEEK if use_mla else _LLAMA)
        if hisparse:
            hf["index_topk"] = 64
        root = tempfile.mkdtemp(prefix="kvpolicy-oracle-model-")
        with open(os.path.join(root, "config.json"), "w") as f:
            json.dump(hf, f)
        mc = ModelConfig(model=root, skip_tokenizer_init=True, dtype="bfloat16")
        if mc.use_mla != use_mla:
            raise RuntimeError(f"tiny model config gives use_mla={mc.use_mla}, wanted {use_mla}")
        _MODEL_CONFIGS[key] = mc
    return _MODEL_CONFIGS[key]


@contextlib.contextmanager
def cuda_alike_extensible_kv_cache():
    """STAND-IN: VllmConfig settles enable_extensible_kv_cache as on a CUDA platform."""
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    original = getattr(VllmConfig, "_resolve_extensible_kv_cache", None)
    if original is None:  # 0.29-0.33: no extensible KV cache to settle
        yield
        return

    def resolve(self):
        saved = current_platform.__dict__.get("is_cuda_alike")
        current_platform.is_cuda_alike = lambda: True
        try:
            return original(self)
        finally:
            if saved is None:
                del current_platform.is_cuda_alike
            else:
                current_platform.is_cuda_alike = saved

    VllmConfig._resolve_extensible_kv_cache = resolve
    try:
        yield
    finally:
        VllmConfig._resolve_extensible_kv_cache = original


@contextlib.contextmanager
def cuda_for_hisparse():
    """STAND-IN: 0.30-0.33 refuse HiSparse unless ``current_platform.is_cuda()`` ("HiSparse currently
    requires NVIDIA CUDA"; 0.34 asks ``get_hisparse_backend_cls``, which `gpu_platform_config`
    answers): the platform says CUDA while VllmConfig is built, as on the deployments decided for.
    Its other is_cuda() branches read settings the oracle leaves at their defaults (TP 1, no
    batch invariance, no profiler)."""
    from vllm.platforms import current_platform

    if hasattr(type(current_platform), "get_hisparse_backend_cls"):
        yield
        return
    saved = current_platform.__dict__.get("is_cuda")
    current_platform.is_cuda = lambda: True
    try:
        yield
    finally:
        if saved is None:
            del current_platform.is_cuda
        else:
            current_platform.is_cuda = saved


@contextlib.contextmanager
def triton_present():
    """STAND-IN: VllmConfig sees Triton, as on the CUDA deployments decided for. HiSparse selects
    Model Runner V2, which 0.30-0.32 refuse without Triton ("Model Runner V2 requires Triton"); the
    release sites leave Triton out (`install_vllm.py`), so ``vllm.config.vllm.HAS_TRITON`` is False."""
    import vllm.config.vllm as config_module

    saved = getattr(config_module, "HAS_TRITON", None)
    if saved is None:
        yield
        return
    config_module.HAS_TRITON = True
    try:
        yield
    finally:
        config_module.HAS_TRITON = saved


def build_vllm_config(case, layout=None, num_blocks=None):
    from vllm.config import AttentionConfig, CacheConfig, KVTransferConfig, VllmConfig

    # enable_extensible_kv_cache is always given where CacheConfig has it (0.34: unset means "on where
    # supported", which a case's False must not become); a release without it (0.29-0.33) refuses the key.
    # 0.29's AttentionConfig has no hisparse_config either (`hisparse_config`).
    cache = {}
    if "enable_extensible_kv_cache" in {f.name for f in dataclasses.fields(CacheConfig)}:
        cache["enable_extensible_kv_cache"] = bool(case.get("enable_extensible_kv_cache", False))
    elif case.get("enable_extensible_kv_cache"):
        raise ValueError("this release's CacheConfig has no enable_extensible_kv_cache")
    if case.get("block_size") is not None:
        cache["block_size"] = case["block_size"]
    if num_blocks is not None:
        cache["num_gpu_blocks_override"] = num_blocks
    kv_transfer = case.get("kv_transfer_config")
    kwargs = dict(
        cache_config=CacheConfig(**cache),
        kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
        attention_config=AttentionConfig(**hisparse_config(case)),
    )
    if case.get("model_config", True):
        # HiSparse needs a DSA model (hf_config.index_topk); HiSparseConnector turns it on.
        dsa = bool(case.get("hisparse")) or "HiSparseConnector" in json.dumps(kv_transfer or {})
        kwargs["model_config"] = model_config(bool(case.get("use_mla", False)), dsa)
    with gpu_platform_config(), cuda_alike_extensible_kv_cache(), cuda_for_hisparse(), triton_present():
        vllm_config = VllmConfig(**kwargs)
    if layout is not None:
        # How a worker adopts the layout the engine core resolved.
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        record_kv_cache_layout(vllm_config.cache_config, layout)
    return vllm_config


def hisparse_config(case):
    if not case.get("hisparse"):
        return {}
    from vllm.config.attention import HiSparseConfig

    return {"hisparse_config": HiSparseConfig()}


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_spec(s, backend):
    """The layer's KV cache spec as vLLM's attention layers build it, then customized by
    the backend as the worker does (v1/worker/utils.customize_attention_spec)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        get_kv_quant_mode,
    )
    kind = s.get("kind", "full")
    if kind == "mamba":
        # A Mamba layer's state: one tensor of `state_elements` values (vLLM's MambaSpec;
        # Mamba layers have their own backends and no attention customization).
        return MambaSpec(
            block_size=s.get("block_size", 16),
            shapes=((s["state_elements"],),),
            dtypes=(TORCH_DTYPES[s.get("dtype", "bfloat16")],),
        )
    kv_cache_dtype = s.get("kv_cache_dtype", "auto")
    model_dtype = types.SimpleNamespace(dtype=TORCH_DTYPES[s.get("dtype", "bfloat16")])
    common = dict(
        block_size=s.get("block_size", 16),
        num_kv_heads=s.get("num_kv_heads", 8),
        head_size=s.get("head_size", 128),
        dtype=kv_cache_dtype_str_to_dtype(kv_cache_dtype, model_dtype),
        kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
        page_size_padded=s.get("page_size_padded"),
    )
    if "dcp_sharded" in {f.name for f in dataclasses.fields(FullAttentionSpec)}:  # 0.31 on
        common["dcp_sharded"] = s.get("dcp_sharded", True)
    elif not s.get("dcp_sharded", True):
        raise ValueError("this release's specs have no dcp_sharded")
    if kind == "full":
        spec = FullAttentionSpec(**common)
    elif kind == "mla":
        spec = MLAAttentionSpec(**common, cache_dtype_str=kv_cache_dtype)
    elif kind == "sliding_window":
        spec = SlidingWindowSpec(**common, sliding_window=s.get("sliding_window", 128))
    else:
        raise ValueError(f"unknown spec kind {kind!r}")
    return customize_attention_spec(backend, spec) if backend is not None else spec


def customize_attention_spec(backend, spec):
    """The worker's customization of a layer's spec: ``v1/worker/utils.customize_attention_spec``
    (0.32 on: the backend's ``customize_spec`` plus the kernel block alignment), else what 0.29-0.31's
    GPU model runner calls, the backend's ``customize_spec``."""
    try:
        from vllm.v1.worker.utils import customize_attention_spec as worker_customization
    except ImportError:
        return backend.customize_spec(spec)
    return worker_customization(backend, spec)


def spec_facts(spec):
    return {
        "type": type(spec).__name__,
        "num_heads": spec.num_heads,
        "num_states": spec.num_states,
        "state_content_size_bytes": spec.state_content_size_bytes,
        "page_size_bytes": spec.page_size_bytes,
        "kv_quant_mode": spec.kv_quant_mode.name,
        "dtype": str(spec.dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------


_DECISION_CONFIGS: dict[str, object] = {}


def decision_config(case):
    """The case's VllmConfig, built (and validated) once per distinct configuration.

    resolve_kv_cache_layout reads the config and writes only its answer, to
    cache_config.kv_cache_layout, which a freshly built config has unset: it is
    cleared before each reuse. A config vLLM refuses is refused again for every case.
    """
    keys = ("kv_transfer_config", "enable_extensible_kv_cache", "hisparse", "use_mla", "model_config")
    key = json.dumps([case.get(k) for k in keys], sort_keys=True)
    if key not in _DECISION_CONFIGS:
        try:
            _DECISION_CONFIGS[key] = build_vllm_config(case)
        except Exception as exc:
            _DECISION_CONFIGS[key] = exc
    config = _DECISION_CONFIGS[key]
    if isinstance(config, Exception):
        raise config
    config.cache_config.kv_cache_layout = None
    return config


def decision(case):
    """resolve_kv_cache_layout as the engine core calls it (v1/engine/core.py)."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    cap = case.get("device_capability")
    # The config is built (and validated) at start-up, before any worker reports.
    vllm_config = decision_config(case)
    with device_capability(cap):
        # Each worker reports layout names (worker_base.get_supported_kv_cache_layouts).
        supported = [
            [layout.name for layout in get_supported_kv_cache_layouts([backend_class(n) for n in names])]
            for names in case["workers"]
        ]
        first_backend = backend_class(case["workers"][0][0]) if case["workers"] and case["workers"][0] else None
        specs = [
            build_spec(s, backend_class(s["backend"]) if s.get("backend") else first_backend)
            for s in case.get("specs", [])
        ]
        with vllm_env(case.get("VLLM_KV_CACHE_LAYOUT")), captured_warnings() as warnings:
            layout = resolve_kv_cache_layout(vllm_config, supported, specs)
    return {
        "layout": layout.name,
        "warnings": warnings,
        "supported": supported,
        # what resolve_kv_cache_layout reads of each spec (its HNC shape and DCP sharding)
        "specs": [
            [spec.num_heads, spec.num_states, spec.page_size_bytes, getattr(spec, "dcp_sharded", None)]
            for spec in specs
        ],
    }


def connector_class_name(factory, name):
    """The class vLLM loads for connector ``name`` (``get_connector_class``, default extra config);
    where that import needs a package this site lacks (nixl, lmcache, ...), the class name the
    registry's lazy loader holds (``register_connector(name, module_path, class_name)``)."""
    from vllm.config import KVTransferConfig

    try:
        return factory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both")).__name__
    except Exception:
        loader = factory._registry[name]
        return inspect.getclosurevars(loader).nonlocals["class_name"]


def config_fields():
    """The fields of the configs the layout decision reads (``KVTransferConfig``: what
    ``--kv-transfer-config`` may hold; ``CacheConfig`` and ``AttentionConfig``: which settings exist;
    ``AttentionSpec``: whether a spec can be DCP-sharded or replicated)."""
    import dataclasses

    from vllm.config import AttentionConfig, CacheConfig, KVTransferConfig
    from vllm.v1.kv_cache_interface import AttentionSpec

    return {name: [f.name for f in dataclasses.fields(cls)] for name, cls in
            (("kv_transfer", KVTransferConfig), ("cache", CacheConfig), ("attention", AttentionConfig),
             ("attention_spec", AttentionSpec))}


def facts(case):
    from vllm.config import KVTransferConfig
    from vllm.config.cache import CacheConfig, CacheDType

    # KV_CACHE_DTYPES (0.33+) is the CacheDType literal's arguments, which older releases have alone
    kv_cache_dtypes = list(typing.get_args(CacheDType))
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE
    from vllm.v1.kv_cache_layout import KVCacheLayout

    out = {
        "version": __import__("vllm").__version__,
        "layouts": {m.name: list(m.value) for m in KVCacheLayout},
        "default_layout_preference": [m.name for m in _DEFAULT_LAYOUT_PREFERENCE],
        "kv_cache_dtypes": kv_cache_dtypes,
        "default_block_size": CacheConfig().block_size,
        "backends": {},
        "connectors": {},
        "stand_ins": STUBBED,
    }
    for name in BACKENDS:
        try:
            cls = backend_class(name)
        except Exception as exc:
            out["backends"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        per_cap = {}
        for cap in CAPABILITIES:
            with device_capability(cap):
                layouts = cls.supported_kv_cache_layouts()
            per_cap["none" if cap is None else f"{cap[0]}.{cap[1]}"] = (
                None if layouts is None else [m.name for m in layouts]
            )
        out["backends"][name] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "supported_kv_cache_layouts": per_cap,
            "is_mla": cls.is_mla(),
            "supported_kv_cache_dtypes": list(getattr(cls, "supported_kv_cache_dtypes", []) or []),
        }
    out["stand_ins"] = STUBBED
    registry = getattr(KVConnectorFactory, "_registry", {})
    out["registered_connectors"] = sorted(registry)
    out["connector_classes"] = {name: connector_class_name(KVConnectorFactory, name) for name in registry}
    out["config_fields"] = config_fields()
    for name in CONNECTORS:
        entry = {}
        try:
            cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both"))
            entry["class"] = f"{cls.__module__}.{cls.__qualname__}"
        except Exception as exc:
            out["connectors"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        layouts = {}
        for label, extra in (
            ("default", {}),
            ("use_mla", {"use_mla": True}),
            ("hisparse", {"hisparse": True}),
            ("no_model_config", {"model_config": False}),
        ):
            ktc = {"kv_connector": name, "kv_role": "kv_both"}
            if name == "MultiConnector":
                ktc["kv_connector_extra_config"] = {
                    "connectors": [
                        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                    ]
                }
            try:
                vc = build_vllm_config({"kv_transfer_config": ktc, **extra})
                with captured_warnings():
                    layouts[label] = cls.get_required_kvcache_layout(vc)
            except Exception as exc:
                layouts[label] = {"error": f"{type(exc).__name__}: {exc}"}
        entry["get_required_kvcache_layout"] = layouts
        out["connectors"][name] = entry
    return out


def geometry(case):
    """Allocation as the 0.34 engine does it: get_kv_cache_config_from_groups computes the
    KVCacheTensors (layer_stride, block_stride, offset, size) for the resolved layout,
    allocate_kv_cache views a raw int8 buffer per layer (create_kv_cache_views)."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    except ImportError:  # 0.29-0.32: the same functions in kv_cache_utils
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.utils import allocate_kv_cache

    backend = backend_class(case["backend"])
    s = dict(case)
    s.setdefault("kind", "mla" if backend.is_mla() else "full")
    with device_capability(case.get("device_capability")):
        spec = build_spec(s, backend)
        num_layers = case["num_layers"]
        num_blocks = case["num_blocks"]
        vllm_config = build_vllm_config({"block_size": spec.block_size}, layout=case["layout"], num_blocks=num_blocks)
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        groups = get_kv_cache_groups(vllm_config, {n: spec for n in layer_names})
        kv_cache_config = get_kv_cache_config_from_groups(
            vllm_config, groups, available_memory=num_blocks * num_layers * spec.page_size_bytes * 4
        )
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        buffers = []

        def allocate(nbytes):
            buf = torch.zeros(nbytes, dtype=torch.int8)
            buffers.append(buf)
            return buf

        if "allocate" in inspect.signature(allocate_kv_cache).parameters:
            views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, allocate=allocate)
        else:  # 0.29-0.33 allocate their one backing buffer themselves: found through the views' storage
            views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
            for view in views.values():
                storage = view.untyped_storage()
                if all(b.data_ptr() != storage.data_ptr() for b in buffers):
                    buffers.append(torch.empty(0, dtype=torch.int8).set_(storage))

    def locate(tensor):
        """(index of the buffer holding the tensor's first byte, byte offset in that buffer)."""
        ptr = tensor.data_ptr()
        for i, b in enumerate(buffers):
            if b.data_ptr() <= ptr < b.data_ptr() + b.numel():
                return i, ptr - b.data_ptr()
        raise RuntimeError("a view starts outside every allocated buffer")

    layers = []
    for name in layer_names:
        view = views[name]
        esize = view.element_size()
        buffer, offset = locate(view)
        entry = {
            "buffer": buffer,
            "byte_offset": offset,
            "shape": list(view.shape),
            "dtype": str(view.dtype).removeprefix("torch."),
            "byte_strides": [st * esize for st in view.stride()],
        }
        try:
            entry.update(cell_split(backend, spec, view, case))
        except Exception as exc:  # a dtype this split does not know (nvfp4 packs K and V by head)
            entry["split_error"] = f"{type(exc).__name__}: {exc}"
        try:
            entry["writes"] = kv_write_views(backend, spec, view, case, locate)
        except Exception as exc:
            entry["writes_error"] = f"{type(exc).__name__}: {exc}"
        layers.append(entry)
    return {
        "layout": layout.name,
        "stride_order": list(layout.value),
        "num_blocks": kv_cache_config.num_blocks,
        "buffers": [{"nbytes": b.numel()} for b in buffers],
        "kv_cache_tensors": [
            {
                "size": t.size,
                "layers": len(t.layers),
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
                "offset": t.offset,
            }
            for t in kv_cache_config.kv_cache_tensors
        ],
        "spec": spec_facts(spec),
        "layers": layers,
    }


def cell_split(backend, spec, view, case):
    """Where K, V (and per-token-head scales) sit inside a cell, by the backend's own
    split of the [B, H, N, C] view (byte offsets from the cell's first byte)."""
    cell0 = view.data_ptr()
    if backend.is_mla():
        # MLA caches one latent per token; there is no K/V split.
        return {"k_byte_offset_in_cell": 0, "content_bytes": spec.state_content_size_bytes}
    if spec.kv_quant_mode.is_per_token_head and backend.get_name() == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

        impl = types.SimpleNamespace(
            _k_scale_cache=None,
            _v_scale_cache=None,
            _set_kv_ptr_range=False,
            _kv_quant_mode=spec.kv_quant_mode,
            fp8_dtype=torch.float8_e4m3fn,
        )
        impl._ensure_scale_caches = types.MethodType(TritonAttentionImpl._ensure_scale_caches, impl)
        key, value = TritonAttentionImpl._pth_key_value_caches(impl, view)
        return {
            "split": "TritonAttentionImpl._pth_key_value_caches",
            "k_byte_offset_in_cell": key.data_ptr() - cell0,
            "k_bytes": key.shape[-1] * key.element_size(),
            "v_byte_offset_in_cell": value.data_ptr() - cell0,
            "v_bytes": value.shape[-1] * value.element_size(),
            "k_scale_byte_offset_in_cell": impl._k_scale_cache.data_ptr() - cell0,
            "v_scale_byte_offset_in_cell": impl._v_scale_cache.data_ptr() - cell0,
            "scale_dtype": str(impl._k_scale_cache.dtype).removeprefix("torch."),
            "scale_byte_strides": [st * 4 for st in impl._k_scale_cache.stride()],
        }
    # FLASH_ATTN / TRITON_ATTN (not per-token-head) / FLEX_ATTENTION / CPU_ATTN:
    # kv_cache.transpose(1, 2).split(head_size, dim=-1) in their forward.
    if spec.kv_quant_mode.is_per_token_head:
        return {"split": None, "note": f"{backend.get_name()} has no per-token-head split"}
    key, value = view.transpose(1, 2).split(case.get("head_size", spec.head_size), dim=-1)
    return {
        "split": "kv_cache.transpose(1, 2).split(head_size, dim=-1)",
        "k_byte_offset_in_cell": key.data_ptr() - cell0,
        "k_bytes": key.shape[-1] * key.element_size(),
        "v_byte_offset_in_cell": value.data_ptr() - cell0,
        "v_bytes": value.shape[-1] * value.element_size(),
    }


# The cache-write kernels' tensor arguments, in order, with the dims each kernel documents
# for them (csrc/cache_kernels.cu, vllm/_custom_ops.py, the backends' comments).
_WRITE_KERNELS = {
    # (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D)) in FLASH_ATTN / TRITON_ATTN / FLASHINFER / FLEX_ATTENTION
    "reshape_and_cache_flash": (("key", "value", "key_cache", "value_cache"),
                                {"key_cache": ("block", "token", "head", "dim"),
                                 "value_cache": ("block", "token", "head", "dim")}),
    "triton_reshape_and_cache_flash": (("key", "value", "key_cache", "value_cache"),
                                       {"key_cache": ("block", "token", "head", "dim"),
                                        "value_cache": ("block", "token", "head", "dim")}),
    # _ensure_scale_caches: "Scale shape: (num_blocks, block_size, num_kv_heads)"
    "triton_reshape_and_cache_flash_per_token_head_quant": (
        ("key", "value", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache"),
        {"key_cache": ("block", "token", "head", "dim"), "value_cache": ("block", "token", "head", "dim"),
         "k_scale_cache": ("block", "token", "head"), "v_scale_cache": ("block", "token", "head")}),
    # CPU_ATTN: kv_cache.view(B, H, 2N, -1).chunk(2, dim=2) -> key/value [B, H, N, D]
    "cpu_attn_reshape_and_cache": (("key", "value", "key_cache", "value_cache"),
                                   {"key_cache": ("block", "head", "token", "dim"),
                                    "value_cache": ("block", "head", "token", "dim")}),
    # MLA: MLAAttention.bind_kv_cache squeezes [B, 1, N, C] -> [B, N, C]
    "concat_and_cache_mla": (("kv_c", "k_pe", "kv_cache"), {"kv_cache": ("block", "token", "dim")}),
}
# FLASHINFER's nvfp4 writer (flashinfer's, called with vLLM's `_nvfp4_kv_views`): (key, value,
# slot_mapping, (k_data, v_data), (k_scale, v_scale), k_scale, v_scale, kv_layout=...), each data
# and scale tensor (B, H, N, bytes) for kv_layout "HND", (B, N, H, bytes) for "NHD".
_NVFP4_WRITER = "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping"


def _record_nvfp4(calls):
    def record(key, value, slot_mapping, data, scales, *args, kv_layout="NHD", **kwargs):
        dims = ("block", "head", "token", "dim") if kv_layout == "HND" else ("block", "token", "head", "dim")
        tensors = {"key_cache": data[0], "value_cache": data[1], "k_scale_cache": scales[0],
                   "v_scale_cache": scales[1]}
        calls.append({"kernel": _NVFP4_WRITER, "tensors": tensors, "dims": dict.fromkeys(tensors, dims)})

    return record


@contextlib.contextmanager
def recorded_write_kernels():
    """STAND-IN: every cache-write kernel a backend's do_kv_cache_update may call is replaced by a
    recorder of the cache tensors it is handed (the CUDA/CPU kernels are not built here). Yields
    the list the calls are appended to, as {kernel, tensors: {argument name: tensor}}."""
    import importlib

    calls = []

    def recorder(kernel):
        names, dims = _WRITE_KERNELS[kernel]

        def record(*args, **kwargs):
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            calls.append({"kernel": kernel, "tensors": {n: bound[n] for n in dims}, "dims": dims})

        return record

    targets = [
        ("vllm.v1.attention.backends.flash_attn", "reshape_and_cache_flash", "reshape_and_cache_flash"),
        ("vllm.v1.attention.backends.triton_attn", "triton_reshape_and_cache_flash",
         "triton_reshape_and_cache_flash"),
        ("vllm.v1.attention.backends.triton_attn", "triton_reshape_and_cache_flash_per_token_head_quant",
         "triton_reshape_and_cache_flash_per_token_head_quant"),
        ("vllm._cpu_ops", "cpu_attn_reshape_and_cache", "cpu_attn_reshape_and_cache"),
        # where 0.29-0.33's CPU backend finds it (`from vllm import _custom_ops as ops`)
        ("vllm._custom_ops", "cpu_attn_reshape_and_cache", "cpu_attn_reshape_and_cache"),
        ("vllm._custom_ops", "concat_and_cache_mla", "concat_and_cache_mla"),
    ]
    saved = []
    for module_name, attr, kernel in targets:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a backend module this interpreter cannot import is never called
            continue
        saved.append((module, attr, module.__dict__.get(attr, _MISSING)))
        setattr(module, attr, recorder(kernel))
    try:
        flashinfer_backend = importlib.import_module("vllm.v1.attention.backends.flashinfer")
    except Exception:  # a backend module this interpreter cannot import is never called
        flashinfer_backend = None
    if flashinfer_backend is not None:
        saved.append((flashinfer_backend, _NVFP4_WRITER, flashinfer_backend.__dict__.get(_NVFP4_WRITER, _MISSING)))
        setattr(flashinfer_backend, _NVFP4_WRITER, _record_nvfp4(calls))
    ops_ns = torch.ops._C_cache_ops
    saved.append((ops_ns, "reshape_and_cache_flash", ops_ns.__dict__.get("reshape_and_cache_flash", _MISSING)))
    ops_ns.reshape_and_cache_flash = recorder("reshape_and_cache_flash")
    try:
        yield calls
    finally:
        for obj, attr, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)


_MISSING = object()


def kv_write_views(backend, spec, view, case, locate):
    """The tensors this layer's cache-write kernel receives, by vLLM's own code: the layer's
    bind_kv_cache (MLA squeezes the head dim) and the backend impl's do_kv_cache_update, which
    splits the cache into K, V (and per-token-head scale) views and hands them to the kernel.

    STAND-INs: the impl is the backend's impl class built with ``__new__`` plus the attributes
    do_kv_cache_update reads, set as its ``__init__`` sets them for this spec (``__init__`` checks
    the platform's kernels); the attention layer is an object with the scale attributes it reads;
    the kernels are recorders (`recorded_write_kernels`). Each tensor is reported as its byte
    offset from the buffer, shape, byte strides, dtype and the dims the kernel documents."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    kv_cache_dtype = case.get("kv_cache_dtype", "auto")
    head_size = case.get("head_size", spec.head_size)
    num_kv_heads = case.get("num_kv_heads", spec.num_kv_heads)
    impl_cls = backend.get_impl_cls()
    impl = impl_cls.__new__(impl_cls)
    mode = get_kv_quant_mode(kv_cache_dtype)
    for name, value in {
        "attn_type": AttentionType.DECODER,
        "head_size": head_size,
        "num_kv_heads": num_kv_heads,
        "kv_cache_dtype": kv_cache_dtype,
        "fp8_dtype": current_platform.fp8_dtype(),
        "kv_sharing_target_layer_name": None,
        "cache_dtype": kv_cache_dtype,  # FlashInferImpl: the dtype handed to its write kernel
        # TritonAttentionImpl.__init__
        "_kv_quant_mode": mode,
        "_is_per_token_head_quant": mode.is_per_token_head,
        "_k_scale_cache": None,
        "_v_scale_cache": None,
        "_set_kv_ptr_range": False,
        # FlashInferImpl.__init__ on SM80/90/120 (fa2): NVFP4 is written through `_nvfp4_kv_views`, the
        # views its forward reads on every device (SM100's trtllm writer gets whole cells instead)
        "is_kvcache_nvfp4": kv_cache_dtype.startswith("nvfp4"),
        "nvfp4_fa2": kv_cache_dtype.startswith("nvfp4"),
    }.items():
        impl.__dict__[name] = value
    one = torch.ones((), dtype=torch.float32)
    layer = types.SimpleNamespace(_k_scale=one, _v_scale=one, _k_scale_float=1.0, _v_scale_float=1.0, isa="vec",
                                  _vllm_config=types.SimpleNamespace(
                                      kernel_config=types.SimpleNamespace(enable_jit_warmup=False)))
    slots = torch.zeros(0, dtype=torch.long)
    with recorded_write_kernels() as calls:
        if backend.is_mla():
            MLAAttention.bind_kv_cache(layer, view)
            impl.do_kv_cache_update(torch.zeros(0, head_size), torch.zeros(0, 1, 0), layer.kv_cache, slots,
                                    kv_cache_dtype, one)
        else:
            AttentionLayerBase.bind_kv_cache(layer, view)
            key = torch.zeros(0, num_kv_heads, head_size)
            impl.do_kv_cache_update(layer, key, key, layer.kv_cache, slots)
    if len(calls) != 1:
        raise RuntimeError(f"do_kv_cache_update made {len(calls)} recorded kernel calls, expected 1")
    (call,) = calls
    out = {"kernel": call["kernel"], "impl": f"{impl_cls.__module__}.{impl_cls.__qualname__}", "tensors": {}}
    for name, t in call["tensors"].items():
        buffer, offset = locate(t)
        out["tensors"][name] = {
            "dims": list(call["dims"][name]),
            "buffer": buffer,
            "byte_offset": offset,
            "shape": list(t.shape),
            "byte_strides": [st * t.element_size() for st in t.stride()],
            "dtype": str(t.dtype).removeprefix("torch."),
        }
    return out


def validation(cls, case, caps):
    """The backend's own ``validate_configuration`` for this case (a decoder layer, no sinks,
    no sparsity, no connector) under each device capability: the reasons vLLM's backend
    selection would refuse it for, by capability ("M.m"); an empty list accepts it."""
    out = {}
    for cap in caps:
        if cap is None:
            continue
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backend import AttentionType

        try:
            reasons = cls.validate_configuration(
                head_size=case["head_size"],
                dtype=TORCH_DTYPES[case.get("dtype", "bfloat16")],
                kv_cache_dtype=case["kv_cache_dtype"],
                block_size=case["block_size"],
                use_mla=cls.is_mla(),
                has_sink=False,
                use_sparse=False,
                use_mm_prefix=False,
                use_per_head_quant_scales=False,
                device_capability=DeviceCapability(*cap),
                attn_type=AttentionType.DECODER,
            )
        except Exception as exc:
            reasons = [f"{type(exc).__name__}: {exc}"]
        out[f"{cap[0]}.{cap[1]}"] = list(reasons)
    return out


def geometry_sweep(case):
    """Geometry for every combination vLLM accepts: for each backend named, every kv_cache_dtype
    its class lists (``supported_kv_cache_dtypes``) and every layout it declares under any of the
    device capabilities (``supported_kv_cache_layouts()``; None declares none, so every
    KVCacheLayout). Each combination runs ``per_combo`` geometry cases whose sizes are taken in
    turn from ``configs`` (MLA backends from ``mla_configs``); a config's ``page_padding`` asks
    for ``page_size_padded`` = vLLM's page size plus that many bytes. Returns the declarations and
    ``cases``: one ``{"case", "result"}`` per geometry run, a refusal as ``{"error": ...}``."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    sweep = case["geometry_sweep"]
    per_combo = sweep.get("per_combo", 1)
    caps = [None if c is None else tuple(c) for c in sweep.get("capabilities", CAPABILITIES)]
    declared, cases = {}, []
    turn = {"mha": 0, "mla": 0}
    for name in sweep["backends"]:
        cls = backend_class(name)
        layouts = set()
        for cap in caps:
            with device_capability(cap):
                got = cls.supported_kv_cache_layouts()
            layouts |= {m.name for m in (KVCacheLayout if got is None else got)}
        ordered = [m.name for m in KVCacheLayout if m.name in layouts]
        dtypes = list(getattr(cls, "supported_kv_cache_dtypes", []) or [])
        kind = "mla" if cls.is_mla() else "mha"
        declared[name] = {"is_mla": cls.is_mla(), "kv_cache_dtypes": dtypes, "layouts": ordered}
        configs = sweep["mla_configs" if kind == "mla" else "configs"]
        for dtype in dtypes:
            for layout in ordered:
                for _ in range(per_combo):
                    size = dict(configs[turn[kind] % len(configs)])
                    turn[kind] += 1
                    one = {"backend": name, "kv_cache_dtype": dtype, "layout": layout, **size}
                    padding = one.pop("page_padding", None)
                    if padding is not None:  # page_size_padded: vLLM's own page size plus `padding` bytes
                        with device_capability(None):
                            real = build_spec({**one, "kind": "mla" if cls.is_mla() else "full"}, cls)
                        one["page_size_padded"] = real.page_size_bytes + padding
                    try:
                        result = geometry(one)
                    except Exception as exc:
                        result = {"error": f"{type(exc).__name__}: {exc}"}
                    result["validate_configuration"] = validation(cls, one, caps)
                    cases.append({"case": one, "result": result})
    return {"version": __import__("vllm").__version__, "backends": declared, "cases": cases}


def handle(case):
    if case.get("facts"):
        return facts(case)
    if "geometry_sweep" in case:
        return geometry_sweep(case)
    if "workers" in case:
        return decision(case)
    if "backend" in case and "layout" in case:
        return geometry(case)
    raise ValueError(f"unknown case kind: {sorted(case)}")


def main():
    answer_cases(handle, _ANSWER)


if __name__ == "__main__":
    main()
