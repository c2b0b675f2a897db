"""The torch runtime: allocate a `LayoutPlan`, write and read quantized K/V, move blocks.

Importing `engine` or `kvpolicy.engine.plan` never imports torch; this package does.
"""

from kvpolicy.engine.runtime.allocate import allocate
from kvpolicy.engine.runtime.cache import KVCache
from kvpolicy.engine.runtime.quantize import decode_cells, encode_cells

__all__ = ["KVCache", "allocate", "decode_cells", "encode_cells"]
