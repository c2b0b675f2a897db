"""YAML to plain data with a position for every key and value.

PyYAML's ``safe_load`` forgets where things were and silently keeps the last
of two duplicate keys. We compose the node graph instead (no object is ever
constructed from a tag), convert it ourselves, and remember line:column.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvpolicy.policy.errors import Diagnostic

__all__ = ["INT64_MAX", "INT64_MIN", "INVALID", "Limits", "Located", "parse_yaml"]

Path = tuple[Any, ...]

_SAFE_SCALAR_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}
_MAP_TAG = "tag:yaml.org,2002:map"
# YAML 1.1 reads a plain `2027-01-31` as a timestamp; only a waiver's `expires` takes one, as its text
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_PLAIN_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")
# libyaml's composer when PyYAML was built with it (several times faster); same nodes, same marks.
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SEQ_TAG = "tag:yaml.org,2002:seq"


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # no file this project reads needs a wider integer

# YAML 1.1 (PyYAML's resolver) reads these plain scalars as numbers although a person rarely means one:
# `1:30` is 90 (base 60) and `017` is 15 (octal). A quoted string or a plain decimal says what was meant.
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_LEGACY_OCTAL = re.compile(r"^[-+]?0[0-7_]+$")
_BOOL_WORDS = {"yes", "no", "on", "off", "y", "n"}


_PLAIN_DATA = "these files hold plain strings, numbers, booleans, lists and mappings"  # the help of a tag refused


class _Invalid:
    """The value of a node that could not be read: its problem is already reported, so later
    stages skip it (one problem, one message) instead of stopping at the first."""

    _instance: _Invalid | None = None

    def __new__(cls) -> _Invalid:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<invalid>"


INVALID: Any = _Invalid()


@dataclass(frozen=True)
class Limits:
    """Caps that keep a hostile or broken rule file from exhausting the loader."""

    max_file_bytes: int = 1_000_000
    max_nodes: int = 200_000  # after alias expansion: stops "billion laughs"
    max_depth: int = 64
    max_rules: int = 10_000


@dataclass
class Located:
    """Plain data from one YAML document plus the positions of its parts."""

    file: str
    data: Any
    value_pos: dict[Path, tuple[int, int]] = field(default_factory=dict)
    key_pos: dict[Path, tuple[int, int]] = field(default_factory=dict)
    invalid: set[Path] = field(default_factory=set)  # paths whose value could not be read (already reported)
    yaml11_bools: dict[Path, str] = field(default_factory=dict)  # `on`/`yes`/`n`... read as booleans: the text

    def is_invalid(self, path: Path) -> bool:
        """Whether ``path`` lies at or under a value the parser already reported as unreadable."""
        return any(path[:k] in self.invalid for k in range(len(path) + 1))

    def position(self, path: Path, *, key: bool = False) -> tuple[int, int]:
        """The closest known position of ``path`` (its key's, if ``key``)."""
        if key and path in self.key_pos:
            return self.key_pos[path]
        while path not in self.value_pos and path:
            path = path[:-1]
        return self.value_pos.get(path, (1, 1))

    def diag(self, path: Path, code: str, message: str, help: str | None = None, *, key: bool = False) -> Diagnostic:
        line, col = self.position(path, key=key)
        return Diagnostic(self.file, line, col, code, message, help)


class _Abort(Exception):
    def __init__(self, diag: Diagnostic) -> None:
        self.diag = diag


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _number_hint(node: yaml.ScalarNode) -> tuple[str, str] | None:
    """A YAML 1.1 reading of a plain scalar that is almost never what a person meant, as (message, help)."""
    if node.style or node.tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
        return None
    text = node.value
    if _SEXAGESIMAL.match(text):
        return (f"`{text}` is a base-60 number in YAML 1.1 (`1:30` reads as 90)",
                f"quote it (`\"{text}\"`) if it is text, or write the number in decimal")
    if _LEGACY_OCTAL.match(text) and text.strip("+-_0"):
        value = int(text.replace("_", ""), 8)
        return (f"`{text}` is an octal number in YAML 1.1 (it reads as {value})",
                f"write `{value}` if you mean {value}, drop the leading zero, or quote it if it is text")
    return None


class _Converter:
    def __init__(self, file: str, limits: Limits) -> None:
        self.file = file
        self.limits = limits
        self.located = Located(file, None)
        self.nodes = 0
        self.diags: list[Diagnostic] = []
        self._scalars = yaml.constructor.SafeConstructor()

    def diag(self, node: yaml.Node, code: str, message: str, help: str | None = None) -> Diagnostic:
        line, col = _pos(node)
        return Diagnostic(self.file, line, col, code, message, help)

    def invalid(self, path: Path, node: yaml.Node, code: str, message: str, help: str | None = None) -> Any:
        """Report ``node`` and read it as `INVALID`, so the rest of the file is still checked."""
        self.diags.append(self.diag(node, code, message, help))
        self.located.invalid.add(path)
        return INVALID

    def scalar(self, node: yaml.ScalarNode, path: Path) -> Any:
        if node.tag == _TIMESTAMP_TAG and path and path[-1] == "expires" and _PLAIN_DAY.match(node.value):
            return node.value  # a waiver's `expires: 2027-01-31`: the day as written, never a datetime
        if node.tag not in _SAFE_SCALAR_TAGS:
            return self.invalid(path, node, "unsafe-tag", f"tag `{node.tag}` is not allowed", _PLAIN_DATA)
        hint = _number_hint(node)
        if hint is not None:
            return self.invalid(path, node, "ambiguous-number", *hint)
        digits = node.value.lstrip("+-").replace("_", "")
        if node.tag == "tag:yaml.org,2002:int" and digits.isdigit() and len(digits.lstrip("0")) > 19:
            return self._out_of_range(path, node)  # beyond int64 for sure; never converted (4300-digit limit)
        try:
            value = self._scalars.construct_object(node)
        except Exception as exc:  # any failure of the safe constructor on a vetted tag; `!!int ""` is an IndexError
            # `!!int abc`, `!!bool maybe`, a decimal of more than 4300 digits
            shown = node.value if len(node.value) <= 40 else node.value[:37] + "..."
            kind = node.tag.rsplit(":", 1)[-1]
            reason = str(exc) if isinstance(exc, yaml.YAMLError) else f"not a valid {kind}"
            return self.invalid(path, node, "yaml-value", f"cannot read `{shown}`: {reason}",
                                "write a plain value, or quote it to make it a string")
        if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            return self._out_of_range(path, node)
        if isinstance(value, float) and math.isinf(value) and "inf" not in node.value.lower():
            return self.invalid(path, node, "number-out-of-range",
                                f"the number `{_short(node.value)}` is too large for a 64-bit float",
                                "write a smaller number")
        if isinstance(value, bool) and not node.style and node.value.lower() in _BOOL_WORDS:
            # `on`, `yes`, `n`: YAML 1.1 booleans; remembered so a type error can say "quote it"
            self.located.yaml11_bools[path] = node.value
        return value

    def _out_of_range(self, path: Path, node: yaml.ScalarNode) -> Any:
        return self.invalid(path, node, "number-out-of-range",
                            f"the integer `{_short(node.value)}` is outside the 64-bit range",
                            f"integers here lie in {INT64_MIN}..{INT64_MAX}")

    def key(self, key_node: yaml.Node, path: Path) -> str | None:
        """A mapping key as text; None (reported) when it cannot be one."""
        if key_node.tag == "tag:yaml.org,2002:merge":
            self.diags.append(self.diag(key_node, "unsupported-merge", "merge keys (`<<`) are not supported",
                                        "write the keys out; these files should read without indirection"))
            return None
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag not in _SAFE_SCALAR_TAGS:
            self.diags.append(self.diag(key_node, "bad-key", "a mapping key must be a plain string"))
            return None
        if key_node.tag == "tag:yaml.org,2002:str":
            return key_node.value
        # A plain key YAML 1.1 would read as a boolean, number or null (`on:`, `yes:`, `1:`, `~:`): keep
        # the text as written, as JSON and every reader of these files mean it, never `true` or 1.
        if key_node.style is None or key_node.style == "":
            try:
                self._scalars.construct_object(key_node)
            except Exception:  # as for values
                self.diags.append(self.diag(key_node, "yaml-value", f"cannot read the key `{key_node.value[:40]}`",
                                            "write a plain key"))
                return None
        return key_node.value

    def convert(self, node: yaml.Node, path: Path, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > self.limits.max_nodes:
            raise _Abort(self.diag(node, "too-large",
                                   f"the document expands to more than {self.limits.max_nodes} nodes",
                                   "remove anchors/aliases that multiply content (these files need none)"))
        self.located.value_pos[path] = _pos(node)
        if depth > self.limits.max_depth:
            raise _Abort(self.diag(node, "too-deep", f"nesting deeper than {self.limits.max_depth} levels",
                                   "flatten the nesting"))
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, path)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                return self.invalid(path, node, "unsafe-tag", f"tag `{node.tag}` is not allowed", _PLAIN_DATA)
            return [self.convert(item, (*path, i), depth + 1) for i, item in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP_TAG:
                return self.invalid(path, node, "unsafe-tag", f"tag `{node.tag}` is not allowed", _PLAIN_DATA)
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = self.key(key_node, path)
                if key is None:
                    self.located.invalid.add(path)  # a key is missing from this mapping: skip its checks
                    continue
                if key in out:
                    first = self.located.key_pos[(*path, key)]
                    line, col = _pos(key_node)
                    self.diags.append(Diagnostic(
                        self.file, line, col, "duplicate-key",
                        f"duplicate key `{key}` (first defined at line {first[0]}, column {first[1]})",
                        "YAML keeps only one of them; delete or rename one",
                    ))
                    continue
                self.located.key_pos[(*path, key)] = _pos(key_node)
                out[key] = self.convert(value_node, (*path, key), depth + 1)
            return out
        raise _Abort(self.diag(node, "yaml-node", "unsupported YAML node"))  # pragma: no cover


def _short(text: str) -> str:
    """A long literal shown by its ends and its length, never whole (it may be thousands of digits)."""
    return text if len(text) <= 24 else f"{text[:12]}...{text[-6:]} ({len(text)} characters)"


def parse_yaml(text: str, file: str, limits: Limits = Limits()) -> tuple[Located | None, list[Diagnostic]]:
    """Parse one YAML document; returns the located data, or None and the diagnostics."""
    try:
        nodes = list(yaml.compose_all(text, Loader=_COMPOSER))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = exc.problem or str(exc)
        lines = text.splitlines()
        at = lines[line - 1][col - 1: col] if 0 < line <= len(lines) else ""
        hint = ("YAML forbids tab characters for indentation; use spaces" if at == "\t" or "\t" in problem
                else "fix the YAML syntax at this position")
        return None, [Diagnostic(file, line, col, "yaml-syntax", f"invalid YAML: {problem}", hint)]
    except yaml.YAMLError as exc:
        return None, [Diagnostic(file, 1, 1, "yaml-syntax", f"invalid YAML: {exc}")]
    except RecursionError:  # PyYAML's pure-Python composer (no libyaml) recurses per nesting level
        return None, [Diagnostic(file, 1, 1, "too-deep", f"nesting deeper than {limits.max_depth} levels",
                                 "flatten the nesting")]
    if not nodes or all(n is None for n in nodes):
        return None, [Diagnostic(file, 1, 1, "empty-document", "the file holds no YAML document",
                                 "the file is empty or holds only comments")]
    if len(nodes) > 1:
        line, col = _pos(nodes[1])
        return None, [Diagnostic(file, line, col, "multiple-documents", "a rule file holds exactly one document",
                                 "split the documents into separate files")]
    conv = _Converter(file, limits)
    try:
        conv.located.data = conv.convert(nodes[0], (), 0)
    except _Abort as abort:
        return None, [*conv.diags, abort.diag]
    except RecursionError:
        return None, [Diagnostic(file, 1, 1, "too-deep", "the document nests too deeply")]
    return conv.located, conv.diags
