"""`Decision`: a layout together with its reasons.

A decision is a value (Cedar's ``Response``): the chosen layout, the ranking
of the survivors, and the trace that explains both. With ``explain=False``
the engine only runs the fast path; the trace is computed on first access,
from the same rule set and context, so it always matches the layout.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from functools import cached_property
from typing import Any

from kvpolicy.engine.counterfactual import counterfactuals, describe
from kvpolicy.engine.decide import Outcome, evaluate, scopes_for, unknown_connector_warnings
from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint
from kvpolicy.engine.render import render_text
from kvpolicy.engine.trace import (
    CandidateRemoved,
    Counterfactual,
    Event,
    LayoutChosen,
    PreferenceApplied,
    RuleEvaluated,
    RuleRef,
    WaiverChecked,
)
from kvpolicy.policy.context import MISSING, Context
from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["JSON_FORMAT_VERSION", "Decision"]

# The version of the JSON contract (docs/json-output.md). Adding a key keeps it;
# renaming, removing or changing the meaning of one bumps it.
JSON_FORMAT_VERSION = 1


class Decision:
    """The layout a rule set chose for a context, and why."""

    def __init__(self, ruleset: RuleSet, context: Context, outcome: Outcome) -> None:
        assert outcome.winner is not None
        self.ruleset = ruleset
        self.context = context
        self.layout: Layout = ruleset.layout_order[outcome.winner]
        self.score: int = outcome.scores[outcome.winner]
        self._outcome = outcome
        # connectors the deployment loads from kv_connector_module_path (`declaring`)
        self.declared_connectors: frozenset[str] = frozenset()
        if outcome.events:
            self.__dict__["events"] = outcome.events

    def declaring(self, names: Iterable[str]) -> Decision:
        """This decision for a deployment that loads the connectors ``names`` from ``kv_connector_module_path``:
        its `warnings` leave out the "unknown connector" line for them (a class of the operator's own is no
        misspelling; `kvpolicy.engine.connector_names.check_connector_names` says what applies to it)."""
        out = copy.copy(self)
        out.declared_connectors = frozenset(names)
        return out

    def __repr__(self) -> str:
        return f"Decision(layout={self.layout}, score={self.score}, rules={self.ruleset.digest[:19]})"

    @property
    def ranking(self) -> tuple[tuple[Layout, int], ...]:
        """Surviving layouts, best first, with their preference scores."""
        order, o = self.ruleset.layout_order, self._outcome
        return tuple((order[i], o.scores[i]) for i in o.ranked())

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """The full trace (typed events, in evaluation order)."""
        glob, conn = scopes_for(self.ruleset, self.context)
        return evaluate(self.ruleset, glob, conn, explain=True).events

    @cached_property
    def counterfactuals(self) -> tuple[Counterfactual, ...]:
        """For each losing layout, the smallest input change that makes it win."""
        glob, conn = scopes_for(self.ruleset, self.context)
        c = self.context.connector
        names = () if c is None else (c.name, *(m.name for m in c.connectors))
        return counterfactuals(self.ruleset, glob, conn, self.ruleset.layout_order.index(self.layout),
                               profile=_profile_or_none(self.context.profile), connectors=names)

    @cached_property
    def fingerprint(self) -> LayoutFingerprint:
        """What every rank and transfer peer must agree on (docs/fingerprint.md)."""
        return fingerprint(self)

    @property
    def rule_results(self) -> tuple[RuleEvaluated, ...]:
        return tuple(e for e in self.events if isinstance(e, RuleEvaluated))

    @property
    def eliminated(self) -> dict[Layout, list[tuple[RuleRef, str]]]:
        """Each removed layout -> the (rule, scope) pairs that removed it."""
        out: dict[Layout, list[tuple[RuleRef, str]]] = {}
        for e in self.events:
            if isinstance(e, CandidateRemoved):
                out.setdefault(e.layout, []).append((e.rule, e.scope))
        return out

    @property
    def preferences(self) -> tuple[PreferenceApplied, ...]:
        return tuple(e for e in self.events if isinstance(e, PreferenceApplied))

    @property
    def waivers(self) -> tuple[WaiverChecked, ...]:
        """Every waiver this decision met (`kvpolicy.policy.waivers`): applied ones (in force: the rule they name
        matched and had no effect) and lapsed ones (expired: the rule applied as written; also a warning)."""
        return tuple(e for e in self.events if isinstance(e, WaiverChecked))

    @cached_property
    def audit(self) -> tuple[Any, ...]:
        """The audit-mode rules that matched (`kvpolicy.engine.audit.AuditFinding`): what each would
        remove if enforced. They never change ``layout``."""
        from kvpolicy.engine.audit import audit_findings

        return audit_findings(self.ruleset, self.context, self.layout, [layout for layout, _ in self.ranking])

    def _dropped_preferences(self) -> list[tuple[bool, str]]:
        """(shipped only?, text) for each matched ``prefer`` rule every layout of which was removed."""
        surviving = {layout for layout, _ in self.ranking}
        eliminated = self.eliminated
        operator_ids = frozenset().union(*(layer.rule_ids for layer in self.ruleset.layers if not layer.shipped))
        asked: dict[tuple[str, str], tuple[Any, list[Layout]]] = {}
        for p in self.preferences:
            asked.setdefault((p.rule.id, p.scope), (p.rule, []))[1].append(p.layout)
        out = []
        for (_rule_id, scope), (rule, layouts) in asked.items():
            if any(x in surviving for x in layouts):
                continue
            removers = sorted({r.id for x in layouts for r, _ in eliminated.get(x, [])})
            wanted = ", ".join(str(x) for x in layouts)
            layer = self.ruleset.layer_of(rule.id)
            # a shipped global preference the release's own rules removed: vLLM logs nothing, no operator can
            # act on it (a connector's layout that is no candidate stays a warning: vLLM warns for it too)
            shipped = (layer is not None and layer.shipped and not scope.startswith("connector")
                       and not operator_ids.intersection(removers))
            out.append((shipped, f"{rule.id} ({scope}) prefers {wanted}, which "
                        + (f"{'was' if len(layouts) == 1 else 'were'} removed by {', '.join(removers)}"
                           if removers else "did not survive")
                        + f"; the preference is dropped and {self.layout} is used instead"))
        return out

    @property
    def warnings(self) -> tuple[str, ...]:
        """Preferences that came to nothing: every layout a matched ``prefer`` rule asked for was
        removed, so the ranking fell back to the candidates' order. (vLLM 0.34 warns the same way
        when a connector's required layout is not a candidate, and uses its first candidate.) A shipped
        rule's global preference removed by shipped rules only is a note instead (`notes`).
        Then one line per matched audit-mode rule (`audit`), then one per lapsed waiver that would have covered
        a matched rule (`waivers`): the rule applied again. First, one line per configured connector
        no profile registers and no rule names (`unknown_connector_warnings`): no rules applied to it."""
        return (unknown_connector_warnings(self.ruleset, self.context.connector, self.declared_connectors)
                + tuple(text for shipped, text in self._dropped_preferences() if not shipped)
                + tuple(f.text() for f in self.audit)
                + tuple(dict.fromkeys(w.text() for w in self.waivers if not w.applied)))

    @property
    def notes(self) -> tuple[str, ...]:
        """Dropped preferences that are the shipped rules' own business (a shipped global ``prefer`` removed
        by shipped rules only, as the gate's uniform-cache preference on a release that cannot honour it):
        vLLM logs nothing there and the operator cannot act on it, so they are said in the explanation only."""
        return tuple(text for shipped, text in self._dropped_preferences() if shipped)

    @property
    def matched_rules(self) -> dict[str, bool]:
        """Every rule id in the set -> whether it matched in any active scope."""
        out = {r.id: False for r in self.ruleset.rules}
        for e in self.rule_results:
            out[e.rule.id] = out[e.rule.id] or e.matched
        return out

    def to_dict(self, *, counterfactual: bool = True) -> dict[str, Any]:
        """The JSON contract (docs/json-output.md)."""
        chosen = next((e for e in self.events if isinstance(e, LayoutChosen)), None)
        return {
            "format_version": JSON_FORMAT_VERSION,
            "layout": {"placement": self.layout.placement.value, "head_order": self.layout.head_order.value,
                       "name": str(self.layout)},
            "score": self.score,
            "ranking": [{"layout": str(lay), "score": s} for lay, s in (chosen.ranking if chosen else self.ranking)],
            "eliminated": {
                str(lay): [{"rule": r.id, "source": str(r.source), "scope": scope, "effect": r.effect}
                           for r, scope in hits]
                for lay, hits in self.eliminated.items()
            },
            "rules": self.matched_rules,
            "rule_results": [
                {"rule": e.rule.id, "source": str(e.rule.source), "scope": e.scope, "effect": e.rule.effect,
                 "matched": e.matched,
                 "leaves": [{"field": lf.field, "op": lf.op, "expected": _jsonable(lf.expected),
                             "actual": _jsonable(lf.actual), "result": lf.result} for lf in e.leaves]}
                for e in self.rule_results
            ],
            "preferences": [{"layout": str(p.layout), "rule": p.rule.id, "source": str(p.rule.source),
                             "scope": p.scope, "weight": p.weight} for p in self.preferences],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "audit": [f.to_dict() for f in self.audit],
            "waivers": [{"rule": w.rule.id, "rule_source": str(w.rule.source), "effect": w.rule.effect,
                         "scope": w.scope, "applied": w.applied, "layouts": [str(x) for x in w.layouts],
                         **w.waiver.to_dict()} for w in self.waivers],
            "counterfactual": [
                {"layout": str(cf.layout), "text": describe(cf), "actionable": cf.actionable,
                 "changes": None if cf.changes is None else [
                     {"scope": c.scope, "field": c.field, "from": _jsonable(c.was), "to": _jsonable(c.becomes)}
                     for c in cf.changes]}
                for cf in self.counterfactuals
            ] if counterfactual else [],
            "fingerprint": {"digest": self.fingerprint.digest, **self.fingerprint.to_dict()},
            "ruleset": {"root": self.ruleset.root, "digest": self.ruleset.digest,
                        "layers": [layer.to_dict() for layer in self.ruleset.layers]},
            "inputs": self.context.model_dump(mode="json", exclude_none=True),
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def explain(self, mode: str = "full") -> str:
        """The decision rendered as text for people (see `kvpolicy.engine.render`)."""
        return render_text(self, mode=mode)


def _jsonable(value: Any) -> Any:
    if value is MISSING:
        return None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _profile_or_none(name: str) -> ReleaseProfile | None:
    """The context's release profile, or None for a name no profile has (a hand-built context)."""
    try:
        return get_profile(name)
    except PolicyError:
        return None
