"""An entry made in a directory while that directory is renamed (d -> e) lands in the renamed directory,
as on a local disk, and the old directory does not come back.

A directory rename moves the objects it finds when it starts, its own marker last. A `mkdir`, `symlink`
or `mknod` in it that checked its path before the rename ended stored its marker or object under the old
path (`d/x`): the rename had not seen it, so `d` came back with `x` in it (and `e` lacked it). Both
interleavings are pinned: the new entry arriving while the rename is held half way (one object moved),
and the rename arriving while the new entry's check or its publish is held.

An entry removed there meanwhile (`unlink`, `rmdir`) is removed from the renamed directory: removed by
its old path between the rename's two steps for it, it left a tombstone carrying the moved object's nuid.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from opskit import CTX, Env
from test_ops_coherence import Held
from test_ops_upload_races import bucket_b, ino_of, rename

from natsfs.adr20 import BytesSource, ObjectStore, parse_meta, stream_name
from natsfs.memstreams import MemoryStreams


class HeldWhen:
    """Holds the first call of the async method `obj.name` whose arguments `when(*args)` picks, until
    `release()`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, obj: object, name: str, when: Callable[..., bool]) -> None:
        self.held = trio.Event()
        self._gate = trio.Event()
        real = getattr(obj, name)

        async def held(*args: Any, **kwargs: Any) -> Any:
            if not self.held.is_set() and when(*args):
                self.held.set()
                await self._gate.wait()
            return await real(*args, **kwargs)

        monkeypatch.setattr(obj, name, held)

    def release(self) -> None:
        self._gate.set()


async def dir_with_a_file(ms: MemoryStreams, store: ObjectStore) -> None:
    await bucket_b(ms, store)
    await store.put("b", "d/f", BytesSource(b"in d"), expected_revision=0)


def stored_names(env: Env) -> set[str]:
    """The live object names the bucket's stream holds (its last meta per subject), read from the store
    itself, not from the mount's index."""
    last = {}
    for msg in env.streams.messages(stream_name("b")):
        if msg.subject.startswith("$O.b.M."):
            last[msg.subject] = msg
    return {info.name for info in (parse_meta("b", msg) for msg in last.values()) if not info.deleted}


async def make_mkdir(env: Env, d: int) -> None:
    await env.ops.mkdir(d, b"x", 0o755, CTX)


async def make_symlink(env: Env, d: int) -> None:
    await env.ops.symlink(d, b"x", b"f", CTX)


async def make_fifo(env: Env, d: int) -> None:
    await env.ops.mknod(d, b"x", stat.S_IFIFO | 0o644, 0, CTX)


async def make_file(env: Env, d: int) -> None:
    fi, _ = await env.ops.create(d, b"x", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await env.ops.write(fi.fh, 0, b"new file")
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)


MAKERS: dict[str, tuple[Callable[[Env, int], Awaitable[None]], str]] = {
    "mkdir": (make_mkdir, "x/"), "symlink": (make_symlink, "x"), "mknod": (make_fifo, "x"),
    "create": (make_file, "x")}


async def landed_in_the_renamed_directory(env: Env, stored_as: str) -> None:
    assert stored_names(env) == {"old", "e/", "e/f", f"e/{stored_as}"}  # nothing under d/ (d/x, d/)
    assert (await env.listdir(await ino_of(env, ""))).names == ["e", "old"]
    assert (await env.listdir(await ino_of(env, "e"))).names == ["f", "x"]


@pytest.mark.parametrize("op", MAKERS)
def test_an_entry_made_while_its_directory_is_renamed_half_way_lands_in_the_renamed_directory(
        ops_env, monkeypatch, op):
    async def body(env: Env):
        make, stored_as = MAKERS[op]
        d = await ino_of(env, "d")
        hold = Held(monkeypatch, env.store, "rename")  # the rename's first move (d/f; the marker d/ is last)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rename(env, "d", "e"))
            await hold.held.wait()
            nursery.start_soon(make, env, d)
            await env.settle()  # (it waits for the rename)
            hold.release()
        await env.settle()
        await landed_in_the_renamed_directory(env, stored_as)

    ops_env(body, setup=dir_with_a_file, bucket="b")


@pytest.mark.parametrize("held", ["check", "publish"])
@pytest.mark.parametrize("op", ["mkdir", "symlink", "mknod"])
def test_a_directory_renamed_while_an_entry_is_made_in_it_takes_the_entry_along(ops_env, monkeypatch, op, held):
    """The whole rename runs while the new entry is held in its check of the path (it then checks again
    under the new path), or it waits for the entry's publish under way (and then moves it too)."""
    async def body(env: Env):
        make, stored_as = MAKERS[op]
        d = await ino_of(env, "d")
        real = env.fs._path_node
        reached, go = trio.Event(), trio.Event()

        async def held_check(path: tuple[str, ...]) -> Any:
            if path == ("d",) and not go.is_set():  # the entry's look at its parent directory
                reached.set()
                await go.wait()
            return await real(path)

        if held == "check":
            monkeypatch.setattr(env.fs, "_path_node", held_check)
        else:
            hold = Held(monkeypatch, env.store, "put" if op != "symlink" else "publish_meta")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(make, env, d)
            if held == "check":
                await reached.wait()
                monkeypatch.setattr(env.fs, "_path_node", real)
                await rename(env, "d", "e")()  # the whole rename, while the entry waits
                go.set()
            else:
                await hold.held.wait()
                nursery.start_soon(rename(env, "d", "e"))
                await env.settle()  # (it waits for the entry being stored)
                hold.release()
        await env.settle()
        await landed_in_the_renamed_directory(env, stored_as)

    ops_env(body, setup=dir_with_a_file, bucket="b")


