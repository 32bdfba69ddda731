"""The mount's tree: buckets at the root (or one bucket as the root), each bucket's live index.

`Namespace` turns a mount-relative path into a `Node` and lists directories, always from memory
once a bucket's index is loaded. A bucket's index is loaded on first use and then kept current by a
`natsfs.watcher.BucketWatcher` (an ordered consumer on the bucket's metas, plus the checks for what a
consumer never delivers). The set of buckets is refreshed by polling the stream list every
`poll_interval` seconds (and on every listing of the root); a bucket that vanished from the list is
confirmed gone before its directory is dropped and its watch stopped.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from .adr20 import ObjectInfo, ObjectStore, valid_bucket_name
from .config import Config
from .errors import DetachedPath, NatsFSError, NotADirectory, NotFound
from .index import BucketIndex, Dir
from .inodes import DETACHED
from .watcher import BucketWatcher, summary

log = logging.getLogger(__name__)

Path = tuple[str, ...]



class NodeKind(enum.StrEnum):
    ROOT = "root"  # the mount's root: all buckets, or the one bucket mounted
    BUCKET = "bucket"  # a bucket's directory at the root of an all-buckets mount
    DIR = "dir"  # a directory inside a bucket (a marker object, or names below it)
    FILE = "file"  # an object
    LINK = "link"  # an ADR-20 link or an empty object with natsfs.symlink text, shown as a symlink


ROOT, BUCKET, DIR, FILE, LINK = NodeKind.ROOT, NodeKind.BUCKET, NodeKind.DIR, NodeKind.FILE, NodeKind.LINK


@dataclass(slots=True)
class Node:
    kind: NodeKind
    bucket: str | None = None
    rel: Path = ()
    dir: Dir | None = None
    info: ObjectInfo | None = None
    mtime_ns: int | None = None  # None: not known (the mount's start time shows); 0 is the epoch


class Namespace:
    def __init__(self, store: ObjectStore, *, bucket: str | None = None,
                 poll_interval: float = Config.bucket_poll_interval,
                 reconcile_interval: float = Config.reconcile_interval):
        self.store = store
        self.single_bucket = bucket
        self.poll_interval = poll_interval
        self.reconcile_interval = reconcile_interval
        self.started_ns = time.time_ns()
        self._buckets: dict[str, BucketWatcher] = {}
        self._bucket_names: set[str] = set()
        self._nursery: trio.Nursery | None = None
        # Called with (bucket, path inside bucket) of every entry that changed, and with
        # (bucket, None) when a bucket appeared or disappeared.
        self.on_change: Callable[[str, Path | None], None] | None = None
        # Called with (bucket, when it was asked (time.monotonic()), sealed) whenever a bucket's watcher
        # read its stream's sealed state (at the watch's start and at each reconciliation).
        self.on_sealed: Callable[[str, float, bool], None] | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.single_bucket is not None:
            await self.index(self.single_bucket)
        else:
            await self.refresh_buckets()
            nursery.start_soon(self._poll_buckets)

    def stats(self) -> dict[str, Any]:
        """Counters of the bucket watchers (for the stats xattr)."""
        return summary(list(self._buckets.values())) | {"buckets_watched": len(self._buckets),
                                                          "buckets": sorted(self._buckets)}

    # ------------------------------------------------------------------ buckets
    async def refresh_buckets(self) -> set[str]:
        names = set(await self.store.list_buckets())
        added, removed = names - self._bucket_names, self._bucket_names - names
        for b in list(removed):
            # A listing can miss a stream (a server still starting): drop a bucket only when the
            # server says it does not exist.
            try:
                await self.store.bucket_status(b)
            except NotFound:
                continue
            except NatsFSError:
                pass
            removed.discard(b)
            names.add(b)
        self._bucket_names = names
        for b in removed:
            self._drop(b)
        if self.on_change is not None:
            for b in added | removed:
                self.on_change(b, None)
        return names

    async def _poll_buckets(self) -> None:
        while True:
            await trio.sleep(self.poll_interval)
            try:
                await self.refresh_buckets()
            except NatsFSError as e:
                log.debug("bucket poll failed: %s", e)

    def _drop(self, bucket: str) -> None:
        watcher = self._buckets.pop(bucket, None)
        if watcher is not None:
            log.info("bucket %s is gone; its watch stops", bucket)
            watcher.cancel.cancel()

    def _gone(self, watcher: BucketWatcher) -> None:
        """The watcher of a loaded bucket found the bucket deleted."""
        bucket = watcher.bucket
        if self._buckets.get(bucket) is watcher:
            del self._buckets[bucket]
        self._bucket_names.discard(bucket)
        if self.on_change is not None:
            if self.single_bucket is not None:
                for name in list(watcher.index.root.children):
                    self.on_change(bucket, (name,))
            self.on_change(bucket, None)

    async def bucket_exists(self, bucket: str) -> bool:
        if bucket in self._bucket_names:
            return True
        if not valid_bucket_name(bucket):
            return False
        try:
            await self.store.bucket_status(bucket)
        except NotFound:
            return False
        self._bucket_names.add(bucket)
        return True

    def bucket_listed(self, bucket: str) -> bool:
        """Whether `bucket` was there at the last look (a listing, or a bucket found by name)."""
        return bucket in self._bucket_names

    def loaded_buckets(self) -> list[str]:
        """Buckets whose index is loaded or loading."""
        return list(self._buckets)

    # ------------------------------------------------------------------ indexes
    async def index(self, bucket: str) -> BucketIndex:
        watcher = self._buckets.get(bucket)
        if watcher is None:
            watcher = BucketWatcher(self.store, bucket, on_change=lambda path: self._changed(bucket, path),
                                    on_gone=self._gone, on_sealed=lambda at, sealed: self._sealed(bucket, at, sealed),
                                    reconcile_interval=self.reconcile_interval,
                                    default_created_ns=self.started_ns)
            self._buckets[bucket] = watcher
            assert self._nursery is not None, "Namespace.start() was not called"
            self._nursery.start_soon(watcher.run)
        await watcher.ready.wait()
        if watcher.error is not None or watcher.gone:
            if self._buckets.get(bucket) is watcher:
                del self._buckets[bucket]
            raise watcher.error or NotFound(f"no bucket {bucket!r}")
        return watcher.index

    def sealed_when_watched(self, bucket: str) -> bool | None:
        """Whether the bucket was sealed when its watcher last read it (None: not watched yet)."""
        watcher = self._buckets.get(bucket)
        return watcher.sealed if watcher is not None else None

    def loaded_index(self, bucket: str) -> BucketIndex | None:
        watcher = self._buckets.get(bucket)
        if watcher is None or not watcher.ready.is_set() or watcher.error is not None or watcher.gone:
            return None
        return watcher.index

    def _sealed(self, bucket: str, asked_at: float, sealed: bool) -> None:
        if self.on_sealed is not None:
            self.on_sealed(bucket, asked_at, sealed)

    def _changed(self, bucket: str, path: Path) -> None:
        if self.on_change is not None:
            self.on_change(bucket, path)

    # ------------------------------------------------------------------ paths
    def split(self, path: Path) -> tuple[str | None, Path]:
        """(bucket, path inside the bucket) of a mount path; bucket None for the root of a multi-bucket mount.
        Every path becomes object names here: the path of a detached inode (`DETACHED`, under which no
        lookup reaches it) names nothing, and is refused (`DetachedPath`, ENOENT) so that no object is
        ever read or written under the inode table's placeholder."""
        if path[:1] == (DETACHED,):
            raise DetachedPath(f"{'/'.join(path[1:])}: the directory or file was removed or replaced "
                               "(its inode is detached)")
        if self.single_bucket is not None:
            return self.single_bucket, path
        if not path:
            return None, ()
        return path[0], path[1:]

    def mount_path(self, bucket: str, rel: Path) -> Path:
        return rel if self.single_bucket is not None else (bucket, *rel)

    async def resolve(self, path: Path) -> Node:
        bucket, rel = self.split(path)
        if bucket is None:
            return Node(ROOT, mtime_ns=self.started_ns)
        if self.single_bucket is None and not rel:
            if not await self.bucket_exists(bucket):
                raise NotFound(f"no bucket {bucket!r}")
            idx = self.loaded_index(bucket)
            return Node(BUCKET, bucket, (), idx.root if idx else None,
                        mtime_ns=idx.root.mtime_ns if idx else self.started_ns)
        if self.single_bucket is None and not await self.bucket_exists(bucket):
            raise NotFound(f"no bucket {bucket!r}")
        if not rel:
            return self._node(bucket, rel, await self._root_index(bucket))
        index = await self.index(bucket)
        entry = index.get(rel)
        if entry is None:
            raise NotFound(f"{bucket}/{'/'.join(rel)}")
        return self._node(bucket, rel, entry)

    async def _root_index(self, bucket: str) -> Dir:
        """The root of a `--bucket` mount: its bucket's tree, or an empty directory while the bucket does
        not exist (another client deleted it; it shows again once created again). The root of a mount
        answering ENOENT broke `ls` and `cd` of the mountpoint and every process inside it."""
        try:
            return (await self.index(bucket)).root
        except NotFound:
            return Dir(self.started_ns)

    def loaded_node(self, path: Path) -> Node | None:
        """What `resolve` answers for an entry inside a bucket whose index is loaded, without waiting;
        None when the index is not loaded or nothing is there."""
        bucket, rel = self.split(path)
        index = self.loaded_index(bucket) if bucket is not None and rel else None
        entry = index.get(rel) if index is not None else None
        return self._node(bucket, rel, entry) if bucket is not None and entry is not None else None

    def _node(self, bucket: str, rel: Path, entry: Dir | ObjectInfo) -> Node:
        if isinstance(entry, Dir):
            kind = BUCKET if not rel and self.single_bucket is None else (ROOT if not rel else DIR)
            return Node(kind, bucket, rel, entry, mtime_ns=entry.mtime_ns)
        if entry.link is not None or (entry.attrs is not None and entry.attrs.symlink is not None
                                      and entry.size == 0):
            return Node(LINK, bucket, rel, None, entry, entry.mtime_ns)
        return Node(FILE, bucket, rel, None, entry, entry.mtime_ns)

    async def listdir(self, path: Path) -> list[tuple[str, Node]]:
        bucket, rel = self.split(path)
        if bucket is None:
            names = await self.refresh_buckets()
            out = []
            for b in sorted(names):
                idx = self.loaded_index(b)
                out.append((b, Node(BUCKET, b, (), idx.root if idx else None,
                                    mtime_ns=idx.root.mtime_ns if idx else self.started_ns)))
            return out
        if not rel and self.single_bucket is not None:
            entry: Dir | ObjectInfo = await self._root_index(bucket)
        else:
            index = await self.index(bucket)
            found = index.get(rel)
            if found is None:
                raise NotFound(f"{bucket}/{'/'.join(rel)}")
            entry = found
        if not isinstance(entry, Dir):
            raise NotADirectory(f"{bucket}/{'/'.join(rel)}")
        return [(name, self._node(bucket, (*rel, name), child)) for name, child in sorted(entry.children.items())]
