"""chunk_cache.ChunkCache over MemoryStreams + ObjectStore: uneven chunks, far reads, shared fetches, bounds."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing
from gowriters import put_object

from natsfs.adr20 import ObjectInfo, ObjectStore, chunk_subject, digest_of, stream_name
from natsfs.chunk_cache import ChunkCache, layout_key
from natsfs.errors import Corrupt, Stale, Unavailable
from natsfs.handles import FileHandle
from natsfs.inodes import InodeNo
from natsfs.memstreams import MemoryBatchStream, MemoryStreams
from natsfs.streams import StoredMsg

KiB = 1024
RNG = random.Random(20)


def blob(n: int) -> bytes:
    return RNG.randbytes(n)


def run(body: Callable[[MemoryStreams, ObjectStore, ChunkCache], Awaitable[Any]], *, cache_bytes: int = 64 << 20,
        batch_bytes: int = 128 * KiB, background: bool = True, **streams_kw: Any) -> Any:
    """Run `body(streams, store, cache)` under trio with a fresh bucket `b`."""

    async def main() -> Any:
        ms = MemoryStreams(**streams_kw)
        store = ObjectStore(ms)
        await store.create_bucket("b")
        cache = ChunkCache(store, cache_bytes=cache_bytes, batch_bytes=batch_bytes)
        async with trio.open_nursery() as nursery:
            if background:
                cache.start(nursery)
            try:
                return await body(ms, store, cache)
            finally:
                nursery.cancel_scope.cancel()

    return trio.run(main)


UNEVEN = [1, 100_000, 7, 131_072, 50_000, 3, 131_072, 131_072, 12_345, 1]


@pytest.mark.parametrize("background", [True, False])
def test_uneven_chunks_read_exactly(background):
    data = blob(sum(UNEVEN))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "u.bin", data, chunk_sizes=UNEVEN)
        assert info.chunks == len(UNEVEN)
        assert await cache.read(info, 0, len(data)) == data
        # Every chunk boundary, +-1, with reads that straddle it.
        ends = [sum(UNEVEN[: i + 1]) for i in range(len(UNEVEN))]
        for e in ends:
            for off in (e - 2, e - 1, e, e + 1):
                if 0 <= off < len(data):
                    assert await cache.read(info, off, 5) == data[off : off + 5], off
        rng = random.Random(1)
        for _ in range(200):
            off = rng.randrange(len(data))
            size = rng.choice([1, 100, 4096, 131_072, 300_000])
            assert await cache.read(info, off, size) == data[off : off + size]

    run(body, background=background)


@pytest.mark.parametrize("background", [True, False])
def test_uneven_chunks_fresh_cache_random_order(background):
    data = blob(sum(UNEVEN))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "u.bin", data, chunk_sizes=UNEVEN)
        for off in [600_000, 3, 100_001, 0, len(data) - 1, 300_000]:
            fresh = ChunkCache(store, cache_bytes=1 << 20, batch_bytes=128 * KiB)
            assert await fresh.read(info, off, 70_000) == data[off : off + 70_000]

    run(body, background=background)


def test_reads_at_and_past_eof():
    data = blob(1000)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "s", data, chunk_size=300)
        assert await cache.read(info, 990, 100) == data[990:]
        assert await cache.read(info, 1000, 10) == b""
        assert await cache.read(info, 5000, 10) == b""
        assert await cache.read(info, 0, 0) == b""
        empty = await put_object(ms, "b", "e", b"")
        assert empty.chunks == 0
        assert await cache.read(empty, 0, 4096) == b""

    run(body)


def test_far_random_read_uses_one_index_scan_and_fetches_only_touched_chunks():
    sizes = [RNG.randrange(40_000, 90_000) for _ in range(40)]
    data = blob(sum(sizes))
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    off = ends[29] - 50  # straddles chunks 29 and 30, far beyond the first batch
    assert off > 1 << 20

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "far.bin", data, chunk_sizes=sizes)
        ms.calls.clear()
        got = await cache.read(info, off, 100)
        assert got == data[off : off + 100]
        s = cache.stats
        assert s.index_scans == 1
        assert ms.calls["subject_index"] == 1
        assert s.fetch_requests == 1
        assert s.chunks_fetched == 2
        assert s.bytes_fetched == sizes[29] + sizes[30]
        # Another far read of a chunk not yet fetched: no second scan, one more small fetch.
        off2 = ends[9] + 10
        assert await cache.read(info, off2, 10) == data[off2 : off2 + 10]
        assert s.index_scans == 1 and ms.calls["subject_index"] == 1
        assert s.fetch_requests == 2 and s.chunks_fetched == 3
        # A cached chunk: a hit, nothing fetched.
        assert await cache.read(info, off + 10, 20) == data[off + 10 : off + 30]
        assert s.fetch_requests == 2 and s.hits >= 1

    run(body, batch_bytes=128 * KiB)


def test_concurrent_misses_on_one_chunk_share_one_fetch():
    sizes = [100_000] * 30
    data = blob(sum(sizes))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "c.bin", data, chunk_sizes=sizes)
        # Learn the layout (one scan) from a far read of another chunk.
        assert await cache.read(info, 2_500_000, 10) == data[2_500_000:2_500_010]
        before = (cache.stats.fetch_requests, cache.stats.chunks_fetched, cache.stats.index_scans)
        results: list[bytes] = []

        async def reader(off: int) -> None:
            results.append(await cache.read(info, off, 1000))

        async with trio.open_nursery() as n:
            for k in range(8):
                n.start_soon(reader, 1_500_000 + k * 1000)
        assert sorted(results) == sorted(data[1_500_000 + k * 1000 : 1_501_000 + k * 1000] for k in range(8))
        after = (cache.stats.fetch_requests, cache.stats.chunks_fetched, cache.stats.index_scans)
        assert after == (before[0] + 1, before[1] + 1, before[2])

    run(body, delay=0.001)


def test_concurrent_first_reads_far_away_share_the_scan_and_the_fetch():
    sizes = [100_000] * 30
    data = blob(sum(sizes))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "c.bin", data, chunk_sizes=sizes)
        ms.calls.clear()
        out: dict[int, bytes] = {}

        async def reader(k: int) -> None:
            out[k] = await cache.read(info, 2_000_000 + k, 500)

        async with trio.open_nursery() as n:
            for k in range(5):
                n.start_soon(reader, k)
        assert all(out[k] == data[2_000_000 + k : 2_000_500 + k] for k in range(5))
        assert cache.stats.index_scans == 1 and ms.calls["subject_index"] == 1
        assert cache.stats.chunks_fetched == 1

    run(body, delay=0.001)


def test_cache_is_bounded_in_bytes():
    data = blob(2_000_000)
    limit = 300_000

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "big", data, chunk_size=64 * KiB)
        for off in range(0, len(data), 50_000):
            assert await cache.read(info, off, 50_000) == data[off : off + 50_000]
            assert cache.cached_bytes <= limit
        for off in range(len(data) - 50_000, -1, -170_000):
            assert await cache.read(info, off, 50_000) == data[off : off + 50_000]
            assert cache.cached_bytes <= limit
        assert cache.cached_bytes > 0

    run(body, cache_bytes=limit, background=False)


def test_chunk_larger_than_the_cache_is_served_uncached():
    data = blob(500_000)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "huge-chunk", data, chunk_size=500_000)
        assert await cache.read(info, 0, len(data)) == data
        assert await cache.read(info, 123, 456) == data[123:579]
        assert cache.cached_bytes == 0

    run(body, cache_bytes=100_000)


def test_purged_object_raises_stale_on_a_fresh_cache():
    data = blob(400_000)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "p", data, chunk_size=100_000)
        await ms.purge_subject(stream_name("b"), chunk_subject("b", info.nuid))
        with pytest.raises(Stale):
            await cache.read(info, 0, 10)
        far = ChunkCache(store, cache_bytes=1 << 20, batch_bytes=128 * KiB)
        with pytest.raises(Stale):
            await far.read(info, 350_000, 10)

    run(body)


def test_replaced_object_raises_stale_for_chunks_not_cached():
    data = blob(400_000)

    async def body(ms, store, cache):
        old = await put_object(ms, "b", "p", data, chunk_size=100_000)
        assert await cache.read(old, 0, 10) == data[:10]
        new = await put_object(ms, "b", "p", b"new version")  # purges the old nuid's chunks
        assert new.nuid != old.nuid
        with pytest.raises(Stale):
            await cache.read(old, 390_000, 10)
        assert await cache.read(new, 0, 100) == b"new version"

    run(body, cache_bytes=150_000, background=False)


@pytest.mark.parametrize("found_by", ["read", "readahead"])
def test_a_version_found_purged_is_never_served_again_even_from_the_cache(found_by):
    """The kernel asks again page by page when a read across a chunk boundary fails, and hands the program
    the pages that read before the failing one: a short read in the middle of the file, which programs
    take for its end. So once the server said the version's chunks are gone, its cached chunks are not
    served either: every read of it fails ESTALE, at its first byte."""
    data = blob(400_000)

    async def body(ms, store, cache):
        old = await put_object(ms, "b", "p", data, chunk_size=100_000)
        assert await cache.read(old, 0, 10) == data[:10]  # chunk 0 (at least) cached
        await put_object(ms, "b", "p", b"new version")  # purges the old nuid's chunks
        if found_by == "read":
            with pytest.raises(Stale):
                await cache.read(old, 390_000, 10)
        else:
            # (cached: served, and what follows is fetched ahead, which finds the version gone)
            assert await cache.read(old, 99_000, 900, readahead=400_000) == data[99_000:99_900]
            await trio.testing.wait_all_tasks_blocked()
        for off in (0, 50_000, 99_990):  # bytes of chunk 0, still cached
            with pytest.raises(Stale):
                await cache.read(old, off, 20)

    run(body, cache_bytes=1 << 20, batch_bytes=100_000)


def _with(info: ObjectInfo, **changes: Any) -> ObjectInfo:
    return ObjectInfo(**{**{f: getattr(info, f) for f in info.__slots__}, **changes})


@pytest.mark.expect_log("the meta says 1500 bytes in 3; 700 of 1500 bytes cannot be read",
                        "the meta says 1500 bytes in 4; .*1500 of 1500 bytes cannot be read")
@pytest.mark.parametrize("background", [True, False])
def test_meta_claiming_more_than_the_chunks_hold_is_corrupt(background):
    data = blob(1000)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "c", data, chunk_size=400)
        with pytest.raises(Corrupt):
            await cache.read(_with(info, size=1500), 0, 1500)
        with pytest.raises(Corrupt):
            await cache.read(_with(info, nuid=info.nuid, chunks=4, size=1500), 1200, 100)

    run(body, background=background)


@pytest.mark.expect_log("the meta says 900 bytes in 3; 100 of 900 bytes cannot be read")
@pytest.mark.parametrize("background", [True, False])
def test_chunks_holding_more_than_the_meta_says_is_corrupt(background):
    data = blob(1000)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "c", data, chunk_size=400)
        with pytest.raises(Corrupt):
            await cache.read(_with(info, size=900), 0, 900)

    run(body, background=background)


@pytest.mark.parametrize("op", ["stream_batch", "subject_index", "get_batch"])
def test_fetch_failure_is_reported_and_the_next_read_works(op):
    sizes = [100_000] * 10
    data = blob(sum(sizes))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "f", data, chunk_sizes=sizes)
        if op == "get_batch":
            assert await cache.read(info, 900_000, 10) == data[900_000:900_010]  # layout known, one chunk cached
        ms.fail_next(op, Stale("injected"))
        off = 0 if op == "stream_batch" else 500_000
        with pytest.raises(Stale, match="injected"):
            await cache.read(info, off, 10)
        assert await cache.read(info, off, 10) == data[off : off + 10]
        assert not ms._faults

    run(body, batch_bytes=128 * KiB)


# ---------------------------------------------------------------- digest checks (per version, in the cache)
def test_good_digest_read_start_to_end_in_pieces():
    data = blob(sum(UNEVEN))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "g", data, chunk_sizes=UNEVEN)
        out = b""
        for off in range(0, len(data), 4096):
            out += await cache.read(info, off, 4096)
        assert out == data
        assert await cache.read(info, 0, len(data)) == data

    run(body)


@pytest.mark.expect_log("digest mismatch: meta says SHA-256=")
@pytest.mark.parametrize("background", [True, False])
def test_digest_mismatch_raises_corrupt_naming_both_digests(background):
    data = blob(sum(UNEVEN))
    claimed = digest_of(b"not these bytes")

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "bad", data, chunk_sizes=UNEVEN, digest=claimed)
        assert await cache.read(info, 0, 100_000) == data[:100_000]  # not at the end yet: served
        with pytest.raises(Corrupt) as e:
            await cache.read(info, 100_000, len(data))
        assert "bad" in str(e.value)
        assert claimed in str(e.value) and digest_of(data) in str(e.value)
        # The version is refused from now on, wherever the read is.
        with pytest.raises(Corrupt):
            await cache.read(info, 0, 10)
        # Another version of the same name (new nuid) is judged on its own.
        good = await put_object(ms, "b", "bad", data, chunk_sizes=UNEVEN)
        assert await cache.read(good, 0, len(data)) == data

    run(body, background=background)


@pytest.mark.expect_log("digest mismatch: meta says SHA-256=")
def test_out_of_order_reads_verify_once_every_chunk_has_passed():
    sizes = [50_000] * 8
    data = blob(sum(sizes))

    async def body(ms, store, cache):
        good = await put_object(ms, "b", "good", data, chunk_sizes=sizes)
        bad = await put_object(ms, "b", "bad", data, chunk_sizes=sizes, digest=digest_of(b"x"))
        order = [7, 3, 0, 5, 1, 6, 2, 4]
        for info in (good, bad):
            for k in order:
                assert await cache.read(info, k * 50_000, 50_000) == data[k * 50_000 : (k + 1) * 50_000]
        # Every chunk has been through the cache: the next read of the last byte settles the check.
        assert await cache.read(good, len(data) - 1, 1) == data[-1:]
        with pytest.raises(Corrupt):
            await cache.read(bad, len(data) - 1, 1)

    run(body, batch_bytes=128 * KiB, background=False)


def test_object_without_digest_is_served_unchecked():
    data = blob(10_000)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "nodigest", data, chunk_size=3000, digest="")
        assert await cache.read(info, 0, len(data)) == data
        odd = await put_object(ms, "b", "odd", data, chunk_size=3000, digest="MD5=abc")
        assert await cache.read(odd, 0, len(data)) == data

    run(body)


# ---------------------------------------------------------------- verified layouts (damaged versions)
CHUNK = 64 * KiB


def chunk_seqs(ms: MemoryStreams, info: ObjectInfo) -> list[int]:
    subject = chunk_subject(info.bucket, info.nuid)
    return [m.seq for m in ms.messages(stream_name(info.bucket)) if m.subject == subject]


async def read_each_chunk(cache: ChunkCache, info: ObjectInfo, data: bytes, order: list[int]) -> dict[int, bytes | str]:
    """chunk index -> its bytes as read, or "EIO"."""
    out: dict[int, bytes | str] = {}
    for k in order:
        try:
            out[k] = await cache.read(info, k * CHUNK, CHUNK)
        except Corrupt:
            out[k] = "EIO"
    return out


def damage_records(caplog: pytest.LogCaptureFixture, info: ObjectInfo) -> list[logging.LogRecord]:
    """Log records at WARNING or above that name this version (from any natsfs logger)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING and info.nuid in r.getMessage()]


