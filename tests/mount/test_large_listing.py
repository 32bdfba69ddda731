"""Listings of many subjects (`JetStreams.subject_counts` with a wildcard filter: the watcher's
reconciliation over `$O.<b>.M.>`, fsck's chunk subjects `$O.<b>.C.>`) against a server with a 2 MB
`max_pending`: the server answers `STREAM.INFO` with a subjects filter in one reply of up to 100 000
subjects (4.4 MB for 100 000 metas named like `dir/file-000001.parquet`), which it drops the main
connection for as a slow consumer, however fast the daemon reads. Such listings are made by a
byte-bounded headers-only scan instead: no kick, and what they find is right."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import subprocess
import sys
from typing import Any

import pytest
from helpers import create_bucket, wait_for, with_nats
from test_transport import KICKABLE, own_server

from natsfs.adr20 import meta_doc, meta_json

OBJECTS = 100_000
CHUNKED = 30_000
EMPTY_DIGEST = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(b"").digest()).decode()
ABC_DIGEST = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(b"abc").digest()).decode()


def name_of(i: int) -> str:
    return f"dir/file-{i:06d}.parquet"


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M." + base64.urlsafe_b64encode(name.encode()).decode()


def load(url: str, bucket: str, objects: int, *, with_chunks: bool) -> None:
    """Objects, published without waiting for acks: empty ones, or of one 3-byte chunk each (their nuids
    of 64 characters: 30 000 chunk subjects are 2.4 MB as one listing)."""

    async def fn(nc: Any, js: Any) -> None:
        for i in range(objects):
            nuid = secrets.token_hex(32 if with_chunks else 11)
            name = name_of(i)
            if with_chunks:
                doc = meta_doc(name=name, bucket=bucket, nuid=nuid, size=3, chunks=1, digest=ABC_DIGEST)
                await nc.publish(f"$O.{bucket}.C.{nuid}", b"abc")
            else:
                doc = meta_doc(name=name, bucket=bucket, nuid=nuid, size=0, chunks=0, digest=EMPTY_DIGEST)
            await nc.publish(meta_subject(bucket, name), meta_json(doc), headers={"Nats-Rollup": "sub"})
            if i % 5000 == 4999:
                await nc.flush()
        await nc.flush()

    with_nats(url, fn)

    async def stored(nc: Any, js: Any) -> int:
        return (await js.stream_info(f"OBJ_{bucket}")).state.messages

    want = objects * (2 if with_chunks else 1)
    assert wait_for(lambda: with_nats(url, stored) == want, timeout=120)


@pytest.fixture
def small_pending(tmp_path):
    server = own_server(tmp_path, KICKABLE)
    try:
        yield server
    finally:
        server.stop()


def slow_consumers(server: Any) -> list[str]:
    return [line for line in server.log_file.read_text(errors="replace").splitlines() if "Slow Consumer" in line]


def test_a_forced_listing_of_many_metas_does_not_get_the_daemon_dropped(small_pending, mounter):
    """100 000 metas, a mount that has them all, then one meta subject purged behind the watch's back
    (a raw STREAM.PURGE of that subject: the watch sees nothing, the meta subject count differs from the
    index's): the reconciliation lists the meta subjects, the purged name leaves the mount, and the
    server never drops the daemon's connection (4.4 MB in one reply before)."""
    url, b = small_pending.url, "big"
    create_bucket(url, b)
    load(url, b, OBJECTS, with_chunks=False)
    m = mounter(url)
    last = m.path / b / name_of(OBJECTS - 1)
    assert wait_for(last.exists, timeout=180)  # (the snapshot comes in order: all of them are there)
    gone = name_of(OBJECTS // 2)
    assert (m.path / b / gone).exists()

    async def purge(nc: Any, js: Any) -> None:
        r = await nc.request(f"$JS.API.STREAM.PURGE.OBJ_{b}", json.dumps({"filter": meta_subject(b, gone)}).encode(),
                             timeout=10)
        assert json.loads(r.data).get("purged") == 1, r.data

    with_nats(url, purge)
    assert wait_for(lambda: gone.split("/")[1] not in os.listdir(m.path / b / "dir"), timeout=120, interval=1.0)
    assert (m.path / b / name_of(OBJECTS // 2 + 1)).exists()
    assert not slow_consumers(small_pending)
    log = m.log()
    assert "lost the connection" not in log
    assert f"the meta of {gone!r} was purged by another client" in log


def test_fsck_of_a_bucket_of_many_chunk_subjects_is_clean_without_a_drop(small_pending):
    """fsck of a bucket of 30 000 one-chunk objects (as many chunk subjects, 2.4 MB as one listing)
    against the 2 MB `max_pending` server: clean, no slow consumer."""
    url, b = small_pending.url, "chunky"
    create_bucket(url, b)
    load(url, b, CHUNKED, with_chunks=True)
    r = subprocess.run([sys.executable, "-m", "natsfs", "fsck", b, "--server", url],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert f"{CHUNKED} objects, 0 tombstones, {CHUNKED} chunk subjects: clean" in r.stdout, r.stdout[-3000:]
    assert not slow_consumers(small_pending)
    assert "lost the connection" not in r.stderr


@pytest.mark.parametrize("reads", ["lean_reads_off", "trio_reads_off"])
def test_a_scanned_listing_over_the_main_connection_is_complete_without_a_drop(small_pending, reads):
    """Without a lean connection of the trio thread (lean reads turned off: reads go through nats-py;
    or that connection driven by the asyncio thread), `subject_counts` of 20 000 metas (2 MB as one
    listing) scans over the main connection (`_ordered_scan`): every subject counted once, complete,
    and the 2 MB `max_pending` server never drops the connection."""
    import trio

    from natsfs.bridge import Bridge
    from natsfs.jetstream import JetStreams

    url, b, objects = small_pending.url, "scanned", 20_000
    create_bucket(url, b)
    load(url, b, objects, with_chunks=False)

    async def main() -> tuple[dict[str, int], bool, dict[str, int]]:
        bridge = Bridge([url], request_timeout=5, lean_reads=reads != "lean_reads_off",
                        trio_reads=reads != "trio_reads_off")
        await bridge.connect()
        try:
            assert not bridge.reads_in_trio
            js = JetStreams(bridge)
            counts, last_seq, complete = await js.subject_counts(f"OBJ_{b}", f"$O.{b}.M.>")
            assert last_seq == objects
            return counts, complete, dict(js.calls)
        finally:
            await bridge.close()

    counts, complete, calls = trio.run(main)
    assert counts == {meta_subject(b, name_of(i)): 1 for i in range(objects)}
    assert complete
    assert calls.get("subject_scans") == 1 and calls.get("ordered_scans") == 1, calls
    assert not calls.get("lean_scans") and not calls.get("subject_listings"), calls
    assert not slow_consumers(small_pending)
