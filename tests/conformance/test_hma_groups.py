"""vLLM turning its hybrid KV cache manager off by itself: kvpolicy's groups are the release's.

With a KV connector whose class does not implement ``SupportsHMA`` (LMCache, Example, a MultiConnector
with such a member ...) or, for a model with chunked local attention,
``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``, ``VllmConfig.__post_init__`` disables the
hybrid KV cache manager, and the engine core caches sliding-window and chunked-local layers as full
attention in one group (a Mamba hybrid then does not start). For each deployment below, vLLM 0.34.0
and 0.28.0 build the model's specs and groups (``oracles/hma_groups.py``, the model-config oracle's
path with the deployment's ``--kv-transfer-config`` and environment); `build_context` decides the same
deployment. Compared: whether the manager is off (`hybrid_manager_off`; kvpolicy's note
``hybrid-manager-off`` only where vLLM turns it off), the layers of each kind among the groups, each
attention group's heads, head size, block size and page bytes, and the number of KV cache groups
(`KVCacheGroups.count`, vLLM's); a deployment vLLM refuses must be refused by kvpolicy. ``pytest -s``
prints the table and the counts.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import asked_ahead
import pytest
from vllm_release import run_oracle

from kvpolicy.engine.inputs import build_context, hybrid_manager_off
from kvpolicy.policy.connectors import ConnectorConfig
from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.hf_config import kv_groups_from_hf_config
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import AttentionKind, KVCacheGroups

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
RELEASES = ("0.34.0", "0.28.0")
BLOCK_SIZE = 16


def _ktc(name: str, *members: str) -> dict[str, Any]:
    out: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both"}
    if members:
        out["kv_connector_extra_config"] = {"connectors": [{"kv_connector": m, "kv_role": "kv_both"} for m in members]}
    return out


# (config, label, kv_transfer_config or None, VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE,
#  --disable-hybrid-kv-cache-manager: True, --enable-hybrid-kv-cache-manager: False, neither: None)
DEPLOYMENTS: tuple[tuple[str, str, dict[str, Any] | None, bool, bool | None], ...] = (
    ("gemma-3-1b-it", "lmcache", _ktc("LMCacheConnectorV1"), True, None),
    ("gemma-3-1b-it", "multi-nixl-lmcache", _ktc("MultiConnector", "NixlConnector", "LMCacheConnectorV1"), True,
     None),
    ("gemma-3-1b-it", "multi-nixl-offloading", _ktc("MultiConnector", "NixlConnector", "OffloadingConnector"), True,
     None),
    ("gemma-2-2b-it", "lmcache", _ktc("LMCacheConnectorV1"), True, None),
    ("gemma-2-2b-it", "nixl", _ktc("NixlConnector"), True, None),
    ("gpt-oss-20b", "lmcache", _ktc("LMCacheConnectorV1"), True, None),
    ("gpt-oss-20b", "example", _ktc("ExampleConnector"), True, None),
    ("gpt-oss-20b", "offloading", _ktc("OffloadingConnector"), True, None),
    ("llama-4-scout-17b-16e-instruct", "chunked-env-0", None, False, None),
    ("llama-4-scout-17b-16e-instruct", "chunked-env-unset", None, True, None),
    ("jamba-v0.1", "lmcache", _ktc("LMCacheConnectorV1"), True, None),
    ("mistral-7b-v0.1", "lmcache", _ktc("LMCacheConnectorV1"), True, None),
    ("llama-3.1-8b-instruct", "lmcache", _ktc("LMCacheConnectorV1"), True, None),
    ("gemma-3-1b-it", "disable-flag", None, True, True),
    ("gemma-3-1b-it", "lmcache-enable-flag", _ktc("LMCacheConnectorV1"), True, False),
    ("jamba-v0.1", "disable-flag", None, True, True),
    ("llama-3.1-8b-instruct", "disable-flag", None, True, True),
    ("llama-4-scout-17b-16e-instruct", "chunked-env-0-enable-flag", None, False, False),
    ("llama-4-scout-17b-16e-instruct", "disable-flag", None, True, True),
)
_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding_window", "MLAAttentionSpec": "mla",
          "MambaSpec": "mamba", "ChunkedLocalAttentionSpec": "chunked_local"}
_FIELDS = ("num_kv_heads", "head_size", "block_size", "page_size_bytes")
ROWS: list[tuple[str, str, str, str, str]] = []
_ASKED: dict[str, list[dict[str, Any]]] = {}


def start_ahead(items: list[pytest.Item]) -> None:
    """Each selected release's one oracle call asked ahead (asked_ahead.py)."""
    import ahead

    asked_ahead.queue("hma_groups", ahead.params(items, "version"), _ask)


