"""Quantized cells, byte for byte, against each vLLM release's own Triton kernels (TRITON_INTERPRET=1, CPU).

For every release 0.24.0-0.34.0 and each quantized ``kv_cache_dtype`` its TRITON_ATTN accepts
(its profile's list: int8/fp8 per token-head from 0.24, int4 from 0.25, per-tensor fp8), the
same K and V (random heads and the edge inputs of `edge_heads`) go

- through ``KVCache.write`` (kvpolicy, on the plan of that release's profile: `plan_layout` with
  the profile's TRITON_ATTN, per-layer LBNHC or LBHNC) and through the release's own
  ``do_kv_cache_update`` and write kernels on a cache that release allocates with its own shape
  and stride functions (``oracles/quantized_cells.py``): every byte of every written cell (data and
  inline scale), read at kvpolicy's planned addresses from both buffers, must be identical; so the
  plan's geometry and kvpolicy's quantization are both the release's;
- the other way: the cells vLLM's kernels wrote, put into a kvpolicy cache, read back by
  ``KVCache.read`` must equal vLLM's own dequantization of them (its attention kernel's
  output for a one-token sequence whose V is the cell; K cells are read as a V too);
- per-tensor fp8 values whose quotient by the layer's scale is exactly halfway between two codes
  (``tie_heads``, 0.34): vLLM's write divides, so these round to the even code, which a multiply by the
  reciprocal would not (the random heads and the scales 0.37 and 0.0625 never tell the two apart).

Values compare bit for bit, except that a zero compares equal to a zero of either sign
(the attention sums its one weighted value onto +0.0) and a NaN to any NaN.

Cost (interpreted Triton, about 0.5-1 s a case): the full case set (every dtype x model dtype x
head size) runs on the newest release and on the newest release of each distinct write-kernel file
(`FULL`, held by `test_every_write_kernel_file_gets_the_full_case_set`); the other releases get one
case per quantized dtype (model dtypes rotated, every one covered), K/V cells and scales written and
read. Layouts alternate between LBNHC and LBHNC by case, except where the release's per-token-head
scale views assume one contiguous NHD buffer per layer (0.24-0.25, vLLM #48412): there only layouts
whose planned scale cells are the ones vLLM's views address (`naive_scale_view` equal to the plan's:
LBNHC) are compared; LBHNC's per-token-head scales are elsewhere in vLLM (kvpolicy decides it but does
not plan it as vLLM lays it out, test_gate_geometry.py) and are counted as excluded. Patch releases
run their series' kernel files (checked byte for byte) and are not asked again.

MLA's 576-value latent appears as a TRITON_ATTN head of 576: no vLLM MLA backend accepts a
per-token-head or Triton-written fp8 cache (FLASHMLA / TRITON_MLA write fp8 with the CUDA op
``concat_and_cache_mla``).
"""

from __future__ import annotations

import base64
import ctypes
import functools
import hashlib
import math
from collections import defaultdict
from typing import NamedTuple

import asked_ahead
import install_vllm
import pytest
import torch
from conftest import RELEASES
from vllm_release import run_oracle

from kvpolicy.engine.plan import LayoutPlan, naive_scale_view, plan_layout
from kvpolicy.engine.runtime import KVCache, allocate
from kvpolicy.engine.runtime.quantize import hadamard, rht_block, rht_signs
from kvpolicy.policy.backends import ScaleViews
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import KVCacheSpec

PER_TOKEN_HEAD = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]
PER_TENSOR = ["fp8", "fp8_e4m3", "fp8_e5m2"]
DTYPES = ["bfloat16", "float16", "float32"]
# head sizes: powers of two, and 96 / 576 (576 = MLA's latent width), whose int4 transform is
# block-diagonal (blocks of 32 and 64); per-token-head scales need head_size % 4 (int4: % 8)
HEADS = {"per_token_head": [64, 96, 128, 256, 576], "per_tensor": [64, 128, 576]}
READ_HEADS = {"int8_per_token_head": [128, 576], "fp8_per_token_head": [128, 576],
              "int4_per_token_head": HEADS["per_token_head"], "per_tensor": [128]}
