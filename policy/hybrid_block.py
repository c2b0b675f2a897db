"""The attention block size vLLM gives a hybrid attention + Mamba model, and its padded Mamba page.

vLLM allocates every layer's pages from one pool, so an attention page must hold a whole Mamba
state. After the workers load the model, the executor calls the platform's
``update_block_size_for_backend`` (``vllm/platforms/interface.py``, 0.24-0.34): for a hybrid
model its ``_align_hybrid_block_size`` raises the attention block size, even past an explicit
``--block-size``, to the smallest multiple of the kernel block whose page holds the state, then
pads the Mamba page to that attention page (``mamba_page_size_padded``). Worked example, Jamba-v0.1
on one rank, bfloat16 (attention page 2 x 8 heads x 128 x 2 B = 4096 B a token, Mamba state
311296 B, `kvpolicy.policy.hf_mamba_state`)::

    kernel block  = max(16, block_size)              # vLLM 0.34's default 64 -> 64; --block-size 16 -> 16
    tokens needed = cdiv(311296, 4096)               = 76
    block_size    = kernel * cdiv(76, kernel)        # 64 -> 128; 16 -> 80
    Mamba page    = block_size * 4096                # 128 -> 524288 B, padded from 311296

The kernel block is the attention backend's smallest kernel block size (16 for CUDA's
TRITON_ATTN, FLASH_ATTN and FLASHINFER: ``MultipleOf(16)`` or 16 first) or the block size when
larger; for an MLA model vLLM makes it at least 128 (the TRTLLM/FlashInfer MLA decode kernels).
The facts that differ per release are in the release profiles: the default block size
(``default_block_size``: 16 until 0.33, 64 in 0.34), which the caller passes in, and from 0.32 a
rounding of the result up to a multiple of every backend's kernel block (``hybrid_block_rounded``;
it changes only a block size that is not a multiple of 16: ``--block-size 24`` on Granite-4.0-H
gives 408 on 0.28, 416 on 0.32-0.34). The arithmetic
is held to each release's own ``update_block_size_for_backend`` by
``tests/conformance/test_model_configs.py`` (every hybrid config of the corpus, at the release's
default block size and at an explicit one).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import ValidationError

from kvpolicy.policy.hf_mamba_state import mamba_state
from kvpolicy.policy.hf_reader import ConfigReader
from kvpolicy.policy.quant import ModelDtype
from kvpolicy.policy.spec import MAX_BLOCK_SIZE, AttentionKind, KVCacheSpec

__all__ = ["KERNEL_BLOCK", "MLA_KERNEL_BLOCK", "HybridBlock", "align_hybrid_block", "hybrid_block_size"]

KERNEL_BLOCK = 16  # the smallest kernel block of vLLM's CUDA attention backends kvpolicy decides for
MLA_KERNEL_BLOCK = 128  # _align_hybrid_block_size's floor for hybrid MLA models


class HybridBlock(NamedTuple):
    """What vLLM makes of a hybrid model's block size: the attention block size, the Mamba state's own
    bytes and the page every layer then has (the attention page; the Mamba page padded to it)."""

    block_size: int
    mamba_state_bytes: int
    page_size_bytes: int

    def raised(self, asked: int) -> bool:
        return self.block_size != asked


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align_hybrid_block(block_size: int, attention_page_per_token: int, mamba_state_bytes: int,
                       mla: bool = False, rounded: bool = False) -> HybridBlock:
    """The attention block size vLLM's ``_align_hybrid_block_size`` sets, from the block size it starts
    from (the operator's, else the release default), one token's attention page (backend packing
    included) and one Mamba state's bytes; ``rounded`` (the profile's `hybrid_block_rounded`, 0.32 on):
    then up to a multiple of the kernel block, which matters only for a block size that is not one."""
    kernel = max(KERNEL_BLOCK, block_size)
    if mla:
        kernel = max(kernel, MLA_KERNEL_BLOCK)
    needed = kernel * _cdiv(mamba_state_bytes, kernel * attention_page_per_token)
    if rounded:
        needed = KERNEL_BLOCK * _cdiv(needed, KERNEL_BLOCK)
    aligned = max(block_size, needed)
    return HybridBlock(aligned, mamba_state_bytes, aligned * attention_page_per_token)


def hybrid_block_size(r: ConfigReader, kind: AttentionKind, geometry: tuple[int, int], asked: int,
                      dtype: ModelDtype, kv_cache_dtype: str, tp: int, rounded: bool = False) -> HybridBlock | None:
    """For an attention + Mamba model read by ``r`` (attention ``kind``, (KV heads per rank, head size)
    ``geometry``), the block size vLLM raises ``asked`` to so that a page holds a Mamba state, with a note
    in ``r`` when it differs; None where kvpolicy cannot size the state (a note says what that leaves out)."""
    release = f"vLLM {'.'.join(map(str, r.release))}" if r.release else "vLLM"
    state = mamba_state(r, tp)
    if state is None:
        r.warn("hybrid-block-not-aligned", f"{release} raises a hybrid model's attention block size until one page "
               f"holds a Mamba state, but kvpolicy does not size the state of `{r.model_type}` (or the config "
               f"lacks a field it needs): the block size stays {asked}, and pages may be smaller than vLLM's",
               "give the groups in a --spec file with the block size vLLM logs (\"Setting attention block size "
               "to N tokens\")")
        return None
    kv_heads, head_size = geometry
    try:
        per_token = KVCacheSpec(kind=kind, num_layers=1, block_size=1, num_kv_heads=kv_heads, head_size=head_size,
                                dtype=dtype, kv_cache_dtype=kv_cache_dtype).page_size_bytes
    except ValidationError:
        return None  # the attention spec itself is invalid: the caller's build reports it
    aligned = align_hybrid_block(asked, per_token, state.page_size_bytes(dtype.size_bytes),
                                 mla=kind is AttentionKind.mla, rounded=rounded)
    if aligned.block_size > MAX_BLOCK_SIZE:
        r.error("invalid-spec", f"{release} would raise the attention block size to {aligned.block_size} tokens for "
                f"this hybrid model's Mamba state ({aligned.mamba_state_bytes} B), over kvpolicy's bound of "
                f"{MAX_BLOCK_SIZE}", "check the config's Mamba fields (state size, heads, expand)")
        r.fail_if_any()
    if aligned.raised(asked):
        r.warn("hybrid-block-size", f"{release} aligns the attention block size to {aligned.block_size} for the Mamba "
               f"state page: one {state.family} state is {aligned.mamba_state_bytes} B, one token of attention page "
               f"{per_token} B, so a page of {aligned.block_size} tokens ({aligned.page_size_bytes} B) is the "
               f"smallest multiple of the kernel block ({max(KERNEL_BLOCK, asked)}) that holds it"
               + (f", rounded up to a multiple of {KERNEL_BLOCK}" if rounded and asked % KERNEL_BLOCK else "")
               + "; the block size "
               f"asked for was {asked}. The Mamba page is padded to {aligned.page_size_bytes} B",
               "nothing to do: vLLM raises it even past an explicit --block-size; pass a block size of "
               f"{aligned.block_size} to silence this note")
    return aligned
