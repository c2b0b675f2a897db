"""The environment variables vLLM reads on the KV cache layout's decision path, read as the release reads them.

Found by reading each release's ``envs.VLLM_*`` uses in the layout, backend-selection, connector and
config code (``v1/attention/backends/utils.py``, ``v1/kv_cache_layout.py``, ``v1/attention/selector.py``,
``platforms/``, ``distributed/kv_transfer/``, ``v1/worker/kv_connector_model_runner_mixin.py``,
``config/``) of 0.24.0-0.34.0. Each is used, or said to be ignored and why:

- ``VLLM_KV_CACHE_LAYOUT`` (every release; ``env_with_choices``, case-sensitive): used as
  ``vllm_kv_cache_layout``. 0.24-0.28 take ``NHD``/``HND`` (``get_kv_cache_layout``: the head order,
  overriding the connector's), 0.29+ a ``KVCacheLayout`` name or those aliases (``resolve_kv_cache_layout``).
  ``--vllm-kv-cache-layout`` wins over it.
- ``VLLM_USE_V2_MODEL_RUNNER`` (0.24-0.33, ``bool(int(value))``): used as ``use_v2_model_runner`` where the
  gate decides (0.24-0.28: the V2 runner never allocates cross-layer); 0.29-0.33 read it but resolve the
  layout in the engine core before any runner allocates; 0.34 does not read it.
- ``VLLM_MLA_DISABLE`` (``bool(int(value))``): vLLM then serves an MLA model without MLA
  (``ModelConfig.use_mla``); kvpolicy reads MLA from the config and refuses to guess the other geometry.
- ``VLLM_BATCH_INVARIANT``: vLLM's backend selection skips backends without batch invariance;
  kvpolicy's default backend does not, so a configured backend is asked for.
- ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE`` (every release, ``bool(int(value))``, default 1):
  used as ``allow_chunked_local_attn_with_hybrid_kv_cache``. At 0, ``VllmConfig.__post_init__`` turns the
  hybrid KV cache manager off for a model with chunked local attention (Llama-4), and its chunked-local
  layers are cached as full attention in one group (`kvpolicy.engine.inputs.hybrid_manager_off`).
- ``VLLM_USE_SIMPLE_KV_OFFLOAD``: which connector ``--kv-offloading-size`` configures; kvpolicy refuses
  that argument (`kvpolicy.engine.vllm_args.NOT_MODELLED`), so the variable has nothing to act on.

Not on the decision path (read by those files for other things, so not said): the connectors' network
and timeout settings (``VLLM_NIXL_SIDE_CHANNEL_*``, ``VLLM_MOONCAKE_*``), ``VLLM_CONFIDENTIAL_COMPUTE``
(staging buffers), compilation and debugging switches. ``VLLM_TARGET_DEVICE`` (the platform) and
``VLLM_ATTENTION_BACKEND`` (read by none of these releases) are said by ``dry-run`` itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import input_error
from kvpolicy.policy.releases import ReleaseProfile, Resolver
from kvpolicy.policy.spec import AttentionKind

__all__ = ["DECISION_VARIABLES", "EnvReading", "check_env_against", "read_vllm_env", "reads"]

# variable -> the last vLLM series that reads it (None: every profiled release); checked against
# each release's `vllm.envs.environment_variables` by tests/conformance/test_serve_args.py
DECISION_VARIABLES: dict[str, tuple[int, int] | None] = {
    "VLLM_KV_CACHE_LAYOUT": None,
    "VLLM_USE_V2_MODEL_RUNNER": (0, 33),
    "VLLM_MLA_DISABLE": None,
    "VLLM_BATCH_INVARIANT": None,
    "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": None,
    "VLLM_USE_SIMPLE_KV_OFFLOAD": None,
}


@dataclass(frozen=True)
class EnvReading:
    """The decision's keywords the environment gives, and what to say about it."""

    inputs: dict[str, Any]
    notes: tuple[str, ...]


def _series(release: ReleaseProfile) -> tuple[int, int] | None:
    if not release.vllm_versions:
        return None  # a development state: taken as reading what the releases read
    major, minor = release.vllm_versions[0].split(".")[:2]
    return int(major), int(minor)


def reads(release: ReleaseProfile, name: str) -> bool:
    """Whether ``release``'s ``vllm.envs`` has variable ``name``."""
    last = DECISION_VARIABLES[name]
    series = _series(release)
    return last is None or series is None or series <= last


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    """``bool(int(value))``, as vLLM reads these variables; None when unset; a located error otherwise."""
    value = environ.get(name)
    if value is None:
        return None
    try:
        return bool(int(value))
    except ValueError:
        raise input_error(name, f"{name}={value!r}: vLLM reads it as an integer (bool(int(value))) and stops "
                          "at start-up on this value", f"set {name}=0 or {name}=1, or unset it",
                          code="invalid-environment") from None


