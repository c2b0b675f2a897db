"""NixlConnector's handshake carries this engine's stamp, and a peer is refused unless its blocks mean
byte for byte what this engine's do.

NIXL (vLLM 0.24 on, ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``; ``NixlConnector`` is
``NixlPullConnector``, and ``NixlPushConnector`` shares its worker base) moves raw block regions
between engines' caches: nothing is transcoded on the way. Each worker describes its cache in a
``NixlAgentMetadata`` (a dataclass, msgpack-encoded by msgspec inside the ``NixlHandshakePayload``
its connector's ``get_handshake_metadata`` hands to vLLM); the peer decodes it in ``_nixl_handshake``
with ``msgspec.msgpack.Decoder(NixlAgentMetadata)``, the name looked up in ``base_worker`` at call
time, and checks it in ``NixlBaseConnectorWorker._validate_remote_agent_handshake`` (called by
``add_remote_agent`` before any transfer; the push worker's override calls it through ``super()``)
or, on the push-mode decode side (0.26 on), registers it in ``_add_notif_only_remote_agent``.

The guard, once per process (`install`, recorded, undone by `unguard`):

- rebinds ``base_worker.NixlAgentMetadata`` to a subclass with ``kvpolicy_fingerprint: str = ""``:
  an old peer's metadata decodes with the field empty, and a peer without this guard ignores it
  (msgspec skips unknown fields of a dataclass);
- wraps ``_validate_remote_agent_handshake`` and ``_add_notif_only_remote_agent`` of the worker's
  classes to check the peer's stamp first: `kvpolicy.engine.exchange.compare_blocks` of the
  peer's fingerprint into this engine's must answer ``as_is``; ``transcode`` and ``refused`` are
  refused (NIXL cannot transcode), naming every fingerprint field that differs;

and, per connector object on the worker side, writes this engine's `Stamp` (its JSON) into the
metadata its ``get_handshake_metadata`` returns. A peer that sends no stamp is refused, unless
``KVPOLICY_UNSTAMPED_BLOCKS=accept`` (said once per peer engine).

Not folded into vLLM's ``compute_nixl_compatibility_hash``: vLLM compares that hash before it
decodes the metadata and refuses with a message that cannot say what differs, and it would refuse
every unstamped peer even under ``accept``. The check here runs whatever
``enforce_handshake_compat`` says.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import threading
from typing import Any

from kvpolicy.engine.agreement import check_compatible
from kvpolicy.engine.exchange import ExchangeKind, compare_blocks, compare_transfer
from kvpolicy.engine.integrations.connector_guards.patching import Patches, WarnOnce
from kvpolicy.engine.integrations.vllm_exchange import ENV_UNSTAMPED, Stamp
from kvpolicy.policy.errors import PolicyError, input_error

__all__ = ["FIELD", "NixlGuard", "guard", "install", "stamped_agent_class", "unguard"]

log = logging.getLogger("vllm.kvpolicy")

BASE_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
FIELD = "kvpolicy_fingerprint"
_CHECKED = ("_validate_remote_agent_handshake", "_add_notif_only_remote_agent")
_WHERE = "NixlConnector handshake"

_lock = threading.RLock()
_patches = Patches()  # (owner, attribute, what it was), in the order applied
_warned = _warn_once = WarnOnce(log)
_patch = _patches.apply


def unguard() -> None:
    """Put back every vLLM attribute this module replaced (the newest first)."""
    with _lock:
        _patches.undo()


def stamped_agent_class(original: type) -> type:
    """``original`` (vLLM's ``NixlAgentMetadata``) with ``kvpolicy_fingerprint: str = ""`` added; itself
    if it has the field already."""
    if any(f.name == FIELD for f in dataclasses.fields(original)):
        return original
    frozen = bool(getattr(getattr(original, "__dataclass_params__", None), "frozen", False))
    cls = dataclasses.make_dataclass(original.__name__, [(FIELD, str, dataclasses.field(default=""))],
                                     bases=(original,), frozen=frozen)
    cls.__module__ = __name__
    cls.__qualname__ = f"kvpolicy[{original.__qualname__}]"
    cls.__doc__ = f"vLLM's {original.__name__} and the stamp of the engine that sent it (kvpolicy)."
    return cls


def _checking(original: Any) -> Any:
    """``original`` (a worker method whose first argument is the peer's metadata), checking the peer
    with the worker's guard first."""

    @functools.wraps(original)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = getattr(self, "__dict__", {}).get("kvpolicy_guard")
        if guard is not None:
            guard.check_peer(args[0] if args else kwargs.get("nixl_agent_meta", kwargs.get("metadata")))
        return original(self, *args, **kwargs)

    checked.__kvpolicy__ = True  # type: ignore[attr-defined]
    return checked


def install(worker_class: type | None = None) -> str | None:
    """Patch vLLM's NIXL worker once (see the module docstring), and ``worker_class``'s own overrides of
    the checked methods; None when done, else what this vLLM lacks (nothing is patched then)."""
    with _lock:
        try:
            base_worker = importlib.import_module(BASE_WORKER)
            base = base_worker.NixlBaseConnectorWorker
            agent = base_worker.NixlAgentMetadata
        except (ImportError, AttributeError) as exc:
            return f"{BASE_WORKER}.NixlBaseConnectorWorker or NixlAgentMetadata ({type(exc).__name__}: {exc})"
        if not dataclasses.is_dataclass(agent):
            return f"{BASE_WORKER}.NixlAgentMetadata is not a dataclass"
        if "_validate_remote_agent_handshake" not in base.__dict__:
            return "NixlBaseConnectorWorker._validate_remote_agent_handshake"
        stamped = stamped_agent_class(agent)
        if stamped is not agent:
            _patch(base_worker, "NixlAgentMetadata", stamped)
        classes = [base]
        if worker_class is not None and issubclass(worker_class, base):
            classes += [c for c in worker_class.__mro__ if c is not base and issubclass(c, base)]
        for cls in classes:
            for name in _CHECKED:
                method = cls.__dict__.get(name)
                if method is not None and not getattr(method, "__kvpolicy__", False):
                    _patch(cls, name, _checking(method))
        return None


def _first_line(exc: PolicyError) -> str:
    text = exc.message or (exc.diagnostics[0].message if exc.diagnostics else str(exc))
    return (text.splitlines() or [""])[0][:300]


def _codec() -> tuple[Any, type]:
    import msgspec

    return msgspec, importlib.import_module(BASE_WORKER).NixlAgentMetadata


class NixlGuard:
    """One NixlConnector object's guard: its worker's outgoing metadata carries ``stamp``, and the
    peers its worker handshakes with are checked against it (`check_peer`)."""

    def __init__(self, connector: Any, stamp: Stamp, unstamped: str) -> None:
        self.stamp = stamp
        self.unstamped = unstamped
        self.text = json.dumps(stamp.to_dict(), sort_keys=True, separators=(",", ":"))
        self.worker = getattr(connector, "connector_worker", None)
        connector.kvpolicy_guard = self
        if self.worker is not None:
            self.worker.kvpolicy_guard = self
            self._handshake_metadata = connector.get_handshake_metadata
            connector.get_handshake_metadata = self.get_handshake_metadata

    # ------------------------------------------------------------ what this engine sends

    def get_handshake_metadata(self) -> Any:
        """The connector's handshake payload, its agent metadata carrying this engine's stamp."""
        payload = self._handshake_metadata()
        data = getattr(payload, "agent_metadata_bytes", None)
        if isinstance(data, (bytes, bytearray)):
            payload.agent_metadata_bytes = self.stamp_metadata(bytes(data))
        return payload

    def stamp_metadata(self, data: bytes) -> bytes:
        """Encoded agent metadata ``data``, with this engine's stamp in it."""
        msgspec, agent = _codec()
        meta = msgspec.msgpack.Decoder(agent).decode(data)
        if getattr(meta, FIELD, None) == self.text:
            return data
        if not hasattr(meta, FIELD):  # another plugin rebound the class over ours: stamp or refuse, never send bare
            raise input_error(_WHERE, f"vLLM's NixlAgentMetadata is `{agent.__qualname__}`, which has no `{FIELD}` "
                              "field: kvpolicy cannot send this engine's stamp to its NIXL peers",
                              "do not load another plugin that replaces NixlAgentMetadata", code="unstamped-handshake")
        return msgspec.msgpack.encode(dataclasses.replace(meta, **{FIELD: self.text}))

    # ------------------------------------------------------------ what a peer sent

    def check_peer(self, meta: Any) -> None:
        """Return if a peer's blocks are this engine's byte for byte; `InputError` naming what differs
        otherwise (or, for a peer with no stamp, under ``miss``)."""
        engine = str(getattr(meta, "engine_id", "?"))[:200]
        text = getattr(meta, FIELD, "") or ""
        if not text:
            if self.unstamped == "accept":
                _warn_once(f"accept:{engine}", "kvpolicy: NixlConnector: peer engine %s sent no kvpolicy stamp; "
                           "%s=accept: its blocks are taken as laid out as this engine's (%s)", engine,
                           ENV_UNSTAMPED, self.stamp.view_digest)
                return
            raise input_error(_WHERE, f"peer engine `{engine}` sent no kvpolicy stamp (it runs without kvpolicy, "
                              "or with one that does not guard NIXL), so whether the blocks NIXL would move from or "
                              "to it are laid out as this engine's cannot be checked; its handshake is refused",
                              f"run the peer under kvpolicy with the same rules, or set {ENV_UNSTAMPED}=accept to "
                              "trust peers without a stamp", code="unstamped-peer")
        try:
            theirs = Stamp.from_json(text, "NIXL peer")
        except PolicyError as exc:
            raise input_error(_WHERE, f"peer engine `{engine}` sent a kvpolicy stamp this engine cannot read "
                              f"({_first_line(exc)}); its handshake is refused",
                              "run both engines with one kvpolicy version", code="stamp-format") from None
        if compare_transfer("NixlConnector", theirs.fingerprint, self.stamp.fingerprint)[0] == "as_is":
            return  # the same blocks, or only what NIXL reconciles itself (tensor-parallel heads, block size)
        exchange = compare_blocks(theirs.fingerprint, self.stamp.fingerprint)
        fields = check_compatible(self.stamp.fingerprint, theirs.fingerprint, local_name="ours",
                                  remote_name="theirs").messages
        if exchange.kind is ExchangeKind.transcode:
            why = "the same cells sit elsewhere in its blocks, and NIXL moves raw block regions (it cannot transcode)"
        else:
            why = exchange.reason or "its cells differ from this engine's (no exact conversion exists)"
        writer = f" (vLLM {theirs.vllm_version})" if theirs.vllm_version else ""
        body = "".join(f"\n    {line}" for line in fields) or f"\n    {exchange.reason}"
        raise input_error(_WHERE, f"peer engine `{engine}`{writer} lays out its KV blocks otherwise than this "
                          f"engine ({exchange.kind}: {why}); its handshake is refused. Fields that differ:{body}",
                          "run prefill and decode engines with the same kvpolicy rules, block size and KV cache "
                          "dtype, so they decide one layout", code="layout-mismatch")


def guard(connector: Any, stamp: Stamp, unstamped: str) -> NixlGuard | None:
    """Guard one NixlConnector (NixlPullConnector, NixlPushConnector) object; None, said once as a
    warning, where this vLLM's NIXL lacks what the guard needs."""
    worker = getattr(connector, "connector_worker", None)
    missing = install(type(worker) if worker is not None else None)
    if missing is not None:
        _warn_once("missing", "kvpolicy: %s: this release's NIXL is not guarded: kvpolicy needs %s; the blocks it "
                   "moves are not checked against its peers' layouts (this engine's stamp is %s)",
                   type(connector).__name__, missing, stamp.view_digest)
        return None
    return NixlGuard(connector, stamp, unstamped)
