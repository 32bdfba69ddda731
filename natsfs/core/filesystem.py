"""The filesystem core: every FUSE operation's logic, with no pyfuse3 in sight.

`Filesystem` turns paths into namespace nodes, opens, reads, writes, stages, uploads, renames and
deletes through the layers below, and answers in domain values (`Attributes`, `Opened`, `FsUsage`);
`natsfs.fs` (the FUSE adapter) decodes requests into calls here and those values into pyfuse3 replies,
and maps the domain errors raised here to errnos. The ops tests drive this class directly over
`MemoryStreams`.

What the core keeps per inode lives in its tables: paths and lookup counts (`InodeTable`), open
handles (`HandleTable`), the open-file record of each inode (`OpenFileTable`, see its design note),
staged content (`Staging`), the requests in flight that kernel invalidations wait for (`serving`), the
paths this mount's renames are moving (lookups and opens there wait, `_after_renames`), and the size
last handed to the kernel per inode (an open of a version of another size is `direct_io`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import stat
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from .. import testpoints, xattrs
from ..adr20 import (
    ATTR_SYMLINK,
    ATTR_SYMLINK_SIG,
    SPECIAL_KINDS,
    Link,
    ObjectInfo,
    PosixAttrs,
    meta_subject,
    new_nuid,
    set_posix_attrs,
    valid_bucket_name,
)
from ..chunk_cache import ChunkCache
from ..config import Config
from ..errors import (
    AlreadyExists,
    BadName,
    Conflict,
    Corrupt,
    DetachedPath,
    InvalidArgument,
    IsADirectory,
    KernelSizeStale,
    MalformedMeta,
    MarkerShaped,
    NameTooLong,
    NatsFSError,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotKept,
    ReadOnly,
    Stale,
    Unavailable,
)
from ..handles import DirHandle, FileHandle, HandleNo, HandleTable
from ..index import Dir, is_marker
from ..inodes import ROOT_INODE, InodeNo, InodeTable
from ..journal import WriteBackJournal
from ..kernel import DEGRADED_TIMEOUT, KernelNotifier
from ..links import HIDDEN_TARGET, OUTSIDE_TARGET, LinkTarget, SymlinkSigner, link_target, stays_in_mount
from ..mutations import Mutations
from ..names import NAME_MAX, placement
from ..namespace import BUCKET, DIR, FILE, LINK, ROOT, Namespace, Node
from ..openers import Openers, ProcOpeners
from ..secrecy import redact_urls
from ..staging import StagedFile, StagedVersion, Staging, WriteState, version_entry
from ..status import recent_problems
from ..streams import Payload
from .openfiles import OpenFileTable
from .writeback import INLINE_BYTES, WriteBack

WRITTEN_MTIMES_MAX = 10_000

OPENER_FDS_INLINE = 64  # an opener with at most this many descriptors is checked without a worker thread
# A directory's time is stored to its marker once no entry of it changed for DIR_TIME_DELAY_S, and at
# the latest DIR_TIME_MAX_S after the first change not stored yet (tar keeps directories busy).
DIR_TIME_DELAY_S = 0.5
DIR_TIME_MAX_S = 5.0
# At an unmount, directory times get what is left of --shutdown-timeout, but at least this long.
DIR_TIME_AT_UNMOUNT_MIN_S = 1.0
# The unmount settles the puts this run left (read back `purge_check_delay` after their purge) for at
# most that delay plus this, within what --shutdown-timeout leaves.
UNMOUNT_SETTLE_EXTRA_S = 2.0
# How long a close refused at its store waits for the kernel to drop the inode's attributes (a notifier
# that does not answer costs no more).
REFUSED_CLOSE_INVALIDATION_S = 1.0
# Bytes that could not be written to lost+found (a full local disk) are tried again this often.
KEEP_RETRY_S = 10.0
# A change of a file waiting for its write-back upload checks this often whether the server went away
# meanwhile, and once more when it has waited `CHANGE_WAIT_MAX_S` (then the upload is interrupted: see
# `Filesystem._changing`).
CHANGE_RECHECK_S = 0.5
# The longest a change of a file (write, truncate, O_TRUNC open) waits for its write-back upload attempt
# while the server still counts as connected (a stopped or overloaded server keeps the connection open and
# answers nothing): past it, the attempt is interrupted and the change goes on. Long enough for the put of
# a file rewritten in a loop to land between its rewrites, short enough that a write never waits for the
# network like a synchronous close would.
CHANGE_WAIT_MAX_S = 1.0
log = logging.getLogger(__name__)
_T = TypeVar("_T")

XATTR_STATS = b"user.natsfs.stats"
PETABYTE = 1 << 50


def _bytes_never_stored(info: StagedVersion) -> Stale:
    """A handle (or an inode held by one) on this mount's staged bytes that went to lost+found unstored."""
    return Stale(f"{info.bucket}/{info.name}: the bytes it opened were never stored (another client's version "
                 f"won; they are kept in lost+found)")


@dataclass(frozen=True, slots=True)
class Attributes:
    """What stat(2) shows of an inode, and how long the kernel may keep it."""

    ino: InodeNo
    mode: int
    nlink: int
    size: int
    uid: int
    gid: int
    mtime_ns: int  # also shown as atime and ctime
    blksize: int
    entry_timeout: float
    attr_timeout: float
    rdev: int = 0


