"""Stream limits another client set on a bucket (`max_msgs_per_subject`, `max_bytes` / `max_msgs` with
discard old, `max_age`): a close never returns 0 for a version the stream cannot hold whole, or cut right
after storing it. A version that can never fit is refused before anything is sent (`E2BIG`, bytes in
lost+found, the old version and every other object intact); one the stream cut after its acks is taken
back (`EIO`), the old version kept. Buckets without such limits pay no round trip for it."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
from gowriters import put_object
from opskit import ROOT, Ctx, Env
from test_ops_write import stored

from natsfs.adr20 import NO_LIMITS, ObjectStore, chunk_subject, stream_name
from natsfs.compose import spool_root
from natsfs.memstreams import MemoryStreams

OLD = os.urandom(100_000)  # one chunk (a limit set on the stream applies at once to what it holds)
NEW = os.urandom(300_000)
OTHER = b"another object, never touched"
QUIET = 3600.0  # sealed_ttl: the bucket's status is not read again by itself during the test


def setup_for(atomic: bool, **changes: Any):
    """Bucket b (atomic puts or not) holding old.bin and other.txt; then another client sets `changes`
    on its stream config (before the mount starts: its bucket watch reads the status)."""

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b", atomic=atomic)
        await put_object(ms, "b", "old.bin", OLD)
        await put_object(ms, "b", "other.txt", OTHER)
        if changes:
            await another_client_sets(ms, **changes)

    return setup


async def another_client_sets(ms: MemoryStreams, **changes: Any) -> None:
    st = await ms.stream_info(stream_name("b"))
    await ms.update_stream(dict(st.config, **changes))


def chunk_subjects(env: Env) -> set[str]:
    return {s for s in env.streams.subjects(stream_name("b")) if ".C." in s}


def kept_files(tmp_path: Path) -> list[Path]:
    lost_found = spool_root(tmp_path / "cache", Path("/nonexistent")) / "lost+found"
    return sorted(p for p in lost_found.rglob("*") if p.is_file())


async def rewrite(env: Env, name: str, data: bytes) -> int:
    """Open `name` with O_TRUNC, write `data`, close: the close's errno (0: stored)."""
    fi = await env.ops.open((await env.lookup(name)).st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
    await env.ops.write(fi.fh, 0, data)
    try:
        await env.ops.flush(fi.fh)
        return 0
    except pyfuse3.FUSEError as e:
        return e.errno
    finally:
        await env.ops.release(fi.fh)


def lines(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


REFUSALS = {
    # every chunk of a version is on one subject: only the last one would stay
    "max_msgs_per_subject": (dict(max_msgs_per_subject=1), NEW),
    # discard old: the stream would drop the version's first chunks to make room for its last
    "max_bytes": (dict(max_bytes=400_000, discard="old"), os.urandom(600_000)),
    "max_msgs": (dict(max_msgs=12, discard="old"), os.urandom(12 * 128 * 1024)),
}


@pytest.mark.expect_log(r"b/old\.bin: closed without a successful upload \(a version of")
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-order"])
@pytest.mark.parametrize("limit", sorted(REFUSALS))
def test_a_version_the_stream_cannot_hold_whole_is_refused_before_anything_is_sent(ops_env, tmp_path, caplog,
                                                                                    limit, atomic):
    changes, data = REFUSALS[limit]

    async def body(env: Env):
        before = chunk_subjects(env)
        caplog.clear()
        assert await rewrite(env, "old.bin", data) == errno.E2BIG
        # Nothing was sent: no chunk of the refused version, nothing of the others evicted.
        assert chunk_subjects(env) == before
        assert await stored(env, "old.bin") == OLD and await stored(env, "other.txt") == OTHER
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [data]
        assert await env.cat("old.bin") == OLD
        # A file that fits is stored as before.
        fi, _ = await env.ops.create(ROOT, b"small.txt", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, b"fits")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await stored(env, "small.txt") == b"fits"

    ops_env(body, setup=setup_for(atomic, **changes), bucket="b", sealed_ttl=QUIET)
    logged = lines(caplog)
    naming = [line for line in logged if f"the stream's {limit} is" in line]
    # The close's line names the limit; the line of the bytes kept in lost+found repeats why.
    assert [line.split(":", 1)[0] for line in naming] == ["flush", "b/old.bin"], logged
    assert "kept at" in naming[1] and len(logged) == 2
    assert lines(caplog, logging.ERROR) == naming[1:]


@pytest.mark.expect_log(r"b/old\.bin: closed without a successful upload \(a version of")
def test_a_limit_another_client_sets_while_mounted_is_known_at_the_next_close(ops_env, tmp_path):
    """The server announces every stream config update: the bucket's status is read again before its
    next put, not only every `sealed_ttl` (the tester's case: a rewrite half a second after the change)."""

    async def body(env: Env):
        await rewrite(env, "other.txt", b"small")  # (the first upload reads the bucket's status)
        await another_client_sets(env.streams, max_msgs_per_subject=1)
        await env.settle()
        infos = env.streams.calls["stream_info"]
        assert await rewrite(env, "old.bin", NEW) == errno.E2BIG
        assert env.streams.calls["stream_info"] == infos + 1
        assert await stored(env, "old.bin") == OLD
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [NEW]
        calls = env.streams.calls.copy()
        assert await rewrite(env, "other.txt", b"fits") == 0  # read once per announced change, not per put
        assert (env.streams.calls - calls)["stream_info"] == 0

    ops_env(body, setup=setup_for(True), bucket="b", sealed_ttl=QUIET)


def test_a_refusal_reads_the_config_again_and_a_limit_lifted_meanwhile_refuses_nothing(ops_env):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await setup_for(True)(ms, store)
        await store.update_bucket("b", lambda c: c.update(max_msgs_per_subject=1))  # the mount's last status

    async def body(env: Env):
        await rewrite(env, "other.txt", b"small")  # (the first upload reads the bucket's status)
        assert env.store.limits("b").per_subject == 1
        env.streams._update_followers.clear()  # no advisory reaches the mount (an account that may not)
        await another_client_sets(env.streams, max_msgs_per_subject=-1)  # the mount has not read it yet
        infos = env.streams.calls["stream_info"]
        assert await rewrite(env, "old.bin", NEW) == 0
        assert await stored(env, "old.bin") == NEW
        assert env.streams.calls["stream_info"] == infos + 1  # read again once, before refusing
        assert env.store.limits("b") == NO_LIMITS

    ops_env(body, setup=setup, bucket="b", sealed_ttl=QUIET)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-order"])
def test_buckets_without_such_limits_pay_no_round_trip_and_limited_ones_one_per_put(ops_env, atomic):
    async def body(env: Env):
        await rewrite(env, "old.bin", os.urandom(1000))  # (the first upload reads the bucket's status)
        for data in (os.urandom(200), NEW):
            calls = env.streams.calls.copy()
            assert await rewrite(env, "old.bin", data) == 0
            assert await stored(env, "old.bin") == data
            made = env.streams.calls - calls
            assert made["subject_counts"] == 0 and made["stream_info"] == 0, made
        # The same puts where the stream may drop a version's first chunks later (max_age): one count each.
        await env.store.update_bucket("b", lambda c: c.update(max_age=24 * 3600 * 10**9))
        await rewrite(env, "old.bin", os.urandom(1000))  # (the announced change is read before this put)
        for data in (os.urandom(200), NEW):
            calls = env.streams.calls.copy()
            assert await rewrite(env, "old.bin", data) == 0
            made = env.streams.calls - calls
            assert made["subject_counts"] == 1 and made["stream_info"] == 0, made

    ops_env(body, setup=setup_for(atomic), bucket="b", sealed_ttl=QUIET)


class CutsTheNextVersion(MemoryStreams):
    """A stream that cuts the next version of b right when its meta arrives: `drop_first` removes its
    first chunk (as a limit or another client could), `filler` is another client's message stored just
    before that meta (with discard old and max_bytes it evicts the oldest messages)."""

    drop_first = False
    filler = 0

    def _store(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        if self.filler and subject.startswith("$O.b.M."):
            size, self.filler = self.filler, 0
            super()._store("$O.b.C.another-client", os.urandom(size), None)
        seq = super()._store(subject, data, headers)
        if self.drop_first and subject.startswith("$O.b.M."):
            self.drop_first = False
            chunks = self._streams[stream_name("b")].by_subject[chunk_subject("b", json.loads(data)["nuid"])]
            self._streams[stream_name("b")].remove(chunks[0])
        return seq


@pytest.mark.expect_log(r"b/old\.bin: closed without a successful upload \(not stored whole: the "
                        r"stream dropped 1 of its 3 chunks")
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-order"])
def test_a_version_cut_after_its_acks_is_taken_back_and_the_old_one_stays(ops_env, tmp_path, caplog, atomic):
    ms = CutsTheNextVersion()

    async def body(env: Env):
        old_chunks = chunk_subjects(env)
        ms.drop_first = True
        caplog.clear()
        assert await rewrite(env, "old.bin", NEW) == errno.EIO
        assert await stored(env, "old.bin") == OLD  # the old version is the name's again, whole
        assert chunk_subjects(env) == old_chunks  # what the stream left of the new one is purged
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [NEW]
        await env.settle()
        assert await env.cat("old.bin") == OLD

    ops_env(body, setup=setup_for(atomic, max_age=24 * 3600 * 10**9), bucket="b", streams=ms, sealed_ttl=QUIET)
    [error] = lines(caplog, logging.ERROR)  # the one line saying what happened and where the bytes are
    assert "max_age 86400 s" in error and "kept at" in error
    assert "the version it replaced is the name's again" in error


@pytest.mark.expect_log(r"b/new\.bin: closed without a successful upload \(not stored whole: the "
                        r"stream dropped 1 of its 3 chunks")
def test_a_new_file_cut_by_discard_old_is_deleted_again_and_its_bytes_kept(ops_env, tmp_path, caplog):
    """Discard old drops the oldest messages first: what the new version replaces went before it (a
    rewrite then fails as a conflict: its expected meta is gone), so this is met by new names."""
    ms = CutsTheNextVersion()

    async def body(env: Env):
        ms.filler = 400_000  # evicts old.bin and other.txt, then the new version's first chunk
        fi, _ = await env.ops.create(ROOT, b"new.bin", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, NEW)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.flush(fi.fh)
        assert e.value.errno == errno.EIO
        await env.ops.release(fi.fh)
        info = await env.store.get_info("b", "new.bin")
        assert info is not None and info.deleted  # no client reads a version that is not whole
        assert chunk_subjects(env) == {"$O.b.C.another-client"}
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [NEW]

    ops_env(body, setup=setup_for(True, max_bytes=700_000, discard="old"), bucket="b", streams=ms,
            sealed_ttl=QUIET)
    [error] = lines(caplog, logging.ERROR)
    assert "max_bytes 700000 with discard old" in error and "the name is deleted again" in error


@pytest.mark.parametrize("limit", ["max_msgs_per_subject", "max_bytes"])
def test_in_write_back_mode_a_refused_upload_goes_to_lost_found_and_is_not_retried(ops_env, tmp_path, caplog, limit):
    changes, data = REFUSALS[limit]

    async def body(env: Env):
        assert await rewrite(env, "old.bin", data) == 0  # (write-back: the close only journals it)
        await env.fs.shutdown(10)
        assert await stored(env, "old.bin") == OLD and await stored(env, "other.txt") == OTHER
        assert [p.read_bytes() for p in kept_files(tmp_path)] == [data]
        assert env.fs.writeback is not None and env.fs.writeback.journal.pending == {}

    ops_env(body, setup=setup_for(True, **changes), bucket="b", write_back=0.0, sealed_ttl=QUIET)
    assert sum(f"the stream's {limit} is" in line for line in lines(caplog)) == 1, lines(caplog)
