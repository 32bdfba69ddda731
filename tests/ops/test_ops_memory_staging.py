"""Write-back mode keeps small files in memory: new files are born there, rewritten ones move there
once their journal record holds their bytes (`StagedFile.to_memory`). A burst of small closes leaves no
spool files behind, and every way out of memory (growing past the inline size, a conflict kept in
lost+found, an unmount, a crash and replay) gives the exact bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pyfuse3
import trio
from gowriters import put_object
from opskit import ROOT, Ctx, Env, Fields
from test_ops_write import stored, write_file

from natsfs.adr20 import ObjectStore
from natsfs.compose import spool_root
from natsfs.core.filesystem import AttrChanges
from natsfs.core.writeback import INLINE_BYTES
from natsfs.memstreams import MemoryStreams
from natsfs.staging import MEMORY_STAGED_MAX

LATER = 3600.0  # uploads happen only when the test asks (shutdown)


async def bucket_b(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b", max_bytes=1 << 24)
    await put_object(ms, "b", "old.txt", b"old content")


def spool_files(env: Env) -> list[Path]:
    """Spool files that hold bytes (the empty ones made ahead for new files do not count)."""
    return [p for p in env.fs.staging.spool.dir.iterdir() if p.stat().st_size > 0]


def bodies(n: int) -> dict[str, bytes]:
    return {f"f{i:03d}.txt": os.urandom(100 + 37 * i) for i in range(n)}


def test_a_burst_of_small_new_files_makes_no_spool_file_and_every_byte_reads_back(ops_env):
    async def body(env: Env):
        files = bodies(50)
        for name, data in files.items():
            await write_file(env, ROOT, name, data)
        # New files are born in memory; closed at up to INLINE_BYTES their journal records hold them.
        assert list(env.fs.staging.spool.dir.iterdir()) == []  # (and none made ahead for them)
        assert env.fs.staging.spool.memory_used == sum(-(-len(d) // 4096) * 4096 for d in files.values())
        for name, data in files.items():
            assert await env.cat(name) == data
        assert await env.store.get_info("b", "f000.txt") is None  # nothing uploaded yet
        await env.fs.shutdown(30)
        for name, data in files.items():
            assert await stored(env, name) == data
        assert env.fs.staging.spool.memory_used == 0
        assert spool_files(env) == []

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_a_file_in_memory_that_grows_past_the_inline_size_goes_back_to_a_spool_file(ops_env):
    async def body(env: Env):
        first = os.urandom(1000)
        ino = await write_file(env, ROOT, "grows.bin", first)
        await write_file(env, ROOT, "next.txt", b"next")  # drops grows.bin's spool file
        sf = env.fs.staging.get(ino)
        assert sf is not None and sf.in_memory and not sf.spool_path.exists()
        more = os.urandom(INLINE_BYTES + 5000)
        fi = await env.ops.open(ino, os.O_WRONLY, None)
        assert await env.ops.write(fi.fh, len(first), more) == len(more)
        assert not sf.in_memory and sf.spool_path.read_bytes() == first + more
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await env.cat("grows.bin") == first + more
        await env.fs.shutdown(30)
        assert await stored(env, "grows.bin") == first + more
        assert await stored(env, "next.txt") == b"next"

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_a_truncate_past_the_inline_size_goes_back_to_a_spool_file_with_zeros(ops_env):
    async def body(env: Env):
        ino = await write_file(env, ROOT, "sparse.bin", b"head")
        await write_file(env, ROOT, "next.txt", b"next")
        sf = env.fs.staging.get(ino)
        assert sf is not None and sf.in_memory
        await env.fs.setattr(ino, AttrChanges(size=3 * INLINE_BYTES))
        assert not sf.in_memory
        await env.fs.shutdown(30)
        assert await stored(env, "sparse.bin") == b"head" + bytes(3 * INLINE_BYTES - 4)

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_a_conflicting_file_in_memory_is_kept_in_lost_found_byte_exact(ops_env, tmp_path):
    async def body(env: Env):
        fi = await env.ops.open((await env.lookup("old.txt")).st_ino, os.O_WRONLY | os.O_TRUNC, None)
        await env.ops.write(fi.fh, 0, b"mine, in memory")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await write_file(env, ROOT, "next.txt", b"next")
        sf = env.fs.staging.get((await env.lookup("old.txt")).st_ino)
        assert sf is not None and sf.in_memory
        await put_object(env.streams, "b", "old.txt", b"theirs, newer")
        await env.settle()
        await env.fs.shutdown(10)
        assert await stored(env, "old.txt") == b"theirs, newer"
        kept = list((spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found" / "b").iterdir())
        assert [p.read_bytes() for p in kept] == [b"mine, in memory"]

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_files_in_memory_when_the_daemon_dies_are_replayed_from_the_journal(ops_env):
    ms = MemoryStreams()
    files = bodies(20)

    async def first(env: Env):
        for name, data in files.items():
            await write_file(env, ROOT, name, data)
        assert spool_files(env) == []
        # The daemon dies here: nothing uploaded, the 20 files only in memory and in the journal.

    async def second(env: Env):
        with trio.fail_after(20):
            while any([await env.store.get_info("b", n) is None for n in files]):
                await trio.sleep(0.01)
        for name, data in files.items():
            assert await stored(env, name) == data
        assert not list((env.fs.staging.spool.lost_found).glob("leftover/*"))

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)


def test_a_rewritten_small_file_keeps_its_spool_file_until_the_next_close(ops_env):
    """An existing object rewritten (staged in a spool file, copy-on-write) moves to memory once its
    record is synced; its spool file goes one close later (the last record is the one a crash can tear)."""
    async def body(env: Env):
        ino = (await env.lookup("old.txt")).st_ino
        fi = await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, None)
        assert await env.ops.write(fi.fh, 0, b"rewritten") == 9
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        sf = env.fs.staging.get(ino)
        assert sf is not None and sf.in_memory and sf.spool_path.read_bytes() == b"rewritten"
        await write_file(env, ROOT, "later.txt", b"later")
        assert not sf.spool_path.exists()
        assert await env.cat("old.txt") == b"rewritten"
        await env.fs.shutdown(30)
        assert await stored(env, "old.txt") == b"rewritten"

    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_memory_staging_stops_at_its_budget(ops_env, monkeypatch):
    from natsfs import staging

    monkeypatch.setattr(staging, "MEMORY_STAGED_MAX", 3 * 4096)

    async def body(env: Env):
        for i in range(6):
            await write_file(env, ROOT, f"m{i}.txt", b"x" * 3000)
        in_memory = [sf for sf in env.fs.staging.all() if sf.in_memory]
        assert len(in_memory) == 3 and env.fs.staging.spool.memory_used == 3 * 4096
        await env.fs.shutdown(30)
        for i in range(6):
            assert await stored(env, f"m{i}.txt") == b"x" * 3000

    assert MEMORY_STAGED_MAX >= 16 << 20
    ops_env(body, setup=bucket_b, bucket="b", write_back=LATER)


def test_attributes_and_xattrs_of_a_pending_file_survive_the_daemon_dying(ops_env):
    """chmod and setxattr of a file closed and waiting for its upload went into the staged file only:
    a killed daemon (or an unmount while the server was away) stored it without them."""
    ms = MemoryStreams()

    async def first(env: Env):
        await write_file(env, ROOT, "f", b"hello\n")
        ino = (await env.lookup("f")).st_ino
        chmod = pyfuse3.EntryAttributes()
        chmod.st_mode = 0o100640
        await env.ops.setattr(ino, chmod, Fields(update_mode=True), None, Ctx())
        await env.ops.setxattr(ino, b"user.color", b"blue", Ctx())
        # The daemon dies here: nothing uploaded.

    async def second(env: Env):
        with trio.fail_after(20):
            while await env.store.get_info("b", "f") is None:
                await trio.sleep(0.01)
        assert await stored(env, "f") == b"hello\n"
        doc, _ = await env.store.get_meta_doc("b", "f")
        assert doc["metadata"]["natsfs.mode"] == "640" and doc["metadata"]["color"] == "blue"

    ops_env(first, setup=bucket_b, bucket="b", streams=ms, write_back=LATER)
    ops_env(second, bucket="b", streams=ms, write_back=0.0)
