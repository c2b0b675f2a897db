"""The ``kvpolicy`` command line: dry-run, validate, test, schema (docs/cli.md).

``main`` is imported lazily so that ``python -m kvpolicy.engine.cli.main`` does not
find the module already imported by its package.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvpolicy`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    from kvpolicy.engine.cli.main import main as _main

    return _main(argv)
