# ruff: noqa  (hostile-pass scripts, not product code)
"""Issue 32, class 1: `kvpolicy fmt` (stdout, --write, --check, --diff, -, --format json) on awkward YAML.
Library property (format_rule_file) over generated files, then the CLI on hand-made ones.
Held: fmt refuses (located, no traceback) or returns a text that loads to the same value, keeps every
comment, and is a fixed point. Run: python .ci/hostile/issue32_fmt.py"""
from __future__ import annotations

import json
import random
import time

import yaml
from _i32 import R, cli, ok_result, report, summary, tmpdir

from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.fmt import format_rule_file

HEAD = "version: 1\nrules:\n"


def rule(i: int, desc: str, extra: str = "") -> str:
    return f"  - id: r{i}\n    description: {desc}\n{extra}    forbid: {{placement: cross_layer}}\n"


HAND = {
    "flow-rules": 'version: 1\nrules: [{id: a, description: "x, y", forbid: {placement: cross_layer}}]\n',
    "flow-in-block-multiline": HEAD + "  - id: a\n    description: d\n    when: {all: [\n      {field: kv.per_token_head, eq: true},  # c1\n      {field: connector.present, eq: true}]}\n    forbid: {placement: cross_layer}\n",
    "single-quoted-escape": HEAD + rule(1, "'it''s # not a comment'"),
    "double-quoted-escapes": HEAD + rule(1, '"tab\\there \\u00e9 \\x41 \\" end"'),
    "block-literal-keep": HEAD + "  - id: a\n    description: |+\n      line1\n\n      line2\n\n\n    forbid: {placement: cross_layer}\n",
    "block-folded-strip-indent": HEAD + "  - id: a\n    description: >2-\n        indented more\n      less\n    forbid: {placement: cross_layer}\n",
    "block-literal-last": HEAD + "  - id: a\n    forbid: {placement: cross_layer}\n    description: |\n      last\n",
    "block-literal-last-keep-eof": HEAD + "  - id: a\n    forbid: {placement: cross_layer}\n    description: |+\n      last\n\n",
    "anchor": HEAD + "  - id: a\n    description: &d hello\n    forbid: {placement: cross_layer}\n  - id: b\n    description: *d\n    forbid: {placement: cross_layer}\n",
    "tag-str": HEAD + "  - id: a\n    description: !!str 123\n    forbid: {placement: cross_layer}\n",
    "custom-tag": HEAD + "  - id: a\n    description: !foo bar\n    forbid: {placement: cross_layer}\n",
    "bom": "\ufeff" + HEAD + rule(1, "bom"),
    "crlf": (HEAD + rule(1, "crlf # c") + "# tail\n").replace("\n", "\r\n"),
    "crlf-in-quoted": HEAD + '  - id: a\n    description: "x\r\n      y"\n    forbid: {placement: cross_layer}\n',
    "tabs-in-value": HEAD + rule(1, "a\tb"),
    "tab-indent": "version: 1\nrules:\n\t- id: a\n",
    "unicode-keys-values": HEAD + rule(1, "日本語 — ünïcödé 🚀 \u200b"),
    "comment-everywhere": "# top\nversion: 1  # v\n# before rules\nrules:  # r\n  # before item\n  - id: a  # id\n    # before desc\n    description: d  # dd\n    forbid: {placement: cross_layer}  # f\n    # trailing in rule\n# end\n",
    "comment-in-flow-oneline": HEAD + "  - {id: a, description: d, forbid: {placement: cross_layer}}  # one\n",
    "comment-hash-in-quoted": HEAD + rule(1, '"a # b"  # real'),
    "numbers-as-strings": HEAD + rule(1, '"0x1F"') + rule(2, "'1e3'") + rule(3, '"012"') + rule(4, "'.inf'"),
    "bool-like": HEAD + rule(1, '"yes"') + rule(2, "'off'") + rule(3, '"~"') + rule(4, "'null'"),
    "plain-yes-no": HEAD + rule(1, "yes") + rule(2, "no"),
    "version-float": 'version: 1.0\nrules: []\n',
    "version-string": 'version: "1"\nrules: []\n',
    "empty-file": "",
    "only-comments": "# a\n# b\n",
    "null-doc": "~\n",
    "list-doc": "- 1\n- 2\n",
    "multi-doc": HEAD + rule(1, "a") + "---\n" + HEAD,
    "doc-end-marker": HEAD + rule(1, "a") + "...\n",
    "directive": "%YAML 1.1\n---\n" + HEAD + rule(1, "a"),
    "dup-key": "version: 1\nversion: 1\nrules: []\n",
    "merge-key": HEAD + "  - id: a\n    <<: {description: m}\n    forbid: {placement: cross_layer}\n",
    "complex-key": "? [a, b]\n: 1\nversion: 1\nrules: []\n",
    "null-key": "~: 1\nversion: 1\nrules: []\n",
    "int-key": "1: x\nversion: 1\nrules: []\n",
    "unknown-keys": HEAD + "  - zzz: 1\n    id: a\n    aaa: [1, 2]\n    description: d\n    forbid: {placement: cross_layer, zz: 1}\n",
    "waivers": "version: 1\nrules: []\nwaivers:\n  # w\n  - expires: 2027-01-31  # e\n    reason: >-\n      long\n      reason\n    rule: offloading-requires-lbhnc\n    owner: 'kv@x'\n    when: {field: connector.name, eq: OffloadingConnector}\n",
    "waivers-date-quoted": 'version: 1\nrules: []\nwaivers:\n  - {rule: r, owner: o, reason: r, expires: "2027-01-31"}\n',
    "waivers-date-bad": 'version: 1\nrules: []\nwaivers:\n  - {rule: r, owner: o, reason: r, expires: 2027-02-30}\n',
    "waivers-datetime": 'version: 1\nrules: []\nwaivers:\n  - {rule: r, owner: o, reason: r, expires: 2027-01-31T10:00:00Z}\n',
    "long-line": HEAD + rule(1, "x" * 20000),
    "many-rules": HEAD + "".join(rule(i, f"d{i}  # c{i}") for i in range(3000)),
    "deep-60": HEAD + "  - id: a\n    description: d\n    when: " + "{not: " * 60 + "{field: kv.per_token_head, eq: true}" + "}" * 60 + "\n    forbid: {placement: cross_layer}\n",
    "deep-200": HEAD + "  - id: a\n    description: d\n    when: " + "{not: " * 200 + "{field: kv.per_token_head, eq: true}" + "}" * 200 + "\n    forbid: {placement: cross_layer}\n",
    "deep-block-100": "version: 1\nx:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(100)) + "  " * 101 + "v\n",
    "colon-space-value": HEAD + rule(1, "'a: b'"),
    "plain-with-colon": HEAD + rule(1, "a:b"),
    "dash-value": HEAD + rule(1, "'- x'"),
    "question-value": HEAD + rule(1, "'? x'"),
    "percent-value": HEAD + rule(1, "'%x'"),
    "at-value": HEAD + rule(1, "'@x'"),
    "backtick": HEAD + rule(1, "'`x`'"),
    "star-value": HEAD + rule(1, "'*x'"),
    "amp-value": HEAD + rule(1, "'&x'"),
    "bang-value": HEAD + rule(1, "'!x'"),
    "pipe-value": HEAD + rule(1, "'| x'"),
    "gt-value": HEAD + rule(1, "'> x'"),
    "trailing-space-quoted": HEAD + rule(1, "'x  '"),
    "leading-space-quoted": HEAD + rule(1, "'  x'"),
    "empty-string": HEAD + rule(1, "''"),
    "nbsp": HEAD + rule(1, "a\u00a0b"),
    "nel-in-quoted": HEAD + rule(1, '"a\\Nb"'),
    "ls-in-quoted": HEAD + rule(1, '"a\\Lb"'),
    "ls-raw-plain": HEAD + rule(1, "a\u2028b"),
    "control-escaped": HEAD + rule(1, '"\\e[31m red \\a"'),
    "nul-escaped": HEAD + rule(1, '"a\\0b"'),
    "surrogate-escaped": HEAD + rule(1, '"\\ud800"'),
    "astral-escaped": HEAD + rule(1, '"\\U0001F600"'),
    "multiline-plain": HEAD + "  - id: a\n    description: one\n      two\n\n      three\n    forbid: {placement: cross_layer}\n",
    "multiline-single": HEAD + "  - id: a\n    description: 'one\n      two\n\n      three'\n    forbid: {placement: cross_layer}\n",
    "multiline-double-escape-nl": HEAD + '  - id: a\n    description: "one\\\n      two"\n    forbid: {placement: cross_layer}\n',
    "comment-no-space": HEAD + rule(1, "a#b"),
    "comment-after-block-scalar": HEAD + "  - id: a\n    description: |  # hdr\n      x\n    # after\n    forbid: {placement: cross_layer}\n",
    "comment-in-block-scalar-text": HEAD + "  - id: a\n    description: |\n      # not a comment\n    forbid: {placement: cross_layer}\n",
    "comment-lookalike-and-real": HEAD + "  - id: a\n    description: |\n      # same\n    forbid: {placement: cross_layer}  # same\n",
    "layout-order": "version: 1\ndefaults:\n  layout_order:\n    - NHD   # first\n    - HND\nrules: []\n",
    "empty-values": "version: 1\nrules:\n  -\n  - id:\n",
    "indentless-seq": "version: 1\nrules:\n- id: a\n  description: d\n  forbid: {placement: cross_layer}\n",
    "json-style": '{"version": 1, "rules": [{"id": "a", "description": "d", "forbid": {"placement": "cross_layer"}}]}\n',
    "no-trailing-newline": (HEAD + rule(1, "d")).rstrip("\n") + "  # c",
    "connector-file": "version: 1\nconnector: OffloadingConnector\nrules: []\n",
}

