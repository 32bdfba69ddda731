"""The ordered consumers over the main connection (`jetstream._ConsumerStream`: a bucket watch's snapshot,
the ordered headers-only scan, `sequences`) catch up through byte-bounded pull requests, then hand over
to the live push consumer: a daemon that stops taking what they deliver for a while (a starved process,
here a reader that sleeps mid-catch-up with far more than the server's 2 MB `max_pending` still to come)
is not dropped as a slow consumer, and every message is delivered exactly once, across the hand-over
too (proven by stream sequence)."""

from __future__ import annotations

import base64
import logging
from typing import Any

import pytest
import trio
from helpers import create_bucket, wait_for, with_nats
from test_transport import KICKABLE, own_server

from natsfs import bridge as bridge_module
from natsfs import jetstream as jetstream_module
from natsfs.bridge import Bridge
from natsfs.jetstream import JetStreams

BUCKET = "pull"
STREAM = f"OBJ_{BUCKET}"
METAS, CHUNKS = 8_000, 8_000  # each with 2 KiB of headers: 16 MB of deliveries apiece
PAD = "x" * 2048
CHUNK = f"$O.{BUCKET}.C.padded"
STARVED_S = 3.0


def meta(name: str) -> str:
    return f"$O.{BUCKET}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def publish_metas(url: str, names: list[str]) -> list[int]:
    """Metas (with rollup, and 2 KiB of headers) under these names; their stream sequences."""

    async def fn(nc: Any, js: Any) -> list[int]:
        acks = [await js.publish(meta(n), b'{"name": "%s"}' % n.encode(), headers={"Nats-Rollup": "sub", "X-Pad": PAD})
                for n in names]
        return [a.seq for a in acks]

    return with_nats(url, fn)


@pytest.fixture
def padded(tmp_path):
    """A server with a 2 MB `max_pending` whose stream holds METAS metas (sequences 1..METAS), then
    CHUNKS messages on one chunk subject, every one with 2 KiB of headers."""
    server = own_server(tmp_path, KICKABLE)
    url = server.url
    try:
        create_bucket(url, BUCKET)

        async def fast(nc: Any, js: Any) -> None:
            for i in range(METAS):
                await nc.publish(meta(f"m{i:05d}"), b'{}', headers={"Nats-Rollup": "sub", "X-Pad": PAD})
            for _ in range(CHUNKS):
                await nc.publish(CHUNK, b"abc", headers={"X-Pad": PAD})
            await nc.flush()

        with_nats(url, fast)

        async def stored(nc: Any, js: Any) -> int:
            return (await js.stream_info(STREAM)).state.messages

        assert wait_for(lambda: with_nats(url, stored) == METAS + CHUNKS, timeout=60)
        yield server
    finally:
        server.stop()


def starve_once(monkeypatch: pytest.MonkeyPatch, after: int, meanwhile: Any = None) -> list[int]:
    """Make trio stop taking the deliveries of any subscription for STARVED_S once `after` messages were
    taken (running `meanwhile` in a thread first): what the server sends meanwhile waits for the daemon.
    Returns the list that counts the messages taken."""
    taken = [0]
    starved: list[bool] = []
    real = bridge_module.Subscription.next_batch

    async def next_batch(self: Any, timeout: float | None = None) -> list[Any]:
        if taken[0] >= after and not starved:
            starved.append(True)
            if meanwhile is not None:
                await trio.to_thread.run_sync(meanwhile)
            await trio.sleep(STARVED_S)
        batch = await real(self, timeout)
        taken[0] += len(batch)
        return batch

    monkeypatch.setattr(bridge_module.Subscription, "next_batch", next_batch)
    return taken


