# ruff: noqa  (hostile-pass scripts, not product code)
"""Class 1: no operator layer revives a layout a lower layer removed, whatever name it addresses a
connector by; aliases resolve to the class vLLM loads. Run: python hostile/class1_layers.py"""
from __future__ import annotations

import itertools
import random
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _common import report, summary  # noqa: E402

from kvpolicy.engine import LayoutEngine  # noqa: E402
from kvpolicy.policy.errors import NoLayoutError, PolicyError  # noqa: E402
from kvpolicy.policy.layouts import ALL_LAYOUTS  # noqa: E402
from kvpolicy.policy.releases import get_profile, profile_names  # noqa: E402

LAYOUTS = [str(x) for x in ALL_LAYOUTS]
SPEC = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def write_layer(root: Path, files: dict, order: list | None = None, modes: dict | None = None) -> Path:
    (root / "connectors").mkdir(parents=True, exist_ok=True)
    glob = {"version": 1, "rules": [dict(r, id=f"{root.name.lower()}-g{i}", description="x") for i, r in
                                    enumerate(files.get("global", []))]}
    if order:
        glob["defaults"] = {"layout_order": order}
    (root / "global.yaml").write_text(yaml.safe_dump(glob))
    for j, (fname, (conn, rules)) in enumerate((k, v) for k, v in files.items() if k != "global"):
        doc = {"version": 1, "connector": conn,
               "rules": [dict(r, id=f"{root.name.lower()}-c{j}-{i}", description="x") for i, r in enumerate(rules)]}
        if modes and conn in modes:
            doc["member_preferences"] = modes[conn]
        (root / "connectors" / f"{fname}.yaml").write_text(yaml.safe_dump(doc))
    return root


def survivors(engine: LayoutEngine, inputs: dict):
    try:
        return frozenset(str(x) for x, _ in engine.decide(explain=False, **inputs).ranking)
    except NoLayoutError:
        return frozenset()
    except PolicyError:
        return None


def deployments(profile: str):
    prof = get_profile(profile)
    names = sorted(prof.connectors)
    rnd = random.Random(profile)
    for name in names + [None]:
        for dtype, backend, cross, lay in [("auto", "FLASH_ATTN", "true", None), ("fp8", "TRITON_ATTN", "false", None),
                                           ("auto", "FLASHINFER", "true", "HND")]:
            inp = {"spec": SPEC, "kv_cache_dtype": dtype, "attention_backend": backend}
            if lay:
                inp["vllm_kv_cache_layout"] = lay
            if name is not None:
                inp["connector"] = name
                cfg = {"enable_cross_layers_blocks": cross}
                if name == "NixlConnector":
                    cfg["transfer_mode"] = rnd.choice(["pull", "push"])
                inp["connector_config"] = cfg
            yield f"{name}/{dtype}/{backend}/{lay}", inp
    aliases = [n for n in names if prof.connectors[n] != n] + ["NixlPullConnector", "OffloadingConnector"]
    if "MultiConnector" in names:
        for a, b in itertools.combinations(aliases, 2):
            inp = {"spec": SPEC, "kv_transfer_config": {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"connectors": [
                       {"kv_connector": a, "kv_connector_extra_config": {"enable_cross_layers_blocks": "true"}},
                       {"kv_connector": b}]}}}
            yield f"Multi[{a},{b}]", inp


