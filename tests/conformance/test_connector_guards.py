"""kvpolicy's connector guards on vLLM's own classes, under every release a profile answers for.

One oracle subprocess per release (``oracles/connector_guards.py``), kvpolicy installed from a wheel
of this checkout (``plugin_site.py``), drives:

- **NixlConnector**: vLLM's ``NixlAgentMetadata`` rebound with ``kvpolicy_fingerprint`` round-trips
  through the release's msgspec both ways (old peers decode ours, ours decode theirs with the field
  empty); a ``NixlPullConnector`` / ``NixlPushConnector`` guarded through
  `vllm_exchange.guard_connector` (GUARDS, by vLLM's class names) sends this engine's stamp, and its
  worker's ``_validate_remote_agent_handshake`` (and ``_add_notif_only_remote_agent``, 0.26 on)
  refuses a peer of another block size or head order, naming the fields, and a peer without a stamp
  unless ``KVPOLICY_UNSTAMPED_BLOCKS=accept``, while a peer whose blocks are byte for byte ours goes on
  into vLLM's own checks;
- **OffloadingConnector**: vLLM's ``FileMapper`` after the guard's ``before_create`` keys stores of two
  fingerprints apart (base path, block files, P2P config fingerprint) and one fingerprint alike;
- **MooncakeStoreConnector**: the cache prefix vLLM reads after the guard's ``before_create`` (0.34's
  own ``_resolve_cache_prefix``, "auto" included) keys two fingerprints apart in vLLM's ``PoolKey``,
  keeps the operator's prefix, and the guard refuses a worker keyed without its namespace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ahead
import plugin_site
import pytest
from plugin_site import kvpolicy_site
from profiled_releases import RELEASES

from kvpolicy.engine.exchange import block_digest
from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint_of
from kvpolicy.engine.integrations.connector_guards.mooncake_store_connector import namespace
from kvpolicy.engine.integrations.connector_guards.nixl_connector import FIELD
from kvpolicy.engine.integrations.vllm_exchange import ENV_UNSTAMPED, Stamp, stamp_of
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import KVCacheSpec

ORACLE = "connector_guards"
GUARDS_PACKAGE = Path("kvpolicy", "engine", "integrations", "connector_guards")
QWEN4 = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def _fp(layout: Layout = Layout.LBNHC, backend: str = "TRITON_ATTN", **spec: Any) -> LayoutFingerprint:
    return fingerprint_of(layout, KVCacheSpec(**{**QWEN4, **spec}), get_profile("vllm-0.34").backend(backend))


STAMPS: dict[str, Stamp] = {
    "ours": stamp_of(_fp(), "0.34.0"),
    "block32": stamp_of(_fp(block_size=32), "0.34.0"),  # vLLM's NIXL pairs block sizes itself: its checks decide
    "fp8": stamp_of(_fp(kv_cache_dtype="fp8"), "0.34.0"),  # refused: other cells
    "hnd": stamp_of(_fp(Layout.LBHNC), "0.34.0"),  # transcode: the same cells elsewhere
    "flash": stamp_of(_fp(backend="FLASH_ATTN"), "0.34.0"),  # as_is: another backend, the same bytes
}
PEERS = {"match": "ours", "block32": "block32", "fp8": "fp8", "transcode": "hnd", "backend": "flash", "unstamped": None,
         "garbage": "{not a stamp"}
PREFIXES = [None, "team", "auto"]


def _cases(version: str) -> list[dict]:
    stamps = {k: json.dumps(v.to_dict()) for k, v in STAMPS.items()}
    return [
        {"kind": "nixl_wire"},
        {"kind": "nixl", "worker": "pull", "ours": "ours", "unstamped": "miss", "peers": PEERS, "stamps": stamps},
        {"kind": "nixl", "worker": "push", "ours": "ours", "unstamped": "accept", "peers": PEERS, "stamps": stamps},
        {"kind": "file_mapper", "a": "ours", "b": "block32", "stamps": stamps},
        {"kind": "mooncake_store", "a": "ours", "b": "block32", "prefixes": PREFIXES, "stamps": stamps},
    ]


# ---------------------------------------------------------------- the oracle


def start_ahead(items: list[pytest.Item]) -> None:
    """Queue each selected release's oracle (conftest.py, at the end of collection)."""
    plugin_site.start_ahead(ahead.params(items, "run"), ORACLE, _cases)


