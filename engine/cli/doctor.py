"""``kvpolicy doctor``: check the vLLM plugin's setup before starting vLLM.

What the plugin does at start-up, step by step, without vLLM: read its settings (``KVPOLICY_*`` in the
environment), load the rule directories as it would (fail-closed), pick the release profile for the
installed vLLM (read from package metadata, never imported) or for ``--vllm-version``, and decide the
deployment given by dry-run's flags (default: the built-in example), printing the log line the plugin
would print. Every problem found is reported, located, in one run.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.engine.cli.common import EXIT_FAILED, EXIT_OK, HelpFormatter, add_format_flag, print_json
from kvpolicy.policy.errors import Diagnostic, PolicyError

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  kvpolicy doctor                                   # the settings in this environment, the built-in example
  KVPOLICY_RULES=shipped kvpolicy doctor --vllm-version 0.34.0
  KVPOLICY_RULES=my-rules/ kvpolicy doctor --vllm-version 0.28.0 --spec spec.yaml --connector NixlConnector
  kvpolicy doctor --format json | jq .ok

checks, in the plugin's order: the settings (KVPOLICY_RULES, KVPOLICY_SHIPPED_RULES,
KVPOLICY_EXPLAIN, KVPOLICY_VLLM_VERSION, KVPOLICY_UNSTAMPED_BLOCKS), the rule directories (loaded as the plugin
loads them), the release profile (--vllm-version, else the one the plugin picks for the
installed vLLM), and the decision for the deployment (the same flags as dry-run)

exit codes: 0 the plugin would start (or is off: KVPOLICY_RULES unset) and decide, 1 a check
failed (every problem listed, located), 2 usage error
"""

_VARIABLES = ("KVPOLICY_RULES", "KVPOLICY_SHIPPED_RULES", "KVPOLICY_EXPLAIN", "KVPOLICY_VLLM_VERSION",
              "KVPOLICY_VLLM_PROFILE", "KVPOLICY_UNSTAMPED_BLOCKS", "KVPOLICY_TODAY")


def register(verbs: argparse._SubParsersAction) -> None:
    from kvpolicy.engine.cli.dry_run import add_deployment_flags

    p = verbs.add_parser(
        "doctor", help="check the vLLM plugin's settings, rules, profile and decision without starting vLLM",
        description="Check what the vLLM plugin would do at start-up, without vLLM: its KVPOLICY_* settings, "
                    "its rule directories, the release profile it would pick for the installed vLLM (or for "
                    "--vllm-version), and the layout it would decide for a deployment (dry-run's flags).",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    add_deployment_flags(p)
    for action in p._actions:  # the profile is chosen here as the plugin chooses it, not by the CLI's default
        if action.dest == "vllm_version":
            action.dest = "doctor_vllm_version"
    add_format_flag(p)
    p.set_defaults(run=run)


@dataclass
class Checkup:
    """What doctor found, check by check; ``problems`` are every located error."""

    settings: dict[str, str | None] = field(default_factory=dict)
    active: bool = False
    vllm: dict[str, Any] = field(default_factory=dict)
    profile: str | None = None
    rules: dict[str, Any] | None = None
    decision: dict[str, Any] | None = None
    lines: list[str] = field(default_factory=list)
    problems: list[Diagnostic] = field(default_factory=list)
    warnings: list[Diagnostic] = field(default_factory=list)  # nothing fails now; something will, once ...

    def fail(self, exc: PolicyError) -> None:
        self.problems += exc.diagnostics or [Diagnostic("kvpolicy", 0, 0, "error", exc.message)]
        self.lines.append(f"  error: {exc.message or exc.diagnostics[0].message}")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": not self.problems, "active": self.active, "settings": self.settings, "vllm": self.vllm,
                "profile": self.profile, "rules": self.rules, "decision": self.decision,
                "problems": [d.to_dict() for d in self.problems],
                "warnings": [d.to_dict() for d in self.warnings]}


def _installed() -> dict[str, Any]:
    from kvpolicy.policy.releases import installed_vllm_distribution

    found = installed_vllm_distribution()
    return {"installed": found is not None, "distribution": found.distribution if found else None,
            "version": found.version if found else None}


