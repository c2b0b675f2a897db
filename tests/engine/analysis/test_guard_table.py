"""The packaged load-bearing guards (`kvpolicy.engine.analysis.guards`, ``guard_table.json``).

``KVPOLICY_SHIPPED_RULES=0`` warns for each shipped guard the replacing rules drop; which guards bear load is
a lint of the whole shipped profile, which the vLLM plugin ran in every vLLM process (issue 23: 10 CPU s on
vllm-0.28). The answers are packaged under a key of the shipped rules and the profile's facts: every key must
be current, and the answers equal the live lint (here for the profiles quick to lint; all of them:
``python -m kvpolicy.engine.analysis.guards --check``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.analysis import guards
from kvpolicy.policy.releases import profile_names

# Quick to lint (a few CPU s each); the gate releases 0.24-0.28 take 10-45 s each.
LIVE_CHECKED = ("issue-48412", "vllm-0.34")


def _clear() -> None:
    guards.load_bearing_guards.cache_clear()
    guards._table.cache_clear()


@pytest.fixture(autouse=True)
def fresh_caches():
    _clear()
    yield
    _clear()


@pytest.mark.parametrize("profile", profile_names())
def test_every_profile_has_a_current_entry(profile: str) -> None:
    """A change of the shipped rules or of the profile's facts needs `python -m kvpolicy.engine.analysis.guards
    --write` (a stale entry is linted live: correct, but slow at every vLLM start)."""
    table = json.loads(guards.GUARD_TABLE.read_text(encoding="utf-8"))
    assert table[profile]["key"] == guards.guard_key(profile), (
        f"guard_table.json is stale for `{profile}`: run python -m kvpolicy.engine.analysis.guards --write")


@pytest.mark.parametrize("profile", LIVE_CHECKED)
def test_the_table_holds_what_the_live_lint_finds(profile: str) -> None:
    table = json.loads(guards.GUARD_TABLE.read_text(encoding="utf-8"))
    assert table[profile]["guards"] == [list(row) for row in guards.live_guards(profile)]


def test_the_table_is_not_empty() -> None:
    """The per-token-head guard bears load where the scale views assume per-layer buffers (issue-48412)."""
    table = json.loads(guards.GUARD_TABLE.read_text(encoding="utf-8"))
    assert [rule for rule, _ in table["issue-48412"]["guards"]] == ["per-token-head-forbids-cross-layer"]


@pytest.mark.parametrize("profile", ["vllm-0.28", "issue-48412"])
def test_replacing_the_shipped_rules_lints_nothing_at_start_up(tmp_path: Path, monkeypatch, profile: str) -> None:
    """What the plugin's register() does with KVPOLICY_SHIPPED_RULES=0 and an empty rule directory: the
    dropped-guard warnings come from the table, with no lint of the profile."""
    def no_lint(*_a, **_k):
        raise AssertionError("the shipped profile was linted at start-up")

    monkeypatch.setattr(guards, "lint", no_lint)
    (tmp_path / "global.yaml").write_text("version: 1\nrules: []\n")
    engine = LayoutEngine.from_path(tmp_path, vllm_version=profile, shipped_rules=False)
    dropped = [d for d in engine.ruleset.warnings if d.code == "dropped-guard"]
    table = json.loads(guards.GUARD_TABLE.read_text(encoding="utf-8"))
    assert [d.message.split("`")[1] for d in dropped] == [rule for rule, _ in table[profile]["guards"]]
    assert all(f"load-bearing for `{profile}`" in d.message for d in dropped)


def test_a_stale_entry_is_linted_live(monkeypatch) -> None:
    monkeypatch.setattr(guards, "_table", lambda: {"issue-48412": {"key": "sha256:stale", "guards": []}})
    asked = []
    monkeypatch.setattr(guards, "live_guards", lambda name, shipped=None: asked.append(name) or [])
    assert guards.load_bearing_guards("issue-48412") == () and asked == ["issue-48412"]


def test_the_check_command_names_a_stale_entry(monkeypatch, capsys) -> None:
    """`python -m kvpolicy.engine.analysis.guards --check` (here over one profile) exits 1 naming it."""
    monkeypatch.setattr(guards, "_table", lambda: {"issue-48412": {"key": "sha256:stale", "guards": []}})
    monkeypatch.setattr("kvpolicy.policy.releases.profile_names", lambda: ("issue-48412",))
    assert guards.main(["--check"]) == 1
    assert "`issue-48412` differs from the live lint" in capsys.readouterr().err
