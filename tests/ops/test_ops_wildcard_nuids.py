"""A meta whose nuid is `*` or `>` (another client wrote it: a tombstone, a live meta, a link) is rewritten by
the mount on a fresh nuid that holds no chunks, expecting the revision it read: nats.go's Delete and Put
and nats.js's put of that name purge the nuid they find there, and `$O.<bucket>.C.*` is every chunk of
the bucket. One WARNING per name. A live object reads as before (empty, or EIO: it never had chunks it
could read), a link still leads to its target. (A real server's purge by that filter, with nats.go's and
nats.js's steps, is in tests/mount/test_wildcard_nuids.py; MemoryStreams refuses such a purge.)"""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import pyfuse3
import pytest
import trio
from gowriters import delete_object, js_put_object, put_object
from opskit import Ctx, Env

from natsfs.adr20 import ROLLUP, ObjectStore, meta_subject, usable_nuid
from natsfs.memstreams import MemoryStreams

# Metas other clients wrote with a wildcard nuid: name -> their fields besides name and bucket.
WILD: dict[str, dict[str, Any]] = {
    "victim": {"nuid": "*", "deleted": True},
    "other": {"nuid": ">", "deleted": True},
    "empty": {"nuid": ">", "metadata": {"k": "v"}},
    "unreadable": {"nuid": "*", "size": 5, "chunks": 1, "digest": "SHA-256=abc", "description": "kept"},
    "dotted": {"nuid": "x.*"},
    "link": {"nuid": "*", "options": {"link": {"bucket": "b", "name": "keep1"}}},
}


def meta(bucket: str, name: str, fields: dict[str, Any]) -> bytes:
    return json.dumps({"name": name, "bucket": bucket, "size": 0, "chunks": 0,
                       "mtime": "0001-01-01T00:00:00Z"} | fields).encode()


def tombstone(bucket: str, name: str, nuid: str) -> bytes:
    return meta(bucket, name, {"nuid": nuid, "deleted": True})


async def publish_wild(streams: MemoryStreams) -> None:
    for name, fields in WILD.items():
        await streams.publish(meta_subject("b", name), meta("b", name, fields), {ROLLUP: "sub"})


async def what_reads(env: Env) -> dict[str, Any]:
    """What each live name of WILD reads as through the mount: bytes, an errno, or a link's target."""
    got: dict[str, Any] = {}
    for name in ("empty", "unreadable", "dotted"):
        try:
            got[name] = await env.cat(f"b/{name}")
        except pyfuse3.FUSEError as e:
            got[name] = e.errno
    got["link"] = await env.ops.readlink((await env.lookup("b/link")).st_ino, None)
    return got


async def bucket_with_objects(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "keep1", b"one" * 1000)
    await put_object(ms, "b", "keep2", b"two" * 1000)


async def meta_of(env: Env, name: str) -> tuple[dict, int]:
    msg = await env.streams.last_msg("OBJ_b", meta_subject("b", name))
    assert msg is not None
    return json.loads(msg.data), msg.seq


async def write_close_and_read(env: Env, fi: Any, name: str) -> None:
    """Write "mine" through the handle `fi` of b/`name`, close it: stored, on a fresh nuid."""
    await env.ops.write(fi.fh, 0, b"mine")
    await env.ops.flush(fi.fh)
    await env.ops.release(fi.fh)
    await env.settle()
    assert await env.cat(f"b/{name}") == b"mine"
    doc, _ = await meta_of(env, name)
    assert usable_nuid(doc["nuid"]) and doc["size"] == 4


async def rewritten(env: Env, name: str) -> dict:
    """The meta of `name` once the mount rewrote its tombstone (a bounded wait for that outcome)."""
    with trio.fail_after(30):
        while True:
            doc, _ = await meta_of(env, name)
            if usable_nuid(doc.get("nuid") or ""):
                return doc
            await trio.sleep(0.05)


