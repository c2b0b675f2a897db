"""The decision procedure (docs/rule-language.md, "Decision semantics"); pure Python, no torch.

1. Candidates: the layouts the release profile has and every attention
   backend supports (``Context.candidates``), most preferred first; the
   others are removed up front by the built-in ``release-candidates`` entry,
   and any the planned backend has no geometry for by ``backend-geometry``.
2. Active scopes: global, the configured connector, and recursively each
   member of a composite connector, whose ``connector.*`` fields bind to it.
3. A matched ``forbid`` removes what its pattern matches; a matched
   ``require`` removes what it does not. Removal is final: nothing restores.
4. Survivors rank by summed ``prefer`` weights: global + the connector's
   score, where a connector's score is its own prefers plus its members'
   scores combined by its ``member_preferences`` (``all`` = min).
   Ties go to the candidates' preference order (vLLM's: the backends' merged
   ``supported_kv_cache_layouts``, else the release's default preference).
5. No survivor raises `NoLayoutError` naming every rule that removed one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvpolicy.engine.trace import (
    CandidateRemoved,
    Event,
    LayoutChosen,
    PreferenceApplied,
    RuleEvaluated,
    RuleRef,
    WaiverChecked,
    WaiverRef,
)
from kvpolicy.policy.conditions import LeafResult
from kvpolicy.policy.connectors import ConnectorConfig
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import Diagnostic, NoLayoutError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile, profile_names
from kvpolicy.policy.rule_model import MemberPreferences
from kvpolicy.policy.ruleset import FORBID, PREFER, REQUIRE, CompiledRule, RuleSet, Source

__all__ = [
    "BACKEND_GEOMETRY",
    "RELEASE_CANDIDATES",
    "Outcome",
    "Scope",
    "connector_names_for",
    "connector_rules_for",
    "evaluate",
    "geometry_ref",
    "rule_ref",
    "scopes_for",
    "unknown_connector_warnings",
]

# The id under which the built-in candidate filter (step 1) appears in traces, errors and policy tests.
RELEASE_CANDIDATES = "release-candidates"
# The id under which a candidate the planned backend has no geometry for is removed (step 1 too): a
# Context built by hand may list one, and a winner must always be plannable.
BACKEND_GEOMETRY = "backend-geometry"



@dataclass
class Scope:
    """Rules evaluated against one binding of ``connector.*`` (global: the top one)."""

    label: str
    rules: tuple[CompiledRule, ...]
    env: dict[str, Any]
    members: tuple[Scope, ...] = ()
    mode: MemberPreferences = MemberPreferences.all
    candidates: tuple[Layout, ...] | None = None  # global scope only: Context.candidates
    release: RuleRef | None = None  # global scope only: what stands for the built-in candidate filter
    geometry: RuleRef | None = None  # global scope only: what removed the candidates `no_geometry` lists
    no_geometry: tuple[Layout, ...] = ()  # global scope only: candidates the backend cannot plan

    def walk(self) -> list[Scope]:
        out = [self]
        for m in self.members:
            out += m.walk()
        return out

    def with_env(self, overrides: dict[str, dict[str, Any]]) -> Scope:
        """A copy whose envs have ``overrides[label][field] = value`` applied."""
        env = self.env
        if "*" in overrides:
            env = {**env, **overrides["*"]}
        if self.label in overrides:
            env = {**env, **overrides[self.label]}
        members = tuple(m.with_env(overrides) for m in self.members)
        return Scope(self.label, self.rules, env, members, self.mode, self.candidates, self.release,
                     self.geometry, self.no_geometry)


def connector_names_for(profile: str, name: str, extra: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The connector files whose rules apply to a connector configured as ``name`` with ``extra`` (its
    ``kv_connector_extra_config``), in every layer: the class the release loads for that configuration
    (vLLM 0.28's ``NixlConnector`` is ``NixlPullConnector``; 0.34's is ``NixlPushConnector`` with
    ``transfer_mode: push``: `ReleaseProfile.connector_class`), then the name itself.

    Both always: a file for the name a deployment configures (an operator's ``NixlConnector.yaml``)
    adds to the rules of the class vLLM runs, never hides them; otherwise an upper layer could lift a
    lower layer's forbid by naming the connector by its alias.
    """
    loads = get_profile(profile).connector_class(name, extra) if profile in profile_names() else None
    return (loads, name) if loads and loads != name else (name,)


