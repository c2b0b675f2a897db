"""kvpolicy's vLLM plugin inside vLLM 0.34.0: loaded by vLLM's own plugin loader, answering vLLM's own
layout resolution.

One oracle subprocess (``oracles/v034_plugin.py``) runs under the release with kvpolicy installed
from a wheel of this checkout (``plugin_site.py``: the entry point comes from the dist-info pip
writes from pyproject.toml). In order, it:

1. loads plugins with ``KVPOLICY_RULES`` unset, and with ``VLLM_PLUGINS`` naming another plugin:
   vLLM's ``resolve_kv_cache_layout`` stays vLLM's own;
2. loads them with ``KVPOLICY_RULES=shipped``, twice: the engine core's ``resolve_kv_cache_layout``
   (``vllm.v1.engine.core``, the name ``EngineCore._initialize_kv_caches`` calls) is kvpolicy's,
   wrapping vLLM's, and the second load changes nothing;
3. calls it, and vLLM's own function, on every case of test_v034_decisions' input space
   (69,408 cases: real ``VllmConfig``, workers' reported layouts and customized specs): the
   same layout, or both refusing (the plugin's refusal gives the rule standing for vLLM's check as
   its primary reason, `test_v034_decisions.primary_reason`, file:line); and vLLM's
   ``EngineCore._initialize_kv_caches`` on a sample, whose ``set_kv_cache_layout`` RPC carries the
   plugin's layout to the workers;
4. logs: one INFO line naming the deciding rule and the fingerprint; the explanation with
   ``KVPOLICY_EXPLAIN=1``;
5. with operator rule directories (the shipped rules plus one site rule): OffloadingConnector
   never gets a block-outermost layout (planes B-D of the space, 23,904 cases), every deployment
   gets LBHNC (a sample of 9,700), each the rules' answer as kvpolicy decides it, and a
   deployment whose workers cannot run LBHNC stops with the located rule;
6. an impossible rule set stops start-up with the located error; a rule set that does not load
   stops the plugin's registration with every problem located; on a vLLM version no profile
   answers for, ``KVPOLICY_RULES`` stops start-up (naming the version, the profiles and the
   override; a rule set that does not load in the same error) unless a profile is forced with
   ``KVPOLICY_VLLM_VERSION`` (or its deprecated name), and unset the plugin stays inert; a patch
   release decides with its series' profile, said; a profile of the wrong resolver is refused;
7. unset again: vLLM's own resolver is back.
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

import plugin_site
import pytest
from plugin_site import ROOT, kvpolicy_site
from test_v034_decisions import (
    EXPECTED_CASES,
    PROFILE,
    _blamed,
    _shown,
    _vllm_error_kind,
    input_space,
    is_reason,
    kvpolicy_inputs,
    oracle_case,
    primary,
    primary_reason,
)

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy import Layout
from kvpolicy.policy.errors import InputError, NoLayoutError, PolicyError
from kvpolicy.policy.releases import profile_names

VERSION = "0.34.0"
ENTRY_POINT = "kvpolicy.engine.integrations.vllm_plugin:register"
UNPROFILED = "0.99.0"  # a release of no series any profile answers for
ENGINE_CORE_EVERY = 97  # one case in 97 also goes through EngineCore._initialize_kv_caches
LBHNC_EVERY = 7  # one case in 7 under the require-LBHNC site rules

def _third(name: str) -> dict[str, Any]:
    """An out-of-tree connector (oracles/thirdparty_connectors.py), configured as an operator does."""
    return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_module_path": "thirdparty_connectors"}


def _multi(*members: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": list(members)}}


_OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
_NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
THIRD_PARTY_CONNECTORS = {
    **{n: _third(n) for n in ("RequiresHND", "RequiresNHD", "RequiresLBHNC", "RequiresBLHNC", "RequiresLHBNC",
                              "RequiresNothing", "RequiresUnknown")},
    "Multi[RequiresBLHNC]": _multi(_third("RequiresBLHNC")),
    "Multi[RequiresHND]": _multi(_third("RequiresHND")),
    "Multi[Offloading,RequiresHND]": _multi(_OFFLOADING, _third("RequiresHND")),
    "Multi[Offloading,RequiresBLHNC]": _multi(_OFFLOADING, _third("RequiresBLHNC")),
    "Multi[Nixl,RequiresNothing]": _multi(_NIXL, _third("RequiresNothing")),
    "Multi[RequiresHND,RequiresNHD]": _multi(_third("RequiresHND"), _third("RequiresNHD")),
    "Multi[Multi[RequiresBLHNC]]": _multi(_multi(_third("RequiresBLHNC"))),
    "Multi[RequiresUnknown]": _multi(_third("RequiresUnknown")),
}
_FULL = {"kind": "full", "num_kv_heads": 8, "head_size": 128, "block_size": 16}
THIRD_PARTY_SPECS = {"one": [_FULL], "mixed-heads": [_FULL, {**_FULL, "num_kv_heads": 4, "kind": "sliding_window",
                                                              "sliding_window": 128}]}
THIRD_PARTY_WORKERS = [([["FLASH_ATTN"]], None), ([["FLASHINFER"]], [9, 0]), ([["FLEX_ATTENTION"]], None),
                       ([["TRITON_ATTN"], ["FLASH_ATTN"]], None)]


def third_party_space() -> list[dict[str, Any]]:
    """Out-of-tree connectors (alone, as MultiConnector members) x worker sets x spec sets x
    VLLM_KV_CACHE_LAYOUT: oracle decision cases."""
    return [{"label": f"{conn} {workers} {specs} env={env}", "workers": workers, "device_capability": cap,
             "specs": THIRD_PARTY_SPECS[specs], "use_mla": False, "VLLM_KV_CACHE_LAYOUT": env,
             "kv_transfer_config": ktc, "enable_extensible_kv_cache": False, "hisparse": False}
            for conn, ktc in THIRD_PARTY_CONNECTORS.items() for workers, cap in THIRD_PARTY_WORKERS
            for specs in THIRD_PARTY_SPECS for env in (None, "LBNHC", "HND", "BLHNC")]


SITE_OFFLOADING = """
  - id: site-offloading-never-block-outermost
    description: this site's offload store reads one layer at a time; no block-outermost layout with it
    forbid: {block_outermost: true}
