"""A change of an entry inside a directory while this mount renames that directory (d -> e) lands on the
renamed entry only, as on a local disk.

A directory rename moves each object in two steps: its meta under the new name (e/f), then a purge of the
old name's meta subject up to the revision it read (d/f). A meta-only change (chmod, chown, utimens,
setxattr, removexattr) or a truncate of d/f that read d/f before the rename started and stored after the
rename's first step wrote a live meta under d/f again, one the purge left alone: the object showed under
both names, two live metas held one nuid (another client's Delete of d/f purges the chunks e/f still
reads), and a truncate's upload replaced d/f's nuid and purged its chunks, which e/f still used. A
change of a subdirectory's marker (d/s/) or of the moved directory's own (d/) brought the old directory
back the same way.
Such a change now waits for a rename under way and goes by the new path, and a rename waits for a change
under way (`_DirRenameGate`).

The other order (the change arriving while the rename is held half way: it waits, as every request by
an inode there does, and changes the renamed entry) and the close of a file open for writing there (its
bytes are stored under the new name only) are pinned here too, and so is a rename within the directory
being renamed (git's `rename(d/.git/HEAD.lock, d/.git/HEAD)`), which failed with ESTALE while renames
did not pass the gate. So is a file first staged there (an open with O_TRUNC, the first write of a
handle) while the rename starts, which was put under its old name while the rename moved it (ESTALE at
close, the bytes in lost+found), and two writers rewriting a file there while its directory is renamed
in a loop, which hung the previous gate on staging (its lock order is in `_DirRenameGate`).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pyfuse3
import pytest
import trio
import trio.testing
from opskit import CTX, Env, Fields
from test_ops_entries_in_renamed_dirs import HeldWhen, stored_metas, stored_names, tombstones_sharing_a_live_nuid
from test_ops_upload_races import bucket_b, ino_of, rename

from natsfs.adr20 import BytesSource, ObjectStore, stream_name
from natsfs.memstreams import MemoryStreams


async def dir_with_a_file_and_a_subdirectory(ms: MemoryStreams, store: ObjectStore) -> None:
    await bucket_b(ms, store)
    await store.put("b", "d/f", BytesSource(b"in d"), expected_revision=0)
    await store.put("b", "d/s/", BytesSource(b""), expected_revision=0)


def mode_change(mode: int) -> Callable[[Env, int], Awaitable[None]]:
    async def change(env: Env, ino: int) -> None:
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = mode
        await env.ops.setattr(ino, attr, Fields(update_mode=True), None, CTX)
    return change


async def chown(env: Env, ino: int) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_uid, attr.st_gid = 4321, 8765
    await env.ops.setattr(ino, attr, Fields(update_uid=True, update_gid=True), None, CTX)


async def utimens(env: Env, ino: int) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_mtime_ns = 1_600_000_000_000_000_000
    await env.ops.setattr(ino, attr, Fields(update_mtime=True), None, CTX)


async def truncate(env: Env, ino: int) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 2
    await env.ops.setattr(ino, attr, Fields(update_size=True), None, CTX)


async def setxattr(env: Env, ino: int) -> None:
    await env.ops.setxattr(ino, b"user.color", b"blue", CTX)


async def removexattr(env: Env, ino: int) -> None:
    await env.ops.removexattr(ino, b"user.shape", CTX)


async def st(env: Env, path: str) -> pyfuse3.EntryAttributes:
    return await env.lookup(path)


async def xattr_of(env: Env, path: str, name: bytes) -> bytes | None:
    try:
        return await env.ops.getxattr((await env.lookup(path)).st_ino, name, CTX)
    except pyfuse3.FUSEError:
        return None


async def mode_is(env: Env, path: str, mode: int) -> None:
    assert (await st(env, path)).st_mode & 0o7777 == mode


async def owner_changed(env: Env, path: str) -> None:
    attr = await st(env, path)
    assert (attr.st_uid, attr.st_gid) == (4321, 8765)


async def time_set(env: Env, path: str) -> None:
    assert (await st(env, path)).st_mtime_ns == 1_600_000_000_000_000_000


async def truncated(env: Env, path: str) -> None:
    assert await env.cat(path) == b"in"


async def colored(env: Env, path: str) -> None:
    assert await xattr_of(env, path, b"user.color") == b"blue"


async def shapeless(env: Env, path: str) -> None:
    assert await xattr_of(env, path, b"user.shape") is None


# op -> (the change, the entry it changes (under d), what shows under e afterwards)
CHANGES: dict[str, tuple[Callable[[Env, int], Awaitable[None]], str, Callable[[Env, str], Awaitable[None]]]] = {
    "chmod": (mode_change(0o100600), "f", lambda env, p: mode_is(env, p, 0o600)),
    "chown": (chown, "f", owner_changed),
    "utimens": (utimens, "f", time_set),
    "truncate": (truncate, "f", truncated),
    "setxattr": (setxattr, "f", colored),
    "removexattr": (removexattr, "f", shapeless),
    "chmod of a subdirectory": (mode_change(0o040700), "s", lambda env, p: mode_is(env, p, 0o700)),
    "chmod of the directory itself": (mode_change(0o040711), "", lambda env, p: mode_is(env, p, 0o711)),
}


def between_the_steps_for(monkeypatch: pytest.MonkeyPatch, env: Env, name: str) -> HeldWhen:
    """Holds a rename's claim of `name` (a tombstone there): its meta under the new name is published already."""
    return HeldWhen(monkeypatch, env.store, "publish_meta",
                    lambda bucket, doc, *_: bool(doc.get("deleted")) and doc.get("name") == name)


