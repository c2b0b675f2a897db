"""``kvpolicy compat``: can blocks of one deployment be restored in another, and at what cost.

Each side is a JSON file (``kvpolicy dry-run --format json``, a fingerprint's ``to_json()``, or
``describe()``'s object), a deployment of a fleet file as it is declared (``FLEET.yaml#name``,
decided as ``dry-run --fleet`` decides it), or a vLLM release (a profile name or version), whose
layout is decided for the deployment the flags describe (default: the built-in example).
``--from KEY=VALUE`` / ``--to KEY=VALUE`` change one side's deployment by a case key (what a fleet
deployment or a policy test case sets: ``block_size=32``, ``cpu=x86+avx512+amx``). The answer is
`kvpolicy.engine.exchange`'s: exchanged as is, with transcoding (the bytes of a block on each
side and the descriptors a transfer registers per block), or not at all, and why. ``--via
CONNECTOR`` answers for what that connector moves (`kvpolicy.engine.exchange.transfer_unit`): a
layer's view (ExampleConnector: the same `layer_view_digest`), or raw blocks as they are (any
other: as is or not at all; it cannot transcode). ``--table`` answers for every pair of release
profiles at once. Exit 0 when blocks move (as is or transcoded), 1 when they cannot, 2 on a usage
error. Decision path only: no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpolicy.engine.block_format import descriptors_per_block, plan_of
from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    UsageError,
    add_format_flag,
    add_rules_flag,
    int_at_least,
    print_json,
    usage_error,
)
from kvpolicy.engine.exchange import BlockExchange, ExchangeKind, compare_blocks
from kvpolicy.engine.fingerprint import LayoutFingerprint
from kvpolicy.engine.inputs import DEFAULT_EXAMPLE
from kvpolicy.engine.peer_data import load_peer_json
from kvpolicy.policy.errors import Diagnostic, InputError, NoLayoutError, PolicyError

if TYPE_CHECKING:  # engine.fleet builds the case models: imported when a side needs them, not per CLI start
    from kvpolicy.engine.fleet import Fleet, FleetResult
    from kvpolicy.policy.ruleset import RuleSet

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  kvpolicy compat vllm-0.28 vllm-0.34 --block-size 16      # the built-in example under two releases
  kvpolicy compat prefill.json decode.json                 # two `kvpolicy dry-run --format json` outputs
  kvpolicy compat vllm-0.34 vllm-0.34 --from block_size=16 --to block_size=32 --via MooncakeStoreConnector
  kvpolicy compat 0.34.0 0.34.0 --device cpu --block-size 32 --from cpu=x86 --to cpu=x86+avx512+amx
  kvpolicy compat --table --block-size 16 --kv-cache-dtype auto
  kvpolicy compat vllm-0.28 vllm-0.34 --block-size 16 --rules my-rules/   # decided with your rule layers too
"""
# what a side of a fleet file looks like: the file, `#`, a deployment's name
FLEET_SEP = "#"
_MARK = {ExchangeKind.as_is: "=", ExchangeKind.transcode: "T", ExchangeKind.refused: "x"}
_SAYS = {ExchangeKind.as_is: "as is: every byte of a block means the same on both sides",
         ExchangeKind.transcode: "with transcoding: the same cells in another order; restore rewrites each block "
                                 "byte for byte",
         ExchangeKind.refused: "not at all"}


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "compat", help="whether blocks of one deployment restore in another: as is, transcoded, or not at all",
        description="Compare two deployments' KV block layouts: exchanged as is, with transcoding (bytes per "
                    "block, descriptors per block), or not at all and why (docs/blocks.md).",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("source", nargs="?", metavar="FROM",
                   help="a JSON file, a vLLM release (vllm-0.28, 0.28.0), or FLEET.yaml#NAME: a fleet file's "
                        "deployment as it is declared there")
    p.add_argument("target", nargs="?", metavar="TO", help="the deployment the blocks are restored in (as FROM)")
    p.add_argument("--table", action="store_true", help="every pair of release profiles, for the flags' deployment")
    p.add_argument("--via", metavar="CONNECTOR",
                   help="answer for what this KV connector moves: ExampleConnector moves each layer's [B, H, N, C] "
                        "view slot by slot (the same layer_view_digest: as is, or not at all); any other moves raw "
                        "blocks as they are (as is, or not at all: it cannot transcode); `none`: kvpolicy's own "
                        "restore, which transcodes blocks whose cells only sit elsewhere. Default: the connector "
                        "both sides declare where they are a fleet's deployments with the same one, else none")
    what = p.add_argument_group("the deployment of a release side (default: the built-in example)")
    what.add_argument("--spec", metavar="FILE", help="a YAML or JSON file of KVCacheSpec fields")
    what.add_argument("--model", metavar="PATH", help="a Hugging Face config.json, or the directory holding one")
    what.add_argument("--tensor-parallel-size", type=int_at_least(1), metavar="N",
                      help="with --model: KV heads are split over N ranks (default 1)")
    what.add_argument("--dtype", metavar="DTYPE", help="vLLM's --dtype, with --model (default auto)")
    what.add_argument("--kv-cache-dtype", metavar="DTYPE")
    what.add_argument("--block-size", type=int_at_least(1), metavar="N",
                      help="tokens per block (default: each release's own)")
    what.add_argument("--attention-backend", "--backend", dest="backend", metavar="NAME")
    what.add_argument("--connector", metavar="NAME", help="the KV connector (`none` for none)")
    what.add_argument("--kv-transfer-config", type=_json_object, metavar="JSON",
                      help="vLLM's whole --kv-transfer-config (instead of --connector)")
    what.add_argument("--device", choices=("cuda", "cpu"), help="vLLM's platform (default cuda; cpu: CPU_ATTN)")
    what.add_argument("--cpu", metavar="ARCH[+FEATURE...]",
                      help="the host CPU of a CPU_ATTN side, whose kernel orders a block's bytes: x86, x86+avx512, "
                           "x86+avx512+amx, arm, ... (default: this machine's, said in a note)")
    side = p.add_argument_group(
        "one side only",
        "What differs between two deployments is a case key, so one generic pair of flags\n"
        "says it: no flag per key and per side, and every key a fleet deployment or a\n"
        "policy test case takes (docs/cli.md, the case format) can differ. They apply to a\n"
        "release side (over the flags above) and to a FLEET.yaml#NAME side (over its keys\n"
        "there); a JSON file is decided already.")
    side.add_argument("--from", dest="from_keys", action="append", type=_key_value, metavar="KEY=VALUE",
                      default=[], help="set a case key of FROM's deployment (repeatable): block_size=16, "
                                       "cpu=x86+avx512+amx, kv_cache_dtype=fp8, vllm_version=0.33.0 (a fleet side)")
    side.add_argument("--to", dest="to_keys", action="append", type=_key_value, metavar="KEY=VALUE",
                      default=[], help="set a case key of TO's deployment (repeatable), as --from")
    add_rules_flag(p)  # a release or fleet side is decided with these layers, as dry-run (--fleet) decides it
    add_format_flag(p)
    p.set_defaults(run=run)