@dataclass(frozen=True, slots=True)
class Opened:
    fh: HandleNo
    keep_cache: bool  # the kernel's pages of this inode still hold this version
    # The kernel may size the inode for another version: reads bypass its page cache and size (see
    # `_open_handle`).
    direct_io: bool = False


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a request (the owner of what it creates)."""

    uid: int
    gid: int
    pid: int = 0  # the calling thread (0: unknown, e.g. another pid namespace)


@dataclass(frozen=True, slots=True)
class _RetryHold:
    """The inode a kernel retry of an open refused `ESTALE` reached by walking the path again, and the
    version its lookup showed there: held for the retried open as if open (see `_hold_for_retry`)."""

    ino: InodeNo
    bucket: str
    info: ObjectInfo


# A create that races an unlink, a create or a rename of the same name starts again (the name is free
# again, or shows another file): at most this many times in all, then it answers ESTALE.
CREATE_ATTEMPTS = 16

# Threads remembered at once as waiting for the kernel's retry of their refused open (one that never
# comes, a thread that died, leaves its entry behind: the oldest go first).
RETRIES_KEPT = 1024


@dataclass(frozen=True, slots=True)
class AttrChanges:
    """setattr: the fields to change (None: leave as is)."""

    size: int | None = None
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    mtime_ns: int | None = None

    @property
    def posix(self) -> bool:
        return self.mode is not None or self.uid is not None or self.gid is not None or self.mtime_ns is not None


@dataclass(frozen=True, slots=True)
class FsUsage:
    """statfs(2)."""

    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int


def _owner(attrs: PosixAttrs | None, default_mode: int, default_uid: int, default_gid: int, special_bits: bool
           ) -> tuple[int, int, int]:
    """(permission bits, uid, gid) from an object's stored metadata, else the defaults.

    Setuid and setgid bits come from any client's metadata, so they show only when the mount was
    asked to honour them (`special_bits`, `--allow-setuid`). The sticky bit always shows: it only
    takes rights away (in a `1777` directory only an entry's owner may remove or rename it), so
    masking it would be the unsafe direction."""
    if attrs is None:
        return default_mode, default_uid, default_gid
    uid = attrs.uid if attrs.uid is not None else default_uid
    gid = attrs.gid if attrs.gid is not None else default_gid
    if attrs.mode is None:
        return default_mode, uid, gid
    return attrs.mode & (0o7777 if special_bits else 0o1777), uid, gid


def _merged(current: PosixAttrs | None, changes: AttrChanges, default_mode: int) -> PosixAttrs:
    """The attributes `changes` make of `current` (a missing mode: `default_mode`)."""
    cur = current or PosixAttrs()
    return PosixAttrs(
        changes.mode if changes.mode is not None else (cur.mode if cur.mode is not None else default_mode),
        changes.uid if changes.uid is not None else cur.uid,
        changes.gid if changes.gid is not None else cur.gid,
        changes.mtime_ns if changes.mtime_ns is not None else cur.mtime_ns,
        cur.kind, cur.rdev,
    )


def _without_privileges(mode: int, file_gid: int, caller: Caller | None) -> int:
    """`mode` as a local disk leaves a regular file's (of group `file_gid`) after a chown by `caller`, or a
    write or truncate by a caller other than root: no setuid bit; no setgid bit where group execute is
    set, nor where the caller is neither root nor in the file's group (setgid without group execute,
    once mandatory locking, stays only then; of the caller's groups only the primary one is known, so
    a member by a supplementary group clears it too: the safe direction)."""
    keeps_setgid = not mode & stat.S_IXGRP and (_privileged(caller) or (caller is not None and caller.gid == file_gid))
    return mode & ~stat.S_ISUID & ~(0 if keeps_setgid else stat.S_ISGID)


def _privileged(caller: Caller | None) -> bool:
    """Whether a write or truncate by `caller` keeps setuid/setgid bits: root's (CAP_FSETID; an unknown
    caller, too: nothing is taken away on a guess)."""
    return caller is None or caller.uid == 0


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


def _objects_below(directory: Dir) -> Iterator[tuple[tuple[str, ...], ObjectInfo]]:
    """Every object shown under `directory`, with its path below it (markers are not shown)."""
    stack: list[tuple[tuple[str, ...], Dir]] = [((), directory)]
    while stack:
        below, d = stack.pop()
        for name, child in d.children.items():
            if isinstance(child, Dir):
                stack.append(((*below, name), child))
            else:
                yield (*below, name), child


def _new_name(raw: bytes) -> str:
    """A name this mount is asked to create: refused before anything is stored when it is over
    NAME_MAX bytes (`ENAMETOOLONG`) or not UTF-8 (`EILSEQ`: no ADR-20 client could use it)."""
    if len(raw) > NAME_MAX:
        raise NameTooLong(f"{raw[:40]!r}...: {len(raw)} bytes, over {NAME_MAX}")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadName(f"{raw!r} is not UTF-8") from None
    return _name(raw)


class _Gate:
    """What the gates below share: waiters wait for the next change of the gate's state and look again."""

    def __init__(self) -> None:
        self._changed = trio.Event()

    async def _wait(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class _DirTimeGate(_Gate):
    """Directory renames, rmdirs and attribute changes publish markers at revisions they read; a
    directory-time store in between would make them fail as conflicts. They run together; a store
    of directory times runs alone."""

    def __init__(self) -> None:
        super().__init__()
        self._users = 0
        self._storing = False

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        while self._storing:
            await self._wait()
        self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            self._notify()

    @contextlib.asynccontextmanager
    async def storing(self) -> AsyncIterator[None]:
        while self._users or self._storing:
            await self._wait()
        self._storing = True
        try:
            yield
        finally:
            self._storing = False
            self._notify()


def _under(path: tuple[str, ...], directory: tuple[str, ...]) -> bool:
    return path[: len(directory)] == directory


class _DirRenameGate(_Gate):
    """A directory rename and the entries added in the directories it moves (create, mkdir, symlink,
    mknod, a rename into, out of or within them) or removed from them (unlink, rmdir), or changed in
    place there (chmod, chown, utimens, truncate, setxattr, removexattr; also of the moved directory
    itself) run one after the other. A rename moves the objects it finds when it starts, each in two
    steps (its meta under the new name, then its claim of the old name: a tombstone on a fresh nuid that
    expects the revision it read; before, a purge of the old name's meta up to that revision); an entry
    published under the old path meanwhile stayed behind and brought the old directory back,
    one removed by its old path between the two steps left a tombstone carrying the renamed object's
    nuid, and one changed by its old path between them got a live meta there again (the purge leaves a
    newer one alone): the object under both names, two live metas with one nuid. So an entry waits while
    a directory it is added to, removed from or changed in (or one above) is being renamed, and then
    goes by the directory's new path; a rename waits for the entries being added, removed or changed
    there, and moves what is left. A file staged there (an open with O_TRUNC, a handle's first write:
    `Filesystem._staged_here`) counts as an entry changed: staged after the rename took the upload locks
    of the files staged there, its close put it under the old name while the rename moved it.

    Lock order: this gate (`adding`, `renaming`), then `_DirTimeGate`, then the locks of staged files
    (`StagedFile.lock`, in inode order, `Filesystem._uploads_settled`). A rename holds the gate while it
    waits for those locks and moves the objects; so nothing may wait for the gate while it holds a staged
    file's lock. (An open with O_TRUNC that found its file dropped while it waited for the lock staged it
    again from inside that lock: with staging behind this gate, it waited for a rename that waited for
    that lock, and a real mount hung within seconds with two writers and a directory renamed in a loop.)
    The operations holding a staged file's lock (a write, a truncate, an upload) wait for no gate."""

    def __init__(self) -> None:
        super().__init__()
        self._adding: Counter[tuple[str, ...]] = Counter()  # directory -> entries being added in it
        self._renaming: Counter[tuple[str, ...]] = Counter()  # directories being renamed (old and new path)

    @contextlib.asynccontextmanager
    async def adding(self, *directories: Callable[[], tuple[str, ...]]
                     ) -> AsyncIterator[tuple[tuple[str, ...], ...]]:
        """Held while an entry is added, removed or changed (a rename: moved out of one directory into
        another; a change in place: `directories()` is the entry's own path): yields the paths the
        `directories()` have once no rename moves any of them (all at once: one held while waiting for
        another could hold up the rename that one waits for). Never entered again while held: a rename
        that started meanwhile waits for the outer one, which would wait for that rename."""
        while any(_under(directory(), moved) for directory in directories for moved in self._renaming):
            await self._wait()
        paths = tuple(directory() for directory in directories)
        for path in paths:
            self._adding[path] += 1
        try:
            yield paths
        finally:
            for path in paths:
                self._adding[path] -= 1
                if not self._adding[path]:
                    del self._adding[path]
            if self._renaming:  # (only renames wait for entries being added)
                self._notify()

    @contextlib.asynccontextmanager
    async def renaming(self, *directories: tuple[str, ...]) -> AsyncIterator[None]:
        for d in directories:
            self._renaming[d] += 1  # first: no entry starts being added there from now on
        try:
            while any(_under(added, d) for added in self._adding for d in directories):
                await self._wait()
            yield
        finally:
            for d in directories:
                self._renaming[d] -= 1
                if not self._renaming[d]:
                    del self._renaming[d]
            self._notify()


class Filesystem:
    """The mount's filesystem, one method per FUSE operation (see the module docstring)."""

    def __init__(self, namespace: Namespace, cache: ChunkCache, config: Config, staging: Staging,
                 kernel: KernelNotifier | None = None, journal: WriteBackJournal | None = None,
                 openers: Openers | None = None):
        self.ns = namespace
        self.cache = cache
        self.config = config
        self.inodes = InodeTable()
        self.handles = HandleTable()
        self.writable = not config.read_only
        # Requests in flight per inode they name; invalidations of those inodes wait (kernel.py).
        self._in_flight: dict[InodeNo, int] = {}
        self.kernel = kernel if kernel is not None else KernelNotifier()
        self.kernel.busy = self._in_flight.__contains__
        self.staging = staging
        self.mut = Mutations(namespace, namespace.store, self.staging, config)
        self.mut.on_sealed_changed = self._sealed_changed
        self.files = OpenFileTable()
        self.openers = openers if openers is not None else ProcOpeners(config.mountpoint)
        self._mount_root = str(config.mountpoint.resolve())  # resolved before mounting, never after
        self.signer = SymlinkSigner(config.cache_dir / "symlink.key")
        self._link_refusal_logged = False  # the first refused link() of this mount is logged at INFO
        # (bucket, nuid, revision) -> mtime: versions this mount stored keep showing the time of their
        # last write, not the later time of their meta message, so a stored file's mtime and ctime do
        # not jump at close (tar's placeholder check compares them). Bounded; lost at unmount.
        self._written_mtimes: dict[tuple[str, str, int], int] = {}
        # Directories whose entries this mount changed: mount path -> when (their mtime and ctime).
        # Persisted to the directory's marker a moment later (coalesced), where one exists.
        self._dir_mtimes: dict[tuple[str, ...], int] = {}
        self._dir_times_pending: set[tuple[str, ...]] = set()
        # The unmount's wait for the open writers' uploads (`shutdown`), and why it was cut short.
        self._shutdown_wait: trio.CancelScope | None = None
        self._shutdown_cut: str | None = None
        self._dir_gate = _DirTimeGate()
        self._dir_renames = _DirRenameGate()
        # Paths (and everything under them) this mount's renames are moving right now, from before the
        # first publish until the inode table follows. Lookups, attributes and opens of inodes there wait
        # (see `_after_renames`).
        self._renaming: list[tuple[str, ...]] = []
        self._renames_ended = trio.Event()
        # The size last handed to the kernel for each file inode (the kernel's i_size, as far as we
        # know): an open pinning a version of another size is not served through the page cache.
        self._told_sizes: dict[InodeNo, int] = {}
        # The inodes last handed to the kernel as directories: a change that leaves such a path a
        # directory drops only its attributes, never its entry (see `entry_changed`).
        self._told_dirs: set[InodeNo] = set()
        # Per inode, the calling threads an open of it was refused `ESTALE` for, whose retry has not come
        # yet (see `_kernel_size_stale`): their next open of it is never refused.
        self._size_revalidations: dict[InodeNo, set[int]] = {}
        # Per thread whose open of an inode this mount replaced or deleted (nothing held its version) was
        # refused `ESTALE`: the path that inode had. The kernel walks it again and retries the open once;
        # the inode the walk reaches is held for that retry (`_retry_holds`, see `_hold_for_retry`).
        self._refused_opens: dict[int, tuple[str, ...]] = {}
        self._retry_holds: dict[int, _RetryHold] = {}
        # What inodes whose file this mount unlinked showed (from the start of the unlink), while the
        # kernel may still reach them: see `getattr`. Dropped when the kernel forgets the inode, or a
        # create gives it a new file.
        self._unlinked_nodes: dict[InodeNo, Node] = {}
        # Links already logged as unable to point into the mount (bucket, nuid, revision): one line each.
        self._reported_links: set[tuple[str, str, int]] = set()
        # Directory entries already logged as skipped by readdir (path, revision): one line each.
        self._reported_entries: set[tuple[tuple[str, ...], int]] = set()
        # Versions (bucket, nuid, revision) already logged for keys listxattr leaves out: one line each.
        self._reported_xattr_keys: set[tuple[str, str, int]] = set()
        self._nursery: trio.Nursery | None = None
        self._refreshing: set[str] = set()  # buckets whose sealed state is being read in the background
        # Per bucket, when a lookup or getattr last had its sealed state read again (`_refresh_sealed`).
        self._sealed_refreshed: dict[str, float] = {}
        # Staged files whose bytes belong in lost+found but could not be written there (UNKEPT, see
        # `_keep`): no longer in `staging`, held here until a retry keeps them.
        self.unkept: list[StagedFile] = []
        self._unkept_added = trio.Event()
        self.counters = {"writes": 0, "write_bytes": 0, "uploads": 0, "upload_bytes": 0, "conflicts": 0,
                         "flushes_deferred": 0}
        self.op_counts: Counter[str] = Counter()  # FUSE requests served, per operation (fs.py counts them)
        # Write-back mode (--write-back): closes are made durable locally and uploaded in the background.
        self.writeback: WriteBack | None = None
        if config.write_back is not None and journal is not None:
            self.writeback = WriteBack(self, journal, config.write_back, staging.spool.dir.parent)
            self.inodes.pinned = self._upload_pending

    def start(self, nursery: trio.Nursery) -> None:
        """Background work of the operations (kernel invalidations, refreshes) runs in `nursery`."""
        self._nursery = nursery
        self.kernel.start(nursery)
        self.mut.start(nursery)
        if self.writeback is not None:
            self.writeback.resume()
            nursery.start_soon(self.writeback.run)
        nursery.start_soon(self._retry_keeping_loop)
        self.ns.on_change = self.entry_changed

    def entry_changed(self, bucket: str, rel: tuple[str, ...] | None) -> None:
        """The namespace says an entry appeared, changed or vanished: drop what the kernel cached of it.

        Unchanged objects keep their page cache; a changed one loses its attributes and pages, so the
        next access comes back to us and sees the new version. The name's entry is dropped only where
        the kernel's may be wrong: the name shows nothing now, or something the kernel holds no inode of
        (a negative entry, a detached inode), or a thing of another kind. A directory that stays a
        directory (its marker added, changed, its times stored) and a file this mount is uploading
        keep their entries: the kernel's invalidation of a directory's entry unhashes it, and a process
        whose working directory it is then gets ENOENT from getcwd(3) (git, make and shells call it),
        until something walks the path again.
        """
        if rel is None:
            if self.ns.single_bucket is None and not self.files.is_own((bucket,)):
                ino = self.inodes.known((bucket,))
                if ino is None or ino not in self._told_dirs or not self.ns.bucket_listed(bucket):
                    self.kernel.entry(ROOT_INODE, os.fsencode(bucket))
                self.kernel.inode(ROOT_INODE, attr_only=True)
            return
        path = self.ns.mount_path(bucket, rel)
        if self.files.is_own(path):
            # This mount is changing it right now: the kernel learns the outcome from our answer, and
            # the request holds the very locks an invalidation would wait for.
            return
        ino = self.inodes.known(path)
        if ino is not None and self._readers_left_behind(ino, bucket, rel):
            # Open handles read the version they opened, but the path now shows another one (or
            # nothing). The path gets a fresh inode at its next lookup; the old inode stays with those
            # handles, with its own attributes and page cache, as a file replaced by rename(2) or
            # unlinked while open does on a local disk. Neither ever sees the other's bytes or size.
            self._detach(path)
            ino = None
        entry_holds = False
        if ino is not None and self.files.uploading(ino):
            # Our own upload: the page cache holds exactly what was written; only attributes moved, and
            # the name still names this inode.
            self.kernel.inode(ino, attr_only=True)
            entry_holds = True
        elif ino is not None:
            self.files.forget_cached_version(ino)
            self.kernel.inode(ino)
            entry_holds = self._still_a_directory(ino, bucket, rel)
        if path and not entry_holds:
            parent = self.inodes.known(path[:-1])
            if parent is not None:
                self.kernel.entry(parent, os.fsencode(path[-1]))

    def _still_a_directory(self, ino: InodeNo, bucket: str, rel: tuple[str, ...]) -> bool:
        """Whether the kernel holds `ino` as a directory and `rel` in `bucket` still shows one (a
        bucket's root included): its entry is right."""
        if ino not in self._told_dirs or self.staging.at_path(self.ns.mount_path(bucket, rel)) is not None:
            return False
        index = self.ns.loaded_index(bucket)
        entry = index.get(rel) if index is not None else None
        return entry is not None and not isinstance(entry, ObjectInfo)

    @contextlib.contextmanager
    def serving(self, inodes: Sequence[InodeNo]) -> Iterator[None]:
        """A request naming `inodes` is being served: the kernel may hold their inode or page locks
        until it is answered, so no invalidation that could wait on them goes out meanwhile."""
        for ino in inodes:
            self._in_flight[ino] = self._in_flight.get(ino, 0) + 1
        try:
            yield
        finally:
            for ino in inodes:
                left = self._in_flight.pop(ino, 1) - 1
                if left:
                    self._in_flight[ino] = left
                else:
                    self.kernel.idle(ino)

    @contextlib.contextmanager
    def _moving(self, *paths: tuple[str, ...]) -> Iterator[None]:
        """A rename of this mount moves `paths`: from its first publish until the inode table follows,
        the index and the inode table disagree about them (the target path already shows the renamed
        object while its inode is still the replaced file's; the source path shows nothing while its
        inode is still there)."""
        self._renaming.extend(paths)
        try:
            yield
        finally:
            for p in paths:
                self._renaming.remove(p)
            self._renames_ended.set()
            self._renames_ended = trio.Event()

    def _being_renamed(self, path: tuple[str, ...]) -> bool:
        return any(path[: len(p)] == p for p in self._renaming)

    async def _after_renames(self, path: tuple[str, ...]) -> bool:
        """Wait until no rename of this mount moves `path`; True if one did (the caller looks again).

        rename(2) is atomic: a reader of the target sees the replaced file or the renamed one, whole.
        The kernel holds the renamed and the replaced inode locked while our rename runs, but an open or
        a lookup reaching them through its cached names takes no such lock: answered in the middle, an
        open of the replaced inode would pin the renamed object's version (the index shows it already)
        on the inode whose size the kernel caches for the replaced one, and the kernel would read the
        new bytes up to the old size (cut short, or padded with zeros); an open of the renamed inode
        would find its old name gone (ENOENT). Waiting for the rename answers them as after it."""
        if not self._being_renamed(path):
            return False
        while self._being_renamed(path):
            await self._renames_ended.wait()
        return True

    def handle_inode(self, fh: HandleNo) -> InodeNo | None:
        handle = self.handles.get(fh)
        return handle.ino if handle is not None else None

    def _detach(self, path: tuple[str, ...]) -> None:
        """The name at `path` is gone: its inode keeps only its open handles, not the kernel's pages."""
        ino = self.inodes.detach(path)
        if ino is not None:
            self.files.forget_cached_version(ino)

    def _detach_if_left_behind(self, ino: InodeNo) -> None:
        """After this mount's upload of `ino` lost to another client's version: handles still open on
        it (other readers and writers of the staged bytes, which went to lost+found) hold a version the
        path no longer shows. The watch's report of that version came while the file was staged, which
        detaches nothing, so it is detached now, as the watch does (the next open did it, but until then
        an `ftruncate` through such a handle truncated and stored the other client's version)."""
        try:
            path = self.inodes.path_of(ino)
            bucket, rel = self.ns.split(path)
        except DetachedPath:
            return
        if bucket is None or not rel or not self._readers_left_behind(ino, bucket, rel):
            return
        self._detach(path)
        parent = self.inodes.known(path[:-1])
        if parent is not None:
            self.kernel.entry(parent, os.fsencode(path[-1]))

    def _readers_left_behind(self, ino: InodeNo, bucket: str, rel: tuple[str, ...]) -> bool:
        """Whether `ino` has handles open for reading a version the path no longer shows."""
        if not self.files.is_open(ino) or self.files.uploading(ino) or self.staging.get(ino) is not None:
            return False
        index = self.ns.loaded_index(bucket)
        current = index.get(rel) if index is not None else None
        nuid = current.nuid if isinstance(current, ObjectInfo) else None
        return any(h.info.nuid != nuid for h in self._readers(ino))

    def _readers(self, ino: InodeNo) -> list[FileHandle]:
        return [h for h in self.handles.values() if isinstance(h, FileHandle) and h.ino == ino]

    # ------------------------------------------------------------------ attributes
    def _attr(self, ino: InodeNo, node: Node) -> Attributes:
        c = self.config
        size, nlink, rdev = 0, 1, 0
        writable = self.writable and not (node.bucket is not None and self._known_sealed(node.bucket))
        if node.kind in (ROOT, BUCKET, DIR):
            marker = node.dir.marker if node.dir is not None else None
            mode, uid, gid = _owner(marker.attrs if marker is not None else None, c.dir_mode, c.uid, c.gid,
                                    c.allow_setuid)
            if node.kind == ROOT and self.ns.single_bucket is None:
                mode = c.dir_mode  # buckets are made with mkdir here
            mode = stat.S_IFDIR | (mode if writable else mode & ~0o222)
            nlink = 2
            self._told_dirs.add(ino)
        elif node.kind == LINK:
            self._told_dirs.discard(ino)
            assert node.info is not None
            _, uid, gid = _owner(node.info.attrs, 0, c.uid, c.gid, False)
            mode = stat.S_IFLNK | 0o777
            size = len(os.fsencode(self._link_target(node)))
        else:
            self._told_dirs.discard(ino)
            info = node.info
            assert info is not None
            mode, uid, gid = _owner(info.attrs, c.file_mode, c.uid, c.gid, c.allow_setuid)
            kind = info.attrs.kind if info.attrs is not None and info.size == 0 else None
            if kind is not None:
                # A FIFO, socket or device node (its object is empty; one with bytes is a regular file,
                # whatever its metadata says). The mount is nodev: a device node never opens a device.
                mode = SPECIAL_KINDS[kind] | (mode if writable else mode & ~0o222)
                assert info.attrs is not None
                rdev = info.attrs.rdev or 0
            else:
                mode = stat.S_IFREG | (mode if writable else mode & ~0o222)
            # Deleted or replaced while open: no name links to it any more, as fstat shows on a local disk.
            nlink = 0 if self._nameless(ino) else 1
            size = info.size
            self._told_sizes[ino] = size
        # Large enough that cp, cat and dd move 1 MiB per system call (fewer FUSE round trips).
        blksize = max(self.cache.store.chunk_size, 1 << 20)
        mtime_ns = node.mtime_ns
        if node.kind in (BUCKET, DIR) and node.bucket is not None:
            mtime_ns = self._dir_mtimes.get(self.ns.mount_path(node.bucket, node.rel), mtime_ns)
        if node.kind == FILE and node.info is not None and node.bucket is not None:
            mtime_ns = self._written_mtimes.get((node.bucket, node.info.nuid, node.info.revision), mtime_ns)
        entry_timeout, attr_timeout = c.entry_timeout, c.attr_timeout
        if self.kernel.degraded:  # nothing could tell the kernel of a change now: it must ask again soon
            entry_timeout, attr_timeout = min(entry_timeout, DEGRADED_TIMEOUT), min(attr_timeout, DEGRADED_TIMEOUT)
        return Attributes(ino=ino, mode=mode, nlink=nlink, size=size, uid=uid, gid=gid,
                          mtime_ns=mtime_ns if mtime_ns is not None else self.ns.started_ns, blksize=blksize,
                          entry_timeout=entry_timeout, attr_timeout=attr_timeout, rdev=rdev)

    def _link_target(self, node: Node) -> str:
        """The symlink's target: its verbatim text where natsfs/links.py allows it, else built only from
        validated parts."""
        info = node.info
        assert info is not None and node.bucket is not None
        link_path = self.ns.mount_path(node.bucket, node.rel)
        text = info.attrs.symlink if info.attrs is not None else None
        if text is not None:
            if stays_in_mount(text, link_path, self._mount_root) or self.signer.verify(
                    node.bucket, text, info.attrs.symlink_sig if info.attrs is not None else None):
                return text
            if info.link is None:
                if (node.bucket, info.nuid, info.revision) not in self._reported_links:
                    self._reported_links.add((node.bucket, info.nuid, info.revision))
                    log.warning("symlink %r in bucket %r reads as %r: its text %r leaves the mount and was not "
                                "written by this user", info.name, node.bucket, OUTSIDE_TARGET, text)
                return OUTSIDE_TARGET
        assert info.link is not None
        target = link_target(info.link, link_path, self.ns.single_bucket, marker=self._links_a_marker(info.link))
        if target.outside is None and self._held_by_another(info.link):
            target = LinkTarget(HIDDEN_TARGET, f"its object {info.link.name!r} is hidden by another entry at its "
                                               "path (see the daemon log)")
        if target.outside is not None and (node.bucket, info.nuid, info.revision) not in self._reported_links:
            self._reported_links.add((node.bucket, info.nuid, info.revision))
            log.log(logging.WARNING if target.hostile else logging.INFO, "link %r in bucket %r reads as %r: %s",
                    info.name, node.bucket, target.text, target.outside)
        return target.text

    def _held_by_another(self, link: Link) -> bool:
        """Whether the path a link's object would show at holds another entry (a real name its escaped
        form collides with, or a directory where it is a file): following the link would reach that
        entry instead. Only where the target's bucket is loaded; a missing object just dangles."""
        index = self.ns.loaded_index(link.bucket)
        if index is None or link.name is None:
            return False
        if self._links_a_marker(link):
            return False  # it shows as its directory, which is where the link leads
        placed, _ = placement(link.name)
        entry = index.get(placed) if placed is not None else None
        return entry is not None and (not isinstance(entry, ObjectInfo) or entry.name != link.name)

    def _refuse_unreadable_meta(self, bucket: str, name: str) -> None:
        """A name whose meta subject holds a meta this mount skipped (not ADR-20 it can read) shows
        nothing, but its store would fail when it reads that meta back: at the close, with the bytes
        sent to lost+found. Refuse at once instead, as `symlink` and `mknod` do."""
        index = self.ns.loaded_index(bucket)
        if index is not None and meta_subject(bucket, name) in index.malformed:
            raise MalformedMeta(f"{bucket}/{name}: its meta subject holds a meta this mount cannot read (logged "
                                "when it was skipped; `natsfs fsck` reports it): fix or remove it with another "
                                "client first")

    def _links_a_marker(self, link: Link) -> bool:
        """Whether a link names a directory marker (an empty `dir/` object) of a loaded bucket: it shows
        as its directory, so the link must lead there, not to the escaped name `dir%2F`."""
        index = self.ns.loaded_index(link.bucket)
        target = index.objects.get(link.name) if index is not None and link.name is not None else None
        return target is not None and is_marker(target)

    def _known_sealed(self, bucket: str) -> bool:
        return bool(self.mut.known_sealed(bucket))

    async def _node(self, ino: InodeNo, hold: _RetryHold | None = None) -> Node:
        """What an inode is now: its staged state while that differs from the bucket, else the index.
        `hold`: the calling open is a kernel retry whose walk reached `ino` (see `_hold_for_retry`)."""
        while True:
            sf = self.staging.get(ino)
            if sf is not None and sf.shown:
                return self._staged_node(sf)
            path = self.inodes.path_of(ino)
            if await self._after_renames(path):
                continue
            try:
                node = await self.ns.resolve(path)
            except NotFound:
                if self._being_renamed(path):
                    continue  # a rename of this mount started meanwhile: answered as after it
                readers = self._readers(ino)
                if not readers and hold is not None and self._held_version_kept(hold, ino):
                    # Replaced or deleted by this mount after the retry's walk reached it: that version.
                    return Node(FILE, hold.bucket, (), None, hold.info, hold.info.mtime_ns)
                if not readers and self._nameless(ino):
                    # Replaced or deleted, and nothing holds its version: the kernel reached it through
                    # a name it still caches (a rename's target, before the kernel moved the renamed
                    # entry there; or a change by another client, before its invalidation landed), or
                    # through a descriptor that holds no handle (`O_PATH`).
                    if await self._former_path_empty(ino):
                        # Deleted: what a stat of the name gives, with nothing to walk to (a local disk
                        # would show an `O_PATH` descriptor's unlinked file with no link; the two come
                        # as the same request).
                        raise NotFound(f"inode {ino} was deleted") from None
                    # Replaced: ESTALE, not ENOENT: open(2) and stat(2) then walk the path again,
                    # revalidating every name with us, and reach what the name shows now.
                    raise Stale(f"inode {ino} was replaced", log_level=logging.DEBUG) from None
                if not readers or not self._nameless(ino):
                    raise
                # Deleted or replaced while open (by this mount or another client): what its handles hold.
                info = readers[0].info
                return Node(FILE, info.bucket, (), None, info, info.mtime_ns)
            if self.inodes.path_of(ino) == path and not self._being_renamed(path):
                return node
            # Renamed, or detached (replaced while open) while the index was awaited: what the path
            # shows now may be another inode's.

    async def _former_path_empty(self, ino: InodeNo) -> bool:
        """Whether the path detached `ino` had shows nothing now (its file was deleted, not replaced)."""
        former = self.inodes.detached_from(ino)
        if former is None or self._being_renamed(former):
            return False  # (a rename onto it is under way: something shows there once it is done)
        return await self._maybe_node(former) is None and not self._being_renamed(former)

    async def _path_node(self, path: tuple[str, ...]) -> Node:
        sf = self.staging.at_path(path)
        if sf is not None:
            return self._staged_node(sf)
        return await self.ns.resolve(path)

    async def _check_new_entry(self, path: tuple[str, ...]) -> None:
        """`path` is free for a new object, in a bucket or directory (the root of a `--bucket` mount is
        its bucket; `_in_bucket` has refused the root of an all-buckets mount already)."""
        if await self._maybe_node(path) is not None:
            raise AlreadyExists("/".join(path))
        await self._check_parent(path)

    async def _check_parent(self, path: tuple[str, ...]) -> None:
        parent = await self._path_node(path[:-1])
        if parent.kind not in (ROOT, BUCKET, DIR):
            raise NotADirectory("/".join(path[:-1]))

    @contextlib.asynccontextmanager
    async def _new_entry(self, parent_inode: InodeNo, path: tuple[str, ...], check: Callable[[], Awaitable[None]]
                         ) -> AsyncIterator[bool]:
        """`check()` that `path`, made from the directory `parent_inode`'s path, can take a new entry, then
        hold while the caller stores it there. Yields False (store nothing) when that directory was renamed
        meanwhile: the entry belongs under its new path (as on a local disk, where it lands in the renamed
        directory), so the caller starts again from there. A directory rename under way is waited for,
        and one that starts waits until the caller is done (`_DirRenameGate`): stored under the old path
        then, the entry stayed behind and brought the old directory back."""
        checked = False
        try:
            await check()
            checked = True
        except NatsFSError:
            if self.inodes.path_of(parent_inode) == path[:-1]:
                raise
            # (renamed while checking: the answer was about the old path)
        async with self._dir_renames.adding(lambda: self.inodes.path_of(parent_inode)) as (directory,):
            here = checked and directory == path[:-1]
            if not here:
                yield False
                return
            # The new entry is this mount's own change: the kernel learns it from our answer. Its
            # report (from the store's answer, or the watch when that comes first) must not invalidate
            # the name: held back while this request runs, it would reach the kernel after the answer
            # and drop the entry just made (a directory's, with a process already inside it).
            with self.files.changing(path):
                try:
                    yield True
                except NatsFSError:
                    # Not made (another client's entry got there first, say): the kernel may hold a
                    # negative entry for the name; it goes once this request is answered.
                    self.kernel.entry(parent_inode, os.fsencode(path[-1]))
                    raise

    async def _maybe_node(self, path: tuple[str, ...]) -> Node | None:
        try:
            return await self._path_node(path)
        except NotFound:
            return None

    def _staged_node(self, sf: StagedFile) -> Node:
        info = sf.as_info()
        try:
            rel = self.ns.split(sf.path)[1]
        except DetachedPath:
            rel = ()  # unlinked or replaced while open: a file without a name (it is never stored)
        return Node(FILE, sf.bucket, rel, None, info, sf.mtime_ns)

    def _refuse_if_read_only(self) -> None:
        if self.config.read_only:
            raise ReadOnly("this mount is read-only")

    def _in_bucket(self, path: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """(bucket, path inside it) for a path where objects can live; EPERM at a multi-bucket root."""
        bucket, rel = self.ns.split(path)
        if bucket is None or not rel:
            raise NatsFSError("only buckets (directories) live at the root", errno=errno.EPERM,
                              log_level=logging.INFO)
        return bucket, rel

    # ------------------------------------------------------------------ lookups
    async def lookup(self, parent_inode: InodeNo, name: bytes, thread: int = 0) -> Attributes:
        """`thread`: the calling thread (0: unknown), for the kernel's walk again after an open refused
        `ESTALE` (see `_hold_for_retry`)."""
        parent = self.inodes.path_of(parent_inode)
        if len(name) > NAME_MAX:
            raise NameTooLong(f"lookup of a {len(name)}-byte name")
        path = (*parent, _name(name))
        if name in (b".", b".."):
            raise NotFound("dot lookups are answered by the kernel")
        while True:  # (a kernel lookup reaching a name a rename moves: its revalidation of a cached name)
            await self._after_renames(path)
            try:
                node = await self._path_node(path)
            except NotFound:
                if self._being_renamed(path):
                    continue
                raise
            if not self._being_renamed(path):
                break
        if node.bucket is not None:
            await self._refresh_sealed(node.bucket, first_waits=node.kind == BUCKET)
        ino = self.inodes.lookup(path)
        # (No await since the renames were waited for: a rename that starts now finds the hold.)
        ended = self._hold_for_retry(thread, ino, path, node) if thread else None
        attrs = self._attr(ino, node)
        if ended is not None:
            await self._hold_ended(ended)
        return attrs

    async def _refresh_sealed(self, bucket: str, *, first_waits: bool = False) -> None:
        """Whether a bucket is sealed (its entries then show without write bits) is read again in the
        background, at most every `sealed_ttl` per bucket, when a lookup or getattr of any entry of it
        comes (another client may seal it at any time; in a `--bucket` mount nothing looks the bucket
        itself up): the request answers from what is known and never waits on the server. A read that
        finds the state changed has the kernel drop the attributes of the bucket's inodes
        (`_sealed_changed`), so the next stat shows the new mode. `first_waits`: a lookup of the bucket
        directory with nothing known yet reads it first (it answers with its mode)."""
        if first_waits and (self._nursery is None or self.mut.known_sealed(bucket) is None):
            await self.mut.sealed(bucket)
            return
        if self._nursery is None:
            return
        now = time.monotonic()
        if bucket in self._refreshing or now - self._sealed_refreshed.get(bucket, -math.inf) < self.config.sealed_ttl:
            return
        self._sealed_refreshed[bucket] = now
        self._refreshing.add(bucket)
        self._nursery.start_soon(self._read_sealed, bucket)

    async def _read_sealed(self, bucket: str) -> None:
        try:
            await self.mut.sealed(bucket)  # (a change it finds calls `_sealed_changed`)
        except NatsFSError as e:
            log.debug("bucket %s: sealed state not refreshed: %s", bucket, e)
        finally:
            self._refreshing.discard(bucket)

    def _sealed_changed(self, bucket: str) -> None:
        """A read of `bucket`'s sealed state found it changed: every inode of the bucket the kernel may
        cache attributes of shows another mode now (write bits dropped, or back). Attribute-only
        invalidations take no lock, so they go out at once, also for inodes a request is serving."""
        for ino in self.inodes.under(self.ns.mount_path(bucket, ())):
            self.kernel.inode(ino, attr_only=True)

    async def getattr(self, inode: InodeNo) -> Attributes:
        """What `inode` shows. One whose file this mount unlinked, that no handle holds, shows the file it
        was, with no link, as on a local disk: the kernel reaches it only through a walk that found its
        name before the unlink dropped it (the kernel drops the name of a file it unlinks), or through a
        descriptor without a handle (`O_PATH`). Such a walk is often an `open(2)`, whose permission
        check asks for the attributes before it sends the OPEN: ENOENT there failed the open, where its
        OPEN, refused `ESTALE`, makes the kernel walk again and open (or, with `O_CREAT`, create) what
        the name shows then."""
        try:
            node = await self._node(inode)
        except NotFound:
            unlinked = self._unlinked_nodes.get(inode)
            if unlinked is None:
                raise
            return dataclasses.replace(self._attr(inode, unlinked), nlink=0)
        if node.bucket is not None:
            await self._refresh_sealed(node.bucket)
        return self._attr(inode, node)

    def _nameless(self, inode: InodeNo) -> bool:
        return self.files.is_unlinked(inode) or self.inodes.is_detached(inode)

    def forget(self, inode_list: Sequence[tuple[InodeNo, int]]) -> None:
        for ino, nlookup in inode_list:
            if self.inodes.forget(ino, nlookup):
                self.files.forget_cached_version(ino)
                self._unlinked_nodes.pop(ino, None)
                self._told_sizes.pop(ino, None)
                self._told_dirs.discard(ino)
                self._size_revalidations.pop(ino, None)
                # A retry that held it never came (the kernel opens no inode it forgot).
                for thread in [t for t, h in self._retry_holds.items() if h.ino == ino]:
                    hold = self._retry_holds.pop(thread)
                    if self._nursery is not None:
                        self._nursery.start_soon(self._hold_ended, hold)

    async def readlink(self, inode: InodeNo) -> bytes:
        node = await self._node(inode)
        if node.kind != LINK:
            raise NatsFSError("not a symlink", errno=errno.EINVAL, log_level=logging.DEBUG)
        return os.fsencode(self._link_target(node))

    # ------------------------------------------------------------------ directories
    async def opendir(self, inode: InodeNo) -> HandleNo:
        path = self.inodes.path_of(inode)
        return self.handles.add(DirHandle(inode, path, await self._listing(path)))

    async def _listing(self, path: tuple[str, ...]) -> list[tuple[str, tuple[str, ...], Node]]:
        """The snapshot a directory handle lists: (name, path, node) of each entry, sorted by name."""
        listing = dict(await self.ns.listdir(path))
        for sf in self.staging.children(path):
            listing[sf.path[-1]] = self._staged_node(sf)
        return [(name, (*path, name), listing[name]) for name in sorted(listing)]

    async def readdir(self, fh: HandleNo, start_id: int, reply: Callable[[bytes, Attributes, int], bool]) -> None:
        """Hand the entries from `start_id` on to `reply(name, attributes, next id)` until it refuses one;
        an entry counts as a lookup only once it was accepted."""
        handle = self.handles.get(fh)
        if not isinstance(handle, DirHandle):
            raise NatsFSError("bad directory handle", errno=errno.EBADF)
        # The directory may have been renamed (or removed) since opendir: its entries are where it is now.
        directory = self.inodes.path_of(handle.ino) if self.inodes.known(handle.path) != handle.ino else handle.path
        if start_id == 0 and handle.listed:
            # Read from the start again after a first pass (rewinddir, or lseek(fd, 0): Python's
            # os.listdir(fd) does it): POSIX says the directory then shows as it is now, not as at opendir.
            try:
                handle.entries = await self._listing(directory)
            except NotFound:
                handle.entries = []  # removed since: empty, as a removed directory reads on a local disk
            handle.path = directory
        handle.listed = True
        for i in range(start_id, len(handle.entries)):
            name, listed_path, listed = handle.entries[i]
            path = listed_path if directory == handle.path else (*directory, name)
            # The names are the snapshot taken at opendir, but the kernel caches the attributes handed
            # with each entry for its inode: they must be what the path shows now (after a replace, the
            # new version's size, on the fresh inode the path got if readers keep the old one). A name
            # gone since opendir (deleted, or renamed away) is left out: handed over, the kernel would
            # keep an entry (and this mount an inode) for a name that shows nothing.
            known = self.inodes.known(path)
            staged = self.staging.get(known) if known is not None else None
            if staged is not None and staged.shown:
                node = self._staged_node(staged)
            else:
                current = self._loaded_node_now(path)
                if current is None and self._listing_is_loaded(path):
                    continue
                node = current or listed
            ino = self.inodes.ino_for(path)
            try:
                accepted = reply(os.fsencode(name), self._attr(ino, node), i + 1)
            except Exception as e:
                # One entry whose attributes cannot be built or handed over must never hide the rest
                # of its directory: it is left out (the kernel did not take it: no lookup counted).
                self._report_skipped_entry(path, node, e)
                accepted = None
            if not accepted:
                if self.inodes.lookup_count(ino) == 0 and self.inodes.forget(ino, 0):
                    self.files.forget_cached_version(ino)
                    self._told_sizes.pop(ino, None)
                    self._told_dirs.discard(ino)
                    self._size_revalidations.pop(ino, None)
                if accepted is None:
                    continue
                return
            self.inodes.lookup(path)

    def _loaded_node_now(self, path: tuple[str, ...]) -> Node | None:
        try:
            return self.ns.loaded_node(path)
        except NotFound:  # (under a removed directory's placeholder)
            return None

    def _listing_is_loaded(self, path: tuple[str, ...]) -> bool:
        """Whether what `path` shows now is known without asking the server (an entry inside a bucket
        whose index is loaded, or under a removed directory): then nothing there means it is gone."""
        try:
            bucket, rel = self.ns.split(path)
        except NotFound:
            return True
        return bool(rel) and bucket is not None and self.ns.loaded_index(bucket) is not None

    def _report_skipped_entry(self, path: tuple[str, ...], node: Node, e: Exception) -> None:
        key = (path, node.info.revision if node.info is not None else 0)
        if key in self._reported_entries:
            return
        self._reported_entries.add(key)
        log.error("readdir: %s left out of its directory, its attributes could not be handed over: %r",
                  "/".join(path), e)
        log.debug("readdir of %s failed here", "/".join(path), exc_info=e)

    def releasedir(self, fh: HandleNo) -> None:
        self.handles.pop(fh)

    # ------------------------------------------------------------------ files
    async def open(self, inode: InodeNo, flags: int, caller: Caller | None = None, *, revalidate: bool = False
                   ) -> Opened:
        """Open `inode`. `revalidate`: the kernel walked a path to it (FUSE_OPEN) and walks it again, asking
        for fresh attributes, if this open fails with `ESTALE` (see `_kernel_size_stale`, `_hold_for_retry`)."""
        thread = caller.pid if revalidate and caller is not None else 0
        # This thread's open after one refused `ESTALE` is the kernel's retry: whatever it opens, the
        # inode its walk reached stays held while it is answered (a rename meanwhile keeps its version),
        # and no longer.
        hold = self._retry_holds.get(thread) if thread else None
        if thread:
            self._refused_opens.pop(thread, None)
        try:
            opened = await self._open(inode, flags, caller, revalidate, hold)
            if flags & os.O_TRUNC and caller is not None and not _privileged(caller):
                self._drop_privileges_of_staged(inode, caller)  # (truncated by the open, as truncate(2))
            return opened
        except Stale:
            if thread:
                self._refused(thread, inode)
            raise
        finally:
            if hold is not None and self._retry_holds.get(thread) is hold:
                del self._retry_holds[thread]
                await self._hold_ended(hold)

    async def _open(self, inode: InodeNo, flags: int, caller: Caller | None, revalidate: bool,
                    hold: _RetryHold | None) -> Opened:
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR))
        if not flags & os.O_TRUNC:
            node = await self._node_to_open(inode, flags, caller, revalidate, hold)
            return self._open_handle(inode, node, writing, caller)
        while True:
            # An open that truncates stages the file: as any staging, it waits for a rename of a directory
            # above under way, and a rename that starts meanwhile waits for it (`_staged_here`).
            async with self._staged_here(inode):
                node = await self._node_to_open(inode, flags, caller, revalidate, hold)
                sf = self._stage(inode, node)
            # Pinned until its handle is registered: another handle's last close meanwhile leaves the file
            # to this open's handle, instead of dropping it under the truncate (EBADF) or sending the
            # emptied file to lost+found.
            try:
                async with self._pinned(sf):
                    async with self._changing(sf):
                        ended = sf.ended
                        if not ended:
                            sf.skip_copy()
                            await sf.truncate(0)
                    if not ended:
                        self.mut.after_write(sf, 0)
                        if not writing:
                            # `O_RDONLY|O_TRUNC` truncates as on a local disk (the kernel checked write
                            # permission), but no close of this read-only handle stores: stored as
                            # truncate(2) is, and refused as it is.
                            await self._store_truncated(inode, sf)
                        return self._open_handle(inode, node, writing, caller)
            except NatsFSError as e:
                if sf.failed_by == "truncate" and sf.state == WriteState.KEPT:
                    # The line that says where the bytes went gave the reason: one line per refused open.
                    e.log_level = logging.DEBUG
                raise
            # Dropped while this open waited (another handle's last close after its upload): resolve and
            # stage again, from the version that close stored. Not from inside `_changing`: staging waits
            # for a directory rename, which may wait for that lock (see `_DirRenameGate`).
            hold = None

    async def _node_to_open(self, inode: InodeNo, flags: int, caller: Caller | None, revalidate: bool,
                            hold: _RetryHold | None) -> Node:
        """The file `inode` shows, for an open with `flags` to pin (see `open`)."""
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR))
        while True:
            try:
                node = await self._node(inode, hold)
            except NotFound:
                # Deleted (here, or by another client) after the kernel's walk reached it through a name
                # it still cached (or while an unlink here is still detaching it): ESTALE, not ENOENT, so
                # the kernel walks the path again and retries, as an open on a local disk that found the
                # name: `open(O_CREAT)` (whose OPEN carries no O_CREAT) then creates the file, where ENOENT
                # said the name it asked to create is gone.
                raise Stale(f"inode {inode} was deleted while it was opened", log_level=logging.DEBUG) from None
            if node.kind != FILE:
                raise NatsFSError("not a regular file", errno=errno.EISDIR if node.kind != LINK else errno.ELOOP,
                                  log_level=logging.DEBUG)
            assert node.info is not None and node.bucket is not None
            if writing or flags & (os.O_TRUNC | os.O_APPEND):
                await self.mut.check_writable(node.bucket)
            # The object may have changed while this open awaited; its handle must read what the
            # inode shows now, or the kernel would serve two versions from one page cache.
            if self._shows_now(inode, node.info, hold):
                break
            if self._unheld_nameless(inode, hold):
                # Deleted or replaced meanwhile, and its last handle closed: nothing keeps it (its staged
                # file is being dropped, its version purged): as above.
                raise Stale(f"inode {inode} was deleted while it was opened", log_level=logging.DEBUG)
        if revalidate and self._kernel_size_stale(inode, node.info, flags, caller.pid if caller else 0):
            raise KernelSizeStale(f"{'/'.join(self.inodes.path_of(inode))}: the kernel holds "
                                  f"{self._told_sizes.get(inode)} bytes for a version of {node.info.size}")
        return node

    @contextlib.asynccontextmanager
    async def _pinned(self, sf: StagedFile) -> AsyncIterator[None]:
        """Held by an operation that stages `sf` (or changes it) and then settles it itself: an open with
        O_TRUNC registers its handle, a truncate stores it. While it runs, a last close (or the end of a
        write-back upload) leaves the staged file alone: dropping it would close its descriptor under the
        change (EBADF), and keeping its bytes in lost+found would take the change's bytes away from the
        name. If the operation ends with no handle open and nothing else pinning it (it failed), the
        file is settled here as at a last close."""
        sf.pins += 1
        try:
            yield
        finally:
            sf.pins -= 1
            if not sf.pins and not self.files.is_open(InodeNo(sf.ino)) and self.staging.get(InodeNo(sf.ino)) is sf:
                await self._settle_unused(sf)

    def _shows_now(self, inode: InodeNo, info: ObjectInfo, hold: _RetryHold | None = None) -> bool:
        """Whether a handle of version `info` may be registered on `inode` at this moment.

        Every handle of an inode reads one version, the one the inode shows: the kernel keeps one page
        cache and one size per inode. An inode keeps its path while that shows the version its handles
        read; when the path moves on, the inode is detached (`entry_changed`) and stays with its handles.
        So an open that resolved its inode before awaiting may hold a version the inode no longer shows
        (replaced meanwhile: the inode was detached and keeps the old version; or it had no handle to
        keep it and shows the new one); it then resolves again. Nor may a handle register on an inode
        replaced or deleted meanwhile that nothing kept the version of (no handle, no `hold` of the
        calling retry, `_hold_for_retry`): its chunks were purged (an `O_TRUNC` open then staged a file
        no unlink or rename had seen, which its close stored over the name as a conflict, and a write
        after another handle's close read the purged bytes: EIO); it resolves again, and is refused
        `ESTALE` (`_node`), for the kernel to walk the path again.
        """
        if self._unheld_nameless(inode, hold):
            return False
        sf = self.staging.get(inode)
        if sf is not None and sf.shown:
            return True  # reads come from the staged file, every byte of which went through this kernel
        if self._nameless(inode):
            readers = self._readers(inode)
            if not readers:
                return hold is not None and hold.info.nuid == info.nuid
            return readers[0].info.nuid == info.nuid
        path = self.inodes.path_of(inode)
        if self._being_renamed(path):
            return False  # a rename of this mount started while this open awaited: `_node` waits for it
        bucket, rel = self.ns.split(path)
        assert bucket is not None  # a file's path is inside a bucket
        if self._readers_left_behind(inode, bucket, rel):
            # Its handles read a version the path no longer shows, and nothing detached it yet (a
            # change seen while this mount's own upload of it ran, which then failed): as the watch does.
            self._detach(path)
            parent = self.inodes.known(path[:-1])
            if parent is not None:
                self.kernel.entry(parent, os.fsencode(path[-1]))
            return False
        current = self.ns.loaded_node(path)
        shown = current.info if current is not None and current.kind == FILE else None
        return shown is not None and (shown is info or (bool(info.nuid) and shown.nuid == info.nuid))

    def _unheld_nameless(self, inode: InodeNo, hold: _RetryHold | None) -> bool:
        """Whether `inode` was deleted or replaced and nothing keeps what it was: no handle open, and no
        `hold` of the calling retry that kept its version. Its staged file, if any, is being dropped by
        its last close, and its version purged; a handle registered on it now would write to a file
        that no unlink has seen (stored over the name at its close: a false conflict, ESTALE) and read
        the purged version (EIO)."""
        return self._nameless(inode) and not self._readers(inode) and not (
            hold is not None and self._held_version_kept(hold, inode))

    def _kernel_size_stale(self, inode: InodeNo, info: ObjectInfo, flags: int, thread: int) -> bool:
        """Whether an open of `inode` pinning `info`, by the calling `thread`, is refused with `ESTALE`, for
        the kernel to learn the version's size before it reads a byte of it.

        The kernel keeps one size per inode and reads through its page cache up to it (read, mmap, and
        splice, which sendfile and copy_file_range use, even on a direct_io handle). When another client
        replaced the object and the kernel has not asked for its attributes since (its invalidation
        waits while a request on the inode is answered, or the notifier is behind; and once it lands,
        the kernel asks only at its next stat or read, not at an open or a splice), the size it holds is
        the old version's: the new bytes would come back cut to it, or padded with zeros up to it.
        `open(2)` answered `ESTALE` walks its path again with LOOKUP_REVAL, which sends a LOOKUP of each
        name; its reply carries the attributes of the version the path shows (`_attr` records the size
        told), the kernel takes the new size and drops the inode's pages, and the retried open finds the
        sizes equal. The kernel retries once, in the same thread: that thread's next open of the inode
        is never refused (if its sizes still differ, e.g. the object was replaced again meanwhile, or
        the open walked no name, as one of /proc/PID/fd/N, it is answered direct_io, `_open_handle`).
        """
        told = self._told_sizes.get(inode)
        refused = self._size_revalidations.get(inode)
        retry = refused is not None and thread in refused
        if retry:
            assert refused is not None
            refused.discard(thread)
            if not refused:
                del self._size_revalidations[inode]
        if told is None or told == info.size or flags & os.O_TRUNC or retry:
            return False
        if self.staging.get(inode) is not None:
            return False  # every byte of a staged file went through this kernel: its size is the kernel's
        self._size_revalidations.setdefault(inode, set()).add(thread)
        return True

    def _refused(self, thread: int, inode: InodeNo) -> None:
        """`thread`'s open of `inode` was refused `ESTALE`: if this mount replaced or deleted the file it
        was, the kernel walks that path again and retries, and the walk's inode is held for the retry."""
        path = self.inodes.detached_from(inode)
        if path is None:
            return
        self._refused_opens.pop(thread, None)
        self._refused_opens[thread] = path
        while len(self._refused_opens) > RETRIES_KEPT:
            del self._refused_opens[next(iter(self._refused_opens))]

    def _hold_for_retry(self, thread: int, ino: InodeNo, path: tuple[str, ...], node: Node) -> _RetryHold | None:
        """A lookup by `thread` answered `ino`, showing `node`, at `path`; returns a hold of that thread's
        that ends now (the caller settles it, `_hold_ended`).

        An open of an inode this mount replaced by a rename (an atomic save: write `f.tmp`, rename it
        over `f`) reaches it through the name the kernel cached before the rename, and nothing holds its
        version (purged at the rename): it is refused `ESTALE` (`_node`), and the kernel walks the path
        again (LOOKUP_REVAL) and retries the open once, on the inode the walk reached. With several
        writers saving the same file, another rename could replace that inode too between the walk's
        lookup and the retry; refused again, the `ESTALE` would reach the program, where a local disk
        opens the file the walk found. So the walk's lookup of that path holds the inode it answers for
        the retry, as if open: a rename or unlink of this mount that replaces it keeps its version's
        chunks (and marks them to be purged once nothing holds or opens it), and the retry opens that
        version, whole, at the size the lookup handed the kernel. The hold ends at the thread's next
        open (the retry), its next such lookup, or when the kernel forgets the inode.

        (Rather than renames waiting for the retry: a writer would then wait on a reader whose retry may
        never come. Nor does the retry get the newest version on the inode its walk reached: that
        version's chunks belong to another inode, whose replacement would purge them under it.)"""
        if self._refused_opens.get(thread) != path:
            return None
        ended = self._retry_holds.pop(thread, None)
        if node.kind == FILE and node.info is not None and node.info.nuid and node.bucket is not None \
                and self.staging.get(ino) is None:  # (a staged file is not replaced away: it is served)
            self._retry_holds[thread] = _RetryHold(ino, node.bucket, node.info)
            while len(self._retry_holds) > RETRIES_KEPT:
                dropped = self._retry_holds.pop(next(iter(self._retry_holds)))
                if self._nursery is not None:
                    self._nursery.start_soon(self._hold_ended, dropped)
        return ended

    def _held(self, ino: InodeNo | None) -> bool:
        return ino is not None and any(h.ino == ino for h in self._retry_holds.values())

    def _open_here(self, ino: InodeNo | None) -> bool:
        """Whether handles of this mount read `ino`'s version, or a kernel retry of an open is about to."""
        return self.files.is_open(ino) or self._held(ino)

    def _held_version_kept(self, hold: _RetryHold, ino: InodeNo) -> bool:
        """Whether `hold` of `ino` kept its version when this mount replaced or deleted it (its chunks are
        purged once nothing holds or opens it, not at the replacement)."""
        rec = self.files.get(ino)
        return hold.ino == ino and rec is not None and rec.purge_later == (hold.bucket, hold.info.nuid)

    async def _hold_ended(self, hold: _RetryHold) -> None:
        """`hold` ended: the version it kept, if its inode was replaced or deleted meanwhile and nothing
        else holds or opens it, is purged now (as at the last close of a file unlinked while open)."""
        if self._held(hold.ino):
            return
        left = self.files.unheld(hold.ino)
        if left is not None and left.purge_later is not None:
            await self.mut.purge_unused(*left.purge_later)

    def _open_handle(self, inode: InodeNo, node: Node, writing: bool, caller: Caller | None) -> Opened:
        info = node.info
        assert info is not None
        opener = self.openers.thread_group(caller.pid) if writing and caller is not None else None
        if opener is not None:
            self.openers.opened(opener, inode)
        fh = self.handles.add(FileHandle(inode, info, writable=writing, opener=opener,
                                         unprivileged_writer=caller if writing and not _privileged(caller) else None))
        self.files.opened(inode, writing=writing)
        direct_io = False
        if self.staging.get(inode) is not None:
            keep = True  # every byte of a staged file went through this kernel's page cache
        else:
            # A version the kernel has not been told the size of (another client replaced the object
            # and this open came before the kernel took the invalidation, and the kernel's walk again
            # did not bring the size, `_kernel_size_stale`): the kernel reads through its page cache
            # up to the size it holds, so the new bytes would come back cut to the old size, or padded
            # with zeros up to it. This handle bypasses the page cache instead: its reads return exactly
            # the version it pinned, whole, whatever size the kernel holds (until the kernel asks for
            # the attributes again). Every open of it does, also after one that pinned it before.
            told = self._told_sizes.get(inode)
            direct_io = told is not None and told != info.size
            # Unchanged since the kernel last cached it (and sized for it): let the page cache serve
            # rereads.
            keep = self.files.cached_version(inode) == info.nuid and not direct_io
            if direct_io:
                # Its reads fill no page; a splice of it fills pages under the old size: none vouched for.
                self.files.forget_cached_version(inode)
            elif not keep:
                self.files.dropping_at_open(inode, info.nuid, fh)
        return Opened(fh, keep, direct_io)

    @contextlib.asynccontextmanager
    async def _staged_here(self, inode: InodeNo) -> AsyncIterator[None]:
        """Held while a file is staged (an open with O_TRUNC, the first write of a handle): from reading
        the version it starts from to its entry in the staging area. A rename of a directory above it
        under way is waited for first (the file is then staged under its new path, from the renamed
        object's revision), and a directory rename that starts meanwhile waits for the staging
        (`_DirRenameGate`), so it finds the file staged and holds its upload lock while it moves the
        objects (`_uploads_settled`). Else a file staged after the rename took those locks was put
        while the rename moved it: under its old name, which failed as another client's change (ESTALE
        at close, the bytes in lost+found) once the rename had moved the object, or landed between the
        rename's two steps and brought the old directory back holding the new bytes. Entered holding no
        staged file's lock (the lock order of `_DirRenameGate`)."""
        def path() -> tuple[str, ...]:
            try:
                return self.inodes.path_of(inode)
            except Stale:
                return ()  # (forgotten: under no directory; the staging then answers as before)

        async with self._dir_renames.adding(path):
            yield

    def _stage(self, inode: InodeNo, node: Node) -> StagedFile:
        """The shared staged state of `inode`, created from the version `node` shows if there is none
        (in `_staged_here`, or where a change in place is held, `_changed_in_place`)."""
        sf = self.staging.get(inode)
        if sf is not None and not sf.ended:
            return sf
        assert node.bucket is not None and node.info is not None
        base = node.info if node.info.nuid or node.info.revision else None
        attrs = node.info.attrs or PosixAttrs()
        sf = StagedFile(self.staging.spool, ino=inode, path=self.inodes.path_of(inode), bucket=node.bucket,
                        name=node.info.name, base=base,
                        attrs=PosixAttrs(attrs.mode, attrs.uid, attrs.gid, node.info.mtime_ns),
                        unlinked=self.files.is_unlinked(inode))
        self.staging.add(sf)
        return sf

    async def _fill(self, sf: StagedFile, upto: int | None = None) -> None:
        """Copy-on-write: bring the base version's bytes into the spool before changing them."""
        if sf.copied:
            return
        base = sf.base
        assert base is not None
        if isinstance(base, StagedVersion):
            # Staged from what a handle opened on this mount's staged bytes, which went to lost+found
            # unstored (an inode detached while such a handle holds it shows that version, `_node`).
            raise _bytes_never_stored(base)

        async def read(offset: int, size: int) -> Payload:
            return await self.cache.read(base, offset, size)

        await sf.fill(read, upto)

    async def create(self, parent_inode: InodeNo, name: bytes, mode: int, flags: int, caller: Caller
                     ) -> tuple[Opened, Attributes]:
        """Create `name` in `parent_inode` and open it (or open the file already there, without `O_EXCL`).

        A create that races an unlink, a create or a rename of the same name (or of its directory) starts
        again, at most `CREATE_ATTEMPTS` times in all; past that it answers `ESTALE` (the kernel walks the
        path again and retries the open once)."""
        self._refuse_if_read_only()
        for _ in range(CREATE_ATTEMPTS):
            done = await self._create_once(parent_inode, name, mode, flags, caller)
            if done is not None:
                return done
        path = "/".join((*self.inodes.path_of(parent_inode), _new_name(name)))
        raise Stale(f"{path}: create gave up after {CREATE_ATTEMPTS} attempts: each time, the name was "
                    "deleted, created again or moved while it was opened")

    async def _create_once(self, parent_inode: InodeNo, name: bytes, mode: int, flags: int, caller: Caller
                           ) -> tuple[Opened, Attributes] | None:
        """One attempt of `create`; None when the name (or its directory) changed under it: try again."""
        path = (*self.inodes.path_of(parent_inode), _new_name(name))
        bucket, rel = self._in_bucket(path)
        self.ns.store.check_name(bucket, "/".join(rel))
        await self.mut.check_writable(bucket)
        existing = await self._maybe_node(path)
        if existing is not None:
            if flags & os.O_EXCL:
                raise AlreadyExists("/".join(path))
            ino = self.inodes.lookup(path)
            try:
                info = await self.open(ino, flags, caller)
            except (NotFound, Stale):  # (Stale: its inode was detached, `_node`)
                # Unlinked (or renamed away) while this open awaited: the name is free, create it; or
                # created again meanwhile (by another writer): open that file, as on a local disk.
                return None
            return info, self._attr(ino, await self._node(ino))
        self._refuse_unreadable_meta(bucket, "/".join(rel))
        bits, gid = await self._new_owner(parent_inode, mode, caller)
        async with self._new_entry(parent_inode, path, lambda: self._check_parent(path)) as here:
            if here:
                ino = self.inodes.lookup(path)
                self._unlinked_nodes.pop(ino, None)  # (a file unlinked while its inode kept the name)
                # A new file starts in memory and needs a spool file only if it grows past INLINE_BYTES:
                # closed before that, it is put from memory (or, in write-back mode, its journal record
                # holds its bytes, see core/writeback.py). Creating a spool file, and removing it after the
                # upload, was about a tenth of each file of `tar -x` without write-back.
                sf = StagedFile(self.staging.spool, ino=ino, path=path, bucket=bucket, name="/".join(rel),
                                base=None, attrs=PosixAttrs(bits, caller.uid, gid, None), new=True,
                                memory_limit=INLINE_BYTES)
                self.staging.add(sf)
        if not here:
            return None  # its directory was renamed meanwhile: the entry belongs under its new path
        self._entries_changed(path[:-1])
        node = self._staged_node(sf)
        return self._open_handle(ino, node, True, caller), self._attr(ino, node)

    async def read(self, fh: HandleNo, off: int, size: int) -> Payload:
        handle = self._file_handle(fh)
        sf = self.staging.get(handle.ino)
        if sf is not None and sf.serves_reads:
            return await sf.read(off, size)
        if isinstance(handle.info, StagedVersion):
            # Opened while this mount staged the file, and those bytes are gone from the staging area
            # without being stored (the close lost to another client's version: they are in lost+found).
            # The bucket holds nothing of them: this is a version purged under the reader, not a damaged
            # object (the chunk cache, asked for a version of chunks=0 and the base's nuid, logged an
            # ERROR and failed EIO).
            raise _bytes_never_stored(handle.info)
        # (The kernel sends this only once the handle's open completed: a drop of the pages it made is done.)
        self.files.read_through(handle.ino, fh, handle.info.nuid)
        ra = handle.plan_readahead(off, size, self.config.readahead_min, self.config.readahead_max)
        try:
            return await self.cache.read(handle.info, off, size, ra)
        except Corrupt:
            # The cache refuses this version from now on; drop whatever the kernel cached of it.
            self.files.forget_cached_version(handle.ino)
            self.kernel.inode(handle.ino)
            raise
        except Stale:
            # Its chunks are gone: the cache refuses this version from now on (see `ChunkCache._gone`), and
            # the kernel's pages of it go too (once), so that a later read fails at its first byte rather
            # than copying the cached pages and coming back short where they end.
            if self.files.purged_seen(handle.ino, handle.info.nuid):
                self.files.forget_cached_version(handle.ino)
                self.kernel.inode(handle.ino)
            raise

    async def write(self, fh: HandleNo, off: int, buf: bytes) -> int:
        self._refuse_if_read_only()
        handle = self._file_handle(fh)
        if not handle.writable:
            raise NatsFSError("file not open for writing", errno=errno.EBADF)
        if handle.opener is not None and not handle.opener_located:
            handle.opener_located = True
            self.openers.located(handle.opener, handle.ino)
        while True:
            sf = self.staging.get(handle.ino)
            if sf is None or sf.ended:
                async with self._staged_here(handle.ino):  # (holding no staged file's lock: see _DirRenameGate)
                    sf = self.staging.get(handle.ino)
                    if sf is None or sf.ended:
                        sf = self._stage(handle.ino, await self._version_of(handle))
            async with self._changing(sf):
                if sf.ended:
                    continue  # dropped while this write waited: stage again
                await self._fill(sf)
                written = await sf.write(off, buf)
                if handle.unprivileged_writer is not None:
                    # (pyfuse3 tells a write nothing of its caller: the open's is the handle's)
                    self._drop_privileges_of_staged(handle.ino, handle.unprivileged_writer)
                    handle.unprivileged_writer = None
            break
        self.mut.after_write(sf, off)
        self.counters["writes"] += 1
        self.counters["write_bytes"] += written
        return written

    @contextlib.asynccontextmanager
    async def _changing(self, sf: StagedFile) -> AsyncIterator[None]:
        """Hold `sf.lock` to change its content. An upload holds that lock for its whole put; a change
        waits for it, except for a write-back upload attempt, which a change never waits for on the
        network: while the server is unreachable (or becomes so while the change waits, checked every
        `CHANGE_RECHECK_S`) the attempt could only end at its deadline, and a server that keeps the
        connection but answers nothing (stopped, overloaded) would hold it as long; so the attempt is
        interrupted (`StagedFile.interrupt_upload`) at once when the server is unreachable, else once
        the change has waited `CHANGE_WAIT_MAX_S`, and the change goes on; the file is uploaded again
        after its next close."""
        if self.writeback is None:
            await sf.lock.acquire()
        else:
            self._interrupt_stuck_upload(sf, waited_out=False)
            try:
                sf.lock.acquire_nowait()
            except trio.WouldBlock:
                # Waits in line, looking again meanwhile whatever the file's state now: an attempt ahead
                # of this change (UPLOADING, or DIRTY and waiting for the lock too) may come to wait for
                # a server that went away or stopped answering.
                async with trio.open_nursery() as watching:
                    watching.start_soon(self._interrupt_while_stuck, sf)
                    await sf.lock.acquire()
                    watching.cancel_scope.cancel()
        try:
            yield
        finally:
            sf.lock.release()

    def _interrupt_stuck_upload(self, sf: StagedFile, *, waited_out: bool) -> None:
        """Interrupt `sf`'s write-back upload attempt if the server is unreachable, or if a change of the
        file has waited `CHANGE_WAIT_MAX_S` for it (`waited_out`); one info line either way."""
        if not self.ns.store.connected:
            if sf.interrupt_upload():
                log.info("%s/%s: its write-back upload, waiting for an unreachable server, was interrupted by a "
                         "change of the file; it is uploaded again after its next close", sf.bucket, sf.name)
        elif waited_out and sf.interrupt_upload():
            log.info("%s/%s: its write-back upload was interrupted by a change of the file, which waited "
                     "%g s for it (the server answers slowly or not at all); it is uploaded again after its "
                     "next close", sf.bucket, sf.name, CHANGE_WAIT_MAX_S)

    async def _interrupt_while_stuck(self, sf: StagedFile) -> None:
        waited_out_at = trio.current_time() + CHANGE_WAIT_MAX_S
        while True:
            now = trio.current_time()
            # (Wakes exactly at `waited_out_at` once, then keeps looking every CHANGE_RECHECK_S: the attempt
            # holding the lock then may be one that began after this change started waiting.)
            await trio.sleep_until(min(now + CHANGE_RECHECK_S, waited_out_at) if now < waited_out_at
                                   else now + CHANGE_RECHECK_S)
            self._interrupt_stuck_upload(sf, waited_out=trio.current_time() >= waited_out_at)

    async def _version_of(self, handle: FileHandle) -> Node:
        """What a handle's first write starts from: the object now at the inode's path if it is still
        the version the handle opened (renamed or re-attributed by anyone: same nuid), else the pinned
        version, whose upload then fails as a conflict instead of overwriting a newer object."""
        pinned = Node(FILE, handle.info.bucket, (), None, handle.info)
        if self.files.is_unlinked(handle.ino):
            return pinned
        try:
            node = await self.ns.resolve(self.inodes.path_of(handle.ino))
        except NatsFSError:
            return pinned
        if node.kind == FILE and node.info is not None and node.info.nuid == handle.info.nuid:
            return node
        if isinstance(handle.info, StagedVersion):
            # Opened while this mount staged the file, whose bytes went to lost+found unstored (see
            # `read`): nothing in the bucket to start from (the copy-on-write of its base failed EIO
            # with an ERROR claiming the object damaged).
            raise _bytes_never_stored(handle.info)
        return pinned

    def _file_handle(self, fh: HandleNo) -> FileHandle:
        handle = self.handles.get(fh)
        if not isinstance(handle, FileHandle):
            raise NatsFSError("bad file handle", errno=errno.EBADF)
        return handle

    async def flush(self, fh: HandleNo) -> None:
        """Store at the close of the thread group that opened the handle for writing (see openers.py):
        a reader closing must not store a writer's half-written bytes, nor a child closing a descriptor
        it inherited."""
        handle = self._file_handle(fh)
        if not handle.writable:
            return
        sf = self.staging.get(handle.ino)
        if sf is None or not sf.unstored:
            return
        if handle.opener is not None and await self._opener_holds(handle.opener, handle.ino):
            self.counters["flushes_deferred"] += 1
            self.files.defer_store(handle.ino, True)
            return
        self.files.defer_store(handle.ino, False)
        try:
            await self._store_or_journal(handle.ino)
        except NatsFSError:
            # The kernel holds the size this handle's writes and truncates gave the inode, but the bucket
            # still has the version stored before, which the inode shows once the release gives the bytes
            # to lost+found: it asks again rather than show the refused size until its attributes expire
            # (told before the close returns, or a stat right after it reads the old ones).
            await self.kernel.attrs_dropped(handle.ino, within=REFUSED_CLOSE_INVALIDATION_S)
            raise

    async def _opener_holds(self, tgid: int, ino: InodeNo) -> bool:
        """`Openers.still_holds`, read here when the opener has few descriptors (procfs is memory: a
        few reads cost less than a worker thread's round trip at every close), else on a worker thread."""
        held = self.openers.still_holds(tgid, ino, max_fds=OPENER_FDS_INLINE)
        if held is None:
            held = await trio.to_thread.run_sync(self.openers.still_holds, tgid, ino)
        return bool(held)

    async def fsync(self, fh: HandleNo) -> None:
        handle = self._file_handle(fh)
        await self._store_or_journal(handle.ino)

    async def _store_or_journal(self, ino: InodeNo) -> None:
        """What a close must do: store the file, or in write-back mode make it durable locally."""
        if self.writeback is None:
            await self._store_in_time(ino)
            return
        sf = self.staging.get(ino)
        if sf is not None and sf.unstored:
            await self._journal(sf)

    async def _journal_if_pending(self, sf: StagedFile) -> None:
        """A change (attributes, xattrs) of a file closed and waiting for its write-back upload goes into
        its journal record too, or a killed daemon or an unmount before the upload would lose it."""
        if self.writeback is not None and self.writeback.queued(sf):
            await self._journal(sf)

    async def _journal(self, sf: StagedFile, *, replaced: Sequence[StagedFile] = ()) -> None:
        assert self.writeback is not None
        try:
            await self.writeback.closed(sf, replaced=replaced)
        except OSError as e:
            # The same text for every file (a full disk refuses a run of closes: logged once, see
            # `FailureLog`); the last release's line names each file and what becomes of it.
            raise NatsFSError(f"the staged bytes could not be made durable on local disk: {e}",
                              errno=e.errno or errno.EIO) from None

    async def _journal_unlinked(self, files: Sequence[StagedFile]) -> None:
        """Write-back mode: staged files just unlinked or replaced by a rename replay no more after a
        crash (their pending records are closed durably, see `WriteBack.unlinked`)."""
        if self.writeback is None or not files:
            return
        try:
            await self.writeback.unlinked(files)
        except OSError as e:
            names = ", ".join(f"{sf.bucket}/{sf.name}" for sf in files)
            raise NatsFSError(f"{names}: removed, but the write-back journal could not record it ({e}); a crash "
                              "before its next sync would bring the pending upload back", errno=e.errno or errno.EIO
                              ) from None

    # ------------------------------------------------------------------ write-back (see core/writeback.py)
    def _upload_pending(self, ino: InodeNo) -> bool:
        sf = self.staging.get(ino)
        return sf is not None and sf.unstored

    async def fill_staged(self, sf: StagedFile) -> None:
        """Copy the rest of the base version in (write-back journals only files holding every byte)."""
        await self._fill(sf)

    async def store_staged(self, sf: StagedFile) -> None:
        """The write-back uploader's put of `sf` (a conflict keeps it in lost+found and raises `Conflict`)."""
        if self.staging.get(InodeNo(sf.ino)) is sf:
            await self._upload(InodeNo(sf.ino))

    def keep_staged(self, sf: StagedFile) -> Path | None:
        """A write-back upload the bucket refuses: its bytes go to lost+found (None: not yet, see `_keep`)."""
        self.staging.remove(sf)
        self.mut.discard_stream(sf)
        return self._keep(sf)

    # ------------------------------------------------------------------ lost+found
    def _keep(self, sf: StagedFile) -> Path | None:
        """`sf.keep()`, never raising: if lost+found cannot be written (a full local disk), one ERROR line
        names the file and the cause, the bytes stay staged (UNKEPT: memory or spool file, still charged
        to the budgets; in write-back mode the journal record stays open too) and keeping them is
        retried in the background and at unmount (`retry_keeping`). None then."""
        try:
            return sf.keep()
        except NotKept as e:
            if sf not in self.unkept:
                self.unkept.append(sf)
                self._unkept_added.set()
            log.error("%s; keeping them in lost+found is retried every %g s and at unmount", e, KEEP_RETRY_S)
            return None

    async def _retry_keeping_loop(self) -> None:
        while True:
            await self._unkept_added.wait()
            while self.unkept:
                await trio.sleep(KEEP_RETRY_S)
                await self.retry_keeping()
            self._unkept_added = trio.Event()

    async def retry_keeping(self) -> None:
        """Try again to keep the bytes that could not be written to lost+found: one warning line per file
        kept; a file that still cannot be kept stays held, silently (its error was logged once)."""
        for sf in list(self.unkept):
            if sf not in self.unkept:
                continue  # kept meanwhile by another run of this (the background one, or unmount's)
            try:
                kept = sf.keep()
            except NotKept as e:
                log.debug("still not kept: %s", e)
                continue
            self.unkept.remove(sf)
            log.warning("%s/%s: its bytes are now kept at %s", sf.bucket, sf.name, kept)
            if self.writeback is not None:
                await self.writeback.record_kept(sf)

    async def _unkept_at_unmount(self) -> None:
        """Unmounting: a last try to keep what is held; what stays unkept is said plainly, one line each."""
        await self.retry_keeping()
        for sf in self.unkept:
            if self.writeback is not None:
                fate = ("they stay in the write-back journal" + ("" if sf.in_memory else f" and {sf.spool_path}")
                        + "; the next mount with this cache dir and --write-back replays them (uploads them, "
                        "or keeps them if they are refused again)")
            elif not sf.in_memory:
                fate = f"they stay in {sf.spool_path}, which the next mount moves to lost+found/leftover"
            else:
                fate = "they were held in memory only and are LOST"
            log.error("%s/%s: unmounting, and its %d bytes still cannot be written to %s: %s", sf.bucket, sf.name,
                      sf.size, self.staging.spool.lost_found, fate)

    def upload_settled(self, sf: StagedFile) -> None:
        """The write-back uploader is done with `sf`: drop it unless a handle still has it open."""
        ino = InodeNo(sf.ino)
        if self.files.is_open(ino) or sf.ended or sf.pins:
            return  # (a pinned file is settled by the operation pinning it, `_pinned`)
        self.staging.remove(sf)
        self.mut.discard(sf)
        if ino in self.inodes and self.inodes.lookup_count(ino) == 0 and self.inodes.forget(ino, 0):
            # It was kept only for the upload: what is kept per inode for the kernel goes with it, as on
            # a forget.
            self.files.forget_cached_version(ino)
            self._told_sizes.pop(ino, None)
            self._told_dirs.discard(ino)
            self._size_revalidations.pop(ino, None)

    async def _store_in_time(self, ino: InodeNo) -> None:
        """`_upload` under one deadline for the whole store (every request, retry and fallback in it):
        `flush_timeout` seconds plus one per `flush_rate_floor` bytes staged. Past it the close fails
        with EIO; the bytes stay staged (the next close tries again, release keeps them). The put cut
        off there cleans up for at most `ABORT_CLEANUP_S` more (see `PutSession.abort`)."""
        sf = self.staging.get(ino)
        if sf is None or not sf.unstored:
            return
        allowance = sf.size / self.config.flush_rate_floor
        limit = self.config.flush_timeout + allowance
        try:
            with trio.move_on_after(limit) as scope:
                await self._upload(ino)
            if scope.cancelled_caught:
                # The limit as it was applied, and how it is made up (a big file's allowance is no surprise).
                made_of = f"--flush-timeout {self.config.flush_timeout:g} s"
                if allowance >= 0.05:
                    made_of += f" + {allowance:.1f} s for its {sf.size} bytes"
                raise Unavailable(f"{sf.bucket}/{sf.name}: not stored within {limit:.1f} s ({made_of}); the "
                                  "server is unreachable or too slow")
        except NatsFSError as e:
            sf.store_failure = str(e).removeprefix(f"{sf.bucket}/{sf.name}: ")
            raise

    async def shutdown(self, timeout: float) -> None:
        """Unmounting: store what files still open for writing hold (within `timeout` in all, progress in
        the log); keep what cannot be stored in lost+found, one log line per file. Nothing is dropped
        silently. In write-back mode: wait for the queued uploads instead; what is still queued after
        `timeout` stays in the spool and the journal for the next mount. Directory times not written
        yet are written last."""
        deadline = trio.current_time() + timeout
        try:
            await self._shutdown_files(timeout)
        finally:
            await self._unkept_at_unmount()
            # Within what is left of `timeout` (a server that did not answer the uploads will not answer
            # these either), but a moment at least.
            left = deadline - trio.current_time() if self._shutdown_cut is None else 0.0
            with trio.move_on_after(min(DIR_TIME_MAX_S, max(left, DIR_TIME_AT_UNMOUNT_MIN_S))):
                await self._store_pending_dir_times()
            if self._shutdown_cut is None:
                left = max(deadline - trio.current_time(), 0.0)
                await self.mut.settle_at_unmount(min(left, self.config.purge_check_delay + UNMOUNT_SETTLE_EXTRA_S))
            self.mut.journal.flush()

    def cut_shutdown_short(self, why: str) -> None:
        """Stop the unmount's wait for uploads now (or before it starts): what is not stored yet is kept as
        after --shutdown-timeout (lost+found, one line per file naming `why`; in write-back mode the
        spool and the journal)."""
        self._shutdown_cut = why
        if self._shutdown_wait is not None:
            self._shutdown_wait.cancel()
        if self.writeback is not None:
            self.writeback.cut_drain_short(why)

    async def _store_pending_dir_times(self) -> None:
        for directory in list(self._dir_times_pending):
            try:
                async with self._dir_gate.storing():
                    await self._store_dir_time(directory)
            except NatsFSError as e:
                log.debug("%s: directory time not stored at unmount (%s)", "/".join(directory), e)

    async def _shutdown_files(self, timeout: float) -> None:
        if self.writeback is not None:
            await self.writeback.drain(timeout)
            for sf in self.staging.all():
                if not sf.unstored:
                    self.staging.remove(sf)
                    self.mut.discard(sf)
            return
        pending = [sf for sf in self.staging.all() if sf.unstored]
        if pending:
            log.info("unmounting: storing %d file(s) still open for writing (%d bytes), for at most %g s",
                     len(pending), sum(sf.size for sf in pending), timeout)
        causes: dict[int, str] = {}
        with trio.move_on_after(timeout) as self._shutdown_wait:
            if self._shutdown_cut is not None:
                self._shutdown_wait.cancel()
            for n, sf in enumerate(pending, 1):
                try:
                    await self._upload(InodeNo(sf.ino))
                except NatsFSError as e:
                    causes[sf.ino] = str(e)
                    continue
                if not sf.unstored:
                    log.info("unmounting: stored %s/%s (%d bytes; %d of %d)", sf.bucket, sf.name, sf.size, n,
                             len(pending))
        for sf in self.staging.all():
            self.staging.remove(sf)
            if sf.unstored:
                self.mut.discard_stream(sf)
                kept = self._keep(sf)
                if kept is not None:
                    cause = causes.get(sf.ino) or self._shutdown_cut or f"no time left after {timeout:g} s"
                    log.warning("%s/%s: not stored before unmounting (%s); its bytes are kept at %s", sf.bucket,
                                sf.name, cause, kept)
            else:
                self.mut.discard(sf)

    async def _upload(self, ino: InodeNo) -> None:
        sf = self.staging.get(ino)
        if sf is None or not sf.unstored:
            return
        try:
            with self.files.own_upload(ino):
                info = await self.mut.upload(sf, self.config.chunk_size)
        except Conflict as e:
            self.counters["conflicts"] += 1
            self.mut.discard_stream(sf)
            self.staging.remove(sf)
            # The kernel's pages of the inode hold the bytes that went to lost+found, not the version it
            # shows from now on: dropped, or a read would mix the two.
            self.files.forget_cached_version(ino)
            self.kernel.inode(ino)
            self._detach_if_left_behind(ino)
            kept = self._keep(sf)
            if kept is None:  # (logged) the caller learns that the local disk is full: ENOSPC
                raise NotKept(f"{e}; the local disk refused the copy for lost+found", log_level=logging.DEBUG) from None
            log.warning("%s/%s: not stored, another client changed it meanwhile; your bytes are kept at %s",
                        sf.bucket, sf.name, kept)
            raise Conflict(f"{e} (kept at {kept})", log_level=logging.DEBUG) from None
        if info is not None:
            if info.attrs is None or info.attrs.mtime_ns is None:
                if len(self._written_mtimes) >= WRITTEN_MTIMES_MAX:
                    del self._written_mtimes[next(iter(self._written_mtimes))]
                self._written_mtimes[(info.bucket, info.nuid, info.revision)] = sf.mtime_ns
            self.files.set_cached_version(ino, info.nuid)
            # The kernel sized the inode by the writes (and truncates) that made these bytes.
            self._told_sizes[ino] = info.size
            self.counters["uploads"] += 1
            self.counters["upload_bytes"] += info.size

    async def release(self, fh: HandleNo) -> None:
        handle = self.handles.pop(fh)
        if not isinstance(handle, FileHandle):
            return
        last = self.files.released(handle.ino, writing=handle.writable)
        if last is None:
            return
        if last.purge_later is not None and self._held(handle.ino):
            # A kernel retry of an open is about to open it (`_hold_for_retry`): purged when that ends.
            self.files.unlinked_while_open(handle.ino, last.purge_later)
        elif last.purge_later is not None:
            await self.mut.purge_unused(*last.purge_later)
            if self.files.is_open(handle.ino):
                return  # (opened again meanwhile: that handle's last close settles the staged file)
        sf = self.staging.get(handle.ino)
        if sf is None:
            return
        if sf.unstored and last.store_deferred:
            try:  # the last close was not the opener's: store now
                await self._store_or_journal(handle.ino)
            except NatsFSError as e:
                log.info("%s/%s: store at the last release failed (%s)", sf.bucket, sf.name, e)
            sf = self.staging.get(handle.ino)
            if sf is None:
                return
        if sf.pins:
            return  # an open or truncate under way settles it (`_pinned`)
        await self._settle_unused(sf)

    async def _settle_unused(self, sf: StagedFile) -> None:
        """No handle has `sf` open any more and nothing works on it: store or keep its bytes, and drop it."""
        if self.writeback is not None and sf.unstored:
            if not self.writeback.queued(sf):
                try:
                    await self._journal(sf)
                except NatsFSError as e:
                    # The local disk takes no record (full): the bytes are only here, and no close is left
                    # to report it to (the failed close said ENOSPC). Held until the unmount they would
                    # be lost to any crash before it: uploaded now instead, without a record.
                    log.error("%s/%s: %s; it is uploaded without a write-back record (a crash before the upload "
                              "loses it)", sf.bucket, sf.name, e)
                    self.writeback.schedule(sf, self.writeback.delay)
            return  # the write-back uploader stores it and then drops it
        shown = self._staged_node(sf) if sf.unstored and sf.never_stored else None
        self.staging.remove(sf)
        if sf.unstored:
            self.mut.discard_stream(sf)
            # The inode shows the stored version again: the kernel's size and pages of it are those of the
            # bytes given up (as after a conflict, `_upload`).
            self.files.forget_cached_version(InodeNo(sf.ino))
            self.kernel.inode(InodeNo(sf.ino))
            if shown is not None:
                self._name_given_up(InodeNo(sf.ino), sf.path, shown)
            kept = self._keep(sf)
            if kept is not None:
                # The one line per file that says what became of its bytes, with why (the close's own
                # line, if it failed, says it once for a run of files refused alike: see `FailureLog`).
                why = f" ({sf.store_failure})" if sf.store_failure else ""
                if sf.failed_by == "truncate":
                    log.error("truncate: %s/%s: not stored%s; the bytes are kept at %s", sf.bucket, sf.name,
                              why, kept)
                else:
                    log.error("%s/%s: closed without a successful upload%s; the bytes are kept at %s",
                              sf.bucket, sf.name, why, kept)
        else:
            self.mut.discard(sf)

    def _name_given_up(self, ino: InodeNo, path: tuple[str, ...], shown: Node) -> None:
        """A new file was given up without ever being stored (its first close refused, its bytes kept in
        lost+found): its name shows nothing now, as after an unlink of this mount, but here the kernel
        still caches the name's entry for `ino` (an unlink drops it itself). An `open(O_CREAT)` of the
        name then reached `ino` through it, and its permission check's GETATTR answered ENOENT, which
        failed the open(2) until the entry expired, where a local disk creates the file.

        So the name goes as at an unlink: its entry is invalidated (queued), and until that lands the inode
        is detached and shows the file it was with no link (`getattr`), so such an open goes on to its
        OPEN, is refused `ESTALE` (`_node_to_open`), and the kernel walks the path again and creates the
        file; a later lookup of the name gets a new inode."""
        if self.inodes.known(path) != ino:
            return  # (renamed or unlinked since: its inode no longer has this name)
        self._unlinked_nodes[ino] = shown
        self._detach(path)
        parent = self.inodes.known(path[:-1])
        if parent is not None:
            self.kernel.entry(parent, os.fsencode(path[-1]))

    # ------------------------------------------------------------------ attributes
    @contextlib.asynccontextmanager
    async def _changed_in_place(self, inode: InodeNo) -> AsyncIterator[None]:
        """Held while an attribute, xattr or truncate change of `inode` reads and stores it. A rename of
        a directory above it (or of the inode itself, a directory) under way is waited for first, and the
        change then goes by the inode's new path; a directory rename that starts meanwhile waits for the
        change (`_DirRenameGate`). Else a change that read the old path stored there between the rename's
        two steps for the entry: a live meta under the old name again, holding the nuid of the renamed
        object (other clients' Delete of the old name purge its chunks; a truncate's put replaced that
        nuid and purged them itself), and a directory's marker brought the old directory back."""
        async with self._dir_renames.adding(lambda: self.inodes.path_of(inode)):
            yield

    async def setattr(self, inode: InodeNo, changes: AttrChanges, caller: Caller | None = None) -> Attributes:
        self._refuse_if_read_only()
        async with self._changed_in_place(inode):
            return await self._setattr(inode, await self._dropping_privileges(inode, changes, caller))

    async def _dropping_privileges(self, inode: InodeNo, changes: AttrChanges, caller: Caller | None
                                   ) -> AttrChanges:
        """`changes`, plus the mode a local disk leaves a regular file with setuid/setgid bits after a chown
        (by anyone) or a truncate by a caller other than root (`_without_privileges`). The kernel does
        this itself only for bits it sees, and a mount without `--allow-setuid` shows none: the stored
        bits stayed, and a later `--allow-setuid` mount showed a setuid file someone else had changed.
        An explicit mode (chmod, or the kernel's own clearing) is left as given."""
        chown = changes.uid is not None or changes.gid is not None
        if changes.mode is not None or not (chown or (changes.size is not None and not _privileged(caller))):
            return changes
        try:
            node = await self._node(inode)
        except NatsFSError:
            return changes  # (`_setattr` answers for an inode that shows nothing)
        info = node.info if node.kind == FILE else None
        attrs = info.attrs if info is not None else None
        if info is None or attrs is None or attrs.mode is None or (attrs.kind is not None and info.size == 0):
            return changes  # (no stored mode: the default has no such bits; FIFOs and devices keep theirs)
        cleared = _without_privileges(attrs.mode, attrs.gid if attrs.gid is not None else self.config.gid, caller)
        return changes if cleared == attrs.mode else dataclasses.replace(changes, mode=cleared)

    def _drop_privileges_of_staged(self, inode: InodeNo, caller: Caller) -> None:
        """A write (or `O_TRUNC` open) by `caller`, other than root, changed the staged file of `inode`:
        its setuid/setgid bits go, stored with its bytes (see `_dropping_privileges`)."""
        sf = self.staging.get(inode)
        if sf is None or sf.ended or sf.mode is None:
            return
        cleared = _without_privileges(sf.mode, sf.gid if sf.gid is not None else self.config.gid, caller)
        if cleared != sf.mode:
            sf.set_attrs(cleared, None, None, None)

    async def _setattr(self, inode: InodeNo, changes: AttrChanges) -> Attributes:
        node = await self._node(inode)
        if node.kind in (ROOT, BUCKET):
            if changes.size is not None:
                raise IsADirectory("a bucket")
            return self._attr(inode, node)  # bucket directories keep no attributes: accepted, not stored
        assert node.bucket is not None
        await self.mut.check_writable(node.bucket)
        if changes.size is None:
            if changes.posix:
                await self._change_posix(inode, node, changes)
            return self._attr(inode, await self._node(inode))
        if node.kind != FILE:
            raise IsADirectory("/".join(node.rel))
        while True:
            sf = self._stage(inode, node)
            try:
                # Pinned until stored (or left to a writer's close): a last close meanwhile leaves it to this
                # truncate, and once none pins it and no handle has it open, `_pinned` drops it.
                async with self._pinned(sf):
                    async with self._changing(sf):
                        if not sf.ended:
                            await self._fill(sf, upto=changes.size)
                            await sf.truncate(changes.size)
                    if sf.ended:
                        # Dropped while this truncate waited (stored and dropped by a close, another truncate,
                        # or kept after a conflict): stage again from what the file is now.
                        node = await self._node(inode)
                        continue
                    self.mut.after_write(sf, changes.size)
                    if changes.posix:
                        await self._change_posix(inode, node, changes)
                    await self._store_truncated(inode, sf)
            except NatsFSError as e:
                if sf.failed_by == "truncate" and sf.state == WriteState.KEPT:
                    # The line that says where the bytes went gave the reason: one line per refused truncate.
                    e.log_level = logging.DEBUG
                raise
            return self._attr(inode, await self._node(inode))

    async def _store_truncated(self, inode: InodeNo, sf: StagedFile) -> None:
        """`sf` (pinned by the caller) was truncated by an operation no close of its own stores (truncate(2),
        an `O_RDONLY|O_TRUNC` open): stored now if no writer has the file open, else left to the writers'
        close. A refused store raises, its bytes kept in `lost+found` once `_pinned` lets go of them."""
        if self.files.has_writers(inode):
            # Left to the writers' close; if they flushed already (their last release is all that is left),
            # that release stores it rather than taking it for a failed store.
            self.files.defer_store(inode, True)
            return
        try:
            await (self._upload(inode) if self.writeback is None else self._store_or_journal(inode))
        except NatsFSError as e:
            # Said where `_pinned` keeps the bytes in lost+found, as the truncate's refusal.
            sf.store_failure = str(e).removeprefix(f"{sf.bucket}/{sf.name}: ")
            sf.failed_by = "truncate"
            raise

    def _open_nameless(self, inode: InodeNo) -> list[FileHandle]:
        """The handles of `inode` if it is a file deleted or replaced while open here (no name links to it),
        else none. The kernel reaches such an inode through those descriptors (`fchmod`, `futimens`,
        `fsetxattr`; FUSE names no handle for them), never by walking a path to it: a name it still cached
        after another client replaced the file is dropped by the watch's invalidation, and until it lands
        such a change is as if it came just before the replace."""
        return self._readers(inode) if self._nameless(inode) else []

    async def _change_posix(self, inode: InodeNo, node: Node, changes: AttrChanges) -> None:
        """chmod, chown, utimens: stored (`_set_posix`), except on a file deleted or replaced while open
        here, whose descriptors change its own attributes, as on a local disk: fstat through them shows
        them, nothing stores them (its bytes go nowhere either), and the object now at its former name
        keeps its own."""
        readers = self._open_nameless(inode)
        if not readers:
            await self._set_posix(inode, node, changes)
            return
        sf = self.staging.get(inode)
        if changes.mtime_ns is not None:
            # The time this mount wrote its version with (`_attr` shows it for that version) is shown no
            # more: no other inode shows that version.
            for version in (readers[0].info, sf.base if sf is not None else None):
                if version is not None:
                    self._written_mtimes.pop((version.bucket, version.nuid, version.revision), None)
        if sf is not None and sf.shown:
            # Its inode shows the staged file: its attributes are those. (One another client replaced
            # meanwhile that holds unstored bytes keeps them in lost+found with these attributes.)
            async with sf.lock:
                sf.set_attrs(changes.mode, changes.uid, changes.gid, changes.mtime_ns)
            await self._journal_if_pending(sf)
            return
        for handle in readers:  # the version its handles read is what it shows (`_node`)
            attrs = _merged(handle.info.attrs, changes, self.config.file_mode)
            handle.info = dataclasses.replace(handle.info, attrs=attrs, mtime_ns=changes.mtime_ns
                                              if changes.mtime_ns is not None else handle.info.mtime_ns)

    async def _set_posix(self, inode: InodeNo, node: Node, changes: AttrChanges) -> None:
        assert node.bucket is not None
        if node.kind == DIR:
            assert node.dir is not None
            if changes.mtime_ns is not None:
                self._dir_mtimes.pop(self.ns.mount_path(node.bucket, node.rel), None)
            async with self._dir_gate.changing():
                node = await self._path_node(self.ns.mount_path(node.bucket, node.rel))
                assert node.dir is not None and node.bucket is not None
                marker = node.dir.marker
                if marker is None:
                    self._refuse_marker_over_a_file(node.bucket, "/".join(node.rel) + "/")
                await self.mut.set_dir_attrs(node.bucket, node.rel, node.dir,
                                             _merged(marker.attrs if marker else None, changes, self.config.dir_mode))
            return
        if node.kind == LINK:
            return  # symlinks have no mode of their own; times on links are not stored
        sf, current = await self._unless_staged(inode, lambda: self._node(inode))
        if sf is None:
            assert current is not None
            if current.kind != FILE:
                # Read again: another client replaced the file meanwhile (by a directory, a link). The
                # change was for the file, not for what is there now.
                raise Conflict(f"{'/'.join(node.rel)} was replaced by another client meanwhile")
            await self._store_posix(inode, current, changes)
            return
        # An upload under way has taken the attributes it stores, and stores at the revision it read:
        # the change waits for it (else it would be lost, or make the upload a false conflict).
        async with sf.lock:
            if not sf.shadows_index:
                await self._store_posix(inode, await self._node(inode), changes)
                return
            # Stored together with the data at the next upload.
            sf.set_attrs(changes.mode, changes.uid, changes.gid, changes.mtime_ns)
        await self._journal_if_pending(sf)

    async def _unless_staged(self, inode: InodeNo, read: Callable[[], Awaitable[_T]]
                             ) -> tuple[StagedFile | None, _T | None]:
        """(None, `read()`), `read()` being what the bucket has of `inode`, for a meta-only change of it,
        while the inode has no staged file under way; (that file, None) if it has one (the change then
        goes through it, under its lock).

        Read now, not before: a node read earlier may be that of a staged file whose close stored a newer
        revision since, and a change published at the old one failed with ESTALE. Nothing is awaited
        between the last look at the staging area and the return, so the caller's change is under way
        (`own_meta_change`) before an upload of a file staged later can start: that upload waits for it."""
        while True:
            sf = self.staging.get(inode)
            if sf is not None and not sf.ended:
                return sf, None
            got = await read()
            if self.staging.get(inode) is sf:
                return None, got

    async def _store_posix(self, inode: InodeNo, node: Node, changes: AttrChanges) -> None:
        """Store attribute changes of a stored file in its meta (a meta-only change: same nuid)."""
        assert node.info is not None and node.bucket is not None
        current = node.info.attrs
        new = _merged(current, changes, self.config.file_mode)
        if changes.mtime_ns is None:
            new = dataclasses.replace(new, mtime_ns=current.mtime_ns if current else None)
        with self.mut.own_meta_change(node.bucket, node.info.name):
            info = await self.mut.set_attrs(node.bucket, node.info, new, self.mut.file_defaults)
            staged = self._rebase_staged(inode, info)
            if staged is not None:  # its next upload stores these attributes, not the ones it had
                staged.set_attrs(changes.mode, changes.uid, changes.gid, changes.mtime_ns)

    def _rebase_staged(self, inode: InodeNo, info: ObjectInfo) -> StagedFile | None:
        """This mount stored `info`, a meta-only change of the file at `inode`: its staged file (looked up
        now, it may have been made while the change was stored) is based on that meta from now on, so
        its next upload is no conflict. Not one based on other bytes (another nuid): that one's upload
        must still fail as a conflict rather than replace a version it never saw."""
        sf = self.staging.get(inode)
        if (sf is None or sf.ended or sf.base is None or sf.base.nuid != info.nuid
                or sf.base_revision >= info.revision):
            return None
        sf.rebase(info)
        return sf

    # ------------------------------------------------------------------ directory times
    def _entries_changed(self, directory: tuple[str, ...]) -> None:
        """This mount created, removed or renamed an entry of `directory`: its mtime and ctime advance
        now, and are written to its marker (natsfs.mtime_ns) shortly after, coalesced."""
        self._dir_mtimes[directory] = time.time_ns()
        if directory not in self._dir_times_pending and self._nursery is not None:
            self._dir_times_pending.add(directory)
            self._nursery.start_soon(self._persist_dir_time, directory)

    async def _persist_dir_time(self, directory: tuple[str, ...]) -> None:
        try:
            latest = trio.current_time() + DIR_TIME_MAX_S
            while True:
                changed = self._dir_mtimes.get(directory)
                await trio.sleep(min(DIR_TIME_DELAY_S, max(0.0, latest - trio.current_time())))
                if self._dir_mtimes.get(directory) == changed or trio.current_time() >= latest:
                    break
        finally:
            self._dir_times_pending.discard(directory)
        try:
            async with self._dir_gate.storing():
                await self._store_dir_time(directory)
        except NatsFSError as e:
            log.debug("%s: directory time not stored (%s)", "/".join(directory), e)

    async def _store_dir_time(self, directory: tuple[str, ...]) -> None:
        mtime_ns = self._dir_mtimes.get(directory)
        node = await self.ns.resolve(directory)
        if (mtime_ns is None or node.kind != DIR or node.dir is None or node.dir.marker is None
                or node.bucket is None):
            return  # no marker: the time lives in this mount's memory only
        marker = node.dir.marker
        if marker.attrs is not None and marker.attrs.mtime_ns == mtime_ns:
            return
        cur = marker.attrs or PosixAttrs()
        await self.mut.set_attrs(node.bucket, marker, dataclasses.replace(cur, mtime_ns=mtime_ns),
                                 self.mut.dir_defaults)

    # ------------------------------------------------------------------ namespace changes
    async def unlink(self, parent_inode: InodeNo, name: bytes) -> None:
        self._refuse_if_read_only()
        # A rename of the directory (or one above) may be under way: the unlink waits for it and removes
        # the entry under the directory's new path, and a rename that starts meanwhile waits for the
        # unlink (`_DirRenameGate`). Between a rename's two steps for the entry (its meta published under
        # the new name, the old name's not purged yet) an unlink by the old path wrote a tombstone there
        # carrying the renamed object's nuid (and purged its chunks): other clients' Delete or Put of
        # the old name then purge the live object's chunks.
        async with self._dir_renames.adding(lambda: self.inodes.path_of(parent_inode)) as (directory,):
            await self._unlink(directory, name)

    async def _unlink(self, directory: tuple[str, ...], name: bytes) -> None:
        path = (*directory, _name(name))
        bucket, _ = self._in_bucket(path)
        node = await self._path_node(path)
        if node.kind in (DIR, BUCKET, ROOT):
            raise IsADirectory("/".join(path))
        await self.mut.check_writable(bucket)
        async with self._uploads_settled(path):
            # (an upload of this file that was in flight has ended: its object is in the index now)
            ino = self.inodes.known(path)
            sf = self.staging.get(ino) if ino is not None else None
            stored = await self._index_info(path)
            # The chunks of a file's version are kept through the delete, and purged after it unless a
            # handle here reads them then (`_forget_open_version`): an open (or the lookup that makes its
            # inode) may register while the delete awaits, until the tombstone reaches the index, and
            # its version, purged under it, failed its reads ESTALE.
            kept = self._open_here(ino) or (stored is not None and stored.link is None and stored.size > 0)
            # (A pending file's record names the tombstone first: see `_removing_record`.)
            removed_by, records = self._removing_record(sf) if stored is not None else ("", [])
            await self._journal_intent(records, "unlink")
            if ino is not None:
                self._unlinked_nodes[ino] = node
            with self.files.changing(path), self._own_removal(path):
                try:
                    if stored is not None:
                        await self.mut.delete(bucket, stored, keep_chunks=kept, msg_id=removed_by)
                    elif sf is None or sf.ended:
                        raise NotFound("/".join(path))
                except BaseException:
                    if ino is not None:
                        self._unlinked_nodes.pop(ino, None)
                    if sf is not None and removed_by:
                        sf.failed_removal = removed_by  # (its tombstone may be stored: `Mutations._upload`)
                    await self._journal_removal_failed(records)
                    raise
            if ino is None:  # (a lookup may have made it while the delete awaited)
                ino = self.inodes.known(path)
                if ino is not None:
                    self._unlinked_nodes[ino] = node
            await self._forget_open_version(ino, bucket, stored, kept)
            # (Read again: an open with O_TRUNC may have staged the file while the delete awaited.)
            sf = self.staging.get(ino) if ino is not None else None
            unlinked = []
            if sf is not None and not sf.ended:
                sf.unlink()
                unlinked.append(sf)
            self._detach(path)
        self._entries_changed(path[:-1])
        if testpoints.ACTIVE and stored is not None:
            await testpoints.pause("unlink.deleted")
        await self._journal_unlinked(unlinked)

    def _removing_record(self, sf: StagedFile | None) -> tuple[str, list[dict[str, Any]]]:
        """Write-back mode: an unlink of a pending file, or a rename over it, is about to change its name
        in the bucket (a tombstone; the renamed object's meta). Its record, again with `removed_by`: the
        `Nats-Msg-Id` that change is published with (returned first), synced before it publishes (one
        more sync, only for a pending file whose name holds an object). A daemon killed before the
        record's `done` is synced then closes the record at the next mount instead of replaying it, if
        the bucket holds that very change (`WriteBack.settle_moves`): the bytes of a file the program
        removed are not kept in lost+found as if another client had changed it. ("", []): none."""
        if self.writeback is None or sf is None or sf.ended or sf.unlinked:
            return "", []
        record = self.writeback.journal.pending.get(sf.entry_id)
        if record is None:
            return "", []
        msg_id = new_nuid()
        return msg_id, [{**record, "removed_by": msg_id}]

    async def _journal_removal_failed(self, records: list[dict[str, Any]]) -> None:
        """An unlink of a pending file whose record names its tombstone (`_removing_record`) failed: the
        file stays, so its record names no removal again (unless a close wrote a newer one meanwhile).
        A tombstone stored all the same (no answer, then none to the read-back either: `OutcomeUnknown`)
        is then another change at the name for the replay, whose bytes it keeps in lost+found: never
        taken for the unlink's, which closed the record and dropped the bytes of a file the program was
        told had not been removed."""
        if not records or self.writeback is None:
            return
        pending = self.writeback.journal.pending
        again = [{k: v for k, v in r.items() if k != "removed_by"} for r in records
                 if pending.get(r["id"], {}).get("removed_by") == r["removed_by"]]
        if again:
            with trio.CancelScope(shield=True), contextlib.suppress(OSError):
                await self.writeback.moving(again)

    async def _journal_intent(self, records: list[dict[str, Any]], call: str) -> None:
        """`WriteBack.moving`: the records naming what `call` is about to change in the bucket, synced."""
        if not records or self.writeback is None:
            return
        try:
            await self.writeback.moving(records)
        except OSError as e:
            raise NatsFSError(f"{call}: the write-back journal could not record it ({e}); nothing changed",
                              errno=e.errno or errno.EIO) from None

    def _own_removal(self, path: tuple[str, ...]) -> contextlib.AbstractContextManager[None]:
        """This mount removes (or renames away, or over) the entry at `path`: a directory without a marker
        that this empties stays, empty, in this mount (`BucketIndex.own_removal`)."""
        bucket, rel = self.ns.split(path)
        index = self.ns.loaded_index(bucket) if bucket is not None and len(rel) > 1 else None
        return index.own_removal(rel[:-1]) if index is not None else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def _uploads_settled(self, *paths: tuple[str, ...], subtree: bool = False) -> AsyncIterator[None]:
        """Hold the locks of the staged files at `paths` (with `subtree`, also under them) while a rename
        or unlink changes those names. An upload holds its file's lock from reading the file's name to
        applying what it stored, so one in flight ends first (its object is then in the index, under the
        name it had, and is renamed or deleted like any stored object), and none starts until the
        change is done (it then publishes under the new name, or not at all once unlinked). Without
        this, an upload that started before the change stored the file under its old name after it,
        undoing the rename or unlink. Taken in inode order (no two operations wait on each other); a
        file staged at those paths while waiting is taken too."""
        while True:
            wanted = {id(sf): sf for p in paths for sf in self.staging.named(p, subtree=subtree)}
            async with contextlib.AsyncExitStack() as held:
                for sf in sorted(wanted.values(), key=lambda sf: sf.ino):
                    await held.enter_async_context(sf.lock)
                if all(id(sf) in wanted for p in paths for sf in self.staging.named(p, subtree=subtree)):
                    yield
                    return

    async def _forget_open_version(self, ino: InodeNo | None, bucket: str, stored: ObjectInfo | None,
                                   open_here: bool) -> None:
        """An object this mount deleted or replaced while it holds it open (`open_here`: its chunks were
        kept): like a local disk, those handles keep reading (its chunks are purged at the last close)
        and their writes go nowhere. If the last of them closed while the delete or rename awaited,
        that close found nothing to purge (and an unlink keeps them even with no handle open, for one
        that registers meanwhile): with no handle here now, the chunks go now, or nothing would ever
        purge them."""
        if not open_here:
            return
        purge_later = (bucket, stored.nuid) if stored is not None and stored.nuid else None
        if ino is not None and self._open_here(ino):
            self.files.unlinked_while_open(ino, purge_later)
        elif purge_later is not None:
            await self.mut.purge_unused(*purge_later)

    async def _index_info(self, path: tuple[str, ...]) -> ObjectInfo | None:
        """The object the bucket (not the staging area) has at `path`, if any."""
        try:
            node = await self.ns.resolve(path)
        except NotFound:
            return None
        return node.info if node.kind in (FILE, LINK) else None

    async def _new_owner(self, parent_inode: InodeNo, mode: int, caller: Caller, *, directory: bool = False
                         ) -> tuple[int, int]:
        """(permission bits, gid) of a new entry of `parent_inode`: the caller's gid, except in a directory
        that shows the setgid bit, whose group it takes (and a new directory its setgid bit), as on a
        local disk (the BSD rule). Only where that bit shows (`--allow-setuid`): elsewhere the stored bit
        is masked off, and a directory showing `0775` gives new entries the creator's group."""
        mode &= 0o7777
        if not self.config.allow_setuid:
            return mode, caller.gid
        parent = self._attr(parent_inode, await self._node(parent_inode))
        if not parent.mode & stat.S_ISGID:
            return mode, caller.gid
        return mode | (stat.S_ISGID if directory else 0), parent.gid

    def _refuse_marker_over_a_file(self, bucket: str, marker_name: str) -> None:
        """A `chmod`/`utime` of a directory without a marker stores one: where another client's object with
        bytes holds that name (shown escaped), the marker would replace it. Refused `EPERM`, one line (it
        was `EEXIST` from the server's refusal, an errno chmod(2) never gives, and no line)."""
        index = self.ns.loaded_index(bucket)
        holder = index.objects.get(marker_name) if index is not None else None
        if holder is not None and not holder.deleted:
            raise MarkerShaped(f"{bucket}/{marker_name}: an object with bytes holds the name the directory's "
                               f"marker needs (it shows as {'/'.join(placement(marker_name)[0] or ())!r}): its "
                               f"attributes cannot be stored")

    async def mkdir(self, parent_inode: InodeNo, name: bytes, mode: int, caller: Caller) -> Attributes:
        self._refuse_if_read_only()
        path = (*self.inodes.path_of(parent_inode), _new_name(name))
        bucket, rel = self.ns.split(path)
        if bucket is None or not rel:
            return await self._make_bucket(path, mode)
        self.ns.store.check_name(bucket, "/".join(rel) + "/")
        bits, gid = await self._new_owner(parent_inode, mode, caller, directory=True)
        async with self._new_entry(parent_inode, path, lambda: self._check_new_entry(path)) as here:
            if here:
                marker_name = "/".join(rel) + "/"
                index = self.ns.loaded_index(bucket)
                holder = index.objects.get(marker_name) if index is not None else None
                if holder is not None and not holder.deleted:
                    # Another client's object with bytes under the marker's name (shown escaped): a marker
                    # would replace it, so the directory cannot be made.
                    raise AlreadyExists(f"{bucket}/{marker_name}: an object with bytes holds the name a directory "
                                        f"marker needs (it shows as {'/'.join(placement(marker_name)[0] or ())!r})",
                                        log_level=logging.INFO)
                await self.mut.mkdir(bucket, rel, PosixAttrs(bits, caller.uid, gid, None))
        if not here:
            return await self.mkdir(parent_inode, name, mode, caller)
        self._entries_changed(path[:-1])
        node = await self.ns.resolve(path)
        return self._attr(self.inodes.lookup(path), node)

    async def _make_bucket(self, path: tuple[str, ...], mode: int) -> Attributes:
        """mkdir at the root of an all-buckets mount creates a bucket with the mount's defaults."""
        if self.ns.single_bucket is not None or len(path) != 1:
            raise AlreadyExists("/")
        bucket = path[0]
        if not valid_bucket_name(bucket):
            raise InvalidArgument(f"invalid bucket name {bucket!r}: letters, digits, '-' and '_' only")
        if await self.ns.bucket_exists(bucket):
            raise AlreadyExists(f"bucket {bucket}")
        with self.files.changing(path):  # (the kernel learns of the new bucket from our answer)
            await self.mut.create_bucket(bucket)
            node = await self.ns.resolve(path)
        return self._attr(self.inodes.lookup(path), node)

    async def rmdir(self, parent_inode: InodeNo, name: bytes) -> None:
        self._refuse_if_read_only()
        # (As an unlink: a rename of the directory above under way is waited for, and the marker is
        # deleted under the new path, never by a tombstone under the old one carrying the moved marker's
        # nuid.)
        async with self._dir_renames.adding(lambda: self.inodes.path_of(parent_inode)) as (directory,):
            await self._rmdir(directory, name)

    async def _rmdir(self, directory: tuple[str, ...], name: bytes) -> None:
        path = (*directory, _name(name))
        bucket, rel = self.ns.split(path)
        node = await self._path_node(path)
        if node.kind not in (DIR, BUCKET):
            raise NotADirectory("/".join(path))
        if bucket is None or not rel:
            if self.ns.single_bucket is not None or bucket is None:
                raise NatsFSError("the root of the mount", errno=errno.EBUSY, log_level=logging.INFO)
            if any(sf.shadows_index for sf in self.staging.named(path, subtree=True)):
                # A file this mount shows there and has not stored yet (being written, or waiting for its
                # write-back upload) is an entry, as on a local disk: deleting the bucket lost its bytes
                # to lost+found at its close (ENOENT).
                raise NotEmpty(f"bucket {bucket} holds files this mount has not stored yet")
            await self.mut.delete_bucket(bucket)
            self._detach(path)
            return
        async with self._dir_gate.changing():
            node = await self._path_node(path)
            if node.dir is None:
                raise NotADirectory("/".join(path))
            with self._own_removal(path):
                await self.mut.rmdir(bucket, rel, node.dir, path)
        self._detach(path)
        self._dir_mtimes.pop(path, None)
        self._entries_changed(path[:-1])

    async def rename(self, parent_inode_old: InodeNo, name_old: bytes, parent_inode_new: InodeNo, name_new: bytes,
                     *, noreplace: bool = False, exchange: bool = False, whiteout: bool = False) -> None:
        self._refuse_if_read_only()
        old = (*self.inodes.path_of(parent_inode_old), _name(name_old))
        new = (*self.inodes.path_of(parent_inode_new), _new_name(name_new))
        if exchange:
            raise InvalidArgument("RENAME_EXCHANGE is not supported")
        if whiteout:
            # A plain rename would answer 0 and leave no whiteout behind; overlayfs checks for one.
            raise InvalidArgument("RENAME_WHITEOUT is not supported")
        bucket_old, rel_old = self.ns.split(old)
        bucket_new, rel_new = self.ns.split(new)
        if bucket_old is None or bucket_new is None or not rel_old or not rel_new or bucket_old != bucket_new:
            raise NatsFSError("rename across buckets (or of a bucket)", errno=errno.EXDEV, log_level=logging.DEBUG)
        if old != new and _under(new, old):
            raise InvalidArgument("cannot move a directory into itself")
        # A directory the entry leaves or enters (or is renamed within) may be being renamed: this rename
        # waits for that one and then takes the directory's new path, and one that starts meanwhile waits
        # for this one (`_DirRenameGate`, as for an entry made there). Else a file moved into the renamed
        # directory stayed behind under its old path and brought the old directory back, and one renamed
        # within it (git's HEAD.lock over HEAD) read its names before the directory rename moved them
        # and failed ESTALE. (Not where a directory of the rename lies under its own paths: renamed onto
        # its ancestor, refused below.)
        if _under(old[:-1], new):
            await self._rename_now(bucket_old, old, new, rel_old, rel_new, noreplace)
            return
        async with self._dir_renames.adding(lambda: self.inodes.path_of(parent_inode_old),
                                            lambda: self.inodes.path_of(parent_inode_new)) as directories:
            if directories == (old[:-1], new[:-1]):
                await self._rename_now(bucket_old, old, new, rel_old, rel_new, noreplace)
                return
        # (a directory of the rename was renamed meanwhile: the entry goes by its new path)
        await self.rename(parent_inode_old, name_old, parent_inode_new, name_new, noreplace=noreplace)

    async def _rename_now(self, bucket: str, old: tuple[str, ...], new: tuple[str, ...], rel_old: tuple[str, ...],
                          rel_new: tuple[str, ...], noreplace: bool) -> None:
        src = await self._path_node(old)
        dst = await self._maybe_node(new)
        if dst is not None and noreplace:
            raise AlreadyExists("/".join(new))
        if old == new:
            return
        await self.mut.check_writable(bucket)
        # (A directory: entries being added in it are stored first, and new ones wait, see _DirRenameGate.)
        moving = self._dir_renames.renaming(old, new) if src.kind == DIR else contextlib.nullcontext()
        async with moving, self._dir_gate.changing(), self._uploads_settled(old, new, subtree=src.kind == DIR):
            # Read again: a directory time may have been stored, or an upload of a file there may have
            # ended, meanwhile.
            src = await self._path_node(old)
            dst = await self._maybe_node(new)
            # The target's directory must exist, as on a local disk (ENOENT): the kernel may hand a
            # directory inode whose name went away meanwhile (renamed or removed; its old path shows
            # nothing, or it was detached), and the objects moved under a path no directory holds
            # split the tree (the renamed directory's contents under a second top directory).
            await self._check_parent(new)
            intended, removed_by = await self._journal_moving(old, new)
            with self._moving(old, new):
                with self.files.changing(old, new), self._own_removal(old), self._own_removal(new):
                    try:
                        replaced = await self._rename(bucket, old, new, rel_old, rel_new, src, dst, removed_by)
                    except BaseException:
                        if intended and self.writeback is not None:
                            # Failed: the records name no move again (a replay must not take another
                            # client's change for the rename's), unless a close wrote a newer one.
                            pending = self.writeback.journal.pending
                            again = [r for r in intended if pending.get(r["id"], {}).get("moving_to")
                                     or pending.get(r["id"], {}).get("removed_by")]
                            with trio.CancelScope(shield=True), contextlib.suppress(OSError):
                                await self.writeback.moving(again)
                        raise
                staged_moved = self._move_staged(bucket, old, new)
                self.inodes.move(old, new)
        if testpoints.ACTIVE:
            await testpoints.pause("rename.stored")
        if self.writeback is not None:
            # A pending file replaced here replays no more after a crash: its record is closed in the same
            # sync as the moved file's new record, before it (one sync for an atomic save).
            for sf in staged_moved:
                if self.writeback.queued(sf):
                    await self._journal(sf, replaced=replaced)  # the record names the new path
                    replaced = []
            await self._journal_unlinked(replaced)
        for moved in [p for p in self._dir_mtimes if p[: len(old)] == old]:
            self._dir_mtimes[new + moved[len(old):]] = self._dir_mtimes.pop(moved)
        self._entries_changed(old[:-1])
        self._entries_changed(new[:-1])

    async def _journal_moving(self, old: tuple[str, ...], new: tuple[str, ...]
                              ) -> tuple[list[dict[str, Any]], str]:
        """Write-back mode: pending files at or under `old` whose rename changes the bucket (a rewrite of a
        stored object: that version moves; a file renamed over an object, which it replaces at its first
        upload: that object is deleted) get their record again with `moving_to` (the new name), synced
        before the rename publishes: a crash before their records under the new names are synced then
        replays each where the rename left it (see `WriteBack.settle_moves`). A pending file the rename
        replaces gets `removed_by` in the same sync (`_removing_record`). Returns the records as they
        were (written again if the rename fails) and the `Nats-Msg-Id` of the meta the rename stores at
        the new name ("": any)."""
        if self.writeback is None:
            return [], ""
        dst_ino = self.inodes.known(new)
        dst_sf = self.staging.get(dst_ino) if dst_ino is not None else None
        removed_by = ""
        records: list[dict[str, Any]] = []
        if dst_sf is not None and dst_sf.path == new:
            # Only when the rename publishes at the new name (see `_rename`): it moves a stored object
            # there, or deletes the object there that this mount holds open. (An atomic save of a file
            # not stored yet over a pending one publishes nothing: no sync more.)
            src_sf = self.staging.at_path(old)
            moves_object = (src_sf is None or src_sf.replaces is None) and await self._index_info(old) is not None
            if moves_object or (self._open_here(dst_ino) and await self._index_info(new) is not None):
                removed_by, records = self._removing_record(dst_sf)
        before = [self.writeback.journal.pending[r["id"]] for r in records]
        for sf in self.staging.all():
            if sf.path[: len(old)] != old or sf.unlinked or (sf.base is None and sf.replaces is None):
                continue
            record = self.writeback.journal.pending.get(sf.entry_id)
            if record is not None:
                path = new + sf.path[len(old):]
                # (A file that replaces an object at its first upload replaces the one at its new name then.)
                name = "/".join(self.ns.split(path)[1])
                target = await self._index_info(path) if sf.base is None and path == new else None
                if target is not None and target.name != name:
                    target = None  # (another name's object shown there: the rename deletes it)
                records.append({**record, "moving_to": name, "moving_replaces": version_entry(target)})
                before.append(record)
        await self._journal_intent(records, "rename")
        return before, removed_by

    async def _rename(self, bucket: str, old: tuple[str, ...], new: tuple[str, ...], rel_old: tuple[str, ...],
                      rel_new: tuple[str, ...], src: Node, dst: Node | None, removed_by: str = ""
                      ) -> list[StagedFile]:
        """The rename in the bucket; returns the staged file it replaced (unlinked), if any. `removed_by`:
        the `Nats-Msg-Id` of what it publishes at the new name (see `_removing_record`)."""
        if src.kind == DIR:
            if dst is not None and dst.kind != DIR:
                raise NotADirectory("/".join(new))
            if new[: len(old)] == old:
                raise InvalidArgument("cannot move a directory into itself")
            if dst is not None and self.staging.children(new):
                raise NotEmpty("/".join(new))  # files being written there count
            assert src.dir is not None
            if src.dir.vacant():
                # A directory this mount keeps empty (its last entry removed here; nothing stored): it
                # moves in this mount only, and stays unstored (a marker at the target is deleted, as
                # any rename over an empty directory does).
                await self.mut.rename_dir(bucket, rel_old, src.dir, rel_new, dst.dir if dst is not None else None)
                index = self.ns.loaded_index(bucket)
                if index is None or not index.move_kept(rel_old, rel_new):
                    raise NotFound("/".join(old))
                return []
            index = self.ns.loaded_index(bucket)
            if index is not None and index.renamed_away(rel_old):
                # (Its entries go with that rename, which claimed the directory first: as a file renamed
                # away by another client meanwhile, nothing moves here.) rename_dir checks again after
                # its own awaits, before it reads the moves.
                raise NotFound(f"{'/'.join(old)}: another client is renaming this directory")
            signatures = await self._move_signatures(bucket, [
                (info, self.ns.mount_path(bucket, (*rel_old, *below)), self.ns.mount_path(bucket, (*rel_new, *below)))
                for below, info in _objects_below(src.dir)])
            await self.mut.rename_dir(bucket, rel_old, src.dir, rel_new, dst.dir if dst is not None else None,
                                      signatures)
            return []
        if dst is not None and dst.kind == DIR:
            raise IsADirectory("/".join(new))
        self.ns.store.check_name(bucket, "/".join(rel_new))
        stored = await self._index_info(old)
        target = await self._index_info(new)
        dst_ino = self.inodes.known(new)
        target_open = self._open_here(dst_ino)
        # The path may show another name's object (escaped: object `q\0` shows as `q%00`). The rename
        # stores the literal name, which then holds that path; the object shown there is replaced, as
        # POSIX says, by deleting it once the rename is stored (its own subject is not the new name's).
        shown_there = target if target is not None and target.name != "/".join(rel_new) else None
        if shown_there is not None:
            target = None
        src_sf = self.staging.at_path(old)
        if src_sf is not None and src_sf.replaces is not None:
            # A staged file that replaces, at its upload, the object still stored under its name: the name
            # moves away now, so that object goes now (it is not this file's stored version).
            if stored is not None and stored.revision == src_sf.replaces.revision:
                await self.mut.delete(bucket, stored)
            # (One another client changed meanwhile is its own newer version now: it stays.)
            src_sf.replace(None)
            stored = None
        elif stored is None and src_sf is None:
            # Deleted (or renamed away) by another client since the kernel's walk found it: nothing to
            # move, as on a local disk. (Answering 0 here had a rename racing another mount's unlink
            # succeed while the file was gone.)
            raise NotFound("/".join(old))
        if stored is not None:
            written = self._written_mtimes.pop((bucket, stored.nuid, stored.revision), None)
            if written is not None:  # the mtime shown (its last write) is the one rename keeps
                stored = dataclasses.replace(stored, mtime_ns=written)
            signature = (await self._move_signatures(bucket, [(stored, old, new)])).get(stored.name)
            await self.mut.rename_object(bucket, stored, "/".join(rel_new), target, keep_target_chunks=target_open,
                                         extra_metadata=signature, msg_id=removed_by)
        elif target is not None and src_sf is not None and src_sf.base is None and not target_open:
            # A file that exists only in the staging area replaces an object (an atomic save: write a
            # temporary file, rename it over): its upload replaces that object, which other clients
            # keep reading until then (write-back mode: until the background upload lands).
            src_sf.replace(target)
        elif target is not None:
            # (The replaced object is open here: its handles keep reading it, its chunks are purged at
            # their last close.) Deleted now; the staged bytes are stored under the new name when closed.
            await self.mut.delete(bucket, target, keep_chunks=target_open, msg_id=removed_by)
        if shown_there is not None:
            await self.mut.delete(bucket, shown_there, keep_chunks=target_open)
            target = shown_there
        await self._forget_open_version(dst_ino, bucket, target, target_open)
        dst_sf = self.staging.get(dst_ino) if dst_ino is not None else None
        if dst_sf is not None and not dst_sf.ended:
            dst_sf.unlink()
            return [dst_sf]
        return []

    async def _move_signatures(self, bucket: str, moves: Sequence[tuple[ObjectInfo, tuple[str, ...], tuple[str, ...]]]
                               ) -> dict[str, dict[str, str]]:
        """The signature (`natsfs.symlink_sig`) each symlink among `moves` (object, old and new mount
        path) needs to keep reading as its text after this mount moves it: a text that stays in the mount
        only from its old place (`../../x` moved one directory up) read as `nats-object:?/outside-link`
        (or another client's computed target) once moved, though it read verbatim before, as on a local
        disk, where a rename never changes a symlink's text. Such a move is this user's own, as `mv`
        between buckets is (it makes the symlink again with `ln -s`, which signs). A text that did not
        read verbatim before is left as it is, and a signature stays valid (it covers bucket and text).
        A key the signer refuses leaves the text unsigned: the rename itself is not refused for it."""
        out: dict[str, dict[str, str]] = {}
        for info, old, new in moves:
            attrs = info.attrs
            text = attrs.symlink if attrs is not None and info.size == 0 else None
            if (text is None or not stays_in_mount(text, old, self._mount_root)
                    or stays_in_mount(text, new, self._mount_root)
                    or self.signer.verify(bucket, text, attrs.symlink_sig if attrs is not None else None)):
                continue
            try:
                signature = await trio.to_thread.run_sync(self.signer.sign, bucket, text)
            except NatsFSError:  # (a refused or unwritable key, logged by the signer): the move still goes
                continue
            out[info.name] = {ATTR_SYMLINK_SIG: signature}
        return out

    def _move_staged(self, bucket: str, old: tuple[str, ...], new: tuple[str, ...]) -> list[StagedFile]:
        """Staged files at or under `old` now belong to `new` (and to the renamed objects' revisions)."""
        index = self.ns.loaded_index(bucket)
        moved_files = []
        for sf in self.staging.all():
            if sf.path[: len(old)] != old or sf.unlinked:
                continue
            path = new + sf.path[len(old):]
            name = "/".join(self.ns.split(path)[1])
            # Its stored version (or the object it replaces at its first upload), renamed along with it.
            follows = sf.base or sf.replaces
            moved = index.objects.get(name) if index is not None and follows is not None else None
            same = moved is not None and follows is not None and moved.nuid == follows.nuid
            self.staging.move(sf, path, name, moved if same else None)
            moved_files.append(sf)
        return moved_files

    async def link(self, inode: InodeNo, new_parent_inode: InodeNo, new_name: bytes) -> Attributes:
        self._refuse_if_read_only()
        # One line per mount, not one per call: git tries link() for every object it writes (then falls
        # back to rename), which flooded the log with one INFO line each.
        if self._link_refusal_logged:
            raise NatsFSError("hard links are not supported", errno=errno.EPERM, log_level=logging.DEBUG)
        self._link_refusal_logged = True
        raise NatsFSError("hard links are not supported (EPERM; further link() calls are logged at DEBUG only)",
                          errno=errno.EPERM, log_level=logging.INFO)

    async def mknod(self, parent_inode: InodeNo, name: bytes, mode: int, caller: Caller, rdev: int = 0
                    ) -> Attributes:
        self._refuse_if_read_only()
        kind = next((k for k, bits in SPECIAL_KINDS.items() if stat.S_IFMT(mode) == bits), None)
        if kind is not None:
            return await self._make_special(parent_inode, name, kind, mode, rdev, caller)
        if not stat.S_ISREG(mode):
            raise NatsFSError(f"mknod of file type {stat.S_IFMT(mode):o}", errno=errno.EINVAL,
                              log_level=logging.INFO)
        info, attr = await self.create(parent_inode, name, mode, os.O_WRONLY | os.O_EXCL, caller)
        await self.flush(info.fh)
        await self.release(info.fh)
        return attr

    async def _make_special(self, parent_inode: InodeNo, name: bytes, kind: str, mode: int, rdev: int,
                            caller: Caller) -> Attributes:
        """A FIFO, socket or device node: an empty object whose `natsfs.type` (and `natsfs.rdev`) say
        what it is; other clients see an empty object."""
        path = (*self.inodes.path_of(parent_inode), _new_name(name))
        bucket, rel = self._in_bucket(path)
        self.ns.store.check_name(bucket, "/".join(rel))
        await self.mut.check_writable(bucket)
        bits, gid = await self._new_owner(parent_inode, mode, caller)
        attrs = PosixAttrs(bits, caller.uid, gid, None, kind, rdev if kind in ("char", "block") else None)
        async with self._new_entry(parent_inode, path, lambda: self._check_new_entry(path)) as here:
            if here:
                await self.mut.make_special(bucket, "/".join(rel), attrs)
        if not here:
            return await self._make_special(parent_inode, name, kind, mode, rdev, caller)
        self._entries_changed(path[:-1])
        ino = self.inodes.lookup(path)
        return self._attr(ino, await self._node(ino))

    # ------------------------------------------------------------------ filesystem
    async def statfs(self) -> FsUsage:
        bsize = 4096
        used, total = 0, -1
        if self.ns.single_bucket is not None:
            try:
                status = await self.ns.store.bucket_status(self.ns.single_bucket)
                used, total = status.size, status.max_bytes
                files = status.messages
            except NotFound:
                # Another client deleted the bucket: the root shows an empty directory until it is created
                # again, so the mount is an empty filesystem (ENOENT made `df` fail on the mountpoint).
                files = 0
        else:
            limits = await self.ns.store.account_limits()
            used, total = limits.storage_used, limits.max_storage
            files = 0
        if total <= 0:
            total = used + PETABYTE
        used_blocks = -(-used // bsize)
        blocks = max(-(-total // bsize), used_blocks)
        return FsUsage(block_size=bsize, blocks=blocks, blocks_free=blocks - used_blocks, files=files + 1_000_000,
                       files_free=1_000_000, name_max=NAME_MAX)

    def stats(self) -> dict[str, Any]:
        return {
            "cache": self.cache.stats.as_dict() | {"cached_bytes": self.cache.cached_bytes,
                                                   "cache_limit": self.cache.cache_bytes},
            "fs": dict(self.counters),
            "ops": dict(self.op_counts),
            "server_calls": dict(self.ns.store.streams.calls),
            # (of those, the ones made while serving FUSE requests, per operation)
            "server_calls_for_requests": dict(self.ns.store.streams.calls.for_requests),
            "writeback": dict(self.writeback.counters) if self.writeback is not None else None,
            "staged_files": len(self.staging),
            "unfinished_puts": len(self.mut.journal.pending),  # chunks left to settle (kept or purged)
            "spool_bytes": self.staging.spool.used,
            "inodes": len(self.inodes),
            "handles": len(self.handles),
            "namespace": self.ns.stats(),
            "kernel_invalidations": self.kernel.done,
            "servers": redact_urls(self.config.servers) if self.config.servers else "embedded nats-server",
            "recent_errors": recent_problems(),
        }

    # ------------------------------------------------------------------ links
    async def symlink(self, parent_inode: InodeNo, name: bytes, target: bytes, caller: Caller) -> Attributes:
        """`ln -s TARGET NAME`: TARGET is stored verbatim in `natsfs.symlink` (any text, as on a local
        disk). Where it names a stored object or a bucket of this mount, the object is also an ADR-20
        link (AddLink / AddBucketLink), so other clients follow it; else an empty object."""
        self._refuse_if_read_only()
        path = (*self.inodes.path_of(parent_inode), _new_name(name))
        bucket, rel = self._in_bucket(path)
        self.ns.store.check_name(bucket, "/".join(rel))
        try:
            text = target.decode("utf-8")
        except UnicodeDecodeError:
            raise BadName(f"symlink target {target!r} is not UTF-8 (metadata is JSON text)") from None
        if not text:
            raise NotFound("an empty symlink target")
        await self.mut.check_writable(bucket)
        async with self._new_entry(parent_inode, path, lambda: self._check_new_entry(path)) as here:
            if here:
                await self._store_symlink(bucket, rel, text, caller)
        if not here:
            return await self.symlink(parent_inode, name, target, caller)
        self._entries_changed(path[:-1])
        node = await self.ns.resolve(path)
        return self._attr(self.inodes.lookup(path), node)

    async def _store_symlink(self, bucket: str, rel: tuple[str, ...], text: str, caller: Caller) -> None:
        # The caller owns the link, as on a local disk: on a shared (allow_other) mount the kernel's
        # protected_symlinks rule for sticky directories relies on who owns a link.
        owned: dict[str, Any] = {"metadata": {ATTR_SYMLINK: text}}
        set_posix_attrs(owned, PosixAttrs(None, caller.uid, caller.gid, None), self.mut.file_defaults)
        metadata: dict[str, str] = owned["metadata"]
        path = self.ns.mount_path(bucket, rel)
        if not stays_in_mount(text, path, self._mount_root):
            metadata[ATTR_SYMLINK_SIG] = await trio.to_thread.run_sync(self.signer.sign, bucket, text)
        linked = await self._adr20_target(path[:-1], text)
        if linked is not None:
            await self.mut.add_link(bucket, "/".join(rel), *linked, metadata=metadata)
        else:
            await self.mut.make_special(bucket, "/".join(rel), PosixAttrs(), metadata)

    async def _adr20_target(self, directory: tuple[str, ...], text: str) -> tuple[str, str | None] | None:
        """(bucket, object name or None for the bucket) when `text` names a stored object (not a link)
        or a bucket of this mount as the kernel resolves it, else None."""
        try:
            target_path, climbed_out_of, names_a_directory = self._link_target_path(directory, text)
        except NatsFSError:
            return None
        # The kernel resolves `..` physically: `x/..` is where `x` is only when `x` is a directory (a
        # symlink `x` leads elsewhere, a file `x` fails ENOTDIR), so a link is made only where the
        # text's lexical reading is the one the kernel follows; other clients then see the object
        # this mount's symlink leads to, never one it does not.
        for climbed in climbed_out_of:
            try:
                node = await self._maybe_node(climbed)
            except NatsFSError:
                return None
            if node is None or node.kind not in (ROOT, BUCKET, DIR):
                return None
        target_bucket, target_rel = self.ns.split(target_path)
        if target_bucket is None:
            return None
        if not target_rel:
            return (target_bucket, None) if await self.ns.bucket_exists(target_bucket) else None
        if names_a_directory:  # `file/`, `file/.`: the kernel answers ENOTDIR, it never reaches the file
            return None
        try:
            node = await self._maybe_node(target_path)
        except NatsFSError:
            return None
        if node is None or node.kind != FILE:
            return None
        stored = await self._index_info(target_path)
        return (target_bucket, stored.name) if stored is not None else None

    def _link_target_path(self, directory: tuple[str, ...], target: str
                          ) -> tuple[tuple[str, ...], list[tuple[str, ...]], bool]:
        """The mount path a symlink target names read lexically, relative to the link's directory or
        absolute under the mountpoint (`EXDEV` for anything outside the mount); with the paths each
        `..` climbed out of (the kernel climbs only out of a directory), and whether the text ends in
        `/`, `.` or `..` (it then names a directory)."""
        outside = NatsFSError(f"link target {target!r} is outside the mount", errno=errno.EXDEV,
                              log_level=logging.INFO)
        if target.startswith("/"):
            root = self._mount_root
            if target != root and not target.startswith(root.rstrip("/") + "/"):
                raise outside
            parts: list[str] = []
            segments = target[len(root):].split("/")
        else:
            parts = list(directory)
            segments = target.split("/")
        climbed_out_of: list[tuple[str, ...]] = []
        for seg in segments:
            if seg in ("", "."):
                continue
            if seg == "..":
                if not parts:
                    raise outside
                climbed_out_of.append(tuple(parts))
                parts.pop()
            else:
                parts.append(seg)
        return tuple(parts), climbed_out_of, segments[-1] in ("", ".", "..")

    # ------------------------------------------------------------------ extended attributes
    async def _meta_doc(self, node: Node) -> tuple[dict[str, Any], int]:
        """The full meta document of a file or link (or what a staged new file will store)."""
        assert node.info is not None and node.bucket is not None
        ino = self.inodes.known(self.ns.mount_path(node.bucket, node.rel))
        sf = self.staging.get(ino) if ino is not None else None
        if sf is not None and sf.never_stored:
            doc: dict[str, Any] = {"name": sf.name, "bucket": sf.bucket}
            sf.apply_xattr_changes(doc)
            return doc, 0
        index = self.ns.loaded_index(node.bucket)
        alias = index.odd_subjects.get(node.info.name) if index is not None else None  # shown from there
        got = await self.ns.store.get_meta_doc(node.bucket, node.info.name, alias)
        if got is None or got[0].get("deleted"):
            raise NotFound(f"{node.bucket}/{node.info.name}")
        return got

    async def _own_meta_doc(self, inode: InodeNo) -> tuple[dict[str, Any], int] | None:
        """The meta document a file deleted or replaced while open here shows through its descriptors (and
        the revision it had), None for any other inode. As on a local disk, `fsetxattr` and `fgetxattr`
        through them act on that file's own attributes: never stored (its bytes go nowhere either), never
        those of the object now at its former name. Made at the first such request, from its meta if
        the bucket still holds it (else with no attribute, or the ones a file never stored was given)."""
        readers = self._open_nameless(inode)
        rec = self.files.get(inode)
        if not readers or rec is None:
            return None
        info = readers[0].info
        if rec.own_meta_doc is None:
            doc: dict[str, Any] = {"name": info.name, "bucket": info.bucket}
            sf = self.staging.get(inode)
            if sf is not None and sf.never_stored:
                sf.apply_xattr_changes(doc)
            elif info.nuid:
                with contextlib.suppress(NatsFSError):
                    got = await self.ns.store.get_meta_doc(info.bucket, info.name)
                    if got is not None and not got[0].get("deleted") and got[0].get("nuid") == info.nuid:
                        doc = got[0]
            if rec.own_meta_doc is None:  # (unless another request made it while this one awaited)
                rec.own_meta_doc = doc
        return rec.own_meta_doc, info.revision

    async def getxattr(self, inode: InodeNo, name: bytes) -> bytes:
        if inode == ROOT_INODE and name == XATTR_STATS:
            return json.dumps(self.stats()).encode()
        key = os.fsdecode(name)
        if not key.startswith(xattrs.USER):
            # Only the user.* namespace exists here. `ls -l` asks every file for security.selinux and
            # system.posix_acl_access; ENOTSUP (rather than ENODATA) tells it this filesystem has none
            # of those at all, so it stops asking after the first file: no request per entry.
            raise NatsFSError(f"{key}: only user.* attributes exist here", errno=errno.EOPNOTSUPP,
                              log_level=logging.DEBUG)
        node = await self._node(inode)
        if node.kind == BUCKET and node.bucket is not None:
            st = await self.ns.store.bucket_status(node.bucket)
            return xattrs.get_bucket(st.config, st.size, st.messages, key)
        if node.kind in (FILE, LINK):
            doc, revision = await self._own_meta_doc(inode) or await self._meta_doc(node)
            return xattrs.get_object(doc, revision, key)
        raise xattrs.NoAttribute(key)

    async def listxattr(self, inode: InodeNo) -> list[bytes]:
        node = await self._node(inode)
        names: list[bytes] = []  # (the root's read-only XATTR_STATS is read by name, not listed)
        if node.kind == BUCKET and node.bucket is not None:
            st = await self.ns.store.bucket_status(node.bucket)
            names += xattrs.list_bucket(st.config, st.size, st.messages)
        elif node.kind in (FILE, LINK):
            doc, revision = await self._own_meta_doc(inode) or await self._meta_doc(node)
            left_out: list[str] = []
            names += xattrs.list_object(doc, revision, left_out.append)
            assert node.info is not None and node.bucket is not None
            key = (node.bucket, node.info.nuid, revision)
            if left_out and key not in self._reported_xattr_keys:
                self._reported_xattr_keys.add(key)
                log.warning("%s/%s: metadata or header keys that make no usable attribute name are not "
                            "listed as xattrs: %s", node.bucket, node.info.name, ", ".join(left_out[:5])
                            + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""))
        return names

    async def setxattr(self, inode: InodeNo, name: bytes, value: bytes) -> None:
        self._refuse_if_read_only()
        async with self._changed_in_place(inode):
            await self._change_xattr(inode, os.fsdecode(name), value)

    async def removexattr(self, inode: InodeNo, name: bytes) -> None:
        self._refuse_if_read_only()
        async with self._changed_in_place(inode):
            await self._change_xattr(inode, os.fsdecode(name), None)

    async def _change_xattr(self, inode: InodeNo, key: str, value: bytes | None) -> None:
        node = await self._node(inode)
        if node.kind == BUCKET and node.bucket is not None:
            await self.mut.change_bucket(node.bucket, lambda config: xattrs.set_bucket(config, key, value))
            return
        if node.kind not in (FILE, LINK) or node.bucket is None or node.info is None:
            if not key.startswith(xattrs.USER):
                # As everywhere else: tools such as `cp -a` fall back quietly only on EOPNOTSUPP.
                raise NatsFSError(f"only user.* attributes are supported ({key})", errno=errno.EOPNOTSUPP,
                                  log_level=logging.DEBUG)
            raise NatsFSError("extended attributes live on files, links and buckets", errno=errno.EPERM,
                              log_level=logging.INFO)
        await self.mut.check_writable(node.bucket)
        own = await self._own_meta_doc(inode)
        if own is not None:  # deleted or replaced while open: its own, never stored (see `_own_meta_doc`)
            xattrs.set_object(own[0], key, value)
            return

        def change(doc: dict[str, Any]) -> None:
            xattrs.set_object(doc, key, value)

        bucket = node.bucket

        async def with_the_data(sf: StagedFile) -> None:
            # No object yet: checked now, stored with the data at close.
            doc, _ = await self._meta_doc(node)
            change(doc)
            self.ns.store.check_meta_size(bucket, doc)  # (a new object: it replaces no meta)
            sf.change_xattr(key, value)

        sf, stored = await self._unless_staged(inode, lambda: self._index_info(self.inodes.path_of(inode)))
        if sf is None:
            if stored is not None and (stored.link is not None) != (node.kind == LINK):
                # Another client replaced the file by a link (or the link by a file) since it was read:
                # the change was meant for what is gone, not for what holds the name now.
                raise Conflict(f"{bucket}/{stored.name}: replaced by another client meanwhile")
            await self._store_xattr(inode, node.bucket, change, stored)
            return
        # Under the file's lock: after an upload under way, which stores at the revision it read (and
        # a first upload under way would not carry a change made meanwhile).
        async with sf.lock:
            if not sf.never_stored:
                stored = await self._index_info(self.inodes.path_of(inode))
                await self._store_xattr(inode, node.bucket, change, stored)
                return
            await with_the_data(sf)
        await self._journal_if_pending(sf)

    async def _store_xattr(self, inode: InodeNo, bucket: str, change: Callable[[dict[str, Any]], None],
                           stored: ObjectInfo | None) -> None:
        if stored is None:
            raise NotFound("/".join(self.inodes.path_of(inode)))
        with self.mut.own_meta_change(bucket, stored.name):
            info = await self.mut.change_meta(bucket, stored, change)
            self._rebase_staged(inode, info)  # our own change: not a conflict at upload
