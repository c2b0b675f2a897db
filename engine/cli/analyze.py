"""``kvpolicy lint [DIR]`` and ``kvpolicy diff OLD NEW``: a rule set over every input it could see."""

from __future__ import annotations

import argparse
import sys
import time

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    add_format_flag,
    add_rules_flag,
    add_vllm_version_flag,
    check_vllm_version,
    int_at_least,
    load_ruleset,
    operator_dirs,
    print_diagnostics,
    print_json,
    report_error,
)
from kvpolicy.engine.cli.fleet_report import add_fleet_flag, run_fleet_diff
from kvpolicy.engine.cli.operator_view import finding_diagnostic, own_lint_report, print_findings_text
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.errors import RuleLoadError

__all__ = ["register"]

_LINT_EPILOG = """\
examples:
  kvpolicy lint                         # the shipped rules of the default release profile
  kvpolicy lint --vllm-version issue-48412
      the #48412 development state: the per-token-head guard is a safety rule there
  kvpolicy lint my-rules/ --vllm-version 0.34.0 --strict
      an operator's rules (on top of vLLM 0.34's shipped rules) over its inputs; warnings fail too
  kvpolicy lint --rules base/ --rules site/ --no-shipped-rules
      two layers that replace the shipped rules
  kvpolicy lint --vllm-version issue-48412 --scale-views stride_aware
      what if the backends built stride-aware scale views: which forbids stop protecting bytes
  kvpolicy lint my-rules/ --format github       # findings on your layer's files as CI annotations
  kvpolicy lint my-rules/ --format sarif > kvpolicy.sarif
  kvpolicy lint my-rules/ --include-shipped     # the shipped rules' findings too
  kvpolicy lint my-rules/ --fleet fleet.yaml    # against exactly the deployments of a fleet file
  kvpolicy lint my-rules/ --fleet fleet.yaml --format github
      findings at the fleet file's deployment lines and at your rules, as CI annotations

the space: every input the profile's decision reads (its backends, kv_cache_dtypes,
device capabilities, VLLM_KV_CACHE_LAYOUT, extensible KV cache, HiSparse, group shapes,
connectors and MultiConnector pairs), values no rule tells apart counted once; its size
is printed

findings: error[unsafe-permit] the rules choose a layout whose views overlap (the inputs
are listed); error[conflict] no layout survives where the profile's shipped rules choose
one (located at each of your rules taking part); warning[dead-rule] no input makes the
rule match; note[release-refuses] no layout survives, as with the shipped rules (the
release refuses to start); note[not-load-bearing] deleting the forbid/require changes nothing

text output folds near-identical inputs into lines (5 per finding) and summarises a field of
many values (connector=<43 values: A, B, C, ...>); --verbose lists every value, JSON every input

--fleet FILE: findings about each deployment at its fleet line (invalid-deployment, conflict,
release-refuses, unsafe-permit, not-planned), about each rule at the rule (dead-rule,
not-load-bearing, audit), load-bearing counted in deployments

load-bearing: each forbid/require is `safety` (deleting it lets an unsafe layout through),
`decision` (deleting it changes decisions, all to safe layouts) or `no`

exit codes: 0 no errors, 1 errors (or warnings with --strict), 2 usage error
"""

