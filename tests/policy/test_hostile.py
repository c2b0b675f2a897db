"""Hostile and broken rule files: every outcome is a loaded set or a located RuleLoadError."""

from __future__ import annotations

import os
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.policy import Limits, PolicyError, RuleLoadError, load_rules, load_rules_from_texts
from kvpolicy.policy.conditions import LeafResult, leaves_of
from kvpolicy.policy.context import MISSING

# KVPOLICY_FUZZ_EXAMPLES=20000 pytest tests/policy/test_hostile.py -k fuzz  for a long run
FUZZ_EXAMPLES = int(os.environ.get("KVPOLICY_FUZZ_EXAMPLES", "300"))

GOOD = ("version: 1\nrules:\n  - id: r1\n    description: d\n"
        "    when: {field: kv.per_token_head, eq: true}\n    forbid: {placement: cross_layer}\n")


def load_dir_error(root: Path, limits: Limits = Limits()) -> RuleLoadError:
    with pytest.raises(RuleLoadError) as info:
        load_rules(root, limits=limits)
    return info.value


def write(root: Path, name: str, data: str | bytes) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


@pytest.mark.parametrize("payload", [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:os.system ['touch {marker}']",
    "!!python/name:os.system",
    "{{a: !!python/object/apply:subprocess.call [['touch', '{marker}']]}}",
])
def test_python_tags_are_rejected_never_executed(tmp_path: Path, payload: str) -> None:
    marker = tmp_path / "executed"
    write(tmp_path, "global.yaml", "version: 1\nrules: " + payload.format(marker=marker) + "\n")
    err = load_dir_error(tmp_path)
    [d] = [d for d in err.diagnostics if d.code == "unsafe-tag"]  # `rules: {...}` is also not a list
    assert d.line == 2, d.render()
    assert "is not allowed" in d.message
    assert not marker.exists()


