"""kvpolicy's policy language: input models, the rule format, loading and validation.

`policy` never imports `engine` or torch. These names are the public surface
(tests/test_public_api.py pins them); the compiled forms (`kvpolicy.policy.ruleset`),
the field registry (`kvpolicy.policy.context`) and the backend registry
(`get_backend` reads it) are internals of their modules.
"""

from kvpolicy.policy.backends import BackendProfile, Dim, ScaleViews, get_backend
from kvpolicy.policy.connectors import KNOWN_CONNECTORS, ConnectorConfig
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import (
    Diagnostic,
    GeometryError,
    InputError,
    MissingDependencyError,
    ModelConfigError,
    NoLayoutError,
    PolicyError,
    RuleLoadError,
)
from kvpolicy.policy.layouts import ALL_LAYOUTS, HeadOrder, Layout, LayoutPattern, Placement
from kvpolicy.policy.load import Limits, load_rules, load_rules_from_texts
from kvpolicy.policy.quant import KV_CACHE_DTYPES, CacheDtype, ModelDtype, QuantMode, parse_kv_cache_dtype
from kvpolicy.policy.rule_model import Rule, RuleFile
from kvpolicy.policy.ruleset import RuleSet
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

__all__ = [
    "ALL_LAYOUTS",
    "KNOWN_CONNECTORS",
    "KV_CACHE_DTYPES",
    "AttentionKind",
    "BackendProfile",
    "CacheDtype",
    "ConnectorConfig",
    "Context",
    "Diagnostic",
    "Dim",
    "GeometryError",
    "HeadOrder",
    "InputError",
    "KVCacheGroup",
    "KVCacheGroups",
    "KVCacheSpec",
    "Layout",
    "LayoutPattern",
    "Limits",
    "MissingDependencyError",
    "ModelConfigError",
    "ModelDtype",
    "NoLayoutError",
    "Placement",
    "PolicyError",
    "QuantMode",
    "Rule",
    "RuleFile",
    "RuleLoadError",
    "RuleSet",
    "ScaleViews",
    "get_backend",
    "load_rules",
    "load_rules_from_texts",
    "parse_kv_cache_dtype",
]