def connector_rules_for(ruleset: RuleSet, profile: str, name: str,
                        extra: Mapping[str, Any] | None = None) -> tuple[CompiledRule, ...]:
    """The rules of connector ``name`` configured with ``extra`` under release profile ``profile``
    (`connector_names_for`)."""
    return tuple(r for n in connector_names_for(profile, name, extra) for r in ruleset.connector_rules(n))


def unknown_connector_warnings(ruleset: RuleSet, conn: ConnectorConfig | None,
                               declared: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """One warning per connector in ``conn``'s tree (members included) that no release profile registers
    and no rule file names: no rules apply to it, which is most often a misspelling (``nixlconnector``).
    The library's `Decision.warnings` and the CLI's dry-run say the same. ``declared``: names the
    deployment loads from ``kv_connector_module_path``, no misspelling (`kvpolicy.engine.connector_names`
    says what applies to them instead)."""
    from kvpolicy.policy.connectors import KNOWN_CONNECTORS, suggest_connector

    out: list[str] = []
    for node in () if conn is None else _tree(conn):
        if node.name not in KNOWN_CONNECTORS and node.name not in ruleset.connectors and node.name not in declared:
            near = suggest_connector(node.name)
            text = (f"unknown connector `{node.name}`: no rules apply to it"
                    + (f"; did you mean `{near}`?" if near else ""))
            if text not in out:
                out.append(text)
    return tuple(out)


def _tree(conn: ConnectorConfig) -> list[ConnectorConfig]:
    return [conn, *(n for m in conn.connectors for n in _tree(m))]


def _connector_scope(ruleset: RuleSet, ctx: Context, conn: ConnectorConfig, label: str, top: bool) -> Scope:
    members = tuple(
        _connector_scope(ruleset, ctx, m, f"{label}/{m.name}[{i}]", False) for i, m in enumerate(conn.connectors)
    )
    env = ctx.env() if top else ctx.env(conn)
    rules = connector_rules_for(ruleset, ctx.profile, conn.name, conn.extra)
    return Scope(label, rules, env, members, ruleset.combine_mode(conn.name))


def scopes_for(ruleset: RuleSet, ctx: Context) -> tuple[Scope, Scope | None]:
    """The global scope and the connector scope tree (None without a connector)."""
    # INVARIANT: the winner is plannable: a candidate the backend has no geometry for is removed up front
    plannable = tuple(x for x in ctx.candidates if x in ctx.backend.orders)
    no_geometry = tuple(x for x in ctx.candidates if x not in ctx.backend.orders)
    glob = Scope("global", ruleset.global_rules, ctx.env(), candidates=plannable, release=release_ref(ctx),
                 geometry=geometry_ref(ctx, no_geometry) if no_geometry else None, no_geometry=no_geometry)
    if ctx.connector is None:
        return glob, None
    return glob, _connector_scope(ruleset, ctx, ctx.connector, f"connector:{ctx.connector.name}", True)


def release_ref(ctx: Context) -> RuleRef:
    """The built-in candidate filter, shown like a rule: the release's layouts the backends support."""
    names = ", ".join(str(x) for x in ctx.candidates) or "none"
    workers = ctx.worker_backends
    if workers is None or workers == ((ctx.backend.name,),):
        what = f"attention backend `{ctx.backend.name}` supports"
    else:
        shown = "; ".join("[" + ", ".join(w) + "]" for w in workers)
        what = (f"the attention backends of every worker support ({shown}), merged as vLLM merges the "
                "workers' supported_kv_cache_layouts()")
    return RuleRef(RELEASE_CANDIDATES, Source(f"policy/releases/{ctx.profile}.yaml", 1), "require",
                   f"the layouts `{ctx.profile}` has that {what}, most preferred first: {names}")


def geometry_ref(ctx: Context, missing: tuple[Layout, ...]) -> RuleRef:
    """The built-in geometry filter, shown like a rule: candidates the planned backend has no geometry for."""
    have = ", ".join(str(x) for x in ctx.backend.orders) or "none"
    return RuleRef(BACKEND_GEOMETRY, Source(f"policy/releases/{ctx.profile}.yaml", 1), "require",
                   f"attention backend `{ctx.backend.name}` has a geometry (a plan) for {have} only, not for "
                   + ", ".join(str(x) for x in missing))


def waiver_ref(waiver: Any) -> WaiverRef:
    """A `kvpolicy.policy.waivers.CompiledWaiver` as the trace shows it."""
    w = waiver.waiver
    return WaiverRef(waiver.source, w.owner, w.reason, w.expires.isoformat())


def rule_ref(rule: CompiledRule) -> RuleRef:
    r = rule.rule
    return RuleRef(r.id, rule.source, r.effect.value, r.description, r.reference)


class Outcome(NamedTuple):
    """The result of one evaluation: survivors' mask, scores and the winner's index."""

    alive: int
    scores: tuple[int, ...]
    winner: int | None
    events: tuple[Event, ...] = ()
    ranks: tuple[int, ...] = ()

    def ranked(self) -> list[int]:
        """Indices of the surviving candidates, best first (score, then the candidates' preference order)."""
        ranks = self.ranks or tuple(range(len(self.scores)))
        return sorted((i for i in range(len(self.scores)) if self.alive >> i & 1),
                      key=lambda i: (-self.scores[i], ranks[i]))


def _fast_scope(scope: Scope, n: int, alive: int) -> tuple[int, list[int]]:
    score = [0] * n
    env = scope.env
    for rule in scope.rules:
        test, code, mask, weights = rule.fast
        if test(env):
            if code == FORBID:
                alive &= ~mask
            elif code == REQUIRE:
                alive &= mask
            else:
                score = [a + b for a, b in zip(score, weights)]
    if scope.members:
        member_scores = []
        for member in scope.members:
            alive, s = _fast_scope(member, n, alive)
            member_scores.append(s)
        if _conflict(scope.mode, member_scores, n):
            alive = 0
        combined = _combine(scope.mode, member_scores, n)
        score = [a + b for a, b in zip(score, combined)]
    return alive, score


def _conflict(mode: MemberPreferences, member_scores: list[list[int]], n: int) -> bool:
    """Under ``agree``: do two members prefer different best layouts?"""
    if mode is not MemberPreferences.agree:
        return False
    tops = set()
    for s in member_scores:
        best = max(s, default=0)
        if best > 0:
            tops.add(tuple(i for i in range(n) if s[i] == best))
    return len(tops) > 1


def _combine(mode: MemberPreferences, member_scores: list[list[int]], n: int) -> list[int]:
    if mode is MemberPreferences.all:
        return [min(s[i] for s in member_scores) for i in range(n)]
    if mode in (MemberPreferences.any, MemberPreferences.agree):
        return [max(s[i] for s in member_scores) for i in range(n)]
    return [sum(s[i] for s in member_scores) for i in range(n)]


def _pick(alive: int, scores: list[int], ranks: tuple[int, ...]) -> int | None:
    best: int | None = None
    for i in sorted(range(len(ranks)), key=ranks.__getitem__):
        if alive >> i & 1 and (best is None or scores[i] > scores[best]):
            best = i
    return best


def _start(ruleset: RuleSet, glob: Scope) -> tuple[int, tuple[int, ...]]:
    """The candidates' mask over the rule set's order, and each layout's tie-break rank: the rule
    set's declared `defaults.layout_order` when it has one, else the candidates' preference order."""
    order = ruleset.layout_order
    cands = glob.candidates if glob.candidates is not None else order
    mask = sum(1 << i for i, layout in enumerate(order) if layout in cands)
    if ruleset.order_declared:
        return mask, tuple(range(len(order)))
    rank = {layout: i for i, layout in enumerate(cands)}
    return mask, tuple(rank.get(layout, len(order) + i) for i, layout in enumerate(order))


def _explain_scope(scope: Scope, order: tuple[Layout, ...], alive: int, events: list[Event],
                   candidates: int) -> tuple[int, list[int]]:
    """Evaluate one scope with a trace; removals are reported only for ``candidates`` (what the
    release left), so an error never blames a rule for a layout the release never offered."""
    n = len(order)
    score = [0] * n
    for rule in scope.rules:
        leaves: list[LeafResult] = []
        matched = rule.condition.explain(scope.env, leaves)
        ref = rule_ref(rule)
        events.append(RuleEvaluated(ref, scope.label, matched, tuple(leaves)))
        if not matched:
            continue
        code = rule.fast[1]
        if rule.waivers:
            events += [WaiverChecked(ref, waiver_ref(w), scope.label, False) for w in rule.lapsed_for(scope.env)]
            waiver = rule.waived_by(scope.env)
            if waiver is not None:  # in force here: the rule has no effect (as `rule.fast[0]` says on the fast path)
                hits = tuple(layout for i, layout in enumerate(order)
                             if candidates >> i & 1 and (rule.mask >> i & 1 if code == PREFER else rule.removes(i)))
                events.append(WaiverChecked(ref, waiver_ref(waiver), scope.label, True, hits))
                continue
        for i, layout in enumerate(order):
            if rule.removes(i):
                if candidates >> i & 1:
                    events.append(CandidateRemoved(layout, ref, scope.label))
            elif code == PREFER and rule.mask >> i & 1:
                score[i] += rule.weight
                events.append(PreferenceApplied(layout, ref, scope.label, rule.weight))
        if code == FORBID:
            alive &= ~rule.mask
        elif code == REQUIRE:
            alive &= rule.mask
    if scope.members:
        member_scores = []
        for member in scope.members:
            alive, s = _explain_scope(member, order, alive, events, candidates)
            member_scores.append(s)
        if _conflict(scope.mode, member_scores, n):
            ref = RuleRef(f"{scope.label}:members-agree", Source(scope.label, 1), "require",
                          "the members prefer different layouts and `member_preferences: agree` asks them to "
                          "agree (vLLM: all connectors must use the same layout)")
            events += [CandidateRemoved(layout, ref, scope.label) for i, layout in enumerate(order) if alive >> i & 1]
            alive = 0
        combined = _combine(scope.mode, member_scores, n)
        score = [a + b for a, b in zip(score, combined)]
    return alive, score


def evaluate(ruleset: RuleSet, glob: Scope, conn: Scope | None, *, explain: bool) -> Outcome:
    """Run the decision over prepared scopes; never raises for a policy "no"."""
    order = ruleset.layout_order
    n = len(order)
    full, ranks = _start(ruleset, glob)
    if not explain:
        alive, scores = _fast_scope(glob, n, full)
        if conn is not None:
            alive, conn_scores = _fast_scope(conn, n, alive)
            scores = [a + b for a, b in zip(scores, conn_scores)]
        return Outcome(alive, tuple(scores), _pick(alive, scores, ranks), ranks=ranks)
    events: list[Event] = []
    if glob.release is not None:
        events += [CandidateRemoved(layout, glob.geometry, "backend") if glob.geometry is not None
                   and layout in glob.no_geometry else CandidateRemoved(layout, glob.release, "release")
                   for i, layout in enumerate(order) if not full >> i & 1]
    alive, scores = _explain_scope(glob, order, full, events, full)
    if conn is not None:
        alive, conn_scores = _explain_scope(conn, order, alive, events, full)
        scores = [a + b for a, b in zip(scores, conn_scores)]
    winner = _pick(alive, scores, ranks)
    outcome = Outcome(alive, tuple(scores), winner, ranks=ranks)
    if winner is not None:
        events.append(LayoutChosen(order[winner], scores[winner],
                                   tuple((order[i], scores[i]) for i in outcome.ranked())))
    return outcome._replace(events=tuple(events))


def no_layout_error(ruleset: RuleSet, events: tuple[Event, ...]) -> NoLayoutError:
    """The conflict error: every rule that removed a candidate, located."""
    diags, seen = [], set()
    for e in events:
        if isinstance(e, CandidateRemoved) and (e.rule.id, e.scope) not in seen:
            seen.add((e.rule.id, e.scope))
            removed = [str(x.layout) for x in events if isinstance(x, CandidateRemoved) and x.rule.id == e.rule.id]
            src = e.rule.source
            diags.append(Diagnostic(src.file, src.line, src.col, "removed-candidates",
                                    f"rule `{e.rule.id}` ({e.rule.effect}, {e.scope}) removed "
                                    + ", ".join(f"`{r}`" for r in removed)))
    return NoLayoutError(
        "no layout survives the rules for this input; these rules removed the candidates "
        "(relax one of them, or change the input):",
        diags,
    )

