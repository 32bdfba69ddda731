"""Telling the kernel that what it cached is no longer true (entries, attributes, page cache).

pyfuse3's invalidate calls block until the kernel has dropped what it held, and the kernel may need
to wait for a FUSE request of ours to finish first, so calling them on the trio thread can deadlock.
`KernelNotifier` queues invalidations and runs them one by one on a worker thread; one already
waiting in the queue is not queued twice (a burst of changes to one entry costs one invalidation).
Without a mounted kernel (tests of the operations class) it just records them.
"""

from __future__ import annotations

import errno
import logging
import math

import pyfuse3
import trio

log = logging.getLogger(__name__)


class KernelNotifier:
    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[tuple[str, int, bytes | None]](math.inf)
        self.running = False
        self.sent: list[tuple[str, int, bytes | None]] = []  # what was asked, for tests
        self._waiting: set[tuple[str, int, bytes | None]] = set()
        self.done = 0  # invalidations the kernel was asked for

    def start(self, nursery: trio.Nursery) -> None:
        self.running = True
        nursery.start_soon(self._run)

    def inode(self, ino: int, *, attr_only: bool = False) -> None:
        """Drop the kernel's attributes (and, unless attr_only, cached pages) of `ino`."""
        self._queue(("attr" if attr_only else "inode", ino, None))

    def entry(self, parent_ino: int, name: bytes) -> None:
        """Drop the kernel's cached name → inode entry `name` in directory `parent_ino`."""
        self._queue(("entry", parent_ino, name))

    def _queue(self, item: tuple[str, int, bytes | None]) -> None:
        self.sent.append(item)
        if len(self.sent) > 1000:
            del self.sent[:500]
        if self.running and item not in self._waiting:
            self._waiting.add(item)
            self._send.send_nowait(item)

    async def _run(self) -> None:
        async for item in self._recv:
            self._waiting.discard(item)
            kind, ino, name = item
            self.done += 1
            try:
                if kind == "entry":
                    assert name is not None
                    await trio.to_thread.run_sync(pyfuse3.invalidate_entry, ino, name)
                else:
                    await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, kind == "attr")
            except (OSError, pyfuse3.FUSEError) as e:
                code = getattr(e, "errno", None)
                if code not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF):
                    log.debug("invalidate %s %d %r failed: %s", kind, ino, name, e)
