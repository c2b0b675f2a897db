"""The operator who owns one layer on top of the shipped rules (issue 22, class 1): `shipped` names the
shipped rules wherever a rule directory is accepted; coverage, lint and CI annotations are about the
operator's layer unless --include-shipped; CI locations are repository paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

ALWAYS_BLOCK_OUTERMOST = """\
version: 1
rules:
  - id: always-block-outermost
    description: this site moves whole blocks
    require: {block_outermost: true}
"""

PREFER = """\
version: 1
rules:
  - id: site-prefers-bhlnc
    description: this site likes BHLNC
    prefer: {layout: BHLNC}
    weight: 50
"""

CASE = """\
version: 1
cases:
  - name: plain
    input:
      spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}
    expect: {matched: [site-prefers-bhlnc]}
"""


@pytest.fixture
def layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "global.yaml").write_text(PREFER)
    (tmp_path / "site" / "tests").mkdir()
    (tmp_path / "site" / "tests" / "t.yaml").write_text(CASE)
    (tmp_path / "strict").mkdir()
    (tmp_path / "strict" / "global.yaml").write_text(ALWAYS_BLOCK_OUTERMOST)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_shipped_is_a_rule_directory_for_validate_diff_and_test(layer: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "validate", "shipped")
    assert code == 0 and out.startswith("ok: "), err
    code, out, err = cli(capsys, "diff", "shipped", "site/", "--format", "json")
    assert code == 1, err  # the layer changes decisions: against the shipped rules alone
    assert json.loads(out)["counts"]
    code, out, err = cli(capsys, "diff", "shipped", "shipped")
    assert code == 0, err
    code, out, err = cli(capsys, "test", "--rules", "shipped")
    assert code == 0 and " 0 failed" in out, out + err


def test_shipped_under_no_shipped_rules_is_still_the_shipped_layer(layer: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "validate", "--rules", "shipped", "--rules", "site", "--no-shipped-rules",
                         "--format", "json")
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert [(x["root"], x["shipped"]) for x in layers] == [("rules/issue-48412", True), ("site", False)]
    assert "dropped-guard" not in err


def test_a_missing_directory_names_shipped_in_its_help(layer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = cli(capsys, "validate", "nope/")
    assert code == 2 and "`shipped`" in err


def test_coverage_counts_the_operators_layer(layer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "test", "--rules", "site", "--require-coverage")
    assert code == 0, out + err
    assert "coverage: 1/1 rules of site matched by some case" in out
    code, out, _ = cli(capsys, "test", "--rules", "site", "--include-shipped", "--require-coverage")
    assert code == 1 and "uncovered: " in out and "rules/issue-48412/" in out


def test_lint_of_a_layer_reports_the_layer(layer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = cli(capsys, "lint", "site", "--format", "json")
    data = json.loads(out)
    assert {lb["rule"] for lb in data["load_bearing"]} <= {"site-prefers-bhlnc"}
    assert all(f["rule"] is None or f["rule"]["rule"] == "site-prefers-bhlnc" for f in data["findings"])
    assert data["shipped_findings_left_out"] > 0
    _code, out, _ = cli(capsys, "lint", "site", "--format", "json", "--include-shipped")
    data = json.loads(out)
    assert any(lb["source"].startswith("rules/issue-48412/") for lb in data["load_bearing"])
    assert data["shipped_findings_left_out"] == 0


def test_ci_locations_are_repository_paths(layer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "lint", "--rules", str(layer / "strict"), "--format", "github")
    assert code == 1
    # the conflict the layer makes is located at its rule (GitHub annotates files, not directories), relative
    # to the cwd
    assert "::error file=strict/global.yaml,line=3,col=5,title=conflict::" in out
    assert "file=strict," not in out
    assert "%20%2B%20" not in out and "rules/issue-48412 + " not in out.split("::")[1]
    code, out, _ = cli(capsys, "lint", "strict", "--include-shipped", "--format", "sarif")
    run = json.loads(out)["runs"][0]
    uris = [loc["physicalLocation"]["artifactLocation"] for r in run["results"] for loc in r.get("locations", [])]
    assert {"uri": "strict/global.yaml"} in uris and {"uri": "strict"} not in uris
    shipped = [u for u in uris if u.get("uriBaseId") == "KVPOLICY_SHIPPED"]
    assert shipped and all(u["uri"].startswith("issue-48412/") for u in shipped)
    assert "KVPOLICY_SHIPPED" in run["originalUriBaseIds"]
    assert not any("%20" in u["uri"] or u["uri"].startswith(("/", "rules/")) for u in uris)
    code, out, _ = cli(capsys, "lint", "strict", "--include-shipped", "--format", "github")
    lines = [line for line in out.splitlines() if "shipped rule at rules/issue-48412/" in line]
    assert lines and not any("file=rules/" in line for line in lines)


def test_test_annotations_name_no_shipped_file_as_the_repositorys(layer: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "test", "--rules", "site", "--include-shipped", "--format", "github")
    assert code == 0  # every case passes; uncovered shipped rules are warnings
    uncovered = [line for line in out.splitlines() if "uncovered-rule" in line]
    assert uncovered and not any("file=rules/" in line for line in uncovered)
    assert any("shipped rule at rules/issue-48412/" in line for line in uncovered)


def test_a_layers_conflict_is_located_at_its_rule_and_summarised(layer: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A conflict the layer makes: at the layer's rule (not its directory, which GitHub cannot annotate), and a
    field of many values (27 connector combinations) summarised in text, listed in full by --verbose and JSON."""
    code, out, _ = cli(capsys, "lint", "strict")
    assert code == 1 and out.startswith("strict/global.yaml:3: error[conflict]: no layout survives for ")
    assert "where `always-block-outermost` removes candidates" in out
    assert "connector=<27 values: " in out and "--verbose lists each" in out
    assert "MultiConnector[NixlConnector" not in out and len(out) < 4000
    code, none, _ = cli(capsys, "lint", "strict", "--max-inputs", "0")
    assert "values: " not in none and "--verbose lists each" not in none  # no line shown, nothing summarised
    code, verbose, _ = cli(capsys, "lint", "strict", "--verbose")
    assert "MultiConnector[NixlConnector" in verbose and "values: " not in verbose and len(verbose) > 2 * len(out)
    code, text, _ = cli(capsys, "lint", "strict", "--format", "json")
    conflict, = [f for f in json.loads(text)["findings"] if f["code"] == "conflict"]
    assert conflict["rule"]["rule"] == "always-block-outermost" and conflict["rule"]["source"] == "strict/global.yaml:3"
    assert conflict["count"] == len(conflict["inputs"]) == sum(g["count"] for g in conflict["groups"])
    assert any("MultiConnector[NixlConnector" in g["inputs"] for g in conflict["groups"])
