"""The transport under load and errors: slow-consumer kicks, server restarts, `-ERR` replies.

Real processes throughout: servers of the tests' own (small `max_pending`, restarts), the daemon in a
child process, and a fresh nats-py client to check every byte afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from helpers import create_bucket, raw_put, wait_for

from natsfs.bridge import Bridge
from natsfs.errors import NotFound, OutcomeUnknown, Unavailable
from natsfs.server import NatsServer

T = TypeVar("T")
CHUNK = 128 * 1024
BROKEN = b"<meta without its chunks>"


def own_server(tmp_path: Path, conf: str = "") -> NatsServer:
    """A nats-server with its own config file (e.g. a small `max_pending`)."""
    cfg = tmp_path / "nats.conf"
    cfg.write_text(conf)
    server = NatsServer(tmp_path / "nats", extra_args=("-c", str(cfg)))
    server.start()
    return server


# A server whose system account can kick clients (`$SYS.REQ.SERVER.<id>.KICK`); other clients, the
# mount among them, connect without credentials as the JetStream account's user.
KICKABLE = """
max_pending: 2MB
accounts {
  APP { jetstream: enabled, users: [{user: app, password: app}] }
  SYS { users: [{user: sys, password: sys}] }
}
system_account: SYS
no_auth_user: app
"""


def kick(url: str, *names: str) -> int:
    """Disconnect every client with one of these connection names, from the server side."""
    import nats

    async def main() -> int:
        nc = await nats.connect(url.replace("nats://", "nats://sys:sys@"))
        try:
            r = await nc.request("$SYS.REQ.SERVER.PING.CONNZ", json.dumps({"limit": 4096}).encode(), timeout=5)
            info = json.loads(r.data)
            cids = [c["cid"] for c in info["data"]["connections"] if c.get("name") in names]
            for cid in cids:
                await nc.request(f"$SYS.REQ.SERVER.{info['server']['id']}.KICK", json.dumps({"cid": cid}).encode(),
                                 timeout=5)
            return len(cids)
        finally:
            await nc.close()

    return asyncio.run(main())


def fresh_get(url: str, bucket: str, name: str) -> bytes | None:
    """An object's bytes as a fresh nats-py client reads them (the meta, then its chunks one direct
    get at a time, which no small max_pending minds): None without a live meta, BROKEN when the
    chunks do not add up to the meta."""
    import nats

    async def main() -> bytes | None:
        nc = await nats.connect(url)
        try:
            stream = f"OBJ_{bucket}"
            enc = base64.urlsafe_b64encode(name.encode()).decode()
            m = await nc.request(f"$JS.API.DIRECT.GET.{stream}.$O.{bucket}.M.{enc}", b"", timeout=10)
            if not m.data:
                return None
            meta = json.loads(m.data)
            if meta.get("deleted"):
                return None
            parts, seq = [], 1
            while len(parts) < meta["chunks"]:
                body = {"seq": seq, "next_by_subj": f"$O.{bucket}.C.{meta['nuid']}"}
                r = await nc.request(f"$JS.API.DIRECT.GET.{stream}", json.dumps(body).encode(), timeout=10)
                if not r.data and not (r.headers or {}).get("Nats-Sequence"):
                    break  # 404: no more chunks
                parts.append(r.data)
                seq = int(r.headers["Nats-Sequence"]) + 1
            data = b"".join(parts)
            digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
            if len(data) != meta["size"] or len(parts) != meta["chunks"] or digest != meta.get("digest", digest):
                return BROKEN
            return data
        finally:
            await nc.close()

    return asyncio.run(main())


def put_sources(url: str, bucket: str, count: int, size: int) -> dict[str, bytes]:
    sources = {f"src/{i}.bin": os.urandom(size) for i in range(count)}
    for name, data in sources.items():
        raw_put(url, bucket, name, [data[o : o + CHUNK] for o in range(0, len(data), CHUNK)])
    return sources


# ---------------------------------------------------------------------------------------------- the bridge
def test_err_from_server_replaces_the_client_and_restores_subscriptions(private_server):
    """A subject over the control-line limit gets `-ERR` and nats-py closes its client for good: the
    bridge makes a new one, the publish in flight is OutcomeUnknown (sent, no ack), subscriptions
    keep delivering, and later requests work."""
    url = private_server.url

    async def main() -> None:
        bridge = Bridge([url], request_timeout=5)
        await bridge.connect()
        try:
            sub = await bridge.subscribe("natsfs.test.events")
            before = bridge.server_info.get("server_id")
            # At once, not after the request timeout: failed by the connection's loss ("not acknowledged
            # in 5s" would be the timeout). (The bound is a guard only.)
            with trio.fail_after(60):
                with pytest.raises(OutcomeUnknown, match="connection to NATS lost"):
                    await bridge.js_publish("x." + "a" * 5000, b"payload")
            with trio.fail_after(10):
                while not bridge.connected or bridge.reconnects < 1:
                    await trio.sleep(0.02)
            assert bridge.server_info.get("server_id") == before
            reply = await bridge.api("INFO")
            assert "limits" in reply or "memory" in reply
            await publish_elsewhere(url, "natsfs.test.events", b"after")
            with trio.fail_after(30):
                got = []
                while not got:
                    got = await sub.next_batch(1)
            assert [m.data for m in got] == [b"after"]
            with pytest.raises(NotFound):
                await bridge.request("natsfs.test.nobody", b"")
            await sub.unsubscribe()
        finally:
            await bridge.close()

    trio.run(main)


async def publish_elsewhere(url: str, subject: str, data: bytes) -> None:
    import nats

    async def main() -> None:
        nc = await nats.connect(url)
        await nc.publish(subject, data)
        await nc.flush()
        await nc.close()

    await trio.to_thread.run_sync(lambda: asyncio.run(main()))


@pytest.mark.expect_log("nats: encountered error")
def test_requests_in_flight_fail_at_once_and_late_replies_are_dropped(private_server):
    """A request whose connection is lost fails with Unavailable at once; its reply, arriving later on
    the old inbox, completes nothing; a publish that cannot be sent is Unavailable, not OutcomeUnknown."""
    import nats

    url = private_server.url
    held: list[str] = []
    responder_ready = threading.Event()
    stop = threading.Event()

    def responder() -> None:
        async def main() -> None:
            nc = await nats.connect(url)

            async def slow(m: Any) -> None:
                held.append(m.reply)  # answered only later, after the asker's client was replaced

            async def fast(m: Any) -> None:
                await nc.publish(m.reply, b"fast:" + m.data)

            await nc.subscribe("svc.slow", cb=slow)
            await nc.subscribe("svc.fast", cb=fast)
            await nc.flush()
            responder_ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
                if late.is_set():
                    while held:
                        await nc.publish(held.pop(), b"late")
            await nc.close()

        asyncio.run(main())

    late = threading.Event()
    thread = threading.Thread(target=responder, daemon=True)
    thread.start()
    assert responder_ready.wait(10)

    async def main() -> None:
        bridge = Bridge([url], request_timeout=8)
        await bridge.connect()
        try:
            outcome: list[BaseException] = []

            async def ask_slow() -> None:
                try:
                    await bridge.request("svc.slow", b"1")
                except Unavailable as e:
                    outcome.append(e)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask_slow)
                with trio.fail_after(30):
                    while not held:
                        await trio.sleep(0.01)
                with pytest.raises(OutcomeUnknown):
                    await bridge.js_publish("x." + "b" * 5000, b"")
            # Failed by the connection's loss, not at its 8 s request timeout ("timed out after 8s").
            assert outcome and "connection to NATS lost" in str(outcome[0]), outcome
            late.set()  # the old request's reply now goes to the old inbox
            for i in range(20):
                reply = await bridge.request("svc.fast", str(i).encode())
                assert reply.data == f"fast:{i}".encode()
            # A publish that never leaves (no server): Unavailable, never OutcomeUnknown.
            private_server.stop()
            with trio.fail_after(10):
                while bridge.connected:
                    await trio.sleep(0.02)
            with pytest.raises(Unavailable) as info:
                await bridge.js_publish("$O.none.C.x", b"", timeout=0.5)
            assert not isinstance(info.value, OutcomeUnknown)
            private_server.start()
            with trio.fail_after(15):
                while not bridge.connected:
                    await trio.sleep(0.05)
            assert "limits" in await bridge.api("INFO")
        finally:
            await bridge.close()

    try:
        trio.run(main)
    finally:
        stop.set()
        thread.join(5)


def test_kicked_clients_end_for_good(tmp_path, caplog):
    """The server kicks the bridge again and again while publishes of 1 MiB are queued: nats-py's own
    close of a kicked client often stops half-way (its last flush to the reset socket fails), and each
    replaced client is then ended by the bridge: afterwards no burial is left, the only nats-py client
    alive is the current one, and asyncio reported no task destroyed pending and no exception never
    retrieved."""
    import gc

    import nats.aio.client

    server = own_server(tmp_path, KICKABLE)
    try:
        url = server.url

        async def main() -> None:
            bridge = Bridge([url], request_timeout=5, lean_reads=False)
            await bridge.connect()
            try:
                async def publish() -> None:
                    while True:
                        with contextlib.suppress(Unavailable, NotFound):
                            await bridge.js_publish_many([("nobody.here", os.urandom(1 << 20), None)] * 16)
                        await trio.sleep(0)

                kicked = tries = 0
                async with trio.open_nursery() as nursery:
                    for _ in range(4):
                        nursery.start_soon(publish)
                    # Six kicks that found the client (a kick between two clients finds none: how many do
                    # depends on how fast it reconnects, so the count of tries is not what is asserted).
                    while kicked < 6:
                        assert tries < 400, f"only {kicked} of {tries} kicks found a client to kick"
                        await trio.sleep(0.15)
                        kicked += await trio.to_thread.run_sync(kick, url, "natsfs")
                        tries += 1
                    nursery.cancel_scope.cancel()
                # The last kick may reach a client the bridge still counts as connected: it is back, for
                # good, once a request is answered.
                with trio.fail_after(30):
                    while True:
                        while not bridge.connected or bridge.reconnects < 1:
                            await trio.sleep(0.05)
                        with contextlib.suppress(Unavailable):
                            assert "limits" in await bridge.api("INFO")
                            break
                link = bridge._link
                assert link is not None
                with trio.fail_after(30):  # (bounded by _BURY_GRACE per client; no speed asserted)
                    while link.burials:
                        await trio.sleep(0.05)

                def live_clients() -> int:
                    gc.collect()
                    return sum(isinstance(o, nats.aio.client.Client) for o in gc.get_objects())

                assert await bridge.run_on_loop(_on_loop(live_clients)) == 1
                assert "limits" in await bridge.api("INFO")
            finally:
                await bridge.close()

        trio.run(main)
    finally:
        server.stop()
    reported = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not [m for m in reported if "Task was destroyed" in m or "never retrieved" in m], reported


async def _on_loop(fn: Callable[[], T]) -> T:
    """`fn()` run on the bridge's asyncio loop thread (as a coroutine for `Bridge.run_on_loop`)."""
    return fn()


