"""YAML to plain data with a position for every key and value.

PyYAML's ``safe_load`` forgets where things were and silently keeps the last
of two duplicate keys. We compose the node graph instead (no object is ever
constructed from a tag), convert it ourselves, and remember line:column.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from kvpolicy.policy.errors import Diagnostic

__all__ = ["Limits", "Located", "parse_yaml"]

Path = tuple[Any, ...]

_SAFE_SCALAR_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}
_MAP_TAG = "tag:yaml.org,2002:map"
# libyaml's composer when PyYAML was built with it (several times faster); same nodes, same marks.
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SEQ_TAG = "tag:yaml.org,2002:seq"


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


class _Converter:
    def __init__(self, file: str, limits: Limits) -> None:
        self.file = file
        self.limits = limits
        self.located = Located(file, None)
        self.nodes = 0
        self.diags: list[Diagnostic] = []
        self._scalars = yaml.constructor.SafeConstructor()

    def fail(self, node: yaml.Node, code: str, message: str, help: str | None = None) -> _Abort:
        line, col = _pos(node)
        return _Abort(Diagnostic(self.file, line, col, code, message, help))

    def convert(self, node: yaml.Node, path: Path, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > self.limits.max_nodes:
            raise self.fail(node, "too-large",
                            f"the document expands to more than {self.limits.max_nodes} nodes",
                            "remove anchors/aliases that multiply content (a rule file needs none)")
        if depth > self.limits.max_depth:
            raise self.fail(node, "too-deep", f"nesting deeper than {self.limits.max_depth} levels",
                            "flatten the condition tree")
        self.located.value_pos[path] = _pos(node)
        if isinstance(node, yaml.ScalarNode):
            if node.tag not in _SAFE_SCALAR_TAGS:
                raise self.fail(node, "unsafe-tag", f"tag `{node.tag}` is not allowed",
                                "rule files hold plain strings, numbers, booleans, lists and mappings")
            try:
                return self._scalars.construct_object(node)
            except yaml.YAMLError as exc:  # e.g. a malformed timestamp-like int
                raise self.fail(node, "yaml-value", f"cannot read this value: {exc}") from None
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                raise self.fail(node, "unsafe-tag", f"tag `{node.tag}` is not allowed")
            return [self.convert(item, (*path, i), depth + 1) for i, item in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP_TAG:
                raise self.fail(node, "unsafe-tag", f"tag `{node.tag}` is not allowed")
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise self.fail(key_node, "unsupported-merge", "merge keys (`<<`) are not supported",
                                    "write the keys out; rule files should read without indirection")
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag not in _SAFE_SCALAR_TAGS:
                    raise self.fail(key_node, "bad-key", "a mapping key must be a plain string")
                key = self._scalars.construct_object(key_node)
                if not isinstance(key, str):
                    key = str(key).lower() if isinstance(key, bool) else str(key)
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
        raise self.fail(node, "yaml-node", "unsupported YAML node")  # pragma: no cover


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
