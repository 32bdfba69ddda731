"""Write-back mode: closes made durable on local disk, and the background uploader that stores them.

`WriteBack` owns the mount's `WriteBackJournal` (see `natsfs.journal`) and the queue of staged files
waiting for their upload. `closed` is what a close (or fsync) does in write-back mode: the staged bytes
are copied in completely, the spool file is fsynced, then one journal record is appended and fsynced;
the file joins the queue. `run` uploads queued files one at a time in the order of their latest
close, through the core's ordinary upload (same conflict check, same put journal): a newer close of a
file that is still queued replaces its place (one upload for both). A server that does not answer
postpones the file with exponential backoff; a conflict with another client's newer version keeps the
bytes in lost+found (the core logs it); any other refusal (a full bucket, a sealed or missing bucket,
a name the bucket refuses) keeps the bytes in lost+found with one log line. Either way the journal
record is closed (`done`). `resume` turns the records an earlier run left into queued staged files
before the mount serves; `drain` is the wait of an unmount, with progress in the log and in a small
progress file that `natsfs umount` prints.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ..errors import Conflict, NatsFSError, Unavailable
from ..journal import WriteBackJournal
from ..staging import StagedFile, WriteState

if TYPE_CHECKING:
    from .filesystem import Filesystem

log = logging.getLogger(__name__)

# Backoff between attempts of an upload the server did not answer: doubling from the first to the last.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
PROGRESS_FILE = "writeback.progress"


class WriteBack:
    def __init__(self, fs: Filesystem, journal: WriteBackJournal, delay: float, progress_dir: Path):
        self.fs = fs
        self.journal = journal
        self.delay = delay
        self.progress_path = progress_dir / PROGRESS_FILE
        # Staged files waiting for their upload, by journal id, in order of their latest close, with the
        # trio time their next attempt may start.
        self._queue: dict[str, tuple[StagedFile, float]] = {}
        self._attempts: dict[str, int] = {}
        self._running: StagedFile | None = None
        self._journal_lock = trio.Lock()
        self._wake = trio.Event()
        self._changed = trio.Event()  # set whenever an upload ends (drain waits on it)
        # fsyncs of spool files and of the journal, journal records written, uploads done (for the stats).
        self.counters = {"spool_fsyncs": 0, "journal_fsyncs": 0, "records": 0, "uploads": 0}

    # ------------------------------------------------------------------ closes
    async def closed(self, sf: StagedFile) -> None:
        """A close (or fsync) in write-back mode: returns once the bytes and their journal record are
        durable on local disk; the upload follows in the background."""
        if sf.state is WriteState.UPLOADING:
            # The uploader is storing it (holding its lock for the whole put): its bytes cannot change
            # meanwhile and were synced before the record that queued this upload. Only the record is
            # written again (a rename changes its name).
            entry = sf.journal_entry()
        else:
            async with sf.lock:
                if not sf.unstored:
                    return
                await self.fs.fill_staged(sf)
                await trio.to_thread.run_sync(os.fsync, sf.fd)
                self.counters["spool_fsyncs"] += 1
                entry = sf.journal_entry()
        async with self._journal_lock:
            await trio.to_thread.run_sync(self.journal.record, entry)
            self.counters["records"] += 1
            self.counters["journal_fsyncs"] += 1
        self.schedule(sf, self.delay)

    def schedule(self, sf: StagedFile, delay: float) -> None:
        self._queue.pop(sf.entry_id, None)  # a newer close takes the place of a queued one
        self._queue[sf.entry_id] = (sf, trio.current_time() + delay)
        self._wake.set()

    def queued(self, sf: StagedFile) -> bool:
        return sf.entry_id in self._queue or self._running is sf

    @property
    def pending(self) -> list[StagedFile]:
        files = [sf for sf, _ in self._queue.values()]
        return [*files, self._running] if self._running is not None else files

    # ------------------------------------------------------------------ replay
    def resume(self) -> None:
        """Queue every upload an earlier run of this mount left in the journal (before serving)."""
        self.progress_path.unlink(missing_ok=True)
        if not self.journal.pending:
            return
        resumed = 0
        for entry in list(self.journal.pending.values()):
            bucket, name = str(entry["bucket"]), str(entry["name"])
            path = self.fs.ns.mount_path(bucket, tuple(name.split("/")))
            spool_file = self.fs.staging.spool.dir / str(entry["id"])
            if not spool_file.is_file():
                log.error("write-back journal: the spool file of %s/%s is missing; nothing to upload", bucket, name)
                self.journal.done(str(entry["id"]))
                continue
            ino = self.fs.inodes.ino_for(path)
            sf = StagedFile.resume(self.fs.staging.spool, entry, ino=ino, path=path)
            if self.fs.ns.single_bucket not in (None, bucket) or self.fs.staging.get(ino) is not None:
                # Not reachable through this mount (another --bucket), or a second record for one path.
                kept = sf.keep()
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
        """Upload queued files one at a time, each once its time has come."""
        while True:
            now = trio.current_time()
            ready = next((sf for sf, due in self._queue.values() if due <= now), None)
            if ready is None:
                next_due = min((due for _, due in self._queue.values()), default=math.inf)
                self._wake = trio.Event()
                with trio.move_on_at(next_due):
                    await self._wake.wait()
                continue
            del self._queue[ready.entry_id]
            self._running = ready
            try:
                await self._upload(ready)
            finally:
                self._running = None
                self._changed.set()
                self._changed = trio.Event()

    async def _upload(self, sf: StagedFile) -> None:
        key = sf.entry_id
        if sf.unstored:
            limit = self.fs.config.flush_timeout + sf.size / self.fs.config.flush_rate_floor
            try:
                with trio.fail_after(limit):
                    await self.fs.store_staged(sf)
            except Conflict:
                pass  # kept in lost+found, one log line (the core's conflict path)
            except (Unavailable, trio.TooSlowError) as e:
                attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
                delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1))
                log.log(logging.WARNING if attempt == 1 else logging.DEBUG,
                        "%s/%s: write-back upload postponed (%s); retrying with backoff (up to %g s apart)",
                        sf.bucket, sf.name, e or "no answer in time", BACKOFF_MAX_S)
                if key not in self._queue:  # (closed again meanwhile: queued already)
                    self.schedule(sf, delay)
                return
            except NatsFSError as e:
                kept = self.fs.keep_staged(sf)
                log.warning("%s/%s: not stored by the write-back uploader (%s); its bytes are kept at %s",
                            sf.bucket, sf.name, e, kept)
            if sf.unstored:
                return  # written again during the upload: its next close queues it again
        if self._attempts.pop(key, None):
            log.info("%s/%s: stored after the server answered again", sf.bucket, sf.name)
        async with self._journal_lock:
            await trio.to_thread.run_sync(self.journal.done, key)
        if key not in self._queue:
            self.fs.upload_settled(sf)

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
        for sf, _ in list(self._queue.values()):
            self.schedule(sf, 0.0)  # no more waiting for --write-back's delay
        total = len(self.pending)
        if total:
            log.info("unmounting: waiting for %d write-back upload(s) (%d bytes), for at most %g s", total,
                     sum(sf.size for sf in self.pending), timeout)
        with trio.move_on_after(timeout):
            while self.pending:
                self._progress(total)
                await self._changed.wait()
                log.info("unmounting: %d of %d write-back upload(s) done", total - len(self.pending), total)
        left = self.pending
        if total:
            self._progress(total)  # the last line `natsfs umount` prints (removed at the next mount)
        if left:
            log.warning("unmounting: %d write-back upload(s) not done after %g s (%s); their bytes stay in %s "
                        "and the next mount with this cache dir uploads them", len(left), timeout,
                        ", ".join(f"{sf.bucket}/{sf.name}" for sf in left[:5]), self.fs.staging.spool.dir)

    def _progress(self, total: int) -> None:
        pending = self.pending
        text = (f"{total - len(pending)} of {total} write-back upload(s) done, "
                f"{sum(sf.size for sf in pending)} bytes pending\n")
        try:
            tmp = self.progress_path.with_suffix(".new")
            tmp.write_text(text)
            os.replace(tmp, self.progress_path)
        except OSError as e:
            log.debug("write-back progress not written: %s", e)
