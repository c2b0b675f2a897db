"""`kvpolicy diff OLD NEW`: every input whose decision a rule change alters, and why.

Both rule sets decide every input of one enumerated space (the union of what
either set's connector rules test). For each changed input the report names,
on each side, the rules responsible: those that removed the other side's
layout, or else the preferences that ranked this side's layout first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.analysis.space import AnalysisInput, enumerate_inputs
from engine.decide import Outcome, evaluate, scopes_for
from engine.trace import CandidateRemoved, PreferenceApplied
from policy.ruleset import RuleSet

__all__ = ["DecisionChange", "DiffReport", "diff_rulesets"]


@dataclass(frozen=True)
class DecisionChange:
    input: AnalysisInput
    old: str  # a layout, or "no layout"
    new: str
    old_because: tuple[str, ...]  # "rule-id (file:line)"
    new_because: tuple[str, ...]

    def render(self) -> str:
        return (f"{self.input.label}\n    old: {self.old}  because {', '.join(self.old_because) or 'default order'}"
                f"\n    new: {self.new}  because {', '.join(self.new_because) or 'default order'}")

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input.to_dict(), "old": self.old, "new": self.new,
                "old_because": list(self.old_because), "new_because": list(self.new_because)}


@dataclass(frozen=True)
class DiffReport:
    inputs_checked: int
    changes: tuple[DecisionChange, ...]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.changes:
            key = f"{c.old} -> {c.new}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"inputs_checked": self.inputs_checked, "changed": len(self.changes), "counts": self.counts(),
                "changes": [c.to_dict() for c in self.changes]}


def _outcome(ruleset: RuleSet, inp: AnalysisInput) -> Outcome:
    glob, conn = scopes_for(ruleset, inp.context)
    return evaluate(ruleset, glob, conn, explain=False)


def _name(ruleset: RuleSet, out: Outcome) -> str:
    return "no layout" if out.winner is None else str(ruleset.layout_order[out.winner])


def _because(ruleset: RuleSet, inp: AnalysisInput, out: Outcome, other: str) -> tuple[str, ...]:
    """Why this side did not pick ``other``: what removed it, else what ranked our choice first."""
    glob, conn = scopes_for(ruleset, inp.context)
    events = evaluate(ruleset, glob, conn, explain=True).events
    removed = {f"{e.rule.id} ({e.rule.source})" for e in events
               if isinstance(e, CandidateRemoved) and str(e.layout) == other}
    if out.winner is None:
        removed = {f"{e.rule.id} ({e.rule.source})" for e in events if isinstance(e, CandidateRemoved)}
    if removed:
        return tuple(sorted(removed))
    mine = str(ruleset.layout_order[out.winner])
    return tuple(sorted({f"{e.rule.id} ({e.rule.source})" for e in events
                         if isinstance(e, PreferenceApplied) and str(e.layout) == mine}))


def diff_rulesets(old: RuleSet, new: RuleSet, inputs: list[AnalysisInput] | None = None) -> DiffReport:
    """Decide every input under both rule sets and list what changed."""
    if inputs is None:
        seen: set[str] = set()
        inputs = []
        for rs in (old, new):  # the union of both spaces, each input once
            for inp in enumerate_inputs(rs):
                if inp.label not in seen:
                    seen.add(inp.label)
                    inputs.append(inp)
    changes = []
    for inp in inputs:
        a, b = _outcome(old, inp), _outcome(new, inp)
        na, nb = _name(old, a), _name(new, b)
        if na != nb:
            changes.append(DecisionChange(inp, na, nb, _because(old, inp, a, nb), _because(new, inp, b, na)))
    return DiffReport(len(inputs), tuple(changes))


