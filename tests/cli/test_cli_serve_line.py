"""``kvpolicy dry-run`` given the deployment in vLLM's terms: a `vllm serve` line after ``--``, ``--dtype``,
and the ``VLLM_*`` environment read as the release reads it (issue 21).

That vLLM derives the same from the line is `tests/conformance/test_serve_args.py`; that the flags the
line lands on decide as vLLM does is the decision conformance. Here: the line decides exactly what the
same flags typed one by one decide, and an exported variable what the flag it stands for decides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "e2e" / "tiny-llama")
DEEPSEEK = str(ROOT / "tests" / "fixtures" / "configs" / "deepseek-v2-lite.json")
KTC = ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
       '"kv_connector_extra_config": {"enable_cross_layers_blocks": "true"}}')
VARIABLES = ("VLLM_KV_CACHE_LAYOUT", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_MLA_DISABLE", "VLLM_BATCH_INVARIANT",
             "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "VLLM_USE_SIMPLE_KV_OFFLOAD", "VLLM_TARGET_DEVICE",
             "VLLM_ATTENTION_BACKEND")
# a real `vllm serve` line, as an operator runs it (frontend arguments and all)
SERVE_LINE = [TINY, "--host", "0.0.0.0", "--port", "8000", "--kv-transfer-config", KTC, "--kv-cache-dtype", "fp8",
              "--tensor-parallel-size", "2", "--block-size", "32", "--max-model-len", "8192",
              "--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--served-model-name", "tiny"]
FLAGS = ["--model", TINY, "--kv-transfer-config", KTC, "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2",
         "--block-size", "32"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict, str]:
    """The JSON document less `notes` and `warnings` (what the run said, which differs with how the
    deployment was given: test_cli_json_notes.py), and stderr."""
    code, out, err = cli(capsys, "dry-run", "--format", "json", *argv)
    assert code == 0, err
    data = json.loads(out)
    return {k: v for k, v in data.items() if k not in ("notes", "warnings")}, err


@pytest.mark.parametrize("version", ["0.28.0", "0.34.0"])
def test_a_serve_line_decides_what_the_same_flags_decide(capsys: pytest.CaptureFixture[str], version: str) -> None:
    typed, _ = _json(capsys, "--vllm-version", version, *FLAGS)
    given, err = _json(capsys, "--vllm-version", version, "--", *SERVE_LINE)
    assert given == typed
    assert given["inputs"]["kv"]["num_kv_heads"] == 1  # tiny-llama's 2 KV heads over 2 ranks
    assert "note: vllm serve: ignored, they do not bear on the KV cache layout: --enable-prefix-caching, " \
           "--gpu-memory-utilization, --host, --max-model-len, --port, --served-model-name" in err


def test_the_serve_line_as_text_names_its_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.28.0", "--", *SERVE_LINE)
    assert code == 0
    assert "block 32, 1 KV heads x 64" in out and "kv_cache_dtype fp8" in out and "connector: NixlConnector" in out


def test_a_config_yaml_with_flags_overriding_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {TINY}\nkv-cache-dtype: fp8\ntensor_parallel_size: 2\nblock-size: 16\n"
                      "kv-transfer-config:\n  kv_connector: NixlConnector\n  kv_role: kv_both\n"
                      "  kv_connector_extra_config: {enable_cross_layers_blocks: 'true'}\n")
    typed, _ = _json(capsys, "--vllm-version", "0.34.0", *FLAGS)
    given, _ = _json(capsys, "--vllm-version", "0.34.0", "--", "--config", str(config), "--block_size=32")
    assert given == typed


def test_a_kvpolicy_flag_wins_over_the_line_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    data, err = _json(capsys, "--vllm-version", "0.34.0", "--block-size", "64", "--", TINY, "--block-size", "32")
    assert data["inputs"]["kv"]["block_size"] == 64
    assert "note: --block-size 64 wins over the serve line's 32" in err


@pytest.mark.parametrize(("line", "where", "text"), [
    (["meta-llama/Llama-3.1-8B", "-tp", "2"], "vllm serve meta-llama/Llama-3.1-8B",
     "kvpolicy does not download models"),
    ([TINY, "--tensor-paralel-size", "2"], "vllm serve --tensor-paralel-size",
     "does not accept --tensor-paralel-size"),
    ([TINY, "--dtype", "bf16"], "vllm serve --dtype", "invalid choice: 'bf16'"),
    ([TINY, "-pp", "2"], "vllm serve --pipeline-parallel-size", "kvpolicy does not model"),
    # it changes the KV cache groups vLLM builds from the config: once ignored, silently
    ([TINY, "--hf-overrides", '{"num_hidden_layers": 2}'], "vllm serve --hf-overrides", "kvpolicy does not model"),
    # the Mamba state's bytes decide a hybrid model's attention block size (kvpolicy sizes it as auto does)
    ([TINY, "--mamba-ssm-cache-dtype", "float32"], "vllm serve --mamba-ssm-cache-dtype", "kvpolicy does not model"),
    ([TINY, "--mamba-block-size", "64"], "vllm serve --mamba-block-size", "kvpolicy does not model"),
    (["--served-model-name", "x"], "vllm serve", "without a positional model"),
    # arguments the decision ignores are still checked as the release's parser checks them (vLLM refuses these)
    ([TINY, "--max-num-seqs", "abc"], "vllm serve --max-num-seqs", "invalid int value: 'abc'"),
    ([TINY, "--gpu-memory-utilization=high"], "vllm serve --gpu-memory-utilization", "invalid float value"),
    ([TINY, "--max-model-len", "1.5K"], "vllm serve --max-model-len", "invalid human_readable_int value"),
    ([TINY, "--model-impl", "transformers"], "vllm serve --model-impl", "kvpolicy does not model"),
    ([TINY, "--config", "serve.json"], "vllm serve --config", "only as YAML"),
])
def test_a_line_kvpolicy_cannot_take_is_a_located_error(capsys: pytest.CaptureFixture[str], line: list[str],
                                                        where: str, text: str) -> None:
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--", *line)
    assert code == 2 and out == ""
    assert err.splitlines()[-2].startswith(f"{where}: error[") and text in err, err


def test_an_unknown_argument_gets_a_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--", TINY, "--tensor-paralel-size", "2")
    assert "did you mean `--tensor-parallel-size`?" in err


def test_a_spec_and_a_serve_line_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 2\nnum_kv_heads: 2\nhead_size: 64\n")
    code, _, err = cli(capsys, "dry-run", "--spec", str(spec), "--", TINY)
    assert code == 2 and "--spec: error[usage]: --spec and a serve line both describe the KV cache" in err


# --dtype


def test_dtype_sets_the_model_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = _json(capsys, "--vllm-version", "0.34.0", "--model", TINY, "--dtype", "float16")
    assert data["inputs"]["kv"]["dtype"] == "float16"
    half, _ = _json(capsys, "--vllm-version", "0.34.0", "--", TINY, "--dtype", "half")
    assert half == data


@pytest.mark.parametrize(("argv", "text"), [
    (["--model", TINY, "--dtype", "bf16"], "vLLM 0.34.0's --dtype takes: auto, bfloat16, float, float16, float32, "
                                           "half; not `bf16`"),
    (["--dtype", "float16"], "applies to a model (--model, or the model of a serve line after --)"),
])
def test_dtype_mistakes(capsys: pytest.CaptureFixture[str], argv: list[str], text: str) -> None:
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", *argv)
    assert code == 2 and f"--dtype: error[usage]: {text}" in err


# the environment


def test_an_exported_kv_cache_layout_decides_as_vllm(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in example: LBHNC (the OffloadingConnector's); vLLM 0.34 with VLLM_KV_CACHE_LAYOUT=LBNHC
    resolves LBNHC, what --vllm-kv-cache-layout LBNHC decides (held to vLLM by the decision conformance)."""
    plain, _ = _json(capsys, "--vllm-version", "0.34.0")
    assert plain["layout"]["name"] == "LBHNC"
    flagged, _ = _json(capsys, "--vllm-version", "0.34.0", "--vllm-kv-cache-layout", "LBNHC")
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    exported, err = _json(capsys, "--vllm-version", "0.34.0")
    assert exported["layout"]["name"] == "LBNHC" and exported["inputs"] == flagged["inputs"]
    assert "note: VLLM_KV_CACHE_LAYOUT=LBNHC read from the environment and used as vLLM 0.34.0 uses it" in err


