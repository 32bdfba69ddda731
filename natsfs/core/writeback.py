"""Write-back mode: closes made durable on local disk, and the background uploader that stores them.

`WriteBack` owns the mount's `WriteBackJournal` (see `natsfs.journal`) and the queue of staged files
waiting for their upload. `closed` is what a close (or fsync) does in write-back mode: the staged bytes
are copied in completely; a small file's bytes go into its journal record itself, a larger file's
spool file is fsynced first; then the record is appended and fsynced. Records of closes that arrive
while a sync runs are written and synced together by the next one (group commit: the first close to
find no sync running leads, the others wait for its result), so N concurrent closes cost far fewer
than N syncs (each sync runs on a worker thread: the trio thread never waits for the disk). The file joins the
queue. `run` starts queued uploads in the order of their latest close, once a burst of closes has
paused (`BURST_QUIET_S`; or its backlog is full), up to `UPLOADS_AT_ONCE` at a time (never two of one
name at once), through the core's ordinary upload (same conflict check, same put journal): a newer
close of a file that is still queued replaces its place (one upload for both). A replayed record whose
object the run that died had already stored (its `done` record lost) is recognised by the core (same
size and digest) and closed, not taken for a conflict. A server that does not answer postpones the
file with exponential backoff; a conflict with another client's newer version keeps the bytes in
lost+found (the core logs it); any other refusal (a full bucket, a sealed or missing bucket,
a name the bucket refuses) keeps the bytes in lost+found with one log line. Either way the journal
record is closed (`done`), once the bytes are in lost+found: if the local disk cannot take them (full),
they stay staged and the record stays open until the core's retry keeps them (`record_kept`), or the
next mount replays it. A pending file unlinked, or replaced by a rename, has its record closed by a
`done` in the group commit before the unlink or rename returns (`unlinked`): no replay brings it back.
`resume` turns the records an earlier run left into queued staged files before the mount serves (of
several records of one path, the latest only); `drain` is the wait of an unmount, with progress in
the log and in a small progress file that `natsfs umount` prints.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .. import futures, testpoints
from ..errors import Conflict, NatsFSError, NotKept, Unavailable
from ..journal import WriteBackJournal
from ..mutations import is_attempt_of
from ..staging import StagedFile, WriteState

if TYPE_CHECKING:
    from .filesystem import Filesystem

log = logging.getLogger(__name__)

# Backoff between attempts of an upload the server did not answer: doubling from the first to the last.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
PROGRESS_FILE = "writeback.progress"
# Files up to this size are made durable by their journal record alone (their bytes inside it).
INLINE_BYTES = 64 * 1024
# Uploads running at once (each waits for the server most of its time).
UPLOADS_AT_ONCE = 8
# A burst of closes (tar -x, git checkout) is not slowed by uploads competing with it for the daemon's
# thread: uploads start once no close has come for this long, or once this many files wait (each holds
# a spool descriptor; at most a quarter of the descriptor limit), or once the spool is half full.
BURST_QUIET_S = 0.05
BURST_BACKLOG_FILES = 4096
# Empty spool files kept created ahead on a worker thread, so the creates of a burst do not wait for the
# filesystem (refilled when half are used).
SPOOL_AHEAD = 64


class _Synced:
    """A close waiting for the group commit that makes its record durable."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.error: OSError | None = None


