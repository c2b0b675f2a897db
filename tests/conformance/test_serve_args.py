"""A `vllm serve` line as kvpolicy reads it is what vLLM 0.28.0 and 0.34.0 derive from it, by their own parser.

``oracles/engine_args.py`` runs each line through the release's ``FlexibleArgumentParser`` and
``AsyncEngineArgs.from_cli_args``; kvpolicy reads it with `kvpolicy.engine.vllm_args.parse_serve_args`
over its committed facts (``engine/vllm_serve_args``) and `build_context`. Per line: both refuse it for the
same reason (located at the option vLLM's error names), or both derive the same model, dtype, block
size, kv_cache_dtype, tensor-parallel size, KV transfer config and attention backend. Also checked
against each release: the committed engine-argument facts, which variables its ``vllm.envs`` reads
(`kvpolicy.engine.vllm_env.DECISION_VARIABLES`) and the values its ``VLLM_KV_CACHE_LAYOUT`` getter
accepts.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from vllm_release import run_oracle

from kvpolicy.engine.inputs import build_context
from kvpolicy.engine.vllm_args import parse_serve_args
from kvpolicy.engine.vllm_env import DECISION_VARIABLES, reads
from kvpolicy.engine.vllm_serve_facts import serve_actions
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile

VERSIONS = ("0.28.0", "0.34.0")
MODEL = str(Path(__file__).resolve().parents[1] / "e2e" / "tiny-llama")
NIXL = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
YAML = "tensor-parallel-size: 2\nblock_size: 32\nkv-cache-dtype: fp8\nenforce-eager: true\n"
YAML_KTC = ("kv-transfer-config:\n  kv_connector: OffloadingConnector\n  kv_role: kv_both\n"
            "  kv_connector_extra_config: {block_size: 64}\ndtype: float16\n")

# (note, argv, files, what kvpolicy does beyond vLLM's parser: None, or "unmodelled" / "refused later")
CORPUS: list[tuple[str, list[str], dict[str, str], str | None]] = [
    ("model only", [MODEL], {}, None),
    ("dtype", [MODEL, "--dtype", "float16"], {}, None),
    ("dtype with =", [MODEL, "--dtype=half"], {}, None),
    ("dtype float", [MODEL, "--dtype", "float"], {}, None),
    ("dtype vLLM does not take", [MODEL, "--dtype", "bf16"], {}, None),
    ("block size", [MODEL, "--block-size", "32"], {}, None),
    ("underscores", [MODEL, "--block_size", "32"], {}, None),
    ("underscores with =", [MODEL, "--block_size=64"], {}, None),
    ("block size not an int", [MODEL, "--block-size", "abc"], {}, None),
    ("-tp", [MODEL, "-tp", "4"], {}, None),
    ("tp with =", [MODEL, "--tensor-parallel-size=2"], {}, None),
    ("tp underscores", [MODEL, "--tensor_parallel_size", "4"], {}, None),
    ("repeated: the last wins", [MODEL, "-tp", "2", "-tp", "4"], {}, None),
    ("abbreviated flag", [MODEL, "--tensor-parallel", "2"], {}, None),
    ("kv cache dtype", [MODEL, "--kv-cache-dtype", "fp8"], {}, None),
    ("kv cache dtype underscores =", [MODEL, "--kv_cache_dtype=fp8_e4m3"], {}, None),
    ("kv cache dtype repeated", [MODEL, "--kv-cache-dtype", "fp8", "--kv-cache-dtype", "auto"], {}, None),
    ("kv transfer config JSON", [MODEL, "--kv-transfer-config", NIXL], {}, None),
    ("kv transfer config dotted", [MODEL, "--kv-transfer-config.kv_connector", "OffloadingConnector",
                                   "--kv-transfer-config.kv_role", "kv_both"], {}, None),
    ("kv transfer config dotted with = and extra", [
        MODEL, "--kv_transfer_config.kv_connector=NixlConnector", "--kv-transfer-config.kv_role=kv_producer",
        "--kv-transfer-config.kv_connector_extra_config.enable_cross_layers_blocks", "true"], {}, None),
    ("kv transfer config bad role", [MODEL, "--kv-transfer-config",
                                     '{"kv_connector": "NixlConnector", "kv_role": "bogus"}'], {}, None),
    ("kv transfer config not JSON", [MODEL, "--kv-transfer-config", "{nixl}"], {}, None),
    ("attention backend", [MODEL, "--attention-backend", "FLASHINFER"], {}, None),
    ("attention config JSON", [MODEL, "--attention-config", '{"backend": "TRITON_ATTN"}'], {}, None),
    ("attention config dotted", [MODEL, "--attention-config.backend", "FLASH_ATTN"], {}, None),
    ("attention config -ac", [MODEL, "-ac", '{"backend": "FLASH_ATTN"}'], {}, None),
    ("backend twice", [MODEL, "--attention-backend", "FLASH_ATTN", "--attention-config.backend", "TRITON_ATTN"],
     {}, "refused later"),
    ("--model moved", ["--model", MODEL, "-tp", "2"], {}, None),
    ("--model= moved", [f"--model={MODEL}", "--dtype", "float32"], {}, None),
    ("--config YAML", [MODEL, "--config", "{dir}/serve.yaml"], {"serve.yaml": YAML}, None),
    ("--config then flags override it", [MODEL, "--config", "{dir}/serve.yaml", "-tp", "4", "--block-size", "16"],
     {"serve.yaml": YAML}, None),
    ("model in --config", ["--config", "{dir}/serve.yaml"], {"serve.yaml": f"model: {MODEL}\n" + YAML}, None),
    ("--config nested JSON", [MODEL, "--config", "{dir}/serve.yaml"], {"serve.yaml": YAML_KTC}, None),
    ("--config not YAML", [MODEL, "--config", "{dir}/serve.json"], {"serve.json": "{}"}, None),
    ("unknown flag", [MODEL, "--frobnicate", "1"], {}, None),
    ("unknown flag, underscores", [MODEL, "--kv_cache_dtypes", "fp8"], {}, None),
    ("ignored arguments", [MODEL, "--enforce-eager", "--max-model-len", "4096", "--gpu-memory-utilization", "0.9",
                           "--served-model-name", "llama", "--trust-remote-code", "--seed", "0"], {}, None),
    ("-O3 and a human-readable int", [MODEL, "-O3", "--max-model-len=8k"], {}, None),
    ("negated flags", [MODEL, "--no-enforce-eager", "--disable-log-stats"], {}, None),
    ("served model name without a model", ["--served-model-name", "x", "--dtype", "auto"], {}, None),
    ("-O with a separate level", [MODEL, "-O", "2", "--block-size", "16"], {}, None),
    ("--no- spelling of a bool", [MODEL, "--no-enable-prefix-caching", "--enable-chunked-prefill"], {}, None),
    ("extensible KV cache", [MODEL, "--enable-extensible-kv-cache"], {}, None),
    ("pipeline parallel", [MODEL, "-pp", "2"], {}, "unmodelled"),
    ("Transformers model implementation", [MODEL, "--model-impl", "transformers"], {}, "unmodelled"),
    ("vLLM's own model implementation", [MODEL, "--model-impl", "vllm"], {}, None),
    ("an ignored int that is not one", [MODEL, "--max-num-seqs", "abc"], {}, None),
    ("an ignored optional int left unset", [MODEL, "--max-num-seqs", "None"], {}, None),
    ("an ignored float that is not one", [MODEL, "--gpu-memory-utilization", "high"], {}, None),
    ("an ignored human-readable int that is not one", [MODEL, "--max-model-len", "8x"], {}, None),
    ("a decimal with a binary suffix", [MODEL, "--max-model-len", "1.5K"], {}, None),
    ("an ignored int with =", [MODEL, "--seed=abc"], {}, None),
    ("data parallel", [MODEL, "--data-parallel-size", "2", "-tp", "2"], {}, None),
]


LAYOUT_CANDIDATES = [x.value for x in Layout] + ["NHD", "HND", "nhd", "", "per_layer"]


def _oracle_cases() -> list[dict[str, Any]]:
    return [{"argv": argv, "files": files} for _, argv, files, _ in CORPUS]


@functools.cache
def _answers(version: str) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(the corpus's answers, the parser's facts, the environment's) from one run of the oracle (one
    import of vLLM, about 40 s; kept per machine while the release, the oracle and the cases hold)."""
    cases = [*_oracle_cases(), {"facts": True}, {"envs": True, "layout_candidates": LAYOUT_CANDIDATES}]
    answers = run_oracle(version, "engine_args", cases)
    return answers[:-2], answers[-2], answers[-1]


