"""The JSON Schema (draft 2020-12) of a rule file, as strict as the loader wherever JSON Schema can say it.

pydantic's own export of `RuleFile` describes the models' *shapes* only: it
accepts a misspelt field path, zero or two effects, two operators in a leaf, a
string where an integer field is compared. This module builds the schema from
the same sources the loader reads, so the two cannot drift:

- the models' keys and descriptions (`RuleFile`, `Rule`, `Defaults`, `LayoutPattern`);
- the field registry `kvpolicy.policy.context.FIELDS` (paths, value types,
  closed domains) plus the open family ``connector.extra.<key>``;
- the operator table `kvpolicy.policy.rule_model.OPERATORS`;
- the layouts (`Layout`, `LEGACY_NAMES`) and their derived properties, so a
  pattern that no layout matches is refused here as by `kvpolicy validate`.

What JSON Schema cannot say stays with the loader alone: `LOADER_ONLY_CHECKS`
lists it by diagnostic code (docs/cli.md says the same): YAML-level problems
(duplicate keys, tags, several documents, limits), where a file lies
(``connectors/`` or not), uniqueness of a key across items (duplicate rule ids,
in one file or across files; one file per connector, one ``defaults``), whether
a connector name is known (a "did you mean" over the release profiles), ``8.0``
for an integer and an integer literal past 64 bits where any number may stand
(JSON numbers have no integer type: ``8.0`` *is* the integer 8, and
``10000000000000000000`` the float ``1e19``, to JSON Schema) and NaN.
`tests/policy/test_json_schema.py` runs a corpus of broken files through both
and holds them to the same verdict, and generates documents that the schema
accepts: each loads, or fails only with a check listed here.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kvpolicy.policy.context import EXTRA_PREFIX, FIELDS, FieldSpec
from kvpolicy.policy.layouts import LEGACY_NAMES, HeadOrder, Layout, LayoutPattern, Placement
from kvpolicy.policy.rule_model import (
    OPERATORS,
    Defaults,
    Effect,
    Enforcement,
    MemberPreferences,
    Rule,
    RuleFile,
    Waiver,
)
from kvpolicy.policy.yaml_source import INT64_MAX, INT64_MIN

__all__ = ["DRAFT", "INT64_BOUNDS", "LOADER_ONLY_CHECKS", "RULE_FILE_ID", "LoaderOnly", "layout_names",
           "layout_pattern_schema", "rule_file_schema", "whole_pattern"]

DRAFT = "https://json-schema.org/draft/2020-12/schema"
RULE_FILE_ID = "urn:kvpolicy:rule-file:1"  # stable: editors and CI pin it

_NUMERIC_OPS = ("lt", "le", "gt", "ge")
_LIST_OPS = ("in", "not_in")
# The loader refuses .inf and -.inf (no value ever compares with them); a bound refuses them here too.
_FINITE = {"minimum": -sys.float_info.max, "maximum": sys.float_info.max}
# What vLLM's connector factory can name: a Python class name (`kv_connector`, or a third-party
# class loaded by `kv_connector_module_path`).
CONNECTOR_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
CONNECTOR_NAME_MAX = 128
# The loader reads no integer past 64 bits (kvpolicy.policy.yaml_source): where only an integer may stand,
# the schema bounds it too.
INT64_BOUNDS = {"minimum": INT64_MIN, "maximum": INT64_MAX}


def whole_pattern(pattern: str) -> str:
    """A ``^...$`` pattern as the loader applies it, to the whole text, whatever the validator's regex engine:
    Python's ``re`` (the ``jsonschema`` package) also matches ``$`` before a final newline, so ``"r\\n"``
    passed the id pattern; ``(?!\\n)`` closes that, and ECMA-262 engines (editors) read it the same."""
    return pattern + r"(?!\n)" if pattern.endswith("$") else pattern


@dataclass(frozen=True)
class LoaderOnly:
    """A check of the loader that JSON Schema cannot express: its diagnostic ``code``, a ``message``
    pattern where the code also names checks the schema makes, and why the schema cannot say it."""

    code: str
    why: str
    message: str = ""

    def covers(self, code: str, message: str) -> bool:
        return code == self.code and re.search(self.message, message) is not None


LOADER_ONLY_CHECKS: tuple[LoaderOnly, ...] = (
    *(LoaderOnly(code, "the YAML itself: a schema sees the parsed data, after the parser kept one of two "
                 "duplicate keys, read tags and anchors, and before any size or depth limit")
      for code in ("yaml-syntax", "duplicate-key", "unsafe-tag", "unsupported-merge", "bad-key", "yaml-value",
                   "ambiguous-number", "too-deep", "too-large", "too-many-rules")),
    LoaderOnly("missing-connector", "where the file lies (`connectors/` or not) is not in the data"),
    LoaderOnly("misplaced-connector-file", "where the file lies (`connectors/` or not) is not in the data"),
    LoaderOnly("duplicate-rule-id", "uniqueness of one key across list items (`uniqueItems` compares whole "
               "items), in one file or across files"),
    LoaderOnly("duplicate-connector-file", "two files for one connector: across files"),
    LoaderOnly("duplicate-defaults", "`defaults` declared twice: across files"),
    LoaderOnly("unknown-waived-rule", "whether a waiver's rule exists: rules of any file and layer"),
    LoaderOnly("waiver-of-audit-rule", "whether a waiver's rule is in audit mode: a rule of any file and layer"),
    LoaderOnly("invalid-value", "whether a waiver's `expires` is a day of the calendar (`2027-02-30`): a pattern "
               "sees digits", r"date|day"),
    *(LoaderOnly(code, "whether vLLM knows a connector: `connector.name` takes any class name (third-party "
                 "connectors); a near miss of a known one (edit distance) is the loader's to judge",
                 r"is not a value of `connector\.name`")
      for code in ("unknown-value", "type-mismatch")),  # `eq`, or an item of `in`/`not_in`
    LoaderOnly("type-mismatch", "`8.0` for an integer: JSON has one number type, so 8.0 is the integer 8",
               r"is an integer, got number"),
    LoaderOnly("invalid-value", "`2.0` for an integer (`weight`): JSON has one number type",
               r"expected a valid integer, got number"),
    LoaderOnly("number-out-of-range", "an integer literal past 64 bits where any number may stand "
               "(`connector.extra.*`, `lt`/`le`/`gt`/`ge`): JSON has one number type, so it is the float "
               "of the same value, which the loader takes", r"^the integer"),
    LoaderOnly("invalid-value", "`.nan`: JSON has no NaN, and NaN passes every numeric bound",
               r"\bnan\b|NaN"),
)
_PATTERN_BOOLS = ("layer_compact", "block_outermost", "block_compact", "block_contiguous")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/$defs/{name}"}


def _null() -> dict[str, str]:
    return {"type": "null"}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null: the loader reads an explicit null as the key's absence."""
    return {"anyOf": [schema, _null()]}


