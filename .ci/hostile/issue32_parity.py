# ruff: noqa  (hostile-pass scripts, not product code)
"""Issue 32, class 5: text/JSON parity. For dry-run, doctor, compat, test and lint in situations that make
notes and warnings, every `note:` / `warning...:` line the text prints (stdout or stderr) must be in the JSON
document (its message, whitespace-normalised, somewhere among its strings). Run: python .ci/hostile/issue32_parity.py"""
from __future__ import annotations

import json
import re

from _i32 import V34, cli, ok_result, report, summary, tmpdir

LINE = re.compile(r"^(?:[^\s:]+(?::\d+)*: )?(note|warning)(?:\[([a-z0-9-]+)\])?: (.*)$")


def strings(x) -> list[str]:
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [s for k, v in x.items() for s in strings(k) + strings(v)]
    if isinstance(x, list):
        return [s for v in x for s in strings(v)]
    return []


def norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip()


def compare(case: str, text_args: list[str], json_args: list[str], env=None, stdin=None) -> None:
    t = cli(text_args, env=env, stdin=stdin)
    j = cli(json_args, env=env, stdin=stdin)
    ok, why = ok_result(t)
    ok2, why2 = ok_result(j)
    if not (ok and ok2):
        report(case, False, f"text: {why}; json: {why2}")
        return
    try:
        doc = json.loads(j.out)
    except Exception as e:
        report(case, False, f"json not parseable: {e} {j.out[:100]!r} {j.err[-200:]!r}")
        return
    blob = norm(" ".join(strings(doc)))
    codes = set(strings(doc))
    missing = []
    lines = (t.out + "\n" + t.err).splitlines()
    found = 0
    for ln in lines:
        m = LINE.match(ln.strip())
        if not m:
            continue
        found += 1
        kind, code, msg = m.groups()
        msg = norm(msg)
        if msg[:60] not in blob and (code is None or code not in codes or msg[:30] not in blob):
            missing.append(f"{kind}[{code}]: {msg[:120]}")
    if j.err.strip() and j.out.strip():
        # JSON mode printing notes on stderr is fine only if they are in the document too
        for ln in j.err.splitlines():
            m = LINE.match(ln.strip())
            if m and norm(m.group(3))[:60] not in blob:
                missing.append(f"(json stderr only) {ln[:120]}")
    if missing:
        report(case, False, f"{len(missing)} of {found} text notes/warnings not in the JSON: {missing[:3]}",
               "kvpolicy " + " ".join(text_args) + "  vs  --format json")
    else:
        report(case, True, f"{found} notes/warnings, all in the JSON")


def main() -> None:
    d = tmpdir("parity")
    (d / "spec.yaml").write_text("num_layers: 4\nnum_kv_heads: 2\nhead_size: 64\n")
    rd = d / "rules"
    rd.mkdir()
    (rd / "global.yaml").write_text(
        "version: 1\nrules:\n  - id: site-audit\n    description: d\n    enforcement: audit\n    forbid: {placement: cross_layer}\n"
        "  - id: site-lit\n    description: d\n    when: {field: connector.name, eq: OffloadConector}\n    forbid: {placement: per_layer}\n"
        "  - id: site-w\n    description: d\n    forbid: {head_order: HND}\n"
        "waivers:\n  - {rule: site-w, owner: o, reason: r, expires: 2026-01-01}\n")
    dry = {
        "plain": [],
        "spec": ["--spec", str(d / "spec.yaml")],
        "serve-ignored-args": ["--", str(d / "spec.yaml") if False else "m", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5"],
        "near-connector": ["--connector", "OffloadConector"],
        "own-connector": ["--connector", "MyConnector", "--connector-module-path", "my.mod"],
        "rules-audit-lapsed": ["--rules", str(rd), "--connector", "OffloadingConnector"],
        "env-layout": [],
        "fp8-flashinfer": ["--kv-cache-dtype", "fp8", "--backend", "FLASHINFER", "--connector", "NixlConnector"],
        "map": ["--map"],
        "explain": ["--explain", "fails"],
        "hisparse": ["--hisparse", "--connector", "OffloadingConnector"],
        "patch-release": ["--vllm-version", "0.34.9"],
    }
    for label, extra in dry.items():
        v = [] if "--vllm-version" in extra else V34
        env = {"VLLM_KV_CACHE_LAYOUT": "NHD", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN"} if label == "env-layout" else None
        if "--" in extra:
            i = extra.index("--")
            ta = ["dry-run", *v, *extra[:i], "--format", "text", *extra[i:]]
            ja = ["dry-run", *v, *extra[:i], "--format", "json", *extra[i:]]
        else:
            ta = ["dry-run", *v, *extra]
            ja = ["dry-run", *v, *extra, "--format", "json"]
        compare(f"dry-run/{label}", ta, ja, env=env)
    for label, env in {"plain": None, "env": {"VLLM_KV_CACHE_LAYOUT": "HND", "KVPOLICY_SHIPPED_RULES": "0"}}.items():
        compare(f"doctor/{label}", ["doctor", *V34], ["doctor", *V34, "--format", "json"], env=env)
    # compat: two decided sides
    a, b = d / "a.json", d / "b.json"
    a.write_text(cli(["dry-run", *V34, "--format", "json"]).out)
    b.write_text(cli(["dry-run", *V34, "--kv-cache-dtype", "fp8", "--format", "json"]).out)
    for label, (x, y) in {"same": (a, a), "dtype": (a, b), "versions": ("0.28.0", "0.34.0")}.items():
        compare(f"compat/{label}", ["compat", str(x), str(y)], ["compat", str(x), str(y), "--format", "json"])
    # test: cases with warnings
    cd = d / "cases"
    cd.mkdir()
    (cd / "c.yaml").write_text(
        "version: 1\ncases:\n  - name: one\n    input:\n      spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}\n"
        "      connector: OffloadConector\n    expect:\n      layout: BLHNC\n"
        "  - name: two\n    input:\n      spec: {num_layers: 4, num_kv_heads: 2, head_size: 64}\n      vllm_version: '0.34.9'\n"
        "    expect:\n      layout: LBHNC\n")
    compare("test/warnings", ["test", str(cd), *V34, "--rules", str(rd)], ["test", str(cd), *V34, "--rules", str(rd), "--format", "json"])
    compare("test/coverage", ["test", str(cd), *V34, "--require-coverage", "--rules", str(rd)],
            ["test", str(cd), *V34, "--require-coverage", "--rules", str(rd), "--format", "json"])
    # lint
    for label, extra in {"rules": [str(rd)], "shipped": [], "strict": [str(rd), "--strict"]}.items():
        compare(f"lint/{label}", ["lint", *extra, *V34], ["lint", *extra, *V34, "--format", "json"])
    compare("validate/lapsed", ["validate", str(rd), *V34], ["validate", str(rd), *V34, "--format", "json"])
    compare("inspect/waivers", ["inspect", str(rd), *V34], ["inspect", str(rd), *V34, "--format", "json"])
    summary("5 text/JSON parity")


if __name__ == "__main__":
    main()
