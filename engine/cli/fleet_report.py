"""``kvpolicy dry-run --fleet FILE`` and ``kvpolicy diff OLD NEW --fleet FILE``: a fleet of deployments at once.

dry-run: one report for every deployment of the fleet file (`kvpolicy.engine.fleet`): its decision
(with dry-run's geometry check: ``unsafe`` when views of the chosen layout write the same bytes),
its refusal (no layout survives, with the rules that removed the candidates) or its input error,
then the audit findings and other warnings, the answer for every ordered pair of each exchange (the
fleet's ``exchanges:``: whether the blocks one deployment writes are what another reads, through the
exchange's connector), and the time it took; as text, JSON or JUnit XML (a deployment is a test case;
a refusal or bad input a failure; an exchange's pair a test case of a second suite). Exit 1 when some
deployment is unsafe, refused or invalid, or an exchange's pair is refused. diff: each deployment decided
with both rule stacks, each under its own release's shipped rules; the deployments whose decision
changes, with the rules that removed the old layout on the new side. Exit 1 when some decision changes.
"""

from __future__ import annotations

import argparse
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    load_ruleset,
    print_json,
    report_error,
    say_fleet_default,
    usage_error,
)
from kvpolicy.engine.cli.test_reports import xml_document
from kvpolicy.policy.errors import PolicyError, RuleLoadError

if TYPE_CHECKING:  # engine.fleet builds the case models (~30 ms): imported when a fleet is read, not per CLI start
    from kvpolicy.engine.fleet import ExchangeAnswer, Fleet, FleetResult
    from kvpolicy.policy.ruleset import RuleSet

__all__ = ["add_fleet_flag", "falls_back", "open_fleet", "result_dict", "rule_warnings", "rules_for", "run_fleet",
           "run_fleet_diff"]

# dry-run flags that describe one deployment: the fleet file describes each instead
FLEET_SUITE = "kvpolicy fleet"  # the JUnit report's name, its error document's too

_ONE_DEPLOYMENT = (
    "model", "spec", "dtype", "serve_args", "kv_cache_dtype", "block_size", "tensor_parallel_size", "backend",
    "worker_attention_backends", "scale_views", "connector", "connector_config", "kv_transfer_config",
    "connector_module_path", "connector_prefers_cross_layer_blocks", "vllm_kv_cache_layout",
    "enable_extensible_kv_cache", "hisparse", "cpu",
    "use_v2_model_runner", "allow_chunked_local_attn_with_hybrid_kv_cache", "disable_hybrid_kv_cache_manager",
    "disable_sliding_window",
    "device", "device_capability", "num_blocks", "map_layout", "svg", "record_test",
)


def add_fleet_flag(parser: argparse.ArgumentParser, *, dry_run: bool) -> None:
    """``--fleet FILE`` on dry-run (which also gets ``--format junit``) or diff."""
    parser.add_argument("--fleet", metavar="FILE", default=None,
                        help="a fleet file of deployments (docs/cli.md): decide each of them, one report" if dry_run
                        else "compare the two rule stacks over the deployments of this fleet file, each under its "
                             "own release, instead of over the profile's space")
    if dry_run:
        fmt = next(a for a in parser._actions if a.dest == "format")
        fmt.choices = (*fmt.choices, "junit")  # type: ignore[operator]
        fmt.help = (fmt.help or "") + "; junit (with --fleet): JUnit XML, a test case per deployment"


def rules_for(args: argparse.Namespace, layers: list[str], flag: str) -> Callable[[str], RuleSet]:
    """The rule stack of each release profile a fleet uses (the shipped rules unless --no-shipped-rules, then
    ``layers``), each loaded once."""
    cache: dict[str, RuleSet] = {}

    def rules(profile: str) -> RuleSet:
        if profile not in cache:
            cache[profile] = load_ruleset(layers, flag, vllm_version=profile, shipped_rules=not args.no_shipped_rules)
            said = args.__dict__.setdefault("rule_warnings", {})  # printed on stderr as loaded; JSON carries them
            said.update({d.render(): d.to_dict() for d in cache[profile].warnings})
        return cache[profile]

    return rules


