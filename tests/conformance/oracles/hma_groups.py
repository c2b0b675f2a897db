"""Oracle: the KV cache specs and groups vLLM builds when it turns its hybrid KV cache manager off by itself.

The model-config path of ``model_config.py`` (the release's engine arguments, ``create_engine_config``,
the model class on the meta device, ``get_kv_cache_spec``, the engine core's grouping), with a
deployment that may turn the hybrid manager off:

    {"config": {...config.json...}, "kv_transfer_config": {"kv_connector": ..., "kv_role": "kv_both", ...},
     "allow_chunked_local": true, "block_size": 16, "disable_hybrid_kv_cache_manager": null}

``kv_transfer_config`` goes to the engine arguments as ``--kv-transfer-config`` (the release's own
``KVTransferConfig``); ``allow_chunked_local`` false sets ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``
for the case (unset otherwise: vLLM's default 1); ``disable_hybrid_kv_cache_manager`` true/false is the
engine argument of that name (``--disable-hybrid-kv-cache-manager`` / ``--enable-...``), null leaves it
unset. ``VllmConfig.__post_init__`` decides
``scheduler_config.disable_hybrid_kv_cache_manager``; the grouping (``get_kv_cache_groups`` /
``get_global_kv_cache_groups``) unifies the specs when it is on. Answer: model_config.py's answer plus
``"hybrid_manager_disabled"``, read off the VllmConfig the grouping is given. Runs under 0.28 on.

STAND-INs: those of model_config.py; and connector modules' missing third-party packages are not
stubbed: ``supports_hma_config`` imports the connector's module, so a case names connectors whose
modules import with the release site alone.
"""

from __future__ import annotations

import os

import model_config  # first: it routes everything printed to fd 1 to stderr (its _ANSWER is stdout)
from _common import answer_cases

_VARIABLE = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
_SEEN: dict[str, object] = {}
_serve_engine_args = model_config.serve_engine_args
_group_layers = model_config.group_layers


def _engine_args(case: dict):
    """model_config's engine arguments plus ``--kv-transfer-config`` (the release's KVTransferConfig)."""
    args = _serve_engine_args(case)
    if case.get("kv_transfer_config") is not None:
        from vllm.config import KVTransferConfig

        args.kv_transfer_config = KVTransferConfig(**case["kv_transfer_config"])
    if case.get("disable_hybrid_kv_cache_manager") is not None:  # --disable- (true) / --enable- (false)
        args.disable_hybrid_kv_cache_manager = case["disable_hybrid_kv_cache_manager"]
    return args


def _groups(vllm_config, specs):
    _SEEN["hybrid_manager_disabled"] = bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
    return _group_layers(vllm_config, specs)


model_config.serve_engine_args = _engine_args
model_config.group_layers = _groups


def handle(case: dict) -> dict:
    _SEEN.clear()
    if case.get("allow_chunked_local", True):
        os.environ.pop(_VARIABLE, None)
    else:
        os.environ[_VARIABLE] = "0"
    result = model_config.handle(case)
    result["hybrid_manager_disabled"] = _SEEN.get("hybrid_manager_disabled")
    return result


if __name__ == "__main__":
    answer_cases(handle, model_config._ANSWER)
