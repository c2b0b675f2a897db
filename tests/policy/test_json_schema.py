"""The published JSON Schemas judge files as the loaders do.

`tests/fixtures/schema_corpus/` holds one file per kind of mistake (plus a few
valid edge cases named ``valid-*``): ``global/`` files are loaded as a rule
set's global.yaml, ``connectors/`` files as a connector file, ``cases/`` files
as policy test files. Every file goes through the loader and the schema; both
must give the file's expected verdict. Files named ``loader-only-*`` hold a
mistake JSON Schema cannot express: the loader refuses them and the schema
accepts them, each for the reason listed in `LOADER_ONLY`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # a test extra: missing, the suite fails rather than skips
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.engine.cli.schema import case_file_schema, rule_file_schema
from kvpolicy.engine.policy_tests import PolicyTestError, load_cases
from kvpolicy.policy.context import FIELDS
from kvpolicy.policy.errors import RuleLoadError
from kvpolicy.policy.json_schema import LOADER_ONLY_CHECKS
from kvpolicy.policy.layouts import LEGACY_NAMES, Layout, LayoutPattern
from kvpolicy.policy.load import load_rules_from_texts
from kvpolicy.policy.rule_model import OPERATORS

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fixtures" / "schema_corpus"

RULES = jsonschema.Draft202012Validator(rule_file_schema())
CASES = jsonschema.Draft202012Validator(case_file_schema())

# file stem -> why JSON Schema cannot say it
LOADER_ONLY = {
    "loader-only-duplicate-key": "YAML duplicate keys: the parsed data a schema sees keeps only one of them",
    "loader-only-integral-float": "`8.0` for an integer: JSON has one number type, so 8.0 is the integer 8",
    "loader-only-integral-float-weight": "`2.0` for an integer: JSON has one number type",
    "loader-only-nan": "`.nan`: JSON has no NaN, and NaN passes every numeric bound",
    "loader-only-connector-outside-connectors-dir": "where the file lies (`connectors/` or not) is not in the data",
    "loader-only-no-connector-in-connectors-dir": "where the file lies (`connectors/` or not) is not in the data",
    "loader-only-unknown-connector": "whether vLLM knows a connector is a \"did you mean\" over the release "
                                     "profiles; the schema accepts any name so third-party connectors validate",
    "loader-only-connector-name-near-miss": "`connector.name` takes any class name (third-party connectors); a "
                                            "near miss of a known one (edit distance) is the loader's to judge",
    "loader-only-duplicate-case-name": "uniqueness of one key across list items (`uniqueItems` compares whole items)",
    "loader-only-backend-alias-differs": "comparing two values (`backend` vs `attention_backend`, case-insensitive)",
    "loader-only-integer-past-64-bits-in-spec": "an integer literal past 64 bits in a free-form mapping (`spec`): "
                                                "JSON has one number type, so it is the float 9.2e18",
    "loader-only-duplicate-rule-id-in-file": "uniqueness of one key across list items, in one file as across files",
    "loader-only-integer-past-64-bits-for-a-number": "an integer literal past 64 bits where any number may stand: "
                                                     "JSON has one number type, so it is the float 9.2e18",
}

# An unknown connector name is an error today and a "did you mean" warning once any connector may have
# rules (#15); the schema accepts it either way.
LOADER_MAY_ACCEPT = {"loader-only-unknown-connector"}

# Mistakes that span files: the schema judges one file at a time and accepts each of these.
CROSS_FILE = {
    "duplicate rule id across files": {
        "global.yaml": "version: 1\nrules:\n  - {id: r, description: d, forbid: {placement: cross_layer}}\n",
        "connectors/nixl.yaml": "version: 1\nconnector: NixlConnector\nrules:\n"
                                "  - {id: r, description: d, forbid: {layout: BHLNC}}\n",
    },
    "two files for one connector": {
        "connectors/a.yaml": "version: 1\nconnector: NixlConnector\nrules: []\n",
        "connectors/b.yaml": "version: 1\nconnector: NixlConnector\nrules: []\n",
    },
    "defaults declared twice": {
        "a.yaml": "version: 1\ndefaults: {layout_order: [LBNHC]}\nrules: []\n",
        "b.yaml": "version: 1\ndefaults: {layout_order: [LBHNC]}\nrules: []\n",
    },
}


def _corpus(kind: str) -> list[Path]:
    return sorted((CORPUS / kind).glob("*.yaml"))


def _expected(path: Path) -> str:
    if path.stem.startswith("loader-only-"):
        return "loader-only"
    return "valid" if path.stem.startswith("valid-") else "invalid"


def _rules_load(name: str, text: str) -> list[str]:
    try:
        load_rules_from_texts({name: text})
    except RuleLoadError as exc:
        return [f"{d.code}: {d.message}" for d in exc.diagnostics]
    return []


def _schema_errors(validator: jsonschema.Draft202012Validator, data: Any) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(data)]


def test_corpus_is_large_and_every_loader_only_file_has_a_reason() -> None:
    files = [*_corpus("global"), *_corpus("connectors"), *_corpus("cases")]
    assert sum(_expected(p) == "invalid" for p in files) >= 40
    assert {p.stem for p in files if _expected(p) == "loader-only"} == set(LOADER_ONLY)


def _assert_agree(expected: str, loader: list[str], schema: list[str], loader_may_accept: bool) -> None:
    """A corpus file's verdicts: both accept, both refuse, or (loader-only) only the loader refuses."""
    if expected == "valid":
        assert (loader, schema) == ([], [])
    elif expected == "invalid":
        assert loader, "the loader accepts a broken file"
        assert schema, f"the schema accepts what the loader refuses: {loader}"
    else:
        assert loader or loader_may_accept, "a loader-only mistake the loader accepts"
        assert schema == [], "the schema now catches this: move it out of LOADER_ONLY"


