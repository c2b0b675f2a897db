"""The `vllm serve` parser of every profiled release, read from the release: kvpolicy's serve-argument facts.

    python3 tests/conformance/serve_args_facts.py --write      # (re)write engine/vllm_serve_args/*.json
    python3 tests/conformance/serve_args_facts.py 0.35.0 --write
    python3 tests/conformance/serve_args_facts.py --check              # exit 1 unless the files are the releases'

Runs ``oracles/engine_args.py``'s facts case (``"frontend": true``: the whole parser,
``ServeSubcommand().subparser_init``) under each release. The frontend arguments (--host, --port...) need the
``openai`` package, which the conformance sites do not install: this script installs it once into its own
cache (``<cache>/serve-frontend-extras``) and puts it on the path after the release's site. Each file states
only what differs from the release before (``extends``): one fact, one place. ``test_serve_args.py`` checks
the engine-argument facts of 0.28 and 0.34 against the release itself on every run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import install_vllm  # noqa: E402
from vllm_release import oracle_env  # noqa: E402

from kvpolicy.engine.vllm_serve_facts import FACTS_DIR, action_key  # noqa: E402
from kvpolicy.policy.releases import iter_profiles  # noqa: E402

EXTRAS = ("openai", "openai-harmony")


def extras_site() -> Path:
    site = install_vllm.cache_root() / "serve-frontend-extras"
    if not (site / "COMPLETE").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site), *EXTRAS], check=True)
        (site / "COMPLETE").write_text(" ".join(EXTRAS))
    return site


def release_facts(version: str) -> dict:
    """The facts case of the oracle under ``version``, frontend included."""
    site = install_vllm.ensure(version)
    env = oracle_env(site)
    env["PYTHONPATH"] = f"{site}:{extras_site()}"
    proc = subprocess.run([sys.executable, str(HERE / "oracles" / "engine_args.py")],
                          input=json.dumps([{"facts": True, "frontend": True}]), env=env, capture_output=True,
                          text=True, cwd=str(HERE / "oracles"), timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM {version}: the oracle exited {proc.returncode}\n{proc.stderr[-3000:]}")
    answer = json.loads(proc.stdout)[0]
    if "error" in answer:
        raise SystemExit(f"vLLM {version}: {answer['error']}")
    return answer


def as_table(answer: dict) -> dict[str, dict]:
    """Actions keyed by `action_key`, each with every spelling the parser accepts."""
    spellings: dict[int, list[str]] = {}
    for opt, i in answer["options"].items():
        spellings.setdefault(i, []).append(opt)
    table = {}
    for i, action in enumerate(answer["actions"]):
        if action["kind"] == "help":
            continue
        entry = {k: v for k, v in action.items() if v is not None and k != "options"}
        entry["options"] = sorted(spellings.get(i, []), key=lambda o: (o.startswith("--no-"), len(o), o))
        if action["options"] and not entry["options"]:
            continue
        table[action_key(entry)] = entry
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help="releases (default: every profile's)")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare each release's parser with its file")
    a = ap.parse_args()
    differ = 0
    profiles = [(p.name, p.vllm_versions[0]) for p in iter_profiles() if p.vllm_versions]
    profiles.sort(key=lambda nv: tuple(int(x) for x in nv[1].split(".")))
    wanted = set(a.versions) or {v for _, v in profiles}
    previous: tuple[str, dict] | None = None
    for name, version in profiles:
        path = FACTS_DIR / f"{name}.json"
        if version not in wanted:
            if path.is_file():
                from kvpolicy.engine.vllm_serve_facts import serve_actions

                previous = (name, serve_actions(name))
            continue
        table = as_table(release_facts(version))
        if a.check:
            from kvpolicy.engine.vllm_serve_facts import serve_actions

            try:
                kept = serve_actions(name)
            except KeyError:
                kept = {}
            wrong = sorted(k for k in set(table) | set(kept) if table.get(k) != kept.get(k))
            differ += bool(wrong)
            print(f"{name} ({version}): " + (f"differs in {', '.join(wrong[:12])}" if wrong else "the release's"))
        doc: dict = {"vllm_version": version}
        if previous is None:
            doc["actions"] = table
        else:
            base_name, base = previous
            doc["extends"] = base_name
            doc["actions"] = {k: v for k, v in table.items() if base.get(k) != v}
            doc["removed"] = sorted(k for k in base if k not in table)
        if not a.check:
            print(f"{name} ({version}): {len(table)} arguments, {len(doc['actions'])} stated"
                  + (f", {len(doc.get('removed', []))} removed" if previous else ""))
        if a.write:
            FACTS_DIR.mkdir(exist_ok=True)
            path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        previous = (name, table)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
