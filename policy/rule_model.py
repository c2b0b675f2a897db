"""The rule file format as pydantic models: the source of its JSON Schema.

A rule file::

    version: 1
    connector: NixlConnector          # connector files only: the scope
    defaults:                         # global file only
      layout_order: [LBNHC, LBHNC, BLNHC, BHLNC]
    rules:
      - id: per-token-head-forbids-cross-layer
        description: inline scales collide under the cross-layer layout
        reference: vllm-project/vllm#48412
        when:
          all:
            - {field: kv.per_token_head, eq: true}
            - {field: backend.scale_views, eq: assume_per_layer_contiguous}
        forbid: {placement: cross_layer}

Conditions are a tree of ``all`` / ``any`` / ``not`` over leaves
``{field: <path>, <op>: <value>}``; there are no expression strings.
"""

from __future__ import annotations

import math
import re
from datetime import date
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictFloat, StrictInt, Tag, model_validator

from kvpolicy.policy.layouts import LayoutPattern
from kvpolicy.policy.spec import Frozen

__all__ = [
    "OPERATORS",
    "AllOf",
    "AnyOf",
    "Condition",
    "Defaults",
    "Effect",
    "Enforcement",
    "Leaf",
    "MemberPreferences",
    "NotOf",
    "Rule",
    "RuleFile",
    "Waiver",
]

Scalar = str | bool | int | float | None
# Strict: YAML `"30"` or `true` where a number belongs is an error, not silently 30 or 1.
Number = StrictInt | StrictFloat

# op -> what its operand is (the docs and the validator read this table)
OPERATORS: dict[str, str] = {
    "eq": "the field equals the value",
    "ne": "the field differs from the value (true when the field is absent)",
    "in": "the field equals one of the listed values",
    "not_in": "the field equals none of the listed values (true when absent)",
    "lt": "the field is a number less than the value",
    "le": "the field is a number less than or equal to the value",
    "gt": "the field is a number greater than the value",
    "ge": "the field is a number greater than or equal to the value",
    "exists": "`true`: the field has a value here; `false`: it is absent",
}


_OPERAND = {"in": "a list of values", "not_in": "a list of values", "lt": "a number", "le": "a number",
            "gt": "a number", "ge": "a number", "exists": "`true` or `false`"}


class Effect(str, Enum):
    forbid = "forbid"
    require = "require"
    prefer = "prefer"


class Enforcement(str, Enum):
    """What a matched ``forbid`` / ``require`` rule does (Kyverno's ``validationFailureAction``).

    ``enforce`` (the default) removes candidates. ``audit`` removes nothing: the rule's finding (what it
    would remove, and whether that would change the decision) is reported as a warning in dry-run, the
    plugin's log, lint and ``kvpolicy inspect``, so a site can roll a new rule out before enforcing it by
    deleting one line.
    """

    enforce = "enforce"
    audit = "audit"


class Leaf(Frozen):
    """``{field: <path>, <op>: <value>}`` with exactly one operator."""

    field: str = Field(description="a field path, e.g. `kv.per_token_head` or `connector.extra.<key>`")
    eq: Scalar = None
    ne: Scalar = None
    in_: list[Scalar] | None = Field(default=None, alias="in", min_length=1)
    not_in: list[Scalar] | None = Field(default=None, min_length=1)
    lt: Number | None = None
    le: Number | None = None
    gt: Number | None = None
    ge: Number | None = None
    exists: StrictBool | None = None

    # No populate_by_name: `in_` is the attribute, never a key a file may write (`{eq: x, in_: [y]}` loaded).

    @model_validator(mode="before")
    @classmethod
    def _one_operator(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ops = [k for k in data if k in OPERATORS]
            if len(ops) != 1:
                found = ", ".join(f"`{o}`" for o in ops) or "none"
                raise ValueError(
                    f"a leaf needs exactly one operator, found {found}; operators: {', '.join(OPERATORS)}"
                )
            op, value = ops[0], data[ops[0]]
            # INVARIANT: after validation only `eq`/`ne` may hold null (and validate.py rejects it
            # there with a hint); None elsewhere would be read as "operator not given".
            if value is None and op not in ("eq", "ne"):
                raise ValueError(f"`{op}` needs {_OPERAND[op]}, got null")
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, float) and not math.isfinite(item):
                    raise ValueError(f"`{op}` compares with `{item}`, which no field value ever equals or orders "
                                     "against; use a finite number")
        return data

    @property
    def op(self) -> str:
        for name in OPERATORS:
            if name in self.model_fields_set or (name == "in" and "in_" in self.model_fields_set):
                return name
        raise AssertionError("validated leaf without operator")  # pragma: no cover

    @property
    def value(self) -> Any:
        return getattr(self, "in_" if self.op == "in" else self.op)


class AllOf(Frozen):
    all: list[Condition] = Field(min_length=1, description="true when every condition is")


class AnyOf(Frozen):
    any: list[Condition] = Field(min_length=1, description="true when some condition is")


class NotOf(Frozen):
    not_: Condition = Field(alias="not", description="true when the condition is false")

    model_config = Frozen.model_config | {"populate_by_name": True}


def _condition_tag(data: Any) -> str | None:
    if isinstance(data, dict):
        for key in ("all", "any", "not"):
            if key in data:
                return key
        return "leaf"
    if isinstance(data, (AllOf, AnyOf, NotOf, Leaf)):
        return {AllOf: "all", AnyOf: "any", NotOf: "not", Leaf: "leaf"}[type(data)]
    return None


