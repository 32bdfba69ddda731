"""--max-meta-bytes applies to every meta the mount writes (ObjectStore.check_meta_size): a change that
would make a meta larger than the limit and larger than the meta it replaces is refused with E2BIG and
nothing is stored; a change that does not grow it is allowed, so an oversized object can always be
shrunk or fixed. A directory rename that would grow a moved meta over the limit moves nothing."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import pyfuse3
import pytest
from gowriters import put_object
from opskit import CTX, Env, Fields, errno_of

from natsfs.adr20 import ObjectStore, meta_json, meta_subject, stream_name
from natsfs.memstreams import MemoryStreams

LIMIT = 2048


async def err(coro: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


async def meta_of_size(ms: MemoryStreams, name: str, size: int, data: bytes = b"some bytes\n",
                       metadata: dict[str, str] | None = None) -> None:
    """Another client's object whose meta is exactly `size` bytes (padded by a metadata value), by
    default with a mode and an mtime of its own, so a chmod or utime replaces them without growing the
    meta (a write drops both: the mode is the default, the time the write's)."""
    if metadata is None:
        metadata = {"natsfs.mode": "644", "natsfs.mtime_ns": "1700000000000000000"}
    metadata = dict(metadata, pad="")
    info = await put_object(ms, "b", name, data, metadata=metadata)
    metadata["pad"] = "p" * (size - info.meta_bytes)
    info = await put_object(ms, "b", name, data, metadata=metadata)
    assert info.meta_bytes == size


async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await meta_of_size(ms, "over.txt", LIMIT + 500)  # oversized: written by another client
    await meta_of_size(ms, "edge.txt", LIMIT)  # at the limit
    await meta_of_size(ms, "plain.txt", LIMIT, metadata={})  # at the limit, no POSIX attributes


async def meta_bytes(env: Env, name: str) -> int:
    msg = await env.streams.last_msg(stream_name("b"), meta_subject("b", name))
    assert msg is not None
    return len(msg.data)


async def revision(env: Env, name: str) -> int:
    info = await env.store.get_info("b", name)
    assert info is not None and not info.deleted
    return info.revision


async def chmod(env: Env, ino: int, mode: int) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_mode = 0o100000 | mode
    await env.ops.setattr(ino, attr, Fields(update_mode=True), None, CTX)


async def utime(env: Env, ino: int, mtime_ns: int) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_mtime_ns = mtime_ns
    await env.ops.setattr(ino, attr, Fields(update_mtime=True), None, CTX)


async def truncate(env: Env, ino: int, size: int) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_size = size
    await env.ops.setattr(ino, attr, Fields(update_size=True), None, CTX)


async def rename(env: Env, old: str, new: str) -> None:
    old_dir, _, old_name = old.rpartition("/")
    new_dir, _, new_name = new.rpartition("/")
    await env.ops.rename((await env.lookup(old_dir)).st_ino, old_name.encode(),
                         (await env.lookup(new_dir)).st_ino, new_name.encode(), 0, CTX)


# (The bytes of a refused truncate are kept in lost+found, as those of any refused store.)
@pytest.mark.expect_log(r"truncate: b/plain.txt: not stored \(.*over --max-meta-bytes 2048.*\); the bytes are kept at")
def test_changes_that_grow_a_meta_at_the_limit_are_refused(ops_env, caplog):
    async def body(env: Env):
        ino = (await env.lookup("b/edge.txt")).st_ino
        before = await revision(env, "edge.txt")
        # Each of these would grow the meta over the limit: refused, nothing stored.
        assert await err(rename(env, "b/edge.txt", "b/edge-with-a-longer-name.txt")) == errno.E2BIG
        assert await err(env.ops.setxattr(ino, b"user.k", b"v", CTX)) == errno.E2BIG
        assert await err(chmod(env, ino, 0o4644)) == errno.E2BIG  # "4644" where "644" was
        assert await revision(env, "edge.txt") == before  # nothing stored
        assert await env.store.get_info("b", "edge-with-a-longer-name.txt") is None
        assert await env.cat("b/edge.txt") == b"some bytes\n"
        # Changes that keep it within the limit are made.
        await rename(env, "b/edge.txt", "b/edge.tx")
        ino = (await env.lookup("b/edge.tx")).st_ino
        await chmod(env, ino, 0o600)
        await utime(env, ino, 1_600_000_000_000_000_000)
        assert await meta_bytes(env, "edge.tx") <= LIMIT
        await truncate(env, (await env.lookup("b/edge.tx")).st_ino, 4)
        assert await env.cat("b/edge.tx") == b"some"
        # A write that makes the size a longer number grows the meta too.
        plain = (await env.lookup("b/plain.txt")).st_ino
        before = await revision(env, "plain.txt")
        assert await err(truncate(env, plain, 10**5)) == errno.E2BIG
        assert await revision(env, "plain.txt") == before
        # One line says it, as a truncate (nothing was closed), with the reason and where the bytes went.
        said = [r.getMessage() for r in caplog.records if "plain.txt" in r.getMessage() and r.levelno >= logging.INFO]
        assert len(said) == 1 and said[0].startswith("truncate: b/plain.txt: not stored ("), said
        assert "over --max-meta-bytes 2048" in said[0] and "the bytes are kept at" in said[0]
        await truncate(env, plain, 4)
        assert await env.cat("b/plain.txt") == b"some"
        assert await meta_bytes(env, "plain.txt") == LIMIT - 1
        assert [r for r in caplog.records if "over --max-meta-bytes 2048" in r.getMessage()]

    ops_env(body, setup=setup, max_meta_bytes=LIMIT)


def test_an_oversized_meta_can_be_shrunk_and_fixed(ops_env):
    """Another client's meta over the limit: changes that do not grow it are made (a shorter rename,
    chmod and utime replacing values of the same length, removing an xattr, truncate, unlink)."""
    async def body(env: Env):
        size = await meta_bytes(env, "over.txt")
        ino = (await env.lookup("b/over.txt")).st_ino
        assert await err(env.ops.setxattr(ino, b"user.k", b"v", CTX)) == errno.E2BIG
        assert await err(rename(env, "b/over.txt", "b/over-and-longer.txt")) == errno.E2BIG
        await chmod(env, ino, 0o600)
        await utime(env, ino, 1_600_000_000_000_000_000)
        assert await meta_bytes(env, "over.txt") <= size
        await rename(env, "b/over.txt", "b/ov.txt")
        ino = (await env.lookup("b/ov.txt")).st_ino
        await truncate(env, ino, 3)
        assert await env.cat("b/ov.txt") == b"som"
        assert (await env.ops.getattr(ino, None)).st_mode & 0o777 == 0o600
        size = await meta_bytes(env, "ov.txt")
        await env.ops.removexattr(ino, b"user.pad", CTX)
        assert await meta_bytes(env, "ov.txt") < LIMIT < size
        await env.ops.setxattr(ino, b"user.k", b"v", CTX)  # room again
        await env.ops.unlink((await env.lookup("b")).st_ino, b"ov.txt", CTX)
        assert (await env.store.get_info("b", "ov.txt")).deleted

    ops_env(body, setup=setup, max_meta_bytes=LIMIT)


def test_the_tombstone_of_an_oversized_link_is_written(ops_env):
    """Deleting always works, even where the tombstone is a few bytes larger than the meta (a link's
    tombstone adds `deleted` and drops nothing)."""
    async def setup_link(ms: MemoryStreams, store: ObjectStore) -> None:
        await setup(ms, store)
        doc = {"name": "big-link", "metadata": {"pad": "p" * LIMIT}, "options": {"link": {"bucket": "b", "name":
               "edge.txt"}}, "bucket": "b", "nuid": "L1", "size": 0, "mtime": "0001-01-01T00:00:00Z", "chunks": 0}
        await ms.publish(meta_subject("b", "big-link"), meta_json(doc), {"Nats-Rollup": "sub"})

    async def body(env: Env):
        await env.lookup("b/big-link")
        await env.ops.unlink((await env.lookup("b")).st_ino, b"big-link", CTX)
        assert (await env.store.get_info("b", "big-link")).deleted
        assert await meta_bytes(env, "big-link") > LIMIT

    ops_env(body, setup=setup_link, max_meta_bytes=LIMIT)


def test_a_directory_rename_that_would_outgrow_the_limit_moves_nothing(ops_env, caplog):
    async def setup_dir(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        for i in range(5):
            await put_object(ms, "b", f"d/small{i}.txt", b"small\n")
        await meta_of_size(ms, "d/sub/edge.txt", LIMIT - 10)

    async def body(env: Env):
        caplog.set_level(logging.INFO)
        before = {name: await revision(env, name) for name in
                  [f"d/small{i}.txt" for i in range(5)] + ["d/sub/edge.txt"]}
        assert await err(rename(env, "b/d", "b/d-is-now-much-longer")) == errno.E2BIG
        assert {name: await revision(env, name) for name in before} == before
        assert sorted((await env.listdir((await env.lookup("b")).st_ino)).names) == ["d"]
        assert [r for r in caplog.records if "d-is-now-much-longer/sub/edge.txt" in r.getMessage()
                and "over --max-meta-bytes" in r.getMessage()]
        # A rename that keeps every meta within the limit moves them all.
        await rename(env, "b/d", "b/e")
        assert await env.cat("b/e/sub/edge.txt") == b"some bytes\n"
        assert sorted((await env.listdir((await env.lookup("b/e")).st_ino)).names) == [
            *(f"small{i}.txt" for i in range(5)), "sub"]

    ops_env(body, setup=setup_dir, max_meta_bytes=LIMIT)


@pytest.mark.expect_log(r"b/plain.txt: closed without a successful upload \(.*over --max-meta-bytes 2048")
def test_a_close_refused_over_the_limit_leaves_no_refused_size_in_the_kernel(ops_env):
    """open, ftruncate (accepted: staged), close refused E2BIG (the size is a longer number): the kernel
    sized the inode by the truncate, so the refused close asks it to drop those attributes before it
    returns, and the release that gives the bytes to lost+found drops its pages too; the inode shows
    the stored object again."""
    async def body(env: Env):
        ino = (await env.lookup("b/plain.txt")).st_ino
        fi = await env.open(ino, os.O_RDWR)
        attr = pyfuse3.EntryAttributes()
        attr.st_size = 10**6
        assert (await env.ops.setattr(ino, attr, Fields(update_size=True), fi.fh, CTX)).st_size == 10**6
        env.fs.kernel.sent.clear()
        assert await err(env.ops.flush(fi.fh)) == errno.E2BIG
        assert ("attr", ino, None) in env.fs.kernel.sent  # before the close returns
        await env.ops.release(fi.fh)
        assert ("inode", ino, None) in env.fs.kernel.sent
        assert (await env.ops.getattr(ino, CTX)).st_size == len(b"some bytes\n")
        assert await env.cat("b/plain.txt") == b"some bytes\n"

    ops_env(body, setup=setup, max_meta_bytes=LIMIT)