"""
SITE_LBHNC = """
  - id: site-requires-lbhnc
    description: this site's transfer engine speaks LBHNC only
    require: {layout: LBHNC}
"""
SITE_IMPOSSIBLE = """
  - id: site-needs-block-outermost
    description: this site wants one region per block
    require: {block_outermost: true}
  - id: site-needs-lhbnc
    description: and heads outside blocks
    require: {layout: LHBNC}
"""
# A rule set written from scratch, not from a copy of the shipped rules: it has none of the rules standing
# for vLLM's own narrowing of the candidates.
SCRATCH = """version: 1
rules:
  - id: site-prefers-lhbnc
    description: this site's transfer engine likes heads outside blocks
    prefer: {layout: LHBNC}
    weight: 50
"""
SITE_BROKEN = """
  - id: site-typo
    description: a layout that does not exist
    forbid: {layout: LBXNC}
"""


def _rule_dir(tmp: Path, name: str, file: str, extra: str) -> Path:
    """The shipped vllm-0.34 rules with ``extra`` appended to ``file``: how an operator adds a site rule."""
    root = tmp / name
    shutil.copytree(ROOT / "rules" / PROFILE, root)
    with open(root / file, "a", encoding="utf-8") as f:
        f.write(extra)
    return root


def _plugin(env: dict[str, str], log_level: str = "ERROR", version: str | None = None) -> dict[str, Any]:
    case: dict[str, Any] = {"plugin": {"env": env, "log_level": log_level}}
    if version is not None:
        case["plugin"]["version"] = version
    return case


_RULE = re.compile(r"rule `([^`]+)`")


def _plugin_blamed(error: str) -> list[str]:
    return _RULE.findall(error)


def _same_as_vllm(vllm: dict[str, Any], plugin: dict[str, Any]) -> str | None:
    """None when the plugin answered what vLLM answers without it."""
    if "error" in vllm:
        if "error" not in plugin:
            return f"vLLM refuses, the plugin chose {plugin['layout']}"
        if vllm.get("before"):
            same = plugin.get("before") and plugin["error"] == vllm["error"]
            return None if same else "the refusal before resolution differs"
        kind = _vllm_error_kind(vllm["error"])
        if kind is None:
            return f"unmapped vLLM refusal {vllm['error'][:120]}"
        if kind[1] is InputError:  # an input vLLM's resolver refuses outright (0.29-0.33's workers-disagree)
            ok = plugin["error"].startswith("StartupError: kvpolicy: ") and f"error[{kind[2]}]" in plugin["error"]
            return None if ok else f"vLLM refuses ({kind[2]}); the plugin: {plugin['error'][:160]}"
        if not plugin["error"].startswith("StartupError: kvpolicy: no KV cache layout survives"):
            return f"vLLM refuses ({kind[2]}); the plugin: {plugin['error'][:160]}"
        if not is_reason(kind[2], reason := primary_reason(plugin["error"])):
            return f"vLLM refuses ({kind[2]}); the plugin refuses for {reason} ({_plugin_blamed(plugin['error'])})"
        return None
    if "error" in plugin:
        return f"vLLM chose {vllm['layout']}, the plugin refused: {plugin['error'][:200]}"
    if plugin["layout"] != vllm["layout"] or plugin["recorded"] != plugin["layout"]:
        return f"vLLM {vllm['layout']}, the plugin {plugin['layout']} (recorded {plugin['recorded']})"
    return None


# vLLM's refusals of what out-of-tree connectors answer (no shipped rule stands for them): the layout name a
# connector returns that vLLM cannot parse; MultiConnector members returning different layouts, as written
_UNKNOWN_LAYOUT = re.compile(r"Unknown KV cache layout '(\w+)'")
_MISMATCH = re.compile(r"KV cache layout mismatch: found \d+ different layouts \(([^)]*)\)")
_RETURNED = re.compile(r"<vllm:\w+\.get_required_kvcache_layout>: error\[(unknown-layout|layout-mismatch)\]: "
                       r"returned `(\w+)`")


def _refusal_kind(error: str) -> str:
    if _UNKNOWN_LAYOUT.search(error):
        return "unknown-layout"
    if (kind := _vllm_error_kind(error)) is not None:
        return kind[2]
    return "unmapped"


def _same_refusal(vllm: dict[str, Any], plugin: dict[str, Any]) -> str | None:
    """None when vLLM and the plugin refuse alike: a connector's layout name vLLM cannot parse, the same
    name in the plugin's located error; members requiring different layouts, the same names in both; else
    vLLM's error mapped to the rule the plugin's refusal must name (`_same_as_vllm`). Else what differs."""
    if "error" not in vllm or "error" not in plugin:
        return (f"vLLM {vllm.get('layout') or vllm['error'][:120]}, "
                f"plugin {plugin.get('layout') or plugin['error'][:200]}")
    returned = _RETURNED.findall(plugin["error"])
    if unknown := _UNKNOWN_LAYOUT.search(vllm["error"]):
        ok = ("unknown-layout", unknown[1]) in returned
        return None if ok else f"vLLM cannot parse `{unknown[1]}`; the plugin: {plugin['error'][:200]}"
    mismatch = _MISMATCH.search(vllm["error"])
    if mismatch and any(code == "layout-mismatch" for code, _ in returned):
        theirs, ours = set(mismatch[1].split(", ")), {name for code, name in returned if code == "layout-mismatch"}
        return None if theirs == ours else f"vLLM's members require {sorted(theirs)}, the plugin names {sorted(ours)}"
    return _same_as_vllm(vllm, plugin)


def _expected(engine: LayoutEngine, case: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"layout": str(engine.decide(explain=False, **kvpolicy_inputs(case)).layout)}
    except PolicyError as exc:
        return {"error": type(exc).__name__, "blamed": _blamed(exc), "primary": primary(exc)}


def _as_rules_say(expected: dict[str, Any], plugin: dict[str, Any]) -> str | None:
    """None when the plugin's answer through vLLM is the rule set's own decision for the case."""
    if "layout" in expected:
        if plugin.get("layout") != expected["layout"]:
            return f"rules {expected['layout']}, plugin {plugin.get('layout') or plugin['error'][:160]}"
        return None
    if "error" not in plugin:
        return f"rules refuse ({expected['blamed']}), plugin {plugin['layout']}"
    if plugin.get("before"):  # refused before resolution (VllmConfig, a worker); the rules refuse it too
        kind = _vllm_error_kind(plugin["error"])
        # vLLM stops at VllmConfig, before it resolves any layout: its check must be among the rules named, but
        # need not be the primary reason (an operator's rule layer runs before the shipped rules and may leave
        # no candidate by itself, as `site-requires-lbhnc` does for FLEX_ATTENTION)
        ok = kind is not None and any(kind[2] in b for b in expected["blamed"])
        return None if ok else f"refused before resolution: {plugin['error'][:100]}; rules blame {expected['blamed']}"
    if expected["error"] == InputError.__name__ and plugin["error"].startswith("StartupError: kvpolicy: "):
        # an input the release refuses outright (0.29-0.33's workers-disagree): the same code, located
        missing = [code for code in expected["blamed"] if f"error[{code}]" not in plugin["error"]]
        return f"rules refuse ({expected['blamed']}), plugin: {plugin['error'][:160]}" if missing else None
    if expected["error"] == NoLayoutError.__name__:
        if set(_plugin_blamed(plugin["error"])) != set(expected["blamed"]):
            return f"rules blame {expected['blamed']}, plugin {_plugin_blamed(plugin['error'])}"
        return None
    return f"rules: {expected}, plugin: {plugin['error'][:160]}"


_RULE_DIRS = Path(tempfile.mkdtemp(prefix="kvpolicy-v034-plugin-rules-"))
atexit.register(shutil.rmtree, _RULE_DIRS, True)


@functools.cache
def _prepared() -> dict[str, Any]:
    """The rule directories and the oracle's cases, made once (whether the oracle runs ahead or not)."""
    tmp = _RULE_DIRS
    dirs = {
        "offloading": _rule_dir(tmp, "offloading", "connectors/OffloadingConnector.yaml", SITE_OFFLOADING),
        "lbhnc": _rule_dir(tmp, "lbhnc", "global.yaml", SITE_LBHNC),
        "impossible": _rule_dir(tmp, "impossible", "global.yaml", SITE_IMPOSSIBLE),
        "broken": _rule_dir(tmp, "broken", "global.yaml", SITE_BROKEN),
        "scratch": tmp / "scratch",
    }
    dirs["scratch"].mkdir()
    (dirs["scratch"] / "global.yaml").write_text(SCRATCH)
    space = input_space()
    third_party = third_party_space()
    connector_planes = space[-23_904:]  # planes B, C, D: input_space lists plane A first
    assert all(c["conn"] in ("none", "Offloading") for c in space[:-23_904])
    lbhnc_sample = space[::LBHNC_EVERY]
    core_sample = space[::ENGINE_CORE_EVERY]
    scratch_sample = [c for c in space if c["specs"] in SCRATCH_SPECS and c["conn"] in ("none", "Offloading")
                      and c["env"] is None]
    shipped = {"KVPOLICY_RULES": "shipped"}
    plan: list[tuple[str, Any]] = [
        ("off", _plugin({})),
        ("allow-list", _plugin({**shipped, "VLLM_PLUGINS": "some_other_plugin"})),
        ("shipped", _plugin(shipped)),
        ("shipped-again", _plugin(shipped)),
        *(("decide", {"decide": oracle_case(c), "baseline": True}) for c in space),
        *(("third-party", {"decide": {k: v for k, v in c.items() if k != "label"}, "baseline": True})
          for c in third_party),
        ("shipped-logged", _plugin({**shipped, "KVPOLICY_EXPLAIN": "1"}, log_level="INFO")),
        ("logged", {"decide": oracle_case(space[0]), "log": True}),
        ("logged-again", {"decide": oracle_case(space[0]), "log": True}),
        ("shipped", _plugin(shipped)),
        *(("engine-core", {"engine_core": oracle_case(c)}) for c in core_sample),
        ("offloading", _plugin({"KVPOLICY_RULES": str(dirs["offloading"])})),
        *(("site-offloading", {"decide": oracle_case(c)}) for c in connector_planes),
        ("lbhnc", _plugin({"KVPOLICY_RULES": str(dirs["lbhnc"])}, log_level="INFO")),
        *(("site-lbhnc", {"decide": oracle_case(c), "log": True}) for c in lbhnc_sample),
        ("impossible", _plugin({"KVPOLICY_RULES": str(dirs["impossible"])})),
        *(("site-impossible", {"decide": oracle_case(c)}) for c in space[::4_000]),
        ("impossible-core", {"engine_core": oracle_case(space[0])}),
        ("scratch", _plugin({"KVPOLICY_RULES": str(dirs["scratch"]), "KVPOLICY_SHIPPED_RULES": "0"})),
        *(("site-scratch", {"decide": oracle_case(c), "baseline": True}) for c in scratch_sample),
        ("scratch-core", {"engine_core": oracle_case(next(c for c in scratch_sample if c["specs"] == "mixed-heads"))}),
        ("broken", _plugin({"KVPOLICY_RULES": str(dirs["broken"])})),
        # a release no profile answers for (0.99.0: no series of it either), and a patch release of 0.34
        ("unknown-version", _plugin(shipped, version=UNPROFILED)),
        ("unknown-version-site", _plugin({"KVPOLICY_RULES": str(dirs["lbhnc"])}, version=UNPROFILED)),
        ("unknown-version-broken", _plugin({"KVPOLICY_RULES": str(dirs["broken"])}, version=UNPROFILED)),
        ("unknown-version-off", _plugin({}, log_level="DEBUG", version=UNPROFILED)),
        ("patch", _plugin(shipped, log_level="INFO", version="0.34.1")),
        ("forced", _plugin({**shipped, "KVPOLICY_VLLM_VERSION": "vllm-0.34"}, version=UNPROFILED)),
        ("forced-version", _plugin({**shipped, "KVPOLICY_VLLM_VERSION": "0.34.0"}, version=UNPROFILED)),
        ("forced-old-name", _plugin({**shipped, "KVPOLICY_VLLM_PROFILE": "vllm-0.34"}, log_level="INFO",
                                    version=UNPROFILED)),
        ("forced-both-differ", _plugin({**shipped, "KVPOLICY_VLLM_PROFILE": "vllm-0.34",
                                        "KVPOLICY_VLLM_VERSION": "vllm-0.28"}, version=VERSION)),
        ("wrong-profile", _plugin({**shipped, "KVPOLICY_VLLM_VERSION": "vllm-0.28"}, version=VERSION)),
        ("off-again", _plugin({})),
        *(("off-decide", {"decide": oracle_case(c), "baseline": True}) for c in space[::4_000]),
    ]
    return {"dirs": dirs, "space": space, "connector_planes": connector_planes, "third_party": third_party,
            "scratch_sample": scratch_sample, "lbhnc_sample": lbhnc_sample, "core_sample": core_sample, "plan": plan}


