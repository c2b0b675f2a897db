"""A `vllm serve` command line read as the release's own parser reads it, for the layout decision.

``kvpolicy dry-run -- <everything after 'vllm serve'>``: the words go through the steps of vLLM's
``FlexibleArgumentParser.parse_args`` (``vllm/utils/argparse_utils.py``, the same in 0.24-0.34 for
``serve``): ``--model X`` moved to the positional model, ``--config FILE`` (YAML, keys as flag names)
spliced in after the model so that later flags override it, ``--foo_bar`` read as ``--foo-bar``,
``-O3`` as ``--optimization-level 3``, dotted JSON keys (``--kv-transfer-config.kv_role kv_both``)
merged into one JSON argument; then Python's argparse over the release's own arguments
(`kvpolicy.engine.vllm_serve_facts`: every spelling, nargs and choices read from the release), with
``allow_abbrev`` as vLLM leaves it. ``tests/conformance/test_serve_args.py`` holds the result to
``AsyncEngineArgs.from_cli_args`` of 0.28.0 and 0.34.0 over a corpus of lines.

Of the parsed arguments, `LAYOUT_ARGUMENTS` are what the decision reads; every other argument the
release accepts is ignored and listed (`ServeArgs.ignored`); `NOT_MODELLED` ones bear on the KV cache
but kvpolicy cannot follow them: they are refused with what to do instead.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kvpolicy.engine.vllm_serve_facts import serve_actions
from kvpolicy.policy.errors import InputError, input_error

__all__ = ["LAYOUT_ARGUMENTS", "NOT_MODELLED", "ServeArgs", "parse_serve_args"]

WHERE = "vllm serve"  # how errors name the command line

# dest -> the dry-run keyword it becomes (the decision reads these)
LAYOUT_ARGUMENTS: dict[str, str] = {
    "model_tag": "model",
    "model": "model",
    "dtype": "dtype",
    "block_size": "block_size",
    "kv_cache_dtype": "kv_cache_dtype",
    "tensor_parallel_size": "tensor_parallel_size",
    "kv_transfer_config": "kv_transfer_config",
    "attention_backend": "attention_backend",
    "attention_config": "attention_backend",
    "enable_extensible_kv_cache": "enable_extensible_kv_cache",
    "disable_hybrid_kv_cache_manager": "disable_hybrid_kv_cache_manager",
    "disable_sliding_window": "disable_sliding_window",
    "config": "config",
}

# dest -> why kvpolicy refuses it (it changes the KV cache in a way the inputs cannot say)
NOT_MODELLED: dict[str, str] = {
    "model_impl": "the Transformers (or Terratorch) model implementation builds its own attention layers, whose KV "
                  "cache specs kvpolicy does not derive from config.json; decide without it for vLLM's own "
                  "implementation",
    "pipeline_parallel_size": "each pipeline stage holds a share of the layers, with its own backends; give one "
                              "stage's geometry with --spec and its backends with --worker-attention-backends",
    "decode_context_parallel_size": "decode context parallelism shards the KV cache (0.29+ then keeps only "
                                    "block-outermost layouts for mixed page sizes), which kvpolicy's model and "
                                    "serve-line inputs do not describe",
    "prefill_context_parallel_size": "prefill context parallelism shards the KV cache, which kvpolicy's model "
                                     "and serve-line inputs do not describe",
    "kv_offloading_size": "it configures a KV connector (OffloadingConnector, or SimpleCPUOffloadConnector "
                          "with VLLM_USE_SIMPLE_KV_OFFLOAD) that kvpolicy does not derive; pass the connector "
                          "with --kv-transfer-config instead",
    "speculative_config": "a draft model adds KV cache specs kvpolicy does not read from a serve line",
    "hf_overrides": "it changes the model config vLLM reads (layer count, heads, windows...), and kvpolicy reads "
                    "config.json as it is; apply the overrides to a copy of the config and give that",
    # the Mamba state's bytes, from which vLLM aligns a hybrid model's attention block size (policy/hybrid_block.py)
    "mamba_cache_dtype": "it sets the Mamba state's dtype, whose bytes decide the attention block size vLLM aligns a "
                         "hybrid model to; kvpolicy sizes the state in the model dtype (auto)",
    "mamba_ssm_cache_dtype": "it sets the Mamba recurrent state's dtype, whose bytes decide the attention block size "
                             "vLLM aligns a hybrid model to; kvpolicy sizes it as auto does",
    "mamba_block_size": "it sets the Mamba block size, which vLLM's alignment of a hybrid model's attention block "
                        "size then follows; kvpolicy aligns as without it",
    "mamba_cache_mode": "with `all` (0.24-0.31) vLLM aligns a hybrid model's attention block size to the Mamba chunk "
                        "size; kvpolicy aligns as with the default (`align` under prefix caching, else `none`)",
}

_INT_ARGS = {"block_size", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"}
_JSON_ARGS = {"kv_transfer_config", "attention_config"}
_DEFAULT_VALUE_MEANS_UNSET = {"model_impl": ("auto", "vllm"), "kv_offloading_size": ("", "None"),
                              "speculative_config": ("", "None"),
                              "hf_overrides": ("", "None", "{}", {}),
                              "mamba_cache_dtype": ("auto",), "mamba_ssm_cache_dtype": ("auto",),
                              "mamba_block_size": ("", "None"), "mamba_cache_mode": ("none", "align")}


@dataclass(frozen=True)
class ServeArgs:
    """What a serve line says for the decision: dry-run keywords, and the notes to say about it."""

    inputs: dict[str, Any]  # model, dtype, block_size, kv_cache_dtype, tensor_parallel_size, ...
    ignored: tuple[str, ...]  # the arguments given that do not bear on the layout, as typed
    notes: tuple[str, ...] = field(default=())
    data_parallel_size: int | None = None


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Refused(message)


class _BoolAction(argparse.Action):
    """A ``--x`` / ``--no-x`` (or ``--enable-x`` / ``--disable-x``) pair: the value each spelling stores."""

    def __init__(self, option_strings: list[str], dest: str, values: dict[str, bool], **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kw)
        self.values_of = values

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.values_of.get(option_string or "", True))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{_short(text)}'") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{_short(text)}'") from None


def _optional(parse: Any) -> Any:
    """vLLM's ``optional_type``: "" and "None" leave the argument unset."""
    def check(text: str) -> Any:
        return None if text in ("", "None") else parse(text)
    return check


