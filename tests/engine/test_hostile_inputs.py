"""A hostile user's inputs to the release-profile features: each is decided, or a located error.

Regressions for what a hostile review found broken (odd values for the decide()
keywords, the dry-run flags and the policy-test fields, odd vLLM versions, byte
addresses at the edges), and properties that keep them fixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpolicy.engine.policy_tests import PolicyTestError, load_cases, run_policy_tests

SPEC = "{num_layers: 4, num_kv_heads: 2, head_size: 64}"
GROUP_SPEC = "{num_layers: 4, num_kv_heads: 2, head_size: 64, block_size: 16}"


def _case_file(tmp_path: Path, inputs: str, expect: str = "{layout: LBNHC}") -> Path:
    body = "\n".join("      " + line for line in inputs.strip().splitlines())
    path = tmp_path / "cases.yaml"
    path.write_text(f"version: 1\ncases:\n  - name: c\n    input:\n{body}\n    expect: {expect}\n")
    return path


# -- policy-test fields: a wrong type is a located load error, never a silently coerced value -----------


@pytest.mark.parametrize(("inputs", "message"), [
    (f"spec: {SPEC}\nblock_size: true", "expected a valid integer, got boolean"),
    (f"spec: {SPEC}\nblock_size: '16'", "expected a valid integer, got string"),
    (f"spec: {SPEC}\nblock_size: 16.0", "expected a valid integer, got number"),
    (f"spec: {SPEC}\ndevice_capability: true", "expected a valid integer, got boolean"),
    (f"spec: {SPEC}\ndevice_capability: .inf", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: .nan", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: 0.5", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: -1.0", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\ndevice_capability: '１０.0'", "is not a CUDA compute capability"),
    (f"spec: {SPEC}\nhisparse: 'true'\nconnector: HiSparseConnector", "expected a valid boolean, got string"),
    (f"spec: {SPEC}\nhisparse: 1\nconnector: HiSparseConnector", "expected a valid boolean, got integer"),
    (f"spec: {SPEC}\nenable_extensible_kv_cache: 0", "expected a valid boolean, got integer"),
    (f"spec: {SPEC}\nuse_v2_model_runner: 'yes'", "expected a valid boolean, got string"),
    (f"spec: {SPEC}\ntensor_parallel_size: true", "expected a valid integer, got boolean"),
    (f"spec: {SPEC}\nvllm_version: ''", "at least 1 character"),
    (f"spec: {SPEC}\nvllm_version: 0.34", "write the vLLM version as a string"),
    (f"groups: [{{spec: {GROUP_SPEC}, num_attention_groups: true}}]", "expected a valid integer, got boolean"),
    (f"groups: [{{spec: {GROUP_SPEC}, num_attention_groups: '2'}}]", "expected a valid integer, got string"),
    (f"groups: [{{spec: {GROUP_SPEC}, dcp_sharded: 'no'}}]", "expected a valid boolean, got string"),
    (f"groups: [{{spec: {GROUP_SPEC}, dcp_sharded: 0}}]", "expected a valid boolean, got integer"),
])
def test_case_fields_of_the_wrong_type_are_located_errors(tmp_path: Path, inputs: str, message: str) -> None:
    path = _case_file(tmp_path, inputs)
    with pytest.raises(PolicyTestError) as info:
        load_cases([path])
    [d] = info.value.diagnostics
    assert d.file.endswith("cases.yaml") and d.line >= 5 and d.col > 0, d.render()
    assert message in d.message, d.render()


def test_case_device_capability_as_written_by_people(tmp_path: Path) -> None:
    for value in ("10", "10.0", "'10.0'", "'10'"):
        path = _case_file(tmp_path, f"spec: {SPEC}\ndevice_capability: {value}\nattention_backend: FLASHINFER",
                          "{survivors: [LBHNC, BLHNC]}")
        run = run_policy_tests(_shipped("0.34.0"), [path], vllm_version="0.34.0")
        assert run.ok, [r.failures for r in run.results]


def test_case_tensor_parallel_size_with_a_spec_is_refused_not_dropped(tmp_path: Path) -> None:
    path = _case_file(tmp_path, f"spec: {SPEC}\ntensor_parallel_size: 2", "{error: invalid-input}")
    run = run_policy_tests(_shipped("0.34.0"), [path], vllm_version="0.34.0")
    assert run.ok, [r.failures for r in run.results]
    [result] = run.results
    [d] = result.error.diagnostics
    assert "applies to `model` only" in d.message and d.line == 6, d.render()


def _shipped(version: str):
    from kvpolicy.engine import LayoutEngine

    return LayoutEngine.default(version).ruleset


@pytest.mark.parametrize("text", ["9", "9.0", "10.0", "12.1"])
def test_device_capability_parses_the_same_in_cases_and_flags(text: str) -> None:
    from kvpolicy.engine.cli.dry_run import _capability
    from kvpolicy.engine.inputs import parse_device_capability
    from kvpolicy.engine.policy_tests import CaseInput

    major = int(text.split(".")[0])
    assert parse_device_capability(text) == _capability(text) == major
    assert CaseInput(spec={}, device_capability=text).device_capability == major


@pytest.mark.parametrize("text", ["", " 9", "９", "10.0.1", "sm_90", "0", "100", "-1", "1e3", "10.x"])
def test_device_capability_refuses_the_same_in_cases_and_flags(text: str) -> None:
    import argparse

    from pydantic import ValidationError

    from kvpolicy.engine.cli.dry_run import _capability
    from kvpolicy.engine.inputs import parse_device_capability
    from kvpolicy.engine.policy_tests import CaseInput

    assert parse_device_capability(text) is None
    with pytest.raises(argparse.ArgumentTypeError):
        _capability(text)
    with pytest.raises(ValidationError):
        CaseInput(spec={}, device_capability=text)


# -- the default profile: KVPOLICY_VLLM_VERSION and the installed vllm distribution --------------------


def _fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metadata_bytes: bytes) -> None:
    """A `vllm` distribution whose METADATA is ``metadata_bytes``, and a `vllm` package that must never load."""
    import sys

    dist = tmp_path / "vllm-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_bytes(metadata_bytes)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise RuntimeError('kvpolicy imported vllm')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KVPOLICY_VLLM_VERSION", raising=False)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)


@pytest.mark.parametrize(("version", "profile"), [
    ("0.34.0", "vllm-0.34"), ("0.34.0+cu121", "vllm-0.34"), ("0.28.0", "vllm-0.28"),
    # no profile of its own: its X.Y series when shipped, else the newest; never the historical one
    ("0.28.1", "vllm-0.28"), ("0.28.0.post1", "vllm-0.28"), ("0.28.1rc2", "vllm-0.28"), ("0.34.1", "vllm-0.34"),
    ("0.99.0", "vllm-0.34"), ("0.280.0", "vllm-0.34"), ("1.0", "vllm-0.34"), ("garbage!", "vllm-0.34"),
    ("", "vllm-0.34"), ("issue-48412", "vllm-0.34"),
])
def test_default_profile_follows_an_installed_vllm_without_importing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, profile: str) -> None:
    import sys

    from kvpolicy.engine import LayoutEngine
    from kvpolicy.policy.releases import default_profile_name

    _fake_vllm(tmp_path, monkeypatch, f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n".encode())
    assert default_profile_name() == profile
    decision = LayoutEngine.default().decide(spec={"num_layers": 2, "num_kv_heads": 2, "head_size": 64})
    assert decision.context.profile == profile
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("metadata_bytes", [
    b"Metadata-Version: 2.1\nName: vllm\n",                      # no Version
    b"Metadata-Version: 2.1\nName: vllm\nVersion: \xff\xfe\n",   # not UTF-8: was a UnicodeDecodeError
])
def test_a_broken_vllm_install_falls_back_to_the_newest_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metadata_bytes: bytes) -> None:
    from kvpolicy.policy.releases import default_profile_name, installed_vllm_version, profile_names

    _fake_vllm(tmp_path, monkeypatch, metadata_bytes)
    assert installed_vllm_version() is None
    assert default_profile_name() == profile_names()[0] == "vllm-0.34"


def test_a_bad_env_version_is_located_at_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpolicy.policy import InputError
    from kvpolicy.policy.releases import get_profile

    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "garbage")
    with pytest.raises(InputError) as info:
        get_profile()
    [d] = info.value.diagnostics
    assert d.file == "KVPOLICY_VLLM_VERSION" and d.code == "unknown-vllm-version" and "`garbage`" in d.message
    assert get_profile("0.34.0").name == "vllm-0.34"  # an explicit version does not read the variable


@pytest.mark.parametrize("verb", [["dry-run"], ["validate"], ["test"], ["lint", "--max-inputs", "1"]])
def test_cli_bad_env_version(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                             verb: list[str]) -> None:
    from kvpolicy.engine.cli.main import main

    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "garbage")
    assert main(verb) == 2
    err = capsys.readouterr().err
    assert err.startswith("KVPOLICY_VLLM_VERSION: error[unknown-vllm-version]") and "Traceback" not in err
    # an explicit --vllm-version wins over the variable (dry-run's engine read it regardless)
    assert main([*verb, "--vllm-version", "issue-48412"]) == 0, capsys.readouterr().err


# -- settings a release does not have, and the lint space -------------------------------------------


@pytest.mark.parametrize("version", ["0.28.0", "issue-48412"])
@pytest.mark.parametrize("setting", ["hisparse", "enable_extensible_kv_cache"])
def test_a_setting_the_release_lacks_is_refused(version: str, setting: str) -> None:
    from kvpolicy.engine.inputs import build_context
    from kvpolicy.policy import InputError

    with pytest.raises(InputError) as info:
        build_context(spec={"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, vllm_version=version,
                      connector="OffloadingConnector", **{setting: True})
    [d] = info.value.diagnostics
    assert d.file == setting and d.code == "unsupported-option" and "vllm-0.34" in d.help, d.render()
    # unset (false) is what the release has: fine
    build_context(spec={"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, vllm_version=version,
                  **{setting: False})


def test_cli_setting_the_release_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy.engine.cli.main import main

    assert main(["dry-run", "--vllm-version", "0.28.0", "--enable-extensible-kv-cache"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("--enable-extensible-kv-cache: error[unsupported-option]: vLLM 0.28.0 has no"), err


@pytest.mark.parametrize("version", ["0.34.0", "0.28.0", "issue-48412"])
def test_every_lint_input_is_one_the_release_can_have(version: str) -> None:
    """The space of a rule set that reads every option: each input rebuilds through build_context (vLLM 0.28
    takes only NHD/HND for VLLM_KV_CACHE_LAYOUT and has no HiSparse or extensible KV cache)."""
    import random

    from kvpolicy.engine.analysis.space import build_space
    from kvpolicy.engine.inputs import build_context
    from kvpolicy.policy import load_rules_from_texts
    from kvpolicy.policy.releases import get_profile

    reads_all = load_rules_from_texts({"global.yaml": "version: 1\nrules:\n" + "".join(
        f"  - id: r{i}\n    description: d\n    when: {{field: env.VLLM_KV_CACHE_LAYOUT, eq: {v}}}\n"
        f"    prefer: {{layout: LBNHC}}\n" for i, v in enumerate(["LBHNC", "BLNHC", "NHD", "HND"]))
        + "  - id: h\n    description: d\n    when: {field: attention.hisparse, eq: true}\n"
        "    prefer: {layout: LBHNC}\n"
        "  - id: e\n    description: d\n    when: {field: cache.enable_extensible_kv_cache, eq: true}\n"
        "    prefer: {layout: LBHNC}\n"})
    profile = get_profile(version)
    space = build_space(reads_all, vllm_version=version, backends=["TRITON_ATTN"])
    layouts = {i.context.options.kv_cache_layout for i in space.inputs} - {None}
    assert layouts == set(profile.kv_cache_layout_values()) & {"LBHNC", "BLNHC", "NHD", "HND"}
    for inp in random.Random(0).sample(space.inputs, min(300, len(space.inputs))):
        ctx = inp.context
        again = build_context(groups=ctx.groups, attention_backend=ctx.backend.name, vllm_version=version,
                              connector=ctx.connector, device_capability=ctx.options.device_capability,
                              vllm_kv_cache_layout=ctx.options.kv_cache_layout, hisparse=ctx.options.hisparse,
                              enable_extensible_kv_cache=ctx.options.enable_extensible_kv_cache)
        assert again == ctx


# -- empty values are values, not "unset" -----------------------------------------------------------


@pytest.mark.parametrize(("flags", "where", "code"), [
    (["--backend", ""], "--attention-backend", "unknown-backend"),             # was: TRITON_ATTN, silently
    (["--kv-cache-dtype", ""], "--kv-cache-dtype", "unknown-kv-cache-dtype"),  # was: the example's dtype
    (["--vllm-kv-cache-layout", ""], "--vllm-kv-cache-layout", "unknown-layout"),  # was: unset
    (["--vllm-kv-cache-layout", "", "--vllm-version", "0.28.0"], "--vllm-kv-cache-layout", "unknown-layout"),
])
def test_cli_empty_values_are_errors(capsys: pytest.CaptureFixture[str], flags: list[str], where: str,
                                     code: str) -> None:
    from kvpolicy.engine.cli.main import main

    args = ["dry-run", *flags] if "--vllm-version" in flags else ["dry-run", "--vllm-version", "0.34.0", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{where}: error[{code}]"), err


def test_an_empty_vllm_kv_cache_layout_is_refused_as_vllm_does() -> None:
    from kvpolicy.engine.inputs import build_context
    from kvpolicy.policy import InputError

    for version in ("0.34.0", "0.28.0", "issue-48412"):
        with pytest.raises(InputError) as info:
            build_context(spec={"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, vllm_version=version,
                          vllm_kv_cache_layout="")
        assert info.value.diagnostics[0].message == "VLLM_KV_CACHE_LAYOUT is set but empty, which vLLM refuses"


@pytest.mark.parametrize("config", ['{"a": NaN}', '{"a": 1e400}', '{"a": -Infinity}', '{"a": {"b": NaN}}',
                                    '{"connectors": [{"kv_connector": "NixlConnector", '
                                    '"kv_connector_extra_config": {"x": NaN}}]}'])
def test_non_finite_connector_config_is_refused_so_the_json_stays_json(
        capsys: pytest.CaptureFixture[str], config: str) -> None:
    import json

    from kvpolicy.engine.cli.main import main

    connector = "MultiConnector" if "connectors" in config else "NixlConnector"
    assert main(["dry-run", "--vllm-version", "0.34.0", "--format", "json", "--connector", connector,
                 "--connector-config", config]) == 2
    out, err = capsys.readouterr()
    data = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    [d] = data["error"]["diagnostics"]
    assert d["file"].startswith("--connector-config") and "not a number a rule can compare" in d["message"], err


# -- byte addresses at the edges ---------------------------------------------------------------------


class _NumpyLikeInt:
    """What numpy.int64 / a 0-d torch tensor offer: ``__index__``, not an ``int`` subclass."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def _plan(version: str = "0.34.0", **inputs):
    from kvpolicy.engine import LayoutEngine

    inputs.setdefault("spec", {"num_layers": 3, "num_kv_heads": 2, "head_size": 64, "block_size": 4})
    return LayoutEngine.default(version).plan(num_blocks=5, **inputs)


