"""`kvpolicy dry-run`: exact output lines, the JSON contract, the plan, and every error path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "rules" / "issue-48412"
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
QWEN = {"num_layers": 24, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def rule_line(rule_id: str, file: Path = RULES / "global.yaml") -> int:
    """The 1-based line of ``- id: <rule_id>`` in a rule file: where the engine locates the rule."""
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if re.match(rf"\s*- id: {re.escape(rule_id)}\s*$", line):
            return n
    raise AssertionError(rule_id)


PTH_LINE = rule_line("per-token-head-forbids-cross-layer")


def write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- the built-in example -----------------------------------------------------------------------


def test_default_example_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "dry-run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("built-in example: Qwen2.5-0.5B KV geometry, TRITON_ATTN, OffloadingConnector, "
                               "kv_cache_dtype fp8_per_token_head")
    assert "pass --model PATH or --spec FILE" in lines[0]
    assert lines[2] == "layout: LBNHC (per_layer, NHD)"
    assert "  1. LBNHC            score 0  <- chosen" in lines
    assert "  2. LBHNC            score 0  (tie: rule set's default order)" in lines
    i = lines.index("  BLNHC")
    at = f"at rules/issue-48412/global.yaml:{PTH_LINE}"
    assert lines[i + 1] == f"    by per-token-head-forbids-cross-layer (forbid, global) {at}"
    assert ("  BLNHC would be chosen if kv.per_token_head were false (it is true) "
            "(kv.per_token_head is derived from kv.kv_cache_dtype, not a setting)") in lines
    assert f"  [x] per-token-head-forbids-cross-layer (forbid, global) {at}" in lines
    assert any(line.startswith("  +10 BLNHC            offloading-prefers-cross-layer") for line in lines)
    assert lines[-1].startswith("rule set: rules/issue-48412 (sha256:")
    assert err == ""


def test_ties_name_what_breaks_them(capsys: pytest.CaptureFixture[str]) -> None:
    """A rule set without `defaults.layout_order` breaks ties by the release's preference order, and says so."""
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--connector", "none",
                         "--kv-cache-dtype", "auto")
    assert code == 0, err
    assert "  2. LBHNC            score 0  (tie: the release's preference order)" in out.splitlines()
    assert "rule set's default order" not in out


def test_default_example_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "dry-run", "--format", "json")
    assert code == 0
    assert err.startswith("built-in example:")  # stdout stays pure JSON
    data = json.loads(out)
    assert {"layout", "score", "ranking", "eliminated", "rules", "rule_results", "preferences",
            "counterfactual", "ruleset", "inputs"} <= set(data)
    assert data["layout"] == {"placement": "per_layer", "head_order": "NHD", "name": "LBNHC"}
    assert data["eliminated"]["BLNHC"] == [
        {"rule": "per-token-head-forbids-cross-layer", "source": f"rules/issue-48412/global.yaml:{PTH_LINE}",
         "scope": "global", "effect": "forbid"}]
    assert data["rules"]["per-token-head-forbids-cross-layer"] is True
    assert data["rules"]["cross-layer-needs-connector"] is False
    assert [r["layout"] for r in data["ranking"]] == ["LBNHC", "LBHNC"]
    cf = {c["layout"]: c for c in data["counterfactual"]}
    assert cf["BLNHC"]["changes"] == [
        {"scope": "*", "field": "kv.per_token_head", "from": True, "to": False}]
    assert data["ruleset"]["root"] == "rules/issue-48412" and data["ruleset"]["digest"].startswith("sha256:")
    assert data["inputs"]["kv"]["kv_cache_dtype"] == "fp8_per_token_head"
    assert data["inputs"]["connector"]["name"] == "OffloadingConnector"
    assert "plan" not in data


