"""Real model configs read by kvpolicy as vLLM reads them: specs and groups, per release.

For every config of the corpus (``tests/fixtures/model_configs/*/config.json``, transcribed from the
published files; its README says from where and why each is there) and each case below, vLLM
0.34.0 and 0.28.0 build their own ``ModelConfig``/``VllmConfig``, instantiate the model class on the
meta device, collect each layer's KV cache spec and group them as the engine core does
(``oracles/model_config.py``); `kv_groups_from_hf_config` reads the same file. One oracle call per
release, all cases at once; answers are kept per machine (`vllm_release.run_oracle`). Beside the corpus,
`VARIANTS`: a published config changed the way a writer of config.json changes it (transformers writes an
infinite float as `Infinity`), read by both from the same JSON text.

How kvpolicy's groups map onto vLLM's (`KVCacheGroups`, policy/spec.py):

- **Layer kinds.** vLLM's per-layer spec classes: ``FullAttentionSpec`` -> ``full``,
  ``SlidingWindowSpec`` -> ``sliding_window``, ``MLAAttentionSpec`` -> ``mla``, ``MambaSpec`` ->
  ``mamba``; ``ChunkedLocalAttentionSpec`` (``chunked_local``) and ``CrossAttentionSpec``
  (``cross``) have no kvpolicy kind, so a model with them can never be equal.
- **One kvpolicy group per kind** holds every layer of that kind; vLLM's hybrid allocator splits
  a kind into groups of equal size (Gemma-3-27B: 6 sliding groups + 1 full one). So kvpolicy's
  ``num_layers`` of a kind is compared with the number of vLLM *layers* of that kind, the set of
  kinds among the groups with vLLM's, and `KVCacheGroups.count` (what a rule's ``groups.count``
  reads: vLLM's split, ``vllm_splits``) with vLLM's number of groups, exactly.
- **Per attention kind**: KV heads per rank, head size, sliding window, block size and page bytes,
  from vLLM's per-layer spec before grouping (grouping pads pages), after the executor's
  ``update_block_size_for_backend``: vLLM raises the attention block size of a hybrid attention +
  Mamba model until a page holds a Mamba state, past an explicit ``--block-size`` too
  (`kvpolicy.policy.hybrid_block`). **Mamba**: the layer count, the block size and the page bytes
  (vLLM's Mamba page padded to the attention page; kvpolicy's Mamba spec is otherwise a stand-in:
  `kv_groups_from_hf_config`'s docstring). Hybrid configs are asked at the release's default block
  size too (``*-default-block``: no ``--block-size``; kvpolicy gets the profile's `default_block_size`).
- **dtype**: the dtype vLLM serves (``ModelConfig.dtype``: ``--dtype`` rules, float32 downcast)
  against every kvpolicy spec's ``dtype``; the KV cache dtype shows in the page bytes.
- **Refusals**: vLLM refusing a case kvpolicy also refuses for the same reason is equal ("both
  refuse"; the reasons are paired in `_SAME_REASON`, another reason is "different"); for the
  architectures a release's registry dropped (Bamba, Mllama) kvpolicy's refusal is the release
  profile's ``previously_supported_models`` (``removed-architecture``), itself read from each release
  (`test_release_facts.py`).

Where vLLM cannot be asked on the machine the oracles answer for (`oracles/_host.py`; `_NOT_BUILT`: a stage
needs CUDA kernels or packages the release site lacks), the comparison falls back to ``ModelConfig``'s own
methods the oracle answers
(layer count by block type, KV heads per rank, head size, MLA, dtype), or, with no ModelConfig at all,
is not made; configs vLLM itself refuses (`_VLLM_REFUSES`) must be refused by kvpolicy too ("both
refuse"; kvpolicy answering is "different"). Both tables are asserted: the error must still be the one
recorded, so a release that stops refusing shows.

``pytest -s`` prints the table (config, case, release, outcome, why). A ``different`` row is a
failure: kvpolicy reads that config unlike vLLM.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import asked_ahead
import pytest
from vllm_release import run_oracle

from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.hf_config import kv_groups_from_hf_config
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import AttentionKind, KVCacheGroups

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
NAMES = sorted(p.name for p in CORPUS.iterdir() if (p / "config.json").is_file())
RELEASES = ("0.34.0", "0.28.0")
# releases asked about the hybrid configs only (each case of HYBRIDS): where vLLM's alignment code changed
# (0.32: rounded to every backend's kernel block; 0.33: Mamba prefill checkpoints) and one before
HYBRID_RELEASES = ("0.30.0", "0.32.0", "0.33.0")

# (label, tensor_parallel_size, dtype, kv_cache_dtype, block_size); every config gets the first two. A
# block size of None is no --block-size: the release's default (its profile's `default_block_size`).
Case = tuple[str, int, str, str, "int | None"]
BLOCK_SIZE = 16
BASE_CASES: tuple[Case, ...] = (("tp1", 1, "auto", "auto", BLOCK_SIZE), ("tp4-fp8", 4, "auto", "fp8", BLOCK_SIZE))
# hybrid attention + Mamba models: vLLM raises the attention block size until a page holds a Mamba state
# (`update_block_size_for_backend`), from the default block size as from an explicit one
# and at a block size that is no multiple of the kernel block (0.32 on round the raised size up to one)
HYBRID_CASES: tuple[Case, ...] = (("tp1-default-block", 1, "auto", "auto", None),
                                  ("tp4-fp8-default-block", 4, "auto", "fp8", None),
                                  ("tp1-block-24", 1, "auto", "auto", 24))
HYBRIDS = ("falcon-h1-0.5b-instruct", "granite-4.0-h-tiny", "jamba-v0.1", "nvidia-nemotron-nano-9b-v2",
           "qwen3-next-80b-a3b-instruct", "zamba2-1.2b")
# Published configs changed the way a writer of config.json changes them, each read by vLLM as by kvpolicy
# from the JSON text: name -> (corpus config, fields set, why).
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "nvidia-nemotron-nano-9b-v2+infinity": (
        "nvidia-nemotron-nano-9b-v2", {"time_step_limit": [0.0, math.inf]},
        "transformers writes Mamba-2's default `time_step_limit` (0.0, inf) as `[0.0, Infinity]`, which Python's "
        "json, transformers and vLLM read"),
}
EXTRA_CASES: dict[str, tuple[Case, ...]] = {
    "deepseek-v2-lite-chat": (("tp3", 3, "auto", "auto", BLOCK_SIZE),),  # MLA: 16 heads do not split 3 ways
    "gemma-2-2b-it": (("tp1-float32", 1, "float32", "auto", BLOCK_SIZE),),  # an explicit --dtype float32 keeps fp32
    "phi-2": (("tp1-bfloat16", 1, "bfloat16", "auto", BLOCK_SIZE),),  # a float16 checkpoint served in bf16
    **{name: HYBRID_CASES for name in HYBRIDS},
}

# Configs vLLM itself refuses (on any machine): release -> a substring of its error, and why.
_VLLM_REFUSES: dict[str, tuple[dict[str, tuple[str, ...]], str]] = {
    "bamba-9b": ({"0.28.0": ("supported in vLLM until v0.23.0",),
                  "0.34.0": ("does not dispatch through the Transformers attention interface",)},
                 "BambaForCausalLM: supported until v0.23.0, removed after it (0.28 says so; 0.34 falls back to the "
                 "Transformers backend, which cannot run its Mamba layers)"),
    "deepseek-v2-lite-chat/tp3": ({v: ("must be divisible by tensor parallel size",) for v in RELEASES},
                                  "16 attention heads at TP 3: vLLM splits an MLA model's heads too"),
    "llama-3.2-11b-vision-instruct": ({v: ("until v0.10.2", "Can't load image processor") for v in RELEASES},
                                      "MllamaForConditionalGeneration: supported until v0.10.2 (its image processor "
                                      "is asked for first when only config.json is present)"),
}
# Cases the oracles' pinned machine (oracles/_host.py) cannot build (a CUDA kernel or a package missing from the
# release site), by config
# or "config/case": release -> substring of the error, and why. The comparison falls back to
# ModelConfig's answers where there are some.
_NOT_BUILT: dict[str, tuple[dict[str, tuple[str, ...]], str]] = {
    "gpt-oss-20b-bf16/tp4-fp8": ({v: ("No Unquantized MoE backend",) for v in RELEASES},
                                 "unquantized MoE at TP 4: none of the CPU platform's MoE backends takes it"),
    "deepseek-v3": ({v: ("ScaledMM",) for v in RELEASES},
                    "fp8 block-scaled weights: no CPU kernel without AMX-FP8 (a CUDA GPU has one)"),
    "kimi-k2-instruct": ({v: ("ScaledMM",) for v in RELEASES},
                         "fp8 block-scaled weights: no CPU kernel without AMX-FP8 (a CUDA GPU has one)"),
    "deepseek-v2-lite-chat": ({"0.28.0": ("compile_flash_attn_varlen_func_from_specs",)},
                              "0.28's MLA module imports a flash-attn helper its CPU build lacks"),
    "qwen2.5-vl-7b-instruct": ({"0.28.0": ("Can't load image processor",)},
                               "0.28 builds the image processor with the model: needs the repo's "
                               "preprocessor_config.json"),
    "llava-1.5-7b-hf": ({v: ("failed to be inspected",) for v in RELEASES},
                        "vLLM's llava module imports openai, openai-harmony and mistral-common, not in the "
                        "release site"),
}

_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding_window", "MLAAttentionSpec": "mla",
          "MambaSpec": "mamba", "ChunkedLocalAttentionSpec": "chunked_local", "CrossAttentionSpec": "cross"}
_ATTENTION_FIELDS = ("num_kv_heads", "head_size", "sliding_window", "block_size", "page_size_bytes")
# a Mamba state's: the block size and the page (vLLM's padded to the attention page in a hybrid model)
_MAMBA_FIELDS = ("block_size", "page_size_bytes")

ROWS: list[tuple[str, str, str, str, str]] = []


def _cases(name: str) -> list[Case]:
    return [*BASE_CASES, *EXTRA_CASES.get(name, ())]


def _config(name: str) -> dict[str, Any]:
    """A corpus config, or a variant's: its corpus config with the variant's fields set."""
    base, fields, _ = VARIANTS.get(name, (name, {}, ""))
    return {**json.loads((CORPUS / base / "config.json").read_text(encoding="utf-8")), **fields}


_VARIANT_DIRS: dict[str, Path] = {}


def _config_path(name: str) -> Path:
    """The directory kvpolicy reads ``name`` from: the corpus's, or the variant's JSON text as Python writes
    it (``Infinity`` for an infinite float) in a directory of this module's run."""
    return _VARIANT_DIRS.get(name, CORPUS / name)


