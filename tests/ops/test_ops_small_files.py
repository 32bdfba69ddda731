"""Many small files through natsfs.fs.Operations over MemoryStreams: what one file of `tar -x` costs in
server calls (a new small file is one chunk publish and one meta publish in one round trip, also in a
bucket that allows atomic batches; tar's mtime, owner and mode on the open descriptor ride along with the data; no read
back of the stored meta), an empty file is one meta publish, and a file deleted before its close costs
nothing at all."""

from __future__ import annotations

import os
from collections import Counter

import pyfuse3
import pytest
from gowriters import put_object
from opskit import Env
from test_ops_write import Ctx, Fields, one_bucket, stored

from natsfs.errors import Conflict

MTIME_NS = 1_700_000_000 * 10**9


def calls_since(env: Env, before: Counter[str]) -> dict[str, int]:
    """Server calls since `before`, less the bucket watch's own polling."""
    return {k: v for k, v in (env.streams.calls - before).items() if v and k != "watch_next"}


async def ready(env: Env) -> tuple[int, Counter[str]]:
    """The bucket indexed and its state known (what a mount does once): its inode and the calls so far."""
    b = (await env.lookup("b")).st_ino
    await env.ns.index("b")
    await env.settle()
    return b, env.streams.calls.copy()


async def tar_one_file(env: Env, b: int, name: str, data: bytes) -> None:
    """What GNU tar does for one regular file in directory `b` (strace): create with O_EXCL, write,
    futimens, fchown, fchmod on the open descriptor, close."""
    fi, attr = await env.ops.create(b, name.encode(), 0o600, os.O_WRONLY | os.O_CREAT | os.O_EXCL, Ctx())
    if data:
        await env.ops.write(fi.fh, 0, data)
    a = pyfuse3.EntryAttributes()
    a.st_mtime_ns = MTIME_NS
    await env.ops.setattr(attr.st_ino, a, Fields(update_mtime=True), fi.fh, Ctx())
    a = pyfuse3.EntryAttributes()
    a.st_uid, a.st_gid = 1000, 1000
    await env.ops.setattr(attr.st_ino, a, Fields(update_uid=True, update_gid=True), fi.fh, Ctx())
    a = pyfuse3.EntryAttributes()
    a.st_mode = 0o100640
    await env.ops.setattr(attr.st_ino, a, Fields(update_mode=True), fi.fh, Ctx())
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)


async def atomic_bucket(ms, store) -> None:  # type: ignore[no-untyped-def]
    await one_bucket(ms, store)
    await store.bucket_status("b")  # learns that the bucket allows atomic batches


def test_a_small_file_of_tar_is_one_round_trip(ops_env):
    async def body(env: Env):
        assert env.store.batch_fits("b", 4096)
        data = os.urandom(3000)
        b, before = await ready(env)
        await tar_one_file(env, b, "f.txt", data)
        assert calls_since(env, before) == {"publish_each": 1}  # the chunk and the meta, sent together
        assert await stored(env, "f.txt") == data
        doc, _ = await env.store.get_meta_doc("b", "f.txt")
        assert doc["metadata"] == {"natsfs.mode": "640", "natsfs.uid": "1000", "natsfs.gid": "1000",
                                   "natsfs.mtime_ns": str(MTIME_NS)}
        attr = await env.lookup("b/f.txt")
        assert (attr.st_size, attr.st_mtime_ns, attr.st_mode & 0o777) == (3000, MTIME_NS, 0o640)
        assert not env.fs.mut.journal.pending and not env.fs.mut.journal.active

    ops_env(body, setup=atomic_bucket)


def test_an_empty_file_is_one_meta_publish(ops_env):
    async def body(env: Env):
        b, before = await ready(env)
        await tar_one_file(env, b, "empty", b"")
        assert calls_since(env, before) == {"publish": 1}
        assert await stored(env, "empty") == b""

    ops_env(body, setup=atomic_bucket)


def test_a_file_deleted_before_its_close_costs_nothing(ops_env):
    async def body(env: Env):
        b, before = await ready(env)
        fi, _ = await env.ops.create(b, b"tmp", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, b"scratch")
        await env.ops.unlink(b, b"tmp", Ctx())
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert calls_since(env, before) == {}
        assert await env.store.get_info("b", "tmp") is None

    ops_env(body, setup=atomic_bucket)


