"""The server away (MemoryStreams offline: every call waits the request timeout for a connection, then
fails with `NoConnection`, as the bridge does): how long operations wait, measured on trio's mock clock
(it jumps whenever every task waits, so no test here depends on real time).

- A read of bytes not cached fails with EIO at the request timeout, not after nested retry windows.
- A read whose server does not answer (connected, no reply) gets one deadline: max(request timeout,
  `FETCH_RETRY_S`) from its start, however many steps (walk, fetches) it asks again.
- Creating or opening a file for writing uses the bucket's last known sealed state instead of waiting
  for the server: in write-back mode the close succeeds offline and the upload lands later.
- A close/fsync without write-back fails with EIO at its flush deadline plus at most the put's
  cleanup margin (`ABORT_CLEANUP_S`), not after the cleanup's own wait for the server.
- In write-back mode a change of a file whose upload attempt waits for a stopped server (connected,
  nothing answered) waits for it at most `CHANGE_WAIT_MAX_S`, and its close does not wait at all.
"""

from __future__ import annotations

import errno
import logging
import os

import pyfuse3
import pytest
import trio
import trio.testing
from opskit import CTX, ROOT, Env, Fields
from test_ops import DATA, fuse_error, two_buckets
from test_ops_upload_races import NEW, V2, close, ino_of, lost_and_found, written
from test_ops_write import Ctx, stored, write_file
from test_ops_writeback import LATER, bucket_b

from natsfs import chunk_cache, futures
from natsfs.adr20 import ABORT_CLEANUP_S, stream_name
from natsfs.core.filesystem import CHANGE_WAIT_MAX_S
from natsfs.errors import Unavailable
from natsfs.staging import WriteState


