"""``kvpolicy releases``: the vLLM release profiles kvpolicy ships, and what changed between two.

Without arguments, one line per profile: the vLLM versions it answers for, the profile it
extends, how the release decides (``use_uniform_kv_cache`` gate or ``resolve_kv_cache_layout``),
its default block size and its shipped rule layers. With two profiles (names or versions), what
changed from the first to the second: every release fact that differs (compared by meaning,
`kvpolicy.policy.release_diff`) and every shipped rule added, removed or changed. Decision path
only: no torch, no vLLM.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvpolicy.engine.cli.common import EXIT_OK, HelpFormatter, add_format_flag, print_json, usage_error
from kvpolicy.policy.errors import InputError

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  kvpolicy releases                      # every profile, newest first
  kvpolicy releases 0.33 0.34            # what vLLM 0.34 changed from 0.33 (facts and shipped rules)
  kvpolicy releases vllm-0.28 vllm-0.29 --format json
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "releases", help="list the vLLM release profiles, or show what changed between two",
        description="List kvpolicy's vLLM release profiles, or show what changed between two of them: the "
                    "release facts (layouts, backends, kv_cache_dtypes, connectors, ...) and the shipped rules.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("old", nargs="?", metavar="FROM", help="a profile name (vllm-0.33) or a vLLM version (0.33.0)")
    p.add_argument("new", nargs="?", metavar="TO", help="the profile or version to compare FROM with")
    add_format_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvpolicy.policy.releases import get_profile, profile_names

    if args.old is None:
        rows = [_row(get_profile(name)) for name in profile_names()]
        if args.format == "json":
            print_json({"profiles": rows})
        else:
            for r in rows:
                versions = ", ".join(r["vllm_versions"]) or "not a release"
                print(f"{r['name']:<12} {versions:<16} {r['resolver']:<26} block {r['default_block_size']:<3} "
                      f"extends {r['extends'] or '-':<11} rules {' + '.join(r['rules'])}")
        return EXIT_OK
    if args.new is None:
        raise usage_error("FROM", "give two profiles to compare (FROM TO), or none to list them all")
    old, new = _profile(args.old, "FROM"), _profile(args.new, "TO")
    report = compare(old, new)
    if args.format == "json":
        print_json(report)
        return EXIT_OK
    print(f"from {old.name} ({old.version_label}) to {new.name} ({new.version_label}):")
    print(f"  facts: {len(report['facts'])} differ")
    for line in report["facts"]:
        print(f"    {line}")
    rules = report["rules"]
    print(f"  shipped rules: {len(rules['added'])} added, {len(rules['removed'])} removed, "
          f"{len(rules['changed'])} changed")
    for kind in ("added", "removed", "changed"):
        for rule in rules[kind]:
            print(f"    {kind:<8} {rule}")
    return EXIT_OK


def compare(old: Any, new: Any) -> dict[str, Any]:
    """The differences between two profiles: release facts (``path: old -> new`` lines) and shipped
    rule ids added, removed, or changed in meaning (same id, another condition, effect or scope)."""
    from kvpolicy.policy.release_diff import canonical_facts, fact_differences

    before, after = _shipped_rules(old), _shipped_rules(new)
    return {
        "from": old.name, "to": new.name,
        "facts": fact_differences(canonical_facts(old, stated=True), canonical_facts(new, stated=True)),
        "rules": {"added": sorted(after.keys() - before.keys()), "removed": sorted(before.keys() - after.keys()),
                  "changed": sorted(k for k in before.keys() & after.keys() if before[k] != after[k])},
    }


def _shipped_rules(profile: Any) -> dict[str, Any]:
    from kvpolicy.engine.rule_layers import load_layers

    ruleset = load_layers(vllm_version=profile)
    return {r.rule.id: (r.scope, r.rule.model_dump(mode="json", exclude={"description", "reference"}))
            for r in ruleset.rules}


def _row(profile: Any) -> dict[str, Any]:
    rules = profile.rules if isinstance(profile.rules, (list, tuple)) else [profile.rules]
    return {"name": profile.name, "vllm_versions": list(profile.vllm_versions), "extends": profile.extends,
            "resolver": {"uniform_gate": "use_uniform_kv_cache gate",
                         "kv_cache_layout": "resolve_kv_cache_layout"}[profile.resolver.value],
            "default_block_size": profile.default_block_size, "rules": [f"rules/{r}" for r in rules],
            "historical": profile.historical}


def _profile(name: str, where: str) -> Any:
    from kvpolicy.policy.releases import get_profile

    try:
        return get_profile(name)
    except InputError as exc:
        d = exc.diagnostics[0]
        raise usage_error(where, d.message, d.help) from None
