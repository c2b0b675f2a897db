"""Oracle subprocesses started ahead of the tests that read their answers.

A test that asks an oracle waits on one subprocess while the machine's other cores idle, and the
plugin's oracles are never kept between runs (their answers depend on this checkout), so on a warm
cache they are most of the suite's time. At the end of collection (conftest.py) each selected module
that defines ``start_ahead(items)`` queues the oracle runs its selected tests will read, then `start`
hands them to a pool of `workers()` threads, which runs them while the suite goes on; the fixture takes
the answer with `take` (running the job itself if it was never queued or is still waiting for a thread).
The same subprocess, the same cases: only earlier. Under pytest -n every worker queues the same jobs;
each starts at its own part of the queue, and an answer is asked once (answer_cache.py).

``KVPOLICY_ORACLE_JOBS`` sets the number of oracles run at once (0: none ahead, each when its test
asks). Every subprocess goes through `run`, so `stop` can end the ones still running when the
session ends early (``-x``, Ctrl-C).
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_MAX_DEFAULT = 4  # a vLLM oracle holds 1-2 GB; more at once gains little on the machines CI uses


class AheadError(RuntimeError):
    """KVPOLICY_ORACLE_JOBS is not a whole number of jobs."""


def workers() -> int:
    """How many oracle subprocesses run at once: ``KVPOLICY_ORACLE_JOBS``, else the cores (at most 4)
    shared among the test processes (pytest-xdist's workers: ``PYTEST_XDIST_WORKER_COUNT``)."""
    raw = os.environ.get("KVPOLICY_ORACLE_JOBS")
    if raw is None or not raw.strip():
        processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
        return max(1, min(os.cpu_count() or 1, _MAX_DEFAULT) // max(1, processes))
    try:
        value = int(raw)
    except ValueError:
        raise AheadError(f"KVPOLICY_ORACLE_JOBS={raw!r}: expected a whole number of jobs (0: none ahead)") from None
    if value < 0:
        raise AheadError(f"KVPOLICY_ORACLE_JOBS={raw!r}: expected 0 or more")
    return value


def share() -> tuple[int, int]:
    """(this test process's index, how many there are): pytest-xdist's worker ``gwN`` of
    ``PYTEST_XDIST_WORKER_COUNT``; (0, 1) without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw") or 0), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)


def rotated(items: list[T], process: int, processes: int) -> list[T]:
    """``items`` begun at the ``process``-th of ``processes`` equal parts (and wrapped round): processes
    working through the same list each start at their own part instead of waiting on each other in turn."""
    first = len(items) * process // max(1, processes)
    return items[first:] + items[:first]


def params(items: list[Any], name: str) -> list[Any]:
    """The values of the parametrized fixture or argument ``name`` among ``items``, in test order."""
    seen: list[Any] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and name in callspec.params and callspec.params[name] not in seen:
            seen.append(callspec.params[name])
    return seen


class Ahead:
    """A pool of background jobs keyed by what they compute, and the subprocesses they run."""

    def __init__(self, jobs: int | None = None) -> None:
        self._jobs = jobs
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._queued: dict[Hashable, Future[Any]] = {}
        self._pending: dict[Hashable, Callable[[], Any]] = {}
        self._running: set[subprocess.Popen[str]] = set()
        self._stopped = False

    def ahead(self, key: Hashable, job: Callable[[], T]) -> None:
        """Queue ``job`` to run in the background once `start` is called; `take` with the same key returns
        its result."""
        jobs = workers() if self._jobs is None else self._jobs
        with self._lock:
            if self._stopped or key in self._queued or key in self._pending or jobs == 0:
                return
            self._pending[key] = job

    def start(self, process: int = 0, processes: int = 1) -> None:
        """Run the queued jobs in the background, in the order queued, begun at the ``process``-th of
        ``processes`` equal parts: test processes sharing one cache (pytest-xdist's workers) queue the same
        jobs, and starting each at its own part keeps them from waiting on each other's answer in turn."""
        jobs = workers() if self._jobs is None else self._jobs
        with self._lock:
            pending = list(self._pending.items())
            self._pending.clear()
            if self._stopped or not pending or jobs == 0:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="oracle-ahead")
            for key, job in rotated(pending, process, processes):
                self._queued[key] = self._pool.submit(job)

    def take(self, key: Hashable, job: Callable[[], T]) -> T:
        """The result of the job queued under ``key``: waited for once it runs; a job still waiting for a
        free worker is taken off the queue and run now, in the caller's thread (the test waits either way).
        Else ``job`` run now."""
        with self._lock:
            future = self._queued.pop(key, None)
            self._pending.pop(key, None)
        if future is not None and not future.cancel():
            try:
                return future.result()
            except CancelledError:
                pass
        return job()

    def run(self, cmd: list[str], *, input: str, env: dict[str, str] | None, timeout: float,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """`subprocess.run` (text, output captured) whose process `stop` can end."""
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=cwd)
        with self._lock:
            self._running.add(proc)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            with self._lock:
                self._running.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def stop(self) -> None:
        """Cancel the queued jobs and kill the subprocesses still running (the session is over)."""
        with self._lock:
            self._stopped = True
            for future in self._queued.values():
                future.cancel()
            self._queued.clear()
            self._pending.clear()
            running = list(self._running)
            pool, self._pool = self._pool, None
        for proc in running:
            proc.kill()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


SESSION = Ahead()  # the test session's (conftest.py stops it when the session ends)
ahead = SESSION.ahead
start = SESSION.start
take = SESSION.take
run = SESSION.run
stop = SESSION.stop