def _human_int_checked(text: str) -> int:
    value = _human_int(text)
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"invalid human_readable_int value: '{_short(text)}' (a number, or one with "
                                         "a suffix such as 8k = 8,000 or 8K = 8,192)")
    return value


def _human_int_or_auto(text: str) -> int:
    return -1 if text.strip() == "-1" or text.strip().lower() == "auto" else _human_int_checked(text)


# the value types of the release's facts (``type``) checked as its parser checks them, so that a line vLLM
# refuses is refused here too, even for an argument the decision ignores
_VALUE_TYPES: dict[str, Any] = {
    "int": _int, "float": _float, "int or None": _optional(_int), "float or None": _optional(_float),
    "human_readable_int": _human_int_checked, "human_readable_int_or_auto": _human_int_or_auto,
}


def _json(text: str) -> Any:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"`{_short(text)}` is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"`{_short(text)}` is not a JSON object")
    return value


def _parser(actions: dict[str, dict[str, Any]]) -> _Parser:
    parser = _Parser(prog="vllm serve", add_help=False)
    for action in actions.values():
        dest, kind, options = action["dest"], action["kind"], action.get("options") or []
        kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
        if not options:  # the positional model
            parser.add_argument(dest, nargs=action.get("nargs"), default=argparse.SUPPRESS)
            continue
        if kind == "bool":
            parser.add_argument(*options, action=_BoolAction, values=action.get("values", {}), **kw)
        elif kind in ("store_true", "store_false", "store_const", "append_const", "count"):
            parser.add_argument(*options, action={"store_const": "store_const", "append_const": "append_const"}
                                .get(kind, kind), **({"const": True} if kind.endswith("const") else {}), **kw)
        else:
            nargs = action.get("nargs")
            if nargs is not None:
                kw["nargs"] = nargs
                if nargs == "?":
                    kw["const"] = True
            choices = action.get("choices")
            if choices and all(isinstance(c, str) for c in choices):
                kw["choices"] = choices
            if dest in _INT_ARGS:
                kw["type"] = _int
            elif dest in _JSON_ARGS:
                kw["type"] = _json
            elif action.get("type") in _VALUE_TYPES:
                kw["type"] = _VALUE_TYPES[action["type"]]
            parser.add_argument(*options, action="append" if kind in ("append", "extend") else "store", **kw)
    return parser


def _error(message: str, help: str | None = None, where: str = WHERE, code: str = "invalid-serve-args") -> InputError:
    return input_error(where, message, help, code=code)