def test_numpy_like_indices_address_the_same_cell() -> None:
    plan = _plan(kv_cache_dtype="fp8_per_token_head")
    args = (2, 1, 4, 3, 1)  # the last cell
    wrapped = tuple(_NumpyLikeInt(a) for a in args)
    assert plan.cell_offset(*wrapped) == plan.cell_offset(*args)
    assert plan.scale_offset(*wrapped) == plan.scale_offset(*args)


@pytest.mark.parametrize("bad", [True, False, 0.0, 1.5, "0", None, [0]])
@pytest.mark.parametrize("position", range(5))
def test_a_non_integer_index_says_so(bad: object, position: int) -> None:
    from kvpolicy.policy import InputError

    plan = _plan()
    args: list[object] = [0, 0, 0, 0, 0]
    args[position] = bad
    name = ("layer", "kv", "block", "token", "head")[position]
    with pytest.raises(InputError) as info:
        plan.cell_offset(*args)
    [d] = info.value.diagnostics
    assert (d.file, d.code) == (name, "invalid-index") and "must be an integer" in d.message, d.render()


def test_out_of_range_indices_share_one_code() -> None:
    from kvpolicy.policy import InputError

    plan = _plan()
    for args in ((3, 0, 0, 0, 0), (-1, 0, 0, 0, 0), (0, 2, 0, 0, 0), (0, 0, 5, 0, 0), (0, 0, 0, 4, 0),
                 (0, 0, 0, 0, 2), (0, 0, -1, 0, 0), (0, 0, 10**30, 0, 0)):
        with pytest.raises(InputError) as info:
            plan.cell_offset(*args)
        assert info.value.diagnostics[0].code == "out-of-range", args


