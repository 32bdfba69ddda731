"""Links as symlinks, metadata as xattrs, and buckets managed from a real mount (issue 4)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
from helpers import create_bucket, raw_put, wait_for, with_nats, with_store
from test_write import meta_json


@pytest.fixture()
def wb(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    return m, m.path / bucket_name


def _errno(fn) -> int:
    with pytest.raises(OSError) as e:
        fn()
    return e.value.errno


# ---------------------------------------------------------------- links
def test_ln_s_makes_links_shaped_like_nats_go_addlink(nats_url, bucket_name, wb):
    m, b = wb
    (b / "dir").mkdir()
    (b / "dir" / "target.txt").write_bytes(b"target bytes")
    os.symlink("target.txt", b / "dir" / "obj-link")
    os.symlink(f"../{bucket_name}", b / "bucket-link")
    link = meta_json(nats_url, bucket_name, "dir/obj-link")
    assert set(link) - {"seq"} == {"name", "metadata", "options", "bucket", "nuid", "size", "mtime", "chunks"}
    assert link["options"] == {"link": {"bucket": bucket_name, "name": "dir/target.txt"}}
    assert link["metadata"] == {"natsfs.symlink": "target.txt"}  # the text as given, for readlink
    assert link["size"] == 0 and link["chunks"] == 0 and len(link["nuid"]) == 22
    assert meta_json(nats_url, bucket_name, "bucket-link")["options"] == {"link": {"bucket": bucket_name}}
    p = b / "dir" / "obj-link"
    st = os.lstat(p)
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len(os.readlink(p))
    assert p.read_bytes() == b"target bytes"
    assert (b / "bucket-link" / "dir" / "target.txt").read_bytes() == b"target bytes"
    # Absolute targets inside the mount work too.
    os.symlink(str(b / "dir" / "target.txt"), b / "abs-link")
    assert (b / "abs-link").read_bytes() == b"target bytes"
    # Removing a link removes only the link.
    p.unlink()
    assert not os.path.lexists(p) and (b / "dir" / "target.txt").read_bytes() == b"target bytes"
    m.remount()
    assert os.readlink(b / "bucket-link") == f"../{bucket_name}"
    assert (b / "abs-link").read_bytes() == b"target bytes"


def test_ln_s_stores_any_target_text_and_links_only_stored_objects(nats_url, bucket_name, wb):
    m, b = wb
    (b / "obj").write_bytes(b"o")
    (b / "dir").mkdir()
    for name, text in (("link", "obj"), ("link-to-link", "link"), ("dangling", "missing"), ("to-dir", "dir"),
                       ("outside", "/etc/passwd"), ("up", "../../..")):
        os.symlink(text, b / name)
        assert os.readlink(b / name) == text
    assert meta_json(nats_url, bucket_name, "link")["options"] == {"link": {"bucket": bucket_name, "name": "obj"}}
    for name in ("link-to-link", "dangling", "to-dir", "outside", "up"):  # no ADR-20 link: empty objects
        assert "link" not in meta_json(nats_url, bucket_name, name).get("options", {})
    assert (b / "link-to-link").read_bytes() == b"o"
    assert _errno(lambda: os.symlink("obj", b / "obj")) == errno.EEXIST
    (b / "gone").write_bytes(b"g")
    os.symlink("gone", b / "to-gone")
    (b / "gone").unlink()
    # A link whose target was deleted is a dangling symlink, not an error.
    assert os.path.islink(b / "to-gone") and not os.path.exists(b / "to-gone")
    m.remount()
    assert os.readlink(b / "outside") == "/etc/passwd"  # this user's own text survives a remount
    assert sorted(os.listdir(b)) == ["dangling", "dir", "link", "link-to-link", "obj", "outside", "to-dir",
                                     "to-gone", "up"]


def test_links_to_another_bucket(nats_url, bucket_name, wb):
    m, b = wb
    other = bucket_name + "_o"
    create_bucket(nats_url, other)
    raw_put(nats_url, other, "x/y.txt", [b"in the other bucket"])
    assert wait_for(lambda: (m.path / other / "x" / "y.txt").exists(), 10)
    os.symlink(f"../{other}/x/y.txt", b / "cross")
    assert meta_json(nats_url, bucket_name, "cross")["options"]["link"] == {"bucket": other, "name": "x/y.txt"}
    assert (b / "cross").read_bytes() == b"in the other bucket"


# ---------------------------------------------------------------- xattrs
def test_metadata_from_other_clients_shows_as_xattrs(nats_url, bucket_name, wb):
    _m, b = wb
    raw_put(nats_url, bucket_name, "tagged.txt", [b"t"], meta_extra={
        "description": "a tagged file", "metadata": {"owner": "infra", "tier": "gold"},
        "headers": {"Content-Type": ["text/plain"]}})
    p = b / "tagged.txt"
    assert wait_for(lambda: p.exists(), 10)
    names = os.listxattr(p)
    assert {"user.owner", "user.tier", "user.nats.description", "user.nats.header.Content-Type"} <= set(names)
    assert not {"user.nats.digest", "user.nats.revision"} & set(names)  # read-only facts: read by name
    assert os.getxattr(p, "user.nats.revision").isdigit()
    assert os.getxattr(p, "user.owner") == b"infra"
    assert os.getxattr(p, "user.nats.description") == b"a tagged file"
    assert os.getxattr(p, "user.nats.header.Content-Type") == b"text/plain"
    if shutil.which("getfattr"):  # the attr package is optional on the test machine
        out = subprocess.run(["getfattr", "-d", str(p)], capture_output=True, text=True)
        assert 'user.owner="infra"' in out.stdout


def test_cp_a_and_mv_between_buckets_copy_attributes_without_errors(nats_url, bucket_name, wb):
    """Tools that copy every listed attribute must not trip over read-only facts (they are not listed),
    and keep what can be written."""
    _m, b = wb
    other = bucket_name + "_2"
    create_bucket(nats_url, other)
    o = b.parent / other
    assert wait_for(lambda: o.exists(), 10)
    (b / "d").mkdir()
    (b / "d" / "f.txt").write_bytes(b"data")
    os.setxattr(b / "d" / "f.txt", "user.color", b"blue")
    copied = subprocess.run(["cp", "-a", str(b / "d"), str(o / "copy")], capture_output=True, text=True)
    assert copied.returncode == 0 and copied.stderr == ""
    assert (o / "copy" / "f.txt").read_bytes() == b"data"
    assert os.getxattr(o / "copy" / "f.txt", "user.color") == b"blue"
    moved = subprocess.run(["mv", str(b / "d" / "f.txt"), str(o / "moved.txt")], capture_output=True, text=True)
    assert moved.returncode == 0 and moved.stderr == ""
    assert (o / "moved.txt").read_bytes() == b"data" and not (b / "d" / "f.txt").exists()


def test_setxattr_is_seen_by_other_clients_and_keeps_their_fields(nats_url, bucket_name, wb):
    m, b = wb
    raw_put(nats_url, bucket_name, "f.txt", [b"data"], meta_extra={
        "description": "keep me", "metadata": {"from-go": "yes"}, "headers": {"X-A": ["1", "2"]},
        "future_field": {"kept": True}})
    p = b / "f.txt"
    assert wait_for(lambda: p.exists(), 10)
    before = meta_json(nats_url, bucket_name, "f.txt")
    os.setxattr(p, "user.color", b"blue")
    after = meta_json(nats_url, bucket_name, "f.txt")
    assert after["nuid"] == before["nuid"]  # no data moved
    assert after["metadata"] == {"from-go": "yes", "color": "blue"}
    assert after["description"] == "keep me" and after["headers"] == {"X-A": ["1", "2"]}
    assert after["future_field"] == {"kept": True}
    os.removexattr(p, "user.from-go")
    assert meta_json(nats_url, bucket_name, "f.txt")["metadata"] == {"color": "blue"}
    os.setxattr(p, "user.nats.description", b"new description")
    m.remount()
    assert os.getxattr(p, "user.color") == b"blue"
    assert os.getxattr(p, "user.nats.description") == b"new description"
    assert p.read_bytes() == b"data"
    assert _errno(lambda: os.setxattr(p, "user.nats.digest", b"x")) == errno.EPERM
    assert _errno(lambda: os.getxattr(p, "user.nope")) == errno.ENODATA
    assert _errno(lambda: os.setxattr(p, "user.color", b"red", os.XATTR_CREATE)) == errno.EEXIST
    assert _errno(lambda: os.setxattr(p, "user.none", b"red", os.XATTR_REPLACE)) == errno.ENODATA


def test_oversize_attribute_is_e2big_and_stores_nothing(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--max-meta-bytes", "2KiB")
    p = m.path / bucket_name / "f"
    p.write_bytes(b"x")
    os.setxattr(p, "user.small", b"ok")
    before = meta_json(nats_url, bucket_name, "f")
    assert _errno(lambda: os.setxattr(p, "user.big", b"y" * 3000)) == errno.E2BIG
    after = meta_json(nats_url, bucket_name, "f")
    assert after["seq"] == before["seq"] and "big" not in after["metadata"]
    assert "over --max-meta-bytes" in m.log()


def test_xattrs_on_a_file_not_yet_stored_are_stored_with_it(nats_url, bucket_name, wb):
    _m, b = wb
    fd = os.open(b / "new", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"content")
    os.setxattr(b / "new", "user.stage", b"early")
    os.close(fd)
    assert meta_json(nats_url, bucket_name, "new")["metadata"] == {"stage": "early"}


# ---------------------------------------------------------------- buckets
def test_mkdir_and_rmdir_at_the_root_manage_buckets(nats_url, bucket_name, mounter):
    m = mounter(nats_url, "--storage", "memory", "--max-bytes", "10MiB", "--ttl", "1h", "--compression")
    name = bucket_name + "_new"
    (m.path / name).mkdir()

    async def info(nc, js):
        return (await js.stream_info(f"OBJ_{name}")).config

    cfg = with_nats(nats_url, info)
    assert getattr(cfg.storage, "value", cfg.storage) == "memory" and cfg.max_bytes == 10 * 1024 * 1024
    assert cfg.max_age == 3600 and cfg.allow_rollup_hdrs and cfg.allow_direct
    assert getattr(cfg.discard, "value", cfg.discard) == "new"
    assert cfg.subjects == [f"$O.{name}.C.>", f"$O.{name}.M.>"]
    (m.path / name / "f").write_bytes(b"f")
    assert _errno(lambda: (m.path / name).rmdir()) == errno.ENOTEMPTY
    (m.path / name / "f").unlink()
    (m.path / name).rmdir()
    assert name not in os.listdir(m.path)
    assert with_store(nats_url, lambda s: s.list_buckets()).count(name) == 0
    assert _errno(lambda: (m.path / "bad.name").mkdir()) == errno.EINVAL
    assert _errno(lambda: (m.path / "xxx").write_bytes(b"no files at the root")) in (errno.EPERM, errno.EACCES)


@pytest.mark.expect_log("/g: closed without a successful upload")
def test_sealed_bucket_shows_read_only(nats_url, bucket_name, wb):
    m, b = wb
    (b / "f").write_bytes(b"f")
    with_store(nats_url, lambda s: s.seal_bucket(bucket_name))
    assert _errno(lambda: (b / "g").write_bytes(b"g")) == errno.EROFS
    m.remount()
    assert not os.stat(b).st_mode & 0o222
    assert not os.stat(b / "f").st_mode & 0o222
    assert os.getxattr(b, "user.nats.bucket.sealed") == b"true"


def test_bucket_xattrs_and_df(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name, description="the bucket", metadata={"team": "infra"}, max_bytes=50 << 20)
    m = mounter(nats_url)
    b = m.path / bucket_name
    assert os.getxattr(b, "user.nats.description") == b"the bucket"
    assert os.getxattr(b, "user.team") == b"infra"
    assert os.getxattr(b, "user.nats.bucket.max_bytes") == str(50 << 20).encode()
    os.setxattr(b, "user.owner", b"me")

    async def info(nc, js):
        return (await js.stream_info(f"OBJ_{bucket_name}")).config.metadata

    assert with_nats(nats_url, info)["owner"] == "me"
    (b / "data").write_bytes(b"z" * 100_000)
    single = mounter(nats_url, "--bucket", bucket_name)
    st = os.statvfs(single.path)
    assert st.f_blocks * st.f_frsize == 50 << 20
    assert (st.f_blocks - st.f_bfree) * st.f_frsize >= 100_000


def test_bucket_cli(nats_url, bucket_name):
    env = dict(os.environ, NATS_URL=nats_url)

    def natsfs(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "natsfs", "bucket", *args], capture_output=True, text=True,
                              env=env, timeout=60)

    assert natsfs("create", bucket_name, "--description", "cli", "--max-bytes", "1MiB").returncode == 0
    assert bucket_name in natsfs("ls").stdout
    raw_put(nats_url, bucket_name, "x", [b"x"])
    r = natsfs("rm", bucket_name)
    assert r.returncode == 1 and "holds objects" in r.stderr
    assert natsfs("seal", bucket_name).returncode == 0
    assert "sealed" in natsfs("ls").stdout
    assert natsfs("rm", bucket_name, "--force").returncode == 0
    assert bucket_name not in natsfs("ls").stdout
    bad = natsfs("create", "no.dots")
    assert bad.returncode == 1 and "invalid bucket name" in bad.stderr


def test_json_of_stats_xattr(nats_url, wb):
    m, _ = wb
    stats = json.loads(os.getxattr(m.path, "user.natsfs.stats"))
    assert {"cache", "fs", "inodes", "handles"} <= set(stats)


def test_hostile_meta_fields_break_neither_listings_nor_mutations(nats_url, bucket_name, wb):
    """Valid JSON another client wrote wrong: numbers out of their kernel type's range, metadata that is
    no object and headers as nats.py stores them (descriptive fields of the wrong JSON type: ignored),
    a link whose bucket is a number (a meta nats.go cannot read: skipped), keys that make no attribute
    name. The directory lists, listxattr works, chmod stores a meta nats.go can read."""
    m, b = wb
    raw_put(nats_url, bucket_name, "good.txt", [b"good\n"])
    raw_put(nats_url, bucket_name, "huge-uid", [b"x"], meta_extra={"metadata": {"natsfs.uid": str(2**40)}})
    raw_put(nats_url, bucket_name, "huge-mtime", [b"x"], meta_extra={"metadata": {"natsfs.mtime_ns": "9" * 30}})
    raw_put(nats_url, bucket_name, "huge-size", [b"x"], meta_extra={"size": 2**63})
    raw_put(nats_url, bucket_name, "link-typed-wrong", [],
            meta_extra={"options": {"link": {"bucket": 7, "name": ["a"]}}})
    raw_put(nats_url, bucket_name, "md-list", [b"x\n"], meta_extra={"metadata": ["a", "b"]})
    raw_put(nats_url, bucket_name, "py-headers", [b"py\n"], meta_extra={
        "headers": {"Content-Type": "text/plain", "X-Good": ["a"]}, "metadata": {"author": "py"}})
    raw_put(nats_url, bucket_name, "keys", [b"k"], meta_extra={
        "metadata": {"k\x00": "v", "a\x00b": "v", "L" * 300: "v", "ok": "fine"}, "headers": {"H\x00": ["v"]}})
    assert wait_for(lambda: (b / "keys").exists(), 10)
    assert sorted(os.listdir(b)) == ["good.txt", "huge-mtime", "huge-uid", "keys", "md-list", "py-headers"]
    assert os.lstat(b / "huge-uid").st_uid == os.getuid()
    assert (b / "huge-uid").read_bytes() == b"x"
    names = os.listxattr(b / "keys")
    assert "user.ok" in names and not [n for n in names if "\x00" in n or len(n.encode()) > 255]
    # A nats.py object: shown, the header nats.go cannot read ignored, the rest of its fields kept.
    assert (b / "py-headers").read_bytes() == b"py\n"
    assert sorted(os.listxattr(b / "py-headers")) == ["user.author", "user.nats.header.X-Good"]
    assert os.getxattr(b / "py-headers", "user.nats.header.X-Good") == b"a"
    assert _errno(lambda: os.getxattr(b / "py-headers", "user.nats.header.Content-Type")) == errno.ENODATA
    os.chmod(b / "py-headers", 0o600)
    after = meta_json(nats_url, bucket_name, "py-headers")
    assert after is not None and after["headers"] == {"X-Good": ["a"]}
    assert after["metadata"] == {"author": "py", "natsfs.mode": "600"}
    assert (b / "md-list").read_bytes() == b"x\n"
    os.chmod(b / "md-list", 0o600)
    with open(b / "md-list", "wb") as f:
        f.write(b"new bytes")
    after = meta_json(nats_url, bucket_name, "md-list")
    assert after is not None and after["metadata"] == {"natsfs.mode": "600"}
    assert (b / "md-list").read_bytes() == b"new bytes"
    os.chmod(b / "huge-uid", 0o600)
    with open(b / "huge-uid", "wb") as f:
        f.write(b"new bytes")
    after = meta_json(nats_url, bucket_name, "huge-uid")
    assert after is not None and after["metadata"] == {"natsfs.mode": "600"}  # (the unusable uid dropped)
    assert (b / "huge-uid").read_bytes() == b"new bytes"
    log = m.log()
    for name in ("md-list", "py-headers"):
        assert len(re.findall(rf"WARNING .*meta for '{name}' has fields of the wrong JSON type \(ignored\)", log)) == 1
    assert len(re.findall(r"WARNING .*skipping malformed meta: meta for 'link-typed-wrong'", log)) == 1
