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


def test_a_new_file_gets_the_mode_open_would_give(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_atomically(tmp_path / "new.svg", b"<svg/>")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.svg").stat().st_mode) == 0o644
    assert (tmp_path / "new.svg").read_bytes() == b"<svg/>"