def test_changes_right_after_the_close_are_one_publish_each(ops_env):
    """chmod after close (Hadoop's chmod), rename (a task's output committed) and unlink of a file this
    mount just stored start from the meta it stored: no read back of it."""
    async def body(env: Env):
        b, _ = await ready(env)
        await tar_one_file(env, b, "part-0", b"rows")
        attr = await env.lookup("b/part-0")
        before = env.streams.calls.copy()
        a = pyfuse3.EntryAttributes()
        a.st_mode = 0o100600
        await env.ops.setattr(attr.st_ino, a, Fields(update_mode=True), None, Ctx())
        assert calls_since(env, before) == {"publish": 1}
        before = env.streams.calls.copy()
        await env.ops.rename(b, b"part-0", b, b"part-00000", 0, Ctx())
        assert calls_since(env, before) == {"publish": 2}  # the new meta, the claim of the old name
        doc, _ = await env.store.get_meta_doc("b", "part-00000")
        assert doc["metadata"]["natsfs.mode"] == "600" and doc["metadata"]["natsfs.mtime_ns"] == str(MTIME_NS)
        assert await stored(env, "part-00000") == b"rows"
        before = env.streams.calls.copy()
        await env.ops.unlink(b, b"part-00000", Ctx())
        assert calls_since(env, before) == {"publish": 1, "purge_subject": 1}
        info = await env.store.get_info("b", "part-00000")
        assert info is not None and info.deleted

    ops_env(body, setup=atomic_bucket)


def test_a_rewrite_from_the_remembered_meta_still_refuses_another_clients_change(ops_env):
    async def body(env: Env):
        b, _ = await ready(env)
        await tar_one_file(env, b, "f", b"mine")
        ours = await env.store.get_info("b", "f")
        assert ours is not None
        await put_object(env.streams, "b", "f", b"theirs")
        before = env.streams.calls.copy()
        with pytest.raises(Conflict):
            await env.store.update_meta("b", "f", lambda doc: doc.update(description="x"),
                                        expected_revision=ours.revision)
        assert "last_msg" not in calls_since(env, before)  # started from the remembered meta
        assert await stored(env, "f") == b"theirs"
        doc, _ = await env.store.get_meta_doc("b", "f")
        assert "description" not in doc

    ops_env(body, setup=atomic_bucket)


def test_a_file_written_again_after_rm_replaces_the_tombstone_at_once(ops_env):
    """tar over an existing tree (unlink, then create) and Spark's overwrite: the new put expects the
    tombstone this mount just wrote instead of being refused and reading it back."""
    async def body(env: Env):
        b, _ = await ready(env)
        await tar_one_file(env, b, "f", b"first")
        await env.ops.unlink(b, b"f", Ctx())
        before = env.streams.calls.copy()
        await tar_one_file(env, b, "f", b"second")
        assert calls_since(env, before) == {"publish_each": 1}
        assert await stored(env, "f") == b"second"

    ops_env(body, setup=atomic_bucket)


def test_a_directory_is_one_publish_to_make_and_one_to_remove(ops_env):
    """Spark makes and removes many `_temporary` directories: a marker put is not read back for its
    time, and removing an empty object purges no chunks (it has none)."""
    async def body(env: Env):
        b, before = await ready(env)
        await env.ops.mkdir(b, b"_temporary", 0o755, Ctx())
        assert calls_since(env, before) == {"publish": 1}
        before = env.streams.calls.copy()
        await env.ops.rmdir(b, b"_temporary", Ctx())
        assert calls_since(env, before) == {"publish": 1}
        info = await env.store.get_info("b", "_temporary/")
        assert info is not None and info.deleted

    ops_env(body, setup=atomic_bucket)


def test_a_directory_time_not_written_yet_is_written_at_unmount(ops_env):
    async def body(env: Env):
        b, _ = await ready(env)
        await env.ops.mkdir(b, b"tree", 0o755, Ctx())
        tree = (await env.lookup("b/tree")).st_ino
        await tar_one_file(env, tree, "f", b"x")
        shown = (await env.lookup("b/tree")).st_mtime_ns
        await env.fs.shutdown(10)  # before the directory's quiet time has passed
        doc, _ = await env.store.get_meta_doc("b", "tree/")
        assert doc["metadata"]["natsfs.mtime_ns"] == str(shown)

    ops_env(body, setup=atomic_bucket)
