"""kvpolicy's `vllm-0.28` profile decides as vLLM 0.28.0 does, on every input its decision reads.

One oracle call (`oracles/v028.py`) answers the release's facts and, for every
deployment of `v028_space`, what vLLM's own `use_uniform_kv_cache` and
`get_kv_cache_layout()` say. The layout vLLM allocates is read off the backend's
stride orders in those facts; kvpolicy's decision must be that layout, and a
deployment vLLM refuses must be one kvpolicy refuses.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from v028_space import (
    CONNECTORS,
    ENV_LAYOUTS,
    MHA_SHAPES,
    MLA_SHAPES,
    UNPLANNED_DTYPES,
    VERSION,
    Deployment,
    vllm_layout,
)
from vllm_release import run_oracle

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.errors import InputError, NoLayoutError
from kvpolicy.policy.layouts import HeadOrder
from kvpolicy.policy.releases import get_profile

PROFILE = get_profile(VERSION)


def _space() -> list[Deployment]:
    from v028_space import deployments

    facts_like = {"backends": {b: {"supported_kv_cache_dtypes": list(f.kv_cache_dtypes or ())}
                               for b, f in PROFILE.backends.items()}}
    return deployments(facts_like)


@pytest.fixture(scope="module")
def answered(vllm_sites) -> tuple[dict[str, Any], list[tuple[Deployment, dict[str, Any]]], float]:
    space = _space()
    start = time.perf_counter()
    facts, *answers = run_oracle(VERSION, "v028", [{"facts": True}, *(d.oracle_case() for d in space)])
    return facts, list(zip(space, answers)), time.perf_counter() - start


# ------------------------------------------------------------------------------------ facts


def test_profile_facts_are_the_release_facts(answered) -> None:
    facts, _, _ = answered
    assert facts["vllm_version"] == VERSION
    assert list(PROFILE.kv_cache_dtypes) == facts["kv_cache_dtypes"]
    assert PROFILE.default_block_size == facts["default_block_size"]
    assert facts["get_kv_cache_layout"] == {"None": "NHD", "NHD": "NHD", "HND": "HND"}
    for name, backend in PROFILE.backends.items():
        f = facts["backends"][name]
        assert "error" not in f, (name, f)
        assert backend.mla is f["is_mla"], name
        assert list(backend.kv_cache_dtypes or ()) == f["supported_kv_cache_dtypes"], name
        for head_order in HeadOrder:
            by = f["by_layout"][head_order.value]
            ours = backend.stride_orders[head_order]
            for field, key in (("per_layer", "stride_order"), ("cross_layer", "stride_order_with_layers")):
                theirs = by[key]
                expected = None if isinstance(theirs, dict) and theirs["error"].startswith("NotImplementedError") \
                    else theirs
                got = getattr(ours, field)
                assert (list(got) if got is not None else None) == expected, (name, head_order, field)
            assert get_profile(VERSION).backend(name).indexes_kv_by_block_stride is by["indexes_kv_by_block_stride"]
            for cross in (False, True):
                layout = backend.allocated_layout(head_order, cross)
                if cross and not by["indexes_kv_by_block_stride"]:
                    assert layout is None, name
                else:
                    assert layout is not None and layout.value == vllm_layout(f, head_order.value, cross), name
    # every backend the release's oracle lists that the profile leaves out is one kvpolicy cannot plan
    assert set(facts["backends"]) - set(PROFILE.backends) == {"ROCM_ATTN"}


def test_profile_connectors_are_the_registered_ones(answered) -> None:
    facts, _, _ = answered
    registered = facts["connectors"]
    assert set(PROFILE.connectors) == set(registered)
    for name, cls in PROFILE.connectors.items():
        if "error" in registered[name]:  # the module needs a package the site lacks (lmcache, msgpack)
            assert cls == name
        else:
            assert registered[name]["class"] == cls, name
    # the connectors whose class defines prefer_cross_layer_blocks are the ones the global rule lets through
    own = {n for n, c in registered.items() if "error" not in c and c["prefer_cross_layer_blocks_defined_in"]
           not in (None, "KVConnectorBase_V1")}
    assert own == {"OffloadingConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector",
                   "MooncakeStoreConnector", "MultiConnector", "ExampleHiddenStatesConnector"}
    required = facts["required_kvcache_layout"]
    assert required["OffloadingConnector"]["dense"] == required["OffloadingConnector"]["mla"] == "HND"
    assert required["NixlConnector"] == {"dense": "HND", "get_kv_cache_layout_dense": "HND", "mla": None,
                                         "get_kv_cache_layout_mla": "NHD"}


# -------------------------------------------------------------------------------- decisions


def _kvpolicy(engine: LayoutEngine, d: Deployment) -> str:
    try:
        return engine.decide(explain=False, **d.decide_inputs()).layout.value
    except NoLayoutError:
        return "error"


def _vllm(facts: dict[str, Any], d: Deployment, answer: dict[str, Any]) -> str:
    if "error" in answer:
        return "error"
    return vllm_layout(facts["backends"][d.backend], answer["head_order"], answer["uniform"])


def test_every_decision_is_vllm_s(answered, capsys) -> None:
    facts, pairs, oracle_s = answered
    engine = LayoutEngine.default(VERSION)
    start = time.perf_counter()
    mismatches = []
    seen: Counter[str] = Counter()
    for d, answer in pairs:
        ours, theirs = _kvpolicy(engine, d), _vllm(facts, d, answer)
        seen[theirs] += 1
        if d.shape == "mamba_only" and theirs != "error":
            # no attention layer: only the placement is a decision (the head order has nothing to order)
            ours, theirs = ours[:1] == "B", answer["uniform"]
        if ours != theirs:
            mismatches.append(f"{d.label()}: kvpolicy {ours}, vLLM {theirs} ({answer})")
    decide_s = time.perf_counter() - start
    backends = Counter(d.backend for d, _ in pairs)
    with capsys.disabled():
        print(f"\nvLLM {VERSION} decisions: {len(pairs) - len(mismatches)} of {len(pairs)} equal "
              f"(oracle {oracle_s:.0f} s, kvpolicy {decide_s:.1f} s)\n"
              f"  dimensions: (backend x its kv_cache_dtypes) {sum(1 for _ in _pairs(pairs))} pairs over "
              f"{len(backends)} backends; model shapes {len(MHA_SHAPES)} MHA / {len(MLA_SHAPES)} MLA; "
              f"{len(CONNECTORS)} connector configs; VLLM_KV_CACHE_LAYOUT {len(ENV_LAYOUTS)}\n"
              f"  vLLM's layouts: {dict(sorted(seen.items()))}")
    assert not mismatches, f"{len(mismatches)} of {len(pairs)} differ:\n" + "\n".join(mismatches[:40])


def _pairs(pairs: list[tuple[Deployment, dict[str, Any]]]) -> set[tuple[str, str]]:
    return {(d.backend, d.kv_cache_dtype) for d, _ in pairs}


def test_the_space_reaches_every_outcome(answered) -> None:
    """Every layout of the profile is vLLM's answer somewhere, and so is a refusal."""
    facts, pairs, _ = answered
    outcomes = {_vllm(facts, d, a) for d, a in pairs}
    assert outcomes >= {x.value for x in PROFILE.layouts} | {"error"}


