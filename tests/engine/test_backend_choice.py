"""The backend vLLM's selector takes and the groups it caches, as a deployment decides them.

Each behaviour here is held to the release's own code by a conformance test: the backends' model
dtypes and kernel block sizes by ``tests/conformance/test_backend_support.py`` (every profiled
release), the groups with the hybrid KV cache manager turned off by ``test_hma_groups.py``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from kvpolicy.engine.cli.main import main
from kvpolicy.engine.inputs import build_context
from kvpolicy.policy import InputError
from kvpolicy.policy.spec import AttentionKind

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
GEMMA2 = CONFIGS / "gemma-2-2b-it"
GEMMA3 = CONFIGS / "gemma-3-1b-it"
GPT_OSS = CONFIGS / "gpt-oss-20b"
LLAMA4 = CONFIGS / "llama-4-scout-17b-16e-instruct"
JAMBA = CONFIGS / "jamba-v0.1"
SPEC = {"num_layers": 4, "num_kv_heads": 2, "head_size": 64}
MLA = {"kind": "mla", "num_layers": 4, "num_kv_heads": 1, "head_size": 576}
LMCACHE = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def _context(**kw: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = build_context(**kw)
    return ctx, [str(w.message) for w in caught]


def _refusal(**kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InputError) as info:
            build_context(**kw)
    return info.value.diagnostics[0]


def _kinds(ctx: Any) -> list[tuple[str, int]]:
    return sorted((g.spec.kind.value, g.spec.num_layers) for g in ctx.groups.groups)


# --- 1. the model dtype ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.34.0", "0.28.0", "0.24.0"])
def test_float32_skips_the_backends_without_it(version: str) -> None:
    """FLASH_ATTN and FLASHINFER run fp16/bf16 only: vLLM's selector passes over them to TRITON_ATTN."""
    ctx, _ = _context(model=GEMMA2, dtype="float32", vllm_version=version)
    assert ctx.kv.dtype.value == "float32" and ctx.backend.name == "TRITON_ATTN"
    assert _context(model=GEMMA2, vllm_version=version)[0].backend.name == "FLASH_ATTN"  # auto: bfloat16


def test_a_configured_backend_without_the_dtype_is_refused() -> None:
    d = _refusal(model=GEMMA2, dtype="float32", attention_backend="FLASH_ATTN", vllm_version="0.34.0")
    assert d.file == "attention_backend" and d.code == "unsupported-dtype"
    assert "FLASH_ATTN on vLLM 0.34.0 does not run model dtype `float32`" in d.message
    assert "Reason: ['dtype not supported']" in d.message and "TRITON_ATTN" in d.help


def test_an_mla_model_in_float32_has_no_backend() -> None:
    d = _refusal(spec={**MLA, "dtype": "float32"}, vllm_version="0.34.0")
    assert d.code == "no-valid-backend" and "No valid attention backend found" in d.message


# --- 2. the block size ---------------------------------------------------------------------------------


def test_a_block_size_the_configured_backend_refuses_is_refused() -> None:
    d = _refusal(spec=SPEC, block_size=24, attention_backend="TRITON_ATTN", vllm_version="0.34.0")
    assert d.file == "block_size" and d.code == "unsupported-block-size"
    assert d.message.startswith("--block-size 24: TRITON_ATTN on vLLM 0.34.0 takes block sizes that are multiples "
                                "of 16")
    assert _context(spec=SPEC, block_size=48, attention_backend="TRITON_ATTN", vllm_version="0.34.0")[0]


def test_no_backend_takes_a_block_size_every_one_refuses() -> None:
    d = _refusal(spec=SPEC, block_size=24, vllm_version="0.34.0")
    assert d.file == "block_size" and d.code == "no-valid-backend" and "multiples of 16" in d.help


def test_a_block_size_passes_over_a_backend_and_says_so() -> None:
    """FlashMLA's kernel takes multiples of 64: with --block-size 32, vLLM selects TRITON_MLA and logs why."""
    ctx, notes = _context(spec=MLA, block_size=32, vllm_version="0.34.0")
    assert ctx.backend.name == "TRITON_MLA"
    assert any("block-size-precluded-backend" in n and "FLASHMLA" in n for n in notes)
    assert _context(spec=MLA, block_size=64, vllm_version="0.34.0")[0].backend.name == "FLASHMLA"
    # without --block-size vLLM checks none: the spec's own block size is the geometry vLLM built
    assert _context(spec={**MLA, "block_size": 16}, vllm_version="0.34.0")[0].backend.name == "FLASHMLA"


