"""Which CPUs the daemon's threads and children run on (`share_one_cpu`, `next_cpu`, `release`, `Rebalancer`).

Design note. Every FUSE request that needs the server crosses threads twice: the trio (FUSE) thread
hands it to the asyncio (NATS) thread, and the reply comes back the same way. Each hand-off wakes the
other thread, and when that thread sleeps on another CPU which has gone idle, the wake-up costs the
time for that CPU to come back (an inter-processor interrupt; on a VM, a halted vCPU): 70-150 us per
hop measured on the 2-vCPU test machine, against a few microseconds for a switch on one CPU. The two
threads hardly ever run at the same time anyway (they share the GIL), so they, and the helper threads
and the invalidation child they start, are kept on one CPU. Measured there: a request round trip
went from about 480 to 290 us, random 4 KiB cold reads from 1.05-1.10 to 0.87-0.92 ms p50, `tar -x`
from 391 to 408-427 files/s, and cold `cat` did not get slower (318 -> 368-397 MiB/s). The upload
worker (hashing, its own GIL) gets one CPU of its own, the next one: its two threads hand chunks to
each other just as often (`cp` 401-415 MiB/s with it on any CPU, 434-463 on the next one, 364-375 on
the daemon's). An embedded nats-server gets the daemon's original CPUs back. The daemon's CPU is the
one it starts on, unless other mounts are kept there and another CPU has fewer (mounts started
together at boot would otherwise all share one). The kernel cannot move pinned threads away from a
CPU that other work takes over, so `Rebalancer` checks every few seconds and moves them itself.
`--cpus any` leaves placement to the kernel.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os

log = logging.getLogger(__name__)

# What the process was allowed before `share_one_cpu`, and the CPU it chose; None while nothing was
# narrowed.
_original: set[int] | None = None
_chosen: int | None = None


def _current_cpu(allowed: set[int]) -> int:
    try:
        cpu = int(ctypes.CDLL(None).sched_getcpu())
    except (OSError, AttributeError):
        cpu = -1
    return cpu if cpu in allowed else min(allowed)


def mounts_per_cpu(proc: str = "/proc") -> collections.Counter[int]:
    """How many other natsfs daemons are kept on each CPU, told by their kernel notifier children (one
    per mount, on its daemon's CPU)."""
    counts: collections.Counter[int] = collections.Counter()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return counts
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                if b"natsfs.notifier" not in f.read():
                    continue
            with open(f"{proc}/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Cpus_allowed_list:"):
                        allowed = line.split(b":", 1)[1].strip()
                        if allowed.isdigit():
                            counts[int(allowed)] += 1
                        break
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return counts


def _pick(allowed: set[int], current: int, taken: collections.Counter[int]) -> int:
    """The CPU the daemon runs on, unless other mounts are kept there and a CPU with fewer is free:
    several mounts started from one shell (or by systemd at boot) must not all share one CPU."""
    fewest = min(taken[c] for c in allowed)
    if taken[current] == fewest:
        return current
    return min(c for c in allowed if taken[c] == fewest)


def share_one_cpu() -> int | None:
    """Keep the calling thread, and every thread and process it starts from now on, on one CPU: the
    one it runs on, or the one with the fewest other mounts (see `_pick` and the design note). The
    CPU, or None where there is nothing to narrow or it is refused."""
    global _original, _chosen
    try:
        allowed = os.sched_getaffinity(0)
    except (OSError, AttributeError):
        return None
    if len(allowed) < 2:
        return None
    taken = mounts_per_cpu()
    cpu = _pick(allowed, _current_cpu(allowed), taken)
    log.debug("the daemon's threads are kept on CPU %d (other mounts kept per CPU: %s)", cpu,
              ", ".join(f"{c}: {taken[c]}" for c in sorted(allowed)))
    try:
        # pid 0 is the calling thread only: threads already running keep their CPUs.
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        log.debug("could not keep the daemon's threads on CPU %d (%s)", cpu, e)
        return None
    _original, _chosen = allowed, cpu
    return cpu


def release(pid: int) -> None:
    """Give a child the CPUs the daemon had before `share_one_cpu` (a worker that should run beside it)."""
    if _original is None:
        return
    try:
        os.sched_setaffinity(pid, _original)
    except OSError as e:  # the child is gone already, or the set changed: it keeps the one CPU
        log.debug("could not widen the CPUs of process %d (%s)", pid, e)


def next_cpu(pid: int) -> None:
    """Keep a child's threads together on one CPU other than the daemon's (the next one it had): the
    upload worker, whose sending and hashing threads hand chunks to each other all the time."""
    if _original is None or _chosen is None:
        return
    others = sorted(c for c in _original if c != _chosen)
    if not others:
        return
    cpu = next((c for c in others if c > _chosen), others[0])
    try:
        os.sched_setaffinity(pid, {cpu})
    except OSError as e:  # the child is gone already, or the set changed: it keeps the daemon's CPU
        log.debug("could not move process %d to CPU %d (%s)", pid, cpu, e)


# Moving off a busy CPU: how often the daemon's CPU is checked, how much of it other work must take
# (in CPUs, averaged over the check) before the threads move, and by how much less busy the CPU they
# move to must be.
CHECK_S = 2.0
HOGGED = 0.5
MARGIN = 0.25


def cpu_ticks(stat_text: str) -> dict[int, tuple[int, int]]:
    """(busy, total) clock ticks of each CPU so far, from the text of /proc/stat."""
    ticks = {}
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        values = [int(v) for v in rest.split()]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # (guest time is counted in user time already)
        ticks[int(name[3:])] = (total - idle, total)
    return ticks


def better_cpu(busy: dict[int, float], ours: int, own: float) -> int | None:
    """Where the daemon's threads should go: None to stay. `busy` is each allowed CPU's use over the
    last check (0-1), `own` the daemon's own share of it. They move only when other work takes at
    least `HOGGED` of their CPU and another CPU is clearly less busy than that (by `MARGIN`)."""
    others_here = busy.get(ours, 0.0) - own
    if others_here < HOGGED:
        return None
    best = min((c for c in busy if c != ours), key=lambda c: (busy[c], c), default=None)
    if best is None or busy[best] > others_here - MARGIN:
        return None
    return best


class Rebalancer:
    """Moves the daemon's threads (and the children kept with them) off their CPU when other work
    takes it over: a pinned thread cannot be moved by the kernel, and a CPU-bound job on the same CPU
    would otherwise halve every request's speed for as long as it runs. Call `check` every `CHECK_S`;
    it never raises."""

    def __init__(self, proc: str = "/proc"):
        self._proc = proc
        self._last: tuple[dict[int, tuple[int, int]], float] | None = None
        self.moves = 0

    def check(self) -> int | None:
        """Sample the CPUs; move if `better_cpu` says so. The CPU moved to, or None."""
        if _original is None or _chosen is None:
            return None
        try:
            with open(f"{self._proc}/stat") as f:
                ticks = cpu_ticks(f.read())
            own = sum(os.times()[:2])
        except (OSError, ValueError, IndexError):
            return None
        last, self._last = self._last, (ticks, own)
        if last is None:
            return None
        before, own_before = last
        busy: dict[int, float] = {}
        span = 0
        for cpu in _original:
            if cpu in ticks and cpu in before:
                total = ticks[cpu][1] - before[cpu][1]
                if total > 0:
                    busy[cpu] = (ticks[cpu][0] - before[cpu][0]) / total
                    span = max(span, total)
        if _chosen not in busy or span == 0:
            return None
        own_share = (own - own_before) * os.sysconf("SC_CLK_TCK") / span
        target = better_cpu(busy, _chosen, own_share)
        if target is None:
            return None
        old = _chosen
        self._move(old, target)
        self.moves += 1
        log.info("moved the daemon's threads from CPU %d (%.0f%% taken by other work) to CPU %d (%.0f%% busy)",
                 old, 100 * (busy[old] - own_share), target, 100 * busy[target])
        return target

    def _move(self, old: int, new: int) -> None:
        global _chosen
        _chosen = new
        task = f"{self._proc}/self/task"
        children: list[int] = []
        with contextlib.suppress(OSError):
            for tid in os.listdir(task):
                with contextlib.suppress(OSError, ValueError):
                    if os.sched_getaffinity(int(tid)) == {old}:
                        os.sched_setaffinity(int(tid), {new})
                with contextlib.suppress(OSError, ValueError), open(f"{task}/{tid}/children") as f:
                    children += [int(pid) for pid in f.read().split()]
        for pid in children:  # the notifier goes along; a child on the new CPU (the upload worker) swaps
            with contextlib.suppress(OSError):
                mask = os.sched_getaffinity(pid)
                if mask == {old}:
                    os.sched_setaffinity(pid, {new})
                elif mask == {new}:
                    os.sched_setaffinity(pid, {old})