def rule_warnings(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The warnings of every rule stack `rules_for` loaded (each once), as JSON: the text prints them on stderr."""
    return list(getattr(args, "rule_warnings", {}).values())


def _removed(result: FleetResult) -> dict[str, list[str]]:
    d = result.decision
    if d is None:
        return {}
    return {str(layout): sorted({r.id for r, _ in hits}) for layout, hits in d.eliminated.items()}


def result_dict(result: FleetResult) -> dict[str, Any]:
    """One deployment in the JSON report."""
    d = result.decision
    out: dict[str, Any] = {"name": result.name, "location": result.location, "profile": result.profile,
                           "status": result.status}
    if d is not None:
        out |= {"backend": d.context.backend.name, "layout": str(d.layout), "placement": d.layout.placement.value,
                "head_order": d.layout.head_order.value,
                "score": d.score, "removed": _removed(result), "warnings": list(result.warnings),
                "audit": [f.to_dict() for f in d.audit], "fingerprint": d.fingerprint.digest, "error": None,
                "geometry": None if result.geometry is None else _error(result.geometry)}
    else:
        out |= {"backend": None if result.context is None else result.context.backend.name, "layout": None,
                "warnings": list(result.warnings), "audit": [], "error": _error(result.error), "geometry": None}  # type: ignore[arg-type]
    return out


def _error(exc: PolicyError) -> dict[str, Any]:
    return {"kind": type(exc).__name__, "message": exc.message, "diagnostics": [x.to_dict() for x in exc.diagnostics]}


def _what(result: FleetResult) -> str:
    dep = result.deployment
    if dep.model is not None:
        return dep.model.rsplit("/", 1)[-1].removesuffix(".json").removesuffix("/config")
    return "groups" if dep.groups is not None else "spec"


def _outcome(result: FleetResult) -> str:
    d = result.decision
    if d is not None:
        unsafe = " UNSAFE: views write the same bytes" if result.status == "unsafe" else ""
        return f"{d.layout} ({d.layout.placement.value}, {d.layout.head_order.value}){unsafe}"
    if result.status == "refused":
        return "refused: no layout survives"
    first = result.error.diagnostics[0] if result.error and result.error.diagnostics else None  # type: ignore[union-attr]
    return "invalid: " + (f"error[{first.code}]" if first else "input error")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def exchanges_text(answers: list[ExchangeAnswer]) -> list[str]:
    """The exchanges section: each exchange with its connector and what it moves, then each ordered pair."""
    lines: list[str] = []
    shown = None
    for a in answers:
        if a.exchange is not shown:
            shown = a.exchange
            ex = a.exchange
            said = "" if ex.connector_from == "exchange" else " (the deployments' own)"
            unit = "layer views (the same layer_view_digest)" if ex.unit == "layer_view" else \
                "raw blocks (as is only: it cannot transcode)"
            lines.append(f"  {ex.name} ({a.location}): {ex.connector}{said} moves {unit}")
        lines.append(f"    {a.writer} -> {a.reader}: {a.say()}")
        if a.change:
            lines.append(f"      help: {a.change}")
    return lines


def render_text(file: str, results: list[FleetResult], seconds: float,
                answers: list[ExchangeAnswer] | None = None) -> str:
    counts = _counts(results)
    releases = sorted({r.profile for r in results if r.profile})
    unsafe = f", {counts['unsafe']} unsafe" if counts["unsafe"] else ""
    lines = [f"fleet {file}: {len(results)} deployments over {len(releases)} release profile(s): "
             f"{counts['decided']} decided{unsafe}, {counts['refused']} refused, {counts['invalid']} invalid", ""]
    rows = [["NAME", "RELEASE", "MODEL", "BACKEND", "KV DTYPE", "CONNECTOR", "LAYOUT"]]
    for r in results:
        dep = r.deployment
        backend = r.context.backend.name if r.context is not None else "?"
        rows.append([r.name, r.profile or "?", _what(r), backend, dep.kv_cache_dtype or "auto",
                     dep.connector or ("(kv_transfer_config)" if dep.kv_transfer_config else "-"), _outcome(r)])
    lines += _table(rows)
    bad = [r for r in results if r.status != "decided"]
    if bad:
        lines += ["", "unsafe, refused and invalid:" if counts["unsafe"] else "refused and invalid:"]
        for r in bad:
            lines.append(f"  {r.name} ({r.location}):")
            why = r.geometry if r.status == "unsafe" else r.error
            lines += ["    " + line for line in why.render().splitlines()]  # type: ignore[union-attr]
    warned = [(r, w) for r in results for w in r.warnings]
    warned += [(r, f"decided as the release decides, but not planned: {r.geometry.diagnostics[0].message}")
               for r in results if r.decision is not None and r.status == "decided" and r.geometry is not None
               and r.geometry.diagnostics]
    if warned:
        lines += ["", "warnings:"]
        lines += [f"  {r.name}: {w}".replace("\n", "\n    ") for r, w in warned]
    if answers:
        refused = sum(a.answer == "refused" for a in answers)
        unknown = sum(a.answer == "unknown" for a in answers)
        lines += ["", f"exchanges: {len(answers)} ordered pair(s): {len(answers) - refused - unknown} as is, "
                  f"{refused} refused, {unknown} unknown"]
        lines += exchanges_text(answers)
    lines += ["", f"{len(results)} deployments decided in {seconds:.2f}s"]
    return "\n".join(lines)


def _counts(results: list[FleetResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in ("decided", "unsafe", "refused", "invalid")}


def junit_xml(file: str, results: list[FleetResult], seconds: float,
              answers: list[ExchangeAnswer] | None = None) -> str:
    """The fleet as JUnit XML: a testsuite with a testcase per deployment, a failure per unsafe, refused or
    invalid one; with exchanges, a second testsuite with a testcase per ordered pair, a failure per refused
    one (an unknown one is skipped: its deployment's own failure says why)."""
    bad = [r for r in results if r.status != "decided"]
    answers = answers or []
    refused = [a for a in answers if a.answer == "refused"]
    root = ET.Element("testsuites", name=FLEET_SUITE, tests=str(len(results) + len(answers)),
                      failures=str(len(bad) + len(refused)), errors="0", time=f"{seconds:.3f}")
    suite = ET.SubElement(root, "testsuite", name=file, tests=str(len(results)), failures=str(len(bad)),
                          errors="0", skipped="0", time=f"{seconds:.3f}")
    for r in results:
        line = r.location.rsplit(":", 1)[1]
        case = ET.SubElement(suite, "testcase", name=r.name, classname=r.profile or "fleet", file=file, line=line,
                             time="0")
        if r.status != "decided":
            failure = ET.SubElement(case, "failure", message=_outcome(r), type=r.status)
            failure.text = "\n".join([*r.notes, (r.geometry if r.status == "unsafe"  # type: ignore[union-attr]
                                                   else r.error).render()])
        else:
            out = ET.SubElement(case, "system-out")
            out.text = "\n".join([f"layout: {_outcome(r)}", *r.warnings])
    if answers:
        suite = ET.SubElement(root, "testsuite", name=f"{file} exchanges", tests=str(len(answers)),
                              failures=str(len(refused)), errors="0",
                              skipped=str(sum(a.answer == "unknown" for a in answers)), time="0")
        for a in answers:
            case = ET.SubElement(suite, "testcase", name=f"{a.writer} -> {a.reader}",
                                 classname=f"exchange.{a.exchange.name}", file=file, line=str(a.exchange.line),
                                 time="0")
            if a.answer == "refused":
                failure = ET.SubElement(case, "failure", message=a.say(), type="exchange-refused")
                failure.text = "\n".join([a.say(), f"help: {a.change}"])
            elif a.answer == "unknown":
                ET.SubElement(case, "skipped", message=a.reason)
    return xml_document(root)


def run_fleet(args: argparse.Namespace) -> int:
    """``dry-run --fleet FILE``."""
    if args.fleet is None:
        raise usage_error("--format", "`junit` is a fleet report", "pass --fleet FILE, or --format text/json")
    given = [name for name in _ONE_DEPLOYMENT if getattr(args, name, None) not in (None, False, [])]
    if given or args.map:
        flag = "--" + (given[0] if given else "map").replace("_", "-")
        raise usage_error(flag, f"{flag} describes one deployment; the fleet file describes each of them",
                          "set it in the fleet file (on a deployment, or under `defaults:`)")
    from kvpolicy.engine.fleet import decide_fleet, exchange_answers

    fleet = open_fleet(args)
    if fleet is None:
        return EXIT_USAGE
    start = time.perf_counter()
    try:
        results = decide_fleet(fleet, rules_for(args, list(args.rules or []), "--rules"), args.vllm_version)
    except RuleLoadError as exc:
        report_error(exc, args.format, FLEET_SUITE)  # in the format asked for: a CI report, never an empty one
        return EXIT_FAILED
    answers = exchange_answers(fleet, results)
    seconds = time.perf_counter() - start
    if args.format == "json":
        counts = _counts(results)
        print_json({"fleet": args.fleet, "summary": {"deployments": len(results), **counts,
                                                     "seconds": round(seconds, 3)},
                    "deployments": [result_dict(r) for r in results],
                    "exchanges": [a.to_dict() for a in answers], "warnings": rule_warnings(args)})
    elif args.format == "junit":
        print(junit_xml(args.fleet, results, seconds, answers))
    else:
        print(render_text(args.fleet, results, seconds, answers))
    ok = all(r.status == "decided" for r in results) and not any(a.answer == "refused" for a in answers)
    return EXIT_OK if ok else EXIT_FAILED


def falls_back(fleet: Fleet) -> bool:
    """Whether some deployment names no release (and so is decided under --vllm-version or the default)."""
    return any(dep.vllm_version is None for dep, _line in fleet.deployments)


def open_fleet(args: argparse.Namespace) -> Fleet | None:
    """``args.fleet`` loaded, and the default release's note said if a deployment falls back to it; None
    when the file does not load (its located errors reported on stderr, and on stdout in the format asked for)."""
    from kvpolicy.engine.fleet import FleetError, load_fleet

    try:
        fleet = load_fleet(args.fleet)
    except FleetError as exc:
        report_error(exc, args.format, FLEET_SUITE)  # in the format asked for: a CI report, never an empty one
        return None
    say_fleet_default(args, falls_back(fleet))
    return fleet


def _side(result: FleetResult) -> str:
    return str(result.decision.layout) if result.decision is not None else result.status


def _preferred(old: FleetResult, new: FleetResult) -> list[str]:
    """Why NEW ranks its layout first when OLD's layout survived: the preferences for NEW's layout that OLD
    lacks (else all of them), then OLD's preferences for its layout that NEW lacks; as the non-fleet diff's
    ``because`` (`kvpolicy.engine.analysis.diff`)."""
    def prefs(result: FleetResult, layout: Any) -> list[Any]:
        return [p for p in result.decision.preferences if p.layout == layout]  # type: ignore[union-attr]

    def said(p: Any) -> str:
        return f"{p.rule.id} (prefer +{p.weight}, {p.scope}) at {p.rule.source}"

    mine = prefs(new, new.decision.layout)  # type: ignore[union-attr]
    before = {said(p) for p in prefs(old, new.decision.layout)}  # type: ignore[union-attr]
    out = [said(p) for p in mine if said(p) not in before] or [said(p) for p in mine]
    after = {said(p) for p in prefs(new, old.decision.layout)}  # type: ignore[union-attr]
    gone = [said(p) + " (in OLD only)" for p in prefs(old, old.decision.layout)  # type: ignore[union-attr]
            if said(p) not in after]
    return list(dict.fromkeys(out + gone))


def run_fleet_diff(args: argparse.Namespace) -> int:
    """``diff OLD NEW --fleet FILE``: the deployments whose decision changes."""
    from kvpolicy.engine.fleet import decide_fleet

    fleet = open_fleet(args)
    if fleet is None:
        return EXIT_USAGE
    shared = list(args.rules or [])
    try:
        old = decide_fleet(fleet, rules_for(args, [*shared, args.old], "OLD"), args.vllm_version)
        new = decide_fleet(fleet, rules_for(args, [*shared, args.new], "NEW"), args.vllm_version)
    except (RuleLoadError, PolicyError) as exc:
        report_error(exc, args.format)
        return EXIT_USAGE
    changes = []
    bad = [b for a, b in zip(old, new) if a.status == b.status == "invalid"]  # nothing to compare: error rows
    invalid = [{"name": b.name, "location": _error_location(b), "profile": b.profile,
                "error": _error(b.error)} for b in bad]  # type: ignore[arg-type]
    for a, b in zip(old, new):
        if b in bad:
            continue
        if _side(a) == _side(b):
            continue
        why: list[str] = []
        if a.decision is not None and b.decision is not None:
            hits = b.decision.eliminated.get(a.decision.layout, [])
            why = [f"{r.id} ({r.effect}, {scope}) at {r.source}" for r, scope in hits] or _preferred(a, b)
        elif b.error is not None and b.error.diagnostics:
            why = [d.message for d in b.error.diagnostics]
        changes.append({"name": a.name, "location": a.location, "profile": b.profile, "old": _side(a),
                        "new": _side(b), "why": why})
    notes = {r.name: list(r.notes) for r in new if r.notes}  # a model config's notes: the same on both sides
    if args.format == "json":
        print_json({"fleet": args.fleet, "old": args.old, "new": args.new, "deployments": len(old),
                    "changes": changes, "invalid": invalid, "notes": notes, "warnings": rule_warnings(args)})
    else:
        print(f"diff over fleet {args.fleet}: {len(old)} deployments, {len(changes)} decision(s) change"
              + (f", {len(invalid)} invalid" if invalid else ""))
        for c in changes:
            print(f"  {c['name']} ({c['location']}, {c['profile']}): {c['old']} -> {c['new']}")
            for w in c["why"]:
                print(f"      because of {w}" if " at " in w else f"      {w}")
        if bad:  # as dry-run --fleet shows them
            print("\ninvalid (decided on neither side):")
        for r in bad:
            print(f"  {r.name} ({r.location}):")
            print("\n".join("    " + line for line in r.error.render().splitlines()))  # type: ignore[union-attr]
        if notes:
            print("\nnotes:")
            for name, lines in notes.items():
                print("\n".join(f"  {name}: {line}".replace("\n", "\n    ") for line in lines))
    return EXIT_FAILED if changes or bad else EXIT_OK  # an invalid deployment is no pass, as in dry-run --fleet


def _error_location(result: FleetResult) -> str:
    """Where an invalid deployment's error is, in the fleet file (the key that is wrong), else the deployment."""
    d = result.error.diagnostics[0] if result.error is not None and result.error.diagnostics else None
    return d.location if d is not None and d.line > 0 and result.location.startswith(d.file + ":") else result.location
