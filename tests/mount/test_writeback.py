"""Write-back mode with real processes: a daemon killed right after closes, a torn journal, a server that
is stopped or restarted while uploads wait, a bucket that fills up, and `natsfs umount` waiting for the
uploads. Bytes are checked with nats-py, a client that is not natsfs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from helpers import Mount, create_bucket, nats_py_get, nats_py_put, stop_process, wait_for, with_nats

from natsfs.compose import WRITE_BACK_JOURNAL, spool_root
from natsfs.journal import WriteBackJournal, read_records

LATER = "--write-back=1h"  # uploads wait: what the test checks happens before any of them


def kill_daemon(m: Mount) -> None:
    """`kill -9` of the daemon, then clear its dead mount (as an admin would) so it can be mounted again."""
    assert m.proc is not None
    m.proc.kill()
    m.proc.wait()
    m.proc = None
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)


def remount(m: Mount, *args: str) -> None:
    m.args = [a for a in m.args if not a.startswith("--write-back")] + list(args)
    m.start()


def journal_path(m: Mount) -> Path:
    return spool_root(m.cache_dir, m.path.resolve()) / WRITE_BACK_JOURNAL


def in_bucket(url: str, bucket: str, name: str) -> bytes | None:
    try:
        return nats_py_get(url, bucket, name)
    except Exception:
        return None


def umount(m: Mount) -> subprocess.CompletedProcess[str]:
    proc = m.proc
    r = subprocess.run([sys.executable, "-m", "natsfs", "umount", str(m.path)], capture_output=True, text=True,
                       timeout=120)
    if proc is not None:
        proc.wait(30)
    return r


def test_kill_9_right_after_20_closes_loses_nothing(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--bucket", bucket_name, LATER)
    rng = random.Random(11)
    files = {f"f{i:02d}.bin": rng.randbytes(rng.choice([0, 1, 4096, 200_000, 300_001])) for i in range(20)}
    for name, data in files.items():
        (m / name).write_bytes(data)  # close returns: durable locally, not uploaded (1 h delay)
    assert in_bucket(nats_url, bucket_name, "f00.bin") is None
    kill_daemon(m)
    remount(m, "--write-back")
    assert wait_for(lambda: all(in_bucket(nats_url, bucket_name, n) == d for n, d in files.items()), 60)
    assert "20 file(s) closed by an earlier run" in m.log()
    assert " ERROR " not in m.log()
    assert WriteBackJournal(journal_path(m)).pending == {}


def all_in_bucket(url: str, bucket: str, files: dict[str, bytes]) -> bool:
    """Whether a fresh nats-py client reads every file of `files` with exactly its bytes."""
    async def fn(nc: Any, js: Any) -> bool:
        obs = await js.object_store(bucket)
        for name, data in files.items():
            try:
                got = (await asyncio.wait_for(obs.get(name), 30)).data
            except Exception:
                return False
            if got != data:
                return False
        return True

    return with_nats(url, fn)


def test_kill_9_in_a_burst_of_small_closes_while_uploading_loses_nothing(nats_url, bucket_name, mounter):
    """Small files closed by four writers at once (their records share syncs) while the uploader stores
    them, then kill -9 mid-way: the remount stores every closed file exactly once, and the uploads the
    dead daemon had already stored are recognised as such, not kept in lost+found as conflicts."""
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--bucket", bucket_name, "--write-back=0.3")  # some stored, most waiting at the kill
    rng = random.Random(15)
    files = {f"d{i % 4}/s{i:03d}.txt": rng.randbytes(rng.randint(0, 4096)) for i in range(400)}
    for d in range(4):
        os.mkdir(m / f"d{d}")

    def writer(k: int) -> None:
        for name, data in files.items():
            if name.startswith(f"d{k}/"):
                (m / name).write_bytes(data)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kill_daemon(m)  # every close returned: all 400 are durable locally, some uploaded, some not
    remount(m, "--write-back")
    assert wait_for(lambda: all_in_bucket(nats_url, bucket_name, files), 90)
    for name, data in list(files.items())[:20]:
        assert (m / name).read_bytes() == data
    log = m.log()
    assert umount(m).returncode == 0
    assert WriteBackJournal(journal_path(m)).pending == {}
    assert not (spool_root(m.cache_dir, m.path.resolve()) / "lost+found").exists()
    assert " ERROR " not in log


def test_a_journal_cut_mid_record_skips_only_the_torn_record(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--bucket", bucket_name, LATER)
    # j2 is larger than a record holds (INLINE_BYTES): its bytes are in its synced spool file. (A small
    # file's bytes live in its record only: one whose record is torn was never closed successfully.)
    big = b"journaled 2" * 7000
    for i in range(3):
        (m / f"j{i}.txt").write_bytes(big if i == 2 else f"journaled {i}".encode())
    kill_daemon(m)
    path = journal_path(m)
    data = path.read_bytes()
    end = read_records(data)[1]
    path.write_bytes(data[:end - 7] + bytes(len(data) - end + 7))  # the last record (j2's close) torn
    remount(m, "--write-back")
    assert wait_for(lambda: in_bucket(nats_url, bucket_name, "j1.txt") == b"journaled 1", 60)
    assert in_bucket(nats_url, bucket_name, "j0.txt") == b"journaled 0"
    log = m.log()
    assert "a torn record at byte" in log
    # j2's bytes are not lost: its spool file is kept in lost+found with the other leftovers.
    leftovers = list((spool_root(m.cache_dir, m.path.resolve()) / "lost+found" / "leftover").iterdir())
    assert [p.read_bytes() for p in leftovers] == [big]
    assert in_bucket(nats_url, bucket_name, "j2.txt") is None


def test_pending_files_show_local_bytes_while_the_server_is_down_and_umount_waits(private_server, bucket_name,
                                                                                 mounter):
    url = private_server.url
    create_bucket(url, bucket_name)
    nats_py_put(url, bucket_name, "old.txt", b"the older object")
    m = mounter(url, "--bucket", bucket_name, LATER)
    (m / "new.txt").write_bytes(b"written while the server was down")
    (m / "old.txt").write_bytes(b"rewritten locally")
    private_server.stop()
    # The server is gone and the uploads wait: what the mount shows are the local bytes.
    assert (m / "new.txt").read_bytes() == b"written while the server was down"
    assert (m / "old.txt").read_bytes() == b"rewritten locally"
    assert os.stat(m / "old.txt").st_size == len(b"rewritten locally")
    assert {"new.txt", "old.txt"} <= set(os.listdir(m.path))
    private_server.start()
    r = umount(m)
    assert r.returncode == 0, r.stderr
    assert "write-back upload(s) done" in r.stderr
    assert nats_py_get(url, bucket_name, "new.txt") == b"written while the server was down"
    assert nats_py_get(url, bucket_name, "old.txt") == b"rewritten locally"
    assert " ERROR " not in m.log()


def test_a_server_restart_during_write_back_uploads_loses_nothing(private_server, bucket_name, mounter):
    url = private_server.url
    create_bucket(url, bucket_name)
    m = mounter(url, "--bucket", bucket_name, LATER)
    files = {f"r{i}.bin": os.urandom(700_000) for i in range(8)}
    for name, data in files.items():
        (m / name).write_bytes(data)
    private_server.stop()
    # The unmount starts the uploads at once (no more delay) while the server is down; it comes back.
    proc = m.proc
    umounting = subprocess.Popen([sys.executable, "-m", "natsfs", "umount", str(m.path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: "write-back upload postponed" in m.log(), 30)
    private_server.start()
    _, err = umounting.communicate(timeout=120)
    assert umounting.returncode == 0, err
    assert proc is not None and proc.wait(30) == 0
    assert "8 of 8 write-back upload(s) done" in err
    for name, data in files.items():
        assert nats_py_get(url, bucket_name, name) == data
    assert " ERROR " not in m.log()


def _stats(m: Mount) -> dict[str, Any]:
    return dict(json.loads(os.getxattr(m.path, "user.natsfs.stats")))


def _stream_messages(url: str, bucket: str) -> int:
    async def fn(nc: Any, js: Any) -> int:
        return int((await js.stream_info(f"OBJ_{bucket}")).state.messages)

    return int(with_nats(url, fn))


def _publishes(m: Mount) -> int:
    return sum(n for call, n in _stats(m)["server_calls"].items() if call.startswith("publish"))


def test_umount_with_a_stopped_server_keeps_the_pending_upload_for_the_next_mount(private_server, bucket_name,
                                                                                 mounter):
    """`natsfs umount` of a write-back mount whose server does not answer (SIGSTOP): the daemon waits
    --shutdown-timeout for the upload, then exits (closing its connection does not wait on that server,
    nor leaves an asyncio ERROR), and umount's last line says the file stays in the journal; it exits 0
    (the mount is gone, nothing is lost). The next write-back mount uploads it. Shown by outcomes, not a
    clock: umount and the daemon end while the server is still stopped (guards of 60 and 30 s, far
    above 3 s), the daemon's wait ended at its deadline, and it closed its connection meanwhile."""
    url = private_server.url
    create_bucket(url, bucket_name)
    m = mounter(url, "--bucket", bucket_name, LATER, "--shutdown-timeout", "3s")
    data = os.urandom(200_000)
    (m / "pending.bin").write_bytes(data)
    assert private_server.proc is not None and m.proc is not None
    proc = m.proc
    stop_process(private_server.proc.pid)
    try:
        r = subprocess.run([sys.executable, "-m", "natsfs", "umount", str(m.path)], capture_output=True, text=True,
                           timeout=60)
        status = proc.wait(30)
        log = m.log()  # (complete: the daemon has exited, before the server went on)
        assert not m.unexpected_log(), m.unexpected_log()
    finally:
        os.kill(private_server.proc.pid, signal.SIGCONT)
    assert r.returncode == 0, r.stderr
    assert status == 0
    assert "unmounting: 1 write-back upload(s) not done after 3 s" in log, log[-3000:]  # the deadline ended it
    assert "closed the connection to NATS" in log, log[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("natsfs: 0 of 1 write-back upload(s) done; 1 not uploaded (200000 bytes): they stay in "
                           "the write-back journal"), r.stderr
    assert not m.mounted()
    m.proc = None
    remount(m, "--write-back")
    assert wait_for(lambda: in_bucket(url, bucket_name, "pending.bin") == data, timeout=60, interval=0.5), \
        m.log()[-3000:]


def test_a_write_and_close_do_not_wait_for_an_upload_stuck_on_a_stopped_server(private_server, bucket_name,
                                                                              mounter):
    """The server is stopped (SIGSTOP: the connection stays open, nothing is answered; the mount notices
    only at its ping timeout, a minute or more) while the write-back uploader's put of a file still open
    is under way (started by an fsync, its first publish sent). A write of that file and its close still
    return at once (within the 1 s a change waits for an upload attempt, plus the interrupted put's
    cleanup; bounded here by 10 s, far below the put's deadline of 300 s and the ping timeout). Once
    the server goes on, a fresh client reads the newest bytes, and the interrupted put leaves no chunk
    behind (the server stores its chunk once it goes on; the put journal purges it). Shown by outcomes,
    not a clock: the write and the close return while the server is still stopped, and what let them
    go on is the change's interruption of the upload after its bounded wait (said in the log), not the
    put giving up by itself (its unacknowledged publishes, tens of seconds: "postponed") nor the
    connection's loss (the ping timeout)."""
    url = private_server.url
    create_bucket(url, bucket_name)
    m = mounter(url, "--bucket", bucket_name, "--write-back", "--flush-timeout", "300s")
    # (One chunk, put in-process: its publish is counted in the mount's stats.)
    first, second = os.urandom(100_000), os.urandom(100_000)
    path = m / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # (opened with the server up: no sealed-state check later)
    assert private_server.proc is not None
    server_pid = private_server.proc.pid
    done: list[str] = []
    changing: threading.Thread | None = None
    try:
        os.write(fd, first)
        stop_process(server_pid)
        published = _publishes(m)
        os.fsync(fd)  # durable locally; the uploader's put starts and gets no answer
        assert wait_for(lambda: _publishes(m) > published, timeout=30), m.log()[-3000:]

        def change() -> None:
            assert os.pwrite(fd, second, 0) == len(second)
            done.append("written")
            os.close(fd)
            done.append("closed")

        changing = threading.Thread(target=change, daemon=True)
        changing.start()
        # (A guard only: a failing run's change returns once the put gives up, or at the connection's loss.)
        changing.join(180)
        assert not changing.is_alive(), "the write or close waited for the stopped server"
        log = m.log()
        assert done == ["written", "closed"], done
        assert "was interrupted by a change of the file, which waited" in log, log[-3000:]
        assert "write-back upload postponed" not in log and "lost the connection" not in log, log[-3000:]
        assert path.read_bytes() == second  # the mount shows the newest bytes meanwhile
    finally:
        os.kill(server_pid, signal.SIGCONT)
        if changing is None:
            os.close(fd)
        else:
            changing.join(120)  # (a failing run's change ends once the server answers again)
    assert wait_for(lambda: in_bucket(url, bucket_name, "f.bin") == second, timeout=120, interval=0.5), \
        m.log()[-3000:]
    # The interrupted put's chunk is purged once settled: the stream holds the object's chunk and its
    # meta, nothing else.
    assert wait_for(lambda: _stats(m)["unfinished_puts"] == 0, timeout=120, interval=0.2), m.log()[-3000:]
    assert wait_for(lambda: _stream_messages(url, bucket_name) == 1 + 1, timeout=60, interval=0.5), \
        _stream_messages(url, bucket_name)
    assert " ERROR " not in m.log()


def test_a_bucket_that_fills_up_keeps_the_file_never_half_stored(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name, max_bytes=1 << 20)
    m = mounter(nats_url, "--bucket", bucket_name, "--write-back")
    data = os.urandom(3 << 20)
    (m / "small.txt").write_bytes(b"fits")
    (m / "big.bin").write_bytes(data)  # close succeeds: the refusal comes at upload
    assert wait_for(lambda: "big.bin: not stored by the write-back uploader" in m.log(), 60)
    # The refusal names the bucket, not the meta or chunk subject it came on.
    assert f"big.bin: not stored by the write-back uploader (bucket {bucket_name}: refused by the server: " \
        "maximum bytes exceeded); its bytes are kept at" in m.log()
    assert f"$O.{bucket_name}." not in m.log()
    assert in_bucket(nats_url, bucket_name, "big.bin") is None
    assert in_bucket(nats_url, bucket_name, "small.txt") == b"fits"
    kept = list((spool_root(m.cache_dir, m.path.resolve()) / "lost+found" / bucket_name).iterdir())
    assert [p.read_bytes() == data for p in kept] == [True]
    assert not os.path.exists(m / "big.bin")


def test_without_write_back_a_dead_runs_journal_is_kept_in_lost_found(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--bucket", bucket_name, LATER)
    (m / "w.txt").write_bytes(b"closed, never uploaded")
    kill_daemon(m)
    remount(m)
    assert "without --write-back they are not replayed but kept in lost+found" in m.log()
    leftovers = list((spool_root(m.cache_dir, m.path.resolve()) / "lost+found" / "leftover").iterdir())
    assert [p.read_bytes() for p in leftovers] == [b"closed, never uploaded"]
    assert not journal_path(m).exists()
    assert in_bucket(nats_url, bucket_name, "w.txt") is None


def test_a_replayed_upload_never_overwrites_another_clients_newer_version(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    nats_py_put(nats_url, bucket_name, "shared.txt", b"version 1")
    m = mounter(nats_url, "--bucket", bucket_name, LATER)
    (m / "shared.txt").write_bytes(b"my pending version")
    kill_daemon(m)
    nats_py_put(nats_url, bucket_name, "shared.txt", b"their newer version")
    remount(m, "--write-back")
    assert wait_for(lambda: "another client changed it meanwhile; your bytes are kept at" in m.log(), 60)
    assert nats_py_get(nats_url, bucket_name, "shared.txt") == b"their newer version"
    kept = list((spool_root(m.cache_dir, m.path.resolve()) / "lost+found" / bucket_name).iterdir())
    assert [p.read_bytes() for p in kept] == [b"my pending version"]
    assert wait_for(lambda: (m / "shared.txt").read_bytes() == b"their newer version", 10)


def test_an_atomic_save_leaves_the_old_version_readable_for_other_clients_until_it_is_stored(
        nats_url, bucket_name, mounter):
    """write a temporary file, fsync, rename it over the file (an editor's save): until the upload lands,
    other clients read the old version, never nothing; then the new one, and the old chunks are gone."""
    create_bucket(nats_url, bucket_name)
    nats_py_put(nats_url, bucket_name, "doc.txt", b"old version\n" * 1000, create=False)
    m = mounter(nats_url, "--bucket", bucket_name, LATER)
    tmp = m.path / "doc.txt.tmp"
    with open(tmp, "wb") as f:
        f.write(b"new version\n" * 1200)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, m.path / "doc.txt")
    assert (m.path / "doc.txt").read_bytes() == b"new version\n" * 1200
    assert in_bucket(nats_url, bucket_name, "doc.txt") == b"old version\n" * 1000
    assert umount(m).returncode == 0
    assert in_bucket(nats_url, bucket_name, "doc.txt") == b"new version\n" * 1200
    assert in_bucket(nats_url, bucket_name, "doc.txt.tmp") is None


def test_kill_9_after_pending_files_were_replaced_unlinked_or_moved_replays_what_programs_saw(
        nats_url, bucket_name, mounter):
    """Pending files replaced by a rename (atomic saves), unlinked and created again, unlinked, and moved,
    then `kill -9`: the replay stores exactly what programs read before the crash (a fresh nats-py client
    checks), brings back nothing unlinked, and keeps nothing in lost+found."""
    create_bucket(nats_url, bucket_name)
    nats_py_put(nats_url, bucket_name, "stored.txt", b"version 1", create=False)
    m = mounter(nats_url, "--bucket", bucket_name, LATER)
    rng = random.Random(7)
    (m / "f.txt").write_bytes(b"OLD")
    (m / "tmp").write_bytes(b"NEW")
    os.rename(m / "tmp", m / "f.txt")  # an atomic save over a pending file
    (m / "stored.txt").write_bytes(b"rewritten, pending")
    saved = rng.randbytes(200_000)  # (a spool file, not its record, holds these bytes)
    (m / "tmp2").write_bytes(saved)
    os.rename(m / "tmp2", m / "stored.txt")
    (m / "u.bin").write_bytes(rng.randbytes(150_000))
    os.unlink(m / "u.bin")
    (m / "u.bin").write_bytes(b"SECOND")
    (m / "gone.txt").write_bytes(b"GONE")
    os.unlink(m / "gone.txt")
    (m / "draft.txt").write_bytes(b"MOVED")
    os.rename(m / "draft.txt", m / "final.txt")
    (m / "later.txt").write_bytes(b"a later close")
    expected = {"f.txt": b"NEW", "stored.txt": saved, "u.bin": b"SECOND", "final.txt": b"MOVED",
                "later.txt": b"a later close"}
    assert {name: (m / name).read_bytes() for name in expected} == expected
    assert in_bucket(nats_url, bucket_name, "stored.txt") == b"version 1"
    kill_daemon(m)
    remount(m, "--write-back")
    assert wait_for(lambda: all(in_bucket(nats_url, bucket_name, n) == d for n, d in expected.items()), 60)
    for name in ("tmp", "tmp2", "gone.txt", "draft.txt"):
        assert in_bucket(nats_url, bucket_name, name) is None
    assert {name: (m / name).read_bytes() for name in expected} == expected
    assert sorted(p.name for p in m.path.iterdir()) == sorted(expected)
    assert "5 file(s) closed by an earlier run" in m.log()
    assert "not reachable" not in m.log() and " ERROR " not in m.log()
    assert not (spool_root(m.cache_dir, m.path.resolve()) / "lost+found").exists()


def test_umount_waits_for_uploads_of_a_mount_given_write_back_as_o_option(nats_url, bucket_name, mounter):
    """`-o write_back=...` is how natsfs@.service passes it: umount waits and shows progress all the same."""
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--bucket", bucket_name, "-o", "write_back=1h")
    (m / "f.bin").write_bytes(b"x" * 300_000)
    assert in_bucket(nats_url, bucket_name, "f.bin") is None
    r = subprocess.run([sys.executable, "-m", "natsfs", "umount", str(m.path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "1 of 1 write-back upload(s) done" in r.stderr
    assert nats_py_get(nats_url, bucket_name, "f.bin") == b"x" * 300_000  # stored by the time umount returned
