"""The inputs vLLM 0.34's layout resolution reads, as decide() keywords, dry-run flags and policy-test fields.

The conformance suite (tests/conformance/test_v034_decisions.py) holds the decisions to
vLLM's own; these tests pin the input handling without vLLM: validation, derivation,
the explanation, and that every input is spelt the same in all three places.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.cli.main import main
from kvpolicy.engine.inputs import INPUT_NAMES
from kvpolicy.engine.policy_tests import CaseInput
from kvpolicy.policy import InputError, NoLayoutError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.spec import AttentionKind, KVCacheGroup, KVCacheGroups, KVCacheSpec

PROFILE = "vllm-0.34"
ENGINE = LayoutEngine.default(vllm_version=PROFILE)
SPEC = {"num_layers": 4, "block_size": 16, "num_kv_heads": 8, "head_size": 128}
MLA = {"kind": "mla", "num_layers": 4, "block_size": 16, "num_kv_heads": 1, "head_size": 576}
HISPARSE = {"kv_connector": "HiSparseConnector", "kv_connector_extra_config": {"host_pool_gib": 8}}


def decide(**kw: Any) -> Any:
    return ENGINE.decide(vllm_version=PROFILE, **{"spec": SPEC, **kw})


def group(heads: int = 8, head: int = 128, block: int = 16, kind: str = "full", dcp: bool = True) -> KVCacheGroup:
    spec = KVCacheSpec(kind=AttentionKind(kind), num_layers=2, block_size=block, num_kv_heads=heads, head_size=head)
    return KVCacheGroup(spec=spec, dcp_sharded=dcp)


# --- workers ------------------------------------------------------------------------------------


def test_workers_merge_like_vllm() -> None:
    ctx = ENGINE.context(spec=SPEC, worker_attention_backends=[["FLASHINFER"], ["CPU_ATTN"]], device_capability=10)
    assert ctx.candidates == (Layout.LBHNC,)
    assert ctx.backend.name == "FLASHINFER"  # the first worker's first backend is planned
    assert ctx.worker_backends == (("FLASHINFER",), ("CPU_ATTN",))
    # a worker whose backends declare nothing does not vote
    ctx = ENGINE.context(spec=SPEC, worker_attention_backends=[["FLASH_ATTN"], ["FLASHINFER"]], device_capability=10)
    assert ctx.candidates == (Layout.LBHNC, Layout.BLHNC)
    assert ctx.backend.name == "FLASH_ATTN"
    # a pipeline stage without attention reports the default preference, and does not vote either
    ctx = ENGINE.context(spec=SPEC, worker_attention_backends=[["flashinfer"], []], device_capability=9)
    assert ctx.candidates == (Layout.LBNHC, Layout.LBHNC, Layout.BLNHC, Layout.BLHNC, Layout.BHLNC)


def test_workers_without_a_common_layout_name_the_release_filter() -> None:
    with pytest.raises(NoLayoutError) as info:
        decide(worker_attention_backends=[["FLEX_ATTENTION"], ["CPU_ATTN"]])
    assert "release-candidates" in info.value.render()


def test_workers_show_in_the_explanation() -> None:
    text = decide(worker_attention_backends=[["FLASHINFER"], ["FLASH_ATTN", "TRITON_ATTN"]],
                  device_capability=10).explain()
    assert "  workers:   [FLASHINFER]; [FLASH_ATTN, TRITON_ATTN] (candidates: LBHNC, BLHNC)" in text


@pytest.mark.parametrize(("inputs", "where", "message"), [
    ({"worker_attention_backends": "FLASHINFER"}, "worker_attention_backends", "must be a non-empty list"),
    ({"worker_attention_backends": []}, "worker_attention_backends", "must be a non-empty list"),
    ({"worker_attention_backends": ["FLASHINFER"]}, "worker_attention_backends[0]", "must be a list of backend"),
    ({"worker_attention_backends": [["FLASHINFER"], [3]]}, "worker_attention_backends[1]", "must be a string"),
    ({"worker_attention_backends": [["FLASHINFR"]]}, "worker_attention_backends[0]", "unknown attention backend"),
    ({"worker_attention_backends": [[]]}, "worker_attention_backends", "no worker names an attention backend"),
    ({"worker_attention_backends": [["FLASHINFER"]], "attention_backend": "CPU_ATTN"}, "attention_backend",
     "is on no worker"),
    ({"worker_attention_backends": [["FLASH_ATTN"], ["FLASHMLA"]]}, "worker_attention_backends[1]",
     "does not fit a `full` KV spec"),
    ({"spec": MLA, "worker_attention_backends": [["FLASHMLA", "TRITON_ATTN"]]}, "worker_attention_backends[0]",
     "does not fit a `mla` KV spec"),
    ({"kv_cache_dtype": "fp8_per_token_head", "attention_backend": "FLASH_ATTN"}, "kv_cache_dtype",
     "does not support kv_cache_dtype `fp8_per_token_head`"),
    ({"kv_cache_dtype": "fp8", "worker_attention_backends": [["TRITON_ATTN"], ["FLEX_ATTENTION"]]},
     "kv_cache_dtype", "`FLEX_ATTENTION` does not support kv_cache_dtype `fp8`"),
    ({"hisparse": True, "connector": "OffloadingConnector"}, "hisparse", "refuses a HiSparse config without"),
    ({"hisparse": True}, "hisparse", "refuses a HiSparse config without"),
])
def test_input_mistakes(inputs: dict, where: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        decide(**inputs)
    d = next(d for d in info.value.diagnostics if d.file == where)
    assert message in d.message, d.render()


# --- HiSparse, connectors, VLLM_KV_CACHE_LAYOUT -------------------------------------------------


def test_a_hisparse_connector_member_turns_hisparse_on() -> None:
    multi = {"connectors": [HISPARSE, {"kv_connector": "OffloadingConnector"}]}
    d = decide(connector="MultiConnector", connector_config=multi)
    assert d.context.options.hisparse is True
    assert d.layout is Layout.BLHNC
    assert decide(connector="MultiConnector", connector_config=multi, hisparse=True).layout is Layout.BLHNC
    assert decide(connector="OffloadingConnector").context.options.hisparse is False


def test_members_that_disagree_are_only_asked_without_vllm_kv_cache_layout() -> None:
    multi = {"connectors": [HISPARSE, {"kv_connector": "NixlConnector"}]}
    with pytest.raises(NoLayoutError, match="members-agree"):
        decide(connector="MultiConnector", connector_config=multi)
    assert decide(connector="MultiConnector", connector_config=multi, vllm_kv_cache_layout="LBHNC").layout \
        is Layout.LBHNC


def test_nixl_refuses_an_unknown_transfer_mode() -> None:
    assert decide(connector="NixlConnector", connector_config={"transfer_mode": "push"}).layout is Layout.LBHNC
    with pytest.raises(NoLayoutError, match="nixl-transfer-mode-is-pull-or-push"):
        decide(connector="NixlConnector", connector_config={"transfer_mode": "pipelined"})


def test_a_dropped_connector_preference_is_a_warning() -> None:
    d = decide(attention_backend="FLEX_ATTENTION", connector="OffloadingConnector")
    assert d.layout is Layout.LBNHC
    assert d.warnings == ("offloading-requires-lbhnc (connector:OffloadingConnector) prefers LBHNC, which was "
                          "removed by release-candidates; the preference is dropped and LBNHC is used instead",)
    assert "warnings:\n  offloading-requires-lbhnc" in d.explain()
    assert d.to_dict()["warnings"] == list(d.warnings)
    assert decide(connector="OffloadingConnector").warnings == ()
    # with VLLM_KV_CACHE_LAYOUT vLLM never asks the connector: nothing to drop
    assert decide(connector="OffloadingConnector", vllm_kv_cache_layout="NHD").warnings == ()


# --- the specs ----------------------------------------------------------------------------------


def test_hnc_shapes_count_mamba_states() -> None:
    assert not KVCacheGroups(groups=(group(), group())).mixed_hnc_shapes
    assert KVCacheGroups(groups=(group(), group(heads=4))).mixed_hnc_shapes
    assert KVCacheGroups(groups=(group(8, 128, 16), group(4, 128, 32))).mixed_hnc_shapes  # same page, other shape
    mamba = group(heads=1, head=256, kind="mamba")
    assert KVCacheGroups(groups=(group(), mamba)).mixed_hnc_shapes


def test_dcp_page_sizes_count_mamba_states_but_not_their_sharding() -> None:
    assert KVCacheGroups(groups=(group(), group(head=64, dcp=False))).dcp_mixed_page_sizes
    assert not KVCacheGroups(groups=(group(), group(dcp=False))).dcp_mixed_page_sizes
    mamba = group(heads=1, head=256, kind="mamba")
    assert KVCacheGroups(groups=(group(), group(dcp=False), mamba)).dcp_mixed_page_sizes
    assert not KVCacheGroups(groups=(group(), mamba, group(heads=1, head=256, kind="mamba", dcp=False))
                             ).dcp_mixed_page_sizes


# --- one input, three spellings -----------------------------------------------------------------


def _dry_run_dests() -> dict[str, str]:
    from kvpolicy.engine.cli import dry_run

    parser = argparse.ArgumentParser()
    dry_run.register(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["dry-run"]
    return {opt: a.dest for a in sub._actions for opt in a.option_strings}


def test_every_decide_input_is_a_dry_run_flag_and_a_case_field() -> None:
    flags = _dry_run_dests()
    for name in INPUT_NAMES:
        assert name in CaseInput.model_fields, name
        if name == "groups":
            continue  # a --spec file holds `groups:`
        assert "--" + name.replace("_", "-") in flags, name


def test_case_inputs_reach_the_decision(tmp_path: Any) -> None:
    inp = CaseInput.model_validate({"groups": [{"spec": SPEC}, {"spec": {**SPEC, "head_size": 64},
                                                                "dcp_sharded": False}],
                                    "worker_attention_backends": [["FLASHINFER"]], "device_capability": "10.0",
                                    "vllm_kv_cache_layout": "BLHNC", "enable_extensible_kv_cache": True,
                                    "vllm_version": PROFILE, "connector": "NixlConnector"})
    from kvpolicy.engine.policy_tests.cases import context_for

    ctx = context_for(inp)
    assert inp.device_capability == 10
    assert ctx.options.device_capability == 10 and ctx.options.kv_cache_layout == "BLHNC"
    assert ctx.options.enable_extensible_kv_cache and ctx.profile == PROFILE
    assert [g.dcp_sharded for g in ctx.groups.groups] == [True, False] and ctx.groups.dcp_mixed_page_sizes
    assert ENGINE.decide(ctx).layout is Layout.BLHNC


def test_dry_run_worker_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["dry-run", "--vllm-version", "0.34.0", "--kv-cache-dtype", "auto", "--device-capability", "10.0",
                 "--worker-attention-backends", "FLASHINFER", "--worker-attention-backends", "FLASH_ATTN,TRITON_ATTN",
                 "--explain", "notes"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[2] == "layout: LBHNC (per_layer, HND)"
    assert "  workers:   [FLASHINFER]; [FLASH_ATTN, TRITON_ATTN] (candidates: LBHNC, BLHNC)" in out
    code = main(["dry-run", "--vllm-version", "0.34.0", "--worker-attention-backends", "FLASH_ATTN,",
                 "--kv-cache-dtype", "auto"])
    assert code == 2
    code = main(["dry-run", "--vllm-version", "0.34.0", "--worker-attention-backends", "FLASHMLA"])
    out, err = capsys.readouterr()
    assert code == 2 and "--worker-attention-backends" in err, err


def test_shipped_034_policy_tests_pass_with_full_coverage(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["test", "--vllm-version", PROFILE, "--require-coverage"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "0 failed" in out and "coverage: 17/17 rules matched by some case" in out
