"""The vLLM plugin and the 0.29+ resolver without vLLM: settings, profile choice, the entry point,
no vLLM import, and the resolver on stand-ins named and shaped like vLLM 0.34's objects.

The conformance tests (tests/conformance/test_v034_plugin.py, test_gate_plugin.py) load the
plugin through vLLM's own loader and call vLLM's own resolution paths.
"""

from __future__ import annotations

import enum
import logging
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_vllm import fake_vllm

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.integrations import vllm_plugin
from kvpolicy.engine.integrations.vllm import StartupError
from kvpolicy.engine.integrations.vllm_plugin import Settings, decided_by, pick_profile
from kvpolicy.engine.integrations.vllm_resolver import kv_cache_groups, make_resolver, resolve, worker_candidates
from kvpolicy.policy import Layout, load_rules_from_texts
from kvpolicy.policy.errors import InputError, RuleLoadError
from kvpolicy.policy.releases import get_profile

ROOT = Path(__file__).resolve().parents[3]
PROFILE = "vllm-0.34"


class KVQuantMode(enum.IntEnum):  # vLLM's names
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    NVFP4 = 5


@dataclass(frozen=True)
class FullAttentionSpec:
    """vLLM 0.34's spec as the engine core receives it (customized by the backend)."""

    block_size: int = 16
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "torch.bfloat16"
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    dcp_sharded: bool = True
    scale_bytes: int = 0

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads

    @property
    def num_states(self) -> int:
        return self.block_size

    @property
    def page_size_bytes(self) -> int:
        elem = 1 if "int8" in self.dtype or "uint8" in self.dtype or "float8" in self.dtype else 2
        return self.page_size_padded or self.num_kv_heads * self.block_size * 2 * (self.head_size * elem
                                                                                   + self.scale_bytes)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 128


@dataclass(frozen=True)
class MambaSpec:
    block_size: int = 16
    page_size_bytes: int = 16384
    num_heads: int = 1
    num_states: int = 1
    dcp_sharded: bool = False


@dataclass(frozen=True)
class HiSparseHotSpec:
    block_size: int = 16
    has_layer_views: bool = False


def config(connector: str | None = None, extra: dict[str, Any] | None = None, *, extensible: bool = False,
           pp: int = 1) -> SimpleNamespace:
    """vLLM's VllmConfig, as far as the resolver reads it."""
    ktc = None if connector is None else SimpleNamespace(kv_connector=connector, kv_connector_extra_config=extra or {})
    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=None, cache_dtype="auto", enable_extensible_kv_cache=extensible),
        kv_transfer_config=ktc, attention_config=SimpleNamespace(backend=None, hisparse_config=None),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        model_config=SimpleNamespace(dtype="torch.bfloat16"))


FLASHINFER = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC"]
DEFAULT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]  # vLLM's _DEFAULT_LAYOUT_PREFERENCE
ENGINE = LayoutEngine.default(PROFILE)


# ---------------------------------------------------------------- settings and profiles


@pytest.mark.parametrize("value, rules", [(None, None), ("", None), ("0", None), ("off", None), ("OFF", None),
                                          ("shipped", "shipped"), (" /etc/kvpolicy ", "/etc/kvpolicy")])
def test_settings_from_the_environment(value: str | None, rules: str | None) -> None:
    env = {} if value is None else {"KVPOLICY_RULES": value}
    assert Settings.from_env(env).rules == rules
    assert Settings.from_env({**env, "KVPOLICY_EXPLAIN": "1"}).explain
    assert not Settings.from_env({**env, "KVPOLICY_EXPLAIN": "0"}).explain
    assert Settings.from_env({**env, "KVPOLICY_VLLM_PROFILE": "vllm-0.34"}).profile == "vllm-0.34"