def test_any_integer_index_addresses_a_cell_inside_its_buffer_or_is_out_of_range() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvpolicy.policy import InputError

    plans = [_plan(v, kv_cache_dtype=d, attention_backend=b) for v, b, d in (
        ("0.34.0", "TRITON_ATTN", "fp8_per_token_head"), ("0.34.0", "CPU_ATTN", "fp8"),
        ("0.28.0", "TRITON_ATTN", "int4_per_token_head"), ("issue-48412", "TRITON_ATTN", "int8_per_token_head"))]
    plans += [_plan("0.34.0", spec={"kind": "mla", "num_layers": 3, "num_kv_heads": 1, "head_size": 64,
                                    "block_size": 4}, attention_backend="FLASHMLA")]
    small = st.integers(min_value=-3, max_value=7) | st.integers()

    @settings(max_examples=400, deadline=None)
    @given(st.sampled_from(plans), small, small, small, small, small)
    def check(plan, layer, kv, block, token, head) -> None:
        try:
            buf, off = plan.cell_offset(layer, kv, block, token, head)
        except InputError as exc:
            assert exc.diagnostics[0].code == "out-of-range"
            return
        assert 0 <= off and off + plan.spec.cell_bytes <= plan.buffers[buf].nbytes
        if plan.spec.per_token_head:
            assert plan.scale_offset(layer, kv, block, token, head) == (buf, off + plan.spec.data_bytes_per_head)

    check()


