"""The finite input space a rule set is analysed over, for one vLLM release profile:
the release's inputs around the literals the rules compare fields with (not every deployment).

Every input is built as an operator's would be (`kvpolicy.engine.inputs.build_context`
with the profile's ``vllm_version``), so lint never decides an input the
release cannot have: the profile's backends with their geometry and
candidates, its ``kv_cache_dtype`` strings, and vLLM's options. Dimensions:

- attention backend (the profile's), and for a backend whose declared layouts
  depend on the CUDA device capability, each capability that changes them
  (plus none);
- ``kv_cache_dtype``: the profile's strings kvpolicy has a cell geometry for,
  one per (quant mode, element size, what the rules can tell apart);
- attention kind (MLA backends: ``mla``; others ``full``, and
  ``sliding_window`` or ``mamba`` (a model of Mamba layers only, one group,
  no paged K/V to verify) when a rule can tell it apart);
- group shape: one group, one group with two attention groups, two groups,
  a Mamba hybrid, mixed (heads, tokens, page bytes) shapes, and a replicated
  draft under DCP with another page size; and N groups or M attention groups
  either side of each ``groups.count`` / ``groups.attention_groups`` literal;
- ``VLLM_KV_CACHE_LAYOUT`` (unset, a layout, ``NHD``/``HND``),
  ``enable_extensible_kv_cache``, HiSparse;
- sizes (``num_layers``, ``block_size``, ``num_kv_heads``, ``head_size``): the
  defaults, and the values either side of each literal a rule compares one with;
- connector: none, every connector some rule names in each variant of the
  ``connector.extra.*`` values its rules test (either side of each literal), a
  connector no rule names, and MultiConnector pairs of those; when a rule reads
  ``connector.prefers_cross_layer_blocks``, each of them with it said true and false
  (the unknown connector's default is false).

A dimension's values that no rule of the analysed rule sets can tell apart
(and that give the same candidates and geometry) collapse to the first one,
so a dimension the rules never read costs nothing. Sizes and extra keys vary one at a
time around a base point (the default sizes, no extras), plus the fields one rule reads
together, never as a full product: the space grows with the distinct literals. A
non-default size pairs with the connectors and dimensions its rules read with it.

Inputs share their parts: the environment rules see is composed from the
shared part of its context and its connector's part, never copied per input.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.engine.analysis.budget import (
    DEFAULT_MAX_INPUTS,
    MAX_SPACE_LIMIT,
    Cut,
    SizeCost,
    inputs_for_rules,
    plan_cut,
    tier_of_override,
)
from kvpolicy.engine.decide import Scope, connector_names_for, connector_rules_for
from kvpolicy.engine.inputs import build_context
from kvpolicy.engine.plan import DECIDED_NOT_PLANNED, plan_layout
from kvpolicy.policy.backends import BackendProfile, ScaleViews, packed_backend
from kvpolicy.policy.conditions import leaf_predicate, leaves_of
from kvpolicy.policy.connectors import ConnectorConfig
from kvpolicy.policy.context import EXTRA_PREFIX, FIELDS, MISSING, Context, VllmOptions
from kvpolicy.policy.errors import PolicyError, input_error
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.quant import KV_CACHE_DTYPES
from kvpolicy.policy.releases import ReleaseProfile, Resolver, get_profile, profile_names
from kvpolicy.policy.ruleset import RuleSet
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

__all__ = ["AnalysisInput", "InputConnector", "InputCore", "Space", "build_space", "connector_env", "enumerate_inputs"]

SIZES = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 16}
MLA_SIZES = {"num_layers": 4, "block_size": 16, "num_kv_heads": 1, "head_size": 32}
GROUP_SHAPES = ("1x1", "1x2", "2x1", "mamba-hybrid", "mixed-hnc", "dcp-mixed")
UNKNOWN_CONNECTOR = "ThirdPartyConnector"
_LISTED = 20  # items of each left-out list `Space.describe` names
_OPTION_PREFIXES = ("env.", "cache.", "attention.", "platform.", "worker.")
_CONNECTOR_PREFIX = "connector."


# ---------------------------------------------------------------------------------------------
# One input


@dataclass(frozen=True, eq=False)
class InputCore:
    """What many inputs share: a validated context without a connector, its environment, its labels."""

    context: Context
    env: dict[str, Any]
    labels: tuple[tuple[str, str], ...]
    tail: tuple[tuple[str, str], ...]  # vLLM's options that are set, shown before the connector
    geometry: tuple[str, ...]  # (kv_cache_dtype, kind, backend, scale_views): what the verifier sees
    member_envs: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)  # id(InputConnector) -> env


@dataclass(frozen=True, eq=False)
class InputConnector:
    """A connector of the space, its label, and the connector.* fields bound to it and to each member."""

    config: ConnectorConfig | None
    label: str
    env: dict[str, Any]  # the connector.* fields (and extras) bound to this connector
    members: tuple[InputConnector, ...] = ()
    # profile -> the connector files whose rules apply (`connector_names_for`): resolved once per
    # connector, not once per input (resolving reads the release profiles, sorted, every time)
    names: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: ConnectorConfig | None) -> InputConnector:
        members = () if config is None else tuple(cls.of(m) for m in config.connectors)
        return cls(config, _connector_label(config), connector_env(config), members)


@dataclass(frozen=True, eq=False)
class AnalysisInput:
    """One point of the space: a context (built on demand) and a short label that names it."""

    core: InputCore
    conn: InputConnector

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        return (*self.core.labels, *self.core.tail, ("connector", self.conn.label))

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.labels)

    def to_dict(self) -> dict[str, str]:
        return dict(self.labels)

    @property
    def context(self) -> Context:
        """The full decision context, validated (built on demand: lint and diff need it rarely)."""
        c = self.core.context
        return Context(kv=c.kv, groups=c.groups, backend=c.backend, connector=self.conn.config, profile=c.profile,
                       candidates=c.candidates, options=c.options)

    @property
    def kv(self) -> KVCacheSpec:
        return self.core.context.kv

    @property
    def backend(self) -> BackendProfile:
        return self.core.context.backend

    @property
    def candidates(self) -> tuple[Layout, ...]:
        return self.core.context.candidates

    @property
    def geometry(self) -> tuple[str, ...]:
        return self.core.geometry

    @property
    def env(self) -> dict[str, Any]:
        """What conditions see in the global scope (equal to ``context.env()``)."""
        return {**self.core.env, **self.conn.env}

    def scopes(self, ruleset: RuleSet) -> tuple[Scope, Scope | None]:
        """`kvpolicy.engine.decide.scopes_for` from the shared environments (no trace: ``release`` unset)."""
        env = self.env
        glob = Scope("global", ruleset.global_rules, env, candidates=self.candidates)
        if self.conn.config is None:
            return glob, None
        return glob, self._connector_scope(ruleset, self.conn, f"connector:{self.conn.config.name}", env)

    def _connector_scope(self, ruleset: RuleSet, conn: InputConnector, label: str, env: dict[str, Any] | None) -> Scope:
        name = conn.config.name  # type: ignore[union-attr]
        members = tuple(self._connector_scope(ruleset, m, f"{label}/{m.config.name}[{i}]", None)  # type: ignore
                        for i, m in enumerate(conn.members))
        if env is None:
            env = self.core.member_envs.get(id(conn))
            if env is None:
                env = self.core.member_envs[id(conn)] = {**self.core.env, **conn.env}
        profile = self.core.context.profile
        names = conn.names.get(profile)
        if names is None:
            names = conn.names[profile] = connector_names_for(profile, name, conn.config.extra)  # type: ignore
        rules = tuple(r for n in names for r in ruleset.connector_rules(n))  # `connector_rules_for`
        return Scope(label, rules, env, members, ruleset.combine_mode(name))


def connector_env(c: ConnectorConfig | None) -> dict[str, Any]:
    env = {path: spec.get(None, c) for path, spec in FIELDS.items()  # type: ignore[arg-type]
           if path.startswith(_CONNECTOR_PREFIX)}
    if c is not None:
        for key, value in c.extra.items():
            env[EXTRA_PREFIX + key] = value
    return env


# ---------------------------------------------------------------------------------------------
# What the rules can tell apart


class _Leaves:
    """Every leaf of the analysed rules, by field: a dimension's values with equal answers
    from every leaf are the same input to the rules."""

    def __init__(self, rulesets: Sequence[RuleSet] = (), rules: Iterable[Any] | None = None) -> None:
        self.by_field: dict[str, list[Callable[[Any], bool]]] = {}
        self.literals: dict[str, list[tuple[str, Any]]] = {}
        self.together: list[tuple[str, ...]] = []  # the fields each rule's condition reads, per rule
        every = [r for rs in rulesets for r in rs.rules] if rules is None else list(rules)
        for rule in every:
            read: list[str] = []
            for leaf in leaves_of(rule.rule.when):
                self.by_field.setdefault(leaf.field, []).append(leaf_predicate(leaf))
                self.literals.setdefault(leaf.field, []).append((leaf.op, leaf.value))
                if leaf.field not in read:
                    read.append(leaf.field)
            if len(read) > 1:
                self.together.append(tuple(sorted(read)))

    def signature(self, env: dict[str, Any]) -> tuple[bool, ...]:
        return tuple(p(env[f]) for f in sorted(env) for p in self.by_field.get(f, ()))

    def values(self, path: str) -> list[Any]:
        """The literals the rules compare ``path`` with (and the integers either side of an ordering)."""
        out: list[Any] = []
        for op, value in self.literals.get(path, []):
            items = value if isinstance(value, list) else [value]
            for v in items:
                if isinstance(v, bool) or v is None:
                    continue
                near = [v - 1, v, v + 1] if op in ("lt", "le", "gt", "ge") and isinstance(v, int) else [v]
                out += [x for x in near if x not in out]
        return out

    def boundaries(self, path: str) -> list[Any]:
        """Each literal ``path`` is compared with and the values either side of it: for a number
        ``v`` the integers ``floor(v) - 1 .. ceil(v) + 1`` (both sides of ``ge 8``, ``gt 16``, and
        one value outside an ``in`` list), for a string or a boolean the literal itself."""
        out: list[Any] = []
        for _op, value in self.literals.get(path, []):
            for v in value if isinstance(value, list) else [value]:
                if v is None:
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    near: list[Any] = list(range(math.floor(v) - 1, math.ceil(v) + 2))
                    if isinstance(v, float) and not v.is_integer():
                        near.append(v)
                else:
                    near = [v]
                out += [x for x in near if not any(x == o and type(x) is type(o) for o in out)]
        return out

    def classes(self, path: str, values: Iterable[Any]) -> list[Any]:
        """The first of each group of ``values`` (None: absent) every leaf on ``path`` answers alike."""
        preds = self.by_field.get(path, ())
        return list(_distinct(values, lambda v: tuple(p(MISSING if v is None else v) for p in preds)))


def _variants_of(leaves: _Leaves, base: dict[str, Any], prefix: str, valid: Callable[[str, Any], bool],
                 cap: int = 256, limit: int | None = None, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """Overrides of ``base`` (field -> value, None: absent) reaching every answer the rules can give.

    One field at a time over the classes of its boundary values, the others at ``base``; and for the
    fields one rule reads together, their product (pairs only, beyond ``cap`` combinations). So the
    count grows with the distinct literals, not exponentially in the number of fields. At most ``limit``
    are made (a rule reading 500 extra keys together has 500,000 pairs); those past it are counted into
    ``skipped[0]`` (an upper bound: some would have been duplicates) without being built.
    """
    kept: dict[str, list[Any]] = {}
    for path in sorted(p for p in leaves.literals if p.startswith(prefix)):
        key = path[len(prefix):]
        if key not in base and prefix != EXTRA_PREFIX:
            continue
        start = base.get(key)
        values = [v for v in leaves.boundaries(path) if valid(key, v)]
        kept[key] = leaves.classes(path, [start, *values])  # the base's class first
    out: list[dict[str, Any]] = [{}]
    seen: set[tuple[tuple[str, str], ...]] = {()}
    over = 0

    def full() -> bool:
        return limit is not None and len(out) >= limit

    def add(change: dict[str, Any]) -> None:
        nonlocal over
        change = {k: v for k, v in change.items() if v != base.get(k) or type(v) is not type(base.get(k))}
        mark = tuple(sorted((k, repr(v)) for k, v in change.items()))
        if mark not in seen:
            if full():
                over += 1
                return
            seen.add(mark)
            out.append(change)

    for key, values in kept.items():
        for v in values[1:]:
            add({key: v})
    for fields in dict.fromkeys(leaves.together):  # rules reading the same fields add the same variants
        keys = [f[len(prefix):] for f in fields if f.startswith(prefix) and f[len(prefix):] in kept]
        if len(keys) < 2:
            continue
        counts = [len(kept[k]) for k in keys]
        whole = math.prod(counts) <= cap
        total = math.prod(counts) if whole else (sum(counts) ** 2 - sum(n * n for n in counts)) // 2
        done = 0
        for group in ([keys] if whole else itertools.combinations(keys, 2)):
            if full():  # the rest is counted, not enumerated
                over += total - done
                break
            for combo in itertools.product(*(kept[k] for k in group)):
                add(dict(zip(group, combo)))
            done += math.prod(len(kept[k]) for k in group)
    if skipped is not None:
        skipped[0] += over
    return out


def _distinct(values: Iterable[Any], key: Callable[[Any], Any]) -> dict[Any, list[Any]]:
    """First value of each key -> every value it stands for, in order."""
    firsts: dict[Any, Any] = {}
    out: dict[Any, list[Any]] = {}
    for v in values:
        k = key(v)
        if k not in firsts:
            firsts[k] = v
            out[v] = [v]
        else:
            out[firsts[k]].append(v)
    return out


# ---------------------------------------------------------------------------------------------
# Connectors


def _connector_label(c: ConnectorConfig | None) -> str:
    if c is None:
        return "none"
    text = c.name + ("{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(c.extra.items())) + "}"
                     if c.extra else "")
    if c.prefers_cross_layer_blocks is not None:
        text += f"(prefers_cross_layer_blocks={json.dumps(c.prefers_cross_layer_blocks)})"
    if c.connectors:
        text += "[" + ",".join(_connector_label(m) for m in c.connectors) + "]"
    return text


def _modes(profile: str, name: str) -> tuple[str, tuple[str, ...]] | None:
    """The extra-config key that chooses the class ``profile`` loads for ``name``, and its values
    (`ReleaseProfile.connector_modes`), or None."""
    release = get_profile(profile) if profile in profile_names() else None
    mode = release.connector_modes.get(name) if release is not None else None
    return None if mode is None else (mode.key, tuple(mode.classes))


def _extra_variants(rulesets: Sequence[RuleSet], connector: str, profile: str, limit: int | None = None,
                    skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The ``extra`` dicts of ``connector`` that reach every answer its rules (and the global
    rules) can give on ``connector.extra.*``: none, then each key alone over its boundary values,
    then the keys one rule reads together (at most ``limit``: see `_variants_of`). The rules are
    those of every class the connector can load (`_modes`)."""
    mode = _modes(profile, connector)
    extras: list[dict[str, Any] | None] = [None] + ([{mode[0]: v} for v in mode[1]] if mode else [])
    rules = list({id(r): r for rs in rulesets for e in extras
                  for r in (*rs.global_rules, *connector_rules_for(rs, profile, connector, e))}.values())
    return _variants_of(_Leaves(rules=rules), {}, EXTRA_PREFIX,
                        lambda _k, v: isinstance(v, (str, bool, int, float)), limit=limit, skipped=skipped)


