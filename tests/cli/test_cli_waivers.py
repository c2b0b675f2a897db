"""Waivers on the command line: validate is the gate (a lapsed waiver fails it), every verb reads `--today`,
dry-run shows the waiver it applied by file:line (text and JSON), and a safety guard cannot be waived."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

WAIVER = """\
version: 1
waivers:
  - rule: offloading-requires-lbhnc
    owner: kv-team@example.com
    reason: LMCache reads LBNHC until INFRA-1234
    expires: 2027-01-31
    when: {field: kv.kv_cache_dtype, eq: fp8}
"""
DRY = ("dry-run", "--vllm-version", "0.34.0", "--connector", "OffloadingConnector", "--kv-cache-dtype", "fp8")


@pytest.fixture
def ops(tmp_path: Path) -> Path:
    (tmp_path / "global.yaml").write_text(WAIVER)
    return tmp_path


def test_validate_passes_a_waiver_in_force_and_fails_a_lapsed_one(capsys: pytest.CaptureFixture[str],
                                                                 ops: Path) -> None:
    code, out, err = cli(capsys, "validate", str(ops), "--vllm-version", "0.34.0", "--today", "2027-01-31")
    assert code == 0 and out.startswith("ok: ") and "expired" not in err
    code, out, err = cli(capsys, "validate", str(ops), "--vllm-version", "0.34.0", "--today", "2027-02-01")
    assert code == 1 and out == ""
    assert f"{ops}/global.yaml:3:5: error[expired-waiver]: the waiver of `offloading-requires-lbhnc` (owner " \
           "kv-team@example.com) expired on 2027-01-31" in err
    assert "warning[expired-waiver]" not in err  # said once, as the error
    code, out, _ = cli(capsys, "validate", str(ops / "global.yaml"), "--vllm-version", "0.34.0",
                       "--today", "2027-02-01", "--format", "json")
    assert code == 1 and json.loads(out)["error"]["diagnostics"][0]["code"] == "expired-waiver"


def test_kvpolicy_today_is_read_and_a_bad_day_is_a_usage_error(capsys: pytest.CaptureFixture[str], ops: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_TODAY", "2027-03-01")
    assert cli(capsys, "validate", str(ops), "--vllm-version", "0.34.0")[0] == 1
    code, _, err = cli(capsys, "validate", str(ops), "--vllm-version", "0.34.0", "--today", "2027-01-01")
    assert code == 0, err  # the flag wins over the variable
    monkeypatch.setenv("KVPOLICY_TODAY", "2027-3-1")
    code, _, err = cli(capsys, "validate", str(ops), "--vllm-version", "0.34.0")
    assert code == 2 and "KVPOLICY_TODAY: error[invalid-date]: `2027-3-1` is not a date" in err
    code, _, err = cli(capsys, "inspect", str(ops), "--vllm-version", "0.34.0", "--today", "someday")
    assert code == 2 and "--today: error[invalid-date]" in err and "Traceback" not in err


def test_dry_run_explains_the_waiver_it_applied_and_warns_for_a_lapsed_one(capsys: pytest.CaptureFixture[str],
                                                                          ops: Path) -> None:
    code, out, _ = cli(capsys, *DRY, "--rules", str(ops), "--today", "2027-01-01")
    assert code == 0 and "layout: LBNHC" in out  # the connector's preference for LBHNC is waived
    assert "waived:" in out and f"waived at {ops}/global.yaml:3 (owner kv-team@example.com, expires 2027-01-31)" \
        in " ".join(out.split())
    code, out, _ = cli(capsys, *DRY, "--rules", str(ops), "--today", "2027-01-01", "--format", "json")
    [w] = json.loads(out)["waivers"]
    assert w["applied"] and w["source"] == f"{ops}/global.yaml:3" and w["layouts"] == ["LBHNC"]
    code, out, err = cli(capsys, *DRY, "--rules", str(ops), "--today", "2027-06-01")
    assert code == 0 and "layout: LBHNC" in out  # lapsed: the rule applies again
    assert "warning[expired-waiver]" in err and "expired on 2027-01-31" in " ".join(out.split())


def test_a_waiver_of_a_safety_guard_fails_validate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(WAIVER.replace("offloading-requires-lbhnc",
                                                         "per-token-head-forbids-cross-layer"))
    code, _, err = cli(capsys, "validate", str(tmp_path), "--vllm-version", "issue-48412")
    assert code == 1 and f"{tmp_path}/global.yaml:3:5: error[unwaivable-rule]" in err


def test_one_file_alone_checks_its_waivers_too(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`validate FILE --no-shipped-rules`: no layer below, the file's own waivers are still checked."""
    own = ("version: 1\nrules:\n  - id: r\n    description: d\n    forbid: {layout: LBNHC}\nwaivers:\n"
           "  - rule: r\n    owner: a\n    reason: b\n    expires: 2027-01-01\n")
    (tmp_path / "g.yaml").write_text(own)
    args = ("validate", str(tmp_path / "g.yaml"), "--no-shipped-rules", "--vllm-version", "0.34.0")
    assert cli(capsys, *args, "--today", "2027-01-01")[0] == 0
    code, _, err = cli(capsys, *args, "--today", "2027-01-02")
    assert code == 1 and "error[expired-waiver]" in err
    (tmp_path / "g.yaml").write_text(own.replace("  - rule: r\n", "  - rule: q\n"))
    code, _, err = cli(capsys, *args)
    assert code == 1 and f"{tmp_path}/g.yaml:7:5: error[unknown-waived-rule]" in err