# -- rule files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["'yes'", "1", "'true'", "0", "'no'"])
def test_pattern_properties_take_booleans_only(value: str) -> None:
    """A condition on a boolean field refuses `1` (type-mismatch); a pattern property took it, and `'no'`."""
    from kvpolicy.policy import RuleLoadError, load_rules_from_texts

    text = f"version: 1\nrules:\n  - id: a\n    description: d\n    forbid: {{block_outermost: {value}}}\n"
    with pytest.raises(RuleLoadError) as info:
        load_rules_from_texts({"global.yaml": text})
    [d] = info.value.diagnostics
    assert (d.line, d.col) == (5, 31) and "expected a valid boolean" in d.message, d.render()


def test_a_misspelt_profile_in_a_condition_is_an_error_not_a_dead_rule() -> None:
    from kvpolicy.policy import RuleLoadError, load_rules_from_texts

    text = ("version: 1\nrules:\n  - id: a\n    description: d\n    when: {field: vllm.profile, eq: vllm-0.3}\n"
            "    forbid: {layout: LBHNC}\n")
    with pytest.raises(RuleLoadError) as info:
        load_rules_from_texts({"global.yaml": text})
    [d] = info.value.diagnostics
    assert d.code == "unknown-value" and d.help.startswith("did you mean `vllm-0.34`?"), d.render()


