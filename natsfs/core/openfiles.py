"""The open-file table: one record per inode for everything this mount knows about it being open.

Design note. The filesystem decides several things per inode from facts that used to live in six
separate dicts, sets and a single-slot flag: how many handles are open and how many may write (a
reader's close must not store a writer's bytes; `truncate` with no writer stores at once), whether the
inode was deleted or replaced here while open (its writes then go nowhere and the chunks of the version
its readers hold are purged at its last close, not before), whether an upload of this mount's own is
being applied to it (then a change reported by the watch is ours: the kernel's page cache already holds
those bytes, only its attributes move), and which version's bytes the kernel may hold in its page cache
(`keep_cache` at the next open).

All of that is one `OpenFile` record here. Every fact is per inode, so two concurrent flushes of
different files each mark their own record: nothing can overwrite another file's flag. Own uploads are
counted, not flagged, so even two overlapping flushes of the same file leave it marked until both end.

A record lives while it says anything (open handles, an own upload, an unlinked state, a cached
version); `forget` of the inode (or its detachment from its path) drops the cached version, and an empty
record is removed. Paths this mount is changing itself (its own rename or unlink) are per path, not
per inode, and kept alongside (`changing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..inodes import InodeNo, Path


@dataclass
class OpenFile:
    """What this mount knows about one inode being open (see the module's design note)."""

    ino: InodeNo
    opens: int = 0  # open file handles
    writers: int = 0  # open handles that may write
    # Deleted or replaced by this mount while open: writes go nowhere, no name links to it any more.
    unlinked: bool = False
    # (bucket, nuid) of the version its handles still read, purged at the last close.
    purge_later: tuple[str, str] | None = None
    own_uploads: int = 0  # uploads of this mount's own being applied right now
    cached_version: str | None = None  # the nuid whose bytes the kernel may hold in its page cache
    # (nuid, handle) of the last open answered without `keep_cache`: the kernel drops the inode's pages
    # while it completes that open, after our answer, so the pages are that version's only once a read
    # through that handle shows the open completed (`read_through`); until then no open keeps them.
    dropping: tuple[str, int] | None = None
    purged: str | None = None  # the version its handles read was found purged (`purged_seen`)
    # A flush did not store because it was not the opener's last close (see openers.py): the last
    # release stores.
    store_deferred: bool = False
    # Deleted or replaced while open: the meta document its descriptors show (their xattr changes go
    # here, never stored), made at the first xattr request through one of them; it ends at the last close.
    own_meta_doc: dict[str, Any] | None = None

    @property
    def idle(self) -> bool:
        return (not self.opens and not self.own_uploads and not self.unlinked and self.purge_later is None
                and self.cached_version is None and self.dropping is None)


class OpenFileTable:
    def __init__(self) -> None:
        self._files: dict[InodeNo, OpenFile] = {}
        self._own_paths: list[Path] = []

    def __len__(self) -> int:
        return len(self._files)

    def get(self, ino: InodeNo) -> OpenFile | None:
        return self._files.get(ino)

    def _record(self, ino: InodeNo) -> OpenFile:
        rec = self._files.get(ino)
        if rec is None:
            rec = self._files[ino] = OpenFile(ino)
        return rec

    def _drop_if_idle(self, rec: OpenFile) -> None:
        if rec.idle and self._files.get(rec.ino) is rec:
            del self._files[rec.ino]

    # ------------------------------------------------------------------ handles
    def opened(self, ino: InodeNo, *, writing: bool) -> OpenFile:
        rec = self._record(ino)
        rec.opens += 1
        if writing:
            rec.writers += 1
        return rec

    def released(self, ino: InodeNo, *, writing: bool) -> OpenFile | None:
        """One handle closed. Returns the record as it was when this was the last handle (its
        unlinked state and purge-later version then end), else None."""
        rec = self._files.get(ino)
        if rec is None:
            return None
        if writing:
            rec.writers = max(0, rec.writers - 1)
        rec.opens = max(0, rec.opens - 1)
        if rec.opens:
            return None
        last = OpenFile(ino, unlinked=rec.unlinked, purge_later=rec.purge_later, store_deferred=rec.store_deferred)
        rec.unlinked, rec.purge_later, rec.store_deferred, rec.own_meta_doc = False, None, False, None
        rec.dropping = None  # (no handle left to show its open's drop done)
        self._drop_if_idle(rec)
        return last

    def defer_store(self, ino: InodeNo, deferred: bool) -> None:
        rec = self._files.get(ino)
        if rec is not None:
            rec.store_deferred = deferred

    def is_open(self, ino: InodeNo | None) -> bool:
        rec = self._files.get(ino) if ino is not None else None
        return rec is not None and rec.opens > 0

    def has_writers(self, ino: InodeNo) -> bool:
        rec = self._files.get(ino)
        return rec is not None and rec.writers > 0

    # ------------------------------------------------------------------ unlinked while open
    def unlinked_while_open(self, ino: InodeNo, purge_later: tuple[str, str] | None) -> None:
        """Deleted or replaced here while open: writes go nowhere; `purge_later` at the last close."""
        rec = self._record(ino)
        rec.unlinked = True
        if purge_later is not None:
            rec.purge_later = purge_later

    def unheld(self, ino: InodeNo) -> OpenFile | None:
        """Nothing is about to open `ino` any more (a kernel retry's hold ended): if no handle has it open,
        its unlinked state and purge-later version end now. Returns the record as it was then."""
        rec = self._files.get(ino)
        if rec is None or rec.opens:
            return None
        left = OpenFile(ino, unlinked=rec.unlinked, purge_later=rec.purge_later)
        rec.unlinked, rec.purge_later = False, None
        self._drop_if_idle(rec)
        return left

    def is_unlinked(self, ino: InodeNo) -> bool:
        rec = self._files.get(ino)
        return rec is not None and rec.unlinked

    # ------------------------------------------------------------------ own uploads
    @contextlib.contextmanager
    def own_upload(self, ino: InodeNo) -> Iterator[None]:
        """While this runs, changes the watch reports for `ino` are this mount's own upload."""
        rec = self._record(ino)
        rec.own_uploads += 1
        try:
            yield
        finally:
            rec.own_uploads -= 1
            self._drop_if_idle(rec)

    def uploading(self, ino: InodeNo) -> bool:
        rec = self._files.get(ino)
        return rec is not None and rec.own_uploads > 0

    # ------------------------------------------------------------------ the kernel's page cache
    def cached_version(self, ino: InodeNo) -> str | None:
        rec = self._files.get(ino)
        return rec.cached_version if rec is not None else None

    def set_cached_version(self, ino: InodeNo, nuid: str) -> None:
        self._record(ino).cached_version = nuid

    def dropping_at_open(self, ino: InodeNo, nuid: str, fh: int) -> None:
        """Handle `fh` of version `nuid` was opened without `keep_cache`: the kernel drops the inode's pages
        when it completes that open, which is after this mount answered it. Another thread's open of the
        same version answered meanwhile with `keep_cache` would read what the pages hold before that drop
        (another version's bytes, whole pages of them in the middle of its read), so the pages count as
        this version's only from the first read through `fh` on (the kernel sends none before the open
        completed, drop included: `read_through`)."""
        rec = self._record(ino)
        rec.cached_version = None
        rec.dropping = (nuid, fh)

    def read_through(self, ino: InodeNo, fh: int, nuid: str) -> None:
        """A read through handle `fh` of version `nuid`: if its open dropped the pages, that drop is done."""
        rec = self._files.get(ino)
        if rec is not None and rec.dropping == (nuid, fh):
            rec.cached_version, rec.dropping = nuid, None

    def purged_seen(self, ino: InodeNo, nuid: str) -> bool:
        """A read through a handle of `ino` found version `nuid` purged: True the first time."""
        rec = self._files.get(ino)
        if rec is None or rec.purged == nuid:
            return False
        rec.purged = nuid
        return True

    def forget_cached_version(self, ino: InodeNo) -> None:
        """The kernel's pages of `ino` are dropped (or the inode itself is gone)."""
        rec = self._files.get(ino)
        if rec is not None:
            rec.cached_version = None
            rec.dropping = None
            self._drop_if_idle(rec)

    # ------------------------------------------------------------------ own changes by path
    def is_own(self, path: Path) -> bool:
        return any(path[: len(p)] == p for p in self._own_paths)

    @contextlib.contextmanager
    def changing(self, *paths: Path) -> Iterator[None]:
        """Mark paths (and everything under them) as being changed by this mount itself."""
        self._own_paths.extend(paths)
        try:
            yield
        finally:
            for p in paths:
                self._own_paths.remove(p)