def test_billion_laughs_is_rejected_quickly_and_cheaply(tmp_path: Path) -> None:
    lines = ["version: 1", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    lines.append("rules: *a9")
    write(tmp_path, "global.yaml", "\n".join(lines) + "\n")
    tracemalloc.start()
    err = load_dir_error(tmp_path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [d.code for d in err.diagnostics] == ["too-large"]
    assert "more than 200000 nodes" in err.diagnostics[0].message
    assert peak < 200 * 2**20  # 10^10 nodes would need terabytes


def test_recursive_alias_is_rejected(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", "version: 1\nrules: &r [*r]\n")
    err = load_dir_error(tmp_path)
    assert err.diagnostics[0].code in ("too-deep", "yaml-syntax")


def test_nesting_depth_cap(tmp_path: Path) -> None:
    cond = "{field: kv.per_token_head, eq: true}"
    for _ in range(80):
        cond = "{not: " + cond + "}"
    write(tmp_path, "global.yaml", "version: 1\nrules:\n  - id: deep\n    description: d\n"
          f"    when: {cond}\n    forbid: {{placement: cross_layer}}\n")
    err = load_dir_error(tmp_path)
    [d] = err.diagnostics
    assert (d.code, d.line) == ("too-deep", 5)
    assert "nesting deeper than 64 levels" in d.message


def test_file_size_cap(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", GOOD + "#" * 2000 + "\n")
    err = load_dir_error(tmp_path, Limits(max_file_bytes=1000))
    [d] = err.diagnostics
    assert d.code == "too-large" and "over the 1000-byte limit" in d.message
    assert d.file.endswith("global.yaml")


def test_rule_count_cap(tmp_path: Path) -> None:
    rules = "".join(f"  - id: r{i}\n    description: d\n    forbid: {{placement: cross_layer}}\n" for i in range(6))
    write(tmp_path, "global.yaml", "version: 1\nrules:\n" + rules)
    err = load_dir_error(tmp_path, Limits(max_rules=5))
    [d] = err.diagnostics
    assert (d.code, d.line, d.col) == ("too-many-rules", 3, 3)


def test_invalid_utf8_is_located(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", b"version: 1\nrules:\n  - id: caf\xe9\n")
    [d] = load_dir_error(tmp_path).diagnostics
    assert (d.code, d.line, d.col) == ("encoding", 3, 12)
    assert d.message == "invalid UTF-8 byte 0xe9"


def test_bom_is_rejected_with_help(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", b"\xef\xbb\xbf" + GOOD.encode())
    [d] = load_dir_error(tmp_path).diagnostics
    assert (d.code, d.line, d.col) == ("bom", 1, 1)
    assert d.help == "save it as UTF-8 without BOM"


def test_tab_indentation_is_located(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", "version: 1\nrules:\n\t- id: r1\n")
    [d] = load_dir_error(tmp_path).diagnostics
    assert d.code == "yaml-syntax" and d.line == 3
    assert "tab" in (d.help or "").lower()


def test_empty_file_and_non_mapping(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", "")
    write(tmp_path, "connectors/x.yaml", "[1, 2]\n")
    codes = sorted(d.code for d in load_dir_error(tmp_path).diagnostics)
    assert codes == ["empty-document", "not-a-mapping"]


def test_directory_without_yaml(tmp_path: Path) -> None:
    write(tmp_path, "README.txt", "not rules")
    [d] = load_dir_error(tmp_path).diagnostics
    assert d.code == "no-rule-files"


def test_dangling_symlink_is_unreadable(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", GOOD)
    os.symlink(tmp_path / "missing.yaml", tmp_path / "connectors.yaml")
    [d] = load_dir_error(tmp_path).diagnostics
    assert d.code == "unreadable" and d.file.endswith("connectors.yaml")


def test_symlink_leaving_the_rules_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    rules = tmp_path / "rules"
    write(outside, "evil.yaml", GOOD)
    write(rules, "global.yaml", GOOD.replace("r1", "r2"))
    (rules / "connectors").mkdir()
    os.symlink(outside / "evil.yaml", rules / "connectors" / "evil.yaml")
    [d] = load_dir_error(rules).diagnostics
    assert d.code == "outside-root"
    assert "links outside the rules directory" in d.message


def test_symlink_inside_the_rules_directory_is_fine(tmp_path: Path) -> None:
    write(tmp_path, "shared/base.yaml.txt", GOOD)
    os.symlink(tmp_path / "shared" / "base.yaml.txt", tmp_path / "global.yaml")
    assert [r.id for r in load_rules(tmp_path).rules] == ["r1"]


def test_a_directory_named_like_a_rule_file(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", GOOD)
    (tmp_path / "extra.yaml").mkdir()
    [d] = load_dir_error(tmp_path).diagnostics
    assert d.code == "not-a-file"


def test_errors_in_one_file_never_half_load_the_set(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", GOOD)
    write(tmp_path, "connectors/nixl.yaml", "version: 1\nconnector: NixlConnector\nrules:\n  - id: x\n")
    err = load_dir_error(tmp_path)
    assert {d.file.split("/")[-1] for d in err.diagnostics} == {"nixl.yaml"}


# -- fuzzing ------------------------------------------------------------------------------

def _check_outcome(texts: dict[str, str]) -> None:
    try:
        rs = load_rules_from_texts(texts)
    except RuleLoadError as exc:
        assert exc.diagnostics, "a RuleLoadError always carries diagnostics"
        for d in exc.diagnostics:
            assert d.file in texts and d.line >= 1 and d.col >= 1, d.render()
            assert d.message and d.code
    except PolicyError as exc:  # pragma: no cover - any other PolicyError is a bug here
        raise AssertionError(f"unexpected {type(exc).__name__}: {exc}") from exc
    else:  # what loads prints: its digest, and every leaf as the trace shows it (#16 class 2)
        assert rs.digest.startswith("sha256:")
        for compiled in rs.rules:
            for leaf in leaves_of(compiled.rule.when):
                LeafResult(leaf.field, leaf.op, leaf.value, MISSING, False).describe()


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400))
def test_fuzz_arbitrary_text(text: str) -> None:
    _check_outcome({"global.yaml": text})


leaf_ops = st.sampled_from(["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "exists", "bogus"])
field_paths = st.sampled_from(["kv.per_token_head", "kv.block_size", "kv.quant_mode", "backend.name",
                               "connector.extra.flag", "groups.count", "kv.nope", "", "connector.extra."])
junk = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(allow_nan=True),
                 st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                          st.integers(), max_size=2))


def conditions():
    leaf = st.builds(lambda f, op, v: {"field": f, op: v}, field_paths, leaf_ops, junk)
    return st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda xs: {"all": xs}, st.lists(inner, max_size=3)),
        st.builds(lambda xs: {"any": xs}, st.lists(inner, max_size=3)),
        st.builds(lambda x: {"not": x}, inner),
        inner.map(lambda c: [c]),
    ), max_leaves=6)


patterns = st.fixed_dictionaries({}, optional={"placement": st.sampled_from(["per_layer", "cross_layer", "diag", 1]),
                                               "head_order": st.sampled_from(["NHD", "HND", "XYZ"])})
rules = st.fixed_dictionaries(
    {"id": st.one_of(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), junk),
     "description": st.one_of(st.just("d"), junk)},
    optional={"when": conditions(), "forbid": patterns, "require": patterns, "prefer": patterns,
              "weight": junk, "reference": junk, "surprise": junk},
)
files = st.fixed_dictionaries(
    {"version": st.one_of(st.just(1), junk), "rules": st.one_of(st.lists(rules, max_size=4), junk)},
    optional={"connector": st.sampled_from(["NixlConnector", "Nope", None]),
              "defaults": st.fixed_dictionaries({"layout_order": st.lists(
                  st.sampled_from(["LBNHC", "BHLNC", "x/y"]), max_size=4)}),
              "member_preferences": st.sampled_from(["all", "any", "most"])},
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files, st.sampled_from(["global.yaml", "connectors/c.yaml"]))
def test_fuzz_schema_shaped_trees(tree: dict, name: str) -> None:
    _check_outcome({name: yaml.safe_dump(tree, allow_unicode=True)})


def test_empty_when_is_an_error_not_always(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", "version: 1\nrules:\n  - id: r\n    description: d\n    when:\n"
          "    forbid: {placement: cross_layer}\n")
    [d] = load_dir_error(tmp_path).diagnostics
    assert (d.code, d.line, d.col) == ("empty-condition", 5, 5)


@pytest.mark.parametrize("value", ["false", "0", '""'])
def test_falsy_rules_value_is_not_an_empty_list(tmp_path: Path, value: str) -> None:
    write(tmp_path, "global.yaml", f"version: 1\nrules: {value}\n")
    [d] = load_dir_error(tmp_path).diagnostics
    assert "`rules` must be a list" in d.message


def test_misspelt_directories_and_suffixes_are_reported(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", GOOD)
    write(tmp_path, "connector/nixl.yaml", "version: 1\nconnector: NixlConnector\nrules: []\n")
    write(tmp_path, "Offloading.YAML", GOOD)
    diags = load_dir_error(tmp_path).diagnostics
    by_code = {d.code: d for d in diags}
    assert "did you mean `connectors/`?" in by_code["stray-directory"].help
    assert by_code["stray-file"].help == "rename it to `Offloading.yaml`"
    assert len(diags) == 2


def test_a_file_named_connectors_is_reported_not_skipped(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", GOOD)
    write(tmp_path, "connectors", "version: 1\nconnector: NixlConnector\nrules: []\n")
    [d] = load_dir_error(tmp_path).diagnostics
    assert (d.code, d.file) == ("stray-file", str(tmp_path / "connectors"))
    assert "is a file, not a directory" in d.message and "connectors/" in d.help


@pytest.mark.parametrize("target", ["nowhere", "connectors"])  # dangling; a loop onto itself
def test_a_connectors_symlink_to_nothing_is_reported(tmp_path: Path, target: str) -> None:
    write(tmp_path, "global.yaml", GOOD)
    (tmp_path / "connectors").symlink_to(target)
    [d] = load_dir_error(tmp_path).diagnostics
    assert d.code == "stray-file" and "is a symlink to nothing" in d.message


def test_connectors_linked_to_a_sibling_directory_is_read_not_called_stray(tmp_path: Path) -> None:
    write(tmp_path, "global.yaml", GOOD)
    write(tmp_path, "shared-connectors/Nixl.yaml", "version: 1\nconnector: NixlConnector\nrules:\n"
          "  - id: nixl-hnd\n    description: d\n    when: {field: kv.block_size, ge: 1}\n"
          "    prefer: {layout: LBHNC}\n")
    (tmp_path / "connectors").symlink_to("shared-connectors")
    ruleset = load_rules(tmp_path)
    assert "NixlConnector" in ruleset.connectors


# -- fuzzing, widened (#16): tags, huge numbers, nesting, file-system oddities, case files ---------------
# Every target runs KVPOLICY_FUZZ_EXAMPLES examples (300 by default; 10,000+ for a long run).

TAGS = ["!!bool", "!!int", "!!float", "!!str", "!!null", "!!timestamp", "!!binary", "!!set", "!!omap", "!!pairs",
        "!!seq", "!!map", "!!merge", "!!value", "!custom", "!<tag:yaml.org,2002:int>", "!!python/none", ""]
SCALAR_TEXT = st.one_of(
    st.sampled_from(["abc", "yes", "on", "1:30", "-1:30:00", "017", "0o17", "0x1F", "0b101", "1_000", ".inf", ".nan",
                     "-.inf", "1e400", "2020-01-01", "aGVsbG8=", "~", "''", "[a]", "{a: 1}", "true", "True"]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.integers(min_value=0, max_value=2**4000).map(hex),
    st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n),
    st.integers(min_value=1, max_value=6000).map(lambda n: "1" * n + ".5"),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
)


@st.composite
def tagged_values(draw: st.DrawFn) -> str:
    tag = draw(st.sampled_from(TAGS))
    text = draw(SCALAR_TEXT)
    return f"{tag} {text}".strip() if text else tag or "''"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(tagged_values(), st.sampled_from(["eq", "ne", "lt", "gt", "in", "exists"]),
       st.sampled_from(["kv.block_size", "kv.quant_mode", "kv.per_token_head", "connector.extra.x"]),
       st.sampled_from(["operand", "key", "version", "id", "list"]))
def test_fuzz_tag_values_and_numbers(value: str, op: str, field: str, where: str) -> None:
    operand = f"[{value}]" if op == "in" or where == "list" else value
    texts = {
        "operand": f"version: 1\nrules:\n  - id: r\n    description: d\n    when: {{field: {field}, {op}: {operand}}}\n"
                   "    forbid: {placement: cross_layer}\n",
        "key": f"version: 1\n{value}: 1\nrules: []\n",
        "version": f"version: {value}\nrules: []\n",
        "id": f"version: 1\nrules:\n  - id: {value}\n    description: d\n    forbid: {{placement: cross_layer}}\n",
    }
    _check_outcome({"global.yaml": texts.get(where, texts["operand"])})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=1, max_value=3000), st.sampled_from(["not", "all", "list", "map", "flow"]))
def test_fuzz_deep_nesting(depth: int, kind: str) -> None:
    leaf = "{field: kv.per_token_head, eq: true}"
    if kind == "not":
        cond = "{not: " * depth + leaf + "}" * depth
    elif kind == "all":
        cond = "{all: [" * depth + leaf + "]}" * depth
    elif kind == "list":
        cond = "[" * depth + leaf + "]" * depth
    elif kind == "map":
        cond = "{a: " * depth + "1" + "}" * depth
    else:
        cond = "".join(f"\n{'  ' * (i + 3)}a:" for i in range(min(depth, 400))) + " 1"
    _check_outcome({"global.yaml": "version: 1\nrules:\n  - id: deep\n    description: d\n"
                                   f"    when: {cond}\n    forbid: {{placement: cross_layer}}\n"})


FS_KINDS = ["good", "junk", "dir", "loop", "dangling", "outside", "fifo", "link-dir", "empty"]
FS_NAMES = ["global.yaml", "other.yml", "connectors/nixl.yaml", "connectors/x.yaml", "a.yaml", "connectors",
            "tests/t.yaml", "Upper.YAML"]


def _make(root: Path, outside: Path, name: str, kind: str, text: str) -> None:
    path = root / name
    if path.exists() or path.is_symlink():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # an earlier entry took the parent's name (a file or a link loop named `connectors`)
    if kind == "good":
        path.write_text(GOOD.replace("r1", f"r{abs(hash(name)) % 1000}"))
    elif kind == "junk":
        path.write_text(text)
    elif kind == "dir":
        path.mkdir()
    elif kind == "loop":
        os.symlink(path.name, path)
    elif kind == "dangling":
        os.symlink(root / "missing-target", path)
    elif kind == "outside":
        os.symlink(outside, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-dir":
        os.symlink(root, path)
    else:
        path.write_text("")


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(FS_NAMES), st.sampled_from(FS_KINDS), st.text(max_size=60)),
                min_size=1, max_size=6))
def test_fuzz_file_system_oddities(entries: list[tuple[str, str, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root, outside = Path(tmp) / "rules", Path(tmp) / "outside.yaml"
        root.mkdir()
        outside.write_text(GOOD)
        for name, kind, text in entries:
            _make(root, outside, name, kind, text)
        try:
            rs = load_rules(root)
        except RuleLoadError as exc:
            assert exc.diagnostics
            for d in exc.diagnostics:
                assert d.file.startswith(str(root)) and d.code and d.message, d.render()
        else:
            assert rs.digest.startswith("sha256:")


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.text(max_size=300), tagged_values().map(
    lambda v: "version: 1\ncases:\n  - name: c\n    input: {spec: {num_layers: " + v
    + ", num_kv_heads: 2, head_size: 64}, connector_config: {k: " + v + "}}\n    expect: {layout: LBNHC}\n")))
def test_fuzz_policy_test_files(text: str) -> None:
    from kvpolicy.engine.policy_tests import PolicyTestError, load_cases

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cases.yaml"
        path.write_text(text)
        try:
            load_cases([path])
        except PolicyTestError as exc:
            assert exc.diagnostics
            for d in exc.diagnostics:
                assert d.code and d.message and d.file.endswith("cases.yaml"), d.render()
