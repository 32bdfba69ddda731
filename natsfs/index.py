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
import time
from collections.abc import Callable, Iterator

from .adr20 import ObjectInfo
from .names import placement

log = logging.getLogger(__name__)

Path = tuple[str, ...]
Entry = "Dir | ObjectInfo"
# How many purged names are remembered (against stale messages resurrecting them).
_PURGED_KEPT = 10_000
# How long a directory whose marker another client's rename claimed counts as being moved by that rename
# (`renamed_away`): far longer than a directory rename takes, and short enough that the entries a mount
# that died half way left behind can be renamed again.
CLAIMED_DIR_MOVING_S = 60.0
_CLAIMS_PRUNED_AT = 1024


class Dir:
    """A directory: its children by name, and the marker object that keeps it alive when empty.

    A directory without a marker exists because names imply it, and goes with its last entry, except
    where this mount removed that entry itself (`BucketIndex.own_removal`): then it is `kept`, empty, in
    this mount only (nothing stored; other clients see it gone), as on a local disk, until this mount
    removes it (`drop_empty`) or something is placed under it again. `removing` counts this mount's
    removals under way in it, which no report of them (the watch may deliver one first) prunes it for."""

    __slots__ = ("children", "kept", "marker", "mtime_ns", "removing")

    def __init__(self, mtime_ns: int = 0):
        self.children: dict[str, Dir | ObjectInfo] = {}
        self.marker: ObjectInfo | None = None
        self.mtime_ns = mtime_ns
        self.kept = False
        self.removing = 0

    def vacant(self) -> bool:
        """Nothing keeps it for other clients: no marker, no removal of ours under way, and no entries but
        directories only this mount keeps (they go with it)."""
        return (self.marker is None and not self.removing
                and all(isinstance(c, Dir) and c.kept and c.vacant() for c in self.children.values()))


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
        # Name -> the line last logged about where it shows (hidden, and why; or escaped, and as what), so
        # that another client updating such an object again and again (a status file `x/` with bytes)
        # gets one line, not one per version. Dropped when the name goes away.
        self._told: dict[str, str] = {}
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
        # Metas on their canonical subject (tombstones, live metas, links) whose nuid holds a wildcard, `*`
        # or `>` (`adr20.wildcard_nuid`): name -> (revision, that nuid). Other clients' Delete or Put of
        # the name would purge every chunk of the bucket; the layer above rewrites them on a fresh nuid
        # (`natsfs.mutations.Mutations.defuse_wildcard_nuids`).
        self.wildcard_nuids: dict[str, tuple[int, str]] = {}
        # Aliases (parsed or skipped) whose nuid holds a wildcard, on a subject nats.go's Put and Delete of
        # some name read (`adr20.alias_wildcard_nuid`): subject -> (revision, that nuid, the name the meta
        # carries). Rewritten in place like those above (`Mutations.defuse_wildcard_nuids`).
        self.alias_wildcards: dict[str, tuple[int, str, str]] = {}
        # Directory markers a rename claimed (a tombstone on a fresh nuid replaced the live marker): marker
        # name -> (the claim's revision, when it was applied here, monotonic). See `renamed_away`.
        self.claimed_markers: dict[str, tuple[int, float]] = {}

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
        if info.wildcard_nuid:
            self.wildcard_nuids[name] = (info.revision, info.wildcard_nuid)
        elif self.wildcard_nuids:
            self.wildcard_nuids.pop(name, None)
        if info.deleted:
            self.tombstones[name] = info.revision
            self._note_tombstone(name, info)
            if old is not None and is_marker(old) and info.nuid and info.nuid != old.nuid:
                self._note_claimed_marker(name, info.revision)
            if old is None:
                return False
            del self.objects[name]
            self._told.pop(name, None)
            self._retry_hidden()
            return True
        if self.tombstones:
            self.tombstones.pop(name, None)
            self._drop_tomb_nuid(name)
            self.claimed_markers.pop(name, None)
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
        self.alias_wildcards.pop(subject, None)
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
            self._told.pop(name, None)
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
        if self.wildcard_nuids.get(name, (0, ""))[0] == revision:
            del self.wildcard_nuids[name]

    def remove(self, name: str) -> bool:
        """Drop `name` (the meta subject it is shown from was purged, e.g. renamed away by another client)."""
        with self._update():
            return self._remove(name)

    def _remove(self, name: str) -> bool:
        if name in self.odd_subjects:
            return self.drop_alias(self.odd_subjects[name])
        self.tombstones.pop(name, None)
        self._drop_tomb_nuid(name)
        self.wildcard_nuids.pop(name, None)
        old = self.objects.pop(name, None)
        if old is None:
            return self._settle_alias(name)
        self.purged[name] = old.revision
        if len(self.purged) > _PURGED_KEPT:
            del self.purged[next(iter(self.purged))]  # the oldest: long overtaken by the watch
        self._unmap_nuid(old)
        self._unplace(old)
        self._told.pop(name, None)
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
        if self.wildcard_nuids.get(name, (0, ""))[0] < revision:
            self.wildcard_nuids.pop(name, None)
        if held is None:
            return False
        del self.objects[name]
        self.odd_subjects.pop(name, None)
        self._unmap_nuid(held)
        self._unplace(held)
        self._told.pop(name, None)
        self._retry_hidden()
        return True

    @contextlib.contextmanager
    def own_removal(self, directory: Path) -> Iterator[None]:
        """This mount removes (unlinks, renames away, rmdirs) an entry of `directory`: a directory without
        a marker that this leaves empty is kept, empty, in this mount (`Dir.kept`), not dropped as one
        another client emptied is: `rm -r` removes its entries, then rmdirs it. Held while the removal
        runs, so that the watch delivering its tombstone first does not prune it either; a removal that
        failed leaves an emptied directory to go as today (another client removed the entry)."""
        held = self.get(directory) if directory else None
        if not isinstance(held, Dir):
            yield
            return
        held.removing += 1
        was_kept = held.kept  # (a rename into it that failed and took its entry back: still kept)
        done = False
        try:
            yield
            done = True
        finally:
            held.removing -= 1
            if not held.removing and self.get(directory) is held and held.vacant():
                if done or was_kept:
                    held.kept = True
                else:
                    with self._update():
                        self._prune(directory)

    def _note_claimed_marker(self, name: str, revision: int) -> None:
        now = time.monotonic()
        if len(self.claimed_markers) >= _CLAIMS_PRUNED_AT:  # (only recent claims count: the rest go)
            for old_name, (_, applied) in list(self.claimed_markers.items()):
                if now - applied > CLAIMED_DIR_MOVING_S:
                    del self.claimed_markers[old_name]
        self.claimed_markers[name] = (revision, now)

    def renamed_away(self, path: Path) -> bool:
        """Whether another client is renaming the directory at `path` away: a rename's claim replaced its
        marker (applied here less than `CLAIMED_DIR_MOVING_S` ago) after every entry still shown under it
        was stored, so those are the entries that rename has yet to move. A directory rename moves its
        marker first, and its claim decides a race with another rename of the directory; a mount that
        learns of the claim before its own rename reads the marker must not move the entries left
        (both renames then moved part of the directory: the one that claimed the marker lost its entries
        and moved the marker back, the other's target had no marker)."""
        held = self.get(path) if path else None
        claim = self.claimed_markers.get("/".join(path) + "/")
        if not isinstance(held, Dir) or held.marker is not None or claim is None:
            return False
        revision, applied = claim
        if time.monotonic() - applied > CLAIMED_DIR_MOVING_S:
            return False
        stack = [held]
        while stack:
            d = stack.pop()
            for child in d.children.values():
                if isinstance(child, Dir):
                    if child.marker is not None and child.marker.revision > revision:
                        return False
                    stack.append(child)
                elif child.revision > revision:
                    return False  # (stored after the claim: not among what that rename moves)
        return True

    def drop_empty(self, directory: Path) -> None:
        """This mount's rmdir of a directory without a marker (kept, see `own_removal`): it goes from this
        mount; nothing was stored for it."""
        held = self.get(directory) if directory else None
        if isinstance(held, Dir) and not held.children and held.marker is None:
            with self._update():
                self._prune(directory, keep_kept=False)

    def move_kept(self, old: Path, new: Path) -> bool:
        """This mount renames a directory it keeps (`Dir.vacant`: nothing under it is stored) from `old` to
        `new`: it moves in this mount only, as it stays empty and unstored, replacing a vacant directory
        there; False (nothing moved) when `new`'s parent is no directory or another entry holds `new`."""
        if not old or not new:
            return False
        old_parent, new_parent = self.get(old[:-1]), self.get(new[:-1])
        if not isinstance(old_parent, Dir) or not isinstance(new_parent, Dir):
            return False
        moved = old_parent.children.get(old[-1])
        there = new_parent.children.get(new[-1])
        if not isinstance(moved, Dir) or not moved.vacant() or (
                there is not None and not (isinstance(there, Dir) and there.vacant())):
            return False
        with self._update():
            del old_parent.children[old[-1]]
            self._changed(old)
            moved.kept = True
            new_parent.children[new[-1]] = moved
            self._changed(new)
        return True

    def carry_kept(self, old: Dir) -> None:
        """Take over the directories this mount keeps (`Dir.kept`) from `old`, the root of the index this
        one replaces (rebuilt after the watch started over), where their parent is still a directory and
        the name still free: they are this mount's, and no stored object tells of them."""
        stack: list[tuple[Path, Dir]] = [((), old)]
        while stack:
            prefix, d = stack.pop()
            for name, child in d.children.items():
                if not isinstance(child, Dir):
                    continue
                path = (*prefix, name)
                if child.kept and child.vacant():
                    parent = self.get(prefix)
                    if isinstance(parent, Dir) and name not in parent.children:
                        parent.children[name] = child
                else:
                    stack.append((path, child))

    def _prune(self, directory: Path, *, keep_kept: bool = True) -> None:
        """Drop `directory` and the directories above it that it leaves vacant (`Dir.vacant`)."""
        while directory:
            parent = self.get(directory[:-1])
            d = parent.children.get(directory[-1]) if isinstance(parent, Dir) else None
            if not isinstance(parent, Dir) or not isinstance(d, Dir) or (d.kept and keep_kept) or not d.vacant():
                return
            del parent.children[directory[-1]]
            self._changed(directory)
            directory = directory[:-1]
            keep_kept = True

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
        self._told.clear()
        self._by_nuid.clear()
        self.tombstones.clear()
        self._tomb_nuid.clear()
        self._tomb_by_nuid.clear()
        self.shared_tombstones.clear()
        self.wildcard_nuids.clear()
        self.alias_wildcards.clear()
        self.claimed_markers.clear()
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
        if info.name not in self.hidden and self._told.get(info.name) != why:
            log.warning("bucket %s: object %r is not shown: %s", self.bucket, info.name, why)
        self._told[info.name] = why
        self.hidden[info.name] = why

    def _place(self, info: ObjectInfo) -> None:
        marker = is_marker(info)
        path, escaped = placement(info.name, marker_candidate=marker)
        if path is None:
            self._hide(info, "its name cannot be a file name (" + ("it is empty" if not info.name else
                                                                   "a segment over 255 bytes") + ")")
            return
        node = self.root
        for depth, seg in enumerate(path[:-1]):
            child = node.children.get(seg)
            if isinstance(child, Dir):
                child.kept = False  # implied by a name again (or held by a marker): no longer this mount's
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
                existing.kept = False
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
            told = f"shown as {path[0]!r}"
            if self._told.get(info.name) != told:
                log.info("bucket %s: object %r is shown as %r", self.bucket, info.name, path[0])
            self._told[info.name] = told
            self.escaped.add(info.name)
        else:
            self._told.pop(info.name, None)
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
            if isinstance(d, Dir) and not d.kept and d.vacant():
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
