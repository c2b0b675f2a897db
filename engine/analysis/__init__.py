"""Policy analysis over a release profile's whole input space: lint, diff."""

from kvpolicy.engine.analysis.diff import DecisionChange, DiffReport, diff_rulesets
from kvpolicy.engine.analysis.lint import Finding, LintReport, LoadBearing, lint, shipped_ruleset
from kvpolicy.engine.analysis.space import AnalysisInput, Space, build_space, enumerate_inputs

__all__ = [
    "AnalysisInput",
    "DecisionChange",
    "DiffReport",
    "Finding",
    "LintReport",
    "LoadBearing",
    "Space",
    "build_space",
    "diff_rulesets",
    "enumerate_inputs",
    "lint",
    "shipped_ruleset",
]