def old_name(entry: str) -> str:
    return {"f": "d/f", "s": "d/s/", "": "d/"}[entry]


@pytest.mark.parametrize("op", CHANGES)
def test_a_change_that_read_its_entry_before_the_directory_rename_lands_on_the_renamed_entry_only(
        ops_env, monkeypatch, op):
    """`chmod d/f` (chown, touch, truncate, setfattr...) while `mv d e` runs: the kernel lets both through
    at once (the directory rename locks only d's parent, a setattr only d/f). The change has read d/f when
    the rename starts; the rename publishes e/f and is held there, before it purges d/f. The change then
    stored a live meta under d/f (a truncate: a new object there, whose put purged the chunks e/f uses),
    which the purge left alone (for d itself: its marker d/, so d came back). Now the rename waits for
    the change, and moves the changed entry."""
    async def body(env: Env):
        change, entry, changed = CHANGES[op]
        path = f"d/{entry}" if entry else "d"
        ino = await ino_of(env, path)
        if op == "removexattr":
            await env.ops.setxattr(ino, b"user.shape", b"round", CTX)
        await ino_of(env, "d/f")
        # The change has read its entry and is about to store: held at the store (a truncate: before
        # it stages the file, once it has read the version it truncates).
        if op == "truncate":
            hold_change = HeldWhen(monkeypatch, env.fs.mut, "check_writable", lambda *_: True)
        else:
            hold_change = HeldWhen(monkeypatch, env.store, "update_meta", lambda *_: True)
        hold_rename = between_the_steps_for(monkeypatch, env, old_name(entry))
        failures: list[BaseException] = []

        async def the_rename() -> None:
            try:
                await rename(env, "d", "e")()
            except pyfuse3.FUSEError as e:
                failures.append(e)

        # Stored, or done: a truncate reads the bytes it keeps in a thread (not settled), and without the
        # gate its answer (the attributes read after the upload) waits for the rename held here.
        stored_here = trio.Event()
        store_call = "put_file" if op == "truncate" else "update_meta"
        real_store = getattr(env.store, store_call)

        async def store_then_tell(*args: Any, **kwargs: Any) -> Any:
            try:
                return await real_store(*args, **kwargs)
            finally:
                stored_here.set()

        monkeypatch.setattr(env.store, store_call, store_then_tell)

        async def the_change() -> None:
            await change(env, ino)
            stored_here.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(the_change)
            await hold_change.held.wait()
            nursery.start_soon(the_rename)
            await env.settle()  # (held between its steps for the entry; fixed: it waits for the change)
            hold_change.release()
            await stored_here.wait()
            hold_rename.release()
        await env.settle()
        assert failures == []
        assert stored_names(env) == {"old", "e/", "e/f", "e/s/"}  # nothing left under d/
        assert tombstones_sharing_a_live_nuid(env) == []
        assert (await env.listdir(await ino_of(env, ""))).names == ["e", "old"]
        assert (await env.listdir(await ino_of(env, "e"))).names == ["f", "s"]
        await changed(env, f"e/{entry}" if entry else "e")
        if op != "truncate":
            assert await env.cat("e/f") == b"in d"

    ops_env(body, setup=dir_with_a_file_and_a_subdirectory, bucket="b")


