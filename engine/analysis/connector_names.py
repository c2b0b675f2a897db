"""Lint's connector-name check: connector files for connectors no release profile knows.

A connector file may name any well-formed connector (third-party ones, ones newer than kvpolicy's
profiles); lint says which ones no profile registers, so an operator sees that their rules rest
on a name kvpolicy cannot check, and which of those look like a known name misspelt.
"""

from __future__ import annotations

from kvpolicy.policy.connectors import KNOWN_CONNECTORS, near_connector
from kvpolicy.policy.ruleset import CompiledRule, RuleSet

__all__ = ["unknown_connector_findings"]


def unknown_connector_findings(ruleset: RuleSet, known: frozenset[str] = KNOWN_CONNECTORS
                               ) -> list[tuple[str, str, str, CompiledRule]]:
    """One finding per connector with rules that no release profile registers, as (severity, code,
    message, the connector's first rule): a warning when the name is near a known one
    (`near_connector`), else a note. Sorted by connector name; lint makes them `Finding`s."""
    out = []
    for name in ruleset.connectors:
        if name in known:
            continue
        near = near_connector(name, known)
        ref = ruleset.connector_rules(name)[0]
        if near is not None:
            out.append(("warning", "unknown-connector",
                               f"connector `{name}` is registered by no release profile and is close to `{near}`: "
                               f"did you mean `{near}`?", ref))
        else:
            out.append(("note", "unknown-connector",
                               f"connector `{name}` is registered by no release profile (third-party or newer "
                               "than kvpolicy's profiles): its rules apply when a connector of exactly that "
                               "class name is configured", ref))
    return out
