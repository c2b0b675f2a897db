"""`kvpolicy.policy.layers` and connector names: how rule layers compose, which names warn."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.policy.connectors import KNOWN_CONNECTORS, connector_name_problem, near_connector
from kvpolicy.policy.errors import RuleLoadError
from kvpolicy.policy.layers import compose_layers
from kvpolicy.policy.load import load_rules_from_texts


def conn_file(name: str, rule_id: str, body: str = "prefer: {block_outermost: true}") -> str:
    return f"version: 1\nconnector: {name}\nrules:\n  - id: {rule_id}\n    description: d\n    {body}\n"


GLOBAL = "version: 1\nrules:\n  - id: {id}\n    description: d\n    forbid: {{placement: cross_layer}}\n"


def test_connector_file_for_a_third_party_connector_loads() -> None:
    rs = load_rules_from_texts({"connectors/MyConnector.yaml": conn_file("MyConnector", "mine")})
    assert rs.connectors == ("MyConnector",)


@pytest.mark.parametrize("bad", ["My-Connector", "9Connector", "My Connector", "Conn\u00e9ctor", "x" * 129])
def test_malformed_connector_name_is_an_error(bad: str) -> None:
    with pytest.raises(RuleLoadError) as err:
        load_rules_from_texts({"connectors/x.yaml": conn_file(f'"{bad}"', "mine")})
    assert [d.code for d in err.value.diagnostics] == ["invalid-connector-name"]


def test_near_names() -> None:
    assert near_connector("NixlConector", KNOWN_CONNECTORS) == "NixlConnector"
    assert near_connector("nixlconnector", KNOWN_CONNECTORS) == "NixlConnector"
    assert near_connector("MyConnector", KNOWN_CONNECTORS) is None
    assert near_connector("MyConector", {"MyConnector"}) == "MyConnector"


@given(st.sampled_from(sorted(KNOWN_CONNECTORS)))
def test_every_known_name_is_well_formed_and_near_only_to_others(name: str) -> None:
    assert connector_name_problem(name) is None
    assert near_connector(name, {name}) is None


def test_near_connector_names_warn_not_fail() -> None:
    shipped = load_rules_from_texts({"global.yaml": GLOBAL.format(id="g")})
    ops = load_rules_from_texts({"connectors/a.yaml": conn_file("NixlConector", "a"),
                                 "connectors/b.yaml": conn_file("MyConnector", "b"),
                                 "connectors/c.yaml": conn_file("MyConector", "c")})
    rs = compose_layers([(shipped, True), (ops, False)])
    warned = {d.message.split("`")[1]: d.help for d in rs.warnings}
    assert set(warned) == {"NixlConector", "MyConnector", "MyConector"}
    assert "did you mean `NixlConnector`?" in (warned["NixlConector"] or "")
    assert "did you mean `MyConnector`?" in (warned["MyConector"] or "")
    assert all(d.code == "near-connector-name" for d in rs.warnings)


def test_forbids_of_every_layer_apply_and_layers_are_recorded() -> None:
    low = load_rules_from_texts({"global.yaml": GLOBAL.format(id="low")})
    high = load_rules_from_texts({"connectors/x.yaml": conn_file("MyConnector", "high")})
    rs = compose_layers([(low, True), (high, False)])
    assert {r.id for r in rs.rules} == {"low", "high"}
    assert rs.layer_of("low").shipped and not rs.layer_of("high").shipped
    assert [layer.digest for layer in rs.layers] == [low.digest, high.digest]


def test_duplicate_id_across_layers_is_an_error_at_the_upper_rule() -> None:
    low = load_rules_from_texts({"global.yaml": GLOBAL.format(id="same")})
    changed = GLOBAL.format(id="same").replace("cross_layer", "per_layer")
    with pytest.raises(RuleLoadError) as err:
        compose_layers([(low, True), (load_rules_from_texts({"ops.yaml": changed}), False)])
    (d,) = err.value.diagnostics
    assert (d.code, d.file) == ("duplicate-rule-id", "ops.yaml")
    assert "--no-shipped-rules" in (d.help or "")


def test_a_rule_restated_word_for_word_is_one_rule() -> None:
    low = load_rules_from_texts({"global.yaml": GLOBAL.format(id="same")})
    copy = load_rules_from_texts({"copy.yaml": GLOBAL.format(id="same")})
    rs = compose_layers([(low, True), (copy, False)])
    assert [r.source.file for r in rs.rules] == ["global.yaml"]


def test_connector_files_in_two_layers_both_apply() -> None:
    a = load_rules_from_texts({"connectors/a.yaml": conn_file("MyConnector", "a")})
    b = load_rules_from_texts({"connectors/b.yaml": conn_file("MyConnector", "b")})
    assert [r.id for r in compose_layers([(a, True), (b, False)]).connector_rules("MyConnector")] == ["a", "b"]


def test_connector_name_conditions_take_any_name_but_a_near_miss() -> None:
    when = "version: 1\nrules:\n  - id: r\n    description: d\n    when: {{field: connector.name, eq: {}}}\n" \
           "    forbid: {{placement: cross_layer}}\n"
    assert load_rules_from_texts({"global.yaml": when.format("MyConnector")}).rules[0].id == "r"
    with pytest.raises(RuleLoadError) as err:
        load_rules_from_texts({"global.yaml": when.format("NixlConector")})
    assert "did you mean `NixlConnector`?" in (err.value.diagnostics[0].help or "")


def test_a_connector_file_of_audit_rules_only_is_checked_for_a_near_name(tmp_path) -> None:
    # rolling a connector's rule out in audit mode first: a typo in its class name must still be said
    from kvpolicy.policy.layers import connector_warnings
    from kvpolicy.policy.load import load_rules

    (tmp_path / "connectors").mkdir()
    (tmp_path / "connectors" / "OffloadingConnecter.yaml").write_text(
        "version: 1\nconnector: OffloadingConnecter\nrules:\n  - id: site-offload-nhd\n    description: x\n"
        "    enforcement: audit\n    require: {head_order: NHD}\n")
    (warning,) = connector_warnings(load_rules(tmp_path))
    assert warning.code == "near-connector-name" and (warning.line, warning.col) == (2, 12)
    assert "did you mean `OffloadingConnector`?" in warning.help
