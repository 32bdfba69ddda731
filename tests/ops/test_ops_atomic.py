"""Atomic puts through natsfs.fs.Operations over MemoryStreams: in a bucket that allows atomic batches a
file closed before the streaming threshold is one batch, a batch cut off stores nothing and leaves no
journal record, a lost commit ack is read back, and a bigger file is streamed while it is written (no
meta before its close) and committed in the nats.go order."""

from __future__ import annotations

import errno
import os

import pytest
import trio
from gowriters import put_object
from opskit import Env
from test_ops_puts import Ctx, all_chunk_msgs, err, stored

from natsfs.adr20 import ObjectStore
from natsfs.errors import OutcomeUnknown, Unavailable
from natsfs.memstreams import MemoryStreams
from natsfs.mutations import STREAM_BATCH

CHUNK = 8192


async def atomic_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "old.txt", b"old content")


async def write(env: Env, name: str, data: bytes, *, existing: bool = False) -> int:
    b = (await env.lookup("b")).st_ino
    if existing:
        ino = (await env.lookup(f"b/{name}")).st_ino
        fi = await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())
    else:
        fi, _ = await env.ops.create(b, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    for off in range(0, len(data), 64 * 1024):
        await env.ops.write(fi.fh, off, data[off:off + 64 * 1024])
    return fi.fh


def test_a_file_closed_before_the_streaming_threshold_is_one_batch(ops_env):
    async def body(env: Env):
        data = os.urandom(STREAM_BATCH - CHUNK)  # 511 chunks of 8 KiB: just under the streaming threshold
        fh = await write(env, "f", data)
        await env.settle()
        assert all_chunk_msgs(env) == 1  # only old.txt's: nothing streamed
        await env.ops.flush(fh)
        await env.ops.release(fh)
        assert env.streams.calls["publish_batch"] == 1 and env.streams.calls["publish_many"] == 0
        assert await stored(env, "f") == data
        assert not env.fs.mut.journal.pending and not env.fs.mut.journal.active

    ops_env(body, setup=atomic_bucket, chunk_size=CHUNK)


@pytest.mark.expect_log("flush: connection lost", "b/old.txt: closed without a successful upload")
def test_a_batch_cut_off_stores_nothing_and_the_old_version_stays(ops_env):
    async def body(env: Env):
        fh = await write(env, "old.txt", os.urandom(50 * CHUNK), existing=True)
        env.streams.fail_next_publish(Unavailable("connection lost"), subject="$O.b.C.>")
        assert await err(env.ops.flush(fh)) == errno.EIO
        await env.ops.release(fh)
        assert await stored(env, "old.txt") == b"old content"
        assert all_chunk_msgs(env) == 1
        assert not env.fs.mut.journal.pending and not env.fs.mut.journal.active

    ops_env(body, setup=atomic_bucket, chunk_size=CHUNK)


def test_a_lost_commit_ack_is_success_and_the_old_chunks_are_purged(ops_env):
    async def body(env: Env):
        data = os.urandom(20 * CHUNK)
        fh = await write(env, "old.txt", data, existing=True)
        env.streams.lose_next_ack(subject="$O.b.M.>")
        await env.ops.flush(fh)
        await env.ops.release(fh)
        assert await stored(env, "old.txt") == data
        assert all_chunk_msgs(env) == 20
        assert not env.fs.mut.journal.pending and not env.fs.mut.journal.active

    ops_env(body, setup=atomic_bucket, chunk_size=CHUNK)


@pytest.mark.expect_log(
    "the meta publish got no answer .* it may or may not be stored",
    "b/f: closed without a successful upload",
)
def test_a_commit_that_never_answers_leaves_the_put_to_the_journal(ops_env):
    async def body(env: Env):
        env.store.settle_timeout = 0.3
        fh = await write(env, "f", os.urandom(5 * CHUNK))
        for _ in range(50):
            env.streams.fail_next_publish(OutcomeUnknown("no answer"), subject="$O.b.M.>")
        env.streams.fail_next("last_msg", Unavailable("away"), times=50)
        assert await err(env.ops.flush(fh)) == errno.EIO
        await env.ops.release(fh)
        assert len(env.fs.mut.journal.pending) == 1  # settled once the server answers again
        assert all_chunk_msgs(env) == 1

    ops_env(body, setup=atomic_bucket, chunk_size=CHUNK)


def test_a_file_past_the_streaming_threshold_is_streamed_while_open_and_committed_at_close(ops_env):
    async def body(env: Env):
        data = os.urandom(990 * CHUNK)  # 7.7 MiB at 8 KiB chunks: would fit one batch
        fh = await write(env, "f", data)
        # The streamer reads the spool file on a worker thread, which `settle` does not wait for.
        with trio.fail_after(30):
            while all_chunk_msgs(env) <= 1:
                await trio.sleep(0.01)
        await env.settle()  # chunks sent while the file is open
        assert env.fs.mut.journal.active  # journalled until its meta is stored
        assert await env.store.get_info("b", "f") is None  # no meta before the close
        await env.ops.flush(fh)
        await env.ops.release(fh)
        assert env.streams.calls["publish_batch"] == 0
        assert await stored(env, "f") == data
        assert all_chunk_msgs(env) == 1 + 990
        assert not env.fs.mut.journal.pending and not env.fs.mut.journal.active

    ops_env(body, setup=atomic_bucket, chunk_size=CHUNK)


def test_a_file_too_big_for_one_batch_is_streamed_in_order(ops_env):
    async def body(env: Env):
        data = os.urandom(1200 * CHUNK)
        fh = await write(env, "big", data)
        await env.ops.flush(fh)
        await env.ops.release(fh)
        assert env.streams.calls["publish_batch"] == 0
        assert await stored(env, "big") == data

    ops_env(body, setup=atomic_bucket, chunk_size=CHUNK)
