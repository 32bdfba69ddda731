"""What a lean scan (`jetstream._take_deliveries`) takes as proof from a consumer's deliveries, without
a server: every delivery the next one of this consumer of this stream (both forms of the `$JS.ACK`
reply subject), on the subject, with a size, up to the one that leaves nothing pending; anything else
is a doubt (`_ScanDoubt`: the caller scans again over the main connection), and a connection lost
before the last delivery fails the scan instead of ending it."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from natsfs.errors import Unavailable
from natsfs.jetstream import _ScanDoubt, _take_deliveries

SUBJECT = "$O.b.C.n"


def v1(sseq: int, cseq: int, pending: int, consumer: str = "scan", stream: str = "OBJ_b") -> bytes:
    return f"$JS.ACK.{stream}.{consumer}.1.{sseq}.{cseq}.1795544086202843333.{pending}".encode()


def v2(sseq: int, cseq: int, pending: int) -> bytes:
    return f"$JS.ACK.hub.ACCHASH.OBJ_b.scan.1.{sseq}.{cseq}.1795544086202843333.{pending}.xyz".encode()


class FakeDeliveries:
    """Hands over the given batches, then fails as a lost connection does."""

    def __init__(self, *batches: list[tuple[bytes, bytes, int | None]]) -> None:
        self.batches = list(batches)

    async def next(self, timeout: float) -> list[tuple[bytes, bytes, int | None]]:
        await trio.lowlevel.checkpoint()
        if not self.batches:
            raise Unavailable("deliveries to _INBOX.x.d.1: connection to NATS lost (kicked)")
        return self.batches.pop(0)


def take(*batches: list[tuple[bytes, bytes, int | None]]) -> list[tuple[int, int]]:
    async def main() -> list[tuple[int, int]]:
        deliveries: Any = FakeDeliveries(*batches)
        return await _take_deliveries(deliveries, "OBJ_b", "scan", SUBJECT, 5.0)

    return trio.run(main)


S = SUBJECT.encode()


@pytest.mark.parametrize("form", [v1, v2], ids=["v1", "v2"])
def test_every_delivery_up_to_nothing_pending(form):
    rows = [(S, form(3, 1, 2), 10), (S, form(8, 2, 1), 0)]
    assert take(rows, [(S, form(9, 3, 0), 131072)]) == [(3, 10), (8, 0), (9, 131072)]


@pytest.mark.parametrize("rows, why", [
    ([(S, v1(3, 2, 0), 1)], "consumer sequence 2 after 0"),  # the first delivery missed
    ([(S, v1(3, 1, 1), 1), (S, v1(4, 3, 0), 1)], "consumer sequence 3 after 1"),
    ([(S, v1(3, 1, 1), 1), (S, v1(3, 2, 0), 1)], "stream sequence 3 after 3"),
    ([(b"$O.b.C.other", v1(3, 1, 0), 1)], "unexpected delivery"),
    ([(S, v1(3, 1, 0), None)], "unexpected delivery"),  # no readable size
    ([(S, v1(3, 1, 0, consumer="other"), 1)], "reply subject"),
    ([(S, v1(3, 1, 0, stream="OBJ_c"), 1)], "reply subject"),
    ([(S, b"$JS.ACK.OBJ_b.scan.1.3.1.17.-0", 1)], "reply subject"),
    ([(S, b"$JS.ACK.OBJ_b.scan.1.03.1.17.0", 1)], "reply subject"),
    ([(S, b"$JS.ACK.x.OBJ_b.scan.1.3.1.17.0", 1)], "reply subject"),  # ten tokens: neither form
    ([(S, b"_INBOX.x.1", 1)], "reply subject"),
])
def test_anything_else_is_a_doubt(rows, why):
    with pytest.raises(_ScanDoubt, match=why):
        take(rows)


def test_a_connection_lost_before_the_last_delivery_fails_the_scan():
    with pytest.raises(Unavailable, match="connection to NATS lost"):
        take([(S, v1(3, 1, 2), 10), (S, v1(4, 2, 1), 10)])