def _with_modes(extras: list[dict[str, Any]], mode: tuple[str, tuple[str, ...]] | None, limit: int | None = None,
                skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """``extras``, each also with the mode key at each of its values (the key left as a variant has it); at
    most ``limit`` of them, the rest counted into ``skipped[0]``."""
    if mode is None:
        return extras
    key, values = mode
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for extra in extras:
        for e in (extra, *({**extra, key: v} for v in values)):
            text = json.dumps(e, sort_keys=True, default=repr)
            if text in seen:
                continue
            seen.add(text)
            if limit is not None and len(out) >= limit:
                if skipped is not None:
                    skipped[0] += 1
                continue
            out.append(e)
    return out


def _variants(rulesets: Sequence[RuleSet], name: str, full: bool, profile: str, limit: int | None = None,
              skipped: list[int] | None = None) -> list[ConnectorConfig]:
    extras = _extra_variants(rulesets, name, profile, limit, skipped if full else None)
    mode = _modes(profile, name)
    if not full:  # members of a composite: absent, or every tested key at its first other value
        merged: dict[str, Any] = {}
        for extra in extras[1:]:
            for k, v in extra.items():
                merged.setdefault(k, v)
        return [ConnectorConfig(name=name, extra=e) for e in _with_modes([{}] + ([merged] if merged else []), mode)]
    return [ConnectorConfig(name=name, extra=extra) for extra in _with_modes(extras, mode, limit, skipped)]


def connectors(rulesets: RuleSet | Sequence[RuleSet], profile: str = "", limit: int | None = None,
               skipped: list[int] | None = None) -> list[ConnectorConfig | None]:
    """None, an unknown connector, every connector with rules in each tested extra variant, and
    MultiConnector pairs of those (the unknown one included: a member that asks for nothing). A
    connector's rules are those ``profile``'s decisions apply to it (`connector_names_for`).

    With ``limit``, at most that many extra variants per connector and that many MultiConnector
    pairs are built; the others are counted into ``skipped[0]``.
    """
    sets = [rulesets] if isinstance(rulesets, RuleSet) else list(rulesets)
    files = {c for rs in sets for c in rs.connectors if c != "MultiConnector"}
    # a name whose class an extra-config key chooses (0.34's NixlConnector) is tried where any class it
    # can load has rules: its mode values reach them (`_with_modes`)
    moded = get_profile(profile).connector_modes if profile in profile_names() else {}
    named = sorted(files | {n for n, m in moded.items()
                            if files & {*m.classes.values(), get_profile(profile).connectors.get(n)}})
    unknown = ConnectorConfig(name=UNKNOWN_CONNECTOR)
    out: list[ConnectorConfig | None] = [None, *_variants(sets, UNKNOWN_CONNECTOR, full=True, profile=profile,
                                                          limit=limit, skipped=skipped)]
    for name in named:
        out += _variants(sets, name, full=True, profile=profile, limit=limit, skipped=skipped)
    members = [v for name in named for v in _variants(sets, name, full=False, profile=profile, limit=limit)]
    members.append(unknown)
    if any(PREFERS_CROSS_LAYER in _fields_read(rs.rules) for rs in sets):
        # the connector object's own prefer_cross_layer_blocks, as the plugin reads it: the unknown
        # connector's (default false) said true, and each named connector's (default: its rules) said
        # either way; an unknown member said true too
        out.append(unknown.model_copy(update={"prefers_cross_layer_blocks": True}))
        out += [ConnectorConfig(name=name, prefers_cross_layer_blocks=v) for name in named for v in (True, False)]
        members.append(unknown.model_copy(update={"prefers_cross_layer_blocks": True}))
    pairs = 0
    for i, a in enumerate(members):
        if limit is not None and pairs >= limit:  # the rest counted, not built (an upper bound)
            if skipped is not None:
                skipped[0] += sum(len(members) - 1 - j for j in range(i, len(members)))
            break
        for b in members[i + 1:]:
            if a.name != b.name:
                out.append(ConnectorConfig(name="MultiConnector", connectors=(a, b)))
                pairs += 1
    if any("MultiConnector" in rs.connectors for rs in sets):
        out.append(ConnectorConfig(name="MultiConnector"))  # configured without members
    return out


# ---------------------------------------------------------------------------------------------
# The space


@dataclass
class Space:
    """The inputs of one profile's space, and what each dimension holds."""

    profile: ReleaseProfile
    inputs: list[AnalysisInput]
    dimensions: dict[str, list[str]] = field(default_factory=dict)
    stands_for: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    left_out: dict[str, list[str]] = field(default_factory=dict)
    cut: Cut | None = None  # how the space was bounded, when it was (`kvpolicy.engine.analysis.budget`)

    def __len__(self) -> int:
        return len(self.inputs)

    def __iter__(self) -> Iterator[AnalysisInput]:
        return iter(self.inputs)

    def describe(self) -> str:
        """One line: the size and each dimension's count, and what was left out."""
        dims = ", ".join(f"{len(v)} {k}" for k, v in self.dimensions.items())
        text = f"{len(self.inputs)} inputs of `{self.profile.name}` ({dims})"
        for what, items in self.left_out.items():
            shown = ", ".join(items[:_LISTED])
            if len(items) > _LISTED:  # a hostile rule set's variants could make this line megabytes long
                shown += f", and {len(items) - _LISTED} more (--format json lists all)"
            text += f"; left out {len(items)} {what}: {shown}"
        if self.cut is not None:
            text += f"; {self.cut.describe()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.name, "size": len(self.inputs), "dimensions": self.dimensions,
                "stands_for": self.stands_for, "left_out": self.left_out,
                "cut": self.cut.to_dict() if self.cut is not None else None}


