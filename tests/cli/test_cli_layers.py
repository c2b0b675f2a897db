"""Layered rule sets and third-party connectors on the command line (#15): every verb takes
``--rules`` repeatedly, layers go on the shipped rules, ``--no-shipped-rules`` warns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.engine.integrations import vllm_plugin

MY_CONNECTOR = """\
version: 1
connector: MyConnector
rules:
  - id: my-connector-prefers-block-outermost
    description: my connector moves one region per block
    prefer: {block_outermost: true}
    weight: 5
"""

CASE = """\
version: 1
cases:
  - name: my connector takes a block-outermost layout
    input:
      spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}
      kv_cache_dtype: auto
      attention_backend: TRITON_ATTN
      connector: MyConnector
    expect:
      layout: BLNHC
      matched: [my-connector-prefers-block-outermost]
"""


@pytest.fixture
def ops(tmp_path: Path) -> Path:
    (tmp_path / "ops" / "connectors").mkdir(parents=True)
    (tmp_path / "ops" / "tests").mkdir()
    (tmp_path / "ops" / "connectors" / "MyConnector.yaml").write_text(MY_CONNECTOR)
    (tmp_path / "ops" / "tests" / "mine.yaml").write_text(CASE)
    return tmp_path / "ops"


def test_my_connector_validates_tests_and_decides(capsys: pytest.CaptureFixture[str], ops: Path) -> None:
    code, out, err = cli(capsys, "validate", "--rules", str(ops), "--vllm-version", "vllm-0.34")
    assert code == 0 and err == ""
    assert out.startswith("ok: 18 rules in 10 files")
    assert f"  layer 1: {ops} (operator, 1 rules" in out
    code, out, _ = cli(capsys, "test", "--rules", str(ops), "--vllm-version", "vllm-0.34")
    assert code == 0 and "1 passed, 0 failed" in out
    code, out, _ = cli(capsys, "dry-run", "--rules", str(ops), "--vllm-version", "vllm-0.34",
                       "--connector", "MyConnector", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["layout"]["name"] == "BLNHC"


def test_layered_rules_keep_the_load_bearing_guard(capsys: pytest.CaptureFixture[str], ops: Path) -> None:
    # issue-48412: the per-token-head guard keeps the layers' inline scales apart; a layer on top
    # that prefers block-outermost cannot bring cross-layer back
    args = ("dry-run", "--rules", str(ops), "--vllm-version", "issue-48412", "--connector", "MyConnector",
            "--kv-cache-dtype", "fp8_per_token_head")
    code, out, err = cli(capsys, *args)
    assert code == 0 and "(per_layer," in out.splitlines()[2]
    assert "per-token-head-forbids-cross-layer" in out and "warning[" not in err
    code, out, err = cli(capsys, *args, "--no-shipped-rules")
    assert "--no-shipped-rules: warning[dropped-guard]: shipped forbid `per-token-head-forbids-cross-layer` " \
           "(rules/issue-48412/global.yaml:42)" in err


def test_no_shipped_rules_warns_only_where_a_guard_bears_load(capsys: pytest.CaptureFixture[str], ops: Path) -> None:
    code, out, err = cli(capsys, "validate", "--rules", str(ops), "--no-shipped-rules", "--vllm-version",
                         "issue-48412")
    assert code == 0 and out.startswith("ok: 1 rules in 1 files") and "warning[dropped-guard]" in err
    code, _, err = cli(capsys, "validate", "--rules", str(ops), "--no-shipped-rules", "--vllm-version", "vllm-0.34")
    assert code == 0 and err == ""  # released backends build stride-aware views: nothing load-bearing goes


def test_repeated_rules_flag_and_duplicate_ids(capsys: pytest.CaptureFixture[str], ops: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "global.yaml").write_text(
        "version: 1\nrules:\n  - id: per-token-head-forbids-cross-layer\n    description: weaker\n"
        "    prefer: {placement: per_layer}\n")
    code, out, err = cli(capsys, "lint", "--rules", str(ops), "--rules", str(site), "--vllm-version", "issue-48412")
    assert code == 1
    assert f"{site}/global.yaml:3:5: error[duplicate-rule-id]: rule id `per-token-head-forbids-cross-layer` is " \
           "already used at rules/issue-48412/global.yaml:42 (layer `rules/issue-48412`)" in err
    for verb in (("validate",), ("test",), ("dry-run",)):
        code, _, err = cli(capsys, *verb, "--rules", str(ops), "--rules", str(site), "--vllm-version", "vllm-0.34")
        assert code == 0, (verb, err)
    _, out, _ = cli(capsys, "lint", "--rules", str(ops), "--rules", str(site), "--vllm-version", "vllm-0.34")
    assert "lint: " in out and ", 19 rules," in out  # 17 shipped + one per layer
    code, out, _ = cli(capsys, "diff", "--rules", str(ops), str(site), str(site), "--vllm-version", "vllm-0.34")
    assert code == 0 and "0 decision(s) change" in out


def test_near_connector_names_warn(capsys: pytest.CaptureFixture[str], ops: Path) -> None:
    (ops / "connectors" / "typo.yaml").write_text(MY_CONNECTOR.replace("MyConnector", "MyConector")
                                                  .replace("my-connector", "my-conector"))
    (ops / "connectors" / "nixl.yaml").write_text(MY_CONNECTOR.replace("MyConnector", "NixlConector")
                                                  .replace("my-connector", "nixl-typo"))
    code, _, err = cli(capsys, "validate", str(ops))
    assert code == 0
    assert "warning[near-connector-name]: connector `NixlConector`" in err and "did you mean `NixlConnector`?" in err
    assert "warning[near-connector-name]: connector `MyConector`" in err and "did you mean `MyConnector`?" in err
    code, out, _ = cli(capsys, "lint", str(ops))
    assert "warning[unknown-connector]: connector `NixlConector` is registered by no release profile" in out
    assert "note[unknown-connector]: connector `MyConnector`" in out


def test_plugin_layers_kvpolicy_rules(ops: Path) -> None:
    layered = vllm_plugin._engine(vllm_plugin.Settings.from_env({"KVPOLICY_RULES": str(ops)}),
                                  vllm_plugin.get_profile("issue-48412"))
    assert "per-token-head-forbids-cross-layer" in {r.id for r in layered.ruleset.rules}
    alone = vllm_plugin._engine(vllm_plugin.Settings.from_env({"KVPOLICY_RULES": str(ops),
                                                               "KVPOLICY_SHIPPED_RULES": "0"}),
                                vllm_plugin.get_profile("issue-48412"))
    assert [r.id for r in alone.ruleset.rules] == ["my-connector-prefers-block-outermost"]
    assert [d.code for d in alone.ruleset.warnings] == ["dropped-guard"]
    with pytest.raises(vllm_plugin.PluginError):
        vllm_plugin.Settings.from_env({"KVPOLICY_RULES": str(ops), "KVPOLICY_SHIPPED_RULES": "maybe"})
