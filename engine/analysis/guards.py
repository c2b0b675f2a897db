"""Load-bearing shipped guards that a replacement of the shipped rules drops.

``--no-shipped-rules`` (``shipped_rules=False``, ``KVPOLICY_SHIPPED_RULES=0``) is allowed, and
warns for each shipped forbid/require that ``kvpolicy lint`` finds `safety` load-bearing in the
profile (removing it lets the decision pick a layout the geometry verifier rejects, for some
input of the profile's space) and that the replacing rules do not restate word for word.

Which guards are load-bearing is a lint of the whole shipped profile (vllm-0.28: about 10 CPU s, 0.24-0.27:
more), and the vLLM plugin loads its rules in every vLLM process. So the answers are packaged
(``guard_table.json``), each under a key of what they follow from: the shipped rules' digest and the release
profile's facts. An entry whose key still matches is used; any other profile (or a stale entry) is linted
live, as before. ``python -m kvpolicy.engine.analysis.guards --write`` rewrites the table, ``--check`` compares
it with the live lint of every profile; ``tests/engine/analysis/test_guard_table.py`` checks every key and
the answers of the profiles quick to lint.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvpolicy.engine.analysis.lint import lint
from kvpolicy.engine.rule_layers import NO_SHIPPED_FLAG, RulesArg, load_layers
from kvpolicy.policy.errors import Diagnostic, RuleLoadError, shown_file
from kvpolicy.policy.files import write_atomically
from kvpolicy.policy.layers import with_warnings
from kvpolicy.policy.load import Limits
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["GUARD_TABLE", "dropped_guards", "guard_key", "live_guards", "load_bearing_guards", "load_checked",
           "unwaivable"]

GUARD_TABLE = Path(__file__).with_name("guard_table.json")


def load_checked(rules: RulesArg = None, *, vllm_version: str | ReleaseProfile | None = None,
                 shipped_rules: bool = True, limits: Limits = Limits(), display: list[str] | None = None,
                 where: str = NO_SHIPPED_FLAG) -> RuleSet:
    """`load_layers`, plus a ``warnings`` entry (located at ``where``) for each load-bearing shipped
    guard that is gone when ``shipped_rules`` is False."""
    ruleset = load_layers(rules, vllm_version=vllm_version, shipped_rules=shipped_rules, limits=limits,
                          display=display, where=where)
    refused = unwaivable(ruleset, vllm_version)
    if refused:
        raise with_warnings(RuleLoadError(f"{len(refused)} error(s) in rule set `{shown_file(ruleset.root)}`",
                                          refused), ruleset.warnings)
    if shipped_rules:
        return ruleset
    return replace(ruleset, warnings=(*ruleset.warnings, *dropped_guards(ruleset, vllm_version, where)))


def guard_key(profile_name: str, shipped: RuleSet | None = None) -> str:
    """What a profile's load-bearing guards follow from: its shipped rules' digest and its facts."""
    shipped = load_layers(vllm_version=profile_name) if shipped is None else shipped
    blob = json.dumps({"rules": shipped.digest, "profile": get_profile(profile_name).model_dump(mode="json")},
                      sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def live_guards(profile_name: str, shipped: RuleSet | None = None) -> list[tuple[str, list[str]]]:
    """(rule id, example inputs) of each shipped forbid/require that ``kvpolicy lint`` finds `safety`
    load-bearing in the profile, in lint's order: the lint itself (seconds)."""
    shipped = load_layers(vllm_version=profile_name) if shipped is None else shipped
    report = lint(shipped, vllm_version=profile_name, baseline=shipped)
    return [(lb.rule.id, list(lb.examples)) for lb in report.load_bearing if lb.kind == "safety"]


@functools.cache
def _table() -> dict[str, dict]:
    try:
        data = json.loads(GUARD_TABLE.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # pragma: no cover - a packaging defect: every profile is linted live
        return {}
    return data if isinstance(data, dict) else {}


@functools.lru_cache(maxsize=8)
def load_bearing_guards(profile_name: str) -> tuple[tuple[CompiledRule, tuple[str, ...]], ...]:
    """The shipped forbids/requires of the profile that ``kvpolicy lint`` finds `safety` load-bearing,
    each with example inputs: the packaged answer where its key matches (`guard_key`), else the live lint.
    Deterministic for a profile, so computed once per process."""
    shipped = load_layers(vllm_version=profile_name)
    entry = _table().get(profile_name)
    if isinstance(entry, dict) and entry.get("key") == guard_key(profile_name, shipped):
        rows = [(rule_id, examples) for rule_id, examples in entry["guards"]]
    else:
        rows = live_guards(profile_name, shipped)
    return tuple((shipped.rule(rule_id), tuple(examples)) for rule_id, examples in rows)


def unwaivable(ruleset: RuleSet, vllm_version: str | ReleaseProfile | None = None) -> list[Diagnostic]:
    """An error for each waiver (lapsed ones too: renewing one must not make it valid) of a shipped guard that the
    geometry verifier shows load-bearing for safety in the profile: waiving it would let the decision pick a
    layout whose views overlap. A waiver is for policy (a preference, a site's caution), never for the bytes;
    the verifier refuses an overlapping plan whatever the rules say, and this says so when the rules load,
    not when a deployment starts. Looks the guards up only when some waiver names a rule of the set."""
    named = {w.rule_id for w in ruleset.waivers}
    if not named:
        return []
    profile = get_profile(vllm_version)
    guards = {guard.id: examples for guard, examples in load_bearing_guards(profile.name) if guard.id in named}
    out = []
    for w in ruleset.waivers:
        if w.rule_id in guards:
            example = f"; e.g. {guards[w.rule_id][0].rsplit(': ', 1)[0]}" if guards[w.rule_id] else ""
            out.append(Diagnostic(w.source.file, w.source.line, w.source.col, "unwaivable-rule",
                                  f"rule `{w.rule_id}` is a safety guard: the geometry verifier shows it load-bearing "
                                  f"for `{profile.name}` (without it the rules let a layout whose views overlap "
                                  f"through{example}), and a waiver cannot lift it",
                                  "delete the waiver; if the guard is wrong for your deployment, fix the input it "
                                  "reads (e.g. `--scale-views`) or report it, since the verifier would refuse "
                                  "the overlapping layout anyway"))
    return out


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


def main(argv: list[str] | None = None) -> int:
    """``--write``: lint every profile and write `GUARD_TABLE`; ``--check``: exit 1 where it differs."""
    from kvpolicy.policy.releases import profile_names

    parser = argparse.ArgumentParser(prog="python -m kvpolicy.engine.analysis.guards")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="lint every profile and write the table")
    mode.add_argument("--check", action="store_true", help="exit 1 where the table differs from the live lint")
    args = parser.parse_args(argv)
    table = {name: {"key": guard_key(name), "guards": [list(row) for row in live_guards(name)]}
             for name in profile_names()}
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if args.write:
        write_atomically(GUARD_TABLE, text)
        return 0
    stale = [name for name in table if _table().get(name) != table[name]]
    for name in stale:
        print(f"{GUARD_TABLE.name}: `{name}` differs from the live lint; run with --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