def _config_args(path_text: str, option_strings: set[str]) -> list[str]:
    """``--config FILE``'s YAML as the words vLLM's ``load_config_file`` makes of it, read with the bounded
    loader the rule, case and fleet files go through (`kvpolicy.policy.yaml_source.parse_yaml`): no alias
    bomb, no nesting past its depth, no integer past 64 bits, only plain values (a date, ``!!binary`` or
    ``!!set`` is a located error, not a TypeError when the value is written as JSON)."""
    where = f"{WHERE} --config"
    if path_text.split(".")[-1] not in ("yaml", "yml"):
        raise _error(f"vLLM reads a --config file only as YAML (.yaml or .yml), got `{path_text}`",
                     "rename the file to .yaml", where)
    from kvpolicy.policy.files import read_capped
    from kvpolicy.policy.yaml_source import Limits, parse_yaml

    limits = Limits(max_nodes=10_000, max_depth=32)  # a --config file is a few flags: far below either
    text, problems = read_capped(Path(path_text), path_text, limits.max_file_bytes)
    if text is None:
        d = problems[0]
        raise InputError("unreadable --config file", [d.__class__(d.file, d.line, d.col, d.code,
                                                                 "the --config file: " + d.message, d.help)])
    located, problems = parse_yaml(text, path_text, limits)
    if problems:
        raise InputError("the --config file cannot be read", [
            d.__class__(d.file, d.line, d.col, d.code, "the --config file: " + d.message, d.help) for d in problems])
    config = None if located is None else located.data
    if not isinstance(config, dict):
        raise _error("a --config file is a mapping of flag names to values (e.g. `tensor-parallel-size: 2`)",
                     None, path_text)
    words: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            if value:
                words.append(f"--{key}")
            elif f"--no-{key}" in option_strings:
                words.append(f"--no-{key}")
        elif isinstance(value, list):
            if value:
                words += [f"--{key}", *(str(v) for v in value)]
        elif isinstance(value, dict):
            words += [f"--{key}", json.dumps(value)]
        else:
            words += [f"--{key}", str(value)]
    return words


_KEY = re.compile(r"(?<=--)[^\.]*")


def _preprocess(argv: list[str], option_strings: set[str], notes: list[str]) -> list[str]:
    """The word rewriting of ``FlexibleArgumentParser.parse_args`` for ``["serve", *argv]``, less ``serve``."""
    args = ["serve", *argv]
    at = next((i for i, a in enumerate(args) if re.match(r"^--model(=.+|$)", a)), None)
    if at is not None:
        if args[at] == "--model":
            if at + 1 >= len(args):
                raise _error("argument --model: expected one argument", "give the model directory")
            tag, rest = args[at + 1], at + 2
        else:
            tag, rest = args[at].removeprefix("--model="), at + 1
        args = ["serve", tag, *args[1:at], *args[rest:]]
        notes.append("note: vllm serve: the model given with --model is read as the positional model, as vLLM "
                     "does (it warns that --model will be removed)")
    if (len(args) > 1 and args[1].startswith("-") and not any(re.match(r"^--config(=.+|$)", a) for a in args)
            and any(re.match(r"^--served[-_]model[-_]name(=.+|$)", a) for a in args)):
        raise _error("vLLM refuses --served-model-name without a positional model",
                     "give the model first: -- <model dir> --served-model-name NAME ...")
    if "--config" in args:
        if args.count("--config") > 1:
            raise _error("vLLM takes one --config file; this line gives several", "merge them into one YAML file")
        index = args.index("--config")
        if index == len(args) - 1:
            raise _error("--config without a file", "give the YAML file after --config")
        config = _config_args(args[index + 1], option_strings)
        if len(args) > 1 and not args[1].startswith("-"):
            args = args[:2] + config + args[2:index] + args[index + 2:]
        elif "--model" in config:
            args = args[:1] + config + args[1:index] + args[index + 2:]
        else:
            raise _error("no model: vLLM needs it as the positional argument or as `model:` in the --config file",
                         "give the model directory first")
    elif any(a.startswith("--config=") for a in args):
        notes.append("warning: vllm serve: vLLM reads a --config file only when it is given as `--config FILE` "
                     "(two words); `--config=FILE` is accepted and its file not read, by vLLM and by kvpolicy")
    words: list[str] = []
    for i, arg in enumerate(args[1:], start=1):
        if arg.startswith("--"):
            if "=" in arg:
                key, value = arg.split("=", 1)
                words.append(_KEY.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + "=" + value)
            else:
                words.append(_KEY.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1))
        elif arg.startswith("-O") and arg != "-O":
            words += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            words.append("--optimization-level")
        else:
            words.append(arg)
    return _dotted(words, notes)


