"""Text rendering of a `Decision` for people; kept apart from the trace itself.

The decision is typed structurally (`Explainable`): the decision module
depends on this one, never the other way round.
"""

from __future__ import annotations

import textwrap
from typing import Any, Protocol

from kvpolicy.engine.counterfactual import describe
from kvpolicy.engine.trace import Counterfactual, Event, PreferenceApplied, RuleEvaluated, WaiverChecked, explain_filter
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import shown_file
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.spec import KVCacheGroups

__all__ = ["Explainable", "render_inputs", "render_text"]


class Explainable(Protocol):
    """What rendering reads of an `engine.Decision`."""

    context: Context
    layout: Layout
    score: int
    ruleset: Any

    @property
    def events(self) -> tuple[Event, ...]: ...
    @property
    def ranking(self) -> tuple[tuple[Layout, int], ...]: ...
    @property
    def eliminated(self) -> dict[Layout, list[tuple[Any, str]]]: ...
    @property
    def preferences(self) -> tuple[PreferenceApplied, ...]: ...
    @property
    def warnings(self) -> tuple[str, ...]: ...
    @property
    def notes(self) -> tuple[str, ...]: ...
    @property
    def counterfactuals(self) -> tuple[Counterfactual, ...]: ...
    @property
    def fingerprint(self) -> Any: ...


def _kinds_split(groups: KVCacheGroups) -> str:
    """Where vLLM splits a kind into several groups: which kinds, into how many (`KVCacheGroups.count`)."""
    if all(n == 1 for n in groups.vllm_splits):
        return ""
    parts = [f"{g.spec.kind.value} {g.spec.num_layers} layers -> {n}" for g, n in zip(groups.groups, groups.vllm_splits,
                                                                                      strict=True)]
    return " (vLLM's, each kind split into groups of equal size: " + ", ".join(parts) + ")"


def render_inputs(decision: Explainable) -> list[str]:
    ctx = decision.context
    kv, b, c = ctx.kv, ctx.backend, ctx.connector
    quant = kv.quant_mode.value
    lines = [
        f"  kv:        {kv.kind.value}, {kv.num_layers} layers, block {kv.block_size}, "
        f"{kv.num_kv_heads} KV heads x {kv.head_size}, {kv.dtype.value}",
        f"             kv_cache_dtype {kv.kv_cache_dtype} ({quant}): cell {kv.cell_bytes} B, "
        f"page {kv.page_size_bytes} B" + (f" ({kv.scale_bytes_per_page} B inline scales)"
                                          if kv.per_token_head else ""),
        f"  groups:    {ctx.groups.count} KV cache group(s), {ctx.groups.attention_groups} attention group(s)"
        + _kinds_split(ctx.groups)
        + (", Mamba present" if ctx.groups.has_mamba else "")
        + (", DCP-replicated: " + ", ".join(str(i) for i, g in enumerate(ctx.groups.groups) if not g.dcp_sharded)
           if any(not g.dcp_sharded for g in ctx.groups.groups) else ""),
        f"  backend:   {b.name} (scale views {b.scale_views.value}; indexes KV by block stride: "
        f"{'yes' if b.indexes_kv_by_block_stride else 'no'})",
    ]
    workers = ctx.worker_backends
    if workers is not None and workers != ((b.name,),):
        lines.append("  workers:   " + "; ".join(f"[{', '.join(w)}]" for w in workers)
                     + f" (candidates: {', '.join(str(x) for x in ctx.candidates) or 'none'})")
    if c is None:
        lines.append("  connector: none")
    else:
        lines.append(f"  connector: {_connector(c)}")
    o = ctx.options
    settings = [f"{k}={v}" for k, v in (("VLLM_KV_CACHE_LAYOUT", o.kv_cache_layout),
                                         ("enable_extensible_kv_cache", o.enable_extensible_kv_cache or None),
                                         ("hisparse", o.hisparse or None),
                                         ("device_capability", o.device_capability)) if v is not None]
    lines.append(f"  vllm:      profile {ctx.profile}" + (f"; {', '.join(settings)}" if settings else ""))
    return lines


def _connector(c: object) -> str:
    name = getattr(c, "name", "")
    extra = getattr(c, "extra", {})
    members = getattr(c, "connectors", ())
    text = name + (" " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())) if extra else "")
    prefers = getattr(c, "prefers_cross_layer_blocks", None)
    if prefers is not None:
        text += f" (prefer_cross_layer_blocks {str(prefers).lower()})"
    if members:
        text += " [" + "; ".join(_connector(m) for m in members) + "]"
    return text


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width=88, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False)


