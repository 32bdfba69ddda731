"""Chunk-aligned reads: where each chunk of a version lives (proven), a byte-bounded cache, shared
fetches, readahead, digest checks.

Chunks are cached under `(bucket, nuid, stream sequence)`: a reply can only ever fill the slot of its own
sequence, and a nuid is fresh on every put, so a replaced object is never served from its predecessor's
chunks. Layouts and digest verdicts are kept per claim of a meta (`layout_key`: nuid, size, chunks and
digest), not per nuid: any client may write a meta naming another object's nuid with other claims (a
wrong digest, more or fewer chunks), and each meta's claims are checked on their own, so such a copy
fails its own checks without making the good object unreadable, and is never served on the strength of
a layout or a digest that another meta's claims proved. Chunk bytes are still shared between them.
The cache is an LRU bounded in bytes (`ChunkLRU`) in which a sequential reader's passed chunks go
first. Concurrent misses on one chunk share one fetch (an in-flight table of trio Events).

Where chunks live (`Layout`: stream sequence and end offset of each chunk) is learned lazily and never
assumed: chunk sizes may differ anywhere, so no offset is computed from a chunk size. A read from the
front walks forward with batched direct gets that return data and sequences together; each reply is
taken only if its subject is this nuid's chunk subject, its sequence follows the last known chunk, the
chunk count it proves (the chunks before it, itself and the server's count of those after it) is the
meta's, its bytes fit the meta's size and it was stored before the meta. So a chunk is served only when
its offset is proven. Replies without that count (a stream that does not allow direct gets is read with
STREAM.MSG.GET, see natsfs.jetstream) prove no offset: such a version is mapped by the scan below (their
bytes are kept, under their own sequences). A read far from what is known maps the whole version
with one headers-only scan (no payloads; see "Random access" below). A version whose chunks do not
match its meta is placed once by `place_chunks`, which serves what it can prove and marks the rest
unreadable (EIO); each such version is logged once. Readahead runs in the
background, under one byte budget shared equally by the versions being read (see `ChunkCache`), and its
failures are left for the foreground read to report. Digests are checked per version: each read hands
what it serves (and what readahead brought in after it) to one hashing thread, in chunk order.

Random access. A read far from what is known maps the version with one headers-only scan
(sequence and size of every chunk) before it serves a byte. Computing the slots from two probes instead
(the first chunk and the last, at consecutive sequences, every chunk but the last `max_chunk_size`
bytes) rested on the writer: a chunk larger than `max_chunk_size`, or a meta whose `size` is not what
its chunks hold, lets both probes and every fetched chunk fit while chunk i does not start at
`max_chunk_size * i`, and the bytes it served (and the kernel kept in its page cache) came from another
offset, unnoticed by the digest check, which hashes chunks by their proven order. Any client of a
bucket can write such a meta; only the sizes of all the chunks before a byte prove its offset.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import cachetools
import trio

from .adr20 import ObjectInfo, ObjectStore, chunk_subject, format_digest, parse_digest
from .errors import Corrupt, NatsFSError, NoConnection, Stale, Unavailable
from .futures import wait_done, wait_future
from .streams import Payload, StoredMsg

log = logging.getLogger(__name__)


def _own_chunk_subject(info: ObjectInfo) -> str:
    """The chunk subject of a version; `Stale`, as for a version whose chunks were all purged, when its
    nuid names none (another client's wildcard nuid, `ObjectInfo.wildcard_nuid`: no chunk is published to
    a subject filter as one object's, and a rewrite of that meta on a fresh nuid reads the same)."""
    if not info.nuid:
        raise Stale(f"{info.bucket}/{info.name}: no chunks of its own (its nuid {info.wildcard_nuid!r} names "
                    "no chunk subject)")
    return chunk_subject(info.bucket, info.nuid)

ChunkKey = tuple[str, str, int]  # (bucket, nuid, stream sequence of the chunk)
# What a meta claims about its version: (bucket, nuid, size, chunks, digest). A layout and a digest
# verdict are proven for these claims; another meta naming the same nuid with other claims gets its own.
LayoutKey = tuple[str, str, int, int, str]

# Chunks a sequential reader has gone past, kept for the kernel reading them again (see `ChunkLRU`).
PASSED_BYTES = 8 * 1024 * 1024

# One worker hashes every version's chunks, in submission order, off the trio thread (hashlib drops
# the GIL on large buffers, so hashing overlaps with serving requests).
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="natsfs-sha256")


# Checking a sequence gap of a damaged version for room scans it (headers only): at most this many
# gaps, each at most this many sequences long.
GAP_CHECKS = 16
# A fetch the server did not answer (its node died, a stream between leaders) is tried again for this
# long before the read fails: a cluster elects a new leader within about ten seconds. A read request
# gets one deadline for everything it waits for, `max(request timeout, FETCH_RETRY_S)` from its start
# (see `ChunkCache.read`); a fetch that found no connection at all (`NoConnection`, after waiting the
# request timeout for one), or a server that has sent nothing for a request timeout and does not answer
# a PING (`NoConnection` too, from `_TrioReads.check_answering`), is not asked again.
FETCH_RETRY_S = 15.0
_FETCH_PAUSE_S = 0.25
GAP_SCAN_LIMIT = 100_000
# A version not read for this long no longer counts as a stream sharing the readahead budget.
STREAM_IDLE_S = 1.0
# Bytes handed to the hashing thread and not hashed yet, beyond which a read waits for it: chunks
# queued for hashing stay in memory even once evicted, and a starved hashing thread must not let that
# queue grow without bound.
HASH_BACKLOG = 16 * 1024 * 1024

