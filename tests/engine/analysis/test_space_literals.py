"""The analysed space reaches every literal a rule compares a size or a connector extra with (#15).

A rule on ``kv.num_layers ge 8`` or ``connector.extra.num_streams lt 4`` matches real
deployments; lint must not call it dead because the space held only its fixed sizes.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.engine.analysis import build_space, lint
from kvpolicy.engine.analysis.space import connectors
from kvpolicy.engine.decide import scopes_for
from kvpolicy.engine.inputs import build_context
from kvpolicy.policy import load_rules_from_texts
from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.spec import KVCacheSpec

GLOBAL = """\
version: 1
defaults:
  layout_order: [per_layer/NHD, per_layer/HND, cross_layer/NHD, cross_layer/HND]
rules:
{rules}
"""
CONNECTOR = """\
version: 1
connector: {name}
rules:
{rules}
"""


def rule(rule_id: str, when: str, effect: str = "prefer: {layout: per_layer/HND}") -> str:
    return f"  - id: {rule_id}\n    description: test rule {rule_id}\n    when: {when}\n    {effect}\n"


def dead(report) -> set[str]:
    return {f.rule.id for f in report.findings if f.code == "dead-rule"}


def test_rules_on_sizes_and_extras_beyond_the_defaults_are_not_dead() -> None:
    texts = {
        "global.yaml": GLOBAL.format(rules=rule("deep", "{field: kv.num_layers, ge: 8}")
                                     + rule("big-blocks", "{field: kv.block_size, gt: 16}")),
        "connectors/nixl.yaml": CONNECTOR.format(name="NixlConnector", rules=rule(
            "few-streams", "{field: connector.extra.num_streams, lt: 4}")),
    }
    texts["global.yaml"] += rule("many-groups", "{field: groups.count, gt: 3}") + rule(
        "many-attention-groups", "{field: groups.attention_groups, ge: 5}")
    report = lint(load_rules_from_texts(texts), baseline=None)
    assert dead(report) == set()
    sizes = report.to_dict()["space"]["dimensions"]["sizes"]
    assert any("num_layers=8" in s for s in sizes) and any("block_size=32" in s or "block_size=17" in s
                                                          for s in sizes)


def test_a_rule_on_mamba_only_models_is_not_dead_and_their_decisions_are_not_errors() -> None:
    """vLLM 0.28's `cross-layer-needs-attention-spec` (kv.kind eq mamba) keeps a model of Mamba
    layers only off the cross-layer path; such a model has no paged K/V to verify, so lint must
    neither call the rule dead nor call a layout chosen for it unsafe."""
    from kvpolicy.engine import LayoutEngine

    report = lint(LayoutEngine.default("vllm-0.28").ruleset, vllm_version="vllm-0.28")
    assert "cross-layer-needs-attention-spec" not in dead(report)
    assert "mamba" in report.to_dict()["space"]["dimensions"]["kind"]
    assert [f.code for f in report.findings if f.severity == "error"] == []
    texts = {"global.yaml": GLOBAL.format(rules=rule("mamba-only", "{field: kv.kind, eq: mamba}",
                                                     "forbid: {placement: cross_layer}"))}
    assert dead(lint(load_rules_from_texts(texts), baseline=None)) == set()


def test_a_rule_no_deployment_can_match_is_still_dead() -> None:
    texts = {"global.yaml": GLOBAL.format(rules=rule("never", "{all: [{field: kv.num_layers, ge: 8}, "
                                                               "{field: kv.num_layers, lt: 8}]}")
                                          + rule("live", "{field: kv.num_layers, lt: 8}"))}
    assert dead(lint(load_rules_from_texts(texts), baseline=None)) == {"never"}


def test_nine_connector_extra_keys_keep_the_space_linear() -> None:
    keys = [f"k{i}" for i in range(9)]
    rules = "".join(rule(f"r-{k}", f"{{field: connector.extra.{k}, eq: {i}}}") for i, k in enumerate(keys))
    rules += rule("pair", "{all: [{field: connector.extra.k0, eq: 0}, {field: connector.extra.k1, eq: 1}]}")
    texts = {"global.yaml": GLOBAL.format(rules=rule("g", "{field: kv.num_layers, ge: 2}")),
             "connectors/nixl.yaml": CONNECTOR.format(name="NixlConnector", rules=rules)}
    rs = load_rules_from_texts(texts)
    nixl = [c for c in connectors(rs) if c is not None and c.name == "NixlConnector"]
    assert len(nixl) < 40  # the full product: 2^9 = 512 (3^9 with two literals a key)
    space = build_space(rs)
    assert space.dimensions["connector"].count("none") == 1
    assert dead(lint(rs, space, baseline=None)) == set()


# ---------------------------------------------------------------------------------------------
# Property: whatever a `kvpolicy test`-style case matches, lint does not call dead

FIELDS_OPS = st.sampled_from([("kv.num_layers", (1, 64)), ("kv.block_size", (1, 64)),
                              ("kv.num_kv_heads", (1, 16)), ("kv.head_size", (1, 256)),
                              ("connector.extra.a", (0, 9)), ("connector.extra.b", (0, 9))])
OPS = st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge", "in", "not_in", "exists"])


@st.composite
def leaf(draw) -> str:
    field, (lo, hi) = draw(FIELDS_OPS)
    op = draw(OPS)
    if op == "exists":
        return f"{{field: {field}, exists: {draw(st.booleans())}}}".replace("True", "true").replace("False", "false")
    if op in ("in", "not_in"):
        vals = draw(st.lists(st.integers(lo, hi), min_size=1, max_size=3))
        return f"{{field: {field}, {op}: {vals}}}"
    return f"{{field: {field}, {op}: {draw(st.integers(lo, hi))}}}"


@st.composite
def rule_sets(draw) -> tuple[dict[str, str], list[str]]:
    n = draw(st.integers(1, 4))
    out, ids = "", []
    for i in range(n):
        leaves = draw(st.lists(leaf(), min_size=1, max_size=2))
        when = leaves[0] if len(leaves) == 1 else f"{{all: [{', '.join(leaves)}]}}"
        out += rule(f"r{i}", when)
        ids.append(f"r{i}")
    return {"global.yaml": GLOBAL.format(rules=out)}, ids


CASE = st.fixed_dictionaries({
    "num_layers": st.integers(1, 70), "block_size": st.sampled_from([1, 2, 7, 8, 15, 16, 17, 32, 64]),
    "num_kv_heads": st.integers(1, 17), "head_size": st.sampled_from([8, 16, 32, 64, 128, 256]),
    "extra": st.dictionaries(st.sampled_from(["a", "b"]), st.integers(-1, 10), max_size=2),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rule_sets(), st.lists(CASE, min_size=1, max_size=4))
def test_a_rule_some_case_matches_is_never_reported_dead(generated, cases) -> None:
    texts, _ = generated
    rs = load_rules_from_texts(texts)
    matched: set[str] = set()
    for case in cases:
        spec = KVCacheSpec(num_layers=case["num_layers"], block_size=case["block_size"],
                           num_kv_heads=case["num_kv_heads"], head_size=case["head_size"])
        try:
            ctx = build_context(spec=spec, connector="NixlConnector", connector_config=case["extra"] or None)
        except PolicyError:
            continue
        glob, conn = scopes_for(rs, ctx)
        for scope in glob.walk() + (conn.walk() if conn else []):
            matched |= {r.id for r in scope.rules if r.fast[0](scope.env)}
    assert dead(lint(rs, baseline=None)) & matched == set()


def test_lint_tries_each_class_a_connector_mode_loads() -> None:
    """vLLM 0.34 loads NixlPushConnector for NixlConnector with `transfer_mode: push` (issue 23): the space
    holds NixlConnector at each transfer_mode, each with the rules of the class it loads."""
    from kvpolicy.engine import LayoutEngine
    from kvpolicy.engine.analysis.space import connectors
    from kvpolicy.engine.decide import connector_rules_for

    ruleset = LayoutEngine.default("vllm-0.34").ruleset
    nixl = [c for c in connectors(ruleset, "vllm-0.34") if c is not None and c.name == "NixlConnector"]
    modes = {c.extra.get("transfer_mode") for c in nixl}
    assert {None, "pull", "push"} <= modes
    push = next(c for c in nixl if c.extra.get("transfer_mode") == "push")
    files = {r.scope for r in connector_rules_for(ruleset, "vllm-0.34", push.name, push.extra)}
    assert files == {"NixlPushConnector", "NixlConnector"}
