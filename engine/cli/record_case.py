"""``kvpolicy dry-run ... --record-test FILE``: today's decision for a deployment, kept as a policy test case.

OPA users write tests from real inputs (`opa eval --input` then a `test_` rule); here one flag turns
a dry-run into a case of the existing format (`kvpolicy.engine.policy_tests.cases`): the deployment
as ``input`` (a ``--model`` path relative to the case file, as case files resolve it), and as
``expect`` the chosen ``layout``, for each removed layout the rules that removed it, and the audit-mode
rules that report a finding (``audit``); or, when no
layout survives, ``error: no-layout``. ``kvpolicy test`` then fails the day a rule edit changes that
decision. The case is appended to FILE (created with ``version: 1``, and its directory, if absent), so the comments and
cases already there stay as written; the new text is read back before the file is replaced (at once), and a text
that would not hold the cases already there plus this one is never written. The case holds every input of the
decision (an explicit false, the platform however it was told, the VLLM_* environment's part), and the note
names the `kvpolicy test` command that checks it under the same rule layers and release.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpolicy.engine.cli.common import usage_error
from kvpolicy.policy.errors import Diagnostic, PolicyError
from kvpolicy.policy.files import read_capped, write_atomically
from kvpolicy.policy.yaml_source import Limits

__all__ = ["Resolved", "case_input", "record_case"]


def _given(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys a case reads the same when absent (its field's default): an explicit false
    (``--enable-hybrid-kv-cache-manager``, ``--allow-chunked-local-attn-with-hybrid-kv-cache 0``) is kept."""
    from kvpolicy.engine.policy_tests.cases import CaseInput

    fields = CaseInput.model_fields
    return {k: v for k, v in data.items() if v is not None and not (k in fields and v == fields[k].default
                                                                     and type(v) is type(fields[k].default))}


@dataclass(frozen=True)
class Resolved:
    """What dry-run worked out from its flags, that a case records as given: the platform, the --spec
    file's content, --connector-prefers-cross-layer-blocks as build_context takes it."""

    device: str
    spec_source: dict[str, Any] | None
    preferences: bool | dict[str, bool] | None
    env_inputs: dict[str, Any] = field(default_factory=dict)  # what the VLLM_* environment set (flags win)


def case_input(args: argparse.Namespace, case_file: Path, resolved: Resolved) -> dict[str, Any]:
    """The ``input`` mapping of a case for the deployment dry-run's flags describe (the built-in example's
    values where it stands in)."""
    from kvpolicy.engine.inputs import DEFAULT_EXAMPLE

    device = resolved.device
    example = args.model is None and args.spec is None
    data: dict[str, Any] = {}
    if args.model is not None:
        model = Path(args.model).resolve()
        # relative to the case file (as cases resolve it) when both lie in the working tree, so the pair can move
        inside = model.is_relative_to(Path.cwd().resolve()) and case_file.resolve().is_relative_to(Path.cwd().resolve())
        data["model"] = os.path.relpath(model, case_file.resolve().parent) if inside else str(model)
        data["tensor_parallel_size"] = args.tensor_parallel_size if args.tensor_parallel_size not in (None, 1) \
            else None
        data["dtype"] = getattr(args, "dtype", None)
    elif resolved.spec_source is not None:
        source = resolved.spec_source
        if "groups" in source:
            data["groups"] = [g.model_dump(mode="json") if hasattr(g, "model_dump") else g for g in source["groups"]]
        else:
            data["spec"] = dict(source["spec"])
    else:
        data["spec"] = dict(DEFAULT_EXAMPLE["spec"])
    dtype = args.kv_cache_dtype
    if example and dtype is None:
        dtype = DEFAULT_EXAMPLE["kv_cache_dtype"] if device == "cuda" else "auto"
    backend = args.backend
    if example and backend is None and args.worker_attention_backends is None and device == "cuda":
        backend = DEFAULT_EXAMPLE["backend"]
    connector = args.connector
    if example and connector is None and args.kv_transfer_config is None:
        connector = DEFAULT_EXAMPLE["connector"]
    data.update({
        "kv_cache_dtype": dtype,
        "block_size": args.block_size,
        "attention_backend": backend,
        "worker_attention_backends": args.worker_attention_backends,
        "scale_views": args.scale_views,
        "connector": connector,
        "connector_config": args.connector_config,
        "kv_transfer_config": args.kv_transfer_config,
        "connector_module_path": getattr(args, "connector_module_path", None),
        "vllm_version": args.vllm_version,
        "vllm_kv_cache_layout": args.vllm_kv_cache_layout,
        "enable_extensible_kv_cache": bool(args.enable_extensible_kv_cache),
        "hisparse": bool(args.hisparse),
        "device_capability": args.device_capability,
        "cpu": getattr(args, "cpu", None),
        "use_v2_model_runner": bool(args.use_v2_model_runner),
        "connector_prefers_cross_layer_blocks": resolved.preferences,
    })
    # the VLLM_* environment's part of the decision, kept in the case (a test must not read the environment);
    # applied as dry-run applies it (`context_from_args`): the variables, then the flags that win over them
    data.update(resolved.env_inputs)
    if args.disable_sliding_window:
        data["disable_sliding_window"] = True
    if args.disable_hybrid_kv_cache_manager is not None:
        data["disable_hybrid_kv_cache_manager"] = args.disable_hybrid_kv_cache_manager
    if args.allow_chunked_local_attn_with_hybrid_kv_cache is not None:
        data["allow_chunked_local_attn_with_hybrid_kv_cache"] = bool(args.allow_chunked_local_attn_with_hybrid_kv_cache)
    if device != "cuda" or args.device is not None:  # the platform decided, however it was told (VLLM_TARGET_DEVICE)
        data["device"] = device
    return _given(data)


