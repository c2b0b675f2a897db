# ruff: noqa  (hostile-pass scripts, not product code)
"""Issue 32, class 3: one output boundary. Hostile strings (ESC, BEL, CR, C1 CSI, bidi override, NUL where a
file can hold one, lone surrogates as invalid UTF-8 bytes, 100k characters) through flags, serve-line
arguments, KVPOLICY_*/VLLM_* variables, rule ids/descriptions, waiver owner/reason, case names and file names,
into every verb and format. Held: no traceback, no raw control character on stdout/stderr, JSON/SARIF parse,
JUnit parses as XML. Run: python .ci/hostile/issue32_boundary.py"""
from __future__ import annotations

import json
import os
import xml.dom.minidom

from _i32 import V34, cli, ok_result, report, summary, tmpdir

EVIL = {"esc": "a\x1b[31mRED\x1b]0;title\x07b", "cr": "ov\rER", "c1": "x\u009b31my\u0085z", "bidi": "ab\u202edc\u2066e",
        "ls": "l\u2028s", "long": "L" * 100_000}
EVIL_FILE = {**EVIL, "nul-escaped": "n\\0ul", "surrogate-escaped": "s\\ud800x", "del": "d\x7fe"}
FORMATS_LINT = ["text", "json", "github", "sarif"]


def well_formed(fmt: str, out: str) -> str | None:
    if fmt in ("json", "sarif"):
        try:
            json.loads(out)
        except Exception as e:
            return f"{fmt} not parseable: {e}"
    if fmt == "junit":
        try:
            xml.dom.minidom.parseString(out)
        except Exception as e:
            return f"junit not XML: {e}"
    return None


def check(case: str, r, fmt: str = "text", repro: str = "") -> None:
    ok, why = ok_result(r)
    if ok and r.out.strip():
        bad = well_formed(fmt, r.out)
        if bad:
            ok, why = False, bad
    if ok and len(r.out) + len(r.err) > 2_000_000:
        ok, why = False, f"output of {len(r.out) + len(r.err)} characters for one input"
    report(case, ok, why, repro)


