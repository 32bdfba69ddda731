"""The FUSE adapter: decode pyfuse3 requests, call the filesystem core, build the replies.

Thin by design: all filesystem logic lives in `natsfs.core.filesystem.Filesystem`, which knows nothing
of pyfuse3 and is driven directly by the ops tests. This module turns request arguments into the core's
values (inode and handle numbers, `Caller`, `AttrChanges`, rename flags), its answers into
`pyfuse3.EntryAttributes`/`FileInfo`/`StatvfsData`, and keeps the one errno boundary: `_boundary` is
the one place where domain errors become `pyfuse3.FUSEError` (logged once, at the error's own level)
and where an unexpected exception becomes EIO plus a logged traceback instead of taking the mount down.
`forget` never raises. The adapter holds no per-inode state.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3

from .adr20 import clamp_time_ns
from .core.filesystem import AttrChanges, Attributes, Caller, Filesystem
from .errors import NatsFSError, single_error
from .handles import HandleNo
from .inodes import InodeNo
from .streams import SERVING

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# Operations whose first argument is a file or directory handle, and those naming two inodes.
_BY_HANDLE = frozenset({"read", "write", "flush", "fsync", "release", "readdir", "releasedir"})
_TWO_INODES = {"rename": (0, 2), "link": (0, 1)}
# A failure seen again within this many seconds is counted, not logged again.
REPEAT_WINDOW_S = 60.0
RENAME_WHITEOUT = 1 << 2  # renameat2's flag from <linux/fs.h>, which pyfuse3 does not name
_REPEATS_KEPT = 1000


class FailureLog:
    """One log line per distinct failure (its cause and object: the message), not one per request.

    Repeats within `window` seconds of the line are counted, and the count is logged once the window
    is over: before the next occurrence, or when any later failure is logged."""

    def __init__(self, window: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window = window
        self.clock = clock
        self._seen: dict[str, list[Any]] = {}  # message -> [first logged at, level, repeats since]
        self._swept = 0.0

    def log(self, level: int, message: str, *, exc_info: bool = False) -> None:
        if level < logging.WARNING:
            log.log(level, "%s", message, exc_info=exc_info)
            return
        now = self.clock()
        self._sweep(now)
        seen = self._seen.get(message)
        if seen is not None:
            if now - seen[0] < self.window:
                seen[2] += 1
                return
            self._summarise(message)
        self._seen[message] = [now, level, 0]
        if len(self._seen) > _REPEATS_KEPT:
            self._summarise(next(iter(self._seen)))
        log.log(level, "%s", message, exc_info=exc_info)

    def _sweep(self, now: float) -> None:
        if now - self._swept < self.window:
            return
        self._swept = now
        for message in [m for m, seen in self._seen.items() if now - seen[0] >= self.window]:
            self._summarise(message)

    def _summarise(self, message: str) -> None:
        _, level, repeats = self._seen.pop(message)
        if repeats:
            log.log(level, "%s (repeated %d times in %.0f s)", message, repeats, self.window)


def _boundary(fn: F) -> F:
    """Map domain errors to errnos once, and never let an unexpected exception kill the mount.

    Failures are logged through the operations' `FailureLog` (a repeat is counted, not logged again).
    The request is served under `Filesystem.serving` with the inodes it names (the kernel may hold
    that inode's lock or page locks until we answer), so that no kernel invalidation waits on them.
    """
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        self.fs.op_counts[op] += 1
        _t0 = time.perf_counter()
        serving = SERVING.set(op)
        try:
            with self.fs.serving(self._request_inodes(op, args)):
                return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:
            error = single_error(e)
            if isinstance(error, NatsFSError):
                self.failures.log(error.log_level, f"{op}: {error}")
                raise pyfuse3.FUSEError(error.errno) from None
            self.failures.log(logging.ERROR, f"{op}{args[:2]!r} failed unexpectedly: {error!r}", exc_info=True)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            SERVING.reset(serving)
            self.fs.op_counts[op + "_us"] += int((time.perf_counter() - _t0) * 1e6)

    return wrapper  # type: ignore[return-value]


def entry_attributes(a: Attributes) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = a.ino
    e.generation = 0
    e.entry_timeout = a.entry_timeout
    e.attr_timeout = a.attr_timeout
    e.st_mode = a.mode
    e.st_nlink = a.nlink
    e.st_uid = a.uid
    e.st_gid = a.gid
    e.st_rdev = a.rdev
    e.st_size = a.size
    e.st_blksize = a.blksize
    e.st_blocks = (a.size + 511) // 512
    e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = a.mtime_ns
    return e


def _caller(ctx: pyfuse3.RequestContext) -> Caller:
    return Caller(ctx.uid, ctx.gid, ctx.pid)


class Operations(pyfuse3.Operations):
    """pyfuse3's request handlers, each a decode → `Filesystem` call → reply."""

    enable_writeback_cache = False

    def __init__(self, fs: Filesystem):
        super().__init__()
        self.fs = fs
        self.failures = FailureLog()
        self.initialized = False  # the kernel's INIT was answered
        # Called (once) before the first open is answered: the mount sets the kernel's readahead there,
        # which a file takes when it is opened (see `natsfs.mount.KernelReadahead`).
        self.before_first_open: Callable[[], None] | None = None

    def init(self) -> None:
        self.initialized = True

    def _request_inodes(self, op: str, args: tuple[Any, ...]) -> tuple[InodeNo, ...]:
        """The inodes a request names (directories for entry operations, files for data ones)."""
        if op in _BY_HANDLE:
            ino = self.fs.handle_inode(HandleNo(args[0])) if args and isinstance(args[0], int) else None
            return (ino,) if ino is not None else ()
        positions = _TWO_INODES.get(op, (0,))
        return tuple(InodeNo(args[i]) for i in positions if i < len(args) and isinstance(args[i], int))

    # ------------------------------------------------------------------ lookups and attributes
    @_boundary
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
                     ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.lookup(InodeNo(parent_inode), name, ctx.pid if ctx is not None else 0))

    @_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.getattr(InodeNo(inode)))

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:  # type: ignore[override]
        try:
            self.fs.forget([(InodeNo(ino), nlookup) for ino, nlookup in inode_list])
        except Exception:
            log.exception("forget failed (ignored)")

    @_boundary
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        changes = AttrChanges(
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode & 0o7777 if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            # (a time beyond what the mount can keep is clamped to it, as the kernel does for a local disk)
            mtime_ns=clamp_time_ns(attr.st_mtime_ns) if fields.update_mtime else None)
        caller = _caller(ctx) if ctx is not None else None
        return entry_attributes(await self.fs.setattr(InodeNo(inode), changes, caller))

    @_boundary
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.readlink(InodeNo(inode))

    # ------------------------------------------------------------------ directories
    @_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return await self.fs.opendir(InodeNo(inode))

    @_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        def reply(name: bytes, attrs: Attributes, next_id: int) -> bool:
            return bool(pyfuse3.readdir_reply(token, name, entry_attributes(attrs), next_id))

        await self.fs.readdir(HandleNo(fh), start_id, reply)

    @_boundary
    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(HandleNo(fh))

    # ------------------------------------------------------------------ files
    def _first_open(self) -> None:
        hook, self.before_first_open = self.before_first_open, None
        if hook is not None:
            hook()

    @_boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self._first_open()
        opened = await self.fs.open(InodeNo(inode), flags, _caller(ctx) if ctx is not None else None,
                                    revalidate=True)
        return pyfuse3.FileInfo(fh=opened.fh, keep_cache=opened.keep_cache, direct_io=opened.direct_io)

    @_boundary
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._first_open()
        opened, attrs = await self.fs.create(InodeNo(parent_inode), name, mode, flags, _caller(ctx))
        return (pyfuse3.FileInfo(fh=opened.fh, keep_cache=opened.keep_cache, direct_io=opened.direct_io),
                entry_attributes(attrs))

    @_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray:  # type: ignore[override]
        # (pyfuse3 replies with any contiguous buffer: a cached chunk goes out as the bytearray it came in)
        return await self.fs.read(HandleNo(fh), off, size)

    @_boundary
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.fs.write(HandleNo(fh), off, buf)

    @_boundary
    async def flush(self, fh: int) -> None:
        await self.fs.flush(HandleNo(fh))

    @_boundary
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(HandleNo(fh))

    @_boundary
    async def release(self, fh: int) -> None:
        await self.fs.release(HandleNo(fh))

    # ------------------------------------------------------------------ namespace changes
    @_boundary
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.unlink(InodeNo(parent_inode), name)

    @_boundary
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
                    ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.mkdir(InodeNo(parent_inode), name, mode, _caller(ctx)))

    @_boundary
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rmdir(InodeNo(parent_inode), name)

    @_boundary
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rename(InodeNo(parent_inode_old), name_old, InodeNo(parent_inode_new), name_new,
                             noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                             exchange=bool(flags & pyfuse3.RENAME_EXCHANGE),
                             whiteout=bool(flags & RENAME_WHITEOUT))

    @_boundary
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.link(InodeNo(inode), InodeNo(new_parent_inode), new_name))

    @_boundary
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
                    ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.mknod(InodeNo(parent_inode), name, mode, _caller(ctx), rdev))

    @_boundary
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
                      ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.symlink(InodeNo(parent_inode), name, target, _caller(ctx)))

    # ------------------------------------------------------------------ filesystem
    @_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        usage = await self.fs.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = usage.block_size
        s.f_blocks = usage.blocks
        s.f_bfree = s.f_bavail = usage.blocks_free
        s.f_files = usage.files
        s.f_ffree = s.f_favail = usage.files_free
        s.f_namemax = usage.name_max
        return s

    # ------------------------------------------------------------------ extended attributes
    @_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.getxattr(InodeNo(inode), name)

    @_boundary
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return await self.fs.listxattr(InodeNo(inode))

    @_boundary
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.setxattr(InodeNo(inode), name, value)

    @_boundary
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.removexattr(InodeNo(inode), name)