# ---------------------------------------------------------------------------------------------- the mount
def test_oversize_subject_never_kills_the_mount(private_server, mounter, tmp_path):
    """A ~5000-byte path (components of 250 bytes): whatever it gets (ENAMETOOLONG before anything is
    sent, or EIO after the server's `-ERR` ended the connection), the same mount keeps working."""
    url = private_server.url
    create_bucket(url, "long")
    m = mounter(url)
    base = m.path / "long"
    dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    failure: OSError | None = None
    try:
        for depth in range(20):
            name = f"{depth:02d}" + "d" * 248
            try:
                if depth < 19:
                    os.mkdir(name, dir_fd=dir_fd)
                    nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)
                    os.close(dir_fd)
                    dir_fd = nxt
                else:
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dir_fd)
                    try:
                        os.write(fd, b"x" * 1000)
                    finally:
                        os.close(fd)
            except OSError as e:
                failure = e
                break
    finally:
        os.close(dir_fd)
    assert failure is not None and failure.errno in (errno.ENAMETOOLONG, errno.EIO), failure
    data = os.urandom(3 * CHUNK + 17)

    def works() -> bool:
        try:
            (base / "after.bin").write_bytes(data)
            return (base / "after.bin").read_bytes() == data
        except OSError:
            return False

    assert wait_for(works, timeout=15), m.log()[-3000:]
    assert fresh_get(url, "long", "after.bin") == data
    assert m.alive
    assert "failed unexpectedly" not in m.log()