@pytest.fixture(scope="module", params=RELEASES)
def run(request: pytest.FixtureRequest, vllm_sites: Any) -> dict[str, Any]:
    version = request.param
    answers, _ = plugin_site.take(version, ORACLE, _cases)
    for answer in answers:
        assert "oracle" not in answer, (version, answer.get("oracle"), answer.get("trace"))
        assert answer["vllm"] == version
    wire, pull, push, mapper, store = answers
    return {"version": version, "wire": wire, "pull": pull, "push": push, "mapper": mapper, "store": store}


def _at_least(version: str, other: str) -> bool:
    return tuple(int(p) for p in version.split(".")) >= tuple(int(p) for p in other.split("."))


# ---------------------------------------------------------------- packaging


def test_the_wheel_ships_the_connector_guards() -> None:
    """vLLM imports a guard module when it creates its connector: a wheel without them stops vLLM."""
    shipped = {p.name for p in (kvpolicy_site() / GUARDS_PACKAGE).glob("*.py")}
    assert {"nixl_connector.py", "offloading_connector.py", "mooncake_store_connector.py"} <= shipped, (
        "kvpolicy's wheel has no kvpolicy.engine.integrations.connector_guards: pyproject.toml's "
        "[tool.setuptools] packages must list it, or vLLM fails to create any guarded connector")


# ---------------------------------------------------------------- NIXL


def test_nixl_agent_metadata_with_the_stamp_round_trips_with_old_peers(run: dict[str, Any]) -> None:
    wire = run["wire"]
    assert wire["missing"] is None, wire
    assert wire["rebound"] and wire["subclass"] and wire["metadata_module_kept"], wire
    assert wire["fields_added"] == [FIELD]
    assert wire["old_reads_new"] == {"type": "NixlAgentMetadata", "engine_id": "peer", "has_field": False}
    assert wire["new_reads_old"] == ""  # a peer without kvpolicy: the field's default
    assert wire["new_reads_new"] == "stamp-text"
    assert wire["same_values"], wire
    assert wire["unguarded"], wire


def _outcomes(answer: dict, label: str) -> list[dict]:
    peer = answer["peers"][label]
    return [peer["validate"], *([peer["notif"]] if "notif" in peer else [])]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_sends_this_engines_stamp(run: dict[str, Any], mode: str) -> None:
    answer = run[mode]
    assert answer["guard"] == "NixlGuard", answer
    assert answer["class"] == ("NixlPullConnector" if mode == "pull" else "NixlPushConnector")
    assert answer["sent"]["stamp_digest"] == STAMPS["ours"].view_digest
    assert answer["sent"]["old_decoder_engine_id"] == "ours"
    assert answer["notif_method"] == _at_least(run["version"], "0.26.0"), answer  # push mode's decode side
    assert answer["unguarded"], answer


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_refuses_a_peer_whose_blocks_differ_naming_the_fields(run: dict[str, Any], mode: str) -> None:
    answer = run[mode]
    for outcome in _outcomes(answer, "fp8"):
        assert outcome["by"] == "kvpolicy" and outcome["code"] == "layout-mismatch", outcome
        assert "kv_cache_dtype: ours bfloat16, theirs fp8_e4m3" in outcome["message"], outcome
    for outcome in _outcomes(answer, "transcode"):
        assert outcome["by"] == "kvpolicy" and outcome["code"] == "layout-mismatch", outcome
        assert "head_order: ours NHD, theirs HND" in outcome["message"], outcome
        assert "cannot transcode" in outcome["message"], outcome
    for outcome in _outcomes(answer, "garbage"):
        assert outcome["by"] == "kvpolicy" and outcome["code"] == "stamp-format", outcome


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_lets_a_peer_with_our_bytes_into_vllms_own_checks(run: dict[str, Any], mode: str) -> None:
    # "backend": FLASH_ATTN's blocks are TRITON_ATTN's byte for byte (compare_blocks: as_is); "block32": a peer of
    # another block size, which vLLM's NIXL reconciles (or refuses) itself, as it does another tensor-parallel size
    for label in ("match", "backend", "block32"):
        for outcome in _outcomes(run[mode], label):
            assert outcome["by"] == "vllm" and outcome["in_vllm"], (label, outcome)