def _kvpolicy(argv: list[str], files: dict[str, str], version: str, tmp: Path) -> dict[str, Any]:
    """kvpolicy's reading of the line, as the fields the oracle answers; or {"error": ...}."""
    for name, text in files.items():
        (tmp / name).write_text(text)
    argv = [a.replace("{dir}", str(tmp)) for a in argv]
    profile = get_profile(version)
    try:
        line = parse_serve_args(argv, profile.name, version)
        inputs = dict(line.inputs)
        if "model" in inputs:
            build_context(vllm_version=profile.name, **inputs)  # what vLLM's parser validates, kvpolicy checks here
    except InputError as exc:
        first = exc.diagnostics[0]
        return {"error": first.code, "where": first.file, "message": first.message}
    ktc = inputs.get("kv_transfer_config")
    return {
        "model": inputs.get("model"),
        "dtype": inputs.get("dtype", "auto"),
        "block_size": inputs.get("block_size"),
        "kv_cache_dtype": inputs.get("kv_cache_dtype", "auto"),
        "tensor_parallel_size": inputs.get("tensor_parallel_size", 1),
        "kv_transfer_config": None if ktc is None else {
            "kv_connector": ktc.get("kv_connector"), "kv_role": ktc.get("kv_role"),
            "kv_connector_extra_config": ktc.get("kv_connector_extra_config", {})},
        "attention_backend": inputs.get("attention_backend"),
        "enable_extensible_kv_cache": bool(inputs.get("enable_extensible_kv_cache")),
    }


