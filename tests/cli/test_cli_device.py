"""``kvpolicy dry-run --device``: the backend vLLM's platform selects, and what was assumed, said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.policy.cpu_kernel import CpuHost

V034 = ("--vllm-version", "0.34.0")  # the CLI tests' default profile is another
SPEC = "num_layers: 2\nnum_kv_heads: 2\nhead_size: 64\n"


@pytest.fixture
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return str(path)


def test_cpu_selects_cpu_attn_and_says_so(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, out, err = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "cpu")
    assert code == 0, err
    assert out.startswith("layout: LBHNC")  # CPUAttentionBackend.supported_kv_cache_layouts() = (LBHNC,)
    assert "backend:   CPU_ATTN" in out
    assert "note: deciding for vLLM's CPU platform (--device cpu): backend CPU_ATTN" in err


def test_cuda_default_is_said(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, out, err = cli(capsys, "dry-run", *V034, "--spec", spec)
    assert code == 0, err
    assert "backend:   FLASH_ATTN" in out
    assert "CUDA platform (SM90 (H100/H200) assumed): backend FLASH_ATTN" in err
    assert "pass --device cpu" in err


def test_json_names_the_device(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, out, _ = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "cpu", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["layout"]["name"] == "LBHNC"
    assert data["device"] == {"device": "cpu", "capability": None, "assumed_capability": None,
                              "assumed_from": None, "given": True, "backend": "CPU_ATTN",
                              "backend_from": "platform default", "cpu": CpuHost.this_host().label,
                              "cpu_from": "this machine"}  # the host orders CPU_ATTN's bytes: said which
    code, out, _ = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "cpu", "--cpu", "x86", "--format", "json")
    assert {k: json.loads(out)["device"][k] for k in ("cpu", "cpu_from")} == {"cpu": "x86", "cpu_from": "--cpu"}
    code, out, _ = cli(capsys, "dry-run", *V034, "--spec", spec, "--format", "json")
    device = json.loads(out)["device"]
    assert (device["device"], device["assumed_capability"], device["backend"]) == ("cuda", 9, "FLASH_ATTN")


def test_vllm_target_device_is_read_and_said(capsys: pytest.CaptureFixture[str], spec: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    code, out, err = cli(capsys, "dry-run", *V034, "--spec", spec, "--format", "json")
    assert code == 0
    assert json.loads(out)["device"]["assumed_from"].startswith("VLLM_TARGET_DEVICE=cpu")
    assert "note: deciding for vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu" in err
    code, out, _ = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "cuda")  # the flag wins
    assert code == 0 and "backend:   FLASH_ATTN" in out


def test_capability_with_cpu_is_a_located_usage_error(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, out, err = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "cpu", "--device-capability", "9.0")
    assert code == 2 and out == ""
    assert err.startswith("--device-capability: error[usage]: a CUDA compute capability, but the device is cpu")


def test_a_backend_the_cpu_platform_replaces_is_refused(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, _, err = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "cpu", "--attention-backend", "FLASH_ATTN")
    assert code == 2
    assert "--attention-backend: error[backend-not-on-device]" in err and "selects CPU_ATTN" in err
    code, out, err = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "cpu", "--attention-backend", "CPU_ATTN",
                         "--cpu", "x86")
    assert code == 0 and "backend:   CPU_ATTN" in out and "note:" not in err  # nothing assumed: nothing said


def test_unknown_device(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, _, err = cli(capsys, "dry-run", *V034, "--spec", spec, "--device", "gpu")
    assert code == 2 and "`gpu` is not one of vLLM's platforms kvpolicy knows: cuda, cpu" in err


def test_mla_on_cpu_is_refused_naming_what_vllm_selects(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        spec: str) -> None:
    mla = tmp_path / "mla.yaml"
    mla.write_text("kind: mla\nnum_layers: 2\nnum_kv_heads: 1\nhead_size: 576\n")
    code, _, err = cli(capsys, "dry-run", *V034, "--spec", str(mla), "--device", "cpu")
    assert code == 2
    assert "error[unmodelled-backend]" in err and "AMX_MLA on an x86 host with AMX tiles, else CPU_MLA" in err


def test_example_on_cpu(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, out, err = cli(capsys, "dry-run", *V034, "--device", "cpu")
    assert code == 0, err
    assert "on vLLM's CPU platform: CPU_ATTN, kv_cache_dtype auto" in err or "CPU_ATTN, kv_cache_dtype auto" in out
    assert "backend:   CPU_ATTN" in out


def test_the_example_says_it_stays_on_cuda_when_vllm_target_device_says_cpu(
        capsys: pytest.CaptureFixture[str], spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in example is a CUDA deployment (TRITON_ATTN, #48412); VLLM_TARGET_DEVICE=cpu is not
    followed there, and that is said rather than ignored."""
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    code, out, err = cli(capsys, "dry-run", *V034)
    assert code == 0, err
    assert "backend:   TRITON_ATTN" in out
    assert ("note: VLLM_TARGET_DEVICE=cpu, which vLLM reads to choose its platform, but the built-in example is a "
            "CUDA deployment and is decided as one; pass --device cpu") in err
    code, out, err = cli(capsys, "dry-run", *V034, "--device", "cpu")  # said: no such note
    assert code == 0 and "backend:   CPU_ATTN" in out and "is decided as one" not in err


def test_the_help_example_with_a_capability_keeps_its_line_break(capsys: pytest.CaptureFixture[str]) -> None:
    """A shell continuation in the epilog is printed as one, not joined into one line."""
    code, out, _ = cli(capsys, "dry-run", "--help")
    assert code == 0
    assert "--device-capability 10.0 \\\n      --worker-attention-backends FLASHINFER" in out
