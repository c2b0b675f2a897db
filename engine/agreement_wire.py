"""The wire of `kvpolicy.engine.agreement.agree`: fingerprints exchanged so that no peer can drive it out of step.

Every collective's shape is a constant of the protocol, never something a peer
announced: a peer's data can make its own frame be refused, never make two
ranks post operations of different sizes. Each rank sends each peer one frame::

    offset  bytes  field
    0       8      magic ``kvpagree``
    8       2      protocol version (`PROTOCOL`), big-endian, as every field
    10      4      this agreement's number on the group (1, 2, ...: a frame left over from
                   an earlier call is refused, not taken for this one)
    14      4      payload length ``N``
    18      N      payload: the rank's `RankFingerprint` as canonical ASCII JSON

and receives into `FRAME_BYTES` (64 KiB, zero-filled) per peer: about 80 times
the payload of one KV cache group, 700 groups' worth. A frame is checked before
its payload is read (`parse_frame`): the magic, the version, the number, ``N``
within the frame, and exactly ``N`` bytes sent (fewer, or bytes past them, are
refused). A rank whose own payload does not fit sends the header alone, so
every peer names it.

Transport, by the group's backend:

- **gloo** (vLLM's ``cpu_group``): point to point. Each rank posts a receive of
  `FRAME_BYTES` from every peer, sends its frame to every peer, and waits for
  each with one deadline. gloo takes a message shorter than the receive, so a
  short frame is found by the header; a peer that sends nothing in time, or
  whose connection closes, is named by its rank.
- **other backends** (NCCL): one ``all_gather`` of `FRAME_BYTES` per rank (the
  frames zero-padded), bounded by the group's own timeout; a rank that stalls
  or dies there is not named, the failure is.

The limit of any protocol over gloo: a process that sends a message *longer*
than the receive posted for it (here more than `FRAME_BYTES`) makes gloo's I/O
thread throw ``gloo::EnforceNotMet`` and the receiving process abort in C++
before any Python runs. A kvpolicy rank never sends more than `FRAME_BYTES`;
only a process running other code on the group's ``TAG`` can.
"""

from __future__ import annotations

import datetime
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FRAME_BYTES", "MAGIC", "PROTOCOL", "TAG", "Fault", "exchange", "frame", "parse_frame"]

MAGIC = b"kvpagree"
PROTOCOL = 2  # version 1 was the all_gather of announced lengths, then of rows padded to the longest
FRAME_BYTES = 64 * 1024
TAG = 0x6B7670  # "kvp": the gloo send/recv tag of agreement frames, apart from vLLM's own (0)
_HEADER = struct.Struct(">8sHII")
HEADER_BYTES = _HEADER.size
MAX_PAYLOAD = FRAME_BYTES - HEADER_BYTES
_SHOWN = 60  # bytes of a bad frame quoted in a message


@dataclass(frozen=True)
class Fault:
    """What went wrong with one peer's frame: the group rank, and what it sent (or did not)."""

    group_rank: int
    code: str  # peer-data | peer-timeout | peer-lost | peer-protocol
    message: str


def frame(payload: bytes, number: int) -> bytes:
    """The frame a rank sends: the header, then the payload (the header alone if it does not fit)."""
    header = _HEADER.pack(MAGIC, PROTOCOL, number & 0xFFFFFFFF, len(payload))
    return header + payload if len(payload) <= MAX_PAYLOAD else header


def _quote(data: bytes) -> str:
    text = data[:_SHOWN].decode("latin-1").encode("unicode_escape").decode("ascii").replace("`", "\\x60")
    return f"`{text}`" + ("..." if len(data) > _SHOWN else "")


def parse_frame(data: bytes, group_rank: int, number: int) -> bytes | Fault:
    """The payload of group rank ``group_rank``'s frame ``data`` (its received bytes, trailing zeros
    dropped), or the `Fault` that names what it sent instead."""
    name = f"group rank {group_rank}"
    if len(data) < HEADER_BYTES or data[:8] != MAGIC:
        what = "nothing but zero bytes" if not data else f"{len(data)} bytes starting {_quote(data)}"
        return Fault(group_rank, "peer-protocol", f"{name} sent {what}, not an agreement frame (no `kvpagree` "
                     "header): it runs another program, or a kvpolicy older than this one, on the group")
    _, version, their_number, n = _HEADER.unpack_from(data)
    if version != PROTOCOL:
        return Fault(group_rank, "peer-protocol", f"{name} speaks agreement protocol {version}, this rank "
                     f"{PROTOCOL}: run one kvpolicy version on every rank")
    if their_number != number & 0xFFFFFFFF:
        return Fault(group_rank, "peer-protocol", f"{name} sent the frame of agreement {their_number} on this "
                     f"group during agreement {number}: a frame left over from an earlier call, or ranks that "
                     "called agree() a different number of times")
    if n > MAX_PAYLOAD:
        return Fault(group_rank, "peer-data", f"{name} announced {n} bytes of fingerprint; a frame holds at most "
                     f"{MAX_PAYLOAD}")
    got = len(data) - HEADER_BYTES
    if got < n:
        return Fault(group_rank, "peer-data", f"{name} announced {n} bytes of fingerprint and sent {got}")
    if got > n:
        return Fault(group_rank, "peer-data", f"{name} announced {n} bytes of fingerprint and sent {got}, "
                     f"ending {_quote(data[HEADER_BYTES + n:])}")
    return data[HEADER_BYTES:]


