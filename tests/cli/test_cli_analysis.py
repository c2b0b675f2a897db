"""`kvpolicy lint`, `kvpolicy diff` and `dry-run --map/--svg`, end to end: output and exit codes."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "rules" / "issue-48412"
SMALL = "num_layers: 4\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n"



@pytest.fixture
def spec(tmp_path: Path) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(SMALL)
    return str(path)


def test_lint_shipped_rules_is_clean(capsys) -> None:
    code, out, _ = cli(capsys, "lint")
    assert code == 0
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("lint: 2565 inputs of issue-48412, 11 rules, ")
    assert last.endswith("0 error(s), 0 warning(s), 2 note(s)")
    # Mamba-only models are in the space, so the rule that keeps them per layer is seen working
    assert "  decision  `cross-layer-needs-attention-spec` (forbid, rules/issue-48412/global.yaml:31)" in out
    assert "space: 2565 inputs of `issue-48412` (4 backend, 5 kv_cache_dtype, " in out
    assert ", 1 sizes, " in out
    assert "  safety    `per-token-head-forbids-cross-layer` (forbid, rules/issue-48412/global.yaml:42)" in out


def test_lint_without_the_per_token_head_rule_fails_naming_inputs(capsys, no_pth: Path) -> None:
    code, out, _ = cli(capsys, "lint", str(no_pth), "--no-shipped-rules", "--max-inputs", "1")
    assert code == 1
    assert "error[unsafe-permit]: the rules choose `BLNHC` for 27 input(s) whose views would overlap" in out
    assert "error[unsafe-permit]: the rules choose `BHLNC` for 27 input(s) whose views would overlap" in out
    code, out, _ = cli(capsys, "lint", str(no_pth), "--no-shipped-rules", "--format", "json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and data["errors"] == 2 and data["profile"] == "issue-48412"
    labels = [label for f in data["findings"] for label in f["inputs"]]
    assert len(labels) == 54 and all("per_token_head" in label for label in labels)
    assert ("kv_cache_dtype=fp8_per_token_head backend=TRITON_ATTN scale_views=assume_per_layer_contiguous "
            "kind=full groups=1x1 connector=MooncakeStoreConnector{enable_cross_layers_blocks=true}") in labels


def test_lint_strict_and_scale_view_what_if(capsys, tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(
        "version: 1\nrules:\n  - id: never\n    description: d\n    when: {field: kv.block_size, gt: 99999}\n"
        "    forbid: {block_outermost: true}\n")
    code, out, _ = cli(capsys, "lint", str(tmp_path))
    assert code == 0 and "warning[dead-rule]: rule `never` matches no input" in out
    assert "global.yaml:3: warning" in out
    code, _, _ = cli(capsys, "lint", str(tmp_path), "--strict")
    assert code == 1
    # what if every backend built stride-aware scale views: the per-token-head rule never
    # matches, and lint says so
    code, out, _ = cli(capsys, "lint", "--scale-views", "stride_aware")
    assert code == 0 and "lint: 2565 inputs of issue-48412" in out
    assert "warning[dead-rule]: rule `per-token-head-forbids-cross-layer` matches no input" in out


def test_lint_vllm_version_prints_each_profile_load_bearing_rules(capsys) -> None:
    code, out, _ = cli(capsys, "lint", "--vllm-version", "0.34.0", "--max-inputs", "0")
    assert code == 0
    assert "load-bearing forbids/requires under `vllm-0.34`" in out
    assert "  decision  `env-layout-bhlnc` (require, rules/vllm-0.34/global.yaml:" in out
    assert "safety " not in out and "error[" not in out
    assert out.rstrip().splitlines()[-1].startswith("lint: ") and "0 error(s), 0 warning(s)" in out
    assert "note[release-refuses]: no layout survives for " in out
    code, out, _ = cli(capsys, "lint", "--vllm-version", "issue-48412", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["profile"] == "issue-48412" and data["space"]["size"] == data["inputs_checked"]
    bearing = {b["rule"]: b["load_bearing"] for b in data["load_bearing"]}
    assert bearing["per-token-head-forbids-cross-layer"] == "safety"
    assert bearing["hnd-needs-head-dim"] is None
    # the #48412 rules over vLLM 0.34's inputs: the guard never matches there
    code, out, _ = cli(capsys, "lint", str(RULES), "--vllm-version", "vllm-0.34", "--no-shipped-rules",
                       "--format", "json")
    bearing = {b["rule"]: b for b in json.loads(out)["load_bearing"]}
    assert bearing["per-token-head-forbids-cross-layer"]["load_bearing"] is None
    assert bearing["per-token-head-forbids-cross-layer"]["matched"] == 0


def test_diff_lists_exactly_the_per_token_head_inputs(capsys, no_pth: Path) -> None:
    code, out, _ = cli(capsys, "diff", str(RULES), str(no_pth), "--no-shipped-rules", "--max-changes", "1")
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == "diff: 2565 inputs of issue-48412 checked, 54 decision(s) change"
    assert lines[1:3] == ["      27  LBHNC -> BHLNC", "      27  LBNHC -> BLNHC"]
    assert "    old: LBNHC  because per-token-head-forbids-cross-layer" in out
    code, out, _ = cli(capsys, "diff", str(RULES), str(no_pth), "--no-shipped-rules", "--format", "json")
    changes = json.loads(out)["changes"]
    assert {c["input"]["kv_cache_dtype"] for c in changes} == {
        "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"}


def test_diff_of_a_rule_set_with_itself_is_empty(capsys) -> None:
    code, out, _ = cli(capsys, "diff", str(RULES), str(RULES))
    assert (code, out.splitlines()[0]) == (0, "diff: 2565 inputs of issue-48412 checked, 0 decision(s) change")
    assert out.splitlines()[-1].startswith("space: 2565 inputs of `issue-48412` (4 backend, ")
    assert ", 1 sizes, " in out.splitlines()[-1]


def test_diff_under_a_chosen_profile(capsys, tmp_path: Path) -> None:
    shipped = ROOT / "rules" / "vllm-0.34"
    edited = tmp_path / "rules"
    shutil.copytree(shipped, edited, ignore=shutil.ignore_patterns("tests"))
    (edited / "connectors" / "OffloadingConnector.yaml").unlink()
    code, out, _ = cli(capsys, "diff", str(shipped), str(edited), "--vllm-version", "0.34.0", "--no-shipped-rules",
                       "--format", "json")
    data = json.loads(out)
    assert code == 1 and data["profile"] == "vllm-0.34" and data["changed"] > 0
    assert all("OffloadingConnector" in c["input"]["connector"] for c in data["changes"])


def test_unknown_vllm_version_is_a_usage_error_on_every_verb(capsys) -> None:
    for argv in (["validate"], ["test"], ["lint"], ["diff", str(RULES), str(RULES)]):
        code, out, err = cli(capsys, *argv, "--vllm-version", "9.9")
        assert (code, out) == (2, ""), argv
        assert err.startswith("--vllm-version: error[unknown-vllm-version]: no profile for vLLM version `9.9`"), argv
        assert "known profiles: vllm-0.34 (0.34.0)" in err and "issue-48412 (not a release)" in err, argv


def test_validate_and_test_select_the_profile_shipped_rules(capsys, monkeypatch) -> None:
    from kvpolicy.engine import LayoutEngine

    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "vllm-0.34")
    n = len(LayoutEngine.default("vllm-0.34").ruleset.rules)
    code, out, _ = cli(capsys, "validate")
    assert code == 0 and out.startswith(f"ok: {n} rules in ")
    code, out, _ = cli(capsys, "validate", "--vllm-version", "issue-48412")
    assert code == 0 and out.startswith("ok: 11 rules in 6 files")
    # the #48412 cases, decided in their own profile although the default is vLLM 0.34
    code, out, _ = cli(capsys, "test", "--vllm-version", "issue-48412")
    assert code == 0 and "30 passed, 0 failed" in out and "coverage: 11/11 rules" in out
    code, out, _ = cli(capsys, "test", "--rules", str(RULES), "--vllm-version", "issue-48412", "--format", "json")
    assert code == 0 and json.loads(out)["failed"] == 0


def test_dry_run_map_of_a_safe_choice(capsys, spec: str) -> None:
    code, out, _ = cli(capsys, "dry-run", "--spec", spec, "--connector", "OffloadingConnector", "--map",
                       "--explain", "notes")
    assert code == 0
    assert "block 0 of `BLNHC` on TRITON_ATTN" in out
    assert "       0 .. 4096         4096 B  layer 0 K data" in out
    assert out.rstrip().endswith("8 segments; no overlaps")


def test_dry_run_map_what_if_shows_the_collision(capsys, spec: str) -> None:
    code, out, _ = cli(capsys, "dry-run", "--spec", spec, "--kv-cache-dtype", "int8_per_token_head",
                       "--connector", "OffloadingConnector", "--map-layout", "BLNHC", "--explain", "notes")
    assert code == 0  # the chosen layout (per_layer) is safe; the map is a what-if
    assert "!!         0 .. 2176         2176 B  32 x [64 B layer 0 K data | 4 B OVERLAP layers 0..3 k scale]" in out


def test_dry_run_refuses_an_unsafe_choice_and_draws_it(capsys, spec: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "global.yaml").write_text("version: 1\ndefaults:\n  layout_order: [BLNHC]\nrules: []\n")
    svg = tmp_path / "block.svg"
    code, out, err = cli(capsys, "dry-run", "--rules", str(rules), "--no-shipped-rules", "--spec", spec,
                         "--kv-cache-dtype", "fp8_per_token_head", "--map", "--svg", str(svg))
    assert code == 1
    assert out.startswith("layout: BLNHC")
    assert "OVERLAP layers 0..3 k scale" in out
    assert "refusing layout `BLNHC` on `TRITON_ATTN`" in err
    assert "error[overlapping-views]: layer 0 k scale and layer 1 k scale both write buffer 0 byte 64" in err
    root = ET.fromstring(svg.read_text())
    assert any(r.get("data-kind") == "overlap" for r in root.iter("{http://www.w3.org/2000/svg}rect"))


def test_dry_run_json_reports_verification_and_map(capsys, spec: str) -> None:
    code, out, _ = cli(capsys, "dry-run", "--spec", spec, "--format", "json", "--map")
    data = json.loads(out)
    assert code == 0
    assert data["verification"] == {"layout": "LBNHC", "scale_views": "assume_per_layer_contiguous",
                                    "ok": True, "collision_count": 0, "collisions": []}
    assert [s["owners"] for s in data["map"][:2]] == [[[0, "k_data"]], [[0, "v_data"]]]


def test_map_layout_rejects_unknown_layouts(capsys) -> None:
    code, _, err = cli(capsys, "dry-run", "--map-layout", "diagonal/NHD")
    assert code == 2 and "unknown layout `diagonal/NHD`" in err


def test_a_rules_path_that_is_not_a_directory_is_a_usage_error(capsys, tmp_path: Path) -> None:
    code, _, err = cli(capsys, "dry-run", "--rules", str(tmp_path / "missing"))
    assert code == 2 and err.startswith("--rules: error[usage]: ")
    code, _, err = cli(capsys, "lint", str(tmp_path / "missing"))
    assert code == 2 and err.startswith("DIR: error[usage]: ")


def test_diff_with_a_broken_side_exits_2_not_1(capsys, tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text("version: 1\nrules: [\n")
    code, out, err = cli(capsys, "diff", str(RULES), str(tmp_path))
    assert (code, out) == (2, "")
    assert "global.yaml:" in err and "error[yaml-syntax]" in err


def test_map_layout_the_backend_cannot_lay_out_is_a_warning(capsys) -> None:
    code, _, err = cli(capsys, "dry-run", "--model", str(ROOT / "tests/fixtures/configs/deepseek-v2-lite.json"),
                       "--backend", "FLASHMLA", "--map-layout", "LBHNC", "--explain", "notes")
    assert code == 0
    assert "warning: --map-layout LBHNC: backend `FLASHMLA` has no geometry for layout `LBHNC`; nothing drawn" in err


def test_a_mamba_only_model_is_decided_without_a_geometry_check(capsys, tmp_path: Path) -> None:
    spec = tmp_path / "mamba.yaml"
    spec.write_text("groups:\n  - spec: {kind: mamba, num_layers: 4, block_size: 16, num_kv_heads: 1, head_size: 16}\n")
    code, out, _ = cli(capsys, "dry-run", "--spec", str(spec), "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["layout"]["name"] == "LBNHC" and "verification" not in data


def test_lint_over_its_space_bound_warns_and_strict_fails(capsys) -> None:
    """`--max-space N` bounds the space (issue 23): a cut is a `space-cut` warning, in the text, the JSON
    and the space line; the other findings then hold for the explored inputs only."""
    code, out, _ = cli(capsys, "lint", "--max-space", "1000")
    assert code == 0
    assert out.startswith("warning[space-cut]: the space was cut to at most 1000 inputs (--max-space) from about "
                          "2565: left out 17 of 27 connector variants (fields set together first, then single "
                          "literals): every finding holds for the explored inputs only")
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("lint: 950 inputs of issue-48412, 11 rules, ") and "1 warning(s)" in last
    assert "; cut to at most 1000 inputs (--max-space) from about 2565" in out
    code, out, _ = cli(capsys, "lint", "--max-space", "1000", "--strict")
    assert code == 1
    code, out, _ = cli(capsys, "lint", "--max-space", "50", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["inputs_checked"] == 50 and data["findings"][0]["code"] == "space-cut"
    assert all(f["message"].endswith("(as cut: see space-cut)") for f in data["findings"] if f["code"] == "dead-rule")
    assert data["space"]["cut"] == {"max_inputs": 50, "estimated_inputs": 2565, "size_variants": 2,
                                    "size_variants_left_out": 0, "connectors": 27, "connectors_left_out": 21,
                                    "stopped_at_bound": True, "max_space": 50, "rules": 11}
    code, out, _ = cli(capsys, "lint")
    assert code == 0 and "space-cut" not in out and '"cut"' not in out


@pytest.mark.parametrize("bad", ["0", "-5", "many"])
def test_max_space_must_be_a_positive_count(capsys, bad: str) -> None:
    code, _, err = cli(capsys, "lint", "--max-space", bad)
    assert code == 2 and "--max-space" in err


def test_diff_over_its_space_bound_warns_on_stderr(capsys, no_pth: Path) -> None:
    code, out, err = cli(capsys, "diff", str(RULES), str(no_pth), "--no-shipped-rules", "--max-space", "500")
    assert code in (0, 1)
    assert "\nwarning: the space was cut to at most 500 inputs (--max-space) from about 2565" in err
    assert "changes among the left-out inputs are not listed; raise --max-space to explore more" in err
    assert out.startswith("diff: 500 inputs of issue-48412 checked")