def _dotted(words: list[str], notes: list[str]) -> list[str]:
    """``--json-arg.key value`` (and ``--json-arg.key+ a,b``) merged into one ``--json-arg JSON``."""
    delete: set[int] = set()
    merged: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    duplicates: set[str] = set()
    for i, word in enumerate(words):
        if i in delete:
            continue
        if word.startswith("--") and "." not in word:
            name = word.split("=", 1)[0]
            (duplicates if name in seen else seen).add(name)
            continue
        if word.startswith("-") and "." in word:
            if "=" in word:
                word, value_text = word.split("=", 1)
                if "." not in word:
                    continue
            else:
                if i + 1 >= len(words):
                    raise _error(f"`{word}` without a value", "give its value after it")
                value_text = words[i + 1]
                delete.add(i + 1)
            if word.endswith("+"):
                word = word[:-1]
                value_text = json.dumps(value_text.split(","))
            key, *keys = word.split(".")
            if _LONG_NUMBER.fullmatch(value_text.strip()):  # vLLM's json.loads / int() raise ValueError on it
                raise _error(f"`{word}` takes a number of {len(value_text.strip())} characters, which vLLM "
                             "cannot read (Python converts at most 4300 digits; vLLM's configs take 64-bit "
                             "numbers)", "give a number of at most 19 digits", f"{WHERE} {word}")
            try:
                value: Any = json.loads(value_text)
            except json.JSONDecodeError:
                value = _human_int(value_text)
            except ValueError:  # JSON holding an integer of more than 4300 digits: vLLM's json.loads raises too
                raise _error(f"`{word}`'s value holds a number too long to read", "give numbers of at most 19 "
                             "digits", f"{WHERE} {word}") from None
            for k in reversed(keys):
                value = {k: value}
            duplicates |= {f"{key}.{d}" for d in _update(merged.setdefault(key, {}), value)}
            delete.add(i)
    out = [w for i, w in enumerate(words) if i not in delete]
    if duplicates:
        notes.append(f"warning: vllm serve: given more than once (the last wins, as in vLLM, which warns "
                     f"\"Found duplicate keys\"): {', '.join(sorted(duplicates))}")
    for key, value in merged.items():
        out += [key, json.dumps(value)]
    return out


# a decimal too long for any of vLLM's numbers (a 64-bit integer has at most 19 digits)
_LONG_NUMBER = re.compile(r"[-+]?\d{31,}(?:\.\d*)?(?:[eE][-+]?\d+)?[kKmMgGtT]?")


def _short(text: str) -> str:
    """A long value shown by its ends and its length, never whole (it may be thousands of digits)."""
    return text if len(text) <= 40 else f"{text[:16]}...{text[-8:]} ({len(text)} characters)"


