"""kvpolicy's uniform-gate profiles (vllm-0.24 ... vllm-0.28) hold each release's facts and decide as
that release does, on every input its decision reads.

One oracle call per release (`gate_oracle.gate_answers`, under the release: `oracles/v028.py`)
answers the release's facts and, for every deployment of `v028_space`, what vLLM's own
`use_uniform_kv_cache` and `get_kv_cache_layout()` say. The profile's facts must be what
`release_facts_gate.profile_facts_from_oracle` reads off that answer, field by field. The layout
vLLM allocates is read off the backend's stride orders in those facts; kvpolicy's decision must be
that layout, and a deployment vLLM refuses must be one kvpolicy refuses.

One deliberate divergence, 0.24 and 0.25 only: their gate gives a per-token-head cache a
cross-layer buffer when the connector prefers it, while their Triton backend builds the inline-scale
views as if each layer's buffer were contiguous (vLLM issue #48412). kvpolicy keeps those caches per
layer (rules/vllm-gate-per-token-head); each such deployment is counted only where kvpolicy's
geometry verifier proves that vLLM's layout puts two writers on one byte.

Patch releases (0.25.1, 0.27.1): their installed vLLM differs from the series release's in no
file kvpolicy models (checked file by file), their facts are the series profile's, and a sample of
the space decides the same.
"""

from __future__ import annotations

import dataclasses
import filecmp
import functools
import time
from collections import Counter
from typing import Any

import install_vllm
import pytest
from gate_oracle import PATCH_STRIDE, PER_LAYER_SCALE_VIEWS, GateAnswers, deliberate, gate_answers, overlaps, space
from release_facts_gate import profile_facts_from_oracle
from test_v034_decisions import _vllm_error_kind, primary
from v028_space import (
    CONNECTORS,
    ENV_LAYOUTS,
    GATE_PATCHES,
    GATE_RELEASES,
    MHA_SHAPES,
    MLA_SHAPES,
    UNPLANNED_DTYPES,
    Deployment,
    vllm_layout,
)

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.errors import InputError, NoLayoutError
from kvpolicy.policy.layouts import HeadOrder
from kvpolicy.policy.releases import BackendFacts, Geometry, ReleaseProfile, get_profile

# The files of a patch release that differ from its series release's, none of which kvpolicy models
# (fused-MoE and all-reduce fusion, multimodal video, torchcodec probing, type hints, the version).
PATCH_CHANGES = {
    "0.25.1": {"vllm/_version.py", "vllm/compilation/passes/fusion/allreduce_rms_fusion.py",
               "vllm/model_executor/layers/fused_moe/layer.py", "vllm/multimodal/video.py",
               "vllm/utils/import_utils.py", "vllm/v1/kv_offload/tiering/p2p/manager.py"},
    "0.27.1": {"vllm/_version.py", "vllm/model_executor/models/qwen3_dspark.py"},
}


@pytest.fixture(scope="module", params=GATE_RELEASES)
def answered(request: pytest.FixtureRequest, vllm_sites: Any) -> GateAnswers:
    return gate_answers(request.param)


# ------------------------------------------------------------------------------------ facts


def _comparable(profile: ReleaseProfile, fields: dict[str, Any]) -> dict[str, Any]:
    """The profile's resolved value of each of ``fields``, in the form the tool writes (JSON)."""
    dumped = profile.model_dump(mode="json")
    out = {k: dumped[k] for k in fields}
    out["backends"] = {name: {k: v for k, v in facts.items() if k in fields["backends"].get(name, {})}
                       for name, facts in dumped["backends"].items()}
    return out


def test_profile_facts_are_the_release_facts(answered: GateAnswers) -> None:
    facts, profile = answered.facts, answered.profile
    assert facts["vllm_version"] == answered.version
    derived = profile_facts_from_oracle(facts)
    # each backend's fields the tool states, with the model's defaults for those it leaves out (kv_dim)
    derived["backends"] = {n: BackendFacts.model_validate(b).model_dump(mode="json", include={*b, "kv_dim"})
                           for n, b in derived["backends"].items()}
    ours = _comparable(profile, derived)
    differ = {k: (ours[k], v) for k, v in derived.items() if ours[k] != v}
    assert not differ, f"{profile.name} vs vLLM {answered.version}: {differ}"
    assert facts["get_kv_cache_layout"] == {"None": "NHD", "NHD": "NHD", "HND": "HND"}
    # the geometry kvpolicy chose for the profile is the one the backends' cache shapes have
    assert (profile.geometry is Geometry.kv_dim) is any(b.kv_dim for b in profile.backends.values())
    for name, backend in profile.backends.items():
        by_layout = facts["backends"][name]["by_layout"]
        for head_order in HeadOrder:
            by = by_layout[head_order.value]
            assert profile.backend(name).indexes_kv_by_block_stride is by["indexes_kv_by_block_stride"], name
            for cross in (False, True):
                layout = backend.allocated_layout(head_order, cross)
                if cross and not by["indexes_kv_by_block_stride"]:
                    assert layout is None, name
                else:
                    assert layout is not None and layout.value == vllm_layout(
                        facts["backends"][name], head_order.value, cross), name
    # every backend the release's oracle lists that the profile leaves out is one kvpolicy cannot plan
    assert set(facts["backends"]) - set(profile.backends) == {"ROCM_ATTN"}


