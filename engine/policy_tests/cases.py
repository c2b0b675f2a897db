"""Policy test cases: the YAML format, loading with positions, and the inputs they describe.

A case file (``rules/tests/*.yaml``; the format is documented in docs/cli.md)::

    version: 1
    cases:
      - name: offloading with fp8 per-token-head stays per-layer
        input: {spec: {num_layers: 24, block_size: 16, num_kv_heads: 2, head_size: 64},
                kv_cache_dtype: fp8_per_token_head, connector: OffloadingConnector}
        expect:
          layout: per_layer/NHD
          removed: {cross_layer/NHD: [per-token-head-forbids-cross-layer]}

`load_cases` parses with positions (`kvpolicy.policy.yaml_source.parse_yaml`) and
validates every file, collecting every problem located at file:line:col.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from kvpolicy.engine.decide import BACKEND_GEOMETRY, RELEASE_CANDIDATES
from kvpolicy.engine.inputs import build_context, parse_device_capability
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.context import Context
from kvpolicy.policy.cpu_kernel import CpuHost
from kvpolicy.policy.errors import Diagnostic, InputError, PolicyError, shown_file
from kvpolicy.policy.files import read_capped
from kvpolicy.policy.layouts import Layout, LayoutName, LayoutPattern
from kvpolicy.policy.load import RULE_FILE_SUFFIXES
from kvpolicy.policy.releases import ReleaseProfile, get_profile
from kvpolicy.policy.ruleset import RuleSet
from kvpolicy.policy.spec import AttentionKind, Frozen, KVCacheGroup, KVCacheGroups, KVCacheSpec, make_model
from kvpolicy.policy.validate import located_validation_errors
from kvpolicy.policy.yaml_source import Limits, Located, parse_yaml

__all__ = [
    "CaseFile",
    "CaseInput",
    "Expect",
    "GroupInput",
    "LoadedCase",
    "PolicyCase",
    "PolicyTestError",
    "case_files",
    "context_for",
    "groups_from_data",
    "load_cases",
]



class PolicyTestError(PolicyError):
    """Policy test files that cannot be read or do not validate (every problem, located)."""


# ---------------------------------------------------------------------------------------------
# The case format


class GroupInput(Frozen):
    """One KV cache group of a hybrid model: a spec, its attention-group count, its DCP sharding."""

    spec: dict[str, Any] = Field(description="KVCacheSpec fields (num_layers, block_size, num_kv_heads, ...)")
    num_attention_groups: StrictInt = Field(default=1, ge=1, description="attention backends in this group")
    dcp_sharded: StrictBool = Field(default=True, description="vLLM's `dcp_sharded`: decode context parallelism shards "
                              "this cache's tokens; false for a replicated draft model's cache")


class CaseInput(Frozen):
    """The deployment a case decides for: the keywords of `kvpolicy.engine.inputs.build_context`.

    Exactly one of ``model`` (a config.json, relative to the case file),
    ``spec`` (one group) or ``groups`` (several) describes the KV cache.
    """

    model: str | None = Field(default=None, description="HF config.json or its directory, relative to the case file")
    spec: dict[str, Any] | None = Field(default=None, description="KVCacheSpec fields of the single group")
    groups: list[GroupInput] | None = Field(default=None, min_length=1, description="several KV cache groups")
    kv_cache_dtype: str | None = Field(default=None, description="vLLM's --kv-cache-dtype; overrides the spec's")
    block_size: StrictInt | None = Field(default=None, gt=0, description="tokens per block; overrides the spec's")
    attention_backend: str | None = Field(
        default=None, description="vLLM's attention backend enum name (default: the first of "
        "`worker_attention_backends`, else TRITON_ATTN)")
    backend: str | None = Field(default=None, description="alias of `attention_backend`")
    worker_attention_backends: list[list[str]] | None = Field(
        default=None, description="each worker's attention backends (pipeline stages may differ); the candidates "
        "are the layouts all of them support, merged as vLLM merges the workers' lists")
    scale_views: ScaleViews | None = Field(default=None, description="override the backend's scale-view strategy")
    connector: str | None = Field(default=None, description="KV connector class name; absent: no connector")
    connector_config: dict[str, Any] | None = Field(default=None, description="vLLM's kv_connector_extra_config")
    kv_transfer_config: dict[str, Any] | None = Field(
        default=None, description="vLLM's whole --kv-transfer-config (instead of connector/connector_config)")
    connector_module_path: str | None = Field(
        default=None, min_length=1, description="vLLM's kv_connector_module_path: `connector` is a class of your own "
        "in this module (not one the release registers); without it such a name is refused, as vLLM refuses it")
    tensor_parallel_size: StrictInt = Field(default=1, ge=1, description="with `model` only")
    dtype: str | None = Field(default=None, description="vLLM's --dtype, with `model` only (auto: as vLLM serves "
                              "the config's torch_dtype)")
    vllm_version: str | None = Field(
        default=None, min_length=1,
        description="the vLLM release profile (`vllm-0.34`, `0.34.0`, or a patch release such as `0.28.1`: its "
                    "series' profile, said as a warning); default: the rule set's")
    vllm_kv_cache_layout: str | None = Field(
        default=None, description="vLLM's `VLLM_KV_CACHE_LAYOUT`: one of the six layouts, or NHD / HND")
    enable_extensible_kv_cache: StrictBool = Field(default=False, description="vLLM's `enable_extensible_kv_cache`")
    hisparse: StrictBool = Field(default=False, description="`attention_config.hisparse_config` is set")
    device: Literal["cuda", "cpu"] | None = Field(
        default=None, description="vLLM's platform: `cuda` (default) or `cpu` (the backend its CPU platform selects)")
    device_capability: StrictInt | None = Field(
        default=None, description="the CUDA compute capability's major number (10 for 10.0); `9.0` is accepted")
    cpu: str | None = Field(
        default=None, description="the host CPU vLLM's CPU attention runs on, whose cache-write kernel orders a "
        "block's bytes (the fingerprint's kernel_order): `x86`, `x86+avx512`, `x86+avx512+amx`, `arm`, `power`, "
        "`s390x`, `riscv`, `riscv+rvv`; absent: the machine kvpolicy runs on")

    @field_validator("cpu", mode="before")
    @classmethod
    def _cpu_label(cls, value: Any) -> Any:
        """A CPU label, checked as `CpuHost.parse` checks it and written as its canonical label."""
        if not isinstance(value, str):
            return value  # a number, a mapping: the type error says it
        try:
            return CpuHost.parse(value, "cpu").label
        except InputError as exc:
            d = exc.diagnostics[0]
            raise ValueError(f"`cpu`: {d.message} ({d.help})") from None

    @field_validator("device_capability", mode="before", json_schema_input_type=int | float | str | None)
    @classmethod
    def _capability_major(cls, value: Any) -> Any:
        """``10``, ``10.0`` or ``"10.0"`` -> 10; anything else (a boolean, ``.inf``, ``0.5``) is an error."""
        if isinstance(value, float):
            if not math.isfinite(value) or value < 1:
                raise ValueError(f"`{value}` is not a CUDA compute capability such as 9.0 or 10.0")
            return int(value)
        if isinstance(value, str):
            major = parse_device_capability(value)
            if major is None:
                raise ValueError(f"`{value}` is not a CUDA compute capability such as 9.0 or 10.0")
            return major
        return value

    @field_validator("vllm_version", mode="before")
    @classmethod
    def _version_is_text(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"write the vLLM version as a string (`\"{value}\"`): YAML reads `{value}` as a number, "
                             "and `0.30` would become 0.3")
        return value

    use_v2_model_runner: StrictBool = Field(default=False, description="vLLM's `VllmConfig.use_v2_model_runner` "
                                      "(0.28: the V2 runner never allocates cross-layer)")
    allow_chunked_local_attn_with_hybrid_kv_cache: StrictBool = Field(
        default=True, description="vLLM's VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE (default true); "
        "false: a model with chunked local attention runs without the hybrid KV cache manager")
    disable_sliding_window: StrictBool = Field(
        default=False, description="vLLM's --disable-sliding-window, with `model` only: no layer keeps a window")
    disable_hybrid_kv_cache_manager: StrictBool | None = Field(
        default=None, description="vLLM's SchedulerConfig.disable_hybrid_kv_cache_manager: null lets vLLM decide; "
        "true (--disable-hybrid-kv-cache-manager): sliding-window and chunked-local layers cached as full "
        "attention in one group (a Mamba hybrid: refused, as vLLM fails to start); false "
        "(--enable-hybrid-kv-cache-manager): kept on past a connector without SupportsHMA")
    connector_prefers_cross_layer_blocks: StrictBool | dict[str, StrictBool] | None = Field(
        default=None, description="the connector class's own `prefer_cross_layer_blocks` (vLLM 0.24-0.28's gate "
        "asks it): true/false for the connector, or connector names (MultiConnector members) to true/false")

    @model_validator(mode="after")
    def _one_source(self) -> CaseInput:
        given = [k for k in ("model", "spec", "groups") if getattr(self, k) is not None]
        if len(given) != 1:
            found = ", ".join(f"`{k}`" for k in given) or "none"
            raise ValueError(f"an input needs exactly one of `model`, `spec`, `groups`; found {found}")
        if (self.backend is not None and self.attention_backend is not None
                and self.backend.upper() != self.attention_backend.upper()):
            raise ValueError("give `attention_backend` or its alias `backend`, not both")
        return self




def _pattern(value: Any) -> Any:
    if isinstance(value, str):
        return LayoutPattern(layout=(Layout.parse(value),))  # ValueError names the valid layouts
    return value


def _layout_name(value: str) -> str:
    return str(Layout.parse(value))


class Expect(Frozen):
    """What the decision must be; every key is optional, at least one is required."""

    layout: LayoutPattern | None = Field(
        default=None, description="the chosen layout, `per_layer/NHD`, or a pattern `{placement: per_layer}`"
    )
    survivors: list[str] | None = Field(default=None, description="the surviving layouts, best first (exact)")
    removed: dict[str, list[str]] | None = Field(
        default=None, description="layout -> rule ids that must have removed it ([]: removed by some rule)"
    )
    matched: list[str] = Field(default_factory=list, description="rule ids that must match (in some scope)")
    not_matched: list[str] = Field(default_factory=list, description="rule ids that must not match in any scope")
    audit: list[str] = Field(default_factory=list, description="audit-mode rules (`enforcement: audit`) that must "
                             "report a finding for this input (exactly these: [] with another key, none)")
    error: str | None = Field(
        default=None, description="the decision must fail: `no-layout`, `invalid-input`, `invalid-model-config`, "
                                  "or the code of one of the error's diagnostics (e.g. `unknown-backend`)")

    @field_validator("layout", mode="before", json_schema_input_type=LayoutName | LayoutPattern | None)
    @classmethod
    def _layout(cls, value: Any) -> Any:
        return _pattern(value)

    @field_validator("survivors", mode="before")
    @classmethod
    def _survivors(cls, value: Any) -> Any:
        return [_layout_name(v) for v in value] if isinstance(value, list) and all(
            isinstance(v, str) for v in value) else value

    @field_validator("removed", mode="before")
    @classmethod
    def _removed(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {_layout_name(k) if isinstance(k, str) else k: ([] if v is None else v) for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Expect:
        if self.error is not None and (self.layout is not None or self.survivors is not None):
            raise ValueError("`error` cannot be combined with `layout` or `survivors`: no layout is chosen")
        if not (self.layout or self.survivors is not None or self.removed or self.matched or self.not_matched
                or self.error or self.audit):
            raise ValueError("`expect` needs at least one of `layout`, `survivors`, `removed`, `matched`, "
                             "`not_matched`, `error`, `audit`")
        return self

    @property
    def rule_ids(self) -> list[tuple[tuple[Any, ...], str]]:
        """(path inside ``expect``, rule id) for every rule the expectation names."""
        out = [(("matched", i), r) for i, r in enumerate(self.matched)]
        out += [(("not_matched", i), r) for i, r in enumerate(self.not_matched)]
        out += [(("audit", i), r) for i, r in enumerate(self.audit)]
        for layout, ids in (self.removed or {}).items():
            out += [(("removed", layout, i), r) for i, r in enumerate(ids)]
        return out


class PolicyCase(Frozen):
    """One named case: an input and what the rule set must decide for it."""

    name: str = Field(min_length=1, description="shown in the report; unique within a file")
    input: CaseInput
    expect: Expect


class CaseFile(Frozen):
    """One policy test file."""

    version: Literal[1] = Field(description="format version; currently 1")
    cases: list[PolicyCase] = Field(min_length=1)



class _CaseFileHeader(Frozen):
    """`CaseFile` with its cases left unchecked: the file-level keys alone."""

    version: Literal[1]
    cases: list[Any] = Field(min_length=1)


# ---------------------------------------------------------------------------------------------
# Loading


_KEYS: dict[str, tuple[str, ...]] = {
    "file": tuple(CaseFile.model_fields),
    "case": tuple(PolicyCase.model_fields),
    "input": tuple(CaseInput.model_fields),
    "expect": tuple(Expect.model_fields),
    "group": tuple(GroupInput.model_fields),
    "pattern": tuple(LayoutPattern.model_fields),
}


def _keys_at(path: tuple[Any, ...]) -> tuple[str, ...]:
    if not path:
        return _KEYS["file"]
    last = path[-1]
    if isinstance(last, int) and len(path) >= 2:
        return {"cases": _KEYS["case"], "groups": _KEYS["group"]}.get(path[-2], ())
    return {"input": _KEYS["input"], "expect": _KEYS["expect"], "layout": _KEYS["pattern"]}.get(last, ())


@dataclass(frozen=True)
class LoadedCase:
    """A validated case stamped with where it is written (OPA's conformance cases do the same)."""

    case: PolicyCase
    src: Located
    index: int

    @property
    def file(self) -> str:
        return self.src.file

    @property
    def line(self) -> int:
        return self.src.position(("cases", self.index))[0]

    @property
    def location(self) -> str:
        return f"{shown_file(self.file)}:{self.line}"  # one line of valid text, whatever the file's name

    @property
    def base_dir(self) -> Path:
        return Path(self.src.file).parent

    def diag(self, path: tuple[Any, ...], code: str, message: str, help: str | None = None) -> Diagnostic:
        return self.src.diag(("cases", self.index, *path), code, message, help)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it, else as given."""
    try:
        rel = path.resolve().relative_to(Path.cwd().resolve())
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return str(path)
    return str(rel)


# Case files are read whole and their YAML is composed in memory: the same caps as a rule file's.
CASE_LIMITS = Limits()


def case_files(paths: Iterable[str | os.PathLike[str]]) -> tuple[list[Path], list[Diagnostic]]:
    """The case files named by ``paths`` (files, or directories of ``*.yaml``), sorted per directory.

    Every ``*.yaml`` entry of a directory is returned, whatever it is, so that reading it reports
    a directory, a FIFO or a link loop named like a case file instead of skipping it silently.
    """
    files: list[Path] = []
    diags: list[Diagnostic] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            try:
                found = sorted(x for x in p.iterdir() if x.suffix in RULE_FILE_SUFFIXES)
            except OSError as exc:
                diags.append(Diagnostic(_shown(p), 0, 0, "unreadable",
                                        f"cannot list the directory: {exc.strerror or exc}", "check its permissions"))
                continue
            if not found:
                diags.append(Diagnostic(_shown(p), 0, 0, "no-test-files", "no `.yaml` policy test files here",
                                        "write cases in `<rules>/tests/*.yaml` (see docs/cli.md)"))
            files += found
        elif p.exists() or p.is_symlink():
            files.append(p)  # a file, or something that is not one: reading it says which
        else:
            diags.append(Diagnostic(_shown(p), 0, 0, "not-found", "no such file or directory",
                                    "pass policy test files or directories holding them"))
    return files, diags


RuleRef = tuple[Located, tuple[Any, ...], str]  # where an expectation names a rule id, and the id


def _rule_refs(src: Located, index: int, data: Any) -> list[RuleRef]:
    """The rule ids an ``expect`` block names, read even where the rest of its case is broken."""
    try:
        expect = Expect.model_validate(data)
    except (ValidationError, ValueError):
        return []
    return [(src, ("cases", index, "expect", *path), rule_id) for path, rule_id in expect.rule_ids]


def _load_file(path: Path) -> tuple[list[LoadedCase], list[Diagnostic], list[RuleRef]]:
    """One file's valid cases, every problem in it, and every rule id its expectations name."""
    shown = _shown(path)
    text, diags = read_capped(path, shown, CASE_LIMITS.max_file_bytes)
    if text is None:
        return [], diags, []
    src, diags = parse_yaml(text, shown, CASE_LIMITS)
    if src is None or src.is_invalid(()):
        return [], diags, []
    if not isinstance(src.data, dict):
        return [], [*diags, src.diag((), "not-a-mapping", "a policy test file is a mapping",
                                     "start the file with `version: 1` and a `cases:` list")], []
    raw_cases = src.data.get("cases")
    if isinstance(src.data.get("version"), bool):  # pydantic's Literal[1] takes `true` (True == 1)
        diags.append(src.diag(("version",), "invalid-value",
                              f"expected 1, got boolean `{src.yaml11_bools.get(('version',), 'true')}`",
                              "write `version: 1`"))
    try:  # the file's own keys; its cases are checked one by one below, so one cannot hide another
        _CaseFileHeader.model_validate(src.data)
    except ValidationError as exc:
        diags += located_validation_errors(src, (), src.data, exc, valid_keys=_keys_at)
    cases: list[LoadedCase] = []
    refs: list[RuleRef] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_cases if isinstance(raw_cases, list) else []):
        if src.is_invalid(("cases", i)):
            continue
        name = raw.get("name") if isinstance(raw, dict) else None
        if isinstance(name, str) and name in seen:  # read raw: a broken case still owns its name
            diags.append(src.diag(("cases", i, "name"), "duplicate-case",
                                  f"case `{name}` is already defined at line {seen[name]}",
                                  "give each case of a file its own name"))
        elif isinstance(name, str):
            seen[name] = src.position(("cases", i))[0]
        try:
            case = PolicyCase.model_validate(raw)
        except ValidationError as exc:
            diags += [_model_hint(d, raw) for d in located_validation_errors(src, ("cases", i), raw, exc,
                                                                             valid_keys=_keys_at)]
            if isinstance(raw, dict):
                refs += _rule_refs(src, i, raw.get("expect"))
            continue
        cases.append(LoadedCase(case, src, i))
        refs += [(src, ("cases", i, "expect", *p), r) for p, r in case.expect.rule_ids]
    return cases, diags, refs


