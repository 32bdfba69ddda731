"""The `natsfs` command: background mounts, one-sentence failures, the embedded server, umount."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import create_bucket, nats_py_put, wait_for

NATSFS = [sys.executable, "-m", "natsfs"]


def run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*NATSFS, *args], capture_output=True, text=True, timeout=timeout,
                          env=env or os.environ.copy())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_sentence(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.strip()
    assert proc.returncode != 0
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("natsfs: ")
    return err


def test_background_mount_returns_when_live_and_umount_unmounts(nats_url, bucket_name, tmp_path):
    nats_py_put(nats_url, bucket_name, "hello.txt", b"hi\n")
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        r = run("mount", str(mp), "--server", nats_url, "--data-dir", str(tmp_path / "data"))
        assert r.returncode == 0, r.stderr
        assert os.path.ismount(mp)
        assert (mp / bucket_name / "hello.txt").read_bytes() == b"hi\n"
        r = run("umount", str(mp))
        assert r.returncode == 0, r.stderr
        assert wait_for(lambda: not os.path.ismount(mp))
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_unreachable_server_is_one_clear_sentence(tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = run("mount", str(mp), "--server", f"nats://127.0.0.1:{free_port()}", "--data-dir", str(tmp_path))
    err = _one_sentence(r)
    assert "cannot connect" in err
    assert not os.path.ismount(mp)


def test_missing_bucket_missing_mountpoint_and_busy_mountpoint(nats_url, bucket_name, tmp_path, mounter):
    mp = tmp_path / "mnt"
    mp.mkdir()
    err = _one_sentence(run("mount", str(mp), "--server", nats_url, "--bucket", "nope_" + bucket_name,
                            "--data-dir", str(tmp_path)))
    assert "no bucket" in err
    err = _one_sentence(run("mount", str(tmp_path / "absent"), "--server", nats_url))
    assert "does not exist" in err
    m = mounter(nats_url)
    err = _one_sentence(run("mount", str(m.path), "--server", nats_url))
    assert "already a mount point" in err


def test_foreground_mount_stops_cleanly_on_sigterm(nats_url, tmp_path):
    import signal

    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen([*NATSFS, "mount", str(mp), "--server", nats_url, "--foreground",
                             "--log-file", str(tmp_path / "log")])
    try:
        assert wait_for(lambda: os.path.ismount(mp), 30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not os.path.ismount(mp)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_embedded_server_when_nothing_is_configured(tmp_path):
    """No --server and no NATS_URL: the mount runs its own nats-server, which takes only this user's
    clients (a password in server.json, 0600), and stops it at unmount; `natsfs bucket` finds it."""
    import json

    mp = tmp_path / "mnt"
    mp.mkdir()
    home = tmp_path / "home"
    data = home / ".local" / "share" / "natsfs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")} | {"HOME": str(home)}
    try:
        r = run("mount", str(mp), env=env)
        assert r.returncode == 0, r.stderr
        record = json.loads((data / "server.json").read_text())
        assert (data / "server.json").stat().st_mode & 0o777 == 0o600
        assert data.stat().st_mode & 0o777 == 0o700
        url, password = record["url"], record["password"]
        assert len(password) >= 32
        assert password not in Path(f"/proc/{record['pid']}/cmdline").read_text()  # a 0600 config has it
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            create_bucket(url, "embedded")  # another local user knows the port, not the password
        own = url.replace("nats://", f"nats://{record['user']}:{password}@")
        create_bucket(own, "embedded")
        nats_py_put(own, "embedded", "e.txt", b"embedded\n", create=False)
        assert wait_for(lambda: (mp / "embedded").exists(), 10)
        assert (mp / "embedded" / "e.txt").read_bytes() == b"embedded\n"
        listed = run("bucket", "ls", env=env)
        assert listed.returncode == 0 and listed.stdout.startswith("embedded\t"), listed.stderr
        assert password not in (data / "nats-server.log").read_text()
        assert run("umount", str(mp)).returncode == 0
        assert wait_for(lambda: not os.path.exists(f"/proc/{record['pid']}") or _zombie(record["pid"]), 20)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


def test_sigterm_unmounts_promptly_when_the_server_is_gone(private_server, tmp_path):
    import signal

    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen([*NATSFS, "mount", str(mp), "--server", private_server.url, "--foreground",
                             "--log-file", str(tmp_path / "log")])
    try:
        assert wait_for(lambda: os.path.ismount(mp), 30)
        private_server.stop()
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not os.path.ismount(mp)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_sigterm_after_a_lazy_unmount_does_not_crash(nats_url, tmp_path):
    import signal

    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen([*NATSFS, "mount", str(mp), "--server", nats_url, "--foreground",
                             "--log-file", str(tmp_path / "log")])
    try:
        assert wait_for(lambda: os.path.ismount(mp), 30)
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # never a crash (SIGSEGV)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_log_file_is_never_a_symlink_or_another_users_file(tmp_path):
    """Whoever can write the log directory must not get the daemon to append to, or chmod, a file of
    their choosing: one sentence, nothing mounted, the file untouched."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    victim = tmp_path / "victim.conf"
    victim.write_text("setting = 1\n")
    victim.chmod(0o644)
    (tmp_path / "link.log").symlink_to(victim)
    err = _one_sentence(run("mount", str(mp), "--server", f"nats://127.0.0.1:{free_port()}",
                            "--log-file", str(tmp_path / "link.log")))
    assert "cannot open the log file" in err and "symlink" in err
    assert victim.read_text() == "setting = 1\n" and victim.stat().st_mode & 0o777 == 0o644
    if os.geteuid() == 0:
        os.chown(victim, 65534, 65534)
        err = _one_sentence(run("mount", str(mp), "--server", f"nats://127.0.0.1:{free_port()}",
                                "--log-file", str(victim)))
        assert "not this user's own regular file" in err
        assert victim.read_text() == "setting = 1\n" and victim.stat().st_mode & 0o777 == 0o644
    assert not os.path.ismount(mp)


