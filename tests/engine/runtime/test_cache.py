"""kvpolicy.engine.runtime.cache: quantized writes and reads, bit-exact against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_allocate import COMBO_IDS, COMBOS, ODD, ODD_LAYOUTS, cell_addresses, fill_random, make_plan
from test_reference import decode_ref, encode_ref

from kvpolicy.engine.runtime import KVCache, allocate, quantize
from kvpolicy.policy.errors import InputError

# written to layer 1: one skipped token (-1), slots spread over blocks and offsets
SLOTS = [0, 7, -1, 19, 10, 5]
LAYER = 1


def make_inputs(cache: KVCache, slots: list[int] = SLOTS, dtype: torch.dtype = torch.bfloat16, seed: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    spec = cache.plan.spec
    gen = torch.Generator().manual_seed(seed)
    shape = (len(slots), spec.num_kv_heads, spec.head_size)
    key = (torch.randn(shape, generator=gen) * 2).to(dtype)
    value = None if spec.kv_factor == 1 else (torch.randn(shape, generator=gen) * 0.5).to(dtype)
    return key, value, torch.tensor(slots)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def code_dtype(plan) -> str:
    """The fp8 format of fp8_per_tensor codes: TRITON_ATTN writes e4m3 whatever the cache dtype (vLLM 0.34)."""
    if plan.spec.quant_mode.value == "fp8_per_tensor" and plan.backend.name == "TRITON_ATTN":
        return "float8_e4m3fn"
    return plan.spec.cache_dtype.value


def snapshot(cache: KVCache) -> list[torch.Tensor]:
    return [r.clone() for r in cache.raw]


def assert_unchanged(cache: KVCache, before: list[torch.Tensor]) -> None:
    for r, b in zip(cache.raw, before, strict=True):
        assert torch.equal(r, b), "a rejected call changed the cache"


def check_write_read(cache: KVCache, slots: list[int] = SLOTS, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write LAYER, then: written cells hold the reference bytes, no other byte changed, reads dequantize exactly."""
    plan, spec = cache.plan, cache.plan.spec
    mode, cdt = spec.quant_mode.value, code_dtype(plan)
    fill_random(cache)
    before = snapshot(cache)
    key, value, slot_t = make_inputs(cache, slots, dtype)
    cache.write(LAYER, key, value, slot_t)

    kept = [i for i, s in enumerate(slots) if s >= 0]
    kept_slots = [slots[i] for i in kept]
    addrs = cell_addresses(plan, LAYER, kept_slots)  # (K, T, H, cell)
    raw = cache.raw[plan.layers[LAYER].view.buffer]
    parts = [key] if value is None else [key, value]
    scales = [cache.k_scales[LAYER], cache.v_scales[LAYER]]
    for kv, part in enumerate(parts):
        for t, i in enumerate(kept):
            for h in range(spec.num_kv_heads):
                values = part[i, h].float().tolist()
                want = encode_ref(values, mode, cdt, scales[kv], in_dtype=name(dtype))
                assert bytes(raw[addrs[kv, t, h]].tolist()) == want, (kv, t, h)

    # every byte outside the written cells, in every buffer (other layers, padding), is unchanged
    for b, (r, old) in enumerate(zip(cache.raw, before, strict=True)):
        mask = torch.ones(r.numel(), dtype=torch.bool)
        if b == plan.layers[LAYER].view.buffer:
            mask[addrs.flatten()] = False
        assert torch.equal(r[mask], old[mask]), f"bytes outside the written cells changed in buffer {b}"

    got_k, got_v = cache.read(LAYER, torch.tensor(kept_slots, dtype=torch.int64), dtype=torch.float32)
    for kv, (part, got) in enumerate(zip(parts, (got_k, got_v), strict=False)):
        for t, i in enumerate(kept):
            for h in range(spec.num_kv_heads):
                cell = encode_ref(part[i, h].float().tolist(), mode, cdt, scales[kv], in_dtype=name(dtype))
                assert got[t, h].tolist() == decode_ref(cell, mode, cdt, spec.head_size, scales[kv])
    if value is None:
        assert got_v is None
    if mode == "none" and key.dtype == cache._cache_dtype:
        assert torch.equal(got_k, key[kept].float())


@pytest.mark.parametrize(("backend", "layout", "dtype"), COMBOS, ids=COMBO_IDS)
def test_write_then_read_is_bit_exact_and_touches_only_its_cells(backend: str, layout: str, dtype: str) -> None:
    check_write_read(allocate(make_plan(backend, layout, kv_cache_dtype=dtype)))


