"""A name whose tombstone another client purged is free again in this mount, at once and after the check.

The mount deletes a name (`rmdir n`, `rm n`): its meta subject ends at the tombstone this mount wrote.
Another client then purges that subject (a raw purge, or another mount's clean-up of tombstones that
carry a live nuid). The subject is empty: a new object there must be published expecting sequence 0.
The mount used to expect its own (remembered) tombstone's revision for good, so the server refused
every mkdir (EEXIST), create, symlink and rename onto the name ("wrong last sequence: 0", ESTALE). A
refusal is now settled by reading the subject back: a tombstone or nothing there is retried once on
what is there; a live meta stays a conflict. The reconciliation drops the purged tombstone from the
index, as it drops purged metas.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Awaitable, Callable

import pyfuse3
import pytest
from gowriters import put_object
from opskit import CTX, ROOT, Env, errno_of

from natsfs.adr20 import ObjectStore, meta_subject, stream_name
from natsfs.memstreams import MemoryStreams


async def bucket_b(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "m", b"the file m\n")


async def make_dir(env: Env) -> None:
    await env.ops.mkdir(ROOT, b"n", 0o755, CTX)


async def make_file(env: Env) -> None:
    fi, _ = await env.ops.create(ROOT, b"n", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await env.ops.write(fi.fh, 0, b"new n\n")
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)


async def make_symlink(env: Env) -> None:
    await env.ops.symlink(ROOT, b"n", b"m", CTX)


async def make_dangling_symlink(env: Env) -> None:
    # (a link to no stored object is an empty object with its text in the metadata, as mknod's; one
    # to a stored object is a nats.go link, which reads the name's meta first)
    await env.ops.symlink(ROOT, b"n", b"nowhere", CTX)


async def make_fifo(env: Env) -> None:
    await env.ops.mknod(ROOT, b"n", stat.S_IFIFO | 0o644, 0, CTX)


async def rename_over(env: Env) -> None:
    await env.ops.rename(ROOT, b"m", ROOT, b"n", 0, CTX)


# op -> (what it does, the name it stores, the type the mount shows)
OPS: dict[str, tuple[Callable[[Env], Awaitable[None]], str, int]] = {
    "mkdir": (make_dir, "n/", stat.S_IFDIR), "create": (make_file, "n", stat.S_IFREG),
    "symlink": (make_symlink, "n", stat.S_IFLNK), "symlink-dangling": (make_dangling_symlink, "n", stat.S_IFLNK),
    "mknod": (make_fifo, "n", stat.S_IFIFO),
    "rename": (rename_over, "n", stat.S_IFREG)}


async def delete_n(env: Env, stored_as: str) -> None:
    """This mount deletes `n` (of the kind `stored_as` says), leaving its own tombstone."""
    if stored_as.endswith("/"):
        await env.ops.mkdir(ROOT, b"n", 0o755, CTX)
        await env.ops.rmdir(ROOT, b"n", CTX)
    else:
        await make_file(env)
        await env.ops.unlink(ROOT, b"n", CTX)
    await env.settle()
    info = await env.store.get_info("b", stored_as)
    assert info is not None and info.deleted


@pytest.mark.parametrize("checked", [False, True], ids=["at-once", "after-the-check"])
@pytest.mark.parametrize("op", OPS)
def test_a_name_whose_tombstone_was_purged_behind_the_mounts_back_is_free(ops_env, op, checked):
    async def body(env: Env):
        do, stored_as, kind = OPS[op]
        await delete_n(env, stored_as)
        index = env.ns._buckets["b"].index
        assert stored_as in index.tombstones
        await env.streams.purge_subject(stream_name("b"), meta_subject("b", stored_as))  # another client
        assert await env.store.get_info("b", stored_as) is None
        if checked:
            w = env.ns._buckets["b"]
            w._last_activity = -1e9  # quiet, as at a check every 5 s
            await w.reconcile()
            assert stored_as not in index.tombstones
        await do(env)
        await env.settle()
        info = await env.store.get_info("b", stored_as)
        assert info is not None and not info.deleted
        assert stat.S_IFMT((await env.lookup("n")).st_mode) == kind
        if op == "rename":
            assert await env.cat("n") == b"the file m\n"
            gone = await env.store.get_info("b", "m")
            assert gone is None or gone.deleted  # (the rename's claim: a tombstone on a fresh nuid)
        elif op == "create":
            assert await env.cat("n") == b"new n\n"

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.parametrize("op", ["mkdir", "symlink", "symlink-dangling", "mknod"])
def test_a_live_object_another_client_put_where_the_tombstone_was_stays_a_conflict(ops_env, op):
    """The read-back after the refusal finds a live meta: it is not overwritten (EEXIST). (A create
    without O_EXCL would open that file, as POSIX has it: not a conflict.)"""
    async def body(env: Env):
        do, stored_as, _kind = OPS[op]
        await delete_n(env, stored_as)
        await env.streams.purge_subject(stream_name("b"), meta_subject("b", stored_as))
        theirs = await put_object(env.streams, "b", stored_as, b"")  # another client's object, unseen yet
        with pytest.raises(pyfuse3.FUSEError) as e:
            await do(env)
        assert errno_of(e.value) == errno.EEXIST
        info = await env.store.get_info("b", stored_as)
        assert info is not None and info.nuid == theirs.nuid

    ops_env(body, setup=bucket_b, bucket="b")


def test_the_check_drops_a_purged_tombstone_even_when_another_subject_keeps_the_count(ops_env, monkeypatch):
    """The tester's case: the tombstone's subject is purged while another subject appears, and a check
    runs before the watch has shown that subject: the server holds as many meta subjects as the index
    accounts for (the purged tombstone stands in for the new subject), so the check found nothing to
    list and took the stream as verified. The watch showing the new subject afterwards (a meta the
    check's stream state already held) must undo that verification, or the next check would skip the
    listing until the stream changes again, and the purged tombstone stayed in the index."""
    async def body(env: Env):
        await delete_n(env, "n/")
        w = env.ns._buckets["b"]
        real_apply = w._apply
        held: list[tuple[object, object]] = []
        monkeypatch.setattr(w, "_apply", lambda index, m: held.append((index, m)))  # the watch lags
        await env.streams.purge_subject(stream_name("b"), meta_subject("b", "n/"))
        await put_object(env.streams, "b", "other", b"x")
        await env.settle()
        assert held and "other" not in w.index.objects
        w._last_activity = -1e9  # quiet
        assert await w.reconcile() == 0  # same count: nothing listed
        monkeypatch.setattr(w, "_apply", real_apply)
        for index, m in held:  # the watch catches up
            w._apply(index, m)
        assert "other" in w.index.objects
        w._last_activity = -1e9
        await w.reconcile()
        assert "n/" not in w.index.tombstones
        assert w.index.meta_subject_count() == 2  # m, other
        await make_dir(env)
        assert stat.S_ISDIR((await env.lookup("n")).st_mode)

    ops_env(body, setup=bucket_b, bucket="b")