@pytest.fixture(scope="module", autouse=True)
def _variants(tmp_path_factory: pytest.TempPathFactory) -> None:
    for name in VARIANTS:
        directory = tmp_path_factory.mktemp(name)
        (directory / "config.json").write_text(json.dumps(_config(name), indent=2), encoding="utf-8")
        _VARIANT_DIRS[name] = directory


def _plan(version: str = RELEASES[0]) -> list[tuple[str, Case]]:
    """The (config, case)s asked of ``version``: every one for `RELEASES`, the hybrids' for `HYBRID_RELEASES`."""
    names = [*NAMES, *VARIANTS] if version in RELEASES else HYBRIDS
    return [(name, case) for name in names for case in _cases(name)]


_ASKED: dict[str, dict[tuple[str, str], dict[str, Any]] | Exception] = {}


def start_ahead(items: list[pytest.Item]) -> None:
    """Each selected release's one oracle call asked ahead (asked_ahead.py)."""
    import ahead

    asked_ahead.queue("model_config", ahead.params(items, "version"), _ask)


def _answers(version: str) -> dict[tuple[str, str], dict[str, Any]]:
    """`_ask`'s answers, asked ahead or now."""
    return asked_ahead.take("model_config", version, _ask)


def _ask(version: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The release's answer to every (config, case): one oracle call, all cases (a failed call is
    remembered too, so that the release's other tests do not ask again)."""
    if version not in _ASKED:
        plan = _plan(version)
        cases = [{"config": _config(name),
                  "tensor_parallel_size": tp, "dtype": dtype, "kv_cache_dtype": kv, "block_size": block}
                 for name, (_, tp, dtype, kv, block) in plan]
        try:
            answers = run_oracle(version, "model_config", cases, timeout=1800)
            _ASKED[version] = {(name, case[0]): answer for (name, case), answer in zip(plan, answers, strict=True)}
        except Exception as exc:  # OracleError, a timeout: every test of this release reports it
            _ASKED[version] = exc
    asked = _ASKED[version]
    if isinstance(asked, Exception):
        raise asked
    return asked


def _vllm_kinds(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """vLLM's layers by kind: the count and each compared field (a set where layers disagree)."""
    out: dict[str, dict[str, Any]] = {}
    for _, index in answer["layers"]:
        spec = answer["specs"][index]
        kind = _KINDS.get(spec["type"], spec["type"])
        if kind == "full" and spec.get("attention_chunk_size"):
            kind = "chunked_local"
        entry = out.setdefault(kind, {"layers": 0})
        entry["layers"] += 1
        for field in _MAMBA_FIELDS if kind == "mamba" else _ATTENTION_FIELDS:
            entry.setdefault(field, set()).add(spec.get(field))
    for entry in out.values():
        for field in _ATTENTION_FIELDS:
            if field in entry:
                values = entry[field]
                entry[field] = next(iter(values)) if len(values) == 1 else sorted(values, key=str)
    return out


def _group_kinds(spec: dict[str, Any]) -> set[str]:
    if spec["type"] == "UniformTypeKVCacheSpecs":
        return {k for inner in spec["kv_cache_specs"].values() for k in _group_kinds(inner)}
    kind = _KINDS.get(spec["type"], spec["type"])
    return {"chunked_local" if kind == "full" and spec.get("attention_chunk_size") else kind}


def _ours_kinds(groups: KVCacheGroups) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for group in groups.groups:
        spec = group.spec
        entry = out.setdefault(spec.kind.value, {"layers": 0})
        entry["layers"] += spec.num_layers
        entry.update(block_size=spec.block_size, page_size_bytes=spec.page_size_bytes)
        if spec.kind is not AttentionKind.mamba:
            entry.update(num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, sliding_window=spec.sliding_window)
    return out


def _compare_instantiated(vllm: dict[str, Any], ours: KVCacheGroups) -> list[str]:
    """What differs, field by field (empty: equal)."""
    why = []
    theirs, mine = _vllm_kinds(vllm), _ours_kinds(ours)
    if set(theirs) != set(mine):
        why.append("kinds: vLLM " + ", ".join(f"{k} x{v['layers']}" for k, v in theirs.items())
                   + "; kvpolicy " + ", ".join(f"{k} x{v['layers']}" for k, v in mine.items()))
    for kind in sorted(set(theirs) & set(mine)):
        for field in ("layers", *_ATTENTION_FIELDS):
            if field in theirs[kind] and theirs[kind][field] != mine[kind].get(field):
                why.append(f"{kind}.{field}: vLLM {theirs[kind][field]}, kvpolicy {mine[kind].get(field)}")
    dtypes = {g.spec.dtype.value for g in ours.groups}
    if dtypes != {vllm["served_dtype"]}:
        why.append(f"dtype: vLLM serves {vllm['served_dtype']}, kvpolicy {'/'.join(sorted(dtypes))}")
    if "groups" in vllm:
        group_kinds = set().union(*(_group_kinds(g["spec"]) for g in vllm["groups"])) if vllm["groups"] else set()
        if group_kinds != set(mine):
            why.append(f"group kinds: vLLM {sorted(group_kinds)}, kvpolicy {sorted(mine)}")
        if len(vllm["groups"]) != ours.count:
            why.append(f"group count: vLLM {len(vllm['groups'])} groups, kvpolicy {ours.count}")
    else:
        why.append(f"vLLM could not group the layers: {vllm.get('error')}")
    return why


def _compare_model_config(view: dict[str, Any], ours: KVCacheGroups) -> list[str]:
    """The fallback: what ModelConfig's own methods answer against kvpolicy's attention groups."""
    why = []
    attention = [g.spec for g in ours.groups if g.spec.kind.is_attention]
    layers = sum(s.num_layers for s in attention)
    if view.get("attention_layers") != layers:
        why.append(f"attention layers: vLLM {view.get('attention_layers')}, kvpolicy {layers}")
    if view.get("use_mla") != any(s.kind is AttentionKind.mla for s in attention):
        why.append(f"MLA: vLLM {view.get('use_mla')}, kvpolicy {[s.kind.value for s in attention]}")
    for field, ours_values in (("num_kv_heads", {s.num_kv_heads for s in attention}),
                               ("head_size", {s.head_size for s in attention})):
        if ours_values != {view.get(field)}:
            why.append(f"{field}: vLLM {view.get(field)}, kvpolicy {sorted(ours_values)}")
    dtypes = {g.spec.dtype.value for g in ours.groups}
    if dtypes != {view.get("dtype")}:
        why.append(f"dtype: vLLM serves {view.get('dtype')}, kvpolicy {'/'.join(sorted(dtypes))}")
    return why


def _expected_error(table: dict[str, Any], name: str, label: str, version: str) -> tuple[tuple[str, ...], str] | None:
    for key in (f"{name}/{label}", name):
        if key in table and version in table[key][0]:
            return table[key][0][version], table[key][1]
    return None


def _said(error: str) -> str:
    """vLLM's error in one line: pydantic's ``Value error, ...`` line where there is one."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    said = next((line.removeprefix("Value error, ") for line in lines if line.startswith("Value error,")), lines[0])
    return said.split(" [type=")[0][:200]


def _refusal(error: PolicyError) -> str:
    return "; ".join(d.message for d in error.diagnostics) or error.message


# Refusing for the same reason: vLLM's error (a substring) -> kvpolicy's (diagnostic code, a substring of its
# message). A refusal of vLLM's that kvpolicy refuses for another reason is "different".
_SAME_REASON: tuple[tuple[str, str, str], ...] = (
    ("must be divisible by tensor parallel size", "invalid-field", "does not divide `num_attention_heads`"),
)


def _same_reason(error: str, ours: PolicyError, removed: bool = False) -> str | None:
    """None when kvpolicy refuses for vLLM's reason: an architecture the release's registry dropped
    (``removed``: `_VLLM_REFUSES`) is kvpolicy's ``removed-architecture``; any other refusal of vLLM's is a
    `_SAME_REASON` row. Else what kvpolicy said instead."""
    said = [(d.code, d.message) for d in ours.diagnostics]
    if removed:
        ok = any(code == "removed-architecture" for code, _ in said)
    else:
        ok = any(theirs in error and code == mine and text in message
                 for theirs, mine, text in _SAME_REASON for code, message in said)
    return None if ok else f"kvpolicy refuses for another reason ({'; '.join(f'{c}: {m}' for c, m in said)})"


def _kvpolicy(name: str, tp: int, dtype: str, kv: str, version: str,
              block: int | None = BLOCK_SIZE) -> KVCacheGroups | PolicyError:
    """kvpolicy's reading; no block size is the release's default, as `dry-run` passes it."""
    if block is None:
        block = get_profile(version).default_block_size
    try:
        return kv_groups_from_hf_config(_config_path(name), kv_cache_dtype=kv, block_size=block,
                                        tensor_parallel_size=tp, dtype=None if dtype == "auto" else dtype,
                                        vllm_version=version)
    except PolicyError as exc:
        return exc


def judge(name: str, label: str, version: str) -> tuple[str, str]:
    """(outcome, why) for one config, case and release."""
    _, tp, dtype, kv, block = next(c for c in _cases(name) if c[0] == label)
    vllm = _answers(version)[(name, label)]
    ours = _kvpolicy(name, tp, dtype, kv, version, block)
    error = vllm.get("error")
    refused = _expected_error(_VLLM_REFUSES, name, label, version)
    not_built = None if refused else _expected_error(_NOT_BUILT, name, label, version)
    for expected, kind in ((refused, "vLLM refuses"), (not_built, "not built here")):
        if expected is not None:
            substrings, reason = expected
            assert error and any(s in error for s in substrings), (
                f"{name} {label} on {version}: recorded as '{kind}' ({reason}), but vLLM answered "
                f"{error or 'without an error'}")
    if refused is not None:  # a layout for a model vLLM does not start would look like an answer
        if isinstance(ours, PolicyError):
            removal = not any(theirs in (error or "") for theirs, _, _ in _SAME_REASON)
            if (other := _same_reason(error or "", ours, removed=removal)) is not None:
                return "different", f"{refused[1]}; {other}"
            return "both refuse", f"{refused[1]}; kvpolicy: {_refusal(ours)}"
        return "different", f"{refused[1]}; kvpolicy answers " + ", ".join(
            f"{k} x{v['layers']}" for k, v in _ours_kinds(ours).items())
    if not_built is not None:
        view = vllm.get("model_config")
        if not view:
            return "not checked", not_built[1]
        if isinstance(ours, PolicyError):
            return "different", f"kvpolicy refuses ({_refusal(ours)}); vLLM's ModelConfig answers"
        why = _compare_model_config(view, ours)
        return ("different" if why else "equal (ModelConfig)"), "; ".join(why) or f"fallback: {not_built[1]}"
    if error is not None:
        if isinstance(ours, PolicyError):
            if (other := _same_reason(error, ours)) is not None:
                return "different", f"vLLM refuses at {vllm.get('stage')} ({_said(error)}); {other}"
            return "both refuse", f"vLLM: {_said(error)}; kvpolicy: {_refusal(ours)}"
        return "different", f"vLLM refuses at {vllm.get('stage')} ({_said(error)}); kvpolicy answers"
    if isinstance(ours, PolicyError):
        return "different", f"kvpolicy refuses ({_refusal(ours)}); vLLM answers"
    why = _compare_instantiated(vllm, ours)
    return ("different" if why else "equal"), "; ".join(why)


@pytest.fixture(scope="module", autouse=True)
def _table() -> Any:
    yield
    if ROWS:
        width = max(len(r[0]) for r in ROWS)
        print(f"\n{'config':{width}}  case          release  outcome               why")
        for name, label, version, outcome, why in sorted(ROWS):
            print(f"{name:{width}}  {label:12}  {version:7}  {outcome:20}  {why}")
        for version in (*RELEASES, *HYBRID_RELEASES):
            counts: dict[str, int] = {}
            for row in ROWS:
                if row[2] == version:
                    counts[row[3]] = counts.get(row[3], 0) + 1
            if counts:
                print(f"vLLM {version}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize(("name", "label"), [(n, c[0]) for n, c in _plan()])
def test_kvpolicy_reads_the_config_as_vllm(name: str, label: str, version: str, vllm_sites: Any) -> None:
    outcome, why = judge(name, label, version)
    ROWS.append((name, label, version, outcome, why))
    assert outcome != "different", f"{name} ({label}) on vLLM {version}: {why}"


@pytest.mark.parametrize("version", HYBRID_RELEASES)
@pytest.mark.parametrize(("name", "label"), [(n, c[0]) for n, c in _plan(HYBRID_RELEASES[0])])
def test_hybrid_block_size_as_more_releases(name: str, label: str, version: str, vllm_sites: Any) -> None:
    """The hybrid configs on releases beyond 0.28 and 0.34: block size and pages, specs and groups alike."""
    outcome, why = judge(name, label, version)
    ROWS.append((name, label, version, outcome, why))
    assert outcome != "different", f"{name} ({label}) on vLLM {version}: {why}"


def test_corpus_is_large_and_complete() -> None:
    """At least 25 configs (issue 21), each listed in the corpus README with its source."""
    readme = (CORPUS / "README.md").read_text(encoding="utf-8")
    assert len(NAMES) >= 25
    assert [n for n in NAMES if f"`{n}`" not in readme] == []


def test_the_comparison_sees_each_field(vllm_sites: Any) -> None:
    """The comparison itself: vLLM's real Llama-3.1 answer equals kvpolicy's, and each field changed
    in vLLM's answer is named (a comparison that cannot fail would make every row above 'equal')."""
    import copy

    real = _answers("0.34.0")[("llama-3.1-8b-instruct", "tp1")]
    ours = _kvpolicy("llama-3.1-8b-instruct", 1, "auto", "auto", "0.34.0")
    assert isinstance(ours, KVCacheGroups) and _compare_instantiated(real, ours) == []
    for field, value, named in (("num_kv_heads", 4, "full.num_kv_heads"), ("head_size", 64, "full.head_size"),
                                ("page_size_bytes", 1, "full.page_size_bytes"), ("type", "SlidingWindowSpec", "kinds")):
        changed = copy.deepcopy(real)
        changed["specs"][0][field] = value
        assert any(why.startswith(named) for why in _compare_instantiated(changed, ours)), field
    served = {**real, "served_dtype": "float16"}
    assert any(why.startswith("dtype") for why in _compare_instantiated(served, ours))
    split = copy.deepcopy(real)
    split["groups"] = [{"layers": g["layers"][:16], "spec": g["spec"]} for g in real["groups"]] + [
        {"layers": g["layers"][16:], "spec": g["spec"]} for g in real["groups"]]
    assert any(why.startswith("group count") for why in _compare_instantiated(split, ours))