ORDERS = {"front-to-back": list(range(8)), "far-first": [6, 7, 0, 5, 2, 4, 1, 3], "backwards": list(range(7, -1, -1))}


@pytest.mark.expect_log("1 of 8 chunks missing")
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("lost", [3, 0, 7])
def test_a_missing_chunk_fails_its_reads_and_every_other_chunk_reads_exactly(lost, order, caplog):
    """Chunk `lost` of 8 deleted by another client: EIO for the reads touching it, exact bytes for the
    others (the gap in the stream sequences shows where it was), one log line for the version."""
    data = blob(8 * CHUNK - 1000)
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "obj", data, chunk_size=CHUNK)
        assert info.chunks == 8
        await ms.delete_msg(stream_name("b"), chunk_seqs(ms, info)[lost])
        got = await read_each_chunk(cache, info, data, ORDERS[order])
        for k in range(8):
            want = "EIO" if k == lost else data[k * CHUNK : (k + 1) * CHUNK]
            assert got[k] == want, k
        # Reads that straddle the lost chunk fail; the whole object fails; nothing is ever shifted.
        lo = max(lost * CHUNK - 10, 0)
        with pytest.raises(Corrupt):
            await cache.read(info, lo, 20)
        with pytest.raises(Corrupt):
            await cache.read(info, 0, len(data))
        # Reads of the same broken version keep failing fast, without new log lines.
        with pytest.raises(Corrupt):
            await cache.read(info, lost * CHUNK, 1)
        return info

    info = run(body, batch_bytes=128 * KiB)
    records = damage_records(caplog, info)
    assert len(records) == 1, [r.getMessage() for r in records]
    msg = records[0].getMessage()
    assert records[0].levelno == logging.ERROR
    assert "b/obj" in msg and info.nuid in msg and "1 of 8 chunks missing" in msg


