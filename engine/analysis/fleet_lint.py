"""``kvpolicy lint --fleet FILE``: the rules checked against exactly the deployments of a fleet file.

conftest tests the manifests a repository holds, not every manifest there could be; a site's fleet file
(`kvpolicy.engine.fleet`) is its manifests. Each deployment is decided as ``dry-run --fleet`` decides it
(its context, the release's candidates and connector checks, the chosen layout's geometry check), under its
own release's rule stack, and the rules are linted over the fleet's deployments (`fleet_space`):

- about a deployment, located at its line in the fleet file: ``invalid-deployment`` (error: its inputs are
  wrong, as ``dry-run --fleet`` says), ``conflict`` (error: no layout survives where the shipped rules alone
  choose one: the operator's rules refuse it), ``release-refuses`` (error here: the shipped rules refuse it
  too, so vLLM would not start it; a note over a release's space, where such inputs are expected),
  ``unsafe-permit`` (error: the chosen layout's views overlap), ``not-planned`` (warning: decided as the
  release decides, but kvpolicy has no geometry to check), ``release-fails`` (note);
- about an exchange (the fleet's ``exchanges:``), located at its line: ``exchange-refused`` (error: the
  blocks one deployment writes are not what another reads through the exchange's connector; every
  differing field named, and the keys to change), one per refused ordered pair;
- about a rule, located at it: ``dead-rule`` (warning: it matches no deployment), ``not-load-bearing``
  (note: deleting the forbid/require changes no deployment's decision: a rule the fleet shadows),
  ``audit`` (note: what enforcing an audit rule would change), ``unknown-connector``; and each
  forbid/require's load-bearing line over the fleet.

A rule is one across the releases' rule stacks by its id and where it is written; its counts add up over
the releases the fleet's deployments use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpolicy.engine.analysis.audit_lint import audit_summaries
from kvpolicy.engine.analysis.decider import Decider
from kvpolicy.engine.analysis.fleet_space import fleet_spaces
from kvpolicy.engine.analysis.lint import (
    RELEASE_FAILS,
    Finding,
    LoadBearing,
    lint,
    render_load_bearing,
    shipped_ruleset,
)
from kvpolicy.engine.decide import rule_ref
from kvpolicy.policy.errors import GeometryError, ModelConfigError
from kvpolicy.policy.ruleset import RuleSet, Source

__all__ = ["FleetLintReport", "lint_fleet"]

_EXAMPLES = 3
# findings a release's space lint makes about its inputs: over a fleet, each deployment gets its own
_ABOUT_INPUTS = frozenset({"conflict", "unsafe-permit", "release-fails", "release-refuses", "space-cut"})


@dataclass(frozen=True)
class FleetLintReport:
    """Lint over a fleet: findings about deployments and rules, and each forbid/require's load-bearing line."""

    fleet: str
    deployments: int
    profiles: tuple[str, ...]
    findings: tuple[Finding, ...]
    load_bearing: tuple[LoadBearing, ...] = ()
    rules: int = 0
    plans_verified: int = 0
    summary: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    def render_load_bearing(self) -> str:
        return render_load_bearing(f"load-bearing forbids/requires over fleet `{self.fleet}` (deleting one lets an "
                                   "unsafe layout through for a deployment: safety; or changes a deployment's "
                                   "decision: decision):", self.load_bearing, "deployment")

    def to_dict(self) -> dict[str, Any]:
        return {"fleet": self.fleet, "deployments": self.deployments, "profiles": list(self.profiles),
                "rules": self.rules, "plans_verified": self.plans_verified, "summary": self.summary,
                "errors": len(self.errors), "warnings": len(self.warnings),
                "findings": [f.to_dict() for f in self.findings],
                "load_bearing": [lb.to_dict() for lb in self.load_bearing]}


def _key(rule: Any) -> tuple[str, str]:
    return rule.id, str(rule.source)


