"""Opens racing replacements: every handle of an inode reads one version, whatever the interleaving.

The kernel keeps one page cache (and one size) per inode, so two handles of one inode that read two
versions would be served each other's pages. An open awaits (the bucket's index, the server) between
resolving its inode and registering its handle; these tests hold it right there, let another client
replace the object, and then check what each handle reads, which handles the kernel may let keep its
pages (`keep_cache`), and that the path moved to a fresh inode where it had to.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import pytest
import trio
from gowriters import delete_object, put_object
from opskit import CTX, Ctx, Env, Listing

from natsfs.adr20 import ObjectStore, stream_name
from natsfs.handles import FileHandle
from natsfs.inodes import InodeNo
from natsfs.memstreams import MemoryStreams

OLD = b"the old version\n" * 4096  # 64 KiB: one chunk
NEW = b"THE NEW, LONGER VERSION\n" * 4096


async def one_object(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("alpha")
    await put_object(ms, "alpha", "moving.bin", OLD)


class Held:
    """Holds the next call of the async method `obj.name` (its arguments already taken) until `release()`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> None:
        self.held = trio.Event()
        self._gate = trio.Event()
        self._armed = True
        real = getattr(obj, name)

        async def held(*args: Any, **kwargs: Any) -> Any:
            if self._armed:
                self._armed = False
                self.held.set()
                await self._gate.wait()
            return await real(*args, **kwargs)

        monkeypatch.setattr(obj, name, held)

    def release(self) -> None:
        self._gate.set()


async def held_open(hold: Held, env: Env, ino: int, meanwhile: Callable[[], Awaitable[None]],
                    flags: int = os.O_RDONLY, *, retried: bool = True) -> pyfuse3.FileInfo:
    """Open `ino`, with `meanwhile()` run (and the watch settled) while the open is held by `hold`; as
    open(2) does (`Env.open`, walked again and retried once if answered `ESTALE`) unless not `retried`."""
    opened: list[pyfuse3.FileInfo] = []

    async def open_it() -> None:
        opened.append(await (env.open(ino, flags) if retried else env.ops.open(ino, flags, CTX)))

    env.nursery.start_soon(open_it)
    await hold.held.wait()
    await meanwhile()
    await env.settle()
    hold.release()
    await env.settle()
    assert len(opened) == 1
    return opened[0]


def versions_on(env: Env, ino: int) -> set[str]:
    """The nuids the open handles of `ino` read."""
    return {h.info.nuid for h in env.fs.handles.values() if isinstance(h, FileHandle) and h.ino == ino}


async def read(env: Env, fi: pyfuse3.FileInfo, size: int) -> bytes:
    return await env.ops.read(fi.fh, 0, size)


async def replace(env: Env) -> None:
    await put_object(env.streams, "alpha", "moving.bin", NEW)


def test_an_open_reaching_a_replaced_inode_reads_the_version_its_other_handles_hold(ops_env, monkeypatch):
    """The object is replaced while a reader holds it and a second open of the same inode (the kernel's
    entry still pointed at it) is under way: the second handle reads the old version too, never the new."""
    async def body(env: Env):
        ino = (await env.lookup("alpha/moving.bin")).st_ino
        first = await env.ops.open(ino, os.O_RDONLY, CTX)
        assert await read(env, first, len(OLD)) == OLD  # its chunk is now cached
        old_nuid = versions_on(env, ino)

        # Held after it took the inode's path, before it read the index.
        second = await held_open(Held(monkeypatch, env.ns, "resolve"), env, ino, lambda: replace(env))

        assert versions_on(env, ino) == old_nuid  # one version per inode
        assert await read(env, second, len(OLD)) == OLD
        assert not second.keep_cache  # the detached inode's pages were not vouched for
        moved = await env.lookup("alpha/moving.bin")
        assert moved.st_ino != ino and moved.st_size == len(NEW)
        assert await env.read_all(moved.st_ino) == NEW
        assert (await env.ops.getattr(ino, None)).st_size == len(OLD)
        for fi in (first, second):
            await env.ops.release(fi.fh)

    ops_env(body, setup=one_object)