@pytest.mark.expect_log(r"chunk 3 \(seq 4, bytes 196608..262144\) gone from the stream")
def test_chunk_gone_after_the_layout_was_proven_fails_alone():
    """A cache that learned the layout before the delete keeps every other chunk's place."""
    data = blob(8 * CHUNK)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "obj", data, chunk_size=CHUNK)
        assert await cache.read(info, 0, len(data)) == data  # layout proven, digest checked
        await ms.delete_msg(stream_name("b"), chunk_seqs(ms, info)[3])
        small = ChunkCache(store, cache_bytes=CHUNK, batch_bytes=128 * KiB)
        small._layouts[layout_key(info)] = cache._layouts[layout_key(info)]  # the same proven layout
        got = await read_each_chunk(small, info, data, [7, 3, 0, 4, 2, 6, 1, 5])
        assert got == {k: "EIO" if k == 3 else data[k * CHUNK : (k + 1) * CHUNK] for k in range(8)}

    run(body, cache_bytes=1 << 20)


@pytest.mark.expect_log("1 of 4 chunks missing")
@pytest.mark.parametrize("others", ["kept", "purged"])
def test_missing_chunk_among_interleaved_writes_is_placed_only_when_provable(others):
    """Another object's chunks sit between every pair of chunks. While they are there, a scan of the
    gaps shows that only one gap can have held the lost chunk, and every other chunk reads exactly.
    Once they are purged, every gap could have held it: reads fail rather than serve bytes at a
    guessed offset (chunk 0 still reads: it has sequence 1, nothing can precede it)."""
    a, b = blob(4 * CHUNK), blob(4 * CHUNK)

    async def body(ms, store, cache):
        subj_a, subj_b = chunk_subject("b", "A" * 22), chunk_subject("b", "B" * 22)
        for k in range(4):
            await ms.publish(subj_a, a[k * CHUNK : (k + 1) * CHUNK])
            await ms.publish(subj_b, b[k * CHUNK : (k + 1) * CHUNK])
        meta = await put_object(ms, "b", "a", b"")  # a meta to copy, then the real ones by hand
        info_a = _with(meta, nuid="A" * 22, size=len(a), chunks=4, digest=digest_of(a))
        await ms.delete_msg(stream_name("b"), chunk_seqs(ms, info_a)[2])
        if others == "purged":
            await ms.purge_subject(stream_name("b"), subj_b)
        got = await read_each_chunk(cache, info_a, a, [3, 0, 1, 2])
        if others == "kept":
            assert got == {k: "EIO" if k == 2 else a[k * CHUNK : (k + 1) * CHUNK] for k in range(4)}
        else:
            assert got == {0: a[:CHUNK], 1: "EIO", 2: "EIO", 3: "EIO"}

    run(body)


