"""Reading a file a user names, without surprises: bounded, regular files only, UTF-8, located errors.

A FIFO or a device named like a rule file would block or never end; a multi-gigabyte file named
by mistake would be read whole before any check. Every loader of user files (rule files, policy
test files, `--spec`, `config.json`) reads through `read_capped`, so each refuses the same way.
"""

from __future__ import annotations

import stat
from pathlib import Path

from kvpolicy.policy.errors import Diagnostic

__all__ = ["read_capped"]


def read_capped(real: Path, shown: str, max_bytes: int) -> tuple[str | None, list[Diagnostic]]:
    """The UTF-8 text of a regular file of at most ``max_bytes``, or located diagnostics.

    Never opens a FIFO or device (it could block or never end) and never reads more than the cap.
    """
    def fail(code: str, message: str, help: str | None = None, line: int = 0, col: int = 0) -> tuple[None, list]:
        return None, [Diagnostic(shown, line, col, code, message, help)]

    try:
        st = real.stat()
    except (OSError, RuntimeError) as exc:
        return fail("unreadable", f"cannot read the file: {getattr(exc, 'strerror', None) or exc}")
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a pipe or device"
        return fail("not-a-file", f"not a regular file ({kind})", "these files must be plain files")
    try:
        if st.st_size > max_bytes:
            return fail("too-large", f"the file is {st.st_size} bytes, over the {max_bytes}-byte limit",
                        "split it, or raise Limits.max_file_bytes")
        with open(real, "rb") as fh:
            raw = fh.read(max_bytes + 1)
        if len(raw) > max_bytes:  # it grew since stat
            return fail("too-large", f"the file is over the {max_bytes}-byte limit",
                        "split it, or raise Limits.max_file_bytes")
    except OSError as exc:
        return fail("unreadable", f"cannot read the file: {exc.strerror or exc}", "check its permissions")
    if raw.startswith(b"\xef\xbb\xbf"):
        return fail("bom", "the file starts with a byte-order mark", "save it as UTF-8 without BOM", 1, 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - (before.rfind(b"\n") + 1) + 1
        return fail("encoding", f"invalid UTF-8 byte 0x{raw[exc.start]:02x}", "save the file as UTF-8", line, col)
    return text, []
