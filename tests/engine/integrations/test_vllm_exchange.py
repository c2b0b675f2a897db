"""The plugin's stamp on what KV connectors store (`vllm_exchange`) and ExampleConnector's guard, without vLLM.

`FakeExampleConnector` reproduces what the guard touches of vLLM's ExampleConnector (0.24-0.34,
``kv_connector/v1/example_connector.py``): ``_storage_path``, ``_block_size``, the folder named by a
hash of the prompt's whole blocks of its first n-1 tokens, and a lookup that asks whether the folder
exists. The real class is exercised between two real engines in ``tests/e2e/test_block_exchange.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from kvpolicy import LayoutEngine
from kvpolicy.engine.exchange import layer_view_digest
from kvpolicy.engine.integrations import vllm_exchange, vllm_plugin
from kvpolicy.engine.integrations.vllm_exchange import (
    ENV_UNSTAMPED,
    STAMP_FILE,
    Stamp,
    guard_connector,
    read_stamp,
    stamp_of,
    unstamped_policy,
)
from kvpolicy.policy.errors import InputError

MODEL = Path(__file__).resolve().parents[2] / "e2e" / "tiny-llama" / "config.json"
PROMPT = list(range(1, 71))  # 70 tokens: the whole blocks of the first 69 are 64 tokens at block 32 and 64


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """vLLM's own (example_connector.py): the guard finds it in the connector class's module."""
    return (num_tokens - 1) // block_size * block_size


class FakeExampleConnector:
    def __init__(self, storage: Path, block_size: int = 32) -> None:
        self._storage_path = str(storage)
        self._block_size = block_size

    def _generate_foldername_debug(self, token_ids, mm_hashes, create_folder=False) -> str:
        digest = hashlib.md5(str(token_ids.tolist()).encode()).hexdigest()  # vLLM hashes the int64 bytes
        folder = os.path.join(self._storage_path, digest)
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder

    def _found_match_for_prompt(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        import torch

        aligned = align_to_block_size(len(prompt_token_ids) - 1, self._block_size)
        return os.path.exists(self._generate_foldername_debug(torch.tensor(prompt_token_ids)[:aligned], mm_hashes))

    def store(self, prompt: list[int]) -> Path:
        """What ExampleConnector's save_kv_layer leaves: a folder with a file per layer."""
        import torch

        aligned = align_to_block_size(len(prompt) - 1, self._block_size)
        folder = Path(self._generate_foldername_debug(torch.tensor(prompt)[:aligned], [], create_folder=True))
        for layer in range(2):
            (folder / f"model.layers.{layer}.self_attn.attn.safetensors").write_bytes(b"kv")
        return folder


class ExampleConnector(FakeExampleConnector):
    """Named as vLLM's class: `guard_connector` picks the guard by the class name."""


def stamp(block_size: int = 32, cpu: str = "x86") -> Stamp:
    decision = LayoutEngine.default("0.32.0").decide(model=str(MODEL), attention_backend="CPU_ATTN",
                                                     block_size=block_size, cpu=cpu)
    return stamp_of(decision.fingerprint, "0.32.0")


def test_a_stamp_names_its_folder_and_round_trips() -> None:
    s = stamp()
    assert s.view_digest == layer_view_digest(s.fingerprint)
    assert s.namespace == "kvpolicy-" + s.view_digest.removeprefix("sha256:")[:20]
    again = Stamp.from_json(json.dumps(s.to_dict()))
    assert again == s


def test_equal_view_digests_across_releases_with_the_same_bytes() -> None:
    """vLLM 0.28 allocates a buffer per layer, 0.32 one buffer: the layer views hold the same bytes."""
    ours = LayoutEngine.default("0.28.0").decide(model=str(MODEL), attention_backend="CPU_ATTN", block_size=32,
                                                 cpu="x86").fingerprint
    theirs = stamp().fingerprint
    assert ours.digest != theirs.digest  # num_buffers differ
    assert layer_view_digest(ours) == layer_view_digest(theirs)


