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

Where blocks move between deployments (prefill to decode, a store several deployments share), an
``exchanges:`` list says so::

    exchanges:
      - name: llama-pd
        deployments: [llama-prefill, llama-decode]     # 2 or more names of this file
        connector: NixlConnector                        # optional: default the deployments' own (the same)

and `exchange_answers` answers for every ordered pair (writer -> reader) of each exchange, by what the
connector moves (`transfer_unit`): a layer's logical ``[B, H, N, C]`` view, slot by slot (ExampleConnector:
the same `layer_view_digest`), or a block's raw bytes (every other connector: the same bytes, as is; these
connectors cannot transcode).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvpolicy.engine.agreement import Difference
from kvpolicy.engine.connector_names import Refuse, check_connector_names, out_of_tree_names
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.exchange import _DERIVED, compare_transfer, reconciled_differences, transfer_unit
from kvpolicy.engine.fingerprint import LayoutFingerprint
from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.engine.model_notes import model_config_notes
from kvpolicy.engine.policy_tests.cases import CaseInput, context_for
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import Diagnostic, GeometryError, InputError, NoLayoutError, PolicyError, shown_file
from kvpolicy.policy.files import read_capped
from kvpolicy.policy.near_names import nearest
from kvpolicy.policy.ruleset import RuleSet
from kvpolicy.policy.spec import Frozen
from kvpolicy.policy.validate import located_validation_errors
from kvpolicy.policy.yaml_source import Limits, Located, parse_yaml

__all__ = [
    "Deployment",
    "ExchangeAnswer",
    "Fleet",
    "FleetError",
    "FleetExchange",
    "FleetResult",
    "decide_deployment",
    "decide_fleet",
    "decide_in_fleet",
    "exchange_answers",
    "load_fleet",
    "own_connector",
]


class FleetError(PolicyError):
    """A fleet file that cannot be read or does not validate (every problem, located)."""


class Deployment(CaseInput):
    """One deployment: a name and the inputs a policy test case takes."""

    name: str = Field(min_length=1, description="unique within the fleet; shown in the report")
    description: str | None = Field(default=None, description="what the deployment serves (not read)")


class Exchange(Frozen):
    """Blocks move between these deployments (each writes, each reads) through one connector."""

    name: str = Field(min_length=1, description="unique among the exchanges; shown in the report")
    # at most 64: every ordered pair is answered (64 deployments: 4,032 pairs); a larger group is several exchanges
    deployments: list[str] = Field(min_length=2, max_length=64, description="the deployments, by name (2 to 64)")
    connector: str | None = Field(
        default=None, min_length=1, description="the connector that moves the blocks; default: the deployments' "
        "own, which must then be the same")
    description: str | None = Field(default=None, description="what moves, and why (not read)")


class _FleetHeader(Frozen):
    version: Literal[1] = Field(description="format version; currently 1")
    defaults: dict[str, Any] = Field(default_factory=dict, description="keys every deployment has unless it sets them")
    deployments: list[Any] = Field(min_length=1, description="the deployments")
    exchanges: list[Any] = Field(default_factory=list, description="where blocks move between deployments")


_DEPLOYMENT_KEYS = tuple(Deployment.model_fields)


def _keys_at(path: tuple[Any, ...]) -> tuple[str, ...]:
    if not path:
        return tuple(_FleetHeader.model_fields)
    if isinstance(path[-1], int) and len(path) >= 2 and path[-2] == "deployments":
        return _DEPLOYMENT_KEYS
    if isinstance(path[-1], int) and len(path) >= 2 and path[-2] == "exchanges":
        return tuple(Exchange.model_fields)
    if path[-1] == "defaults":
        return _DEPLOYMENT_KEYS
    return ()


@dataclass(frozen=True)
class FleetExchange:
    """A loaded exchange: its deployments, the connector that moves the blocks and where it is written."""

    name: str
    deployments: tuple[str, ...]
    connector: str
    connector_from: str  # "exchange" (its `connector:`) or "deployments" (their own, the same)
    line: int
    col: int = 1
    description: str | None = None

    @property
    def unit(self) -> str:
        return transfer_unit(self.connector)


