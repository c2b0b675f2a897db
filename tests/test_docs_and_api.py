"""The generated docs match the models, the public API is what we promise, and lint is clean."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

import kvpolicy.engine as engine
import kvpolicy.policy as policy
from kvpolicy.policy.reference import render_reference
from kvpolicy.policy.rule_model import RuleFile

ROOT = Path(__file__).resolve().parent.parent


def test_rule_language_reference_is_current() -> None:
    committed = (ROOT / "docs" / "rule-language.md").read_text()
    assert committed == render_reference(), "regenerate: python -m kvpolicy.policy.reference > docs/rule-language.md"


def test_reference_lists_every_field_and_operator() -> None:
    text = render_reference()
    from kvpolicy.policy.context import FIELDS

    for path in FIELDS:
        assert f"| `{path}` |" in text
    for op in ("eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "exists"):
        assert f"| `{op}` |" in text


def test_public_api() -> None:
    assert set(engine.__all__) >= {"LayoutEngine", "Decision"}
    for name in engine.__all__:
        assert hasattr(engine, name), name
    for name in policy.__all__:
        assert hasattr(policy, name), name
    assert callable(engine.LayoutEngine.default)
    assert callable(engine.LayoutEngine.from_path)


def test_policy_never_imports_engine() -> None:
    code = ("import sys, kvpolicy.policy, kvpolicy.policy.load, kvpolicy.policy.reference\n"
            "print([m for m in sys.modules if m.startswith('kvpolicy.engine')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    for path in (ROOT / "policy").glob("*.py"):
        text = path.read_text()
        assert "from kvpolicy.engine" not in text and "import kvpolicy.engine" not in text, path


def test_ruff_clean() -> None:
    # `python -m ruff`: the test extras install it beside this interpreter, on PATH or not
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "kvpolicy", "policy", "engine", "tests",
                          "bench"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_worked_example_is_the_default_dry_run() -> None:
    """docs/rule-language.md's worked example: its rules exist as quoted, and the decision is the one it states."""
    from kvpolicy.engine import LayoutEngine
    from kvpolicy.engine.inputs import DEFAULT_EXAMPLE

    engine = LayoutEngine.default("vllm-0.34")
    rules = {r.id: r for r in engine.ruleset.rules}
    for rid in ("extensible-kv-cache-with-connector-needs-block-compact", "offloading-requires-lbhnc"):
        assert rid in rules, rid
    assert str(rules["offloading-requires-lbhnc"].rule.prefer) == "{layout: LBHNC}"
    # each quoted file's rules are the shipped rules word for word (a shipped edit must update the quote)
    example = render_reference().split("## Worked example", 1)[1]
    block = example.split("```yaml\n", 1)[1].split("```", 1)[0]
    quoted = [part for part in re.split(r"^# rules/\S+.*$", block, flags=re.M) if part.strip()]
    assert len(quoted) == 2
    for part in quoted:
        for rule in RuleFile.model_validate(yaml.safe_load(part)).rules:
            assert rule == rules[rule.id].rule, f"the worked example quotes `{rule.id}` unlike its shipped file"
    d = engine.decide(**DEFAULT_EXAMPLE)
    assert str(d.layout) == "LBHNC" and d.score == 10
    assert [str(x) for x in d.context.candidates] == ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
    assert "**LBHNC** (per_layer, HND)" in (ROOT / "docs" / "rule-language.md").read_text()


def test_the_doc_examples_name_nothing_outside_docs_examples() -> None:
    """Copying docs/examples/ anywhere must work (issue 22): every `model` a fleet deployment, a test case or
    the serve config names is a model directory inside docs/examples/ that holds a config.json. Fleet and
    case paths are relative to their file; serve.yaml's to where `vllm serve` runs (docs/examples/)."""
    examples = ROOT / "docs" / "examples"
    named: list[tuple[Path, Path]] = []
    fleet = yaml.safe_load((examples / "fleet.yaml").read_text())
    named += [(examples / "fleet.yaml", examples / d["model"]) for d in fleet["deployments"] if "model" in d]
    for cases in examples.glob("*/tests/*.yaml"):
        for case in yaml.safe_load(cases.read_text())["cases"]:
            if "model" in case.get("input", {}):
                named.append((cases, cases.parent / case["input"]["model"]))
    named.append((examples / "serve.yaml", examples / yaml.safe_load((examples / "serve.yaml").read_text())["model"]))
    assert len(named) >= 27
    for where, path in named:
        path = path.resolve()
        assert examples in path.parents, f"{where}: {path} is outside docs/examples/"
        assert (path / "config.json").is_file(), f"{where}: {path} holds no config.json"
