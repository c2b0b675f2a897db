"""The arguments each vLLM release's `vllm serve` accepts, as data read from the release's own parser.

``engine/vllm_serve_args/<profile>.json`` lists, per argument, every spelling the parser accepts, its
``dest``, ``nargs``, kind (``store``, ``store_true``, ``bool`` for ``--x``/``--no-x`` pairs with the value
each spelling stores, ``append``...) and choices. Written by ``tests/conformance/serve_args_facts.py``,
which calls the release's ``ServeSubcommand().subparser_init``; a file states only what differs from the
release before it (``extends``, ``removed``). ``tests/conformance/test_serve_args.py`` checks 0.28's
and 0.34's engine arguments against the release on every run.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["FACTS_DIR", "action_key", "serve_actions"]

FACTS_DIR = Path(__file__).resolve().parent / "vllm_serve_args"


def action_key(action: dict[str, Any]) -> str:
    """One argument's stable name: its first spelling (``--dtype``), or its dest for a positional."""
    return action["options"][0] if action.get("options") else action["dest"]


@functools.cache
def serve_actions(profile: str) -> dict[str, dict[str, Any]]:
    """The serve parser of release profile ``profile`` (e.g. ``vllm-0.34``): key -> action facts.
    A `KeyError` when the profile has no facts (a development state such as ``issue-48412``)."""
    path = FACTS_DIR / f"{profile}.json"
    if not path.is_file():
        raise KeyError(profile)
    doc = json.loads(path.read_text(encoding="utf-8"))
    base = dict(serve_actions(doc["extends"])) if doc.get("extends") else {}
    for key in doc.get("removed", ()):
        base.pop(key, None)
    base.update(doc["actions"])
    return base