# reduced set: one head per dtype, every case read (int4 at a power of two: see `_vllm_refuses`)
REDUCED_HEADS = {"int4_per_token_head": 128, "int8_per_token_head": 96, "fp8_per_token_head": 64}
REDUCED_HEAD_PER_TENSOR = 128
INT4_ODD_HEAD = 96  # asked of every int4 release, written only: 0.25-0.31 refuse it at the first write
LAYOUTS = (Layout.LBNHC, Layout.LBHNC)  # the per-layer layouts (NHD, HND) every release allocates
NUM_KV_HEADS = 2
BLOCK_SIZE = 16
NUM_BLOCKS = 5
TENSOR_SCALES = (0.37, 0.0625)  # per-tensor K and V scales: one inexact division, one power of two
READS = 12  # tokens whose K and V cells are dequantized by vLLM (attention is the slow kernel)
SEEDS = 72  # make_inputs' seed stride (the number of 0.34 cases when the inputs were chosen)
WRITE_KERNEL = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"
# what the oracle's calls reach: the attention package (backends, kernels, int4), and the modules they import
# the cache dtypes, quant modes and fp8 helpers from
KERNEL_TREE = "vllm/v1/attention"
KERNEL_MODULES = ("vllm/v1/kv_cache_interface.py", "vllm/utils/torch_utils.py",
                  "vllm/model_executor/layers/quantization/utils/quant_utils.py")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


# Patch releases (x.y.z, z > 0) run their series' kernel files (test_patch_releases_run_their_series_kernels).
SERIES = {v: v.rsplit(".", 1)[0] + ".0" for v in RELEASES if not v.endswith(".0")}
ASKED = tuple(sorted((v for v in RELEASES if v not in SERIES), key=_key))
# The full case set: the newest release of each distinct write-kernel file (0.24, 0.25, 0.26-0.32, 0.33-0.34).
FULL = ("0.24.0", "0.25.0", "0.32.0", "0.34.0")


class Case(NamedTuple):
    version: str
    mode: str
    dtype: str
    head: int
    layout: Layout
    read: bool


def _id(case: Case) -> str:
    return f"{case.version}-{case.mode}-{case.dtype}-{case.head}-{case.layout.value}"


def _modes(version: str) -> list[str]:
    accepted = get_profile(version).backends["TRITON_ATTN"].kv_cache_dtypes or ()
    return [m for m in PER_TOKEN_HEAD + PER_TENSOR if m in accepted]


def _plan(version: str, mode: str, dtype: str, head: int, layout: Layout, num_layers: int = 1) -> LayoutPlan:
    """The plan of ``layout`` under ``version``'s profile: its TRITON_ATTN geometry."""
    spec = KVCacheSpec(num_layers=num_layers, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=head,
                       dtype=dtype, kv_cache_dtype=mode)
    return plan_layout(layout, spec, get_profile(version).backend("TRITON_ATTN"), NUM_BLOCKS)


def release_fails_at_write(version: str, mode: str, head: int) -> bool:
    """The profile says the release cannot write this cache (int4 at a head that is not a power of two,
    0.25-0.31: `int4_heads_power_of_two`): kvpolicy refuses to plan it, vLLM must refuse to write it."""
    backend = get_profile(version).backend("TRITON_ATTN")
    return backend.int4_heads_power_of_two and mode == "int4_per_token_head" and bool(head & (head - 1))


