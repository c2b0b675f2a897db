"""Issue 23, class 4: what vLLM hands the plugin at start-up becomes a located error or a decision, never
another exception. vLLM's Python API takes any dict as ``kv_connector_extra_config`` (a set, bytes, NaN,
an object that contains itself), loads a connector class of any name, and the environment can hold any
``KVPOLICY_RULES``; the plugin checks them as the CLI's ``--kv-transfer-config`` is checked (one function,
`kvpolicy.policy.connectors.check_extra_config`), on the 0.24-0.28 gate and the 0.29+ resolver alike.

vLLM's objects are stand-ins shaped like vLLM's (tests/engine/integrations/test_vllm.py, test_vllm_plugin.py).
"""

from __future__ import annotations

import decimal
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_vllm import fake_vllm
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_vllm import KVConnectorBase_V1, MultiConnector, OffloadingConnector, one
from test_vllm_plugin import FLASHINFER, FullAttentionSpec, config

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.inputs import build_context
from kvpolicy.engine.integrations import vllm_plugin
from kvpolicy.engine.integrations.vllm import StartupError, decide, own_rule_id, use_uniform_kv_cache
from kvpolicy.engine.integrations.vllm_plugin import Settings, decided_by
from kvpolicy.engine.integrations.vllm_resolver import resolve
from kvpolicy.policy import Layout, Placement
from kvpolicy.policy.connectors import ConnectorConfig
from kvpolicy.policy.errors import InputError, PolicyError, RuleLoadError
from kvpolicy.policy.rule_model import Rule

GATE = LayoutEngine.default("vllm-0.28")
RESOLVER = LayoutEngine.default("vllm-0.34")
WHERE = "kv_transfer_config.kv_connector_extra_config"


def configured(name: str, extra: Any, cls: type = KVConnectorBase_V1) -> Any:
    """A connector object as vLLM 0.28 builds it: its ``_kv_transfer_config`` names it and holds its extra
    config (no live members: a MultiConnector is read from its configuration form)."""
    conn = cls.__new__(cls)
    conn._kv_transfer_config = SimpleNamespace(kv_connector=name, kv_connector_extra_config=extra)
    return conn


def gate(name: str, extra: Any) -> bool:
    return use_uniform_kv_cache(one(), configured(name, extra), engine=GATE)


def resolved(name: str, extra: Any) -> Layout:
    return resolve(RESOLVER, config(name, extra), [FLASHINFER], [FullAttentionSpec()]).layout


def cli(name: str, extra: Any) -> ConnectorConfig:
    """What `kvpolicy dry-run --kv-transfer-config` builds from the same configuration."""
    ktc = {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    connector = build_context(spec={"num_layers": 2, "num_kv_heads": 8, "head_size": 128},
                              kv_transfer_config=ktc, vllm_version="vllm-0.34").connector
    assert connector is not None
    return connector


def shape(c: ConnectorConfig) -> tuple:
    return c.name, c.extra, tuple(shape(m) for m in c.connectors)


def where(exc: PolicyError) -> list[tuple[str, str]]:
    return [(d.file, d.code) for d in exc.diagnostics]


# ---------------------------------------------------------------- extra configs: the property

_JSON_LEAVES = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats()
                | st.text(max_size=6))
_HOSTILE_LEAVES = (st.sampled_from([{1, 2}, frozenset(), b"ab", bytearray(b"a"), object(), 1j, decimal.Decimal("1.5"),
                                    range(2), print, int, math.inf, -math.inf, math.nan])
                   | st.integers(min_value=2**63, max_value=2**80) | st.just(5000).map(lambda n: 10**n)
                   | st.just(-(2**64))
                   | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2))
_KEYS = (st.text(max_size=5) | st.integers() | st.none() | st.booleans() | st.tuples(st.integers())
         | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=1))
_VALUES = st.recursive(_JSON_LEAVES | _HOSTILE_LEAVES, lambda inner: st.lists(inner, max_size=3)
                       | st.tuples(inner) | st.dictionaries(_KEYS, inner, max_size=3), max_leaves=8)
_EXTRA = st.dictionaries(_KEYS, _VALUES, max_size=4)
_MEMBER = st.fixed_dictionaries({"kv_connector": st.sampled_from(["OffloadingConnector", "NixlConnector", "MyConn"]),
                                 "kv_connector_extra_config": _EXTRA})
