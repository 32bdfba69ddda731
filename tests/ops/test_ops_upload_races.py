"""A rename or unlink that runs while the same file is being uploaded (by its close, or by the write-back
uploader) holds, as on a local disk: the upload is held right at its put (`Held`), the rename or unlink
is started, the put is let go, and then the mount and the bucket must agree on the outcome: the bytes
under the new name only, or nowhere after an unlink; the close returns 0 (no false ESTALE) and nothing
goes to lost+found."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import pytest
import trio
from gowriters import put_object
from opskit import ROOT, Env, Fields, errno_of
from test_ops_coherence import Held
from test_ops_write import Ctx, stored

from natsfs.adr20 import BytesSource, ObjectStore
from natsfs.memstreams import MemoryStreams

V1 = b"version one\n" * 25_000  # 300 KB: several chunks
V2 = b"VERSION TWO\n" * 25_000
NEW = os.urandom(300_000)


async def bucket_b(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await store.put("b", "d/", BytesSource(b""), expected_revision=0)  # a directory "d" with a marker
    await put_object(ms, "b", "old", V1)


async def gone_here(env: Env, path: str) -> bool:
    try:
        await env.lookup(path)
    except pyfuse3.FUSEError as e:
        return errno_of(e) == errno.ENOENT
    return False


async def gone_there(env: Env, name: str) -> bool:
    info = await env.store.get_info("b", name)
    return info is None or info.deleted


async def ino_of(env: Env, path: str) -> int:
    return (await env.lookup(path)).st_ino if path else ROOT


async def while_put_held(monkeypatch: pytest.MonkeyPatch, env: Env, upload: Callable[[], Awaitable[None]],
                         change: Callable[[], Awaitable[None]]) -> list[str]:
    """Run `upload()` until its put is under way, start `change()`, let the put go; both must succeed.
    Returns what ended, in order."""
    hold = Held(monkeypatch, env.store, "put_file")
    ended: list[str] = []

    async def run(what: str, op: Callable[[], Awaitable[None]]) -> None:
        await op()
        ended.append(what)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "upload", upload)
        await hold.held.wait()
        nursery.start_soon(run, "change", change)
        await env.settle()  # the change runs as far as it can while the put is held
        hold.release()
    return ended


async def written(env: Env, path: str, data: bytes, *, rewrite: bool = False) -> pyfuse3.FileInfo:
    """A handle of `path` holding `data`, not closed yet."""
    if rewrite:
        fi = await env.ops.open(await ino_of(env, path), os.O_WRONLY | os.O_TRUNC, Ctx())
    else:
        parent, _, name = path.rpartition("/")
        fi, _ = await env.ops.create(await ino_of(env, parent), name.encode(), 0o644, os.O_WRONLY | os.O_CREAT,
                                     Ctx())
    assert await env.ops.write(fi.fh, 0, data) == len(data)
    return fi


def lost_and_found(env: Env) -> list[str]:
    root = env.fs.staging.spool.lost_found
    return [str(p) for p in root.rglob("*") if p.is_file()] if root.exists() else []


def rename(env: Env, old: str, new: str) -> Callable[[], Awaitable[None]]:
    async def go() -> None:
        o_parent, _, o_name = old.rpartition("/")
        n_parent, _, n_name = new.rpartition("/")
        await env.ops.rename(await ino_of(env, o_parent), o_name.encode(), await ino_of(env, n_parent),
                             n_name.encode(), 0, Ctx())
    return go


def unlink(env: Env, path: str) -> Callable[[], Awaitable[None]]:
    async def go() -> None:
        parent, _, name = path.rpartition("/")
        await env.ops.unlink(await ino_of(env, parent), name.encode(), Ctx())
    return go


def close(env: Env, fi: pyfuse3.FileInfo) -> Callable[[], Awaitable[None]]:
    async def go() -> None:
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
    return go


def test_a_new_file_renamed_while_its_close_uploads_it_is_stored_under_the_new_name(ops_env, monkeypatch):
    async def body(env: Env):
        fi = await written(env, "f", NEW)
        await while_put_held(monkeypatch, env, close(env, fi), rename(env, "f", "g"))
        await env.settle()
        assert await gone_here(env, "f") and await gone_there(env, "f")
        assert await stored(env, "g") == NEW
        assert await env.cat("g") == NEW
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_rewritten_file_renamed_while_its_close_uploads_it_keeps_the_new_version(ops_env, monkeypatch):
    """Before the fix the close failed with ESTALE (v2 went to lost+found), the bucket kept v1 under the
    new name, and this mount read a mix of both versions there."""
    async def body(env: Env):
        ino = await ino_of(env, "old")
        assert await env.read_all(ino) == V1
        fi = await written(env, "old", V2, rewrite=True)
        await while_put_held(monkeypatch, env, close(env, fi), rename(env, "old", "g"))
        await env.settle()
        assert await gone_here(env, "old") and await gone_there(env, "old")
        assert await stored(env, "g") == V2
        assert await env.cat("g") == V2
        assert lost_and_found(env) == []
        assert env.fs.counters["conflicts"] == 0

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_directory_renamed_while_a_file_in_it_is_uploaded_takes_the_file_along(ops_env, monkeypatch):
    async def body(env: Env):
        fi = await written(env, "d/f", NEW)
        await while_put_held(monkeypatch, env, close(env, fi), rename(env, "d", "e"))
        await env.settle()
        assert await gone_here(env, "d") and await gone_there(env, "d/f") and await gone_there(env, "d/")
        assert await stored(env, "e/f") == NEW
        assert await env.cat("e/f") == NEW

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_file_unlinked_while_its_close_uploads_it_stays_deleted(ops_env, monkeypatch):
    async def body(env: Env):
        fi = await written(env, "f", NEW)
        await while_put_held(monkeypatch, env, close(env, fi), unlink(env, "f"))
        await env.settle()
        assert await gone_here(env, "f") and await gone_there(env, "f")
        assert "f" not in (await env.listdir(ROOT)).names

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_rename_over_a_file_whose_close_uploads_it_replaces_the_new_version(ops_env, monkeypatch):
    """The target's upload ends first: the rename replaces what it stored (no ESTALE for either)."""
    async def body(env: Env):
        src = await written(env, "src", NEW)
        await close(env, src)()
        fi = await written(env, "old", V2, rewrite=True)
        await while_put_held(monkeypatch, env, close(env, fi), rename(env, "src", "old"))
        await env.settle()
        assert await gone_here(env, "src") and await gone_there(env, "src")
        assert await stored(env, "old") == NEW
        assert await env.cat("old") == NEW
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.parametrize("change", ["rename", "unlink"])
def test_write_back_rename_or_unlink_during_the_background_upload_holds(ops_env, monkeypatch, change):
    async def body(env: Env):
        fi = await written(env, "d/f", NEW)
        await close(env, fi)()  # journalled; the uploader starts it in the background

        async def upload() -> None:
            assert env.fs.writeback is not None
            await env.fs.writeback.drain(30)

        op = rename(env, "d", "e") if change == "rename" else unlink(env, "d/f")
        await while_put_held(monkeypatch, env, upload, op)
        await env.fs.writeback.drain(30)  # type: ignore[union-attr]
        await env.settle()
        assert await gone_here(env, "d/f") and await gone_there(env, "d/f")
        if change == "rename":
            assert await stored(env, "e/f") == NEW
            assert await env.cat("e/f") == NEW
        else:
            assert await gone_there(env, "e/f")
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0)