@pytest.mark.expect_log("no gap in the stream sequences could have held the 1 missing")
@pytest.mark.parametrize("others", ["before", "after"])
def test_a_chunk_never_stored_is_never_placed_by_its_only_gap(others, caplog):
    """The meta counts 4 chunks of 64 KiB, only 3 were ever stored, and the one sequence gap the fourth
    could seem to be in (before the first chunk, or between the last and the meta) is full of another
    object's messages: it never held a chunk. No chunk's place can be shown, so every read fails,
    rather than serving AAAA at chunk 1 and CCCC at chunk 3 (explore-hostile F4)."""
    data = b"".join(bytes([65 + k]) * CHUNK for k in range(4))
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        nuid = "F" * 22
        if others == "before":
            await put_object(ms, "b", "before.txt", b"another object")
        for k in range(3):  # chunk 3 (DDDD) is never stored
            await ms.publish(chunk_subject("b", nuid), data[k * CHUNK : (k + 1) * CHUNK])
        if others == "after":
            await put_object(ms, "b", "after.txt", b"another object")
        meta = await put_object(ms, "b", "damaged.bin", b"")
        info = _with(meta, nuid=nuid, size=len(data), chunks=4, digest=digest_of(data))
        got = await read_each_chunk(cache, info, data, [3, 1, 2, 0])
        assert got == {k: "EIO" for k in range(4)}
        with pytest.raises(Corrupt):
            await cache.read(info, 0, len(data))
        return info

    info = run(body)
    records = damage_records(caplog, info)
    assert len(records) == 1 and records[0].levelno == logging.ERROR, [r.getMessage() for r in records]
    assert "262144 of 262144 bytes cannot be read" in records[0].getMessage()


@pytest.mark.expect_log("no gap in the stream sequences could have held the 2 missing")
def test_missing_chunks_are_not_placed_in_a_gap_too_small_to_hold_them():
    """Two chunks missing, and the one gap that could hold them has a single empty sequence: they
    cannot both have been there, so nothing is placed (not chunks 0-1 EIO and the rest shifted)."""
    data = b"".join(bytes([65 + k]) * CHUNK for k in range(4))

    async def body(ms, store, cache):
        other = await put_object(ms, "b", "other", b"x")  # chunk at seq 1, meta at seq 2
        await ms.delete_msg(stream_name("b"), chunk_seqs(ms, other)[0])
        nuid = "G" * 22
        for k in (2, 3):
            await ms.publish(chunk_subject("b", nuid), data[k * CHUNK : (k + 1) * CHUNK])
        meta = await put_object(ms, "b", "two-missing", b"")
        info = _with(meta, nuid=nuid, size=len(data), chunks=4, digest=digest_of(data))
        assert await read_each_chunk(cache, info, data, [2, 3, 0, 1]) == {k: "EIO" for k in range(4)}

    run(body)


@pytest.mark.expect_log("1 of 4 chunks missing")
def test_a_chunk_deleted_where_its_only_gap_has_room_is_placed():
    """The counterpart: chunk 0 stored and deleted, another object's messages before it purged. The one
    gap has room, every other chunk reads exactly."""
    data = b"".join(bytes([65 + k]) * CHUNK for k in range(4))

    async def body(ms, store, cache):
        await put_object(ms, "b", "before.txt", b"another object")
        info = await put_object(ms, "b", "obj", data, chunk_size=CHUNK)
        await ms.delete_msg(stream_name("b"), chunk_seqs(ms, info)[0])
        await ms.delete_msg(stream_name("b"), 1)  # before.txt's chunk
        got = await read_each_chunk(cache, info, data, [3, 1, 2, 0])
        assert got == {k: "EIO" if k == 0 else data[k * CHUNK : (k + 1) * CHUNK] for k in range(4)}

    run(body)


@pytest.mark.expect_log("object b/wrong-digest .*digest mismatch", "object b/bigger .*the meta says 589824 bytes in 9",
                        "object b/smaller .*the meta says 458752 bytes in 7")
@pytest.mark.parametrize("order", ["copies-first", "good-first"])
def test_metas_sharing_a_nuid_are_each_checked_on_their_own_claims(order, caplog):
    """Other clients' metas name a good object's nuid with other claims: a wrong digest, one chunk
    more, one chunk fewer (with the digest of the bytes those hold). Each fails its own checks (EIO,
    one ERROR line each) and the good object reads exactly, whichever is read first: a layout or a
    digest verdict proven for one meta's claims is never another's (explore-hostile F10)."""
    data = blob(8 * CHUNK)
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        good = await put_object(ms, "b", "good", data, chunk_size=CHUNK)
        copies = [_with(good, name="wrong-digest", digest=digest_of(b"nope")),
                  _with(good, name="bigger", size=9 * CHUNK, chunks=9),
                  _with(good, name="smaller", size=7 * CHUNK, chunks=7, digest=digest_of(data[: 7 * CHUNK]))]
        reads = [*copies, good, *copies, good] if order == "copies-first" else [good, *copies, good, *copies]
        for info in reads:
            if info is good:
                assert await cache.read(info, 0, info.size) == data
                assert await cache.read(info, 5 * CHUNK, 10) == data[5 * CHUNK : 5 * CHUNK + 10]
            else:
                with pytest.raises(Corrupt):
                    await cache.read(info, 0, info.size)
        return good

    good = run(body)
    records = damage_records(caplog, good)
    assert sorted(r.getMessage().split()[1] for r in records) == ["b/bigger", "b/smaller", "b/wrong-digest"]
    assert all(r.levelno == logging.ERROR for r in records)


def test_extra_chunk_after_the_meta_is_ignored_with_one_warning(caplog):
    data = blob(3 * CHUNK)
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "x", data, chunk_size=CHUNK)
        await ms.publish(chunk_subject("b", info.nuid), b"appended by someone else")
        assert await cache.read(info, 0, len(data)) == data  # digest checked too
        assert await cache.read(info, CHUNK, 10) == data[CHUNK : CHUNK + 10]
        return info

    info = run(body)
    records = damage_records(caplog, info)
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "published after the meta" in records[0].getMessage()


