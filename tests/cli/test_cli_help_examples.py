"""Every example in a `--help` text runs: from a scratch directory holding the files the examples name (the
spec file dry-run's help shows, a rule layer, a fleet file, ...), each example line is run as written and is
no usage error."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from kvpolicy.engine.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "fixtures" / "model_configs"

# the scratch directory's files: what the examples name (my-rules/, spec.yaml, ./Qwen2.5-0.5B, ...)
NIXL_RULE = """\
version: 1
connector: NixlConnector
rules:
  - id: site-nixl-stays-per-layer
    description: our decode hosts read NixlConnector's blocks per layer
    when: {field: kv.kind, eq: full}
    forbid: {placement: cross_layer}
"""
GLOBAL_RULE = """\
version: 1
rules:
  - id: site-no-lhbnc
    description: our transfer path cannot move LHBNC
    forbid: {layout: LHBNC}
"""
LAYER_TESTS = """\
version: 1
cases:
  - name: NixlConnector stays per layer
    input:
      vllm_version: 0.34.0
      spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}
      connector: NixlConnector
    expect:
      matched: [site-nixl-stays-per-layer]
  - name: LHBNC is never chosen
    input:
      vllm_version: 0.34.0
      spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}
      vllm_kv_cache_layout: LHBNC
    expect:
      error: no-layout
      removed: {LHBNC: [site-no-lhbnc]}
"""
FLEET = """\
version: 1
defaults:
  vllm_version: "0.34.0"
deployments:
  - name: qwen-offload
    model: Qwen2.5-0.5B
    kv_cache_dtype: fp8_per_token_head
    connector: OffloadingConnector
  - name: llama-nixl
    spec: {num_layers: 32, num_kv_heads: 8, head_size: 128}
    connector: NixlConnector
"""


def _help_spec() -> str:
    """The spec file dry-run's --help shows, as it shows it."""
    text = _epilogs()["dry-run"]
    block = text.split("spec file (--spec, YAML or JSON): KVCacheSpec fields, or several KV cache groups:\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if not line.startswith("  ") or line.strip().startswith("#"):
            break
        lines.append(line[2:])
    return "\n".join(lines) + "\n"


def scratch(root: Path) -> Path:
    """A directory holding every file the help examples name; returns it."""
    shutil.copytree(MODELS / "qwen2.5-0.5b-instruct", root / "Qwen2.5-0.5B")
    shutil.copytree(MODELS / "gemma-2-2b-it", root / "gemma-2-2b")
    (root / "spec.yaml").write_text(_help_spec())
    (root / "serve.yaml").write_text("model: ./Qwen2.5-0.5B\nkv-cache-dtype: fp8\ntensor-parallel-size: 2\n")
    for layer in ("my-rules", "base", "site"):
        (root / layer / "connectors").mkdir(parents=True)
        (root / layer / "global.yaml").write_text(GLOBAL_RULE.replace("site-", f"{layer}-"))
        (root / layer / "connectors" / "NixlConnector.yaml").write_text(NIXL_RULE.replace("site-", f"{layer}-"))
    (root / "my-rules" / "tests").mkdir()
    (root / "my-rules" / "tests" / "cases.yaml").write_text(LAYER_TESTS.replace("site-", "my-rules-"))
    (root / "cases").mkdir()
    (root / "cases" / "nixl.yaml").write_text(LAYER_TESTS.replace("site-", "my-rules-"))
    (root / "fleet.yaml").write_text(FLEET)
    (root / "rule.yaml").write_text(GLOBAL_RULE)
    (root / "my_connectors.py").write_text("class MyConnector:\n    pass\n")
    for name in ("prefill.json", "decode.json"):  # two dry-run documents, made in-process as the examples run
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["dry-run", "--vllm-version", "0.34.0", "--block-size", "16", "--format", "json"]) == 0
        (root / name).write_text(out.getvalue())
    return root


