"""Running policy tests: decide each case with the full trace and compare with its expectation.

`run_policy_tests` returns a `TestRun`: what failed (expected vs actual, with the
decision's ``fails`` explanation) and which rules no case made match (coverage).
`kvpolicy test` is a thin printer over it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.engine.connector_names import Refuse, check_connector_names, out_of_tree_names
from kvpolicy.engine.decide import evaluate, no_layout_error, scopes_for
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.model_notes import model_config_notes
from kvpolicy.engine.policy_tests.cases import Expect, LoadedCase, context_for, load_cases
from kvpolicy.engine.trace import CandidateRemoved, RuleEvaluated
from kvpolicy.policy.errors import GeometryError, InputError, ModelConfigError, NoLayoutError, PolicyError
from kvpolicy.policy.layouts import Layout, LayoutPattern
from kvpolicy.policy.releases import ReleaseProfile
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["CaseResult", "Coverage", "TestRun", "coverage_of", "error_codes", "run_case", "run_policy_tests"]


@dataclass(frozen=True)
class CaseResult:
    """One case's outcome: what was checked, what differed, and the evidence."""

    loaded: LoadedCase
    failures: tuple[str, ...]
    matched: frozenset[str]  # rule ids that matched in some scope
    layout: Layout | None  # the chosen layout (None on error)
    error: PolicyError | None  # the decision's error, if any
    decision: Decision | None = field(default=None, compare=False, repr=False)
    notes: tuple[str, ...] = field(default=(), compare=False)  # what reading its model config assumed

    @property
    def name(self) -> str:
        return self.loaded.case.name

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def covered(self) -> frozenset[str]:
        """The rules this case tests: those that matched, and the audit-mode rules its ``expect.audit``
        asserts (the decision never evaluates an audit rule, so it never "matches")."""
        return self.matched | frozenset(self.loaded.case.expect.audit)

    def explanation(self) -> str:
        """The decision's ``fails`` explanation, or the rendered error."""
        if self.decision is not None:
            return self.decision.explain("fails")
        return self.error.render() if self.error is not None else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "location": self.loaded.location,
            "passed": self.passed,
            "failures": list(self.failures),
            "layout": None if self.layout is None else str(self.layout),
            "error": None if self.error is None else [d.to_dict() for d in self.error.diagnostics],
            "warnings": list(self.notes),
        }


@dataclass(frozen=True)
class Coverage:
    """Which rules of the rule set some case made match."""

    total: int
    covered: frozenset[str]
    uncovered: tuple[CompiledRule, ...]
    layers: tuple[str, ...] = ()  # the layers counted (as shown); empty: every rule of the set

    @property
    def complete(self) -> bool:
        return not self.uncovered

    def to_dict(self) -> dict[str, Any]:
        return {"matched": self.total - len(self.uncovered), "total": self.total, "layers": list(self.layers),
                "uncovered": [{"rule": r.id, "source": str(r.source)} for r in self.uncovered]}


@dataclass(frozen=True)
class TestRun:
    """Every case's result and the rule coverage, for one rule set."""

    ruleset: RuleSet
    results: tuple[CaseResult, ...]
    coverage: Coverage
    # `--run PATTERN` (`run_policy_tests(select=...)`): the pattern and how many cases the files hold; None: all ran
    selection: tuple[str, int] | None = None

    __test__ = False  # not a pytest class

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def to_dict(self) -> dict[str, Any]:
        out = {"passed": self.passed, "failed": self.failed, "cases": [r.to_dict() for r in self.results],
               "coverage": self.coverage.to_dict(),
               "ruleset": {"root": self.ruleset.root, "digest": self.ruleset.digest}}
        if self.selection is not None:
            out["selection"] = {"run": self.selection[0], "selected": len(self.results), "of": self.selection[1]}
        return out


def _fmt_list(items: Iterable[str]) -> str:
    items = list(items)
    return ", ".join(f"`{i}`" for i in items) if items else "nothing"


