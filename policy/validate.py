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
from kvpolicy.policy.near_names import nearest_operator
from kvpolicy.policy.rule_model import (
    OPERATORS,
    AllOf,
    AnyOf,
    Condition,
    Defaults,
    Effect,
    Leaf,
    NotOf,
    Rule,
    RuleFile,
    Waiver,
)
from kvpolicy.policy.value_hints import plain_message, type_hint
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
    "waiver": tuple(Waiver.model_fields),
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
    if path[0] == "waivers" and len(path) == 2:
        return _KNOWN_KEYS["waiver"]
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
        if src.is_invalid(path) and kind != "extra_forbidden":
            continue  # the parser already reported this value (an unreadable tag, a bad number)
        if path in seen and kind not in ("extra_forbidden", "missing"):
            continue  # one message per value: a union (`int | float`) reports each branch (each missing key is one)
        seen.add(path)
        if kind == "extra_forbidden":
            key = str(err["loc"][-1])
            valid = valid_keys(path[:-1])
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            diags.append(src.diag(path, "unknown-key", f"unknown key `{key}`",
                                  f"{hint}valid keys here: {', '.join(valid)}" if valid else None, key=True))
        elif kind == "missing":
            key = str(err["loc"][-1])
            diags.append(src.diag(path, "missing-key", f"missing required key `{key}`",
                                  "start the file with `version: 1`" if key == "version" and len(err["loc"]) == 1
                                  else f"add `{key}:` to this mapping, with its value"))
        elif kind in ("string_type", "literal_error", "int_type", "enum") and isinstance(err.get("input"), bool):
            shown = src.yaml11_bools.get(path, str(err["input"]).lower())
            expected = err["msg"].replace("Input should be", "expected").replace("a valid string", "a string")
            expected = expected[:1].lower() + expected[1:]
            diags.append(src.diag(path, "invalid-value", f"{expected}, got boolean `{shown}`",
                                  "YAML reads yes/no/on/off/true/false as booleans: quote the value, or write "
                                  "the value this key takes"))
        elif kind == "string_pattern_mismatch":
            diags.append(src.diag(path, "invalid-id", f"`{err['input']}` is not a valid id",
                                  "use lowercase letters, digits, `.`, `_` and `-`, starting with a letter or digit"))
        else:
            msg = plain_message(err["msg"])
            code = ("invalid-condition" if kind == "condition" or msg.startswith("a leaf")
                    else "invalid-rule" if kind == "value_error" and len(path) == 2 and path[0] == "rules"
                    else "invalid-waiver" if kind == "value_error" and len(path) == 2 and path[0] == "waivers"
                    else "invalid-value")
            shown = err.get("input")
            if kind not in ("condition", "value_error") and isinstance(shown, (str, int, float, bool)):
                msg += f", got {_type_name(shown)} `{str(shown).lower() if isinstance(shown, bool) else shown}`"
            hint = _operator_hint(msg, shown) or type_hint(kind, shown)
            if kind.startswith(("date_", "datetime_")):  # a waiver's `expires`
                hint = "write a day of the calendar as `YYYY-MM-DD`, e.g. `2027-02-28`"
            diags.append(src.diag(path, code, msg, hint))
    return diags


def _operator_hint(message: str, leaf: Any) -> str | None:
    """For a leaf with no known operator: the operator its unknown key most likely means (``greater_than``
    -> ``gt``), as the line to write."""
    if not message.startswith("a leaf needs exactly one operator, found none") or not isinstance(leaf, dict):
        return None
    for key in leaf:
        if key == "field" or not isinstance(key, str):
            continue
        op = nearest_operator(key, OPERATORS)
        if op is not None:
            return f"did you mean `{op}`? write `{op}: {_show(leaf[key])}` instead of `{key}: {_show(leaf[key])}`"
    return None


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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
        return (f"`{spec.path}` is a boolean, got {_type_name(value)} `{_show(value)}`",
                "write `true` or `false` unquoted")
    if spec.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        # INVARIANT: a boolean is never an integer here, although Python's bool subclasses int:
        # `eq: true` on an integer field would otherwise load and never match
        hint = ("write the number unquoted" if isinstance(value, str)
                else "write `exists: true` to test that the field has a value" if isinstance(value, bool) else None)
        return f"`{spec.path}` is an integer, got {_type_name(value)} `{_show(value)}`", hint
    if spec.type == "str":
        if not isinstance(value, str):
            hint = ("YAML reads yes/no/on/off/true/false as booleans: quote it" if isinstance(value, bool)
                    else "quote it to compare with text")
            return f"`{spec.path}` is a string, got {_type_name(value)} `{_show(value)}`", hint
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


