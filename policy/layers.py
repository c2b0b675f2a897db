"""Layered rule sets: several rule directories composed into one `RuleSet`, bottom layer first.

A deployment's rules are the shipped rules of its vLLM release profile with an
operator's directories on top (``--rules A --rules B``: layers shipped, A, B).
Composition, fixed and order-independent except where stated:

1. Every rule of every layer is in the set; the decision semantics do not know
   layers. So forbids and requires of every layer apply, and a forbid always
   wins (docs/rule-layers.md): a layer can add constraints and preferences, never take
   one away, except by a waiver (`kvpolicy.policy.waivers`): explicit, owned, dated,
   named in every explanation, checked here once every layer is in.
2. A rule id is unique across all layers. A duplicate is an error located at
   the upper rule, naming the lower one; there is no override. (A rule
   restated word for word, same id, scope and content, as in a copy of a
   shipped file, is the same rule and stays in its lowest layer.) As in Cedar,
   where no policy can lift another's `forbid`, nothing in an upper layer can
   silently weaken a lower one: the failure this replaces (issue #15) was a
   directory that dropped every shipped guard without a word. Changing a
   shipped rule means replacing the shipped layer, explicitly
   (``--no-shipped-rules``), with the verifier's warning for each load-bearing
   guard that goes (`kvpolicy.engine.rule_layers`).
3. Connector files for one connector in several layers all apply, as if their
   rules were in one file; their ``member_preferences`` must agree.
4. ``defaults.layout_order`` (a tie-break, not a constraint): the topmost layer
   that declares one wins.
5. The same directory given twice (or an operator directory that is the
   shipped one) is one layer, at its first position.

The set's ``digest`` stays the digest of its meaning (the rules, not where they
are written), so one rule set split over layers or kept in one directory has
one digest; each layer's own digest is in ``RuleSet.layers``, and
``RuleSet.layer_of(id)`` names the layer a rule came from (``explain`` shows it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvpolicy.policy.connectors import KNOWN_CONNECTORS, near_connector
from kvpolicy.policy.errors import Diagnostic, RuleLoadError, shown_file
from kvpolicy.policy.literals import literal_warnings
from kvpolicy.policy.rule_model import MemberPreferences, Rule
from kvpolicy.policy.ruleset import RuleSet, Source
from kvpolicy.policy.waivers import waiver_problems

__all__ = ["RuleLayer", "compose_layers", "connector_warnings", "partial_warnings", "render_warning",
           "with_warnings"]


@dataclass(frozen=True)
class RuleLayer:
    """One layer of a rule set: where it was read, whether it is the shipped one, what it holds."""

    root: str  # the directory as shown (`rules/vllm-0.34`, `ops/`)
    shipped: bool
    digest: str  # the layer's own RuleSet.digest
    rule_ids: frozenset[str]
    connectors: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"root": self.root, "shipped": self.shipped, "digest": self.digest, "rules": len(self.rule_ids),
                "connectors": list(self.connectors)}


def compose_layers(layers: list[tuple[RuleSet, bool]],
                   other_releases: Callable[[str], Sequence[str]] | None = None) -> RuleSet:
    """One `RuleSet` of ``layers`` (each a loaded directory and whether it is the shipped one),
    bottom first. Raises `RuleLoadError` listing every cross-layer problem (duplicate ids,
    disagreeing ``member_preferences``); the result carries `connector_warnings`. ``other_releases``:
    `waiver_problems`'s (the shipped rules of the other release profiles, which the caller knows)."""
    diags: list[Diagnostic] = []
    entries = []
    first: dict[str, tuple[Source, str]] = {}
    same: dict[str, tuple[str | None, Rule]] = {}
    modes: dict[str, tuple[MemberPreferences, str]] = {}
    order, declared = None, False
    metas: list[RuleLayer] = []
    for ruleset, shipped in layers:
        ids = []
        for rule in sorted(ruleset.all_rules, key=lambda r: (r.source, r.id)):
            if rule.id in first:
                lower, lower_root = first[rule.id]
                if same[rule.id] == (rule.scope, rule.rule):
                    continue  # restated word for word (a copied shipped file): the same rule, kept below
                diags.append(Diagnostic(
                    rule.source.file, rule.source.line, rule.source.col, "duplicate-rule-id",
                    f"rule id `{rule.id}` is already used at {lower} (layer `{lower_root}`)",
                    "rule ids are unique across layers and no layer replaces another's rule: rename this rule, "
                    "or replace the shipped rules explicitly with --no-shipped-rules (docs/rule-layers.md)"))
                continue
            first[rule.id] = (rule.source, ruleset.root)
            same[rule.id] = (rule.scope, rule.rule)
            ids.append(rule.id)
            entries.append((rule.rule, rule.source, rule.scope))
        for name, mode in sorted(ruleset.member_preferences.items()):
            if name in modes and modes[name][0] is not mode:
                where = next((r.source.file for r in ruleset.connector_rules(name)), ruleset.root)
                diags.append(Diagnostic(
                    where, 0, 0, "conflicting-member-preferences",
                    f"`member_preferences: {mode.value}` for `{name}` disagrees with `{modes[name][0].value}` "
                    f"in layer `{shown_file(modes[name][1])}`",
                    "connector files for one connector in several layers must agree on member_preferences"))
            modes.setdefault(name, (mode, ruleset.root))
        if ruleset.order_declared:  # the topmost declaration wins
            order, declared = ruleset.layout_order, True
        metas.append(RuleLayer(ruleset.root, shipped, ruleset.digest, frozenset(ids), ruleset.connectors))
    sources = {name: at for ruleset, _shipped in reversed(layers) for name, at in ruleset.connector_sources.items()}
    kwargs = {} if order is None else {"layout_order": order}
    waivers = [(w.waiver, w.source) for ruleset, _shipped in layers for w in ruleset.waivers]
    day = next((w.day for ruleset, _shipped in layers for w in ruleset.waivers), None)  # one day for every layer
    composed = replace(RuleSet.build(entries, member_preferences={k: v[0] for k, v in modes.items()},
                                     root=" + ".join(m.root for m in metas), order_declared=declared,
                                     waivers=waivers, day=day, **kwargs),
                       layers=tuple(metas), connector_sources=sources)
    errors, lapsed = waiver_problems(composed, other_releases)  # a waiver may name a rule of any layer
    diags += errors
    composed = replace(composed, warnings=(*connector_warnings(composed), *literal_warnings(composed), *lapsed))
    if diags:
        raise with_warnings(RuleLoadError(f"{len(diags)} error(s) across rule layers "
                                          f"{shown_file(' + '.join(m.root for m in metas))}", diags),
                            composed.warnings)
    return composed


