"""What a ``--spec`` file's head fields mean for a Mamba group, said where one is missing.

kvpolicy describes every KV cache group with one spec shape. A Mamba group has no heads: vLLM's
``MambaSpec`` is a state of ``page_size_bytes`` per block, and the layout decision reads of it only
that it is Mamba (``groups.has_mamba``) and its page shape, ``(1, 1, page_size_bytes)``
(``KVCacheSpec.hnc_shape``). Its ``num_kv_heads`` and ``head_size`` only size that page
(``2 x block_size x num_kv_heads x head_size x`` the dtype's bytes), which ``page_size_padded`` sets
outright.
"""

from __future__ import annotations

from dataclasses import replace

from kvpolicy.policy.errors import Diagnostic

__all__ = ["MAMBA_HEADS", "mamba_help"]

MAMBA_HEADS = ("a Mamba group has no heads: kvpolicy reads only its page size (vLLM's MambaSpec.page_size_bytes), "
               "computed as 2 x block_size x num_kv_heads x head_size x the dtype's bytes, or given by "
               "page_size_padded; e.g. `num_kv_heads: 1, head_size: 64, page_size_padded: <vLLM's page bytes>`")


def mamba_help(diag: Diagnostic) -> Diagnostic:
    """``diag`` with `MAMBA_HEADS` as its help when it is about a missing head field of a Mamba group."""
    if diag.code == "missing-key" and ("`num_kv_heads`" in diag.message or "`head_size`" in diag.message):
        return replace(diag, help=MAMBA_HEADS)
    return diag
