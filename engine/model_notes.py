"""What reading a model config assumed, captured per deployment instead of leaking as Python warnings.

`kvpolicy.policy.hf_config` says each assumption (a float32 checkpoint served in bfloat16, ...) as a
`ModelConfigWarning`, a located ``file: warning[code]: ...`` line. A tool that decides many deployments
(a fleet, policy test cases, doctor) must tie each note to its deployment and print it as dry-run
does; left to Python, it is printed once (the default filter), as ``inputs.py:197: ModelConfigWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["model_config_notes"]


@contextmanager
def model_config_notes() -> Iterator[list[str]]:
    """Collect the `ModelConfigWarning`s raised in the block into the yielded list (their rendered lines,
    each once, in order, also when the block raises); any other warning is shown as Python would."""
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield notes
        finally:
            others = []
            for w in caught:
                if type(w.message).__name__ == "ModelConfigWarning":  # no import: hf_config may be absent
                    if str(w.message) not in notes:
                        notes.append(str(w.message))
                else:
                    others.append(w)
    for w in others:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
