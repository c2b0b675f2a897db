"""Canonical formatting of rule files (``kvpolicy fmt``), as ``opa fmt`` formats Rego.

The canonical form:

- keys in a fixed order: the file's ``version, connector, member_preferences, defaults, rules``; a
  rule's ``id, description, reference, enforcement, when, forbid, require, prefer, weight``; a
  leaf's ``field`` then its operator; a pattern's keys in `LayoutPattern`'s order; keys the format
  does not know follow in their own order;
- block style for the file, the rule list, rules, ``defaults`` and ``all`` / ``any`` / ``not``;
  flow style (one line) for a leaf (``{field: kv.per_token_head, eq: true}``), an effect's
  pattern and ``layout_order``; anything else keeps its style;
- two spaces of indentation, a sequence indented under its key (``rules:\\n  - id: ...``);
- scalars as written (``"0.34"`` stays quoted, ``>-`` descriptions stay folded, re-indented);
  a scalar written over several lines without a block indicator becomes one line (quoted, breaks as
  ``\\n``, where it holds line breaks); a plain scalar a flow collection cannot hold (``x,y``, ``a]b``)
  is quoted there; a ``|+`` scalar keeps exactly the breaks it holds.

What is preserved: every comment on a line of its own stays above the key or list item it
preceded, at that item's indentation (a comment inside a flow collection written over several lines
moves above the collection); a comment at the end of a line stays at the end of the line of the key
or item it was on; comments after the last item stay at the end; one blank line before a key or item
that had one or more. What is not: alignment inside lines, blank lines beyond one, anchors and
aliases, explicit tags (a file with them is refused, not rewritten). The meaning never changes, and
`format_rule_file` checks it on every call rather than trusting the emitter: the loader reads input and
output, every value must be equal (typed, lists in order), every comment kept, and formatting twice must
be formatting once;
else the file is refused, located at the first difference (property tests generate awkward files).
"""

from __future__ import annotations

import bisect
import io
import itertools
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import yaml
import yaml.emitter
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvpolicy.policy.errors import Diagnostic, PolicyError
from kvpolicy.policy.yaml_source import INVALID, Limits, Located, parse_yaml

__all__ = ["FormatError", "format_rule_file"]


class FormatError(PolicyError):
    """A file ``kvpolicy fmt`` cannot format (not YAML, several documents, anchors), located."""


_FILE_KEYS = ("version", "connector", "member_preferences", "defaults", "rules")
_RULE_KEYS = ("id", "description", "reference", "enforcement", "when", "forbid", "require", "prefer", "weight")
_PATTERN_KEYS = ("layout", "placement", "head_order", "layer_compact", "block_outermost", "block_compact",
                 "block_contiguous")
_EFFECTS = ("forbid", "require", "prefer")
_STR_TAG = "tag:yaml.org,2002:str"
_LINE_BREAKS = "\n\r\x85\u2028\u2029"
# libyaml's composer when PyYAML has it (as the loader's): the same nodes and marks, and it refuses nesting
# beyond 1000 levels itself, where PyYAML's pure-Python composer recurses until Python stops it
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_PLAIN_WORDS = re.compile(r"[A-Za-z0-9_./+~]+(?: [A-Za-z0-9_./+~-]+)*\Z")


def _flow_plain(text: str) -> bool:
    """Whether the plain scalar ``text`` (text, from a block) reads the same inside a flow collection: not
    when it holds `,[]{}` or starts with `?`/`:` (PyYAML's emitter decides, conservatively)."""
    if _PLAIN_WORDS.match(text):  # most scalars: names, numbers, dotted fields (the emitter is slow)
        return True
    emitter = yaml.emitter.Emitter(io.StringIO(), allow_unicode=True)
    return bool(emitter.analyze_scalar(text).allow_flow_plain)


def _one_line(value: str, flow: bool) -> str:
    """The string ``value`` as one line of YAML: plain where it may be (in a flow collection when ``flow``),
    else quoted (a line break as ``\\n``)."""
    style = '"' if any(c in value for c in _LINE_BREAKS) else None
    text = yaml.safe_dump([value] if flow else value, default_flow_style=True, default_style=style,
                          width=10**9, allow_unicode=True)
    text = text.removesuffix("\n").removesuffix("\n...").removesuffix("...").strip()
    if flow:
        text = text[1:-1]
    if "\n" in text:  # never with the width above; a double-quoted scalar escapes every break
        return _one_line_quoted(value)
    return text


