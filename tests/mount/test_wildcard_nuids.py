"""Metas whose nuid is `*` or `>` (another client wrote them: a tombstone, a live meta, a link), seen by a
running mount, on a real server.

nats.go's Delete(name) and nats.js's put(name) purge the nuid they find under the name, tombstones
included: `$O.<bucket>.C.*`, every chunk of the bucket. The mount rewrites such a meta on a fresh nuid
(expecting the revision it read, every other field kept) as soon as it sees it, so those clients' delete
and put of the name purge nothing of the other objects. A live object reads as before (empty, or
`ESTALE`: it never had chunks it could read); a link keeps leading to its target. nats-py's own delete
and put do not read tombstones and purge nothing then.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import create_bucket, nats_py_get, nats_py_put, stored_layout, wait_for, with_nats
from test_fsck import fsck
from test_puts_integrity import _info_with_deleted, _meta_subject, go_delete, js_put

# name -> the fields another client wrote besides name and bucket (a wildcard nuid each).
WILD = {
    "victim": {"nuid": "*", "deleted": True},
    "empty": {"nuid": ">"},
    "unreadable": {"nuid": "*", "size": 5, "chunks": 1, "digest": "SHA-256=abc", "description": "kept"},
    "link": {"nuid": "*", "options": {"link": {"bucket": "{b}", "name": "keep1"}}},
}


def publish_wild(url: str, b: str) -> dict[str, tuple[dict, int]]:
    """Another client's metas of WILD in bucket `b`: name -> (the meta, its stream sequence)."""
    written = {name: json.loads(json.dumps({"name": name, "bucket": b, "size": 0, "chunks": 0,
                                            "mtime": "0001-01-01T00:00:00Z"} | fields).replace("{b}", b))
               for name, fields in WILD.items()}

    async def publish(nc, js):
        return {name: (doc, (await js.publish(_meta_subject(b, name), json.dumps(doc).encode(),
                                              headers={"Nats-Rollup": "sub"})).seq) for name, doc in written.items()}

    return with_nats(url, publish)


def meta(url: str, b: str, name: str) -> dict:
    return with_nats(url, lambda nc, js: _info_with_deleted(nc, b, name))


def check_rewritten(url: str, b: str, wild: dict[str, tuple[dict, int]]) -> None:
    """Each meta of `wild` is rewritten on a fresh nuid (a newer revision), every other field kept."""

    async def meta_seq(nc, js, name):
        return (await js.get_last_msg(f"OBJ_{b}", _meta_subject(b, name))).seq

    for name, (doc, seq) in wild.items():
        after = meta(url, b, name)
        assert re.fullmatch(r"[A-Za-z0-9_-]+", after["nuid"]), name
        assert with_nats(url, lambda nc, js, name=name: meta_seq(nc, js, name)) > seq
        if doc.get("deleted"):
            assert after["deleted"] is True and (after["size"], after["chunks"]) == (0, 0) and after["name"] == name
        else:  # every other field kept
            assert {**after, "nuid": doc["nuid"]} == doc, name


def other_clients_delete_and_put(url: str, b: str, names: list[str]) -> None:
    """nats.go's Delete and nats.js's put of every name, then nats-py's put and delete of one."""
    for name in names:
        assert go_delete(url, b, name)
        js_put(url, b, name, b"theirs")
    nats_py_put(url, b, names[0], b"nats-py", create=False)

    async def py_delete(nc, js):
        await (await js.object_store(b)).delete(names[0])

    with_nats(url, py_delete)


def test_the_mount_rewrites_wildcard_nuids_before_other_clients_purge_every_chunk(nats_url, bucket_name, mounter):
    b = bucket_name
    create_bucket(nats_url, b)
    m = mounter(nats_url)
    data = {"keep1": b"one" * 100_000, "keep2": b"two" * 50_000}
    for name, payload in data.items():
        (m.path / b / name).write_bytes(payload)
    before = {name: stored_layout(nats_url, b, name) for name in data}
    assert all(v["stored_digest_ok"] and v["stored_chunks"] == v["chunks"] > 0 for v in before.values())
    wild = publish_wild(nats_url, b)
    for name in wild:
        assert wait_for(lambda name=name: re.fullmatch(r"[A-Za-z0-9_-]+", meta(nats_url, b, name)["nuid"]),
                        timeout=30), name
    check_rewritten(nats_url, b, wild)
    # Through the mount: the live ones read as before, the link leads to keep1.
    assert wait_for(lambda: os.path.exists(m.path / b / "empty"), timeout=30)
    assert (m.path / b / "empty").read_bytes() == b""
    with pytest.raises(OSError) as e:
        (m.path / b / "unreadable").read_bytes()
    assert e.value.errno == errno.ESTALE
    assert os.readlink(m.path / b / "link") == f"../{b}/keep1"
    assert (m.path / b / "link").read_bytes() == data["keep1"]
    other_clients_delete_and_put(nats_url, b, list(wild))
    for name, payload in data.items():
        now = stored_layout(nats_url, b, name)
        assert now["seqs"] == before[name]["seqs"] and now["stored_digest_ok"]
        assert nats_py_get(nats_url, b, name) == payload
        assert (m.path / b / name).read_bytes() == payload
    log = m.log()
    for name, (doc, _) in wild.items():
        warnings = re.findall(rf"WARNING natsfs\.mutations: bucket \S+: the \w+ '{name}' carried the nuid "
                              rf"'{re.escape(doc['nuid'])}'", log)
        assert len(warnings) == 1, name


