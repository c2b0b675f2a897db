"""``kvpolicy inspect`` (alias ``rules``): the rules in force for a rule stack and release profile.

`opa inspect` lists a bundle's packages and annotations; here each rule with what an operator asks
first: its id, its effect (and ``audit`` when it only warns), the connector it is scoped to, the
layer it comes from (shipped or operator) and where it is written (file:line). ``--connector NAME``
keeps the rules that apply while that connector is configured (global ones and its files', under
the name vLLM loads for it too: `kvpolicy.engine.decide.connector_names_for`).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from kvpolicy.engine.cli.common import (
    EXIT_OK,
    HelpFormatter,
    add_rules_flag,
    add_vllm_version_flag,
    load_ruleset,
    operator_dirs,
    print_json,
)
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["register", "rule_rows", "run", "waiver_rows"]

_EPILOG = """\
examples:
  kvpolicy inspect                               # the shipped rules of the default release profile
  kvpolicy inspect my-rules/ --vllm-version 0.34.0   # my-rules/ on the shipped rules: which layer has what
  kvpolicy inspect --connector NixlConnector     # the rules in force with NixlConnector configured
  kvpolicy rules my-rules/ --format json | jq .rules
  kvpolicy inspect --brief                       # one line per rule, no descriptions

output: one line per rule: id, effect (`forbid (audit)` for an audit-mode rule), scope (global or the
connector), layer (its index, bottom first, and root) and file:line, then its description (and reference)
indented under it (--brief leaves them out); then the waivers of those rules, each with its owner, expiry
(in force or expired), where it applies and file:line; JSON: docs/cli.md

