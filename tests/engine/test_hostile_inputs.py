"""A hostile user's inputs to the release-profile features: each is decided, or a located error.

Regressions for what a hostile review found broken (odd values for the decide()
keywords, the dry-run flags and the policy-test fields, odd vLLM versions, byte
addresses at the edges), and properties that keep them fixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.policy_tests import PolicyTestError, load_cases, run_policy_tests

SPEC = "{num_layers: 4, num_kv_heads: 2, head_size: 64}"
GROUP_SPEC = "{num_layers: 4, num_kv_heads: 2, head_size: 64, block_size: 16}"


def _case_file(tmp_path: Path, inputs: str, expect: str = "{layout: LBNHC}") -> Path:
    body = "\n".join("      " + line for line in inputs.strip().splitlines())
    path = tmp_path / "cases.yaml"
    path.write_text(f"version: 1\ncases:\n  - name: c\n    input:\n{body}\n    expect: {expect}\n")
    return path


# -- policy-test fields: a wrong type is a located load error, never a silently coerced value -----------


@pytest.mark.parametrize(("inputs", "message"), [
    (f"spec: {SPEC}\nblock_size: true", "expected a valid integer, got boolean"),
    (f"spec: {SPEC}\nblock_size: '16'", "expected a valid integer, got string"),
    (f"spec: {SPEC}\nblock_size: 16.0", "expected a valid integer, got number"),
    (f"spec: {SPEC}\ndevice_capability: true", "expected a valid integer, got boolean"),
    (f"spec: {SPEC}\ndevice_capability: .inf", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: .nan", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: 0.5", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: -1.0", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: '１０.0'", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\nhisparse: 'true'\nconnector: HiSparseConnector", "expected a valid boolean, got string"),
    (f"spec: {SPEC}\nhisparse: 1\nconnector: HiSparseConnector", "expected a valid boolean, got integer"),
    (f"spec: {SPEC}\nenable_extensible_kv_cache: 0", "expected a valid boolean, got integer"),
    (f"spec: {SPEC}\nuse_v2_model_runner: 'yes'", "expected a valid boolean, got string"),
    (f"spec: {SPEC}\ntensor_parallel_size: true", "expected a valid integer, got boolean"),
    (f"spec: {SPEC}\nvllm_version: ''", "at least 1 character"),
    (f"spec: {SPEC}\nvllm_version: 0.34", "write the vLLM version as a string"),
    (f"groups: [{{spec: {GROUP_SPEC}, num_attention_groups: true}}]", "expected a valid integer, got boolean"),
    (f"groups: [{{spec: {GROUP_SPEC}, num_attention_groups: '2'}}]", "expected a valid integer, got string"),
    (f"groups: [{{spec: {GROUP_SPEC}, dcp_sharded: 'no'}}]", "expected a valid boolean, got string"),
    (f"groups: [{{spec: {GROUP_SPEC}, dcp_sharded: 0}}]", "expected a valid boolean, got integer"),
])
def test_case_fields_of_the_wrong_type_are_located_errors(tmp_path: Path, inputs: str, message: str) -> None:
    path = _case_file(tmp_path, inputs)
    with pytest.raises(PolicyTestError) as info:
        load_cases([path])
    [d] = info.value.diagnostics
    assert d.file.endswith("cases.yaml") and d.line >= 5 and d.col > 0, d.render()
    assert message in d.message, d.render()


def test_case_device_capability_as_written_by_people(tmp_path: Path) -> None:
    for value in ("10", "10.0", "'10.0'", "'10'"):
        path = _case_file(tmp_path, f"spec: {SPEC}\ndevice_capability: {value}\nattention_backend: FLASHINFER",
                          "{survivors: [LBHNC, BLHNC]}")
        run = run_policy_tests(_shipped("0.34.0"), [path], vllm_version="0.34.0")
        assert run.ok, [r.failures for r in run.results]


def test_case_tensor_parallel_size_with_a_spec_is_refused_not_dropped(tmp_path: Path) -> None:
    path = _case_file(tmp_path, f"spec: {SPEC}\ntensor_parallel_size: 2", "{error: invalid-input}")
    run = run_policy_tests(_shipped("0.34.0"), [path], vllm_version="0.34.0")
    assert run.ok, [r.failures for r in run.results]
    [result] = run.results
    [d] = result.error.diagnostics
    assert "applies to `model` only" in d.message and d.line == 6, d.render()


def _shipped(version: str):
    from engine import LayoutEngine

    return LayoutEngine.default(version).ruleset


@pytest.mark.parametrize("text", ["9", "9.0", "10.0", "12.1"])
def test_device_capability_parses_the_same_in_cases_and_flags(text: str) -> None:
    from engine.cli.dry_run import _capability
    from engine.inputs import parse_device_capability
    from engine.policy_tests import CaseInput

    major = int(text.split(".")[0])
    assert parse_device_capability(text) == _capability(text) == major
    assert CaseInput(spec={}, device_capability=text).device_capability == major


@pytest.mark.parametrize("text", ["", " 9", "９", "10.0.1", "sm_90", "0", "100", "-1", "1e3", "10.x"])
def test_device_capability_refuses_the_same_in_cases_and_flags(text: str) -> None:
    import argparse

    from pydantic import ValidationError

    from engine.cli.dry_run import _capability
    from engine.inputs import parse_device_capability
    from engine.policy_tests import CaseInput

    assert parse_device_capability(text) is None
    with pytest.raises(argparse.ArgumentTypeError):
        _capability(text)
    with pytest.raises(ValidationError):
        CaseInput(spec={}, device_capability=text)