@pytest.mark.parametrize("held_in", ["resolve", "check_writable"])
def test_an_open_under_way_while_the_object_is_replaced_reads_the_new_version(ops_env, monkeypatch, held_in):
    """No handle is open when the object is replaced, but an open of its inode is under way (held before
    it read the index, or after, while it checks the bucket is writable): that open registers after the
    change, so it reads the new version, and the inode keeps one version."""
    async def body(env: Env):
        ino = (await env.lookup("alpha/moving.bin")).st_ino
        assert await env.read_all(ino) == OLD  # the kernel's pages now hold the old version

        hold = Held(monkeypatch, env.ns if held_in == "resolve" else env.fs.mut, held_in)
        held = await held_open(hold, env, ino, lambda: replace(env), flags=os.O_RDWR)

        assert not held.keep_cache  # the old version's pages are dropped at this open
        assert await read(env, held, len(NEW)) == NEW
        again = await env.ops.open(ino, os.O_RDONLY, CTX)  # the kernel's entry still points here
        assert again.keep_cache  # its pages were filled by the new version only
        assert len(versions_on(env, ino)) == 1
        assert await read(env, again, len(NEW)) == NEW
        assert ("inode", ino, None) in env.fs.kernel.sent
        for fi in (held, again):
            await env.ops.release(fi.fh)

    ops_env(body, setup=one_object)


def test_an_open_under_way_while_the_object_is_deleted_is_estale(ops_env, monkeypatch):
    """ESTALE, not ENOENT: the kernel walks the path again and retries; the program then gets ENOENT from
    that walk, or, opening with O_CREAT (which an OPEN does not carry), the file is created."""
    async def body(env: Env):
        ino = (await env.lookup("alpha/moving.bin")).st_ino

        async def delete() -> None:
            await env.store.delete("alpha", "moving.bin")

        hold = Held(monkeypatch, env.ns, "resolve")
        failed: list[int] = []

        async def open_it() -> None:
            try:
                await env.ops.open(ino, os.O_RDONLY, CTX)
            except pyfuse3.FUSEError as e:
                failed.append(e.errno)

        env.nursery.start_soon(open_it)
        await hold.held.wait()
        await delete()
        await env.settle()
        hold.release()
        await env.settle()
        assert failed == [errno.ESTALE]
        assert not versions_on(env, ino)

    ops_env(body, setup=one_object)


def test_a_reader_left_on_an_inode_whose_upload_conflicted_keeps_its_version(ops_env):
    """A reader holds the inode while a writer's upload of it loses to another client's version (the
    change was seen while the upload ran, so nothing detached the inode then): a later open of the inode
    joins the reader's version, and the path moves to a fresh inode for the other client's."""
    async def body(env: Env):
        alpha = (await env.lookup("alpha")).st_ino
        ino = (await env.lookup("alpha/moving.bin")).st_ino
        reader = await env.ops.open(ino, os.O_RDONLY, CTX)
        assert await read(env, reader, len(OLD)) == OLD
        old_nuid = versions_on(env, ino)
        writer = await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, CTX)
        await env.ops.write(writer.fh, 0, b"mine")
        await replace(env)
        await env.settle()
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.flush(writer.fh)  # ESTALE: another client changed it meanwhile
        await env.ops.release(writer.fh)

        again = await env.ops.open(ino, os.O_RDONLY, CTX)  # the kernel's entry still points here
        assert versions_on(env, ino) == old_nuid
        assert await read(env, again, len(OLD)) == OLD
        assert ("entry", alpha, b"moving.bin") in env.fs.kernel.sent
        moved = await env.lookup("alpha/moving.bin")
        assert moved.st_ino != ino and await env.read_all(moved.st_ino) == NEW
        for fi in (reader, again):
            await env.ops.release(fi.fh)

    ops_env(body, setup=one_object)


