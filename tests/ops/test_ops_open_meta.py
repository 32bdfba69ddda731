"""Opens that truncate without write access (`O_RDONLY|O_TRUNC`), and metadata calls through a descriptor
whose file was unlinked or replaced while open: driven through natsfs.fs.Operations over MemoryStreams."""

from __future__ import annotations

import errno
import os

import pyfuse3
import pytest
from gowriters import put_object
from opskit import Ctx, Env, Fields
from test_ops_shared_and_odd_metas import err, stored

from natsfs.adr20 import ObjectStore
from natsfs.memstreams import MemoryStreams


async def one_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=4 << 20)
    await put_object(ms, "b", "old.txt", b"old content")


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


# ------------------------------------------------------------------ metadata calls on a nameless open file
async def change_meta_through(env: Env, ino: int) -> pyfuse3.EntryAttributes:
    """fchmod, fchown, futimens and fsetxattr through a descriptor of `ino`, as the kernel sends them (FUSE
    names no handle for them); what fstat shows after."""
    attr = pyfuse3.EntryAttributes()
    attr.st_mode, attr.st_uid, attr.st_mtime_ns = 0o100600, 65534, 5_000_000_005
    got = await env.ops.setattr(ino, attr, Fields(update_mode=True), None, Ctx())
    assert got.st_mode & 0o7777 == 0o600
    got = await env.ops.setattr(ino, attr, Fields(update_uid=True), None, Ctx())
    assert got.st_uid == 65534
    got = await env.ops.setattr(ino, attr, Fields(update_mtime=True), None, Ctx())
    assert got.st_mtime_ns == 5_000_000_005
    await env.ops.setxattr(ino, b"user.k", b"v", Ctx())
    assert await env.ops.getxattr(ino, b"user.k", Ctx()) == b"v"
    assert b"user.k" in await env.ops.listxattr(ino, Ctx())
    await env.ops.setxattr(ino, b"user.gone", b"x", Ctx())
    await env.ops.removexattr(ino, b"user.gone", Ctx())
    assert await err(env.ops.getxattr(ino, b"user.gone", Ctx())) == pyfuse3.ENOATTR
    fstat = await env.ops.getattr(ino, None)
    assert (fstat.st_mode & 0o7777, fstat.st_uid, fstat.st_mtime_ns, fstat.st_nlink) == (0o600, 65534,
                                                                                         5_000_000_005, 0)
    return fstat


@pytest.mark.parametrize("written", [False, True], ids=["untouched", "written"])
@pytest.mark.parametrize("stored_by", ["another client", "this mount"])
def test_metadata_calls_on_an_unlinked_open_file_act_on_it_alone(ops_env, written, stored_by):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        f = await env.lookup("b/old.txt")
        if stored_by == "this mount":  # (whose mtime of the version this mount remembers, not stored)
            fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
            await env.ops.write(fi.fh, 0, b"old content")
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)
        fi = await env.ops.open(f.st_ino, os.O_RDWR, Ctx())
        await env.ops.unlink(b, b"old.txt", Ctx())
        if written:  # its staged copy, which no close stores
            await env.ops.write(fi.fh, 0, b"OLD")
        fstat = await change_meta_through(env, f.st_ino)
        assert fstat.st_size == len(b"old content")
        assert await env.ops.read(fi.fh, 0, 100) == (b"OLD content" if written else b"old content")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        gone = await env.store.get_info("b", "old.txt")
        assert gone is None or gone.deleted  # (its tombstone)
        assert lost_found(env) == [] and len(env.fs.staging) == 0

    ops_env(body, setup=one_bucket)


def test_metadata_calls_on_a_never_stored_file_unlinked_while_open(ops_env):
    async def body(env: Env):
        # tempfile.TemporaryFile() on a mount refusing O_TMPFILE: create, unlink, then use the descriptor.
        b = (await env.lookup("b")).st_ino
        fi, attr = await env.ops.create(b, b"tmp", 0o644, os.O_RDWR | os.O_CREAT, Ctx())
        await env.ops.setxattr(attr.st_ino, b"user.before", b"1", Ctx())
        await env.ops.write(fi.fh, 0, b"abc")
        await env.ops.unlink(b, b"tmp", Ctx())
        await change_meta_through(env, attr.st_ino)
        assert await env.ops.getxattr(attr.st_ino, b"user.before", Ctx()) == b"1"
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await env.store.get_info("b", "tmp") is None
        assert lost_found(env) == [] and len(env.fs.staging) == 0

    ops_env(body, setup=one_bucket)


@pytest.mark.parametrize("written", [False, True], ids=["untouched", "written"])
def test_metadata_calls_on_a_replaced_open_file_leave_the_new_file_alone(ops_env, written):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        f = await env.lookup("b/old.txt")
        await env.ops.setxattr(f.st_ino, b"user.old", b"kept", Ctx())
        fi = await env.ops.open(f.st_ino, os.O_RDWR, Ctx())
        # An atomic save over it: write a temporary file, rename it over the name.
        tmp, _ = await env.ops.create(b, b"old.txt.tmp", 0o640, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(tmp.fh, 0, b"newer")
        await env.ops.flush(tmp.fh)
        await env.ops.release(tmp.fh)
        await env.ops.setxattr((await env.lookup("b/old.txt.tmp")).st_ino, b"user.new", b"n", Ctx())
        await env.ops.rename(b, b"old.txt.tmp", b, b"old.txt", 0, Ctx())
        new_before = await env.store.get_meta_doc("b", "old.txt")
        if written:
            await env.ops.write(fi.fh, 0, b"XX")
        await change_meta_through(env, f.st_ino)
        assert await err(env.ops.getxattr(f.st_ino, b"user.new", Ctx())) == pyfuse3.ENOATTR
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        # The file at the name keeps its own bytes, mode, owner, time and xattrs: untouched since the rename.
        assert await env.store.get_meta_doc("b", "old.txt") == new_before
        assert await stored(env, "old.txt") == b"newer"
        now = await env.lookup("b/old.txt")
        assert now.st_ino != f.st_ino and now.st_mode & 0o7777 == 0o640 and now.st_mtime_ns != 5_000_000_005
        assert await env.ops.getxattr(now.st_ino, b"user.new", Ctx()) == b"n"
        assert await err(env.ops.getxattr(now.st_ino, b"user.k", Ctx())) == pyfuse3.ENOATTR
        assert lost_found(env) == [] and len(env.fs.staging) == 0

    ops_env(body, setup=one_bucket)