_MAX_VALUE_CHARS = 100_000  # a --from/--to value or a --kv-transfer-config: a deployment key, not a file


def _json_object(text: str) -> dict[str, Any]:
    from kvpolicy.engine.peer_data import load_peer_json
    from kvpolicy.policy.errors import InputError as _InputError

    if len(text) > _MAX_VALUE_CHARS:
        raise argparse.ArgumentTypeError(f"{len(text)} characters; at most {_MAX_VALUE_CHARS} are read")
    try:
        load_peer_json(text, "--kv-transfer-config")  # bounded depth and size: no RecursionError
    except _InputError as exc:
        raise argparse.ArgumentTypeError(exc.diagnostics[0].message if exc.diagnostics else str(exc)) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON ({exc.msg} at column {exc.colno}); expected an object "
                                         "such as '{\"kv_connector\": \"NixlConnector\", \"kv_role\": "
                                         "\"kv_both\"}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``: a case key and its value read as YAML (``32`` a number, ``{a: b}`` a mapping)."""

    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a case key: block_size=32, cpu=x86+avx512+amx), "
                                         f"got `{text[:80]}`")
    if len(value) > _MAX_VALUE_CHARS:
        raise argparse.ArgumentTypeError(f"the value of `{key[:40]}` is {len(value)} characters; at most "
                                         f"{_MAX_VALUE_CHARS} are read (put a large value in a fleet file)")
    if not value.strip():
        return key, value
    from kvpolicy.policy.yaml_source import Limits, parse_yaml

    # the loader fleet and case files go through: bounded nodes and depth (no alias bomb), plain JSON-like
    # values only (a date, !!binary or !!set is refused, not a TypeError later)
    located, problems = parse_yaml(value, f"--from/--to {key[:40]}", Limits(max_nodes=10_000, max_depth=32))
    if problems:
        first = problems[0]
        if first.code == "yaml-syntax":
            return key, value  # not YAML: the text itself (validation says whether the key takes it)
        raise argparse.ArgumentTypeError(f"the value of `{key[:40]}`: {first.message}")
    return key, None if located is None else located.data


