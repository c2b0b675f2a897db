"""`kvpolicy lint`: a rule set checked over every input of one release profile, grounded in bytes.

Findings, by severity:

- error ``unsafe-permit``: the rules choose a layout whose views the verifier
  finds overlapping (or one the backend has no geometry for) for these inputs;
- error ``conflict``: no layout survives for these inputs, where the
  profile's shipped rules choose one; a conflict an operator's layer makes is
  one finding per rule of theirs removing candidates there, located at it;
- warning ``dead-rule``: no input makes the rule match;
- note ``release-fails``: the rules choose, as the release does, a layout the
  release then cannot run for these inputs, so kvpolicy cannot plan it either
  (nvfp4 under a layout leaving a layer's pages scattered: vLLM 0.34's
  FlashInfer raises at the first forward);
- note ``release-refuses``: no layout survives, as with the profile's shipped
  rules: the release itself refuses to start there (``VLLM_KV_CACHE_LAYOUT``
  naming a layout the backends lack, MultiConnector members requiring
  different layouts, ...). The shipped rules reproduce the release, checked
  against it by ``tests/conformance/``;
- note ``not-load-bearing``: a forbid/require whose removal changes no
  decision of the space and lets no unsafe layout through: it can go;
- warning ``space-cut``: the space was over its bound (``max_inputs``,
  `kvpolicy.engine.analysis.budget`) and some of it was left out: every other
  finding holds for the explored inputs only.

Load-bearing, for every forbid and require: removing the rule lets an unsafe
layout (overlapping views, or no geometry) survive the rules for some input
(``safety``), or else changes some input's decision (``decision``: a rule that
reproduces the release or an operator's choice, not one that protects bytes).
The per-token-head guard of the #48412 state is a ``safety`` rule there; in
the released profiles, whose backends build stride-aware scale views (vLLM
0.27.1 on), it protects nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.engine.analysis.audit_lint import audit_summaries, audit_view
from kvpolicy.engine.analysis.budget import DEFAULT_MAX_INPUTS
from kvpolicy.engine.analysis.connector_names import unknown_connector_findings
from kvpolicy.engine.analysis.decider import Decider
from kvpolicy.engine.analysis.space import AnalysisInput, Space, build_space
from kvpolicy.engine.decide import release_ref, rule_ref
from kvpolicy.engine.plan import plan_layout
from kvpolicy.engine.trace import CandidateRemoved, RuleRef
from kvpolicy.engine.verify import verify_plan
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.rule_model import Effect
from kvpolicy.policy.ruleset import RuleSet, Source

__all__ = ["Finding", "LintReport", "LoadBearing", "fold", "lint", "render_load_bearing", "shipped_ruleset"]

VERIFY_BLOCKS = 2
_CUT_MEANS = ("every finding holds for the explored inputs only: an unsafe permit or a conflict among the left-out "
              "inputs goes unreported, and a `dead-rule` or `not-load-bearing` rule may be matched or bear load "
              "there; raise --max-space (more time and memory), or split the rule set")
_EXAMPLES = 3
_REFUSALS_LISTED = 50  # a release's refusals are many and expected: a sample is listed, the count is exact
WIDE = 6  # text output: a folded field with more values than this shows their count and the first `_SHOWN`
_SHOWN = 3


@dataclass(frozen=True)
class Finding:
    severity: str  # error | warning | note
    code: str
    message: str
    rule: RuleRef | None = None
    inputs: tuple[str, ...] = ()
    total: int | None = None  # inputs in all, when ``inputs`` lists only a sample
    groups: tuple[tuple[str, int], ...] = ()  # ``inputs`` folded: (label with {a,b} where they vary, count)
    brief: tuple[tuple[str, int], ...] = ()  # ``groups`` with a field of many values summarised (`WIDE`)
    at: Source | None = None  # where a finding about no one rule is (a fleet's deployment: its line in the file)

    @property
    def count(self) -> int:
        return len(self.inputs) if self.total is None else self.total

    def render(self, max_inputs: int = 20, verbose: bool = False) -> str:
        """The finding and its inputs, folded; a field of many values is summarised unless ``verbose``."""
        where = f"{self.rule.source}: " if self.rule else f"{self.at}: " if self.at else ""
        text = f"{where}{self.severity}[{self.code}]: {self.message}"
        groups = self.groups if verbose or not self.brief else self.brief
        if groups:  # near-identical inputs on one line each, with their count
            for label, n in groups[:max_inputs]:
                text += f"\n    {label}" + (f"  ({n} inputs)" if n > 1 else "")
            if groups[:max_inputs] != self.groups[:max_inputs]:  # a shown line is summarised
                text += f"\n    (a field of more than {WIDE} values shows their count and the first {_SHOWN}: " \
                    "--verbose lists each, --format json every input)"
            shown = sum(n for _, n in groups[:max_inputs])
            if self.count > shown:
                text += f"\n    ... and {self.count - shown} more inputs (--format json lists " + (
                    "all)" if self.total is None else f"{len(self.inputs)})")
            return text
        for label in self.inputs[:max_inputs]:
            text += f"\n    {label}"
        if self.count > min(max_inputs, len(self.inputs)):
            more = self.count - min(max_inputs, len(self.inputs))
            text += f"\n    ... and {more} more inputs " + (
                "(--format json lists all)" if self.total is None else f"(--format json lists {len(self.inputs)})")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "rule": self.rule.to_dict() if self.rule else None,
                "location": str(self.at) if self.at is not None else None, "count": self.count,
                "inputs": list(self.inputs),
                "groups": [{"inputs": label, "count": n} for label, n in self.groups]}


@dataclass
class LoadBearing:
    """What one forbid/require bears in the space: what deleting it would change."""

    rule: RuleRef
    matched: int = 0  # inputs it matches
    changed: int = 0  # inputs whose decision changes without it
    unsafe: int = 0  # inputs for which an unsafe layout survives the rules without it
    unsafe_chosen: int = 0  # ... and is chosen
    examples: list[str] = field(default_factory=list)  # inputs where it bears load (safety ones first)

    @property
    def kind(self) -> str | None:
        """``safety``, ``decision``, or None (not load-bearing)."""
        if self.unsafe:
            return "safety"
        return "decision" if self.changed else None

    def describe(self, unit: str = "input") -> str:
        """What deleting the rule changes, counted in ``unit``s (``input``; a fleet's ``deployment``)."""
        if self.kind == "safety":
            text = f"without it an unsafe layout gets through the rules for {self.unsafe} {unit}(s)"
            if self.unsafe_chosen:
                text += f" (and is chosen for {self.unsafe_chosen})"
            return text + f"; {self.changed} decision(s) change"
        if self.kind == "decision":
            return f"without it {self.changed} decision(s) change, every one to a safe layout"
        if not self.matched:
            return f"it matches no {unit}"
        return f"it matches {self.matched} {unit}(s), but without it no decision changes"

    def to_dict(self) -> dict[str, Any]:
        return {**self.rule.to_dict(), "load_bearing": self.kind, "matched": self.matched,
                "decisions_changed": self.changed, "unsafe_without": self.unsafe,
                "unsafe_chosen_without": self.unsafe_chosen, "examples": list(self.examples)}




def render_load_bearing(header: str, load_bearing: Sequence[LoadBearing], unit: str = "input") -> str:
    """The load-bearing section of a lint report: ``header``, then one line per forbid/require."""
    lines = [header]
    for lb in load_bearing:
        lines.append(f"  {lb.kind or 'no':<8}  `{lb.rule.id}` ({lb.rule.effect}, {lb.rule.source}): "
                     f"{lb.describe(unit)}")
    if not load_bearing:
        lines.append("  (the rule set has no forbid or require)")
    return "\n".join(lines)
@dataclass(frozen=True)
class LintReport:
    findings: tuple[Finding, ...]
    inputs_checked: int
    rules: int
    plans_verified: int = 0
    summary: dict[str, int] = field(default_factory=dict)
    profile: str = ""
    space: Space | None = None
    load_bearing: tuple[LoadBearing, ...] = ()

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    def bearing(self, kind: str | None) -> list[str]:
        """Ids of the forbids/requires of this kind (``safety``, ``decision``, None)."""
        return [lb.rule.id for lb in self.load_bearing if lb.kind == kind]

    def render_load_bearing(self) -> str:
        return render_load_bearing(f"load-bearing forbids/requires under `{self.profile}` (deleting one lets an "
                                   "unsafe layout through: safety; or changes a decision: decision):",
                                   self.load_bearing)

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "inputs_checked": self.inputs_checked,
                "space": self.space.to_dict() if self.space is not None else None,
                "rules": self.rules, "plans_verified": self.plans_verified,
                "errors": len(self.errors), "warnings": len(self.warnings),
                "findings": [f.to_dict() for f in self.findings],
                "load_bearing": [lb.to_dict() for lb in self.load_bearing]}


