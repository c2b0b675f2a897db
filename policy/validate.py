"""The validation pass: structure (pydantic) and meaning (fields, types, names).

Collects every problem in a file and returns them all, each located; nothing
here raises for a user's mistake. Evaluation assumes validated input.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from kvpolicy.policy.connectors import connector_name_problem, near_connector
from kvpolicy.policy.context import EXTRA_PREFIX, FIELDS, FieldSpec, field_spec
from kvpolicy.policy.errors import Diagnostic
from kvpolicy.policy.layouts import Layout, LayoutPattern
from kvpolicy.policy.rule_model import OPERATORS, AllOf, AnyOf, Condition, Defaults, Leaf, NotOf, Rule, RuleFile
from kvpolicy.policy.yaml_source import Located, Path

__all__ = ["located_validation_errors", "validate_file", "walk_loc"]

_NUMERIC_OPS = {"lt", "le", "gt", "ge"}
_LIST_OPS = {"in", "not_in"}

# every key a rule file may use somewhere, for "did you mean" on unknown keys
_KNOWN_KEYS: dict[str, tuple[str, ...]] = {
    "file": tuple(RuleFile.model_fields),
    "rule": tuple(Rule.model_fields),
    "leaf": ("field", *OPERATORS),
    "pattern": tuple(LayoutPattern.model_fields),
    "defaults": tuple(Defaults.model_fields),
}


def walk_loc(data: Any, loc: tuple[Any, ...]) -> Path:
    """Map a pydantic error location (with union tags) onto the longest matching path in ``data``."""
    path: list[Any] = []
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
            path.append(part)
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
            path.append(part)
    return tuple(path)


def _context_keys(path: Path) -> tuple[str, ...]:
    last = next((p for p in reversed(path) if isinstance(p, str)), None)
    if not path or last is None:
        return _KNOWN_KEYS["file"]
    if last in ("forbid", "require", "prefer"):
        return _KNOWN_KEYS["pattern"]
    if last == "defaults":
        return _KNOWN_KEYS["defaults"]
    if last in ("when", "all", "any", "not"):
        return _KNOWN_KEYS["leaf"] + ("all", "any", "not")
    if path[0] == "rules" and len(path) == 2:
        return _KNOWN_KEYS["rule"]
    return ()


def located_validation_errors(
    src: Located, base: Path, data: Any, exc: ValidationError,
    *, valid_keys: Callable[[Path], tuple[str, ...]] = _context_keys,
) -> list[Diagnostic]:
    """Turn a pydantic `ValidationError` on ``data`` (found at ``base`` in ``src``) into
    located diagnostics, one per value; unknown keys get "did you mean" from ``valid_keys(path)``,
    the keys allowed in the mapping at ``path`` (default: a rule file's)."""
    diags = []
    seen: set[Path] = set()
    for err in exc.errors():
        path = (*base, *walk_loc(data, err["loc"]))
        kind = err["type"]
        if path in seen and kind != "extra_forbidden":
            continue  # one message per value: a union (`int | float`) reports each branch
        seen.add(path)
        if kind == "extra_forbidden":
            key = str(err["loc"][-1])
            valid = valid_keys(path[:-1])
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            diags.append(src.diag(path, "unknown-key", f"unknown key `{key}`",
                                  f"{hint}valid keys here: {', '.join(valid)}" if valid else None, key=True))
        elif kind == "missing":
            diags.append(src.diag(path, "missing-key", f"missing required key `{err['loc'][-1]}`"))
        elif kind == "string_type" and isinstance(err.get("input"), bool):
            shown = str(err["input"]).lower()
            diags.append(src.diag(path, "invalid-value", f"expected a string, got boolean `{shown}`",
                                  "YAML reads yes/no/on/off/true/false as booleans: quote the value"))
        elif kind == "string_pattern_mismatch":
            diags.append(src.diag(path, "invalid-id", f"`{err['input']}` is not a valid id",
                                  "use lowercase letters, digits, `.`, `_` and `-`, starting with a letter or digit"))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg.replace("Input should be", "expected")
            msg = msg[:1].lower() + msg[1:]
            code = ("invalid-condition" if kind == "condition" or msg.startswith("a leaf")
                    else "invalid-rule" if kind == "value_error" and len(path) == 2 and path[0] == "rules"
                    else "invalid-value")
            shown = err.get("input")
            if kind not in ("condition", "value_error") and isinstance(shown, (str, int, float, bool)):
                msg += f", got {_type_name(shown)} `{str(shown).lower() if isinstance(shown, bool) else shown}`"
            diags.append(src.diag(path, code, msg))
    return diags


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(value), type(value).__name__)