# -- decide() keywords: wrong types and conflicts are located at the keyword the user gave -----------------


_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 64}


@pytest.mark.parametrize(("inputs", "where", "message"), [
    ({"model": 5}, "model", "`model` must be a path"),                  # was located at `config`
    ({"model": ["config.json"]}, "model", "`model` must be a path"),
    ({"spec": _SPEC, "connector_config": []}, "connector_config", "must be a mapping"),  # were silently ignored
    ({"spec": _SPEC, "connector_config": ""}, "connector_config", "must be a mapping"),
    ({"spec": _SPEC, "connector_config": 0}, "connector_config", "must be a mapping"),
    ({"spec": _SPEC, "worker_attention_backends": [["FLASHMLA"], ["FLASHINFER"]]},  # was located at `backend`
     "worker_attention_backends[0]", "does not fit a `full` KV spec"),
    ({"spec": _SPEC, "worker_attention_backends": [[], ["TRITON_MLA"]]},
     "worker_attention_backends[1]", "does not fit a `full` KV spec"),
])
def test_keyword_mistakes_are_located_at_the_keyword(inputs: dict, where: str, message: str) -> None:
    from kvpolicy.engine import LayoutEngine
    from kvpolicy.policy import InputError

    with pytest.raises(InputError) as info:
        LayoutEngine.default("0.34.0").decide(**inputs)
    [d] = info.value.diagnostics
    assert d.file == where and message in d.message, d.render()