# Plan refusals where the release itself cannot run the layout either (not an unsafe permit).
RELEASE_FAILS = frozenset({"nvfp4-pages-not-dense"})


class _Verifier:
    """Verify (layout, geometry) once; the space repeats them many times."""

    def __init__(self) -> None:
        self.cache: dict[tuple[Any, ...], tuple[str, str] | None] = {}

    def check(self, layout: Layout, inp: AnalysisInput) -> tuple[str, str] | None:
        """None when safe; else ("overlap" | "unplannable" | "release-fails", what is wrong in one line)."""
        if not inp.kv.kind.is_attention:  # a Mamba-only model: no paged K/V whose views could meet
            return None
        key = (layout, inp.geometry)
        if key not in self.cache:
            try:
                report = verify_plan(plan_layout(layout, inp.kv, inp.backend, VERIFY_BLOCKS))
                self.cache[key] = None if report.ok else ("overlap", report.collisions[0].describe())
            except PolicyError as exc:
                code = exc.diagnostics[0].code if exc.diagnostics else ""
                self.cache[key] = ("release-fails" if code in RELEASE_FAILS else "unplannable",
                                   exc.diagnostics[0].message if exc.diagnostics else exc.message)
        return self.cache[key]

    def unsafe(self, layout: Layout, inp: AnalysisInput) -> bool:
        """The rules must not let ``layout`` through for ``inp``: its views overlap, or kvpolicy has no
        geometry for it where the release has one."""
        problem = self.check(layout, inp)
        return problem is not None and problem[0] != "release-fails"