@pytest.mark.parametrize("layout", ODD_LAYOUTS)
@pytest.mark.parametrize("geo", ODD, ids=[str(g) for g in ODD])
def test_odd_cells_and_padded_pages_write_exactly(layout: str, geo: dict) -> None:
    check_write_read(allocate(make_plan("TRITON_ATTN", layout, **geo)))


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "int4_per_token_head", "fp8_e5m2", "float16"])
def test_large_writes_take_the_tensor_path_and_stay_exact(dtype: str) -> None:
    """Over 64 tokens, slot checks and row arithmetic run as tensor ops instead of Python."""
    cache = allocate(make_plan(layout="LBHNC", kv_cache_dtype=dtype, num_blocks=40))
    slots = torch.randperm(160, generator=torch.Generator().manual_seed(5))[:100].tolist()
    slots[7] = slots[50] = -1
    check_write_read(cache, slots)


@settings(max_examples=30, deadline=None)
@given(combo=st.sampled_from(COMBOS), data=st.data())
def test_any_slot_mapping_round_trips(combo: tuple[str, str, str], data: st.DataObject) -> None:
    backend, layout, dtype = combo
    cache = allocate(make_plan(backend, layout, kv_cache_dtype=dtype, num_blocks=20))
    size = data.draw(st.sampled_from([1, 3, 9, 70]))
    slots = data.draw(st.lists(st.integers(0, 79), min_size=size, max_size=size, unique=True))
    skipped = data.draw(st.lists(st.integers(0, size - 1), max_size=2))
    check_write_read(cache, [-1 if i in skipped else s for i, s in enumerate(slots)])


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "fp8", "auto"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
def test_other_input_dtypes_are_accepted(dtype: str, input_dtype: torch.dtype) -> None:
    cache = allocate(make_plan(layout="BHLNC", kv_cache_dtype=dtype))
    if dtype == "auto":  # float32/float16 into a bf16 cache: a plain rounding cast
        key, value, slots = make_inputs(cache, [3, 4], input_dtype)
        cache.write(0, key, value, slots)
        got_k, got_v = cache.read(0, slots)
        assert torch.equal(got_k, key.to(torch.bfloat16)) and torch.equal(got_v, value.to(torch.bfloat16))
    else:
        check_write_read(cache, dtype=input_dtype)


def test_per_tensor_fp8_scales_are_per_layer_and_settable() -> None:
    cache = allocate(make_plan(layout="BLNHC", kv_cache_dtype="fp8_e4m3"))
    assert cache.k_scales == cache.v_scales == (1.0, 1.0, 1.0)
    cache.set_tensor_scales(LAYER, 0.25, 3.0)
    assert cache.k_scales[LAYER] == 0.25 and cache.v_scales[LAYER] == 3.0 and cache.k_scales[0] == 1.0
    check_write_read(cache)
    with pytest.raises(InputError, match="k_scale"):
        cache.set_tensor_scales(0, 0.0, 1.0)
    with pytest.raises(InputError, match="v_scale"):
        cache.set_tensor_scales(0, 1.0, float("nan"))
    # finite as Python floats, but 0 or infinite in the fp32 the cache computes with: every code would be
    # +-448 or 0 (they were accepted and silently stored garbage)
    for bad in (1e-300, 1e300, 1e-40):
        with pytest.raises(InputError, match=r"k_scale.*fp32"):
            cache.set_tensor_scales(0, bad, 1.0)
    assert cache.k_scales[0] == 1.0


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"])
def test_a_zero_head_reads_back_as_exact_zeros(dtype: str) -> None:
    cache = allocate(make_plan(kv_cache_dtype=dtype))
    key = torch.zeros(2, 2, 8)
    cache.write(0, key, key.clone(), torch.tensor([1, 2]))
    got_k, got_v = cache.read(0, torch.tensor([1, 2]), dtype=torch.float32)
    assert torch.equal(got_k, key) and torch.equal(got_v, key)
    assert torch.isfinite(got_k).all()


def test_all_skipped_and_empty_writes_change_nothing() -> None:
    cache = allocate(make_plan(kv_cache_dtype="int8_per_token_head"))
    fill_random(cache)
    before = snapshot(cache)
    key, value, _ = make_inputs(cache, [-1, -1])
    cache.write(0, key, value, torch.tensor([-1, -1]))
    key, value, _ = make_inputs(cache, [])
    cache.write(0, key, value, torch.tensor([], dtype=torch.int64))
    assert_unchanged(cache, before)


def test_int32_slot_mappings_work() -> None:
    cache = allocate(make_plan(kv_cache_dtype="int8_per_token_head"))
    key, value, slots = make_inputs(cache, [3, 9])
    cache.write(2, key, value, slots.to(torch.int32))
    got_k, _ = cache.read(2, slots.to(torch.int32))
    assert got_k.shape == key.shape and got_k.dtype == torch.bfloat16


# ---- reconstruction error on Gaussian data -----------------------------------------------------

ERROR_BOUNDS = {"int8_per_token_head": 0.01, "fp8_per_token_head": 0.04, "int4_per_token_head": 0.15}


