"""A config that leaves out its size is read with its config class's defaults, as vLLM reads it, and says
so (issue 32): a `class-defaults` note names every field taken from the defaults with the value taken, in
the text and the JSON output. `{"architectures": [...], "model_type": "llama"}` alone was decided as a
32-layer, 32-KV-head model without a word."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.engine.cli.main import main
from kvpolicy.policy.hf_config import read_hf_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA_FIELDS = {"num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_size": 2048}
LLAMA_DEFAULTS = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096}
BARE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _said(config: dict) -> list[str]:
    reading = read_hf_config(config)
    return [n.message for n in reading.notes if n.code == "class-defaults"]


def test_a_bare_config_says_every_default_it_was_read_with() -> None:
    reading = read_hf_config(BARE)
    assert reading.groups.primary.num_layers == 32 and reading.groups.primary.num_kv_heads == 32  # as vLLM reads it
    (message,) = _said(BARE)
    for field, value in LLAMA_DEFAULTS.items():
        assert f"`{field}` {value}" in message
    assert "`llama`" in message


@given(left_out=st.sets(st.sampled_from(sorted(LLAMA_FIELDS))))
def test_the_note_names_exactly_the_fields_taken_from_the_defaults(left_out: set[str]) -> None:
    config = {**BARE, **{k: v for k, v in LLAMA_FIELDS.items() if k not in left_out}}
    said = _said(config)
    if not {"num_hidden_layers", "hidden_size"} & left_out:
        assert said == []  # the model's size is stated
        return
    (message,) = said
    named = {f for f in LLAMA_FIELDS if f"`{f}` " in message}
    # the KV heads default to the query heads: named when those were taken from the defaults too
    expected = left_out - ({"num_key_value_heads"} if "num_attention_heads" not in left_out else set())
    assert named == expected


@pytest.mark.parametrize("name", ["gemma-3-4b-it", "qwen2.5-0.5b-instruct", "llama-3.1-8b-instruct"])
def test_a_real_config_stating_its_size_says_nothing_of_defaults(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reading = read_hf_config(ROOT / "tests" / "fixtures" / "model_configs" / name / "config.json")
    assert "class-defaults" not in [n.code for n in reading.notes]


def test_the_cli_says_it_in_text_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BARE))
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", str(tmp_path))
    assert code == 0 and "warning[class-defaults]" in err and "`num_hidden_layers` 32" in err
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--model", str(tmp_path), "--format", "json")
    assert code == 0
    assert any("warning[class-defaults]" in w and "`num_key_value_heads` 32" in w
               for w in json.loads(out)["warnings"])
