"""`kvpolicy compat`: each side as it is declared (a fleet's FLEET.yaml#NAME, a release with the deployment
flags), one side's keys changed (--from/--to KEY=VALUE), and --via CONNECTOR's transfer unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "docs" / "examples" / "models"

FLEET = f"""\
version: 1
defaults: {{vllm_version: "0.34.0", model: {MODELS}/qwen2.5-0.5b}}
deployments:
  - {{name: prefill, connector: NixlConnector}}
  - {{name: decode, connector: NixlConnector}}
  - {{name: hnd, connector: ExampleConnector, vllm_kv_cache_layout: LBHNC}}
  - {{name: nhd, connector: ExampleConnector, vllm_kv_cache_layout: LBNHC}}
  - name: typo
    connector: NixlConector
"""


@pytest.fixture()
def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code, out, err = cli(capsys, "compat", *argv, "--format", "json")
    assert out, err
    return code, json.loads(out)


def test_a_fleet_deployment_is_a_side_as_it_is_declared(capsys: pytest.CaptureFixture[str], fleet: Path) -> None:
    code, report = _json(capsys, f"{fleet}#prefill", f"{fleet}#decode", "--via", "NixlConnector")
    assert code == 0 and report["exchange"] == "as_is"
    assert (report["via"], report["unit"]) == ("NixlConnector", "block")
    assert report["from"]["from"] == f"{fleet}#prefill" and report["from"]["block_size"] == 64
    assert report["cost"]["descriptors_per_block"] == {"from": 24, "to": 24}
    # a rolling upgrade of one deployment: the same keys under another release
    code, out, _ = cli(capsys, "compat", f"{fleet}#prefill", f"{fleet}#prefill", "--to", "vllm_version=0.28.0")
    assert code == 1 and "    block_size: source 64, target 16" in out.splitlines()
    assert out.splitlines()[1].startswith(f"TO   {fleet}#prefill (vllm_version=0.28.0): ")


def test_via_answers_for_the_connectors_transfer_unit(capsys: pytest.CaptureFixture[str], fleet: Path) -> None:
    """HND and NHD per-layer caches: kvpolicy's restore transcodes, ExampleConnector (layer views) moves them as
    is, NixlConnector (raw blocks as they are) cannot."""
    hnd, nhd = f"{fleet}#hnd", f"{fleet}#nhd"
    code, report = _json(capsys, hnd, nhd, "--via", "none")
    assert code == 0 and (report["exchange"], report["unit"], report["via"]) == ("transcode", "block", None)
    code, report = _json(capsys, hnd, nhd, "--via", "ExampleConnector")
    assert code == 0 and (report["exchange"], report["unit"]) == ("as_is", "layer_view")
    assert report["layer_view_digest"]["from"] == report["layer_view_digest"]["to"] and "cost" not in report
    code, report = _json(capsys, hnd, nhd, "--via", "NixlConnector")
    assert code == 1 and report["exchange"] == "refused" and "cannot transcode" in report["reason"]
    assert "head_order: source HND, target NHD" in report["differences"]
    code, out, _ = cli(capsys, "compat", hnd, nhd, "--via", "NixlConnector")
    lines = out.splitlines()
    assert lines[2] == "compared: raw blocks, as NixlConnector moves them: as is or not at all (it cannot transcode)"
    assert lines[3] == "exchange: not at all"
    assert "    head_order: source HND, target NHD" in lines
    code, out, _ = cli(capsys, "compat", hnd, nhd, "--via", "ExampleConnector")
    assert out.splitlines()[2].startswith("compared: layer views, as ExampleConnector moves them")


def test_two_fleet_sides_are_compared_through_the_connector_both_declare(capsys: pytest.CaptureFixture[str],
                                                                        fleet: Path) -> None:
    """What moves a P/D pair's blocks is the connector they declare: no --via answers as it moves them, and says
    so; --via none asks kvpolicy's own restore."""
    code, out, err = cli(capsys, "compat", f"{fleet}#hnd", f"{fleet}#nhd", "--format", "json")
    assert code == 0 and json.loads(out)["via"] == "ExampleConnector"
    assert "note: compared via ExampleConnector, the connector both deployments declare" in err
    code, out, err = cli(capsys, "compat", f"{fleet}#prefill", f"{fleet}#hnd")
    assert "compared: raw blocks, as kvpolicy's own restore reads them" in out and "note: compared via" not in err


