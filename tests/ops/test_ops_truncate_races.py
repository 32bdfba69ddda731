"""Opens with O_TRUNC and truncates of one file racing another handle's last close, or each other, on
one mount, behave as on a local disk: each succeeds, the last bytes written are stored, nothing goes to
lost+found. The truncate is held right at the staged file's truncate (`Held`) while the other operation
runs; the staged file was dropped under it (its descriptor closed: EBADF, or `IllegalTransition
discarded -> dirty`)."""

from __future__ import annotations

import errno
import os

import pyfuse3
import pytest
import trio
from opskit import ROOT, Env, Fields, errno_of
from test_ops_coherence import Held
from test_ops_upload_races import NEW, bucket_b, close, ino_of, lost_and_found, unlink, written
from test_ops_write import Ctx, stored

from natsfs.staging import StagedFile


async def truncated(env: Env, path: str, size: int) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_size = size
    await env.ops.setattr(await ino_of(env, path), attr, Fields(update_size=True), None, Ctx())


@pytest.mark.parametrize("truncating", ["open O_TRUNC", "truncate"])
def test_a_truncate_while_another_handles_last_close_lands_is_stored(ops_env, monkeypatch, truncating):
    """Writer A closes (stored) and B truncates the file; A's last release lands while B's truncate of the
    staged file runs (B's handle is not registered yet): the file stays B's."""
    async def body(env: Env):
        first = await written(env, "f", NEW)
        await env.ops.flush(first.fh)  # stored
        ino = await ino_of(env, "f")
        opened: list[pyfuse3.FileInfo] = []
        hold = Held(monkeypatch, StagedFile, "truncate")

        async def truncate() -> None:
            if truncating == "open O_TRUNC":
                opened.append(await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx()))
            else:
                await truncated(env, "f", 3)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(truncate)
            await hold.held.wait()
            await env.ops.release(first.fh)  # the last close, while the truncate runs
            hold.release()
        if truncating == "open O_TRUNC":
            assert await env.ops.write(opened[0].fh, 0, b"second") == 6
            await close(env, opened[0])()
            expected = b"second"
        else:
            expected = NEW[:3]
        await env.settle()
        assert await stored(env, "f") == expected and await env.cat("f") == expected
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


def test_two_truncates_of_a_file_no_handle_has_open_both_apply(ops_env, monkeypatch):
    """truncate(2) T1 stores the file and drops it while T2 waits for the staged file's lock: T2 stages
    it again and stores its size."""
    async def body(env: Env):
        await close(env, await written(env, "f", NEW))()
        hold = Held(monkeypatch, env.store, "put_file")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(truncated, env, "f", 5)
            await hold.held.wait()  # T1 stores, holding the staged file's lock
            nursery.start_soon(truncated, env, "f", 2)
            await env.settle()  # T2 waits for that lock
            hold.release()
        await env.settle()
        assert await stored(env, "f") == NEW[:2] and await env.cat("f") == NEW[:2]
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


def test_an_open_of_a_file_deleted_after_the_kernel_reached_it_answers_estale(ops_env):
    """The kernel's walk reached `old` through a cached name, then an unlink (of this mount) deleted it
    before the OPEN came: ESTALE, so the kernel walks again and `open(O_CREAT)` (an OPEN carries no
    O_CREAT) creates the file. ENOENT reached the program, where a local disk creates."""
    async def body(env: Env):
        ino = await ino_of(env, "old")
        await unlink(env, "old")()
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        assert errno_of(raised.value) == errno.ESTALE
        # The kernel's retry: its walk finds no name, and creates it.
        fi, _ = await env.ops.create(ROOT, b"old", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"anew")
        await close(env, fi)()
        assert await stored(env, "old") == b"anew"

    ops_env(body, setup=bucket_b, bucket="b")


def test_an_o_creat_open_of_a_file_unlinked_and_created_again_while_it_opens_opens_the_new_file(
        ops_env, monkeypatch):
    """open(O_CREAT|O_TRUNC) found `old`; while it opened it, another writer unlinked it and created it
    again: the open opens that new file (as on a local disk), where it answered ENOENT."""
    async def body(env: Env):
        hold = Held(monkeypatch, env.fs, "open")
        created: list[pyfuse3.FileInfo] = []

        async def create() -> None:
            fi, _ = await env.ops.create(ROOT, b"old", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, Ctx())
            created.append(fi)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(create)
            await hold.held.wait()  # create found "old" and opens it
            await unlink(env, "old")()
            other = await written(env, "old", b"other writer")
            hold.release()
        await close(env, other)()
        assert await env.ops.write(created[0].fh, 0, b"mine") == 4
        await close(env, created[0])()
        assert await stored(env, "old") == b"mine"
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_truncate_between_a_writers_flush_and_its_release_is_stored(ops_env):
    """close(2) of the last writer is a flush (stored), then a release; a truncate(2) in between left the
    file to that release, which took the unstored bytes for a failed store: lost+found."""
    async def body(env: Env):
        fi = await written(env, "f", NEW)
        await env.ops.flush(fi.fh)
        await truncated(env, "f", 3)
        await env.ops.release(fi.fh)
        await env.settle()
        assert await stored(env, "f") == NEW[:3] and await env.cat("f") == NEW[:3]
        assert lost_and_found(env) == []

    ops_env(body, setup=bucket_b, bucket="b")
