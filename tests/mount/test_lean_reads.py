"""Batched direct gets over the bridge's lean connection (natsfs.wire), against real nats-servers:
the same messages as through nats-py, every credential the mount supports, and connection loss
(kicks, `-ERR`, server restarts) failing what is in flight at once and replacing the connection.
The lean connection is driven by the trio thread (`_TrioReads`) where the server does not want TLS,
else by the asyncio thread (`_Link`); both are tested."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
from typing import Any

import pytest
import trio
from helpers import create_bucket, raw_put, wait_for
from test_auth import METHODS, SECRET, _env, _options_dict, _setup
from test_transport import KICKABLE, kick, own_server

from natsfs.auth import Connection, resolve
from natsfs.bridge import Bridge, _Link, _TrioReads
from natsfs.errors import Unavailable
from natsfs.jetstream import JetStreams
from natsfs.server import NatsServer

CHUNK = 128 * 1024
NUID = "l" * 22
# Uneven sizes as nats.go may write them: empty, tiny, the default chunk, one near max_payload.
SIZES = [CHUNK, 0, 1, CHUNK, 1000 * 1024, 77, CHUNK + 3, CHUNK]


def connected(url: str, name: str) -> int:
    """How many client connections with this name the server has (asked as its system account)."""
    import nats

    async def main() -> int:
        nc = await nats.connect(url.replace("nats://", "nats://sys:sys@"))
        try:
            r = await nc.request("$SYS.REQ.SERVER.PING.CONNZ", json.dumps({"limit": 4096}).encode(), timeout=5)
            return sum(c.get("name") == name for c in json.loads(r.data)["data"]["connections"])
        finally:
            await nc.close()

    return asyncio.run(main())


def put_object(url: str, bucket: str) -> list[bytes]:
    create_bucket(url, bucket)
    chunks = [os.urandom(n) for n in SIZES]
    raw_put(url, bucket, "obj", chunks, nuid=NUID)
    return chunks


async def read_both_ways(js: JetStreams, bucket: str) -> tuple[list[Any], list[Any]]:
    """(seq, subject, pending, payload) of every chunk, by `get_batch` and by `stream_batch`."""
    stream, subject = f"OBJ_{bucket}", f"$O.{bucket}.C.{NUID}"
    whole = await js.get_batch(stream, subject, 1, 100, 8 << 20)
    batches = await js.stream_batch(stream, subject, 1, 100, 8 << 20)
    streamed = []
    try:  # (as the chunk cache does: a batch that failed still gives its reply budget back)
        while (msgs := await batches.next()) is not None:
            streamed += msgs
    finally:
        await batches.close()
    return ([(m.seq, m.subject, m.pending, m.data) for m in whole],
            [(m.seq, m.subject, m.pending, m.data) for m in streamed])


def test_batched_gets_over_the_lean_connection_match_nats_py(private_server):
    url = private_server.url
    chunks = put_object(url, "lean")

    async def main() -> None:
        seen = {}
        for lean, in_trio in ((True, True), (True, False), (False, False)):
            bridge = Bridge([url], lean_reads=lean, trio_reads=in_trio)
            await bridge.connect()
            try:
                assert bridge.lean_reads == lean and bridge.reads_in_trio == in_trio
                seen[lean, in_trio] = await read_both_ways(JetStreams(bridge), "lean")
            finally:
                await bridge.close()
        whole, streamed = seen[True, True]
        assert whole == streamed == seen[True, False][0] == seen[True, False][1]
        assert whole == seen[False, False][0] == seen[False, False][1]
        assert [bytes(d) for *_, d in whole] == chunks
        assert [p for _, _, p, _ in whole] == list(range(len(chunks) - 1, -1, -1))
        assert all(isinstance(d, bytearray) for *_, d in whole if d)  # received in place, not copied to bytes

    trio.run(main)


@pytest.mark.expect_log("nats: encountered error")  # the test's responder, when the server restarts
@pytest.mark.parametrize("in_trio", [True, False], ids=["trio", "asyncio"])
def test_a_lost_lean_connection_fails_what_is_in_flight_at_once_and_is_replaced(tmp_path, caplog, in_trio):
    """A request waiting on the lean connection when the server kicks it fails with Unavailable at once
    (not after the request timeout); a new lean connection serves the next reads; so it does after a
    server restart. The loss is logged once (by the main connection), not once per connection."""
    import nats

    server = own_server(tmp_path, KICKABLE)
    url = server.url
    chunks = put_object(url, "kick")
    subscribed = threading.Event()
    asked = threading.Event()
    stop = threading.Event()

    def responder() -> None:  # takes requests on svc.never and never answers
        async def main() -> None:
            nc = await nats.connect(url)

            async def never(_: Any) -> None:
                asked.set()

            await nc.subscribe("svc.never", cb=never)
            await nc.flush()
            subscribed.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await nc.close()

        asyncio.run(main())

    thread = threading.Thread(target=responder, daemon=True)
    thread.start()
    # Before the request is sent: without a subscriber the server answers it at once with a 503
    # "no responders", which ends the request normally.
    assert subscribed.wait(10)

    async def reads_again(js: JetStreams) -> None:
        with trio.fail_after(20):
            # (a new lean connection serves them: while there is none, batches over the main connection
            # are cut to its small fallback budget, fewer chunks than `read_both_ways` wants at once)
            while not (js.bridge._reads is not None and js.bridge._reads.nc is not None):
                await trio.sleep(0.02)
            while True:
                try:
                    whole, _ = await read_both_ways(js, "kick")
                except Unavailable:
                    await trio.sleep(0.1)
                    continue
                if len(whole) == len(chunks):
                    break
                # Cut short: the lean connection seen above was the one the server had just closed (a
                # restart), and the batch went over the main one within its fallback budget.
                assert [bytes(d) for *_, d in whole] == chunks[: len(whole)]
                await trio.sleep(0.1)
        assert [bytes(d) for *_, d in whole] == chunks

    async def main() -> None:
        bridge = Bridge([url], request_timeout=30, trio_reads=in_trio)
        await bridge.connect()
        js = JetStreams(bridge)
        try:
            assert bridge.lean_reads and bridge.reads_in_trio == in_trio
            caplog.clear()
            failed: list[bool] = []

            async def ask() -> None:
                with pytest.raises(Unavailable, match="connection to NATS lost"):
                    await bridge.request_many("svc.never", b"", max_bytes=CHUNK)
                failed.append(True)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                with trio.fail_after(10):
                    while not asked.is_set():
                        await trio.sleep(0.01)
                assert await trio.to_thread.run_sync(kick, url, "natsfs") == 2  # both of the bridge's
            # At once: failed by the connection's loss (the message above), not at its 30 s timeout
            # ("timed out after 30s").
            assert failed
            assert bridge._budget.used == 0
            await reads_again(js)
            lost = [r for r in caplog.records if "lost the connection" in r.getMessage()
                    and r.levelno >= logging.WARNING]
            assert len(lost) == 1, [r.getMessage() for r in lost]

            server.stop()
            server.start()
            await reads_again(js)
        finally:
            await bridge.close()

    try:
        trio.run(main)
    finally:
        stop.set()
        thread.join(5)
        server.stop()


@pytest.mark.parametrize("in_trio", [True, False], ids=["trio", "asyncio"])
def test_err_on_the_lean_connection_leaves_the_main_one_alone(private_server, in_trio):
    """`-ERR` (a subject over the server's control-line limit) ends only the lean connection: the
    request fails at once, the main connection is not replaced, and reads go on over a new lean one."""
    url = private_server.url
    chunks = put_object(url, f"err{int(in_trio)}")

    async def main() -> None:
        bridge = Bridge([url], request_timeout=20, trio_reads=in_trio)
        await bridge.connect()
        js = JetStreams(bridge)
        try:
            first = bridge._reads.nc if bridge._reads is not None else None
            assert first is not None
            # At once, not after the 20 s request timeout: failed by the connection's loss ("timed out
            # after 20s" would be the timeout). (The bound is a guard only.)
            with trio.fail_after(60), pytest.raises(Unavailable, match="connection to NATS lost"):
                await bridge.request_many("x." + "a" * 5000, b"")
            with trio.fail_after(10):
                while bridge._reads.nc in (None, first):
                    await trio.sleep(0.02)
            assert bridge.reads_in_trio == in_trio
            _, streamed = await read_both_ways(js, f"err{int(in_trio)}")  # over the new lean connection
            assert [bytes(d) for *_, d in streamed] == chunks
            assert bridge.connected and bridge.reconnects == 0
            assert "limits" in await bridge.api("INFO")
        finally:
            await bridge.close()

    trio.run(main)


@pytest.mark.parametrize("method", METHODS)
def test_reads_take_the_lean_connection_with_each_method(tmp_path, method):
    """Each credential the mount supports opens the lean connection too (no quiet fall back to nats-py),
    on the trio thread (TLS included), and chunks read over it are byte-exact."""
    config, options, extra_env, scheme, _secret = _setup(method, tmp_path)
    server = NatsServer(tmp_path / "nats", config=config)
    server.start()
    try:
        url = f"{scheme}://{server.host}:{server.port}"
        if method == "context":
            (tmp_path / "config" / "nats" / "context" / "prod.json").write_text(json.dumps({"url": url,
                                                                                          "token": SECRET}))
        connection = resolve({"server": None if method == "context" else url, **_options_dict(options)},
                             _env(**extra_env))

        async def main() -> None:
            bridge = Bridge(list(connection.servers), auth=connection)
            await bridge.connect()
            try:
                assert bridge.lean_reads
                assert bridge.reads_in_trio
                await bridge.api("STREAM.CREATE.OBJ_a", {"name": "OBJ_a", "subjects": ["$O.a.C.>"],
                                                         "allow_direct": True, "storage": "memory"})
                chunks = [os.urandom(n) for n in (CHUNK, 5, *[CHUNK] * 30, 1000 * 1024, CHUNK)]  # (many TLS records)
                for c in chunks:
                    await bridge.js_publish(f"$O.a.C.{NUID}", c)
                whole, streamed = await read_both_ways(JetStreams(bridge), "a")
                assert [bytes(d) for *_, d in whole] == [bytes(d) for *_, d in streamed] == chunks
            finally:
                await bridge.close()

        trio.run(main)
    finally:
        server.stop()


def test_a_refused_lean_connection_names_no_secret(tmp_path):
    server = NatsServer(tmp_path / "nats", config=f'authorization {{ user: "u1", password: "{SECRET}" }}')
    server.start()
    try:
        attempts = [
            ([server.url], Connection(user="u1", password=SECRET + "-wrong")),
            ([f"nats://u1:{SECRET}-wrong@{server.host}:{server.port}"], None),
            ([f"nats://{SECRET}@{server.host}:{server.port}"], None),
        ]
        async def refused(link: Any) -> str:  # (runs on asyncio and on trio alike)
            try:
                await link.open()
            except Unavailable as e:
                return str(e)
            finally:
                await link.close()
            raise AssertionError("connected with a wrong password")

        async def in_trio(servers: list[str], auth: Connection | None) -> str:
            bridge = Bridge(servers, auth=auth)  # (only the lean connection is opened here)
            return await refused(_TrioReads(bridge, servers, name="natsfs", auth=auth, connect_timeout=5))

        for servers, auth in attempts:
            on_asyncio = asyncio.run(refused(_Link(servers, name="natsfs", connect_timeout=5, auth=auth, lean=True)))
            for text in (on_asyncio, trio.run(in_trio, servers, auth)):
                assert "Authorization Violation" in text and SECRET not in text, text
    finally:
        server.stop()


def test_a_mount_reads_over_its_lean_connection_through_kicks(tmp_path, mounter):
    """A mount has two connections named `natsfs` (the main one and the lean one); files read through a
    fresh mount are byte-exact, and stay so when the server kicks both connections mid-read, which is
    one WARNING line per kick (the main connection's), not one per connection."""
    server = own_server(tmp_path, KICKABLE.replace("max_pending: 2MB\n", ""))
    try:
        url = server.url
        create_bucket(url, "mnt")
        sources = {}
        for i, sizes in enumerate([[CHUNK] * 40 + [5], [CHUNK, 1, 0, CHUNK + 7, 1000 * 1024, 3]]):
            chunks = [os.urandom(n) for n in sizes]
            raw_put(url, "mnt", f"f{i}.bin", chunks)
            sources[f"f{i}.bin"] = b"".join(chunks)
        m = mounter(url, "--cache-size", "4MiB")
        assert (m.path / "mnt" / "f1.bin").read_bytes() == sources["f1.bin"]
        assert kick(url, "natsfs") == 2
        assert wait_for(lambda: connected(url, "natsfs") == 2, 10)  # both replaced
        done = threading.Event()
        got: dict[str, bytes] = {}
        errors: list[OSError] = []

        def reader() -> None:
            while not done.is_set():
                try:
                    got["f0.bin"] = (m.path / "mnt" / "f0.bin").read_bytes()
                    done.set()
                except OSError as e:  # a read that lost its connection twice in a row
                    errors.append(e)

        thread = threading.Thread(target=reader)
        thread.start()
        assert kick(url, "natsfs") >= 1
        thread.join(60)
        assert not thread.is_alive()
        assert got["f0.bin"] == sources["f0.bin"]
        assert (m.path / "mnt" / "f1.bin").read_bytes() == sources["f1.bin"]
        assert all(e.errno == errno.EIO for e in errors), errors
        assert wait_for(lambda: connected(url, "natsfs") == 2, 10)
        assert m.log().count("WARNING natsfs.bridge: lost the connection to NATS") == 2, m.log()[-3000:]
    finally:
        server.stop()


def kick_lean(url: str) -> int:
    """Disconnect the lean connections (`natsfs.wire`'s, version `natsfs-wire`) from the server side."""
    import nats

    async def main() -> int:
        nc = await nats.connect(url.replace("nats://", "nats://sys:sys@"))
        try:
            r = await nc.request("$SYS.REQ.SERVER.PING.CONNZ", json.dumps({"limit": 4096}).encode(), timeout=5)
            info = json.loads(r.data)
            cids = [c["cid"] for c in info["data"]["connections"] if c.get("version") == "natsfs-wire"]
            for cid in cids:
                await nc.request(f"$SYS.REQ.SERVER.{info['server']['id']}.KICK", json.dumps({"cid": cid}).encode(),
                                 timeout=5)
            return len(cids)
        finally:
            await nc.close()

    return asyncio.run(main())


def test_a_kick_of_the_lean_connection_alone_with_replies_in_flight_shrinks_the_budget(tmp_path, caplog):
    """The server drops the lean connection alone while replies are in flight: it takes the lean
    connection again at once (it is alive), so it was a kick, and the reply budget drops to its floor
    with one WARNING; the main connection is never replaced."""
    from natsfs.bridge import MIN_REPLY_BUDGET

    server = own_server(tmp_path, KICKABLE)

    async def main() -> None:
        bridge = Bridge([server.url])
        await bridge.connect()
        try:
            reads = bridge._reads
            assert isinstance(reads, _TrioReads) and reads.nc is not None
            first = reads.nc
            held = await bridge._budget.acquire(4 * 1024 * 1024)  # replies in flight
            caplog.clear()
            assert await trio.to_thread.run_sync(kick_lean, server.url) == 1
            with trio.fail_after(20):
                while reads.nc in (None, first):
                    await trio.sleep(0.02)
            bridge._budget.release(held)
            assert bridge._budget.limit == MIN_REPLY_BUDGET
            shrunk = [r for r in caplog.records if "at most 256 KiB in flight from now on" in r.getMessage()]
            assert [r.levelno for r in shrunk] == [logging.WARNING]
            assert not [r for r in caplog.records if "is gone" in r.getMessage()]
            assert bridge.connected and bridge.reconnects == 0
        finally:
            await bridge.close()

    caplog.set_level(logging.INFO, logger="natsfs.bridge")
    try:
        trio.run(main)
    finally:
        server.stop()
