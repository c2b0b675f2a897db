"""Data a peer sent: JSON parsed with bounded size, nesting and work, and never unpickled.

Fingerprints travel between processes (a transfer handshake, `agree`'s gather),
so every byte of them is controlled by the other side. A fingerprint is about
1 KiB of JSON nested 3 deep (`agree`'s payload: 4); these bounds are far above
that and far below what could exhaust the stack or the memory of the process
that parses it:

- at most `MAX_PEER_BYTES` bytes of text (checked before parsing);
- at most `MAX_PEER_DEPTH` nested lists and objects, `MAX_PEER_ITEMS` values
  and `MAX_PEER_BYTES` characters of strings in all (checked iteratively,
  without recursion, on parsed JSON and on dicts a caller passes alike);
- strict JSON: ``NaN`` and ``Infinity`` are refused, and so are integers of
  more than 4,096 bits (a fingerprint's largest is a byte count), which could
  not even be printed in an error message past Python's 4,300-digit limit.

Every failure is an `InputError` naming ``what`` (code ``peer-data``). Pure
Python, no torch.
"""

from __future__ import annotations

import json
from typing import Any

from kvpolicy.policy.errors import input_error

__all__ = ["MAX_PEER_BYTES", "MAX_PEER_DEPTH", "MAX_PEER_ITEMS", "check_peer_value", "load_peer_json"]

MAX_PEER_BYTES = 1 << 20
MAX_PEER_DEPTH = 16
MAX_PEER_ITEMS = 100_000
_MAX_INT_BITS = 4096  # about 1,233 digits; a fingerprint's largest integer is a byte size

_HELP = "a peer sends LayoutFingerprint.to_json() of the same kvpolicy version; check what it sent"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"`{name}` is not JSON")


def load_peer_json(data: str | bytes | bytearray, what: str) -> Any:
    """Parse a peer's JSON ``data`` within the bounds above; `InputError` naming ``what`` otherwise."""
    size = len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    if size > MAX_PEER_BYTES:
        raise input_error(what, f"the {what} data is {size} bytes, more than the {MAX_PEER_BYTES} a fingerprint "
                          "may take", _HELP, code="peer-data")
    try:
        value = json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise input_error(what, f"the {what} data nests deeper than {MAX_PEER_DEPTH} levels", _HELP,
                          code="peer-data") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise input_error(what, f"the {what} fingerprint is not JSON: {exc}", _HELP, code="peer-data") from None
    check_peer_value(value, what)
    return value


def check_peer_value(value: Any, what: str) -> None:
    """Raise `InputError` unless ``value`` nests at most `MAX_PEER_DEPTH` deep with at most `MAX_PEER_ITEMS`
    values; walks with an explicit stack, so a deep (or cyclic) structure costs no recursion."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    items = chars = 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if isinstance(node, str):
            chars += len(node)
            if chars > MAX_PEER_BYTES:
                raise input_error(what, f"the {what} data holds more than {MAX_PEER_BYTES} characters of text",
                                  _HELP, code="peer-data")
            continue
        if items > MAX_PEER_ITEMS:
            raise input_error(what, f"the {what} data holds more than {MAX_PEER_ITEMS} values", _HELP,
                              code="peer-data")
        if isinstance(node, int) and node.bit_length() > _MAX_INT_BITS:
            raise input_error(what, f"the {what} data holds an integer of {node.bit_length()} bits", _HELP,
                              code="peer-data")
        if isinstance(node, dict):
            children = [*node.keys(), *node.values()]
        elif isinstance(node, (list, tuple)):
            children = list(node)
        else:
            continue
        if depth + 1 > MAX_PEER_DEPTH and children:
            raise input_error(what, f"the {what} data nests deeper than {MAX_PEER_DEPTH} levels", _HELP,
                              code="peer-data")
        stack.extend((c, depth + 1) for c in children)

