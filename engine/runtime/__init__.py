"""The torch runtime: allocate a `LayoutPlan`, write and read quantized K/V, move blocks (`OffloadedBlocks`).

Importing `engine` or `kvpolicy.engine.plan` never imports torch; this package does, and
without torch it raises `MissingDependencyError` naming the extra to install
(``pip install 'kvpolicy[torch]'``) instead of a bare ModuleNotFoundError from deep inside.
"""

from kvpolicy.policy.errors import Diagnostic, MissingDependencyError

try:
    import torch  # noqa: F401
except ImportError as exc:
    raise MissingDependencyError("", [Diagnostic(
        "torch", 0, 0, "missing-dependency", f"kvpolicy's runtime needs torch, which cannot be imported ({exc})",
        "pip install 'kvpolicy[torch]'")]) from None

from kvpolicy.engine.runtime.allocate import allocate
from kvpolicy.engine.runtime.blocks import OffloadedBlocks
from kvpolicy.engine.runtime.cache import KVCache
from kvpolicy.engine.runtime.quantize import decode_cells, encode_cells

__all__ = ["KVCache", "OffloadedBlocks", "allocate", "decode_cells", "encode_cells"]