def _one_line_quoted(value: str) -> str:
    return yaml.safe_dump(value, default_style='"', width=10**9, allow_unicode=True).removesuffix("\n")


@dataclass
class _Line:
    """One output line; ``anchor``: the source line of the key or item it starts (None: a continuation),
    ``span``: the source lines an inline (one-line) value covers; ``leads``: the source lines whose
    preceding comments go above it (its anchor, and a list item's line for the item's first key)."""

    text: str
    anchor: int | None = None
    span: tuple[int, int] | None = None
    indent: int = 0
    leads: tuple[int, ...] | None = None
    kept: bool = False  # the last line of a `|+`/`>+` block scalar: a blank line after it would be content

    def __post_init__(self) -> None:
        if self.leads is None:
            self.leads = () if self.anchor is None else (self.anchor,)


@dataclass
class _Source:
    text: str
    lines: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.lines = self.text.splitlines()

    def slice(self, node: Node) -> str:
        s, e = node.start_mark, node.end_mark
        lines = self.lines
        if s.line >= len(lines):  # an implicit null after the last line (`? x` at the end) starts past it
            return ""
        if s.line == e.line:
            return lines[s.line][s.column:e.column]
        last = lines[e.line] if e.line < len(lines) else ""
        return "\n".join([lines[s.line][s.column:], *lines[s.line + 1:e.line], last[:e.column]])


def _key(node: MappingNode, i: int) -> str:
    k = node.value[i][0]
    return k.value if isinstance(k, ScalarNode) else ""


def _ordered(node: MappingNode, order: tuple[str, ...]) -> list[tuple[Node, Node]]:
    """The pairs of ``node``: known keys in ``order``, then the others as written."""
    rank = {k: i for i, k in enumerate(order)}
    return [p for _, p in sorted(enumerate(node.value),
                                 key=lambda ip: (rank.get(_key(node, ip[0]), len(order)), ip[0]))]


