"""Writes staged on local disk until close, then put as one object: the write path's state machine.

`Spool` owns the directory of spool files under the cache dir, the byte budget (`--spool-size`),
`lost+found`, where the bytes of an upload that could not be stored are kept for the user, and the
`PutJournal` of puts whose chunks may be orphans (it survives a killed daemon). A
`StagedFile` is the one shared staged state of a file that is being written: every handle of that
inode reads and writes the same spool file. It knows the version it was staged from (for
copy-on-write and for the optimistic-concurrency check at upload) and the POSIX attributes to store.

Design note: the write state machine. A staged file is always in exactly one `WriteState`, and only
`StagedFile`'s own methods move it (an illegal move raises `IllegalTransition`: a bug, never input):

    UNCHANGED --write/truncate--> DIRTY --upload--> UPLOADING --stored--> STORED --write--> DIRTY
        (new files start DIRTY)              UPLOADING --failed/conflict/cancelled--> DIRTY
                                             UPLOADING --interrupted (`interrupt_upload`)--> DIRTY
    UNCHANGED/DIRTY/UPLOADING/STORED --unlink or replaced while open--> UNLINKED
    DIRTY/UPLOADING --not storable (conflict, unmount, last close)--> KEPT (lost+found)
    UNLINKED --its upload refused as a conflict--> KEPT;  UNCHANGED/STORED/UNLINKED --last close--> DISCARDED
    DIRTY/UPLOADING/UNLINKED --to be kept, but lost+found cannot be written (a full disk)--> UNKEPT
    UNKEPT --kept at a retry--> KEPT

The questions the filesystem asks are properties of the state: `unstored` (DIRTY or UPLOADING: a close
must store it, and a second close waits for the first), `shadows_index` (lookups show the staged file),
`shown`, `ended`, `serves_reads`, `never_stored`. The content changes only under `lock`, which an upload
holds for its whole put, so it never changes while UPLOADING: a change that must not wait for the network
(a write while the write-back uploader's attempt waits for an unreachable server, or has kept it waiting
over a second) interrupts the attempt instead (`interrupt_upload`: it ends as a cancelled one, UPLOADING
-> DIRTY, and releases the lock), and the file is uploaded again after its next close. DIRTY never goes
straight to DISCARDED: unstored bytes are stored or kept, never dropped. UNKEPT is not an end: its bytes
stay where they were (the spool or memory file, still charged to the budgets; in write-back mode also the
journal record) until a retry of `keep` writes them to lost+found; lost+found never holds a partial copy
(written under a temporary name, renamed once complete). Copy-on-write progress (`copied`) and a
streaming upload (the session and the offset claimed so far, a part of DIRTY: `may_stream`,
`claim_stream`, `break_stream`) are the other facts a resumed upload needs. The write-back journal
(`natsfs.journal`) persists exactly this (`journal_entry`): the spool file's id, bucket, name, base
version and revision, the stored object it replaces (`replaces`: renamed over one before its first
upload), the state's value (a plain string), `copied`, the POSIX attributes and the xattr changes (data,
not callbacks); after a crash (`resume`) DIRTY resumes as DIRTY, UPLOADING too (the put journal settles a
put whose meta may have been stored: `Mutations.upload` recognises its nuid), and only files that are
DIRTY or UPLOADING are recorded.

Disk I/O of more than a small write, and all reading and hashing for uploads, runs on worker threads.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import errno
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from . import xattrs
from .adr20 import ObjectInfo, PosixAttrs, PutSession
from .errors import NatsFSError, NoSpace, NotKept
from .names import escape
from .secrecy import private_dir

log = logging.getLogger(__name__)

# Writes up to this size go straight to the page cache from the trio thread; bigger ones use a thread.
_INLINE_IO = 1024 * 1024
# Small staged files whose bytes a write-back journal record holds may live in anonymous memory files
# instead of spool files (`StagedFile.to_memory`), up to this many bytes in all.
MEMORY_STAGED_MAX = 64 * 1024 * 1024
_PAGE = 4096
_FILL_PIECE = 1024 * 1024
# The journal is rewritten with only its open records once this many lines were appended.
_JOURNAL_COMPACT = 4096
# Closing lines of the put journal written with its next record, at most this many held back.
_CLOSES_HELD = 64
# A full spool is warned of once per this many seconds; the refusals in between are counted in the next
# warning (a program retrying its write, or `truncate` to a terabyte in a loop, logged a line per call).
SPOOL_FULL_WARNING_INTERVAL_S = 60.0


@dataclass
class UnfinishedPut:
    """A put that ended without a stored meta (or without knowing): its chunks are settled later."""

    name: str
    meta_unknown: bool  # the meta may be stored: read back before purging
    purged_at: float | None = None  # trio time of the last purge; checked empty some seconds later
    reported: bool = False
    # The upload worker did not say yet that it sends nothing more of it (`FileSender.drop`): purged only
    # once it does, or is gone.
    sender_busy: bool = False


class PutJournal:
    """Puts whose chunks may become orphans, recorded in an append-only file so that not even a killed
    daemon leaves chunks unnoticed (`adr20.PutLog`); also the chunks of replaced or deleted versions
    whose purge failed (`orphaned`).

    A put is recorded (`+`) before its first chunk is sent and closed (`-`) once its meta is stored or
    its chunks are known gone. Puts that ended otherwise are `pending`; so is every record left open by
    an earlier run of this mount. `natsfs.mutations.Mutations` settles pending puts while the mount runs:
    once the server answers, a put whose meta holds the nuid is kept, any other has its chunk subject
    purged (and checked empty a few seconds later). Lines are written without fsync: a killed daemon
    loses nothing, a machine crash may lose the last records (fsck finds those orphans). A closing line
    (`-`) is written together with the next record (`_CLOSES_HELD` at most wait): a small file's put
    costs one write instead of two, and a killed daemon's last closes only make the next mount check
    those puts again (their metas hold the nuids: kept).
    """

    def __init__(self, path: Path):
        self.path = path
        self.active: dict[tuple[str, str], str] = {}  # (bucket, nuid) -> name, for puts in progress
        self.pending: dict[tuple[str, str], UnfinishedPut] = {}
        self._appended = 0
        self._broken = False
        self._closes: list[bytes] = []  # closing lines not written yet (see `finished`)
        for key, name in self._open_records().items():
            self.pending[key] = UnfinishedPut(name, meta_unknown=True)
        self._fd = -1
        try:
            self._rewrite()
        except OSError as e:
            # A full disk at start: the journal stays as it is (its records are still the truth) and
            # new lines are appended to it; the mount starts anyway.
            self.path.with_suffix(".new").unlink(missing_ok=True)
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                size = os.fstat(self._fd).st_size
                if size and os.pread(self._fd, 1, size - 1) != b"\n":
                    os.write(self._fd, b"\n")  # after a killed daemon's torn last line, a line of its own
            except OSError:
                self._broken = True
            log.warning("cannot rewrite the put journal %s (%s): its records stay as they are", self.path,
                        e.strerror or e)

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
        # 0600: the records name buckets and files.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # one an older version left
        with open(fd, "w") as f:
            f.write("".join(json.dumps(rec) + "\n" for rec in lines))
        os.replace(tmp, self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._appended = 0
        self._closes.clear()  # (the rewrite holds open records only)

    def _append(self, rec: dict[str, str] | None) -> None:
        """Write `rec` (None: nothing but the closing lines held back)."""
        lines = self._closes
        if rec is not None:
            lines.append(_journal_line(rec))
        if not lines:
            return
        try:
            os.write(self._fd, b"".join(lines))
            self._appended += len(lines)
            lines.clear()
            if self._appended >= _JOURNAL_COMPACT:
                self._rewrite()
        except OSError as e:
            lines.clear()
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
        self._closes.append(_journal_line({"op": "-", "b": bucket, "n": nuid}))
        if len(self._closes) >= _CLOSES_HELD:
            self._append(None)

    def failed(self, bucket: str, nuid: str, name: str, *, meta_unknown: bool, purged: bool,
               sender_busy: bool = False) -> None:
        self.active.pop((bucket, nuid), None)
        self.pending[(bucket, nuid)] = UnfinishedPut(name, meta_unknown, None, sender_busy=sender_busy)
        if purged:
            self.pending[(bucket, nuid)].purged_at = trio.current_time()

    def orphaned(self, bucket: str, nuid: str, name: str) -> None:
        self.pending[(bucket, nuid)] = UnfinishedPut(name, meta_unknown=True)
        self._append({"op": "+", "b": bucket, "n": nuid, "name": name})

    def flush(self) -> None:
        """Write the closing lines held back (unmounting)."""
        if self._fd >= 0:
            self._append(None)

    def close(self) -> None:
        if self._fd >= 0:
            self.flush()
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def _journal_line(rec: dict[str, str]) -> bytes:
    return (json.dumps(rec) + "\n").encode()


class Spool:
    def __init__(self, root: Path, limit: int, *, clock: Callable[[], float] = time.monotonic):
        self.dir = Path(root) / "spool"
        self.lost_found = Path(root) / "lost+found"
        self.limit = limit
        self.used = 0
        self._clock = clock
        self._full_warned_at: float | None = None
        self._full_refusals_unwarned = 0
        # Bytes (in whole pages) of staged files kept in memory files (see `StagedFile.to_memory`).
        self.memory_used = 0
        # Empty spool files created ahead on a worker thread (write-back mode, see `create_ahead`).
        self._ready: list[tuple[int, Path]] = []
        self.taken = 0  # spool files handed out (`create`): none, and none need making ahead
        private_dir(self.dir)
        self.journal = PutJournal(Path(root) / "puts.journal")

    def rescue_leftovers(self, replayed: frozenset[str] = frozenset()) -> list[Path]:
        """Spool files left by a daemon that died, except those the write-back journal replays
        (`replayed`): move them to lost+found/leftover (never delete data), with one log line saying where."""
        kept = []
        stuck: list[str] = []
        error = ""
        for f in sorted(self.dir.iterdir()):
            if f.name in replayed:
                continue
            if f.is_file() and f.stat().st_size > 0:
                try:
                    dest = self._lost_path("leftover", f.name)
                    shutil.move(str(f), dest)
                except OSError as e:  # a disk still full: the file stays here for the next mount
                    stuck.append(f.name)
                    error = e.strerror or str(e)
                    continue
                kept.append(dest)
            else:
                f.unlink(missing_ok=True)
        if kept:
            log.warning("%d staged file(s) left by an earlier run of this mount were moved to %s: %s", len(kept),
                        kept[0].parent, ", ".join(p.name for p in kept))
        if stuck:
            log.error("%d staged file(s) left by an earlier run of this mount cannot be moved to %s (%s); they "
                      "stay in %s for the next mount: %s", len(stuck), self.lost_found / "leftover", error,
                      self.dir, ", ".join(stuck))
        return kept

    def create(self) -> tuple[int, Path]:
        self.taken += 1
        if self._ready:
            return self._ready.pop()
        return self._create()

    def _create(self) -> tuple[int, Path]:
        path = self.dir / secrets.token_hex(12)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        return fd, path

    def create_in_memory(self) -> tuple[int, Path]:
        """An anonymous memory file and the spool path it would take (not created): creating a file
        costs the local file system far more than a memory file (0.75 ms of CPU against 8 us on the
        test machine's ext4), and a small new file is put (or, in write-back mode, journalled) from
        memory, never needing one."""
        return _memory_file(), self.dir / secrets.token_hex(12)

    @property
    def ready(self) -> int:
        return len(self._ready)

    def create_ahead(self, count: int) -> list[tuple[int, Path]]:
        """`count` empty spool files for `add_ready` (blocking: a worker thread's job). Creating a file
        costs a burst of small files (`tar -x` in write-back mode) about as much as its journal sync."""
        return [self._create() for _ in range(count)]

    def add_ready(self, made: list[tuple[int, Path]]) -> None:
        self._ready.extend(made)

    def drop_ready(self) -> None:
        """Remove the spool files created ahead and not used (unmounting). Any a crash leaves are empty,
        and `rescue_leftovers` removes empty files."""
        for fd, path in self._ready:
            with contextlib.suppress(OSError):
                os.close(fd)
            path.unlink(missing_ok=True)
        self._ready.clear()

    def charge(self, old_size: int, new_size: int) -> None:
        delta = new_size - old_size
        if delta > 0 and self.used + delta > self.limit:
            self._warn_full(delta)
            raise NoSpace(f"spool full ({self.limit} bytes, --spool-size)", log_level=logging.DEBUG)
        self.used += delta

    def _warn_full(self, delta: int) -> None:
        now = self._clock()
        if self._full_warned_at is not None and now - self._full_warned_at < SPOOL_FULL_WARNING_INTERVAL_S:
            self._full_refusals_unwarned += 1
            return
        since = (f" ({self._full_refusals_unwarned} more refused since the last such warning)"
                 if self._full_refusals_unwarned else "")
        log.warning("spool is full: %d of %d bytes staged; refusing %d more%s", self.used, self.limit, delta, since)
        self._full_warned_at = now
        self._full_refusals_unwarned = 0

    def _lost_path(self, bucket: str, name: str) -> Path:
        d = private_dir(self.lost_found / bucket)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        return d / f"{escape(name)[:200]}.{stamp}.{secrets.token_hex(3)}"

    def keep(self, spool_path: Path, bucket: str, name: str) -> Path:
        dest = self._lost_path(bucket, name)
        os.replace(spool_path, dest)
        return dest

    def keep_data(self, data: bytes, bucket: str, name: str) -> Path:
        """`keep` of bytes held in memory (a staged file moved to memory). Written under a temporary
        name and renamed once complete: a full disk leaves no partial copy that looks kept (`OSError`)."""
        dest = self._lost_path(bucket, name)
        partial = dest.with_name(f".{dest.name}.partial")
        try:
            restore_file(partial, data)
            os.replace(partial, dest)
        except OSError:
            partial.unlink(missing_ok=True)
            raise
        return dest


def _write_all(fd: int, data: bytes) -> None:
    """Write `data` as the content of `fd` from offset 0 (short writes continued)."""
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos:], pos)


def _pages(size: int) -> int:
    """`size` rounded up to whole pages: what a memory file of that size costs."""
    return -(-size // _PAGE) * _PAGE


def _memory_file() -> int:
    return os.memfd_create("natsfs-staged", os.MFD_CLOEXEC)


def _spool_write_error(e: OSError) -> NatsFSError:
    """The domain error for a failed write to the local spool."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"local spool disk is full: {e}")
    return NatsFSError(f"spool write failed: {e}")


def restore_file(path: Path, data: bytes) -> None:
    """Write `data` as the whole content of `path` (a spool file restored from a journal record)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def version_entry(info: ObjectInfo | None) -> dict[str, Any] | None:
    """What the write-back journal keeps of a stored version (the `ObjectInfo` fields of `resume`)."""
    if info is None:
        return None
    return {"nuid": info.nuid, "size": info.size, "chunks": info.chunks, "digest": info.digest,
            "mtime_ns": info.mtime_ns, "revision": info.revision, "chunk_size": info.chunk_size}


class WriteState(enum.StrEnum):
    """Where a staged file is on its way to the bucket (see the module's design note)."""

    UNCHANGED = "unchanged"  # staged from a stored version, not changed yet (its bytes copied in or not)
    DIRTY = "dirty"  # changed since it was last stored; a new file starts here (close creates the object)
    UPLOADING = "uploading"  # being stored; a close that comes meanwhile waits for the outcome
    STORED = "stored"  # the bucket holds exactly these bytes and attributes
    UNLINKED = "unlinked"  # deleted or replaced while open: its handles still read and write, nothing is stored
    DISCARDED = "discarded"  # the spool file is gone (end)
    KEPT = "kept"  # the bytes were moved to lost+found, never stored (end)
    UNKEPT = "unkept"  # to be kept, but lost+found could not be written: the bytes stay staged, keeping is retried


_NEXT: dict[WriteState, frozenset[WriteState]] = {
    WriteState.UNCHANGED: frozenset({WriteState.DIRTY, WriteState.UNLINKED, WriteState.DISCARDED}),
    # Never DIRTY -> DISCARDED: unstored bytes are stored or kept in lost+found, never dropped.
    WriteState.DIRTY: frozenset({WriteState.DIRTY, WriteState.UPLOADING, WriteState.UNLINKED, WriteState.KEPT,
                                 WriteState.UNKEPT}),
    WriteState.UPLOADING: frozenset({WriteState.STORED, WriteState.DIRTY, WriteState.UNLINKED, WriteState.KEPT,
                                     WriteState.UNKEPT}),
    WriteState.STORED: frozenset({WriteState.DIRTY, WriteState.UNLINKED, WriteState.DISCARDED}),
    WriteState.UNLINKED: frozenset({WriteState.UNLINKED, WriteState.DISCARDED, WriteState.KEPT, WriteState.UNKEPT}),
    # Never UNKEPT -> DISCARDED either: bytes waiting for lost+found are kept or left for the next mount.
    WriteState.UNKEPT: frozenset({WriteState.UNKEPT, WriteState.KEPT}),
    WriteState.DISCARDED: frozenset(),
    WriteState.KEPT: frozenset(),
}
_UNSTORED = frozenset({WriteState.DIRTY, WriteState.UPLOADING})
_SHADOWING = frozenset({WriteState.UNCHANGED, WriteState.DIRTY, WriteState.UPLOADING})
_ENDED = frozenset({WriteState.DISCARDED, WriteState.KEPT})


class IllegalTransition(RuntimeError):
    """A staged file was asked to move to a state it cannot reach from where it is (a bug, never input)."""


class StagedFile:
    """The staged content and attributes of one file being written, and its `WriteState`.

    Only the methods here change a staged file; everything else reads it."""

    def __init__(self, spool: Spool, *, ino: int, path: tuple[str, ...], bucket: str, name: str,
                 base: ObjectInfo | None, attrs: PosixAttrs, new: bool = False, unlinked: bool = False,
                 spool_file: Path | None = None, memory_limit: int = 0):
        self.spool = spool
        self.ino = ino
        self.path = path
        self.bucket = bucket
        self.name = name
        self.base = base  # the version this content started from (None: a new name)
        self.base_revision = base.revision if base is not None else 0
        # A stored object this file (never stored itself) was renamed over: its upload replaces that one
        # (expecting its revision, purging its chunks), so other clients read it until then (`replace`).
        self.replaces: ObjectInfo | None = None
        # In memory (`to_memory`): `fd` is an anonymous memory file and `spool_path` may no longer exist.
        self.in_memory = False
        self._memory_charge = 0
        self._memory_limit = 0
        self._spool_file_made = True  # False while a file born in memory has never had one
        if spool_file is None and memory_limit and spool.memory_used + _PAGE <= MEMORY_STAGED_MAX:
            # Born in memory (a new file, see `Spool.create_in_memory`): a spool file of this name is
            # made only if it grows past `memory_limit` or a path is needed.
            self.fd, self.spool_path = spool.create_in_memory()
            self.size = 0
            self.in_memory = True
            self._spool_file_made = False
            self._memory_limit = memory_limit
        elif spool_file is None:
            self.fd, self.spool_path = spool.create()
            self.size = 0
        else:  # resumed from the write-back journal
            self.fd = os.open(spool_file, os.O_RDWR | os.O_CLOEXEC)
            self.spool_path = spool_file
            self.size = os.fstat(self.fd).st_size
            spool.used += self.size
        # `new`: an empty new file is still a file, so close creates the object.
        self.state = WriteState.UNLINKED if unlinked else WriteState.DIRTY if new else WriteState.UNCHANGED
        self.copied = base is None  # copy-on-write: the base version's bytes are in the spool file
        self.lock = trio.Lock()  # held by uploads and by everything that changes the content
        # Operations that staged or are changing it and settle it themselves when done (an open with
        # O_TRUNC registers its handle, a truncate stores it): while any runs, a last close or the end of
        # a write-back upload does not drop it (it would close `fd` under the change, or send the bytes
        # the change just made to lost+found), see `FileSystem._pinned`.
        self.pins = 0
        self.mode = attrs.mode
        self.uid = attrs.uid
        self.gid = attrs.gid
        # (0 is a time like any other: the epoch, as `touch -d @0` sets it)
        self.mtime_ns = attrs.mtime_ns if attrs.mtime_ns is not None else time.time_ns()
        self.mtime_explicit = False
        # Streaming upload (part of DIRTY): while a file grows from the front, its full chunks are sent
        # as they are written, so close only has to send the tail and the meta (Mutations.stream_ahead).
        self.stream: PutSession | None = None
        self.stream_claimed = 0  # bytes [0, claimed) have been read for sending
        self.stream_running: trio.Event | None = None
        self.stream_wake: trio.Event | None = None  # set by writes and ended sends while streaming runs
        self.stream_dead = False  # content below `claimed` changed: no streaming until the next upload
        # Extended attributes set or removed (None) on a file that has no stored object yet, stored
        # with its first upload.
        self.xattr_changes: list[tuple[str, bytes | None]] = []
        # Resumed from the write-back journal: its upload may have been stored by the run that died.
        self.resumed = False
        # The `Nats-Msg-Id` of this mount's last unlink of it that failed (write-back: the tombstone of
        # `Filesystem._removing_record`), which may have been stored all the same: its upload replaces it.
        self.failed_removal = ""
        # Why the last store of it at a close failed: said again where its bytes end up in lost+found.
        self.store_failure: str | None = None
        # The operation whose store failed: "truncate" for a truncate(2) of a path no writer had open,
        # whose bytes then go to lost+found without any close (the line saying so names it, not a close).
        self.failed_by = "close"
        # The cancel scope of an upload attempt that a change of the content may interrupt (the
        # write-back uploader's, see `interruptible_upload`); None: a change waits for the upload.
        self._interruptible: trio.CancelScope | None = None

    @property
    def entry_id(self) -> str:
        """Its key in the write-back journal: the spool file's name (unique in the spool; kept while the
        bytes are in memory, and the name a spool file for them takes again)."""
        return self.spool_path.name

    # ------------------------------------------------------------------ memory or spool file
    def to_memory(self, limit: int) -> bool:
        """Move the bytes of a small file into an anonymous memory file, so that it holds no spool file
        (a file system slows down with many live files: a burst of small closes in write-back mode).
        Only for bytes a synced journal record also holds; the caller removes the spool file (see
        `drop_spool_file`). False if the memory budget (`MEMORY_STAGED_MAX`) is spent or it moved already."""
        charge = _pages(self.size)
        if self.in_memory or self.ended or self.spool.memory_used + charge > MEMORY_STAGED_MAX or self.size > limit:
            return False
        data = self.read_all()
        mfd = _memory_file()
        try:
            _write_all(mfd, data)
        except OSError:
            os.close(mfd)
            return False
        os.close(self.fd)
        self.fd = mfd
        self.in_memory = True
        self._memory_charge = charge
        self._memory_limit = limit
        self.spool.memory_used += charge
        return True

    def drop_spool_file(self) -> None:
        """Remove the spool file a file in memory no longer uses (left while its journal record was the
        last one, the only one a crash can tear)."""
        if self.in_memory:
            self.spool_path.unlink(missing_ok=True)

    def file_path(self) -> str:
        """The path of a spool file holding every staged byte (for the upload worker, which opens it):
        a file in memory goes back to its spool file first."""
        self._to_spool_file()
        return str(self.spool_path)

    def _to_spool_file(self) -> None:
        """Back into a spool file (of the same name) before it grows past what memory holds, or when a
        path is needed."""
        if not self.in_memory:
            return
        data = self.read_all()
        try:
            fd = os.open(self.spool_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            self._spool_file_made = True
        except OSError as e:  # (a full or read-only local disk: the bytes stay in memory)
            raise _spool_write_error(e) from None
        try:
            _write_all(fd, data)
        except OSError as e:
            os.close(fd)
            raise _spool_write_error(e) from None
        os.close(self.fd)
        self.fd = fd
        self._leave_memory()

    def _leave_memory(self) -> None:
        self.in_memory = False
        self.spool.memory_used -= self._memory_charge
        self._memory_charge = 0

    def _fits_memory(self, size: int) -> bool:
        return (size <= self._memory_limit
                and self.spool.memory_used - self._memory_charge + _pages(size) <= MEMORY_STAGED_MAX)

    def _recharge_memory(self) -> None:
        if self.in_memory:
            charge = _pages(self.size)
            self.spool.memory_used += charge - self._memory_charge
            self._memory_charge = charge

    def journal_entry(self, data: bytes | None = None) -> dict[str, Any]:
        """What the write-back journal keeps of it: all an upload after a crash needs (plain data);
        `data`, the whole content of a small file, makes the record alone durable (no spool sync)."""
        inline = {} if data is None else {"data": base64.b64encode(data).decode()}
        replaces = {} if self.replaces is None else {"replaces": version_entry(self.replaces)}
        return inline | replaces | {
            "id": self.entry_id, "bucket": self.bucket, "name": self.name, "state": self.state.value,
            "copied": self.copied, "size": self.size, "base": version_entry(self.base),
            "base_revision": self.base_revision, "mode": self.mode, "uid": self.uid, "gid": self.gid,
            "mtime_ns": self.mtime_ns, "mtime_explicit": self.mtime_explicit,
            "xattrs": [[k, None if v is None else base64.b64encode(v).decode()] for k, v in self.xattr_changes],
        }

    @classmethod
    def resume(cls, spool: Spool, entry: dict[str, Any], *, ino: int, path: tuple[str, ...]) -> StagedFile:
        """A file closed in write-back mode by an earlier run, from its journal entry and spool file: DIRTY
        again (an upload that was running is settled by the put journal, see `Mutations.upload`)."""
        b, r = entry["base"], entry.get("replaces")
        base = None if b is None else ObjectInfo(bucket=entry["bucket"], name=entry["name"], **b)
        if "data" in entry:  # the bytes the close made durable (the spool file was not synced)
            restore_file(spool.dir / entry["id"], base64.b64decode(entry["data"]))
        sf = cls(spool, ino=ino, path=path, bucket=entry["bucket"], name=entry["name"], base=base,
                 attrs=PosixAttrs(entry["mode"], entry["uid"], entry["gid"], entry["mtime_ns"]), new=True,
                 spool_file=spool.dir / entry["id"])
        sf.base_revision = int(entry["base_revision"])
        sf.copied = True  # only files holding every byte are journaled
        sf.mtime_explicit = bool(entry["mtime_explicit"])
        sf.xattr_changes = [(k, None if v is None else base64.b64decode(v)) for k, v in entry["xattrs"]]
        sf.resumed = True
        if r is not None:
            sf.replaces = ObjectInfo(bucket=entry["bucket"], name=entry["name"], **r)
        return sf

    def read_all(self) -> bytes:
        """The whole staged content (a small file: read in place, no worker thread)."""
        data = os.pread(self.fd, self.size, 0) if self.size else b""
        return data + bytes(self.size - len(data))  # a hole at the end reads short

    def _to(self, state: WriteState) -> None:
        if state not in _NEXT[self.state]:
            raise IllegalTransition(f"{self.bucket}/{self.name}: {self.state} -> {state}")
        self.state = state

    # ------------------------------------------------------------------ what the state says
    @property
    def unstored(self) -> bool:
        """Holds bytes the bucket does not have yet that a close (or unmount) must store."""
        return self.state in _UNSTORED

    @property
    def shadows_index(self) -> bool:
        """While this is true, lookups and listings show the staged file rather than the index."""
        return self.state in _SHADOWING

    @property
    def shown(self) -> bool:
        """Its inode shows the staged file (also once unlinked: what its open handles hold)."""
        return self.state in _SHADOWING or self.state is WriteState.UNLINKED

    @property
    def ended(self) -> bool:
        return self.state in _ENDED

    @property
    def unlinked(self) -> bool:
        return self.state is WriteState.UNLINKED

    @property
    def unkept(self) -> bool:
        """Its bytes belong in lost+found but could not be written there yet (see `keep`)."""
        return self.state is WriteState.UNKEPT

    @property
    def never_stored(self) -> bool:
        """No object exists for it yet (its xattrs live here until the first upload)."""
        return not self.ended and self.base is None

    @property
    def serves_reads(self) -> bool:
        """Reads come from the spool file (it holds every byte of the file)."""
        return self.copied and not self.ended

    def attrs(self) -> PosixAttrs:
        return PosixAttrs(self.mode, self.uid, self.gid, self.mtime_ns if self.mtime_explicit else None)

    def as_info(self) -> StagedVersion:
        base = self.base
        return StagedVersion(bucket=self.bucket, name=self.name, nuid=base.nuid if base else "", size=self.size,
                             chunks=0, digest="", mtime_ns=self.mtime_ns,
                             revision=self.base_revision, attrs=PosixAttrs(self.mode, self.uid, self.gid, None))

    def apply_xattr_changes(self, doc: dict[str, Any], changes: list[tuple[str, bytes | None]] | None = None) -> None:
        for key, value in self.xattr_changes if changes is None else changes:
            xattrs.set_object(doc, key, value)

    # ------------------------------------------------------------------ attributes and names
    def set_attrs(self, mode: int | None, uid: int | None, gid: int | None, mtime_ns: int | None) -> None:
        """chmod/chown/utimens of a file not stored yet: stored with its data at the next upload."""
        if mode is not None:
            self.mode = mode
        if uid is not None:
            self.uid = uid
        if gid is not None:
            self.gid = gid
        if mtime_ns is not None:
            self.mtime_ns = mtime_ns
            self.mtime_explicit = True

    def change_xattr(self, key: str, value: bytes | None) -> None:
        self.xattr_changes.append((key, value))

    def rebase(self, info: ObjectInfo) -> None:
        """This mount changed the stored version's meta itself (attributes, xattrs): the upload that
        follows replaces `info`, not a conflict."""
        self.base = info
        self.base_revision = info.revision

    def move(self, path: tuple[str, ...], name: str, renamed: ObjectInfo | None) -> None:
        """Renamed (by this mount): it now lives at `path`; `renamed` is its stored version's new meta
        (or, for a file that replaces an object at its first upload, that object's new meta)."""
        self.path = path
        self.name = name
        if renamed is not None and self.base is None:
            self.replaces = renamed
        elif renamed is not None:
            self.rebase(renamed)

    def replace(self, target: ObjectInfo | None) -> None:
        """Renamed over the stored object `target` before its first upload (None: no longer, the object
        was deleted): the upload replaces it."""
        assert self.base is None
        self.replaces = target

    def unlink(self) -> None:
        """Deleted or replaced while open: writes through open handles now go nowhere, as on a local disk."""
        self._to(WriteState.UNLINKED)

    # ------------------------------------------------------------------ uploads
    def begin_upload(self) -> None:
        self._to(WriteState.UPLOADING)

    def upload_failed(self) -> None:
        """The upload ended without storing (error, conflict or cancelled): the bytes stay unstored."""
        if self.state is WriteState.UPLOADING:
            self._to(WriteState.DIRTY)

    def stored(self, info: ObjectInfo, xattrs_stored: int) -> None:
        """The upload stored `info` (with the first `xattrs_stored` xattr changes)."""
        self.rebase(info)
        self.replaces = None
        del self.xattr_changes[:xattrs_stored]
        if self.state is WriteState.UPLOADING:
            self._to(WriteState.STORED)

    @contextlib.contextmanager
    def interruptible_upload(self) -> Iterator[trio.CancelScope]:
        """Run an upload attempt that `interrupt_upload` may cancel; `cancelled_caught` of the scope
        yielded tells whether it was."""
        with trio.CancelScope() as scope:
            self._interruptible = scope
            try:
                yield scope
            finally:
                self._interruptible = None

    def interrupt_upload(self) -> bool:
        """A change of the content that must not wait for the upload under way: cancel its attempt, if
        it runs in `interruptible_upload`. It then ends as a cancelled attempt (UPLOADING -> DIRTY, its
        put's chunks settled like those of a close cut off by its deadline) and releases `lock`; the
        change goes on, and nothing of the attempt is recorded as the file's stored state. True if it
        was interrupted now (False: no such attempt, or one interrupted already and still ending)."""
        if (self.state is not WriteState.UPLOADING or self._interruptible is None
                or self._interruptible.cancel_called):
            return False
        self._interruptible.cancel()
        return True

    # ------------------------------------------------------------------ streaming (within DIRTY)
    def may_stream(self, batch: int) -> bool:
        return (not self.stream_dead and self.stream_running is None and self.state is WriteState.DIRTY
                and self.size - self.stream_claimed >= batch)

    def streaming_started(self) -> trio.Event:
        self.stream_running = trio.Event()
        return self.stream_running

    def claim_stream(self, start_put: Callable[[], PutSession], batch: int, chunk: int) -> tuple[PutSession, int, int]:
        """The next range of full chunks to send, claimed before it is read: a write into it from now on
        breaks the stream, so sending needs no lock and writers never wait for it."""
        if self.stream is None:
            self.stream = start_put()
        start = self.stream_claimed
        end = start + min(batch, (self.size - start) // chunk * chunk)
        self.stream_claimed = end
        return self.stream, start, end

    def streaming_ended(self) -> None:
        self.stream_wake = None
        running, self.stream_running = self.stream_running, None
        if running is not None:
            running.set()

    def break_stream(self) -> tuple[PutSession | None, trio.Event | None]:
        """Stop streaming until the next upload; returns the session to abort and the send to wait for."""
        self.stream_dead = True
        session, self.stream, self.stream_claimed = self.stream, None, 0
        return session, self.stream_running

    def reset_stream(self) -> None:
        self.stream = None
        self.stream_claimed = 0
        self.stream_dead = False

    # ------------------------------------------------------------------ content
    def skip_copy(self) -> None:
        """Nothing of the base version's content survives (O_TRUNC): no copy needed."""
        self.copied = True

    async def fill(self, read: Callable[[int, int], Awaitable[bytes | bytearray]], upto: int | None = None) -> None:
        """Copy the base version's bytes in (copy-on-write), at most `upto` of them."""
        if self.copied:
            return
        assert self.base is not None
        self._to_spool_file()
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
        self.copied = True

    async def write(self, offset: int, data: bytes) -> int:
        end = offset + len(data)
        if self.in_memory and not self._fits_memory(end):
            self._to_spool_file()
        self.spool.charge(self.size, max(self.size, end))
        try:
            if len(data) <= _INLINE_IO:
                written = os.pwrite(self.fd, data, offset)
            else:
                written = await trio.to_thread.run_sync(os.pwrite, self.fd, data, offset)
        except OSError as e:
            self.spool.charge(max(self.size, end), self.size)
            raise _spool_write_error(e) from None
        self.size = max(self.size, offset + written)
        self._recharge_memory()
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
        if self.in_memory and not self._fits_memory(size):
            self._to_spool_file()
        self.spool.charge(self.size, size)
        await trio.to_thread.run_sync(os.ftruncate, self.fd, size)
        self.size = size
        self._recharge_memory()
        self.touch()

    def touch(self) -> None:
        """The content changed (a write or truncate, always under `lock`, so never while uploading)."""
        if self.state is WriteState.UPLOADING:
            raise IllegalTransition(f"{self.bucket}/{self.name}: changed while uploading")
        if self.state is not WriteState.UNLINKED:
            self._to(WriteState.DIRTY)
        self.mtime_ns = time.time_ns()
        self.mtime_explicit = False

    # ------------------------------------------------------------------ endings
    def discard(self) -> None:
        """Drop the spool file (nothing in it is needed: stored, unchanged, or unlinked)."""
        if self.ended:
            return
        self._to(WriteState.DISCARDED)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1  # a late use fails (EBADF) instead of reaching whatever file reuses the number
        if self._spool_file_made:
            self.spool_path.unlink(missing_ok=True)
        self.spool.charge(self.size, 0)
        if self.in_memory:
            self._leave_memory()

    def keep(self) -> Path:
        """Move the staged bytes to lost+found (an upload that could not be stored) and return where.

        If lost+found cannot be written (a full local disk: a copy of bytes held in memory needs space,
        a new lost+found directory may too), it is UNKEPT and `NotKept` is raised: the bytes stay where
        they are, still charged to the spool and memory budgets, and a later call tries again."""
        if WriteState.KEPT not in _NEXT[self.state]:
            raise IllegalTransition(f"{self.bucket}/{self.name}: {self.state} -> {WriteState.KEPT}")
        try:
            if self.in_memory:
                kept = self.spool.keep_data(self.read_all(), self.bucket, self.name)
            else:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, self.size)
                kept = self.spool.keep(self.spool_path, self.bucket, self.name)
        except OSError as e:
            self._to(WriteState.UNKEPT)
            where = "in memory" if self.in_memory else f"in {self.spool_path}"
            raise NotKept(f"{self.bucket}/{self.name}: its bytes ({self.size}) could not be written to "
                          f"{self.spool.lost_found} ({e.strerror or e}); they stay {where}",
                          errno=e.errno or errno.EIO) from None
        self._to(WriteState.KEPT)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1  # (as in `discard`)
        self.spool.charge(self.size, 0)
        if self.in_memory:
            self._leave_memory()
            self.spool_path.unlink(missing_ok=True)  # (a spool file not dropped yet)
        return kept


@dataclass(slots=True)
class StagedVersion(ObjectInfo):
    """What a staged file shows (`StagedFile.as_info`): its bytes are in the staging area, not in the
    bucket. Its nuid is the version it was staged from and its size the staged one, so no chunk of the
    bucket is ever read for it: a handle that opened it reads the staged file while it serves reads."""


class Staging:
    """Which files are staged, by inode and by path (indexed both ways: a write-back burst leaves
    thousands staged, and every lookup and create asks by path)."""

    def __init__(self, spool: Spool):
        self.spool = spool
        self._by_ino: dict[int, StagedFile] = {}
        self._by_path: dict[tuple[str, ...], dict[int, StagedFile]] = {}
        self._by_parent: dict[tuple[str, ...], dict[int, StagedFile]] = {}

    def get(self, ino: int) -> StagedFile | None:
        return self._by_ino.get(ino)

    def add(self, staged: StagedFile) -> None:
        old = self._by_ino.get(staged.ino)
        if old is not None:
            self._unindex(old)
        self._by_ino[staged.ino] = staged
        self._index(staged)

    def remove(self, staged: StagedFile) -> None:
        if self._by_ino.get(staged.ino) is staged:
            del self._by_ino[staged.ino]
            self._unindex(staged)

    def move(self, staged: StagedFile, path: tuple[str, ...], name: str, renamed: ObjectInfo | None) -> None:
        """`StagedFile.move`, keeping the path index right."""
        indexed = self._by_ino.get(staged.ino) is staged
        if indexed:
            self._unindex(staged)
        staged.move(path, name, renamed)
        if indexed:
            self._index(staged)

    def _index(self, staged: StagedFile) -> None:
        self._by_path.setdefault(staged.path, {})[staged.ino] = staged
        self._by_parent.setdefault(staged.path[:-1], {})[staged.ino] = staged

    def _unindex(self, staged: StagedFile) -> None:
        for table, key in ((self._by_path, staged.path), (self._by_parent, staged.path[:-1])):
            group = table.get(key)
            if group is not None and group.get(staged.ino) is staged:
                del group[staged.ino]
                if not group:
                    del table[key]

    def at_path(self, path: tuple[str, ...]) -> StagedFile | None:
        for sf in self._by_path.get(path, {}).values():
            if sf.shadows_index:
                return sf
        return None

    def named(self, path: tuple[str, ...], *, subtree: bool = False) -> list[StagedFile]:
        """Every staged file (in any state but ended) at `path`, or with `subtree` also under it."""
        if subtree:
            return [sf for sf in self._by_ino.values() if sf.path[: len(path)] == path and not sf.ended]
        return [sf for sf in self._by_path.get(path, {}).values() if not sf.ended]

    def children(self, path: tuple[str, ...]) -> list[StagedFile]:
        """Staged files directly in directory `path` that the index does not show yet."""
        return [sf for sf in self._by_parent.get(path, {}).values() if sf.shadows_index]

    def all(self) -> list[StagedFile]:
        return list(self._by_ino.values())

    def __len__(self) -> int:
        return len(self._by_ino)
