"""Blocks between engines: what an engine writes through a KV connector is stamped, and what it reads
must carry its own stamp.

A prefill engine hands blocks to a decode engine, an engine stores blocks and
another (or itself, after a restart) loads them: whenever KV bytes cross an
engine's boundary, the reader decodes them as its own. If the writer laid them
out otherwise (another block size, kernel order, dtype...), the output is
garbage and nothing fails. While ``KVPOLICY_RULES`` is set, the plugin wraps
vLLM's ``KVConnectorFactory.create_connector``, so every connector vLLM
creates (scheduler side and worker side alike) is guarded by what kvpolicy
knows of its class (`guard_connector`):

- **ExampleConnector** (a store on ``shared_storage_path``: one safetensors
  file per layer per prompt, the slots of the layer's logical ``[B, H, N, C]``
  view) keeps its entries in a folder of their own,
  ``<shared_storage_path>/kvpolicy-<20 hex>/``, named by the engine's
  `layer_view_digest` and holding ``stamp.json`` (the whole `Stamp`). Engines
  whose views mean the same bytes share that folder and exchange blocks; any
  other engine never finds them and recomputes. When the engine's folder has
  no entry for a prompt but another folder does, one warning per such folder
  names every fingerprint field that differs. Entries an engine without
  kvpolicy wrote (at the top of the store, unstamped) are a miss too, unless
  ``KVPOLICY_UNSTAMPED_BLOCKS=accept`` takes them as this engine's own
  (linked into its folder, said once).
- Every other connector: one warning at creation saying its blocks are not
  checked against the peer's layout, and where the docs say how it stands.

The stamp is computed where the connector is created, from what vLLM itself
applied: the layout ``KVCacheConfig.kv_cache_layout`` carries (0.29+; the
gate releases' per-layer layout in vLLM's head order before that), the
specs of its KV cache groups, the attention backend its selector runs, and
the host CPU as vLLM's CPU attention reads it (`_vllm_host`).
"""

from __future__ import annotations

import importlib
import logging
import os
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.engine.exchange import layer_view_digest
from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint_of
from kvpolicy.engine.peer_data import load_peer_json
from kvpolicy.policy.cpu_kernel import CpuArch, CpuHost
from kvpolicy.policy.errors import InputError, PolicyError, input_error, terminal_text
from kvpolicy.policy.files import write_atomically
from kvpolicy.policy.layouts import HeadOrder, Layout
from kvpolicy.policy.releases import ReleaseProfile

__all__ = [
    "ENV_UNSTAMPED",
    "GUARDS",
    "NAMESPACE_PREFIX",
    "STAMP_FILE",
    "STAMP_FORMAT",
    "Stamp",
    "before_create",
    "guard_connector",
    "install",
    "read_stamp",
    "stamp_of",
    "this_engines_fingerprint",
    "unguard",
    "unstamped_policy",
    "write_atomically",
]

ENV_UNSTAMPED = "KVPOLICY_UNSTAMPED_BLOCKS"
UNSTAMPED_CHOICES = ("miss", "accept")
NAMESPACE_PREFIX = "kvpolicy-"
STAMP_FILE = "stamp.json"
STAMP_FORMAT = 1
_STAMP_MAX_BYTES = 64 * 1024  # a stamp is about 2 KiB; another engine's file is read with this bound
_NAMESPACE_HEX = 20

log = logging.getLogger("vllm.kvpolicy")