class _Formatter:
    def __init__(self, src: _Source) -> None:
        self.src = src

    # -- what goes where -------------------------------------------------------------------------

    def _role_of_child(self, role: str, key: str) -> str:
        """The role of the value under ``key`` in a mapping of ``role``."""
        if role == "file":
            return {"defaults": "defaults", "rules": "rules"}.get(key, "other")
        if role == "rule":
            if key == "when":
                return "condition"
            return "pattern" if key in _EFFECTS else "other"
        if role == "defaults":
            return "flow" if key == "layout_order" else "other"
        if role == "condition":
            return {"all": "conditions", "any": "conditions", "not": "condition"}.get(key, "other")
        return "other"

    def _order(self, role: str, node: MappingNode) -> list[tuple[Node, Node]]:
        if role == "file":
            return _ordered(node, _FILE_KEYS)
        if role == "rule":
            return _ordered(node, _RULE_KEYS)
        if role == "leaf":
            return _ordered(node, ("field",))
        if role == "pattern":
            return _ordered(node, _PATTERN_KEYS)
        return list(node.value)

    @staticmethod
    def _is_leaf(node: Node) -> bool:
        return isinstance(node, MappingNode) and any(_key(node, i) == "field" for i in range(len(node.value)))

    def _inline(self, role: str, node: Node) -> bool:
        if isinstance(node, ScalarNode):
            return node.style not in ("|", ">")
        if not node.value:  # `rules: []`: an empty block has no block form
            return True
        if role in ("pattern", "flow", "leaf"):
            return True
        if role in ("condition",) and self._is_leaf(node):
            return True
        if role in ("file", "rules", "rule", "defaults", "condition", "conditions"):
            return False
        return bool(node.flow_style)

    # -- one-line values -------------------------------------------------------------------------

    def _key(self, node: Node, flow: bool) -> str:
        """A mapping key: the loader keeps a key's text as written (`~`, `null` and an empty key differ)."""
        if isinstance(node, ScalarNode) and not node.style and not self.src.slice(node):
            return '""'  # `? ` or `{?}`: the empty key, which `:` alone cannot spell
        return self._flow("other", node, flow)

    def _scalar(self, node: ScalarNode, flow: bool) -> str:
        """The scalar on one line, in a flow collection when ``flow``: as written where that reads back the
        same there; else the same value written again (quoted where it must be)."""
        text = self.src.slice(node)
        plain = not node.style
        if plain and not text:  # `key:` or `-` with nothing after it: null, which a flow collection must spell
            return "null" if flow else ""
        if plain and node.tag != _STR_TAG:  # a number, boolean or null: `0x10`, `1:30`, `~` read alike in a flow
            return text  # kept as written; the round-trip check refuses the file if that changes a value
        if "\n" not in text and not (flow and plain and not _flow_plain(text)):
            return text
        return _one_line(node.value, flow)

    def _flow(self, role: str, node: Node, flow: bool = True) -> str:
        if isinstance(node, ScalarNode):
            return self._scalar(node, flow)
        if isinstance(node, SequenceNode):
            return "[" + ", ".join(self._flow("other", item) for item in node.value) + "]"
        leaf = role == "leaf" or self._is_leaf(node)
        pairs = self._order("leaf" if leaf else role, node)
        return "{" + ", ".join(f"{self._key(k, True)}: {self._flow('other', v)}" for k, v in pairs) + "}"

    # -- blocks ----------------------------------------------------------------------------------

    def _block_scalar(self, node: ScalarNode, indent: int) -> tuple[str, list[_Line]]:
        """The header (``>-``) and the content lines, re-indented to ``indent``. The content's trailing
        line breaks come from the value, not from the blank lines around it: a ``|+`` scalar keeps exactly
        the breaks it holds, however the lines after it are laid out."""
        s, e = node.start_mark, node.end_mark
        header = self.src.lines[s.line][s.column:].split("#", 1)[0].rstrip()
        if any(c.isdigit() for c in header):
            raise FormatError("", [Diagnostic("", s.line + 1, s.column + 1, "unsupported",
                                              "a block scalar with an indentation indicator is not formatted",
                                              "drop the digit from the block header")])
        end = e.line if e.column == 0 else e.line + 1
        body = self.src.lines[s.line + 1:end]
        while body and not body[-1].strip():
            body.pop()
        current = min((len(x) - len(x.lstrip(" ")) for x in body if x.strip()), default=indent)
        shift = indent - current
        out = [_Line("" if not x.strip() else (" " * shift + x if shift >= 0 else x[-shift:])) for x in body]
        if "+" in header:  # keep: each trailing break is content, the last content line holds the first
            breaks = len(node.value) - len(node.value.rstrip("\n"))
            out += [_Line("") for _ in range(breaks - (1 if body else 0))]
            (out[-1] if out else _Line("")).kept = True
        return header, out

    def _entry(self, prefix: str, indent: int, role: str, node: Node, anchor: int) -> list[_Line]:
        """``prefix`` (``key:`` or ``-``) and its value at ``indent``."""
        pad = " " * indent
        span = (anchor, node.end_mark.line if node.end_mark.column > 0 else node.end_mark.line - 1)
        if self._inline(role, node):
            span = (min(anchor, node.start_mark.line), max(span[1], anchor))
            text = f"{pad}{prefix} {self._flow(role, node, isinstance(node, (MappingNode, SequenceNode)))}"
            return [_Line(text.rstrip(" "), anchor, span, indent)]
        if isinstance(node, ScalarNode):  # a block scalar
            header, body = self._block_scalar(node, indent + 2)
            head = _Line(f"{pad}{prefix} {header}", anchor, (anchor, anchor), indent, kept="+" in header and not body)
            return [head, *body]
        inner = self._block(role, node, indent + 2)
        if prefix == "-" and isinstance(node, MappingNode) and inner:  # `- key: value` on one line
            first = inner[0]
            for x in inner[1:]:  # the item's line leads the item, not the key written first there
                x.leads = tuple(ln for ln in x.leads or () if ln != anchor)
            inner[0] = _Line(f"{pad}- {first.text.lstrip()}", first.anchor, first.span, indent,
                             (anchor, *(ln for ln in first.leads or () if ln != anchor)))
            return inner
        if anchor == node.start_mark.line and inner:  # `-` then a list written from that line (`- - a  # c`):
            # the comment at the end of that line is the inner item's, which keeps that line's anchor
            return [_Line(f"{pad}{prefix}", None, None, indent, (anchor,)), *inner]
        return [_Line(f"{pad}{prefix}", anchor, (anchor, anchor), indent), *inner]

    def _block(self, role: str, node: Node, indent: int) -> list[_Line]:
        out: list[_Line] = []
        if isinstance(node, MappingNode):
            for k, v in self._order(role, node):
                child = self._role_of_child(role, k.value if isinstance(k, ScalarNode) else "")
                out += self._entry(f"{self._key(k, False)}:", indent, child, v, k.start_mark.line)
        elif isinstance(node, SequenceNode):
            item_role = {"rules": "rule", "conditions": "condition"}.get(role, "other")
            for item in node.value:
                out += self._entry("-", indent, item_role, item, self._dash_line(node, item))
        return out

    def _dash_line(self, seq: SequenceNode, item: Node) -> int:
        """The line of ``item``'s ``-``: the item's first line, unless the dash stands alone on a line above
        it (``-``, a blank line, then the value), where a blank line kept before the item would otherwise
        land above the dash and move on each pass."""
        col, lines = seq.start_mark.column, self.src.lines
        line = min(item.start_mark.line, len(lines) - 1)
        while line > seq.start_mark.line and not (
                lines[line][col:col + 1] == "-" and lines[line][col + 1:col + 2] in ("", " ", "\t")):
            line -= 1
        return line

    def format(self, root: Node) -> list[_Line]:
        if not isinstance(root, MappingNode):
            return [_Line(self._flow("other", root, not isinstance(root, ScalarNode)), root.start_mark.line,
                          (root.start_mark.line, root.end_mark.line))]
        return self._block("file", root, 0)


