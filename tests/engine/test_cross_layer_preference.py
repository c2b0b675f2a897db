"""`connector.prefers_cross_layer_blocks`: the connector object's own answer, which vLLM 0.24-0.28's gate asks.

vLLM asks the connector it loads (a third-party one from ``kv_connector_module_path`` included); the
rules read the same fact. Held to vLLM 0.28 by tests/conformance/test_v028_plugin.py (out-of-tree
connectors whose ``prefer_cross_layer_blocks`` is true and false, through vLLM's own plugin loader).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.inputs import build_context
from kvpolicy.policy.connectors import ConnectorConfig
from kvpolicy.policy.context import MISSING
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Placement

V028 = LayoutEngine.default("vllm-0.28")
BASE: dict[str, Any] = {"spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, "backend": "FLASH_ATTN",
                        "vllm_version": "vllm-0.28"}
FIELD = "connector.prefers_cross_layer_blocks"


def placement(**inputs: Any) -> Placement:
    return V028.decide(explain=False, **BASE, **inputs).layout.placement


def field(**inputs: Any) -> Any:
    return build_context(**BASE, **inputs).env()[FIELD]


@pytest.mark.parametrize(("prefers", "expected"), [(True, Placement.cross_layer), (False, Placement.per_layer),
                                                   (None, Placement.per_layer)])
def test_a_third_party_connector_gets_what_its_own_preference_says(prefers: bool | None, expected: Placement) -> None:
    """vLLM 0.28's gate: cross-layer exactly when the object's prefer_cross_layer_blocks is true (not
    given: KVConnectorBase_V1's false); no connector file is needed for it."""
    given = {} if prefers is None else {"connector_prefers_cross_layer_blocks": prefers}
    assert placement(connector="MyConnector", **given) is expected


def test_the_field_defaults_from_what_kvpolicy_knows() -> None:
    assert field() is MISSING  # no connector
    assert field(connector="MyConnector") is False  # KVConnectorBase_V1's default
    assert field(connector="OffloadingConnector") is MISSING  # its connector file says when it prefers
    assert field(connector="OffloadingConnector", connector_prefers_cross_layer_blocks=False) is False
    multi = {"connector": "MultiConnector", "connector_config": {"connectors": [
        {"kv_connector": "OffloadingConnector"}, {"kv_connector": "MyConnector"}]}}
    assert field(**multi) is False  # all of its members': one is false
    assert field(**multi, connector_prefers_cross_layer_blocks={"MyConnector": True}) is MISSING  # one unknown
    assert field(**multi, connector_prefers_cross_layer_blocks={"MyConnector": True,
                                                                "OffloadingConnector": True}) is True


def test_a_multiconnector_with_a_member_that_prefers_nothing_stays_per_layer() -> None:
    multi = {"connector": "MultiConnector", "connector_config": {"connectors": [
        {"kv_connector": "OffloadingConnector"}, {"kv_connector": "MyConnector"}]}}
    assert placement(**multi) is Placement.per_layer
    assert placement(**multi, connector_prefers_cross_layer_blocks={"MyConnector": True}) is Placement.cross_layer


def test_the_plugin_passes_a_registered_connectors_own_answer_too() -> None:
    """OffloadingConnector with canonical_layout: its object answers false, and the global rule agrees
    with its file's rule."""
    decision = V028.decide(explain=False, **BASE, connector="OffloadingConnector",
                           connector_prefers_cross_layer_blocks=False)
    assert decision.layout.placement is Placement.per_layer
    removed = {r.id for pairs in decision.eliminated.values() for r, _ in pairs}
    assert "cross-layer-needs-a-connector-that-prefers-it" in removed


@pytest.mark.parametrize(("given", "where", "says"), [
    ({"connector_prefers_cross_layer_blocks": True}, "connector_prefers_cross_layer_blocks",
     "given without a connector"),
    ({"connector": "MyConnector", "connector_prefers_cross_layer_blocks": {"MyConector": True}},
     "connector_prefers_cross_layer_blocks.MyConector", "no configured connector is named `MyConector`"),
    ({"connector": "MyConnector", "connector_prefers_cross_layer_blocks": {"MyConnector": "yes"}},
     "connector_prefers_cross_layer_blocks.MyConnector", "must be true or false"),
    ({"connector": "MyConnector", "connector_prefers_cross_layer_blocks": "yes"},
     "connector_prefers_cross_layer_blocks", "expected true, false, or a non-empty mapping"),
    ({"connector": "MultiConnector", "connector_config": {"connectors": [{"kv_connector": "MyConnector"}]},
      "connector_prefers_cross_layer_blocks": True}, "connector_prefers_cross_layer_blocks", "all its members do"),
])
def test_bad_preferences_are_located_errors(given: dict[str, Any], where: str, says: str) -> None:
    with pytest.raises(InputError) as exc:
        build_context(**BASE, **given)
    (d,) = exc.value.diagnostics
    assert d.file == where and says in d.message and d.help, d


def test_the_preference_is_part_of_the_connector_and_its_hash() -> None:
    a = ConnectorConfig(name="MyConnector")
    b = a.with_cross_layer_preferences(True, "x")
    assert a.prefers_cross_layer_blocks is None and b.prefers_cross_layer_blocks is True
    assert a != b and hash(a) != hash(b)