@pytest.mark.parametrize("way", ["into", "out of"])
def test_a_file_renamed_into_or_out_of_a_directory_being_renamed_moves_with_it(ops_env, monkeypatch, way):
    """`mv old d/` (or `mv d/f .`) while `mv d e` runs: the kernel lets both through at once (the
    directory rename locks only its parent). Moved into d while the rename ran, the file stayed behind
    as d/g and brought d back; moved out of it, it raced the rename's own move of d/f. As on a local
    disk, the file lands in (or leaves) the renamed directory, and d does not come back."""
    async def body(env: Env):
        d = await ino_of(env, "d")
        root = await ino_of(env, "")
        await ino_of(env, "old")
        await ino_of(env, "d/f")
        hold = Held(monkeypatch, env.store, "rename")  # the directory rename's first move (d/f)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rename(env, "d", "e"))
            await hold.held.wait()
            if way == "into":
                nursery.start_soon(env.ops.rename, root, b"old", d, b"g", 0, CTX)
            else:
                nursery.start_soon(env.ops.rename, d, b"f", root, b"g", 0, CTX)
            await env.settle()  # (it waits for the directory rename)
            hold.release()
        await env.settle()
        if way == "into":
            assert stored_names(env) == {"e/", "e/f", "e/g"}
            assert (await env.listdir(root)).names == ["e"]
            assert (await env.listdir(await ino_of(env, "e"))).names == ["f", "g"]
        else:
            assert stored_names(env) == {"e/", "g", "old"}
            assert (await env.listdir(root)).names == ["e", "g", "old"]
            assert (await env.listdir(await ino_of(env, "e"))).names == []
            assert await env.cat("g") == b"in d"

    ops_env(body, setup=dir_with_a_file, bucket="b")


def stored_metas(env: Env) -> list[Any]:
    """The last meta of every meta subject the bucket's stream holds (tombstones included)."""
    last = {}
    for msg in env.streams.messages(stream_name("b")):
        if msg.subject.startswith("$O.b.M."):
            last[msg.subject] = msg
    return [parse_meta("b", msg) for msg in last.values()]


def tombstones_sharing_a_live_nuid(env: Env) -> list[str]:
    """Tombstones whose nuid a live object holds: another client's Delete or Put of such a name would
    purge the live object's chunks."""
    metas = stored_metas(env)
    live = {info.nuid for info in metas if not info.deleted}
    return [info.name for info in metas if info.deleted and info.nuid in live]


async def dir_with_a_subdirectory(ms: MemoryStreams, store: ObjectStore) -> None:
    await bucket_b(ms, store)
    await store.put("b", "d/s/", BytesSource(b""), expected_revision=0)


async def remove_file(env: Env, d: int) -> None:
    await env.ops.unlink(d, b"f", CTX)


async def remove_subdirectory(env: Env, d: int) -> None:
    await env.ops.rmdir(d, b"s", CTX)


REMOVALS: dict[str, tuple[Callable[[Env, int], Awaitable[None]], Callable[[MemoryStreams, ObjectStore],
                                                                           Awaitable[None]]]] = {
    "unlink": (remove_file, dir_with_a_file), "rmdir": (remove_subdirectory, dir_with_a_subdirectory)}


@pytest.mark.parametrize("watch", ["seen", "late"])
@pytest.mark.parametrize("op", REMOVALS)
def test_an_entry_removed_while_its_directory_is_renamed_is_removed_from_the_renamed_directory(
        ops_env, monkeypatch, op, watch):
    """`rm d/f` (or `rmdir d/s`) while `mv d e` runs, as git's clean-up of a failed clone does while its
    directory is renamed: the kernel lets both through at once (the directory rename locks only its
    parent). Held between the rename's two steps for that entry (its meta published under e/, the old
    subject not purged yet), the removal answered 0 while e/f (e/s) lived on; and where the watch had
    not delivered the new meta yet ("late"), it wrote its tombstone on the old name, carrying the nuid
    of the live e/f (other clients' Delete or Put of d/f then purge e/f's chunks) and purged e/f's
    chunks too. As on a local disk, the entry is removed from the renamed directory, and no tombstone
    carries a live nuid."""
    async def body(env: Env):
        remove, _ = REMOVALS[op]
        d = await ino_of(env, "d")
        await ino_of(env, "d/f" if op == "unlink" else "d/s")
        index = env.ns.loaded_index("b")
        assert index is not None
        real_apply = index.apply
        deferred: list[Any] = []
        watch_late = watch == "late"

        def apply(info: Any) -> bool:
            if watch_late and info.name.startswith("e/"):
                deferred.append(info)  # the watch has not delivered the renamed metas yet
                return False
            return real_apply(info)

        monkeypatch.setattr(index, "apply", apply)
        # The rename's first claim of an old name (its tombstone there): its new meta is published already.
        hold = HeldWhen(monkeypatch, env.store, "publish_meta", lambda bucket, doc, *_: bool(doc.get("deleted")))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rename(env, "d", "e"))
            await hold.held.wait()
            nursery.start_soon(remove, env, d)
            await env.settle()  # (it waits for the rename)
            watch_late = False
            for info in deferred:
                real_apply(info)
            hold.release()
        await env.settle()
        assert tombstones_sharing_a_live_nuid(env) == []
        assert stored_names(env) == {"old", "e/"}
        assert (await env.listdir(await ino_of(env, ""))).names == ["e", "old"]
        assert (await env.listdir(await ino_of(env, "e"))).names == []

    ops_env(body, setup=REMOVALS[op][1], bucket="b")