def mock_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def no_worker_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `trio.to_thread.run_sync` inline: the mock clock jumps whenever every task waits, also while
    one waits for a worker thread, so a deadline test with threads (the spool file read for a put)
    would measure how the threads were scheduled."""

    async def inline(fn, *args, **_kw):  # type: ignore[no-untyped-def]
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", inline)
    monkeypatch.setattr(futures, "run_on_thread", inline)  # (the write-back journal's syncs)


@pytest.mark.expect_log("read: .*(no connection to NATS|no answer from the server)")
@pytest.mark.parametrize("request_timeout", [10.0, 2.0, 30.0])
def test_a_read_without_a_connection_fails_at_the_request_timeout(ops_env, request_timeout):
    async def body(env: Env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        env.streams.go_offline(request_timeout)
        start = trio.current_time()
        assert await fuse_error(env.ops.read(fi.fh, 0, 4096)) == errno.EIO
        # One wait for a connection, not one per retry window (the walk's, then each fetch's).
        assert trio.current_time() - start == pytest.approx(request_timeout, abs=0.5)
        env.streams.go_online()
        assert await env.ops.read(fi.fh, 0, 4096) == DATA[:4096]
        await env.ops.release(fi.fh)

    ops_env(body, setup=two_buckets, clock=mock_clock(), request_timeout=request_timeout,
            fetch_batch_bytes=128 * 1024, readahead_min=0, readahead_max=0)


@pytest.mark.expect_log("read: .*no answer from the server within 15s")
@pytest.mark.parametrize("op", ["stream_batch", "get_batch"])
def test_a_read_the_server_never_answers_fails_at_one_deadline(ops_env, op):
    """Each attempt waits the request timeout for its reply; the read still ends FETCH_RETRY_S after it
    started (the request timeout being shorter), not after the attempt that was under way then."""

    async def body(env: Env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        if op == "get_batch":  # the layout must be known for a chunk fetch by sequence
            assert await env.ops.read(fi.fh, 300_000, 10) == DATA[300_000:300_010]
        unanswered = 0

        async def no_reply(*args: object, **kw: object) -> object:
            nonlocal unanswered
            unanswered += 1
            await trio.sleep(env.config.request_timeout)
            raise Unavailable("request timed out after 10s")

        env.streams.__dict__[op] = no_reply  # (an instance attribute shadows the method)
        start = trio.current_time()
        off = 0 if op == "stream_batch" else 150_000
        assert await fuse_error(env.ops.read(fi.fh, off, 4096)) == errno.EIO
        assert trio.current_time() - start == pytest.approx(chunk_cache.FETCH_RETRY_S, abs=0.01)
        assert unanswered == 2  # asked again once within the window
        del env.streams.__dict__[op]
        assert await env.ops.read(fi.fh, off, 4096) == DATA[off: off + 4096]
        await env.ops.release(fi.fh)

    ops_env(body, setup=two_buckets, clock=mock_clock(), fetch_batch_bytes=128 * 1024, readahead_min=0,
            readahead_max=0)


def test_write_back_creates_and_rewrites_files_while_the_server_is_away(ops_env):
    async def body(env: Env):
        # Nothing was written yet: the bucket's watch saw it writable when it started.
        env.streams.go_offline(60.0)  # (a wait for the server would fail the create with EIO)
        await write_file(env, ROOT, "new.txt", b"made offline")
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"rewritten offline")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await env.cat("new.txt") == b"made offline"
        assert await env.cat("old.txt") == b"rewritten offline"
        fi = await env.ops.open((await env.lookup("new.txt")).st_ino, os.O_WRONLY | os.O_APPEND, None)
        await env.ops.write(fi.fh, len(b"made offline"), b", appended")  # its bytes are here: no server needed
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        env.streams.go_online()
        assert await env.store.get_info("b", "new.txt") is None  # nothing reached the server meanwhile
        await env.fs.shutdown(30)
        for name, data in (("new.txt", b"made offline, appended"), ("old.txt", b"rewritten offline")):
            assert await stored(env, name) == data

    # sealed_ttl=0: every check would ask the server again; the last known state answers instead.
    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER, sealed_ttl=0)


@pytest.mark.expect_log("flush: b/new.txt: not stored within", "b/new.txt: closed without a successful upload")
def test_creating_a_file_while_the_server_is_away_does_not_wait_for_it(ops_env):
    """Without write-back the close fails (EIO, bytes in lost+found) as documented; the create does not
    wait for the server to say whether the bucket is sealed."""

    async def body(env: Env):
        await write_file(env, ROOT, "before.txt", b"before")
        env.streams.go_offline(env.config.request_timeout)
        start = trio.current_time()
        fi, _ = await env.ops.create(ROOT, b"new.txt", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        assert trio.current_time() == start
        await env.ops.write(fi.fh, 0, b"x")
        assert await fuse_error(env.ops.flush(fi.fh)) == errno.EIO
        await env.ops.release(fi.fh)
        env.streams.go_online()

    ops_env(body, setup=bucket_b, bucket="b", clock=mock_clock(), sealed_ttl=0)


def test_a_bucket_this_mount_made_takes_files_offline_in_write_back_mode(ops_env):
    """mkdir at the root made the bucket (unsealed): no server is needed to know it is writable."""
    async def body(env: Env):
        await env.ops.mkdir(ROOT, b"fresh", 0o755, CTX)
        env.streams.go_offline(60.0)
        bucket = (await env.lookup("fresh")).st_ino
        await write_file(env, bucket, "f.txt", b"made offline in a new bucket")
        env.streams.go_online()
        await env.fs.shutdown(30)
        info = await env.store.get_info("fresh", "f.txt")
        assert info is not None and info.size == len(b"made offline in a new bucket")

    ops_env(body, setup=two_buckets, write_back=LATER, sealed_ttl=0, clock=mock_clock())


async def unatomic_bucket_b(ms, store) -> None:  # type: ignore[no-untyped-def]
    await store.create_bucket("b", max_bytes=4 << 20, atomic=False)  # chunks first, then the meta


@pytest.mark.expect_log(r"fsync: b/new.bin: not stored within 2\.3 s \(--flush-timeout 2 s \+ 0\.3 s for its "
                        r"300000 bytes\); the server is unreachable")
@pytest.mark.parametrize("server", ["away", "not answering"])
def test_an_fsync_without_a_server_returns_at_its_flush_deadline(ops_env, monkeypatch, server):
    """Cut off by its deadline while its chunks were being sent, the put's cleanup (purging those chunks)
    waited for the server too, shielded: the fsync returned a whole request timeout after its flush
    deadline. Now the cleanup is skipped without a connection and takes at most `ABORT_CLEANUP_S` with
    one that gets no answer; the chunks are settled later."""
    no_worker_threads(monkeypatch)
    data = os.urandom(300_000)  # over one small put, under a streamed batch: put whole at the fsync

    async def body(env: Env):
        fi, _ = await env.ops.create(ROOT, b"new.bin", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        await env.ops.write(fi.fh, 0, data)

        async def no_reply(*args: object, **kw: object) -> object:
            await trio.sleep(env.config.request_timeout)
            raise Unavailable("request timed out after 10s")

        if server == "away":
            env.streams.go_offline(env.config.request_timeout)  # 10 s, the flush timeout is 2 s
        else:  # connected, but the chunks and then the purge of the cut-off put get no answer
            env.streams.__dict__["publish_many"] = env.streams.__dict__["purge_subject"] = no_reply
        start = trio.current_time()
        assert await fuse_error(env.ops.fsync(fi.fh, False)) == errno.EIO
        limit = 2.0 + len(data) / env.config.flush_rate_floor
        assert limit <= trio.current_time() - start <= limit + ABORT_CLEANUP_S
        env.streams.go_online()
        env.streams.__dict__.pop("publish_many", None)
        env.streams.__dict__.pop("purge_subject", None)
        await env.ops.fsync(fi.fh, False)  # the bytes stayed staged: the next fsync stores them
        await env.ops.release(fi.fh)
        assert await stored(env, "new.bin") == data
        info = await env.store.get_info("b", "new.bin")
        assert info is not None
        await trio.sleep(3 * env.config.settle_interval + env.config.purge_check_delay)
        # The cut-off put's chunks, not purged at the fsync, were settled (purged) later.
        assert {s for s in env.streams.subjects(stream_name("b")) if ".C." in s} == {f"$O.b.C.{info.nuid}"}

    ops_env(body, setup=unatomic_bucket_b, bucket="b", clock=mock_clock(), flush_timeout=2.0)


def test_a_put_stored_as_its_deadline_passes_is_no_failure(ops_env, monkeypatch):
    """The meta is stored, then the purge of the replaced version's chunks gets no answer and the flush
    deadline passes: the close failed with EIO and its bytes went to lost+found although the bucket held
    them (and the next close would have been refused as a conflict with itself). The purge after a
    stored meta is shielded and bounded by `ABORT_CLEANUP_S`; the put journal purges the old chunks."""
    no_worker_threads(monkeypatch)
    data = b"the new version\n" * 100

    async def body(env: Env):
        old = await env.store.get_info("b", "old.txt")
        assert old is not None
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, data)

        async def no_reply(*args: object, **kw: object) -> object:
            await trio.sleep(env.config.request_timeout)
            raise Unavailable("request timed out after 10s")

        env.streams.__dict__["purge_subject"] = no_reply
        start = trio.current_time()
        await env.ops.flush(fi.fh)
        assert trio.current_time() - start <= 2.0 + ABORT_CLEANUP_S
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == data
        del env.streams.__dict__["purge_subject"]
        await trio.sleep(3 * env.config.settle_interval + env.config.purge_check_delay)
        assert not await env.store.chunk_index("b", old.nuid)  # the replaced version's chunks, purged later
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b", clock=mock_clock(), flush_timeout=2.0)


@pytest.mark.parametrize("stopped_at", ["put", "meta"])
@pytest.mark.parametrize("what", ["write", "truncate"])
def test_a_change_waits_for_a_write_back_upload_stuck_on_a_stopped_server_only_briefly(ops_env, monkeypatch, caplog,
                                                                                      what, stopped_at):
    """The server stops (SIGSTOP: the connection stays open, nothing is answered, the mount still counts
    it connected) while the write-back uploader's put of a still open file is under way: at its first
    request, or at its meta once its chunks are stored. A write (or truncate) of the file waits for that
    attempt at most `CHANGE_WAIT_MAX_S`, then interrupts it and goes on, and the close after it returns,
    while the server is still stopped (the attempt itself would wait for its flush deadline, an hour
    here). Once the server goes on, the newest bytes are stored, the interrupted attempt's chunks are
    purged (its meta, in flight, is settled by reading back) and nothing goes to lost+found."""
    caplog.set_level(logging.INFO, logger="natsfs")
    no_worker_threads(monkeypatch)
    second = NEW if what == "write" else V2[:1000]

    async def body(env: Env):
        assert env.fs.writeback is not None
        fi = await written(env, "f", V2)
        stuck = env.streams.stop(from_subject=None if stopped_at == "put" else "$O.b.M.>")
        await env.ops.flush(fi.fh)  # journalled: the uploader starts its upload, which gets no answer
        await stuck.wait()
        sf = env.fs.staging.get(await ino_of(env, "f"))
        assert sf is not None and sf.state is WriteState.UPLOADING
        chunks = {s for s in env.streams.subjects(stream_name("b")) if ".C." in s}
        assert len(chunks) == (1 if stopped_at == "meta" else 0)  # the attempt's chunks, stored
        started = trio.current_time()
        if what == "write":
            assert await env.ops.write(fi.fh, 0, second) == len(second)
        else:
            attrs = pyfuse3.EntryAttributes()
            attrs.st_size = len(second)
            await env.ops.setattr(await ino_of(env, "f"), attrs, Fields(update_size=True), fi.fh, Ctx())
        await close(env, fi)()
        # Returned while the server is still stopped (mock clock: the attempt's deadline is an hour): the
        # change waited CHANGE_WAIT_MAX_S, the interrupted put's cleanup at most ABORT_CLEANUP_S more.
        assert trio.current_time() - started <= min(CHANGE_WAIT_MAX_S + ABORT_CLEANUP_S, 10.0)
        assert await env.cat("f") == second  # the mount shows the newest bytes meanwhile
        env.streams.go_on()
        await env.fs.writeback.drain(60)
        assert await stored(env, "f") == second
        info = await env.store.get_info("b", "f")
        assert info is not None
        await trio.sleep(3 * env.config.settle_interval + env.config.purge_check_delay)
        # The interrupted attempt's chunks (stored, when it stopped at its meta) were purged.
        assert {s for s in env.streams.subjects(stream_name("b")) if ".C." in s} == {f"$O.b.C.{info.nuid}"}
        assert lost_and_found(env) == []
        assert len([r for r in caplog.records if "was interrupted by a change of the file, which waited"
                    in r.getMessage()]) == 1

    ops_env(body, setup=unatomic_bucket_b, bucket="b", write_back=0.0, flush_timeout=3600.0,
            clock=mock_clock())


def test_an_fsync_or_close_neither_waits_for_nor_interrupts_a_write_back_upload_stuck_on_a_stopped_server(
        ops_env, monkeypatch):
    """A close or fsync in write-back mode writes its journal record beside an upload attempt that waits
    for a stopped server (the attempt's bytes cannot change meanwhile): it returns at once and the attempt
    goes on, storing the file once the server answers."""
    no_worker_threads(monkeypatch)

    async def body(env: Env):
        assert env.fs.writeback is not None
        fi = await written(env, "f", V2)
        stuck = env.streams.stop()
        await env.ops.flush(fi.fh)
        await stuck.wait()
        sf = env.fs.staging.get(await ino_of(env, "f"))
        assert sf is not None and sf.state is WriteState.UPLOADING
        started = trio.current_time()
        await env.ops.fsync(fi.fh, False)
        await close(env, fi)()
        assert trio.current_time() == started  # no wait at all (mock clock)
        assert sf.state is WriteState.UPLOADING  # the attempt goes on
        env.streams.go_on()
        await env.fs.writeback.drain(60)
        assert await stored(env, "f") == V2
        assert lost_and_found(env) == []

    ops_env(body, setup=unatomic_bucket_b, bucket="b", write_back=0.0, flush_timeout=3600.0, clock=mock_clock())


def test_a_change_waits_for_a_write_back_upload_that_lands_within_the_bound(ops_env, monkeypatch, caplog):
    """The trade-off of `CHANGE_WAIT_MAX_S`: an upload attempt that lands within it is not interrupted,
    so a file rewritten again and again is still stored between its rewrites."""
    caplog.set_level(logging.INFO, logger="natsfs")
    no_worker_threads(monkeypatch)
    assert CHANGE_WAIT_MAX_S >= 1.0

    async def body(env: Env):
        assert env.fs.writeback is not None
        fi = await written(env, "f", V2)
        stuck = env.streams.stop()
        await env.ops.flush(fi.fh)
        await stuck.wait()

        async def answers_soon() -> None:
            await trio.sleep(0.5)  # (the server answers again well within the bound)
            env.streams.go_on()

        env.nursery.start_soon(answers_soon)
        assert await env.ops.write(fi.fh, 0, NEW) == len(NEW)  # waited for the upload, which landed
        assert await stored(env, "f") == V2
        await close(env, fi)()
        await env.fs.writeback.drain(60)
        assert await stored(env, "f") == NEW
        assert not [r for r in caplog.records if "interrupted" in r.getMessage()]

    ops_env(body, setup=unatomic_bucket_b, bucket="b", write_back=0.0, flush_timeout=3600.0, clock=mock_clock())


def test_opening_for_writing_waits_for_a_stopped_server_only_briefly_and_sees_a_seal_at_once(ops_env, monkeypatch):
    """A bucket whose sealed state is known is asked again in the background: a server that answers gives
    the fresh state (a seal made meanwhile refuses the next open for writing), one that is connected but
    stopped costs each open `SEALED_REFRESH_WAIT_S`, not the request timeout."""
    from natsfs.mutations import SEALED_REFRESH_WAIT_S

    no_worker_threads(monkeypatch)

    async def body(env: Env):
        await write_file(env, ROOT, "old.txt", b"old")
        ino = (await env.lookup("old.txt")).st_ino
        stuck = env.streams.stop()
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND, os.O_WRONLY):
            start = trio.current_time()
            fi = await env.ops.open(ino, flags, None)
            assert trio.current_time() - start <= SEALED_REFRESH_WAIT_S < env.config.request_timeout
            await env.ops.release(fi.fh)
        assert stuck.is_set()
        env.streams.go_on()
        await env.store.seal_bucket("b")
        await trio.sleep(0.01)  # (sealed_ttl=0: the next check asks again)
        assert await fuse_error(env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, None)) == errno.EROFS

    ops_env(body, setup=bucket_b, bucket="b", sealed_ttl=0, clock=mock_clock())
