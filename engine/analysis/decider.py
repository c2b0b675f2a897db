"""One rule set's decisions over a space, computed once per distinct input the rules can see.

Two inputs decide alike when they have the same candidates, the same
connector tree and the same value in every field some rule of the set tests;
`Decider` keys its cache on exactly that, so a space of 100k inputs costs a
few thousand evaluations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpolicy.engine.analysis.space import AnalysisInput
from kvpolicy.engine.decide import Outcome, Scope, evaluate, release_ref
from kvpolicy.engine.trace import Event
from kvpolicy.policy.conditions import leaves_of
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
        fields = {leaf.field for r in ruleset.rules for leaf in leaves_of(r.rule.when)}
        self.fields = tuple(sorted(f for f in fields if not f.startswith("connector.")))
        self._core_keys: dict[int, int] = {}  # id(core) -> interned key (the space keeps every core alive)
        self._interned: dict[tuple[Any, ...], int] = {}
        self._cache: dict[tuple[int, str], Decided] = {}

    def key(self, inp: AnalysisInput) -> tuple[int, str]:
        """Equal for inputs this rule set decides alike: (what the rules see of the shared part, the connector)."""
        core = inp.core
        ck = self._core_keys.get(id(core))
        if ck is None:
            env = core.env
            seen = (core.context.candidates, tuple(env.get(f, MISSING) for f in self.fields))
            ck = self._core_keys[id(core)] = self._interned.setdefault(seen, len(self._interned))
        return ck, inp.conn.label

    def decide(self, inp: AnalysisInput) -> Decided:
        k = self.key(inp)
        found = self._cache.get(k)
        if found is None:
            found = self._cache[k] = self._decide(inp)
        return found

    def _decide(self, inp: AnalysisInput) -> Decided:
        ruleset = self.ruleset
        glob, conn = inp.scopes(ruleset)
        outcome = evaluate(ruleset, glob, conn, explain=False)
        cands = sum(1 << i for i, x in enumerate(ruleset.layout_order) if x in glob.candidates)  # type: ignore
        matched: dict[str, CompiledRule] = {}
        removers: dict[int, set[str]] = {}
        n = len(ruleset.layout_order)
        for scope in glob.walk() + (conn.walk() if conn else []):
            env = scope.env
            for rule in scope.rules:
                test, code, mask, _ = rule.fast
                if test(env):
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
