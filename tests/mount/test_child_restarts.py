"""The daemon's helper children die (kill -9, as the OOM killer would): the upload worker and the kernel
notifier are reaped at once, said once at WARNING, and started again; nothing they were doing is lost.
Children that stop answering (SIGSTOP) are killed after a few seconds and then handled the same way.

Checked by what other clients see (nats-py reads the stored bytes back and verifies their digest), by
/proc (new pids, no zombie) and by the daemon log (one WARNING per death, no ERROR: the mounter
fixture fails a test on any ERROR record it did not declare)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import Mount, create_bucket, nats_py_get, nats_py_put, wait_for
from helpers import daemon_children as _children


def _reaped(pid: int) -> bool:
    """`pid` is gone from /proc, or (reused meanwhile) is no zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state != "Z"


def _restarted(m: Mount, role: str, old: int) -> int:
    """Wait (bounded) for a new child in `role` after `old` was killed; its pid."""
    assert m.proc is not None
    assert wait_for(lambda: _children(m.proc.pid).get(role, old) != old and _reaped(old), 30), \
        (role, old, _children(m.proc.pid), _reaped(old), m.log()[-3000:])
    return _children(m.proc.pid)[role]


def _death_warnings(m: Mount, what: str, pid: int) -> list[str]:
    return re.findall(rf"^.* WARNING .*{what} \(pid {pid}\) died \(killed by SIGKILL\).*$", m.log(), re.MULTILINE)