# the flags of a release side's deployment: their argparse dests and the case key each sets
_DEPLOYMENT_FLAGS = (("--spec", "spec", "spec"), ("--model", "model", "model"),
                     ("--tensor-parallel-size", "tensor_parallel_size", "tensor_parallel_size"),
                     ("--dtype", "dtype", "dtype"), ("--kv-cache-dtype", "kv_cache_dtype", "kv_cache_dtype"),
                     ("--block-size", "block_size", "block_size"),
                     ("--attention-backend", "backend", "attention_backend"), ("--connector", "connector", "connector"),
                     ("--kv-transfer-config", "kv_transfer_config", "kv_transfer_config"),
                     ("--device", "device", "device"), ("--cpu", "cpu", "cpu"))
_SIDE_FLAG = {"FROM": "--from", "TO": "--to"}


@dataclass(frozen=True)
class Side:
    """One deployment: where it came from (a file, a profile, a fleet's deployment) and its fingerprint."""

    label: str
    fingerprint: LayoutFingerprint
    connector: str | None = None  # a fleet side's declared KV connector (what moves its blocks)

    def summary(self) -> dict[str, Any]:
        fp = self.fingerprint
        return {"from": self.label, "layout": str(fp.layout), "backend": fp.backend,
                "kv_cache_dtype": fp.kv_cache_dtype, "num_layers": fp.num_layers, "block_size": fp.block_size,
                "kernel_order": fp.kernel_order, "page_bytes": fp.page_bytes, "digest": fp.digest}

    def line(self) -> str:
        s = self.summary()
        order = f", kernel order {s['kernel_order']}" if s["kernel_order"] != "cells" else ""
        return (f"{s['from']}: {s['layout']} on {s['backend']}, {s['kv_cache_dtype']}, {s['num_layers']} layers, "
                f"block {s['block_size']}{order}, page {s['page_bytes']} B ({s['digest'][:19]})")


@dataclass(frozen=True)
class Answer:
    """The exchange, and what was compared: the unit (raw blocks or layer views) and the connector."""

    kind: ExchangeKind
    blocks: BlockExchange  # compare_blocks's answer (its cost, its differences), whatever the unit
    via: str | None
    unit: str  # block | layer_view
    differences: tuple[Any, ...]  # the fields that differ for this unit
    reason: str = ""
    reconciled: bool = False  # as is only because the connector itself reconciles what differs (NIXL's TP ratio)

    @property
    def ok(self) -> bool:
        return self.kind is not ExchangeKind.refused

    def compared(self) -> str:
        if self.unit == "layer_view":
            return (f"layer views, as {self.via} moves them (each layer's [B, H, N, C] view, slot by slot): as is "
                    "when the layer_view_digest is the same")
        if self.via is None:
            return "raw blocks, as kvpolicy's own restore reads them (it transcodes cells that only sit elsewhere)"
        return f"raw blocks, as {self.via} moves them: as is or not at all (it cannot transcode)"


def _answer(src: LayoutFingerprint, dst: LayoutFingerprint, via: str | None) -> Answer:
    from kvpolicy.engine.exchange import compare_transfer, reconciled_differences, transfer_unit

    blocks = compare_blocks(src, dst)
    unit = transfer_unit(via) if via is not None else "block"
    if unit == "layer_view":
        kind, diffs, why = compare_transfer(via, src, dst, "source", "target")
        return Answer(ExchangeKind(kind), blocks, via, unit, diffs, why)
    if via is not None:  # the connector's own answer: as is, or not at all (what it reconciles may differ)
        kind, diffs, why = compare_transfer(via, src, dst, "source", "target")
        mapped, mapped_why = reconciled_differences(via, src, dst, "source", "target")
        if mapped:  # as is, though the bytes differ: the connector maps them itself
            return Answer(ExchangeKind.as_is, blocks, via, unit, mapped, mapped_why, reconciled=True)
        return Answer(ExchangeKind(kind), blocks, via, unit, diffs, why)
    return Answer(blocks.kind, blocks, via, unit, blocks.cell_differences if blocks.kind is ExchangeKind.refused
                  else blocks.differences, blocks.reason)


_SAYS_VIEWS = {ExchangeKind.as_is: "as is: each layer's view means the same bytes on both sides",
               ExchangeKind.refused: "not at all"}


def _rules_of(args: argparse.Namespace) -> Any:
    """The rule stack a side is decided with: the shipped rules of its release, then each ``--rules`` layer
    (``--no-shipped-rules``: those alone), as `dry-run --fleet --rules` decides a deployment."""
    if not (getattr(args, "rules", None) or getattr(args, "no_shipped_rules", False)):
        return _rules
    if getattr(args, "_rules_for", None) is None:
        from kvpolicy.engine.cli.fleet_report import rules_for

        args._rules_for = rules_for(args, list(args.rules or []), "--rules")
    return args._rules_for


_SAID: list[str] = []  # this run's stderr lines (notes, a model's warnings), for --format json too


def _say(line: str) -> None:
    """``line`` on stderr, kept for the JSON report: what the text says, the JSON carries."""
    print(line, file=sys.stderr)
    _SAID.append(line)


