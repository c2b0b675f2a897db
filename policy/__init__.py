"""kvpolicy's policy language: input models, the rule format, loading and validation.

`policy` never imports `engine` or torch.
"""

from policy.backends import BACKENDS, BackendProfile, Dim, ScaleViews, get_backend
from policy.connectors import KNOWN_CONNECTORS, ConnectorConfig
from policy.context import FIELDS, MISSING, Context, FieldSpec
from policy.errors import (
    Diagnostic,
    GeometryError,
    InputError,
    ModelConfigError,
    NoLayoutError,
    PolicyError,
    RuleLoadError,
)
from policy.layouts import ALL_LAYOUTS, HeadOrder, Layout, LayoutPattern, Placement
from policy.load import Limits, load_rules, load_rules_from_texts
from policy.quant import KV_CACHE_DTYPES, CacheDtype, ModelDtype, QuantMode, parse_kv_cache_dtype
from policy.rule_model import Rule, RuleFile
from policy.ruleset import CompiledRule, RuleSet, Source
from policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

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