def _vllm(answer: dict[str, Any]) -> dict[str, Any]:
    if "error" in answer:
        return answer
    backend = answer["attention_backend"] or answer["attention_config_backend"]
    return {
        "model": answer["model"],
        "dtype": answer["dtype"],
        "block_size": answer["block_size"],
        "kv_cache_dtype": answer["kv_cache_dtype"],
        "tensor_parallel_size": answer["tensor_parallel_size"],
        "kv_transfer_config": answer["kv_transfer_config"],
        "attention_backend": backend,
        "enable_extensible_kv_cache": bool(answer["enable_extensible_kv_cache"]),
    }


# vLLM's refusals that name no option -> where kvpolicy's refusal of the same line is located
_LOCATED = (("json_invalid", "vllm serve --kv-transfer-config"),
            ("Config file must be of a yaml/yml type", "vllm serve --config"),
            ("should be provided as the first positional argument", "vllm serve"))


def _same_reason(error: str, ours: dict[str, Any]) -> bool:
    """Whether kvpolicy refuses the line for vLLM's reason: located at the option vLLM's parser names
    (``argument --block-size: ...``, ``unrecognized arguments: --frobnicate``, the latter as an unknown
    argument) or at the field of its value vLLM's message names (``kv_transfer_config.kv_role``), else where
    `_LOCATED` pairs vLLM's message with."""
    named = re.search(r"unrecognized arguments: (--[\w-]+)|argument (--[\w-]+)", error)
    if named:
        flag = named.group(1) or named.group(2)
        field, *inner = ours["where"].split(".")  # a field of the option's value, named by vLLM's message too
        at = ours["where"] == f"vllm serve {flag}" or (
            field == flag.lstrip("-").replace("-", "_") and bool(inner) and inner[-1] in error)
        return at and (named.group(1) is None or ours["error"] == "unknown-serve-argument")
    return any(theirs in error and ours["where"] == where for theirs, where in _LOCATED)


