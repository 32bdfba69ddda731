"""POSIX as a local disk has it, through real mounts: one upload per written file (also when a child
process inherits and closes the descriptor), every file type, symlinks, directory times."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys

import pytest
from helpers import create_bucket, nats_py_get, with_store


@pytest.fixture()
def pb(nats_url, bucket_name, mounter):
    """A fresh bucket and a mount; yields (mount, bucket dir path)."""
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    return m, m.path / bucket_name


def fs_stats(m) -> dict:
    return json.loads(os.getxattr(m.path, "user.natsfs.stats"))["fs"]


# ---------------------------------------------------------------- one upload per written file
def test_children_closing_an_inherited_descriptor_store_nothing(nats_url, bucket_name, pb):
    """The Hadoop/Spark pattern: open for write, a child `chmod` process inherits the descriptor and
    exits, write more, close. Each file is uploaded once with exactly its bytes."""
    m, b = pb
    rng = random.Random(12)
    before = fs_stats(m)
    files = {}
    for i in range(3):
        path = b / f"part-{i}"
        first, second = rng.randbytes(3 << 20), rng.randbytes(2 << 20)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, first)
            # The child inherits fd (close_fds=False) and closes it at exit: a FLUSH from another process.
            subprocess.run(["chmod", "0640", str(path)], check=True, close_fds=False)
            subprocess.run(["true"], check=True, close_fds=False)
            os.write(fd, second)
        finally:
            os.close(fd)
        files[f"part-{i}"] = first + second
    after = fs_stats(m)
    assert after["uploads"] - before["uploads"] == 3
    assert after["upload_bytes"] - before["upload_bytes"] == sum(map(len, files.values()))
    assert after["flushes_deferred"] - before["flushes_deferred"] >= 6
    for name, data in files.items():
        assert nats_py_get(nats_url, bucket_name, name) == data
        assert (b / name).stat().st_mode & 0o777 == 0o640
    assert " ERROR " not in m.log()


def test_a_child_outliving_the_opener_stores_at_the_last_close(nats_url, bucket_name, pb):
    """The opener closes first (its close stores); a child that still holds the descriptor writes more
    and closes: that last close stores the rest, since the opener holds it no more."""
    m, b = pb
    path = b / "late"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"parent\n")
    child = subprocess.Popen([sys.executable, "-I", "-c", f"import os, sys; sys.stdin.readline(); "
                              f"os.write({fd}, b'child\\n')"], stdin=subprocess.PIPE, pass_fds=(fd,))
    os.close(fd)
    assert nats_py_get(nats_url, bucket_name, "late") == b"parent\n"
    child.communicate(b"go\n")
    assert child.returncode == 0
    assert nats_py_get(nats_url, bucket_name, "late") == b"parent\nchild\n"
    assert path.read_bytes() == b"parent\nchild\n"
    assert " ERROR " not in m.log()


def test_fsync_stores_even_while_a_child_holds_the_descriptor(nats_url, bucket_name, pb):
    m, b = pb
    fd = os.open(b / "synced", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"one")
        child = subprocess.Popen(["sleep", "30"], pass_fds=(fd,))
        try:
            os.fsync(fd)
            assert nats_py_get(nats_url, bucket_name, "synced") == b"one"
        finally:
            child.kill()
            child.wait()
    finally:
        os.close(fd)
    assert nats_py_get(nats_url, bucket_name, "synced") == b"one"
    assert " ERROR " not in m.log()


# ---------------------------------------------------------------- every file type
def make_socket(path) -> None:
    """bind(2) a Unix socket there (from its directory: mount paths are longer than sun_path)."""
    subprocess.run([sys.executable, "-I", "-c", f"import socket; socket.socket(socket.AF_UNIX).bind({path.name!r})"],
                   cwd=path.parent, check=True, capture_output=True)


SPECIAL = {
    "fifo": (stat.S_IFIFO, lambda p: os.mkfifo(p, 0o640), 0),
    "socket": (stat.S_IFSOCK, make_socket, 0),
    "char": (stat.S_IFCHR, lambda p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3)), os.makedev(1, 3)),
    "block": (stat.S_IFBLK, lambda p: os.mknod(p, stat.S_IFBLK | 0o600, os.makedev(7, 0)), os.makedev(7, 0)),
}


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_every_file_type_is_created_stat_chmod_chown_renamed_and_unlinked(nats_url, bucket_name, pb, kind):
    m, b = pb
    fmt, make, rdev = SPECIAL[kind]
    (b / "d").mkdir()
    node = b / "d" / "node"
    make(node)
    st = os.lstat(node)
    assert stat.S_IFMT(st.st_mode) == fmt and st.st_rdev == rdev and st.st_size == 0
    os.chmod(node, 0o604)
    os.chown(node, 4321, 8765)
    os.rename(node, b / "moved")
    assert not os.path.lexists(node)
    # Other clients see an empty object with its type in the metadata.
    info = with_store(nats_url, lambda s: s.get_info(bucket_name, "moved"))
    assert info is not None and info.size == 0 and not info.deleted
    assert nats_py_get(nats_url, bucket_name, "moved") == b""
    m.remount()
    st = os.lstat(b / "moved")
    assert stat.S_IFMT(st.st_mode) == fmt and st.st_rdev == rdev
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o604, 4321, 8765)
    with pytest.raises((FileExistsError, subprocess.CalledProcessError)):
        make(b / "moved")
    os.unlink(b / "moved")
    assert not os.path.lexists(b / "moved")
    assert with_store(nats_url, lambda s: s.get_info(bucket_name, "moved")).deleted
    assert " ERROR " not in m.log()


def test_a_fifo_in_the_mount_carries_data_between_processes(pb):
    _m, b = pb
    os.mkfifo(b / "pipe")
    reader = subprocess.Popen(["cat", str(b / "pipe")], stdout=subprocess.PIPE)
    with open(b / "pipe", "wb") as w:
        w.write(b"through the pipe")
    assert reader.communicate(timeout=10)[0] == b"through the pipe"


def test_device_nodes_never_open_a_device(pb):
    """The mount is nodev: a device node (which any client of the bucket could describe) is shown but
    opening it is refused by the kernel."""
    _m, b = pb
    os.mknod(b / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(PermissionError), open(b / "null", "rb"):
        pass
