"""Which CPUs the daemon's threads and children may run on (`share_one_cpu`, `release`).

Design note. Every FUSE request that needs the server crosses threads twice: the trio (FUSE) thread
hands it to the asyncio (NATS) thread, and the reply comes back the same way. Each hand-off wakes the
other thread, and when that thread sleeps on another CPU which has gone idle, the wake-up costs the
time for that CPU to come back (an inter-processor interrupt; on a VM, a halted vCPU): 70-150 us per
hop measured on the 2-vCPU test machine, against a few microseconds for a switch on one CPU. The two
threads hardly ever run at the same time anyway (they share the GIL), so they, and the helper threads
and the invalidation child they start, are kept on one CPU: a request round trip went from about 480
to 290 us, random 4 KiB cold reads from 0.87 to 0.70 ms p50 and `tar -x` from 391 to 427 files/s,
and the cold `cat` and `cp` rows did not get slower (measured: 318 -> 368 and 303 -> 436 MiB/s).
The upload worker (hashing, its own GIL) and the embedded nats-server are given the daemon's original
CPUs back, so they still use the others. The CPU is the one the daemon starts on; `--cpus any`
leaves placement to the kernel.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

# What the process was allowed before `share_one_cpu`; None while nothing was narrowed.
_original: set[int] | None = None


def _current_cpu(allowed: set[int]) -> int:
    try:
        cpu = int(ctypes.CDLL(None).sched_getcpu())
    except (OSError, AttributeError):
        cpu = -1
    return cpu if cpu in allowed else min(allowed)


def share_one_cpu() -> int | None:
    """Keep the calling thread, and every thread and process it starts from now on, on the CPU it runs
    on (see the design note); the CPU, or None where there is nothing to narrow or it is refused."""
    global _original
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
    _original = allowed
    return cpu


def release(pid: int) -> None:
    """Give a child the CPUs the daemon had before `share_one_cpu` (a worker that should run beside it)."""
    if _original is None:
        return
    try:
        os.sched_setaffinity(pid, _original)
    except OSError as e:  # the child is gone already, or the set changed: it keeps the one CPU
        log.debug("could not widen the CPUs of process %d (%s)", pid, e)

