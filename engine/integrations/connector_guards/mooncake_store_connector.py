"""MooncakeStoreConnector's keys, kept per layout fingerprint.

MooncakeStoreConnector (vLLM 0.24 on, ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/``)
puts each block's raw bytes in a Mooncake store shared by engines, under
``[cache_prefix@]<model>[store_namespace]@tp_rank:..@pcp..@dcp..@pp_rank:..@group:..@<chunk hash>``:
no layout, dtype or backend in it. Its worker reads ``kv_connector_extra_config["cache_prefix"]``
once, while vLLM constructs the connector (in ``MooncakeStoreWorker.__init__`` up to 0.33; through
``_resolve_cache_prefix``, which turns ``"auto"`` into a build-and-model hash, in 0.34), and every
key it makes starts with it.

The guard makes that prefix ``kvpolicy-<20 hex of this engine's fingerprint digest>``, followed by
``-<the operator's prefix>`` when there is one, so engines of different layouts never read each
other's keys (nor keys an engine without kvpolicy wrote: ``KVPOLICY_UNSTAMPED_BLOCKS=accept`` cannot
apply). The prefix must be set before the connector is built: `before_create` (the factory hook's
"before create" step) edits the extra config (for ``"auto"`` on 0.34, it wraps
``_resolve_cache_prefix`` instead, so the derived prefix follows the namespace). `guard` then checks
the worker's key metadata carries the namespace and refuses the connector otherwise (an operator
without the hook can set the prefix by hand: the message gives it). The scheduler makes no keys.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from typing import Any

from kvpolicy.engine.exchange import block_digest
from kvpolicy.engine.integrations.connector_guards.patching import Patches, WarnOnce
from kvpolicy.engine.integrations.vllm_exchange import ENV_UNSTAMPED, NAMESPACE_PREFIX, Stamp
from kvpolicy.policy.errors import input_error

__all__ = ["MARK", "MooncakeStoreGuard", "before_create", "carries", "guard", "namespace", "stamped_prefix",
           "unguard"]

log = logging.getLogger("vllm.kvpolicy")

STORE_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
PREFIX_KEY = "cache_prefix"
MARK = "kvpolicy_cache_prefix"  # extra-config key: the namespace a wrapped ``_resolve_cache_prefix`` prepends
_HEX = 20
_WHERE = "kv_transfer_config.kv_connector_extra_config.cache_prefix"

_lock = threading.RLock()
_patches = Patches()
_warned = _warn_once = WarnOnce(log)


def unguard() -> None:
    """Put back vLLM's ``_resolve_cache_prefix`` where it was wrapped."""
    with _lock:
        _patches.undo()


def namespace(stamp: Stamp) -> str:
    """``kvpolicy-`` and the first 20 hex digits of ``stamp``'s `block_digest` (what a block's bytes mean:
    engines whose blocks are the same bytes, e.g. vLLM 0.28's per-layer buffers and 0.34's one buffer, share)."""
    return NAMESPACE_PREFIX + block_digest(stamp.fingerprint).removeprefix("sha256:")[:_HEX]


def carries(prefix: str, tag: str) -> bool:
    """Whether a cache prefix starts with the namespace ``tag`` (alone, or followed by ``-``)."""
    return prefix == tag or prefix.startswith(tag + "-")


def stamped_prefix(prefix: str, tag: str) -> str:
    """``prefix`` with the namespace ``tag`` in front (unchanged if it has it already)."""
    if carries(prefix, tag):
        return prefix
    return f"{tag}-{prefix}" if prefix else tag


def _configured(extra: dict[str, Any]) -> str:
    """The prefix as vLLM reads it: ``str(extra.get("cache_prefix", ""))``."""
    return str(extra.get(PREFIX_KEY, ""))


def _resolver() -> tuple[Any, Any] | None:
    """(the store worker module, its ``_resolve_cache_prefix``) where this vLLM derives ``"auto"``."""
    try:
        module = importlib.import_module(STORE_WORKER)
    except ImportError:
        return None
    function = getattr(module, "_resolve_cache_prefix", None)
    return (module, function) if callable(function) else None


