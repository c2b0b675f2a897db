"""``kvpolicy validate FILE`` and ``validate -``: one rule file checked on its own, then against the shipped rules.

`opa check file.rego` and `conftest verify` take a single file; an editor or a pre-commit hook
checks the file it just saved, and a generator pipes its output in (``-``: stdin). A file alone
has no directory to say whether it holds connector rules: a file under a ``connectors/`` directory
is one, else the file's own ``connector:`` key decides. Then the file is layered on the shipped
rules of the release profile (unless ``--no-shipped-rules``), so an id that collides with a shipped
rule is reported as it would be in a rule directory.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    load_ruleset,
    print_diagnostics,
    print_json,
    report_error,
    usage_error,
)
from kvpolicy.policy.errors import RuleLoadError, shown_file
from kvpolicy.policy.files import read_capped, read_stdin_capped
from kvpolicy.policy.layers import render_warning, with_warnings
from kvpolicy.policy.load import Limits, load_rule_file
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["STDIN", "is_single_file", "lapsed_waivers", "run_file"]

STDIN = "-"


def is_single_file(path: str | None) -> bool:
    """Whether validate's DIR names one file (or ``-``, stdin) rather than a rule directory."""
    return path is not None and (path == STDIN or Path(path).is_file())


def _read(args: argparse.Namespace) -> tuple[str, str, bool | None]:
    """(text, shown name, connector file?) of the file or stdin validate was given."""
    if args.dir == STDIN:
        shown = args.stdin_filename or "<stdin>"
        text, diags = read_stdin_capped(sys.stdin, shown, Limits().max_file_bytes)
    else:
        shown = args.dir
        text, diags = read_capped(Path(args.dir), shown, Limits().max_file_bytes)
    if text is None:
        raise RuleLoadError(f"cannot read `{shown}`", diags)
    connector = True if Path(shown).parent.name == "connectors" else None
    return text, shown, connector


def _layered(ruleset: RuleSet, args: argparse.Namespace) -> RuleSet:
    """The file's rules on top of the shipped rules (and any --rules): collisions across layers are errors.
    The layers below print their own warnings on stderr as they load (``args.said_below`` keeps them)."""
    from kvpolicy.policy.layers import compose_layers, render_warning

    below = load_ruleset(args.rules, vllm_version=args.vllm_version, shipped_rules=not args.no_shipped_rules) \
        if (args.rules or not args.no_shipped_rules) else None
    if below is None:  # the file alone: its waivers name rules of this file only
        from kvpolicy.policy.waivers import waiver_problems

        errors, lapsed = waiver_problems(ruleset)
        if errors:
            raise RuleLoadError(f"{len(errors)} error(s) in rule file `{shown_file(ruleset.root)}`", errors)
        return replace(ruleset, warnings=(*ruleset.warnings, *lapsed))
    args.said_below = {render_warning(d) for d in below.warnings}
    from kvpolicy.engine.rule_layers import shipped_elsewhere

    return compose_layers([(below, not args.rules), (ruleset, False)], shipped_elsewhere)


def lapsed_waivers(ruleset: RuleSet) -> None:
    """Raise a `RuleLoadError` of every lapsed waiver (``expired-waiver``), the other warnings with it.

    Every other verb warns and decides without the waiver (the rule it named applies again); validate is the
    gate CI runs before a deploy, so a waiver that lapsed (a decision that changed without a commit) fails it:
    renew it after review, or delete it."""
    lapsed = [d for d in ruleset.warnings if d.code == "expired-waiver"]
    if lapsed:
        raise with_warnings(RuleLoadError(f"{len(lapsed)} expired waiver(s) in rule set `{shown_file(ruleset.root)}`",
                                          lapsed), [d for d in ruleset.warnings if d.code != "expired-waiver"])


def run_file(args: argparse.Namespace) -> int:
    """Validate one file (or stdin); the same output and exit codes as a directory."""
    if args.dir != STDIN and args.stdin_filename is not None:
        raise usage_error("--stdin-filename", "applies to `validate -` only", "drop it, or read the file from stdin")
    try:
        text, shown, connector = _read(args)
        try:
            alone = load_rule_file(text, shown, connector_file=connector)
        except RuleLoadError as exc:  # the warnings of its valid rules, layered as the file would be, said too
            partial = getattr(exc, "partial", None)
            if partial is not None and partial.all_rules:
                try:
                    with_warnings(exc, _layered(partial, args).warnings)
                except RuleLoadError as below:
                    with_warnings(exc, getattr(below, "warnings", ()))
            raise
        layered = _layered(alone, args)
        lapsed_waivers(layered)
    except RuleLoadError as exc:
        report_error(exc, args.format)
        return EXIT_FAILED
    what = "connector file" if alone.connectors or connector else "global file"
    if args.format in ("github", "sarif"):
        print_diagnostics([("warning", d) for d in layered.warnings], args.format, layered)
    elif args.format == "json":
        print_json({"ok": True, "rules": len(alone.all_rules), "files": 1, "digest": alone.digest, "root": shown,
                    "kind": what.split()[0], "layers": [layer.to_dict() for layer in layered.layers],
                    "warnings": [d.to_dict() for d in layered.warnings]})
    else:  # the file's own warnings on stderr, as a rule directory's are (those below were said as they loaded)
        said = getattr(args, "said_below", set())
        for line in dict.fromkeys(render_warning(d) for d in layered.warnings):
            if line not in said:
                print(line, file=sys.stderr)
        below = ("" if layered.root == alone.root
                 else f", layered on {layered.root.rsplit(' + ', 1)[0]} without conflict")
        print(f"ok: {len(alone.all_rules)} rules in 1 file, a {what} (digest {alone.digest}){below}")
    return EXIT_OK