@pytest.mark.expect_log("the stream holds 5000 bytes in 5 chunks, the meta says 4000 bytes in 4")
@pytest.mark.parametrize("background", [True, False])
def test_extra_chunk_before_the_meta_makes_every_read_fail(background, caplog):
    """One chunk too many among the version's own: which one is extra cannot be shown."""
    pieces = [blob(1000) for _ in range(4)]
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "x", b"".join(pieces), chunk_sizes=[1000] * 4)
        # The same object written by hand with a duplicate chunk (a retried publish without de-duplication).
        nuid = "D" * 22
        for p in [pieces[0], pieces[1], pieces[1], pieces[2], pieces[3]]:
            await ms.publish(chunk_subject("b", nuid), p)
        dup = _with(info, nuid=nuid, revision=(await ms.stream_info(stream_name("b"))).last_seq + 1)
        for off in (0, 1500, 2500, 3999):
            with pytest.raises(Corrupt):
                await cache.read(dup, off, 1)
        return dup

    dup = run(body, background=background)
    records = damage_records(caplog, dup)
    assert len(records) == 1 and "5 chunks" in records[0].getMessage()


@pytest.mark.expect_log("the meta says 4000 bytes in 5")
def test_meta_counting_more_chunks_than_stored_fails_every_read():
    data = blob(4000)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "c", data, chunk_size=1000)
        lying = _with(info, chunks=5)  # same bytes, one chunk more than stored
        for off in (0, 3999):
            with pytest.raises(Corrupt):
                await cache.read(lying, off, 1)

    run(body)


@pytest.mark.expect_log("the stream holds 458752 bytes in 3 chunks")
def test_oversized_chunk_is_logged_once_however_often_it_is_read(caplog):
    """issue 9: one `cat` of an object with an oversized chunk logged 71 identical ERROR lines."""
    sizes = [CHUNK, CHUNK, 5 * CHUNK]
    data = blob(sum(sizes))
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        real = await put_object(ms, "b", "big", data, chunk_sizes=sizes)
        info = _with(real, size=3 * CHUNK)  # the meta says the last chunk holds CHUNK bytes
        # A `cat`: sequential reads until the first error; again and again.
        for _ in range(3):
            out = b""
            with pytest.raises(Corrupt):
                for off in range(0, info.size, 4096):
                    out += await cache.read(info, off, 4096, readahead=128 * KiB)
            assert out == data[: 2 * CHUNK]  # the chunks whose place is proven
        return info

    info = run(body)
    records = damage_records(caplog, info)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.ERROR


class Tampered:
    """MemoryStreams whose next direct-get replies pass through `tamper` (a transport gone wrong)."""

    def __init__(self, ms: MemoryStreams):
        self._ms = ms
        self.tamper: Callable[[list[StoredMsg]], list[StoredMsg]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ms, name)

    def _apply(self, msgs: list[StoredMsg]) -> list[StoredMsg]:
        tamper, self.tamper = self.tamper, None
        return tamper(msgs) if tamper is not None else msgs

    async def get_batch(self, *args: Any) -> list[StoredMsg]:
        return self._apply(await self._ms.get_batch(*args))

    async def stream_batch(self, *args: Any) -> MemoryBatchStream:
        msgs = self._apply(await self._ms.get_batch(*args))
        return MemoryBatchStream(msgs, 2)


def run_tampered(body: Callable[[MemoryStreams, Tampered, ChunkCache], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        ms = MemoryStreams()
        tampered = Tampered(ms)
        store = ObjectStore(tampered)  # type: ignore[arg-type]
        await store.create_bucket("b")
        cache = ChunkCache(store, batch_bytes=128 * KiB, **kw)
        return await body(ms, tampered, cache)

    return trio.run(main)


def _foreign(m: StoredMsg) -> StoredMsg:
    return replace(m, subject=chunk_subject("b", "F" * 22))


@pytest.mark.parametrize("tamper", ["other-subject", "repeated", "reordered"])
def test_walk_discards_replies_that_are_not_the_next_chunk(tamper):
    data = blob(6 * 1000)

    def change(msgs: list[StoredMsg]) -> list[StoredMsg]:
        if tamper == "other-subject":
            return [msgs[0], _foreign(msgs[1]), *msgs[2:]]
        if tamper == "repeated":
            return [msgs[0], msgs[1], msgs[1], *msgs[2:]]
        return [msgs[0], msgs[2], msgs[1], *msgs[3:]]

    async def body(ms, streams, cache):
        info = await put_object(ms, "b", "t", data, chunk_size=1000)
        streams.tamper = change
        if tamper == "reordered":
            # The early reply's pending count does not fit its place: settled by a scan, exact.
            assert await cache.read(info, 0, len(data)) == data
            assert cache.stats.index_scans == 1
        else:
            with pytest.raises(Unavailable):
                await cache.read(info, 0, len(data))
        # Nothing of the bad batch took a wrong place: the next read is exact.
        assert await cache.read(info, 0, len(data)) == data
        assert await cache.read(info, 2500, 1000) == data[2500:3500]

    run_tampered(body, cache_bytes=1 << 20)


def test_walk_never_takes_the_reply_after_a_lost_one_as_its_chunk():
    """A reply lost in the middle of a batch: the next one's pending count gives it away."""
    data = blob(6 * 1000)

    async def body(ms, streams, cache):
        info = await put_object(ms, "b", "t", data, chunk_size=1000)
        streams.tamper = lambda msgs: [msgs[0], *msgs[2:]]
        assert await cache.read(info, 0, len(data)) == data
        assert cache.stats.index_scans == 1  # settled by a scan, not by guessing

    run_tampered(body, cache_bytes=1 << 20)


@pytest.mark.parametrize("tamper", ["other-subject", "swapped", "lost"])
def test_fetch_fills_each_slot_only_with_its_own_sequence(tamper):
    data = blob(6 * CHUNK)

    def change(msgs: list[StoredMsg]) -> list[StoredMsg]:
        if tamper == "other-subject":
            return [_foreign(msgs[0]), *msgs[1:]]
        if tamper == "swapped":
            return [msgs[1], msgs[0], *msgs[2:]]
        return msgs[1:]

    async def body(ms, streams, cache):
        info = await put_object(ms, "b", "t", data, chunk_size=CHUNK)
        assert await cache.read(info, 5 * CHUNK, 10) == data[5 * CHUNK : 5 * CHUNK + 10]  # layout known
        assert cache.stats.index_scans == 1
        streams.tamper = change
        if tamper == "lost":
            # The chunk that did not come back is asked for alone, and found.
            assert await cache.read(info, 2 * CHUNK, 2 * CHUNK) == data[2 * CHUNK : 4 * CHUNK]
        else:
            with pytest.raises(Unavailable):
                await cache.read(info, 2 * CHUNK, 2 * CHUNK)
        assert await cache.read(info, 0, len(data)) == data

    run_tampered(body, cache_bytes=64 * CHUNK)


# ---------------------------------------------------------------- random access (one scan, then any chunk)
def test_far_read_maps_the_version_with_one_scan_then_each_chunk_is_one_get():
    """A tail read maps the version with one headers-only scan (no payloads) before it serves a byte;
    then any chunk is one direct get, in any order."""
    data = blob(40 * CHUNK + 1234)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "big", data, chunk_size=CHUNK)
        ms.calls.clear()
        assert await cache.read(info, len(data) - 1000, 1000) == data[-1000:]
        s = cache.stats
        assert (s.index_scans, ms.calls["subject_index"]) == (1, 1)
        assert s.chunks_fetched == 1 and s.bytes_fetched == 1234
        order = list(range(1, 40))
        RNG.shuffle(order)
        for k in order:
            off = k * CHUNK + 17
            assert await cache.read(info, off, 4096) == data[off : off + 4096]
        assert s.index_scans == 1 and s.chunks_fetched == 40
        # Every chunk has passed: the digest is checked at the end of a read from the front.
        assert await cache.read(info, 0, len(data)) == data
        layout = cache._layouts[layout_key(info)]
        assert layout.verdict is True

    run(body, background=False)


def test_interleaved_writers_are_read_exactly():
    """Another writer's chunks sit between every pair: the scan places each chunk at its own sequence,
    and every byte reads exactly."""
    a, b = blob(6 * CHUNK), blob(6 * CHUNK)

    async def body(ms, store, cache):
        subj_a, subj_b = chunk_subject("b", "A" * 22), chunk_subject("b", "B" * 22)
        for k in range(6):
            await ms.publish(subj_a, a[k * CHUNK : (k + 1) * CHUNK])
            await ms.publish(subj_b, b[k * CHUNK : (k + 1) * CHUNK])
        meta = await put_object(ms, "b", "a", b"", chunk_size=CHUNK)
        info_a = _with(meta, nuid="A" * 22, size=len(a), chunks=6, digest=digest_of(a), chunk_size=CHUNK,
                       revision=(await ms.stream_info(stream_name("b"))).last_seq + 1)
        got = await read_each_chunk(cache, info_a, a, [5, 2, 4, 0, 3, 1])
        assert got == {k: a[k * CHUNK : (k + 1) * CHUNK] for k in range(6)}
        assert cache.stats.index_scans == 1

    run(body)


@pytest.mark.parametrize("sizes", [
    [CHUNK, CHUNK // 2, CHUNK, CHUNK, CHUNK // 2],  # a short read in the middle, as nats.go may write
    [CHUNK, CHUNK, CHUNK // 2, CHUNK // 2, CHUNK],  # the same bytes in other chunks: the last is full
])
def test_short_chunks_in_the_middle_read_exactly(sizes):
    data = blob(sum(sizes))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "s", data, chunk_size=CHUNK, chunk_sizes=sizes)
        got = await read_each_chunk_at(cache, info, data, sizes, [4, 1, 3, 0, 2])
        assert got == [data[o : o + z] for o, z in zip(offsets(sizes), sizes, strict=True)]
        assert cache.stats.index_scans == 1

    run(body)


def offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:k]) for k in range(len(sizes))]