_MULTI = st.fixed_dictionaries({"connectors": st.lists(_MEMBER, max_size=3)}, optional={"x": _VALUES})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["OffloadingConnector", "NixlConnector", "MyConnector", "MultiConnector"]),
       extra=_EXTRA | _MULTI)
def test_any_extra_config_is_decided_as_the_cli_reads_it_or_refused_where_the_cli_refuses_it(
        name: str, extra: dict) -> None:
    """Arbitrary JSON-ish and non-JSON values (sets, bytes, objects, NaN, integers past 64 bits, lone
    surrogates, keys that are no strings), for a registered, an unknown and a composite connector: the
    0.28 gate answers a bool and the 0.34 resolver a layout, each from the connector the CLI reads from the
    same configuration, or both stop start-up with the CLI's refusal at the same field; nothing else."""
    try:
        expected: ConnectorConfig | InputError = cli(name, extra)
    except InputError as exc:
        expected = exc
    event("refused" if isinstance(expected, InputError) else "decided")
    conn = configured(name, extra)
    for run in (lambda: use_uniform_kv_cache(one(), conn, engine=GATE), lambda: resolved(name, extra)):
        try:
            answer = run()
        except StartupError as exc:
            assert isinstance(expected, InputError), exc.render()
            assert where(exc) == where(expected) and all(d.file.startswith(WHERE) for d in exc.diagnostics)
        else:
            assert not isinstance(expected, InputError), expected.render()
            assert isinstance(answer, (bool, Layout))
    if not isinstance(expected, InputError):
        assert shape(decide(one(), conn, engine=GATE).context.connector) == shape(expected)
        assert shape(resolve(RESOLVER, config(name, extra), [FLASHINFER], [FullAttentionSpec()]).context
                     .connector) == shape(expected)


def _nested(levels: int) -> dict:
    extra: dict = {}
    for _ in range(levels):
        extra = {"a": extra}
    return extra


def _self_containing() -> dict:
    extra: dict = {}
    extra["self"] = extra
    return extra


def _multi_containing_itself() -> dict:
    extra: dict = {"connectors": []}
    extra["connectors"].append({"kv_connector": "MultiConnector", "kv_connector_extra_config": extra})
    return extra


def _listed_in_itself() -> dict:
    items: list = []
    items.append(items)
    return {"k": items}


@pytest.mark.parametrize(("extra", "at", "code"), [
    ({"x": {1, 2}}, f"{WHERE}.x", "invalid-input"),
    ({"x": b"ab"}, f"{WHERE}.x", "invalid-input"),  # pydantic would read bytes as text: a silent guess
    ({"x": object()}, f"{WHERE}.x", "invalid-input"),
    ({"x": math.nan}, f"{WHERE}.x", "invalid-input"),
    ({"a": [math.inf]}, f"{WHERE}.a[0]", "invalid-input"),
    ({"x": 10**5000}, f"{WHERE}.x", "invalid-input"),  # printing it (KVPOLICY_EXPLAIN) raised ValueError
    ({1: "a"}, WHERE, "invalid-input"),
    (_nested(5000), WHERE, "too-deep"),
    ({"k": [[[[[[]]]]]] * 2, "deep": _nested(100)}, WHERE, "too-deep"),
    (_self_containing(), WHERE, "too-deep"),
    (_listed_in_itself(), WHERE, "too-deep"),
    (_multi_containing_itself(), WHERE, "too-deep"),
])
@pytest.mark.parametrize("name", ["OffloadingConnector", "MyConnector", "MultiConnector"])
def test_an_extra_config_the_rules_cannot_read_stops_start_up_at_its_field(extra: dict, at: str, code: str,
                                                                           name: str) -> None:
    for run in (gate, resolved):
        with pytest.raises(StartupError) as exc:
            run(name, extra)
        assert where(exc.value) == [(at, code)], exc.value.render()
        assert "vLLM must not start" in exc.value.render()


def test_a_wide_shared_extra_config_is_bounded_not_walked_forever() -> None:
    """An object referring to one dict from many keys is a tree of 100**3 values to a walk: refused at the
    value bound, at once."""
    leaf = {str(i): i for i in range(100)}
    middle = {str(i): leaf for i in range(100)}
    with pytest.raises(StartupError) as exc:
        gate("MyConnector", {str(i): middle for i in range(100)})
    assert where(exc.value) == [(WHERE, "too-large")]


# ---------------------------------------------------------------- live MultiConnector members


def _member_cycle() -> Any:
    multi = MultiConnector(OffloadingConnector())
    multi._connectors.append(multi)
    return multi


