"""OffloadingConnector's stores outside the engine, kept per layout fingerprint.

OffloadingConnector (vLLM 0.24 on) offloads a block's raw bytes, as the cache lays them out
(physical pages: the layout, the kernel's order and the cells all show), to a CPU tier inside the
engine and, with ``TieringOffloadingSpec``'s ``secondary_tiers``, to stores other engines read:

- FS and OBJ tiers name every block ``<root>/<model>_<sha256(fields)[:12]>_r<rank>/...`` from a
  ``FileMapper`` (``vllm/v1/kv_offload/file_mapper.py``), and write its ``fields`` to
  ``config.json``;
- the P2P tier (0.25 on) refuses a peer whose ``config_fingerprint`` (a hash of a FileMapper's
  ``get_run_config()``) is not its own.

The fields name the model, block geometry, parallelism and dtype, but no layout, backend or kernel
order, so engines of two layouts (or 0.28 and 0.29, whose pages differ) share paths and pass P2P's
check. The guard wraps ``FileMapper.__init__`` once per process (recorded; `unguard` undoes it):
every FileMapper gets ``fields["kvpolicy_fingerprint"] = <this engine's fingerprint digest>`` (the
bytes' identity: the whole fingerprint) and its ``base_path`` recomputed from them, so stores of
different layouts never share a path, ``config.json`` names the digest, and P2P peers of other
layouts (or without kvpolicy) are refused by P2P's own check.

The scheduler builds its tiers, and their FileMappers, while vLLM constructs the connector: the
wrapper must be in place before. `before_create` (the factory hook's "before create" step) puts it
there; without it, `guard` refuses a connector whose secondary tiers were built unstamped. The CPU
tier never leaves the engine: nothing to guard. Entries an engine without kvpolicy stored live
under other paths: they are recomputed, ``KVPOLICY_UNSTAMPED_BLOCKS=accept`` notwithstanding.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from typing import Any

from kvpolicy.engine.exchange import block_digest
from kvpolicy.engine.integrations.connector_guards.patching import Patches, WarnOnce
from kvpolicy.engine.integrations.vllm_exchange import ENV_UNSTAMPED, Stamp
from kvpolicy.policy.errors import input_error

__all__ = ["FIELD", "FILE_MAPPER", "OffloadingGuard", "before_create", "guard", "install", "unguard"]

log = logging.getLogger("vllm.kvpolicy")

FILE_MAPPER = "vllm.v1.kv_offload.file_mapper"
FIELD = "kvpolicy_fingerprint"
_IN_ENGINE_SPECS = ("CPUOffloadingSpec",)  # specs whose blocks never leave the engine
_VLLM_SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")

_lock = threading.RLock()
_patches = Patches()
_warned = _warn_once = WarnOnce(log)
_state: dict[str, Any] = {"stamp": None}  # the stamp the FileMapper wrapper writes


def unguard() -> None:
    """Put back vLLM's ``FileMapper.__init__``."""
    with _lock:
        _patches.undo()
        _state["stamp"] = None