_DIFF_EPILOG = """\
examples:
  kvpolicy diff shipped my-rules/                          # what my layer changes, and why
      each side is the shipped rules + --rules DIR... + OLD (NEW); `shipped` names the
      profile's shipped rules (wherever a rule directory is accepted) and adds no layer
  kvpolicy diff shipped my-rules/ --vllm-version issue-48412
  kvpolicy diff shipped my-rules/ --format json | jq .counts

output: a summary (the profile, inputs checked, decisions changed, counts per old -> new),
then each changed input with the rules responsible on each side

exit codes: 0 no decision changes, 1 some decisions change, 2 usage error
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "lint", help="check a rule set over a vLLM release's inputs: unsafe permits, conflicts, "
                     "dead rules, load-bearing forbids",
        description="Enumerate a vLLM release profile's inputs around the rules' literals and check the decision "
                    "for each against the geometry verifier; report, for every forbid and require, whether "
                    "it is load-bearing.",
        epilog=_LINT_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("dir", nargs="?", metavar="DIR",
                   help="a rule directory, layered on the shipped rules of the release profile like --rules "
                        "(default: the shipped rules alone)")
    add_rules_flag(p)
    add_vllm_version_flag(p)
    p.add_argument("--scale-views", choices=[s.value for s in ScaleViews], action="append",
                   help="model the backends' inline-scale views with this strategy instead of the profile's "
                        "(repeatable: each is a copy of the space)")
    p.add_argument("--strict", action="store_true", help="warnings fail the lint too")
    p.add_argument("--include-shipped", action="store_true",
                   help="with DIR or --rules: report the shipped rules' findings and load-bearing lines too (default: "
                        "only your layers'; a finding about the whole rule set is always reported)")
    p.add_argument("--max-inputs", type=int_at_least(0), default=None, metavar="N",
                   help="lines of inputs listed per finding in text output (default 5, with --verbose 20; JSON "
                        "lists all)")
    p.add_argument("--verbose", action="store_true",
                   help="text output: list every value of a folded input line, and 20 lines per finding (default: "
                        "a field of more than 6 values, such as 30 connector combinations, shows their count and "
                        "the first 3; 5 lines per finding)")
    add_max_space_flag(p)
    add_format_flag(p, ci=True)
    p.add_argument("--fleet", metavar="FILE", default=None,
                   help="lint the rules against exactly the deployments of this fleet file (docs/cli.md), each "
                        "under its own release's rules, instead of over the profile's space")
    p.set_defaults(run=run_lint)

    d = verbs.add_parser(
        "diff", help="list every input whose decision changes between two rule sets, and why",
        description="Decide every input of a vLLM release profile's space with both rule sets and list each "
                    "input whose layout changes, with the rules responsible on each side. A summary comes first.",
        epilog=_DIFF_EPILOG, formatter_class=HelpFormatter)
    d.add_argument("old", metavar="OLD", help="the rule directory before the change")
    d.add_argument("new", metavar="NEW", help="the rule directory after the change")
    add_rules_flag(d)
    add_vllm_version_flag(d)
    d.add_argument("--max-changes", type=int_at_least(0), default=50, metavar="N",
                   help="changed inputs shown in text output (default 50; JSON lists all)")
    add_max_space_flag(d)
    add_format_flag(d)
    add_fleet_flag(d, dry_run=False)
    d.set_defaults(run=run_diff)


def add_max_space_flag(p: argparse.ArgumentParser) -> None:
    # the default is resolved when the verb runs, so that building the parser imports no analysis module
    p.add_argument("--max-space", type=int_at_least(1, 100_000_000), default=None, metavar="N",
                   help="the most inputs the space may hold (default 300000: "
                        "kvpolicy.engine.analysis.budget.DEFAULT_MAX_INPUTS; at most 100000000), of up to 200 "
                        "rules each: more rules "
                        "get proportionally fewer inputs (the work is inputs x rules); past it, variants that set "
                        "several fields together, then single literals, are left out, and the output says so "
                        "(docs/cli.md)")


def max_space(args: argparse.Namespace) -> int:
    from kvpolicy.engine.analysis.budget import DEFAULT_MAX_INPUTS

    return DEFAULT_MAX_INPUTS if args.max_space is None else args.max_space


def run_lint(args: argparse.Namespace) -> int:
    from kvpolicy.engine.analysis import lint
    from kvpolicy.policy.releases import get_profile

    if args.fleet is not None:
        from kvpolicy.engine.cli.lint_fleet import run_lint_fleet

        return run_lint_fleet(args)
    ruleset = load_ruleset(operator_dirs(args, "dir"), "DIR", vllm_version=args.vllm_version,
                           shipped_rules=not args.no_shipped_rules)
    profile = get_profile(args.vllm_version)
    start = time.perf_counter()
    views = [ScaleViews(v) for v in args.scale_views] if args.scale_views else None
    report = lint(ruleset, vllm_version=profile, scale_views=views, max_inputs=max_space(args))
    seconds = time.perf_counter() - start
    report, left_out = own_lint_report(report, ruleset, args.include_shipped)
    failed = bool(report.errors) or (args.strict and bool(report.warnings))
    if args.format in ("github", "sarif"):
        root = ruleset.root or "rules"
        print_diagnostics([(f.severity, finding_diagnostic(f, root)) for f in report.findings], args.format,
                          ruleset)
        return EXIT_FAILED if failed else EXIT_OK
    if args.format == "json":
        print_json({**report.to_dict(), "seconds": round(seconds, 3), "ok": not failed,
                    "shipped_findings_left_out": left_out,
                    "rule_warnings": [d.to_dict() for d in ruleset.warnings]})  # what the text prints on stderr
        return EXIT_FAILED if failed else EXIT_OK
    print_findings_text(report, args)
    assert report.space is not None
    print(f"space: {report.space.describe()}")
    counts = {sev: sum(1 for f in report.findings if f.severity == sev) for sev in ("error", "warning", "note")}
    print(f"lint: {report.inputs_checked} inputs of {report.profile}, {report.rules} rules, "
          f"{report.plans_verified} plans verified in {seconds:.2f}s: {counts['error']} error(s), "
          f"{counts['warning']} warning(s), {counts['note']} note(s)"
          + (f"; {left_out} about the shipped rules left out (--include-shipped)" if left_out else ""))
    return EXIT_FAILED if failed else EXIT_OK


def run_diff(args: argparse.Namespace) -> int:
    from kvpolicy.engine.analysis import diff_rulesets
    from kvpolicy.policy.releases import get_profile

    check_vllm_version(args.vllm_version)
    if args.fleet is not None:
        return run_fleet_diff(args)
    try:  # exit 1 means "decisions change": a rule set that does not load is a usage error (2)
        shared = list(args.rules or [])  # layers under both sides, on the shipped rules
        old = load_ruleset([*shared, args.old], "OLD", vllm_version=args.vllm_version,
                           shipped_rules=not args.no_shipped_rules)
        new = load_ruleset([*shared, args.new], "NEW", vllm_version=args.vllm_version,
                           shipped_rules=not args.no_shipped_rules)
    except RuleLoadError as exc:
        report_error(exc, args.format)
        return EXIT_USAGE
    report = diff_rulesets(old, new, vllm_version=get_profile(args.vllm_version), max_inputs=max_space(args))
    if report.space is not None and report.space.cut is not None:
        print(f"warning: the space was {report.space.cut.describe()}: changes among the left-out inputs are not "
              "listed; raise --max-space to explore more", file=sys.stderr)
    if args.format == "json":  # the rule sets' warnings, as the text prints them on stderr (each once)
        said = {d.render(): d.to_dict() for d in (*old.warnings, *new.warnings)}
        print_json({**report.to_dict(), "warnings": list(said.values())})
        return EXIT_FAILED if report.changes else EXIT_OK
    print(f"diff: {report.inputs_checked} inputs of {report.profile} checked, "
          f"{len(report.changes)} decision(s) change")
    for key, n in report.counts().items():
        print(f"  {n:>6}  {key}")
    if report.changes:
        print()
    for change in report.changes[: args.max_changes]:
        print(change.render())
    if len(report.changes) > args.max_changes:
        print(f"... and {len(report.changes) - args.max_changes} more (--max-changes N, or --format json)")
    if report.space is not None:
        print(f"space: {report.space.describe()}")
    return EXIT_FAILED if report.changes else EXIT_OK
