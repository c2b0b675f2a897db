"""A fleet's `exchanges:`: where blocks move between deployments, every ordered pair answered by what the
connector moves (layer views for ExampleConnector, raw blocks as they are for every other), in dry-run --fleet
(text, JSON, JUnit) and lint --fleet (an error per refused pair, located at the exchange)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "docs" / "examples" / "models"
FLEET = ROOT / "docs" / "examples" / "fleet.yaml"

STORE = f"""\
version: 1
defaults: {{vllm_version: "0.34.0", model: {MODELS}/llama-3.1-8b}}
deployments:
  - {{name: prefill, connector: NixlConnector}}
  - {{name: decode, connector: NixlConnector}}
  - {{name: store-b16, connector: MooncakeStoreConnector, block_size: 16}}
  - {{name: store-b32, connector: MooncakeStoreConnector, block_size: 32}}
exchanges:
  - name: pd
    deployments: [prefill, decode]
  - name: store
    description: one Mooncake store, two block sizes
    deployments: [store-b16, store-b32]
"""

VIEWS = f"""\
version: 1
defaults: {{vllm_version: "0.34.0", model: {MODELS}/qwen2.5-0.5b, connector: ExampleConnector}}
deployments:
  - {{name: hnd, vllm_kv_cache_layout: LBHNC}}
  - {{name: nhd, vllm_kv_cache_layout: LBNHC}}
  - {{name: cross, vllm_kv_cache_layout: BLHNC}}
  - {{name: broken, kv_cache_dtype: nope}}
  - {{name: cpu-x86, device: cpu, cpu: x86, block_size: 32}}
  - {{name: cpu-amx, device: cpu, cpu: x86+avx512+amx, block_size: 32}}
  - {{name: hnd-nixl, vllm_kv_cache_layout: LBHNC, connector: NixlConnector}}
  - {{name: nhd-nixl, vllm_kv_cache_layout: LBNHC, connector: NixlConnector}}
exchanges:
  - {{name: views, deployments: [hnd, nhd, cross]}}
  - {{name: raw, deployments: [hnd-nixl, nhd-nixl], connector: NixlConnector}}
  - {{name: with-broken, deployments: [hnd, broken]}}
  - {{name: cpu-store, deployments: [cpu-x86, cpu-amx]}}