@pytest.mark.parametrize("dtype", list(ERROR_BOUNDS))
def test_relative_reconstruction_error_on_gaussian_heads_of_128(dtype: str, record_property) -> None:
    plan = make_plan(layout="BHLNC", kv_cache_dtype=dtype, head_size=128, num_kv_heads=8,
                     block_size=16, num_blocks=32)
    cache = allocate(plan)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(512, 8, 128, generator=gen)
    value = torch.randn(512, 8, 128, generator=gen)
    slots = torch.randperm(plan.num_blocks * 16, generator=gen)[:512]
    cache.write(0, key, value, slots)
    got_k, got_v = cache.read(0, slots, dtype=torch.float32)
    err = float(torch.linalg.vector_norm(torch.cat([got_k - key, got_v - value]))
                / torch.linalg.vector_norm(torch.cat([key, value])))
    record_property("relative_error", err)
    print(f"\n{dtype}: relative reconstruction error {err:.4%} (bound {ERROR_BOUNDS[dtype]:.0%})")
    assert err < ERROR_BOUNDS[dtype]


# ---- MLA ---------------------------------------------------------------------------------------


def test_mla_writes_one_latent_and_reads_it_back() -> None:
    cache = allocate(make_plan("FLASHMLA", "LBNHC", kv_cache_dtype="int8_per_token_head", head_size=16))
    latent = torch.randn(3, 1, 16)
    cache.write(0, latent, None, torch.tensor([0, 5, 9]))
    got, none = cache.read(0, torch.tensor([0, 5, 9]), dtype=torch.float32)
    assert none is None and got.shape == (3, 1, 16)
    assert float((got - latent).abs().max()) < 0.05
    with pytest.raises(InputError, match="one latent per token"):
        cache.write(0, latent, latent, torch.tensor([0, 5, 9]))


# ---- input checks: clear errors, and a rejected write changes no byte --------------------------


def _bad_writes(cache: KVCache) -> list[tuple[str, dict]]:
    key, value, slots = make_inputs(cache, [1, 2, 3])
    n = cache.num_slots
    return [
        ("layer", dict(layer=3)),
        ("layer", dict(layer=-1)),
        ("layer", dict(layer=True)),
        ("key", dict(key=key[:, :1])),  # wrong head count
        ("key", dict(key=key[..., :4])),  # wrong head size
        ("key", dict(key=key.to(torch.int32))),
        ("key", dict(key=key.to("meta"))),
        ("key", dict(key=key.tolist())),
        ("value", dict(value=None)),
        ("value", dict(value=value[:2])),
        ("value", dict(value=value.float())),
        ("slot_mapping", dict(slot_mapping=slots[:2])),
        ("slot_mapping", dict(slot_mapping=slots.float())),
        ("slot_mapping", dict(slot_mapping=slots.view(3, 1))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([1, 2, n]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([1, 2, 2]))),
        ("slot_mapping", dict(slot_mapping=[1, 2, 3])),
    ]


@pytest.mark.parametrize("dtype", ["auto", "int8_per_token_head", "int4_per_token_head"])
def test_rejected_writes_name_the_argument_and_change_no_byte(dtype: str) -> None:
    cache = allocate(make_plan(layout="BHLNC", kv_cache_dtype=dtype))
    fill_random(cache)
    before = snapshot(cache)
    key, value, slots = make_inputs(cache, [1, 2, 3])
    for where, override in _bad_writes(cache):
        args = dict(layer=0, key=key, value=value, slot_mapping=slots) | override
        with pytest.raises(InputError) as info:
            cache.write(**args)
        assert info.value.diagnostics[0].file == where, (where, override, info.value)
        assert_unchanged(cache, before)


@pytest.mark.parametrize("tokens", [3, 100])
def test_out_of_range_and_repeated_slots_are_refused_on_both_paths(tokens: int) -> None:
    cache = allocate(make_plan(kv_cache_dtype="int8_per_token_head", num_blocks=40))
    fill_random(cache)
    before = snapshot(cache)
    key, value, slots = make_inputs(cache, list(range(tokens)))
    for bad, match in ((160, "out of range"), (1, "same slot twice")):
        wrong = slots.clone()
        wrong[-1] = bad
        with pytest.raises(InputError, match=match):
            cache.write(0, key, value, wrong)
        assert_unchanged(cache, before)
    with pytest.raises(InputError, match="slots must be >= 0"):
        cache.read(0, torch.cat([slots[:-1], torch.tensor([-1])]))


def test_bad_reads_are_refused() -> None:
    cache = allocate(make_plan(kv_cache_dtype="int8_per_token_head"))
    with pytest.raises(InputError, match="slots must be >= 0"):
        cache.read(0, torch.tensor([1, -1]))
    with pytest.raises(InputError, match="out of range"):
        cache.read(3, torch.tensor([1]))
    with pytest.raises(InputError, match="dtype"):
        cache.read(0, torch.tensor([1]), dtype=torch.int8)