def with_warnings(exc: RuleLoadError, warnings: Sequence[Diagnostic]) -> RuleLoadError:
    """``exc`` carrying the warnings about the rules that did load (``exc.warnings``): `kvpolicy validate`
    shows them after the errors, so that one run says everything."""
    exc.warnings = tuple(warnings)  # type: ignore[attr-defined]
    return exc


def partial_warnings(layers: list[tuple[RuleSet | None, bool]]) -> tuple[Diagnostic, ...]:
    """The warnings of the rules that loaded, for a rule set some of whose files did not: each layer's
    valid rules (a failed layer's ``partial``, `kvpolicy.policy.load.with_partial`) composed as
    `compose_layers` composes them."""
    loaded = [(rs, shipped) for rs, shipped in layers if rs is not None]
    if not loaded:
        return ()
    try:
        return compose_layers(loaded).warnings
    except RuleLoadError as exc:
        return getattr(exc, "warnings", ())


def connector_warnings(ruleset: RuleSet, known: frozenset[str] = KNOWN_CONNECTORS) -> list[Diagnostic]:
    """A warning for each connector file whose name no release profile knows and that is near a
    known name or another file's name (`near_connector`): its rules would never apply to the
    connector it probably means. ``MyConector`` beside ``MyConnector`` warns on both: which one is
    the typo only the author knows."""
    names = set(ruleset.connectors) | {r.scope for r in ruleset.all_rules if r.scope}  # audit rules' too
    out = []
    for name in sorted(names - known):
        near = near_connector(name, known) or near_connector(name, names)
        if near is None:
            continue
        rules = ruleset.connector_rules(name)
        where = ruleset.connector_sources.get(name) or (rules[0].source if rules else Source(ruleset.root, 0, 0))
        whose = "a connector vLLM registers" if near in known else f"the connector of {_file_of(ruleset, near)}"
        out.append(Diagnostic(where.file, where.line, where.col, "near-connector-name",
                              f"connector `{name}` is no connector a release profile knows, and is close to "
                              f"`{near}` ({whose})",
                              f"did you mean `{near}`? rules for `{name}` apply only while a connector of "
                              "exactly that class name is configured"))
    return out


def _file_of(ruleset: RuleSet, connector: str) -> str:
    rules = ruleset.connector_rules(connector)
    return rules[0].source.file if rules else f"`{connector}`"


def render_warning(diag: Diagnostic) -> str:
    """``file:line:col: warning[code]: message`` and its ``help:`` line, as errors render."""
    text = f"{diag.location}: warning[{diag.code}]: {diag.message}"
    return text + (f"\n  help: {diag.help}" if diag.help else "")