def _install_resolver(module: Any, function: Any) -> None:
    with _lock:
        if getattr(function, "__kvpolicy__", False):
            return

        @functools.wraps(function)
        def _resolve_cache_prefix(vllm_config: Any) -> str:
            prefix = function(vllm_config)
            extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None)
            tag = extra.get(MARK) if isinstance(extra, dict) else None
            return stamped_prefix(prefix, tag) if isinstance(tag, str) and tag else prefix

        _resolve_cache_prefix.__kvpolicy__ = True  # type: ignore[attr-defined]
        _patches.record(module, "_resolve_cache_prefix", function)
        module._resolve_cache_prefix = _resolve_cache_prefix


def before_create(extra_config: dict[str, Any], stamp: Stamp, unstamped: str = "miss") -> None:
    """Before vLLM constructs a MooncakeStoreConnector from ``extra_config`` (its
    ``kv_connector_extra_config``, or a MultiConnector member's): its keys will carry the namespace."""
    tag = namespace(stamp)
    prefix = _configured(extra_config)
    resolver = _resolver() if prefix == "auto" else None
    if resolver is not None:  # 0.34: vLLM derives the prefix; the wrapper puts the namespace in front of it
        extra_config[MARK] = tag
        _install_resolver(*resolver)
    else:
        extra_config[PREFIX_KEY] = stamped_prefix(prefix, tag)


def _key_prefixes(worker: Any) -> list[str]:
    """The cache prefixes of the key metadata the worker made its keys from (every release keeps one
    per KV cache group in ``token_dbs``; up to 0.28 also ``metadata``)."""
    found = []
    holders = [getattr(worker, "metadata", None)]
    dbs = getattr(worker, "token_dbs", None)
    if isinstance(dbs, (list, tuple)):
        holders += [getattr(db, "metadata", None) for db in dbs]
    for meta in holders:
        prefix = getattr(meta, PREFIX_KEY, None)
        if isinstance(prefix, str):
            found.append(prefix)
    return found


class MooncakeStoreGuard:
    """One MooncakeStoreConnector object's guard: its worker's keys carry the namespace ``tag``."""

    def __init__(self, connector: Any, stamp: Stamp, unstamped: str) -> None:
        self.stamp = stamp
        self.tag = namespace(stamp)
        ktc = getattr(getattr(connector, "_vllm_config", None), "kv_transfer_config", None)
        extra = getattr(ktc, "kv_connector_extra_config", None)
        extra = extra if isinstance(extra, dict) else {}
        worker = getattr(connector, "connector_worker", None)
        if worker is not None:
            prefixes = _key_prefixes(worker)
            if not prefixes:  # a worker kvpolicy cannot read: what vLLM read its prefix from
                prefixes = [_configured(extra)] if extra.get(MARK) != self.tag else []
            bad = next((p for p in prefixes if not carries(p, self.tag)), None)
            if bad is not None:
                raise input_error(_WHERE, f"MooncakeStoreConnector keys its blocks under cache_prefix `{bad[:200]}`, "
                                  f"which lacks this engine's layout namespace `{self.tag}` (vLLM's factory hook ran "
                                  "no before-create step for it), so blocks of another layout could be read from the "
                                  "store as this engine's",
                                  f"set cache_prefix to `{self.tag}`, or to one that starts with `{self.tag}-`, or "
                                  "use a kvpolicy whose factory hook calls the connector guard's `before_create`",
                                  code="unstamped-store")
        if unstamped == "accept":
            _warn_once("accept", "kvpolicy: MooncakeStoreConnector: %s=accept does not apply to its store: keys "
                       "written without kvpolicy's namespace are not read", ENV_UNSTAMPED)
        connector.kvpolicy_guard = self


def guard(connector: Any, stamp: Stamp, unstamped: str) -> MooncakeStoreGuard:
    """Guard one MooncakeStoreConnector object (scheduler or worker side)."""
    return MooncakeStoreGuard(connector, stamp, unstamped)