def _said() -> dict[str, list[str]]:
    """What this run said on stderr, as dry-run's JSON has it: ``notes`` without their ``note: `` prefix,
    every other line in ``warnings``."""
    return {"notes": [x.removeprefix("note: ") for x in _SAID if x.startswith("note: ")],
            "warnings": [x for x in _SAID if not x.startswith("note: ")]}


def run(args: argparse.Namespace) -> int:
    _SAID.clear()
    if args.table:
        if args.source is not None:
            raise usage_error("--table", "--table compares every release profile: give no FROM or TO",
                              "drop FROM and TO, or drop --table to compare two deployments")
        for flag, keys in (("--from", args.from_keys), ("--to", args.to_keys)):
            if keys:
                raise usage_error(flag, f"{flag} changes one side, and --table has no sides",
                                  "give FROM and TO, or set the key for every release with its flag")
        return _table(args)
    if args.source is None or args.target is None:
        raise usage_error("FROM", "give the two deployments to compare (FROM TO), or --table",
                          "e.g. `kvpolicy compat 0.28 0.34`, `kvpolicy compat fleet.yaml#prefill fleet.yaml#decode`, "
                          "`kvpolicy compat --table`")
    via = _via(args.via)
    given = [flag for flag, dest, _ in _DEPLOYMENT_FLAGS if getattr(args, dest, None) is not None]
    kinds = [_kind_of(args.source), _kind_of(args.target)]
    if given and "release" not in kinds:
        said = "files" if kinds == ["file", "file"] else "decided or declared already (a file, a fleet's deployment)"
        raise usage_error(given[0], f"{given[0]} describes the deployment of a release side, and FROM and TO are "
                          f"both {said}: it would change nothing",
                          f"drop {given[0]} (--from/--to KEY=VALUE change a fleet side), or name a release as FROM "
                          "or TO")
    if (args.rules or args.no_shipped_rules) and kinds == ["file", "file"]:
        flag = "--rules" if args.rules else "--no-shipped-rules"
        raise usage_error(flag, f"{flag} decides a release or fleet side, and FROM and TO are both files decided "
                          "already: it would change nothing", f"drop {flag}, or name a release or FLEET.yaml#NAME")
    fleets: dict[str, Fleet] = {}
    src = _side(args.source, args, "FROM", args.from_keys, fleets)
    dst = _side(args.target, args, "TO", args.to_keys, fleets)
    if args.via is None and src.connector is not None and src.connector == dst.connector:
        via = src.connector  # the connector both deployments declare moves their blocks: answer as it moves them
        _say(f"note: compared via {via}, the connector both deployments declare (pass --via to compare "
             "through another)")
    answer = _answer(src.fingerprint, dst.fingerprint, via)
    report = _report(src, dst, answer)
    if args.format == "json":
        print_json({**report, **_said()})
    else:
        print(f"FROM {src.line()}")
        print(f"TO   {dst.line()}")
        print(f"compared: {answer.compared()}")
        says = _SAYS_VIEWS[answer.kind] if answer.unit == "layer_view" else _SAYS[answer.kind]
        if answer.reconciled:
            says = f"as is through {via}, which reconciles what differs itself (not byte for byte)"
        print(f"exchange: {says}")
        cost = report.get("cost")
        if cost:
            print(f"  bytes per block: {cost['bytes_per_block']['from']} at FROM, {cost['bytes_per_block']['to']} "
                  f"at TO" + (" (transcoding reads and writes each once more)"
                              if answer.kind is ExchangeKind.transcode else ""))
            print(f"  descriptors per block: {cost['descriptors_per_block']['from']} at FROM, "
                  f"{cost['descriptors_per_block']['to']} at TO")
        if answer.kind is ExchangeKind.refused:
            if answer.differences:
                n = len(answer.differences)
                if answer.unit == "layer_view":
                    said = f"a layer's view differs in {n} field(s), and {via} moves views slot by slot"
                elif answer.blocks.kind is ExchangeKind.refused:
                    said = f"the cells differ in {n} field(s), so no exact conversion exists"
                else:
                    said = (f"where the cells sit differs in {n} field(s), and {via} moves raw blocks as they are "
                            "(it cannot transcode)")
                print(f"  {said}:")
                for d in answer.differences:
                    print(f"    {d}")
            else:
                print(f"  {answer.reason}")
        elif answer.reconciled:
            print(f"  {answer.reason}; what differs:")
            for d in answer.differences:
                print(f"    {d}")
        elif answer.differences:
            print("  where the cells sit differs in:" if answer.kind is ExchangeKind.transcode
                  else "  the fingerprints differ where no byte of a block moves:")
            for d in answer.differences:
                print(f"    {d}")
    return EXIT_OK if answer.ok else EXIT_FAILED


