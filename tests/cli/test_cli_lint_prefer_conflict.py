"""A conflict a `prefer` rule takes part in is said as what it is: a prefer removes no candidate; it changes a
connector member's best layout, and MultiConnector's members that no longer agree leave no layout."""

from __future__ import annotations

from pathlib import Path

from cli_capture import cli

GLOBAL = """version: 1
rules:
  - id: site-prefer-hnd-for-fp8
    description: fp8 caches read faster head-major on our kernels
    when: {field: kv.kv_cache_dtype, in: [fp8, fp8_e4m3]}
    prefer: {head_order: HND}
    weight: 5
waivers:
  - rule: offloading-requires-lbhnc
    owner: kv-team@example.com
    reason: our offload readers expect NHD pages
    expires: 2027-01-31
    when: {field: kv.kv_cache_dtype, eq: fp8}
"""
OFFLOAD = """version: 1
connector: OffloadingConnector
rules:
  - id: site-offload-per-layer
    description: offload host copies per layer
    prefer: {placement: per_layer}
    weight: 2
"""


def test_a_conflict_a_prefer_takes_part_in_does_not_say_it_removes_candidates(capsys, tmp_path: Path) -> None:
    (tmp_path / "site" / "connectors").mkdir(parents=True)
    (tmp_path / "site" / "global.yaml").write_text(GLOBAL)
    (tmp_path / "site" / "connectors" / "OffloadingConnector.yaml").write_text(OFFLOAD)
    code, out, err = cli(capsys, "lint", str(tmp_path / "site"), "--vllm-version", "0.34.0", "--today", "2027-01-01")
    assert code == 1, err
    lines = [x for x in out.splitlines() if "error[conflict]" in x]
    assert {rule for rule in ("site-prefer-hnd-for-fp8", "site-offload-per-layer")
            if any(f"`{rule}`" in x for x in lines)} == {"site-prefer-hnd-for-fp8", "site-offload-per-layer"}
    for rule in ("site-prefer-hnd-for-fp8", "site-offload-per-layer"):
        line = next(x for x in lines if f"`{rule}`" in x)
        assert f"`{rule}` removes candidates" not in line
        assert f"where `{rule}` (prefer) changes a connector member's best layout, so the members no longer agree" \
            in line
