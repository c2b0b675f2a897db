"""Loading fails closed and reports every error at once, each located."""

from __future__ import annotations

import textwrap

import pytest

from kvpolicy.policy import RuleLoadError, load_rules, load_rules_from_texts
from kvpolicy.policy.errors import Diagnostic

HEADER = "version: 1\nrules:\n"


def rule(body: str, rule_id: str = "r1") -> str:
    """A rule file with one rule whose `when`/effect lines are ``body``."""
    return HEADER + f"  - id: {rule_id}\n    description: test rule\n" + textwrap.indent(textwrap.dedent(body), "    ")


def errors(texts: dict[str, str] | str) -> list[Diagnostic]:
    if isinstance(texts, str):
        texts = {"global.yaml": texts}
    with pytest.raises(RuleLoadError) as info:
        load_rules_from_texts(texts)
    return info.value.diagnostics


def only(texts: dict[str, str] | str) -> Diagnostic:
    diags = errors(texts)
    assert len(diags) == 1, [d.render() for d in diags]
    return diags[0]


def at(d: Diagnostic) -> tuple[int, int]:
    return d.line, d.col


def test_valid_file_loads() -> None:
    rs = load_rules_from_texts({"global.yaml": rule("when: {field: kv.per_token_head, eq: true}\n"
                                                    "forbid: {placement: cross_layer}\n")})
    assert [r.id for r in rs.rules] == ["r1"]
    assert str(rs.rules[0].source) == "global.yaml:3"


