"""kvpolicy's engine: decide a KV cache layout, explain it, and drive memory.

The decision path (this package's import, `LayoutEngine.decide`) never
imports torch; the runtime (`LayoutEngine.build`, `engine.runtime`) does, lazily.
"""

from engine.decision import Decision
from engine.layout_engine import LayoutEngine, shipped_rules_dir
from engine.trace import (
    CandidateRemoved,
    Counterfactual,
    FieldChange,
    LayoutChosen,
    PreferenceApplied,
    RuleEvaluated,
    RuleRef,
)

__all__ = [
    "CandidateRemoved",
    "Counterfactual",
    "Decision",
    "FieldChange",
    "LayoutChosen",
    "LayoutEngine",
    "PreferenceApplied",
    "RuleEvaluated",
    "RuleRef",
    "shipped_rules_dir",
]
