"""`kvpolicy test`'s CI renderings and its coverage by layer and by file.

- ``--format junit``: JUnit XML as CI systems read it (`conftest test --output junit` is the model):
  ``<testsuites>`` of one ``<testsuite>`` per case file, a ``<testcase>`` per case with a
  ``<failure message=... type="policy-test">`` holding expected vs actual and the decision's
  ``fails`` explanation; then a ``coverage`` suite with one ``<testcase>`` per uncovered rule,
  ``<skipped>`` unless ``--require-coverage`` makes it a ``<failure>``. Files that do not load: an
  ``<error>`` per problem, at its file and line (`junit_error_xml`).
- ``--format github`` / ``sarif``: a failing case is an error at its file:line (code
  ``policy-test-failed``); an uncovered rule a warning at its file:line (an error when the
  threshold is not met), through the same printers as validate and lint.
- Coverage by layer and by file: which rules some case made match, counted per rule layer
  (shipped, operator) and per rule file, so an operator sees the file that lacks cases.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpolicy.policy.errors import Diagnostic, shown, shown_file

if TYPE_CHECKING:
    from kvpolicy.engine.policy_tests import CaseResult, TestRun
    from kvpolicy.policy.ruleset import RuleSet

__all__ = ["CoverageRow", "case_diagnostics", "coverage_breakdown", "coverage_percent", "junit_error_xml", "junit_xml"]


@dataclass(frozen=True)
class CoverageRow:
    """Rules matched by some case among the rules of one layer or one file."""

    name: str
    kind: str  # "shipped" / "operator" for a layer, "file" for a file
    covered: int
    total: int
    shipped: bool = False  # of the shipped layer (a file: of a shipped layer)

    @property
    def percent(self) -> float:
        return 100.0 if self.total == 0 else 100.0 * self.covered / self.total

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "matched": self.covered, "total": self.total,
                "percent": round(self.percent, 1)}

    def render(self) -> str:
        what = f" ({self.kind})" if self.kind != "file" else ""
        return f"  {shown_file(self.name)}{what}: {self.covered}/{self.total} ({self.percent:.0f}%)"


def coverage_percent(run: TestRun) -> float:
    """The covered share of the rules the run's coverage counts (an operator's layers, or all)."""
    cov = run.coverage
    return 100.0 if cov.total == 0 else 100.0 * (cov.total - len(cov.uncovered)) / cov.total


def coverage_breakdown(ruleset: RuleSet, results: Iterable[CaseResult]) -> tuple[list[CoverageRow], list[CoverageRow]]:
    """(by layer, bottom first; by file, sorted) over every rule of ``ruleset``, audit-mode ones included."""
    matched: set[str] = set()
    for r in results:
        matched |= r.covered
    layers: dict[str, list[int]] = {}
    kinds: dict[str, str] = {}
    files: dict[str, list[int]] = {}
    file_shipped: dict[str, bool] = {}
    for rule in ruleset.all_rules:
        layer = ruleset.layer_of(rule.id)
        root = layer.root if layer is not None else ruleset.root
        kinds[root] = "shipped" if layer is not None and layer.shipped else "operator"
        file_shipped[shown(rule.source.file)] = kinds[root] == "shipped"
        for table, key in ((layers, root), (files, shown(rule.source.file))):
            row = table.setdefault(key, [0, 0])
            row[0] += rule.id in matched
            row[1] += 1
    order = [layer.root for layer in ruleset.layers if layer.root in layers] or list(layers)
    by_layer = [CoverageRow(root, kinds[root], *layers[root], shipped=kinds[root] == "shipped") for root in order]
    by_file = [CoverageRow(name, "file", *row, shipped=file_shipped[name]) for name, row in sorted(files.items())]
    return by_layer, by_file


def _case_file_line(result: CaseResult) -> tuple[str, int]:
    return result.loaded.file, result.loaded.line


_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def _xml_safe(text: str) -> str:
    """``text`` with what XML 1.0 cannot hold (control characters, lone surrogates) written ``\\xNN``."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else
                        f"\\u{ord(m.group()):04x}", text)


def xml_document(root: ET.Element) -> str:
    """The one way a JUnit report becomes text: every attribute and text made XML-safe (an operator's names
    may hold control characters), indented, with its declaration."""
    for node in root.iter():
        node.attrib = {k: _xml_safe(v) for k, v in node.attrib.items()}
        if node.text:
            node.text = _xml_safe(node.text)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode")