@dataclass(frozen=True)
class Fleet:
    """A loaded fleet: its deployments with where each is written."""

    file: str
    deployments: tuple[tuple[Deployment, int], ...]  # (deployment, line)
    # per deployment, where each of its keys is written (line, col): its own, else the `defaults:` one
    keys: tuple[dict[str, tuple[int, int]], ...] = ()
    exchanges: tuple[FleetExchange, ...] = ()

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
    except ValidationError as exc:  # reported; the parts that are lists and mappings are still checked, so one
        # run lists every mistake of the file
        diags += located_validation_errors(src, (), src.data, exc, valid_keys=_keys_at)
        part = {k: src.data.get(k) for k in ("defaults", "deployments", "exchanges")}
        header = _FleetHeader.model_construct(
            version=1, defaults=part["defaults"] if isinstance(part["defaults"], dict) else {},
            deployments=part["deployments"] if isinstance(part["deployments"], list) else [],
            exchanges=part["exchanges"] if isinstance(part["exchanges"], list) else [])
    bad_defaults = _check_defaults(src, header.defaults, diags)
    out: list[tuple[Deployment, int]] = []
    keys: list[dict[str, tuple[int, int]]] = []
    seen: dict[str, int] = {}
    partial: dict[str, Deployment] = {}  # deployments with a wrong key, as far as they are right: for the exchanges
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
            wrong = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
            if isinstance(name, str) and not wrong & {"connector", "connector_config", "kv_transfer_config"}:
                partial[name] = Deployment.model_construct(**{k: v for k, v in merged.items()
                                                              if k in _DEPLOYMENT_KEYS and k not in wrong})
            continue
        keys.append(_key_positions(src, where, raw, merged))
    exchanges = _load_exchanges(src, header.exchanges, seen, {**partial, **{d.name: d for d, _ in out}}, diags)
    if diags:  # the file is refused: its valid deployments' own input errors too, so one run lists every mistake
        diags += _input_errors(shown, out, keys)
        raise FleetError(f"{len(diags)} error(s) in fleet file `{shown}`", diags)
    return Fleet(shown, tuple(out), tuple(keys), tuple(exchanges))


def _input_errors(shown: str, deps: list[tuple[Deployment, int]],
                  keys: list[dict[str, tuple[int, int]]]) -> list[Diagnostic]:
    """The input errors deciding would report for these deployments (a dtype or backend the release does not
    have, ...), each located at the key that sets it: said with the file's own mistakes when it is refused.
    A deployment that names no release is read in the default profile, as a fleet run would read it."""
    out: list[Diagnostic] = []
    base = Path(shown).parent
    for (dep, line), at in zip(deps, keys):
        try:
            with model_config_notes():
                context_for(dep, base, None)
        except PolicyError as exc:
            for d in exc.diagnostics:
                if d.line:  # located already (a model config's line)
                    out.append(d)
                    continue
                key = d.file.split(".", 1)[0].split("[", 1)[0]
                key_line, col = at.get(key, (line, 1))
                out.append(Diagnostic(shown_file(shown), key_line, col, d.code,
                                      f"deployment `{dep.name}`: {d.message}", d.help))
    return out


def own_connector(dep: Deployment) -> str | None:
    """The connector a deployment names (``connector``, or ``kv_transfer_config``'s ``kv_connector``)."""
    name = dep.kv_transfer_config.get("kv_connector") if dep.kv_transfer_config is not None else dep.connector
    return name if isinstance(name, str) and name.lower() != "none" else None


def _runs(dep: Deployment) -> set[str]:
    """The connectors a deployment's engine runs: its own, and a MultiConnector's members."""
    names = {n for n in (own_connector(dep),) if n}
    config = dep.kv_transfer_config.get("kv_connector_extra_config") if dep.kv_transfer_config else \
        dep.connector_config
    members = config.get("connectors") if isinstance(config, dict) else None
    return names | {m["kv_connector"] for m in members or [] if isinstance(m, dict)
                    and isinstance(m.get("kv_connector"), str)}


def _connector_names(deps: dict[str, Deployment]) -> set[str]:
    """Every connector name an exchange may name: those kvpolicy knows, every release's, the deployments' own."""
    from kvpolicy.policy.connectors import KNOWN_CONNECTORS
    from kvpolicy.policy.releases import get_profile, profile_names

    names = set(KNOWN_CONNECTORS).union(*(get_profile(p).connectors for p in profile_names()))
    for dep in deps.values():
        names |= _runs(dep)
    return names


