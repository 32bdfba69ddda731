"""A new mount of a mountpoint waits for the daemon of the earlier mount to finish with its directory
under the cache dir (an unmount returns before that daemon has ended)."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from natsfs.mount import DAEMON_LOCK, lock_cache_root

HOLDER = """
import sys
from pathlib import Path
from natsfs.mount import lock_cache_root
lock_cache_root(Path(sys.argv[1]), Path("/mnt/x"))
print("locked", flush=True)
sys.stdin.read()  # until the test lets it end
"""


def test_a_second_daemon_waits_for_the_first_to_end(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cache" / "mnt%2Fmnt%2Fx"
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=tmp_path)
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline() == b"locked\n"
    assert oct(root.stat().st_mode & 0o777) == "0o700"  # (made private, with its parents)
    probe = os.open(root / DAEMON_LOCK, os.O_RDWR)
    with pytest.raises(BlockingIOError):  # the first daemon holds it
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(probe)

    caplog.set_level(logging.INFO, logger="natsfs.mount")
    got: list[int] = []
    second = threading.Thread(target=lambda: got.append(lock_cache_root(root, Path("/mnt/x"))))
    second.start()
    waiting = threading.Event()
    for _ in range(6000):  # (until the one line says it waits; the second cannot get past the flock before)
        if any("waiting for the daemon of an earlier mount of /mnt/x" in r.getMessage() for r in caplog.records):
            waiting.set()
            break
        second.join(0.01)
    assert waiting.is_set() and not got
    first.stdin.close()  # the first daemon ends: its lock goes with the process
    assert first.wait(30) == 0
    second.join(30)
    assert got, "the second daemon never got the lock"
    assert any("has finished" in r.getMessage() for r in caplog.records)
    os.close(got[0])


def test_a_killed_daemon_leaves_no_lock(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=tmp_path)
    assert first.stdout is not None
    assert first.stdout.readline() == b"locked\n"
    first.kill()
    first.wait(30)
    fd = lock_cache_root(root, Path("/mnt/x"))  # at once (the non-blocking try), no wait
    os.close(fd)
