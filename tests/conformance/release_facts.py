"""The facts of a vLLM release, read from the installed release, and how they differ from a profile.

Following a new vLLM release is a command:

    python3 tests/conformance/release_facts.py 0.35.0                      # what differs from the nearest profile
    python3 tests/conformance/release_facts.py 0.34.0 --against vllm-0.33  # what 0.33 -> 0.34 changed
    python3 tests/conformance/release_facts.py 0.33.0 --check              # exit 1 unless its profile has them
    python3 tests/conformance/release_facts.py 0.35.0 --write              # write policy/releases/vllm-0.35.yaml

The release is installed like the conformance releases (`install_vllm.py`, cached outside the
repository); its facts oracle calls the release's own code (``oracles/v034.py`` from 0.29 on,
``oracles/v028.py`` before), ``oracles/backend_priority.py``, ``oracles/cpu_platform.py`` and
``oracles/model_registry.py`` (the architectures its model registry no longer serves). ``--write`` writes a profile that
``extends`` the nearest older one and states only what differs (a merge patch: see
``policy/releases.py``), with a description for a person to finish; the conformance suite then
proves the decisions, the geometry and the plugin. ``test_release_facts.py`` runs ``--check``'s
comparison for every profiled release.

Only the facts the release determines are compared (`DETERMINED`); the rest of a profile (its
name, description, rules, geometry family, how a backend splits K and V) is written by a person
and proven by the other conformance tests.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import install_vllm  # noqa: E402
from release_facts_gate import profile_facts_from_oracle  # noqa: E402
from vllm_release import run_oracle  # noqa: E402

from kvpolicy.policy import releases  # noqa: E402
from kvpolicy.policy.release_diff import (  # noqa: E402
    BACKEND_FACTS,
    CAPABILITIES,
    RELEASE_FACTS,
    canonical_facts,
    fact_differences,
)
from kvpolicy.policy.releases import (  # noqa: E402
    BackendFacts,
    ReleaseProfile,
    get_profile,
    profile_facts,
    profile_names,
)

# The profile fields a release's code determines (`kvpolicy.policy.release_diff`).
DETERMINED, BACKEND_DETERMINED = RELEASE_FACTS, BACKEND_FACTS
MAJORS = CAPABILITIES
_CAPS = {"none": None, "8.0": 8, "9.0": 9, "10.0": 10, "12.0": 12}
# oracles/v034.py's BACKENDS: the attention backends kvpolicy models
MODELLED_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN", "FLASHMLA",
                     "TRITON_MLA")


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3])


def is_resolver_release(version: str) -> bool:
    """0.29 on: ``resolve_kv_cache_layout`` over the ``KVCacheLayout`` enum; before, the uniform gate."""
    return version_key(version) >= (0, 29)


def backend_priority(version: str, backends: list[str]) -> dict[str, list[str]]:
    """``_get_backend_priorities`` for MLA or not at each of `MAJORS`, cut to ``backends``: the SM90
    list under ``attention`` / ``mla``, and ``kind@major`` where a capability's list differs."""
    cases = [{"mla": mla, "major": major} for mla, major in itertools.product((False, True), MAJORS)]
    answers = run_oracle(version, "backend_priority", cases)
    out: dict[str, list[str]] = {}
    for case, order in zip(cases, answers, strict=True):
        kind = "mla" if case["mla"] else "attention"
        cut = [b for b in order if b in backends]
        if case["major"] == 9:
            out[kind] = cut
    for case, order in zip(cases, answers, strict=True):
        kind = "mla" if case["mla"] else "attention"
        cut = [b for b in order if b in backends]
        if case["major"] != 9 and cut != out[kind]:
            out[f"{kind}@{case['major']}"] = cut
    return out


def resolver_facts(answer: dict[str, Any]) -> dict[str, Any]:
    """The profile fields of a 0.29+ release, from ``oracles/v034.py``'s facts answer."""
    backends: dict[str, Any] = {}
    for name in MODELLED_BACKENDS:
        entry = answer["backends"].get(name)
        if entry is None or "error" in entry:
            continue  # not in this release
        by_cap = {_CAPS[c]: layouts for c, layouts in entry["supported_kv_cache_layouts"].items()}
        plain = by_cap[None]
        backends[name] = {
            "mla": entry["is_mla"],
            "supported_layouts": plain,
            "supported_layouts_by_capability": {cap: layouts for cap, layouts in by_cap.items()
                                                if cap is not None and layouts != plain},
            "kv_cache_dtypes": entry["supported_kv_cache_dtypes"],
        }
    fields = answer["config_fields"]
    options = [name for name, present in (
        ("enable_extensible_kv_cache", "enable_extensible_kv_cache" in fields["cache"]),
        ("hisparse", "hisparse_config" in fields["attention"]),
        ("dcp_sharding", "dcp_sharded" in fields["attention_spec"])) if present]
    return {
        "resolver": "kv_cache_layout",
        "layouts": list(answer["layouts"]),
        "default_layout_preference": answer["default_layout_preference"],
        "default_block_size": answer["default_block_size"],
        "kv_cache_dtypes": answer["kv_cache_dtypes"],
        "backends": backends,
        "connectors": dict(sorted(answer["connector_classes"].items())),
        "kv_transfer_config_fields": fields["kv_transfer"],
        "options": options,
    }