@pytest.mark.expect_log("b/old: not stored, another client changed it meanwhile")
def test_a_close_refused_as_a_conflict_drops_the_kernels_pages_of_its_bytes(ops_env, monkeypatch):
    """Another client's version lands while this mount's put is under way (the watch then only drops
    attributes: the pages were this mount's own writes). The put is refused, the bytes go to lost+found,
    and the inode shows the other version from now on: the kernel must not keep serving the lost+found
    bytes from its pages (a mix of two versions where the sizes differ only in the last page)."""
    async def body(env: Env):
        ino = await ino_of(env, "old")
        fi = await written(env, "old", V2, rewrite=True)
        hold = Held(monkeypatch, env.store, "put_file")
        failed: list[int] = []

        async def close_it() -> None:
            try:
                await env.ops.flush(fi.fh)
            except pyfuse3.FUSEError as e:
                failed.append(errno_of(e))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_it)
            await hold.held.wait()
            await put_object(env.streams, "b", "old", V1 + b"theirs")
            await env.settle()
            env.fs.kernel.sent.clear()
            hold.release()
        await env.ops.release(fi.fh)
        assert failed == [errno.ESTALE]
        assert ("inode", ino, None) in env.fs.kernel.sent
        assert await env.cat("old") == V1 + b"theirs"

    ops_env(body, setup=bucket_b, bucket="b")


