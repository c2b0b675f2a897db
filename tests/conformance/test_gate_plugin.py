"""kvpolicy's vLLM plugin inside each uniform-gate release (vLLM 0.24.0-0.28.0): loaded by vLLM's own
plugin loader, answering the model runner's ``use_uniform_kv_cache`` gate.

One oracle subprocess (``oracles/v028_plugin.py``) runs under the release with kvpolicy installed
from a wheel of this checkout (``plugin_site.py``). In order, it:

1. loads plugins with ``KVPOLICY_RULES`` unset: ``GPUModelRunner.use_uniform_kv_cache`` stays vLLM's;
2. loads them with ``KVPOLICY_RULES=shipped``, twice: the gate is kvpolicy's, installed once;
3. asks it, and vLLM's own gate, on every 5th deployment of test_gate_decisions' space (3,978 for 0.28: real
   VllmConfig, layer specs, attention groups and the connector vLLM's factory loads, including
   ``NixlConnector``, which 0.28 registers as an alias of ``NixlPullConnector``, and
   OffloadingConnector's ``canonical_layout``): the same answer and the same head order, with the
   plugin's check that the head order vLLM fixed is the rules' passing everywhere; and vLLM's
   ``GPUModelRunner.initialize_kv_cache_tensors`` on a sample takes the allocation the plugin answers;
4. with operator rule directories: OffloadingConnector kept per layer, NixlConnector (by the name
   vLLM registers, not its class) kept per layer, each the rules' own answer; a rule requiring NHD
   where vLLM has already fixed HND stops start-up naming the rule and the variable that fixes it;
5. an impossible rule set stops start-up with the located error, and unset again vLLM's gate is back.
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
from gate_oracle import PER_LAYER_SCALE_VIEWS, deliberate
from gate_oracle import space as gate_space
from plugin_site import kvpolicy_site
from test_v034_decisions import _vllm_error_kind
from test_v034_plugin import _plugin_blamed
from v028_space import GATE_SERIES, Deployment, vllm_layout

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.errors import NoLayoutError
from kvpolicy.policy.releases import get_profile

ENTRY_POINT = "kvpolicy.engine.integrations.vllm_plugin:register"
EXPECTED_028 = 3_978  # every 5th of the 19,890 deployments under vllm-0.28
RUNNER_EVERY = 37
# Every STRIDE-th deployment through the plugin, where test_gate_decisions.py holds the same shipped rules
# to vLLM's gate on every deployment in-process: what this module adds, vLLM's loader finding and installing
# the plugin, and its answers through vLLM's own runner, needs no more (about 40 s an oracle; every
# deployment of 0.28 took 85 s).
STRIDE: dict[str, int] = {}
OTHER_STRIDE = 5

SITE_OFFLOADING = """
  - id: site-offloading-per-layer
    description: this site's offload store reads one layer at a time
    forbid: {placement: cross_layer}
"""
SITE_NIXL = """
  - id: site-nixl-per-layer
    description: this site's NIXL peers register one region per layer
    when: {field: connector.name, eq: NixlConnector}
    forbid: {placement: cross_layer}
"""
SITE_NHD = """
  - id: site-requires-nhd
    description: this site's tools read token-major blocks
    require: {head_order: NHD}
"""
SITE_IMPOSSIBLE = """
  - id: site-no-per-layer
    description: this site wants one region per block
    forbid: {placement: per_layer}
  - id: site-no-cross-layer
    description: and one buffer per layer
    forbid: {placement: cross_layer}
"""


# A rule set written from scratch (not from a copy of the shipped rules): none of the rules standing for
# vLLM's gate conditions.
SCRATCH = """version: 1
rules:
  - id: site-prefers-cross-layer
    description: this site's store reads whole blocks
    prefer: {placement: cross_layer}
    weight: 50