def test_unsupported_dtypes_are_refused_and_unplanned_ones_named(answered) -> None:
    facts, _, _ = answered
    engine = LayoutEngine.default(VERSION)
    base = {"spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, "connector": "OffloadingConnector"}
    # vLLM's validate_configuration refuses a backend for a kv_cache_dtype it does not list
    with pytest.raises(InputError) as exc:
        engine.decide(backend="FLASH_ATTN", kv_cache_dtype="fp8_per_token_head", **base)
    assert exc.value.diagnostics[0].code == "unsupported-kv-cache-dtype"
    # FLASHINFER accepts nvfp4 in 0.28: kvpolicy decides it (above, with vLLM's gate) but cannot plan it
    assert set(UNPLANNED_DTYPES) <= set(facts["backends"]["FLASHINFER"]["supported_kv_cache_dtypes"])
    for dtype in UNPLANNED_DTYPES:
        engine.decide(backend="FLASHINFER", kv_cache_dtype=dtype, **base)
        with pytest.raises(InputError) as exc:
            engine.plan(num_blocks=4, backend="FLASHINFER", kv_cache_dtype=dtype, **base)
        (diag,) = exc.value.diagnostics
        assert diag.code == "unplanned-kv-cache-dtype" and diag.file == "kv_cache_dtype", diag
        assert f"`{dtype}` on backend `FLASHINFER` but cannot plan it" in diag.message and "0.24-0.28" in diag.message
