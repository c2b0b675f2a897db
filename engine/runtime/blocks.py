"""`OffloadedBlocks`: block bytes bound to the layout that gives them a meaning.

Today's KV stores and transfer peers move blocks as bare bytes, and a block of
one layout read under another is garbage without a word (vLLM issue #48412's
class of bug). `KVCache.offload` therefore returns the bytes together with the
writer's `LayoutFingerprint` and `BlockFormat`, and `KVCache.restore` compares
them with its own before it writes a byte (`kvpolicy.engine.exchange`): as is,
transcoded, or refused. Ship ``.data`` and ``fingerprint.to_json()`` together;
the receiver binds them again with `OffloadedBlocks.received`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy.engine.block_format import BlockFormat, block_format, plan_of
from kvpolicy.engine.fingerprint import LayoutFingerprint
from kvpolicy.engine.peer_data import check_peer_value, load_peer_json
from kvpolicy.policy.errors import input_error

__all__ = ["FingerprintLike", "OffloadedBlocks", "as_fingerprint"]

FingerprintLike = LayoutFingerprint | dict[str, Any] | str | bytes


@dataclass(frozen=True, eq=False)
class OffloadedBlocks:
    """Blocks copied out of a cache: ``data`` (n, L, page_bytes) uint8 on the CPU, as `offload` filled it
    (its ``out`` when given), the writer's ``fingerprint``, and its ``format``: where each cell sits in a
    row of ``data``. No copy: ``data`` is the tensor offload wrote."""

    data: torch.Tensor
    fingerprint: LayoutFingerprint
    format: BlockFormat

    @classmethod
    def received(cls, data: torch.Tensor, fingerprint: FingerprintLike) -> OffloadedBlocks:
        """Bind bytes from a peer or a store to the writer's fingerprint (the object, its dict or JSON);
        the format is recovered from the fingerprint (`kvpolicy.engine.block_format.plan_of`)."""
        fp = as_fingerprint(fingerprint, "fingerprint")
        return cls(data, fp, block_format(plan_of(fp)))

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __len__(self) -> int:
        return self.num_blocks

    def __repr__(self) -> str:
        fp = self.fingerprint
        return (f"OffloadedBlocks({self.num_blocks} blocks of {self.format.row_bytes} bytes, {fp.layout}, "
                f"{fp.kv_cache_dtype}, {fp.digest[:19]})")


def as_fingerprint(value: object, where: str) -> LayoutFingerprint:
    """A `LayoutFingerprint` from the object, its dict or its JSON (a peer's: bounded before it is trusted)."""
    if isinstance(value, LayoutFingerprint):
        return value
    if isinstance(value, (str, bytes)):
        value = load_peer_json(value, where)
    elif isinstance(value, dict):
        check_peer_value(value, where)
    if not isinstance(value, dict):
        raise input_error(where, f"`{where}` must be a LayoutFingerprint, its dict or its JSON, got "
                          f"`{type(value).__name__}`", "pass the writer's `cache.fingerprint` (or `.to_json()`)")
    return LayoutFingerprint.from_dict(value)
