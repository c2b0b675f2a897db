"""Audit-mode rules (``enforcement: audit``): what each would do if enforced, for one decision.

An audit rule never takes part in the decision (`RuleSet.build` keeps it out of ``rules``); this module
evaluates it beside the decision, in the same scopes (global; a connector file's only while that
connector, or a member of it, is active), and reports a finding when it matches:

- ``would_remove``: the surviving layouts the rule would remove if enforced;
- ``changes_decision``: whether the chosen layout is among them;
- ``enforced_layout``: what enforcing it alone would choose instead (None: no layout would survive,
  so vLLM's start-up would be refused).

Kyverno's ``Audit`` mode is the model: a finding is reported, nothing is blocked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvpolicy.engine.decide import evaluate, rule_ref, scopes_for
from kvpolicy.engine.trace import RuleRef
from kvpolicy.policy.context import Context
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["AuditFinding", "audit_findings", "enforced"]


@dataclass(frozen=True)
class AuditFinding:
    """One audit rule that matched for a deployment, and what enforcing it would do."""

    rule: RuleRef
    scope: str
    would_remove: tuple[Layout, ...]
    chosen: Layout
    enforced_layout: Layout | None

    @property
    def changes_decision(self) -> bool:
        return self.chosen in self.would_remove

    def text(self) -> str:
        """One line for a warning list: the rule, where it is written, and what enforcing it would do."""
        head = f"audit rule `{self.rule.id}` ({self.scope}, {self.rule.source}) matched"
        if not self.would_remove:
            return head + f"; enforcing it would remove no surviving layout ({self.chosen} stays)"
        removed = ", ".join(str(x) for x in self.would_remove)
        if not self.changes_decision:
            return head + f"; enforcing it would remove {removed}, not the chosen {self.chosen}"
        after = (f"the decision would become {self.enforced_layout}" if self.enforced_layout is not None
                 else "no layout would survive and vLLM would refuse to start")
        return head + f"; enforcing it would remove {removed}, the chosen {self.chosen} among them: {after}"

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule.id, "source": str(self.rule.source), "scope": self.scope,
                "effect": self.rule.effect, "would_remove": [str(x) for x in self.would_remove],
                "changes_decision": self.changes_decision,
                "enforced_layout": None if self.enforced_layout is None else str(self.enforced_layout)}


def enforced(ruleset: RuleSet, rule: CompiledRule) -> RuleSet:
    """``ruleset`` with audit rule ``rule`` enforced (its ``enforcement`` dropped), the others kept in audit."""
    promoted = RuleSet.build([(rule.rule.model_copy(update={"enforcement": None}), rule.source, rule.scope)],
                             ruleset.layout_order).rules[0]
    rest = tuple(r for r in ruleset.audit_rules if r.id != rule.id)
    return replace(ruleset, rules=(*ruleset.rules, promoted), audit_rules=rest)


def _enforced_winner(ruleset: RuleSet, rule: CompiledRule, ctx: Context) -> Layout | None:
    promoted = enforced(ruleset, rule)
    glob, conn = scopes_for(promoted, ctx)
    outcome = evaluate(promoted, glob, conn, explain=False)
    return None if outcome.winner is None else promoted.layout_order[outcome.winner]


def audit_findings(ruleset: RuleSet, context: Context, winner: Layout,
                   surviving: list[Layout]) -> tuple[AuditFinding, ...]:
    """Every audit rule of ``ruleset`` that matched for ``context`` (whose decision chose ``winner`` among
    ``surviving``), in evaluation order (global first)."""
    if not ruleset.audit_rules:
        return ()
    shadow = RuleSet(ruleset.audit_rules, ruleset.layout_order, ruleset.member_preferences, ruleset.root,
                     ruleset.order_declared)
    glob, conn = scopes_for(shadow, context)
    order = ruleset.layout_order
    out = []
    for scope in [glob, *(conn.walk() if conn is not None else [])]:
        for rule in scope.rules:
            if not rule.condition.test(scope.env):
                continue
            removes = tuple(x for x in surviving if rule.removes(order.index(x)))
            after = _enforced_winner(ruleset, rule, context) if winner in removes else winner
            out.append(AuditFinding(rule_ref(rule), scope.label, removes, winner, after))
    return tuple(out)
