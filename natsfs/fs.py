"""The FUSE operations: translate kernel requests into namespace/cache calls and errors into errnos.

Thin by design: no NATS and no asyncio here, so the class can be driven in tests with an in-memory
store and no kernel. Every operation passes through `_boundary`, the one place where domain errors
become `pyfuse3.FUSEError` (logged once, at the error's own level) and where an unexpected exception
becomes EIO plus a logged traceback instead of taking the mount down. `forget` never raises.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

from .chunk_cache import ChunkCache
from .config import Config
from .errors import Corrupt, NatsFSError, NotFound, ReadOnly
from .handles import DirHandle, HandleTable, ReadHandle
from .inodes import InodeTable
from .kernel import KernelNotifier
from .names import escape, placement
from .namespace import BUCKET, DIR, FILE, LINK, ROOT, Namespace, Node

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

XATTR_STATS = b"user.natsfs.stats"
PETABYTE = 1 << 50


def _boundary(fn: F) -> F:
    """Map domain errors to errnos once, and never let an unexpected exception kill the mount."""

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except NatsFSError as e:
            log.log(e.log_level, "%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("%s%r failed unexpectedly", fn.__name__, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


class Operations(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, namespace: Namespace, cache: ChunkCache, config: Config):
        super().__init__()
        self.ns = namespace
        self.cache = cache
        self.config = config
        self.inodes = InodeTable()
        self.handles = HandleTable()
        self.writable = False  # this build serves buckets read-only
        self.kernel = KernelNotifier()

    def start(self, nursery: trio.Nursery) -> None:
        """Background work of the operations (kernel invalidations) runs in `nursery`."""
        self.kernel.start(nursery)
        self.ns.on_change = self.entry_changed

    def entry_changed(self, bucket: str, rel: tuple[str, ...] | None) -> None:
        """The namespace says an entry appeared, changed or vanished: drop what the kernel cached of it.

        Unchanged objects keep their page cache; a changed one loses its attributes, pages and name
        entry, so the next access comes back to us and sees the new version.
        """
        if rel is None:
            if self.ns.single_bucket is None:
                self.kernel.entry(pyfuse3.ROOT_INODE, os.fsencode(bucket))
                self.kernel.inode(pyfuse3.ROOT_INODE, attr_only=True)
            return
        path = self.ns.mount_path(bucket, rel)
        ino = self.inodes.known(path)
        if ino is not None:
            self.inodes.cached_version.pop(ino, None)
            self.kernel.inode(ino)
        if path:
            parent = self.inodes.known(path[:-1])
            if parent is not None:
                self.kernel.entry(parent, os.fsencode(path[-1]))

    # ------------------------------------------------------------------ attributes
    def _attr(self, ino: int, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self.config.entry_timeout
        a.attr_timeout = self.config.attr_timeout
        a.st_uid = self.config.uid
        a.st_gid = self.config.gid
        a.st_blksize = self.cache.store.chunk_size
        a.st_rdev = 0
        size = 0
        if node.kind in (ROOT, BUCKET, DIR):
            a.st_mode = stat.S_IFDIR | (0o755 if self.writable else 0o555)
            a.st_nlink = 2
        elif node.kind == LINK:
            assert node.info is not None
            a.st_mode = stat.S_IFLNK | 0o777
            a.st_nlink = 1
            size = len(os.fsencode(self._link_target(node)))
        else:
            info = node.info
            assert info is not None
            mode = 0o644 if self.writable else 0o444
            if info.attrs is not None:
                if info.attrs.mode is not None:
                    mode = info.attrs.mode & 0o7777
                    if not self.writable:
                        mode &= ~0o222
                if info.attrs.uid is not None:
                    a.st_uid = info.attrs.uid
                if info.attrs.gid is not None:
                    a.st_gid = info.attrs.gid
            a.st_mode = stat.S_IFREG | mode
            a.st_nlink = 1
            size = info.size
        a.st_size = size
        a.st_blocks = (size + 511) // 512
        t = node.mtime_ns or self.ns.started_ns
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        return a

    def _link_target(self, node: Node) -> str:
        """Relative path from the link's directory to its target inside the mount."""
        info = node.info
        assert info is not None and info.link is not None and node.bucket is not None
        depth = len(self.ns.mount_path(node.bucket, node.rel)) - 1
        up = "../" * depth
        link = info.link
        if self.ns.single_bucket is not None and link.bucket != self.ns.single_bucket:
            # The target is outside this single-bucket mount: a dangling, self-describing target.
            return f"nats-object:{link.bucket}/{link.name or ''}"
        if link.name is None:
            target: tuple[str, ...] = () if self.ns.single_bucket is not None else (link.bucket,)
            return (up + "/".join(target)) or "."
        path, _ = placement(link.name)
        rel = path if path is not None else (escape(link.name),)
        return up + "/".join(self.ns.mount_path(link.bucket, rel))

    async def _node(self, ino: int) -> Node:
        return await self.ns.resolve(self.inodes.path_of(ino))

    # ------------------------------------------------------------------ lookups
    @_boundary
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext = None
                     ) -> pyfuse3.EntryAttributes:
        parent = self.inodes.path_of(parent_inode)
        path = (*parent, _name(name))
        if name in (b".", b".."):
            raise NotFound("dot lookups are answered by the kernel")
        node = await self.ns.resolve(path)
        return self._attr(self.inodes.lookup(path), node)

    @_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext = None) -> pyfuse3.EntryAttributes:
        return self._attr(inode, await self._node(inode))

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:  # type: ignore[override]
        try:
            for ino, nlookup in inode_list:
                self.inodes.forget(ino, nlookup)
        except Exception:
            log.exception("forget failed (ignored)")

    @_boundary
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = await self._node(inode)
        if node.kind != LINK:
            raise NatsFSError("not a symlink", errno=errno.EINVAL, log_level=logging.DEBUG)
        return os.fsencode(self._link_target(node))

    # ------------------------------------------------------------------ directories
    @_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self.inodes.path_of(inode)
        listing = await self.ns.listdir(path)
        return self.handles.add(DirHandle(inode, path, [(name, (*path, name), node) for name, node in listing]))

    @_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self.handles.get(fh)
        if not isinstance(handle, DirHandle):
            raise NatsFSError("bad directory handle", errno=errno.EBADF)
        for i in range(start_id, len(handle.entries)):
            name, path, node = handle.entries[i]
            ino = self.inodes.ino_for(path)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(ino, node), i + 1):
                if self.inodes.lookup_count(ino) == 0:
                    self.inodes.forget(ino, 0)
                return
            self.inodes.lookup(path)

    @_boundary
    async def releasedir(self, fh: int) -> None:
        self.handles.pop(fh)

    # ------------------------------------------------------------------ files
    @_boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise ReadOnly("this mount is read-only")
        node = await self._node(inode)
        if node.kind != FILE:
            raise NatsFSError("not a regular file", errno=errno.EISDIR if node.kind != LINK else errno.ELOOP,
                              log_level=logging.DEBUG)
        info = node.info
        assert info is not None
        handle = ReadHandle(inode, info)
        fh = self.handles.add(handle)
        # Unchanged since the kernel last cached it: let the page cache serve rereads.
        keep = self.inodes.cached_version.get(inode) == info.nuid
        self.inodes.cached_version[inode] = info.nuid
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    @_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self.handles.get(fh)
        if not isinstance(handle, ReadHandle):
            raise NatsFSError("bad file handle", errno=errno.EBADF)
        ra = handle.plan_readahead(off, size, self.config.readahead_min, self._readahead_max())
        try:
            return await self.cache.read(handle.info, off, size, ra)
        except Corrupt:
            # The cache refuses this version from now on; drop whatever the kernel cached of it.
            self.inodes.cached_version.pop(handle.ino, None)
            self.kernel.inode(handle.ino)
            raise

    def _readahead_max(self) -> int:
        return max(self.config.readahead_min, min(self.config.readahead_max, self.cache.cache_bytes // 4))

    @_boundary
    async def flush(self, fh: int) -> None:
        return None

    @_boundary
    async def release(self, fh: int) -> None:
        self.handles.pop(fh)

    # ------------------------------------------------------------------ filesystem
    @_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        bsize = 4096
        used, total = 0, -1
        if self.ns.single_bucket is not None:
            status = await self.ns.store.bucket_status(self.ns.single_bucket)
            used, total = status.size, status.max_bytes
            files = status.messages
        else:
            limits = await self.ns.store.streams.account_limits()
            used, total = limits.storage_used, limits.max_storage
            files = 0
        if total <= 0:
            total = used + PETABYTE
        used_blocks = -(-used // bsize)
        s.f_bsize = s.f_frsize = bsize
        s.f_blocks = max(-(-total // bsize), used_blocks)
        s.f_bfree = s.f_bavail = s.f_blocks - used_blocks
        s.f_files = files + 1_000_000
        s.f_ffree = s.f_favail = 1_000_000
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------------ xattrs
    @_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == XATTR_STATS:
            return json.dumps(self.stats()).encode()
        raise NatsFSError("no such attribute", errno=pyfuse3.ENOATTR, log_level=logging.DEBUG)

    @_boundary
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        if inode == pyfuse3.ROOT_INODE:
            return [XATTR_STATS]
        await self._node(inode)
        return []

    def stats(self) -> dict[str, Any]:
        return {
            "cache": self.cache.stats.as_dict() | {"cached_bytes": self.cache.cached_bytes,
                                                   "cache_limit": self.cache.cache_bytes},
            "inodes": len(self.inodes),
            "handles": len(self.handles),
        }

    # ------------------------------------------------------------------ writes (read-only build)
    async def _refuse(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = _refuse  # type: ignore[assignment]
    mknod = _refuse  # type: ignore[assignment]
    mkdir = _refuse  # type: ignore[assignment]
    unlink = _refuse  # type: ignore[assignment]
    rmdir = _refuse  # type: ignore[assignment]
    symlink = _refuse  # type: ignore[assignment]
    rename = _refuse  # type: ignore[assignment]
    link = _refuse  # type: ignore[assignment]
    create = _refuse  # type: ignore[assignment]
    write = _refuse  # type: ignore[assignment]
    setxattr = _refuse  # type: ignore[assignment]
    removexattr = _refuse  # type: ignore[assignment]

