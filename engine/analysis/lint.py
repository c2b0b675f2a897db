"""`kvpolicy lint`: a rule set checked over every input it could see, grounded in bytes.

Findings, by severity:

- error ``unsafe-permit``: the rules choose a layout whose views the verifier
  finds overlapping (or one the backend cannot lay out) for these inputs;
- error ``conflict``: no layout survives for these inputs;
- warning ``dead-rule``: no input makes the rule match;
- note ``not-load-bearing``: a forbid/require whose every removed layout is
  safe by the verifier for every input it matches. Its reason is not memory
  safety (a performance or compatibility rule), or it can go: this is how the
  cross-layer speed-up comes back once backends build stride-aware scale views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.analysis.space import AnalysisInput, enumerate_inputs
from engine.decide import evaluate, rule_ref, scopes_for
from engine.plan import plan_layout
from engine.trace import CandidateRemoved, RuleRef
from engine.verify import verify_plan
from policy.errors import PolicyError
from policy.layouts import Layout
from policy.rule_model import Effect
from policy.ruleset import RuleSet

__all__ = ["Finding", "LintReport", "lint"]

VERIFY_BLOCKS = 2


@dataclass(frozen=True)
class Finding:
    severity: str  # error | warning | note
    code: str
    message: str
    rule: RuleRef | None = None
    inputs: tuple[str, ...] = ()

    def render(self, max_inputs: int = 20) -> str:
        where = f"{self.rule.source}: " if self.rule else ""
        text = f"{where}{self.severity}[{self.code}]: {self.message}"
        for label in self.inputs[:max_inputs]:
            text += f"\n    {label}"
        if len(self.inputs) > max_inputs:
            text += f"\n    ... and {len(self.inputs) - max_inputs} more inputs (--format json lists all)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "rule": self.rule.to_dict() if self.rule else None, "inputs": list(self.inputs)}


@dataclass(frozen=True)
class LintReport:
    findings: tuple[Finding, ...]
    inputs_checked: int
    rules: int
    plans_verified: int = 0
    summary: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    def to_dict(self) -> dict[str, Any]:
        return {"inputs_checked": self.inputs_checked, "rules": self.rules, "plans_verified": self.plans_verified,
                "errors": len(self.errors), "warnings": len(self.warnings),
                "findings": [f.to_dict() for f in self.findings]}


class _Verifier:
    """Verify (layout, spec, backend) once; the space repeats them many times."""

    def __init__(self) -> None:
        self.cache: dict[tuple[Any, ...], tuple[str, str] | None] = {}

    def check(self, layout: Layout, inp: AnalysisInput) -> tuple[str, str] | None:
        """None when safe; else ("overlap" | "unplannable", what is wrong in one line)."""
        ctx = inp.context
        key = (layout, ctx.kv, ctx.backend)
        if key not in self.cache:
            try:
                report = verify_plan(plan_layout(layout, ctx.kv, ctx.backend, VERIFY_BLOCKS))
                self.cache[key] = None if report.ok else ("overlap", report.collisions[0].describe())
            except PolicyError as exc:
                self.cache[key] = ("unplannable", exc.render().splitlines()[-1].strip())
        return self.cache[key]

    def problem(self, layout: Layout, inp: AnalysisInput) -> str | None:
        found = self.check(layout, inp)
        return None if found is None else found[1]

    def overlaps(self, layout: Layout, inp: AnalysisInput) -> bool:
        found = self.check(layout, inp)
        return found is not None and found[0] == "overlap"


def _needed(verifier: _Verifier, layout: Layout, inp: AnalysisInput, removers: int) -> bool:
    """Is removing ``layout`` for ``inp`` protecting anything?

    An overlapping layout always is (defence in depth, even if another rule
    also removes it). A layout the backend cannot lay out at all (HND without a
    head dim) is, when this rule is the only one removing it.
    """
    found = verifier.check(layout, inp)
    if found is None:
        return False
    return found[0] == "overlap" or removers <= 1


def lint(ruleset: RuleSet, inputs: list[AnalysisInput] | None = None) -> LintReport:
    """Lint ``ruleset`` over ``inputs`` (default: the whole enumerated space)."""
    space = inputs if inputs is not None else list(enumerate_inputs(ruleset))
    order = ruleset.layout_order
    verifier = _Verifier()
    matched: dict[str, list[int]] = {r.id: [] for r in ruleset.rules}
    removers: list[dict[int, int]] = []  # per input: layout index -> how many matched rules remove it
    unsafe: dict[str, list[str]] = {}
    why: dict[str, list[str]] = {}
    conflicts: list[str] = []
    conflict_rules: dict[str, RuleRef] = {}
    for n, inp in enumerate(space):
        glob, conn = scopes_for(ruleset, inp.context)
        count: dict[int, int] = {}
        for scope in glob.walk() + (conn.walk() if conn else []):
            for rule in scope.rules:
                if rule.fast[0](scope.env):
                    hits = matched[rule.id]
                    if not hits or hits[-1] != n:
                        hits.append(n)
                    if rule.effect is not Effect.prefer:
                        for i in range(len(order)):
                            if rule.removes(i):
                                count[i] = count.get(i, 0) + 1
        removers.append(count)
        outcome = evaluate(ruleset, glob, conn, explain=False)
        if outcome.winner is None:
            conflicts.append(inp.label)
            for e in evaluate(ruleset, glob, conn, explain=True).events:
                if isinstance(e, CandidateRemoved):
                    conflict_rules.setdefault(e.rule.id, e.rule)
            continue
        layout = order[outcome.winner]
        problem = verifier.problem(layout, inp)
        if problem is not None:
            unsafe.setdefault(str(layout), []).append(inp.label)
            if problem not in why.setdefault(str(layout), []):
                why[str(layout)].append(problem)

    findings: list[Finding] = []
    for layout, labels in sorted(unsafe.items()):
        shown = "; ".join(why[layout][:2]) + (f"; and {len(why[layout]) - 2} more" if len(why[layout]) > 2 else "")
        findings.append(Finding("error", "unsafe-permit",
                                f"the rules choose `{layout}` for {len(labels)} input(s) whose views would overlap "
                                f"({shown})", inputs=tuple(labels)))
    if conflicts:
        named = ", ".join(f"`{r.id}` ({r.source})" for r in sorted(conflict_rules.values(), key=lambda r: r.source))
        findings.append(Finding("error", "conflict",
                                f"no layout survives for {len(conflicts)} input(s); the rules removing candidates "
                                f"there: {named}", inputs=tuple(conflicts)))
    for rule in sorted(ruleset.rules, key=lambda r: (r.source, r.id)):
        hits = matched[rule.id]
        if not hits:
            findings.append(Finding("warning", "dead-rule", f"rule `{rule.id}` matches no input of the space",
                                    rule_ref(rule)))
        elif rule.effect in (Effect.forbid, Effect.require):
            removed = [i for i in range(len(order)) if rule.removes(i)]
            load_bearing = any(_needed(verifier, order[i], space[n], removers[n].get(i, 0))
                               for n in hits for i in removed)
            if not load_bearing:
                findings.append(Finding(
                    "note", "not-load-bearing",
                    f"rule `{rule.id}` only removes layouts the verifier finds safe for all {len(hits)} input(s) "
                    "it matches: it is not a memory-safety rule, or it can be removed", rule_ref(rule)))
    summary = {"inputs": len(space), "unsafe_inputs": sum(len(v) for v in unsafe.values()),
               "conflicts": len(conflicts)}
    return LintReport(tuple(findings), len(space), len(ruleset.rules), len(verifier.cache), summary)