def test_a_watch_whose_reader_starves_while_it_catches_up_is_not_dropped(padded, monkeypatch):
    """A last-per-subject watch of the metas, its reader starved once 2,000 were taken (another client
    puts 20 metas meanwhile, before the catch-up ends), then 20 more puts once caught up (after the
    hand-over to the live consumer): no reconnect, and the watch delivers every meta's sequence exactly
    once, in order."""
    url = padded.url
    during = [f"during{i}" for i in range(20)]
    got_during: list[int] = []
    taken = starve_once(monkeypatch, 2_000, lambda: got_during.extend(publish_metas(url, during)))

    async def main() -> None:
        bridge = Bridge([url], request_timeout=30)
        await bridge.connect()
        js = JetStreams(bridge)
        try:
            w = await js.watch(STREAM, f"$O.{BUCKET}.M.>")
            seqs: list[int] = []
            with trio.fail_after(120):
                while True:
                    batch = await w.next_batch(timeout=1.0)
                    assert not batch.reset
                    seqs += [m.seq for m in batch.msgs]
                    if batch.caught_up:
                        break
            assert taken[0] >= 2_000 and got_during  # (the reader did starve, and the puts came meanwhile)
            assert seqs == [*range(1, METAS + 1), *got_during]
            after = publish_metas(url, [f"after{i}" for i in range(20)])
            with trio.fail_after(60):
                while len(seqs) < METAS + 40:
                    seqs += [m.seq for m in (await w.next_batch(timeout=1.0)).msgs]
            await trio.sleep(0.5)
            seqs += [m.seq for m in (await w.next_batch(timeout=0.2)).msgs]
            assert seqs == [*range(1, METAS + 1), *got_during, *after]  # (each once, across the hand-over)
            assert bridge.reconnects == 0
            await w.close()
        finally:
            await bridge.close()

    trio.run(main)
    assert "Slow Consumer" not in padded.log_file.read_text(errors="replace")


@pytest.mark.parametrize("scan", ["ordered_index", "sequences"])
def test_an_ordered_scan_whose_reader_starves_is_not_dropped(padded, monkeypatch, scan):
    """The ordered headers-only scan of the chunk subject, and `sequences` over the whole stream, their
    reader starved once 2,000 deliveries were taken: no reconnect, and the exact answer."""
    url = padded.url
    taken = starve_once(monkeypatch, 2_000)

    async def main() -> None:
        bridge = Bridge([url], request_timeout=30)
        await bridge.connect()
        js = JetStreams(bridge)
        try:
            with trio.fail_after(120):
                if scan == "ordered_index":
                    got: list[Any] = await js._ordered_index(STREAM, CHUNK)
                    assert got == [(seq, 3) for seq in range(METAS + 1, METAS + CHUNKS + 1)]
                else:
                    got = await js.sequences(STREAM, 1, METAS + CHUNKS + 1)
                    assert got == list(range(1, METAS + CHUNKS + 1))
            assert taken[0] >= 2_000
            assert bridge.reconnects == 0
        finally:
            await bridge.close()

    trio.run(main)
    assert "Slow Consumer" not in padded.log_file.read_text(errors="replace")


def test_a_user_refused_pull_requests_catches_up_by_push(tmp_path, caplog):
    """The server refuses the user the pull requests (`$JS.API.CONSUMER.MSG.NEXT`) but lets it create
    consumers: the watch catches up by push instead, with every meta, then follows live puts; nothing
    is logged above INFO."""
    conf = """
authorization {
  users: [
    { user: admin, password: admin }
    { user: nopull, password: nopull,
      permissions: { publish: { allow: [">"], deny: ["$JS.API.CONSUMER.MSG.NEXT.>"] }, subscribe: { allow: [">"] } } }
  ]
}
"""
    server = own_server(tmp_path, conf)
    admin = server.url.replace("nats://", "nats://admin:admin@")
    try:
        create_bucket(admin, BUCKET)
        before = publish_metas(admin, [f"n{i}" for i in range(50)])

        async def main() -> None:
            bridge = Bridge([server.url.replace("nats://", "nats://nopull:nopull@")])
            await bridge.connect()
            js = JetStreams(bridge)
            try:
                w = await js.watch(STREAM, f"$O.{BUCKET}.M.>")
                seqs: list[int] = []
                with trio.fail_after(60):
                    while True:
                        batch = await w.next_batch(timeout=1.0)
                        seqs += [m.seq for m in batch.msgs]
                        if batch.caught_up:
                            break
                assert seqs == before and STREAM in js._pulls_refused
                after = await trio.to_thread.run_sync(publish_metas, admin, ["later"])
                with trio.fail_after(30):
                    while len(seqs) < len(before) + 1:
                        seqs += [m.seq for m in (await w.next_batch(timeout=1.0)).msgs]
                assert seqs == before + after and bridge.reconnects == 0
                await w.close()
            finally:
                await bridge.close()

        caplog.clear()
        trio.run(main)
        assert not [r.getMessage() for r in caplog.records if r.levelno > logging.INFO]
    finally:
        server.stop()