def _stamped_init(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        stamp: Stamp | None = _state["stamp"]
        if stamp is None:  # unguarded between the patch and now: vLLM's own mapper
            return
        fields = getattr(self, "fields", None)
        if not isinstance(fields, dict):
            raise input_error("OffloadingConnector", "vLLM's FileMapper has no `fields` dict: kvpolicy cannot keep "
                              "this engine's offloaded blocks apart from other layouts'",
                              "report the vLLM version to kvpolicy", code="unguardable-store")
        root = signature.bind(self, *args, **kwargs).arguments.get("root_dir", "")
        fields[FIELD] = block_digest(stamp.fingerprint)
        self.base_path = self._compute_base_path(root, fields)

    __init__.__kvpolicy__ = True  # type: ignore[attr-defined]
    return __init__


def install(stamp: Stamp) -> str | None:
    """Wrap ``FileMapper.__init__`` (once) so it stamps ``stamp``; None when done, else what this vLLM
    lacks."""
    with _lock:
        try:
            cls = importlib.import_module(FILE_MAPPER).FileMapper
        except (ImportError, AttributeError) as exc:
            return f"{FILE_MAPPER}.FileMapper ({type(exc).__name__}: {exc})"
        init = cls.__dict__.get("__init__")
        if init is None or not hasattr(cls, "_compute_base_path") or \
                "root_dir" not in inspect.signature(init).parameters:
            return "FileMapper.__init__(root_dir, ...) and FileMapper._compute_base_path"
        _state["stamp"] = stamp
        if not getattr(init, "__kvpolicy__", False):
            _patches.record(cls, "__init__", init)
            cls.__init__ = _stamped_init(init)
        return None


def before_create(extra_config: dict[str, Any], stamp: Stamp, unstamped: str = "miss") -> None:
    """Before vLLM constructs an OffloadingConnector (whose scheduler builds its tiers then): every
    FileMapper made from now on is stamped. ``extra_config`` is left as it is."""
    missing = install(stamp)
    if missing is not None:
        _warn_missing(missing, stamp)


def _warn_missing(missing: str, stamp: Stamp) -> None:
    _warn_once("missing", "kvpolicy: OffloadingConnector: this release's offloading stores are not guarded: kvpolicy "
               "needs %s; blocks its FS/OBJ/P2P tiers store are not kept apart from other layouts' (this engine's "
               "stamp is %s)", missing, block_digest(stamp.fingerprint))


def _extra_config(connector: Any) -> dict[str, Any]:
    ktc = getattr(getattr(connector, "_vllm_config", None), "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None)
    return extra if isinstance(extra, dict) else {}


def _is_scheduler(connector: Any) -> bool:
    role = getattr(connector, "_role", None)
    name = getattr(role, "name", role)
    return name == "SCHEDULER" or getattr(connector, "connector_scheduler", None) is not None


class OffloadingGuard:
    """One OffloadingConnector object's guard: the FileMappers of its stores carry ``stamp``."""

    def __init__(self, connector: Any, stamp: Stamp, unstamped: str, built_stamped: bool) -> None:
        self.stamp = stamp
        self.unstamped = unstamped
        extra = _extra_config(connector)
        spec = str(extra.get("spec_name", "CPUOffloadingSpec"))
        tiers = extra.get("secondary_tiers") or []
        self.stores_outside = spec not in _IN_ENGINE_SPECS and (bool(tiers) or spec not in _VLLM_SPECS)
        if self.stores_outside and _is_scheduler(connector) and not built_stamped:
            kinds = ", ".join(str(t.get("type", t)) if isinstance(t, dict) else str(t) for t in tiers)
            raise input_error("kv_transfer_config.kv_connector_extra_config.secondary_tiers",
                              f"OffloadingConnector built its stores ({spec}: {kinds or 'its own'}) before kvpolicy "
                              "could keep them apart from other layouts' (vLLM's factory hook ran no before-create "
                              "step for it), so blocks of another layout could be read from them as this engine's",
                              "use a kvpolicy whose factory hook calls the connector guard's "
                              "`before_create`, or offload to the CPU tier only", code="unstamped-store")
        if spec not in _VLLM_SPECS:
            _warn_once(f"spec:{spec}", "kvpolicy: OffloadingConnector: spec %s is not vLLM's: kvpolicy keeps its "
                       "stores apart per layout only where they name blocks through vLLM's FileMapper", spec)
        if self.stores_outside and unstamped == "accept":
            _warn_once("accept", "kvpolicy: OffloadingConnector: %s=accept does not apply to offloaded blocks: "
                       "entries stored without kvpolicy live under other paths and are recomputed", ENV_UNSTAMPED)
        connector.kvpolicy_guard = self


def guard(connector: Any, stamp: Stamp, unstamped: str) -> OffloadingGuard | None:
    """Guard one OffloadingConnector object (scheduler or worker side); None, said once as a warning,
    where this vLLM has no FileMapper to stamp."""
    with _lock:
        current = _state["stamp"]
        built_stamped = bool(_patches) and current is not None and \
            block_digest(current.fingerprint) == block_digest(stamp.fingerprint)
        missing = install(stamp)
    if missing is not None:
        _warn_missing(missing, stamp)
        return None
    return OffloadingGuard(connector, stamp, unstamped, built_stamped)