ALPH = ["a", " ", ",", ":", "#", "[", "]", "{", "}", "'", '"', "\\", "\t", "é", "🚀", "-", "?", "&", "*", "!", "|", ">",
        "%", "@", "`", "\u2028", "\x85", "0", "1", ".", "e", "\n", "~", "\u202e", "\x1b"]


def gen_scalar(rng: random.Random) -> str:
    s = "".join(rng.choice(ALPH) for _ in range(rng.randint(1, 12)))
    style = rng.choice(["plain", "single", "double", "literal", "folded", "literal+", "literal-", "folded+"])
    if style == "plain":
        return s.replace("\n", " ")
    if style == "single":
        return "'" + s.replace("'", "''") + "'"
    if style == "double":
        return json.dumps(s, ensure_ascii=rng.random() < 0.5)
    ind = {"literal": "|", "folded": ">", "literal+": "|+", "literal-": "|-", "folded+": ">+"}[style]
    body = "".join("      " + ln + "\n" for ln in s.replace("\t", " ").split("\n"))
    return ind + "\n" + body


def gen_file(rng: random.Random) -> str:
    out = []
    if rng.random() < 0.3:
        out.append("# head " + rng.choice(ALPH).strip() + "\n")
    out.append("version: 1\nrules:\n")
    for i in range(rng.randint(1, 4)):
        if rng.random() < 0.3:
            out.append("  # before rule %d\n" % i)
        d = gen_scalar(rng)
        cmt = "  # c%d" % i if rng.random() < 0.3 and not d.startswith(("|", ">")) else ""
        out.append(f"  - id: r{i}\n    description: {d}{cmt}\n" if not d.startswith(("|", ">")) else f"  - id: r{i}\n    description: {d}")
        if rng.random() < 0.3:
            out.append(f"    reference: {gen_scalar(rng)}" + ("\n" if not gen_scalar(rng).startswith(("|", ">")) else "\n"))
        if rng.random() < 0.5:
            out.append("    when: {field: connector.name, eq: " + rng.choice(['"a,b"', "'x'", "Foo", '"#"']) + "}\n")
        out.append("    forbid: {placement: cross_layer}\n")
    if rng.random() < 0.3:
        out.append("waivers:\n  - rule: r0\n    owner: " + gen_scalar(rng).split("\n")[0] + "\n    reason: x\n    expires: 2027-01-01\n")
    if rng.random() < 0.3:
        out.append("# tail\n")
    return "".join(out)