def test_a_catch_up_whose_last_pending_metas_are_purged_is_caught_up_not_stalled(tmp_path, monkeypatch, caplog):
    """Another client purges the metas the watch still counted as pending (tombstones, say) before the
    pull consumer delivered them, the stream's last one too: no delivery says "nothing pending", and a
    pull consumer sends no heartbeat. The watch is caught up (the server says nothing is pending and
    everything delivered was taken) and hands over to the live consumer; it was taken for a stall,
    re-created with a "no heartbeat" warning."""
    server = own_server(tmp_path)
    url = server.url
    try:
        create_bucket(url, BUCKET)
        names = [f"m{i}" for i in range(10)]
        seqs_stored = publish_metas(url, names)
        monkeypatch.setattr(jetstream_module, "CATCHUP_REQUEST_BYTES", len(PAD) + 512)  # (one meta a request)
        real = bridge_module.Subscription.next_batch
        purged: list[int] = []

        async def next_batch(self: Any, timeout: float | None = None) -> list[Any]:
            batch = await real(self, timeout)
            delivered = [int(m.reply.split(".")[-4]) for m in batch if m.reply.startswith("$JS.ACK.")]
            if delivered and not purged:
                top = max(delivered)
                purged.append(top)

                async def purge(nc: Any, js: Any) -> None:
                    for name, seq in zip(names, seqs_stored, strict=True):
                        if seq > top:
                            await js.purge_stream(STREAM, subject=meta(name))

                await trio.to_thread.run_sync(lambda: with_nats(url, purge))
            return batch

        monkeypatch.setattr(bridge_module.Subscription, "next_batch", next_batch)

        async def main() -> None:
            bridge = Bridge([url], request_timeout=30)
            await bridge.connect()
            js = JetStreams(bridge)
            try:
                w = await js.watch(STREAM, f"$O.{BUCKET}.M.>")
                seqs: list[int] = []
                with trio.fail_after(60):
                    while True:
                        batch = await w.next_batch(timeout=1.0)
                        seqs += [m.seq for m in batch.msgs]
                        if batch.caught_up:
                            break
                assert purged and purged[0] < seqs_stored[-1]  # (the tail was purged before it was delivered)
                assert seqs == [s for s in seqs_stored if s <= purged[0]]
                after = publish_metas(url, ["after"])
                with trio.fail_after(60):
                    while len(seqs) < purged[0] + 1:
                        seqs += [m.seq for m in (await w.next_batch(timeout=1.0)).msgs]
                await trio.sleep(0.5)
                seqs += [m.seq for m in (await w.next_batch(timeout=0.2)).msgs]
                assert seqs == [*(s for s in seqs_stored if s <= purged[0]), *after]  # (once, across the hand-over)
                await w.close()
            finally:
                await bridge.close()

        with caplog.at_level(logging.INFO, logger="natsfs"):
            trio.run(main)
        assert not [r.getMessage() for r in caplog.records if "re-creat" in r.getMessage()]
    finally:
        server.stop()
