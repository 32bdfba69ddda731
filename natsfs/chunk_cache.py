"""Chunk-aligned reads: where each chunk of an object lives, a byte-bounded cache, shared fetches, readahead.

Chunks are cached under `(bucket, nuid, chunk index)`. A nuid is fresh on every put, so a replaced
object can never be served from the cache of its predecessor. The cache is a cachetools LRU bounded in
bytes. Concurrent misses on one chunk share one fetch (an in-flight table of trio Events).

Where chunks live (`Layout`: stream sequence and end offset of each chunk) is learned lazily: a read
from the front walks forward with batched direct gets that return data and sequences together; a read
far from what is known maps the whole object with one headers-only scan (no payloads), then fetches
just the chunks it touches. Chunk sizes are never assumed equal. Readahead runs in the background,
bounded by a capacity limiter, and its failures are left for the foreground read to report.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import hashlib
import logging
from array import array
from collections.abc import Iterable

import cachetools
import trio

from .adr20 import ObjectInfo, ObjectStore, format_digest, parse_digest
from .errors import Corrupt, NatsFSError, Stale, Unavailable
from .futures import wait_future

log = logging.getLogger(__name__)

ChunkKey = tuple[str, str, int]

# One worker hashes every version's chunks, in submission order, off the trio thread (hashlib drops
# the GIL on large buffers, so hashing overlaps with serving requests).
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="natsfs-sha256")


class Layout:
    """Stream sequence and end offset of the chunks of one object that are known so far, in order."""

    __slots__ = ("busy", "complete", "ends", "error", "grew", "hash_pos", "hasher", "seqs", "verdict")

    def __init__(self) -> None:
        self.seqs = array("q")
        self.ends = array("q")
        self.complete = False
        self.busy = False  # a walk or scan is under way; wait on `grew`
        self.grew = trio.Event()
        self.error: NatsFSError | None = None
        # Digest check of this version: chunks are hashed in order as they become available.
        self.hasher = hashlib.sha256()
        self.hash_pos = 0  # index of the next chunk to hash
        self.verdict: bool | None = None  # None: not (yet) verified

    def wake(self) -> None:
        grew, self.grew = self.grew, trio.Event()
        grew.set()

    @property
    def known_bytes(self) -> int:
        return self.ends[-1] if self.ends else 0

    def chunk_at(self, offset: int) -> int:
        return bisect.bisect_right(self.ends, offset)

    def start_of(self, idx: int) -> int:
        return self.ends[idx - 1] if idx else 0

    def size_of(self, idx: int) -> int:
        return self.ends[idx] - self.start_of(idx)

    def append(self, seq: int, size: int) -> None:
        self.seqs.append(seq)
        self.ends.append(self.known_bytes + size)


class CacheStats:
    """Counters a bench or `natsfs status` reads (via the root's user.natsfs.stats xattr)."""

    def __init__(self) -> None:
        self.fetch_requests = 0
        self.chunks_fetched = 0
        self.bytes_fetched = 0
        self.index_scans = 0
        self.hits = 0
        self.misses = 0
        self.reads = 0
        self.read_bytes = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class ChunkCache:
    def __init__(self, store: ObjectStore, *, cache_bytes: int, batch_bytes: int = 4 << 20,
                 parallelism: int = 4):
        self.store = store
        self.cache_bytes = cache_bytes
        self.batch_bytes = max(batch_bytes, 128 * 1024)
        self._data: cachetools.LRUCache[ChunkKey, bytes] = cachetools.LRUCache(cache_bytes, getsizeof=len)
        self._layouts: cachetools.LRUCache[tuple[str, str], Layout] = cachetools.LRUCache(4096)
        self._inflight: dict[ChunkKey, trio.Event] = {}
        self._limiter = trio.CapacityLimiter(parallelism)
        self._nursery: trio.Nursery | None = None
        self.stats = CacheStats()

    def start(self, nursery: trio.Nursery) -> None:
        """Background readahead runs in `nursery`; without one, reads still work, just without it."""
        self._nursery = nursery

    @property
    def cached_bytes(self) -> int:
        return int(self._data.currsize)

    # ------------------------------------------------------------------ reading
    async def read(self, info: ObjectInfo, offset: int, size: int, readahead: int = 0) -> bytes:
        """Bytes [offset, offset+size) of `info`'s version (short at EOF); prefetch `readahead` beyond."""
        end = min(offset + size, info.size)
        if offset >= end:
            return b""
        self.stats.reads += 1
        self.stats.read_bytes += end - offset
        layout = await self._layout_covering(info, offset, end, end + readahead)
        if layout.verdict is False:
            raise Corrupt(f"{info.bucket}/{info.name}: version {info.nuid} failed its digest check")
        first, last = layout.chunk_at(offset), layout.chunk_at(end - 1)
        pieces: list[bytes] = []
        fetched: dict[int, bytes] = {}
        for idx in range(first, last + 1):
            data = fetched.get(idx)
            if data is None:
                data = self._data.get((info.bucket, info.nuid, idx))
                if data is None:
                    # Keep what came along for this read even if the cache is too small to hold it.
                    fetched.update(await self._get_missing(info, layout, idx, last + 1))
                    data = fetched[idx]
                else:
                    self.stats.hits += 1
            pieces.append(data)
        if readahead > 0:
            self._prefetch(info, layout, last + 1, min(end + readahead, info.size))
        if end == info.size and layout.verdict is None:
            await self._verify(info, layout)
        if len(pieces) == 1:
            chunk_start = layout.start_of(first)
            data = pieces[0]
            if offset == chunk_start and end - offset == len(data):
                return data  # the whole chunk: no copy
            return data[offset - chunk_start : end - chunk_start]
        joined = b"".join(pieces)
        base = layout.start_of(first)
        if offset == base and end - base == len(joined):
            return joined
        return joined[offset - base : end - base]

    async def _get_missing(self, info: ObjectInfo, layout: Layout, idx: int, stop: int) -> dict[int, bytes]:
        """Chunk `idx` (and any missing ones after it, up to `stop`), sharing fetches already in flight."""
        for _ in range(3):
            key = (info.bucket, info.nuid, idx)
            data = self._data.get(key)
            if data is not None:
                return {idx: data}
            event = self._inflight.get(key)
            if event is not None:
                await event.wait()
                continue
            self.stats.misses += 1
            run = self._claim(info, layout, idx, stop)
            return await self._fetch_claimed(info, layout, *run)
        # Others kept fetching it and it kept being evicted: fetch our own copy.
        run = self._claim(info, layout, idx, idx + 1, force=True)
        return await self._fetch_claimed(info, layout, *run)

    # ------------------------------------------------------------------ layout
    async def _layout_covering(self, info: ObjectInfo, offset: int, end: int, want_end: int = 0) -> Layout:
        """The object's layout, known at least up to `end` (walking forward up to `want_end` if it must)."""
        key = (info.bucket, info.nuid)
        layout = self._layouts.get(key)
        if layout is None:
            layout = Layout()
            self._layouts[key] = layout
        while layout.known_bytes < end and not layout.complete:
            if layout.error is not None:
                error, layout.error = layout.error, None
                raise error
            if layout.busy:
                await layout.grew.wait()
            elif offset <= layout.known_bytes + self.batch_bytes:
                if self._nursery is None:
                    layout.busy = True
                    await self._extend(info, layout, max(end, want_end))
                else:
                    self._start_extend(info, layout, max(end, want_end))
                    await layout.grew.wait()
            else:
                layout.busy = True
                try:
                    await self._map_all(info, layout)
                finally:
                    layout.busy = False
                    layout.wake()
        if layout.known_bytes < end:
            raise Corrupt(f"{info.bucket}/{info.name}: chunks hold {layout.known_bytes} bytes, "
                          f"meta says {info.size}")
        return layout

    def _chunk_guess(self, info: ObjectInfo) -> int:
        if info.chunks:
            return max(1, -(-info.size // info.chunks))
        return self.store.chunk_size

    def _start_extend(self, info: ObjectInfo, layout: Layout, want_end: int) -> None:
        assert self._nursery is not None
        layout.busy = True
        self._nursery.start_soon(self._extend, info, layout, want_end)

    async def _extend(self, info: ObjectInfo, layout: Layout, want_end: int) -> None:
        """Walk forward from the last known chunk with one batched direct get whose chunks are taken
        (into the layout and the cache) as they arrive, so readers never wait for the whole batch."""
        try:
            remaining = info.chunks - len(layout.seqs)
            if remaining <= 0:
                self._finish(info, layout)
                return
            want = max(self.batch_bytes, want_end - layout.known_bytes)
            count = min(remaining, -(-want // self._chunk_guess(info)))
            start_seq = layout.seqs[-1] + 1 if layout.seqs else 1
            self.stats.fetch_requests += 1
            batches = await self.store.stream_chunks(info.bucket, info.nuid, start_seq, count, want)
            got = 0
            try:
                while (msgs := await batches.next()) is not None:
                    for m in msgs:
                        if len(layout.seqs) >= info.chunks or layout.known_bytes + len(m.data) > info.size:
                            layout.verdict = False  # never serve bytes the meta does not account for
                            raise Corrupt(f"{info.bucket}/{info.name}: the stream holds more than the meta's "
                                          f"{info.size} bytes in {info.chunks} chunks")
                        layout.append(m.seq, len(m.data))
                        self._store(info, len(layout.seqs) - 1, m.data, layout)
                        self.stats.chunks_fetched += 1
                        self.stats.bytes_fetched += len(m.data)
                    got += len(msgs)
                    if msgs:
                        layout.wake()
            finally:
                await batches.close()
            if not got:
                raise Stale(f"{info.bucket}/{info.name}: chunks of version {info.nuid} are gone")
            if len(layout.seqs) >= info.chunks:
                self._finish(info, layout)
        except NatsFSError as e:
            layout.error = e
        except Exception as e:
            log.exception("fetching %s/%s failed unexpectedly", info.bucket, info.name)
            layout.error = Unavailable(f"{info.bucket}/{info.name}: fetch failed: {e!r}")
        finally:
            layout.busy = False
            layout.wake()

    async def _map_all(self, info: ObjectInfo, layout: Layout) -> None:
        """Learn every chunk's sequence and size with one headers-only scan."""
        self.stats.index_scans += 1
        index = await self.store.chunk_index(info.bucket, info.nuid)
        if not index and info.chunks:
            raise Stale(f"{info.bucket}/{info.name}: chunks of version {info.nuid} are gone")
        known = len(layout.seqs)
        if known and (len(index) < known or index[known - 1][0] != layout.seqs[known - 1]):
            raise Stale(f"{info.bucket}/{info.name}: chunks of version {info.nuid} changed under us")
        for seq, size in index[known:]:
            layout.append(seq, size)
        self._finish(info, layout)

    def _finish(self, info: ObjectInfo, layout: Layout) -> None:
        layout.complete = True
        if len(layout.seqs) != info.chunks or layout.known_bytes != info.size:
            layout.verdict = False  # refused from now on, like a failed digest
            log.error("object %s/%s: meta says %d bytes in %d chunks, the stream holds %d bytes in %d",
                      info.bucket, info.name, info.size, info.chunks, layout.known_bytes, len(layout.seqs))
            raise Corrupt(f"{info.bucket}/{info.name}: chunks do not match the meta")

    # ------------------------------------------------------------------ fetching
    async def _fetch(self, info: ObjectInfo, start_seq: int, count: int, max_bytes: int):
        self.stats.fetch_requests += 1
        msgs = await self.store.fetch_chunks(info.bucket, info.nuid, start_seq, count, max_bytes)
        self.stats.chunks_fetched += len(msgs)
        self.stats.bytes_fetched += sum(len(m.data) for m in msgs)
        return msgs

    def _store(self, info: ObjectInfo, idx: int, data: bytes, layout: Layout | None = None) -> None:
        # A chunk larger than the whole cache (ValueError) is served uncached.
        with contextlib.suppress(ValueError):
            self._data[(info.bucket, info.nuid, idx)] = data
        if layout is not None and idx == layout.hash_pos:
            self._hash_forward(info, layout, data)

    def _hash_forward(self, info: ObjectInfo, layout: Layout, data: bytes | None) -> None:
        """Hash chunk `hash_pos` (given, or from the cache) and every cached chunk after it."""
        while layout.hash_pos < len(layout.seqs):
            if data is None:
                data = self._data.get((info.bucket, info.nuid, layout.hash_pos))
                if data is None:
                    return
            _HASHER.submit(layout.hasher.update, data)
            layout.hash_pos += 1
            data = None

    async def _verify(self, info: ObjectInfo, layout: Layout) -> None:
        """Finish the digest check of a version whose last byte is being served, when every chunk
        has passed (or can still pass) through in order; a read pattern that never had some chunk
        in hand (random access with eviction) is left unverified rather than refetched."""
        expected = parse_digest(info.digest)
        if expected is None:
            return
        while layout.hash_pos < info.chunks and layout.complete:
            before = layout.hash_pos
            self._hash_forward(info, layout, None)
            if layout.hash_pos == before:
                event = self._inflight.get((info.bucket, info.nuid, layout.hash_pos))
                if event is None:
                    return
                await event.wait()
        if layout.hash_pos < info.chunks or layout.verdict is not None:
            return
        raw = await wait_future(_HASHER.submit(layout.hasher.digest))
        if layout.verdict is not None:
            return
        layout.verdict = raw == expected
        if not layout.verdict:
            raise Corrupt(f"digest mismatch for {info.bucket}/{info.name}: meta says {info.digest}, "
                          f"data hashes to {format_digest(raw)}")  # type: ignore[arg-type]

    def _claim(self, info: ObjectInfo, layout: Layout, start: int, stop: int,
               force: bool = False) -> tuple[int, int, list[trio.Event]]:
        """Mark a run of missing chunks [start, end) as in flight; stops at one cached or claimed."""
        events: list[trio.Event] = []
        end = start
        budget = self.batch_bytes
        while end < stop and end < len(layout.seqs):
            key = (info.bucket, info.nuid, end)
            if end > start and (key in self._inflight or key in self._data):
                break
            if end > start and budget <= 0:
                break
            budget -= layout.size_of(end)
            if key not in self._inflight and not force:
                ev = trio.Event()
                self._inflight[key] = ev
                events.append(ev)
            end += 1
        return start, end, events

    async def _fetch_claimed(self, info: ObjectInfo, layout: Layout, start: int, end: int,
                             events: list[trio.Event]) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        try:
            wanted = layout.ends[end - 1] - layout.start_of(start)
            msgs = await self._fetch(info, layout.seqs[start], end - start, max(wanted, self.batch_bytes))
            if not msgs or msgs[0].seq != layout.seqs[start]:
                raise Stale(f"{info.bucket}/{info.name}: chunk {start} of version {info.nuid} is gone")
            for i, m in enumerate(msgs):
                idx = start + i
                if idx >= end:
                    break
                if m.seq != layout.seqs[idx]:
                    raise Stale(f"{info.bucket}/{info.name}: chunk {idx} of version {info.nuid} is gone")
                if len(m.data) != layout.size_of(idx):
                    raise Corrupt(f"{info.bucket}/{info.name}: chunk {idx} changed size")
                out[idx] = m.data
                self._store(info, idx, m.data, layout)
        finally:
            for k in range(start, end):
                ev = self._inflight.get((info.bucket, info.nuid, k))
                if ev is not None and ev in events:
                    del self._inflight[(info.bucket, info.nuid, k)]
                    ev.set()
        return out

    # ------------------------------------------------------------------ readahead
    def _prefetch(self, info: ObjectInfo, layout: Layout, from_idx: int, to_offset: int) -> None:
        if self._nursery is None or to_offset <= layout.start_of(min(from_idx, len(layout.seqs))):
            return
        if layout.known_bytes < to_offset and not layout.complete:
            if not layout.busy:
                self._start_extend(info, layout, to_offset)
            return
        stop = layout.chunk_at(to_offset - 1) + 1
        idx = from_idx
        while idx < stop:
            key = (info.bucket, info.nuid, idx)
            if key in self._data or key in self._inflight:
                idx += 1
                continue
            run = self._claim(info, layout, idx, stop)
            self._nursery.start_soon(self._prefetch_run, info, layout, run)
            idx = run[1]

    async def _prefetch_run(self, info: ObjectInfo, layout: Layout, run: tuple[int, int, list[trio.Event]]) -> None:
        try:
            async with self._limiter:
                await self._fetch_claimed(info, layout, *run)
        except NatsFSError as e:
            log.debug("readahead of %s/%s stopped: %s", info.bucket, info.name, e)
        except Exception:
            log.exception("readahead of %s/%s failed unexpectedly", info.bucket, info.name)

    def forget_objects(self, keys: Iterable[tuple[str, str]]) -> None:
        for key in keys:
            self._layouts.pop(key, None)