@pytest.mark.parametrize("version", VERSIONS)
def test_serve_lines_derive_as_vllm(version: str, vllm_sites, tmp_path: Path) -> None:
    answers, _, _ = _answers(version)
    agreed = 0
    for (note, argv, files, beyond), answer in zip(CORPUS, answers, strict=True):
        work = tmp_path / str(agreed + 1000 * len(note))
        work.mkdir(exist_ok=True)
        ours, theirs = _kvpolicy(argv, files, version, work), _vllm(answer)
        if beyond == "unmodelled":  # vLLM takes it; kvpolicy cannot follow it and says so
            assert "error" not in theirs and ours.get("error") == "unmodelled-serve-argument", (note, ours, theirs)
        elif beyond == "refused later":  # vLLM's create_engine_config refuses what its parser took
            assert "error" not in theirs and "error" in ours, (note, ours, theirs)
        elif "error" in theirs:
            assert "error" in ours, (note, ours, theirs)
            assert _same_reason(theirs["error"], ours), (note, ours, theirs["error"][-300:])
        else:
            assert "error" not in ours, (note, ours, theirs)
            if ours["model"] is None:  # vLLM's default model: a hub id kvpolicy never reads
                theirs = {**theirs, "model": None}
            assert ours == theirs, (note, argv)
        agreed += 1
    assert agreed == len(CORPUS) >= 45


def _engine_part(facts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spellings: dict[int, list[str]] = {}
    for opt, i in facts["options"].items():
        spellings.setdefault(i, []).append(opt)
    out = {}
    for i, action in enumerate(facts["actions"]):
        if action["kind"] == "help":
            continue
        entry = {k: v for k, v in action.items() if v is not None and k != "options"}
        entry["options"] = sorted(spellings.get(i, []))
        out[entry["options"][0] if entry["options"] else entry["dest"]] = entry
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_engine_argument_facts_are_the_releases(version: str, vllm_sites) -> None:
    """Every engine argument of the release's serve parser is in kvpolicy's facts, spelled, shaped and
    valued the same (the facts also hold the frontend's arguments, read by serve_args_facts.py)."""
    _, facts, _ = _answers(version)
    ours = {a["dest"]: a for a in serve_actions(get_profile(version).name).values()}
    theirs = _engine_part(facts)
    assert len(theirs) > 200
    for entry in theirs.values():
        mine = dict(ours[entry["dest"]])
        mine["options"] = sorted(mine.get("options", []))
        assert mine == entry, entry["dest"]


@pytest.mark.parametrize("version", VERSIONS)
def test_environment_variables_are_the_releases(version: str, vllm_sites) -> None:
    _, _, answer = _answers(version)
    release = get_profile(version)
    for name in DECISION_VARIABLES:
        assert reads(release, name) == (name in answer["variables"]), name
    assert sorted(answer["kv_cache_layout_accepts"]) == sorted(release.kv_cache_layout_values())
    assert "VLLM_ATTENTION_BACKEND" not in answer["variables"]  # dry-run's note: vLLM does not read it


def test_corpus_spells_every_layout_argument() -> None:
    text = json.dumps([argv for _, argv, _, _ in CORPUS]) + YAML + YAML_KTC
    for flag in ("--dtype", "--block", "-tp", "--kv-cache-dtype", "--kv-transfer-config", "--attention-backend",
                 "--attention-config", "--model", "--config", "kv-transfer-config:"):
        assert flag in text, flag
