# ruff: noqa  (hostile-pass scripts, not product code)
"""Shared helpers for the hostile pass (issue 23): PASS/BROKE lines and a per-class summary."""
from __future__ import annotations

import sys
from collections import Counter

_tally: Counter = Counter()
_broke: list[str] = []


def report(case: str, ok: bool, reason: str, repro: str = "") -> None:
    _tally["tried"] += 1
    _tally["held" if ok else "broke"] += 1
    print(f"{'PASS' if ok else 'BROKE'} {case}: {reason}", flush=True)
    if not ok:
        _broke.append(f"{case}: {reason}" + (f"\n    repro: {repro}" if repro else ""))


def summary(cls: str) -> None:
    print(f"\n== class {cls}: tried {_tally['tried']} / held {_tally['held']} / broke {_tally['broke']}")
    for b in _broke:
        print("  BROKE", b)
    sys.stdout.flush()
