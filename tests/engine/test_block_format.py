"""kvpolicy.engine.block_format: where each cell sits in a block row, and the plan behind a peer's fingerprint."""

from __future__ import annotations

import pytest

from kvpolicy.engine.block_format import block_format, cell_format, descriptors_per_block, plan_of
from kvpolicy.engine.exchange import ExchangeKind, compare_blocks
from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint_of
from kvpolicy.engine.plan import plan_layout
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile, profile_names
from kvpolicy.policy.spec import AttentionKind, KVCacheSpec

QWEN4 = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def plan(profile: str, layout: Layout, backend: str = "TRITON_ATTN", num_blocks: int = 3, **fields: object):
    spec = KVCacheSpec(**{**QWEN4, **fields})
    return plan_layout(layout, spec, get_profile(profile).backend(backend), num_blocks)


def test_the_worked_example_of_the_module_docstring() -> None:
    old = block_format(plan("issue-48412", Layout.BLNHC))
    new = block_format(plan("vllm-0.34", Layout.LBHNC))
    assert (old.cell_bytes, old.page_bytes, old.row_bytes) == (128, 8192, 4 * 8192) == (
        new.cell_bytes, new.page_bytes, new.row_bytes)
    assert old.cell_strides == (8192, 4096, 256, 128)
    assert new.cell_strides == (8192, 128, 256, 4096)
    assert old.padding_bytes == new.padding_bytes == 0


@pytest.mark.parametrize("layout", [Layout.LBNHC, Layout.BLNHC, Layout.LBHNC, Layout.BHLNC])
def test_every_cell_is_where_the_plan_puts_it(layout: Layout) -> None:
    """A cell's row offset is its address in the cache, relative to its block's rows (the plan's
    `cell_offset`, held to vLLM's own views by the conformance tests)."""
    p = plan("vllm-0.28", layout, kv_cache_dtype="int8_per_token_head")
    fmt = block_format(p)
    block = 2
    for layer in range(p.num_layers):
        for kv in range(2):
            for token in (0, 7, 15):
                for head in range(2):
                    _, addr = p.cell_offset(layer, kv, block, token, head)
                    base = p.block_row_offset(layer)
                    _, block_addr = p.cell_offset(layer, 0, block, 0, 0)
                    assert fmt.cell_offset(layer, kv, token, head) == base + addr - block_addr


def test_padding_and_descriptors() -> None:
    padded = plan("vllm-0.34", Layout.BLNHC, page_size_padded=8192 + 64)
    fmt = block_format(padded)
    assert fmt.page_bytes == 8256 and fmt.padding_bytes == 4 * 64
    assert descriptors_per_block(padded) == 1
    assert descriptors_per_block(plan("vllm-0.34", Layout.LBHNC)) == 4  # one per layer
    assert descriptors_per_block(plan("vllm-0.28", Layout.LBHNC)) == 4  # a buffer per layer


def test_a_layout_without_transfers_has_no_block_format() -> None:
    with pytest.raises(InputError) as info:
        block_format(plan("vllm-0.34", Layout.LHBNC))
    assert info.value.diagnostics[0].code == "transfer-geometry"


def test_a_dim_of_one_has_stride_zero_so_equal_rows_have_equal_formats() -> None:
    mla = {"kind": AttentionKind.mla, "num_kv_heads": 1, "head_size": 576, "num_layers": 2}
    a = block_format(plan("issue-48412", Layout.LBNHC, "FLASHMLA", **mla))
    b = block_format(plan("vllm-0.28", Layout.LBNHC, "FLASHMLA", **mla))
    assert a == b and a.kv_stride == a.head_stride == 0


def _every_fingerprint() -> list[tuple[str, LayoutFingerprint]]:
    out = []
    for name in profile_names():
        profile = get_profile(name)
        for backend in profile.backend_names():
            b = profile.backend(backend)
            for dtype in ("auto", "fp8_per_token_head"):
                declared = profile.backends[backend].kv_cache_dtypes
                if dtype != "auto" and (declared is None or dtype not in declared):
                    continue
                mla = {"kind": AttentionKind.mla, "num_kv_heads": 1} if b.mla else {}
                spec = KVCacheSpec(**{**QWEN4, "kv_cache_dtype": dtype, **mla})
                for layout in b.layouts:
                    if layout in profile.layouts:
                        out.append((f"{name}/{backend}/{layout}/{dtype}", fingerprint_of(layout, spec, b)))
    return out


def test_the_plan_behind_every_profiled_fingerprint_is_recovered() -> None:
    """What a peer that received only the writer's fingerprint restores with: the same block format."""
    cases = _every_fingerprint()
    assert len(cases) > 300
    for where, fp in cases:
        recovered = plan_of(LayoutFingerprint.from_json(fp.to_json()))
        assert fingerprint_of(recovered.layout, recovered.spec, recovered.backend) == fp, where
        original = plan_layout(fp.layout, recovered.spec, recovered.backend, 5)
        if original.transfer:
            assert block_format(recovered) == block_format(original), where


def test_a_fingerprint_no_profile_lays_out_is_refused_by_name() -> None:
    fp = fingerprint_of(Layout.LBNHC, KVCacheSpec(**QWEN4), get_profile("vllm-0.34").backend("TRITON_ATTN"))
    data = fp.to_dict()
    data["backend"] = "NEW_BACKEND"
    with pytest.raises(InputError) as info:
        plan_of(LayoutFingerprint.from_dict(data))
    assert info.value.diagnostics[0].code == "unknown-block-format"


def test_cell_format_leaves_out_where_cells_sit_and_page_padding() -> None:
    a = fingerprint_of(Layout.BLNHC, KVCacheSpec(**QWEN4), get_profile("issue-48412").backend("TRITON_ATTN"))
    b = fingerprint_of(Layout.LBHNC, KVCacheSpec(**QWEN4, page_size_padded=8192 + 128),
                       get_profile("vllm-0.34").backend("TRITON_ATTN"))
    assert cell_format(a) == cell_format(b)
    assert compare_blocks(a, b).kind is ExchangeKind.transcode
    assert compare_blocks(a, a).kind is ExchangeKind.as_is
