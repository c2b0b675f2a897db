# ruff: noqa  (hostile-pass scripts, not product code)
"""Issue 32, class 6: new surfaces. Waivers (every shipped rule waived in force and lapsed, with `when`,
misdated: timezones, leap days, 2027-02-30, timestamps, ints), --today / KVPOLICY_TODAY, `kvpolicy test --run`
with catastrophic-backtracking and invalid patterns, `kvpolicy completion` (syntax; names reaching it).
Held: a waiver of a safety guard is refused, none crashes or yields a layout the geometry check refuses, a
bad date is a located error, a lapsed waiver warns and stops applying; --run is bounded (CPU 20 s); the
completion scripts parse. Run: python .ci/hostile/issue32_waivers.py"""
from __future__ import annotations

import json
import shutil
import subprocess

from _i32 import V34, cli, ok_result, report, summary, tmpdir

SITE = "version: 1\nrules:\n  - id: site-no-cross\n    description: d\n    forbid: {placement: cross_layer}\n"


def waiver(rule: str, expires: str = "2027-01-31", when: str | None = None, owner: str = "o", reason: str = "r") -> str:
    w = f"  - rule: {rule}\n    owner: {owner}\n    reason: {reason}\n    expires: {expires}\n"
    return w + (f"    when: {when}\n" if when else "")


