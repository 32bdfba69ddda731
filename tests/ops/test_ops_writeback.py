"""Write-back mode through the core over MemoryStreams: close returns before the upload, the pending
file shows its local bytes, rewrites merge, conflicts and refusals go to lost+found, an unanswered
upload is retried, and a later mount with the same cache dir replays what an earlier run left."""

from __future__ import annotations

import base64
import errno
import logging
import os
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pyfuse3
import pytest
import trio
from gowriters import delete_object, put_object
from opskit import CTX, ROOT, Ctx, Env
from test_ops_write import chunk_count, stored, write_file

from natsfs.adr20 import ObjectStore, meta_subject
from natsfs.compose import WRITE_BACK_JOURNAL, spool_root
from natsfs.core import writeback
from natsfs.errors import Conflict, Unavailable
from natsfs.journal import WriteBackJournal
from natsfs.memstreams import MemoryStreams

LATER = 3600.0  # a delay no test waits for: uploads happen only when the test asks (drain)


async def bucket_b(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=1 << 20)
    await put_object(ms, "b", "old.txt", b"old content")


def journal_of(env: Env) -> WriteBackJournal:
    assert env.fs.writeback is not None
    return env.fs.writeback.journal


def test_close_returns_before_the_upload_and_the_pending_file_shows_local_bytes(ops_env):
    async def body(env: Env):
        await write_file(env, ROOT, "new.txt", b"local bytes")
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"rewritten")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await env.store.get_info("b", "new.txt") is None
        old = await env.store.get_info("b", "old.txt")
        assert old is not None and old.size == len(b"old content")
        assert [r["name"] for r in journal_of(env).pending.values()] == ["new.txt", "old.txt"]
        assert (await env.lookup("new.txt")).st_size == len(b"local bytes")
        assert await env.cat("new.txt") == b"local bytes"
        assert await env.cat("old.txt") == b"rewritten"
        assert {"new.txt", "old.txt"} <= set((await env.listdir(ROOT)).names)
        await env.fs.shutdown(10)
        info = await env.store.get_info("b", "new.txt")
        assert info is not None and info.size == len(b"local bytes")
        assert (await env.store.get_info("b", "old.txt")).size == len(b"rewritten")  # type: ignore[union-attr]
        assert journal_of(env).pending == {}

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_rewrites_of_a_pending_file_merge_into_one_upload(ops_env):
    async def body(env: Env):
        for content in (b"one", b"two", b"three"):
            fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
            await env.ops.write(fi.fh, 0, content)
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)
        assert len(journal_of(env).pending) == 1
        await env.fs.shutdown(10)
        assert env.fs.counters["uploads"] == 1
        assert (await env.store.get_info("b", "old.txt")).size == 5  # type: ignore[union-attr]
        assert await env.cat("old.txt") == b"three"

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_a_pending_upload_never_overwrites_another_clients_newer_version(ops_env, tmp_path):
    async def body(env: Env):
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"mine")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await put_object(env.streams, "b", "old.txt", b"theirs, newer")
        await env.settle()
        await env.fs.shutdown(10)
        assert (await env.store.get_info("b", "old.txt")).size == len(b"theirs, newer")  # type: ignore[union-attr]
        kept = list((spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found" / "b").iterdir())
        assert [p.read_bytes() for p in kept] == [b"mine"]
        assert journal_of(env).pending == {}

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_an_unanswered_upload_is_retried_until_it_lands(ops_env):
    async def body(env: Env):
        env.streams.fail_next("publish", Unavailable("server gone"), times=3)
        await write_file(env, ROOT, "retry.txt", b"x" * 1000)
        await env.fs.shutdown(30)
        info = await env.store.get_info("b", "retry.txt")
        assert info is not None and info.size == 1000

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


def test_a_full_bucket_keeps_the_file_in_lost_found_never_half_stored(ops_env, tmp_path):
    async def body(env: Env):
        await write_file(env, ROOT, "big.bin", os.urandom(2 << 20))  # over the bucket's 1 MiB
        await env.fs.shutdown(10)
        assert await env.store.get_info("b", "big.bin") is None
        kept = list((spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found" / "b").iterdir())
        assert [p.stat().st_size for p in kept] == [2 << 20]
        assert journal_of(env).pending == {}

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


def test_a_later_mount_with_the_same_cache_dir_replays_pending_uploads(ops_env, tmp_path):
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "a.txt", b"first file")
        await write_file(env, ROOT, "b.txt", b"second file")
        # The daemon dies here: no shutdown, nothing uploaded.

    async def second(env: Env):
        with trio.fail_after(10):
            while await env.store.get_info("b", "b.txt") is None:
                await trio.sleep(0.01)
        assert (await env.store.get_info("b", "a.txt")).size == len(b"first file")  # type: ignore[union-attr]
        assert await env.cat("b.txt") == b"second file"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    root = spool_root(tmp_path / "cache", Path("/nonexistent"))
    assert len(WriteBackJournal(root / WRITE_BACK_JOURNAL).pending) == 2
    ops_env(second, bucket="b", streams=ms, write_back=0.0)


def test_without_write_back_a_dead_runs_pending_files_go_to_lost_found(ops_env, tmp_path):
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "a.txt", b"never uploaded")

    async def second(env: Env):
        assert await env.store.get_info("b", "a.txt") is None

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms)
    root = spool_root(tmp_path / "cache", Path("/nonexistent"))
    kept = list((root / "lost+found" / "leftover").iterdir())
    assert [p.read_bytes() for p in kept] == [b"never uploaded"]
    assert not (root / WRITE_BACK_JOURNAL).exists()


def test_a_renamed_pending_file_is_replayed_under_its_new_name(ops_env):
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "draft.txt", b"renamed before its upload")
        await env.ops.rename(ROOT, b"draft.txt", ROOT, b"final.txt", 0, None)
        assert await env.cat("final.txt") == b"renamed before its upload"

    async def second(env: Env):
        with trio.fail_after(10):
            while await env.store.get_info("b", "final.txt") is None:
                await trio.sleep(0.01)
        assert await env.store.get_info("b", "draft.txt") is None
        assert await env.cat("final.txt") == b"renamed before its upload"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)