def test_the_cpu_platform_does_not_validate_its_backend() -> None:
    ctx, _ = _context(spec=SPEC, block_size=16, device="cpu", vllm_version="0.34.0")
    assert ctx.backend.name == "CPU_ATTN"


# --- 3. the hybrid KV cache manager ----------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.34.0", "0.28.0"])
def test_a_connector_without_hma_caches_sliding_layers_as_full(version: str) -> None:
    ctx, notes = _context(model=GEMMA3, kv_transfer_config=LMCACHE, vllm_version=version)
    assert _kinds(ctx) == [("full", 26)] and ctx.groups.count == 1
    note = next(n for n in notes if "hybrid-manager-off" in n)
    assert "`LMCacheConnectorV1` does not support it" in note and "one group of 26 layers" in note
    kept, notes = _context(model=GEMMA3, kv_transfer_config={**LMCACHE, "kv_connector": "NixlConnector"},
                           vllm_version=version)
    assert {k for k, _ in _kinds(kept)} == {"full", "sliding_window"}
    assert not any("hybrid-manager-off" in n for n in notes)


def test_a_multiconnector_needs_every_member_to_support_hma() -> None:
    def multi(*names: str) -> dict[str, Any]:
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "connectors": [{"kv_connector": n, "kv_role": "kv_both"} for n in names]}}

    assert _context(model=GPT_OSS, kv_transfer_config=multi("NixlConnector", "LMCacheConnectorV1"),
                    vllm_version="0.34.0")[0].groups.count == 1
    assert _context(model=GPT_OSS, kv_transfer_config=multi("NixlConnector", "OffloadingConnector"),
                    vllm_version="0.34.0")[0].groups.count == 2


def test_a_mamba_hybrid_without_hma_does_not_start() -> None:
    d = _refusal(model=JAMBA, kv_transfer_config=LMCACHE, vllm_version="0.34.0")
    assert d.code == "needs-hybrid-manager" and "Mamba" in d.message


def test_chunked_local_attention_follows_the_variable() -> None:
    ctx, _ = _context(model=LLAMA4, vllm_version="0.34.0")
    assert AttentionKind.chunked_local in {g.spec.kind for g in ctx.groups.groups}
    ctx, notes = _context(model=LLAMA4, vllm_version="0.34.0", allow_chunked_local_attn_with_hybrid_kv_cache=False)
    assert _kinds(ctx) == [("full", 48)]
    assert any("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0" in n for n in notes)


def _dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any] | None, str]:
    code = main(["dry-run", "--format", "json", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_dry_run_reads_the_variable_and_its_flag_wins(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "0")
    code, out, err = _dry_run(capsys, "--vllm-version", "0.34.0", "--model", str(LLAMA4))
    assert code == 0 and [g["spec"]["kind"] for g in out["inputs"]["groups"]["groups"]] == ["full"]
    assert "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0 read from the environment" in err
    assert "warning[hybrid-manager-off]" in err
    code, out, err = _dry_run(capsys, "--vllm-version", "0.34.0", "--model", str(LLAMA4),
                              "--allow-chunked-local-attn-with-hybrid-kv-cache", "1")
    assert code == 0 and len(out["inputs"]["groups"]["groups"]) == 2 and "wins" in err


def test_dry_run_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry_run(capsys, "--vllm-version", "0.34.0", "--block-size", "24")  # the example: TRITON_ATTN
    assert code == 2 and err.startswith("--block-size: error[unsupported-block-size]: --block-size 24: TRITON_ATTN "
                                        "on vLLM 0.34.0 takes block sizes that are multiples of 16")
    code, _, err = _dry_run(capsys, "--vllm-version", "0.34.0", "--model", str(GEMMA2), "--dtype", "float32",
                            "--attention-backend", "FLASH_ATTN")
    assert code == 2 and "--attention-backend: error[unsupported-dtype]" in err and "`float32`" in err
    code, out, _ = _dry_run(capsys, "--vllm-version", "0.34.0", "--model", str(GEMMA2), "--dtype", "float32")
    assert code == 0 and out["inputs"]["backend"]["name"] == "TRITON_ATTN"