"""


def _write(tmp_path: Path, text: str, name: str = "fleet.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _pairs(doc: dict) -> dict[tuple[str, str, str], dict]:
    return {(a["exchange"], a["writer"], a["reader"]): a for a in doc["exchanges"]}


def test_raw_block_pairs_exchange_as_is_or_are_refused_naming_every_field(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = _write(tmp_path, STORE)
    code, out, err = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", "json")
    doc = json.loads(out)
    assert code == 1, err  # every deployment decides; a refused pair fails the run
    assert doc["summary"]["decided"] == 4
    pairs = _pairs(doc)
    assert len(pairs) == 4  # every ordered pair of each exchange
    pd = pairs[("pd", "prefill", "decode")]
    assert (pd["answer"], pd["unit"], pd["connector"], pd["connector_from"]) == \
        ("as_is", "block", "NixlConnector", "deployments")
    assert pd["location"] == f"{fleet}:9" and pd["differences"] == [] and pd["change"] is None
    refused = pairs[("store", "store-b16", "store-b32")]
    assert refused["answer"] == "refused" and refused["fields"] == ["block_size"]
    assert refused["differences"] == ["block_size: store-b16 16, store-b32 32"]
    assert "`block_size`" in refused["change"]
    assert pairs[("store", "store-b32", "store-b16")]["differences"] == ["block_size: store-b32 32, store-b16 16"]

    code, text, _ = cli(capsys, "dry-run", "--fleet", str(fleet))
    assert code == 1
    assert "exchanges: 4 ordered pair(s): 2 as is, 2 refused, 0 unknown" in text
    assert f"  pd ({fleet}:9): NixlConnector (the deployments' own) moves raw blocks" in text
    assert "    prefill -> decode: as is" in text
    assert "    store-b16 -> store-b32: refused: a block's cells differ: block_size: store-b16 16, store-b32 32" in text


def test_a_fleet_whose_exchanges_all_move_as_is_passes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = _write(tmp_path, STORE.split("  - name: store\n")[0])
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", "json")
    assert code == 0 and [a["answer"] for a in json.loads(out)["exchanges"]] == ["as_is", "as_is"]
    code, out, _ = cli(capsys, "lint", "--fleet", str(fleet), "--format", "json")
    assert not [f for f in json.loads(out)["findings"] if f["code"] == "exchange-refused"]


def test_layer_views_ignore_placement_and_head_order_raw_blocks_do_not(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """ExampleConnector moves each layer's [B, H, N, C] view: LBHNC, LBNHC and cross-layer BLHNC caches exchange
    as is; two such caches of engines running NixlConnector (raw blocks, no transcoding) do not. A deployment that
    decides nothing leaves its pairs unknown, saying why; the CPU kernel's order is a view's business too."""
    fleet = _write(tmp_path, VIEWS)
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", "json")
    assert code == 1  # `broken` is invalid, and two pairs are refused
    pairs = _pairs(json.loads(out))
    views = [a for (ex, _, _), a in pairs.items() if ex == "views"]
    assert len(views) == 6 and {(a["answer"], a["unit"]) for a in views} == {("as_is", "layer_view")}
    raw = pairs[("raw", "hnd-nixl", "nhd-nixl")]
    assert (raw["answer"], raw["unit"], raw["connector_from"]) == ("refused", "block", "exchange")
    assert "head_order" in raw["fields"] and "cannot transcode" in raw["reason"]
    assert "`vllm_kv_cache_layout`" in raw["change"]
    unknown = pairs[("with-broken", "hnd", "broken")]
    assert unknown["answer"] == "unknown" and "`broken` decides no layout (invalid: " in unknown["reason"]
    assert "kv_cache_dtype `nope`" in unknown["reason"]
    cpu = pairs[("cpu-store", "cpu-x86", "cpu-amx")]
    assert (cpu["answer"], cpu["unit"], cpu["fields"]) == ("refused", "layer_view", ["kernel_order"])
    assert cpu["differences"] == ["kernel_order: cpu-x86 vec, cpu-amx amx"] and "`cpu`" in cpu["change"]


def test_junit_has_a_suite_of_exchange_pairs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = _write(tmp_path, VIEWS)
    _, out, _ = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", "junit")
    root = ET.fromstring(out.split("\n", 1)[1])
    deployments, exchanges = root.findall("testsuite")
    cases = exchanges.findall("testcase")
    assert len(cases) == int(exchanges.get("tests")) == 6 + 2 + 2 + 2
    failed = [c for c in cases if c.find("failure") is not None]
    assert {c.get("name") for c in failed} == {"hnd-nixl -> nhd-nixl", "nhd-nixl -> hnd-nixl", "cpu-x86 -> cpu-amx",
                                             "cpu-amx -> cpu-x86"}
    assert failed[0].find("failure").get("type") == "exchange-refused" and failed[0].get("classname") == "exchange.raw"
    assert exchanges.get("skipped") == "2" and exchanges.get("failures") == "4"
    assert root.get("failures") == str(int(deployments.get("failures")) + 4)


def test_lint_reports_each_refused_pair_at_the_exchange_in_every_format(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = _write(tmp_path, STORE)
    code, out, _ = cli(capsys, "lint", "--fleet", str(fleet), "--format", "json")
    data = json.loads(out)
    refused = [f for f in data["findings"] if f["code"] == "exchange-refused"]
    assert code == 1 and data["ok"] is False and len(refused) == 2
    assert {f["location"] for f in refused} == {f"{fleet}:11"}  # the `store` exchange's line
    first = refused[0]
    assert first["severity"] == "error" and first["rule"] is None
    assert "`store-b16`" in first["message"] and "`store-b32`" in first["message"]
    assert "block_size: store-b16 16, store-b32 32" in first["message"]
    assert "give both deployments the same `block_size`" in first["message"]  # what to change
    assert "MooncakeStoreConnector: raw blocks, as is only" in first["message"]
    code, out, _ = cli(capsys, "lint", "--fleet", str(fleet))
    assert code == 1 and f"{fleet}:11: error[exchange-refused]: exchange `store`" in out
    code, out, _ = cli(capsys, "lint", "--fleet", str(fleet), "--format", "github")
    assert out.count(f"::error file={fleet},line=11,col=5,title=exchange-refused::") == 2
    code, out, _ = cli(capsys, "lint", "--fleet", str(fleet), "--format", "sarif")
    results = [r for r in json.loads(out)["runs"][0]["results"] if r["ruleId"] == "exchange-refused"]
    assert len(results) == 2 and results[0]["locations"][0]["physicalLocation"]["region"]["startLine"] == 11


def test_mistakes_in_exchanges_are_located(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = _write(tmp_path, STORE + """\
  - name: typo
    deployments: [prefill, decod]
  - name: twice
    deployments: [prefill, prefill]
  - name: mixed
    deployments: [prefill, store-b16]
  - name: bad-connector
    deployments: [prefill, decode]
    connector: NixlConector
  - name: alone
    deployments: [prefill]
  - name: pd
    deployments: [prefill, decode]
    bogus: 1