def _about(result: Any, fleet_file: str, base: Decider | None, inp: Any,
           model_at: tuple[int, int] | None = None) -> Finding | None:
    """The finding about one deployment (None: decided cleanly), located at its line in the fleet file (an
    invalid one at the key that is wrong; ``model_at``: its `model:` key, for an error in the model config)."""
    line = int(result.location.rsplit(":", 1)[1])
    at = Source(fleet_file, line, 1)
    who = f"deployment `{result.name}`" + (f" ({result.profile})" if result.profile else "")
    if result.status == "invalid":
        d = result.error.diagnostics[0] if result.error.diagnostics else None
        if d is not None and d.file == fleet_file and d.line > 0:  # the key that is wrong
            at = Source(fleet_file, d.line, max(d.col, 1))
        elif model_at is not None and isinstance(result.error, ModelConfigError):
            at = Source(fleet_file, *model_at)
        where = f" at {d.location}" if d is not None and d.file != fleet_file else ""
        return Finding("error", "invalid-deployment",
                       f"{who}: its inputs are wrong{where}: " + (d.message if d else result.error.message), at=at)
    if result.status == "refused":
        rules = "; ".join(f"{d.message.split(' removed ')[0]} at {d.location}" for d in result.error.diagnostics
                          if d.code == "removed-candidates")
        chosen = None if base is None or inp is None else base.decide(inp).winner
        if chosen is None:
            return Finding("error", "release-refuses",
                           f"{who}: no layout survives, as with the shipped rules alone: vLLM would refuse to "
                           f"start it; removed by: {rules}", at=at)
        return Finding("error", "conflict",
                       f"{who}: no layout survives the rules, where the shipped rules alone choose "
                       f"`{base.name(chosen)}`; removed by: {rules}", at=at)  # type: ignore[union-attr]
    layout = result.decision.layout
    if result.status == "unsafe":
        first = result.geometry.diagnostics[0].message if result.geometry.diagnostics else result.geometry.message
        return Finding("error", "unsafe-permit", f"{who}: the rules choose `{layout}`, whose views would "
                       f"overlap ({first})", at=at)
    if result.geometry is not None and not isinstance(result.geometry, GeometryError):
        d = result.geometry.diagnostics[0] if result.geometry.diagnostics else None
        if d is not None and d.code in RELEASE_FAILS:
            return Finding("note", "release-fails", f"{who}: the rules choose `{layout}`, as the release does, "
                           f"which the release then cannot run, nor kvpolicy plan ({d.message})", at=at)
        return Finding("warning", "not-planned", f"{who}: decided `{layout}` as the release decides, but kvpolicy "
                       "has no plan to check its geometry: " + (d.message if d else result.geometry.message), at=at)
    return None


def _exchange_findings(fleet: Any, results: Sequence[Any]) -> list[Finding]:
    """An error per refused ordered pair of the fleet's exchanges, located at the exchange (a pair a
    deployment leaves unknown: that deployment's own finding says why)."""
    from kvpolicy.engine.fleet import exchange_answers

    out = []
    for a in exchange_answers(fleet, results):
        if a.answer != "refused":
            continue
        ex = a.exchange
        unit = "layer views" if ex.unit == "layer_view" else "raw blocks, as is only"
        fields = "; ".join(str(d) for d in a.differences)
        out.append(Finding("error", "exchange-refused",
                           f"exchange `{ex.name}` ({ex.connector}: {unit}): blocks `{a.writer}` writes are not what "
                           f"`{a.reader}` reads: {a.reason}" + (f": {fields}" if fields else "") + f"; {a.change}",
                           at=Source(fleet.file, ex.line, ex.col)))
    return out


def _merge_bearing(into: dict[tuple[str, str], LoadBearing], lb: LoadBearing) -> None:
    have = into.get(_key(lb.rule))
    if have is None:
        into[_key(lb.rule)] = replace(lb, examples=list(lb.examples))
        return
    have.matched += lb.matched
    have.changed += lb.changed
    have.unsafe += lb.unsafe
    have.unsafe_chosen += lb.unsafe_chosen
    have.examples += lb.examples[: max(0, _EXAMPLES - len(have.examples))]