def test_a_wildcard_nuid_is_rewritten_on_a_fresh_nuid_once_seen(ops_env, caplog):
    """Tombstones, live metas and links alike; then nats.go's Delete and nats.js's put of those names purge
    only the fresh nuids: every other object keeps its chunks byte-exact."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        chunks_before = {s: n for s, n in env.streams.subjects("OBJ_b").items() if ".C." in s}
        await publish_wild(env.streams)
        for name, fields in WILD.items():
            doc = await rewritten(env, name)
            assert doc["nuid"] not in chunks_before, name
            if fields.get("deleted"):
                assert doc["deleted"] is True and (doc["size"], doc["chunks"]) == (0, 0)
                assert doc["name"] == name and doc["bucket"] == "b"
            else:  # every other field kept
                assert {k: v for k, v in doc.items() if k != "nuid"} == \
                    {k: v for k, v in json.loads(meta("b", name, fields)).items() if k != "nuid"}
        await env.settle()
        # Nothing else changed: every chunk is there, the objects read whole, the names stay deleted, the
        # live ones read as an object with a wildcard nuid reads (empty, or EIO), the link leads to keep1.
        assert {s: n for s, n in env.streams.subjects("OBJ_b").items() if ".C." in s} == chunks_before
        assert await env.cat("b/keep1") == b"one" * 1000
        assert await env.cat("b/keep2") == b"two" * 1000
        assert await what_reads(env) == {"empty": b"", "unreadable": errno.ESTALE, "dotted": b"", "link": b"../b/keep1"}
        # Another client's wildcard tombstone of the same name again: rewritten again, logged at INFO.
        await env.streams.publish(meta_subject("b", "victim"), tombstone("b", "victim", "*"), {ROLLUP: "sub"})
        await rewritten(env, "victim")
        # And again: rewritten, logged at DEBUG only (a client doing it in a loop floods no log).
        await env.streams.publish(meta_subject("b", "victim"), tombstone("b", "victim", "*"), {ROLLUP: "sub"})
        await rewritten(env, "victim")
        # nats.go's Delete of every live name, nats.js's put of every name: only the fresh nuids go.
        for name, fields in WILD.items():
            if not fields.get("deleted"):
                await delete_object(env.streams, "b", name)
            await js_put_object(env.streams, "b", name, b"theirs")
        await env.settle()
        assert {s: n for s, n in env.streams.subjects("OBJ_b").items() if s in chunks_before} == chunks_before
        assert await env.cat("b/keep1") == b"one" * 1000
        assert await env.cat("b/keep2") == b"two" * 1000

    caplog.set_level(logging.DEBUG, logger="natsfs")
    ops_env(body, setup=bucket_with_objects, settle_interval=0.05)
    lines = [r for r in caplog.records if "carried the nuid" in r.getMessage()]
    warnings = sorted(r.getMessage().split("'")[1] for r in lines if r.levelno == logging.WARNING)
    assert warnings == sorted(WILD)
    assert [r.getMessage().split("'")[1] for r in lines if r.levelno == logging.INFO] == ["victim"]
    assert [r.getMessage().split("'")[1] for r in lines if r.levelno == logging.DEBUG] == ["victim"]


def test_a_live_meta_with_a_wildcard_nuid_reads_the_same_before_and_after_its_rewrite(ops_env):
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish_wild(env.streams)
        await env.settle()
        for name in WILD:
            doc, _ = await meta_of(env, name)
            assert not usable_nuid(doc["nuid"]), name
        before = await what_reads(env)
        assert before == {"empty": b"", "unreadable": errno.ESTALE, "dotted": b"", "link": b"../b/keep1"}
        await env.fs.mut.defuse_wildcard_nuids()
        await env.settle()
        for name in WILD:
            doc, _ = await meta_of(env, name)
            assert usable_nuid(doc["nuid"]), name
        assert await what_reads(env) == before

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)  # (rewritten only when called here)


@pytest.mark.parametrize("count", [25])
def test_many_wildcard_nuids_log_no_flood(ops_env, caplog, count):
    """A bucket full of them: one WARNING line each for the first few, one more line for the rest."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        for i in range(count):
            await env.streams.publish(meta_subject("b", f"w{i}"), tombstone("b", f"w{i}", "*"), {ROLLUP: "sub"})
        await env.settle()
        await env.fs.mut.defuse_wildcard_nuids()
        for i in range(count):
            doc, _ = await meta_of(env, f"w{i}")
            assert usable_nuid(doc["nuid"])

    caplog.set_level(logging.INFO, logger="natsfs")
    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "nuid" in r.getMessage()]
    assert len(warnings) == 11 and "15 more metas whose nuid was a wildcard" in warnings[-1]