def _epilogs() -> dict[str, str]:
    parser = build_parser()
    out = {"kvpolicy": parser.epilog or ""}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.setdefault(name, sub.epilog or "")
    return out


def examples(text: str) -> list[str]:
    """The command lines of an epilog's `examples:` section, continuation lines (`\\`) joined."""
    out: list[str] = []
    current: str | None = None
    inside = False
    for line in text.splitlines():
        if line.startswith("examples:"):
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            inside = False
        if not inside:
            continue
        stripped = line.strip()
        if current is not None:
            current += " " + stripped.rstrip("\\").strip()
            if not stripped.endswith("\\"):
                out.append(current)
                current = None
        elif re.match(r"^(\w+=\S+ )*kvpolicy\b", stripped):
            if stripped.endswith("\\"):
                current = stripped.rstrip("\\").strip()
            else:
                out.append(stripped)
    return out


EXAMPLES = sorted({(verb, ex) for verb, text in _epilogs().items() for ex in examples(text)})


def test_every_verb_has_examples_found() -> None:
    verbs = {verb for verb, _ in EXAMPLES}
    assert {"kvpolicy", "dry-run", "validate", "test", "lint", "diff", "compat", "fmt", "doctor"} <= verbs
    assert len(EXAMPLES) > 40


@pytest.fixture(scope="module")
def here(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scratch(tmp_path_factory.mktemp("help-examples"))


def run_example(example: str, work: Path, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``example`` run as a shell runs it, in-process: its `NAME=value` prefixes set, `< FILE` as stdin,
    `> FILE` written, `| jq .KEY` answered from the JSON on stdout (exit 1 without that key)."""
    words = shlex.split(example, comments=True)
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    pipe = words[words.index("|") + 1:] if "|" in words else None
    words = words[:words.index("|")] if pipe is not None else words
    target = None
    if ">" in words:
        target = work / words[words.index(">") + 1]
        words = words[:words.index(">")]
    if "<" in words:
        monkeypatch.setattr(sys, "stdin", io.StringIO((work / words[words.index("<") + 1]).read_text()))
        words = words[:words.index("<")]
    assert words[0] == "kvpolicy"
    code = main(words[1:])
    out, err = capsys.readouterr()
    if target is not None:
        target.write_text(out)
    if pipe is not None:
        assert pipe[0] == "jq" and pipe[1].startswith(".")
        code = code if pipe[1][1:] in json.loads(out) else 1
    return code, out, err


@pytest.mark.parametrize(("verb", "example"), EXAMPLES, ids=[f"{v}: {e[:70]}" for v, e in EXAMPLES])
def test_a_help_example_runs(here: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str], verb: str, example: str) -> None:
    """Exit 0, or 1 where 1 is the verb's finding (lint's errors, diff's changed decisions, compat's blocks that
    cannot move): never a usage error (2) or a traceback."""
    work = tmp_path / "w"
    shutil.copytree(here, work)  # an example may write (fmt --write, > file): each its own copy
    for name in list(os.environ):
        if name.startswith(("KVPOLICY_", "VLLM_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))  # --connector-module-path my_connectors
    code, out, err = run_example(example, work, monkeypatch, capsys)
    assert code in (0, 1), f"`{example}` ({verb} --help) exits {code}:\n{out[-3000:]}\n{err[-3000:]}"
    if code == 1:
        assert verb in ("lint", "diff", "compat", "kvpolicy") and any(
            w in example for w in ("lint", "diff", "compat")), f"`{example}` exits 1:\n{out[-2000:]}\n{err[-2000:]}"


def test_the_rules_flags_are_not_listed_under_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dry-run", "--help"]) == 0
    text = capsys.readouterr().out
    rules = text.index("\nthe rules (default: the release profile's shipped rules):\n")
    assert rules < text.index("  --rules DIR") < text.index("  --no-shipped-rules") < text.index("\noutput:\n")
