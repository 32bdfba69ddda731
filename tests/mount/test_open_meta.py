"""Through real mounts: `open(O_RDONLY|O_TRUNC)` empties a file for good, and metadata calls through a
descriptor of a file unlinked or replaced while open act on that file alone, as on a local disk."""

from __future__ import annotations

import base64
import errno
import json
import os
import stat
import tempfile
from typing import Any

import pytest
from helpers import create_bucket, nats_py_get, with_nats


@pytest.fixture()
def pb(nats_url, bucket_name, mounter):
    """A fresh bucket and a mount; yields (mount, bucket dir path)."""
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    return m, m.path / bucket_name


def lost_found(m) -> list[str]:
    return [str(p) for p in m.cache_dir.rglob("lost+found/*/*") if p.is_file()]


def meta_doc(url: str, bucket: str, name: str) -> dict[str, Any]:
    """The object's meta as another client reads it (nats-py, message by message)."""
    async def fn(nc: Any, js: Any) -> dict[str, Any]:
        key = base64.urlsafe_b64encode(name.encode()).decode()
        return json.loads((await js.get_msg(f"OBJ_{bucket}", subject=f"$O.{bucket}.M.{key}")).data)

    return with_nats(url, fn)


def test_read_only_open_with_o_trunc_empties_the_file_for_good(nats_url, bucket_name, pb, mounter):
    m, b = pb
    p = b / "rdtrunc"
    p.write_bytes(b"content")
    for _ in range(3):
        fd = os.open(p, os.O_RDONLY | os.O_TRUNC)
        try:
            assert os.fstat(fd).st_size == 0
            assert os.read(fd, 10) == b""
        finally:
            os.close(fd)
        assert p.stat().st_size == 0 and p.read_bytes() == b""
        assert nats_py_get(nats_url, bucket_name, "rdtrunc") == b""
        p.write_bytes(b"content again")
    assert lost_found(m) == []  # (and no ERROR in the daemon's log: checked by `mounter`)
    ro = mounter(nats_url, "--read-only")
    with pytest.raises(OSError) as e:
        os.open(ro.path / bucket_name / "rdtrunc", os.O_RDONLY | os.O_TRUNC)
    assert e.value.errno == errno.EROFS
    assert nats_py_get(nats_url, bucket_name, "rdtrunc") == b"content again"


def change_meta_through(fd: int) -> None:
    """fchmod, fchown, futimens, fsetxattr and fgetxattr through `fd` succeed and show on it."""
    os.fchmod(fd, 0o600)
    assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    os.fchown(fd, 65534, -1)
    assert os.fstat(fd).st_uid == 65534
    os.utime(fd, ns=(5, 5))
    assert os.fstat(fd).st_mtime_ns == 5
    os.setxattr(fd, "user.k", b"v")
    assert os.getxattr(fd, "user.k") == b"v"
    assert "user.k" in os.listxattr(fd)
    assert os.fstat(fd).st_nlink == 0


def test_metadata_calls_on_a_descriptor_of_an_unlinked_file(nats_url, bucket_name, pb):
    m, b = pb
    p = b / "uo"
    p.write_bytes(b"hello")
    fd = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        os.pwrite(fd, b"WORLD", 5)
        change_meta_through(fd)
        assert os.pread(fd, 20, 0) == b"helloWORLD"
        os.fsync(fd)
    finally:
        os.close(fd)
    assert not p.exists() and os.listdir(b) == []
    # tempfile.TemporaryFile() here: O_TMPFILE is refused, so it creates a file and unlinks it.
    with tempfile.TemporaryFile(dir=b) as t:
        t.write(b"scratch")
        t.flush()
        change_meta_through(t.fileno())
        t.seek(0)
        assert t.read() == b"scratch"
    assert os.listdir(b) == [] and lost_found(m) == []


def test_metadata_calls_on_a_descriptor_of_a_replaced_file_leave_the_new_file_alone(nats_url, bucket_name, pb):
    m, b = pb
    p = b / "rp"
    p.write_bytes(b"old-content")
    fd = os.open(p, os.O_RDWR)
    try:
        # An atomic save over it: a temporary file with its own mode and xattr, renamed over the name.
        tmp = b / "rp.tmp"
        tmp.write_bytes(b"newer")
        os.chmod(tmp, 0o640)
        os.setxattr(tmp, "user.new", b"n")
        os.rename(tmp, p)
        before = meta_doc(nats_url, bucket_name, "rp")
        os.pwrite(fd, b"XX", 0)
        change_meta_through(fd)
        with pytest.raises(OSError) as e:
            os.getxattr(fd, "user.new")
        assert e.value.errno == errno.ENODATA
    finally:
        os.close(fd)
    assert meta_doc(nats_url, bucket_name, "rp") == before
    assert nats_py_get(nats_url, bucket_name, "rp") == b"newer"
    st = os.stat(p)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, p.read_bytes()) == (0o640, 0, b"newer") and st.st_mtime_ns != 5
    assert os.getxattr(p, "user.new") == b"n" and "user.k" not in os.listxattr(p)
    assert lost_found(m) == []
