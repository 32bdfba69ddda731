"""A tombstone whose nuid is `*` or `>` (another client wrote it) is rewritten by the mount on a fresh nuid
that holds no chunks, expecting the revision it read: nats.go's Delete and nats.js's put of that name
purge the nuid they find there, and `$O.<bucket>.C.*` is every chunk of the bucket. One WARNING per name.
(A real server's purge by that filter, with nats.go's and nats.js's steps, is in
tests/mount/test_wildcard_tombstones.py; MemoryStreams refuses such a purge.)"""

from __future__ import annotations

import json
import logging

import trio
from gowriters import put_object
from opskit import Env

from natsfs.adr20 import ROLLUP, ObjectStore, meta_subject, usable_nuid
from natsfs.memstreams import MemoryStreams


def tombstone(bucket: str, name: str, nuid: str) -> bytes:
    return json.dumps({"name": name, "bucket": bucket, "nuid": nuid, "size": 0, "chunks": 0,
                       "mtime": "0001-01-01T00:00:00Z", "deleted": True}).encode()


async def bucket_with_objects(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "keep1", b"one" * 1000)
    await put_object(ms, "b", "keep2", b"two" * 1000)


async def meta_of(env: Env, name: str) -> tuple[dict, int]:
    msg = await env.streams.last_msg("OBJ_b", meta_subject("b", name))
    assert msg is not None
    return json.loads(msg.data), msg.seq


async def rewritten(env: Env, name: str) -> dict:
    """The meta of `name` once the mount rewrote its tombstone (a bounded wait for that outcome)."""
    with trio.fail_after(30):
        while True:
            doc, _ = await meta_of(env, name)
            if doc.get("nuid") not in ("*", ">"):
                return doc
            await trio.sleep(0.05)


def test_a_wildcard_tombstone_is_rewritten_on_a_fresh_nuid_once_seen(ops_env, caplog):
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        chunks_before = env.streams.subjects("OBJ_b")
        for name, nuid in (("victim", "*"), ("other", ">")):
            await env.streams.publish(meta_subject("b", name), tombstone("b", name, nuid), {ROLLUP: "sub"})
        for name in ("victim", "other"):
            doc = await rewritten(env, name)
            assert doc["deleted"] is True and usable_nuid(doc["nuid"]) and (doc["size"], doc["chunks"]) == (0, 0)
            assert doc["name"] == name and doc["bucket"] == "b"
        # Nothing else changed: every chunk is there, the objects read whole, the names stay deleted.
        assert {s: n for s, n in env.streams.subjects("OBJ_b").items() if ".C." in s} == \
            {s: n for s, n in chunks_before.items() if ".C." in s}
        assert await env.cat("b/keep1") == b"one" * 1000
        assert await env.cat("b/keep2") == b"two" * 1000
        # Another client's wildcard tombstone of the same name again: rewritten again, logged at INFO.
        await env.streams.publish(meta_subject("b", "victim"), tombstone("b", "victim", "*"), {ROLLUP: "sub"})
        await rewritten(env, "victim")

    caplog.set_level(logging.INFO, logger="natsfs")
    ops_env(body, setup=bucket_with_objects, settle_interval=0.05)
    lines = [r for r in caplog.records if "carried the nuid" in r.getMessage()]
    warnings = sorted(r.getMessage().split("'")[1] for r in lines if r.levelno == logging.WARNING)
    assert warnings == ["other", "victim"]
    assert len([r for r in lines if r.levelno == logging.INFO]) == 1


def test_a_wildcard_tombstone_changed_meanwhile_is_left_as_it_is_now(ops_env):
    """The rewrite expects the revision read: another client's meta stored since stays."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await env.streams.publish(meta_subject("b", "victim"), tombstone("b", "victim", "*"), {ROLLUP: "sub"})
        await env.settle()
        index = env.ns.loaded_index("b")
        assert index is not None
        revision = index.wildcard_tombstones["victim"][0]
        await put_object(env.streams, "b", "victim", b"theirs")
        assert await env.store.defuse_tombstone("b", "victim", revision) is None
        doc, seq = await meta_of(env, "victim")
        assert not doc.get("deleted") and seq > revision
        await env.fs.mut.defuse_wildcard_tombstones()
        await env.settle()
        assert await env.cat("b/victim") == b"theirs"
        assert not index.wildcard_tombstones

    ops_env(body, setup=bucket_with_objects)


def test_a_read_only_bucket_keeps_its_wildcard_tombstone(ops_env):
    async def body(env: Env) -> None:
        await env.streams.publish(meta_subject("b", "victim"), tombstone("b", "victim", "*"), {ROLLUP: "sub"})
        await env.store.seal_bucket("b")
        await env.lookup("b/keep1")
        await env.settle()
        await env.fs.mut.defuse_wildcard_tombstones()
        doc, _ = await meta_of(env, "victim")
        assert doc["nuid"] == "*"

    ops_env(body, setup=bucket_with_objects)
