"""Replies the kernel no longer takes: a request the daemon is still serving when the filesystem is
unmounted (a kernel readahead read, or the release after a close; the kernel waits for neither) is
answered into a connection that has ended. pyfuse3 logs that as an ERROR ("fuse_reply_* failed with
No such file or directory"); the daemon logs it as one DEBUG line, still finishes the request's work,
exits cleanly, and the next mount serves the same bytes.

Real mounts and processes; the request is held in the daemon by stopping its nats-server (SIGSTOP)
until the unmount has ended the connection.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import Mount, create_bucket, nats_py_put, stop_process, wait_for, with_store

# Opens the file, says so, and at the next input line reads (argv[2] == "read") or just exits.
_HOLDER = """
import sys
f = open(sys.argv[1], "rb")
print("opened", flush=True)
sys.stdin.readline()
if sys.argv[2] == "read":
    f.read(1 << 20)
"""


def _served(mountpoint: Path, op: str) -> int:
    """How many `op` requests the daemon has begun serving (its stats xattr; the root needs no server)."""
    stats = json.loads(os.getxattr(mountpoint, "user.natsfs.stats"))
    return int(stats["ops"].get(op, 0))



def _unmount_while_served(server: Any, m: Mount, path: Path, op: str,
                          before_stop: Callable[[], None] = lambda: None) -> None:
    """A child holds `path` open (`before_stop` runs then); with the server stopped, the child reads
    and is killed (op "read": the readahead read goes on in the daemon), or exits (op "release": its
    close sends the release); once the daemon serves `op`, unmount; then let the server go on, and see
    the daemon exit 0 with no ERROR and one DEBUG line for the reply it could not deliver."""
    assert server.proc is not None and m.proc is not None
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), op], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "opened\n"
        before_stop()
        before = _served(m.path, op)
        try:
            stop_process(server.proc.pid)
            holder.stdin.write("\n")
            holder.stdin.flush()
            if op == "read":
                assert wait_for(lambda: _served(m.path, op) > before, timeout=10)
                holder.kill()  # it waits on the page, killably; the read it started stays in the daemon
                assert holder.wait(10) == -signal.SIGKILL
            else:
                assert holder.wait(10) == 0
                assert wait_for(lambda: _served(m.path, op) > before, timeout=10)
            # Nothing holds the mount open: the kernel ends the connection with `op` still in the daemon.
            r = subprocess.run(["fusermount3", "-u", str(m.path)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    assert m.proc.wait(20) == 0
    log = m.log()
    assert " ERROR " not in log, log[-3000:]
    assert f"fuse_{op}(): the kernel no longer waits for this reply" in log, log[-3000:]


def _bucket_bytes(url: str, bucket: str) -> int:
    async def size(store: Any) -> int:
        return int((await store.bucket_status(bucket)).size)

    return with_store(url, size)


def test_read_in_flight_at_unmount_is_no_error(private_server, mounter):
    """A reader blocked on a read the daemon is still fetching is killed, and the mount is unmounted
    before the fetch ends: the daemon's late reply finds no request (ENOENT from /dev/fuse). That is
    one DEBUG line, not an ERROR; the daemon exits 0, and a new mount reads every byte."""
    url = private_server.url
    create_bucket(url, "slow")
    data = os.urandom(3 * 1024 * 1024 + 17)
    nats_py_put(url, "slow", "f", data, create=False)
    m = mounter(url, "--request-timeout", "60")  # the held request must not time out under load
    path = m.path / "slow" / "f"
    assert path.stat().st_size == len(data)
    _unmount_while_served(private_server, m, path, "read")
    m.stop()
    m.start()
    assert path.read_bytes() == data


def test_release_in_flight_at_unmount_still_does_its_work(private_server, mounter):
    """The last close of a file unlinked while open purges its chunks in the release, which the kernel
    sends after close(2) returned. Unmounted while that purge waits on the server: the release's reply
    finds no request (one DEBUG line, no ERROR), and the purge is still done: the bucket no longer
    holds the file's bytes. The next mount shows the name gone and reads the other file."""
    url = private_server.url
    create_bucket(url, "rel")
    doomed = os.urandom(2 * 1024 * 1024)
    kept = os.urandom(100_000)
    nats_py_put(url, "rel", "doomed", doomed, create=False)
    nats_py_put(url, "rel", "kept", kept, create=False)
    m = mounter(url, "--request-timeout", "60")  # the held request must not time out under load
    path = m.path / "rel" / "doomed"
    assert path.stat().st_size == len(doomed)
    _unmount_while_served(private_server, m, path, "release", before_stop=path.unlink)
    assert _bucket_bytes(url, "rel") < len(doomed)
    m.stop()
    m.start()
    assert not path.exists()
    assert (m.path / "rel" / "kept").read_bytes() == kept