def _cases(version: str) -> list[dict[str, Any]]:
    return [case for _, case in _prepared()["plan"]]


def start_ahead(items: list[pytest.Item]) -> None:
    """Queue the oracle the selected tests read (conftest.py, at the end of collection)."""
    if any("run" in getattr(item, "fixturenames", ()) for item in items):
        plugin_site.start_ahead([VERSION], "v034_plugin", _cases)


@pytest.fixture(scope="module")
def run(vllm_sites: Any) -> dict[str, Any]:
    prepared = _prepared()
    plan = prepared["plan"]
    answers, seconds = plugin_site.take(VERSION, "v034_plugin", _cases)
    by: dict[str, list[Any]] = {}
    for (label, _), answer in zip(plan, answers):
        assert not answer.get("oracle"), (label, answer)
        by.setdefault(label, []).append(answer)
    return {**{k: v for k, v in prepared.items() if k != "plan"}, "by": by, "seconds": seconds}



def _inactive(status: dict) -> bool:
    """The plugin's status() when it changed nothing: inactive, saying why (the settings, or their error)."""
    return status.get("active") is False and isinstance(status.get("reason"), str) and bool(status["reason"])

def test_vllm_finds_kvpolicy_by_its_entry_point_and_unset_changes_nothing(run: dict[str, Any]) -> None:
    site = str(kvpolicy_site())
    off = run["by"]["off"][0]
    assert off["error"] is None
    ours = [ep for ep in off["entry_points"] if ep["name"] == "kvpolicy"]
    assert ours == [{"name": "kvpolicy", "value": ENTRY_POINT, "dist": ours[0]["dist"]}]
    assert ours[0]["dist"].startswith(site) and ours[0]["dist"].endswith(".dist-info")
    assert off["module_file"].startswith(site)  # vLLM imported the installed kvpolicy, not the source tree
    assert off["core_is_vllms"] and _inactive(off["status"])
    allow = run["by"]["allow-list"][0]
    assert allow["error"] is None and allow["core_is_vllms"] and _inactive(allow["status"])


