"""The connector guards for NixlConnector, OffloadingConnector and MooncakeStoreConnector, on stand-ins
of the vLLM modules they patch (vLLM is not installed here).

Each stand-in keeps the shape of vLLM's (names, signatures, where a name is looked up); the real
classes of every release are driven by tests/conformance/test_connector_guards.py. msgspec is
stood in for too where it is missing (dataclasses encoded as JSON, unknown fields skipped on
decode, as msgspec does for dataclasses).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvpolicy.engine.exchange import block_digest
from kvpolicy.engine.fingerprint import fingerprint_of
from kvpolicy.engine.integrations import vllm_exchange
from kvpolicy.engine.integrations.connector_guards import (
    mooncake_store_connector,
    nixl_connector,
    offloading_connector,
)
from kvpolicy.engine.integrations.vllm_exchange import ENV_UNSTAMPED, Stamp, stamp_of
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.releases import get_profile
from kvpolicy.policy.spec import KVCacheSpec

QWEN4 = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


def _stamp(layout: Layout = Layout.LBNHC, backend: str = "TRITON_ATTN", **spec: Any) -> Stamp:
    fp = fingerprint_of(layout, KVCacheSpec(**{**QWEN4, **spec}), get_profile("vllm-0.34").backend(backend))
    return stamp_of(fp, "0.34.0")


OURS = _stamp()
BLOCK32 = _stamp(block_size=32)  # another block size: NIXL reconciles it (block_size_ratio), as heads per rank
FP8 = _stamp(kv_cache_dtype="fp8")  # other cells: refused
HEADS2 = _stamp(num_kv_heads=2)  # a decode instance at twice the tensor-parallel size: NIXL's tp_ratio
HND = _stamp(Layout.LBHNC)  # the same cells elsewhere: transcode
FLASH = _stamp(backend="FLASH_ATTN")  # the same bytes: as_is


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _error(info: pytest.ExceptionInfo[InputError]) -> tuple[str, str, str]:
    diag = info.value.diagnostics[0]
    return diag.code, diag.message, diag.help or ""


# ---------------------------------------------------------------- msgspec, as it treats dataclasses


def _fake_msgspec() -> types.ModuleType:
    def default(value: Any) -> Any:
        if isinstance(value, bytes):
            return {"__bytes__": base64.b64encode(value).decode()}
        raise TypeError(type(value))

    def hook(obj: dict) -> Any:
        return base64.b64decode(obj["__bytes__"]) if set(obj) == {"__bytes__"} else obj

    class Decoder:
        def __init__(self, type: type) -> None:
            self.type = type

        def decode(self, data: bytes) -> Any:
            values = json.loads(data, object_hook=hook)
            known = {f.name for f in dataclasses.fields(self.type)}
            return self.type(**{k: v for k, v in values.items() if k in known})

    msgpack = types.SimpleNamespace(
        encode=lambda obj: json.dumps(dataclasses.asdict(obj), default=default).encode(),
        decode=lambda data, type: Decoder(type).decode(data), Decoder=Decoder)
    module = types.ModuleType("msgspec")
    module.msgpack = msgpack  # type: ignore[attr-defined]
    return module


@pytest.fixture
def msgspec(monkeypatch: pytest.MonkeyPatch) -> Any:
    try:
        import msgspec as real
    except ImportError:
        real = _fake_msgspec()
        monkeypatch.setitem(sys.modules, "msgspec", real)
    return real


# ---------------------------------------------------------------- NIXL


@dataclasses.dataclass
class NixlAgentMetadata:  # vLLM's, cut to what the guard and these tests read
    engine_id: str
    agent_metadata: bytes
    block_size: int
    kv_cache_layout: str = "HND"


@dataclasses.dataclass
class NixlHandshakePayload:
    compatibility_hash: str
    agent_metadata_bytes: bytes


class Reached(Exception):
    """vLLM's own check ran (the stand-in's)."""


@pytest.fixture
def nixl(monkeypatch: pytest.MonkeyPatch, msgspec: Any) -> Iterator[types.SimpleNamespace]:
    class NixlBaseConnectorWorker:
        def _validate_remote_agent_handshake(self, nixl_agent_meta: Any, remote_tp_size: int) -> None:
            raise Reached(f"validate {nixl_agent_meta.engine_id}")

        def _add_notif_only_remote_agent(self, metadata: Any, remote_tp_size: int) -> str:
            raise Reached(f"notif {metadata.engine_id}")

    class NixlPullConnectorWorker(NixlBaseConnectorWorker):
        pass

    class NixlPushConnectorWorker(NixlBaseConnectorWorker):
        calls = 0

        def _validate_remote_agent_handshake(self, nixl_agent_meta: Any, remote_tp_size: int) -> None:
            type(self).calls += 1
            super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size)

    base_worker = _module(monkeypatch, nixl_connector.BASE_WORKER, NixlBaseConnectorWorker=NixlBaseConnectorWorker,
                          NixlAgentMetadata=NixlAgentMetadata, msgspec=msgspec)

    def connector(name: str, worker_cls: type) -> Any:
        worker = object.__new__(worker_cls)
        worker.xfer_handshake_metadata = NixlHandshakePayload("h", msgspec.msgpack.encode(
            NixlAgentMetadata("ours", b"agent", 16)))

        def get_handshake_metadata(self: Any) -> Any:
            return self.connector_worker.xfer_handshake_metadata

        cls = type(name, (), {"get_handshake_metadata": get_handshake_metadata})
        obj = cls()
        obj.connector_worker = worker
        return obj

    def peer(stamp: Stamp | str | None, engine: str = "peer") -> Any:
        """The peer's metadata as vLLM's _nixl_handshake decodes it: Decoder(base_worker.NixlAgentMetadata)."""
        if stamp is None:
            data = msgspec.msgpack.encode(NixlAgentMetadata(engine, b"a", 16))
        else:
            text = stamp if isinstance(stamp, str) else json.dumps(stamp.to_dict())
            data = msgspec.msgpack.encode(base_worker.NixlAgentMetadata(engine, b"a", 16, kvpolicy_fingerprint=text))
        return msgspec.msgpack.Decoder(base_worker.NixlAgentMetadata).decode(data)

    nixl_connector._warned.clear()
    yield types.SimpleNamespace(base_worker=base_worker, base=NixlBaseConnectorWorker, pull=NixlPullConnectorWorker,
                                push=NixlPushConnectorWorker, connector=connector, peer=peer, msgspec=msgspec)
    nixl_connector.unguard()
    nixl_connector._warned.clear()


def test_nixl_guards_every_class_name_vllm_builds(nixl: Any) -> None:
    for name in ("NixlConnector", "NixlPullConnector", "NixlPushConnector"):
        assert vllm_exchange.GUARDS[name] == "nixl_connector"
        guard = vllm_exchange.guard_connector(nixl.connector(name, nixl.pull), OURS, "miss")
        assert isinstance(guard, nixl_connector.NixlGuard)


def test_nixl_sends_this_engines_stamp_and_old_peers_still_decode_it(nixl: Any) -> None:
    connector = nixl.connector("NixlPullConnector", nixl.pull)
    nixl_connector.guard(connector, OURS, "miss")
    payload = connector.get_handshake_metadata()
    sent = nixl.msgspec.msgpack.Decoder(nixl.base_worker.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    assert Stamp.from_json(sent.kvpolicy_fingerprint) == OURS
    old = nixl.msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    assert old == NixlAgentMetadata("ours", b"agent", 16)  # a peer without kvpolicy ignores the field
    assert connector.get_handshake_metadata().agent_metadata_bytes == payload.agent_metadata_bytes  # once


@pytest.mark.parametrize("worker", ["pull", "push"])
def test_nixl_refuses_a_peer_of_another_kv_cache_dtype_naming_it(nixl: Any, worker: str) -> None:
    connector = nixl.connector("NixlPullConnector", getattr(nixl, worker))
    nixl_connector.guard(connector, OURS, "miss")
    for method in (connector.connector_worker._validate_remote_agent_handshake,
                   connector.connector_worker._add_notif_only_remote_agent):
        with pytest.raises(InputError) as info:
            method(nixl.peer(FP8, "p1"), 1)
        code, message, _ = _error(info)
        assert code == "layout-mismatch"
        assert "peer engine `p1`" in message and "kv_cache_dtype: ours bfloat16, theirs fp8_e4m3" in message


@pytest.mark.parametrize("peer", ["BLOCK32", "HEADS2"])
def test_nixl_leaves_what_it_reconciles_itself_to_vllm(nixl: Any, peer: str) -> None:
    """A prefill and a decode instance of other tensor-parallel sizes (heads per rank) or block sizes: vLLM's
    NIXL pairs them itself (tp_ratio, block_size_ratio) and checks the regions' lengths, so kvpolicy passes
    the handshake on to vLLM's own check instead of refusing a pairing vLLM supports."""
    connector = nixl.connector("NixlPullConnector", nixl.pull)
    nixl_connector.guard(connector, OURS, "miss")
    with pytest.raises(Reached):
        connector.connector_worker._validate_remote_agent_handshake(nixl.peer(globals()[peer], "p1"), 1)


