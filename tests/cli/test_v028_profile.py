"""The `vllm-0.28` profile from the command line and the library: its shipped policy tests pass with
full rule coverage, and a dry-run decides and plans in it (the release itself is checked by
tests/conformance/test_gate_*.py)."""

from __future__ import annotations

import json

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.cli.main import main
from kvpolicy.engine.plan import plan_layout
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile


def test_shipped_v028_policy_tests_pass_with_full_coverage(capsys) -> None:
    code = main(["test", "--vllm-version", "0.28.0", "--require-coverage"])
    out = capsys.readouterr().out
    assert code == 0, out
    rules = len(LayoutEngine.default("0.28.0").ruleset.rules)
    assert f"coverage: {rules}/{rules} rules matched by some case" in out


def test_dry_run_decides_and_plans_in_v028(capsys) -> None:
    code = main(["dry-run", "--vllm-version", "0.28.0", "--kv-cache-dtype", "fp8", "--num-blocks", "8",
                 "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["layout"] == {"placement": "cross_layer", "head_order": "HND", "name": "BHLNC"}
    assert data["plan"]["num_buffers"] == 1 and data["plan"]["physical_shape"] == [8, 2, 24, 16, 2, 64]


def test_profile_layouts_per_backend() -> None:
    profile = get_profile("0.28.0")
    layouts = {name: profile.backend(name).layouts for name in profile.backends}
    four = (Layout.LBHNC, Layout.LBNHC, Layout.BLNHC, Layout.BHLNC)
    assert layouts["TRITON_ATTN"] == layouts["FLASH_ATTN"] == layouts["FLASHINFER"] == four
    assert layouts["FLEX_ATTENTION"] == layouts["FLASHMLA"] == (Layout.LBNHC, Layout.BLNHC)
    assert layouts["CPU_ATTN"] == (Layout.LBHNC,)
    assert not profile.backend("CPU_ATTN").indexes_kv_by_block_stride
    assert profile.backend("FLASHMLA").indexes_kv_by_block_stride


def test_per_layer_plans_one_buffer_per_layer_and_cross_layer_one() -> None:
    engine = LayoutEngine.default("0.28.0")
    ctx = engine.context(spec={"num_layers": 3, "num_kv_heads": 2, "head_size": 64}, connector="OffloadingConnector")
    per = plan_layout(Layout.LBHNC, ctx.kv, ctx.backend, 4)
    cross = plan_layout(Layout.BHLNC, ctx.kv, ctx.backend, 4)
    assert len(per.buffers) == 3 and len(cross.buffers) == 1
    assert per.total_bytes == cross.total_bytes == 3 * 4 * ctx.kv.page_size_bytes