def read_vllm_env(environ: Mapping[str, str], release: ReleaseProfile, *, layout_flag: str | None,
                  v2_runner_flag: bool | None, chunked_local_flag: int | None = None) -> EnvReading:
    """The keywords and notes of the variables vLLM ``release`` reads for this decision.

    ``layout_flag`` / ``v2_runner_flag`` / ``chunked_local_flag``: what the user passed explicitly
    (``--vllm-kv-cache-layout``, ``--use-v2-model-runner``, ``--allow-chunked-local-attn-with-hybrid-kv-cache``);
    an explicit flag wins over the variable, and the note says so."""
    inputs: dict[str, Any] = {}
    notes: list[str] = []
    label = release.version_label
    layout = environ.get("VLLM_KV_CACHE_LAYOUT")
    if layout is not None:
        valid = release.kv_cache_layout_values()
        if layout not in valid:  # env_with_choices: case-sensitive, an empty value refused too
            raise input_error("VLLM_KV_CACHE_LAYOUT", f"VLLM_KV_CACHE_LAYOUT={layout!r} is not a value {label} "
                              "accepts (vLLM stops at start-up: \"Invalid value\")",
                              "valid: " + ", ".join(valid) + "; or unset it", code="unknown-layout")
        if layout_flag is not None:
            if layout_flag != layout:
                notes.append(f"note: VLLM_KV_CACHE_LAYOUT={layout} is set, but --vllm-kv-cache-layout {layout_flag} "
                             "wins (the explicit flag; vLLM itself would read the variable)")
        else:
            inputs["vllm_kv_cache_layout"] = layout
            what = ("the head order, over the connector's" if release.resolver is Resolver.uniform_gate
                    else "the layout, if the backends support it")
            notes.append(f"note: VLLM_KV_CACHE_LAYOUT={layout} read from the environment and used as {label} uses "
                         f"it ({what}); --vllm-kv-cache-layout overrides it")
    v2 = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if v2 is not None:
        if not reads(release, "VLLM_USE_V2_MODEL_RUNNER"):
            notes.append(f"note: VLLM_USE_V2_MODEL_RUNNER is set, but {label} does not read it; ignored")
        elif release.resolver is not Resolver.uniform_gate:
            _flag(environ, "VLLM_USE_V2_MODEL_RUNNER")
            notes.append(f"note: VLLM_USE_V2_MODEL_RUNNER={v2} is set; {label} resolves the layout in the engine "
                         "core, before any model runner allocates, so it does not bear on this decision")
        else:
            value = _flag(environ, "VLLM_USE_V2_MODEL_RUNNER")
            if v2_runner_flag:
                if not value:
                    notes.append(f"note: VLLM_USE_V2_MODEL_RUNNER={v2} is set, but --use-v2-model-runner wins")
            else:
                inputs["use_v2_model_runner"] = value
                notes.append(f"note: VLLM_USE_V2_MODEL_RUNNER={v2} read from the environment: the workers "
                             f"{'run' if value else 'do not run'} vLLM's model runner V2 (as {label} reads it)")
    batch = _flag(environ, "VLLM_BATCH_INVARIANT")
    if batch:
        notes.append("warning: VLLM_BATCH_INVARIANT=1: vLLM then selects only batch-invariant attention "
                     "backends and checks the configured one; kvpolicy does not model that, so pass the backend "
                     "vLLM runs with --attention-backend")
    chunked = _flag(environ, "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE")
    if chunked is not None and chunked_local_flag is not None:
        if bool(chunked_local_flag) != chunked:
            notes.append(f"note: VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE={int(chunked)} is set, but "
                         f"--allow-chunked-local-attn-with-hybrid-kv-cache {chunked_local_flag} wins (the explicit "
                         "flag; vLLM itself would read the variable)")
    elif chunked is not None:
        inputs["allow_chunked_local_attn_with_hybrid_kv_cache"] = chunked
        notes.append(f"note: VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE={int(chunked)} read from the "
                     f"environment as {label} reads it: " + ("a model with chunked local attention keeps the hybrid "
                     "KV cache manager (vLLM's default)" if chunked else "a model with chunked local attention runs "
                     "without the hybrid KV cache manager, its chunked-local layers cached as full attention in "
                     "one group"))
    if _flag(environ, "VLLM_USE_SIMPLE_KV_OFFLOAD") is not None:
        notes.append("note: VLLM_USE_SIMPLE_KV_OFFLOAD is ignored: it only chooses the connector that "
                     "--kv-offloading-size configures, and kvpolicy takes the connector from --connector or "
                     "--kv-transfer-config")
    _flag(environ, "VLLM_MLA_DISABLE")  # checked now: a bad value is refused before anything is decided
    return EnvReading(inputs=inputs, notes=tuple(notes))


def check_env_against(environ: Mapping[str, str], ctx: Context) -> None:
    """Refuse what the environment changes about the decided model that kvpolicy cannot follow:
    ``VLLM_MLA_DISABLE=1`` with an MLA model (vLLM then serves it without MLA)."""
    if _flag(environ, "VLLM_MLA_DISABLE") and any(g.spec.kind is AttentionKind.mla for g in ctx.groups.groups):
        raise input_error("VLLM_MLA_DISABLE", "VLLM_MLA_DISABLE=1: vLLM serves this MLA model without MLA (full "
                          "attention over the model's own heads), which kvpolicy does not derive from the config",
                          "unset VLLM_MLA_DISABLE, or describe the geometry vLLM then uses with --spec",
                          code="invalid-environment")