def test_a_hash_in_a_deployment_name_or_a_file_name(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = tmp_path / "site#1"
    folder.mkdir()
    path = folder / "fleet.yaml"
    path.write_text(FLEET.replace("name: prefill,", "name: pre#fill,"))
    code, report = _json(capsys, f"{path}#pre#fill", f"{path}#decode")
    assert code == 0 and report["from"]["from"] == f"{path}#pre#fill" and report["via"] == "NixlConnector"
    code, _, err = cli(capsys, "compat", f"{path}#pre#fil", f"{path}#decode")
    assert code == 2 and "no deployment `pre#fil`" in err and "did you mean `pre#fill`?" in err


def test_one_sides_keys_and_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _json(capsys, "vllm-0.34", "vllm-0.34", "--from", "block_size=16", "--to", "block_size=32",
                         "--via", "MooncakeStoreConnector")
    assert code == 1 and report["exchange"] == "refused"
    assert "block_size: source 16, target 32" in report["cell_differences"]
    assert (report["from"]["from"], report["to"]["from"]) == ("vllm-0.34 (block_size=16)", "vllm-0.34 (block_size=32)")
    cpu = ("0.34.0", "0.34.0", "--device", "cpu", "--block-size", "32")
    code, out, _ = cli(capsys, "compat", *cpu, "--from", "cpu=x86", "--to", "cpu=x86+avx512+amx")
    assert code == 1 and "    kernel_order: source vec, target amx" in out.splitlines()
    assert "block 32, kernel order vec" in out.splitlines()[0]
    code, report = _json(capsys, *cpu, "--from", "cpu=x86", "--to", "cpu=x86+avx512+amx", "--via", "ExampleConnector")
    assert code == 1 and report["unit"] == "layer_view" and report["differences"] == [
        "kernel_order: source vec, target amx"]
    code, report = _json(capsys, *cpu, "--cpu", "x86+avx512+amx", "--via", "ExampleConnector")
    assert code == 0 and report["exchange"] == "as_is" and report["from"]["kernel_order"] == "amx"
    code, _, err = cli(capsys, "compat", *cpu)  # no host said: this machine's, in a note per side
    assert "note: FROM runs CPU_ATTN, whose kernel order" in err and "pass --cpu, or --to cpu=LABEL" in err


def test_the_deployment_flags_a_release_side_lacked(capsys: pytest.CaptureFixture[str]) -> None:
    llama = str(MODELS / "llama-3.1-8b")
    code, report = _json(capsys, "0.34.0", "0.34.0", "--model", llama, "--tensor-parallel-size", "2",
                         "--to", "tensor_parallel_size=1")
    assert code == 1 and "num_kv_heads: source 4, target 8" in report["cell_differences"]
    ktc = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    code, report = _json(capsys, "0.34.0", "0.34.0", "--model", llama, "--kv-transfer-config", ktc,
                         "--to", "connector=OffloadingConnector", "--via", "NixlConnector")
    assert code == 0 and report["exchange"] == "as_is"
    code, report = _json(capsys, "0.34.0", "0.34.0", "--model", llama, "--dtype", "float16", "--to", "dtype=bfloat16")
    assert code == 1 and "cache_dtype: source float16, target bfloat16" in report["cell_differences"]


def test_a_bad_side_is_an_error_where_it_is(capsys: pytest.CaptureFixture[str], fleet: Path, tmp_path: Path) -> None:
    code, _, err = cli(capsys, "compat", f"{fleet}#prefil", f"{fleet}#decode")
    assert code == 2 and err.startswith("FROM: error[usage]: no deployment `prefil` in fleet")
    assert "did you mean `prefill`?" in err
    code, _, err = cli(capsys, "compat", f"{fleet}#prefill", f"{fleet}#typo")  # decides nothing: where it is written
    assert code == 2 and f"{fleet}:9:16: error[unknown-connector]" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text(FLEET + "exchanges:\n  - {name: x, deployments: [prefill, decod]}\n")
    code, _, err = cli(capsys, "compat", f"{broken}#prefill", "vllm-0.34")
    assert code == 2 and f"{broken}:11:38: error[unknown-deployment]" in err
    code, _, err = cli(capsys, "compat", f"{tmp_path}/none.yaml#prefill", "vllm-0.34")
    assert code == 2 and "is no fleet file" in err
    code, _, err = cli(capsys, "compat", f"{fleet}#prefill", "vllm-0.34", "--to", "cpu=x87")
    assert code == 2 and err.startswith("--to cpu: error[usage]: TO: `cpu`: unknown CPU architecture `x87`")
    code, _, err = cli(capsys, "compat", f"{fleet}#prefill", "vllm-0.34", "--from", "blok_size=16")
    assert code == 2 and err.startswith("--from blok_size: error[usage]: no case key `blok_size`")
    assert "did you mean `block_size`?" in err
    code, _, err = cli(capsys, "compat", "vllm-0.34", "vllm-0.34", "--to", "vllm_version=0.28.0")
    assert code == 2 and err.startswith("--to vllm_version: error[usage]: TO names its release already")
    code, _, err = cli(capsys, "compat", f"{fleet}#prefill", f"{fleet}#decode", "--block-size", "16")
    assert code == 2 and err.startswith("--block-size: error[usage]: --block-size describes the deployment of a "
                                        "release side")
    code, _, err = cli(capsys, "compat", f"{fleet}#prefill", "vllm-0.34", "--via", "NixlConector")
    assert code == 2 and "did you mean `NixlConnector`?" in err
    code, _, err = cli(capsys, "compat", "--table", "--from", "block_size=16")
    assert code == 2 and err.startswith("--from: error[usage]")
    code, _, err = cli(capsys, "compat", "vllm-0.34", "vllm-0.34", "--from", "block_size")
    assert code == 2 and "expected KEY=VALUE" in err
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--format", "json")
    (tmp_path / "decided.json").write_text(out)
    code, _, err = cli(capsys, "compat", str(tmp_path / "decided.json"), "vllm-0.34", "--from", "block_size=16")
    assert code == 2 and err.startswith("--from: error[usage]: FROM is a file, a layout decided already")


def test_the_table_answers_via_a_connector(capsys: pytest.CaptureFixture[str]) -> None:
    code, table = _json(capsys, "--table", "--block-size", "16", "--kv-cache-dtype", "auto", "--via", "NixlConnector")
    assert code == 0 and (table["via"], table["unit"]) == ("NixlConnector", "block")
    kinds = {k for row in table["exchanges"] for k in row}
    assert "transcode" not in kinds and {"as_is", "refused"} <= kinds  # raw blocks: as is or not at all


@pytest.mark.parametrize("value", ["cpu=!!binary aGVsbG8=", "cpu=2001-12-14", "block_size=!!set {a, b}",
                                   "spec=" + "[" * 5000 + "]" * 5000,
                                   "spec=a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
                                   "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
                                   "e: [*d,*d,*d,*d,*d,*d,*d,*d,*d]", "cpu=" + "x" * 200_000])
def test_a_hostile_side_value_is_a_usage_error_not_a_traceback(capsys: pytest.CaptureFixture[str], fleet: Path,
                                                                value: str) -> None:
    code, out, err = cli(capsys, "compat", f"{fleet}#prefill", f"{fleet}#decode", "--from", value)
    assert code == 2 and "Traceback" not in out + err and "--from" in err


def test_a_deep_kv_transfer_config_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "compat", "0.34.0", "0.34.0", "--kv-transfer-config", "[" * 3000 + "]" * 3000)
    assert code == 2 and "--kv-transfer-config" in err and "Traceback" not in err
