"""Writes through natsfs.fs.Operations over MemoryStreams (no kernel): staging, uploads, conflicts,
renames and their crash order, attributes, links and xattrs."""

from __future__ import annotations

import errno
import os
from typing import Any

import pyfuse3
import pytest
import trio
from opskit import ROOT, Env, errno_of

from natsfs.adr20 import ObjectStore, chunk_subject, digest_of, stream_name
from natsfs.errors import NoSpace, Unavailable
from natsfs.memstreams import MemoryStreams, put_object
from natsfs.mutations import STREAM_BATCH


async def one_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=4 << 20)
    await put_object(ms, "b", "old.txt", b"old content")


def chunk_count(env: Env) -> int:
    return sum(n for s, n in env.streams.subjects(stream_name("b")).items() if ".C." in s)


async def err(coro: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


class Ctx:
    uid = 1000
    gid = 1000
    pid = 1
    umask = 0o022


class Fields:
    """Stands in for pyfuse3.SetattrFields, whose attributes only the kernel side can set."""

    def __init__(self, **set_: bool):
        for name in ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
                     "update_size"):
            setattr(self, name, set_.get(name, False))


async def write_file(env: Env, parent: int, name: str, data: bytes) -> int:
    fi, attr = await env.ops.create(parent, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    if data:
        assert await env.ops.write(fi.fh, 0, data) == len(data)
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)
    return attr.st_ino


async def stored(env: Env, name: str) -> bytes:
    info = await env.store.get_info("b", name)
    assert info is not None and not info.deleted
    data = b"".join(m.data for m in await env.store.fetch_chunks("b", info.nuid, 1, 10_000, 1 << 30))
    assert digest_of(data) == info.digest
    return data


async def chunks_left(env: Env, nuid: str) -> int:
    return len(await env.store.chunk_index("b", nuid))


def test_create_write_close_stores_an_object(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        await write_file(env, b, "new.bin", b"x" * 300_000)
        assert await stored(env, "new.bin") == b"x" * 300_000
        assert (await env.lookup("b/new.bin")).st_size == 300_000
        assert env.fs.staging.spool.used == 0 and len(env.fs.staging) == 0

    ops_env(body, setup=one_bucket)


def test_read_only_handles_never_upload(ops_env):
    async def body(env: Env):
        before = await env.store.get_info("b", "old.txt")
        f = await env.lookup("b/old.txt")
        writer = await env.ops.open(f.st_ino, os.O_WRONLY, Ctx())
        reader = await env.ops.open(f.st_ino, os.O_RDONLY, Ctx())
        await env.ops.write(writer.fh, 0, b"NEW")
        await env.ops.flush(reader.fh)  # a reader closing first stores nothing
        assert (await env.store.get_info("b", "old.txt")).revision == before.revision
        assert await env.ops.read(reader.fh, 0, 100) == b"NEW content"  # shared staged state
        await env.ops.flush(writer.fh)
        assert await stored(env, "old.txt") == b"NEW content"
        for fi in (reader, writer):
            await env.ops.release(fi.fh)

    ops_env(body, setup=one_bucket)


def test_conflict_keeps_both_versions(ops_env, tmp_path):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"mine")
        await put_object(env.streams, "b", "old.txt", b"theirs")
        assert await err(env.ops.flush(fi.fh)) == errno.ESTALE
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == b"theirs"
        kept = list((env.fs.staging.spool.lost_found / "b").iterdir())
        assert len(kept) == 1 and kept[0].read_bytes() == b"mine"
        assert env.fs.counters["conflicts"] == 1

    ops_env(body, setup=one_bucket)


def test_bucket_limit_is_enospc_and_no_chunks_remain(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        fi, _ = await env.ops.create(b, b"huge", 0o644, os.O_WRONLY, Ctx())
        await env.ops.write(fi.fh, 0, os.urandom(6 << 20))
        assert await err(env.ops.flush(fi.fh)) == errno.ENOSPC
        await env.ops.release(fi.fh)
        assert await env.store.get_info("b", "huge") is None
        subjects = [s for s in env.streams.subjects(stream_name("b")) if ".C." in s]
        info = await env.store.get_info("b", "old.txt")
        assert subjects == [chunk_subject("b", info.nuid)]  # only the old object's chunks

    ops_env(body, setup=one_bucket)


def test_failed_meta_publish_purges_the_new_chunks_and_keeps_the_old_version(ops_env):
    async def body(env: Env):
        old = await env.store.get_info("b", "old.txt")
        f = await env.lookup("b/old.txt")
        fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"new bytes")
        env.streams.fail_next("publish", NoSpace("injected"), subject="$O.b.M.>")
        assert await err(env.ops.flush(fi.fh)) == errno.ENOSPC
        assert await stored(env, "old.txt") == b"old content"
        assert await chunks_left(env, old.nuid) == old.chunks
        # The staged bytes are still there: a retry (fsync) stores them.
        await env.ops.fsync(fi.fh, False)
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == b"new bytes"
        assert await chunks_left(env, old.nuid) == 0

    ops_env(body, setup=one_bucket)