def _via(name: str | None) -> str | None:
    """``--via``'s connector, a name kvpolicy or some release knows (a typo would be answered as raw blocks);
    ``none`` (kvpolicy's own restore) is None."""
    if name is None or name.lower() == "none":
        return None
    from kvpolicy.policy.connectors import KNOWN_CONNECTORS, suggest_connector
    from kvpolicy.policy.near_names import nearest
    from kvpolicy.policy.releases import get_profile, profile_names

    known = set(KNOWN_CONNECTORS).union(*(get_profile(p).connectors for p in profile_names()))
    if name not in known:
        near = nearest(name, known) or suggest_connector(name)
        raise usage_error("--via", f"no KV connector `{name}`",
                          (f"did you mean `{near}`? " if near else "") + "name a connector class: ExampleConnector "
                          "(layer views), NixlConnector, MooncakeStoreConnector, OffloadingConnector, ... (raw blocks)")
    return name


def _report(src: Side, dst: Side, answer: Answer) -> dict[str, Any]:
    blocks = answer.blocks
    out: dict[str, Any] = {"from": src.summary(), "to": dst.summary(), "via": answer.via, "unit": answer.unit,
                           "exchange": answer.kind.value, "differences": [str(d) for d in answer.differences]
                           if answer.unit == "layer_view" else [str(d) for d in blocks.differences],
                           "cell_differences": [str(d) for d in blocks.cell_differences]
                           if answer.unit == "block" else [], "reason": answer.reason}
    if answer.unit == "layer_view":
        from kvpolicy.engine.exchange import layer_view_digest

        out["layer_view_digest"] = {"from": layer_view_digest(src.fingerprint),
                                    "to": layer_view_digest(dst.fingerprint)}
    elif answer.ok:
        out["cost"] = {
            "bytes_per_block": {"from": blocks.source_format.row_bytes, "to": blocks.target_format.row_bytes}
            if blocks.source_format and blocks.target_format else None,
            "descriptors_per_block": {"from": descriptors_per_block(plan_of(src.fingerprint)),
                                      "to": descriptors_per_block(plan_of(dst.fingerprint))},
        }
    return out


def _kind_of(text: str) -> str:
    """``file``, ``fleet`` (FLEET.yaml#NAME) or ``release``."""
    if Path(text).is_file():
        return "file"
    return "fleet" if FLEET_SEP in text else "release"


def _side(text: str, args: argparse.Namespace, where: str, keys: list[tuple[str, Any]],
          fleets: dict[str, Fleet]) -> Side:
    kind = _kind_of(text)
    if kind == "file":
        if keys:
            raise usage_error(_SIDE_FLAG[where], f"{where} is a file, a layout decided already: "
                              f"{_SIDE_FLAG[where]} {keys[0][0]}=... would change nothing",
                              f"drop {_SIDE_FLAG[where]}, or name a release or a FLEET.yaml#NAME as {where}")
        return Side(text, _fingerprint_in(Path(text), where))
    if kind == "fleet":
        return _fleet_side(text, where, keys, fleets, _rules_of(args))
    from kvpolicy.policy.releases import resolve_profile

    try:
        profile, _ = resolve_profile(text)
    except InputError:
        raise usage_error(where, f"`{text}` is neither a file nor a vLLM release kvpolicy profiles",
                          "give a `kvpolicy dry-run --format json` file, a release (`kvpolicy releases` lists "
                          "them), or FLEET.yaml#NAME") from None
    return Side(profile.name + _changed(keys), _decided(profile.name, args, where, keys))


def _changed(keys: list[tuple[str, Any]]) -> str:
    """A side's ``--from``/``--to`` keys, for its label: `` (block_size=16, cpu=x86)``."""
    return f" ({', '.join(f'{k}={json.dumps(v) if not isinstance(v, str) else v}' for k, v in keys)})" if keys else ""


