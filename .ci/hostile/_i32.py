# ruff: noqa  (hostile-pass scripts, not product code)
"""Issue 32 hostile pass: run the installed `kvpolicy` CLI as a child (nice 10, CPU-capped via ulimit -t,
wall timeout), and check a result for tracebacks and raw control characters."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import report, summary  # noqa: F401

PY = os.environ.get("KVP_PY", sys.executable)
# raw terminal hazards: C0 except \t \n, DEL, C1, bidi overrides/isolates, line/paragraph separators
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
V34 = ["--vllm-version", "vllm-0.34"]


class R:
    def __init__(self, rc, out: bytes, err: bytes, secs: float):
        self.rc, self.outb, self.errb, self.secs = rc, out, err, secs
        self.out = out.decode("utf-8", "replace")
        self.err = err.decode("utf-8", "replace")

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err or self.rc == -999

    def raw(self) -> list[str]:
        return sorted({repr(c) for c in RAW.findall(self.out + self.err)})

    def invalid_utf8(self) -> bool:
        try:
            self.outb.decode("utf-8"); self.errb.decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True

    def brief(self) -> str:
        return f"rc={self.rc} t={self.secs:.1f}s err={self.err.strip()[-300:]!r}"


def cli(args, stdin: bytes | None = None, env: dict | None = None, cwd=None, timeout: float = 90,
        cpu: int = 60, fsize_kb: int | None = None) -> R:
    import time
    e = dict(os.environ)
    e.setdefault("LC_ALL", "C.UTF-8")
    e["KVPOLICY_TODAY"] = e.get("KVPOLICY_TODAY", "2026-12-07")
    if env:
        e.update(env)
    lim = f"ulimit -t {cpu}; " + (f"ulimit -f {fsize_kb}; " if fsize_kb else "")
    cmd = ["bash", "-c", lim + 'exec nice -n 10 "$0" -m kvpolicy "$@"', PY, *[os.fsdecode(a) if isinstance(a, bytes) else a for a in args]]
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, input=stdin if stdin is not None else b"", capture_output=True, env=e, cwd=cwd,
                           timeout=timeout)
        return R(p.returncode, p.stdout, p.stderr, time.monotonic() - t)
    except subprocess.TimeoutExpired as x:
        return R(-998, x.stdout or b"", (x.stderr or b"") + b"\n<wall timeout>", time.monotonic() - t)


def tmpdir(tag: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"i32h-{tag}-", dir="/tmp/i32h"))


def ok_result(r: R, *, allow_rc=(0, 1, 2)) -> tuple[bool, str]:
    """A sane outcome: a known exit code, no traceback, no raw controls, no timeout, valid UTF-8."""
    if r.rc in (-998,):
        return False, "hang: " + r.brief()
    if r.rc < 0 or r.rc >= 128 or r.rc == 137:
        return False, f"killed (signal/cpu limit) {r.brief()}"
    if r.traceback:
        return False, "traceback: " + r.err.strip().splitlines()[-1][:300]
    if r.rc not in allow_rc:
        return False, "unexpected exit " + r.brief()
    raw = r.raw()
    if raw:
        return False, f"raw control chars {raw} reach the terminal: {r.brief()}"
    if r.invalid_utf8():
        return False, "output is not valid UTF-8"
    return True, f"rc={r.rc} {r.secs:.1f}s"
