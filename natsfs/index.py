"""A bucket's live tree of objects: names → entries, directories derived from `/` in names.

`BucketIndex` holds every live meta of one bucket (tombstones dropped) and the directory tree the
names rule (`natsfs.names`) places them in. It is pure data: `apply` takes one parsed meta at a time,
in stream order, whether from the initial load or the live watch, and reports which paths changed so
the layer above can invalidate kernel caches. Collisions are settled deterministically:
a directory beats a file at the same path, a real name beats an escaped one; losers are hidden
(one log line each) and come back when the path frees up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from .adr20 import ObjectInfo
from .names import placement

log = logging.getLogger(__name__)

Path = tuple[str, ...]
Entry = "Dir | ObjectInfo"


class Dir:
    """A directory: its children by name, and the marker object that keeps it alive when empty."""

    __slots__ = ("children", "marker", "mtime_ns")

    def __init__(self, mtime_ns: int = 0):
        self.children: dict[str, Dir | ObjectInfo] = {}
        self.marker: ObjectInfo | None = None
        self.mtime_ns = mtime_ns


def is_marker(info: ObjectInfo) -> bool:
    return info.name.endswith("/") and info.size == 0 and info.link is None and not info.deleted


class BucketIndex:
    """Live objects of one bucket and the tree they form."""

    def __init__(self, bucket: str, *, created_ns: int = 0):
        self.bucket = bucket
        self.objects: dict[str, ObjectInfo] = {}
        self.root = Dir(created_ns)
        self.hidden: dict[str, str] = {}  # object name -> why it is not shown
        self.escaped: set[str] = set()  # names shown under an escaped name
        self.created_ns = created_ns
        # Called with the path of every entry that appeared, changed or disappeared.
        self.on_change: Callable[[Path], None] | None = None

    # ------------------------------------------------------------------ queries
    def get(self, path: Path) -> Dir | ObjectInfo | None:
        node: Dir | ObjectInfo = self.root
        for seg in path:
            if not isinstance(node, Dir):
                return None
            child = node.children.get(seg)
            if child is None:
                return None
            node = child
        return node

    def __len__(self) -> int:
        return len(self.objects)

    def walk_files(self) -> Iterator[ObjectInfo]:
        stack = [self.root]
        while stack:
            d = stack.pop()
            for child in d.children.values():
                if isinstance(child, Dir):
                    stack.append(child)
                else:
                    yield child

    # ------------------------------------------------------------------ updates
    def apply(self, info: ObjectInfo) -> bool:
        """Take one meta (newer than what we hold); True when the index changed."""
        old = self.objects.get(info.name)
        if old is not None and info.revision <= old.revision:
            return False
        if old is not None:
            self._unplace(old)
        if info.deleted:
            if old is None:
                return False
            del self.objects[info.name]
            self._retry_hidden()
            return True
        self.objects[info.name] = info
        self._place(info)
        return True

    def remove(self, name: str) -> bool:
        """Drop `name` (its meta subject was purged, e.g. renamed away by another client)."""
        old = self.objects.pop(name, None)
        if old is None:
            return False
        self._unplace(old)
        self._retry_hidden()
        return True

    def clear(self) -> None:
        self.objects.clear()
        self.root = Dir(self.created_ns)
        self.hidden.clear()
        self.escaped.clear()

    # ------------------------------------------------------------------ placement
    def _changed(self, path: Path) -> None:
        if self.on_change is not None:
            self.on_change(path)

    def _hide(self, info: ObjectInfo, why: str) -> None:
        if info.name not in self.hidden:
            log.warning("bucket %s: object %r is not shown: %s", self.bucket, info.name, why)
        self.hidden[info.name] = why

    def _place(self, info: ObjectInfo) -> None:
        marker = is_marker(info)
        path, escaped = placement(info.name, marker_candidate=marker)
        if path is None:
            self._hide(info, "its name cannot be a file name (a segment over 255 bytes)")
            return
        node = self.root
        for depth, seg in enumerate(path[:-1]):
            child = node.children.get(seg)
            if child is None or not isinstance(child, Dir):
                if child is not None:
                    # A directory beats a file at the same path.
                    self._hide(child, f"a directory {'/'.join(path[: depth + 1])!r} has the same path")
                new = Dir(info.mtime_ns)
                node.children[seg] = new
                self._changed(path[: depth + 1])
                child = new
            node = child
        last = path[-1]
        existing = node.children.get(last)
        if marker:
            if isinstance(existing, Dir):
                existing.marker = info
                existing.mtime_ns = max(existing.mtime_ns, info.mtime_ns)
                return
            if existing is not None:
                self._hide(existing, f"a directory {'/'.join(path)!r} has the same path")
            d = Dir(info.mtime_ns)
            d.marker = info
            node.children[last] = d
            self._changed(path)
            return
        if isinstance(existing, Dir):
            self._hide(info, f"a directory {'/'.join(path)!r} has the same path")
            return
        if existing is not None and existing.name != info.name:
            if existing.name in self.escaped and not escaped:
                self._hide(existing, f"object {info.name!r} has the same path")
            else:
                self._hide(info, f"object {existing.name!r} has the same path")
                return
        node.children[last] = info
        self.hidden.pop(info.name, None)
        if escaped:
            log.info("bucket %s: object %r is shown as %r", self.bucket, info.name, path[0])
            self.escaped.add(info.name)
        self._changed(path)

    def _unplace(self, info: ObjectInfo) -> None:
        self.escaped.discard(info.name)
        if self.hidden.pop(info.name, None) is not None:
            return
        marker = is_marker(info)
        path, _ = placement(info.name, marker_candidate=marker)
        if path is None:
            return
        trail: list[tuple[Dir, str]] = []
        node = self.root
        for seg in path[:-1]:
            child = node.children.get(seg)
            if not isinstance(child, Dir):
                return
            trail.append((node, seg))
            node = child
        last = path[-1]
        child = node.children.get(last)
        if marker:
            if isinstance(child, Dir) and child.marker is not None and child.marker.name == info.name:
                child.marker = None
                trail.append((node, last))
                node = child
            else:
                return
        elif isinstance(child, ObjectInfo) and child.name == info.name:
            del node.children[last]
            self._changed(path)
        else:
            return
        # Prune directories that only existed for this object.
        while trail:
            parent, seg = trail.pop()
            d = parent.children.get(seg)
            if isinstance(d, Dir) and not d.children and d.marker is None:
                del parent.children[seg]
                self._changed((*tuple(s for _, s in trail), seg))
            else:
                break

    def _retry_hidden(self) -> None:
        if not self.hidden:
            return
        for name in list(self.hidden):
            info = self.objects.get(name)
            if info is None:
                self.hidden.pop(name, None)
                continue
            path, _ = placement(name, marker_candidate=is_marker(info))
            if path is None:
                continue
            if self._fits(path, is_marker(info)):
                del self.hidden[name]
                self._place(info)
                if name not in self.hidden:
                    log.info("bucket %s: object %r is shown again", self.bucket, name)

    def _fits(self, path: Path, marker: bool) -> bool:
        node: Dir | ObjectInfo = self.root
        for seg in path[:-1]:
            assert isinstance(node, Dir)
            child = node.children.get(seg)
            if child is None:
                return True
            if not isinstance(child, Dir):
                return False
            node = child
        assert isinstance(node, Dir)
        existing = node.children.get(path[-1])
        return existing is None or (marker and isinstance(existing, Dir))