class TerminalSafe(logging.Filter):
    """The plugin's log boundary: every record of ``vllm.kvpolicy`` formatted once, through `terminal_text`,
    so what another engine or tenant wrote (a stamp's strings, a store's folder names) or an operator's
    setting cannot move the cursor or recolour vLLM's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit the format: logging reports it as usual
            return True
        record.msg, record.args = terminal_text(message), None
        return True


if not any(isinstance(f, TerminalSafe) for f in log.filters):
    log.addFilter(TerminalSafe())


@dataclass(frozen=True)
class Stamp:
    """What an engine's stored blocks mean: its layout fingerprint, and the digest of what a layer's
    view of them means (`layer_view_digest`), which names the store folder they live in."""

    fingerprint: LayoutFingerprint
    view_digest: str
    vllm_version: str = ""

    @property
    def namespace(self) -> str:
        """The store folder of this stamp's entries: ``kvpolicy-`` and 20 hex digits of `view_digest`."""
        return NAMESPACE_PREFIX + self.view_digest.removeprefix("sha256:")[:_NAMESPACE_HEX]

    def to_dict(self) -> dict[str, Any]:
        return {"format": STAMP_FORMAT, "digest": self.view_digest, "fingerprint_digest": self.fingerprint.digest,
                "vllm_version": self.vllm_version, "fingerprint": self.fingerprint.to_dict()}

    @classmethod
    def from_json(cls, text: str | bytes, what: str = "stamp") -> Stamp:
        """A stamp another engine wrote (bounded: `kvpolicy.engine.peer_data`); `InputError` if it is none."""
        data = load_peer_json(text, what)
        if not isinstance(data, dict) or type(data.get("format")) is not int or data["format"] != STAMP_FORMAT:
            raise input_error(what, f"not a kvpolicy stamp of format {STAMP_FORMAT}", code="stamp-format")
        fp = LayoutFingerprint.from_dict(data.get("fingerprint"))
        digest = layer_view_digest(fp)
        if data.get("digest") != digest:
            raise input_error(what, "the stamp's digest is not its fingerprint's: it was changed after it was "
                              "written", code="stamp-digest")
        version = data.get("vllm_version")
        return cls(fp, digest, version if isinstance(version, str) else "")


def stamp_of(fp: LayoutFingerprint, vllm_version: str = "") -> Stamp:
    """The stamp of a cache whose fingerprint is ``fp``."""
    return Stamp(fp, layer_view_digest(fp), vllm_version)


def unstamped_policy(env: Mapping[str, str] | None = None) -> str:
    """``KVPOLICY_UNSTAMPED_BLOCKS``: what a reader does with blocks no kvpolicy stamped (``miss``, the
    default: recompute; ``accept``: take them as its own); `InputError` naming the variable otherwise."""
    written = (os.environ if env is None else env).get(ENV_UNSTAMPED, "").strip()
    value = written.lower()
    if value in ("", "miss"):
        return "miss"
    if value == "accept":
        return value
    shown = written if len(written) <= 40 else written[:37] + "..."  # as the operator wrote it, not lowercased
    raise input_error(ENV_UNSTAMPED, f"`{shown}` is not a setting of {ENV_UNSTAMPED}",
                      "set it to `miss` (the default: blocks no kvpolicy stamped are recomputed) or `accept` "
                      "(they are taken as this engine's own)", code="invalid-setting")


# ---------------------------------------------------------------- the stamp of this engine


def _vllm_host() -> CpuHost:
    """The CPU as vLLM's CPU attention reads it (`_get_attn_isa`: torch's AMX and AVX-512 checks, the
    platform's architecture); this machine's `/proc/cpuinfo` where vLLM cannot say."""
    try:
        import torch
        from vllm.platforms import CpuArchEnum, current_platform

        arch = current_platform.get_cpu_architecture()
        arches = {CpuArchEnum.X86: CpuArch.x86, CpuArchEnum.ARM: CpuArch.arm, CpuArchEnum.POWERPC: CpuArch.power,
                  CpuArchEnum.S390X: CpuArch.s390x, CpuArchEnum.RISCV: CpuArch.riscv}
        ours = arches.get(arch, CpuArch.x86)
        x86 = ours is CpuArch.x86
        return CpuHost(arch=ours, amx=x86 and bool(torch.cpu._is_amx_tile_supported()),
                       avx512=x86 and bool(torch.cpu._is_avx512_supported()))
    except Exception:  # an older vLLM or torch without the checks: what /proc/cpuinfo says
        return CpuHost.this_host()


def _layout(release: ReleaseProfile, kv_cache_config: Any, vllm_config: Any, backend: Any) -> Layout:
    """The layout vLLM allocated: ``KVCacheConfig.kv_cache_layout`` (0.29+), else (the gate releases,
    which decide in the worker) the backend's per-layer layout in vLLM's head order."""
    for holder in (kv_cache_config, getattr(vllm_config, "cache_config", None)):
        name = getattr(holder, "kv_cache_layout", None)
        if isinstance(name, str) and name:
            return Layout(name)
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        head_order = HeadOrder(str(get_kv_cache_layout()))
    except Exception:
        head_order = HeadOrder.NHD
    per_layer = [x for x in backend.orders if x.placement.value == "per_layer"]
    fitting = [x for x in per_layer if x.head_order is head_order]
    if not (fitting or per_layer):
        raise InputError(f"backend `{backend.name}` of `{release.name}` lays out no per-layer layout")
    return (fitting or per_layer)[0]