@pytest.mark.parametrize("op", CHANGES)
def test_a_change_arriving_while_its_directory_is_renamed_half_way_goes_by_the_new_path(ops_env, monkeypatch, op):
    """The other order: the rename is held between its two steps for d/f when the change arrives. The
    change waits for the rename and then changes the renamed entry."""
    async def body(env: Env):
        change, entry, changed = CHANGES[op]
        path = f"d/{entry}" if entry else "d"
        ino = await ino_of(env, path)
        if op == "removexattr":
            await env.ops.setxattr(ino, b"user.shape", b"round", CTX)
        await ino_of(env, "d/f")
        hold = between_the_steps_for(monkeypatch, env, old_name(entry))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rename(env, "d", "e"))
            await hold.held.wait()
            nursery.start_soon(change, env, ino)
            await env.settle()  # (it waits for the rename)
            hold.release()
        await env.settle()
        assert stored_names(env) == {"old", "e/", "e/f", "e/s/"}
        assert tombstones_sharing_a_live_nuid(env) == []
        assert (await env.listdir(await ino_of(env, "e"))).names == ["f", "s"]
        await changed(env, f"e/{entry}" if entry else "e")

    ops_env(body, setup=dir_with_a_file_and_a_subdirectory, bucket="b")


@pytest.mark.parametrize("held", ["rename", "upload", "first write"])
def test_the_close_of_a_file_written_in_a_directory_being_renamed_stores_it_under_the_new_name_only(
        ops_env, monkeypatch, held):
    """`echo new > d/f` closed while `mv d e` runs. The rename holds the file's upload lock from before
    its first step until the inode table follows ("rename": the close arrives while the rename is held
    between its two steps for d/f), and waits for an upload under way ("upload": the close's put is held
    when the rename starts); a file opened before the rename but first written while it runs ("first
    write": staged only then, so not among the files whose locks the rename holds) reads its version
    after the rename: either way the bytes are stored under e/f only, and no meta under d/f."""
    async def body(env: Env):
        f = await ino_of(env, "d/f")
        if held == "first write":
            fi = await env.ops.open(f, os.O_WRONLY, CTX)
        else:
            fi = await env.ops.open(f, os.O_WRONLY | os.O_TRUNC, CTX)
            await env.ops.write(fi.fh, 0, b"new bytes")

        async def close() -> None:
            if held == "first write":
                await env.ops.write(fi.fh, 0, b"new bytes")
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)

        async with trio.open_nursery() as nursery:
            if held != "upload":
                hold = between_the_steps_for(monkeypatch, env, "d/f")
                nursery.start_soon(rename(env, "d", "e"))
                await hold.held.wait()
                nursery.start_soon(close)
            else:
                hold = HeldWhen(monkeypatch, env.store, "put_file", lambda *_: True)
                nursery.start_soon(close)
                await hold.held.wait()
                nursery.start_soon(rename(env, "d", "e"))
            await env.settle()
            hold.release()
        await env.settle()
        assert stored_names(env) == {"old", "e/", "e/f", "e/s/"}
        assert tombstones_sharing_a_live_nuid(env) == []
        assert await env.cat("e/f") == b"new bytes"
        assert not [m for m in env.streams.messages(stream_name("b")) if m.subject.startswith("$O.b.C.")
                    and not chunk_used(env, m.subject)]

    ops_env(body, setup=dir_with_a_file_and_a_subdirectory, bucket="b")


def chunk_used(env: Env, subject: str) -> bool:
    """Whether a live object's nuid owns the chunk subject (no orphan left by a put under the old name)."""
    return any(not info.deleted and subject.endswith(f".{info.nuid}") for info in stored_metas(env))


INNER_ORDERS = ["directory rename between its steps for HEAD.lock", "directory rename between its steps for HEAD",
                "inner rename first"]