# ---------------------------------------------------------------------------------------------
# Comments


def _scalar_ranges(root: Node, lines: list[str]) -> list[list[tuple[int, int]]]:
    """Per source line, the column ranges scalars occupy (a ``#`` there is text, not a comment)."""
    n_lines = len(lines)
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(n_lines + 1)]
    stack = [root]
    big = 10**9
    while stack:
        node = stack.pop()
        if isinstance(node, ScalarNode):
            s, e = node.start_mark, node.end_mark
            header = (_BLOCK_HEADER.match(lines[s.line], s.column)
                      if node.style in ("|", ">") and s.line < len(lines) else None)
            if s.line == e.line:
                ranges[s.line].append((s.column, e.column))
            else:  # a block scalar's header line may end in a comment: only the indicators are the scalar's
                ranges[s.line].append((s.column, header.end() if header else big))
                for line in range(s.line + 1, min(e.line, n_lines)):
                    ranges[line].append((0, big))
                if e.line <= n_lines:
                    ranges[e.line].append((0, e.column))
        elif isinstance(node, MappingNode):
            for k, v in node.value:
                stack += [k, v]
        elif isinstance(node, SequenceNode):
            stack += node.value
    return ranges


_COMMENT_CHARS = re.compile("[#'\"]")
_BLOCK_HEADER = re.compile(r"[|>][0-9+-]*")


def _comments(lines: list[str], ranges: list[list[tuple[int, int]]]) -> dict[int, tuple[str, bool]]:
    """Source line -> (the comment from its ``#``, whether the line holds nothing else)."""
    out = {}
    for i, line in enumerate(lines):
        taken = ranges[i] if i < len(ranges) else []
        quote = None
        for col in (m.start() for m in _COMMENT_CHARS.finditer(line)):  # no other character changes anything
            ch = line[col]
            if any(a <= col < b for a, b in taken):
                continue
            if quote:
                if ch == quote:
                    quote = None
                continue
            if ch in "'\"" and (col == 0 or not line[col - 1].isalnum()):
                quote = ch
            if ch == "#" and (col == 0 or line[col - 1] in " \t"):
                out[i] = (line[col:].rstrip(), not line[:col].strip())
                break
    return out


