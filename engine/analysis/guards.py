"""Load-bearing shipped guards that a replacement of the shipped rules drops.

``--no-shipped-rules`` (``shipped_rules=False``, ``KVPOLICY_SHIPPED_RULES=0``) is allowed, and
warns for each shipped forbid/require that ``kvpolicy lint`` finds `safety` load-bearing in the
profile (removing it lets the decision pick a layout the geometry verifier rejects, for some
input of the profile's space) and that the replacing rules do not restate word for word.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from kvpolicy.engine.analysis.lint import lint
from kvpolicy.engine.rule_layers import NO_SHIPPED_FLAG, RulesArg, load_layers
from kvpolicy.policy.errors import Diagnostic
from kvpolicy.policy.load import Limits
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["dropped_guards", "load_bearing_guards", "load_checked"]


def load_checked(rules: RulesArg = None, *, vllm_version: str | ReleaseProfile | None = None,
                 shipped_rules: bool = True, limits: Limits = Limits(), display: list[str] | None = None,
                 where: str = NO_SHIPPED_FLAG) -> RuleSet:
    """`load_layers`, plus a ``warnings`` entry (located at ``where``) for each load-bearing shipped
    guard that is gone when ``shipped_rules`` is False."""
    ruleset = load_layers(rules, vllm_version=vllm_version, shipped_rules=shipped_rules, limits=limits,
                          display=display, where=where)
    if shipped_rules:
        return ruleset
    return replace(ruleset, warnings=(*ruleset.warnings, *dropped_guards(ruleset, vllm_version, where)))


@functools.lru_cache(maxsize=8)
def load_bearing_guards(profile_name: str) -> tuple[tuple[CompiledRule, tuple[str, ...]], ...]:
    """The shipped forbids/requires of the profile that ``kvpolicy lint`` finds `safety` load-bearing,
    each with example inputs. Deterministic for a profile, so computed once per process."""
    shipped = load_layers(vllm_version=profile_name)
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
