"""The lint/diff space is bounded (issue 23, class 3): hostile rule directories whose literal-aware space is a
product of millions of inputs are cut to ``max_inputs`` before any input is built, the cut is reported, and no
shipped profile's space is cut.

Asserts on the number of inputs and on the reported bound, never on time. Before the bound, building these
spaces took minutes and gigabytes (size rules read with the dtype, groups and options: 4.1 million inputs
for 2 rules, past 6 GB for 10); each test here builds at most a few hundred thousand small objects.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.engine.analysis import build_space, lint
from kvpolicy.engine.analysis.budget import DEFAULT_MAX_INPUTS, WORK_RULES_PER_INPUT, SizeCost, plan_cut
from kvpolicy.engine.analysis.lint import shipped_ruleset
from kvpolicy.engine.rule_layers import load_layers
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.releases import profile_names

V034 = "vllm-0.34"
SIZES = ("kv.num_layers", "kv.block_size", "kv.num_kv_heads", "kv.head_size")


def sizes_read_together(d: Path, rules: int = 10) -> Path:
    """Rules each comparing the four sizes (their own literals) together with the dtype, groups and an option."""
    body = ""
    for i in range(rules):
        leaves = ", ".join(f"{{field: {SIZES[j]}, gt: {3 + 4 * i + j}}}" for j in range(4))
        body += (f"  - id: sizes-{i}\n    description: sizes {i}\n    when: {{all: [{leaves}, "
                 "{field: kv.kv_cache_dtype, eq: fp8}, {field: groups.count, eq: 1}, "
                 "{field: env.VLLM_KV_CACHE_LAYOUT, exists: false}]}\n    forbid: {placement: cross_layer}\n")
    d.mkdir(parents=True, exist_ok=True)
    (d / "sizes.yaml").write_text("version: 1\nrules:\n" + body)
    return d


def extras_read_together(d: Path, keys: int = 40) -> Path:
    """One NixlConnector rule reading ``keys`` connector.extra keys in one condition."""
    leaves = ", ".join(f"{{field: connector.extra.k{i}, eq: {i}}}" for i in range(keys))
    (d / "connectors").mkdir(parents=True, exist_ok=True)
    (d / "connectors" / "NixlConnector.yaml").write_text(
        "version: 1\nconnector: NixlConnector\nrules:\n  - id: many-extras\n    description: d\n"
        f"    when: {{all: [{leaves}]}}\n    prefer: {{layout: per_layer/HND}}\n")
    return d


def connector_files(d: Path, files: int = 10) -> Path:
    """``files`` connector files, each for its own connector, each reading one extra key."""
    (d / "connectors").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (d / "connectors" / f"C{i}.yaml").write_text(
            f"version: 1\nconnector: SiteConnector{i}\nrules:\n  - id: c{i}\n    description: d\n"
            f"    when: {{field: connector.extra.mode{i}, eq: fast}}\n    prefer: {{layout: per_layer/HND}}\n")
    return d


HOSTILE = {"sizes-read-together": sizes_read_together, "extras-read-together": extras_read_together,
           "connector-files": connector_files}


def rulesets(d: Path) -> list:
    return [load_layers([str(d)], vllm_version=V034), shipped_ruleset(V034)]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_rule_directory_is_cut_to_the_bound_and_says_so(tmp_path: Path, name: str) -> None:
    space = build_space(rulesets(HOSTILE[name](tmp_path / name)), vllm_version=V034)
    assert space.cut is not None and not space.cut.stopped
    assert len(space) <= DEFAULT_MAX_INPUTS < space.cut.estimated
    assert space.cut.size_variants_left_out + space.cut.connectors_left_out > 0
    text = space.describe()
    assert f"cut to at most {DEFAULT_MAX_INPUTS} inputs (--max-space) from about {space.cut.estimated}" in text
    assert space.to_dict()["cut"]["estimated_inputs"] == space.cut.estimated


def test_the_figures_of_the_three_hostile_directories(tmp_path: Path) -> None:
    """The estimates the bound works from (what the space would have held): ten size rules about 44.6
    million inputs, 40 extras in one NixlConnector condition 2,129,400 (each variant at each `transfer_mode`,
    which chooses the class vLLM 0.34 loads), ten connector files 404,040."""
    estimates = {name: build_space(rulesets(make(tmp_path / name)), vllm_version=V034, max_inputs=1000).cut
                 for name, make in HOSTILE.items()}
    assert estimates["extras-read-together"].estimated == 2_129_400
    assert estimates["connector-files"].estimated == 404_040
    assert estimates["sizes-read-together"].estimated > 40_000_000
    for cut in estimates.values():
        assert cut.max_inputs == 1000


def test_variants_past_what_the_bound_could_keep_are_counted_not_built(tmp_path: Path) -> None:
    """One rule reading 500 extra keys together has about 500,000 pairs of values: building them took 44 s and
    2.4 GB before any bound applied. At most ``max(1000, max_inputs // 50)`` variants of a list are built."""
    from kvpolicy.engine.analysis.space import connectors

    sets = rulesets(extras_read_together(tmp_path / "extras", keys=500))
    skipped = [0]
    built = connectors(sets, V034, limit=1000, skipped=skipped)
    assert len(built) < 1100 and skipped[0] > 400_000
    space = build_space(sets, vllm_version=V034, max_inputs=20_000)
    assert space.cut is not None and space.cut.connectors > 400_000
    assert len(space.dimensions["connector"]) <= 1000 and len(space) <= 20_000


def test_lint_of_a_cut_space_warns_and_qualifies_its_dead_rules(tmp_path: Path) -> None:
    layer = extras_read_together(tmp_path / "extras")
    report = lint(load_layers([str(layer)], vllm_version=V034), vllm_version=V034, max_inputs=5000)
    assert report.inputs_checked <= 5000
    cut = [f for f in report.findings if f.code == "space-cut"]
    assert len(cut) == 1 and cut[0].severity == "warning" and report.findings[0] is cut[0]
    assert "every finding holds for the explored inputs only" in cut[0].message
    assert "raise --max-space" in cut[0].message
    dead = [f for f in report.findings if f.code == "dead-rule"]
    assert dead and all(f.message.endswith("(as cut: see space-cut)") for f in dead)
    assert report.to_dict()["space"]["cut"]["max_inputs"] == 5000


def test_a_bound_below_the_base_space_stops_building_at_the_bound() -> None:
    space = build_space(shipped_ruleset(V034), vllm_version=V034, max_inputs=777)
    assert len(space) == 777 and space.cut is not None and space.cut.stopped
    assert "inputs were built in order up to it" in space.describe()


@pytest.mark.parametrize("profile", profile_names())
def test_no_shipped_profile_is_cut(profile: str) -> None:
    """The estimate bounds the space from above (next test), so a profile estimated within the bound is never cut."""
    estimate = build_space(shipped_ruleset(profile), vllm_version=profile, max_inputs=1).cut
    assert estimate is not None and estimate.estimated <= DEFAULT_MAX_INPUTS
    # nor is a site layer of 50 rules, linted with the shipped rules as its baseline (the work bound)
    rules = 2 * len(shipped_ruleset(profile).rules) + 50
    assert estimate.estimated * rules <= DEFAULT_MAX_INPUTS * WORK_RULES_PER_INPUT, (estimate.estimated, rules)


def test_many_rules_get_fewer_inputs_and_the_cut_says_why(tmp_path: Path) -> None:
    """Issue 23: the work is inputs x rules; 1,000 rules on vllm-0.27 (9,980 on 0.34) ran past 120 CPU s with no
    message. The bound now holds inputs x rules within --max-space x WORK_RULES_PER_INPUT, and the cut says so."""
    body = "".join(f"  - id: same-{i}\n    description: d\n    when: {{field: backend.name, eq: FLASH_ATTN}}\n"
                   f"    prefer: {{layout: LBHNC}}\n" for i in range(1000))
    (tmp_path / "many.yaml").write_text("version: 1\nrules:\n" + body)
    sets = [load_layers([str(tmp_path)], vllm_version="vllm-0.27"), shipped_ruleset("vllm-0.27")]
    rules = sum(len(rs.rules) for rs in sets)
    space = build_space(sets, vllm_version="vllm-0.27", max_inputs=20_000)
    assert 0 < len(space) * rules <= 20_000 * WORK_RULES_PER_INPUT
    assert space.cut is not None and space.cut.rules == rules and space.cut.max_space == 20_000
    assert f"{rules} rules to decide each input with, and --max-space 20000 allows" in space.describe()
    assert space.to_dict()["cut"]["rules"] == rules


@pytest.mark.parametrize("profile", ["vllm-0.34", "vllm-0.28", "vllm-0.24", "issue-48412"])
def test_the_estimate_bounds_the_space_it_describes(profile: str) -> None:
    rules = shipped_ruleset(profile)
    space = build_space(rules, vllm_version=profile)
    estimate = build_space(rules, vllm_version=profile, max_inputs=1).cut
    assert space.cut is None and estimate is not None and estimate.estimated >= len(space)


def test_the_cli_help_states_the_default_bound(capsys) -> None:
    from kvpolicy.engine.cli.main import main

    assert main(["lint", "--help"]) == 0
    assert f"(default {DEFAULT_MAX_INPUTS}:" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10", 100_000_001, 10**40])
def test_max_inputs_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(InputError) as err:
        build_space(shipped_ruleset(V034), vllm_version=V034, max_inputs=bad)  # type: ignore[arg-type]
    assert err.value.diagnostics[0].file == "max_inputs"


def _size(cores: int, tier: int, conns: int, allowed: frozenset[int] | None = None) -> SizeCost:
    return SizeCost(cores, allowed, tier, (1,) * conns)


def test_plan_cut_keeps_everything_within_the_bound() -> None:
    sizes = [_size(10, 0, 3), _size(10, 1, 3)]
    assert plan_cut(sizes, [0, 1, 2], 60) == ([True, True], [True, True, True], 60, 60)


def test_plan_cut_drops_combinations_before_single_literals_and_never_the_base() -> None:
    sizes = [_size(10, 0, 3), _size(10, 1, 3), _size(10, 2, 3)]
    keep_size, keep_conn, full, kept = plan_cut(sizes, [0, 1, 2], 45)
    assert full == 90 and kept <= 45
    assert keep_size[0] and keep_conn[0]  # tier 0
    assert not keep_size[2] and not keep_conn[2]  # tier 2 went first
    keep_size, keep_conn, _, kept = plan_cut(sizes, [0, 1, 2], 1)
    assert keep_size == [True, False, False] and keep_conn == [True, False, False] and kept == 10


def test_plan_cut_drops_the_costliest_variant_of_a_tier_first() -> None:
    """Fewest variants go: a size variant paired with every connector before a connector few sizes reach."""
    sizes = [_size(1, 0, 4, frozenset({0})), _size(100, 2, 4), _size(1, 2, 4, frozenset({3}))]
    keep_size, keep_conn, full, kept = plan_cut(sizes, [0, 0, 0, 2], 60)
    assert full == 1 + 400 + 1 and keep_size == [True, False, True] and all(keep_conn) and kept == 2


def test_the_space_line_names_at_most_20_items_of_a_left_out_list(tmp_path: Path) -> None:
    """Size variants an MLA spec cannot have are listed: hundreds for a hostile directory, in one line."""
    space = build_space(rulesets(sizes_read_together(tmp_path / "sizes", rules=3)), vllm_version=V034,
                        max_inputs=50_000)
    invalid = space.left_out["size variants no spec of that kind can have"]
    assert len(invalid) > 20
    text = space.describe()
    assert f"left out {len(invalid)} size variants no spec of that kind can have: " in text
    assert f"{invalid[19]}, and {len(invalid) - 20} more (--format json lists all)" in text


@st.composite
def _cut_problems(draw: st.DrawFn) -> tuple[list[SizeCost], list[int], int]:
    n_conns = draw(st.integers(1, 8))
    conn_tiers = [0, *draw(st.lists(st.integers(0, 2), min_size=n_conns - 1, max_size=n_conns - 1))]
    vectors = [tuple(draw(st.lists(st.integers(0, 3), min_size=n_conns, max_size=n_conns))) for _ in range(2)]
    sizes = [SizeCost(draw(st.integers(0, 50)),
                      draw(st.none() | st.frozensets(st.integers(0, n_conns - 1))),
                      0 if j == 0 else draw(st.integers(0, 2)), draw(st.sampled_from(vectors)))
             for j in range(draw(st.integers(1, 8)))]
    return sizes, conn_tiers, draw(st.integers(1, 2000))


def _estimate(sizes: list[SizeCost], keep_size: list[bool], keep_conn: list[bool]) -> int:
    return sum(s.cores * s.weights[c] for s, k in zip(sizes, keep_size) if k
               for c in (range(len(keep_conn)) if s.allowed is None else s.allowed) if keep_conn[c])


@given(_cut_problems())
@settings(max_examples=300, deadline=None)
def test_plan_cut_fits_the_bound_whenever_tier_0_does_and_never_drops_tier_0(problem) -> None:
    sizes, conn_tiers, bound = problem
    keep_size, keep_conn, full, kept = plan_cut(sizes, conn_tiers, bound)
    assert full == _estimate(sizes, [True] * len(sizes), [True] * len(conn_tiers))
    assert kept == _estimate(sizes, keep_size, keep_conn)  # the running sums are the estimate of what is kept
    assert all(k for s, k in zip(sizes, keep_size) if s.tier == 0)
    assert all(k for t, k in zip(conn_tiers, keep_conn) if t == 0)
    base = _estimate(sizes, [s.tier == 0 for s in sizes], [t == 0 for t in conn_tiers])
    assert kept <= max(bound, base)
    if full <= bound:
        assert all(keep_size) and all(keep_conn)


def test_the_cli_refuses_a_max_space_past_its_limit(capsys) -> None:
    """A 40-digit --max-space turned the bound off (issue 23's hostile pass: past 120 CPU s on 60 extras)."""
    from kvpolicy.engine.cli.main import main

    assert main(["lint", "--max-space", "9" * 40]) == 2
    assert "of at most 100000000" in capsys.readouterr().err
