"""`kvpolicy dry-run` with no arguments answers what vLLM 0.34.0 resolves for the same deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_release import run_oracle

ROOT = Path(__file__).resolve().parents[2]


def test_default_dry_run_is_vllm_034s_layout(vllm_sites):
    env = {k: v for k, v in os.environ.items() if k != "KVPOLICY_VLLM_VERSION"}  # the default profile
    proc = subprocess.run([sys.executable, "-m", "kvpolicy.engine.cli.main", "dry-run", "--format", "json"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ours = json.loads(proc.stdout)
    inputs = ours["inputs"]
    kv = inputs["kv"]
    assert inputs["profile"] == "vllm-0.34"
    (theirs,) = run_oracle("0.34.0", "v034", [{
        "workers": [[inputs["backend"]["name"]]],
        "device_capability": None,
        "specs": [{"kind": kv["kind"], "num_kv_heads": kv["num_kv_heads"], "head_size": kv["head_size"],
                   "block_size": kv["block_size"], "kv_cache_dtype": kv["kv_cache_dtype"], "dtype": kv["dtype"]}],
        "VLLM_KV_CACHE_LAYOUT": None,
        "kv_transfer_config": {"kv_connector": inputs["connector"]["name"], "kv_role": "kv_both"},
    }])
    assert "error" not in theirs, theirs
    assert (kv["block_size"], kv["kv_cache_dtype"], inputs["backend"]["name"], inputs["connector"]["name"]) == (
        64, "fp8_per_token_head", "TRITON_ATTN", "OffloadingConnector")
    assert ours["layout"]["name"] == theirs["layout"] == "LBHNC"