async def read_each_chunk_at(cache: ChunkCache, info: ObjectInfo, data: bytes, sizes: list[int],
                             order: list[int]) -> list[bytes]:
    starts = offsets(sizes)
    got: dict[int, bytes] = {}
    for k in order:
        got[k] = await cache.read(info, starts[k], sizes[k])
    return [got[k] for k in range(len(sizes))]


@pytest.mark.expect_log("object b/d .*1 of 8 chunks missing")
def test_a_chunk_deleted_before_the_first_read_is_placed_by_a_scan(caplog):
    data = blob(8 * CHUNK)
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "d", data, chunk_size=CHUNK)
        await ms.delete_msg(stream_name("b"), chunk_seqs(ms, info)[3])
        got = await read_each_chunk(cache, info, data, [7, 3, 0, 5, 1, 2, 4, 6])
        assert got == {k: "EIO" if k == 3 else data[k * CHUNK : (k + 1) * CHUNK] for k in range(8)}
        return info

    info = run(body, cache_bytes=1 << 20)
    assert len(damage_records(caplog, info)) == 1


# A hostile writer's version whose first and last chunk, and every chunk a far read fetches, look as one
# writer filling `max_chunk_size` chunks would leave them, but whose chunk k does not start at CHUNK * k:
# chunk 1 is larger than the declared chunk size (and the meta's size is what the chunks hold), or
# chunk 1 is short and the meta claims the bytes of full chunks (a size its chunks do not hold).
LOOKALIKES = {
    "oversized chunk": ([CHUNK, CHUNK + 5000, CHUNK, CHUNK, CHUNK - 5000, 1000], None),
    "size not held": ([CHUNK, CHUNK - 5000, CHUNK, CHUNK, CHUNK, 1000], 5 * CHUNK + 1000),
}


@pytest.mark.expect_log("object b/h .*(the meta says|cannot be read)")
@pytest.mark.parametrize("kind", list(LOOKALIKES))
def test_a_far_read_never_serves_bytes_of_another_offset_whatever_the_meta_claims(kind):
    """The tail first, then chunk 2's and chunk 3's bytes: each read gives the bytes at that offset of
    the chunks in their order (as nats.go's Get streams them), or EIO for a version whose chunks do not
    hold its size, never the bytes a chunk of the declared size would hold there."""
    sizes, claimed = LOOKALIKES[kind]
    data = blob(sum(sizes))

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "h", data, chunk_size=CHUNK, chunk_sizes=sizes)
        if claimed is not None:
            info = _with(info, size=claimed)
        got = {}
        for off in (claimed or len(data)) - 100, 2 * CHUNK + 100, 3 * CHUNK + 100:
            try:
                got[off] = await cache.read(info, off, 64)
            except Corrupt:
                got[off] = "EIO"
        if claimed is None:
            assert got == {off: data[off : off + 64] for off in got}
            assert await cache.read(info, 0, len(data)) == data
        else:
            assert all(v == "EIO" or v == data[off : off + 64] for off, v in got.items()), got

    run(body, cache_bytes=1 << 20)


def test_a_failed_far_fetch_surfaces_as_its_own_error_and_the_next_read_works():
    data = blob(8 * CHUNK)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "p", data, chunk_size=CHUNK)
        ms.fail_next("get_batch", Stale("injected"))  # an answer, not silence: not asked again
        with pytest.raises(Stale, match="injected"):
            await cache.read(info, 7 * CHUNK, 10)
        assert await cache.read(info, 7 * CHUNK, 10) == data[7 * CHUNK : 7 * CHUNK + 10]

    run(body)


