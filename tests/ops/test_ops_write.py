"""Writes through natsfs.fs.Operations over MemoryStreams (no kernel): staging, uploads, conflicts,
renames and their crash order, attributes, links and xattrs."""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Any

import pyfuse3
import pytest
import trio
from gowriters import put_object
from opskit import ROOT, Ctx, Env, Fields, errno_of

from natsfs.adr20 import ROLLUP, ObjectStore, chunk_subject, digest_of, meta_json, meta_subject, stream_name
from natsfs.errors import JetStreamAPIError, NoSpace, PermissionDenied, Unavailable
from natsfs.memstreams import MemoryStreams
from natsfs.mutations import STREAM_BATCH


async def one_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=4 << 20)
    await put_object(ms, "b", "old.txt", b"old content")


def chunk_count(env: Env) -> int:
    return sum(n for s, n in env.streams.subjects(stream_name("b")).items() if ".C." in s)


async def err(coro: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)




async def write_file(env: Env, parent: int, name: str, data: bytes) -> int:
    fi, attr = await env.ops.create(parent, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    if data:
        assert await env.ops.write(fi.fh, 0, data) == len(data)
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)
    return attr.st_ino


async def stored(env: Env, name: str) -> bytes:
    info = await env.store.get_info("b", name)
    assert info is not None and not info.deleted
    data = b"".join(m.data for m in await env.store.fetch_chunks("b", info.nuid, 1, 10_000, 1 << 30))
    assert digest_of(data) == info.digest
    return data


async def chunks_left(env: Env, nuid: str) -> int:
    return len(await env.store.chunk_index("b", nuid))


def test_create_write_close_stores_an_object(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        await write_file(env, b, "new.bin", b"x" * 300_000)
        assert await stored(env, "new.bin") == b"x" * 300_000
        assert (await env.lookup("b/new.bin")).st_size == 300_000
        assert env.fs.staging.spool.used == 0 and len(env.fs.staging) == 0

    ops_env(body, setup=one_bucket)


def test_read_only_handles_never_upload(ops_env):
    async def body(env: Env):
        before = await env.store.get_info("b", "old.txt")
        f = await env.lookup("b/old.txt")
        writer = await env.ops.open(f.st_ino, os.O_WRONLY, Ctx())
        reader = await env.ops.open(f.st_ino, os.O_RDONLY, Ctx())
        await env.ops.write(writer.fh, 0, b"NEW")
        await env.ops.flush(reader.fh)  # a reader closing first stores nothing
        assert (await env.store.get_info("b", "old.txt")).revision == before.revision
        assert await env.ops.read(reader.fh, 0, 100) == b"NEW content"  # shared staged state
        await env.ops.flush(writer.fh)
        assert await stored(env, "old.txt") == b"NEW content"
        for fi in (reader, writer):
            await env.ops.release(fi.fh)

    ops_env(body, setup=one_bucket)


def test_conflict_keeps_both_versions(ops_env, tmp_path):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"mine")
        await put_object(env.streams, "b", "old.txt", b"theirs")
        assert await err(env.ops.flush(fi.fh)) == errno.ESTALE
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == b"theirs"
        kept = list((env.fs.staging.spool.lost_found / "b").iterdir())
        assert len(kept) == 1 and kept[0].read_bytes() == b"mine"
        assert env.fs.counters["conflicts"] == 1

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log(r"b/huge: closed without a successful upload \(bucket b: refused by the server: maximum "
                        r"bytes exceeded\); the bytes are kept at")