async def atomic_save(env: Env, data: bytes) -> None:
    """write a temporary file, fsync, close, rename it over `old` (editors, package managers, git)."""
    fi = await written(env, "old.tmp", data)
    await env.ops.fsync(fi.fh, False)
    await close(env, fi)()
    await rename(env, "old.tmp", "old")()


@pytest.mark.parametrize("write_back", [None, 3600.0])
def test_an_atomic_save_leaves_the_old_version_readable_until_the_new_one_is_stored(ops_env, write_back):
    """In write-back mode the temporary file is not stored yet at the rename: other clients keep reading
    the old version (never ENOENT) until the upload lands, which replaces it (its chunks purged)."""
    async def body(env: Env):
        before = await env.store.get_info("b", "old")
        assert before is not None
        await atomic_save(env, V2)
        assert await env.cat("old") == V2 and await gone_here(env, "old.tmp")
        if write_back is not None:
            assert await stored(env, "old") == V1  # what other clients read meanwhile
            assert env.fs.writeback is not None
            await env.fs.writeback.drain(30)
        assert await stored(env, "old") == V2
        assert await gone_there(env, "old.tmp")
        assert await env.store.chunk_index("b", before.nuid) == []
        assert await env.cat("old") == V2
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b", **({} if write_back is None else {"write_back": write_back}))


def test_a_pending_atomic_save_renamed_on_or_unlinked_takes_the_replaced_object_along(ops_env):
    """Write-back: the saved file, not stored yet, is renamed again (the object it replaces goes with
    its name), its directory is renamed (it still replaces that object, under the new name), or it is
    unlinked (the object goes too)."""
    async def body(env: Env):
        assert env.fs.writeback is not None
        await atomic_save(env, V2)
        await rename(env, "old", "moved")()
        assert await gone_there(env, "old") and await gone_here(env, "old")
        await put_object(env.streams, "b", "d/x", V1)
        await env.settle()
        fi = await written(env, "d/x.tmp", NEW)
        await close(env, fi)()
        await rename(env, "d/x.tmp", "d/x")()
        await rename(env, "d", "e")()
        assert await stored(env, "e/x") == V1
        await put_object(env.streams, "b", "gone", V1)
        await env.settle()
        fi = await written(env, "gone.tmp", NEW)
        await close(env, fi)()
        await rename(env, "gone.tmp", "gone")()
        await unlink(env, "gone")()
        assert await gone_there(env, "gone")
        await env.fs.writeback.drain(30)
        await env.settle()
        assert await stored(env, "moved") == V2 and await env.cat("moved") == V2
        assert await stored(env, "e/x") == NEW and await env.cat("e/x") == NEW
        assert await gone_there(env, "gone") and await gone_here(env, "gone")
        assert await gone_there(env, "old") and await gone_there(env, "d/x")
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b", write_back=3600.0)


