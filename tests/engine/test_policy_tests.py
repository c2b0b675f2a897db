"""`kvpolicy.engine.policy_tests`: loading cases with positions, running them, coverage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.policy_tests import (
    CaseInput,
    GroupInput,
    PolicyTestError,
    context_for,
    groups_from_data,
    load_cases,
    run_policy_tests,
)
from kvpolicy.policy import InputError, load_rules_from_texts
from kvpolicy.policy.layouts import Layout

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = LayoutEngine.default().ruleset
SPEC = "{num_layers: 24, block_size: 16, num_kv_heads: 2, head_size: 64}"

CONFLICT = load_rules_from_texts({
    "global.yaml": """\
version: 1
rules:
  - id: no-cross
    description: per-layer only
    forbid: {placement: cross_layer}
  - id: cross-only
    description: cross-layer only, when a connector is set
    when: {field: connector.present, eq: true}
    require: {placement: cross_layer}
  - id: never
    description: never matches
    when: {field: kv.num_layers, gt: 100000}
    forbid: {head_order: HND}
""",
})


def write(tmp_path: Path, body: str, name: str = "cases.yaml") -> Path:
    path = tmp_path / name
    path.write_text("version: 1\ncases:\n" + body)
    return path


def errors_of(exc: pytest.ExceptionInfo[PolicyTestError]) -> list[tuple[int, int, str]]:
    return [(d.line, d.col, d.code) for d in exc.value.diagnostics]


# -- the shipped tests ----------------------------------------------------------------------


def test_shipped_cases_pass_and_cover_every_rule() -> None:
    run = run_policy_tests(SHIPPED, [ROOT / "rules" / "issue-48412" / "tests"])
    failed = [(r.loaded.location, r.failures) for r in run.results if not r.passed]
    assert failed == []
    assert run.ok and run.failed == 0 and run.passed == len(run.results) >= 25
    assert run.coverage.complete
    assert run.coverage.covered == {r.id for r in SHIPPED.rules}


def test_shipped_cases_cover_the_gate_scenarios() -> None:
    cases = load_cases([ROOT / "rules" / "issue-48412" / "tests"], SHIPPED)
    connectors = {c.case.input.connector for c in cases}
    assert {None, "OffloadingConnector", "NixlConnector", "MooncakeStoreConnector", "MultiConnector",
            "LMCacheConnectorV1"} <= connectors
    assert any(c.case.input.groups for c in cases)
    assert any(c.case.input.scale_views is not None for c in cases)
    assert any(c.case.input.backend == "FLASHMLA" and c.case.input.connector == "NixlConnector" for c in cases)


# -- running --------------------------------------------------------------------------------


def test_results_report_failures_and_matches(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
  - name: right
    input: {{spec: {SPEC}, kv_cache_dtype: fp8_per_token_head, connector: OffloadingConnector}}
    expect:
      layout: LBNHC
      survivors: [LBNHC, LBHNC]
      removed: {{BLNHC: [per-token-head-forbids-cross-layer], BHLNC: []}}
      matched: [offloading-prefers-cross-layer]
      not_matched: [cross-layer-needs-connector]
  - name: wrong
    input: {{spec: {SPEC}}}
    expect:
      layout: {{placement: cross_layer}}
      survivors: [LBNHC]
      removed: {{LBNHC: []}}
      matched: [offloading-prefers-cross-layer]
""")
    run = run_policy_tests(SHIPPED, [path])
    right, wrong = run.results
    assert right.passed and right.layout == Layout.parse("LBNHC")
    assert "per-token-head-forbids-cross-layer" in right.matched
    assert wrong.failures == (
        "expected layout: {placement: cross_layer}\nactual layout:   LBNHC",
        "expected survivors: LBNHC\nactual survivors:   LBNHC, LBHNC",
        "expected `LBNHC` removed\nactual: it survived",
        "expected rule `offloading-prefers-cross-layer` to match\nactual: it matched in no scope",
    )
    assert wrong.explanation().startswith("layout: LBNHC (per_layer, NHD)\n")
    assert "counterfactual:" in wrong.explanation()
    assert (run.passed, run.failed, run.ok) == (1, 1, False)
    data = run.to_dict()
    assert data["cases"][1]["location"] == f"{path}:11" and data["cases"][1]["passed"] is False
    json.dumps(data)


def test_partial_layout_pattern(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
  - name: head order only
    input: {{spec: {SPEC}, connector: NixlConnector}}
    expect: {{layout: {{head_order: HND}}}}
""")
    assert run_policy_tests(SHIPPED, [path]).ok


def test_expected_no_layout_still_records_matches(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
  - name: the rules conflict with a connector
    input: {{spec: {SPEC}, connector: OffloadingConnector}}
    expect:
      error: no-layout
      removed: {{LBNHC: [cross-only], BLNHC: [no-cross]}}
      matched: [no-cross, cross-only]
  - name: without a connector they agree
    input: {{spec: {SPEC}}}
    expect: {{error: no-layout}}
""")
    run = run_policy_tests(CONFLICT, [path])
    conflict, fine = run.results
    assert conflict.passed and conflict.layout is None
    assert {d.code for d in conflict.error.diagnostics} >= {"removed-candidates"}
    assert "error[removed-candidates]" in conflict.explanation()
    assert fine.failures == ("expected error: `no-layout`\nactual layout:  LBNHC",)
    assert [r.id for r in run.coverage.uncovered] == ["never"]
    assert run.coverage.to_dict()["uncovered"] == [{"rule": "never", "source": "global.yaml:10"}]


