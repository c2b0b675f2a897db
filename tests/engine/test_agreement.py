"""Peer compatibility and rank agreement, the latter in real multi-process gloo worlds on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvpolicy.engine import LayoutEngine, shipped_rules_dir
from kvpolicy.engine.agreement import (
    AgreementError,
    CompatibilityResult,
    LayoutMismatchError,
    RankFingerprint,
    agree,
    check_compatible,
    compare_ranks,
    require_compatible,
)
from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint
from kvpolicy.policy import InputError, PolicyError

ROOT = Path(__file__).resolve().parents[2]
ENGINE = LayoutEngine.default()
QWEN = {"num_layers": 24, "block_size": 16, "num_kv_heads": 2, "head_size": 64}
# The shipped rules choose BLNHC for this input.
CROSS = {"spec": QWEN, "backend": "TRITON_ATTN", "connector": "OffloadingConnector"}


def fp_for(**overrides: Any) -> LayoutFingerprint:
    return fingerprint(ENGINE.decide(**{**CROSS, **overrides}))


# ---------------------------------------------------------------- check_compatible


def test_identical_fingerprints_are_compatible_in_every_form() -> None:
    a = fp_for()
    for remote in (a, a.to_dict(), a.to_json(), a.to_json().encode(), ENGINE.decide(**CROSS)):
        result = check_compatible(a, remote)
        assert result.ok and bool(result) and result.differences == () and result.messages == []


def test_differences_name_the_field_and_both_values() -> None:
    local = fp_for(connector="NixlConnector", connector_config={"enable_cross_layers_blocks": "true"})
    remote = fp_for(connector="NixlConnector")
    result = check_compatible(local, remote.to_json())
    assert not result.ok
    assert result.messages[0] == "placement: local cross_layer, remote per_layer"
    assert {d.field for d in result.differences} == {"placement", "physical_dims", "physical_shape", "num_buffers"}
    messages = check_compatible(local, fp_for(), local_name="prefill", remote_name="decode").messages  # vs NHD
    assert "head_order: prefill HND, decode NHD" in messages


def test_group_differences_are_reported_per_group_field() -> None:
    result = check_compatible(fp_for(), fp_for(spec={**QWEN, "page_size_padded": 16384}))
    assert result.messages == ["page_bytes: local 8192, remote 16384",
                               "groups[0].page_bytes: local 8192, remote 16384"]


def test_a_format_version_mismatch_is_reported_as_such() -> None:
    future = {**fp_for().to_dict(), "format_version": 3, "new_field": "x"}
    result = check_compatible(fp_for(), future)
    assert not result.ok and result.format_mismatch
    assert result.messages == ["format_version: local 2, remote 3"]
    with pytest.raises(LayoutMismatchError, match="run one kvpolicy version"):
        require_compatible(fp_for(), future)


def test_what_is_not_a_fingerprint_is_an_input_error() -> None:
    with pytest.raises(InputError, match="not JSON"):
        check_compatible(fp_for(), "{nope")
    with pytest.raises(InputError, match="got int"):
        check_compatible(fp_for(), 3)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="missing `page_bytes`"):
        check_compatible(fp_for(), {k: v for k, v in fp_for().to_dict().items() if k != "page_bytes"})


def test_require_compatible_raises_a_policy_error_with_every_field() -> None:
    local, remote = fp_for(), fp_for(kv_cache_dtype="fp8")
    assert require_compatible(local, local.to_dict()) == local
    with pytest.raises(LayoutMismatchError) as info:
        require_compatible(local, remote.to_json(), remote_name="decode-0")
    err = info.value
    assert isinstance(err, PolicyError) and isinstance(err, AgreementError)
    text = str(err)
    expected = check_compatible(local, remote, remote_name="decode-0").messages
    assert len(expected) == 6
    for line in expected:
        assert line in text
    assert "decode-0: error[layout-mismatch]: 6 fields differ from local" in text
    assert "kv_cache_dtype: local bfloat16, decode-0 fp8_e4m3" in text
    (diag,) = err.diagnostics
    assert (diag.file, diag.line, diag.col) == ("decode-0", 0, 0)  # the peer, not a place in a file
    with pytest.raises(LayoutMismatchError, match=r"decode-0: error\[layout-mismatch\]: 1 field differs from local"):
        require_compatible(local, {**local.to_dict(), "block_size": 32}, remote_name="decode-0")
    with pytest.raises(LayoutMismatchError, match=r"2 fields differ from local"):
        require_compatible(local, {**local.to_dict(), "block_size": 32, "page_bytes": 1})


def test_a_differing_mapping_is_shown_with_sorted_keys() -> None:
    """Both ranks print the same text for the same value, whatever order a peer's JSON had."""
    from kvpolicy.engine.agreement import Difference

    shown = str(Difference("x", {"b": 1, "a": 2}, {"a": 2, "c": 1}))
    assert shown == 'x: local {"a":2,"b":1}, remote {"a":2,"c":1}'


