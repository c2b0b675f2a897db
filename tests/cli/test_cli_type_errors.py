"""A value of the wrong type or a missing key in a fleet, policy test or rule file: located, and followed by a
help line saying what to write (the rule files' own checks had one; the shared ones said only what was wrong)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_capture import cli

CASE = "version: 1\ncases:\n  - name: x\n    input: {vllm_version: 0.34.0, spec: {num_layers: 4, num_kv_heads: 2, " \
       "head_size: 64}}\n    expect: {layout: LBNHC}\n"
FILES = [
    ("fleet", "deployments: [{name: a, vllm_version: 0.34.0}]\n", "missing required key `version`",
     "start the file with `version: 1`"),
    ("fleet", "version: 1\ndeployments:\n  - name: a\n    spec: 3\n", "expected a valid dictionary, got integer `3`",
     "write a mapping here"),
    ("fleet", "version: 1\ndeployments:\n  - name: [a]\n", "expected a valid string",
     "write one value here, not a list or mapping"),
    ("fleet", "version: 1\ndeployments:\n  - name: 7\n    vllm_version: 0.34.0\n", "expected a valid string",
     'quote it (`"7"`) to write it as text'),
    ("cases", "version: 1\ncases: 5\n", "expected a valid list, got integer `5`", "write a list here"),
    ("cases", "version: 1\ncases: [{name: x, input: 3}]\n", "missing required key `expect`",
     "add `expect:` to this mapping, with its value"),
    ("cases", CASE.replace("num_layers: 4", "num_layers: x"), "expected a valid integer, got string `x`",
     "write a whole number here"),
    ("rules", "version: 1\nrules: [7]\n", "expected a valid dictionary, got integer `7`", "write a mapping here"),
]


@pytest.mark.parametrize(("kind", "text", "error", "help"), FILES, ids=[f"{k}-{e[:30]}" for k, _, e, _ in FILES])
def test_a_type_error_is_located_with_what_to_write(capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str,
                                                   text: str, error: str, help: str) -> None:
    if kind == "rules":
        (tmp_path / "global.yaml").write_text(text)
        argv = ["validate", str(tmp_path)]
    else:
        path = tmp_path / "f.yaml"
        path.write_text(text)
        argv = ["dry-run", "--fleet", str(path)] if kind == "fleet" else ["test", str(path)]
    code, out, err = cli(capsys, *argv)
    lines = (out + err).splitlines()
    at = next((i for i, line in enumerate(lines) if error in line), None)
    assert code != 0 and at is not None, out + err
    assert lines[at].split(": error[")[0].count(":") == 2  # file:line:col
    assert "instance of" not in lines[at]  # no pydantic class name
    assert lines[at + 1].strip().startswith("help: ") and help in lines[at + 1], lines[at:at + 2]