def _load_exchanges(src: Located, raws: list[Any], names: dict[str, int], deps: dict[str, Deployment],
                    diags: list[Diagnostic]) -> list[FleetExchange]:
    """The ``exchanges:`` list checked, each problem located: keys, names of this file's deployments (each
    once), and the connector (known; or, not named, the deployments' own, the same for all)."""
    out: list[FleetExchange] = []
    seen: dict[str, int] = {}
    known: set[str] | None = None
    for i, raw in enumerate(raws):
        where = ("exchanges", i)
        line, col = src.position(where)
        if not isinstance(raw, dict):
            diags.append(src.diag(where, "not-a-mapping", "an exchange is a mapping",
                                  "give it a `name:` and its `deployments: [a, b]`"))
            continue
        try:
            ex = Exchange.model_validate(raw)
        except ValidationError as exc:
            diags += located_validation_errors(src, where, raw, exc, valid_keys=_keys_at)
            continue
        if ex.name in seen:
            diags.append(src.diag((*where, "name"), "duplicate-exchange",
                                  f"exchange `{ex.name}` is already defined at line {seen[ex.name]}",
                                  "give each exchange its own name"))
        else:
            seen[ex.name] = line
        ok = True
        for j, name in enumerate(ex.deployments):
            if name not in names:
                others = [n for n in names if n not in ex.deployments]  # not one this exchange names already
                near = next(iter(difflib.get_close_matches(name, others, n=1)), None) or nearest(name, others)
                listed = ", ".join(f"`{n}`" for n in list(names)[:8]) + (", ..." if len(names) > 8 else "")
                diags.append(src.diag((*where, "deployments", j), "unknown-deployment",
                                      f"exchange `{ex.name}`: no deployment `{name}` in this fleet",
                                      f"did you mean `{near}`?" if near
                                      else f"name deployments of this file: {listed}"))
                ok = False
            elif name in ex.deployments[:j]:
                diags.append(src.diag((*where, "deployments", j), "duplicate-deployment",
                                      f"exchange `{ex.name}` names deployment `{name}` twice",
                                      "name each deployment once: every ordered pair of them is checked"))
                ok = False
        if not ok or any(n not in deps for n in ex.deployments):  # a deployment that failed: reported already
            continue
        if ex.connector is not None:
            known = _connector_names(deps) if known is None else known
            if ex.connector not in known:
                from kvpolicy.policy.connectors import suggest_connector

                near = nearest(ex.connector, known) or suggest_connector(ex.connector)
                diags.append(src.diag((*where, "connector"), "unknown-connector",
                                      f"exchange `{ex.name}`: no KV connector `{ex.connector}`",
                                      (f"did you mean `{near}`? " if near else "") + "name the connector class "
                                      "that moves the blocks (NixlConnector, MooncakeStoreConnector, ExampleConnector, "
                                      "...), or leave `connector:` out for the deployments' own"))
                continue
            runs_other = {n: own_connector(deps[n]) for n in ex.deployments
                          if own_connector(deps[n]) is not None and ex.connector not in _runs(deps[n])}
            if runs_other:
                said = ", ".join(f"`{n}` runs {c}" for n, c in runs_other.items())
                diags.append(src.diag((*where, "connector"), "exchange-connector",
                                      f"exchange `{ex.name}` moves blocks through {ex.connector}, which not every "
                                      f"deployment runs ({said})",
                                      "a vLLM engine moves blocks only through the connector it runs: name that one "
                                      "(or a member of its MultiConnector), or declare it on the deployments"))
                continue
            out.append(FleetExchange(ex.name, tuple(ex.deployments), ex.connector, "exchange", line, col,
                                     ex.description))
            continue
        own = {n: own_connector(deps[n]) for n in ex.deployments}
        if len(set(own.values())) != 1 or None in own.values():
            said = ", ".join(f"`{n}` {c or 'none'}" for n, c in own.items())
            diags.append(src.diag((*where, "deployments"), "exchange-connector",
                                  f"exchange `{ex.name}` names no `connector:`, and its deployments' own are not one "
                                  f"connector ({said})",
                                  "name the connector that moves the blocks between them: `connector: "
                                  "MooncakeStoreConnector`, say"))
            continue
        out.append(FleetExchange(ex.name, tuple(ex.deployments), next(iter(own.values())) or "", "deployments",
                                 line, col, ex.description))
    return out


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
    version = defaults.get("vllm_version")
    if version is not None:  # a release no profile answers for: said once here, not on every deployment
        from kvpolicy.policy.releases import resolve_profile

        try:
            resolve_profile(version)
        except PolicyError as exc:
            d = exc.diagnostics[0] if exc.diagnostics else None
            diags.append(src.diag(("defaults", "vllm_version"), d.code if d else "unknown-vllm-version",
                                  d.message if d else exc.message, d.help if d else None))
            return {"vllm_version"}
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


