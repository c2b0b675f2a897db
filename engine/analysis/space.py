"""The finite input space a rule set is analysed over.

Every combination of: kv_cache_dtype, backend profile x scale-view strategy,
attention kind, group structure, and connector (none, each known connector
with each value its rules test in ``connector.extra.*``, an unknown one, and
MultiConnector pairs). Sizes are small and representative: the verifier's
answer does not depend on them (its geometry is periodic), and rules testing
sizes see the values they compare with.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from policy.backends import BACKENDS, BackendProfile, ScaleViews
from policy.conditions import leaves_of
from policy.connectors import ConnectorConfig
from policy.context import EXTRA_PREFIX, Context
from policy.quant import KV_CACHE_DTYPES
from policy.ruleset import RuleSet
from policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

__all__ = ["AnalysisInput", "enumerate_inputs"]

SIZES = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 16}
MLA_SIZES = {"num_layers": 4, "block_size": 16, "num_kv_heads": 1, "head_size": 32}
GROUP_SHAPES = ("1x1", "1x2", "2x1", "mamba-hybrid")
UNKNOWN_CONNECTOR = "ThirdPartyConnector"


@dataclass(frozen=True)
class AnalysisInput:
    """One point of the space: a context and a short label that names it."""

    context: Context
    labels: tuple[tuple[str, str], ...]

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.labels)

    def to_dict(self) -> dict[str, str]:
        return dict(self.labels)


def _connector_label(c: ConnectorConfig | None) -> str:
    if c is None:
        return "none"
    text = c.name + ("{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(c.extra.items())) + "}"
                     if c.extra else "")
    if c.connectors:
        text += "[" + ",".join(_connector_label(m) for m in c.connectors) + "]"
    return text


def _extra_values(ruleset: RuleSet, connector: str) -> dict[str, list[Any]]:
    values: dict[str, list[Any]] = {}
    for rule in ruleset.connector_rules(connector):
        for leaf in leaves_of(rule.rule.when):
            if leaf.field.startswith(EXTRA_PREFIX):
                key = leaf.field[len(EXTRA_PREFIX):]
                lits = leaf.value if isinstance(leaf.value, list) else [leaf.value]
                bucket = values.setdefault(key, [])
                for v in lits:
                    if isinstance(v, (str, bool, int, float)) and not any(v == b and type(v) is type(b)
                                                                         for b in bucket):
                        bucket.append(v)
    return values


def _variants(ruleset: RuleSet, name: str, full: bool) -> list[ConnectorConfig]:
    values = _extra_values(ruleset, name)
    keys = sorted(values)
    if not full:  # members of a composite: absent, or every tested key at its first literal
        out = [ConnectorConfig(name=name)]
        if keys:
            out.append(ConnectorConfig(name=name, extra={k: values[k][0] for k in keys}))
        return out
    choices = [[None, *values[k]] for k in keys]
    out = []
    for combo in itertools.product(*choices):
        out.append(ConnectorConfig(name=name, extra={k: v for k, v in zip(keys, combo) if v is not None}))
    return out


def connectors(ruleset: RuleSet) -> list[ConnectorConfig | None]:
    """None, every connector with rules in each tested extra variant, an unknown one, and pairs."""
    named = [c for c in ruleset.connectors if c != "MultiConnector"]
    out: list[ConnectorConfig | None] = [None, ConnectorConfig(name=UNKNOWN_CONNECTOR)]
    for name in named:
        out += _variants(ruleset, name, full=True)
    members = [v for name in named for v in _variants(ruleset, name, full=False)]
    for a, b in itertools.combinations(members, 2):
        if a.name != b.name:
            out.append(ConnectorConfig(name="MultiConnector", connectors=(a, b)))
    return out


def _groups(spec: KVCacheSpec, shape: str) -> KVCacheGroups:
    if shape == "1x1":
        return KVCacheGroups.single(spec)
    if shape == "1x2":
        return KVCacheGroups(groups=(KVCacheGroup(spec=spec, num_attention_groups=2),))
    if shape == "2x1":
        other = spec.model_copy(update={"kind": AttentionKind.sliding_window, "sliding_window": 128})
        return KVCacheGroups(groups=(KVCacheGroup(spec=spec), KVCacheGroup(spec=other)))
    mamba = KVCacheSpec(kind=AttentionKind.mamba, num_layers=spec.num_layers, block_size=spec.block_size,
                        num_kv_heads=1, head_size=16)
    return KVCacheGroups(groups=(KVCacheGroup(spec=spec), KVCacheGroup(spec=mamba)))


def enumerate_inputs(
    ruleset: RuleSet,
    *,
    backends: list[BackendProfile] | None = None,
    scale_views: list[ScaleViews] | None = None,
    kv_cache_dtypes: list[str] | None = None,
) -> Iterator[AnalysisInput]:
    """Every input of the space, in a deterministic order."""
    profiles = backends if backends is not None else list(BACKENDS.values())
    strategies = scale_views if scale_views is not None else list(ScaleViews)
    dtypes = kv_cache_dtypes if kv_cache_dtypes is not None else list(KV_CACHE_DTYPES)
    conns = connectors(ruleset)
    for backend, strategy in itertools.product(profiles, strategies):
        profile = backend.with_scale_views(strategy)
        kinds = [AttentionKind.mla] if backend.mla else [AttentionKind.full, AttentionKind.sliding_window]
        for kind, dtype, shape in itertools.product(kinds, dtypes, GROUP_SHAPES):
            sizes = MLA_SIZES if kind is AttentionKind.mla else SIZES
            spec = KVCacheSpec(kind=kind, kv_cache_dtype=dtype,
                               sliding_window=128 if kind is AttentionKind.sliding_window else None, **sizes)
            groups = _groups(spec, shape)
            for conn in conns:
                ctx = Context(kv=spec, groups=groups, backend=profile, connector=conn)
                yield AnalysisInput(ctx, (
                    ("kv_cache_dtype", dtype), ("backend", backend.name), ("scale_views", strategy.value),
                    ("kind", kind.value), ("groups", shape), ("connector", _connector_label(conn)),
                ))