def test_a_wildcard_nuid_changed_meanwhile_is_left_as_it_is_now(ops_env, caplog):
    """The rewrite expects the revision read: another client's meta stored since stays (a race lost is
    logged once, at INFO), and is rewritten in turn when it carries a wildcard nuid too."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await env.streams.publish(meta_subject("b", "victim"), tombstone("b", "victim", "*"), {ROLLUP: "sub"})
        await env.settle()
        index = env.ns.loaded_index("b")
        assert index is not None
        revision = index.wildcard_nuids["victim"][0]
        await put_object(env.streams, "b", "victim", b"theirs")
        assert await env.store.defuse_wildcard_nuid("b", "victim", revision) is None
        doc, seq = await meta_of(env, "victim")
        assert not doc.get("deleted") and seq > revision
        await env.fs.mut.defuse_wildcard_nuids()
        await env.settle()
        assert await env.cat("b/victim") == b"theirs"
        assert not index.wildcard_nuids
        # Another client's link with a wildcard nuid, stored after the index read the tombstone of "late".
        await env.streams.publish(meta_subject("b", "late"), tombstone("b", "late", ">"), {ROLLUP: "sub"})
        await env.settle()
        link = meta("b", "late", WILD["link"])
        await env.streams.publish(meta_subject("b", "late"), link, {ROLLUP: "sub"})
        for _ in range(3):  # (the first pass expects the tombstone's revision: the race is lost)
            await env.fs.mut.defuse_wildcard_nuids()
            await env.settle()
        doc, _ = await meta_of(env, "late")
        assert usable_nuid(doc["nuid"]) and {**doc, "nuid": "*"} == json.loads(link)
        assert await env.ops.readlink((await env.lookup("b/late")).st_ino, None) == b"../b/keep1"

    caplog.set_level(logging.INFO, logger="natsfs")
    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
    lost = [r for r in caplog.records if "could be rewritten" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split("'")[1]) for r in lost] == [(logging.INFO, "late")]
    done = [r for r in caplog.records if "carried the nuid" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split("'")[1]) for r in done] == [(logging.WARNING, "late")]


def test_a_read_only_bucket_keeps_its_wildcard_tombstone(ops_env):
    async def body(env: Env) -> None:
        await env.streams.publish(meta_subject("b", "victim"), tombstone("b", "victim", "*"), {ROLLUP: "sub"})
        await env.store.seal_bucket("b")
        await env.lookup("b/keep1")
        await env.settle()
        await env.fs.mut.defuse_wildcard_nuids()
        doc, _ = await meta_of(env, "victim")
        assert doc["nuid"] == "*"

    ops_env(body, setup=bucket_with_objects)


def test_this_mounts_own_changes_of_such_names_never_store_a_wildcard_nuid(ops_env):
    """Before the background rewrite: an unlink, a rename, an xattr change and a write of such names store
    metas on fresh nuids (never a wildcard), and purge nothing of the other objects."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        chunks_before = {s: n for s, n in env.streams.subjects("OBJ_b").items() if ".C." in s}
        await publish_wild(env.streams)
        await env.settle()
        b = (await env.lookup("b")).st_ino
        await env.ops.unlink(b, b"empty", Ctx())
        await env.ops.unlink(b, b"link", Ctx())
        await env.ops.rename(b, b"unreadable", b, b"moved", 0, Ctx())
        await env.ops.setxattr((await env.lookup("b/dotted")).st_ino, b"user.k", b"v", Ctx())
        fi = await env.ops.open((await env.lookup("b/dotted")).st_ino, os.O_WRONLY | os.O_APPEND, Ctx())
        await env.ops.write(fi.fh, 0, b"appended")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert await env.cat("b/dotted") == b"appended"
        for name in ("empty", "link", "unreadable", "moved", "dotted"):
            doc, _ = await meta_of(env, name)
            assert usable_nuid(doc["nuid"]), name
        assert (await meta_of(env, "moved"))[0]["description"] == "kept"
        assert {s: n for s, n in env.streams.subjects("OBJ_b").items() if s in chunks_before} == chunks_before
        assert await env.cat("b/keep1") == b"one" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