def test_shipped_rules_replace_the_engine_cores_resolver_once(run: dict[str, Any]) -> None:
    first, again = run["by"]["shipped"][0], run["by"]["shipped-again"][0]
    for answer in (first, again):
        assert answer["error"] is None
        assert not answer["core_is_vllms"] and answer["utils_is_core"] and answer["wraps_vllms"]
        assert answer["status"]["active"] and answer["status"]["profile"] == PROFILE
        assert answer["status"]["hook"] == "resolve_kv_cache_layout"
    # the resolver where it is defined and where the engine core bound it, and KVConnectorFactory.create_connector
    assert again["resolver_id"] == first["resolver_id"] and again["patches"] == first["patches"] == 3


def test_through_vllm_the_shipped_rules_answer_what_vllm_answers(run: dict[str, Any], capsys: Any) -> None:
    space, answers = run["space"], run["by"]["decide"]
    assert len(space) == len(answers) == EXPECTED_CASES
    diffs = [(c, a, why) for c, a in zip(space, answers) if (why := _same_as_vllm(a["vllm"], a["plugin"]))]
    outcomes = Counter(a["vllm"].get("layout") or ("refused before" if a["vllm"].get("before") else "refused")
                       for a in answers)
    before = outcomes["refused before"]  # vLLM refused the config before resolving: equal by construction
    layouts = sum(n for k, n in outcomes.items() if not k.startswith("refused"))
    with capsys.disabled():
        print(f"\nvLLM {VERSION} with the kvpolicy plugin (KVPOLICY_RULES=shipped), through "
              f"vllm.v1.engine.core.resolve_kv_cache_layout: {len(space) - before - len(diffs)} of the "
              f"{len(space) - before} cases vLLM resolves answer what vLLM answers without it: {layouts} layouts, "
              f"{outcomes['refused']} the same refusal ({len(diffs)} differ; {before} more refused by vLLM before "
              f"resolving, not a comparison); oracle {run['seconds']} for "
              f"every phase\n  vLLM's outcomes: " + ", ".join(f"{k} {n}" for k, n in outcomes.most_common()))
    assert not diffs, "\n".join(f"{_shown(c)}: {why}" for c, _, why in diffs[:25])
    assert layouts >= len(space) // 4, dict(outcomes)  # the agreement is on layouts, not only on refusals


