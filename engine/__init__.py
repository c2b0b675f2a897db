"""kvpolicy's engine: decide a KV cache layout, explain it, and drive memory.

The decision path (this package's import, `LayoutEngine.decide`) never
imports torch; the runtime (`LayoutEngine.build`, `kvpolicy.engine.runtime`) does, lazily.
"""

from typing import TYPE_CHECKING, Any

from kvpolicy.engine.decision import Decision
from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint_of
from kvpolicy.engine.layout_engine import LayoutEngine, shipped_rules_dir
from kvpolicy.engine.trace import (
    CandidateRemoved,
    Counterfactual,
    FieldChange,
    LayoutChosen,
    PreferenceApplied,
    RuleEvaluated,
    RuleRef,
)

if TYPE_CHECKING:
    from kvpolicy.engine.agreement import (
        AgreementError,
        CompatibilityResult,
        LayoutMismatchError,
        agree,
        check_compatible,
        require_compatible,
    )

# Rank and peer agreement is not on the decision path (the CLI never needs it): loaded on first use.
_LAZY = {name: "kvpolicy.engine.agreement" for name in ("AgreementError", "CompatibilityResult", "LayoutMismatchError",
                                               "agree", "check_compatible", "require_compatible")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvpolicy.engine' has no attribute {name!r}")


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