@pytest.mark.parametrize("meanwhile", [False, True])
@pytest.mark.parametrize("name", ["dotted", "victim"])
def test_a_file_open_for_writing_survives_the_rewrite_of_its_names_wildcard_nuid(ops_env, name, meanwhile):
    """The background rewrite is this mount's own change, not another client's: a file of such a name
    opened for writing before it or while it is stored (a live meta, or a tombstone created over) still
    stores at its close."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish_wild(env.streams)
        await env.settle()
        b = (await env.lookup("b")).st_ino
        opened = []

        async def open_it() -> None:
            if name == "victim":
                opened.append((await env.ops.create(b, name.encode(), 0o644, os.O_WRONLY, Ctx()))[0])
            else:
                ino = (await env.lookup(f"b/{name}")).st_ino
                opened.append(await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, Ctx()))

        if meanwhile:
            defuse = env.store.defuse_wildcard_nuid

            async def open_then_defuse(bucket: str, n: str, revision: int) -> Any:
                if n == name:
                    await open_it()
                return await defuse(bucket, n, revision)

            env.store.defuse_wildcard_nuid = open_then_defuse  # type: ignore[method-assign]
        else:
            await open_it()
        await env.fs.mut.defuse_wildcard_nuids()
        fi = opened[0]
        await env.settle()
        await write_close_and_read(env, fi, name)

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


def test_a_live_meta_near_the_meta_size_limit_is_rewritten_too(ops_env):
    """The fresh nuid is longer than `*`: the rewrite grows the meta by a few bytes, which must not hold
    it back (retried every pass, forever) when the meta is just under --max-meta-bytes."""
    limit = 4096

    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        fields = {"nuid": "*", "description": ""}
        fields["description"] = "d" * (limit - len(meta("b", "big", fields)) - 2)
        data = meta("b", "big", fields)
        assert limit - 10 < len(data) <= limit
        await env.streams.publish(meta_subject("b", "big"), data, {ROLLUP: "sub"})
        await env.settle()
        await env.fs.mut.defuse_wildcard_nuids()
        doc, _ = await meta_of(env, "big")
        assert usable_nuid(doc["nuid"]) and doc["description"] == fields["description"]

    ops_env(body, setup=bucket_with_objects, settle_interval=3600, max_meta_bytes=limit)


@pytest.mark.parametrize("name", ["dotted", "empty"])
def test_a_file_open_for_writing_survives_another_mounts_rewrite_of_its_wildcard_nuid(ops_env, name):
    """Another mount (or `natsfs fsck --repair`) rewrites the wildcard nuid of a name this mount has open
    for writing: that rewrite changes nothing but the nuid, so the close here still stores."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish_wild(env.streams)
        await env.settle()
        fi = await env.ops.open((await env.lookup(f"b/{name}")).st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        _, revision = await meta_of(env, name)
        other = ObjectStore(env.streams)  # (another mount's store, over the same server)
        assert await other.defuse_wildcard_nuid("b", name, revision) is not None
        await env.settle()
        await write_close_and_read(env, fi, name)

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


def test_a_meta_this_mount_skips_but_nats_go_reads_is_rewritten_too(ops_env, caplog):
    """A meta natsfs does not show (its size claims bytes its zero chunks cannot hold) that nats.go reads,
    with the nuid `*`: nats.go's Delete of that name would purge every chunk of the bucket. The mount
    rewrites it with every other field kept (still skipped here: it is what it was), expecting the
    revision it read, one WARNING; nats.go's Delete then purges only the fresh nuid."""
    fields = {"nuid": "*", "size": 5, "chunks": 0, "description": "odd"}

    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        chunks_before = {s: n for s, n in env.streams.subjects("OBJ_b").items() if ".C." in s}
        await env.streams.publish(meta_subject("b", "odd"), meta("b", "odd", fields), {ROLLUP: "sub"})
        await env.settle()
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.lookup("b/odd")
        assert e.value.errno == errno.ENOENT  # (skipped here, before and after)
        await env.fs.mut.defuse_wildcard_nuids()
        await env.settle()
        doc, _ = await meta_of(env, "odd")
        assert usable_nuid(doc["nuid"])
        assert {k: v for k, v in doc.items() if k != "nuid"} == \
            {k: v for k, v in json.loads(meta("b", "odd", fields)).items() if k != "nuid"}
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.lookup("b/odd")
        assert e.value.errno == errno.ENOENT
        await env.fs.mut.defuse_wildcard_nuids()  # (nothing left to rewrite: no second line)
        await delete_object(env.streams, "b", "odd")
        await env.settle()
        assert {s: n for s, n in env.streams.subjects("OBJ_b").items() if s in chunks_before} == chunks_before
        assert await env.cat("b/keep1") == b"one" * 1000

    caplog.set_level(logging.INFO, logger="natsfs")
    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
    lines = [r for r in caplog.records if "carried the nuid" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split("'")[1]) for r in lines] == [(logging.WARNING, "odd")]
    assert "skipped here, read by nats.go" in lines[0].getMessage()