def _settings(c: Checkup) -> Any:
    """The plugin's settings, every bad one reported: the plugin stops at the first, so each bad variable
    is reported and left out in turn (as if unset) until the rest read, and the checks go on with those."""
    from kvpolicy.engine.integrations import vllm_plugin as plugin

    env = dict(os.environ)
    for _ in range(len(_VARIABLES) + 1):
        try:
            return plugin.Settings.from_env(env)
        except PolicyError as exc:
            c.fail(exc)
            variable = exc.diagnostics[0].file if exc.diagnostics else None
            if variable == plugin.ENV_RULES or variable not in env:  # nothing left to read the rules with
                return None
            env.pop(variable)
    return None


def _dormant_settings(c: Checkup) -> None:
    """While the plugin is off it reads no other variable; one that is set but would stop vLLM once
    KVPOLICY_RULES is set is said now, as a warning (nothing fails today)."""
    from kvpolicy.engine.integrations import vllm_plugin as plugin

    env = {**os.environ, plugin.ENV_RULES: plugin.SHIPPED}
    for _ in range(len(_VARIABLES)):
        try:
            plugin.Settings.from_env(env)
            return
        except PolicyError as exc:
            d = exc.diagnostics[0] if exc.diagnostics else None
            variable = d.file if d is not None else None
            if d is not None:
                c.warnings.append(d)
            c.lines.append(f"  warning: {variable}: {d.message if d else exc.message} (ignored while the plugin "
                           f"is off; vLLM would not start with it once {plugin.ENV_RULES} is set)")
            if variable not in env:
                return
            env.pop(variable)


def _plugin_warnings(args: argparse.Namespace, settings: Any, installed: str | None) -> list[Diagnostic]:
    """What the plugin would warn about at start-up (`vllm_plugin.startup_warnings`), at the setting that makes
    it: for the installed vLLM, or for --vllm-version as if the plugin were told it (a patch release no
    profile lists takes its series' profile)."""
    from kvpolicy.engine.integrations import vllm_plugin as plugin
    from kvpolicy.policy.releases import resolve_profile

    if settings is None:
        return []
    deprecated = f"{plugin.ENV_PROFILE} is deprecated"
    if not args.doctor_vllm_version:
        said = plugin.startup_warnings(installed or "", settings)
        where = settings.profile_variable if settings.profile else "vLLM"
    else:
        said = [w for w in plugin.startup_warnings("", settings) if w.startswith(deprecated)]
        note = resolve_profile(args.doctor_vllm_version)[1]
        said += [f"--vllm-version {args.doctor_vllm_version}: {note}"] if note else []
        where = "--vllm-version"
    return [Diagnostic(plugin.ENV_PROFILE, 0, 0, "deprecated-setting", w) if w.startswith(deprecated)
            else Diagnostic(where, 0, 0, "series-profile", w) for w in said]


def checkup(args: argparse.Namespace) -> Checkup:
    """Every check the plugin makes at start-up, in its order, for this environment and these flags."""
    from kvpolicy.engine.integrations import vllm_plugin as plugin
    from kvpolicy.policy.releases import get_profile, profile_names

    c = Checkup(settings={name: os.environ.get(name) for name in _VARIABLES})
    c.lines.append("settings:")
    for name, value in c.settings.items():
        c.lines.append(f"  {name}={value}" if value is not None else f"  {name}: unset")
    settings = _settings(c)
    if settings is not None and settings.rules is None:
        c.lines.append(f"the plugin is off: {plugin.ENV_RULES} is not set (or is off), so vLLM decides the KV cache "
                       f"layout as without kvpolicy; set {plugin.ENV_RULES}=shipped or to your rule directory")
        _dormant_settings(c)
        return c
    c.active = settings is not None
    c.vllm = _installed()
    c.lines.append("vLLM: " + (f"{c.vllm['version']} ({c.vllm['distribution']}, from its package metadata; not "
                               "imported)" if c.vllm["installed"] else "not installed here"))
    profile = None
    forced = args.doctor_vllm_version or (settings.profile if settings else None)
    try:
        if forced:
            profile = plugin.pick_profile("", forced, "--vllm-version" if args.doctor_vllm_version
                                          else (settings.profile_variable if settings else plugin.ENV_VERSION))
        elif c.vllm["installed"]:
            profile = plugin.pick_profile(c.vllm["version"])
            if profile is None:
                c.problems.append(plugin._unprofiled(c.vllm["version"]))
                c.lines.append(f"  error: no release profile decides for vLLM {c.vllm['version']}")
        else:
            c.lines.append(f"  (the plugin runs inside vLLM; checking against the newest profile, "
                           f"{profile_names()[0]}: pass --vllm-version for the release you will run)")
            profile = get_profile(profile_names()[0])
    except PolicyError as exc:
        c.fail(exc)
    if profile is not None:
        c.profile = profile.name
        hook = "resolve_kv_cache_layout" if profile.resolver.value == "kv_cache_layout" else "use_uniform_kv_cache"
        c.lines.append(f"profile: {profile.name} ({profile.version_label}), answering vLLM's {hook}")
        plugin_warnings = _plugin_warnings(args, settings, c.vllm.get("version"))
        c.warnings += plugin_warnings
        c.lines += [f"  warning: {d.message}" for d in plugin_warnings]
    if settings is None:
        return c
    checked = profile or get_profile(profile_names()[0])
    try:
        engine = plugin._engine(settings, checked)
    except PolicyError as exc:
        c.lines.append(f"rules: {settings.rules} do not load")
        c.fail(exc)
        return c
    c.rules = {"root": engine.ruleset.root, "digest": engine.ruleset.digest,
               "layers": [layer.to_dict() for layer in engine.ruleset.layers],
               "warnings": [d.to_dict() for d in engine.ruleset.warnings]}
    rules = engine.ruleset
    c.lines.append(f"rules: {rules.root}: {len(rules.all_rules)} rules, digest {rules.digest}")  # audit ones too
    from kvpolicy.policy.layers import render_warning

    c.lines += ["  " + render_warning(d).replace("\n", "\n  ") for d in engine.ruleset.warnings]
    if profile is None:
        return c
    _decide(c, engine, args, profile.name, settings.explain)
    return c


