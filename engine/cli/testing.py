"""``kvpolicy test [PATHS...]``: run policy tests (YAML cases) against a rule set.

A thin printer over `kvpolicy.engine.policy_tests.run_policy_tests` (imported when the
verb runs, so other verbs do not build its models); the case format is
documented in docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    add_rules_flag,
    add_vllm_version_flag,
    exit_code_for,
    expand_rule_dirs,
    load_ruleset,
    operator_layer_roots,
    print_diagnostics,
    print_json,
    report_error,
    shipped_roots,
    usage_error,
)
from kvpolicy.engine.cli.test_reports import case_diagnostics, coverage_breakdown, coverage_percent, junit_xml
from kvpolicy.policy.errors import Diagnostic, PolicyError, shown_file

if TYPE_CHECKING:
    from kvpolicy.engine.policy_tests import CaseResult, TestRun
    from kvpolicy.policy.ruleset import RuleSet

__all__ = ["register", "render_run", "run"]

_EPILOG = """\
examples:
  kvpolicy test                                   # rules/<profile>/tests/*.yaml against the shipped rules
  kvpolicy test --vllm-version issue-48412        # that profile's shipped rules and tests
  kvpolicy test --vllm-version 0.28.0             # the tests/ of each shipped layer, decided as vLLM 0.28
  kvpolicy test --rules my-rules/                 # my-rules/tests/*.yaml against the shipped rules + my-rules/
                                                  (several --rules: the tests/ of each that has one)
  kvpolicy test --rules my-rules/ cases/nixl.yaml --require-coverage -v
  kvpolicy test --rules my-rules/ --include-shipped   # the shipped rules count in the coverage too
  kvpolicy test --run 'Nixl|Offloading'           # only the cases whose name matches (a regex, searched)

a case file (docs/cli.md has the full format; this one passes under the default profile):
  version: 1
  cases:
    - name: offloading with fp8 per-token-head takes the layout the connector asks for
      input:
        spec: {num_layers: 24, block_size: 16, num_kv_heads: 2, head_size: 64}
        kv_cache_dtype: fp8_per_token_head
        connector: OffloadingConnector
      expect:
        layout: LBHNC
        matched: [offloading-requires-lbhnc]

output: each failing case with expected vs actual and the decision's `fails` explanation,
then `N passed, N failed`, then `coverage: X/Y rules matched by some case` (with --rules: of
your layers' rules, unless --include-shipped) and the rules no case made match, with their
file:line.

exit codes: 0 every case passed, 1 a case failed (or, with --require-coverage, a rule is
            uncovered; or a test file does not load; or no case matches --run), 2 usage error
            (a --run PATTERN that is no regular expression)
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "test", help="run policy tests (YAML cases) and report rule coverage",
        description="Run policy unit tests: each case decides one input and checks the chosen layout, the "
                    "rules that removed candidates and the rules that matched. Reports which rules no case "
                    "made match.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="case files or directories of them (default: <rules dir>/tests/)")
    add_rules_flag(p)
    add_vllm_version_flag(p)
    p.add_argument("--require-coverage", nargs="?", const=100.0, default=None, type=_percent, metavar="PERCENT",
                   help="fail (exit 1) when fewer than PERCENT of the counted rules are matched by some case "
                        "(alone: 100, every rule); put PATHs before it")
    p.add_argument("--include-shipped", action="store_true",
                   help="with --rules: count the shipped rules' coverage too (default: only the rules of your "
                        "layers count, for the summary and --require-coverage)")
    p.add_argument("--run", metavar="PATTERN", default=None, dest="run_pattern",  # `run` is the verb's function
                   help="run only the cases whose name this regular expression matches anywhere (Python `re`, "
                        "as `opa test --run`); every file is still loaded and checked; coverage counts the "
                        "cases run; no case matching is a failure (exit 1)")
    p.add_argument("-v", "--verbose", action="store_true", help="list passing cases too")
    p.add_argument("--format", choices=("text", "json", "junit", "github", "sarif"), default="text",
                   help="text for people (default), json for programs (docs/json-output.md); junit: JUnit XML "
                        "(a file that does not load: an errored testcase); github: GitHub Actions annotations; "
                        "sarif: SARIF 2.1.0")
    p.set_defaults(run=run)


_MAX_PATTERN = 1000  # a case name is a line; a longer pattern is a mistake, not a selection


def _selection(pattern: str | None) -> re.Pattern[str] | None:
    """``--run PATTERN`` compiled; a usage error at the flag when it is no regular expression."""
    if pattern is None:
        return None
    if len(pattern) > _MAX_PATTERN:
        raise usage_error("--run", f"the pattern is over {_MAX_PATTERN} characters", "select with a shorter one")
    try:
        return re.compile(pattern)
    except re.error as exc:
        where = f" at position {exc.pos}" if exc.pos is not None else ""
        raise usage_error("--run", f"`{pattern}` is not a regular expression: {exc.msg}{where}",
                          "escape regex characters with `\\` (`re.escape`), or write a substring of the "
                          "case name") from None


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage from 0 to 100, got `{text}` (case files go "
                                         "before --require-coverage)") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage from 0 to 100, got `{text}`")
    return value


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else "" for line in text.splitlines())


