"""A fleet: the operator's deployments in one checked-in file, decided together (``kvpolicy dry-run --fleet``).

conftest tests every manifest of a repository in one run; a serving site has a list of deployments
(models, vLLM releases, connectors, cache dtypes), and an edit to its rules must be judged against all
of them. A fleet file::

    version: 1
    defaults:                       # optional: keys every deployment has unless it sets them
      vllm_version: "0.34.0"
    deployments:
      - name: chat-qwen-offload
        model: ../../tests/fixtures/configs/qwen2.5-0.5b.json    # relative to the fleet file
        kv_cache_dtype: fp8_per_token_head
        connector: OffloadingConnector
        tensor_parallel_size: 1

A deployment is a policy test case's ``input`` (`kvpolicy.engine.policy_tests.cases.CaseInput`: one
of ``model`` / ``spec`` / ``groups``, the release, backend, connector, dtype, block size, ...) with
a ``name``. Loading reports every problem of the file, located; deciding never stops at a refusal:
each deployment gets its decision, its refusal (no layout survives) or its input error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvpolicy.engine.connector_names import Refuse, check_connector_names, out_of_tree_names
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.engine.model_notes import model_config_notes
from kvpolicy.engine.policy_tests.cases import CaseInput, context_for
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import Diagnostic, GeometryError, InputError, NoLayoutError, PolicyError, shown_file
from kvpolicy.policy.files import read_capped
from kvpolicy.policy.ruleset import RuleSet
from kvpolicy.policy.spec import Frozen
from kvpolicy.policy.validate import located_validation_errors
from kvpolicy.policy.yaml_source import Limits, Located, parse_yaml

__all__ = ["Deployment", "Fleet", "FleetError", "FleetResult", "decide_fleet", "load_fleet"]


class FleetError(PolicyError):
    """A fleet file that cannot be read or does not validate (every problem, located)."""


class Deployment(CaseInput):
    """One deployment: a name and the inputs a policy test case takes."""

    name: str = Field(min_length=1, description="unique within the fleet; shown in the report")
    description: str | None = Field(default=None, description="what the deployment serves (not read)")


class _FleetHeader(Frozen):
    version: Literal[1] = Field(description="format version; currently 1")
    defaults: dict[str, Any] = Field(default_factory=dict, description="keys every deployment has unless it sets them")
    deployments: list[Any] = Field(min_length=1, description="the deployments")


_DEPLOYMENT_KEYS = tuple(Deployment.model_fields)


def _keys_at(path: tuple[Any, ...]) -> tuple[str, ...]:
    if not path:
        return tuple(_FleetHeader.model_fields)
    if isinstance(path[-1], int) and len(path) >= 2 and path[-2] == "deployments":
        return _DEPLOYMENT_KEYS
    if path[-1] == "defaults":
        return _DEPLOYMENT_KEYS
    return ()


@dataclass(frozen=True)
class Fleet:
    """A loaded fleet: its deployments with where each is written."""

    file: str
    deployments: tuple[tuple[Deployment, int], ...]  # (deployment, line)
    # per deployment, where each of its keys is written (line, col): its own, else the `defaults:` one
    keys: tuple[dict[str, tuple[int, int]], ...] = ()

    @property
    def base_dir(self) -> Path:
        return Path(self.file).parent

    def key_at(self, index: int, key: str) -> tuple[int, int]:
        """Where deployment ``index`` sets ``key`` (its own line, column 1, when unknown)."""
        found = self.keys[index].get(key) if index < len(self.keys) else None
        return found if found is not None else (self.deployments[index][1], 1)


def load_fleet(path: str | Path, *, limits: Limits = Limits()) -> Fleet:
    """Read and validate a fleet file; raises `FleetError` listing every problem, located."""
    shown = str(path)
    text, diags = read_capped(Path(path), shown, limits.max_file_bytes)
    if text is None:
        raise FleetError(f"cannot read the fleet file `{shown}`", diags)
    src, diags = parse_yaml(text, shown, limits)
    if src is None or src.is_invalid(()):
        raise FleetError(f"{len(diags)} error(s) in fleet file `{shown}`", diags)
    if not isinstance(src.data, dict):
        raise FleetError("", [src.diag((), "not-a-mapping", "a fleet file is a mapping",
                                       "start it with `version: 1` and a `deployments:` list")])
    try:
        header = _FleetHeader.model_validate(src.data)
    except ValidationError as exc:
        raise FleetError(f"errors in fleet file `{shown}`",
                         [*diags, *located_validation_errors(src, (), src.data, exc, valid_keys=_keys_at)]) from None
    bad_defaults = _check_defaults(src, header.defaults, diags)
    out: list[tuple[Deployment, int]] = []
    keys: list[dict[str, tuple[int, int]]] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(header.deployments):
        where = ("deployments", i)
        line = src.position(where)[0]
        if not isinstance(raw, dict):
            diags.append(src.diag(where, "not-a-mapping", "a deployment is a mapping", "give it a `name:` and inputs"))
            continue
        name = raw.get("name")
        if isinstance(name, str) and name in seen:
            diags.append(src.diag((*where, "name"), "duplicate-deployment",
                                  f"deployment `{name}` is already defined at line {seen[name]}",
                                  "give each deployment its own name"))
        elif isinstance(name, str):
            seen[name] = line
        merged = {**{k: v for k, v in header.defaults.items() if k not in bad_defaults}, **raw}
        if "model" in raw or "spec" in raw or "groups" in raw:  # a deployment's own source replaces the default's
            merged = {k: v for k, v in merged.items() if k not in ("model", "spec", "groups") or k in raw}
        try:
            out.append((Deployment.model_validate(merged), line))
        except ValidationError as exc:
            diags += located_validation_errors(src, where, merged, exc, valid_keys=_keys_at)
            continue
        keys.append(_key_positions(src, where, raw, merged))
    if diags:
        raise FleetError(f"{len(diags)} error(s) in fleet file `{shown}`", diags)
    return Fleet(shown, tuple(out), tuple(keys))


_PROBE_SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_size": 64}


def _key_positions(src: Located, where: tuple[Any, ...], raw: dict[str, Any],
                   merged: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Where each key of a deployment is written (its own, else the `defaults:` one), and each connector name
    inside its connector settings: ``kv_transfer_config.kv_connector``, ``<settings>.connectors.<i>.kv_connector``
    for a MultiConnector member (``kv_transfer_config``'s members under ``kv_connector_extra_config``)."""
    out: dict[str, tuple[int, int]] = {}
    for key in merged:
        base = (*where, key) if key in raw else ("defaults", key)
        out[key] = src.position(base)
        value = merged[key]
        if key == "kv_transfer_config" and isinstance(value, dict):
            out[f"{key}.kv_connector"] = src.position((*base, "kv_connector"))
            base, value = (*base, "kv_connector_extra_config"), value.get("kv_connector_extra_config")
        if key in ("connector_config", "kv_transfer_config") and isinstance(value, dict) and \
                isinstance(value.get("connectors"), list):
            for i, member in enumerate(value["connectors"]):
                if isinstance(member, dict) and isinstance(member.get("kv_connector"), str):
                    out[f"{key}.member.{member['kv_connector']}"] = src.position((*base, "connectors", i,
                                                                                  "kv_connector"))
    return out