def test_nixl_refuses_a_peer_it_would_have_to_transcode(nixl: Any) -> None:
    connector = nixl.connector("NixlPullConnector", nixl.pull)
    nixl_connector.guard(connector, OURS, "miss")
    with pytest.raises(InputError) as info:
        connector.connector_worker._validate_remote_agent_handshake(nixl.peer(HND), 1)
    code, message, _ = _error(info)
    assert code == "layout-mismatch" and "transcode" in message and "cannot transcode" in message
    assert "head_order: ours NHD, theirs HND" in message


def test_nixl_passes_a_peer_with_our_bytes_to_vllms_checks(nixl: Any) -> None:
    connector = nixl.connector("NixlPushConnector", nixl.push)
    nixl_connector.guard(connector, OURS, "miss")
    for stamp in (OURS, FLASH):  # FLASH_ATTN's blocks are TRITON_ATTN's byte for byte
        with pytest.raises(Reached, match="validate"):
            connector.connector_worker._validate_remote_agent_handshake(nixl.peer(stamp), 1)
        with pytest.raises(Reached, match="notif"):
            connector.connector_worker._add_notif_only_remote_agent(nixl.peer(stamp), 1)
    assert nixl.push.calls == 2  # the push worker's override ran, and through it the checked base method


def test_nixl_unstamped_peer_is_refused_under_miss(nixl: Any) -> None:
    connector = nixl.connector("NixlPullConnector", nixl.pull)
    nixl_connector.guard(connector, OURS, "miss")
    with pytest.raises(InputError) as info:
        connector.connector_worker._validate_remote_agent_handshake(nixl.peer(None, "old"), 1)
    code, message, help = _error(info)
    assert code == "unstamped-peer" and "`old` sent no kvpolicy stamp" in message
    assert f"{ENV_UNSTAMPED}=accept" in help


