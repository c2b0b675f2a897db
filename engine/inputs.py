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

from policy.backends import BACKENDS, BackendProfile, ScaleViews, get_backend
from policy.connectors import ConnectorConfig
from policy.context import Context
from policy.errors import input_error
from policy.quant import ModelDtype, parse_kv_cache_dtype
from policy.spec import AttentionKind, KVCacheGroups, KVCacheSpec, make_model

__all__ = ["DEFAULT_EXAMPLE", "INPUT_NAMES", "build_context", "context_from_inputs"]

# `kvpolicy dry-run` with no arguments: Qwen2.5-0.5B geometry, TRITON_ATTN,
# OffloadingConnector, fp8_per_token_head -- the combination of vLLM #48412.
DEFAULT_EXAMPLE: dict[str, Any] = {
    "spec": {"num_layers": 24, "block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "bfloat16"},
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
    backend: str | BackendProfile = "TRITON_ATTN",
    scale_views: str | ScaleViews | None = None,
    connector: str | ConnectorConfig | None = None,
    connector_config: dict[str, Any] | None = None,
    tensor_parallel_size: int = 1,
) -> Context:
    """Validate and assemble the decision context; raises `InputError` / `ModelConfigError`."""
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
            model, kv_cache_dtype=kv_cache_dtype or "auto", block_size=block_size or 16,
            tensor_parallel_size=tensor_parallel_size,
        )
        if not groups.groups:
            raise input_error("model", "the model config describes no KV cache layers")
        kv = groups.primary
    elif spec is not None:
        kv = _spec(spec, kv_cache_dtype, block_size)
        if groups is None:
            groups = KVCacheGroups.single(kv)
    elif groups is not None and groups.primary is not None:
        kv = groups.primary
    else:
        raise input_error("spec", "no KV cache described", "pass `model` (a config.json) or `spec`")
    profile = backend if isinstance(backend, BackendProfile) else get_backend(str(backend))
    if scale_views is not None:
        try:
            profile = profile.with_scale_views(ScaleViews(scale_views))
        except ValueError:
            raise input_error("scale_views", f"unknown scale-view strategy `{scale_views}`",
                              "valid: " + ", ".join(s.value for s in ScaleViews)) from None
    if profile.mla != (kv.kind is AttentionKind.mla):
        want = "an MLA backend (" + ", ".join(n for n, b in BACKENDS.items() if b.mla) + ")" if not profile.mla \
            else "an MLA spec (kind mla)"
        raise input_error("backend", f"backend `{profile.name}` does not fit a `{kv.kind.value}` KV spec",
                          f"use {want}", code="backend-mismatch")
    return Context(kv=kv, groups=groups, backend=profile, connector=_connector(connector, connector_config))


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
