"""The kernel notifier child: writes FUSE invalidation messages to a cloned `/dev/fuse` descriptor.

Started by `natsfs.kernel.KernelNotifier` (see there for why a separate process). Standard library
only, so it starts in milliseconds. Input: frames of a 4-byte native length and one complete FUSE
notification; output: one line per frame with the errno of the write (0 on success). It ends at the
end of its input, or as soon as its parent is gone (parent-death SIGKILL, and a check before each
write): what is still queued then no longer matters.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import struct
import sys

PR_SET_PDEATHSIG = 1
_FRAME = struct.Struct("=I")


def main(device_fd: int, parent_pid: int) -> int:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(_FRAME.size)
        if len(header) < _FRAME.size:
            return 0
        message = stdin.read(_FRAME.unpack(header)[0])
        if os.getppid() != parent_pid:
            return 0
        try:
            os.write(device_fd, message)
            code = 0
        except OSError as e:
            code = e.errno or errno.EIO
        try:
            stdout.write(b"%d\n" % code)
            stdout.flush()
        except BrokenPipeError:
            return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
