"""Values and files that used to escape the loader as ValueError/KeyError/RuntimeError (#16 classes
1, 2, 10, 11): each is now a located `RuleLoadError`, so ``on_error="fallback"`` always falls back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.policy_tests import PolicyTestError, load_cases
from kvpolicy.policy import RuleLoadError, load_rules, load_rules_from_texts
from kvpolicy.policy.conditions import compile_condition

GOOD = ("version: 1\nrules:\n  - id: r1\n    description: d\n"
        "    when: {field: kv.per_token_head, eq: true}\n    forbid: {placement: cross_layer}\n")


def leaf_rule(operand: str, field: str = "kv.block_size", op: str = "eq") -> str:
    return ("version: 1\nrules:\n  - id: r1\n    description: d\n"
            f"    when: {{field: {field}, {op}: {operand}}}\n    forbid: {{placement: cross_layer}}\n")


def load_error(text: str) -> RuleLoadError:
    with pytest.raises(RuleLoadError) as info:
        load_rules_from_texts({"global.yaml": text})
    return info.value


def falls_back(root: Path) -> RuleLoadError:
    engine = LayoutEngine.from_path(root, on_error="fallback", shipped_rules=False)  # this directory alone
    assert engine.is_fallback
    assert isinstance(engine.load_error, RuleLoadError)
    return engine.load_error


# -- class 1: tags whose value does not convert ------------------------------------------------

@pytest.mark.parametrize("operand, code", [
    ("!!bool abc", "yaml-value"),  # KeyError before
    ("!!int abc", "yaml-value"),  # ValueError before
    ("!!float abc", "yaml-value"),
    ("!<tag:yaml.org,2002:int> abc", "yaml-value"),
    ("!!timestamp abc", "unsafe-tag"),
    ("!!binary abc", "unsafe-tag"),
    ("!!set {a}", "unsafe-tag"),
    ("!!omap [a]", "unsafe-tag"),
    ("!!pairs [a]", "unsafe-tag"),
    ("!!str [a]", "unsafe-tag"),
])
def test_tag_values_that_do_not_convert_are_located(tmp_path: Path, operand: str, code: str) -> None:
    (tmp_path / "global.yaml").write_text(leaf_rule(operand))
    err = falls_back(tmp_path)
    [d] = err.diagnostics  # one problem, one message: the type check skips the unreadable value
    assert (d.code, d.line, d.col) == (code, 5, 38), d.render()


@pytest.mark.parametrize("key", ["!!int abc", "!!bool abc", "!!float x", "[a, b]"])
def test_keys_that_do_not_convert_are_located(key: str) -> None:
    err = load_error(f"version: 1\n{key}: 1\nrules: []\n")
    assert [(d.code, d.line) for d in err.diagnostics] in ([("yaml-value", 2)], [("bad-key", 2)])


# -- class 1: the file system ------------------------------------------------------------------

def test_symlink_loop_is_located(tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(GOOD)
    os.symlink("loop.yaml", tmp_path / "loop.yaml")  # RuntimeError from Path.resolve before
    [d] = falls_back(tmp_path).diagnostics
    assert (d.code, Path(d.file).name) == ("unreadable", "loop.yaml")
    assert "symbolic link loop" in d.message


def test_fifo_named_like_a_rule_file_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(GOOD)
    os.mkfifo(tmp_path / "pipe.yaml")  # opening it would block forever
    [d] = falls_back(tmp_path).diagnostics
    assert d.code == "not-a-file" and "pipe" in d.message


def test_directory_named_like_a_rule_file(tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(GOOD)
    (tmp_path / "connectors" / "x.yaml").mkdir(parents=True)
    [d] = falls_back(tmp_path).diagnostics
    assert (d.code, d.file.endswith("connectors/x.yaml")) == ("not-a-file", True)


def test_unlistable_connectors_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "global.yaml").write_text(GOOD)
    (tmp_path / "connectors").mkdir()
    (tmp_path / "connectors").chmod(0)  # root ignores the mode: the denial is simulated too
    real_iterdir = Path.iterdir

    def iterdir(self: Path):
        if self.name == "connectors":
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    try:
        [d] = falls_back(tmp_path).diagnostics
    finally:
        (tmp_path / "connectors").chmod(0o755)
    assert (d.code, d.file.endswith("connectors")) == ("unreadable", True)
    assert "cannot list the directory: Permission denied" in d.message


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "global.yaml").write_text(GOOD)
    real_open = open

    def deny(file, *args, **kwargs):
        if str(file).endswith("global.yaml"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", deny)
    [d] = falls_back(tmp_path).diagnostics
    assert d.code == "unreadable" and "Permission denied" in d.message


@pytest.mark.parametrize("make", ["loop", "fifo", "dir"])
def test_case_files_that_are_not_files(tmp_path: Path, make: str) -> None:
    target = tmp_path / "cases.yaml"
    {"loop": lambda: os.symlink("cases.yaml", target), "fifo": lambda: os.mkfifo(target),
     "dir": lambda: target.mkdir()}[make]()
    with pytest.raises(PolicyTestError) as info:
        load_cases([tmp_path])  # found in a directory, as `kvpolicy test rules/tests` does
    assert {d.code for d in info.value.diagnostics} == {"unreadable" if make == "loop" else "not-a-file"}


def test_case_files_have_a_size_cap(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("version: 1\ncases: []\n" + "#" * 1_100_000 + "\n")
    with pytest.raises(PolicyTestError) as info:
        load_cases([path])
    [d] = info.value.diagnostics
    assert d.code == "too-large" and "-byte limit" in d.message


# -- class 2: numbers too large to print --------------------------------------------------------

@pytest.mark.parametrize("operand", ["0x" + "f" * 4000, "1" * 5000, "9223372036854775808", "-9223372036854775809",
                                     "[1, 0x" + "f" * 40 + "]"])
def test_operands_beyond_int64_are_located(operand: str) -> None:
    op = "in" if operand.startswith("[") else "eq"
    [d] = load_error(leaf_rule(operand, op=op)).diagnostics
    assert d.code == "number-out-of-range" and d.line == 5
    assert "outside the 64-bit range" in d.message and len(d.render()) < 400


def test_int64_bounds_themselves_load_and_print() -> None:
    rs = load_rules_from_texts({"global.yaml": leaf_rule("[9223372036854775807, -9223372036854775808]",
                                                         field="connector.extra.n", op="in")})
    assert rs.digest.startswith("sha256:")


def test_huge_numbers_in_a_case_file_are_located(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: 1\ncases:\n  - name: big\n    input: {spec: {num_layers: 0x" + "f" * 4000
                    + ", num_kv_heads: 2, head_size: 64}}\n    expect: {layout: LBNHC}\n")
    with pytest.raises(PolicyTestError) as info:
        load_cases([path])
    [d] = info.value.diagnostics
    assert (d.code, d.line) == ("number-out-of-range", 4)


# -- class 10: YAML 1.1 surprises --------------------------------------------------------------

@pytest.mark.parametrize("operand, read_as", [("1:30", "90"), ("-1:30:00", "-5400"), ("017", "15"), ("0_17", "15")])
def test_yaml11_numbers_get_a_quote_it_hint(operand: str, read_as: str) -> None:
    [d] = load_error(leaf_rule(operand)).diagnostics
    assert d.code == "ambiguous-number" and d.line == 5
    assert "quote it" in (d.help or "") or "quote it" in d.message
    assert read_as in d.message or read_as.lstrip("-") in (d.help or "") or "base-60" in d.message


@pytest.mark.parametrize("version", ["true", "yes", "on"])
def test_version_true_is_not_version_1(version: str) -> None:
    [d] = load_error(f"version: {version}\nrules: []\n").diagnostics  # pydantic took True == 1 before
    assert (d.code, d.line) == ("invalid-value", 1)
    assert d.message == f"expected 1, got boolean `{version}`"


@pytest.mark.parametrize("key", ["on", "yes", "off", "y"])
def test_yaml11_boolean_keys_keep_their_text(key: str) -> None:
    [d] = load_error(f"version: 1\n{key}: 1\nrules: []\n").diagnostics
    assert d.message == f"unknown key `{key}`"  # was `true`/`false`


def test_yaml11_boolean_operands_on_string_fields_say_quote_it() -> None:
    [d] = load_error(leaf_rule("on", field="kv.quant_mode")).diagnostics
    assert d.message == "`kv.quant_mode` is a string, got boolean `true`"
    assert "quote it" in (d.help or "")


def test_quoted_or_decimal_forms_still_load() -> None:
    load_rules_from_texts({"global.yaml": leaf_rule('["1:30", "017"]', field="connector.extra.t", op="in")})
    load_rules_from_texts({"global.yaml": leaf_rule("17")})


# -- class 11: `eq: true` on an integer field -----------------------------------------------------

@pytest.mark.parametrize("op, operand", [("eq", "true"), ("ne", "false"), ("in", "[16, true]"),
                                         ("not_in", "[false]")])
def test_booleans_are_not_integers(op: str, operand: str) -> None:
    # bool subclasses int in Python: without the check the rule loads and silently never matches
    [d] = load_error(leaf_rule(operand, op=op)).diagnostics
    assert d.code == "type-mismatch" and "is an integer, got boolean" in d.message


# -- #15: operands printed as written -------------------------------------------------------------

def test_operands_print_faithfully() -> None:
    rs = load_rules_from_texts({"global.yaml": leaf_rule('[true, "true", "True", plain]',
                                                         field="connector.extra.flag", op="in")})
    out: list = []
    compile_condition(rs.rules[0].rule.when).explain({"connector.extra.flag": "true"}, out)
    assert out[0].describe() == 'connector.extra.flag in [true, "true", "True", plain] (saw "true") -> true'


def test_loaded_rules_never_fail_to_print(tmp_path: Path) -> None:
    (tmp_path / "global.yaml").write_text(leaf_rule("9223372036854775807", field="connector.extra.n"))
    rs = load_rules(tmp_path)
    assert rs.digest.startswith("sha256:")


# -- class 2 beyond rule files: config.json and --spec ----------------------------------------------

@pytest.mark.parametrize("number, col", [("1" * 5000, 23), ("9" * 30, 23), ("-" + "9" * 25, 23), ("NaN", 23),
                                         ("Infinity", 23)])
def test_huge_numbers_in_config_json_are_located(tmp_path: Path, number: str, col: int) -> None:
    from kvpolicy.policy import ModelConfigError
    from kvpolicy.policy.hf_config import kv_groups_from_hf_config

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",\n "num_hidden_layers": ' + number + ', "num_attention_heads": 8, '
                    '"hidden_size": 512, "num_key_value_heads": 2}')
    with pytest.raises(ModelConfigError) as info:  # a ValueError traceback before, for 5000 digits
        kv_groups_from_hf_config(path)
    [d] = info.value.diagnostics
    assert (d.code, d.line, d.col) == ("invalid-field", 2, col), d.render()
    assert len(d.render()) < 300


def test_a_fifo_for_config_json_is_refused_not_read(tmp_path: Path) -> None:
    from kvpolicy.policy import ModelConfigError
    from kvpolicy.policy.hf_config import kv_groups_from_hf_config

    os.mkfifo(tmp_path / "config.json")  # reading it would block forever
    with pytest.raises(ModelConfigError) as info:
        kv_groups_from_hf_config(tmp_path)
    assert [d.code for d in info.value.diagnostics] == ["not-a-file"]


@pytest.mark.parametrize("text", ["num_layers: 0x" + "f" * 4000 + "\nnum_kv_heads: 2\nhead_size: 64\n",
                                  '{"num_layers": ' + "1" * 5000 + ', "num_kv_heads": 2, "head_size": 64}'])
def test_huge_numbers_in_a_spec_file_are_located(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 text: str) -> None:
    from kvpolicy.engine.cli.main import main

    path = tmp_path / "spec.yaml"
    path.write_text(text)
    assert main(["dry-run", "--spec", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1:" in err and "error[number-out-of-range]" in err and "Traceback" not in err
