"""``kvpolicy doctor`` and the plugin's own account of itself (issue 22, class 5): the plugin's setup is
checked without vLLM; status() says why it is inactive; register() reports the settings first."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.engine.integrations import vllm_plugin

BROKEN = ("version: 1\nrules:\n  - id: x\n    description: y\n    when: {field: kv.nope, eq: 1}\n"
          "    forbid: {layout: BHLNC}\n")


@pytest.fixture(autouse=True)
def _plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVPOLICY_RULES", "KVPOLICY_SHIPPED_RULES", "KVPOLICY_EXPLAIN", "KVPOLICY_VLLM_VERSION",
                 "KVPOLICY_VLLM_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    vllm_plugin.unregister()
    vllm_plugin._state["error"] = None


def test_doctor_with_the_plugin_off_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "doctor")
    assert code == 0 and "the plugin is off: KVPOLICY_RULES is not set" in out


def test_doctor_decides_what_the_plugin_would(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0", "--kv-cache-dtype", "auto",
                       "--connector", "NixlConnector", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["active"] and data["profile"] == "vllm-0.34"
    _, dry, _ = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--kv-cache-dtype", "auto",
                    "--connector", "NixlConnector", "--format", "json")
    assert data["decision"]["layout"] == json.loads(dry)["layout"]["name"]
    assert data["decision"]["fingerprint"] == json.loads(dry)["fingerprint"]["digest"]


def test_doctor_lists_every_problem_located(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "global.yaml").write_text(BROKEN)
    monkeypatch.setenv("KVPOLICY_RULES", str(tmp_path / "site"))
    monkeypatch.setenv("KVPOLICY_EXPLAIN", "maybe")
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0")
    assert code == 1 and "KVPOLICY_EXPLAIN: error[invalid-setting]" in out
    monkeypatch.delenv("KVPOLICY_EXPLAIN")
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0")
    assert code == 1 and f"{tmp_path}/site/global.yaml:5:" in out
    assert "error[unknown-field]: unknown field `kv.nope`" in out
    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "0.99")
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    code, out, _ = cli(capsys, "doctor")
    assert code == 1 and "KVPOLICY_VLLM_VERSION: error[invalid-setting]" in out


def test_doctor_reports_every_bad_setting_in_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVPOLICY_RULES", "nope:scratch")
    monkeypatch.setenv("KVPOLICY_EXPLAIN", "maybe")
    monkeypatch.setenv("KVPOLICY_SHIPPED_RULES", "2")
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0", "--format", "json")
    files = [p["file"] for p in json.loads(out)["problems"]]
    assert code == 1 and "KVPOLICY_EXPLAIN" in files and "KVPOLICY_SHIPPED_RULES" in files
    assert any("nope" in p["message"] or "nope" in p["file"] for p in json.loads(out)["problems"])  # the rules too
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0")
    assert code == 1 and "KVPOLICY_EXPLAIN: error[invalid-setting]" in out
    assert "KVPOLICY_SHIPPED_RULES: error[invalid-setting]" in out and "nope" in out


def test_status_says_why_the_plugin_is_inactive(monkeypatch: pytest.MonkeyPatch) -> None:
    status = vllm_plugin.status()
    assert status["active"] is False and "KVPOLICY_RULES is not set" in status["reason"]
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    assert "register() has not run in this process" in vllm_plugin.status()["reason"]
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(vllm_plugin.PluginError):
        vllm_plugin.register()
    assert "register() failed" in vllm_plugin.status()["reason"]
    assert "vLLM cannot be imported here" in vllm_plugin.status()["reason"]


def test_register_reports_the_rules_before_the_missing_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "global.yaml").write_text(BROKEN)
    monkeypatch.setenv("KVPOLICY_RULES", str(tmp_path / "site"))
    monkeypatch.setitem(sys.modules, "vllm", None)
    with caplog.at_level(logging.ERROR, logger="vllm.kvpolicy"), pytest.raises(vllm_plugin.PluginError) as exc:
        vllm_plugin.register()
    codes = [d.code for d in exc.value.diagnostics]
    assert codes[0] == "unknown-field" and codes[-1] == "no-vllm"
    assert "kvpolicy doctor" in exc.value.render()


def test_shipped_is_an_entry_of_the_rules_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`KVPOLICY_RULES=shipped:site` means what `--rules shipped --rules site/` means (docs/rule-layers.md):
    the shipped layers, then the site's; not a directory called `shipped` (issue 22)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "site.yaml").write_text("version: 1\nrules:\n  - id: site-prefers-hnd\n    description: d\n"
                                    "    prefer: {layout: LBHNC}\n")
    monkeypatch.chdir(tmp_path)
    import os
    monkeypatch.setenv("KVPOLICY_RULES", os.pathsep.join(["shipped", "site"]))
    code, out, err = cli(capsys, "doctor", "--vllm-version", "0.34.0", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["ok"], (out, err)
    assert "no-rules-dir" not in out + err
    engine = vllm_plugin._engine(vllm_plugin.Settings.from_env(), vllm_plugin.get_profile("0.34.0"))
    roots = [layer.root for layer in engine.ruleset.layers]
    assert roots[0] == "rules/vllm-0.34" and roots[-1].endswith("site") and len(roots) == 2, roots


def test_a_bad_setting_while_the_plugin_is_off_is_a_warning(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the plugin reads nothing while KVPOLICY_RULES is unset; the day it is set, vLLM would not start
    monkeypatch.delenv("KVPOLICY_RULES", raising=False)
    monkeypatch.setenv("KVPOLICY_UNSTAMPED_BLOCKS", "bogus")
    code, out, _ = cli(capsys, "doctor")
    assert code == 0 and "the plugin is off" in out
    assert "warning: KVPOLICY_UNSTAMPED_BLOCKS: `bogus` is not a setting" in out
    code, out, _ = cli(capsys, "doctor", "--format", "json")
    doc = json.loads(out)
    assert doc["ok"] and [w["file"] for w in doc["warnings"]] == ["KVPOLICY_UNSTAMPED_BLOCKS"]


def test_doctor_names_the_store_folder_of_this_engines_stamp(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator sharing an ExampleConnector store sees where this engine's entries go before it starts:
    the folder the guard names after the stamp (its layer-view digest), under shared_storage_path."""
    from kvpolicy.engine.integrations.vllm_exchange import NAMESPACE_PREFIX

    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0", "--connector", "ExampleConnector",
                       "--connector-config", '{"shared_storage_path": "/srv/kv/"}', "--format", "json")
    folder = json.loads(out)["decision"]["store_folder"]
    assert code == 0 and folder.startswith(f"/srv/kv/{NAMESPACE_PREFIX}")
    assert len(folder) == len("/srv/kv/kvpolicy-") + 20 + 1
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0", "--connector", "ExampleConnector",
                       "--connector-config", '{"shared_storage_path": "/srv/kv"}', "--kv-cache-dtype", "fp8")
    assert "ExampleConnector keeps this engine's blocks in /srv/kv/kvpolicy-" in out
    assert folder not in out  # fp8 cells are other bytes: another folder
    code, out, _ = cli(capsys, "doctor", "--vllm-version", "0.34.0", "--connector", "NixlConnector",
                       "--format", "json")
    assert "store_folder" not in json.loads(out)["decision"]


