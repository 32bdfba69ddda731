"""Who may store a file at its close: the thread group that opened it.

FUSE sends FLUSH at every close(2) of a descriptor, also of one a child process inherited (Hadoop's
`chmod` subprocess closes Spark's open write descriptors). Storing at each of them uploads a file many
times. mountpoint-s3 stores only at the flush of the opener's thread group; pyfuse3 does not tell the
flushing pid, so natsfs asks the other way round: the kernel removes a descriptor from the closing
process's table before it sends FLUSH, so a flush while the opener's thread group still holds a
descriptor open for writing on the inode came from someone else (or from a second descriptor the opener still holds)
and stores nothing; the opener's own last close, its exit, `fsync` and the last release store.

A process with hundreds of descriptors (a JVM) costs a millisecond or more to scan, and Spark
closes each of its files several times (once per `chmod` child it spawns). So a scan remembers which
descriptors of the thread group held the inode for writing, and later checks of that (process, inode)
read only those descriptors' fdinfo: one still naming the inode, writable, means it is held; none
means it is not, without another scan. The first check after a writable open usually needs no
scan either: the descriptor is expected in the lowest slot that was free when the open was answered
(`opened`), and the first write through it finds it there (`located`), so even the opener's own
close, which finds it gone, costs one readlink. The shortcut can only err towards "not held" (the
opener `dup`ed its descriptor and closed the original, or opened the inode twice for writing): that
close then stores, as a close without this check would. A process that opens and closes one file after
another (`tar -x`, `cp -r`) gets each descriptor in the slot the one before it left free (the kernel
always takes the lowest free slot): after a close that found its descriptor's slot empty, the next
writable open of that process expects its descriptor there, without listing the process's descriptors.
A process whose descriptor was not where expected is listed at each open from then on.

Everything here reads procfs only (never the mountpoint itself: `/proc/PID/fdinfo/N` names the inode
and mount without a FUSE request). When the answer cannot be read (the process is gone, another pid
namespace, no permission), the flush stores, as before.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path
from typing import Any, Protocol

KNOWN_KEPT = 4096  # (process, inode) pairs whose holding descriptors are remembered
SLOTS_GUESSED = 8  # free descriptor slots noted at a writable open (see `ProcOpeners.opened`)
# A thread's thread group is remembered this long: `tar -x` opens thousands of files from one thread, and
# /proc/PID/status costs tens of microseconds under load. A pid reused within it (the pid space would
# have to wrap in a second) can only make the check look at the wrong process: a flush that stores.
THREAD_GROUP_KEPT_S = 1.0


class Openers(Protocol):
    def thread_group(self, pid: int) -> int | None:
        """The thread group (process) of thread `pid`, None if unknown."""

    def opened(self, tgid: int, ino: int) -> None:
        """Process `tgid` is being given a descriptor for writing on inode `ino`."""

    def located(self, tgid: int, ino: int) -> None:
        """A write through a descriptor of `tgid`'s open of inode `ino` is being served (the descriptor
        is surely installed now): remember where it is, if that is cheap to find."""

    def still_holds(self, tgid: int, ino: int, max_fds: int | None = None) -> bool | None:
        """Whether process `tgid` still has a descriptor open for writing on inode `ino` of this mount;
        None (not looked at) when it has more than `max_fds` descriptors open."""


def _mount_id(mountpoint: Path) -> int | None:
    """The mount id (as /proc/PID/fdinfo shows it) of the mount at `mountpoint`, the topmost one."""
    found = None
    target = os.fsencode(str(mountpoint))
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4].replace(b"\\040", b" ") == target:
                    found = int(fields[0])
    except OSError:
        return None
    return found


class ProcOpeners:
    """`Openers` read from /proc of this machine."""

    def __init__(self, mountpoint: Path, proc: Path = Path("/proc")):
        self._mountpoint = mountpoint
        self._proc = proc
        self._mnt_id: int | None = None
        # Resolved now, before the mount exists: never a request to ourselves later.
        self._root = str(mountpoint.resolve())
        self._own_ns = _readlink(f"{proc}/self/ns/mnt")
        # (thread group, inode) -> the descriptors the last look found holding it for writing.
        self._known: dict[tuple[int, int], list[str]] = {}
        # (thread group, inode) -> where the descriptor of a writable open is expected (see `opened`).
        self._expected: dict[tuple[int, int], list[str]] = {}
        self._thread_groups: dict[int, tuple[int, float]] = {}  # thread -> (its thread group, when read)
        # Thread group -> the slot its last writable open's descriptor was found in and its close found
        # empty again: where its next one is expected (see the module docstring).
        self._free_slot: dict[int, str] = {}
        # (thread group, inode) whose expected slot came from `_free_slot`, not from a listing.
        self._predicted: dict[tuple[int, int], bool] = {}
        self._mispredicted: dict[int, bool] = {}  # thread groups whose descriptor was elsewhere: listed

    def thread_group(self, pid: int) -> int | None:
        if pid <= 0:  # a process in another pid namespace shows as 0
            return None
        now = time.monotonic()
        known = self._thread_groups.get(pid)
        if known is not None and now - known[1] < THREAD_GROUP_KEPT_S:
            return known[0]
        try:
            with open(f"{self._proc}/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Tgid:"):
                        tgid = int(line.split()[1])
                        self._thread_groups.pop(pid, None)
                        _bounded_put(self._thread_groups, pid, (tgid, now))
                        return tgid
        except (OSError, ValueError, IndexError):
            return None
        return None

    def still_holds(self, tgid: int, ino: int, max_fds: int | None = None) -> bool | None:
        key = (tgid, ino)
        known = self._known.pop(key, None)
        if known is None:
            guesses = self._expected.pop(key, None)
            self._predicted.pop(key, None)
            if guesses is not None:
                found = self._holding(tgid, ino, guesses, first_only=True)
                if found:
                    self._remember(key, found)
                    return True
        if known is not None:
            if len(known) == 1 and _readlink(f"{self._proc}/{tgid}/fd/{known[0]}") is None:
                # The slot is empty (the opener's own close): not held, and its next open's slot.
                _bounded_put(self._free_slot, tgid, known[0])
                return False
            held = self._holding(tgid, ino, known)
            if held:
                self._remember(key, held)
            return bool(held)
        try:
            fds = os.listdir(f"{self._proc}/{tgid}/fdinfo/")
        except OSError:
            return False
        if max_fds is not None and len(fds) > max_fds:
            return None
        held = self._holding(tgid, ino, self._in_this_mount(tgid, fds))
        if held:
            self._remember(key, held)
        return bool(held)

    def _holding(self, tgid: int, ino: int, fds: list[str], *, first_only: bool = False) -> list[str]:
        """Those of `fds` (descriptor numbers of `tgid`) open for writing on inode `ino` of this mount;
        with `first_only`, at most the first one found."""
        if self._mnt_id is None:
            self._mnt_id = _mount_id(self._mountpoint)
        fdinfo = f"{self._proc}/{tgid}/fdinfo/"  # (plain strings: this runs at every close of a writer)
        held = []
        for fd in fds:
            if self._writes_to(fdinfo + fd, ino):
                held.append(fd)
                if first_only:
                    break
        return held

    def opened(self, tgid: int, ino: int) -> None:
        """Note the lowest free descriptor numbers of `tgid`: the kernel reserves the lowest free slot
        for an open before it asks us and installs the descriptor there once we answer, so the first
        check will most likely find it among them (a few fdinfo reads instead of a scan; a slot below
        ours may be reserved by another thread's open in flight). A miss falls back to the scan."""
        key = (tgid, ino)
        slot = self._free_slot.pop(tgid, None)
        if slot is not None and tgid not in self._mispredicted:
            _bounded_put(self._expected, key, [slot])
            _bounded_put(self._predicted, key, True)
            return
        self._predicted.pop(key, None)
        try:
            used = {int(fd) for fd in os.listdir(f"{self._proc}/{tgid}/fd")}
        except (OSError, ValueError):
            return
        free = (str(n) for n in itertools.count() if n not in used)
        _bounded_put(self._expected, key, list(itertools.islice(free, SLOTS_GUESSED)))

    def located(self, tgid: int, ino: int) -> None:
        """At the first write through a writable open, its descriptor is in one of the slots `opened`
        noted (no scan here: a miss leaves the guesses for the first check). Remembered where it is,
        the opener's own close (whose descriptor the kernel removed before the flush) then costs one
        fdinfo read instead of the guesses and a scan."""
        key = (tgid, ino)
        guesses = self._expected.get(key)
        if guesses is None or key in self._known:
            return
        found = self._holding(tgid, ino, guesses, first_only=True)
        if self._predicted.pop(key, False) and not found:
            # Not in the slot its last close left free (the first check scans, as after any miss): this
            # process is listed at its opens from now on.
            _bounded_put(self._mispredicted, tgid, True)
        if found:
            self._expected.pop(key, None)
            self._remember(key, found)

    def _remember(self, key: tuple[int, int], fds: list[str]) -> None:
        _bounded_put(self._known, key, fds)

    def _writes_to(self, fdinfo_path: str, ino: int) -> bool:
        """Whether the descriptor of this fdinfo file is open for writing on inode `ino` of this mount."""
        try:  # (os.open and os.read: half the time of a Python file object, 8.6 against 16 us)
            fd = os.open(fdinfo_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                text = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:
            return False  # closed meanwhile
        fields = dict(line.split(b":", 1) for line in text.splitlines() if b":" in line)
        try:
            if int(fields.get(b"ino", b"-1")) != ino:
                return False
            if self._mnt_id is not None and int(fields.get(b"mnt_id", b"-1")) != self._mnt_id:
                return False
            # A reader's close never stores, so it never waits for one.
            return int(fields.get(b"flags", b"0"), 8) & os.O_ACCMODE != os.O_RDONLY
        except ValueError:
            return False

    def _in_this_mount(self, tgid: int, fds: list[str]) -> list[str]:
        """The descriptors of `tgid` whose path lies in this mount: a JVM holds hundreds of descriptors
        (jars, sockets), and one readlink each is far cheaper than reading each one's fdinfo. Only
        comparable within our own mount namespace (elsewhere, or unreadable: every descriptor)."""
        if self._own_ns is None or _readlink(f"{self._proc}/{tgid}/ns/mnt") != self._own_ns:
            return fds
        base = f"{self._proc}/{tgid}/fd/"
        prefix = self._root.rstrip("/") + "/"
        found = []
        for fd in fds:
            target = _readlink(base + fd)
            if target is not None and (target == self._root or target.startswith(prefix)):
                found.append(fd)
        return found


def _bounded_put(table: dict[Any, Any], key: Any, value: Any) -> None:
    table[key] = value
    if len(table) > KNOWN_KEPT:  # (checks also run on worker threads: never raise here)
        with contextlib.suppress(StopIteration, RuntimeError):
            table.pop(next(iter(table)), None)


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None