@pytest.mark.parametrize("path", [*_corpus("global"), *_corpus("connectors")],
                         ids=lambda p: p.parent.name + "/" + p.stem)
def test_rule_corpus_loader_and_schema_agree(path: Path) -> None:
    text = path.read_text()
    name = "connectors/c.yaml" if path.parent.name == "connectors" else "global.yaml"
    loader = _rules_load(name, text)
    schema = _schema_errors(RULES, yaml.safe_load(text))
    _assert_agree(_expected(path), loader, schema, loader_may_accept=path.stem in LOADER_MAY_ACCEPT)


@pytest.mark.parametrize("path", _corpus("cases"), ids=lambda p: p.stem)
def test_case_corpus_loader_and_schema_agree(path: Path) -> None:
    try:
        load_cases([path])
        loader: list[str] = []
    except PolicyTestError as exc:
        loader = [f"{d.code}: {d.message}" for d in exc.diagnostics]
    schema = _schema_errors(CASES, yaml.safe_load(path.read_text()))
    _assert_agree(_expected(path), loader, schema, loader_may_accept=False)


@pytest.mark.parametrize("texts", CROSS_FILE.values(), ids=list(CROSS_FILE))
def test_cross_file_mistakes_are_the_loaders_alone(texts: dict[str, str]) -> None:
    assert _rules_load_all(texts)
    for text in texts.values():
        assert _schema_errors(RULES, yaml.safe_load(text)) == []


def _rules_load_all(texts: dict[str, str]) -> list[str]:
    try:
        load_rules_from_texts(texts)
    except RuleLoadError as exc:
        return [d.code for d in exc.diagnostics]
    return []


def test_shipped_files_pass_both() -> None:
    rule_files = [*(ROOT / "rules").glob("*/*.yaml"), *(ROOT / "rules").glob("*/connectors/*.yaml")]
    case_files = list((ROOT / "rules").glob("*/tests/*.yaml"))
    assert len(rule_files) > 20 and len(case_files) >= 6
    for path in rule_files:
        assert _schema_errors(RULES, yaml.safe_load(path.read_text())) == [], path
    for path in case_files:
        assert _schema_errors(CASES, yaml.safe_load(path.read_text())) == [], path


def test_schemas_are_valid_2020_12_with_stable_ids() -> None:
    for validator, urn in ((RULES, "urn:kvpolicy:rule-file:1"), (CASES, "urn:kvpolicy:policy-test-file:1")):
        jsonschema.Draft202012Validator.check_schema(validator.schema)
        assert validator.schema["$id"] == urn
        json.dumps(validator.schema)  # plain JSON: no tuples or enums left in it


# ---------------------------------------------------------------------------------------------
# Generated documents


def _operand(spec_type: str, choices: tuple[str, ...] | None) -> st.SearchStrategy[Any]:
    if spec_type == "bool":
        return st.booleans()
    if spec_type == "int":
        return st.integers(-(2**40), 2**40)
    if choices is not None:
        return st.sampled_from(choices)
    if spec_type == "str":
        return st.text(max_size=12)
    return st.one_of(st.text(max_size=6), st.booleans(), st.integers(-100, 100),
                     st.floats(allow_nan=False, allow_infinity=False))


_PATHS = [*FIELDS, "connector.extra.num_streams", "connector.extra.a.b", "connector.extra.x y"]


