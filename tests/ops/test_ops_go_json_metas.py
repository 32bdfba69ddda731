"""Metas another client wrote with keys nats.go's encoding/json reads differently from Python's json.loads:
`{"nuid":"abc","NUID":"*"}` is nuid `*` to nats.go (keys match fields case-insensitively, the last one
wins). The mount reads it as nats.go does, so it rewrites such a meta on a fresh nuid (nats.go's Delete of
that name would purge `$O.<bucket>.C.*`, every chunk of the bucket), and a rewrite stores canonical keys
only (no `NUID` left for nats.go to read instead)."""

from __future__ import annotations

import json
from typing import Any

from gowriters import delete_object, put_object
from opskit import Ctx, Env

from natsfs.adr20 import ROLLUP, ObjectStore, load_meta, meta_subject, usable_nuid
from natsfs.memstreams import MemoryStreams


def raw_meta(name: str, *members: tuple[str, Any]) -> bytes:
    """A meta as another client may write it: members in this order, duplicates and case variants kept."""
    fields = [("name", name), ("bucket", "b"), ("size", 0), ("chunks", 0), ("mtime", "0001-01-01T00:00:00Z"),
              *members]
    return ("{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in fields) + "}").encode()


# name -> the members after the common ones: nats.go reads each nuid as `*`.
HOSTILE: dict[str, list[tuple[str, Any]]] = {
    "live": [("nuid", "abcdef"), ("Description", "kept"), ("NUID", "*")],
    "nulled": [("nuid", "*"), ("nuid", None)],  # (null leaves a string field as it was)
    "tomb": [("nuid", "abcdef"), ("deleted", True), ("Nuid", ">")],
    "deleted-case": [("nuid", "abcdef"), ("Deleted", True), ("nUID", "*")],
}


async def bucket_with_objects(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "keep1", b"one" * 1000)
    await put_object(ms, "b", "keep2", b"two" * 1000)


async def stored(env: Env, name: str) -> tuple[bytes, dict[str, Any]]:
    msg = await env.streams.last_msg("OBJ_b", meta_subject("b", name))
    assert msg is not None
    return bytes(msg.data), load_meta(msg.data)[0]


def test_a_case_variant_wildcard_nuid_is_defused_and_go_deletes_only_the_fresh_nuid(ops_env):
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        chunks_before = {s: n for s, n in env.streams.subjects("OBJ_b").items() if ".C." in s}
        for name, members in HOSTILE.items():
            await env.streams.publish(meta_subject("b", name), raw_meta(name, *members), {ROLLUP: "sub"})
            assert load_meta(raw_meta(name, *members))[0]["nuid"] in ("*", ">")  # what nats.go reads
        await env.settle()
        index = env.ns.loaded_index("b")
        assert index is not None and set(index.wildcard_nuids) == set(HOSTILE)
        await env.fs.mut.defuse_wildcard_nuids()
        await env.settle()
        for name in HOSTILE:
            data, doc = await stored(env, name)
            assert usable_nuid(doc["nuid"]) and doc["nuid"] not in chunks_before, name
            # Canonical keys only: nats.go, nats.js and Python all read the same nuid.
            assert json.loads(data)["nuid"] == doc["nuid"]
            assert not [k for k in json.loads(data) if k != k.lower()], data
        assert (await stored(env, "live"))[1]["description"] == "kept"
        assert (await stored(env, "deleted-case"))[1]["deleted"] is True
        assert await env.cat("b/live") == b"" and await env.cat("b/nulled") == b""
        # nats.go's Delete of the live names (reading them as encoding/json does) purges only fresh nuids.
        for name in ("live", "nulled"):
            await delete_object(env.streams, "b", name)
        await env.settle()
        assert {s: n for s, n in env.streams.subjects("OBJ_b").items() if s in chunks_before} == chunks_before
        assert await env.cat("b/keep1") == b"one" * 1000
        assert await env.cat("b/keep2") == b"two" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)  # (rewritten only when called here)


def test_a_rewrite_of_a_meta_with_case_variant_keys_stores_what_nats_go_read(ops_env):
    """`Description` after `description`: nats.go reads the second, so does the mount, and a chmod stores
    that one under the canonical key, the variant gone."""
    async def body(env: Env) -> None:
        info = await put_object(env.streams, "b", "var", b"data")
        members = [("nuid", info.nuid), ("size", 4), ("chunks", 1), ("digest", info.digest),
                   ("description", "old"), ("Description", "new"), ("METADATA", {"k": "v"})]
        await env.streams.publish(meta_subject("b", "var"), raw_meta("var", *members), {ROLLUP: "sub"})
        await env.settle()
        await env.ops.setxattr((await env.lookup("b/var")).st_ino, b"user.x", b"y", Ctx())
        await env.settle()
        data, doc = await stored(env, "var")
        assert json.loads(data) == doc
        assert (doc["description"], doc["metadata"]["k"], doc["nuid"]) == ("new", "v", info.nuid)
        assert await env.cat("b/var") == b"data"

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
