"""`LayoutEngine`: the library's entry point for a serving engine at start-up.

    from engine import LayoutEngine
    engine = LayoutEngine.default()
    decision = engine.decide(model="config.json", kv_cache_dtype="fp8_per_token_head",
                             backend="TRITON_ATTN", connector="OffloadingConnector")
    decision.layout.placement          # Placement.per_layer
    print(decision.explain())

Deciding never imports torch; `build` does, lazily.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from engine.decide import evaluate, no_layout_error, scopes_for
from engine.decision import Decision
from engine.inputs import build_context
from policy.context import Context
from policy.load import Limits, load_rules
from policy.ruleset import RuleSet

__all__ = ["LayoutEngine", "shipped_rules_dir"]


def shipped_rules_dir() -> Path:
    """The shipped ``rules/`` directory: beside the source tree, or the installed package data."""
    here = Path(__file__).resolve().parent.parent / "rules"
    if (here / "global.yaml").is_file():
        return here
    return Path(str(resources.files("kvpolicy_rules")))


class LayoutEngine:
    """Decides KV cache layouts with one immutable `RuleSet`."""

    _SCOPE_CACHE_SIZE = 1024

    def __init__(self, ruleset: RuleSet) -> None:
        self._ruleset = ruleset
        # id(context) -> (context, scopes): contexts are immutable, so the scope tree
        # built for one (envs bound per connector member) is reused on the next decide.
        self._scopes: dict[int, tuple[Context, Any]] = {}

    def _scopes_for(self, ctx: Context) -> Any:
        hit = self._scopes.get(id(ctx))
        if hit is not None and hit[0] is ctx:
            return hit[1]
        scopes = scopes_for(self._ruleset, ctx)
        if len(self._scopes) >= self._SCOPE_CACHE_SIZE:
            self._scopes.clear()
        self._scopes[id(ctx)] = (ctx, scopes)
        return scopes

    @property
    def ruleset(self) -> RuleSet:
        return self._ruleset

    @classmethod
    def default(cls) -> LayoutEngine:
        """The shipped rules (``rules/``), which reproduce vLLM's gate."""
        return cls(load_rules(shipped_rules_dir(), display="rules"))

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], *, limits: Limits = Limits()) -> LayoutEngine:
        """An operator's rule directory; raises `RuleLoadError` with every problem."""
        return cls(load_rules(path, limits=limits))

    def context(self, **inputs: Any) -> Context:
        """The validated `Context` for ``decide``'s keyword inputs."""
        return build_context(**inputs)

    def decide(self, context: Context | None = None, *, explain: bool = True, **inputs: Any) -> Decision:
        """Choose a layout for ``context`` (or for keyword inputs, as `kvpolicy dry-run`'s flags).

        ``explain=True`` records the trace as it decides; ``explain=False`` runs
        the fast path and computes the trace only if it is asked for. The
        counterfactuals (a search) are computed on first access either way.
        Raises `NoLayoutError` when nothing survives.
        """
        ctx = context if context is not None else build_context(**inputs)
        glob, conn = self._scopes_for(ctx)
        outcome = evaluate(self._ruleset, glob, conn, explain=explain)
        if outcome.winner is None:
            events = outcome.events or evaluate(self._ruleset, glob, conn, explain=True).events
            raise no_layout_error(self._ruleset, events)
        return Decision(self._ruleset, ctx, outcome)
