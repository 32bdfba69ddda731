"""The systemd units in systemd/ verify cleanly, and sd_notify datagrams reach $NOTIFY_SOCKET."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from natsfs import sdnotify

UNITS = Path(__file__).resolve().parents[2] / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_verify_clean(tmp_path):
    # verify checks that ExecStart's program exists: point it at this checkout's natsfs.
    natsfs = str(Path(sys.executable).parent / "natsfs")
    for unit in ("natsfs@.service", "mnt-data.mount"):
        (tmp_path / unit).write_text((UNITS / unit).read_text().replace("/usr/local/bin/natsfs", natsfs))
    (tmp_path / "natsfs@mnt-data.service").symlink_to("natsfs@.service")
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", "./natsfs@mnt-data.service", "./mnt-data.mount"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


def test_the_service_runs_what_the_readme_installs():
    service = (UNITS / "natsfs@.service").read_text()
    assert "Type=notify" in service and "Restart=on-failure" in service and "DeviceAllow=/dev/fuse rw" in service
    assert "ExecStart=/usr/local/bin/natsfs mount %f --foreground --log-file - $NATSFS_OPTIONS" in service
    assert "KillMode=mixed" in service  # SIGTERM to the daemon only: its upload worker keeps running
    for namespacing in ("ProtectSystem=", "PrivateTmp=", "ProtectHome=", "PrivateDevices="):
        assert namespacing not in service  # a mount namespace of its own would hide the mount


def test_notify_sends_one_datagram(tmp_path, monkeypatch):
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        sdnotify.notify("READY=1", "STATUS=serving /mnt")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving /mnt"


def test_a_failed_notify_is_a_debug_line(monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/socket")
    with caplog.at_level(logging.DEBUG, logger="natsfs.sdnotify"):
        sdnotify.notify("READY=1")  # a failed send is not the mount's problem
    assert [r.levelname for r in caplog.records] == ["DEBUG"]
    assert "cannot notify systemd at /nonexistent/socket" in caplog.records[0].getMessage()
