"""Open file and directory handles: which version a reader holds, how it reads, what it has verified.

A `ReadHandle` pins the `ObjectInfo` (nuid, size, digest) the file had at open, so a reader keeps
reading the version it opened even when the bucket moves on. Its `Verifier` hashes the bytes of a
start-to-end read on a worker thread and checks the SHA-256 digest when the last byte is served.
A `DirHandle` is a snapshot of a directory listing taken at `opendir`, so that entries added or
removed during a `readdir` cycle never make others be skipped or repeated.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from .adr20 import ObjectInfo, format_digest, parse_digest
from .errors import Corrupt

log = logging.getLogger(__name__)

# One worker keeps each verifier's updates in order and hashes off the trio thread (hashlib drops
# the GIL for large buffers, so it overlaps with serving FUSE requests).
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="natsfs-sha256")
# Out-of-order pieces a verifier will hold while waiting for the one it needs next.
_MAX_PARKED = 64


async def _await_future(fut: concurrent.futures.Future) -> object:
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def wake(_: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    fut.add_done_callback(wake)
    await done.wait()
    return fut.result()


class Verifier:
    """Checks the digest of an object read from its first byte to its last."""

    def __init__(self, info: ObjectInfo):
        self.info = info
        self.expected = parse_digest(info.digest)
        self.pos = 0
        self.active = self.expected is not None and info.size > 0
        self._hash = hashlib.sha256()
        self._parked: dict[int, bytes] = {}

    async def feed(self, offset: int, data: bytes) -> None:
        """Account for `data` served at `offset`; raises `Corrupt` when the finished digest differs."""
        if not self.active or not data:
            return
        if offset != self.pos:
            if offset > self.pos and len(self._parked) < _MAX_PARKED:
                self._parked[offset] = data
            elif offset > self.pos:
                self.active = False  # too far out of order: not a start-to-end read
            return
        self._take(data)
        while self.pos in self._parked:
            self._take(self._parked.pop(self.pos))
        if self.pos >= self.info.size:
            self.active = False
            raw = await _await_future(_HASHER.submit(self._hash.digest))
            if raw != self.expected:
                got = format_digest(raw)  # type: ignore[arg-type]
                raise Corrupt(f"digest mismatch for {self.info.bucket}/{self.info.name}: "
                              f"meta says {self.info.digest}, data hashes to {got}")

    def _take(self, data: bytes) -> None:
        _HASHER.submit(self._hash.update, data)
        self.pos += len(data)


@dataclass
class ReadHandle:
    ino: int
    info: ObjectInfo
    verifier: Verifier
    next_offset: int = 0
    readahead: int = 0

    def plan_readahead(self, offset: int, size: int, minimum: int, maximum: int) -> int:
        """Readahead grows while reads are sequential and collapses on a seek."""
        if offset == self.next_offset:
            self.readahead = minimum if self.readahead == 0 else min(maximum, self.readahead * 2)
        elif offset > self.next_offset + size * 8 or offset < self.next_offset - size * 8:
            self.readahead = 0
        self.next_offset = offset + size
        return self.readahead


@dataclass
class DirHandle:
    ino: int
    path: tuple[str, ...]
    # (name, mount path, namespace node) of every entry, as listed at opendir
    entries: list[tuple[str, tuple[str, ...], Any]] = field(default_factory=list)


class HandleTable:
    def __init__(self) -> None:
        self._handles: dict[int, ReadHandle | DirHandle] = {}
        self._next = 1

    def add(self, handle: ReadHandle | DirHandle) -> int:
        fh = self._next
        self._next += 1
        self._handles[fh] = handle
        return fh

    def get(self, fh: int) -> ReadHandle | DirHandle | None:
        return self._handles.get(fh)

    def pop(self, fh: int) -> ReadHandle | DirHandle | None:
        return self._handles.pop(fh, None)

    def __len__(self) -> int:
        return len(self._handles)
