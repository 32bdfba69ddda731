"""Setuid and setgid bits as a local disk keeps them (see SEMANTICS, *Attributes*): a setgid directory
gives new entries its group (and new directories its setgid bit), on a mount that shows the bit
(`--allow-setuid`); a chown, and a write or truncate by a caller other than root, clear a regular
file's stored setuid bit (and its setgid bit where group execute is set), whatever the mount shows."""

from __future__ import annotations

import os
import stat

import pyfuse3
import pytest
from gowriters import put_object
from opskit import ROOT, Ctx, Env, Fields

from natsfs.adr20 import ObjectStore
from natsfs.memstreams import MemoryStreams


class Root(Ctx):
    uid = 0
    gid = 0


class Nobody(Ctx):
    uid = 65534
    gid = 65534


async def a_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")


async def stored_metadata(env: Env, name: str) -> dict:
    doc, _ = await env.store.get_meta_doc("b", name)
    return doc.get("metadata") or {}


async def chmod(env: Env, ino: int, mode: int, ctx: Ctx) -> None:
    attr = pyfuse3.EntryAttributes()
    attr.st_mode = stat.S_IFREG | mode
    await env.ops.setattr(ino, attr, Fields(update_mode=True), None, ctx)


@pytest.mark.parametrize("allow_setuid", [True, False])
def test_a_setgid_directory_passes_its_group_and_its_setgid_bit_on(ops_env, allow_setuid):
    """mkdir sg; chown 0:65534 sg; chmod 2775 sg; then root makes a file, a directory and a FIFO there:
    on an --allow-setuid mount they get group 65534 and the directory 2755, as on a local disk (they got
    root's group and 755). Without --allow-setuid the bit does not show, and neither does its effect."""
    async def body(env: Env) -> None:
        sg = await env.ops.mkdir(ROOT, b"sg", 0o755, Root())
        owner = pyfuse3.EntryAttributes()
        owner.st_uid, owner.st_gid = 0, 65534
        await env.ops.setattr(sg.st_ino, owner, Fields(update_uid=True, update_gid=True), None, Root())
        mode = pyfuse3.EntryAttributes()
        mode.st_mode = stat.S_IFDIR | 0o2775
        await env.ops.setattr(sg.st_ino, mode, Fields(update_mode=True), None, Root())

        fi, f = await env.ops.create(sg.st_ino, b"f", 0o644, os.O_WRONLY | os.O_CREAT, Root())
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        sub = await env.ops.mkdir(sg.st_ino, b"sub", 0o755, Root())
        fifo = await env.ops.mknod(sg.st_ino, b"fifo", stat.S_IFIFO | 0o644, 0, Root())
        await env.settle()
        shown = {name: (stat.S_IMODE(a.st_mode), a.st_gid) for name, a in
                 (("f", f), ("sub", sub), ("fifo", fifo), ("f again", await env.lookup("sg/f")),
                  ("sub again", await env.lookup("sg/sub")))}
        if allow_setuid:
            assert shown == {"f": (0o644, 65534), "sub": (0o2755, 65534), "fifo": (0o644, 65534),
                             "f again": (0o644, 65534), "sub again": (0o2755, 65534)}
            assert (await stored_metadata(env, "sg/sub/"))["natsfs.mode"] == "2755"
            assert (await stored_metadata(env, "sg/f"))["natsfs.gid"] == "65534"
        else:
            assert {g for _, g in shown.values()} == {0}
            assert shown["sub"][0] == 0o755

    ops_env(body, setup=a_bucket, bucket="b", allow_setuid=allow_setuid)


async def a_setid_file(env: Env, name: str, mode: int) -> int:
    fi, attr = await env.ops.create(ROOT, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT, Root())
    assert await env.ops.write(fi.fh, 0, b"x") == 1
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)
    await chmod(env, attr.st_ino, mode, Root())
    await env.settle()
    assert (await stored_metadata(env, name))["natsfs.mode"] == f"{mode:o}"
    return attr.st_ino


# mode: what a write or truncate by nobody (not in the file's group) leaves, as on a local disk (Linux 6)
MODES = {0o4777: 0o777, 0o2777: 0o777, 0o6767: 0o767, 0o2767: 0o767, 0o6755: 0o755}
# mode: what a chown by root leaves (setgid without group execute stays: root may keep it)
CHOWNED = {0o4777: 0o777, 0o2777: 0o777, 0o6767: 0o2767, 0o2767: 0o2767, 0o6755: 0o755}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m:o}")
def test_an_append_by_another_user_clears_the_stored_setuid_and_setgid_bits(ops_env, mode):
    """`echo more >> f` by nobody, f 4777 owned by root: a local disk clears the setuid bit (and setgid
    where group execute is set); the mount kept 4777 in the meta (the kernel, shown no such bits, did not
    clear them), so a later --allow-setuid mount showed a setuid file someone else had written."""
    async def body(env: Env) -> None:
        ino = await a_setid_file(env, "f", mode)
        fi = await env.ops.open(ino, os.O_WRONLY | os.O_APPEND, Nobody())
        assert await env.ops.write(fi.fh, 1, b"more") == 4
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert await env.cat("f") == b"xmore"
        assert (await stored_metadata(env, "f"))["natsfs.mode"] == f"{MODES[mode]:o}"

    ops_env(body, setup=a_bucket, bucket="b")