def _model_hint(diag: Diagnostic, raw: Any) -> Diagnostic:
    """A case's ``model`` written as KV spec fields: say that ``model`` names a config.json and ``spec`` takes them."""
    model = raw.get("input", {}).get("model") if isinstance(raw, dict) and isinstance(raw.get("input"), dict) else None
    if isinstance(model, dict) and diag.code == "invalid-value" and diag.message.startswith("expected a valid string"):
        return replace(diag, message=f"{diag.message}: `model` names a Hugging Face config.json (or its directory)",
                       help="write KV cache spec fields under `spec:` instead (`spec: {num_layers: 32, ...}`), or "
                            "give `model` the path of a config.json, relative to the case file")
    return diag


# What the engine itself names in removals, beside the rules: the release's candidate filter.
BUILTIN_RULE_IDS = (RELEASE_CANDIDATES, BACKEND_GEOMETRY)


def _check_rule_ids(refs: list[RuleRef], ruleset: RuleSet) -> list[Diagnostic]:
    known = sorted(r.id for r in ruleset.all_rules) + list(BUILTIN_RULE_IDS)
    diags = []
    for src, path, rule_id in refs:
        if rule_id not in known:
            close = difflib.get_close_matches(rule_id, known, n=1)
            elsewhere = _profiles_with_rule(rule_id)
            if elsewhere:
                hint = (f"`{rule_id}` is a shipped rule of {', '.join(f'`{p}`' for p in elsewhere)}: give the case "
                        f"`vllm_version: {elsewhere[0]}`, or run with --vllm-version {elsewhere[0]} "
                        f"(`kvpolicy inspect --vllm-version {elsewhere[0]}` lists that profile's rules)")
            elif close:
                hint = f"did you mean `{close[0]}`? (`kvpolicy inspect` lists the rules in force)"
            else:
                hint = "`kvpolicy inspect` lists the rules in force, with their layers and files"
            diags.append(src.diag(path, "unknown-rule",
                                  f"no rule `{rule_id}` in rule set `{shown_file(ruleset.root)}`", hint))
    return diags