@pytest.mark.parametrize("tokens", [3, 100])
def test_a_read_may_name_a_slot_twice(tokens: int) -> None:
    """Two sequences sharing a prefix read the same slots; reads were refused as "the same slot twice"."""
    cache = allocate(make_plan(kv_cache_dtype="int8_per_token_head", num_blocks=40))
    key, value, slots = make_inputs(cache, list(range(tokens)))
    cache.write(0, key, value, slots)
    twice = torch.cat([slots, slots.flip(0)])
    k, v = cache.read(0, twice)
    once_k, once_v = cache.read(0, slots)
    assert torch.equal(k, torch.cat([once_k, once_k.flip(0)])) and torch.equal(v, torch.cat([once_v, once_v.flip(0)]))


def test_a_meta_cache_has_geometry_but_no_data() -> None:
    cache = allocate(make_plan(), "meta")
    key = torch.zeros(1, 2, 8, device="meta")
    with pytest.raises(InputError, match="meta"):
        cache.write(0, key, key, torch.tensor([0], device="meta"))
    with pytest.raises(InputError, match="meta"):
        cache.read(0, torch.tensor([0], device="meta"))


# ---- write_layers: every layer in one call ---------------------------------------------------


def make_layer_inputs(cache: KVCache, num_tokens: int, dtype: torch.dtype = torch.bfloat16, seed: int = 3
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    spec = cache.plan.spec
    gen = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, num_tokens, spec.num_kv_heads, spec.head_size)
    keys = (torch.randn(shape, generator=gen) * 2).to(dtype)
    values = None if spec.kv_factor == 1 else (torch.randn(shape, generator=gen) * 0.5).to(dtype)
    return keys, values


def assert_write_layers_equals_single_writes(make: callable, slots: list[int], dtype: torch.dtype = torch.bfloat16
                                             ) -> None:
    """``write_layers`` leaves every byte as one ``write`` per layer does, from the same starting bytes."""
    batched, single = make(), make()
    for cache in (batched, single):
        fill_random(cache)
        if cache.plan.spec.quant_mode.value == "fp8_per_tensor":  # distinct scales per layer and K/V
            for layer in range(cache.plan.num_layers):
                cache.set_tensor_scales(layer, 0.5 + layer, 2.0 / (layer + 1))
    keys, values = make_layer_inputs(batched, len(slots), dtype)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    batched.write_layers(keys, values, slot_t)
    for layer in range(single.plan.num_layers):
        single.write(layer, keys[layer], None if values is None else values[layer], slot_t)
    for got, want in zip(batched.raw, single.raw, strict=True):
        assert torch.equal(got, want), "write_layers and per-layer writes left different bytes"


@pytest.mark.parametrize(("backend", "layout", "dtype"), COMBOS, ids=COMBO_IDS)
def test_write_layers_writes_the_bytes_of_one_write_per_layer(backend: str, layout: str, dtype: str) -> None:
    assert_write_layers_equals_single_writes(lambda: allocate(make_plan(backend, layout, kv_cache_dtype=dtype)), SLOTS)


@pytest.mark.parametrize("layout", ODD_LAYOUTS)
@pytest.mark.parametrize("geo", ODD, ids=[str(g) for g in ODD])
def test_write_layers_on_odd_cells_and_padded_pages(layout: str, geo: dict) -> None:
    assert_write_layers_equals_single_writes(lambda: allocate(make_plan("TRITON_ATTN", layout, **geo)), SLOTS)


@settings(max_examples=30, deadline=None)
@given(combo=st.sampled_from(COMBOS), data=st.data())
def test_write_layers_matches_single_writes_for_any_slot_mapping(combo: tuple[str, str, str], data: st.DataObject
                                                                 ) -> None:
    backend, layout, dtype = combo
    size = data.draw(st.sampled_from([1, 2, 5, 16, 70]))
    slots = data.draw(st.lists(st.integers(0, 79), min_size=size, max_size=size, unique=True))
    skipped = data.draw(st.lists(st.integers(0, size - 1), max_size=2))
    slots = [-1 if i in skipped else s for i, s in enumerate(slots)]
    input_dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    assert_write_layers_equals_single_writes(
        lambda: allocate(make_plan(backend, layout, kv_cache_dtype=dtype, num_blocks=20)), slots, input_dtype)