@pytest.mark.parametrize(("mode", "present", "absent"), [
    ("fails", ["eliminated:", "counterfactual:"], ["preferences:", "rules:"]),
    ("notes", ["preferences:", "matched rules:"], ["counterfactual:", "  [ ] "]),
    ("full", ["preferences:", "counterfactual:", "rules:", "  [ ] cross-layer-needs-connector"], []),
])
def test_explain_modes(capsys: pytest.CaptureFixture[str], mode: str, present: list[str], absent: list[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--explain", mode)
    assert code == 0
    for text in present:
        assert text in out, text
    for text in absent:
        assert text not in out, text


def test_example_flags_are_named_in_the_banner(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--kv-cache-dtype", "auto")
    assert code == 0
    assert "changed by --kv-cache-dtype" in out.splitlines()[0]
    assert "layout: BLNHC" in out


def test_connector_none_disables_the_example_connector(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--connector", "none", "--format", "json")
    data = json.loads(out)
    assert code == 0 and "connector" not in data["inputs"]
    assert data["rules"]["cross-layer-needs-connector"] is True


def test_stride_aware_scale_views(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--scale-views", "stride_aware", "--format", "json")
    assert code == 0 and json.loads(out)["layout"]["name"] == "BLNHC"


# -- deployments ------------------------------------------------------------------------------


def test_model_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--model", str(CONFIGS / "qwen2.5-0.5b.json"),
                       "--connector", "NixlConnector", "--connector-config", '{"enable_cross_layers_blocks": "true"}',
                       "--format", "json")
    data = json.loads(out)
    assert code == 0
    assert data["layout"]["name"] == "BHLNC"
    assert data["inputs"]["kv"]["num_layers"] == 24 and data["inputs"]["kv"]["num_kv_heads"] == 2


def test_model_directory_and_tensor_parallel(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((CONFIGS / "llama-3.1-8b.json").read_text())
    code, out, _ = cli(capsys, "dry-run", "--model", str(tmp_path), "--tensor-parallel-size", "2", "--format", "json")
    assert code == 0
    assert json.loads(out)["inputs"]["kv"]["num_kv_heads"] == 4  # 8 KV heads over 2 ranks


def test_hybrid_model_stays_per_layer(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--model", str(CONFIGS / "jamba-v0.1.json"),
                       "--connector", "OffloadingConnector", "--explain", "fails")
    assert code == 0
    assert "layout: LBNHC" in out
    assert "    by cross-layer-needs-attention-spec (forbid, global) at rules/issue-48412/global.yaml:" in out


def test_spec_yaml_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    yml = write_spec(tmp_path, "num_layers: 24\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n")
    code, out, _ = cli(capsys, "dry-run", "--spec", yml, "--connector", "OffloadingConnector")
    assert code == 0 and "layout: BLNHC" in out
    assert not out.startswith("built-in example")
    js = write_spec(tmp_path, json.dumps({**QWEN, "kv_cache_dtype": "int8_per_token_head"}), "spec.json")
    code, out, _ = cli(capsys, "dry-run", "--spec", js, "--connector", "OffloadingConnector", "--format", "json")
    assert code == 0 and json.loads(out)["layout"]["name"] == "LBNHC"


def test_spec_flags_override_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    yml = write_spec(tmp_path, json.dumps({**QWEN, "kv_cache_dtype": "fp8_per_token_head"}))
    code, out, _ = cli(capsys, "dry-run", "--spec", yml, "--kv-cache-dtype", "auto", "--block-size", "32",
                       "--connector", "OffloadingConnector", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["layout"]["name"] == "BLNHC"
    assert data["inputs"]["kv"]["block_size"] == 32


def test_spec_groups(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    yml = write_spec(tmp_path, """\
groups:
  - spec: {num_layers: 4, block_size: 16, num_kv_heads: 8, head_size: 128}
  - spec: {kind: mamba, num_layers: 28, block_size: 16, num_kv_heads: 1, head_size: 128}
""")
    code, out, _ = cli(capsys, "dry-run", "--spec", yml, "--connector", "OffloadingConnector", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["layout"]["name"] == "LBNHC"
    assert {h["rule"] for h in data["eliminated"]["BLNHC"]} == {
        "cross-layer-needs-single-group", "cross-layer-needs-attention-spec"}


def test_multiconnector_config(capsys: pytest.CaptureFixture[str]) -> None:
    conf = {"connectors": [
        {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"enable_cross_layers_blocks": "true"}},
        {"kv_connector": "OffloadingConnector"}]}
    args = ["dry-run", "--kv-cache-dtype", "auto", "--connector", "MultiConnector", "--format", "json"]
    code, out, _ = cli(capsys, *args, "--connector-config", json.dumps(conf))
    assert code == 0 and json.loads(out)["layout"]["name"] == "BHLNC"
    del conf["connectors"][0]["kv_connector_extra_config"]
    code, out, _ = cli(capsys, *args, "--connector-config", json.dumps(conf))
    assert code == 0 and json.loads(out)["layout"]["name"] == "LBHNC"


def test_a_connector_the_release_does_not_register_is_refused_as_vllm_refuses(
        capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's KVConnectorFactory refuses a name it does not register ("Unsupported connector type"): so does
    dry-run, located at the flag, with the name meant; out-of-tree (--connector-module-path) it decides, and
    the JSON carries the warning stderr printed (issue 22)."""
    code, out, err = cli(capsys, "dry-run", "--connector", "Offloading", "--format", "json")
    assert code == 2 and json.loads(out)["ok"] is False
    assert "--connector: error[usage]: " in err and "registers no KV connector `Offloading`" in err
    assert "did you mean `OffloadingConnector`?" in err
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--connector", "NixlConector")
    assert code == 2 and "did you mean `NixlConnector`?" in err
    code, out, err = cli(capsys, "dry-run", "--connector", "MyConn", "--connector-module-path", "my.mod",
                         "--format", "json")
    assert code == 0 and "warning: connector `MyConn`" in err
    assert any("MyConn" in w for w in json.loads(out)["warnings"])
    ktc = '{"kv_connector": "MyConn", "kv_role": "kv_both", "kv_connector_module_path": "my.mod"}'
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--kv-transfer-config", ktc)
    assert code == 0, err
    members = '{"connectors": [{"kv_connector": "NixlConector"}, {"kv_connector": "OffloadingConnector"}]}'
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--connector", "MultiConnector",
                       "--connector-config", members)
    assert code == 2 and "--connector-config: error[usage]" in err and "did you mean `NixlConnector`?" in err


# -- the plan -------------------------------------------------------------------------------


def test_plan_per_layer(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--num-blocks", "1000", "--format", "json")
    plan = json.loads(out)["plan"]
    assert code == 0
    assert plan["num_buffers"] == 24
    assert plan["physical_shape"] == [1000, 2, 16, 2, 68]
    assert plan["page_size_bytes"] == 4352
    assert plan["total_bytes"] == 1000 * 24 * 4352
    assert plan["buffer_bytes"] * plan["num_buffers"] == plan["total_bytes"]
    assert len(plan["layers"]) == 24 and plan["layers"][5]["view"]["buffer"] == 5


def test_plan_cross_layer_matches_vllm_log(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's log for Qwen2.5-0.5B on TRITON_ATTN, HND, 176452 blocks: (176452, 2, 24, 2, 16, 64)
    code, out, _ = cli(capsys, "dry-run", "--model", str(CONFIGS / "qwen2.5-0.5b.json"),
                       "--connector", "NixlConnector", "--connector-config", '{"enable_cross_layers_blocks": true}',
                       "--num-blocks", "176452", "--format", "json")
    plan = json.loads(out)["plan"]
    assert code == 0
    assert plan["layout"] == "BHLNC" and plan["num_buffers"] == 1
    assert plan["physical_shape"] == [176452, 2, 24, 2, 16, 64]
    assert plan["total_bytes"] == 176452 * 24 * 8192


def test_plan_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--kv-cache-dtype", "auto", "--num-blocks", "8", "--explain", "notes")
    assert code == 0
    lines = out.splitlines()
    assert "plan: BLNHC on TRITON_ATTN, 8 blocks" in lines
    assert "  buffers:   1 x (8, 24, 2, 16, 2, 64) bfloat16 [block, layer, kv, token, head, dim], " \
           "1572864 B (1.5 MiB) each" in lines
    assert "  total:     1572864 B (1.5 MiB)" in lines
    assert "    layer  1: buffer 0, shape (8, 2, 16, 2, 64), strides (98304, 2048, 128, 64, 1), offset 4096" in lines


# -- failures -------------------------------------------------------------------------------


def conflicting_rules(tmp_path: Path) -> Path:
    root = tmp_path / "rules"
    (root / "connectors").mkdir(parents=True)
    (root / "global.yaml").write_text((RULES / "global.yaml").read_text() + """
  - id: always-cross-layer
    description: a rule that contradicts per-token-head-forbids-cross-layer
    require: {placement: cross_layer}
""")
    return root


def test_no_layout_exits_1_with_located_diagnostics(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = conflicting_rules(tmp_path)
    code, out, err = cli(capsys, "dry-run", "--rules", str(root), "--no-shipped-rules")
    assert code == 1
    assert out == ""
    shown = f"{root}/global.yaml"
    assert f"{shown}:{PTH_LINE}:5: error[removed-candidates]: rule `per-token-head-forbids-cross-layer`" in err
    assert "error[removed-candidates]: rule `always-cross-layer` (require, global) removed `LBNHC`" in err
    assert "Traceback" not in err


def test_no_layout_json_error_object(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = cli(capsys, "dry-run", "--rules", str(conflicting_rules(tmp_path)), "--format", "json")
    assert code == 1
    error = json.loads(out)["error"]
    assert error["kind"] == "NoLayoutError"
    assert {d["code"] for d in error["diagnostics"]} >= {"removed-candidates"}
    assert "error[removed-candidates]" in err


def test_broken_rules_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text("version: 1\nrules:\n  - id: x\n")
    code, _, err = cli(capsys, "dry-run", "--rules", str(tmp_path))
    assert code == 1
    assert f"{tmp_path}/global.yaml:3:5: error[missing-key]: missing required key `description`" in err


@pytest.mark.parametrize(("argv", "flag"), [
    (["--connector-config", "{bad"], "argument --connector-config: invalid JSON"),
    (["--connector-config", "[1, 2]"], "argument --connector-config: expected a JSON object, got list"),
    (["--backend", "TRITON"], "--attention-backend: error[unknown-backend]: unknown attention backend `TRITON`"),
    (["--kv-cache-dtype", "fp9"],
     "--kv-cache-dtype: error[unknown-kv-cache-dtype]: vLLM profile `issue-48412` has no kv_cache_dtype `fp9`"),
    (["--num-blocks", "0"], "argument --num-blocks: expected a positive integer, got `0`"),
    (["--block-size", "x"], "argument --block-size: expected a positive integer, got `x`"),
    (["--explain", "all"], "argument --explain: invalid choice: 'all'"),
    (["--model", "a", "--spec", "b"], "argument --spec: not allowed with argument --model"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_usage_errors_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    code, out, err = cli(capsys, "dry-run", *argv)
    assert code == 2
    assert out == ""
    assert flag in err


def test_bad_input_values_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = cli(capsys, "dry-run", "--connector", "MultiConnector", "--connector-config", '{"connectors": [1]}')
    assert code == 2 and err.startswith("--connector-config: error[invalid-input]: member 0 of `connectors` needs")
    code, _, err = cli(capsys, "dry-run", "--connector", "none", "--connector-config", "{}")
    assert code == 0, err  # an empty config without a connector is harmless
    code, _, err = cli(capsys, "dry-run", "--connector", "none", "--connector-config", '{"a": 1}')
    assert code == 2 and err.startswith("--connector-config: error[invalid-input]: `connector_config` given without")
    spec = write_spec(tmp_path, json.dumps(QWEN))
    code, _, err = cli(capsys, "dry-run", "--spec", spec, "--tensor-parallel-size", "2")
    assert code == 2 and err.startswith("--tensor-parallel-size: error[usage]: applies to --model only")


def test_model_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = cli(capsys, "dry-run", "--model", str(tmp_path / "missing.json"))
    assert code == 2
    assert f"{tmp_path}/missing.json: error[" in err and "Traceback" not in err


def test_spec_file_errors_are_located(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "num_layers: 24\nblock_size: 16\nnum_kv_heads: two\nhead_sise: 64\n")
    code, out, err = cli(capsys, "dry-run", "--spec", spec)
    assert code == 2 and out == ""
    assert f"{spec}:3:15: error[invalid-value]: expected a valid integer" in err
    assert f"{spec}:4:1: error[unknown-key]: unknown key `head_sise`\n  help: did you mean `head_size`?" in err
    assert f"{spec}:1:1: error[missing-key]: missing required key `head_size`" in err


def test_spec_file_syntax_and_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "num_layers: [24\n")
    code, _, err = cli(capsys, "dry-run", "--spec", spec)
    assert code == 2 and f"{spec}:2:1: error[yaml-syntax]: invalid YAML" in err
    code, _, err = cli(capsys, "dry-run", "--spec", str(tmp_path / "none.yaml"))
    assert code == 2 and f"{tmp_path}/none.yaml: error[unreadable]: cannot read the --spec file" in err
    spec = write_spec(tmp_path, "- 1\n- 2\n")
    code, _, err = cli(capsys, "dry-run", "--spec", spec)
    assert code == 2 and "error[invalid-spec]: a spec file is a mapping" in err


def test_spec_groups_errors_are_located(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "groups:\n  - spec: {num_layers: 4, block_size: 16, num_kv_heads: 8, head_size: 128,"
                                " dtyp: x}\n    num_attn: 1\n")
    code, _, err = cli(capsys, "dry-run", "--spec", spec)
    assert code == 2
    assert f"{spec}:2:76: error[unknown-key]: unknown key `dtyp`\n  help: did you mean `dtype`?" in err
    assert f"{spec}:3:5: error[unknown-key]: unknown key `num_attn`" in err


def test_invalid_spec_values_name_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = write_spec(tmp_path, json.dumps({**QWEN, "head_size": 63}))
    code, _, err = cli(capsys, "dry-run", "--spec", spec, "--kv-cache-dtype", "int4_per_token_head")
    assert code == 2
    assert err.splitlines()[1].startswith(f"{spec}: error[invalid-input]: ")
    assert "head_size 63 must be even" in err


def test_plan_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "{kind: mla, num_layers: 4, block_size: 64, num_kv_heads: 1, head_size: 576}")
    code, _, err = cli(capsys, "dry-run", "--spec", spec, "--backend", "TRITON_ATTN", "--num-blocks", "4")
    assert code == 2
    assert "--attention-backend: error[backend-mismatch]" in err


# -- the documented contract ------------------------------------------------------------------


def test_every_json_key_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    doc = (ROOT / "docs" / "json-output.md").read_text()
    code, out, _ = cli(capsys, "dry-run", "--format", "json", "--num-blocks", "4")
    data = json.loads(out)
    assert code == 0
    keys = set(data) | set(data["plan"]) | set(data["layout"]) | set(data["ruleset"]) | set(data["inputs"])
    keys |= set(data["rule_results"][0]) | set(data["rule_results"][0]["leaves"][0])
    found = next(cf for cf in data["counterfactual"] if cf["changes"])
    keys |= set(found) | set(found["changes"][0])
    keys |= set(data["preferences"][0]) | set(data["eliminated"]["BLNHC"][0])
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert missing == []


def test_every_flag_is_documented() -> None:
    from kvpolicy.engine.cli.main import build_parser

    doc = (ROOT / "docs" / "cli.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "verb")
    for verb, parser in sub.choices.items():
        assert f"## `kvpolicy {verb}" in doc, verb
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in doc, (verb, flag)


def test_kv_transfer_config_is_vllms_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "{num_layers: 4, num_kv_heads: 2, head_size: 64}")
    ktc = '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'
    code, out, _ = cli(capsys, "dry-run", "--spec", spec, "--kv-transfer-config", ktc, "--format", "json")
    assert code == 0 and json.loads(out)["inputs"]["connector"]["name"] == "OffloadingConnector"
    code, _, err = cli(capsys, "dry-run", "--spec", spec, "--kv-transfer-config", ktc, "--connector", "NixlConnector")
    assert code == 2
    assert "--kv-transfer-config: error[usage]: --kv-transfer-config and --connector both set" in err
    code, _, err = cli(capsys, "dry-run", "--spec", spec, "--kv-transfer-config", '{"kv_connector": "X"}')
    assert code == 2 and "--kv-transfer-config: error" in err and "kv_role" in err


def test_an_mla_model_without_a_backend_gets_an_mla_backend(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "{kind: mla, num_layers: 4, num_kv_heads: 1, head_size: 576}")
    code, out, _ = cli(capsys, "dry-run", "--spec", spec, "--format", "json")
    assert code == 0 and json.loads(out)["inputs"]["backend"]["name"] == "FLASHMLA"


def test_a_third_party_connectors_own_preference_is_a_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """vLLM 0.28's gate asks the connector object; without the flag an unregistered connector has
    KVConnectorBase_V1's false, and the note says so."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 2\nnum_kv_heads: 2\nhead_size: 64\n")
    common = ("dry-run", "--vllm-version", "0.28.0", "--spec", str(spec), "--backend", "FLASH_ATTN",
              "--connector", "MyConnector", "--connector-module-path", "my_connectors")
    code, out, err = cli(capsys, *common, "--format", "json")
    assert code == 0 and json.loads(out)["layout"]["placement"] == "per_layer"
    assert ("note: connector `MyConnector` is not one vLLM registers; its prefer_cross_layer_blocks is taken as "
            "KVConnectorBase_V1's default, false") in err
    code, out, err = cli(capsys, *common, "--connector-prefers-cross-layer-blocks", "true")
    assert code == 0 and out.startswith("layout: BLNHC (cross_layer, NHD)")
    assert "connector: MyConnector (prefer_cross_layer_blocks true)" in out and "note:" not in err
    code, out, err = cli(capsys, *common, "--connector-prefers-cross-layer-blocks", "Other=true")
    assert code == 2 and "--connector-prefers-cross-layer-blocks: error[invalid-input]: no configured connector is " \
                         "named `Other`" in err
    code, _, err = cli(capsys, *common, "--connector-prefers-cross-layer-blocks", "true",
                       "--connector-prefers-cross-layer-blocks", "MyConnector=false")
    assert code == 2 and "a bare true/false applies to the one configured connector" in err
