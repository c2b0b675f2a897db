"""The shipped rules of the uniform-gate releases are layers shared between neighbours, not copies:
each release's profile lists its layers, bottom first, and each layer holds what those releases add."""

from __future__ import annotations

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.rule_layers import shipped_rules_dir, shipped_rules_dirs
from kvpolicy.policy.load import load_rules
from kvpolicy.policy.releases import get_profile

GATE = ("0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0")
GUARD = "per-token-head-forbids-cross-layer"
INT4 = "int4-full-and-sliding-window-pages-differ"


def test_every_gate_release_shares_the_base_layer_and_no_rule_is_written_twice() -> None:
    layers: dict[str, set[str]] = {}
    for version in GATE:
        profile = get_profile(version)
        assert profile.rules[0] == "vllm-gate"
        for sub, path in zip(profile.rules, shipped_rules_dirs(version), strict=True):
            assert path.name == sub and (path / "global.yaml").is_file()
            layers.setdefault(sub, {r.id for r in load_rules(path).rules})
    ids = [i for rules in layers.values() for i in rules]
    assert len(ids) == len(set(ids)), "a rule id in two shipped layers: a copy"


@pytest.mark.parametrize(("version", "guard", "int4"), [
    ("0.24.0", True, False), ("0.25.0", True, True), ("0.26.0", False, True), ("0.27.0", True, True),
    ("0.28.0", True, False)])
def test_each_release_has_the_layers_of_what_it_decides(version: str, guard: bool, int4: bool) -> None:
    ids = {r.id for r in LayoutEngine.default(version).ruleset.rules}
    assert (GUARD in ids, INT4 in ids) == (guard, int4)
    assert ("offloading-canonical-layout-keeps-per-layer" in ids) is (version == "0.28.0")


def test_the_layers_show_where_each_rule_comes_from() -> None:
    ruleset = LayoutEngine.default("0.27.0").ruleset
    assert ruleset.root == "rules/vllm-gate + rules/vllm-gate-per-token-head + rules/vllm-gate-int4-sliding-window"
    assert [layer.shipped for layer in ruleset.layers] == [True, True, True]
    assert get_profile("0.27.0").rules_label == ruleset.root


def test_one_directory_only_for_a_profile_that_has_one() -> None:
    assert shipped_rules_dir("0.34.0").name == "vllm-0.34"
    with pytest.raises(ValueError, match="shipped_rules_dirs"):
        shipped_rules_dir("0.28.0")


@pytest.mark.parametrize(("version", "kind"), [("0.24.0", "safety"), ("0.25.0", "safety")])
def test_the_verifier_proves_the_guard_load_bearing_where_the_scale_views_assume_per_layer_buffers(
        version: str, kind: str) -> None:
    """On 0.24-0.25 the per-token-head guard is kvpolicy's, not vLLM's: without it `lint` finds inputs for
    which an overlapping layout gets through (their Triton scale views assume per-layer buffers), which is
    why kvpolicy keeps those caches per layer where the release's gate gives them a cross-layer buffer."""
    from kvpolicy.engine.analysis import lint

    report = lint(LayoutEngine.default(version).ruleset, vllm_version=version)
    assert {lb.rule.id: lb.kind for lb in report.load_bearing}[GUARD] == kind