# The sequence of a slot that stands for bytes whose chunks cannot be placed (missing, or not provably
# where they seem to be). Stream sequences start at 1.
UNPROVEN = 0


class ChunkLRU:
    """Chunk bytes by key, bounded in bytes, the least recently used leaving first.

    A chunk a sequential reader has gone past is `demote`d: the kernel's page cache holds its bytes now,
    so keeping it too would cache the stream twice. Passed chunks wait in a small tier of their own
    (`passed_limit` bytes, oldest leaving first, and first to go when room is needed), which covers the
    kernel reading a page again that it just dropped; the rest of the cache stays for readahead nobody
    has read yet and for random reads. Freeing passed chunks early also lets the allocator hand their
    memory to the next chunks received, instead of faulting in fresh pages for every chunk."""

    def __init__(self, limit: int, passed_limit: int | None = None) -> None:
        self.limit = limit
        self.passed_limit = min(limit, PASSED_BYTES if passed_limit is None else passed_limit)
        self.size = 0
        self.passed_size = 0
        self._items: OrderedDict[ChunkKey, Payload] = OrderedDict()
        self._passed: OrderedDict[ChunkKey, Payload] = OrderedDict()

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._items or key in self._passed

    def __len__(self) -> int:
        return len(self._items) + len(self._passed)

    def get(self, key: ChunkKey) -> Payload | None:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
            return data
        data = self._passed.pop(key, None)
        if data is not None:  # read again: recently used after all
            self.passed_size -= len(data)
            self._items[key] = data
        return data

    def peek(self, key: ChunkKey) -> Payload | None:
        """The chunk, if cached, without making it recently used."""
        data = self._items.get(key)
        return data if data is not None else self._passed.get(key)

    def put(self, key: ChunkKey, data: Payload) -> bool:
        """Keep `data` (evicting passed chunks first, then the least recently used); False for a chunk
        larger than the whole cache."""
        size = len(data)
        if size > self.limit:
            return False
        self._forget(key)
        self._items[key] = data
        self.size += size
        self._evict()
        return True

    def demote(self, key: ChunkKey) -> None:
        data = self._items.pop(key, None)
        if data is None:
            return
        self._passed[key] = data
        self.passed_size += len(data)
        while self.passed_size > self.passed_limit:
            self._drop_oldest(self._passed)

    def _forget(self, key: ChunkKey) -> None:
        for tier in (self._items, self._passed):
            old = tier.pop(key, None)
            if old is not None:
                self.size -= len(old)
                if tier is self._passed:
                    self.passed_size -= len(old)

    def _drop_oldest(self, tier: OrderedDict[ChunkKey, Payload]) -> None:
        _, gone = tier.popitem(last=False)
        self.size -= len(gone)
        if tier is self._passed:
            self.passed_size -= len(gone)

    def _evict(self) -> None:
        while self.size > self.limit:
            self._drop_oldest(self._passed if self._passed else self._items)


class Layout:
    """Where the bytes of one version live, as far as it is proven: one slot per chunk in offset order
    (stream sequence and end offset), known from the front. A damaged version (see `place_chunks`)
    also has one `UNPROVEN` slot covering the bytes no chunk can be proven to hold."""

    __slots__ = ("busy", "complete", "ends", "error", "error_began", "generation", "gone", "grew",
                 "hash_pos", "hasher", "intact", "last_read", "purged", "read_end", "reported", "retry_error", "runs",
                 "seqs", "verdict", "walk_to", "window")

    def __init__(self) -> None:
        self.seqs = array("q")
        self.ends = array("q")
        self.complete = False  # slots cover the whole size
        self.intact = True  # the slots are exactly the meta's chunks, all present: the digest can be checked
        self.gone: set[int] = set()  # slots whose chunk vanished after its place was proven
        self.generation = 0  # bumped when the slots are rebuilt, so a read that waited looks again
        self.reported: set[str] = set()  # causes already logged for this version (one line each)
        self.busy = False  # a walk or scan is under way; wait on `grew`
        self.grew = trio.Event()
        self.error: NatsFSError | None = None
        self.retry_error = False  # `error` is the server not answering: worth another walk
        self.error_began = 0.0  # when the walk that failed with `error` began (trio clock)
        # The server answered that this version's chunks are gone (replaced or deleted, then purged): every
        # read of it fails with this from then on, also of chunks still cached (see `ChunkCache.read`).
        self.purged: str | None = None
        # Digest check of this version: chunks are hashed in order as reads serve them.
        self.hasher = hashlib.sha256()
        self.hash_pos = 0  # index of the next chunk to hash
        self.verdict: bool | None = None  # None: not (yet) verified
        # Readahead of this version (see `ChunkCache._readahead`): the window its last read was granted,
        # when that read came (trio clock), the furthest a sequential read got, how far readers want the
        # layout walk to go, and its prefetch runs in flight.
        self.window = 0
        self.last_read = 0.0
        self.read_end = 0
        self.walk_to = 0
        self.runs = 0

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

    def readable(self, idx: int) -> bool:
        return self.seqs[idx] != UNPROVEN and idx not in self.gone

    def replace(self, slots: list[tuple[int, int]], gone: set[int], intact: bool) -> None:
        """Rebuild from `place_chunks`; the old slots stay a prefix, so cached bytes keep their place."""
        self.seqs, self.ends = array("q"), array("q")
        for seq, size in slots:
            self.append(seq, size)
        self.gone = gone
        self.intact = intact
        self.complete = True
        self.generation += 1

