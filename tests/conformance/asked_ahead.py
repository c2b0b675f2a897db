"""A test module's oracle answers for each release, asked ahead (ahead.py) and taken by its tests.

A module whose tests read one function of the release version (``answers(version)``: its `run_oracle`
calls, cached per machine) queues that function for each selected version in its ``start_ahead``; the
tests `take` the same call. On a cold cache the releases are then asked as many at a time as
``KVPOLICY_ORACLE_JOBS`` allows while the suite goes on (the plugin's oracles already were); on a warm
one the jobs only read the kept answers. A job installs its release first (``install_vllm.ensure``
locks per release, so it never races the `vllm_sites` fixture).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import ahead
import install_vllm

T = TypeVar("T")


def _installed_then(version: str, answers: Callable[[str], T]) -> T:
    install_vllm.ensure(version)
    return answers(version)


def queue(name: str, versions: Iterable[str], answers: Callable[[str], Any]) -> None:
    """Queue ``answers(version)`` for each of ``versions`` under ``name`` (the module's own)."""
    for version in versions:
        ahead.ahead((name, version), functools.partial(_installed_then, version, answers))


def take(name: str, version: str, answers: Callable[[str], T]) -> T:
    """``answers(version)``: the queued job's result (waiting for it), else run now."""
    return ahead.take((name, version), functools.partial(_installed_then, version, answers))
