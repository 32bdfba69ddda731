"""How the daemon's processes ask the C allocator to treat chunk-sized buffers (`keep_freed_buffers`).

Design note. Every chunk the daemon receives or sends is a fresh buffer of 128 KiB to 1 MiB (a
direct get's payload, a read reply joined from chunks, a FUSE write). glibc serves blocks of that size
with a private `mmap` of their own (its threshold starts at 128 KiB) and unmaps each when it is freed,
so every buffer's pages are faulted in one at a time again: about 300 page faults per MiB read, some
0.6 ms of CPU per MiB on the test machine, a fifth of the daemon's cost of a cold read. Raising the
threshold serves them from the heap instead, and raising the trim threshold keeps freed heap for the
next buffers rather than returning it to the kernel at once; the cache then recycles the memory of
chunks it lets go (measured: 320 to 60 faults per MiB, 3.1 to 2.5 ms of CPU per MiB, cold `cat` 280 to
333 MiB/s). The price is memory that stays mapped after a burst: at most `TRIM_BYTES` of free heap per
arena beyond what is in use, which the RSS bound of the daemon (cache and spool budgets + 100 MiB)
leaves room for.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap (buffers of up to a few chunks); larger ones are still mapped
# on their own and returned when freed.
MMAP_BYTES = 4 * 1024 * 1024
# Free heap at the top of an arena kept for reuse before it is returned to the kernel.
TRIM_BYTES = 32 * 1024 * 1024


def keep_freed_buffers() -> bool:
    """Tune glibc's malloc as the design note says; False where there is no glibc `mallopt`."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    if not done:
        log.debug("mallopt refused the buffer thresholds; the allocator keeps its defaults")
    return done