def test_the_backend_alias_may_repeat_the_name_in_another_case() -> None:
    from kvpolicy.engine import LayoutEngine
    from kvpolicy.engine.policy_tests import CaseInput

    engine = LayoutEngine.default("0.34.0")
    same = engine.decide(spec=_SPEC, attention_backend="FLASHINFER", backend="flashinfer")
    assert same.context.backend.name == "FLASHINFER"
    assert CaseInput(spec=_SPEC, attention_backend="FLASHINFER", backend="flashinfer").backend == "flashinfer"


# -- property: any value for any decide() keyword decides or raises a PolicyError ---------------------------


def _hostile_values():
    from hypothesis import strategies as st

    from kvpolicy.policy.layouts import Layout
    from kvpolicy.policy.releases import iter_profiles

    known = sorted({b for p in iter_profiles() for b in p.backends} | {d for p in iter_profiles()
                                                                          for d in p.kv_cache_dtypes}
                   | {c for p in iter_profiles() for c in p.connectors} | {x.value for x in Layout}
                   | {"NHD", "HND", "none", "cpu", "cuda",
                      "stride_aware", "assume_per_layer_contiguous", "0.34.0", "0.28.0",
                      "issue-48412", "vllm-0.34"})
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2, 130) | st.floats(allow_nan=True)
               | st.text(max_size=12) | st.sampled_from(known))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6) | st.sampled_from(["connectors", "kv_connector"]),
                                          inner, max_size=3), max_leaves=6)


_KEYWORDS = ("spec", "kv_cache_dtype", "block_size", "attention_backend", "backend", "worker_attention_backends",
             "scale_views", "connector", "connector_config", "kv_transfer_config",
             "vllm_kv_cache_layout", "enable_extensible_kv_cache",
             "hisparse", "device", "device_capability", "use_v2_model_runner", "tensor_parallel_size", "vllm_version",
             "model", "dtype", "allow_chunked_local_attn_with_hybrid_kv_cache", "disable_hybrid_kv_cache_manager",
             "disable_sliding_window", "cpu",
             "connector_prefers_cross_layer_blocks")


