"""Opens with O_TRUNC and truncates of one file racing another handle's last close, or each other, on
one mount, behave as on a local disk: each succeeds, the last bytes written are stored, nothing goes to
lost+found. The truncate is held right at the staged file's truncate (`Held`) while the other operation
runs; the staged file was dropped under it (its descriptor closed: EBADF, or `IllegalTransition
discarded -> dirty`)."""

from __future__ import annotations

import os

import pyfuse3
import pytest
import trio
from opskit import Env, Fields
from test_ops_coherence import Held
from test_ops_upload_races import NEW, bucket_b, close, ino_of, lost_and_found, written
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