def _profiles_with_rule(rule_id: str) -> list[str]:
    """The release profiles whose shipped rules hold ``rule_id`` (a case written for another release)."""
    from kvpolicy.engine.rule_layers import load_layers
    from kvpolicy.policy.releases import iter_profiles

    found = []
    for profile in iter_profiles():
        try:
            if any(r.id == rule_id for r in load_layers(vllm_version=profile).rules):
                found.append(profile.name)
        except PolicyError:  # a profile whose shipped rules do not load is not the user's problem here
            continue
    return found


def load_cases(paths: Iterable[str | os.PathLike[str]], ruleset: RuleSet | None = None) -> list[LoadedCase]:
    """Load and validate every case; raises `PolicyTestError` listing every problem of every file.

    With ``ruleset``, rule ids named in expectations must exist in it (checked in the same run,
    also in cases that have other problems).
    """
    files, diags = case_files(paths)
    cases: list[LoadedCase] = []
    refs: list[RuleRef] = []
    for path in files:
        loaded, problems, named = _load_file(path)
        cases += loaded
        diags += problems
        refs += named
    if ruleset is not None:
        diags += _check_rule_ids(refs, ruleset)
    if diags:
        raise PolicyTestError(f"{len(diags)} error(s) in policy test files", diags)
    if not cases:
        raise PolicyTestError("", [Diagnostic("<policy tests>", 0, 0, "no-test-files", "no policy test files given")])
    return cases


