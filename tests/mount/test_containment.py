"""Nothing escapes the mount (issue 9): hostile link metas and special mode bits from other clients.

Another client publishes link metas by hand whose bucket or name tries to leave the mount (`..`,
absolute paths, invalid bucket names, empty parts). Through a real mount, in all-buckets and
`--bucket` mode, no such link may resolve outside the mountpoint: not by `readlink`, not by
`realpath`, not by reading or writing through it. A file planted next to the mountpoint stays
unread and unchanged. Writes through links aimed at `/etc` are never attempted (the tests run as
root): those links are only read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from helpers import create_bucket, raw_put, wait_for

HOST_SECRET = b"a host file the mount must never reach\n"


def _link(url: str, bucket: str, name: str, link: dict[str, str]) -> None:
    raw_put(url, bucket, name, [], meta_extra={"options": {"link": link}})


def _lexically_inside(target: str, link_dir_depth: int) -> bool:
    """Whether `target`, followed from a directory `link_dir_depth` levels below the mount root, stays in."""
    if target.startswith("/"):
        return False
    depth = link_dir_depth
    for segment in target.split("/"):
        if segment == "..":
            depth -= 1
            if depth < 0:
                return False
        elif segment not in ("", "."):
            depth += 1
    return True


def _host_state(host: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(host.iterdir())}


@pytest.fixture()
def host(tmp_path: Path) -> Path:
    """A directory next to the mountpoints (tmp_path/mnt*) holding a file no link may reach."""
    d = tmp_path / "host"
    d.mkdir()
    (d / "secret.txt").write_bytes(HOST_SECRET)
    return d


@pytest.mark.parametrize("mode", ["all-buckets", "bucket"])
def test_hostile_links_never_resolve_outside_the_mount(nats_url, bucket_name, mounter, host, mode):
    create_bucket(nats_url, bucket_name)
    # An object whose first segment is `nats-object:..`: the directory a naive `nats-object:<bucket>/…`
    # rendering would climb out of.
    raw_put(nats_url, bucket_name, "nats-object:../anchor", [b"anchor"])
    hostile = {
        # Naively rendered, these reach tmp_path/host from mnt0/<bucket>/ or mnt0/nats-object:../ .
        "up-bucket": {"bucket": "../host", "name": "secret.txt"},
        "up-bucket-new": {"bucket": "../host", "name": "created.txt"},
        "dotdot-bucket": {"bucket": "..", "name": "host/secret.txt"},
        "dotdot-bucket-link": {"bucket": ".."},
        "nats-object-climb": {"bucket": "../../..", "name": "host/secret.txt"},
        "nats-object-climb-new": {"bucket": "../../..", "name": "host/created.txt"},
        "etc-bucket": {"bucket": "../../../../../../../../../../etc", "name": "passwd"},
        "abs-bucket": {"bucket": "/etc", "name": "passwd"},
        "invalid-bucket": {"bucket": "no such bucket!", "name": "x"},
        "dot-bucket": {"bucket": ".", "name": "x"},
        "long-name": {"bucket": bucket_name, "name": "n" * 300},
    }
    in_mount = {
        # Valid bucket, hostile names: they point where such an object would show (escaped, inside).
        "name-traversal": {"bucket": bucket_name, "name": "../../../etc/passwd"},
        "name-dots": {"bucket": bucket_name, "name": "a/../../.."},
        "name-abs": {"bucket": bucket_name, "name": "/etc/passwd"},
        "name-empty": {"bucket": bucket_name, "name": ""},
    }
    for name, link in (hostile | in_mount).items():
        _link(nats_url, bucket_name, name, link)
    m = mounter(nats_url, *(["--bucket", bucket_name] if mode == "bucket" else []))
    root = m.path if mode == "bucket" else m.path / bucket_name
    depth = 0 if mode == "bucket" else 1
    before = _host_state(host)
    passwd = Path("/etc/passwd").read_bytes()
    assert wait_for(lambda: all(os.path.lexists(root / n) for n in hostile | in_mount), 10), os.listdir(root)

    for name in hostile | in_mount:
        p = root / name
        assert stat.S_ISLNK(os.lstat(p).st_mode), name
        target = os.readlink(p)
        assert _lexically_inside(target, depth), (name, target)
        assert os.lstat(p).st_size == len(os.fsencode(target))
        real = os.path.realpath(p)
        assert real.startswith(str(m.path) + os.sep) or real == str(m.path), (name, target, real)
        try:
            data = p.read_bytes()
        except OSError as e:
            assert e.errno in (errno.ENOENT, errno.EISDIR, errno.ENAMETOOLONG), (name, e)
        else:
            assert data not in (HOST_SECRET, passwd), name
    for name in hostile:
        assert os.readlink(root / name).startswith("nats-object:"), name

    # Writing through the links aimed at the planted directory creates and changes nothing there.
    for name in ("up-bucket", "up-bucket-new", "dotdot-bucket", "nats-object-climb", "nats-object-climb-new"):
        with pytest.raises(OSError) as e:
            (root / name).write_bytes(b"written through a hostile link\n")
        assert e.value.errno == errno.ENOENT, name
    assert _host_state(host) == before
    assert not (m.path.parent / "created.txt").exists()

    # A hostile link that arrives while mounted (through the live watch) is contained the same way.
    _link(nats_url, bucket_name, "late", {"bucket": "../host", "name": "secret.txt"})
    assert wait_for(lambda: os.path.lexists(root / "late"), 10)
    assert os.readlink(root / "late") == "nats-object:?/invalid-link"
    hostile["late"] = {}

    # One warning per hostile link, however often it is read; nothing worse.
    for name in hostile:
        os.readlink(root / name)
    log = m.log()
    for name in hostile:
        assert log.count(f"link {name!r} in bucket {bucket_name!r} reads as") == 1, (name, log[-3000:])
    for name in in_mount:
        assert f"link {name!r}" not in log
    assert " ERROR " not in log, log[-3000:]


def test_link_into_another_bucket_of_a_bucket_mount_stays_a_dangling_name(nats_url, bucket_name, mounter):
    other = bucket_name + "_o"
    create_bucket(nats_url, bucket_name)
    create_bucket(nats_url, other)
    raw_put(nats_url, other, "x/y.txt", [b"in the other bucket"])
    _link(nats_url, bucket_name, "cross", {"bucket": other, "name": "x/y.txt"})
    _link(nats_url, bucket_name, "cross-bucket", {"bucket": other})
    m = mounter(nats_url, "--bucket", bucket_name)
    assert wait_for(lambda: os.path.lexists(m.path / "cross-bucket"), 10)
    assert os.readlink(m.path / "cross") == f"nats-object:{other}/x/y.txt"
    assert os.readlink(m.path / "cross-bucket") == f"nats-object:{other}/"
    with pytest.raises(FileNotFoundError):
        (m.path / "cross").write_bytes(b"x")
    assert sorted(os.listdir(m.path)) == ["cross", "cross-bucket"]
    assert m.log().count(f"link 'cross' in bucket {bucket_name!r} reads as") == 1


def test_setuid_setgid_bits_from_metadata_need_allow_setuid_and_sticky_always_shows(nats_url, bucket_name,
                                                                                    mounter):
    create_bucket(nats_url, bucket_name)
    raw_put(nats_url, bucket_name, "suid", [b"#!/bin/sh\n"], meta_extra={"metadata": {"natsfs.mode": "4755"}})
    raw_put(nats_url, bucket_name, "sgid", [b"x"], meta_extra={"metadata": {"natsfs.mode": "2711"}})
    raw_put(nats_url, bucket_name, "shared/", [], meta_extra={"metadata": {"natsfs.mode": "1777"}})
    plain = mounter(nats_url, "--bucket", bucket_name)
    honouring = mounter(nats_url, "--bucket", bucket_name, "--allow-setuid")
    expected = {"suid": (0o755, 0o4755), "sgid": (0o711, 0o2711), "shared": (0o1777, 0o1777)}
    with open("/proc/mounts") as f:
        options = {line.split()[1]: line.split()[3].split(",") for line in f}
    assert "nosuid" in options[str(plain.path)]  # and the kernel ignores them anyway (FUSE's default)
    for name, (masked, honoured) in expected.items():
        assert wait_for(lambda n=name: (plain.path / n).exists() and (honouring.path / n).exists(), 10)
        assert stat.S_IMODE(os.stat(plain.path / name).st_mode) == masked, name
        assert stat.S_IMODE(os.stat(honouring.path / name).st_mode) == honoured, name


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_sticky_directories_and_link_owners_protect_users_of_a_shared_mount(nats_url, bucket_name, mounter,
                                                                            tmp_path):
    """On an `allow_other` mount a `1777` directory works as /tmp does: another user cannot remove
    the owner's file, and a symlink shows as owned by the user who made it (what the kernel's
    protected_symlinks rule checks before root follows a link in such a directory)."""
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--bucket", bucket_name, "-o", "allow_other")
    # The other user must reach the mountpoint: let it pass through pytest's private directories.
    ancestors = [d for d in (m.path.parent, *m.path.parent.parents) if d != Path("/") and d != Path("/tmp")]
    modes = {d: stat.S_IMODE(d.stat().st_mode) for d in ancestors}
    try:
        for d in ancestors:
            d.chmod(modes[d] | 0o001)
        _sticky_and_link_owners(m.path)
    finally:
        for d, mode in modes.items():
            d.chmod(mode)


def _sticky_and_link_owners(root: Path) -> None:
    import subprocess

    shared = root / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    (shared / "rootfile").write_bytes(b"root's data")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777

    def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
                              capture_output=True, text=True, timeout=30)

    removed = as_nobody("rm", "-f", str(shared / "rootfile"))
    assert removed.returncode != 0 and "Operation not permitted" in removed.stderr
    assert (shared / "rootfile").read_bytes() == b"root's data"
    assert as_nobody("ln", "-s", "rootfile", str(shared / "nobodys-link")).returncode == 0
    assert os.lstat(shared / "nobodys-link").st_uid == 65534
    os.symlink("rootfile", shared / "roots-link")
    assert os.lstat(shared / "roots-link").st_uid == 0
