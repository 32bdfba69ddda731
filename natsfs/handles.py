"""Open file and directory handles: which version a reader holds, how it reads, what it has verified.

A `FileHandle` (an open file: it reads, and writes when opened for writing) pins the `ObjectInfo`
(nuid, size, digest) the file had at open, so a reader keeps reading the version it opened even when
the bucket moves on, and tracks sequential access for readahead. (Digests are checked per version by
the chunk cache, not per handle.)
A `DirHandle` is a snapshot of a directory listing taken at `opendir` (and again at a rewind: a readdir
from offset 0 after the first), so that entries added or removed during a `readdir` cycle never make
others be skipped or repeated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NewType

from .adr20 import ObjectInfo
from .inodes import InodeNo

# A handle number as the kernel knows it (`fh`).
HandleNo = NewType("HandleNo", int)

log = logging.getLogger(__name__)


@dataclass
class FileHandle:
    ino: InodeNo
    info: ObjectInfo
    writable: bool = False
    opener: int | None = None  # the thread group that opened it for writing, if known (openers.py)
    opener_located: bool = False  # its descriptor looked for at the first write (`Openers.located`)
    # Who opened it for writing when not root (a `core.filesystem.Caller`): its first write clears the
    # file's setuid/setgid bits, as a write without CAP_FSETID does on a local disk (a write request
    # does not name its caller).
    unprivileged_writer: Any = None
    next_offset: int = 0
    readahead: int = 0

    def plan_readahead(self, offset: int, size: int, minimum: int, maximum: int) -> int:
        """Readahead grows (doubling) while reads are sequential and collapses on a seek.

        A read near where the reader is, within its readahead window or eight of its own size, neither
        grows nor collapses it: the kernel's readahead sends requests a little out of order, and reads
        single pages again, far behind, when it dropped them before the reader got to them (page cache
        reclaim). Such a read behind does not move the reader back either."""
        near = max(self.readahead, size * 8)
        if offset == self.next_offset:
            self.readahead = minimum if self.readahead == 0 else min(maximum, self.readahead * 2)
        elif offset > self.next_offset + near or offset < self.next_offset - near:
            self.readahead = 0
        elif offset < self.next_offset:
            return self.readahead
        self.next_offset = offset + size
        return self.readahead


@dataclass
class DirHandle:
    ino: InodeNo
    path: tuple[str, ...]
    # (name, mount path, namespace node) of every entry, as listed at opendir
    entries: list[tuple[str, tuple[str, ...], Any]] = field(default_factory=list)
    listed: bool = False  # a readdir was answered: one from offset 0 again (rewinddir) lists afresh


class HandleTable:
    def __init__(self) -> None:
        self._handles: dict[HandleNo, FileHandle | DirHandle] = {}
        self._next = 1

    def add(self, handle: FileHandle | DirHandle) -> HandleNo:
        fh = HandleNo(self._next)
        self._next += 1
        self._handles[fh] = handle
        return fh

    def get(self, fh: HandleNo) -> FileHandle | DirHandle | None:
        return self._handles.get(fh)

    def pop(self, fh: HandleNo) -> FileHandle | DirHandle | None:
        return self._handles.pop(fh, None)

    def __len__(self) -> int:
        return len(self._handles)

    def values(self) -> list[FileHandle | DirHandle]:
        return list(self._handles.values())
