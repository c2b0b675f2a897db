"""Compiled conditions: a validated condition tree becomes two closures.

``test(env) -> bool`` is the fast path (no allocation, short-circuiting).
``explain(env, out) -> bool`` also appends every leaf it evaluated, with the
value the field had, for the trace. Both read a flat ``path -> value`` map.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from kvpolicy.policy.context import MISSING
from kvpolicy.policy.rule_model import AllOf, AnyOf, Condition, Leaf, NotOf

__all__ = ["CompiledCondition", "LeafResult", "compile_condition", "leaves_of", "same_value"]

Env = dict[str, Any]
Test = Callable[[Env], bool]


@dataclass(frozen=True)
class LeafResult:
    """One leaf as evaluated: ``field op expected`` saw ``actual`` and gave ``result``."""

    field: str
    op: str
    expected: Any
    actual: Any
    result: bool

    def describe(self) -> str:
        shown = "absent" if self.actual is MISSING else _fmt(self.actual)
        return f"{self.field} {self.op} {_fmt(self.expected)} (saw {shown}) -> {str(self.result).lower()}"


def _fmt(value: Any) -> str:
    """A value as a rule file writes it: `true` a boolean, `"true"` the string (#15 printed both as
    true). A string is quoted exactly when YAML would not read it back as that string."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, str) and _needs_quotes(value):
        return json.dumps(value)
    return str(value)


_PLAIN = re.compile(r"^[A-Za-z0-9_./+-][A-Za-z0-9_./+ -]*$")
_RESOLVER = yaml.resolver.Resolver()


def _needs_quotes(text: str) -> bool:
    if not _PLAIN.match(text) or text != text.strip():
        return True
    return _RESOLVER.resolve(yaml.ScalarNode, text, (True, False)) != "tag:yaml.org,2002:str"


def _num(op: Callable[[Any, Any], bool], bound: float) -> Callable[[Any], bool]:
    def check(actual: Any) -> bool:
        return isinstance(actual, (int, float)) and not isinstance(actual, bool) and op(actual, bound)

    return check


def same_value(a: Any, b: Any) -> bool:
    # `true == 1` in Python; a rule saying `eq: true` must not match the integer 1
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def leaf_predicate(leaf: Leaf) -> Callable[[Any], bool]:
    """The leaf's test on one field value."""
    op, value = leaf.op, leaf.value
    if op == "eq":
        return lambda actual: same_value(actual, value)
    if op == "ne":
        return lambda actual: not same_value(actual, value)
    if op in ("in", "not_in"):
        plain = frozenset(v for v in value if not isinstance(v, bool))
        bools = frozenset(v for v in value if isinstance(v, bool))

        def member(actual: Any) -> bool:
            if isinstance(actual, bool):
                return actual in bools
            try:
                return actual in plain
            except TypeError:
                return False

        return member if op == "in" else (lambda actual: not member(actual))
    if op == "exists":
        return lambda actual: (actual is not MISSING) is value
    return _num({"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}[op], value)


def _fast_leaf(leaf: Leaf) -> Test | None:
    """Specialised closures for the common leaves: one dict lookup, one comparison.

    # INVARIANT: each returns exactly what `leaf_predicate` would.
    """
    path, op, value = leaf.field, leaf.op, leaf.value
    if op in ("eq", "ne") and isinstance(value, bool):
        if op == "eq":
            return lambda env: env.get(path, MISSING) is value  # bools are singletons
        return lambda env: env.get(path, MISSING) is not value
    if op in ("eq", "ne") and isinstance(value, str):
        if op == "eq":
            return lambda env: env.get(path, MISSING) == value  # never equal to a bool or a number
        return lambda env: env.get(path, MISSING) != value
    if op in ("eq", "ne") and isinstance(value, int):
        def eq_int(env: Env) -> bool:
            actual = env.get(path, MISSING)
            return actual == value and actual.__class__ is not bool

        return eq_int if op == "eq" else (lambda env: not eq_int(env))
    if op in ("in", "not_in") and all(isinstance(v, str) for v in value):
        members = frozenset(value)
        if op == "in":
            return lambda env: env.get(path, MISSING).__class__ is str and env.get(path) in members
        return lambda env: not (env.get(path, MISSING).__class__ is str and env.get(path) in members)
    return None


@dataclass(frozen=True)
class CompiledCondition:
    test: Test
    explain: Callable[[Env, list[LeafResult]], bool]
    fields: frozenset[str]


def _compile(cond: Condition) -> tuple[Test, Callable[[Env, list[LeafResult]], bool]]:
    if isinstance(cond, Leaf):
        pred, path, op, expected = leaf_predicate(cond), cond.field, cond.op, cond.value
        test = _fast_leaf(cond) or (lambda env: pred(env.get(path, MISSING)))

        def explain(env: Env, out: list[LeafResult]) -> bool:
            actual = env.get(path, MISSING)
            result = pred(actual)
            out.append(LeafResult(path, op, expected, actual, result))
            return result

        return test, explain
    if isinstance(cond, NotOf):
        inner_test, inner_explain = _compile(cond.not_)
        return (lambda env: not inner_test(env)), (lambda env, out: not inner_explain(env, out))
    subs = [_compile(c) for c in (cond.all if isinstance(cond, AllOf) else cond.any)]
    tests = tuple(t for t, _ in subs)
    explains = tuple(e for _, e in subs)
    def explain_all(env: Env, out: list[LeafResult]) -> bool:
        return all([e(env, out) for e in explains])  # a list: every leaf is recorded

    def explain_any(env: Env, out: list[LeafResult]) -> bool:
        return any([e(env, out) for e in explains])
    if isinstance(cond, AllOf):
        if len(tests) == 1:
            return tests[0], explain_all
        if len(tests) == 2:
            a, b = tests
            return (lambda env: a(env) and b(env)), explain_all

        def test_all(env: Env) -> bool:
            for t in tests:
                if not t(env):
                    return False
            return True

        return test_all, explain_all
    assert isinstance(cond, AnyOf)
    if len(tests) == 1:
        return tests[0], explain_any
    if len(tests) == 2:
        a, b = tests
        return (lambda env: a(env) or b(env)), explain_any

    def test_any(env: Env) -> bool:
        for t in tests:
            if t(env):
                return True
        return False

    return test_any, explain_any


def leaves_of(cond: Condition | None) -> list[Leaf]:
    if cond is None:
        return []
    if isinstance(cond, Leaf):
        return [cond]
    if isinstance(cond, NotOf):
        return leaves_of(cond.not_)
    return [leaf for sub in (cond.all if isinstance(cond, AllOf) else cond.any) for leaf in leaves_of(sub)]


def _always(env: Env) -> bool:
    return True


def compile_condition(cond: Condition | None) -> CompiledCondition:
    """Compile a validated condition; ``None`` (no ``when``) always holds.

    The explain closure evaluates every leaf (no short-circuit) so the trace
    shows each value a rule saw, not only the first deciding one.
    """
    if cond is None:
        return CompiledCondition(_always, lambda env, out: True, frozenset())
    test, explain = _compile(cond)
    return CompiledCondition(test, explain, frozenset(leaf.field for leaf in leaves_of(cond)))