@st.composite
def valid_leaves(draw: st.DrawFn) -> dict[str, Any]:
    path = draw(st.sampled_from(_PATHS))
    spec = FIELDS.get(path)
    spec_type, choices = (spec.type, spec.choices) if spec else ("scalar", None)
    numeric = spec_type in ("int", "scalar")
    op = draw(st.sampled_from([op for op in OPERATORS if numeric or op not in ("lt", "le", "gt", "ge")]))
    value = draw(_operand(spec_type, choices))
    if op in ("in", "not_in"):
        value = draw(st.lists(_operand(spec_type, choices), min_size=1, max_size=4))
    elif op == "exists":
        value = draw(st.booleans())
    elif op in ("lt", "le", "gt", "ge"):
        value = draw(st.one_of(st.integers(-1000, 1000), st.floats(-1e6, 1e6, allow_nan=False)))
    return {"field": path, op: value}


conditions = st.recursive(valid_leaves(), lambda inner: st.one_of(
    st.builds(lambda xs: {"all": xs}, st.lists(inner, min_size=1, max_size=3)),
    st.builds(lambda xs: {"any": xs}, st.lists(inner, min_size=1, max_size=3)),
    st.builds(lambda x: {"not": x}, inner),
), max_leaves=6)


@st.composite
def patterns(draw: st.DrawFn) -> dict[str, Any]:
    """A non-empty pattern that some layout (drawn first) satisfies."""
    layout = draw(st.sampled_from(list(Layout)))
    facts: dict[str, Any] = {
        "layout": draw(st.sampled_from([layout.value, *(n for n, x in LEGACY_NAMES.items() if x is layout)])),
        "placement": layout.placement.value, "head_order": layout.head_order.value,
        **{k: getattr(layout, "is_" + k) for k in ("layer_compact", "block_outermost", "block_compact",
                                                   "block_contiguous")},
    }
    assert set(facts) == set(LayoutPattern.model_fields)
    keys = draw(st.lists(st.sampled_from(sorted(facts)), min_size=1, max_size=3, unique=True))
    out = {k: facts[k] for k in keys}
    if "layout" in out and draw(st.booleans()):
        out["layout"] = [out["layout"], draw(st.sampled_from([x.value for x in Layout]))]
    return out


@st.composite
def rules(draw: st.DrawFn) -> dict[str, Any]:
    effect = draw(st.sampled_from(["forbid", "require", "prefer"]))
    rule: dict[str, Any] = {"id": draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)),
                            "description": draw(st.text(min_size=1, max_size=20)), effect: draw(patterns())}
    if draw(st.booleans()):
        rule["when"] = draw(conditions)
    if effect == "prefer" and draw(st.booleans()):
        rule["weight"] = draw(st.integers(1, 1000))
    if draw(st.booleans()):
        rule["reference"] = "vllm-project/vllm#48412"
    return rule


@st.composite
def rule_documents(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    doc: dict[str, Any] = {"version": 1}
    connector = draw(st.booleans())
    if connector:
        doc["connector"] = "MultiConnector"
        if draw(st.booleans()):
            doc["member_preferences"] = draw(st.sampled_from(["all", "any", "sum", "agree"]))
    elif draw(st.booleans()):
        doc["defaults"] = {"layout_order": draw(st.lists(st.sampled_from([x.value for x in Layout]), min_size=1,
                                                          unique=True))}
    found = draw(st.lists(rules(), max_size=4, unique_by=lambda r: r["id"]))
    doc["rules"] = found
    return ("connectors/multi.yaml" if connector else "global.yaml"), doc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rule_documents())
def test_generated_valid_documents_pass_both(named: tuple[str, dict[str, Any]]) -> None:
    name, doc = named
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    assert _rules_load(name, text) == []
    assert _schema_errors(RULES, yaml.safe_load(text)) == []


# One mistake applied to a valid document: both must refuse it.
def _break(doc: dict[str, Any], how: str, where: int) -> dict[str, Any] | None:
    doc = json.loads(json.dumps(doc))
    rules_ = doc["rules"]
    if not rules_:
        return None
    rule = rules_[where % len(rules_)]
    if how == "second-effect":
        other = next(e for e in ("forbid", "require", "prefer") if e not in rule)
        rule[other] = {"placement": "per_layer"}
    elif how == "no-effect":
        for e in ("forbid", "require", "prefer", "weight"):
            rule.pop(e, None)
    elif how == "misspelt-field":
        rule["when"] = {"field": "kv.num_layer", "ge": 8}
    elif how == "second-operator":
        rule["when"] = {"field": "kv.num_layers", "ge": 8, "lt": 16}
    elif how == "string-for-int":
        rule["when"] = {"field": "kv.block_size", "eq": "16"}
    elif how == "unknown-operator":
        rule["when"] = {"not": {"field": "kv.kind", "is": "full"}}
    elif how == "bad-layout":
        e = next(e for e in ("forbid", "require", "prefer") if e in rule)
        rule[e] = {"layout": "per-layer/NHD"}
    elif how == "extra-key":
        rule["severity"] = "high"
    else:  # pragma: no cover
        raise AssertionError(how)
    return doc