def test_compatibility_result_to_dict() -> None:
    result = check_compatible(fp_for(), fp_for(spec={**QWEN, "block_size": 32}))
    assert isinstance(result, CompatibilityResult)
    d = result.to_dict()
    assert d["ok"] is False and "block_size: local 16, remote 32" in d["differences"]


# ---------------------------------------------------------------- compare_ranks (the pure half of agree)


def ranks_of(*fps: LayoutFingerprint, digests: tuple[str, ...] = ()) -> list[RankFingerprint]:
    return [RankFingerprint(i, i, f.to_dict(), digests[i] if digests else None) for i, f in enumerate(fps)]


@pytest.mark.parametrize("ranks", ["ab", b"ab", 3, None, {"0": 1}, [{"fingerprint": {}}], [None]])
def test_compare_ranks_refuses_what_is_not_a_list_of_rank_fingerprints(ranks) -> None:
    with pytest.raises(InputError, match="must be a sequence of RankFingerprint"):
        compare_ranks(ranks)


def test_compare_ranks_refuses_bad_rank_numbers_duplicates_and_garbage() -> None:
    """Found by a hostile pass: a str rank crashed the sort, a duplicate rank was compared with
    itself, and two garbage dicts were reported as a format_version mismatch of null and null."""
    a, b = fp_for().to_dict(), fp_for(kv_cache_dtype="fp8").to_dict()
    with pytest.raises(InputError, match="rank numbers must be ints"):
        compare_ranks([RankFingerprint("a", "a", a), RankFingerprint(1, 1, b)])
    with pytest.raises(InputError, match="rank numbers must be ints") as info:
        compare_ranks([RankFingerprint(0, None, a), RankFingerprint(1, 1, b)])
    assert "help: build RankFingerprint(rank, group_rank, ...) from ints" in str(info.value)
    with pytest.raises(InputError, match="group rank 0 appears twice"):
        compare_ranks([RankFingerprint(0, 0, a), RankFingerprint(0, 0, b)])
    with pytest.raises(InputError, match="rank 0 sent something that is not a layout fingerprint"):
        compare_ranks([RankFingerprint(0, 0, {"a": 1}), RankFingerprint(1, 1, {"b": [1, 2]})])
    with pytest.raises(InputError, match="rank 1 sent something that is not a layout fingerprint: unknown `x`"):
        compare_ranks([RankFingerprint(0, 0, a), RankFingerprint(1, 1, {**a, "x": 1})])


def test_compare_ranks_takes_any_iterable_of_rank_fingerprints() -> None:
    a = fp_for()
    assert compare_ranks(iter(ranks_of(a, a))) == a
    assert compare_ranks(tuple(ranks_of(a))) == a


def test_compare_ranks_names_the_odd_rank_against_the_majority() -> None:
    a, b = fp_for(), fp_for(kv_cache_dtype="fp8")
    assert compare_ranks(ranks_of(a, a, a)) == a
    with pytest.raises(LayoutMismatchError) as info:
        compare_ranks(ranks_of(b, a, a, a))  # rank 0 is the odd one
    text = str(info.value)
    assert "rank 1, rank 2, rank 3 agree; rank 0 differs from rank 1" in text
    assert "rank 0: error[layout-mismatch]" in text and "quant_mode: rank 1 none, rank 0 fp8_per_tensor" in text
    with pytest.raises(LayoutMismatchError, match="rank 0 agree; rank 1 differs from rank 0"):
        compare_ranks(ranks_of(a, b))  # a tie goes to the lowest rank