def vllm_addresses_scales(version: str, mode: str, dtype: str, head: int, layout: Layout) -> bool:
    """Whether the release's scale views address the plan's scale cells: always where its views are
    stride-aware; where they assume a contiguous NHD buffer per layer (0.24-0.25), only when that
    assumption's views (`naive_scale_view`) are the plan's (per layer NHD)."""
    if release_fails_at_write(version, mode, head):
        return True  # nothing is written: vLLM's refusal and kvpolicy's are compared
    plan = _plan(version, mode, dtype, head, layout)
    if plan.backend.scale_views is not ScaleViews.assume_per_layer_contiguous:
        return True
    return all(naive_scale_view(plan, lp.layer, sv.role) == sv for lp in plan.layers for sv in lp.scales)


EXCLUDED: list[Case] = []


def _cases() -> list[Case]:
    out = []
    for version in ASKED:
        full = version in FULL
        for m, mode in enumerate(_modes(version)):
            kind = "per_token_head" if mode in PER_TOKEN_HEAD else "per_tensor"
            if full:
                combos = [(dtype, head) for dtype in DTYPES for head in HEADS[kind]]
            else:  # one model dtype per mode, rotated over the modes so that every one is covered
                head = REDUCED_HEADS.get(mode, REDUCED_HEAD_PER_TENSOR)
                combos = [(DTYPES[(m + _key(version)[1]) % len(DTYPES)], head)]
                if mode == "int4_per_token_head":  # and whether the release writes a head that is no power of two
                    combos.append((combos[0][0], INT4_ODD_HEAD))
            for i, (dtype, head) in enumerate(combos):
                read = (head in READ_HEADS.get(mode, READ_HEADS["per_tensor"]) if full
                        else not (mode == "int4_per_token_head" and head == INT4_ODD_HEAD))
                preferred = LAYOUTS[(i + m + _key(version)[1]) % 2]
                for layout in (preferred, *[x for x in LAYOUTS if x is not preferred]):
                    case = Case(version, mode, dtype, head, layout, read)
                    if vllm_addresses_scales(version, mode, dtype, head, layout):
                        out.append(case)
                        break
                    EXCLUDED.append(case)
    return out


CASES = _cases()