def test_a_read_only_mount_leaves_pending_uploads_for_the_next_write_back_mount(ops_env, tmp_path):
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "a.txt", b"waiting")

    async def read_only(env: Env):
        assert await env.store.get_info("b", "a.txt") is None

    async def second(env: Env):
        with trio.fail_after(10):
            while await env.store.get_info("b", "a.txt") is None:
                await trio.sleep(0.01)
        assert await env.cat("a.txt") == b"waiting"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(read_only, bucket="b", streams=ms, read_only=True)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not (spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found").exists()


def test_closes_arriving_together_share_one_journal_sync(ops_env):
    async def body(env: Env):
        assert env.fs.writeback is not None
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(write_file, env, ROOT, f"f{i}.txt", f"file {i}".encode())
        counters = env.fs.writeback.counters
        assert counters["records"] == 10 and counters["journal_fsyncs"] < 10
        assert counters["spool_fsyncs"] == 0  # small files: the bytes are in their records
        assert sorted(r["name"] for r in journal_of(env).pending.values()) == [f"f{i}.txt" for i in range(10)]
        await env.fs.shutdown(10)
        for i in range(10):
            assert await env.cat(f"f{i}.txt") == f"file {i}".encode()
            assert (await env.store.get_info("b", f"f{i}.txt")).size == len(f"file {i}")  # type: ignore[union-attr]

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_a_small_files_record_restores_a_spool_file_the_crash_lost(ops_env, tmp_path):
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "a.txt", b"closed, in the record")
        # The machine dies: the spool file (never synced) is lost or torn; the record is durable.
        for f in (spool_root(tmp_path / "cache", Path("/nonexistent")) / "spool").iterdir():
            f.write_bytes(b"torn")

    async def second(env: Env):
        with trio.fail_after(10):
            while await env.store.get_info("b", "a.txt") is None:
                await trio.sleep(0.01)
        assert await env.cat("a.txt") == b"closed, in the record"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)


def test_a_replayed_upload_the_dead_run_had_stored_is_closed_not_kept_as_a_conflict(ops_env, tmp_path):
    ms = MemoryStreams()
    data = os.urandom(3000)

    async def first(env: Env):
        await write_file(env, ROOT, "a.txt", data)
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"new content")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        # The run stored both objects, then died before the journal's `done` records.
        await put_object(ms, "b", "a.txt", data)
        await put_object(ms, "b", "old.txt", b"new content")

    revisions: dict[str, int] = {}

    async def second(env: Env):
        with trio.fail_after(10):
            while journal_of(env).pending:
                await trio.sleep(0.01)
        for name in ("a.txt", "old.txt"):
            info = await env.store.get_info("b", name)
            assert info is not None
            revisions[name] = info.revision
        assert await env.cat("a.txt") == data
        assert await env.cat("old.txt") == b"new content"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    before = {name: seq for name, seq in ms.subjects("OBJ_b").items()}
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert ms.subjects("OBJ_b") == before  # nothing stored again
    assert not (spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found").exists()


def test_without_write_back_a_small_files_record_restores_its_bytes_for_lost_found(ops_env, tmp_path):
    ms = MemoryStreams()
    root = spool_root(tmp_path / "cache", Path("/nonexistent"))

    async def first(env: Env):
        await write_file(env, ROOT, "a.txt", b"closed, never uploaded")
        for f in (root / "spool").iterdir():
            f.write_bytes(b"torn")  # the machine died: the spool file was never synced

    async def second(env: Env):
        assert await env.store.get_info("b", "a.txt") is None

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms)
    assert [p.read_bytes() for p in (root / "lost+found" / "leftover").iterdir()] == [b"closed, never uploaded"]


def test_uploads_wait_for_a_burst_of_closes_to_pause_and_unmount_stores_them_all(ops_env, monkeypatch):
    monkeypatch.setattr(writeback, "BURST_QUIET_S", LATER)  # the burst never pauses within the test

    async def body(env: Env):
        assert env.fs.writeback is not None
        for i in range(20):
            await write_file(env, ROOT, f"t{i:02d}.txt", f"tar member {i}".encode())
        await trio.sleep(0.3)  # the uploader had every chance to start (its delay is 0)
        assert env.fs.writeback.counters["uploads"] == 0
        assert await env.store.get_info("b", "t00.txt") is None
        assert len(journal_of(env).pending) == 20
        assert await env.cat("t07.txt") == b"tar member 7"  # the pending files serve their local bytes
        await env.fs.shutdown(30)  # unmount does not wait for a pause
        assert env.fs.writeback.counters["uploads"] == 20 and journal_of(env).pending == {}
        for i in range(20):
            assert await stored(env, f"t{i:02d}.txt") == f"tar member {i}".encode()

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


