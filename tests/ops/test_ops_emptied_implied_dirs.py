"""Directories implied by other clients' object names, emptied by this mount: they stay, as on a local disk.

A directory without a marker exists because object names imply it. When this mount removes its last
entry itself (unlink, a rename away, rmdir), it stays in this mount as an empty directory, with nothing
stored (other clients see it gone), until this mount removes it with rmdir (0, nothing sent), renames
it, or a name implies it again: `rm -r` removes the entries, then rmdirs the directory, and answered
ENOENT for that last step. Another client's removals still make such a directory vanish.
"""

from __future__ import annotations

import errno

import pyfuse3
import pytest
from gowriters import delete_object, put_object
from opskit import CTX, Env, errno_of

from natsfs.adr20 import ObjectStore
from natsfs.memstreams import MemoryStreams


async def implied(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("alpha")
    await put_object(ms, "alpha", "zz/a", b"1")
    await put_object(ms, "alpha", "top.txt", b"top")


async def fuse_error(coro) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


async def names(env: Env, path: str) -> list[str]:
    return (await env.listdir((await env.lookup(path)).st_ino)).names


async def stored(env: Env) -> set[str]:
    return set(await env.store.live_objects("alpha"))


def last_seq(env: Env) -> int:
    """The bucket's stream's last sequence: nothing was published (or purged with a publish) since."""
    return env.streams._streams["OBJ_alpha"].last_seq


async def unlink(env: Env, path: str) -> None:
    parent, _, name = path.rpartition("/")
    await env.ops.unlink((await env.lookup(parent)).st_ino, name.encode(), CTX)


async def rmdir(env: Env, path: str) -> None:
    parent, _, name = path.rpartition("/")
    await env.ops.rmdir((await env.lookup(parent)).st_ino, name.encode(), CTX)


def test_unlink_of_the_last_entry_keeps_the_directory_until_rmdir(ops_env):
    async def body(env: Env) -> None:
        zz = await env.lookup("alpha/zz")
        await unlink(env, "alpha/zz/a")
        await env.settle()  # (the watch delivers the tombstone too)
        # Still a directory, empty, listed by its parent; nothing was stored for it.
        assert (await env.lookup("alpha/zz")).st_ino == zz.st_ino
        assert (await env.ops.getattr(zz.st_ino, None)).st_nlink == 2
        assert await names(env, "alpha/zz") == []
        assert "zz" in await names(env, "alpha")
        assert await stored(env) == {"top.txt"}
        sent = last_seq(env)
        await rmdir(env, "alpha/zz")
        assert last_seq(env) == sent  # nothing sent
        assert await fuse_error(env.lookup("alpha/zz")) == errno.ENOENT
        assert "zz" not in await names(env, "alpha")
        assert env.ns.loaded_index("alpha").get(("zz",)) is None  # (not kept in memory either)

    ops_env(body, setup=implied)


def test_nested_implied_directories_are_removed_bottom_up(ops_env):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("alpha")
        await put_object(ms, "alpha", "a/b/c", b"1")
        await put_object(ms, "alpha", "m/n/", b"")  # a marker under an implied directory

    async def body(env: Env) -> None:
        await unlink(env, "alpha/a/b/c")
        await rmdir(env, "alpha/a/b")
        assert await names(env, "alpha/a") == []  # emptied by this mount's rmdir: kept too
        await rmdir(env, "alpha/a")
        await rmdir(env, "alpha/m/n")  # (deletes the marker)
        assert await names(env, "alpha/m") == []
        await rmdir(env, "alpha/m")
        await env.settle()
        assert await names(env, "alpha") == []
        assert await stored(env) == set()
        assert not env.ns.loaded_index("alpha").root.children

    ops_env(body, setup=setup)


def test_rename_away_of_the_last_entry_keeps_the_directory(ops_env):
    async def body(env: Env) -> None:
        alpha = await env.lookup("alpha")
        zz = await env.lookup("alpha/zz")
        await env.ops.rename(zz.st_ino, b"a", alpha.st_ino, b"moved", 0, CTX)
        await env.settle()
        assert await names(env, "alpha/zz") == []
        assert await stored(env) == {"top.txt", "moved"}
        await rmdir(env, "alpha/zz")
        assert await fuse_error(env.lookup("alpha/zz")) == errno.ENOENT

    ops_env(body, setup=implied)


def test_rename_of_a_kept_directory_moves_it_in_this_mount_only(ops_env):
    async def body(env: Env) -> None:
        alpha = await env.lookup("alpha")
        await unlink(env, "alpha/zz/a")
        sent = last_seq(env)
        await env.ops.rename(alpha.st_ino, b"zz", alpha.st_ino, b"yy", 0, CTX)
        assert last_seq(env) == sent  # nothing stored
        assert await fuse_error(env.lookup("alpha/zz")) == errno.ENOENT
        assert await names(env, "alpha/yy") == []
        await rmdir(env, "alpha/yy")
        assert await names(env, "alpha") == ["top.txt"]

    ops_env(body, setup=implied)


def test_another_clients_removals_still_make_it_vanish(ops_env):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await implied(ms, store)
        await put_object(ms, "alpha", "zz/b", b"2")

    async def body(env: Env) -> None:
        await unlink(env, "alpha/zz/a")
        await env.settle()
        assert await names(env, "alpha/zz") == ["b"]
        await delete_object(env.streams, "alpha", "zz/b")  # another client removes the last entry
        await env.settle()
        assert await fuse_error(env.lookup("alpha/zz")) == errno.ENOENT
        assert env.ns.loaded_index("alpha").get(("zz",)) is None

    ops_env(body, setup=setup)


def test_a_kept_directory_is_implied_again_by_another_clients_put(ops_env):
    async def body(env: Env) -> None:
        await unlink(env, "alpha/zz/a")
        await env.settle()
        await put_object(env.streams, "alpha", "zz/c", b"3")
        await env.settle()
        # Not empty any more: rmdir refuses, as on a local disk.
        assert await fuse_error(rmdir(env, "alpha/zz")) == errno.ENOTEMPTY
        # Implied by that name again: its deletion by the other client makes the directory vanish.
        await delete_object(env.streams, "alpha", "zz/c")
        await env.settle()
        assert await fuse_error(env.lookup("alpha/zz")) == errno.ENOENT

    ops_env(body, setup=implied)


def test_a_kept_directory_goes_with_its_parent(ops_env):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("alpha")
        await put_object(ms, "alpha", "p/x", b"1")
        await put_object(ms, "alpha", "p/zz/a", b"2")

    async def body(env: Env) -> None:
        await unlink(env, "alpha/p/zz/a")
        await env.settle()
        assert await names(env, "alpha/p") == ["x", "zz"]
        await delete_object(env.streams, "alpha", "p/x")  # another client empties p as it sees it
        await env.settle()
        assert await fuse_error(env.lookup("alpha/p")) == errno.ENOENT
        assert not env.ns.loaded_index("alpha").root.children

    ops_env(body, setup=setup)
