"""Reads while the server does not answer for a moment (a cluster node lost, a leader being elected):
fetches are asked again, so the read returns the bytes instead of EIO; a server answering wrongly still
fails at once."""

from __future__ import annotations

import errno
import os

import pytest
import trio
import trio.testing
from test_ops import DATA, fuse_error, two_buckets

from natsfs import chunk_cache
from natsfs.errors import Unavailable


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(chunk_cache, "_FETCH_PAUSE_S", 0.001)


@pytest.mark.parametrize("op", ["stream_batch", "get_batch"])
def test_a_fetch_without_an_answer_is_asked_again(ops_env, op):
    async def body(env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        if op == "get_batch":  # the layout must be known for a chunk fetch by sequence
            assert await env.ops.read(fi.fh, 300_000, 10) == DATA[300_000:300_010]
        env.streams.fail_next(op, Unavailable("request timed out"), times=3)
        off = 0 if op == "stream_batch" else 150_000
        assert await env.ops.read(fi.fh, off, 4096) == DATA[off: off + 4096]
        await env.ops.release(fi.fh)

    ops_env(body, setup=two_buckets, fetch_batch_bytes=128 * 1024, readahead_min=0, readahead_max=0)


@pytest.mark.expect_log("read: (request timed out|.*no answer from the server within 15s)")
def test_a_server_that_never_answers_fails_the_read_after_the_retry_window(ops_env, monkeypatch):
    monkeypatch.setattr(chunk_cache, "_FETCH_PAUSE_S", 0.25)

    async def body(env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        env.streams.fail_next("stream_batch", Unavailable("request timed out"), times=10_000)
        start = trio.current_time()
        assert await fuse_error(env.ops.read(fi.fh, 0, 4096)) == errno.EIO
        assert trio.current_time() - start == pytest.approx(chunk_cache.FETCH_RETRY_S, abs=0.3)
        env.streams._faults.clear()
        assert await env.ops.read(fi.fh, 0, 4096) == DATA[:4096]
        await env.ops.release(fi.fh)

    ops_env(body, setup=two_buckets, clock=trio.testing.MockClock(autojump_threshold=0),
            fetch_batch_bytes=128 * 1024, readahead_min=0, readahead_max=0)