# ---------------------------------------------------------------- readahead (one budget, shared fairly)
class Requests:
    """Every chunk request the cache sends (walks and batched gets), per object version: how many, how
    many bytes each asked for, and which versions had one in flight at the same moment."""

    def __init__(self, store: ObjectStore) -> None:
        self.asked: dict[str, list[int]] = {}
        self.in_flight: dict[str, int] = {}
        self.peak: dict[str, int] = {}  # the most requests in flight at one moment, per version
        self.most_at_once = 0  # the most versions with a request in flight at one moment
        fetch, stream = store.fetch_chunks, store.stream_chunks

        async def fetch_chunks(bucket: str, nuid: str, start: int, count: int, max_bytes: int) -> Any:
            self._start(nuid, max_bytes)
            try:
                return await fetch(bucket, nuid, start, count, max_bytes)
            finally:
                self._end(nuid)

        async def stream_chunks(bucket: str, nuid: str, start: int, count: int, max_bytes: int) -> Any:
            self._start(nuid, max_bytes)
            batches = await stream(bucket, nuid, start, count, max_bytes)
            close = batches.close

            async def closed() -> None:
                self._end(nuid)
                await close()

            batches.close = closed
            return batches

        store.fetch_chunks = fetch_chunks  # type: ignore[method-assign]
        store.stream_chunks = stream_chunks  # type: ignore[method-assign]

    def _start(self, nuid: str, max_bytes: int) -> None:
        self.asked.setdefault(nuid, []).append(max_bytes)
        self.in_flight[nuid] = self.in_flight.get(nuid, 0) + 1
        self.peak[nuid] = max(self.peak.get(nuid, 0), self.in_flight[nuid])
        self.most_at_once = max(self.most_at_once, sum(1 for n in self.in_flight.values() if n))

    def _end(self, nuid: str) -> None:
        self.in_flight[nuid] -= 1


async def read_sequentially(cache: ChunkCache, info: ObjectInfo, piece: int, minimum: int, maximum: int) -> bytes:
    """Read a whole version in `piece`-byte reads with the readahead a file handle plans for them."""
    handle = FileHandle(InodeNo(2), info)
    out = bytearray()
    for off in range(0, info.size, piece):
        out += await cache.read(info, off, piece, handle.plan_readahead(off, piece, minimum, maximum))
    return bytes(out)


def test_readahead_grows_while_reads_are_sequential_and_collapses_on_a_random_read():
    data = blob(4 << 20)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "seq.bin", data, chunk_size=64 * KiB)
        handle = FileHandle(InodeNo(2), info)
        windows = []
        for off in range(0, 1 << 20, 64 * KiB):
            ra = handle.plan_readahead(off, 64 * KiB, 64 * KiB, 1 << 20)
            assert await cache.read(info, off, 64 * KiB, ra) == data[off : off + 64 * KiB]
            windows.append(cache.stats.readahead_peak)
        assert windows[0] == 64 * KiB and windows[-1] == 1 << 20 and windows == sorted(windows)
        assert cache.stats.readahead_collapses == 0
        await trio.testing.wait_all_tasks_blocked()  # the last window's readahead has landed
        fetched = cache.stats.chunks_fetched
        far = 3 << 20
        ra = handle.plan_readahead(far, 4096, 64 * KiB, 1 << 20)
        assert ra == 0
        assert await cache.read(info, far, 4096, ra) == data[far : far + 4096]
        assert cache.stats.readahead_collapses == 1
        await trio.testing.wait_all_tasks_blocked()
        # Nothing ahead of it: its own chunk only (a scan, which fetches no payload, placed it).
        assert cache.stats.chunks_fetched - fetched == 1

    run(body, cache_bytes=16 << 20)


def test_parallel_readers_share_the_readahead_budget_and_nothing_is_fetched_twice():
    """Four readers of four versions through a cache whose readahead budget is 1 MiB: each gets its
    share (256 KiB) and requests in flight alongside the others, and no chunk leaves the cache before it
    is read (the chunks a reader has passed go first)."""
    size = 3 << 20
    datas = [blob(size) for _ in range(4)]

    async def body(ms, store, cache):
        infos = [await put_object(ms, "b", f"p{k}.bin", datas[k], chunk_size=32 * KiB) for k in range(4)]
        requests = Requests(store)
        got: dict[int, bytes] = {}

        async def reader(k: int) -> None:
            got[k] = await read_sequentially(cache, infos[k], 32 * KiB, 64 * KiB, 4 << 20)

        async with trio.open_nursery() as n:
            for k in range(4):
                n.start_soon(reader, k)
        assert all(got[k] == datas[k] for k in range(4))
        assert requests.most_at_once == 4
        share = cache.readahead_budget // 4
        for info in infos:
            assert len(requests.asked[info.nuid]) >= 4
            assert max(requests.asked[info.nuid]) <= share + 32 * KiB  # its share beyond the read's own bytes
        assert cache.stats.readahead_peak == share
        assert cache.stats.chunks_fetched == sum(info.chunks for info in infos)

    run(body, cache_bytes=2 << 20, batch_bytes=128 * KiB, delay=0.001)


def test_a_version_whose_layout_is_known_gets_several_batched_requests_in_flight():
    data = blob(4 << 20)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "known.bin", data, chunk_size=64 * KiB)
        await cache.read(info, info.size - 10, 10)  # the layout is mapped: no walk needed from here
        requests = Requests(store)
        assert await read_sequentially(cache, info, 64 * KiB, 1 << 20, 2 << 20) == data
        assert requests.peak[info.nuid] >= 2
        assert cache.stats.chunks_fetched == info.chunks

    run(body, cache_bytes=16 << 20, batch_bytes=128 * KiB, delay=0.001)


def test_a_second_sequential_read_of_a_version_gets_readahead_again():
    data = blob(4 << 20)

    async def body(ms, store, cache):
        info = await put_object(ms, "b", "twice.bin", data, chunk_size=64 * KiB)
        assert await read_sequentially(cache, info, 64 * KiB, 256 * KiB, 1 << 20) == data
        await trio.testing.wait_all_tasks_blocked()
        requests = Requests(store)
        assert await read_sequentially(cache, info, 64 * KiB, 256 * KiB, 1 << 20) == data
        # The cache holds a quarter of the version: the second pass fetches most of it again, a batch
        # (four chunks) per request, several requests ahead of the reads.
        asked = len(requests.asked[info.nuid])
        assert 0 < asked <= info.chunks // 4 + 4
        assert requests.peak[info.nuid] >= 2

    run(body, cache_bytes=1 << 20, batch_bytes=256 * KiB, delay=0.001)


