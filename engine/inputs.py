"""Turn the keyword inputs of `LayoutEngine.decide` (and the CLI's flags) into a `Context`.

The same names as ``kvpolicy dry-run``'s flags: ``model`` or ``spec``,
``kv_cache_dtype``, ``block_size``, ``backend``, ``connector``,
``connector_config``; the pydantic models themselves are accepted too.
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any

from policy.backends import BackendProfile, ScaleViews
from policy.connectors import ConnectorConfig
from policy.context import Context, VllmOptions
from policy.errors import input_error
from policy.layouts import Layout
from policy.quant import ModelDtype, parse_kv_cache_dtype
from policy.releases import ReleaseProfile, Resolver, get_profile
from policy.spec import AttentionKind, KVCacheGroups, KVCacheSpec, make_model

__all__ = ["DEFAULT_EXAMPLE", "INPUT_NAMES", "build_context", "context_from_inputs"]

# `kvpolicy dry-run` with no arguments: Qwen2.5-0.5B geometry, TRITON_ATTN,
# OffloadingConnector, fp8_per_token_head -- the combination of vLLM #48412 --
# at the release's default block size.
DEFAULT_EXAMPLE: dict[str, Any] = {
    "spec": {"num_layers": 24, "num_kv_heads": 2, "head_size": 64, "dtype": "bfloat16"},
    "kv_cache_dtype": "fp8_per_token_head",
    "backend": "TRITON_ATTN",
    "connector": "OffloadingConnector",
}


def _spec(spec: KVCacheSpec | dict[str, Any], kv_cache_dtype: str | None, block_size: int | None) -> KVCacheSpec:
    if isinstance(spec, KVCacheSpec):
        data = spec.model_dump()
    elif isinstance(spec, dict):
        data = dict(spec)
    else:
        raise input_error("spec", f"`spec` must be a KVCacheSpec or a mapping, got {type(spec).__name__}")
    if kv_cache_dtype is not None:
        parse_kv_cache_dtype(kv_cache_dtype, ModelDtype.bfloat16)  # a located error with "did you mean"
        data["kv_cache_dtype"] = kv_cache_dtype
    if block_size is not None:
        data["block_size"] = block_size
    return make_model(KVCacheSpec, "spec", data)


def _connector(connector: str | ConnectorConfig | None, config: dict[str, Any] | None) -> ConnectorConfig | None:
    if connector is None or connector == "" or connector == "none":
        if config:
            raise input_error("connector_config", "`connector_config` given without a connector",
                              "name the connector with `connector` (--connector)")
        return None
    if isinstance(connector, ConnectorConfig):
        return connector
    if not isinstance(connector, str):
        raise input_error("connector", f"`connector` must be a name, got {type(connector).__name__}")
    if config is not None and not isinstance(config, dict):
        raise input_error("connector_config", "`connector_config` must be a mapping (JSON object)")
    return ConnectorConfig.from_vllm(connector, config)


def build_context(
    *,
    model: str | os.PathLike[str] | dict[str, Any] | None = None,
    spec: KVCacheSpec | dict[str, Any] | None = None,
    groups: KVCacheGroups | None = None,
    kv_cache_dtype: str | None = None,
    block_size: int | None = None,
    attention_backend: str | BackendProfile | None = None,
    backend: str | BackendProfile | None = None,
    scale_views: str | ScaleViews | None = None,
    connector: str | ConnectorConfig | None = None,
    connector_config: dict[str, Any] | None = None,
    tensor_parallel_size: int = 1,
    vllm_version: str | ReleaseProfile | None = None,
    vllm_kv_cache_layout: str | None = None,
    enable_extensible_kv_cache: bool = False,
    hisparse: bool = False,
    device_capability: int | None = None,
    use_v2_model_runner: bool = False,
) -> Context:
    """Validate and assemble the decision context; raises `InputError` / `ModelConfigError`.

    Names follow vLLM: ``attention_backend`` (``backend`` is an alias) is the
    backend's enum name, ``vllm_kv_cache_layout`` is ``VLLM_KV_CACHE_LAYOUT``,
    ``device_capability`` the CUDA capability's major number (FlashInfer's
    layouts depend on it), ``hisparse`` whether ``attention_config.hisparse_config``
    is set. ``vllm_version`` selects the release profile (default: the installed
    vLLM's, else the newest).
    """
    release = get_profile(vllm_version)
    if attention_backend is not None and backend is not None and attention_backend != backend:
        raise input_error("backend", "give `attention_backend` or its alias `backend`, not both")
    backend = attention_backend if attention_backend is not None else backend
    if backend is None:
        backend = "TRITON_ATTN"
    options = _options(release, vllm_kv_cache_layout, enable_extensible_kv_cache, hisparse, device_capability,
                       use_v2_model_runner)
    if model is not None and spec is not None:
        raise input_error("model", "give `model` or `spec`, not both")
    if groups is not None and not isinstance(groups, KVCacheGroups):
        raise input_error("groups", f"`groups` must be a KVCacheGroups, got {type(groups).__name__}",
                          "build one with KVCacheGroups(groups=(KVCacheGroup(spec=...), ...))")
    if tensor_parallel_size != 1 and model is None:
        raise input_error("tensor_parallel_size", "`tensor_parallel_size` applies to `model` only",
                          "a `spec` already gives the KV heads of one rank (`num_kv_heads`)")
    if model is not None:
        from policy.hf_config import kv_groups_from_hf_config

        groups = kv_groups_from_hf_config(
            model, kv_cache_dtype=kv_cache_dtype or "auto",
            block_size=release.default_block_size if block_size is None else block_size,
            tensor_parallel_size=tensor_parallel_size,
        )
        if not groups.groups:
            raise input_error("model", "the model config describes no KV cache layers")
        kv = groups.primary
    elif spec is not None:
        if block_size is None and isinstance(spec, dict) and "block_size" not in spec:
            block_size = release.default_block_size  # vLLM's default --block-size
        kv = _spec(spec, kv_cache_dtype, block_size)
        if groups is None:
            groups = KVCacheGroups.single(kv)
    elif groups is not None and groups.primary is not None:
        kv = groups.primary
    else:
        raise input_error("spec", "no KV cache described", "pass `model` (a config.json) or `spec`")
    if isinstance(backend, BackendProfile):
        profile = backend
    elif isinstance(backend, str):
        profile = release.backend(backend)
    else:
        raise input_error("attention_backend", f"`attention_backend` must be a name, got {type(backend).__name__}")
    if scale_views is not None:
        try:
            profile = profile.with_scale_views(ScaleViews(scale_views))
        except ValueError:
            raise input_error("scale_views", f"unknown scale-view strategy `{scale_views}`",
                              "valid: " + ", ".join(s.value for s in ScaleViews)) from None
    if profile.mla != (kv.kind is AttentionKind.mla):
        mla_names = ", ".join(n for n, b in release.backends.items() if b.mla)
        want = f"an MLA backend ({mla_names})" if not profile.mla else "an MLA spec (kind mla)"
        raise input_error("backend", f"backend `{profile.name}` does not fit a `{kv.kind.value}` KV spec",
                          f"use {want}", code="backend-mismatch")
    if kv.kv_cache_dtype not in release.kv_cache_dtypes:
        raise input_error("kv_cache_dtype", f"vLLM profile `{release.name}` has no kv_cache_dtype "
                          f"`{kv.kv_cache_dtype}`", "valid: " + ", ".join(release.kv_cache_dtypes),
                          code="unknown-kv-cache-dtype")
    facts = release.backends.get(profile.name)
    if (kv.kind.is_attention and facts is not None and facts.kv_cache_dtypes is not None
            and kv.kv_cache_dtype not in facts.kv_cache_dtypes):
        # vLLM refuses the backend at selection: validate_configuration's "kv_cache_dtype not supported"
        raise input_error("kv_cache_dtype", f"attention backend `{profile.name}` of `{release.name}` does not "
                          f"support kv_cache_dtype `{kv.kv_cache_dtype}`",
                          "its supported_kv_cache_dtypes: " + ", ".join(facts.kv_cache_dtypes),
                          code="unsupported-kv-cache-dtype")
    candidates = _candidates(release, profile, options)
    return Context(kv=kv, groups=groups, backend=profile, connector=_connector(connector, connector_config),
                   profile=release.name, candidates=candidates, options=options)


def _options(release: ReleaseProfile, layout: str | None, extensible: Any, hisparse: Any,
             capability: Any, v2_runner: Any = False) -> VllmOptions:
    if layout is not None and layout != "":
        if not isinstance(layout, str):
            raise input_error("vllm_kv_cache_layout", "`vllm_kv_cache_layout` must be a layout name")
        # 0.29+ takes a KVCacheLayout name or the NHD/HND aliases; the uniform-gate releases NHD or HND only.
        names = [] if release.resolver is Resolver.uniform_gate else [x.value for x in Layout]
        valid = [*names, "NHD", "HND"]
        if layout not in valid:
            raise input_error("vllm_kv_cache_layout", f"unknown VLLM_KV_CACHE_LAYOUT `{layout}`",
                              "valid: " + ", ".join(valid), code="unknown-layout")
    for name, value in (("enable_extensible_kv_cache", extensible), ("hisparse", hisparse),
                        ("use_v2_model_runner", v2_runner)):
        if not isinstance(value, bool):
            raise input_error(name, f"`{name}` must be true or false, got `{value!r}`")
    if capability is not None and (isinstance(capability, bool) or not isinstance(capability, int)
                                   or not 0 < capability < 100):
        raise input_error("device_capability", f"`device_capability` must be a CUDA capability major number "
                          f"such as 9 or 10, got `{capability!r}`")
    return VllmOptions(kv_cache_layout=layout or None, enable_extensible_kv_cache=extensible, hisparse=hisparse,
                       device_capability=capability, use_v2_model_runner=v2_runner)


def _candidates(release: ReleaseProfile, backend: BackendProfile, options: VllmOptions) -> tuple[Layout, ...]:
    """The release's layouts this backend declares and has a geometry for, most preferred first."""
    if backend.name in release.backends:
        declared = release.declared_layouts([[backend.name]], options.device_capability)
    else:  # a BackendProfile the release does not know: its own declaration, else the release's default
        declared = backend.supported_layouts or release.default_layout_preference
    return tuple(x for x in declared if x in release.layouts and x in backend.orders)


INPUT_NAMES: tuple[str, ...] = tuple(inspect.signature(build_context).parameters)


def context_from_inputs(inputs: dict[str, Any]) -> Context:
    """`build_context` for keyword inputs a caller typed: an unknown name is an `InputError`
    with a "did you mean", not a Python `TypeError`."""
    for name in inputs:
        if name not in INPUT_NAMES:
            close = difflib.get_close_matches(name, INPUT_NAMES, n=1)
            raise input_error(name, f"unknown input `{name}`",
                              (f"did you mean `{close[0]}`? " if close else "") + "inputs: " + ", ".join(INPUT_NAMES),
                              code="unknown-input")
    return build_context(**inputs)