def test_out_of_tree_connectors_keep_the_layout_vllm_gives_them(run: dict[str, Any], capsys: Any) -> None:
    """A connector the shipped rules have no file for, alone or as a MultiConnector member, keeps what its
    get_required_kvcache_layout asks for (a legacy NHD/HND included): the plugin answers vLLM's layout,
    or both refuse (an unknown layout name, members that disagree, a requested layout no worker has)."""
    cases, answers = run["third_party"], run["by"]["third-party"]
    assert len(cases) == len(answers) == len(THIRD_PARTY_CONNECTORS) * 4 * 2 * 4
    diffs, same, refused = [], 0, Counter()
    for case, answer in zip(cases, answers):
        vllm, plugin = answer["vllm"], answer["plugin"]
        if "error" in vllm or "error" in plugin:
            if (why := _same_refusal(vllm, plugin)) is not None:
                diffs.append(f"{case['label']}: {why}")
            else:
                refused[_refusal_kind(vllm["error"])] += 1
        elif vllm["layout"] != plugin["layout"] or plugin["recorded"] != plugin["layout"]:
            diffs.append(f"{case['label']}: vLLM {vllm['layout']}, plugin {plugin['layout']}")
        else:
            same += 1
    with capsys.disabled():
        print(f"\nout-of-tree connectors through the plugin (KVPOLICY_RULES=shipped): {same} cases answer vLLM's "
              f"layout, {sum(refused.values())} the same refusal {dict(refused)}, {len(diffs)} differ")
    assert not diffs, "\n".join(diffs[:25])
    by_label = {c["label"]: a["plugin"] for c, a in zip(cases, answers)}
    assert by_label["RequiresHND [['FLASH_ATTN']] one env=None"]["layout"] == "LBHNC"
    assert by_label["Multi[RequiresBLHNC] [['FLASH_ATTN']] one env=None"]["layout"] == "BLHNC"
    unknown = by_label["RequiresUnknown [['FLASH_ATTN']] one env=None"]["error"]
    assert "<vllm:RequiresUnknown.get_required_kvcache_layout>: error[unknown-layout]: returned `XYZ`" in unknown
    assert same > 200 and sum(refused.values()) > 50