def _mutual_cycle() -> Any:
    a = MultiConnector()
    b = MultiConnector(a)
    a._connectors.append(b)
    return a


def _chain(levels: int) -> Any:
    conn: Any = OffloadingConnector()
    for _ in range(levels):
        conn = MultiConnector(conn)
    return conn


@pytest.mark.parametrize(("connector", "at", "code"), [
    (_member_cycle(), f"{WHERE}.connectors[1]", "connector-cycle"),
    (_mutual_cycle(), f"{WHERE}.connectors[0].connectors[0]", "connector-cycle"),
    (_chain(3000), WHERE + ".connectors[0]" * 64, "too-deep"),
])
def test_multiconnector_members_that_contain_each_other_stop_start_up_located(connector: Any, at: str,
                                                                              code: str) -> None:
    """They made a RecursionError (vLLM would loop too); a chain of 3,000 members as well."""
    with pytest.raises(StartupError) as exc:
        use_uniform_kv_cache(one(), connector, engine=GATE)
    assert where(exc.value) == [(at, code)]
    assert use_uniform_kv_cache(one(), _chain(20), engine=GATE) is True  # deep but sound: decided


# ---------------------------------------------------------------- connector names


class _Prefers(KVConnectorBase_V1):
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return True


def _named_class(name: str) -> Any:
    cls = type("Placeholder", (_Prefers,), {})
    cls.__name__ = name  # vLLM loads any attribute of kv_connector_module_path by kv_connector
    conn = cls.__new__(cls)
    conn._kv_transfer_config = SimpleNamespace(kv_connector_extra_config={})
    return conn


NAMES = ["C" * 120, "C" * 128, "X" * 1000, "My Connector", "pkg.MyConnector", "Коннектор", "Ж" * 120, "1Conn",
         "İ" * 80, "🙂" * 60, "a\nb", "-", "..."]


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_connector_of_any_class_name_keeps_its_own_answers(name: str) -> None:
    """A connector the rules do not know is decided by its own prefer_cross_layer_blocks (0.28 gate) and
    get_required_kvcache_layout (0.34 resolver), whatever its class name: the synthetic rules standing for
    them got ids too long (a ValidationError escaped the 0.28 gate for a 120-character name)."""
    d = decide(one(), _named_class(name), engine=GATE)
    assert d.layout.placement is Placement.cross_layer
    assert own_rule_id("vllm-own-preference", name) in d.explain()
    d = resolve(RESOLVER, config(name), [FLASHINFER], [FullAttentionSpec()], connector_layouts=lambda: [(name,
                                                                                                           "BLHNC")])
    assert d.layout is Layout.BLHNC and own_rule_id("vllm-own-layout", name) in decided_by(d)


def test_synthetic_rule_ids_are_valid_and_one_per_name() -> None:
    names = [*NAMES, "C" * 121, "c" * 120, "My-Connector", "my connector", "ThirdPartyConnector", "thirdpartyconnector"]
    for kind in ("vllm-own-preference", "vllm-own-layout"):
        ids = [own_rule_id(kind, n) for n in names]
        for rule_id in ids:
            Rule.model_validate({"id": rule_id, "description": "d", "forbid": {"placement": "cross_layer"}})
        # names that spell themselves in lower case keep their readable id; the others are told apart by a hash
        assert len(set(ids)) == len(ids) - 1  # ThirdPartyConnector and thirdpartyconnector: one id, two scopes
        assert own_rule_id(kind, "ThirdPartyConnector") == f"{kind}.thirdpartyconnector"


def test_a_connector_name_that_is_not_text_is_refused_at_the_field() -> None:
    for run in (gate, resolved):
        with pytest.raises(StartupError) as exc:
            run("\ud800Conn", {})
        assert where(exc.value) == [(WHERE, "invalid-input")]


@pytest.mark.parametrize(("ktc", "at"), [
    (SimpleNamespace(kv_connector=5, kv_connector_extra_config={}), "kv_transfer_config.kv_connector"),
    (SimpleNamespace(kv_connector="", kv_connector_extra_config={}), "kv_transfer_config.kv_connector"),
    (SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_extra_config=["a"]), WHERE),
])
def test_a_kv_transfer_config_of_the_wrong_shape_is_refused_not_ignored(ktc: Any, at: str) -> None:
    """It used to be read as no connector, or as an empty extra config: a silent guess."""
    cfg = config()
    cfg.kv_transfer_config = ktc
    with pytest.raises(StartupError) as exc:
        resolve(RESOLVER, cfg, [FLASHINFER], [FullAttentionSpec()])
    assert [d.file for d in exc.value.diagnostics] == [at]
    if isinstance(ktc.kv_connector_extra_config, list):
        with pytest.raises(StartupError) as exc:
            gate("OffloadingConnector", ["a"])
        assert [d.file for d in exc.value.diagnostics] == [at]


