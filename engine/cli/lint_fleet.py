"""``kvpolicy lint --fleet FILE``: lint the rules against exactly the deployments of a fleet file, one report.

The deployments are decided as ``dry-run --fleet`` decides them, each under its own release's rule stack
(the shipped rules, then ``DIR`` and each ``--rules``); `kvpolicy.engine.analysis.fleet_lint` finds what
bears on them. Findings about a deployment are located at its line in the fleet file (an invalid one at the
key that is wrong), findings about a rule at the rule, in every output format lint has.
"""

from __future__ import annotations

import argparse
import time

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    operator_dirs,
    print_diagnostics,
    print_json,
    report_error,
    usage_error,
)
from kvpolicy.engine.cli.fleet_report import open_fleet, rule_warnings, rules_for
from kvpolicy.engine.cli.operator_view import finding_diagnostic, own_lint_report, print_findings_text
from kvpolicy.policy.errors import RuleLoadError

__all__ = ["run_lint_fleet"]


def run_lint_fleet(args: argparse.Namespace) -> int:
    """``lint [DIR] --fleet FILE``."""
    from kvpolicy.engine.analysis.fleet_lint import lint_fleet
    from kvpolicy.engine.fleet import decide_fleet

    for flag, value in (("--scale-views", args.scale_views), ("--max-space", args.max_space)):
        if value:
            raise usage_error(flag, f"{flag} shapes a release's space; --fleet lints the fleet's deployments",
                              "drop it (a deployment sets `scale_views` itself), or lint without --fleet")
    fleet = open_fleet(args)
    if fleet is None:
        return EXIT_USAGE
    start = time.perf_counter()
    rules = rules_for(args, operator_dirs(args, "dir"), "DIR" if args.dir is not None else "--rules")
    try:
        results = decide_fleet(fleet, rules, args.vllm_version)
        report = lint_fleet(fleet, results, rules)
    except RuleLoadError as exc:
        report_error(exc, args.format)
        return EXIT_FAILED
    seconds = time.perf_counter() - start
    some = rules(report.profiles[0]) if report.profiles else None
    report, left_out = own_lint_report(report, some, args.include_shipped) if some is not None else (report, 0)
    failed = bool(report.errors) or (args.strict and bool(report.warnings))
    if args.format in ("github", "sarif"):
        print_diagnostics([(f.severity, finding_diagnostic(f, args.fleet)) for f in report.findings], args.format,
                          some)
    elif args.format == "json":
        print_json({**report.to_dict(), "seconds": round(seconds, 3), "ok": not failed,
                    "shipped_findings_left_out": left_out, "rule_warnings": rule_warnings(args)})
    else:
        print_findings_text(report, args)
        counts = {sev: sum(f.severity == sev for f in report.findings) for sev in ("error", "warning", "note")}
        print(f"lint: fleet {args.fleet}, {report.deployments} deployments over {len(report.profiles)} release "
              f"profile(s), {report.rules} rules, {report.plans_verified} plans verified in {seconds:.2f}s: "
              f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['note']} note(s)"
              + (f"; {left_out} about the shipped rules left out (--include-shipped)" if left_out else ""))
    return EXIT_FAILED if failed else EXIT_OK
