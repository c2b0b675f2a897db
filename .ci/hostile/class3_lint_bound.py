# ruff: noqa  (hostile-pass scripts, not product code)
"""Class 3: lint/diff on adversarial rule sets must finish bounded (--max-space) with the documented
message. Each run is capped at 120 s of CPU (ulimit -t; the machine is shared) and measured with /usr/bin/time -v
(user+sys seconds, peak RSS).
Run: python hostile/class3_lint_bound.py [case ...]   (about 8 min for all on 2 busy cores)"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _common import report, summary

KVP = str(Path(sys.executable).parent / "kvpolicy")
CAP = 120


def write(d: Path, rules: list, conn: str | None = None) -> Path:
    (d / "connectors").mkdir(parents=True, exist_ok=True)
    doc = {"version": 1, "rules": rules}
    if conn:
        doc["connector"] = conn
        (d / "connectors" / f"{conn}.yaml").write_text(yaml.safe_dump(doc))
    else:
        (d / "global.yaml").write_text(yaml.safe_dump(doc))
    return d


def rule(i: int, when: dict, effect: str = "prefer", tag: str = "r") -> dict:
    r = {"id": f"{tag}{i}", "description": "hostile", "when": when}
    if effect == "prefer":
        r.update(prefer={"layout": ["LBHNC"]}, weight=1 + i % 7)
    else:
        r[effect] = {"layout": ["BHLNC"]}
    return r


def timed(args: list[str]) -> tuple[int | None, float, int, str, str]:
    """rc (None past the cap), CPU seconds (user+sys: the machine is shared, wall time is not the cost),
    peak RSS KiB, stdout, stderr. The cap is CAP seconds of CPU (ulimit -t), 8x that of wall time."""
    import shlex
    cmd = f"ulimit -t {CAP}; exec {shlex.quote(KVP)} " + " ".join(shlex.quote(a) for a in args)
    p = subprocess.run(["/usr/bin/time", "-v", "timeout", str(8 * CAP), "bash", "-c", cmd], capture_output=True,
                       text=True)
    user = float(re.search(r"User time \(seconds\): ([\d.]+)", p.stderr).group(1))
    system = float(re.search(r"System time \(seconds\): ([\d.]+)", p.stderr).group(1))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    rc = None if p.returncode in (124, 137, 152, -9, -24) or "Command terminated by signal" in p.stderr else p.returncode
    return rc, user + system, rss, p.stdout, p.stderr


def cases(tmp: Path) -> dict:
    c = {}
    # the bound counts inputs, not inputs x rules: many rules on the same literal keep the space, multiply the work
    c["same-literal-200-rules-0.34"] = (["lint", str(write(tmp / "s200", [rule(i, {"field": "backend.name", "eq": "FLASH_ATTN"}) for i in range(200)])), "--vllm-version", "0.34.0"], None)
    c["same-literal-2000-rules-0.34"] = (["lint", str(write(tmp / "s2000", [rule(i, {"field": "backend.name", "eq": "FLASH_ATTN"}) for i in range(2000)])), "--vllm-version", "0.34.0"], None)
    big = tmp / "s10000"  # 10,000 rules (the loader's max_rules) in two files under its 1 MB bound each
    write(big, [rule(i, {"field": "backend.name", "eq": "FLASH_ATTN"}) for i in range(5000)])
    (big / "more.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        rule(i, {"field": "backend.name", "eq": "FLASH_ATTN"}, tag="m") for i in range(4980)]}))
    c["same-literal-9980-rules-0.34 (near the loader's max_rules)"] = (["lint", str(big), "--vllm-version", "0.34.0"], None)
    c["same-literal-1000-rules-0.27"] = (["lint", str(write(tmp / "s1000", [rule(i, {"field": "backend.name", "eq": "FLASH_ATTN"}) for i in range(1000)])), "--vllm-version", "0.27.0"], None)
    # one field, thousands of literals (each literal: its value and one outside)
    c["in-list-3000-num_layers"] = (["lint", str(write(tmp / "inl", [rule(0, {"field": "kv.num_layers", "in": list(range(1, 3001))})])), "--vllm-version", "0.34.0"], None)
    # 20 sizes read together (the case) plus 40 extras in one rule, in 6 layers at once
    layers = []
    for k in range(6):
        d = tmp / f"layer{k}"
        write(d, [rule(i, {"all": [{"field": f, "gt": 8 + i + k} for f in ("kv.num_layers", "kv.block_size", "kv.num_kv_heads", "kv.head_size")]}, tag=f"l{k}r") for i in range(5)])
        write(d, [rule(0, {"all": [{"field": f"connector.extra.k{k}x{j}", "lt": j} for j in range(40)]}, tag=f"l{k}c")], "NixlConnector")
        layers += ["--rules", str(d)]
    c["six-layers-joint-sizes-and-extras"] = (["lint", *layers, "--vllm-version", "0.34.0"], "space-cut")
    # 30 connector files each reading 8 extras (MultiConnector pairs grow as files squared)
    d = tmp / "conns"
    for n in range(30):
        write(d, [rule(0, {"all": [{"field": f"connector.extra.e{j}", "eq": j} for j in range(8)]}, tag=f"c{n}-")], f"HostileConnector{n}x")
    write(d, [])
    c["thirty-connector-files"] = (["lint", str(d), "--vllm-version", "0.34.0"], "space-cut")
    # diff of two adversarial sets
    a, b = tmp / "diffa", tmp / "diffb"
    for root, off in ((a, 0), (b, 1)):
        write(root, [rule(0, {"all": [{"field": f"connector.extra.x{j}", "lt": j + off} for j in range(60)]}, tag="d")], "NixlConnector")
        write(root, [])
    c["diff-60-extras-each-side"] = (["diff", str(a), str(b), "--vllm-version", "0.34.0"], None)
    # --max-space values
    for v in ("0", "-1", "abc", "1e3", "9" * 40, ""):
        c[f"max-space={v[:12]!r}"] = (["lint", str(a), "--vllm-version", "0.34.0", "--max-space", v], "refused")
    c["max-space=1_000 (python int syntax, taken)"] = (["lint", str(a), "--vllm-version", "0.34.0", "--max-space", "1_000"], None)
    c["max-space=1"] = (["lint", str(tmp / "s200"), "--vllm-version", "0.34.0", "--max-space", "1"], "space-cut")
    return c


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="host23-c3-"))
    only = set(sys.argv[1:])
    for name, (args, expect) in cases(tmp).items():
        if only and name not in only:
            continue
        rc, s, rss, out, err = timed(args)
        text = out + err
        line = f"{s:.1f} CPU s, {rss / 1024:.0f} MiB, rc {rc}"
        if rc is None:
            ok, why = False, f"did not finish within {CAP} CPU s ({line}); no bound message"
        elif expect == "refused":
            located = "--max-space" in err and "Traceback" not in err and rc == 2
            ok, why = located, f"{line}: {err.strip().splitlines()[0][:120] if err.strip() else '(no message)'}"
        elif expect == "space-cut":
            ok = "space-cut" in text and "Traceback" not in text
            why = f"{line}: " + ("warning[space-cut] said" if "space-cut" in text else "no space-cut warning")
        else:
            ok = "Traceback" not in text and rc in (0, 1)
            why = f"{line}" + (": space-cut" if "space-cut" in text else "")
        report(f"c3/{name}", ok and s < CAP, why, f"kvpolicy {' '.join(a if len(a) < 60 else '<dir>' for a in args)}")
    summary("3")


if __name__ == "__main__":
    main()
