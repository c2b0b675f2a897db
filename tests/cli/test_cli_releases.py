"""`kvpolicy releases`: the shipped profiles, and what changed between two releases."""

from __future__ import annotations

import json

from cli_capture import cli

from kvpolicy.policy.releases import get_profile, profile_names


def test_lists_every_profile_newest_first_with_what_it_extends(capsys) -> None:
    code, out, err = cli(capsys, "releases")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == list(profile_names())
    row = next(line for line in lines if line.startswith("vllm-0.34 "))
    assert "resolve_kv_cache_layout" in row and "extends vllm-0.33" in row and "rules/vllm-0.34" in row


def test_what_a_release_changed_names_each_fact_with_both_values(capsys) -> None:
    code, out, _ = cli(capsys, "releases", "0.33", "vllm-0.34")
    assert code == 0
    assert out.startswith("from vllm-0.33 (vLLM 0.33.0) to vllm-0.34 (vLLM 0.34.0):")
    assert "    default_block_size: 16 -> 64" in out.splitlines()
    assert "    options: [hisparse, dcp_sharding] -> [enable_extensible_kv_cache, hisparse, dcp_sharding]" in out
    assert "shipped rules: 0 added, 0 removed, 0 changed" in out  # the resolver family shares its rules


def test_the_same_profile_twice_differs_in_nothing(capsys) -> None:
    code, out, _ = cli(capsys, "releases", "vllm-0.31", "0.31.0", "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["facts"] == [] and report["rules"] == {"added": [], "removed": [], "changed": []}


def test_from_the_gate_to_the_resolver_the_rules_and_facts_change(capsys) -> None:
    code, out, _ = cli(capsys, "releases", "0.28.0", "0.29.0", "--format", "json")
    report = json.loads(out)
    assert code == 0 and (report["from"], report["to"]) == ("vllm-0.28", "vllm-0.29")
    assert "resolver: uniform_gate -> kv_cache_layout" in report["facts"]
    assert report["rules"]["added"] and report["rules"]["removed"]
    assert "mixed-hnc-shapes-need-block-compact" in report["rules"]["added"]
    assert get_profile("0.29.0").extends == "vllm-0.28"


def test_mistakes_are_usage_errors_naming_the_argument(capsys) -> None:
    code, _, err = cli(capsys, "releases", "0.33")
    assert code == 2 and err.startswith("FROM: error[usage]: give two profiles")
    code, _, err = cli(capsys, "releases", "0.33", "0.99")
    assert code == 2 and "TO: error[usage]: no profile for vLLM version `0.99`" in err and "known profiles" in err
