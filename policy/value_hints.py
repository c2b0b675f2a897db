"""What to write instead of a value of the wrong type: the help line of every loader's type errors (rule,
policy test and fleet files, model inputs), keyed by pydantic's error type, so that each says the same."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["plain_message", "type_hint"]

_TYPE_HINTS = {
    "dict_type": "write a mapping here: `key: value` lines indented below the key, or `{key: value}`",
    "model_type": "write a mapping here: `key: value` lines indented below the key, or `{key: value}`",
    "model_attributes_type": "write a mapping here: `key: value` lines indented below the key, or `{key: value}`",
    "list_type": "write a list here: `- item` lines indented below the key, or `[a, b]`",
    "int_type": "write a whole number here, e.g. `16`",
    "int_parsing": "write a whole number here, e.g. `16`",
    "int_from_float": "write a whole number here, e.g. `16`",
    "float_type": "write a number here, e.g. `0.5`",
    "float_parsing": "write a number here, e.g. `0.5`",
    "bool_type": "write `true` or `false` here",
    "bool_parsing": "write `true` or `false` here",
}


def type_hint(kind: str, value: Any) -> str | None:
    """What to write where a value has the wrong type (a file's layout is read from its indentation)."""
    if kind == "string_type":
        if isinstance(value, (int, float)):
            return f"quote it (`\"{value}\"`) to write it as text"
        if isinstance(value, (list, dict)):
            return "write one value here, not a list or mapping"
        return None
    return _TYPE_HINTS.get(kind)


def plain_message(msg: str) -> str:
    """pydantic's message in kvpolicy's words: ``expected ...``, lowercase, without pydantic's prefixes and
    class names (``or instance of CaseInput`` names no word of the file)."""
    msg = msg.removeprefix("Value error, ").replace("Input should be", "expected")
    msg = re.sub(r" or instance of \w+", "", msg)
    return msg[:1].lower() + msg[1:]
