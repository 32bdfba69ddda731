"""Puts with a known outcome, renames without tombstones, and names refused before anything is stored,
through natsfs.fs.Operations over MemoryStreams with injected lost acks and outages."""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio
import trio.testing
from gowriters import put_object
from opskit import Ctx, Env, errno_of

from natsfs.adr20 import ObjectStore, chunk_subject, digest_of, meta_json, meta_subject, stream_name
from natsfs.compose import spool_root
from natsfs.errors import NatsFSError, OutcomeUnknown, Unavailable
from natsfs.memstreams import MemoryStreams
from natsfs.staging import PutJournal
from natsfs.streams import MSG_ID, ROLLUP

DATA = bytes(range(256)) * 2000  # 512,000 bytes: 4 chunks of 128 KiB


async def one_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    # Puts in the nats.go order (chunks, then meta): a bucket without atomic batches. Atomic puts are
    # tested in test_ops_atomic.py.
    await store.create_bucket("b")
    await store.update_bucket("b", lambda config: config.update(allow_atomic=False))
    await put_object(ms, "b", "old.txt", b"old content")



async def err(coro: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


def chunk_msgs(env: Env, nuid: str) -> int:
    return env.streams.subjects(stream_name("b")).get(chunk_subject("b", nuid), 0)


def all_chunk_msgs(env: Env) -> int:
    return sum(n for s, n in env.streams.subjects(stream_name("b")).items() if ".C." in s)


async def stored(env: Env, name: str) -> bytes:
    info = await env.store.get_info("b", name)
    assert info is not None and not info.deleted
    data = b"".join(m.data for m in await env.store.fetch_chunks("b", info.nuid, 1, 10_000, 1 << 30))
    assert digest_of(data) == info.digest and len(data) == info.size
    assert chunk_msgs(env, info.nuid) == info.chunks
    return data


async def create_and_write(env: Env, name: str, data: bytes) -> Any:
    b = (await env.lookup("b")).st_ino
    fi, _ = await env.ops.create(b, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    await env.ops.write(fi.fh, 0, data)
    return fi


def test_lost_ack_of_a_stored_meta_is_success_not_estale_and_nothing_is_purged(ops_env):
    async def body(env: Env):
        fi = await create_and_write(env, "f", DATA)
        env.streams.lose_next_ack(subject="$O.b.M.>")
        await env.ops.flush(fi.fh)  # the meta was stored, its ack lost: read back, ours, success
        await env.ops.fsync(fi.fh, False)  # nothing changed: no second put, no ESTALE
        await env.ops.release(fi.fh)
        assert await stored(env, "f") == DATA
        assert all_chunk_msgs(env) == 4 + 1  # this object's and old.txt's, nothing orphaned
        assert not env.fs.mut.journal.pending and not env.fs.mut.journal.active

    ops_env(body, setup=one_bucket)


def test_meta_not_stored_is_retried_with_the_same_message_id(ops_env):
    async def body(env: Env):
        fi = await create_and_write(env, "f", DATA)
        # The first meta publish is lost before the server (no ack, not stored); the read-back says
        # "not stored", so the same message is sent again.
        env.streams.fail_next_publish(OutcomeUnknown("connection lost"), subject="$O.b.M.>")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await stored(env, "f") == DATA
        metas = [m for m in env.streams.messages(stream_name("b")) if m.subject == meta_subject("b", "f")]
        info = await env.store.get_info("b", "f")
        assert len(metas) == 1 and metas[0].headers[MSG_ID] == f"{info.nuid}.meta"
        chunks = [m for m in env.streams.messages(stream_name("b")) if m.subject == chunk_subject("b", info.nuid)]
        assert [m.headers[MSG_ID] for m in chunks] == [f"{info.nuid}.{i}" for i in range(4)]

    ops_env(body, setup=one_bucket)


def test_a_retried_meta_is_never_stored_twice(ops_env):
    async def body(env: Env):
        # Stored, ack lost; the read-back fails once (server away), the retry is a duplicate.
        env.streams.lose_next_ack(subject="$O.b.M.>")
        env.streams.fail_next("last_msg", Unavailable("away"))
        fi = await create_and_write(env, "f", b"x" * 10)
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await stored(env, "f") == b"x" * 10
        assert len([m for m in env.streams.messages(stream_name("b")) if m.subject == meta_subject("b", "f")]) == 1

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log("flush: no ack", "b/f: closed without a successful upload")
def test_a_missing_chunk_ack_means_no_meta_and_the_chunks_are_cleaned_up(ops_env):
    async def body(env: Env):
        fi = await create_and_write(env, "f", DATA)
        env.streams.fail_next_publish(OutcomeUnknown("no ack"), subject="$O.b.C.>")
        assert await err(env.ops.flush(fi.fh)) == errno.EIO
        await env.ops.release(fi.fh)  # the bytes go to lost+found
        assert await env.store.get_info("b", "f") is None
        assert len(env.fs.mut.journal.pending) == 1
        await env.fs.mut.settle_puts()  # the purge is checked once more...
        assert all_chunk_msgs(env) == 1
        assert not env.fs.mut.journal.pending  # ...and the record closed
        kept = list((env.fs.staging.spool.lost_found / "b").iterdir())
        assert [p.read_bytes() for p in kept] == [DATA]

    ops_env(body, setup=one_bucket, purge_check_delay=0.0)


@pytest.mark.expect_log("the meta publish got no answer .* it may or may not be stored")
def test_an_unknown_outcome_keeps_the_chunks_and_a_later_close_adopts_the_stored_meta(ops_env):
    async def body(env: Env):
        env.store.settle_timeout = 0.3
        fi = await create_and_write(env, "f", DATA)
        # The meta is stored but its ack is lost, and the server stays away for the read-back.
        env.streams.lose_next_ack(subject="$O.b.M.>")
        env.streams.fail_next("last_msg", Unavailable("away"), times=1000)
        assert await err(env.ops.flush(fi.fh)) == errno.EIO
        env.streams._faults.clear()  # the server is back
        first = await env.store.get_info("b", "f")
        assert chunk_msgs(env, first.nuid) == 4  # the meta may be stored: chunks kept
        # The next close finds its own earlier put there: not another client's change, no ESTALE.
        await env.ops.write(fi.fh, 0, b"Z")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await stored(env, "f") == b"Z" + DATA[1:]
        assert chunk_msgs(env, first.nuid) == 0
        assert not env.fs.mut.journal.pending

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log(
    "the meta publish got no answer .* it may or may not be stored",
    "b/f: closed without a successful upload",
)
def test_an_unknown_outcome_not_stored_is_purged_once_the_server_answers(ops_env):
    async def body(env: Env):
        env.store.settle_timeout = 0.3
        fi = await create_and_write(env, "f", DATA)
        env.streams.fail_next("publish", OutcomeUnknown("away"), subject="$O.b.M.>", times=1000)
        env.streams.fail_next("last_msg", Unavailable("away"), times=1000)
        assert await err(env.ops.flush(fi.fh)) == errno.EIO
        await env.ops.release(fi.fh)
        assert all_chunk_msgs(env) == 5  # not known to be unstored: kept for now
        await env.fs.mut.settle_puts()  # still away: nothing happens, one warning line
        assert all_chunk_msgs(env) == 5
        env.streams._faults.clear()
        await env.fs.mut.settle_puts()
        await env.fs.mut.settle_puts()
        assert all_chunk_msgs(env) == 1 and not env.fs.mut.journal.pending
        assert await env.store.get_info("b", "f") is None

    ops_env(body, setup=one_bucket, purge_check_delay=0.0)


@pytest.mark.expect_log("flush: no ack", "b/f: closed without a successful upload")
def test_a_clean_unmount_settles_the_puts_its_run_left(ops_env):
    """A put given up shortly before an unmount (its chunks purged, the purge not read back yet) is settled
    by the unmount: the journal it leaves holds no open record, so the next mount has nothing to check and
    logs no "unfinished put(s) of an earlier run", a warning only a killed daemon should cause (a 12 MiB
    file written from 4 descriptors out of order, unmounted at once, left 12 such records)."""

    async def body(env: Env):
        fi = await create_and_write(env, "f", DATA)
        env.streams.fail_next_publish(OutcomeUnknown("no ack"), subject="$O.b.C.>")
        assert await err(env.ops.flush(fi.fh)) == errno.EIO
        await env.ops.release(fi.fh)
        assert len(env.fs.mut.journal.pending) == 1  # purged, not read back yet
        await env.fs.shutdown(10)
        assert not env.fs.mut.journal.pending
        assert PutJournal(env.fs.mut.journal.path).pending == {}
        assert all_chunk_msgs(env) == 1  # old.txt's

    ops_env(body, setup=one_bucket, purge_check_delay=0.5)


def test_puts_left_by_a_killed_daemon_are_cleaned_at_the_next_mount(ops_env, tmp_path):
    ms = MemoryStreams()

    journal_path = spool_root(tmp_path / "cache", Path("/nonexistent").resolve()) / "puts.journal"

    async def earlier_run() -> None:
        await one_bucket(ms, ObjectStore(ms))
        # An earlier run recorded two puts and died: one had stored its meta, one had not.
        journal = PutJournal(journal_path)
        done = await put_object(ms, "b", "done", DATA)
        journal.started("b", done.nuid, "done")
        journal.started("b", "orphanNUID", "half")
        for i in range(3):
            await ms.publish(chunk_subject("b", "orphanNUID"), b"c" * 100, {MSG_ID: f"orphanNUID.{i}"})
        journal.close()

    async def body(env: Env):
        assert len(env.fs.mut.journal.pending) == 2
        await env.fs.mut.settle_puts()
        await env.fs.mut.settle_puts()
        assert chunk_msgs(env, "orphanNUID") == 0
        assert await stored(env, "done") == DATA
        assert not env.fs.mut.journal.pending
        env.fs.mut.journal.flush()  # (closing lines wait for the next record, or the unmount)
        assert PutJournal(journal_path).pending == {}

    journal_path.parent.mkdir(parents=True)
    trio.run(earlier_run)
    ops_env(body, streams=ms, purge_check_delay=0.0)


def test_rename_leaves_the_old_name_a_tombstone_that_carries_no_live_nuid(ops_env):
    async def body(env: Env):
        old = await env.store.get_info("b", "old.txt")
        b = (await env.lookup("b")).st_ino
        await env.ops.rename(b, b"old.txt", b, b"new.txt", 0, Ctx())
        # The rename's claim of the old name: nats.go's Delete(old.txt) purges its nuid, which holds nothing;
        # the renamed object is intact.
        claim = await env.store.get_info("b", "old.txt")
        assert claim is not None and claim.deleted and claim.nuid not in ("", old.nuid)
        assert await env.store.chunk_index("b", claim.nuid) == []
        assert (await env.store.get_info("b", "new.txt")).nuid == old.nuid
        assert await stored(env, "new.txt") == b"old content"
        assert "old.txt" not in (await env.listdir(b)).names

    ops_env(body, setup=one_bucket)


def test_a_tombstone_sharing_a_live_nuid_is_purged_when_the_index_meets_it(ops_env):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        info = await put_object(ms, "b", "a", DATA)
        # What an earlier natsfs rename left: the meta under the new name, a tombstone under the old
        # one carrying the same nuid.
        doc = json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", "a"))).data)
        await ms.publish(meta_subject("b", "moved"), meta_json(dict(doc, name="moved")), {ROLLUP: "sub"})
        tomb = dict(doc, deleted=True, size=0, chunks=0, digest="")
        await ms.publish(meta_subject("b", "a"), meta_json(tomb), {ROLLUP: "sub"})
        assert info.nuid

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        assert (await env.listdir(b)).names == ["moved"]
        await env.fs.mut.purge_shared_tombstones()
        assert env.streams.subjects(stream_name("b")).get(meta_subject("b", "a")) is None
        assert await stored(env, "moved") == DATA

    ops_env(body, setup=setup)


def test_a_tombstone_sharing_a_nuid_only_with_a_name_renamed_away_meanwhile_is_left_alone(ops_env, monkeypatch,
                                                                                           caplog):
    """Another client renames d/a to e/a (the new meta, then a purge of the old subject, which no watch
    delivers) and deletes e/a. Until the watch notices the purge, the index still holds d/a live, so
    e/a's tombstone looks as if it shared a live nuid: the clean-up read nothing back, purged that
    ordinary tombstone and logged a warning about a danger that was not there (every `git clone` into a
    directory another mount renamed showed it). It reads the live name back first."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        assert (await env.listdir(b)).names == ["d", "old.txt"]
        index = await env.ns.index("b")
        # The watch reads a suspected old name back only a moment later (`CONFIRM_DELAYS`): not yet.
        monkeypatch.setattr(env.ns._buckets["b"], "_suspect", lambda name: None)
        doc = json.loads((await env.streams.last_msg(stream_name("b"), meta_subject("b", "d/a"))).data)
        await env.streams.publish(meta_subject("b", "e/a"), meta_json(dict(doc, name="e/a")), {ROLLUP: "sub"})
        await env.streams.purge_subject(stream_name("b"), meta_subject("b", "d/a"))
        tomb = dict(doc, name="e/a", deleted=True, size=0, chunks=0, digest="")
        await env.streams.publish(meta_subject("b", "e/a"), meta_json(tomb), {ROLLUP: "sub"})
        await env.settle()
        assert index.objects["d/a"].nuid == doc["nuid"]  # (not noticed yet)
        assert "e/a" in index.shared_tombstones
        caplog.clear()
        await env.fs.mut.purge_shared_tombstones()
        tombstone = await env.store.get_info("b", "e/a")
        assert tombstone is not None and tombstone.deleted  # left alone
        assert not index.shared_tombstones
        assert not [r for r in caplog.records if r.levelno >= 30]

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        await put_object(ms, "b", "d/a", DATA)

    ops_env(body, setup=setup)


def test_names_are_refused_before_anything_is_stored(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        before = env.streams.subjects(stream_name("b"))
        assert await err(env.ops.create(b, b"x" * 256, 0o644, os.O_WRONLY, Ctx())) == errno.ENAMETOOLONG
        assert await err(env.ops.lookup(b, b"x" * 256, Ctx())) == errno.ENAMETOOLONG
        assert await err(env.ops.create(b, b"bad\xff.txt", 0o644, os.O_WRONLY, Ctx())) == errno.EILSEQ
        assert await err(env.ops.mkdir(b, b"bad\xfe", 0o755, Ctx())) == errno.EILSEQ
        assert await err(env.ops.symlink(b, b"l\xff", b"old.txt", Ctx())) == errno.EILSEQ
        assert await err(env.ops.rename(b, b"old.txt", b, b"r\xff", 0, Ctx())) == errno.EILSEQ
        assert env.streams.subjects(stream_name("b")) == before  # nothing stored
        # A deep path whose meta subject would pass the limit.
        d = b
        for i in range(20):
            name = f"{i:02d}".encode() + b"d" * 148
            try:
                d = (await env.ops.mkdir(d, name, 0o755, Ctx())).st_ino
            except pyfuse3.FUSEError as e:
                assert e.errno == errno.ENAMETOOLONG and i >= 10
                break
        else:
            raise AssertionError("no ENAMETOOLONG for a 3000-byte path")
        assert await err(env.ops.create(d, b"f" * 250, 0o644, os.O_WRONLY, Ctx())) == errno.ENAMETOOLONG
        # An oversize meta for the server's max payload.
        env.streams.max_payload = 2048
        f = await env.lookup("b/old.txt")
        assert await err(env.ops.setxattr(f.st_ino, b"user.big", b"v" * 3000, Ctx())) == errno.E2BIG
        assert await stored(env, "old.txt") == b"old content"

    ops_env(body, setup=one_bucket, max_meta_bytes=1 << 20)


class LocalSender:
    """A `FileSender` in this process, publishing ranges in offset order the way the upload worker does."""

    alive = True

    def __init__(self, ms: MemoryStreams):
        self.ms = ms
        self.hashers: dict[str, Any] = {}
        self.next: dict[str, int] = {}

    async def send_range(self, session: str, subject: str, path: str, start: int, end: int, chunk_size: int,
                         window: int) -> None:
        import hashlib

        import trio

        while self.next.get(session, 0) != start:
            await trio.sleep(0.001)
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        data += bytes(end - start - len(data))
        hasher = self.hashers.setdefault(session, hashlib.sha256())
        msgs = []
        for i, pos in enumerate(range(0, len(data), chunk_size)):
            hasher.update(data[pos : pos + chunk_size])
            msgs.append((subject, data[pos : pos + chunk_size], {MSG_ID: f"{session}.{start // chunk_size + i}"}))
        self.next[session] = end
        await self.ms.publish_many(msgs)

    async def digest(self, session: str) -> bytes:
        return self.hashers[session].digest()

    async def drop(self, session: str) -> bool:
        self.hashers.pop(session, None)
        return True  # (its `send_range` publishes everything in one call: nothing is left in flight)


class SlowWorker:
    """A `FileSender` that sends the way the upload worker does: a window of chunks, the next one only once
    the server acknowledged it; a dropped session stops before its next window, and `drop` returns once
    no range of it can publish any more. The server's answer to the first window is held until `release`:
    the window is stored then (as nats-server stores what it read from a connection), acknowledged, and
    sending goes on."""

    alive = True

    def __init__(self, ms: MemoryStreams, window: int = 2):
        self.ms = ms
        self.window = window
        self.released = trio.Event()
        self.first_window_sent = trio.Event()
        self.dropped: set[str] = set()
        self.running: Counter[str] = Counter()
        self.changed = trio.Event()

    def release(self) -> None:
        self.released.set()

    async def send_range(self, session: str, subject: str, path: str, start: int, end: int, chunk_size: int,
                         window: int) -> None:
        data = Path(path).read_bytes()[start:end]
        msgs = [(subject, data[pos : pos + chunk_size], {MSG_ID: f"{session}.{(start + pos) // chunk_size}"})
                for pos in range(0, len(data), chunk_size)]
        # The range is sent by the worker process: a daemon that stops waiting for it does not stop it.
        done, failed = trio.Event(), list[BaseException]()
        self.running[session] += 1
        trio.lowlevel.spawn_system_task(self._send, session, msgs, done, failed)
        await done.wait()
        if failed:
            raise failed[0]

    async def _send(self, session: str, msgs: list[Any], done: trio.Event, failed: list[BaseException]) -> None:
        try:
            for at in range(0, len(msgs), self.window):
                if session in self.dropped:
                    raise Unavailable("dropped")
                self.first_window_sent.set()
                await self.released.wait()
                await self.ms.publish_many(msgs[at : at + self.window])
        except NatsFSError as e:
            failed.append(e)
        finally:
            self.running[session] -= 1
            self.changed.set()
            done.set()

    async def digest(self, session: str) -> bytes:
        raise AssertionError("never asked: the put does not get that far")

    async def drop(self, session: str) -> bool:
        self.dropped.add(session)
        while self.running[session]:
            self.changed = trio.Event()
            await self.changed.wait()
        return True


@pytest.mark.expect_log("flush: ", "b/big: closed without a successful upload")
def test_a_put_given_up_while_the_worker_sends_leaves_no_chunk_once_settled(ops_env):
    """The close deadline gives a put up while the upload worker still sends it (its acks held): its chunks
    are purged only after the worker said it sends nothing more of it, so none is stored after the purge
    (an orphan no record covers) and the put's record closes only once its chunk subject is empty."""

    async def body(env: Env):
        worker = SlowWorker(env.streams)
        env.store.file_sender = worker
        fi = await create_and_write(env, "big", DATA)  # 4 chunks: two windows
        assert await err(env.ops.flush(fi.fh)) == errno.EIO  # past --flush-timeout: given up
        assert worker.first_window_sent.is_set()
        await env.ops.release(fi.fh)
        (nuid,) = worker.dropped
        journal = env.fs.mut.journal
        assert ("b", nuid) in journal.pending
        await env.fs.mut.settle_puts()  # (the worker still did not say it stopped)
        worker.release()  # its first window is stored now; it sends no second one
        with trio.fail_after(60):
            while worker.running[nuid]:
                await trio.sleep(0.1)
        for _ in range(10):
            await env.fs.mut.settle_puts()
            if ("b", nuid) not in journal.pending:
                break
        assert ("b", nuid) not in journal.pending
        assert chunk_msgs(env, nuid) == 0, "chunks of the given-up put stored after its purge"
        assert all_chunk_msgs(env) == 1  # old.txt's
        assert await env.store.get_info("b", "big") is None

    ops_env(body, setup=one_bucket, purge_check_delay=0.0, flush_timeout=0.5,
            clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.expect_log("the meta publish got no answer .* it may or may not be stored")
def test_a_streamed_put_whose_meta_goes_unanswered_is_not_put_a_second_time(ops_env):
    async def body(env: Env):
        import trio

        env.store.file_sender = LocalSender(env.streams)
        env.store.settle_timeout = 0.3
        data = bytes(range(256)) * (24 * 1024)  # 6 MiB: the first 4 MiB are streamed while written
        fi = await create_and_write(env, "big", data)
        while all_chunk_msgs(env) < 33:
            await trio.sleep(0.01)
        env.streams.lose_next_ack(subject="$O.b.M.>")
        env.streams.fail_next("last_msg", Unavailable("away"), times=1000)
        assert await err(env.ops.flush(fi.fh)) == errno.EIO
        env.streams._faults.clear()
        # One put only (no second one from here after an unanswered meta), and its chunks are kept.
        nuids = {s for s in env.streams.subjects(stream_name("b")) if ".C." in s}
        assert len(nuids) == 2  # old.txt's and this put's
        first = await env.store.get_info("b", "big")
        assert chunk_msgs(env, first.nuid) == 48
        await env.ops.fsync(fi.fh, False)  # nothing changed since; stores again without ESTALE
        await env.ops.release(fi.fh)
        assert await stored(env, "big") == data

    ops_env(body, setup=one_bucket)


def test_chunks_whose_purge_fails_are_purged_once_the_server_answers(ops_env):
    async def body(env: Env):
        old = await env.store.get_info("b", "old.txt")
        b = (await env.lookup("b")).st_ino
        env.streams.fail_next("purge_subject", Unavailable("away"))
        await env.ops.unlink(b, b"old.txt", Ctx())  # the tombstone is stored; the purge is not
        assert chunk_msgs(env, old.nuid) == 1
        assert ("b", old.nuid) in env.fs.mut.journal.pending
        await env.fs.mut.settle_puts()
        await env.fs.mut.settle_puts()
        assert chunk_msgs(env, old.nuid) == 0 and not env.fs.mut.journal.pending

    ops_env(body, setup=one_bucket, purge_check_delay=0.0)


def test_a_rename_retries_the_claim_of_the_old_name(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        env.streams.fail_next("publish", Unavailable("a moment away"), times=2,
                              subject=meta_subject("b", "old.txt"))
        await env.ops.rename(b, b"old.txt", b, b"new.txt", 0, Ctx())
        assert not env.streams._faults
        gone = await env.store.get_info("b", "old.txt")
        assert gone is not None and gone.deleted
        assert await stored(env, "new.txt") == b"old content"

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log("flush: .*(no ack|not stored within)", "b/f: closed without a successful upload")
@pytest.mark.parametrize("size", [1000, len(DATA)], ids=["one-chunk", "four-chunks"])
def test_a_meta_still_queued_at_the_server_is_not_taken_for_unstored_and_its_chunks_stay(ops_env, size):
    # The server read the put's chunks and meta but has not stored the meta yet (a stopped server that
    # continues): it answers reads and purges at once, but stores publishes in order from the stream's
    # queue. A settle pass that read "no meta" then would purge the chunks, and the meta land after them.
    async def body(env: Env):
        env.store.settle_timeout = 0.3
        data = DATA[:size]
        fi = await create_and_write(env, "f", data)
        env.streams.hold_publishes(from_subject="$O.b.M.>" if size > 1000 else None)
        assert await err(env.ops.flush(fi.fh)) == errno.EIO
        await env.ops.release(fi.fh)
        # The server stores everything before the meta, then the settle pass runs before the meta is stored.
        metas = [i for i, (s, _, _) in enumerate(env.streams.held) if ".M." in s]
        assert metas, "the meta was sent"
        env.streams.release_held(metas[0])
        assert await env.store.get_info("b", "f") is None
        await env.fs.mut.settle_puts()  # no answer to the barrier behind the meta: nothing is decided
        env.streams.release_held()  # the server stores the rest (and refuses the barriers)
        await env.fs.mut.settle_puts()
        await env.fs.mut.settle_puts()
        info = await env.store.get_info("b", "f")
        assert info is not None, "the meta was stored"
        assert await stored(env, "f") == data  # every chunk there, bytes match
        assert not env.fs.mut.journal.pending

    ops_env(body, setup=one_bucket, purge_check_delay=0.0, flush_timeout=0.5)


def test_an_unlink_killed_between_its_tombstone_and_its_purge_leaves_no_orphan_chunks(ops_env):
    """The daemon dies once an unlink's tombstone is stored, before the deleted version's chunks are purged
    (the task stops there and the run ends). The put journal recorded the purge first: the next mount
    purges the chunks (they were orphans for `natsfs fsck --repair`); an unlink killed before its
    tombstone leaves the live object's chunks alone."""
    ms = MemoryStreams()
    nuids: dict[str, str] = {}

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        for name in ("gone", "stays"):
            await put_object(ms, "b", name, name.encode() * 1000)
            info = await store.get_info("b", name)
            assert info is not None
            nuids[name] = info.nuid

    async def first(env: Env):
        async def dies(*args: Any, **kwargs: Any) -> None:
            await trio.sleep_forever()

        env.store.end_replacing = dies  # type: ignore[method-assign]
        publish_meta = env.store.publish_meta

        async def dies_before_tombstone(bucket: str, doc: dict[str, Any], **kwargs: Any) -> Any:
            if doc.get("name") == "stays":
                await trio.sleep_forever()
            return await publish_meta(bucket, doc, **kwargs)

        env.store.publish_meta = dies_before_tombstone  # type: ignore[method-assign]
        for name in (b"gone", b"stays"):
            env.nursery.start_soon(env.ops.unlink, (await env.lookup("b")).st_ino, name, None)
        with trio.fail_after(10):
            while not (info := await env.store.get_info("b", "gone")) or not info.deleted:
                await trio.sleep(0.01)
        assert await env.store.chunk_index("b", nuids["gone"])

    async def second(env: Env):
        await env.fs.mut.settle_puts()
        await env.fs.mut.settle_puts()
        assert await env.store.chunk_index("b", nuids["gone"]) == []
        assert await env.store.chunk_index("b", nuids["stays"])
        assert not env.fs.mut.journal.pending

    ops_env(first, setup=setup, streams=ms)
    ops_env(second, streams=ms, purge_check_delay=0.0)


def test_a_rename_over_an_object_killed_before_the_purge_of_the_replaced_chunks_leaves_no_orphan(ops_env):
    """The daemon dies between a rename's two publishes (the renamed meta replaced the target's, the old
    name not claimed yet): the replaced target's chunks were recorded in the put journal first, and the
    next mount purges them (they were orphans for `natsfs fsck --repair`); the renamed object keeps its."""
    ms = MemoryStreams()
    nuids: dict[str, str] = {}

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        for name in ("src", "dst"):
            await put_object(ms, "b", name, name.encode() * 1000)
            info = await store.get_info("b", name)
            assert info is not None
            nuids[name] = info.nuid

    async def first(env: Env):
        publish_meta = env.store.publish_meta

        async def dies_before_the_claim(bucket: str, doc: dict[str, Any], **kwargs: Any) -> Any:
            if doc.get("name") == "src" and doc.get("deleted"):
                await trio.sleep_forever()
            return await publish_meta(bucket, doc, **kwargs)

        env.store.publish_meta = dies_before_the_claim  # type: ignore[method-assign]
        b = (await env.lookup("b")).st_ino
        env.nursery.start_soon(env.ops.rename, b, b"src", b, b"dst", 0, None)
        with trio.fail_after(10):
            while (info := await env.store.get_info("b", "dst")) is None or info.nuid != nuids["src"]:
                await trio.sleep(0.01)

    async def second(env: Env):
        await env.fs.mut.settle_puts()
        await env.fs.mut.settle_puts()
        assert await env.store.chunk_index("b", nuids["dst"]) == []
        assert await env.store.chunk_index("b", nuids["src"])
        assert not env.fs.mut.journal.pending

    ops_env(first, setup=setup, streams=ms)
    ops_env(second, streams=ms, purge_check_delay=0.0)