MISTAKES = ["second-effect", "no-effect", "misspelt-field", "second-operator", "string-for-int",
            "unknown-operator", "bad-layout", "extra-key"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rule_documents(), st.sampled_from(MISTAKES), st.integers(0, 3))
def test_generated_documents_with_one_mistake_fail_both(named: tuple[str, dict[str, Any]], how: str,
                                                        where: int) -> None:
    name, doc = named
    broken = _break(doc, how, where)
    if broken is None:
        return
    text = yaml.safe_dump(broken, allow_unicode=True, sort_keys=False)
    assert _rules_load(name, text), how
    assert _schema_errors(RULES, yaml.safe_load(text)), how


@pytest.mark.parametrize(("stem", "path", "says"), [
    ("misspelt-field-path", ["rules", 0, "when", "field"], "is not one of"),
    ("extra-prefix-without-key", ["rules", 0, "when", "field"], "is too short"),
    ("layout-name-lower-case", ["rules", 0, "forbid", "layout", 0], "is not one of"),
    ("int-field-string", ["rules", 0, "when", "eq"], "is not of type 'integer'"),
    ("numeric-op-on-bool-field", ["rules", 0, "when"], "False schema does not allow 1"),
])
def test_editors_are_pointed_at_the_mistake(stem: str, path: list[Any], says: str) -> None:
    data = yaml.safe_load((CORPUS / "global" / f"{stem}.yaml").read_text())
    best = jsonschema.exceptions.best_match(RULES.iter_errors(data))
    assert list(best.absolute_path) == path and says in best.message


# ---------------------------------------------------------------------------------------------
# Generated documents the schema accepts: each loads, or fails only with a listed loader-only check


def _edits(value: Any) -> list[Any]:
    """What a hostile writer puts in place of ``value``: integers at and past 64 bits, floats of integers,
    strings with a newline (before, inside, after), control characters, blanks, case changes, a list with an
    item twice or a layout named twice by its alias, nulls and empties."""
    out: list[Any] = [None, True, 0, -1, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, 1e300, -0.0, "", "x"]
    if isinstance(value, str):
        out += [value + "\n", "\n" + value, value[:1] + "\n" + value[1:], value + " ", value + "\t",
                value + "\x07", value + "\x85", value.upper(), value.lower(), value + "\u00e9", value * 40]
    if isinstance(value, int) and not isinstance(value, bool):
        out += [float(value), value + 2**64]
    if isinstance(value, list) and value:
        out += [value + value[:1], [*value, "per_layer/HND", "LBHNC"], [], value[::-1]]
    if isinstance(value, dict):
        out += [{}, {**value, "x": 1}]
    return out


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    out = [(path, doc)] if path else []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, child in items:
        out += _nodes(child, (*path, key))
    return out


def _replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


@st.composite
def edited_documents(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid document (`rule_documents`) with one to three values replaced by hostile ones (`_edits`),
    or a rule repeated, or a connector file's `connector` replaced."""
    name, doc = draw(rule_documents())
    for _ in range(draw(st.integers(1, 3))):
        nodes = _nodes(doc)
        path, value = draw(st.sampled_from(nodes))
        doc = _replaced(doc, path, draw(st.sampled_from(_edits(value))))
    return name, doc


def _loader_only(code: str, message: str) -> bool:
    return any(check.covers(code, message) for check in LOADER_ONLY_CHECKS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(edited_documents())
def test_any_document_the_schema_accepts_loads_or_fails_only_a_loader_only_check(
        named: tuple[str, dict[str, Any]]) -> None:
    """What an editor or CI validating against docs/rule-file.schema.json passes, `kvpolicy validate` passes
    too, but for the checks JSON Schema cannot express (`LOADER_ONLY_CHECKS`, listed in docs/cli.md). The
    schema accepted a rule id or a connector name ending in a newline (Python's `$`), integers past 64 bits
    for integer fields, and a layout listed twice in `layout_order` by its alias."""
    name, doc = named
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    data = yaml.safe_load(text)
    if _schema_errors(RULES, data):
        return
    try:
        load_rules_from_texts({name: text})
    except RuleLoadError as exc:
        unlisted = [d for d in exc.diagnostics if not _loader_only(d.code, d.message)]
        assert not unlisted, f"the schema accepts what the loader refuses: {[d.render() for d in unlisted]}"


def test_every_loader_only_check_is_documented() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    listed = text[text.index("Only `kvpolicy validate` checks"):text.index("The policy test schema refuses")]
    for check in LOADER_ONLY_CHECKS:
        assert f"`{check.code}`" in listed, check
