"""What a lean scan (`jetstream._take_deliveries`) takes as proof from a consumer's deliveries, without
a server: every delivery the next one of this consumer of this stream (both forms of the `$JS.ACK`
reply subject), on the subject, with a size, up to the one that leaves nothing pending; anything else
is a doubt (`_ScanDoubt`: the caller scans again over the main connection), and a connection lost
before the last delivery fails the scan instead of ending it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from natsfs.bridge import Delivery, Status
from natsfs.errors import Unavailable
from natsfs.jetstream import SCAN_REQUEST_BYTES, SCAN_REQUESTS, _ScanDoubt, _take_deliveries

SUBJECT = "$O.b.C.n"


def v1(sseq: int, cseq: int, pending: int, consumer: str = "scan", stream: str = "OBJ_b") -> bytes:
    return f"$JS.ACK.{stream}.{consumer}.1.{sseq}.{cseq}.1795544086202843333.{pending}".encode()


def v2(sseq: int, cseq: int, pending: int) -> bytes:
    return f"$JS.ACK.hub.ACCHASH.OBJ_b.scan.1.{sseq}.{cseq}.1795544086202843333.{pending}.xyz".encode()


class FakeDeliveries:
    """Hands over the given batches (rows of (subject, reply, size), each of `HEADER_BYTES` header bytes,
    or (rows, statuses)), then fails as a lost connection does; notes the pull requests sent and the
    bytes they asked for and not yet delivered (as the server counts them) after each."""

    def __init__(self, *batches: Any) -> None:
        self.batches = list(batches)
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.asked = 0
        self.most_asked = 0
        self.sent_by_answer: list[int] = []  # requests sent by each `next`

    def request(self, subject: str, payload: bytes) -> None:
        body = json.loads(payload)
        self.requests.append((subject, body))
        self.asked += body["max_bytes"]
        self.most_asked = max(self.most_asked, self.asked)

    async def next(self, timeout: float) -> tuple[list[Delivery], list[Status]]:
        await trio.lowlevel.checkpoint()
        self.sent_by_answer.append(len(self.requests))
        if not self.batches:
            raise Unavailable("deliveries to _INBOX.x.d.1: connection to NATS lost (kicked)")
        batch = self.batches.pop(0)
        rows, statuses = batch if isinstance(batch, tuple) else (batch, [])
        out = [(s, r, n, HEADER_BYTES) for s, r, n in rows]
        self.asked -= sum(len(s) + len(r) + hb for s, r, _, hb in out)
        for _, _, headers in statuses:
            self.asked -= int(headers.get("Nats-Pending-Bytes", 0))
        return out, statuses


HEADER_BYTES = 30


def take(*batches: Any, deliveries: FakeDeliveries | None = None) -> list[tuple[int, int]]:
    async def main() -> list[tuple[int, int]]:
        d: Any = deliveries or FakeDeliveries(*batches)
        rows, complete = await _take_deliveries(d, "OBJ_b", "scan", SUBJECT, 5.0)
        assert complete
        return [(seq, size) for _, seq, size in rows if size is not None]

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


def status(code: str, description: str, unused: int | None = None) -> Status:
    headers = {"Status": code, "Description": description}
    if unused is not None:
        headers |= {"Nats-Pending-Messages": "10", "Nats-Pending-Bytes": str(unused)}
    return code, description, headers


def test_deliveries_are_pulled_a_few_requests_at_a_time_whatever_comes():
    """Requests of `SCAN_REQUEST_BYTES` to this consumer, a new one only once what was asked for and not
    yet delivered (or given up by a request that ended) leaves room for it: never more than
    `SCAN_REQUESTS` requests' worth asked for at once, and the first alone until the server answered
    (a refused one is refused once). Heartbeats change nothing."""
    per = len(S) + len(v1(1000, 1000, 1000)) + HEADER_BYTES  # (the bytes of one delivery, about)
    n = 4 * SCAN_REQUESTS * SCAN_REQUEST_BYTES // per
    batches: list[Any] = []
    for start in range(1, n + 1, 500):
        rows = [(S, v1(1000 + i, i, n - i), i % 7) for i in range(start, min(start + 500, n + 1))]
        batches.append((rows, [status("100", "Idle Heartbeat")]))
        if len(batches) % 3 == 0:  # a request ends with a few bytes its next delivery did not fit in
            batches.append(([], [status("409", "Message Size Exceeds MaxBytes", 40)]))
    d = FakeDeliveries(*batches)
    got = take(deliveries=d)
    assert got == [(1000 + i, i % 7) for i in range(1, n + 1)]
    assert d.most_asked <= SCAN_REQUESTS * SCAN_REQUEST_BYTES
    assert d.sent_by_answer[:2] == [1, SCAN_REQUESTS]  # (one alone until the server answered)
    assert len(d.requests) > 4 * SCAN_REQUESTS
    assert {subject for subject, _ in d.requests} == {"$JS.API.CONSUMER.MSG.NEXT.OBJ_b.scan"}
    assert all(body["max_bytes"] == SCAN_REQUEST_BYTES and body["batch"] > 0 and set(body) == {"batch", "max_bytes"}
               for _, body in d.requests)


@pytest.mark.parametrize("end, why", [
    (status("409", "Message Size Exceeds MaxBytes", SCAN_REQUEST_BYTES), "larger than a whole request"),
    (status("409", "Consumer Deleted"), "409 Consumer Deleted"),
    (status("409", "Leadership Change"), "409 Leadership Change"),
    (status("404", "No Messages"), "404 No Messages"),
    (status("409", "Exceeded MaxRequestBatch of 10"), "Exceeded MaxRequestBatch"),
])
def test_a_status_other_than_a_heartbeat_or_a_request_s_end_is_a_doubt(end, why):
    with pytest.raises(_ScanDoubt, match=why):
        take(([(S, v1(3, 1, 2), 10)], [end]))


def test_a_request_that_ends_with_its_bytes_unused_is_asked_again():
    """A request ended by a status that says what it left (`Nats-Pending-Bytes`) makes room for a new
    one; the scan goes on to the end."""
    first = len(S) + len(v1(3, 1, 2)) + HEADER_BYTES  # (what the first delivery took of its request)
    d = FakeDeliveries(([(S, v1(3, 1, 2), 10)], [status("408", "Request Timeout", SCAN_REQUEST_BYTES - first)]),
                       ([], [status("409", "Batch Completed", 5)]), [(S, v1(4, 2, 1), 1), (S, v1(9, 3, 0), 2)])
    assert take(deliveries=d) == [(3, 10), (4, 1), (9, 2)]
    assert len(d.requests) == SCAN_REQUESTS + 1


def counts_of(*batches: Any, filter_subject: str, last_seq: int = 0) -> tuple[list[tuple[bytes, int]], bool]:
    async def main() -> tuple[list[tuple[bytes, int]], bool]:
        rows, complete = await _take_deliveries(FakeDeliveries(*batches), "OBJ_b", "scan", filter_subject, 5.0,
                                                sizes=False, last_seq=last_seq)
        return [(s, seq) for s, seq, _ in rows], complete

    return trio.run(main)


def test_a_listing_scan_takes_every_subject_the_filter_matches_and_nothing_else():
    """`subject_counts`' scan: any subject under `$O.b.M.>`, sizes not needed; up to nothing pending it
    is complete. A subject outside the filter (or the filter's prefix alone) is a doubt."""
    a, b = b"$O.b.M.YQ==", b"$O.b.M.Yg=="
    got = counts_of([(a, v1(1, 1, 2), None), (b, v1(5, 2, 1), 3)], [(a, v1(7, 3, 0), None)],
                    filter_subject="$O.b.M.>")
    assert got == ([(a, 1), (b, 5), (a, 7)], True)
    for wrong in (b"$O.b.C.x", b"$O.b.M", b"$O.b.MX.y"):
        with pytest.raises(_ScanDoubt, match="unexpected delivery"):
            counts_of([(wrong, v1(1, 1, 0), None)], filter_subject="$O.b.M.>")
    assert counts_of([(b"$O.b.M.x", v1(1, 1, 0), None)], filter_subject="$O.*.M.x")[1]
    with pytest.raises(_ScanDoubt, match="unexpected delivery"):
        counts_of([(b"$O.b.M.x.y", v1(1, 1, 0), None)], filter_subject="$O.*.M.x")


def test_a_listing_scan_that_chases_other_clients_writes_gives_up_not_complete():
    """Begun once the stream ended at `last_seq` 2 (two messages before it), other clients keep storing:
    the scan stops once it took 1002 more than those two after it, and says it is not complete."""
    s = b"$O.b.M.x"
    rows = [(s, v1(seq, seq, 5), None) for seq in range(1, 2000)]
    got, complete = counts_of(rows, filter_subject="$O.b.M.>", last_seq=2)
    assert not complete and len(got) == 2 + 1003 and got[-1] == (s, 1005)
