"""The ADR-20 interop fixtures replayed into MemoryStreams: the same outcomes a real mount must show.

Mirrors tests/mount/test_fixtures.py without a server or a kernel: every well-formed object byte-identical
(and its digest checked), tombstones and renamed-away names absent, links resolving, hostile names escaped
per natsfs/names.py, malformed metas skipped with a log line, and the mount still working afterwards.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import posixpath
import stat

import pyfuse3
import pytest
from opskit import FIXTURES, ROOT, Env, errno_of, replay_dump

from natsfs.adr20 import meta_subject
from natsfs.memstreams import MemoryStreams

DUMP = json.loads((FIXTURES / "OBJ_interop.json").read_text())

WELL_FORMED = ["go/hello.txt", "go/multi.bin", "go/renamed.txt", "go/overwritten.txt", "js/a.txt",
               "js/small-chunks.bin", "py/x.txt", "py/empty.txt", "space name.txt", "tab\tname.txt",
               "new\nline.txt", "ünïcödé.txt", "clash/inner.txt"]
# Hostile names: (object name, where it shows in the bucket directory)
ESCAPED = {"../escape.txt": "..%2Fescape.txt", "/abs/path.txt": "%2Fabs%2Fpath.txt",
           "a//double.txt": "a%2F%2Fdouble.txt", ".": "%2E", "..": "%2E%2E", "d/./e.txt": "d%2F.%2Fe.txt",
           "dir-marker/": "dir-marker%2F"}
TOP = sorted(["%2E", "%2E%2E", "%2Fabs%2Fpath.txt", "..%2Fescape.txt", "a%2F%2Fdouble.txt", "clash", "d%2F.%2Fe.txt",
              "dir-marker%2F", "go", "js", "new\nline.txt", "py", "space name.txt", "tab\tname.txt", "ünïcödé.txt"])


def metas() -> dict[str, dict]:
    """name -> last meta JSON, for every meta in the dump that parses (last one per subject wins)."""
    out: dict[str, dict] = {}
    for m in DUMP["messages"]:
        if ".M." not in m["subject"]:
            continue
        try:
            doc = json.loads(base64.b64decode(m["data_b64"]))
        except ValueError:
            continue
        if isinstance(doc, dict) and "name" in doc:
            out[doc["name"]] = doc
    return out


def chunks_of(nuid: str) -> bytes:
    return b"".join(base64.b64decode(m["data_b64"]) for m in DUMP["messages"]
                    if m["subject"] == f"$O.interop.C.{nuid}")


async def replay_both(ms: MemoryStreams, store) -> None:
    assert await replay_dump(ms, FIXTURES / "OBJ_interop.json") == len(DUMP["messages"])
    await replay_dump(ms, FIXTURES / "OBJ_other.json")


async def fuse_error(coro) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


async def follow(env: Env, link_path: str) -> bytes:
    """Resolve a symlink the way the kernel would (relative to the link's directory) and read the target."""
    attr = await env.lookup(link_path)
    target = os.fsdecode(await env.ops.readlink(attr.st_ino, None))
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link_path), target))
    assert not resolved.startswith(".."), resolved
    return await env.cat(resolved)


@pytest.fixture()
def interop(ops_env):
    def run(body, **kw):
        return ops_env(body, setup=replay_both, **kw)

    return run


def test_well_formed_objects_are_byte_identical(interop):
    async def body(env: Env):
        docs = metas()
        for name in WELL_FORMED:
            expected = chunks_of(docs[name]["nuid"])
            assert len(expected) == docs[name]["size"], name
            attr = await env.lookup("interop/" + name)
            assert stat.S_ISREG(attr.st_mode) and attr.st_size == len(expected), name
            assert await env.read_all(attr.st_ino) == expected, name
            assert await env.read_all(attr.st_ino, size=999) == expected, name  # odd read sizes too
        other = json.loads((FIXTURES / "OBJ_other.json").read_text())
        target = b"".join(base64.b64decode(m["data_b64"]) for m in other["messages"] if ".C." in m["subject"])
        assert await env.cat("other/target.txt") == target == b"hello from go\n"

    interop(body)


def test_tombstones_and_renamed_away_names_are_absent(interop):
    async def body(env: Env):
        go = await env.lookup("interop/go")
        for name in (b"deleted.txt", b"old-name.txt"):
            assert await fuse_error(env.ops.lookup(go.st_ino, name, None)) == errno.ENOENT
        py = await env.lookup("interop/py")
        assert await fuse_error(env.ops.lookup(py.st_ino, b"deleted.txt", None)) == errno.ENOENT
        assert (await env.listdir(go.st_ino)).names == ["hello.txt", "multi.bin", "overwritten.txt", "renamed.txt"]
        assert (await env.listdir(py.st_ino)).names == ["empty.txt", "x.txt"]
        js = await env.lookup("interop/js")
        assert (await env.listdir(js.st_ino)).names == ["a.txt", "bucket-link", "link-to-a", "link-to-other",
                                                        "small-chunks.bin"]
        assert (await env.lookup("interop/go/overwritten.txt")).st_size == 14

    interop(body)


