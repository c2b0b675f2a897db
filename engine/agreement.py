"""Layout agreement: between two transfer peers, and across the ranks of a process group.

A KV block written under one layout and read under another is silently
garbage (vLLM issue #48412 is one way to get there). Peers therefore compare
`LayoutFingerprint`s before exchanging blocks:

- `check_compatible(local, remote)` compares two fingerprints, in any form a
  handshake carries (the object, its dict, its JSON), and lists every field
  that differs; `require_compatible` raises `LayoutMismatchError` instead.
- `agree(decision, group)` sends every rank's fingerprint to every other
  rank over torch.distributed, in frames whose size no peer can change
  (`kvpolicy.engine.agreement_wire`), and raises on every rank, naming the
  ranks and fields, unless all are identical. torch is imported inside the
  function only.

Errors::

    PolicyError
     +-- InputError              a bad argument (``timeout_s`` NaN, infinite, not above 0, over a day)
     +-- AgreementError          ranks could not compare layouts: one never arrived, no process group, or a
     |                           peer sent no valid frame, stalled or died (one diagnostic per such rank:
     |                           peer-data, peer-protocol, peer-timeout, peer-lost)
          +-- LayoutMismatchError   fingerprints differ; one diagnostic per differing field
"""

from __future__ import annotations

import datetime
import json
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpolicy.engine.agreement_wire import Fault, exchange, frame, parse_frame
from kvpolicy.engine.decision import Decision
from kvpolicy.engine.fingerprint import FORMAT_VERSION, LayoutFingerprint, fingerprint
from kvpolicy.engine.peer_data import check_peer_value, load_peer_json
from kvpolicy.policy.errors import Diagnostic, InputError, PolicyError, input_error

__all__ = [
    "AgreementError",
    "CompatibilityResult",
    "Difference",
    "LayoutMismatchError",
    "RankFingerprint",
    "agree",
    "check_compatible",
    "compare_ranks",
    "require_compatible",
]

logger = logging.getLogger("kvpolicy")

FingerprintLike = LayoutFingerprint | Decision | dict[str, Any] | str | bytes

_FORMAT_HELP = "fingerprints of different formats cannot be compared field by field; run one kvpolicy version"
_MISMATCH_HELP = ("every peer must decide the same layout: use the same rules (or rules that decide alike), "
                  "kv_cache_dtype, block size, backend and model sharding")


class AgreementError(PolicyError):
    """Ranks or peers could not compare their layouts."""


class LayoutMismatchError(AgreementError):
    """Fingerprints differ; ``diagnostics`` has one entry per differing field (and rank)."""


_SHOWN_CHARS = 4_000  # of one value in a message: a groups list of 40 groups whole, a peer's 500 KB string not


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Difference:
    """One field whose value differs between two fingerprints."""

    field: str
    local: Any
    remote: Any
    local_name: str = "local"
    remote_name: str = "remote"

    def __str__(self) -> str:
        return f"{self.field}: {self.local_name} {_show(self.local)}, {self.remote_name} {_show(self.remote)}"

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, self.local_name: self.local, self.remote_name: self.remote}


@dataclass(frozen=True)
class CompatibilityResult:
    """Whether two fingerprints describe the same cache, and every difference if not."""

    ok: bool
    differences: tuple[Difference, ...]
    format_mismatch: bool = False

    def __bool__(self) -> bool:
        return self.ok

    @property
    def messages(self) -> list[str]:
        """One line per difference, e.g. ``head_order: local HND, remote NHD``."""
        return [str(d) for d in self.differences]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "format_mismatch": self.format_mismatch, "differences": self.messages}


def _as_dict(value: FingerprintLike, name: str) -> dict[str, Any]:
    if isinstance(value, LayoutFingerprint):
        return value.to_dict()
    if isinstance(value, Decision):
        return fingerprint(value).to_dict()
    if isinstance(value, (str, bytes)):
        value = load_peer_json(value, name)  # bounded: a peer controls every byte
    elif isinstance(value, dict):
        check_peer_value(value, name)
    if not isinstance(value, dict):
        raise input_error(name, f"the {name} fingerprint must be a LayoutFingerprint, its dict or its JSON, "
                                f"got {type(value).__name__}")
    return value