def test_a_long_burst_uploads_once_its_backlog_is_full(ops_env, monkeypatch):
    monkeypatch.setattr(writeback, "BURST_QUIET_S", LATER)
    monkeypatch.setattr(writeback, "BURST_BACKLOG_FILES", 5)

    async def body(env: Env):
        assert env.fs.writeback is not None
        for i in range(12):
            await write_file(env, ROOT, f"b{i:02d}.txt", f"burst {i}".encode())
        with trio.fail_after(30):  # a liveness bound, not a speed target
            while len(journal_of(env).pending) > 5:
                await trio.sleep(0.01)
        # The oldest closes went first (the order of the closes), and another client sees them.
        assert await stored(env, "b00.txt") == b"burst 0"
        assert {r["name"] for r in journal_of(env).pending.values()} <= {f"b{i:02d}.txt" for i in range(7, 12)}
        await env.fs.shutdown(30)
        assert journal_of(env).pending == {}

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


def test_a_lone_close_is_uploaded_without_waiting_for_the_unmount(ops_env):
    async def body(env: Env):
        await write_file(env, ROOT, "lone.txt", b"just one")
        with trio.fail_after(30):  # a liveness bound, not a speed target
            while await env.store.get_info("b", "lone.txt") is None:
                await trio.sleep(0.01)
        assert await stored(env, "lone.txt") == b"just one"

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


def test_unmount_leaves_no_spool_file_created_ahead(ops_env, tmp_path):
    async def body(env: Env):
        for i in range(3):
            await write_file(env, ROOT, f"s{i}.txt", b"spooled")
        await env.fs.shutdown(30)
        assert env.fs.staging.spool.ready == 0
        assert list(env.fs.staging.spool.dir.iterdir()) == []
        for i in range(3):
            assert await stored(env, f"s{i}.txt") == b"spooled"

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


def test_an_inode_the_kernel_forgot_before_its_upload_leaves_nothing_behind_once_stored(ops_env):
    """The kernel forgets the inodes of files written in write-back mode (tar -x of many files) while
    their uploads wait: each inode is kept for its upload and dropped when it settles. What the mount
    kept about the inode for the kernel (the size it was told, the version its pages held) went with it
    on a forget, but stayed for good when the inode was dropped at the upload: memory growing by one
    entry per file for the life of the mount."""
    async def body(env: Env):
        for i in range(3):
            fi, attr = await env.ops.create(ROOT, f"f{i}".encode(), 0o644, os.O_WRONLY | os.O_CREAT, CTX)
            await env.ops.write(fi.fh, 0, b"bytes %d" % i)
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)
            env.ops.forget([(attr.st_ino, 1)])  # (create counted one lookup)
        assert env.fs.writeback is not None
        await env.fs.writeback.drain(30)
        for i in range(3):
            assert await stored(env, f"f{i}") == b"bytes %d" % i
        assert env.fs._told_sizes == {}
        assert len(env.fs.files) == 0

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


# ---------------------------------------------------------------------- unlinked or replaced before upload
def lost_found(tmp_path: Path) -> Path:
    return spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found"


def spool_dir(tmp_path: Path) -> Path:
    return spool_root(tmp_path / "cache", Path("/nonexistent")) / "spool"


async def replayed(env: Env) -> None:
    """Wait until the replay of what the dead run left is done."""
    with trio.fail_after(10):
        while journal_of(env).pending:
            await trio.sleep(0.01)


def test_a_pending_file_unlinked_before_a_crash_never_comes_back(ops_env, tmp_path):
    ms = MemoryStreams()
    big = os.urandom(200_000)  # (past INLINE_BYTES: a spool file, not its record, holds its bytes)

    async def first(env: Env):
        await write_file(env, ROOT, "gone.txt", b"unlinked before its upload")
        await write_file(env, ROOT, "gone.bin", big)
        await env.ops.unlink(ROOT, b"gone.txt", None)
        await env.ops.unlink(ROOT, b"gone.bin", None)
        assert journal_of(env).pending == {}
        assert list(spool_dir(tmp_path).iterdir()) == []  # (its staged bytes went with it)
        # The daemon dies here, before the uploader's turn.

    async def second(env: Env):
        await replayed(env)
        assert not {"gone.txt", "gone.bin"} & set((await env.listdir(ROOT)).names)
        assert await env.store.get_info("b", "gone.txt") is None
        assert await env.store.get_info("b", "gone.bin") is None

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


def test_a_pending_file_unlinked_and_created_again_replays_its_new_content_only(ops_env, tmp_path, caplog):
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "f.txt", b"FIRST")
        await env.ops.unlink(ROOT, b"f.txt", None)
        await write_file(env, ROOT, "f.txt", b"SECOND")
        assert await env.cat("f.txt") == b"SECOND"

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "f.txt") == b"SECOND"
        assert await env.cat("f.txt") == b"SECOND"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()
    assert not [r for r in caplog.records if "not reachable" in r.getMessage()]


