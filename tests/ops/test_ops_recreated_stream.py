"""A bucket's stream deleted and created again by another client while this mount holds revisions of it.

The new stream numbers its messages from 1 again, so another client's object can land at the very
revision this mount read from the old stream, and `Nats-Expected-Last-Subject-Sequence` alone would let a
change made to the old object replace it. Such a change must be a conflict (the bytes kept in
lost+found), or apply to what the name holds now, never put the old object's meta over the new one."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import trio
from gowriters import put_object
from opskit import CTX, ROOT, Ctx, Env, Fields
from test_ops_write import err, stored, write_file

from natsfs.adr20 import ObjectStore, stream_name
from natsfs.errors import Conflict
from natsfs.memstreams import MemoryStreams

A, B, W = b"A" * 1000, b"B" * 1000, b"W" * 10
LATER = 3600.0  # write-back uploads happen only when the test asks (shutdown)


async def bucket_with_f(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=4 << 20)
    await put_object(ms, "b", "f", A)  # chunk at sequence 1, meta at 2


async def empty_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=4 << 20)


async def recreate_with(env: Env, name: str, data: bytes) -> int:
    """Another client deletes the stream, creates the bucket again and puts `name`: the revision it got."""
    env.streams.recreate_stream(stream_name("b"))
    info = await put_object(env.streams, "b", name, data)
    return info.revision


def kept(env: Env) -> list[bytes]:
    lost_found = env.fs.staging.spool.lost_found / "b"
    return [p.read_bytes() for p in sorted(lost_found.iterdir())] if lost_found.exists() else []


def test_the_stream_keeps_sequences_as_nats_server_does_when_created_again(ops_env):
    async def body(env: Env):
        before = await env.store.get_info("b", "f")
        assert await recreate_with(env, "f", B) == before.revision == 2
        assert (await env.streams.stream_info(stream_name("b"))).last_seq == 2

    ops_env(body, setup=bucket_with_f)


def test_a_close_after_the_stream_was_created_again_is_a_conflict_not_a_put_over_the_new_object(ops_env, caplog):
    """The tester's case: opened `r+`, 10 bytes written, the stream deleted and created again with
    another `f` at the same revision, then the close: `ESTALE`, the other client's `f` intact, this
    writer's bytes in lost+found (before: close 0 and `f` = W + the old A's)."""
    async def body(env: Env):
        f = await env.lookup("b/f")
        fi = await env.ops.open(f.st_ino, os.O_RDWR, Ctx())
        assert await env.ops.write(fi.fh, 0, W) == len(W)
        assert await recreate_with(env, "f", B) == 2
        await env.settle()  # the watch notices and rebuilds the index: the revision alone says nothing
        caplog.clear()
        assert await err(env.ops.flush(fi.fh)) == errno.ESTALE
        await env.ops.release(fi.fh)
        assert await stored(env, "f") == B
        assert kept(env) == [W + A[len(W):]]
        assert env.fs.counters["conflicts"] == 1
        assert len([r for r in caplog.records if "lost+found" in r.getMessage()]) == 1
        assert await env.cat("b/f") == B

    ops_env(body, setup=bucket_with_f)


def test_a_write_back_upload_based_on_the_old_stream_goes_to_lost_found(ops_env):
    async def body(env: Env):
        f = await env.lookup("f")
        fi = await env.ops.open(f.st_ino, os.O_RDWR, Ctx())
        await env.ops.write(fi.fh, 0, W)
        await env.ops.flush(fi.fh)  # journaled, not uploaded yet
        await env.ops.release(fi.fh)
        await recreate_with(env, "f", B)
        await env.settle()
        await env.fs.shutdown(10)
        assert await stored(env, "f") == B
        assert kept(env) == [W + A[len(W):]]

    ops_env(body, setup=bucket_with_f, bucket="b", write_back=LATER)


def test_an_atomic_save_over_a_file_of_the_old_stream_goes_to_lost_found(ops_env):
    """Write-back: a temporary file renamed over `f` before its first upload expects `f`'s revision;
    another object there at that revision of the new stream is a conflict."""
    async def body(env: Env):
        fi, _ = await env.ops.create(ROOT, b"f.tmp", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, W)
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.ops.rename(ROOT, b"f.tmp", ROOT, b"f", 0, Ctx())
        await recreate_with(env, "f", B)
        await env.settle()
        await env.fs.shutdown(10)
        assert await stored(env, "f") == B
        assert kept(env) == [W]

    ops_env(body, setup=bucket_with_f, bucket="b", write_back=LATER)


@pytest.mark.parametrize("change", ["chmod", "rename", "unlink"])
def test_changes_after_the_stream_was_created_again_never_put_the_old_meta_over_the_new_object(ops_env, change):
    """This mount wrote `f` to the old stream (so it remembers that meta and would rewrite it without
    reading it back); another client's `f` now sits at the same revision of the new stream. A chmod
    or rename applies to that object, an unlink deletes it with its chunks; none publishes the old meta
    (whose chunks are gone with the old stream) over it."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        await write_file(env, b, "f", W)
        mine = await env.store.get_info("b", "f")
        assert await recreate_with(env, "f", B) == mine.revision
        theirs = await env.store.get_info("b", "f")
        await env.settle()
        if change == "chmod":
            f = await env.lookup("b/f")
            f.st_mode = stat.S_IFREG | 0o600
            await env.ops.setattr(f.st_ino, f, Fields(update_mode=True), None, CTX)
            now = await env.store.get_info("b", "f")
            assert now.nuid == theirs.nuid and now.attrs.mode & 0o777 == 0o600
            assert await stored(env, "f") == B
        elif change == "rename":
            await env.ops.rename(b, b"f", b, b"g", 0, Ctx())
            assert (await env.store.get_info("b", "g")).nuid == theirs.nuid
            assert await stored(env, "g") == B
        else:
            await env.ops.unlink(b, b"f", Ctx())
            assert (await env.store.get_info("b", "f")).deleted
            assert await env.store.chunk_index("b", theirs.nuid) == []  # its chunks purged, none orphaned

    ops_env(body, setup=empty_bucket)