def _labels(inputs: list[AnalysisInput], limit: int | None = None) -> tuple[str, ...]:
    return tuple(sorted(inp.label for inp in inputs[:limit]))


def fold(inputs: list[AnalysisInput] | list[tuple[tuple[str, str], ...]],
         wide: int | None = None) -> tuple[tuple[str, int], ...]:
    """Inputs that differ in one field at a time, folded into one line each: ``backend={A,B}``
    where the values vary, with the number of inputs the line stands for (exact: the inputs
    are distinct, and a line is the product of its value sets). ``wide``: a field with more values
    than that is summarised, ``connector=<46 values: A, B, C, ...>`` (the text output's default)."""
    return _shown(_fold_rows(inputs), wide)


_Rows = list[tuple[tuple[str, ...], tuple[frozenset[str], ...]]]


def _fold_rows(inputs: list[AnalysisInput] | list[tuple[tuple[str, str], ...]]) -> _Rows:
    """`fold`'s lines before they are written: (fields, the values of each)."""
    rows: _Rows = []
    for inp in inputs:
        pairs = inp.labels if isinstance(inp, AnalysisInput) else inp
        rows.append((tuple(k for k, _ in pairs), tuple(frozenset([v]) for _, v in pairs)))
    width = max((len(keys) for keys, _ in rows), default=0)
    for _ in range(2):  # a second pass folds what the first pass's merges made equal
        for pos in range(width):
            merged: dict[tuple[Any, ...], tuple[tuple[str, ...], list[frozenset[str]]]] = {}
            for keys, values in rows:
                if pos >= len(keys):
                    merged[(keys, values)] = (keys, list(values))
                    continue
                key = (keys, values[:pos], values[pos + 1:])
                if key in merged:
                    merged[key][1][pos] = merged[key][1][pos] | values[pos]
                else:
                    merged[key] = (keys, list(values))
            rows = [(keys, tuple(values)) for keys, values in merged.values()]
    return rows


