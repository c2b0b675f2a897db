"""The facts of a uniform-gate release profile (vLLM 0.24-0.28), read off the release's own answers.

`profile_facts_from_oracle` turns the v028 oracle's ``{"facts": true}`` answer (and, when given,
the ``backend_priority`` oracle's lists) into the profile fields the release determines; the
rest of a profile (name, description, vllm_versions, rules, historical, geometry, layer_buffers)
is kvpolicy's own choice. ``tests/conformance/release_facts.py`` writes and checks profiles with
it, and ``test_gate_decisions.py`` holds every gate profile to it, field by field.

Nothing here is a transcription of vLLM's logic: each fact is a value vLLM returned (a stride
order, a dtype list, a dataclass's fields, a registry entry); the only reading done here is
naming the layout a stride order allocates (`BackendFacts.physical_order`, the same reading the
decision conformance tests use).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpolicy.policy.layouts import HeadOrder, Layout, Placement
from kvpolicy.policy.releases import BackendFacts

# The attention backends the gate profiles model, in the order the profiles list them. The oracle
# also answers ROCM_ATTN (a ROCm backend kvpolicy has no device for) and leaves it out.
MODELLED_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN", "FLASHMLA",
                     "TRITON_MLA")
# The device capabilities whose priority lists a profile records (SM90 is the plain key).
PRIORITY_MAJORS = (9, 10, 12)


class FactsError(ValueError):
    """The oracle's answer lacks a fact, or holds one the profile model cannot state."""


def _stride_order(value: Any, where: str) -> list[int] | None:
    """A stride order, or None where vLLM raised NotImplementedError (the runner keeps the identity)."""
    if isinstance(value, dict):
        if str(value.get("error", "")).startswith("NotImplementedError"):
            return None
        raise FactsError(f"{where}: vLLM answered {value}")
    return list(value)


def _backend(name: str, answer: Mapping[str, Any]) -> dict[str, Any]:
    if "error" in answer:
        raise FactsError(f"backend {name}: the oracle could not load it: {answer['error']}")
    mla = bool(answer["is_mla"])
    ex = answer["example"]
    shape = answer["kv_cache_shape"]["auto"]
    packed = [ex["num_blocks"], ex["num_kv_heads"], ex["block_size"], 2 * ex["head_size"]]
    kv_dim = [ex["num_blocks"], 2, ex["block_size"], ex["num_kv_heads"], ex["head_size"]]
    if not mla and shape not in (packed, kv_dim):
        raise FactsError(f"backend {name}: get_kv_cache_shape {shape} is neither (B, H, N, 2D) nor (B, 2, N, H, D)")
    out: dict[str, Any] = {
        "mla": mla,
        "kv_cache_dtypes": list(answer["supported_kv_cache_dtypes"]),
        "stride_orders": {
            h.value: {"per_layer": _stride_order(answer["by_layout"][h.value]["stride_order"],
                                                 f"{name} {h.value} stride order"),
                      "cross_layer": _stride_order(answer["by_layout"][h.value]["stride_order_with_layers"],
                                                   f"{name} {h.value} stride order with layers")}
            for h in HeadOrder},
    }
    if not mla and shape == kv_dim:
        out["kv_dim"] = True
    return out


def _layouts(backends: Mapping[str, dict[str, Any]], default_head_order: HeadOrder) -> list[str]:
    """Every layout a modelled backend allocates, vLLM's defaults first: per layer before cross-layer
    (the gate is false unless a connector asks), then the head order of ``get_kv_cache_layout()``."""
    found: set[Layout] = set()
    for facts in backends.values():
        parsed = BackendFacts.model_validate(facts)
        for head_order in HeadOrder:
            for cross in (False, True):
                layout = parsed.allocated_layout(head_order, cross)
                if layout is not None:
                    found.add(layout)
    ranked = sorted(found, key=lambda x: (x.placement is Placement.cross_layer, x.head_order is not default_head_order,
                                          list(Layout).index(x)))
    return [x.value for x in ranked]


def _connectors(registered: Mapping[str, Any]) -> dict[str, str]:
    """Registered name -> the class vLLM's factory loads; a connector whose module needs a package the
    oracle's site lacks (lmcache, ...) is named after itself (its registry entry names its class so)."""
    return {name: (name if "error" in entry else entry["class"]) for name, entry in sorted(registered.items())}


def backend_priority_from_oracle(answers: Mapping[str, Sequence[str]], backends: Sequence[str]) -> dict[str, list[str]]:
    """``{"attention@9": [...], "mla@10": [...]}`` (the release's full lists) -> the profile's form:
    the SM90 list under the plain key, each other capability's under ``kind@major``, cut to ``backends``."""
    out: dict[str, list[str]] = {}
    for kind in ("attention", "mla"):
        for major in PRIORITY_MAJORS:
            key = kind if major == 9 else f"{kind}@{major}"
            out[key] = [b for b in answers[f"{kind}@{major}"] if b in backends]
    return out


def profile_facts_from_oracle(answer: Mapping[str, Any], priorities: Mapping[str, Sequence[str]] | None = None,
                              backends: Sequence[str] = MODELLED_BACKENDS) -> dict[str, Any]:
    """The fields of a gate profile that the release determines, from the v028 oracle's facts answer.

    ``priorities``: the ``backend_priority`` oracle's lists by ``"<attention|mla>@<major>"`` (majors
    9, 10, 12); without it ``backend_priority`` is left out. Raises `FactsError` when the answer
    lacks a fact or holds one the profile model cannot state.
    """
    if "error" in answer:
        raise FactsError(f"the facts oracle failed: {answer['error']}")
    default = answer["get_kv_cache_layout"]["None"]
    if default not in HeadOrder.__members__:
        raise FactsError(f"get_kv_cache_layout() with nothing set answered {default!r}")
    facts_backends = {name: _backend(name, answer["backends"][name]) for name in backends}
    layouts = _layouts(facts_backends, HeadOrder(default))
    out: dict[str, Any] = {
        "layouts": layouts,
        "default_layout_preference": layouts,
        "default_block_size": answer["default_block_size"],
        "kv_cache_dtypes": list(answer["kv_cache_dtypes"]),
        "backends": facts_backends,
        "connectors": _connectors(answer["connectors"]),
        "kv_transfer_config_fields": list(answer["kv_transfer_config_fields"]),
    }
    if priorities is not None:
        out["backend_priority"] = backend_priority_from_oracle(priorities, backends)
    return out