def hostile_layers(profile: str):
    """Adversarial operator layers: (name, [layer dicts])."""
    prof = get_profile(profile)
    aliases = {n: c for n, c in prof.connectors.items() if n != c}
    top = {"prefer": {"layout": LAYOUTS}, "weight": 1000}
    out = []
    for alias, cls in aliases.items():
        out.append((f"alias-file-prefer-{alias}", [{alias: (alias, [{"prefer": {"layout": ["BHLNC"]}, "weight": 1000}])}]))
        out.append((f"alias-and-class-files-{alias}", [{alias: (alias, [top]), cls: (cls, [top])}]))
        out.append((f"alias-file-named-as-class-{alias}", [{cls: (alias, [top])}]))  # file name lies
        out.append((f"case-variant-{alias}", [{alias.lower(): (alias.lower(), [top]), alias.upper(): (alias.upper(), [top])}]))
        out.append((f"layered-require-prefer-{alias}", [
            {alias: (alias, [{"require": {"placement": "per_layer"}}])},
            {cls: (cls, [{"prefer": {"placement": "cross_layer"}, "weight": 999}]), "global": []},
            {alias: (alias, [top])}]))
    for conn in ("MultiConnector", "OffloadingConnector"):
        out.append((f"member-pref-any-{conn}", [{conn: (conn, [top])}]))
    out.append(("layout-order-reversed", [{"global": [top]}]))
    out.append(("base-forbid-site-prefer-alias", [
        {"global": [{"forbid": {"layout": ["LBHNC"]}}]},
        {a: (a, [{"prefer": {"layout": ["LBHNC"]}, "weight": 1000}]) for a in list(aliases)[:1]}]))
    return out


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="host23-c1-"))
    profiles = [p for p in profile_names()]
    for profile in profiles:
        base = LayoutEngine.default(profile)
        deps = list(deployments(profile))
        for lname, layers in hostile_layers(profile):
            roots = []
            for k, files in enumerate(layers):
                order = list(reversed(LAYOUTS)) if lname == "layout-order-reversed" else None
                modes = {"MultiConnector": "any"} if lname.startswith("member-pref-any-Multi") else None
                roots.append(write_layer(tmp / f"{profile}-{lname}-{k}", files, order, modes))
            try:
                stacks = [LayoutEngine.from_path(roots[:i + 1], vllm_version=profile) for i in range(len(roots))]
            except PolicyError as e:
                report(f"c1/{profile}/{lname}/load", True, f"refused at load (located): {str(e).splitlines()[0][:100]}")
                continue
            engines = [base] + stacks
            bad = []
            for dname, inp in deps:
                prev = None
                for lvl, eng in enumerate(engines):
                    s = survivors(eng, inp)
                    if prev is not None and s is not None and not s <= prev:
                        bad.append(f"{dname} level {lvl}: {sorted(s - prev)} revived")
                    if prev is not None and (prev is None) != (s is None):
                        bad.append(f"{dname} level {lvl}: input validity changed")
                    prev = s if s is not None else prev
            report(f"c1/{profile}/{lname}", not bad, f"{len(deps)} deployments x {len(engines)} levels"
                   + (f"; {bad[0]} (+{len(bad) - 1})" if bad else ": survivors only shrink"))
    # aliases resolve to the class vLLM loads: 0.34's NixlConnector with transfer_mode=push loads NixlPushConnector
    for profile in ("vllm-0.34",):
        root = write_layer(tmp / f"push-{profile}", {"NixlPushConnector": ("NixlPushConnector", [{"forbid": {"layout": ["LBHNC"]}}])})
        eng = LayoutEngine.from_path(root, vllm_version=profile)
        inp = {"spec": SPEC, "connector": "NixlConnector", "connector_config": {"transfer_mode": "push"}}
        s = survivors(eng, inp)
        report(f"c1/{profile}/push-alias-forbid", s is not None and "LBHNC" not in s,
               f"site NixlPushConnector.yaml forbids LBHNC; NixlConnector+transfer_mode=push (vLLM loads "
               f"NixlPushConnector) survivors {sorted(s or [])}",
               "python hostile/class1_layers.py  (case push-alias-forbid)")
        root = write_layer(tmp / f"pull-{profile}", {"NixlPullConnector": ("NixlPullConnector", [{"forbid": {"layout": ["LBNHC"]}}])})
        eng = LayoutEngine.from_path(root, vllm_version=profile)
        s = survivors(eng, inp)
        report(f"c1/{profile}/pull-rules-on-push", s is not None and "LBNHC" in s,
               f"site NixlPullConnector.yaml forbids LBNHC; NixlConnector+push (loads NixlPushConnector) survivors "
               f"{sorted(s or [])}")
    # connector names with whitespace / case as a deployment gives them: the CLI must say the name is unknown
    import subprocess
    kvp = str(Path(sys.executable).parent / "kvpolicy")
    for name in (" NixlConnector", "NixlConnector ", "nixlconnector", "NIXLCONNECTOR", "Nixl\u200bConnector",
                 "NixlConnector\n", "\uff2eixlConnector"):
        r = subprocess.run([kvp, "dry-run", "--vllm-version", "0.34.0", "--connector", name], capture_output=True,
                           text=True, timeout=60)
        said = "unknown connector" in r.stderr or r.returncode != 0
        report(f"c1/cli-deploy-name/{name!r}", said, f"rc {r.returncode}, " + (
            "warned/refused" if said else "decided silently with no connector rules"),
            f"kvpolicy dry-run --vllm-version 0.34.0 --connector {name!r}")
    eng = LayoutEngine.default("vllm-0.34")
    d = eng.decide(spec=SPEC, connector="nixlconnector")
    report("c1/library-deploy-name/'nixlconnector'", bool(d.warnings),
           f"LayoutEngine.decide(connector='nixlconnector') -> {d.layout}, warnings {list(d.warnings)}: the shipped "
           "NixlPullConnector rules silently not applied (the CLI warns, the library does not)",
           f"python -c \"from kvpolicy.engine import LayoutEngine as E; d=E.default('vllm-0.34').decide(spec={SPEC}, "
           "connector='nixlconnector'); print(d.layout, d.warnings)\"")
    summary("1")


if __name__ == "__main__":
    main()
