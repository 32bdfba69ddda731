"""A bucket whose stream does not allow direct gets (`allow_direct` false: made by an older client or
server, or by hand), written and read by nats-py, through a real mount and through `JetStreams`.

The server answers every direct get on such a stream with "503 no responders" at once; the mount reads
its chunks with STREAM.MSG.GET instead, with every check a direct get's reply gets (docs/SEMANTICS.md,
"Buckets without direct gets")."""

from __future__ import annotations

import errno
import json
import os
import random
import re
from typing import Any

import pytest
import trio
from helpers import raw_put, with_nats
from test_integrity_reads import cat, chunk_reads, damage_lines, expected

from natsfs.adr20 import digest_of
from natsfs.bridge import Bridge
from natsfs.jetstream import JetStreams

CHUNK = 128 * 1024  # nats-py's ObjectStore chunk size
LOST = 3  # (as in test_integrity_reads, whose helpers read eight chunks with chunk LOST gone)


def create_stream_without_direct_gets(url: str, bucket: str) -> None:
    from nats.js.api import StreamConfig

    async def fn(nc: Any, js: Any) -> None:
        await js.add_stream(StreamConfig(name=f"OBJ_{bucket}", subjects=[f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"],
                                         allow_rollup_hdrs=True, allow_direct=False))
        assert (await js.stream_info(f"OBJ_{bucket}")).config.allow_direct is False

    with_nats(url, fn)


def nats_py_put_all(url: str, bucket: str, objects: dict[str, bytes]) -> dict[str, str]:
    """Put every object with nats-py's ObjectStore; name -> nuid."""

    async def fn(nc: Any, js: Any) -> dict[str, str]:
        obs = await js.object_store(bucket)
        return {name: (await obs.put(name, data)).nuid for name, data in objects.items()}

    return with_nats(url, fn)


def nats_py_get_all(url: str, bucket: str, names: list[str]) -> dict[str, bytes]:
    async def fn(nc: Any, js: Any) -> dict[str, bytes]:
        obs = await js.object_store(bucket)
        return {name: (await obs.get(name)).data for name in names}

    return with_nats(url, fn)


def chunk_sequences(url: str, bucket: str, nuid: str) -> list[int]:
    """The sequences of a nuid's chunks, found with STREAM.MSG.GET (direct gets are not answered)."""

    async def fn(nc: Any, js: Any) -> list[int]:
        seqs: list[int] = []
        while True:
            body = {"seq": seqs[-1] + 1 if seqs else 1, "next_by_subj": f"$O.{bucket}.C.{nuid}"}
            reply = json.loads((await nc.request(f"$JS.API.STREAM.MSG.GET.OBJ_{bucket}", json.dumps(body).encode(),
                                                 timeout=5)).data)
            if "message" not in reply:
                assert reply["error"]["err_code"] == 10037, reply
                return seqs
            seqs.append(reply["message"]["seq"])

    return with_nats(url, fn)


def delete_msg(url: str, bucket: str, seq: int) -> None:
    async def fn(nc: Any, js: Any) -> None:
        reply = await nc.request(f"$JS.API.STREAM.MSG.DELETE.OBJ_{bucket}", json.dumps({"seq": seq}).encode(),
                                 timeout=5)
        assert json.loads(reply.data).get("success") is True, reply.data

    with_nats(url, fn)


@pytest.mark.expect_log(r"broken\.bin .*1 of 8 chunks missing", r"lying\.bin .*digest mismatch")
def test_objects_of_a_bucket_without_direct_gets_read_through_the_mount(nats_url, bucket_name, mounter):
    rnd = random.Random(9)
    objects = {
        "multi.bin": rnd.randbytes(5 * CHUNK + 77),
        "far.bin": rnd.randbytes(6 * CHUNK + 5),  # read at a random offset first
        "small.txt": b"readable by nats.go and nats-py\n",
        "empty.bin": b"",
        "broken.bin": rnd.randbytes(8 * CHUNK - 777),
    }
    create_stream_without_direct_gets(nats_url, bucket_name)
    nuids = nats_py_put_all(nats_url, bucket_name, objects)
    lying = rnd.randbytes(2 * CHUNK + 1)  # a meta whose digest is not its bytes'
    raw_put(nats_url, bucket_name, "lying.bin", [lying[:CHUNK], lying[CHUNK : 2 * CHUNK], lying[2 * CHUNK :]],
            nuid="lying" + "L" * 17, meta_extra={"digest": digest_of(b"other bytes")})
    delete_msg(nats_url, bucket_name, chunk_sequences(nats_url, bucket_name, nuids["broken.bin"])[LOST])

    m = mounter(nats_url)
    root = m / bucket_name
    assert sorted(os.listdir(root)) == sorted([*objects, "lying.bin"])
    # A read at a random offset of a version read for the first time.
    with open(root / "far.bin", "rb") as f:
        f.seek(4 * CHUNK + 1234)
        assert f.read(50_000) == objects["far.bin"][4 * CHUNK + 1234 : 4 * CHUNK + 1234 + 50_000]
    for name in ("multi.bin", "far.bin", "small.txt", "empty.bin"):
        assert (root / name).read_bytes() == objects[name], name
    # A deleted chunk: EIO for the reads touching it, exact bytes elsewhere, one log line.
    assert chunk_reads(root / "broken.bin") == expected(objects["broken.bin"])
    got, err = cat(root / "broken.bin")
    assert err == errno.EIO and got == objects["broken.bin"][: len(got)]
    lines = damage_lines(m.log(), nuids["broken.bin"])
    assert len(lines) == 1 and "broken.bin" in lines[0], lines
    # The digest is checked as for any bucket.
    got, err = cat(root / "lying.bin")
    assert err == errno.EIO
    assert len(damage_lines(m.log(), "lying" + "L" * 17)) == 1
    # The cause is said once; the other clients still read the same objects.
    assert len(re.findall(r"does not allow direct gets", m.log())) == 1
    good = ["multi.bin", "far.bin", "small.txt", "empty.bin"]
    assert nats_py_get_all(nats_url, bucket_name, good) == {name: objects[name] for name in good}


def test_a_bucket_made_by_mkdir_allows_direct_gets(nats_url, bucket_name, mounter):
    m = mounter(nats_url)
    (m / bucket_name).mkdir()

    async def fn(nc: Any, js: Any) -> bool:
        return bool((await js.stream_info(f"OBJ_{bucket_name}")).config.allow_direct)

    assert with_nats(nats_url, fn) is True


def test_batched_gets_without_direct_gets_match_direct_gets(nats_url, bucket_name):
    """`JetStreams.get_batch` and `stream_batch` on a stream without direct gets return what direct gets
    return on one that has them (the same messages, subjects, sequences and bytes; no pending counts),
    with two objects' chunks interleaved, batch and byte limits, and a start inside the object."""
    rnd = random.Random(10)
    chunks = {"a": [rnd.randbytes(rnd.choice([1, 1000, CHUNK])) for _ in range(9)],
              "b": [rnd.randbytes(500) for _ in range(4)]}
    order = ["a", "a", "b", "a", "b", "b", "a", "a", "a", "a", "b", "a"]
    with_direct = bucket_name[:20] + "_direct"

    async def put(nc: Any, js: Any) -> None:
        from nats.js.api import StreamConfig

        for bucket, direct in ((bucket_name, False), (with_direct, True)):
            await js.add_stream(StreamConfig(name=f"OBJ_{bucket}", subjects=[f"$O.{bucket}.C.>"], allow_direct=direct))
            pos = {"a": 0, "b": 0}
            for nuid in order:
                await js.publish(f"$O.{bucket}.C.{nuid}", chunks[nuid][pos[nuid]])
                pos[nuid] += 1

    with_nats(nats_url, put)
    asks = [("a", 1, 100, 8 << 20), ("a", 1, 3, 8 << 20), ("a", 5, 100, 8 << 20), ("a", 1, 100, 2 * CHUNK),
            ("b", 3, 2, 8 << 20), ("b", 20, 5, 8 << 20), ("none", 1, 5, 8 << 20)]

    async def main() -> None:
        bridge = Bridge([nats_url])
        await bridge.connect()
        try:
            js = JetStreams(bridge)  # learns from the first 503 that the stream does not allow direct gets
            for nuid, start, batch, max_bytes in asks:
                got = {}
                for bucket in (bucket_name, with_direct):
                    stream, subject = f"OBJ_{bucket}", f"$O.{bucket}.C.{nuid}"
                    whole = await js.get_batch(stream, subject, start, batch, max_bytes)
                    batches = await js.stream_batch(stream, subject, start, batch, max_bytes)
                    streamed = []
                    while (msgs := await batches.next()) is not None:
                        streamed += msgs
                    await batches.close()
                    got[bucket] = [[(m.seq, m.subject.split(".")[-1], bytes(m.data)) for m in msgs]
                                   for msgs in (whole, streamed)]
                    pending = {m.pending for m in whole + streamed}
                    assert pending <= ({-1} if bucket == bucket_name else set(range(100))), (bucket, pending)
                assert got[bucket_name] == got[with_direct], (nuid, start, batch, max_bytes)
            assert js.no_direct == {f"OBJ_{bucket_name}"} and js.calls["msg_get"] > 0
        finally:
            await bridge.close()

    trio.run(main)
