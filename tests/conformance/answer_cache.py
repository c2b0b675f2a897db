"""Oracle answers kept in the release cache, asked once among the test processes that share it.

Kept apart from `vllm_release` on purpose: that module is part of every answer's key (it names the oracle's
environment), and how answers are kept changes no answer, so an edit here asks no release again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: one test process at a time is assumed
    fcntl = None  # type: ignore[assignment]


def answered(kept: Path | None, cases: list[dict], ask: Callable[[], list[dict]]) -> tuple[list[dict], bool]:
    """The answers kept at ``kept`` (None: keep nothing), else ``ask()``'s, kept there; and whether they
    were asked now. One asker per answer among the processes sharing the cache (pytest-xdist's workers
    each start the same oracles ahead): the others wait for it and read what it kept."""
    if kept is None:
        return ask(), True
    if (answers := _kept_answers(kept, cases)) is not None:
        return answers, False
    with _asking(kept):
        if (answers := _kept_answers(kept, cases)) is not None:
            return answers, False  # another process answered while this one waited
        results = ask()
        code = kept.name.rsplit("-", 1)[0]
        for stale in kept.parent.glob(f"{code.rsplit('-', 1)[0]}-*"):  # older code's (other cases are kept)
            if stale.suffix in (".json", ".lock") and stale.name.rsplit("-", 1)[0] != code:
                stale.unlink(missing_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(results), encoding="utf-8")
        partial.replace(kept)
    return results, True


def _kept_answers(kept: Path, cases: list[dict]) -> list[dict] | None:
    """The answers kept at ``kept``, or None when there are none (or they are unreadable, cut short)."""
    try:
        answers = json.loads(kept.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return answers if isinstance(answers, list) and len(answers) == len(cases) else None


@contextlib.contextmanager
def _asking(kept: Path) -> Iterator[None]:
    """Hold the advisory lock of one answer file: the test processes of one run (pytest-xdist's
    workers) each start the same oracles ahead, and only one of them should ask the release."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    with open(kept.with_suffix(".lock"), "w") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