def _seconds_left(deadline: float | None) -> datetime.timedelta | None:
    if deadline is None:
        return None
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _wait(work: Any, deadline: float | None) -> str | None:
    """None once ``work`` completed, else gloo's reason (a timeout, a closed connection) in one line."""
    left = _seconds_left(deadline)
    try:
        work.wait() if left is None else work.wait(timeout=left)
    except RuntimeError as exc:  # DistBackendError is one; gloo says what happened, with its source path
        return _reason(exc)
    return None


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _received(buf: bytearray) -> bytes:
    """The bytes of a zero-filled receive buffer up to its last nonzero byte (a whole header at least,
    when it starts with one: a header-only frame's length may end in zero bytes). Plain bytes, scanned
    in Python: torch's ``nonzero`` over 64 KiB took 30 ms on two busy cores, ten times the exchange."""
    data = bytes(buf).rstrip(b"\0")
    if len(data) < HEADER_BYTES and buf[:8] == MAGIC:
        data = bytes(buf[:HEADER_BYTES])
    return data


def _buffer(torch: Any) -> tuple[bytearray, Any]:
    """A zero-filled receive buffer, and a uint8 tensor over the same memory for torch.distributed."""
    buf = bytearray(FRAME_BYTES)  # calloc'd: no fill kernel
    return buf, torch.frombuffer(buf, dtype=torch.uint8)


def _lost(group_rank: int, why: str, sending: bool, timeout_s: float | None) -> Fault:
    name = f"group rank {group_rank}"
    if "timed out" in why.lower() or "timeout" in why.lower():
        within = f"within {timeout_s:g} s" if timeout_s is not None else "within the group's timeout"
        did = "took no frame from this rank" if sending else "sent no frame"
        return Fault(group_rank, "peer-timeout", f"{name} passed the barrier but {did} {within} (it stalled, "
                     f"or runs another kvpolicy version): {why}")
    return Fault(group_rank, "peer-lost", f"{name} was lost during the exchange (its process exited or "
                 f"crashed?): {why}")


def _point_to_point(dist: Any, group: Any) -> bool:
    """gloo groups exchange point to point; others all_gather fixed frames."""
    return "gloo" in str(dist.get_backend(group))


def _outgoing(data: bytes, peer: int) -> bytes:
    """What this rank sends group rank ``peer``: its frame (the tests' hostile peers replace this)."""
    return data


def exchange(dist: Any, group: Any, mine: bytes, timeout_s: float | None) -> list[bytes | Fault]:
    """Every group rank's frame bytes as received (this rank's own: ``mine``), or its transport `Fault`.

    Never raises for a peer's fault; completes or gives up on every operation before returning
    (a receive that timed out closes gloo's connection to that peer), so nothing a peer sends
    later lands anywhere.
    """
    import torch

    me, world = dist.get_rank(group), dist.get_world_size(group)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    send = _outgoing
    peers = [i for i in range(world) if i != me]
    out: list[bytes | Fault] = [b""] * world
    out[me] = mine
    if not _point_to_point(dist, group):
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
            else torch.device("cpu")
        sent = bytearray(send(mine, (me + 1) % world)[:FRAME_BYTES].ljust(FRAME_BYTES, b"\0"))
        padded = torch.frombuffer(sent, dtype=torch.uint8).to(device)
        rows = [torch.empty_like(padded) for _ in range(world)]
        why = _wait(dist.all_gather(rows, padded, group=group, async_op=True), None)
        if why is not None:
            return [out[i] if i == me else Fault(i, "peer-lost", f"the exchange of frames failed (a rank stalled "
                                                 f"or died; over {dist.get_backend(group)} it cannot be named): "
                                                 f"{why}") for i in range(world)]
        received = []
        for i in range(world):
            if i == me:
                received.append(mine)
                continue
            buf, tensor = _buffer(torch)
            tensor.copy_(rows[i])
            received.append(_received(buf))
        return received

    def global_rank(i: int) -> int:
        return i if group is None else dist.get_global_rank(group, i)

    bufs = {i: _buffer(torch) for i in peers}
    recvs: dict[int, Any] = {}
    sends: dict[int, Any] = {}
    for i in peers:  # posting fails at once on a connection already closed
        why = _post(lambda i=i: dist.irecv(bufs[i][1], global_rank(i), group=group, tag=TAG), recvs, i)
        if why is not None:
            out[i] = _lost(i, why, False, timeout_s)
    for i in peers:
        data = send(mine, i)
        tensor = torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)
        why = _post(lambda i=i, t=tensor: dist.isend(t, global_rank(i), group=group, tag=TAG), sends, i)
        if why is not None and not isinstance(out[i], Fault):
            out[i] = _lost(i, why, True, timeout_s)
    for i in recvs:
        why = _wait(recvs[i], deadline)
        if not isinstance(out[i], Fault):
            out[i] = _received(bufs[i][0]) if why is None else _lost(i, why, False, timeout_s)
    for i in sends:
        why = _wait(sends[i], deadline)
        if why is not None and not isinstance(out[i], Fault):
            out[i] = _lost(i, why, True, timeout_s)
    return out


def _post(start: Callable[[], Any], works: dict[int, Any], peer: int) -> str | None:
    """Start one send or receive into ``works``; gloo's reason in one line if it cannot even start."""
    try:
        works[peer] = start()
    except RuntimeError as exc:
        return _reason(exc)
    return None
