"""Oracle: kvpolicy's connector guards (NixlConnector, OffloadingConnector, MooncakeStoreConnector) on
vLLM's own classes, under any release 0.24.0 on.

PYTHONPATH is kvpolicy's installed site (a wheel of the checkout, ../plugin_site.py) in front of
vLLM's. stdin: a JSON list of cases, each ``{"kind": ..., "stamps": {name: <Stamp JSON>}, ...}``;
stdout: one JSON answer per case. Kinds:

  {"kind": "nixl_wire"}
      vLLM's ``NixlAgentMetadata`` before and after `nixl_connector.install`: what the rebound
      ``base_worker.NixlAgentMetadata`` is, and msgspec round trips (the release's msgspec, vLLM's
      own dataclass) of metadata with and without ``kvpolicy_fingerprint``, each way.
  {"kind": "nixl", "worker": "pull"|"push", "ours": name, "unstamped": "miss"|"accept",
   "peers": {label: name | null | "<garbage text>"}}
      a NixlPullConnector / NixlPushConnector made with ``object.__new__`` (its ``__init__`` starts
      NIXL agents), its worker too, holding a ``NixlHandshakePayload`` built as vLLM builds it;
      `vllm_exchange.guard_connector` on it (GUARDS by vLLM's class name); then what the
      connector's ``get_handshake_metadata`` hands out, decoded by vLLM's original class and by the
      rebound one; and per peer, its metadata encoded and decoded with
      ``msgspec.msgpack.Decoder(base_worker.NixlAgentMetadata)`` (the expression ``_nixl_handshake``
      evaluates) and handed to the worker's ``_validate_remote_agent_handshake`` and (0.26 on)
      ``_add_notif_only_remote_agent``: ``{"by": "kvpolicy", "code", "message"}`` when the guard
      refuses, ``{"by": "vllm", "error", "in_vllm"}`` when the call got past it into vLLM's own
      method (which fails on the worker's missing state: ``in_vllm`` says the innermost frame is
      vLLM's nixl code).
  {"kind": "file_mapper", "a": name, "b": name}
      vLLM's ``FileMapper`` (its own keyword arguments per release) built without the guard, after
      `offloading_connector.before_create` with stamp a (twice), with stamp b, and after
      `unguard`: each ``base_path``, a block's ``get_file_name``, ``get_run_config`` and (0.25 on)
      the P2P tier's ``DataTransport._compute_fingerprint`` of it.
  {"kind": "mooncake_store", "a": name, "b": name, "prefixes": [...]}
      per configured ``cache_prefix`` (null: none), `mooncake_store_connector.before_create` on the
      extra config under each stamp, then vLLM's own reading of it: ``_resolve_cache_prefix`` (0.34)
      or ``str(extra.get("cache_prefix", ""))`` (the expression ``MooncakeStoreWorker.__init__``
      evaluates before), into vLLM's ``KeyMetadata`` and ``PoolKey(...).to_string()``; and the guard
      on a ``MooncakeStoreConnector`` made with ``object.__new__`` whose worker holds that metadata.

STAND-INS: the connectors and NIXL workers are made with ``object.__new__`` (constructing them
needs NIXL, Mooncake or a GPU worker); MooncakeStoreConnector's worker is a namespace holding
vLLM's ``KeyMetadata`` in ``token_dbs`` (``MooncakeStoreWorker.__init__`` connects to a store); the
vLLM config ``_resolve_cache_prefix`` reads is a namespace with the fields it reads, and "auto" sets
``VLLM_BUILD_COMMIT``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
import traceback
import types

os.environ.setdefault("VLLM_BUILD_COMMIT", "kvpolicy-oracle")

from _host import pin_host

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)

import msgspec  # noqa: E402
import vllm  # noqa: E402

from kvpolicy.engine.integrations import vllm_exchange  # noqa: E402
from kvpolicy.engine.integrations.connector_guards import (  # noqa: E402
    mooncake_store_connector,
    nixl_connector,
    offloading_connector,
)
from kvpolicy.engine.integrations.vllm_exchange import Stamp  # noqa: E402
from kvpolicy.policy.errors import PolicyError  # noqa: E402

K = "vllm.distributed.kv_transfer.kv_connector.v1"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


LOG = _Lines()
logging.getLogger("vllm.kvpolicy").addHandler(LOG)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:400]}"


def _refusal(exc: PolicyError) -> dict:
    diag = exc.diagnostics[0] if exc.diagnostics else None
    return {"by": "kvpolicy", "code": diag.code if diag else None, "message": diag.message if diag else exc.message,
            "help": (diag.help or "") if diag else ""}


# ---------------------------------------------------------------- NIXL

_AGENT_VALUES = {"engine_id": "peer", "agent_metadata": b"agent", "kv_caches_base_addr": [4096], "device_id": 0,
                 "num_blocks": 8, "block_lens": [8192], "block_strides": [8192], "kv_cache_layout": "HND",
                 "block_size": 16, "ssm_sizes": (0, 0), "attn_backend_name": "FLASH_ATTN",
                 "physical_blocks_per_logical_kv_block": 1}


def _agent_kwargs(cls: type, engine_id: str = "peer") -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        if f.name not in _AGENT_VALUES:
            raise KeyError(f"NixlAgentMetadata field {f.name} has no stand-in value")
        out[f.name] = _AGENT_VALUES[f.name]
    out["engine_id"] = engine_id
    return out


def _nixl_modules():
    md = importlib.import_module(f"{K}.nixl.metadata")
    bw = importlib.import_module(f"{K}.nixl.base_worker")
    return md, bw


def nixl_wire(case: dict) -> dict:
    md, bw = _nixl_modules()
    original = md.NixlAgentMetadata
    missing = nixl_connector.install()
    stamped = bw.NixlAgentMetadata
    kw = _agent_kwargs(original)
    old = msgspec.msgpack.encode(original(**kw))
    new = msgspec.msgpack.encode(stamped(**kw, kvpolicy_fingerprint="stamp-text"))
    old_reads_new = msgspec.msgpack.Decoder(original).decode(new)
    new_reads_old = msgspec.msgpack.Decoder(stamped).decode(old)
    new_reads_new = msgspec.msgpack.Decoder(stamped).decode(new)
    answer = {
        "missing": missing, "nixl_version": getattr(md, "NIXL_CONNECTOR_VERSION", None),
        "rebound": stamped is not original, "subclass": issubclass(stamped, original),
        "metadata_module_kept": md.NixlAgentMetadata is original,
        "fields_added": [f.name for f in dataclasses.fields(stamped) if f.name not in
                         {g.name for g in dataclasses.fields(original)}],
        "old_reads_new": {"type": type(old_reads_new).__name__, "engine_id": old_reads_new.engine_id,
                          "has_field": hasattr(old_reads_new, nixl_connector.FIELD)},
        "new_reads_old": getattr(new_reads_old, nixl_connector.FIELD, None),
        "new_reads_new": getattr(new_reads_new, nixl_connector.FIELD, None),
        "same_values": dataclasses.asdict(new_reads_old) == {**dataclasses.asdict(
            msgspec.msgpack.Decoder(original).decode(old)), nixl_connector.FIELD: ""},
    }
    nixl_connector.unguard()
    answer["unguarded"] = bw.NixlAgentMetadata is original
    return answer


def _call(method, meta) -> dict:
    try:
        method(meta, 1)
    except PolicyError as exc:
        return _refusal(exc)
    except Exception as exc:  # vLLM's own method, on a worker without its state
        frames = traceback.extract_tb(exc.__traceback__)
        innermost = frames[-1].filename if frames else ""
        return {"by": "vllm", "error": _err(exc),
                "in_vllm": innermost.startswith(os.path.join(os.path.dirname(vllm.__file__), "distributed", ""))
                and f"{os.sep}nixl{os.sep}" in innermost}
    return {"by": "none"}


def nixl(case: dict, stamps: dict) -> dict:
    md, bw = _nixl_modules()
    original = md.NixlAgentMetadata
    connector_module = importlib.import_module(f"{K}.nixl.connector")
    role_enum = importlib.import_module(f"{K}.base").KVConnectorRole
    if case["worker"] == "push":
        connector_cls = connector_module.NixlPushConnector
        worker_cls = importlib.import_module(f"{K}.nixl.push_worker").NixlPushConnectorWorker
    else:
        connector_cls = connector_module.NixlConnector
        worker_cls = importlib.import_module(f"{K}.nixl.pull_worker").NixlPullConnectorWorker
    worker = object.__new__(worker_cls)
    ours_bytes = msgspec.msgpack.encode(original(**_agent_kwargs(original, "ours")))
    worker.xfer_handshake_metadata = md.NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=ours_bytes)
    connector = object.__new__(connector_cls)
    connector._role = role_enum.WORKER
    connector.kv_transfer_config = types.SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={})
    connector.connector_worker = worker
    connector.connector_scheduler = None
    ours = stamps[case["ours"]]
    LOG.lines.clear()
    result = vllm_exchange.guard_connector(connector, ours, case["unstamped"])
    answer: dict = {"class": connector_cls.__name__, "worker_class": worker_cls.__name__,
                    "guard": type(result).__name__, "notif_method": hasattr(worker_cls, "_add_notif_only_remote_agent")}
    payload = connector.get_handshake_metadata()
    sent = msgspec.msgpack.Decoder(bw.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    old_view = msgspec.msgpack.Decoder(original).decode(payload.agent_metadata_bytes)
    text = getattr(sent, nixl_connector.FIELD, "")
    answer["sent"] = {"stamp_digest": Stamp.from_json(text).view_digest if text else None,
                      "old_decoder_engine_id": old_view.engine_id, "payload_type": type(payload).__name__}
    answer["peers"] = {}
    for label, peer in case["peers"].items():
        kw = _agent_kwargs(original, f"peer-{label}")
        if peer is None:
            data = msgspec.msgpack.encode(original(**kw))  # a peer without kvpolicy
        else:
            value = json.dumps(stamps[peer].to_dict()) if peer in stamps else peer
            data = msgspec.msgpack.encode(bw.NixlAgentMetadata(**kw, kvpolicy_fingerprint=value))
        meta = msgspec.msgpack.Decoder(bw.NixlAgentMetadata).decode(data)  # as _nixl_handshake decodes it
        out = {"validate": _call(worker._validate_remote_agent_handshake, meta)}
        if answer["notif_method"]:
            out["notif"] = _call(worker._add_notif_only_remote_agent, meta)
        answer["peers"][label] = out
    answer["log"] = [line for line in LOG.lines if "kvpolicy" in line]
    nixl_connector.unguard()
    answer["unguarded"] = bw.NixlAgentMetadata is original and not getattr(
        bw.NixlBaseConnectorWorker._validate_remote_agent_handshake, "__kvpolicy__", False)
    return answer


# ---------------------------------------------------------------- OffloadingConnector


def _mapper_kwargs(cls: type) -> dict:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    kw = dict(root_dir="/store", model_name="Qwen/Qwen2.5-0.5B", tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
              rank=0, dtype="bfloat16", kv_cache_groups=[{"tokens_per_block": 16, "layer_names": ["layers.0"]}])
    if "tokens_per_hash" in params:
        kw.update(tokens_per_hash=16, blocks_per_file=1)
    else:
        kw.update(hash_block_size=16, gpu_blocks_per_file=1)
    return kw


def file_mapper(case: dict, stamps: dict) -> dict:
    import hashlib

    fm = importlib.import_module("vllm.v1.kv_offload.file_mapper")
    base = importlib.import_module("vllm.v1.kv_offload.base")
    key = base.make_offload_key(hashlib.sha256(b"block").digest(), 0)
    try:
        transport = importlib.import_module("vllm.v1.kv_offload.tiering.p2p.data.base").DataTransport
    except ImportError:
        transport = None
    kw = _mapper_kwargs(fm.FileMapper)

    def made(label: str) -> dict:
        m = fm.FileMapper(**kw)
        config = m.get_run_config()
        return {"label": label, "base_path": m.base_path, "file": m.get_file_name(key),
                "field": config.get(offloading_connector.FIELD),
                "p2p": transport._compute_fingerprint(config) if transport is not None else None}

    LOG.lines.clear()
    out = [made("vllm")]
    offloading_connector.before_create({}, stamps[case["a"]])
    out += [made("a"), made("a again")]
    offloading_connector.before_create({}, stamps[case["b"]])
    out.append(made("b"))
    offloading_connector.unguard()
    out.append(made("vllm after unguard"))
    return {"mappers": out, "log": LOG.lines[:], "init_wrapped_after_unguard": bool(
        getattr(fm.FileMapper.__init__, "__kvpolicy__", False))}


# ---------------------------------------------------------------- MooncakeStoreConnector


def _store_modules():
    worker = importlib.import_module(f"{K}.mooncake.store.worker")
    try:
        layout = importlib.import_module(f"{K}.mooncake.store.layout")
    except ImportError:
        layout = importlib.import_module(f"{K}.mooncake.store.data")
    return worker, layout


def _vllm_config(extra: dict) -> types.SimpleNamespace:
    factors = types.SimpleNamespace(compile_factors=lambda: {"model": "Qwen/Qwen2.5-0.5B"})
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector="MooncakeStoreConnector",
                                                 kv_connector_extra_config=extra),
        model_config=types.SimpleNamespace(model="Qwen/Qwen2.5-0.5B", hf_config=types.SimpleNamespace(),
                                           compile_factors=factors.compile_factors),
        cache_config=types.SimpleNamespace(compile_factors=lambda: {"block_size": 16}))


def _read_prefix(worker_module, extra: dict) -> str:
    resolve = getattr(worker_module, "_resolve_cache_prefix", None)
    if resolve is not None:  # 0.34: what MooncakeStoreWorker.__init__ calls
        return resolve(_vllm_config(extra))
    return str(extra.get("cache_prefix", ""))  # what MooncakeStoreWorker.__init__ evaluates before 0.34


def mooncake_store(case: dict, stamps: dict) -> dict:
    worker_module, layout = _store_modules()
    connector_cls = importlib.import_module(f"{K}.mooncake.store.connector").MooncakeStoreConnector
    role_enum = importlib.import_module(f"{K}.base").KVConnectorRole
    answer: dict = {"resolver": hasattr(worker_module, "_resolve_cache_prefix"), "prefixes": []}
    for configured in case["prefixes"]:
        row: dict = {"configured": configured}
        for name in ("vllm", case["a"], case["b"]):
            extra = {} if configured is None else {"cache_prefix": configured}
            if name != "vllm":
                mooncake_store_connector.before_create(extra, stamps[name])
            try:
                prefix = _read_prefix(worker_module, extra)
            except Exception as exc:
                row[name] = {"error": _err(exc)}
                continue
            meta = layout.KeyMetadata(model_name="Qwen2.5-0.5B", tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0,
                                      cache_prefix=prefix)
            key = layout.PoolKey(meta, "c0ffee").to_string()
            connector = object.__new__(connector_cls)
            connector._role = role_enum.WORKER
            connector._vllm_config = _vllm_config(extra)
            connector.connector_scheduler = None
            connector.connector_worker = types.SimpleNamespace(token_dbs=[types.SimpleNamespace(metadata=meta)],
                                                               close=lambda: None)
            try:
                guarded = type(vllm_exchange.guard_connector(connector, stamps[case["a"]], "miss")).__name__
            except PolicyError as exc:
                guarded = _refusal(exc)
            row[name] = {"extra": {k: v for k, v in extra.items()}, "prefix": prefix, "key": key,
                         "guard_a": guarded}
        answer["prefixes"].append(row)
    mooncake_store_connector.unguard()
    answer["resolver_restored"] = not getattr(getattr(worker_module, "_resolve_cache_prefix", None), "__kvpolicy__",
                                              False)
    return answer


def main() -> None:
    cases = json.load(sys.stdin)
    out = []
    for case in cases:
        stamps = {name: Stamp.from_json(text) for name, text in case.get("stamps", {}).items()}
        try:
            if case["kind"] == "nixl_wire":
                answer = nixl_wire(case)
            elif case["kind"] == "nixl":
                answer = nixl(case, stamps)
            elif case["kind"] == "file_mapper":
                answer = file_mapper(case, stamps)
            elif case["kind"] == "mooncake_store":
                answer = mooncake_store(case, stamps)
            else:
                answer = {"oracle": f"unknown case kind {case['kind']}"}
        except Exception as exc:
            answer = {"oracle": _err(exc), "trace": traceback.format_exc()[-3000:]}
        answer["vllm"] = vllm.__version__
        out.append(answer)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
