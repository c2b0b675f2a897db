"""`KVCacheGroups.count`: vLLM's number of KV cache groups, from one group per kind of layer or from vLLM's own.

The figure is held to vLLM's real grouping of every corpus config (0.28, 0.34; the hybrids on 0.30, 0.32,
0.33 too) by tests/conformance/test_model_configs.py.
"""

from __future__ import annotations

import pytest

from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

FULL, SLIDING, MAMBA = AttentionKind.full, AttentionKind.sliding_window, AttentionKind.mamba


def _groups(*kinds_layers: tuple[AttentionKind, int]) -> KVCacheGroups:
    return KVCacheGroups(groups=tuple(
        KVCacheGroup(spec=KVCacheSpec(kind=kind, num_layers=n, block_size=16, num_kv_heads=1, head_size=64))
        for kind, n in kinds_layers))


@pytest.mark.parametrize(
    ("kinds_layers", "count"),
    [
        pytest.param(((SLIDING, 52), (FULL, 10)), 7, id="gemma-3-27b-6-sliding-1-full"),
        pytest.param(((MAMBA, 28), (FULL, 4)), 8, id="jamba"),
        pytest.param(((SLIDING, 12), (FULL, 13)), 2, id="within-1.5x-the-largest-is-the-size"),
        pytest.param(((FULL, 32),), 1, id="one-kind"),
        # vLLM's own groups (the gate plugin's attn_groups): a kind repeats, nothing is split again
        pytest.param(((SLIDING, 2), (SLIDING, 1), (FULL, 2)), 3, id="already-vllms-groups"),
    ],
)
def test_group_count_is_vllms(kinds_layers: tuple[tuple[AttentionKind, int], ...], count: int) -> None:
    assert _groups(*kinds_layers).count == count
