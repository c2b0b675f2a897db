"""``kvpolicy compat``: can blocks of one deployment be restored in another, and at what cost.

Each side is a JSON file (``kvpolicy dry-run --format json``, a fingerprint's ``to_json()``, or
``describe()``'s object) or a vLLM release (a profile name or version), whose layout is decided
for the deployment the flags describe (default: the built-in example). The answer is
`kvpolicy.engine.exchange`'s: exchanged as is, with transcoding (the bytes of a block on each
side and the descriptors a transfer registers per block), or not at all, and why. ``--table``
answers for every pair of release profiles at once. Exit 0 when blocks move (as is or
transcoded), 1 when they cannot. Decision path only: no torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.engine.block_format import descriptors_per_block, plan_of
from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    add_format_flag,
    int_at_least,
    print_json,
    usage_error,
)
from kvpolicy.engine.exchange import BlockExchange, ExchangeKind, compare_blocks
from kvpolicy.engine.fingerprint import LayoutFingerprint
from kvpolicy.engine.inputs import DEFAULT_EXAMPLE
from kvpolicy.engine.peer_data import load_peer_json
from kvpolicy.policy.errors import InputError, PolicyError

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  kvpolicy compat vllm-0.28 vllm-0.34 --block-size 16      # the built-in example under two releases
  kvpolicy compat prefill.json decode.json                 # two `kvpolicy dry-run --format json` outputs
  kvpolicy compat --table --block-size 16 --kv-cache-dtype auto
"""
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
    p.add_argument("source", nargs="?", metavar="FROM", help="a JSON file, or a vLLM release (vllm-0.28, 0.28.0)")
    p.add_argument("target", nargs="?", metavar="TO", help="the deployment the blocks are restored in")
    p.add_argument("--table", action="store_true", help="every pair of release profiles, for the flags' deployment")
    what = p.add_argument_group("the deployment of a release side (default: the built-in example)")
    what.add_argument("--spec", metavar="FILE", help="a YAML or JSON file of KVCacheSpec fields")
    what.add_argument("--model", metavar="PATH", help="a Hugging Face config.json, or the directory holding one")
    what.add_argument("--kv-cache-dtype", metavar="DTYPE")
    what.add_argument("--block-size", type=int_at_least(1), metavar="N",
                      help="tokens per block (default: each release's own)")
    what.add_argument("--attention-backend", "--backend", dest="backend", metavar="NAME")
    what.add_argument("--connector", metavar="NAME", help="the KV connector (`none` for none)")
    add_format_flag(p)
    p.set_defaults(run=run)


# the flags of a release side's deployment, and their argparse dests
_DEPLOYMENT_FLAGS = (("--spec", "spec"), ("--model", "model"), ("--kv-cache-dtype", "kv_cache_dtype"),
                     ("--block-size", "block_size"), ("--attention-backend", "backend"), ("--connector", "connector"))


@dataclass(frozen=True)
class Side:
    """One deployment: where it came from (a file or a profile) and its fingerprint."""

    label: str
    fingerprint: LayoutFingerprint

    def summary(self) -> dict[str, Any]:
        fp = self.fingerprint
        return {"from": self.label, "layout": str(fp.layout), "backend": fp.backend,
                "kv_cache_dtype": fp.kv_cache_dtype, "num_layers": fp.num_layers, "block_size": fp.block_size,
                "page_bytes": fp.page_bytes, "digest": fp.digest}

    def line(self) -> str:
        s = self.summary()
        return (f"{s['from']}: {s['layout']} on {s['backend']}, {s['kv_cache_dtype']}, {s['num_layers']} layers, "
                f"block {s['block_size']}, page {s['page_bytes']} B ({s['digest'][:19]})")


def run(args: argparse.Namespace) -> int:
    if args.table:
        if args.source is not None:
            raise usage_error("--table", "--table compares every release profile: give no FROM or TO")
        return _table(args)
    if args.source is None or args.target is None:
        raise usage_error("FROM", "give the two deployments to compare (FROM TO), or --table")
    given = [flag for flag, dest in _DEPLOYMENT_FLAGS if getattr(args, dest, None) is not None]
    if given and Path(args.source).is_file() and Path(args.target).is_file():
        raise usage_error(given[0], f"{given[0]} describes the deployment of a release side, and FROM and TO are "
                          "both files: it would change nothing", f"drop {given[0]}, or name a release as FROM or TO")
    src, dst = _side(args.source, args, "FROM"), _side(args.target, args, "TO")
    exchange = compare_blocks(src.fingerprint, dst.fingerprint)
    report = _report(src, dst, exchange)
    if args.format == "json":
        print_json(report)
    else:
        print(f"FROM {src.line()}")
        print(f"TO   {dst.line()}")
        print(f"exchange: {_SAYS[exchange.kind]}")
        cost = report.get("cost")
        if cost:
            print(f"  bytes per block: {cost['bytes_per_block']['from']} at FROM, {cost['bytes_per_block']['to']} "
                  f"at TO" + (" (transcoding reads and writes each once more)"
                              if exchange.kind is ExchangeKind.transcode else ""))
            print(f"  descriptors per block: {cost['descriptors_per_block']['from']} at FROM, "
                  f"{cost['descriptors_per_block']['to']} at TO")
        if exchange.kind is ExchangeKind.refused:
            if exchange.cell_differences:
                print(f"  the cells differ in {len(exchange.cell_differences)} field(s), so no exact conversion "
                      "exists:")
                for d in exchange.cell_differences:
                    print(f"    {d}")
            else:
                print(f"  {exchange.reason}")
        elif exchange.differences:
            print("  where the cells sit differs in:" if exchange.kind is ExchangeKind.transcode
                  else "  the fingerprints differ where no byte of a block moves:")
            for d in exchange.differences:
                print(f"    {d}")
    return EXIT_OK if exchange.ok else EXIT_FAILED


