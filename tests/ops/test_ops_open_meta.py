"""Opens that truncate without write access (`O_RDONLY|O_TRUNC`), and metadata calls through a descriptor
whose file was unlinked or replaced while open: driven through natsfs.fs.Operations over MemoryStreams."""

from __future__ import annotations

import errno
import os
from typing import Any

import pyfuse3
import pytest
from gowriters import put_object
from opskit import Ctx, Env, errno_of

from natsfs.adr20 import ObjectStore, digest_of
from natsfs.memstreams import MemoryStreams


async def one_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=4 << 20)
    await put_object(ms, "b", "old.txt", b"old content")


async def err(coro: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


async def stored(env: Env, name: str) -> bytes:
    info = await env.store.get_info("b", name)
    assert info is not None and not info.deleted
    data = b"".join(m.data for m in await env.store.fetch_chunks("b", info.nuid, 1, 10_000, 1 << 30))
    assert digest_of(data) == info.digest
    return data


def lost_found(env: Env) -> list[str]:
    root = env.fs.staging.spool.lost_found
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()] if root.exists() else []


# ------------------------------------------------------------------ open(O_RDONLY|O_TRUNC)
def test_read_only_open_with_o_trunc_stores_the_empty_file(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        fi = await env.ops.open(f.st_ino, os.O_RDONLY | os.O_TRUNC, Ctx())
        # Stored at the open, as truncate(2) on a path no writer holds: no close of this handle stores.
        assert await stored(env, "old.txt") == b""
        assert (await env.ops.getattr(f.st_ino, None)).st_size == 0
        assert await env.ops.read(fi.fh, 0, 100) == b""
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == b""
        assert (await env.lookup("b/old.txt")).st_size == 0
        assert lost_found(env) == [] and len(env.fs.staging) == 0

    ops_env(body, setup=one_bucket)


def test_read_only_o_trunc_open_beside_a_writer_is_stored_at_the_writers_close(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        writer = await env.ops.open(f.st_ino, os.O_WRONLY, Ctx())
        reader = await env.ops.open(f.st_ino, os.O_RDONLY | os.O_TRUNC, Ctx())
        assert (await env.ops.getattr(f.st_ino, None)).st_size == 0
        await env.ops.flush(reader.fh)
        await env.ops.release(reader.fh)  # the truncate is not given up at the reader's close
        await env.ops.write(writer.fh, 0, b"new")
        await env.ops.flush(writer.fh)
        await env.ops.release(writer.fh)
        assert await stored(env, "old.txt") == b"new"
        assert lost_found(env) == []

    ops_env(body, setup=one_bucket)


def test_read_only_o_trunc_open_refused_store_fails_the_open(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        fi = await env.ops.open(f.st_ino, os.O_RDONLY, Ctx())  # pins the version another client replaces
        await put_object(env.streams, "b", "old.txt", b"theirs")
        # The truncate starts from the version this mount shows: stored over theirs it is a conflict,
        # reported as truncate(2) reports it (ESTALE), its bytes in lost+found.
        assert await err(env.ops.open(f.st_ino, os.O_RDONLY | os.O_TRUNC, Ctx())) == errno.ESTALE
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == b"theirs"
        [kept] = lost_found(env)
        assert kept.startswith("b/old.txt.") and (env.fs.staging.spool.lost_found / kept).read_bytes() == b""
        assert len(env.fs.staging) == 0

    ops_env(body, setup=one_bucket)


def test_read_only_o_trunc_open_in_write_back_mode_is_journaled_and_uploaded(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        fi = await env.ops.open(f.st_ino, os.O_RDONLY | os.O_TRUNC, Ctx())
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert env.fs.writeback is not None
        assert [r["name"] for r in env.fs.writeback.journal.pending.values()] == ["old.txt"]
        assert (await env.lookup("b/old.txt")).st_size == 0
        await env.fs.shutdown(10)
        assert await stored(env, "old.txt") == b""
        assert lost_found(env) == []

    ops_env(body, setup=one_bucket, write_back=3600.0)


def test_read_only_o_trunc_open_on_a_read_only_mount_is_erofs(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        assert await err(env.ops.open(f.st_ino, os.O_RDONLY | os.O_TRUNC, Ctx())) == errno.EROFS
        assert await stored(env, "old.txt") == b"old content"

    ops_env(body, setup=one_bucket, read_only=True)