def _expect(decision: Any, error: PolicyError | None) -> dict[str, Any]:
    if decision is None:
        from kvpolicy.engine.policy_tests.runner import error_codes

        return {"error": error_codes(error)[0] if error is not None else "no-layout"}
    removed = {str(layout): sorted({rule.id for rule, _scope in hits}) for layout, hits in decision.eliminated.items()}
    audit = list(dict.fromkeys(f.rule.id for f in decision.audit))
    return {"layout": str(decision.layout), **({"removed": removed} if removed else {}),
            **({"audit": audit} if audit else {})}


def _name(data: dict[str, Any], expect: dict[str, Any]) -> str:
    what = data.get("model") or ("groups" if "groups" in data else "spec")
    parts = [Path(str(what)).name if "model" in data else str(what), data.get("kv_cache_dtype"),
             data.get("attention_backend"), data.get("connector"), data.get("vllm_version")]
    outcome = f"takes {expect['layout']}" if "layout" in expect else f"is refused ({expect['error']})"
    return ", ".join(str(p) for p in parts if p) + " " + outcome


def _check_command(args: argparse.Namespace, path: Path, data: dict[str, Any]) -> str:
    """The `kvpolicy test` command that checks the recorded case as it was decided: the same rule layers
    (--rules, --no-shipped-rules) and release profile, so every rule the case names is in force; quoted
    for a POSIX shell."""
    words = ["kvpolicy", "test"]
    for rules in getattr(args, "rules", None) or []:
        words += ["--rules", str(rules)]
    if getattr(args, "no_shipped_rules", False):
        words.append("--no-shipped-rules")
    if data.get("vllm_version") is not None:
        words += ["--vllm-version", str(data["vllm_version"])]
    words.append(str(path))
    return shlex.join(words)


def _appended(before: str | None, case: dict[str, Any], shown: str) -> str | None:
    """The file's text with ``case`` appended as the last item of its `cases:` list, or None when the text
    so made would not read back as the same cases plus this one (a file whose `cases:` list is not its last
    key, or is in flow style)."""
    from kvpolicy.engine.policy_tests.cases import CASE_LIMITS
    from kvpolicy.policy.yaml_source import parse_yaml

    dumped = yaml.safe_dump([case], sort_keys=False, default_flow_style=None, width=100, allow_unicode=True)
    indented = "".join("  " + line if line.strip() else line for line in dumped.splitlines(keepends=True))
    text = before if before is not None else "version: 1\ncases:\n"
    if text and not text.endswith("\n"):
        text += "\n"
    old, _ = parse_yaml(text, shown, CASE_LIMITS) if before is not None else (None, [])
    new, _ = parse_yaml(text + indented, shown, CASE_LIMITS)
    old_cases = old.data.get("cases") if old is not None and isinstance(old.data, dict) else []
    new_cases = new.data.get("cases") if new is not None and isinstance(new.data, dict) else None
    if not isinstance(old_cases, list) or not isinstance(new_cases, list) or new_cases != [*old_cases, case]:
        return None
    return text + indented


def record_case(args: argparse.Namespace, resolved: Resolved, decision: Any, error: PolicyError | None = None) -> str:
    """Append the case for this dry-run to ``args.record_test``; returns the note to print (on stderr).
    The file is replaced at once (`write_atomically`) and only when the append reads back as intended:
    a failed append leaves it as it was."""
    from pydantic import ValidationError

    from kvpolicy.engine.policy_tests.cases import PolicyCase, load_cases

    path = Path(args.record_test)
    data = case_input(args, path, resolved)
    if decision is not None and args.cpu is None and decision.context.backend.write_isa and "cpu" not in data:
        from kvpolicy.policy.cpu_kernel import CpuHost

        data["cpu"] = CpuHost.this_host().label  # the host whose kernel order was decided (dry-run's note says it)
    expect = _expect(decision, error)
    name = args.record_name or _name(data, expect)
    before = None
    if path.exists():  # read as every case file is (bounded; a FIFO or device such as /dev/full is refused, not read)
        before, problems = read_capped(path, str(path), Limits().max_file_bytes)
        if before is None:
            raise usage_error("--record-test", f"cannot read `{path}`: {problems[0].message}",
                              "record into a policy test file (YAML), or a new path")
    if before is not None and name in {c.case.name for c in load_cases([path])}:
        raise usage_error("--record-test", f"`{path}` already has a case named `{name}`",
                          "pass --record-name NAME, or edit the case in the file")
    case = {"name": name, "input": data, "expect": expect}
    try:
        PolicyCase.model_validate(case)
    except ValidationError as exc:  # a deployment the case format cannot hold: say so rather than write it
        raise usage_error("--record-test", f"this deployment cannot be recorded as a policy test case: "
                          f"{exc.errors()[0]['msg']}", "write the case by hand (docs/cli.md)") from None
    text = _appended(before, case, str(path))
    if text is None:
        raise usage_error("--record-test", f"cannot append a case to `{path}`: its `cases:` list is not the "
                          "file's last key in block style, so the case would not land in it",
                          "record into a case file whose `cases:` list is its last key, in block style")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):  # the path was right: exit 1, as --svg
            raise PolicyError("", [Diagnostic("--record-test", 0, 0, "write-failed",
                                              f"cannot write `{path}`: {exc.strerror}",
                                              "the file is as it was; free space on that disk, run again")]) from None
        raise usage_error("--record-test", f"cannot write `{path}`: {exc.strerror or exc}",
                          "the file is as it was; pass a path you can write (free space, fix permissions)") from None
    return f"recorded: case `{name}` in {path} (`{_check_command(args, path, data)}` checks it)"
