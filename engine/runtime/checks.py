"""Input checks for the runtime: every argument is validated before any byte of the cache is touched.

Each failure is an `InputError` naming the argument, in the project's
message style (lowercase, user input in backticks, a help line).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpolicy.policy.errors import input_error

__all__ = ["check_block_ids", "check_device", "check_layer", "check_slots", "check_slots_on_device", "check_values"]

VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_SMALL = 64  # up to this many slots are checked in Python: cheaper than four tensor ops


def check_device(device: torch.device, what: str) -> None:
    """Reads and writes need data: a meta cache only has geometry."""
    if device.type == "meta":
        raise input_error("device", f"cannot {what} a cache on the `meta` device: it holds no data",
                          "allocate on `cpu` or `cuda` to write and read")


def check_layer(layer: object, num_layers: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise input_error("layer", f"layer `{layer!r}` is out of range", f"use 0..{num_layers - 1}")
    return layer


def check_values(
    name: str, t: object, shape: tuple[int, ...], device: torch.device, like: torch.Tensor | None = None,
    dims: str = "(tokens, heads, head_size)",
) -> torch.Tensor:
    """``t`` is a bf16/fp16/fp32 tensor of ``shape`` (named by ``dims``) on ``device``, of ``like``'s dtype if given."""
    if not isinstance(t, torch.Tensor):
        raise input_error(name, f"`{name}` must be a torch.Tensor, got `{type(t).__name__}`")
    if t.dtype not in VALUE_DTYPES:
        raise input_error(name, f"`{name}` has dtype `{t.dtype}`", "pass bfloat16, float16 or float32 values")
    if tuple(t.shape) != shape:
        raise input_error(name, f"`{name}` has shape `{tuple(t.shape)}`, expected `{shape}` {dims}")
    if t.device != device:
        raise input_error(name, f"`{name}` is on `{t.device}` but the cache is on `{device}`",
                          "move it to the cache's device first")
    if like is not None and t.dtype != like.dtype:
        raise input_error(name, f"`{name}` has dtype `{t.dtype}` but the key has `{like.dtype}`")
    return t


def _slot_tensor(slot_mapping: object, num_tokens: int | None, device: torch.device) -> torch.Tensor:
    """The checks that need no data: a 1-D int32/int64 tensor of ``num_tokens`` slots on ``device``."""
    if not isinstance(slot_mapping, torch.Tensor):
        raise input_error("slot_mapping", f"`slot_mapping` must be a torch.Tensor, got `{type(slot_mapping).__name__}`")
    if slot_mapping.dtype not in _INDEX_DTYPES or slot_mapping.dim() != 1:
        raise input_error("slot_mapping", f"`slot_mapping` must be a 1-D int32 or int64 tensor, got "
                          f"`{slot_mapping.dtype}` with shape `{tuple(slot_mapping.shape)}`")
    if num_tokens is not None and slot_mapping.numel() != num_tokens:
        raise input_error("slot_mapping", f"`slot_mapping` has {slot_mapping.numel()} slots for {num_tokens} tokens",
                          "pass one slot per token")
    if slot_mapping.device != device:
        raise input_error("slot_mapping", f"`slot_mapping` is on `{slot_mapping.device}` but the cache is on "
                          f"`{device}`", "move it to the cache's device first")
    return slot_mapping.long()


def check_slots(slot_mapping: object, num_tokens: int | None, num_slots: int, device: torch.device,
                allow_negative: bool, distinct: bool = True) -> tuple[torch.Tensor, bool]:
    """A 1-D int32/int64 tensor of slots ``block * block_size + offset``; negative means skip when allowed.

    Returns the slots as int64 and whether any is negative. With ``distinct``
    (writes), valid slots must be distinct: two tokens in one cell would leave
    which one wins unspecified. Reads may name a slot twice (shared prefixes).
    The values are read on the host: on a GPU that waits for the device.
    """
    slots = _slot_tensor(slot_mapping, num_tokens, device)
    if slots.numel() == 0:
        return slots, False
    if slots.numel() <= _SMALL:  # decode-sized: one host copy, then plain Python (no sort, no unique)
        values = slots.tolist()
        lo, hi = min(values), max(values)
        valid = [v for v in values if v >= 0] if lo < 0 else values
        repeated = distinct and len(set(valid)) != len(valid)
    else:
        lo, hi = (int(v) for v in torch.aminmax(slots))
        valid_t = slots[slots >= 0] if lo < 0 else slots
        repeated = distinct and valid_t.numel() > 1 and torch.unique(valid_t).numel() != valid_t.numel()
    if hi >= num_slots or (lo < 0 and not allow_negative):
        bad = hi if hi >= num_slots else lo
        low = "a negative slot skips its token" if allow_negative else "slots must be >= 0"
        raise input_error("slot_mapping", f"slot `{bad}` is out of range",
                          f"the cache has {num_slots} slots (num_blocks * block_size); {low}")
    if repeated:
        raise input_error("slot_mapping", "`slot_mapping` names the same slot twice",
                          "write each slot at most once per call")
    return slots, lo < 0


def check_slots_on_device(slot_mapping: object, num_tokens: int | None, num_slots: int,
                          device: torch.device) -> torch.Tensor:
    """`check_slots` (negative slots skip their token) without reading a value on the host.

    The argument's type, dtype, shape and device are checked here, with the usual
    errors; its values by ``torch._assert_async`` on the device, queued before any
    write: a slot out of range or named twice fails there (on CUDA a device-side
    assert, which also stops every later kernel, the cache's writes included).
    """
    slots = _slot_tensor(slot_mapping, num_tokens, device)
    n = slots.numel()
    if n == 0:
        return slots
    torch._assert_async((slots < num_slots).all(), "slot_mapping: a slot is out of range")
    if n > 1:
        # negatives made distinct (-1, -2, ...), then no two sorted neighbours equal
        keys = torch.where(slots >= 0, slots, -1 - torch.arange(n, device=device)).sort().values
        torch._assert_async((keys[1:] != keys[:-1]).all(), "slot_mapping names the same slot twice")
    return slots


def check_block_ids(block_ids: object, num_blocks: int, device: torch.device, unique: bool) -> torch.Tensor:
    """Block ids as a 1-D int64 tensor on ``device``; from a tensor or a sequence of ints."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype not in _INDEX_DTYPES or block_ids.dim() != 1:
            raise input_error("block_ids", f"`block_ids` must be a 1-D int32 or int64 tensor, got "
                              f"`{block_ids.dtype}` with shape `{tuple(block_ids.shape)}`")
        if block_ids.is_meta:
            raise input_error("block_ids", "`block_ids` is on `meta`: it holds no values",
                              f"pass ids on the CPU or on `{device}`")
        ids = block_ids.to(device=device, dtype=torch.int64)
        lo, hi = (int(v) for v in torch.aminmax(ids)) if ids.numel() else (0, 0)
    elif isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in block_ids
    ):
        # the range in Python, before any tensor: an id past int64 (2**70) would make torch.tensor raise
        lo, hi = (min(block_ids), max(block_ids)) if block_ids else (0, 0)
        ids = None
    else:
        raise input_error("block_ids", "`block_ids` must be a tensor or a sequence of ints",
                          f"pass block ids in 0..{num_blocks - 1}, e.g. `[0, 3]` or an int64 tensor")
    if lo < 0 or hi >= num_blocks:
        raise input_error("block_ids", f"block `{lo if lo < 0 else hi}` is out of range", f"use 0..{num_blocks - 1}")
    if ids is None:
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    if unique and ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        raise input_error("block_ids", "`block_ids` names the same block twice", "restore each block once")
    return ids