def _specs(kv_cache_config: Any) -> list[Any]:
    """Every layer's KV cache spec, as the engine core hands them to the resolver."""
    return [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups for _ in group.layer_names]


def this_engines_fingerprint(vllm_config: Any, kv_cache_config: Any, release: ReleaseProfile) -> LayoutFingerprint:
    """The fingerprint of the cache vLLM allocates for ``kv_cache_config`` (see the module docstring)."""
    from kvpolicy.engine.integrations.vllm import _dtype_name
    from kvpolicy.engine.integrations.vllm_resolver import kv_cache_groups

    cache_config = getattr(vllm_config, "cache_config", None)
    configured = getattr(cache_config, "cache_dtype", None)
    model_dtype = _dtype_name(getattr(getattr(vllm_config, "model_config", None), "dtype", None))
    groups = kv_cache_groups(_specs(kv_cache_config), kv_cache_dtype=configured if isinstance(configured, str)
                             else None, model_dtype=model_dtype)
    if groups is None or groups.primary is None:
        raise InputError("the model has no KV cache with per-layer views: nothing to stamp")
    backend = release.backend(_attention_backend(vllm_config, release, groups.primary.kind.value == "mla"))
    layout = _layout(release, kv_cache_config, vllm_config, backend)
    host = _vllm_host() if backend.write_isa else None
    return fingerprint_of(layout, groups.primary, backend, groups, host)


def _attention_backend(vllm_config: Any, release: ReleaseProfile, mla: bool) -> str:
    """The attention backend vLLM's selector runs for the model (by name), as the resolver hook finds it."""
    names: list[str] = []
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = [str(b.get_name()) for b in get_current_attn_backends(vllm_config)]
    except Exception:
        pass
    configured = getattr(getattr(getattr(vllm_config, "attention_config", None), "backend", None), "name", None)
    for name in [*names, configured]:
        if isinstance(name, str) and name in release.backends and release.backends[name].mla == mla:
            return name
    raise InputError(f"kvpolicy cannot tell which attention backend this engine runs ({names or 'none found'}), "
                     "so it cannot stamp the blocks it stores")


# ---------------------------------------------------------------- files


def read_stamp(folder: Path) -> Stamp | str:
    """The stamp in ``folder``, or why there is none that can be read."""
    path = folder / STAMP_FILE
    try:
        # INVARIANT: never blocks: a FIFO or device named stamp.json is refused before a byte is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return f"its {STAMP_FILE} is not a regular file"
            with os.fdopen(fd, "rb") as f:
                fd = -1
                data = f.read(_STAMP_MAX_BYTES + 1)
        finally:
            if fd >= 0:
                os.close(fd)
    except OSError as exc:
        return f"its {STAMP_FILE} cannot be read ({exc.strerror or exc})"
    if len(data) > _STAMP_MAX_BYTES:
        return f"its {STAMP_FILE} is over {_STAMP_MAX_BYTES} bytes"
    try:
        return Stamp.from_json(data, str(path))
    except PolicyError as exc:
        return f"its {STAMP_FILE} is not a kvpolicy stamp ({' '.join(exc.render().split())[:300]})"


# ---------------------------------------------------------------- the factory hook


# connector class -> the module of `kvpolicy.engine.integrations.connector_guards` whose `guard(connector, stamp,
# unstamped)` guards one of its objects (imported when vLLM creates such a connector)
GUARDS: dict[str, str] = {
    "ExampleConnector": "example_connector",
    "NixlConnector": "nixl_connector",  # vLLM's alias of NixlPullConnector; the class vLLM builds is named below
    "NixlPullConnector": "nixl_connector",
    "NixlPushConnector": "nixl_connector",
    "OffloadingConnector": "offloading_connector",
    "MooncakeStoreConnector": "mooncake_store_connector",
}
_warned: set[str] = set()


