"""One rule set's decisions over a space, computed once per distinct input the rules can see.

Two inputs decide alike when they have the same candidates, the same
connector tree and the same value in every field some rule of the set tests;
`Decider` keys its cache on exactly that, so a space of 100k inputs costs a
few thousand evaluations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.engine.analysis.space import AnalysisInput, InputConnector
from kvpolicy.engine.decide import Outcome, Scope, connector_names_for, evaluate, release_ref
from kvpolicy.engine.trace import Event
from kvpolicy.policy.conditions import leaf_predicate, leaves_of
from kvpolicy.policy.context import MISSING
from kvpolicy.policy.ruleset import FORBID, PREFER, CompiledRule, RuleSet

__all__ = ["Decided", "Decider"]


@dataclass
class Decided:
    """The decision for one key: the winner (index into the rule set's order) and what bore on it."""

    outcome: Outcome
    candidates: int  # mask of the release's candidates
    matched: tuple[CompiledRule, ...]  # every rule that matched in some scope, once
    removers: dict[int, frozenset[str]]  # candidate index -> ids of the matched rules removing it
    without: dict[str, int | None] = field(default_factory=dict)  # rule id -> the winner without that rule
    events: tuple[Event, ...] | None = None
    disagree: bool | None = None  # a composite connector's members disagree (known once asked)
    _sole: dict[str, list[int]] = field(default_factory=dict)
    _same: Decided | None = None  # the decision this one shares its parts with (`Decider.decide`)

    @property
    def winner(self) -> int | None:
        return self.outcome.winner

    def sole(self, rule_id: str) -> list[int]:
        """The candidates that only ``rule_id`` removes: they survive without it."""
        found = self._sole.get(rule_id)
        if found is None:
            found = self._sole[rule_id] = [i for i, ids in self.removers.items() if ids == {rule_id}]
        return found


def _prefer_only(scope: Scope) -> Scope:
    return Scope(scope.label, tuple(r for r in scope.rules if r.fast[1] == PREFER), scope.env,
                 tuple(_prefer_only(m) for m in scope.members), scope.mode, scope.candidates, scope.release)


def _matched_only(scope: Scope, hits: Iterator[list[CompiledRule]]) -> Scope:
    """``scope`` (and its members, in `Scope.walk` order) holding only the rules ``hits`` says matched:
    the same decision, each rule tested once more at most."""
    rules = tuple(next(hits))
    return Scope(scope.label, rules, scope.env, tuple(_matched_only(m, hits) for m in scope.members), scope.mode,
                 scope.candidates, scope.release)


def _pick(alive: int, scores: tuple[int, ...], ranks: tuple[int, ...]) -> int | None:
    """`kvpolicy.engine.decide`'s choice: the highest score, ties to the lowest rank."""
    best = None
    for i in range(len(scores)):
        if alive >> i & 1 and (best is None or (-scores[i], ranks[i]) < (-scores[best], ranks[best])):
            best = i
    return best


class Decider:
    """Decides inputs of a space under ``ruleset``, caching by what the rules can see."""

    def __init__(self, ruleset: RuleSet) -> None:
        self.ruleset = ruleset
        leaves = [leaf for r in ruleset.rules for leaf in leaves_of(r.rule.when)]
        self.fields = tuple(sorted({leaf.field for leaf in leaves if not leaf.field.startswith("connector.")}))
        self._core_keys: dict[int, int] = {}  # id(core) -> interned key (the space keeps every core alive)
        self._interned: dict[tuple[Any, ...], int] = {}
        self._cache: dict[tuple[int, str], Decided] = {}
        # Each leaf tests one field; a condition is a function of its leaves. So what the rules see of an
        # input is, per field, each distinct leaf's answer on its value (plus the candidates and the
        # connector): inputs alike in that evaluate once (`_shared`), whatever values they differ in.
        distinct: dict[str, dict[str, Callable[[Any], bool]]] = {}
        for leaf in leaves:
            if leaf.field in self.fields:
                distinct.setdefault(leaf.field, {}).setdefault(repr((leaf.op, leaf.value)), leaf_predicate(leaf))
        self._tests = tuple((f, tuple(distinct[f].values())) for f in self.fields)
        conn_leaves: dict[str, dict[str, Callable[[Any], bool]]] = {}
        for leaf in leaves:
            if leaf.field.startswith("connector."):
                conn_leaves.setdefault(leaf.field, {}).setdefault(repr((leaf.op, leaf.value)), leaf_predicate(leaf))
        self._conn_tests = tuple((f, tuple(t.values())) for f, t in sorted(conn_leaves.items()))
        self._conn_kinds: dict[tuple[int, str], tuple[InputConnector, int]] = {}  # (id, profile) -> kind
        self._core_classes: dict[int, tuple[Any, int]] = {}  # id(core) -> (core, interned class)
        self._classes: dict[tuple[Any, ...], int] = {}
        self._shared: dict[tuple[int, int], Decided] = {}

    def key(self, inp: AnalysisInput) -> tuple[int, str]:
        """Equal for inputs this rule set decides alike: (what the rules see of the shared part, the connector)."""
        core = inp.core
        ck = self._core_keys.get(id(core))
        if ck is None:
            env = core.env
            seen = (core.context.candidates, tuple(env.get(f, MISSING) for f in self.fields))
            ck = self._core_keys[id(core)] = self._interned.setdefault(seen, len(self._interned))
        return ck, inp.conn.label

    def _class(self, inp: AnalysisInput) -> tuple[int, int]:
        """Equal for inputs every leaf answers alike: (the leaves' answers on the shared part, the
        connector tree's kind)."""
        core = inp.core
        found = self._core_classes.get(id(core))
        if found is not None and found[0] is core:
            cc = found[1]
        else:
            env = core.env
            seen = (core.context.candidates,
                    tuple(test(env.get(f, MISSING)) for f, tests in self._tests for test in tests))
            cc = self._classes.setdefault(seen, len(self._classes))
            self._core_classes[id(core)] = (core, cc)  # held with the core: its id is never another's meanwhile
        return cc, self._conn_kind(inp.conn, core.context.profile)

    def _conn_kind(self, conn: InputConnector, profile: str) -> int:
        """Equal for connector trees the rules tell apart from nothing: per node, the connector files
        whose rules apply (its name last: the members' mode) and each connector.* leaf's answer."""
        k = (id(conn), profile)
        found = self._conn_kinds.get(k)
        if found is not None and found[0] is conn:
            return found[1]
        nodes = []
        stack = [conn]
        while stack:  # `Scope.walk` order: a node, then its members'
            node = stack.pop(0)
            files = () if node.config is None else node.names.get(profile) or connector_names_for(
                profile, node.config.name, node.config.extra)
            nodes.append((files, tuple(t(node.env.get(f, MISSING)) for f, ts in self._conn_tests for t in ts)))
            stack[:0] = node.members
        kind = self._classes.setdefault(("connector", tuple(nodes)), len(self._classes))
        self._conn_kinds[k] = (conn, kind)  # held with the connector: its id is never another's meanwhile
        return kind

    def decide(self, inp: AnalysisInput) -> Decided:
        k = self.key(inp)
        found = self._cache.get(k)
        if found is None:
            c = self._class(inp)
            same = self._shared.get(c)
            if same is None:
                found = self._shared[c] = self._decide(inp)
            else:  # the decision and what follows from it shared; the trace and the members' check this input's
                found = Decided(same.outcome, same.candidates, same.matched, same.removers, same.without,
                                _sole=same._sole, _same=same)
            self._cache[k] = found
        return found

    def _decide(self, inp: AnalysisInput) -> Decided:
        ruleset = self.ruleset
        glob, conn = inp.scopes(ruleset)
        # each rule tested once: the matched ones make the decision (`_matched_only`) and say who removed what
        hits = [[rule for rule in scope.rules if rule.fast[0](scope.env)]
                for scope in glob.walk() + (conn.walk() if conn else [])]
        found = iter(hits)
        outcome = evaluate(ruleset, _matched_only(glob, found), _matched_only(conn, found) if conn else None,
                           explain=False)
        cands = sum(1 << i for i, x in enumerate(ruleset.layout_order) if x in glob.candidates)  # type: ignore
        matched: dict[str, CompiledRule] = {}
        removers: dict[int, set[str]] = {}
        n = len(ruleset.layout_order)
        for rules in hits:
            for rule in rules:
                _test, code, mask, _ = rule.fast
                matched.setdefault(rule.id, rule)
                if code != PREFER:
                    gone = cands & (mask if code == FORBID else ~mask)
                    for i in range(n):
                        if gone >> i & 1:
                            removers.setdefault(i, set()).add(rule.id)
        return Decided(outcome, cands, tuple(matched.values()), {i: frozenset(s) for i, s in removers.items()})

    def without(self, inp: AnalysisInput, rule_id: str) -> int | None:
        """The winner for ``inp`` were rule ``rule_id`` deleted.

        A forbid or require never scores, so deleting one only brings back the
        candidates it alone removed; the scores, the members' agreement and the
        tie order stay. (A members' disagreement leaves no layout either way.)
        """
        d = self.decide(inp)
        if rule_id not in d.without:
            alive = d.outcome.alive
            removed = 0
            for i in d.removers:
                removed |= 1 << i
            if alive:  # the members agreed (or there are none): the rules alone decided
                for i in d.sole(rule_id):
                    alive |= 1 << i
                d.without[rule_id] = _pick(alive, d.outcome.scores, d.outcome.ranks)
            elif d.candidates & ~removed:  # something survived the rules: the members disagreed
                d.without[rule_id] = None
            elif self._members_disagree(inp, d):
                d.without[rule_id] = None
            else:
                for i in d.sole(rule_id):
                    alive |= 1 << i
                d.without[rule_id] = _pick(alive, d.outcome.scores, d.outcome.ranks)
        return d.without[rule_id]

    def _members_disagree(self, inp: AnalysisInput, d: Decided) -> bool:
        """Whether a composite connector's members disagree (`member_preferences: agree`), whatever the
        forbids and requires removed: the decision with only the preferences leaves no layout."""
        d = d._same or d  # the same decision for every input alike
        if d.disagree is None:
            glob, conn = inp.scopes(self.ruleset)
            d.disagree = conn is not None and evaluate(self.ruleset, _prefer_only(glob), _prefer_only(conn),
                                                       explain=False).alive == 0
        return d.disagree

    def events(self, inp: AnalysisInput) -> tuple[Event, ...]:
        """The full trace of the decision (the release's candidate filter included)."""
        d = self.decide(inp)
        if d.events is None:
            glob, conn = inp.scopes(self.ruleset)
            glob.release = release_ref(inp.context)
            d.events = evaluate(self.ruleset, glob, conn, explain=True).events
        return d.events

    def name(self, index: int | None) -> str:
        return "no layout" if index is None else str(self.ruleset.layout_order[index])