def lint_fleet(fleet: Any, results: Sequence[Any], rules_for: Callable[[str], RuleSet]) -> FleetLintReport:
    """Lint ``rules_for(profile)`` over the deployments of ``fleet`` (`kvpolicy.engine.fleet.Fleet`), decided as
    ``results`` (`decide_fleet`'s, in the fleet's order). Never raises for one deployment's problem."""
    spaces = fleet_spaces(results)
    bases: dict[str, Decider | None] = {}
    inputs: dict[str, Any] = {}
    for profile, (space, members) in spaces.items():
        ruleset = rules_for(profile)
        base = shipped_ruleset(profile)
        bases[profile] = None if base is None else Decider(ruleset if base.digest == ruleset.digest else base)
        inputs.update({r.name: inp for r, inp in zip(members, space.inputs, strict=True)})
    findings: list[Finding] = []
    for index, result in enumerate(results):
        model_at = fleet.key_at(index, "model") if result.deployment.model is not None else None
        found = _about(result, fleet.file, bases.get(result.profile or ""), inputs.get(result.name), model_at)
        if found is not None:
            findings.append(found)
    findings += _exchange_findings(fleet, results)

    present: dict[tuple[str, str], tuple[Any, int]] = {}  # rule -> (the rule, profiles linting it)
    dead: dict[tuple[str, str], int] = {}
    bearing: dict[tuple[str, str], LoadBearing] = {}
    others: dict[tuple[str, str, str], Finding] = {}
    audits: dict[tuple[str, str], list[Any]] = {}
    rules: dict[tuple[str, str], Any] = {}
    plans = 0
    for profile, (space, _members) in spaces.items():
        ruleset = rules_for(profile)
        report = lint(ruleset, space, vllm_version=profile)
        plans += report.plans_verified
        for rule in ruleset.all_rules:
            rules[_key(rule)] = rule
        for rule in ruleset.rules:
            seen = present.get(_key(rule))
            present[_key(rule)] = (rule, (seen[1] if seen else 0) + 1)
        for f in report.findings:
            if f.code == "dead-rule" and f.rule is not None:
                dead[_key(f.rule)] = dead.get(_key(f.rule), 0) + 1
            elif f.rule is not None and f.code not in _ABOUT_INPUTS | {"not-load-bearing", "audit"}:
                others.setdefault((f.code, f.message, str(f.rule.source)), f)
        for lb in report.load_bearing:
            _merge_bearing(bearing, lb)
        for summary in audit_summaries(ruleset, space, Decider(ruleset)):
            audits.setdefault(_key(summary.rule), []).append(summary)

    by_rule: list[Finding] = list(others.values())
    for k, (rule, profiles) in present.items():
        if dead.get(k) == profiles:
            by_rule.append(Finding("warning", "dead-rule", f"rule `{rule.id}` matches no deployment of the fleet",
                                   rule_ref(rule)))
    for lb in bearing.values():
        if lb.kind is None and lb.matched:
            by_rule.append(Finding(
                "note", "not-load-bearing",
                f"rule `{lb.rule.id}` matches {lb.matched} deployment(s), but removing it alone changes no "
                "deployment's decision and lets no unsafe layout through (other rules or the release's candidates "
                "cover it, for this fleet): it can go, or it guards deployments the fleet does not have", lb.rule))
    for k, summaries in audits.items():
        matched = sum(s.matched for s in summaries)
        changed = sum(s.changed for s in summaries)
        refused = sum(s.refused for s in summaries)
        examples = tuple(e for s in summaries for e in s.examples)
        by_rule.append(Finding(
            "note", "audit", f"audit rule `{k[0]}` matches {matched} deployment(s); enforcing it would change "
            f"{changed} decision(s)" + (f", {refused} to no layout (vLLM would refuse to start)" if refused else ""),
            rule_ref(summaries[0].rule), inputs=examples, total=changed))
    by_rule.sort(key=lambda f: (str(f.rule.source) if f.rule else "", f.code))
    ordered = tuple(sorted(bearing.values(), key=lambda lb: (str(lb.rule.source), lb.rule.id)))
    counts = {s: sum(r.status == s for r in results) for s in ("decided", "unsafe", "refused", "invalid")}
    return FleetLintReport(fleet.file, len(results), tuple(sorted(spaces)), (*findings, *by_rule), ordered,
                           len(rules), plans, counts)