def _non_null(key: str) -> dict[str, Any]:
    """``key`` is present with a value other than null."""
    return {"required": [key], "properties": {key: {"not": _null()}}}


def _described(model: type[BaseModel], key: str, schema: dict[str, Any]) -> dict[str, Any]:
    info = model.model_fields[key]
    return {**schema, "description": info.description} if info.description else schema


def _check_keys(model: type[BaseModel], properties: dict[str, Any]) -> dict[str, Any]:
    """The schema's keys are the model's (by alias): a key added to a model must be added here."""
    keys = {info.alias or name for name, info in model.model_fields.items()}
    if keys != set(properties):  # pragma: no cover - caught by the tests the moment a model changes
        raise AssertionError(f"{model.__name__} keys {sorted(keys)} != schema keys {sorted(properties)}")
    return properties


def layout_names(layout: Layout | None = None) -> list[str]:
    """What a file may write for ``layout`` (every layout if None): the vLLM name and any legacy alias."""
    names = [x.value for x in Layout if layout in (None, x)]
    return names + [name for name, x in LEGACY_NAMES.items() if layout in (None, x)]


def layout_pattern_schema() -> dict[str, Any]:
    """`LayoutPattern` as the models accept it (no emptiness or satisfiability check: rules add those)."""
    name = {"enum": layout_names()}
    props = {
        # one name or a non-empty list of names (if/then: a misspelt name is reported as "not one of [...]")
        "layout": {"type": ["string", "array", "null"], "if": {"type": "string"}, "then": name,
                   "minItems": 1, "items": name},
        "placement": _or_null({"enum": [p.value for p in Placement]}),
        "head_order": _or_null({"enum": [h.value for h in HeadOrder]}),
        **{key: _or_null({"type": "boolean"}) for key in _PATTERN_BOOLS},
    }
    props = {k: _described(LayoutPattern, k, v) for k, v in _check_keys(LayoutPattern, props).items()}
    return {"type": "object", "additionalProperties": False, "properties": props,
            "description": LayoutPattern.__doc__.split("\n")[0]}


