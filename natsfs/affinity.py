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
one it starts on; `--cpus any` leaves placement to the kernel.
"""

from __future__ import annotations

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


def share_one_cpu() -> int | None:
    """Keep the calling thread, and every thread and process it starts from now on, on the CPU it runs
    on (see the design note); the CPU, or None where there is nothing to narrow or it is refused."""
    global _original, _chosen
    try:
        allowed = os.sched_getaffinity(0)
    except (OSError, AttributeError):
        return None
    if len(allowed) < 2:
        return None
    cpu = _current_cpu(allowed)
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