def test_write_layers_reads_back_per_layer_against_the_reference() -> None:
    cache = allocate(make_plan(layout="BHLNC", kv_cache_dtype="int4_per_token_head"))
    keys, values = make_layer_inputs(cache, 3)
    slots = torch.tensor([2, 11, 17])
    cache.write_layers(keys, values, slots)
    for layer in range(cache.plan.num_layers):
        got_k, got_v = cache.read(layer, slots, dtype=torch.float32)
        for got, part in ((got_k, keys[layer]), (got_v, values[layer])):
            for t in range(3):
                for h in range(2):
                    cell = encode_ref(part[t, h].float().tolist(), "int4_per_token_head", "uint8",
                                      in_dtype=name(part.dtype))
                    assert got[t, h].tolist() == decode_ref(cell, "int4_per_token_head", "uint8", 8)


def test_write_layers_on_mla_takes_latents_only() -> None:
    make = lambda: allocate(make_plan("FLASHMLA", "LBNHC", kv_cache_dtype="int8_per_token_head",  # noqa: E731
                                      head_size=16))
    assert_write_layers_equals_single_writes(make, [0, 5, -1, 9])
    cache = make()
    latents, _ = make_layer_inputs(cache, 2)
    with pytest.raises(InputError, match="one latent per token") as info:
        cache.write_layers(latents, latents, torch.tensor([0, 1]))
    assert info.value.diagnostics[0].file == "values"


