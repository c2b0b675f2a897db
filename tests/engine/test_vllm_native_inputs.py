"""vLLM-native inputs (#15) and misuse of the decision API surfacing as our own errors (#16)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.policy.errors import PolicyError

SPEC = {"num_layers": 4, "num_kv_heads": 2, "head_size": 64}
MLA = {"kind": "mla", "num_layers": 4, "num_kv_heads": 1, "head_size": 576}


@pytest.mark.parametrize(("version", "inputs", "backend"), [
    # vllm/platforms/cuda.py _get_backend_priorities: SM90 FLASH_ATTN first; SM100 FLASHINFER first
    ("0.34.0", {"spec": SPEC}, "FLASH_ATTN"),
    ("0.34.0", {"spec": SPEC, "device_capability": 10}, "FLASHINFER"),
    ("0.28.0", {"spec": SPEC}, "FLASH_ATTN"),
    # FLASH_ATTN and FLASHINFER lack per-token-head dtypes: the next in line that has it
    ("0.34.0", {"spec": SPEC, "kv_cache_dtype": "fp8_per_token_head"}, "TRITON_ATTN"),
    # an MLA model gets an MLA backend (FLASH_ATTN_MLA is not modelled; FLASHMLA is next); SM120: TRITON_MLA
    ("0.34.0", {"spec": MLA}, "FLASHMLA"),
    ("0.34.0", {"spec": MLA, "device_capability": 12}, "TRITON_MLA"),
    ("0.28.0", {"spec": MLA}, "FLASHMLA"),
])
def test_no_backend_given_selects_what_vllm_selects(version: str, inputs: dict[str, Any], backend: str) -> None:
    assert LayoutEngine.default(version).decide(**inputs).context.backend.name == backend


@pytest.mark.parametrize("name", ["flash_attn", "Flash_Attn", "FLASH_ATTN"])
def test_backend_names_are_case_insensitive(name: str) -> None:
    assert LayoutEngine.default("0.34.0").decide(spec=SPEC, attention_backend=name).context.backend.name == \
        "FLASH_ATTN"


def test_kv_transfer_config_is_the_connector_and_its_members() -> None:
    ktc = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"block_size": 64}}]}}
    conn = LayoutEngine.default("0.34.0").decide(spec=SPEC, kv_transfer_config=ktc).context.connector
    assert conn is not None and conn.name == "MultiConnector"
    assert [m.name for m in conn.connectors] == ["NixlConnector", "OffloadingConnector"]
    assert conn.connectors[1].extra == {"block_size": 64}


@pytest.mark.parametrize(("version", "inputs", "where", "text"), [
    ("0.34.0", {"kv_transfer_config": {"kv_connector": "NixlConnector"}}, "kv_transfer_config.kv_role",
     "without a `kv_role`"),
    ("0.34.0", {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "both"}},
     "kv_transfer_config.kv_role", "unsupported kv_role"),
    # kv_ip is a 0.28 field that 0.34 dropped
    ("0.34.0", {"kv_transfer_config": {"kv_ip": "1.2.3.4"}}, "kv_transfer_config.kv_ip", "has no field `kv_ip`"),
    ("0.34.0", {"kv_transfer_config": {}, "connector": "NixlConnector"}, "kv_transfer_config", "`connector`"),
    ("0.34.0", {"kv_transfer_config": {}, "connector_config": {}}, "kv_transfer_config", "`connector_config`"),
    ("0.34.0", {"kv_transfer_config": ["x"]}, "kv_transfer_config", "must be a mapping"),
])
def test_kv_transfer_config_mistakes(version: str, inputs: dict[str, Any], where: str, text: str) -> None:
    with pytest.raises(PolicyError) as info:
        LayoutEngine.default(version).decide(spec=SPEC, **inputs)
    assert info.value.diagnostics[0].file == where
    assert text in info.value.diagnostics[0].message


def test_kv_transfer_config_accepts_the_releases_own_fields() -> None:
    ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_ip": "1.2.3.4", "kv_rank": 0}
    assert LayoutEngine.default("0.28.0").decide(spec=SPEC, kv_transfer_config=ktc).context.connector is not None


@pytest.mark.parametrize(("inputs", "where"), [
    ({"spec": SPEC, "connector": "OffloadingConnector", "connector_config": {"a": {1, 2}}}, "connector_config.a"),
    ({"spec": SPEC, "connector": "OffloadingConnector", "connector_config": {"a": b"x"}}, "connector_config.a"),
    ({"spec": SPEC, "connector": "OffloadingConnector", "connector_config": {1: 2}}, "connector_config"),
    ({"spec": SPEC, "connector": "MultiConnector", "connector_config": {"connectors": [
        {"kv_connector": "NixlConnector", "kv_connector_extra_config": []}]}},
     "connector_config.connectors[0].kv_connector_extra_config"),
    ({"model": "a\0b/config.json"}, "model"),
    ({"model": b"config.json"}, "model"),
    ({"spec": SPEC, "kv_cache_dtype": ["fp8"]}, "kv_cache_dtype"),
    ({"spec": SPEC, "kv_cache_dtype": ""}, "kv_cache_dtype"),
    ({"spec": SPEC, "block_size": 0}, "spec.block_size"),
])
def test_misuse_is_our_error_naming_the_argument(inputs: dict[str, Any], where: str) -> None:
    with pytest.raises(PolicyError) as info:
        LayoutEngine.default("0.34.0").decide(**inputs)
    assert info.value.diagnostics[0].file == where


def test_a_huge_model_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    with big.open("wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of NULs
    with pytest.raises(PolicyError) as info:
        LayoutEngine.default("0.34.0").decide(model=big)
    assert info.value.diagnostics[0].code == "too-large"


def test_a_context_of_another_release_is_refused() -> None:
    ctx = LayoutEngine.default("0.28.0").context(spec=SPEC)
    with pytest.raises(PolicyError) as info:
        LayoutEngine.default("0.34.0").decide(ctx)
    assert info.value.diagnostics[0].code == "profile-mismatch"
    assert LayoutEngine.default("0.28.0").decide(ctx).context is ctx
