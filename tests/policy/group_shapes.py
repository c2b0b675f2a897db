"""The shape of KV cache groups, as the model-config tests compare them."""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.policy.spec import AttentionKind, KVCacheGroups


@dataclass(frozen=True)
class G:
    """The expected shape of one KV cache group."""

    kind: AttentionKind
    layers: int
    heads: int
    head_size: int
    window: int | None = None


def shape(groups: KVCacheGroups) -> list[G]:
    """Each group's kind, layer count, KV heads, head size and window, in group order."""
    return [G(g.spec.kind, g.spec.num_layers, g.spec.num_kv_heads, g.spec.head_size, g.spec.sliding_window)
            for g in groups.groups]
