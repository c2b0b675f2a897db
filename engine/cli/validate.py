"""``kvpolicy validate [DIR]``: load a rule directory and report every problem, located."""

from __future__ import annotations

import argparse

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    add_format_flag,
    add_vllm_version_flag,
    check_vllm_version,
    print_diagnostics,
    print_json,
    report_error,
    rules_root,
    usage_error,
)
from kvpolicy.policy.errors import RuleLoadError
from kvpolicy.policy.load import load_rules, rule_files

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  kvpolicy validate                 # the shipped rules of the default release profile
  kvpolicy validate --vllm-version issue-48412   # the shipped rules of that profile
  kvpolicy validate my-rules/       # an operator's rule directory
  kvpolicy validate my-rules/ --format json
  kvpolicy validate my-rules/ --format github    # annotations on the pull request's files
  kvpolicy validate my-rules/ --format sarif > kvpolicy.sarif

output: each problem as `file:line:col: error[code]: message` with a `help:` line, on
stderr; when clean, one line on stdout: `ok: N rules in M files (digest sha256:...)`

exit codes: 0 the rules load cleanly, 1 they do not, 2 usage error (DIR does not exist, or is not a
directory; an unknown flag)
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "validate", help="check a rule directory and print every error with its file:line:col",
        description="Load a rule directory (global *.yaml and connectors/*.yaml) as the engine would: YAML "
                    "syntax, the rule schema, field names and value types, duplicate ids. Every problem is "
                    "reported, not just the first.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("dir", nargs="?", metavar="DIR",
                   help="the rule directory (default: the shipped rules of the release profile)")
    add_vllm_version_flag(p)
    add_format_flag(p, ci=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_vllm_version(args.vllm_version)
    root, shown = rules_root(args.dir, args.vllm_version)
    if args.dir == "" or not root.is_dir():  # nothing to validate: a usage error (2), as for every verb
        what = "does not exist" if args.dir == "" or not root.exists() else "is not a directory"
        raise usage_error("DIR", f"`{shown}` {what}", "pass the rule directory: global *.yaml and connectors/")
    try:
        ruleset = load_rules(root, display=shown)
    except RuleLoadError as exc:
        report_error(exc, args.format)
        return EXIT_FAILED
    files = len(rule_files(root))
    if args.format in ("github", "sarif"):
        print_diagnostics([], args.format)
    elif args.format == "json":
        print_json({"ok": True, "rules": len(ruleset.rules), "files": files, "digest": ruleset.digest,
                    "root": ruleset.root})
    else:
        print(f"ok: {len(ruleset.rules)} rules in {files} files (digest {ruleset.digest})")
    return EXIT_OK