# what each `member_preferences` mode does with the members' scores (docs/rule-language.md, Ranking)
_MEMBER_MODES = {"all": "the smallest member score, so every member must prefer a layout",
                 "any": "the largest member score", "sum": "the members' scores added",
                 "agree": "the largest member score, and members whose best layouts differ are a conflict"}


def member_note(decision: Explainable) -> str:
    """How the composite connector's members' weights combine, as its connector file says."""
    conn = decision.context.connector
    name = getattr(conn, "name", "the composite")
    mode = decision.ruleset.combine_mode(name).value
    return f"member connectors' weights combine by `{name}`'s `member_preferences: {mode}`: {_MEMBER_MODES[mode]}"


def render_text(decision: Explainable, mode: str = "full") -> str:
    """``full``: everything; ``fails``: removals and counterfactuals; ``notes``: what decided."""
    events = explain_filter(decision.events, mode)  # type: ignore[arg-type]
    lay = decision.layout
    out = [f"layout: {lay} ({lay.placement.value}, {lay.head_order.value})", "", "inputs:",
           *render_inputs(decision), ""]

    out.append("ranking (survivors, best first):")
    # a tie goes to the rule set's `defaults.layout_order` when it declares one, else to the candidates' order
    tie = ("  (tie: rule set's default order)" if getattr(decision.ruleset, "order_declared", False)
           else "  (tie: the release's preference order)")
    for rank, (layout, score) in enumerate(decision.ranking, 1):
        note = "  <- chosen" if rank == 1 else (tie if score == decision.score else "")
        out.append(f"  {rank}. {layout!s:<16} score {score}{note}")
    out.append("")

    warnings = decision.warnings
    if warnings:
        out.append("warnings:")
        for text in warnings:
            out += _wrap(text, "  ")
        out.append("")

    notes = getattr(decision, "notes", ())
    if notes and mode == "full":  # the shipped rules' own dropped preferences: no warning, said here
        out.append("notes:")
        for text in notes:
            out += _wrap(text, "  ")
        out.append("")

    eliminated = decision.eliminated
    if eliminated:
        out.append("eliminated:")
        for layout, hits in eliminated.items():
            out.append(f"  {layout}")
            for rule, scope in hits:
                out.append(f"    by {rule.id} ({rule.effect}, {scope}) at {rule.source}")
                out += _wrap(rule.description, "       ")
                if rule.reference:
                    out.append(f"       see {rule.reference}")
        out.append("")

    waived = [e for e in events if isinstance(e, WaiverChecked) and e.applied]
    if waived:  # in every mode: a rule that did not act is part of why this layout won
        out.append("waived:")
        for e in waived:
            out += _wrap(e.text(), "  ")
        out.append("")

    if mode != "fails" and decision.preferences:
        out.append("preferences:")
        for p in decision.preferences:
            out.append(f"  +{p.weight} {p.layout!s:<16} {p.rule.id} ({p.scope}) at {p.rule.source}")
        if any("/" in p.scope for p in decision.preferences):
            out += _wrap(f"({member_note(decision)}; the ranking shows the combined scores)", "  ")
        out.append("")

    if mode in ("full", "fails"):
        out.append("counterfactual:")
        for cf in decision.counterfactuals:
            out.append(f"  {describe(cf)}")
        out.append("")

    rules = [e for e in events if isinstance(e, RuleEvaluated)]
    if rules:
        out.append("rules:" if mode == "full" else "matched rules:")
        for e in rules:
            mark = "x" if e.matched else " "
            waiver = next((w.waiver for w in waived if w.rule.id == e.rule.id and w.scope == e.scope), None)
            out.append(f"  [{mark}] {e.rule.id} ({e.rule.effect}, {e.scope}) at {e.rule.source}"
                       + (f" (waived at {waiver.source})" if waiver is not None else ""))
            for leaf in e.leaves:
                out.append(f"        {leaf.describe()}")
        out.append("")
    out.append(f"layout fingerprint: {decision.fingerprint.digest[:23]}... (what ranks and peers must agree on)")
    out.append(f"rule set: {shown_file(decision.ruleset.root)} ({decision.ruleset.digest[:23]}...)")
    return "\n".join(out)