def comments(text: str) -> list[str]:
    # the comments a YAML scanner sees (tokens), not '#' inside scalars
    return []


def load(text):
    try:
        return ("ok", yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))  # the loader's reader
    except Exception as e:
        return ("err", type(e).__name__)


def lib_case(name: str, text: str) -> None:
    t = time.monotonic()
    try:
        out = format_rule_file(text, name)
    except PolicyError as e:
        report(f"lib/{name}", True, f"refused: {str(e).splitlines()[0][:120]}")
        return
    except RecursionError as e:
        report(f"lib/{name}", False, f"RecursionError", f"format_rule_file(open({name!r}).read())")
        return
    except Exception as e:
        report(f"lib/{name}", False, f"crash {type(e).__name__}: {e!s:.200}", repr(text[:300]))
        return
    dt = time.monotonic() - t
    a, b = load(text.lstrip("\ufeff")), load(out)
    if a != b:
        report(f"lib/{name}", False, f"meaning changed: {str(a)[:150]} -> {str(b)[:150]}", repr(text[:400]))
        return
    try:
        again = format_rule_file(out, name)
    except Exception as e:
        report(f"lib/{name}", False, f"output refused on second pass: {e!s:.200}", repr(text[:400]))
        return
    if again != out:
        report(f"lib/{name}", False, "not idempotent", repr(text[:400]))
        return
    # comments: every '#'-comment token the scanner sees in the input appears in the output
    # a candidate is a comment only if changing its text leaves the loaded value alone (else it was scalar text)
    lost = [c for c in scan_comments(text) if c not in out and load(text.replace(c, "#zz")) == load(text)]
    if lost:
        report(f"lib/{name}", False, f"lost comments {lost[:3]}", repr(text[:400]))
        return
    if dt > 10:
        report(f"lib/{name}", False, f"slow: {dt:.1f}s")
        return
    report(f"lib/{name}", True, f"same meaning, idempotent, comments kept ({dt:.2f}s)")


