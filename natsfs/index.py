"""A bucket's live tree of objects: names → entries, directories derived from `/` in names.

`BucketIndex` holds every live meta of one bucket and the directory tree the names rule
(`natsfs.names`) places them in. It is pure data: `apply` takes one parsed meta at a time, in stream
order, whether from the initial load or the live watch, and reports which paths changed so the layer
above can invalidate kernel caches: once each, after the update (a path being replaced is never
reported while it has no entry). Collisions are settled deterministically: a directory beats a file
at the same path, a real name beats an escaped one; losers are hidden (one log line each) and come back
when the path frees up.

Besides the tree it keeps what the watcher (`natsfs.watcher`) needs to notice changes a consumer never
delivers: which names share a nuid (a rename by another client publishes the new name with the old
nuid, then purges the old meta subject), the revisions of tombstones (so a stale message never
resurrects a deleted object) and the meta subjects whose last message is unusable, so that the number
of meta subjects the index accounts for can be compared with the stream's. `changed_paths` compares two
trees, for swapping in an index rebuilt from scratch.

**One subject per name.** nats.go reads a name at its canonical meta subject (padded base64 of the
UTF-8 name), so that subject rules: a meta under any other subject for the same name (unpadded base64
written by old clients, or a token that is not base64 of UTF-8 with the name in its JSON) is an *alias*,
kept in `aliases` and shown only while the canonical subject holds nothing (neither a live meta nor a
tombstone); then the newest live alias is shown and `odd_subjects` names its subject. A message on a
subject only ever replaces what that same subject held: an alias (or an alias's tombstone) never hides,
replaces or deletes the canonical object, whatever the revisions.

It also notices tombstones that carry the nuid of a live object under another name (earlier versions of
natsfs renamed by writing such a tombstone under the old name). Other clients purge the nuid they find
under a deleted name, so these are dangerous: they are collected in `shared_tombstones` for the layer
above to purge (`natsfs.mutations.Mutations`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from .adr20 import ObjectInfo
from .names import placement

log = logging.getLogger(__name__)

Path = tuple[str, ...]
Entry = "Dir | ObjectInfo"
# How many purged names are remembered (against stale messages resurrecting them).
_PURGED_KEPT = 10_000


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
        # Called with the path of every entry that appeared, changed or disappeared, once the update that
        # changed it is complete (`_update`): never while a path is between its old and new entry.
        self.on_change: Callable[[Path], None] | None = None
        self._reports: list[Path] | None = None  # paths changed by the update under way, not reported yet
        # nuid -> the live name holding it (a list when several do: a rename half done, or a copy).
        self._by_nuid: dict[str, str | list[str]] = {}
        # Deleted names whose meta subject holds a tombstone -> the tombstone's revision.
        self.tombstones: dict[str, int] = {}
        # Names dropped because their meta subject was purged -> the revision they had.
        self.purged: dict[str, int] = {}
        # Meta subjects whose last message could not be used (malformed).
        self.malformed: set[str] = set()
        # Aliases (metas, tombstones included, on a subject that is not their name's canonical one):
        # name -> {subject: its last meta}, and subject -> name. `odd_subjects`: names shown from an
        # alias (the canonical subject holds nothing) -> that alias's subject.
        self.aliases: dict[str, dict[str, ObjectInfo]] = {}
        self._alias_name: dict[str, str] = {}
        self.odd_subjects: dict[str, str] = {}
        # Highest stream sequence applied, and when (monotonic); read by the watcher.
        self.last_revision = 0
        # Tombstones carrying a nuid: name -> nuid, and nuid -> the (last) tombstone name carrying it.
        self._tomb_nuid: dict[str, str] = {}
        self._tomb_by_nuid: dict[str, str] = {}
        # Tombstones whose nuid a live object under another name holds: name -> (revision, nuid).
        self.shared_tombstones: dict[str, tuple[int, str]] = {}

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

    def names_with_nuid(self, nuid: str) -> list[str]:
        """Live names whose meta carries `nuid` (more than one: a rename half done, or a copy)."""
        held = self._by_nuid.get(nuid) if nuid else None
        if held is None:
            return []
        return [held] if isinstance(held, str) else list(held)

    def other_names_with_nuid(self, nuid: str, name: str) -> tuple[str, ...]:
        """Live names other than `name` holding `nuid` (usually none: fast)."""
        held = self._by_nuid.get(nuid)
        if held is None or held == name:
            return ()
        if isinstance(held, str):
            return (held,)
        return tuple(n for n in held if n != name)

    def hidden_aliases(self, name: str | None = None) -> Iterator[tuple[str, ObjectInfo]]:
        """(subject, meta) of the live aliases that are not what their name shows (of `name` only, when
        given). They name no object (the canonical subject wins), so they never make a name "shared"
        (no tombstone decision rests on them), but their chunks must stay: an `adopt_alias` cut short
        leaves the canonical meta and the alias of one name on one nuid."""
        names = [name] if name is not None else list(self.aliases)
        for n in names:
            for subject, info in self.aliases.get(n, {}).items():
                if self.odd_subjects.get(n) != subject and not info.deleted:
                    yield subject, info

    def hidden_alias_holders(self, nuid: str) -> tuple[str, ...]:
        """Subjects of hidden aliases (`hidden_aliases`) that carry `nuid` (rare: scanned)."""
        if not nuid or not self._alias_name:
            return ()
        return tuple(subject for subject, info in self.hidden_aliases() if info.nuid == nuid)

    def meta_subject_count(self) -> int:
        """How many meta subjects the index accounts for: live objects, tombstones, unusable metas, aliases."""
        return (len(self.objects) - len(self.odd_subjects) + len(self.tombstones) + len(self.malformed)
                + len(self._alias_name))

    def alias_subjects(self) -> dict[str, str]:
        """Every alias subject -> the name its meta carries."""
        return self._alias_name

    def alias_at(self, subject: str) -> ObjectInfo | None:
        name = self._alias_name.get(subject)
        return self.aliases[name][subject] if name is not None else None

    # ------------------------------------------------------------------ updates
    @contextlib.contextmanager
    def _update(self) -> Iterator[None]:
        """One update: its changes are reported when it ends, not as each step makes them. A new version
        of an object is placed by removing the old entry, then placing the new one; a report in between
        would show the path with no entry at all, and the layer above would take this mount's own chmod
        for a deletion (and detach the inode its readers hold). Nested updates report with the outermost."""
        if self._reports is not None or self.on_change is None:
            yield
            return
        reports: list[Path] = []
        self._reports = reports
        try:
            yield
        finally:
            self._reports = None
            if self.on_change is not None:
                for path in dict.fromkeys(reports):  # each path once, in the order first changed
                    self.on_change(path)

    def apply(self, info: ObjectInfo) -> bool:
        """Take one meta (newer than what we hold); True when the index changed."""
        with self._update():
            return self._apply(info)

    def _apply(self, info: ObjectInfo) -> bool:
        name = info.name
        if info.revision > self.last_revision:
            self.last_revision = info.revision
        old = self.objects.get(name)
        from_alias = old is not None and name in self.odd_subjects
        if old is not None and not from_alias:
            if info.revision <= old.revision:
                return False
        elif self.tombstones or self.purged:
            # A message older than the deletion we know of (a consumer replaying, or our own write
            # applied before the watch delivered the previous revision) must not resurrect the name.
            gone = max(self.tombstones.get(name, 0), self.purged.get(name, 0))
            if gone and info.revision <= gone:
                return False
            self.purged.pop(name, None)
        if old is not None:
            self._unplace(old)
            self._unmap_nuid(old)
        if from_alias:
            del self.odd_subjects[name]  # the canonical subject holds the name now: it wins
        if info.deleted:
            self.tombstones[name] = info.revision
            self._note_tombstone(name, info)
            if old is None:
                return False
            del self.objects[name]
            self._retry_hidden()
            return True
        if self.tombstones:
            self.tombstones.pop(name, None)
            self._drop_tomb_nuid(name)
        self._show(info)
        return True

    def _show(self, info: ObjectInfo) -> None:
        self.objects[info.name] = info
        self._map_nuid(info)
        self._place(info)
        if info.nuid and info.nuid in self._tomb_by_nuid:
            tomb = self._tomb_by_nuid[info.nuid]
            if tomb != info.name and tomb in self.tombstones and self._tomb_nuid.get(tomb) == info.nuid:
                self.shared_tombstones[tomb] = (self.tombstones[tomb], info.nuid)

    # ------------------------------------------------------------------ aliases
    def apply_alias(self, subject: str, info: ObjectInfo) -> bool:
        """Take one meta found on `subject`, which is not the canonical subject of its name; True when
        what is shown changed."""
        with self._update():
            return self._apply_alias(subject, info)

    def _apply_alias(self, subject: str, info: ObjectInfo) -> bool:
        if info.revision > self.last_revision:
            self.last_revision = info.revision
        changed = False
        before = self._alias_name.get(subject)
        if before is not None:
            if info.revision <= self.aliases[before][subject].revision:
                return False
            if before != info.name:
                changed = self.drop_alias(subject)
        self.aliases.setdefault(info.name, {})[subject] = info
        self._alias_name[subject] = info.name
        return self._settle_alias(info.name) or changed

    def drop_alias(self, subject: str) -> bool:
        """The alias on `subject` is gone (purged, or replaced by an unusable meta)."""
        with self._update():
            return self._drop_alias(subject)

    def _drop_alias(self, subject: str) -> bool:
        name = self._alias_name.pop(subject, None)
        if name is None:
            return False
        held = self.aliases[name]
        del held[subject]
        if not held:
            del self.aliases[name]
        return self._settle_alias(name)

    def _canonical_holds(self, name: str) -> bool:
        return (name in self.objects and name not in self.odd_subjects) or name in self.tombstones

    def _settle_alias(self, name: str) -> bool:
        """Show the newest live alias of `name` while its canonical subject holds nothing; True if changed."""
        if self._canonical_holds(name):
            return False
        best: tuple[str, ObjectInfo] | None = None
        for subject, info in self.aliases.get(name, {}).items():
            if not info.deleted and (best is None or info.revision > best[1].revision):
                best = (subject, info)
        shown = self.objects.get(name)
        if best is not None and shown is best[1]:
            return False
        if shown is None and best is None:
            return False
        if shown is not None:
            del self.objects[name]
            self.odd_subjects.pop(name, None)
            self._unmap_nuid(shown)
            self._unplace(shown)
        if best is None:
            self._retry_hidden()
            return True
        self.odd_subjects[name] = best[0]
        self._show(best[1])
        return True

    def _note_tombstone(self, name: str, info: ObjectInfo) -> None:
        self._drop_tomb_nuid(name)
        if not info.nuid:
            return
        self._tomb_nuid[name] = info.nuid
        self._tomb_by_nuid[info.nuid] = name
        if any(n != name for n in self.names_with_nuid(info.nuid)):
            self.shared_tombstones[name] = (info.revision, info.nuid)

    def _drop_tomb_nuid(self, name: str) -> None:
        self.shared_tombstones.pop(name, None)
        nuid = self._tomb_nuid.pop(name, None)
        if nuid is not None and self._tomb_by_nuid.get(nuid) == name:
            del self._tomb_by_nuid[nuid]

    def drop_tombstone(self, name: str, revision: int) -> None:
        """The tombstone of `name` at `revision` was purged from the bucket."""
        if self.tombstones.get(name) == revision:
            del self.tombstones[name]
            self._drop_tomb_nuid(name)
            self._settle_alias(name)
        self.shared_tombstones.pop(name, None)

    def remove(self, name: str) -> bool:
        """Drop `name` (the meta subject it is shown from was purged, e.g. renamed away by another client)."""
        with self._update():
            return self._remove(name)

    def _remove(self, name: str) -> bool:
        if name in self.odd_subjects:
            return self.drop_alias(self.odd_subjects[name])
        self.tombstones.pop(name, None)
        self._drop_tomb_nuid(name)
        old = self.objects.pop(name, None)
        if old is None:
            return self._settle_alias(name)
        self.purged[name] = old.revision
        if len(self.purged) > _PURGED_KEPT:
            del self.purged[next(iter(self.purged))]  # the oldest: long overtaken by the watch
        self._unmap_nuid(old)
        self._unplace(old)
        self._retry_hidden()
        self._settle_alias(name)
        return True

    def forget(self, name: str, revision: int) -> bool:
        """A deletion (tombstone) of `name` at `revision` known without its meta; True if it was shown."""
        with self._update():
            return self._forget(name, revision)

    def _forget(self, name: str, revision: int) -> bool:
        held = self.objects.get(name)
        if held is not None and name not in self.odd_subjects and held.revision >= revision:
            return False
        self.tombstones[name] = max(revision, self.tombstones.get(name, 0))
        if held is None:
            return False
        del self.objects[name]
        self.odd_subjects.pop(name, None)
        self._unmap_nuid(held)
        self._unplace(held)
        self._retry_hidden()
        return True

    def remove_if(self, name: str, revision: int) -> bool:
        """`remove(name)` only if the index still holds it at `revision` (nothing newer arrived)."""
        held = self.objects.get(name)
        if held is None or held.revision != revision:
            return False
        return self.remove(name)

    def clear(self) -> None:
        self.objects.clear()
        self.root = Dir(self.created_ns)
        self.hidden.clear()
        self.escaped.clear()
        self._by_nuid.clear()
        self.tombstones.clear()
        self._tomb_nuid.clear()
        self._tomb_by_nuid.clear()
        self.shared_tombstones.clear()
        self.purged.clear()
        self.malformed.clear()
        self.aliases.clear()
        self._alias_name.clear()
        self.odd_subjects.clear()

    # ------------------------------------------------------------------ nuids
    def _map_nuid(self, info: ObjectInfo) -> None:
        nuid = info.nuid
        if not nuid:
            return
        held = self._by_nuid.get(nuid)
        if held is None:
            self._by_nuid[nuid] = info.name
        elif isinstance(held, str):
            if held != info.name:
                self._by_nuid[nuid] = [held, info.name]
        elif info.name not in held:
            held.append(info.name)

    def _unmap_nuid(self, info: ObjectInfo) -> None:
        nuid = info.nuid
        if not nuid:
            return
        held = self._by_nuid.get(nuid)
        if held is None:
            return
        if isinstance(held, str):
            if held == info.name:
                del self._by_nuid[nuid]
            return
        if info.name in held:
            held.remove(info.name)
        if len(held) == 1:
            self._by_nuid[nuid] = held[0]
        elif not held:
            del self._by_nuid[nuid]

    # ------------------------------------------------------------------ placement
    def _changed(self, path: Path) -> None:
        if self._reports is not None:
            self._reports.append(path)
        elif self.on_change is not None:
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
                if info.attrs is not None and info.attrs.mtime_ns is not None:
                    existing.mtime_ns = info.mtime_ns  # set on purpose (utimensat, or entries changed)
                else:
                    existing.mtime_ns = max(existing.mtime_ns, info.mtime_ns)
                self._changed(path)  # (the same directory, with the marker's attributes now)
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
                self._changed(path)  # (its attributes were the marker's)
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


def same_version(a: ObjectInfo, b: ObjectInfo) -> bool:
    """Whether two metas show the same thing (the revision aside: a recreated stream renumbers)."""
    return (a is b or (a.name == b.name and a.nuid == b.nuid and a.size == b.size and a.chunks == b.chunks
                       and a.digest == b.digest and a.mtime_ns == b.mtime_ns and a.link == b.link
                       and a.attrs == b.attrs and a.deleted == b.deleted))


def changed_paths(old: Dir, new: Dir) -> list[Path]:
    """Paths whose entry differs between two trees: appeared, vanished, changed kind or version.

    Directories present in both are compared entry by entry (and reported themselves when their marker
    changed); a vanished or replaced directory is reported once, not its contents.
    """
    out: list[Path] = []
    stack: list[tuple[Path, Dir, Dir]] = [((), old, new)]
    while stack:
        prefix, a, b = stack.pop()
        if a is b:
            continue
        if prefix and (a.marker is not b.marker and (a.marker is None or b.marker is None
                                                     or not same_version(a.marker, b.marker))):
            out.append(prefix)
        bc = b.children
        for name, x in a.children.items():
            y = bc.get(name)
            if y is None:
                out.append((*prefix, name))
            elif isinstance(x, Dir):
                if isinstance(y, Dir):
                    stack.append(((*prefix, name), x, y))
                else:
                    out.append((*prefix, name))
            elif isinstance(y, Dir) or not same_version(x, y):
                out.append((*prefix, name))
        ac = a.children
        out.extend((*prefix, name) for name in bc if name not in ac)
    return out
