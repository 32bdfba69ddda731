"""A tombstone whose nuid is `*` (another client wrote it), seen by a running mount, on a real server.

nats.go's Delete(name) and nats.js's put(name) purge the nuid they find under the name, tombstones
included: `$O.<bucket>.C.*`, every chunk of the bucket. The mount rewrites such a tombstone on a fresh nuid
(expecting the revision it read) as soon as it sees it, so those clients' delete and put of the name purge
nothing of the other objects. nats-py's own delete and put do not read tombstones and purge nothing then.
"""

from __future__ import annotations

import json
import re

from helpers import create_bucket, nats_py_get, nats_py_put, stored_layout, wait_for, with_nats
from test_puts_integrity import _info_with_deleted, _meta_subject, go_delete, js_put


def test_the_mount_rewrites_a_wildcard_tombstone_before_other_clients_purge_every_chunk(
        nats_url, bucket_name, mounter):
    b = bucket_name
    create_bucket(nats_url, b)
    m = mounter(nats_url)
    data = {"keep1": b"one" * 100_000, "keep2": b"two" * 50_000}
    for name, payload in data.items():
        (m.path / b / name).write_bytes(payload)
    before = {name: stored_layout(nats_url, b, name) for name in data}
    assert all(v["stored_digest_ok"] and v["stored_chunks"] == v["chunks"] > 0 for v in before.values())

    async def publish_tombstone(nc, js):
        doc = {"name": "victim", "bucket": b, "nuid": "*", "size": 0, "chunks": 0,
               "mtime": "0001-01-01T00:00:00Z", "deleted": True}
        return (await js.publish(_meta_subject(b, "victim"), json.dumps(doc).encode(),
                                 headers={"Nats-Rollup": "sub"})).seq

    seq = with_nats(nats_url, publish_tombstone)

    def meta():
        return with_nats(nats_url, lambda nc, js: _info_with_deleted(nc, b, "victim"))

    assert wait_for(lambda: meta()["nuid"] != "*", timeout=30)
    after = meta()
    assert after["deleted"] is True and re.fullmatch(r"[A-Za-z0-9_-]+", after["nuid"])
    assert (after["size"], after["chunks"]) == (0, 0) and after["name"] == "victim"

    async def meta_seq(nc, js):
        return (await js.get_last_msg(f"OBJ_{b}", _meta_subject(b, "victim"))).seq

    assert with_nats(nats_url, meta_seq) > seq
    # nats.go's Delete and nats.js's put of the name, then nats-py's: nothing of the others is purged.
    assert go_delete(nats_url, b, "victim")
    js_put(nats_url, b, "victim", b"theirs")
    nats_py_put(nats_url, b, "victim", b"nats-py", create=False)

    async def py_delete(nc, js):
        await (await js.object_store(b)).delete("victim")

    with_nats(nats_url, py_delete)
    for name, payload in data.items():
        now = stored_layout(nats_url, b, name)
        assert now["seqs"] == before[name]["seqs"] and now["stored_digest_ok"]
        assert nats_py_get(nats_url, b, name) == payload
        assert (m.path / b / name).read_bytes() == payload
    warnings = re.findall(r"WARNING natsfs\.mutations: bucket \S+: the tombstone of 'victim' carried the nuid '\*'",
                          m.log())
    assert len(warnings) == 1
