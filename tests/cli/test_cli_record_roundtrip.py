"""`dry-run --record-test FILE` records the deployment it decided, and the command it prints checks the file.

The property: for any deployment dry-run decides (flags, the VLLM_* environment, an operator's layer),
the recorded case passes `kvpolicy test` run as the printed command says, in an environment without those
variables: the case holds every input of the decision (explicit false values and the platform included).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from cli_capture import cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
LAYER = ("version: 1\nrules:\n  - id: site-no-lhbnc\n    description: our transfer path cannot move LHBNC\n"
         "    forbid: {layout: LHBNC}\n")
ENV_KEYS = ("VLLM_TARGET_DEVICE", "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "VLLM_KV_CACHE_LAYOUT",
            "VLLM_USE_V2_MODEL_RUNNER", "KVPOLICY_RULES")


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set and every other variable of `ENV_KEYS` unset, for the block only."""
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def printed_command(err: str) -> list[str]:
    """The `kvpolicy test ...` command the recording note names, split as a shell splits it."""
    found = re.search(r"\(`(kvpolicy test [^`]*)` checks it\)", err)
    assert found, err
    return shlex.split(found.group(1))


def _flag(name: str, values: list[str | None]) -> st.SearchStrategy[list[str]]:
    return st.sampled_from(values).map(lambda v: [] if v is None else [name] if v == "" else [name, v])


@st.composite
def deployments(draw: st.DrawFn) -> tuple[list[str], dict[str, str]]:
    """dry-run's argv (without --record-test) and the VLLM_* environment of one deployment, mostly ones it
    decides (a flag a release or a KV cache source does not take is drawn only where it applies)."""
    version = draw(st.sampled_from(["0.26.0", "0.28.0", "0.29.0", "0.32.0", "0.34.0"]))
    source = draw(st.sampled_from([[], ["--spec", "spec.yaml"], ["--model", "llama.json"], ["--model", "gpt-oss.json"],
                                   ["--model", "deepseek.json"], ["--model", "qwen.json"]]))
    argv = ["dry-run", "--vllm-version", version, *source]
    argv += draw(_flag("--kv-cache-dtype", [None, "auto", "fp8", "fp8_per_token_head"]))
    connector = draw(_flag("--connector", [None, "none", "NixlConnector", "OffloadingConnector"]))
    argv += connector
    if connector[1:] not in ([], ["none"]):
        argv += draw(_flag("--connector-prefers-cross-layer-blocks", [None, "true", "false"]))
    argv += draw(st.sampled_from([[], ["--enable-hybrid-kv-cache-manager"], ["--disable-hybrid-kv-cache-manager"]]))
    argv += draw(_flag("--allow-chunked-local-attn-with-hybrid-kv-cache", [None, "0", "1"]))
    argv += draw(_flag("--device", [None, "cpu", "cuda"]))
    if version == "0.34.0":
        argv += draw(_flag("--enable-extensible-kv-cache", [None, ""]))
    else:
        argv += draw(_flag("--use-v2-model-runner", [None, ""]))
    if source[:1] == ["--model"]:
        argv += draw(_flag("--disable-sliding-window", [None, ""]))
    argv += draw(_flag("--vllm-kv-cache-layout", [None, "NHD", "HND"]))
    argv += draw(st.sampled_from([[], ["--rules", "site"], ["--rules", "my rules"],
                                  ["--rules", "my rules", "--no-shipped-rules"]]))
    env = draw(st.fixed_dictionaries({}, optional={
        "VLLM_TARGET_DEVICE": st.sampled_from(["cpu", "cuda"]),
        "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": st.sampled_from(["0", "1"]),
        "VLLM_KV_CACHE_LAYOUT": st.sampled_from(["NHD", "HND"]),
        "VLLM_USE_V2_MODEL_RUNNER": st.sampled_from(["0", "1"]),
    }))
    return argv, env