def test_nixl_refuses_an_unstamped_peer_unless_accepted(run: dict[str, Any]) -> None:
    for outcome in _outcomes(run["pull"], "unstamped"):  # miss
        assert outcome["by"] == "kvpolicy" and outcome["code"] == "unstamped-peer", outcome
        assert f"{ENV_UNSTAMPED}=accept" in outcome["help"], outcome
    for outcome in _outcomes(run["push"], "unstamped"):  # accept
        assert outcome["by"] == "vllm" and outcome["in_vllm"], outcome
    warnings = [line for line in run["push"]["log"] if "peer-unstamped" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING") and f"{ENV_UNSTAMPED}=accept" in warnings[0]
    assert not run["pull"]["log"], run["pull"]["log"]


# ---------------------------------------------------------------- OffloadingConnector


def test_file_mapper_keeps_stores_of_two_fingerprints_apart(run: dict[str, Any]) -> None:
    vllm, a, again, b, after = run["mapper"]["mappers"]
    assert a["base_path"] == again["base_path"] and a["file"] == again["file"]
    assert len({vllm["base_path"], a["base_path"], b["base_path"]}) == 3, run["mapper"]
    for m in (vllm, a, b):
        assert m["file"].startswith(m["base_path"] + "_r0/"), m
    assert a["field"] == block_digest(STAMPS["ours"].fingerprint)
    assert b["field"] == block_digest(STAMPS["block32"].fingerprint)
    assert vllm["field"] is None
    assert (a["p2p"] is not None) == _at_least(run["version"], "0.25.0"), run["mapper"]  # the P2P tier
    if a["p2p"] is not None:  # a peer of another fingerprint is refused by P2P's own check
        assert len({vllm["p2p"], a["p2p"], b["p2p"]}) == 3 and a["p2p"] == again["p2p"], run["mapper"]
    assert after == {**vllm, "label": "vllm after unguard"}
    assert not run["mapper"]["init_wrapped_after_unguard"]


# ---------------------------------------------------------------- MooncakeStoreConnector


def test_mooncake_store_keys_carry_the_namespace(run: dict[str, Any]) -> None:
    store = run["store"]
    tag_a, tag_b = namespace(STAMPS["ours"]), namespace(STAMPS["block32"])
    assert store["resolver"] == _at_least(run["version"], "0.34.0")
    for row in store["prefixes"]:
        vllm, a, b = row["vllm"], row["ours"], row["block32"]
        assert a["prefix"].startswith(tag_a) and b["prefix"].startswith(tag_b), row
        assert a["key"].startswith(a["prefix"] + "@") and a["key"] != b["key"], row
        assert vllm["key"] not in (a["key"], b["key"]), row
        if row["configured"] == "team":
            assert a["prefix"] == f"{tag_a}-team", row
        elif row["configured"] == "auto" and store["resolver"]:  # 0.34 derives it; the namespace goes in front
            assert a["prefix"].startswith(f"{tag_a}-auto-") and vllm["prefix"].startswith("auto-"), row
            assert a["prefix"].removeprefix(f"{tag_a}-") == vllm["prefix"], row
            assert a["extra"]["cache_prefix"] == "auto", row
        elif row["configured"] is None:
            assert a["prefix"] == tag_a, row


def test_mooncake_store_guard_refuses_keys_without_its_namespace(run: dict[str, Any]) -> None:
    tag = namespace(STAMPS["ours"])
    for row in run["store"]["prefixes"]:
        assert row["ours"]["guard_a"] == "MooncakeStoreGuard", row
        for label in ("vllm", "block32"):  # vLLM's own prefix, another fingerprint's
            refusal = row[label]["guard_a"]
            assert isinstance(refusal, dict) and refusal["code"] == "unstamped-store", (label, row)
            assert f"`{tag}`" in refusal["help"] and row[label]["prefix"][:200] in refusal["message"], refusal
    assert run["store"]["resolver_restored"]