def test_a_pending_file_replaced_by_a_rename_replays_the_new_content_only(ops_env, tmp_path):
    """The atomic save over a pending file (write a temporary file, rename it over), twice: over a new
    file, and over a rewrite of a stored object."""
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "f.txt", b"OLD")
        await write_file(env, ROOT, "tmp", b"NEW")
        await env.ops.rename(ROOT, b"tmp", ROOT, b"f.txt", 0, None)
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"rewritten, pending")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await write_file(env, ROOT, "tmp2", os.urandom(100) + b"saved over it")
        await env.ops.rename(ROOT, b"tmp2", ROOT, b"old.txt", 0, None)
        assert await env.cat("f.txt") == b"NEW"
        assert [r["name"] for r in journal_of(env).pending.values()] == ["f.txt", "old.txt"]
        saved[:] = [await env.cat("old.txt")]

    saved: list[bytes] = []

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "f.txt") == b"NEW"
        assert await stored(env, "old.txt") == saved[0]
        assert await env.cat("f.txt") == b"NEW"
        assert not {"tmp", "tmp2"} & set((await env.listdir(ROOT)).names)

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


def test_a_stored_object_renamed_over_a_pending_file_stays_after_a_crash(ops_env, tmp_path):
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "f.txt", b"pending, then replaced")
        await env.ops.rename(ROOT, b"old.txt", ROOT, b"f.txt", 0, None)
        assert await env.cat("f.txt") == b"old content"
        assert journal_of(env).pending == {}

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "f.txt") == b"old content"
        assert await env.cat("f.txt") == b"old content"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


def test_a_replay_of_two_live_records_of_one_name_keeps_the_later_one_only(ops_env, tmp_path, caplog):
    """A journal an earlier version left (it did not close the record of a pending file replaced by a
    rename): the later record is what the program saw; the older one is closed without an upload and
    without lost+found, and its spool file goes."""
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "f.txt", os.urandom(100_000))  # (a spool file holds its bytes)

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    root = spool_root(tmp_path / "cache", Path("/nonexistent"))
    journal = WriteBackJournal(root / WRITE_BACK_JOURNAL)
    [older] = journal.pending.values()
    assert (spool_dir(tmp_path) / older["id"]).is_file()
    newer = {**older, "id": "f" * 24, "size": 3, "data": base64.b64encode(b"NEW").decode()}
    journal.record(newer)
    journal.close()

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "f.txt") == b"NEW"
        assert await env.cat("f.txt") == b"NEW"

    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()
    assert not (spool_dir(tmp_path) / older["id"]).exists()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "f.txt" in r.getMessage()]