def test_the_engine_core_distributes_the_plugins_layout(run: dict[str, Any]) -> None:
    sample = run["core_sample"]
    index = {id(c): i for i, c in enumerate(run["space"])}
    direct = run["by"]["decide"]
    checked = 0
    for case, answer in zip(sample, run["by"]["engine-core"]):
        plugin = direct[index[id(case)]]["plugin"]
        if "layout" in plugin:
            assert answer["resolved"] == plugin["layout"], (_shown(case), answer)
            if answer["distributed"] is not None:  # later start-up steps may refuse some spec sets
                assert answer["distributed"] == plugin["layout"]
                checked += 1
        elif plugin.get("before"):
            assert answer.get("before"), (_shown(case), answer)
        else:
            assert answer["resolved"] is None and answer["error"] == plugin["error"], (_shown(case), answer)
    # about half the space is refused; a few resolved cases are refused by a later start-up step (HiSparse
    # without sparse-MLA specs, specs of no unified type), which the layout does not change
    assert len(sample) == -(-EXPECTED_CASES // ENGINE_CORE_EVERY) and checked >= 250


def test_the_decision_is_logged_once_with_its_rule_and_fingerprint(run: dict[str, Any]) -> None:
    loaded = run["by"]["shipped-logged"][0]
    assert any(line.startswith("INFO kvpolicy: active for vLLM 0.34.0: profile vllm-0.34, rules shipped")
               and "answering resolve_kv_cache_layout" in line for line in loaded["log"]), loaded["log"]
    first, again = run["by"]["logged"][0], run["by"]["logged-again"][0]
    info = [line for line in first["log"] if line.startswith("INFO kvpolicy: KV cache layout")]
    assert len(info) == 1, first["log"]
    assert re.search(r"decided by .+ at rules/vllm-0\.34/\S+\.yaml:\d+|decided by the first candidate", info[0])
    assert re.search(r"fingerprint sha256:[0-9a-f]{64}", info[0])
    assert any(line.startswith("INFO kvpolicy: explanation\nlayout: ") for line in first["log"])
    assert not [line for line in again["log"] if "KV cache layout" in line]  # once per process


def test_a_site_rule_forbidding_block_outermost_for_offloading(run: dict[str, Any], capsys: Any) -> None:
    engine = LayoutEngine.from_path(run["dirs"]["offloading"], vllm_version=PROFILE)
    cases, answers = run["connector_planes"], run["by"]["site-offloading"]
    baseline = {id(c): a["vllm"] for c, a in zip(run["space"], run["by"]["decide"])}
    assert len(cases) == len(answers) == 23_904
    diffs, changed, stopped = [], 0, 0
    for case, answer in zip(cases, answers):
        plugin = answer["plugin"]
        if (why := _as_rules_say(_expected(engine, case), plugin)) is not None:
            diffs.append(f"{_shown(case)}: {why}")
        if "Offloading" in case["conn"] and "layout" in plugin:
            assert plugin["layout"][0] != "B", (_shown(case), plugin)  # the site rule holds
        changed += plugin.get("layout") != baseline[id(case)].get("layout")
        stopped += "site-offloading-never-block-outermost" in plugin.get("error", "")
    with capsys.disabled():
        print(f"\nsite rule `site-offloading-never-block-outermost`: {len(cases) - len(diffs)} of {len(cases)} "
              f"cases are the rules' answer through vLLM; {changed} differ from vLLM's own, {stopped} stop start-up "
              "naming the rule")
    assert not diffs, "\n".join(diffs[:25])
    assert changed > 1000 and stopped > 100


def test_a_site_rule_requiring_lbhnc(run: dict[str, Any], capsys: Any) -> None:
    engine = LayoutEngine.from_path(run["dirs"]["lbhnc"], vllm_version=PROFILE)
    cases, answers = run["lbhnc_sample"], run["by"]["site-lbhnc"]
    diffs, layouts, refusals = [], Counter(), Counter()
    rule_file = str(run["dirs"]["lbhnc"] / "global.yaml")
    for case, answer in zip(cases, answers):
        plugin = answer["plugin"]
        if (why := _as_rules_say(_expected(engine, case), plugin)) is not None:
            diffs.append(f"{_shown(case)}: {why}")
        if "layout" in plugin:
            layouts[plugin["layout"]] += 1
        elif not plugin.get("before"):
            assert f"{rule_file}:" in plugin["error"] or "site-requires-lbhnc" not in plugin["error"]
            refusals["site-requires-lbhnc" in _plugin_blamed(plugin["error"])] += 1
    with capsys.disabled():
        print(f"\nsite rule `site-requires-lbhnc`: {len(cases) - len(diffs)} of {len(cases)} sampled cases are the "
              f"rules' answer through vLLM: {dict(layouts)}; {refusals[True]} stop start-up naming it")
    assert not diffs, "\n".join(diffs[:25])
    assert set(layouts) == {"LBHNC"} and refusals[True] > 100
    # workers that cannot run LBHNC (FLEX_ATTENTION declares LBNHC only): the located refusal
    flex = next(a["plugin"]["error"] for c, a in zip(cases, answers)
                if c["workers"] == (("FLEX_ATTENTION",),) and c["env"] is None and "error" in a["plugin"]
                and not a["plugin"].get("before"))
    assert re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[removed-candidates\]: rule `site-requires-lbhnc` "
                     r"\(require, global\) removed `LBNHC`", flex), flex
    assert "error[removed-candidates]: rule `release-candidates`" in flex
    logged = [line for a in answers for line in a.get("log", ()) if line.startswith("INFO kvpolicy: KV cache")]
    assert any(f"`site-requires-lbhnc` at {rule_file}:" in line for line in logged), logged[:3]


