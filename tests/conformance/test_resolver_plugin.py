"""The plugin inside vLLM 0.29-0.33, loaded by each release's own ``load_general_plugins``.

`test_v034_plugin.py` holds 0.34 to every case of its space and every start-up path; for the
older resolver releases (the same hook, ``resolve_kv_cache_layout`` as the engine core calls it,
the same shipped rules) this module checks, per release, in one oracle subprocess
(`oracles/v034_plugin.py`, which runs under each):

- installed but off (``KVPOLICY_RULES`` unset) changes nothing;
- with the shipped rules, one case in `SAMPLE_EVERY` of the release's decision space (the
  `test_v034_decisions.Release` cut) answers what vLLM answers without the plugin, and the
  engine core (``EngineCore._initialize_kv_caches``) distributes the plugin's layout to the
  workers for one case in `CORE_EVERY`;
- a site rule requiring LBHNC decides through vLLM as the rules say, and where it leaves no layout
  start-up stops naming the rule's file:line;
- a rule directory that does not load stops start-up, located, with nothing installed.

The full space goes through kvpolicy in-process in `test_v034_decisions.py`; what this adds is
that the same decisions come out of the plugin inside each release.
"""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import ahead
import plugin_site
import pytest
from test_v034_decisions import RESOLVER_RELEASES, Release, _blamed, _shown, input_space, kvpolicy_inputs, oracle_case
from test_v034_plugin import SITE_BROKEN, SITE_LBHNC, _as_rules_say, _plugin, _plugin_blamed, _rule_dir, _same_as_vllm

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.errors import PolicyError

OLDER = tuple(v for v in RESOLVER_RELEASES if v != "0.34.0")
SAMPLE_EVERY = 11
CORE_EVERY = 397
SITE_EVERY = 23


def _expected(engine: LayoutEngine, case: dict[str, Any], release: Release) -> dict[str, Any]:
    try:
        return {"layout": str(engine.decide(explain=False, **kvpolicy_inputs(case, release)).layout)}
    except PolicyError as exc:
        return {"error": type(exc).__name__, "blamed": _blamed(exc)}


_RULE_DIRS = Path(tempfile.mkdtemp(prefix="kvpolicy-resolver-plugin-rules-"))
atexit.register(shutil.rmtree, _RULE_DIRS, True)


@functools.cache
def _prepared(version: str) -> dict[str, Any]:
    """The rule directories and the oracle's cases for ``version``, made once (ahead or not)."""
    release = Release(version)
    tmp = _RULE_DIRS / version
    dirs = {"lbhnc": _rule_dir(tmp, "lbhnc", "global.yaml", SITE_LBHNC),
            "broken": _rule_dir(tmp, "broken", "global.yaml", SITE_BROKEN)}
    space = input_space(release)
    sample, core, site = space[::SAMPLE_EVERY], space[::CORE_EVERY], space[::SITE_EVERY]
    shipped = {"KVPOLICY_RULES": "shipped"}
    plan: list[tuple[str, Any]] = [
        ("off", _plugin({})),
        *(("off-decide", {"decide": oracle_case(c), "baseline": True}) for c in space[::2_000]),
        ("shipped", _plugin(shipped, log_level="INFO")),
        *(("decide", {"decide": oracle_case(c), "baseline": True}) for c in sample),
        *(("engine-core", {"engine_core": oracle_case(c)}) for c in core),
        ("lbhnc", _plugin({"KVPOLICY_RULES": str(dirs["lbhnc"])})),
        *(("site-lbhnc", {"decide": oracle_case(c)}) for c in site),
        ("broken", _plugin({"KVPOLICY_RULES": str(dirs["broken"])})),
    ]
    return {"release": release, "dirs": dirs, "sample": sample, "core": core, "site": site, "plan": plan}


def _cases(version: str) -> list[dict[str, Any]]:
    return [case for _, case in _prepared(version)["plan"]]


def start_ahead(items: list[pytest.Item]) -> None:
    """Queue the oracle of each release the selected tests read (conftest.py, at the end of collection)."""
    plugin_site.start_ahead(ahead.params(items, "run"), "v034_plugin", _cases)


@pytest.fixture(scope="module", params=OLDER)
def run(request: Any, vllm_sites: Any) -> dict[str, Any]:
    prepared = _prepared(request.param)
    release, plan, dirs = prepared["release"], prepared["plan"], prepared["dirs"]
    sample, core, site = prepared["sample"], prepared["core"], prepared["site"]
    answers, seconds = plugin_site.take(release.version, "v034_plugin", _cases)
    by: dict[str, list[Any]] = {}
    for (label, _), answer in zip(plan, answers, strict=True):
        assert not answer.get("oracle"), (label, answer)
        by.setdefault(label, []).append(answer)
    return {"release": release, "by": by, "dirs": dirs, "sample": sample, "core": core, "site": site,
            "seconds": seconds}



