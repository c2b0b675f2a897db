"""vLLM's `vllm serve` argument parsing, run under a release (0.24.0-0.34.0): what it derives from a command line.

Reads a JSON list of cases on stdin, writes one JSON result per case on stdout.
Case kinds:
  {"facts": true}                     the serve parser's arguments: each action's option strings, dest,
                                      nargs, kind, choices and value type (the int/float ones kvpolicy checks),
                                      and every option string the parser accepts
                                      (hidden spellings such as --no-enable-x included); with
                                      "frontend": true the whole `vllm serve` parser
                                      (`ServeSubcommand().subparser_init`), else the engine-argument part
  {"envs": true, "layout_candidates": [...]}   the variables `vllm.envs` reads, and which candidates its
                                      VLLM_KV_CACHE_LAYOUT getter accepts
  {"argv": [...], "files": {...}}     everything after `vllm serve`, parsed by vLLM's own
                                      FlexibleArgumentParser (`parse_args(["serve", *argv])`, which moves
                                      --model, pulls --config YAML, turns underscores into dashes, reads
                                      dotted JSON keys), then `ServeSubcommand.cmd`'s `args.model = args.model_tag`
                                      and `AsyncEngineArgs.from_cli_args`. Answers the fields the KV cache
                                      layout decision reads, or the parser's error. `files` are written to a
                                      temporary directory first; `{dir}` in argv names it.

Everything is vLLM's own code. STAND-IN: the serve parser's frontend arguments (--host, --port,
--api-key...; `make_arg_parser`'s FrontendArgs) need the `openai` package and tool parsers, which the
conformance site does not install; parse cases build the serve subparser as `make_arg_parser` does
for everything else: the `model_tag` positional, `--config` (what `parse_args` reads the YAML from)
and `AsyncEngineArgs.add_cli_args`. A line with a frontend argument is therefore not a parse case.
Nothing is built that needs the model (no ModelConfig): the model is a name here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

# stdout carries only the JSON answer: route everything else printed to fd 1 to stderr.
_ANSWER = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

from _common import answer_cases, stub_package  # noqa: E402
from _host import pin_host  # noqa: E402

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)


def _import_vllm_on_the_cpu_platform():
    """``import vllm``, its platform resolved to the CPU platform (the engine arguments' defaults ask the
    platform). STAND-IN (releases before 0.28), the same as v028.py's: they take the CPU platform only for
    a build whose version names ``cpu``, so during ``import vllm`` the ``vllm`` distribution's metadata
    version reads with a ``+cpu`` label. (A copy: importing v028 would run that oracle's imports; the lead
    may move it to _common, which re-asks every release.)"""
    import importlib.metadata as md

    real = md.version
    md.version = lambda name: real(name) + "+cpu" if name == "vllm" else real(name)
    try:
        import vllm
        import vllm.platforms

        vllm.platforms.current_platform.device_type  # noqa: B018  (resolve it while the label holds)
    finally:
        md.version = real


_import_vllm_on_the_cpu_platform()


class _ParserError(Exception):
    pass


def _engine_parser():
    """The `vllm serve` subparser as `make_arg_parser` builds it, less the frontend (STAND-IN, above)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    sub = top.add_subparsers(required=False, dest="subparser")
    serve = sub.add_parser("serve", usage="vllm serve [model_tag] [options]")
    serve.add_argument("model_tag", type=str, nargs="?")
    serve.add_argument("--config")
    AsyncEngineArgs.add_cli_args(serve)
    return top, serve


