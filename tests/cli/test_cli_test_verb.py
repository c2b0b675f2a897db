"""`kvpolicy test`: the shipped policy tests pass with full coverage; failures show expected vs actual."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.releases import profile_names

ROOT = Path(__file__).resolve().parents[2]
SPEC = "{num_layers: 24, block_size: 16, num_kv_heads: 2, head_size: 64}"
N_RULES = len(LayoutEngine.default().ruleset.rules)  # the shipped rules; 11 when written


def case_file(tmp_path: Path, body: str, name: str = "cases.yaml") -> Path:
    path = tmp_path / name
    path.write_text("version: 1\ncases:\n" + body)
    return path


def test_shipped_policy_tests_pass_with_full_coverage(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "test")
    assert code == 0, out + err
    lines = out.splitlines()
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[-2]), lines[-2]
    assert int(lines[-2].split()[0]) >= 25
    assert lines[-1] == f"coverage: {N_RULES}/{N_RULES} rules matched by some case"
    assert "FAIL" not in out


def test_require_coverage_passes_on_shipped_tests(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = cli(capsys, "test", "--require-coverage")
    assert code == 0


def test_verbose_lists_passing_cases(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "test", "-v", str(ROOT / "rules" / "issue-48412" / "tests" / "gate.yaml"))
    assert code == 0
    passed = r"^PASS rules/issue-48412/tests/gate\.yaml:\d+: no connector keeps vLLM's default per-layer NHD$"
    assert re.search(passed, out, re.M)


def test_failing_case_shows_expected_vs_actual(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = case_file(tmp_path, f"""\
  - name: wrong on purpose
    input: {{spec: {SPEC}, kv_cache_dtype: fp8_per_token_head, connector: OffloadingConnector}}
    expect:
      layout: BLNHC
      removed: {{BHLNC: [cross-layer-needs-connector]}}
      not_matched: [offloading-prefers-cross-layer]
  - name: right
    input: {{spec: {SPEC}}}
    expect: {{layout: LBNHC}}
""")
    code, out, _ = cli(capsys, "test", str(path))
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"FAIL {path}:3: wrong on purpose"
    assert lines[1:7] == [
        "  expected layout: BLNHC",
        "  actual layout:   LBNHC",
        "  expected `BHLNC` removed by `cross-layer-needs-connector`",
        "  actual: removed by `per-token-head-forbids-cross-layer`",
        "  expected rule `offloading-prefers-cross-layer` not to match",
        "  actual: it matched",
    ]
    assert lines[7] == "  decision (fails):"
    assert lines[8] == "    layout: LBNHC (per_layer, NHD)"
    assert "    counterfactual:" in lines
    summary = lines.index("1 passed, 1 failed")
    assert lines[summary + 1] == f"coverage: 3/{N_RULES} rules matched by some case"
    assert all(line.startswith("  uncovered: ") for line in lines[summary + 2:])


def test_uncovered_rules_are_listed_and_require_coverage_fails(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    path = case_file(tmp_path, f"  - name: plain\n    input: {{spec: {SPEC}}}\n    expect: {{layout: LBNHC}}\n")
    code, out, _ = cli(capsys, "test", str(path))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "1 passed, 0 failed"
    assert lines[1] == f"coverage: 1/{N_RULES} rules matched by some case"
    uncovered = lines[2:]
    assert len(uncovered) == N_RULES - 1
    assert any(re.fullmatch(r"  uncovered: nixl-requires-hnd at rules/issue-48412/connectors/nixl\.yaml:\d+", line)
               for line in uncovered)
    assert not any("cross-layer-needs-connector" in line for line in uncovered)
    code, _, _ = cli(capsys, "test", str(path), "--require-coverage")
    assert code == 1


def test_expected_error_cases(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = case_file(tmp_path, f"""\
  - name: bad input is an expected error
    input: {{spec: {SPEC}, backend: NOPE}}
    expect: {{error: unknown-backend}}
  - name: unexpected error
    input: {{spec: {SPEC}, backend: NOPE}}
    expect: {{layout: LBNHC}}
""")
    code, out, _ = cli(capsys, "test", str(path))
    assert code == 1
    assert (f"FAIL {path}:6: unexpected error\n  expected a decision\n"
            "  actual error: `invalid-input`, `unknown-backend`\n  error:\n"
            f"    {path}:7:") in out  # located at `backend:` in the case file
    assert "error[unknown-backend]: unknown attention backend `NOPE` in profile `issue-48412`" in out
    assert "1 passed, 1 failed" in out


def test_malformed_case_file_is_located(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = case_file(tmp_path, f"""\
  - name: typo
    input:
      spec: {SPEC}
      conector: OffloadingConnector
    expect:
      layout: cross_layer/XYZ
