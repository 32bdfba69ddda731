"""What the filesystem core asks the kernel to forget (no kernel: the notifier only records it):
nothing this mount is changing itself, everything another client changes."""

from __future__ import annotations

import errno
import os

import pyfuse3
import trio
import trio.testing
from gowriters import delete_object, put_object
from opskit import ROOT, Ctx, Env, Fields

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


def test_own_new_entries_and_their_echoes_keep_their_names(ops_env):
    """This mount's mkdir, a file it closes and the directory times it stores later never drop the
    kernel's entry for those names: the invalidation of a directory's entry unhashes it, and a process
    that had done mkdir D; chdir D got ENOENT from getcwd (git init: "unable to get current working
    directory"). Only attributes go."""

    async def body(env: Env) -> None:
        await env.settle()
        env.fs.kernel.sent.clear()
        top = await env.ops.mkdir(ROOT, b"D", 0o755, Ctx())
        sub = await env.ops.mkdir(top.st_ino, b"E", 0o755, Ctx())
        opened, attrs = await env.fs.create(InodeNo(top.st_ino), b"f", 0o644, os.O_WRONLY, Caller(1000, 1000))
        await env.fs.write(opened.fh, 0, b"written here")
        await env.fs.flush(opened.fh)
        await env.fs.release(opened.fh)
        # An empty directory's marker rewritten (a chmod here): reported as the directory going and
        # coming back within one update.
        empty = await env.ops.mkdir(ROOT, b"empty", 0o755, Ctx())
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = 0o700
        await env.ops.setattr(empty.st_ino, attr, Fields(update_mode=True), None, Ctx())
        await trio.sleep(30)  # (the directory times are stored; the watch brings every meta back)
        await env.settle()
        index = env.ns.loaded_index("b")
        assert index is not None
        marker = index.objects["D/"]
        assert marker.attrs is not None and marker.attrs.mtime_ns  # D's time was stored: a change reported
        entries = [item for item in env.fs.kernel.sent if item[0] == "entry"]
        assert entries == []
        assert ("inode", top.st_ino, None) in env.fs.kernel.sent  # its attributes (times) were dropped
        assert ("attr", attrs.ino, None) in env.fs.kernel.sent
        assert ("inode", sub.st_ino, None) not in env.fs.kernel.sent
        assert ("inode", empty.st_ino, None) in env.fs.kernel.sent
        assert await env.cat("D/f") == b"written here"

    ops_env(body, setup=files, bucket="b", clock=trio.testing.MockClock(autojump_threshold=0))


def test_another_clients_directory_change_keeps_its_entry_a_change_of_kind_drops_it(ops_env):
    """Another client's marker on a directory the kernel holds (same directory, new attributes) drops
    only its attributes; a directory that becomes a file, or goes away, loses its entry too."""

    async def body(env: Env) -> None:
        await env.settle()
        d = (await env.lookup("dir")).st_ino
        await put_object(env.streams, "b", "solo/x", b"x")
        await put_object(env.streams, "b", "gone/x", b"x")
        await env.settle()
        solo = (await env.lookup("solo")).st_ino
        gone = (await env.lookup("gone")).st_ino
        env.fs.kernel.sent.clear()
        await put_object(env.streams, "b", "dir/", b"")  # a marker: dir stays a directory
        await env.settle()
        assert ("inode", d, None) in env.fs.kernel.sent
        assert ("entry", ROOT, b"dir") not in env.fs.kernel.sent
        # A file named "solo" is hidden while the directory holds the path; once its last entry goes,
        # the path is a file: one update, another kind.
        await put_object(env.streams, "b", "solo", b"a file now")
        await delete_object(env.streams, "b", "solo/x")
        await delete_object(env.streams, "b", "gone/x")
        await env.settle()
        assert ("entry", ROOT, b"solo") in env.fs.kernel.sent
        assert ("inode", solo, None) in env.fs.kernel.sent
        assert ("entry", ROOT, b"gone") in env.fs.kernel.sent
        assert ("inode", gone, None) in env.fs.kernel.sent
        assert await env.cat("solo") == b"a file now"

    ops_env(body, setup=files, bucket="b")


def test_a_refused_mkdir_drops_a_negative_entry_for_its_name(ops_env):
    """A new entry is this mount's own change only once it is made: a mkdir refused by what another
    client stored drops the name's entry (the kernel may hold it as absent), after the answer."""

    async def body(env: Env) -> None:
        await put_object(env.streams, "b", "taken/", b"bytes under a marker's name")
        await env.settle()
        env.fs.kernel.sent.clear()
        try:
            await env.ops.mkdir(ROOT, b"taken", 0o755, Ctx())
        except pyfuse3.FUSEError as e:
            assert e.errno == errno.EEXIST
        else:
            raise AssertionError("mkdir over another client's object succeeded")
        assert ("entry", ROOT, b"taken") in env.fs.kernel.sent

    ops_env(body, setup=files, bucket="b")
