"""`kvpolicy inspect` / `kvpolicy rules`: the rules in force, with effect, scope, layer and file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

SITE = """\
version: 1
rules:
  - id: site-fp8-per-layer
    description: roll out first
    enforcement: audit
    when: {field: kv.kv_cache_dtype, eq: fp8}
    forbid: {placement: cross_layer}
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "global.yaml").write_text(SITE)
    return tmp_path


def test_inspect_lists_every_rule_with_its_layer_and_location(capsys: pytest.CaptureFixture[str], site: Path) -> None:
    code, out, _ = cli(capsys, "inspect", str(site), "--vllm-version", "0.34.0")
    assert code == 0
    assert out.startswith("18 rules in force (vllm-0.34; rules/vllm-0.34 + ")
    assert "  layer 0: rules/vllm-0.34 (shipped, 17 rules)" in out
    line = next(x for x in out.splitlines() if x.startswith("site-fp8-per-layer"))
    assert line.split() == ["site-fp8-per-layer", "forbid", "(audit)", "global", "1", f"{site}/global.yaml:3"]
    rows = out.splitlines()[out.splitlines().index("") + 2:]
    assert rows[0].startswith("mixed-hnc-shapes-need-block-compact ")  # shipped globals first, by file:line


def test_inspect_json_and_the_connector_filter(capsys: pytest.CaptureFixture[str], site: Path) -> None:
    code, out, _ = cli(capsys, "rules", str(site), "--vllm-version", "0.34.0", "--connector", "OffloadingConnector",
                       "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["connector"] == "OffloadingConnector"
    scopes = {r["scope"] for r in doc["rules"]}
    assert scopes == {"global", "OffloadingConnector"}
    mine = next(r for r in doc["rules"] if r["id"] == "site-fp8-per-layer")
    assert mine["enforcement"] == "audit" and mine["layer"] == {"index": 1, "root": str(site), "shipped": False}
    assert mine["pattern"] == {"placement": "cross_layer"} and mine["source"] == f"{site}/global.yaml:3"
    offload = next(r for r in doc["rules"] if r["id"] == "offloading-requires-lbhnc")
    assert offload["effect"] == "prefer" and offload["weight"] == 10 and offload["layer"]["shipped"]


def test_inspect_of_rules_that_do_not_load_fails_located(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(SITE.replace("    description: roll out first\n", ""))
    code, _, err = cli(capsys, "inspect", str(tmp_path))
    assert code == 1 and f"{tmp_path}/global.yaml:3:5: error[missing-key]" in err


def test_validate_counts_audit_rules_as_rules(capsys: pytest.CaptureFixture[str], site: Path) -> None:
    code, out, _ = cli(capsys, "validate", str(site), "--vllm-version", "0.34.0")
    assert code == 0 and out.startswith("ok: 18 rules in ") and f"layer 1: {site} (operator, 1 rules" in out


def test_inspect_shows_each_rules_description_under_it(capsys: pytest.CaptureFixture[str], site: Path) -> None:
    code, out, _ = cli(capsys, "inspect", str(site), "--vllm-version", "0.34.0")
    lines = out.splitlines()
    mine = next(i for i, x in enumerate(lines) if x.startswith("site-fp8-per-layer"))
    assert code == 0 and lines[mine + 1] == "    roll out first"
    guard = next(i for i, x in enumerate(lines) if x.startswith("extensible-kv-cache-with-connector-needs-block"))
    about = " ".join(x.strip() for x in lines[guard + 1:guard + 4])
    assert about.startswith("an extensible KV cache commits one contiguous run per layer")
    assert "(see vllm/v1/attention/backends/utils.py resolve_kv_cache_layout)" in about  # its reference
    code, brief, _ = cli(capsys, "inspect", str(site), "--vllm-version", "0.34.0", "--brief")
    assert code == 0 and "roll out first" not in brief and "site-fp8-per-layer" in brief


def test_inspect_lists_the_waivers_of_the_rules_it_shows(capsys: pytest.CaptureFixture[str], site: Path) -> None:
    (site / "waivers.yaml").write_text(
        "version: 1\nwaivers:\n  - rule: offloading-requires-lbhnc\n    owner: kv-team\n    reason: LMCache 0.3\n"
        "    expires: 2027-01-31\n")
    code, out, _ = cli(capsys, "inspect", str(site), "--vllm-version", "0.34.0", "--today", "2027-01-01")
    assert code == 0 and "1 waiver(s):" in out
    assert (f"  offloading-requires-lbhnc waived until 2027-01-31 (in force), owner kv-team, at {site}/waivers.yaml:3"
            in out)
    code, out, _ = cli(capsys, "inspect", str(site), "--vllm-version", "0.34.0", "--today", "2027-02-01",
                       "--format", "json")
    [w] = json.loads(out)["waivers"]
    assert w["in_force"] is False and w["owner"] == "kv-team" and w["source"] == f"{site}/waivers.yaml:3"
    [lapsed] = json.loads(out)["warnings"]  # as the text's stderr says it
    assert lapsed["code"] == "expired-waiver" and lapsed["file"] == f"{site}/waivers.yaml" and lapsed["line"] == 3
    code, out, _ = cli(capsys, "inspect", str(site), "--vllm-version", "0.34.0", "--connector", "NixlConnector",
                       "--format", "json")
    assert json.loads(out)["waivers"] == []  # a waiver of a rule not in force with that connector