def _bad_layer_writes(cache: KVCache) -> list[tuple[str, dict]]:
    keys, values = make_layer_inputs(cache, 3)
    return [
        ("keys", dict(keys=keys[:2])),  # a layer short
        ("keys", dict(keys=keys[0])),  # one layer's (T, H, D)
        ("keys", dict(keys=keys[:, :, :1])),
        ("keys", dict(keys=keys.to(torch.int8))),
        ("keys", dict(keys=keys.tolist())),
        ("values", dict(values=None)),
        ("values", dict(values=values[:, :2])),
        ("values", dict(values=values.float())),
        ("slot_mapping", dict(slot_mapping=torch.tensor([1, 2]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([1, 2, cache.num_slots]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([1, 2, 1]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([1.0, 2.0, 3.0]))),
    ]


@pytest.mark.parametrize("layout", ["BHLNC", "LBNHC"])
@pytest.mark.parametrize("dtype", ["auto", "int8_per_token_head", "fp8_e4m3"])
def test_rejected_write_layers_name_the_argument_and_change_no_byte(layout: str, dtype: str) -> None:
    cache = allocate(make_plan(layout=layout, kv_cache_dtype=dtype))
    fill_random(cache)
    before = snapshot(cache)
    keys, values = make_layer_inputs(cache, 3)
    for where, override in _bad_layer_writes(cache):
        args = dict(keys=keys, values=values, slot_mapping=torch.tensor([1, 2, 3])) | override
        with pytest.raises(InputError) as info:
            cache.write_layers(**args)
        assert info.value.diagnostics[0].file == where, (where, override, info.value)
        assert_unchanged(cache, before)


def test_write_layers_shape_errors_name_the_layers_dim() -> None:
    cache = allocate(make_plan(kv_cache_dtype="int8_per_token_head"))
    keys, values = make_layer_inputs(cache, 2)
    with pytest.raises(InputError, match=r"\(layers, tokens, heads, head_size\)"):
        cache.write_layers(keys[:1], values, torch.tensor([0, 1]))


def test_write_layers_all_skipped_or_empty_changes_nothing() -> None:
    cache = allocate(make_plan(kv_cache_dtype="fp8_per_token_head"))
    fill_random(cache)
    before = snapshot(cache)
    keys, values = make_layer_inputs(cache, 2)
    cache.write_layers(keys, values, torch.tensor([-1, -1]))
    keys, values = make_layer_inputs(cache, 0)
    cache.write_layers(keys, values, torch.tensor([], dtype=torch.int64))
    assert_unchanged(cache, before)


# ---- chunked encoding and reused scratch ----------------------------------------------------


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "fp8_e5m2",
                                   "auto"])
@pytest.mark.parametrize("chunk", [1, 40, 8 * 3 * 6 * 2])
def test_small_chunks_encode_the_same_bytes(dtype: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny `CHUNK_VALUES`: chunks of one token, of a few tokens with a remainder, of two whole layers."""
    monkeypatch.setattr(quantize, "CHUNK_VALUES", chunk)
    check_write_read(allocate(make_plan(layout="BLNHC", kv_cache_dtype=dtype)))
    assert_write_layers_equals_single_writes(
        lambda: allocate(make_plan(layout="LBHNC", kv_cache_dtype=dtype)), [3, -1, 8, 0, 12, 19])


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.sampled_from([1, 2, 7, 30, 70]), min_size=2, max_size=5),
       chunk=st.sampled_from([64, 300, 1 << 20]), dtype=st.sampled_from(["int8_per_token_head", "int4_per_token_head"]))
def test_writes_of_changing_sizes_reuse_scratch_exactly(sizes: list[int], chunk: int, dtype: str) -> None:
    """Scratch views and chunk plans are cached per shape; growing a buffer drops them (never stale)."""
    old = quantize.CHUNK_VALUES
    quantize.CHUNK_VALUES = chunk
    try:
        cache = allocate(make_plan(layout="LBNHC", kv_cache_dtype=dtype, num_blocks=20))
        gen = torch.Generator().manual_seed(len(sizes))
        for i, size in enumerate(sizes):
            slots = torch.randperm(80, generator=gen)[:size].tolist()
            if i % 2:
                check_write_read(cache, slots)
            else:
                keys, values = make_layer_inputs(cache, size, seed=i)
                cache.write_layers(keys, values, torch.tensor(slots))
                for layer in range(cache.plan.num_layers):
                    got_k, _ = cache.read(layer, torch.tensor(slots), dtype=torch.float32)
                    want = encode_ref(keys[layer, 0, 1].float().tolist(), dtype, "uint8", in_dtype=name(keys.dtype))
                    assert got_k[0, 1].tolist() == decode_ref(want, dtype, "uint8", 8)
    finally:
        quantize.CHUNK_VALUES = old


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "int4_per_token_head", "fp8_per_token_head"])
def test_a_large_write_needs_at_most_twice_its_input_in_scratch(dtype: str) -> None:
    """The issue's bound on a write's extra memory, at the benchmark's size (2048 tokens x 8 heads x 128, bf16).

    Peak extra memory of a write is the scratch it holds (chunk-sized, whatever
    the input size) plus index tensors of 8 bytes a cell.
    """
    plan = make_plan(layout="LBNHC", kv_cache_dtype=dtype, num_layers=1, num_kv_heads=8, head_size=128,
                     block_size=16, num_blocks=128)
    cache = allocate(plan)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(2048, 8, 128, generator=gen).to(torch.bfloat16)
    value = torch.randn(2048, 8, 128, generator=gen).to(torch.bfloat16)
    cache.write(0, key, value, torch.arange(2048))
    index_bytes = 2 * 2048 * 8 * 8
    extra = cache.scratch_bytes + index_bytes
    assert extra <= 2 * (key.nbytes + value.nbytes), extra / (key.nbytes + value.nbytes)


# ---- whole blocks: a prefill scatters a block's run of cells at a time ------------------------


def whole_block_slots(blocks: list[int], block_size: int = 4) -> list[int]:
    return [b * block_size + i for b in blocks for i in range(block_size)]


WHOLE = whole_block_slots([7, 0, 19, 3, 12, 5, 18, 1, 9, 14, 2, 16, 11, 6, 17, 4, 10, 13])  # 72 slots


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("dtype", ["int8_per_token_head", "int4_per_token_head", "fp8_per_token_head", "fp8_e5m2",
                                   "auto"])
def test_whole_block_prefills_take_the_block_path_and_stay_exact(layout: str, dtype: str) -> None:
    cache = allocate(make_plan(layout=layout, kv_cache_dtype=dtype, num_blocks=20))
    assert cache.cells.whole_blocks(torch.tensor(WHOLE)) is not None
    check_write_read(cache, WHOLE)
    assert_write_layers_equals_single_writes(
        lambda: allocate(make_plan(layout=layout, kv_cache_dtype=dtype, num_blocks=20)), WHOLE)


BLOCK_ODD = [*(g for g in ODD if "pad" in g), dict(head_size=5, kv_cache_dtype="fp8")]


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("geo", BLOCK_ODD, ids=str)
def test_whole_blocks_on_padded_pages_and_odd_cells(layout: str, geo: dict) -> None:
    cache = allocate(make_plan("TRITON_ATTN", layout, num_blocks=20, **geo))
    assert cache.cells.whole_blocks(torch.tensor(WHOLE)) is not None
    check_write_read(cache, WHOLE)


def test_whole_blocks_of_an_mla_latent_cache() -> None:
    cache = allocate(make_plan("FLASHMLA", "LBNHC", kv_cache_dtype="int8_per_token_head", head_size=16,
                               num_blocks=20))
    assert cache.cells.whole_blocks(torch.tensor(WHOLE)) is not None
    assert_write_layers_equals_single_writes(lambda: cache, WHOLE)
    latent, _, slots = make_inputs(cache, WHOLE)
    cache.write(1, latent, None, slots)
    got, _ = cache.read(1, slots, dtype=torch.float32)
    assert float((got - latent.float()).abs().max()) < 0.05


@pytest.mark.parametrize("name", ["partial last block", "starts mid-block", "tokens out of order", "head-major layout"])
def test_anything_but_whole_blocks_takes_the_cell_path_and_stays_exact(name: str) -> None:
    layout, slots = "LBNHC", list(WHOLE)
    if name == "partial last block":
        slots = slots[:-1]
    elif name == "starts mid-block":
        slots = [*slots[1:], 8 * 4]  # block 8 is not in WHOLE
    elif name == "tokens out of order":
        slots[5], slots[6] = slots[6], slots[5]
    else:
        layout = "LBHNC"
    cache = allocate(make_plan(layout=layout, kv_cache_dtype="int8_per_token_head", num_blocks=20))
    assert cache.cells.whole_blocks(torch.tensor(slots)) is None
    check_write_read(cache, slots)


def test_whole_blocks_with_skipped_tokens_and_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skipped tokens are dropped before the check; chunks of T start on block boundaries."""
    slots = list(WHOLE)
    slots[4:4] = [-1, -1]
    monkeypatch.setattr(quantize, "CHUNK_VALUES", 3 * 2 * 2 * 8)  # 3 tokens a chunk: rounded to one block
    cache = allocate(make_plan(layout="BLNHC", kv_cache_dtype="int4_per_token_head", num_blocks=20))
    check_write_read(cache, slots)
    assert_write_layers_equals_single_writes(
        lambda: allocate(make_plan(layout="LBNHC", kv_cache_dtype="fp8_per_token_head", num_blocks=20)), slots)


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "int4_per_token_head", "fp8", "auto"])
def test_threads_writing_different_layers_write_the_bytes_of_serial_writes(dtype: str) -> None:
    """The cache's scratch is shared: unguarded, one thread's encode overwrote another's cells before
    their scatter (every mode, bytes silently wrong). Writes from several threads are serialized."""
    import threading

    plan = make_plan(layout="LBNHC", kv_cache_dtype=dtype, num_blocks=16, num_layers=4, num_kv_heads=4,
                     head_size=64, block_size=16)
    serial, threaded = allocate(plan), allocate(plan)
    gen = torch.Generator().manual_seed(3)
    inputs = [(torch.randn(100, 4, 64, generator=gen).to(torch.bfloat16),
               torch.randn(100, 4, 64, generator=gen).to(torch.bfloat16),
               torch.randperm(256, generator=gen)[:100]) for _ in range(4)]
    for layer, (k, v, s) in enumerate(inputs):
        serial.write(layer, k, v, s)
    start = threading.Barrier(4)

    def run(layer: int) -> None:
        start.wait()
        for _ in range(10):
            threaded.write(layer, *inputs[layer])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(serial.raw, threaded.raw, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("dtype", "head_size"), [("int8_per_token_head", 6), ("fp8_per_token_head", 2),
                                                  ("int4_per_token_head", 6), ("int4_per_token_head", 12)])