def _with_comments(out: list[_Line], lines: list[str], comments: dict[int, tuple[str, bool]],
                   first_key: int) -> list[tuple[str, int]]:
    claimed: set[int] = set()
    for x in out:  # keys written on one source line (a flow mapping made block): the first output line leads
        x.leads = tuple(ln for ln in x.leads or () if ln not in claimed)
        claimed.update(x.leads)
    leads = sorted({ln for x in out for ln in x.leads or ()})
    by_anchor = {x.anchor for x in out if x.anchor is not None}
    inline_spans = sorted((x.span, x.anchor) for x in out if x.anchor is not None and x.span is not None
                          and x.span[1] > x.span[0])
    starts = [s for (s, _), _ in inline_spans]
    reach = list(itertools.accumulate((e for (_, e), _ in inline_spans), max))
    leading: dict[int, list[int]] = {}
    trailing: dict[int, list[str]] = {}
    tail: list[int] = []
    for line, (text, alone) in sorted(comments.items()):
        if alone and line < first_key:  # before the first key: the file's header, kept on top
            continue
        # the first span (in order) holding `line`: among those starting at or before it, the first whose
        # end reaches it (a running maximum of the ends finds it by bisection, not a scan per comment)
        i = bisect.bisect_left(reach, line)
        inside = inline_spans[i][1] if i < bisect.bisect_right(starts, line) else None
        if not alone:
            target = line if line in by_anchor else inside
            if target is not None:
                trailing.setdefault(target, []).append(text)
                continue
        if inside is not None and line > inside:
            leading.setdefault(inside, []).append(line)
            continue
        i = bisect.bisect_right(leads, line)
        if i < len(leads):
            leading.setdefault(leads[i], []).append(line)
        else:
            tail.append(line)
    # (text, the source line it comes from: where a problem with it is located)
    result: list[tuple[str, int]] = []
    for ln, (text, alone) in sorted(comments.items()):
        if alone and ln < first_key:  # the header, with one blank line where it had some (formatting it again
            if result and not lines[ln - 1].strip():  # must keep them: a comment moved up may bring one)
                result.append(("", ln - 1))
            result.append((text, ln))
    kept = False  # the line before is the end of a `|+` block scalar: a blank line here would join its value
    at = 0
    for x in out:
        at = x.anchor if x.anchor is not None else at
        notes = sorted(ln for lead in x.leads or () for ln in leading.get(lead, []))
        first = min([*(x.leads or ()), *notes], default=None)
        if first is not None and result and first > 0 and not lines[first - 1].strip() and not kept:
            result.append(("", first - 1))
        result += [(" " * x.indent + comments[ln][0], ln) for ln in notes]
        if x.anchor is not None and x.anchor in trailing:
            result.append((x.text + "  " + " ".join(trailing.pop(x.anchor)), at))  # once, on the first such line
        else:
            result.append((x.text, at))
        kept = x.kept
    if tail:
        if result and not lines[tail[0] - 1].strip() and not kept:
            result.append(("", tail[0] - 1))
        result += [(comments[ln][0], ln) for ln in tail]
        kept = False
    if not kept:  # the file ends with one line break (a `|+` value's own breaks are its content)
        while result and not result[-1][0]:
            result.pop()
    return result


def _fail(file: str, line: int, col: int, code: str, message: str, help: str) -> FormatError:
    return FormatError("", [Diagnostic(file, line, col, code, message, help)])


def _compose(text: str, file: str, limits: Limits) -> Node:
    """The one YAML document of ``text``, composed (never constructed), no deeper than the loader reads."""
    if text.startswith("\ufeff"):  # the loader refuses it too (`kvpolicy.policy.files.read_capped`)
        raise _fail(file, 1, 1, "bom", "the file starts with a byte-order mark", "save it as UTF-8 without BOM")
    if len(text.encode("utf-8", "surrogatepass")) > limits.max_file_bytes:
        raise _fail(file, 1, 1, "too-large", f"the file is over the {limits.max_file_bytes}-byte limit",
                    "split it, or raise Limits.max_file_bytes")
    try:
        docs = list(yaml.compose_all(text, Loader=_COMPOSER))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise _fail(file, line, col, "yaml-syntax", str(exc.problem or exc),
                    "fix the YAML first: `kvpolicy validate FILE` says more") from None
    except yaml.YAMLError as exc:  # a character YAML does not allow (`ReaderError`): where it is
        at = getattr(exc, "position", 0) if isinstance(getattr(exc, "position", 0), int) else 0
        line = text.count("\n", 0, at) + 1
        raise _fail(file, line, at - (text.rfind("\n", 0, at) + 1) + 1, "yaml-syntax", str(exc).split("\n")[0],
                    "fix the YAML first: `kvpolicy validate FILE` says more") from None
    except RecursionError:  # PyYAML without libyaml recurses per nesting level
        raise _fail(file, 1, 1, "too-deep", f"nesting deeper than {limits.max_depth} levels",
                    "flatten the nesting") from None
    docs = [d for d in docs if d is not None]
    if len(docs) != 1:
        raise _fail(file, 1, 1, "not-one-document", f"a rule file is one YAML document, found {len(docs)}",
                    "keep one document per file")
    if "&" in text or "*" in text:  # first: the walk below visits an aliased node once per path to it (a bomb)
        _refuse_anchors(docs[0], file)
    stack: list[tuple[Node, int]] = [(docs[0], 0)]
    while stack:  # the formatter recurses per level: refuse what the loader refuses, before recursing
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise _fail(file, node.start_mark.line + 1, node.start_mark.column + 1, "too-deep",
                        f"nesting deeper than {limits.max_depth} levels", "flatten the nesting")
        if isinstance(node, MappingNode):
            stack += [(n, depth + 1) for kv in node.value for n in kv]
        elif isinstance(node, SequenceNode):
            stack += [(n, depth + 1) for n in node.value]
    if "!" in text:
        _refuse_tags(text, file)
    return docs[0]


