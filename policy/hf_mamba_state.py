"""The bytes of one layer's Mamba state, sized from a Hugging Face config as vLLM sizes it.

vLLM keeps one state per sequence for each Mamba (or linear-attention) layer: a convolution
state and a recurrent (SSM) state, whose shapes each model class gives
(``get_mamba_state_shape_from_config``, built by ``MambaStateShapeCalculator`` in
``vllm/model_executor/layers/mamba/mamba_utils.py``, 0.24-0.34 alike for these model types).
The page of a ``MambaSpec`` is the sum of the two states' bytes. Hybrid models need it because
vLLM raises the attention block size until an attention page holds one state
(`kvpolicy.policy.hybrid_block`). Worked example, Jamba-v0.1 (Mamba-1, hidden 4096,
``mamba_expand`` 2, ``mamba_d_conv`` 4, ``mamba_d_state`` 16), bfloat16, one rank::

    intermediate = 2 * 4096 = 8192
    conv state   = (d_conv - 1) x intermediate = 3 x 8192   = 24576 values
    ssm state    = intermediate x d_state      = 8192 x 16  = 131072 values
    page         = (24576 + 131072) x 2 B                   = 311296 B

Mamba-2 (Granite-4.0-H, Nemotron-H, Falcon-H1, Zamba2) adds the B/C groups to the convolution
(``conv_dim = intermediate + 2 * n_groups * d_state``; groups that do not divide by the
tensor-parallel size are replicated up to it) and keeps ``heads x head_dim x d_state``; Gated
DeltaNet (Qwen3-Next) keeps ``(conv_kernel - 1) x (2 * k_heads * k_dim + v_heads * v_dim)`` and
``v_heads x v_dim x k_dim``. Both states are in the model dtype: vLLM's ``--mamba-cache-dtype``
and ``--mamba-ssm-cache-dtype`` default to ``auto`` (and kvpolicy's serve-line reading does not
take them). A model type not listed here answers None: the caller says what that leaves out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvpolicy.policy.hf_reader import ConfigReader

__all__ = ["MambaState", "mamba_state"]


class MambaState(NamedTuple):
    """One layer's state: the values of each part (convolution, recurrent), per tensor-parallel rank."""

    family: str  # vLLM's calculator: mamba1, mamba2, gated_delta_net
    conv_values: int
    ssm_values: int
    ssm_dtype_bytes: int | None = None  # None: the model dtype's

    def page_size_bytes(self, dtype_bytes: int) -> int:
        """``MambaSpec.page_size_bytes``: both states, the convolution in a dtype of ``dtype_bytes`` (the
        model's), the recurrent state in its own where the model type fixes one."""
        return self.conv_values * dtype_bytes + self.ssm_values * (self.ssm_dtype_bytes or dtype_bytes)


def _ints(r: ConfigReader, keys: tuple[str, ...]) -> list[int] | None:
    """The fields as positive integers; None (nothing recorded) where one is absent or not one."""
    values = [r.get(k) for k in keys]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    return values


def _split(total: int, tp: int) -> int | None:
    """vLLM's ``divide``: exact, or None where vLLM would refuse to shard."""
    return total // tp if total % tp == 0 else None


def _mamba1(r: ConfigReader, tp: int) -> MambaState | None:
    got = _ints(r, ("hidden_size", "mamba_expand", "mamba_d_state", "mamba_d_conv"))
    if got is None:
        return None
    hidden, expand, d_state, d_conv = got
    inner = _split(expand * hidden, tp)
    return None if inner is None else MambaState("mamba1", (d_conv - 1) * inner, inner * d_state)


def _mamba2(intermediate: int, groups: int, heads: int, head_dim: int, d_state: int, d_conv: int,
            tp: int) -> MambaState | None:
    groups += 0 if groups % tp == 0 else tp - groups  # extra_groups_for_head_shards
    conv_dim, local_heads = _split(intermediate + 2 * groups * d_state, tp), _split(heads, tp)
    if conv_dim is None or local_heads is None:
        return None
    return MambaState("mamba2", (d_conv - 1) * conv_dim, local_heads * head_dim * d_state)


