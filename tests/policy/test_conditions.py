"""Compiled conditions: the fast closures agree with the explaining ones on every input."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.policy.conditions import compile_condition, leaf_predicate
from kvpolicy.policy.context import MISSING
from kvpolicy.policy.rule_model import Leaf, Rule

scalars = st.one_of(st.booleans(), st.integers(-3, 3), st.sampled_from(["a", "b", "true", "1", ""]), st.none())
values = st.one_of(scalars, st.just(MISSING), st.floats(-3, 3, allow_nan=False))
FIELDS = ["f.a", "f.b", "f.c"]


@st.composite
def leaves(draw):
    op = draw(st.sampled_from(["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "exists"]))
    if op in ("in", "not_in"):
        operand = draw(st.lists(scalars, min_size=1, max_size=4))
    elif op in ("lt", "le", "gt", "ge"):
        operand = draw(st.integers(-3, 3))
    elif op == "exists":
        operand = draw(st.booleans())
    else:
        operand = draw(scalars)
    return {"field": draw(st.sampled_from(FIELDS)), op: operand}


def conditions(depth: int = 3):
    base = leaves()
    return st.recursive(
        base,
        lambda inner: st.one_of(
            st.builds(lambda xs: {"all": xs}, st.lists(inner, min_size=1, max_size=4)),
            st.builds(lambda xs: {"any": xs}, st.lists(inner, min_size=1, max_size=4)),
            st.builds(lambda x: {"not": x}, inner),
        ),
        max_leaves=8,
    )


@settings(max_examples=400, deadline=None)
@given(conditions(), st.dictionaries(st.sampled_from(FIELDS), values))
def test_fast_and_explain_paths_agree(cond, env) -> None:
    rule = Rule.model_validate({"id": "r", "description": "d", "when": cond, "forbid": {"placement": "cross_layer"}})
    compiled = compile_condition(rule.when)
    out: list = []
    assert compiled.test(env) == compiled.explain(env, out)
    assert len(out) >= 1  # explain evaluates every leaf


@given(leaves(), values)
def test_leaf_semantics(leaf_data, actual) -> None:
    leaf = Leaf.model_validate(leaf_data)
    result = leaf_predicate(leaf)(actual)
    op, value = leaf.op, leaf.value

    def same(a, b):
        return a == b and isinstance(a, bool) == isinstance(b, bool) and a is not MISSING

    expected = {
        "eq": lambda: same(actual, value),
        "ne": lambda: not same(actual, value),
        "in": lambda: any(same(actual, v) for v in value),
        "not_in": lambda: not any(same(actual, v) for v in value),
        "exists": lambda: (actual is not MISSING) == value,
    }.get(op, lambda: isinstance(actual, (int, float)) and not isinstance(actual, bool)
          and {"lt": actual < value, "le": actual <= value, "gt": actual > value,
               "ge": actual >= value}[op] if isinstance(actual, (int, float)) else False)()
    assert result == expected


def test_true_never_matches_one() -> None:
    leaf = Leaf.model_validate({"field": "x", "eq": True})
    assert leaf_predicate(leaf)(1) is False
    assert compile_condition(leaf).test({"x": 1}) is False
    assert compile_condition(Leaf.model_validate({"field": "x", "eq": 1})).test({"x": True}) is False
