"""`write_atomically`: every file kvpolicy writes is the old one or the new one, never a part."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from kvpolicy.policy import files
from kvpolicy.policy.files import write_atomically


def _full_disk(_fd: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_leaves_the_old_file_and_no_litter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "rules.yaml"
    target.write_text("version: 1\nrules: [a, b]\n")
    monkeypatch.setattr(files.os, "fsync", _full_disk)
    with pytest.raises(OSError):
        write_atomically(target, "version: 1\n")
    assert target.read_text() == "version: 1\nrules: [a, b]\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rules.yaml"]


def test_permissions_and_links_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "rules.yaml"
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    write_atomically(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_read_only_file_is_refused_not_replaced(tmp_path: Path) -> None:
    """A rename would replace a file nobody may write (root's `open` would too): refused, as editors do."""
    target = tmp_path / "rules.yaml"
    target.write_text("old\n")
    target.chmod(0o444)
    with pytest.raises(OSError) as exc:
        write_atomically(target, "new\n")
    assert exc.value.errno == errno.EACCES and "read-only (mode 0444)" in exc.value.strerror
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["rules.yaml"]


def test_a_file_with_other_hard_links_is_refused_not_parted_from_them(tmp_path: Path) -> None:
    target = tmp_path / "rules.yaml"
    target.write_text("old\n")
    os.link(target, tmp_path / "other.yaml")
    with pytest.raises(OSError) as exc:
        write_atomically(target, "new\n")
    assert exc.value.errno == errno.EMLINK and "2 hard links" in exc.value.strerror
    assert target.read_text() == (tmp_path / "other.yaml").read_text() == "old\n"
    assert os.stat(target).st_ino == os.stat(tmp_path / "other.yaml").st_ino


def test_a_new_file_gets_the_mode_open_would_give(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_atomically(tmp_path / "new.svg", b"<svg/>")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.svg").stat().st_mode) == 0o644
    assert (tmp_path / "new.svg").read_bytes() == b"<svg/>"


def test_a_device_is_written_to_never_replaced(tmp_path: Path) -> None:
    # `--svg /dev/stdout`, `fmt --write` of a FIFO: renaming a file over a device node would replace it
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_atomically(fifo, "through the pipe\n")
        assert os.read(reader, 100) == b"through the pipe\n"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    write_atomically("/dev/null", "x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_full_device_is_an_error_and_stays_a_device() -> None:
    with pytest.raises(OSError) as exc:
        write_atomically("/dev/full", "x" * 100_000)
    assert exc.value.errno == errno.ENOSPC
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_dev_stdout_on_a_pipe_is_written_to() -> None:
    # `kvpolicy dry-run --svg /dev/stdout | less`: /dev/stdout -> /proc/self/fd/1 -> `pipe:[N]`, which is no
    # path; resolving it first made the write fail (`cannot write /dev/stdout: No such file or directory`)
    import subprocess
    import sys

    code = "from kvpolicy.policy.files import write_atomically; write_atomically('/dev/stdout', 'through the pipe')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "through the pipe"


def test_the_folder_entry_is_flushed_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a crash the path holds the new file: the file's bytes and then its folder's entry reach the disk."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    write_atomically(tmp_path / "decision.json", "{}")
    assert synced == ["file", "folder"]
    assert (tmp_path / "decision.json").read_text() == "{}"
