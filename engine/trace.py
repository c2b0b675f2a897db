"""The decision trace: a flat list of typed events, and pure filters over it.

After OPA's ``topdown/trace.go``: events record what happened, in order;
``explain`` modes are filters; rendering lives in `kvpolicy.engine.render`. Every event
names a rule by its own id and file:line, never a generated name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvpolicy.policy.conditions import LeafResult
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.ruleset import Source

__all__ = [
    "CandidateRemoved",
    "Counterfactual",
    "Event",
    "FieldChange",
    "LayoutChosen",
    "PreferenceApplied",
    "RuleEvaluated",
    "RuleRef",
    "WaiverChecked",
    "WaiverRef",
    "explain_filter",
]


@dataclass(frozen=True)
class RuleRef:
    """A rule as shown to people: id, where it is written, why it exists."""

    id: str
    source: Source
    effect: str
    description: str
    reference: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.id, "source": str(self.source), "effect": self.effect,
                "description": self.description, "reference": self.reference}


@dataclass(frozen=True)
class RuleEvaluated:
    """A rule's condition was evaluated in a scope (``global`` or a connector path)."""

    rule: RuleRef
    scope: str
    matched: bool
    leaves: tuple[LeafResult, ...] = ()
    kind: Literal["rule"] = "rule"


@dataclass(frozen=True)
class CandidateRemoved:
    """A matched forbid/require removed a candidate (it may already have been removed)."""

    layout: Layout
    rule: RuleRef
    scope: str
    kind: Literal["removed"] = "removed"


@dataclass(frozen=True)
class PreferenceApplied:
    """A matched prefer rule added ``weight`` to a candidate within a scope."""

    layout: Layout
    rule: RuleRef
    scope: str
    weight: int
    kind: Literal["prefer"] = "prefer"


@dataclass(frozen=True)
class WaiverRef:
    """A waiver as shown to people: where it is written, who owns it, until when, why."""

    source: Source
    owner: str
    reason: str
    expires: str  # YYYY-MM-DD, the last day it applies

    def to_dict(self) -> dict[str, Any]:
        return {"source": str(self.source), "owner": self.owner, "reason": self.reason, "expires": self.expires}


@dataclass(frozen=True)
class WaiverChecked:
    """A matched rule met a waiver covering it in a scope. ``applied``: the waiver is in force, so the rule had no
    effect (``layouts``: the candidates it would have removed, or those it would have preferred); not applied:
    the waiver has lapsed and the rule applied as written."""

    rule: RuleRef
    waiver: WaiverRef
    scope: str
    applied: bool
    layouts: tuple[Layout, ...] = ()
    kind: Literal["waiver"] = "waiver"

    def text(self) -> str:
        w = self.waiver
        if not self.applied:
            return (f"the waiver of {self.rule.id} ({self.scope}) at {w.source} (owner {w.owner}) expired on "
                    f"{w.expires}: it no longer applies, and the rule applied")
        did = "prefer" if self.rule.effect == "prefer" else "remove"
        what = ", ".join(str(x) for x in self.layouts) or "nothing here"
        return (f"{self.rule.id} ({self.rule.effect}, {self.scope}) at {self.rule.source} matched and would "
                f"{did} {what}; waived at {w.source} (owner {w.owner}, expires {w.expires}): {w.reason}")


@dataclass(frozen=True)
class LayoutChosen:
    layout: Layout
    score: int
    ranking: tuple[tuple[Layout, int], ...]
    kind: Literal["chosen"] = "chosen"


@dataclass(frozen=True)
class FieldChange:
    """One changed input, as a rule condition would see it."""

    scope: str
    field: str
    was: Any
    becomes: Any


@dataclass(frozen=True)
class Counterfactual:
    """The smallest set of field changes under which ``layout`` would have won."""

    layout: Layout
    changes: tuple[FieldChange, ...] | None  # None: no change within the search bound
    kind: Literal["counterfactual"] = "counterfactual"
    actionable: bool = True  # False: a fact (counterfactual.FIXED) or a derived field (DERIVED) changes


Event = RuleEvaluated | CandidateRemoved | PreferenceApplied | WaiverChecked | LayoutChosen | Counterfactual

ExplainMode = Literal["full", "fails", "notes"]


def explain_filter(events: tuple[Event, ...], mode: ExplainMode) -> tuple[Event, ...]:
    """``full``: every event. ``fails``: what removed candidates, and why the rest lost.
    ``notes``: only what decided (matched rules, the choice)."""
    if mode == "full":
        return events
    if mode == "fails":
        return tuple(e for e in events
                     if isinstance(e, (CandidateRemoved, WaiverChecked, LayoutChosen, Counterfactual)))
    return tuple(e for e in events if (isinstance(e, RuleEvaluated) and e.matched)
                 or isinstance(e, (CandidateRemoved, PreferenceApplied, WaiverChecked, LayoutChosen)))
