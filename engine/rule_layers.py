"""The rule layers of a deployment: the shipped rules of its release profile, then an operator's
directories in the order given (`kvpolicy.policy.layers` composes them).

``--rules A --rules B`` (``LayoutEngine.from_path([A, B])``, ``KVPOLICY_RULES=A:B``) decides
with the layers of the profile's shipped rules (``rules/vllm-0.34``; the uniform-gate releases
share a base layer, ``rules/vllm-gate``, and add the layers that differ), then A, B. Replacing
the shipped rules is explicit (``--no-shipped-rules``, ``shipped_rules=False``,
``KVPOLICY_SHIPPED_RULES=0``) and warns for each shipped forbid or require that the geometry
verifier shows load-bearing for the profile (``kvpolicy lint``'s `safety` rules: without it the
rules let a layout whose views overlap through for some input of the profile's space) and that
the replacing rules do not restate: `kvpolicy.engine.analysis.guards`, kept apart so that this
module never imports the analysis.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from kvpolicy.policy.errors import Diagnostic, RuleLoadError, shown_file
from kvpolicy.policy.layers import compose_layers, partial_warnings, with_warnings
from kvpolicy.policy.load import Limits, load_rules
from kvpolicy.policy.releases import ReleaseProfile, get_profile, iter_profiles
from kvpolicy.policy.ruleset import RuleSet

__all__ = [
    "NO_SHIPPED_FLAG",
    "load_layers",
    "rule_dirs",
    "shipped_rules_dir",
    "shipped_rules_dirs",
]

NO_SHIPPED_FLAG = "--no-shipped-rules"

RulesArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None


def rule_dirs(rules: RulesArg) -> list[Path]:
    """``rules`` as a list of directories: None is none, one path is one."""
    if rules is None:
        return []
    if isinstance(rules, (str, os.PathLike)):
        return [Path(rules)]
    return [Path(r) for r in rules]


def shipped_rules_dirs(vllm_version: str | ReleaseProfile | None = None) -> tuple[Path, ...]:
    """The shipped rule directories of a release profile (default: the default profile's), bottom
    layer first, e.g. ``(rules/vllm-gate, rules/vllm-gate-per-token-head)``: beside the source
    tree, or in the installed package data."""
    return tuple(_shipped(sub) for sub in get_profile(vllm_version).rules)


def _shipped(sub: str) -> Path:
    here = Path(__file__).resolve().parent.parent / "rules"
    if (here / sub / "global.yaml").is_file():
        return here / sub
    # installed from a wheel: package data `kvpolicy.rules`, a namespace package (no __init__.py)
    spec = importlib.util.find_spec("kvpolicy.rules")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / sub
    return here / sub  # not found: the loader reports the missing directory


def shipped_rules_dir(vllm_version: str | ReleaseProfile | None = None) -> Path:
    """The shipped rule directory of a profile whose shipped rules are one directory (``rules/vllm-0.34``).

    A profile whose shipped rules are layers (the uniform-gate releases) has no one directory: a
    ValueError naming them and `shipped_rules_dirs`, which gives every layer.
    """
    profile = get_profile(vllm_version)
    dirs = shipped_rules_dirs(profile)
    if len(dirs) != 1:
        raise ValueError(f"the shipped rules of profile `{profile.name}` are {len(dirs)} layers "
                         f"({profile.rules_label}): use shipped_rules_dirs()")
    return dirs[0]


def _layer_key(path: Path) -> Path:
    """The directory ``path`` reads, to spot one given twice. A path the system refuses to look up (longer
    than it allows, a NUL byte) is its own key: loading it reports why, located, never an OSError here."""
    try:
        return path.resolve() if path.exists() else path.absolute()
    except (OSError, RuntimeError, ValueError):  # RuntimeError: a symlink loop (Python < 3.13)
        return path.absolute()


def load_layers(rules: RulesArg = None, *, vllm_version: str | ReleaseProfile | None = None,
                shipped_rules: bool = True, limits: Limits = Limits(),
                display: Sequence[str] | None = None, where: str = NO_SHIPPED_FLAG) -> RuleSet:
    """The layered rule set: the profile's shipped rule layers (unless ``shipped_rules`` is False),
    then each directory of ``rules``, bottom first; ``display`` shows each directory in locations.

    Raises `RuleLoadError` listing every problem of every layer; ``where`` names the flag or
    setting that dropped the shipped rules when nothing is left. The warnings for load-bearing
    shipped guards that are gone are `kvpolicy.engine.analysis.guards.load_checked`'s.
    """
    profile = get_profile(vllm_version)
    dirs = rule_dirs(rules)
    shown = list(display) if display is not None else [str(d) for d in dirs]
    todo: list[tuple[Path, str, bool]] = []
    if shipped_rules:
        todo += [(path, f"rules/{sub}", True) for path, sub in zip(shipped_rules_dirs(profile), profile.rules,
                                                                   strict=True)]
    elif not dirs:
        raise RuleLoadError("", [Diagnostic(where, 0, 0, "no-rules", "no rules left: the shipped rules are "
                                            "replaced and no rule directory is given",
                                            "give a rule directory (--rules DIR), or keep the shipped rules")])
    seen: set[Path] = set()
    shipped_keys = {_layer_key(p) for p in shipped_rules_dirs(profile)}
    for d, s in zip(dirs, shown, strict=True):  # a shipped directory named as a layer is still the shipped one
        todo.append((d, s, _layer_key(d) in shipped_keys))
    layers: list[tuple[RuleSet, bool]] = []
    partial: list[tuple[RuleSet | None, bool]] = []
    diags: list[Diagnostic] = []
    for path, name, shipped in todo:
        key = _layer_key(path)
        if key in seen:  # the same directory twice is one layer, at its first position
            continue
        seen.add(key)
        try:
            layers.append((load_rules(path, limits=limits, display=name), shipped))
            partial.append(layers[-1])
        except RuleLoadError as exc:
            diags += exc.diagnostics
            partial.append((getattr(exc, "partial", None), shipped))
    if diags:
        names = " + ".join(n for _p, n, _s in todo)
        raise with_warnings(RuleLoadError(f"{len(diags)} error(s) in rule set `{shown_file(names)}`", diags),
                            partial_warnings(partial))
    return compose_layers(layers, shipped_elsewhere)


def shipped_elsewhere(rule_id: str) -> tuple[str, ...]:
    """The release profiles whose shipped rules have ``rule_id``: a waiver of it in an operator's layer that
    several releases share is a note under the others, not an error (`waiver_problems`)."""
    return _shipped_rule_profiles().get(rule_id, ())


@functools.cache
def _shipped_rule_profiles() -> dict[str, tuple[str, ...]]:
    by_id: dict[str, list[str]] = {}
    for profile in iter_profiles():
        for sub in profile.rules:
            try:
                ids = _shipped_ids(sub)
            except RuleLoadError:  # a broken shipped directory is reported where it is loaded
                continue
            for rule_id in ids:
                if profile.name not in by_id.setdefault(rule_id, []):
                    by_id[rule_id].append(profile.name)
    return {k: tuple(v) for k, v in by_id.items()}


@functools.cache
def _shipped_ids(sub: str) -> frozenset[str]:
    return frozenset(rule.id for rule in load_rules(_shipped(sub), display=f"rules/{sub}").all_rules)