def _diff_groups(local: list[Any], remote: list[Any], names: tuple[str, str]) -> list[Difference]:
    if len(local) != len(remote):
        return [Difference("groups", local, remote, *names)]
    out = []
    for i, (a, b) in enumerate(zip(local, remote)):
        for key in a:
            if a[key] != b[key]:
                out.append(Difference(f"groups[{i}].{key}", a[key], b[key], *names))
    return out


def check_compatible(local: FingerprintLike, remote: FingerprintLike, *, local_name: str = "local",
                     remote_name: str = "remote") -> CompatibilityResult:
    """Compare two fingerprints field by field; ``ok`` only if every field is equal.

    Either side may be a `LayoutFingerprint`, a `Decision`, or the dict or JSON
    form a peer sent. A different ``format_version`` is reported alone, as such.
    Raises `InputError` if a side is not a fingerprint at all.
    """
    names = (local_name, remote_name)
    a, b = _as_dict(local, local_name), _as_dict(remote, remote_name)
    va, vb = a.get("format_version"), b.get("format_version")
    if va != vb or va != FORMAT_VERSION:
        return CompatibilityResult(False, (Difference("format_version", va, vb, *names),), format_mismatch=True)
    a = LayoutFingerprint.from_dict(a).to_dict()  # validates, and fixes the field order
    b = LayoutFingerprint.from_dict(b).to_dict()
    diffs: list[Difference] = []
    for key in a:
        if a[key] == b[key]:
            continue
        if key == "groups":
            diffs += _diff_groups(a[key], b[key], names)
        else:
            diffs.append(Difference(key, a[key], b[key], *names))
    return CompatibilityResult(not diffs, tuple(diffs))


def _mismatch(where: str, reference: str, result: CompatibilityResult) -> Diagnostic:
    """One diagnostic for a peer: every differing field, one a line, in fingerprint order."""
    n = len(result.differences)
    head = f"{n} field{'s' if n != 1 else ''} differ{'s' if n == 1 else ''} from {reference}"
    body = "".join(f"\n    {d}" for d in result.differences)
    return Diagnostic(where, 0, 0, "layout-mismatch", head + body,
                      _FORMAT_HELP if result.format_mismatch else _MISMATCH_HELP)


def require_compatible(local: FingerprintLike, remote: FingerprintLike, *, local_name: str = "local",
                       remote_name: str = "remote") -> LayoutFingerprint:
    """`check_compatible`, raising `LayoutMismatchError` with every difference; returns the local fingerprint."""
    result = check_compatible(local, remote, local_name=local_name, remote_name=remote_name)
    if not result.ok:
        raise LayoutMismatchError(f"the KV cache layouts of `{local_name}` and `{remote_name}` differ:",
                                  [_mismatch(remote_name, local_name, result)])
    return LayoutFingerprint.from_dict(_as_dict(local, local_name))


@dataclass(frozen=True)
class RankFingerprint:
    """What one rank contributes to `agree`: who it is, its fingerprint, and its rule set's digest."""

    rank: int
    group_rank: int
    fingerprint: dict[str, Any]
    ruleset_digest: str | None = None

    @property
    def name(self) -> str:
        if self.rank == self.group_rank:
            return f"rank {self.rank}"
        return f"rank {self.rank} (group rank {self.group_rank})"

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "group_rank": self.group_rank, "fingerprint": self.fingerprint,
                "ruleset_digest": self.ruleset_digest}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankFingerprint:
        return cls(int(data["rank"]), int(data["group_rank"]), dict(data["fingerprint"]), data.get("ruleset_digest"))


def _key(fp: dict[str, Any]) -> str:
    return json.dumps(fp, sort_keys=True, separators=(",", ":"))