def _shown(rows: _Rows, wide: int | None) -> tuple[tuple[str, int], ...]:
    def show(v: frozenset[str]) -> str:
        if wide is not None and len(v) > wide:
            return f"<{len(v)} values: " + ", ".join(sorted(v)[:_SHOWN]) + ", ...>"
        return next(iter(v)) if len(v) == 1 else "{" + ",".join(sorted(v)) + "}"

    out = [(" ".join(f"{k}={show(v)}" for k, v in zip(keys, values)), math.prod(len(v) for v in values))
           for keys, values in rows]
    return tuple(sorted(out, key=lambda g: (-g[1], g[0])))


def _folded(inputs: list[AnalysisInput]) -> dict[str, tuple[tuple[str, int], ...]]:
    """A finding's ``groups`` (every value) and ``brief`` (a field of many values summarised)."""
    rows = _fold_rows(inputs)  # folded once, written twice
    return {"groups": _shown(rows, None), "brief": _shown(rows, WIDE)}


def own_rule_ids(ruleset: RuleSet) -> frozenset[str]:
    """The ids of the rules of the operator's layers (those not shipped): where a conflict they take part in is
    located. Empty for a rule set of one directory, or of shipped layers only."""
    return frozenset().union(*(layer.rule_ids for layer in ruleset.layers if not layer.shipped))


def shipped_ruleset(vllm_version: str | ReleaseProfile | None = None) -> RuleSet | None:
    """The profile's shipped rules (None when they do not load: lint then has no baseline)."""
    from kvpolicy.engine.rule_layers import load_layers

    try:
        return load_layers(vllm_version=vllm_version)
    except PolicyError:  # pragma: no cover - a packaging defect; the shipped-rules tests catch it
        return None