def test_fsck_repair_rewrites_wildcard_nuids_as_the_mount_does(nats_url, bucket_name):
    """No mount: `natsfs fsck` reports each meta with a wildcard nuid, `--repair` rewrites it on a fresh
    nuid as a mount would, and other clients' delete and put of those names purge nothing else."""
    b = bucket_name
    create_bucket(nats_url, b)
    data = {"keep1": b"one" * 100_000, "keep2": b"two" * 50_000}
    for name, payload in data.items():
        nats_py_put(nats_url, b, name, payload, create=False)
    before = {name: stored_layout(nats_url, b, name) for name in data}
    wild = publish_wild(nats_url, b)
    checked = fsck(nats_url, b)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    for name in wild:
        assert re.search(rf"^(tombstone sharing a live nuid|live meta with a wildcard nuid): {name}: ",
                         checked.stdout, re.M), (name, checked.stdout)
    repaired = fsck(nats_url, b, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert repaired.stdout.count("[repaired]") == len(wild)
    check_rewritten(nats_url, b, wild)
    other_clients_delete_and_put(nats_url, b, list(wild))
    for name, payload in data.items():
        now = stored_layout(nats_url, b, name)
        assert now["seqs"] == before[name]["seqs"] and now["stored_digest_ok"]
        assert nats_py_get(nats_url, b, name) == payload


# `natsfs fsck` in a process of its own that, once it has read the metas twice and is about to repair,
# says so (the file `ready`) and waits for the file `go` (at most a minute): what a mount does meanwhile
# lands exactly between fsck's check and its repair.
PAUSED_FSCK = """
import pathlib, runpy, sys, trio
from natsfs.adr20 import ObjectStore
here = pathlib.Path(sys.argv[1])
defuse = ObjectStore.defuse_wildcard_nuid

async def paused(self, *args, **kwargs):
    (here / "ready").touch()
    with trio.fail_after(60):
        while not (here / "go").exists():
            await trio.sleep(0.05)
    return await defuse(self, *args, **kwargs)

ObjectStore.defuse_wildcard_nuid = paused
sys.argv = ["natsfs", *sys.argv[2:]]
runpy.run_module("natsfs", run_name="__main__")
"""


def test_fsck_repair_racing_a_mounts_rewrite_of_the_same_name_counts_it_repaired(nats_url, bucket_name, mounter,
                                                                                 tmp_path):
    """fsck --repair found the wildcard nuids, then a mount rewrote them before fsck's own rewrite: fsck's
    rewrite (expecting the revision it read) is refused, and reading the names back it finds the same
    metas on fresh nuids: repaired (by the mount), not "changed since it was read", exit 0."""
    b = bucket_name
    create_bucket(nats_url, b)
    nats_py_put(nats_url, b, "keep1", b"one" * 100_000, create=False)
    wild = publish_wild(nats_url, b)
    fsck_proc = subprocess.Popen([sys.executable, "-c", PAUSED_FSCK, str(tmp_path), "fsck", b, "--server", nats_url,
                                  "--repair"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (tmp_path / "ready").exists() or fsck_proc.poll() is not None, timeout=60)
        assert fsck_proc.poll() is None, fsck_proc.communicate()
        m = mounter(nats_url)
        assert "keep1" in os.listdir(m.path / b)  # (the bucket's index is loaded: its rewrites start)
        for name in wild:
            assert wait_for(lambda name=name: re.fullmatch(r"[A-Za-z0-9_-]+", meta(nats_url, b, name)["nuid"]),
                            timeout=30), name
        (tmp_path / "go").touch()
        out, err = fsck_proc.communicate(timeout=120)
    finally:
        if fsck_proc.poll() is None:
            fsck_proc.kill()
            fsck_proc.communicate()
    assert fsck_proc.returncode == 0, out + err
    assert "changed since it was read" not in out
    assert out.count("[repaired]") == len(wild), out
    check_rewritten(nats_url, b, wild)