def test_log_directory_removed_while_mounted_the_mount_stays_and_serves(nats_url, bucket_name, tmp_path):
    """A clean-up job removing the log's directory: the next log line must not end the daemon."""
    nats_py_put(nats_url, bucket_name, "f", b"one\n")
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        r = run("mount", str(mp), "--server", nats_url, "--data-dir", str(tmp_path / "data"),
                "--cache-dir", str(tmp_path / "cache"), "--log-file", str(tmp_path / "logdir" / "x.log"))
        assert r.returncode == 0, r.stderr
        shutil.rmtree(tmp_path / "logdir")
        with pytest.raises(OSError):
            (mp / "bad.name").mkdir()  # an invalid bucket name: refused, with a log line
        assert (mp / bucket_name / "f").read_bytes() == b"one\n"
        assert os.path.ismount(mp)
        assert run("umount", str(mp)).returncode == 0
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_mount_on_a_dead_mount_is_one_sentence_naming_umount(nats_url, tmp_path):
    """A daemon killed -9 leaves its mount (ENOTCONN): mounting there again was an OSError traceback."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    args = ["--server", nats_url, "--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache")]
    try:
        assert run("mount", str(mp), *args).returncode == 0
        daemon = next(int(p) for p in os.listdir("/proc")
                      if p.isdigit() and "--foreground" in _cmdline(int(p)) and str(mp) in _cmdline(int(p)))
        os.kill(daemon, 9)
        assert wait_for(lambda: not os.path.exists(f"/proc/{daemon}/cmdline") or _cmdline(daemon) == [])
        err = _one_sentence(run("mount", str(mp), *args))
        assert err == (f"natsfs: mountpoint {mp} is a natsfs mount whose daemon is gone: unmount it first "
                       f"(natsfs umount {mp})")
        assert run("umount", str(mp)).returncode == 0
        assert not os.path.ismount(mp)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [x.decode(errors="replace") for x in f.read().split(b"\0") if x]
    except OSError:
        return []


def test_two_mounts_started_together_on_one_directory_one_is_refused(nats_url, tmp_path):
    """Both used to pass the "already a mount point" check, then both mounted (stacked). The check and
    the mount are one step under an flock on the directory: held here until both daemons are started."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    held = os.open(mp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        mounts = [subprocess.Popen([*NATSFS, "mount", str(mp), "--server", nats_url, "--data-dir",
                                    str(tmp_path / "data"), "--cache-dir", str(tmp_path / f"cache{i}"), "--log-file",
                                    str(tmp_path / f"m{i}.log")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for i in range(2)]
        os.close(held)
        held = -1
        results = sorted((p.wait(60), p.stderr.read().strip() if p.stderr else "") for p in mounts)
        for p in mounts:
            p.stdout and p.stdout.close()
            p.stderr and p.stderr.close()
        assert results == [(0, ""), (1, f"natsfs: mountpoint {mp} is already a mount point (busy)")]
        with open("/proc/mounts") as f:
            assert sum(line.split()[1] == str(mp) for line in f) == 1
    finally:
        if held >= 0:
            os.close(held)
        for _ in range(2):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_cache_dir_that_is_a_file_is_one_sentence_naming_it(tmp_path):
    (tmp_path / "afile").write_text("x")
    mp = tmp_path / "mnt"
    mp.mkdir()
    for extra in ([], ["--foreground"]):
        err = _one_sentence(run("mount", str(mp), *extra, "--server", f"nats://127.0.0.1:{free_port()}",
                                "--cache-dir", str(tmp_path / "afile"), "--log-file", str(tmp_path / "m.log")))
        afile = tmp_path / "afile"
        assert err == f"natsfs: --cache-dir {afile} cannot be used: {afile} is not a directory"


