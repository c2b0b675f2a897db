"""The CLI in-process, as the tests in this directory call it: exit code, stdout, stderr."""

from __future__ import annotations

import pytest

from kvpolicy.engine.cli.main import main


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