class WriteBack:
    def __init__(self, fs: Filesystem, journal: WriteBackJournal, delay: float, progress_dir: Path):
        self.fs = fs
        self.journal = journal
        self.delay = delay
        self.progress_path = progress_dir / PROGRESS_FILE
        # Staged files waiting for their upload, by journal id, in order of their latest close, with the
        # trio time their next attempt may start; `_due` orders them by that time (entries replaced by a
        # newer close stay in it until popped: their sequence number no longer matches).
        self._queue: dict[str, tuple[StagedFile, float, int]] = {}
        self._due: list[tuple[float, int, str]] = []
        self._blocked: list[tuple[float, int, str]] = []  # due, but their name is being uploaded
        self._seq = 0
        self._last_close = -math.inf
        self._draining = False
        self._burst_backlog = min(BURST_BACKLOG_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
        self._attempts: dict[str, int] = {}
        self._running: dict[str, StagedFile] = {}  # uploads in progress, by journal id
        self._journal_lock = trio.Lock()  # held for `done` records (and compactions they start)
        # Group commit: records waiting for the next sync, each with the event its close waits on and
        # the error that sync raised (None: durable).
        self._to_sync: list[tuple[dict[str, Any], _Synced]] = []
        self._syncing = False
        self._wake = trio.Event()
        self._spool_used = trio.Event()  # set by closes: `_spool_ahead` checks its stock
        self._creating_ahead = trio.Lock()  # held while spool files are created ahead (unmount waits)
        self._changed = trio.Event()  # set whenever an upload ends (drain waits on it)
        # The unmount's wait for the queue (`drain`), and why it was cut short before its timeout.
        self._drain_wait: trio.CancelScope | None = None
        self._drain_cut: str | None = None
        # fsyncs of spool files and of the journal, journal records written, uploads done (for the stats).
        self.counters = {"spool_fsyncs": 0, "journal_fsyncs": 0, "records": 0, "uploads": 0}
        # The last file moved to memory, whose spool file goes at the next close (`_to_memory`).
        self._spool_file_to_drop: StagedFile | None = None

    # ------------------------------------------------------------------ closes
    async def closed(self, sf: StagedFile, *, replaced: Sequence[StagedFile] = ()) -> None:
        """A close (or fsync) in write-back mode: returns once the bytes and their journal record are
        durable on local disk; the upload follows in the background. `replaced`: pending files a rename
        of `sf` just replaced (see `unlinked`), their records closed in the same sync, before its own."""
        entry: dict[str, Any] | None = None
        if sf.state is WriteState.UPLOADING:
            # The uploader is storing it (holding its lock for the whole put): its bytes cannot change
            # meanwhile and were made durable with the record that queued this upload. The record is
            # written again (a rename changes its name), with the bytes again if it carried them.
            entry = sf.journal_entry(sf.read_all() if sf.size <= INLINE_BYTES else None)
        else:
            async with sf.lock:
                if sf.unstored:
                    await self.fs.fill_staged(sf)
                    if sf.size <= INLINE_BYTES:
                        entry = sf.journal_entry(sf.read_all())
                    else:
                        await trio.to_thread.run_sync(os.fsync, sf.fd)
                        self.counters["spool_fsyncs"] += 1
                        entry = sf.journal_entry()
        if entry is None:
            await self.unlinked(replaced)
            return
        await self._record([*self._done_records(replaced), {**entry, "op": "put"}])
        self._settle_unlinked(replaced)
        if "data" in entry:
            self._to_memory(sf)
        self._last_close = trio.current_time()
        self._spool_used.set()
        self.schedule(sf, self.delay)

    def _to_memory(self, sf: StagedFile) -> None:
        """A small file's synced record holds its bytes: its spool file goes (see `StagedFile.to_memory`),
        one close later (the last record is the only one a crash can tear, and then its spool file is
        what `rescue_leftovers` keeps). Skipped while an upload or a write holds the file."""
        if sf.state is WriteState.UPLOADING or sf.lock.locked():
            return
        previous, self._spool_file_to_drop = self._spool_file_to_drop, None
        if previous is not None:
            previous.drop_spool_file()
        try:
            if sf.to_memory(INLINE_BYTES):
                self._spool_file_to_drop = sf
        except OSError as e:  # (no memory file: it stays in its spool file)
            log.debug("%s/%s: staged bytes not moved to memory: %s", sf.bucket, sf.name, e)

    async def unlinked(self, files: Sequence[StagedFile]) -> None:
        """Pending files (closed, not uploaded yet) unlinked, or replaced by a rename: their journal
        records are closed (`done`) and that is synced before this returns (group commit), so that no
        replay after a crash brings back what a program saw removed, nor puts an older version over a
        newer one. Then they leave the queue, and their staged bytes go unless a handle holds them
        open. `OSError` if the journal could not be written or synced (the records stay open)."""
        records = self._done_records(files)
        if records:
            await self._record(records)
        self._settle_unlinked(files)

    def _done_records(self, files: Sequence[StagedFile]) -> list[dict[str, Any]]:
        """`done` records for those of `files` that may have a live record: one in the journal, or one
        in a sync under way (the journal leaves out a `done` that finds none, see `WriteBackJournal.commit`)."""
        return [{"op": "done", "id": sf.entry_id} for sf in files
                if sf.entry_id in self.journal.pending or self._syncing]

    def _settle_unlinked(self, files: Sequence[StagedFile]) -> None:
        """Queued files unlinked: nothing to upload (their entries in `_due` are skipped when popped)."""
        for sf in files:
            if self._queue.pop(sf.entry_id, None) is not None:
                self._attempts.pop(sf.entry_id, None)
                if sf.entry_id not in self._running:  # (an upload ending settles it itself)
                    self.fs.upload_settled(sf)

    async def _record(self, records: list[dict[str, Any]]) -> None:
        """Append `records` (`put` and `done`) to the journal, in this order, and return once they are
        synced (group commit, see the module docstring); `OSError` if the write or the sync failed."""
        synced = _Synced()
        self._to_sync.extend((record, synced) for record in records)
        if not self._syncing:
            self._syncing = True
            try:
                # Shielded: the closes waiting on this leader must get their answer even if its own
                # request is interrupted.
                with trio.CancelScope(shield=True):
                    while self._to_sync:
                        batch, self._to_sync = self._to_sync, []
                        error: OSError | None = None
                        try:
                            async with self._journal_lock:
                                await self._sync_records([e for e, _ in batch])
                        except OSError as e:
                            error = e
                        self.counters["records"] += len(batch)
                        self.counters["journal_fsyncs"] += 1
                        for _, waiter in batch:
                            waiter.error = error
                            waiter.event.set()
            finally:
                self._syncing = False
        await synced.event.wait()
        if synced.error is not None:
            raise synced.error

    async def _sync_records(self, records: list[dict[str, Any]]) -> None:
        """`WriteBackJournal.commit` on a worker thread: the trio loop never waits for the disk, however
        slow it is (a sync of a few KiB written in place takes 0.2-4 ms on the test machine, as busy as
        its disk is; the thread's round trip about 0.07 ms more, see `futures.run_on_thread`)."""
        await futures.run_on_thread(lambda: self.journal.commit(records))

    def schedule(self, sf: StagedFile, delay: float) -> None:
        self._queue.pop(sf.entry_id, None)  # a newer close takes the place of a queued one
        self._seq += 1
        due = trio.current_time() + delay
        self._queue[sf.entry_id] = (sf, due, self._seq)
        heapq.heappush(self._due, (due, self._seq, sf.entry_id))
        self._wake.set()

    def queued(self, sf: StagedFile) -> bool:
        return sf.entry_id in self._queue or self._running.get(sf.entry_id) is sf

    @property
    def pending(self) -> list[StagedFile]:
        running = [sf for key, sf in self._running.items() if key not in self._queue]
        return [*(sf for sf, _, _ in self._queue.values()), *running]

    async def moving(self, records: list[dict[str, Any]]) -> None:
        """A rename is about to change the bucket for these pending files (their
        records, each with `moving_to`: the name it gets): durable before the rename publishes anything,
        so that a replay after a crash in the middle knows where the file went (`settle_moves`). The
        rename's own records (under the new names) follow once it is done; a rename that fails writes the
        records as they were again. `OSError` as `_record`."""
        await self._record(records)

    async def settle_moves(self) -> None:
        """Before `resume`: records an earlier run left with `removed_by` (`_settle_removals`), and those
        with `moving_to` (it died while the rename of the
        pending file ran, before the record under the new name was synced). The rename reached the
        bucket when the new name holds the file's stored version (its nuid): the record moves there,
        based on that meta; otherwise it stays under its old name. Without it the replay put the bytes
        a close had acknowledged under the old name, where the rename's claim refused them as another
        client's change (lost+found), and the new name kept the older stored version."""
        moving = [entry for entry in self.journal.pending.values() if entry.get("moving_to")]
        settled, closed = await self._settle_removals()
        for entry in moving:
            bucket, new, base = str(entry["bucket"]), str(entry["moving_to"]), entry.get("base")
            replaces, target = entry.get("replaces"), entry.get("moving_replaces")
            try:
                if base is not None:
                    # The rename moved the stored version: the new name holds its nuid.
                    got = await self.fs.mut.store.get_meta_doc(bucket, new)
                    moved = got is not None and not got[0].get("deleted") and got[0].get("nuid") == base["nuid"]
                else:
                    # The rename deleted the object the file was to replace under its old name.
                    got = await self.fs.mut.store.get_meta_doc(bucket, str(entry["name"]))
                    moved = replaces is not None and (got is None or got[1] != replaces["revision"])
            except NatsFSError as e:  # (left as it is: the next mount settles it)
                log.warning("%s/%s: cannot tell whether its rename to %s was stored (%s); replayed under its "
                            "old name", bucket, entry["name"], new, e)
                continue
            entry = {k: v for k, v in entry.items() if k not in ("moving_to", "moving_replaces", "replaces")}
            if replaces is not None and not moved:
                entry["replaces"] = replaces
            if moved:
                log.info("%s/%s: renamed to %s when an earlier run died; replayed under the new name", bucket,
                         entry["name"], new)
                if base is not None and got is not None:
                    entry |= {"base": {**base, "revision": got[1]}, "base_revision": got[1]}
                    await self._finish_claim(bucket, str(entry["name"]), new, str(base["nuid"]))
                elif target is not None:
                    entry["replaces"] = target
                entry["name"] = new
            settled.append(entry)
        if settled or closed:
            records = [{**entry, "op": "put"} for entry in settled] + [{"op": "done", "id": i} for i in closed]
            await futures.run_on_thread(lambda: self.journal.commit(records))
        for entry_id in closed:
            (self.fs.staging.spool.dir / entry_id).unlink(missing_ok=True)

    async def _finish_claim(self, bucket: str, old: str, new: str, nuid: str) -> None:
        """The rename of a pending rewrite moved its stored version to `new`; if it was cut before its
        claim of `old` (both names hold that version), the claim is published now: else the old name
        kept the version the file's acknowledged close had replaced, beside the new name. A claim that
        cannot be published leaves both names (one info line; nothing is lost: the replayed upload
        purges no chunk another live name holds)."""
        try:
            if await self.fs.mut.finish_claim(bucket, old, nuid):
                log.info("%s/%s: its rename to %s was cut short when an earlier run died; finished (the old "
                         "name is claimed now)", bucket, old, new)
        except NatsFSError as e:
            log.info("%s/%s: its rename to %s may have been cut short when an earlier run died; the old name "
                     "is left as it is (%s)", bucket, old, new, e)

    async def _settle_removals(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Records an earlier run left with `removed_by` (it died while an unlink of the pending file, or a
        rename over it, ran, before its `done` record was synced): when the name's meta in the bucket is
        the one that call published (its `Nats-Msg-Id`), the call reached the bucket and the record is
        closed (returned second: nothing to replay, nothing to keep in lost+found); otherwise it is
        replayed as any record (returned first, without the field): another client's change of the name
        meanwhile is a conflict as ever, its bytes kept in lost+found. Without it the replay took the
        run's own tombstone, or the meta the rename put there, for another client's change: the bytes of
        a file the program had removed landed in lost+found with a warning that another client changed it."""
        settled: list[dict[str, Any]] = []
        closed: list[str] = []
        for entry in [e for e in self.journal.pending.values() if e.get("removed_by")]:
            bucket, name = str(entry["bucket"]), str(entry["name"])
            try:
                got = await self.fs.mut.store.meta_msg_id(bucket, name)
            except NatsFSError as e:  # (replayed as it is: a conflict keeps its bytes in lost+found)
                log.warning("%s/%s: cannot tell whether its unlink (or a rename over it) was stored when an "
                            "earlier run died (%s); replayed", bucket, name, e)
                continue
            if is_attempt_of(got, str(entry["removed_by"])):
                log.info("%s/%s: unlinked or renamed over when an earlier run died; not replayed", bucket, name)
                closed.append(str(entry["id"]))
            else:
                settled.append({k: v for k, v in entry.items() if k != "removed_by"})
        return settled, closed

    # ------------------------------------------------------------------ replay
    def resume(self) -> None:
        """Queue every upload an earlier run of this mount left in the journal (before serving)."""
        self.progress_path.unlink(missing_ok=True)
        if not self.journal.pending:
            return
        resumed = 0
        entries = [(entry, self.fs.ns.mount_path(str(entry["bucket"]), tuple(str(entry["name"]).split("/"))))
                   for entry in self.journal.pending.values()]
        # Several live records of one path (a journal of a version that left the record of a pending file
        # open when it was unlinked or replaced by a rename): the latest one, in journal order, is what the
        # program saw last; the older ones are closed without an upload, and their spool files go.
        latest = {(entry["bucket"], path): entry["id"] for entry, path in entries}
        for entry, path in entries:
            bucket, name = str(entry["bucket"]), str(entry["name"])
            spool_file = self.fs.staging.spool.dir / str(entry["id"])
            if latest[bucket, path] != entry["id"]:
                log.info("%s/%s: an older write-back record, replaced by a later one of the same name, is "
                         "not replayed", bucket, name)
                self.journal.done(str(entry["id"]))
                spool_file.unlink(missing_ok=True)
                continue
            if "data" not in entry and not spool_file.is_file():
                log.error("write-back journal: the spool file of %s/%s is missing; nothing to upload", bucket, name)
                self.journal.done(str(entry["id"]))
                continue
            ino = self.fs.inodes.ino_for(path)
            try:
                sf = StagedFile.resume(self.fs.staging.spool, entry, ino=ino, path=path)
            except OSError as e:  # a full local disk cannot take the spool file its record restores
                if "data" in entry:
                    spool_file.unlink(missing_ok=True)  # (partial; the record holds the bytes)
                log.error("%s/%s: closed in write-back mode by an earlier run, but its staged bytes cannot be "
                          "restored (%s); its record stays in the journal for the next mount", bucket, name,
                          e.strerror or e)
                continue
            if self.fs.ns.single_bucket not in (None, bucket):
                # Not reachable through this mount (another --bucket).
                kept = self.fs.keep_staged(sf)
                if kept is None:
                    continue  # (logged) its record stays open until a retry keeps it (`record_kept`)
                self.journal.done(sf.entry_id)
                log.warning("%s/%s: closed in write-back mode by an earlier run but not reachable through "
                            "this mount; its bytes are kept at %s", bucket, name, kept)
                continue
            self.fs.staging.add(sf)
            self.schedule(sf, 0.0)
            resumed += 1
        if resumed:
            log.warning("write-back: %d file(s) closed by an earlier run of this mount but not uploaded yet "
                        "(%d bytes); uploading them now", resumed, sum(sf.size for sf in self.pending))

    # ------------------------------------------------------------------ the uploader
    async def run(self) -> None:
        """Upload queued files, each once its time has come and no burst of closes is under way, up to
        `UPLOADS_AT_ONCE` at a time."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._spool_ahead)
            while True:
                now = trio.current_time()
                quiet_at = self._burst_ends_at(now)
                free = len(self._running) < UPLOADS_AT_ONCE
                ready = self._next_ready(now) if free and quiet_at <= now else None
                if ready is None:
                    # (a file due now but blocked by a running upload waits for that one to end: `_wake`)
                    next_due = self._due[0][0] if self._due and free else math.inf
                    if quiet_at > now:
                        next_due = max(next_due, quiet_at)
                    self._wake = trio.Event()
                    with trio.move_on_at(next_due):
                        await self._wake.wait()
                    continue
                del self._queue[ready.entry_id]
                self._running[ready.entry_id] = ready
                nursery.start_soon(self._run_one, ready)

    async def _spool_ahead(self) -> None:
        """Keep `SPOOL_AHEAD` empty spool files ready while files are being closed (see `Spool.create_ahead`)."""
        spool = self.fs.staging.spool
        while True:
            await self._spool_used.wait()
            self._spool_used = trio.Event()
            # (Only once spool files are used: new small files are born in memory and need none.)
            if spool.taken and spool.ready < SPOOL_AHEAD // 2 and not self._draining:
                async with self._creating_ahead:
                    try:
                        made = await trio.to_thread.run_sync(spool.create_ahead, SPOOL_AHEAD - spool.ready)
                    except OSError as e:  # creates fall back to making their own (and report it themselves)
                        log.debug("spool files not created ahead: %s", e)
                        continue
                    spool.add_ready(made)
                    if self._draining:
                        spool.drop_ready()

    def _burst_ends_at(self, now: float) -> float:
        """When uploads may start: at once, or once the closes coming in have paused (see
        `BURST_QUIET_S`); never later than the backlog or the spool allows."""
        if (self._draining or len(self._queue) >= self._burst_backlog
                or self.fs.staging.spool.used * 2 >= self.fs.staging.spool.limit):
            return now
        return self._last_close + BURST_QUIET_S

    def _next_ready(self, now: float) -> StagedFile | None:
        """The queued file to upload next: due, not being uploaded, and no upload of its name running
        (two versions of one name are stored in the order of their closes). Due files set aside because
        their name was busy go back in line when an upload ends (`_run_one`)."""
        busy = {(sf.bucket, sf.name) for sf in self._running.values()}
        while self._due and self._due[0][0] <= now:
            entry = heapq.heappop(self._due)
            queued = self._queue.get(entry[2])
            if queued is None or queued[2] != entry[1]:
                continue  # replaced by a newer close, or started already
            sf = queued[0]
            if entry[2] in self._running or (sf.bucket, sf.name) in busy:
                self._blocked.append(entry)
                continue
            return sf
        return None

    async def _run_one(self, sf: StagedFile) -> None:
        try:
            await self._upload(sf)
        finally:
            del self._running[sf.entry_id]
            for entry in self._blocked:
                heapq.heappush(self._due, entry)
            self._blocked.clear()
            self.counters["uploads"] += 1
            self._wake.set()
            self._changed.set()
            self._changed = trio.Event()

    async def _upload(self, sf: StagedFile) -> None:
        key = sf.entry_id
        if sf.unkept:
            return  # queued again by a close during its refused upload: held for lost+found, record open
        if sf.unstored:
            limit = self.fs.config.flush_timeout + sf.size / self.fs.config.flush_rate_floor
            try:
                with trio.fail_after(limit), sf.interruptible_upload() as interrupt:
                    await self.fs.store_staged(sf)
                if interrupt.cancelled_caught:
                    # A write went on instead of waiting for this attempt (the server away, or not
                    # answering within `CHANGE_WAIT_MAX_S`: `Filesystem._changing`, which logs it): the
                    # file is DIRTY and its record open; its next close queues it again.
                    return
            except Conflict:
                pass  # kept in lost+found, one log line (the core's conflict path)
            except NotKept:
                self._attempts.pop(key, None)
                return  # a conflict the local disk could not keep (logged): the record stays open meanwhile
            except (Unavailable, trio.TooSlowError) as e:
                attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
                delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1))
                log.log(logging.WARNING if attempt == 1 else logging.DEBUG,
                        "%s/%s: write-back upload postponed (%s); retrying with backoff (up to %g s apart)",
                        sf.bucket, sf.name, str(e) or "no answer in time", BACKOFF_MAX_S)
                if key not in self._queue:  # (closed again meanwhile: queued already)
                    self.schedule(sf, delay)
                return
            except NatsFSError as e:
                kept = self.fs.keep_staged(sf)
                if kept is None:
                    self._attempts.pop(key, None)
                    return  # (logged) held until a retry keeps it; its record stays open meanwhile
                log.warning("%s/%s: not stored by the write-back uploader (%s); its bytes are kept at %s",
                            sf.bucket, sf.name, e, kept)
            if sf.unstored:
                return  # written again during the upload: its next close queues it again
        if self._attempts.pop(key, None):
            log.info("%s/%s: stored after the server answered again", sf.bucket, sf.name)
        if testpoints.ACTIVE:
            await testpoints.pause("upload.stored")
        await self._close_record(sf)
        if key not in self._queue:
            self.fs.upload_settled(sf)

    async def record_kept(self, sf: StagedFile) -> None:
        """A refused upload that the local disk could not keep at first is in lost+found now (the core's
        retry): its record is closed."""
        await self._close_record(sf)

    async def _close_record(self, sf: StagedFile) -> None:
        async with self._journal_lock:
            try:
                self.journal.done(sf.entry_id, compact=False)
            except OSError as e:  # the record stays live: the next mount finds the object stored (see resume)
                log.warning("write-back journal: the end of %s/%s's upload could not be recorded (%s)", sf.bucket,
                            sf.name, e)
            if self.journal.wants_compaction:
                await trio.to_thread.run_sync(self.journal.compact_if_due)  # (never raises: logs a failure)

    # ------------------------------------------------------------------ unmount
    async def drain(self, timeout: float) -> None:
        """Unmounting: wait (at most `timeout`) until the queue is empty, logging progress and writing it
        to the progress file. Files still waiting after that stay in the spool and the journal: the next
        mount with the same cache dir uploads them."""
        for sf in self.fs.staging.all():
            if sf.unstored and not self.queued(sf):
                try:
                    await self.closed(sf)  # a writer still open: its bytes are kept like a close's
                except OSError as e:
                    log.error("%s/%s: could not make the staged bytes durable at unmount: %s", sf.bucket,
                              sf.name, e)
        self._draining = True  # no more waiting for a burst to end
        async with self._creating_ahead:  # a batch being created ahead lands first, then goes
            self.fs.staging.spool.drop_ready()
        for sf, _, _ in list(self._queue.values()):
            self.schedule(sf, 0.0)  # no more waiting for --write-back's delay
        total = len(self.pending)
        if total:
            log.info("unmounting: waiting for %d write-back upload(s) (%d bytes), for at most %g s", total,
                     sum(sf.size for sf in self.pending), timeout)
        with trio.move_on_after(timeout) as self._drain_wait:
            if self._drain_cut is not None:
                self._drain_wait.cancel()
            while self.pending:
                self._progress(total)
                await self._changed.wait()
                log.info("unmounting: %d of %d write-back upload(s) done", total - len(self.pending), total)
        self._drain_wait = None
        left = self.pending
        if total:
            # The last line `natsfs umount` prints (removed at the next mount).
            self._progress(total, final=True)
        if left:
            log.warning("unmounting: %d write-back upload(s) not done%s (%s); their bytes stay in %s "
                        "and the next mount with this cache dir uploads them", len(left),
                        f" after {timeout:g} s" if self._drain_cut is None else f", {self._drain_cut}",
                        ", ".join(f"{sf.bucket}/{sf.name}" for sf in left[:5]), self.fs.staging.spool.dir)

    def cut_drain_short(self, why: str) -> None:
        """Stop the unmount's wait for the queue now (or before it starts): what is still queued stays in
        the spool and the journal, as after the timeout; `why` says so in the warning line."""
        self._drain_cut = why
        if self._drain_wait is not None:
            self._drain_wait.cancel()

    def _progress(self, total: int, *, final: bool = False) -> None:
        pending = self.pending
        text = f"{total - len(pending)} of {total} write-back upload(s) done"
        if final and pending:
            text += (f"; {len(pending)} not uploaded ({sum(sf.size for sf in pending)} bytes): they stay in the "
                     "write-back journal and the next mount with this cache dir and --write-back uploads them")
        elif pending:
            text += f", {sum(sf.size for sf in pending)} bytes pending"
        text += "\n"
        try:
            tmp = self.progress_path.with_suffix(".new")
            tmp.write_text(text)
            os.replace(tmp, self.progress_path)
        except OSError as e:
            log.debug("write-back progress not written: %s", e)