def test_nixl_unstamped_peer_is_trusted_under_accept_said_once(nixl: Any, caplog: pytest.LogCaptureFixture) -> None:
    connector = nixl.connector("NixlPullConnector", nixl.pull)
    nixl_connector.guard(connector, OURS, "accept")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        for _ in range(2):
            with pytest.raises(Reached):
                connector.connector_worker._validate_remote_agent_handshake(nixl.peer(None, "old"), 1)
    lines = [r.getMessage() for r in caplog.records if "old" in r.getMessage()]
    assert len(lines) == 1 and f"{ENV_UNSTAMPED}=accept" in lines[0]
    with pytest.raises(InputError):  # a stamped peer of another layout is still refused
        connector.connector_worker._validate_remote_agent_handshake(nixl.peer(FP8), 1)


def test_nixl_refuses_a_stamp_it_cannot_read(nixl: Any) -> None:
    connector = nixl.connector("NixlPullConnector", nixl.pull)
    nixl_connector.guard(connector, OURS, "miss")
    tampered = OURS.to_dict()
    tampered["fingerprint"]["block_size"] = 32  # the digest no longer matches
    for text in ("{not json", json.dumps(tampered)):
        with pytest.raises(InputError) as info:
            connector.connector_worker._validate_remote_agent_handshake(nixl.peer(text), 1)
        assert _error(info)[0] == "stamp-format"


def test_nixl_patches_once_and_unguard_restores_vllm(nixl: Any) -> None:
    original_validate = nixl.base.__dict__["_validate_remote_agent_handshake"]
    for _ in range(3):
        nixl_connector.guard(nixl.connector("NixlPushConnector", nixl.push), OURS, "miss")
    assert len(nixl_connector._patches) == 4  # the class, the base's two methods, the push override
    assert nixl.base_worker.NixlAgentMetadata is not NixlAgentMetadata
    nixl_connector.unguard()
    assert nixl.base_worker.NixlAgentMetadata is NixlAgentMetadata
    assert nixl.base.__dict__["_validate_remote_agent_handshake"] is original_validate
    assert not getattr(nixl.push.__dict__["_validate_remote_agent_handshake"], "__kvpolicy__", False)