exit codes: 0 listed, 1 the rules do not load, 2 usage error
"""


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "inspect", aliases=["rules"], help="list the rules in force: id, effect, scope, layer, file:line",
        description="List every rule of the layered rule set (the shipped rules of the release profile, then "
                    "each operator directory) with its effect, scope, layer and location.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("dir", nargs="?", metavar="DIR", help="an operator rule directory on the shipped rules, as "
                                                         "for validate")
    add_rules_flag(p)
    add_vllm_version_flag(p)
    p.add_argument("--connector", metavar="NAME",
                   help="only the rules in force while this connector is configured (global + its files)")
    p.add_argument("--brief", action="store_true",
                   help="text: one line per rule, without its description (JSON always has it)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or json")
    p.set_defaults(run=run)


def _layer(ruleset: RuleSet, rule: CompiledRule) -> tuple[int, str, bool]:
    """(index bottom first, root, shipped?) of the layer ``rule`` comes from."""
    for i, layer in enumerate(ruleset.layers):
        if rule.id in layer.rule_ids:
            return i, layer.root, layer.shipped
    return 0, ruleset.root, False


def rule_rows(ruleset: RuleSet, connector: str | None = None, profile: str | None = None) -> list[dict[str, Any]]:
    """One dict per rule in force, bottom layer first, global rules first, then by file:line: the JSON rows of
    ``inspect``."""
    scopes: set[str | None] | None = None
    if connector is not None:
        from kvpolicy.engine.decide import connector_names_for

        scopes = {None, *connector_names_for(profile or "", connector)}
    rows = []
    for rule in ruleset.all_rules:
        if scopes is not None and rule.scope not in scopes:
            continue
        index, root, shipped = _layer(ruleset, rule)
        r = rule.rule
        rows.append({"id": rule.id, "effect": r.effect.value, "enforcement": "audit" if r.audit else "enforce",
                     "scope": rule.scope or "global", "layer": {"index": index, "root": root, "shipped": shipped},
                     "source": str(rule.source), "pattern": r.pattern.model_dump(mode="json", exclude_none=True),
                     "weight": rule.weight if r.prefer is not None else None, "description": r.description,
                     "reference": r.reference})
    return sorted(rows, key=lambda x: (x["layer"]["index"], x["scope"] != "global", x["source"].rsplit(":", 1)[0],
                                       int(x["source"].rsplit(":", 1)[1]), x["id"]))


def run(args: argparse.Namespace) -> int:
    dirs = operator_dirs(args, "dir")
    ruleset = load_ruleset(dirs, "DIR" if args.dir is not None else "--rules", vllm_version=args.vllm_version,
                           shipped_rules=not args.no_shipped_rules)
    rows = rule_rows(ruleset, args.connector, args.vllm_version)
    waivers = waiver_rows(ruleset, {x["id"] for x in rows})
    layers = [layer.to_dict() for layer in ruleset.layers] or [
        {"root": ruleset.root, "shipped": False, "digest": ruleset.digest, "rules": len(ruleset.all_rules),
         "connectors": list(ruleset.connectors)}]
    if args.format == "json":
        print_json({"root": ruleset.root, "digest": ruleset.digest, "profile": args.vllm_version,
                    "connector": args.connector, "layers": layers, "rules": rows, "waivers": waivers,
                    "warnings": [d.to_dict() for d in ruleset.warnings]})  # what the text prints on stderr
        return EXIT_OK
    what = f" with connector {args.connector}" if args.connector else ""
    print(f"{len(rows)} rules in force{what} ({args.vllm_version}; {ruleset.root}; digest {ruleset.digest[:19]}...)")
    for i, layer in enumerate(layers):
        print(f"  layer {i}: {layer['root']} ({'shipped' if layer['shipped'] else 'operator'}, {layer['rules']} rules)")
    if not rows:
        return EXIT_OK
    effect = [x["effect"] + (" (audit)" if x["enforcement"] == "audit" else "") for x in rows]
    widths = [max(len("ID"), *(len(x["id"]) for x in rows)), max(len("EFFECT"), *(len(e) for e in effect)),
              max(len("SCOPE"), *(len(x["scope"]) for x in rows))]
    print()
    print(f"{'ID':<{widths[0]}}  {'EFFECT':<{widths[1]}}  {'SCOPE':<{widths[2]}}  LAYER  SOURCE")
    for x, e in zip(rows, effect):
        print(f"{x['id']:<{widths[0]}}  {e:<{widths[1]}}  {x['scope']:<{widths[2]}}  {x['layer']['index']:<5}  "
              f"{x['source']}")
        if not args.brief:  # why the rule exists, under it (`opa inspect -a` shows annotations the same way)
            about = x["description"] + (f" (see {x['reference']})" if x["reference"] else "")
            print("\n".join(textwrap.wrap(" ".join(about.split()), width=100, initial_indent="    ",
                                           subsequent_indent="    ", break_on_hyphens=False,
                                           break_long_words=False)))
    _print_waivers(waivers)
    return EXIT_OK


def waiver_rows(ruleset: RuleSet, rule_ids: set[str] | None = None) -> list[dict[str, Any]]:
    """One dict per waiver (docs/rule-language.md, "Waivers"), of the rules in ``rule_ids`` (None: all), by
    file:line: the JSON rows of ``inspect``'s ``waivers``."""
    rows = [w.to_dict() for w in sorted(ruleset.waivers, key=lambda w: w.source)
            if rule_ids is None or w.rule_id in rule_ids]
    return rows


def _print_waivers(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print()
    print(f"{len(rows)} waiver(s):")
    for w in rows:
        state = "in force" if w["in_force"] else "EXPIRED, the rule applies again"
        where = "" if w["when"] is None else " where " + json.dumps(w["when"], separators=(", ", ": "))
        print(f"  {w['rule']} waived{where} until {w['expires']} ({state}), owner {w['owner']}, at {w['source']}")
        print("\n".join(textwrap.wrap(" ".join(w["reason"].split()), width=100, initial_indent="    ",
                                       subsequent_indent="    ", break_on_hyphens=False, break_long_words=False)))
