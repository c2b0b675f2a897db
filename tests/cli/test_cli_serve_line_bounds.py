"""A `vllm serve` line is user input like any file: read bounded, and every mistake a located usage error
(issue 32). The ``--config`` YAML goes through the loader rule, case and fleet files go through; a number
too long for Python to convert, or a size vLLM's config refuses, is refused where it was typed."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_capture import cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "e2e" / "tiny-llama")

# 9 levels of 9 aliases: a few hundred bytes that expand to 9**9 strings when written out as JSON
BOMB = "".join(f"x-{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
BOMB = 'x-a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + BOMB + \
    "kv-transfer-config: {kv_connector: NixlConnector, kv_role: kv_both, x: *i}\n"


def _refused(capsys: pytest.CaptureFixture[str], *line: str) -> str:
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--", TINY, *line)
    assert code == 2, (code, out, err[-2000:])
    assert "Traceback" not in err and "error[" in err
    return err


def test_an_alias_bomb_in_config_is_refused_at_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert len(BOMB) < 600
    (tmp_path / "cfg.yaml").write_text(BOMB)
    err = _refused(capsys, "--config", str(tmp_path / "cfg.yaml"))  # by the node bound, before expanding it
    assert "cfg.yaml:" in err and "error[too-large]" in err and "nodes" in err


@pytest.mark.parametrize("value, tag", [("2024-01-01", "timestamp"), ("!!binary aGVsbG8=", "binary"),
                                        ("!!set {a, b}", "set"), ("!!python/tuple [1, 2]", "python")])
def test_a_config_value_that_is_no_plain_value_is_located(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          value: str, tag: str) -> None:
    (tmp_path / "cfg.yaml").write_text("block-size: 16\n"
                                       f"kv-transfer-config: {{kv_connector: NixlConnector, d: {value}}}\n")
    err = _refused(capsys, "--config", str(tmp_path / "cfg.yaml"))
    assert "cfg.yaml:2:" in err and tag in err


def test_a_config_integer_beyond_64_bits_is_located(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text("max-model-len: " + "1" * 5000 + "\n")
    err = _refused(capsys, "--config", str(tmp_path / "cfg.yaml"))
    assert "cfg.yaml:1:" in err and "64-bit" in err and "1" * 100 not in err


def test_a_plain_config_still_reads(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text("block-size: 32\nenable-prefix-caching: true\nport: 8000\n"
                                       "kv-transfer-config: {kv_connector: NixlConnector, kv_role: kv_both}\n")
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--", TINY, "--config",
                         str(tmp_path / "cfg.yaml"))
    assert code == 0, err
    assert "block 32" in out and "NixlConnector" in out


@pytest.mark.parametrize("line", [
    ["--compilation-config.level", "1" * 5000],
    ["--compilation-config.level", "1" * 5000 + "k"],
    ["--compilation-config.level", "1" * 5000 + "K"],
    ["--compilation-config.x", '{"a": ' + "1" * 5000 + "}"],
    ["--kv-transfer-config.kv_buffer_size", "9" * 4400],
    ["--max-model-len", "1" * 5000],
])
def test_a_number_too_long_to_convert_is_located(capsys: pytest.CaptureFixture[str], line: list[str]) -> None:
    err = _refused(capsys, *line)
    assert f"vllm serve {line[0]}" in err
    assert "1" * 100 not in err and "9" * 100 not in err  # the value is shown short, never whole


@pytest.mark.parametrize("option", ["-tp", "--tensor-parallel-size", "--block-size", "-dp", "-pp"])
@given(value=st.integers(max_value=0))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_size_below_one_is_refused_as_vllm_refuses_it(capsys: pytest.CaptureFixture[str], option: str,
                                                        value: int) -> None:
    # vLLM's ParallelConfig (ge=1) and CacheConfig (gt=0) refuse these; `-tp 0` was read as `-tp 1`
    err = _refused(capsys, option, str(value))
    assert f"vllm serve {option}: error[" in err and "below 1" in err