# ---------------------------------------------------------------- KVPOLICY_RULES


@pytest.fixture
def _unforced(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py forces a profile for the library's suites; here the (fake) running vLLM decides."""
    monkeypatch.delenv("KVPOLICY_VLLM_VERSION", raising=False)
    monkeypatch.delenv("KVPOLICY_VLLM_PROFILE", raising=False)


@pytest.mark.usefixtures("_unforced")
@pytest.mark.parametrize("flavor", ["0.34", "0.28"])
@pytest.mark.parametrize("rules", ["/tmp/" + "a" * 5000, "/tmp/" + "b" * 300, "/tmp" + "/a" * 3000,
                                   "/tmp/x:/tmp/" + "c" * 300])
def test_rule_directories_longer_than_the_system_allows_stop_start_up_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flavor: str, rules: str) -> None:
    """An OSError (File name too long) escaped the plugin; now the rules do not load, located at the
    directory, under the variable's name, and nothing stays installed."""
    with fake_vllm(tmp_path / "site", "0.34.0" if flavor == "0.34" else "0.28.0", flavor):
        monkeypatch.setenv("KVPOLICY_RULES", rules)
        with pytest.raises(RuleLoadError) as exc:
            vllm_plugin.register()
        text = exc.value.render()
        assert text.startswith(f"kvpolicy: the rules in KVPOLICY_RULES={rules}") and "vLLM must not start" in text
        assert "error[unreadable]: cannot look the directory up: File name too long" in text
        assert not vllm_plugin.status()["active"]


@pytest.mark.parametrize(("rules", "message"), [
    ("/etc/a\0b", "holds a NUL byte"),  # os.environ cannot hold one; a mapping handed to from_env can
    ("~no-such-user-kvpolicy/rules", "names no user's home directory"),  # a RuntimeError escaped
    ("/etc/a:~no-such-user-kvpolicy", "names no user's home directory"),
])
def test_rule_settings_no_path_can_hold_stop_start_up_at_the_variable(rules: str, message: str) -> None:
    with pytest.raises(vllm_plugin.PluginError) as exc:
        Settings.from_env({"KVPOLICY_RULES": rules})
    [d] = exc.value.diagnostics
    assert (d.file, d.code) == ("KVPOLICY_RULES", "invalid-setting") and message in d.message


# ---------------------------------------------------------------- vLLM's other objects, and its version


def test_vllm_objects_of_the_wrong_shape_are_located_not_type_errors(caplog: pytest.LogCaptureFixture) -> None:
    """A TypeError escaped for an attention group whose layer_names is no list (the gate: kvpolicy cannot
    describe the KV cache, so per-layer buffers and a warning, as for any such spec) and for a worker report
    that is no list of layout names (the resolver: start-up stops, located)."""
    from test_vllm import group

    bad = group()
    bad.layer_names = 5
    assert use_uniform_kv_cache([[bad]], OffloadingConnector(), engine=GATE) is False
    assert "attn_groups[0].layer_names: error[unknown-spec]" in caplog.text
    for reports in ([5], [FLASHINFER, None], "LBHNC"):
        with pytest.raises(StartupError) as exc:
            resolve(RESOLVER, config(), reports, [FullAttentionSpec()])
        assert exc.value.diagnostics[0].file.startswith("supported_layouts[")


def test_a_version_whose_numbers_cannot_be_converted_is_no_version() -> None:
    """`vllm.__version__` or KVPOLICY_VLLM_VERSION with a number of 5,000 digits raised ValueError (Python
    converts at most 4,300): it is no version, and a forced one is located at the variable."""
    from kvpolicy.engine.integrations.vllm_plugin import pick_profile

    huge = "0." + "9" * 5000
    assert pick_profile(huge) is None and pick_profile("0.34." + "1" * 18).name == "vllm-0.34"
    with pytest.raises(vllm_plugin.PluginError) as exc:
        pick_profile("0.34.0", huge)
    assert exc.value.diagnostics[0].file == "KVPOLICY_VLLM_VERSION" and len(exc.value.render()) < 2000