def _check_value(spec: FieldSpec, op: str, value: Any) -> tuple[str, str | None] | None:
    """Why ``value`` does not fit ``spec`` under ``op`` (message, help), or None."""
    if value is None:
        return (f"`{spec.path}` compared with null",
                "use `exists: false` to test that a field is absent")
    if spec.type == "bool" and not isinstance(value, bool):
        return f"`{spec.path}` is a boolean, got {_type_name(value)} `{value}`", "write `true` or `false` unquoted"
    if spec.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        hint = "write the number unquoted" if isinstance(value, str) else None
        return f"`{spec.path}` is an integer, got {_type_name(value)} `{value}`", hint
    if spec.type == "str":
        if not isinstance(value, str):
            return f"`{spec.path}` is a string, got {_type_name(value)} `{value}`", None
        if spec.path == "connector.name" and _open_connector_name(value, spec.choices or ()):
            return None
        if spec.choices is not None and value not in spec.choices:
            close = difflib.get_close_matches(value, spec.choices, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            return (f"`{value}` is not a value of `{spec.path}`",
                    f"{hint}valid values: {', '.join(spec.choices)}")
    return None


def _open_connector_name(value: str, known: tuple[str, ...]) -> bool:
    """`connector.name` compares with any well-formed connector name (third-party, newer ones) that is
    not a near miss of a known one: a misspelt known name in a condition would silently never match."""
    return value not in known and connector_name_problem(value) is None and near_connector(value, known) is None


def _check_leaf(src: Located, path: Path, leaf: Leaf, diags: list[Diagnostic]) -> None:
    spec = field_spec(leaf.field)
    if spec is None:
        names = [*FIELDS, EXTRA_PREFIX + "<key>"]
        close = difflib.get_close_matches(leaf.field, names, n=1, cutoff=0.5)
        hint = f"did you mean `{close[0]}`? " if close else ""
        diags.append(src.diag((*path, "field"), "unknown-field", f"unknown field `{leaf.field}`",
                              f"{hint}see docs/rule-language.md for every field path"))
        return
    op, value = leaf.op, leaf.value
    vpath = (*path, op)
    if op == "exists":
        return
    if op in _NUMERIC_OPS and spec.type not in ("int", "scalar"):
        diags.append(src.diag(vpath, "bad-operator", f"`{op}` needs a numeric field; `{spec.path}` is a {spec.type}",
                              "use `eq`, `ne`, `in` or `not_in`"))
        return
    if op in _LIST_OPS:
        for i, item in enumerate(value):
            problem = _check_value(spec, op, item)
            if problem:
                diags.append(src.diag((*vpath, i), "type-mismatch", *problem))
        return
    if op in _NUMERIC_OPS:
        return  # pydantic already required a number
    problem = _check_value(spec, op, value)
    if problem:
        diags.append(src.diag(vpath, "unknown-value" if "not a value" in problem[0] else "type-mismatch", *problem))


def _check_condition(src: Located, path: Path, cond: Condition, diags: list[Diagnostic]) -> None:
    if isinstance(cond, AllOf):
        for i, sub in enumerate(cond.all):
            _check_condition(src, (*path, "all", i), sub, diags)
    elif isinstance(cond, AnyOf):
        for i, sub in enumerate(cond.any):
            _check_condition(src, (*path, "any", i), sub, diags)
    elif isinstance(cond, NotOf):
        _check_condition(src, (*path, "not"), cond.not_, diags)
    else:
        _check_leaf(src, path, cond, diags)


def validate_file(src: Located, *, in_connectors_dir: bool, max_rules: int) -> tuple[RuleFile | None, list[Diagnostic]]:
    """Validate one parsed file; returns the model (None if any error) and every diagnostic."""
    data = src.data
    if not isinstance(data, dict):
        return None, [src.diag((), "not-a-mapping", f"a rule file is a mapping, got {_type_name(data)}",
                               "start the file with `version: 1` and a `rules:` list")]
    diags: list[Diagnostic] = []
    header_data = {k: v for k, v in data.items() if k != "rules"}
    rules_data = data.get("rules", [])
    if rules_data is None:  # `rules:` with nothing under it is an empty list
        rules_data = []
    header: RuleFile | None = None
    try:
        header = RuleFile.model_validate({**header_data, "rules": []})
    except ValidationError as exc:
        diags += located_validation_errors(src, (), header_data, exc)
    if not isinstance(rules_data, list):
        diags.append(src.diag(("rules",), "invalid-value", "`rules` must be a list of rules"))
        rules_data = []
    if len(rules_data) > max_rules:
        diags.append(src.diag(("rules",), "too-many-rules",
                              f"{len(rules_data)} rules exceed the limit of {max_rules}",
                              "split the file, or raise Limits.max_rules"))
        rules_data = []

    if header is not None:
        # any well-formed name: third-party and newer connectors get rules too; a near miss of a
        # known name is a warning of the layered set (kvpolicy.policy.layers.connector_warnings)
        problem = None if header.connector is None else connector_name_problem(header.connector)
        if problem is not None:
            diags.append(src.diag(("connector",), "invalid-connector-name", problem,
                                  "name the connector's class, as vLLM's `kv_connector` does"))
        if in_connectors_dir and header.connector is None:
            diags.append(src.diag((), "missing-connector", "a file in `connectors/` must declare `connector:`",
                                  "add `connector: <ConnectorClassName>`"))
        if not in_connectors_dir and header.connector is not None:
            diags.append(src.diag(("connector",), "misplaced-connector-file",
                                  "connector files belong in the `connectors/` directory",
                                  "move the file, or remove `connector:` to make its rules global"))
        if header.defaults is not None and header.connector is not None:
            diags.append(src.diag(("defaults",), "misplaced-defaults", "`defaults` belong in a global file",
                                  "move `defaults` to global.yaml"))
        if header.member_preferences is not None and header.connector is None:
            diags.append(src.diag(("member_preferences",), "misplaced-member-preferences",
                                  "`member_preferences` applies only to a connector file"))
        if header.defaults is not None:
            seen: set[str] = set()
            for i, text in enumerate(header.defaults.layout_order):
                try:
                    Layout.parse(text)
                except ValueError as exc:
                    diags.append(src.diag(("defaults", "layout_order", i), "unknown-layout", str(exc)))
                if text in seen:
                    diags.append(src.diag(("defaults", "layout_order", i), "duplicate-layout",
                                          f"layout `{text}` listed twice"))
                seen.add(text)

    rules: list[Rule] = []
    for i, rule_data in enumerate(rules_data):
        if isinstance(rule_data, dict) and "when" in rule_data and rule_data["when"] is None:
            # `when:` with nothing under it (a condition commented out) would silently mean "always"
            diags.append(src.diag(("rules", i, "when"), "empty-condition", "`when` is empty",
                                  "write the condition, or delete `when` if the rule always applies", key=True))
            continue
        try:
            rule = Rule.model_validate(rule_data)
        except ValidationError as exc:
            diags += located_validation_errors(src, ("rules", i), rule_data, exc)
            continue
        if rule.when is not None:
            _check_condition(src, ("rules", i, "when"), rule.when, diags)
        if not rule.pattern.model_fields_set - {k for k in rule.pattern.model_fields_set
                                                  if getattr(rule.pattern, k) is None}:
            diags.append(src.diag(("rules", i, rule.effect.value), "empty-pattern",
                                  f"the `{rule.effect.value}` pattern matches every layout",
                                  "name a `layout`, or a property such as `block_outermost` or `placement`"))
        elif not any(rule.pattern.matches(x) for x in Layout):
            diags.append(src.diag(("rules", i, rule.effect.value), "unsatisfiable-pattern",
                                  f"the `{rule.effect.value}` pattern `{rule.pattern}` matches no layout",
                                  "drop a key: no layout has all of these properties"))
        rules.append(rule)
    if diags or header is None:
        return None, diags
    return header.model_copy(update={"rules": rules}), []