def _frontend_parser():
    """The whole `vllm serve` parser, as `vllm` builds it (needs the frontend's packages importable;
    pure-Python ones that are missing and only imported, never called while parsing, are stubbed)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for _ in range(8):
        try:
            from vllm.entrypoints.cli.serve import ServeSubcommand

            break
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            if not root or root == "vllm":
                raise
            stub_package(root)
    top = FlexibleArgumentParser(prog="vllm")
    sub = top.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand().subparser_init(sub)
    return top, serve


def _kind(action) -> str:
    name = type(action).__name__
    return {
        "_StoreAction": "store",
        "_StoreTrueAction": "store_true",
        "_StoreFalseAction": "store_false",
        "_StoreConstAction": "store_const",
        "_AppendAction": "append",
        "_AppendConstAction": "append_const",
        "_CountAction": "count",
        "_HelpAction": "help",
        "_VersionAction": "version",
        "BooleanOptionalAction": "bool",
        "EnableDisableAction": "bool",
        "_ExtendAction": "extend",
    }.get(name, name)


def _value_type(parse):
    """The argument's value type where kvpolicy can check it as vLLM's parser does (None: not checked)."""
    if parse in (int, float):
        return parse.__name__
    name = getattr(parse, "__name__", "")
    if name in ("human_readable_int", "human_readable_int_or_auto"):
        return name
    if name == "_optional_type":  # optional_type(int): "" and "None" mean unset, anything else the inner type
        inner = [c.cell_contents for c in parse.__closure__ or () if c.cell_contents in (int, float)]
        return f"{inner[0].__name__} or None" if inner else None
    return None


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def facts(case):
    _top, serve = _frontend_parser() if case.get("frontend") else _engine_parser()
    actions = []
    index = {}
    for action in serve._actions:
        index[id(action)] = len(actions)
        entry = {
            "options": list(action.option_strings),
            "dest": action.dest,
            "nargs": action.nargs,
            "kind": _kind(action),
            "choices": None if action.choices is None else [_jsonable(c) for c in action.choices],
            "type": _value_type(action.type),
        }
        if entry["kind"] == "bool":  # the value each spelling stores (EnableDisableAction: --disable-x is False)
            negative = getattr(action, "negative_option_strings", None)
            entry["values"] = {}
            for opt, act in serve._option_string_actions.items():
                if act is action:
                    false = opt in negative if negative is not None else opt.startswith("--no-")
                    entry["values"][opt] = not false
        actions.append(entry)
    options = {opt: index[id(act)] for opt, act in serve._option_string_actions.items()}
    import vllm

    return {"version": vllm.__version__, "frontend": bool(case.get("frontend")), "actions": actions,
            "options": options}


def _fields(engine_args) -> dict:
    ktc = engine_args.kv_transfer_config
    attention = engine_args.attention_config
    backend = getattr(attention, "backend", None)
    return {
        "model": engine_args.model,
        "dtype": str(engine_args.dtype),
        "block_size": engine_args.block_size,
        "kv_cache_dtype": str(engine_args.kv_cache_dtype),
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "pipeline_parallel_size": engine_args.pipeline_parallel_size,
        "data_parallel_size": engine_args.data_parallel_size,
        "kv_transfer_config": None if ktc is None else {
            "kv_connector": ktc.kv_connector,
            "kv_role": ktc.kv_role,
            "kv_connector_extra_config": _jsonable(ktc.kv_connector_extra_config),
        },
        "attention_backend": None if engine_args.attention_backend is None else str(
            getattr(engine_args.attention_backend, "name", engine_args.attention_backend)),
        "attention_config_backend": None if backend is None else str(getattr(backend, "name", backend)),
        "enable_extensible_kv_cache": getattr(engine_args, "enable_extensible_kv_cache", None),
    }


def parse(case):
    top, serve = _engine_parser()

    def error(message):  # argparse's error() prints usage and exits; keep the message instead
        raise _ParserError(message)

    top.error = error
    serve.error = error
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in (case.get("files") or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        argv = [a.replace("{dir}", tmp) for a in case["argv"]]
        try:
            args = top.parse_args(["serve", *argv])
        except _ParserError as exc:
            return {"error": f"ArgumentError: {exc}"}
        except SystemExit as exc:  # argparse exits for --help and on some errors of its own
            return {"error": f"SystemExit: {exc.code}"}
        if getattr(args, "model_tag", None) is not None:  # ServeSubcommand.cmd
            args.model = args.model_tag
        from vllm.engine.arg_utils import AsyncEngineArgs

        engine_args = AsyncEngineArgs.from_cli_args(args)
        return _fields(engine_args)


def envs(case):
    """The variables the release's ``vllm.envs`` reads, and which values of VLLM_KV_CACHE_LAYOUT it accepts
    (each candidate set and read through the release's own getter)."""
    import vllm.envs as vllm_envs

    getter = vllm_envs.environment_variables["VLLM_KV_CACHE_LAYOUT"]
    accepted = []
    for value in case.get("layout_candidates", []):
        os.environ["VLLM_KV_CACHE_LAYOUT"] = value
        try:
            getter()
            accepted.append(value)
        except ValueError:
            pass
        finally:
            del os.environ["VLLM_KV_CACHE_LAYOUT"]
    return {"variables": sorted(vllm_envs.environment_variables), "kv_cache_layout_accepts": accepted}


def answer(case):
    if case.get("facts"):
        return facts(case)
    if case.get("envs"):
        return envs(case)
    return parse(case)


if __name__ == "__main__":
    answer_cases(answer, _ANSWER)
