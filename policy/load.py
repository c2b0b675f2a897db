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
import errno
import os
import re
from dataclasses import replace
from pathlib import Path

from kvpolicy.policy.errors import Diagnostic, RuleLoadError, shown_file
from kvpolicy.policy.files import read_capped
from kvpolicy.policy.layouts import ALL_LAYOUTS, Layout
from kvpolicy.policy.rule_model import MemberPreferences, Rule, RuleFile, Waiver
from kvpolicy.policy.ruleset import RuleSet, Source
from kvpolicy.policy.validate import validate_file
from kvpolicy.policy.waivers import waiver_problems
from kvpolicy.policy.yaml_source import Limits, Located, parse_yaml

__all__ = ["Limits", "load_rule_file", "load_rules", "load_rules_from_texts", "rule_files"]

RULE_FILE_SUFFIXES = (".yaml", ".yml")  # rule files, and policy test files beside them


def _listing(d: Path) -> list[Path]:
    """``d``'s entries, sorted; [] when it cannot be listed (`_unlistable` reports that)."""
    try:
        return sorted(d.iterdir())
    except OSError:
        return []


def _unlistable(root: Path, shown_root: str) -> list[Diagnostic]:
    """A rules directory or its `connectors/` that exists but cannot be listed: located, never an OSError."""
    diags = []
    for d, shown in ((root, shown_root), (root / "connectors", os.path.join(shown_root, "connectors"))):
        try:
            if d.is_dir():
                next(iter(d.iterdir()), None)
        except OSError as exc:
            diags.append(Diagnostic(shown, 0, 0, "unreadable", f"cannot list the directory: {exc.strerror or exc}",
                                    "check its permissions"))
    return diags


def rule_files(root: Path) -> list[tuple[Path, bool]]:
    """The rule files under ``root`` as (path, in_connectors_dir), sorted."""
    found = [(p, False) for p in _listing(root) if p.suffix in RULE_FILE_SUFFIXES]
    conn = root / "connectors"
    if conn.is_dir():
        found += [(p, True) for p in _listing(conn) if p.suffix in RULE_FILE_SUFFIXES]
    return found


def _holds_yaml(d: Path) -> bool:
    try:
        return any(q.suffix.lower() in RULE_FILE_SUFFIXES for q in d.rglob("*"))
    except OSError:
        return False


_KNOWN_DIRS = ("connectors", "tests")


def _resolved(d: Path) -> Path | None:
    try:
        return d.resolve(strict=True)
    except (OSError, RuntimeError):
        return None


def stray_files(root: Path, shown_root: str) -> list[Diagnostic]:
    """Rule-looking files the loader would not read: misspelt directories, upper-case suffixes."""
    diags = []
    conn = root / "connectors"
    if os.path.lexists(conn) and not conn.is_dir():
        broken = conn.is_symlink() and not conn.exists()  # dangling, or a loop
        diags.append(Diagnostic(os.path.join(shown_root, "connectors"), 0, 0, "stray-file",
                                ("`connectors` is a symlink to nothing" if broken else
                                 "`connectors` is a file, not a directory") + ": nothing in it is read",
                                "make `connectors/` a directory with one `<Connector>.yaml` per connector"))
    read_dirs = {_resolved(d) for d in (root, conn) if d.is_dir()}  # `connectors` may link to another dir
    for d in (root, conn):
        if not d.is_dir():
            continue
        for p in _listing(d):
            if p.is_file() and p.suffix.lower() in RULE_FILE_SUFFIXES and p.suffix not in RULE_FILE_SUFFIXES:
                diags.append(Diagnostic(os.path.join(shown_root, os.path.relpath(p, root)), 0, 0, "stray-file",
                                        f"`{p.name}` is not read: only `.yaml` and `.yml` files are",
                                        f"rename it to `{p.stem}.yaml`"))
    for p in _listing(root):
        if (p.is_dir() and p.name not in _KNOWN_DIRS and not p.name.startswith(".")
                and _resolved(p) not in read_dirs and _holds_yaml(p)):
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
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        reason = "a symbolic link loop" if isinstance(exc, RuntimeError) or exc.errno == errno.ELOOP \
            else exc.strerror or str(exc)
        return fail("unreadable", f"cannot open the file: {reason}", "fix or remove the link")
    if not real.is_relative_to(root.resolve()):
        return fail("outside-root", f"the file links outside the rules directory (to `{real}`)",
                    "copy the file into the rules directory instead of linking it")
    return read_capped(real, shown, limits.max_file_bytes)