def _human_int(text: str) -> Any:
    """vLLM's ``human_readable_int`` for a dotted value that is not JSON (``80g``: 80 * 10**9, ``2G``:
    2 * 2**30; a decimal with a binary suffix, or anything else, stays the text, as vLLM keeps it)."""
    if _LONG_NUMBER.fullmatch(text.strip()):
        return text  # not a number vLLM can read: int() refuses it (or float() makes it inf)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if m:
        number, suffix = m.groups()
        if suffix in "kmgt":
            return int(float(number) * {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[suffix])
        return int(number) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[suffix] if number.isdigit() else text
    try:
        return int(text.strip())
    except ValueError:
        return text


def _update(original: dict[str, Any], update: dict[str, Any]) -> set[str]:
    duplicates: set[str] = set()
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(original.get(k), dict):
            duplicates |= {f"{k}.{d}" for d in _update(original[k], v)}
        elif isinstance(v, list) and isinstance(original.get(k), list):
            original[k] += v
        else:
            if k in original:
                duplicates.add(k)
            original[k] = v
    return duplicates


def _unrecognized(message: str, options: set[str], version: str) -> InputError:
    words = message.split(":", 1)[1].split() if ":" in message else []
    first = next((w for w in words if w.startswith("-")), words[0] if words else "")
    close = difflib.get_close_matches(first.split("=", 1)[0], sorted(options), n=1)
    return _error(f"vLLM {version}'s `vllm serve` does not accept {' '.join(words)} (it would refuse this line: "
                  "\"unrecognized arguments\")",
                  (f"did you mean `{close[0]}`? " if close else "") + "remove it, or decide for the release that "
                  "takes it (--vllm-version); kvpolicy's own flags go before `--`",
                  f"{WHERE} {first}", "unknown-serve-argument")


def _typed(options: list[str], words: list[str]) -> str:
    """The spelling of an argument the line used (``--enable-sliding-window`` is not ``--disable-...``)."""
    return next((o for o in options if any(w == o or w.startswith(o + "=") for w in words)), options[0])


def parse_serve_args(argv: list[str], profile: str, version: str) -> ServeArgs:
    """The decision's inputs from ``argv`` (the words after ``vllm serve``) as release ``profile``
    (vLLM ``version``) parses them; an `InputError` located at ``vllm serve <argument>``."""
    try:
        actions = serve_actions(profile)
    except KeyError:
        raise _error(f"kvpolicy has no `vllm serve` arguments of profile `{profile}`",
                     "decide for a release profile (--vllm-version 0.34), or give the flags one by one") from None
    options = {o for a in actions.values() for o in a.get("options") or ()}
    notes: list[str] = []
    try:
        words = _preprocess(list(argv), options, notes)
    except RecursionError:  # dotted keys nested thousands deep: Python's JSON encoder recurses per level
        raise _error("a dotted argument is nested too deeply to read", "vLLM's configs are a few levels deep") from None
    parser = _parser(actions)
    try:
        ns = parser.parse_args(words)
    except _Refused as exc:
        text = str(exc)
        if text.startswith("unrecognized arguments"):
            raise _unrecognized(text, options, version) from None
        m = re.match(r"argument ([^:]+): (.*)", text, re.S)
        where = f"{WHERE} {m.group(1).split('/')[0]}" if m else WHERE
        raise _error(f"vLLM {version}'s parser refuses it: {m.group(2) if m else text}",
                     "fix the value as vLLM's `vllm serve --help` describes it", where) from None
    given = vars(ns)
    by_dest = {a["dest"]: a for a in actions.values()}
    for dest in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "block_size"):
        value = given.get(dest)
        if isinstance(value, int) and value < 1:  # vLLM's ParallelConfig/CacheConfig refuse it; `or 1` must not hide it
            typed = _typed(by_dest[dest].get("options") or [dest], words) if dest in by_dest else dest
            raise _error(f"{typed} {value}: vLLM refuses a {dest.replace('_', ' ')} below 1",
                         f"give {typed} 1 or more", f"{WHERE} {typed}")
    inputs: dict[str, Any] = {}
    for dest in ("dtype", "block_size", "kv_cache_dtype", "tensor_parallel_size", "kv_transfer_config",
                 "enable_extensible_kv_cache"):
        if dest in given:
            inputs[dest] = given[dest]
    if given.get("disable_sliding_window"):  # False (--enable-sliding-window, vLLM's default): nothing to say
        inputs["disable_sliding_window"] = True
    if given.get("disable_hybrid_kv_cache_manager") is not None:  # None (vLLM's default): the engine decides
        inputs["disable_hybrid_kv_cache_manager"] = given["disable_hybrid_kv_cache_manager"]
    model = given.get("model_tag") or given.get("model")
    if model is not None:
        inputs["model"] = model
    backend = given.get("attention_backend")
    if backend in ("", "None"):  # vLLM's optional_type: unset
        backend = None
    from_config = (given.get("attention_config") or {}).get("backend")
    if backend is not None and from_config is not None:
        raise _error("vLLM refuses --attention-backend together with attention_config.backend (\"attention_backend "
                     "and attention_config.backend are mutually exclusive\")", "give one of them",
                     f"{WHERE} --attention-backend")
    if (backend or from_config) is not None:
        inputs["attention_backend"] = backend or from_config
    if (given.get("attention_config") or {}).get("hisparse_config") is not None:
        inputs["hisparse"] = True
    for dest, why in NOT_MODELLED.items():
        value = given.get(dest)
        if value is None or value in _DEFAULT_VALUE_MEANS_UNSET.get(dest, ()) or (
                dest.endswith("_size") and value == 1):
            continue
        raise _error(f"the serve line sets {dest.replace('_', '-')}, which kvpolicy does not model: {why}",
                     "remove it from the line to decide without it, knowing the answer may differ from vLLM's",
                     f"{WHERE} --{dest.replace('_', '-')}", "unmodelled-serve-argument")
    ignored = tuple(sorted(
        _typed(by_dest[d].get("options") or [d], words) for d in given
        if d not in LAYOUT_ARGUMENTS and d not in ("pipeline_parallel_size",) and d in by_dest))
    dp = given.get("data_parallel_size")
    return ServeArgs(inputs=inputs, ignored=ignored, notes=tuple(notes), data_parallel_size=dp)
