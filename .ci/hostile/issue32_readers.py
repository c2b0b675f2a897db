# ruff: noqa  (hostile-pass scripts, not product code)
"""Issue 32, class 4: bounded readers. Every reader of operator input (serve-line --config YAML, --spec,
--fleet, case files, rule files, stdin `-`, compat sides, --kv-transfer-config, a model's config.json) fed
alias bombs, deep nesting, huge integers, huge files, a FIFO with no writer, /dev/zero, /dev/urandom-like
binary. Held: exit 1/2, no traceback, a message naming the input, within 20 CPU seconds (ulimit -t) and
60 s wall. Run: python .ci/hostile/issue32_readers.py"""
from __future__ import annotations

import json
import os
import random

from _i32 import V34, cli, ok_result, report, summary, tmpdir

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
DEEP_FLOW = "x: " + "[" * 50_000 + "]" * 50_000 + "\n"
DEEP_MAP = "x: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n"
DEEP_BLOCK = "".join(" " * i + "a:\n" for i in range(3000)) + " " * 3000 + "1\n"
HUGE_INT = "num_layers: " + "9" * 200_000 + "\n"
HUGE_FILE = "# pad\n" * 400_000 + "num_layers: 4\n"
MANY_KEYS = "".join(f"k{i}: {i}\n" for i in range(200_000))
LONG_LINE = "x: " + "a" * 3_000_000 + "\n"
BINARY = bytes(random.Random(4).randrange(256) for _ in range(200_000))
JSON_DEEP = "[" * 100_000 + "]" * 100_000
JSON_HUGE_INT = '{"num_hidden_layers": ' + "9" * 100_000 + "}"
JSON_BOMB_KEYS = "{" + ",".join(f'"k{i}": {i}' for i in range(300_000)) + "}"

CONTENTS = {"alias-bomb": BOMB, "deep-flow": DEEP_FLOW, "deep-map": DEEP_MAP, "deep-block": DEEP_BLOCK,
            "huge-int": HUGE_INT, "huge-file": HUGE_FILE, "many-keys": MANY_KEYS, "long-line": LONG_LINE,
            "binary": BINARY, "nul": "a: b\x00c\n", "json-deep": JSON_DEEP, "json-huge-int": JSON_HUGE_INT,
            "json-many-keys": JSON_BOMB_KEYS, "utf16": "num_layers: 4\n".encode("utf-16"),
            "merge-bomb": "a: &a {x: 1}\n" + "".join(f"b{i}: {{<<: *a}}\n" for i in range(50_000))}


def judge(case: str, r, repro: str) -> None:
    ok, why = ok_result(r, allow_rc=(1, 2))
    if ok and r.secs > 30:
        ok, why = False, f"slow: {r.secs:.1f}s wall"
    if ok and not r.err.strip():
        ok, why = False, "no message"
    report(case, ok, why, repro)


def main() -> None:
    d = tmpdir("readers")
    paths = {}
    for label, c in CONTENTS.items():
        p = d / f"{label}.yaml"
        p.write_bytes(c if isinstance(c, bytes) else c.encode())
        paths[label] = str(p)
    fifo = d / "fifo.yaml"
    os.mkfifo(fifo)
    paths["fifo"] = str(fifo)
    paths["dev-zero"] = "/dev/zero"
    paths["dev-urandom"] = "/dev/urandom"
    paths["directory"] = str(d)
    # model directories with hostile config.json
    for label in ("json-deep", "json-huge-int", "json-many-keys", "binary", "huge-file"):
        m = d / f"model-{label}"
        m.mkdir()
        (m / "config.json").write_bytes(open(paths[label], "rb").read())
    m = d / "model-fifo"
    m.mkdir()
    os.mkfifo(m / "config.json")
    m = d / "model-zero"
    m.mkdir()
    (m / "config.json").symlink_to("/dev/zero")

    def readers(p: str) -> dict[str, tuple[list[str], bytes | None]]:
        return {
            "spec": (["dry-run", *V34, "--spec", p], None),
            "serve--config": (["dry-run", *V34, "--", "m", "--config", p], None),
            "fleet": (["dry-run", *V34, "--fleet", p], None),
            "lint--fleet": (["lint", *V34, "--fleet", p], None),
            "test": (["test", *V34, p], None),
            "validate-file": (["validate", p, *V34], None),
            "fmt": (["fmt", p], None),
            "compat-side": (["compat", p, p], None),
            "compat-fleet-side": (["compat", p + "#a", p + "#b"], None),
        }

    for label, p in paths.items():
        for reader, (args, stdin) in readers(p).items():
            if label == "directory" and reader in ("test", "validate-file", "fmt"):
                continue  # a directory is a valid input there
            r = cli(args, stdin=stdin, cpu=20, timeout=60)
            judge(f"{reader}/{label}", r, f"kvpolicy {' '.join(args)}".replace(str(d), "D"))
    # stdin
    for label in ("alias-bomb", "deep-flow", "huge-file", "long-line", "binary", "merge-bomb", "many-keys"):
        c = CONTENTS[label]
        c = c if isinstance(c, bytes) else c.encode()
        for args in (["validate", "-", *V34], ["fmt", "-"], ["fmt", "--check", "-"]):
            r = cli(args, stdin=c, cpu=20, timeout=60)
            judge(f"stdin/{args[0]}/{label}", r, f"kvpolicy {' '.join(args)} < {label}.yaml")
    # kv-transfer-config flag / serve-line JSON
    for label, c in {"json-deep": JSON_DEEP, "json-huge-int": '{"kv_connector": "X", "kv_role": ' + "9" * 100_000 + "}",
                     "json-many-keys": JSON_BOMB_KEYS[:120_000] + "}", "not-json": "{nope", "nan": '{"kv_buffer_size": NaN}',
                     "dup-keys": '{"kv_connector": "A", "kv_connector": "B"}', "huge-float": '{"kv_buffer_size": 1e999}'}.items():
        r = cli(["dry-run", *V34, "--kv-transfer-config", c], cpu=20, timeout=60)
        judge(f"--kv-transfer-config/{label}", r, f"kvpolicy dry-run --kv-transfer-config '{c[:40]}...'")
        r = cli(["dry-run", *V34, "--", "m", "--kv-transfer-config", c], cpu=20, timeout=60)
        judge(f"serve--kv-transfer-config/{label}", r, f"kvpolicy dry-run -- m --kv-transfer-config '{c[:40]}...'")
    # models
    for m in sorted(d.glob("model-*")):
        for args in (["dry-run", *V34, "--model", str(m)], ["dry-run", *V34, "--", str(m)]):
            r = cli(args, cpu=20, timeout=60)
            judge(f"model/{m.name}/{'serve' if '--' in args else 'flag'}", r, f"kvpolicy {' '.join(args)}".replace(str(d), "D"))
    # rule directories holding the hostile files
    for label in ("alias-bomb", "deep-flow", "huge-file", "binary", "merge-bomb", "fifo"):
        rd = d / f"rules-{label}"
        rd.mkdir()
        src = paths[label]
        if label == "fifo":
            os.mkfifo(rd / "global.yaml")
        else:
            (rd / "global.yaml").write_bytes(open(src, "rb").read())
        for args in (["validate", str(rd), *V34], ["dry-run", *V34, "--rules", str(rd)], ["lint", str(rd), *V34],
                     ["fmt", "--check", str(rd)]):
            r = cli(args, cpu=20, timeout=60)
            judge(f"rules-dir/{args[0]}/{label}", r, f"kvpolicy {' '.join(args)}".replace(str(d), "D"))
    summary("4 bounded readers")


if __name__ == "__main__":
    main()
