"""Shared fixtures: a real nats-server per session (or per test), real FUSE mounts, other NATS clients.

Every server runs on a free loopback port with a temp store; every mount is unmounted in teardown with
`fusermount3 -u` (lazily if busy), even when the test failed.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from natsfs.server import NatsServer

sys.path.insert(0, str(Path(__file__).parent))

from helpers import FIXTURES, Mount, check_daemon_logs  # noqa: F401 - FIXTURES re-exported for test modules

_counter = itertools.count()


def pytest_collection_modifyitems(config, items):
    have_fuse = os.path.exists("/dev/fuse") and shutil.which("fusermount3")
    for item in items:
        if "tests/mount" in str(item.fspath).replace(os.sep, "/") or "tests/model" in str(item.fspath).replace(
                os.sep, "/"):
            item.add_marker(pytest.mark.mount)
            if not have_fuse:
                item.add_marker(pytest.mark.skip(reason="needs /dev/fuse and fusermount3"))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def private_server(tmp_path):
    """A server of this test's own (for restarts and limits)."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture()
def bucket_name(request) -> str:
    """A bucket name no other test in this session uses."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]
    return f"t{next(_counter)}_{base}"


@pytest.fixture()
def mounter(tmp_path, request):
    """Make mounts with `mounter(url, *args)`; all are unmounted at teardown, then the test fails if a
    daemon logged an ERROR or a traceback not declared (`m.expect_log(...)`, `@pytest.mark.expect_log`)."""
    mounts: list[Mount] = []

    def make(url: str, *args: str, mountpoint: Path | None = None) -> Mount:
        mp = mountpoint or (tmp_path / f"mnt{len(mounts)}")
        mp.mkdir(exist_ok=True)
        m = Mount(url, mp, list(args), log_file=tmp_path / f"mount{len(mounts)}.log",
                  cache_dir=tmp_path / f"cache{len(mounts)}")
        mounts.append(m)
        m.start()
        return m

    yield make
    errors = []
    for m in mounts:
        try:
            m.stop()
        except Exception as e:  # keep unmounting the others
            errors.append(e)
    if errors:
        raise errors[0]
    check_daemon_logs(mounts, [p for mark in request.node.iter_markers("expect_log") for p in mark.args])


@pytest.fixture(autouse=True)
def _no_unexpected_error_logged(request, caplog):
    """Fail a test whose own process logged an ERROR or a traceback it did not declare with
    `@pytest.mark.expect_log(pattern, ...)` (the daemon's log is checked by `mounter`)."""
    yield
    expected = [re.compile(p) for mark in request.node.iter_markers("expect_log") for p in mark.args]
    found = []
    for r in {id(r): r for when in ("setup", "call") for r in caplog.get_records(when)}.values():
        if r.levelno < logging.ERROR and not r.exc_info:
            continue
        text = caplog.handler.format(r)
        if not any(p.search(text) for p in expected):
            found.append(text)
    if found:
        pytest.fail("unexpected ERROR/traceback logged (declare it with @pytest.mark.expect_log):\n"
                    + "\n".join(found[:20]), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_mount_left_behind(tmp_path_factory):
    """Safety net: unmount natsfs mounts this session left under its own temp dirs (and only those)."""
    base = str(tmp_path_factory.getbasetemp())
    yield
    with open("/proc/mounts") as f:
        left = [line.split()[1] for line in f
                if line.split()[0] == "natsfs" and line.split()[1].startswith(base)]
    for mp in left:
        subprocess.run(["fusermount3", "-u", "-z", mp], check=False)
