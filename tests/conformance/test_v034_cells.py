"""Quantized cells, byte for byte, against vLLM 0.34.0's own Triton kernels (TRITON_INTERPRET=1 on the CPU).

For every quantized ``kv_cache_dtype`` of TRITON_ATTN, model dtype and head size below,
the same K and V (random heads and the edge inputs of `edge_heads`) go

- through ``KVCache.write`` (kvpolicy) and through the backend's own
  ``do_kv_cache_update`` and write kernels (``oracles/v034_kernels.py``): every byte of
  every written cell must be identical;
- the other way: the cells vLLM's kernels wrote, put into a kvpolicy cache, read back by
  ``KVCache.read`` must equal vLLM's own dequantization of them (its attention kernel's
  output for a one-token sequence whose V is the cell; K cells are read as a V too).

Values compare bit for bit, except that a zero compares equal to a zero of either sign
(the attention sums its one weighted value onto +0.0) and a NaN to any NaN.

All cases go to the oracle in one call (one interpreter start, about a minute of
NumPy-emulated kernels). MLA's 576-value latent appears as a TRITON_ATTN head of 576:
vLLM 0.34 has no MLA backend that accepts a per-token-head or Triton-written fp8 cache
(FLASHMLA / TRITON_MLA write fp8 with the CUDA op ``concat_and_cache_mla``).
"""

from __future__ import annotations

import base64
import ctypes
import math
from collections import defaultdict

import install_vllm
import pytest
import torch
from vllm_release import run_oracle

from kvpolicy.engine.plan import plan_layout
from kvpolicy.engine.runtime import KVCache, allocate
from kvpolicy.engine.runtime.quantize import hadamard, rht_block, rht_signs
from kvpolicy.policy.backends import BACKENDS
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.spec import KVCacheSpec

PER_TOKEN_HEAD = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]
PER_TENSOR = ["fp8", "fp8_e4m3", "fp8_e5m2"]
DTYPES = ["bfloat16", "float16", "float32"]
# head sizes: powers of two, and 96 / 576 (576 = MLA's latent width), whose int4 transform is
# block-diagonal (blocks of 32 and 64); per-token-head scales need head_size % 4 (int4: % 8)
HEADS = {"per_token_head": [64, 96, 128, 256, 576], "per_tensor": [64, 128, 576]}
READ_HEADS = {"int8_per_token_head": [128, 576], "fp8_per_token_head": [128, 576],
              "int4_per_token_head": HEADS["per_token_head"], "per_tensor": [128]}
NUM_KV_HEADS = 2
BLOCK_SIZE = 16
NUM_BLOCKS = 5
TENSOR_SCALES = (0.37, 0.0625)  # per-tensor K and V scales: one inexact division, one power of two
READS = 12  # tokens whose K and V cells are dequantized by vLLM (attention is the slow kernel)

FIGURES: dict[tuple[str, str, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))


def _cases() -> list[tuple[str, str, int]]:
    out = []
    for mode in PER_TOKEN_HEAD + PER_TENSOR:
        kind = "per_token_head" if mode in PER_TOKEN_HEAD else "per_tensor"
        for dtype in DTYPES:
            for head in HEADS[kind]:
                out.append((mode, dtype, head))
    return out


CASES = _cases()


def _read(mode: str, head: int) -> bool:
    return head in READ_HEADS.get(mode, READ_HEADS["per_tensor"])


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
    g = torch.Generator().manual_seed(len(CASES) * head + DTYPES.index(dtype_name))
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


# ---- the oracle, once --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_cells(vllm_sites) -> dict[tuple[str, str, int], dict]:
    try:
        install_vllm.ensure_triton()
    except install_vllm.InstallError as exc:
        pytest.fail(f"installing Triton failed: {exc}", pytrace=False)
    cases = []
    for mode, dtype, head in CASES:
        key, value, slots = make_inputs(mode, dtype, head)
        k_scale, v_scale = _scales(mode)
        write = dict(kv_cache_dtype=mode, dtype=dtype, num_kv_heads=NUM_KV_HEADS, head_size=head,
                     block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, key=_b64(key), value=_b64(value), slots=slots,
                     k_scale=k_scale, v_scale=v_scale)
        cases.append({"write": write, "read_slots": _read_slots(slots) if _read(mode, head) else []})
    answers = run_oracle("0.34.0", "v034_kernels", [{"facts": True}, *cases], timeout=1800)
    facts, answers = answers[0], answers[1:]
    assert facts.get("patched") and facts.get("interpret") == "1", facts
    return {case: answer for case, answer in zip(CASES, answers, strict=True)}


def kvpolicy_cache(mode: str, dtype: str, head: int) -> KVCache:
    """kvpolicy's cache for TRITON_ATTN, one layer, as the oracle's (per_layer HND: vLLM's logical order)."""
    spec = KVCacheSpec(num_layers=1, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=head, dtype=dtype,
                       kv_cache_dtype=mode)
    cache = allocate(plan_layout(Layout.parse("LBHNC"), spec, BACKENDS["TRITON_ATTN"], NUM_BLOCKS))
    cache.set_tensor_scales(0, *_scales(mode))
    return cache


