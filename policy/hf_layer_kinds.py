"""Which cache each decoder layer keeps, as vLLM's model code builds it from the config.

One entry a layer: the caches that layer owns, empty for an MLP/MoE-only layer.
Most layers own one; a Falcon-H1 layer and a Zamba2 ``hybrid`` layer own an
attention cache and a Mamba state side by side (vLLM builds both modules in the
layer). The model type decides first where vLLM's model code reads its own fields:

- Mamba-only types (``mamba``, ``mamba2``, ``falcon_mamba``): a state a layer.
- ``falcon_h1``: attention and Mamba in every layer (``falcon_h1.py``).
- ``llama4_text``: ``no_rope_layers`` (``llama4.py``): a RoPE layer (1) is chunked-local
  when ``attention_chunk_size`` is set, a NoPE layer (0) full; the default puts a NoPE
  layer every ``no_rope_layer_interval`` (4).
- ``gpt_oss``: even layers slide, whatever ``layer_types`` says (``gpt_oss.py``).
- Qwen2/Qwen3 and their MoE: one global window or none (`_global_window`).

Otherwise the first source the config has decides, in this order:

1. ``layer_types`` (transformers' per-layer names, legacy ``mamba``/``attention``
   remapped as transformers does).
2. NemotronH's ``hybrid_override_pattern``: ``M`` Mamba, ``*`` attention,
   ``-``/``E`` no cache.
3. ``layers_block_type`` (Zamba2: ``hybrid`` is attention + Mamba; Jamba's written form).
4. Bamba's ``attn_layer_indices``: attention there, Mamba elsewhere (none: all Mamba).
5. Jamba's ``attn_layer_period``/``attn_layer_offset``: attention where
   ``i % period == offset``.
6. Qwen3-Next's ``full_attention_interval`` (default 4): every n-th layer full,
   the rest Gated DeltaNet (linear attention: a state, like Mamba). Releases differ:
   vLLM 0.24-0.31 load Qwen3-Next with their own config class, which ignores the
   interval and makes every 4th layer full; 0.32 on use transformers', which reads it.
7. LFM2's ``full_attn_idxs``: attention there, short convolution (a state) elsewhere.
8. Sliding windows of attention-only models (`_sliding`).

Worked example, Gemma-3-4B (``text_config`` with 34 layers, ``sliding_window``
1024, no ``sliding_window_pattern``): ``Gemma3TextConfig`` defaults the pattern
to 6, so layers 5, 11, 17, 23, 29 are full and the other 29 slide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum

from kvpolicy.policy.hf_reader import ConfigReader, is_int, show

__all__ = ["LayerCache", "LayerCaches", "layer_caches", "window_tokens"]


class LayerCache(str, Enum):
    """One cache a decoder layer keeps (vLLM's per-layer KV cache spec class)."""

    full = "full"  # FullAttentionSpec
    sliding_window = "sliding_window"  # SlidingWindowSpec
    chunked_local = "chunked_local"  # ChunkedLocalAttentionSpec
    mamba = "mamba"  # MambaSpec: Mamba, Mamba2, Gated DeltaNet, short convolution

    def __str__(self) -> str:
        return self.value


LayerCaches = list[tuple[LayerCache, ...]]

_F, _S, _C, _M = (LayerCache.full,), (LayerCache.sliding_window,), (LayerCache.chunked_local,), (LayerCache.mamba,)
_HYBRID = (LayerCache.full, LayerCache.mamba)

# transformers 5.22's layer type names (configuration_utils.ALLOWED_LAYER_TYPES), with its
# legacy remap (mamba -> linear_attention, attention -> full_attention) folded in
_LAYER_TYPES: dict[str, tuple[LayerCache, ...]] = {
    "full_attention": _F,
    "attention": _F,
    "sliding_attention": _S,
    "chunked_attention": _C,
    "linear_attention": _M,
    "mamba": _M,
    "mamba2": _M,
    "conv": _M,
    "hybrid": _HYBRID,
    "mlp": (),
    "moe": (),
}

_NEMOTRON_PATTERN: dict[str, tuple[LayerCache, ...]] = {"M": _M, "*": _F, "-": (), "E": ()}

MAMBA_ONLY = frozenset({"mamba", "mamba2", "falcon_mamba"})

# model types whose config class alternates sliding and full layers without saying so
_SLIDING_PATTERN = {"gemma2": 2, "gpt_oss": 2}
# vLLM models that pass no per-layer window: every layer gets CacheConfig's, which vLLM's EngineArgs
# sets only when transformers' `layer_types` are absent or all sliding (else no window at all)
_GLOBAL_WINDOW = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def _check_length(r: ConfigReader, key: str, items: list | str, num_layers: int) -> bool:
    if len(items) != num_layers:
        r.invalid(key, f"`{r.name(key)}` has {len(items)} entries but `{r.name('num_hidden_layers')}` "
                       f"is {num_layers}", "give one entry per hidden layer")
        return False
    return True


def _from_table(r: ConfigReader, key: str, num_layers: int, table: Mapping[str, tuple[LayerCache, ...]],
                *, chars: bool = False) -> LayerCaches | None:
    """Per-layer caches from a list of names (or a string of characters) looked up in ``table``."""
    items = r.get(key)
    if not (isinstance(items, str) if chars else isinstance(items, list)):
        want = "a string" if chars else "a list of strings"
        r.invalid(key, f"`{r.name(key)}` must be {want}, got `{show(items)}`")
        return None
    if not _check_length(r, key, items, num_layers):
        return None
    caches: LayerCaches = []
    for i, item in enumerate(items):
        if not isinstance(item, str) or item not in table:
            known = ", ".join(f"`{k}`" for k in table)
            r.invalid(key, f"`{r.name(key)}[{i}]` is `{show(item)}`, which is not a layer type kvpolicy models",
                      f"known values: {known}")
            return None
        caches.append(table[item])
    return caches


def _at_indices(r: ConfigReader, key: str, num_layers: int, there: tuple[LayerCache, ...],
                elsewhere: tuple[LayerCache, ...]) -> LayerCaches | None:
    indices = r.int_list(key, below=num_layers)
    if indices is None:
        return None
    return [there if i in indices else elsewhere for i in range(num_layers)]


def _jamba(r: ConfigReader, num_layers: int) -> LayerCaches | None:
    """Jamba: layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset``."""
    period = r.int_field("attn_layer_period", required=True)
    offset = r.int_field("attn_layer_offset", minimum=0)
    if period is None or (offset is None and r.has("attn_layer_offset")):
        return None
    offset = offset or 0
    if offset >= period:
        r.invalid("attn_layer_offset", f"`{r.name('attn_layer_offset')}` ({offset}) must be smaller than "
                                       f"`{r.name('attn_layer_period')}` ({period})")
        return None
    return [_F if i % period == offset else _M for i in range(num_layers)]


# the first release that loads Qwen3-Next through transformers' config class (0.24-0.31: vLLM's own)
_QWEN3_NEXT_READS_INTERVAL = (0, 32)


def _qwen3_next(r: ConfigReader, num_layers: int) -> LayerCaches | None:
    interval = r.int_field("full_attention_interval")
    if interval is None:
        return None
    if interval != 4 and r.model_type == "qwen3_next":
        if r.release is None:
            r.warn("release-dependent", f"`{r.name('full_attention_interval')}` ({interval}) is read by vLLM 0.32 "
                   "on; 0.24-0.31 ignore it (every 4th layer full): read as 0.32 on",
                   "pass vllm_version= (the CLI's --vllm-version) to read it as that release does")
        elif r.release < _QWEN3_NEXT_READS_INTERVAL:
            interval = 4
    return [_M if (i + 1) % interval else _F for i in range(num_layers)]


def _llama4(r: ConfigReader, num_layers: int) -> LayerCaches | None:
    """Llama-4: chunked-local attention on RoPE layers when ``attention_chunk_size`` is set."""
    rope = r.get("no_rope_layers")
    if not rope:  # absent or [] (transformers: falsy means the default)
        interval = r.int_field("no_rope_layer_interval") or 4
        rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    elif not isinstance(rope, list) or not all(is_int(v) and v in (0, 1) for v in rope):
        r.invalid("no_rope_layers", f"`{r.name('no_rope_layers')}` must be a list of 0 and 1, got `{show(rope)}`")
        return None
    elif not _check_length(r, "no_rope_layers", rope, num_layers):
        return None
    chunked = r.has("attention_chunk_size")
    return [_C if uses_rope and chunked else _F for uses_rope in rope]


def _sliding(r: ConfigReader, num_layers: int) -> LayerCaches | None:
    """Attention-only models without per-layer types: which layers use a sliding window.

    - no ``sliding_window`` (or ``0``, which vLLM reads as none): full everywhere.
    - ``use_sliding_window: false`` (Qwen2/2.5/3): full everywhere, whatever ``sliding_window`` says
      (transformers clears the window).
    - ``sliding_window_pattern`` p (Gemma-3 default 6, Cohere2 and EXAONE-4 default 4): every p-th
      layer full, the rest slide; Gemma-2 and gpt-oss alternate (p = 2) without saying so.
    - ``use_sliding_window: true`` with ``max_window_layers`` m: layers from m on slide (Qwen2 and
      Qwen3 themselves take `_global_window`).
    - otherwise a ``sliding_window`` (Mistral-7B v0.1) slides on every layer.
    """
    use = r.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        r.invalid("use_sliding_window", f"`{r.name('use_sliding_window')}` must be true or false, "
                                        f"got `{show(use)}`")
        return None
    if use is False or not r.get("sliding_window"):
        return [_F] * num_layers
    pattern = _SLIDING_PATTERN.get(r.model_type or "")
    if r.has("sliding_window_pattern"):
        pattern = r.int_field("sliding_window_pattern")
        if pattern is None:
            return None
    if pattern is not None:
        return [_S if (i + 1) % pattern else _F for i in range(num_layers)]
    if use is True and r.has("max_window_layers"):
        first = r.int_field("max_window_layers", minimum=0)
        if first is None:
            return None
        return [_S if i >= first else _F for i in range(num_layers)]
    return [_S] * num_layers


def _global_window(r: ConfigReader, num_layers: int) -> LayerCaches | None:
    """Qwen2/Qwen3 (and their MoE): one window for every layer, or none.

    transformers clears the window unless ``use_sliding_window``, and derives ``layer_types``
    (Qwen2, Qwen3: layers from ``max_window_layers`` slide; Qwen2-MoE: odd layers below it;
    Qwen3-MoE: none). vLLM's models pass no per-layer window, so every layer slides when those
    types are absent or all sliding, and none does otherwise (Qwen2 refuses that mix outright).
    """
    use = r.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        r.invalid("use_sliding_window", f"`{r.name('use_sliding_window')}` must be true or false, got `{show(use)}`")
        return None
    if not use or not r.get("sliding_window"):
        return [_F] * num_layers
    if r.has("layer_types"):
        caches = _from_table(r, "layer_types", num_layers, _LAYER_TYPES)
    elif r.model_type == "qwen3_moe":
        caches = None
    else:
        first = r.int_field("max_window_layers", minimum=0, required=True)
        if first is None:
            return None
        if r.model_type == "qwen2_moe":
            caches = [_S if i < first and (i + 1) % 2 else _F for i in range(num_layers)]
        else:
            caches = [_S if i >= first else _F for i in range(num_layers)]
    if r.diagnostics:
        return None
    if caches is None or all(c == _S for c in caches):
        return [_S] * num_layers
    if r.model_type == "qwen2":
        r.error("unsupported-model", f"`{r.name('max_window_layers')}` slides only some of the {num_layers} layers, "
                "which vLLM's qwen2 model refuses (one window for every layer)",
                "set `use_sliding_window` false, or `max_window_layers` to 0 or the layer count")
        return None
    r.warn("global-window", f"`{r.name('sliding_window')}` applies to some layers only, and vLLM's "
           f"{r.model_type} model takes one window for every layer or none: every layer full, as vLLM runs it",
           "set `use_sliding_window` false to say so")
    return [_F] * num_layers


def layer_caches(r: ConfigReader, num_layers: int) -> LayerCaches | None:
    """Each layer's caches from the first source the config has (see the module docstring)."""
    model_type = r.model_type or ""
    if model_type in MAMBA_ONLY:
        return [_M] * num_layers
    if model_type == "falcon_h1":
        return [_HYBRID] * num_layers
    if model_type == "llama4_text":  # llama4.py reads no_rope_layers, not layer_types
        return _llama4(r, num_layers)
    if model_type == "gpt_oss":  # gpt_oss.py slides even layers whatever `layer_types` says
        return _sliding(r, num_layers)
    if model_type in _GLOBAL_WINDOW:
        return _global_window(r, num_layers)
    sources: list[tuple[str, Callable[[], LayerCaches | None]]] = [
        ("layer_types", lambda: _from_table(r, "layer_types", num_layers, _LAYER_TYPES)),
        ("hybrid_override_pattern",
         lambda: _from_table(r, "hybrid_override_pattern", num_layers, _NEMOTRON_PATTERN, chars=True)),
        ("layers_block_type", lambda: _from_table(r, "layers_block_type", num_layers, _LAYER_TYPES)),
        ("attn_layer_indices", lambda: _at_indices(r, "attn_layer_indices", num_layers, _F, _M)),
        ("attn_layer_period", lambda: _jamba(r, num_layers)),
        ("attn_layer_offset", lambda: _jamba(r, num_layers)),
        ("full_attention_interval", lambda: _qwen3_next(r, num_layers)),
        ("full_attn_idxs", lambda: _at_indices(r, "full_attn_idxs", num_layers, _F, _M)),
    ]
    for key, read in sources:
        if r.has(key):
            return _checked(r, key, read())
    if model_type == "bamba":  # attn_layer_indices null: transformers makes every layer Mamba
        return [_M] * num_layers
    return _sliding(r, num_layers)


# vLLM's Cohere2 models (commandr.py, cohere2_moe.py) give a sliding layer `sliding_window + 1` tokens
# from 0.29 on ("[pos - sliding_window, pos]", the training convention); 0.24-0.28 give `sliding_window`
_WINDOW_PLUS_ONE = frozenset({"cohere2", "cohere2_moe"})
_WINDOW_PLUS_ONE_FROM = (0, 29)


def window_tokens(r: ConfigReader, window: int) -> int:
    """The window vLLM's sliding layers keep for ``sliding_window`` tokens of config (see above)."""
    if r.model_type not in _WINDOW_PLUS_ONE:
        return window
    if r.release is None:
        r.warn("release-dependent", f"`{r.name('sliding_window')}` ({window}): vLLM 0.29 on keep {window + 1} "
               f"tokens for {r.model_type}, 0.24-0.28 keep {window}; read as 0.29 on",
               "pass vllm_version= (the CLI's --vllm-version) to read it as that release does")
        return window + 1
    return window + 1 if r.release >= _WINDOW_PLUS_ONE_FROM else window


def _checked(r: ConfigReader, key: str, caches: LayerCaches | None) -> LayerCaches | None:
    if caches is not None and not any(caches):
        r.invalid(key, f"`{r.name(key)}` gives no layer a KV cache or a Mamba state",
                  "a model needs at least one attention or Mamba layer")
        return None
    return caches