""")
    code, out, err = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", "json")
    assert code == 2, err
    diags = {(d["line"], d["col"], d["code"]): d for d in json.loads(out)["error"]["diagnostics"]}
    assert diags[(15, 28, "unknown-deployment")]["help"] == "did you mean `decode`?"
    assert "no deployment `decod` in this fleet" in diags[(15, 28, "unknown-deployment")]["message"]
    assert (17, 28, "duplicate-deployment") in diags
    mixed = diags[(19, 18, "exchange-connector")]
    assert "`prefill` NixlConnector, `store-b16` MooncakeStoreConnector" in mixed["message"]
    assert diags[(22, 16, "unknown-connector")]["help"].startswith("did you mean `NixlConnector`?")
    assert (24, 18, "invalid-value") in diags  # fewer than 2 deployments
    assert (27, 5, "unknown-key") in diags
    code, _, err = cli(capsys, "lint", "--fleet", str(fleet))
    assert code == 2 and f"{fleet}:15:28: error[unknown-deployment]" in err


def test_the_example_fleet_has_a_pair_that_moves_and_a_store_that_cannot(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(FLEET), "--format", "json")
    answers = {(a["exchange"], a["writer"]): a["answer"] for a in json.loads(out)["exchanges"]}
    assert code == 1 and answers == {
        ("llama-8b-pd", "llama-8b-nixl-pd"): "as_is", ("llama-8b-pd", "llama-8b-nixl-pd-decode"): "as_is",
        ("llama-8b-shared-store", "llama-8b-store-b16"): "refused",
        ("llama-8b-shared-store", "llama-8b-store-b32"): "refused"}


def test_an_exchange_through_a_connector_a_deployment_does_not_run_is_located(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An engine moves blocks only through the connector it runs: NixlConnector between two ExampleConnector
    deployments is a mistake in the file, not an answer; a MultiConnector's member is one the engine runs."""
    fleet = _write(tmp_path, f"""\
version: 1
defaults: {{vllm_version: "0.34.0", model: {MODELS}/qwen2.5-0.5b}}
deployments:
  - {{name: a, connector: ExampleConnector}}
  - {{name: b, connector: ExampleConnector}}
  - name: multi
    connector: MultiConnector
    connector_config: {{connectors: [{{kv_connector: NixlConnector}}, {{kv_connector: OffloadingConnector}}]}}
  - {{name: nixl, connector: NixlConnector}}
exchanges:
  - {{name: wrong, deployments: [a, b], connector: NixlConnector}}
  - {{name: member, deployments: [multi, nixl], connector: NixlConnector}}
""")
    code, _, err = cli(capsys, "lint", "--fleet", str(fleet))
    assert code == 2 and f"{fleet}:11:" in err and "error[exchange-connector]" in err
    assert "`a` runs ExampleConnector, `b` runs ExampleConnector" in err and "`multi`" not in err


def test_cpu_beside_fleet_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "dry-run", "--fleet", str(FLEET), "--cpu", "x86")
    assert code == 2 and "--cpu describes one deployment" in err


def test_names_with_control_characters_keep_the_junit_report_xml(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    fleet = _write(tmp_path, STORE.replace("name: pd\n", 'name: "pd\\e[2J\\u0007"\n'))
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", "junit")
    assert code == 1  # the store pair is refused
    suites = ET.fromstring(out.split("\n", 1)[1])
    pairs = [c for c in suites.iter("testcase") if c.get("classname", "").startswith("exchange.pd")]
    assert [c.get("classname") for c in pairs] == ["exchange.pd\\x1b[2J\\x07"] * 2


def test_an_exchange_of_more_than_64_deployments_is_located(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    names = [f"d{i}" for i in range(65)]
    text = (f'version: 1\ndefaults: {{vllm_version: "0.34.0", model: {MODELS}/qwen2.5-0.5b}}\ndeployments:\n'
            + "".join(f"  - {{name: {n}}}\n" for n in names)
            + f"exchanges:\n  - name: all\n    connector: NixlConnector\n    deployments: [{', '.join(names)}]\n")
    code, _, err = cli(capsys, "lint", "--fleet", str(_write(tmp_path, text)))
    assert code == 2 and f":{len(names) + 7}:" in err and "at most 64" in err
