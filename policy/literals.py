"""Warnings for condition literals that no profiled release can produce.

``backend.name`` takes vLLM's enum names, which differ by release, so its domain is open in the field
table (a rule may name a backend of a newer vLLM). A literal that no release profile's backends hold is
still almost always a typo: ``{field: backend.name, eq: flash_attn}`` never matches, and the rule is
silently dead (``kvpolicy lint`` only calls it that). Each such literal is a located warning with the
name it most likely means (``FLASH_ATTN``): `kvpolicy.policy.near_names.nearest`.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpolicy.policy.errors import Diagnostic
from kvpolicy.policy.near_names import nearest
from kvpolicy.policy.rule_model import AllOf, AnyOf, Condition, Leaf, NotOf
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["literal_warnings", "produced_values"]

_COMPARED = ("eq", "ne", "in", "not_in")


def produced_values(field: str) -> frozenset[str] | None:
    """The values some release profile can give ``field``, for the fields whose domain is per release; None
    for the others."""
    if field != "backend.name":
        return None
    from kvpolicy.policy.releases import iter_profiles

    return frozenset(name for profile in iter_profiles() for name in profile.backend_names())


def _leaves(cond: Condition | None) -> Iterator[Leaf]:
    if cond is None:
        return
    if isinstance(cond, AllOf):
        for sub in cond.all:
            yield from _leaves(sub)
    elif isinstance(cond, AnyOf):
        for sub in cond.any:
            yield from _leaves(sub)
    elif isinstance(cond, NotOf):
        yield from _leaves(cond.not_)
    else:
        yield cond


def literal_warnings(ruleset: RuleSet) -> list[Diagnostic]:
    """A warning (code ``unknown-literal``) for each literal of a rule's condition that no release profile
    can produce, located at the rule, with "did you mean"."""
    out = []
    for rule in sorted(ruleset.rules, key=lambda r: (r.source, r.id)):
        for leaf in _leaves(rule.rule.when):
            if leaf.op not in _COMPARED:
                continue
            values = produced_values(leaf.field)
            if values is None:
                continue
            operand = leaf.value if isinstance(leaf.value, list) else [leaf.value]
            for literal in operand:
                if not isinstance(literal, str) or literal in values:
                    continue
                near = nearest(literal, values)
                hint = f"did you mean `{near}`? " if near else ""
                out.append(Diagnostic(
                    rule.source.file, rule.source.line, rule.source.col, "unknown-literal",
                    f"rule `{rule.id}` compares `{leaf.field}` with `{literal}`, which no release profile "
                    f"produces: the comparison never {'fails' if leaf.op in ('ne', 'not_in') else 'holds'}",
                    f"{hint}values of `{leaf.field}` in the profiles: {', '.join(sorted(values))} "
                    "(vLLM's enum names, case-sensitive)"))
    return out