def junit_xml(run: TestRun, *, coverage_fails: bool, render: Callable[[CaseResult], str]) -> str:
    """The run as JUnit XML: testsuites / testsuite per case file / testcase per case / failure (its text:
    ``render`` of the case, the report's own)."""
    suites: dict[str, list[CaseResult]] = {}
    for r in run.results:
        suites.setdefault(r.loaded.file, []).append(r)
    root = ET.Element("testsuites", name="kvpolicy test")
    n_tests = n_failures = 0
    for file, results in suites.items():
        failures = sum(not r.passed for r in results)
        suite = ET.SubElement(root, "testsuite", name=shown(file), tests=str(len(results)),
                              failures=str(failures), errors="0", skipped="0", time="0")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="ruleset", value=run.ruleset.root)
        ET.SubElement(props, "property", name="digest", value=run.ruleset.digest)
        for r in results:
            case = ET.SubElement(suite, "testcase", name=r.name, classname=shown(file), file=shown(file),
                                 line=str(r.loaded.line), time="0")
            if not r.passed:
                first = r.failures[0].splitlines()[0] if r.failures else "failed"
                failure = ET.SubElement(case, "failure", message=first, type="policy-test")
                failure.text = render(r)
        n_tests += len(results)
        n_failures += failures
    cov = run.coverage
    suite = ET.SubElement(root, "testsuite", name="coverage", tests=str(len(cov.uncovered)),
                          failures=str(len(cov.uncovered) if coverage_fails else 0), errors="0",
                          skipped=str(0 if coverage_fails else len(cov.uncovered)), time="0")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="coverage", value=f"{cov.total - len(cov.uncovered)}/{cov.total}")
    for rule in cov.uncovered:
        case = ET.SubElement(suite, "testcase", name=rule.id, classname="coverage", file=shown(rule.source.file),
                             line=str(rule.source.line), time="0")
        text = f"rule `{rule.id}` at {rule.source} is matched by no case"
        ET.SubElement(case, "failure" if coverage_fails else "skipped", message=text,
                      **({"type": "coverage"} if coverage_fails else {}))
    n_tests += len(cov.uncovered)
    n_failures += len(cov.uncovered) if coverage_fails else 0
    root.set("tests", str(n_tests))
    root.set("failures", str(n_failures))
    root.set("errors", "0")
    return xml_document(root)


def junit_error_xml(diagnostics: Iterable[Diagnostic], message: str, suite: str = "kvpolicy test") -> str:
    """Case files (or rules) that do not load, as JUnit XML: one ``<testsuite>`` per file, a ``<testcase>`` per
    problem holding an ``<error>`` (pytest and `conftest --output junit` report collection errors so), located
    at the file and line; a CI system shows the error instead of an empty report."""
    by_file: dict[str, list[Diagnostic]] = {}
    for d in diagnostics:
        by_file.setdefault(d.file, []).append(d)
    if not by_file:
        by_file["kvpolicy"] = [Diagnostic("kvpolicy", 0, 0, "error", message)]
    root = ET.Element("testsuites", name=suite, tests="0", failures="0", errors="0")
    n = 0
    for file, diags in by_file.items():
        suite = ET.SubElement(root, "testsuite", name=shown(file), tests=str(len(diags)), failures="0",
                              errors=str(len(diags)), skipped="0", time="0")
        for d in diags:
            case = ET.SubElement(suite, "testcase", name=f"{shown(file)}:{d.line}: {d.code}", classname=shown(file),
                                 file=shown(file), line=str(d.line), time="0")
            error = ET.SubElement(case, "error", message=d.message, type=d.code)
            error.text = d.render()
        n += len(diags)
    root.set("tests", str(n))
    root.set("errors", str(n))
    return xml_document(root)


def case_diagnostics(run: TestRun, *, coverage_fails: bool) -> list[tuple[str, Diagnostic]]:
    """Failing cases as errors at their file:line; uncovered rules as warnings (errors when required)."""
    out: list[tuple[str, Diagnostic]] = []
    for r in run.results:
        if not r.passed:
            file, line = _case_file_line(r)
            out.append(("error", Diagnostic(file, line, 1, "policy-test-failed",
                                            f"case `{r.name}` failed: " + "; ".join(
                                                " / ".join(x.strip() for x in f.splitlines()) for f in r.failures),
                                            "`kvpolicy test -v` shows the decision's explanation")))
    for rule in run.coverage.uncovered:
        out.append(("error" if coverage_fails else "warning",
                    Diagnostic(rule.source.file, rule.source.line, rule.source.col, "uncovered-rule",
                               f"rule `{rule.id}` is matched by no policy test case",
                               "add a case whose input makes it match (`kvpolicy dry-run ... --record-test FILE`)")))
    return out