def _raw_leaves(data: Any, path: Path) -> list[tuple[Path, Any]]:
    """The leaf mappings of a raw condition tree, following `all`/`any`/`not` as the model's
    discriminator does, so leaves are checked even where another part of the rule is broken."""
    if not isinstance(data, dict):
        return []
    for key in ("all", "any"):
        if key in data:
            items = data[key] if isinstance(data[key], list) else []
            return [leaf for i, sub in enumerate(items) for leaf in _raw_leaves(sub, (*path, key, i))]
    if "not" in data:
        return _raw_leaves(data["not"], (*path, "not"))
    return [(path, data)]


def _effect_problem(data: dict[str, Any]) -> str | None:
    """The rule model's effect check on raw data (pydantic runs it only once every field is valid)."""
    effects = [e.value for e in Effect if data.get(e.value) is not None]
    if len(effects) != 1:
        found = ", ".join(f"`{e}`" for e in effects) or "none"
        return f"a rule needs exactly one effect of `forbid`, `require`, `prefer`; found {found}"
    if data.get("weight") is not None and data.get("prefer") is None:
        return "`weight` applies only to a `prefer` rule"
    if data.get("enforcement") is not None and data.get("prefer") is not None:
        return "`enforcement` applies only to a `forbid` or `require` rule"
    return None


def _check_rule(src: Located, path: Path, data: Any, diags: list[Diagnostic]) -> Rule | None:
    """Every problem of one rule: its shape, the effect count, each leaf's field and operand; the rule if none."""
    if src.is_invalid(path):
        return None
    if isinstance(data, dict) and "when" in data and data["when"] is None:
        # `when:` with nothing under it (a condition commented out) would silently mean "always"
        diags.append(src.diag((*path, "when"), "empty-condition", "`when` is empty",
                              "write the condition, or delete `when` if the rule always applies", key=True))
        return None
    found: list[Diagnostic] = []
    try:
        rule = Rule.model_validate(data)
    except ValidationError as exc:
        rule = None
        found += located_validation_errors(src, path, data, exc)
        if isinstance(data, dict):
            problem = _effect_problem(data)
            if problem and not any(d.message.startswith(problem[:20]) for d in found):
                found.append(src.diag(path, "invalid-rule", problem))
            for leaf_path, leaf_data in _raw_leaves(data.get("when"), (*path, "when")):
                try:
                    leaf = Leaf.model_validate(leaf_data)
                except ValidationError:
                    continue  # reported above, from the whole rule
                _check_leaf(src, leaf_path, leaf, found)
    if rule is not None:
        if rule.when is not None:
            _check_condition(src, (*path, "when"), rule.when, found)
        if not rule.pattern.model_fields_set - {k for k in rule.pattern.model_fields_set
                                                  if getattr(rule.pattern, k) is None}:
            found.append(src.diag((*path, rule.effect.value), "empty-pattern",
                                  f"the `{rule.effect.value}` pattern matches every layout",
                                  "name a `layout`, or a property such as `block_outermost` or `placement`"))
        elif not any(rule.pattern.matches(x) for x in Layout):
            found.append(src.diag((*path, rule.effect.value), "unsatisfiable-pattern",
                                  f"the `{rule.effect.value}` pattern `{rule.pattern}` matches no layout",
                                  "drop a key: no layout has all of these properties"))
    diags += found
    return rule if not found else None


def _check_waiver(src: Located, path: Path, data: Any, diags: list[Diagnostic]) -> Waiver | None:
    """Every problem of one waiver: its shape (owner, reason, expiry required) and its condition's leaves."""
    if src.is_invalid(path):
        return None
    if isinstance(data, dict) and "when" in data and data["when"] is None:
        diags.append(src.diag((*path, "when"), "empty-condition", "`when` is empty",
                              "write where the waiver applies, or delete `when` to waive the rule wherever it "
                              "applies", key=True))
        return None
    found: list[Diagnostic] = []
    try:
        waiver = Waiver.model_validate(data)
    except ValidationError as exc:
        waiver = None
        found += located_validation_errors(src, path, data, exc)
        if isinstance(data, dict):
            for leaf_path, leaf_data in _raw_leaves(data.get("when"), (*path, "when")):
                try:
                    leaf = Leaf.model_validate(leaf_data)
                except ValidationError:
                    continue
                _check_leaf(src, leaf_path, leaf, found)
    if waiver is not None and waiver.when is not None:
        _check_condition(src, (*path, "when"), waiver.when, found)
    diags += found
    return waiver if not found else None


