"""Connector inputs in vLLM's form: members only for composites, extras as rules see them."""

from __future__ import annotations

import pytest

from kvpolicy.policy import ConnectorConfig, InputError
from kvpolicy.policy.connectors import flatten_extra


def test_only_multiconnector_takes_members() -> None:
    multi = ConnectorConfig.from_vllm("MultiConnector", {"connectors": [
        {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"enable_cross_layers_blocks": "true"}},
        {"kv_connector": "OffloadingConnector"}]})
    assert [m.name for m in multi.connectors] == ["NixlConnector", "OffloadingConnector"]
    assert multi.connectors[0].extra == {"enable_cross_layers_blocks": "true"}
    # any other connector keeps `connectors` as ordinary extra config, as vLLM does
    nixl = ConnectorConfig.from_vllm("NixlConnector", {"connectors": [{"kv_connector": "OffloadingConnector"}]})
    assert nixl.connectors == () and not nixl.is_composite
    assert nixl.extra == {"connectors": '[{"kv_connector": "OffloadingConnector"}]'}


def test_extras_flatten_and_nulls_are_unset() -> None:
    assert flatten_extra({"a": {"b": 1, "c": {"d": "x"}}, "n": None, "l": [2, 1], "t": True}) == {
        "a.b": 1, "a.c.d": "x", "l": "[2, 1]", "t": True}
    assert ConnectorConfig(name="X", extra={"x": None}).extra == {}


@pytest.mark.parametrize(("config", "where", "message"), [
    ({"connectors": 5}, "connector_config.connectors", "`connectors` must be a list, got int"),
    ({"connectors": [{}]}, "connector_config.connectors[0]", "member 0 of `connectors` needs a `kv_connector`"),
    ({"connectors": [{"kv_connector": "NixlConnector", "kv_connector_extra_config": 3}]},
     "connector_config.connectors[0].kv_connector_extra_config", "member 0's `kv_connector_extra_config` must be"),
])
def test_malformed_members_are_located_input_errors(config: dict, where: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        ConnectorConfig.from_vllm("MultiConnector", config)
    [d] = info.value.diagnostics
    assert d.file == where and message in d.message


def test_extra_config_depth_bound_is_exact_and_every_refusal_says_what_to_do() -> None:
    """Mutation survivors (issue 23): the depth bound off by one, and help texts nobody checked."""
    from kvpolicy.policy.connectors import MAX_CONFIG_DEPTH, check_extra_config
    from kvpolicy.policy.errors import InputError

    def nested(levels: int) -> dict:
        value: dict = {}
        for _ in range(levels - 1):
            value = {"k": value}
        return value

    check_extra_config(nested(MAX_CONFIG_DEPTH), "extra")  # exactly at the bound: accepted
    with pytest.raises(InputError):
        check_extra_config(nested(MAX_CONFIG_DEPTH + 1), "extra")
    for bad in ({1: "x"}, {"\ud800": 1}, {"k": "\ud800"}):
        with pytest.raises(InputError) as info:
            check_extra_config(bad, "extra")
        assert info.value.diagnostics[0].help, bad