def _report(src: Side, dst: Side, exchange: BlockExchange) -> dict[str, Any]:
    out: dict[str, Any] = {"from": src.summary(), "to": dst.summary(), "exchange": exchange.kind.value,
                           "differences": [str(d) for d in exchange.differences],
                           "cell_differences": [str(d) for d in exchange.cell_differences], "reason": exchange.reason}
    if exchange.ok:
        out["cost"] = {
            "bytes_per_block": {"from": exchange.source_format.row_bytes, "to": exchange.target_format.row_bytes}
            if exchange.source_format and exchange.target_format else None,
            "descriptors_per_block": {"from": descriptors_per_block(plan_of(src.fingerprint)),
                                      "to": descriptors_per_block(plan_of(dst.fingerprint))},
        }
    return out


def _side(text: str, args: argparse.Namespace, where: str) -> Side:
    path = Path(text)
    if path.is_file():
        return Side(text, _fingerprint_in(path, where))
    from kvpolicy.policy.releases import resolve_profile

    try:
        profile, _ = resolve_profile(text)
    except InputError:
        raise usage_error(where, f"`{text}` is neither a file nor a vLLM release kvpolicy profiles",
                          "give a `kvpolicy dry-run --format json` file or a release (`kvpolicy releases` lists "
                          "them)") from None
    return Side(profile.name, _decided(profile.name, args, where))


def _fingerprint_in(path: Path, where: str) -> LayoutFingerprint:
    """The fingerprint in a dry-run JSON, a describe() object, or a fingerprint's own JSON."""
    try:  # bounded as a peer's JSON is: size, nesting, integers too long to print
        data = load_peer_json(path.read_bytes(), "fingerprint")
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


def _inputs(args: argparse.Namespace) -> dict[str, Any]:
    from kvpolicy.engine.cli.dry_run import read_spec_file

    if args.spec is not None:
        inputs: dict[str, Any] = read_spec_file(args.spec)
    elif args.model is not None:
        inputs = {"model": args.model}
    else:
        inputs = {k: v for k, v in DEFAULT_EXAMPLE.items() if k != "backend"}
        inputs["attention_backend"] = DEFAULT_EXAMPLE["backend"]
    for key, value in (("kv_cache_dtype", args.kv_cache_dtype), ("block_size", args.block_size),
                       ("attention_backend", args.backend)):
        if value is not None:
            inputs[key] = value
    if args.connector is not None:
        inputs["connector"] = None if args.connector == "none" else args.connector
    return inputs


def _decided(profile: str, args: argparse.Namespace, where: str) -> LayoutFingerprint:
    from kvpolicy.engine.layout_engine import LayoutEngine

    try:
        return LayoutEngine.default(profile).decide(explain=False, **_inputs(args)).fingerprint
    except PolicyError as exc:
        d = exc.diagnostics[0] if exc.diagnostics else None
        raise usage_error(where, f"{profile}: {d.message if d else exc.message}", d.help if d else None) from None


def _table(args: argparse.Namespace) -> int:
    from kvpolicy.policy.releases import profile_names

    sides: list[Side | None] = []
    for name in profile_names():
        try:
            sides.append(Side(name, _decided(name, args, name)))
        except PolicyError:
            sides.append(None)  # this release decides no layout (or refuses the inputs): shown as such
    names = list(profile_names())
    rows = [[None if a is None or b is None else compare_blocks(a.fingerprint, b.fingerprint).kind
             for b in sides] for a in sides]
    if args.format == "json":
        print_json({"profiles": names, "deployments": [s.summary() if s else None for s in sides],
                    "exchanges": [[k.value if k else None for k in row] for row in rows]})
        return EXIT_OK
    short = [n.removeprefix("vllm-").removeprefix("issue-") for n in names]
    width = max(len(s) for s in short) + 1
    print("FROM \\ TO".ljust(25) + "".join(f"{s:>{width}}" for s in short))
    for name, side, row in zip(names, sides, rows, strict=True):
        layout = f"{side.fingerprint.layout} b{side.fingerprint.block_size}" if side else "no layout"
        marks = "".join(f"{_MARK[k] if k else '-':>{width}}" for k in row)
        print(f"{name:<12} {layout:<12}{marks}")
    print("= as is, T with transcoding, x not at all, - no layout decided")
    return EXIT_OK
