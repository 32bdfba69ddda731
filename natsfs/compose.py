"""The one composition root: how the layers of a mount are built and started, for every user.

`build_filesystem` wires streams → `ObjectStore` → `Namespace` + `ChunkCache` + `Staging` → the
filesystem core → the FUSE adapter; `Built.start` starts their background work (the bucket watches and
bucket polls, readahead, kernel invalidations, streaming uploads, settling of unfinished puts) in one
trio nursery. `natsfs.mount` builds a mount's graph with it over a real server, the ops tests over
`MemoryStreams`, and the one-shot tools take their `ObjectStore` from `open_store`, so every caller gets
the same graph with the same settings.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import trio

from .adr20 import FileSender, ObjectStore
from .chunk_cache import ChunkCache
from .config import Config
from .core.filesystem import Filesystem
from .fs import Operations
from .journal import WriteBackJournal
from .kernel import KernelNotifier
from .namespace import Namespace
from .staging import Spool, Staging, restore_file
from .streams import Streams

log = logging.getLogger(__name__)
WRITE_BACK_JOURNAL = "writeback.journal"


def spool_root(cache_dir: Path, mountpoint: Path) -> Path:
    """Each mountpoint stages in its own directory, so mounts sharing a cache dir never mix spools."""
    return cache_dir / ("mnt" + str(mountpoint).replace("%", "%25").replace("/", "%2F"))


def open_write_back_journal(path: Path, write_back: bool) -> WriteBackJournal | None:
    """The write-back journal of a mount in write-back mode. Without write-back mode, uploads an
    earlier run left pending are not replayed: one log line, and their spool files go to lost+found
    with the other leftovers."""
    if write_back:
        return WriteBackJournal(path)
    if path.exists():
        left = WriteBackJournal(path)
        if left.pending:
            log.warning("%d file(s) closed in write-back mode by an earlier run of this mount were never "
                        "uploaded; without --write-back they are not replayed but kept in lost+found",
                        len(left.pending))
        unrestored: set[str] = set()
        for rec in left.pending.values():
            if "data" in rec:  # what the close made durable, whatever the unsynced spool file holds now
                spool_file = path.parent / "spool" / str(rec["id"])
                try:
                    restore_file(spool_file, base64.b64decode(rec["data"]))
                except OSError as e:  # a full local disk: the record keeps the bytes for a later mount
                    spool_file.unlink(missing_ok=True)
                    unrestored.add(str(rec["id"]))
                    log.error("%s/%s: closed in write-back mode by an earlier run, but its bytes cannot be restored "
                              "for lost+found (%s); the write-back journal keeps them for the next mount",
                              rec.get("bucket"), rec.get("name"), e.strerror or e)
        if unrestored:
            with contextlib.suppress(OSError):  # (if not: the next mount restores those again, a second copy)
                for entry_id in set(left.pending) - unrestored:
                    left.done(entry_id, compact=False)
            left.close()
            return None
        left.close()
        path.unlink()
    return None


def pending_write_backs(path: Path) -> frozenset[str]:
    """The spool files a write-back journal still waits to upload (left as they are, one log line)."""
    if not path.exists():
        return frozenset()
    left = WriteBackJournal(path)
    left.close()
    if left.pending:
        log.warning("%d file(s) closed in write-back mode are not uploaded yet; a read-only mount leaves them "
                    "for the next mount with --write-back", len(left.pending))
    return frozenset(left.pending)


def open_store(streams: Streams, config: Config | None = None, *, file_sender: FileSender | None = None
               ) -> ObjectStore:
    """The ADR-20 client over `streams`, with a mount's settings (or the defaults, for the tools)."""
    if config is None:
        return ObjectStore(streams)
    return ObjectStore(streams, chunk_size=config.chunk_size, file_sender=file_sender,
                       max_subject_bytes=config.max_subject_bytes, settle_timeout=3 * config.request_timeout,
                       max_meta_bytes=config.max_meta_bytes)


@dataclass
class Built:
    """One mount's object graph."""

    config: Config
    store: ObjectStore
    namespace: Namespace
    cache: ChunkCache
    staging: Staging
    fs: Filesystem
    ops: Operations

    async def start(self, nursery: trio.Nursery) -> None:
        """Start every background task of the mount in `nursery` (reads the bucket list first)."""
        await self.namespace.start(nursery)
        nursery.start_soon(self.store.follow_stream_updates)
        self.cache.start(nursery)
        if self.fs.writeback is not None:
            await self.fs.writeback.settle_moves()
        self.fs.start(nursery)


def build_filesystem(config: Config, streams: Streams, *, file_sender: FileSender | None = None,
                     kernel: KernelNotifier | None = None) -> Built:
    """Build (not start) the layers of a mount of `config` over `streams`. Spool files left by a daemon
    that died are moved to lost+found first (see `Spool.rescue_leftovers`), except, in write-back mode,
    those the write-back journal replays once the mount starts."""
    store = open_store(streams, config, file_sender=file_sender)
    namespace = Namespace(store, bucket=config.bucket, poll_interval=config.bucket_poll_interval,
                          reconcile_interval=config.reconcile_interval)
    cache = ChunkCache(store, cache_bytes=config.cache_size, batch_bytes=config.fetch_batch_bytes,
                       parallelism=config.fetch_parallelism, readahead_budget=config.readahead_budget,
                       request_timeout=config.request_timeout)
    root = spool_root(config.cache_dir, config.mountpoint.resolve())
    spool = Spool(root, config.spool_size)
    journal_path = root / WRITE_BACK_JOURNAL
    if config.read_only:
        # Nothing can be uploaded: pending write-back uploads wait for the next writable write-back mount.
        spool.rescue_leftovers(pending_write_backs(journal_path))
        journal = None
    else:
        journal = open_write_back_journal(journal_path, config.write_back is not None)
        spool.rescue_leftovers(frozenset(journal.pending) if journal is not None else frozenset())
    staging = Staging(spool)
    fs = Filesystem(namespace, cache, config, staging, kernel, journal)
    return Built(config, store, namespace, cache, staging, fs, Operations(fs))