def test_nixl_without_the_worker_symbols_warns_that_it_is_not_guarded(
        nixl: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delattr(nixl.base, "_validate_remote_agent_handshake")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert nixl_connector.guard(nixl.connector("NixlPullConnector", nixl.pull), OURS, "miss") is None
        assert nixl_connector.guard(nixl.connector("NixlPullConnector", nixl.pull), OURS, "miss") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "this release's NIXL is not guarded" in lines[0]
    assert "_validate_remote_agent_handshake" in lines[0]
    assert nixl.base_worker.NixlAgentMetadata is NixlAgentMetadata  # nothing patched


# ---------------------------------------------------------------- OffloadingConnector


class FileMapper:  # vLLM's (0.28 on), cut to what names a store
    def __init__(self, root_dir: str, model_name: str, tokens_per_hash: int, dtype: str = "bfloat16") -> None:
        self.fields: dict = {"model_name": model_name, "tokens_per_hash": tokens_per_hash, "dtype": dtype}
        self.base_path: str = self._compute_base_path(root_dir, self.fields)

    def get_run_config(self) -> dict:
        return dict(self.fields)

    @staticmethod
    def _compute_base_path(root_dir: str, fields: dict) -> str:
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
        return f"{root_dir}/{fields['model_name'].replace('/', '_')}_{digest}"


@pytest.fixture
def offloading(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    cls = type("FileMapper", (FileMapper,), {"__init__": FileMapper.__init__})
    _module(monkeypatch, offloading_connector.FILE_MAPPER, FileMapper=cls)
    offloading_connector.unguard()
    offloading_connector._warned.clear()
    yield cls
    offloading_connector.unguard()
    offloading_connector._warned.clear()


def _offloading(role: str, extra: dict) -> Any:
    obj = type("OffloadingConnector", (), {})()
    obj._role = types.SimpleNamespace(name=role)
    obj._vllm_config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))
    obj.connector_scheduler = object() if role == "SCHEDULER" else None
    return obj


FS_TIER = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "fs", "root_dir": "/store"}]}


def test_file_mapper_paths_differ_per_fingerprint_and_agree_for_one(offloading: type) -> None:
    plain = offloading("/store", "Qwen/Qwen3", 16)
    offloading_connector.before_create({}, OURS)
    a1, a2 = offloading("/store", "Qwen/Qwen3", 16), offloading(root_dir="/store", model_name="Qwen/Qwen3",
                                                                 tokens_per_hash=16)
    offloading_connector.before_create({}, BLOCK32)
    b = offloading("/store", "Qwen/Qwen3", 16)
    assert a1.base_path == a2.base_path
    assert len({plain.base_path, a1.base_path, b.base_path}) == 3
    assert all(m.base_path.startswith("/store/Qwen_Qwen3_") for m in (a1, b))
    assert a1.get_run_config()["kvpolicy_fingerprint"] == block_digest(OURS.fingerprint)  # config.json, P2P's hash
    offloading_connector.unguard()
    assert offloading("/store", "Qwen/Qwen3", 16).base_path == plain.base_path


def test_offloading_guard_refuses_tiers_built_before_the_stamp(offloading: type) -> None:
    assert vllm_exchange.GUARDS["OffloadingConnector"] == "offloading_connector"
    with pytest.raises(InputError) as info:
        vllm_exchange.guard_connector(_offloading("SCHEDULER", FS_TIER), OURS, "miss")
    code, message, help = _error(info)
    assert code == "unstamped-store" and "fs" in message and "before_create" in help
    # with the stamp in place before vLLM built the connector (the factory hook's before-create step)
    offloading_connector.before_create(FS_TIER, OURS)
    assert isinstance(offloading_connector.guard(_offloading("SCHEDULER", FS_TIER), OURS, "miss"),
                      offloading_connector.OffloadingGuard)
    with pytest.raises(InputError):  # ... of another stamp than the connector's
        offloading_connector.guard(_offloading("SCHEDULER", FS_TIER), BLOCK32, "miss")


def test_offloading_guard_needs_nothing_where_blocks_stay_in_the_engine(offloading: type) -> None:
    for connector in (_offloading("SCHEDULER", {}), _offloading("SCHEDULER", {"spec_name": "TieringOffloadingSpec"}),
                      _offloading("WORKER", FS_TIER)):
        assert offloading_connector.guard(connector, OURS, "miss") is not None


def test_offloading_guard_says_accept_does_not_apply(offloading: type, caplog: pytest.LogCaptureFixture) -> None:
    offloading_connector.before_create(FS_TIER, OURS)
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        offloading_connector.guard(_offloading("SCHEDULER", FS_TIER), OURS, "accept")
    assert any(f"{ENV_UNSTAMPED}=accept does not apply" in r.getMessage() for r in caplog.records)


def test_offloading_without_file_mapper_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, offloading_connector.FILE_MAPPER, None)  # the import fails
    offloading_connector._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        for _ in range(2):
            assert offloading_connector.guard(_offloading("SCHEDULER", FS_TIER), OURS, "miss") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "not guarded" in lines[0] and "FileMapper" in lines[0]
    offloading_connector._warned.clear()