def _matches(layout: Layout) -> dict[str, Any]:
    """A pattern that ``layout`` satisfies: every key given agrees with it (`LayoutPattern.matches`)."""
    names = {"enum": layout_names(layout)}
    props: dict[str, Any] = {
        "layout": {"anyOf": [_null(), names, {"type": "array", "contains": names}]},
        "placement": {"enum": [None, layout.placement.value]},
        "head_order": {"enum": [None, layout.head_order.value]},
    }
    props |= {key: {"enum": [None, getattr(layout, "is_" + key)]} for key in _PATTERN_BOOLS}
    return {"properties": props}


def _rule_pattern() -> dict[str, Any]:
    """A rule's effect pattern: names some key (`empty-pattern`) and matches some layout (`unsatisfiable-pattern`)."""
    keys = list(LayoutPattern.model_fields)
    return {"allOf": [
        _ref("LayoutPattern"),
        {"anyOf": [_non_null(k) for k in keys], "$comment": "an empty pattern would match every layout"},
        {"anyOf": [_ref(f"matches-{x.value}") for x in Layout], "$comment": "some layout has every given property"},
    ]}


def _field_path() -> dict[str, Any]:
    # if/then/else rather than anyOf: a misspelt path is then reported as "not one of [...]"
    return {
        "description": "a field path (docs/rule-language.md lists them), or `connector.extra.<key>`",
        "type": "string",
        "if": {"pattern": "^" + EXTRA_PREFIX.replace(".", r"\.")},
        "then": {"minLength": len(EXTRA_PREFIX) + 1, "description": "a key of vLLM's `kv_connector_extra_config`"},
        "else": {"enum": list(FIELDS)},
    }


def _value_schema(spec: FieldSpec) -> dict[str, Any]:
    """What `eq`/`ne` and every item of `in`/`not_in` may hold for a field (validate.py's `_check_value`)."""
    if spec.path == "connector.name":
        # Open, as connector files are (#15): any class name, so rules can test third-party
        # connectors; a near miss of a known name is the loader's "did you mean".
        return _ref("ConnectorName")
    if spec.type == "bool":
        return {"type": "boolean"}
    if spec.type == "int":
        return {"type": "integer", **INT64_BOUNDS}
    if spec.choices is not None:
        return {"enum": list(spec.choices)}
    return {"type": "string"}


def _typed_operands(spec_key: str, paths: list[str], value: dict[str, Any], numeric: bool) -> dict[str, Any]:
    """``if field in paths then`` the operands have ``value``'s type (numeric operators only if ``numeric``)."""
    props: dict[str, Any] = {"eq": value, "ne": value}
    props |= {op: {"items": value} for op in _LIST_OPS}
    if not numeric:
        props |= {op: False for op in _NUMERIC_OPS}  # `bad-operator`: lt/le/gt/ge on a non-numeric field
    cond = {"enum": paths} if len(paths) > 1 else {"const": paths[0]}
    return {"if": {"required": ["field"], "properties": {"field": cond}}, "then": {"properties": props},
            "$comment": spec_key}