def _fingerprint_in(path: Path, where: str) -> LayoutFingerprint:
    """The fingerprint in a dry-run JSON, a describe() object, or a fingerprint's own JSON."""
    from kvpolicy.engine.peer_data import MAX_PEER_BYTES
    from kvpolicy.policy.files import read_capped

    # read capped (a multi-gigabyte file named by mistake is refused by its size, never read whole), then
    # bounded as a peer's JSON is: size, nesting, integers too long to print
    text, problems = read_capped(path, str(path), MAX_PEER_BYTES)
    if text is None:
        d = problems[0]
        raise usage_error(str(path), f"{where}: {d.message}", "give `kvpolicy dry-run --format json`'s output "
                          "(a few kilobytes), or a fingerprint's to_json()") from None
    try:
        data = load_peer_json(text, "fingerprint")
    except InputError as exc:
        raise usage_error(str(path), f"not a JSON fingerprint: {exc.diagnostics[0].message}",
                          "give `kvpolicy dry-run --format json`'s output") from None
    if isinstance(data, dict) and data.get("ok") is False:
        error = data.get("error") if isinstance(data.get("error"), dict) else data
        diags = error.get("diagnostics") if isinstance(error.get("diagnostics"), list) else []
        said = "; ".join(f"{d.get('file')}: {d.get('message')}" for d in diags[:3] if isinstance(d, dict))
        said = (said or str(error.get("message") or ""))[:300]
        raise usage_error(str(path), f"{where} is the output of a command that failed: {said}",
                          "give the output of a `kvpolicy dry-run --format json` that decided a layout")
    if isinstance(data, dict) and isinstance(data.get("fingerprint"), dict):
        data = {**data["fingerprint"], **({"digest": data["digest"]} if "digest" in data else {})}
    if not isinstance(data, dict) or "placement" not in data or "physical_dims" not in data:
        raise usage_error(str(path), f"{where} holds no layout fingerprint (it is not `kvpolicy dry-run --format "
                          "json` output, nor a fingerprint's JSON)",
                          "give `kvpolicy dry-run --format json`'s output, or a fingerprint's to_json()")
    try:
        return LayoutFingerprint.from_dict(data)
    except InputError as exc:
        d = exc.diagnostics[0]
        raise usage_error(str(path), d.message, d.help) from None


def _rules(profile: str) -> RuleSet:
    """The shipped rules of a release profile, each loaded once."""
    from kvpolicy.engine.rule_layers import load_layers

    if profile not in _RULES:
        _RULES[profile] = load_layers(vllm_version=profile)
    return _RULES[profile]


_RULES: dict[str, Any] = {}


def _flag_keys(args: argparse.Namespace, device: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The case keys the deployment flags set (the built-in example where no --spec or --model), and the
    flag that set each (for an error about it)."""
    from kvpolicy.engine.cli.dry_run import read_spec_file

    data: dict[str, Any] = {}
    said: dict[str, str] = {}
    if args.spec is not None:
        data.update(read_spec_file(args.spec))
        said.update({k: "--spec" for k in data})
    elif args.model is not None:
        data["model"], said["model"] = args.model, "--model"
    for flag, dest, key in _DEPLOYMENT_FLAGS[2:]:
        value = getattr(args, dest, None)
        if value is not None:
            data[key], said[key] = value, flag
    if data.get("connector") == "none":
        data["connector"] = None
    if args.spec is None and args.model is None:  # the built-in example, as dry-run's (CPU_ATTN on cpu)
        data.setdefault("spec", dict(DEFAULT_EXAMPLE["spec"]))
        cuda = device in (None, "cuda")
        data.setdefault("kv_cache_dtype", DEFAULT_EXAMPLE["kv_cache_dtype"] if cuda else "auto")
        if cuda:
            data.setdefault("attention_backend", DEFAULT_EXAMPLE["backend"])
        if "kv_transfer_config" not in data:
            data.setdefault("connector", DEFAULT_EXAMPLE["connector"])
    return data, said


def _merge(data: dict[str, Any], keys: list[tuple[str, Any]], said: dict[str, str], where: str) -> dict[str, Any]:
    """``data`` with a side's ``--from``/``--to`` keys set (a source key replaces the other sources; a
    connector key the other way of naming the connector)."""
    from kvpolicy.engine.policy_tests.cases import CaseInput
    from kvpolicy.policy.near_names import nearest

    flag = _SIDE_FLAG.get(where, where)
    valid = list(CaseInput.model_fields)
    out = dict(data)
    for key, value in keys:
        if key not in valid:
            near = nearest(key, valid)
            raise usage_error(f"{flag} {key}", f"no case key `{key}`", (f"did you mean `{near}`? " if near else "")
                              + f"the keys: {', '.join(valid)}")
        if key in ("model", "spec", "groups"):
            out = {k: v for k, v in out.items() if k not in ("model", "spec", "groups")}
            if key == "model" and isinstance(value, str):
                value = str(Path(value).resolve())  # typed here: relative to the working directory
        if key in ("connector", "connector_config") and "kv_transfer_config" not in dict(keys):
            out.pop("kv_transfer_config", None)
        if key == "kv_transfer_config":
            out.pop("connector", None)
            out.pop("connector_config", None)
        if key == "connector" and isinstance(value, str) and value.lower() == "none":
            value = None
        out[key] = value
        said[key] = f"{flag} {key}"
    return out


_KEY_HELP = ("give {key} a value a policy test case's `input` takes (docs/cli.md, The case format): "
             "`--from block_size=32`, `--to cpu=x86+avx512`")


def _deployment(name: str, data: dict[str, Any], said: dict[str, str], where: str) -> Any:
    """A `Deployment` of ``data``; a key it refuses is a usage error naming the flag that set it."""
    from pydantic import ValidationError

    from kvpolicy.engine.fleet import Deployment

    try:
        return Deployment.model_validate({**data, "name": name})
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        message = err["msg"].removeprefix("Value error, ").replace("Input should be", "expected")
        message = message[:1].lower() + message[1:]
        raise usage_error(said.get(key, where), f"{where}: {message}" + (f" (`{key}`)" if key and
                                                                           f"`{key}`" not in message else ""),
                          _KEY_HELP.format(key=key or "the key")) from None


def _fingerprint_of(result: FleetResult, where: str, said: dict[str, str], fleet_file: str | None = None
                    ) -> LayoutFingerprint:
    """A decided side's fingerprint; a side that decides nothing is an error where it is written: the fleet
    file's line, else the flag or key that is wrong (a usage error), else the side."""
    for note in result.notes:
        _say(note)
    if result.decision is None:
        exc = result.error
        assert exc is not None
        d = exc.diagnostics[0] if exc.diagnostics else None
        who = f"{where} {result.name}" + (f" ({result.location})" if fleet_file is not None else "")
        if fleet_file is not None and d is not None and d.line > 0 and not isinstance(exc, NoLayoutError):
            raise InputError(f"{who} decides no layout", list(exc.diagnostics))
        key = d.file.split(".", 1)[0].split("[", 1)[0] if d is not None and d.line == 0 else ""
        if key not in said and "model" in said and d is not None and _in_model(d.file, result.deployment.model):
            key = "model"  # the model's config cannot be read (missing, a directory without config.json, ...)
        raise usage_error(said.get(key, where), f"{who}: {d.message if d else exc.message}",
                          d.help if d and d.help else _KEY_HELP.format(key=key or "the side's keys")) from None
    ctx = result.decision.context
    if ctx.backend.write_isa and result.deployment.cpu is None and where in _SIDE_FLAG:  # a side, not a row
        from kvpolicy.policy.cpu_kernel import CpuHost

        order = result.decision.fingerprint.kernel_order
        _say(f"note: {where} runs {ctx.backend.name}, whose kernel order (`{order}`) is decided for this "
             f"machine's CPU (`{CpuHost.this_host().label}`): pass --cpu, or {_SIDE_FLAG[where]} cpu=LABEL, for "
             "another host's")
    return result.decision.fingerprint