def _checked_ranks(ranks: Sequence[RankFingerprint]) -> tuple[list[RankFingerprint], dict[int, LayoutFingerprint]]:
    """The ranks in group-rank order, and each fingerprint of this format parsed by group rank;
    `InputError` naming the rank for anything that is not one rank's fingerprint."""
    given = type(ranks).__name__
    try:
        listed = None if isinstance(ranks, (str, bytes, dict)) else list(ranks)
    except TypeError:
        listed = None
    if listed is None or not all(isinstance(r, RankFingerprint) for r in listed):
        raise input_error("ranks", f"`ranks` must be a sequence of RankFingerprint, got {given}",
                          "gather one RankFingerprint per rank (see `agree`)")
    if not listed:
        raise input_error("ranks", "no rank fingerprints to compare")
    parsed: dict[int, LayoutFingerprint] = {}
    seen: set[int] = set()
    for r in listed:
        if not all(type(n) is int for n in (r.rank, r.group_rank)):
            raise input_error("ranks", f"rank numbers must be ints, got rank {r.rank!r:.40} and group rank "
                              f"{r.group_rank!r:.40}", "build RankFingerprint(rank, group_rank, ...) from ints")
        if r.group_rank in seen:
            raise input_error("ranks", f"group rank {r.group_rank} appears twice",
                              "gather one RankFingerprint per rank of the group")
        seen.add(r.group_rank)
        check_peer_value(r.fingerprint, r.name)  # a peer's data: bounded before it is printed or compared
        version = r.fingerprint.get("format_version") if isinstance(r.fingerprint, dict) else None
        if version == FORMAT_VERSION:  # another format is a version skew, reported as a mismatch
            try:
                parsed[r.group_rank] = LayoutFingerprint.from_dict(r.fingerprint)
            except InputError as exc:
                why = exc.diagnostics[0].message.removeprefix("not a layout fingerprint: ")
                raise input_error("ranks", f"{r.name} sent something that is not a layout fingerprint: {why}",
                                  "run the same kvpolicy version on every rank") from None
        elif type(version) is not int:
            raise input_error("ranks", f"{r.name} sent something that is not a layout fingerprint "
                              "(no integer `format_version`)",
                              "gather LayoutFingerprint.to_dict() from every rank")
    return sorted(listed, key=lambda r: r.group_rank), parsed


def compare_ranks(ranks: Sequence[RankFingerprint]) -> LayoutFingerprint:
    """Check that every rank holds the same fingerprint; the pure half of `agree`.

    The reference is the fingerprint most ranks hold (ties: the one of the
    lowest rank), so a single odd rank is the one named. Raises
    `LayoutMismatchError` with one diagnostic per differing rank and field,
    identical on every rank because every rank sees the same input.
    """
    ordered, parsed = _checked_ranks(ranks)
    classes: dict[str, list[RankFingerprint]] = {}
    for r in ordered:
        classes.setdefault(_key(r.fingerprint), []).append(r)
    if len(classes) == 1:
        digests = {r.ruleset_digest for r in ordered if r.ruleset_digest}
        if len(digests) > 1:
            logger.info("kvpolicy: %d ranks agree on the KV cache layout with %d different rule sets",
                        len(ordered), len(digests))
        return parsed.get(ordered[0].group_rank) or LayoutFingerprint.from_dict(ordered[0].fingerprint)
    ref_members = min(classes.values(), key=lambda members: (-len(members), members[0].group_rank))
    ref = ref_members[0]
    diags: list[Diagnostic] = []
    for r in ordered:
        if _key(r.fingerprint) == _key(ref.fingerprint):
            continue
        result = check_compatible(ref.fingerprint, r.fingerprint, local_name=ref.name, remote_name=r.name)
        diags.append(_mismatch(r.name, ref.name, result))
        if r.ruleset_digest != ref.ruleset_digest and r.ruleset_digest and ref.ruleset_digest:
            diags.append(Diagnostic(r.name, 0, 0, "different-rules",
                                    f"{r.name} decided with rule set `{r.ruleset_digest}`, "
                                    f"{ref.name} with `{ref.ruleset_digest}`"))
    odd = [r.name for r in ordered if _key(r.fingerprint) != _key(ref.fingerprint)]
    holders = ", ".join(r.name for r in ref_members)
    raise LayoutMismatchError(
        f"KV cache layouts differ across the {len(ordered)} ranks: {holders} agree; "
        f"{', '.join(odd)} differ{'s' if len(odd) == 1 else ''} from {ref.name}:",
        diags,
    )


