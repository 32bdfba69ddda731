"""Inode numbers for paths, kernel lookup counts and `forget`.

An inode stands for a mount-relative path (a tuple of names). Numbers are handed out on first
lookup and never reused during a mount, so a stale number can never alias a different file. An entry
is dropped when the kernel has forgotten every lookup of it. Renames move a path (and everything
below it) to a new path while keeping the inode numbers.
"""

from __future__ import annotations

import logging

import pyfuse3

from .errors import Stale

log = logging.getLogger(__name__)

Path = tuple[str, ...]
ROOT_INODE = int(pyfuse3.ROOT_INODE)
# First segment of the path an inode is kept under once its name went away (no lookup can reach it).
DETACHED = "\x00detached"


class InodeTable:
    def __init__(self) -> None:
        self._ino_of: dict[Path, int] = {(): ROOT_INODE}
        self._path_of: dict[int, Path] = {ROOT_INODE: ()}
        self._lookups: dict[int, int] = {}
        self._next = ROOT_INODE + 1
        # The nuid whose bytes the kernel may hold in its page cache for an inode.
        self.cached_version: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._path_of)

    def ino_for(self, path: Path) -> int:
        ino = self._ino_of.get(path)
        if ino is None:
            ino = self._next
            self._next += 1
            self._ino_of[path] = ino
            self._path_of[ino] = path
        return ino

    def known(self, path: Path) -> int | None:
        return self._ino_of.get(path)

    def path_of(self, ino: int) -> Path:
        path = self._path_of.get(ino)
        if path is None:
            raise Stale(f"inode {ino} is not known (forgotten)")
        return path

    def lookup(self, path: Path) -> int:
        """A lookup the kernel will later `forget`: the inode, with its count raised by one."""
        ino = self.ino_for(path)
        self._lookups[ino] = self._lookups.get(ino, 0) + 1
        return ino

    def forget(self, ino: int, nlookup: int) -> None:
        count = self._lookups.get(ino, 0) - nlookup
        if count > 0:
            self._lookups[ino] = count
            return
        self._lookups.pop(ino, None)
        if ino == ROOT_INODE:
            return
        path = self._path_of.pop(ino, None)
        if path is not None and self._ino_of.get(path) == ino:
            del self._ino_of[path]
        self.cached_version.pop(ino, None)

    def lookup_count(self, ino: int) -> int:
        return self._lookups.get(ino, 0)

    def move(self, old: Path, new: Path) -> None:
        """`old` and everything under it now live at `new`; an inode already at `new` is detached."""
        displaced = [p for p in self._ino_of if p[: len(new)] == new]
        for p in displaced:
            ino = self._ino_of.pop(p)
            # Kept in _path_of under a path nobody can look up, until the kernel forgets it.
            self._path_of[ino] = (DETACHED, str(ino))
        moving = [p for p in self._ino_of if p[: len(old)] == old]
        for p in moving:
            ino = self._ino_of.pop(p)
            np = new + p[len(old):]
            self._ino_of[np] = ino
            self._path_of[ino] = np

    def is_detached(self, ino: int) -> bool:
        path = self._path_of.get(ino)
        return path is not None and path[:1] == (DETACHED,)

    def detach(self, path: Path) -> int | None:
        """The object at `path` is gone: its inode (if any) no longer maps a path."""
        ino = self._ino_of.pop(path, None)
        if ino is not None:
            self._path_of[ino] = (DETACHED, str(ino))
            self.cached_version.pop(ino, None)
        return ino
