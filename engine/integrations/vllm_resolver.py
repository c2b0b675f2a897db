"""kvpolicy as vLLM 0.29+'s KV cache layout resolution, answered by the rules.

vLLM's engine core resolves one ``KVCacheLayout`` for the whole model, once,
before memory profiling (``vllm/v1/engine/core.py``)::

    layout = resolve_kv_cache_layout(vllm_config, model_executor.get_supported_kv_cache_layouts(), specs)

and distributes it to every worker (``set_kv_cache_layout``, then
``KVCacheConfig.kv_cache_layout``), so every rank allocates the same layout.
`make_resolver` returns a function with that signature that decides with a
`LayoutEngine` from the same inputs vLLM's resolver reads:

- ``supported_layouts``: each worker's layout names, most preferred first; merged
  as vLLM merges them (workers that report vLLM's default preference do not
  vote), they are the candidates, so the answer is always a layout every worker
  can run;
- ``kv_cache_specs``: the layers' specs, one kvpolicy group per distinct spec
  with per-layer views (``has_layer_views``), each checked to have vLLM's own
  ``(num_heads, num_states, page_size_bytes)``;
- ``vllm_config``: ``kv_transfer_config`` (the connector as configured, by the
  name vLLM registers it under, MultiConnector members from its extra config),
  ``cache_config.enable_extensible_kv_cache``, ``attention_config.hisparse_config``;
- ``VLLM_KV_CACHE_LAYOUT``, the device capability and the attention backends
  vLLM selects for the model's layers (the backend the decision names, so that
  its fingerprint describes the bytes the workers write), which the plugin
  reads from vLLM and passes in.

Nothing here imports vLLM; the plugin (`kvpolicy.engine.integrations.vllm_plugin`) hands
in vLLM's ``KVCacheLayout`` enum and the readers that need vLLM. A rule set
that leaves no layout, or a KV cache kvpolicy cannot describe, raises
`StartupError` (a ``ValueError``, as vLLM's own resolution raises), with every
rule that removed a candidate located (file:line): vLLM does not start, and
never falls back silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

from kvpolicy.engine.decision import Decision
from kvpolicy.engine.inputs import build_context
from kvpolicy.engine.integrations.vllm import (
    _MODEL_DTYPES,
    KV_TRANSFER_EXTRA,
    StartupError,
    _dtype_name,
    _kind,
    _kv_cache_dtype,
    attention_fields,
    has_rules,
    own_rule_id,
)
from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.policy.backends import BackendProfile, packed_backend
from kvpolicy.policy.connectors import ConnectorConfig
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import Diagnostic, InputError, NoLayoutError, PolicyError, input_error
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.quant import ModelDtype, parse_kv_cache_dtype
from kvpolicy.policy.releases import ReleaseProfile, _merge
from kvpolicy.policy.rule_model import Rule
from kvpolicy.policy.ruleset import RuleSet, Source
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec, make_model

__all__ = [
    "OWN_LAYOUT_WEIGHT",
    "VLLM_LAYOUT_ALIASES",
    "check_vllm_requirements",
    "kv_cache_groups",
    "make_resolver",
    "resolve",
    "resolver_context",
    "vllm_layout",
    "worker_candidates",
]

# The weight of the synthetic prefer rule standing for the required layout of a connector the
# rules do not know: the shipped connector files prefer their required layout with 10.
OWN_LAYOUT_WEIGHT = 10

# vLLM 0.29+ still reads the head-order names of earlier releases as layouts (vllm/config/cache.py
# _LAYOUT_COMPAT_ALIASES), wherever it parses a layout name: workers' reports, VLLM_KV_CACHE_LAYOUT and a
# connector's get_required_kvcache_layout, whose docstring still says "e.g. HND, or NHD".
VLLM_LAYOUT_ALIASES = {"NHD": Layout.LBNHC, "HND": Layout.LBHNC}


def vllm_layout(name: Any) -> Layout:
    """A layout name as vLLM 0.29+ parses it (``_layout_from_name``): a ``KVCacheLayout`` member or
    its name, or a legacy head-order alias. Raises ValueError for anything else."""
    text = str(getattr(name, "name", name))
    alias = VLLM_LAYOUT_ALIASES.get(text)
    return alias if alias is not None else Layout(text)


# ---------------------------------------------------------------- candidates


def worker_candidates(release: ReleaseProfile, supported_layouts: Sequence[Sequence[str]]) -> tuple[Layout, ...]:
    """The workers' reported layouts merged as vLLM's engine core merges them: workers reporting
    the default preference (no backend declared a set) do not vote; the rest are intersected and
    ranked by how many put each first (vLLM's ``_merge_supported_layouts``). Empty: no layout fits
    every worker. An empty or unknown report is an `InputError`, and so are reports that differ
    where the release asserts that they agree (0.29-0.33)."""
    if not supported_layouts:
        raise input_error("supported_layouts", "no worker reported supported KV cache layouts",
                          code="no-supported-layouts")
    reports = []
    for i, names in enumerate(supported_layouts):
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise input_error(f"supported_layouts[{i}]", f"worker {i} reported `{str(names)[:40]}`, not a list of "
                              "layout names", code="unknown-layout")
        if not names:
            raise input_error(f"supported_layouts[{i}]", f"worker {i} reported no supported KV cache layouts",
                              code="no-supported-layouts")
        try:
            reports.append(tuple(vllm_layout(n) for n in names))
        except ValueError:
            raise input_error(f"supported_layouts[{i}]", f"worker {i} reported layouts {list(names)}, not all of "
                              f"which vLLM profile `{release.name}` has",
                              "valid: " + ", ".join(x.value for x in release.layouts),
                              code="unknown-layout") from None
    if release.workers_must_agree and any(r != reports[0] for r in reports[1:]):
        shown = "; ".join(f"worker {i} [{', '.join(str(x) for x in r)}]" for i, r in enumerate(reports))
        raise input_error("supported_layouts", f"{release.version_label} requires every worker to report the "
                          f"same supported KV cache layouts, and these differ: {shown}",
                          "run the same attention backends on every worker (pipeline stage) for this release "
                          "(vLLM refuses this too: \"Workers disagree on supported KV cache layouts\")",
                          code="workers-disagree")
    voting = [r for r in reports if r != release.default_layout_preference] or reports
    return tuple(x for x in _merge(voting) if x in release.layouts)


# ---------------------------------------------------------------- specs


def _spec_kv_cache_dtype(spec: Any, configured: str | None, model_dtype: ModelDtype) -> str:
    """The spec's ``kv_cache_dtype``: the configured ``cache_config.cache_dtype`` when it means the
    spec's format (``fp8_e4m3`` stays ``fp8_e4m3``), else the one its quant mode and dtype give."""
    derived = _kv_cache_dtype(spec, None)
    if configured and configured != derived:
        try:
            if parse_kv_cache_dtype(configured, model_dtype) == parse_kv_cache_dtype(derived, model_dtype):
                return configured
        except (PolicyError, ValueError):
            pass
    return derived


def _vllm_hnc(spec: Any) -> tuple[int, int, int] | None:
    try:
        return (int(spec.num_heads), int(spec.num_states), int(spec.page_size_bytes))
    except Exception:  # a spec class without the properties: nothing to compare
        return None


def _convert(spec: Any, num_layers: int, configured: str | None, model_dtype: ModelDtype, where: str
             ) -> KVCacheSpec:
    kind = _kind(spec)
    theirs = _vllm_hnc(spec)
    if kind is AttentionKind.mamba:
        # A recurrent state: one "head" of one state, the page vLLM gives it.
        page = theirs[2] if theirs is not None else None
        if page is None:
            raise input_error(where, f"`{type(spec).__name__}` has no page_size_bytes", code="unknown-spec")
        data: dict[str, Any] = {"kind": kind, "num_layers": num_layers, "block_size": 1, "num_kv_heads": 1,
                                "head_size": 1, "page_size_padded": page}
    else:
        data = attention_fields(spec, kind, num_layers, _spec_kv_cache_dtype(spec, configured, model_dtype),
                                model_dtype)
    ours = make_model(KVCacheSpec, where, data)
    if theirs is not None and ours.hnc_shape != theirs:
        raise input_error(where, f"vLLM's `{type(spec).__name__}` has (heads, states, page bytes) {theirs}, "
                          f"kvpolicy's model of it {ours.hnc_shape}",
                          "kvpolicy cannot describe this KV cache; unset KVPOLICY_RULES to let vLLM decide",
                          code="spec-not-modelled")
    return ours


def kv_cache_groups(specs: Iterable[Any], *, workers_per_stage: int = 1, kv_cache_dtype: str | None = None,
                    model_dtype: str | None = None) -> KVCacheGroups | None:
    """vLLM's KV cache specs (every worker's layers, flattened, as the engine core passes them) as
    kvpolicy groups: one per distinct spec with per-layer views, in order of first appearance, its
    ``num_layers`` the layers reporting it over ``workers_per_stage`` (tensor-parallel ranks report
    the same layers). None when no spec has per-layer views (an attention-free model)."""
    distinct: list[tuple[Any, int]] = []
    for spec in specs:
        if getattr(spec, "has_layer_views", True) is False:
            continue  # vLLM's resolver ignores specs that lay out their own raw tensor
        for i, (seen, count) in enumerate(distinct):
            if seen is spec or seen == spec:
                distinct[i] = (seen, count + 1)
                break
        else:
            distinct.append((spec, 1))
    if not distinct:
        return None
    dtype = model_dtype if model_dtype in _MODEL_DTYPES else ModelDtype.bfloat16.value
    # vLLM's DCP check looks at the sharding of attention specs that take a slot mapping; a spec that
    # addresses its own pages (uses_slot_mapping false) gets a sharding already present, so it adds none.
    sharding = [s.dcp_sharded for s, _ in distinct if getattr(s, "uses_slot_mapping", True) is not False
                and isinstance(getattr(s, "dcp_sharded", None), bool)]
    groups = []
    for i, (spec, count) in enumerate(distinct):
        layers = count // workers_per_stage if workers_per_stage > 1 and count % workers_per_stage == 0 else count
        converted = _convert(spec, max(1, layers), kv_cache_dtype, ModelDtype(dtype), f"kv_cache_specs[{i}]")
        sharded = getattr(spec, "dcp_sharded", True)
        if getattr(spec, "uses_slot_mapping", True) is False or not isinstance(sharded, bool):
            sharded = sharding[0] if sharding else True
        groups.append(KVCacheGroup(spec=converted, dcp_sharded=sharded))
    return KVCacheGroups(groups=tuple(groups))


# ---------------------------------------------------------------- context


def _enum_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value.name if isinstance(value, Enum) else value)


