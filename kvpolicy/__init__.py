"""kvpolicy: declarative, verified KV cache layouts for LLM serving engines.

The names a user needs, in one place::

    from kvpolicy import LayoutEngine
    engine = LayoutEngine.default()            # the shipped rules of the default vLLM profile
    decision = engine.decide(model="config.json", kv_cache_dtype="fp8_per_token_head")
    print(decision.explain())

The implementation lives in `kvpolicy.policy` (the rule language and its input
models; never imports torch) and `kvpolicy.engine` (decision, geometry, runtime,
CLI). This module only re-exports; importing it never imports torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpolicy.engine import (
        CandidateRemoved,
        Counterfactual,
        Decision,
        FieldChange,
        LayoutChosen,
        LayoutEngine,
        LayoutFingerprint,
        PreferenceApplied,
        RuleEvaluated,
        RuleRef,
        fingerprint_of,
        shipped_rules_dir,
    )
    from kvpolicy.engine.agreement import (
        AgreementError,
        CompatibilityResult,
        LayoutMismatchError,
        agree,
        check_compatible,
        require_compatible,
    )
    from kvpolicy.policy import (
        ConnectorConfig,
        Context,
        Diagnostic,
        GeometryError,
        HeadOrder,
        InputError,
        KVCacheGroup,
        KVCacheGroups,
        KVCacheSpec,
        Layout,
        Limits,
        MissingDependencyError,
        ModelConfigError,
        NoLayoutError,
        Placement,
        PolicyError,
        QuantMode,
        RuleLoadError,
        RuleSet,
        load_rules,
    )

_POLICY = frozenset({"ConnectorConfig", "Context", "Diagnostic", "GeometryError", "HeadOrder", "InputError",
                     "KVCacheGroup", "KVCacheGroups", "KVCacheSpec", "Layout", "Limits", "MissingDependencyError",
                     "ModelConfigError",
                     "NoLayoutError", "Placement", "PolicyError", "QuantMode", "RuleLoadError", "RuleSet",
                     "load_rules"})


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): `import kvpolicy.policy` must not load the engine, and nothing here loads torch.
    if name in __all__:
        import importlib

        module = importlib.import_module("kvpolicy.policy" if name in _POLICY else "kvpolicy.engine")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvpolicy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AgreementError",
    "CandidateRemoved",
    "CompatibilityResult",
    "ConnectorConfig",
    "Context",
    "Counterfactual",
    "Decision",
    "Diagnostic",
    "FieldChange",
    "GeometryError",
    "HeadOrder",
    "InputError",
    "KVCacheGroup",
    "KVCacheGroups",
    "KVCacheSpec",
    "Layout",
    "LayoutChosen",
    "LayoutEngine",
    "LayoutFingerprint",
    "LayoutMismatchError",
    "Limits",
    "MissingDependencyError",
    "ModelConfigError",
    "NoLayoutError",
    "Placement",
    "PolicyError",
    "PreferenceApplied",
    "QuantMode",
    "RuleEvaluated",
    "RuleLoadError",
    "RuleRef",
    "RuleSet",
    "agree",
    "check_compatible",
    "fingerprint_of",
    "load_rules",
    "require_compatible",
    "shipped_rules_dir",
]
