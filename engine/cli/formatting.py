"""``kvpolicy fmt [PATH...]``: rule files in their canonical form (`kvpolicy.policy.fmt`), as ``opa fmt`` does.

PATHs are rule files, rule directories (their ``*.yaml`` and ``connectors/*.yaml``; ``tests/`` holds
case files and is left alone) or ``-`` (stdin). One file: the formatted text on stdout. ``--check``:
exit 1 with a unified diff for each file that is not canonical (CI); ``--diff``: the diffs, exit 0;
``--write``: rewrite the files that change. A file that is not one YAML document, or whose formatted
text would not load to the same rules, is an error, located, left as it was, and the other files are
still done. ``--format json``: one document, per file (docs/json-output.md).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    add_format_flag,
    print_error,
    print_json,
    usage_error,
)
from kvpolicy.policy.errors import Diagnostic, PolicyError
from kvpolicy.policy.files import read_capped, read_stdin_capped, write_atomically

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  kvpolicy fmt my-rules/global.yaml            # the canonical form on stdout
  kvpolicy fmt --check my-rules/               # CI: exit 1 and a diff when a file is not canonical
  kvpolicy fmt --write my-rules/               # rewrite the files that change
  kvpolicy fmt - < rule.yaml                   # stdin
  kvpolicy fmt --check --format json my-rules/ # per file: changed, diff, errors

canonical: fixed key order (version, connector, member_preferences, defaults, rules; a rule's id,
description, reference, enforcement, when, forbid/require/prefer, weight), block style for rules and
all/any/not, one-line leaves and patterns, two-space indentation; comments and single blank lines
are kept (docs/cli.md says where); the meaning never changes: the loader reads the file and the
formatted text, and a file whose values would differ is refused, located, and left as it was

exit codes: 0 done (or every file canonical), 1 --check found a file to reformat or a file is not
YAML, 2 usage error
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("fmt", help="format rule files canonically (--check for CI, --write to rewrite)",
                         description="Rewrite rule files in the canonical form: key order, styles, indentation; "
                                     "comments kept, meaning unchanged.",
                         epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH", help="rule files, rule directories, or - for stdin")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1, with a diff, when some file is not canonical")
    mode.add_argument("--diff", action="store_true", help="print a unified diff for each file that would change")
    mode.add_argument("-w", "--write", action="store_true", help="rewrite the files that change, in place")
    add_format_flag(p)
    p.set_defaults(run=run)


_ANCHORED_FROM = 2000  # lines: below, difflib's own diff (quick there, and what every earlier version printed)


class _Anchored(difflib.SequenceMatcher):  # type: ignore[type-arg]
    """difflib's matcher, anchored as patience diff is: lines that occur once in each text, in the same order
    in both, match; the pieces between them are matched by difflib alone. difflib over a whole large rule file,
    whose lines repeat (`forbid: {placement: cross_layer}`), is quadratic: `fmt --check` of a 1 MB file took
    half a minute, where the anchored diff takes a second."""

    def get_matching_blocks(self) -> list[difflib.Match]:
        if self.matching_blocks is not None:
            return self.matching_blocks  # type: ignore[no-any-return]
        a, b = self.a, self.b
        in_a, in_b = Counter(a), Counter(b)
        where_b = {line: j for j, line in enumerate(b) if in_b[line] == 1}
        pairs = [(i, where_b[line]) for i, line in enumerate(a) if in_a[line] == 1 and line in where_b]
        blocks: list[tuple[int, int, int]] = []
        i0 = j0 = 0
        for i, j in [*_increasing(pairs), (len(a), len(b))]:
            piece = difflib.SequenceMatcher(None, a[i0:i], b[j0:j], autojunk=False)
            blocks += [(i0 + x, j0 + y, n) for x, y, n in piece.get_matching_blocks() if n]
            if i < len(a):
                blocks.append((i, j, 1))
            i0, j0 = i + 1, j + 1
        merged: list[tuple[int, int, int]] = []
        for x, y, n in blocks:  # adjacent blocks as one, as difflib returns them
            if merged and merged[-1][0] + merged[-1][2] == x and merged[-1][1] + merged[-1][2] == y:
                merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
            else:
                merged.append((x, y, n))
        self.matching_blocks = [difflib.Match(*m) for m in [*merged, (len(a), len(b), 0)]]
        return self.matching_blocks  # type: ignore[no-any-return]


def _increasing(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest run of ``pairs`` (in order of their first item) whose second items increase."""
    tails: list[int] = []  # tails[k]: the index in pairs ending the best run of length k + 1
    before: list[int] = [-1] * len(pairs)
    for k, (_, j) in enumerate(pairs):
        at = _bisect(pairs, tails, j)
        if at:
            before[k] = tails[at - 1]
        if at == len(tails):
            tails.append(k)
        else:
            tails[at] = k
    out: list[tuple[int, int]] = []
    k = tails[-1] if tails else -1
    while k >= 0:
        out.append(pairs[k])
        k = before[k]
    return out[::-1]


def _bisect(pairs: list[tuple[int, int]], tails: list[int], j: int) -> int:
    """The first run in ``tails`` whose last second item is not below ``j``."""
    lo, hi = 0, len(tails)
    while lo < hi:
        mid = (lo + hi) // 2
        if pairs[tails[mid]][1] < j:
            lo = mid + 1
        else:
            hi = mid
    return lo