def test_a_malformed_kvpolicy_today_fails_whether_or_not_the_rules_hold_waivers(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # a CI job with a bad day must not pass until someone adds the first waiver
    monkeypatch.setenv("KVPOLICY_TODAY", "2027-02-30")
    code, _, err = cli(capsys, "validate", "--vllm-version", "0.34.0")
    assert code == 2 and "KVPOLICY_TODAY: error[invalid-date]: `2027-02-30` is not a date" in err
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0")
    assert code == 1 and "KVPOLICY_TODAY=2027-02-30" in out and "error[invalid-date]" in out


def test_a_layer_shared_across_releases_waives_a_rule_only_where_it_ships(capsys: pytest.CaptureFixture[str],
                                                                         ops: Path) -> None:
    """One operator layer serves 0.34 and 0.28 deployments: its waiver of a 0.29+ rule is a note under 0.28
    (it waives nothing there), while a waiver of a rule no release ships stays an error (a typo)."""
    code, out, err = cli(capsys, "validate", str(ops), "--vllm-version", "0.28.0", "--today", "2027-01-01")
    assert code == 0 and out.startswith("ok: "), err
    assert (f"{ops}/global.yaml:3:5: warning[waived-rule-not-in-release]: `offloading-requires-lbhnc` is a "
            "shipped rule of vllm-0.") in err and "not of this release's rules" in err
    code, out, err = cli(capsys, *DRY[:2], "0.28.0", *DRY[3:], "--rules", str(ops), "--today", "2027-01-01")
    assert code == 0 and "waived-rule-not-in-release" in err
    (ops / "global.yaml").write_text(WAIVER.replace("offloading-requires-lbhnc", "offloading-requires-lbhcn"))
    code, _, err = cli(capsys, "validate", str(ops), "--vllm-version", "0.28.0", "--today", "2027-01-01")
    assert code == 1 and "error[unknown-waived-rule]: no rule `offloading-requires-lbhcn`" in err


def test_a_day_not_on_the_calendar_is_located_with_how_to_write_it(capsys: pytest.CaptureFixture[str],
                                                                  ops: Path) -> None:
    (ops / "global.yaml").write_text(WAIVER.replace("2027-01-31", "2027-02-30"))
    code, _, err = cli(capsys, "validate", str(ops), "--vllm-version", "0.34.0")
    assert code == 1 and f"{ops}/global.yaml:6:14: error[invalid-value]: expected a valid date" in err
    assert "help: write a day of the calendar as `YYYY-MM-DD`, e.g. `2027-02-28`" in err


@pytest.mark.parametrize("depth", range(0, 24, 3))  # the folder name's length moves the wrap
def test_a_wrapped_explanation_never_splits_an_owner_path_or_id_at_a_hyphen(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path, depth: int) -> None:
    """The waived line wraps at 88 columns; where the wrap falls moves with the rule folder's path (a test
    process's temporary folder, say), and a break inside `kv-team@example.com` or a rule id would print a
    name that is not the owner's and that a search for it does not find."""
    ops = tmp_path / ("d" * depth + "-rules")
    ops.mkdir()
    (ops / "global.yaml").write_text(WAIVER)
    code, out, _ = cli(capsys, *DRY, "--rules", str(ops), "--today", "2027-01-01")
    assert code == 0
    words = out.split()
    assert "kv-team@example.com," in words or "kv-team@example.com" in words
    split = [w for w in words if len(w) > 1 and w.endswith("-") and w[-2].isalnum()]  # `<-` is an arrow
    assert not split, split