def test_wrong_error_code(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
  - name: bad backend
    input: {{spec: {SPEC}, backend: NOPE}}
    expect: {{error: model-config}}
  - name: the kind and the diagnostic code both match
    input: {{spec: {SPEC}, backend: NOPE}}
    expect: {{error: invalid-input}}
  - name: the diagnostic code
    input: {{spec: {SPEC}, backend: NOPE}}
    expect: {{error: unknown-backend}}
""")
    result, kind, code = run_policy_tests(SHIPPED, [path]).results
    assert kind.passed and code.passed
    assert result.failures == ("expected error: `model-config`\nactual errors:  `invalid-input`, `unknown-backend`",)
    assert ":4:" in result.explanation().split(" ")[0]  # located at `backend:` in the case file
    assert "error[unknown-backend]" in result.explanation()


# -- loading --------------------------------------------------------------------------------


def test_structure_errors_are_located(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
  - name: typo
    input:
      spec: {SPEC}
      conector: OffloadingConnector
    expect:
      layout: sideways/NHD
  - name: two sources
    input: {{spec: {SPEC}, model: x.json}}
    expect: {{}}
  - input: {{spec: {SPEC}}}
    expect: {{error: no-layout, layout: LBNHC}}
""")
    with pytest.raises(PolicyTestError) as exc:
        load_cases([path])
    assert errors_of(exc) == [
        (6, 7, "unknown-key"),
        (8, 15, "invalid-value"),
        (10, 12, "invalid-value"),
        (11, 13, "invalid-value"),
        (12, 5, "missing-key"),
        (13, 13, "invalid-value"),
    ]
    text = exc.value.render()
    assert f"{path}:6:7: error[unknown-key]: unknown key `conector`\n  help: did you mean `connector`?" in text
    assert "an input needs exactly one of `model`, `spec`, `groups`; found `model`, `spec`" in text
    assert "`error` cannot be combined with `layout`" in text


def test_yaml_and_file_errors(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("version: 1\ncases: [\n")
    (tmp_path / "b.yaml").write_text("- just a list\n")
    (tmp_path / "c.yaml").write_text("version: 2\ncases: []\n")
    with pytest.raises(PolicyTestError) as exc:
        load_cases([tmp_path, tmp_path / "missing.yaml"])
    codes = {(Path(d.file).name, d.code) for d in exc.value.diagnostics}
    assert codes == {("a.yaml", "yaml-syntax"), ("b.yaml", "not-a-mapping"), ("c.yaml", "invalid-value"),
                     ("missing.yaml", "not-found")}


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(PolicyTestError) as exc:
        load_cases([tmp_path])
    assert [d.code for d in exc.value.diagnostics] == ["no-test-files"]


def test_duplicate_names_and_unknown_rules(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
  - name: same
    input: {{spec: {SPEC}}}
    expect: {{not_matched: [no-crosss]}}
  - name: same
    input: {{spec: {SPEC}}}
    expect: {{removed: {{BHLNC: [cross-only, nope]}}}}
""")
    with pytest.raises(PolicyTestError) as exc:
        load_cases([path], CONFLICT)
    assert errors_of(exc) == [(5, 28, "unknown-rule"), (6, 11, "duplicate-case"), (8, 44, "unknown-rule")]
    assert "help: did you mean `no-cross`?" in exc.value.render()
    with pytest.raises(PolicyTestError) as exc:
        load_cases([path])  # without a rule set, rule ids are not checked
    assert errors_of(exc) == [(6, 11, "duplicate-case")]


# -- inputs ---------------------------------------------------------------------------------


def test_groups_override_attention_groups_only() -> None:
    groups = groups_from_data(
        [GroupInput(spec={"num_layers": 4, "block_size": 16, "num_kv_heads": 8, "head_size": 128},
                    num_attention_groups=2),
         GroupInput(spec={"kind": "mamba", "num_layers": 28, "block_size": 16, "num_kv_heads": 1, "head_size": 128})],
        kv_cache_dtype="fp8", block_size=32)
    attn, mamba = groups.groups
    assert attn.spec.kv_cache_dtype == "fp8" and attn.spec.block_size == 32 and attn.num_attention_groups == 2
    assert mamba.spec.kv_cache_dtype == "auto" and mamba.spec.block_size == 16
    # summed over vLLM's groups: the full group's 2, and 1 in each of the 7 groups vLLM splits 28 Mamba layers into
    assert groups.attention_groups == 9 and groups.count == 8 and groups.has_mamba


def test_groups_errors_name_the_group() -> None:
    with pytest.raises(InputError) as exc:
        groups_from_data([GroupInput(spec={"num_layers": 0, "block_size": 16, "num_kv_heads": 1, "head_size": 8})])
    assert exc.value.diagnostics[0].file == "groups[0].spec.num_layers"


def test_model_path_is_relative_to_the_case_file() -> None:
    inp = CaseInput(model="configs/qwen2.5-0.5b.json", kv_cache_dtype="fp8_per_token_head",
                    connector="OffloadingConnector")
    ctx = context_for(inp, ROOT / "tests" / "fixtures")
    assert ctx.kv.num_layers == 24 and ctx.kv.per_token_head
    assert ctx.connector is not None and ctx.connector.name == "OffloadingConnector"


def test_model_case_in_a_file(tmp_path: Path) -> None:
    config = ROOT / "tests" / "fixtures" / "configs" / "deepseek-v2-lite.json"
    path = write(tmp_path, f"""\
  - name: an MLA model from its config
    input: {{model: {config}, backend: FLASHMLA, connector: NixlConnector}}
    expect: {{layout: LBNHC, not_matched: [nixl-requires-hnd]}}
""")
    run = run_policy_tests(SHIPPED, [path])
    assert run.ok, run.results[0].failures
