"""One `validate` run reports every problem of every file and every stage, in file:line:col order (#15).

Before, a rule set with nine problems spread over the stages (YAML values, schema, field paths
and operand types, duplicates across files, connector files) needed three runs: a rule with a
schema error hid its leaves, a file with any error hid its rule ids from the duplicate check,
and one unreadable tag stopped its whole file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpolicy.engine.cli.main import main
from kvpolicy.policy import RuleLoadError, load_rules

GLOBAL = """\
version: 1
rules:
  - id: shared-id
    descriptoin: misspelt key
    when: {field: kv.nope, eq: 1}
    forbid: {placement: cross_layer}
  - id: no-effect
    description: type error and no effect
    when: {field: kv.block_size, eq: "16"}
  - id: tagged
    description: d
    when: {field: kv.num_layers, gt: !!int abc}
    forbid: {placement: cross_layer}
"""

NIXL = """\
version: 1
connector: NixlConnector
defaults: {layout_order: [LBNHC]}
rules:
  - id: shared-id
    description: the same id as in global.yaml
    when: {field: kv.quant_bits, eq: 4}
    forbid: {placement: cross_layer}
"""

BROKEN = "version: 1\nrules: [\n"

EXPECTED = [  # (file, line, col, code): nine problems, sorted as a reader fixes them
    ("connectors/broken.yaml", 3, 1, "yaml-syntax"),
    ("connectors/nixl.yaml", 3, 11, "misplaced-defaults"),
    ("connectors/nixl.yaml", 5, 9, "duplicate-rule-id"),
    ("global.yaml", 3, 5, "missing-key"),
    ("global.yaml", 4, 5, "unknown-key"),
    ("global.yaml", 5, 19, "unknown-field"),
    ("global.yaml", 7, 5, "invalid-rule"),
    ("global.yaml", 9, 38, "type-mismatch"),
    ("global.yaml", 12, 38, "yaml-value"),
]


def nine_problem_rules(root: Path) -> Path:
    (root / "connectors").mkdir(parents=True)
    (root / "global.yaml").write_text(GLOBAL)
    (root / "connectors" / "nixl.yaml").write_text(NIXL)
    (root / "connectors" / "broken.yaml").write_text(BROKEN)
    return root


def located(diags: list) -> list[tuple[str, int, int, str]]:
    return [(d.file.split("rules/", 1)[-1], d.line, d.col, d.code) for d in diags]


def test_every_problem_of_every_stage_in_one_load(tmp_path: Path) -> None:
    root = nine_problem_rules(tmp_path / "rules")
    with pytest.raises(RuleLoadError) as info:
        load_rules(root)
    assert located(info.value.diagnostics) == EXPECTED


def test_validate_prints_them_all_sorted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = nine_problem_rules(tmp_path / "rules")
    assert main(["validate", str(root)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error[" in line]
    assert len(lines) == len(EXPECTED) == 9
    keys = []
    for line in lines:
        where = line.split(": error[", 1)[0]
        file, ln, col = where.rsplit(":", 2)
        keys.append((file, int(ln), int(col)))
    assert keys == sorted(keys)


# -- policy test files ------------------------------------------------------------------------

CASES_A = """\
version: 1
cases:
  - name: one
    input: {spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}, conector: x}
    expect: {matched: [no-such-rule]}
  - name: one
    input: {spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}}
    expect: {layout: LBNHC}
  - name: two
    name: again
    input: {spec: {num_layers: !!int many}}
    expect: {not_matched: [r1]}
"""

CASES_B = "version: 1\ncases: [\n"


def test_every_problem_of_every_case_file_in_one_load(tmp_path: Path) -> None:
    from kvpolicy.engine.policy_tests import PolicyTestError, load_cases
    from kvpolicy.policy import load_rules_from_texts

    ruleset = load_rules_from_texts({"global.yaml": "version: 1\nrules:\n  - id: r1\n    description: d\n"
                                                    "    forbid: {placement: cross_layer}\n"})
    (tmp_path / "a.yaml").write_text(CASES_A)
    (tmp_path / "b.yaml").write_text(CASES_B)
    with pytest.raises(PolicyTestError) as info:
        load_cases([tmp_path], ruleset)
    got = [(Path(d.file).name, d.line, d.col, d.code) for d in info.value.diagnostics]
    assert got == [
        ("a.yaml", 4, 84, "unknown-key"),  # the case's input is broken...
        ("a.yaml", 5, 24, "unknown-rule"),  # ...and its expectation is still checked
        ("a.yaml", 6, 11, "duplicate-case"),
        ("a.yaml", 10, 5, "duplicate-key"),  # the YAML problem does not stop the file
        ("a.yaml", 11, 32, "yaml-value"),
        ("b.yaml", 3, 1, "yaml-syntax"),
    ]
