"""Exchanges between a fleet's deployments (`kvpolicy.engine.fleet`) and the host CPU as a case key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpolicy.engine.fleet import (
    FleetError,
    compare_transfer,
    decide_fleet,
    exchange_answers,
    load_fleet,
    transfer_unit,
)
from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.engine.policy_tests import PolicyTestError, load_cases
from kvpolicy.engine.policy_tests.cases import CaseInput, context_for
from kvpolicy.engine.rule_layers import load_layers

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "docs" / "examples" / "models" / "qwen2.5-0.5b"


def _fp(**inputs):
    return LayoutEngine.default("vllm-0.34").decide(explain=False, model=str(QWEN), **inputs).fingerprint


def test_the_transfer_unit_is_layer_views_for_example_connector_only() -> None:
    assert transfer_unit("ExampleConnector") == "layer_view"
    for name in ("NixlConnector", "NixlPullConnector", "OffloadingConnector", "MooncakeStoreConnector",
                 "MultiConnector", "LMCacheConnectorV1", "SomeoneElsesConnector", None):
        assert transfer_unit(name) == "block"


def test_compare_transfer_names_each_side_and_never_transcodes_raw_blocks() -> None:
    hnd, nhd = _fp(vllm_kv_cache_layout="LBHNC"), _fp(vllm_kv_cache_layout="LBNHC")
    assert compare_transfer("ExampleConnector", hnd, nhd) == ("as_is", (), "")
    kind, diffs, why = compare_transfer("NixlConnector", hnd, nhd, "a", "b")
    assert kind == "refused" and "cannot transcode" in why
    assert "head_order: a HND, b NHD" in [str(d) for d in diffs]
    b16, b32 = _fp(block_size=16), _fp(block_size=32)
    kind, diffs, _ = compare_transfer("MooncakeStoreConnector", b16, b32, "w", "r")
    assert kind == "refused" and [str(d) for d in diffs] == ["block_size: w 16, r 32"]  # groups[0] not repeated
    kind, diffs, _ = compare_transfer("ExampleConnector", b16, b32, "w", "r")
    assert kind == "refused" and [d.field for d in diffs] == ["block_size"]
    assert compare_transfer("NixlConnector", b16, b16) == ("as_is", (), "")


def test_a_case_takes_the_host_cpu_and_decides_its_kernel_order() -> None:
    inp = CaseInput(model=str(QWEN), device="cpu", block_size=32, cpu="X86+AMX+avx512", vllm_version="vllm-0.34")
    assert inp.cpu == "x86+avx512+amx"  # the canonical label
    ctx = context_for(inp)
    decision = LayoutEngine.default("vllm-0.34").decide(ctx)
    assert decision.fingerprint.kernel_order == "amx"
    plain = context_for(inp.model_copy(update={"cpu": "x86"}))
    assert LayoutEngine.default("vllm-0.34").decide(plain).fingerprint.kernel_order == "vec"


def test_a_wrong_cpu_label_is_located_at_its_key(tmp_path: Path) -> None:
    path = tmp_path / "cases.yaml"
    path.write_text("version: 1\ncases:\n  - name: amx host\n    input:\n      spec: {num_layers: 2, num_kv_heads: 1, "
                    "head_size: 64}\n      device: cpu\n      cpu: x86+sse\n    expect: {layout: LBHNC}\n")
    with pytest.raises(PolicyTestError) as info:
        load_cases([path])
    (d,) = info.value.diagnostics
    assert (d.line, d.col, d.code) == (7, 12, "invalid-value")
    assert d.message.startswith("`cpu`: unknown CPU feature `sse`")


def test_exchanges_load_located_and_answer_every_ordered_pair(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"""version: 1
defaults: {{vllm_version: "0.34.0", model: {QWEN}}}
deployments:
  - {{name: a, connector: NixlConnector}}
  - {{name: b, connector: NixlConnector}}
  - {{name: c, connector: NixlConnector, kv_cache_dtype: fp8}}
  - {{name: d, connector: NixlConnector, block_size: 16}}
exchanges:
  - name: three
    deployments: [a, b, c]
  - name: heterogeneous
    deployments: [a, d]
""")
    loaded = load_fleet(fleet)
    ex, _ = loaded.exchanges
    assert (ex.name, ex.deployments, ex.connector, ex.connector_from, ex.line, ex.unit) == \
        ("three", ("a", "b", "c"), "NixlConnector", "deployments", 9, "block")
    answers = exchange_answers(loaded, decide_fleet(loaded, lambda p: load_layers(vllm_version=p)))
    assert [(a.writer, a.reader, a.answer) for a in answers] == [
        ("a", "b", "as_is"), ("a", "c", "refused"), ("b", "a", "as_is"), ("b", "c", "refused"),
        ("c", "a", "refused"), ("c", "b", "refused"),
        ("a", "d", "as_is"), ("d", "a", "as_is")]  # NIXL pairs block sizes (and TP sizes) itself
    assert answers[1].fields[0] == "cache_dtype" and answers[1].location == f"{fleet}:9"
    assert "kv_cache_dtype: a bfloat16, c fp8_e4m3" in answers[1].to_dict()["differences"]
    fleet.write_text(fleet.read_text().replace("[a, b, c]", "[a, z]"))
    with pytest.raises(FleetError) as info:
        load_fleet(fleet)
    (d,) = info.value.diagnostics
    assert (d.line, d.col, d.code) == (10, 22, "unknown-deployment")
