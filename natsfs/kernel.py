"""Telling the kernel that what it cached is no longer true (entries, attributes, page cache).

A reverse invalidation can wait in the kernel: dropping an entry takes its directory's lock, which a
request of ours in flight (a rename, a lookup) holds, and dropping pages waits for the page locks a
read in flight holds. Three rules keep that from ever becoming a deadlock:

- **Not what this mount is changing itself.** The caller (fs.py) never asks for entries its own
  operations are changing: the kernel already knows, and its lock is held by our request.
- **Not while a request on the inode is in flight.** An entry (keyed by its directory) or an inode's
  pages wait in `_parked` while `busy(inode)` says a request of ours names that inode, and go out when
  the last one finishes (`idle`). Attribute-only invalidations take no lock and are never held back.
- **Never from the daemon's own file table.** A thread of the daemon blocked in an invalidation would
  keep the daemon's `/dev/fuse` open after a `kill -9` (the process cannot finish dying while one of
  its threads waits in the kernel), so the connection would never be torn down: the request it waits
  for is never answered, the thread never returns. Invalidations are therefore written by a small
  child process (`natsfs.notifier`) through a *clone* of the session's device
  (`FUSE_DEV_IOC_CLONE`). When the daemon dies, its own device file is released at once, which ends
  every request it had read and not answered (the kernel answers them `ECONNABORTED`); the locks they
  held are freed, the child's invalidation completes, the child dies (it asked for `SIGKILL` when its
  parent dies, and it stops at the end of its input), and with the last device file the connection is
  aborted: applications get `ENOTCONN`, nothing stays in D state, the mountpoint can be unmounted.
  (Requests the kernel had queued but the daemon had not read yet are only ended by that abort; an
  invalidation waiting on a lock whose holder waits on such a request would keep the child, and so the
  connection, alive. The window is the microseconds between the kernel queueing a request and the
  daemon reading it, while the child is already waiting; `/sys/fs/fuse/connections/N/abort` ends it.)

The child answers each message with its errno (0 on success). Nothing waits for it at shutdown.
A child that dies while the mount is live (a kill, the OOM killer) is reaped at once and replaced
(`retry.Restarts` paces it) on a new clone of the device; the messages it had not answered are sent
again by the new one and those asked meanwhile are queued for it. While none runs (`degraded`), the
kernel is given short timeouts (`DEGRADED_TIMEOUT`) so that it asks again soon, and what waits is
capped (`QUEUE_CAP`, oldest dropped first).
A child that stops answering (stopped by SIGSTOP, stuck in a system call) is treated as dead: once an
invalidation has waited `HUNG_AFTER` seconds with no answer meanwhile (`retry.Silence`), it is killed
(SIGKILL), said once at WARNING, and replaced the same way. While an answer is overdue by more than
`DEGRADED_TIMEOUT`, the kernel gets the short timeouts too.
Without a mounted kernel (tests of the operations class) invalidations are only recorded.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Callable

import trio

from .retry import Restarts, Silence, describe_exit

log = logging.getLogger(__name__)

# <linux/fuse.h>
FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t)
FUSE_NOTIFY_INVAL_INODE = 2
FUSE_NOTIFY_INVAL_ENTRY = 3
_OUT_HEADER = struct.Struct("=IiQ")  # len, error (the notify code), unique (0 for notifications)
_INVAL_INODE = struct.Struct("=Qqq")  # ino, offset (-1: attributes only), length (0: to the end)
_INVAL_ENTRY = struct.Struct("=QII")  # parent, namelen, flags
_FRAME = struct.Struct("=I")  # the length of each message handed to the child
# Messages handed to the child and not yet answered; more wait (deduplicated) in the queue.
_IN_FLIGHT = 64
_QUIET_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENOTCONN, errno.ENODEV)
# The kernel's entry and attribute timeouts (seconds) while no notifier runs (`KernelNotifier.degraded`):
# nothing can tell the kernel of other clients' changes then, so it must ask again soon.
DEGRADED_TIMEOUT = 1.0
# A child that leaves an invalidation unanswered this many seconds (no answer at all meanwhile) is hung: it
# is killed and replaced. Answers take microseconds; an invalidation never waits on a lock of ours for
# long (the rules above), so this only catches a stopped or stuck child.
HUNG_AFTER = 5.0
# Invalidations queued while no child takes them (restarts failing): beyond this many, the oldest are
# dropped. An entry or attribute the kernel cached expires on its own (after `DEGRADED_TIMEOUT`
# for what it was told meanwhile, the ordinary timeout for what it was told before), and a replaced
# object gets a new inode, so a dropped invalidation leaves a cache stale for a bounded time, while an
# unbounded queue would grow with every change other clients make for as long as restarts fail.
QUEUE_CAP = 65536
# How long a killed (hung) child is waited for before the next one starts anyway (it is reaped later):
# SIGKILL takes effect only when a system call it is stuck in ends.
_REAP_WAIT = 1.0

Item = tuple[str, int, bytes | None]


def notify_message(item: Item) -> bytes:
    """The FUSE notification that asks the kernel for `item` (as libfuse would write it)."""
    kind, ino, name = item
    if kind == "entry":
        assert name is not None
        body = _INVAL_ENTRY.pack(ino, len(name), 0) + name + b"\0"
        code = FUSE_NOTIFY_INVAL_ENTRY
    else:
        body = _INVAL_INODE.pack(ino, -1 if kind == "attr" else 0, 0)
        code = FUSE_NOTIFY_INVAL_INODE
    return _OUT_HEADER.pack(_OUT_HEADER.size + len(body), code, 0) + body


def session_device_fd() -> int:
    """The daemon's open `/dev/fuse` (pyfuse3 does not expose the session's descriptor)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                return int(name)
        except OSError:
            continue
    raise OSError(errno.EBADF, "no /dev/fuse descriptor in this process")