# ---------------------------------------------------------------- MooncakeStoreConnector


@dataclasses.dataclass
class KeyMetadata:  # vLLM's
    model_name: str
    tp_rank: int = 0
    cache_prefix: str = ""


def _store(extra: dict, prefix: str | None, role: str = "WORKER") -> Any:
    obj = type("MooncakeStoreConnector", (), {})()
    obj._role = types.SimpleNamespace(name=role)
    obj._vllm_config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))
    obj.connector_scheduler = None
    obj.connector_worker = None if role != "WORKER" else types.SimpleNamespace(
        token_dbs=[types.SimpleNamespace(metadata=KeyMetadata("m", cache_prefix=prefix))] if prefix is not None else [])
    return obj


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, mooncake_store_connector.STORE_WORKER, None)  # 0.24-0.33: no resolver
    mooncake_store_connector._warned.clear()
    yield
    mooncake_store_connector.unguard()
    mooncake_store_connector._warned.clear()


def test_mooncake_store_prefix_carries_the_namespace(store: None) -> None:
    tag = mooncake_store_connector.namespace(OURS)
    assert tag == "kvpolicy-" + block_digest(OURS.fingerprint).removeprefix("sha256:")[:20]
    for configured, expected in ((None, tag), ("", tag), ("team", f"{tag}-team"), ("auto", f"{tag}-auto"),
                                 (f"{tag}-team", f"{tag}-team")):
        extra = {} if configured is None else {"cache_prefix": configured}
        mooncake_store_connector.before_create(extra, OURS)
        assert extra["cache_prefix"] == expected
        mooncake_store_connector.before_create(extra, OURS)  # a second time changes nothing
        assert extra["cache_prefix"] == expected
    a, b = {"cache_prefix": "team"}, {"cache_prefix": "team"}
    mooncake_store_connector.before_create(a, OURS)
    mooncake_store_connector.before_create(b, BLOCK32)
    assert a != b


def test_mooncake_store_auto_prefix_is_namespaced_where_vllm_derives_it(monkeypatch: pytest.MonkeyPatch,
                                                                       store: None) -> None:
    def _resolve_cache_prefix(vllm_config: Any) -> str:  # 0.34's, cut down
        prefix = str(vllm_config.kv_transfer_config.kv_connector_extra_config.get("cache_prefix", ""))
        return "auto-1234" if prefix == "auto" else prefix

    module = _module(monkeypatch, mooncake_store_connector.STORE_WORKER, _resolve_cache_prefix=_resolve_cache_prefix)
    extra = {"cache_prefix": "auto"}
    mooncake_store_connector.before_create(extra, OURS)
    tag = mooncake_store_connector.namespace(OURS)
    assert extra == {"cache_prefix": "auto", mooncake_store_connector.MARK: tag}
    config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))
    assert module._resolve_cache_prefix(config) == f"{tag}-auto-1234"
    plain = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
        kv_connector_extra_config={"cache_prefix": "x"}))
    assert module._resolve_cache_prefix(plain) == "x"  # a connector not prepared keeps vLLM's answer
    mooncake_store_connector.unguard()
    assert module._resolve_cache_prefix is _resolve_cache_prefix


def test_mooncake_store_guard_checks_the_workers_keys(store: None) -> None:
    assert vllm_exchange.GUARDS["MooncakeStoreConnector"] == "mooncake_store_connector"
    tag = mooncake_store_connector.namespace(OURS)
    extra: dict = {"cache_prefix": "team"}
    mooncake_store_connector.before_create(extra, OURS)
    guard = vllm_exchange.guard_connector(_store(extra, extra["cache_prefix"]), OURS, "miss")
    assert isinstance(guard, mooncake_store_connector.MooncakeStoreGuard)
    for prefix in ("team", "", mooncake_store_connector.namespace(BLOCK32)):  # built unprepared, another stamp's
        with pytest.raises(InputError) as info:
            mooncake_store_connector.guard(_store({"cache_prefix": prefix}, prefix), OURS, "miss")
        code, message, help = _error(info)
        assert code == "unstamped-store" and f"cache_prefix `{prefix}`" in message and f"`{tag}`" in help
    # no key metadata to read: what vLLM read it from
    with pytest.raises(InputError):
        mooncake_store_connector.guard(_store({"cache_prefix": "team"}, None), OURS, "miss")
    assert mooncake_store_connector.guard(_store(extra, None), OURS, "miss") is not None
    # the scheduler makes no keys
    assert mooncake_store_connector.guard(_store({}, None, role="SCHEDULER"), OURS, "miss") is not None