def test_a_pending_atomic_save_is_replayed_as_a_replacement(ops_env):
    """The daemon dies after the rename, before the upload: the next mount still replaces the object
    (the journal record says which revision it replaces), nothing goes to lost+found."""
    ms = MemoryStreams()

    async def first(env: Env):
        await atomic_save(env, V2)
        assert await stored(env, "old") == V1

    async def second(env: Env):
        with trio.fail_after(10):
            while await stored(env, "old") != V2:
                await trio.sleep(0.01)
        assert await env.cat("old") == V2
        assert lost_and_found(env) == []

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=3600.0)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)


def test_a_file_renamed_over_an_object_before_its_close_replaces_it_at_the_close(ops_env):
    async def body(env: Env):
        fi = await written(env, "old.tmp", V2)
        await rename(env, "old.tmp", "old")()
        assert await stored(env, "old") == V1 and await env.cat("old") == V2
        await close(env, fi)()
        assert await stored(env, "old") == V2 and await env.cat("old") == V2
        assert await gone_there(env, "old.tmp") and lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.parametrize("write_back", [None, 0.0])
def test_a_setxattr_during_a_files_first_upload_is_stored(ops_env, monkeypatch, write_back):
    """The first upload took its snapshot of the file's xattr changes; one made meanwhile waits for it
    and is then stored on the object (it was dropped: the file was stored, nothing carried it)."""
    async def body(env: Env):
        fi = await written(env, "f", NEW)
        ino = await ino_of(env, "f")

        async def upload() -> None:
            await close(env, fi)()
            if env.fs.writeback is not None:
                await env.fs.writeback.drain(30)

        async def setxattr() -> None:
            await env.ops.setxattr(ino, b"user.k", b"v", Ctx())

        await while_put_held(monkeypatch, env, upload, setxattr)
        await env.settle()
        doc, _ = await env.store.get_meta_doc("b", "f")
        assert doc["metadata"]["k"] == "v"
        assert await env.ops.getxattr(ino, b"user.k", Ctx()) == b"v"
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b", write_back=write_back)


def test_a_pending_atomic_save_renamed_on_leaves_a_version_another_client_wrote_meanwhile(ops_env):
    """The object a pending save replaces is changed by another client, then the save is renamed on:
    the rename holds (it kept failing with ESTALE) and the other client's version stays."""
    async def body(env: Env):
        assert env.fs.writeback is not None
        await atomic_save(env, V2)
        await put_object(env.streams, "b", "old", NEW)  # another client's newer version
        await rename(env, "old", "moved")()
        await env.fs.writeback.drain(30)
        await env.settle()
        assert await stored(env, "old") == NEW
        assert await stored(env, "moved") == V2 and await env.cat("moved") == V2
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b", write_back=3600.0)