def test_a_change_whose_revision_now_holds_another_object_is_a_conflict(ops_env):
    """Before the mount has noticed the new stream (its index and caches still of the old one), the
    meta read at the expected revision shows another nuid: `Conflict`, nothing published."""
    async def body(env: Env):
        old = await env.store.get_info("b", "f")
        env.streams.recreate_stream(stream_name("b"))
        await put_object(env.streams, "b", "f", B)
        last = (await env.streams.stream_info(stream_name("b"))).last_seq
        for attempt in (
                env.store.update_meta("b", "f", lambda doc: None, expected_revision=old.revision,
                                      expected_nuid=old.nuid),
                env.store.rename("b", "f", "g", expected_revision=old.revision, expected_nuid=old.nuid),
                env.store.delete("b", "f", expected_revision=old.revision, expected_nuid=old.nuid)):
            with pytest.raises(Conflict):
                await attempt
        assert (await env.streams.stream_info(stream_name("b"))).last_seq == last
        assert await stored(env, "f") == B

    ops_env(body, setup=bucket_with_f)


def test_a_pending_upload_replayed_by_the_next_mount_after_a_re_creation_goes_to_lost_found(ops_env):
    """The daemon died with a write-back upload pending; meanwhile the stream was created again with
    another `f` at the revision the record's base has. The next mount's replay is a conflict: the record
    keeps its base's nuid, and the meta at that revision holds another."""
    ms = MemoryStreams()

    async def first(env: Env):
        f = await env.lookup("f")
        fi = await env.ops.open(f.st_ino, os.O_RDWR, Ctx())
        await env.ops.write(fi.fh, 0, W)
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        # The daemon dies here: no shutdown, nothing uploaded.

    async def second(env: Env):
        await env.fs.shutdown(10)  # waits for the replayed upload
        assert await stored(env, "f") == B
        assert kept(env) == [W + A[len(W):]]

    ops_env(first, setup=bucket_with_f, bucket="b", streams=ms, write_back=LATER)
    ms.recreate_stream(stream_name("b"))
    trio.run(put_object, ms, "b", "f", B)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