"""


def _third(name: str) -> dict[str, Any]:
    """An out-of-tree connector (oracles/thirdparty_connectors.py), configured as an operator does."""
    return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_module_path": "thirdparty_connectors"}


def _multi(*members: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": list(members)}}


_OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
_NIXL_ON = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"enable_cross_layers_blocks": "true"}}
THIRD_PARTY_CONNECTORS = {
    **{n: _third(n) for n in ("RequiresHND", "RequiresNHD", "RequiresNothing", "PrefersCrossLayer",
                              "PrefersCrossLayerHND", "PrefersPerLayerHND")},
    "Multi[RequiresHND]": _multi(_third("RequiresHND")),
    "Multi[Offloading,RequiresHND]": _multi(_OFFLOADING, _third("RequiresHND")),
    "Multi[Offloading,RequiresNothing]": _multi(_OFFLOADING, _third("RequiresNothing")),
    "Multi[Offloading,PrefersCrossLayer]": _multi(_OFFLOADING, _third("PrefersCrossLayer")),
    "Multi[Offloading,PrefersCrossLayerHND]": _multi(_OFFLOADING, _third("PrefersCrossLayerHND")),
    "Multi[Offloading,PrefersPerLayerHND]": _multi(_OFFLOADING, _third("PrefersPerLayerHND")),
    "Multi[Nixl(on),PrefersCrossLayer]": _multi(_NIXL_ON, _third("PrefersCrossLayer")),
    "Multi[Nixl(on),RequiresHND]": _multi(_NIXL_ON, _third("RequiresHND")),
    "Multi[RequiresHND,RequiresNHD]": _multi(_third("RequiresHND"), _third("RequiresNHD")),
}
THIRD_PARTY_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "CPU_ATTN")


def third_party_space() -> list[tuple[str, dict[str, Any]]]:
    """(label, v028 gate case): out-of-tree connectors (alone, as MultiConnector members) x backends x
    VLLM_KV_CACHE_LAYOUT, on one full-attention group."""
    return [(f"{conn} {backend} VLLM_KV_CACHE_LAYOUT={env}",
             {"gate": True, "kv_cache_dtype": "auto", "use_mla": False, "VLLM_KV_CACHE_LAYOUT": env,
              "specs": [{"kind": "full", "num_layers": 2, "num_kv_heads": 2, "head_size": 64, "block_size": 16,
                         "backends": [backend]}], "kv_transfer_config": ktc})
            for conn, ktc in THIRD_PARTY_CONNECTORS.items() for backend in THIRD_PARTY_BACKENDS
            for env in (None, "NHD", "HND")]


def _rule_dir(tmp: Path, name: str, file: str, extra: str) -> Path:
    """An operator's rule directory holding one file with the ``extra`` rules (the shipped layers lie below)."""
    root = tmp / name
    (root / file).parent.mkdir(parents=True, exist_ok=True)
    header = f"version: 1\nconnector: {Path(file).stem}\n" if file.startswith("connectors/") else "version: 1\n"
    (root / file).write_text(header + "rules:" + extra)
    return root


def _patch(version: str) -> str:
    """A patch release of ``version``'s series that no profile lists (0.28.9 for 0.28.0)."""
    return ".".join(version.split(".")[:2]) + ".9"


def _plugin(env: dict[str, str], log_level: str = "ERROR", version: str | None = None) -> dict[str, Any]:
    """A plugin-loading case; ``version`` pretends the running vLLM is another release."""
    case: dict[str, Any] = {"plugin": {"env": env, "log_level": log_level}}
    if version is not None:
        case["plugin"]["version"] = version
    return case


_RULE_DIRS = Path(tempfile.mkdtemp(prefix="kvpolicy-gate-plugin-rules-"))
atexit.register(shutil.rmtree, _RULE_DIRS, True)