def test_log_file_inside_the_mountpoint_is_refused(tmp_path):
    """(The daemon stats its log path at every line: through its own mount, from the thread that serves
    it, so `natsfs mount` never returned and every access hung.)"""
    mp = tmp_path / "mnt"
    mp.mkdir()
    err = _one_sentence(run("mount", str(mp), "--server", f"nats://127.0.0.1:{free_port()}",
                            "--log-file", str(mp / "self.log"), timeout=20))
    assert "is inside the mountpoint" in err and not os.path.ismount(mp)


def test_a_server_that_never_answers_is_a_sentence_with_a_reason(tmp_path):
    """A listener that takes the connection and says nothing (a stopped server, another service): the
    sentence ended in an empty reason ("...:4222: "), a TimeoutError having no text."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        err = _one_sentence(run("mount", str(mp), "--server", url, "--request-timeout", "1s",
                                "--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache")))
    assert err == f"natsfs: cannot connect to NATS at {url}: TimeoutError"


def test_umount_of_a_non_mount_is_one_sentence_and_of_a_symlink_unmounts_its_target(nats_url, tmp_path):
    """(Were fusermount3's "failed to unmount X: Invalid argument", also for a symlink to a live mount.)"""
    mp = tmp_path / "mnt"
    mp.mkdir()
    assert _one_sentence(run("umount", str(mp))) == f"natsfs: {mp} is not a natsfs mount"
    assert _one_sentence(run("umount", "/proc")) == "natsfs: /proc is not a natsfs mount (it is a proc mount)"
    (tmp_path / "link").symlink_to(mp)
    try:
        assert run("mount", str(mp), "--server", nats_url, "--data-dir", str(tmp_path / "data"),
                   "--cache-dir", str(tmp_path / "cache")).returncode == 0
        r = run("umount", str(tmp_path / "link"))
        assert r.returncode == 0, r.stderr
        assert not os.path.ismount(mp)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
