"""Kernel oracle: a vLLM release's own Triton KV-cache kernels, run on the CPU by Triton's interpreter.

One oracle for every release 0.24.0-0.34.0: what differs between them (how the cache is
allocated, the K/V dim of 0.24-0.25, the functions that split the views) is asked of the
release, never branched on its version. Runs under the installed release (PYTHONPATH = its
site) with the harness's Triton site (``install_vllm.triton_site()``) appended,
``TRITON_INTERPRET=1``. Reads a JSON list of cases on stdin, writes one JSON result per case
on stdout. Byte strings travel as base64.

  {"facts": true}
      versions, and which interpreter conversions the stand-ins below replace.
  {"write": {kv_cache_dtype, dtype, num_kv_heads, head_size, block_size, num_blocks, layout,
             key, value, slots, k_scale, v_scale}, "read_slots": [...]}
      One layer's cache, zeroed, allocated for the per-layer ``layout`` (LBNHC or LBHNC) as the
      release allocates it (`allocate`), then ``TritonAttentionImpl.do_kv_cache_update`` (vLLM's
      own, on an impl built with ``__new__`` plus the attributes it reads, as in v034.py) writes
      ``key`` and ``value`` ((T, H, D) of ``dtype``, raw bytes) at ``slots``: for a per-token-head
      dtype the backend's ``_pth_key_value_caches`` / ``_ensure_scale_caches`` split the cache and
      ``triton_reshape_and_cache_flash_per_token_head_quant`` (int8, fp8; int4 from 0.25:
      ``single_rht``, then ``_reshape_cache_int4_kernel``) writes it; otherwise
      ``triton_reshape_and_cache_flash``. Answers the buffer's bytes ("cache", in its physical
      order) and, for the cells of ``read_slots`` (K cells, then V cells, taken through the same
      views), vLLM's own dequantization of each ("read", (2R, H, D) of ``dtype``): the output of
      ``unified_attention`` (the backend's attention entry point; int4 goes on to
      ``unified_attention_int4``, whose inverse transform is part of it) for 2R one-token
      sequences, sequence i holding cell i as its V at slot 0 of block i of a cache allocated
      the same way, a K of zero bytes (every score 0, so the softmax weight is exactly 1), a
      zero query of ``dtype`` and one query head per KV head.

STAND-INs, each needed only because this runs on a CPU:

* ``CUDA_VISIBLE_DEVICES=""``: vLLM's ``triton_utils`` disables Triton when no GPU driver is
  active, except in this "distributed, devices not yet visible" case; with it the real
  ``triton``/``tl`` reach the kernels and ``TRITON_INTERPRET=1`` runs them in NumPy.
* ``current_platform.get_device_capability`` answers (9, 0) (fp8 writes assert SM89+), and
  ``torch.cuda.get_device_capability`` too (``triton_reshape_and_cache_flash`` picks a tile
  size from it; tile sizes change no arithmetic).
* Interpreter conversions replaced by what the compiled kernels do on NVIDIA GPUs (the
  interpreter emulates them with bit tricks that do not round as the hardware does):
  - float -> float (``_convert_float``): fp32 -> bf16 / fp16 / fp8 round to nearest even
    (``cvt.rn``); to fp8 with ``.satfinite`` (finite overflow and infinities to the largest
    finite value, NaN to the canonical NaN 0x7F); fp8 -> wider is exact with NaN kept.
    The interpreter's own rounds ties away from zero, drops the carry when rounding
    overflows the mantissa (1.97 -> fp8e4nv gives 1.0), does not saturate and truncates
    fp32 -> bf16 (triton-lang/triton#8322, PRs #9808 and #11897).
  - float -> integer: truncation that saturates with NaN -> 0 (``cvt.rzi``); NumPy's cast
    gives INT_MIN for NaN and every out-of-range value.
  - ``tl.dot``: bf16 operands as their values (the interpreter multiplies bf16 storage
    integers); fp32 operands unrounded (``input_precision`` is ignored, as the interpreter
    does; a GPU's default TF32 would round them, see README).
  Nothing else of Triton or vLLM is replaced: every arithmetic operation of the kernels,
  their order, clamps, reductions and stores run as vLLM wrote them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# stdout carries only the JSON answer: route everything else printed to fd 1 to stderr.
_ANSWER = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import install_vllm  # noqa: E402

sys.path.append(str(install_vllm.triton_site()))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import device_capability  # noqa: E402
from _host import pin_host  # noqa: E402

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)

CAPABILITY = (9, 0)

# ---------------------------------------------------------------------------
# STAND-IN: the compiled kernels' conversions in the interpreter
# ---------------------------------------------------------------------------

# (exponent bits, mantissa bits, bias, has infinities) of each format the kernels convert between
_FORMATS = {
    "fp32": (8, 23, 127, True),
    "fp16": (5, 10, 15, True),
    "bf16": (8, 7, 127, True),
    "fp8e4nv": (4, 3, 7, False),
    "fp8e5": (5, 2, 15, True),
}


def _format_name(dtype):
    return {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8e4nv": "fp8e4nv", "fp8e5": "fp8e5"}[dtype.name]


def _decode_bits(bits, fmt):
    """float64 values of ``bits`` (uint64 array) in format ``fmt``."""
    e_bits, m_bits, bias, has_inf = _FORMATS[fmt]
    total = 1 + e_bits + m_bits
    sign = np.where((bits >> (total - 1)) & 1, -1.0, 1.0)
    exp = ((bits >> m_bits) & ((1 << e_bits) - 1)).astype(np.int64)
    man = (bits & ((1 << m_bits) - 1)).astype(np.float64)
    emax = (1 << e_bits) - 1
    normal = sign * np.ldexp(1.0 + man / (1 << m_bits), exp - bias)
    sub = sign * np.ldexp(man / (1 << m_bits), 1 - bias)
    out = np.where(exp == 0, sub, normal)
    if has_inf:
        out = np.where((exp == emax) & (man == 0), sign * np.inf, out)
        out = np.where((exp == emax) & (man != 0), np.nan, out)
    else:  # e4m3fn: only S.1111.111 is NaN; the rest of exponent 15 is finite
        out = np.where((exp == emax) & (man == (1 << m_bits) - 1), np.nan, out)
    return out


def _encode_values(values, fmt):
    """Round float64 ``values`` to ``fmt``, nearest-even; fp8 saturating (cvt.rn.satfinite). uint64 bits."""
    e_bits, m_bits, bias, has_inf = _FORMATS[fmt]
    total = 1 + e_bits + m_bits
    v = np.asarray(values, dtype=np.float64)
    neg = np.signbit(v)
    a = np.abs(v)
    emin = 1 - bias
    if has_inf:
        emax_finite = (1 << e_bits) - 2 - bias
        largest = np.ldexp(2.0 - 2.0 ** -m_bits, emax_finite)
    else:
        emax_finite = (1 << e_bits) - 1 - bias
        largest = np.ldexp(2.0 - 2.0 ** (1 - m_bits), emax_finite)  # 448 for e4m3fn
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exp = np.maximum(np.frexp(np.where(a > 0, a, 1.0))[1] - 1, emin)
        quantum = np.ldexp(1.0, (exp - m_bits).astype(np.int64))
        rounded = np.round(a / quantum) * quantum  # NumPy rounds half to even; a / quantum is exact
    saturate = fmt.startswith("fp8")
    overflow = rounded > largest
    if saturate:
        rounded = np.where(overflow | np.isinf(a), largest, rounded)
    # bits of a finite non-negative value
    with np.errstate(divide="ignore", invalid="ignore"):
        rexp = (np.frexp(np.where((rounded > 0) & np.isfinite(rounded), rounded, 1.0))[1] - 1).astype(np.int64)
    is_sub = (rounded < np.ldexp(1.0, emin)) | (rounded == 0)
    sub_man = np.round(rounded / np.ldexp(1.0, emin - m_bits))
    norm_man = np.round((rounded / np.ldexp(1.0, rexp) - 1.0) * (1 << m_bits))
    bits = np.where(is_sub, sub_man, ((rexp + bias) << m_bits) + norm_man)
    bits = np.nan_to_num(bits).astype(np.uint64)
    if has_inf:
        inf_bits = ((1 << e_bits) - 1) << m_bits
        bits = np.where(~saturate & (overflow | np.isinf(a)), inf_bits, bits)
    bits = bits | (neg.astype(np.uint64) << np.uint64(total - 1))
    nan_bits = ((1 << (e_bits + m_bits)) - 1) if fmt.startswith("fp8") else (
        (((1 << e_bits) - 1) << m_bits) | (1 << (m_bits - 1)))  # canonical quiet NaN
    return np.where(np.isnan(v), nan_bits, bits).astype(np.uint64)


_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def _as_bits(data, fmt):
    width = 1 + _FORMATS[fmt][0] + _FORMATS[fmt][1]
    return np.asarray(data).view(_UINT[width]).astype(np.uint64)


def _to_storage(bits, fmt, shape):
    width = 1 + _FORMATS[fmt][0] + _FORMATS[fmt][1]
    return bits.astype(_UINT[width]).reshape(shape)


def patch_interpreter():
    """Install the conversions above into Triton's interpreter (see the module docstring)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    floats = (tl.float32, tl.float16, tl.bfloat16, tl.float8e4nv, tl.float8e5)

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        src, dst = _format_name(input_dtype), _format_name(output_dtype)
        values = _decode_bits(_as_bits(input, src), src)
        return _to_storage(_encode_values(values, dst), dst, np.shape(input))

    interp._convert_float = convert_float
    builder = interp.InterpreterBuilder
    original_cast = builder.cast_impl

    def values_of(src):
        s = src.dtype.scalar
        if s in floats:
            return _decode_bits(_as_bits(src.data, _format_name(s)), _format_name(s)).reshape(np.shape(src.data))
        return np.asarray(src.data).astype(np.float64)

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if d in floats and s != d and (s in floats or (s.is_int() and not s.is_bool())):
            name = _format_name(d)
            data = _to_storage(_encode_values(values_of(src), name), name, np.shape(src.data))
            return interp.TensorHandle(data.view(interp._get_np_dtype(dst_type)), d)
        if s.is_floating() and d.is_int() and not d.is_bool():
            values = values_of(src)
            info = np.iinfo(interp._get_np_dtype(dst_type))
            with np.errstate(invalid="ignore"):
                out = np.clip(np.nan_to_num(np.trunc(values), nan=0.0, posinf=info.max, neginf=info.min),
                              info.min, info.max)
            return interp.TensorHandle(out.astype(interp._get_np_dtype(dst_type)), d)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder.create_fp_to_si = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    builder.create_fp_to_ui = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    builder.create_fp_ext = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    builder.create_fp_trunc = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    builder.create_si_to_fp = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    builder.create_ui_to_fp = lambda self, src, dst_type: cast_impl(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        return cast_impl(self, src, dst_type)

    builder.create_fp_to_fp = create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def values(h):
            if h.dtype.scalar in floats and h.dtype.scalar != tl.float32:
                name = _format_name(h.dtype.scalar)
                return _decode_bits(_as_bits(h.data, name), name).reshape(h.data.shape)
            return h.data.astype(np.float64) if h.data.dtype != np.float32 else h.data
        out_dtype = d.data.dtype
        # products of bf16/fp16/fp8 operands are exact in fp32; the sum is accumulated in out_dtype
        prod = np.matmul(values(a).astype(out_dtype), values(b).astype(out_dtype), dtype=out_dtype)
        return interp.TensorHandle(prod + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


# ---------------------------------------------------------------------------
# vLLM's kernels
# ---------------------------------------------------------------------------

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _b64(t):
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()



def _tensor(data, dtype, shape):
    raw = bytearray(base64.b64decode(data))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


@contextlib.contextmanager
def cuda_capability():
    """STAND-IN: the platform and torch.cuda answer CAPABILITY (see the module docstring)."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    saved_torch = torch.cuda.get_device_capability
    saved_cls = platform_cls.__dict__.get("get_device_capability")
    torch.cuda.get_device_capability = lambda device=None: CAPABILITY
    # has_device_capability is a classmethod that asks the class, not the instance
    platform_cls.get_device_capability = classmethod(lambda cls, device_id=0: current_platform.get_device_capability())
    try:
        with device_capability(CAPABILITY):
            yield
    finally:
        torch.cuda.get_device_capability = saved_torch
        if saved_cls is None:
            del platform_cls.get_device_capability
        else:
            platform_cls.get_device_capability = saved_cls


def _impl(kv_cache_dtype, head_size, num_kv_heads):
    """TritonAttentionImpl built with __new__ and the attributes do_kv_cache_update, _pth_key_value_caches
    and _ensure_scale_caches read in any release 0.24-0.34, set as its __init__ sets them (v034.py does
    the same; a release reads a subset of them)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
    mode = get_kv_quant_mode(kv_cache_dtype)
    impl.__dict__.update({
        "attn_type": AttentionType.DECODER,
        "head_size": head_size,
        "num_kv_heads": num_kv_heads,
        "kv_cache_dtype": kv_cache_dtype,
        "fp8_dtype": current_platform.fp8_dtype(),
        "kv_sharing_target_layer_name": None,
        "_kv_quant_mode": mode,
        "_is_per_token_head_quant": mode.is_per_token_head,
        "_k_scale_cache": None,
        "_v_scale_cache": None,
        "_set_kv_ptr_range": False,
    })
    return impl, mode


def _cache_dtype(kv_cache_dtype, dtype):
    """The cache tensor's dtype, as vLLM allocates it (kv_cache_dtype_str_to_dtype)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    return kv_cache_dtype_str_to_dtype(kv_cache_dtype, types.SimpleNamespace(dtype=dtype))


_HEAD_ORDER = {"LBNHC": "NHD", "LBHNC": "HND"}  # the per-layer layouts, as 0.24-0.28 name them


def allocate(case, num_blocks, dtype):
    """One layer's cache for ``case["layout"]`` (a per-layer layout), allocated as this release does:
    (zeroed buffer, the layer's view the backend is handed).

    0.24-0.28 (the backend has ``get_kv_cache_stride_order``): ``get_kv_cache_shape`` under the head
    order set with ``set_kv_cache_layout``, the buffer in the stride order's physical order, permuted
    back (``GPUModelRunner._reshape_kv_cache``). 0.29 on: the ``FullAttentionSpec`` (through the
    backend's ``customize_spec``), its
    ``compute_layer_kv_cache_shape_bytes`` and ``compute_layout_strides`` for the ``KVCacheLayout``
    (``create_kv_cache_views``). The shape is the backend's own: ``(B, 2, N, H, D)`` in 0.24-0.25,
    ``(B, H, N, 2C)`` from 0.26.
    """
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    kv_cache_dtype, layout = case["kv_cache_dtype"], case["layout"]
    h, d, n = case["num_kv_heads"], case["head_size"], case["block_size"]
    cache_dtype = _cache_dtype(kv_cache_dtype, dtype)
    if hasattr(TritonAttentionBackend, "get_kv_cache_stride_order"):
        from vllm.v1.attention.backends import utils as backend_utils

        backend_utils.set_kv_cache_layout(_HEAD_ORDER[layout])
        try:
            shape = TritonAttentionBackend.get_kv_cache_shape(num_blocks, n, h, d, cache_dtype_str=kv_cache_dtype)
            order = TritonAttentionBackend.get_kv_cache_stride_order()
        finally:
            backend_utils.set_kv_cache_layout(None)
        buffer = torch.zeros([shape[i] for i in order], dtype=cache_dtype)
        return buffer, buffer.permute([order.index(i) for i in range(len(order))])
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    # the layer's spec as Attention.get_kv_cache_spec builds it, then the backend's customize_spec
    # (the runner applies it: per-token-head cells carry their inline scale)
    spec = TritonAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=n, num_kv_heads=h, head_size=d, dtype=cache_dtype, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype)))
    shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
    strides = compute_layout_strides(spec, num_blocks, 1, KVCacheLayout[layout])[1:]  # without the layer dim
    buffer = torch.zeros(int(np.prod(shape)), dtype=torch.uint8)
    return buffer, torch.as_strided(buffer, shape, strides).view(cache_dtype)


def key_value_caches(impl, mode, kv_cache):
    """The K and V caches (B, N, H, cell) the backend hands its kernels for ``kv_cache``, and the
    per-token-head scale caches: ``_pth_key_value_caches`` where the release has it (0.25 on); else, as
    0.24's ``do_kv_cache_update`` and ``forward`` split it (``_ensure_scale_caches``, ``unbind(1)``, fp8
    retyped). Per tensor: ``unbind(1)`` of the K/V dim (0.24-0.25) or ``transpose(1, 2).split(head_size)``
    of the packed cell (0.26 on), retyped to fp8 as ``do_kv_cache_update`` does. A per-token-head cell
    holds its inline scale: the views span data and scale."""
    if mode.is_per_token_head:
        if hasattr(impl, "_pth_key_value_caches"):
            key_cache, value_cache = impl._pth_key_value_caches(kv_cache)
        else:
            impl._ensure_scale_caches(kv_cache)
            key_cache, value_cache = kv_cache.unbind(1)
            if key_cache.dtype == torch.uint8:
                key_cache, value_cache = key_cache.view(impl.fp8_dtype), value_cache.view(impl.fp8_dtype)
        return key_cache, value_cache, impl._k_scale_cache, impl._v_scale_cache
    if kv_cache.dim() == 5:
        key_cache, value_cache = kv_cache.unbind(1)
    else:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    if impl.kv_cache_dtype.startswith("fp8") and key_cache.dtype != impl.fp8_dtype:
        key_cache, value_cache = key_cache.view(impl.fp8_dtype), value_cache.view(impl.fp8_dtype)
    return key_cache, value_cache, None, None


def write(case):
    """vLLM's ``do_kv_cache_update`` on a zeroed cache: (the buffer, the K and V cells (2, B, N, H, C) as bytes)."""
    dtype = _DTYPES[case["dtype"]]
    h, d = case["num_kv_heads"], case["head_size"]
    impl, mode = _impl(case["kv_cache_dtype"], d, h)
    t = len(case["slots"])
    key = _tensor(case["key"], dtype, (t, h, d))
    value = _tensor(case["value"], dtype, (t, h, d))
    slots = torch.tensor(case["slots"], dtype=torch.int64)
    buffer, view = allocate(case, case["num_blocks"], dtype)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(float(case.get("k_scale", 1.0))),
                                  _v_scale=torch.tensor(float(case.get("v_scale", 1.0))))
    try:
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        AttentionLayerBase.bind_kv_cache(layer, view)  # 0.28 on: how the runner hands a layer its view
    except (ImportError, AttributeError):
        layer.kv_cache = view
    with cuda_capability():
        impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slots)
    # the same impl (its scale caches already made: 0.24-0.26 fill new ones with 1.0)
    key_cache, value_cache, _, _ = key_value_caches(impl, mode, view)
    return buffer, torch.stack([key_cache.view(torch.uint8), value_cache.view(torch.uint8)])


def read(case, cells):
    """vLLM's dequantization of the cells at ``case["read_slots"]`` (module docstring): the K cells (with
    the K scale, for per-tensor fp8), then the V cells. ``cells``: (2, B, N, H, C) bytes, from `write`."""
    n = case["block_size"]
    slots = torch.tensor(case["read_slots"], dtype=torch.int64)
    per_slot = cells[:, slots // n, slots % n]  # (2, R, H, C)
    return torch.cat([dequantize(case, per_slot[0], float(case.get("k_scale", 1.0))),
                      dequantize(case, per_slot[1], float(case.get("v_scale", 1.0)))])


def dequantize(case, cells, tensor_scale):
    """``unified_attention`` over one one-token sequence per cell of ``cells`` (R, H, C), the cell as its V."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    dtype = _DTYPES[case["dtype"]]
    h, d = case["num_kv_heads"], case["head_size"]
    impl, mode = _impl(case["kv_cache_dtype"], d, h)
    count = cells.shape[0]
    _, view = allocate(case, count, dtype)
    key_cache, value_cache, k_scales, v_scales = key_value_caches(impl, mode, view)
    value_cache.view(torch.uint8)[:, 0] = cells  # the V of slot 0 of block i (scale included); K stays zero bytes
    if mode.is_per_token_head:
        k_descale = v_descale = None
    else:
        # as TritonAttentionImpl.forward: layer._k_scale / _v_scale expanded to (seqs, kv heads)
        k_descale = v_descale = torch.tensor(tensor_scale, dtype=torch.float32).expand(count, h)
    query = torch.zeros(count, h, d, dtype=dtype)
    out = torch.empty(count, h, d, dtype=dtype)
    with cuda_capability():
        unified_attention(
            q=query, k=key_cache, v=value_cache, out=out,
            cu_seqlens_q=torch.arange(count + 1, dtype=torch.int32), max_seqlen_q=1,
            seqused_k=torch.ones(count, dtype=torch.int32), max_seqlen_k=1,
            softmax_scale=1.0, causal=True, window_size=(-1, -1),
            block_table=torch.arange(count, dtype=torch.int32).view(count, 1), softcap=0.0,
            q_descale=None, k_descale=k_descale, v_descale=v_descale,
            kv_quant_mode=mode, k_scale_cache=k_scales, v_scale_cache=v_scales,
        )
    return out


def facts(case):
    import triton
    import vllm

    return {"vllm": vllm.__version__, "triton": triton.__version__, "torch": torch.__version__,
            "interpret": os.environ.get("TRITON_INTERPRET"), "patched": PATCHED}


PATCHED = False


def handle(case):
    if case.get("facts"):
        return facts(case)
    if "write" in case:
        buffer, cells = write(case["write"])
        answer = {"cache": _b64(buffer.view(torch.uint8).reshape(-1))}
        if case.get("read_slots"):
            answer["read"] = _b64(read({**case["write"], "read_slots": case["read_slots"]}, cells))
        return answer
    raise ValueError(f"unknown case kind: {sorted(case)}")


def main():
    global PATCHED
    cases = json.load(sys.stdin)
    if not os.environ.get("KVPOLICY_UNPATCHED_INTERPRETER"):
        patch_interpreter()
        PATCHED = True
    results = []
    for case in cases:
        try:
            results.append(handle(case))
        except Exception as exc:
            import traceback

            traceback.print_exc()
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    json.dump(results, _ANSWER)
    _ANSWER.write("\n")
    _ANSWER.flush()


if __name__ == "__main__":
    main()
