"""`kvpolicy schema`: the committed schema is the current one, and it describes the shipped files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_capture import cli

from kvpolicy.engine.cli.schema import schema_text

ROOT = Path(__file__).resolve().parents[2]


def test_committed_schema_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "schema")
    assert code == 0
    committed = (ROOT / "docs" / "rule-file.schema.json").read_text()
    assert committed == out, "regenerate: python -m kvpolicy.engine.cli.main schema > docs/rule-file.schema.json"


def test_schema_header(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(schema_text())
    assert data["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert data["$id"] == "urn:kvpolicy:rule-file:1"
    assert data["title"] == "kvpolicy rule file"
    assert set(data["properties"]) == {"version", "connector", "member_preferences", "defaults", "rules", "waivers"}
    cases = json.loads(schema_text(cases=True))
    assert cases["title"] == "kvpolicy policy test file" and set(cases["properties"]) == {"version", "cases"}


def test_shipped_rule_files_name_the_schema() -> None:
    for path in [*(ROOT / "rules").glob("*/*.yaml"), *(ROOT / "rules").glob("*/connectors/*.yaml")]:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# yaml-language-server: $schema=") and first.endswith("docs/rule-file.schema.json")


def test_schema_accepts_shipped_files_and_rejects_typos() -> None:
    import jsonschema  # a test extra: missing, the suite must fail, not skip
    rule_schema = json.loads(schema_text())
    jsonschema.Draft202012Validator.check_schema(rule_schema)
    for path in [*(ROOT / "rules").glob("*/*.yaml"), *(ROOT / "rules").glob("*/connectors/*.yaml")]:
        jsonschema.validate(yaml.safe_load(path.read_text()), rule_schema)
    bad = {"version": 1, "rules": [{"id": "x", "description": "d", "forbid": {"placement": "cross_layer"},
                                    "wieght": 1}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, rule_schema)
    case_schema = json.loads(schema_text(cases=True))
    jsonschema.Draft202012Validator.check_schema(case_schema)
    for path in (ROOT / "rules").glob("*/tests/*.yaml"):
        jsonschema.validate(yaml.safe_load(path.read_text()), case_schema)


def test_schema_takes_a_waiver_and_refuses_one_without_an_owner() -> None:
    """A waiver (docs/rule-language.md, "Waivers") as editors check it: owner, reason and a `YYYY-MM-DD` expiry."""
    import jsonschema

    schema = json.loads(schema_text())
    good = {"version": 1, "waivers": [{"rule": "r", "owner": "kv-team", "reason": "why", "expires": "2027-01-31",
                                       "when": {"field": "backend.name", "eq": "TRITON_ATTN"}}]}
    jsonschema.validate(good, schema)
    for bad in ({k: v for k, v in good["waivers"][0].items() if k != "owner"},
                {**good["waivers"][0], "expires": "31/01/2027"}, {**good["waivers"][0], "until": "x"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"version": 1, "waivers": [bad]}, schema)
    with pytest.raises(jsonschema.ValidationError):  # `waivers` belong in a global file
        jsonschema.validate({**good, "connector": "NixlConnector"}, schema)
