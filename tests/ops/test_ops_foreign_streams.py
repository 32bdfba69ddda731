"""Streams named `OBJ_<name>` that another client (or an operator) made, which are not the object store
nats.go's CreateObjectStore makes.

A stream whose subjects do not take `$O.<name>.C.>` and `$O.<name>.M.>` and that is neither a mirror nor
sourced is no object store at all: not shown, not found by name, never deleted by the mount, one INFO
line. A valid object store that takes no writes (a stream with sources and no subjects of its own, one
without `allow_rollup_hdrs`) shows its objects without write bits and refuses every change with `EROFS`
at once, as a sealed bucket does, rather than failing each close with the bytes in lost+found."""

from __future__ import annotations

import errno
import logging
import os
import stat

import pyfuse3
import pytest
from gowriters import put_object
from opskit import CTX, ROOT, Env, errno_of

from natsfs.adr20 import ObjectStore
from natsfs.memstreams import MemoryStreams


async def foreign_streams(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "f", b"in b")
    # Another tool's stream that happens to be called OBJ_foo.
    await ms.create_stream({"name": "OBJ_foo", "subjects": ["foo.>"]})
    await ms.publish("foo.x", b"not an object")
    # A stream sourced from OBJ_b: its own subjects take no publishes.
    await ms.create_stream({"name": "OBJ_src", "sources": [{"name": "OBJ_b"}], "allow_rollup_hdrs": True})
    # An object store whose stream no longer allows rollup headers (every meta carries one).
    await store.create_bucket("norollup")
    await put_object(ms, "norollup", "kept", b"readable")
    st = await ms.stream_info("OBJ_norollup")
    await ms.update_stream(dict(st.config, allow_rollup_hdrs=False))


def writable(attrs: pyfuse3.EntryAttributes) -> bool:
    return bool(stat.S_IMODE(attrs.st_mode) & 0o222)


def test_a_stream_that_is_no_object_store_is_not_shown_nor_found_and_logged_once(ops_env, caplog):
    async def body(env: Env) -> None:
        for _ in range(3):
            await env.ns.refresh_buckets()
            assert (await env.listdir(ROOT)).names == ["b", "norollup", "src"]
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.lookup("foo")
        assert errno_of(e.value) == errno.ENOENT
        # `mkdir foo` at the root cannot make it a bucket, and the mount never deletes it.
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.mkdir(ROOT, b"foo", 0o755, CTX)
        assert errno_of(e.value) == errno.EEXIST
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.rmdir(ROOT, b"foo", CTX)
        assert errno_of(e.value) == errno.ENOENT
        assert [m.data for m in env.streams.messages("OBJ_foo")] == [b"not an object"]

    caplog.set_level(logging.INFO, logger="natsfs")
    ops_env(body, setup=foreign_streams)
    lines = [r for r in caplog.records if "OBJ_foo is not an object store" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


@pytest.mark.parametrize("bucket", ["src", "norollup"])
def test_an_object_store_that_takes_no_writes_shows_read_only_and_refuses_changes_at_once(ops_env, bucket):
    async def body(env: Env) -> None:
        top = await env.lookup(bucket)
        assert not writable(top)
        if bucket == "norollup":
            kept = await env.lookup("norollup/kept")
            assert not writable(kept)
            assert await env.cat("norollup/kept") == b"readable"
            for flags in (os.O_WRONLY, os.O_RDWR | os.O_TRUNC):
                with pytest.raises(pyfuse3.FUSEError) as e:
                    await env.ops.open(kept.st_ino, flags, CTX)
                assert errno_of(e.value) == errno.EROFS
            with pytest.raises(pyfuse3.FUSEError) as e:
                await env.ops.unlink(top.st_ino, b"kept", CTX)
            assert errno_of(e.value) == errno.EROFS
            with pytest.raises(pyfuse3.FUSEError) as e:
                await env.ops.rename(top.st_ino, b"kept", top.st_ino, b"moved", 0, CTX)
            assert errno_of(e.value) == errno.EROFS
        before = len(env.streams.messages(f"OBJ_{bucket}"))
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.create(top.st_ino, b"new", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        assert errno_of(e.value) == errno.EROFS
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.mkdir(top.st_ino, b"d", 0o755, CTX)
        assert errno_of(e.value) == errno.EROFS
        await env.settle()
        assert len(env.streams.messages(f"OBJ_{bucket}")) == before
        assert await env.store.get_info("b", "f") is not None  # (the bucket it is sourced from is untouched)

    ops_env(body, setup=foreign_streams)


def test_a_stream_fixed_by_its_owner_shows_as_a_bucket_at_the_next_listing(ops_env):
    """The server announces the config update: the stream is looked at again at the next listing."""
    async def body(env: Env) -> None:
        await env.ns.refresh_buckets()
        assert "foo" not in (await env.listdir(ROOT)).names
        st = await env.streams.stream_info("OBJ_foo")
        await env.streams.update_stream(dict(st.config, subjects=["$O.foo.C.>", "$O.foo.M.>"],
                                             allow_rollup_hdrs=True))
        await env.settle()
        await env.ns.refresh_buckets()
        assert "foo" in (await env.listdir(ROOT)).names
        assert writable(await env.lookup("foo"))

    ops_env(body, setup=foreign_streams)
