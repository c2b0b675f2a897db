"""kvpolicy's policy language: input models, the rule format, loading and validation.

`policy` never imports `engine` or torch.
"""

from kvpolicy.policy.backends import BACKENDS, BackendProfile, Dim, ScaleViews, get_backend
from kvpolicy.policy.connectors import KNOWN_CONNECTORS, ConnectorConfig
from kvpolicy.policy.context import FIELDS, MISSING, Context, FieldSpec
from kvpolicy.policy.errors import (
    Diagnostic,
    GeometryError,
    InputError,
    ModelConfigError,
    NoLayoutError,
    PolicyError,
    RuleLoadError,
)
from kvpolicy.policy.layouts import ALL_LAYOUTS, HeadOrder, Layout, LayoutPattern, Placement
from kvpolicy.policy.load import Limits, load_rules, load_rules_from_texts
from kvpolicy.policy.quant import KV_CACHE_DTYPES, CacheDtype, ModelDtype, QuantMode, parse_kv_cache_dtype
from kvpolicy.policy.rule_model import Rule, RuleFile
from kvpolicy.policy.ruleset import CompiledRule, RuleSet, Source
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

__all__ = [
    "ALL_LAYOUTS",
    "BACKENDS",
    "FIELDS",
    "KNOWN_CONNECTORS",
    "KV_CACHE_DTYPES",
    "MISSING",
    "AttentionKind",
    "BackendProfile",
    "CacheDtype",
    "CompiledRule",
    "ConnectorConfig",
    "Context",
    "Diagnostic",
    "Dim",
    "FieldSpec",
    "GeometryError",
    "HeadOrder",
    "InputError",
    "KVCacheGroup",
    "KVCacheGroups",
    "KVCacheSpec",
    "Layout",
    "LayoutPattern",
    "Limits",
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
    "Source",
    "get_backend",
    "load_rules",
    "load_rules_from_texts",
    "parse_kv_cache_dtype",
]