""")
    code, out, err = cli(capsys, "test", str(path))
    assert code == 1 and out == ""
    assert f"{path}:6:7: error[unknown-key]: unknown key `conector`\n  help: did you mean `connector`?" in err
    assert f"{path}:8:15: error[invalid-value]: unknown layout `cross_layer/XYZ`" in err


def test_unknown_rule_in_expectation(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = case_file(tmp_path, f"""\
  - name: typo in a rule id
    input: {{spec: {SPEC}}}
    expect: {{matched: [cross-layer-needs-conector]}}
""")
    code, _, err = cli(capsys, "test", str(path))
    assert code == 1
    assert f"{path}:5:24: error[unknown-rule]: no rule `cross-layer-needs-conector` in rule set `rules/issue-48412`\n" \
           "  help: did you mean `cross-layer-needs-connector`?" in err


def test_rules_flag_selects_rule_set_and_its_tests(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "my-rules"
    shutil.copytree(ROOT / "rules" / "issue-48412", root)
    code, out, _ = cli(capsys, "test", "--rules", str(root))
    assert code == 0 and f"coverage: {N_RULES}/{N_RULES} rules matched by some case" in out
    shutil.rmtree(root / "tests")
    code, _, err = cli(capsys, "test", "--rules", str(root))
    assert code == 1
    assert f"{root}/tests: error[not-found]: no such file or directory" in err


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "test", "--format", "json")
    data = json.loads(out)
    assert code == 0
    assert data["failed"] == 0 and data["passed"] == len(data["cases"])
    assert data["coverage"] == {"matched": N_RULES, "total": N_RULES, "layers": [], "uncovered": []}
    assert data["cases"][0]["location"].startswith("rules/issue-48412/tests/")


def test_missing_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = cli(capsys, "test", str(tmp_path / "none.yaml"))
    assert code == 2 and "error[usage]: no such file or directory" in err  # a usage error, as for every verb


def _rollout(tmp_path: Path) -> Path:
    """docs/examples/rollout/ (one audit-mode rule, two cases asserting it) with its example models."""
    shutil.copytree(ROOT / "docs" / "examples", tmp_path / "examples")
    return tmp_path / "examples" / "rollout"


def test_audit_rules_count_in_coverage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An audit-mode rule is covered by a case whose expect.audit names it, and uncovered otherwise; it was
    left out of coverage altogether ("0/0 rules", --require-coverage 100 passing vacuously; issue 22)."""
    rollout = _rollout(tmp_path)
    code, out, err = cli(capsys, "test", "--rules", str(rollout), "--vllm-version", "0.34.0", "--require-coverage",
                         "100")
    assert code == 0, out + err
    assert f"coverage: 1/1 rules of {rollout}" in out
    (rollout / "tests" / "recorded.yaml").write_text(  # a case that asserts no audit finding
        "version: 1\ncases:\n  - name: no audit asserted\n    input: {spec: " + SPEC + ", vllm_version: vllm-0.34}\n"
        "    expect: {layout: LBNHC}\n")
    code, out, _ = cli(capsys, "test", "--rules", str(rollout), "--vllm-version", "0.34.0", "--require-coverage",
                       "100")
    assert code != 0 and f"coverage: 0/1 rules of {rollout}" in out
    assert "uncovered: site-per-token-head-stays-nhd at " in out


def test_rule_counts_agree_across_verbs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """validate and doctor count the same rules for one stack, audit-mode rules included (lint too: its count
    is `all_rules`, not run here: it enumerates the whole input space)."""
    rollout = _rollout(tmp_path)
    code, out, _ = cli(capsys, "validate", str(rollout), "--vllm-version", "0.34.0")
    validated = int(re.search(r"ok: (\d+) rules", out)[1])  # type: ignore[index]
    monkeypatch.setenv("KVPOLICY_RULES", str(rollout))
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0")
    assert code == 0
    doctored = int(re.search(r"^rules: .*: (\d+) rules,", out, re.M)[1])  # type: ignore[index]
    assert validated == doctored == len(LayoutEngine.default("0.34.0").ruleset.all_rules) + 1


@pytest.mark.parametrize("profile", profile_names())
def test_the_shipped_policy_tests_pass_under_every_profile(capsys: pytest.CaptureFixture[str], profile: str) -> None:
    """`kvpolicy test --vllm-version X` runs the tests of X's shipped layers, decided as X: a case whose behaviour
    only some releases of a layer's family have pins its `vllm_version` (docs/cli.md), so every profile is green."""
    code, out, err = cli(capsys, "test", "--vllm-version", profile)
    assert code == 0, out + err
    assert ", 0 failed" in out
