"""`LayoutEngine`: the library's entry point for a serving engine at start-up.

    from kvpolicy.engine import LayoutEngine
    engine = LayoutEngine.default()
    decision = engine.decide(model="config.json", kv_cache_dtype="fp8_per_token_head",
                             backend="TRITON_ATTN", connector="OffloadingConnector")
    decision.layout.placement          # Placement.per_layer
    print(decision.explain())

Deciding never imports torch; `build` does, lazily.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from kvpolicy.engine.connector_names import out_of_tree_names
from kvpolicy.engine.decide import evaluate, no_layout_error, scopes_for
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.inputs import context_from_inputs
from kvpolicy.engine.plan import LayoutPlan, plan_layout
from kvpolicy.engine.rule_layers import load_layers, rule_dirs, shipped_rules_dir
from kvpolicy.engine.verify import check_plan

if TYPE_CHECKING:
    from kvpolicy.engine.runtime import KVCache
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import Diagnostic, RuleLoadError, input_error
from kvpolicy.policy.layers import render_warning
from kvpolicy.policy.load import Limits, load_rules_from_texts
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["LayoutEngine", "fallback_ruleset", "shipped_rules_dir"]

logger = logging.getLogger("kvpolicy")


FALLBACK_RULES = """\
version: 1
rules:
  - id: kvpolicy-fallback-per-layer
    description: >-
      the configured rules failed to load and the engine was asked to fall back
      instead of failing: only the per-layer layout, which is safe for every
      backend and quantization mode, is allowed
    forbid: {placement: cross_layer}