def _names_any(conn: ConnectorConfig | None, names: Sequence[str]) -> bool:
    """The connector or one of its members (recursively) is named one of ``names``."""
    return conn is not None and (conn.name in names or any(_names_any(m, names) for m in conn.connectors))


def _spec(kind: AttentionKind, dtype: str, sizes: dict[str, Any] | None = None) -> KVCacheSpec:
    base = MLA_SIZES if kind is AttentionKind.mla else SIZES
    return KVCacheSpec(kind=kind, kv_cache_dtype=dtype, **{**base, **(sizes or {})},
                       sliding_window=128 if kind is AttentionKind.sliding_window else None)


def _plannable(backend: BackendProfile, spec: KVCacheSpec) -> bool:
    """kvpolicy has a geometry for ``spec``'s kv_cache_dtype on ``backend`` in this release (vLLM 0.28's
    nvfp4 it decides, but does not plan)."""
    if not spec.kind.is_attention or not backend.layouts:
        return True
    try:
        plan_layout(backend.layouts[0], spec, backend, 1)
    except PolicyError as exc:
        return not exc.diagnostics or exc.diagnostics[0].code not in DECIDED_NOT_PLANNED
    return True


def _fits(kind: AttentionKind, dtype: str) -> bool:
    """A spec of ``kind`` can hold ``dtype`` (an MLA spec cannot hold nvfp4)."""
    try:
        _spec(kind, dtype)
    except ValueError:
        return False
    return True


