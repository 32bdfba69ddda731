"""Aliases with a wildcard nuid on a subject nats.go's Put(X) and Delete(X) read (`adr20.alias_wildcard_nuid`),
rewritten in place (`ObjectStore.defuse_wildcard_alias`): what else must hold of that rewrite."""

from __future__ import annotations

import json

import pytest
from opskit import Ctx, Env, Fields
from test_ops_wildcard_nuids import bucket_with_objects, meta, meta_of
from test_ops_wildcard_rewrite_races import before

from natsfs.adr20 import ROLLUP, ObjectStore, meta_subject, usable_nuid

SUBJECT = "$O.b.M.__4="  # (Go's name b"\xff\xfe": no UTF-8 name's, so the meta shows here as its own name, w)


def test_an_alias_near_the_meta_size_limit_is_rewritten_too(ops_env):
    """The fresh nuid is longer than `*`: the in-place rewrite grows the alias by a few bytes, which must not
    hold it back (refused as over --max-meta-bytes, retried every pass, forever) when it is just under."""
    limit = 4096

    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        for named, fields in (("w", {"nuid": "*", "description": ""}),
                              ("y", {"nuid": "*", "description": "", "size": 5})):  # (y: skipped here)
            subject = SUBJECT if named == "w" else "$O.b.M.eA=="
            fields["description"] = "d" * (limit - len(meta("b", named, fields)) - 2)
            data = meta("b", named, fields)
            assert limit - 10 < len(data) <= limit
            await env.streams.publish(subject, data, {ROLLUP: "sub"})
        await env.settle()
        await env.fs.mut.defuse_wildcard_nuids()
        for subject in (SUBJECT, "$O.b.M.eA=="):
            msg = await env.streams.last_msg("OBJ_b", subject)
            doc = json.loads(msg.data)
            assert usable_nuid(doc["nuid"]) and len(msg.data) > limit, subject  # (rewritten, grown past the limit)
            assert doc["description"] == "d" * len(doc["description"]), subject

    ops_env(body, setup=bucket_with_objects, settle_interval=3600, max_meta_bytes=limit)


@pytest.mark.parametrize("op", ["chmod", "rename", "unlink"])
def test_a_change_of_a_name_shown_from_an_alias_whose_wildcard_nuid_is_rewritten_meanwhile_is_done(ops_env, op):
    """w is shown from an alias (its subject's token is no UTF-8 name's), with the nuid `*`: another mount
    (or `fsck --repair`) rewrites that alias in place between this mount's read of w and its move of w to
    w's canonical subject (`Mutations._on_canonical`, which expects the revision read). That rewrite changed
    nothing but the nuid: the change is done all the same (not ESTALE), on the fresh nuid."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await env.streams.publish(SUBJECT, meta("b", "w", {"nuid": "*", "description": "kept"}), {ROLLUP: "sub"})
        await env.settle()
        attr = await env.lookup("b/w")

        async def rewrite() -> None:
            msg = await env.streams.last_msg("OBJ_b", SUBJECT)
            assert await ObjectStore(env.streams).defuse_wildcard_alias("b", SUBJECT, msg.seq) is not None

        before(env, "adopt_alias", lambda *a, **k: True, rewrite)
        b = (await env.lookup("b")).st_ino
        if op == "chmod":
            attr.st_mode = (attr.st_mode & ~0o777) | 0o600
            await env.ops.setattr(attr.st_ino, attr, Fields(update_mode=True), None, Ctx())
        elif op == "rename":
            await env.ops.rename(b, b"w", b, b"moved", 0, Ctx())
        else:
            await env.ops.unlink(b, b"w", Ctx())
        await env.settle()
        names = (await env.listdir(b)).names
        if op == "chmod":
            assert (await env.lookup("b/w")).st_mode & 0o777 == 0o600
            doc, _ = await meta_of(env, "w")
            assert usable_nuid(doc["nuid"]) and doc["description"] == "kept"
        elif op == "rename":
            assert "moved" in names and "w" not in names
            doc, _ = await meta_of(env, "moved")
            assert usable_nuid(doc["nuid"]) and doc["description"] == "kept"
        else:
            assert "w" not in names
        for subject in (SUBJECT, meta_subject("b", "w")):
            msg = await env.streams.last_msg("OBJ_b", subject)
            assert msg is None or usable_nuid(json.loads(msg.data)["nuid"]), subject
        assert await env.cat("b/keep1") == b"one" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
