"""A drop-in replacement for vLLM 0.24-0.28's ``use_uniform_kv_cache`` gate, answered by the rules.

vLLM's model runner asks ``use_uniform_kv_cache(attn_groups)`` whether to
allocate one cross-layer ("uniform") KV cache. `use_uniform_kv_cache` here
answers the same question, with the connector passed in, from a kvpolicy
`Decision`: True exactly when the decided placement is ``cross_layer``. The
decision is taken under a release profile whose resolver is that gate
(``vllm-0.28``; ``issue-48412`` for the historical state): its backends, its
candidates and its registered connector names. `kvpolicy.engine.integrations.vllm_plugin`
installs the gate in vLLM; vLLM 0.29+ has no gate (see
`kvpolicy.engine.integrations.vllm_resolver`).

Nothing is imported from vLLM. Its objects are read by attribute name:

- ``attn_groups``: a list (one per KV cache group) of lists of attention
  groups, each with ``kv_cache_spec`` (``block_size``, ``num_kv_heads``,
  ``head_size``, ``dtype``, ``kv_quant_mode``, maybe ``kv_cache_dtype`` /
  ``cache_dtype_str``, ``sliding_window``, ``page_size_padded``,
  ``indexes_kv_by_block_stride``; its class name tells attention, MLA,
  sliding window or Mamba), ``backend`` (``get_name()``, maybe
  ``indexes_kv_by_block_stride``) and ``layer_names``;
- the connector (vLLM's ``get_kv_transfer_group()``, None without one): the
  name vLLM registers it under (its ``_kv_transfer_config.kv_connector``, so
  0.28's ``NixlConnector``, an alias of the class ``NixlPullConnector``, is
  ``NixlConnector`` to the rules; else its class name), ``prefer_cross_layer_blocks``
  (property or method), its ``kv_connector_extra_config`` (or
  ``_kv_transfer_config``'s, where OffloadingConnector's ``canonical_layout``
  lives) and, for MultiConnector, its member connectors ``_connectors``.

Where vLLM's objects say more than the rules know, the adapter stays
conservative or defers to the object:

- a connector the rule set has no file for (nor for the class the release
  registers its name to), and that has no members, keeps its own
  ``prefer_cross_layer_blocks``: a synthetic ``prefer`` rule in its scope
  stands for it, so every global ``forbid`` still applies and the trace names it;
- an attention backend the release profile does not know is assumed to build
  scale views for per-layer contiguous buffers (so per-token-head quantization
  never goes cross-layer), and indexes KV by block stride only if the spec or
  backend says so; for a known backend, an explicit ``indexes_kv_by_block_stride``
  from vLLM overrides the shipped profile;
- a KV cache vLLM describes in a way kvpolicy cannot (an unknown spec class,
  quant mode such as ``turboquant_k8v4``, or ``kv_cache_dtype``) gets per-layer buffers:
  the gate logs a warning and answers False.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpolicy.engine.agreement import agree
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.inputs import build_context
from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.policy.backends import BackendProfile, Dim
from kvpolicy.policy.connectors import COMPOSITE_CONNECTORS, KNOWN_CONNECTORS, MAX_CONFIG_DEPTH, ConnectorConfig
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import Diagnostic, InputError, NoLayoutError, PolicyError, input_error
from kvpolicy.policy.layouts import HeadOrder, LayoutPattern, Placement
from kvpolicy.policy.quant import KV_CACHE_DTYPES, ModelDtype, QuantMode, parse_kv_cache_dtype
from kvpolicy.policy.releases import ReleaseProfile, Resolver, get_profile, iter_profiles
from kvpolicy.policy.rule_model import MemberPreferences, Rule
from kvpolicy.policy.ruleset import RuleSet, Source
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec, make_model

__all__ = [
    "KV_TRANSFER_EXTRA",
    "OWN_HEAD_ORDER_WEIGHT",
    "OWN_PREFERENCE_WEIGHT",
    "StartupError",
    "check_cross_layer",
    "check_head_order",
    "connector_config",
    "connector_name",
    "decide",
    "has_rules",
    "make_gate",
    "own_rule_id",
    "use_uniform_kv_cache",
    "vllm_context",
]

logger = logging.getLogger("kvpolicy")

# The weight of the synthetic prefer rule standing for an unknown connector's own
# prefer_cross_layer_blocks: the shipped connector files prefer cross-layer with 10.
OWN_PREFERENCE_WEIGHT = 10
# The weight of the synthetic prefer rule standing for an unknown connector's get_required_kvcache_layout
# (a head order): the shipped connector files prefer their required head order with 100.
OWN_HEAD_ORDER_WEIGHT = 100

_PER_TOKEN_HEAD = {m.value for m in QuantMode if m.is_per_token_head}
_MODEL_DTYPES = {m.value for m in ModelDtype}

_default_engine: LayoutEngine | None = None


def _gate_profile() -> ReleaseProfile:
    """The default profile when it has the gate, else the newest release that has it (``vllm-0.28``)."""
    default = get_profile()
    if default.resolver is Resolver.uniform_gate:
        return default
    return next(p for p in iter_profiles() if p.resolver is Resolver.uniform_gate and not p.historical)


def _engine(engine: LayoutEngine | None) -> LayoutEngine:
    global _default_engine
    if engine is not None:
        return engine
    if _default_engine is None:
        _default_engine = LayoutEngine.default(_gate_profile())
    return _default_engine


class StartupError(PolicyError, ValueError):
    """vLLM must not start: the rules leave no layout, or one vLLM cannot allocate as decided.

    A `ValueError` as well, the type vLLM's own layout resolution raises, so
    vLLM's start-up reports it the same way; its text is located diagnostics.
    """


# ---------------------------------------------------------------- KV cache specs


def _kind(spec: Any) -> AttentionKind:
    """vLLM's spec class (and its bases) by name: ``MambaSpec``, ``MLAAttentionSpec``, ``SlidingWindowSpec``..."""
    names = [cls.__name__ for cls in type(spec).__mro__]
    if any("Mamba" in n for n in names):
        return AttentionKind.mamba
    if any("MLA" in n for n in names):
        return AttentionKind.mla
    if any("SlidingWindow" in n for n in names):
        return AttentionKind.sliding_window
    if any("ChunkedLocal" in n for n in names):
        return AttentionKind.chunked_local
    if any(n.endswith("AttentionSpec") for n in names):
        return AttentionKind.full
    raise input_error("kv_cache_spec", f"`{type(spec).__name__}` is not a KV cache spec kvpolicy knows",
                      "vLLM's gate accepts attention specs only; kvpolicy keeps per-layer buffers",
                      code="unknown-spec")


