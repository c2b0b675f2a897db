"""What a report shows an operator who owns layers on top of the shipped rules, and where CI annotations point.

An operator's ``lint my-layer/`` or ``validate my-layer/`` is about ``my-layer/``: findings located at a
shipped rule (and the notes about what the release itself does, ``release-fails`` and ``release-refuses``)
are left out, counted, unless ``--include-shipped`` asks for them. A rule set of shipped layers only (no
DIR, no --rules) shows everything, as before.

Locations in ``--format github`` and ``sarif`` are repository paths relative to the working directory
(an absolute path under it is made relative); a finding about the whole rule set (no rule) is located at
the topmost operator layer's directory, never at the rule set's display name (``rules/vllm-0.34 + site``),
which is no path. A shipped rule file is not in the operator's repository: SARIF names it relative to
the base ``KVPOLICY_SHIPPED`` (``vllm-0.34/global.yaml``), a stable name a viewer can resolve; a GitHub
annotation carries no ``file`` for it and says ``rules/vllm-0.34/global.yaml:12`` in its message.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpolicy.policy.errors import Diagnostic
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["SHIPPED_BASE", "ci_diagnostic", "finding_diagnostic", "is_shipped_file", "own_lint_report",
           "print_findings_text", "shipped_prefixes"]

SHIPPED_BASE = "KVPOLICY_SHIPPED"
# notes about what the release does with its shipped rules, not about an operator's layer
_RELEASE_NOTES = frozenset({"release-fails", "release-refuses"})


def shipped_prefixes(ruleset: RuleSet) -> tuple[str, ...]:
    """The shipped layers' roots as shown (``rules/vllm-0.34``), each ending in ``/``."""
    return tuple(layer.root.rstrip("/") + "/" for layer in ruleset.layers if layer.shipped)


def is_shipped_file(file: str, ruleset: RuleSet) -> bool:
    return any(file.startswith(p) for p in shipped_prefixes(ruleset))


def own_lint_report(report: Any, ruleset: RuleSet, include_shipped: bool) -> tuple[Any, int]:
    """``report`` (a `LintReport`) with only the findings and load-bearing lines about the operator's layers,
    and how many findings were left out; unchanged when asked for everything or when no layer is the
    operator's."""
    own = [layer for layer in ruleset.layers if not layer.shipped]
    if include_shipped or not own:
        return report, 0
    ids = frozenset().union(*(layer.rule_ids for layer in own))
    kept = tuple(f for f in report.findings if (f.rule.id in ids if f.rule is not None  # a fleet's deployment: kept
                                                 else getattr(f, "at", None) is not None
                                                 or f.code not in _RELEASE_NOTES))
    bearing = tuple(lb for lb in report.load_bearing if lb.rule.id in ids)
    return replace(report, findings=kept, load_bearing=bearing), len(report.findings) - len(kept)


def _relative(file: str) -> str:
    """An absolute path under the working directory as a path relative to it (what CI systems resolve)."""
    if not os.path.isabs(file):
        return file
    try:
        return Path(file).relative_to(Path.cwd()).as_posix()
    except ValueError:
        return file


def ci_diagnostic(d: Diagnostic, ruleset: RuleSet | None, fmt: str) -> tuple[Diagnostic, dict[str, Any]]:
    """``d`` located as ``fmt`` (github, sarif) should show it, with extra SARIF location fields
    (``uriBaseId``) for a shipped file."""
    if ruleset is None:
        return replace(d, file=_relative(d.file)) if d.file else d, {}
    if d.file == ruleset.root and len(ruleset.layers) > 1:  # the rule set's display name: no path
        own = [layer.root for layer in ruleset.layers if not layer.shipped]
        return replace(d, file=_relative(own[-1]) if own else ""), {}
    for prefix in shipped_prefixes(ruleset):
        if d.file.startswith(prefix):
            if fmt == "sarif":
                return replace(d, file=d.file[len("rules/"):] if d.file.startswith("rules/") else d.file), \
                    {"uriBaseId": SHIPPED_BASE}
            where = f"{d.file}:{d.line}" if d.line > 0 else d.file
            return replace(d, file="", line=0, col=0, message=f"{d.message} (shipped rule at {where})"), {}
    return replace(d, file=_relative(d.file)) if d.file else d, {}


def ci_findings(findings: Iterable[tuple[str, Diagnostic]], ruleset: RuleSet | None,
                fmt: str) -> list[tuple[str, Diagnostic, dict[str, Any]]]:
    """Every (severity, diagnostic) located for ``fmt``, with its SARIF location extras."""
    out = []
    for severity, d in findings:
        shown, extra = ci_diagnostic(d, ruleset, fmt)
        out.append((severity, shown, extra))
    return out


def finding_diagnostic(finding: Any, root: str) -> Diagnostic:
    """A lint finding located at its rule (or, for a finding about no one rule, at the rule set), with the
    count of inputs and the first of them in the message."""
    if finding.rule is not None:
        file, line, col = finding.rule.source.file, finding.rule.source.line, finding.rule.source.col
    elif finding.at is not None:  # a fleet's deployment
        file, line, col = finding.at.file, finding.at.line, finding.at.col
    else:
        file, line, col = root, 0, 0
    message = finding.message
    if finding.inputs:
        message += f" (e.g. {finding.inputs[0]})"
    return Diagnostic(file, line, col, finding.code, message)


def print_findings_text(report: Any, args: argparse.Namespace) -> None:
    """A lint report's findings (``--max-inputs`` lines each; 5, or 20 with ``--verbose``) and its
    load-bearing section, as text: a release's space and a fleet alike."""
    shown = args.max_inputs if args.max_inputs is not None else (20 if args.verbose else 5)
    for finding in report.findings:
        print(finding.render(shown, verbose=args.verbose))
    if report.findings:
        print()
    print(report.render_load_bearing())
    print()