def clone_device(session_fd: int) -> int:
    """A second device file on the same FUSE connection (it receives no requests unless read)."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("=I", session_fd))
    except OSError:
        os.close(fd)
        raise
    return fd


class KernelNotifier:
    def __init__(self, busy: Callable[[int], bool] = lambda ino: False, restarts: Restarts | None = None, *,
                 hung_after: float = HUNG_AFTER, queue_cap: int = QUEUE_CAP) -> None:
        self.busy = busy
        self.queue_cap = queue_cap
        self.dropped = 0  # invalidations dropped from a full queue (`QUEUE_CAP`)
        self._drop_said = False  # (once per child that is not running)
        self.restarts = restarts or Restarts()
        self.hung_after = hung_after
        self._silence = Silence(hung_after)  # of the running child's unanswered invalidations
        self._asked = trio.Event()  # an invalidation was handed to the child (wakes its watchdog)
        self._hung = False  # the running child was killed because it did not answer
        self.attached = False  # a kernel to talk to (invalidations are queued, even while no child runs)
        self.running = False  # a child is running
        self.sent: list[Item] = []  # what was asked, for tests
        self.done = 0  # invalidations the kernel was asked for
        self._queue: dict[Item, None] = {}  # ordered, one of each
        self._parked: dict[int, dict[Item, None]] = {}
        # Handed to the child and not answered yet, in order (it answers in order): sent again by the
        # next child when this one dies.
        self._unanswered_items: collections.deque[Item] = collections.deque()
        self._wake = trio.Event()
        self._progress = trio.Event()  # set at each answer of the child (`answered`)
        self._nursery: trio.Nursery | None = None
        self._reopen: Callable[[], int] | None = None
        self._closing = False
        self._to_child: trio.lowlevel.FdStream | None = None
        self._from_child: trio.lowlevel.FdStream | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._unanswered = trio.Semaphore(_IN_FLIGHT)

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    @property
    def queued(self) -> list[Item]:
        """What waits for a child to take it, oldest first."""
        return list(self._queue)

    @property
    def degraded(self) -> bool:
        """Attached, but no child runs now (between a death and its restart, or after failed restarts):
        the kernel should not keep what it caches for long (`Filesystem` shortens its timeouts)."""
        return self.attached and not self._closing and (
            not self.running or self._silence.silent_for > DEGRADED_TIMEOUT)

    def start(self, nursery: trio.Nursery) -> None:
        """Remember where to run; invalidations start once `attach` found a kernel to talk to."""
        self._nursery = nursery

    def attach(self, device: int, reopen: Callable[[], int] | None = None) -> None:
        """Start the notifier child writing to `device` (a clone of the mounted session's `/dev/fuse`,
        see `clone_device`); this takes the descriptor over. `reopen` gives a new one for a child
        started when the last one died (without it, none is)."""
        assert self._nursery is not None, "KernelNotifier.start() was not called"
        self._spawn(device)
        self._reopen = reopen
        self.attached = True
        self._nursery.start_soon(self._supervise)

    def _spawn(self, device: int) -> None:
        """Start a child on `device` (closed here). Called from the trio (main) thread only: the child's
        parent-death signal follows the thread that started it, which lives as long as the daemon, and
        it runs on that thread's CPU (`affinity`: the daemon's)."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-I", "-m", "natsfs.notifier", str(device), str(os.getpid())],
                stdin=to_child_r, stdout=from_child_w, stderr=subprocess.DEVNULL, pass_fds=(device,),
                close_fds=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        except BaseException:
            os.close(to_child_w)
            os.close(from_child_r)
            raise
        finally:
            os.close(device)
            os.close(to_child_r)
            os.close(from_child_w)
        self._to_child = trio.lowlevel.FdStream(to_child_w)
        self._from_child = trio.lowlevel.FdStream(from_child_r)
        self._unanswered = trio.Semaphore(_IN_FLIGHT)
        self._silence = Silence(self.hung_after)
        self._hung = False
        self._drop_said = False
        self.running = True
        self.restarts.started()
        self._wake.set()  # what was queued meanwhile goes out now
        log.debug("kernel notifier started (pid %d)", self._child.pid)

    async def _supervise(self) -> None:
        """Run the child; when it dies, reap it at once, say so, queue again what it had not answered
        (those invalidations may not have reached the kernel), and start a new one (with backoff)."""
        while True:
            async with trio.open_nursery() as one_child:
                one_child.start_soon(self._send_loop)
                one_child.start_soon(self._watch, one_child.cancel_scope)
                await self._read_answers()  # until the child's output ends: it died, or was closed
                one_child.cancel_scope.cancel()
            if self._closing:
                return  # (close(): the child ends on its own, maybe only at the unmount)
            self.running = False
            child, stream = self._child, self._to_child
            self._to_child = None
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
            status = None
            if child is not None:
                with trio.move_on_after(_REAP_WAIT if self._hung else float("inf")):
                    status = await _reap(child)
                if child.returncode is None:  # killed while stuck in a system call: it exits when that ends
                    assert self._nursery is not None
                    self._nursery.start_soon(_reap, child)
            lost = len(self._unanswered_items)
            self._queue = {**dict.fromkeys(self._unanswered_items), **self._queue}
            self._unanswered_items.clear()
            # (First: a child that ran long enough ends a streak of failed restarts, and its death is
            # an ordinary one, said at WARNING.)
            pause = self.restarts.died()
            if child is not None:
                if self._hung and not self.restarts.failing:
                    log.warning("kernel notifier (pid %d) did not answer for %g s (stopped, or stuck); killed it%s",
                                child.pid, self.hung_after,
                                f", starting a new one ({lost} invalidations it had not answered are sent again)"
                                if self._reopen is not None else "; the kernel's caches now expire on their own")
                elif self.restarts.failing:
                    log.debug("kernel notifier (pid %d) %s (%s)", child.pid,
                              "did not answer" if self._hung else "died", describe_exit(status))
                elif self._reopen is None:
                    log.warning("kernel notifier (pid %d) died (%s); the kernel's caches now expire on their "
                                "own", child.pid, describe_exit(status))
                else:
                    log.warning("kernel notifier (pid %d) died (%s); starting a new one (%d invalidations it "
                                "had not answered are sent again)", child.pid, describe_exit(status), lost)
            if self._reopen is None:
                self.attached = False
                self._queue.clear()
                self._parked.clear()
                return
            while not self._closing:
                if self.restarts.newly_failing():
                    log.error("kernel notifier failed %d times in a row: other clients' changes show after "
                              "at most %g s (the kernel's timeouts are shortened); trying again every %g s at "
                              "most", self.restarts.failures, DEGRADED_TIMEOUT, self.restarts.cap)
                await trio.sleep(pause)
                if self._closing:
                    return
                try:
                    self._spawn(self._reopen())
                    break
                except OSError as e:
                    if not self.restarts.failing:
                        log.warning("kernel notifier not started (%s)", e)
                    pause = self.restarts.died()

    async def close(self) -> None:
        """Stop asking (shutdown): the child ends at the end of its input. Never waits for it, since it
        may be waiting in the kernel for a request that only the unmount will end."""
        self._closing = True
        self.running = False
        self._queue.clear()
        self._parked.clear()
        self._wake.set()
        stream, self._to_child = self._to_child, None
        if stream is not None:
            with trio.CancelScope(shield=True):
                await stream.aclose()
        if self._child is not None and self._child.poll() is None:
            log.debug("kernel notifier (pid %d) left to finish on its own", self._child.pid)

    # ------------------------------------------------------------------ asking
    def inode(self, ino: int, *, attr_only: bool = False) -> None:
        """Drop the kernel's attributes (and, unless attr_only, cached pages) of `ino`."""
        self._ask(("attr" if attr_only else "inode", ino, None))

    async def attrs_dropped(self, ino: int, *, within: float) -> bool:
        """`inode(ino, attr_only=True)`, and wait (at most `within` s) until the kernel has answered it: a
        reply that must not be followed by a read of the old attributes (a refused close) waits for it.
        Returns at once with no kernel to tell (not attached, closing); a hung child costs `within`.
        False if the wait gave up at `within` (the invalidation not answered yet), else True."""
        item: Item = ("attr", ino, None)
        self._ask(item)
        with trio.move_on_after(within) as waiting:
            while self.attached and not self._closing and (item in self._queue or item in self._unanswered_items):
                self._progress = trio.Event()
                await self._progress.wait()
        return not waiting.cancelled_caught

    def entry(self, parent_ino: int, name: bytes) -> None:
        """Drop the kernel's cached name → inode entry `name` in directory `parent_ino`."""
        self._ask(("entry", parent_ino, name))

    def idle(self, ino: int) -> None:
        """No request of ours names `ino` any more: what waited for that goes out now."""
        parked = self._parked.pop(ino, None)
        if parked:
            self._queue.update(parked)
            self._wake.set()

    def _ask(self, item: Item) -> None:
        self.sent.append(item)
        if len(self.sent) > 1000:
            del self.sent[:500]
        if not self.attached or self._closing or item in self._queue:
            return
        if len(self._queue) >= self.queue_cap:
            del self._queue[next(iter(self._queue))]
            self.dropped += 1
            if not self._drop_said:
                self._drop_said = True
                log.warning("kernel notifier: %d invalidations wait for a notifier to take them; the oldest are "
                            "dropped from now on (the kernel's caches of those expire on their own)",
                            self.queue_cap)
        self._queue[item] = None
        self._wake.set()

    def _next(self) -> Item | None:
        """The oldest queued item nothing in flight holds up (those are parked until `idle`)."""
        while self._queue:
            item = next(iter(self._queue))
            del self._queue[item]
            kind, ino, _ = item
            if kind != "attr" and self.busy(ino):
                self._parked.setdefault(ino, {})[item] = None
                continue
            return item
        return None

    async def _send_loop(self) -> None:
        """Hand queued items to the child (at most `_IN_FLIGHT` unanswered); ends when it is gone."""
        while self.running:
            item = self._next()
            if item is None:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            self._unanswered_items.append(item)  # (before any wait: a death re-queues it)
            await self._unanswered.acquire()
            self._silence.asked()
            self._asked.set()
            message = notify_message(item)
            stream = self._to_child
            if stream is None:
                return
            try:
                await stream.send_all(_FRAME.pack(len(message)) + message)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return  # the child is gone: `_supervise` notices at the end of its output

    async def _watch(self, this_child: trio.CancelScope) -> None:
        """Kill the running child when an invalidation has waited `hung_after` s with no answer meanwhile,
        and stop serving it (`this_child`: its output ends only once it exits, which a system call it is
        stuck in may delay): `_supervise` replaces it like a dead one."""
        while self.running:
            if not self._silence.waiting:
                self._asked = trio.Event()
                await self._asked.wait()
                continue
            if self._silence.hung:
                self._hung = True
                if self._child is not None and self._child.poll() is None:
                    self._child.kill()
                this_child.cancel()
                return
            await trio.sleep(self._silence.due())

    async def _read_answers(self) -> None:
        stream = self._from_child
        assert stream is not None
        buf = b""
        try:
            async for data in stream:
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    code = int(line or b"0")
                    self.done += 1
                    if self._unanswered_items:
                        self._unanswered_items.popleft()
                    self._unanswered.release()
                    self._silence.answered()
                    self._progress.set()
                    if code and code not in _QUIET_ERRNOS:
                        log.debug("invalidation failed: %s", os.strerror(code))
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()


async def _reap(child: subprocess.Popen[bytes]) -> int | None:
    """Wait for a child whose output ended to exit, and collect its status (no zombie), without blocking
    the trio thread: its pidfd becomes readable when it exits."""
    try:
        pidfd = os.pidfd_open(child.pid)
    except (OSError, AttributeError):
        return await trio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
    return child.wait()
