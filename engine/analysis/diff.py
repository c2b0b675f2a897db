"""`kvpolicy diff OLD NEW`: every input whose decision a rule change alters, and why.

Both rule sets decide every input of one release profile's space (the
inputs either set reads: `kvpolicy.engine.analysis.space`). For each changed input the
report names, on each side, the rules responsible: those that removed the
other side's layout, or else the preferences that ranked this side's layout
first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy.engine.analysis.budget import DEFAULT_MAX_INPUTS
from kvpolicy.engine.analysis.decider import Decider
from kvpolicy.engine.analysis.space import AnalysisInput, Space, build_space
from kvpolicy.engine.trace import CandidateRemoved, PreferenceApplied
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["DecisionChange", "DiffReport", "diff_rulesets"]


TIE_RELEASE = "no rule decides: the release's preference order"
TIE_DECLARED = "no rule decides: the rule set's defaults.layout_order"


def tie_break(ruleset: RuleSet) -> str:
    """What orders a tie under ``ruleset``: its declared ``defaults.layout_order``, else the release's."""
    return TIE_DECLARED if ruleset.order_declared else TIE_RELEASE


@dataclass(frozen=True)
class DecisionChange:
    input: AnalysisInput
    old: str  # a layout, or "no layout"
    new: str
    old_because: tuple[str, ...]  # "rule-id (file:line)"
    new_because: tuple[str, ...]
    # what breaks a tie on each side when no rule decides: a declared order, or the release's preference
    old_tie: str = TIE_RELEASE
    new_tie: str = TIE_RELEASE

    def render(self) -> str:
        return (f"{self.input.label}\n    old: {self.old}  because {', '.join(self.old_because) or self.old_tie}"
                f"\n    new: {self.new}  because {', '.join(self.new_because) or self.new_tie}")

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input.to_dict(), "old": self.old, "new": self.new,
                "old_because": list(self.old_because), "new_because": list(self.new_because)}


@dataclass(frozen=True)
class DiffReport:
    inputs_checked: int
    changes: tuple[DecisionChange, ...]
    profile: str = ""
    space: Space | None = None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.changes:
            key = f"{c.old} -> {c.new}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "inputs_checked": self.inputs_checked,
                "space": self.space.to_dict() if self.space is not None else None,
                "changed": len(self.changes), "counts": self.counts(),
                "changes": [c.to_dict() for c in self.changes]}


def _because(decider: Decider, inp: AnalysisInput, other: str) -> tuple[str, ...]:
    """Why this side did not pick ``other``: what removed it, else what ranked our choice first."""
    events = decider.events(inp)
    winner = decider.decide(inp).winner
    removed = {f"{e.rule.id} ({e.rule.source})" for e in events
               if isinstance(e, CandidateRemoved) and (winner is None or str(e.layout) == other)}
    if removed:
        return tuple(sorted(removed))
    mine = decider.name(winner)
    return tuple(sorted({f"{e.rule.id} ({e.rule.source})" for e in events
                         if isinstance(e, PreferenceApplied) and str(e.layout) == mine}))


def diff_rulesets(
    old: RuleSet,
    new: RuleSet,
    inputs: Space | list[AnalysisInput] | None = None,
    *,
    vllm_version: str | ReleaseProfile | None = None,
    scale_views: list[ScaleViews] | None = None,
    max_inputs: int = DEFAULT_MAX_INPUTS,
) -> DiffReport:
    """Decide every input under both rule sets (in ``vllm_version``'s profile) and list what changed;
    the default space holds at most ``max_inputs`` inputs (``space.cut`` says what a cut left out)."""
    profile = get_profile(vllm_version)
    if inputs is None:
        space = build_space([old, new], vllm_version=profile, scale_views=scale_views, max_inputs=max_inputs)
    elif isinstance(inputs, Space):
        space = inputs
    else:
        space = Space(profile, list(inputs))
    a, b = Decider(old), Decider(new)
    because: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}
    changes = []
    for inp in space:
        na, nb = a.name(a.decide(inp).winner), b.name(b.decide(inp).winner)
        if na != nb:
            key = (a.key(inp), b.key(inp))
            if key not in because:
                because[key] = (_because(a, inp, nb), _because(b, inp, na))
            changes.append(DecisionChange(inp, na, nb, *because[key], tie_break(old), tie_break(new)))
    return DiffReport(len(space), tuple(changes), space.profile.name, space)