def test_an_open_with_truncate_waiting_for_another_handles_close_stages_again(ops_env, monkeypatch):
    """Two writers of one file: B's open(O_TRUNC) waits while A's close uploads, then A's release drops
    the staged file. B truncated the dropped file's closed descriptor: EIO, or, once the number was
    reused by another file's spool file, that file zeroed."""
    async def body(env: Env):
        fi = await written(env, "f", NEW)
        ino = await ino_of(env, "f")
        opened: list[pyfuse3.FileInfo] = []

        async def open_truncating() -> None:
            opened.append(await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx()))

        await while_put_held(monkeypatch, env, close(env, fi), open_truncating)
        assert await env.ops.write(opened[0].fh, 0, b"second") == 6
        await close(env, opened[0])()
        await env.settle()
        assert await stored(env, "f") == b"second" and await env.cat("f") == b"second"
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_create_that_waited_while_its_directory_was_renamed_lands_in_the_renamed_directory(ops_env,
                                                                                             monkeypatch):
    """As on a local disk: the file goes where its directory now is. It was staged under the old path and
    stored there, bringing the old directory back."""
    async def body(env: Env):
        d = await ino_of(env, "d")
        waiting, go = trio.Event(), trio.Event()
        real = env.fs._path_node

        async def held(path: tuple[str, ...]) -> Any:
            if path == ("d",) and not go.is_set():  # the create's look at its parent directory
                waiting.set()
                await go.wait()
            return await real(path)

        created: list[pyfuse3.FileInfo] = []

        async def create() -> None:
            fi, _ = await env.ops.create(d, b"x", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
            created.append(fi)

        async with trio.open_nursery() as nursery:
            monkeypatch.setattr(env.fs, "_path_node", held)
            nursery.start_soon(create)
            await waiting.wait()
            monkeypatch.setattr(env.fs, "_path_node", real)
            await rename(env, "d", "e")()  # the whole rename, while the create waits
            go.set()
        await env.ops.write(created[0].fh, 0, b"new file")
        await close(env, created[0])()
        await env.settle()
        assert await stored(env, "e/x") == b"new file"
        assert await gone_there(env, "d/x") and await gone_here(env, "d")

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_rewrite_opened_while_an_unlink_deletes_the_file_goes_nowhere_without_a_conflict(ops_env, monkeypatch):
    """As on a local disk: the handle was opened on the name the unlink then removed; its writes go
    nowhere and its close returns 0. The close failed with ESTALE (its base was deleted) and its bytes
    went to lost+found."""
    async def body(env: Env):
        ino = await ino_of(env, "old")
        hold = Held(monkeypatch, env.store, "delete")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(unlink(env, "old"))
            await hold.held.wait()  # the unlink is deleting the object
            fi = await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())
            hold.release()
            await env.settle()
            assert await env.ops.write(fi.fh, 0, b"rewritten") == len(b"rewritten")
            await close(env, fi)()
        await env.settle()
        assert await gone_here(env, "old") and await gone_there(env, "old")
        assert lost_and_found(env) == []
        assert env.fs.counters["conflicts"] == 0

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.parametrize("what", ["write", "truncate"])
@pytest.mark.parametrize("rewrite", [False, True])
def test_a_write_does_not_wait_for_a_write_back_upload_stuck_on_an_unreachable_server(ops_env, monkeypatch, caplog,
                                                                                      what, rewrite):
    """The write-back uploader's put holds the file's lock; the server goes away. A write (or truncate)
    of the still open file interrupts that attempt instead of waiting for it to give up (up to its flush
    deadline), and the next close uploads the newest bytes once the server is back."""
    caplog.set_level(logging.INFO, logger="natsfs")
    path = "old" if rewrite else "d/f"
    first, second = (V2, NEW) if what == "write" else (V2, V2[:1000])

    async def body(env: Env):
        assert env.fs.writeback is not None
        fi = await written(env, path, first, rewrite=rewrite)
        hold = Held(monkeypatch, env.store, "put_file")
        await env.ops.flush(fi.fh)  # journalled: the uploader starts its upload (held at its put)
        await hold.held.wait()
        env.streams.go_offline(env.config.request_timeout)
        changed: list[str] = []
        done = trio.Event()

        async def change() -> None:
            if what == "write":
                assert await env.ops.write(fi.fh, 0, second) == len(second)
            else:
                attrs = pyfuse3.EntryAttributes()
                attrs.st_size = len(second)
                await env.ops.setattr(await ino_of(env, path), attrs, Fields(update_size=True), fi.fh, Ctx())
            changed.append(what)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(change)
            # (Not `settle`: a truncate waits for a worker thread, which counts as blocked. The bound
            # only ends a failing run: without the fix the change waits for the release below, or for
            # the attempt's flush deadline.)
            with trio.move_on_after(30):
                await done.wait()
            assert changed == [what]  # done while the put is still held
            hold.release()
        env.streams.go_online()
        await close(env, fi)()
        await env.fs.writeback.drain(30)
        assert await stored(env, path) == second
        assert await env.cat(path) == second
        assert lost_and_found(env) == []
        assert len([r for r in caplog.records if "was interrupted by a change of the file" in r.getMessage()]) == 1

    # (A flush deadline no test reaches: the attempt never gives up by itself.)
    ops_env(body, setup=bucket_b, bucket="b", write_back=0.0, flush_timeout=3600.0)


