"""``dry-run --format json`` carries what the text output says (issue 32): every ``note:`` line stderr
printed is in ``notes`` (then the explanation's own notes), every other line it printed in ``warnings``, for
the same inputs in both formats; ``vllm_version`` is the release asked, ``profile_vllm_version`` the one the
profile reproduces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "e2e" / "tiny-llama")
QWEN = str(ROOT / "tests" / "fixtures" / "model_configs" / "qwen2.5-0.5b-instruct")
LLAMA = str(ROOT / "tests" / "fixtures" / "model_configs" / "llama-3.1-8b-instruct" / "config.json")
VARIABLES = ("VLLM_KV_CACHE_LAYOUT", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_MLA_DISABLE", "VLLM_BATCH_INVARIANT",
             "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "VLLM_USE_SIMPLE_KV_OFFLOAD", "VLLM_TARGET_DEVICE",
             "VLLM_ATTENTION_BACKEND", "KVPOLICY_VLLM_VERSION")

# (environment, argv): each says something on stderr
CASES = [
    ({"VLLM_KV_CACHE_LAYOUT": "HND"}, ["--vllm-version", "0.30.1", "--", QWEN, "--port", "8000",
                                       "--max-model-len", "4096"]),
    ({"VLLM_ATTENTION_BACKEND": "FLASHINFER"}, ["--vllm-version", "0.34.0", "--", "vllm", "serve", TINY, "-tp", "2"]),
    ({}, ["--vllm-version", "0.34.0", "--block-size", "32", "--", TINY, "--block-size", "16", "--config=x.yaml"]),
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, ["--vllm-version", "0.30.0", "--model", QWEN]),
    ({"VLLM_BATCH_INVARIANT": "1"}, ["--vllm-version", "0.28.0", "--model", LLAMA]),
    ({}, ["--vllm-version", "0.34.0", "--device", "cpu", "--model", QWEN]),
    ({}, ["--vllm-version", "0.28.1", "--", TINY, "--kv-transfer-config.kv_connector", "NixlConnector",
          "--kv-transfer-config.kv_role", "kv_both", "--kv-transfer-config.kv_role", "kv_producer"]),
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _said(err: str) -> tuple[list[str], list[str]]:
    lines = [line for line in err.splitlines() if line.startswith(("note: ", "warning: "))]
    return ([line.removeprefix("note: ") for line in lines if line.startswith("note: ")],
            [line for line in lines if line.startswith("warning: ")])


@pytest.mark.parametrize("env, argv", CASES)
def test_json_carries_every_note_and_warning_the_text_says(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            env: dict[str, str], argv: list[str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, text_out, text_err = cli(capsys, "dry-run", *argv)
    assert code == 0, text_err
    code, json_out, json_err = cli(capsys, "dry-run", "--format", "json", *argv)
    assert code == 0, json_err
    data = json.loads(json_out)
    notes, warnings = _said(text_err)
    assert notes, "each case says something"
    assert _said(json_err) == (notes, warnings)  # the same lines on stderr in both formats
    assert data["notes"][:len(notes)] == notes  # ... and in the JSON
    assert all(w in data["warnings"] for w in warnings)
    flat = " ".join(text_out.split())
    assert all(" ".join(n.split()) in flat for n in data["notes"][len(notes):])  # the explanation's own


def test_a_patch_release_is_written_as_asked(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--format", "json", "--vllm-version", "0.30.1")
    data = json.loads(out)
    assert code == 0
    assert (data["vllm_version"], data["profile"], data["profile_vllm_version"]) == ("0.30.1", "vllm-0.30", "0.30.0")
    assert any(n.startswith("--vllm-version 0.30.1: ") for n in data["notes"])
    for asked, version in (("0.34.0", "0.34.0"), ("vllm-0.34", "0.34.0"), ("0.34", "0.34.0"), ("0.25.1", "0.25.1")):
        code, out, _ = cli(capsys, "dry-run", "--format", "json", "--vllm-version", asked)
        data = json.loads(out)
        reproduces = "0.25.0" if asked == "0.25.1" else "0.34.0"
        assert (data["vllm_version"], data["profile_vllm_version"]) == (version, reproduces)


LAPSED = """\
version: 1
rules:
  - id: site-no-cross
    description: the site keeps each layer's pages together
    forbid: {placement: cross_layer}
waivers:
  - rule: site-no-cross
    owner: kv-team
    reason: a lapsed exception
    expires: 2020-01-31
"""
FLEET = str(ROOT / "docs" / "examples" / "fleet.yaml")


@pytest.mark.parametrize(("argv", "key"), [
    (["lint", "{w}", "--vllm-version", "0.34"], "rule_warnings"),
    (["diff", "rules/vllm-0.34", "{w}", "--vllm-version", "0.34"], "warnings"),
    (["dry-run", "--fleet", FLEET, "--rules", "{w}"], "warnings"),
    (["lint", "--fleet", FLEET, "--rules", "{w}"], "rule_warnings"),
    (["diff", "rules/vllm-0.34", "{w}", "--fleet", FLEET], "warnings"),
    (["test", "--rules", "{w}", "{w}/tests/cases.yaml"], "warnings"),  # cases that do not load: the error document
])
def test_the_rule_sets_warnings_the_text_prints_are_in_the_json(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                                key: str) -> None:
    """An expired waiver is a `warning[expired-waiver]` line on stderr in every format: a program reading the
    JSON must see it too (the rule it waived applies again)."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "global.yaml").write_text(LAPSED)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "cases.yaml").write_text("version: 1\ncases: [{name: x, input: 3}]\n")
    argv = [a.replace("{w}", str(tmp_path)) for a in argv]
    _, _, err = cli(capsys, *argv)
    assert "warning[expired-waiver]" in err
    assert argv[0] != "test" or err.count("warning[expired-waiver]") == 1  # said once, though the cases fail
    _, out, _ = cli(capsys, *argv, "--format", "json")
    said = json.loads(out)[key]
    assert any(d["code"] == "expired-waiver" and d["line"] == 7 for d in said), said


@pytest.mark.parametrize("argv", [
    ["0.34", "0.34", "--device", "cpu"],
    [f"{FLEET}#llama-8b-nixl-pd", f"{FLEET}#llama-8b-nixl-pd-decode"],
    ["--table", "--kv-cache-dtype", "int4_per_token_head"],
])
def test_compat_json_carries_every_note_the_text_says(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """The host CPU assumed for a CPU_ATTN side, the connector compared through, a release refusing a `--table`
    row: said on stderr as `note:` lines, and in the JSON's `notes`."""
    _, _, err = cli(capsys, "compat", *argv)
    notes = [line.removeprefix("note: ") for line in err.splitlines() if line.startswith("note: ")]
    assert notes
    _, out, _ = cli(capsys, "compat", *argv, "--format", "json")
    assert json.loads(out)["notes"] == notes
