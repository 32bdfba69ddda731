"""Metas whose fields other clients wrote wrong (valid JSON of the wrong type or range), through
natsfs.fs.Operations over MemoryStreams: a value natsfs cannot use (a descriptive field of the wrong JSON
type, an attribute out of range) is ignored, and a meta whose identity fields nats.go cannot read (a
field of the wrong JSON type) or that no file can be is skipped, with one log line per version; neither
its directory nor the mutations of the object break, and a rewrite stores a meta nats.go can read."""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import pyfuse3
import pytest
from gowriters import fixture_nuid, put_object
from opskit import Ctx, Env, Fields, errno_of

from natsfs.adr20 import ROLLUP, ObjectStore, chunk_subject, digest_of, meta_json, meta_subject, parse_meta
from natsfs.memstreams import MemoryStreams

UID, GID = 1234, 5678  # the ops_env mount's defaults




async def raw_put(ms: MemoryStreams, bucket: str, subject_name: str, data: bytes, **fields: Any) -> None:
    """A put as nats.go does it, with meta fields replaced by `fields` (whatever their JSON type, also
    `name`: the meta subject stays the one of `subject_name`)."""
    nuid = fixture_nuid()
    if data:
        await ms.publish(chunk_subject(bucket, nuid), data)
    doc = {"name": subject_name, "bucket": bucket, "nuid": nuid, "size": len(data),
           "mtime": "0001-01-01T00:00:00Z", "chunks": 1 if data else 0, "digest": digest_of(data)} | fields
    await ms.publish(meta_subject(bucket, subject_name), meta_json(doc), {ROLLUP: "sub"})