def _decide(c: Checkup, engine: Any, args: argparse.Namespace, profile: str, explain: bool) -> None:
    from kvpolicy.engine.cli.dry_run import context_from_args, is_example
    from kvpolicy.engine.integrations.vllm_plugin import decided_by
    from kvpolicy.engine.model_notes import model_config_notes

    args.vllm_version = profile
    notes: list[str] = []
    try:
        with model_config_notes() as notes:  # what reading --model assumed: said as dry-run says it
            ctx = context_from_args(args)
        decision = engine.decide(ctx)
    except PolicyError as exc:
        c.lines.append("decision: none")
        c.lines += [f"  {n}" for n in notes]
        c.fail(exc)
        return
    what = " (the built-in example: pass --model or --spec for your deployment)" if is_example(args) else ""
    c.decision = {"layout": str(decision.layout), "placement": decision.layout.placement.value,
                  "head_order": decision.layout.head_order.value, "decided_by": decided_by(decision),
                  "fingerprint": decision.fingerprint.digest, "warnings": [*notes, *decision.warnings]}
    c.lines.append(f"decision{what}: {decision.layout} ({decision.layout.placement.value}, "
                   f"{decision.layout.head_order.value}) decided by {decided_by(decision)}")
    c.lines.append(f"  fingerprint {decision.fingerprint.digest}")
    store = _stamped_store(decision)
    if store is not None:
        c.decision["store_folder"] = store
        c.lines.append(f"  ExampleConnector keeps this engine's blocks in {store} (the stamp's folder: engines "
                       "whose blocks mean the same bytes share it)")
    c.lines += [f"  {n}".replace("\n", "\n  ") for n in notes]
    c.lines += [f"  warning: {w}" for w in decision.warnings]
    if explain:
        c.lines.append(decision.explain())


def _stamped_store(decision: Any) -> str | None:
    """Where the guarded ExampleConnector (itself or a MultiConnector's member) keeps this engine's entries:
    its ``shared_storage_path`` and the stamp's folder; None for any other connector."""
    from kvpolicy.engine.integrations.vllm_exchange import stamp_of

    stack = [decision.context.connector] if decision.context.connector is not None else []
    while stack:
        connector = stack.pop()
        if connector.name == "ExampleConnector":
            root = connector.extra.get("shared_storage_path", "/tmp")  # vLLM's default
            return f"{str(root).rstrip('/')}/{stamp_of(decision.fingerprint).namespace}/"
        stack.extend(connector.connectors)
    return None


def run(args: argparse.Namespace) -> int:
    c = checkup(args)
    if args.format == "json":
        print_json(c.to_dict())
    else:
        print("\n".join(c.lines))
        if c.problems:
            from kvpolicy.policy.errors import RuleLoadError

            print()
            print(RuleLoadError(f"{len(c.problems)} problem(s): vLLM would not start with the plugin",
                                c.problems).render())
        else:
            print("ok: " + ("the plugin would start and decide as above" if c.active
                            else "nothing to check while the plugin is off"))
    return EXIT_FAILED if c.problems else EXIT_OK