def _head_dim(r: ConfigReader, key: str, inner: int, heads: int) -> int | None:
    """A Mamba-2 head dim: the field, or where absent (or ``"auto"``) what the config class computes from the
    inner width (``inner // heads``, transformers' ``mamba_d_head="auto"``, Zamba2's ``mamba_headdim``)."""
    value = r.get(key)
    if value is None or value == "auto":
        return inner // heads
    got = _ints(r, (key,))
    return None if got is None else got[0]


def _mamba2_fields(keys: tuple[str, str, str, str, str]) -> Callable[[ConfigReader, int], MambaState | None]:
    """A Mamba-2 reader over the model type's own names of (groups, heads, head dim, state, kernel); the inner
    width is ``mamba_expand * hidden_size`` (Falcon-H1: ``mamba_d_ssm`` where set)."""
    groups_key, heads_key, head_dim_key, state_key, kernel_key = keys

    def read(r: ConfigReader, tp: int) -> MambaState | None:
        got = _ints(r, (groups_key, heads_key, state_key, kernel_key, "hidden_size", "mamba_expand"))
        if got is None:
            return None
        groups, heads, d_state, d_conv, hidden, expand = got
        inner = expand * hidden
        if r.model_type == "falcon_h1" and r.get("mamba_d_ssm") is not None:
            d_ssm = _ints(r, ("mamba_d_ssm",))
            if d_ssm is None:
                return None
            inner = d_ssm[0]
        head_dim = _head_dim(r, head_dim_key, inner, heads)
        return None if head_dim is None else _mamba2(inner, groups, heads, head_dim, d_state, d_conv, tp)

    return read


def _nemotron_h(r: ConfigReader, tp: int) -> MambaState | None:
    """NemotronH: the heads span the inner width; the recurrent state in its own dtype."""
    got = _ints(r, ("n_groups", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "conv_kernel"))
    if got is None:
        return None
    groups, heads, head_dim, d_state, d_conv = got
    state = _mamba2(heads * head_dim, groups, heads, head_dim, d_state, d_conv, tp)
    return None if state is None else state._replace(ssm_dtype_bytes=_nemotron_ssm_dtype_bytes(r))


def _nemotron_ssm_dtype_bytes(r: ConfigReader) -> int | None:
    """NemotronH's recurrent state dtype: vLLM's ``NemotronHForCausalLMConfig`` turns ``--mamba-ssm-cache-dtype
    auto`` into the config's ``mamba_ssm_cache_dtype``, else float32 (0.24-0.34 alike)."""
    named = r.top.get("mamba_ssm_cache_dtype", "float32")
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(named) if isinstance(named, str) else None


def _gated_delta_net(r: ConfigReader, tp: int) -> MambaState | None:
    got = _ints(r, ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim"))
    if got is None:
        return None
    k_heads, v_heads, k_dim, v_dim, kernel = got
    conv_dim, local_v = _split(2 * k_heads * k_dim + v_heads * v_dim, tp), _split(v_heads, tp)
    if conv_dim is None or local_v is None:
        return None
    return MambaState("gated_delta_net", (kernel - 1) * conv_dim, local_v * v_dim * k_dim)


_GRANITE_KEYS = ("mamba_n_groups", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_d_conv")
# model_type -> its class's get_mamba_state_shape_from_config, by the fields that class reads
_READERS: dict[str, Callable[[ConfigReader, int], MambaState | None]] = {
    "jamba": _mamba1,
    "granitemoehybrid": _mamba2_fields(_GRANITE_KEYS),
    "bamba": _mamba2_fields(_GRANITE_KEYS),
    "falcon_h1": _mamba2_fields(_GRANITE_KEYS),
    "zamba2": _mamba2_fields(("mamba_ngroups", "n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_d_conv")),
    "nemotron_h": _nemotron_h,
    "qwen3_next": _gated_delta_net,
}


def mamba_state(r: ConfigReader, tensor_parallel_size: int) -> MambaState | None:
    """One Mamba layer's state on one rank, as the model type's vLLM class sizes it; None for a model type
    kvpolicy does not size, or a config missing a field the size needs (or one vLLM cannot shard)."""
    reader = _READERS.get(r.model_type or "")
    return None if reader is None else reader(r, tensor_parallel_size)