def test_a_write_queued_behind_a_write_back_upload_that_then_gets_stuck_offline_interrupts_it(ops_env, monkeypatch,
                                                                                                caplog):
    """The write waits for the file's lock while another write holds it and the uploader waits too (the
    file DIRTY: nothing to interrupt yet); the server is gone. The other write ends, the lock goes to the
    uploader (first in line), whose attempt then waits for the unreachable server. The waiting write
    must still interrupt that attempt: it waited for the attempt's flush deadline, as it only looked
    again while the file was UPLOADING when it began to wait."""
    caplog.set_level(logging.INFO, logger="natsfs")
    path = "d/f"
    tail = b"B" * 1000

    async def body(env: Env):
        assert env.fs.writeback is not None
        from natsfs.staging import StagedFile, WriteState

        fi = await written(env, path, V2)
        await env.ops.flush(fi.fh)  # journalled; its upload is due only much later
        sf = env.fs.staging.get((await env.lookup(path)).st_ino)
        assert sf is not None
        hold_write = Held(monkeypatch, StagedFile, "write")
        hold_put = Held(monkeypatch, env.store, "put_file")
        done: list[str] = []

        async def waiting_for(sf: StagedFile, tasks: int) -> None:
            while sf.lock.statistics().tasks_waiting < tasks:
                await trio.sleep(0.01)

        async def write(what: str, data: bytes) -> None:
            assert await env.ops.write(fi.fh, 0, data) == len(data)
            done.append(what)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, "first", NEW)
            await hold_write.held.wait()  # the first write holds the file's lock
            env.fs.writeback.schedule(sf, 0.0)
            await waiting_for(sf, 1)  # the uploader waits for the lock (after the burst pause), the file DIRTY
            assert sf.state is WriteState.DIRTY
            env.streams.go_offline(3600.0)  # (the attempt never gives up by itself)
            nursery.start_soon(write, "second", tail)
            await waiting_for(sf, 2)  # the second write waits for the lock, behind the uploader
            hold_write.release()
            await hold_put.held.wait()  # the uploader has the lock: its attempt waits (for the server)
            with trio.move_on_after(30):  # (only ends a failing run)
                while "second" not in done:
                    await trio.sleep(0.05)
            assert done == ["first", "second"]  # not held until the attempt's flush deadline
            hold_put.release()
        env.streams.go_online()
        await close(env, fi)()
        await env.fs.writeback.drain(30)
        assert await stored(env, path) == tail + NEW[len(tail):]
        assert lost_and_found(env) == []
        assert len([r for r in caplog.records if "was interrupted by a change of the file" in r.getMessage()]) == 1

    ops_env(body, setup=bucket_b, bucket="b", write_back=3600.0, flush_timeout=3600.0)