def _declared(src: Located, model: RuleFile | None) -> tuple[str | None, list[tuple[int, str]], bool]:
    """What a file declares that other files must not repeat: its connector, its rule ids (by index)
    and whether it has `defaults`; read from the raw data when the file has errors elsewhere, so a
    duplicate id is reported in the same run as everything else."""
    if model is not None:
        return model.connector, list(enumerate(r.id for r in model.rules)), model.defaults is not None
    data = src.data if isinstance(src.data, dict) else {}
    connector = data.get("connector") if isinstance(data.get("connector"), str) else None
    rules = data.get("rules") if isinstance(data.get("rules"), list) else []
    ids = [(i, r["id"]) for i, r in enumerate(rules)
           if isinstance(r, dict) and isinstance(r.get("id"), str) and _RULE_ID.match(r["id"])]
    return connector, ids, isinstance(data.get("defaults"), dict)


_RULE_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")  # `Rule.id`'s pattern and length


def _assemble(files: list[tuple[Located, bool]], limits: Limits, root: str) -> RuleSet:
    diags: list[Diagnostic] = []
    entries: list[tuple[Rule, Source, str | None]] = []
    first_id: dict[str, Source] = {}
    connector_file: dict[str, str] = {}
    connector_at: dict[str, Source] = {}
    order: tuple[Layout, ...] | None = None
    order_file: str | None = None
    modes: dict[str, MemberPreferences] = {}
    valid: list[tuple[Rule, Source, str | None]] = []  # every rule valid on its own: the partial rule set
    waivers: list[tuple[Waiver, Source]] = []
    for src, in_conn in files:
        alone: list[tuple[int, Rule, str | None]] = []
        model, problems = validate_file(src, in_connectors_dir=in_conn, max_rules=limits.max_rules, partial=alone)
        diags += problems
        if model is None:
            valid += [(rule, Source(src.file, *src.position(("rules", i))), conn) for i, rule, conn in alone
                      if not any(v[0].id == rule.id for v in valid) and rule.id not in first_id]
        connector, ids, has_defaults = _declared(src, model)
        if connector is not None:
            if connector in connector_file:
                diags.append(src.diag(("connector",), "duplicate-connector-file",
                                      f"connector `{connector}` already has rules in {connector_file[connector]}",
                                      "keep one file per connector"))
                continue
            connector_file[connector] = src.file
            connector_at[connector] = Source(src.file, *src.position(("connector",)))
        if has_defaults:
            if order_file is not None:
                diags.append(src.diag(("defaults",), "duplicate-defaults",
                                      f"`defaults` already declared in {order_file}", "keep one `defaults` block"))
            order_file = src.file
        for i, rule_id in ids:
            line, col = src.position(("rules", i))
            if rule_id in first_id:
                diags.append(src.diag(("rules", i, "id"), "duplicate-rule-id",
                                      f"rule id `{rule_id}` is already used at {first_id[rule_id]}",
                                      "rule ids are unique across all files of a rule set"))
                continue
            first_id[rule_id] = Source(src.file, line, col)
            if model is not None:
                entries.append((model.rules[i], first_id[rule_id], model.connector))
        if model is None:
            continue
        waivers += [(w, Source(src.file, *src.position(("waivers", j)))) for j, w in enumerate(model.waivers)]
        if model.defaults is not None:
            order = tuple(Layout.parse(t) for t in model.defaults.layout_order)
        if model.connector and model.member_preferences:
            modes[model.connector] = model.member_preferences
    if diags:
        ids = {e[0].id for e in entries}
        partial = replace(RuleSet.build([*entries, *(v for v in valid if v[0].id not in ids)], order or ALL_LAYOUTS,
                                        modes, root, order_declared=order is not None),
                          connector_sources=connector_at)
        raise with_partial(RuleLoadError(f"{len(diags)} error(s) in rule set `{shown_file(root)}`", diags), partial)
    return replace(RuleSet.build(entries, order or ALL_LAYOUTS, modes, root, order_declared=order is not None,
                                 waivers=waivers), connector_sources=connector_at)


