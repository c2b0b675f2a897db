"""``kvpolicy lint [DIR]`` and ``kvpolicy diff OLD NEW``: a rule set over every input it could see."""

from __future__ import annotations

import argparse
import time

from engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    add_format_flag,
    int_at_least,
    load_ruleset,
    print_error,
    print_json,
)
from policy.backends import ScaleViews
from policy.errors import RuleLoadError

__all__ = ["register"]

_LINT_EPILOG = """\
examples:
  kvpolicy lint                         # the shipped rules: clean
  kvpolicy lint my-rules/ --strict      # warnings (dead rules) fail too
  kvpolicy lint --scale-views stride_aware
      only inputs whose backends build stride-aware scale views: shows which
      forbids stop protecting anything once the backends are fixed

findings: error[unsafe-permit] the rules choose a layout whose views overlap (the
inputs are listed); error[conflict] no layout survives; warning[dead-rule] no input
makes the rule match; note[not-load-bearing] the rule only removes layouts the
verifier finds safe

exit codes: 0 no errors, 1 errors (or warnings with --strict), 2 usage error
"""

_DIFF_EPILOG = """\
examples:
  kvpolicy diff rules/ my-rules/        # what my edit changes, and which rules cause it
  kvpolicy diff rules/ my-rules/ --format json | jq .counts

output: a summary (inputs checked, decisions changed, counts per old -> new), then each
changed input with the rules responsible on each side

exit codes: 0 no decision changes, 1 some decisions change, 2 usage error
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "lint", help="check a rule set over every input: unsafe permits, conflicts, dead rules",
        description="Enumerate the finite input space (every kv_cache_dtype, backend and scale-view "
                    "strategy, attention kind, group shape, connector and the extra-config values its rules "
                    "test) and check the rules' decision for each against the geometry verifier.",
        epilog=_LINT_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("dir", nargs="?", metavar="DIR", help="the rule directory (default: the shipped rules)")
    p.add_argument("--scale-views", choices=[s.value for s in ScaleViews], action="append",
                   help="restrict the space to backends with this scale-view strategy (repeatable)")
    p.add_argument("--strict", action="store_true", help="warnings fail the lint too")
    p.add_argument("--max-inputs", type=int_at_least(0), default=20, metavar="N",
                   help="inputs listed per finding in text output (default 20; JSON lists all)")
    add_format_flag(p)
    p.set_defaults(run=run_lint)

    d = verbs.add_parser(
        "diff", help="list every input whose decision changes between two rule sets, and why",
        description="Decide every input of the enumerated space with both rule sets and list each input "
                    "whose layout changes, with the rules responsible on each side. A summary comes first.",
        epilog=_DIFF_EPILOG, formatter_class=HelpFormatter)
    d.add_argument("old", metavar="OLD", help="the rule directory before the change")
    d.add_argument("new", metavar="NEW", help="the rule directory after the change")
    d.add_argument("--max-changes", type=int_at_least(0), default=50, metavar="N",
                   help="changed inputs shown in text output (default 50; JSON lists all)")
    add_format_flag(d)
    d.set_defaults(run=run_diff)


def run_lint(args: argparse.Namespace) -> int:
    from engine.analysis import enumerate_inputs, lint

    ruleset = load_ruleset(args.dir, "DIR")
    start = time.perf_counter()
    views = [ScaleViews(v) for v in args.scale_views] if args.scale_views else None
    report = lint(ruleset, list(enumerate_inputs(ruleset, scale_views=views)))
    seconds = time.perf_counter() - start
    failed = bool(report.errors) or (args.strict and bool(report.warnings))
    if args.format == "json":
        print_json({**report.to_dict(), "seconds": round(seconds, 3), "ok": not failed})
        return EXIT_FAILED if failed else EXIT_OK
    for finding in report.findings:
        print(finding.render(args.max_inputs))
    counts = {sev: sum(1 for f in report.findings if f.severity == sev) for sev in ("error", "warning", "note")}
    print(f"lint: {report.inputs_checked} inputs, {report.rules} rules, {report.plans_verified} plans verified "
          f"in {seconds:.2f}s: {counts['error']} error(s), {counts['warning']} warning(s), {counts['note']} note(s)")
    return EXIT_FAILED if failed else EXIT_OK


def run_diff(args: argparse.Namespace) -> int:
    from engine.analysis import diff_rulesets

    try:  # exit 1 means "decisions change": a rule set that does not load is a usage error (2)
        old, new = load_ruleset(args.old, "OLD"), load_ruleset(args.new, "NEW")
    except RuleLoadError as exc:
        print_error(exc)
        return EXIT_USAGE
    report = diff_rulesets(old, new)
    if args.format == "json":
        print_json(report.to_dict())
        return EXIT_FAILED if report.changes else EXIT_OK
    print(f"diff: {report.inputs_checked} inputs checked, {len(report.changes)} decision(s) change")
    for key, n in report.counts().items():
        print(f"  {n:>6}  {key}")
    if report.changes:
        print()
    for change in report.changes[: args.max_changes]:
        print(change.render())
    if len(report.changes) > args.max_changes:
        print(f"... and {len(report.changes) - args.max_changes} more (--max-changes N, or --format json)")
    return EXIT_FAILED if report.changes else EXIT_OK