def lint(
    ruleset: RuleSet,
    inputs: Space | list[AnalysisInput] | None = None,
    *,
    vllm_version: str | ReleaseProfile | None = None,
    scale_views: list[ScaleViews] | None = None,
    baseline: RuleSet | bool | None = True,
    max_inputs: int = DEFAULT_MAX_INPUTS,
) -> LintReport:
    """Lint ``ruleset`` over ``inputs`` (default: the profile's space; see `kvpolicy.engine.analysis.space`).

    ``baseline``: the rule set whose conflicts are the release's own refusals
    (True: the profile's shipped rules; None/False: none, every conflict is an
    error). Its fields are part of the default space, which holds at most
    ``max_inputs`` inputs: a cut space is a ``space-cut`` warning, and the
    findings hold for the explored inputs only.
    """
    profile = get_profile(vllm_version)
    base = shipped_ruleset(profile) if baseline is True else (baseline or None)
    if base is not None and base.digest == ruleset.digest:
        base = ruleset
    if inputs is None:
        audited = [view] if (view := audit_view(ruleset)) is not None else []  # the fields audit rules test too
        space = build_space(([ruleset] if base is None or base is ruleset else [ruleset, base]) + audited,
                            vllm_version=profile, scale_views=scale_views, max_inputs=max_inputs)
    elif isinstance(inputs, Space):
        space = inputs
    else:
        space = Space(profile, list(inputs))
    order = ruleset.layout_order
    verifier = _Verifier()
    decider = Decider(ruleset)
    base_decider = None if base is None else (decider if base is ruleset else Decider(base))
    matched: dict[str, int] = {r.id: 0 for r in ruleset.rules}
    bearing = {r.id: LoadBearing(rule_ref(r)) for r in ruleset.rules if r.effect is not Effect.prefer}
    unsafe: dict[tuple[str, str], list[AnalysisInput]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    # (refused by the release too?, the operator's rule it is located at, or None) -> inputs, and the rules
    # removing candidates there: a conflict an operator's layer makes is located at each of its rules taking part
    conflicts: dict[tuple[bool, str | None], list[AnalysisInput]] = {}
    conflict_rules: dict[tuple[bool, str | None], dict[str, RuleRef]] = {}
    n_conflicts = {False: 0, True: 0}
    own = own_rule_ids(ruleset)
    # Inputs with the same decision key decide alike; within one, the verifier's answer depends
    # only on the geometry. So each key is analysed once, and each (key, geometry) verified once.
    cases: dict[tuple[int, str], dict[tuple[str, ...], list[AnalysisInput]]] = {}
    for inp in space:
        key = decider.key(inp)
        by_geometry = cases.get(key)
        if by_geometry is None:
            by_geometry = cases[key] = {}
        geometry = inp.core.geometry
        members = by_geometry.get(geometry)
        if members is None:
            by_geometry[geometry] = [inp]
        else:
            members.append(inp)
    full = (1 << len(order)) - 1
    for geometries in cases.values():
        everyone = [inp for members in geometries.values() for inp in members]
        inp, n = everyone[0], len(everyone)
        d = decider.decide(inp)
        for rule in d.matched:
            matched[rule.id] += n
            lb = bearing.get(rule.id)
            if lb is None:
                continue
            lb.matched += n
            sole = d.sole(rule.id)  # what survives without it; nothing else changes (no scores)
            if not sole:
                continue
            w = decider.without(inp, rule.id)
            if w != d.winner:
                lb.changed += n
            for members in geometries.values():
                rep = members[0]
                through = any(verifier.unsafe(order[i], rep) for i in sole)
                if through:
                    lb.unsafe += len(members)
                    if w is not None and w != d.winner and verifier.unsafe(order[w], rep):
                        lb.unsafe_chosen += len(members)
                if (through or w != d.winner) and len(lb.examples) < _EXAMPLES:
                    lb.examples.append(f"{rep.label}: {decider.name(d.winner)} -> {decider.name(w)}"
                                       + (" (unsafe)" if through else ""))
        if d.winner is None:
            owners = sorted({i for ids in d.removers.values() for i in ids if i in own}) or \
                sorted(r.id for r in d.matched if r.id in own) or [None]  # a members' disagreement: their prefers
            sides = set()
            for x in everyone:  # the release refuses these too when its shipped rules leave nothing
                refused = base_decider is not None and base_decider.decide(x).winner is None
                n_conflicts[refused] += 1
                for owner in [None] if refused else owners:
                    conflicts.setdefault((refused, owner), []).append(x)
                    sides.add((refused, owner))
            for side in sides:
                found = conflict_rules.setdefault(side, {})
                for ids in d.removers.values():
                    for rule_id in ids:
                        if rule_id not in found:
                            found[rule_id] = rule_ref(ruleset.rule(rule_id))
                if d.candidates != full and "release-candidates" not in found:
                    found["release-candidates"] = release_ref(inp.context)
                agree = f"connector:{inp.conn.config.name}:members-agree" if inp.conn.config else ""
                if agree not in found and d.candidates & ~sum(1 << i for i in d.removers):  # members disagreed
                    for e in decider.events(inp):
                        if isinstance(e, CandidateRemoved) and e.rule.id.endswith(":members-agree"):
                            found.setdefault(e.rule.id, e.rule)
                            break
            continue
        layout = order[d.winner]
        for members in geometries.values():
            problem = verifier.check(layout, members[0])
            if problem is not None:
                reason = (str(layout), problem[0])
                unsafe.setdefault(reason, []).extend(members)
                if problem[1] not in why.setdefault(reason, []):
                    why[reason].append(problem[1])

    findings: list[Finding] = []
    if space.cut is not None:
        findings.append(Finding("warning", "space-cut", f"the space was {space.cut.describe()}: {_CUT_MEANS}"))
    findings += [Finding(severity, code, message, rule_ref(rule))
                 for severity, code, message, rule in unknown_connector_findings(ruleset)]
    fails = {k: v for k, v in unsafe.items() if k[1] == "release-fails"}
    unsafe = {k: v for k, v in unsafe.items() if k[1] != "release-fails"}
    for (layout, reason), labels in sorted(unsafe.items()):
        shown = "; ".join(why[(layout, reason)][:2])
        if len(why[(layout, reason)]) > 2:
            shown += f"; and {len(why[(layout, reason)]) - 2} more"
        what = "whose views would overlap" if reason == "overlap" else "that the backend has no geometry for"
        findings.append(Finding("error", "unsafe-permit", f"the rules choose `{layout}` for {len(labels)} input(s) "
                                f"{what} ({shown})", inputs=_labels(labels), **_folded(labels)))

    def named(refs: dict[str, RuleRef]) -> str:
        return ", ".join(f"`{r.id}` ({r.source})" for r in sorted(refs.values(), key=lambda r: (str(r.source), r.id)))

    def at(owner: str | None) -> tuple[str, int, str]:  # a conflict about no rule of yours first, then by rule
        return ("", 0, "") if owner is None else (ruleset.rule(owner).source.file,
                                                  ruleset.rule(owner).source.line, owner)

    for owner in sorted((o for refused, o in conflicts if not refused), key=at):
        inputs = conflicts[(False, owner)]
        where = "" if owner is None else f" where `{owner}` removes candidates (the shipped rules alone choose one)"
        if owner is not None and ruleset.rule(owner).effect is Effect.prefer:  # a prefer removes nothing itself
            where = (f" where `{owner}` (prefer) changes a connector member's best layout, so the members no longer "
                     "agree (the shipped rules alone choose one)")
        findings.append(Finding("error", "conflict",
                                f"no layout survives for {len(inputs)} input(s){where}; the rules removing "
                                f"candidates there: {named(conflict_rules[(False, owner)])}",
                                None if owner is None else rule_ref(ruleset.rule(owner)), inputs=_labels(inputs),
                                **_folded(inputs)))
    for rule in sorted(ruleset.rules, key=lambda r: (r.source, r.id)):
        if not matched[rule.id]:
            findings.append(Finding("warning", "dead-rule", f"rule `{rule.id}` matches no input of the space"
                                    + (" (as cut: see space-cut)" if space.cut is not None else ""), rule_ref(rule)))
        elif rule.id in bearing and bearing[rule.id].kind is None:
            findings.append(Finding(
                "note", "not-load-bearing",
                f"rule `{rule.id}` matches {matched[rule.id]} input(s), but removing it alone changes no decision "
                "and lets no unsafe layout through (other rules or the release's candidates cover it): it can go, "
                "or it guards inputs outside the space", rule_ref(rule)))
    for (layout, reason), labels in sorted(fails.items()):
        findings.append(Finding("note", "release-fails",
                                f"the rules choose `{layout}` for {len(labels)} input(s), as the release does, which "
                                f"the release then cannot run, nor kvpolicy plan ({why[(layout, reason)][0]})",
                                inputs=_labels(labels, _REFUSALS_LISTED), total=len(labels), **_folded(labels)))
    if (True, None) in conflicts:
        refusals = conflicts[(True, None)]
        findings.append(Finding("note", "release-refuses",
                                f"no layout survives for {len(refusals)} input(s), as with the shipped rules "
                                f"of `{profile.name}`: the release refuses to start there; the rules removing "
                                f"candidates: {named(conflict_rules[(True, None)])}",
                                inputs=_labels(refusals, _REFUSALS_LISTED), total=len(refusals),
                                **_folded(refusals)))
    findings += [Finding("note", "audit", s.message, rule_ref(s.rule), inputs=s.examples, total=s.changed)
                 for s in audit_summaries(ruleset, space, decider)]
    summary = {"inputs": len(space), "unsafe_inputs": sum(len(v) for v in unsafe.values()),
               "conflicts": n_conflicts[False], "release_refuses": n_conflicts[True],
               "release_fails": sum(len(v) for v in fails.values())}
    ordered = tuple(sorted(bearing.values(), key=lambda lb: (str(lb.rule.source), lb.rule.id)))
    return LintReport(tuple(findings), len(space), len(ruleset.all_rules), len(verifier.cache), summary,
                      space.profile.name, space, ordered)
