"""Policy analysis over the whole input space: lint, diff."""

from engine.analysis.diff import DecisionChange, DiffReport, diff_rulesets
from engine.analysis.lint import Finding, LintReport, lint
from engine.analysis.space import AnalysisInput, enumerate_inputs

__all__ = [
    "AnalysisInput",
    "DecisionChange",
    "DiffReport",
    "Finding",
    "LintReport",
    "diff_rulesets",
    "enumerate_inputs",
    "lint",
]