def release_facts(version: str) -> dict[str, Any]:
    """Every `DETERMINED` fact of the installed release ``version`` (installed first if needed)."""
    install_vllm.ensure(version)
    if is_resolver_release(version):
        (answer,) = run_oracle(version, "v034", [{"facts": True}])
        if answer.get("version") != version:
            raise RuntimeError(f"the oracle ran under vLLM {answer.get('version')}, not {version}: {answer}")
        facts = resolver_facts(answer)
    else:
        (answer,) = run_oracle(version, "v028", [{"facts": True}])
        facts = {"resolver": "uniform_gate", **profile_facts_from_oracle(answer)}
    facts["backend_priority"] = {**backend_priority(version, list(facts["backends"])), **cpu_backends(version)}
    facts["previously_supported_models"] = previously_supported_models(version)
    facts["connector_modes"] = connector_modes(version)
    return facts


def previously_supported_models(version: str) -> dict[str, str]:
    """The architectures the release's model registry no longer serves, each with the last vLLM version
    that did (``_PREVIOUSLY_SUPPORTED_MODELS``, ``oracles/model_registry.py``)."""
    (answer,) = run_oracle(version, "model_registry", [{"previously_supported": True}])
    if answer.get("version") != version:
        raise RuntimeError(f"the oracle ran under vLLM {answer.get('version')}, not {version}: {answer}")
    return answer["previously_supported"]


# A value no release takes: where vLLM refuses it, the key chooses the class (a mode).
PROBE_REFUSED = "kvpolicy-probe"


def connector_modes(version: str) -> dict[str, Any]:
    """The profile's ``connector_modes``: each registered name whose class a ``kv_connector_extra_config`` key
    chooses, asked of ``KVConnectorFactory.get_connector_class`` (``oracles/connector_modes.py``) with every key
    and value some profile states plus a value no release takes. A key is a mode of a name where a value loads
    another class than none does, or is refused; its classes are the values vLLM takes. (A key no profile
    states is not asked: a new release's new mode key shows as a decision difference, not here.)"""
    probes: dict[str, set[str]] = {}
    for name in profile_names():
        for mode in get_profile(name).connector_modes.values():
            probes.setdefault(mode.key, {PROBE_REFUSED}).update(mode.classes)
    if not probes:
        return {}
    (answer,) = run_oracle(version, "connector_modes", [{"probes": {k: sorted(v) for k, v in sorted(probes.items())}}])
    out: dict[str, Any] = {}
    for name, entry in answer.items():
        for key, by_value in entry["by_key"].items():
            taken = {v: c for v, c in by_value.items() if not c.startswith("error: ")}
            if any(c != entry["default"] for c in by_value.values()):
                out[name] = {"key": key, "classes": dict(sorted(taken.items()))}
    return dict(sorted(out.items()))


def cpu_backends(version: str) -> dict[str, list[str]]:
    """The backend vLLM's CPU platform selects with nothing configured (``CpuPlatform.get_attn_backend_cls``,
    ``oracles/cpu_platform.py``) for attention and MLA, on a host without and with AMX tiles: the profile's
    ``attention@cpu`` / ``mla@cpu`` / ``...@cpu+amx`` keys, ``[]`` where the platform refuses the kind."""
    cases = [{"mla": mla, "kv_cache_dtype": "auto", "selected": None, "amx": amx}
             for mla in (False, True) for amx in (False, True)]
    answers = run_oracle(version, "cpu_platform", cases)
    out: dict[str, list[str]] = {}
    for case, answer in zip(cases, answers, strict=True):
        key = f"{'mla' if case['mla'] else 'attention'}@cpu{'+amx' if case['amx'] else ''}"
        out[key] = [answer["backend"]] if "backend" in answer else []
    if out["attention@cpu+amx"] == out["attention@cpu"]:  # stated only where AMX changes the choice
        del out["attention@cpu+amx"]
    return out


def canonical(facts: dict[str, Any]) -> dict[str, Any]:
    """``facts`` (a profile's mapping) cut to `DETERMINED`, written one way per meaning
    (`kvpolicy.policy.release_diff.canonical_facts`)."""
    profile = ReleaseProfile.model_validate({"name": "x", "description": "x", "vllm_versions": [], "rules": "x",
                                             "geometry": "packed", "layer_buffers": False, **{
                                                 k: v for k, v in facts.items() if k in DETERMINED}})
    return canonical_facts(profile)


def diff_patch(base: Any, new: Any) -> Any:
    """The smallest merge patch that turns ``base`` into ``new`` (``merge_patch(base, it) == new``)."""
    if not (isinstance(base, dict) and isinstance(new, dict)):
        return new
    patch: dict[str, Any] = {}
    for key in base.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in base:
            patch[key] = value
        elif base[key] != value:
            patch[key] = diff_patch(base[key], value)
    return patch


