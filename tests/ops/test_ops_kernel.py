"""What the filesystem core asks the kernel to forget (no kernel: the notifier only records it):
nothing this mount is changing itself, everything another client changes."""

from __future__ import annotations

import os

import trio
from gowriters import put_object
from opskit import ROOT, Ctx, Env

from natsfs.adr20 import ObjectStore
from natsfs.core.filesystem import Caller
from natsfs.inodes import InodeNo
from natsfs.memstreams import MemoryStreams


async def files(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    for i in range(20):
        await put_object(ms, "b", f"dir/f{i:02d}", b"x")
    await put_object(ms, "b", "other.txt", b"one")


def test_own_changes_are_not_invalidated_others_are(ops_env):
    async def body(env: Env) -> None:
        await env.settle()
        d = (await env.lookup("dir")).st_ino
        for i in range(20):
            await env.ops.lookup(d, f"f{i:02d}".encode(), None)
        other = (await env.lookup("other.txt")).st_ino
        env.fs.kernel.sent.clear()
        # This mount renames a directory: the kernel learns it from our answer.
        await env.ops.rename(ROOT, b"dir", ROOT, b"moved", 0, Ctx())
        await env.settle()
        assert env.fs.kernel.sent == []
        # Another client replaces a file: its entry, attributes and pages go.
        await put_object(env.streams, "b", "other.txt", b"two")
        await env.settle()
        assert ("entry", ROOT, b"other.txt") in env.fs.kernel.sent
        assert ("inode", other, None) in env.fs.kernel.sent

    ops_env(body, setup=files, bucket="b")


def test_two_concurrent_flushes_each_get_their_own_invalidation(ops_env):
    """Through the core (no FUSE adapter): each file's own upload refreshes only its attributes (the
    kernel's pages hold exactly what was written), even while another file's flush runs at the same
    time. (A single "own upload" slot let the second flush overwrite the first's: a full invalidation.)"""

    async def body(env: Env) -> None:
        await env.settle()
        handles = {}
        for name in ("one.txt", "two.txt"):
            opened, attrs = await env.fs.create(InodeNo(ROOT), name.encode(), 0o644, os.O_WRONLY, Caller(1000, 1000))
            await env.fs.write(opened.fh, 0, name.encode() * 1000)
            handles[attrs.ino] = opened.fh
        env.fs.kernel.sent.clear()
        async with trio.open_nursery() as nursery:
            for fh in handles.values():
                nursery.start_soon(env.fs.flush, fh)
        await env.settle()
        for ino, fh in handles.items():
            assert ("attr", ino, None) in env.fs.kernel.sent
            assert ("inode", ino, None) not in env.fs.kernel.sent  # its pages stay
            await env.fs.release(fh)
        assert await env.cat("one.txt") == b"one.txt" * 1000
        assert await env.cat("two.txt") == b"two.txt" * 1000

    ops_env(body, setup=files, bucket="b")


def test_the_fast_tier_sees_other_clients_changes_without_asking(ops_env):
    """The bucket watch runs in the ops tier: another client's new file and replaced file reach the
    index (listing, size) and the kernel invalidations without any call that would reload them."""

    async def body(env: Env) -> None:
        await env.settle()
        other = (await env.lookup("other.txt")).st_ino
        assert (await env.listdir(ROOT)).names == ["dir", "other.txt"]
        env.fs.kernel.sent.clear()
        await put_object(env.streams, "b", "new.txt", b"fresh")
        await put_object(env.streams, "b", "other.txt", b"replaced!")
        await env.settle()
        assert ("entry", ROOT, b"new.txt") in env.fs.kernel.sent
        assert ("inode", other, None) in env.fs.kernel.sent
        index = env.ns.loaded_index("b")
        assert index is not None and index.objects["new.txt"].size == 5 and index.objects["other.txt"].size == 9
        assert (await env.ops.getattr(other, None)).st_size == 9
        assert await env.cat("new.txt") == b"fresh"

    ops_env(body, setup=files, bucket="b")


def test_without_a_running_notifier_the_kernel_keeps_names_and_attributes_briefly(ops_env):
    """Between a notifier's death and its restart (or after restarts failed), nothing can tell the kernel
    of another client's change: what it caches from then on expires within `DEGRADED_TIMEOUT`."""
    from natsfs.kernel import DEGRADED_TIMEOUT

    async def body(env: Env) -> None:
        await env.settle()
        healthy = await env.lookup("other.txt")
        assert healthy.entry_timeout == healthy.attr_timeout == 60
        env.fs.kernel.attached = True  # attached, no child running: degraded
        assert env.fs.kernel.degraded
        down = await env.lookup("other.txt")
        assert down.entry_timeout == down.attr_timeout == DEGRADED_TIMEOUT
        env.fs.kernel.running = True  # a new child runs
        assert (await env.lookup("other.txt")).entry_timeout == 60

    ops_env(body, setup=files, bucket="b")