@pytest.mark.expect_log(r"the staged bytes could not be made durable on local disk")
def test_a_close_the_local_disk_could_not_journal_is_uploaded_at_its_release(ops_env, caplog):
    """A cache disk too full for the journal record: the close fails with ENOSPC, and the bytes are only
    in the daemon. Its last release held them, unqueued, until the unmount (a crash before it lost
    them; seen on a full tmpfs cache dir): it queues the upload instead, with one error line naming the
    file. The closes' own line is the same for every file (a run of them is logged once)."""
    async def body(env: Env):
        journal = journal_of(env)

        def disk_full(records: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        journal.commit = disk_full  # type: ignore[method-assign]
        fi, _ = await env.ops.create(ROOT, b"nospace.txt", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, b"the bytes")
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.flush(fi.fh)
        assert e.value.errno == errno.ENOSPC
        await env.ops.release(fi.fh)
        fi, _ = await env.ops.create(ROOT, b"second.txt", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, b"more bytes")
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.flush(fi.fh)
        assert e.value.errno == errno.ENOSPC
        await env.ops.release(fi.fh)
        with trio.fail_after(30):  # a liveness bound, not a speed target
            while None in [await env.store.get_info("b", n) for n in ("nospace.txt", "second.txt")]:
                await trio.sleep(0.01)
        assert await stored(env, "nospace.txt") == b"the bytes"
        assert await stored(env, "second.txt") == b"more bytes"
        assert journal.pending == {}
        why = "the staged bytes could not be made durable on local disk: [Errno 28] No space left on device"
        assert [r.getMessage() for r in caplog.records if "made durable" in r.getMessage()] == [
            f"flush: {why}",
            f"b/nospace.txt: {why}; it is uploaded without a write-back record (a crash before the upload loses it)",
            f"b/second.txt: {why}; it is uploaded without a write-back record (a crash before the upload loses it)"]

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


def _die_after_the_rename_is_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon dies once the rename is in the bucket, before the records under the new names are synced
    (every journal sync after the rename's `moving_to` and `removed_by` records fails; the test's body then
    returns)."""
    original = writeback.WriteBack._sync_records

    async def sync(self: writeback.WriteBack, records: list[dict[str, Any]]) -> None:
        if not all(r.get("moving_to") or r.get("removed_by") for r in records):
            raise OSError(errno.EIO, "the daemon dies here")
        await original(self, records)

    monkeypatch.setattr(writeback.WriteBack, "_sync_records", sync)


@pytest.mark.expect_log("rename: the staged bytes could not be made durable")
def test_a_crash_after_a_pending_rewrite_was_renamed_replays_it_under_the_new_name(ops_env, tmp_path, monkeypatch):
    """A stored object rewritten (closed, pending), then renamed (file and directory): the daemon dies once
    the rename is stored in the bucket, before the record under the new name is synced. The replay stores
    the acknowledged bytes under the new name (was: under the old name, refused as another client's change
    into lost+found, while the new name kept the older version)."""
    ms = MemoryStreams()

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await bucket_b(ms, store)
        await put_object(ms, "b", "d/in.txt", b"old inner")

    async def first(env: Env):
        for name in ("old.txt", "d/in.txt"):
            await _rewrite(env, name, b"rewritten " + name.split("/")[-1].encode())
        _die_after_the_rename_is_stored(monkeypatch)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"old.txt", ROOT, b"new.txt", 0, None)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"d", ROOT, b"e", 0, None)

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "new.txt") == b"rewritten old.txt"
        assert await stored(env, "e/in.txt") == b"rewritten in.txt"
        for gone in ("old.txt", "d/in.txt"):
            info = await env.store.get_info("b", gone)
            assert info is None or info.deleted
        assert await env.cat("new.txt") == b"rewritten old.txt"

    ops_env(first, setup=setup, bucket="b", streams=ms, write_back=LATER)
    monkeypatch.undo()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


@pytest.mark.expect_log("rename: the daemon dies here")
def test_a_crash_before_a_pending_rewrites_rename_reached_the_bucket_replays_it_under_the_old_name(
        ops_env, tmp_path, monkeypatch):
    ms = MemoryStreams()

    async def first(env: Env):
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"rewritten, pending")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)

        async def dies(*args: Any, **kwargs: Any) -> None:
            raise Unavailable("the daemon dies here")

        monkeypatch.setattr(env.fs.mut, "rename_object", dies)
        _die_after_the_rename_is_stored(monkeypatch)  # (the failed rename's own cleanup is not written)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"old.txt", ROOT, b"new.txt", 0, None)
        assert [r.get("moving_to") for r in journal_of(env).pending.values()] == ["new.txt"]

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "old.txt") == b"rewritten, pending"
        assert await env.store.get_info("b", "new.txt") is None

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    monkeypatch.undo()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


@pytest.mark.expect_log("rename: the staged bytes could not be made durable")
def test_a_crash_after_an_atomic_saves_pending_file_was_renamed_replays_it_under_the_new_name(
        ops_env, tmp_path, monkeypatch):
    """A new file renamed over a stored object (pending: it replaces that object at its upload), then
    renamed on, which deletes that object at once: the daemon dies before the record under the new name
    is synced. The replay stores the acknowledged bytes under the new name (was: under the old name,
    where the deleted object made it a conflict: in lost+found, stored under neither name)."""
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "tmp", b"NEW")
        await env.ops.rename(ROOT, b"tmp", ROOT, b"old.txt", 0, None)
        _die_after_the_rename_is_stored(monkeypatch)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"old.txt", ROOT, b"new.txt", 0, None)
        info = await env.store.get_info("b", "old.txt")
        assert info is not None and info.deleted  # (the object it replaced is gone already)

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "new.txt") == b"NEW"
        info = await env.store.get_info("b", "old.txt")
        assert info is not None and info.deleted

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    monkeypatch.undo()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


@pytest.mark.expect_log("rename: the server does not answer")
def test_a_failed_rename_of_a_pending_rewrite_leaves_its_record_naming_no_move(ops_env, monkeypatch):
    """The record written before the rename (`moving_to`) is written again as it was when the rename
    fails: a later replay never takes another client's change for that rename."""
    async def body(env: Env):
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"rewritten, pending")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)

        async def refused(*args: Any, **kwargs: Any) -> None:
            raise Unavailable("the server does not answer")

        monkeypatch.setattr(env.fs.mut, "rename_object", refused)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"old.txt", ROOT, b"new.txt", 0, None)
        assert [(r["name"], r.get("moving_to")) for r in journal_of(env).pending.values()] == [("old.txt", None)]
        assert await env.cat("old.txt") == b"rewritten, pending"

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def _die_before_the_done_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon dies once an unlink or a rename is in the bucket, before the `done` record of the pending
    file it removed is synced (every journal sync holding a `done` fails; the test's body then returns)."""
    original = writeback.WriteBack._sync_records

    async def sync(self: writeback.WriteBack, records: list[dict[str, Any]]) -> None:
        if any(r.get("op") == "done" for r in records):
            raise OSError(errno.EIO, "the daemon dies here")
        await original(self, records)

    monkeypatch.setattr(writeback.WriteBack, "_sync_records", sync)


async def _rewrite(env: Env, name: str, data: bytes) -> None:
    fi = await env.ops.open((await env.lookup(name)).st_ino, os.O_WRONLY | os.O_TRUNC, None)
    await env.ops.write(fi.fh, 0, data)
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)


def _conflict_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "changed it meanwhile" in r.getMessage()]