def test_compare_ranks_notes_different_rule_sets_and_group_ranks() -> None:
    a, b = fp_for(), fp_for(block_size=32)
    ranks = [RankFingerprint(4, 0, a.to_dict(), "sha256:aa"), RankFingerprint(5, 1, b.to_dict(), "sha256:bb")]
    with pytest.raises(LayoutMismatchError) as info:
        compare_ranks(ranks)
    text = str(info.value)
    assert "rank 5 (group rank 1): error[different-rules]" in text
    assert "block_size: rank 4 (group rank 0) 16, rank 5 (group rank 1) 32" in text


# ---------------------------------------------------------------- agree, single process


def test_agree_without_a_process_group_is_a_world_of_one() -> None:
    decision = ENGINE.decide(**CROSS)
    assert agree(decision) == fingerprint(decision)
    assert agree(fingerprint(decision)) == fingerprint(decision)
    with pytest.raises(AgreementError, match=r"torch\.distributed is not initialised"):
        agree(decision, group=object())


# ---------------------------------------------------------------- agree, real gloo worlds

WORKER = r'''
import datetime, json, os, sys, time
from pathlib import Path

rank, world = int(sys.argv[1]), int(sys.argv[2])
work = Path(sys.argv[3])
scenarios = json.loads((work / "scenarios.json").read_text())


class NoNumpy:
    """numpy is not a dependency: a fresh venv has none, so agree() must not need it."""

    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


if os.environ.get("KVPOLICY_TEST_BLOCK_NUMPY"):
    assert "numpy" not in sys.modules
    sys.meta_path.insert(0, NoNumpy())

import struct
import torch
import torch.distributed as dist
from kvpolicy.engine import LayoutEngine
from kvpolicy.engine import agreement, agreement_wire
from kvpolicy.engine.agreement import AgreementError, agree

encode = agreement._encode
honest_transport = agreement_wire._point_to_point
HEADER = struct.Struct(">8sHII")
previous = {}  # peer -> the frame this rank sent it last


def remembered(data, peer):
    previous[peer] = data
    return data


def hostile(kind, arg):
    """What a hostile (or broken) rank sends each peer instead of its frame, after the barrier."""

    def out(data, peer):
        replayed = previous.get(peer, data)
        previous[peer] = data
        if kind == "replay":  # the frame it sent this peer in the previous agreement, again
            return replayed
        magic, version, number, n = HEADER.unpack_from(data)
        payload = data[HEADER.size:]
        head = lambda **kw: HEADER.pack(kw.get("magic", magic), kw.get("version", version),  # noqa: E731
                                        kw.get("number", number), kw.get("n", n))
        if kind == "short":  # announces its payload, sends 100 bytes less
            return data[:-100]
        if kind == "long":  # sends 100 bytes past what it announced
            return data + b"x" * 100
        if kind == "two-sizes":  # one size to rank 0, another to rank 1
            return data[:-100] if peer == 0 else data + b"y" * 100
        if kind == "announce-huge":
            return head(n=2**31) + payload
        if kind == "garbage":
            return b"\x80\x04\x95 not a frame {{" * 10
        if kind == "not-a-fingerprint":  # a well-formed frame of valid JSON that is no rank fingerprint
            other = b'{"hello":[1,2,{"x":null}]}'
            return head(n=len(other)) + other
        if kind == "old-protocol":
            return head(version=1)
        if kind == "wrong-number":
            return head(number=number + 5) + payload
        if kind == "stall":  # passed the barrier, then hangs before sending (once, not per peer)
            time.sleep(arg if peer == 0 else 0)
            return data
        if kind == "exit":  # passed the barrier, then its process exits
            os._exit(0)
        raise AssertionError(kind)

    return out

dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=30))
results = {}
for sc in scenarios:
    if rank in sc.get("skip", []):
        results[sc["name"]] = {"skipped": True}
        continue
    rules = sc.get("rules", {}).get(str(rank))
    engine = LayoutEngine.from_path(rules) if rules else LayoutEngine.default()
    decision = engine.decide(**sc["inputs"].get(str(rank), sc["inputs"]["*"]))
    sent = sc.get("send", {}).get(str(rank))  # this rank plays a hostile peer: it sends these bytes
    agreement._encode = encode if sent is None else (lambda _r, sent=sent: sent.encode("latin-1"))
    wire = sc.get("wire", {}).get(str(rank))  # [kind, arg]: this rank breaks the protocol after the barrier
    agreement_wire._outgoing = remembered if wire is None else hostile(*wire)
    gather = sc.get("transport") == "all_gather"  # the fixed-frame all_gather of non-gloo backends, on gloo
    agreement_wire._point_to_point = (lambda _d, _g: False) if gather else honest_transport
    start = time.monotonic()
    try:
        agreed = agree(decision, timeout_s=sc.get("timeout_s", 30))
        results[sc["name"]] = {"ok": True, "digest": agreed.digest}
    except AgreementError as exc:
        results[sc["name"]] = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
    results[sc["name"]]["seconds"] = time.monotonic() - start
results["numpy_imported"] = "numpy" in sys.modules
(work / f"rank{rank}.json").write_text(json.dumps(results))
if any(rank in sc.get("skip", []) or str(rank) in sc.get("wire", {}) for sc in scenarios):
    # stay in the world until rank 0 has reported, so its timeout is a timeout and not a closed socket
    deadline = time.monotonic() + 20
    while not (work / "rank0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
dist.destroy_process_group()
'''


