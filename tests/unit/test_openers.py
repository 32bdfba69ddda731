"""ProcOpeners against this process's own descriptors (procfs, no mount needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from natsfs.openers import ProcOpeners


def test_a_writable_descriptor_is_held_until_closed_and_remembered_between_looks(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    ino = path.stat().st_ino
    openers = ProcOpeners(tmp_path)
    me = os.getpid()
    padding = [os.open("/dev/null", os.O_RDONLY) for _ in range(100)]  # a process with many descriptors
    try:
        assert openers.still_holds(me, ino) is False
        reader = os.open(path, os.O_RDONLY)
        assert openers.still_holds(me, ino) is False  # a reader never holds a file back
        fd = os.open(path, os.O_WRONLY)
        assert openers.still_holds(me, ino, max_fds=64) is None  # too many descriptors to look inline
        assert openers.still_holds(me, ino) is True  # the full look, remembered
        assert openers.still_holds(me, ino, max_fds=64) is True  # only the remembered descriptor read
        os.close(fd)
        assert openers.still_holds(me, ino, max_fds=64) is False
        # The number reused by another file: not held.
        fd = os.open(path, os.O_WRONLY)
        assert openers.still_holds(me, ino) is True
        os.close(fd)
        other = tmp_path / "g"
        fd = os.open(other, os.O_WRONLY | os.O_CREAT)
        assert openers.still_holds(me, ino, max_fds=64) is False
        os.close(fd)
        os.close(reader)
    finally:
        for p in padding:
            os.close(p)


def test_a_process_that_is_gone_holds_nothing(tmp_path: Path) -> None:
    assert ProcOpeners(tmp_path).still_holds(2**22 + 12345, 1) is False


CHILD = """
import os, sys
padding = [os.open("/dev/null", os.O_RDONLY) for _ in range(100)]
print("ready", flush=True)
for line in sys.stdin:
    verb, arg = line.split()
    if verb == "open":
        print(os.open(arg, os.O_WRONLY), flush=True)
    else:
        os.close(int(arg))
        print("closed", flush=True)
"""


def test_the_descriptor_of_a_noted_open_is_found_without_a_scan(tmp_path: Path) -> None:
    """Another process (as the kernel sees it: our answer comes before its descriptor is installed)."""
    path = tmp_path / "f"
    path.write_bytes(b"x")
    ino = path.stat().st_ino
    openers = ProcOpeners(tmp_path)
    child = subprocess.Popen([sys.executable, "-I", "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdin is not None and child.stdout is not None

    def ask(line: str) -> str:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    try:
        assert child.stdout.readline().strip() == "ready"
        openers.opened(child.pid, ino)
        fd = ask(f"open {path}")
        # max_fds=64 refuses a scan of the child's 100+ descriptors (None): found where noted.
        assert openers.still_holds(child.pid, ino, max_fds=64) is True
        ask(f"close {fd}")
        assert openers.still_holds(child.pid, ino, max_fds=64) is False
        # Not where noted (the slots were taken meanwhile): the scan decides.
        openers.opened(child.pid, ino)
        squatters = [ask("open /dev/null") for _ in range(10)]
        fd = ask(f"open {path}")
        assert openers.still_holds(child.pid, ino, max_fds=64) is None
        assert openers.still_holds(child.pid, ino) is True
        for n in [fd, *squatters]:
            ask(f"close {n}")
        assert openers.still_holds(child.pid, ino) is False
    finally:
        child.kill()
        child.wait()
