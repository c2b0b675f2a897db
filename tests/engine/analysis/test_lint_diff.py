"""Lint and diff over the enumerated input space, on the shipped rules and on edits of them."""

from __future__ import annotations

import pytest

from engine import LayoutEngine
from engine.analysis import diff_rulesets, enumerate_inputs, lint
from engine.layout_engine import shipped_rules_dir
from policy import ScaleViews, load_rules_from_texts

PTH = {"fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"}


def shipped_texts() -> dict[str, str]:
    root = shipped_rules_dir()
    return {str(p.relative_to(root)): p.read_text() for p in [*root.glob("*.yaml"), *root.glob("connectors/*.yaml")]}


def without_rule(texts: dict[str, str], rule_id: str) -> dict[str, str]:
    out = {}
    for name, text in texts.items():
        if f"- id: {rule_id}\n" in text:
            start = text.index(f"  - id: {rule_id}\n")
            nxt = text.find("\n  - id: ", start + 1)
            text = text[:start] + (text[nxt + 1:] if nxt != -1 else "")
        out[name] = text
    return out


@pytest.fixture(scope="module")
def shipped():
    return LayoutEngine.default().ruleset


@pytest.fixture(scope="module")
def no_pth():
    return load_rules_from_texts(without_rule(shipped_texts(), "per-token-head-forbids-cross-layer"))


def test_shipped_rules_lint_clean(shipped) -> None:
    report = lint(shipped)
    assert report.inputs_checked > 10_000
    assert [f.render() for f in report.findings if f.severity in ("error", "warning")] == []


def test_removing_the_per_token_head_rule_fails_lint_with_the_corrupting_inputs(no_pth) -> None:
    report = lint(no_pth)
    assert {f.code for f in report.errors} == {"unsafe-permit"}
    unsafe = {label for f in report.errors for label in f.inputs}
    assert unsafe
    for label in unsafe:
        fields = dict(part.split("=", 1) for part in label.split(" "))
        assert fields["kv_cache_dtype"] in PTH
        assert fields["scale_views"] == "assume_per_layer_contiguous"
        assert fields["groups"] == "1x1"
    assert any("layer 0 k scale and layer 1 k scale both write" in f.message for f in report.errors)


def test_diff_lists_exactly_the_per_token_head_inputs(shipped, no_pth) -> None:
    report = diff_rulesets(shipped, no_pth)
    changed = {c.input.label for c in report.changes}
    unsafe = {label for f in lint(no_pth).errors for label in f.inputs}
    assert changed == unsafe  # every decision the edit changes is one the verifier rejects
    for c in report.changes:
        assert c.old.startswith("per_layer/") and c.new.startswith("cross_layer/")
        assert c.old_because == ("per-token-head-forbids-cross-layer (rules/issue-48412/global.yaml:42)",) or \
            c.old_because[0].startswith("per-token-head-forbids-cross-layer")
        assert c.new_because  # the connector preference that now wins
    assert sum(report.counts().values()) == len(report.changes)


def test_diff_of_identical_sets_is_empty(shipped) -> None:
    assert diff_rulesets(shipped, load_rules_from_texts(shipped_texts())).changes == ()


def test_dead_rule_and_conflict_and_not_load_bearing() -> None:
    texts = {
        "global.yaml": (
            "version: 1\nrules:\n"
            "  - id: never\n    description: huge blocks only\n"
            "    when: {field: kv.block_size, gt: 100000}\n    forbid: {placement: cross_layer}\n"
            "  - id: no-per-layer-hnd\n    description: style choice\n"
            "    when: {field: backend.mla, eq: false}\n    forbid: {placement: per_layer, head_order: HND}\n"
            "  - id: mla-needs-hnd\n    description: contradiction on MLA\n"
            "    when: {field: backend.mla, eq: true}\n    require: {head_order: HND}\n"
            "  - id: mla-forbids-hnd\n    description: MLA has no head dim\n"
            "    when: {field: backend.mla, eq: true}\n    forbid: {head_order: HND}\n"
        ),
    }
    report = lint(load_rules_from_texts(texts))
    by_code = {f.code: f for f in report.findings}
    assert by_code["dead-rule"].rule.id == "never"
    assert by_code["conflict"].severity == "error"
    assert "`mla-needs-hnd` (global.yaml:" in by_code["conflict"].message
    assert "`mla-forbids-hnd` (global.yaml:" in by_code["conflict"].message
    assert all("backend=FLASHMLA" in label for label in by_code["conflict"].inputs)
    notes = {f.rule.id for f in report.findings if f.code == "not-load-bearing"}
    assert notes == {"no-per-layer-hnd"}  # LBHNC never overlaps: removing it protects nothing


def test_stride_aware_space_shows_the_rule_is_not_load_bearing() -> None:
    """Once backends build stride-aware scale views, a blunt per-token-head forbid
    protects nothing: lint says it can go (how the cross-layer speed-up comes back)."""
    texts = {"global.yaml": (
        "version: 1\nrules:\n  - id: blunt-pth\n    description: per-token-head forbids cross-layer\n"
        "    when: {field: kv.per_token_head, eq: true}\n    forbid: {placement: cross_layer}\n"
        "  - id: hnd-needs-head-dim\n    description: MLA has no head dim\n"
        "    when: {field: backend.supports_hnd, eq: false}\n    forbid: {head_order: HND}\n")}
    rs = load_rules_from_texts(texts)
    fixed = list(enumerate_inputs(rs, scale_views=[ScaleViews.stride_aware]))
    def notes(report):
        return {f.rule.id for f in report.findings if f.code == "not-load-bearing"}

    assert notes(lint(rs, fixed)) == {"blunt-pth"}
    assert notes(lint(rs)) == set()
