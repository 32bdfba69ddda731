"""Writes staged on local disk until close, then put as one object.

`Spool` owns the directory of spool files under the cache dir, the byte budget (`--spool-size`),
`lost+found`, where the bytes of an upload that could not be stored are kept for the user, and the
`PutJournal` of puts whose chunks may be orphans (it survives a killed daemon). A
`StagedFile` is the one shared staged state of a file that is being written: every handle of that
inode reads and writes the same spool file. It knows the version it was staged from (for
copy-on-write and for the optimistic-concurrency check at upload) and the POSIX attributes to store.
Spool files are plain sparse files named by a random id; a later write-back journal only has to
record (id → bucket, name, base revision) to make them recoverable after a crash.

Disk I/O of more than a small write, and all reading and hashing for uploads, runs on worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from .adr20 import ObjectInfo, PosixAttrs, PutSession
from .errors import NatsFSError, NoSpace
from .names import escape

log = logging.getLogger(__name__)

# Writes up to this size go straight to the page cache from the trio thread; bigger ones use a thread.
_INLINE_IO = 1024 * 1024
_FILL_PIECE = 1024 * 1024
# The journal is rewritten with only its open records once this many lines were appended.
_JOURNAL_COMPACT = 4096


@dataclass
class UnfinishedPut:
    """A put that ended without a stored meta (or without knowing): its chunks are settled later."""

    name: str
    meta_unknown: bool  # the meta may be stored: read back before purging
    purged_at: float | None = None  # trio time of the last purge; checked empty some seconds later
    reported: bool = False


class PutJournal:
    """Puts whose chunks may become orphans, recorded in an append-only file so that not even a killed
    daemon leaves chunks unnoticed (`adr20.PutLog`); also the chunks of replaced or deleted versions
    whose purge failed (`orphaned`).

    A put is recorded (`+`) before its first chunk is sent and closed (`-`) once its meta is stored or
    its chunks are known gone. Puts that ended otherwise are `pending`; so is every record left open by
    an earlier run of this mount. `natsfs.mutations.Mutations` settles pending puts while the mount runs:
    once the server answers, a put whose meta holds the nuid is kept, any other has its chunk subject
    purged (and checked empty a few seconds later). Lines are written without fsync: a killed daemon
    loses nothing, a machine crash may lose the last records (fsck finds those orphans).
    """

    def __init__(self, path: Path):
        self.path = path
        self.active: dict[tuple[str, str], str] = {}  # (bucket, nuid) -> name, for puts in progress
        self.pending: dict[tuple[str, str], UnfinishedPut] = {}
        self._appended = 0
        self._broken = False
        for key, name in self._open_records().items():
            self.pending[key] = UnfinishedPut(name, meta_unknown=True)
        self._fd = -1
        self._rewrite()

    def _open_records(self) -> dict[tuple[str, str], str]:
        try:
            text = self.path.read_text(errors="replace")
        except FileNotFoundError:
            return {}
        records: dict[tuple[str, str], str] = {}
        for line in text.splitlines():
            try:
                rec = json.loads(line)
                key = (str(rec["b"]), str(rec["n"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed daemon
            if rec.get("op") == "+":
                records[key] = str(rec.get("name", ""))
            else:
                records.pop(key, None)
        return records

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".new")
        lines = [{"op": "+", "b": b, "n": n, "name": name} for (b, n), name in self.active.items()]
        lines += [{"op": "+", "b": b, "n": n, "name": p.name} for (b, n), p in self.pending.items()]
        tmp.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
        os.replace(tmp, self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._appended = 0

    def _append(self, rec: dict[str, str]) -> None:
        try:
            os.write(self._fd, (json.dumps(rec) + "\n").encode())
            self._appended += 1
            if self._appended >= _JOURNAL_COMPACT:
                self._rewrite()
        except OSError as e:
            if not self._broken:
                log.warning("cannot write the put journal %s (%s): a crash now may leave orphan chunks for fsck",
                            self.path, e)
            self._broken = True

    def started(self, bucket: str, nuid: str, name: str) -> None:
        self.active[(bucket, nuid)] = name
        self._append({"op": "+", "b": bucket, "n": nuid, "name": name})

    def finished(self, bucket: str, nuid: str) -> None:
        self.active.pop((bucket, nuid), None)
        self.pending.pop((bucket, nuid), None)
        self._append({"op": "-", "b": bucket, "n": nuid})

    def failed(self, bucket: str, nuid: str, name: str, *, meta_unknown: bool, purged: bool) -> None:
        self.active.pop((bucket, nuid), None)
        self.pending[(bucket, nuid)] = UnfinishedPut(name, meta_unknown, None)
        if purged:
            self.pending[(bucket, nuid)].purged_at = trio.current_time()

    def orphaned(self, bucket: str, nuid: str, name: str) -> None:
        self.pending[(bucket, nuid)] = UnfinishedPut(name, meta_unknown=True)
        self._append({"op": "+", "b": bucket, "n": nuid, "name": name})

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class Spool:
    def __init__(self, root: Path, limit: int):
        self.dir = Path(root) / "spool"
        self.lost_found = Path(root) / "lost+found"
        self.limit = limit
        self.used = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = PutJournal(Path(root) / "puts.journal")

    def rescue_leftovers(self) -> list[Path]:
        """Spool files left by a daemon that died: move them to lost+found/leftover (never delete data),
        with one log line saying where."""
        kept = []
        for f in sorted(self.dir.iterdir()):
            if f.is_file() and f.stat().st_size > 0:
                dest = self._lost_path("leftover", f.name)
                shutil.move(str(f), dest)
                kept.append(dest)
            else:
                f.unlink(missing_ok=True)
        if kept:
            log.warning("%d staged file(s) left by an earlier run of this mount were moved to %s: %s", len(kept),
                        kept[0].parent, ", ".join(p.name for p in kept))
        return kept

    def create(self) -> tuple[int, Path]:
        path = self.dir / secrets.token_hex(12)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        return fd, path

    def charge(self, old_size: int, new_size: int) -> None:
        delta = new_size - old_size
        if delta > 0 and self.used + delta > self.limit:
            log.warning("spool is full: %d of %d bytes staged; refusing %d more", self.used, self.limit, delta)
            raise NoSpace(f"spool full ({self.limit} bytes, --spool-size)", log_level=logging.DEBUG)
        self.used += delta

    def _lost_path(self, bucket: str, name: str) -> Path:
        d = self.lost_found / bucket
        d.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        return d / f"{escape(name)[:200]}.{stamp}.{secrets.token_hex(3)}"

    def keep(self, spool_path: Path, bucket: str, name: str) -> Path:
        dest = self._lost_path(bucket, name)
        os.replace(spool_path, dest)
        return dest


class StagedFile:
    """The staged content and attributes of one file being written."""

    def __init__(self, spool: Spool, *, ino: int, path: tuple[str, ...], bucket: str, name: str,
                 base: ObjectInfo | None, attrs: PosixAttrs):
        self.spool = spool
        self.ino = ino
        self.path = path
        self.bucket = bucket
        self.name = name
        self.base = base  # the version this content started from (None: a new name)
        self.base_revision = base.revision if base is not None else 0
        self.fd, self.spool_path = spool.create()
        self.size = 0
        self.dirty = False
        self.filled = base is None  # copy-on-write: base content copied in on first write
        self.uploaded = False  # stored at least once under this name
        self.unlinked = False
        self.opens = 0
        self.lock = trio.Lock()  # held by uploads and by everything that changes the content
        self.mode = attrs.mode
        self.uid = attrs.uid
        self.gid = attrs.gid
        self.mtime_ns = attrs.mtime_ns or time.time_ns()
        self.mtime_explicit = False
        self.closed = False
        # Streaming upload: while a file grows from the front, its full chunks are sent as they are
        # written, so close only has to send the tail and the meta (see Mutations.stream_ahead).
        self.stream: PutSession | None = None
        self.stream_claimed = 0  # bytes [0, claimed) have been read for sending
        self.stream_running: trio.Event | None = None
        self.stream_dead = False  # content below `claimed` changed: no streaming until the next upload
        # Changes to the meta (xattrs) of a file that has no stored object yet, applied at upload.
        self.meta_changes: list[Callable[[dict[str, Any]], None]] = []

    def reset_stream(self) -> None:
        self.stream = None
        self.stream_claimed = 0
        self.stream_dead = False

    @property
    def shadows_index(self) -> bool:
        """While this is true, lookups and listings show the staged file rather than the index."""
        return not self.unlinked and (self.dirty or not self.uploaded)

    def attrs(self) -> PosixAttrs:
        return PosixAttrs(self.mode, self.uid, self.gid, self.mtime_ns if self.mtime_explicit else None)

    def as_info(self) -> ObjectInfo:
        base = self.base
        return ObjectInfo(bucket=self.bucket, name=self.name, nuid=base.nuid if base else "", size=self.size,
                          chunks=0, digest="", mtime_ns=self.mtime_ns,
                          revision=self.base_revision, attrs=PosixAttrs(self.mode, self.uid, self.gid, None))

    # ------------------------------------------------------------------ content
    async def fill(self, read: Callable[[int, int], Awaitable[bytes]], upto: int | None = None) -> None:
        """Copy the base version's bytes in (copy-on-write), at most `upto` of them."""
        if self.filled:
            return
        assert self.base is not None
        total = self.base.size if upto is None else min(upto, self.base.size)
        self.spool.charge(self.size, max(self.size, total))
        pos = 0
        while pos < total:
            data = await read(pos, min(_FILL_PIECE, total - pos))
            if not data:
                break
            await trio.to_thread.run_sync(os.pwrite, self.fd, data, pos)
            pos += len(data)
        self.size = max(self.size, total)
        self.filled = True

    async def write(self, offset: int, data: bytes) -> int:
        end = offset + len(data)
        self.spool.charge(self.size, max(self.size, end))
        try:
            if len(data) <= _INLINE_IO:
                written = os.pwrite(self.fd, data, offset)
            else:
                written = await trio.to_thread.run_sync(os.pwrite, self.fd, data, offset)
        except OSError as e:
            self.spool.charge(max(self.size, end), self.size)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(f"local spool disk is full: {e}") from None
            raise NatsFSError(f"spool write failed: {e}") from None
        self.size = max(self.size, offset + written)
        self.touch()
        return written

    async def read(self, offset: int, size: int) -> bytes:
        size = max(0, min(size, self.size - offset))
        if size == 0:
            return b""
        if size <= _INLINE_IO:
            data = os.pread(self.fd, size, offset)
        else:
            data = await trio.to_thread.run_sync(os.pread, self.fd, size, offset)
        if len(data) < size:  # a hole reaching the end of a sparse spool file
            data += bytes(size - len(data))
        return data

    async def truncate(self, size: int) -> None:
        self.spool.charge(self.size, size)
        await trio.to_thread.run_sync(os.ftruncate, self.fd, size)
        self.size = size
        self.touch()

    def touch(self) -> None:
        self.dirty = True
        self.mtime_ns = time.time_ns()
        self.mtime_explicit = False

    def uploaded_as(self, info: ObjectInfo) -> None:
        self.base = info
        self.base_revision = info.revision
        self.dirty = False
        self.uploaded = True

    # ------------------------------------------------------------------ endings
    def discard(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.spool_path.unlink(missing_ok=True)
        self.spool.charge(self.size, 0)

    def keep(self) -> Path:
        """Move the staged bytes to lost+found (an upload that could not be stored) and return where."""
        self.closed = True
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, self.size)
            os.close(self.fd)
        self.spool.charge(self.size, 0)
        return self.spool.keep(self.spool_path, self.bucket, self.name)