def test_profile_connectors_are_the_registered_ones(answered: GateAnswers) -> None:
    facts, profile = answered.facts, answered.profile
    registered = facts["connectors"]
    assert set(profile.connectors) == set(registered)
    # the connectors whose class defines prefer_cross_layer_blocks are the ones the global rule lets through
    own = {n for n, c in registered.items() if "error" not in c and c["prefer_cross_layer_blocks_defined_in"]
           not in (None, "KVConnectorBase_V1")}
    assert own == {"OffloadingConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector",
                   "MooncakeStoreConnector", "MultiConnector", "ExampleHiddenStatesConnector"}
    required = facts["required_kvcache_layout"]
    assert required["OffloadingConnector"]["dense"] == required["OffloadingConnector"]["mla"] == "HND"
    assert required["NixlConnector"] == {"dense": "HND", "get_kv_cache_layout_dense": "HND", "mla": None,
                                         "get_kv_cache_layout_mla": "NHD"}


@pytest.mark.parametrize("patch", sorted(GATE_PATCHES))
def test_a_patch_release_changes_no_file_kvpolicy_models(patch: str, vllm_sites: Any) -> None:
    """Every Python file of the patch release's vLLM is byte-identical to its series release's, but for
    the listed files, none of which the gate, the backends, the config or the connectors read."""
    ours, theirs = install_vllm.site_for(patch) / "vllm", install_vllm.site_for(GATE_PATCHES[patch]) / "vllm"
    a = {p.relative_to(ours.parent).as_posix() for p in ours.rglob("*.py")}
    b = {p.relative_to(theirs.parent).as_posix() for p in theirs.rglob("*.py")}
    assert a == b, sorted(a ^ b)[:20]
    changed = {f for f in sorted(a) if not filecmp.cmp(ours.parent / f, theirs.parent / f, shallow=False)}
    assert changed == PATCH_CHANGES[patch]
    assert get_profile(patch) is get_profile(GATE_PATCHES[patch])


# -------------------------------------------------------------------------------- decisions


def _refusal(engine: LayoutEngine, d: Deployment, version: str) -> tuple[str, list[str]]:
    """(layout or ``error``, a refusal's primary reason: `test_v034_decisions.primary_reason`, not every
    rule it names, so that vLLM's reason is the one kvpolicy refuses for)."""
    try:
        return engine.decide(explain=False, **d.decide_inputs(version)).layout.value, []
    except NoLayoutError as exc:
        return "error", [primary(exc) or "nothing named"]


def _vllm(facts: dict[str, Any], d: Deployment, answer: dict[str, Any]) -> str:
    if "error" in answer:
        return "error"
    return vllm_layout(facts["backends"][d.backend], answer["head_order"], answer["uniform"])


# The gate releases' own refusals (exact error texts) -> the rule kvpolicy's refusal must name; the others
# are the resolver releases' (`test_v034_decisions._VLLM_ERRORS`), shared by every release.
_GATE_ERRORS = {
    # 0.25-0.27: get_uniform_page_size's bare `assert` when int4's full and sliding-window pages differ
    "AssertionError: ": "int4-full-and-sliding-window-pages-differ",
}


_INT4_PAGES = "int4-full-and-sliding-window-pages-differ"


def _same_refusal(answer: dict[str, Any], blamed: list[str], also: Any = None) -> str | None:
    """None when kvpolicy refuses as vLLM did (vLLM's error mapped to the rule kvpolicy must name); else
    what differs. ``also()``: kvpolicy's refusal of the same deployment without int4's page conflict, asked
    where kvpolicy names that conflict and vLLM stops on an earlier check: vLLM's reason must hold there."""
    if answer["error"] in _GATE_ERRORS:
        rule = _GATE_ERRORS[answer["error"]]
        return None if rule in blamed else f"vLLM refuses ({rule}); kvpolicy's refusal names {blamed}"
    kind = _vllm_error_kind(answer["error"])
    if kind is None:
        return f"vLLM refused in a way the test does not map: {answer['error'][:160]}"
    _, cls, marker = kind
    if cls is NoLayoutError and any(marker in b for b in blamed):
        return None
    if cls is NoLayoutError and _INT4_PAGES in blamed and also is not None:
        layout, without = also()
        if layout == "error" and any(marker in b for b in without):
            return None
    return f"vLLM refuses ({marker}); kvpolicy's refusal names {blamed}"