def test_chunks_fit_a_server_with_a_small_max_payload(tmp_path, mounter):
    """A server that takes messages of at most 64 KiB: the mount writes smaller chunks (one WARNING),
    so files larger than that store and read back, for the mount and for another client."""
    server = own_server(tmp_path, "max_payload: 65536")
    try:
        create_bucket(server.url, "small")
        m = mounter(server.url)
        data = os.urandom(5 * 65536 + 123)
        (m.path / "small" / "big.bin").write_bytes(data)
        assert fresh_get(server.url, "small", "big.bin") == data
        meta = json.loads(os.getxattr(m.path / "small" / "big.bin", "user.nats.chunk_size"))
        assert meta == 61440  # the largest multiple of 4 KiB that fits with the headers' room
        assert (m.path / "small" / "big.bin").read_bytes() == data
        assert m.log().count("writing objects in chunks of 61440 bytes, not 131072") == 1
    finally:
        server.stop()


def test_a_server_with_a_small_max_control_line_drops_the_connection_once_per_limit_learned(tmp_path, mounter):
    """nats-server's `max_control_line` (4096 by default, which the names are checked against) is not in
    its INFO. Set to 1024, a mkdir whose meta subject is over it had the mount send that subject again and
    again while settling the publish: the server dropped the connection every 2 s for 30 s (a WARNING and
    an INFO line each, and everything else in flight failed with it), then the mkdir failed EIO. Now the
    connection is dropped once, the mkdir fails ENAMETOOLONG (nothing stored), and names as long are
    refused before anything is sent, as over the default limit."""
    server = own_server(tmp_path, "max_control_line: 1024")
    try:
        create_bucket(server.url, "b")
        m = mounter(server.url)
        deep = m.path / "b" / ("a" * 255) / ("b" * 255)
        deep.mkdir(parents=True)  # its meta subject is about 690 bytes: taken
        with pytest.raises(OSError) as e:
            (deep / ("c" * 255)).mkdir()  # about 1030 bytes: the server drops the connection
        assert e.value.errno == errno.ENAMETOOLONG
        assert m.log().count("lost the connection to NATS") == 1
        with pytest.raises(OSError) as e:
            (deep / ("d" * 255)).mkdir()  # as long: refused before it is sent
        assert e.value.errno == errno.ENAMETOOLONG
        with pytest.raises(OSError) as e:
            (deep / ("e" * 255)).write_bytes(b"x")
        assert e.value.errno == errno.ENAMETOOLONG
        assert m.log().count("lost the connection to NATS") == 1
        assert sorted(os.listdir(deep)) == []
        (deep / "short").write_bytes(b"still served")  # the mount works on
        assert fresh_get(server.url, "b", f"{'a' * 255}/{'b' * 255}/short") == b"still served"
    finally:
        server.stop()