def run_world(tmp_path: Path, world: int, scenarios: list[dict[str, Any]], deadline_s: float = 60.0,
              block_numpy: bool = False) -> list[dict[str, Any]]:
    """Run ``world`` gloo ranks over the scenarios; kill them all if they outlive ``deadline_s``."""
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "scenarios.json").write_text(json.dumps(scenarios))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if block_numpy:
        env["KVPOLICY_TEST_BLOCK_NUMPY"] = "1"
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(r), str(world), str(tmp_path)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    end = time.monotonic() + deadline_s
    try:
        outputs = [p.communicate(timeout=max(0.1, end - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        pytest.fail(f"the {world}-rank world did not finish in {deadline_s} s:\n" + "\n---\n".join(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out}"
    gone = {int(r) for sc in scenarios for r, (kind, _) in sc.get("wire", {}).items() if kind == "exit"}
    return [{} if r in gone else json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def rules_dir(tmp_path: Path, name: str, extra_rule: str) -> str:
    """The shipped rules plus one more global file."""
    path = tmp_path / name
    shutil.copytree(shipped_rules_dir(), path)
    (path / "zz-extra.yaml").write_text("version: 1\nrules:\n" + extra_rule)
    return str(path)


FORBID_CROSS = ("  - id: site-forbids-cross-layer\n    description: this site keeps per-layer buffers\n"
                "    forbid: {placement: cross_layer}\n")
HARMLESS = ("  - id: site-harmless\n    description: matches nothing here\n"
            "    when: {field: kv.block_size, eq: 12345}\n    forbid: {placement: cross_layer}\n")


def test_two_ranks_agree_disagree_and_time_out(tmp_path: Path) -> None:
    scenarios = [
        {"name": "same", "inputs": {"*": CROSS}},
        {"name": "dtype", "inputs": {"*": CROSS, "1": {**CROSS, "kv_cache_dtype": "fp8_per_token_head"}}},
        {"name": "group-timeout", "inputs": {"*": CROSS}, "timeout_s": None},  # no barrier: the group's timeout
        {"name": "absent", "inputs": {"*": CROSS}, "skip": [1], "timeout_s": 2},
    ]
    r0, r1 = run_world(tmp_path, 2, scenarios)
    expected = fingerprint(ENGINE.decide(**CROSS)).digest
    assert r0["same"]["ok"] and r1["same"]["ok"]
    assert r0["group-timeout"]["ok"] and r1["group-timeout"]["digest"] == expected
    assert r0["same"]["digest"] == r1["same"]["digest"] == expected
    for r in (r0, r1):  # the mismatch is raised on every rank, with the same text
        assert r["dtype"]["error"] == "LayoutMismatchError"
        assert "rank 1 differs from rank 0" in r["dtype"]["message"]
        assert "rank 1: error[layout-mismatch]" in r["dtype"]["message"]
        assert "kv_cache_dtype: rank 0 bfloat16, rank 1 fp8_per_token_head" in r["dtype"]["message"]
        assert "placement: rank 0 cross_layer, rank 1 per_layer" in r["dtype"]["message"]
    assert r0["dtype"]["message"] == r1["dtype"]["message"]
    assert r1["absent"] == {"skipped": True}
    assert r0["absent"]["error"] == "AgreementError"
    assert "agreement-timeout" in r0["absent"]["message"] and "within 2 s" in r0["absent"]["message"]
    assert r0["absent"]["seconds"] < 15


def test_four_ranks_one_odd_rule_set_or_dtype(tmp_path: Path) -> None:
    no_cross = rules_dir(tmp_path, "rules-no-cross", FORBID_CROSS)
    alike = rules_dir(tmp_path, "rules-alike", HARMLESS)
    scenarios = [
        {"name": "same", "inputs": {"*": CROSS}},
        {"name": "rules", "inputs": {"*": CROSS}, "rules": {"1": no_cross}},
        {"name": "dtype", "inputs": {"*": CROSS, "3": {**CROSS, "kv_cache_dtype": "fp8"}}},
        {"name": "rules-alike", "inputs": {"*": CROSS}, "rules": {"2": alike}},
    ]
    results = run_world(tmp_path, 4, scenarios)
    expected = fingerprint(ENGINE.decide(**CROSS)).digest
    for r in results:
        assert r["same"] == {"ok": True, "digest": expected, "seconds": r["same"]["seconds"]}
        assert r["rules-alike"]["ok"] and r["rules-alike"]["digest"] == expected  # same layout, other rules
        rules = r["rules"]
        assert rules["error"] == "LayoutMismatchError"
        assert "rank 0, rank 2, rank 3 agree; rank 1 differs from rank 0" in rules["message"]
        assert "placement: rank 0 cross_layer, rank 1 per_layer" in rules["message"]
        assert "rank 1: error[different-rules]" in rules["message"]
        dtype = r["dtype"]
        assert dtype["error"] == "LayoutMismatchError"
        assert "rank 3 differs from rank 0" in dtype["message"]
        assert "kv_cache_dtype: rank 0 bfloat16, rank 3 fp8_e4m3" in dtype["message"]
    assert len({r["rules"]["message"] for r in results}) == 1
    assert len({r["dtype"]["message"] for r in results}) == 1


def test_ranks_agree_without_numpy_and_name_a_hostile_peer_on_every_rank(tmp_path: Path) -> None:
    """Three gloo ranks with numpy unimportable (a meta-path blocker in each child): agreement and
    disagreement work, and a rank that sends garbage, an oversized payload, JSON nested 30,000 deep
    or JSON that is not a rank fingerprint is named by the same `AgreementError` on every rank, with
    no rank unpickling, recursing or allocating what the peer asked for."""
    me = json.loads(agree_payload())
    scenarios = [
        {"name": "same", "inputs": {"*": CROSS}},
        {"name": "dtype", "inputs": {"*": CROSS, "2": {**CROSS, "kv_cache_dtype": "fp8"}}},
        {"name": "garbage", "inputs": {"*": CROSS}, "send": {"1": "\x80\x04\x95 not json {{"}},
        {"name": "oversized", "inputs": {"*": CROSS}, "send": {"2": "[" + " " * (2 << 20) + "]"}},
        {"name": "nested", "inputs": {"*": CROSS}, "send": {"1": "[" * 30_000 + "]" * 30_000}},  # fits a frame
        {"name": "not-a-rank", "inputs": {"*": CROSS}, "send": {"2": json.dumps({"rank": 2})}},
        {"name": "bad-fingerprint", "inputs": {"*": CROSS},
         "send": {"1": json.dumps({**me, "group_rank": 1, "fingerprint": {**me["fingerprint"], "num_layers": "x"}})}},
        {"name": "same-again", "inputs": {"*": CROSS}},
    ]
    results = run_world(tmp_path, 3, scenarios, block_numpy=True)
    expected = fingerprint(ENGINE.decide(**CROSS)).digest
    hostile = {"garbage": ("group rank 1", "not JSON"), "oversized": ("group rank 2", "announced 2097154 bytes"),
               "nested": ("group rank 1", "nests deeper than 16 levels"),
               "not-a-rank": ("group rank 2", "not a rank fingerprint"),
               "bad-fingerprint": ("group rank 1", "wrong type or value for `num_layers`")}
    for r in results:
        assert r["numpy_imported"] is False
        assert r["same"]["ok"] and r["same"]["digest"] == expected
        assert r["same-again"]["ok"] and r["same-again"]["digest"] == expected  # the world survived the hostile peers
        assert r["dtype"]["error"] == "LayoutMismatchError" and "rank 2 differs from rank 0" in r["dtype"]["message"]
        for name, (who, what) in hostile.items():
            assert r[name]["error"] == "AgreementError", (name, r[name])
            assert f"{who}: error[peer-data]" in r[name]["message"] and what in r[name]["message"], r[name]
    for name in ("dtype", *hostile):
        assert len({r[name]["message"] for r in results}) == 1, name


def agree_payload() -> str:
    """What rank 0 of a one-rank world of CROSS sends (the canonical JSON `agree` gathers)."""
    from kvpolicy.engine import agreement

    return agreement._encode(RankFingerprint(0, 0, fp_for().to_dict(), ENGINE.decide(**CROSS).ruleset.digest)).decode()


@pytest.mark.parametrize(("note", "remote", "what"), [
    ("a JSON array nested 100,000 deep", "[" * 100_000 + "]" * 100_000, "nests deeper than 16 levels"),
    ("an object nested 50,000 deep", '{"a":' * 50_000 + "1" + "}" * 50_000, "nests deeper than 16 levels"),
    ("nesting under the parser's limit", '{"format_version":' + "[" * 500 + "]" * 500 + "}", "nests deeper"),
    ("2 MiB of text", " " * (2 << 20), "more than the 1048576"),
    ("NaN", '{"format_version": NaN}', "`NaN` is not JSON"),
    ("a 5,000-digit integer", '{"format_version": ' + "9" * 5000 + "}", "not JSON"),
    ("a 1,300-digit integer", '{"format_version": ' + "9" * 1300 + "}", "an integer of"),
])
def test_a_peers_fingerprint_is_bounded_in_size_and_nesting(note: str, remote: str, what: str) -> None:
    """A peer controls the fingerprint it sends: deep nesting was a RecursionError, now an InputError."""
    for form in (remote, remote.encode()):
        with pytest.raises(InputError, match="peer-data") as info:
            check_compatible(fp_for(), form, remote_name="decode-0")
        assert what in str(info.value) and "decode-0" in str(info.value)
    with pytest.raises(InputError, match="peer-data"):
        LayoutFingerprint.from_json(remote)


def test_a_deep_or_cyclic_dict_is_refused_without_recursion() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(100_000):
        node["a"] = {}
        node = node["a"]
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    for remote in ({"format_version": deep}, {**fp_for().to_dict(), "groups": cyclic},
                   {"format_version": 10**5000}, {**fp_for().to_dict(), "backend": "x" * (2 << 20)}):
        with pytest.raises(InputError, match="peer-data"):
            check_compatible(fp_for(), remote)
        with pytest.raises(InputError, match="peer-data"):
            compare_ranks([RankFingerprint(0, 0, fp_for().to_dict()), RankFingerprint(1, 1, remote)])


# ---------------------------------------------------------------- agree, peers that break the wire protocol

HONEST = ("0", "1")


def _honest(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [results[int(r)] for r in HONEST]


def test_a_rank_that_breaks_the_frames_is_named_and_the_world_survives(tmp_path: Path) -> None:
    """Three gloo ranks; rank 2 sends, after the barrier, frames shorter or longer than they announce, a
    different size to each peer, an impossible length, garbage, a frame of valid JSON that is no rank
    fingerprint, another protocol version, a wrong agreement number, and its previous frame again. Each time
    both honest ranks raise the same `AgreementError` naming group rank 2 and what it sent (these used
    to abort the honest ranks inside gloo), and the world still agrees afterwards, over point to point
    (gloo) and over the fixed-frame all_gather of other backends alike. About 6 s."""
    n = len(agree_payload())  # group rank 2's payload is as long as rank 0's
    bad = {
        "short": ("peer-data", f"announced {n} bytes of fingerprint and sent {n - 100}"),
        "long": ("peer-data", f"announced {n} bytes of fingerprint and sent {n + 100}, ending `xxxx"),
        "announce-huge": ("peer-data", "announced 2147483648 bytes of fingerprint; a frame holds at most 65518"),
        "garbage": ("peer-protocol", "sent 180 bytes starting `\\x80\\x04\\x95 not a frame {{"),
        "not-a-fingerprint": ("peer-data", 'sent `{"hello":[1,2,{"x":null}]}`, not a rank fingerprint'),
        "old-protocol": ("peer-protocol", "speaks agreement protocol 1, this rank 2"),
        "wrong-number": ("peer-protocol", "sent the frame of agreement 13 on this group during agreement 8"),
    }
    scenarios: list[dict[str, Any]] = [{"name": "same", "inputs": {"*": CROSS}}]
    scenarios += [{"name": kind, "inputs": {"*": CROSS}, "wire": {"2": [kind, None]}} for kind in bad]
    scenarios += [
        {"name": "two-sizes", "inputs": {"*": CROSS}, "wire": {"2": ["two-sizes", None]}},
        {"name": "same-again", "inputs": {"*": CROSS}},
        {"name": "replay", "inputs": {"*": CROSS}, "wire": {"2": ["replay", None]}},
        {"name": "gather", "inputs": {"*": CROSS}, "transport": "all_gather"},
        {"name": "gather-long", "inputs": {"*": CROSS}, "transport": "all_gather", "wire": {"2": ["long", None]}},
        {"name": "gather-garbage", "inputs": {"*": CROSS}, "transport": "all_gather",
         "wire": {"2": ["garbage", None]}},
        {"name": "same-at-last", "inputs": {"*": CROSS}},
    ]
    results = run_world(tmp_path, 3, scenarios)
    expected = fingerprint(ENGINE.decide(**CROSS)).digest
    for r in results:
        for name in ("same", "same-again", "gather", "same-at-last"):
            assert r[name]["ok"] and r[name]["digest"] == expected, (name, r[name])
    for r in _honest(results):
        for name, (code, what) in bad.items():
            assert r[name]["error"] == "AgreementError", (name, r[name])
            assert f"group rank 2: error[{code}]: group rank 2 {what}" in r[name]["message"], (name, r[name])
            assert "could not be compared: group rank 2 sent no valid fingerprint" in r[name]["message"]
        assert f"announced {n} bytes of fingerprint and sent {n + 100}" in r["gather-long"]["message"]
        assert "group rank 2: error[peer-protocol]" in r["gather-garbage"]["message"]
        assert "group rank 2: error[peer-protocol]: group rank 2 sent the frame of agreement 10 on this group " \
               "during agreement 11" in r["replay"]["message"], r["replay"]
    r0, r1 = _honest(results)
    assert f"announced {n} bytes of fingerprint and sent {n - 100}" in r0["two-sizes"]["message"]
    assert f"announced {n} bytes of fingerprint and sent {n + 100}" in r1["two-sizes"]["message"]
    for name in bad:
        assert r0[name]["message"] == r1[name]["message"], name


def test_a_rank_that_stalls_after_the_barrier_is_named_within_the_timeout(tmp_path: Path) -> None:
    """Rank 2 reaches the barrier, then hangs for 3 s; with ``timeout_s=1`` both honest ranks raise an
    `AgreementError` naming it (it was a raw RuntimeError after the group's timeout), and rank 2,
    waking to closed connections, raises one too instead of crashing. About 8 s."""
    scenarios = [{"name": "same", "inputs": {"*": CROSS}},
                 {"name": "stall", "inputs": {"*": CROSS}, "wire": {"2": ["stall", 3]}, "timeout_s": 1}]
    results = run_world(tmp_path, 3, scenarios)
    for r in results:
        assert r["same"]["ok"]
    for r in _honest(results):
        assert r["stall"]["error"] == "AgreementError", r["stall"]
        assert "group rank 2: error[peer-timeout]: group rank 2 passed the barrier but sent no frame within 1 s" \
            in r["stall"]["message"], r["stall"]
    assert results[2]["stall"]["error"] == "AgreementError", results[2]["stall"]
    assert "group rank 0: error[peer-" in results[2]["stall"]["message"]


def test_a_rank_that_exits_after_the_barrier_is_named(tmp_path: Path) -> None:
    """Rank 2 reaches the barrier, then its process exits: both honest ranks raise an `AgreementError`
    naming it as lost, at once (not after the timeout). About 4 s."""
    scenarios = [{"name": "same", "inputs": {"*": CROSS}},
                 {"name": "exit", "inputs": {"*": CROSS}, "wire": {"2": ["exit", None]}, "timeout_s": 20}]
    results = run_world(tmp_path, 3, scenarios)
    assert results[2] == {}
    for r in _honest(results):
        assert r["same"]["ok"]
        assert r["exit"]["error"] == "AgreementError", r["exit"]
        assert "group rank 2: error[peer-lost]: group rank 2 was lost during the exchange" in r["exit"]["message"]
        assert "group rank 2: error[peer-timeout]" not in r["exit"]["message"]
