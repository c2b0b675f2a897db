"""Oracles run ahead (ahead.py): the answer a test takes is the job's own, whether it ran ahead or not,
once; its failure is the test's; KVPOLICY_ORACLE_JOBS is read strictly; the session's end kills what
still runs. And the answers run_oracle keeps per machine are found again, per case set."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import ahead
import pytest
import vllm_release


def test_a_queued_job_runs_once_and_its_answer_is_taken() -> None:
    pool, calls, ran = ahead.Ahead(jobs=2), [], threading.Event()
    pool.ahead("k", lambda: calls.append("ahead") or ran.set() or 41)
    pool.ahead("k", lambda: calls.append("again") or 0)  # the same key is queued once
    assert not ran.wait(0.2)  # queued: nothing runs before `start`
    pool.start()
    assert ran.wait(30)
    assert pool.take("k", lambda: calls.append("inline") or 0) == 41
    assert calls == ["ahead"]
    assert pool.take("k", lambda: calls.append("inline") or 7) == 7  # taken: the next take runs it itself


def test_a_job_still_waiting_for_a_worker_is_run_by_its_taker() -> None:
    """The test would wait either way: it runs the job now rather than behind the queue."""
    pool, release = ahead.Ahead(jobs=1), threading.Event()
    pool.ahead("busy", lambda: release.wait(60) and "busy")
    pool.ahead("waiting", lambda: "ahead")
    pool.start()
    assert pool.take("waiting", lambda: "inline") == "inline"
    release.set()
    assert pool.take("busy", lambda: "inline") == "busy"


@pytest.mark.parametrize(("process", "order"), [(0, "abcd"), (1, "cdab"), (2, "abcd")])
def test_each_test_process_starts_at_its_own_part_of_the_queue(process: int, order: str) -> None:
    """pytest -n: every worker queues the same oracles; started at different parts, they rarely wait on
    one answer (the first asks it, the other reads what it kept) and so run two oracles at once."""
    pool, ran = ahead.Ahead(jobs=1), []
    for key in "abcd":
        pool.ahead(key, lambda key=key: ran.append(key))
    pool.start(process % 2, 2)
    deadline = time.monotonic() + 30
    while len(ran) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "".join(ran) == order
    for key in "abcd":
        pool.take(key, lambda: pytest.fail("ran again by its taker"))


@pytest.mark.parametrize(("worker", "count", "expected"), [(None, None, (0, 1)), ("gw0", "2", (0, 2)),
                                                          ("gw1", "2", (1, 2)), ("gw3", "4", (3, 4))])
def test_the_release_installs_begin_at_each_processs_own_part(worker: str | None, count: str | None,
                                                              expected: tuple[int, int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On an empty cache each test process installs the releases (conftest.vllm_sites) from its own part of
    the list: two processes install two releases at once instead of taking turns at the same one."""
    for name, value in (("PYTEST_XDIST_WORKER", worker), ("PYTEST_XDIST_WORKER_COUNT", count)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert ahead.share() == expected
    releases = [f"0.{n}.0" for n in range(24, 35)]
    order = ahead.rotated(releases, *ahead.share())
    assert sorted(order) == sorted(releases) and order[0] == releases[len(releases) * expected[0] // expected[1]]


def test_a_job_never_queued_runs_when_taken_and_none_runs_with_zero_jobs() -> None:
    pool, calls = ahead.Ahead(jobs=0), []
    pool.ahead("k", lambda: calls.append("ahead"))
    assert pool.take("k", lambda: calls.append("inline") or 3) == 3
    assert calls == ["inline"]


def test_a_queued_jobs_failure_is_raised_where_it_is_taken() -> None:
    pool = ahead.Ahead(jobs=1)

    def broken() -> None:
        raise vllm_release.OracleError("oracle v028 under vLLM 0.28.0 exited 1")

    pool.ahead("k", broken)
    pool.start()
    with pytest.raises(vllm_release.OracleError, match="exited 1"):
        pool.take("k", lambda: None)


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("3", 3), (" 2 ", 2), ("", None)])
def test_the_number_of_jobs_comes_from_the_variable(raw: str, expected: int | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_ORACLE_JOBS", raw)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    if expected is None:  # unset: the cores, at most 4
        assert ahead.workers() == max(1, min(os.cpu_count() or 1, 4))
    else:
        assert ahead.workers() == expected


@pytest.mark.parametrize(("cores", "processes", "expected"), [(2, "2", 1), (8, "2", 2), (16, "3", 1), (1, "4", 1),
                                                             (8, "", 4)])
def test_the_default_jobs_are_shared_among_the_test_processes(cores: int, processes: str, expected: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest -n: each worker starts the oracles ahead, so the default (the cores, at most 4) is shared
    among them, at least one each."""
    monkeypatch.delenv("KVPOLICY_ORACLE_JOBS", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", processes)
    monkeypatch.setattr(ahead.os, "cpu_count", lambda: cores)
    assert ahead.workers() == expected


@pytest.mark.parametrize("raw", ["two", "-1", "1.5"])
def test_a_number_of_jobs_that_is_not_one_is_named(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_ORACLE_JOBS", raw)
    with pytest.raises(ahead.AheadError, match=rf"KVPOLICY_ORACLE_JOBS='{raw}'"):
        ahead.workers()


def test_stop_kills_the_oracles_still_running_and_cancels_the_queued() -> None:
    pool = ahead.Ahead(jobs=1)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    pool.ahead("running", lambda: pool.run(sleeper, input="", env=None, timeout=300))
    pool.ahead("queued", lambda: pool.run(sleeper, input="", env=None, timeout=300))
    pool.start()
    deadline = time.monotonic() + 30
    while not pool._running and time.monotonic() < deadline:
        time.sleep(0.05)
    begin = time.monotonic()
    pool.stop()
    done = threading.Event()
    result: list[object] = []
    threading.Thread(target=lambda: (result.append(pool.take("running", lambda: "inline")), done.set())).start()
    assert done.wait(30) and time.monotonic() - begin < 30
    assert result[0] == "inline" or result[0].returncode != 0  # killed, or cancelled before it ran
    assert pool.take("queued", lambda: "inline") == "inline"  # never ran: the taker runs it
    pool.ahead("late", lambda: "x")  # a stopped pool queues nothing more
    assert pool.take("late", lambda: "inline") == "inline"


def test_run_oracle_keeps_answers_per_case_set_and_asks_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answers kept for one case set survive asking the same oracle other cases (a second cache of the
    v028 oracle once deleted these, and had its own deleted, so both were asked on every run)."""
    cache, oracles, log = tmp_path / "cache", tmp_path / "oracles", tmp_path / "asked"
    site = cache / "9.9.9" / "site"
    site.mkdir(parents=True)
    (cache / "9.9.9" / "COMPLETE").write_text("vllm==9.9.9\n")
    oracles.mkdir()
    (oracles / "echo.py").write_text(
        "import json, sys\ncases = json.load(sys.stdin)\n"
        f"open({str(log)!r}, 'a').write(json.dumps(cases) + '\\n')\n"
        "print(json.dumps([{'echo': c} for c in cases]))\n")
    monkeypatch.setenv("KVPOLICY_VLLM_CACHE", str(cache))
    monkeypatch.delenv("KVPOLICY_ORACLE_CACHE", raising=False)
    monkeypatch.setattr(vllm_release, "ORACLES", oracles)
    first, second = [{"n": 1}], [{"n": 2}, {"n": 3}]
    for _ in range(2):
        assert vllm_release.run_oracle("9.9.9", "echo", first) == [{"echo": {"n": 1}}]
        assert vllm_release.run_oracle("9.9.9", "echo", second) == [{"echo": c} for c in second]
    assert [json.loads(line) for line in log.read_text().splitlines()] == [first, second]
    (oracles / "other.py").write_text("# another oracle, new or edited: echo's answers stay\n")
    vllm_release.run_oracle("9.9.9", "echo", first)
    assert len(log.read_text().splitlines()) == 2
    (oracles / "echo.py").write_text((oracles / "echo.py").read_text() + "import helper\n")
    (oracles / "helper.py").write_text("")
    vllm_release.run_oracle("9.9.9", "echo", first)  # echo's own code changed: asked again
    (oracles / "helper.py").write_text("# a module echo imports changed\n")
    vllm_release.run_oracle("9.9.9", "echo", first)  # the oracle's code changed: asked again, old answers gone
    assert len(log.read_text().splitlines()) == 4
    kept = sorted(p.name.rsplit("-", 1)[0] for p in (cache / "9.9.9" / "answers").glob("*.json"))
    assert len(kept) == 1
