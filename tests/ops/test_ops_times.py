"""Times set with utimensat are kept as set: the epoch (0) is a time like any other, times before 1970 are
negative nanoseconds, and a time beyond what the mount can hold (signed 64-bit nanoseconds) is clamped to
the nearest end, never replaced by "now" (see SEMANTICS, *Attributes*)."""

from __future__ import annotations

import logging
import os

import pyfuse3
import pytest
from gowriters import put_object
from opskit import CTX, ROOT, Env, Fields

from natsfs.adr20 import MAX_TIME_NS, MIN_TIME_NS, ObjectStore
from natsfs.memstreams import MemoryStreams

MOON_LANDING_NS = -14_182_940 * 10**9  # 1969-07-20 20:17:40 UTC
Y2001_NS = 978_307_200 * 10**9


async def a_file_and_a_dir(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "f", b"x")
    await put_object(ms, "b", "d/", b"")


async def utime(env: Env, ino: int, mtime_ns: int, fh: int | None = None) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_mtime_ns = mtime_ns
    await env.ops.setattr(ino, attr, Fields(update_mtime=True), fh, CTX)


async def stored_mtime(env: Env, name: str) -> str | None:
    doc, _ = await env.store.get_meta_doc("b", name)
    return (doc.get("metadata") or {}).get("natsfs.mtime_ns")


def shown_after_remount(ops_env, ms: MemoryStreams, path: str) -> int:
    async def body(env: Env) -> int:
        return (await env.lookup(path)).st_mtime_ns

    return ops_env(body, streams=ms)


@pytest.mark.parametrize(("set_ns", "kept_ns"), [
    (0, 0), (1, 1), (-1, -1), (MOON_LANDING_NS, MOON_LANDING_NS),
    (2**40 * 10**9, MAX_TIME_NS), (-(2**40) * 10**9, MIN_TIME_NS)],
    ids=["epoch", "1ns", "-1ns", "1969", "beyond-2262", "before-1677"])
@pytest.mark.parametrize("path", ["b/f", "b/d"])
def test_a_time_set_is_shown_stored_and_shown_again_after_a_remount(ops_env, caplog, path, set_ns, kept_ns):
    """`touch -d @0`, `touch -d 1969-07-20`, and times past what 64-bit nanoseconds hold (clamped, as the
    kernel clamps for a local filesystem), on a file and on a directory: shown at once, stored as
    natsfs.mtime_ns, shown again by a new mount, and no "unusable" warning (the epoch showed as the
    mount's start time; a negative time showed as now and was stored as a value the mount then ignored,
    losing the time set before)."""
    ms = MemoryStreams()
    name = "f" if path == "b/f" else "d/"

    async def body(env: Env) -> None:
        ino = (await env.lookup(path)).st_ino
        await utime(env, ino, Y2001_NS)
        await utime(env, ino, set_ns)
        assert (await env.ops.getattr(ino, None)).st_mtime_ns == kept_ns
        await env.settle()
        assert await stored_mtime(env, name) == str(kept_ns)
        assert (await env.lookup(path)).st_mtime_ns == kept_ns

    with caplog.at_level(logging.WARNING):
        ops_env(body, setup=a_file_and_a_dir, streams=ms)
        assert shown_after_remount(ops_env, ms, path) == kept_ns
    assert not [r for r in caplog.records if "unusable" in r.getMessage()]


def test_the_epoch_set_on_a_file_open_for_writing_is_kept_by_its_close(ops_env):
    """A file being written (staged) whose time is set to 0 before its close: the close stores "0" and
    it shows 0 (staging took 0 for "unset" and stored the time of the close)."""
    async def body(env: Env) -> None:
        fi, attr = await env.ops.create(ROOT, b"new", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        await env.ops.write(fi.fh, 0, b"data")
        await utime(env, attr.st_ino, 0, fi.fh)
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert await stored_mtime(env, "new") == "0"
        assert (await env.lookup("new")).st_mtime_ns == 0

    ops_env(body, setup=lambda ms, store: store.create_bucket("b"), bucket="b")
