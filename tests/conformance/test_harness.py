"""Smoke tests of the conformance harness itself: the installer's cache and both oracles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import install_vllm
from vllm_release import run_oracle

INSTALLER = Path(__file__).resolve().parent / "install_vllm.py"


def test_installer_reuses_the_cache(vllm_sites):
    for version, site in vllm_sites.items():
        assert (site.parent / "COMPLETE").is_file()
        assert install_vllm.site_for(version) == site
        assert not (site / "torch").exists(), "the site must use the project's torch"
        assert (site / "vllm").is_dir()
    proc = subprocess.run(
        [sys.executable, str(INSTALLER), *vllm_sites],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(vllm_sites)
    assert all(line.endswith("(cached)") for line in lines), lines


def test_site_for_refuses_an_unknown_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOLICY_VLLM_CACHE", str(tmp_path))
    (tmp_path / "0.34.0" / "site").mkdir(parents=True)  # no COMPLETE: a killed install
    try:
        install_vllm.site_for("0.34.0")
    except install_vllm.InstallError as exc:
        assert "not installed" in str(exc)
    else:
        raise AssertionError("site_for accepted an install without COMPLETE")


def test_v034_oracle_facts_and_a_decision(vllm_sites):
    facts, decision, rejected = run_oracle(
        "0.34.0",
        "v034",
        [
            {"facts": True},
            {
                "workers": [["FLASH_ATTN"]],
                "device_capability": [9, 0],
                "specs": [{"kind": "full", "num_kv_heads": 8, "head_size": 128, "block_size": 16}],
                "VLLM_KV_CACHE_LAYOUT": None,
                "kv_transfer_config": None,
            },
            {
                "workers": [["FLEX_ATTENTION"]],
                "device_capability": [9, 0],
                "specs": [{"kind": "full"}],
                "VLLM_KV_CACHE_LAYOUT": "HND",
                "kv_transfer_config": None,
            },
        ],
    )
    assert facts["version"] == "0.34.0"
    assert set(facts["layouts"]) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert "fp8_per_token_head" in facts["kv_cache_dtypes"]
    assert facts["connectors"]["OffloadingConnector"]["get_required_kvcache_layout"]["default"] == "LBHNC"
    assert decision["layout"] in facts["layouts"]
    assert rejected["error"].startswith("ValueError: VLLM_KV_CACHE_LAYOUT=HND")


def test_v034_oracle_geometry_places_per_token_head_scales(vllm_sites):
    (geo,) = run_oracle(
        "0.34.0",
        "v034",
        [
            {
                "backend": "TRITON_ATTN",
                "kv_cache_dtype": "fp8_per_token_head",
                "layout": "BLHNC",
                "num_layers": 3,
                "num_blocks": 5,
                "num_kv_heads": 2,
                "head_size": 64,
                "block_size": 16,
                "dtype": "bfloat16",
            }
        ],
    )
    assert geo["spec"]["page_size_bytes"] == 2 * 16 * 2 * (64 + 4) == 4352
    offsets = [layer["byte_offset"] for layer in geo["layers"]]
    assert offsets == [0, 4352, 8704]
    assert all(layer["byte_strides"][0] == 3 * 4352 for layer in geo["layers"])
    assert geo["layers"][0]["k_scale_byte_offset_in_cell"] == 64


def test_v028_oracle_facts(vllm_sites):
    (facts,) = run_oracle("0.28.0", "v028", [{"facts": True}])
    assert facts["vllm_version"] == "0.28.0"
    triton = facts["backends"]["TRITON_ATTN"]["by_layout"]
    assert triton["HND"]["stride_order_with_layers"] == [1, 2, 0, 3, 4]
    assert triton["NHD"]["stride_order_with_layers"] == [1, 0, 3, 2, 4]