MAX_TIMEOUT_S = 86_400  # a day: longer than any start-up, and far inside what timedelta and gloo's milliseconds hold
_TIMEOUT_HELP = ("pass the seconds every rank may take to reach the agreement (e.g. 60), or None to wait for the "
                 "process group's own timeout")


def _checked_timeout(timeout_s: Any) -> float | None:
    """``timeout_s`` if it is None or a number of seconds in (0, `MAX_TIMEOUT_S`]; `InputError` naming it otherwise.
    Compared without converting, so neither NaN, an infinity nor an integer too large for a float gets through."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise input_error("timeout_s", f"`timeout_s` must be a number of seconds or None, got "
                          f"`{type(timeout_s).__name__}`", _TIMEOUT_HELP)
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # False for NaN too
        shown = (f"{timeout_s:.6g}" if f"{timeout_s:.6g}" != f"{MAX_TIMEOUT_S}" else repr(timeout_s)) \
            if isinstance(timeout_s, float) else (
            str(timeout_s) if timeout_s.bit_length() < 64 else f"an integer of {timeout_s.bit_length()} bits")
        raise input_error("timeout_s", f"`timeout_s` must be finite, above 0 and at most {MAX_TIMEOUT_S} s, "
                          f"got `{shown}`", _TIMEOUT_HELP)
    return float(timeout_s)


_numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _next_number(group: Any) -> int:
    """This process's count of agreements on ``group`` (the frames carry it: a left-over frame is refused)."""
    number = _numbers.get(group, 0) + 1
    _numbers[group] = number
    return number


def agree(decision: Decision | LayoutFingerprint, group: Any = None, timeout_s: float | None = 60.0
          ) -> LayoutFingerprint:
    """Check that every rank of ``group`` (default: the whole world) decided the same layout.

    Sends each rank's fingerprint and rule-set digest to every other rank in a
    frame of fixed capacity (canonical JSON bytes, no pickle, no numpy;
    `kvpolicy.engine.agreement_wire`) and returns the agreed fingerprint, or
    raises `LayoutMismatchError` on every rank, naming the ranks and fields. A
    peer that sends something else, stalls or dies is an `AgreementError`
    naming its rank and what it sent. Every rank of the group must call it
    (it is a collective).

    ``timeout_s`` (seconds, in (0, `MAX_TIMEOUT_S`], or None: the group's own
    timeout) bounds, on a gloo group (vLLM's ``cpu_group``), the wait for every
    rank to arrive (a ``monitored_barrier`` that names the ranks that never
    did), then the wait for their frames; other backends wait for the group's
    own timeout. A process that never initialised torch.distributed is a world
    of one: with ``group=None`` the local fingerprint is returned; with a
    ``group`` given, `AgreementError` is raised.
    """
    if not isinstance(decision, LayoutFingerprint) and not all(
        hasattr(decision, a) for a in ("layout", "context", "ruleset")
    ):
        raise input_error("decision", f"`decision` must be a Decision or a LayoutFingerprint, got "
                          f"`{type(decision).__name__}`", "pass engine.decide(...) or its fingerprint")
    timeout_s = _checked_timeout(timeout_s)
    local = decision if isinstance(decision, LayoutFingerprint) else fingerprint(decision)
    ruleset_digest = decision.ruleset.digest if isinstance(decision, Decision) else None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        dist = None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        if group is None:
            return local
        raise AgreementError("", [Diagnostic(
            "group", 0, 0, "no-process-group", "a process group was given but torch.distributed is not initialised",
            "call torch.distributed.init_process_group first, or pass group=None in a single process")])
    world = dist.get_world_size(group)
    if world == 1:
        return local
    number = _next_number(dist.group.WORLD if group is None else group)
    if timeout_s is not None and "gloo" in str(dist.get_backend(group)):
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise AgreementError("", [Diagnostic(
                f"rank {dist.get_rank()}", 0, 0, "agreement-timeout",
                f"not every rank reached the layout agreement within {timeout_s:g} s: {exc}",
                "every rank of the group must call agree(); check the named ranks' logs")]) from exc
    mine = RankFingerprint(dist.get_rank(), dist.get_rank(group), local.to_dict(), ruleset_digest)
    received = exchange(dist, group, frame(_encode(mine), number), timeout_s)
    ranks: list[RankFingerprint] = []
    faults: list[Fault] = []
    for i, data in enumerate(received):
        payload = data if isinstance(data, Fault) else parse_frame(data, i, number)
        if isinstance(payload, Fault):
            faults.append(payload)
            continue
        try:
            ranks.append(_rank_from_bytes(payload, i))
        except AgreementError as exc:
            faults.append(Fault(i, "peer-data", exc.diagnostics[0].message))
    if faults:
        named = ", ".join(f"group rank {f.group_rank}" for f in faults)
        raise AgreementError(f"the KV cache layouts of the {world} ranks could not be compared: {named} sent no "
                             "valid fingerprint", [_fault_diagnostic(f) for f in faults])
    compare_ranks(ranks)
    return local