def cell_addresses(cache: KVCache, slots: list[int]) -> torch.Tensor:
    """Byte addresses (2, T, H, cell_bytes) in ``cache.raw[0]`` of layer 0's K and V cells at ``slots``."""
    plan = cache.plan
    spec, v, elem = plan.spec, plan.layers[0].view, plan.element_size
    elements = torch.arange(plan.buffers[v.buffer].nbytes // elem).as_strided(v.shape, v.strides, v.storage_offset)
    blocks = torch.tensor([s // spec.block_size for s in slots])
    offsets = torch.tensor([s % spec.block_size for s in slots])
    cells = elements[blocks, :, offsets].permute(1, 0, 2, 3)  # (kv, T, H, D')
    return (cells.unsqueeze(-1) * elem + torch.arange(elem)).flatten(-2)


def vllm_cell_bytes(answer: dict, slots: list[int]) -> torch.Tensor:
    """(2, T, H, C) cells of ``slots`` in the oracle's cache (num_blocks, H, block_size, 2C)."""
    written = _unb64(answer["cache"], torch.uint8, answer["shape"])
    c = written.shape[-1] // 2
    s = torch.tensor(slots)
    per_slot = written[s // BLOCK_SIZE, :, s % BLOCK_SIZE]  # (T, H, 2C)
    return torch.stack([per_slot[..., :c], per_slot[..., c:]])


def same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: equal bits, or both zeros, or both NaN."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return (a.view(ints) == b.view(ints)) | ((a == 0) & (b == 0)) | (a.isnan() & b.isnan())


# ---- the tests ---------------------------------------------------------------------------------


def _id(case: tuple[str, str, int]) -> str:
    return "-".join(map(str, case))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kvpolicy_writes_vllms_bytes(vllm_cells, case: tuple[str, str, int]) -> None:
    answer = vllm_cells[case]
    assert "error" not in answer, answer.get("error")
    key, value, slots = make_inputs(*case)
    cache = kvpolicy_cache(*case)
    cache.write(0, key, value, torch.tensor(slots))
    kept = [s for s in slots if s >= 0]
    mine = cache.raw[0][cell_addresses(cache, kept)]  # (2, T, H, C)
    theirs = vllm_cell_bytes(answer, kept)
    same = (mine == theirs).all(-1)
    FIGURES[case]["write_cells"] += same.numel()
    FIGURES[case]["write_identical"] += int(same.sum())
    bad = (~same).nonzero().tolist()
    assert not bad, f"{len(bad)} of {same.numel()} cells differ, first (kv, token, head) {bad[:3]}: " + \
        f"kvpolicy {mine[tuple(bad[0])].tolist()} vLLM {theirs[tuple(bad[0])].tolist()}"


@pytest.mark.parametrize("case", [c for c in CASES if _read(c[0], c[2])], ids=_id)
def test_kvpolicy_reads_vllms_cells_as_vllm_dequantizes_them(vllm_cells, case: tuple[str, str, int]) -> None:
    _, dtype, head = case
    answer = vllm_cells[case]
    assert "error" not in answer, answer.get("error")
    _, _, slots = make_inputs(*case)
    read_slots = _read_slots(slots)
    torch_dtype = getattr(torch, dtype)
    theirs = _unb64(answer["read"], torch_dtype, (2, len(read_slots), NUM_KV_HEADS, head))
    cache = kvpolicy_cache(*case)
    addresses = cell_addresses(cache, read_slots)
    cache.raw[0][addresses] = vllm_cell_bytes(answer, read_slots)  # vLLM's cells, byte for byte
    k, v = cache.read(0, torch.tensor(read_slots), torch_dtype)
    mine = torch.stack([k, v])
    same = same_values(mine, theirs).all(-1)
    FIGURES[case]["read_cells"] += same.numel()
    FIGURES[case]["read_identical"] += int(same.sum())
    bad = (~same).nonzero().tolist()
    assert not bad, f"{len(bad)} of {same.numel()} cells read differently, first (kv, token, head) {bad[:3]}: " + \
        f"kvpolicy {mine[tuple(bad[0])][:8].tolist()} vLLM {theirs[tuple(bad[0])][:8].tolist()}"


def test_figures(vllm_cells) -> None:
    """Cells compared and identical per mode and head size, both directions (printed with -s / -rP)."""
    rows: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (mode, _dtype, head), f in FIGURES.items():
        row = rows[(mode, head)]
        row[0] += f["write_cells"]
        row[1] += f["write_identical"]
        row[2] += f["read_cells"]
        row[3] += f["read_identical"]
    lines = ["mode                  head  written->vLLM identical  vLLM->read identical"]
    for (mode, head), (wc, wi, rc, ri) in sorted(rows.items()):
        lines.append(f"{mode:21s} {head:4d}  {wi:7d} / {wc:<7d}          {ri:6d} / {rc:<6d}")
    total = [sum(r[i] for r in rows.values()) for i in range(4)]
    lines.append(f"{'all (bf16, fp16, fp32)':26s}  {total[1]:7d} / {total[0]:<7d}"
                 f"          {total[3]:6d} / {total[2]:<6d}")
    print("\n" + "\n".join(lines))
    if rows:  # run with the comparisons above (not alone)
        assert total[0] == total[1] and total[2] == total[3]