def _refuse_tags(text: str, file: str) -> None:
    """An explicit tag (``!!str 1``, ``!x``) is refused, as anchors are: the formatter writes values, not tags."""
    for event in yaml.parse(text, Loader=_COMPOSER):
        tag = getattr(event, "tag", None)
        if tag is not None:
            m = event.start_mark
            raise _fail(file, m.line + 1, m.column + 1, "unsupported", f"explicit tags (`{tag}`) are not formatted",
                        "write the value without the tag (quote it to make it a string)")


def _format(text: str, file: str, limits: Limits,
            notes: dict[int, tuple[str, bool]] | None = None) -> list[tuple[str, int]]:
    """The formatted lines of ``text``, each with the source line it comes from (0-based); its comments by
    source line go into ``notes`` when given."""
    root = _compose(text, file, limits)
    src = _Source(text)
    try:
        out = _Formatter(src).format(root)
    except FormatError as exc:
        raise FormatError("", [Diagnostic(file, d.line, d.col, d.code, d.message, d.help)
                               for d in exc.diagnostics]) from None
    comments = _comments(src.lines, _scalar_ranges(root, src.lines))
    if notes is not None:
        notes.update(comments)
    return _with_comments(out, src.lines, comments, root.start_mark.line)


def _fragments(comments: dict[int, tuple[str, bool]]) -> Counter[str]:
    """Each comment's ``#`` parts (two comments at the ends of lines that fmt puts on one are two parts)."""
    return Counter(part.strip() for text, _ in comments.values() for part in _COMMENT_PARTS.findall(text))


_COMMENT_PARTS = re.compile(r"#[^#]*")


def _joined(lines: list[tuple[str, int]]) -> str:
    return "".join(text + "\n" for text, _ in lines)


def format_rule_file(text: str, file: str = "<text>", *, limits: Limits = Limits()) -> str:
    """``text`` (a rule file) in the canonical form; raises `FormatError` (located) when it is not one
    YAML document the loader reads, uses anchors, or when the formatted text would not mean what ``text``
    means.

    That last check is the guarantee, whatever the emitter's gaps: the input and the output are both
    read by the loader (`kvpolicy.policy.yaml_source.parse_yaml`), and everything the rules are built
    from must be equal (every key and value, with its type, every list in its order; mapping keys
    may move) and read with the same problems; every comment of ``text`` must be in it; and formatting
    the output again must change nothing.
    Otherwise nothing is returned: the error names the first difference, at its place in ``text``.
    """
    before: dict[int, tuple[str, bool]] = {}
    after: dict[int, tuple[str, bool]] = {}
    lines = _format(text, file, limits, before)
    out = _joined(lines)
    _check_same_meaning(text, out, file, lines, limits)
    again = _joined(_format(out, file, limits, after))
    lost = _fragments(before) - _fragments(after)
    if lost:  # a comment is the author's, not fmt's to drop
        part = next(iter(lost))
        line = next(ln for ln, (c, _) in sorted(before.items()) if part in _fragments({0: (c, True)}))
        raise _fail(file, line + 1, 1, "fmt-loses-comment", f"the formatted text would lose the comment `{part}`",
                    _REPORT)
    if again != out:
        at = next(i for i, (a, b) in enumerate(zip([*again.splitlines(), ""], [*out.splitlines(), ""])) if a != b)
        line = lines[min(at, len(lines) - 1)][1] + 1 if lines else 1
        raise _fail(file, line, 1, "fmt-unstable",
                    f"formatting this file twice gives two texts (line {at + 1} of the output differs), "
                    "so it is left as written", _REPORT)
    return out