def with_partial(exc: RuleLoadError, partial: RuleSet | None) -> RuleLoadError:
    """``exc`` carrying ``partial``: the rules that did load (every valid rule of every file), so that the
    warnings about them (a near connector name, a literal no release produces) are said in the same run as
    the errors (`kvpolicy.policy.layers.partial_warnings`)."""
    exc.partial = partial  # type: ignore[attr-defined]
    return exc


def load_rules(path: str | os.PathLike[str], *, limits: Limits = Limits(), display: str | None = None) -> RuleSet:
    """Load every rule file under ``path``; raises `RuleLoadError` listing every problem.

    ``display`` replaces ``path`` in locations (the shipped rules show as ``rules/...``).
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise RuleLoadError("", [Diagnostic("path", 0, 0, "invalid-input",
                                            f"`path` must be a directory path (str or os.PathLike), "
                                            f"got {type(path).__name__}",
                                            "pass the directory holding global.yaml and connectors/")])
    root = Path(path)
    shown_root = display if display is not None else str(path)
    try:
        is_dir = root.is_dir()
    except OSError as exc:  # is_dir answers False for most errors, not for a name longer than the system allows
        raise RuleLoadError("", [Diagnostic(shown_root, 0, 0, "unreadable", f"cannot look the directory up: "
                                            f"{exc.strerror or exc}", "check the path")]) from None
    if not is_dir:
        raise RuleLoadError("", [Diagnostic(shown_root, 0, 0, "no-rules-dir", "not a directory",
                                            "pass the directory holding global.yaml and connectors/")])
    located: list[tuple[Located, bool]] = []
    diags: list[Diagnostic] = stray_files(root, shown_root) + _unlistable(root, shown_root)
    files = rule_files(root)
    if not files and not diags:
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
    partial = None
    try:
        ruleset = _assemble(located, limits, shown_root)
        partial = ruleset
    except RuleLoadError as exc:
        diags += exc.diagnostics
        partial = getattr(exc, "partial", None)
    if diags:
        raise with_partial(RuleLoadError(f"{len(diags)} error(s) in rule set `{shown_file(shown_root)}`", diags),
                           partial)
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
        errors, lapsed = waiver_problems(ruleset)  # the whole rule set is here: a waiver names one of its rules
        diags += errors
        ruleset = replace(ruleset, warnings=(*ruleset.warnings, *lapsed))
    except RuleLoadError as exc:
        diags += exc.diagnostics
    if diags:
        raise RuleLoadError(f"{len(diags)} error(s) in rule set", diags)
    return ruleset


def load_rule_file(text: str, shown: str, *, connector_file: bool | None = None,
                   limits: Limits = Limits()) -> RuleSet:
    """One rule file on its own (``kvpolicy validate FILE``, ``validate -``), located as ``shown``.

    ``connector_file`` None: the file is a connector file when it declares ``connector:`` (on disk the
    directory says so; a file alone has only its content). Raises `RuleLoadError` listing every problem.
    """
    if len(text.encode()) > limits.max_file_bytes:
        raise RuleLoadError("", [Diagnostic(shown, 1, 1, "too-large", f"the file is over the "
                                            f"{limits.max_file_bytes}-byte limit", "split it")])
    src, diags = parse_yaml(text, shown, limits)
    if src is None:
        raise RuleLoadError(f"{len(diags)} error(s) in rule file `{shown}`", diags)
    if connector_file is None:
        connector_file = isinstance(src.data, dict) and src.data.get("connector") is not None
    partial = None
    try:
        ruleset = _assemble([(src, connector_file)], limits, shown)
        partial = ruleset
    except RuleLoadError as exc:
        diags += exc.diagnostics
        partial = getattr(exc, "partial", None)
    if diags:
        raise with_partial(RuleLoadError(f"{len(diags)} error(s) in rule file `{shown}`", diags), partial)
    return ruleset
