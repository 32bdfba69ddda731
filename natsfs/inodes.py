"""Inode numbers for paths, kernel lookup counts and `forget`.

An inode stands for a mount-relative path (a tuple of names). Numbers are handed out on first
lookup and never reused for another path during a mount, so a stale number can never alias a file
elsewhere. An entry is dropped when the kernel has forgotten every lookup of it; the same path looked
up again gets its old number back (a bounded memory of forgotten paths), so st_ino stays stable while
the kernel evicts and reloads an inode, as on a local disk (tar compares a placeholder's st_ino before
it replaces it with a symlink). A name that was deleted gets a new number when it is created again.
Renames move a path (and everything below it) to a new path while keeping the inode numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NewType

from .errors import Stale

log = logging.getLogger(__name__)

Path = tuple[str, ...]
# An inode number as the kernel knows it (never reused during a mount).
InodeNo = NewType("InodeNo", int)
ROOT_INODE = InodeNo(1)  # FUSE_ROOT_ID
RETIRED_MAX = 16_384  # forgotten paths whose numbers are kept for the next lookup
# First segment of the path an inode is kept under once its name went away (no lookup can reach it).
DETACHED = "\x00detached"


class InodeTable:
    def __init__(self) -> None:
        self._ino_of: dict[Path, InodeNo] = {(): ROOT_INODE}
        self._path_of: dict[InodeNo, Path] = {ROOT_INODE: ()}
        self._lookups: dict[InodeNo, int] = {}
        self._next = ROOT_INODE + 1
        self._retired: dict[Path, InodeNo] = {}  # forgotten, not deleted: the path's number if it comes back
        # Detached inodes: the path each had when its name went away (until the kernel forgets it).
        self._detached_from: dict[InodeNo, Path] = {}
        # An inode whose file still waits for its write-back upload keeps its number and path when the
        # kernel forgets it: the staged file is found by that number, and the next lookup gets it again.
        self.pinned: Callable[[InodeNo], bool] = lambda ino: False

    def __len__(self) -> int:
        return len(self._path_of)

    def __contains__(self, ino: InodeNo) -> bool:
        return ino in self._path_of

    def ino_for(self, path: Path) -> InodeNo:
        ino = self._ino_of.get(path)
        if ino is None:
            ino = self._retired.pop(path, None)
            if ino is None or ino in self._path_of:
                ino = InodeNo(self._next)
                self._next += 1
            self._ino_of[path] = ino
            self._path_of[ino] = path
        return ino

    def known(self, path: Path) -> InodeNo | None:
        return self._ino_of.get(path)

    def path_of(self, ino: InodeNo) -> Path:
        path = self._path_of.get(ino)
        if path is None:
            raise Stale(f"inode {ino} is not known (forgotten)")
        return path

    def lookup(self, path: Path) -> InodeNo:
        """A lookup the kernel will later `forget`: the inode, with its count raised by one."""
        ino = self.ino_for(path)
        self._lookups[ino] = self._lookups.get(ino, 0) + 1
        return ino

    def forget(self, ino: InodeNo, nlookup: int) -> bool:
        """Drop `nlookup` lookups; True when the inode itself is gone (the kernel forgot every one)."""
        count = self._lookups.get(ino, 0) - nlookup
        if count > 0:
            self._lookups[ino] = count
            return False
        self._lookups.pop(ino, None)
        if ino == ROOT_INODE or self.pinned(ino):
            return False
        path = self._path_of.pop(ino, None)
        self._detached_from.pop(ino, None)
        if path is not None and self._ino_of.get(path) == ino:
            del self._ino_of[path]
            if len(self._retired) >= RETIRED_MAX:
                del self._retired[next(iter(self._retired))]
            self._retired[path] = ino
        return True

    def under(self, path: Path) -> list[InodeNo]:
        """The inodes of `path` and of every path below it (detached ones excepted)."""
        return [ino for p, ino in self._ino_of.items() if p[: len(path)] == path]

    def lookup_count(self, ino: InodeNo) -> int:
        return self._lookups.get(ino, 0)

    def move(self, old: Path, new: Path) -> None:
        """`old` and everything under it now live at `new`; an inode already at `new` is detached."""
        self._forget_retired(old)
        self._forget_retired(new)
        displaced = [p for p in self._ino_of if p[: len(new)] == new]
        for p in displaced:
            ino = self._ino_of.pop(p)
            # Kept in _path_of under a path nobody can look up, until the kernel forgets it.
            self._path_of[ino] = (DETACHED, str(ino))
            self._detached_from[ino] = p
        moving = [p for p in self._ino_of if p[: len(old)] == old]
        for p in moving:
            ino = self._ino_of.pop(p)
            np = new + p[len(old):]
            self._ino_of[np] = ino
            self._path_of[ino] = np

    def _forget_retired(self, prefix: Path) -> None:
        """Names at or under `prefix` changed: their old numbers are not theirs any more."""
        for p in [p for p in self._retired if p[: len(prefix)] == prefix]:
            del self._retired[p]

    def is_detached(self, ino: InodeNo) -> bool:
        path = self._path_of.get(ino)
        return path is not None and path[:1] == (DETACHED,)

    def detach(self, path: Path) -> InodeNo | None:
        """The object at `path` is gone: its inode (if any) no longer maps a path."""
        self._retired.pop(path, None)
        ino = self._ino_of.pop(path, None)
        if ino is not None:
            self._path_of[ino] = (DETACHED, str(ino))
            self._detached_from[ino] = path
        return ino

    def detached_from(self, ino: InodeNo) -> Path | None:
        """The path a detached inode had when its name went away (None: not detached, or forgotten)."""
        return self._detached_from.get(ino)