def _inactive(status: dict) -> bool:
    """The plugin's status() when it changed nothing: inactive, saying why (the settings, or their error)."""
    return status.get("active") is False and isinstance(status.get("reason"), str) and bool(status["reason"])

def test_off_changes_nothing(run: dict[str, Any]) -> None:
    off = run["by"]["off"][0]
    assert off["error"] is None and off["core_is_vllms"] and _inactive(off["status"])
    answers = run["by"]["off-decide"]
    # not an empty loop: every 2,000th case, 10-18 a release, vLLM's layouts among them (3 of 0.29's 10)
    assert len(answers) >= 10 and sum("layout" in a["vllm"] for a in answers) >= 3
    for answer in answers:
        assert answer["plugin"] == answer["vllm"]


def test_the_shipped_rules_answer_what_vllm_answers(run: dict[str, Any], capsys: Any) -> None:
    release: Release = run["release"]
    loaded = run["by"]["shipped"][0]
    assert loaded["error"] is None and not loaded["core_is_vllms"]
    assert loaded["status"]["active"] and loaded["status"]["profile"] == release.profile.name
    assert any(f"kvpolicy: active for vLLM {release.version}: profile {release.profile.name}" in line
               for line in loaded["log"]), loaded["log"]
    cases, answers = run["sample"], run["by"]["decide"]
    diffs = [f"{_shown(c)}: {why}" for c, a in zip(cases, answers, strict=True)
             if (why := _same_as_vllm(a["vllm"], a["plugin"]))]
    outcomes = Counter(a["vllm"].get("layout") or ("refused before" if a["vllm"].get("before") else "refused")
                       for a in answers)
    before = outcomes["refused before"]  # vLLM refused the config before resolving: equal by construction
    layouts = sum(n for k, n in outcomes.items() if not k.startswith("refused"))
    with capsys.disabled():
        print(f"\nvLLM {release.version} with the kvpolicy plugin (shipped rules): {len(cases) - before - len(diffs)}"
              f" of the {len(cases) - before} sampled cases vLLM resolves answer what vLLM answers without it: "
              f"{layouts} layouts, {outcomes['refused']} the same refusal ({before} more refused by vLLM before "
              f"resolving, not a comparison); oracle {run['seconds']}\n"
              f"  vLLM's outcomes: " + ", ".join(f"{k} {n}" for k, n in outcomes.most_common()))
    assert not diffs, "\n".join(diffs[:25])
    assert len(outcomes) >= 5  # layouts and refusals both: the sample spans the space
    assert layouts >= len(cases) // 4, dict(outcomes)  # the agreement is on layouts, not only on refusals


def test_the_engine_core_distributes_the_plugins_layout(run: dict[str, Any]) -> None:
    engine = LayoutEngine.default(vllm_version=run["release"].version)
    distributed = refused_later = 0
    for case, answer in zip(run["core"], run["by"]["engine-core"], strict=True):
        expected = _expected(engine, case, run["release"])
        if "layout" in expected and answer.get("distributed") is not None:
            assert answer["resolved"] == answer["distributed"] == expected["layout"], (_shown(case), answer)
            distributed += 1
        elif "layout" in expected:  # resolved, then refused by a later start-up step (HiSparse, spec types)
            assert answer.get("resolved") == expected["layout"] and "error" in answer, (_shown(case), answer)
            refused_later += 1
        else:
            assert answer.get("resolved") is None, (_shown(case), answer)
    assert distributed >= 10, (distributed, refused_later)


def test_a_site_rule_decides_through_vllm_and_stops_start_up_located(run: dict[str, Any]) -> None:
    release: Release = run["release"]
    engine = LayoutEngine.from_path(run["dirs"]["lbhnc"], vllm_version=release.version)
    rule_file = str(run["dirs"]["lbhnc"] / "global.yaml")
    diffs, layouts, stopped = [], Counter(), 0
    for case, answer in zip(run["site"], run["by"]["site-lbhnc"], strict=True):
        plugin = answer["plugin"]
        if (why := _as_rules_say(_expected(engine, case, release), plugin)) is not None:
            diffs.append(f"{_shown(case)}: {why}")
        if "layout" in plugin:
            layouts[plugin["layout"]] += 1
        elif "site-requires-lbhnc" in _plugin_blamed(plugin["error"]):
            assert re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[removed-candidates\]", plugin["error"])
            stopped += 1
    assert not diffs, "\n".join(diffs[:25])
    assert set(layouts) == {"LBHNC"} and stopped > 0


def test_rules_that_do_not_load_stop_start_up_located(run: dict[str, Any]) -> None:
    broken = run["by"]["broken"][0]
    rule_file = str(run["dirs"]["broken"] / "global.yaml")
    assert broken["error"].startswith("RuleLoadError: ")
    assert re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[", broken["error"]), broken["error"]
    assert broken["core_is_vllms"] and _inactive(broken["status"])