def test_meta_updated_without_rollup_uses_the_last_message(interop):
    async def body(env: Env):
        await env.lookup("interop/js/a.txt")
        index = env.ns.loaded_index("interop")
        info = index.objects["js/a.txt"]
        last = await env.streams.last_msg("OBJ_interop", meta_subject("interop", "js/a.txt"))
        assert info.revision == last.seq
        assert json.loads(last.data)["description"] == "updated by js"
        assert env.streams.subjects("OBJ_interop")[meta_subject("interop", "js/a.txt")] == 2

    interop(body)


def test_links_are_symlinks_that_resolve(interop):
    async def body(env: Env):
        expected = {"interop/js/link-to-a": "../../interop/js/a.txt",
                    "interop/js/link-to-other": "../../interop/go/hello.txt",
                    "interop/js/bucket-link": "../../other"}
        for path, target in expected.items():
            attr = await env.lookup(path)
            assert stat.S_ISLNK(attr.st_mode)
            assert attr.st_size == len(target)
            assert await env.ops.readlink(attr.st_ino, None) == target.encode()
        assert await follow(env, "interop/js/link-to-a") == await env.cat("interop/js/a.txt")
        assert await follow(env, "interop/js/link-to-other") == await env.cat("interop/go/hello.txt")
        bucket = await env.lookup("other")
        assert (await env.listdir(bucket.st_ino)).names == ["target.txt"]

    interop(body)


def test_hostile_names_follow_the_documented_rule(interop, caplog):
    async def body(env: Env):
        root = await env.lookup("interop")
        listing = await env.listdir(root.st_ino)
        assert listing.names == TOP
        docs = metas()
        for name, shown in ESCAPED.items():
            attr = await env.ops.lookup(root.st_ino, shown.encode(), None)
            assert stat.S_ISREG(attr.st_mode), shown
            assert await env.read_all(attr.st_ino) == chunks_of(docs[name]["nuid"]), shown
        clash = await env.lookup("interop/clash")
        assert stat.S_ISDIR(clash.st_mode)
        assert (await env.listdir(clash.st_ino)).names == ["inner.txt"]
        for absent in (b"x" * 300, b"xxxx", b"no-nuid", b"bad-json", b"escape.txt", b"abs", b"a", b"d"):
            assert await fuse_error(env.ops.lookup(root.st_ino, absent, None)) in (errno.ENOENT, errno.ENAMETOOLONG)
        assert await fuse_error(env.ops.lookup(ROOT, b"escape.txt", None)) == errno.ENOENT
        # Nothing is placed outside the bucket: the mount root holds only the buckets.
        assert (await env.listdir(ROOT)).names == ["interop", "other"]

    interop(body)
    assert "is not JSON" in caplog.text
    assert "no nuid" in caplog.text


def test_mtimes_come_from_the_meta_message_timestamp(interop):
    async def body(env: Env):
        attr = await env.lookup("interop/go/hello.txt")
        msg = await env.streams.last_msg("OBJ_interop", meta_subject("interop", "go/hello.txt"))
        assert attr.st_mtime_ns == msg.time_ns
        assert attr.st_mtime_ns > 1_600_000_000 * 10**9  # not the zero time nats.go writes
        py = await env.lookup("interop/py/x.txt")
        pymsg = await env.streams.last_msg("OBJ_interop", meta_subject("interop", "py/x.txt"))
        assert py.st_mtime_ns == pymsg.time_ns

    interop(body)


def test_the_mount_keeps_working_after_the_fixtures(interop):
    async def body(env: Env):
        root = await env.lookup("interop")
        await env.listdir(root.st_ino)
        for shown in TOP:
            await env.ops.lookup(root.st_ino, shown.encode(), None)
        assert (await env.ops.statfs(None)).f_bsize == 4096
        stats = json.loads(await env.ops.getxattr(ROOT, b"user.natsfs.stats", None))
        assert stats["handles"] == 0
        assert await env.cat("interop/go/multi.bin") == chunks_of(metas()["go/multi.bin"]["nuid"])
        assert await fuse_error(env.ops.open(root.st_ino, os.O_RDONLY, None)) == errno.EISDIR

    interop(body)


def test_single_bucket_mount_of_the_fixtures(interop):
    async def body(env: Env):
        assert (await env.listdir(ROOT)).names == TOP
        expected = {"js/link-to-a": "../js/a.txt", "js/link-to-other": "../go/hello.txt",
                    "js/bucket-link": "nats-object:other/"}
        for path, target in expected.items():
            attr = await env.lookup(path)
            assert await env.ops.readlink(attr.st_ino, None) == target.encode()
        assert await follow(env, "js/link-to-a") == await env.cat("js/a.txt")
        s = await env.ops.statfs(None)
        st = await env.store.bucket_status("interop")
        assert s.f_bfree * 4096 >= 1 << 49 and st.messages == s.f_files - 1_000_000

    interop(body, bucket="interop")
