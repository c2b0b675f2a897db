"""``dry-run --num-blocks``: the chosen layout's `kvpolicy.engine.plan.LayoutPlan`, as text and as JSON.

Pure presentation over the plan; the arithmetic lives in `kvpolicy.engine.plan`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpolicy.engine.plan import LayoutPlan

__all__ = ["plan_summary", "render_plan"]


def plan_summary(plan: LayoutPlan) -> dict[str, Any]:
    """The ``plan`` object of the JSON output: summary keys first, then `LayoutPlan.to_dict()`.

    Every buffer of a plan has the same shape (per_layer: one per layer;
    cross_layer: one), so ``physical_shape`` is the shape of one buffer and
    ``num_buffers`` says how many there are.
    """
    first = plan.buffers[0]
    return {
        "num_buffers": len(plan.buffers),
        "physical_shape": list(first.shape),
        "physical_strides": list(first.strides),
        "dtype": first.dtype,
        "buffer_bytes": first.nbytes,
        "block_row_bytes": plan.block_row_bytes,
        "fingerprint": plan.fingerprint,
        **plan.to_dict(),
    }


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} B ({n / size:.1f} {unit})"
    return f"{n} B"


def render_plan(plan: LayoutPlan, *, groups: int = 1) -> str:
    """Physical buffers, each layer's view, page and total bytes; one line per layer."""
    first = plan.buffers[0]
    n = len(plan.buffers)
    lines = [f"plan: {plan.layout} on {plan.backend.name}, {plan.num_blocks} blocks"]
    if groups > 1:
        lines.append(f"  (the first attention group's spec; the model has {groups} KV cache groups)")
    lines += [
        f"  buffers:   {n} x {_shape(first.shape)} {first.dtype} [{', '.join(first.dims)}], "
        f"{_bytes(first.nbytes)} each",
        f"  page:      {plan.page_size_bytes} B per layer per block (cell {plan.spec.cell_bytes} B); "
        f"one block of all layers: {plan.block_row_bytes} B",
        f"  total:     {_bytes(plan.total_bytes)}",
        f"  layer views [{', '.join(plan.layers[0].view.dims)}] (elements of {first.dtype}):",
    ]
    width = len(str(plan.num_layers - 1))
    for lp in plan.layers:
        v = lp.view
        lines.append(f"    layer {lp.layer:>{width}}: buffer {v.buffer}, shape {_shape(v.shape)}, "
                     f"strides {_shape(v.strides)}, offset {v.storage_offset}")
    if plan.layers[0].scales:
        lines.append("  inline scales: stride-aware fp32 views per layer (see --format json: plan.layers[].scales)")
    return "\n".join(lines)