_REPORT = "the file is left as written; write this part in the canonical form by hand, and report it as a kvpolicy bug"


def _check_same_meaning(before: str, after: str, file: str, lines: list[tuple[str, int]], limits: Limits) -> None:
    old, old_diags = parse_yaml(before, file, limits)
    if old is None:  # the loader refuses what the composer took (more nodes than it reads, say): nothing to keep
        raise FormatError("", old_diags)
    new, new_diags = parse_yaml(after, file, limits)
    if new is None:
        d = new_diags[0]
        line = lines[min(max(d.line, 1), len(lines)) - 1][1] + 1 if lines else 1
        raise _fail(file, line, 1, "fmt-changes-meaning",
                    f"the formatted text would not load (its line {d.line}: {d.message})", _REPORT)
    path = _first_difference(old.data, new.data, ())
    if path is None:
        path = _finding_difference(old, old_diags, new, new_diags)
        if path is None:
            return
        line, col = old.position(path)
        raise _fail(file, line, col, "fmt-changes-meaning", f"the loader would read {_where(path)} differently "
                    "after formatting (what it reports there differs)", _REPORT)
    line, col = old.position(path)
    was, now = _value_at(old, path), _value_at(new, path)
    raise _fail(file, line, col, "fmt-changes-meaning",
                f"formatting would change {_where(path)}: {_shown(was)} would read as {_shown(now)}", _REPORT)


def _finding_difference(old: Located, old_diags: list[Diagnostic], new: Located,
                        new_diags: list[Diagnostic]) -> tuple[Any, ...] | None:
    """Where the loader's findings differ, for data that is equal: a value unreadable on one side only
    (`017` against `"017"`), a YAML 1.1 boolean spelled otherwise (`on` against `true`), another problem
    (None: the same findings). A duplicate key's message names lines, which move: its count is compared."""
    for path in sorted(old.invalid ^ new.invalid, key=repr):
        return path
    for path, _ in sorted(set(old.yaml11_bools.items()) ^ set(new.yaml11_bools.items()), key=repr):
        return path

    def findings(diags: list[Diagnostic]) -> list[tuple[str, str]]:
        return sorted((d.code, "" if d.code == "duplicate-key" else d.message) for d in diags)

    return None if findings(old_diags) == findings(new_diags) else ()


_MISSING = object()


def _value_at(src: Located, path: tuple[Any, ...]) -> Any:
    value = src.data
    for part in path:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return value


def _where(path: tuple[Any, ...]) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return f"`{text}`" if text else "the document"


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "nothing"
    text = "null" if value is None else yaml.safe_dump(value, default_flow_style=True, width=10**9,
                                                       allow_unicode=True).removesuffix("\n").removesuffix("\n...")
    text = text if value is not INVALID else "an unreadable value"
    return f"`{text if len(text) <= 60 else text[:57] + '...'}`"


def _same_scalar(a: Any, b: Any) -> bool:
    if type(a) is not type(b):  # `1`, `1.0`, `true` and `"1"` are four values
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or repr(a) == repr(b)  # -0.0 is not 0.0
    return bool(a is b or a == b)


def _first_difference(a: Any, b: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The path of the first place the loader's data ``a`` and ``b`` differ (None: they are equal). Lists
    compare in order, mappings by key (their order carries no meaning: fmt reorders keys)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in a:
            if key not in b:
                return (*path, key)
            found = _first_difference(a[key], b[key], (*path, key))
            if found is not None:
                return found
        extra = [k for k in b if k not in a]
        return (*path, extra[0]) if extra else None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, (*path, i))
            if found is not None:
                return found
        return None if len(a) == len(b) else (*path, min(len(a), len(b)))
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return path
    return None if _same_scalar(a, b) else path


def _refuse_anchors(root: Node, file: str) -> None:
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:  # a node reached twice: an alias
            raise FormatError("", [Diagnostic(file, node.start_mark.line + 1, node.start_mark.column + 1,
                                              "unsupported", "anchors and aliases are not formatted",
                                              "write the value out where the alias is")])
        seen.add(id(node))
        if isinstance(node, MappingNode):
            for k, v in node.value:
                stack += [k, v]
        elif isinstance(node, SequenceNode):
            stack += node.value