def _refuse_by_key(dep: Deployment) -> Refuse:
    """A connector vLLM would refuse, named by the key that names it (a deployment read from no file)."""
    def refuse(member: bool, message: str, help: str) -> PolicyError:
        key = "kv_transfer_config" if dep.kv_transfer_config is not None else \
            "connector_config" if member else "connector"
        return InputError(f"`{key}`", [Diagnostic(key, 0, 0, "unknown-connector", message, help)])
    return refuse


def decide_deployment(dep: Deployment, base_dir: Path, rules_for: RulesFor, vllm_version: str | None = None, *,
                      location: str = "", refuse: Refuse | None = None) -> FleetResult:
    """One deployment decided as `decide_fleet` decides each (its context, the release's connector checks,
    the chosen layout's geometry check), a ``model`` read relative to ``base_dir``; never raises for its
    refusal or bad input. ``refuse`` places a connector the release does not register (default: by key)."""
    from kvpolicy.policy.releases import resolve_profile

    profile, ctx = None, None
    notes: list[str] = []
    try:
        profile = resolve_profile(dep.vllm_version or vllm_version)[0].name
    except PolicyError as exc:
        return FleetResult(dep, location, None, None, exc)
    ruleset: RuleSet = rules_for(profile)  # rules that do not load are no deployment's fault: it raises
    try:
        with model_config_notes() as notes:
            ctx = context_for(dep, base_dir, profile)
        declared = out_of_tree_names(dep)
        notes += check_connector_names(ctx, ruleset, declared, refuse or _refuse_by_key(dep))
        decision = LayoutEngine(ruleset, vllm_version=profile).decide(ctx).declaring(declared)
        _ = decision.fingerprint  # its kernel order may refuse the cache (cpu-kernel-refuses): as dry-run says it
        return FleetResult(dep, location, profile, decision, context=ctx, geometry=geometry_check(decision),
                           notes=tuple(notes))
    except PolicyError as exc:
        return FleetResult(dep, location, profile, None, exc, ctx, notes=tuple(notes))


def decide_fleet(fleet: Fleet, rules_for: RulesFor, vllm_version: str | None = None) -> list[FleetResult]:
    """Decide every deployment, each under its release's profile (``vllm_version`` for those naming none)
    and ``rules_for(profile)``'s rules; never raises for one deployment's refusal or bad input, and raises
    `RuleLoadError` when a profile's rules do not load (once, not as every deployment's error)."""
    out = []
    for index, (dep, line) in enumerate(fleet.deployments):
        location = f"{shown_file(fleet.file)}:{line}"
        out.append(decide_deployment(dep, fleet.base_dir, rules_for, vllm_version, location=location,
                                     refuse=_refuse(location, fleet, index)))
    return out


def decide_in_fleet(fleet: Fleet, index: int, rules_for: RulesFor, vllm_version: str | None = None,
                    dep: Deployment | None = None) -> FleetResult:
    """Deployment ``index`` of ``fleet`` decided as `decide_fleet` decides it; ``dep``: that deployment with keys
    changed (a connector the release refuses is then named by its key, not placed in the file)."""
    location = f"{shown_file(fleet.file)}:{fleet.deployments[index][1]}"
    return decide_deployment(dep or fleet.deployments[index][0], fleet.base_dir, rules_for, vllm_version,
                             location=location, refuse=None if dep is not None else _refuse(location, fleet, index))


# ---------------------------------------------------------------------------------------------
# Exchanges: whether the blocks one deployment writes are what another reads


# what a deployment sets to change a fingerprint field (a field of a group: its own name)
_KEY_OF_FIELD = {
    "block_size": "block_size", "kv_cache_dtype": "kv_cache_dtype", "quant_mode": "kv_cache_dtype",
    "cache_dtype": "kv_cache_dtype` or `dtype", "scale_placement": "kv_cache_dtype", "scale_dtype": "kv_cache_dtype",
    "scale_bytes": "kv_cache_dtype", "scale_offset": "kv_cache_dtype", "cell_bytes": "kv_cache_dtype",
    "kernel_order": "cpu", "num_kv_heads": "tensor_parallel_size", "head_size": "model", "num_layers": "model",
    "kind": "model", "kv_factor": "model", "attention_groups": "model", "groups": "model",
    "backend": "attention_backend", "code_dtype": "attention_backend", "logical_dims": "attention_backend",
    "placement": "vllm_kv_cache_layout", "head_order": "vllm_kv_cache_layout",
    "physical_dims": "vllm_kv_cache_layout", "format_version": "vllm_version",
}