def _scratch() -> Path:
    root = Path(tempfile.mkdtemp(prefix="kvpolicy-record-"))
    (root / "spec.yaml").write_text("num_layers: 4\nnum_kv_heads: 2\nhead_size: 64\n")
    for name, src in (("llama.json", "llama-3.1-8b.json"), ("gpt-oss.json", "gpt-oss-20b.json"),
                      ("deepseek.json", "deepseek-v2-lite.json"), ("qwen.json", "qwen2.5-0.5b.json")):
        shutil.copy(CONFIGS / src, root / name)
    for layer in ("site", "my rules"):
        (root / layer).mkdir()
        (root / layer / "global.yaml").write_text(LAYER)
    return root


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dep=deployments())
def test_a_recorded_case_passes_the_printed_test_command(capsys: pytest.CaptureFixture[str],
                                                         dep: tuple[list[str], dict[str, str]]) -> None:
    argv, env = dep
    argv = [*argv, "--record-test", "tests/case.yaml", "--explain", "notes"]
    root = _scratch()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        with environment(env):
            code, _, err = cli(capsys, *argv)
        event(f"dry-run exit {code}")
        if code == 2 or not (root / "tests" / "case.yaml").exists():
            return  # refused as a usage or input error: nothing decided, nothing recorded
        assert code in (0, 1), err
        command = printed_command(err)
        assert command[:2] == ["kvpolicy", "test"]
        with environment({}):  # the case carries the environment's part: `kvpolicy test` must not read it
            tcode, out, terr = cli(capsys, *command[1:])
        case = yaml.safe_load((root / "tests" / "case.yaml").read_text())["cases"][0]
        assert tcode == 0, f"{argv} {env}\n{case}\n{out}\n{terr}"
    finally:
        os.chdir(cwd)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["--enable-hybrid-kv-cache-manager", "--connector", "NixlConnector"], {},
     {"disable_hybrid_kv_cache_manager": False}),
    (["--allow-chunked-local-attn-with-hybrid-kv-cache", "0"], {},
     {"allow_chunked_local_attn_with_hybrid_kv_cache": False}),
    ([], {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "0"},
     {"allow_chunked_local_attn_with_hybrid_kv_cache": False}),
    ([], {"VLLM_TARGET_DEVICE": "cpu"}, {"device": "cpu"}),
])
def test_explicit_false_values_and_the_platform_are_recorded(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        argv: list[str], env: dict[str, str], expected: dict) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copy(CONFIGS / "gpt-oss-20b.json", tmp_path / "model.json")
    with environment(env):
        code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", "model.json", *argv,
                           "--record-test", "c.yaml")
    assert code == 0, err
    (case,) = yaml.safe_load((tmp_path / "c.yaml").read_text())["cases"]
    assert expected.items() <= case["input"].items()
    with environment({}):
        assert cli(capsys, "test", "c.yaml")[0] == 0


def test_the_printed_command_runs_in_a_shell_and_names_the_rules(tmp_path: Path) -> None:
    root = _scratch()
    try:
        run = [sys.executable, "-m", "kvpolicy", "dry-run", "--vllm-version", "0.34.0", "--spec", "spec.yaml",
               "--rules", "my rules", "--no-shipped-rules", "--record-test", "out/case file.yaml"]
        done = subprocess.run(run, cwd=root, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
        assert done.returncode in (0, 1), done.stderr
        command = printed_command(done.stderr)
        assert "--rules" in command and "my rules" in command and "--no-shipped-rules" in command
        found = re.search(r"\(`(kvpolicy test [^`]*)` checks it\)", done.stderr)
        assert found is not None
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        checked = subprocess.run(found.group(1), shell=True, cwd=root, capture_output=True, text=True,
                                 env={**os.environ, "PATH": path})
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("text", [
    "version: 1\ncases: []\n",                                                      # flow style
    "version: 1\ncases:\n  - name: a\n    input: {spec: {num_layers: 2, num_kv_heads: 2, head_size: 64}}\n"
    "    expect: {layout: LBNHC}\nnotes: ours\n",                                   # `cases:` is not the last key
    "version: 1\ncases:\n  - name: a\n    input: {spec: {num_layers: 2, num_kv_heads: 2, head_size: 64}}\n"
    "    expect:\n      layout: LBNHC\n      matched:\n",                           # ends inside a case
])
def test_a_failed_append_leaves_the_file_as_it_was(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(text)
    before = (tmp_path / "c.yaml").stat()
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--record-test", "c.yaml")
    after = (tmp_path / "c.yaml").stat()
    assert code in (1, 2) and "error" in err
    assert (tmp_path / "c.yaml").read_text() == text
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not even rewritten
