"""Bytes that belong in lost+found when the local disk cannot take them (full cache disk, simulated by
`helpers.full_local_disk`): they stay staged (UNKEPT), one ERROR line says so, nothing partial looks
kept, the mount goes on, and a retry keeps them once space frees (or the next mount does)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pyfuse3
import pytest
import trio
from gowriters import put_object
from helpers import full_local_disk
from opskit import ROOT, Env, errno_of
from test_ops_write import Ctx, stored, write_file

from natsfs.adr20 import ObjectStore
from natsfs.compose import spool_root
from natsfs.errors import NoSpace
from natsfs.memstreams import MemoryStreams

LATER = 3600.0  # write-back uploads happen only when the test asks (shutdown)
NOT_KEPT = r"could not be written to .*lost\+found \(No space left on device\)"
SMALL = 50_000  # held in memory (a memfd)
LARGE = 100_000  # held in a spool file


async def bucket_b(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=1 << 20)
    await put_object(ms, "b", "old.txt", b"old content")


async def tiny_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=1000)  # refuses every put below


def kept_files(tmp_path: Path) -> list[Path]:
    lost_found = spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found"
    return sorted(p for p in lost_found.rglob("*") if p.is_file())


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.expect_log(NOT_KEPT)
@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_a_failed_close_the_full_disk_cannot_keep_holds_its_bytes_until_space_frees(
        ops_env, tmp_path, monkeypatch, caplog, size):
    data = os.urandom(size)

    async def body(env: Env):
        spool = env.fs.staging.spool
        fi, attr = await env.ops.create(ROOT, b"f.bin", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, data)
        sf = env.fs.staging.get(attr.st_ino)
        assert sf is not None and sf.in_memory is (size == SMALL)
        env.streams.fail_next("publish", NoSpace("bucket full"), subject="$O.b.M.>")
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.flush(fi.fh)
        assert errno_of(e.value) == errno.ENOSPC
        if size == SMALL:  # the copy starts and is cut short (a spool file is moved: making lost+found/b fails)
            (spool.lost_found / "b").mkdir(parents=True)
        free = full_local_disk(monkeypatch)
        caplog.clear()
        await env.ops.release(fi.fh)  # no error escapes: the close has returned long ago
        [line] = errors(caplog)
        assert "b/f.bin" in line.getMessage() and line.exc_info is None
        assert kept_files(tmp_path) == [] and env.fs.unkept == [sf]
        assert spool.used == size and spool.memory_used == (-(-size // 4096) * 4096 if size == SMALL else 0)
        await env.fs.retry_keeping()  # still full: held, and no second line
        assert len(errors(caplog)) == 1 and env.fs.unkept == [sf] and kept_files(tmp_path) == []
        free()
        await env.fs.retry_keeping()
        [kept] = kept_files(tmp_path)
        assert kept.read_bytes() == data and kept.parent.name == "b"
        assert env.fs.unkept == [] and (spool.used, spool.memory_used) == (0, 0)
        assert "now kept at" in caplog.text
        await write_file(env, ROOT, "after.txt", b"the mount goes on")
        assert await stored(env, "after.txt") == b"the mount goes on"

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.expect_log(NOT_KEPT)
def test_a_conflict_at_close_the_full_disk_cannot_keep_is_enospc_and_kept_later(ops_env, tmp_path, monkeypatch):
    async def body(env: Env):
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"mine")
        await put_object(env.streams, "b", "old.txt", b"theirs, newer")
        free = full_local_disk(monkeypatch)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.flush(fi.fh)
        assert errno_of(e.value) == errno.ENOSPC  # the close learns why its bytes are not in lost+found
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == b"theirs, newer" and kept_files(tmp_path) == []
        free()
        await env.fs.retry_keeping()
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [b"mine"]

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.expect_log(NOT_KEPT, r"b/f\.bin: unmounting, and its 100000 bytes still cannot be written .*next mount "
                                  r"moves to lost\+found/leftover")
def test_a_spool_file_still_unkept_at_unmount_goes_to_lost_found_at_the_next_mount(ops_env, tmp_path, monkeypatch):
    data = os.urandom(LARGE)
    frees = []

    async def first(env: Env):
        fi, _ = await env.ops.create(ROOT, b"f.bin", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, data)
        env.streams.fail_next("publish", NoSpace("bucket full"), subject="$O.b.M.>")
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.flush(fi.fh)
        frees.append(full_local_disk(monkeypatch))
        await env.ops.release(fi.fh)
        await env.fs.shutdown(10)
        assert kept_files(tmp_path) == []

    async def second(env: Env):
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [data]

    ms = MemoryStreams()
    ops_env(first, setup=bucket_b, bucket="b", streams=ms)
    frees[0]()
    ops_env(second, bucket="b", streams=ms)


@pytest.mark.expect_log(NOT_KEPT)
def test_a_refused_write_back_upload_the_full_disk_cannot_keep_is_kept_once_space_frees(
        ops_env, tmp_path, monkeypatch, caplog):
    data = os.urandom(SMALL)

    async def body(env: Env):
        assert env.fs.writeback is not None
        await write_file(env, ROOT, "x.bin", data)  # close returns: journalled, bytes in memory
        free = full_local_disk(monkeypatch)
        with trio.fail_after(10):
            while not env.fs.unkept:  # the uploader runs, the bucket refuses, the disk refuses the copy
                await trio.sleep(0.01)
        [line] = errors(caplog)
        assert "b/x.bin" in line.getMessage() and line.exc_info is None
        assert len(env.fs.writeback.journal.pending) == 1  # the record stays open
        assert kept_files(tmp_path) == []
        free()
        await env.fs.retry_keeping()
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [data]
        assert env.fs.writeback.journal.pending == {}
        assert env.fs.staging.spool.memory_used == 0
        await env.fs.shutdown(10)

    ops_env(body, setup=tiny_bucket, bucket="b", write_back=0.0)


@pytest.mark.expect_log(NOT_KEPT, r"b/(x\.bin|old\.txt): unmounting, and its \d+ bytes still cannot be written .*"
                                  r"stay in the write-back journal",
                        r"closed in write-back mode by an earlier run, but its staged bytes cannot be restored")
def test_write_back_bytes_still_unkept_at_unmount_stay_journalled_and_the_next_mount_keeps_them(
        ops_env, tmp_path, monkeypatch):
    ms = MemoryStreams()
    refused, mine = os.urandom(SMALL), b"mine, conflicting"
    frees = []

    async def first(env: Env):
        assert env.fs.writeback is not None
        await write_file(env, ROOT, "x.bin", refused)  # over the bucket's limit: refused
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, mine)
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await put_object(env.streams, "b", "old.txt", b"theirs, newer")  # a conflict
        await env.settle()
        frees.append(full_local_disk(monkeypatch))
        await env.fs.shutdown(10)  # the daemon does not die; nothing half-kept
        assert kept_files(tmp_path) == []
        assert sorted(r["name"] for r in env.fs.writeback.journal.pending.values()) == ["old.txt", "x.bin"]

    async def still_full(env: Env):  # the disk is still full at the next mount: it starts, and keeps the records
        assert env.fs.writeback is not None
        assert sorted(r["name"] for r in env.fs.writeback.journal.pending.values()) == ["old.txt", "x.bin"]
        assert kept_files(tmp_path) == [] and list(env.fs.staging.spool.dir.iterdir()) == []
        assert await env.cat("old.txt") == b"theirs, newer"

    async def second(env: Env):
        with trio.fail_after(10):
            while len(kept_files(tmp_path)) < 2:
                await trio.sleep(0.01)
        assert sorted(p.read_bytes() for p in kept_files(tmp_path)) == sorted([refused, mine])
        assert env.fs.writeback is not None
        with trio.fail_after(10):
            while env.fs.writeback.journal.pending:
                await trio.sleep(0.01)
        assert await stored(env, "old.txt") == b"theirs, newer"

    async def setup(ms_: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b", max_bytes=SMALL // 2)
        await put_object(ms_, "b", "old.txt", b"old content")

    ops_env(first, setup=setup, bucket="b", streams=ms, write_back=LATER)
    ops_env(still_full, bucket="b", streams=ms, write_back=0.0)
    frees[0]()
    ops_env(second, bucket="b", streams=ms, write_back=0.0)


@pytest.mark.expect_log(r"b/(small|other)\.txt: closed in write-back mode by an earlier run, but its bytes cannot be "
                        r"restored for lost\+found \(No space left on device\); the write-back journal keeps them")
def test_a_mount_without_write_back_on_a_full_disk_keeps_the_journal_of_what_it_cannot_restore(
        ops_env, tmp_path, monkeypatch):
    ms = MemoryStreams()
    root = spool_root(tmp_path / "cache", Path("/nonexistent"))

    async def crashed(env: Env):
        await write_file(env, ROOT, "small.txt", b"closed, never uploaded")
        await write_file(env, ROOT, "other.txt", b"also pending")
        # The daemon dies here: both closes are in the journal, their records hold the bytes.

    async def no_op(env: Env):
        pass

    ops_env(crashed, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    free = full_local_disk(monkeypatch)
    ops_env(no_op, bucket="b", streams=ms)  # starts; the record it could not restore stays
    assert (root / "writeback.journal").exists()
    free()
    ops_env(no_op, bucket="b", streams=ms)
    assert sorted(p.read_bytes() for p in kept_files(tmp_path)) == [b"also pending", b"closed, never uploaded"]
    assert not (root / "writeback.journal").exists()