class Staging:
    """Which files are staged, by inode and by path."""

    def __init__(self, spool: Spool):
        self.spool = spool
        self._by_ino: dict[int, StagedFile] = {}

    def get(self, ino: int) -> StagedFile | None:
        return self._by_ino.get(ino)

    def add(self, staged: StagedFile) -> None:
        self._by_ino[staged.ino] = staged

    def remove(self, staged: StagedFile) -> None:
        if self._by_ino.get(staged.ino) is staged:
            del self._by_ino[staged.ino]

    def at_path(self, path: tuple[str, ...]) -> StagedFile | None:
        for sf in self._by_ino.values():
            if sf.path == path and sf.shadows_index:
                return sf
        return None

    def children(self, path: tuple[str, ...]) -> list[StagedFile]:
        """Staged files directly in directory `path` that the index does not show yet."""
        n = len(path)
        return [sf for sf in self._by_ino.values()
                if len(sf.path) == n + 1 and sf.path[:n] == path and sf.shadows_index]

    def under(self, path: tuple[str, ...]) -> list[StagedFile]:
        n = len(path)
        return [sf for sf in self._by_ino.values() if sf.path[:n] == path and len(sf.path) > n]

    def all(self) -> list[StagedFile]:
        return list(self._by_ino.values())

    def __len__(self) -> int:
        return len(self._by_ino)