# ---- inputs ------------------------------------------------------------------------------------


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _int4_ties(head: int, dtype: torch.dtype) -> torch.Tensor:
    """A head whose rotated values (int4's transform) are r = (15, 0, 2.5, 7.5, 0, ...) per block:
    scale 1, zero point 0 and codes at exactly .5 of a step. x = signs * H r / b is exact."""
    block = rht_block(head)
    r = torch.zeros(head // block, block)
    r[:, 0], r[:, 2], r[:, 3 % block] = 15.0, 2.5, 7.5
    x = (hadamard(r, block) * rht_signs(block, torch.device("cpu"))) / block
    return x.reshape(head).to(dtype)


def edge_heads(mode: str, dtype: torch.dtype, head: int) -> list[torch.Tensor]:
    """The issue's edge inputs as whole heads of ``dtype`` (each becomes one K or V head)."""
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(head)
    qmax = {"int8_per_token_head": 127.0, "fp8_per_token_head": 448.0}.get(mode, 15.0)

    def rnd(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(head, generator=g) * scale

    def with_(base: torch.Tensor, **at: float) -> torch.Tensor:
        out = base.clone()
        for i, v in enumerate(at.values()):
            out[(7 * i + 1) % head] = v
        return out

    heads = [
        torch.zeros(head),  # zero head
        torch.full((head,), -0.0),  # negative zeros
        with_(torch.zeros(head), a=-0.0, b=0.0, c=1.0),  # +-0 with one value
        rnd(1e-6 * qmax / 4),  # amax below 1e-6 * QMAX: the floor scale
        rnd(1e-9),
        with_(torch.zeros(head), a=1e-5, b=-1e-5),
        torch.full((head,), 3.0),  # constant head (int4: hi == lo)
        with_(rnd(), a=math.nan),  # NaN among values
        torch.full((head,), math.nan),
        with_(rnd(), a=math.inf),
        with_(rnd(), a=-math.inf),
        with_(rnd(), a=math.inf, b=-math.inf),
        torch.full((head,), math.inf),
        torch.full((head,), -math.inf),
        with_(rnd(), a=math.nan, b=math.inf),  # NaN and an infinity in one head
        with_(torch.zeros(head), a=-math.inf),  # an infinity among zeros
        with_(rnd(), a=math.nan, b=-math.nan),  # NaNs of both signs
        torch.full((head,), fi.max),  # the largest finite values
        with_(rnd(), a=fi.max, b=-fi.max),
        torch.full((head,), -fi.max),
        with_(rnd(), a=fi.tiny / 4, b=-fi.tiny / 8),  # subnormals of the input dtype
        torch.full((head,), fi.tiny / 2),
        rnd(fi.tiny),  # normal and subnormal mixed
        rnd(1e4),
        rnd(1e-3),
    ]
    if mode == "int8_per_token_head":
        # amax 127 * 2**-6: scale and 1/scale exact, and values at exactly .5 of a step
        steps = torch.tensor([127.0, -126.5, 0.5, -0.5, 1.5, -2.5, 63.5, -0.0] * (head // 8)) * 2.0**-6
        heads.append(steps)
    elif mode == "fp8_per_token_head":
        # amax 448 (scale 1): values halfway between e4m3 neighbours
        mids = torch.tensor([448.0, 1.0625, -1.1875, 2.0**-10, 3 * 2.0**-11, 17.0, -464.0 / 2, 0.0] * (head // 8))
        heads.append(mids)
    elif mode == "int4_per_token_head":
        heads.append(_int4_ties(head, dtype).float())
    else:  # per tensor: x / s halfway between fp8 neighbours, and past the largest finite
        s = _f32(TENSOR_SCALES[1])
        heads.append(torch.tensor([1.0625, -1.1875, 2.0**-10, 3 * 2.0**-11, 464.0, -480.0, 1e6, 0.0] * (head // 8)) * s)
    return [h.to(dtype) for h in heads]


def make_inputs(mode: str, dtype_name: str, head: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """K and V (T, H, D), and their slots: random tokens, then the edge heads, K and V shifted."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(SEEDS * head + DTYPES.index(dtype_name))
    edges = edge_heads(mode, dtype, head)
    random = 12
    tokens = random + (len(edges) + 1) // NUM_KV_HEADS + 1
    key = (torch.randn(tokens, NUM_KV_HEADS, head, generator=g) * 2).to(dtype)
    value = (torch.randn(tokens, NUM_KV_HEADS, head, generator=g) * 0.5).to(dtype)
    for i, e in enumerate(edges):
        key[random + i // NUM_KV_HEADS, i % NUM_KV_HEADS] = e
        j = (i + 3) % len(edges)
        value[random + j // NUM_KV_HEADS, j % NUM_KV_HEADS] = e
    perm = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:tokens].tolist()
    slots = [-1 if t in (4, 9) else s for t, s in enumerate(perm)]  # two skipped random tokens
    return key, value, slots


def _b64(t: torch.Tensor) -> str:
    t = t.contiguous()
    return base64.b64encode(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).decode()


def _unb64(data: str, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8).view(dtype).reshape(shape)


def _scales(mode: str) -> tuple[float, float]:
    return TENSOR_SCALES if mode in PER_TENSOR else (1.0, 1.0)


def _read_slots(slots: list[int]) -> list[int]:
    """Up to READS written slots: the edge tokens first (the last ones written), then random ones."""
    kept = [s for s in slots if s >= 0]
    return kept[::-1][:READS]


# ---- the oracle, once per release ---------------------------------------------------------------


def start_ahead(items: list[pytest.Item]) -> None:
    """The selected cases' releases asked ahead (asked_ahead.py), in the order the tests read them."""
    versions = list(dict.fromkeys(item.callspec.params["case"].version for item in items
                                  if hasattr(item, "callspec") and "case" in item.callspec.params))
    asked_ahead.queue("quantized_cells", versions, _ask)


def _answers(version: str) -> dict[Case, dict]:
    """The release's answers to all its cases (`_ask`, asked ahead or now)."""
    return asked_ahead.take("quantized_cells", version, _ask)


@functools.cache
def _ask(version: str) -> dict[Case, dict]:
    """The release's answers to all its cases, in one oracle call (cached per machine by run_oracle)."""
    install_vllm.ensure_triton()
    cases = [c for c in CASES if c.version == version]
    asked = []
    for c in cases:
        key, value, slots = make_inputs(c.mode, c.dtype, c.head)
        k_scale, v_scale = _scales(c.mode)
        write = dict(kv_cache_dtype=c.mode, dtype=c.dtype, num_kv_heads=NUM_KV_HEADS, head_size=c.head,
                     block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, layout=c.layout.value, key=_b64(key),
                     value=_b64(value), slots=slots, k_scale=k_scale, v_scale=v_scale)
        asked.append({"write": write, "read_slots": _read_slots(slots) if c.read else []})
    answers = run_oracle(version, "quantized_cells", [{"facts": True}, *asked], timeout=1800)
    facts, answers = answers[0], answers[1:]
    assert facts.get("vllm") == version and facts.get("patched") and facts.get("interpret") == "1", facts
    return dict(zip(cases, answers, strict=True))


@pytest.fixture
def vllm_cells(vllm_sites) -> object:
    """``_answers``, after every release is installed (an install failure errors the test)."""
    try:
        install_vllm.ensure_triton()
    except install_vllm.InstallError as exc:
        pytest.fail(f"installing Triton failed: {exc}", pytrace=False)
    return _answers


def kvpolicy_cache(case: Case) -> KVCache:
    """kvpolicy's cache for TRITON_ATTN, one layer: the plan of the case's layout under its release's profile."""
    cache = allocate(_plan(case.version, case.mode, case.dtype, case.head, case.layout))
    cache.set_tensor_scales(0, *_scales(case.mode))
    return cache


def cell_addresses(plan: LayoutPlan, slots: list[int]) -> torch.Tensor:
    """Byte addresses (2, T, H, cell_bytes) in layer 0's buffer of its K and V cells at ``slots``
    (a per-token-head cell holds its inline scale), from the plan's view, whatever its dim order."""
    spec, v, elem = plan.spec, plan.layers[0].view, plan.element_size
    elements = torch.arange(plan.buffers[v.buffer].nbytes // elem).as_strided(v.shape, v.strides, v.storage_offset)
    elements = elements.permute([v.dims.index(d) for d in ("kv", "block", "token", "head", "dim")])
    blocks = torch.tensor([s // spec.block_size for s in slots])
    offsets = torch.tensor([s % spec.block_size for s in slots])
    cells = elements[:, blocks, offsets]  # (kv, T, H, D')
    return (cells.unsqueeze(-1) * elem + torch.arange(elem)).flatten(-2)


def vllm_cell_bytes(answer: dict, plan: LayoutPlan, slots: list[int]) -> torch.Tensor:
    """(2, T, H, C): the bytes of vLLM's buffer at the plan's addresses of the cells of ``slots``."""
    written = torch.frombuffer(bytearray(base64.b64decode(answer["cache"])), dtype=torch.uint8)
    assert written.numel() == plan.buffers[0].nbytes, (written.numel(), plan.buffers[0].nbytes)
    return written[cell_addresses(plan, slots)]


def same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: equal bits, or both zeros, or both NaN."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return (a.view(ints) == b.view(ints)) | ((a == 0) & (b == 0)) | (a.isnan() & b.isnan())


# ---- the tests ---------------------------------------------------------------------------------

REFUSED: set[Case] = set()
INT4_POWER_OF_TWO = "AssertionError: Requires power-of-2 dim"


def _vllm_refuses(case: Case, answer: dict) -> bool:
    """Whether the release refused the write, as it must exactly where its profile says it fails at the
    first write (`release_fails_at_write`): 0.25-0.31 accept int4_per_token_head at any head size divisible
    by 8, but their ``single_rht`` asserts a power-of-two head (96 and 576 fail; 0.32 on transform such
    heads in blocks). There kvpolicy must refuse to plan the cache, saying why."""
    fails = release_fails_at_write(case.version, case.mode, case.head)
    assert ("error" in answer) is fails, (case, answer.get("error", "vLLM wrote it"))
    if not fails:
        return False
    assert answer["error"].startswith(INT4_POWER_OF_TWO), answer["error"]
    with pytest.raises(InputError) as exc:
        _plan(case.version, case.mode, case.dtype, case.head, case.layout)
    (diag,) = exc.value.diagnostics
    assert (diag.file, diag.code) == ("kv_cache_dtype", "release-fails-at-write"), diag
    assert f"at head size {case.head}, but its first cache write fails" in diag.message
    REFUSED.add(case)
    return True


@functools.cache
def _write_comparison(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(same (2, T, H), kvpolicy's cell bytes, vLLM's) for the case's write; None where vLLM refuses it."""
    answer = _answers(case.version)[case]
    if _vllm_refuses(case, answer):
        return None
    key, value, slots = make_inputs(case.mode, case.dtype, case.head)
    cache = kvpolicy_cache(case)
    cache.write(0, key, value, torch.tensor(slots))
    kept = [s for s in slots if s >= 0]
    mine = cache.raw[0][cell_addresses(cache.plan, kept)]  # (2, T, H, C)
    theirs = vllm_cell_bytes(answer, cache.plan, kept)
    return (mine == theirs).all(-1), mine, theirs


@functools.cache
def _read_comparison(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(same (2, T, H), kvpolicy's reads, vLLM's) of vLLM's written cells; None where vLLM refuses the write."""
    answer = _answers(case.version)[case]
    if _vllm_refuses(case, answer):
        return None
    _, _, slots = make_inputs(case.mode, case.dtype, case.head)
    read_slots = _read_slots(slots)
    torch_dtype = getattr(torch, case.dtype)
    theirs = _unb64(answer["read"], torch_dtype, (2, len(read_slots), NUM_KV_HEADS, case.head))
    cache = kvpolicy_cache(case)
    cache.raw[0][cell_addresses(cache.plan, read_slots)] = vllm_cell_bytes(answer, cache.plan, read_slots)
    k, v = cache.read(0, torch.tensor(read_slots), torch_dtype)
    mine = torch.stack([k, v])
    return same_values(mine, theirs).all(-1), mine, theirs


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kvpolicy_writes_vllms_bytes(vllm_cells, case: Case) -> None:
    compared = _write_comparison(case)
    if compared is None:  # vLLM refuses, and so does kvpolicy's plan (_vllm_refuses)
        return
    same, mine, theirs = compared
    bad = (~same).nonzero().tolist()
    assert not bad, f"{len(bad)} of {same.numel()} cells differ, first (kv, token, head) {bad[:3]}: " + \
        f"kvpolicy {mine[tuple(bad[0])].tolist()} vLLM {theirs[tuple(bad[0])].tolist()}"


@pytest.mark.parametrize("case", [c for c in CASES if c.read], ids=_id)
def test_kvpolicy_reads_vllms_cells_as_vllm_dequantizes_them(vllm_cells, case: Case) -> None:
    compared = _read_comparison(case)
    if compared is None:
        return
    same, mine, theirs = compared
    bad = (~same).nonzero().tolist()
    assert not bad, f"{len(bad)} of {same.numel()} cells read differently, first (kv, token, head) {bad[:3]}: " + \
        f"kvpolicy {mine[tuple(bad[0])][:8].tolist()} vLLM {theirs[tuple(bad[0])][:8].tolist()}"


# ---- per-tensor fp8 at ties: vLLM's write divides by the scale -----------------------------------

TIE_SCALE = 0.109375  # 7/64: 1 / s is inexact, so x * (1 / s) and x / s round apart at ties
TIE_VERSION = FULL[-1]
TIE_CASES = [(mode, dtype) for mode in ("fp8_e4m3", "fp8_e5m2") for dtype in DTYPES]


def tie_heads(dtype: torch.dtype, head: int) -> torch.Tensor:
    """(T, H, D) of ``dtype``: every midpoint between neighbouring finite e4m3 values (the codes TRITON_ATTN
    writes for every fp8 cache, 0.34), both signs, times `TIE_SCALE`. Each product has at most 8
    significant bits, so it is exact in bf16, fp16 and fp32: ``x / s`` is the midpoint itself, which rounds
    to the even code, where ``x * (1 / s)`` falls on either side (bf16 0.0013885498046875: 6, not 7)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = values[values.isfinite() & (values >= 0)].unique().sort().values
    mids = (finite[:-1] + finite[1:]) / 2
    x = torch.cat([mids, -mids]) * TIE_SCALE
    assert torch.equal(x.to(dtype).float(), x), "a tie that the input dtype cannot hold"
    per_token = NUM_KV_HEADS * head
    tokens = -(-x.numel() // per_token)
    padded = torch.cat([x, torch.zeros(tokens * per_token - x.numel())])
    return padded.view(tokens, NUM_KV_HEADS, head).to(dtype)


def _tie_write(mode: str, dtype: str) -> dict:
    key = tie_heads(getattr(torch, dtype), REDUCED_HEAD_PER_TENSOR)
    slots = list(range(1, 2 * key.shape[0] + 1, 2))
    return dict(kv_cache_dtype=mode, dtype=dtype, num_kv_heads=NUM_KV_HEADS, head_size=REDUCED_HEAD_PER_TENSOR,
                block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, layout=Layout.LBNHC.value, key=_b64(key),
                value=_b64(-key), slots=slots, k_scale=TIE_SCALE, v_scale=TIE_SCALE)


@functools.cache
def _tie_answers() -> list[dict]:
    install_vllm.ensure_triton()
    asked = [{"write": _tie_write(mode, dtype), "read_slots": []} for mode, dtype in TIE_CASES]
    answers = run_oracle(TIE_VERSION, "quantized_cells", [{"facts": True}, *asked], timeout=600)
    assert answers[0].get("vllm") == TIE_VERSION and answers[0].get("interpret") == "1", answers[0]
    return answers[1:]


@pytest.mark.parametrize(("mode", "dtype"), TIE_CASES, ids=[f"{m}-{d}" for m, d in TIE_CASES])
def test_per_tensor_fp8_ties_round_as_vllms_division(vllm_sites, mode: str, dtype: str) -> None:
    """Per-tensor fp8 values whose quotient by the layer's scale is exactly halfway between two codes:
    kvpolicy's cells are vLLM's byte for byte (its Triton write divides; a multiply by the reciprocal
    rounds some of them the other way)."""
    answer = _tie_answers()[TIE_CASES.index((mode, dtype))]
    write = _tie_write(mode, dtype)
    head = REDUCED_HEAD_PER_TENSOR
    key = _unb64(write["key"], getattr(torch, dtype), (-1, NUM_KV_HEADS, head))
    cache = allocate(_plan(TIE_VERSION, mode, dtype, head, Layout.LBNHC))
    cache.set_tensor_scales(0, TIE_SCALE, TIE_SCALE)
    cache.write(0, key, -key, torch.tensor(write["slots"]))
    mine = cache.raw[0][cell_addresses(cache.plan, write["slots"])]
    theirs = vllm_cell_bytes(answer, cache.plan, write["slots"])
    bad = (mine != theirs).nonzero().tolist()
    assert not bad, f"{len(bad)} of {mine.numel()} bytes differ, first (kv, token, head, byte) {bad[:3]}"


def _release_files(version: str) -> dict[str, str]:
    """sha256 of each installed file of `KERNEL_TREE` and `KERNEL_MODULES`, by path in the site."""
    site = install_vllm.site_for(version)
    paths = [*sorted((site / KERNEL_TREE).rglob("*.py")), *(site / f for f in KERNEL_MODULES)]
    return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


@pytest.mark.parametrize("patch", sorted(SERIES), ids=str)
def test_patch_releases_run_their_series_kernels(vllm_sites, patch: str) -> None:
    """A patch release is not asked again: every file its kernels and backends come from is its series'."""
    mine, series = _release_files(patch), _release_files(SERIES[patch])
    assert len(mine) > 50 and WRITE_KERNEL in mine
    assert mine == series, sorted(f for f in mine.keys() | series.keys() if mine.get(f) != series.get(f))


def test_every_write_kernel_file_gets_the_full_case_set(vllm_sites) -> None:
    """Each distinct write-kernel file among the releases runs under the full case set on some release."""
    files: dict[str, list[str]] = defaultdict(list)
    for version in ASKED:
        files[_release_files(version)[WRITE_KERNEL]].append(version)
    missing = [versions for versions in files.values() if not set(versions) & set(FULL)]
    assert not missing, f"releases whose write kernel gets no full case set: {missing}"
    assert set(FULL) <= set(ASKED) and ASKED[-1] in FULL


def test_every_release_and_dtype_is_compared() -> None:
    """Each release 0.24-0.34 asks every quantized dtype its TRITON_ATTN accepts, with K/V cells and
    scales written and read, in every model dtype, under both per-layer layouts where its views allow."""
    assert ASKED[0] == "0.24.0" and len(ASKED) >= 11
    for version in ASKED:
        mine = [c for c in CASES if c.version == version]
        assert {c.mode for c in mine} == {c.mode for c in mine if c.read} == set(_modes(version))
        assert {c.dtype for c in mine} == set(DTYPES)
        assert {c.layout for c in mine} == set(LAYOUTS)
    assert "int4_per_token_head" in _modes("0.25.0") and "int4_per_token_head" not in _modes("0.24.0")
    # the excluded layouts are exactly the per-token-head LBHNC cases of the releases with #48412's scale views
    assert EXCLUDED and all(c.mode in PER_TOKEN_HEAD and c.layout is Layout.LBHNC and c.version in ("0.24.0", "0.25.0")
                            for c in EXCLUDED)


def test_figures(vllm_cells) -> None:
    """Per release: cases, cells compared and identical both ways (printed with -s / -rP). The comparisons
    are the tests' own (cached), so the figures hold whichever of the tests ran before."""
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for case in CASES:
        row = rows[case.version]
        written = _write_comparison(case)
        if written is None:
            continue
        row[0] += 1
        row[1] += written[0].numel()
        row[2] += int(written[0].sum())
        read = _read_comparison(case) if case.read else None
        if read is not None:
            row[3] += read[0].numel()
            row[4] += int(read[0].sum())
    # last column: cases whose LBHNC turn ran as LBNHC (per-token-head scale views of #48412's kind)
    lines = ["release  cases  cells written  byte-identical  cells read  reads equal  vLLM refuses  LBHNC->LBNHC"]
    for version in sorted(rows, key=_key):
        n, wc, wi, rc, ri = rows[version]
        excluded = sum(c.version == version for c in EXCLUDED)
        refused = sum(c.version == version for c in REFUSED)
        lines.append(f"{version:7s}  {n:5d}  {wc:13d}  {wi:14d}  {rc:10d}  {ri:11d}  {refused:12d}  {excluded}")
    total = [sum(r[i] for r in rows.values()) for i in range(5)]
    lines.append(f"{'all':7s}  {total[0]:5d}  {total[1]:13d}  {total[2]:14d}  {total[3]:10d}  {total[4]:11d}"
                 f"  {len(REFUSED):12d}  {len(EXCLUDED)}")
    print("\n" + "\n".join(lines))
    assert set(rows) == set(ASKED) and total[0] + len(REFUSED) == len(CASES)
    assert total[1] == total[2] > 0 and total[3] == total[4] > 0