def render_case(result: CaseResult) -> str:
    """A failing case: its location and name, what differed, and the decision's explanation."""
    lines = [f"FAIL {result.loaded.location}: {result.name}"]
    for failure in result.failures:
        lines.append(_indent(failure, "  "))
    lines.append("  decision (fails):" if result.decision is not None else "  error:")
    lines.append(_indent(result.explanation(), "    "))
    return "\n".join(lines)


def render_run(run: TestRun, *, verbose: bool = False) -> str:
    """The whole report; ends with the summary line and the coverage report."""
    out = []
    for r in run.results:
        if not r.passed:
            out.append(render_case(r))
            out.append("")
        elif verbose:
            out.append(f"PASS {r.loaded.location}: {r.name}")
    if verbose and run.failed == 0:
        out.append("")
    noted = [(r, n) for r in run.results for n in r.notes]
    if noted:  # what reading a case's model config assumed, tied to the case (as dry-run --model says it)
        out += [f"{r.loaded.location}: {r.name}: {n}" for r, n in noted]
        out.append("")
    cov = run.coverage
    out.append(f"{run.passed} passed, {run.failed} failed"
               + (f" ({len(run.results)} of {run.selection[1]} cases selected by --run `{run.selection[0]}`)"
                  if run.selection is not None else ""))
    of = f" of {' + '.join(shown_file(layer) for layer in cov.layers)}" if cov.layers else ""
    out.append(f"coverage: {cov.total - len(cov.uncovered)}/{cov.total} rules{of} matched by some case"
               + (" (the shipped rules: --include-shipped)" if cov.layers else ""))
    for rule in cov.uncovered:
        out.append(f"  uncovered: {rule.id} at {rule.source}")
    by_layer, by_file = coverage_breakdown(run.ruleset, run.results)
    if len(by_layer) > 1:
        out.append("coverage by layer:")
        out += [row.render() for row in by_layer]
    files = by_file if verbose else [row for row in by_file if not row.shipped]  # the shipped files' with -v
    if files:
        out.append("coverage by file:")
        out += [row.render() for row in files]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    ruleset = load_ruleset(args.rules, vllm_version=args.vllm_version, shipped_rules=not args.no_shipped_rules)
    try:
        return _run_with(args, ruleset)
    except PolicyError as exc:  # the cases do not load: the error document keeps the rule set's warnings,
        report_error(exc, args.format, printed=ruleset.warnings)  # which stderr already carries
        return exit_code_for(exc)


def _run_with(args: argparse.Namespace, ruleset: RuleSet) -> int:
    from kvpolicy.engine.policy_tests import run_policy_tests  # its pydantic models cost ~30 ms: only for this verb
    from kvpolicy.engine.policy_tests.runner import coverage_of

    # default cases: the tests/ of each operator layer; with no --rules the shipped layers' own
    layers = [d / "tests" for d in expand_rule_dirs(list(args.rules or []), args.vllm_version)[0]]
    shipped = [t for t in (d / "tests" for d in shipped_roots(args.vllm_version)) if t.is_dir()]
    paths = args.paths or [t for t in layers if t.is_dir()] or layers[-1:] or shipped
    missing = [str(p) for p in args.paths or [] if not os.path.lexists(p)]
    if missing:  # a path that names nothing is a usage error (2), as for every verb; a bad file is a failure (1)
        raise usage_error(missing[0], "no such file or directory", "pass policy test files or directories holding them")
    select = _selection(args.run_pattern)
    result = run_policy_tests(ruleset, paths, vllm_version=args.vllm_version, select=select)
    if select is not None and not result.results:
        total = result.selection[1] if result.selection else 0
        raise PolicyError("", [Diagnostic("--run", 0, 0, "no-case-selected",
                                          f"no case name matches `{args.run_pattern}` ({total} case(s) in the "
                                          "files run)",
                                          "`kvpolicy test -v` lists every case's name; the pattern is searched "
                                          "anywhere in it (anchor it with `^...$`)")])
    own = operator_layer_roots(ruleset)
    mine = any(layer.rule_ids for layer in ruleset.layers if not layer.shipped)  # a copy of shipped files owns none
    if mine and not args.include_shipped:  # the operator's coverage: the rules of the layers they own
        result = replace(result, coverage=coverage_of(ruleset, result.results, own))
    short = args.require_coverage is not None and coverage_percent(result) < args.require_coverage
    if args.format == "json":
        by_layer, by_file = coverage_breakdown(result.ruleset, result.results)
        data = result.to_dict()
        data["warnings"] = [d.to_dict() for d in ruleset.warnings]  # what the text prints on stderr (expired-waiver)
        data["coverage_summary"] = {"percent": round(coverage_percent(result), 1), "required": args.require_coverage,
                                    "by_layer": [r.to_dict() for r in by_layer],
                                    "by_file": [r.to_dict() for r in by_file]}
        print_json(data)
    elif args.format == "junit":
        print(junit_xml(result, coverage_fails=short, render=render_case))
    elif args.format in ("github", "sarif"):
        print_diagnostics(case_diagnostics(result, coverage_fails=short), args.format, ruleset)
    else:
        print(render_run(result, verbose=args.verbose))
        if short:
            print(f"coverage {coverage_percent(result):.1f}% is under the required {args.require_coverage:g}%")
    if not result.ok or short:
        return EXIT_FAILED
    return EXIT_OK