def unified_diff(a: list[str], b: list[str], fromfile: str, tofile: str) -> str:
    """The unified diff of the lines ``a`` and ``b`` (with their line ends), as `difflib.unified_diff` writes it;
    over 2,000 lines matched by `_Anchored`, so that a large file is diffed in about linear time."""
    if len(a) + len(b) < _ANCHORED_FROM:
        return "".join(difflib.unified_diff(a, b, fromfile=fromfile, tofile=tofile))

    def span(start: int, stop: int) -> str:
        length = stop - start
        return f"{start + 1}" if length == 1 else f"{start if not length else start + 1},{length}"

    out: list[str] = []
    for group in _Anchored(None, a, b, autojunk=False).get_grouped_opcodes(3):
        if not out:
            out += [f"--- {fromfile}\n", f"+++ {tofile}\n"]
        first, last = group[0], group[-1]
        out.append(f"@@ -{span(first[1], last[2])} +{span(first[3], last[4])} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + line for line in a[i1:i2]]
                continue
            out += ["-" + line for line in a[i1:i2]] + ["+" + line for line in b[j1:j2]]
    return "".join(out)  # a last line without its line end is written as difflib writes it


def _files(paths: list[str]) -> list[str]:
    out: list[str] = []
    for raw in paths:
        p = Path(raw)
        if raw == "-":
            out.append(raw)
        elif p.is_dir():
            found = sorted([*p.glob("*.yaml"), *p.glob("*.yml"), *p.glob("connectors/*.yaml"),
                            *p.glob("connectors/*.yml")])
            if not found:
                raise usage_error(raw, "no rule files (`*.yaml`, `connectors/*.yaml`) here", "pass a rule directory")
            out += [str(f) for f in found]
        elif p.is_file() or p.exists():  # a FIFO or device: read_capped says what it is, never opening it
            out.append(raw)
        else:
            raise usage_error(raw, "no such file or directory", "pass rule files, rule directories, or -")
    return out


def _read(name: str) -> tuple[str | None, list[Diagnostic]]:
    """A rule file or stdin, read as the loader reads it: bounded, UTF-8 without a byte-order mark."""
    from kvpolicy.policy.load import Limits

    cap = Limits().max_file_bytes
    return read_stdin_capped(sys.stdin, "<stdin>", cap) if name == "-" else read_capped(Path(name), name, cap)


def run(args: argparse.Namespace) -> int:
    from kvpolicy.policy.fmt import format_rule_file

    files = _files(args.paths)
    as_json = args.format == "json"
    if not (args.check or args.diff or args.write) and len(files) > 1:
        raise usage_error("PATH", f"{len(files)} files: the formatted text of one file goes to stdout",
                          "pass one file, or --check, --diff or --write")
    if args.write and "-" in files:
        raise usage_error("--write", "stdin cannot be rewritten", "drop --write to print the formatted text")
    failed = changed = 0
    report: list[dict[str, Any]] = []
    for name in files:
        shown = "<stdin>" if name == "-" else name
        entry: dict[str, Any] = {"file": shown, "ok": True, "changed": False, "written": False, "diagnostics": []}
        report.append(entry)
        text, problems = _read(name)
        try:
            if text is None:
                raise PolicyError(f"cannot read `{shown}`", problems)
            formatted = format_rule_file(text, shown)
        except PolicyError as exc:  # the file is left as it is: nothing is printed or written for it
            print_error(exc)  # on stderr, in every format
            entry.update(ok=False, diagnostics=[d.to_dict() for d in exc.diagnostics])
            failed += 1
            continue
        entry["changed"] = formatted != text
        if not (args.check or args.diff or args.write):
            if as_json:
                entry["formatted"] = formatted
            else:  # the file's text, exact (escaped on a terminal only): `fmt - < a.yaml > b.yaml` is a copy
                getattr(sys.stdout, "write_exact", sys.stdout.write)(formatted)
            continue
        if formatted == text:
            continue
        changed += 1
        if args.write:
            try:
                write_atomically(name, formatted)
            except OSError as exc:  # a full disk, a read-only directory: the old file is whole
                err = PolicyError(f"cannot write `{shown}`", [Diagnostic(
                    shown, 0, 0, "unwritable", f"cannot write the file: {exc.strerror or exc}",
                    "the file is as it was; free space or fix the permissions and run again")])
                print_error(err)
                entry.update(ok=False, diagnostics=[d.to_dict() for d in err.diagnostics])
                failed += 1
                continue
            entry["written"] = True
            print(f"formatted: {shown}", file=sys.stderr)
        else:
            diff = unified_diff(text.splitlines(keepends=True), formatted.splitlines(keepends=True),
                                f"{shown} (as written)", f"{shown} (kvpolicy fmt)")
            if as_json:
                entry["diff"] = diff
            else:
                sys.stdout.write(diff)
    if args.check and changed:
        print(f"{changed} file(s) would be reformatted: kvpolicy fmt --write {' '.join(args.paths)}",
              file=sys.stderr)
    code = EXIT_FAILED if failed or (args.check and changed) else EXIT_OK
    if as_json:
        mode = "check" if args.check else "diff" if args.diff else "write" if args.write else "print"
        print_json({"ok": code == EXIT_OK, "mode": mode, "changed": changed, "failed": failed, "files": report})
    return code