@pytest.mark.parametrize("order", INNER_ORDERS)
def test_a_rename_within_a_directory_being_renamed_succeeds_in_the_renamed_directory(ops_env, monkeypatch, order):
    """git's `rename(d/.git/HEAD.lock, d/.git/HEAD)` while `mv d e` runs (a git clone into d while d is
    renamed): the kernel lets both through at once (each locks only its own parent). Ungated, the inner
    rename read HEAD.lock and HEAD by their old names while the directory rename moved them, and failed
    with ESTALE ("changed since it was read"), an answer no program expects of rename(2); or it stored
    HEAD under the old path after the move, bringing d back. On a local disk it succeeds (the kernel
    reached .git by its inode, which the directory rename keeps). Here it waits for a directory rename
    under way and renames e/.git/HEAD.lock over e/.git/HEAD, or the directory rename waits for it."""
    async def body(env: Env):
        git = await ino_of(env, "d/.git")
        await ino_of(env, "d/.git/HEAD")
        await ino_of(env, "d/.git/HEAD.lock")
        failures: list[BaseException] = []

        async def inner() -> None:
            try:
                await env.ops.rename(git, b"HEAD.lock", git, b"HEAD", 0, CTX)
            except pyfuse3.FUSEError as e:
                failures.append(e)

        async with trio.open_nursery() as nursery:
            if order == "inner rename first":
                hold = HeldWhen(monkeypatch, env.store, "rename", lambda *_: True)
                nursery.start_soon(inner)
                await hold.held.wait()
                nursery.start_soon(rename(env, "d", "e"))
            else:
                moved_first = "d/.git/HEAD.lock" if order.endswith("HEAD.lock") else "d/.git/HEAD"
                hold = between_the_steps_for(monkeypatch, env, moved_first)
                nursery.start_soon(rename(env, "d", "e"))
                await hold.held.wait()
                nursery.start_soon(inner)
            await env.settle()  # (the one that came second waits for the other)
            hold.release()
        await env.settle()
        assert failures == []
        assert stored_names(env) == {"old", "e/", "e/.git/HEAD"}
        assert tombstones_sharing_a_live_nuid(env) == []
        assert (await env.listdir(await ino_of(env, ""))).names == ["e", "old"]
        assert (await env.listdir(await ino_of(env, "e/.git"))).names == ["HEAD"]
        assert await env.cat("e/.git/HEAD") == b"ref: main"

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await bucket_b(ms, store)
        await store.put("b", "d/.git/HEAD", BytesSource(b"ref: old"), expected_revision=0)
        await store.put("b", "d/.git/HEAD.lock", BytesSource(b"ref: main"), expected_revision=0)

    ops_env(body, setup=setup, bucket="b")


@pytest.mark.parametrize("entry", ["", "s"])
def test_a_directory_time_is_never_stored_between_the_steps_of_a_directory_rename(ops_env, monkeypatch, entry):
    """An entry changed in d (or d/s) a moment before `mv d e`: its directory's time is stored to the
    marker a moment later (coalesced), by the path it had then. Coming due while the rename is held
    between its two steps for that marker, it waits for the rename (the directory-time gate), and then
    finds the time moved to the new path: nothing is written under d/ (or d/s/), which would bring d back
    holding the moved marker's nuid."""
    async def body(env: Env):
        directory = ("d", entry) if entry else ("d",)
        await ino_of(env, "d/f")
        hold = between_the_steps_for(monkeypatch, env, old_name(entry))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rename(env, "d", "e"))
            await hold.held.wait()
            env.fs._dir_mtimes[directory] = 1_600_000_000_000_000_000
            nursery.start_soon(env.fs._persist_dir_time, directory)
            await trio.sleep(10)  # (past DIR_TIME_MAX_S: the store is due, and waits for the rename)
            await env.settle()
            hold.release()
        await env.settle()
        assert stored_names(env) == {"old", "e/", "e/f", "e/s/"}
        assert tombstones_sharing_a_live_nuid(env) == []
        assert (await env.listdir(await ino_of(env, ""))).names == ["e", "old"]

    ops_env(body, setup=dir_with_a_file_and_a_subdirectory, bucket="b",
            clock=trio.testing.MockClock(autojump_threshold=0))