Condition = Annotated[
    Annotated[AllOf, Tag("all")]
    | Annotated[AnyOf, Tag("any")]
    | Annotated[NotOf, Tag("not")]
    | Annotated[Leaf, Tag("leaf")],
    Discriminator(
        _condition_tag,
        custom_error_type="condition",
        custom_error_message="a condition is a mapping with `all`, `any`, `not`, or `field` and one operator",
    ),
]


class Rule(Frozen):
    """One constraint: when ``when`` holds, apply exactly one effect to a layout pattern."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=100,
                    description="unique across the rule set; lowercase, digits, `.`, `_`, `-`")
    description: str = Field(min_length=1, description="why the rule exists, shown in explanations")
    reference: str | None = Field(default=None, description="an issue or PR, e.g. `vllm-project/vllm#48412`")
    when: Condition | None = Field(default=None, description="absent: the rule always applies")
    forbid: LayoutPattern | None = Field(default=None, description="remove the layouts the pattern matches")
    require: LayoutPattern | None = Field(default=None, description="remove the layouts the pattern does not match")
    prefer: LayoutPattern | None = Field(default=None, description="add `weight` to the layouts the pattern matches")
    weight: StrictInt | None = Field(default=None, ge=1, le=1000, description="with `prefer` only; default 1")
    enforcement: Enforcement | None = Field(
        default=None, description="with `forbid` or `require` only: `enforce` (default) removes layouts; `audit` "
                                  "only warns what enforcing would remove and change (roll a rule out first)")

    @model_validator(mode="after")
    def _one_effect(self) -> Rule:
        effects = [e.value for e in Effect if getattr(self, e.value) is not None]
        if len(effects) != 1:
            found = ", ".join(f"`{e}`" for e in effects) or "none"
            raise ValueError(f"a rule needs exactly one effect of `forbid`, `require`, `prefer`; found {found}")
        if self.weight is not None and self.prefer is None:
            raise ValueError("`weight` applies only to a `prefer` rule")
        if self.enforcement is not None and self.prefer is not None:
            raise ValueError("`enforcement` applies only to a `forbid` or `require` rule: a preference removes "
                             "nothing, so there is nothing to audit")
        return self

    @property
    def audit(self) -> bool:
        """An audit-mode rule: it warns what it would remove and never removes anything."""
        return self.enforcement is Enforcement.audit

    @property
    def effect(self) -> Effect:
        for e in Effect:
            if getattr(self, e.value) is not None:
                return e
        raise AssertionError("validated rule without effect")  # pragma: no cover

    @property
    def pattern(self) -> LayoutPattern:
        return getattr(self, self.effect.value)


class Waiver(Frozen):
    """An exception to one rule (Kyverno's ``PolicyException``, conftest's exceptions): while ``when`` holds and
    until ``expires``, the rule named by ``rule`` has no effect. Owned and argued: ``owner`` and ``reason`` are
    required, and a lapsed waiver stops applying (the rule applies again) and fails ``kvpolicy validate``."""

    rule: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=100,
                      description="the id of the rule waived, in any layer of the rule set")
    owner: str = Field(min_length=1, max_length=200,
                       description="who answers for the waiver (a person, team or ticket queue)")
    reason: str = Field(min_length=1, description="why the rule is waived here, shown in explanations")
    expires: date = Field(description="the last day the waiver applies (`YYYY-MM-DD`); from the day after, the "
                                      "rule applies again and `kvpolicy validate` fails")
    when: Condition | None = Field(default=None, description="where the waiver applies, in the rules' condition "
                                                             "language; absent: wherever the rule does")

    @model_validator(mode="before")
    @classmethod
    def _date_text(cls, data: Any) -> Any:
        """``expires`` as the loader reads it: `YYYY-MM-DD` text only (no timestamps, no numbers of days)."""
        value = data.get("expires") if isinstance(data, dict) else None
        if isinstance(value, str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
            raise ValueError(f"`expires` is a date written `YYYY-MM-DD`, got `{value}`")
        if value is not None and not isinstance(value, (str, date)):  # pydantic reads 1700000000 as a date
            raise ValueError(f"`expires` is a date written `YYYY-MM-DD`, got `{value}`")
        return data


class Defaults(Frozen):
    layout_order: list[str] = Field(
        min_length=1,
        description="tie-break order of candidate layouts (vLLM names, or legacy `placement/head_order`); unlisted "
                    "ones follow in vLLM's enum order; absent: the candidates' preference order",
    )


class MemberPreferences(str, Enum):
    """How a composite connector combines its members' preferences for a layout."""

    all = "all"  # the smallest member score: every member must prefer it (vLLM's MultiConnector)
    any = "any"  # the largest member score
    sum = "sum"  # the members' scores added
    agree = "agree"  # the largest; members preferring different best layouts are a conflict (vLLM 0.34's
    # MultiConnector: "All connectors must use the same layout")


class RuleFile(Frozen):
    """One YAML rule file."""

    version: Literal[1] = Field(description="format version; currently 1")
    connector: str | None = Field(default=None, description="connector files only: the connector they apply to")
    member_preferences: MemberPreferences | None = Field(
        default=None, description="composite connectors only: how members' preferences combine (default `all`)"
    )
    defaults: Defaults | None = Field(default=None, description="global file only")
    rules: list[Rule] = Field(default_factory=list, description="the rules; order does not matter")
    waivers: list[Waiver] = Field(default_factory=list, description="global files only: exceptions to rules of "
                                                                    "any layer, each with an owner and an expiry")



AllOf.model_rebuild()
AnyOf.model_rebuild()
NotOf.model_rebuild()
Rule.model_rebuild()
Waiver.model_rebuild()
RuleFile.model_rebuild()