def validate_file(src: Located, *, in_connectors_dir: bool, max_rules: int,
                  partial: list[tuple[int, Rule, str | None]] | None = None
                  ) -> tuple[RuleFile | None, list[Diagnostic]]:
    """Validate one parsed file; returns the model (None if any error) and every diagnostic. ``partial``
    collects (index, rule, the file's connector) for each rule that is valid on its own, also when the file
    has errors elsewhere: the warnings about them are said with the errors."""
    data = src.data
    if src.is_invalid(()):
        return None, []
    if not isinstance(data, dict):
        return None, [src.diag((), "not-a-mapping", f"a rule file is a mapping, got {_type_name(data)}",
                               "start the file with `version: 1` and a `rules:` list")]
    diags: list[Diagnostic] = []
    header_data = {k: v for k, v in data.items() if k not in ("rules", "waivers")}
    rules_data = data.get("rules", [])
    if rules_data is None:  # `rules:` with nothing under it is an empty list
        rules_data = []
    header: RuleFile | None = None
    try:
        header = RuleFile.model_validate({**header_data, "rules": []})
    except ValidationError as exc:
        diags += located_validation_errors(src, (), header_data, exc)
    if isinstance(header_data.get("version"), bool):  # pydantic's Literal[1] takes `true` (True == 1)
        shown = src.yaml11_bools.get(("version",), _show(header_data["version"]))
        diags.append(src.diag(("version",), "invalid-value", f"expected 1, got boolean `{shown}`",
                              "write `version: 1`"))
    if src.is_invalid(("rules",)):
        rules_data = []
    elif not isinstance(rules_data, list):
        diags.append(src.diag(("rules",), "invalid-value", "`rules` must be a list of rules"))
        rules_data = []
    if len(rules_data) > max_rules:
        diags.append(src.diag(("rules",), "too-many-rules",
                              f"{len(rules_data)} rules exceed the limit of {max_rules}",
                              "split the file, or raise Limits.max_rules"))
        rules_data = []
    waivers_data = data.get("waivers", [])
    if waivers_data is None:  # `waivers:` with nothing under it is an empty list
        waivers_data = []
    if src.is_invalid(("waivers",)):
        waivers_data = []
    elif not isinstance(waivers_data, list):
        diags.append(src.diag(("waivers",), "invalid-value", "`waivers` must be a list of waivers"))
        waivers_data = []
    elif len(waivers_data) > max_rules:
        diags.append(src.diag(("waivers",), "too-many-rules",
                              f"{len(waivers_data)} waivers exceed the limit of {max_rules}",
                              "split the file, or raise Limits.max_rules"))
        waivers_data = []

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
        if waivers_data and header.connector is not None:
            diags.append(src.diag(("waivers",), "misplaced-waivers", "`waivers` belong in a global file",
                                  "move them to a global file; scope one to a connector with "
                                  "`when: {field: connector.name, eq: <Connector>}`", key=True))
        if header.member_preferences is not None and header.connector is None:
            diags.append(src.diag(("member_preferences",), "misplaced-member-preferences",
                                  "`member_preferences` applies only to a connector file"))
        if header.defaults is not None:
            seen: dict[Layout, tuple[int, str]] = {}
            for i, text in enumerate(header.defaults.layout_order):
                try:
                    layout = Layout.parse(text)
                except ValueError as exc:
                    diags.append(src.diag(("defaults", "layout_order", i), "unknown-layout", str(exc)))
                    continue
                if layout in seen:  # by meaning: `per_layer/HND` is LBHNC
                    j, first = seen[layout]
                    what = f"`{text}`" if text == first else f"`{text}` (layout {layout}, as `{first}` is)"
                    diags.append(src.diag(("defaults", "layout_order", i), "duplicate-layout",
                                          f"{what} is already listed at layout_order[{j}]", "list each layout once"))
                seen.setdefault(layout, (i, text))

    rules: list[Rule] = []
    for i, rule_data in enumerate(rules_data):
        rule = _check_rule(src, ("rules", i), rule_data, diags)
        if rule is not None:
            rules.append(rule)
            if partial is not None and header is not None:
                partial.append((i, rule, header.connector))
    waivers: list[Waiver] = []
    for i, waiver_data in enumerate(waivers_data):
        waiver = _check_waiver(src, ("waivers", i), waiver_data, diags)
        if waiver is not None:
            waivers.append(waiver)
    if diags or header is None:
        return None, diags
    return header.model_copy(update={"rules": rules, "waivers": waivers}), []