# ---------------------------------------------------------------------------------------------- ChunkLRU
def test_lru_passed_chunks_are_bounded_and_leave_first() -> None:
    from natsfs.chunk_cache import ChunkLRU

    lru = ChunkLRU(10 * KiB, passed_limit=3 * KiB)
    keys = [("b", "n", seq) for seq in range(8)]
    for k in keys[:6]:
        assert lru.put(k, bytes(KiB))
    for k in keys[:5]:  # a sequential reader went past five of them: at most three are kept
        lru.demote(k)
    assert [k in lru for k in keys[:6]] == [False, False, True, True, True, True]
    assert (lru.size, lru.passed_size, len(lru)) == (4 * KiB, 3 * KiB, 4)
    # Room is made from the passed chunks first: the unread readahead (seq 5) outlives them.
    for k in keys[6:]:
        lru.put(k, bytes(3 * KiB))
    assert keys[5] in lru and lru.size <= lru.limit
    assert lru.passed_size == lru.size - sum(len(lru.peek(k) or b"") for k in (keys[5], keys[6], keys[7]))


def test_lru_a_passed_chunk_read_again_is_recently_used() -> None:
    from natsfs.chunk_cache import ChunkLRU

    lru = ChunkLRU(4 * KiB, passed_limit=2 * KiB)
    a, b, c = ("b", "n", 1), ("b", "n", 2), ("b", "n", 3)
    lru.put(a, b"a" * KiB)
    lru.put(b, b"b" * KiB)
    lru.demote(a)
    assert lru.get(a) == b"a" * KiB  # back among the recently used ...
    assert lru.passed_size == 0
    lru.demote(b)
    lru.put(c, b"c" * (2 * KiB) + b"!")  # ... so the passed one goes when room is needed
    assert a in lru and b not in lru and c in lru
    assert lru.size == KiB + 2 * KiB + 1


def test_allocator_keeps_chunk_buffers_on_the_heap() -> None:
    from natsfs.memory import keep_freed_buffers

    assert keep_freed_buffers() is True  # glibc (the supported platform) takes both settings


@pytest.mark.expect_log("digest mismatch: meta says SHA-256=")
def test_a_streamed_read_with_requests_out_of_order_keeps_little_and_still_checks_the_digest(monkeypatch):
    """The kernel's readahead requests come a little out of order: every chunk a sequential reader has
    had goes to the small passed tier (also those of a request behind the furthest one), and the chunks
    still pass through the digest check in order."""
    import natsfs.chunk_cache as chunk_cache_module

    monkeypatch.setattr(chunk_cache_module, "PASSED_BYTES", 256 * KiB)
    sizes = [64 * KiB] * 32
    data = blob(sum(sizes))
    step = 128 * KiB

    async def body(ms, store, cache):
        for name, digest in (("good", None), ("bad", digest_of(b"x"))):
            info = await put_object(ms, "b", name, data, chunk_sizes=sizes, digest=digest)
            offsets = list(range(0, len(data), step))
            for i in range(0, len(offsets) - 1, 2):  # each pair of requests swapped
                offsets[i], offsets[i + 1] = offsets[i + 1], offsets[i]
            last = offsets.pop(offsets.index(len(data) - step))  # the end last: it settles the check
            for off in [*offsets, last]:
                if name == "bad" and off == last:
                    with pytest.raises(Corrupt):
                        await cache.read(info, off, step, readahead=512 * KiB)
                else:
                    assert await cache.read(info, off, step, readahead=512 * KiB) == data[off : off + step]
                assert cache.cached_bytes <= 256 * KiB + 512 * KiB + 2 * step  # passed tier + readahead

    run(body, batch_bytes=128 * KiB)


# ---------------------------------------------------------------- streams without direct gets
async def refuse_direct_gets(ms: MemoryStreams, bucket: str) -> None:
    """Make the bucket's stream one an older client made: no `allow_direct`. Its batched gets are then
    answered as `JetStreams` answers them for such a stream (STREAM.MSG.GET): no pending counts."""
    st = await ms.stream_info(stream_name(bucket))
    await ms.update_stream(dict(st.config, allow_direct=False))


def test_a_bucket_created_by_natsfs_allows_direct_gets():
    async def body(ms, store, cache):
        assert (await ms.stream_info(stream_name("b"))).config["allow_direct"] is True

    run(body)


@pytest.mark.expect_log("1 of 8 chunks missing", "digest mismatch: meta says SHA-256=")
@pytest.mark.parametrize("order", ORDERS)
def test_a_stream_without_direct_gets_reads_exactly_with_every_check(order, caplog):
    """Replies without pending counts (STREAM.MSG.GET) prove no layout by themselves: each version is
    mapped by a headers-only scan, then read exactly, front to back or anywhere first, its digest
    checked; a deleted chunk fails its reads alone, with one log line; a wrong digest fails the read
    that reaches the end."""
    data = blob(8 * CHUNK - 1000)
    caplog.set_level(logging.DEBUG)

    async def body(ms, store, cache):
        await refuse_direct_gets(ms, "b")
        await put_object(ms, "b", "before", blob(10))  # the chunks do not start at sequence 1
        good = await put_object(ms, "b", "good", data, chunk_size=CHUNK)
        broken = await put_object(ms, "b", "broken", data, chunk_size=CHUNK)
        lying = await put_object(ms, "b", "lying", data, chunk_size=CHUNK, digest=digest_of(b"other bytes"))
        await ms.delete_msg(stream_name("b"), chunk_seqs(ms, broken)[3])
        assert ms.calls["msg_get"] == 0
        assert await read_each_chunk(cache, good, data, ORDERS[order]) == {
            k: data[k * CHUNK : (k + 1) * CHUNK] for k in range(8)}
        assert await cache.read(good, 0, len(data)) == data
        assert cache._layout_of(good).verdict is True
        assert await read_each_chunk(cache, broken, data, ORDERS[order]) == {
            k: "EIO" if k == 3 else data[k * CHUNK : (k + 1) * CHUNK] for k in range(8)}
        with pytest.raises(Corrupt):
            await cache.read(lying, 0, len(data))
        assert ms.calls["msg_get"] > 0
        return broken, lying

    broken, lying = run(body, batch_bytes=128 * KiB)
    for info, text in ((broken, "1 of 8 chunks missing"), (lying, "digest mismatch")):
        records = damage_records(caplog, info)
        assert len(records) == 1 and text in records[0].getMessage(), [r.getMessage() for r in records]
