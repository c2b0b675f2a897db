"""A fleet's deployments as the inputs lint analyses: exactly the operator's deployments, not a release's space.

`kvpolicy.engine.analysis.space` builds a release profile's inputs around the rules' literals; a fleet file
(`kvpolicy.engine.fleet`) names the deployments a site runs. ``kvpolicy lint --fleet FILE`` lints the rules
against those: each deployment's context is built as ``dry-run --fleet`` builds it (`decide_fleet`: the model
config read as the release reads it, the release's candidates and connector checks), and becomes one
`AnalysisInput` of its release profile, labelled by the deployment's name. The environment the rules see is
the context's own (`Context.env`): the connector's part is bound by the input, as in a space.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpolicy.engine.analysis.space import AnalysisInput, InputConnector, InputCore, Space, connector_env
from kvpolicy.policy.context import Context
from kvpolicy.policy.releases import get_profile

__all__ = ["deployment_input", "fleet_spaces"]

_CONNECTOR_PREFIX = "connector."


def deployment_input(ctx: Context, name: str) -> AnalysisInput:
    """One deployment's context as an input of lint (its ``env`` equals ``ctx.env()``), labelled
    ``deployment=NAME``; the verifier sees its own geometry (spec, backend, scale views)."""
    bare = Context.model_construct(kv=ctx.kv, groups=ctx.groups, backend=ctx.backend, connector=None,
                                   profile=ctx.profile, candidates=ctx.candidates, options=ctx.options)
    env = {k: v for k, v in ctx.env().items() if not k.startswith(_CONNECTOR_PREFIX)}
    geometry = (ctx.kv.model_dump_json(), ctx.backend.name, ctx.backend.scale_views.value)
    core = InputCore(bare, {**env, **connector_env(None)}, (("deployment", name),), (), geometry)
    return AnalysisInput(core, InputConnector.of(ctx.connector))


def fleet_spaces(results: Sequence[Any]) -> dict[str, tuple[Space, list[Any]]]:
    """Per release profile, the space of the fleet's deployments that have a context (decided, unsafe or
    refused; not invalid ones) and those deployments' results (`kvpolicy.engine.fleet.FleetResult`), in
    the fleet's order."""
    out: dict[str, tuple[Space, list[Any]]] = {}
    for result in results:
        if result.context is None or result.profile is None or result.status == "invalid":
            continue
        if result.profile not in out:
            out[result.profile] = (Space(get_profile(result.profile), []), [])
        space, members = out[result.profile]
        space.inputs.append(deployment_input(result.context, result.name))
        members.append(result)
    for space, _ in out.values():
        space.dimensions = {"deployment": [inp.core.labels[0][1] for inp in space.inputs]}
    return out