def test_the_running_version_picks_the_profile() -> None:
    assert pick_profile("0.34.0").name == "vllm-0.34"
    assert pick_profile("0.34.0+cu129").name == "vllm-0.34"
    assert pick_profile("0.28.0").name == "vllm-0.28"
    assert pick_profile("0.33.1") is None and pick_profile("0.35.0") is None and pick_profile("0.22.0") is None
    assert pick_profile("0.33.1", "vllm-0.34").name == "vllm-0.34"  # the operator forces one
    with pytest.raises(vllm_plugin.PluginError, match="names no kvpolicy release profile") as exc:
        pick_profile("0.33.1", "vllm-9")
    # located at the variable the operator set, with the profiles to choose from
    assert exc.value.diagnostics[0].file == "KVPOLICY_VLLM_PROFILE"
    assert "vllm-0.34 (0.34.0)" in exc.value.render() and "vllm-0.28 (0.28.0)" in exc.value.render()


@pytest.mark.parametrize("value", ["maybe", "2", "enable", "ja"])
def test_an_explain_setting_that_is_no_boolean_stops_start_up_named(value: str) -> None:
    with pytest.raises(vllm_plugin.PluginError) as exc:
        Settings.from_env({"KVPOLICY_RULES": "shipped", "KVPOLICY_EXPLAIN": value})
    text = exc.value.render()
    assert text.startswith(f"kvpolicy: KVPOLICY_EXPLAIN={value!r} is not a valid setting")
    assert "KVPOLICY_EXPLAIN: error[invalid-setting]" in text and "help: set it to 1" in text
    # unconfigured, the plugin reads nothing else and changes nothing
    assert Settings.from_env({"KVPOLICY_EXPLAIN": value}).rules is None
    for ok in ("1", "true", "YES", "on", "0", "false", "no", "off", " "):
        Settings.from_env({"KVPOLICY_RULES": "shipped", "KVPOLICY_EXPLAIN": ok})


def test_setting_errors_name_their_variable_and_leave_nothing_installed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with fake_vllm(tmp_path / "site") as vllm:
        from vllm.v1.attention.backends import utils
        from vllm.v1.engine import core

        original = utils.resolve_kv_cache_layout
        monkeypatch.setenv("KVPOLICY_RULES", "shipped")
        vllm_plugin.register()
        assert vllm_plugin.status()["active"] and core.resolve_kv_cache_layout is not original
        for variable, value, where in [("KVPOLICY_EXPLAIN", "maybe", "KVPOLICY_EXPLAIN: error[invalid-setting]"),
                                       ("KVPOLICY_VLLM_PROFILE", "vllm-9", "KVPOLICY_VLLM_PROFILE: error[invalid")]:
            monkeypatch.setenv(variable, value)
            with caplog.at_level(logging.ERROR, logger="vllm.kvpolicy"), pytest.raises(vllm_plugin.PluginError) as exc:
                vllm_plugin.register()
            assert where in exc.value.render() and where in caplog.text
            assert vllm_plugin.status() == {"active": False}
            assert core.resolve_kv_cache_layout is original and utils.resolve_kv_cache_layout is original
            monkeypatch.delenv(variable)
            vllm_plugin.register()
            assert vllm_plugin.status()["active"]
        assert vllm.__version__ == "0.34.0"


def test_a_rule_directory_that_does_not_load_names_the_variable_and_the_directory_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with fake_vllm(tmp_path / "site"):
        monkeypatch.setenv("KVPOLICY_RULES", "site-rules")  # relative: this process's working directory
        with pytest.raises(RuleLoadError) as exc:
            vllm_plugin.register()
        text = exc.value.render()
        assert text.startswith(f"kvpolicy: the rules in KVPOLICY_RULES=site-rules (read as {tmp_path}/site-rules) "
                               "do not load; vLLM must not start")
        assert f"{tmp_path}/site-rules: error[no-rules-dir]: not a directory" in text
        shutil.copytree(ROOT / "rules" / PROFILE, tmp_path / "site-rules")
        vllm_plugin.register()
        # layered on the running release's shipped rules (the copy restates them: one layer's worth of rules)
        assert vllm_plugin.status()["rules"] == f"rules/{PROFILE} + {tmp_path / 'site-rules'}"