@functools.cache
def _prepared(version: str) -> dict[str, Any]:
    """The operator rule directories and the oracle's cases for ``version``, made once (the same cases
    whether the oracle runs ahead or when the fixture asks)."""
    tmp = _RULE_DIRS / version
    dirs = {
        "offloading": _rule_dir(tmp, "offloading", "connectors/OffloadingConnector.yaml", SITE_OFFLOADING),
        "nixl": _rule_dir(tmp, "nixl", "global.yaml", SITE_NIXL),
        "nhd": _rule_dir(tmp, "nhd", "global.yaml", SITE_NHD),
        "impossible": _rule_dir(tmp, "impossible", "global.yaml", SITE_IMPOSSIBLE),
        "scratch": tmp / "scratch",
    }
    dirs["scratch"].mkdir()
    (dirs["scratch"] / "global.yaml").write_text(SCRATCH)
    third_party = third_party_space()
    stride = STRIDE.get(version, OTHER_STRIDE)
    space = gate_space(get_profile(version))[::stride]
    offloading = [d for d in space if "Offloading" in str((d.connector, d.extra))]
    nixl = [d for d in space if "Nixl" in str((d.connector, d.extra))]
    nhd = space[::3]
    scratch = space[::5]
    shipped = {"KVPOLICY_RULES": "shipped"}
    plan: list[tuple[str, Any]] = [
        ("facts", {"facts": True}),
        ("off", _plugin({})),
        ("shipped", _plugin(shipped, log_level="INFO")),
        ("shipped-again", _plugin(shipped)),
        *(("gate", {"gate": d.oracle_case(), "baseline": True}) for d in space),
        *(("third-party", {"gate": case, "baseline": True}) for _, case in third_party),
        ("runner", {"runner": space[0].oracle_case()}),
        *(("runner", {"runner": d.oracle_case()}) for d in space[1::RUNNER_EVERY // stride]),
        ("offloading", _plugin({"KVPOLICY_RULES": str(dirs["offloading"])})),
        *(("site-offloading", {"gate": d.oracle_case()}) for d in offloading),
        ("nixl", _plugin({"KVPOLICY_RULES": str(dirs["nixl"])})),
        *(("site-nixl", {"gate": d.oracle_case()}) for d in nixl),
        ("nhd", _plugin({"KVPOLICY_RULES": str(dirs["nhd"])})),
        *(("site-nhd", {"gate": d.oracle_case()}) for d in nhd),
        ("scratch", _plugin({"KVPOLICY_RULES": str(dirs["scratch"]), "KVPOLICY_SHIPPED_RULES": "0"})),
        *(("site-scratch", {"gate": d.oracle_case()}) for d in scratch),
        ("impossible", _plugin({"KVPOLICY_RULES": str(dirs["impossible"])})),
        *(("site-impossible", {"gate": d.oracle_case()}) for d in space[::2_000 // stride]),
        # a release no profile answers for: the operator's rules stop start-up unless a profile is forced;
        # a patch release of the series decides with its profile, said
        ("unknown-version", _plugin({"KVPOLICY_RULES": str(dirs["nhd"])}, version="0.99.0")),
        ("forced", _plugin({"KVPOLICY_RULES": str(dirs["nhd"]), "KVPOLICY_VLLM_VERSION": version},
                           version="0.99.0")),
        ("patch", _plugin(shipped, log_level="INFO", version=_patch(version))),
        ("off-again", _plugin({})),
        *(("off-gate", {"gate": d.oracle_case(), "baseline": True}) for d in space[::2_000 // stride]),
    ]
    return {"dirs": dirs, "third_party": third_party, "stride": stride, "space": space, "offloading": offloading,
            "nixl": nixl, "nhd": nhd, "scratch": scratch, "plan": plan}


def _cases(version: str) -> list[dict[str, Any]]:
    return [case for _, case in _prepared(version)["plan"]]


def start_ahead(items: list[pytest.Item]) -> None:
    """Queue the oracle of each release the selected tests read (conftest.py, at the end of collection)."""
    plugin_site.start_ahead(ahead.params(items, "run"), "v028_plugin", _cases)


@pytest.fixture(scope="module", params=GATE_SERIES)
def run(request: pytest.FixtureRequest, vllm_sites: Any) -> dict[str, Any]:
    version = request.param
    prepared = _prepared(version)
    plan, space, stride, dirs, third_party = (prepared[k] for k in ("plan", "space", "stride", "dirs", "third_party"))
    offloading, nixl, nhd, scratch = (prepared[k] for k in ("offloading", "nixl", "nhd", "scratch"))
    answers, seconds = plugin_site.take(version, "v028_plugin", _cases)
    by: dict[str, list[Any]] = {}
    for (label, _), answer in zip(plan, answers):
        assert not answer.get("oracle"), (label, answer)
        by.setdefault(label, []).append(answer)
    runner_sample = [space[0], *space[1::RUNNER_EVERY // stride]]
    return {"version": version, "profile": get_profile(version), "stride": stride,
            "by": by, "dirs": dirs, "space": space, "offloading": offloading, "nixl": nixl, "nhd": nhd,
            "third_party": third_party, "scratch": scratch,
            "runner_sample": runner_sample, "seconds": seconds, "facts": by["facts"][0]}


def _same_refusal(vllm: dict[str, Any], plugin: dict[str, Any]) -> str | None:
    """None when vLLM and the plugin refuse alike: vLLM's error mapped to the rule kvpolicy must name
    (`test_v034_decisions._VLLM_ERRORS`) and the plugin's start-up error naming it, or, where the shipped rules
    know nothing of the connectors (out-of-tree members), vLLM's own check refusing the plugin's answer for
    the same reason; else what differs."""
    if "error" not in vllm or "error" not in plugin:
        return f"vLLM {vllm}, plugin {str(plugin)[:300]}"
    kind = _vllm_error_kind(vllm["error"])
    if kind is None:
        return f"vLLM refused in a way the test does not map: {vllm['error'][:160]}"
    if _vllm_error_kind(plugin["error"]) == kind:  # vLLM's own check, after the plugin answered: the same refusal
        return None
    blamed = _plugin_blamed(plugin["error"])
    if not plugin["error"].startswith("StartupError: kvpolicy: no KV cache layout survives") or not any(
            kind[2] in b for b in blamed):
        return f"vLLM refuses ({kind[2]}); the plugin: {plugin['error'][:200]}"
    return None


def _layout(facts: dict[str, Any], d: Deployment, answer: dict[str, Any]) -> str:
    return vllm_layout(facts["backends"][d.backend], answer["head_order"], answer["uniform"])



def _inactive(status: dict) -> bool:
    """The plugin's status() when it changed nothing: inactive, saying why (the settings, or their error)."""
    return status.get("active") is False and isinstance(status.get("reason"), str) and bool(status["reason"])

def test_vllm_finds_kvpolicy_and_unset_changes_nothing(run: dict[str, Any]) -> None:
    off = run["by"]["off"][0]
    assert off["error"] is None and off["gate_is_vllms"] and _inactive(off["status"])
    ours = [ep for ep in off["entry_points"] if ep["name"] == "kvpolicy"]
    assert len(ours) == 1 and ours[0]["value"] == ENTRY_POINT and ours[0]["dist"].startswith(str(kvpolicy_site()))
    assert off["module_file"].startswith(str(kvpolicy_site()))


def test_shipped_rules_install_the_gate_once(run: dict[str, Any]) -> None:
    first, again = run["by"]["shipped"][0], run["by"]["shipped-again"][0]
    for answer in (first, again):
        assert answer["error"] is None and not answer["gate_is_vllms"]
        assert answer["status"]["profile"] == run["profile"].name
        assert answer["status"]["hook"] == "KVConnectorModelRunnerMixin.use_uniform_kv_cache"
    # the gate, and KVConnectorFactory.create_connector (every connector vLLM creates gets this engine's stamp)
    assert again["gate_id"] == first["gate_id"] and again["patches"] == first["patches"] == 2
    assert any(f"kvpolicy: active for vLLM {run['version']}: profile {run['profile'].name}" in line
               for line in first["log"])


def test_through_vllm_the_shipped_rules_answer_what_vllms_gate_answers(run: dict[str, Any], capsys: Any) -> None:
    space, answers, facts = run["space"], run["by"]["gate"], run["facts"]
    assert len(space) == len(answers) and (run["version"] != "0.28.0" or len(space) == EXPECTED_028)
    assert len(space) == len(gate_space(run["profile"])[::run["stride"]])
    diffs, seen = [], Counter()
    for d, a in zip(space, answers):
        vllm, plugin = a["vllm"], a["plugin"]
        if "error" in vllm:
            if vllm.get("before"):  # vLLM refused the config before any gate ran: not a comparison of answers
                seen["refused before the gate"] += 1
                ok = plugin == vllm
            else:  # MultiConnector members requiring different head orders: vLLM refuses after the gate
                seen["the same refusal"] += 1
                ok = _same_refusal(vllm, plugin) is None
            if not ok:
                diffs.append(f"{d.label()}: vLLM {vllm['error'][:80]}, plugin {plugin}")
            continue
        seen[_layout(facts, d, vllm)] += 1
        if (plugin != vllm and run["version"] in PER_LAYER_SCALE_VIEWS and "error" not in plugin
                and deliberate(run["version"], d, _layout(facts, d, plugin), _layout(facts, d, vllm))):
            seen["deliberate: per-token-head kept per layer"] += 1  # test_gate_decisions.py's divergence
        elif plugin != vllm:
            diffs.append(f"{d.label()}: vLLM {vllm}, plugin {plugin}")
    before = seen["refused before the gate"]
    compared = len(space) - before
    with capsys.disabled():
        print(f"\nvLLM {run['version']} with the kvpolicy plugin (KVPOLICY_RULES=shipped), through "
              f"GPUModelRunner.use_uniform_kv_cache: {compared - len(diffs)} of the {compared} deployments vLLM's "
              f"gate answers (every {run['stride']}th of the space; {before} more refused by vLLM before the gate, "
              f"not a comparison) answer what vLLM's gate answers, with the same head order ({len(diffs)} differ, "
              f"{seen['the same refusal']} of the agreements the same refusal); oracle "
              f"{run['seconds']} for every phase\n  vLLM's layouts: {dict(sorted(seen.items()))}")
    assert not diffs, "\n".join(diffs[:25])
    # most of the sample reaches the gate and gets a layout: the agreement is on answers, not on refusals
    assert compared - seen["the same refusal"] >= len(space) // 2, dict(seen)


def test_out_of_tree_connectors_get_what_vllms_gate_gives_them(run: dict[str, Any], capsys: Any) -> None:
    """A connector the shipped rules have no file for, alone or as a MultiConnector member, keeps its own
    prefer_cross_layer_blocks (true, false, or the base class's false) and the head order its
    get_required_kvcache_layout asks for: the plugin reads the object vLLM loads into
    `connector.prefers_cross_layer_blocks`, the field the global rule reads, and answers vLLM's gate and
    head order, or both refuse."""
    cases, answers = run["third_party"], run["by"]["third-party"]
    assert len(cases) == len(answers) == len(THIRD_PARTY_CONNECTORS) * len(THIRD_PARTY_BACKENDS) * 3
    diffs, seen = [], Counter()
    for (label, _), answer in zip(cases, answers):
        vllm, plugin = answer["vllm"], answer["plugin"]
        if "error" in vllm or "error" in plugin:
            why = _same_refusal(vllm, plugin)
            if why is None:
                seen["the same refusal"] += 1
            else:
                diffs.append(f"{label}: {why}")
            continue
        seen[f"uniform={vllm['uniform']} {vllm['head_order']}"] += 1
        if plugin != vllm:
            diffs.append(f"{label}: vLLM {vllm}, plugin {str(plugin)[:300]}")
    with capsys.disabled():
        print(f"\nout-of-tree connectors through the plugin (KVPOLICY_RULES=shipped): {len(cases) - len(diffs)} of "
              f"{len(cases)} answer vLLM's gate and head order, or refuse with it: {dict(sorted(seen.items()))}")
    assert not diffs, "\n".join(diffs[:25])
    # cross-layer for a connector that prefers it, alone and beside OffloadingConnector or NIXL; per layer
    # for one that does not (its own False, or the base class's)
    cross = Counter(label.split()[0] for (label, _), a in zip(cases, answers) if a["vllm"].get("uniform") is True)
    assert {"PrefersCrossLayer", "PrefersCrossLayerHND", "Multi[Offloading,PrefersCrossLayer]",
            "Multi[Nixl(on),PrefersCrossLayer]"} <= set(cross)
    assert not {"PrefersPerLayerHND", "RequiresHND", "Multi[Offloading,PrefersPerLayerHND]"} & set(cross)
    assert seen["uniform=True HND"] >= 6 and seen["uniform=False HND"] >= 20


def _is_block_stride(facts: dict[str, Any], backend: str) -> bool:
    return facts["backends"][backend]["by_layout"]["NHD"]["indexes_kv_by_block_stride"] is True


def test_rules_without_vllms_gate_conditions_never_make_vllm_allocate_cross_layer_where_it_cannot(
        run: dict[str, Any], capsys: Any) -> None:
    """A rule set written from scratch prefers cross-layer and has no rule for vLLM's gate conditions.
    The plugin answers cross-layer only where vLLM's allocate_uniform_kv_caches can lay the model out
    (one KV cache group of one attention group, an attention spec, a backend indexing KV by the block
    stride), with the head order vLLM fixed (a connector without rules keeps the one it requires), and
    stops start-up naming the missing requirement elsewhere, instead of vLLM's AssertionError; on 0.24-0.25 it
    also stops a per-token-head cache that vLLM would allocate cross-layer with every layer's scales on the
    same bytes (vLLM issue #48412), naming that."""
    rule_file = str(run["dirs"]["scratch"] / "global.yaml")
    scratch = LayoutEngine.from_path(run["dirs"]["scratch"], shipped_rules=False, vllm_version=run["version"])
    baseline = {id(d): a["vllm"] for d, a in zip(run["space"], run["by"]["gate"])}
    diffs, seen = [], Counter()
    for d, answer in zip(run["scratch"], run["by"]["site-scratch"]):
        plugin = answer["plugin"]
        if plugin.get("before") or "error" in baseline[id(d)]:  # vLLM refuses these itself
            continue
        fits = (len(d.groups) == 1 and d.groups[0][1] == 1 and d.groups[0][0] != "mamba"
                and _is_block_stride(run["facts"], d.backend))
        # 0.24-0.25: vLLM allocates it, but every layer's per-token-head scales land on the same bytes
        unsafe = fits and run["version"] in PER_LAYER_SCALE_VIEWS and "per_token_head" in d.kv_cache_dtype
        if "error" in plugin:
            if "error[vllm-requirement]" in plugin["error"]:
                seen["stopped: vLLM cannot allocate it"] += 1
                if (fits and not unsafe) or (unsafe and "vLLM issue #48412" not in plugin["error"]) \
                        or f"{rule_file}:3:5: error[vllm-requirement]: rule `site-prefers-cross-layer`" \
                        not in plugin["error"]:
                    diffs.append(f"{d.label()}: {plugin['error'][:300]}")
            elif (why := _as_scratch_rules_say(run, scratch, d, plugin["error"], baseline[id(d)])) is not None:
                diffs.append(f"{d.label()}: {why}")
            else:
                seen["stopped: other"] += 1
        else:
            seen[f"uniform={plugin['uniform']}"] += 1
            if plugin["uniform"] and (unsafe or not fits):
                diffs.append(f"{d.label()}: cross-layer where vLLM cannot allocate it")
    with capsys.disabled():
        print(f"\na rule set written from scratch (prefer cross-layer, none of vLLM's gate conditions): "
              f"{dict(sorted(seen.items()))}")
    assert not diffs, "\n".join(diffs[:25])
    assert seen["stopped: vLLM cannot allocate it"] > 500 // run["stride"]
    assert seen["uniform=True"] > 100 // run["stride"]


def _as_scratch_rules_say(run: dict[str, Any], engine: LayoutEngine, d: Deployment, error: str,
                         vllm: dict[str, Any]) -> str | None:
    """None when the plugin's start-up error, for no gate condition of vLLM's, is the scratch rules' own
    refusal: no layout survives them, the same rules named; or their layout has another head order than
    the one vLLM fixed (``error[head-order-fixed]``). Else what differs."""
    expected = _expected(engine, d)
    if "blamed" in expected:
        ok = (error.startswith("StartupError: kvpolicy: no KV cache layout survives")
              and set(_plugin_blamed(error)) == set(expected["blamed"]))
        return None if ok else f"the rules blame {expected['blamed']}; the plugin: {error[:300]}"
    layout = expected["layout"]
    allocated = vllm_layout(run["facts"]["backends"][d.backend], vllm["head_order"],
                            layout.placement.value == "cross_layer")
    if allocated != layout.value and "error[head-order-fixed]" in error:
        return None
    return f"the rules decide {layout} (vLLM fixed {vllm['head_order']}); the plugin: {error[:300]}"


def test_the_runner_allocates_what_the_plugin_answers(run: dict[str, Any]) -> None:
    index = {id(d): i for i, d in enumerate(run["space"])}
    checked = Counter()
    for d, answer in zip(run["runner_sample"], run["by"]["runner"]):
        plugin = run["by"]["gate"][index[id(d)]]["plugin"]
        if "error" in plugin:
            continue
        assert answer == {"allocation": "cross_layer" if plugin["uniform"] else "per_layer"}, (d.label(), answer)
        checked[answer["allocation"]] += 1
    assert checked["cross_layer"] >= 5 and checked["per_layer"] >= 100, checked


def _expected(engine: LayoutEngine, d: Deployment) -> dict[str, Any]:
    try:
        return {"layout": engine.decide(explain=False, **d.decide_inputs(engine.profile.name)).layout}
    except NoLayoutError as exc:
        return {"blamed": re.findall(r"rule `([^`]+)`", exc.render())}


def _site_phase(run: dict[str, Any], name: str, deployments: list[Deployment]) -> tuple[list[str], Counter]:
    """Each answer is the site rules' decision as vLLM allocates it: the gate answers its placement, and
    the head order vLLM fixed is its head order, or start-up stops naming why."""
    engine = LayoutEngine.from_path(run["dirs"][name], vllm_version=run["version"])
    baseline = {id(d): a["vllm"] for d, a in zip(run["space"], run["by"]["gate"])}
    diffs, seen = [], Counter()
    for d, answer in zip(deployments, run["by"][f"site-{name}"]):
        plugin, vllm, expected = answer["plugin"], baseline[id(d)], _expected(engine, d)
        if plugin.get("before"):
            continue
        if d.shape == "mamba_only":
            # no attention: the plugin decides for the Mamba group's own backend, which `decide_inputs` does not
            # model (it names the attention backend, so `expected` is not the plugin's input): nothing to lay
            # out cross-layer and no head order to order, so vLLM's answer kept per layer, or vLLM's refusal
            if "error" in vllm:
                ok = _same_refusal(vllm, plugin) is None
            else:
                ok = plugin == {"uniform": False, "head_order": vllm["head_order"]}
            seen["mamba only"] += 1
        elif "blamed" in expected:
            ok = "error" in plugin and set(re.findall(r"rule `([^`]+)`", plugin["error"])) == set(expected["blamed"])
            seen["no layout"] += 1
        elif "error" in vllm:
            ok = False
        else:
            layout = expected["layout"]
            cross = layout.placement.value == "cross_layer"
            allocated = vllm_layout(run["facts"]["backends"][d.backend], vllm["head_order"], cross)
            if allocated == layout.value:
                ok = plugin == {"uniform": cross, "head_order": vllm["head_order"]}
                seen["changed" if plugin.get("uniform") != vllm["uniform"] else "same"] += 1
            else:  # the head order vLLM fixed is not the rules': start-up stops
                ok = "error" in plugin and "error[head-order-fixed]" in plugin["error"]
                seen["head order fixed"] += 1
        if not ok:
            diffs.append(f"{d.label()}: rules {expected}, plugin {plugin}, vLLM {vllm}")
    return diffs, seen


def test_site_rules_keep_offloading_and_nixl_per_layer(run: dict[str, Any], capsys: Any) -> None:
    for name, rule, top in (("offloading", "site-offloading-per-layer", "OffloadingConnector"),
                            ("nixl", "site-nixl-per-layer", "NixlConnector")):
        diffs, seen = _site_phase(run, name, run[name])
        with capsys.disabled():
            print(f"\nsite rule `{rule}`: {sum(seen.values()) - len(diffs)} of {sum(seen.values())} deployments "
                  f"are the rules' answer through vLLM's gate: {dict(seen)}")
        assert not diffs, "\n".join(diffs[:25])
        assert seen["changed"] > 20 // run["stride"]  # vLLM's gate says cross-layer there; the site rule: per layer
        # the site rule holds wherever that connector is configured by that name
        assert not [d.label() for d, a in zip(run[name], run["by"][f"site-{name}"])
                    if d.connector == top and a["plugin"].get("uniform")]


def test_a_head_order_vllm_already_fixed_stops_start_up_located(run: dict[str, Any], capsys: Any) -> None:
    diffs, seen = _site_phase(run, "nhd", run["nhd"])
    assert not diffs, "\n".join(diffs[:25])
    rule_file = str(run["dirs"]["nhd"] / "global.yaml")
    fixed = [a["plugin"]["error"] for a in run["by"]["site-nhd"] if "head-order-fixed" in a["plugin"].get("error", "")]
    assert seen["head order fixed"] == len(fixed) > 100 // run["stride"]
    example = fixed[0]
    assert example.startswith("StartupError: kvpolicy: the rules decided ")
    assert re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[head-order-fixed\]: rule `site-requires-nhd` "
                     r"\(require, global\) removed", example), example
    assert "help: set VLLM_KV_CACHE_LAYOUT=NHD" in example
    with capsys.disabled():
        print(f"\nsite rule `site-requires-nhd`: {dict(seen)}; where vLLM fixed HND:\n  {example}")


def test_an_impossible_rule_set_stops_start_up_located(run: dict[str, Any]) -> None:
    assert run["by"]["impossible"][0]["error"] is None
    rule_file = str(run["dirs"]["impossible"] / "global.yaml")
    answers = [a["plugin"] for a in run["by"]["site-impossible"] if not a["plugin"].get("before")]
    assert len(answers) >= 5
    named = Counter()
    for plugin in answers:
        assert plugin["error"].startswith("StartupError: kvpolicy: no KV cache layout survives the rules")
        for rule in ("site-no-per-layer", "site-no-cross-layer"):  # each, where it removed a candidate
            named[rule] += bool(re.search(rf"{re.escape(rule_file)}:\d+:\d+: error\[removed-candidates\]: "
                                          rf"rule `{rule}` \(forbid, global\)", plugin["error"]))
    assert named["site-no-per-layer"] == len(answers) and named["site-no-cross-layer"] >= 3, named


def test_unset_again_vllms_gate_is_back(run: dict[str, Any]) -> None:
    off = run["by"]["off-again"][0]
    assert off["gate_is_vllms"] and _inactive(off["status"])
    answers = run["by"]["off-gate"]
    assert len(answers) == len(run["space"][::2_000 // run["stride"]]) >= 9  # not an empty loop
    assert sum("error" not in a["vllm"] for a in answers) >= 5  # the gate's answers, not only refusals
    for answer in answers:
        assert answer["plugin"] == answer["vllm"]


def test_versions_an_unprofiled_release_stops_a_patch_release_decides_as_its_series(run: dict[str, Any]) -> None:
    name, patch_version = run["profile"].name, _patch(run["version"])
    unknown = run["by"]["unknown-version"][0]
    assert unknown["error"].startswith("PluginError: kvpolicy: no release profile decides for vLLM 0.99.0 while "
                                       "KVPOLICY_RULES="), unknown["error"]
    assert "KVPOLICY_RULES: error[unprofiled-vllm]" in unknown["error"] and "vllm-0.24 (0.24.0)" in unknown["error"]
    assert unknown["gate_is_vllms"] and _inactive(unknown["status"])
    forced = run["by"]["forced"][0]
    assert forced["error"] is None and not forced["gate_is_vllms"] and forced["status"]["profile"] == name
    patch = run["by"]["patch"][0]
    assert patch["error"] is None and not patch["gate_is_vllms"] and patch["status"]["profile"] == name
    assert any(line.startswith(f"WARNING kvpolicy: no release profile lists vLLM {patch_version}; deciding with "
                               f"`{name}`") for line in patch["log"]), patch["log"]
