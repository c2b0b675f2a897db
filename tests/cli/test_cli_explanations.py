"""Explanations that do not mislead (issue 22, class 4): counterfactuals propose only inputs the release
accepts, settings before facts; the MultiConnector note says the file's mode; a tie names what broke it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

FACT_AND_SETTING = """\
version: 1
rules:
  - id: mla-likes-bhlnc
    description: a fact of the model
    when: {field: kv.kind, eq: mla}
    prefer: {layout: BHLNC}
    weight: 100
  - id: fp8-likes-blnhc
    description: a setting
    when: {field: kv.kv_cache_dtype, eq: fp8}
    prefer: {layout: BLNHC}
    weight: 100
"""

NEVER = """\
version: 1
rules:
  - id: never
    description: matches nothing of this space
    when: {field: kv.num_layers, gt: 100000}
    forbid: {layout: BHLNC}
"""

PREFER_BHLNC = """\
version: 1
rules:
  - id: likes-bhlnc
    description: always BHLNC
    prefer: {layout: BHLNC}
"""


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text("num_layers: 4\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n")
    return path


def _layer(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "global.yaml").write_text(text)
    return str(tmp_path / name)


def test_no_counterfactual_proposes_what_the_release_refuses(spec: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM 0.34 refuses a HiSparse config without a HiSparseConnector: never advice."""
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--spec", str(spec), "--kv-cache-dtype", "auto",
                       "--connector", "OffloadingConnector", "--format", "json")
    assert code == 0
    for cf in json.loads(out)["counterfactual"]:
        assert not any(c["field"] == "attention.hisparse" for c in cf["changes"] or []), cf["text"]


def test_counterfactuals_on_028_take_only_what_028_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    """0.28 takes VLLM_KV_CACHE_LAYOUT=NHD or HND only, and no operator sets kv.per_token_head (it follows
    from kv_cache_dtype): neither is proposed as a setting (issue 22)."""
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.28.0", "--format", "json")
    assert code == 0
    cfs = json.loads(out)["counterfactual"]
    changes = [(cf, c) for cf in cfs for c in cf["changes"] or []]
    assert any(c["field"] == "env.VLLM_KV_CACHE_LAYOUT" for _, c in changes)
    for cf, c in changes:
        if c["field"] == "env.VLLM_KV_CACHE_LAYOUT":
            assert c["to"] in ("NHD", "HND", None), cf["text"]
        if c["field"] == "kv.per_token_head":
            assert not cf["actionable"] and "kv.per_token_head is derived from kv.kv_cache_dtype" in cf["text"]


def test_settings_come_before_facts_no_operator_can_change(tmp_path: Path, spec: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rules = _layer(tmp_path, "cf", FACT_AND_SETTING)
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--rules", rules, "--no-shipped-rules",
                       "--spec", str(spec), "--kv-cache-dtype", "auto", "--connector", "none", "--format", "json")
    assert code == 0
    cfs = json.loads(out)["counterfactual"]
    assert [(c["layout"], c["actionable"]) for c in cfs[:2]] == [("BLNHC", True), ("BHLNC", False)]
    assert cfs[1]["text"].endswith("(a fact of the model, backend or hardware, not a setting)")
    assert all(c["changes"] is None for c in cfs[2:])


def test_the_multiconnector_note_says_the_files_mode(capsys: pytest.CaptureFixture[str]) -> None:
    config = json.dumps({"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                                        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}]})
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--kv-cache-dtype", "auto",
                       "--connector", "MultiConnector", "--connector-config", config)
    assert code == 0
    text = " ".join(out.split())
    assert "`MultiConnector`'s `member_preferences: agree`" in text and "`all` = the smallest" not in text


def test_a_tie_names_what_broke_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = _layer(tmp_path, "old", NEVER), _layer(tmp_path, "new", PREFER_BHLNC)
    code, out, _ = cli(capsys, "diff", old, new, "--vllm-version", "0.34.0", "--no-shipped-rules", "--max-changes", "1")
    assert code == 1
    assert "because no rule decides: the release's preference order" in out
    assert "default order" not in out