def _dtype_name(dtype: Any) -> str | None:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``, without importing torch."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _quant_mode_name(spec: Any) -> str | None:
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is None:
        return None
    name = getattr(mode, "name", mode)  # vLLM's KVQuantMode is an IntEnum: NONE, FP8_PER_TOKEN_HEAD, ...
    if not isinstance(name, str):
        raise input_error("kv_quant_mode", f"kv_quant_mode `{mode!r}` has no name", code="unknown-quant-mode")
    return name.lower()


def _kv_cache_dtype(spec: Any, cache_dtype: str | None) -> str:
    """vLLM's ``kv_cache_dtype`` string for a spec: given, or derived from ``kv_quant_mode`` and ``dtype``."""
    explicit = cache_dtype or getattr(spec, "kv_cache_dtype", None) or getattr(spec, "cache_dtype_str", None)
    mode = _quant_mode_name(spec)
    dtype = _dtype_name(getattr(spec, "dtype", None))
    if explicit is not None:
        if explicit not in KV_CACHE_DTYPES:
            raise input_error("kv_cache_dtype", f"kv_cache_dtype `{explicit}` has no kvpolicy geometry",
                              code="unknown-kv-cache-dtype")
        derived = parse_kv_cache_dtype(explicit, ModelDtype.bfloat16)[0].value
        if mode is not None and mode != derived:
            raise input_error("kv_quant_mode", f"kv_quant_mode `{mode}` contradicts kv_cache_dtype `{explicit}`")
        return explicit
    if mode == "none":
        return "auto"
    if mode == "fp8_per_tensor":
        return "fp8_e5m2" if dtype == "float8_e5m2" else "fp8"
    if mode in _PER_TOKEN_HEAD or mode == QuantMode.nvfp4.value:  # nvfp4_4over6 has nvfp4's bytes
        return mode
    if mode is not None:
        raise input_error("kv_quant_mode", f"quant mode `{mode}` has no kvpolicy geometry",
                          f"known: {', '.join(m.value for m in QuantMode)}", code="unknown-quant-mode")
    if dtype in _MODEL_DTYPES:
        return "auto"
    if dtype in ("float8_e4m3fn", "float8_e5m2"):
        return "fp8_e5m2" if dtype == "float8_e5m2" else "fp8"
    raise input_error("kv_cache_spec.dtype", f"cannot tell the KV cache format of dtype `{dtype}` "
                      "without kv_quant_mode or kv_cache_dtype", code="unknown-kv-cache-dtype")