def held_after_its_staged_files_are_locked(monkeypatch: pytest.MonkeyPatch, env: Env
                                           ) -> tuple[trio.Event, trio.Event]:
    """Holds a rename once it holds the upload locks of the files staged where it moves (before it reads
    the directory again and moves its objects); returns (set once held, set it to release)."""
    release = trio.Event()
    held = trio.Event()
    real = env.fs._uploads_settled

    @contextlib.asynccontextmanager
    async def settled_then_held(*paths: tuple[str, ...], subtree: bool = False) -> AsyncIterator[None]:
        async with real(*paths, subtree=subtree):
            if not held.is_set():
                held.set()
                await release.wait()
            yield

    monkeypatch.setattr(env.fs, "_uploads_settled", settled_then_held)
    return held, release


@pytest.mark.parametrize("staged_by", ["open O_TRUNC", "first write"])
def test_a_file_staged_while_its_directory_rename_starts_is_stored_under_the_new_name_only(
        ops_env, monkeypatch, staged_by):
    """`echo new > d/f` while `mv d e` runs, the file staged (by the truncating open, or by the first
    write of a handle opened before) after the rename took the upload locks of the files staged there
    (the rename awaits the directory's listing after that): the rename did not hold this file's lock, so
    the close's put ran while the rename moved d/f to e/f: it failed as "changed by another client"
    (ESTALE at close, the bytes in lost+found) though only this mount's rename had moved it, or it landed
    on d/f between the rename's two steps and brought d back with the new bytes (d/f and e/f, two
    nuids). Now staging a file there waits for the rename (`_DirRenameGate`), so the rename holds its
    lock or it is staged under e/f: stored under e/f only."""
    async def body(env: Env):
        f = await ino_of(env, "d/f")
        early = await env.ops.open(f, os.O_WRONLY, CTX) if staged_by == "first write" else None
        rename_held, rename_released = held_after_its_staged_files_are_locked(monkeypatch, env)
        put_held = HeldWhen(monkeypatch, env.store, "put_file", lambda *_: True)
        waits = waits_for_a_rename(monkeypatch, env)
        failures: list[BaseException] = []

        async def echo() -> None:
            try:
                fi = early if early is not None else await env.ops.open(f, os.O_WRONLY | os.O_TRUNC, CTX)
                await env.ops.write(fi.fh, 0, b"new bytes")
                await env.ops.flush(fi.fh)
                await env.ops.release(fi.fh)
            except pyfuse3.FUSEError as e:
                failures.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rename(env, "d", "e"))
            await rename_held.wait()
            nursery.start_soon(echo)
            # Unfixed: staged under d/f, its put held. Fixed: the open (or write) waits for the rename.
            await first_of(put_held.held.wait, waits.wait)
            rename_released.set()
            await env.settle()
            put_held.release()
        await env.settle()
        assert failures == []
        assert stored_names(env) == {"old", "e/", "e/f", "e/s/"}
        assert tombstones_sharing_a_live_nuid(env) == []
        assert (await env.listdir(await ino_of(env, ""))).names == ["e", "old"]
        assert await env.cat("e/f") == b"new bytes"
        assert env.fs.counters["conflicts"] == 0  # (nothing went to lost+found)

    ops_env(body, setup=dir_with_a_file_and_a_subdirectory, bucket="b")


