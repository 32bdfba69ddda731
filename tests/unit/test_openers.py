"""ProcOpeners against this process's own descriptors (procfs, no mount needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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
        # Located at its first write: the close that removed it is then told by one fdinfo read (with
        # max_fds=64 a scan of the child's 100+ descriptors would answer None).
        openers.opened(child.pid, ino)
        fd = ask(f"open {path}")
        openers.located(child.pid, ino)
        assert openers._known[(child.pid, ino)] == [fd]
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


def test_a_thread_group_is_read_once_and_read_again_after_a_while(tmp_path: Path, monkeypatch: Any) -> None:
    import threading

    import natsfs.openers as openers_module

    openers = ProcOpeners(tmp_path)
    tids: list[int] = []
    started, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (tids.append(threading.get_native_id()), started.set(), done.wait(10)))
    worker.start()
    started.wait(10)
    try:
        assert tids[0] != os.getpid() and openers.thread_group(tids[0]) == os.getpid()  # a thread: its process
    finally:
        done.set()
        worker.join()
    assert openers.thread_group(os.getpid()) == os.getpid()
    reads: list[str] = []
    real_open = open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    assert openers.thread_group(os.getpid()) == os.getpid()
    assert reads == []  # remembered
    clock = [0.0]
    monkeypatch.setattr(openers_module.time, "monotonic", lambda: clock[0])
    openers._thread_groups.clear()
    assert openers.thread_group(os.getpid()) == os.getpid()
    clock[0] += openers_module.THREAD_GROUP_KEPT_S + 0.1
    assert openers.thread_group(os.getpid()) == os.getpid()
    assert len(reads) == 2  # read again once it is older than THREAD_GROUP_KEPT_S
    assert openers.thread_group(0) is None  # another pid namespace


def test_a_process_opening_one_file_after_another_is_not_listed_at_each_open(tmp_path: Path,
                                                                            monkeypatch: Any) -> None:
    """`tar -x`: each descriptor lands in the slot the one before it left free; after a close found that
    slot empty, the next open expects its descriptor there without listing the process's descriptors.
    A process whose descriptor was elsewhere is listed at its opens from then on."""
    paths = [tmp_path / f"f{i}" for i in range(4)]
    for p in paths:
        p.write_bytes(b"x")
    inos = [p.stat().st_ino for p in paths]
    openers = ProcOpeners(tmp_path)
    child = subprocess.Popen([sys.executable, "-I", "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdin is not None and child.stdout is not None
    listings: list[str] = []
    real_listdir = os.listdir

    def counting_listdir(path: Any) -> list[str]:
        listings.append(str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", counting_listdir)

    def ask(line: str) -> str:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    def write_and_close(i: int) -> None:
        openers.opened(child.pid, inos[i])
        fd = ask(f"open {paths[i]}")
        openers.located(child.pid, inos[i])
        assert openers.still_holds(child.pid, inos[i], max_fds=64) is True
        ask(f"close {fd}")
        assert openers.still_holds(child.pid, inos[i], max_fds=64) is False

    try:
        assert child.stdout.readline().strip() == "ready"
        write_and_close(0)
        assert len(listings) == 1  # the first open lists the child's descriptors
        write_and_close(1)
        write_and_close(2)
        assert len(listings) == 1  # the next ones are expected where the one before was
        # A descriptor left open takes that slot: the next one is elsewhere, found by the first check's
        # scan, and the process is listed at its opens from then on.
        squatter = ask("open /dev/null")
        openers.opened(child.pid, inos[3])
        fd = ask(f"open {paths[3]}")
        openers.located(child.pid, inos[3])
        assert openers.still_holds(child.pid, inos[3], max_fds=64) is None  # (100+ descriptors: no inline scan)
        assert openers.still_holds(child.pid, inos[3]) is True
        ask(f"close {fd}")
        assert openers.still_holds(child.pid, inos[3]) is False
        before = len(listings)
        write_and_close(0)
        assert len(listings) == before + 1  # listed again at the open
        ask(f"close {squatter}")
    finally:
        child.kill()
        child.wait()