@pytest.mark.expect_log("the daemon dies here")
def test_a_crash_after_the_tombstone_of_an_unlinked_pending_file_replays_nothing(ops_env, tmp_path, caplog):
    """An unlink of a pending rewrite, and of a pending file saved over a stored object (which it replaces
    at its upload): the daemon dies once the tombstone is stored, before the `done` record is synced. The
    replay recognises the tombstone as this mount's own (its Nats-Msg-Id, named in the record before it
    was published) and closes the record: nothing in lost+found, no warning that another client changed
    the file (was: both)."""
    ms = MemoryStreams()
    kill = pytest.MonkeyPatch()  # (the kill point; undone for the next mount)

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await bucket_b(ms, store)
        await put_object(ms, "b", "saved.txt", b"saved over")

    async def first(env: Env):
        await _rewrite(env, "old.txt", b"rewritten, pending")
        await write_file(env, ROOT, "tmp", b"NEW")
        await env.ops.rename(ROOT, b"tmp", ROOT, b"saved.txt", 0, None)
        _die_before_the_done_record(kill)
        for name in (b"old.txt", b"saved.txt"):
            with pytest.raises(pyfuse3.FUSEError):
                await env.ops.unlink(ROOT, name, None)
        for name in ("old.txt", "saved.txt"):
            info = await env.store.get_info("b", name)
            assert info is not None and info.deleted
        assert sorted(r["name"] for r in journal_of(env).pending.values()) == ["old.txt", "saved.txt"]

    async def second(env: Env):
        await replayed(env)
        for name in ("old.txt", "saved.txt"):
            info = await env.store.get_info("b", name)
            assert info is not None and info.deleted
        assert not {"old.txt", "saved.txt"} & set((await env.listdir(ROOT)).names)

    ops_env(first, setup=setup, bucket="b", streams=ms, write_back=LATER)
    kill.undo()
    caplog.clear()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()
    assert not _conflict_lines(caplog)
    assert list(spool_dir(tmp_path).iterdir()) == []


@pytest.mark.expect_log("the daemon dies here")
def test_a_crash_after_a_stored_file_was_renamed_over_a_pending_one_replays_nothing(ops_env, tmp_path, caplog):
    """A stored object renamed over a pending rewrite, and over a pending new file: the daemon dies once the
    rename is stored, before the pending file's `done` record is synced. The replay finds the rename's
    meta at the name (its Nats-Msg-Id) and closes the record: the renamed object stays, nothing in
    lost+found (was: the pending bytes there, with a warning that another client changed the file)."""
    ms = MemoryStreams()
    kill = pytest.MonkeyPatch()  # (the kill point; undone for the next mount)

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await bucket_b(ms, store)
        await put_object(ms, "b", "a.txt", b"stored a")
        await put_object(ms, "b", "c.txt", b"stored c")

    async def first(env: Env):
        await _rewrite(env, "old.txt", b"rewritten, pending")
        await write_file(env, ROOT, "new.txt", b"new, pending")
        _die_before_the_done_record(kill)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"a.txt", ROOT, b"old.txt", 0, None)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"c.txt", ROOT, b"new.txt", 0, None)

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "old.txt") == b"stored a"
        assert await stored(env, "new.txt") == b"stored c"
        assert await env.cat("old.txt") == b"stored a"
        for name in ("a.txt", "c.txt"):
            info = await env.store.get_info("b", name)
            assert info is not None and info.deleted

    ops_env(first, setup=setup, bucket="b", streams=ms, write_back=LATER)
    kill.undo()
    caplog.clear()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()
    assert not _conflict_lines(caplog)


@pytest.mark.expect_log("the daemon dies here")
def test_a_crash_in_an_unlink_of_a_pending_file_keeps_the_bytes_when_the_change_is_not_its_own(
        ops_env, tmp_path, caplog):
    """The record names the unlink's tombstone, but the bucket holds another client's change of the name:
    killed before the tombstone was published (another client then deleted the file), and killed after it
    (another client then stored the name again). Either way the replay is a conflict as ever: the bytes
    are kept in lost+found, never dropped as if the unlink had removed them."""
    ms = MemoryStreams()
    kill = pytest.MonkeyPatch()  # (the kill point; undone for the next mount)

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await bucket_b(ms, store)
        await put_object(ms, "b", "two.txt", b"stored two")

    async def first(env: Env):
        await _rewrite(env, "old.txt", b"pending one")
        await _rewrite(env, "two.txt", b"pending two")
        original = env.fs.mut.delete

        async def dies_before(bucket: str, info: Any, **kwargs: Any) -> None:
            if info.name == "old.txt":
                raise Unavailable("the daemon dies here")
            await original(bucket, info, **kwargs)

        kill.setattr(env.fs.mut, "delete", dies_before)
        _die_before_the_done_record(kill)
        # (Killed there, it syncs nothing more: not the record of a failed unlink, naming no tombstone again.)
        sync = writeback.WriteBack._sync_records

        async def dead_for_old(self: writeback.WriteBack, records: list[dict[str, Any]]) -> None:
            if any(r.get("name") == "old.txt" and not r.get("removed_by") for r in records):
                raise OSError(errno.EIO, "the daemon dies here")
            await sync(self, records)

        kill.setattr(writeback.WriteBack, "_sync_records", dead_for_old)
        for name in (b"old.txt", b"two.txt"):
            with pytest.raises(pyfuse3.FUSEError):
                await env.ops.unlink(ROOT, name, None)
        assert [bool(r.get("removed_by")) for r in journal_of(env).pending.values()] == [True, True]

    async def other_client(ms: MemoryStreams, store: ObjectStore) -> None:
        await delete_object(ms, "b", "old.txt")
        await put_object(ms, "b", "two.txt", b"theirs")

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "two.txt") == b"theirs"
        info = await env.store.get_info("b", "old.txt")
        assert info is not None and info.deleted

    ops_env(first, setup=setup, bucket="b", streams=ms, write_back=LATER)
    kill.undo()
    trio.run(other_client, ms, None)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    kept = sorted(p.read_bytes() for p in (lost_found(tmp_path) / "b").iterdir())
    assert kept == [b"pending one", b"pending two"]
    assert len(_conflict_lines(caplog)) == 2