@pytest.mark.parametrize("version", ["0.34.0", "0.28.0", "issue-48412"])
def test_any_value_for_any_keyword_decides_or_is_a_policy_error(version: str) -> None:
    import json
    import os

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvpolicy.engine import LayoutEngine
    from kvpolicy.engine.inputs import INPUT_NAMES
    from kvpolicy.policy import PolicyError

    assert set(_KEYWORDS) | {"groups"} == set(INPUT_NAMES)
    engine = LayoutEngine.default(version)
    base = {"spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 64}}

    examples = int(os.environ.get("KVPOLICY_FUZZ_EXAMPLES", "300"))

    spec_fields = st.dictionaries(st.sampled_from(["kind", "num_layers", "block_size", "num_kv_heads", "head_size",
                                                   "dtype", "kv_cache_dtype", "sliding_window", "page_size_padded"]),
                                  _hostile_values() | st.sampled_from(["mla", "mamba", "sliding_window", "float16"]),
                                  max_size=3)

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(_KEYWORDS), _hostile_values(), min_size=1, max_size=3), spec_fields)
    def check(changes: dict, spec_changes: dict) -> None:
        inputs = {**base, **changes}
        if spec_changes and "spec" not in changes:
            inputs["spec"] = {**base["spec"], **spec_changes}
        if "model" in changes:
            inputs.pop("spec", None)
        try:
            first = engine.decide(explain=False, **inputs)
        except PolicyError as exc:
            assert exc.diagnostics and all(d.file and d.message for d in exc.diagnostics), exc.render()
            return
        again = engine.decide(**inputs)  # deterministic, with or without the trace
        assert (again.layout, again.ranking, again.warnings) == (first.layout, first.ranking, first.warnings)
        json.dumps(first.to_dict(), allow_nan=False)  # the dry-run JSON stays JSON

    check()


# -- concurrency ---------------------------------------------------------------------------------------------


def test_threads_deciding_while_another_reloads_agree_with_one_thread() -> None:
    """decide() with keyword inputs of the 0.34 profile (workers, capability, HiSparse, extensible, layouts)
    from many threads on one engine while another thread reloads it: every answer equals the one-thread one."""
    import itertools
    import random
    import threading

    from kvpolicy.engine import LayoutEngine
    from kvpolicy.engine.layout_engine import shipped_rules_dir
    from kvpolicy.policy import PolicyError

    engine = LayoutEngine.default("0.34.0")
    inputs = [dict(spec=_SPEC, attention_backend=b, connector=c, vllm_kv_cache_layout=lay,
                   enable_extensible_kv_cache=ext, device_capability=cap)
              for b, c, lay, ext, cap in itertools.product(
                  ["TRITON_ATTN", "FLASHINFER", "CPU_ATTN"], [None, "OffloadingConnector", "HiSparseConnector"],
                  [None, "LBHNC", "BLNHC", "HND"], [False, True], [None, 10])]
    inputs += [dict(spec=_SPEC, worker_attention_backends=[["FLASHINFER"], ["FLASH_ATTN", "TRITON_ATTN"]],
                    device_capability=cap, connector="NixlConnector") for cap in (None, 9, 10)]

    def answer(kw: dict) -> tuple:
        try:
            d = engine.decide(explain=False, **kw)
            return d.layout, d.ranking, d.warnings, d.fingerprint
        except PolicyError as exc:
            return type(exc).__name__, exc.render()

    expected = [answer(kw) for kw in inputs]
    stop, problems = threading.Event(), []

    def reloader() -> None:
        while not stop.is_set():
            if engine.reload(shipped_rules_dir("0.34.0")) is not None:
                problems.append("reload failed")

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            i = rng.randrange(len(inputs))
            try:
                got = answer(inputs[i])
            except BaseException as exc:  # anything but a PolicyError is a bug
                problems.append(repr(exc))
                continue
            if got != expected[i]:
                problems.append((i, got, expected[i]))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    reload_thread = threading.Thread(target=reloader)
    reload_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    reload_thread.join(timeout=30)
    assert not problems, problems[:3]


