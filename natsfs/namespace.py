"""The mount's tree: buckets at the root (or one bucket as the root), each bucket's live index.

`Namespace` turns a mount-relative path into a `Node` and lists directories, always from memory
once a bucket's index is loaded. It loads an index on first use, with one ordered consumer per bucket
that first delivers the last meta of every object and then keeps delivering changes, which are applied
to the index as they arrive. The set of buckets is refreshed by polling the stream list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from .adr20 import ObjectInfo, ObjectStore, parse_meta, valid_bucket_name
from .errors import MalformedMeta, NatsFSError, NotADirectory, NotFound
from .index import BucketIndex, Dir
from .streams import StoredMsg

log = logging.getLogger(__name__)

Path = tuple[str, ...]

ROOT, BUCKET, DIR, FILE, LINK = "root", "bucket", "dir", "file", "link"


@dataclass(slots=True)
class Node:
    kind: str
    bucket: str | None = None
    rel: Path = ()
    dir: Dir | None = None
    info: ObjectInfo | None = None
    mtime_ns: int = 0


class _Loaded:
    """One bucket's index and the state of its loader."""

    def __init__(self, bucket: str):
        self.index = BucketIndex(bucket)
        self.ready = trio.Event()
        self.error: NatsFSError | None = None
        self.cancel = trio.CancelScope()


class Namespace:
    def __init__(self, store: ObjectStore, *, bucket: str | None = None, poll_interval: float = 2.0):
        self.store = store
        self.single_bucket = bucket
        self.poll_interval = poll_interval
        self.started_ns = time.time_ns()
        self._buckets: dict[str, _Loaded] = {}
        self._bucket_names: set[str] = set()
        self._nursery: trio.Nursery | None = None
        # Called with (bucket, path inside bucket) of every entry that changed, and with
        # (bucket, None) when a bucket appeared or disappeared.
        self.on_change: Callable[[str, Path | None], None] | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.single_bucket is not None:
            await self.index(self.single_bucket)
        else:
            await self.refresh_buckets()
            nursery.start_soon(self._poll_buckets)

    # ------------------------------------------------------------------ buckets
    async def refresh_buckets(self) -> set[str]:
        names = set(await self.store.list_buckets())
        added, removed = names - self._bucket_names, self._bucket_names - names
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
        loaded = self._buckets.pop(bucket, None)
        if loaded is not None:
            loaded.cancel.cancel()

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

    def bucket_names(self) -> list[str]:
        return sorted(self._bucket_names)

    # ------------------------------------------------------------------ indexes
    async def index(self, bucket: str) -> BucketIndex:
        loaded = self._buckets.get(bucket)
        if loaded is None:
            loaded = _Loaded(bucket)
            self._buckets[bucket] = loaded
            assert self._nursery is not None, "Namespace.start() was not called"
            self._nursery.start_soon(self._watch, loaded)
        await loaded.ready.wait()
        if loaded.error is not None:
            if self._buckets.get(bucket) is loaded:
                del self._buckets[bucket]
            raise loaded.error
        return loaded.index

    def loaded_index(self, bucket: str) -> BucketIndex | None:
        loaded = self._buckets.get(bucket)
        return loaded.index if loaded is not None and loaded.ready.is_set() and loaded.error is None else None

    async def _watch(self, loaded: _Loaded) -> None:
        bucket = loaded.index.bucket
        index = loaded.index
        with loaded.cancel:
            try:
                status = await self.store.bucket_status(bucket)
                index.created_ns = index.root.mtime_ns = status.created_ns or self.started_ns
                watch = await self.store.watch_metas(bucket)
            except NatsFSError as e:
                loaded.error = e
                loaded.ready.set()
                return
            index.on_change = lambda path: self._changed(bucket, path)
            started = time.monotonic()
            try:
                while True:
                    batch = await watch.next_batch(timeout=1.0)
                    if batch.reset:
                        index.clear()
                    for m in batch.msgs:
                        self._apply(index, m)
                    if batch.caught_up and not loaded.ready.is_set():
                        log.info("bucket %s: %d objects indexed in %.2fs", bucket, len(index),
                                 time.monotonic() - started)
                        loaded.ready.set()
            except NotFound:
                log.warning("bucket %s was deleted", bucket)
                self._bucket_names.discard(bucket)
                if self._buckets.get(bucket) is loaded:
                    del self._buckets[bucket]
                if self.on_change is not None:
                    self.on_change(bucket, None)
            except NatsFSError as e:
                log.error("bucket %s: index watch failed: %s", bucket, e)
                if not loaded.ready.is_set():
                    loaded.error = e
                if self._buckets.get(bucket) is loaded:
                    del self._buckets[bucket]
            finally:
                loaded.ready.set()
                with trio.CancelScope(shield=True):
                    await watch.close()

    def _apply(self, index: BucketIndex, m: StoredMsg) -> None:
        try:
            info = parse_meta(index.bucket, m)
        except MalformedMeta as e:
            log.warning("bucket %s: skipping malformed meta: %s", index.bucket, e)
            return
        except Exception:
            # Bad input is normal input: one meta must never stop the bucket's index.
            log.exception("bucket %s: skipping meta %s (seq %d) that could not be parsed", index.bucket,
                          m.subject, m.seq)
            return
        index.apply(info)

    def _changed(self, bucket: str, path: Path) -> None:
        if self.on_change is not None:
            self.on_change(bucket, path)

    # ------------------------------------------------------------------ paths
    def split(self, path: Path) -> tuple[str | None, Path]:
        """(bucket, path inside the bucket) of a mount path; bucket None for the root of a multi-bucket mount."""
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
        index = await self.index(bucket)
        entry = index.get(rel)
        if entry is None:
            raise NotFound(f"{bucket}/{'/'.join(rel)}")
        return self._node(bucket, rel, entry)

    def _node(self, bucket: str, rel: Path, entry: Dir | ObjectInfo) -> Node:
        if isinstance(entry, Dir):
            kind = BUCKET if not rel and self.single_bucket is None else (ROOT if not rel else DIR)
            return Node(kind, bucket, rel, entry, mtime_ns=entry.mtime_ns)
        if entry.link is not None:
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
        index = await self.index(bucket)
        entry = index.get(rel)
        if entry is None:
            raise NotFound(f"{bucket}/{'/'.join(rel)}")
        if not isinstance(entry, Dir):
            raise NotADirectory(f"{bucket}/{'/'.join(rel)}")
        return [(name, self._node(bucket, (*rel, name), child)) for name, child in sorted(entry.children.items())]
