# ruff: noqa  (hostile-pass scripts, not product code)
"""Class 5: every verb's outputs (text/json/sarif/github) for legal but awkward rule-file names, beyond
tests/cli/test_report_formats.py's six (terminal escapes, CR, NEL, U+2028, `#`/`?` in URIs, very long...).
In-process, stdout/stderr strict UTF-8 as under a UTF-8 locale. Run: python hostile/class5_names.py"""
from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote_to_bytes

sys.path.insert(0, str(Path(__file__).parent))
from _common import report, summary

from kvpolicy.engine.cli.main import main

NAMES = {"ansi-escape": b"red\x1b[31mX\x1b[0m", "cr": b"car\rret", "tab": b"ta\tb", "bell-del": b"b\x07d\x7f",
         "hash-query": b"frag#x?q=1", "backslash": b"back\\slash", "nel-u0085": "ne\u0085l".encode(),
         "line-sep-u2028": "ls\u2028x".encode(), "rtl-u202e": "rtl\u202etxt".encode(),
         "github-cmd": b"::error::pwned", "pct-0A": b"%0A::warning::x", "long-240": b"L" * 240,
         "leading-dash": b"--help", "c1-csi-u009b": "c1\u009b31m".encode()}
_TWICE = ("version: 1\nrules:\n  - id: site-no-cross\n    description: a site rule\n"
          "    forbid: {placement: cross_layer}\n  - id: site-no-cross-again\n    description: the same again\n"
          "    forbid: {placement: cross_layer}\n")
_BROKEN = "version: 1\nrules:\n  - id: site-bad\n    descriptio: typo\n    forbid: {placement: cross_layer}\n"
_CASE = ("version: 1\ncases:\n  - name: a case that fails\n    input:\n      spec: {num_layers: 32, block_size: 16, "
         "num_kv_heads: 8, head_size: 128}\n      backend: FLASH_ATTN\n    expect:\n      layout: cross_layer/NHD\n")
V = ["--vllm-version", "issue-48412"]
BAD_CHARS = ["\x1b", "\r", "\x07", "\x7f", "\x85", "\u2028", "\u009b"]


def run(argv: list[str]) -> tuple[int, str, str]:
    out_b, err_b = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_b, encoding="utf-8", errors="strict", newline="\n")
    err = io.TextIOWrapper(err_b, encoding="utf-8", errors="strict", newline="\n")
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        except BaseException as e:  # a traceback
            code = -1
            err.write(f"Traceback: {type(e).__name__}: {e!r}"[:300])
        out.flush()
        err.flush()
    finally:
        sys.stdout, sys.stderr = old
    return code, out_b.getvalue().decode("utf-8", "replace"), err_b.getvalue().decode("utf-8", "replace")


def make(root: Path, name: bytes, text: str) -> tuple[str, bytes]:
    d = os.path.join(os.fsencode(root), b"dir-" + name)
    os.makedirs(os.path.join(d, b"tests"))
    with open(os.path.join(d, name + b".yaml"), "wb") as f:
        f.write(text.encode())
    with open(os.path.join(d, b"tests", name + b".yaml"), "wb") as f:
        f.write(_CASE.encode())
    return os.fsdecode(b"./dir-" + name), os.path.join(b"./dir-" + name, name + b".yaml")


def raw_control(text: str) -> list[str]:
    return sorted({repr(c) for c in BAD_CHARS if c in text})


def main_() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="host23-c5-"))
    os.chdir(tmp)
    for label, name in NAMES.items():
        for broken in (False, True):
            sub = tmp / f"{label}-{int(broken)}"
            sub.mkdir()
            os.chdir(sub)
            d, fbytes = make(sub, name, _BROKEN if broken else _TWICE)
            for verb in ("validate", "lint"):
                for fmt in ("text", "json", "sarif", "github"):
                    code, out, err = run([verb, d, *V, "--format", fmt])
                    case = f"c5/{verb}/{fmt}/{label}/{'broken' if broken else 'clean'}"
                    repro = (f"cd $(mktemp -d) && mkdir -p \"dir-{name!r}\" && ... kvpolicy {verb} DIR {' '.join(V)} "
                             f"--format {fmt}   (python hostile/class5_names.py, case {case})")
                    problems = []
                    if "Traceback" in err or code == -1:
                        problems.append(f"traceback: {err[-150:]!r}")
                    if code != (1 if broken else 0):
                        problems.append(f"exit {code}, expected {1 if broken else 0}")
                    if fmt == "text" and raw_control(out + err):
                        problems.append(f"raw control characters {raw_control(out + err)} in the text output "
                                        "(terminal escapes / split lines)")
                    if fmt in ("json", "sarif") and out.strip():
                        try:
                            doc = json.loads(out)
                        except ValueError as e:
                            problems.append(f"not JSON: {e}")
                            doc = None
                        if fmt == "sarif" and doc is not None:
                            uris = [loc["physicalLocation"]["artifactLocation"]["uri"]
                                    for r in doc["runs"][0]["results"] for loc in r.get("locations", [])]
                            for u in uris:
                                if "#" in u or "?" in u or any(ord(c) < 0x21 or ord(c) > 0x7e for c in u):
                                    problems.append(f"SARIF uri not percent-encoded: {u[:80]!r}")
                            if uris and not any(unquote_to_bytes(u).endswith(fbytes.lstrip(b"./")) or
                                                unquote_to_bytes(u).endswith(fbytes) for u in uris):
                                problems.append(f"no SARIF uri decodes to the file's bytes: {uris[:2]!r:.120}")
                    if fmt == "github":
                        for line in out.split("\n"):
                            if line and not line.startswith("::"):
                                problems.append(f"a line that is no workflow command: {line[:80]!r}")
                                break
                            if "\r" in line:
                                problems.append("raw CR in a workflow command")
                                break
                            if line.count("::") > 2 and "::" in line.split("::", 2)[2] and False:
                                pass
                    report(case, not problems, "; ".join(problems) or f"exit {code}", repro)
            # the verbs that print sources and case locations (text/json), as the existing test does
            for argv, expected in ((["test", "--rules", d, os.path.join(d, "tests")], 1),
                                   (["dry-run", "--rules", d], 0 if not broken else 1),
                                   (["explain", "--rules", d], 0 if not broken else 1)):
                for fmt in ("text", "json"):
                    code, out, err = run([*argv, *V, "--format", fmt])
                    case = f"c5/{argv[0]}/{fmt}/{label}/{'broken' if broken else 'clean'}"
                    problems = []
                    if "Traceback" in err or code == -1:
                        problems.append(f"traceback: {err[-150:]!r}")
                    if "invalid choice" in err or "unrecognized" in err:
                        continue  # no such verb/format
                    if fmt == "text" and raw_control(out + err):
                        problems.append(f"raw control characters {raw_control(out + err)} in the text output")
                    if fmt == "json" and out.strip():
                        try:
                            json.loads(out)
                        except ValueError as e:
                            problems.append(f"not JSON: {e}")
                    report(case, not problems, "; ".join(problems) or f"exit {code}",
                           f"python hostile/class5_names.py  ({case})")
            os.chdir(tmp)
    summary("5")


if __name__ == "__main__":
    main_()