@pytest.mark.parametrize(("env", "installed", "flags", "said"), [
    ({"KVPOLICY_VLLM_PROFILE": "0.34.0"}, None, [], ["KVPOLICY_VLLM_PROFILE is deprecated; set KVPOLICY_VLLM_VERSION"]),
    ({"KVPOLICY_VLLM_PROFILE": "0.28.1"}, None, [],
     ["KVPOLICY_VLLM_PROFILE is deprecated", "KVPOLICY_VLLM_PROFILE=0.28.1: no release profile lists vLLM 0.28.1"]),
    ({"KVPOLICY_VLLM_VERSION": "0.29.5"}, None, [], ["KVPOLICY_VLLM_VERSION=0.29.5: no release profile lists"]),
    ({}, "0.33.2", [], ["no release profile lists vLLM 0.33.2; deciding with `vllm-0.33`"]),
    ({}, "0.34.0", ["--vllm-version", "0.34.1"], ["--vllm-version 0.34.1: no release profile lists vLLM 0.34.1"]),
    ({}, "0.34.0", [], []),
])
def test_doctor_shows_what_the_plugin_will_warn_about(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], env: dict[str, str],
                                                      installed: str | None, flags: list[str],
                                                      said: list[str]) -> None:
    from types import SimpleNamespace

    import kvpolicy.policy.releases as releases

    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = None if installed is None else SimpleNamespace(distribution="vllm", version=installed)
    monkeypatch.setattr(releases, "installed_vllm_distribution", lambda *a, **k: found)
    code, out, _ = cli(capsys, "doctor", *flags, "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["ok"]
    warnings = [w["message"] for w in data["warnings"]]
    assert len(warnings) == len(said)
    assert all(w.startswith(s) or s in w for w, s in zip(warnings, said))
    if not flags:  # the plugin's own start-up warnings, word for word
        settings = vllm_plugin.Settings.from_env()
        assert warnings == vllm_plugin.startup_warnings(installed or "", settings)
    code, text, _ = cli(capsys, "doctor", *flags)
    assert all(f"  warning: {w}" in text for w in warnings)


def test_dry_run_says_it_does_not_read_kvpolicy_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "global.yaml").write_text("version: 1\nrules: []\n")
    monkeypatch.setenv("KVPOLICY_RULES", str(tmp_path / "site"))
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0")
    assert code == 0
    assert f"note: KVPOLICY_RULES is set (`{tmp_path / 'site'}`), but dry-run does not read it" in err
    assert f"pass `--rules {tmp_path / 'site'}`" in err
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--rules", str(tmp_path / "site"))
    assert code == 0 and "KVPOLICY_RULES" not in err  # the flags name the plugin's rules: nothing to say
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    code, _, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0")
    assert code == 0 and "KVPOLICY_RULES" not in err


@pytest.mark.parametrize("value", ["REFUSE", "Maybe"])
def test_a_bad_unstamped_blocks_setting_is_quoted_as_written(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str], value: str) -> None:
    """`REFUSE` quoted back as `refuse` reads as if `refuse` were the setting refused for another reason: the
    message quotes the operator's own text (the check itself ignores case)."""
    monkeypatch.setenv("KVPOLICY_RULES", "shipped")
    monkeypatch.setenv("KVPOLICY_UNSTAMPED_BLOCKS", value)
    code, out, err = cli(capsys, "doctor")
    assert code == 1 and f"`{value}` is not a setting of KVPOLICY_UNSTAMPED_BLOCKS" in out + err