def _decided(profile: str, args: argparse.Namespace, where: str, keys: list[tuple[str, Any]] = ()  # type: ignore[assignment]
             ) -> LayoutFingerprint:
    """A release side: the flags' deployment (and the side's keys) decided under ``profile``'s shipped rules,
    as dry-run --fleet decides a deployment."""
    if any(k == "vllm_version" for k, _ in keys):
        raise usage_error(f"{_SIDE_FLAG.get(where, where)} vllm_version",
                          f"{where} names its release already (`{profile}`)", f"name the release as {where} itself")
    result, said = _decided_result(profile, args, where, keys)
    return _fingerprint_of(result, where, said)


def _decided_result(profile: str, args: argparse.Namespace, where: str, keys: list[tuple[str, Any]] = ()  # type: ignore[assignment]
                    ) -> tuple[FleetResult, dict[str, str]]:
    """`_decided`'s decision (or refusal) as it came, and the flag that set each key."""
    from kvpolicy.engine.fleet import decide_deployment

    device = dict(keys).get("device", args.device)
    data, said = _flag_keys(args, device)
    data = _merge(data, list(keys), said, where)
    data["vllm_version"] = profile
    dep = _deployment(profile, data, said, where)
    return decide_deployment(dep, Path("."), _rules_of(args), profile), said


def _fleet_side(text: str, where: str, keys: list[tuple[str, Any]], fleets: dict[str, Fleet],
                rules: Any = None) -> Side:
    """``FLEET.yaml#NAME``: the deployment as the fleet file declares it (``keys`` changed), decided as
    dry-run --fleet decides it; a fleet file with mistakes is its located errors."""
    from kvpolicy.engine.fleet import FleetError, decide_in_fleet, load_fleet
    from kvpolicy.policy.near_names import nearest

    file, name = _split_fleet_side(text)
    if not Path(file).is_file():
        raise usage_error(where, f"`{file}` (before `{FLEET_SEP}{name}`) is no fleet file",
                          "give FLEET.yaml#NAME: a fleet file and one of its deployments' names")
    if file not in fleets:
        try:
            fleets[file] = load_fleet(file)
        except FleetError as exc:
            raise InputError(f"{where}: the fleet file `{file}` has mistakes", list(exc.diagnostics)) from None
    fleet = fleets[file]
    names = [d.name for d, _ in fleet.deployments]
    if name not in names:
        near = nearest(name, names)
        raise usage_error(where, f"no deployment `{name}` in fleet `{file}`",
                          (f"did you mean `{near}`? " if near else "") + "its deployments: "
                          + ", ".join(names[:12]) + (", ..." if len(names) > 12 else ""))
    index = names.index(name)
    said: dict[str, str] = {}
    dep = None
    if keys:
        declared = fleet.deployments[index][0].model_dump(mode="json", exclude_defaults=True)
        dep = _deployment(name, _merge(declared, list(keys), said, where), said, where)
    result = decide_in_fleet(fleet, index, rules or _rules, None, dep)
    fingerprint = _fingerprint_of(result, where, said, fleet.file)
    connector = result.decision.context.connector if result.decision is not None else None
    return Side(text + _changed(keys), fingerprint, connector.name if connector is not None else None)