_FAULT_HELP = {
    "peer-data": "every rank must run the same kvpolicy version and call agree(); check that rank's logs",
    "peer-protocol": "every rank must run the same kvpolicy version and call agree() as often; check that rank's logs",
    "peer-timeout": "every rank must call agree() within `timeout_s` of the others; check that rank's logs (do not "
                    "use this process group for more collectives: it is out of step)",
    "peer-lost": "check that rank's logs: its process exited or crashed (do not use this process group any more)",
}


def _fault_diagnostic(fault: Fault) -> Diagnostic:
    return Diagnostic(f"group rank {fault.group_rank}", 0, 0, fault.code, fault.message, _FAULT_HELP[fault.code])


def _encode(rank: RankFingerprint) -> bytes:
    """What this rank sends: its `RankFingerprint` as canonical JSON bytes."""
    return json.dumps(rank.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _peer_error(group_rank: int, message: str) -> AgreementError:
    return AgreementError("", [Diagnostic(
        f"group rank {group_rank}", 0, 0, "peer-data", message,
        "every rank must run the same kvpolicy version and call agree(); check that rank's logs")])


def _rank_from_bytes(data: bytes, group_rank: int) -> RankFingerprint:
    """Group rank ``group_rank``'s contribution, checked before anything trusts it.

    Every rank parses the same bytes, so a rank that sent garbage is named by the
    same `AgreementError` on every rank. A fingerprint of another format version is
    left for `compare_ranks`, which reports it as a format mismatch.
    """
    name = f"group rank {group_rank}"
    try:
        payload = load_peer_json(data, name)
    except InputError as exc:
        raise _peer_error(group_rank, exc.diagnostics[0].message) from None
    fields = {"rank": int, "group_rank": int, "fingerprint": dict, "ruleset_digest": (str, type(None))}
    if not isinstance(payload, dict) or set(payload) != set(fields) or not all(
        isinstance(payload[k], t) and not isinstance(payload[k], bool) for k, t in fields.items()
    ):
        raise _peer_error(group_rank, f"{name} sent `{_show(payload)[:200]}`, not a rank fingerprint")
    if payload["group_rank"] != group_rank:
        raise _peer_error(group_rank, f"{name} claims to be group rank {payload['group_rank']}")
    version = payload["fingerprint"].get("format_version")
    if type(version) is not int:  # compare_ranks would refuse it as the caller's InputError, not the peer's fault
        raise _peer_error(group_rank, f"{name} sent a fingerprint with no integer `format_version` "
                          f"(got `{json.dumps(version)[:60]}`)")
    if version == FORMAT_VERSION:
        try:
            LayoutFingerprint.from_dict(payload["fingerprint"])
        except InputError as exc:
            raise _peer_error(group_rank, f"{name} sent an invalid fingerprint: "
                              f"{exc.diagnostics[0].message}") from None
    return RankFingerprint.from_dict(payload)