def _show_pattern(p: LayoutPattern) -> str:
    others = p.model_dump(exclude={"layout"}, exclude_none=True)
    if p.layout is not None and len(p.layout) == 1 and not others:
        return p.layout[0].value
    if p.layout is None and set(others) == {"placement", "head_order"}:
        return f"{p.placement.value}/{p.head_order.value}"
    return str(p)


# An `expect.error` names the kind of error or the code of one of its diagnostics.
_KIND_CODES: tuple[tuple[type[PolicyError], str], ...] = (
    (NoLayoutError, "no-layout"),
    (InputError, "invalid-input"),
    (ModelConfigError, "invalid-model-config"),
    (GeometryError, "geometry"),
)


def error_codes(error: PolicyError) -> list[str]:
    """The codes an ``expect.error`` may name: the error's kind first, then its diagnostics' codes."""
    kinds = [code for cls, code in _KIND_CODES if isinstance(error, cls)]
    return list(dict.fromkeys([*kinds, *(d.code for d in error.diagnostics)]))


def _check(expect: Expect, layout: Layout | None, error: PolicyError | None, survivors: list[str],
           removed: dict[str, list[str]], matched: set[str]) -> list[str]:
    """Every way the actual outcome differs from ``expect``, each as "expected ...\nactual ..."."""
    out: list[str] = []
    codes = error_codes(error) if error is not None else []
    if expect.error is not None:
        if error is None:
            out.append(f"expected error: `{expect.error}`\nactual layout:  {layout}")
        elif expect.error not in codes:
            out.append(f"expected error: `{expect.error}`\nactual errors:  {_fmt_list(dict.fromkeys(codes))}")
    elif error is not None:
        out.append(f"expected a decision\nactual error: {_fmt_list(dict.fromkeys(codes))}")
        return out
    if expect.layout is not None and layout is not None and not expect.layout.matches(layout):
        out.append(f"expected layout: {_show_pattern(expect.layout)}\nactual layout:   {layout}")
    if expect.survivors is not None and expect.survivors != survivors:
        out.append(f"expected survivors: {', '.join(expect.survivors) or 'none'}\n"
                   f"actual survivors:   {', '.join(survivors) or 'none'}")
    for lay, ids in (expect.removed or {}).items():
        by = removed.get(lay, [])
        if not by:
            out.append(f"expected `{lay}` removed" + (f" by {_fmt_list(ids)}" if ids else "")
                       + "\nactual: it survived")
            continue
        if any(i not in by for i in ids):
            out.append(f"expected `{lay}` removed by {_fmt_list(ids)}\nactual: removed by {_fmt_list(by)}")
    for rule_id in expect.matched:
        if rule_id not in matched:
            out.append(f"expected rule `{rule_id}` to match\nactual: it matched in no scope")
    for rule_id in expect.not_matched:
        if rule_id in matched:
            out.append(f"expected rule `{rule_id}` not to match\nactual: it matched")
    return out


def _located(exc: PolicyError, lc: LoadedCase) -> PolicyError:
    """An input error named by field (``spec.block_size``) placed at that field in the case file."""
    if not isinstance(exc, InputError):
        return exc  # model-config errors are located in the config file already
    diags = []
    for d in exc.diagnostics:
        if d.line == 0:
            parts = [int(p) if p.isdigit() else p for p in re.split(r"[.\[\]]+", d.file) if p]
            d = lc.diag(("input", *parts), d.code, d.message, d.help)
        diags.append(d)
    return type(exc)(exc.message, diags)


def _refuse(lc: LoadedCase) -> Refuse:
    """A connector vLLM would refuse is a case error, located at the field that names it."""
    def refuse(member: bool, message: str, help: str) -> PolicyError:
        inp = lc.case.input
        key = "kv_transfer_config" if inp.kv_transfer_config is not None else \
            "connector_config" if member else "connector"
        return InputError(f"case `{lc.case.name}`: `{key}`", [lc.diag(("input", key), "unknown-connector", message,
                                                                       help)])
    return refuse