@pytest.mark.parametrize(
    ("note", "body", "code", "message", "pos"),
    [
        ("unknown key in a rule", "forbid: {placement: cross_layer}\nwehn: {field: kv.kind, eq: mla}\n",
         "unknown-key", "unknown key `wehn`", (6, 5)),
        ("unknown key in a pattern", "forbid: {placment: cross_layer}\n",
         "unknown-key", "unknown key `placment`", (5, 14)),
        ("unknown field path", "when: {field: kv.per_tokn_head, eq: true}\nforbid: {placement: cross_layer}\n",
         "unknown-field", "unknown field `kv.per_tokn_head`", (5, 19)),
        ("string for an integer", 'when: {field: kv.block_size, eq: "16"}\nforbid: {placement: cross_layer}\n',
         "type-mismatch", "`kv.block_size` is an integer, got string `16`", (5, 38)),
        ("unknown enum value", "when: {field: kv.quant_mode, eq: fp9}\nforbid: {placement: cross_layer}\n",
         "unknown-value", "`fp9` is not a value of `kv.quant_mode`", (5, 38)),
        ("unknown enum value in a list", "when: {field: kv.kind, in: [full, mlaa]}\nforbid: {placement: cross_layer}\n",
         "type-mismatch", "`mlaa` is not a value of `kv.kind`", (5, 39)),
        ("unknown layout value", "forbid: {placement: cross_layers}\n",
         "invalid-value", "expected 'per_layer' or 'cross_layer', got string `cross_layers`", (5, 25)),
        ("numeric op on a string field", "when: {field: backend.name, lt: 3}\nforbid: {placement: cross_layer}\n",
         "bad-operator", "`lt` needs a numeric field", (5, 37)),
        ("two operators", "when: {field: kv.kind, eq: mla, ne: full}\nforbid: {placement: cross_layer}\n",
         "invalid-condition", "a leaf needs exactly one operator, found `eq`, `ne`", (5, 11)),
        ("two effects", "forbid: {placement: cross_layer}\nprefer: {placement: per_layer}\n",
         "invalid-rule", "a rule needs exactly one effect", (3, 5)),
        ("weight without prefer", "forbid: {placement: cross_layer}\nweight: 3\n",
         "invalid-rule", "`weight` applies only to a `prefer` rule", (3, 5)),
        ("empty pattern", "forbid: {}\n", "empty-pattern", "the `forbid` pattern matches every layout", (5, 13)),
        ("boolean for a boolean field quoted",
         'when: {field: kv.per_token_head, eq: "yes"}\nforbid: {placement: cross_layer}\n',
         "type-mismatch", "`kv.per_token_head` is a boolean, got string `yes`", (5, 42)),
        ("null comparison", "when: {field: kv.sliding_window, eq: null}\nforbid: {placement: cross_layer}\n",
         "type-mismatch", "compared with null", (5, 42)),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else "",
)
def test_rule_errors_are_located(note: str, body: str, code: str, message: str, pos: tuple[int, int]) -> None:
    d = only(rule(body))
    assert d.code == code, d.render()
    assert message in d.message, d.render()
    assert at(d) == pos, d.render()
    assert d.file == "global.yaml"


def test_did_you_mean_for_fields_and_keys() -> None:
    d = only(rule("when: {field: kv.per_tokn_head, eq: true}\nforbid: {placement: cross_layer}\n"))
    assert "did you mean `kv.per_token_head`?" in (d.help or "")
    d = only(rule("forbid: {placement: cross_layer}\ndescripton: x\n"))
    assert "did you mean `description`?" in (d.help or "")
    d = only(rule("when: {field: kv.quant_mode, eq: fp8_per_token_heads}\nforbid: {placement: cross_layer}\n"))
    assert "did you mean `fp8_per_token_head`?" in (d.help or "")


def test_duplicate_keys_are_errors_not_silently_merged() -> None:
    d = only(HEADER + "  - id: r1\n    description: a\n    description: b\n    forbid: {placement: cross_layer}\n")
    assert d.code == "duplicate-key"
    assert d.message == "duplicate key `description` (first defined at line 4, column 5)"
    assert at(d) == (5, 5)


def test_every_error_is_reported_at_once() -> None:
    text = HEADER + (
        "  - id: a\n    description: x\n    when: {field: kv.nope, eq: 1}\n    forbid: {placement: cross_layer}\n"
        "  - id: b\n    description: y\n    forbid: {placement: sideways}\n"
        "  - id: c\n    description: z\n    when: {field: kv.block_size, gt: 8}\n"
        "    forbid: {placement: cross_layer}\n    extra: 1\n"
    )
    diags = errors(text)
    assert [d.code for d in diags] == ["unknown-field", "invalid-value", "unknown-key"]
    assert [d.line for d in diags] == sorted(d.line for d in diags)


def test_duplicate_rule_ids_across_files() -> None:
    body = "forbid: {placement: cross_layer}\n"
    conn = "version: 1\nconnector: OffloadingConnector\nrules:\n  - id: r1\n    description: again\n    " + body
    d = only({"global.yaml": rule(body), "connectors/offloading.yaml": conn})
    assert d.code == "duplicate-rule-id"
    assert d.file == "global.yaml" or d.file == "connectors/offloading.yaml"
    assert "rule id `r1` is already used at" in d.message


def test_connector_file_for_a_connector_no_profile_knows_loads() -> None:
    # any well-formed name (third-party, newer vLLM); a near miss is a warning (tests/policy/test_layers.py)
    assert load_rules_from_texts({"connectors/x.yaml": "version: 1\nconnector: NixlConector\nrules: []\n"})
    d = only({"connectors/x.yaml": "version: 1\nconnector: Nixl-Connector\nrules: []\n"})
    assert (d.code, at(d)) == ("invalid-connector-name", (2, 12))


def test_connector_file_must_name_its_connector() -> None:
    d = only({"connectors/x.yaml": "version: 1\nrules: []\n"})
    assert d.code == "missing-connector"


@pytest.mark.parametrize(
    ("text", "code", "message"),
    [
        ("", "empty-document", "the file holds no YAML document"),
        ("# only a comment\n", "empty-document", "the file holds no YAML document"),
        ("- a\n- b\n", "not-a-mapping", "a rule file is a mapping, got list"),
        ("just a string\n", "not-a-mapping", "a rule file is a mapping, got string"),
        ("version: 2\nrules: []\n", "invalid-value", "expected 1"),
        ("rules: []\n", "missing-key", "missing required key `version`"),
        ("version: 1\nrules: {a: 1}\n", "invalid-value", "`rules` must be a list"),
        ("version: 1\nrules: [\n", "yaml-syntax", "invalid YAML"),
        ("version: 1\n---\nversion: 1\n", "multiple-documents", "exactly one document"),
    ],
)
def test_bad_documents(text: str, code: str, message: str) -> None:
    d = only(text)
    assert d.code == code
    assert message in d.message
    assert d.line >= 1


def test_unsafe_tags_are_rejected_not_executed(tmp_path) -> None:
    marker = tmp_path / "pwned"
    text = f"version: 1\nrules: !!python/object/apply:os.system ['touch {marker}']\n"
    d = only(text)
    assert d.code == "unsafe-tag"
    assert at(d) == (2, 8)
    assert not marker.exists()


def test_defaults_layout_order_validated() -> None:
    d = only("version: 1\ndefaults:\n  layout_order: [LBNHC, diagonal/NHD]\nrules: []\n")
    assert d.code == "unknown-layout"
    assert at(d) == (3, 25)
    assert "unknown layout `diagonal/NHD`" in d.message


@pytest.mark.parametrize(("order", "col", "said"), [
    ("[LBHNC, per_layer/HND]", 25,
     "`per_layer/HND` (layout LBHNC, as `LBHNC` is) is already listed at layout_order[0]"),
    ("[per_layer/NHD, BLNHC, LBNHC]", 40, "`LBNHC` (layout LBNHC, as `per_layer/NHD` is) is already listed"),
    ("[LBHNC, LBHNC]", 25, "`LBHNC` is already listed at layout_order[0]"),
])
def test_a_layout_listed_twice_is_refused_by_meaning_not_spelling(order: str, col: int, said: str) -> None:
    """A tie-break order naming one layout twice (in two spellings) would rank it twice."""
    d = only(f"version: 1\ndefaults:\n  layout_order: {order}\nrules: []\n")
    assert (d.code, at(d)) == ("duplicate-layout", (3, col))
    assert said in d.message and d.help == "list each layout once"


def test_load_rules_from_directory(tmp_path) -> None:
    (tmp_path / "connectors").mkdir()
    (tmp_path / "global.yaml").write_text(rule("forbid: {placement: cross_layer}\n"))
    (tmp_path / "connectors" / "offloading.yaml").write_text(
        "version: 1\nconnector: OffloadingConnector\nrules:\n  - id: offload\n    description: d\n"
        "    prefer: {placement: cross_layer}\n    weight: 5\n")
    rs = load_rules(tmp_path, display="my-rules")
    assert rs.connectors == ("OffloadingConnector",)
    assert str(rs.rule("offload").source) == "my-rules/connectors/offloading.yaml:4"


def test_a_broken_file_fails_the_whole_set(tmp_path) -> None:
    (tmp_path / "global.yaml").write_text(rule("forbid: {placement: cross_layer}\n"))
    (tmp_path / "connectors").mkdir()
    (tmp_path / "connectors" / "bad.yaml").write_text("version: 1\nconnector: NixlConnector\nrules: [\n")
    with pytest.raises(RuleLoadError) as info:
        load_rules(tmp_path)
    assert [d.code for d in info.value.diagnostics] == ["yaml-syntax"]
    assert "connectors/bad.yaml:4" in info.value.render() or "connectors/bad.yaml:3" in info.value.render()


def test_yaml_booleans_in_string_positions_get_a_hint() -> None:
    d = only(HEADER + "  - id: off\n    description: d\n    forbid: {placement: cross_layer}\n")
    assert (d.code, at(d)) == ("invalid-value", (3, 9))
    assert d.message == "expected a string, got boolean `off`"  # as written, not as YAML 1.1 read it
    assert "quote the value" in (d.help or "")


def test_empty_directory_and_missing_directory(tmp_path) -> None:
    with pytest.raises(RuleLoadError, match=r"no `\.yaml` rule files found"):
        load_rules(tmp_path)
    with pytest.raises(RuleLoadError, match="not a directory"):
        load_rules(tmp_path / "nope")


def test_digest_ignores_file_order_and_comments() -> None:
    a = {"global.yaml": rule("forbid: {placement: cross_layer}\n", "a"),
         "extra.yaml": "# comment\n" + rule("prefer: {placement: per_layer}\n", "b")}
    b = {"x.yaml": rule("prefer: {placement: per_layer}\n", "b"),
         "y.yaml": rule("forbid: {placement: cross_layer}\n", "a")}
    assert load_rules_from_texts(a).digest == load_rules_from_texts(b).digest


@pytest.mark.parametrize(("operand", "message"), [
    ("in: null", "`in` needs a list of values, got null"),
    ("not_in: null", "`not_in` needs a list of values, got null"),
    ("lt: null", "`lt` needs a number, got null"),
    ("exists: null", "`exists` needs `true` or `false`, got null"),
    ("eq: .nan", "`eq` compares with `nan`"),
    ('lt: "30"', "expected a valid integer, got string `30`"),
    ("lt: true", "expected a valid integer, got boolean `true`"),
    ("exists: 1", "expected a valid boolean, got integer `1`"),
])
def test_null_nan_and_coercible_operands_are_errors(operand: str, message: str) -> None:
    """YAML `null`, NaN, a quoted number or a boolean where a number belongs never load silently
    (they once crashed evaluation or were coerced to 30 / 1)."""
    d = only(rule(f"when: {{field: kv.num_layers, {operand}}}\nforbid: {{placement: cross_layer}}\n"))
    assert message in d.message, d.render()
    assert d.line == 5


@pytest.mark.parametrize("weight", ['"5"', "true", "5.0"])
def test_prefer_weight_must_be_an_integer(weight: str) -> None:
    d = only(rule(f"prefer: {{placement: cross_layer}}\nweight: {weight}\n"))
    assert (d.code, d.line) == ("invalid-value", 6)