def test_a_write_by_root_keeps_the_setuid_bit_and_a_write_by_its_owner_does_not(ops_env):
    """Root writes with CAP_FSETID: the bits stay. Any other caller clears them, the file's owner too."""
    async def body(env: Env) -> None:
        ino = await a_setid_file(env, "f", 0o4755)
        fi = await env.ops.open(ino, os.O_WRONLY, Root())
        await env.ops.write(fi.fh, 0, b"y")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert (await stored_metadata(env, "f"))["natsfs.mode"] == "4755"
        owner = pyfuse3.EntryAttributes()
        owner.st_uid = 1000
        await env.ops.setattr(ino, owner, Fields(update_uid=True), None, Root())  # (clears it: chown)
        await chmod(env, ino, 0o4755, Root())
        fi = await env.ops.open(ino, os.O_RDWR, Ctx())  # uid 1000, the owner
        await env.ops.write(fi.fh, 0, b"z")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert (await stored_metadata(env, "f"))["natsfs.mode"] == "755"

    ops_env(body, setup=a_bucket, bucket="b")


def test_a_write_by_a_member_of_the_files_group_keeps_setgid_without_group_execute(ops_env):
    """2767 of group 1000 written by a caller of group 1000: stays 2767 (no group execute: the kernel
    keeps it for a member of the file's group); 2777 loses it."""
    async def body(env: Env) -> None:
        for name, mode, left in (("lock", 0o2767, 0o2767), ("exec", 0o2777, 0o777)):
            ino = await a_setid_file(env, name, mode)
            group = pyfuse3.EntryAttributes()
            group.st_gid = 1000
            await env.ops.setattr(ino, group, Fields(update_gid=True), None, Root())
            await chmod(env, ino, mode, Root())
            fi = await env.ops.open(ino, os.O_WRONLY, Ctx())  # uid 1000, gid 1000
            await env.ops.write(fi.fh, 0, b"y")
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)
            await env.settle()
            assert (await stored_metadata(env, name))["natsfs.mode"] == f"{left:o}"

    ops_env(body, setup=a_bucket, bucket="b")


@pytest.mark.parametrize("how", ["truncate", "O_TRUNC open"])
def test_a_truncate_by_another_user_clears_the_setuid_bit(ops_env, how):
    async def body(env: Env) -> None:
        ino = await a_setid_file(env, "f", 0o4777)
        if how == "truncate":
            size = pyfuse3.EntryAttributes()
            size.st_size = 0
            await env.ops.setattr(ino, size, Fields(update_size=True), None, Nobody())
        else:
            fi = await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Nobody())
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)
        await env.settle()
        assert await env.cat("f") == b""
        assert (await stored_metadata(env, "f"))["natsfs.mode"] == "777"

    ops_env(body, setup=a_bucket, bucket="b")


@pytest.mark.parametrize("mode", CHOWNED, ids=lambda m: f"{m:o}")
def test_a_chown_clears_the_setuid_bit_and_the_setgid_bit_with_group_execute(ops_env, mode):
    """chown nobody:nogroup of a 6755 file by root: 755 on a local disk, and in the meta now."""
    async def body(env: Env) -> None:
        ino = await a_setid_file(env, "f", mode)
        owner = pyfuse3.EntryAttributes()
        owner.st_uid, owner.st_gid = 65534, 65534
        await env.ops.setattr(ino, owner, Fields(update_uid=True, update_gid=True), None, Root())
        await env.settle()
        metadata = await stored_metadata(env, "f")
        assert (metadata["natsfs.mode"], metadata["natsfs.uid"]) == (f"{CHOWNED[mode]:o}", "65534")

    ops_env(body, setup=a_bucket, bucket="b", allow_setuid=True)


def test_a_chown_of_a_directory_keeps_its_setgid_bit(ops_env):
    async def body(env: Env) -> None:
        d = await env.ops.mkdir(ROOT, b"d", 0o2775, Root())
        owner = pyfuse3.EntryAttributes()
        owner.st_gid = 65534
        await env.ops.setattr(d.st_ino, owner, Fields(update_gid=True), None, Root())
        await env.settle()
        assert (await stored_metadata(env, "d/"))["natsfs.mode"] == "2775"

    ops_env(body, setup=a_bucket, bucket="b", allow_setuid=True)


async def a_stored_setuid_file(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "f", b"x", metadata={"natsfs.mode": "4755"})


def test_a_read_by_another_user_keeps_the_setuid_bit(ops_env):
    """Only a change clears: an open for writing that writes nothing, and reads, leave the meta alone."""
    async def body(env: Env) -> None:
        ino = (await env.lookup("f")).st_ino
        fi = await env.ops.open(ino, os.O_RDWR, Nobody())
        assert await env.ops.read(fi.fh, 0, 10) == b"x"
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert (await stored_metadata(env, "f"))["natsfs.mode"] == "4755"

    ops_env(body, setup=a_stored_setuid_file, bucket="b")