# ---------------------------------------------------------------------------------------------
# Inputs


def groups_from_data(
    groups: Sequence[GroupInput], *, kv_cache_dtype: str | None = None, block_size: int | None = None,
    default_block_size: int | None = None,
) -> KVCacheGroups:
    """`KVCacheGroups` from plain group data; ``kv_cache_dtype``/``block_size`` override every
    attention group's spec, as vLLM's flags do, and a spec without ``block_size`` gets
    ``default_block_size`` (the release's, as a single ``spec`` does). Raises `InputError` naming
    ``groups[i].spec``."""
    out = []
    for i, g in enumerate(groups):
        data = dict(g.spec)
        if default_block_size is not None:
            data.setdefault("block_size", default_block_size)
        if data.get("kind", "full") != AttentionKind.mamba.value:
            if kv_cache_dtype is not None:
                data["kv_cache_dtype"] = kv_cache_dtype
            if block_size is not None:
                data["block_size"] = block_size
        spec = make_model(KVCacheSpec, f"groups[{i}].spec", data)
        out.append(KVCacheGroup(spec=spec, num_attention_groups=g.num_attention_groups, dcp_sharded=g.dcp_sharded))
    return KVCacheGroups(groups=tuple(out))


def context_for(inp: CaseInput, base_dir: Path = Path("."), vllm_version: str | ReleaseProfile | None = None
                ) -> Context:
    """The decision `Context` for a case input (in profile ``vllm_version`` unless the case names
    one); raises `InputError` / `ModelConfigError`."""
    common: dict[str, Any] = {
        "attention_backend": inp.attention_backend if inp.attention_backend is not None else inp.backend,
        "worker_attention_backends": inp.worker_attention_backends,
        "scale_views": inp.scale_views.value if inp.scale_views else None,
        "connector": inp.connector,
        "connector_config": inp.connector_config,
        "kv_transfer_config": inp.kv_transfer_config,
        "vllm_version": inp.vllm_version if inp.vllm_version is not None else vllm_version,
        "vllm_kv_cache_layout": inp.vllm_kv_cache_layout,
        "enable_extensible_kv_cache": inp.enable_extensible_kv_cache,
        "hisparse": inp.hisparse,
        "device": inp.device,
        "device_capability": inp.device_capability,
        "cpu": inp.cpu,
        "use_v2_model_runner": inp.use_v2_model_runner,
        "allow_chunked_local_attn_with_hybrid_kv_cache": inp.allow_chunked_local_attn_with_hybrid_kv_cache,
        "disable_hybrid_kv_cache_manager": inp.disable_hybrid_kv_cache_manager,
        "connector_prefers_cross_layer_blocks": inp.connector_prefers_cross_layer_blocks,
    }
    # `tensor_parallel_size` goes to build_context with every source: with `spec` or `groups` it is
    # refused there (a spec already gives one rank's KV heads), never silently dropped.
    common["tensor_parallel_size"] = inp.tensor_parallel_size
    if inp.groups is not None:
        version = common["vllm_version"]
        default = get_profile(version).default_block_size  # an unknown version: build_context names it below
        groups = groups_from_data(inp.groups, kv_cache_dtype=inp.kv_cache_dtype, block_size=inp.block_size,
                                  default_block_size=default)
        return build_context(groups=groups, **common)
    sizing = {"kv_cache_dtype": inp.kv_cache_dtype, "block_size": inp.block_size}
    if inp.model is not None:
        model = Path(inp.model) if Path(inp.model).is_absolute() else base_dir / inp.model
        return build_context(model=model, dtype=inp.dtype, disable_sliding_window=inp.disable_sliding_window,
                         **sizing, **common)
    if inp.dtype is not None or inp.disable_sliding_window:  # build_context says these need `model`
        return build_context(spec=inp.spec, dtype=inp.dtype, disable_sliding_window=inp.disable_sliding_window,
                             **sizing, **common)
    return build_context(spec=inp.spec, **sizing, **common)
