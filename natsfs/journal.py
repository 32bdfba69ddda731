"""The write-back journal: which closed files still wait for their upload, durable on local disk.

In write-back mode (`--write-back`) a close returns once the file's spool file and one record here are
fsynced; the background uploader (`natsfs.core.writeback`) puts the file later and then appends a `done`
record. A later mount with the same cache dir reads the journal back and replays every record that is
not done.

The file is a sequence of framed records, each `length (u32 BE) | CRC-32 of the payload (u32 BE) |
payload` with a JSON object as payload, followed by zeros: the file is grown ahead of its records in
zero-filled steps (`GROW_BYTES`), so that the sync of a record writes data only. (An fdatasync that
neither extends the file nor allocates blocks commits no filesystem metadata: on ext4 it costs about
half of an append's, and it does not wait for the metadata of the spool files created meanwhile.) A
zero header ends the records. One writer (the daemon, holding the mount) appends and
chooses when to sync: `record_many` writes the records of several closes at once and fsyncs them
together (group commit: one sync for every close that arrived while the previous one ran); `done` is
written without a sync of its own (the next sync covers it; a `done` lost to a crash of the machine
only makes the replay find the object already stored, see `core.writeback`). A pending file unlinked, or
replaced by a rename, before its upload is closed by a `done` that is synced like a close's record
(`commit`: a crash must not bring back what a program saw removed). A record cut short by a crash or
a failed CRC ends the readable journal: that torn record and whatever follows it is skipped (one log
line), everything before it is used. The journal is rewritten with only its live records (compaction:
temporary file, fsync, rename, fsync of the directory) when it is opened after a torn tail or once
most of its records are dead. Compaction only saves space: one that fails while the mount runs (a
local disk with no room for the copy, though the records still fit in the zeros ahead) fails no
close; the records go on into the journal as it is (one warning line) and it is tried again after
`_COMPACT_MIN` more records.

A live record is keyed by `id` (the spool file's name) and holds what `staging.StagedFile.journal_entry`
writes: bucket, name, base version, state, attributes, xattr changes, and for a small file its bytes
(`data`, base64: then the record alone makes the close durable, no sync of the spool file is needed,
and the replay restores the spool file from it). A newer record of the same id
replaces the older one (a rewrite of a pending file merges into one upload), and replay order is the
order in which each id's latest record was written (where two live records name one path, the replay
keeps the later one only, see `core.writeback.WriteBack.resume`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">II")
# A record bigger than this is not one we wrote: the length field itself is torn or garbage.
MAX_RECORD = 1 << 20
# The journal file grows ahead of its records by at least this much (zeros), see the module docstring.
GROW_BYTES = 1 << 20
# Compact once dead records outnumber live ones by this factor (and there are at least _COMPACT_MIN).
_COMPACT_FACTOR = 2
_COMPACT_MIN = 64


def is_torn(data: bytes, end: int) -> bool:
    """Whether `data` holds anything but zeros after the readable records ending at `end`."""
    return bool(data[end:].strip(b"\0"))


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The records framed in `data`, and the offset where the readable part ends: where the zeros
    after the last record start, or where a torn record starts."""
    records: list[dict[str, Any]] = []
    pos = 0
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        if length == 0 and crc == 0:
            break  # the zeros after the last record (no record has an empty payload)
        start = pos + _HEADER.size
        if length > MAX_RECORD or start + length > len(data):
            break
        payload = data[start:start + length]
        if zlib.crc32(payload) != crc:
            break
        try:
            rec = json.loads(payload)
        except ValueError:
            break
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            break
        records.append(rec)
        pos = start + length
    return records, pos


