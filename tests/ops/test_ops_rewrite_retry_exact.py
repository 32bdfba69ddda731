"""A rename is done all the same when the only change since it read its source or target is the rewrite of
a wildcard nuid (`Mutations._rewritten_since`); never when another client really changed either name:
a meta with anything else changed (a header, a description, the meta's own mtime, user metadata), or a
target's meta changed keeping its nuid (nats.go's UpdateMeta, another mount's chmod), stays a conflict
(`ESTALE`), and the other client's meta is left as it is."""

from __future__ import annotations

import errno
import json
import os
from typing import Any

import pyfuse3
import pytest
from opskit import Ctx, Env
from test_ops_wildcard_nuids import bucket_with_objects, meta, meta_of
from test_ops_wildcard_rewrite_races import before, publish

from natsfs.adr20 import ROLLUP, meta_subject

EMPTY = "SHA-256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU="
# The source: an empty object another client wrote with the nuid `*`.
SOURCE = {"nuid": "*", "digest": EMPTY, "description": "mine", "headers": {"A": ["1"]}}
# What another client stores under the source's name meanwhile (a Put of the same empty bytes): the same
# size, chunks and digest on a fresh nuid, something else changed.
CHANGES: dict[str, dict[str, Any]] = {
    "description": {"description": "theirs"},
    "headers": {"headers": {"A": ["2"]}},
    "mtime": {"mtime": "2031-01-01T00:00:00Z"},
    "metadata": {"metadata": {"k": "v"}},
    "dup-key": {"Description": "theirs"},  # (Go reads a later case variant of a key as that field)
}


async def rename_fails_estale(env: Env, old: bytes, new: bytes) -> None:
    b = (await env.lookup("b")).st_ino
    with pytest.raises(pyfuse3.FUSEError) as e:
        await env.ops.rename(b, old, b, new, 0, Ctx())
    assert e.value.errno == errno.ESTALE


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_rename_whose_source_another_client_changed_is_refused_even_off_its_wildcard_nuid(ops_env, change):

    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish(env, "src", SOURCE)
        await env.settle()

        async def their_put() -> None:
            doc = json.loads(meta("b", "src", SOURCE | {"nuid": "Theirs0000000000000000"}))
            text = json.dumps(doc)[:-1] + ", " + json.dumps(CHANGES[change])[1:]
            await env.streams.publish(meta_subject("b", "src"), text.encode(), {ROLLUP: "sub"})

        before(env, "rename", lambda *a, **k: True, their_put)
        await rename_fails_estale(env, b"src", b"moved")
        doc, _ = await meta_of(env, "src")
        assert doc["nuid"] == "Theirs0000000000000000" and not doc.get("deleted")
        assert (await env.streams.last_msg("OBJ_b", meta_subject("b", "moved"))) is None or \
            (await meta_of(env, "moved"))[0].get("deleted") is True

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


def test_a_rename_over_a_target_another_client_changed_keeping_its_nuid_is_refused(ops_env):
    """No wildcard anywhere: keep1's meta changed by another client (UpdateMeta: same nuid, size, digest)
    after the mount read it. The rename over it is refused, keep1 stays theirs."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await env.lookup("b/keep2")

        async def their_update() -> None:
            doc, _ = await meta_of(env, "keep1")
            doc["description"] = "theirs"
            await env.streams.publish(meta_subject("b", "keep1"), json.dumps(doc).encode(), {ROLLUP: "sub"})

        before(env, "rename", lambda *a, **k: True, their_update)
        await rename_fails_estale(env, b"keep2", b"keep1")
        doc, _ = await meta_of(env, "keep1")
        assert doc["description"] == "theirs"
        assert await env.cat("b/keep1") == b"one" * 1000
        assert await env.cat("b/keep2") == b"two" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_close_over_another_clients_version_of_the_same_bytes_is_a_conflict(ops_env, change):
    """A file opened for writing at a meta with the nuid `*`: another client then stores its own version
    of the same (empty) bytes on a fresh nuid, something else changed. That is no rewrite of the wildcard
    nuid: the close is a conflict (`ESTALE`), their version stays."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish(env, "src", SOURCE)
        await env.settle()
        fi = await env.ops.open((await env.lookup("b/src")).st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"mine")
        doc = json.loads(meta("b", "src", SOURCE | {"nuid": "Theirs0000000000000000"}))
        text = json.dumps(doc)[:-1] + ", " + json.dumps(CHANGES[change])[1:]
        await env.streams.publish(meta_subject("b", "src"), text.encode(), {ROLLUP: "sub"})
        await env.settle()
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.ops.flush(fi.fh)
        assert e.value.errno == errno.ESTALE
        await env.ops.release(fi.fh)
        assert (await meta_of(env, "src"))[0]["nuid"] == "Theirs0000000000000000"

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
