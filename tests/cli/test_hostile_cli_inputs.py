"""Hostile deployment inputs: each one a located error under the flag the user typed, never a traceback."""

from __future__ import annotations

import json

import pytest
from cli_capture import cli

from kvpolicy.engine.inputs import build_context
from kvpolicy.policy.errors import InputError

KTC = "--kv-transfer-config"


@pytest.mark.parametrize("text", [
    '{"kv_connector": "\\ud800", "kv_role": "kv_both"}',
    '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"x": "a\\udfff"}}',
    '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"\\udc80": 1}}',
])
def test_lone_surrogate_in_kv_transfer_config_is_a_located_usage_error(capsys, text):
    # JSON's `\ud800` escape decodes to a lone surrogate, which no output can print.
    code, out, err = cli(capsys, "dry-run", KTC, text, "--format", "json")
    assert code == 2
    doc = json.loads(out)
    assert doc["error"]["kind"] == "InputError"
    assert doc["error"]["diagnostics"][0]["file"] == KTC
    assert "not valid Unicode" in err


def test_lone_surrogate_in_connector_config_text_output(capsys):
    code, _, err = cli(capsys, "dry-run", "--connector", "NixlConnector", "--connector-config", '{"x": "\\ud800"}')
    assert code == 2
    assert err.startswith("--connector-config:") and "not valid Unicode" in err


@pytest.mark.parametrize("extra, message", [
    ({"connectors": 5}, "must be a list"),
    ({"x": float("nan")}, "not a number a rule can compare"),
])
def test_kv_transfer_config_extra_errors_name_the_flag_given(capsys, extra, message):
    """A bad `kv_connector_extra_config` inside --kv-transfer-config is located there, not at --connector-config
    (a flag the user never typed)."""
    ktc = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    code, _, err = cli(capsys, "dry-run", KTC, json.dumps(ktc))
    assert code == 2
    assert err.startswith(f"{KTC}: error[invalid-input]:"), err
    assert message in err and "--connector-config" not in err


def test_library_locates_kv_transfer_config_extra_errors():
    ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"x": float("inf")}}
    with pytest.raises(InputError) as info:
        build_context(spec={"num_layers": 2, "block_size": 16, "num_kv_heads": 1, "head_size": 64},
                      kv_transfer_config=ktc)
    assert info.value.diagnostics[0].file.startswith("kv_transfer_config.kv_connector_extra_config")


def test_unwritable_svg_with_format_json_prints_an_error_document(capsys, tmp_path):
    """docs/json-output.md: a failure after the flags parsed leaves exactly one JSON document on stdout."""
    code, out, err = cli(capsys, "dry-run", "--format", "json", "--svg", str(tmp_path / "no" / "map.svg"))
    assert code == 2
    doc = json.loads(out)
    assert doc["format_version"] == 1 and doc["ok"] is False
    assert doc["error"]["diagnostics"][0]["file"] == "--svg"
    assert "--svg: error[usage]: cannot write" in err


@pytest.mark.parametrize("argv, flag", [
    (["validate", ""], "DIR"),
    (["test", "--rules", ""], "--rules"),
    (["dry-run", "--rules", ""], "--rules"),
])
def test_empty_rule_directory_argument_is_a_usage_error(capsys, tmp_path, monkeypatch, argv, flag):
    """`""` names no directory (docs/cli.md: exit 2); it used to validate the working directory."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, *argv)
    assert code == 2
    assert err.startswith(f"{flag}: error[usage]:"), err


@pytest.mark.parametrize("path", ["\ud800", "rules/\udfff/config.json"])
def test_decide_with_unencodable_model_path_is_an_input_error(path):
    """A lone surrogate no file system can name: the `model` argument is named, no UnicodeEncodeError."""
    from kvpolicy import LayoutEngine

    with pytest.raises(InputError) as info:
        LayoutEngine.default().decide(model=path)
    assert info.value.diagnostics[0].file == "model"


def test_read_capped_refuses_an_unencodable_name(tmp_path):
    from kvpolicy.policy.files import read_capped

    text, diags = read_capped(tmp_path / "\ud800.yaml", "x.yaml", 1000)
    assert text is None and [d.code for d in diags] == ["unreadable"]


@pytest.mark.parametrize("path", [None, 5, b"rules", ["rules"]])
def test_load_rules_with_a_non_path_is_a_policy_error(path):
    """The public loader names its argument instead of raising pathlib's TypeError."""
    from kvpolicy import PolicyError, load_rules

    with pytest.raises(PolicyError) as info:
        load_rules(path)
    assert info.value.diagnostics[0].file == "path"
    assert type(path).__name__ in info.value.diagnostics[0].message


def test_counterfactual_search_is_bounded_for_a_huge_multiconnector(monkeypatch):
    """vLLM takes any number of MultiConnector members; explaining 300 of them must not cost 300 times
    the search (it took 27 s for 1000 members). Counted in scope passes, not seconds."""
    from kvpolicy import LayoutEngine
    from kvpolicy.engine import counterfactual

    passes = []
    real = counterfactual.evaluate

    def counting(ruleset, glob, conn, **kw):
        passes.append(1 + (len(conn.walk()) if conn else 0))
        return real(ruleset, glob, conn, **kw)

    monkeypatch.setattr(counterfactual, "evaluate", counting)
    members = [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}] * 300
    ktc = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": members}}
    decision = LayoutEngine.default("vllm-0.34").decide(
        spec={"num_layers": 2, "block_size": 16, "num_kv_heads": 1, "head_size": 64}, kv_transfer_config=ktc)
    assert decision.counterfactuals  # still searched
    assert sum(passes) <= 2 * counterfactual.MAX_EVALUATIONS * 8


@pytest.mark.parametrize(("spec", "code"), [
    ("num_layers: .inf\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n", "invalid-value"),
    ("num_layers: 2\nblock_size: 16\nnum_kv_heads: 2\n", "missing-key"),
    ('num_layers: !!python/object/apply:os.system ["true"]\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n',
     "unsafe-tag"),
    ("num_layers: !!set {a, b}\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n", "unsafe-tag"),
])
def test_every_spec_file_error_says_what_to_write(capsys, tmp_path, spec, code):
    """A --spec file's value of the wrong type, a key it lacks, a tag: located, and a help line saying what to do."""
    (tmp_path / "spec.yaml").write_text(spec)
    rc, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34", "--spec", str(tmp_path / "spec.yaml"))
    assert rc == 2 and "spec.yaml:" in err
    located = [line for line in err.splitlines() if f"error[{code}]" in line]
    assert located, err
    after = err.split(located[0] + "\n", 1)[1].splitlines()
    assert after and after[0].startswith("  help: "), err
