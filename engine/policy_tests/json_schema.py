"""The JSON Schema (draft 2020-12) of a policy test file, as strict as `load_cases` where JSON Schema can say it.

Built from the case models (`CaseFile`, `PolicyCase`, `CaseInput`, `GroupInput`,
`Expect`) and the layouts, with the checks pydantic's export leaves out: exactly
one of ``model``/``spec``/``groups``, an ``expect`` that asks something and
does not combine ``error`` with ``layout``/``survivors``, layout names where
the loader parses them, CUDA capabilities as the loader reads them.

Loader-only (docs/cli.md): duplicate case names, rule ids that must exist in
the rule set, ``backend`` and ``attention_backend`` naming different backends
(JSON Schema cannot compare two values), an integer literal past 64 bits inside
the free-form mappings (``spec``, ``connector_config``, ...) and for
``device_capability`` (the float of that value is the same JSON number, and
accepted there), and everything `kvpolicy test` finds when it
builds the input (an unknown backend or dtype is a case's business:
``expect: {error: ...}`` may test exactly that). Integer keys are bounded to 64
bits as the loader reads them, and patterns hold for the whole text.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel

from kvpolicy.engine.policy_tests.cases import CaseFile, CaseInput, Expect, GroupInput, PolicyCase
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.json_schema import DRAFT, INT64_BOUNDS, layout_names, layout_pattern_schema, whole_pattern

__all__ = ["CASE_FILE_ID", "case_file_schema"]

CASE_FILE_ID = "urn:kvpolicy:policy-test-file:1"  # stable: editors and CI pin it

# `parse_device_capability`: ASCII digits, major 1..99, an optional `.minor`.
_CAPABILITY = whole_pattern(r"^0*[1-9][0-9]?(\.[0-9]*)?$")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/$defs/{name}"}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _non_null(key: str) -> dict[str, Any]:
    return {"required": [key], "properties": {key: {"not": {"type": "null"}}}}


def _object(model: type[BaseModel], props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """``model`` as a closed object: its keys (checked against the model), descriptions, required keys."""
    keys = {info.alias or name for name, info in model.model_fields.items()}
    if keys != set(props):  # pragma: no cover - caught by the tests the moment a model changes
        raise AssertionError(f"{model.__name__} keys {sorted(keys)} != schema keys {sorted(props)}")
    described = {}
    for key, schema in props.items():
        info = model.model_fields[key]
        described[key] = {**schema, "description": info.description} if info.description else schema
    required = [name for name, info in model.model_fields.items() if info.is_required()]
    return {"type": "object", "description": (model.__doc__ or "").split("\n")[0],
            **({"required": required} if required else {}), "additionalProperties": False,
            "properties": described, **extra}


def _input() -> dict[str, Any]:
    string, mapping = {"type": "string"}, {"type": "object"}
    props = {
        "model": _or_null(string),
        "spec": _or_null(mapping),
        "groups": _or_null({"type": "array", "minItems": 1, "items": _ref("GroupInput")}),
        "kv_cache_dtype": _or_null(string),
        "block_size": _or_null({"type": "integer", "exclusiveMinimum": 0, "maximum": INT64_BOUNDS["maximum"]}),
        "attention_backend": _or_null(string),
        "backend": _or_null(string),
        "worker_attention_backends": _or_null({"type": "array", "items": {"type": "array", "items": string}}),
        "scale_views": _or_null({"enum": [s.value for s in ScaleViews]}),
        "connector": _or_null(string),
        "connector_config": _or_null(mapping),
        "kv_transfer_config": _or_null(mapping),
        "connector_module_path": _or_null({"type": "string", "minLength": 1}),
        "tensor_parallel_size": {"type": "integer", "minimum": 1, "maximum": INT64_BOUNDS["maximum"]},
        "dtype": _or_null(string),
        "vllm_version": _or_null({"type": "string", "minLength": 1}),
        "vllm_kv_cache_layout": _or_null(string),
        "enable_extensible_kv_cache": {"type": "boolean"},
        "hisparse": {"type": "boolean"},
        "device": _or_null({"enum": ["cuda", "cpu"]}),
        "cpu": _or_null(string),  # a CPU label (`x86+avx512+amx`): which labels, the loader's (CpuHost.parse)
        "device_capability": _or_null({"anyOf": [
            {"type": "integer"},  # past 64 bits: as a float it is accepted, as an integer literal not (loader-only)
            {"type": "number", "minimum": 1, "maximum": sys.float_info.max},  # finite, >= 1: its major
            {"type": "string", "pattern": _CAPABILITY}]}),
        "use_v2_model_runner": {"type": "boolean"},
        "allow_chunked_local_attn_with_hybrid_kv_cache": {"type": "boolean"},
        "disable_hybrid_kv_cache_manager": _or_null({"type": "boolean"}),
        "disable_sliding_window": {"type": "boolean"},
        "connector_prefers_cross_layer_blocks": _or_null({"anyOf": [
            {"type": "boolean"}, {"type": "object", "minProperties": 1, "additionalProperties": {"type": "boolean"}}]}),
    }
    sources = ("model", "spec", "groups")
    return _object(CaseInput, props, oneOf=[_non_null(k) for k in sources],
                   **{"$comment": "exactly one of `model`, `spec`, `groups`"})


def _expect() -> dict[str, Any]:
    names = {"enum": layout_names()}
    props = {
        "layout": _or_null({"anyOf": [names, _ref("LayoutPattern")]}),
        "survivors": _or_null({"type": "array", "items": names}),
        "removed": _or_null({"type": "object", "propertyNames": names,
                             "additionalProperties": _or_null({"type": "array", "items": {"type": "string"}})}),
        "matched": {"type": "array", "items": {"type": "string"}},
        "not_matched": {"type": "array", "items": {"type": "string"}},
        "audit": {"type": "array", "items": {"type": "string"}},
        "error": _or_null({"type": "string"}),
    }
    asks = [_non_null("layout"), _non_null("survivors"),
            {"required": ["removed"], "properties": {"removed": {"type": "object", "minProperties": 1}}},
            {"required": ["matched"], "properties": {"matched": {"minItems": 1}}},
            {"required": ["not_matched"], "properties": {"not_matched": {"minItems": 1}}},
            {"required": ["audit"], "properties": {"audit": {"minItems": 1}}},
            {"required": ["error"], "properties": {"error": {"type": "string", "minLength": 1}}}]
    no_layout = {"properties": {"layout": {"type": "null"}, "survivors": {"type": "null"}}}
    return _object(Expect, props, anyOf=asks, allOf=[
        {"if": _non_null("error"), "then": no_layout,
         "$comment": "`error` cannot be combined with `layout` or `survivors`"}])


def case_file_schema() -> dict[str, Any]:
    """The JSON Schema of one policy test file (``$id`` `CASE_FILE_ID`)."""
    body = _object(CaseFile, {"version": {"const": 1},
                              "cases": {"type": "array", "minItems": 1, "items": _ref("PolicyCase")}})
    return {
        "$schema": DRAFT,
        "$id": CASE_FILE_ID,
        "title": "kvpolicy policy test file",
        **body,
        "description": "The same checks as `kvpolicy test`'s loader where JSON Schema can express them; "
                       "duplicate case names and unknown rule ids are the loader's alone (docs/cli.md).",
        "$defs": {
            "PolicyCase": _object(PolicyCase, {"name": {"type": "string", "minLength": 1},
                                               "input": _ref("CaseInput"), "expect": _ref("Expect")}),
            "CaseInput": _input(),
            "GroupInput": _object(GroupInput, {"spec": {"type": "object"},
                                               "num_attention_groups": {"type": "integer", "minimum": 1,
                                                                        "maximum": INT64_BOUNDS["maximum"]},
                                               "dcp_sharded": {"type": "boolean"}}),
            "Expect": _expect(),
            "LayoutPattern": layout_pattern_schema(),
        },
    }