def _leaf() -> dict[str, Any]:
    scalar = _ref("Scalar")
    operands: dict[str, Any] = {}
    for op in OPERATORS:
        if op in _LIST_OPS:
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": scalar}
        elif op in _NUMERIC_OPS:
            schema = {"type": "number", **_FINITE}
        elif op == "exists":
            schema = {"type": "boolean"}
        else:
            schema = scalar
        operands[op] = {**schema, "description": OPERATORS[op]}
    # Group the registry's fields by the type their operands must have: one if/then per group.
    groups: dict[str, tuple[list[str], dict[str, Any], bool]] = {}
    for spec in FIELDS.values():
        key = f"{spec.type} fields" if spec.choices is None else f"values of {spec.path}"
        paths, _, _ = groups.setdefault(key, ([], _value_schema(spec), spec.type in ("int", "scalar")))
        paths.append(spec.path)
    return {
        "type": "object",
        "description": "`{field: <path>, <operator>: <operand>}` with exactly one operator",
        "required": ["field"],
        "additionalProperties": False,
        "properties": {"field": _ref("FieldPath"), **operands},
        "oneOf": [{"required": [op]} for op in OPERATORS],
        "allOf": [_typed_operands(key, paths, value, numeric) for key, (paths, value, numeric) in groups.items()],
    }


def _combinator(key: str, description: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "description": description, "required": [key], "additionalProperties": False,
            "properties": {key: body}}


def _condition() -> dict[str, Any]:
    """The loader's discriminator: a mapping with `all` is an AllOf, else `any`, else `not`, else a leaf."""
    return {
        "type": "object",
        "description": "`all`, `any`, `not`, or a leaf `{field, <operator>}`",
        "if": {"required": ["all"]}, "then": _ref("AllOf"),
        "else": {"if": {"required": ["any"]}, "then": _ref("AnyOf"),
                 "else": {"if": {"required": ["not"]}, "then": _ref("NotOf"), "else": _ref("Leaf")}},
    }


def _rule() -> dict[str, Any]:
    id_info = Rule.model_fields["id"]
    pattern = next(m.pattern for m in id_info.metadata if getattr(m, "pattern", None))
    max_length = next(m.max_length for m in id_info.metadata if getattr(m, "max_length", None))
    effects = [e.value for e in Effect]
    props = {
        "id": {"type": "string", "pattern": whole_pattern(pattern), "maxLength": max_length},
        "description": {"type": "string", "minLength": 1},
        "reference": _or_null({"type": "string"}),
        "when": _ref("Condition"),  # `when:` left empty is an error (`empty-condition`), not "always"
        **{e: _or_null(_ref("RulePattern")) for e in effects},
        "weight": _or_null({"type": "integer", "minimum": 1, "maximum": 1000}),
        "enforcement": _or_null({"enum": [e.value for e in Enforcement]}),
    }
    props = {k: _described(Rule, k, v) for k, v in _check_keys(Rule, props).items()}
    return {
        "type": "object",
        "description": Rule.__doc__.split("\n")[0],
        "required": [k for k, info in Rule.model_fields.items() if info.is_required()],
        "additionalProperties": False,
        "properties": props,
        "oneOf": [{"required": [e], "properties": {e: {"type": "object"}}} for e in effects],
        "allOf": [{"if": _non_null("weight"), "then": _non_null("prefer"),
                   "$comment": "`weight` applies only to a `prefer` rule"},
                  {"if": _non_null("enforcement"), "then": {"properties": {"prefer": _null()}},
                   "$comment": "`enforcement` applies only to a `forbid` or `require` rule"}],
    }


def _waiver() -> dict[str, Any]:
    id_info = Waiver.model_fields["rule"]
    pattern = next(m.pattern for m in id_info.metadata if getattr(m, "pattern", None))
    max_length = next(m.max_length for m in id_info.metadata if getattr(m, "max_length", None))
    owner_max = next(m.max_length for m in Waiver.model_fields["owner"].metadata if getattr(m, "max_length", None))
    props = {
        "rule": {"type": "string", "pattern": whole_pattern(pattern), "maxLength": max_length},
        "owner": {"type": "string", "minLength": 1, "maxLength": owner_max},
        "reason": {"type": "string", "minLength": 1},
        # a calendar day; whether it exists (2027-02-30) is the loader's (`format` is an annotation in 2020-12)
        "expires": {"type": "string", "pattern": whole_pattern(r"^\d{4}-\d{2}-\d{2}$"), "format": "date"},
        "when": _ref("Condition"),
    }
    props = {k: _described(Waiver, k, v) for k, v in _check_keys(Waiver, props).items()}
    return {"type": "object", "description": Waiver.__doc__.split("\n")[0],
            "required": [k for k, info in Waiver.model_fields.items() if info.is_required()],
            "additionalProperties": False, "properties": props}