def test_per_token_head_sizes_vllm_cannot_view_are_refused(dtype: str, head_size: int) -> None:
    """vLLM reads each inline scale through a float32 view (TRITON_ATTN asserts 4-byte offsets): head_size 6
    under int8, or 12 under int4, built a cache vLLM cannot use. Refused when the spec is made."""
    from kvpolicy.engine import LayoutEngine

    with pytest.raises(InputError, match=f"head_size {head_size} must be a multiple of"):
        LayoutEngine.default("vllm-0.34").build(
            num_blocks=2, spec=dict(num_layers=1, block_size=16, num_kv_heads=1, head_size=head_size),
            kv_cache_dtype=dtype, attention_backend="TRITON_ATTN")


@settings(max_examples=40, deadline=None)
@given(start=st.integers(0, 11), blocks=st.integers(17, 24), extra=st.sampled_from([0, 0, 1, 3]),
       layout=st.sampled_from(["LBNHC", "BLNHC"]), dtype=st.sampled_from(["int8_per_token_head", "auto"]))
def test_a_run_of_slots_lands_where_slot_by_slot_writes_put_it(start: int, blocks: int, extra: int, layout: str,
                                                               dtype: str) -> None:
    """Consecutive slots from any start, prefill-sized (past the 64-slot decode path): block-aligned
    runs of whole blocks take the block-wise scatter, unaligned ones (slot 2 onwards, spanning
    blocks) the cell path; either way every cell ends where one-token writes put it."""
    n = 4  # make_plan's block size
    slots = list(range(start, start + blocks * n + extra))
    plan = make_plan(layout=layout, kv_cache_dtype=dtype, num_blocks=30)
    bulk, single = allocate(plan), allocate(plan)
    fill_random(bulk)
    fill_random(single)
    key, value, slot_t = make_inputs(bulk, slots)
    bulk.write(LAYER, key, value, slot_t)
    for i, s in enumerate(slots):
        single.write(LAYER, key[i : i + 1], value[i : i + 1], torch.tensor([s]))
    for a, b in zip(bulk.raw, single.raw, strict=True):
        assert torch.equal(a, b), f"slots {start}..{slots[-1]}: the bulk write differs from slot-by-slot writes"