@dataclass
class Placement:
    """The slots of a version (`(seq, size)`, `UNPROVEN` for bytes no chunk is proven to hold), the
    slots whose chunk is gone, whether the version is intact, and what is wrong with it."""

    slots: list[tuple[int, int]]
    gone: set[int]
    intact: bool
    problems: list[str]
    unreadable: int  # bytes that cannot be served
    # The sequence gaps (lo, hi), exclusive, that could hold a missing chunk, in order: showing that
    # the first or the last is full of other messages (`room` 0) narrows the unproven bytes.
    gaps: list[tuple[int, int]]


def place_chunks(size: int, chunks: int, revision: int, prefix: Sequence[tuple[int, int]],
                 present: Sequence[tuple[int, int]], room: Mapping[tuple[int, int], int] | None = None
                 ) -> Placement:
    """Where each chunk of a version is, from every chunk message of its nuid (`present`, (seq, size) in
    stream order, from a complete scan) and the meta's `size`, `chunks` and `revision` (the meta's
    stream sequence, 0 if not known). `prefix` are the first chunks, already proven by a walk.

    What it relies on: every ADR-20 writer publishes a version's chunks in order and before its meta,
    so chunk i+1 has a higher sequence than chunk i, all below the meta's. Then:
    - chunks after the meta's sequence are not part of the version (ignored);
    - if the rest are exactly `chunks` chunks holding exactly `size` bytes, every offset is proven;
    - if k chunks are missing, a missing chunk was stored between the sequences of its present
      neighbours and has since been deleted, so only gaps in the sequences can hold one, and only as
      many as the gap has sequences without a message: `room` holds that count for the gaps scanned
      (0: every sequence in it holds another message), a gap not scanned may hold up to its length.
      Chunks before the first gap that could hold one are where they seem, chunks after the last one
      are at `size` minus the bytes after them; the bytes in between are unproven. With the other
      chunks stored contiguously (one writer) that is exactly the missing chunks' bytes;
    - if the gaps cannot hold the k missing chunks (all of them full, as when the meta counts a chunk
      that was never stored), no chunk's place can be shown: every byte after the proven prefix is
      unproven, exactly as for anything else (more chunks than the meta says, or sizes that do not
      add up).
    """
    slots = list(prefix)
    prefix_bytes = sum(z for _, z in prefix)
    on_subject = {s for s, _ in present}
    gone = {i for i, (s, _) in enumerate(prefix) if s not in on_subject}
    problems: list[str] = []
    if gone:
        problems.append("chunk " + ", ".join(str(i) for i in sorted(gone)) + " gone")
    last_prefix_seq = prefix[-1][0] if prefix else 0
    after = [(s, z) for s, z in present if s > last_prefix_seq]
    rest = [(s, z) for s, z in after if not revision or s < revision]
    if len(rest) < len(after):
        problems.append(f"{len(after) - len(rest)} chunk message(s) published after the meta, ignored")
    wanted = chunks - len(prefix)
    missing = wanted - len(rest)
    missing_bytes = size - prefix_bytes - sum(z for _, z in rest)
    candidates: list[int] = []
    gaps: list[tuple[int, int]] = []
    room = room or {}
    unplaceable = False
    if missing > 0 and missing_bytes >= missing:
        bounds = [last_prefix_seq, *(s for s, _ in rest), revision or (1 << 63)]
        holes = {j: room.get((bounds[j], bounds[j + 1]), bounds[j + 1] - bounds[j] - 1) for j in range(len(rest) + 1)}
        candidates = [j for j, n in holes.items() if n > 0]
        gaps = [(bounds[j], bounds[j + 1]) for j in candidates]
        if sum(holes[j] for j in candidates) < missing:
            # Not one place where the missing chunks can have been stored: the meta counts chunks that
            # never were, and which of the present ones is which cannot be told.
            unplaceable = True
            candidates, gaps = [], []
    if missing == 0 and missing_bytes == 0:
        slots += rest
    elif candidates:
        lo, hi = candidates[0], candidates[-1]
        tail = rest[hi:]
        head = rest[:lo]
        hole = size - prefix_bytes - sum(z for _, z in head) - sum(z for _, z in tail)
        slots += head
        slots.append((UNPROVEN, hole))
        slots += tail
        problems.append(f"{missing} of {chunks} chunks missing ({missing_bytes} bytes)")
    else:
        held = len(prefix) + len(rest)
        problems.append(f"the stream holds {size - missing_bytes} bytes in {held} chunks, "
                        f"the meta says {size} bytes in {chunks}")
        if unplaceable:
            problems.append(f"no gap in the stream sequences could have held the {missing} missing")
        if size > prefix_bytes:
            slots.append((UNPROVEN, size - prefix_bytes))
    unreadable = sum(z for s, z in slots if s == UNPROVEN) + sum(slots[i][1] for i in gone)
    intact = not gone and all(s != UNPROVEN for s, _ in slots)
    return Placement(slots, gone, intact, problems, unreadable, gaps)


