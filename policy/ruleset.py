"""A loaded, validated and compiled rule set: what the engine evaluates.

Immutable. Built only by `kvpolicy.policy.load`, which never hands out a partially
valid set.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from kvpolicy.policy.conditions import CompiledCondition, compile_condition
from kvpolicy.policy.errors import shown_file
from kvpolicy.policy.layouts import ALL_LAYOUTS, Layout, LayoutPattern
from kvpolicy.policy.rule_model import Effect, MemberPreferences, Rule, Waiver
from kvpolicy.policy.waivers import CompiledWaiver, today

__all__ = ["EFFECT_CODES", "FORBID", "PREFER", "REQUIRE", "CompiledRule", "RuleSet", "Source"]


@dataclass(frozen=True, order=True)
class Source:
    """Where a rule is written: shown wherever the rule is named."""

    file: str
    line: int
    col: int = 1

    def __str__(self) -> str:
        return f"{shown_file(self.file)}:{self.line}"  # one line of valid text, whatever the file's name


# Effect codes of the hot loop (`CompiledRule.fast[1]`): ints compare faster than enum members.
FORBID, REQUIRE, PREFER = 0, 1, 2
EFFECT_CODES = {Effect.forbid: FORBID, Effect.require: REQUIRE, Effect.prefer: PREFER}


@dataclass(frozen=True)
class CompiledRule:
    """A rule ready to evaluate, with its scope and precomputed candidate mask."""

    rule: Rule
    source: Source
    scope: str | None  # connector name, or None for global
    condition: CompiledCondition = field(compare=False)
    mask: int  # bit i set: the pattern matches layout_order[i]
    # (test, effect code 0 forbid / 1 require / 2 prefer, mask, per-candidate weights): the hot loop's view
    fast: tuple[Any, ...] = field(default=(), compare=False)
    # the waivers of this rule (kvpolicy.policy.waivers), lapsed ones too: where one in force holds, the rule
    # has no effect (`fast[0]` already says so); a lapsed one is only reported
    waivers: tuple[CompiledWaiver, ...] = field(default=(), compare=False)

    def waived_by(self, env: Any) -> CompiledWaiver | None:
        """The first waiver in force whose condition holds in ``env``, or None."""
        return next((w for w in self.waivers if w.in_force and w.condition.test(env)), None)

    def lapsed_for(self, env: Any) -> tuple[CompiledWaiver, ...]:
        """The lapsed waivers that would cover this rule in ``env``: the rule applies again there."""
        return tuple(w for w in self.waivers if not w.in_force and w.condition.test(env))

    @property
    def id(self) -> str:
        return self.rule.id

    @property
    def effect(self) -> Effect:
        return self.rule.effect

    @property
    def pattern(self) -> LayoutPattern:
        return self.rule.pattern

    @property
    def weight(self) -> int:
        return self.rule.weight or 1

    def removes(self, i: int) -> bool:
        """Whether this rule, when it matches, removes candidate ``i`` of the layout order."""
        hit = bool(self.mask >> i & 1)
        return (self.fast[1] == FORBID and hit) or (self.fast[1] == REQUIRE and not hit)


@dataclass(frozen=True)
class RuleSet:
    """Every rule, indexed by scope, plus the candidate order and composition modes."""

    rules: tuple[CompiledRule, ...]
    layout_order: tuple[Layout, ...] = ALL_LAYOUTS
    member_preferences: dict[str, MemberPreferences] = field(default_factory=dict)
    root: str = "<memory>"
    order_declared: bool = False  # `defaults.layout_order` given: it, not the release's preference, breaks ties
    # the layers it was composed of, bottom first (kvpolicy.policy.layers.RuleLayer); () for one directory
    layers: tuple[Any, ...] = ()
    # located warnings found while loading (a connector file whose name is near another's), never errors
    warnings: tuple[Any, ...] = ()
    # where each connector file names its connector (its `connector:` key), for warnings about the name
    connector_sources: dict[str, Source] = field(default_factory=dict, compare=False)
    # `enforcement: audit` rules: never evaluated by the decision, only reported (kvpolicy.engine.audit)
    audit_rules: tuple[CompiledRule, ...] = ()
    # every waiver of every layer, lapsed ones too (`CompiledWaiver.in_force`); the rules carry those in force
    waivers: tuple[CompiledWaiver, ...] = ()

    def __post_init__(self) -> None:
        by_scope: dict[str | None, list[CompiledRule]] = {}
        for rule in sorted(self.rules, key=lambda r: (r.scope or "", r.source, r.id)):
            by_scope.setdefault(rule.scope, []).append(rule)
        object.__setattr__(self, "_by_scope", {k: tuple(v) for k, v in by_scope.items()})
        object.__setattr__(self, "_by_id", {r.id: r for r in (*self.rules, *self.audit_rules)})

    @property
    def all_rules(self) -> tuple[CompiledRule, ...]:
        """The enforced rules, then the audit-mode ones: every rule the files declare."""
        return self.rules + self.audit_rules

    @property
    def global_rules(self) -> tuple[CompiledRule, ...]:
        return self._by_scope.get(None, ())  # type: ignore[attr-defined]

    def connector_rules(self, name: str) -> tuple[CompiledRule, ...]:
        return self._by_scope.get(name, ())  # type: ignore[attr-defined]

    @property
    def connectors(self) -> tuple[str, ...]:
        return tuple(sorted(k for k in self._by_scope if k is not None))  # type: ignore[attr-defined]

    def layer_of(self, rule_id: str) -> Any:
        """The `RuleLayer` rule ``rule_id`` comes from, or None for a rule set of one directory."""
        return next((layer for layer in self.layers if rule_id in layer.rule_ids), None)

    def rule(self, rule_id: str) -> CompiledRule:
        return self._by_id[rule_id]  # type: ignore[attr-defined]

    def combine_mode(self, connector: str) -> MemberPreferences:
        return self.member_preferences.get(connector, MemberPreferences.all)

    @property
    def digest(self) -> str:
        """sha256 of the rules' meaning: independent of file order, paths and comments."""
        canon: dict[str, Any] = {
            "layout_order": [str(layout) for layout in self.layout_order] if self.order_declared else None,
            "member_preferences": {k: v.value for k, v in sorted(self.member_preferences.items())},
            "rules": sorted(
                ({"scope": r.scope, **r.rule.model_dump(mode="json", by_alias=True, exclude_none=True)}
                 for r in self.all_rules),
                key=lambda d: d["id"],
            ),
        }
        if self.waivers:  # only when there are any: a rule set without waivers keeps its digest
            canon["waivers"] = sorted(
                (w.waiver.model_dump(mode="json", by_alias=True, exclude_none=True) for w in self.waivers),
                key=lambda d: json.dumps(d, sort_keys=True))
        blob = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()

    @classmethod
    def build(
        cls,
        rules: list[tuple[Rule, Source, str | None]],
        layout_order: tuple[Layout, ...] = ALL_LAYOUTS,
        member_preferences: dict[str, MemberPreferences] | None = None,
        root: str = "<memory>",
        *,
        order_declared: bool = False,
        waivers: list[tuple[Waiver, Source]] | tuple[()] = (),
        day: date | None = None,
    ) -> RuleSet:
        """Compile validated rules. Unlisted layouts follow ``layout_order`` canonically. Audit-mode rules
        go to ``audit_rules``: the decision never sees them, so they cannot change a layout. ``waivers`` are
        read against ``day`` (default `kvpolicy.policy.waivers.today`, read only when there are waivers);
        each rule carries those in force for it, and its fast test is false where one applies."""
        order = tuple(layout_order) + tuple(x for x in ALL_LAYOUTS if x not in layout_order)
        on = (day or today()) if waivers else date.min
        waived = tuple(CompiledWaiver(w, source, compile_condition(w.when), on) for w, source in waivers)
        compiled, audited = [], []
        for rule, source, scope in rules:
            mask = sum(1 << i for i, layout in enumerate(order) if rule.pattern.matches(layout))
            cond = compile_condition(rule.when)
            code = EFFECT_CODES[rule.effect]
            weights = tuple((rule.weight or 1) if mask >> i & 1 else 0 for i in range(len(order)))
            mine = tuple(w for w in waived if w.rule_id == rule.id and not rule.audit)
            live = tuple(w.condition.test for w in mine if w.in_force)
            test = _unless(cond.test, live) if live else cond.test
            # INVARIANT: an audit rule never reaches `rules`, the only tuple decide.py evaluates
            (audited if rule.audit else compiled).append(
                CompiledRule(rule, source, scope, cond, mask, (test, code, mask, weights), mine))
        return cls(tuple(compiled), order, dict(member_preferences or {}), root, order_declared,
                   audit_rules=tuple(audited), waivers=waived)


def _unless(test: Any, waived: tuple[Any, ...]) -> Any:
    """``test``, false wherever one of the ``waived`` conditions holds: a waived rule has no effect."""
    return lambda env: test(env) and not any(w(env) for w in waived)