@pytest.mark.expect_log(
    "(read|flush): .*connection to NATS",
    "kick/w/[0-9]+.bin: closed without a successful upload",
)
def test_kicks_under_16_readers_and_16_writers(tmp_path, mounter):
    """A server with a small max_pending drops the daemon as a slow consumer, and its system account
    kicks the daemon's and the upload worker's connections again and again, while 16 readers and 16
    writers of 8 MiB files work through the mount. Every read is byte-exact or an error; every write
    closed without error is byte-exact for a fresh client; the mount serves afterwards."""
    server = own_server(tmp_path, KICKABLE)
    try:
        url = server.url
        create_bucket(url, "kick")
        size = 8 * 1024 * 1024
        sources = put_sources(url, "kick", 16, size)
        m = mounter(url, "--cache-size", "16MiB")
        base = m.path / "kick"
        wrong: list[str] = []
        read_errors: list[OSError] = []
        short_reads: list[str] = []
        written: dict[str, bytes] = {}
        attempted: dict[str, bytes] = {}
        write_errors: dict[str, OSError] = {}
        lock = threading.Lock()

        def reader(name: str) -> None:
            want = sources[name]
            try:
                fd = os.open(base / name, os.O_RDONLY)
            except OSError as e:
                with lock:
                    read_errors.append(e)
                return
            try:
                for off in range(0, size, 1024 * 1024):
                    try:
                        got = os.pread(fd, 1024 * 1024, off)
                    except OSError as e:
                        with lock:
                            read_errors.append(e)
                        continue
                    if len(got) < min(1024 * 1024, size - off) and got == want[off : off + len(got)]:
                        # A read the kernel split into several requests, one of which failed: the
                        # bytes before the failure, exact (a short read, then the error).
                        with lock:
                            short_reads.append(f"{name}@{off}")
                        continue
                    if got != want[off : off + 1024 * 1024]:
                        first = next((i for i, (a, b) in enumerate(zip(got, want[off:], strict=False)) if a != b),
                                     min(len(got), 1024 * 1024))
                        with lock:
                            wrong.append(f"{name}@{off}: {len(got)} bytes, first wrong at {first}")
            finally:
                os.close(fd)

        def writer(i: int) -> None:
            name = f"w/{i}.bin"
            data = os.urandom(size)
            with lock:
                attempted[name] = data
            try:
                with open(base / name, "wb") as f:
                    for off in range(0, size, 1024 * 1024):
                        f.write(data[off : off + 1024 * 1024])
            except OSError as e:
                with lock:
                    write_errors[name] = e
                return
            with lock:
                written[name] = data

        (base / "w").mkdir()
        threads = [threading.Thread(target=reader, args=(n,)) for n in sources]
        threads += [threading.Thread(target=writer, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        kicked = 0
        for _ in range(6):  # forced disconnects of the daemon and its upload worker
            time.sleep(0.5)
            kicked += kick(url, "natsfs", "natsfs-upload-worker")
        assert kicked
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads)
        assert not wrong, f"wrong bytes served: {wrong}"
        assert all(e.errno in (errno.EIO, errno.ESTALE) for e in read_errors), read_errors
        for name, data in written.items():
            assert fresh_get(url, "kick", name) == data, name
        left = {"none": 0, "broken": 0, "whole": 0}
        for name in write_errors:
            got = fresh_get(url, "kick", name)
            left["none" if got is None else "broken" if got == BROKEN else "whole"] += 1
            # A write reported as failed is not in the bucket, or (its outcome was unknown at close and
            # the meta landed after all) whole; never a meta whose chunks are missing.
            assert got is None or got == attempted[name], \
                f"{name} ({write_errors[name]}): {len(got)} bytes, not what was written"

        # The mount serves again, within seconds: reads and writes, checked by a fresh client.
        data = os.urandom(3 * 1024 * 1024 + 5)

        def serves() -> bool:
            try:
                (base / "after.bin").write_bytes(data)
                return (base / "after.bin").read_bytes() == data and \
                    (base / "src/0.bin").read_bytes() == sources["src/0.bin"]
            except OSError:
                return False

        assert wait_for(serves, timeout=30), m.log()[-3000:]
        assert fresh_get(url, "kick", "after.bin") == data
        log = m.log()
        assert "failed unexpectedly" not in log
        assert "reconnected to NATS" in log
        # Each replaced client was ended, not left to the garbage collector (the mounter checks the
        # whole log again after the unmount).
        assert "Task was destroyed" not in log and "never retrieved" not in log, log[-3000:]
        print(f"\nreads failed: {len(read_errors)} (short: {len(short_reads)}), writes failed: {len(write_errors)}, "
              f"connection losses: {log.count('lost the connection to NATS')}, failed writes left {left}")
    finally:
        server.stop()


def test_small_max_pending_kicks_the_lean_connection_once_and_the_main_one_never(tmp_path, mounter):
    """A server with a `max_pending` of 512 KB (the daemon cannot learn it: it is not in INFO), rounds
    of three parallel cold readers of fresh objects, a writer in the last: the first kick of the lean
    connection (the reads' own, `vnatsfs-wire` in the server log) takes the reply budget to its floor at
    once, so no further drop follows, and the main connection (nats-py's, with the watchers and
    publishes) is never dropped, also not while the lean one is being replaced. Every byte is right and
    the daemon logs no ERROR. Before, halving took five kicks from 32 MiB, the floor of 1 MiB still
    passed a 1 MB `max_pending`, and reads sent over the main connection meanwhile got it dropped too."""
    server = own_server(tmp_path, "max_pending: 512KB\nmax_payload: 512KB\n")
    try:
        url = server.url
        create_bucket(url, "sc")
        m = mounter(url, "--cache-size", "16MiB")
        base = m.path / "sc"
        digests: dict[str, str] = {}
        errors: list[BaseException] = []

        def reader(name: str) -> None:
            try:
                assert wait_for(lambda: (base / name).exists(), timeout=10)  # (the watcher shows the new object)
                digests[name] = hashlib.sha256((base / name).read_bytes()).hexdigest()
            except BaseException as e:
                errors.append(e)

        def writer(name: str, data: bytes) -> None:
            try:
                (base / name).write_bytes(data)
            except BaseException as e:
                errors.append(e)

        written = os.urandom(3 * 1024 * 1024 + 11)
        for round_ in range(3):
            sources = {f"r{round_}/{i}.bin": os.urandom(8 * 1024 * 1024) for i in range(3)}
            for name, data in sources.items():
                raw_put(url, "sc", name, [data[o : o + CHUNK] for o in range(0, len(data), CHUNK)])
            threads = [threading.Thread(target=reader, args=(n,)) for n in sources]
            if round_ == 2:
                threads.append(threading.Thread(target=writer, args=("w.bin", written)))
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors, errors
            want = {n: hashlib.sha256(d).hexdigest() for n, d in sources.items()}
            assert {n: digests.get(n) for n in sources} == want
        assert fresh_get(url, "sc", "w.bin") == written
        drops = [line for line in server.log_file.read_text().splitlines() if "Slow Consumer" in line]
        assert not [line for line in drops if '"vnatsfs-wire:' not in line], drops  # the main connection
        assert len(drops) <= 1, drops
        log = m.log()
        assert " ERROR " not in log, log[-3000:]
        assert "lost the connection to NATS" not in log  # (the main connection's WARNING)
    finally:
        server.stop()


def test_paused_daemon_with_four_readers_stays_connected(private_server, mounter):
    """A default server, four parallel readers of large objects through a small cache, and the daemon
    stopped for a moment mid-read (SIGSTOP: nothing is read from its socket meanwhile): what the
    server holds for it stays within the daemon's reply budget, far under the default max_pending, so
    no slow-consumer disconnect and no ERROR, and every byte is right. The full-size scenario of issue
    8 (four readers of 256 MiB objects, `--cache-size 64MiB`, a default server) is too slow for the
    suite on two cores and is run by hand; on 2026-11-23 it read 140 MiB/s in total with no disconnect
    and no ERROR, where the code before the reply budget read 37 MiB/s, was kicked twice and logged 8
    ERRORs."""
    url = private_server.url
    create_bucket(url, "par")
    size = 48 * 1024 * 1024
    sources = put_sources(url, "par", 4, size)
    m = mounter(url, "--cache-size", "16MiB")
    digests: dict[str, str] = {}
    errors: list[BaseException] = []

    def reader(name: str) -> None:
        h = hashlib.sha256()
        try:
            with open(m.path / "par" / name, "rb") as f:
                while block := f.read(1024 * 1024):
                    h.update(block)
        except OSError as e:
            errors.append(e)
        digests[name] = h.hexdigest()

    threads = [threading.Thread(target=reader, args=(n,)) for n in sources]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert m.proc is not None
    os.kill(m.proc.pid, signal.SIGSTOP)
    time.sleep(1.5)
    os.kill(m.proc.pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert not errors
    assert digests == {n: hashlib.sha256(d).hexdigest() for n, d in sources.items()}
    log = m.log()
    assert "lost the connection" not in log
    assert " ERROR " not in log, log[-3000:]
    assert "Slow Consumer" not in private_server.log_file.read_text()


def test_a_request_asks_for_what_it_was_granted_when_the_budget_shrank_meanwhile(private_server):
    """A batched get that waited for the reply budget while a kick shrank it asks the server for what it
    was granted, not for what it wanted before: the bytes it brings fit the floor."""
    from natsfs.bridge import MIN_REPLY_BUDGET

    url = private_server.url
    create_bucket(url, "grant")
    data = os.urandom(16 * CHUNK)
    raw_put(url, "grant", "obj", [data[o : o + CHUNK] for o in range(0, len(data), CHUNK)], nuid="g" * 22)

    async def main() -> None:
        bridge = Bridge([url], reply_budget=4 * 1024 * 1024)
        await bridge.connect()
        try:
            want = bridge.max_batch_bytes
            assert want > MIN_REPLY_BUDGET
            asked: list[int] = []

            def payload(max_bytes: int) -> bytes:
                asked.append(max_bytes)
                body = {"seq": 1, "next_by_subj": "$O.grant.C." + "g" * 22, "batch": 16, "max_bytes": max_bytes}
                return json.dumps(body).encode()

            held = await bridge._budget.acquire(4 * 1024 * 1024)  # the whole budget: the request waits
            got: list[Any] = []
            async with trio.open_nursery() as nursery:
                async def one() -> None:
                    got.extend(await bridge.request_many("$JS.API.DIRECT.GET.OBJ_grant", payload, max_bytes=want))

                nursery.start_soon(one)
                await trio.sleep(0.1)
                assert not asked  # still waiting
                bridge._budget.shrink()  # a kick meanwhile
                bridge._budget.release(held)
            assert asked == [MIN_REPLY_BUDGET - CHUNK]
            assert sum(len(m.data) for m in got) <= MIN_REPLY_BUDGET
            assert b"".join(m.data for m in got) == data[: len(got) * CHUNK] and got
        finally:
            await bridge.close()

    trio.run(main)


def test_request_budget_bounds_replies_in_flight(private_server):
    """Batched direct gets wait for the reply budget: however many are asked at once, the bytes asked
    for and not yet taken never pass it, and every reply arrives."""
    url = private_server.url
    create_bucket(url, "budget")
    data = os.urandom(64 * CHUNK)
    raw_put(url, "budget", "obj", [data[o : o + CHUNK] for o in range(0, len(data), CHUNK)], nuid="n" * 22)

    async def main() -> None:
        bridge = Bridge([url], reply_budget=2 * 1024 * 1024)
        await bridge.connect()
        try:
            assert bridge.max_batch_bytes <= 2 * 1024 * 1024
            peak = 0
            got: dict[int, bytes] = {}

            async def one(start: int) -> None:
                want = bridge.max_batch_bytes
                body = {"seq": start, "next_by_subj": "$O.budget.C." + "n" * 22, "batch": 64, "max_bytes": want}
                msgs = await bridge.request_many("$JS.API.DIRECT.GET.OBJ_budget", json.dumps(body).encode(),
                                                 max_bytes=want)
                for msg in msgs:
                    got[int(msg.headers["Nats-Sequence"])] = msg.data

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, bridge._budget.used)
                    await trio.sleep(0.001)

            async with trio.open_nursery() as outer:
                outer.start_soon(watch)
                async with trio.open_nursery() as nursery:
                    for start in range(1, 65, 4):
                        nursery.start_soon(one, start)
                outer.cancel_scope.cancel()
            assert 0 < peak <= 2 * 1024 * 1024
            assert bridge._budget.used == 0
            assert b"".join(got[s] for s in sorted(got)) == data
        finally:
            await bridge.close()

    trio.run(main)
