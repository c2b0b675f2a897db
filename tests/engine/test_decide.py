"""Decision semantics (docs/rule-language.md): forbid wins, scopes, ranking, conflicts, traces."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvpolicy.engine import CandidateRemoved, LayoutEngine
from kvpolicy.policy import (
    ConnectorConfig,
    Layout,
    NoLayoutError,
    Placement,
    load_rules_from_texts,
)

SPEC = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def engine_for(files: dict[str, str]) -> LayoutEngine:
    return LayoutEngine(load_rules_from_texts(files))


def rules_yaml(*rules: str, connector: str | None = None, extra: str = "") -> str:
    head = "version: 1\n" + (f"connector: {connector}\n" if connector else "") + extra + "rules:\n"
    return head + "".join(rules)


def r(rule_id: str, effect: str, when: str | None = None, weight: int | None = None) -> str:
    text = f"  - id: {rule_id}\n    description: {rule_id}\n"
    if when:
        text += f"    when: {when}\n"
    text += f"    {effect}\n"
    if weight:
        text += f"    weight: {weight}\n"
    return text


def decide(engine: LayoutEngine, **kw):
    kw.setdefault("spec", SPEC)
    return engine.decide(**kw)


def test_no_rules_picks_the_default_order_head() -> None:
    e = engine_for({"global.yaml": rules_yaml()})
    assert str(decide(e).layout) == "LBNHC"


def test_declared_default_order_breaks_ties() -> None:
    e = engine_for({"global.yaml": rules_yaml(extra="defaults:\n  layout_order: [BHLNC]\n")})
    d = decide(e)
    assert str(d.layout) == "BHLNC"
    # unlisted layouts follow in vLLM's KVCacheLayout enum order
    assert [str(lay) for lay, _ in d.ranking] == ["BHLNC", "LBHNC", "LBNHC", "BLNHC"]


def test_prefer_weights_sum_and_rank() -> None:
    e = engine_for({"global.yaml": rules_yaml(
        r("a", "prefer: {placement: cross_layer}", weight=3),
        r("b", "prefer: {head_order: HND}", weight=2),
        r("c", "prefer: {placement: per_layer, head_order: HND}", weight=4),
    )})
    d = decide(e)
    assert [(str(lay), s) for lay, s in d.ranking] == [
        ("LBHNC", 6), ("BHLNC", 5), ("BLNHC", 3), ("LBNHC", 0)]


def test_connector_rules_cannot_lift_a_global_forbid() -> None:
    files = {
        "global.yaml": rules_yaml(r("no-cross", "forbid: {placement: cross_layer}")),
        "connectors/off.yaml": rules_yaml(
            r("want-cross", "prefer: {placement: cross_layer}", weight=100),
            r("need-cross", "require: {placement: cross_layer}"),
            connector="OffloadingConnector"),
    }
    e = engine_for(files)
    with pytest.raises(NoLayoutError) as info:
        decide(e, connector="OffloadingConnector")
    text = info.value.render()
    assert "rule `no-cross` (forbid, global) removed `BLNHC`, `BHLNC`" in text
    assert "rule `need-cross` (require, connector:OffloadingConnector) removed `LBHNC`, `LBNHC`" in text
    assert "global.yaml:3:5" in text and "connectors/off.yaml:8:5" in text
    # without the connector, its rules are out of scope
    assert decide(e).layout.placement is Placement.per_layer


def test_connector_rules_apply_only_to_their_connector() -> None:
    files = {"global.yaml": rules_yaml(),
             "connectors/off.yaml": rules_yaml(r("p", "prefer: {placement: cross_layer}"),
                                               connector="OffloadingConnector")}
    e = engine_for(files)
    assert decide(e, connector="OffloadingConnector").layout.placement is Placement.cross_layer
    assert decide(e, connector="NixlConnector").layout.placement is Placement.per_layer
    assert decide(e).layout.placement is Placement.per_layer


@pytest.mark.parametrize(("mode", "expected"), [("all", "BHLNC"), ("any", "LBHNC"),
                                                ("sum", "BHLNC")])
def test_member_preferences_combine(mode: str, expected: str) -> None:
    files = {
        "global.yaml": rules_yaml(),
        "connectors/multi.yaml": rules_yaml(connector="MultiConnector", extra=f"member_preferences: {mode}\n"),
        "connectors/off.yaml": rules_yaml(r("offl", "prefer: {placement: cross_layer}"),
                                          connector="OffloadingConnector"),
        "connectors/lm.yaml": rules_yaml(r("lm-hnd", "prefer: {head_order: HND}",
                                           when="{field: connector.present, eq: true}"),
                                         connector="LMCacheConnectorV1"),
    }
    e = engine_for(files)
    multi = ConnectorConfig(name="MultiConnector", connectors=(ConnectorConfig(name="OffloadingConnector"),
                                                               ConnectorConfig(name="LMCacheConnectorV1")))
    # Offloading gives +1 to both cross_layer layouts; LMCache +1 to both HND layouts.
    # all (min): only cross/HND has 1. any (max): a four-way... three-way tie at 1, default
    # order picks per/HND. sum: cross/HND has 2.
    assert str(decide(e, connector=multi).layout) == expected


def test_member_scopes_bind_connector_fields_to_the_member() -> None:
    files = {
        "global.yaml": rules_yaml(),
        "connectors/nixl.yaml": rules_yaml(
            r("nixl-flag", "prefer: {placement: cross_layer}",
              when="{field: connector.extra.flag, eq: on_member}", weight=5),
            connector="NixlConnector"),
    }
    e = engine_for(files)
    member = ConnectorConfig(name="NixlConnector", extra={"flag": "on_member"})
    multi = ConnectorConfig(name="MultiConnector", extra={"flag": "on_parent"}, connectors=(member,))
    d = decide(e, connector=multi)
    assert d.layout.placement is Placement.cross_layer
    [ev] = [x for x in d.rule_results if x.rule.id == "nixl-flag"]
    assert ev.scope == "connector:MultiConnector/NixlConnector[0]"
    assert ev.leaves[0].actual == "on_member"


def test_same_decision_whatever_the_file_order() -> None:
    e0 = LayoutEngine.default()
    chosen = set()
    # rebuild the shipped rules from texts under shuffled names: same digest, same decisions
    from kvpolicy.engine.layout_engine import shipped_rules_dir
    root = shipped_rules_dir()
    texts = {str(p.relative_to(root)): p.read_text() for p in [*root.glob("*.yaml"), *root.glob("connectors/*.yaml")]}
    rnd = random.Random(7)
    for _ in range(5):
        items = list(texts.items())
        rnd.shuffle(items)
        e = LayoutEngine(load_rules_from_texts(dict(items)))
        assert e.ruleset.digest == e0.ruleset.digest
        for conn in [None, "OffloadingConnector", "NixlConnector"]:
            kw = dict(spec=SPEC, connector=conn, kv_cache_dtype="auto")
            got, want = e.decide(**kw).to_dict(counterfactual=False), e0.decide(**kw).to_dict(counterfactual=False)
            def removers(data: dict) -> dict:
                return {k: sorted(r["rule"] for r in v) for k, v in data["eliminated"].items()}

            assert (got["layout"], removers(got)) == (want["layout"], removers(want))
            chosen.add(got["layout"]["name"])
    assert len(chosen) > 1  # the inputs are ones on which the order could show: not one constant answer


def test_trace_records_every_rule_and_leaf_value() -> None:
    d = LayoutEngine.default().decide(spec=SPEC, kv_cache_dtype="int8_per_token_head",
                                      connector="OffloadingConnector")
    results = {e.rule.id: e for e in d.rule_results}
    ev = results["per-token-head-forbids-cross-layer"]
    assert ev.matched and ev.scope == "global"
    assert [(lf.field, lf.actual, lf.result) for lf in ev.leaves] == [
        ("kv.per_token_head", True, True), ("backend.scale_views", "assume_per_layer_contiguous", True)]
    assert results["cross-layer-needs-connector"].matched is False
    removed = d.eliminated[Layout.parse("BLNHC")]
    assert [(rule.id, str(rule.source)) for rule, _ in removed] == [
        ("per-token-head-forbids-cross-layer", "rules/issue-48412/global.yaml:42")]


def test_counterfactual_names_the_smallest_change() -> None:
    d = LayoutEngine.default().decide(spec=SPEC, kv_cache_dtype="fp8_per_token_head",
                                      connector="OffloadingConnector")
    cf = {str(c.layout): c for c in d.counterfactuals}["BLNHC"]
    assert cf.changes is not None and len(cf.changes) == 1
    assert (cf.changes[0].field, cf.changes[0].was, cf.changes[0].becomes) == ("kv.per_token_head", True, False)
    text = d.to_dict()["counterfactual"]
    assert any(c["text"] == "BLNHC would be chosen if kv.per_token_head were false (it is true) "
               "(kv.per_token_head is derived from kv.kv_cache_dtype, not a setting)" for c in text)


def test_counterfactual_for_no_connector() -> None:
    d = LayoutEngine.default().decide(spec=SPEC)
    cf = {str(c.layout): c for c in d.counterfactuals}["BLNHC"]
    # removing the forbid is not enough: nothing prefers cross_layer without a connector
    assert cf.changes is None


def test_explain_modes_filter_the_trace() -> None:
    d = LayoutEngine.default().decide(spec=SPEC, kv_cache_dtype="fp8_per_token_head",
                                      connector="OffloadingConnector")
    full, fails, notes = d.explain("full"), d.explain("fails"), d.explain("notes")
    assert "[ ] cross-layer-needs-connector" in full
    assert "cross-layer-needs-connector" not in notes
    assert "[x] per-token-head-forbids-cross-layer" in notes
    assert "rules:" not in fails and "counterfactual:" in fails


def test_json_contract() -> None:
    d = LayoutEngine.default().decide(spec=SPEC, kv_cache_dtype="fp8_per_token_head",
                                      connector="OffloadingConnector")
    data = json.loads(d.to_json())
    assert data["layout"] == {"placement": "per_layer", "head_order": "NHD", "name": "LBNHC"}
    assert data["eliminated"]["BLNHC"][0]["rule"] == "per-token-head-forbids-cross-layer"
    assert data["rules"]["per-token-head-forbids-cross-layer"] is True
    assert data["rules"]["nixl-requires-hnd"] is False  # out of scope: reported, not matched
    assert data["ruleset"]["digest"].startswith("sha256:")
    assert data["inputs"]["kv"]["kv_cache_dtype"] == "fp8_per_token_head"


def test_fast_path_trace_is_computed_on_demand() -> None:
    d = LayoutEngine.default().decide(spec=SPEC, connector="NixlConnector",
                                      connector_config={"enable_cross_layers_blocks": "true"}, explain=False)
    assert d.layout == Layout.parse("BHLNC")
    explained = LayoutEngine.default().decide(spec=SPEC, connector="NixlConnector",
                                              connector_config={"enable_cross_layers_blocks": "true"})
    assert any(isinstance(e, CandidateRemoved) for e in d.events)
    assert d.events == explained.events  # the trace computed later is the one deciding with explain=True records
    assert {e.rule.id for e in d.rule_results} >= {r.rule.id for r in d.ruleset.global_rules}


def test_deciding_never_imports_torch() -> None:
    code = ("import sys\nfrom engine import LayoutEngine\n"
            "d = LayoutEngine.default().decide(spec=dict(num_layers=2, block_size=16, num_kv_heads=2, head_size=64),"
            " connector='OffloadingConnector')\nd.to_json(); d.explain()\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_candidate_without_geometry_never_wins_and_the_trace_says_why(tmp_path: Path) -> None:
    """A Context built by hand may list a layout the backend cannot plan (FLASHMLA has no head axis):
    rules preferring it must not make it the winner, or explain() and the fingerprint fail (#16)."""
    (tmp_path / "global.yaml").write_text(
        "version: 1\nrules:\n  - id: prefer-hnd\n    description: prefer head-major\n"
        "    prefer: {layout: LBHNC}\n    weight: 10\n")
    e = LayoutEngine.from_path(tmp_path, vllm_version="issue-48412")
    ctx = e.context(spec={"kind": "mla", "num_layers": 4, "num_kv_heads": 1, "head_size": 576}, backend="FLASHMLA")
    ctx = ctx.model_copy(update={"candidates": (Layout.LBNHC, Layout.LBHNC, Layout.BLNHC)})
    d = e.decide(ctx)
    assert d.layout == Layout.LBNHC
    assert [r.id for r, _ in d.eliminated[Layout.LBHNC]] == ["backend-geometry"]
    (geometry, _), = d.eliminated[Layout.LBHNC]
    assert str(geometry.source) == "policy/releases/issue-48412.yaml:1"  # located at the profile stating the facts
    assert d.fingerprint.placement == "per_layer" and "LBNHC" in d.explain()


@pytest.mark.parametrize("name", ["nixlconnector", " NixlConnector"])
def test_the_library_warns_of_a_connector_no_rules_apply_to(name: str) -> None:
    """Issue 23: `decide(connector="nixlconnector")` decided with no connector rules and no warning, while the
    CLI's dry-run warned; `Decision.warnings` (and its JSON) now carries the CLI's warning, members included."""
    engine = LayoutEngine.default("vllm-0.34")
    spec = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}
    decision = engine.decide(spec=spec, connector=name)
    expected = f"unknown connector `{name}`: no rules apply to it; did you mean `NixlConnector`?"
    assert expected in decision.warnings
    assert expected in json.loads(decision.to_json())["warnings"]
    member = engine.decide(spec=spec, kv_transfer_config={
        "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
            {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
                {"kv_connector": name, "kv_role": "kv_both"}]}}]}})
    assert expected in member.warnings
    assert not engine.decide(spec=spec, connector="NixlConnector").warnings


def test_a_connector_loaded_from_its_module_is_no_misspelling() -> None:
    """A kv_transfer_config that loads its connector by kv_connector_module_path names a class of the caller's
    own: no "unknown connector ... did you mean" warning (a bare unknown name still gets one)."""
    engine = LayoutEngine.default("0.34.0")
    spec = {"num_layers": 4, "num_kv_heads": 2, "head_size": 64}
    own = engine.decide(spec=spec, kv_transfer_config={"kv_connector": "MyConnector", "kv_role": "kv_both",
                                                       "kv_connector_module_path": "site.connectors"})
    assert not any("MyConnector" in w for w in own.warnings)
    assert any(w.startswith("unknown connector `MyConector`") for w in engine.decide(spec=spec,
                                                                                     connector="MyConector").warnings)