def main() -> None:
    d = tmpdir("boundary")
    # 1. flags
    for label, s in EVIL.items():
        for flag in ["--connector", "--backend", "--kv-cache-dtype", "--vllm-version", "--spec", "--model",
                     "--vllm-kv-cache-layout", "--today", "--kv-transfer-config"]:
            for fmt in ("text", "json"):
                if label == "long" and fmt == "text" and flag not in ("--connector", "--spec"):
                    continue
                args = ["dry-run", *(V34 if flag != "--vllm-version" else []), flag, s, "--format", fmt]
                r = cli(args)
                check(f"flag{flag}/{label}/{fmt}", r, fmt, f"kvpolicy dry-run {flag} {s[:40]!r} --format {fmt}")
    # invalid UTF-8 in argv (a lone surrogate under surrogateescape)
    for flag in ["--connector", "--spec", "--backend"]:
        r = cli(["dry-run", *V34, flag, b"bad\xed\xa0\x80\xffx"])
        check(f"flag{flag}/invalid-utf8/text", r)
        r = cli(["dry-run", *V34, flag, b"bad\xed\xa0\x80\xffx", "--format", "json"])
        check(f"flag{flag}/invalid-utf8/json", r, "json")
    # 2. serve line
    for label, s in EVIL.items():
        for words in (["m", "--kv-cache-dtype", s], ["--model", s], ["--max-num-seqs", s], [f"--{s}", "1"],
                      ["--kv-transfer-config", json.dumps({"kv_connector": s, "kv_role": "kv_both"})],
                      ["--kv-transfer-config." + s, "1"]):
            for fmt in ("text", "json"):
                r = cli(["dry-run", *V34, "--format", fmt, "--", *words])
                check(f"serve/{words[0][:20]!r}/{label}/{fmt}", r, fmt, f"kvpolicy dry-run -- {' '.join(w[:30] for w in words)}")
    # 3. env
    for label, s in EVIL.items():
        for var in ["VLLM_KV_CACHE_LAYOUT", "VLLM_ATTENTION_BACKEND", "KVPOLICY_TODAY", "KVPOLICY_SHIPPED_RULES",
                    "VLLM_USE_V1"]:
            for fmt in ("text", "json"):
                r = cli(["dry-run", *V34, "--format", fmt], env={var: s})
                check(f"env/{var}/{label}/{fmt}", r, fmt, f"{var}={s[:30]!r} kvpolicy dry-run --format {fmt}")
    # 4. rule files: ids, descriptions, waiver owner/reason, connector names -> validate/lint/inspect/dry-run
    for label, s in EVIL_FILE.items():
        q = json.dumps(s, ensure_ascii=True) if "escaped" not in label else '"' + s + '"'
        rd = d / f"rules-{label}"
        rd.mkdir()
        (rd / "global.yaml").write_text(
            "version: 1\nrules:\n"
            f"  - id: {q}\n    description: {q}\n    forbid: {{placement: cross_layer}}\n"
            f"  - id: site-ok\n    description: {q}\n    reference: {q}\n    when: {{field: connector.name, eq: {q}}}\n"
            "    forbid: {placement: cross_layer}\n"
            f"waivers:\n  - rule: site-ok\n    owner: {q}\n    reason: {q}\n    expires: 2026-01-01\n"
            f"  - rule: {q}\n    owner: {q}\n    reason: {q}\n    expires: 2027-01-01\n")
        for verb in ("validate", "lint", "inspect"):
            for fmt in (FORMATS_LINT if verb != "inspect" else ["text", "json"]):
                r = cli([verb, str(rd), *V34, "--format", fmt])
                check(f"rules/{verb}/{label}/{fmt}", r, fmt, f"kvpolicy {verb} {rd} --format {fmt}")
        for fmt in ("text", "json"):
            r = cli(["dry-run", *V34, "--rules", str(rd), "--format", fmt, "--connector", "x"])
            check(f"rules/dry-run/{label}/{fmt}", r, fmt)
        r = cli(["fmt", str(rd / "global.yaml")])
        check(f"rules/fmt/{label}", r)
        # a valid id, hostile description/owner/reason, in force: dry-run's waived: section
        rd2 = d / f"rules2-{label}"
        rd2.mkdir()
        (rd2 / "global.yaml").write_text(
            "version: 1\nrules:\n"
            f"  - id: site-x\n    description: {q}\n    forbid: {{placement: per_layer}}\n"
            f"waivers:\n  - rule: site-x\n    owner: {q}\n    reason: {q}\n    expires: 2027-01-01\n")
        for fmt in ("text", "json"):
            r = cli(["dry-run", *V34, "--rules", str(rd2), "--format", fmt, "--explain"] if fmt == "text" else
                    ["dry-run", *V34, "--rules", str(rd2), "--format", fmt])
            check(f"waiver/dry-run/{label}/{fmt}", r, fmt)
        # cases: hostile case names and expectations
        cd = d / f"cases-{label}"
        cd.mkdir()
        (cd / "c.yaml").write_text(
            f"version: 1\ncases:\n  - name: {q}\n    input:\n      spec: {{num_layers: 4, num_kv_heads: 2, head_size: 64}}\n"
            f"      connector: {q}\n    expect:\n      layout: {q}\n"
            f"  - name: ok-{label}\n    input:\n      spec: {{num_layers: 4, num_kv_heads: 2, head_size: 64}}\n"
            f"    expect:\n      layout: BLHNC\n")
        for fmt in ("text", "json", "junit", "github", "sarif"):
            r = cli(["test", str(cd), *V34, "--format", fmt])
            check(f"cases/test/{label}/{fmt}", r, fmt, f"kvpolicy test {cd} --format {fmt}")
        r = cli(["test", str(cd), *V34, "--run", s[:200]])
        check(f"cases/test--run/{label}", r)
    # 5. file names (bytes)
    for label, name in {"esc": b"e\x1b[2Jx", "bidi": "b\u202ex".encode(), "invalid-utf8": b"i\xff\xfe", "cr": b"c\rr",
                        "newline": b"n\nl"}.items():
        p = os.path.join(os.fsencode(d), b"f-" + name + b".yaml")
        with open(p, "wb") as f:
            f.write(b"version: 1\nrules:\n  - id: q\n    descriptio: x\n")
        for verb in (["validate"], ["fmt"], ["lint"]):
            for fmt in ("text", "json", "github", "sarif"):
                if verb == ["fmt"] and fmt in ("github", "sarif"):
                    continue
                r = cli([*verb, p, *(V34 if verb != ["fmt"] else []), "--format", fmt])
                check(f"filename/{verb[0]}/{label}/{fmt}", r, fmt)
        r = cli(["dry-run", *V34, "--spec", p])
        check(f"filename/dry-run--spec/{label}", r)
        r = cli(["compat", p, p])
        check(f"filename/compat/{label}", r)
    summary("3 output boundary")


if __name__ == "__main__":
    main()
