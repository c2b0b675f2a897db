"""`kvpolicy lint --fleet FILE`: the rules linted against exactly the deployments of a fleet file, one report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "docs" / "examples" / "fleet.yaml"
DEPLOYMENTS = len(yaml.safe_load(FLEET.read_text())["deployments"])

SITE = """\
version: 1
rules:
  - id: site-no-cross-layer
    description: the site keeps each layer's pages together
    forbid: {placement: cross_layer}
  - id: site-huge-models-only
    description: a rule for models this fleet does not run
    when: {field: kv.num_layers, gt: 1000}
    forbid: {head_order: HND}
"""


def line_of(name: str) -> int:
    """The line of deployment ``name`` in the example fleet (its `- name:` line)."""
    lines = FLEET.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.strip() == f"- name: {name}")


@pytest.fixture()
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "global.yaml").write_text(SITE)
    return tmp_path / "site"


def test_findings_are_located_at_the_deployments_and_the_rules(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "lint", "site", "--fleet", str(FLEET), "--format", "json")
    data = json.loads(out)
    assert code == 1 and data["deployments"] == DEPLOYMENTS and len(data["profiles"]) == 9
    by_code = {}
    for f in data["findings"]:
        by_code.setdefault(f["code"], []).append(f)
    # the layer refuses a deployment the shipped rules decide: located at the deployment's line
    conflict, = by_code["conflict"]
    assert conflict["location"] == f"{FLEET}:{line_of('mistral-7b-env-layout-blhnc')}"
    assert "where the shipped rules alone choose `BLHNC`" in conflict["message"]
    assert "`site-no-cross-layer` (forbid, global) at site/global.yaml:3:5" in conflict["message"]
    # the release refuses one on purpose: an error over a fleet (vLLM would not start it)
    refused, = by_code["release-refuses"]
    assert refused["severity"] == "error"
    assert refused["location"] == f"{FLEET}:{line_of('mistral-env-lhbnc-extensible-offload')}"
    # a rule no deployment matches is dead for this fleet, located at the rule; shipped findings are left out
    dead, = by_code["dead-rule"]
    assert dead["rule"]["rule"] == "site-huge-models-only" and dead["rule"]["source"] == "site/global.yaml:6"
    assert data["shipped_findings_left_out"] > 0
    bearing = {lb["rule"]: lb for lb in data["load_bearing"]}
    assert set(bearing) == {"site-no-cross-layer", "site-huge-models-only"}
    assert bearing["site-no-cross-layer"]["load_bearing"] == "decision"
    assert bearing["site-no-cross-layer"]["decisions_changed"] >= 1


def test_every_format_locates_them(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = line_of("mistral-7b-env-layout-blhnc")
    code, out, _ = cli(capsys, "lint", "site", "--fleet", str(FLEET))
    assert code == 1
    assert f"{FLEET}:{line}: error[conflict]: deployment `mistral-7b-env-layout-blhnc` (vllm-0.34)" in out
    assert "site/global.yaml:6: warning[dead-rule]: rule `site-huge-models-only` matches no deployment" in out
    assert "load-bearing forbids/requires over fleet" in out
    assert f"lint: fleet {FLEET}, {DEPLOYMENTS} deployments over 9 release profile(s)" in out
    code, out, _ = cli(capsys, "lint", "site", "--fleet", str(FLEET), "--format", "github")
    assert f"::error file={FLEET},line={line},col=1,title=conflict::" in out
    assert "::warning file=site/global.yaml,line=6,col=5,title=dead-rule::" in out
    code, out, _ = cli(capsys, "lint", "site", "--fleet", str(FLEET), "--format", "sarif")
    results = json.loads(out)["runs"][0]["results"]
    where = {(r["ruleId"], r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
              r["locations"][0]["physicalLocation"]["region"]["startLine"]) for r in results}
    assert ("conflict", str(FLEET), line) in where and ("dead-rule", "site/global.yaml", 6) in where


def test_an_invalid_deployment_is_an_error_at_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("""version: 1
deployments:
  - name: typo
    vllm_version: "0.34.0"
    spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}
    connector: NixlConector
  - name: fine
    vllm_version: "0.34.0"
    spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}
  - name: no-config
    vllm_version: "0.34.0"
    model: models/nope
""")
    code, out, _ = cli(capsys, "lint", "--fleet", str(f), "--format", "json")
    typo, config = [x for x in json.loads(out)["findings"] if x["code"] == "invalid-deployment"]
    assert code == 1 and typo["location"] == f"{f}:6"  # the `connector:` key, not the deployment's line 3
    assert "registers no KV connector `NixlConector`" in typo["message"]
    assert config["location"] == f"{f}:12" and "cannot read the model config" in config["message"]  # `model:`


def test_flags_that_shape_a_space_are_usage_errors_with_a_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "lint", "--fleet", str(FLEET), "--scale-views", "stride_aware")
    assert code == 2 and "--scale-views" in err