def test_not_configured_register_changes_nothing_and_never_imports_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOLICY_RULES", raising=False)
    vllm_plugin.register()
    vllm_plugin.register()
    assert vllm_plugin.status() == {"active": False}
    code = ("import sys, kvpolicy.engine, kvpolicy.engine.integrations.vllm_plugin as p\n"
            "import kvpolicy.engine.integrations.vllm_resolver\n"
            "p.register()\nprint(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVPOLICY_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_an_engine_of_a_release_without_the_gate_is_a_configuration_error() -> None:
    from kvpolicy.engine.integrations.vllm import use_uniform_kv_cache

    group = SimpleNamespace(kv_cache_spec=FullAttentionSpec(), backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"),
                            layer_names=["l0"])
    with pytest.raises(InputError, match="has no use_uniform_kv_cache gate"):
        use_uniform_kv_cache([[group]], None, engine=ENGINE)


def test_the_entry_point_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {
        "kvpolicy": "kvpolicy.engine.integrations.vllm_plugin:register"}
    assert callable(vllm_plugin.register)


def test_no_module_imports_vllm_at_module_level() -> None:
    for name in ("vllm.py", "vllm_resolver.py", "vllm_plugin.py"):
        source = (ROOT / "engine" / "integrations" / name).read_text()
        top = [line for line in source.splitlines() if line.startswith(("import vllm", "from vllm"))]
        assert not top, (name, top)


# ---------------------------------------------------------------- the resolver's inputs


def test_workers_reports_merge_as_vllm_merges_them() -> None:
    release = get_profile(PROFILE)
    assert worker_candidates(release, [FLASHINFER]) == tuple(Layout(x) for x in FLASHINFER)
    # a worker whose backends declared nothing reports the default preference and does not vote
    assert worker_candidates(release, [DEFAULT, ["LBHNC"]]) == (Layout.LBHNC,)
    assert worker_candidates(release, [["LBNHC"], ["LBHNC"]]) == ()
    assert worker_candidates(release, [["LBHNC", "BLHNC"], ["BLHNC", "LBHNC"]]) == (Layout.LBHNC, Layout.BLHNC)
    with pytest.raises(InputError, match="reported no supported"):
        worker_candidates(release, [[]])
    with pytest.raises(InputError, match="not all of which"):
        worker_candidates(release, [["LBHNC", "XYZ"]])


def test_specs_become_one_group_per_distinct_spec() -> None:
    a, b = FullAttentionSpec(), SlidingWindowSpec(num_kv_heads=4)
    # two tensor-parallel workers of one stage report the same 3 layers of `a` and one of `b`
    groups = kv_cache_groups([a, a, a, b, a, a, a, b, HiSparseHotSpec()], workers_per_stage=2)
    assert groups is not None and [(g.spec.kind.value, g.spec.num_layers) for g in groups.groups] == [
        ("full", 3), ("sliding_window", 1)]
    assert groups.mixed_hnc_shapes
    assert kv_cache_groups([HiSparseHotSpec()]) is None  # nothing with per-layer views
    mamba = kv_cache_groups([a, MambaSpec()])
    assert mamba is not None and mamba.groups[1].spec.page_size_bytes == 16384 and mamba.has_mamba
    pth = FullAttentionSpec(dtype="torch.uint8", kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD, scale_bytes=4)
    spec = kv_cache_groups([pth]).groups[0].spec
    assert (spec.kv_cache_dtype, spec.page_size_bytes) == ("fp8_per_token_head", pth.page_size_bytes)
    assert kv_cache_groups([FullAttentionSpec(dcp_sharded=False)]).groups[0].dcp_sharded is False


def test_a_spec_without_slot_mapping_takes_no_part_in_the_dcp_check() -> None:
    @dataclass(frozen=True)
    class CircularBufferSpec(FullAttentionSpec):  # addresses its own pages, as vLLM's ring buffers do
        uses_slot_mapping: bool = False

    ring = CircularBufferSpec(head_size=64, dcp_sharded=False)
    groups = kv_cache_groups([FullAttentionSpec(), ring])
    assert [g.dcp_sharded for g in groups.groups] == [True, True] and not groups.dcp_mixed_page_sizes
    assert kv_cache_groups([FullAttentionSpec(), FullAttentionSpec(head_size=64, dcp_sharded=False)]
                           ).dcp_mixed_page_sizes


def test_a_spec_kvpolicy_models_differently_is_refused() -> None:
    wrong = FullAttentionSpec(dtype="torch.uint8", kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)  # no scale bytes
    with pytest.raises(InputError, match="kvpolicy's model of it") as exc:
        kv_cache_groups([wrong])
    assert exc.value.diagnostics[0].code == "spec-not-modelled"


# ---------------------------------------------------------------- deciding


def test_resolve_decides_from_vllms_inputs() -> None:
    d = resolve(ENGINE, config("OffloadingConnector"), [FLASHINFER], [FullAttentionSpec()])
    assert d is not None and d.layout is Layout.LBHNC and d.context.connector.name == "OffloadingConnector"
    assert "offloading-requires-lbhnc" in decided_by(d) and "OffloadingConnector.yaml:" in decided_by(d)
    plain = resolve(ENGINE, config(), [FLASHINFER], [FullAttentionSpec()])
    assert plain.layout is Layout.LBNHC and decided_by(plain).startswith("the first candidate")
    env = resolve(ENGINE, config("OffloadingConnector"), [FLASHINFER], [FullAttentionSpec()],
                  vllm_kv_cache_layout="BLNHC")
    assert env.layout is Layout.BLNHC
    mixed = resolve(ENGINE, config(), [DEFAULT], [FullAttentionSpec(), SlidingWindowSpec(num_kv_heads=4)])
    assert mixed.layout is Layout.LBNHC and "mixed-hnc-shapes-need-block-compact" in decided_by(mixed)
    assert resolve(ENGINE, config(), [DEFAULT], [HiSparseHotSpec()]) is None


def test_no_layout_stops_start_up_with_the_rules_located() -> None:
    with pytest.raises(StartupError) as exc:
        resolve(ENGINE, config(), [FLASHINFER], [FullAttentionSpec()], vllm_kv_cache_layout="LHBNC")
    text = str(exc.value)
    assert isinstance(exc.value, ValueError)  # what vLLM's own resolution raises
    assert text.startswith("kvpolicy: no KV cache layout survives the rules; vLLM must not start")
    assert "rules/vllm-0.34/global.yaml:" in text and "rule `env-layout-lhbnc`" in text
    assert "rule `release-candidates`" in text


def test_what_kvpolicy_cannot_describe_stops_start_up() -> None:
    nvfp4 = FullAttentionSpec(dtype="torch.uint8", kv_quant_mode=KVQuantMode.NVFP4, page_size_padded=18432)
    with pytest.raises(StartupError, match="cannot describe vLLM's KV cache layout inputs") as exc:
        resolve(ENGINE, config(), [DEFAULT], [nvfp4])
    assert exc.value.diagnostics[0].code == "unknown-quant-mode"


def test_a_connector_without_rules_keeps_its_required_layout() -> None:
    asked: list[Any] = []

    def required(vllm_config: Any = None) -> str:
        asked.append(vllm_config)
        return "BLHNC"

    d = resolve(ENGINE, config("MyStoreConnector"), [DEFAULT], [FullAttentionSpec()], connector_layout=required)
    assert d.layout is Layout.BLHNC and "vllm-own-layout.mystoreconnector" in decided_by(d)
    assert "<vllm:MyStoreConnector.get_required_kvcache_layout>" in decided_by(d)
    # VLLM_KV_CACHE_LAYOUT wins over it, as in vLLM
    assert resolve(ENGINE, config("MyStoreConnector"), [DEFAULT], [FullAttentionSpec()], connector_layout=required,
                   vllm_kv_cache_layout="LBHNC").layout is Layout.LBHNC
    # a connector the rules know is decided by its rules; vLLM's answer is not asked for
    asked.clear()
    resolve(ENGINE, config("OffloadingConnector"), [DEFAULT], [FullAttentionSpec()], connector_layout=required)
    assert asked == []


def test_a_connector_may_require_a_legacy_head_order_name() -> None:
    """vLLM 0.34 still reads NHD/HND as LBNHC/LBHNC (its get_required_kvcache_layout docstring still says
    "e.g. HND, or NHD"): a third-party connector asking for HND gets LBHNC, as without kvpolicy."""
    d = resolve(ENGINE, config("MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                connector_layout=lambda: "HND")
    assert d.layout is Layout.LBHNC and "vllm-own-layout.mystoreconnector" in decided_by(d)
    assert resolve(ENGINE, config("MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                   connector_layout=lambda: "NHD").layout is Layout.LBNHC


def test_a_connector_requiring_a_layout_vllm_does_not_know_stops_start_up_located() -> None:
    with pytest.raises(StartupError) as exc:  # vLLM: ValueError("Unknown KV cache layout 'XYZ'")
        resolve(ENGINE, config("MyStoreConnector"), [DEFAULT], [FullAttentionSpec()], connector_layout=lambda: "XYZ")
    assert exc.value.diagnostics[0].location == "<vllm:MyStoreConnector.get_required_kvcache_layout>"
    assert exc.value.diagnostics[0].code == "unknown-layout" and "returned `XYZ`" in str(exc.value)
    # asked only while VLLM_KV_CACHE_LAYOUT is unset, as vLLM asks
    assert resolve(ENGINE, config("MyStoreConnector"), [DEFAULT], [FullAttentionSpec()], connector_layout=lambda: "XYZ",
                   vllm_kv_cache_layout="LBHNC").layout is Layout.LBHNC


def _multi(*names: str) -> SimpleNamespace:
    return config("MultiConnector", {"connectors": [{"kv_connector": n} for n in names]})


def test_multiconnector_members_without_rules_keep_their_required_layouts() -> None:
    """vLLM's MultiConnector.get_required_kvcache_layout asks every member; a member the rules have no
    file for keeps its answer (in its own scope), as a plain connector without rules does."""
    asked: list[int] = []

    def members(answers: dict[str, str | None]):
        def reported() -> list[tuple[str, Any]]:
            asked.append(1)
            return list(answers.items())
        return reported

    d = resolve(ENGINE, _multi("MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                connector_layouts=members({"MyStoreConnector": "BLHNC"}))
    assert d.layout is Layout.BLHNC and "<vllm:MyStoreConnector.get_required_kvcache_layout>" in decided_by(d)
    # with a member the rules know (OffloadingConnector prefers LBHNC): both ask for it
    d = resolve(ENGINE, _multi("OffloadingConnector", "MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                connector_layouts=members({"OffloadingConnector": "LBHNC", "MyStoreConnector": "LBHNC"}))
    assert d.layout is Layout.LBHNC
    d = resolve(ENGINE, _multi("MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                connector_layouts=members({"MyStoreConnector": "HND"}))
    assert d.layout is Layout.LBHNC
    # members that disagree, even only in how they write it: vLLM's "KV cache layout mismatch"
    for other in ("BLHNC", "HND"):
        with pytest.raises(StartupError, match="require different KV cache layouts") as exc:
            resolve(ENGINE, _multi("OffloadingConnector", "MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                    connector_layouts=members({"OffloadingConnector": "LBHNC", "MyStoreConnector": other}))
        assert [d.location for d in exc.value.diagnostics] == [
            "<vllm:MyStoreConnector.get_required_kvcache_layout>",
            "<vllm:OffloadingConnector.get_required_kvcache_layout>"]
        assert {d.code for d in exc.value.diagnostics} == {"layout-mismatch"}
    # a member without a requirement, VLLM_KV_CACHE_LAYOUT set, or every member known: nothing asked
    asked.clear()
    assert resolve(ENGINE, _multi("MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                   connector_layouts=members({"MyStoreConnector": None})).layout is Layout.LBNHC
    assert len(asked) == 1
    resolve(ENGINE, _multi("MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()], vllm_kv_cache_layout="LBHNC",
            connector_layouts=members({"MyStoreConnector": "BLHNC"}))
    resolve(ENGINE, _multi("OffloadingConnector"), [FLASHINFER], [FullAttentionSpec()],
            connector_layouts=members({"OffloadingConnector": "BLHNC"}))
    assert len(asked) == 1
    # two members of one name that require different layouts (vLLM: mismatch)
    with pytest.raises(StartupError, match="require different KV cache layouts"):
        resolve(ENGINE, _multi("MyStoreConnector", "MyStoreConnector"), [FLASHINFER], [FullAttentionSpec()],
                connector_layouts=lambda: [("MyStoreConnector", "LBHNC"), ("MyStoreConnector", "BLHNC")])


def test_workers_may_report_legacy_head_order_names() -> None:
    release = get_profile(PROFILE)
    assert worker_candidates(release, [["NHD", "HND"]]) == (Layout.LBNHC, Layout.LBHNC)


def _site(rules: str) -> LayoutEngine:
    """An operator's rule set written from scratch (without the shipped rules' copies of vLLM's checks)."""
    return LayoutEngine(load_rules_from_texts({"global.yaml": "version: 1\nrules:\n" + rules}), vllm_version=PROFILE)


PREFER_LHBNC = """
  - id: site-prefers-lhbnc
    description: this site's transfer engine likes heads outside blocks
    prefer: {layout: LHBNC}
    weight: 50
"""


@pytest.mark.parametrize("cfg, specs, requirement", [
    (config(), [FullAttentionSpec(), SlidingWindowSpec(num_kv_heads=4)], "mixed-hnc-shapes-need-block-compact"),
    (config(), [FullAttentionSpec(), FullAttentionSpec(head_size=64, dcp_sharded=False)],
     "dcp-mixed-page-sizes-need-block-outermost"),
    (config("OffloadingConnector", extensible=True), [FullAttentionSpec()],
     "extensible-kv-cache-with-connector-needs-block-compact"),
])
def test_rules_without_vllms_own_checks_cannot_hand_vllm_a_layout_it_cannot_use(
        cfg: SimpleNamespace, specs: list[Any], requirement: str) -> None:
    """vLLM narrows its candidates (mixed HNC shapes, DCP with a replicated draft, extensible cache with a
    connector); a rule set without the rules standing for that must not answer outside them."""
    engine = _site(PREFER_LHBNC)
    assert resolve(engine, config(), [DEFAULT], [FullAttentionSpec()]).layout is Layout.LHBNC  # nothing to narrow
    with pytest.raises(StartupError) as exc:
        resolve(engine, cfg, [DEFAULT], specs)
    text = str(exc.value)
    assert text.startswith("kvpolicy: the rules chose LHBNC, which vLLM (profile vllm-0.34) cannot use for this "
                           "model; vLLM must not start:")
    assert "global.yaml:4:5: error[vllm-requirement]: rule `site-prefers-lhbnc` (global) prefers LHBNC" in text
    assert "<vllm:resolve_kv_cache_layout>: error[vllm-requirement]:" in text and f"`{requirement}`" in text
    # the shipped rules carry the requirement: the same inputs get one of vLLM's own candidates
    assert resolve(ENGINE, cfg, [DEFAULT], specs).layout is not Layout.LHBNC


class _Enum:
    """vLLM's KVCacheLayout: members by name."""

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name)


def test_make_resolver_has_vllms_signature_and_records_the_layout() -> None:
    calls: list[Any] = []

    def original(vllm_config: Any, supported: Any, specs: Any = None) -> Any:
        calls.append(vllm_config.cache_config.kv_cache_layout)
        return SimpleNamespace(name=vllm_config.cache_config.kv_cache_layout or "LBNHC")

    seen: list[Any] = []
    resolver = make_resolver(original, ENGINE, layout_type=_Enum(), vllm_kv_cache_layout=lambda: None,
                             device_capability=lambda: 10, on_decision=seen.append)
    cfg = config("NixlConnector")
    assert resolver(cfg, [FLASHINFER], [FullAttentionSpec()]).name == "LBHNC"
    assert cfg.cache_config.kv_cache_layout == "LBHNC" and len(seen) == 1 and calls == []
    assert seen[0].context.options.device_capability == 10
    # a layout already recorded is vLLM's to honour, as its own resolver does
    assert resolver(cfg, [FLASHINFER], [FullAttentionSpec()]).name == "LBHNC" and calls == ["LBHNC"]
    # nothing with per-layer views: vLLM's own answer
    fresh = config()
    assert resolver(fresh, [DEFAULT], [HiSparseHotSpec()]).name == "LBNHC" and calls[-1] is None
    assert resolver.__wrapped__ is original and resolver.__kvpolicy__


def test_the_decision_log_line_is_written_once(caplog: pytest.LogCaptureFixture) -> None:
    d = resolve(ENGINE, config("OffloadingConnector"), [FLASHINFER], [FullAttentionSpec()])
    with caplog.at_level(logging.INFO, logger="vllm.kvpolicy"):
        vllm_plugin._log_decision(d, explain=True)
        vllm_plugin._log_decision(d, explain=True)
    lines = [r.getMessage() for r in caplog.records if "KV cache layout" in r.getMessage()]
    assert len(lines) == 1
    assert "KV cache layout LBHNC (per_layer, HND) decided by prefer `offloading-requires-lbhnc`" in lines[0]
    assert f"fingerprint {d.fingerprint.digest}" in lines[0]
    assert any(r.getMessage().startswith("kvpolicy: explanation\nlayout: LBHNC") for r in caplog.records)


def test_register_from_many_threads_toggling_the_setting_restores_vllm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM calls register once per process and thread, but nothing stops a program from calling it
    from several threads: every (owner, attribute) it replaces must be put back exactly."""
    import os
    import threading

    with fake_vllm(tmp_path / "site"):
        from vllm.v1.attention.backends import utils
        from vllm.v1.engine import core

        original = utils.resolve_kv_cache_layout
        import builtins
        import time

        def slow_setattr(owner: Any, name: str, value: Any) -> None:
            time.sleep(0.0005)  # widen the window between recording an attribute and replacing it
            builtins.setattr(owner, name, value)

        monkeypatch.setattr(vllm_plugin, "setattr", slow_setattr, raising=False)  # shadows the builtin there
        previous = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
        errors: list[BaseException] = []
        barrier = threading.Barrier(8)
        env_lock = threading.Lock()  # os.environ.pop is not atomic

        def toggle(i: int) -> None:
            barrier.wait()
            for j in range(30):
                try:
                    with env_lock:
                        if (i + j) % 3:
                            os.environ["KVPOLICY_RULES"] = "shipped"
                        else:
                            os.environ.pop("KVPOLICY_RULES", None)
                    vllm_plugin.register()
                except BaseException as exc:  # pragma: no cover - what the test looks for
                    errors.append(exc)

        monkeypatch.setenv("KVPOLICY_RULES", "shipped")
        try:
            threads = [threading.Thread(target=toggle, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(previous)
        assert not errors
        os.environ["KVPOLICY_RULES"] = "shipped"
        vllm_plugin.register()
        assert len(vllm_plugin._state["patches"]) == 2
        assert core.resolve_kv_cache_layout is utils.resolve_kv_cache_layout
        assert core.resolve_kv_cache_layout.__wrapped__ is original
        del os.environ["KVPOLICY_RULES"]
        vllm_plugin.register()
        assert core.resolve_kv_cache_layout is original and utils.resolve_kv_cache_layout is original
        assert vllm_plugin._state["patches"] == []