def guard_connector(connector: Any, stamp: Stamp, unstamped: str = "miss") -> Any:
    """Guard one connector object by its class (see the module docstring); returns the guard, or None
    for a class kvpolicy has no guard for (said once per class, as a warning)."""
    name = type(connector).__name__
    module = _guard_module(name)
    if module is not None:
        return module.guard(connector, stamp, unstamped)
    children = getattr(connector, "_connectors", None)
    if isinstance(children, list) and children:  # MultiConnector builds its members itself, not by the factory
        return [guard_connector(child, stamp, unstamped) for child in children]
    if name not in _warned:
        _warned.add(name)
        log.warning("kvpolicy: %s: the blocks this connector moves are not checked against its peers' layouts "
                    "(kvpolicy guards %s; docs/blocks-between-engines.md says where each connector stands); this "
                    "engine's stamp is %s", name, ", ".join(sorted(GUARDS)), stamp.view_digest)
    return None


def _guard_module(name: Any) -> Any:
    """The guard module of connector class ``name``, or None."""
    module = GUARDS.get(name) if isinstance(name, str) else None
    return None if module is None else importlib.import_module(
        f"kvpolicy.engine.integrations.connector_guards.{module}")


def before_create(kv_transfer_config: Any, stamp: Stamp, unstamped: str = "miss") -> None:
    """What a guard must settle before vLLM builds its connector (a store's namespace that the constructor
    reads: OffloadingConnector's tiers, MooncakeStoreConnector's ``cache_prefix``), for the configured
    connector and, in a MultiConnector, for each member's own ``kv_connector_extra_config``."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    if extra is None:
        extra = {}
        kv_transfer_config.kv_connector_extra_config = extra
    todo = [(getattr(kv_transfer_config, "kv_connector", None), extra)]
    while todo:
        name, config = todo.pop()
        module = _guard_module(name)
        hook = getattr(module, "before_create", None)
        if hook is not None:
            hook(config, stamp, unstamped)
        for member in config.get("connectors") or () if isinstance(config, dict) else ():
            if isinstance(member, dict):
                todo.append((member.get("kv_connector"), member.setdefault("kv_connector_extra_config", {})))


def unguard() -> None:
    """Put back what every guard module loaded in this process patched in vLLM (the plugin's unregister)."""
    for module in set(GUARDS.values()):
        loaded = sys.modules.get(f"kvpolicy.engine.integrations.connector_guards.{module}")
        undo = getattr(loaded, "unguard", None)
        if undo is not None:
            undo()


def install(release: ReleaseProfile, vllm_version: str, patch: Callable[[Any, str, Any], None],
            unstamped: str = "miss") -> bool:
    """Wrap ``KVConnectorFactory.create_connector`` (with ``patch``, which the plugin undoes); False
    where this vLLM has no such factory (nothing to guard)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return False
    original = KVConnectorFactory.__dict__["create_connector"]
    create = original.__func__ if isinstance(original, classmethod) else original
    create = getattr(create, "__wrapped__", create)

    def create_connector(cls: Any, config: Any, role: Any, *args: Any, **kwargs: Any) -> Any:
        kv_cache_config = args[0] if args else kwargs.get("kv_cache_config")
        ktc = getattr(config, "kv_transfer_config", None)
        name = getattr(ktc, "kv_connector", None)
        try:
            if kv_cache_config is None:
                raise InputError("vLLM gave the connector no KV cache config")
            stamp = stamp_of(this_engines_fingerprint(config, kv_cache_config, release), vllm_version)
        except PolicyError as exc:
            # INVARIANT: fail closed. A connector whose blocks kvpolicy cannot stamp would read and write
            # blocks unchecked while the operator believes they are checked.
            why = " ".join(exc.render().split())[:400]
            raise input_error(_ENV_RULES, f"kvpolicy cannot stamp the blocks of connector `{name}` ({why}); vLLM "
                              "must not start", f"unset {_ENV_RULES} to let vLLM run unchecked",
                              code="cannot-stamp") from None
        if ktc is not None:
            before_create(ktc, stamp, unstamped)
        connector = create(cls, config, role, *args, **kwargs)
        guard_connector(connector, stamp, unstamped)
        return connector

    create_connector.__wrapped__ = create  # type: ignore[attr-defined]
    patch(KVConnectorFactory, "create_connector", classmethod(create_connector))
    return True


_ENV_RULES = "KVPOLICY_RULES"