@pytest.mark.parametrize("change", [{"block_size": 64}, {"cpu": "x86+avx512+amx"}])
def test_what_changes_the_bytes_changes_the_folder(change: dict) -> None:
    assert stamp(**change).namespace != stamp().namespace


def test_a_changed_stamp_is_refused() -> None:
    data = stamp().to_dict()
    data["fingerprint"]["block_size"] = 64  # the digest still names block 32's view
    with pytest.raises(InputError, match="changed after it was written"):
        Stamp.from_json(json.dumps(data))


def test_the_guard_keeps_entries_in_the_stamps_folder(tmp_path: Path) -> None:
    conn = ExampleConnector(tmp_path)
    guard = guard_connector(conn, stamp(), "miss")
    assert Path(conn._storage_path) == tmp_path / stamp().namespace
    assert read_stamp(guard.folder) == stamp()
    assert not conn._found_match_for_prompt(PROMPT, [])
    conn.store(PROMPT)
    assert conn._found_match_for_prompt(PROMPT, [])  # an engine of the same stamp finds it
    other = ExampleConnector(tmp_path)
    guard_connector(other, stamp(), "miss")
    assert other._found_match_for_prompt(PROMPT, [])


def test_another_layouts_entries_are_a_miss_with_one_warning_naming_the_fields(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = ExampleConnector(tmp_path, block_size=32)
    guard_connector(writer, stamp(32), "miss")
    writer.store(PROMPT)
    reader = ExampleConnector(tmp_path, block_size=64)
    guard_connector(reader, stamp(64), "miss")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert not reader._found_match_for_prompt(PROMPT, [])
        assert not reader._found_match_for_prompt(PROMPT, [])
    (record,) = [r for r in caplog.records if "ExampleConnector" in r.getMessage()]
    message = record.getMessage()
    assert "block_size: ours 64, theirs 32" in message and "vLLM 0.32.0" in message
    assert str(tmp_path / stamp(32).namespace) in message


def test_another_kernel_orders_entries_are_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = ExampleConnector(tmp_path)
    guard_connector(writer, stamp(cpu="x86+avx512+amx"), "miss")
    writer.store(PROMPT)
    reader = ExampleConnector(tmp_path)
    guard_connector(reader, stamp(cpu="x86"), "miss")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert not reader._found_match_for_prompt(PROMPT, [])
    assert "kernel_order: ours vec, theirs amx" in caplog.text


def test_unstamped_entries_are_a_miss_by_default_and_taken_under_accept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plain = FakeExampleConnector(tmp_path)  # an engine without kvpolicy: the top of the store
    entry = plain.store(PROMPT)
    reader = ExampleConnector(tmp_path)
    guard_connector(reader, stamp(), "miss")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert not reader._found_match_for_prompt(PROMPT, [])
    assert f"{ENV_UNSTAMPED}=accept" in caplog.text and "no kvpolicy stamped" in caplog.text
    caplog.clear()
    trusting = ExampleConnector(tmp_path)
    guard = guard_connector(trusting, stamp(), "accept")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert trusting._found_match_for_prompt(PROMPT, [])
    linked = guard.folder / entry.name
    assert sorted(p.name for p in linked.iterdir()) == sorted(p.name for p in entry.iterdir())
    assert all(os.path.samefile(f, entry / f.name) for f in linked.iterdir())
    assert "taken as this engine's own" in caplog.text


def test_an_unreadable_stamp_is_reported_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = ExampleConnector(tmp_path)
    guard = guard_connector(writer, stamp(64), "miss")
    writer.store(PROMPT)
    (guard.folder / STAMP_FILE).write_text('{"format": 1, "digest": "sha256:00", "fingerprint": {}}')
    reader = ExampleConnector(tmp_path)
    guard_connector(reader, stamp(), "miss")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert not reader._found_match_for_prompt(PROMPT, [])
    assert "is not a kvpolicy stamp" in caplog.text


def test_a_folder_named_for_our_stamp_holding_another_stops_start_up(tmp_path: Path) -> None:
    folder = tmp_path / stamp().namespace
    folder.mkdir()
    (folder / STAMP_FILE).write_text(json.dumps(stamp(64).to_dict()))
    with pytest.raises(InputError) as err:
        guard_connector(ExampleConnector(tmp_path), stamp(), "miss")
    assert err.value.diagnostics[0].code == "stamp-mismatch"


def test_a_connector_without_a_guard_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    class SomeThirdPartyConnector:
        pass

    vllm_exchange._warned.discard("SomeThirdPartyConnector")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert guard_connector(SomeThirdPartyConnector(), stamp()) is None
        guard_connector(SomeThirdPartyConnector(), stamp())
    assert caplog.text.count("SomeThirdPartyConnector: the blocks this connector moves are not checked") == 1


def test_a_multiconnectors_members_are_guarded(tmp_path: Path) -> None:
    class MultiConnector:
        def __init__(self) -> None:
            self._connectors = [ExampleConnector(tmp_path / "a"), ExampleConnector(tmp_path / "b")]

    multi = MultiConnector()
    guards = guard_connector(multi, stamp())
    assert [g.folder for g in guards] == [tmp_path / x / stamp().namespace for x in "ab"]


@pytest.mark.parametrize(("value", "policy"), [(None, "miss"), ("", "miss"), ("miss", "miss"), ("ACCEPT", "accept")])
def test_the_unstamped_setting(value: str | None, policy: str) -> None:
    assert unstamped_policy({} if value is None else {ENV_UNSTAMPED: value}) == policy


def test_a_wrong_unstamped_setting_stops_the_plugin_located() -> None:
    with pytest.raises(vllm_plugin.PluginError) as err:
        vllm_plugin.Settings.from_env({"KVPOLICY_RULES": "shipped", ENV_UNSTAMPED: "maybe"})
    (diagnostic,) = err.value.diagnostics
    assert diagnostic.file == ENV_UNSTAMPED and "`maybe`" in diagnostic.message and "accept" in diagnostic.help


def test_before_create_reaches_a_multiconnectors_members() -> None:
    """A store's namespace must be set before vLLM builds the connector (MooncakeStoreConnector reads
    ``cache_prefix`` in its constructor); inside a MultiConnector, in the member's own extra config."""
    from types import SimpleNamespace

    ktc = SimpleNamespace(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [
        {"kv_connector": "ExampleConnector"},
        {"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {"cache_prefix": "site"}}]})
    vllm_exchange.before_create(ktc, stamp())
    members = ktc.kv_connector_extra_config["connectors"]
    assert members[0]["kv_connector_extra_config"] == {}  # ExampleConnector settles nothing before
    prefix = members[1]["kv_connector_extra_config"]["cache_prefix"]
    assert prefix.startswith("kvpolicy-") and prefix.endswith("-site"), prefix


# ---------------------------------------------------------------- another tenant of the store (hostile pass)


def test_a_fifo_named_stamp_json_never_blocks_the_lookup(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    other = tmp_path / "kvpolicy-00000000000000000000"
    reader = ExampleConnector(tmp_path)
    guard_connector(reader, stamp(), "miss")
    entry = reader.store(PROMPT).name
    (other / entry).mkdir(parents=True)
    os.mkfifo(other / STAMP_FILE)
    fresh = ExampleConnector(tmp_path, block_size=64)
    guard_connector(fresh, stamp(64), "miss")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert not fresh._found_match_for_prompt(PROMPT, [])  # returns: the FIFO is never opened for reading
    assert "is not a regular file" in caplog.text


def test_nothing_in_the_store_makes_the_lookup_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A folder this engine may not look into (an unprivileged engine and another tenant's mode 000
    folder): a miss, said, never an exception in vLLM's scheduler."""
    (tmp_path / "kvpolicy-00000000000000000000").mkdir()
    reader = ExampleConnector(tmp_path)
    guard_connector(reader, stamp(), "miss")
    real = Path.is_dir

    def denied(self: Path) -> bool:
        if "kvpolicy-0000" in str(self):
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "is_dir", denied)
    assert not reader._found_match_for_prompt(PROMPT, [])
    reader = ExampleConnector(tmp_path)
    monkeypatch.setattr(Path, "is_dir", real)
    guard = guard_connector(reader, stamp(), "miss")
    guard._folder_of = lambda *a, **k: 1 / 0
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert not guard.found_match_for_prompt(PROMPT, [])
    assert "ZeroDivisionError" in caplog.text and "a miss" in caplog.text


def test_accept_takes_only_a_real_folder_of_regular_files(tmp_path: Path) -> None:
    store = tmp_path / "store"
    plain = FakeExampleConnector(store)
    entry = plain.store(PROMPT)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not kv")
    shutil.rmtree(entry)
    entry.symlink_to(outside)  # an unstamped "entry" pointing out of the store
    trusting = ExampleConnector(store)
    guard = guard_connector(trusting, stamp(), "accept")
    assert not trusting._found_match_for_prompt(PROMPT, [])
    assert not (guard.folder / entry.name).exists() and list(guard.folder.glob(".adopting-*")) == []
    entry.unlink()
    entry.mkdir()
    (entry / "model.layers.0.self_attn.attn.safetensors").symlink_to(outside / "secret")
    assert not trusting._found_match_for_prompt(PROMPT, [])
    assert not (guard.folder / entry.name).exists()  # nothing half taken: no empty folder that reads as a hit


def test_a_stamp_folder_made_a_link_by_another_tenant_stops_start_up(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / stamp().namespace).symlink_to(elsewhere)
    with pytest.raises(InputError) as err:
        guard_connector(ExampleConnector(tmp_path / "store"), stamp(), "miss")
    assert err.value.diagnostics[0].code == "stamp-mismatch" and "symbolic link" in err.value.diagnostics[0].message
    assert list(elsewhere.iterdir()) == []


def test_a_store_that_cannot_be_written_stops_start_up_located(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("a file, not a folder")
    with pytest.raises(InputError) as err:
        guard_connector(ExampleConnector(tmp_path / "store"), stamp(), "miss")
    (d,) = err.value.diagnostics
    assert d.code == "store-unwritable" and d.file.endswith("shared_storage_path")


def test_what_another_tenant_wrote_reaches_the_log_escaped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = ExampleConnector(tmp_path)
    guard = guard_connector(writer, stamp(32), "miss")
    writer.store(PROMPT)
    data = stamp(32).to_dict()
    data["vllm_version"] = "0.32.0\nkvpolicy: FORGED LINE \x1b[2J" + "x" * 5000
    (guard.folder / STAMP_FILE).write_text(json.dumps(data))
    reader = ExampleConnector(tmp_path, block_size=64)
    guard_connector(reader, stamp(64), "miss")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        assert not reader._found_match_for_prompt(PROMPT, [])
    (message,) = [r.getMessage() for r in caplog.records if "ExampleConnector" in r.getMessage()]
    assert "\n" not in message and "\x1b" not in message and len(message) < 3000


def test_the_plugin_log_shows_what_a_peer_wrote_escaped(caplog: pytest.LogCaptureFixture) -> None:
    # a hostile tenant's folder name or stamp string reaches vLLM's log as text, never as a terminal command
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        logging.getLogger("vllm.kvpolicy").warning("kvpolicy: store %s, %s", "/s/\x1b[2J", "by vLLM 0.3\x07\u202e")
    (record,) = caplog.records
    assert record.getMessage() == "kvpolicy: store /s/\\x1b[2J, by vLLM 0.3\\x07\\u202e"