def _defaults() -> dict[str, Any]:
    # each layout at most once, in any of its spellings (`per_layer/HND` is LBHNC): `duplicate-layout`
    once = [{"contains": {"enum": layout_names(x)}, "minContains": 0, "maxContains": 1} for x in Layout]
    props = {"layout_order": {"type": "array", "minItems": 1, "uniqueItems": True,
                              "items": {"enum": layout_names()}, "allOf": once}}
    props = {k: _described(Defaults, k, v) for k, v in _check_keys(Defaults, props).items()}
    return {"type": "object", "required": ["layout_order"], "additionalProperties": False, "properties": props}


def rule_file_schema() -> dict[str, Any]:
    """The JSON Schema of one rule file (``$id`` `RULE_FILE_ID`)."""
    props = {
        "version": {"const": 1},
        # Any class name: whether vLLM knows the connector is the loader's "did you mean" over
        # the release profiles, not a closed list that would refuse a third-party connector.
        "connector": _or_null(_ref("ConnectorName")),
        "member_preferences": _or_null({"enum": [m.value for m in MemberPreferences]}),
        "defaults": _or_null(_ref("Defaults")),
        "rules": {"type": ["array", "null"], "items": _ref("Rule")},
        "waivers": {"type": ["array", "null"], "items": _ref("Waiver")},
    }
    props = {k: _described(RuleFile, k, v) for k, v in _check_keys(RuleFile, props).items()}
    return {
        "$schema": DRAFT,
        "$id": RULE_FILE_ID,
        "title": "kvpolicy rule file",
        "description": "The same checks as `kvpolicy validate` where JSON Schema can express them; "
                       "`kvpolicy validate` also checks what spans files (docs/cli.md).",
        "type": "object",
        "required": ["version"],
        "additionalProperties": False,
        "properties": props,
        "allOf": [
            {"if": _non_null("member_preferences"), "then": _non_null("connector"),
             "$comment": "`member_preferences` applies only to a connector file"},
            {"if": _non_null("connector"), "then": {"properties": {"defaults": _null()}},
             "$comment": "`defaults` belong in a global file"},
            {"if": _non_null("connector"), "then": {"properties": {"waivers": {"type": ["array", "null"],
                                                                                "maxItems": 0}}},
             "$comment": "`waivers` belong in a global file"},
        ],
        "$defs": {
            "Rule": _rule(),
            "Defaults": _defaults(),
            "Waiver": _waiver(),
            "Condition": _condition(),
            "AllOf": _combinator("all", "true when every condition is",
                                 {"type": "array", "minItems": 1, "items": _ref("Condition")}),
            "AnyOf": _combinator("any", "true when some condition is",
                                 {"type": "array", "minItems": 1, "items": _ref("Condition")}),
            "NotOf": _combinator("not", "true when the condition is false", _ref("Condition")),
            "Leaf": _leaf(),
            "FieldPath": _field_path(),
            "ConnectorName": {"type": "string", "pattern": whole_pattern(CONNECTOR_NAME_PATTERN),
                              "maxLength": CONNECTOR_NAME_MAX,
                              "description": "a KV connector's class name, as vLLM's `kv_connector` names it"},
            "Scalar": {"anyOf": [{"type": ["string", "boolean"]}, {"type": "number", **_FINITE}]},
            "LayoutPattern": layout_pattern_schema(),
            "RulePattern": _rule_pattern(),
            **{f"matches-{x.value}": _matches(x) for x in Layout},
        },
    }