async def err(coro: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


async def doc_of(env: Env, name: str) -> dict[str, Any]:
    """The stored meta as other clients read it (not cleaned up as the mount reads it)."""
    msg = await env.streams.last_msg("OBJ_b", meta_subject("b", name))
    assert msg is not None
    return json.loads(msg.data)


OUT_OF_RANGE: dict[str, dict[str, Any]] = {
    "huge-uid": {"metadata": {"natsfs.uid": str(2**40)}},
    "huge-gid": {"metadata": {"natsfs.gid": str(2**32)}},
    "huge-rdev": {"metadata": {"natsfs.type": "char", "natsfs.rdev": str(2**70)}},
    "huge-mtime": {"metadata": {"natsfs.mtime_ns": "9" * 30}},
    "huge-mode": {"metadata": {"natsfs.mode": "7" * 40}},
    "negative-uid": {"metadata": {"natsfs.uid": "-5"}},
}


async def hostile_bucket(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await raw_put(ms, "b", "good-1.txt", b"good one\n")
    await raw_put(ms, "b", "good-2.txt", b"good two\n")
    for name, fields in OUT_OF_RANGE.items():
        await raw_put(ms, "b", name, b"" if "rdev" in name else b"x", **fields)
    await raw_put(ms, "b", "huge-size", b"x", size=2**63, chunks=1)
    await raw_put(ms, "b", "huge-chunks", b"x", chunks=2**32)


def test_out_of_range_numbers_never_hide_a_directory(ops_env, caplog):
    caplog.set_level(logging.WARNING)

    async def body(env: Env):
        b = await env.lookup("b")
        names = (await env.listdir(b.st_ino)).names
        assert names == sorted(["good-1.txt", "good-2.txt", *OUT_OF_RANGE])
        assert await env.cat("b/good-1.txt") == b"good one\n"
        # A size or chunk count no file can have: the object is skipped like any meta that breaks ADR-20.
        for name in (b"huge-size", b"huge-chunks"):
            assert await err(env.ops.lookup(b.st_ino, name, None)) == errno.ENOENT
        # An attribute out of its kernel type's range is ignored: the default applies.
        assert (await env.lookup("b/huge-uid")).st_uid == UID
        assert (await env.lookup("b/huge-gid")).st_gid == GID
        assert (await env.lookup("b/negative-uid")).st_uid == UID
        assert (await env.lookup("b/huge-mode")).st_mode & 0o7777 == 0o644
        rdev = await env.lookup("b/huge-rdev")
        assert rdev.st_rdev == 0 and rdev.st_mode & 0o170000 == 0o020000
        mtime = (await env.lookup("b/huge-mtime")).st_mtime_ns
        assert 0 < mtime < 2**63
        assert await env.cat("b/huge-uid") == b"x"
        await env.listdir(b.st_ino)  # listed again: nothing logged again

    ops_env(body, setup=hostile_bucket)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    for name in [*OUT_OF_RANGE, "huge-size", "huge-chunks"]:
        assert len([m for m in lines if repr(name) in m]) == 1, (name, lines)


def test_a_bucket_mount_root_lists_next_to_out_of_range_metas(ops_env):
    async def body(env: Env):
        names = (await env.listdir(pyfuse3.ROOT_INODE)).names
        assert {"good-1.txt", "good-2.txt", "huge-uid", "huge-mtime"} <= set(names)

    ops_env(body, setup=hostile_bucket, bucket="b")


@pytest.mark.expect_log("readdir: b/good-1.txt left out of its directory")
def test_one_entry_that_cannot_be_handed_over_never_aborts_readdir(ops_env, caplog, monkeypatch):
    """Defence in depth: whatever goes wrong building one entry's attributes, the others are listed."""
    caplog.set_level(logging.WARNING)

    async def body(env: Env):
        b = await env.lookup("b")
        real_attr = env.fs._attr

        def attr(ino, node):
            if node.info is not None and node.info.name == "good-1.txt":
                raise OverflowError("value too large to convert")
            return real_attr(ino, node)

        monkeypatch.setattr(env.fs, "_attr", attr)
        for _ in range(2):
            assert "good-1.txt" not in (names := (await env.listdir(b.st_ino)).names)
            assert "good-2.txt" in names and "huge-uid" in names
        monkeypatch.setattr(env.fs, "_attr", real_attr)
        assert "good-1.txt" in (await env.listdir(b.st_ino)).names

    ops_env(body, setup=hostile_bucket)
    skipped = [r for r in caplog.records if "left out of its directory" in r.getMessage()]
    assert len(skipped) == 1 and "good-1.txt" in skipped[0].getMessage()


# ---------------------------------------------------------------- fields of the wrong JSON type
# Fields that decide what the object is, of another JSON type than nats.go's ObjectInfo declares (it
# cannot unmarshal such a meta at all): the meta is skipped as malformed, never shown with the field
# turned into text.
STRICT_WRONG_TYPES: dict[str, dict[str, Any]] = {
    "name-number": {"name": 5},
    "link-typed-wrong": {"options": {"link": {"bucket": 7, "name": ["a"]}}},
    "link-string": {"options": {"link": "str"}},
    "digest-number": {"digest": 5},
    "deleted-string": {"deleted": "yes"},
    "size-string": {"size": "2"},
}


async def strict_wrong_types(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "good.txt", b"good\n")
    for name, fields in STRICT_WRONG_TYPES.items():
        await raw_put(ms, "b", name, b"x\n", **fields)


def test_metas_whose_identity_fields_are_of_the_wrong_type_are_skipped(ops_env, caplog):
    caplog.set_level(logging.WARNING)

    async def body(env: Env):
        b = await env.lookup("b")
        for _ in range(2):  # (listed again: nothing logged again)
            assert (await env.listdir(b.st_ino)).names == ["good.txt"]
        for name in STRICT_WRONG_TYPES:
            assert await err(env.ops.lookup(b.st_ino, name.encode(), None)) == errno.ENOENT
        assert await env.cat("b/good.txt") == b"good\n"
        # Another client puts a proper meta there: the object shows.
        await put_object(env.streams, "b", "digest-number", b"fixed\n", metadata={"k": "v"})
        await env.settle()
        assert await env.cat("b/digest-number") == b"fixed\n"
        assert await env.ops.getxattr((await env.lookup("b/digest-number")).st_ino, b"user.k", Ctx()) == b"v"

    ops_env(body, setup=strict_wrong_types)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    skipped = [r.getMessage() for r in caplog.records if "skipping malformed meta" in r.getMessage()]
    for name in STRICT_WRONG_TYPES:
        assert len([m for m in skipped if repr(name) in m and "is not one nats.go can read" in m]) == 1, (name, skipped)
    assert len(skipped) == len(STRICT_WRONG_TYPES)
    assert not [r for r in caplog.records if "of the wrong JSON type (ignored)" in r.getMessage()]


# Descriptive fields of the wrong JSON type (nats.py stores whatever `headers` or `metadata` a user
# passes): that field or entry is ignored with one warning per meta version, the object shows as if it
# were absent, and every rewrite by the mount stores a meta nats.go can read.
LENIENT_WRONG_TYPES: dict[str, dict[str, Any]] = {
    "md-list": {"metadata": ["a", "b"]},
    "md-str": {"metadata": "garbage"},
    "md-number-value": {"metadata": {"k": 5}},
    "hdr-str": {"headers": "garbage"},
    "hdr-str-values": {"headers": {"Content-Type": "text/plain"}},
    "opt-list": {"options": ["x"]},
    "desc-obj": {"description": {"x": 1}},
    "symlink-number": {"metadata": {"natsfs.symlink": 5}},
    "mtime-number": {"mtime": 12},
    "chunk-size-string": {"options": {"max_chunk_size": "131072"}},
}


async def lenient_wrong_types(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    for name, fields in LENIENT_WRONG_TYPES.items():
        await raw_put(ms, "b", name, b"x\n", **fields)


def _nats_go_reads(doc: dict[str, Any]) -> None:
    """The meta as nats.go's json.Unmarshal into its ObjectInfo takes it: every field absent, null or of
    its declared type."""
    def text(value: Any) -> bool:
        return value is None or isinstance(value, str)

    def uint(value: Any, bits: int) -> bool:
        return value is None or (type(value) is int and 0 <= value < 2**bits)

    def string_map(value: Any, each: Any) -> bool:
        return value is None or (isinstance(value, dict) and all(each(v) for v in value.values()))

    options = doc.get("options")
    assert options is None or isinstance(options, dict), doc
    link = (options or {}).get("link")
    assert link is None or (isinstance(link, dict) and text(link.get("bucket")) and text(link.get("name"))), doc
    assert uint((options or {}).get("max_chunk_size"), 32), doc
    assert all(text(doc.get(k)) for k in ("name", "description", "bucket", "nuid", "mtime", "digest")), doc
    assert string_map(doc.get("metadata"), text), doc
    assert string_map(doc.get("headers"), lambda v: v is None or (isinstance(v, list) and all(map(text, v)))), doc
    assert uint(doc.get("size"), 64) and uint(doc.get("chunks"), 32), doc
    assert doc.get("deleted") is None or isinstance(doc["deleted"], bool), doc


def test_metas_with_descriptive_fields_of_the_wrong_type_are_shown(ops_env, caplog):
    caplog.set_level(logging.WARNING)

    async def body(env: Env):
        b = await env.lookup("b")
        for _ in range(2):  # (listed again: nothing logged again)
            assert (await env.listdir(b.st_ino)).names == sorted(LENIENT_WRONG_TYPES)
        for name in LENIENT_WRONG_TYPES:
            assert await env.cat(f"b/{name}") == b"x\n"
            ino = (await env.lookup(f"b/{name}")).st_ino
            # Nothing of the wrong type shows as an attribute (never turned into text).
            assert [n for n in await env.ops.listxattr(ino, Ctx()) if not n.startswith(b"user.nats.")] == []
            assert not [n for n in await env.ops.listxattr(ino, Ctx()) if n.startswith(b"user.nats.header.")]
        md = (await env.lookup("b/md-number-value")).st_ino
        assert await err(env.ops.getxattr(md, b"user.k", Ctx())) == errno.ENODATA
        hdr = (await env.lookup("b/hdr-str-values")).st_ino
        assert await err(env.ops.getxattr(hdr, b"user.nats.header.Content-Type", Ctx())) == errno.ENODATA
        desc = (await env.lookup("b/desc-obj")).st_ino
        assert await err(env.ops.getxattr(desc, b"user.nats.description", Ctx())) == errno.ENODATA
        link = await env.lookup("b/symlink-number")
        assert link.st_mode & 0o170000 == 0o100000 and link.st_size == 2  # a file, not a symlink to "5"
        chunk = (await env.lookup("b/chunk-size-string")).st_ino
        assert await err(env.ops.getxattr(chunk, b"user.nats.chunk_size", Ctx())) == errno.ENODATA

    ops_env(body, setup=lenient_wrong_types)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if "malformed" in r.getMessage()]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in LENIENT_WRONG_TYPES:
        assert len([m for m in lines if repr(name) in m]) == 1, (name, lines)
    assert len(lines) == len(LENIENT_WRONG_TYPES), lines


@pytest.mark.parametrize("name", sorted(LENIENT_WRONG_TYPES))
def test_every_mutation_works_on_a_meta_with_fields_of_the_wrong_type(ops_env, caplog, name):
    caplog.set_level(logging.WARNING)

    async def body(env: Env):
        b = await env.lookup("b")
        f = await env.lookup(f"b/{name}")
        ino = f.st_ino
        # chmod, chown, utime
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = 0o100600
        await env.ops.setattr(ino, attr, Fields(update_mode=True), None, Ctx())
        attr.st_uid, attr.st_gid = 0, 12345
        await env.ops.setattr(ino, attr, Fields(update_uid=True, update_gid=True), None, Ctx())
        attr.st_mtime_ns = 1_700_000_000_000_000_000
        await env.ops.setattr(ino, attr, Fields(update_mtime=True), None, Ctx())
        doc = await doc_of(env, name)
        _nats_go_reads(doc)
        assert doc["metadata"] == {"natsfs.mode": "600", "natsfs.uid": "0", "natsfs.gid": "12345",
                                   "natsfs.mtime_ns": "1700000000000000000"}
        assert "headers" not in doc and "description" not in doc and doc["mtime"] == "0001-01-01T00:00:00Z"
        # setxattr, removexattr
        await env.ops.setxattr(ino, b"user.k", b"v", Ctx())
        await env.ops.setxattr(ino, b"user.nats.header.H", b"hv", Ctx())
        await env.ops.removexattr(ino, b"user.k", Ctx())
        doc = await doc_of(env, name)
        _nats_go_reads(doc)
        assert doc["headers"] == {"H": ["hv"]}
        # overwrite at close
        fi = await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"new bytes")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await env.cat(f"b/{name}") == b"new bytes"
        _nats_go_reads(await doc_of(env, name))
        # truncate(2) on a path nobody holds open
        attr.st_size = 3
        await env.ops.setattr(ino, attr, Fields(update_size=True), None, Ctx())
        assert await env.cat(f"b/{name}") == b"new"
        # rename, then unlink
        await env.ops.rename(b.st_ino, name.encode(), b.st_ino, b"renamed", 0, Ctx())
        _nats_go_reads(await doc_of(env, "renamed"))
        assert await env.cat("b/renamed") == b"new"
        await env.ops.unlink(b.st_ino, b"renamed", Ctx())
        assert await err(env.ops.lookup(b.st_ino, b"renamed", None)) == errno.ENOENT

    ops_env(body, setup=lenient_wrong_types)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # One line for the version another client wrote; the mount's own rewrites are proper.
    assert len([r for r in caplog.records if repr(name) in r.getMessage() and "ignored" in r.getMessage()]) == 1


@pytest.mark.parametrize("name", sorted(LENIENT_WRONG_TYPES))
def test_rename_and_unlink_of_a_meta_with_fields_of_the_wrong_type(ops_env, name):
    async def body(env: Env):
        b = await env.lookup("b")
        await env.lookup(f"b/{name}")
        await env.ops.rename(b.st_ino, name.encode(), b.st_ino, b"moved", 0, Ctx())
        _nats_go_reads(await doc_of(env, "moved"))
        assert await env.cat("b/moved") == b"x\n"
        await env.ops.unlink(b.st_ino, b"moved", Ctx())
        tombstone = await doc_of(env, "moved")
        _nats_go_reads(tombstone)
        info = parse_meta("b", await env.streams.last_msg("OBJ_b", meta_subject("b", "moved")))
        assert info.deleted

    ops_env(body, setup=lenient_wrong_types)


async def nats_py_object(ms: MemoryStreams, store: ObjectStore) -> None:
    """An object as nats.py puts it for `ObjectMeta(headers={"Content-Type": "text/plain"}, ...)`: the
    headers stored as the user passed them (a string, not a list), an ISO mtime."""
    await store.create_bucket("b")
    await raw_put(ms, "b", "py.txt", b"from python\n", mtime="2026-11-21T22:35:45.512982+00:00",
                  options={"max_chunk_size": 131072}, metadata={"author": "py"},
                  headers={"Content-Type": "text/plain", "X-Good": ["a", "b"]})


def test_a_nats_py_object_with_string_headers_is_shown_and_a_chmod_stores_headers_nats_go_reads(ops_env, caplog):
    caplog.set_level(logging.WARNING)

    async def body(env: Env):
        b = await env.lookup("b")
        assert (await env.listdir(b.st_ino)).names == ["py.txt"]
        assert await env.cat("b/py.txt") == b"from python\n"
        ino = (await env.lookup("b/py.txt")).st_ino
        assert await env.ops.getxattr(ino, b"user.author", Ctx()) == b"py"
        assert await env.ops.getxattr(ino, b"user.nats.header.X-Good", Ctx()) == b"a\nb"
        assert await err(env.ops.getxattr(ino, b"user.nats.header.Content-Type", Ctx())) == errno.ENODATA
        assert sorted(await env.ops.listxattr(ino, Ctx())) == [b"user.author", b"user.nats.header.X-Good"]
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = 0o100600
        await env.ops.setattr(ino, attr, Fields(update_mode=True), None, Ctx())
        doc = await doc_of(env, "py.txt")
        _nats_go_reads(doc)
        assert doc["headers"] == {"X-Good": ["a", "b"]}  # (the entry nats.go cannot read is left out)
        assert doc["metadata"] == {"author": "py", "natsfs.mode": "600"}
        assert doc["options"] == {"max_chunk_size": 131072}
        await env.settle()
        assert (await env.lookup("b/py.txt")).st_mode == 0o100600
        assert await env.cat("b/py.txt") == b"from python\n"

    ops_env(body, setup=nats_py_object)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "headers['Content-Type'] 'text/plain' (not a list of strings)" in lines[0], lines


# ---------------------------------------------------------------- keys that make no attribute name
async def odd_keys(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await raw_put(ms, "b", "keys", b"x", metadata={"a\x00b": "v", "k\x00": "v", "L" * 300: "v", "nats.digest": "v",
                                                   "ok": "fine", "L" * 250: "max"},
                  headers={"H\x00": ["v"], "Good": ["h"]})


def test_listxattr_lists_only_keys_that_make_usable_attribute_names(ops_env, caplog):
    caplog.set_level(logging.WARNING)

    async def body(env: Env):
        ino = (await env.lookup("b/keys")).st_ino
        for _ in range(2):
            names = await env.ops.listxattr(ino, Ctx())
            assert all(n and b"\x00" not in n and len(n) <= 255 for n in names), names
            user = sorted(n for n in names if not n.startswith(b"user.nats.") or n.startswith(b"user.nats.header"))
            assert user == [b"user." + b"L" * 250, b"user.nats.header.Good", b"user.ok"]
            assert b"user.nats.digest" not in names  # the metadata key is left out, the fact is not listed
            for n in names:  # every listed name reads back
                await env.ops.getxattr(ino, n, Ctx())
        assert await env.ops.getxattr(ino, b"user." + b"L" * 250, Ctx()) == b"max"

    ops_env(body, setup=odd_keys)
    left_out = [r.getMessage() for r in caplog.records if "no usable attribute name" in r.getMessage()]
    assert len(left_out) == 1 and "'user.a\\x00b'" in left_out[0] and "'user.nats.header.H\\x00'" in left_out[0]


@pytest.mark.parametrize("how", ["unlink", "rename over"])
@pytest.mark.parametrize("nuid", [">", "*", "a.b"])
def test_a_link_with_a_wildcard_nuid_never_purges_other_objects_chunks(ops_env, how, nuid):
    """Another client's link meta claiming chunks under the nuid `>`: deleting or replacing the link
    purged `$O.b.C.>`, every chunk of the bucket. A link has no chunks of its own to purge."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        await put_object(ms, "b", "target.txt", b"the target's bytes")
        await put_object(ms, "b", "bystander.txt", b"another object's bytes")
        await raw_put(ms, "b", "evil-link", b"", nuid=nuid, size=5, chunks=1,
                      options={"link": {"bucket": "b", "name": "target.txt"}})

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        if how == "unlink":
            await env.ops.unlink(b, b"evil-link", Ctx())
        else:
            fi, _ = await env.ops.create(b, b"new", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
            await env.ops.write(fi.fh, 0, b"new bytes")
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)
            await env.ops.rename(b, b"new", b, b"evil-link", 0, Ctx())
        await env.settle()
        assert await env.cat("b/target.txt") == b"the target's bytes"
        assert await env.cat("b/bystander.txt") == b"another object's bytes"
        for name in ("target.txt", "bystander.txt"):
            info = await env.store.get_info("b", name)
            assert await env.store.chunk_index("b", info.nuid), name
        if how == "rename over":
            assert await env.cat("b/evil-link") == b"new bytes"

    ops_env(body, setup=setup)


async def empty_values(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await raw_put(ms, "b", "empties", b"e", metadata={"empty": "", "null": None, "": "no name", "ok": "1"},
                  headers={"None": [], "Blank": [""], "Null": None, "Ok": ["v"]}, description="")


def test_every_listed_attribute_reads_and_an_empty_value_is_an_empty_attribute(ops_env):
    """Other clients write metadata values "" or null and headers without values: they were listed but
    read ENODATA (`rsync -X` exits 23, "get_xattr_data ... No data available"), and `setfattr -v ""`
    through the mount listed a name that did not read. A local disk keeps an empty value; so does natsfs.
    A metadata key "" (`user.`, which local filesystems refuse) is not listed."""
    async def body(env: Env):
        ino = (await env.lookup("b/empties")).st_ino
        names = await env.ops.listxattr(ino, Ctx())
        assert sorted(names) == [b"user.empty", b"user.nats.header.Blank", b"user.nats.header.None",
                                 b"user.nats.header.Null", b"user.nats.header.Ok", b"user.null", b"user.ok"]
        got = {n: await env.ops.getxattr(ino, n, Ctx()) for n in names}
        assert got == {b"user.empty": b"", b"user.nats.header.Blank": b"", b"user.nats.header.None": b"",
                       b"user.nats.header.Null": b"", b"user.nats.header.Ok": b"v", b"user.null": b"",
                       b"user.ok": b"1"}
        assert await err(env.ops.getxattr(ino, b"user.nats.description", Ctx())) == errno.ENODATA
        await env.ops.setxattr(ino, b"user.set-empty", b"", Ctx())
        assert await env.ops.getxattr(ino, b"user.set-empty", Ctx()) == b""
        assert b"user.set-empty" in await env.ops.listxattr(ino, Ctx())
        doc = json.loads((await env.streams.last_msg("OBJ_b", meta_subject("b", "empties"))).data)
        assert doc["metadata"]["set-empty"] == "" and doc["metadata"][""] == "no name"

    ops_env(body, setup=empty_values)


async def unreadable_metas(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await raw_put(ms, "b", "dotted-nuid", b"", nuid="a.b", size=1, chunks=1)  # nats.go reads this one
    await ms.publish(meta_subject("b", "not-json"), b"{not json", {ROLLUP: "sub"})


@pytest.mark.expect_log(r"b/(dotted-nuid|not-json): its meta subject holds a meta this mount cannot read")
def test_creating_a_name_whose_meta_the_mount_cannot_read_fails_at_once(ops_env):
    """The name shows nothing (its meta is skipped), so `echo x > name` created it, and every close failed
    EIO with the bytes sent to lost+found (the store reads the meta back): a shell redirection, which
    does not check close, reported success and the file was gone. The create itself is refused now."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        for name in (b"dotted-nuid", b"not-json"):
            assert await err(env.ops.create(b, name, 0o644, os.O_WRONLY | os.O_CREAT, Ctx())) == errno.EIO
            assert await err(env.ops.lookup(b, name, Ctx())) == errno.ENOENT
        fi, _ = await env.ops.create(b, b"other", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
        await env.ops.write(fi.fh, 0, b"fine\n")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert await env.cat("b/other") == b"fine\n"
        assert not (env.fs.staging.spool.lost_found / "b").exists()
        assert json.loads((await env.streams.last_msg("OBJ_b", meta_subject("b", "dotted-nuid"))).data)["nuid"] == "a.b"

    ops_env(body, setup=unreadable_metas)