"""


class LayoutEngine:
    """Decides KV cache layouts with one immutable `RuleSet` at a time.

    Thread-safe: `decide` reads the active rule set once, so a concurrent
    `reload` is seen entirely or not at all by each decision.
    """

    _SCOPE_CACHE_SIZE = 1024

    def __init__(self, ruleset: RuleSet, *,
                 source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
                 limits: Limits = Limits(), load_error: RuleLoadError | None = None,
                 vllm_version: str | ReleaseProfile | None = None, shipped_rules: bool = True) -> None:
        self.profile: ReleaseProfile = get_profile(vllm_version)
        self._ruleset = ruleset
        # the operator's directories reload() reads again, on top of the shipped rules unless
        # shipped_rules is False; None: a rule set given directly, nothing to reload
        self._source: tuple[Path, ...] | None = None if source is None else tuple(rule_dirs(source))
        self._shipped_rules = shipped_rules
        self._limits = limits
        self.load_error = load_error
        # id(context) -> (context, rule set, scopes): contexts are immutable, so the scope
        # tree built for one (envs bound per connector member) is reused on the next decide.
        self._scopes: dict[int, tuple[Context, RuleSet, Any]] = {}

    def _scopes_for(self, ruleset: RuleSet, ctx: Context) -> Any:
        hit = self._scopes.get(id(ctx))
        if hit is not None and hit[0] is ctx and hit[1] is ruleset:
            return hit[2]
        scopes = scopes_for(ruleset, ctx)
        if len(self._scopes) >= self._SCOPE_CACHE_SIZE:
            self._scopes.clear()
        self._scopes[id(ctx)] = (ctx, ruleset, scopes)
        return scopes

    @property
    def ruleset(self) -> RuleSet:
        """The active rule set."""
        return self._ruleset

    @property
    def is_fallback(self) -> bool:
        """True when the configured rules failed to load and the per-layer fallback is active."""
        return self.load_error is not None

    @classmethod
    def default(cls, vllm_version: str | ReleaseProfile | None = None) -> LayoutEngine:
        """The shipped rules of a vLLM release profile, which reproduce that release's decision.

        ``vllm_version``: a profile name (``vllm-0.34``) or a version (``0.34.0``); by
        default the installed vLLM's profile, else the newest shipped release.
        """
        profile = get_profile(vllm_version)
        return cls(load_layers(vllm_version=profile), source=(), vllm_version=profile)

    @classmethod
    def from_path(cls, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                  shipped_rules: bool = True, limits: Limits = Limits(),
                  on_error: Literal["raise", "fallback"] = "raise",
                  vllm_version: str | ReleaseProfile | None = None) -> LayoutEngine:
        """An operator's rule directories (one path, or several: bottom first), layered on the
        shipped rules of the release profile (`kvpolicy.policy.layers` says how layers combine).

        ``shipped_rules=False`` replaces the shipped rules instead; each load-bearing shipped guard
        that goes is a warning on logger ``kvpolicy`` (and in ``ruleset.warnings``).
        Fail-closed by default: any problem raises `RuleLoadError` listing every
        one. ``on_error="fallback"`` instead logs the errors (logger ``kvpolicy``)
        and returns an engine that allows only the per-layer layout, with the
        error kept in ``load_error``, so a serving engine can still start.
        """
        from kvpolicy.engine.analysis.guards import load_checked  # the analysis only when rules are read

        profile = get_profile(vllm_version)
        dirs = tuple(rule_dirs(path))
        try:
            ruleset = load_checked(dirs, vllm_version=profile, shipped_rules=shipped_rules, limits=limits,
                                   where="shipped_rules")
        except RuleLoadError as exc:
            if on_error != "fallback":
                raise
            logger.error("kvpolicy: rules in %s failed to load; falling back to per_layer only\n%s",
                         ", ".join(map(str, dirs)), exc.render())
            return cls(fallback_ruleset(), source=dirs, limits=limits, load_error=exc, vllm_version=profile,
                       shipped_rules=shipped_rules)
        _log_warnings(ruleset)
        return cls(ruleset, source=dirs, limits=limits, vllm_version=profile, shipped_rules=shipped_rules)

    def reload(self, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None
               ) -> RuleLoadError | None:
        """Load the rules again (the operator's directories ``path``, else the original ones, layered
        as before) and swap them in.

        The new set replaces the active one only if it loads completely;
        otherwise the active set stays and the error is returned (never raised).
        Returns None on success.
        """
        from kvpolicy.engine.analysis.guards import load_checked

        source = tuple(rule_dirs(path)) if path is not None else self._source
        if source is None:
            return RuleLoadError("", [Diagnostic("<engine>", 0, 0, "no-source", "this engine has no rules directory",
                                                 "pass the directory to reload(path)")])
        try:
            ruleset = load_checked(source, vllm_version=self.profile, shipped_rules=self._shipped_rules,
                                   limits=self._limits, where="shipped_rules")
        except RuleLoadError as exc:
            logger.warning("kvpolicy: reload of %s failed; keeping the active rules\n%s",
                           ", ".join(map(str, source)) or "the shipped rules", exc.render())
            return exc
        _log_warnings(ruleset)
        # INVARIANT: one reference assignment; a decide() in flight keeps the set it read.
        self._ruleset = ruleset
        self._source = source
        self.load_error = None
        return None

    def context(self, **inputs: Any) -> Context:
        """The validated `Context` for ``decide``'s keyword inputs, in this engine's release profile."""
        return context_from_inputs(self._with_profile(inputs))

    def _with_profile(self, inputs: dict[str, Any]) -> dict[str, Any]:
        asked = inputs.get("vllm_version")
        if asked is not None and get_profile(asked) is not self.profile:
            raise input_error("vllm_version", f"this engine decides for profile `{self.profile.name}`, not "
                              f"`{get_profile(asked).name}`",
                              "make an engine for that release: LayoutEngine.default(vllm_version=...)",
                              code="profile-mismatch")
        return {**inputs, "vllm_version": self.profile}

    def _context(self, context: Context | None, inputs: dict[str, Any]) -> Context:
        if context is None:
            return context_from_inputs(self._with_profile(inputs))
        if not isinstance(context, Context):
            raise input_error("context", f"`context` must be a Context, got {type(context).__name__}",
                              "pass keyword inputs instead, or build one with engine.context(...)")
        if inputs:
            raise input_error(next(iter(inputs)), "give a `context` or keyword inputs, not both",
                              "a Context already holds every input")
        if context.profile != self.profile.name:  # its candidates and backend facts are another release's
            raise input_error("context", f"the context was built for profile `{context.profile}`, this engine "
                              f"decides for `{self.profile.name}`", "build it with this engine's "
                              "engine.context(...), or decide with an engine of that release",
                              code="profile-mismatch")
        return context

    def decide(self, context: Context | None = None, *, explain: bool = True, **inputs: Any) -> Decision:
        """Choose a layout for ``context`` (or for keyword inputs, as `kvpolicy dry-run`'s flags).

        ``explain=True`` records the trace as it decides; ``explain=False`` runs
        the fast path and computes the trace only if it is asked for. The
        counterfactuals (a search) are computed on first access either way.
        Raises `NoLayoutError` when nothing survives.
        """
        ruleset = self._ruleset  # read once: a concurrent reload() is all-or-nothing for us
        ctx = self._context(context, inputs)
        glob, conn = self._scopes_for(ruleset, ctx)
        outcome = evaluate(ruleset, glob, conn, explain=explain)
        if outcome.winner is None:
            events = outcome.events or evaluate(ruleset, glob, conn, explain=True).events
            raise no_layout_error(ruleset, events)
        # a connector loaded by kv_connector_module_path (in kv_transfer_config) is the caller's own: no misspelling
        declared = out_of_tree_names(SimpleNamespace(**inputs)) if inputs else set()
        return Decision(ruleset, ctx, outcome).declaring(declared)


    def plan(self, *, num_blocks: int, context: Context | None = None, **inputs: Any) -> LayoutPlan:
        """Decide, then plan the chosen layout's geometry (pure arithmetic, no torch)."""
        decision = self.decide(context, explain=False, **inputs)
        return plan_layout(decision.layout, decision.context.kv, decision.context.backend, num_blocks)

    def build(self, *, num_blocks: int, device: str = "cpu", context: Context | None = None,
              **inputs: Any) -> KVCache:
        """Decide, plan, verify and allocate: the one call from inputs to a `KVCache`.

        Takes ``decide``'s keyword inputs. The plan is checked by the geometry
        verifier before any memory is touched: a layout whose views overlap is
        refused with `GeometryError`, whatever the rules said (the rules state
        intent; the verifier enforces the bytes). The cache carries
        ``.decision`` and ``.plan``. Plans the first attention group's spec.
        """
        decision = self.decide(context, explain=False, **inputs)
        plan = plan_layout(decision.layout, decision.context.kv, decision.context.backend, num_blocks)
        check_plan(plan)
        from kvpolicy.engine.runtime import allocate  # torch, lazily

        try:
            cache = allocate(plan, device)
        except (RuntimeError, MemoryError) as exc:  # the device's allocator said no
            raise input_error("num_blocks", f"cannot allocate {plan.total_bytes} bytes for {num_blocks} blocks on "
                              f"`{device}`: {str(exc).splitlines()[0]}", "plan fewer blocks",
                              code="out-of-memory") from None
        cache.decision = decision
        return cache


def _log_warnings(ruleset: RuleSet) -> None:
    for diag in ruleset.warnings:
        logger.warning("kvpolicy: %s", render_warning(diag))


def fallback_ruleset() -> RuleSet:
    """The safe default used when configured rules fail to load: per_layer only."""
    return load_rules_from_texts({"<fallback>.yaml": FALLBACK_RULES})