def _die_before_the_claim(env: Env, monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """The daemon dies between a rename's two publishes: the meta under the new name is stored, the claim
    of the old name is not (and no journal sync after the rename's own `moving_to` records lands)."""
    original = env.store.publish_meta

    async def publish_meta(bucket: str, doc: dict[str, Any], **kwargs: Any) -> Any:
        if doc.get("deleted") and doc.get("name") == old:
            raise Unavailable("the daemon dies here")
        return await original(bucket, doc, **kwargs)

    monkeypatch.setattr(env.store, "publish_meta", publish_meta)
    _die_after_the_rename_is_stored(monkeypatch)


async def _live_metas_hold_their_chunks(env: Env) -> dict[str, str]:
    """Every live object of the bucket reads back whole (its chunks are there); name -> nuid."""
    out = {}
    for name, info in (await env.store.live_objects("b")).items():
        if info.size:
            assert await stored(env, name) is not None
        out[name] = info.nuid
    return out


@pytest.mark.expect_log("the daemon dies here", "could not be made durable")
def test_a_crash_between_the_publishes_of_a_pending_rewrites_rename_finishes_it(ops_env, tmp_path):
    """A pending rewrite renamed, cut between the rename's two publishes (the stored version under both
    names, one nuid). The replay stores the acknowledged bytes under the new name, the old name's claim
    is published then (the rename finished), and the replaced version's chunks are purged only once no
    live name holds them: every live meta reads back whole, no name keeps the older version."""
    ms = MemoryStreams()
    kill = pytest.MonkeyPatch()  # (the kill point; undone for the next mount)

    async def first(env: Env):
        await _rewrite(env, "old.txt", b"rewritten, pending")
        _die_before_the_claim(env, kill, "old.txt")
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"old.txt", ROOT, b"new.txt", 0, None)
        old, new = await env.store.get_info("b", "old.txt"), await env.store.get_info("b", "new.txt")
        assert old is not None and new is not None and not old.deleted and old.nuid == new.nuid

    async def second(env: Env):
        await replayed(env)
        await env.settle()
        assert await stored(env, "new.txt") == b"rewritten, pending"
        assert await _live_metas_hold_their_chunks(env) == {"new.txt": ANY}
        info = await env.store.get_info("b", "old.txt")
        assert info is not None and info.deleted
        assert await env.cat("new.txt") == b"rewritten, pending"
        assert "old.txt" not in (await env.listdir(ROOT)).names

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    kill.undo()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


@pytest.mark.expect_log("the daemon dies here", "could not be made durable")
def test_a_crash_between_the_publishes_of_a_rename_over_a_pending_file_keeps_both_names_whole(
        ops_env, tmp_path):
    """A stored object renamed over a pending rewrite, cut between the rename's two publishes: both names
    hold the stored object (one nuid, as documented for any rename cut there). The replay closes the
    pending file's record (the rename's meta is at its name) and purges nothing: both names read back
    whole, nothing in lost+found."""
    ms = MemoryStreams()
    kill = pytest.MonkeyPatch()  # (the kill point; undone for the next mount)

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await bucket_b(ms, store)
        await put_object(ms, "b", "a.txt", b"stored a")

    async def first(env: Env):
        await _rewrite(env, "old.txt", b"rewritten, pending")
        _die_before_the_claim(env, kill, "a.txt")
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.rename(ROOT, b"a.txt", ROOT, b"old.txt", 0, None)

    async def second(env: Env):
        await replayed(env)
        await env.settle()
        nuids = await _live_metas_hold_their_chunks(env)
        assert set(nuids) == {"a.txt", "old.txt"} and nuids["a.txt"] == nuids["old.txt"]
        assert await stored(env, "old.txt") == b"stored a"

    ops_env(first, setup=setup, bucket="b", streams=ms, write_back=LATER)
    kill.undo()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()