def test_an_exported_head_order_decides_as_the_gate_releases(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """0.28: NIXL's cross-layer blocks need HND; VLLM_KV_CACHE_LAYOUT=NHD keeps the cache per layer."""
    argv = ("--vllm-version", "0.28.0", "--model", TINY, "--kv-transfer-config", KTC)
    plain, _ = _json(capsys, *argv)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    exported, err = _json(capsys, *argv)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    flagged, _ = _json(capsys, *argv, "--vllm-kv-cache-layout", "NHD")
    assert plain["layout"] != exported["layout"] == flagged["layout"]
    assert exported["layout"]["name"] == "LBNHC"
    assert "(the head order, over the connector's)" in err


def test_the_flag_wins_over_the_variable(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    data, err = _json(capsys, "--vllm-version", "0.34.0", "--vllm-kv-cache-layout", "LBHNC")
    assert data["layout"]["name"] == "LBHNC"
    assert "VLLM_KV_CACHE_LAYOUT=LBNHC is set, but --vllm-kv-cache-layout LBHNC wins" in err


def test_the_help_says_the_variable_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    """--help once said VLLM_KV_CACHE_LAYOUT was not read from the environment; it is (the epilog says so)."""
    code, out, _ = cli(capsys, "dry-run", "--help")
    assert code == 0
    assert "not read from the environment" not in out
    assert "Default: the variable as exported" in " ".join(out.split())


@pytest.mark.parametrize(("version", "value", "valid"), [
    ("0.34.0", "lbnhc", "LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC, NHD, HND"),
    ("0.28.0", "LBNHC", "NHD, HND"),  # the gate releases take the head order only
    ("0.34.0", "", "LBHNC"),
])
def test_a_bad_variable_is_located(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                   version: str, value: str, valid: str) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", value)
    code, _, err = cli(capsys, "dry-run", "--vllm-version", version)
    assert code == 2
    assert f"VLLM_KV_CACHE_LAYOUT: error[unknown-layout]: VLLM_KV_CACHE_LAYOUT={value!r} is not a value" in err
    assert f"help: valid: {valid}" in err


def test_v2_model_runner_variable(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ("--vllm-version", "0.28.0", "--model", TINY, "--kv-transfer-config", KTC)
    flagged, _ = _json(capsys, *argv, "--use-v2-model-runner")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    exported, err = _json(capsys, *argv)
    assert exported == flagged and "VLLM_USE_V2_MODEL_RUNNER=1 read from the environment" in err
    _, err = _json(capsys, "--vllm-version", "0.34.0", "--model", TINY)
    assert "VLLM_USE_V2_MODEL_RUNNER is set, but vLLM 0.34.0 does not read it; ignored" in err
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "yes")
    code, _, err = cli(capsys, "dry-run", *argv)
    assert code == 2 and "VLLM_USE_V2_MODEL_RUNNER: error[invalid-environment]" in err


def test_mla_disable_with_an_mla_model_is_refused(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", DEEPSEEK)
    assert code == 2 and "VLLM_MLA_DISABLE: error[invalid-environment]" in err
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", TINY)
    assert code == 0, err


@pytest.mark.parametrize(("name", "text"), [
    ("VLLM_BATCH_INVARIANT", "warning: VLLM_BATCH_INVARIANT=1"),
    ("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "=1 read from the environment"),
    ("VLLM_USE_SIMPLE_KV_OFFLOAD", "VLLM_USE_SIMPLE_KV_OFFLOAD is ignored"),
])
def test_variables_not_modelled_are_said(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                         name: str, text: str) -> None:
    monkeypatch.setenv(name, "1")
    _, err = _json(capsys, "--vllm-version", "0.34.0", "--model", TINY)
    assert text in err


@pytest.mark.parametrize("line", [
    [TINY, "--kv-transfer-config", "[" * 100_000],
    [TINY, "--kv-transfer-config." + ".".join(["a"] * 5000), "1"],
    [TINY, "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "x": ' + "9" * 5000 + "}"],
    [TINY, "--config", "/dev/null.yaml"],
    [TINY, "--config", "--config", "x.yaml"],
])
def test_hostile_lines_are_errors_not_tracebacks(capsys: pytest.CaptureFixture[str], line: list[str]) -> None:
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--", *line)
    assert code == 2 and out == "" and "Traceback" not in err and "error[" in err, err


@pytest.mark.parametrize("head", [["vllm", "serve"], ["serve"]])
def test_the_command_pasted_with_its_line_is_read_as_the_command(capsys: pytest.CaptureFixture[str],
                                                                 head: list[str]) -> None:
    plain, _ = _json(capsys, "--vllm-version", "0.34.0", "--", *SERVE_LINE)
    pasted, err = _json(capsys, "--vllm-version", "0.34.0", "--", *head, *SERVE_LINE)
    assert pasted == plain
    assert f"note: vllm serve: `{' '.join(head)}` at the start of the line is read as the command" in err


GEMMA3_1B = str(ROOT / "tests" / "fixtures" / "model_configs" / "gemma-3-1b-it")
JAMBA = str(ROOT / "tests" / "fixtures" / "model_configs" / "jamba-v0.1")
LMCACHE = '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'


def _kinds(data: dict) -> list[tuple[str, int]]:
    return [(g["spec"]["kind"], g["spec"]["num_layers"]) for g in data["inputs"]["groups"]["groups"]]


@pytest.mark.parametrize("version", ["0.28.0", "0.34.0"])
def test_disabling_the_hybrid_manager_caches_sliding_layers_as_full(capsys: pytest.CaptureFixture[str],
                                                                    version: str) -> None:
    """`--disable-hybrid-kv-cache-manager` on the line decides what the flag typed decides: Gemma-3-1B's 22
    sliding-window layers cached as full attention beside its 4 full ones, in one group (vLLM's answer,
    tests/conformance/test_hma_groups.py), said in a warning naming the argument."""
    plain, _ = _json(capsys, "--vllm-version", version, "--", GEMMA3_1B)
    given, err = _json(capsys, "--vllm-version", version, "--", GEMMA3_1B, "--disable-hybrid-kv-cache-manager")
    typed, _ = _json(capsys, "--vllm-version", version, "--model", GEMMA3_1B, "--disable-hybrid-kv-cache-manager")
    assert sorted(_kinds(plain)) == [("full", 4), ("sliding_window", 22)]
    assert _kinds(given) == [("full", 26)] and given == typed
    assert "--disable-hybrid-kv-cache-manager: warning[hybrid-manager-off]" in err
    assert "drop --disable-hybrid-kv-cache-manager to keep the groups" in err


def test_enabling_the_hybrid_manager_keeps_it_past_a_connector(capsys: pytest.CaptureFixture[str]) -> None:
    off, _ = _json(capsys, "--vllm-version", "0.34.0", "--", GEMMA3_1B, "--kv-transfer-config", LMCACHE)
    on, err = _json(capsys, "--vllm-version", "0.34.0", "--", GEMMA3_1B, "--kv-transfer-config", LMCACHE,
                    "--enable-hybrid-kv-cache-manager")
    assert _kinds(off) == [("full", 26)]
    assert sorted(_kinds(on)) == [("full", 4), ("sliding_window", 22)] and "hybrid-manager-off" not in err


def test_a_mamba_hybrid_with_the_manager_disabled_is_refused_at_the_argument(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--", JAMBA,
                         "--disable-hybrid-kv-cache-manager")
    assert code == 2 and out == ""
    assert "--disable-hybrid-kv-cache-manager: error[needs-hybrid-manager]" in err
    assert "Failed to promote local KV cache specs to one unified type" in err


@pytest.mark.parametrize("version", ["0.28.0", "0.34.0"])
def test_disabling_sliding_windows_makes_every_layer_full(capsys: pytest.CaptureFixture[str], version: str) -> None:
    """`--disable-sliding-window` (vLLM's ModelConfig clears the window: every layer full attention), on the line
    and typed; it was listed as ignored, under another spelling, and the groups kept their windows."""
    given, err = _json(capsys, "--vllm-version", version, "--", GEMMA3_1B, "--disable-sliding-window")
    typed, _ = _json(capsys, "--vllm-version", version, "--model", GEMMA3_1B, "--disable-sliding-window")
    assert _kinds(given) == [("full", 26)] and given == typed
    assert "ignored" not in err or "sliding-window" not in err
    code, _, err = cli(capsys, "dry-run", "--disable-sliding-window")  # the built-in example is a spec
    assert code == 2 and "--disable-sliding-window: error[" in err and "applies to `model` only" in err


def test_an_ignored_argument_is_named_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = _json(capsys, "--vllm-version", "0.34.0", "--", TINY, "--no-enable-prefix-caching", "--enforce-eager")
    assert "ignored, they do not bear on the KV cache layout: --enforce-eager, --no-enable-prefix-caching" in err


def test_vllm_flags_before_the_separator_point_to_it(capsys: pytest.CaptureFixture[str]) -> None:
    """`dry-run --model M -tp 4` (a vLLM flag among kvpolicy's): the error names the argument and says where
    serve arguments go, instead of the top-level usage line."""
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", TINY, "-tp", "2")
    assert code == 2 and out == ""
    assert err.startswith("-tp: error[usage]: unrecognized arguments: -tp") and "go after `--`" in err
    code, _, err = cli(capsys, "validate", "--bogus")
    assert code == 2 and "unrecognized arguments: --bogus" in err  # other verbs: argparse's own message
