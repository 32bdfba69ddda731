"""Helpers of the ops tier: the environment a test body gets, a fake readdir token, fixture replay."""

from __future__ import annotations

import base64
import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import trio
import trio.testing
from helpers import FIXTURES

from natsfs.adr20 import ObjectStore
from natsfs.chunk_cache import ChunkCache
from natsfs.config import Config
from natsfs.core.filesystem import Filesystem
from natsfs.fs import Operations
from natsfs.inodes import InodeNo
from natsfs.memstreams import MemoryStreams
from natsfs.namespace import Namespace

__all__ = ["FIXTURES"]

ROOT = pyfuse3.ROOT_INODE


class Ctx:
    """What pyfuse3 hands a request about its caller."""

    uid = 1000
    gid = 1000
    pid = 1
    umask = 0o022


CTX = Ctx()


class Fields:
    """Stands in for pyfuse3.SetattrFields, whose attributes only the kernel side can set."""

    def __init__(self, **set_: bool):
        for name in ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
                     "update_size"):
            setattr(self, name, set_.get(name, False))
# Replay keeps what replay.py keeps of a dumped stream config.
_KEEP = {"name", "subjects", "retention", "max_consumers", "max_msgs", "max_bytes", "max_age", "max_msgs_per_subject",
         "max_msg_size", "storage", "num_replicas", "discard", "duplicate_window", "allow_rollup_hdrs", "deny_delete",
         "deny_purge", "allow_direct", "mirror_direct", "description", "compression"}


@dataclass
class Listing:
    """The token handed to `readdir`: the fake `readdir_reply` appends here, refusing after `limit` entries."""

    limit: int = 1 << 30
    entries: list[tuple[str, pyfuse3.EntryAttributes, int]] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.entries]


def fake_readdir_reply(token: Listing, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
    if len(token.entries) >= token.limit:
        return False
    token.entries.append((os.fsdecode(name), attr, next_id))
    return True


def errno_of(exc: BaseException) -> int:
    assert isinstance(exc, pyfuse3.FUSEError), repr(exc)
    return exc.errno


@dataclass
class Env:
    streams: MemoryStreams
    store: ObjectStore
    ns: Namespace
    cache: ChunkCache
    fs: Filesystem  # the core
    ops: Operations  # its FUSE adapter
    config: Config
    nursery: trio.Nursery

    async def settle(self) -> None:
        """Let the namespace watch apply everything published so far."""
        await trio.testing.wait_all_tasks_blocked()

    async def lookup(self, path: str) -> pyfuse3.EntryAttributes:
        """Look up every segment of `path` (mount-relative, `/`-separated) from the root, like the kernel."""
        ino = ROOT
        attr = await self.ops.getattr(ROOT, None)
        for seg in [s for s in path.split("/") if s]:
            attr = await self.ops.lookup(ino, os.fsencode(seg), None)
            ino = attr.st_ino
        return attr

    async def open(self, ino: int, flags: int = os.O_RDONLY) -> pyfuse3.FileInfo:
        """Open `ino` as open(2) does: answered `ESTALE`, the kernel walks the path again asking for fresh
        attributes of each name (LOOKUP_REVAL) and retries the open once, on the inode the walk reached."""
        try:
            return await self.ops.open(ino, flags, CTX)
        except pyfuse3.FUSEError as e:
            if e.errno != errno.ESTALE:
                raise
        walked = await self.lookup("/".join(self.fs.inodes.path_of(InodeNo(ino))))
        return await self.ops.open(walked.st_ino, flags, CTX)

    async def listdir(self, ino: int, *, start: int = 0, limit: int = 1 << 30) -> Listing:
        fh = await self.ops.opendir(ino, None)
        listing = Listing(limit)
        try:
            await self.ops.readdir(fh, start, listing)
        finally:
            await self.ops.releasedir(fh)
        return listing

    async def read_all(self, ino: int, size: int = 128 * 1024) -> bytes:
        fi = await self.ops.open(ino, os.O_RDONLY, None)
        out = []
        off = 0
        try:
            while True:
                piece = await self.ops.read(fi.fh, off, size)
                if not piece:
                    break
                out.append(piece)
                off += len(piece)
        finally:
            await self.ops.release(fi.fh)
        return b"".join(out)

    async def cat(self, path: str) -> bytes:
        return await self.read_all((await self.lookup(path)).st_ino)


async def replay_dump(streams: MemoryStreams, path: Path) -> int:
    """Create the dumped stream and publish every message in order (subject, headers, payload), as replay.py."""
    dump = json.loads(path.read_text())
    await streams.create_stream({k: v for k, v in dump["config"].items() if k in _KEEP} | {"num_replicas": 1})
    for m in dump["messages"]:
        await streams.publish(m["subject"], base64.b64decode(m["data_b64"]), m["headers"] or None)
    return len(dump["messages"])
