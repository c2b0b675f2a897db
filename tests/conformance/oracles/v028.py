"""Conformance oracle for the uniform-gate releases, vLLM 0.24.0 to 0.28.0 (runs UNDER the release,
never in-process; tests/conformance/gate_oracle.py asks it once per release).

stdin: JSON list of cases; stdout: JSON list of results, one per case, same order.
Everything vLLM logs goes to stderr. A case vLLM rejects yields
{"error": "<ExceptionType>: <message>"}; the oracle itself never crashes on a case.

Case kinds (see tests/conformance/oracles/README.md):
  {"facts": true}
  {"gate": true, ...}       -> {"uniform": bool, "head_order": "NHD"|"HND", ...}
  {"backend": ..., "layout": "per_layer"|"cross_layer", ...}   (geometry)

Rule: call vLLM's own code, never transcribe it. Where a vLLM object cannot be
built on a CPU-only machine the smallest stand-in is used; each one is marked
STAND-IN below with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import traceback
from typing import Any

# vLLM's logging handler writes to sys.stdout, resolved when vllm is imported:
# point it at stderr so stdout carries only our JSON.
_STDOUT = sys.stdout
sys.stdout = sys.stderr
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from _host import pin_host  # noqa: E402

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)


def _import_vllm_on_the_cpu_platform():
    """``import vllm``, its platform resolved to the CPU platform.

    STAND-IN (releases before 0.28): they ignore VLLM_TARGET_DEVICE=cpu and take the CPU
    platform only for a build whose version names ``cpu`` (``vllm_version_matches_substr``,
    read from the distribution's metadata while ``import vllm`` resolves the platform). During
    that import the metadata version of ``vllm`` reads with a ``+cpu`` local label; 0.28 picks
    the same CpuPlatform for VLLM_TARGET_DEVICE=cpu before it ever asks.
    """
    import importlib.metadata as md

    real = md.version
    md.version = lambda name: real(name) + "+cpu" if name == "vllm" else real(name)
    try:
        import vllm
        import vllm.platforms
    finally:
        md.version = real
    assert vllm.platforms.current_platform.device_type == "cpu", vllm.platforms.current_platform
    return vllm


vllm = _import_vllm_on_the_cpu_platform()
from _common import backend_class as _registry_backend_class  # noqa: E402
from vllm import envs  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: E402
    KVConnectorFactory,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.model_executor.layers.attention_layer_base import (  # noqa: E402
    AttentionLayerBase,
)
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # noqa: E402
from vllm.v1.attention.backends import utils as backend_utils  # noqa: E402
from vllm.v1.attention.backends.registry import (  # noqa: E402
    MambaAttentionBackendEnum,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)
from vllm.v1.worker.gpu import attn_utils  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import (  # noqa: E402
    KVConnectorModelRunnerMixin,
)
from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes  # noqa: E402

FACT_BACKENDS = [
    "TRITON_ATTN",
    "FLASH_ATTN",
    "FLASHINFER",
    "FLEX_ATTENTION",
    "FLASHMLA",
    "TRITON_MLA",
    "CPU_ATTN",
    "ROCM_ATTN",
]
FACT_CACHE_DTYPES = ["auto", "fp8", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]


def _err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"}


def _try(fn, *a, **kw):
    try:
        v = fn(*a, **kw)
        return list(v) if isinstance(v, tuple) else v
    except Exception as e:  # vLLM's own refusal is data here
        return _err(e)


def _set_env_layout(value: str | None) -> None:
    """VLLM_KV_CACHE_LAYOUT as vLLM reads it (envs.__getattr__, uncached here)."""
    if value is None:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    else:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = value
    envs.disable_envs_cache()
    backend_utils.set_kv_cache_layout(None)  # also clears get_kv_cache_layout's lru_cache


# ---------------------------------------------------------------- model config
# ModelConfig needs an HF config; a tiny config.json in a temp dir is read by
# transformers offline (no weights, no tokenizer). Real ModelConfig, real
# use_mla / get_total_num_kv_heads. Built at most once per process per kind
# (about 20-40 s: vLLM resolves the architecture through its model registry).
_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
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
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 2,
    "rms_norm_eps": 1e-6,
}
_MODEL_CONFIGS: dict[bool, Any] = {}
_TMP = tempfile.mkdtemp(prefix="kvpolicy-oracle-v028-")


def _model_config(use_mla: bool):
    if use_mla not in _MODEL_CONFIGS:
        d = os.path.join(_TMP, "mla" if use_mla else "dense")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(_DEEPSEEK if use_mla else _LLAMA, f)
        try:
            _MODEL_CONFIGS[use_mla] = ModelConfig(
                model=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
            )
        except Exception as e:
            _MODEL_CONFIGS[use_mla] = e
    mc = _MODEL_CONFIGS[use_mla]
    if isinstance(mc, Exception):
        raise RuntimeError(f"oracle could not build ModelConfig: {_err(mc)['error']}")
    return mc


def _vllm_config(case: dict, with_model: bool) -> VllmConfig:
    ktc = case.get("kv_transfer_config")
    kw: dict[str, Any] = {
        "cache_config": CacheConfig(
            block_size=_first_spec(case).get("block_size", 16),
            cache_dtype=case.get("kv_cache_dtype", "auto"),
        )
    }
    if with_model:
        kw["model_config"] = _model_config(bool(case.get("use_mla")))
    if ktc:
        kw["kv_transfer_config"] = KVTransferConfig(**_ktc_kwargs(ktc))
    return VllmConfig(**kw)


def _ktc_kwargs(ktc: dict) -> dict:
    out = dict(ktc)
    out.setdefault("kv_role", "kv_both")
    out.setdefault("engine_id", "kvpolicy-oracle")
    return out


def _first_spec(case: dict) -> dict:
    specs = case.get("specs") or [case]
    return specs[0]


# ------------------------------------------------------------------ specs
class _StandInLayer(AttentionLayerBase):
    """STAND-IN for a model's attention layer in static_forward_context.

    A real Attention/MLAAttention/Mamba layer builds its impl (kernels, CUDA
    checks) and needs a loaded model; what vLLM reads from it here is only
    get_attn_backend() (NixlConnector.prefer_cross_layer_blocks via
    get_current_attn_backend, init_attn_backend's grouping) and
    get_kv_cache_spec() (the runner's get_kv_cache_spec). The spec it returns
    is built exactly as Attention.get_kv_cache_spec builds it
    (model_executor/layers/attention/attention.py:597-655) from vLLM's own
    spec classes; vLLM's get_kv_cache_spec then applies its own
    indexes_kv_by_block_stride + customize_spec post-processing.
    """

    def __init__(self, backend, spec):
        self._backend = backend
        self._spec = spec

    def get_attn_backend(self):
        return self._backend

    def get_kv_cache_spec(self, vllm_config):
        return self._spec


def _backend_class(name: str):
    if name in MambaAttentionBackendEnum.__members__:
        return MambaAttentionBackendEnum[name].get_class()
    # STAND-IN (shared with v034, _common.backend_class): the FLASHINFER module imports
    # the flashinfer package (a CUDA JIT package, not installed) at import time; an inert
    # stub tree is installed only when that import fails. Shapes and stride orders are
    # pure Python and call none of it.
    return _registry_backend_class(name)


def _base_spec(s: dict, case: dict, model_config) -> Any:
    kind = s.get("kind", "full")
    kvd = s.get("kv_cache_dtype") or case.get("kv_cache_dtype", "auto")
    if kvd == "auto":
        dtype = STR_DTYPE_TO_TORCH_DTYPE[s.get("dtype", case.get("dtype", "bfloat16"))]
    else:
        dtype = STR_DTYPE_TO_TORCH_DTYPE[kvd]
    common = dict(
        block_size=s.get("block_size", 16),
        num_kv_heads=s.get("num_kv_heads", 8),
        head_size=s.get("head_size", 128),
        dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(kvd),
        page_size_padded=s.get("page_size_padded"),
    )
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding_window":
        return SlidingWindowSpec(**common, sliding_window=s.get("sliding_window", 128))
    if kind == "mla":
        common["num_kv_heads"] = s.get("num_kv_heads", 1)
        common["head_size"] = s.get("head_size", 576)
        return MLAAttentionSpec(**common, cache_dtype_str=kvd)
    if kind == "mamba":
        # page_size_padded: vLLM pads hybrid models' Mamba pages to the attention
        # page (unify_kv_cache_spec_page_size); _build_model fills it in when absent.
        return MambaSpec(
            block_size=s.get("block_size", 16),
            shapes=tuple(tuple(x) for x in s.get("shapes", [[2, 64], [4, 16, 16]])),
            dtypes=tuple(STR_DTYPE_TO_TORCH_DTYPE[d] for d in s.get("dtypes", ["bfloat16", "float32"])),
            page_size_padded=s.get("page_size_padded"),
        )
    raise ValueError(f"unknown spec kind {kind!r}")


def _default_backend(case: dict, s: dict) -> list[str]:
    if s.get("backends"):
        return list(s["backends"])
    if s.get("backend"):
        return [s["backend"]]
    if s.get("kind") == "mamba":
        return ["MAMBA2"]
    if case.get("backend"):
        return [case["backend"]]
    workers = case.get("workers")
    if workers:
        return list(workers[0][:1])
    raise ValueError("no backend given for spec")


def _build_model(case: dict, vllm_config: VllmConfig):
    """Layers -> specs (vLLM's get_kv_cache_spec) -> KVCacheConfig -> attn_groups."""
    specs_in = case.get("specs") or [case]
    layers_per_group = case.get("num_layers", 2)
    num_blocks = case.get("num_blocks", 8)
    sfc = vllm_config.compilation_config.static_forward_context
    sfc.clear()
    group_layers: list[list[tuple[str, Any]]] = []
    lid = 0
    for s in specs_in:
        backends = [_backend_class(n) for n in _default_backend(case, s)]
        base = _base_spec(s, case, vllm_config.model_config)
        names = []
        for j in range(s.get("num_layers", layers_per_group)):
            name = f"model.layers.{lid}.attn"
            lid += 1
            b = backends[j % len(backends)]
            sfc[name] = _StandInLayer(b, base)
            names.append((name, b))
        group_layers.append(names)
    # vLLM's own per-layer spec post-processing (indexes_kv_by_block_stride,
    # customize_spec): v1/worker/gpu/attn_utils.py:63-80.
    layer_specs = attn_utils.get_kv_cache_spec(vllm_config)
    groups = [
        KVCacheGroupSpec(layer_names=[n for n, _ in gl], kv_cache_spec=layer_specs[gl[0][0]]) for gl in group_layers
    ]
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    for g in groups:
        if isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.page_size_bytes < page:
            g.kv_cache_spec = dataclasses.replace(g.kv_cache_spec, page_size_padded=page)
    group_size = max(len(g.layer_names) for g in groups)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, available_memory=page * num_blocks * group_size
    )
    # Phase 1 of attn_utils.init_attn_backend (v1/worker/gpu/attn_utils.py:106-140):
    # one AttentionGroup per (backend, spec) within a KV cache group. Replayed
    # here because phases 2-3 of that function build metadata builders, which
    # need a CUDA device and a loaded model.
    attn_groups: list[list[AttentionGroup]] = []
    for gid, gl in enumerate(group_layers):
        by_backend: dict[str, AttentionGroup] = {}
        for name, b in gl:
            key = b.full_cls_name()
            if key not in by_backend:
                by_backend[key] = AttentionGroup(b, [], layer_specs[name], gid)
            by_backend[key].layer_names.append(name)
        attn_groups.append(list(by_backend.values()))
    return kv_cache_config, attn_groups


# ------------------------------------------------------------- connectors
def _reads_canonical_layout() -> bool:
    """Whether OffloadingConnector.prefer_cross_layer_blocks reads ``_canonical_layout`` (0.28; before,
    it returns True and its config has no canonical_layout): asked of vLLM's own property, on an
    instance that has no such attribute."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    try:
        OffloadingConnector.__new__(OffloadingConnector).prefer_cross_layer_blocks  # noqa: B018
    except AttributeError:
        return True
    return False


_OFFLOADING_READS_CANONICAL_LAYOUT = _reads_canonical_layout()


def _make_connector(cls, vllm_config: VllmConfig, kv_cache_config):
    """A worker-role instance of vLLM's real connector class.

    STAND-IN (partial): the subclass __init__ of the connectors that matter here
    opens hardware/network resources (NIXL agents, offloading worker threads and
    pinned host buffers, Mooncake store clients), so the instance is created with
    cls.__new__, then vLLM's own KVConnectorBase_V1.__init__ runs, then the
    attributes the subclass __init__ would set *that prefer_cross_layer_blocks
    reads* are set the way that __init__ sets them:
      NixlBaseConnector (nixl/connector.py:116-140): kv_cache_config, kv_transfer_config
      OffloadingConnector (offloading_connector.py:58-67): _canonical_layout from
        vLLM's build_offloading_config(...).canonical_layout
      MultiConnector (multi_connector.py:169-187): _connectors, children built the
        same way from vLLM's _get_connector_classes_and_configs
    prefer_cross_layer_blocks itself is always vLLM's property, unmodified.
    """
    inst = cls.__new__(cls)
    KVConnectorBase_V1.__init__(inst, vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    if isinstance(inst, NixlBaseConnector):
        inst.kv_cache_config = kv_cache_config
        inst.kv_transfer_config = vllm_config.kv_transfer_config
    if isinstance(inst, OffloadingConnector) and _OFFLOADING_READS_CANONICAL_LAYOUT:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            build_offloading_config,
        )

        inst._canonical_layout = build_offloading_config(vllm_config, kv_cache_config).canonical_layout
    if isinstance(inst, MultiConnector):
        inst._connectors = [
            _make_connector(ccls, tcfg, kv_cache_config)
            for ccls, tcfg in cls._get_connector_classes_and_configs(vllm_config)
        ]
    return inst


# ------------------------------------------------------------------- facts
def _facts(case: dict) -> dict:
    from typing import get_args

    from vllm.config.cache import CacheDType

    out: dict[str, Any] = {"vllm_version": vllm.__version__}
    out["kv_cache_dtypes"] = list(get_args(CacheDType))
    out["default_block_size"] = CacheConfig().block_size
    out["kv_transfer_config_fields"] = [f.name for f in dataclasses.fields(KVTransferConfig)]
    backends: dict[str, Any] = {}
    for name in case.get("backends", FACT_BACKENDS):
        try:
            b = _backend_class(name)
        except Exception as e:
            backends[name] = _err(e)
            continue
        entry: dict[str, Any] = {
            "class": f"{b.__module__}.{b.__qualname__}",
            "is_mla": b.is_mla(),
            "supported_kv_cache_dtypes": list(getattr(b, "supported_kv_cache_dtypes", []) or []),
        }
        # three heads: a K/V dim of its own (size 2, 0.24-0.25) is not mistaken for the head dim
        n, bs, h, d = 5, 16, 3, (576 if b.is_mla() else 64)
        entry["example"] = {"num_blocks": n, "block_size": bs, "num_kv_heads": h, "head_size": d}
        entry["kv_cache_shape"] = {
            dt: _try(b.get_kv_cache_shape, n, bs, h, d, cache_dtype_str=dt) for dt in FACT_CACHE_DTYPES
        }
        by_layout = {}
        for lay in ("NHD", "HND"):
            _set_env_layout(lay)
            with set_current_vllm_config(VllmConfig()):
                by_layout[lay] = {
                    "stride_order": _try(b.get_kv_cache_stride_order),
                    "stride_order_with_layers": _try(b.get_kv_cache_stride_order, include_num_layers_dimension=True),
                    "indexes_kv_by_block_stride": _try(b.indexes_kv_by_block_stride),
                }
        _set_env_layout(None)
        entry["by_layout"] = by_layout
        backends[name] = entry
    out["backends"] = backends

    # get_kv_cache_layout(): default (no connector), env override.
    lay: dict[str, Any] = {}
    for env in (None, "NHD", "HND"):
        _set_env_layout(env)
        with set_current_vllm_config(VllmConfig()):
            lay[str(env)] = _try(backend_utils.get_kv_cache_layout)
    _set_env_layout(None)
    out["get_kv_cache_layout"] = lay

    conns: dict[str, Any] = {}
    for name in sorted(KVConnectorFactory._registry):
        try:
            c = KVConnectorFactory.get_connector_class_by_name(name)
        except Exception as e:
            conns[name] = _err(e)
            continue
        prop = None
        for klass in c.__mro__:
            if "prefer_cross_layer_blocks" in vars(klass):
                prop = klass
                break
        attr = vars(prop)["prefer_cross_layer_blocks"] if prop else None
        conns[name] = {
            "class": c.__name__,
            "qualname": f"{c.__module__}.{c.__qualname__}",
            "prefer_cross_layer_blocks_defined_in": prop.__name__ if prop else None,
            "prefer_cross_layer_blocks_kind": type(attr).__name__ if attr is not None else None,
        }
    out["connectors"] = conns
    req: dict[str, Any] = {}
    for name in case.get(
        "layout_connectors",
        [
            "NixlConnector",
            "OffloadingConnector",
            "MooncakeConnector",
            "LMCacheConnectorV1",
            "ExampleConnector",
            "MooncakeStoreConnector",
            "SimpleCPUOffloadConnector",
        ],
    ):
        per = {}
        for use_mla in (False, True):
            try:
                vc = VllmConfig(
                    model_config=_model_config(use_mla),
                    kv_transfer_config=KVTransferConfig(**_ktc_kwargs({"kv_connector": name})),
                )
                c = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
                per["mla" if use_mla else "dense"] = _try(c.get_required_kvcache_layout, vc)
                _set_env_layout(None)
                with set_current_vllm_config(vc):
                    per["get_kv_cache_layout_" + ("mla" if use_mla else "dense")] = _try(
                        backend_utils.get_kv_cache_layout
                    )
            except Exception as e:
                per["mla" if use_mla else "dense"] = _err(e)
        req[name] = per
    out["required_kvcache_layout"] = req
    return out


# -------------------------------------------------------------------- gate
def _gate(case: dict) -> dict:
    _set_env_layout(case.get("VLLM_KV_CACHE_LAYOUT"))
    vc = _vllm_config(case, with_model=True)
    try:
        with set_current_vllm_config(vc):
            kv_cache_config, attn_groups = _build_model(case, vc)
            conn = None
            if vc.kv_transfer_config is not None:
                ccls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
                conn = _make_connector(ccls, vc, kv_cache_config)
            # The mixin reads the process-wide agent through
            # get_kv_transfer_group()/has_kv_transfer_group(); set that global
            # the way ensure_kv_transfer_initialized does (kv_transfer_state.py:90).
            kv_transfer_state._KV_CONNECTOR_AGENT = conn
            res: dict[str, Any] = {}
            res["uniform"] = KVConnectorModelRunnerMixin.use_uniform_kv_cache(attn_groups)
            res["head_order"] = backend_utils.get_kv_cache_layout()
            res["connector_class"] = type(conn).__name__ if conn is not None else None
            res["prefer_cross_layer_blocks"] = (
                _try(lambda: conn.prefer_cross_layer_blocks) if conn is not None else None
            )
            res["required_kvcache_layout"] = (
                _try(type(conn).get_required_kvcache_layout, vc) if conn is not None else None
            )
            res["num_kv_cache_groups"] = len(kv_cache_config.kv_cache_groups)
            res["num_attention_groups"] = [len(g) for g in attn_groups]
            res["indexes_kv_by_block_stride"] = [
                [getattr(g.kv_cache_spec, "indexes_kv_by_block_stride", None) for g in gs] for gs in attn_groups
            ]
            res["use_v2_model_runner_here"] = vc.use_v2_model_runner
            return res
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        _set_env_layout(None)


# ---------------------------------------------------------------- geometry
def _role_view(v: torch.Tensor, names: tuple[str, ...]) -> dict:
    """Where the first byte of each (block, token, head) cell of one role sits: ``v`` indexed by
    ``names`` (its leading dims), as a byte offset and byte strides over those dims."""
    es = v.element_size()
    return {"dims": list(names), "byte_offset": v.storage_offset() * es,
            "byte_strides": [v.stride(i) * es for i in range(len(names))]}


def _cpu_attn_key_value(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches CPU_ATTN's ``do_kv_cache_update`` passes ``cpu_attn_reshape_and_cache``
    for layer view ``t``. STAND-IN: the impl is made with __new__ (its __init__ reads the platform) and
    the op is a recorder: only the tensors handed to it are read, never written."""
    import types

    from vllm.v1.attention.backends import cpu_attn

    seen: dict[str, torch.Tensor] = {}
    impl = cpu_attn.CPUAttentionBackendImpl.__new__(cpu_attn.CPUAttentionBackendImpl)
    impl.attn_type = "decoder"
    impl.kv_cache_dtype = "auto"
    impl.isa = "vec"  # 0.24-0.28 keep the ISA on the impl (0.29 on: on the layer)
    layer = types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    real = cpu_attn.ops
    cpu_attn.ops = types.SimpleNamespace(cpu_attn_reshape_and_cache=lambda key, value, k, v, *a, **kw: seen.update(
        k=k, v=v))
    try:
        empty = t.new_empty((0, t.shape[1], t.shape[-1] // 2))
        impl.do_kv_cache_update(layer, empty, empty, t, torch.empty(0, dtype=torch.long))
    finally:
        cpu_attn.ops = real
    return seen["k"], seen["v"]


def _roles(t: torch.Tensor, backend, spec) -> dict:
    """Each role's cells in layer view ``t`` as vLLM's backend reads them, and the cell sizes.

    K and V: split as the backend's forward does: packed ``(B, H, N, 2D)`` (0.26 on)
    ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` (flash_attn.py, triton_attn.py,
    flex_attention.py); ``(B, 2, N, H, D)`` (0.24-0.25) ``kv_cache.unbind(1)``. The per-token-head
    scales are the Triton impl's own views (``_ensure_scale_caches``).
    """
    es = t.element_size()
    if backend.is_mla():
        return {"roles": {"latent": _role_view(t, ("block", "token"))}, "cell_bytes": t.shape[-1] * es}
    kv_dim = t.dim() == 5
    if backend.get_name() == "CPU_ATTN":
        # the tensors vLLM's own CPU_ATTN cache update hands its kernel as K and V, captured: its
        # do_kv_cache_update (0.24 on: view(B, H, 2N, -1).chunk(2, dim=2), K's N rows then V's)
        k, v = _cpu_attn_key_value(t)
        dims = ("block", "head", "token")
        return {"roles": {"k": _role_view(k, dims), "v": _role_view(v, dims)}, "cell_bytes": t.shape[-1] * es}
    if kv_dim:
        k, v = t.unbind(1)
        cell = 2 * t.shape[-1] * es
    else:
        k, v = t.transpose(1, 2).split(t.shape[-1] // 2, dim=-1)
        cell = t.shape[-1] * es
    out = {"roles": {"k": _role_view(k, ("block", "token", "head")), "v": _role_view(v, ("block", "token", "head"))},
           "cell_bytes": cell}
    if spec.kv_quant_mode.is_per_token_head and backend.get_name() == "TRITON_ATTN":
        # STAND-IN: the impl object is created with __new__ (its __init__ checks the platform's
        # kernels); _ensure_scale_caches reads only the kv cache and the fields set here.
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

        impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
        impl._kv_quant_mode = spec.kv_quant_mode
        impl._k_scale_cache = impl._v_scale_cache = None
        impl._ensure_scale_caches(t)
        out["roles"]["k_scale"] = _role_view(impl._k_scale_cache, ("block", "token", "head"))
        out["roles"]["v_scale"] = _role_view(impl._v_scale_cache, ("block", "token", "head"))
        out["scale_bytes"] = impl._k_scale_cache.element_size()
        # the quantized data before the inline scale: the padded head less the fp32
        out["k_bytes"] = out["v_bytes"] = cell // 2 - out["scale_bytes"]
    else:
        out["k_bytes"] = out["v_bytes"] = cell // 2
    return out


def _geometry(case: dict) -> dict:
    head_order = case.get("head_order", "NHD")
    layout = case["layout"]
    if layout not in ("per_layer", "cross_layer"):
        raise ValueError(f"layout must be per_layer or cross_layer, got {layout!r}")
    _set_env_layout(None)
    # vLLM's own override hook for the head order (utils.py:183).
    backend_utils.set_kv_cache_layout(head_order)
    vc = _vllm_config(case, with_model=False)
    cache_dtype = case.get("kv_cache_dtype", "auto")
    try:
        with set_current_vllm_config(vc):
            kv_cache_config, attn_groups = _build_model(case, vc)
            kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
            device = torch.device("cpu")
            if layout == "cross_layer":
                # The real function, run on CPU (kv_connector_model_runner_mixin.py:164-255).
                kv_caches, _cross, _ = KVConnectorModelRunnerMixin.allocate_uniform_kv_caches(
                    kv_cache_config, attn_groups, cache_dtype, device, kernel_block_sizes
                )
            else:
                # The runner's per-layer path: module-level functions of
                # v1/worker/gpu/attn_utils.py (_allocate_kv_cache, _reshape_kv_cache);
                # GPUModelRunner._reshape_kv_cache_tensors (gpu_model_runner.py:7499)
                # reaches the same _reshape_attention_kv_cache with the same inputs.
                raw = attn_utils._allocate_kv_cache(kv_cache_config, {}, device)
                kv_caches = attn_utils._reshape_kv_cache(
                    [g for gs in attn_groups for g in gs],
                    raw,
                    cache_dtype,
                    kernel_block_sizes,
                    {},
                    kv_cache_config,
                )
            spec_of = {n: g for gs in attn_groups for g in gs for n in g.layer_names}
            storages: list[int] = []
            buffers: list[dict] = []
            layers = []
            for name in sorted(kv_caches, key=lambda s: int(s.split(".")[2])):
                t = kv_caches[name]
                st = t.untyped_storage()
                if st.data_ptr() not in storages:
                    storages.append(st.data_ptr())
                    buffers.append({"nbytes": st.nbytes()})
                es = t.element_size()
                g = spec_of[name]
                entry = {
                    "name": name,
                    "buffer": storages.index(st.data_ptr()),
                    "byte_offset": t.storage_offset() * es,
                    "shape": list(t.shape),
                    "byte_strides": [s * es for s in t.stride()],
                    "dtype": str(t.dtype).removeprefix("torch."),
                }
                if isinstance(g.kv_cache_spec, AttentionSpec):
                    entry.update(_roles(t, g.backend, g.kv_cache_spec))
                layers.append(entry)
            return {
                "buffers": buffers,
                "layers": layers,
                "kernel_block_sizes": list(kernel_block_sizes),
                "page_size_bytes": kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
                "num_blocks": kv_cache_config.num_blocks,
            }
    finally:
        backend_utils.set_kv_cache_layout(None)


def run_case(case: dict) -> dict:
    try:
        if case.get("facts"):
            return _facts(case)
        if case.get("gate"):
            return _gate(case)
        if "layout" in case:
            return _geometry(case)
        raise ValueError(f"unrecognised case keys: {sorted(case)}")
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return _err(e)


def main() -> int:
    cases = json.load(sys.stdin)
    results = [run_case(c) for c in cases]
    _STDOUT.write(json.dumps(results))
    _STDOUT.write("\n")
    _STDOUT.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
