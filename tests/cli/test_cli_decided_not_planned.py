"""``kvpolicy dry-run`` on a deployment kvpolicy decides as vLLM does but plans no cache for: the
decision is shown, then why there is no plan (exit 2), in text and in JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli


def _spec(tmp_path: Path, head: int) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(f"num_layers: 2\nnum_kv_heads: 2\nhead_size: {head}\n")
    return str(path)


@pytest.mark.parametrize(("version", "backend", "dtype", "head", "code"), [
    ("0.29.0", "FLASHINFER", "nvfp4", 64, "unplanned-kv-cache-dtype"),
    ("0.28.0", "TRITON_ATTN", "int4_per_token_head", 96, "release-fails-at-write"),
    ("0.25.0", "TRITON_ATTN", "int4_per_token_head", 96, "release-fails-at-write"),
])
def test_the_decision_is_shown_then_why_there_is_no_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         version: str, backend: str, dtype: str, head: int,
                                                         code: str) -> None:
    argv = ("dry-run", "--vllm-version", version, "--backend", backend, "--kv-cache-dtype", dtype,
            "--spec", _spec(tmp_path, head))
    status, out, err = cli(capsys, *argv)
    assert status == 2
    assert out.startswith("layout: ") and "layout fingerprint: sha256:" in out
    assert err.startswith(f"--kv-cache-dtype: error[{code}]")  # the flag the user typed
    status, out, err = cli(capsys, *argv, "--format", "json")
    data = json.loads(out)
    assert status == 2 and data["layout"]["name"] and data["allocation"] is None
    assert data["plan_error"]["diagnostics"][0]["code"] == code and f"error[{code}]" in err


def test_int4_at_a_power_of_two_head_or_from_032_is_planned(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    for version, head in (("0.28.0", 128), ("0.32.0", 96), ("0.34.0", 96)):
        status, out, err = cli(capsys, "dry-run", "--vllm-version", version, "--backend", "TRITON_ATTN",
                               "--kv-cache-dtype", "int4_per_token_head", "--spec", _spec(tmp_path, head),
                               "--format", "json")
        assert status == 0, err
        assert json.loads(out)["allocation"]["page_size_bytes"] > 0 and "plan_error" not in json.loads(out)


@pytest.mark.parametrize("num_blocks", [(), ("--num-blocks", "4")])
def test_the_plan_refusal_names_where_the_kv_cache_dtype_was_given(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path, num_blocks: tuple[str, ...]
                                                                   ) -> None:
    """The flag when typed, the --spec file when it holds the dtype: never a bare keyword, nor a flag the
    user did not type."""
    spec = _spec(tmp_path, 96)
    base = ("dry-run", "--vllm-version", "0.26.0", "--backend", "TRITON_ATTN", *num_blocks)
    status, _, err = cli(capsys, *base, "--kv-cache-dtype", "int4_per_token_head", "--spec", spec)
    assert status == 2 and err.startswith("--kv-cache-dtype: error[release-fails-at-write]")
    Path(spec).write_text("num_layers: 2\nnum_kv_heads: 2\nhead_size: 96\nkv_cache_dtype: int4_per_token_head\n")
    status, out, err = cli(capsys, *base, "--spec", spec, "--format", "json")
    assert status == 2 and err.startswith(f"{spec}: error[release-fails-at-write]")
    assert json.loads(out)["plan_error"]["diagnostics"][0]["file"] == spec