@pytest.mark.parametrize("reader_open", [False, True])
def test_a_listing_hands_the_kernel_the_attributes_an_entry_has_now(ops_env, reader_open):
    """A listing's names are a snapshot taken at opendir, but the attributes handed with each entry are
    cached by the kernel for the entry's inode: after a replace they must be the new version's (on the
    same inode, or on the fresh one the path got while a reader keeps the old), never the old size."""
    async def body(env: Env):
        alpha = (await env.lookup("alpha")).st_ino
        ino = (await env.lookup("alpha/moving.bin")).st_ino
        reader = await env.ops.open(ino, os.O_RDONLY, CTX) if reader_open else None
        fh = await env.ops.opendir(alpha, None)
        await replace(env)
        await env.settle()
        listing = Listing()
        await env.ops.readdir(fh, 0, listing)
        await env.ops.releasedir(fh)
        [(name, attr, _)] = listing.entries
        assert name == "moving.bin" and attr.st_size == len(NEW)
        assert (attr.st_ino != ino) == reader_open
        assert await env.read_all(attr.st_ino) == NEW
        if reader is not None:
            assert (await env.ops.getattr(ino, None)).st_size == len(OLD)
            await env.ops.release(reader.fh)

    ops_env(body, setup=one_object)


def test_attributes_asked_for_while_the_object_is_replaced_are_those_of_the_inodes_version(ops_env, monkeypatch):
    """A getattr of the inode an old reader holds, under way while the object is replaced: the inode keeps
    the old version, so the kernel must get the old size (the new one would cut the reader short)."""
    async def body(env: Env):
        ino = (await env.lookup("alpha/moving.bin")).st_ino
        reader = await env.ops.open(ino, os.O_RDONLY, CTX)
        hold = Held(monkeypatch, env.ns, "resolve")
        sizes: list[int] = []

        async def getattr_() -> None:
            sizes.append((await env.ops.getattr(ino, None)).st_size)

        env.nursery.start_soon(getattr_)
        await hold.held.wait()
        await put_object(env.streams, "alpha", "moving.bin", NEW)
        await env.settle()
        hold.release()
        await env.settle()
        assert sizes == [len(OLD)]
        await env.ops.release(reader.fh)

    ops_env(body, setup=one_object)