def _int_attr(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _spec(spec: Any, num_layers: int, cache_dtype: str | None) -> KVCacheSpec:
    kind = _kind(spec)
    if kind is AttentionKind.mamba:
        # A recurrent state has no heads; the stand-in only carries the kind and the layer count.
        data: dict[str, Any] = {"kind": kind, "num_layers": num_layers, "block_size": _int_attr(spec, "block_size")
                                or 1, "num_kv_heads": 1, "head_size": 1}
    else:
        data = attention_fields(spec, kind, num_layers, _kv_cache_dtype(spec, cache_dtype), ModelDtype.bfloat16)
    return make_model(KVCacheSpec, "kv_cache_spec", data)


def attention_fields(spec: Any, kind: AttentionKind, num_layers: int, kv_cache_dtype: str,
                     model_dtype: ModelDtype) -> dict[str, Any]:
    """`KVCacheSpec` fields of a vLLM attention spec, read by attribute name. For a quantized cache
    vLLM's ``dtype`` is the cache's; ``model_dtype`` stands in for the model's, which changes no byte."""
    dtype = _dtype_name(getattr(spec, "dtype", None))
    return {
        "kind": kind,
        "num_layers": num_layers,
        "block_size": getattr(spec, "block_size", None),
        "num_kv_heads": getattr(spec, "num_kv_heads", None),
        "head_size": getattr(spec, "head_size", None),
        "dtype": dtype if dtype in _MODEL_DTYPES else model_dtype.value,
        "kv_cache_dtype": kv_cache_dtype,
        "sliding_window": _int_attr(spec, "sliding_window"),
        "page_size_padded": _int_attr(spec, "page_size_padded"),
    }


# ---------------------------------------------------------------- backends


def _backend_name(backend: Any) -> str:
    get_name = getattr(backend, "get_name", None)
    name = get_name() if callable(get_name) else getattr(backend, "name", None)
    if name is None:
        name = backend.__name__ if isinstance(backend, type) else type(backend).__name__
    return str(getattr(name, "name", name))


def _reported_block_stride(spec: Any, backend: Any) -> bool | None:
    """vLLM's own ``indexes_kv_by_block_stride``: on the spec (recent vLLM) or the backend; None if absent."""
    for owner in (spec, backend):
        value = getattr(owner, "indexes_kv_by_block_stride", None)
        if callable(value):
            try:
                value = value()
            except Exception:  # a backend method that needs vLLM's config: treat as not said
                value = None
        if isinstance(value, bool):
            return value
    return None


def _outermost(order: tuple[Dim, ...], dim: Dim) -> tuple[Dim, ...]:
    return (dim, *(d for d in order if d is not dim))


def _unknown_backend(name: str, mla: bool, block_stride: bool) -> BackendProfile:
    """A backend kvpolicy has no profile for: flash-like geometry, conservative scale views."""
    first = Dim.block if block_stride else Dim.layer
    B, L, KV, N, H, D = Dim.block, Dim.layer, Dim.kv, Dim.token, Dim.head, Dim.dim
    if mla:
        return BackendProfile(name=name, mla=True, logical_dims=(B, N, D), per_layer_order={HeadOrder.NHD: (B, N, D)},
                              cross_layer_order={HeadOrder.NHD: _outermost((B, L, N, D), first)})
    return BackendProfile(
        name=name,
        logical_dims=(B, KV, N, H, D),
        per_layer_order={HeadOrder.NHD: (B, KV, N, H, D), HeadOrder.HND: (B, KV, H, N, D)},
        cross_layer_order={HeadOrder.NHD: _outermost((B, L, KV, N, H, D), first),
                           HeadOrder.HND: _outermost((B, H, L, KV, N, D), first)},
    )  # scale_views keeps its default, assume_per_layer_contiguous: the conservative answer


def _profile(backend: Any, spec_obj: Any, kind: AttentionKind, release: ReleaseProfile) -> BackendProfile:
    name = _backend_name(backend)
    reported = _reported_block_stride(spec_obj, backend)
    if name not in release.backends:
        return _unknown_backend(name, kind is AttentionKind.mla, bool(reported))
    known = release.backend(name)
    if reported is None or reported == known.indexes_kv_by_block_stride:
        return known
    # vLLM's runtime says otherwise than the shipped profile: its word decides, as in vLLM's own gate.
    first = Dim.block if reported else Dim.layer
    orders = {x: _outermost(order, first) if x.is_block_outermost else order for x, order in known.orders.items()}
    return known.model_copy(update={"orders": orders})


# ---------------------------------------------------------------- connectors


# Where a connector object's configuration came from, as the operator wrote it (vLLM's --kv-transfer-config).
KV_TRANSFER_EXTRA = "kv_transfer_config.kv_connector_extra_config"


def _extra_config(connector: Any, where: str = KV_TRANSFER_EXTRA) -> dict[str, Any]:
    extra = getattr(connector, "kv_connector_extra_config", None)
    if extra is None:
        extra = getattr(getattr(connector, "_kv_transfer_config", None), "kv_connector_extra_config", None)
    if extra is not None and not isinstance(extra, Mapping):
        raise input_error(where, f"`kv_connector_extra_config` must be a mapping, got {type(extra).__name__}",
                          'e.g. {"enable_cross_layers_blocks": "true"}')
    return dict(extra or {})


def _members(connector: Any) -> list[Any] | None:
    members = getattr(connector, "_connectors", None)
    return list(members) if isinstance(members, Sequence) and not isinstance(members, str) else None


def connector_name(connector: Any) -> str:
    """The name vLLM registers ``connector`` under: the ``kv_connector`` its config names (vLLM 0.28's
    ``NixlConnector`` loads the class ``NixlPullConnector``; the rules see ``NixlConnector``), else its
    class name (a stand-in, or a connector loaded from ``kv_connector_module_path``)."""
    configured = getattr(getattr(connector, "_kv_transfer_config", None), "kv_connector", None)
    if isinstance(configured, str) and configured:
        return configured
    return type(connector).__name__


def _own_preference(connector: Any) -> bool:
    """The connector's ``prefer_cross_layer_blocks`` (a property, or a method in some versions)."""
    try:
        value = getattr(connector, "prefer_cross_layer_blocks", False)
        if callable(value):
            value = value()
    except Exception:
        logger.warning("kvpolicy: reading %s.prefer_cross_layer_blocks failed; taking False",
                       type(connector).__name__, exc_info=True)
        return False
    return value is True


def connector_config(connector: Any) -> ConnectorConfig | None:
    """vLLM's connector object as a `ConnectorConfig` (None for None); MultiConnector keeps its members.

    A connector no release registers (a class vLLM loads from ``kv_connector_module_path``) brings its
    own ``prefer_cross_layer_blocks``, the fact vLLM's gate asks the object: it becomes the rules'
    ``connector.prefers_cross_layer_blocks``. A registered connector's rules model that property
    (conditions included, checked against the release), and a composite's is its members', so the
    decision is the one ``kvpolicy dry-run`` makes for the same deployment.

    Every connector's configuration is checked as the CLI's ``--kv-transfer-config`` is
    (`ConnectorConfig.from_vllm`: what JSON cannot hold, NaN, nesting past `MAX_CONFIG_DEPTH`), and so
    are the member objects (one that contains itself, or members nested past that depth): an
    `InputError` located at ``kv_transfer_config.kv_connector_extra_config...``, never a pydantic or
    recursion error."""
    return None if connector is None else _connector_config(connector, KV_TRANSFER_EXTRA, ())


def _connector_config(connector: Any, where: str, holders: tuple[int, ...]) -> ConnectorConfig:
    """`connector_config` of one object; ``holders``: the ids of the composites that hold it."""
    if id(connector) in holders:
        raise input_error(where, f"MultiConnector `{connector_name(connector)}` is its own member (its members "
                          "contain each other)", "list each member connector once, none holding its holder",
                          code="connector-cycle")
    if len(holders) >= MAX_CONFIG_DEPTH:
        raise input_error(where, f"MultiConnector members are nested deeper than {MAX_CONFIG_DEPTH} levels",
                          "list the member connectors in one MultiConnector", code="too-deep")
    name = connector_name(connector)
    extra = _extra_config(connector, where)
    if name not in COMPOSITE_CONNECTORS:  # only a composite's `connectors` key lists members
        own = name not in KNOWN_CONNECTORS and hasattr(type(connector), "prefer_cross_layer_blocks")
        return ConnectorConfig.from_vllm(name, extra, where=where).model_copy(
            update={"prefers_cross_layer_blocks": _own_preference(connector) if own else None})
    instances = _members(connector)
    if instances is None:  # no live member objects: vLLM's configuration form
        return ConnectorConfig.from_vllm(name, extra, where=where)
    extra.pop("connectors", None)
    members = tuple(_connector_config(m, f"{where}.connectors[{i}]", (*holders, id(connector)))
                    for i, m in enumerate(instances) if m is not None)
    return ConnectorConfig.from_vllm(name, extra, where=where).model_copy(update={"connectors": members})


def _own_preferences(connector: Any, out: dict[str, bool] | None = None) -> dict[str, bool]:
    """Name -> own ``prefer_cross_layer_blocks`` for every non-composite connector object in the tree."""
    out = {} if out is None else out
    if connector is None:
        return out
    members = _members(connector)
    name = connector_name(connector)
    if name in COMPOSITE_CONNECTORS:
        for m in members or ():
            _own_preferences(m, out)
        return out
    # INVARIANT: two objects of one name share one rule scope; both must prefer (conservative).
    out[name] = out.get(name, True) and _own_preference(connector)
    return out


_RULE_ID_MAX: int = next(m.max_length for m in Rule.model_fields["id"].metadata if hasattr(m, "max_length"))


def own_rule_id(kind: str, name: str) -> str:
    """The id of the synthetic rule of ``kind`` (``vllm-own-preference``, ``vllm-own-layout``) standing for
    connector ``name``: ``kind.<name in lower case>``. A name that does not spell itself so (spaces, dots of
    a module path, non-ASCII letters) or that would make an id longer than a rule id may be (100: a class
    name may be 128) is cut and suffixed with 8 hex digits of its hash, so that every name gets a valid id
    and two names share one only where they differ in case alone (each rule's source names its connector)."""
    lower = name.lower()
    slug = re.sub(r"[^a-z0-9._-]+", "-", lower).strip("-") or "connector"
    rule_id = f"{kind}.{slug}"
    if slug == lower and len(rule_id) <= _RULE_ID_MAX:
        return rule_id
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{rule_id[:_RULE_ID_MAX - 9].rstrip('.-')}-{digest}"


def has_rules(ruleset: RuleSet, release: ReleaseProfile, name: str, extra: Mapping[str, Any] | None = None) -> bool:
    """Whether ``ruleset`` has a connector file for ``name``, or for the class the release loads for it
    configured with ``extra`` (`ReleaseProfile.connector_class`)."""
    loads = release.connector_class(name, extra)
    return name in ruleset.connectors or (loads is not None and loads in ruleset.connectors)


def _own_head_orders(connector: Any, names: set[str], out: dict[str, set[str]] | None = None
                     ) -> dict[str, set[str]]:
    """Name -> the head orders vLLM's ``get_required_kvcache_layout`` gives each non-composite connector
    object named in ``names`` in the tree, asked as vLLM asks it (the class, with the config the object
    was built with: its ``_vllm_config``, a MultiConnector member's own). Objects without that config are
    not asked."""
    out = {} if out is None else out
    if connector is None:
        return out
    name = connector_name(connector)
    if name in COMPOSITE_CONNECTORS:
        for m in _members(connector) or ():
            _own_head_orders(m, names, out)
        return out
    if name not in names:
        return out
    ask = getattr(type(connector), "get_required_kvcache_layout", None)
    config = getattr(connector, "_vllm_config", None)
    if callable(ask) and config is not None:
        try:
            answer = ask(config)
        except Exception:
            logger.warning("kvpolicy: %s.get_required_kvcache_layout failed; taking no head order",
                           type(connector).__name__, exc_info=True)
            answer = None
        if answer in ("NHD", "HND"):  # what 0.24-0.28's get_kv_cache_layout() uses; vLLM refuses the rest
            out.setdefault(name, set()).add(answer)
    return out


def _agreeing_members(ruleset: RuleSet, conn: ConnectorConfig | None) -> set[str]:
    """The names of connectors that are members of a composite whose members must agree on their
    preferences (``member_preferences: agree``, vLLM 0.28's MultiConnector: its members' required head
    orders)."""
    out: set[str] = set()
    stack = [] if conn is None else [conn]
    while stack:
        c = stack.pop()
        if c.is_composite and ruleset.combine_mode(c.name) is MemberPreferences.agree:
            out.update(m.name for m in c.connectors)
        stack.extend(c.connectors)
    return out


def _with_own_preferences(ruleset: RuleSet, release: ReleaseProfile, preferences: dict[str, bool],
                          head_orders: dict[str, set[str]] | None = None,
                          agreeing: set[str] | None = None) -> RuleSet:
    """``ruleset`` plus, for each connector it has no rules for: a synthetic prefer of the cross-layer
    placement when its own ``prefer_cross_layer_blocks`` is true, else a forbid (vLLM's gate needs every
    connector, every MultiConnector member included, to prefer it); and a prefer of the head order its
    ``get_required_kvcache_layout`` gives (``head_orders``), while VLLM_KV_CACHE_LAYOUT is unset, as
    vLLM's ``get_kv_cache_layout()`` uses it.

    A member of a composite whose members must ``agree`` (``agreeing``) gets no cross-layer prefer: that
    mode compares the members' best layouts, which are their required head orders; a rule set written so
    prefers the cross-layer placement globally and lets connectors forbid it, as the vllm-0.28 rules do."""
    unknown = sorted(n for n in preferences if not has_rules(ruleset, release, n))
    if not unknown:
        return ruleset
    entries = [(r.rule, r.source, r.scope) for r in ruleset.rules]
    for name in unknown:
        source = Source(f"<vllm:{name}.prefer_cross_layer_blocks>", 1)
        rule: Rule | None = None
        if preferences[name] and name in (agreeing or set()):
            pass  # see above: the rule set's global cross-layer preference stands for it
        elif preferences[name]:
            rule = Rule(
                id=own_rule_id("vllm-own-preference", name),
                description=(f"`{name}` has no rules in this rule set; its own prefer_cross_layer_blocks is true, "
                             "so kvpolicy prefers the cross-layer placement for it as vLLM would"),
                prefer=LayoutPattern(placement=Placement.cross_layer),
                weight=OWN_PREFERENCE_WEIGHT,
            )
        else:
            rule = Rule(
                id=own_rule_id("vllm-own-preference", name),
                description=(f"`{name}` has no rules in this rule set; its own prefer_cross_layer_blocks is false, "
                             "so vLLM's gate keeps per-layer buffers for it, and so does kvpolicy"),
                forbid=LayoutPattern(placement=Placement.cross_layer),
            )
        if rule is not None:
            entries.append((rule, source, name))
        orders = (head_orders or {}).get(name, set())
        if len(orders) == 1:  # two objects of one name asking for different ones: vLLM refuses before the gate
            order = HeadOrder(next(iter(orders)))
            entries.append((Rule.model_validate({
                "id": own_rule_id("vllm-own-layout", name),
                "description": (f"`{name}` has no rules in this rule set; its get_required_kvcache_layout asks for "
                                f"{order.value}, which vLLM's get_kv_cache_layout() uses when VLLM_KV_CACHE_LAYOUT "
                                "is unset, and so does kvpolicy"),
                "when": {"field": "env.VLLM_KV_CACHE_LAYOUT", "exists": False},
                "prefer": {"head_order": order.value},
                "weight": OWN_HEAD_ORDER_WEIGHT,
            }), Source(f"<vllm:{name}.get_required_kvcache_layout>", 1), name))
    return RuleSet.build(entries, ruleset.layout_order, ruleset.member_preferences, ruleset.root,
                         order_declared=ruleset.order_declared)


# ---------------------------------------------------------------- the gate


def vllm_context(attn_groups: Sequence[Sequence[Any]], transfer_group: Any, *,
                 cache_dtype: str | None = None, vllm_kv_cache_layout: str | None = None,
                 vllm_version: str | ReleaseProfile | None = None) -> Context:
    """The decision `Context` for vLLM's attention groups and connector; raises `InputError`.

    ``cache_dtype`` is vLLM's ``cache_config.cache_dtype``, which older vLLM
    passes to the gate; newer vLLM carries ``kv_quant_mode`` on the spec.
    ``vllm_kv_cache_layout`` is the head order vLLM was told to use
    (``VLLM_KV_CACHE_LAYOUT``, or the override a backend set), the rules'
    ``env.VLLM_KV_CACHE_LAYOUT``. ``vllm_version`` picks the release profile
    (default: the default profile if it has the gate, else ``vllm-0.28``).
    """
    release = get_profile(vllm_version) if vllm_version is not None else _gate_profile()
    if release.resolver is not Resolver.uniform_gate:
        raise input_error("vllm_version", f"vLLM profile `{release.name}` has no use_uniform_kv_cache gate",
                          "vLLM 0.29 and later resolve one KVCacheLayout in the engine core: use "
                          "kvpolicy.engine.integrations.vllm_resolver (the kvpolicy vLLM plugin installs it)",
                          code="no-gate")
    if not attn_groups:
        raise input_error("attn_groups", "no KV cache groups", code="no-kv-cache")
    built: list[tuple[KVCacheGroup, Any, Any]] = []
    for i, subgroups in enumerate(attn_groups):
        subgroups = list(subgroups)
        if not subgroups:
            raise input_error(f"attn_groups[{i}]", "a KV cache group without attention groups", code="no-kv-cache")
        spec_obj = subgroups[0].kv_cache_spec
        num_layers = sum(_layer_count(g, f"attn_groups[{i}]") for g in subgroups) or len(subgroups)
        spec = _spec(spec_obj, num_layers, cache_dtype)
        built.append((KVCacheGroup(spec=spec, num_attention_groups=len(subgroups)), subgroups[0].backend, spec_obj))
    groups = KVCacheGroups(groups=tuple(g for g, _, _ in built))
    primary = next((b for b in built if b[0].spec.kind.is_attention), built[0])
    group, backend, spec_obj = primary
    return build_context(groups=groups, attention_backend=_profile(backend, spec_obj, group.spec.kind, release),
                         connector=connector_config(transfer_group), vllm_kv_cache_layout=vllm_kv_cache_layout,
                         vllm_version=release)


def _layer_count(group: Any, where: str) -> int:
    """How many layers an attention group holds: its ``layer_names`` (vLLM's list), 0 when it has none."""
    names = getattr(group, "layer_names", None)
    if names is None:
        return 0
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise input_error(f"{where}.layer_names", f"`layer_names` must be a list of layer names, got "
                          f"{type(names).__name__}", code="unknown-spec")
    return len(names)


def decide(attn_groups: Sequence[Sequence[Any]], transfer_group: Any, *, engine: LayoutEngine | None = None,
           cache_dtype: str | None = None, vllm_kv_cache_layout: str | None = None,
           explain: bool = False) -> Decision:
    """The kvpolicy `Decision` for vLLM's KV cache: `vllm_context` decided by ``engine`` (default: the
    shipped rules of the gate's release profile), under that engine's profile.

    Connectors without rules (a MultiConnector's members included) contribute
    their own ``prefer_cross_layer_blocks`` and ``get_required_kvcache_layout``
    as synthetic rules, so the decision (and its fingerprint, for `agree`) is
    the layout the gate answers for. Raises `InputError` or `NoLayoutError`.
    """
    eng = _engine(engine)
    ctx = vllm_context(attn_groups, transfer_group, cache_dtype=cache_dtype,
                       vllm_kv_cache_layout=vllm_kv_cache_layout, vllm_version=eng.profile)
    ruleset = eng.ruleset
    preferences = _own_preferences(transfer_group)
    unknown = {n for n in preferences if not has_rules(ruleset, eng.profile, n)}
    augmented = _with_own_preferences(ruleset, eng.profile, preferences, _own_head_orders(transfer_group, unknown),
                                      _agreeing_members(ruleset, ctx.connector))
    if augmented is not ruleset:
        eng = LayoutEngine(augmented, vllm_version=eng.profile)
    return eng.decide(ctx, explain=explain)


def check_head_order(decision: Decision, vllm_head_order: str) -> None:
    """Raise `StartupError` unless vLLM, with its head order already fixed, allocates ``decision.layout``.

    Before vLLM 0.29 the head order (``get_kv_cache_layout()``: NHD or HND) is
    settled before the gate runs: connectors record it when they are created
    and attention metadata builders are built with it, so the gate cannot
    change it. The layout vLLM allocates is the backend's stride order under
    that head order, per layer or (gate true) cross-layer; a decision it does
    not give stops start-up, naming the rules that chose it. Skipped where the
    release profile has no stride orders for the backend, and for a model
    without attention (nothing has a head order).
    """
    ctx = decision.context
    facts = get_profile(ctx.profile).backends.get(ctx.backend.name)
    if facts is None or facts.stride_orders is None or not ctx.kv.kind.is_attention:
        return
    try:
        order = HeadOrder(vllm_head_order)
    except ValueError:
        return
    cross = decision.layout.placement is Placement.cross_layer
    allocated = facts.allocated_layout(order, cross)
    if allocated is None or allocated is decision.layout:
        return
    # the rules that removed what vLLM allocates, else those that ranked the decided layout above it
    removed = decision.eliminated.get(allocated, [])
    diags = [Diagnostic(r.source.file, r.source.line, r.source.col, "head-order-fixed",
                        f"rule `{r.id}` ({r.effect}, {scope}) removed {allocated}") for r, scope in removed]
    if not removed:
        diags += [Diagnostic(p.rule.source.file, p.rule.source.line, p.rule.source.col, "head-order-fixed",
                             f"rule `{p.rule.id}` ({p.scope}) prefers {decision.layout}")
                  for p in decision.preferences if p.layout is decision.layout]
    wanted = decision.layout.head_order.value
    diags.append(Diagnostic("<vllm>", 0, 0, "head-order-fixed",
                            f"vLLM {ctx.profile} fixed the head order {order.value} before the KV cache is "
                            f"allocated, so it would allocate {allocated}, not {decision.layout} "
                            f"({decision.layout.placement.value}, {wanted})",
                            f"set VLLM_KV_CACHE_LAYOUT={wanted} so that every vLLM component uses it, or change "
                            "the rules to decide the head order vLLM uses"))
    raise StartupError(f"kvpolicy: the rules decided {decision.layout} (fingerprint "
                       f"{decision.fingerprint.digest}), which vLLM cannot allocate:", diags)


# What vLLM's cross-layer allocation (KVConnectorModelRunnerMixin.allocate_uniform_kv_caches, 0.24-0.28)
# needs, whatever the rules prefer: it lays out attn_groups[0][0] alone (asserting one kernel block size and
# an AttentionSpec), and a backend that does not index KV by the block stride gives no block-outermost
# buffer. (condition on the decision's context, the shipped rule standing for it, what goes wrong)
_CROSS_LAYER_NEEDS: tuple[tuple[Callable[[dict[str, Any]], bool], str, str], ...] = (
    (lambda env: env["groups.count"] != 1, "cross-layer-needs-one-kv-cache-group",
     "more than one KV cache group: vLLM's cross-layer allocation asserts one (AssertionError at start-up)"),
    (lambda env: env["groups.attention_groups"] != 1, "cross-layer-needs-one-attention-group",
     "more than one attention group: vLLM's cross-layer allocation shapes every layer for the first group's "
     "backend"),
    (lambda env: env["kv.kind"] == "mamba" or env.get("groups.has_mamba") is True,
     "cross-layer-needs-attention-spec",
     "a Mamba state: vLLM's cross-layer allocation asserts an attention spec (AssertionError at start-up)"),
    (lambda env: env["backend.indexes_kv_by_block_stride"] is False, "cross-layer-needs-block-stride-indexing",
     "the backend does not index KV by the block stride: vLLM's cross-layer buffer would keep layers "
     "outermost, not the decided layout"),
    (lambda env: env["kv.per_token_head"] is True and env["backend.scale_views"] == "assume_per_layer_contiguous",
     "per-token-head-forbids-cross-layer",
     "per-token-head scales on a backend whose scale views assume per-layer buffers: every layer's scales on "
     "the same bytes (vLLM issue #48412)"),
)


def check_cross_layer(decision: Decision) -> None:
    """Raise `StartupError` when ``decision`` is cross-layer where vLLM cannot allocate it (`_CROSS_LAYER_NEEDS`):
    a rule set without the shipped rules standing for vLLM's gate would otherwise make vLLM crash at
    start-up or allocate another layout than the decided one. Never raises for the shipped rules."""
    if decision.layout.placement is not Placement.cross_layer:
        return
    env = decision.context.env()
    broken = [(rule_id, why) for test, rule_id, why in _CROSS_LAYER_NEEDS if test(env)]
    if not broken:
        return
    diags = [Diagnostic(p.rule.source.file, p.rule.source.line, p.rule.source.col, "vllm-requirement",
                        f"rule `{p.rule.id}` ({p.scope}) prefers {decision.layout}")
             for p in decision.preferences if p.layout is decision.layout]
    diags += [Diagnostic("<vllm:allocate_uniform_kv_caches>", 0, 0, "vllm-requirement", why,
                         f"this rule set has no rule for it: add the shipped rule `{rule_id}` (of "
                         f"{get_profile(decision.context.profile).rules_label}), or start from a copy of the "
                         "shipped rules")
              for rule_id, why in broken]
    raise StartupError(f"kvpolicy: the rules chose the cross-layer {decision.layout}, which vLLM (profile "
                       f"{decision.context.profile}) cannot allocate for this model; vLLM must not start:", diags)


def _gate_decision(attn_groups: Sequence[Sequence[Any]], transfer_group: Any, engine: LayoutEngine | None,
                   cache_dtype: str | None, vllm_kv_cache_layout: str | None = None) -> Decision | None:
    """`decide`, or None (and a warning) when kvpolicy cannot describe the KV cache; `StartupError` for a
    cross-layer decision vLLM cannot allocate (`check_cross_layer`) and for a connector configuration the
    rules cannot read (`connector_config`: the operator's to fix, refused as the CLI refuses it)."""
    try:
        connector_config(transfer_group)
    except InputError as exc:
        raise StartupError("kvpolicy: the KV connector's configuration cannot be read as the rules read it; "
                           "vLLM must not start (fix kv_transfer_config, or unset KVPOLICY_RULES to let vLLM "
                           "decide):", exc.diagnostics) from None
    try:
        decision = decide(attn_groups, transfer_group, engine=engine, cache_dtype=cache_dtype,
                          vllm_kv_cache_layout=vllm_kv_cache_layout)
    except InputError as exc:
        if any(d.code == "no-gate" for d in exc.diagnostics):
            raise  # an engine for a release without the gate: a configuration error, not an input to guard
        logger.warning("kvpolicy: cannot describe vLLM's KV cache, keeping per-layer buffers\n%s", exc.render())
        return None
    check_cross_layer(decision)
    if (decision.layout.placement is Placement.cross_layer and transfer_group is not None
            and not _own_preference(transfer_group)):
        logger.warning("kvpolicy: the rules choose %s although %s.prefer_cross_layer_blocks is false; "
                       "the rules decide", decision.layout, connector_name(transfer_group))
    return decision


def use_uniform_kv_cache(attn_groups: Sequence[Sequence[Any]], transfer_group: Any, *,
                         engine: LayoutEngine | None = None, cache_dtype: str | None = None,
                         vllm_kv_cache_layout: str | None = None) -> bool:
    """vLLM's ``use_uniform_kv_cache(attn_groups)``: allocate one cross-layer KV cache?

    ``transfer_group`` is vLLM's connector (``get_kv_transfer_group()``), or
    None when no connector is configured. True exactly when the decision's
    placement is ``cross_layer``. A KV cache kvpolicy cannot describe gets
    False (per-layer buffers) and a warning; rules that leave no layout raise
    `NoLayoutError`, since the operator's policy forbids every layout; a connector
    configuration the rules cannot read (a set, NaN, members that contain each
    other...) raises `StartupError` located at its ``kv_transfer_config`` field.
    """
    decision = _gate_decision(attn_groups, transfer_group, engine, cache_dtype, vllm_kv_cache_layout)
    return decision is not None and decision.layout.placement is Placement.cross_layer


def make_gate(has_transfer_group: Callable[[], bool], get_transfer_group: Callable[[], Any], *,
              engine: LayoutEngine | None = None, agreement_group: Callable[[], Any] | None = None,
              timeout_s: float = 60.0, vllm_kv_cache_layout: Callable[[], str | None] | None = None,
              head_order: Callable[[], str | None] | None = None,
              on_decision: Callable[[Decision], None] | None = None) -> Callable[..., bool]:
    """A function with the signature of vLLM's gate, ``(attn_groups, cache_dtype=None) -> bool``.

    Pass vLLM's ``has_kv_transfer_group`` and ``get_kv_transfer_group``; the
    result replaces ``KVConnectorModelRunnerMixin.use_uniform_kv_cache``
    (docs/vllm.md). With ``agreement_group`` (a callable returning a process
    group, e.g. ``lambda: get_world_group().cpu_group``) every call also runs
    `kvpolicy.engine.agreement.agree` on the decision, so ranks that would lay out
    their caches differently fail at start-up instead of exchanging garbage.
    It is a collective: every rank of that group must reach the gate.
    ``vllm_kv_cache_layout`` returns the head order vLLM was told
    (``VLLM_KV_CACHE_LAYOUT`` or a backend's override) for the rules;
    ``head_order`` returns the head order vLLM uses (``get_kv_cache_layout()``),
    checked by `check_head_order`; ``on_decision`` sees every decision (the
    plugin logs it). Rules that leave no layout raise `StartupError`.
    """

    def gate(attn_groups: Sequence[Sequence[Any]], cache_dtype: str | None = None) -> bool:
        connector = get_transfer_group() if has_transfer_group() else None
        told = vllm_kv_cache_layout() if vllm_kv_cache_layout is not None else None
        try:
            decision = _gate_decision(attn_groups, connector, engine, cache_dtype, told)
        except NoLayoutError as exc:
            raise StartupError("kvpolicy: no KV cache layout survives the rules; vLLM must not start "
                               "(relax one of these rules, or change the deployment):", exc.diagnostics) from None
        if decision is None:
            return False
        if on_decision is not None:
            on_decision(decision)
        if head_order is not None:
            used = head_order()
            if used is not None:
                check_head_order(decision, used)
        if agreement_group is not None:
            agree(decision, group=agreement_group(), timeout_s=timeout_s)
        return decision.layout.placement is Placement.cross_layer

    return gate