def run_case(ruleset: RuleSet, lc: LoadedCase, vllm_version: str | ReleaseProfile | None = None) -> CaseResult:
    """Decide one case (in ``vllm_version``'s profile) with the full trace and compare it with its expectation."""
    expect = lc.case.expect
    notes: list[str] = []
    try:
        with model_config_notes() as notes:
            ctx = context_for(lc.case.input, lc.base_dir, vllm_version)
        notes += check_connector_names(ctx, ruleset, out_of_tree_names(lc.case.input), _refuse(lc))
    except PolicyError as exc:
        exc = _located(exc, lc)
        return CaseResult(lc, tuple(_check(expect, None, exc, [], {}, set())), frozenset(), None, exc,
                          notes=tuple(notes))
    glob, conn = scopes_for(ruleset, ctx)
    outcome = evaluate(ruleset, glob, conn, explain=True)
    matched = {e.rule.id for e in outcome.events if isinstance(e, RuleEvaluated) and e.matched}
    removed: dict[str, list[str]] = {}
    for e in outcome.events:
        if isinstance(e, CandidateRemoved):
            ids = removed.setdefault(str(e.layout), [])
            if e.rule.id not in ids:
                ids.append(e.rule.id)
    order = ruleset.layout_order
    survivors = [str(order[i]) for i in outcome.ranked()]
    decision: Decision | None = None
    error: NoLayoutError | None = None
    layout: Layout | None = None
    if outcome.winner is None:
        error = no_layout_error(ruleset, outcome.events)
    else:
        decision = Decision(ruleset, ctx, outcome).declaring(out_of_tree_names(lc.case.input))
        layout = decision.layout
    failures = _check(expect, layout, error, survivors, removed, matched)
    if "audit" in expect.model_fields_set:
        failures += _check_audit(expect.audit, decision)
    return CaseResult(lc, tuple(failures), frozenset(matched), layout, error, decision, notes=tuple(notes))


def _check_audit(expected: list[str], decision: Decision | None) -> list[str]:
    """``expect.audit``: exactly these audit-mode rules report a finding (none without a decision)."""
    got = [] if decision is None else list(dict.fromkeys(f.rule.id for f in decision.audit))
    if sorted(got) == sorted(expected):
        return []
    return [f"expected audit findings: {_fmt_list(expected)}\nactual audit findings:   {_fmt_list(got)}"]


def coverage_of(ruleset: RuleSet, results: Iterable[CaseResult], layers: Iterable[str] | None = None) -> Coverage:
    """Which rules some case tests (`CaseResult.covered`: audit-mode rules count, covered by a case's
    ``expect.audit``); with ``layers`` (layer roots as shown), only those layers' rules count: an operator's
    coverage is about the rules the operator owns, not the shipped ones under them."""
    covered: set[str] = set()
    for r in results:
        covered |= r.covered
    rules = sorted(ruleset.all_rules, key=lambda r: r.source)
    counted = tuple(layers) if layers is not None else ()
    if layers is not None:
        rules = [r for r in rules if (layer := ruleset.layer_of(r.id)) is not None and layer.root in counted]
    return Coverage(len(rules), frozenset(covered), tuple(r for r in rules if r.id not in covered), counted)


def run_policy_tests(ruleset: RuleSet, paths: Iterable[str | os.PathLike[str]], *,
                     vllm_version: str | ReleaseProfile | None = None,
                     select: re.Pattern[str] | None = None) -> TestRun:
    """Load the cases under ``paths`` and run them against ``ruleset``, deciding each in
    ``vllm_version``'s release profile (default: the default profile); with ``select``, only the cases
    whose name it matches anywhere (`re.search`, as ``opa test --run``), and the coverage of those.

    Raises `PolicyTestError` (every problem, located) when a file does not
    load (every file is loaded and checked, selected cases or not); a case that fails is a result,
    not an exception.
    """
    cases = load_cases(paths, ruleset)
    chosen = cases if select is None else [lc for lc in cases if select.search(lc.case.name)]
    results = tuple(run_case(ruleset, lc, vllm_version) for lc in chosen)
    return TestRun(ruleset, results, coverage_of(ruleset, results),
                   None if select is None else (select.pattern, len(cases)))
