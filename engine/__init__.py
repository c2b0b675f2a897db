"""kvpolicy's engine: decide a KV cache layout, explain it, and drive memory.

The decision path (this package's import, `LayoutEngine.decide`) never
imports torch; the runtime (`LayoutEngine.build`, `engine.runtime`) does, lazily.
"""

from engine.agreement import (
    AgreementError,
    CompatibilityResult,
    LayoutMismatchError,
    agree,
    check_compatible,
    require_compatible,
)
from engine.decision import Decision
from engine.fingerprint import LayoutFingerprint, fingerprint_of
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
    "AgreementError",
    "CandidateRemoved",
    "CompatibilityResult",
    "Counterfactual",
    "Decision",
    "FieldChange",
    "LayoutChosen",
    "LayoutEngine",
    "LayoutFingerprint",
    "LayoutMismatchError",
    "PreferenceApplied",
    "RuleEvaluated",
    "RuleRef",
    "agree",
    "check_compatible",
    "fingerprint_of",
    "require_compatible",
    "shipped_rules_dir",
]
