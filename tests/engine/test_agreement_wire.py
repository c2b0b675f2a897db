"""The agreement frame, parsed as a receiver does: every way a peer's frame can be wrong is a `Fault` naming
its group rank and what it sent, decided from the header before the payload is read."""

from __future__ import annotations

import pytest

from kvpolicy.engine.agreement_wire import FRAME_BYTES, HEADER_BYTES, MAGIC, Fault, frame, parse_frame

PAYLOAD = b'{"fingerprint":{},"group_rank":3,"rank":3,"ruleset_digest":null}'


def test_a_frame_round_trips_its_payload() -> None:
    data = frame(PAYLOAD, 7)
    assert data[:8] == MAGIC and len(data) == HEADER_BYTES + len(PAYLOAD)
    assert parse_frame(data, 3, 7) == PAYLOAD


def test_a_payload_too_large_for_a_frame_is_sent_as_its_header_alone() -> None:
    """The sender stays in step: its peers read the header and name it, nobody allocates for it."""
    big = b"x" * (FRAME_BYTES - HEADER_BYTES + 1)
    data = frame(big, 1)
    assert len(data) == HEADER_BYTES
    fault = parse_frame(data, 3, 1)
    assert isinstance(fault, Fault) and fault.code == "peer-data"
    assert fault.message == f"group rank 3 announced {len(big)} bytes of fingerprint; a frame holds at most " \
                            f"{FRAME_BYTES - HEADER_BYTES}"


@pytest.mark.parametrize(("data", "code", "what"), [
    (b"", "peer-protocol", "group rank 3 sent nothing but zero bytes, not an agreement frame"),
    (b"\x80\x04\x95pickle", "peer-protocol", "group rank 3 sent 9 bytes starting `\\x80\\x04\\x95pickle`, not an"),
    (b"`" * 100, "peer-protocol", "starting `" + "\\x60" * 60 + "`..., not an agreement frame"),
    (frame(PAYLOAD, 1)[:10], "peer-protocol", "group rank 3 sent 10 bytes starting `kvpagree"),
    (frame(PAYLOAD, 1).replace(b"\x00\x02", b"\x00\x01", 1), "peer-protocol",
     "speaks agreement protocol 1, this rank 2"),
    (frame(PAYLOAD, 2), "peer-protocol", "sent the frame of agreement 2 on this group during agreement 1"),
    (frame(PAYLOAD, 1)[:-5], "peer-data", f"announced {len(PAYLOAD)} bytes of fingerprint and sent {len(PAYLOAD) - 5}"),
    (frame(PAYLOAD, 1) + b"tail", "peer-data",
     f"announced {len(PAYLOAD)} bytes of fingerprint and sent {len(PAYLOAD) + 4}, ending `tail`"),
], ids=["empty", "garbage", "backticks", "header-cut", "protocol-1", "left-over", "short", "long"])
def test_a_bad_frame_is_a_fault_naming_the_rank_and_what_it_sent(data: bytes, code: str, what: str) -> None:
    fault = parse_frame(data, 3, 1)
    assert isinstance(fault, Fault) and fault.group_rank == 3 and fault.code == code
    assert what in fault.message, fault.message



def test_a_header_only_frame_survives_the_zero_padding_of_its_receive_buffer() -> None:
    """A payload of 1 MiB announces 0x00100000: its header ends in zero bytes, which the receiver must not
    take for padding."""
    from kvpolicy.engine.agreement_wire import _received

    data = frame(b"x" * (1 << 20), 4)
    buf = bytearray(FRAME_BYTES)
    buf[: len(data)] = data
    fault = parse_frame(_received(buf), 1, 4)
    assert isinstance(fault, Fault) and "announced 1048576 bytes of fingerprint" in fault.message