def _connector(vllm_config: Any) -> ConnectorConfig | None:
    """The configured connector (None without one), checked as the CLI's ``--kv-transfer-config`` is
    (`ConnectorConfig.from_vllm`); what it cannot read is an `InputError` at the field."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(ktc, "kv_connector", None)
    if ktc is None or name is None:
        return None
    if not isinstance(name, str) or not name:
        raise input_error("kv_transfer_config.kv_connector", f"`kv_connector` must be a connector name, got "
                          f"`{name!r}`")
    extra = getattr(ktc, "kv_connector_extra_config", None)
    if extra is not None and not isinstance(extra, Mapping):
        raise input_error(KV_TRANSFER_EXTRA, f"`kv_connector_extra_config` must be a mapping, got "
                          f"{type(extra).__name__}")
    return ConnectorConfig.from_vllm(name, None if extra is None else dict(extra), where=KV_TRANSFER_EXTRA)


def _backend(release: ReleaseProfile, vllm_config: Any, mla: bool, candidates: tuple[Layout, ...],
             selected: Sequence[str] = (), device_capability: int | None = None) -> BackendProfile:
    """The backend whose bytes the workers write: the one vLLM's selector picks for the model (``selected``,
    by name), when it is one backend the release knows and it is what the workers reported (a worker
    running it reports its declared layouts: ``candidates``); else the configured ``--attention-backend``;
    either only when it can view every candidate. Else ``auto``, a packed backend (nothing tells which
    backend the workers run; the plugin says so when it logs the decision)."""
    distinct = list(dict.fromkeys(selected))
    workers = [name for name in distinct[:1] if len(distinct) == 1 and name in release.backends
               and release.declared_layouts([[name]], device_capability) == candidates]
    configured = _enum_name(getattr(getattr(vllm_config, "attention_config", None), "backend", None))
    for name in [*workers, configured]:
        if name in release.backends:
            known = release.backend(name)
            if known.mla == mla and all(x in known.orders for x in candidates):
                return known
    return packed_backend("auto", mla=mla, layouts=release.layouts, layer_buffers=release.layer_buffers)


def resolver_context(vllm_config: Any, supported_layouts: Sequence[Sequence[str]], kv_cache_specs: Iterable[Any],
                     *, release: ReleaseProfile, vllm_kv_cache_layout: str | None = None,
                     device_capability: int | None = None, attention_backends: Sequence[str] = ()) -> Context | None:
    """The decision `Context` for vLLM's resolver inputs; None for a model without per-layer KV views
    (nothing to lay out). ``attention_backends``: the backends vLLM selects for the model's layers, by
    name (the backend the context names, so its fingerprint describes the workers' bytes). Raises
    `InputError` for what kvpolicy cannot describe."""
    candidates = worker_candidates(release, supported_layouts)
    cache_config = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    stages = getattr(parallel, "pipeline_parallel_size", 1)
    stages = stages if isinstance(stages, int) and stages > 0 else 1
    workers_per_stage = len(supported_layouts) // stages if len(supported_layouts) % stages == 0 else 1
    configured = getattr(cache_config, "cache_dtype", None)
    model_dtype = _dtype_name(getattr(getattr(vllm_config, "model_config", None), "dtype", None))
    groups = kv_cache_groups(kv_cache_specs, workers_per_stage=max(1, workers_per_stage),
                             kv_cache_dtype=configured if isinstance(configured, str) else None,
                             model_dtype=model_dtype)
    if groups is None:
        return None
    primary = groups.primary
    assert primary is not None
    backend = _backend(release, vllm_config, primary.kind is AttentionKind.mla, candidates, attention_backends,
                       device_capability)
    hisparse = getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None
    extensible = getattr(cache_config, "enable_extensible_kv_cache", False) is True
    ctx = build_context(groups=groups, attention_backend=backend, connector=_connector(vllm_config),
                        vllm_kv_cache_layout=vllm_kv_cache_layout, enable_extensible_kv_cache=extensible,
                        hisparse=hisparse, device_capability=device_capability, vllm_version=release)
    return ctx.model_copy(update={"candidates": tuple(x for x in candidates if x in backend.orders)})


# ---------------------------------------------------------------- deciding


def _own_layouts(release: ReleaseProfile, ruleset: RuleSet, conn: ConnectorConfig | None,
                 reported: Iterable[tuple[str, Any]]) -> dict[str, Layout]:
    """The layouts vLLM's ``get_required_kvcache_layout`` gives for the connectors in ``conn``'s tree
    that the rules have no file for: ``reported`` is (``kv_connector`` name, answer) for each connector
    vLLM configured (a MultiConnector's members, not the MultiConnector). None answers do not count.
    Raises `StartupError` where vLLM refuses: an answer it cannot parse, or members whose answers
    differ (vLLM's MultiConnector compares them as written, so HND and LBHNC differ too)."""
    wanted: dict[str, Layout] = {}
    if conn is None:
        return wanted
    answers = [(name, answer) for name, answer in reported if answer is not None]
    if len({str(answer) for _, answer in answers}) > 1:
        raise StartupError("kvpolicy: the KV connectors require different KV cache layouts; vLLM must not start:",
                           [Diagnostic(f"<vllm:{name}.get_required_kvcache_layout>", 0, 0, "layout-mismatch",
                                       f"returned `{answer}`", "vLLM's MultiConnector needs every member that "
                                       "requires a layout to name the same one, as written")
                            for name, answer in answers])
    ruleless = {c.name for c in _tree(conn) if not c.is_composite and not has_rules(ruleset, release, c.name, c.extra)}
    for name, answer in answers:
        if name not in ruleless:
            continue
        try:
            wanted[name] = vllm_layout(answer)
        except ValueError:
            raise StartupError(f"kvpolicy: the KV connector `{name}` requires a KV cache layout vLLM does not "
                               "know; vLLM must not start:",
                               [Diagnostic(f"<vllm:{name}.get_required_kvcache_layout>", 0, 0, "unknown-layout",
                                           f"returned `{answer}`",
                                           "valid: " + ", ".join(x.value for x in release.layouts)
                                           + ", or the legacy NHD, HND")]) from None
    return wanted


def _tree(conn: ConnectorConfig) -> list[ConnectorConfig]:
    out, stack = [], [conn]
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.connectors)
    return out


def _with_connector_layouts(ruleset: RuleSet, wanted: dict[str, Layout]) -> RuleSet:
    """``ruleset`` plus, for each connector the rules do not know, a prefer rule in its scope for the
    layout vLLM's ``get_required_kvcache_layout`` gives it (``wanted``), used as vLLM uses it: when
    VLLM_KV_CACHE_LAYOUT is unset (as a MultiConnector member too, where vLLM asks every member)."""
    if not wanted:
        return ruleset
    entries = [(r.rule, r.source, r.scope) for r in ruleset.rules]
    for name, layout in sorted(wanted.items()):
        rule = Rule.model_validate({
            "id": own_rule_id("vllm-own-layout", name),
            "description": (f"`{name}` has no rules in this rule set; vLLM's get_required_kvcache_layout "
                            f"asks for {layout}, so kvpolicy prefers it as vLLM would"),
            "when": {"field": "env.VLLM_KV_CACHE_LAYOUT", "exists": False},
            "prefer": {"layout": layout.value},
            "weight": OWN_LAYOUT_WEIGHT,
        })
        entries.append((rule, Source(f"<vllm:{name}.get_required_kvcache_layout>", 1), name))
    return RuleSet.build(entries, ruleset.layout_order, ruleset.member_preferences, ruleset.root,
                         order_declared=ruleset.order_declared)


# vLLM's own narrowing of the candidates in resolve_kv_cache_layout (vllm/v1/attention/backends/utils.py):
# not a preference but what its allocation needs. The shipped rules carry each as a rule of the same id;
# a rule set written without one would otherwise hand vLLM a layout it never resolves to itself.
# (fields that must all hold, the layout property vLLM then requires, the shipped rule, why)
_VLLM_REQUIREMENTS: tuple[tuple[tuple[str, ...], str, str, str], ...] = (
    (("groups.mixed_hnc_shapes",), "is_block_compact", "mixed-hnc-shapes-need-block-compact",
     "specs with mixed (heads, tokens per block, page bytes) shapes alias one block's bytes, which needs a "
     "block-compact layout"),
    (("groups.dcp_mixed_page_sizes",), "is_block_outermost", "dcp-mixed-page-sizes-need-block-outermost",
     "a DCP-sharded target beside a replicated draft with another page size needs a block-outermost layout"),
    (("cache.enable_extensible_kv_cache", "connector.present"), "is_block_compact",
     "extensible-kv-cache-with-connector-needs-block-compact",
     "an extensible KV cache with a KV connector needs a block-compact layout"),
)


def check_vllm_requirements(decision: Decision) -> None:
    """Raise `StartupError` when ``decision.layout`` breaks one of vLLM's own requirements on the layout
    (`_VLLM_REQUIREMENTS`): the answer is then none of the candidates vLLM itself would choose from, and
    the rule set lacks the rule standing for that requirement. Never raises for the shipped rules."""
    env = decision.context.env()
    layout = decision.layout
    broken = [(prop, rule_id, why) for fields, prop, rule_id, why in _VLLM_REQUIREMENTS
              if all(env.get(f) is True for f in fields) and not getattr(layout, prop)]
    if not broken:
        return
    diags = [Diagnostic(p.rule.source.file, p.rule.source.line, p.rule.source.col, "vllm-requirement",
                        f"rule `{p.rule.id}` ({p.scope}) prefers {layout}")
             for p in decision.preferences if p.layout is layout]
    if not diags:
        diags.append(Diagnostic("<vllm:resolve_kv_cache_layout>", 0, 0, "vllm-requirement",
                                f"{layout} is the first of the workers' candidates, and no rule removed it"))
    for prop, rule_id, why in broken:
        diags.append(Diagnostic("<vllm:resolve_kv_cache_layout>", 0, 0, "vllm-requirement",
                                f"{why}; {layout} is not {prop.removeprefix('is_').replace('_', '-')}",
                                f"this rule set has no rule for it: add the shipped rule `{rule_id}` "
                                f"(rules/{decision.context.profile}/global.yaml), or start from a copy of the "
                                "shipped rules"))
    raise StartupError(f"kvpolicy: the rules chose {layout}, which vLLM (profile {decision.context.profile}) cannot "
                       "use for this model; vLLM must not start:", diags)


def resolve(engine: LayoutEngine, vllm_config: Any, supported_layouts: Sequence[Sequence[str]],
            kv_cache_specs: Iterable[Any] | None, *, vllm_kv_cache_layout: str | None = None,
            device_capability: int | None = None, connector_layout: Callable[[], str | None] | None = None,
            connector_layouts: Callable[[], Iterable[tuple[str, Any]]] | None = None,
            attention_backends: Sequence[str] = (), explain: bool = False) -> Decision | None:
    """The rules' `Decision` for vLLM's resolver inputs, under ``engine``'s release profile; None when
    the model has no KV cache views to lay out.

    For the connectors the rules do not know, vLLM's own ``get_required_kvcache_layout`` stands in
    (asked only while VLLM_KV_CACHE_LAYOUT is unset, as vLLM asks): ``connector_layouts`` returns
    (``kv_connector`` name, answer) for every connector configured, a MultiConnector's members
    included; ``connector_layout`` returns vLLM's ``get_kv_connector_cache_layout(vllm_config)``, the
    configured connector's alone (used when ``connector_layouts`` is not given).
    ``attention_backends``: the backends vLLM selects for the model, by name (`resolver_context`).
    Raises `StartupError`: no layout survives, or kvpolicy cannot describe the inputs."""
    try:
        ctx = resolver_context(vllm_config, supported_layouts, list(kv_cache_specs or ()),
                               release=engine.profile, vllm_kv_cache_layout=vllm_kv_cache_layout,
                               device_capability=device_capability, attention_backends=attention_backends)
        if ctx is None:
            return None
        eng = engine
        conn = ctx.connector
        asks = vllm_kv_cache_layout is None and conn is not None and any(
            not c.is_composite and not has_rules(engine.ruleset, engine.profile, c.name, c.extra) for c in _tree(conn))
        reported: list[tuple[str, Any]] = []
        if asks and connector_layouts is not None:
            reported = list(connector_layouts())
        elif asks and connector_layout is not None and conn is not None and not conn.is_composite:
            reported = [(conn.name, connector_layout())]
        wanted = _own_layouts(engine.profile, engine.ruleset, conn, reported)
        if wanted:
            eng = LayoutEngine(_with_connector_layouts(engine.ruleset, wanted), vllm_version=engine.profile)
        decision = eng.decide(ctx, explain=explain)
    except NoLayoutError as exc:
        raise StartupError("kvpolicy: no KV cache layout survives the rules; vLLM must not start (relax one of "
                           "these rules, or change the deployment):", exc.diagnostics) from None
    except InputError as exc:
        raise StartupError("kvpolicy: cannot describe vLLM's KV cache layout inputs; vLLM must not start "
                           "(unset KVPOLICY_RULES to let vLLM decide):", exc.diagnostics) from None
    if decision.layout not in ctx.candidates:  # pragma: no cover - the release filter makes this impossible
        raise StartupError(f"kvpolicy: the rules chose {decision.layout}, which not every worker supports "
                           f"({', '.join(str(x) for x in ctx.candidates)})")
    check_vllm_requirements(decision)
    return decision


def make_resolver(original: Callable[..., Any], engine: LayoutEngine, *, layout_type: Any,
                  vllm_kv_cache_layout: Callable[[], str | None], device_capability: Callable[[], int | None],
                  connector_layout: Callable[[Any], str | None] | None = None,
                  connector_layouts: Callable[[Any], Iterable[tuple[str, Any]]] | None = None,
                  attention_backends: Callable[[Any], Sequence[str]] | None = None, explain: bool = False,
                  on_decision: Callable[[Decision], None] | None = None) -> Callable[..., Any]:
    """A function with the signature of vLLM's ``resolve_kv_cache_layout(vllm_config, supported_layouts,
    kv_cache_specs=None) -> KVCacheLayout``, answered by ``engine``.

    ``original`` is vLLM's own function: it still answers where vLLM's answer is
    not a decision (a layout already recorded on ``cache_config``, which vLLM
    honours as-is; a model without per-layer KV views). ``layout_type`` is vLLM's
    ``KVCacheLayout`` enum. The answer is recorded on ``cache_config.kv_cache_layout``
    as vLLM records its own, from where vLLM distributes it to the workers. ``connector_layout``,
    ``connector_layouts`` and ``attention_backends`` take ``vllm_config`` and are `resolve`'s.
    """

    def resolve_kv_cache_layout(vllm_config: Any, supported_layouts: list[list[str]],
                                kv_cache_specs: Iterable[Any] | None = None) -> Any:
        cache_config = vllm_config.cache_config
        if getattr(cache_config, "kv_cache_layout", None) is not None:
            return original(vllm_config, supported_layouts, kv_cache_specs)
        specs = list(kv_cache_specs or ())
        decision = resolve(
            engine, vllm_config, supported_layouts, specs, vllm_kv_cache_layout=vllm_kv_cache_layout(),
            device_capability=device_capability(),
            connector_layout=None if connector_layout is None else (lambda: connector_layout(vllm_config)),
            connector_layouts=None if connector_layouts is None else (lambda: connector_layouts(vllm_config)),
            attention_backends=() if attention_backends is None else attention_backends(vllm_config),
            explain=explain)
        if decision is None:
            return original(vllm_config, supported_layouts, specs)
        if on_decision is not None:
            on_decision(decision)
        layout = layout_type[decision.layout.value]
        cache_config.kv_cache_layout = layout.name
        return layout

    resolve_kv_cache_layout.__kvpolicy__ = True  # type: ignore[attr-defined]
    resolve_kv_cache_layout.__wrapped__ = original  # type: ignore[attr-defined]
    return resolve_kv_cache_layout
