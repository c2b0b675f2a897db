"""Load a rule directory: read, parse, validate, cross-check, compile; fail closed.

Layout of a rule directory::

    <dir>/*.yaml                 global rules (usually one global.yaml)
    <dir>/connectors/*.yaml      rules scoped to the connector each file names
    <dir>/tests/                 policy tests (ignored here; see `kvpolicy test`)

Every problem in every file is collected before raising one `RuleLoadError`;
a rule set with any error is never returned.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from kvpolicy.policy.errors import Diagnostic, RuleLoadError
from kvpolicy.policy.layouts import ALL_LAYOUTS, Layout
from kvpolicy.policy.rule_model import MemberPreferences, Rule, RuleFile
from kvpolicy.policy.ruleset import RuleSet, Source
from kvpolicy.policy.validate import validate_file
from kvpolicy.policy.yaml_source import Limits, Located, parse_yaml

__all__ = ["Limits", "load_rules", "load_rules_from_texts", "rule_files"]

RULE_FILE_SUFFIXES = (".yaml", ".yml")  # rule files, and policy test files beside them


def rule_files(root: Path) -> list[tuple[Path, bool]]:
    """The rule files under ``root`` as (path, in_connectors_dir), sorted."""
    found = [(p, False) for p in sorted(root.iterdir()) if p.suffix in RULE_FILE_SUFFIXES]
    conn = root / "connectors"
    if conn.is_dir():
        found += [(p, True) for p in sorted(conn.iterdir()) if p.suffix in RULE_FILE_SUFFIXES]
    return found


_KNOWN_DIRS = ("connectors", "tests")


def stray_files(root: Path, shown_root: str) -> list[Diagnostic]:
    """Rule-looking files the loader would not read: misspelt directories, upper-case suffixes."""
    diags = []
    for d in (root, root / "connectors"):
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.is_file() and p.suffix.lower() in RULE_FILE_SUFFIXES and p.suffix not in RULE_FILE_SUFFIXES:
                diags.append(Diagnostic(os.path.join(shown_root, os.path.relpath(p, root)), 0, 0, "stray-file",
                                        f"`{p.name}` is not read: only `.yaml` and `.yml` files are",
                                        f"rename it to `{p.stem}.yaml`"))
    for p in sorted(root.iterdir()):
        if p.is_dir() and p.name not in _KNOWN_DIRS and not p.name.startswith(".") and \
                any(q.suffix.lower() in RULE_FILE_SUFFIXES for q in p.rglob("*")):
            close = difflib.get_close_matches(p.name, _KNOWN_DIRS, n=1)
            diags.append(Diagnostic(os.path.join(shown_root, p.name), 0, 0, "stray-directory",
                                    f"rule files in `{p.name}/` are not read",
                                    (f"did you mean `{close[0]}/`? " if close else "")
                                    + "connector rules go in `connectors/`, policy tests in `tests/`"))
    return diags


def _read(path: Path, shown: str, root: Path, limits: Limits) -> tuple[str | None, list[Diagnostic]]:
    def fail(code: str, message: str, help: str | None = None, line: int = 0, col: int = 0) -> tuple[None, list]:
        return None, [Diagnostic(shown, line, col, code, message, help)]

    try:
        real = path.resolve(strict=True)
    except OSError as exc:
        return fail("unreadable", f"cannot open the file: {exc.strerror or exc}")
    if not real.is_relative_to(root.resolve()):
        return fail("outside-root", f"the file links outside the rules directory (to `{real}`)",
                    "copy the file into the rules directory instead of linking it")
    if not real.is_file():
        return fail("not-a-file", "not a regular file")
    try:
        size = real.stat().st_size
        if size > limits.max_file_bytes:
            return fail("too-large", f"the file is {size} bytes, over the {limits.max_file_bytes}-byte limit",
                        "split it, or raise Limits.max_file_bytes")
        raw = real.read_bytes()
    except OSError as exc:
        return fail("unreadable", f"cannot read the file: {exc.strerror or exc}", "check its permissions")
    if raw.startswith(b"\xef\xbb\xbf"):
        return fail("bom", "the file starts with a byte-order mark", "save it as UTF-8 without BOM", 1, 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - (before.rfind(b"\n") + 1) + 1
        return fail("encoding", f"invalid UTF-8 byte 0x{raw[exc.start]:02x}", "save the file as UTF-8", line, col)
    return text, []


def _assemble(files: list[tuple[Located, bool]], limits: Limits, root: str) -> RuleSet:
    diags: list[Diagnostic] = []
    entries: list[tuple[Rule, Source, str | None]] = []
    first_id: dict[str, Source] = {}
    connector_file: dict[str, str] = {}
    order: tuple[Layout, ...] | None = None
    order_file: str | None = None
    modes: dict[str, MemberPreferences] = {}
    for src, in_conn in files:
        model, problems = validate_file(src, in_connectors_dir=in_conn, max_rules=limits.max_rules)
        diags += problems
        if model is None:
            continue
        _collect(src, model, entries, first_id, connector_file, diags)
        if model.defaults is not None:
            if order_file is not None:
                diags.append(src.diag(("defaults",), "duplicate-defaults",
                                      f"`defaults` already declared in {order_file}", "keep one `defaults` block"))
            order = tuple(Layout.parse(t) for t in model.defaults.layout_order)
            order_file = src.file
        if model.connector and model.member_preferences:
            modes[model.connector] = model.member_preferences
    if diags:
        raise RuleLoadError(f"{len(diags)} error(s) in rule set `{root}`", diags)
    return RuleSet.build(entries, order or ALL_LAYOUTS, modes, root, order_declared=order is not None)


def _collect(src: Located, model: RuleFile, entries: list, first_id: dict[str, Source],
             connector_file: dict[str, str], diags: list[Diagnostic]) -> None:
    if model.connector is not None:
        if model.connector in connector_file:
            diags.append(src.diag(("connector",), "duplicate-connector-file",
                                  f"connector `{model.connector}` already has rules in "
                                  f"{connector_file[model.connector]}",
                                  "keep one file per connector"))
            return
        connector_file[model.connector] = src.file
    for i, rule in enumerate(model.rules):
        line, col = src.position(("rules", i))
        source = Source(src.file, line, col)
        if rule.id in first_id:
            diags.append(src.diag(("rules", i, "id"), "duplicate-rule-id",
                                  f"rule id `{rule.id}` is already used at {first_id[rule.id]}",
                                  "rule ids are unique across all files of a rule set"))
            continue
        first_id[rule.id] = source
        entries.append((rule, source, model.connector))


def load_rules(path: str | os.PathLike[str], *, limits: Limits = Limits(), display: str | None = None) -> RuleSet:
    """Load every rule file under ``path``; raises `RuleLoadError` listing every problem.

    ``display`` replaces ``path`` in locations (the shipped rules show as ``rules/...``).
    """
    root = Path(path)
    shown_root = display if display is not None else str(path)
    if not root.is_dir():
        raise RuleLoadError("", [Diagnostic(shown_root, 0, 0, "no-rules-dir", "not a directory",
                                            "pass the directory holding global.yaml and connectors/")])
    located: list[tuple[Located, bool]] = []
    diags: list[Diagnostic] = stray_files(root, shown_root)
    files = rule_files(root)
    if not files:
        raise RuleLoadError("", [Diagnostic(shown_root, 0, 0, "no-rule-files", "no `.yaml` rule files found",
                                            "add a global.yaml, or point at the right directory")])
    for file, in_conn in files:
        shown = os.path.join(shown_root, os.path.relpath(file, root))
        text, problems = _read(file, shown, root, limits)
        diags += problems
        if text is None:
            continue
        src, problems = parse_yaml(text, shown, limits)
        diags += problems
        if src is not None:
            located.append((src, in_conn))
    try:
        ruleset = _assemble(located, limits, shown_root)
    except RuleLoadError as exc:
        diags += exc.diagnostics
    if diags:
        raise RuleLoadError(f"{len(diags)} error(s) in rule set `{shown_root}`", diags)
    return ruleset


def load_rules_from_texts(texts: dict[str, str], *, limits: Limits = Limits()) -> RuleSet:
    """Load rule files given as ``{relative path: YAML text}`` (tests, embedding).

    Paths under ``connectors/`` are connector files, as on disk.
    """
    located: list[tuple[Located, bool]] = []
    diags: list[Diagnostic] = []
    for name in sorted(texts):
        if len(texts[name].encode()) > limits.max_file_bytes:
            diags.append(Diagnostic(name, 1, 1, "too-large", f"the file is over the {limits.max_file_bytes}-byte limit",
                                    "split it, or raise Limits.max_file_bytes"))
            continue
        src, problems = parse_yaml(texts[name], name, limits)
        diags += problems
        if src is not None:
            located.append((src, name.startswith("connectors/")))
    try:
        ruleset = _assemble(located, limits, "<memory>")
    except RuleLoadError as exc:
        diags += exc.diagnostics
    if diags:
        raise RuleLoadError(f"{len(diags)} error(s) in rule set", diags)
    return ruleset