# Aliases another client wrote: meta subject (the canonical subject of another name) -> the meta there.
ALIASES: dict[str, dict[str, Any]] = {
    meta_subject("b", "x"): {"name": "y", "nuid": "*", "description": "kept"},  # live, skipped here (another name's)
    "$O.b.M.__4=": {"name": "w", "nuid": "*"},  # shown as w (its token is no UTF-8 name's), Go's name b"\xff\xfe"
    meta_subject("b", "t"): {"name": "ghost", "nuid": ">", "deleted": True},  # a tombstone (Delete reads it too)
    meta_subject("b", "s"): {"name": "z", "nuid": "*", "size": 5, "chunks": 0},  # skipped here, read by nats.go
}


def test_an_alias_with_a_wildcard_nuid_on_a_subject_nats_go_reads_by_name_is_rewritten_in_place(ops_env, caplog):
    """nats.go's Put(X) and Delete(X) read the last meta on X's subject (`GetInfo`, which never checks its
    `name`) and purge the nuid it holds: an alias there (a meta named Y) with the nuid `*` would have them
    purge every chunk of the bucket. The mount rewrites it in place on a fresh nuid, every other field
    (its own name, a tombstone's `deleted`) kept, expecting the revision it read; one WARNING each. An
    alias on a subject no name's is (unpadded base64) is left alone: nothing reads it by name."""
    unpadded = meta_subject("b", "alias").rstrip("=")

    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        chunks_before = {s: n for s, n in env.streams.subjects("OBJ_b").items() if ".C." in s}
        written: dict[str, tuple[dict, int]] = {}
        for subject, fields in {**ALIASES, unpadded: {"name": "alias2", "nuid": "*"}}.items():
            doc = json.loads(meta("b", fields["name"], fields))
            written[subject] = (doc, await env.streams.publish(subject, json.dumps(doc).encode(), {ROLLUP: "sub"}))
        await env.settle()
        await env.fs.mut.defuse_wildcard_nuids()
        await env.settle()
        for subject, (doc, seq) in written.items():
            msg = await env.streams.last_msg("OBJ_b", subject)
            now = json.loads(msg.data)
            if subject == unpadded:
                assert msg.seq == seq and now == doc
                continue
            assert msg.seq > seq and usable_nuid(now["nuid"]) and now["nuid"] not in chunks_before, subject
            assert {**now, "nuid": doc["nuid"]} == doc, subject
        assert await env.cat("b/w") == b""  # (shown from its alias, as before)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.lookup("b/y")  # (skipped here, as before)
        assert e.value.errno == errno.ENOENT
        # nats.go's Delete of x and s, and Put of x, s and t: only the fresh nuids are purged.
        await delete_object(env.streams, "b", "x")
        await delete_object(env.streams, "b", "s")
        for name in ("x", "s", "t"):
            await put_object(env.streams, "b", name, b"theirs")
        await env.settle()
        assert {s: n for s, n in env.streams.subjects("OBJ_b").items() if s in chunks_before} == chunks_before
        assert await env.cat("b/keep1") == b"one" * 1000
        assert await env.cat("b/keep2") == b"two" * 1000
        assert await env.cat("b/x") == b"theirs"

    caplog.set_level(logging.INFO, logger="natsfs")
    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
    lines = [r for r in caplog.records if "carried the nuid" in r.getMessage()]
    assert sorted((r.levelno, r.getMessage().split(" ")[5]) for r in lines) == \
        sorted((logging.WARNING, s) for s in ALIASES)
    assert "(named 'y', not the name that subject is for; skipped here, read by nats.go)" in lines[0].getMessage()