def scan_comments(text: str) -> list[str]:
    # crude: '#' preceded by whitespace (or at col 0) outside quotes on lines that are not inside block scalars
    res = []
    try:
        for tok in yaml.scan(text):
            pass
    except Exception:
        return res
    in_block = None
    for ln in text.splitlines():
        s = ln.lstrip(" ")
        ind = len(ln) - len(s)
        if in_block is not None:
            if s == "" or ind > in_block:
                continue
            in_block = None
        if s.startswith("#"):
            res.append(s.strip())
            continue
        q = None
        for i, ch in enumerate(ln):
            if q:
                if ch == q:
                    q = None
                continue
            if ch in "'\"" and (i == 0 or ln[i - 1] in " :[{,"):
                q = ch
            elif ch == "#" and i > 0 and ln[i - 1] in " \t":
                res.append(ln[i:].strip())
                break
        if q is None and (s.rstrip().split("#")[0].rstrip().endswith(("|", ">", "|+", "|-", ">-", ">+"))):
            in_block = ind
    return res


def cli_cases() -> None:
    d = tmpdir("fmt")
    for name in ["comment-everywhere", "crlf", "bom", "waivers", "anchor", "deep-200", "many-rules",
                 "block-literal-keep", "multiline-single", "flow-in-block-multiline", "no-trailing-newline", "ls-raw-plain"]:
        text = HAND[name]
        p = d / f"{name}.yaml"
        p.write_bytes(text.encode())
        before = p.read_bytes()
        for args in (["fmt", str(p)], ["fmt", "--check", str(p)], ["fmt", "--diff", str(p)],
                     ["fmt", "--format", "json", str(p)], ["fmt", "-"], ["fmt", "--check", "--format", "json", "-"]):
            r = cli(args, stdin=text.encode() if "-" in args else None, timeout=120)
            ok, why = ok_result(r)
            if ok and "--format" in args:
                try:
                    json.loads(r.out)
                except Exception as e:
                    ok, why = False, f"json not parseable: {e}"
            report(f"cli/{name}/{' '.join(a for a in args[1:] if a.startswith('-'))}", ok, why,
                   f"kvpolicy {' '.join(args)}")
        r = cli(["fmt", "--write", str(p)], timeout=120)
        ok, why = ok_result(r)
        after = p.read_bytes()
        if ok and r.rc != 0 and after != before:
            ok, why = False, "fmt --write failed but the file changed"
        if ok and r.rc == 0:
            if load(after.decode("utf-8", "replace")) != load(before.decode().lstrip("\ufeff")):
                ok, why = False, "written file has another meaning"
            r2 = cli(["fmt", "--check", str(p)], timeout=120)
            if r2.rc != 0:
                ok, why = False, "written file is not canonical by --check " + r2.brief()
        litter = [x.name for x in d.iterdir() if x.name.startswith(".")]
        if litter:
            ok, why = False, f"temp litter {litter}"
        report(f"cli/{name}/--write", ok, why, f"kvpolicy fmt --write {p}")


def main() -> None:
    for name, text in HAND.items():
        lib_case(name, text)
    rng = random.Random(32)
    for i in range(400):
        lib_case(f"gen-{i}", gen_file(rng))
    cli_cases()
    summary("1 fmt")


if __name__ == "__main__":
    main()
