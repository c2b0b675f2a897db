"""``kvpolicy dry-run``'s deployment in vLLM's own terms: ``--dtype``, a `vllm serve` line, the environment.

``kvpolicy dry-run [flags] -- <everything after 'vllm serve'>`` reads the serve line with the release's
parser (`kvpolicy.engine.vllm_args`); ``VLLM_*`` variables are read as the release reads them
(`kvpolicy.engine.vllm_env`). A kvpolicy flag given explicitly wins over both, and a note says so.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvpolicy.engine.cli.common import usage_error
from kvpolicy.engine.vllm_args import parse_serve_args
from kvpolicy.engine.vllm_env import read_vllm_env
from kvpolicy.engine.vllm_serve_facts import serve_actions
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.releases import ReleaseProfile, get_profile

__all__ = ["add_serve_flags", "apply_serve_line", "dtype_choices", "environment_inputs"]

# the dry-run flag each serve-line keyword lands on (args attribute, the flag's name)
_FLAG = {
    "dtype": ("dtype", "--dtype"),
    "block_size": ("block_size", "--block-size"),
    "kv_cache_dtype": ("kv_cache_dtype", "--kv-cache-dtype"),
    "tensor_parallel_size": ("tensor_parallel_size", "--tensor-parallel-size"),
    "kv_transfer_config": ("kv_transfer_config", "--kv-transfer-config"),
    "attention_backend": ("backend", "--attention-backend"),
    "enable_extensible_kv_cache": ("enable_extensible_kv_cache", "--enable-extensible-kv-cache"),
    "hisparse": ("hisparse", "--hisparse"),
    "disable_hybrid_kv_cache_manager": ("disable_hybrid_kv_cache_manager", "--disable-hybrid-kv-cache-manager"),
    "disable_sliding_window": ("disable_sliding_window", "--disable-sliding-window"),
}

_FALLBACK_DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")


def add_serve_flags(parser: argparse.ArgumentParser, group: Any) -> None:
    """``--dtype`` (in the KV cache group) and the serve line (everything after ``--``)."""
    group.add_argument("--dtype", metavar="DTYPE",
                       help="vLLM's --dtype, the model dtype (with --model or a serve line's model; not with "
                            "--spec, whose `dtype:` field says it): the release's choices, "
                            f"{', '.join(_FALLBACK_DTYPES)} in 0.24-0.34; auto (the default) as vLLM serves the "
                            "config's torch_dtype")
    parser.add_argument("serve_args", nargs="*", metavar="-- VLLM_SERVE_ARGS",
                        help="after `--`: everything after `vllm serve`, as you run it (the model directory, "
                             "--dtype, --block-size, --kv-cache-dtype, -tp, --kv-transfer-config, "
                             "--attention-backend / --attention-config, --config YAML...), read with the "
                             "release's own parser; arguments that do not bear on the layout are ignored "
                             "and listed; a flag of kvpolicy's wins over the line's")


def dtype_choices(release: ReleaseProfile) -> tuple[str, ...]:
    """What the release's ``vllm serve --dtype`` accepts."""
    try:
        choices = serve_actions(release.name)["--dtype"].get("choices")
    except KeyError:
        choices = None
    return tuple(choices) if choices else _FALLBACK_DTYPES


def _release(args: argparse.Namespace) -> ReleaseProfile:
    try:
        return get_profile(args.vllm_version)
    except InputError:
        raise  # the caller names --vllm-version


def _is_local(model: str) -> bool:
    return Path(model).expanduser().exists()


def apply_serve_line(args: argparse.Namespace) -> list[str]:
    """Fill the flags the user did not give from the serve line (``args.serve_args``), in place; return the
    notes to print. Raises `InputError` located at ``vllm serve <argument>`` or the flag."""
    notes: list[str] = []
    release = _release(args)
    if args.dtype is not None and args.dtype not in dtype_choices(release):
        raise usage_error("--dtype", f"{release.version_label}'s --dtype takes: {', '.join(dtype_choices(release))}; "
                          f"not `{args.dtype}`", "e.g. --dtype bfloat16")
    if not args.serve_args:
        if args.dtype is not None and args.model is None:
            raise usage_error("--dtype", "applies to a model (--model, or the model of a serve line after --)",
                              "a --spec file states the dtype in its `dtype:` field; the built-in example is "
                              "bfloat16")
        return notes
    if args.spec is not None:
        raise usage_error("--spec", "--spec and a serve line both describe the KV cache",
                          "give the model on the serve line (its directory), or --spec without a serve line")
    version = release.vllm_versions[0] if release.vllm_versions else release.name
    words = list(args.serve_args)
    for head in (["vllm", "serve"], ["serve"]):  # the command itself, pasted with its arguments
        if words[:len(head)] == head and not _is_local(words[0]):
            words = words[len(head):]
            notes.append(f"note: vllm serve: `{' '.join(head)}` at the start of the line is read as the command, "
                         "not as arguments")
            break
    line = parse_serve_args(words, release.name, version)
    notes += line.notes
    inputs = dict(line.inputs)
    model = inputs.pop("model", None)
    if model is None and args.model is None:
        raise usage_error("vllm serve", "the serve line names no model (vLLM would serve its default, a hub id "
                          "kvpolicy does not download)", "put the model's local directory first: -- ./Llama ...")
    if model is not None:
        if args.model is not None:
            notes.append(f"note: --model {args.model} wins over the serve line's model `{model}`")
        elif not _is_local(model):
            raise usage_error(f"vllm serve {model}", f"`{model}` is not a local directory; kvpolicy does not "
                              "download models from the hub", "put its config.json in a local directory and give "
                              "that directory (or the file) as the model")
        else:
            args.model = model
    if inputs.get("kv_transfer_config") is not None and (args.connector is not None
                                                         or args.connector_config is not None):
        given = "--connector" if args.connector is not None else "--connector-config"
        notes.append(f"note: {given} wins over the serve line's --kv-transfer-config")
        inputs.pop("kv_transfer_config")
    for key, value in inputs.items():
        attr, flag = _FLAG[key]
        mine = getattr(args, attr)
        if mine is None:
            setattr(args, attr, value)
        elif mine != value:
            notes.append(f"note: {flag} {_show(mine)} wins over the serve line's {_show(value)}")
    if line.ignored:
        notes.append("note: vllm serve: ignored, they do not bear on the KV cache layout: " + ", ".join(line.ignored))
    if line.data_parallel_size not in (None, 1):
        notes.append(f"note: vllm serve: data-parallel size {line.data_parallel_size}: every data-parallel rank "
                     "runs its own engine with this same layout")
    return notes


def _show(value: Any) -> str:
    if isinstance(value, dict):
        import json

        return json.dumps(value)
    return str(value)


def environment_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The keywords the ``VLLM_*`` environment gives the decision (flags win), and the notes."""
    reading = read_vllm_env(os.environ, _release(args), layout_flag=args.vllm_kv_cache_layout,
                            v2_runner_flag=args.use_v2_model_runner,
                            chunked_local_flag=getattr(args, "allow_chunked_local_attn_with_hybrid_kv_cache", None))
    return reading.inputs, list(reading.notes)
