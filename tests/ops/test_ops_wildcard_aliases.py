"""Aliases with a wildcard nuid on a subject nats.go's Put(X) and Delete(X) read (`adr20.alias_wildcard_nuid`),
rewritten in place (`ObjectStore.defuse_wildcard_alias`): what else must hold of that rewrite."""

from __future__ import annotations

import json

from opskit import Env
from test_ops_wildcard_nuids import bucket_with_objects, meta

from natsfs.adr20 import ROLLUP, usable_nuid

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
