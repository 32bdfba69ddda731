"""The one composition root: how the layers of a mount are built and started, for every user.

`build_filesystem` wires streams → `ObjectStore` → `Namespace` + `ChunkCache` + `Staging` → the
filesystem core → the FUSE adapter; `Built.start` starts their background work (the bucket watches and
bucket polls, readahead, kernel invalidations, streaming uploads, settling of unfinished puts) in one
trio nursery. `natsfs.mount` builds a mount's graph with it over a real server, the ops tests over
`MemoryStreams`, and the one-shot tools take their `ObjectStore` from `open_store`, so every caller gets
the same graph with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trio

from .adr20 import FileSender, ObjectStore
from .chunk_cache import ChunkCache
from .config import Config
from .core.filesystem import Filesystem
from .fs import Operations
from .kernel import KernelNotifier
from .namespace import Namespace
from .staging import Spool, Staging
from .streams import Streams


def spool_root(cache_dir: Path, mountpoint: Path) -> Path:
    """Each mountpoint stages in its own directory, so mounts sharing a cache dir never mix spools."""
    return cache_dir / ("mnt" + str(mountpoint).replace("%", "%25").replace("/", "%2F"))


def open_store(streams: Streams, config: Config | None = None, *, file_sender: FileSender | None = None
               ) -> ObjectStore:
    """The ADR-20 client over `streams`, with a mount's settings (or the defaults, for the tools)."""
    if config is None:
        return ObjectStore(streams)
    return ObjectStore(streams, chunk_size=config.chunk_size, file_sender=file_sender,
                       max_subject_bytes=config.max_subject_bytes, settle_timeout=3 * config.request_timeout)


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
        self.cache.start(nursery)
        self.fs.start(nursery)


def build_filesystem(config: Config, streams: Streams, *, file_sender: FileSender | None = None,
                     kernel: KernelNotifier | None = None) -> Built:
    """Build (not start) the layers of a mount of `config` over `streams`. Spool files left by a daemon
    that died are moved to lost+found first (see `Spool.rescue_leftovers`)."""
    store = open_store(streams, config, file_sender=file_sender)
    namespace = Namespace(store, bucket=config.bucket)
    cache = ChunkCache(store, cache_bytes=config.cache_size, batch_bytes=config.fetch_batch_bytes,
                       parallelism=config.fetch_parallelism)
    spool = Spool(spool_root(config.cache_dir, config.mountpoint.resolve()), config.spool_size)
    spool.rescue_leftovers()
    staging = Staging(spool)
    fs = Filesystem(namespace, cache, config, staging, kernel)
    return Built(config, store, namespace, cache, staging, fs, Operations(fs))
