"""Release profiles: a profile file states what differs from the profile it extends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.policy import releases
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
    monkeypatch.setattr(releases, "RELEASES_DIR", tmp_path)
    for cached in (releases._profiles, releases.profile_facts):
        cached.cache_clear()
    yield tmp_path
    for cached in (releases._profiles, releases.profile_facts):
        cached.cache_clear()


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


def test_vllm_028_facts_are_unchanged_by_the_gate_family_chain() -> None:
    """vllm-0.28 became `extends: vllm-0.27` (0.24 -> 0.25 -> ... -> 0.28, each stating what its release
    changed): every fact it resolves to is the one its self-contained file stated before, except where it
    extends and its shipped rules, now layers shared by the gate family."""
    before = json.loads((Path(__file__).parent / "snapshots" / "vllm-0.28-facts-before-extends.json").read_text())
    after = get_profile("vllm-0.28").model_dump(mode="json")
    assert {k for k in before if before[k] != after[k]} == {"extends", "rules"}
    assert (before["extends"], before["rules"]) == (None, "vllm-0.28")
    assert after["extends"] == "vllm-0.27"
    assert after["rules"] == ["vllm-gate", "vllm-gate-per-token-head", "vllm-gate-0.28"]


def test_the_gate_family_is_one_forward_chain() -> None:
    chain = ["vllm-0.24", "vllm-0.25", "vllm-0.26", "vllm-0.27", "vllm-0.28"]
    assert [get_profile(n).extends for n in chain] == [None, *chain[:-1]]
    assert get_profile("0.25.1").name == "vllm-0.25" and get_profile("0.27.1").name == "vllm-0.27"
