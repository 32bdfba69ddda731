"""The chunk-size scan over the lean connection (`JetStreams._lean_index`: a one-shot headers-only
pull consumer delivering to the trio thread's connection what its byte-bounded requests ask for)
against a real nats-server: it returns exactly what the ordered consumer over the main connection
returns, for chunks of unequal sizes, chunks interleaved with other objects' chunks, chunks with
headers of their own (which the server keeps in its headers-only deliveries); a scan cut by a lost
lean connection raises instead of returning what came before, and `subject_index` then answers in
full over the main connection; a user who may not subscribe to its delivery subject, or send its pull
requests, gets the same answer the other way; a reader that stops reading mid-scan is not dropped by
a small `max_pending`; no consumer is left behind."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import trio
from helpers import create_bucket, wait_for, with_nats
from test_lean_reads import kick_lean
from test_transport import KICKABLE, own_server

from natsfs.bridge import Bridge, Deliveries, _TrioReads
from natsfs.errors import Unavailable
from natsfs.jetstream import JetStreams
from natsfs.wire import TrioWireConnection

BUCKET = "scan"
STREAM = f"OBJ_{BUCKET}"


def subject(nuid: str) -> str:
    return f"$O.{BUCKET}.C.{nuid}"


def publish(url: str, msgs: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
    """Publish chunk messages in this order (the stream's sequences follow it)."""

    async def fn(nc: Any, js: Any) -> None:
        for subj, data, headers in msgs:
            await js.publish(subj, data, headers=headers)

    with_nats(url, fn)


def consumers(url: str) -> int:
    async def fn(nc: Any, js: Any) -> int:
        return (await js.stream_info(STREAM)).state.consumer_count

    return with_nats(url, fn)


def uneven_and_interleaved(url: str) -> dict[str, list[int]]:
    """Objects whose chunk messages are: `uneven` (sizes 0, 1, 128 KiB, 1000 KiB, ...), `a` and `b`
    interleaved one for one, `many` (3000 small chunks of unequal sizes, with other objects' chunks
    between some of them), `headed` (chunks with headers of their own, which the server's
    headers-only deliveries keep, one of them a `Nats-Msg-Size`). name -> the chunk sizes."""
    create_bucket(url, BUCKET)
    sizes = {"uneven": [128 * 1024, 0, 1, 128 * 1024, 1000 * 1024, 77, 128 * 1024 + 3]}
    msgs: list[tuple[str, bytes, dict[str, str] | None]] = [(subject("uneven"), os.urandom(n), None)
                                                           for n in sizes["uneven"]]
    sizes["a"], sizes["b"] = [10 + i for i in range(40)], [500 - i for i in range(40)]
    for x, y in zip(sizes["a"], sizes["b"], strict=True):
        msgs += [(subject("a"), os.urandom(x), None), (subject("b"), os.urandom(y), None)]
    sizes["many"] = [(i * 37) % 300 for i in range(3000)]
    for i, n in enumerate(sizes["many"]):
        msgs.append((subject("many"), os.urandom(n), None))
        if i % 97 == 0:
            msgs.append((subject("other"), b"x", None))
    # (The last one claims another size in a `Nats-Msg-Size` of its own: the server's comes after it.)
    sizes["headed"] = [5, 6, 7, 8]
    msgs += [(subject("headed"), os.urandom(n), {"X-Note": f"chunk {n}"}) for n in sizes["headed"][:-1]]
    msgs.append((subject("headed"), os.urandom(8), {"Nats-Msg-Size": "131072", "X-Note": "claims"}))
    publish(url, msgs)
    return sizes


def test_the_fast_scan_returns_exactly_what_the_ordered_scan_does(private_server):
    url = private_server.url
    sizes = uneven_and_interleaved(url)

    async def main() -> None:
        bridge = Bridge([url])
        await bridge.connect()
        js = JetStreams(bridge)
        try:
            assert bridge.reads_in_trio
            for nuid in [*sizes, "none"]:
                ordered = await js._ordered_index(STREAM, subject(nuid))
                assert [n for _, n in ordered] == sizes.get(nuid, [])
                assert await js._lean_index(STREAM, subject(nuid)) == ordered, nuid
                before = js.calls["lean_scans"]
                assert await js.subject_index(STREAM, subject(nuid)) == ordered
                assert js.calls["lean_scans"] == before + 1  # (it took the lean connection)
        finally:
            await bridge.close()

    trio.run(main)
    assert consumers(url) == 0


@pytest.mark.parametrize("through", ["parts", "subject_index"])
def test_a_scan_cut_by_a_kicked_lean_connection_never_yields_a_partial_layout(tmp_path, monkeypatch, through):
    """The lean connection is lost after the first deliveries of a scan arrived and before the rest
    did: `_lean_index` raises `Unavailable` rather than return them, and `subject_index` answers
    in full over the main connection."""
    server = own_server(tmp_path, KICKABLE)
    url = server.url
    try:
        sizes = uneven_and_interleaved(url)
        cut: list[int] = []

        async def first_deliveries_then_kick(self: Deliveries, timeout: float) -> tuple[list[Any], list[Any]]:
            rows, statuses = await real_next(self, timeout)
            if cut:
                return rows, statuses
            # The connection is lost when only the first few deliveries came (the rest are dropped here,
            # as if they had not arrived yet): the kick is sent and seen before they are handed on.
            cut.append(len(rows))
            assert await trio.to_thread.run_sync(kick_lean, url) == 1
            with trio.fail_after(20):
                while self.error is None:
                    await trio.sleep(0.01)
            self._rows.clear()  # (nor had any that came meanwhile)
            self._statuses.clear()
            return rows[:3], []

        real_next = Deliveries.next
        monkeypatch.setattr(Deliveries, "next", first_deliveries_then_kick)

        async def main() -> None:
            bridge = Bridge([url], request_timeout=20)
            await bridge.connect()
            js = JetStreams(bridge)
            try:
                ordered = await js._ordered_index(STREAM, subject("many"))
                assert [n for _, n in ordered] == sizes["many"]
                if through == "parts":
                    with pytest.raises(Unavailable, match="connection to NATS lost"):
                        await js._lean_index(STREAM, subject("many"))
                else:
                    assert await js.subject_index(STREAM, subject("many")) == ordered
                assert cut
            finally:
                await bridge.close()

        trio.run(main)
    finally:
        server.stop()


@pytest.mark.parametrize("denied", [
    'publish: { allow: [">"] }, subscribe: { allow: [">"], deny: ["_INBOX.*.d.*"] }',
    'publish: { allow: [">"], deny: ["$JS.API.CONSUMER.MSG.NEXT.>"] }, subscribe: { allow: [">"] }',
], ids=["subscribe", "pull"])
def test_a_user_who_may_not_subscribe_to_the_scan_subject_gets_the_same_answer(tmp_path, caplog, denied):
    """The server refuses the lean connection's subscription for the deliveries, or its pull requests
    (a permissions violation): the scan is made over the main connection, with the same answer, and so
    are later ones, without asking again; nothing is logged above INFO."""
    conf = """
authorization {
  users: [
    { user: admin, password: admin }
    { user: noscan, password: noscan, permissions: { DENIED } }
  ]
}
""".replace("DENIED", denied)
    server = own_server(tmp_path, conf)
    admin = server.url.replace("nats://", "nats://admin:admin@")
    try:
        sizes = uneven_and_interleaved(admin)

        async def main() -> None:
            bridge = Bridge([server.url.replace("nats://", "nats://noscan:noscan@")])
            await bridge.connect()
            js = JetStreams(bridge)
            try:
                assert bridge.reads_in_trio
                with pytest.raises(Exception, match="permission"):
                    await js._lean_index(STREAM, subject("a"))
                for nuid in ("a", "b", "uneven"):
                    got = await js.subject_index(STREAM, subject(nuid))
                    assert [n for _, n in got] == sizes[nuid]
                assert js.calls["lean_scans"] == 2  # (the one above, and the first of these)
            finally:
                await bridge.close()

        caplog.clear()
        trio.run(main)
        assert not [r.getMessage() for r in caplog.records if r.levelno > logging.INFO]
    finally:
        server.stop()


def test_a_scan_of_many_small_messages_stays_within_a_small_max_pending(tmp_path, caplog):
    """40,000 empty chunks: the server would send their deliveries (about 6 MB) faster than the reader
    parses them, past a `max_pending` of 2 MB, but sends only what the scan's pull requests ask for: the
    scan ends over the same lean connection, with the ordered scan's answer."""
    server = own_server(tmp_path, KICKABLE)
    url = server.url
    count = 40_000
    try:
        create_bucket(url, BUCKET)

        async def publish_fast(nc: Any, js: Any) -> None:
            for _ in range(count):
                await nc.publish(subject("tiny"), b"")
            await nc.flush()

        with_nats(url, publish_fast)

        async def stored(nc: Any, js: Any) -> int:
            return (await js.stream_info(STREAM)).state.messages

        # (Published without acks: the stream may still be storing the last of them.)
        assert wait_for(lambda: with_nats(url, stored) == count, timeout=60)

        async def main() -> None:
            bridge = Bridge([url])
            await bridge.connect()
            js = JetStreams(bridge)
            try:
                reads = bridge._reads
                assert isinstance(reads, _TrioReads) and reads.nc is not None
                lean = reads.nc
                caplog.set_level(logging.DEBUG, logger="natsfs.jetstream")
                got = await js.subject_index(STREAM, subject("tiny"))
                assert len(got) == count and {n for _, n in got} == {0}
                assert reads.nc is lean and js.calls["lean_scans"] == 1
                assert not [r for r in caplog.records if "over the main one" in r.getMessage()]
                assert got == await js._ordered_index(STREAM, subject("tiny"))
            finally:
                await bridge.close()

        trio.run(main)
    finally:
        server.stop()


def test_a_scan_whose_reader_stops_reading_is_not_dropped_by_a_small_max_pending(tmp_path, monkeypatch, caplog):
    """The lean connection's reader stops reading for a while in the middle of a scan (a starved
    process), with far more than the server's 2 MB `max_pending` still to come (15,000 chunks with
    2 KiB of headers each: 30 MB of deliveries): the server sends only what the scan asked for, which
    is far less, so it never drops the connection; the scan ends over the same lean connection with
    the ordered scan's answer, without falling back to the main one."""
    server = own_server(tmp_path, KICKABLE)
    url = server.url
    count, pad = 15_000, "x" * 2048
    try:
        create_bucket(url, BUCKET)

        async def publish_fast(nc: Any, js: Any) -> None:
            for _ in range(count):
                await nc.publish(subject("padded"), b"abc", headers={"X-Pad": pad})
            await nc.flush()

        with_nats(url, publish_fast)

        async def stored(nc: Any, js: Any) -> int:
            return (await js.stream_info(STREAM)).state.messages

        assert wait_for(lambda: with_nats(url, stored) == count, timeout=60)

        # The reader stops once the scan has 4,000 deliveries (8 MB: past any flow-control window's
        # start), for long enough that the server could send everything else meanwhile.
        delivered = [0]
        stalled: list[float] = []
        real_message, real_headers_only = Deliveries.message, Deliveries.headers_only
        real_receive = TrioWireConnection._receive_once

        def counted_message(self: Deliveries, *args: Any) -> None:
            delivered[0] += 1
            real_message(self, *args)

        def counted_headers_only(self: Deliveries, rows: list[Any]) -> None:
            delivered[0] += len(rows)
            real_headers_only(self, rows)

        async def starved(self: TrioWireConnection) -> bool:
            if delivered[0] >= 4000 and not stalled:
                stalled.append(trio.current_time())
                await trio.sleep(STARVED_S)
            return await real_receive(self)

        monkeypatch.setattr(Deliveries, "message", counted_message)
        monkeypatch.setattr(Deliveries, "headers_only", counted_headers_only)
        monkeypatch.setattr(TrioWireConnection, "_receive_once", starved)

        async def main() -> None:
            bridge = Bridge([url], request_timeout=30)
            await bridge.connect()
            js = JetStreams(bridge)
            try:
                reads = bridge._reads
                assert isinstance(reads, _TrioReads) and reads.nc is not None
                lean = reads.nc
                caplog.set_level(logging.DEBUG, logger="natsfs.jetstream")
                got = await js.subject_index(STREAM, subject("padded"))
                assert not [r for r in caplog.records if "over the main one" in r.getMessage()]
                assert reads.nc is lean and not lean.is_closed and js.calls["lean_scans"] == 1
                assert stalled  # (the reader did stop)
                # What the ordered scan answers (the stream holds these messages alone). (Not asked of it
                # here: its push consumer over the main connection outruns nats-py past a 2 MB
                # `max_pending` with deliveries this large, and gets that connection dropped, more than once.)
                assert got == [(seq, 3) for seq in range(1, count + 1)]
                assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            finally:
                await bridge.close()

        trio.run(main)
    finally:
        server.stop()


STARVED_S = 3.0