def test_bucket_limit_is_enospc_and_no_chunks_remain(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        fi, _ = await env.ops.create(b, b"huge", 0o644, os.O_WRONLY, Ctx())
        await env.ops.write(fi.fh, 0, os.urandom(6 << 20))
        assert await err(env.ops.flush(fi.fh)) == errno.ENOSPC
        await env.ops.release(fi.fh)
        assert await env.store.get_info("b", "huge") is None
        subjects = [s for s in env.streams.subjects(stream_name("b")) if ".C." in s]
        info = await env.store.get_info("b", "old.txt")
        assert subjects == [chunk_subject("b", info.nuid)]  # only the old object's chunks

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log("closed without a successful upload")
def test_a_full_bucket_logs_one_line_per_refused_file_naming_it_and_one_for_the_refusals(ops_env, caplog):
    """A run of closes refused by a full bucket: each file gets the one line that names it, says why and
    where its bytes are; the closes' own line names the bucket (not a base64 meta subject), the same
    text for all of them, so the repeat filter logs it once."""
    names = [f"n{i}" for i in range(5)]

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        for name in names:
            fi, _ = await env.ops.create(b, name.encode(), 0o644, os.O_WRONLY, Ctx())
            await env.ops.write(fi.fh, 0, os.urandom(100_000 if name == "n0" else 5 << 20))
            if name == "n0":
                await env.ops.flush(fi.fh)  # (fits: only the files over the bucket's room are refused)
            else:
                assert await err(env.ops.flush(fi.fh)) == errno.ENOSPC
            await env.ops.release(fi.fh)
        kept = {p.name.split(".")[0] for p in (env.fs.staging.spool.lost_found / "b").iterdir()}
        assert kept == set(names[1:])

    ops_env(body, setup=one_bucket)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [line for line in lines if "$O." in line]
    refusal = "bucket b: refused by the server: maximum bytes exceeded"
    assert [line for line in lines if not line.endswith(tuple(f"b/{n}" for n in names)) and "kept at" not in line
            ] == [f"flush: {refusal}"]
    per_file = [line for line in lines if "kept at" in line]
    assert [line.split(": ", 1)[0] for line in per_file] == [f"b/{n}" for n in names[1:]]
    assert all(f"closed without a successful upload ({refusal}); the bytes are kept at " in line for line in per_file)


def test_failed_meta_publish_purges_the_new_chunks_and_keeps_the_old_version(ops_env):
    async def body(env: Env):
        old = await env.store.get_info("b", "old.txt")
        f = await env.lookup("b/old.txt")
        fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"new bytes")
        env.streams.fail_next("publish", NoSpace("injected"), subject="$O.b.M.>")
        assert await err(env.ops.flush(fi.fh)) == errno.ENOSPC
        assert await stored(env, "old.txt") == b"old content"
        assert await chunks_left(env, old.nuid) == old.chunks
        # The staged bytes are still there: a retry (fsync) stores them.
        await env.ops.fsync(fi.fh, False)
        await env.ops.release(fi.fh)
        assert await stored(env, "old.txt") == b"new bytes"
        assert await chunks_left(env, old.nuid) == 0

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log("rename: crash")
@pytest.mark.expect_log(r"the meta publish got no answer \(crash\)")
def test_rename_crash_between_steps_never_loses_the_object(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        await write_file(env, b, "a", b"precious" * 1000)
        a = await env.store.get_info("b", "a")
        # The claim of the old name keeps failing (it is retried for a while): the object is reachable
        # under both names (same nuid).
        env.store.settle_timeout = 0.3
        env.streams.fail_next("publish", Unavailable("crash"), times=1000, subject=meta_subject("b", "a"))
        assert await err(env.ops.rename(b, b"a", b, b"c", 0, Ctx())) == errno.EIO
        env.streams._faults.clear()
        c = await env.store.get_info("b", "c")
        assert c.nuid == a.nuid
        await env.settle()
        # Deleting one of the two names must not purge the chunks the other still uses, nor leave a
        # tombstone carrying that nuid (another client's delete of `a` would purge it).
        await env.ops.unlink(b, b"a", Ctx())
        gone = await env.store.get_info("b", "a")
        assert gone is not None and gone.deleted and gone.nuid != a.nuid
        assert await stored(env, "c") == b"precious" * 1000

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log(r"the meta publish got no answer \(gone\)")
def test_a_directory_of_many_files_is_renamed_whole_and_a_failure_loses_nothing(ops_env):
    """Its objects are renamed several at a time: all arrive with their bytes, none stays behind, the
    marker moves first; a failing server midway is EIO, the objects moved are moved back, and every object
    is under one name or both."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        src = (await env.ops.mkdir(b, b"src", 0o755, Ctx())).st_ino
        sub = (await env.ops.mkdir(src, b"sub", 0o755, Ctx())).st_ino
        files = {f"src/f{i:02d}": bytes([i]) * (100 + i) for i in range(20)}
        files |= {f"src/sub/g{i}": bytes([100 + i]) * 50 for i in range(5)}
        for name, data in files.items():
            await write_file(env, sub if "/sub/" in name else src, name.rsplit("/", 1)[1], data)
        await env.ops.rename(b, b"src", b, b"dst", 0, Ctx())
        for name, data in files.items():
            assert (await env.store.get_info("b", name)).deleted
            assert await stored(env, "dst/" + name[4:]) == data
        assert (await env.store.get_info("b", "src/")).deleted
        # Again, with the server failing after a few renames.
        env.store.settle_timeout = 0.3
        env.streams.fail_next("publish", Unavailable("gone"), times=1000,
                              subject=meta_subject("b", "moved/f07"))
        assert await err(env.ops.rename(b, b"dst", b, b"moved", 0, Ctx())) == errno.EIO
        env.streams._faults.clear()
        for name, data in files.items():
            rest = name[4:]
            old, new = await env.store.get_info("b", "dst/" + rest), await env.store.get_info("b", "moved/" + rest)
            old = old if old is not None and not old.deleted else None
            new = new if new is not None and not new.deleted else None
            assert old is not None or new is not None, rest
            assert await stored(env, ("dst/" if old is not None else "moved/") + rest) == data

    ops_env(body, setup=one_bucket)


def test_the_watch_does_not_read_back_names_this_mount_renames_away(ops_env):
    """The new meta of our own rename arrives through the watch while the rename is under way: the old
    name is not suspected of having been renamed by another client (no read back per renamed object)."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        d = (await env.ops.mkdir(b, b"d", 0o755, Ctx())).st_ino
        for i in range(5):
            await write_file(env, d, f"f{i}", b"x" * (10 + i))
        await env.settle()
        before = env.streams.calls["last_msg"]
        env.streams.delay = 0.01  # a server round trip: the watch delivers the new meta mid-rename
        for i in range(5):
            await env.ops.rename(d, f"f{i}".encode(), b, f"g{i}".encode(), 0, Ctx())
        await env.ops.rename(b, b"d", b, b"e", 0, Ctx())
        env.streams.delay = 0
        await env.settle()
        await trio.sleep(0.3)  # past the watch's first read-back delays
        await env.settle()
        assert env.streams.calls["last_msg"] == before
        for i in range(5):
            assert await stored(env, f"g{i}") == b"x" * (10 + i)
            gone = await env.store.get_info("b", f"d/f{i}")
            assert gone is None or gone.deleted

    ops_env(body, setup=one_bucket)


def test_unlink_of_a_file_still_being_written_drops_it(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        fi, _ = await env.ops.create(b, b"tmp", 0o644, os.O_WRONLY, Ctx())
        await env.ops.write(fi.fh, 0, b"scratch")
        await env.ops.unlink(b, b"tmp", Ctx())
        await env.ops.write(fi.fh, 7, b" more")  # goes nowhere, as on a local disk
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await env.store.get_info("b", "tmp") is None
        assert "tmp" not in (await env.listdir(b)).names

    ops_env(body, setup=one_bucket)


def test_posix_attributes_are_metadata(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = 0o100600
        got = await env.ops.setattr(f.st_ino, attr, Fields(update_mode=True), None, Ctx())
        assert got.st_mode & 0o777 == 0o600
        doc, _ = await env.store.get_meta_doc("b", "old.txt")
        assert doc["metadata"] == {"natsfs.mode": "600"}
        assert await stored(env, "old.txt") == b"old content"

    ops_env(body, setup=one_bucket)


def test_xattrs_and_the_meta_size_limit(ops_env):
    async def body(env: Env):
        f = await env.lookup("b/old.txt")
        await env.ops.setxattr(f.st_ino, b"user.k", b"v", Ctx())
        assert await env.ops.getxattr(f.st_ino, b"user.k", Ctx()) == b"v"
        before = (await env.store.get_info("b", "old.txt")).revision
        assert await err(env.ops.setxattr(f.st_ino, b"user.big", b"z" * 5000, Ctx())) == errno.E2BIG
        assert (await env.store.get_info("b", "old.txt")).revision == before
        assert await err(env.ops.setxattr(f.st_ino, b"user.nats.nuid", b"x", Ctx())) == errno.EPERM
        assert await err(env.ops.setxattr(f.st_ino, b"trusted.x", b"x", Ctx())) == errno.EOPNOTSUPP
        assert await err(env.ops.getxattr(f.st_ino, b"user.none", Ctx())) == pyfuse3.ENOATTR

    ops_env(body, setup=one_bucket, max_meta_bytes=4096)


def test_mkdir_where_an_object_with_bytes_holds_the_marker_name(ops_env, caplog):
    """Another client's `dm/` with bytes shows as the file `dm%2F`; `mkdir dm` would replace it."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        await put_object(ms, "b", "dm/", b"content under a marker's name")

    async def body(env: Env):
        caplog.set_level("INFO")
        b = (await env.lookup("b")).st_ino
        assert await err(env.ops.mkdir(b, b"dm", 0o755, Ctx())) == errno.EEXIST
        assert await env.cat("b/dm%2F") == b"content under a marker's name"
        assert [r.levelname for r in caplog.records if "holds the name a directory marker needs" in r.message] \
            == ["INFO"]

    ops_env(body, setup=setup)


def test_rename_of_a_file_shown_under_a_marker_name_keeps_its_mtime(ops_env):
    """Another client's `tr/` with bytes is the file `tr%2F`, not a directory marker: `mv tr%2F t` keeps its
    mtime as `natsfs.mtime_ns`, as for any file (the new meta's timestamp showed, in every mount)."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        await put_object(ms, "b", "tr/", b"content under a marker's name")

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        mtime_ns = (await env.lookup("b/tr%2F")).st_mtime_ns
        await env.ops.rename(b, b"tr%2F", b, b"t", 0, Ctx())
        doc, _ = await env.store.get_meta_doc("b", "t")
        assert (doc.get("metadata") or {}).get("natsfs.mtime_ns") == str(mtime_ns)
        assert (await env.lookup("b/t")).st_mtime_ns == mtime_ns
        assert await env.cat("b/t") == b"content under a marker's name"

    ops_env(body, setup=setup)


@pytest.mark.expect_log(r"b/rep/: (closed without a successful upload|not stored) \(an empty object with this name "
                        r"is a directory marker")
def test_a_file_shown_under_a_marker_name_is_never_emptied_into_a_directory(ops_env, caplog):
    """Another client's `rep/` with bytes is the file `rep%2F`. Emptied (`truncate`, `open(O_TRUNC)` and
    close), its store would be an empty `rep/`: a directory marker, which showed as the directory `rep` in
    every mount, the file gone and another client's file `rep` hidden by it. Refused with `EPERM` instead,
    nothing stored (the emptied file is kept in lost+found, as any refused store); refilled after `O_TRUNC`,
    it is stored as any file."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        await put_object(ms, "b", "rep/", b"content under a marker's name")
        await put_object(ms, "b", "rep", b"a file of its own")

    async def body(env: Env):
        caplog.set_level("INFO")
        b = (await env.lookup("b")).st_ino
        before = await env.store.get_info("b", "rep/")
        ino = (await env.lookup("b/rep%2F")).st_ino
        attr = pyfuse3.EntryAttributes()
        attr.st_size = 0
        assert await err(env.ops.setattr(ino, attr, Fields(update_size=True), None, Ctx())) == errno.EPERM
        fi = await env.open(ino, os.O_WRONLY | os.O_TRUNC)
        assert await err(env.ops.flush(fi.fh)) == errno.EPERM
        await env.ops.release(fi.fh)
        await env.settle()
        assert (await env.store.get_info("b", "rep/")).revision == before.revision  # nothing stored
        assert (await env.listdir(b)).names == ["old.txt", "rep", "rep%2F"]
        assert stat.S_ISREG((await env.lookup("b/rep")).st_mode)
        assert await env.cat("b/rep") == b"a file of its own"
        assert await env.cat("b/rep%2F") == b"content under a marker's name"
        kept = sorted(p.name for p in (env.fs.staging.spool.lost_found / "b").iterdir())
        assert len(kept) == 2 and all(name.startswith("rep%2F.") for name in kept)

        fi = await env.open((await env.lookup("b/rep%2F")).st_ino, os.O_WRONLY | os.O_TRUNC)
        await env.ops.write(fi.fh, 0, b"new")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await stored(env, "rep/") == b"new"

    ops_env(body, setup=setup)


def test_chmod_of_a_directory_whose_marker_name_holds_a_file_is_refused_eperm(ops_env, caplog):
    """Another client's `g/` with bytes shows as the file `g%2F`, and `g/x` makes the directory `g`, which has
    no marker: a `chmod` or `utime` of `g` would store one, replacing that file. Refused `EPERM` with one
    line, nothing stored (was `EEXIST`, which chmod(2) never gives, and no line)."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        await put_object(ms, "b", "g/", b"content under a marker's name")
        await put_object(ms, "b", "g/x", b"x")

    async def body(env: Env):
        caplog.set_level("INFO")
        g = await env.lookup("b/g")
        before = await env.store.get_info("b", "g/")
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = stat.S_IFDIR | 0o700
        attr.st_mtime_ns = 10**18
        for fields in (Fields(update_mode=True), Fields(update_mtime=True)):
            assert await err(env.ops.setattr(g.st_ino, attr, fields, None, Ctx())) == errno.EPERM
        assert (await env.store.get_info("b", "g/")).revision == before.revision
        assert await env.cat("b/g%2F") == b"content under a marker's name"
        assert len([r for r in caplog.records if "holds the name the directory's marker needs" in r.message]) == 2

    ops_env(body, setup=setup)


def test_rename_of_a_directory_whose_marker_would_replace_a_file_is_refused_eperm(ops_env, caplog):
    """Another client's `e/` with bytes shows as the file `e%2F`. `mv d e` of a directory with a marker
    would move the marker `d/` onto `e/`, replacing that file: refused `EPERM` with one line, nothing moved
    (was `ESTALE` and a warning that another client changed it, which nothing had). A directory without a
    marker (only names under it) needs none there and moves."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        await put_object(ms, "b", "e/", b"content under a marker's name")
        await put_object(ms, "b", "implied/f", b"f")

    async def body(env: Env):
        caplog.set_level("INFO")
        b = (await env.lookup("b")).st_ino
        d = (await env.ops.mkdir(b, b"d", 0o755, Ctx())).st_ino
        await write_file(env, d, "f", b"in d")
        assert await err(env.ops.rename(b, b"d", b, b"e", 0, Ctx())) == errno.EPERM
        await env.settle()
        assert await env.cat("b/e%2F") == b"content under a marker's name"
        assert await env.cat("b/d/f") == b"in d"
        assert (await env.store.get_info("b", "d/")) is not None
        assert (await env.store.get_info("b", "e/f")) is None
        assert [r.levelname for r in caplog.records if "holds the name the moved directory's marker needs" in
                r.message] == ["INFO"]

        await env.ops.rename(b, b"implied", b, b"e", 0, Ctx())
        assert await env.cat("b/e/f") == b"f"
        assert await env.cat("b/e%2F") == b"content under a marker's name"

    ops_env(body, setup=setup)


def test_handles_opened_on_staged_bytes_that_lost_to_another_client_get_estale(ops_env):
    """A reader and a second writer open a file while a writer of this mount has it staged (they read and
    write those bytes, as on a local disk); another client's version wins, and the writer's close keeps
    the bytes in lost+found. The other handles then get `ESTALE`, a version gone under them; before, the
    chunk cache was asked for the staged version (the base's nuid, chunks 0) and failed `EIO` with an
    ERROR claiming the object damaged."""
    async def body(env: Env):
        ino = (await env.lookup("b/old.txt")).st_ino
        writer = await env.open(ino, os.O_RDWR)
        await env.ops.write(writer.fh, 0, b"NEW")
        reader = await env.open(ino, os.O_RDONLY)
        second = await env.open(ino, os.O_RDWR)
        assert await env.ops.read(reader.fh, 0, 100) == b"NEW content"
        await put_object(env.streams, "b", "old.txt", b"another client's")
        await env.settle()
        assert await err(env.ops.flush(writer.fh)) == errno.ESTALE
        await env.ops.release(writer.fh)
        assert await err(env.ops.read(reader.fh, 0, 100)) == errno.ESTALE
        assert await err(env.ops.write(second.fh, 0, b"more")) == errno.ESTALE
        # The inode is detached from the path (its handles hold a version the path no longer shows): an
        # ftruncate through the second handle stages from that version, ESTALE too; it truncated and
        # stored the other client's version, which that handle never read.
        assert env.fs.inodes.path_of(ino) != ("b", "old.txt")
        attr = pyfuse3.EntryAttributes()
        attr.st_size = 3
        assert await err(env.ops.setattr(ino, attr, Fields(update_size=True), second.fh, Ctx())) == errno.ESTALE
        late = await env.ops.open(ino, os.O_RDONLY, Ctx())  # through the inode the kernel still holds
        assert await err(env.ops.read(late.fh, 0, 100)) == errno.ESTALE
        await env.ops.release(late.fh)
        for h in (reader, second):
            await env.ops.flush(h.fh)
            await env.ops.release(h.fh)
        assert await env.cat("b/old.txt") == b"another client's"

    ops_env(body, setup=one_bucket)


def test_rename_over_an_entry_shown_under_an_escaped_name(ops_env):
    """Object `q\0` shows as `q%00`; `mv src q%00` replaces what shows there, as on a local disk: the
    literal name `q%00` is stored and `q\0` is deleted (was a false ESTALE every time)."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await one_bucket(ms, store)
        await put_object(ms, "b", "q\0", b"object with a NUL in its name")
        await put_object(ms, "b", "src", b"source")

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        await env.ops.rename(b, b"src", b, b"q%00", 0, Ctx())
        assert await env.cat("b/q%00") == b"source"
        assert (await env.store.get_info("b", "q\0")).deleted
        assert (await env.store.get_info("b", "q%00")).size == len(b"source")
        assert await err(env.lookup("b/src")) == errno.ENOENT

    ops_env(body, setup=setup)


def test_xattrs_on_a_directory(ops_env):
    """Names outside user.* are EOPNOTSUPP everywhere (`cp -a` then quietly falls back to chmod for
    system.posix_acl_access); user.* on a plain directory is EPERM (its marker holds no attributes)."""
    async def body(env: Env):
        d = await env.ops.mkdir((await env.lookup("b")).st_ino, b"d", 0o755, Ctx())
        acl = b"\x02\x00\x00\x00\x01\x00\x07\x00\xff\xff\xff\xff"
        assert await err(env.ops.setxattr(d.st_ino, b"system.posix_acl_access", acl, Ctx())) == errno.EOPNOTSUPP
        assert await err(env.ops.setxattr(d.st_ino, b"trusted.x", b"x", Ctx())) == errno.EOPNOTSUPP
        assert await err(env.ops.removexattr(d.st_ino, b"security.x", Ctx())) == errno.EOPNOTSUPP
        assert await err(env.ops.setxattr(d.st_ino, b"user.x", b"x", Ctx())) == errno.EPERM

    ops_env(body, setup=one_bucket)


def test_symlink_rules(ops_env):
    """Any target text is stored verbatim; one naming a stored object is also an ADR-20 link."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        link = await env.ops.symlink(b, b"l", b"old.txt", Ctx())
        assert await env.ops.readlink(link.st_ino, Ctx()) == b"old.txt"
        assert stat.S_ISLNK(link.st_mode) and link.st_size == len(b"old.txt")
        doc, _ = await env.store.get_meta_doc("b", "l")
        assert doc["options"] == {"link": {"bucket": "b", "name": "old.txt"}}
        # The caller (uid 1000, not the mount's) owns the link, as on a local disk.
        assert doc["metadata"] == {"natsfs.symlink": "old.txt", "natsfs.uid": "1000", "natsfs.gid": "1000"}
        assert (link.st_uid, link.st_gid) == (1000, 1000)
        for name, text in ((b"l2", b"l"), (b"l3", b"missing/later"), (b"l4", b"../../etc"),
                           (b"l5", b"/etc/passwd"), (b"l6", b"./a//b/../c")):
            attr = await env.ops.symlink(b, name, text, Ctx())
            assert await env.ops.readlink(attr.st_ino, Ctx()) == text
            doc, _ = await env.store.get_meta_doc("b", name.decode())
            assert doc["size"] == 0 and "link" not in doc["options"]
            assert doc["metadata"]["natsfs.symlink"] == text.decode()
            # Texts that could leave the mount carry this user's signature; contained ones need none.
            assert ("natsfs.symlink_sig" in doc["metadata"]) == (name in (b"l4", b"l5", b"l6"))
        assert await err(env.ops.symlink(b, b"l", b"x", Ctx())) == errno.EEXIST
        assert await err(env.ops.symlink(b, b"bad", b"\xff", Ctx())) == errno.EILSEQ
        await env.ops.unlink(b, b"l", Ctx())
        assert await stored(env, "old.txt") == b"old content"

    ops_env(body, setup=one_bucket)


def test_symlink_is_an_adr20_link_only_to_the_object_the_kernel_follows_it_to(ops_env):
    """The kernel resolves `x/..` physically: a text reaching `old.txt` only when read lexically (through
    a symlink, a missing name, a file, or with a trailing `/`) leads nowhere in this mount, so it must not
    become an ADR-20 link that other clients follow to `old.txt`."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        d = (await env.ops.mkdir(b, b"d", 0o755, Ctx())).st_ino
        await env.ops.mkdir(d, b"e", 0o755, Ctx())
        await env.ops.symlink(b, b"deep", b"d/e", Ctx())  # deep/.. is d, not b

        async def linked(text: bytes) -> dict[str, Any] | None:
            name = f"l{len(env.streams.subjects(stream_name('b')))}".encode()
            attr = await env.ops.symlink(b, name, text, Ctx())
            assert await env.ops.readlink(attr.st_ino, Ctx()) == text
            doc, _ = await env.store.get_meta_doc("b", name.decode())
            return doc["options"].get("link")

        for text in (b"deep/../old.txt", b"missing/../old.txt", b"old.txt/../old.txt", b"old.txt/",
                     b"old.txt/.", b"../b/old.txt/.."):
            assert await linked(text) is None, text
        for text in (b"d/../old.txt", b"d/e/../../old.txt", b"./old.txt", b"../b/old.txt"):
            assert await linked(text) == {"bucket": "b", "name": "old.txt"}, text
        assert await linked(b"../b/") == {"bucket": "b"}
        assert await linked(b"d/../../b") == {"bucket": "b"}

    ops_env(body, setup=one_bucket)


def test_a_moved_symlink_keeps_reading_as_its_text(ops_env):
    """A rename never changes a symlink's text on a local disk. A text that stays in the mount only from
    its old place (`../../b/old.txt` one directory up, or its directory moved up) is signed as it moves:
    it read as its ADR-20 link's computed target or `nats-object:?/outside-link` (one WARNING that said
    another client wrote it) after `mv`."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        m1 = (await env.ops.mkdir(b, b"m1", 0o755, Ctx())).st_ino
        m2 = (await env.ops.mkdir(m1, b"m2", 0o755, Ctx())).st_ino
        await env.ops.symlink(m1, b"to-old", b"../../b/old.txt", Ctx())  # also an ADR-20 link
        await env.ops.symlink(m2, b"up3", b"../../../x", Ctx())
        await env.ops.symlink(m2, b"near", b"sibling", Ctx())
        await put_object(env.streams, "b", "m1/m2/theirs", b"", metadata={"natsfs.symlink": "/etc/shadow"})
        await env.settle()

        async def text(path: str) -> bytes:
            return await env.ops.readlink((await env.lookup(path)).st_ino, Ctx())

        await env.ops.rename(m1, b"to-old", b, b"to-old-up", 0, Ctx())
        await env.ops.rename(m1, b"m2", b, b"m2-up", 0, Ctx())
        await env.settle()
        assert await text("b/to-old-up") == b"../../b/old.txt"
        assert await text("b/m2-up/up3") == b"../../../x"
        assert await text("b/m2-up/near") == b"sibling"
        assert await text("b/m2-up/theirs") == b"nats-object:?/outside-link"  # not this user's: stays so
        signed = {}
        for name in ("to-old-up", "m2-up/up3", "m2-up/near", "m2-up/theirs"):
            doc, _ = await env.store.get_meta_doc("b", name)
            signed[name] = "natsfs.symlink_sig" in doc["metadata"]
        assert signed == {"to-old-up": True, "m2-up/up3": True, "m2-up/near": False, "m2-up/theirs": False}
        doc, _ = await env.store.get_meta_doc("b", "to-old-up")
        assert doc["options"]["link"] == {"bucket": "b", "name": "old.txt"}

        # A signing key the signer refuses does not refuse the rename: the text just moves unsigned.
        def refuse(bucket: str, text: str) -> str:
            raise PermissionDenied("the key is another user's")

        await env.ops.symlink(m1, b"again", b"../../b/old.txt", Ctx())
        env.fs.signer.sign = refuse  # type: ignore[method-assign]
        await env.ops.rename(m1, b"again", b, b"again-up", 0, Ctx())
        doc, _ = await env.store.get_meta_doc("b", "again-up")
        assert "natsfs.symlink_sig" not in doc["metadata"]

    ops_env(body, setup=one_bucket)


def test_symlink_text_from_other_clients_stays_in_the_mount(ops_env):
    """natsfs.symlink written by another client (no valid signature of this user) shows verbatim only
    when it cannot leave the mount."""
    async def body(env: Env):
        for name, text in (("in", "old.txt"), ("up", "../../../etc/shadow"), ("abs", "/etc/shadow"),
                           ("dotdot-late", "sub/../../x")):
            await put_object(env.streams, "b", name, b"", metadata={"natsfs.symlink": text,
                                                                   "natsfs.symlink_sig": "00" * 32})
        await put_object(env.streams, "b", "with-bytes", b"data", metadata={"natsfs.symlink": "old.txt"})
        await env.settle()

        async def shown(name: str) -> bytes:
            attr = await env.lookup(f"b/{name}")
            assert stat.S_ISLNK(attr.st_mode)
            return await env.ops.readlink(attr.st_ino, Ctx())

        assert await shown("in") == b"old.txt"
        for name in ("up", "abs", "dotdot-late"):
            assert await shown(name) == b"nats-object:?/outside-link"
        assert stat.S_ISREG((await env.lookup("b/with-bytes")).st_mode)
        # This user's own signed text shows verbatim.
        signed = env.fs.signer.sign("b", "/etc/hostname")
        await put_object(env.streams, "b", "mine", b"", metadata={"natsfs.symlink": "/etc/hostname",
                                                                 "natsfs.symlink_sig": signed})
        await env.settle()
        assert await shown("mine") == b"/etc/hostname"

    ops_env(body, setup=one_bucket)


def test_buckets_by_mkdir_and_rmdir(ops_env):
    async def body(env: Env):
        attr = await env.ops.mkdir(ROOT, b"fresh", 0o755, Ctx())
        assert attr.st_mode & 0o040000
        assert "fresh" in await env.store.list_buckets()
        assert await err(env.ops.mkdir(ROOT, b"bad.name", 0o755, Ctx())) == errno.EINVAL
        assert await err(env.ops.mkdir(ROOT, b"fresh", 0o755, Ctx())) == errno.EEXIST
        assert await err(env.ops.rmdir(ROOT, b"b", Ctx())) == errno.ENOTEMPTY
        await env.ops.rmdir(ROOT, b"fresh", Ctx())
        assert "fresh" not in await env.store.list_buckets()

    ops_env(body, setup=one_bucket)


@pytest.mark.expect_log(r"skipping malformed meta")
def test_rmdir_of_a_bucket_counts_objects_this_mount_does_not_show(ops_env):
    """A meta this mount skips (an unusable nuid, a size in 0 chunks, under another name's subject) is
    still an object nats.go lists: `rmdir` of the bucket, empty as shown, deleted them with it."""
    odd_metas = (("bad-nuid", "bad-nuid", {"nuid": "not a token", "size": 3, "chunks": 1}),
                 ("no-chunks", "no-chunks", {"nuid": "n1", "size": 3, "chunks": 0}),
                 ("on-another-subject", "elsewhere", {"nuid": "n2", "size": 0, "chunks": 0}))

    async def body(env: Env):
        for name, subject_name, fields in odd_metas:
            await env.store.create_bucket(name)
            doc = {"name": name, "bucket": name, "mtime": "2024-01-01T00:00:00Z", **fields}
            await env.streams.publish(meta_subject(name, subject_name), meta_json(doc), {ROLLUP: "sub"})
            assert (await env.listdir((await env.lookup(name)).st_ino)).names == []  # looks empty
            assert await err(env.ops.rmdir(ROOT, name.encode(), Ctx())) == errno.ENOTEMPTY
            assert name in await env.store.list_buckets()
        # Delete markers alone still leave a bucket that rmdir deletes.
        await env.store.create_bucket("tombs")
        await env.streams.publish(meta_subject("tombs", "gone"), meta_json(
            {"name": "gone", "bucket": "tombs", "nuid": "n3", "deleted": True}), {ROLLUP: "sub"})
        await env.ops.rmdir(ROOT, b"tombs", Ctx())
        assert "tombs" not in await env.store.list_buckets()

    ops_env(body, setup=one_bucket)


def test_rmdir_of_a_bucket_with_a_file_being_written_is_enotempty(ops_env):
    """A new file this mount shows but has not stored yet is an entry of its bucket, as on a local disk:
    rmdir deleted the bucket under it, and its close failed ENOENT with its bytes in lost+found."""
    async def body(env: Env):
        fresh = await env.ops.mkdir(ROOT, b"fresh", 0o755, Ctx())
        fi, _ = await env.ops.create(fresh.st_ino, b"new.txt", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, b"being written")
        assert await err(env.ops.rmdir(ROOT, b"fresh", Ctx())) == errno.ENOTEMPTY
        assert "fresh" in await env.store.list_buckets()
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        info = await env.store.get_info("fresh", "new.txt")
        assert info is not None and info.size == len(b"being written")

    ops_env(body, setup=one_bucket)


@pytest.mark.parametrize("description, err_code", [("maximum number of streams reached", 10027),
                                                    ("insufficient storage resources available", 10047),
                                                    ("stream max bytes exceeds account limit max stream bytes",
                                                     10122)])
def test_a_bucket_the_accounts_limits_leave_no_room_for_is_enospc_said_once(ops_env, caplog, description,
                                                                            err_code):
    """mkdir at the root when the account's JetStream limits (max_streams, storage to reserve) refuse the
    stream: ENOSPC, as a full disk refuses a mkdir, with one WARNING naming the limit; not EIO logged as
    an ERROR. Nothing is created, and the next mkdir the limits allow works."""

    async def body(env: Env):
        caplog.set_level(logging.DEBUG)
        env.streams.fail_next("create_stream", JetStreamAPIError(description, code=400, err_code=err_code))
        assert await err(env.ops.mkdir(ROOT, b"fresh", 0o755, Ctx())) == errno.ENOSPC
        assert "fresh" not in await env.store.list_buckets()
        lines = [r for r in caplog.records if description in r.getMessage()]
        assert [(r.levelno, r.getMessage()) for r in lines] == [
            (logging.WARNING, f"mkdir: bucket fresh not created: the account's JetStream limits leave no room "
                              f"for it ({description})")]
        await env.ops.mkdir(ROOT, b"fresh", 0o755, Ctx())
        assert "fresh" in await env.store.list_buckets()

    ops_env(body, setup=one_bucket)


def test_mkdir_of_a_bucket_name_too_long_for_a_stream_is_enametoolong(ops_env, caplog):
    """A stream name is at most 255 characters, so a bucket name at most 251 ("OBJ_" + name): a longer
    one (still a valid file name) was sent to the server, whose refusal became EIO with an ERROR line."""
    async def body(env: Env):
        longest = b"n" * 251
        assert (await env.ops.mkdir(ROOT, longest, 0o755, Ctx())).st_mode & 0o040000
        for size in (252, 255):
            assert await err(env.ops.mkdir(ROOT, b"n" * size, 0o755, Ctx())) == errno.ENAMETOOLONG
        assert sorted(len(b) for b in await env.store.list_buckets()) == [1, 251]

    with caplog.at_level(logging.INFO):
        ops_env(body, setup=one_bucket)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_fast_tier_streams_a_growing_file_before_it_is_closed(ops_env):
    """Streaming uploads run in the ops tier: the full chunks of a file written from the front are on
    the server before close, and close adds only the rest and the meta."""

    async def body(env: Env):
        chunk = env.config.chunk_size
        data = os.urandom(6 * 1024 * 1024)
        fi, _ = await env.ops.create(ROOT, b"growing.bin", 0o644, os.O_WRONLY, Ctx())
        for off in range(0, len(data), 1 << 20):
            await env.ops.write(fi.fh, off, data[off : off + (1 << 20)])
        streamed = 0
        with trio.move_on_after(10):
            while streamed < STREAM_BATCH // chunk:
                await trio.sleep(0.01)
                streamed = chunk_count(env)
        assert streamed >= STREAM_BATCH // chunk  # sent while still open
        assert await env.store.get_info("b", "growing.bin") is None  # no meta before close
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        info = await env.store.get_info("b", "growing.bin")
        assert info is not None and info.size == len(data) and chunk_count(env) == -(-len(data) // chunk)
        assert await env.cat("growing.bin") == data

    async def big_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b", atomic=False)  # (an atomic bucket puts a file this size whole at close)

    ops_env(body, setup=big_bucket, bucket="b")


class FakeOpeners:
    """Which thread groups still hold a descriptor open for writing (what /proc would say)."""

    def __init__(self) -> None:
        self.holding: set[int] = set()

    def thread_group(self, pid: int) -> int | None:
        return pid + 1000  # a thread of process pid+1000

    def opened(self, tgid: int, ino: int) -> None:
        pass

    def located(self, tgid: int, ino: int) -> None:
        pass

    def still_holds(self, tgid: int, ino: int, max_fds: int | None = None) -> bool | None:
        return tgid in self.holding


def test_flush_stores_only_at_the_openers_last_close(ops_env):
    """A flush while the opener still holds the descriptor (a child closing what it inherited) stores
    nothing; the opener's close stores once; a deferred store happens at the last release."""
    async def body(env: Env):
        openers = env.fs.openers = FakeOpeners()
        b = (await env.lookup("b")).st_ino
        fi, _ = await env.ops.create(b, b"part", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        openers.holding.add(Ctx.pid + 1000)
        await env.ops.write(fi.fh, 0, b"first")
        await env.ops.flush(fi.fh)  # the child's close
        assert await env.store.get_info("b", "part") is None
        await env.ops.write(fi.fh, 5, b"second")
        openers.holding.clear()
        await env.ops.flush(fi.fh)  # the opener's close
        await env.ops.release(fi.fh)
        assert await stored(env, "part") == b"firstsecond"
        stats = env.fs.stats()["fs"]
        assert (stats["uploads"], stats["upload_bytes"], stats["flushes_deferred"]) == (1, 11, 1)

        # Only other processes' flushes came: the last release stores.
        fi, _ = await env.ops.create(b, b"late", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        openers.holding.add(Ctx.pid + 1000)
        await env.ops.write(fi.fh, 0, b"late bytes")
        await env.ops.flush(fi.fh)
        assert await env.store.get_info("b", "late") is None
        await env.ops.release(fi.fh)
        assert await stored(env, "late") == b"late bytes"
        assert env.fs.stats()["fs"]["uploads"] == 2

    ops_env(body, setup=one_bucket)


def test_symlink_and_mknod_at_the_root_of_a_bucket_mount(ops_env):
    """The root of a `--bucket` mount is the bucket: new entries of every kind land there."""
    async def body(env: Env):
        link = await env.ops.symlink(ROOT, b"l", b"old.txt", Ctx())
        assert await env.ops.readlink(link.st_ino, Ctx()) == b"old.txt"
        fifo = await env.ops.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o644, 0, Ctx())
        assert stat.S_IFMT(fifo.st_mode) == stat.S_IFIFO
        doc, _ = await env.store.get_meta_doc("b", "l")
        assert doc["options"] == {"link": {"bucket": "b", "name": "old.txt"}}
        assert (await env.store.get_meta_doc("b", "fifo"))[0]["metadata"]["natsfs.type"] == "fifo"
        assert await err(env.ops.symlink(ROOT, b"l", b"x", Ctx())) == errno.EEXIST

    ops_env(body, setup=one_bucket, bucket="b")


def test_mknod_stores_an_empty_object_with_its_type_and_rdev(ops_env):
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        attr = await env.ops.mknod(b, b"dev", stat.S_IFBLK | 0o600, os.makedev(8, 1), Ctx())
        assert stat.S_IFMT(attr.st_mode) == stat.S_IFBLK and attr.st_rdev == os.makedev(8, 1)
        fifo = await env.ops.mknod(b, b"fifo", stat.S_IFIFO | 0o644, 0, Ctx())
        assert stat.S_IFMT(fifo.st_mode) == stat.S_IFIFO and fifo.st_rdev == 0
        doc, _ = await env.store.get_meta_doc("b", "dev")
        assert doc["size"] == 0 and doc["metadata"]["natsfs.type"] == "block"
        assert doc["metadata"]["natsfs.rdev"] == str(os.makedev(8, 1))
        assert await err(env.ops.mknod(b, b"fifo", stat.S_IFIFO | 0o644, 0, Ctx())) == errno.EEXIST
        # chmod keeps the type; an object another client filled with bytes is a regular file.
        chmod = pyfuse3.EntryAttributes()
        chmod.st_mode = stat.S_IFIFO | 0o600
        await env.ops.setattr(fifo.st_ino, chmod, Fields(update_mode=True), None, Ctx())
        assert (await env.lookup("b/fifo")).st_mode == stat.S_IFIFO | 0o600
        await put_object(env.streams, "b", "fifo", b"bytes now", metadata={"natsfs.type": "fifo"})
        await env.settle()
        assert stat.S_ISREG((await env.lookup("b/fifo")).st_mode)

    ops_env(body, setup=one_bucket)
