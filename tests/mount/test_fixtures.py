"""The ADR-20 interop fixtures (nats.go, nats.js, nats-py and hostile entries) through a real mount."""

from __future__ import annotations

import base64
import json
import os

import pytest
from helpers import FIXTURES, replay_fixtures


def _objects_in_fixture() -> dict[str, dict]:
    """name -> last meta JSON, for every meta subject in OBJ_interop that parses."""
    dump = json.loads((FIXTURES / "OBJ_interop.json").read_text())
    metas: dict[str, dict] = {}
    for m in dump["messages"]:
        if ".M." not in m["subject"]:
            continue
        try:
            doc = json.loads(base64.b64decode(m["data_b64"]))
        except ValueError:
            continue
        if isinstance(doc, dict) and "name" in doc:
            metas[doc["name"]] = doc
    return metas


def _chunks_of(nuid: str) -> bytes:
    dump = json.loads((FIXTURES / "OBJ_interop.json").read_text())
    return b"".join(base64.b64decode(m["data_b64"]) for m in dump["messages"]
                    if m["subject"] == f"$O.interop.C.{nuid}")


@pytest.fixture(scope="module")
def fixture_mount(nats_server, tmp_path_factory):
    from helpers import Mount, check_daemon_logs

    replay_fixtures(nats_server.url, "OBJ_interop.json", "OBJ_other.json")
    tmp = tmp_path_factory.mktemp("fixtures")
    mp = tmp / "mnt"
    mp.mkdir()
    m = Mount(nats_server.url, mp, [], log_file=tmp / "mount.log", cache_dir=tmp / "cache")
    m.start()
    yield m
    m.stop()
    check_daemon_logs([m], [])


WELL_FORMED = ["go/hello.txt", "go/multi.bin", "go/renamed.txt", "go/overwritten.txt", "js/a.txt",
               "js/small-chunks.bin", "py/x.txt", "py/empty.txt", "space name.txt", "tab\tname.txt",
               "new\nline.txt", "ünïcödé.txt"]


@pytest.mark.parametrize("name", WELL_FORMED)
def test_well_formed_objects_read_byte_identical(fixture_mount, name):
    meta = _objects_in_fixture()[name]
    expected = _chunks_of(meta["nuid"])
    assert len(expected) == meta["size"]
    path = fixture_mount.path / "interop" / name
    assert path.read_bytes() == expected
    assert path.stat().st_size == meta["size"]


def test_tombstones_and_renamed_away_names_are_absent(fixture_mount):
    root = fixture_mount.path / "interop"
    assert not (root / "go/deleted.txt").exists()
    assert not (root / "py/deleted.txt").exists()
    assert not (root / "go/old-name.txt").exists()
    assert sorted(os.listdir(root / "go")) == ["hello.txt", "multi.bin", "overwritten.txt", "renamed.txt"]


def test_overwritten_object_shows_only_the_new_version(fixture_mount):
    assert (fixture_mount.path / "interop/go/overwritten.txt").stat().st_size == 14


def test_links_are_symlinks_that_resolve(fixture_mount):
    js = fixture_mount.path / "interop" / "js"
    for link, target in [("link-to-a", "interop/js/a.txt"), ("link-to-other", "interop/go/hello.txt")]:
        p = js / link
        assert p.is_symlink()
        assert os.lstat(p).st_size == len(os.readlink(p))
        assert p.read_bytes() == (fixture_mount.path / target).read_bytes()
    bucket_link = js / "bucket-link"
    assert bucket_link.is_symlink()
    assert (bucket_link / "target.txt").read_bytes() == (fixture_mount.path / "other/target.txt").read_bytes()


def test_hostile_names_follow_the_documented_rule(fixture_mount):
    root = fixture_mount.path / "interop"
    names = set(os.listdir(root))
    # Escaped, flat in the bucket's top directory, never outside it.
    for shown in ["..%2Fescape.txt", "%2Fabs%2Fpath.txt", "a%2F%2Fdouble.txt", "%2E", "%2E%2E",
                  "d%2F.%2Fe.txt", "dir-marker%2F"]:
        assert shown in names, shown
        assert (root / shown).is_file()
    assert not (fixture_mount.path / "escape.txt").exists()
    assert not (fixture_mount.path.parent / "escape.txt").exists()
    # A file and a directory wanting the same path: the directory wins.
    assert (root / "clash").is_dir()
    assert (root / "clash" / "inner.txt").is_file()
    # Over-long segments and malformed metas are hidden; nothing else crashed.
    assert not any(n.startswith("xxxx") for n in names)
    assert "no-nuid" not in names
    assert "bad-json" not in names
    log = fixture_mount.log()
    assert "is not JSON" in log and "no nuid" in log
    assert fixture_mount.alive


def test_mtimes_come_from_the_meta_message_timestamp(fixture_mount):
    st = (fixture_mount.path / "interop/go/hello.txt").stat()
    # nats.go writes the zero time on the wire; the mount shows the message time (this session).
    assert st.st_mtime > 1_600_000_000


def test_read_only_mount_refuses_writes_with_erofs(fixture_mount, mounter, nats_server):
    import errno

    ro = mounter(nats_server.url, "--read-only")
    for attempt in (lambda: (ro.path / "interop" / "new.txt").write_bytes(b"x"),
                    lambda: (ro.path / "interop" / "go" / "hello.txt").unlink(),
                    lambda: (ro.path / "interop" / "newdir").mkdir()):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    assert (ro.path / "interop" / "go" / "hello.txt").read_bytes() == b"hello from go\n"
