"""Secrets never leak and children never import from the working directory (issue 9).

A private nats-server with user/password auth; mounts started the way a user starts them (the
`natsfs` command, background daemon). The password, given in `--server` or only in `$NATS_URL`,
must appear in no process's command line (every /proc/*/cmdline), in no environment of the daemon
or its upload worker, in no log line and in no error message, also after a reconnect and after a
wrong-password attempt. Modules planted in the working directory of `natsfs mount` are never
imported by the daemon or its upload worker.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import create_bucket, nats_py_get, wait_for

from natsfs.server import NatsServer

USER = "natsfs-user"
PASSWORD = "pw-9c1e5f0b7a2d"  # unique: found anywhere means leaked
NATSFS = str(Path(sys.executable).parent / "natsfs")


@pytest.fixture()
def auth_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats", auth=(USER, PASSWORD))
    server.start()
    yield server
    server.stop()


def _url(server: NatsServer, password: str = PASSWORD) -> str:
    return f"nats://{USER}:{password}@{server.host}:{server.port}"


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def _cmdlines_with(needle: str) -> list[str]:
    return [_read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
            for pid in _pids() if needle.encode() in _read(f"/proc/{pid}/cmdline")]


def _mount_processes(mountpoint: Path) -> list[int]:
    """The daemon serving `mountpoint` and its children (the upload worker, the kernel notifier)."""
    daemons = {pid for pid in _pids() if str(mountpoint).encode() in _read(f"/proc/{pid}/cmdline")}
    children = set()
    for pid in _pids():
        stat_line = _read(f"/proc/{pid}/stat").decode(errors="replace")
        if stat_line and int(stat_line.rsplit(")", 1)[1].split()[1]) in daemons:
            children.add(pid)
    return sorted(daemons | children)


@contextlib.contextmanager
def background_mount(mountpoint: Path, data_dir: Path, cache_dir: Path, args: list[str],
                     env: dict[str, str] | None = None, cwd: Path | None = None
                     ) -> Iterator[subprocess.CompletedProcess[str]]:
    """`natsfs mount` as a user runs it (daemon in the background); unmounted and waited for at the end."""
    mountpoint.mkdir(exist_ok=True)
    proc = subprocess.run([NATSFS, "mount", str(mountpoint), "--data-dir", str(data_dir), "--cache-dir",
                           str(cache_dir), "--log-level", "debug", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    try:
        yield proc
    finally:
        with open("/proc/mounts") as f:
            mounted = any(line.split()[1] == str(mountpoint) for line in f)
        if mounted:
            subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        assert wait_for(lambda: not _mount_processes(mountpoint), 20), "the daemon did not exit"


def _log_of(data_dir: Path) -> Path:
    (log,) = (data_dir / "logs").iterdir()
    return log


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "NATS_URL"} | extra


def _assert_no_password_anywhere(mountpoint: Path, texts: list[str]) -> None:
    assert _cmdlines_with(PASSWORD) == []
    assert _cmdlines_with("pwWRONG") == []
    for pid in _mount_processes(mountpoint):
        assert PASSWORD.encode() not in _read(f"/proc/{pid}/environ"), _read(f"/proc/{pid}/cmdline")
    for text in texts:
        assert PASSWORD not in text and "pwWRONG" not in text, text


@pytest.mark.parametrize("given_by", ["--server", "NATS_URL"])
def test_password_never_in_argv_environment_or_log(auth_server, tmp_path, given_by):
    url = _url(auth_server)
    bucket = "secrets"
    create_bucket(url, bucket)
    mp, data_dir = tmp_path / "mnt", tmp_path / "data"
    args, env = (["--server", url], _env()) if given_by == "--server" else ([], _env(NATS_URL=url))
    with background_mount(mp, data_dir, tmp_path / "cache", args, env=env) as mounted:
        assert mounted.returncode == 0, mounted.stderr
        (mp / bucket / "big.bin").write_bytes(os.urandom(6 << 20))  # through the upload worker
        processes = _mount_processes(mp)
        cmdlines = [_read(f"/proc/{pid}/cmdline").split(b"\0") for pid in processes]
        assert len(processes) == 3, cmdlines  # the daemon, its upload worker and its kernel notifier
        assert all(cmd[1] == b"-I" for cmd in cmdlines), cmdlines  # all isolated
        # A server restart: the daemon logs its reconnect (with the URL, redacted).
        auth_server.stop()
        auth_server.start()
        log = _log_of(data_dir)
        assert wait_for(lambda: "reconnected to NATS at" in log.read_text(), 20)
        assert (mp / bucket / "after.txt").write_bytes(b"after the restart") == 17
        _assert_no_password_anywhere(mp, [mounted.stdout, mounted.stderr, log.read_text()])
    assert nats_py_get(url, bucket, "after.txt") == b"after the restart"
    text = log.read_text()
    assert f"nats://{USER}:***@{auth_server.host}:{auth_server.port}" in text
    assert " ERROR " not in text, text[-3000:]
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700


def test_wrong_password_is_not_in_the_error_or_the_log(auth_server, tmp_path):
    wrong = _url(auth_server, "pwWRONG")
    mp, data_dir = tmp_path / "mnt", tmp_path / "data"
    with background_mount(mp, data_dir, tmp_path / "cache", ["--server", wrong], env=_env()) as mounted:
        assert mounted.returncode == 1
        assert f"cannot connect to NATS at nats://{USER}:***@" in mounted.stderr, mounted.stderr
        _assert_no_password_anywhere(mp, [mounted.stdout, mounted.stderr, _log_of(data_dir).read_text()])
    # In the foreground the error goes to stderr.
    fg = subprocess.run([NATSFS, "mount", str(mp), "--foreground", "--cache-dir", str(tmp_path / "cache"),
                         "--data-dir", str(data_dir)],
                        capture_output=True, text=True, env=_env(NATS_URL=wrong), timeout=60)
    assert fg.returncode == 1 and "cannot connect to NATS at" in fg.stderr, fg.stderr
    assert "pwWRONG" not in fg.stderr + fg.stdout


def test_log_file_is_private_and_follows_logrotate(auth_server, tmp_path):
    url = _url(auth_server)
    create_bucket(url, "rotated")
    mp, data_dir = tmp_path / "mnt", tmp_path / "data"
    log_dir = tmp_path / "logs" / "natsfs"  # created by the mount
    log = log_dir / "mount.log"
    with background_mount(mp, data_dir, tmp_path / "cache", ["--server", url, "--log-file", str(log)],
                          env=_env()) as mounted:
        assert mounted.returncode == 0, mounted.stderr
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
        log.rename(log_dir / "mount.log.1")  # what logrotate does, without copytruncate
        (mp / "rotated" / "f.txt").write_bytes(b"logged after rotation")
        assert wait_for(lambda: log.exists() and "f.txt" in log.read_text(), 10)
        assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_modules_in_the_working_directory_are_never_imported(auth_server, tmp_path):
    """`python -m` puts the working directory first on sys.path: a child without `-I` would import these."""
    url = _url(auth_server)
    create_bucket(url, "planted", atomic=False)  # puts are streamed by the upload worker
    cwd = tmp_path / "cwd"
    (cwd / "natsfs").mkdir(parents=True)
    marker = tmp_path / "imported"
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).mkdir(exist_ok=True)\n" \
              f"(pathlib.Path({str(marker)!r}) / __name__).touch()\n"
    for name in ("trio.py", "nats.py", "json.py", "asyncio.py", "argparse.py", "natsfs/__init__.py"):
        (cwd / name).write_text(payload)
    mp = tmp_path / "mnt"
    with background_mount(mp, tmp_path / "data", tmp_path / "cache", ["--server", url], env=_env(),
                          cwd=cwd) as mounted:
        assert mounted.returncode == 0, mounted.stderr
        data = os.urandom(6 << 20)  # large enough to be streamed by the upload worker
        (mp / "planted" / "big.bin").write_bytes(data)
        assert len(_mount_processes(mp)) == 3  # the upload worker and the kernel notifier are running
    assert nats_py_get(url, "planted", "big.bin") == data
    assert not marker.exists(), sorted(p.name for p in marker.iterdir())
