"""This mount's own meta-only changes (chmod, chown, utime, setxattr, removexattr) keep a file's identity.

A meta-only change stores a new meta with the same nuid (the same bytes): the inode keeps its path, its
open handles stay attached (fstat shows one link), and a later write through this mount does not take the
change for another client's. (An index update used to report the path between removing the old entry and
placing the new one; the filesystem then saw no entry, detached the inode its readers held, and the next
writer through the kernel's still-valid entry got the old version, whose upload failed as a conflict.)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import pytest
import trio
from gowriters import put_object
from opskit import CTX, Env, Fields
from test_ops_coherence import Held
from test_ops_upload_races import lost_and_found
from test_ops_write import stored

from natsfs.adr20 import ObjectStore
from natsfs.memstreams import MemoryStreams

LINE0 = b"line0\n"
LINE1 = b"line1\n"


async def a_log_file(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "app.log", LINE0)



async def chmod(env: Env, ino: int, mode: int, fh: int | None = None) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_mode = 0o100000 | mode
    await env.ops.setattr(ino, attr, Fields(update_mode=True), fh, CTX)


async def utime(env: Env, ino: int, fh: int | None = None) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_mtime_ns = 1_000_000_000 * 10**9
    await env.ops.setattr(ino, attr, Fields(update_mtime=True), fh, CTX)


async def setxattr(env: Env, ino: int, fh: int | None = None) -> None:
    await env.ops.setxattr(ino, b"user.k", b"v", CTX)


async def removexattr(env: Env, ino: int, fh: int | None = None) -> None:
    await env.ops.setxattr(ino, b"user.k", b"v", CTX)
    await env.ops.removexattr(ino, b"user.k", CTX)


MetaChange = Callable[..., Awaitable[None]]
CHANGES: dict[str, MetaChange] = {"chmod": lambda env, ino, fh=None: chmod(env, ino, 0o640, fh), "utime": utime,
                                  "setxattr": setxattr, "removexattr": removexattr}


@pytest.mark.parametrize("change", CHANGES)
def test_a_meta_change_while_a_reader_is_open_keeps_the_inode_and_a_later_append_is_stored(ops_env, change):
    """`tail -f app.log` holds it open; the log is chmodded (or touched, or given an xattr) here; then a
    writer appends through the same inode (the kernel's entry is still valid): the close stores both
    lines, nothing goes to lost+found, and the reader reads them."""
    async def body(env: Env):
        attr = await env.lookup("b/app.log")
        ino = attr.st_ino
        reader = await env.ops.open(ino, os.O_RDONLY, CTX)
        assert await env.ops.read(reader.fh, 0, 100) == LINE0

        await CHANGES[change](env, ino)
        await env.settle()

        assert (await env.lookup("b/app.log")).st_ino == ino  # the path kept its inode
        assert (await env.ops.getattr(ino, None)).st_nlink == 1  # fstat(reader): still linked

        writer = await env.ops.open(ino, os.O_WRONLY | os.O_APPEND, CTX)
        assert await env.ops.write(writer.fh, len(LINE0), LINE1) == len(LINE1)
        await env.ops.flush(writer.fh)  # raised ESTALE ("another client changed it meanwhile")
        await env.ops.release(writer.fh)
        await env.settle()

        assert await env.cat("b/app.log") == LINE0 + LINE1
        assert env.fs.counters["conflicts"] == 0
        lost = env.fs.staging.spool.lost_found
        assert not lost.exists() or not [p for p in lost.rglob("*") if p.is_file()]
        assert (await env.lookup("b/app.log")).st_ino == ino
        await env.ops.release(reader.fh)

    ops_env(body, setup=a_log_file)


def test_chmod_by_path_then_fchmod_through_the_open_descriptor(ops_env):
    """chmod(path) then fchmod(fd) of a file open for reading: both succeed (the second used to fail with
    ESTALE, its inode detached and pinned to the version before the first), one link, one inode."""
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        fd = await env.ops.open(ino, os.O_RDONLY, CTX)
        await chmod(env, ino, 0o600)
        await env.settle()
        await chmod(env, ino, 0o640, fd.fh)
        await utime(env, ino)
        got = await env.ops.getattr(ino, None)
        assert got.st_nlink == 1 and got.st_mode & 0o777 == 0o640
        assert (await env.lookup("b/app.log")).st_ino == ino
        doc, _ = await env.store.get_meta_doc("b", "app.log")
        assert doc["metadata"]["natsfs.mode"] == "640"
        assert await env.ops.read(fd.fh, 0, 100) == LINE0
        await env.ops.release(fd.fh)

    ops_env(body, setup=a_log_file)


def test_fchmod_then_close_then_rename_the_new_name_shows_the_same_inode(ops_env):
    """What rsync does with every file it receives: write a temporary file, open it for reading,
    fchmod, close (the release comes later, asynchronously), rename it into place. The renamed inode
    answers getattr (stat(dst) used to get ENOENT for the entry timeout) before and after the release."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        fi, attr = await env.ops.create(b, b".t0", 0o600, os.O_WRONLY | os.O_CREAT, CTX)
        await env.ops.write(fi.fh, 0, b"hello\n")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        ino = attr.st_ino

        fd = await env.ops.open(ino, os.O_RDONLY, CTX)
        await chmod(env, ino, 0o644, fd.fh)
        await env.ops.flush(fd.fh)  # close(2); its release has not arrived yet
        await env.settle()
        await env.ops.rename(b, b".t0", b, b"d0", 0, CTX)
        await env.settle()

        got = await env.ops.getattr(ino, None)  # the kernel moved its entry: d0 is this inode
        assert got.st_nlink == 1 and got.st_mode & 0o777 == 0o644 and got.st_size == 6
        await env.ops.release(fd.fh)
        await env.settle()
        assert (await env.ops.getattr(ino, None)).st_size == 6
        assert (await env.ops.lookup(b, b"d0", None)).st_ino == ino
        assert await env.cat("b/d0") == b"hello\n"

    ops_env(body, setup=a_log_file)


def test_a_file_held_open_keeps_its_inode_when_its_directory_is_renamed(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        d = await env.ops.mkdir(b, b"dir", 0o755, CTX)
        fi, attr = await env.ops.create(d.st_ino, b"f", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        await env.ops.write(fi.fh, 0, b"data")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        reader = await env.ops.open(attr.st_ino, os.O_RDONLY, CTX)
        await chmod(env, attr.st_ino, 0o600)
        await env.settle()
        await env.ops.rename(b, b"dir", b, b"moved", 0, CTX)
        await env.settle()
        assert (await env.lookup("b/moved/f")).st_ino == attr.st_ino
        assert (await env.ops.getattr(attr.st_ino, None)).st_nlink == 1
        assert await env.ops.read(reader.fh, 0, 10) == b"data"
        await env.ops.release(reader.fh)

    ops_env(body, setup=a_log_file)


def test_a_meta_change_by_another_client_keeps_the_inode_too(ops_env):
    """Another client's chmod (a meta with the same nuid) is no replacement either: the reader's inode
    keeps the path and shows the new mode."""
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        reader = await env.ops.open(ino, os.O_RDONLY, CTX)
        info = await env.store.get_info("b", "app.log")

        def mode_600(doc: dict) -> None:
            doc["metadata"] = dict(doc.get("metadata") or {}) | {"natsfs.mode": "600"}

        await env.store.update_meta("b", "app.log", mode_600, expected_revision=info.revision)
        await env.settle()
        assert (await env.lookup("b/app.log")).st_ino == ino
        got = await env.ops.getattr(ino, None)
        assert got.st_nlink == 1 and got.st_mode & 0o777 == 0o600
        await env.ops.release(reader.fh)

    ops_env(body, setup=a_log_file)


class HeldMetaUpdate:
    """Holds this mount's next meta-only store (`ObjectStore.update_meta`) twice: before it is sent
    (`sending`, until `send`) and after the server stored it (`stored`, until `finish`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: ObjectStore) -> None:
        self.sending, self.send, self.stored, self.finish = trio.Event(), trio.Event(), trio.Event(), trio.Event()
        original = store.update_meta

        async def held(*args: Any, **kwargs: Any) -> Any:
            self.sending.set()
            await self.send.wait()
            info = await original(*args, **kwargs)
            self.stored.set()
            await self.finish.wait()
            return info

        monkeypatch.setattr(store, "update_meta", held)


class HeldMetaRead:
    """Holds the next `ObjectStore.get_meta_doc` (an upload comparing its base with the stored meta)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: ObjectStore) -> None:
        self.reached, self.go = trio.Event(), trio.Event()
        original = store.get_meta_doc

        async def held(*args: Any, **kwargs: Any) -> Any:
            if not self.go.is_set():
                self.reached.set()
                await self.go.wait()
            return await original(*args, **kwargs)

        monkeypatch.setattr(store, "get_meta_doc", held)


async def stored_doc(env: Env) -> dict:
    doc, _ = await env.store.get_meta_doc("b", "app.log")
    return doc


def test_a_chmod_racing_a_writer_of_the_same_file_is_no_conflict_and_is_kept(ops_env, monkeypatch):
    """chmod reads the file's meta; meanwhile a writer opens it and appends (staged on the meta before
    the chmod); the chmod is stored; the writer closes while the chmod is still finishing: the close
    waits for it and stores both lines with the new mode (it failed as a conflict, bytes to lost+found)."""
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        hold = HeldMetaUpdate(monkeypatch, env.store)
        env.nursery.start_soon(chmod, env, ino, 0o640)
        await hold.sending.wait()

        writer = await env.ops.open(ino, os.O_WRONLY | os.O_APPEND, CTX)
        await env.ops.write(writer.fh, len(LINE0), LINE1)
        hold.send.set()
        await hold.stored.wait()

        closed = trio.Event()

        async def close() -> None:
            await env.ops.flush(writer.fh)
            closed.set()

        env.nursery.start_soon(close)
        await env.settle()
        assert not closed.is_set()  # the close waits for this mount's own change to finish
        hold.finish.set()
        await closed.wait()
        await env.ops.release(writer.fh)
        await env.settle()

        assert env.fs.counters["conflicts"] == 0
        assert await env.cat("b/app.log") == LINE0 + LINE1
        assert (await stored_doc(env))["metadata"]["natsfs.mode"] == "640"
        assert (await env.ops.getattr(ino, None)).st_mode & 0o777 == 0o640

    ops_env(body, setup=a_log_file)


@pytest.mark.parametrize("change", ["chmod", "setxattr"])
def test_a_meta_change_during_the_upload_of_a_close_waits_for_it(ops_env, monkeypatch, change):
    """A chmod (or setxattr) arriving while a close's upload is under way is stored after it: neither lost
    (the upload had taken the attributes it stores) nor a false conflict for the upload."""
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        writer = await env.ops.open(ino, os.O_WRONLY | os.O_APPEND, CTX)
        await env.ops.write(writer.fh, len(LINE0), LINE1)
        hold = HeldMetaRead(monkeypatch, env.store)
        env.nursery.start_soon(env.ops.flush, writer.fh)
        await hold.reached.wait()  # the upload runs

        done = trio.Event()

        async def meta_change() -> None:
            if change == "chmod":
                await chmod(env, ino, 0o600)
            else:
                await env.ops.setxattr(ino, b"user.k", b"v", CTX)
            done.set()

        env.nursery.start_soon(meta_change)
        await env.settle()
        hold.go.set()
        await done.wait()
        await env.ops.release(writer.fh)
        await env.settle()

        assert env.fs.counters["conflicts"] == 0
        assert await env.cat("b/app.log") == LINE0 + LINE1
        doc = await stored_doc(env)
        if change == "chmod":
            assert doc["metadata"]["natsfs.mode"] == "600"
            assert (await env.ops.getattr(ino, None)).st_mode & 0o777 == 0o600
        else:
            assert await env.ops.getxattr(ino, b"user.k", CTX) == b"v"

    ops_env(body, setup=a_log_file)


def test_a_chmod_between_two_closes_of_a_writer_is_not_undone_by_the_second(ops_env):
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        writer = await env.ops.open(ino, os.O_RDWR, CTX)
        await env.ops.write(writer.fh, len(LINE0), LINE1)
        await env.ops.fsync(writer.fh, False)  # stored; the file stays open for writing
        await chmod(env, ino, 0o600)
        await env.ops.write(writer.fh, len(LINE0 + LINE1), b"line2\n")
        await env.ops.flush(writer.fh)
        await env.ops.release(writer.fh)
        await env.settle()
        assert await env.cat("b/app.log") == LINE0 + LINE1 + b"line2\n"
        assert (await stored_doc(env))["metadata"]["natsfs.mode"] == "600"

    ops_env(body, setup=a_log_file)


def test_write_back_a_chmodded_log_appended_to_with_a_reader_open(ops_env):
    """The same in write-back mode: the append is uploaded later, with the mode of the last chmod (one made
    while it waited for its upload too), and no conflict."""
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        reader = await env.ops.open(ino, os.O_RDONLY, CTX)
        await chmod(env, ino, 0o640)
        writer = await env.ops.open(ino, os.O_WRONLY | os.O_APPEND, CTX)
        await env.ops.write(writer.fh, len(LINE0), LINE1)
        await env.ops.flush(writer.fh)
        await env.ops.release(writer.fh)
        await chmod(env, ino, 0o600)  # while its upload is queued
        assert env.fs.writeback is not None
        await env.fs.writeback.drain(10)
        await env.settle()
        assert env.fs.counters["conflicts"] == 0
        assert await env.cat("b/app.log") == LINE0 + LINE1
        assert (await stored_doc(env))["metadata"]["natsfs.mode"] == "600"
        assert (await env.lookup("b/app.log")).st_ino == ino
        await env.ops.release(reader.fh)

    ops_env(body, setup=a_log_file, write_back=3600.0)


async def both_stored(env: Env, ino: int, change: str, data: bytes = LINE0 + LINE1) -> None:
    """The close's bytes and the meta change are both in the stored object (read back from the store),
    and nothing went to lost+found."""
    assert env.fs.counters["conflicts"] == 0
    assert lost_and_found(env) == []
    assert await stored(env, "app.log") == data
    metadata = (await stored_doc(env)).get("metadata") or {}
    if change == "chmod":
        assert metadata.get("natsfs.mode") == "640"
        assert (await env.ops.getattr(ino, None)).st_mode & 0o777 == 0o640
    elif change == "utime":
        assert metadata.get("natsfs.mtime_ns") == str(1_000_000_000 * 10**9)
    elif change == "setxattr":
        assert await env.ops.getxattr(ino, b"user.k", CTX) == b"v"
    assert await env.cat("b/app.log") == data


@pytest.mark.parametrize("change", ["chmod", "utime", "setxattr"])
@pytest.mark.parametrize("resumes", ["before the release", "after the release"])
def test_a_meta_change_arriving_while_a_close_is_put_is_stored_after_it(ops_env, monkeypatch, change, resumes):
    """The change arrives while the close's put is held, and goes on once the close is done (before its
    release, or after it: the staged file is gone then). Both are stored; the chmod used to publish at the
    revision it read before the put (the staged file's) and fail with ESTALE."""
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        writer = await env.ops.open(ino, os.O_WRONLY | os.O_APPEND, CTX)
        await env.ops.write(writer.fh, len(LINE0), LINE1)
        put = Held(monkeypatch, env.store, "put_file")
        changed, closed = trio.Event(), trio.Event()

        async def meta_change() -> None:
            await CHANGES[change](env, ino)
            changed.set()

        async def close() -> None:
            await env.ops.flush(writer.fh)
            if resumes == "after the release":
                await env.ops.release(writer.fh)
            closed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close)
            await put.held.wait()
            checked = Held(monkeypatch, env.fs.mut, "check_writable")  # the change's, after reading the file
            nursery.start_soon(meta_change)
            await checked.held.wait()
            put.release()
            await closed.wait()
            checked.release()
        if resumes == "before the release":
            await env.ops.release(writer.fh)
        await env.settle()
        await both_stored(env, ino, change)

    ops_env(body, setup=a_log_file)


async def an_empty_log(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "app.log", b"")


@pytest.mark.parametrize("change", ["chmod", "setxattr"])  # (a utime is undone by the write that follows it)
def test_a_close_landing_while_a_meta_change_is_published_is_stored_after_it(ops_env, monkeypatch, change):
    """A writer has the file open, nothing written yet; a chmod (or setxattr) reads the meta and its
    publish is held; the writer writes and closes meanwhile. The close waits for the change and stores at
    its revision, with its attributes: both kept. The close's put used to go first and the change then failed
    with ESTALE."""
    async def body(env: Env):
        ino = (await env.lookup("b/app.log")).st_ino
        writer = await env.ops.open(ino, os.O_WRONLY | os.O_APPEND, CTX)
        publish = Held(monkeypatch, env.store, "update_meta")
        closed = trio.Event()

        async def close() -> None:
            await env.ops.write(writer.fh, 0, LINE1)  # (an empty file: nothing to copy in first)
            await env.ops.flush(writer.fh)
            await env.ops.release(writer.fh)
            closed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(CHANGES[change], env, ino)
            await publish.held.wait()
            nursery.start_soon(close)
            await env.settle()  # (the close waits for the change)
            publish.release()
        assert closed.is_set()
        await env.settle()
        await both_stored(env, ino, change, LINE1)

    ops_env(body, setup=an_empty_log)


def _hold_first_node_read(env: Env, monkeypatch: Any) -> tuple[trio.Event, trio.Event]:
    """The core's next read of a node waits after it read: `reached` is set then, and it goes on once
    `go` is set (what it read is then out of date, as when another client changed it meanwhile)."""
    real_node = env.fs._node
    reached, go = trio.Event(), trio.Event()

    async def first_read_held(inode: Any) -> Any:
        node = await real_node(inode)
        if not reached.is_set():
            reached.set()
            await go.wait()
        return node

    monkeypatch.setattr(env.fs, "_node", first_read_held)
    return reached, go


@pytest.mark.parametrize("replacement", ["directory", "symlink"])
def test_a_chmod_of_a_file_another_client_replaces_meanwhile_is_a_clear_error(ops_env, monkeypatch, replacement):
    """The chmod read the file, then awaited; meanwhile another client replaced it by a directory (or an
    ADR-20 link). The change, read again before it is stored, must not be applied to what is there now
    as if it were the file: a clear errno, no traceback (it was an AssertionError, EIO)."""
    from gowriters import delete_object

    async def body(env: Env):
        ino = (await env.lookup("app.log")).st_ino
        reached, go = _hold_first_node_read(env, monkeypatch)
        errnos: list[int] = []

        async def change() -> None:
            try:
                await chmod(env, ino, 0o600)
            except pyfuse3.FUSEError as e:
                errnos.append(e.errno)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(change)
            await reached.wait()
            await delete_object(env.streams, "b", "app.log")
            if replacement == "directory":
                await put_object(env.streams, "b", "app.log/inner", b"x")
            else:
                await env.store.add_link("b", "app.log", "b", "other")
            await env.settle()
            go.set()
        assert len(errnos) == 1 and errnos[0] != errno.EIO, errnos

    ops_env(body, setup=a_log_file, bucket="b")


def test_a_setxattr_of_a_file_another_client_replaced_by_a_link_meanwhile_is_a_conflict(ops_env, monkeypatch):
    """The setxattr read the file, then awaited; meanwhile another client replaced it by an ADR-20 link.
    Read again before it is stored, the name holds the link: the attribute must not land on the link's
    meta as if it were the file (ESTALE, as for a chmod)."""
    from gowriters import delete_object

    async def body(env: Env):
        ino = (await env.lookup("app.log")).st_ino
        reached, go = _hold_first_node_read(env, monkeypatch)
        errnos: list[int] = []

        async def change() -> None:
            try:
                await setxattr(env, ino)
            except pyfuse3.FUSEError as e:
                errnos.append(e.errno)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(change)
            await reached.wait()
            await delete_object(env.streams, "b", "app.log")
            await env.store.add_link("b", "app.log", "b", "other")
            placed = await env.store.get_info("b", "app.log")
            await env.settle()
            go.set()
        assert errnos == [errno.ESTALE], errnos
        link = await env.store.get_info("b", "app.log")
        assert placed is not None and link is not None and link.link is not None
        assert link.revision == placed.revision  # the link's meta was not changed

    ops_env(body, setup=a_log_file, bucket="b")