def main() -> None:
    d = tmpdir("waivers")
    r = cli(["inspect", *V34, "--format", "json"])
    ids = sorted({x["id"] for x in json.loads(r.out)["rules"]})
    base = cli(["dry-run", *V34, "--format", "json"])
    # 1. every shipped rule waived, in force: refused (unwaivable/audit) or a decision without crash/overlap
    for rid in ids:
        rd = d / f"w-{rid}"
        rd.mkdir()
        (rd / "global.yaml").write_text("version: 1\nrules: []\nwaivers:\n" + waiver(rid))
        r = cli(["validate", str(rd), *V34, "--today", "2027-01-01"])
        ok, why = ok_result(r)
        refused = r.rc != 0
        report(f"waive-shipped/validate/{rid}", ok, why + (" refused: " + r.err.strip().splitlines()[0][:100] if refused else " accepted"))
        if refused:
            continue
        for conn in ("", "OffloadingConnector", "NixlConnector"):
            for extra in ([], ["--kv-cache-dtype", "fp8"], ["--vllm-kv-cache-layout", "NHD"], ["--enable-extensible-kv-cache"]):
                args = ["dry-run", *V34, "--rules", str(rd), "--format", "json", "--today", "2027-01-01", "--map",
                        *(["--connector", conn] if conn else []), *extra]
                r = cli(args)
                ok, why = ok_result(r)
                if ok and r.rc == 0:
                    j = json.loads(r.out)
                    txt = json.dumps(j).lower()
                    if '"overlap": true' in txt:
                        ok, why = False, "a waived rule yields an overlapping layout"
                report(f"waive-shipped/dry-run/{rid}/{conn or '-'}/{' '.join(extra) or '-'}", ok, why,
                       f"kvpolicy {' '.join(args)}")
    # 2. dates
    rd = d / "site"
    rd.mkdir()
    (rd / "global.yaml").write_text(SITE)
    for label, exp in {"feb-30": "2027-02-30", "feb-29-nonleap": "2027-02-29", "feb-29-leap": "2028-02-29",
                       "timestamp-z": "2027-01-31T23:00:00Z", "timestamp-tz": "2027-01-31 23:00:00+14:00",
                       "timestamp-neg": "2027-01-31T01:00:00-12:00", "int": "20270131", "quoted": '"2027-01-31"',
                       "single-digit": "2027-1-5", "year-0": "0000-01-01", "year-9999": "9999-12-31",
                       "year-10000": "10000-01-01", "null": "~", "empty": "''", "list": "[2027-01-31]",
                       "bool": "true", "float": "2027.0131", "unicode-digits": "٢٠٢٧-٠١-٣١", "space": "' 2027-01-31'",
                       "trailing-nl-quoted": '"2027-01-31\\n"', "tag-timestamp": "!!timestamp 2027-01-31",
                       "tag-str": "!!str 2027-01-31", "huge-year": "99999999999999999999-01-01"}.items():
        wd = d / f"date-{label}"
        wd.mkdir()
        (wd / "global.yaml").write_text(SITE + "waivers:\n" + waiver("site-no-cross", exp))
        for verb in ("validate", "dry-run"):
            args = [verb, *([str(wd)] if verb == "validate" else ["--rules", str(wd)]), *V34, "--today", "2027-01-31", "--format", "json"]
            r = cli(args)
            ok, why = ok_result(r)
            valid = label in ("feb-29-leap", "quoted", "year-9999", "tag-str")
            if ok and not valid and r.rc == 0:
                # accepted: then it must be read as the day written (a timestamp's date, no timezone shift)
                ok, why = False, f"`expires: {exp}` accepted: " + r.out[:200].replace("\n", " ")
            if ok and valid and r.rc != 0 and label != "year-9999":
                ok, why = False, f"`expires: {exp}` refused: " + r.err[:200]
            if ok and not valid and r.rc != 0 and verb == "validate":
                j = json.loads(r.out) if r.out.strip() else {}
                diags = j.get("error", {}).get("diagnostics", [])
                if not any(x.get("line") for x in diags):
                    ok, why = False, "error not located at a line: " + r.out[:200]
            report(f"date/{verb}/{label}", ok, why, f"waiver `expires: {exp}`; kvpolicy {' '.join(args)}")
    # 3. boundary days: in force on `expires`, lapsed the day after; the warning is there, the rule back
    wd = d / "boundary"
    wd.mkdir()
    (wd / "global.yaml").write_text(SITE + "waivers:\n" + waiver("site-no-cross", "2028-02-29"))
    for today, in_force in (("2028-02-28", True), ("2028-02-29", True), ("2028-03-01", False), ("2099-01-01", False)):
        for how in ("flag", "env"):
            args = ["dry-run", *V34, "--rules", str(wd), "--format", "json"] + (["--today", today] if how == "flag" else [])
            r = cli(args, env={"KVPOLICY_TODAY": today} if how == "env" else {"KVPOLICY_TODAY": "2000-01-01"} if False else {"KVPOLICY_TODAY": today})
            ok, why = ok_result(r)
            if ok:
                j = json.loads(r.out)
                txt = json.dumps(j)
                applied = any(w.get("applied") for w in j.get("waivers", []))
                warned = "expired-waiver" in txt
                if in_force and not applied:
                    ok, why = False, f"waiver not applied on {today} (expires 2028-02-29)"
                if not in_force and (applied or not warned):
                    ok, why = False, f"lapsed waiver on {today}: applied={applied} warned={warned}"
            report(f"boundary/{how}/{today}", ok, why)
    r = cli(["dry-run", *V34, "--rules", str(wd)], env={"KVPOLICY_TODAY": "2028-03-01"})
    ok, why = ok_result(r)
    report("boundary/text-warns-lapsed", ok and "expired-waiver" in r.err + r.out, why + " " + r.err[-200:])
    r = cli(["validate", str(wd), *V34], env={"KVPOLICY_TODAY": "2028-03-01"})
    report("boundary/validate-fails-lapsed", ok_result(r)[0] and r.rc == 1, r.brief())
    for label, t in {"bad-env": "2027-02-30", "blank-env": " ", "tz-env": "2027-01-31T00:00Z", "nl-env": "2027-01-31\n"}.items():
        r = cli(["dry-run", *V34, "--rules", str(wd)], env={"KVPOLICY_TODAY": t})
        ok, why = ok_result(r)
        report(f"today/{label}", ok and r.rc == 2 and "KVPOLICY_TODAY" in r.err, why + " " + r.err[-150:],
               f"KVPOLICY_TODAY={t!r} kvpolicy dry-run --rules D")
    r = cli(["dry-run", *V34, "--rules", str(wd)], env={"KVPOLICY_TODAY": ""})
    report("today/empty-env-uses-clock", ok_result(r)[0] and r.rc == 0, r.brief())
    # waiver with `when`, a waiver in a connector file, a waiver of itself twice, a waiver of an audit rule
    for label, text in {
            "when-unknown-field": SITE + "waivers:\n" + waiver("site-no-cross", when="{field: nope.x, eq: 1}"),
            "when-deep": SITE + "waivers:\n" + waiver("site-no-cross", when="{not: " * 300 + "{field: connector.present, eq: true}" + "}" * 300),
            "two-waivers-same-rule": SITE + "waivers:\n" + waiver("site-no-cross") + waiver("site-no-cross", "2026-01-01"),
            "waivers-not-list": SITE + "waivers: {rule: site-no-cross}\n",
            "waiver-missing-owner": SITE + "waivers:\n  - {rule: site-no-cross, reason: r, expires: 2027-01-31}\n",
            "waiver-extra-key": SITE + "waivers:\n" + waiver("site-no-cross") + "    approve: yes\n",
            "waiver-empty-owner": SITE + "waivers:\n" + waiver("site-no-cross", owner="''"),
            "waiver-long-reason": SITE + "waivers:\n" + waiver("site-no-cross", reason="x" * 200_000),
            "10k-waivers": SITE + "waivers:\n" + "".join(waiver("site-no-cross") for _ in range(10_000))}.items():
        wd = d / f"w-{label}"
        wd.mkdir()
        (wd / "global.yaml").write_text(text)
        r = cli(["validate", str(wd), *V34, "--today", "2027-01-01"], cpu=30)
        ok, why = ok_result(r)
        if ok and label != "two-waivers-same-rule" and r.rc == 0 and label not in ("waiver-long-reason",):
            ok, why = False, "accepted: " + r.out[:150]
        report(f"waiver-shape/{label}", ok, why, f"kvpolicy validate D --today 2027-01-01")
    cd = d / "conn"
    (cd / "connectors").mkdir(parents=True)
    (cd / "connectors" / "OffloadingConnector.yaml").write_text("version: 1\nrules: []\nwaivers:\n" + waiver("offloading-requires-lbhnc"))
    r = cli(["validate", str(cd), *V34, "--today", "2027-01-01"])
    report("waiver-in-connector-file", ok_result(r)[0] and r.rc != 0, r.brief())
    # 4. test --run
    cdir = d / "cases"
    cdir.mkdir()
    cases = "version: 1\ncases:\n" + "".join(
        f"  - name: '{n}'\n    input:\n      spec: {{num_layers: 4, num_kv_heads: 2, head_size: 64}}\n    expect:\n      layout: BLHNC\n"
        for n in ["a" * 60 + "!", "x" * 5000 + "y", "ok"])
    (cdir / "c.yaml").write_text(cases)
    for label, pat in {"nested-plus": "(a+)+$", "nested-star": "(a*)*b", "alt-overlap": "(a|aa)+$", "x-backtrack": "(x+x+)+z",
                       "dotstar-many": ".*.*.*.*.*.*.*.*.*.*=", "backref": r"^(a+)\1+$", "lookahead": "(?=(a+))+b",
                       "invalid": "(", "huge-repeat": "a{1000000000}", "long-pattern": "a" * 100_000,
                       "nul": "a\x00", "empty": "", "unicode-class": r"\p{L}"}.items():
        args = ["test", str(cdir), *V34, "--run", pat]
        r = cli(args, cpu=20, timeout=60)
        ok, why = ok_result(r)
        if ok and r.secs > 20:
            ok, why = False, f"slow {r.secs:.0f}s"
        report(f"test--run/{label}", ok, why, f"kvpolicy test D --run {pat[:40]!r}")
    # 5. completion
    for sh in ("bash", "zsh", "fish"):
        r = cli(["completion", sh])
        ok, why = ok_result(r)
        exe = shutil.which(sh)
        if ok and exe:
            p = d / f"c.{sh}"
            p.write_text(r.out)
            chk = subprocess.run([exe, "-n", str(p)] if sh != "fish" else [exe, "--no-execute", str(p)], capture_output=True, text=True)
            if chk.returncode:
                ok, why = False, f"{sh} -n: {chk.stderr[:200]}"
        if ok and ("`" in r.out.replace("``", "") and sh == "bash" and "eval" in r.out):
            ok, why = False, "eval in the completion script"
        report(f"completion/{sh}", ok, why + ("" if exe else f" ({sh} not installed: syntax unchecked)"))
    for bad in ("powershell", "", "bash;id", "\x1b[31m"):
        r = cli(["completion", bad])
        report(f"completion/unknown-{bad!r}", ok_result(r)[0] and r.rc == 2, r.brief())
    # the bash completion, run: filenames with $(...) and backticks in cwd must not be executed
    if shutil.which("bash"):
        r = cli(["completion", "bash"])
        p = d / "comp.bash"
        p.write_text(r.out)
        evil = d / "ev"
        evil.mkdir()
        (evil / "$(touch PWNED)").write_text("")
        (evil / "`touch PWNED2`").write_text("")
        script = f"source {p}; COMP_WORDS=(kvpolicy dry-run --spec ''); COMP_CWORD=3; COMP_LINE='kvpolicy dry-run --spec '; COMP_POINT=${{#COMP_LINE}}; " \
                 f"f=$(complete -p kvpolicy | sed -E 's/.*-F ([^ ]+).*/\\1/'); $f kvpolicy '' --spec; printf '%s\\n' \"${{COMPREPLY[@]}}\""
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=evil)
        pwned = (evil / "PWNED").exists() or (evil / "PWNED2").exists()
        report("completion/bash-filenames-not-executed", not pwned, f"rc={out.returncode} {out.stdout[:100]!r} {out.stderr[:100]!r}")
    summary("6 waivers / --run / completion")


if __name__ == "__main__":
    main()
