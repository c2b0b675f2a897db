"""`kvpolicy test --format junit|github|sarif` and coverage by layer and file with `--require-coverage PERCENT`."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cli_capture import cli

SITE = """\
version: 1
rules:
  - id: site-fp8-per-layer
    description: fp8 caches stay per layer
    when: {field: kv.kv_cache_dtype, eq: fp8}
    forbid: {placement: cross_layer}
  - id: site-huge-models-per-layer
    description: never seen by a case
    when: {field: kv.num_layers, gt: 1000}
    forbid: {placement: cross_layer}
"""
CASES = """\
version: 1
cases:
  - name: fp8 stays per layer
    input: {spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}, kv_cache_dtype: fp8}
    expect: {layout: {placement: per_layer}, matched: [site-fp8-per-layer]}
  - name: a wrong expectation
    input: {spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}}
    expect: {layout: BHLNC}
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "global.yaml").write_text(SITE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "cases.yaml").write_text(CASES)
    return tmp_path


def _args(site: Path, *more: str) -> list[str]:
    return ["test", "--rules", str(site), "--vllm-version", "0.34.0", *more]


def test_junit_is_testsuites_of_testsuite_of_testcase_with_failure(capsys: pytest.CaptureFixture[str],
                                                                     site: Path) -> None:
    code, out, _ = cli(capsys, *_args(site, "--format", "junit"))
    assert code == 1 and out.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites ')
    root = ET.fromstring(out.split("\n", 1)[1])
    assert root.tag == "testsuites" and root.get("failures") == "1"
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == [str(site / "tests" / "cases.yaml"), "coverage"]
    for s in suites:  # the attributes the common JUnit schema (Jenkins' junit-10.xsd) requires
        assert {"name", "tests", "failures", "errors"} <= set(s.attrib)
        assert int(s.get("tests")) == len(s.findall("testcase"))
        assert int(s.get("failures")) == len(s.findall("testcase/failure"))
        assert all(set(c.attrib) >= {"name", "classname"} for c in s.findall("testcase"))
    cases = suites[0].findall("testcase")
    assert [c.get("name") for c in cases] == ["fp8 stays per layer", "a wrong expectation"]
    assert cases[0].find("failure") is None and cases[1].get("line") == "6"
    failure = cases[1].find("failure")
    assert failure.get("type") == "policy-test" and "expected layout" in failure.get("message")
    assert "decision (fails):" in failure.text
    uncovered = {c.get("name"): c for c in suites[1].findall("testcase")}
    assert "site-fp8-per-layer" not in uncovered  # covered rules are not listed
    assert uncovered["site-huge-models-per-layer"].find("skipped") is not None
    assert uncovered["site-huge-models-per-layer"].get("line") == "7"
    code, out, _ = cli(capsys, *_args(site, "--format", "junit", "--require-coverage"))
    coverage = ET.fromstring(out.split("\n", 1)[1]).findall("testsuite")[1]
    assert coverage.find("testcase/failure").get("type") == "coverage"


def test_github_and_sarif_locate_failed_cases_and_uncovered_rules(capsys: pytest.CaptureFixture[str],
                                                                  site: Path) -> None:
    code, out, _ = cli(capsys, *_args(site, "--format", "github"))
    assert code == 1
    assert f"::error file={site}/tests/cases.yaml,line=6,col=1,title=policy-test-failed::case `a wrong" in out
    assert f"::warning file={site}/global.yaml,line=7" in out and "site-huge-models-per-layer" in out
    code, out, _ = cli(capsys, *_args(site, "--format", "sarif"))
    results = json.loads(out)["runs"][0]["results"]
    assert {r["ruleId"] for r in results} >= {"policy-test-failed", "uncovered-rule"}


def test_coverage_by_layer_and_file_and_a_percentage_threshold(capsys: pytest.CaptureFixture[str],
                                                               site: Path) -> None:
    (site / "tests" / "cases.yaml").write_text(CASES[:CASES.index("  - name: a wrong")])
    code, out, _ = cli(capsys, *_args(site))
    assert code == 0
    assert f"  {site} (operator): 1/2 (50%)" in out and "  rules/vllm-0.34 (shipped): " in out
    assert f"coverage by file:\n  {site}/global.yaml: 1/2 (50%)" in out
    assert "rules/vllm-0.34/global.yaml:" not in out.split("coverage by file:")[1]  # shipped files: with -v
    # the threshold is over the rules coverage counts (here the layer alone: 1 of 2)
    # (issue-48412: the profile whose dropped-guard check --no-shipped-rules runs in a second)
    alone = ["test", "--rules", str(site), "--vllm-version", "issue-48412", "--no-shipped-rules"]
    assert cli(capsys, *alone, "--require-coverage", "40")[0] == 0
    code, out, _ = cli(capsys, *alone, "--require-coverage", "60")
    assert code == 1 and "coverage 50.0% is under the required 60%" in out
    assert cli(capsys, *alone, "--require-coverage")[0] == 1  # alone: 100
    code, out, _ = cli(capsys, *_args(site, "--format", "json", "--require-coverage", "60"))
    cov = json.loads(out)["coverage_summary"]
    assert code == 1 and cov["required"] == 60
    mine = next(r for r in cov["by_file"] if r["name"] == f"{site}/global.yaml")
    assert mine == {"name": f"{site}/global.yaml", "kind": "file", "matched": 1, "total": 2, "percent": 50.0}
    code, _, err = cli(capsys, *_args(site, "--require-coverage", "ninety"))
    assert code == 2 and "expected a percentage from 0 to 100" in err


def test_junit_reports_a_case_file_that_does_not_load_as_an_errored_testcase(capsys: pytest.CaptureFixture[str],
                                                                             site: Path) -> None:
    (site / "tests" / "broken.yaml").write_text(
        "version: 1\ncases:\n  - name: names no rule\n    input: {spec: {num_layers: 4, num_kv_heads: 2, "
        "head_size: 64}}\n    expect: {matched: [no-such-rule]}\n")
    code, out, err = cli(capsys, *_args(site, "--format", "junit"))
    assert code == 1 and "error[unknown-rule]" in err  # the exit code and stderr as before
    assert out.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites ')
    root = ET.fromstring(out.split("\n", 1)[1])
    assert root.get("errors") == "1" and root.get("tests") == "1"
    (suite,) = root.findall("testsuite")
    assert suite.get("name") == str(site / "tests" / "broken.yaml") and suite.get("errors") == "1"
    (case,) = suite.findall("testcase")
    assert case.get("file") == str(site / "tests" / "broken.yaml") and case.get("line") == "5"
    error = case.find("error")
    assert error.get("type") == "unknown-rule" and "no rule `no-such-rule`" in error.get("message")
    assert "broken.yaml:5:" in error.text


def test_the_rule_sets_warnings_are_in_the_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # text prints a lapsed waiver's warning on stderr; the JSON document had no place for it
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "global.yaml").write_text(
        "version: 1\nrules:\n  - id: site-w\n    description: d\n    forbid: {head_order: HND}\n"
        "waivers:\n  - {rule: site-w, owner: o, reason: r, expires: 2026-01-01}\n")
    (tmp_path / "c.yaml").write_text(
        "version: 1\ncases:\n  - name: one\n    input:\n      spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}\n"
        "    expect:\n      layout: LBHNC\n")
    _, out, _ = cli(capsys, "test", str(tmp_path / "c.yaml"), "--rules", str(rules), "--vllm-version", "0.34.0",
                    "--today", "2026-06-01", "--format", "json")
    (warning,) = json.loads(out)["warnings"]
    assert warning["code"] == "expired-waiver" and "site-w" in warning["message"]