@settings(max_examples=60, deadline=None)
@given(head_size=st.integers(1, 160), mla=st.booleans(),
       dtype=st.sampled_from(["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]),
       slots=st.lists(st.integers(0, 19), min_size=1, max_size=6, unique=True))
def test_every_per_token_head_size_is_refused_when_made_or_reads_back_what_it_wrote(
        head_size: int, mla: bool, dtype: str, slots: list[int]) -> None:
    """Per-token-head, MLA latents included: a head size whose code bytes are not a multiple of 4
    (vLLM 0.34's ``_ensure_scale_caches`` asserts it; it has no MLA backend for these modes) is
    refused when the spec is made; every other size writes, then reads any one slot or several
    back as the reference decodes the reference's cells (a read of one slot raised a torch
    RuntimeError where the scale's offset was not a multiple of 4)."""
    packed = head_size // 2 if dtype == "int4_per_token_head" else head_size
    backend = "FLASHMLA" if mla else "TRITON_ATTN"
    if packed % 4 or (dtype == "int4_per_token_head" and head_size % 2):
        with pytest.raises(ValueError, match=f"head_size {head_size} must be"):  # the spec model's validation
            make_plan(backend, "LBNHC", head_size=head_size, kv_cache_dtype=dtype)
        if not mla:  # and through the public API, a located InputError
            from kvpolicy.engine import LayoutEngine

            with pytest.raises(InputError, match=f"head_size {head_size} must be"):
                LayoutEngine.default().build(num_blocks=2, kv_cache_dtype=dtype, backend="TRITON_ATTN",
                                             spec=dict(num_layers=1, block_size=4, num_kv_heads=1, head_size=head_size))
        return
    cache = allocate(make_plan(backend, "LBNHC", num_blocks=5, head_size=head_size, kv_cache_dtype=dtype))
    spec = cache.plan.spec
    key, value, slot_t = make_inputs(cache, slots)
    cache.write(LAYER, key, value, slot_t)
    parts = [key] if value is None else [key, value]
    for read in ([slots[-1]], slots):
        got = cache.read(LAYER, torch.tensor(read), dtype=torch.float32)
        for kv, part in enumerate(parts):
            for t, s in enumerate(read):
                for h in range(spec.num_kv_heads):
                    cell = encode_ref(part[slots.index(s), h].float().tolist(), dtype, "uint8", in_dtype="bfloat16")
                    want = decode_ref(cell, dtype, "uint8", head_size, out_dtype="float32")
                    assert got[kv][t, h].tolist() == want, (read, kv, t, h)


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"])
def test_nan_and_infinities_read_back_as_vllm_reads_them(dtype: str) -> None:
    """The edge semantics docs/quantized-cells.md documents, through a cache (the bytes are
    vLLM 0.34's, tests/conformance/test_cells.py): int8/fp8 store a NaN as the lowest code, so
    it reads back as a finite negative value of the head's magnitude, the rest intact; an infinity of
    either sign makes the scale infinite, so it reads -inf and every other value of its head NaN.
    int4 rotates first: a NaN reads the whole head as zeros, an infinity as NaN."""
    cache = allocate(make_plan(layout="LBNHC", kv_cache_dtype=dtype, num_blocks=5, head_size=8, num_kv_heads=1))
    base = [1.0, -2.0, 0.5, 3.0, -0.25, 0.0, 1.5, -1.0]
    edits = [{1: math.nan}, {1: math.inf}, {1: -math.inf}, {1: math.nan, 3: math.inf}]  # nan, +inf, -inf, both
    rows = [[at.get(i, v) for i, v in enumerate(base)] for at in edits]
    k = torch.tensor(rows).view(len(rows), 1, 8).to(torch.bfloat16)
    cache.write(0, k, k, torch.arange(len(rows)))
    got, _ = cache.read(0, torch.arange(len(rows)), torch.float32)
    got = got.view(len(rows), 8)
    nan, inf, others = got[0], got[1:3], [i for i in range(8) if i != 1]
    if dtype == "int4_per_token_head":
        assert (nan == 0).all() and (got[3] == 0).all()  # NaN anywhere wins over the infinity: scale 1e-6, codes 0
        assert inf.isnan().all()
        return
    scale = 3.0 / (127.0 if dtype == "int8_per_token_head" else 448.0)
    lowest = -128.0 if dtype == "int8_per_token_head" else -448.0
    assert float(nan[1]) == pytest.approx(lowest * scale, rel=1e-6)  # NaN -> the lowest code: finite, negative
    assert torch.allclose(nan[others], torch.tensor(base)[others], rtol=0.07, atol=scale)  # fp8: 3 mantissa bits
    for row, infinite in ((inf[0], [1]), (inf[1], [1]), (got[3], [1, 3])):
        finite = [i for i in range(8) if i not in infinite]
        assert (row[infinite] == -math.inf).all()  # +inf's sign is lost, and NaN's: the lowest code times inf
        assert row[finite].isnan().all()  # 0 * inf: every other value of the head is NaN
