"""`kvpolicy compat --rules DIR`: a release or fleet side decided with the operator's layers, so compat answers
for the layouts `dry-run --fleet --rules` decides, not for the shipped rules' alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

QWEN = str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "models" / "qwen2.5-0.5b")
NO_BHLNC = """version: 1
rules:
  - id: site-no-bhlnc
    description: our offload readers cannot read head-major cross-layer blocks
    forbid: {layout: BHLNC}
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "global.yaml").write_text(NO_BHLNC)
    (tmp_path / "fleet.yaml").write_text(f"""version: 1
defaults: {{model: {QWEN}, connector: OffloadingConnector, block_size: 16}}
deployments:
  - {{name: old, vllm_version: "0.28.0"}}
  - {{name: new, vllm_version: "0.34.0"}}
exchanges:
  - {{name: upgrade, deployments: [old, new]}}
""")
    return tmp_path


def test_a_fleet_pair_is_answered_as_dry_run_fleet_answers_it_with_the_same_layers(capsys, site: Path) -> None:
    fleet, rules = str(site / "fleet.yaml"), str(site / "site")
    code, out, _ = cli(capsys, "dry-run", "--fleet", fleet, "--rules", rules, "--format", "json")
    assert code == 0 and {e["answer"] for e in json.loads(out)["exchanges"]} == {"as_is"}
    code, out, err = cli(capsys, "compat", f"{fleet}#old", f"{fleet}#new", "--rules", rules, "--format", "json")
    report = json.loads(out)
    assert code == 0, err
    assert (report["from"]["layout"], report["to"]["layout"], report["exchange"]) == ("LBHNC", "LBHNC", "as_is")
    # without the layer, the shipped rules alone: 0.28 goes cross-layer, and OffloadingConnector cannot transcode
    code, out, _ = cli(capsys, "compat", f"{fleet}#old", f"{fleet}#new", "--format", "json")
    assert code == 1 and json.loads(out)["from"]["layout"] == "BHLNC"


def test_a_release_side_is_decided_with_the_layers(capsys, site: Path) -> None:
    code, out, err = cli(capsys, "compat", "vllm-0.28", "vllm-0.34", "--model", QWEN, "--block-size", "16",
                         "--connector", "OffloadingConnector", "--rules", str(site / "site"), "--format", "json")
    assert code == 0, err
    assert json.loads(out)["from"]["layout"] == "LBHNC"


def test_rules_beside_two_decided_files_or_a_missing_layer_are_usage_errors(capsys, site: Path) -> None:
    code, out, _ = cli(capsys, "dry-run", "--format", "json")
    (site / "a.json").write_text(out)
    code, _, err = cli(capsys, "compat", str(site / "a.json"), str(site / "a.json"), "--rules", str(site / "site"))
    assert code == 2 and err.startswith("--rules: error[usage]: --rules decides a release or fleet side")
    code, _, err = cli(capsys, "compat", "vllm-0.28", "vllm-0.34", "--rules", str(site / "nope"))
    assert code == 2 and "--rules: error[usage]" in err and "does not exist" in err
