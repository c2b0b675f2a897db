"""What changed between two vLLM release profiles: their facts, compared by meaning.

A profile file states what differs from the profile it extends (`kvpolicy.policy.releases`), so
two profiles' files are not directly comparable: `canonical_facts` resolves a profile and writes
each fact in one form, so that equal meaning is equal data (a backend's declared layouts at every
device capability, the backend priority at every capability), and `fact_differences` lists what
differs, one ``path: old -> new`` line each. ``kvpolicy releases A B`` shows it, and the
conformance tool ``tests/conformance/release_facts.py`` compares a release's facts read from its
own code with its profile the same way.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvpolicy.policy.releases import ReleaseProfile

__all__ = ["BACKEND_FACTS", "BACKEND_STATED_FACTS", "CAPABILITIES", "RELEASE_FACTS", "STATED_FACTS", "canonical_facts",
           "fact_differences"]

# The profile fields a release's code determines, and within `backends`, the fields of a backend.
RELEASE_FACTS = ("resolver", "layouts", "default_layout_preference", "default_block_size", "kv_cache_dtypes",
                 "backends", "connectors", "connector_modes", "kv_transfer_config_fields", "backend_priority",
                 "options", "previously_supported_models")
BACKEND_FACTS = ("mla", "supported_layouts", "supported_layouts_by_capability", "kv_cache_dtypes", "stride_orders",
                 "kv_dim")
CAPABILITIES = (8, 9, 10, 12)  # the CUDA capability majors whose declarations and priorities profiles hold
# What a person states in a profile (the release's code does not say it in one place), proven by the
# conformance tests: shown by ``kvpolicy releases`` beside the release facts.
STATED_FACTS = ("geometry", "layer_buffers", "workers_must_agree", "hisparse_connectors",
                "hisparse_requires_connector", "hma_connectors", "hybrid_block_rounded")
BACKEND_STATED_FACTS = ("kv_split", "write_isa", "unplanned_kv_cache_dtypes", "int4_heads_power_of_two",
                        "supported_dtypes", "kernel_block_sizes")


def canonical_facts(profile: ReleaseProfile, stated: bool = False) -> dict[str, Any]:
    """The `RELEASE_FACTS` of ``profile`` in one form per meaning (JSON-compatible); with ``stated``,
    also the facts a person states (`STATED_FACTS`): every fact a decision or a plan reads."""
    keep, backend_keep = RELEASE_FACTS + (STATED_FACTS if stated else ()), BACKEND_FACTS + (
        BACKEND_STATED_FACTS if stated else ())
    out: dict[str, Any] = {k: v for k, v in profile.model_dump(mode="json").items() if k in keep}
    for name, backend in profile.backends.items():
        entry = {k: v for k, v in out["backends"][name].items() if k in backend_keep}
        entry.pop("supported_layouts_by_capability")
        entry["supported_layouts"] = {str(cap): None if (d := backend.declared_layouts(cap)) is None
                                      else [str(x) for x in d] for cap in (None, *CAPABILITIES)}
        out["backends"][name] = entry
    priority = profile.backend_priority
    out["backend_priority"] = {f"{kind}@{major}": list(priority.get(f"{kind}@{major}", priority.get(kind, ())))
                               for kind in ("attention", "mla") for major in CAPABILITIES}
    # the CPU platform's one backend (plain and with AMX tiles); null where the profile does not say
    for kind in ("attention", "mla"):
        plain = priority.get(f"{kind}@cpu")
        out["backend_priority"][f"{kind}@cpu"] = None if plain is None else list(plain)
        amx = priority.get(f"{kind}@cpu+amx", plain)
        out["backend_priority"][f"{kind}@cpu+amx"] = None if amx is None else list(amx)
    out["connectors"] = dict(sorted(out["connectors"].items()))
    return out


def fact_differences(old: dict[str, Any], new: dict[str, Any], path: str = "") -> list[str]:
    """One line per fact that differs between two `canonical_facts`: ``path: old -> new``."""
    lines = []
    for key in sorted(set(old) | set(new), key=str):
        here = f"{path}.{key}" if path else str(key)
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            lines += fact_differences(a, b, here)
        elif a != b:
            lines.append(f"{here}: {_short(a)} -> {_short(b)}")
    return lines


def _short(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()