@pytest.fixture()
def wb(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    return m, m.path / bucket_name


def test_an_upload_worker_killed_during_a_large_cp_is_replaced_and_the_file_stored(nats_url, bucket_name, wb,
                                                                                  tmp_path):
    m, b = wb
    assert m.proc is not None
    assert wait_for(lambda: "worker" in _children(m.proc.pid))
    old = _children(m.proc.pid)["worker"]
    data = random.Random(31).randbytes(96 * 1024 * 1024)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    cp = subprocess.Popen(["cp", str(src), str(b / "big.bin")])
    try:
        # Streamed while written: the worker is sending the front by the time 8 MiB are written.
        assert wait_for(lambda: ((b / "big.bin").exists() and (b / "big.bin").stat().st_size >= 8 << 20)
                        or cp.poll() is not None, 30)
        os.kill(old, signal.SIGKILL)
    finally:
        assert cp.wait(120) == 0
    assert nats_py_get(nats_url, bucket_name, "big.bin") == data  # byte-exact, digest verified
    new = _restarted(m, "worker", old)
    assert len(_death_warnings(m, "upload worker", old)) == 1, m.log()[-3000:]
    # The new worker takes the next file (and it is stored exactly too).
    (b / "next.bin").write_bytes(data[: 20 << 20])
    assert nats_py_get(nats_url, bucket_name, "next.bin") == data[: 20 << 20]
    assert _children(m.proc.pid)["worker"] == new


def test_an_idle_upload_worker_killed_is_replaced_and_the_new_one_uploads(nats_url, bucket_name, wb):
    m, b = wb
    assert m.proc is not None
    big = random.Random(32).randbytes(9 * 1024 * 1024)
    (b / "before.bin").write_bytes(big)
    old = _children(m.proc.pid)["worker"]
    os.kill(old, signal.SIGKILL)
    new = _restarted(m, "worker", old)
    (b / "after.bin").write_bytes(big[::-1])
    assert nats_py_get(nats_url, bucket_name, "before.bin") == big
    assert nats_py_get(nats_url, bucket_name, "after.bin") == big[::-1]
    assert len(_death_warnings(m, "upload worker", old)) == 1, m.log()[-3000:]
    assert "could not send it" not in m.log().split(f"upload worker (pid {old}) died")[1]  # sent by `new`
    assert _children(m.proc.pid)["worker"] == new and _reaped(old)


def _overwritten_shows(path: Path, want: bytes) -> bool:
    with contextlib.suppress(OSError):
        return path.stat().st_size == len(want) and path.read_bytes() == want
    return False


def test_a_killed_notifier_is_replaced_and_other_clients_changes_show_through(nats_url, bucket_name, wb):
    """The mount cached an object (stat and read, kernel timeouts 60 s); its notifier is killed; another
    client overwrites the object: the mount shows the new bytes and size long before the 60 s."""
    m, b = wb
    assert m.proc is not None
    nats_py_put(nats_url, bucket_name, "shared.txt", b"version one\n")
    assert wait_for(lambda: _overwritten_shows(b / "shared.txt", b"version one\n"))
    assert (b / "shared.txt").stat().st_size == 12 and (b / "shared.txt").read_bytes() == b"version one\n"
    old = _children(m.proc.pid)["notifier"]
    os.kill(old, signal.SIGKILL)
    new = _restarted(m, "notifier", old)
    assert new != old
    second = b"version two, longer than the first\n"
    nats_py_put(nats_url, bucket_name, "shared.txt", second)
    # Polled, bounded well below the 60 s the kernel may keep what it cached when nobody invalidates it.
    assert wait_for(lambda: _overwritten_shows(b / "shared.txt", second), 15), m.log()[-3000:]
    assert len(_death_warnings(m, "kernel notifier", old)) == 1, m.log()[-3000:]


def test_invalidations_queued_while_the_notifier_is_dead_are_sent_by_the_new_one(nats_url, bucket_name, wb):
    """The other client's overwrite lands right after the kill, before a new notifier runs."""
    m, b = wb
    assert m.proc is not None
    nats_py_put(nats_url, bucket_name, "raced.txt", b"first\n")
    assert wait_for(lambda: _overwritten_shows(b / "raced.txt", b"first\n"))
    old = _children(m.proc.pid)["notifier"]
    os.kill(old, signal.SIGKILL)
    second = b"second, and longer\n"
    nats_py_put(nats_url, bucket_name, "raced.txt", second)
    assert wait_for(lambda: _overwritten_shows(b / "raced.txt", second), 15), m.log()[-3000:]
    _restarted(m, "notifier", old)


def test_a_put_session_never_continues_on_a_restarted_worker(nats_url, bucket_name, tmp_path):
    """The worker holds a session's hash: after a restart, the rest of a session begun on the dead worker
    and its digest are refused (the caller sends the file again in-process), never answered by the new
    worker with a digest of the later ranges only. New sessions use the new worker."""
    import hashlib

    import trio

    from natsfs.auth import Connection
    from natsfs.errors import Unavailable
    from natsfs.retry import Restarts
    from natsfs.uploader import UploadWorker

    create_bucket(nats_url, bucket_name, atomic=False)
    chunk = 128 * 1024
    data = random.Random(33).randbytes(4 * chunk)
    spool = tmp_path / "spool.bin"
    spool.write_bytes(data)

    def subject(nuid: str) -> str:
        return f"$O.{bucket_name}.C.{nuid}"

    async def main() -> None:
        worker = UploadWorker(Connection(servers=(nats_url,)), Restarts(first=0.01))
        async with trio.open_nursery() as nursery:
            await worker.start(nursery)
            old = worker.pid
            assert worker.alive and old is not None
            await worker.send_range("OldSession000000000000", subject("OldSession000000000000"), str(spool), 0,
                                    2 * chunk, chunk, 8)
            os.kill(old, signal.SIGKILL)
            with trio.fail_after(30):
                while not (worker.alive and worker.pid != old):
                    await trio.sleep(0.02)
            assert _reaped(old)
            with pytest.raises(Unavailable):
                await worker.send_range("OldSession000000000000", subject("OldSession000000000000"), str(spool),
                                        2 * chunk, 4 * chunk, chunk, 8)
            with pytest.raises(Unavailable):
                await worker.digest("OldSession000000000000")
            await worker.drop("OldSession000000000000")
            await worker.send_range("NewSession000000000000", subject("NewSession000000000000"), str(spool), 0,
                                    4 * chunk, chunk, 8)
            assert await worker.digest("NewSession000000000000") == hashlib.sha256(data).digest()
            await worker.drop("NewSession000000000000")
            await worker.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def _hung_warnings(m: Mount, what: str, pid: int) -> list[str]:
    return re.findall(rf"^.* WARNING .*{what} \(pid {pid}\) did not answer .*$", m.log(), re.MULTILINE)


@contextlib.contextmanager
def _stopped(pid: int):
    """`pid` stopped (SIGSTOP) for the block, and never left stopped after it (SIGCONT if it still exists)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stopped_upload_worker_is_killed_and_replaced_and_the_close_succeeds(nats_url, bucket_name, wb, tmp_path):
    """The worker exists but answers nothing: the close does not wait out the flush deadline and fail,
    blamed on the server; the worker is killed (it did not answer a ping), the file is sent in-process on a
    fresh nuid, and a new worker started."""
    m, b = wb
    assert m.proc is not None
    assert wait_for(lambda: "worker" in _children(m.proc.pid))
    old = _children(m.proc.pid)["worker"]
    data = random.Random(34).randbytes(4 * 1024 * 1024)
    src = tmp_path / "mid.bin"
    src.write_bytes(data)
    with _stopped(old):
        done = subprocess.run(["cp", str(src), str(b / "mid.bin")], capture_output=True, timeout=120)
        assert done.returncode == 0, (done.stderr, m.log()[-3000:])
        new = _restarted(m, "worker", old)
    assert nats_py_get(nats_url, bucket_name, "mid.bin") == data  # byte-exact, digest verified
    assert new != old
    assert len(_hung_warnings(m, "upload worker", old)) == 1, m.log()[-3000:]
    assert not _death_warnings(m, "upload worker", old) and "unreachable or too slow" not in m.log()
    # The new worker takes the next file.
    (b / "next.bin").write_bytes(data[::-1])
    assert nats_py_get(nats_url, bucket_name, "next.bin") == data[::-1]
    assert _children(m.proc.pid)["worker"] == new


def test_a_stopped_notifier_is_killed_and_replaced_and_other_clients_changes_show_through(nats_url, bucket_name,
                                                                                         wb):
    """The mount cached an object (kernel timeouts 60 s); its notifier is stopped; another client
    overwrites the object: the invalidation goes unanswered, the notifier is killed and replaced, and
    the new one tells the kernel: the mount shows the new size and bytes long before the 60 s."""
    m, b = wb
    assert m.proc is not None
    nats_py_put(nats_url, bucket_name, "shared.txt", b"version one\n")
    assert wait_for(lambda: _overwritten_shows(b / "shared.txt", b"version one\n"))
    old = _children(m.proc.pid)["notifier"]
    second = b"version two, longer than the first\n"
    with _stopped(old):
        assert (b / "shared.txt").stat().st_size == 12  # cached while the notifier is stopped
        nats_py_put(nats_url, bucket_name, "shared.txt", second)
        # Polled, bounded well below the 60 s the kernel may keep what it cached when nobody invalidates it.
        assert wait_for(lambda: (b / "shared.txt").stat().st_size == len(second), 20), m.log()[-3000:]
        assert (b / "shared.txt").read_bytes() == second
        new = _restarted(m, "notifier", old)
    assert new != old
    assert len(_hung_warnings(m, "kernel notifier", old)) == 1, m.log()[-3000:]
    assert not _death_warnings(m, "kernel notifier", old)
