"""Audit-mode rules (`enforcement: audit`, Kyverno's Audit): reported, never enforced (engine/audit.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy import RuleLoadError, load_rules_from_texts
from kvpolicy.policy.layouts import Layout

SPEC = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}

BASE = """\
version: 1
rules:
  - id: prefer-outermost
    description: one descriptor per block
    prefer: {block_outermost: true}
"""


def _audit(rule_id: str, pattern: str, when: str | None = None, effect: str = "forbid") -> str:
    text = f"  - id: {rule_id}\n    description: {rule_id} in rollout\n    enforcement: audit\n"
    if when:
        text += f"    when: {when}\n"
    return text + f"    {effect}: {pattern}\n"


def test_an_audit_rule_warns_what_enforcing_it_would_change_and_changes_nothing() -> None:
    plain = LayoutEngine(load_rules_from_texts({"global.yaml": BASE})).decide(spec=SPEC)
    audited = LayoutEngine(load_rules_from_texts(
        {"global.yaml": BASE + _audit("no-outermost", "{block_outermost: true}")})).decide(spec=SPEC)
    assert audited.layout == plain.layout and str(plain.layout).startswith("B")
    (finding,) = audited.audit
    assert finding.rule.id == "no-outermost" and finding.changes_decision
    assert finding.enforced_layout is not None and not finding.enforced_layout.is_block_outermost
    text = [w for w in audited.warnings if "no-outermost" in w]
    assert text and "global.yaml:" in text[0] and f"would become {finding.enforced_layout}" in text[0]
    data = json.loads(audited.to_json())
    assert data["audit"][0]["rule"] == "no-outermost" and data["audit"][0]["changes_decision"] is True
    assert any("no-outermost" in w for w in data["warnings"])
    assert "no-outermost" in audited.explain("full")


def test_an_audit_rule_that_would_leave_nothing_says_vllm_would_refuse_to_start() -> None:
    d = LayoutEngine(load_rules_from_texts(
        {"global.yaml": BASE + _audit("nothing-left", "{placement: cross_layer}", effect="require")
                       + _audit("nothing-left-2", "{placement: cross_layer}")})).decide(spec=SPEC)
    # each is judged alone: enforcing one of them leaves the other's layouts
    assert all(f.enforced_layout is not None for f in d.audit)
    only = LayoutEngine(load_rules_from_texts({"global.yaml": BASE + _audit("all-gone", "{layer_compact: true}")
                                               + _audit("all-gone-2", "{layer_compact: false}")
                                               .replace("audit", "enforce")})).decide(spec=SPEC)
    gone = next(f for f in only.audit if f.rule.id == "all-gone")
    assert gone.enforced_layout is None and "refuse to start" in gone.text()


def test_an_audit_rule_that_does_not_match_is_silent() -> None:
    d = LayoutEngine(load_rules_from_texts({"global.yaml": BASE + _audit(
        "only-fp8", "{block_outermost: true}", when="{field: kv.per_token_head, eq: true}")})).decide(spec=SPEC)
    assert d.audit == () and not any("only-fp8" in w for w in d.warnings)


def test_a_connector_files_audit_rule_applies_only_with_that_connector() -> None:
    files = {"global.yaml": BASE,
             "connectors/NixlConnector.yaml": "version: 1\nconnector: NixlConnector\nrules:\n"
             + _audit("nixl-audit", "{block_outermost: true}")}
    engine = LayoutEngine(load_rules_from_texts(files))
    assert engine.decide(spec=SPEC).audit == ()
    (finding,) = engine.decide(spec=SPEC, connector="NixlConnector").audit
    assert finding.scope.startswith("connector:NixlConnector")


def test_enforcement_on_a_prefer_rule_is_a_located_error() -> None:
    text = BASE + "  - id: bad\n    description: x\n    enforcement: audit\n    prefer: {placement: per_layer}\n"
    with pytest.raises(RuleLoadError) as exc:
        load_rules_from_texts({"global.yaml": text})
    diag = exc.value.diagnostics[0]
    assert diag.file == "global.yaml" and diag.line >= 5 and "forbid" in diag.message


def test_the_digest_counts_audit_rules_and_keeps_enforced_ones_stable() -> None:
    base = load_rules_from_texts({"global.yaml": BASE})
    audited = load_rules_from_texts({"global.yaml": BASE + _audit("x", "{placement: cross_layer}")})
    enforced = load_rules_from_texts({"global.yaml": BASE + _audit("x", "{placement: cross_layer}")
                                      .replace("    enforcement: audit\n", "")})
    assert len({base.digest, audited.digest, enforced.digest}) == 3
    assert [r.id for r in audited.rules] == ["prefer-outermost"] and [r.id for r in audited.audit_rules] == ["x"]


_PATTERNS = ["{placement: cross_layer}", "{placement: per_layer}", "{block_outermost: true}",
             "{head_order: HND}", "{layer_compact: true}"] + [f"{{layout: {x.value}}}" for x in Layout]
_CONDITIONS = [None, "{field: kv.per_token_head, eq: true}", "{field: kv.num_layers, gt: 2}",
               "{field: connector.name, eq: NixlConnector}"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=st.lists(st.tuples(st.sampled_from(_PATTERNS), st.sampled_from(_CONDITIONS),
                                st.sampled_from(["forbid", "require"])), max_size=5),
       dtype=st.sampled_from(["auto", "fp8_per_token_head"]),
       connector=st.sampled_from([None, "NixlConnector", "OffloadingConnector"]))
def test_adding_audit_rules_never_changes_the_decided_layout(rules, dtype, connector) -> None:
    plain = LayoutEngine(load_rules_from_texts({"global.yaml": BASE}))
    extra = "".join(_audit(f"audit-{i}", p, w, e) for i, (p, w, e) in enumerate(rules))
    audited = LayoutEngine(load_rules_from_texts({"global.yaml": BASE + extra}))
    kw = {"spec": SPEC, "kv_cache_dtype": dtype, "connector": connector}
    a, b = plain.decide(**kw), audited.decide(**kw)
    assert (a.layout, a.ranking) == (b.layout, b.ranking)
    assert len(b.audit) <= len(rules)


def test_lint_notes_what_enforcing_an_audit_rule_would_change_and_never_fails_for_it() -> None:
    from kvpolicy.engine.analysis.audit_lint import audit_view
    from kvpolicy.engine.analysis.lint import lint
    from kvpolicy.engine.analysis.space import build_space

    files = {"global.yaml": BASE + _audit("fp8-per-layer", "{placement: cross_layer}",
                                          when="{field: kv.kv_cache_dtype, eq: fp8}")}
    rs = load_rules_from_texts(files)
    space = build_space([rs, audit_view(rs)], vllm_version="vllm-0.34", backends=["TRITON_ATTN"],
                        kv_cache_dtypes=["auto", "fp8"])
    report = lint(rs, space, vllm_version="vllm-0.34", baseline=None)
    (note,) = [f for f in report.findings if f.code == "audit"]
    assert note.severity == "note" and note.rule.id == "fp8-per-layer"
    assert "enforcing it would change" in note.message and note.count > 0
    assert all(" -> " in label for label in note.inputs)
    assert not any(f.rule is not None and f.rule.id == "fp8-per-layer" for f in report.errors + report.warnings)


def test_the_plugin_logs_an_audit_finding_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from kvpolicy.engine.integrations import vllm_plugin

    d = LayoutEngine(load_rules_from_texts(
        {"global.yaml": BASE + _audit("logged-audit", "{block_outermost: true}")})).decide(spec=SPEC)
    with caplog.at_level(logging.INFO, logger="vllm.kvpolicy"):
        vllm_plugin._log_decision(d, explain=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("audit rule `logged-audit`" in m and "would become" in m for m in warned)