def test_a_failed_unlink_of_a_pending_file_replays_its_bytes_at_the_next_mount(ops_env, tmp_path, caplog):
    """Unlinks of pending rewrites whose tombstone the bucket refuses: a conflict (twice: the unlink's own
    retry too), and no answer until the publish gives up (nothing stored). The unlink fails, the file
    stays, and its record (which named the tombstone) is replayed at the next mount: the acknowledged
    bytes are uploaded to the name, never dropped, nothing in lost+found, no conflict warning."""
    ms = MemoryStreams()

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await bucket_b(ms, store)
        await put_object(ms, "b", "two.txt", b"stored two")

    async def first(env: Env):
        await _rewrite(env, "old.txt", b"pending one")
        await _rewrite(env, "two.txt", b"pending two")
        env.streams.fail_next("publish", Conflict("wrong last sequence"), subject=meta_subject("b", "old.txt"),
                              times=2)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.unlink(ROOT, b"old.txt", None)
        env.store.settle_timeout = 0.2
        env.streams.fail_next("publish", Unavailable("server gone"), subject=meta_subject("b", "two.txt"),
                              times=1000)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.unlink(ROOT, b"two.txt", None)
        env.streams._faults.clear()
        assert await env.cat("old.txt") == b"pending one"
        assert await env.cat("two.txt") == b"pending two"
        assert sorted(r["name"] for r in journal_of(env).pending.values()) == ["old.txt", "two.txt"]
        # The daemon dies here, before the uploader's turn.

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "old.txt") == b"pending one"
        assert await stored(env, "two.txt") == b"pending two"

    ops_env(first, setup=setup, bucket="b", streams=ms, write_back=LATER)
    caplog.clear()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()
    assert not _conflict_lines(caplog)
    assert list(spool_dir(tmp_path).iterdir()) == []


@pytest.mark.expect_log("may or may not be stored")
def test_an_unlink_of_a_pending_file_whose_outcome_is_unknown_keeps_its_bytes(ops_env, tmp_path, caplog):
    """An unlink of a pending rewrite whose tombstone is stored but neither its ack nor any read-back
    answers (`OutcomeUnknown`): the unlink fails (EIO) and the file stays with its pending bytes. At the
    next mount they are uploaded to the name, nothing in lost+found (was: the record still named the
    tombstone, the replay took it for the unlink's and closed it: the bytes of a file the program was
    told had not been removed were dropped, the name deleted)."""
    ms = MemoryStreams()

    async def first(env: Env):
        await _rewrite(env, "old.txt", b"pending one")
        await _unlink_whose_answers_are_lost(env, "old.txt")
        # The daemon dies here, before the uploader's turn.

    async def second(env: Env):
        await replayed(env)
        assert await stored(env, "old.txt") == b"pending one"
        assert await env.cat("old.txt") == b"pending one"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    caplog.clear()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
    assert not lost_found(tmp_path).exists()
    assert not _conflict_lines(caplog)
    assert list(spool_dir(tmp_path).iterdir()) == []


async def _unlink_whose_answers_are_lost(env: Env, name: str) -> None:
    """Unlink `name` with its tombstone stored but neither its ack nor any read-back answering
    (`OutcomeUnknown`): the unlink fails (EIO), the file stays with its pending bytes, the bucket holds
    the tombstone."""
    cut = pytest.MonkeyPatch()
    env.store.settle_timeout = 0.2
    original = env.streams.publish

    async def ack_lost(subject: str, data: bytes, headers: Any = None, **kw: Any) -> int:
        seq = await original(subject, data, headers, **kw)
        if subject == meta_subject("b", name):  # (stored; no answer from here on)
            env.streams.fail_next("last_msg", Unavailable("server gone"), times=1000)
            raise Unavailable("ack lost")
        return seq

    cut.setattr(env.streams, "publish", ack_lost)
    with pytest.raises(pyfuse3.FUSEError) as failed:
        await env.ops.unlink(ROOT, name.encode(), None)
    assert failed.value.errno == errno.EIO
    cut.undo()
    env.streams._faults.clear()
    assert await env.cat(name) == b"pending one"
    info = await env.store.get_info("b", name)
    assert info is not None and info.deleted  # (the tombstone was stored all the same)


@pytest.mark.expect_log("may or may not be stored")
@pytest.mark.parametrize("old", [b"old content", b""], ids=["chunked", "empty"])
def test_an_unlink_of_a_pending_file_whose_outcome_is_unknown_uploads_its_bytes_in_the_same_run(
        ops_env, tmp_path, caplog, old):
    """As above, without a restart: the unlink fails (EIO), the file stays with its pending bytes and the
    bucket holds the tombstone. The uploader of the same run stores the acknowledged bytes under the
    name over that tombstone (this mount's own publish whose outcome was unknown, not another client's
    change: the put journal knows it; for an empty stored object, which the put log does not note, its
    `Nats-Msg-Id` names it the failed unlink's, where the bytes went to lost+found with a warning that
    another client had changed the name), keeping the meta's description and metadata, the replaced
    version's chunks purged: nothing in lost+found, no warning that another client changed it."""

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b", max_bytes=1 << 20)
        await put_object(ms, "b", "old.txt", old, description="theirs", metadata={"note": "kept"})

    async def body(env: Env):
        await _rewrite(env, "old.txt", b"pending one")
        await _unlink_whose_answers_are_lost(env, "old.txt")
        await env.fs.shutdown(10)  # (the uploader's turn, in this run)
        assert journal_of(env).pending == {}
        assert await stored(env, "old.txt") == b"pending one"
        got = await env.store.get_meta_doc("b", "old.txt")
        assert got is not None and not got[0].get("deleted")
        assert (got[0].get("description"), got[0].get("metadata")) == ("theirs", {"note": "kept"})
        if old:
            assert chunk_count(env) == 1  # (the old version's chunks purged)
        assert await env.cat("old.txt") == b"pending one"

    ops_env(body, setup=setup, bucket="b", write_back=LATER)
    assert not lost_found(tmp_path).exists()
    assert not _conflict_lines(caplog)
    assert list(spool_dir(tmp_path).iterdir()) == []
