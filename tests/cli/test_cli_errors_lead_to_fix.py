"""Errors that lead to the fix (issue 22, class 3): each names the value meant and where it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.policy.near_names import nearest, nearest_operator
from kvpolicy.policy.rule_model import OPERATORS

FLASH_LOWER = """\
version: 1
rules:
  - id: no-flash-block-outermost
    description: a site rule with vLLM's name in the wrong case
    when: {field: backend.name, in: [TRITON_ATTN, flash_attn]}
    forbid: {block_outermost: true}
"""

GREATER_THAN = """\
version: 1
rules:
  - id: big-models-per-layer
    description: an operator spelt as another policy language spells it
    when: {field: kv.num_layers, greater_than: 30}
    forbid: {block_outermost: true}
"""

MISSPELT_CONNECTOR = """\
version: 1
connector: NixlConector
rules:
  - id: nixl-likes-hnd
    description: a connector name with a typo
    prefer: {layout: LBHNC}
"""

OTHER_PROFILES_RULE = """\
version: 1
cases:
  - name: written for vLLM 0.34
    input:
      spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}
    expect: {matched: [env-layout-lbnhc]}
"""

MAMBA = """\
groups:
  - spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}
  - spec: {kind: mamba, num_layers: 2, block_size: 16}
"""


def _layer(tmp_path: Path, text: str, name: str = "global.yaml") -> Path:
    root = tmp_path / "site"
    (root / Path(name).parent).mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
    return root


def test_the_nearest_name_knows_vllms_abbreviations() -> None:
    backends = ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN", "FLASHMLA", "TRITON_MLA")
    assert nearest("FLASH_ATTENTION", backends) == "FLASH_ATTN"
    assert nearest("flash_attn", backends) == "FLASH_ATTN"
    assert nearest("FLASH_ATTN_VLLM_V1", backends) == "FLASH_ATTN"
    assert nearest("flex-attention", backends) == "FLEX_ATTENTION"
    assert nearest("CPU", backends) == "CPU_ATTN"
    assert nearest("PAGED_LATENT_QUUX", backends) is None  # nothing near: no guess
    assert nearest_operator("greater_than", OPERATORS) == "gt"
    assert nearest_operator("gte", OPERATORS) == "ge"
    assert nearest_operator("not_one_of", OPERATORS) == "not_in"
    assert nearest_operator("eqq", OPERATORS) == "eq"


def test_a_literal_no_release_produces_warns_with_the_name_meant(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "validate", str(_layer(tmp_path, FLASH_LOWER)))
    assert code == 0  # a warning: a backend of a newer vLLM is legal
    assert f"{tmp_path}/site/global.yaml:3:5: warning[unknown-literal]: rule `no-flash-block-outermost` compares " \
           "`backend.name` with `flash_attn`, which no release profile produces" in err
    assert "did you mean `FLASH_ATTN`?" in err
    assert "TRITON_ATTN`, which" not in err
    code, out, _ = cli(capsys, "dry-run", "--rules", str(tmp_path / "site"), "--format", "json")
    assert code == 0 and any("warning[unknown-literal]" in w for w in json.loads(out)["warnings"])  # JSON says it too


def test_an_unknown_backend_suggests_vllms_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--backend", "FLASH_ATTENTION")
    assert code == 2 and "did you mean `FLASH_ATTN`?" in err


def test_an_operator_from_another_language_suggests_ours(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "validate", str(_layer(tmp_path, GREATER_THAN)))
    assert code == 1
    assert "global.yaml:5:11: error[invalid-condition]" in err
    assert "help: did you mean `gt`? write `gt: 30` instead of `greater_than: 30`" in err


def test_a_misspelt_connector_file_warns_at_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _layer(tmp_path, MISSPELT_CONNECTOR, "connectors/NixlConector.yaml")
    code, _, err = cli(capsys, "validate", str(root))
    assert code == 0
    assert f"{root}/connectors/NixlConector.yaml:2:12: warning[near-connector-name]" in err


def test_a_case_naming_another_profiles_rule_says_which(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = tmp_path / "case.yaml"
    case.write_text(OTHER_PROFILES_RULE)
    code, _, err = cli(capsys, "test", str(case))  # under issue-48412 (tests/conftest.py)
    assert code == 1
    assert "error[unknown-rule]: no rule `env-layout-lbnhc`" in err
    assert "`env-layout-lbnhc` is a shipped rule of `vllm-0.34`" in err and "--vllm-version vllm-0.34" in err
    assert "`kvpolicy inspect --vllm-version vllm-0.34` lists" in err


def test_a_mamba_group_says_what_head_fields_mean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "hybrid.yaml"
    spec.write_text(MAMBA)
    code, _, err = cli(capsys, "dry-run", "--spec", str(spec))
    assert code == 2
    # both missing fields at once, each with what it means for Mamba
    assert "missing required key `num_kv_heads`" in err and "missing required key `head_size`" in err
    assert err.count("a Mamba group has no heads") == 2 and "page_size_padded" in err


def test_a_case_giving_model_spec_fields_says_to_use_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = tmp_path / "case.yaml"
    case.write_text("version: 1\ncases:\n  - name: a spec under model\n    input:\n"
                    "      model: {num_layers: 32, block_size: 16, num_kv_heads: 8, head_size: 128}\n"
                    "    expect: {layout: LBNHC}\n")
    code, _, err = cli(capsys, "test", str(case))
    assert code == 1 and f"{case}:5:14: error[invalid-value]" in err
    assert "write KV cache spec fields under `spec:`" in err
