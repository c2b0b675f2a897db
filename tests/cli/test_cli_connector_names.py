"""A connector name vLLM would refuse (``Unsupported connector type``) is refused in a fleet deployment and
in a policy test case as dry-run --connector refuses it, located, with "did you mean"; `connector_module_path`
declares a connector of one's own, as --connector-module-path does (issue 22)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

SPEC = "{num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}"


def test_a_misspelt_connector_makes_its_deployment_invalid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("fleet.yaml").write_text(
        "version: 1\ndeployments:\n"
        f"  - name: ok\n    spec: {SPEC}\n    connector: NixlConnector\n"
        f"  - name: typo\n    spec: {SPEC}\n    connector: NixlConector\n"
        f"  - name: mine\n    spec: {SPEC}\n    connector: MyConnector\n    connector_module_path: my.connectors\n")
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--fleet", "fleet.yaml", "--format", "json")
    deps = {d["name"]: d for d in json.loads(out)["deployments"]}
    assert code != 0
    assert [deps[n]["status"] for n in ("ok", "typo", "mine")] == ["decided", "invalid", "decided"]
    (diag,) = deps["typo"]["error"]["diagnostics"]
    # at its `connector:` key (line 8, the value's column), not the deployment's line 6
    assert (diag["file"], diag["line"], diag["col"], diag["code"]) == ("fleet.yaml", 8, 16, "unknown-connector")
    assert "did you mean `NixlConnector`?" in diag["help"]
    assert any("MyConnector" in w and "kv_connector_module_path" in w for w in deps["mine"]["warnings"])
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--fleet", "fleet.yaml")
    assert "fleet.yaml:8:16: error[unknown-connector]" in out


def test_a_misspelt_connector_is_a_located_case_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "r"
    (rules / "tests").mkdir(parents=True)
    (rules / "global.yaml").write_text("version: 1\nrules: []\n")
    (rules / "tests" / "c.yaml").write_text(
        "version: 1\ncases:\n"
        f"  - name: typo\n    input: {{spec: {SPEC}, connector: NixlConector}}\n    expect: {{layout: LBHNC}}\n"
        f"  - name: mine\n    input: {{spec: {SPEC}, connector: MyConnector, connector_module_path: my.connectors}}\n"
        "    expect: {layout: LBNHC}\n")
    code, out, _ = cli(capsys, "test", "--rules", str(rules), "--vllm-version", "0.34.0")
    assert code == 1 and "1 passed, 1 failed" in out
    assert f"{rules}/tests/c.yaml:4:" in out and "error[unknown-connector]" in out
    assert "did you mean `NixlConnector`?" in out