def test_an_atomic_save_in_this_mount_is_seen_whole_by_opens_and_lookups_racing_it(ops_env, monkeypatch):
    """rename(2) of a stored `.tmp` over `f` by this mount, held after its publishes (the index shows the
    renamed object at `f` and nothing at `.tmp`) and before it is done; meanwhile the kernel, through the
    names it caches, opens and stats the replaced inode, opens the renamed one, and revalidates `f`. On a
    local disk each sees the old or the new file, whole. Here: an open of the replaced inode must not pin
    the new version on it (the kernel caches the old size for it, and would read the new bytes cut to or
    padded with zeros up to that size): it gets ESTALE, on which the kernel walks the path again. The
    renamed inode opens (never ENOENT) and reads the new version; `f` looks up as the renamed inode."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("alpha")
        await put_object(ms, "alpha", "f", OLD)
        await put_object(ms, "alpha", ".tmp", NEW)

    async def body(env: Env):
        bucket = (await env.lookup("alpha")).st_ino
        replaced = await env.lookup("alpha/f")
        renamed = await env.lookup("alpha/.tmp")
        hold = Held(monkeypatch, env.store, "purge_chunks_later_if_needed")  # the replaced object's chunks
        outcome: dict[str, Any] = {}

        async def attempt(what: str, op: Callable[[], Awaitable[Any]]) -> None:
            try:
                outcome[what] = await op()
            except pyfuse3.FUSEError as e:
                outcome[what] = errno.errorcode[e.errno]

        async def stat_size(ino: int) -> int:
            return (await env.ops.getattr(ino, None)).st_size

        async def looked_up() -> tuple[int, int]:
            attr = await env.ops.lookup(bucket, b"f", None)
            return attr.st_ino, attr.st_size

        async with trio.open_nursery() as racing:
            racing.start_soon(env.ops.rename, bucket, b".tmp", bucket, b"f", 0, CTX)
            await hold.held.wait()
            racing.start_soon(attempt, "open replaced", lambda: env.read_all(replaced.st_ino))
            racing.start_soon(attempt, "stat replaced", lambda: stat_size(replaced.st_ino))
            racing.start_soon(attempt, "open renamed", lambda: env.read_all(renamed.st_ino))
            racing.start_soon(attempt, "lookup f", looked_up)
            await env.settle()
            hold.release()

        assert outcome["open replaced"] in ("ESTALE", OLD)  # never NEW on the inode the kernel sizes as OLD
        assert outcome["stat replaced"] in ("ESTALE", len(OLD))
        assert outcome["open renamed"] == NEW
        assert outcome["lookup f"] == (renamed.st_ino, len(NEW))
        assert await env.cat("alpha/f") == NEW

    ops_env(body, setup=setup)


async def estale(call: Awaitable[Any]) -> bool:
    try:
        await call
    except pyfuse3.FUSEError as e:
        return e.errno == errno.ESTALE
    return False


async def refused_open(monkeypatch: pytest.MonkeyPatch, env: Env, ino: int, data: bytes = NEW) -> None:
    """An open of `ino` (the kernel sized it for OLD) held while another client replaces the object: it
    pins NEW, of another size than the kernel holds, and is answered `ESTALE` for the kernel to ask again."""
    opened: list[pyfuse3.FileInfo] = []
    hold = Held(monkeypatch, env.ns, "resolve")

    async def open_it() -> None:
        with pytest.raises(pyfuse3.FUSEError) as refused:
            opened.append(await env.ops.open(ino, os.O_RDONLY, CTX))
        assert refused.value.errno == errno.ESTALE

    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_it)
        await hold.held.wait()
        await put_object(env.streams, "alpha", "moving.bin", data)
        await env.settle()
        hold.release()
    assert not opened and versions_on(env, ino) == set()


def test_an_open_pinning_a_version_the_kernel_has_another_size_for_is_refused_for_the_kernel_to_ask_again(
        ops_env, monkeypatch):
    """Another client replaces the object while an open of its inode is under way: the open pins the new
    version, but the kernel still holds the old size for the inode (its invalidation waits until the open
    is answered, or the notifier is behind). Read through the page cache, and by splice (sendfile,
    copy_file_range) even on a direct_io handle, the new bytes would come back cut to the old size or
    padded with zeros up to it. The open is answered ESTALE: open(2) walks the path again with fresh
    lookups, whose reply gives the kernel the new size, and its retried open then reads the new version
    through the page cache, at its size."""
    async def body(env: Env):
        ino = (await env.lookup("alpha/moving.bin")).st_ino  # the kernel now sizes the inode len(OLD)
        plain = await env.ops.open(ino, os.O_RDONLY, CTX)
        assert not plain.direct_io  # the version the kernel has the size of
        assert await read(env, plain, 2 * len(OLD)) == OLD  # its pages hold OLD
        await env.ops.release(plain.fh)

        await refused_open(monkeypatch, env, ino)

        walked = await env.lookup("alpha/moving.bin")  # the kernel's walk again (LOOKUP_REVAL)
        assert walked.st_ino == ino and walked.st_size == len(NEW)
        retried = await env.ops.open(ino, os.O_RDONLY, CTX)
        assert not retried.direct_io and not retried.keep_cache  # OLD's pages go
        assert await read(env, retried, 2 * len(NEW)) == NEW
        await env.ops.release(retried.fh)
        again = await env.ops.open(ino, os.O_RDONLY, CTX)
        assert again.keep_cache and not again.direct_io  # pages filled by NEW, at NEW's size
        await env.ops.release(again.fh)

    ops_env(body, setup=one_object)


def test_the_retry_of_an_open_refused_for_the_size_is_never_refused_and_bypasses_the_page_cache(
        ops_env, monkeypatch):
    """The kernel retries a refused open once, in the same thread. If its walk again did not bring it the
    new size (an open of /proc/PID/fd/N walks no name; the object replaced again meanwhile), the retry is
    not refused but answered direct_io, so reads return the version whole; so is the retry of every later
    open (each refused once, never keep_cache: also the second open of the version, which reads nothing a
    direct_io open put in the page cache). Another thread's open in between is refused for itself. Once
    the kernel asked for the attributes again, opens use the page cache as before."""
    async def body(env: Env):
        ino = (await env.lookup("alpha/moving.bin")).st_ino
        assert await env.read_all(ino) == OLD

        await refused_open(monkeypatch, env, ino)  # by CTX's thread

        other = Ctx()
        other.pid = CTX.pid + 1
        assert await estale(env.ops.open(ino, os.O_RDONLY, other))  # not CTX's retry
        for _ in range(2):  # no lookup in between: the kernel still holds len(OLD)
            fallback = await env.ops.open(ino, os.O_RDONLY, CTX)  # the retry
            assert fallback.direct_io and not fallback.keep_cache
            assert await read(env, fallback, 2 * len(NEW)) == NEW
            await env.ops.release(fallback.fh)
            assert await estale(env.ops.open(ino, os.O_RDONLY, CTX))  # the next open(2), refused once
        retried = await env.ops.open(ino, os.O_RDONLY, other)  # the other thread's retry
        assert retried.direct_io and not retried.keep_cache
        await env.ops.release(retried.fh)

        assert (await env.ops.getattr(ino, None)).st_size == len(NEW)  # the kernel asks again
        again = await env.ops.open(ino, os.O_RDONLY, CTX)  # CTX's pending retry, now with the sizes equal
        assert not again.direct_io and not again.keep_cache  # direct_io handles vouched for no page
        assert await read(env, again, 2 * len(NEW)) == NEW
        await env.ops.release(again.fh)
        kept = await env.ops.open(ino, os.O_RDONLY, CTX)
        assert kept.keep_cache and not kept.direct_io
        await env.ops.release(kept.fh)

        # The kernel learned the size: a later change of size is refused once again.
        await refused_open(monkeypatch, env, ino, data=OLD)
        assert (await env.cat("alpha/moving.bin")) == OLD

    ops_env(body, setup=one_object)


def test_an_open_after_a_replace_the_kernel_was_told_of_but_not_sized_for_is_refused_once(ops_env):
    """The replace's invalidation reached the kernel, but it keeps the old size until it asks for the
    attributes again, and an open asks for none (a sendfile right after it would stop at the old size):
    the open is refused once, the walk again brings the size."""
    async def body(env: Env):
        ino = (await env.lookup("alpha/moving.bin")).st_ino
        await replace(env)
        await env.settle()
        assert ("inode", ino, None) in env.fs.kernel.sent
        assert await estale(env.ops.open(ino, os.O_RDONLY, CTX))
        assert (await env.lookup("alpha/moving.bin")).st_size == len(NEW)  # open(2)'s walk again
        fi = await env.ops.open(ino, os.O_RDONLY, CTX)  # and its retry
        assert not fi.direct_io
        assert await read(env, fi, 2 * len(NEW)) == NEW
        await env.ops.release(fi.fh)

    ops_env(body, setup=one_object)


def test_reopening_a_file_this_mount_wrote_keeps_its_pages_and_is_never_refused(ops_env):
    """Every byte of a file this mount wrote went through its kernel, which sized the inode by the writes:
    after the upload, a reopen is neither refused nor direct_io, and keeps the pages the writes filled."""
    async def body(env: Env):
        bucket = (await env.lookup("alpha")).st_ino
        fi, attr = await env.ops.create(bucket, b"written.bin", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        assert attr.st_size == 0
        await env.ops.write(fi.fh, 0, NEW)
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        again = await env.ops.open(attr.st_ino, os.O_RDONLY, CTX)
        assert again.keep_cache and not again.direct_io
        assert await read(env, again, 2 * len(NEW)) == NEW
        await env.ops.release(again.fh)

    ops_env(body, setup=one_object)


SAVED = [b"version %d of an atomically saved file\n" % n * (1000 * (n + 1)) for n in range(3)]


async def two_saves_ready(ms: MemoryStreams, store: ObjectStore) -> None:
    """`f` and two saved temporary files, `.tmp1` and `.tmp2`, each of its own size."""
    await store.create_bucket("alpha")
    for name, data in (("f", SAVED[0]), (".tmp1", SAVED[1]), (".tmp2", SAVED[2])):
        await put_object(ms, "alpha", name, data)


def chunk_nuids(env: Env) -> set[str]:
    """The nuids of the objects whose chunks bucket alpha holds."""
    return {s.rsplit(".", 1)[1] for s in env.streams.subjects(stream_name("alpha")) if ".C." in s}


async def read_handle(env: Env, fh: int) -> bytes:
    out, off = [], 0
    while piece := await env.ops.read(fh, off, 128 * 1024):
        out.append(piece)
        off += len(piece)
    return b"".join(out)


def test_a_retried_open_racing_a_second_atomic_save_opens_the_version_its_walk_reached(ops_env):
    """Two writers of this mount save `f` atomically (write a temporary file, rename it over `f`) while a
    reader opens `f`. The reader's open reaches the inode the first save replaced (through the name the
    kernel cached) and is refused ESTALE; the kernel walks the path again (its lookup reaches the inode
    the first save renamed there) and retries the open, but the second save replaces that inode between
    the lookup and the retry. On a local disk the open opens the file its walk found. Here too: the retry
    opens that version, whole, never ESTALE (before: ESTALE reached the program); its chunks, kept for
    it, are purged at its close."""
    async def body(env: Env) -> None:
        bucket = (await env.lookup("alpha")).st_ino
        cached = await env.ops.lookup(bucket, b"f", CTX)
        first = (await env.store.get_info("alpha", ".tmp1")).nuid
        await env.ops.rename(bucket, b".tmp1", bucket, b"f", 0, CTX)
        with pytest.raises(pyfuse3.FUSEError) as refused:
            await env.ops.open(cached.st_ino, os.O_RDONLY, CTX)
        assert refused.value.errno == errno.ESTALE
        walked = await env.ops.lookup(bucket, b"f", CTX)  # the walk again, in the same thread
        assert walked.st_size == len(SAVED[1])
        await env.ops.rename(bucket, b".tmp2", bucket, b"f", 0, CTX)
        await env.settle()
        assert first in chunk_nuids(env)  # kept for the retry
        retried = await env.ops.open(walked.st_ino, os.O_RDONLY, CTX)
        assert await read_handle(env, retried.fh) == SAVED[1]
        await env.ops.release(retried.fh)
        await env.settle()
        assert first not in chunk_nuids(env)
        assert await env.cat("alpha/f") == SAVED[2]
        assert not env.fs._retry_holds

    ops_env(body, setup=two_saves_ready)


def test_a_walk_again_whose_retry_never_opens_keeps_nothing_once_the_kernel_forgets_the_inode(ops_env):
    """As above, but the retry never opens the inode its walk reached (the kernel gave up before, e.g. a
    permission check): once the kernel forgets that inode, the version kept for it is purged."""
    async def body(env: Env) -> None:
        bucket = (await env.lookup("alpha")).st_ino
        cached = await env.ops.lookup(bucket, b"f", CTX)
        first = (await env.store.get_info("alpha", ".tmp1")).nuid
        await env.ops.rename(bucket, b".tmp1", bucket, b"f", 0, CTX)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.open(cached.st_ino, os.O_RDONLY, CTX)
        walked = await env.ops.lookup(bucket, b"f", CTX)
        await env.ops.rename(bucket, b".tmp2", bucket, b"f", 0, CTX)
        await env.settle()
        assert first in chunk_nuids(env)
        env.ops.forget([(walked.st_ino, env.fs.inodes.lookup_count(InodeNo(walked.st_ino)))])
        await env.settle()
        assert first not in chunk_nuids(env)
        assert not env.fs._retry_holds and not env.fs.files.get(InodeNo(walked.st_ino))

    ops_env(body, setup=two_saves_ready)


def test_another_thread_does_not_open_a_version_held_for_a_retry(ops_env):
    """Only the thread the kernel retries in opens the held version: another thread reaching that inode
    through a cached name is refused ESTALE and walks the path itself (to the newest save)."""
    async def body(env: Env) -> None:
        bucket = (await env.lookup("alpha")).st_ino
        cached = await env.ops.lookup(bucket, b"f", CTX)
        await env.ops.rename(bucket, b".tmp1", bucket, b"f", 0, CTX)
        with pytest.raises(pyfuse3.FUSEError):
            await env.ops.open(cached.st_ino, os.O_RDONLY, CTX)
        walked = await env.ops.lookup(bucket, b"f", CTX)
        await env.ops.rename(bucket, b".tmp2", bucket, b"f", 0, CTX)
        other = Ctx()
        other.pid = CTX.pid + 1
        with pytest.raises(pyfuse3.FUSEError) as refused:
            await env.ops.open(walked.st_ino, os.O_RDONLY, other)
        assert refused.value.errno == errno.ESTALE
        retried = await env.ops.open(walked.st_ino, os.O_RDONLY, CTX)
        assert await read_handle(env, retried.fh) == SAVED[1]
        await env.ops.release(retried.fh)

    ops_env(body, setup=two_saves_ready)


async def stat_errno(env: Env, ino: int) -> int | None:
    """`fstat` of an `O_PATH` descriptor of `ino` (a GETATTR with no handle): its errno, None if it succeeds."""
    try:
        await env.ops.getattr(ino, None)
    except pyfuse3.FUSEError as e:
        return e.errno
    return None


def test_fstat_of_an_o_path_descriptor_of_a_file_this_mount_deleted_shows_it_with_no_link(ops_env):
    """An `O_PATH` descriptor holds the inode but no handle. Once this mount unlinks the file, its stat
    shows the file with `st_nlink` 0, as on a local disk (was ESTALE, which a program's fstat gets as is:
    there is no path to walk; then ENOENT, which also failed an open(2) whose walk found the name just
    before the unlink: its permission check makes the same request)."""
    async def body(env: Env) -> None:
        bucket = (await env.lookup("alpha")).st_ino
        held = await env.ops.lookup(bucket, b"moving.bin", CTX)
        await env.ops.unlink(bucket, b"moving.bin", CTX)
        attrs = await env.ops.getattr(held.st_ino, None)
        assert (attrs.st_nlink, attrs.st_size) == (0, held.st_size)
        env.ops.forget([(held.st_ino, 1)])  # the descriptor is closed: the kernel forgets the inode
        assert await stat_errno(env, held.st_ino) == errno.ESTALE

    ops_env(body, setup=one_object)


def test_fstat_of_an_o_path_descriptor_of_a_file_another_client_deleted_while_open_here_is_enoent(ops_env):
    """Another client deletes the file while this mount reads it (its inode is detached, kept for that
    handle); after that handle's close, the stat through an `O_PATH` descriptor is ENOENT, as for an inode
    that had no handle (was ESTALE)."""
    async def body(env: Env) -> None:
        held = await env.lookup("alpha/moving.bin")
        reader = await env.ops.open(held.st_ino, os.O_RDONLY, CTX)
        await delete_object(env.streams, "alpha", "moving.bin")
        await env.settle()
        assert (await env.ops.getattr(held.st_ino, None)).st_size == len(OLD)  # the handle's version
        await env.ops.release(reader.fh)
        assert await stat_errno(env, held.st_ino) == errno.ENOENT

    ops_env(body, setup=one_object)


def test_stat_of_an_inode_whose_file_was_replaced_is_estale_for_the_kernel_to_walk_again(ops_env):
    """Replaced (here by another client, while this mount read it) rather than deleted: the name shows
    another file, so a stat reaching the old inode through a name the kernel still caches is ESTALE, and
    stat(2) walks the path again to the new file."""
    async def body(env: Env) -> None:
        held = await env.lookup("alpha/moving.bin")
        reader = await env.ops.open(held.st_ino, os.O_RDONLY, CTX)
        await put_object(env.streams, "alpha", "moving.bin", NEW)
        await env.settle()
        await env.ops.release(reader.fh)
        assert await stat_errno(env, held.st_ino) == errno.ESTALE
        assert (await env.lookup("alpha/moving.bin")).st_size == len(NEW)

    ops_env(body, setup=one_object)