def test_an_o_creat_open_of_a_file_unlinked_while_it_opens_creates_the_file(ops_env, monkeypatch):
    """open(O_CREAT) of an existing name opens that file; unlinked while the open awaited, the name is
    free and the file is created, as on a local disk. The open of the unlinked (detached) inode answers
    ESTALE now (the kernel walks the path again), and create took that for its answer: ESTALE instead
    of a new file."""
    async def body(env: Env):
        reached, go = trio.Event(), trio.Event()
        real_open = env.fs.open

        async def held_open(*args: Any, **kwargs: Any) -> Any:
            reached.set()
            await go.wait()
            return await real_open(*args, **kwargs)

        monkeypatch.setattr(env.fs, "open", held_open)
        created: list[pyfuse3.FileInfo] = []

        async def create() -> None:
            fi, _ = await env.ops.create(ROOT, b"old", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
            created.append(fi)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(create)
            await reached.wait()  # create found "old" and opens it
            await unlink(env, "old")()
            go.set()
        assert await env.ops.write(created[0].fh, 0, b"created anew") == len(b"created anew")
        await close(env, created[0])()
        assert await stored(env, "old") == b"created anew"
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


async def held_replacement(env: Env, monkeypatch: pytest.MonkeyPatch, change: str
                           ) -> tuple[Held, Callable[[], Awaitable[None]]]:
    """A change of `old` by this mount ("rename over": an atomic save of V2; "unlink"), to be run, held
    at its rename or delete of the stored object until the hold is released."""
    if change == "rename over":
        await close(env, await written(env, "old.tmp", V2))()
        return Held(monkeypatch, env.fs.mut, "rename_object"), rename(env, "old.tmp", "old")
    return Held(monkeypatch, env.fs.mut, "delete"), unlink(env, "old")


@pytest.mark.parametrize("change", ["rename over", "unlink"])
def test_the_last_close_of_a_file_while_a_change_here_replaces_it_leaves_no_chunks_behind(
        ops_env, monkeypatch, change):
    """A reader's handle holds `old` when an atomic save renames over it (or an unlink deletes it): the
    replaced version's chunks are kept for that handle. Its last close lands while the rename or delete
    is stored: the chunks are purged once that is done (they were left behind for good, a leak of one
    version per such save)."""
    async def body(env: Env):
        before = await env.store.get_info("b", "old")
        assert before is not None
        reader = await env.ops.open(await ino_of(env, "old"), os.O_RDONLY, Ctx())
        hold, act = await held_replacement(env, monkeypatch, change)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(act)
            await hold.held.wait()
            await env.ops.release(reader.fh)  # the last close, while the change is under way
            hold.release()
        await env.settle()
        assert await env.store.chunk_index("b", before.nuid) == []
        if change == "rename over":
            assert await stored(env, "old") == V2
        else:
            assert await gone_there(env, "old")

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.parametrize("change", ["rename over", "unlink"])
def test_an_open_while_a_change_here_replaces_the_file_opens_what_the_name_shows_after_it(
        ops_env, monkeypatch, change):
    """An open of `old` (through the inode the kernel's cached name gives) arrives while this mount's
    unlink deletes it (or a rename replaces it), and reads a whole version as a local disk would: the
    unlinked one (opened before its name went), or the renamed file (a rename is waited for). Its
    chunks are purged at the close. The unlink counted the handles open before its delete awaited, not
    one registered meanwhile: that handle's version was purged under it, and its reads failed ESTALE
    ("chunks of version ... are gone")."""
    async def body(env: Env):
        before = await env.store.get_info("b", "old")
        assert before is not None
        old_ino = await ino_of(env, "old")
        hold, act = await held_replacement(env, monkeypatch, change)
        opened: list[pyfuse3.FileInfo | int] = []

        async def open_it() -> None:
            try:
                try:
                    opened.append(await env.ops.open(old_ino, os.O_RDONLY, Ctx()))
                except pyfuse3.FUSEError as e:
                    if errno_of(e) != errno.ESTALE:
                        raise
                    # (as the kernel does: it walks the path "old" again and retries the open once)
                    opened.append(await env.ops.open(await ino_of(env, "old"), os.O_RDONLY, Ctx()))
            except pyfuse3.FUSEError as e:
                opened.append(errno_of(e))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(act)
            await hold.held.wait()
            nursery.start_soon(open_it)
            await env.settle()  # the open runs as far as it can while the change is held
            hold.release()
        assert len(opened) == 1
        fi = opened[0]
        assert isinstance(fi, pyfuse3.FileInfo)  # (ESTALE or ENOENT would show here as an errno)
        data, off = b"", 0
        while piece := await env.ops.read(fi.fh, off, 128 * 1024):
            data += piece
            off += len(piece)
        await env.ops.release(fi.fh)
        # The unlinked version (opened before the name went), or the file renamed over it.
        assert data == (V1 if change == "unlink" else V2)
        await env.settle()
        assert await env.store.chunk_index("b", before.nuid) == []

    ops_env(body, setup=bucket_b, bucket="b")