def _answers(version: str) -> list[dict[str, Any]]:
    return asked_ahead.take("hma_groups", version, _ask)


def _ask(version: str) -> list[dict[str, Any]]:
    if version not in _ASKED:
        cases = [{"config": json.loads((CORPUS / name / "config.json").read_text(encoding="utf-8")),
                  "kv_transfer_config": ktc, "allow_chunked_local": allow, "block_size": BLOCK_SIZE,
                  "disable_hybrid_kv_cache_manager": manager}
                 for name, _, ktc, allow, manager in DEPLOYMENTS]
        _ASKED[version] = run_oracle(version, "hma_groups", cases, timeout=1800)
    return _ASKED[version]


def _kind(spec: dict[str, Any]) -> str:
    """The group's allocation kind by its spec class (a promoted chunked-local layer keeps its
    ``attention_chunk_size`` in a ``FullAttentionSpec``: cached as full attention)."""
    return _KINDS.get(spec["type"], spec["type"])


def _vllm_groups(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """vLLM's groups by kind: the layers of that kind and each compared field (a sorted list where groups differ)."""
    out: dict[str, dict[str, Any]] = {}
    for group in answer["groups"]:
        entry = out.setdefault(_kind(group["spec"]), {"layers": 0})
        entry["layers"] += len(group["layers"])
        if entry is not out.get("mamba"):
            for field in _FIELDS:
                entry.setdefault(field, set()).add(group["spec"].get(field))
    for entry in out.values():
        for field in _FIELDS:
            if field in entry:
                entry[field] = next(iter(entry[field])) if len(entry[field]) == 1 else sorted(entry[field])
    return out


def _ours_groups(groups: KVCacheGroups) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for group in groups.groups:
        spec = group.spec
        entry = out.setdefault(spec.kind.value, {"layers": 0})
        entry["layers"] += spec.num_layers
        if spec.kind is not AttentionKind.mamba:
            entry.update({f: getattr(spec, f) for f in _FIELDS})
    return out


def _decide(name: str, ktc: dict[str, Any] | None, allow: bool, manager: bool | None, version: str
            ) -> tuple[KVCacheGroups | PolicyError, bool]:
    """kvpolicy's groups (or refusal), and whether it said that vLLM turns the hybrid manager off."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ctx = build_context(model=CORPUS / name, block_size=BLOCK_SIZE, kv_transfer_config=ktc,
                                vllm_version=version, allow_chunked_local_attn_with_hybrid_kv_cache=allow,
                                disable_hybrid_kv_cache_manager=manager)
        except PolicyError as exc:
            return exc, False
    return ctx.groups, any("warning[hybrid-manager-off]" in str(w.message) for w in caught)


# Refusing for the same reason: (vLLM's stage, a substring of its error) -> kvpolicy's diagnostic code.
# Without the hybrid manager, vLLM cannot put a hybrid model's specs in one group ("Failed to promote");
# an explicitly enabled manager it does not support is refused at VllmConfig; kvpolicy says both as
# `needs-hybrid-manager`, located at the connector or the flag that turns the manager off or on.
_SAME_REASON: tuple[tuple[str, str, str], ...] = (
    ("groups", "Failed to promote local KV cache specs to one unified type", "needs-hybrid-manager"),
    ("vllm_config", "Hybrid KV cache manager was explicitly enabled but is not supported", "needs-hybrid-manager"),
)


def _other_reason(vllm: dict[str, Any], ours: PolicyError) -> str | None:
    """None when kvpolicy refuses for vLLM's reason (`_SAME_REASON`); else what kvpolicy said instead."""
    codes = {d.code for d in ours.diagnostics}
    if any(vllm.get("stage") == stage and said in vllm["error"] and code in codes
           for stage, said, code in _SAME_REASON):
        return None
    return "kvpolicy refuses for another reason: " + "; ".join(f"{d.code}: {d.message[:100]}" for d in ours.diagnostics)


def judge(index: int, version: str) -> tuple[str, str]:
    """(outcome, why) for one deployment on one release."""
    name, _, ktc, allow, manager = DEPLOYMENTS[index]
    vllm = _answers(version)[index]
    ours, off = _decide(name, ktc, allow, manager, version)
    if vllm.get("error"):
        if isinstance(ours, PolicyError):
            if (other := _other_reason(vllm, ours)) is not None:
                return "different", f"vLLM refuses at {vllm.get('stage')} ({vllm['error'][:120]}); {other}"
            return "both refuse", (f"vLLM at {vllm.get('stage')}: {vllm['error'][:120]}; "
                                   f"kvpolicy: {ours.diagnostics[0].code}")
        return "different", f"vLLM refuses at {vllm.get('stage')} ({vllm['error'][:120]}); kvpolicy answers"
    if isinstance(ours, PolicyError):
        return "different", f"kvpolicy refuses ({ours.diagnostics[0].message}); vLLM answers"
    why = []
    if off and not vllm["hybrid_manager_disabled"]:
        why.append("kvpolicy says vLLM turns the hybrid manager off; vLLM keeps it")
    connector = None if ktc is None else ConnectorConfig.from_vllm(ktc["kv_connector"],
                                                                   ktc.get("kv_connector_extra_config"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the model's own notes: said by _decide's context already
        model = kv_groups_from_hf_config(CORPUS / name, block_size=BLOCK_SIZE, vllm_version=version)
    off = hybrid_manager_off(get_profile(version), model, connector, allow, manager) is not None  # for any model
    if off != vllm["hybrid_manager_disabled"]:
        why.append(f"hybrid manager off: vLLM {vllm['hybrid_manager_disabled']}, kvpolicy {off}")
    theirs, mine = _vllm_groups(vllm), _ours_groups(ours)
    if set(theirs) != set(mine):
        why.append(f"kinds: vLLM {sorted(theirs)}, kvpolicy {sorted(mine)}")
    for kind in sorted(set(theirs) & set(mine)):
        for field in ("layers", *_FIELDS):
            if field in theirs[kind] and theirs[kind][field] != mine[kind].get(field):
                why.append(f"{kind}.{field}: vLLM {theirs[kind][field]}, kvpolicy {mine[kind].get(field)}")
    if len(vllm["groups"]) != ours.count:
        why.append(f"groups: vLLM {len(vllm['groups'])}, kvpolicy {ours.count}")
    shown = ", ".join(f"{k} x{v['layers']}" for k, v in mine.items())
    return ("different" if why else "equal"), "; ".join(why) or f"manager {'off' if off else 'on'}: {shown}"


@pytest.fixture(scope="module", autouse=True)
def _table() -> Any:
    yield
    for row in sorted(ROWS):
        print("  ".join(row))
    for version in RELEASES:
        outcomes = [r[3] for r in ROWS if r[2] == version]
        print(f"vLLM {version}: {len(outcomes)} deployments, " + ", ".join(
            f"{o} {outcomes.count(o)}" for o in sorted(set(outcomes))))


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("index", range(len(DEPLOYMENTS)), ids=[f"{d[0]}-{d[1]}" for d in DEPLOYMENTS])
def test_groups_with_the_hybrid_manager_as_vllm_leaves_it(index: int, version: str, vllm_sites: Any) -> None:
    outcome, why = judge(index, version)
    ROWS.append((DEPLOYMENTS[index][0], DEPLOYMENTS[index][1], version, outcome, why))
    assert outcome != "different", f"{DEPLOYMENTS[index][:2]} on vLLM {version}: {why}"


def test_the_comparison_sees_a_split_group(vllm_sites: Any) -> None:
    """The comparison itself: kvpolicy's groups without the promotion (the hybrid manager kept on) differ
    from vLLM's answer for Gemma-3 with LMCache (a comparison that cannot fail would pass every row)."""
    index = next(i for i, d in enumerate(DEPLOYMENTS) if d[:2] == ("gemma-3-1b-it", "lmcache"))
    vllm = _answers("0.34.0")[index]
    assert vllm["hybrid_manager_disabled"] is True
    kept, _ = _decide("gemma-3-1b-it", None, True, None, "0.34.0")
    assert isinstance(kept, KVCacheGroups) and _vllm_groups(vllm).keys() != _ours_groups(kept).keys()