def test_an_impossible_rule_set_stops_start_up_located(run: dict[str, Any], capsys: Any) -> None:
    rule_file = str(run["dirs"]["impossible"] / "global.yaml")
    answers = run["by"]["site-impossible"]
    errors = [a["plugin"].get("error", a["plugin"].get("layout")) for a in answers if not a["plugin"].get("before")]
    assert len(errors) >= 10
    for error in errors:
        assert error.startswith("StartupError: kvpolicy: no KV cache layout survives the rules; vLLM must not start")
        assert re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[removed-candidates\]: rule "
                         r"`site-needs-block-outermost` \(require, global\)", error), error
        assert re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[removed-candidates\]: rule `site-needs-lhbnc`",
                         error), error
    core = run["by"]["impossible-core"][0]
    assert core["resolved"] is None and core["distributed"] is None and core["error"] == errors[0]
    with capsys.disabled():
        print("\nan impossible site rule set, through EngineCore._initialize_kv_caches:\n  " + errors[0])


# spec set -> (the shipped rule standing for vLLM's narrowing, the layout property it requires)
SCRATCH_SPECS = {"one": None, "mixed-heads": ("mixed-hnc-shapes-need-block-compact", "block_compact"),
                 "mixed-shape-same-page": ("mixed-hnc-shapes-need-block-compact", "block_compact"),
                 "dcp-draft": ("dcp-mixed-page-sizes-need-block-outermost", "block_outermost")}


def _is(layout: str, prop: str) -> bool:
    return getattr(Layout(layout), f"is_{prop}")


def test_rules_without_vllms_own_checks_never_answer_outside_vllms_candidates(run: dict[str, Any],
                                                                               capsys: Any) -> None:
    """An operator rule set written from scratch prefers LHBNC and has no rule for vLLM's own narrowing
    (mixed HNC shapes: block-compact; DCP with a replicated draft: block-outermost; the extensible KV
    cache with a connector: block-compact). Where vLLM narrows, the plugin answers one of vLLM's
    candidates or stops start-up naming the missing requirement; elsewhere the site's preference holds."""
    rule_file = str(run["dirs"]["scratch"] / "global.yaml")
    cases, answers = run["scratch_sample"], run["by"]["site-scratch"]
    assert len(cases) == len(answers) > 500
    stopped, preferred, refused, diffs = 0, 0, 0, []
    for case, answer in zip(cases, answers):
        plugin, vllm = answer["plugin"], answer["vllm"]
        if plugin.get("before"):
            continue
        needs = [] if SCRATCH_SPECS[case["specs"]] is None else [SCRATCH_SPECS[case["specs"]]]
        if case["ext"] and case["conn"] != "none":
            needs.append(("extensible-kv-cache-with-connector-needs-block-compact", "block_compact"))
        if "layout" in plugin:
            broken = [rule for rule, prop in needs if not _is(plugin["layout"], prop)]
            if broken:
                diffs.append(f"{_shown(case)}: {plugin['layout']} breaks vLLM's {broken}")
            preferred += plugin["layout"] == "LHBNC"
        elif "error[vllm-requirement]" in plugin["error"]:
            stopped += 1
            if not any(f"`{rule}`" in plugin["error"] for rule, _ in needs):
                diffs.append(f"{_shown(case)}: {plugin['error'][:300]}")
            site = f"{rule_file}:3:5: error[vllm-requirement]: rule `site-prefers-lhbnc` (global) prefers LHBNC"
            others = ("is the first of the workers' candidates, and no rule removed it",
                      "error[vllm-requirement]: rule `vllm-own-layout.offloadingconnector`")
            if site not in plugin["error"] and not any(o in plugin["error"] for o in others):
                diffs.append(f"{_shown(case)}: the refusal does not say what chose it: {plugin['error'][:300]}")
        elif "error" not in vllm:
            diffs.append(f"{_shown(case)}: vLLM {vllm['layout']}, plugin {plugin['error'][:300]}")
        elif (why := _same_as_vllm(vllm, plugin)) is not None:  # both refuse, for no requirement the rules lack
            diffs.append(f"{_shown(case)}: {why}")
        else:
            refused += 1
    with capsys.disabled():
        print(f"\na rule set written from scratch (prefer LHBNC, none of vLLM's checks): {len(cases)} cases, "
              f"{preferred} get LHBNC where vLLM allows it, {stopped} stop start-up naming vLLM's requirement, "
              f"{refused} refused as vLLM refuses")
    assert not diffs, "\n".join(diffs[:25])
    assert preferred > 20 and stopped > 500
    core = run["by"]["scratch-core"][0]
    assert core["resolved"] is None and core["distributed"] is None
    assert "`mixed-hnc-shapes-need-block-compact`" in core["error"] and core["error"].startswith("StartupError: ")


