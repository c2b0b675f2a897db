"""Lint's view of audit-mode rules: over the space, what enforcing each would change.

Lint adds one note (``audit``) per audit rule that matches some input: how many inputs it matches,
how many decisions enforcing it would change, for how many no layout would survive (vLLM would refuse
to start), with the changed inputs as examples. A note, never a warning: an audit rule must not fail a
lint that runs with ``--strict`` (Kyverno's Audit mode reports, it never blocks).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpolicy.engine.analysis.decider import Decider
from kvpolicy.engine.analysis.space import AnalysisInput
from kvpolicy.engine.audit import enforced
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["AuditSummary", "audit_summaries", "audit_view"]

_EXAMPLES = 20


@dataclass(frozen=True)
class AuditSummary:
    """One audit rule over a space: inputs it matches, decisions enforcing it changes, examples."""

    rule: CompiledRule
    matched: int
    changed: int
    refused: int  # of the changed: no layout would survive
    examples: tuple[str, ...]

    @property
    def message(self) -> str:
        return (f"audit rule `{self.rule.id}` matches {self.matched} input(s); enforcing it would change "
                f"{self.changed} decision(s)"
                + (f", {self.refused} to no layout (vLLM would refuse to start)" if self.refused else ""))


def audit_view(ruleset: RuleSet) -> RuleSet | None:
    """The audit rules as a rule set of their own (so the space explores the fields they test), or None."""
    if not ruleset.audit_rules:
        return None
    return RuleSet(ruleset.audit_rules, ruleset.layout_order, ruleset.member_preferences, ruleset.root,
                   ruleset.order_declared)


def audit_summaries(ruleset: RuleSet, space: Iterable[AnalysisInput], decider: Decider) -> list[AuditSummary]:
    """One summary per audit rule of ``ruleset`` that matches some input of ``space``."""
    inputs = list(space)
    out = []
    for rule in sorted(ruleset.audit_rules, key=lambda r: (r.source, r.id)):
        promoted = Decider(enforced(ruleset, rule))
        matched, changed, refused, examples = 0, 0, 0, []
        for inp in inputs:
            after = promoted.decide(inp)
            if not any(r.id == rule.id for r in after.matched):
                continue
            matched += 1
            before = decider.decide(inp).winner
            if after.winner != before:
                changed += 1
                refused += after.winner is None
                if len(examples) < _EXAMPLES:
                    examples.append(f"{inp.label}: {decider.name(before)} -> {promoted.name(after.winner)}")
        if matched:
            out.append(AuditSummary(rule, matched, changed, refused, tuple(examples)))
    return out