class WriteBackJournal:
    """The pending uploads of one mount (see the module docstring). Its methods do blocking disk I/O
    (with fsync): call them from a worker thread."""

    def __init__(self, path: Path):
        self.path = path
        self.pending: dict[str, dict[str, Any]] = {}  # id -> latest record, in replay order
        self.torn_at: int | None = None  # where a torn tail started when the journal was opened
        self._written = 0  # records in the file (live and dead)
        # After a failed compaction: the record count at which to try again (None: no failure pending).
        self._compact_retry_at: int | None = None
        self._fd = -1
        self._end = 0  # where the next record goes (the zeros start)
        self._size = 0  # the file's size (records and the zeros after them)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        records, end = read_records(data)
        for rec in records:
            self._apply(rec)
        self._end, self._size = end, len(data)
        if is_torn(data, end):
            self.torn_at = end
            log.warning("write-back journal %s: a torn record at byte %d (of %d) is skipped; %d pending "
                        "upload(s) read before it", path, end, len(data), len(self.pending))
        self._written = len(records)
        if self.torn_at is not None or self._mostly_dead():
            self.compact()
        else:
            self._open()

    def _apply(self, rec: dict[str, Any]) -> None:
        self.pending.pop(rec["id"], None)
        if rec.get("op") == "put":
            self.pending[rec["id"]] = rec

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _mostly_dead(self) -> bool:
        dead = self._written - len(self.pending)
        return dead >= _COMPACT_MIN and dead > _COMPACT_FACTOR * len(self.pending)

    def _compaction_due(self) -> bool:
        return self._mostly_dead() and (self._compact_retry_at is None or self._written >= self._compact_retry_at)

    def _append(self, recs: list[dict[str, Any]], sync: bool, compact: bool = True) -> None:
        data = b"".join(frame(json.dumps(rec, separators=(",", ":")).encode()) for rec in recs)
        if self._end + len(data) > self._size:
            self._grow(len(data))
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, self._end)
            view = view[written:]
            self._end += written
        if sync:
            os.fdatasync(self._fd)
        self._written += len(recs)
        for rec in recs:
            self._apply(rec)
        if compact:
            self.compact_if_due()

    def _grow(self, need: int) -> None:
        """Zeros after the records for this and later records (synced with the record that needs them)."""
        target = self._end + need + GROW_BYTES
        zeros = bytes(min(GROW_BYTES, target - self._size))
        while self._size < target:
            self._size += os.pwrite(self._fd, zeros[:target - self._size], self._size)

    def record(self, entry: dict[str, Any]) -> None:
        """A file's bytes (fsynced in its spool file, or carried in the entry) wait for upload: durable
        when this returns."""
        self.record_many([entry])

    def record_many(self, entries: list[dict[str, Any]], *, compact: bool = True) -> None:
        """`record` of several files with one write and one sync (group commit). With `compact` False
        the caller compacts (on a worker thread) once `wants_compaction` says so."""
        self.commit([{**entry, "op": "put"} for entry in entries], compact=compact)

    def commit(self, records: list[dict[str, Any]], *, compact: bool = True) -> None:
        """Append `put` and `done` records in this order with one write and one sync (group commit): a
        `done` here closes a record that must not replay (a pending file unlinked, or replaced by a
        rename), durably. A `done` of an id with no live record at its place in the order is left out
        (nothing to close); nothing left: no write, no sync."""
        live = set(self.pending)
        wanted = []
        for rec in records:
            if rec["op"] == "put":
                live.add(rec["id"])
            elif rec["id"] in live:
                live.discard(rec["id"])
            else:
                continue
            wanted.append(rec)
        if wanted:
            self._append(wanted, sync=True, compact=compact)

    def done(self, entry_id: str, *, compact: bool = True) -> None:
        """The file was stored (or kept in lost+found): nothing to replay for it. Not synced here: one
        small write, which the trio thread may do itself when `compact` is False (then it calls
        `compact` on a worker thread once `wants_compaction` says so)."""
        if entry_id in self.pending:
            self._append([{"op": "done", "id": entry_id}], sync=False, compact=compact)

    @property
    def wants_compaction(self) -> bool:
        return self._compaction_due()

    def compact_if_due(self) -> None:
        """`compact` once most records are dead, never raising: the records are durable whether or not
        the rewrite succeeds, so a failure (a disk with no room for the copy) is one warning line, the
        journal goes on as it is, and the rewrite is tried again after `_COMPACT_MIN` more records."""
        if not self._compaction_due():
            return
        try:
            self.compact()
        except OSError as e:
            if self._compact_retry_at is None:
                log.warning("write-back journal %s: not compacted (%s); records go on into it as it is, the "
                            "compaction is tried again later", self.path, e.strerror or e)
            self._compact_retry_at = self._written + _COMPACT_MIN
        else:
            if self._compact_retry_at is not None:
                log.info("write-back journal %s: compacted", self.path)
            self._compact_retry_at = None

    def compact(self) -> None:
        """Rewrite the journal with only its live records, atomically (rename over the old file). On an
        `OSError` before the rename the journal stays as it was (and the temporary copy goes)."""
        tmp = self.path.with_suffix(".compact")
        data = b"".join(frame(json.dumps(rec, separators=(",", ":")).encode()) for rec in self.pending.values())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path)
        # The new file is the journal from here on: switch to it before anything else can fail, or later
        # records would go into the replaced (unlinked) file.
        self.close()
        self._written = len(self.pending)
        self._end = self._size = len(data)
        self._open()
        dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
