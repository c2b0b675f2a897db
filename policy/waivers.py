"""Waivers: an owned, dated exception to one rule (Kyverno's ``PolicyException``, conftest's exceptions).

A rule file's ``waivers:`` list (global files only)::

    waivers:
      - rule: offloading-requires-lbhnc        # a rule id of any layer
        owner: kv-team@example.com
        reason: LMCache 0.3 reads LBNHC; until INFRA-1234 ships
        expires: 2027-01-31                    # the last day it applies
        when: {field: kv.kv_cache_dtype, eq: fp8}   # where (absent: wherever the rule applies)

A waiver in force makes its rule have no effect where ``when`` holds, in the scope the rule is evaluated in
(a connector rule's ``connector.*`` fields bind to its connector, for the waiver too); the decision's
explanation names it, by file:line, owner and expiry, wherever the rule would have acted. Expiry is read
against one day per loaded rule set (`today`: ``KVPOLICY_TODAY``, the CLI's ``--today``, else the clock's
date), so a decision and its trace always agree. A lapsed waiver never applies: the rule applies again,
every verb warns (``warning[expired-waiver]``) and ``kvpolicy validate`` fails, so CI catches it before a
deployment silently changes layout. A waiver never lifts the geometry verifier, and a waiver of a shipped
guard that the verifier shows load-bearing for safety is refused when the rules load
(`kvpolicy.engine.analysis.guards`).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from kvpolicy.policy.conditions import CompiledCondition
from kvpolicy.policy.errors import Diagnostic, InputError
from kvpolicy.policy.rule_model import Waiver

__all__ = ["TODAY_VARIABLE", "CompiledWaiver", "parse_day", "today", "today_is", "waiver_problems"]

TODAY_VARIABLE = "KVPOLICY_TODAY"
_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_override: ContextVar[date | None] = ContextVar("kvpolicy_today", default=None)


def parse_day(text: str, where: str) -> date:
    """``YYYY-MM-DD`` as a date; an `InputError` located at ``where`` (a flag or a variable) otherwise."""
    try:
        if _DAY.match(text):
            return date.fromisoformat(text)
    except ValueError:
        pass
    raise InputError("", [Diagnostic(where, 0, 0, "invalid-date", f"`{text}` is not a date",
                                     "write the day as `YYYY-MM-DD`, e.g. `2027-01-31`")])


def today() -> date:
    """The day waivers are read against: `today_is`'s (the CLI's ``--today``), else ``KVPOLICY_TODAY``, else
    the clock's. A malformed ``KVPOLICY_TODAY`` is an `InputError` naming the variable, never a silent clock."""
    day = _override.get()
    if day is not None:
        return day
    text = os.environ.get(TODAY_VARIABLE)
    if text:
        return parse_day(text, TODAY_VARIABLE)
    return date.today()


@contextmanager
def today_is(day: date | None) -> Iterator[None]:
    """Within the block, rule sets read their waivers against ``day`` (None: `today` as usual)."""
    token = _override.set(day)
    try:
        yield
    finally:
        _override.reset(token)


@dataclass(frozen=True)
class CompiledWaiver:
    """A waiver ready to evaluate: where it is written and the day the rule set was loaded for."""

    waiver: Waiver
    source: Any  # kvpolicy.policy.ruleset.Source
    condition: CompiledCondition = field(compare=False)
    day: date = field(default_factory=date.today)

    @property
    def rule_id(self) -> str:
        return self.waiver.rule

    @property
    def in_force(self) -> bool:
        """Not expired on the rule set's day: ``expires`` is the last day it applies."""
        return self.day <= self.waiver.expires

    def text(self) -> str:
        """One line for explanations: what, who, until when, why, where."""
        w = self.waiver
        return (f"rule `{w.rule}` waived at {self.source} (owner {w.owner}, expires {w.expires.isoformat()}): "
                f"{w.reason}")

    def to_dict(self) -> dict[str, Any]:
        w = self.waiver
        return {"rule": w.rule, "source": str(self.source), "owner": w.owner, "reason": w.reason,
                "expires": w.expires.isoformat(), "in_force": self.in_force,
                "when": None if w.when is None else w.when.model_dump(mode="json", by_alias=True, exclude_none=True)}


def waiver_problems(ruleset: Any, other_releases: Callable[[str], Sequence[str]] | None = None,
                    ) -> tuple[list[Diagnostic], list[Diagnostic]]:
    """(errors, warnings) of ``ruleset``'s waivers once every layer is in: a waiver of a rule the set does not
    have (a typo would waive nothing, silently) or of an audit-mode rule (nothing to waive) is an error; a
    lapsed one is ``warning[expired-waiver]`` (`kvpolicy validate` makes it an error).

    ``other_releases(rule_id)``: the release profiles whose shipped rules have that rule. A waiver of one of
    them is ``warning[waived-rule-not-in-release]``, not an error: an operator's layer is shared by
    deployments of several releases, and a waiver written for one release waives nothing under another."""
    errors: list[Diagnostic] = []
    warnings: list[Diagnostic] = []
    enforced = {r.id for r in ruleset.rules}
    audited = {r.id for r in ruleset.audit_rules}
    for w in ruleset.waivers:
        src = w.source
        if w.rule_id in audited:
            errors.append(Diagnostic(src.file, src.line, src.col, "waiver-of-audit-rule",
                                     f"rule `{w.rule_id}` is in audit mode: it removes nothing, so there is "
                                     "nothing to waive", "delete the waiver, or enforce the rule first"))
        elif w.rule_id not in enforced and (elsewhere := tuple(other_releases(w.rule_id) if other_releases
                                                               else ())):
            warnings.append(Diagnostic(
                src.file, src.line, src.col, "waived-rule-not-in-release",
                f"`{w.rule_id}` is a shipped rule of {', '.join(elsewhere)}, not of this release's rules: the "
                "waiver waives nothing here", "nothing to do where this layer serves several releases"))
        elif w.rule_id not in enforced:
            close = difflib.get_close_matches(w.rule_id, sorted(enforced), n=1)
            builtin = w.rule_id in ("release-candidates", "backend-geometry")
            errors.append(Diagnostic(
                src.file, src.line, src.col, "unknown-waived-rule",
                f"`{w.rule_id}` is a built-in filter of the release profile, not a rule: it cannot be waived"
                if builtin else f"no rule `{w.rule_id}` in the rule set: the waiver would waive nothing",
                "the release's candidates and the backend's geometry are facts, not policy" if builtin else
                (f"did you mean `{close[0]}`? " if close else "")
                + "`kvpolicy inspect` lists every rule id of every layer"))
        elif not w.in_force:
            warnings.append(Diagnostic(src.file, src.line, src.col, "expired-waiver",
                                   f"the waiver of `{w.rule_id}` (owner {w.waiver.owner}) expired on "
                                   f"{w.waiver.expires.isoformat()}: it no longer applies, the rule does again",
                                   "review it with its owner: renew `expires`, or delete the waiver"))
    return errors, warnings