def test_rules_that_do_not_load_stop_the_plugin_located(run: dict[str, Any]) -> None:
    broken = run["by"]["broken"][0]
    rule_file = str(run["dirs"]["broken"] / "global.yaml")
    assert broken["error"].startswith("RuleLoadError: ")
    assert re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[", broken["error"]), broken["error"]
    assert "LBXNC" in broken["error"]
    assert broken["core_is_vllms"] and _inactive(broken["status"])  # nothing half-installed


def test_versions_and_profiles(run: dict[str, Any]) -> None:
    by = {label: answers[0] for label, answers in run["by"].items()}
    # KVPOLICY_RULES on a release no profile answers for: start-up stops (shipped or site rules), naming the
    # version, the profiles and the override; vLLM's resolver stays its own
    for label in ("unknown-version", "unknown-version-site"):
        unknown = by[label]
        assert unknown["error"].startswith(f"PluginError: kvpolicy: no release profile decides for vLLM "
                                           f"{UNPROFILED} while KVPOLICY_RULES="), (label, unknown["error"])
        assert "KVPOLICY_RULES: error[unprofiled-vllm]" in unknown["error"]
        assert all(f"{name} (" in unknown["error"] for name in profile_names())
        assert "KVPOLICY_VLLM_VERSION=<profile or version>" in unknown["error"]
        assert unknown["core_is_vllms"] and _inactive(unknown["status"])
    # a rule directory that does not load is reported in the same error, located
    broken = by["unknown-version-broken"]
    assert broken["error"].startswith(f"PluginError: kvpolicy: no release profile decides for vLLM {UNPROFILED}, "
                                      "and the rules in KVPOLICY_RULES=")
    assert "KVPOLICY_RULES: error[unprofiled-vllm]" in broken["error"] and "LBXNC" in broken["error"]
    assert re.search(rf"{re.escape(str(run['dirs']['broken'] / 'global.yaml'))}:\d+:\d+: error\[", broken["error"])
    assert broken["core_is_vllms"] and _inactive(broken["status"])
    # unset, inert on any release, silently
    off = by["unknown-version-off"]
    assert off["error"] is None and off["core_is_vllms"] and _inactive(off["status"])
    assert not [line for line in off["log"] if line.startswith(("WARNING", "ERROR"))]
    # a patch release decides with its series' profile and says so
    patch = by["patch"]
    assert patch["error"] is None and not patch["core_is_vllms"] and patch["status"]["profile"] == PROFILE
    assert any(line.startswith("WARNING kvpolicy: no release profile lists vLLM 0.34.1; deciding with "
                               f"`{PROFILE}`") for line in patch["log"]), patch["log"]
    # forced: a profile name or a version; the old variable name too, with a warning naming the new one
    for label in ("forced", "forced-version", "forced-old-name"):
        forced = by[label]
        assert forced["error"] is None and not forced["core_is_vllms"] and forced["status"]["profile"] == PROFILE
    assert any("KVPOLICY_VLLM_PROFILE is deprecated; set KVPOLICY_VLLM_VERSION instead" in line
               for line in by["forced-old-name"]["log"])
    differ = by["forced-both-differ"]
    assert differ["error"].startswith("PluginError: ") and "KVPOLICY_VLLM_PROFILE: error[conflicting-vllm-version]" \
        in differ["error"]
    assert differ["core_is_vllms"] and _inactive(differ["status"])
    wrong = by["wrong-profile"]
    assert wrong["error"].startswith("PluginError: kvpolicy: ") and "use_uniform_kv_cache" in wrong["error"]
    assert wrong["core_is_vllms"]


def test_unset_again_vllm_decides(run: dict[str, Any]) -> None:
    off = run["by"]["off-again"][0]
    assert off["core_is_vllms"] and _inactive(off["status"])
    answers = run["by"]["off-decide"]
    assert len(answers) == len(run["space"][::4_000]) == 18  # not an empty loop: 10 layouts, 8 refusals
    assert sum("layout" in a["vllm"] for a in answers) >= 8
    for answer in answers:
        assert answer["plugin"] == answer["vllm"]