def _split_fleet_side(text: str) -> tuple[str, str]:
    """``FLEET.yaml#NAME`` as (file, name). A file name or a deployment name may hold ``#`` too: the split is
    at the first ``#`` before which a file exists whose fleet names what follows; failing that, the first
    before which a file exists (its error lists the names), else the last ``#``."""
    from kvpolicy.engine.fleet import FleetError, load_fleet

    splits = [(text[:i], text[i + 1:]) for i, c in enumerate(text) if c == FLEET_SEP]
    files = [(f, n) for f, n in splits if f and Path(f).is_file()]
    for file, name in files:
        try:
            if name in {d.name for d, _ in load_fleet(file).deployments}:
                return file, name
        except FleetError:
            break  # its mistakes are reported where the side is read
    if files:
        return files[0]
    file, _, name = text.rpartition(FLEET_SEP)
    return file, name


def _table(args: argparse.Namespace) -> int:
    from kvpolicy.policy.releases import profile_names

    via = _via(args.via)
    sides: list[Side | None] = []
    names = list(profile_names())
    refused: dict[str, PolicyError] = {}  # the releases that refuse the flags' inputs (not: decide no layout)
    for name in names:
        try:
            result, said = _decided_result(name, args, name)
            if result.decision is None and isinstance(result.error, NoLayoutError):
                sides.append(None)  # this release's rules leave no layout for the deployment: a `-` row
                continue
            sides.append(Side(name, _fingerprint_of(result, name, said)))
        except PolicyError as exc:
            sides.append(None)
            refused[name] = exc
    def why(name: str, exc: PolicyError) -> str:
        text = exc.diagnostics[0].message if exc.diagnostics else exc.message
        for prefix in (f"{name} {name}: ", f"{name}: "):
            text = text.removeprefix(prefix)
        return text

    if refused and len(refused) == len(names):  # a misspelt flag, a missing --model: every row would be `-`
        name, first = next(iter(refused.items()))
        raise UsageError("", [Diagnostic(d.file, d.line, d.col, d.code, f"no release profile takes the "
                                         f"deployment these flags describe ({name}: {why(name, first)})", d.help)
                              for d in first.diagnostics[:1]]) from None
    for name, exc in refused.items():  # the rest: said, so that a `-` row is not read as a rule's refusal
        _say(f"note: {name} refuses the deployment these flags describe: {why(name, exc)}")
    rows = [[None if a is None or b is None else _answer(a.fingerprint, b.fingerprint, via).kind
             for b in sides] for a in sides]
    if args.format == "json":
        print_json({"profiles": names, "via": via, "unit": _answer_unit(via),
                    "deployments": [s.summary() if s else None for s in sides],
                    "exchanges": [[k.value if k else None for k in row] for row in rows], **_said()})
        return EXIT_OK
    short = [n.removeprefix("vllm-").removeprefix("issue-") for n in names]
    width = max(len(s) for s in short) + 1
    print("FROM \\ TO".ljust(25) + "".join(f"{s:>{width}}" for s in short))
    for name, side, row in zip(names, sides, rows, strict=True):
        layout = f"{side.fingerprint.layout} b{side.fingerprint.block_size}" if side else "no layout"
        marks = "".join(f"{_MARK[k] if k else '-':>{width}}" for k in row)
        print(f"{name:<12} {layout:<12}{marks}")
    print("= as is, T with transcoding, x not at all, - no layout decided"
          + (f" (via {via}: {'layer views' if _answer_unit(via) == 'layer_view' else 'raw blocks, as is only'})"
             if via else ""))
    return EXIT_OK


def _in_model(file: str, model: Any) -> bool:
    """Whether a diagnostic's ``file`` is the model's config (the path given, or its config.json)."""
    if not isinstance(model, str) or not model:
        return False
    shown = str(Path(model))
    return file in (model, shown) or file.startswith(shown.rstrip("/") + "/")


def _answer_unit(via: str | None) -> str:
    from kvpolicy.engine.exchange import transfer_unit

    return "block" if via is None else transfer_unit(via)
