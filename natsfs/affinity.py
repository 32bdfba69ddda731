"""Which CPUs the daemon's threads and children run on (`share_one_cpu`, `next_cpu`, `release`).

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
together at boot would otherwise all share one); `--cpus any` leaves placement to the kernel.
"""

from __future__ import annotations

import collections
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
    cpu = _pick(allowed, _current_cpu(allowed), mounts_per_cpu())
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