async def first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Returns once the first of `waits` returns."""
    async with trio.open_nursery() as nursery:
        async def wait_then_stop(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()
        for wait in waits:
            nursery.start_soon(wait_then_stop, wait)


def waits_for_a_rename(monkeypatch: pytest.MonkeyPatch, env: Env) -> trio.Event:
    """Set once a request waits for a directory rename under way (`_DirRenameGate`)."""
    waiting = trio.Event()
    gate = env.fs._dir_renames
    real = gate._wait

    async def wait() -> None:
        if gate._renaming:
            waiting.set()
        await real()

    monkeypatch.setattr(gate, "_wait", wait)
    return waiting


def test_a_file_open_for_writing_across_several_renames_of_its_directory_is_stored_under_its_last_name(ops_env):
    """`mv d e; mv e d; mv d e` while d/f is open for writing (staged before the first): each rename moves
    the staged file and its base along (the renamed object's revision), so its close stores it under
    e/f, no conflict with this mount's own renames, nothing under d/."""
    async def body(env: Env):
        f = await ino_of(env, "d/f")
        fi = await env.ops.open(f, os.O_WRONLY | os.O_TRUNC, CTX)
        await env.ops.write(fi.fh, 0, b"new bytes")
        await rename(env, "d", "e")()
        await rename(env, "e", "d")()
        await rename(env, "d", "e")()
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert stored_names(env) == {"old", "e/", "e/f", "e/s/"}
        assert tombstones_sharing_a_live_nuid(env) == []
        assert await env.cat("e/f") == b"new bytes"
        assert env.fs.counters["conflicts"] == 0  # (nothing went to lost+found)

    ops_env(body, setup=dir_with_a_file_and_a_subdirectory, bucket="b")



def jittered(monkeypatch: pytest.MonkeyPatch, obj: object, names: Sequence[str], seed: int) -> None:
    """Each call of the async methods `names` of `obj` first sleeps 0 to 3 ms (chosen by a random
    generator seeded with `seed`): the requests under way interleave differently at each of those awaits.
    (Not on a MockClock: one that jumps while a worker thread writes the spool would time a close out.)"""
    rng = random.Random(seed)
    for name in names:
        real = getattr(obj, name)

        async def jittered_call(*args: Any, _real: Callable[..., Awaitable[Any]] = real, **kwargs: Any) -> Any:
            await trio.sleep(rng.choice((0, 0, 0.001, 0.002, 0.003)))
            return await _real(*args, **kwargs)

        monkeypatch.setattr(obj, name, jittered_call)


@pytest.mark.parametrize("seed", range(4))
def test_two_writers_rewriting_a_file_while_its_directory_is_renamed_in_a_loop_store_every_close(
        ops_env, monkeypatch, seed):
    """Two writers rewrite d/f (open O_TRUNC, write, close) while `mv d e; mv e d` runs in a loop (the
    store's answers come after varied pauses, so the three interleave anew at each). Every staging of
    the file passes the directory-rename gate and every rename holds the upload locks of the files
    staged there, while one writer's open waits for the other's upload and its last close. The previous
    gate on staging let such an open, finding its file dropped meanwhile, stage it again from inside the
    file's lock, waiting for a rename that waited for that lock: a real mount hung within seconds. Now
    every close is stored (no ESTALE, nothing in lost+found), nothing under a name the directory left,
    and nothing hangs (the timeout only guards against a hang; it times nothing)."""
    rounds = 25

    async def body(env: Env):
        jittered(monkeypatch, env.store, ("put_file", "get_meta_doc", "rename", "_purge_settled"), seed)
        jittered(monkeypatch, env.ns, ("resolve",), seed + 100)
        jittered(monkeypatch, env.fs.mut, ("check_writable",), seed + 200)
        real_settled = env.fs._uploads_settled
        pause = random.Random(seed + 300)

        @contextlib.asynccontextmanager
        async def settled_then_paused(*paths: tuple[str, ...], subtree: bool = False) -> AsyncIterator[None]:
            async with real_settled(*paths, subtree=subtree):
                await trio.sleep(pause.choice((0, 0.001, 0.002)))  # (the locks held, before the move)
                yield

        monkeypatch.setattr(env.fs, "_uploads_settled", settled_then_paused)
        f = await ino_of(env, "d/f")
        failures: list[BaseException] = []
        renaming_done = trio.Event()
        closes = [0, 0]

        async def writer(n: int) -> None:
            while not renaming_done.is_set():
                try:
                    fi = await env.ops.open(f, os.O_WRONLY | os.O_TRUNC, CTX)
                    await env.ops.write(fi.fh, 0, b"writer %d close %d" % (n, closes[n]))
                    await env.ops.flush(fi.fh)
                    await env.ops.release(fi.fh)
                except pyfuse3.FUSEError as e:
                    failures.append(e)
                closes[n] += 1

        async def renamer() -> None:
            for _ in range(rounds):
                await rename(env, "d", "e")()
                await rename(env, "e", "d")()
            renaming_done.set()

        with trio.fail_after(60):  # (a hang guard only)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer, 0)
                nursery.start_soon(writer, 1)
                nursery.start_soon(renamer)
        await env.settle()
        assert failures == []
        assert min(closes) > 0
        assert env.fs.counters["conflicts"] == 0  # (nothing went to lost+found)
        assert stored_names(env) == {"old", "d/", "d/f", "d/s/"}
        assert tombstones_sharing_a_live_nuid(env) == []
        assert (await env.cat("d/f")).startswith(b"writer ")

    ops_env(body, setup=dir_with_a_file_and_a_subdirectory, bucket="b")
