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

from natsfs.adr20 import ObjectStore, chunk_subject, digest_of, meta_subject, stream_name
from natsfs.errors import NoSpace, Unavailable
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