async def place_checking_gaps(store: ObjectStore, info: ObjectInfo, prefix: Sequence[tuple[int, int]],
                              index: Sequence[tuple[int, int]], on_scan: Callable[[], None] = lambda: None
                              ) -> Placement:
    """`place_chunks`, narrowed while the first or last gap that could hold a missing chunk turns out to
    be full of other messages, or to have fewer empty sequences than chunks are missing (one
    headers-only scan of the stream per gap checked, each counted by `on_scan`). A single such gap is
    checked too: it is the only place the missing chunks can be, and if it cannot hold them, nothing is
    placed. Reads and `natsfs fsck` place a damaged version the same way."""
    room: dict[tuple[int, int], int] = {}
    while True:
        placed = place_chunks(info.size, info.chunks, info.revision, prefix, index, room)
        if not placed.gaps or len(room) >= GAP_CHECKS:
            return placed
        scanned = False
        for lo, hi in dict.fromkeys((placed.gaps[0], placed.gaps[-1])):
            if (lo, hi) in room or hi - lo - 1 > GAP_SCAN_LIMIT:
                continue
            on_scan()
            room[(lo, hi)] = hi - lo - 1 - len(await store.stored_sequences(info.bucket, lo + 1, hi))
            scanned = True
            if not room[(lo, hi)]:
                break  # place again without it before scanning further
        if not scanned:
            return placed


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
        # Readahead: the largest window granted to one version, how often a version's window collapsed
        # (a read that is not sequential after sequential ones), and the batched requests it sent for
        # versions whose layout was known (a layout walk's requests are `fetch_requests`).
        self.readahead_peak = 0
        self.readahead_collapses = 0
        self.prefetch_requests = 0
        # Reads that waited for chunks already on their way (the layout walk's, or a fetch in flight):
        # readahead was not far enough ahead of them.
        self.waits = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class ChunkCache:
    """Reads of versions' bytes through the chunk cache, with readahead.

    Readahead. A version read sequentially (the caller passes the window it planned, growing while the
    reads stay sequential, 0 on random access) is a stream. All streams share one byte budget, at most
    half the cache so that what is fetched ahead is never evicted before it is read: a read may fetch
    ahead up to its window or the budget divided by the streams read within the last `STREAM_IDLE_S`,
    whichever is smaller. What a stream has read is demoted in the cache (the kernel's page cache
    holds it), so the bytes ahead of every stream stay cached. A version's layout walk fetches ahead as it
    goes; a version whose layout is known has up to `parallelism` batched requests in flight, each up to
    `batch_bytes`."""

    def __init__(self, store: ObjectStore, *, cache_bytes: int, batch_bytes: int = 4 << 20,
                 parallelism: int = 4, readahead_budget: int = 32 << 20, request_timeout: float = 10.0):
        self.store = store
        # A read fails once it has waited this long for the server, whatever it waited for (see `read`).
        self.read_deadline_s = max(request_timeout, FETCH_RETRY_S)
        self.cache_bytes = cache_bytes
        self.batch_bytes = max(batch_bytes, 128 * 1024)
        self.parallelism = max(1, parallelism)
        self.readahead_budget = max(0, min(readahead_budget, cache_bytes // 2))
        self._data = ChunkLRU(cache_bytes)
        self._layouts: cachetools.LRUCache[LayoutKey, Layout] = cachetools.LRUCache(4096)
        self._inflight: dict[ChunkKey, trio.Event] = {}
        self._streams: set[Layout] = set()  # versions read sequentially of late (see `_readahead`)
        self._nursery: trio.Nursery | None = None
        self.stats = CacheStats()
        # Bytes handed to the hashing thread, and hashed by it (each written by one thread only).
        self._hash_submitted = 0
        self._hash_done = 0
        self._hash_last: concurrent.futures.Future[None] | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Background readahead runs in `nursery`; without one, reads still work, just without it."""
        self._nursery = nursery

    @property
    def cached_bytes(self) -> int:
        return self._data.size

    # ------------------------------------------------------------------ reading
    async def read(self, info: ObjectInfo, offset: int, size: int, readahead: int = 0) -> Payload:
        """Bytes [offset, offset+size) of `info`'s version (short at EOF); prefetch `readahead` beyond."""
        end = min(offset + size, info.size)
        if offset >= end:
            return b""
        self.stats.reads += 1
        self.stats.read_bytes += end - offset
        purged = self._layout_of(info).purged
        if purged is not None:
            raise Stale(purged)  # (not served from the cache either: see `_gone`)
        readahead = self._readahead(self._layout_of(info), readahead)
        # One deadline for all this read waits for (a layout walk, fetches, each asked again while the
        # server does not answer), never one window per step.
        deadline = trio.current_time() + self.read_deadline_s
        with trio.move_on_at(deadline) as waited:
            while True:
                layout = await self._layout_covering(info, offset, end, end + readahead, deadline)
                if layout.verdict is False:
                    raise self._refused(info, layout, "digest")
                generation = layout.generation
                first, last = layout.chunk_at(offset), layout.chunk_at(end - 1)
                pieces = await self._pieces(info, layout, first, last)
                if layout.generation == generation:
                    break
                # The slots were rebuilt while this read waited: look again.
        if waited.cancelled_caught:
            raise Unavailable(f"{info.bucket}/{info.name}: no answer from the server within "
                              f"{self.read_deadline_s:g}s")
        if layout.intact and layout.hash_pos <= last:
            self._hash_forward(info, layout, pieces, first)
            if self._hash_submitted - self._hash_done > HASH_BACKLOG and self._hash_last is not None:
                await wait_done(self._hash_last)  # (not cancelled with us: it is part of a digest)
        if readahead > 0 and end < layout.read_end - readahead:
            layout.read_end = 0  # a sequential reader far behind the furthest one: another one, or it started over
        if readahead > 0:
            # A sequential reader is past these chunks (the kernel's page cache holds them now): they are
            # the first to go (see `ChunkLRU`), also when the kernel's requests come a little out of
            # order and this one is behind the furthest (its chunks stayed cached for good before).
            for idx in range(first, last + 1 if layout.ends[last] <= end else last):
                self._data.demote(self._key(info, layout, idx))
            if end >= layout.read_end:
                # (A read a little behind the furthest one, such as the kernel reading a page again that
                # it dropped, changes nothing else: the readahead beyond it is under way already.)
                layout.read_end = end
                self._prefetch(info, layout, last + 1, min(end + readahead, info.size))
        if end == info.size and layout.verdict is None:
            await self._verify(info, layout)
        base = layout.start_of(first)
        joined = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if offset == base and end - base == len(joined):
            return joined  # whole chunks: no copy
        return joined[offset - base : end - base]

    def _readahead(self, layout: Layout, window: int) -> int:
        """How far ahead of this read to fetch: the caller's `window` (0 for random access), within this
        version's share of the readahead budget."""
        if window <= 0:
            if layout.window:
                self.stats.readahead_collapses += 1
                layout.window = 0
            self._streams.discard(layout)
            return 0
        now = trio.current_time()
        layout.last_read = now
        self._streams.add(layout)
        idle = [s for s in self._streams if now - s.last_read > STREAM_IDLE_S]
        self._streams.difference_update(idle)
        granted = min(window, self.readahead_budget // len(self._streams))
        layout.window = granted
        self.stats.readahead_peak = max(self.stats.readahead_peak, granted)
        return granted

    async def _pieces(self, info: ObjectInfo, layout: Layout, first: int, last: int) -> list[Payload]:
        pieces: list[Payload] = []
        fetched: dict[int, Payload] = {}
        generation = layout.generation
        for idx in range(first, last + 1):
            if layout.generation != generation:
                return pieces
            if not layout.readable(idx):
                raise self._unreadable(info, layout, idx)
            data = fetched.get(idx)
            if data is None:
                data = self._data.get(self._key(info, layout, idx))
                if data is None:
                    # Keep what came along for this read even if the cache is too small to hold it.
                    fetched.update(await self._get_missing(info, layout, idx, last + 1))
                    if layout.generation != generation:
                        return pieces
                    data = fetched.get(idx)
                    if data is None:
                        raise self._unreadable(info, layout, idx)
                else:
                    self.stats.hits += 1
            pieces.append(data)
        return pieces

    def _key(self, info: ObjectInfo, layout: Layout, idx: int) -> ChunkKey:
        return (info.bucket, info.nuid, layout.seqs[idx])

    def _layout_of(self, info: ObjectInfo) -> Layout:
        key = layout_key(info)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = Layout()
        return layout

    async def _get_missing(self, info: ObjectInfo, layout: Layout, idx: int, stop: int) -> dict[int, Payload]:
        """Chunk `idx` (and any missing ones after it, up to `stop`), sharing fetches already in flight.
        Empty when the chunk turned out to be gone."""
        for _ in range(3):
            if not layout.readable(idx):
                return {}
            key = self._key(info, layout, idx)
            data = self._data.get(key)
            if data is not None:
                return {idx: data}
            event = self._inflight.get(key)
            if event is not None:
                self.stats.waits += 1
                await event.wait()
                continue
            self.stats.misses += 1
            run = self._claim(info, layout, idx, stop)
            return await self._fetch_claimed(info, layout, *run)
        # Others kept fetching it and it kept being evicted: fetch our own copy.
        run = self._claim(info, layout, idx, idx + 1, force=True)
        return await self._fetch_claimed(info, layout, *run)

    # ------------------------------------------------------------------ what is wrong, said once
    def _report(self, info: ObjectInfo, layout: Layout, cause: str, text: str, level: int = logging.ERROR) -> None:
        """Log `text` about this version once per cause; later reads meet the same cause silently."""
        if cause in layout.reported:
            return
        layout.reported.add(cause)
        log.log(level, "object %s/%s (version %s): %s", info.bucket, info.name, info.nuid, text)

    def _gone(self, info: ObjectInfo, layout: Layout) -> Stale:
        """The server holds no chunk of this version any more: it was replaced or deleted, and purged.
        Every read of it fails from now on, also of the chunks still cached: the kernel, whose request
        across a chunk boundary fails, asks again page by page and hands the program the pages that read
        before the failing one, a short read in the middle of the file that programs take for its end.
        (Pages the kernel already caches it still copies first: see docs/SEMANTICS.md.)"""
        layout.purged = f"{info.bucket}/{info.name}: chunks of version {info.nuid} are gone"
        return Stale(layout.purged)

    def _unreadable(self, info: ObjectInfo, layout: Layout, idx: int) -> Corrupt:
        start, end = layout.start_of(idx), layout.ends[idx]
        return Corrupt(f"{info.bucket}/{info.name}: bytes {start}..{end} of version {info.nuid} cannot be "
                       f"read: its chunks do not match the meta", log_level=logging.DEBUG)

    def _refused(self, info: ObjectInfo, layout: Layout, cause: str) -> Corrupt:
        return Corrupt(f"{info.bucket}/{info.name}: version {info.nuid} failed its {cause} check",
                       log_level=logging.DEBUG)

    # ------------------------------------------------------------------ layout
    async def _layout_covering(self, info: ObjectInfo, offset: int, end: int, want_end: int,
                               deadline: float) -> Layout:
        """The object's layout, known at least up to `end` (walking forward up to `want_end` if it must);
        a walk the server did not answer is tried again until the read's `deadline`."""
        layout = self._layout_of(info)
        waited = 0
        began = trio.current_time()
        while layout.known_bytes < end and not layout.complete:
            if layout.error is not None:
                error, layout.error = layout.error, None
                # A walk that began before this read (its readers' deadline may have passed first) says
                # nothing final about this read's own attempt: it walks again.
                again = layout.retry_error or layout.error_began < began
                if not again or trio.current_time() >= deadline:
                    raise error
                log.debug("%s/%s: fetching the layout again after: %s", info.bucket, info.name, error)
                await trio.sleep(_FETCH_PAUSE_S)
                continue
            if layout.busy:
                waited += 1
                self.stats.waits += waited == 1
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
        if layout.known_bytes < end:  # (place_chunks always covers the size: a broken invariant)
            raise Corrupt(f"{info.bucket}/{info.name}: layout of version {info.nuid} ends at "
                          f"{layout.known_bytes}, the meta says {info.size}")
        return layout

    def _chunk_guess(self, info: ObjectInfo) -> int:
        if info.chunks:
            return max(1, -(-info.size // info.chunks))
        return self.store.chunk_size

    def _start_extend(self, info: ObjectInfo, layout: Layout, want_end: int) -> None:
        assert self._nursery is not None
        layout.walk_to = max(layout.walk_to, want_end)
        layout.busy = True
        self._nursery.start_soon(self._extend, info, layout, want_end)

    def _stray(self, info: ObjectInfo, layout: Layout, m: StoredMsg, why: str) -> Unavailable:
        """A reply that is not the one asked for (another subject, an earlier sequence): a transport fault,
        not damage to the version. Nothing of it is used."""
        text = f"a direct get reply ({m.subject} seq {m.seq}) is not {why}; discarded"
        self._report(info, layout, "stray", text, logging.WARNING)
        return Unavailable(f"{info.bucket}/{info.name}: {text}", log_level=logging.DEBUG)

    async def _extend(self, info: ObjectInfo, layout: Layout, want_end: int) -> None:
        """Walk forward from the last known chunk with batched direct gets whose chunks are taken (into
        the layout and the cache) as they arrive, so readers never wait for the whole batch; while
        readers' readahead asks for more than a batch brought (`Layout.walk_to`), the next one is sent at
        once rather than at the next read.

        A reply is taken only if it is the next chunk of this version beyond doubt: its subject is this
        nuid's chunk subject, its sequence follows the last known chunk's, the number of chunk messages
        it proves to exist (those before it, it, and the server's count of those after it) is the
        meta's chunk count, its bytes fit in the meta's size (the last chunk ending exactly there) and
        it was stored before the meta. Anything else is settled by a full scan (`_map_all`)."""
        began = trio.current_time()
        try:
            subject = _own_chunk_subject(info)
            while True:
                remaining = info.chunks - len(layout.seqs)
                if remaining <= 0:
                    await self._map_all(info, layout)
                    return
                want = max(self.batch_bytes, want_end - layout.known_bytes)
                count = min(remaining, -(-want // self._chunk_guess(info)))
                start_seq = layout.seqs[-1] + 1 if layout.seqs else 1
                self.stats.fetch_requests += 1
                batches = await self.store.stream_chunks(info.bucket, info.nuid, start_seq, count, want)
                got = 0
                settle = False
                try:
                    while not settle and (msgs := await batches.next()) is not None:
                        taken = 0
                        for i, m in enumerate(msgs):
                            if m.subject != subject:
                                raise self._stray(info, layout, m, f"a chunk of {subject}")
                            if m.seq < start_seq or (layout.seqs and m.seq <= layout.seqs[-1]):
                                raise self._stray(info, layout, m, f"the chunk after seq {start_seq - 1}")
                            idx = len(layout.seqs)
                            end = layout.known_bytes + len(m.data)
                            if m.pending < 0:
                                # No count of the chunks after it (a stream without direct gets): the
                                # scan proves the layout. The bytes of this nuid's messages are those of
                                # their sequences whatever the layout, so the scan's slots take them.
                                for kept in msgs[i:]:
                                    if kept.subject == subject and not (info.revision and kept.seq > info.revision):
                                        self._data.put((info.bucket, info.nuid, kept.seq), kept.data)
                                settle = True
                                break
                            if (idx + 1 + m.pending != info.chunks or end > info.size
                                    or (idx == info.chunks - 1 and end != info.size)
                                    or (info.revision and m.seq > info.revision)):
                                settle = True
                                break
                            layout.append(m.seq, len(m.data))
                            self._store(info, layout, idx, m.data)
                            self.stats.chunks_fetched += 1
                            self.stats.bytes_fetched += len(m.data)
                            taken += 1
                        got += len(msgs)
                        if taken:
                            layout.wake()
                finally:
                    await batches.close()
                if settle:
                    await self._map_all(info, layout)
                    return
                if not got:
                    raise self._gone(info, layout)
                if len(layout.seqs) >= info.chunks:
                    layout.complete = True
                    return
                want_end = max(want_end, layout.walk_to)
                if want_end <= layout.known_bytes:
                    return
        except NatsFSError as e:
            layout.error, layout.retry_error, layout.error_began = e, _unanswered(e), began
        except Exception as e:
            log.exception("fetching %s/%s failed unexpectedly", info.bucket, info.name)
            layout.error, layout.retry_error = Unavailable(f"{info.bucket}/{info.name}: fetch failed: {e!r}"), False
            layout.error_began = began
        finally:
            layout.busy = False
            layout.wake()

    async def _map_all(self, info: ObjectInfo, layout: Layout) -> None:
        """Learn every chunk's sequence and size with one headers-only scan, and place them
        (`place_chunks`) after the chunks already proven by a walk."""
        self.stats.index_scans += 1
        _own_chunk_subject(info)
        index = await self.store.chunk_index(info.bucket, info.nuid)
        if not index and info.chunks:
            raise self._gone(info, layout)
        prefix = list(zip(layout.seqs, (layout.size_of(i) for i in range(len(layout.seqs))), strict=True))
        placed = await self._place(info, prefix, index)
        layout.replace(placed.slots, placed.gone, placed.intact)
        if placed.problems:
            text = "; ".join(placed.problems)
            if placed.unreadable:
                text += f"; {placed.unreadable} of {info.size} bytes cannot be read (EIO)"
            self._report(info, layout, "layout", text, logging.ERROR if placed.unreadable else logging.WARNING)

    async def _place(self, info: ObjectInfo, prefix: list[tuple[int, int]],
                     index: list[tuple[int, int]]) -> Placement:
        def scanned() -> None:
            self.stats.index_scans += 1

        return await place_checking_gaps(self.store, info, prefix, index, scanned)

    # ------------------------------------------------------------------ fetching
    async def _fetch(self, info: ObjectInfo, start_seq: int, count: int, max_bytes: int) -> list[StoredMsg]:
        deadline = trio.current_time() + FETCH_RETRY_S
        while True:
            self.stats.fetch_requests += 1
            try:
                msgs = await self.store.fetch_chunks(info.bucket, info.nuid, start_seq, count, max_bytes)
                break
            except Unavailable as e:
                if not _unanswered(e) or trio.current_time() >= deadline:
                    raise
                log.debug("%s/%s: fetching chunks again after: %s", info.bucket, info.name, e)
                await trio.sleep(_FETCH_PAUSE_S)
        self.stats.chunks_fetched += len(msgs)
        self.stats.bytes_fetched += sum(len(m.data) for m in msgs)
        return msgs

    def _store(self, info: ObjectInfo, layout: Layout, idx: int, data: Payload) -> None:
        # A chunk larger than the whole cache is not kept: the read that fetched it serves it.
        self._data.put(self._key(info, layout, idx), data)

    def _hash_forward(self, info: ObjectInfo, layout: Layout, pieces: Sequence[Payload] = (), first: int = 0) -> None:
        """Hash chunk `hash_pos` and those after it that are at hand (in `pieces`, the chunks from index
        `first` on, or cached), in order, in one task of the hashing thread (a read hashes what it serves,
        and whatever its readahead brought in already)."""
        batch: list[Payload] = []
        while layout.hash_pos < len(layout.seqs):
            k = layout.hash_pos - first
            data = pieces[k] if 0 <= k < len(pieces) else self._data.peek(self._key(info, layout, layout.hash_pos))
            if data is None:
                break
            batch.append(data)
            layout.hash_pos += 1
        if batch:
            self._hash_submitted += sum(len(data) for data in batch)
            self._hash_last = _HASHER.submit(self._update_all, layout.hasher, batch)

    def _update_all(self, hasher: hashlib._Hash, chunks: list[Payload]) -> None:
        """(hashing thread)"""
        for data in chunks:
            hasher.update(data)
            self._hash_done += len(data)

    async def _verify(self, info: ObjectInfo, layout: Layout) -> None:
        """Finish the digest check of a version whose last byte is being served, when every chunk
        has passed (or can still pass) through in order; a read pattern that never had some chunk
        in hand (random access with eviction) is left unverified rather than refetched. A damaged
        version (not `intact`) has no verdict: its damage is reported on its own."""
        expected = parse_digest(info.digest)
        if expected is None:
            return
        while layout.hash_pos < info.chunks and layout.complete and layout.intact:
            before = layout.hash_pos
            self._hash_forward(info, layout)
            if layout.hash_pos == before:
                event = self._inflight.get(self._key(info, layout, layout.hash_pos))
                if event is None:
                    return
                await event.wait()
        if layout.hash_pos < info.chunks or layout.verdict is not None or not layout.intact:
            return
        raw = await wait_future(_HASHER.submit(layout.hasher.digest))
        if layout.verdict is not None:
            return
        layout.verdict = raw == expected
        if not layout.verdict:
            self._report(info, layout, "digest", f"digest mismatch: meta says {info.digest}, data hashes "
                         f"to {format_digest(raw)}; every read of it fails (EIO)")
            raise Corrupt(f"digest mismatch for {info.bucket}/{info.name}: meta says {info.digest}, "
                          f"data hashes to {format_digest(raw)}", log_level=logging.DEBUG)

    def _claim(self, info: ObjectInfo, layout: Layout, start: int, stop: int,
               force: bool = False) -> tuple[int, int, list[trio.Event]]:
        """Mark a run of missing chunks [start, end) as in flight; stops at one cached, claimed or
        unreadable."""
        events: list[trio.Event] = []
        end = start
        budget = self.batch_bytes
        while end < stop and end < len(layout.seqs) and layout.readable(end):
            key = self._key(info, layout, end)
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
                             events: list[trio.Event]) -> dict[int, Payload]:
        """Fetch the chunks of slots [start, end). Each reply fills only the slot of its own sequence:
        a chunk that does not come back is gone (reported once, EIO for the reads that need it)."""
        out: dict[int, Payload] = {}
        keys = [self._key(info, layout, k) for k in range(start, end)]
        try:
            if start >= end:
                return out
            subject = chunk_subject(info.bucket, info.nuid)
            generation = layout.generation
            slot_of = {layout.seqs[k]: k for k in range(start, end)}
            last_seq = layout.seqs[end - 1]
            wanted = layout.ends[end - 1] - layout.start_of(start)
            msgs = await self._fetch(info, layout.seqs[start], end - start, max(wanted, self.batch_bytes))
            if layout.generation != generation:
                return out  # slots were rebuilt meanwhile; the reader looks again
            if not msgs and not await self._fetch(info, 1, 1, 1):
                # Not one chunk of the version is left: it was replaced and purged.
                raise self._gone(info, layout)
            previous = 0
            for m in msgs:
                if m.subject != subject:
                    raise self._stray(info, layout, m, f"a chunk of {subject}")
                if m.seq <= previous:
                    raise self._stray(info, layout, m, f"after seq {previous}")
                previous = m.seq
                if m.seq > last_seq:
                    break  # beyond the run (chunks in it are gone)
                idx = slot_of.get(m.seq)
                if idx is None or len(m.data) != layout.size_of(idx):
                    raise self._stray(info, layout, m, "a chunk of this version's layout")
                out[idx] = m.data
                self._store(info, layout, idx, m.data)
            missing = []
            for k in range(start, end):
                if k not in out and not await self._fetch_one(info, layout, k, subject, out):
                    missing.append(k)
            if layout.generation != generation:
                return out
            if missing:
                layout.gone.update(missing)
                layout.intact = False
                self._report(info, layout, f"gone {missing[0]}",
                             "chunk " + ", ".join(f"{k} (seq {layout.seqs[k]}, bytes {layout.start_of(k)}.."
                                                  f"{layout.ends[k]})" for k in missing)
                             + " gone from the stream; reads of those bytes fail (EIO)")
        finally:
            for key in keys:
                ev = self._inflight.get(key)
                if ev is not None and ev in events:
                    del self._inflight[key]
                    ev.set()
        return out

    async def _fetch_one(self, info: ObjectInfo, layout: Layout, idx: int, subject: str,
                         out: dict[int, Payload]) -> bool:
        """Ask for slot `idx`'s chunk alone (it did not come with its run): False if it is gone."""
        seq = layout.seqs[idx]
        msgs = await self._fetch(info, seq, 1, 1)
        if not msgs or msgs[0].seq > seq:
            return False
        m = msgs[0]
        if m.subject != subject or m.seq != seq or len(m.data) != layout.size_of(idx):
            raise self._stray(info, layout, m, f"chunk {idx} (seq {seq})")
        out[idx] = m.data
        self._store(info, layout, idx, m.data)
        return True

    # ------------------------------------------------------------------ readahead
    def _prefetch(self, info: ObjectInfo, layout: Layout, from_idx: int, to_offset: int) -> None:
        """Fetch what is missing of the chunks from `from_idx` to `to_offset` in the background: by the
        layout walk while the layout is not known that far, else in batched requests, up to
        `parallelism` of them in flight for this version (the budget bounds their bytes: see
        `_readahead`)."""
        if self._nursery is None or to_offset <= layout.start_of(min(from_idx, len(layout.seqs))):
            return
        if layout.known_bytes < to_offset and not layout.complete:
            if layout.busy:
                layout.walk_to = max(layout.walk_to, to_offset)  # the walk under way goes on that far
            else:
                self._start_extend(info, layout, to_offset)
            return
        stop = layout.chunk_at(to_offset - 1) + 1
        # As reads move on, the window's end moves a read at a time: wait until a batch (or half the
        # window) is missing before asking, so that requests stay batches.
        worth = min(self.batch_bytes, (to_offset - layout.start_of(min(from_idx, stop))) // 2)
        idx = from_idx
        while idx < stop and layout.runs < self.parallelism:
            if not layout.readable(idx):
                return
            key = self._key(info, layout, idx)
            if key in self._data or key in self._inflight:
                idx += 1
                continue
            if layout.ends[stop - 1] - layout.start_of(idx) < worth and stop < len(layout.seqs):
                return
            run = self._claim(info, layout, idx, stop)
            layout.runs += 1
            self.stats.prefetch_requests += 1
            self._nursery.start_soon(self._prefetch_run, info, layout, run)
            idx = run[1]

    async def _prefetch_run(self, info: ObjectInfo, layout: Layout, run: tuple[int, int, list[trio.Event]]) -> None:
        try:
            await self._fetch_claimed(info, layout, *run)
        except NatsFSError as e:
            log.debug("readahead of %s/%s stopped: %s", info.bucket, info.name, e)
        except Exception:
            log.exception("readahead of %s/%s failed unexpectedly", info.bucket, info.name)
        finally:
            layout.runs -= 1


def layout_key(info: ObjectInfo) -> LayoutKey:
    """The claims of `info`'s meta that a layout and a digest verdict are proven for. (Not the meta's
    revision: a rename or chmod rewrites the meta with the same claims, and must not cost a new walk and
    digest check. A copy with the same claims as the original claims the same bytes, which the shared
    layout and verdict prove.)"""
    return (info.bucket, info.nuid, info.size, info.chunks, info.digest)


def _unanswered(error: NatsFSError) -> bool:
    """The server did not answer (worth asking again), as opposed to answering with something wrong:
    replies that are not the chunk asked for are `Unavailable` too, but logged at DEBUG (`_stray`).
    `NoConnection` is not worth it either: that attempt already waited the request timeout for a
    connection, and the read fails then (see `FETCH_RETRY_S`)."""
    return (isinstance(error, Unavailable) and not isinstance(error, NoConnection)
            and error.log_level != logging.DEBUG)
