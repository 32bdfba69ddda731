"""`open(O_CREAT|O_TRUNC)` of a name that this mount unlinks meanwhile (writers rewriting a file while
another process removes it): as on a local disk, the open succeeds, opening the file the name showed or
creating a fresh one, and its handle is usable. Each race is forced with a hold (`HeldWhen`) or by
sending the kernel's requests in the order that loses it.

The kernel's side of such an open: its walk finds the name cached (inode `I`), the permission check of
`default_permissions` asks GETATTR(I) when the attributes it caches are stale (after every write or
`O_TRUNC` open they are), then it sends OPEN(I); an OPEN answered `ESTALE` makes it walk the path again
(LOOKUP) and retry: OPEN of what the name shows, or CREATE if it shows nothing."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import pyfuse3
import pytest
import trio
from opskit import ROOT, Env, errno_of
from test_ops_changes_in_renamed_dirs import HeldWhen
from test_ops_upload_races import V1, bucket_b, close, gone_there, ino_of, lost_and_found, unlink
from test_ops_write import Ctx, stored

from natsfs.errors import Stale

WRITTEN = b"written after the race"


async def fuse_errno(coro: Any) -> int | None:
    try:
        await coro
    except pyfuse3.FUSEError as e:
        return errno_of(e)
    return None


async def open_creat_trunc_after_the_walk(env: Env, ino: int) -> pyfuse3.FileInfo:
    """The rest of the kernel's `open("old", O_WRONLY|O_CREAT|O_TRUNC)` whose walk reached inode `ino`:
    GETATTR (permission check), OPEN; on ESTALE, the walk again and OPEN or CREATE of what it finds."""
    attrs = await env.ops.getattr(ino, None)  # ENOENT here fails the open(2): the defect
    assert attrs.st_ino == ino
    try:
        return await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())
    except pyfuse3.FUSEError as e:
        assert errno_of(e) == errno.ESTALE
    try:
        again = await env.lookup("old")
    except pyfuse3.FUSEError as e:
        assert errno_of(e) == errno.ENOENT
        fi, _ = await env.ops.create(ROOT, b"old", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, Ctx())
        return fi
    return await env.ops.open(again.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())


async def writes_through_an_open_creat_trunc_after_the_walk(env: Env, ino: int) -> None:
    """That open (`open_creat_trunc_after_the_walk`), a write and a close store the written bytes as
    "old", with nothing in lost+found."""
    fi = await open_creat_trunc_after_the_walk(env, ino)
    assert await env.ops.write(fi.fh, 0, WRITTEN) == len(WRITTEN)
    await close(env, fi)()
    assert await stored(env, "old") == WRITTEN
    assert lost_and_found(env) == []


def test_an_open_creat_trunc_whose_walk_reached_a_file_unlinked_here_since_creates_it(ops_env):
    """The unlink ends between the open's walk and its permission check: the GETATTR of the unlinked
    inode shows the file it was, with no link (as on a local disk), so the open goes on, is refused
    ESTALE, and the kernel's second walk creates the file. GETATTR answered ENOENT, which failed the
    open(2) (about 0.3 % of such opens racing an unlinker)."""
    async def body(env: Env) -> None:
        ino = await ino_of(env, "old")
        await unlink(env, "old")()
        attrs = await env.ops.getattr(ino, None)
        assert (attrs.st_nlink, attrs.st_size) == (0, len(V1))
        await writes_through_an_open_creat_trunc_after_the_walk(env, ino)

    ops_env(body, setup=bucket_b, bucket="b")


def test_an_open_creat_trunc_whose_permission_check_lands_while_an_unlink_here_ends_creates_it(
        ops_env, monkeypatch):
    """The GETATTR of the open's permission check arrives while this mount's unlink of the file is
    finishing (its tombstone is in the index, its old version's chunks are being purged, its inode still
    has the name): it shows the file with no link, and the open goes on (and creates the file, which the
    unlink then removes: the two overlap). It was ENOENT."""
    async def body(env: Env) -> None:
        ino = await ino_of(env, "old")
        purging = HeldWhen(monkeypatch, env.fs.mut, "purge_unused", lambda *_: True)
        opened: list[pyfuse3.FileInfo] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(unlink(env, "old"))
            await purging.held.wait()
            opened.append(await open_creat_trunc_after_the_walk(env, ino))
            purging.release()
        assert await env.ops.write(opened[0].fh, 0, WRITTEN) == len(WRITTEN)
        await close(env, opened[0])()
        # The file was created before the unlink returned, which then removed it (the two overlap: as
        # if the create came first); the mount and the bucket agree.
        assert await fuse_errno(env.lookup("old")) == errno.ENOENT
        assert await gone_there(env, "old")
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_create_that_keeps_losing_its_race_gives_up_with_estale_and_one_log_line(ops_env, monkeypatch, caplog):
    """Each time the create opens the existing name, it was unlinked (or created again) meanwhile: it
    starts again at most CREATE_ATTEMPTS times, then answers ESTALE with one warning. It recursed
    without bound (a RecursionError, EIO and a traceback)."""
    async def body(env: Env) -> None:
        await ino_of(env, "old")
        attempts = 0

        async def always_stale(*args: Any, **kwargs: Any) -> Any:
            nonlocal attempts
            attempts += 1
            raise Stale("inode was deleted while it was opened", log_level=logging.DEBUG)

        monkeypatch.setattr(env.fs, "open", always_stale)
        for _ in range(2):
            assert await fuse_errno(env.ops.create(ROOT, b"old", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())) \
                == errno.ESTALE
        assert attempts == 2 * 16

    caplog.set_level(logging.DEBUG)
    ops_env(body, setup=bucket_b, bucket="b")
    gave_up = [r for r in caplog.records if "create gave up" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in gave_up] == [
        (logging.WARNING, "create: old: create gave up after 16 attempts: each time, the name was deleted, "
                          "created again or moved while it was opened")]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]



def test_an_o_trunc_open_that_resolved_a_file_unlinked_here_before_it_registered_is_refused_estale(
        ops_env, monkeypatch):
    """An `O_TRUNC` open resolves the file, then awaits (its bucket's writability) while this mount's
    unlink deletes it, detaches its inode and purges its version (no handle was open). The open must not
    register on that inode: refused ESTALE, the kernel walks the path again and creates the file. It
    registered, staging a file that no unlink had seen: its close stored it over the name as a conflict
    (ESTALE, bytes in lost+found), and a write after another handle's close read the purged version (EIO)."""
    async def body(env: Env) -> None:
        ino = await ino_of(env, "old")
        before = await env.store.get_info("b", "old")
        assert before is not None
        opening = HeldWhen(monkeypatch, env.fs.mut, "check_writable", lambda *_: True)
        answers: list[int | None] = []

        async def open_it() -> None:
            answers.append(await fuse_errno(env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_it)
            await opening.held.wait()
            await unlink(env, "old")()
            assert await env.store.chunk_index("b", before.nuid) == []  # nothing held it: purged
            opening.release()
        assert answers == [errno.ESTALE]
        await writes_through_an_open_creat_trunc_after_the_walk(env, ino)

    ops_env(body, setup=bucket_b, bucket="b")


def test_an_o_trunc_open_of_a_file_unlinked_here_while_its_last_close_ends_is_refused_estale(
        ops_env, monkeypatch):
    """A writer's file (stored by its flush) is unlinked here while it is open; its last close purges the
    kept version. An `O_TRUNC` open of the inode (its walk found the name before the unlink) arrives while
    that purge awaits: refused ESTALE (nothing keeps the file any more), and the kernel's second walk
    creates the file. It registered on the staged file that close was dropping: the close dropped it
    under the new handle, whose write then re-staged from the purged version (EIO); and a staged file
    that no unlink had seen was stored over the name at its close, as a conflict (ESTALE, bytes in
    lost+found): about one close per minute with 2 writers, a truncater and an unlinker."""
    async def body(env: Env) -> None:
        first, _ = await env.ops.create(ROOT, b"new", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        assert await env.ops.write(first.fh, 0, b"first writer") == len(b"first writer")
        await env.ops.flush(first.fh)  # stored
        ino = await ino_of(env, "new")
        await unlink(env, "new")()
        purging = HeldWhen(monkeypatch, env.fs.mut, "purge_unused", lambda *_: True)
        answers: list[int | None] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(env.ops.release, first.fh)  # the last close
            await purging.held.wait()
            answers.append(await fuse_errno(env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())))
            purging.release()
        assert answers == [errno.ESTALE]
        fi, _ = await env.ops.create(ROOT, b"new", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, Ctx())
        assert await env.ops.write(fi.fh, 0, WRITTEN) == len(WRITTEN)
        await close(env, fi)()
        assert await stored(env, "new") == WRITTEN
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


async def limit_stream(env: Env, **limits: Any) -> None:
    """Change the bucket's stream config as another client would (max_bytes, discard, max_msg_size)."""
    info = await env.streams.stream_info("OBJ_b")
    await env.streams.update_stream({**info.config, **limits})


@pytest.mark.expect_log(r"closed without a successful upload .*maximum bytes exceeded")
def test_a_new_file_whose_first_close_was_refused_can_be_created_again_through_the_entry_the_kernel_kept(
        ops_env):
    """`big` is created and written; its close is refused (the stream is full, discard new) and its
    release gives the bytes to lost+found: the name shows nothing. The kernel still caches the name's
    entry for the file's inode (its create made it), so the next `open("big", O_CREAT|O_TRUNC)` reaches
    that inode: its GETATTR answered ENOENT, which failed the open(2) until the entry expired. Now the
    inode shows the file it was with no link, the OPEN is refused ESTALE, and the kernel's walk again
    creates the file (a new inode), whose bytes are stored; and the kernel is told to drop the entry."""
    async def body(env: Env) -> None:
        await limit_stream(env, max_bytes=4096, discard="new")
        fi, attrs = await env.ops.create(ROOT, b"big", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, Ctx())
        ino = attrs.st_ino
        assert await env.ops.write(fi.fh, 0, b"x" * 20_000) == 20_000
        assert await fuse_errno(env.ops.flush(fi.fh)) == errno.ENOSPC
        env.fs.kernel.sent.clear()
        await env.ops.release(fi.fh)
        assert len(lost_and_found(env)) == 1
        assert ("entry", ROOT, b"big") in env.fs.kernel.sent  # the name's entry goes (queued)
        await limit_stream(env, max_bytes=-1)

        # Before that invalidation lands: the kernel's open through the entry it kept.
        got = await env.ops.getattr(ino, None)
        assert (got.st_nlink, got.st_size) == (0, 20_000)
        assert await fuse_errno(env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())) == errno.ESTALE
        fi = await open_creat_trunc_after_the_walk_of(env, "big", ino)
        assert await env.ops.write(fi.fh, 0, WRITTEN) == len(WRITTEN)
        await close(env, fi)()
        assert await stored(env, "big") == WRITTEN
        again = await env.lookup("big")
        assert again.st_ino != ino and again.st_size == len(WRITTEN)

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.expect_log(r"closed without a successful upload .*maximum bytes exceeded")
def test_a_new_file_given_up_after_a_rename_over_an_object_leaves_that_object_shown(ops_env):
    """The same refusal for a new file renamed over "old" before its first close: "old" still shows
    the object the rename was to replace (the refused upload never replaced it), also to an open
    through the entry the kernel kept for the given-up file (refused ESTALE, it walks again to it)."""
    async def body(env: Env) -> None:
        fi, attrs = await env.ops.create(ROOT, b"new", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, Ctx())
        assert await env.ops.write(fi.fh, 0, b"x" * 20_000) == 20_000
        await env.ops.rename(ROOT, b"new", ROOT, b"old", 0, Ctx())
        # (room for what the stream holds: a limit below it would drop "old"'s version at once)
        held = (await env.streams.stream_info("OBJ_b")).bytes
        await limit_stream(env, max_bytes=held + 4096, discard="new")
        assert await fuse_errno(env.ops.flush(fi.fh)) == errno.ENOSPC
        await env.ops.release(fi.fh)
        assert await fuse_errno(env.ops.open(attrs.st_ino, os.O_RDONLY, Ctx())) == errno.ESTALE
        fi = await env.ops.open((await env.lookup("old")).st_ino, os.O_RDONLY, Ctx())
        try:
            assert await env.ops.read(fi.fh, 0, 1 << 20) == V1
        finally:
            await env.ops.release(fi.fh)
        assert await env.cat("old") == V1

    ops_env(body, setup=bucket_b, bucket="b")


async def open_creat_trunc_after_the_walk_of(env: Env, name: str, ino: int) -> pyfuse3.FileInfo:
    """`open_creat_trunc_after_the_walk` of another name."""
    await env.ops.getattr(ino, None)
    try:
        return await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())
    except pyfuse3.FUSEError as e:
        assert errno_of(e) == errno.ESTALE
    try:
        again = await env.lookup(name)
    except pyfuse3.FUSEError as e:
        assert errno_of(e) == errno.ENOENT
        fi, _ = await env.ops.create(ROOT, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, Ctx())
        return fi
    return await env.ops.open(again.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