def test_every_decision_is_vllm_s(answered: GateAnswers, capsys: pytest.CaptureFixture[str]) -> None:
    version, facts, pairs = answered.version, answered.facts, answered.decisions
    engine = LayoutEngine.default(version)
    start = time.perf_counter()
    mismatches, kept = [], Counter()
    seen: Counter[str] = Counter()
    refusals = 0
    for d, answer in pairs:
        (ours, blamed), theirs = _refusal(engine, d, version), _vllm(facts, d, answer)
        seen[theirs] += 1
        if ours == theirs == "error":
            also = functools.partial(_refusal, engine, dataclasses.replace(d, kv_cache_dtype="auto"), version)
            if (why := _same_refusal(answer, blamed, also)) is not None:
                mismatches.append(f"{d.label()}: {why}")
            else:
                refusals += 1
            continue
        if d.shape == "mamba_only" and "error" not in (ours, theirs):
            # no attention layer: only the placement is a decision (the head order has nothing to order);
            # a refusal on either side stays "error", a difference from the other side's answer
            ours, theirs = ours[:1] == "B", answer["uniform"]
        if ours != theirs:
            if deliberate(version, d, ours, theirs):
                kept[f"{d.backend} {d.kv_cache_dtype} {theirs} -> {ours} "
                           f"({overlaps(version, d.backend, d.kv_cache_dtype, theirs)} overlapping writer pairs "
                           f"in vLLM's layout at {d.decide_inputs(version)['groups'].groups[0].spec.num_layers} "
                           f"layers)"] += 1
            else:
                mismatches.append(f"{d.label()}: kvpolicy {ours}, vLLM {theirs} ({answer})")
    decide_s = time.perf_counter() - start
    backends = Counter(d.backend for d, _ in pairs)
    sampled = f" (every {PATCH_STRIDE}th)" if version in GATE_PATCHES else ""
    with capsys.disabled():
        equal = len(pairs) - len(mismatches) - sum(kept.values())
        print(f"\nvLLM {version} decisions{sampled}: {equal} of {len(pairs)} equal ({equal - refusals} layouts, "
              f"{refusals} the same refusal), {sum(kept.values())} deliberate divergences, {len(mismatches)} other "
              f"(oracle {answered.seconds:.0f} s for facts, decisions and geometry; kvpolicy {decide_s:.1f} s)\n"
              f"  dimensions: (backend x its kv_cache_dtypes) {len({(d.backend, d.kv_cache_dtype) for d, _ in pairs})}"
              f" pairs over {len(backends)} backends; model shapes {len(MHA_SHAPES)} MHA / {len(MLA_SHAPES)} MLA; "
              f"{len(CONNECTORS)} connector configs; VLLM_KV_CACHE_LAYOUT {len(ENV_LAYOUTS)}\n"
              f"  vLLM's layouts: {dict(sorted(seen.items()))}")
        for what, n in sorted(kept.items()):
            print(f"  deliberate: {n} x {what}")
    assert not mismatches, f"{len(mismatches)} of {len(pairs)} differ:\n" + "\n".join(mismatches[:40])
    assert equal - refusals >= len(pairs) // 2, "fewer than half the deployments compare layouts"
    assert bool(kept) is (version in PER_LAYER_SCALE_VIEWS)
    if version not in GATE_PATCHES:
        assert len(pairs) == len(space(answered.profile))


def test_the_space_reaches_every_outcome(answered: GateAnswers) -> None:
    """Every layout of the profile is vLLM's answer somewhere, and so is a refusal."""
    outcomes = {_vllm(answered.facts, d, a) for d, a in answered.decisions}
    assert outcomes >= {x.value for x in answered.profile.layouts} | {"error"}


def test_unsupported_dtypes_are_refused_and_unplanned_ones_named(answered: GateAnswers) -> None:
    facts, version = answered.facts, answered.version
    engine = LayoutEngine.default(version)
    base = {"spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, "connector": "OffloadingConnector"}
    # vLLM's validate_configuration refuses a backend for a kv_cache_dtype it does not list
    with pytest.raises(InputError) as exc:
        engine.decide(backend="FLASH_ATTN", kv_cache_dtype="fp8_per_token_head", **base)
    assert exc.value.diagnostics[0].code == "unsupported-kv-cache-dtype"
    # FLASHINFER accepts nvfp4: kvpolicy decides it (above, with vLLM's gate) but cannot plan it
    accepted = set(facts["backends"]["FLASHINFER"]["supported_kv_cache_dtypes"]) & set(UNPLANNED_DTYPES)
    assert "nvfp4" in accepted
    for dtype in sorted(accepted):
        engine.decide(backend="FLASHINFER", kv_cache_dtype=dtype, **base)
        with pytest.raises(InputError) as exc:
            engine.plan(num_blocks=4, backend="FLASHINFER", kv_cache_dtype=dtype, **base)
        (diag,) = exc.value.diagnostics
        assert diag.code == "unplanned-kv-cache-dtype" and diag.file == "kv_cache_dtype", diag
        assert f"`{dtype}` on backend `FLASHINFER` but cannot plan it" in diag.message and "0.24-0.28" in diag.message