def _check_defaults(src: Located, defaults: dict[str, Any], diags: list[Diagnostic]) -> set[str]:
    """Check ``defaults`` once, located where they are written; returns the keys that are wrong (left out of
    every deployment, so one mistake is reported once)."""
    if not defaults:
        return set()
    probe = {"name": "defaults", **defaults}
    if not any(k in defaults for k in ("model", "spec", "groups")):
        probe["spec"] = _PROBE_SPEC  # a source is a deployment's own business
    try:
        Deployment.model_validate(probe)
    except ValidationError as exc:
        diags += located_validation_errors(src, ("defaults",), probe, exc, valid_keys=_keys_at)
        return {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
    return set()


@dataclass(frozen=True)
class FleetResult:
    """One deployment's outcome: a decision, a refusal (`NoLayoutError`) or an input error."""

    deployment: Deployment
    location: str
    profile: str | None
    decision: Decision | None = None
    error: PolicyError | None = field(default=None)
    context: Context | None = field(default=None, compare=False)  # built also for a refused deployment
    # the geometry check of the chosen layout, as dry-run's: None checked clean (or nothing to check), else
    # the verifier's refusal (views that write the same bytes) or why the layout has no plan here
    geometry: PolicyError | None = field(default=None, compare=False)
    # what reading its model config assumed: `ModelConfigWarning` lines, located in the config file
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def warnings(self) -> tuple[str, ...]:
        """The model config's notes, then the decision's warnings (none without a decision)."""
        return self.notes + (self.decision.warnings if self.decision is not None else ())

    @property
    def name(self) -> str:
        return self.deployment.name

    @property
    def status(self) -> str:
        """``decided``, ``unsafe`` (decided, but the verifier finds views writing the same bytes), ``refused``
        (no layout survives the rules) or ``invalid`` (the inputs are wrong)."""
        if self.decision is not None:
            return "unsafe" if isinstance(self.geometry, GeometryError) else "decided"
        return "refused" if isinstance(self.error, NoLayoutError) else "invalid"


def geometry_check(decision: Decision) -> PolicyError | None:
    """dry-run's check of the chosen layout: planned for one more block than layers (so a view assuming one
    page per block reaches across block 0's layers) and verified. None: clean, or no paged KV to check."""
    from kvpolicy.engine.plan import plan_layout
    from kvpolicy.engine.verify import refusal, verify_plan

    ctx = decision.context
    if not ctx.kv.kind.is_attention:
        return None
    try:
        plan = plan_layout(decision.layout, ctx.kv, ctx.backend, ctx.kv.num_layers + 1)
    except InputError as exc:  # decided as vLLM decides, but no plan (a dtype kvpolicy has no cells for, ...)
        return exc
    report = verify_plan(plan)
    return None if report.ok else refusal(plan, report)


RulesFor = Any  # Callable[[str], RuleSet]: the rule set of a profile name


def _refuse(location: str, fleet: Fleet, index: int) -> Refuse:
    """A connector vLLM would refuse makes the deployment invalid, located at the key that names it in the
    fleet file (``connector:``, a member in ``connector_config:``, or ``kv_transfer_config:``)."""
    dep = fleet.deployments[index][0]

    def refuse(member: bool, message: str, help: str) -> PolicyError:
        key = "kv_transfer_config" if dep.kv_transfer_config is not None else \
            "connector_config" if member else "connector"
        names = fleet.keys[index] if index < len(fleet.keys) else {}
        # the name itself: a member's `kv_connector`, or kv_transfer_config's (the message names it in backticks)
        exact = next((at for k, at in names.items() if k.startswith(f"{key}.member.")
                      and f"`{k.rsplit('.', 1)[1]}`" in message), None) if member else names.get(f"{key}.kv_connector")
        line, col = exact or fleet.key_at(index, key)
        return InputError(f"deployment at {location}: `{key}`",
                          [Diagnostic(shown_file(fleet.file), line, col, "unknown-connector", message, help)])
    return refuse


def decide_fleet(fleet: Fleet, rules_for: RulesFor, vllm_version: str | None = None) -> list[FleetResult]:
    """Decide every deployment, each under its release's profile (``vllm_version`` for those naming none)
    and ``rules_for(profile)``'s rules; never raises for one deployment's refusal or bad input, and raises
    `RuleLoadError` when a profile's rules do not load (once, not as every deployment's error)."""
    from kvpolicy.policy.releases import resolve_profile

    out = []
    for index, (dep, line) in enumerate(fleet.deployments):
        location = f"{shown_file(fleet.file)}:{line}"
        profile, ctx = None, None
        notes: list[str] = []
        try:
            profile = resolve_profile(dep.vllm_version or vllm_version)[0].name
        except PolicyError as exc:
            out.append(FleetResult(dep, location, None, None, exc))
            continue
        ruleset: RuleSet = rules_for(profile)  # rules that do not load are no deployment's fault: it raises
        try:
            with model_config_notes() as notes:
                ctx = context_for(dep, fleet.base_dir, profile)
            declared = out_of_tree_names(dep)
            notes += check_connector_names(ctx, ruleset, declared, _refuse(location, fleet, index))
            decision = LayoutEngine(ruleset, vllm_version=profile).decide(ctx).declaring(declared)
            out.append(FleetResult(dep, location, profile, decision, context=ctx, geometry=geometry_check(decision),
                                   notes=tuple(notes)))
        except PolicyError as exc:
            out.append(FleetResult(dep, location, profile, None, exc, ctx, notes=tuple(notes)))
    return out
