"""The rule layers of a deployment: the shipped rules of its release profile, then an operator's
directories in the order given (`kvpolicy.policy.layers` composes them).

``--rules A --rules B`` (``LayoutEngine.from_path([A, B])``, ``KVPOLICY_RULES=A:B``) decides
with the layers ``rules/<profile>``, A, B. Replacing the shipped rules is explicit
(``--no-shipped-rules``, ``shipped_rules=False``, ``KVPOLICY_SHIPPED_RULES=0``) and warns for
each shipped forbid or require that the geometry verifier shows load-bearing for the profile
(``kvpolicy lint``'s `safety` rules: without it the rules let a layout whose views overlap
through for some input of the profile's space) and that the replacing rules do not restate.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvpolicy.policy.errors import Diagnostic, RuleLoadError
from kvpolicy.policy.layers import compose_layers
from kvpolicy.policy.load import Limits, load_rules
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["NO_SHIPPED_FLAG", "dropped_guards", "load_layers", "load_bearing_guards"]

NO_SHIPPED_FLAG = "--no-shipped-rules"

RulesArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None


def rule_dirs(rules: RulesArg) -> list[Path]:
    """``rules`` as a list of directories: None is none, one path is one."""
    if rules is None:
        return []
    if isinstance(rules, (str, os.PathLike)):
        return [Path(rules)]
    return [Path(r) for r in rules]


def load_layers(rules: RulesArg = None, *, vllm_version: str | ReleaseProfile | None = None,
                shipped_rules: bool = True, limits: Limits = Limits(),
                display: Sequence[str] | None = None, where: str = NO_SHIPPED_FLAG) -> RuleSet:
    """The layered rule set: the profile's shipped rules (unless ``shipped_rules`` is False), then
    each directory of ``rules``, bottom first; ``display`` shows each directory in locations.

    Raises `RuleLoadError` listing every problem of every layer. Without the shipped layer the
    result's ``warnings`` name each load-bearing shipped guard that is gone (`dropped_guards`),
    located at ``where`` (the flag or setting that dropped them).
    """
    from kvpolicy.engine.layout_engine import shipped_rules_dir

    profile = get_profile(vllm_version)
    dirs = rule_dirs(rules)
    shown = list(display) if display is not None else [str(d) for d in dirs]
    todo: list[tuple[Path, str, bool]] = []
    if shipped_rules:
        todo.append((shipped_rules_dir(profile), f"rules/{profile.rules}", True))
    elif not dirs:
        raise RuleLoadError("", [Diagnostic(where, 0, 0, "no-rules", "no rules left: the shipped rules are "
                                            "replaced and no rule directory is given",
                                            "give a rule directory (--rules DIR), or keep the shipped rules")])
    seen: set[Path] = set()
    for d, s in zip(dirs, shown, strict=True):
        todo.append((d, s, False))
    layers: list[tuple[RuleSet, bool]] = []
    diags: list[Diagnostic] = []
    for path, name, shipped in todo:
        key = path.resolve() if path.exists() else path.absolute()
        if key in seen:  # the same directory twice is one layer, at its first position
            continue
        seen.add(key)
        try:
            layers.append((load_rules(path, limits=limits, display=name), shipped))
        except RuleLoadError as exc:
            diags += exc.diagnostics
    if diags:
        raise RuleLoadError(f"{len(diags)} error(s) in rule set `{' + '.join(n for _p, n, _s in todo)}`", diags)
    ruleset = compose_layers(layers)
    if not shipped_rules:
        ruleset = replace(ruleset, warnings=(*ruleset.warnings, *dropped_guards(ruleset, profile, where)))
    return ruleset


@functools.lru_cache(maxsize=8)
def load_bearing_guards(profile_name: str) -> tuple[tuple[CompiledRule, tuple[str, ...]], ...]:
    """The shipped forbids/requires of the profile that ``kvpolicy lint`` finds `safety` load-bearing,
    each with example inputs. Deterministic for a profile, so computed once per process."""
    from kvpolicy.engine.analysis import lint
    from kvpolicy.engine.layout_engine import LayoutEngine

    shipped = LayoutEngine.default(profile_name).ruleset
    report = lint(shipped, vllm_version=profile_name, baseline=shipped)
    return tuple((shipped.rule(lb.rule.id), tuple(lb.examples)) for lb in report.load_bearing
                 if lb.kind == "safety")


def dropped_guards(ruleset: RuleSet, vllm_version: str | ReleaseProfile | None = None,
                   where: str = NO_SHIPPED_FLAG) -> list[Diagnostic]:
    """A warning for each load-bearing shipped guard of the profile that ``ruleset`` does not
    hold word for word (same scope, same rule)."""
    profile = get_profile(vllm_version)
    have = [(r.scope, r.rule) for r in ruleset.rules]  # rules are not hashable: compared by equality
    out = []
    for guard, examples in load_bearing_guards(profile.name):
        if (guard.scope, guard.rule) in have:
            continue
        example = f"; e.g. {examples[0].rsplit(': ', 1)[0]}" if examples else ""
        out.append(Diagnostic(where, 0, 0, "dropped-guard",
                              f"shipped {guard.effect.value} `{guard.id}` ({guard.source}) is not in these rules, "
                              f"and the verifier shows it load-bearing for `{profile.name}`: without it the rules "
                              f"let a layout whose views overlap through{example}",
                              "keep the shipped rules (drop the flag: your directories layer on top of them), "
                              "or copy the rule into your rules"))
    return out
