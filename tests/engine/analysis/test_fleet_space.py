"""A fleet's deployments as lint's inputs (`kvpolicy.engine.analysis.fleet_space`): the rules see each deployment's
context exactly as dry-run --fleet decides it."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvpolicy.engine.analysis.decider import Decider
from kvpolicy.engine.analysis.fleet_space import fleet_spaces
from kvpolicy.engine.fleet import decide_fleet, load_fleet
from kvpolicy.engine.rule_layers import load_layers

FLEET = Path(__file__).resolve().parents[3] / "docs" / "examples" / "fleet.yaml"


def test_each_deployment_decides_as_dry_run_fleet_decides_it() -> None:
    rules = {}

    def rules_for(profile: str):
        return rules.setdefault(profile, load_layers(vllm_version=profile))

    results = decide_fleet(load_fleet(FLEET), rules_for)
    spaces = fleet_spaces(results)
    assert sum(len(space) for space, _ in spaces.values()) == sum(r.context is not None for r in results) == \
        len(yaml.safe_load(FLEET.read_text())["deployments"])
    for profile, (space, members) in spaces.items():
        decider = Decider(rules_for(profile))
        for inp, result in zip(space, members, strict=True):
            assert inp.env == result.context.env()  # the fields every rule reads, connector members' aside
            assert inp.label.startswith(f"deployment={result.name} connector=")
            winner = decider.decide(inp).winner
            if result.decision is None:
                assert winner is None and result.status == "refused"
            else:
                assert decider.name(winner) == str(result.decision.layout), result.name