# -- groups get the release's default block size, as a single spec does -------------------------------------


@pytest.mark.parametrize(("version", "block"), [("0.34.0", 64), ("0.28.0", 16)])
def test_group_specs_without_block_size_get_the_release_default(tmp_path: Path, version: str, block: int) -> None:
    """It was `groups[0].spec.block_size: field required`, while a `spec` without it gets the default."""
    from kvpolicy.engine.cli.dry_run import context_from_args
    from kvpolicy.engine.cli.main import build_parser

    groups = ("groups: [{spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}}, "
              "{spec: {kind: sliding_window, sliding_window: 128, num_layers: 4, num_kv_heads: 2, head_size: 64}}]")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(groups + "\n")
    args = build_parser().parse_args(["dry-run", "--spec", str(spec_file), "--vllm-version", version])
    ctx = context_from_args(args)
    assert [g.spec.block_size for g in ctx.groups.groups] == [block, block]
    path = _case_file(tmp_path, groups + f"\nvllm_version: '{version}'", "{layout: LBNHC}")
    run = run_policy_tests(_shipped(version), [path], vllm_version=version)
    [result] = run.results
    assert result.error is None and result.decision.context.kv.block_size == block


# -- deeply nested connector configs -------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [70, 3000])
def test_cli_deep_connector_config_is_an_error_not_a_recursion_error(capsys: pytest.CaptureFixture[str],
                                                                     depth: int) -> None:
    from kvpolicy.engine.cli.main import main

    text = '{"a": ' * depth + "1" + "}" * depth
    assert main(["dry-run", "--vllm-version", "0.34.0", "--connector", "NixlConnector",
                 "--connector-config", text]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("too-deep" in err or "nested too deeply" in err), err[-300:]


def test_api_deep_or_cyclic_connector_config_is_an_error() -> None:
    from kvpolicy.engine import LayoutEngine
    from kvpolicy.policy import InputError

    deep: object = 1
    for _ in range(5000):
        deep = {"a": deep}
    cyclic: dict = {}
    cyclic["self"] = cyclic
    members: dict = {"connectors": [{"kv_connector": "NixlConnector"}]}
    for _ in range(30):
        members = {"connectors": [{"kv_connector": "MultiConnector", "kv_connector_extra_config": members}]}
    engine = LayoutEngine.default("0.34.0")
    for name, config in (("NixlConnector", deep), ("NixlConnector", cyclic), ("MultiConnector", members)):
        with pytest.raises(InputError) as info:
            engine.decide(spec=_SPEC, connector=name, connector_config=config)
        assert info.value.diagnostics[0].code == "too-deep"


@pytest.mark.parametrize(("digits", "message"), [(26, "an integer of 84 bits, outside the 64-bit range"),
                                                 (5000, "the JSON holds an integer too long to read")])
def test_cli_connector_config_integers_past_64_bits_are_refused_said_so(capsys: pytest.CaptureFixture[str],
                                                                        digits: int, message: str) -> None:
    """Past 4,300 digits Python cannot even print the number (a decision's explanation raised ValueError); past
    64 bits the plugin refuses it as well (kvpolicy.policy.connectors.check_extra_config)."""
    from kvpolicy.engine.cli.main import main

    assert main(["dry-run", "--vllm-version", "0.34.0", "--connector", "NixlConnector",
                 "--connector-config", '{"a": ' + "1" * digits + "}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err) < 2000, err[-300:]


def test_cli_a_version_too_long_to_convert_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy.engine.cli.main import main

    assert main(["validate", "--vllm-version", "0." + "9" * 5000]) == 2
    err = capsys.readouterr().err
    assert "error[unknown-vllm-version]" in err and "(5002 characters)" in err and "Traceback" not in err
