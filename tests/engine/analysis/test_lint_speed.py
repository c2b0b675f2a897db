"""Lint's decisions are shared between inputs the rules cannot tell apart (issue 32): the findings stay
exactly those of the slow path, kept here as the reference, while the work follows what the rules see.

The slow path decided every distinct input (each value of every field a rule tests, each connector
label) from scratch and resolved each connector's rule files from the release profiles every time:
the shipped rules plus 1,000 generated ones took about 30 s of CPU on vLLM 0.34's profile, and 20
one-rule files for third-party connectors (about 300,000 inputs) over a minute.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from unittest import mock

import pytest

from kvpolicy.engine.analysis.decider import Decided, Decider
from kvpolicy.engine.analysis.space import AnalysisInput
from kvpolicy.engine.decide import connector_rules_for, evaluate
from kvpolicy.policy import load_rules_from_texts
from kvpolicy.policy.ruleset import FORBID, PREFER, CompiledRule

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

PROFILE = "issue-48412"
decider_module = importlib.import_module("kvpolicy.engine.analysis.decider")
lint_module = importlib.import_module("kvpolicy.engine.analysis.lint")  # the package exports `lint`, the function


class ReferenceDecider(Decider):
    """The slow path as it was: every decision key evaluated from scratch, connector rules resolved each time."""

    def decide(self, inp: AnalysisInput) -> Decided:
        k = self.key(inp)
        found = self._cache.get(k)
        if found is None:
            found = self._cache[k] = self._reference(inp)
        return found

    def _reference(self, inp: AnalysisInput) -> Decided:
        ruleset = self.ruleset
        glob, conn = inp.scopes(ruleset)
        if conn is not None:  # the rules as `connector_rules_for` resolves them, not the cached file names
            conn = _resolved(conn, inp)
        outcome = evaluate(ruleset, glob, conn, explain=False)
        cands = sum(1 << i for i, x in enumerate(ruleset.layout_order) if x in glob.candidates)
        matched: dict[str, CompiledRule] = {}
        removers: dict[int, set[str]] = {}
        n = len(ruleset.layout_order)
        for scope in glob.walk() + (conn.walk() if conn else []):
            for rule in scope.rules:
                test, code, mask, _ = rule.fast
                if test(scope.env):
                    matched.setdefault(rule.id, rule)
                    if code != PREFER:
                        gone = cands & (mask if code == FORBID else ~mask)
                        for i in range(n):
                            if gone >> i & 1:
                                removers.setdefault(i, set()).add(rule.id)
        return Decided(outcome, cands, tuple(matched.values()), {i: frozenset(s) for i, s in removers.items()})


def _resolved(scope, inp: AnalysisInput):
    from kvpolicy.engine.decide import Scope

    def walk(s, node):
        rules = connector_rules_for(inp_ruleset[0], inp.core.context.profile, node.config.name, node.config.extra)
        assert rules == s.rules, "the cached connector files give the rules connector_rules_for gives"
        return Scope(s.label, rules, s.env, tuple(walk(m, c) for m, c in zip(s.members, node.members, strict=True)),
                     s.mode, s.candidates, s.release)

    return walk(scope, inp.conn)


inp_ruleset: list = [None]


def _third_party(count: int) -> dict[str, str]:
    return {f"connectors/Vendor{i:02d}Connector.yaml":
            f"version: 1\nconnector: Vendor{i:02d}Connector\nrules:\n"
            f"  - id: vendor-{i:02d}-no-cross\n    description: vendor {i} reads no cross-layer blocks\n"
            f"    when: {{field: kv.block_size, gt: {8 * (i + 1)}}}\n    forbid: {{placement: cross_layer}}\n"
            for i in range(count)}


def _corpus() -> list[tuple[str, object]]:
    from bench_decide import generated_rules

    from kvpolicy.engine.layout_engine import LayoutEngine

    shipped = LayoutEngine.default(PROFILE).ruleset
    texts = generated_rules(60, 6)  # the shipped rules plus generated connector layers
    vendor = {**{k: v for k, v in texts.items() if not k.startswith("connectors/gen_")}, **_third_party(4)}
    return [("shipped", shipped), ("generated", load_rules_from_texts(texts)),
            ("third-party", load_rules_from_texts(vendor))]


def _report(ruleset) -> dict:
    data = lint_module.lint(ruleset, vllm_version=PROFILE).to_dict()
    data.pop("seconds", None)
    return json.loads(json.dumps(data, default=str))


@pytest.mark.parametrize("name", ["shipped", "generated", "third-party"])
def test_lint_findings_equal_the_slow_paths(name: str) -> None:
    ruleset = dict(_corpus())[name]
    fast = _report(ruleset)
    inp_ruleset[0] = ruleset
    with mock.patch.object(lint_module, "Decider", ReferenceDecider), \
            mock.patch.object(lint_module, "_folded", lambda inputs: {"groups": lint_module.fold(inputs),
                                                                        "brief": lint_module.fold(inputs, 6)}):
        slow = _report(ruleset)
    assert fast["findings"] and fast == slow


def test_decisions_follow_what_the_rules_see_not_the_inputs() -> None:
    """The fast path evaluates once per kind of input the rules tell apart (each leaf's answer, each
    connector's rule files), the slow one once per distinct value of every field some rule tests."""
    ruleset = dict(_corpus())["third-party"]
    space = lint_module.build_space([ruleset], vllm_version=PROFILE)
    fast, slow = Decider(ruleset), ReferenceDecider(ruleset)
    inp_ruleset[0] = ruleset
    calls = {"fast": 0, "slow": 0}
    real = decider_module.evaluate

    def counting(which):
        def run(*args, **kwargs):
            calls[which] += 1
            return real(*args, **kwargs)
        return run

    with mock.patch.object(decider_module, "evaluate", counting("fast")):
        for inp in space:
            fast.decide(inp)
    with mock.patch.object(sys.modules[__name__], "evaluate", counting("slow")):
        for inp in space:
            slow.decide(inp)
    assert calls["slow"] == len(slow._cache)
    assert calls["fast"] == len(fast._shared)  # one evaluation per kind of input the rules see
    assert calls["fast"] * 5 < calls["slow"] * 3  # 1,474 against 2,774 here