def advice(fields: tuple[str, ...] | list[str]) -> str:
    """What to change for blocks to move: the deployment keys behind the differing fingerprint fields."""
    keys = list(dict.fromkeys(_KEY_OF_FIELD.get(f.rsplit(".", 1)[-1].split("[", 1)[0], "model") for f in fields
                              if f.rsplit(".", 1)[-1] not in _DERIVED))
    if not keys:
        return "give both the same deployment keys"
    said = ", ".join(f"`{k}`" for k in keys)
    text = f"give both deployments the same {said}"
    if "vllm_kv_cache_layout" in keys:
        text += " (one layout for both: the same release, backend and connector, or `vllm_kv_cache_layout`)"
    if "cpu" in keys:
        text += " (CPU_ATTN's kernel order follows the host CPU, the block size, the dtypes and the head size)"
    return text


@dataclass(frozen=True)
class ExchangeAnswer:
    """One ordered pair of an exchange: whether blocks ``writer`` writes are what ``reader`` reads."""

    exchange: FleetExchange
    location: str  # "file:line" of the exchange
    writer: str
    reader: str
    answer: str  # as_is | refused | unknown (a side decides no layout)
    differences: tuple[Difference, ...] = ()
    reason: str = ""

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(d.field for d in self.differences)

    @property
    def change(self) -> str:
        return advice(self.fields) if self.answer == "refused" else ""

    def say(self) -> str:
        """One line: the answer, with every differing field and why."""
        if self.answer == "as_is":  # with the differences the connector reconciles itself, when there are some
            return "as is" + (f" ({self.reason}: {'; '.join(str(d) for d in self.differences)})"
                              if self.differences else "")
        if self.answer == "unknown":
            return f"unknown: {self.reason}"
        fields = "; ".join(str(d) for d in self.differences)
        return f"refused: {self.reason}" + (f": {fields}" if fields else "")

    def to_dict(self) -> dict[str, Any]:
        ex = self.exchange
        return {"exchange": ex.name, "location": self.location, "connector": ex.connector,
                "connector_from": ex.connector_from, "unit": ex.unit, "writer": self.writer, "reader": self.reader,
                "answer": self.answer, "differences": [str(d) for d in self.differences], "fields": list(self.fields),
                "reason": self.reason, "change": self.change or None}


def _fingerprint(result: FleetResult) -> tuple[LayoutFingerprint | None, str]:
    if result.decision is None:
        error = result.error
        first = error.diagnostics[0].message if error is not None and error.diagnostics else \
            (error.message if error is not None else "")
        return None, f"`{result.name}` decides no layout ({result.status}: {first})"
    try:
        return result.decision.fingerprint, ""
    except PolicyError as exc:
        return None, f"`{result.name}` has no fingerprint ({exc.diagnostics[0].message if exc.diagnostics else exc})"


def exchange_answers(fleet: Fleet, results: list[FleetResult]) -> list[ExchangeAnswer]:
    """Every ordered pair (writer -> reader) of every exchange of ``fleet``, answered from ``results``
    (`decide_fleet`'s): ``as_is``, ``refused`` (naming every differing field) or ``unknown`` (a side decides
    no layout: why)."""
    by_name = {r.name: r for r in results}
    out: list[ExchangeAnswer] = []
    for ex in fleet.exchanges:
        location = f"{shown_file(fleet.file)}:{ex.line}"
        prints = {n: _fingerprint(by_name[n]) for n in ex.deployments}
        for writer in ex.deployments:
            for reader in ex.deployments:
                if writer == reader:
                    continue
                (wfp, wwhy), (rfp, rwhy) = prints[writer], prints[reader]
                if wfp is None or rfp is None:
                    out.append(ExchangeAnswer(ex, location, writer, reader, "unknown",
                                              reason="; ".join(w for w in (wwhy, rwhy) if w)))
                    continue
                kind, diffs, why = compare_transfer(ex.connector, wfp, rfp, writer, reader)
                if kind == "as_is":  # NIXL across TP sizes: as is, and what differs that it reconciles is said
                    diffs, why = reconciled_differences(ex.connector, wfp, rfp, writer, reader)
                out.append(ExchangeAnswer(ex, location, writer, reader, kind, diffs, why))
    return out