def profile_for(version: str) -> str | None:
    """The shipped profile that lists ``version``, if any."""
    return next((n for n in profile_names() if version in profile_facts(n)["vllm_versions"]), None)


def nearest_older(version: str) -> str:
    """The newest released profile older than ``version``'s series: what a new profile extends."""
    older = [(version_key(v), n) for n in profile_names() for v in profile_facts(n)["vllm_versions"]
             if version_key(v)[:2] < version_key(version)[:2]]
    if not older:
        raise SystemExit(f"release_facts: no profile older than {version} to extend; write its root by hand")
    return max(older)[1]


def new_profile(version: str, base: str, facts: dict[str, Any]) -> dict[str, Any]:
    """The file of a new profile for ``version``: ``extends: base`` and the facts that differ."""
    inherited = profile_facts(base)
    determined = _sparse({k: v for k, v in inherited.items() if k in DETERMINED})
    patch = diff_patch(determined, _sparse(_keep_undetermined(determined, facts)))
    series = ".".join(version.split(".")[:2])
    return {"name": f"vllm-{series}", "extends": base,
            "description": f"vLLM {series}: {base}'s facts with what `release_facts.py {version}` read from the "
                           f"release (TODO(#20): say what changed, and where vLLM decides)",
            "vllm_versions": [version], **patch}


def _sparse(facts: dict[str, Any]) -> dict[str, Any]:
    """``facts`` without what a profile file leaves unsaid: a backend's fields at their defaults
    (``mla: false``, no capability overrides, ...), so that a patch states only real changes."""
    defaults = {name: field.get_default(call_default_factory=True)
                for name, field in BackendFacts.model_fields.items()}
    top = {name: field.get_default(call_default_factory=True) for name, field in ReleaseProfile.model_fields.items()
           if not field.is_required()}
    out = {k: v for k, v in facts.items() if not (k in top and v in (top[k], list(top[k] or [])))}
    out["backends"] = {name: {k: v for k, v in entry.items() if not (k in defaults and v == defaults[k]
                                                                    and k != "kv_split")}
                       for name, entry in facts.get("backends", {}).items()}
    return out


def _keep_undetermined(base: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """``facts`` with each backend's fields that a release does not determine (``kv_split``) taken
    from the base, so that the patch never removes them."""
    top = {name: field.get_default(call_default_factory=True) for name, field in ReleaseProfile.model_fields.items()
           if not field.is_required()}
    out = {k: v for k, v in facts.items() if not (k in top and v in (top[k], list(top[k] or [])))}
    out["backends"] = {name: {**{k: v for k, v in base.get("backends", {}).get(name, {}).items()
                                 if k not in BACKEND_DETERMINED}, **entry}
                       for name, entry in facts["backends"].items()}
    return out


class _Dumper(yaml.SafeDumper):
    """Lists of scalars on one line (``layouts: [LBHNC, LBNHC]``), as the hand-written profiles are."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=110, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="release_facts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="an installable vLLM release, e.g. 0.34.0")
    parser.add_argument("--against", metavar="PROFILE", help="compare with this profile (default: the profile "
                        "that lists the version, else the nearest older one)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 unless the profile has the release's facts")
    mode.add_argument("--write", action="store_true", help="write policy/releases/vllm-X.Y.yaml extending the "
                      "nearest older profile")
    args = parser.parse_args(argv)
    if args.against is not None and args.against not in profile_names():
        parser.error(f"--against: no profile `{args.against}`; profiles: {', '.join(profile_names())}")
    try:
        facts = release_facts(args.version)
    except install_vllm.InstallError as exc:
        first = str(exc).splitlines()[0]
        print(f"release_facts: vLLM {args.version} cannot be installed: {first}", file=sys.stderr)
        if args.version not in install_vllm.PINNED:
            print(f"  help: add `\"{args.version}\": [...]` to PINNED in tests/conformance/install_vllm.py (the "
                  "previous release's list is the usual start; the install names what else it imports)",
                  file=sys.stderr)
        return 2
    if args.write:
        base = args.against or nearest_older(args.version)
        doc = new_profile(args.version, base, facts)
        path = releases.RELEASES_DIR / f"{doc['name']}.yaml"
        if path.exists():  # it holds what a person wrote (descriptions, comments, rules): never overwritten
            print(f"release_facts: {path} exists; compare it with `--check`, or remove it to write it anew",
                  file=sys.stderr)
            return 2
        header = (f"# Facts of vLLM {args.version}: what differs from `{base}`, as\n"
                  f"# `python3 tests/conformance/release_facts.py {args.version}` read them from the release.\n")
        path.write_text(header + dump(doc), encoding="utf-8")
        print(f"wrote {path}")
        return 0
    against = args.against or profile_for(args.version) or nearest_older(args.version)
    lines = fact_differences(canonical(profile_facts(against)), canonical(facts))
    print(f"vLLM {args.version} against profile `{against}`: {len(lines)} fact(s) differ")
    for line in lines:
        print(f"  {line}")
    return 1 if args.check and lines else 0


if __name__ == "__main__":
    sys.exit(main())