def _size_variants(leaves: _Leaves, mla: bool, limit: int | None = None,
                   skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The size overrides (``{}``: the default sizes) reaching every answer the rules give on
    ``kv.num_layers``, ``kv.block_size``, ``kv.num_kv_heads``, ``kv.head_size`` (at most ``limit``)."""
    return _variants_of(leaves, MLA_SIZES if mla else SIZES, "kv.",
                        lambda _k, v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                        limit=limit, skipped=skipped)


def _size_label(sizes: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(sizes.items())) or "default"


PREFERS_CROSS_LAYER = "connector.prefers_cross_layer_blocks"


def _fields_read(rules: Iterable[Any]) -> set[str]:
    return {leaf.field for r in rules for leaf in leaves_of(r.rule.when)}


def _group_shapes(leaves: _Leaves) -> tuple[str, ...]:
    """The fixed shapes, then ``Nx1`` (N groups) and ``1xM`` (M attention groups in one) for each
    count from 3 to 64 either side of a literal the rules compare ``groups.count`` or
    ``groups.attention_groups`` with."""
    extra = [f"{v}x1" for v in leaves.boundaries("groups.count") if type(v) is int and 3 <= v <= 64]
    extra += [f"1x{v}" for v in leaves.boundaries("groups.attention_groups") if type(v) is int and 3 <= v <= 64]
    return GROUP_SHAPES + tuple(dict.fromkeys(extra))


def _groups(spec: KVCacheSpec, shape: str) -> KVCacheGroups:
    if shape == "1x1":
        return KVCacheGroups.single(spec)
    if shape.startswith("1x") and shape[2:].isdigit():
        return KVCacheGroups(groups=(KVCacheGroup(spec=spec, num_attention_groups=int(shape[2:])),))
    if shape.endswith("x1") and shape[:-2].isdigit():  # N groups: the spec and another kind, alternating
        kind = AttentionKind.mla if spec.kind is AttentionKind.mla else AttentionKind.sliding_window
        other = spec.model_copy(update={"kind": kind, "sliding_window": None if kind is AttentionKind.mla else 128})
        return KVCacheGroups(groups=tuple(KVCacheGroup(spec=other if i % 2 else spec)
                                          for i in range(int(shape[:-2]))))
    if shape == "mamba-hybrid":
        mamba = KVCacheSpec(kind=AttentionKind.mamba, num_layers=spec.num_layers, block_size=spec.block_size,
                            num_kv_heads=1, head_size=16)
        return KVCacheGroups(groups=(KVCacheGroup(spec=spec), KVCacheGroup(spec=mamba)))
    # another attention spec whose pages differ: twice the head size (an MLA indexer, a draft model)
    other = spec.model_copy(update={"head_size": spec.head_size * 2})
    if shape == "mixed-hnc":
        return KVCacheGroups(groups=(KVCacheGroup(spec=spec), KVCacheGroup(spec=other)))
    # dcp-mixed: a DCP-sharded target and a replicated draft with another page size
    return KVCacheGroups(groups=(KVCacheGroup(spec=spec), KVCacheGroup(spec=other, dcp_sharded=False)))


def _kv_choices(profile: ReleaseProfile, leaves: _Leaves, left_out: list[str]
               ) -> tuple[dict[bool, list[tuple[AttentionKind, str]]], dict[str, list[str]], dict[str, list[str]]]:
    """(MLA or not -> the (kind, kv_cache_dtype) pairs to enumerate), and what each dtype and kind stands for.

    Two ``kv_cache_dtype`` strings are one when they give the same quant mode and
    element size (so the same cell geometry) and no rule tells them apart; two
    kinds are one when no rule tells them apart. Strings kvpolicy has no cell
    geometry for go to ``left_out``.
    """
    usable = [d for d in profile.kv_cache_dtypes if d in KV_CACHE_DTYPES]
    left_out += [d for d in profile.kv_cache_dtypes if d not in KV_CACHE_DTYPES]
    out: dict[bool, list[tuple[AttentionKind, str]]] = {}
    dtype_for: dict[str, list[str]] = {}
    kind_for: dict[str, list[str]] = {}
    if not usable:
        return {False: [], True: []}, dtype_for, kind_for

    def kv_fields(spec: KVCacheSpec) -> dict[str, Any]:
        return {k: v for k, v in _probe(spec).items() if k.startswith("kv.")}

    for mla in (False, True):
        kinds = [AttentionKind.mla] if mla else [AttentionKind.full, AttentionKind.sliding_window,
                                                 AttentionKind.mamba]

        def dtype_key(d: str, kind: AttentionKind = kinds[0]) -> Any:
            spec = _spec(kind, d)
            return spec.quant_mode, spec.cache_dtype.size_bytes, leaves.signature(kv_fields(spec))

        fits = [d for d in usable if _fits(kinds[0], d)]  # nvfp4 is no MLA format
        dtypes = _distinct(fits, dtype_key)
        kinds_kept = _distinct(kinds, lambda k: leaves.signature(kv_fields(_spec(k, usable[0]))))
        out[mla] = [(k, d) for k in kinds_kept for d in dtypes]
        for d, same in dtypes.items():
            dtype_for.setdefault(d, same)
        for k, same_kinds in kinds_kept.items():
            kind_for[k.value] = [x.value for x in same_kinds]
    return out, dtype_for, kind_for


_PROBE_BACKENDS = {mla: packed_backend("PROBE", mla=mla) for mla in (False, True)}


def _probe(spec: KVCacheSpec, groups: KVCacheGroups | None = None,
           options: VllmOptions | None = None) -> dict[str, Any]:
    """The fields a stand-in context with these parts shows (read only for kv.*, groups.* and options)."""
    backend = _PROBE_BACKENDS[spec.kind is AttentionKind.mla]
    ctx = Context.model_construct(kv=spec, groups=groups or KVCacheGroups.single(spec), backend=backend,
                                  connector=None, profile="", candidates=(), options=options or VllmOptions())
    return ctx.env()


_Combo = tuple[str | None, bool, bool, bool]


def _option_values(profile: ReleaseProfile, leaves: _Leaves
                   ) -> tuple[list[_Combo], dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """The (VLLM_KV_CACHE_LAYOUT, enable_extensible_kv_cache, hisparse, use_v2_model_runner) combinations
    of the profile (only the values and settings its release takes) the rules can tell apart, each
    dimension's values, and what the kept layout values stand for."""
    def sig(path: str) -> Callable[[Any], Any]:
        return lambda v: leaves.signature({path: MISSING if v is None else v})

    def flags(name: str) -> tuple[bool, ...]:
        return (False, True) if name in profile.options else (False,)

    layouts = _distinct((None, *profile.kv_cache_layout_values()), sig("env.VLLM_KV_CACHE_LAYOUT"))
    extensible = _distinct(flags("enable_extensible_kv_cache"), sig("cache.enable_extensible_kv_cache"))
    hisparse = _distinct(flags("hisparse"), sig("attention.hisparse"))
    v2_runner = _distinct((False, True), sig("worker.use_v2_model_runner"))
    combos = list(itertools.product(layouts, extensible, hisparse, v2_runner))
    dims = {"VLLM_KV_CACHE_LAYOUT": [x or "unset" for x in layouts],
            "enable_extensible_kv_cache": [str(x).lower() for x in extensible],
            "hisparse": [str(x).lower() for x in hisparse],
            "use_v2_model_runner": [str(x).lower() for x in v2_runner]}
    stands = {"VLLM_KV_CACHE_LAYOUT": {k or "unset": [x or "unset" for x in v] for k, v in layouts.items()}}
    return combos, dims, stands


def _capabilities(profile: ReleaseProfile, name: str, leaves: _Leaves) -> list[int | None]:
    """None, and each device capability that changes the backend's layouts or a rule's answer."""
    facts = profile.backends[name]
    values: list[int | None] = [None]
    if profile.resolver is Resolver.kv_cache_layout:
        values += sorted(facts.supported_layouts_by_capability)
    values += [v for v in leaves.values("platform.device_capability")
               if isinstance(v, int) and 0 < v < 100 and v not in values]
    path = "platform.device_capability"
    return list(_distinct(values, lambda v: (facts.declared_layouts(v),
                                             leaves.signature({path: MISSING if v is None else v}))))


def build_space(
    rulesets: RuleSet | Sequence[RuleSet],
    *,
    vllm_version: str | ReleaseProfile | None = None,
    scale_views: Sequence[ScaleViews] | None = None,
    backends: Sequence[str] | None = None,
    kv_cache_dtypes: Sequence[str] | None = None,
    max_inputs: int = DEFAULT_MAX_INPUTS,
) -> Space:
    """The space of ``vllm_version``'s profile (default: the default profile) that ``rulesets`` read.

    ``scale_views`` overrides the backends' own strategy (a what-if: the
    released backends build stride-aware views, the #48412 state did not);
    ``backends`` and ``kv_cache_dtypes`` restrict those dimensions. At most
    ``max_inputs`` inputs are built (fewer for more than `budget.WORK_RULES_PER_INPUT` rules in
    ``rulesets``: the work is inputs x rules); past that the space is cut as
    `kvpolicy.engine.analysis.budget` says, and ``Space.cut`` tells how.
    """
    if isinstance(max_inputs, bool) or not isinstance(max_inputs, int) or not 1 <= max_inputs <= MAX_SPACE_LIMIT:
        raise input_error("max_inputs", f"`max_inputs` must be a positive int of at most {MAX_SPACE_LIMIT}, got "
                          f"`{max_inputs!r:.40}`",
                          f"pass the most inputs the space may hold (default {DEFAULT_MAX_INPUTS})")
    sets = [rulesets] if isinstance(rulesets, RuleSet) else list(rulesets)
    profile = get_profile(vllm_version)
    # the work is inputs x rules: many rules get fewer inputs (`budget.inputs_for_rules`)
    max_space, rules = max_inputs, sum(len(rs.rules) for rs in {id(rs): rs for rs in sets}.values())
    max_inputs = inputs_for_rules(max_space, rules)
    leaves = _Leaves(sets)
    no_geometry: list[str] = []
    pairs, dtype_for, kind_for = _kv_choices(profile, leaves, no_geometry)
    if kv_cache_dtypes is not None:
        pairs = {m: [(k, d) for k, d in p if d in kv_cache_dtypes] for m, p in pairs.items()}
    combos, option_dims, option_stands = _option_values(profile, leaves)
    # No list of variants is built longer than the bound could ever keep (each costs at least one input,
    # and thousands in practice): the rest are counted as left out.
    limit = max(1_000, max_inputs // 50)
    skipped_conns, skipped_sizes = [0], [0]
    conns = [InputConnector.of(c) for c in connectors(sets, profile.name, limit=limit, skipped=skipped_conns)]
    no_connector = connector_env(None)
    names = [n for n in profile.backend_names() if backends is None or n in backends]
    strategies: list[ScaleViews | None] = list(scale_views) if scale_views else [None]
    shapes: dict[tuple[AttentionKind, str], list[str]] = {}
    group_shapes = _group_shapes(leaves)
    option_env: dict[tuple[int, int | None], tuple[VllmOptions, dict[str, Any]]] = {}
    inputs: list[AnalysisInput] = []
    dims: dict[str, list[str]] = {"backend": [], "kv_cache_dtype": [], "kind": [], "groups": []}
    refused: dict[str, list[str]] = {}
    invalid: list[str] = []
    unplanned: list[str] = []  # backend/kv_cache_dtype pairs kvpolicy decides but has no geometry for

    # A release that derives HiSparse from its connector (0.34: VllmConfig turns it on for a HiSparse
    # connector and refuses it without one) pairs each connector with the one value it allows.
    derived = profile.hisparse_connectors
    told_apart = len(option_dims["hisparse"]) > 1
    with_hisparse = [c for c in conns if derived and _names_any(c.config, derived)]
    without = [c for c in conns if c not in with_hisparse]

    def conns_by_hisparse(wanted: bool) -> list[tuple[bool, list[InputConnector]]]:
        if not derived:
            return [(wanted, conns)]
        if told_apart:
            return [(wanted, with_hisparse if wanted else without)]
        return [(False, without), (True, with_hisparse)]

    def seen(dim: str, value: str) -> None:
        if value not in dims[dim]:
            dims[dim].append(value)

    # A size other than the default is paired only with the connectors whose rules (or the global
    # rules) read that size: for the others it decides as the default does.
    sizes = {mla: _size_variants(leaves, mla, limit, skipped_sizes) for mla in (False, True)}
    dims["sizes"] = []
    global_reads = _fields_read(r for rs in sets for r in rs.global_rules)

    def conn_reads(c: ConnectorConfig | None) -> set[str]:
        if c is None:
            return set()
        return _fields_read(r for rs in sets for r in connector_rules_for(rs, profile.name, c.name, c.extra)).union(
            *(conn_reads(m) for m in c.connectors))

    reads = {id(c): conn_reads(c.config) for c in conns}
    every_rule = [r for rs in sets for r in rs.rules]

    def around(over: dict[str, Any]) -> tuple[set[int] | None, str]:
        """For a size variant: the connectors it pairs with (None: all), and which other dimensions
        vary with it ("kv": backends, capabilities, dtypes and kinds; "groups"; "options"): those
        some rule reading one of its sizes also reads. The rest stay at their first value."""
        paths = {"kv." + k for k in over}
        allowed = None if paths & global_reads else {id(c) for c in conns if paths & reads[id(c)]}
        also = _fields_read(r for r in every_rule if paths & _fields_read([r])) - {"kv." + k for k in SIZES}
        wide = ("kv" if any(f.startswith(("kv.", "backend.", "platform.")) for f in also) else "") + \
            (" groups" if any(f.startswith("groups.") for f in also) else "") + \
            (" options" if any(f.startswith(_OPTION_PREFIXES) and not f.startswith("platform.") for f in also) else "")
        return allowed, wide

    arounds = {_size_label(o): around(o) for mla in (False, True) for o in sizes[mla] if o}
    thin_done: set[tuple[Any, ...]] = set()

    # What each backend decides over (the loop below skips the rest), and the group shapes of each spec.
    caps = {name: _capabilities(profile, name, leaves) for name in names}
    kv_for: dict[str, list[tuple[AttentionKind, str]]] = {}
    for name in names:
        facts = profile.backends[name]
        kv_for[name] = []
        for kind, dtype in pairs[facts.mla]:
            if facts.kv_cache_dtypes is not None and dtype not in facts.kv_cache_dtypes:
                continue
            spec = _spec(kind, dtype)
            if not _plannable(profile.backend(name), spec):
                if f"{name}/{dtype}" not in unplanned:
                    unplanned.append(f"{name}/{dtype}")
                continue
            kv_for[name].append((kind, dtype))
            if (kind, dtype) not in shapes:  # a Mamba spec stands for a model of Mamba layers only
                own = ("1x1",) if kind is AttentionKind.mamba else group_shapes
                shapes[(kind, dtype)] = list(_distinct(own, lambda s, spec=spec: leaves.signature(
                    {k: v for k, v in _probe(spec, _groups(spec, s)).items() if k.startswith("groups.")})))
    # how many of vLLM's option combinations each connector pairs with (HiSparse splits them), over all or the first
    member_sets = {wide: [{id(m) for m in members} for combo in (combos if wide else combos[:1])
                          for _, members in conns_by_hisparse(combo[2])] for wide in (True, False)}
    weights = {wide: tuple(sum(id(c) in ids for ids in member_sets[wide]) for c in conns) for wide in (True, False)}
    sizes, conns, cut = _bounded(sizes, conns, max_inputs, caps, kv_for, shapes, len(strategies), weights,
                                 arounds, profile, skipped_sizes[0], skipped_conns[0])
    with_hisparse = [c for c in conns if derived and _names_any(c.config, derived)]
    without = [c for c in conns if c not in with_hisparse]
    stopped = False

    for name in names:
        if stopped:
            break
        facts = profile.backends[name]
        own_views = profile.backend(name).scale_views
        for strategy, cap in itertools.product(strategies, caps[name]):
            views = (strategy or own_views).value
            for kind, dtype in kv_for[name]:
                spec = _spec(kind, dtype)
                for shape, over in itertools.product(shapes[(kind, dtype)], sizes[facts.mla]):
                    if stopped:
                        break
                    size_label = _size_label(over)
                    allowed, wide = arounds[size_label] if over else (None, "kv groups options")
                    if allowed is not None and not allowed:
                        continue
                    if "groups" not in wide and shape != shapes[(kind, dtype)][0]:
                        continue
                    thin = None if "kv" in wide else (facts.mla, size_label, shape)
                    if thin in thin_done:
                        continue
                    where = f"{name}/{dtype}/{shape}" + (f"/{size_label}" if over else "")
                    try:
                        groups = _groups(_spec(kind, dtype, over), shape)
                    except ValueError:  # sizes no spec of this kind can have (an MLA spec has one head)
                        invalid.append(where)
                        continue
                    try:  # as an operator's input is built: the release's candidates and checks
                        ctx = build_context(groups=groups, attention_backend=name,
                                            scale_views=strategy, vllm_version=profile, device_capability=cap)
                    except PolicyError as exc:  # an input the release cannot have: say so, skip it
                        refused.setdefault(exc.render().splitlines()[0], []).append(where)
                        continue
                    core_env = {k: v for k, v in ctx.env().items()
                                if not k.startswith((*_OPTION_PREFIXES, _CONNECTOR_PREFIX))}
                    labels = [("kv_cache_dtype", dtype), ("backend", name)]
                    if cap is not None:
                        labels.append(("device_capability", str(cap)))
                    labels += [("scale_views", views), ("kind", kind.value), ("groups", shape)]
                    labels += [(k, str(v)) for k, v in sorted(over.items())]
                    geometry = (dtype, kind.value, name, views) + ((size_label,) if over else ())
                    if thin is not None:
                        thin_done.add(thin)
                    for i, combo in enumerate(combos if "options" in wide else combos[:1]):
                        for hisparse, members in conns_by_hisparse(combo[2]):
                            key = (i, cap, hisparse)
                            if key not in option_env:
                                options = VllmOptions(kv_cache_layout=combo[0], enable_extensible_kv_cache=combo[1],
                                                      hisparse=hisparse, device_capability=cap,
                                                      use_v2_model_runner=combo[3])
                                probe = _probe(spec, options=options)
                                option_env[key] = options, {k: v for k, v in probe.items()
                                                            if k.startswith(_OPTION_PREFIXES)}
                            options, opt_env = option_env[key]
                            full = Context.model_construct(kv=ctx.kv, groups=ctx.groups, backend=ctx.backend,
                                                           connector=None, profile=ctx.profile,
                                                           candidates=ctx.candidates, options=options)
                            tail = ((("VLLM_KV_CACHE_LAYOUT", combo[0]),) if combo[0] is not None else ()) + \
                                ((("enable_extensible_kv_cache", "true"),) if combo[1] else ()) + \
                                ((("hisparse", "true"),) if hisparse else ()) + \
                                ((("use_v2_model_runner", "true"),) if combo[3] else ())
                            core = InputCore(full, {**core_env, **opt_env, **no_connector}, tuple(labels), tail,
                                         geometry)
                            batch = [AnalysisInput(core, c) for c in members if allowed is None or id(c) in allowed]
                            if len(inputs) + len(batch) > max_inputs:  # tier 0 alone is over the bound
                                inputs += batch[: max_inputs - len(inputs)]
                                stopped = True
                                break
                            inputs += batch
                        if stopped:
                            break
                    seen("kv_cache_dtype", dtype)
                    seen("sizes", size_label)
                    seen("kind", kind.value)
                    seen("groups", shape)
            seen("backend", name if cap is None else f"{name}@{cap}")
    out_dims = {**dims, **option_dims, "connector": [c.label for c in conns]}
    if scale_views:
        out_dims["scale_views"] = [s.value for s in scale_views]
    stands = {"kv_cache_dtype": {k: v for k, v in dtype_for.items() if k in dims["kv_cache_dtype"]},
              "kind": {k: v for k, v in kind_for.items() if k in dims["kind"]}, **option_stands}
    left_out: dict[str, list[str]] = {}
    if no_geometry:
        left_out["kv_cache_dtypes kvpolicy has no cell geometry for"] = no_geometry
    if unplanned:
        left_out["backend/kv_cache_dtype pairs kvpolicy decides but cannot plan for this release"] = unplanned
    if invalid:
        left_out["size variants no spec of that kind can have"] = invalid
    for message, where in refused.items():
        left_out[f"inputs the release refuses ({message})"] = where
    cut = dataclasses.replace(cut, stopped=stopped, max_space=max_space, rules=rules)
    told = stopped or cut.size_variants_left_out or cut.connectors_left_out
    return Space(profile, inputs, out_dims, stands, left_out, cut if told else None)


def _bounded(sizes: dict[bool, list[dict[str, Any]]], conns: list[InputConnector], max_inputs: int,
             caps: dict[str, list[int | None]], kv_for: dict[str, list[tuple[AttentionKind, str]]],
             shapes: dict[tuple[AttentionKind, str], list[str]], n_strategies: int,
             weights: dict[bool, tuple[int, ...]],
             arounds: dict[str, tuple[set[int] | None, str]], profile: ReleaseProfile,
             unbuilt_sizes: int = 0, unbuilt_conns: int = 0
             ) -> tuple[dict[bool, list[dict[str, Any]]], list[InputConnector], Cut]:
    """The size variants and connectors `build_space` explores within ``max_inputs`` (see `budget`), and the
    `Cut` that says what was left out (nothing, when the estimate fits); estimated from the dimensions
    before any input is built. ``unbuilt_*``: variants past the generation limit, left out unbuilt (each
    counted in the estimate at the cost of the cheapest one built of its tier 2)."""
    index = {id(c): i for i, c in enumerate(conns)}
    costs: list[SizeCost] = []
    where: list[tuple[bool, int]] = []
    for mla in (False, True):
        backends = [n for n in kv_for if profile.backends[n].mla is mla]
        for j, over in enumerate(sizes[mla]):
            allowed, wide = arounds[_size_label(over)] if over else (None, "kv groups options")
            per_kv = [(len(shapes[kd]) if "groups" in wide else 1) for n in backends for kd in kv_for[n]]
            if "kv" in wide:
                cores = n_strategies * sum(len(caps[n]) * sum((len(shapes[kd]) if "groups" in wide else 1)
                                                               for kd in kv_for[n]) for n in backends)
            else:  # the first backend that accepts it stands for the rest
                cores = max(per_kv, default=0)
            costs.append(SizeCost(cores, None if allowed is None else frozenset(index[a] for a in allowed),
                                  tier_of_override(over), weights["options" in wide]))
            where.append((mla, j))
    tiers = [_connector_tier(c.config) for c in conns]
    keep_size, keep_conn, full, _ = plan_cut(costs, tiers, max_inputs)
    if unbuilt_sizes:
        full += unbuilt_sizes * min((c.cores for c in costs if c.tier), default=0)
    if unbuilt_conns:
        base = sum(c.cores * c.weights[0] for c in costs if c.allowed is None)  # what `none` pairs with
        full += unbuilt_conns * base
    position = {w: i for i, w in enumerate(where)}
    kept = {mla: [over for j, over in enumerate(sizes[mla]) if keep_size[position[(mla, j)]]]
            for mla in (False, True)}
    return kept, [c for c, k in zip(conns, keep_conn) if k], Cut(
        max_inputs, full, keep_size.count(False) + unbuilt_sizes, len(costs) + unbuilt_sizes,
        keep_conn.count(False) + unbuilt_conns, len(conns) + unbuilt_conns)


def _connector_tier(c: ConnectorConfig | None) -> int:
    """0: no connector, or one as plainly configured; 1: one extra key or its cross-layer preference set;
    2: more set together, or a MultiConnector pair."""
    if c is None:
        return 0
    if c.connectors:
        return 2
    return min(len(c.extra) + (c.prefers_cross_layer_blocks is not None), 2)


def enumerate_inputs(
    rulesets: RuleSet | Sequence[RuleSet],
    *,
    vllm_version: str | ReleaseProfile | None = None,
    scale_views: Sequence[ScaleViews] | None = None,
    backends: Sequence[str] | None = None,
    kv_cache_dtypes: Sequence[str] | None = None,
) -> Iterator[AnalysisInput]:
    """Every input of `build_space`, in a deterministic order."""
    return iter(build_space(rulesets, vllm_version=vllm_version, scale_views=scale_views, backends=backends,
                            kv_cache_dtypes=kv_cache_dtypes))
