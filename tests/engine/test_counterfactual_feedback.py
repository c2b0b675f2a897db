"""A counterfactual proposes only inputs the tool accepts, and fed back, each decides as it says.

"BLNHC would be chosen if backend.name were FLASH_ATTN" for an MLA model is advice the operator cannot
follow (`--attention-backend FLASH_ATTN` is `error[backend-mismatch]`); and a backend also changes the
candidates it declares, which the rules' view of `backend.name` alone does not. For many deployments, each
proposed change of a setting is given back as that setting and the decision must be the proposed layout.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.counterfactual import ALL_SCOPES
from kvpolicy.policy.context import MISSING
from kvpolicy.policy.errors import PolicyError

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
# the rule fields that are a setting of their own, and the input that sets each
SETTING = {"backend.name": "attention_backend", "env.VLLM_KV_CACHE_LAYOUT": "vllm_kv_cache_layout",
           "cache.enable_extensible_kv_cache": "enable_extensible_kv_cache", "attention.hisparse": "hisparse",
           "worker.use_v2_model_runner": "use_v2_model_runner"}


@cache
def engine(version: str) -> LayoutEngine:
    return LayoutEngine.default(version)


deployments = st.fixed_dictionaries({
    "vllm_version": st.sampled_from(["0.24.0", "0.26.0", "0.28.0", "0.29.0", "0.33.0", "0.34.0", "issue-48412"]),
    "model": st.sampled_from([str(CONFIGS / n) for n in ("deepseek-v2-lite.json", "llama-3.1-8b.json",
                                                         "qwen2.5-0.5b.json", "gpt-oss-20b.json")]),
    "kv_cache_dtype": st.sampled_from([None, "auto", "fp8", "fp8_per_token_head"]),
    "connector": st.sampled_from([None, "NixlConnector", "OffloadingConnector", "LMCacheConnectorV1"]),
    "attention_backend": st.sampled_from([None, None, "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLASHMLA",
                                          "TRITON_MLA"]),
    "vllm_kv_cache_layout": st.sampled_from([None, None, "NHD", "HND"]),
})


def _given_back(inputs: dict[str, Any], changes: Any) -> dict[str, Any] | None:
    """``inputs`` with each change given as the setting it is; None when a change is no setting of its own."""
    out = dict(inputs)
    for change in changes:
        if change.field in SETTING:
            out[SETTING[change.field]] = None if change.becomes is MISSING else change.becomes
        elif change.field.startswith("connector.extra.") and change.scope in (ALL_SCOPES,
                                                                               f"connector:{inputs.get('connector')}"):
            config = dict(out.get("connector_config") or {})
            key = change.field.removeprefix("connector.extra.")
            if change.becomes is MISSING:
                config.pop(key, None)
            else:
                config[key] = change.becomes
            out["connector_config"] = config
        else:
            return None
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dep=deployments)
def test_each_proposed_setting_fed_back_decides_as_said(dep: dict[str, Any]) -> None:
    inputs = {k: v for k, v in dep.items() if v is not None}
    try:
        decision = engine(dep["vllm_version"]).decide(**inputs)
    except PolicyError:
        return  # refused as given: nothing to advise
    for cf in decision.counterfactuals:
        if cf.changes is None or not cf.actionable:
            continue
        again = _given_back(inputs, cf.changes)
        if again is None:
            continue
        said = ", ".join(f"{c.field}={c.becomes}" for c in cf.changes)
        try:
            layout = engine(dep["vllm_version"]).decide(**again).layout
        except PolicyError as exc:
            raise AssertionError(f"{inputs}: proposed {said} for {cf.layout}, which the tool refuses: "
                                 f"{exc.diagnostics[0].message if exc.diagnostics else exc}") from None
        assert layout == cf.layout, f"{inputs}: proposed {said} for {cf.layout}, fed back it decides {layout}"


def test_an_mla_model_on_0_28_is_not_told_to_use_a_non_mla_backend() -> None:
    decision = engine("0.28.0").decide(model=str(CONFIGS / "deepseek-v2-lite.json"), connector="NixlConnector")
    proposed = {c.becomes for cf in decision.counterfactuals for c in cf.changes or () if c.field == "backend.name"}
    assert not proposed & {"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION"}
