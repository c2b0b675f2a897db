"""Files a user names, without surprises: read bounded, written whole.

Reading: a FIFO or a device named like a rule file would block or never end; a multi-gigabyte file
named by mistake would be read whole before any check. Every loader of user files (rule files, policy
test files, `--spec`, `config.json`) reads through `read_capped`, so each refuses the same way.

Writing: every file kvpolicy writes (``fmt --write``, ``--record-test``, ``--svg``, the plugin's store
stamps, the guard table) goes through `write_atomically`: a full disk or a killed process leaves the
old file or the new one, never a truncated rule file that would still load.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

from kvpolicy.policy.errors import Diagnostic

__all__ = ["read_capped", "read_stdin_capped", "write_atomically"]


def write_atomically(path: Path | str, data: str | bytes, *, encoding: str = "utf-8") -> None:
    """``data`` at ``path``, replaced in one step (written beside it, flushed to disk, renamed over it): a
    reader sees the old file or the new one, never a part. A file that exists keeps its permissions; a
    symbolic link keeps pointing where it did (its target is replaced). A path that is no regular file (a
    device such as ``/dev/stdout``, a FIFO) is written to as `open` would, never replaced. Raises OSError as
    `open` would, the old file untouched."""
    payload = data.encode(encoding) if isinstance(data, str) else data
    try:  # the path itself, links followed: /dev/stdout on a pipe resolves to no path (`pipe:[...]`), but opens
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # INVARIANT: a device, FIFO or terminal (`--svg /dev/stdout`) is written to, never replaced by a file
        with open(path, "wb") as f:
            f.write(payload)
        return
    if st is not None:
        _check_replaceable(path, st)
    target = Path(os.path.realpath(path))
    mode = stat.S_IMODE(st.st_mode) if st is not None else None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:  # a new file gets the mode `open` would give it
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_directory(target.parent)


def _check_replaceable(path: Path | str, st: os.stat_result) -> None:
    """Refuse to replace a file whose replacement would not be the file the user meant to change."""
    if not st.st_mode & 0o222 or not os.access(path, os.W_OK):
        raise OSError(errno.EACCES, f"the file is read-only (mode {stat.S_IMODE(st.st_mode):04o}); make it "
                      "writable (chmod u+w) if it is to change", str(path))
    if st.st_nlink > 1:
        raise OSError(errno.EMLINK, f"the file has {st.st_nlink} hard links, which a replacement would part "
                      "from it (they would keep the old text); copy it to a file of its own first", str(path))


def _sync_directory(folder: Path) -> None:
    """Flush the folder's entry for the renamed file, so that after a crash the path holds the new file,
    not the old one or none. Where a folder cannot be opened or synced (Windows), the rename stands as is."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_capped(real: Path, shown: str, max_bytes: int) -> tuple[str | None, list[Diagnostic]]:
    """The UTF-8 text of a regular file of at most ``max_bytes``, or located diagnostics.

    Never opens a FIFO or device (it could block or never end) and never reads more than the cap.
    """
    def fail(code: str, message: str, help: str | None = None, line: int = 0, col: int = 0) -> tuple[None, list]:
        return None, [Diagnostic(shown, line, col, code, message, help)]

    try:
        st = real.stat()
    except (OSError, RuntimeError) as exc:
        return fail("unreadable", f"cannot read the file: {getattr(exc, 'strerror', None) or exc}",
                    "check the path (a link must point to a file that exists) and its permissions")
    except ValueError:  # a NUL byte, or a lone surrogate the file system cannot encode
        return fail("unreadable", "cannot read the file: the name is not a usable path",
                    "name the file with plain text")
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
    return _decoded(raw, shown)


def read_stdin_capped(stream: IO[Any], shown: str, max_bytes: int) -> tuple[str | None, list[Diagnostic]]:
    """The UTF-8 text of ``stream`` (stdin) up to ``max_bytes``, or located diagnostics: an endless or huge
    stdin is refused after ``max_bytes + 1`` bytes, never read whole, as `read_capped` refuses a file."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        raw = buffer.read(max_bytes + 1)
    else:  # a text stream without bytes underneath (a test's StringIO): the cap in characters, then bytes
        raw = stream.read(max_bytes + 1).encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        return None, [Diagnostic(shown, 0, 0, "too-large", f"stdin is over the {max_bytes}-byte limit of a "
                                 "rule file (reading stopped there)",
                                 "pipe in one rule file of at most that size, or split it")]
    return _decoded(raw, shown)


def _decoded(raw: bytes, shown: str) -> tuple[str | None, list[Diagnostic]]:
    """``raw`` as UTF-8 text without a byte-order mark, or where it is not."""
    if raw.startswith(b"\xef\xbb\xbf"):
        return None, [Diagnostic(shown, 1, 1, "bom", "the file starts with a byte-order mark",
                                 "save it as UTF-8 without BOM")]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - (before.rfind(b"\n") + 1) + 1
        return None, [Diagnostic(shown, line, col, "encoding", f"invalid UTF-8 byte 0x{raw[exc.start]:02x}",
                                 "save the file as UTF-8")]
    return text, []
