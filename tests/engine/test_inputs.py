"""Every mistake in decide()/build() keyword inputs is a located InputError, never a bare Python error."""

from __future__ import annotations

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.inputs import build_context
from kvpolicy.policy import InputError, PolicyError

ENGINE = LayoutEngine.default()
SPEC = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


@pytest.mark.parametrize(("inputs", "where", "message"), [
    ({"spc": SPEC}, "spc", "unknown input `spc`"),
    ({"spec": SPEC, "groups": [1]}, "groups", "`groups` must be a KVCacheGroups, got list"),
    ({"spec": SPEC, "tensor_parallel_size": 2}, "tensor_parallel_size", "applies to `model` only"),
    ({"context": {}}, "context", "`context` must be a Context, got dict"),
    ({"spec": {**SPEC, "block_size": True}}, "spec.block_size", "got boolean `true`"),
    ({"spec": SPEC, "block_size": "16"}, "spec.block_size", "got string `16`"),
    ({"spec": {**SPEC, "head_sise": 1}}, "spec.head_sise", "unknown field `spec.head_sise`"),
    ({"spec": [1]}, "spec", "`spec` must be a KVCacheSpec or a mapping, got list"),
    ({"spec": SPEC, "connector": 3}, "connector", "`connector` must be a name, got int"),
    ({"spec": SPEC, "kv_cache_dtype": "fp9"}, "kv_cache_dtype", "has no kv_cache_dtype `fp9`"),
    ({"spec": SPEC, "backend": "TRITON"}, "attention_backend", "unknown attention backend `TRITON`"),
    ({"spec": {**SPEC, "kind": "mla", "num_kv_heads": 1}, "backend": "TRITON_ATTN"}, "backend",
     "does not fit a `mla` KV spec"),
])
def test_decide_input_mistakes(inputs: dict, where: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        ENGINE.decide(**inputs)
    d = next(d for d in info.value.diagnostics if d.file == where)
    assert message in d.message, d.render()


def test_context_and_keywords_together_is_an_error() -> None:
    ctx = ENGINE.context(spec=SPEC)
    with pytest.raises(InputError, match="give a `context` or keyword inputs, not both"):
        ENGINE.decide(ctx, connector="OffloadingConnector")


def test_build_reports_an_impossible_allocation() -> None:
    with pytest.raises(InputError) as info:
        ENGINE.build(num_blocks=10**15, spec=SPEC)
    [d] = info.value.diagnostics
    assert (d.file, d.code) == ("num_blocks", "out-of-memory")
    assert "cannot allocate" in d.message


@pytest.mark.parametrize("num_blocks", [0, -1, True, 2.5])
def test_build_and_plan_refuse_bad_block_counts(num_blocks: object) -> None:
    with pytest.raises(PolicyError):
        ENGINE.plan(num_blocks=num_blocks, spec=SPEC)


@pytest.mark.parametrize(("dtype", "code", "says"), [
    ("ultraquant_4bit", "unmodelled-kv-cache-dtype",
     "vLLM 0.34.0 accepts kv_cache_dtype `ultraquant_4bit`, but kvpolicy does not model"),
    ("turboquant_k8v4", "unmodelled-kv-cache-dtype", "can neither decide nor plan"),
    ("fp8_per_tokn_head", "unknown-kv-cache-dtype", "did you mean `fp8_per_token_head`?"),
])
def test_kv_cache_dtype_the_release_accepts_but_kvpolicy_does_not_model(dtype: str, code: str, says: str) -> None:
    for where in ({"kv_cache_dtype": dtype}, {"spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 64,
                                                       "kv_cache_dtype": dtype}}):
        kw = {"spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, **where}
        with pytest.raises(InputError) as exc:
            build_context(vllm_version="vllm-0.34", attention_backend="FLASHINFER", **kw)
        (diag,) = exc.value.diagnostics
        assert diag.code == code and diag.file == "kv_cache_dtype"
        assert says in diag.message + " " + (diag.help or "")


def test_dtype_is_vllms_dtype_for_a_model() -> None:
    """``dtype=`` (vLLM's --dtype) reaches the model's KV dtype; a spec states its own."""
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[1] / "e2e" / "tiny-llama"
    assert build_context(model=tiny, vllm_version="0.34.0").kv.dtype.value == "bfloat16"
    assert build_context(model=tiny, dtype="half", vllm_version="0.34.0").kv.dtype.value == "float16"
    assert build_context(model=tiny, dtype="auto", vllm_version="0.34.0").kv.dtype.value == "bfloat16"
    with pytest.raises(InputError, match="`dtype` applies to `model` only"):
        build_context(spec={"num_layers": 2, "num_kv_heads": 2, "head_size": 64}, dtype="float16")