def test_rename_crash_between_steps_never_loses_the_object(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        await write_file(env, b, "a", b"precious" * 1000)
        a = await env.store.get_info("b", "a")
        # The purge of the old name's meta keeps failing (it is retried for a while): the object is
        # reachable under both names (same nuid).
        env.store.settle_timeout = 0.3
        env.streams.fail_next("purge_subject", Unavailable("crash"), times=1000)
        assert await err(env.ops.rename(b, b"a", b, b"c", 0, Ctx())) == errno.EIO
        env.streams._faults.clear()
        c = await env.store.get_info("b", "c")
        assert c.nuid == a.nuid
        await env.settle()
        # Deleting one of the two names must not purge the chunks the other still uses, nor leave a
        # tombstone carrying that nuid (another client's delete of `a` would purge it).
        await env.ops.unlink(b, b"a", Ctx())
        assert await env.store.get_info("b", "a") is None
        assert await stored(env, "c") == b"precious" * 1000

    ops_env(body, setup=one_bucket)


def test_unlink_of_a_file_still_being_written_drops_it(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        fi, _ = await env.ops.create(b, b"tmp", 0o644, os.O_WRONLY, Ctx())
        await env.ops.write(fi.fh, 0, b"scratch")
        await env.ops.unlink(b, b"tmp", Ctx())
        await env.ops.write(fi.fh, 7, b" more")  # goes nowhere, as on a local disk
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await env.store.get_info("b", "tmp") is None
        assert "tmp" not in (await env.listdir(b)).names

    ops_env(body, setup=one_bucket)


def test_posix_attributes_are_metadata(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = 0o100600
        got = await env.ops.setattr(f.st_ino, attr, Fields(update_mode=True), None, Ctx())
        assert got.st_mode & 0o777 == 0o600
        doc, _ = await env.store.get_meta_doc("b", "old.txt")
        assert doc["metadata"] == {"natsfs.mode": "600"}
        assert await stored(env, "old.txt") == b"old content"

    ops_env(body, setup=one_bucket)


def test_xattrs_and_the_meta_size_limit(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        await env.ops.setxattr(f.st_ino, b"user.k", b"v", Ctx())
        assert await env.ops.getxattr(f.st_ino, b"user.k", Ctx()) == b"v"
        before = (await env.store.get_info("b", "old.txt")).revision
        assert await err(env.ops.setxattr(f.st_ino, b"user.big", b"z" * 5000, Ctx())) == errno.E2BIG
        assert (await env.store.get_info("b", "old.txt")).revision == before
        assert await err(env.ops.setxattr(f.st_ino, b"user.nats.nuid", b"x", Ctx())) == errno.EPERM
        assert await err(env.ops.setxattr(f.st_ino, b"trusted.x", b"x", Ctx())) == errno.EOPNOTSUPP
        assert await err(env.ops.getxattr(f.st_ino, b"user.none", Ctx())) == pyfuse3.ENOATTR

    ops_env(body, setup=one_bucket, max_meta_bytes=4096)


def test_symlink_rules(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        link = await env.ops.symlink(b, b"l", b"old.txt", Ctx())
        assert await env.ops.readlink(link.st_ino, Ctx()) == b"../b/old.txt"
        doc, _ = await env.store.get_meta_doc("b", "l")
        assert doc["options"] == {"link": {"bucket": "b", "name": "old.txt"}}
        assert await err(env.ops.symlink(b, b"l2", b"l", Ctx())) == errno.EINVAL
        assert await err(env.ops.symlink(b, b"l3", b"missing", Ctx())) == errno.ENOENT
        assert await err(env.ops.symlink(b, b"l4", b"../../etc", Ctx())) == errno.EXDEV
        assert await err(env.ops.symlink(b, b"l5", b"/etc/passwd", Ctx())) == errno.EXDEV
        await env.ops.unlink(b, b"l", Ctx())
        assert await stored(env, "old.txt") == b"old content"

    ops_env(body, setup=one_bucket)


def test_buckets_by_mkdir_and_rmdir(ops_env):
    async def body(env: Env):
        attr = await env.ops.mkdir(ROOT, b"fresh", 0o755, Ctx())
        assert attr.st_mode & 0o040000
        assert "fresh" in await env.store.list_buckets()
        assert await err(env.ops.mkdir(ROOT, b"bad.name", 0o755, Ctx())) == errno.EINVAL
        assert await err(env.ops.mkdir(ROOT, b"fresh", 0o755, Ctx())) == errno.EEXIST
        assert await err(env.ops.rmdir(ROOT, b"b", Ctx())) == errno.ENOTEMPTY
        await env.ops.rmdir(ROOT, b"fresh", Ctx())
        assert "fresh" not in await env.store.list_buckets()

    ops_env(body, setup=one_bucket)


def test_the_fast_tier_streams_a_growing_file_before_it_is_closed(ops_env):
    """Streaming uploads run in the ops tier: the full chunks of a file written from the front are on
    the server before close, and close adds only the rest and the meta."""

    async def body(env: Env):
        chunk = env.config.chunk_size
        data = os.urandom(6 * 1024 * 1024)
        fi, _ = await env.ops.create(ROOT, b"growing.bin", 0o644, os.O_WRONLY, Ctx())
        for off in range(0, len(data), 1 << 20):
            await env.ops.write(fi.fh, off, data[off : off + (1 << 20)])
        streamed = 0
        with trio.move_on_after(10):
            while streamed < STREAM_BATCH // chunk:
                await trio.sleep(0.01)
                streamed = chunk_count(env)
        assert streamed >= STREAM_BATCH // chunk  # sent while still open
        assert await env.store.get_info("b", "growing.bin") is None  # no meta before close
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        info = await env.store.get_info("b", "growing.bin")
        assert info is not None and info.size == len(data) and chunk_count(env) == -(-len(data) // chunk)
        assert await env.cat("growing.bin") == data

    async def big_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b", atomic=False)  # (an atomic bucket puts a file this size whole at close)

    ops_env(body, setup=big_bucket, bucket="b")
