"""``kvpolicy validate [DIR]``: load a rule directory and report every problem, located."""

from __future__ import annotations

import argparse
import io
import sys

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    add_format_flag,
    add_rules_flag,
    add_vllm_version_flag,
    check_vllm_version,
    expand_rule_dirs,
    load_ruleset,
    operator_dirs,
    print_diagnostics,
    print_json,
    report_error,
    shipped_roots,
)
from kvpolicy.engine.cli.rule_file import is_single_file, lapsed_waivers, run_file
from kvpolicy.policy.errors import RuleLoadError, shown_file
from kvpolicy.policy.load import rule_files

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  kvpolicy validate                 # the shipped rules of the default release profile
  kvpolicy validate --vllm-version issue-48412   # the shipped rules of that profile
  kvpolicy validate my-rules/       # an operator's rule directory, on top of the shipped rules
  kvpolicy validate --rules base/ --rules site/   # two layers on the shipped rules, bottom first
  kvpolicy validate my-rules/ --no-shipped-rules  # my-rules/ alone: warns for each load-bearing guard dropped
  kvpolicy validate my-rules/ --format json
  kvpolicy validate my-rules/ --format github    # annotations on the pull request's files
  kvpolicy validate my-rules/ --format sarif > kvpolicy.sarif
  kvpolicy validate my-rules/connectors/NixlConnector.yaml   # one file, then layered on the shipped rules
  generate-rules | kvpolicy validate - --stdin-filename my-rules/global.yaml   # a file on stdin

output: each problem as `file:line:col: error[code]: message` with a `help:` line, on
stderr; when clean, one line on stdout: `ok: N rules in M files (digest sha256:...)`, then one
line per layer when there are several; warnings (`warning[code]`) on stderr do not fail

waivers: a waiver past its `expires` (read against --today, KVPOLICY_TODAY or the clock) is an
error here (`expired-waiver`), a warning for every other verb, which decide as if it were gone

exit codes: 0 the rules load cleanly, 1 they do not (or a waiver has expired), 2 usage error
(DIR does not exist, or is not a directory; an unknown flag)
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "validate", help="check a rule directory and print every error with its file:line:col",
        description="Load a rule directory (global *.yaml and connectors/*.yaml) as the engine would: YAML "
                    "syntax, the rule schema, field names and value types, duplicate ids. Every problem is "
                    "reported, not just the first.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("dir", nargs="?", metavar="DIR",
                   help="a rule directory, layered on the shipped rules of the release profile like --rules "
                        "(default: the shipped rules alone); or one rule file, or `-` for a file on stdin")
    p.add_argument("--stdin-filename", metavar="PATH", default=None,
                   help="with `validate -`: the name to locate errors at (under connectors/: a connector file)")
    add_rules_flag(p)
    add_vllm_version_flag(p)
    add_format_flag(p, ci=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_vllm_version(args.vllm_version)
    if is_single_file(args.dir) or args.stdin_filename is not None:
        return run_file(args)
    dirs = operator_dirs(args, "dir")
    said = io.StringIO()  # the load's warnings, said below unless a lapsed waiver fails the run
    try:
        ruleset = load_ruleset(dirs, "DIR" if args.dir is not None else "--rules", vllm_version=args.vllm_version,
                               shipped_rules=not args.no_shipped_rules, stream=said)
        lapsed_waivers(ruleset)
    except RuleLoadError as exc:
        report_error(exc, args.format)
        return EXIT_FAILED
    sys.stderr.write(said.getvalue())
    roots = (list(shipped_roots(args.vllm_version)) if not args.no_shipped_rules else []) + \
        expand_rule_dirs(dirs, args.vllm_version)[0]
    files = sum(len(rule_files(r)) for r in dict.fromkeys(r.resolve() for r in roots))
    if args.format in ("github", "sarif"):
        print_diagnostics([("warning", d) for d in ruleset.warnings], args.format, ruleset)
    elif args.format == "json":
        print_json({"ok": True, "rules": len(ruleset.all_rules), "files": files, "digest": ruleset.digest,
                    "root": ruleset.root, "layers": [layer.to_dict() for layer in ruleset.layers],
                    "warnings": [d.to_dict() for d in ruleset.warnings]})
    else:
        print(f"ok: {len(ruleset.all_rules)} rules in {files} files (digest {ruleset.digest})")
        if len(ruleset.layers) > 1:
            for i, layer in enumerate(ruleset.layers):
                kind = "shipped" if layer.shipped else "operator"
                print(f"  layer {i}: {shown_file(layer.root)} ({kind}, {len(layer.rule_ids)} rules, "
                      f"digest {layer.digest})")
    return EXIT_OK
