"""Reading a damaged object through a real mount: another client deletes one chunk message.

The mount must give EIO for the reads that touch the lost chunk, exact bytes for every other chunk,
never bytes from another offset, and one log line for the version (issue 8, point 1 and 7). Also metas
of other clients that claim chunks never stored, or name another object's nuid with other claims.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import create_bucket, raw_put, with_nats, with_store

CHUNK = 128 * 1024
CHUNKS = 8
LOST = 3


def put_eight_chunks(url: str, bucket: str, name: str) -> tuple[bytes, str]:
    """An 8-chunk object written by another client after a small one (so the stream sequences before
    its first chunk hold other messages); returns its bytes and nuid."""
    create_bucket(url, bucket)
    rnd = random.Random(8)
    raw_put(url, bucket, "earlier.bin", [rnd.randbytes(1000), rnd.randbytes(500)])
    chunks = [rnd.randbytes(CHUNK) for _ in range(CHUNKS - 1)] + [rnd.randbytes(CHUNK - 777)]
    nuid = "integrity" + "".join(rnd.choice("ABCDEFGH") for _ in range(13))
    raw_put(url, bucket, name, chunks, nuid=nuid)
    return b"".join(chunks), nuid


def delete_chunk(url: str, bucket: str, nuid: str, index: int) -> None:
    """Delete one chunk message with the JetStream API, as a hostile or buggy client could."""

    async def fn(nc: Any, js: Any) -> None:
        subject = f"$O.{bucket}.C.{nuid}"
        seqs = []
        seq = 1
        while True:
            body = {"seq": seq, "next_by_subj": subject}
            reply = await nc.request(f"$JS.API.DIRECT.GET.OBJ_{bucket}", json.dumps(body).encode(), timeout=5)
            if not reply.headers or "Nats-Sequence" not in reply.headers:
                break
            seqs.append(int(reply.headers["Nats-Sequence"]))
            seq = seqs[-1] + 1
        assert len(seqs) == CHUNKS
        reply = await nc.request(f"$JS.API.STREAM.MSG.DELETE.OBJ_{bucket}",
                                 json.dumps({"seq": seqs[index]}).encode(), timeout=5)
        assert json.loads(reply.data).get("success") is True, reply.data

    with_nats(url, fn)


def chunk_reads(path: Path) -> dict[int, bytes | int]:
    """Each chunk read with one pread (as `dd bs=128K skip=k count=1`): its bytes, or the errno."""
    return pread_each(path, CHUNK, [7, LOST, 0, 5, 2, 4, 1, 6])


def expected(data: bytes) -> dict[int, bytes | int]:
    return {k: errno.EIO if k == LOST else data[k * CHUNK : (k + 1) * CHUNK] for k in range(CHUNKS)}


def cat(path: Path) -> tuple[bytes, int | None]:
    """Read the whole file in 128 KiB reads: (bytes before the first error, its errno or None)."""
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while True:
            try:
                piece = f.read(CHUNK)
            except OSError as e:
                return bytes(out), e.errno
            if not piece:
                return bytes(out), None
            out += piece


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def damage_lines(log: str, nuid: str) -> list[str]:
    return [line for line in log.splitlines() if nuid in line and re.search(r" (ERROR|WARNING) ", line)]


@pytest.mark.expect_log("eight.bin .*(1 of 8 chunks missing|gone from the stream)")
def test_lost_chunk_gives_eio_for_its_reads_and_exact_bytes_elsewhere(nats_url, bucket_name, mounter):
    data, nuid = put_eight_chunks(nats_url, bucket_name, "eight.bin")
    # A mount that read (and cached) the object before the damage, with a cache too small to keep it.
    before = mounter(nats_url, "--cache-size", "256KiB")
    p_before = before / bucket_name / "eight.bin"
    assert p_before.read_bytes() == data
    delete_chunk(nats_url, bucket_name, nuid, LOST)

    fresh = mounter(nats_url)
    p = fresh / bucket_name / "eight.bin"
    assert p.stat().st_size == len(data)
    assert chunk_reads(p) == expected(data)
    # A read that straddles the lost chunk stops short at it (the kernel returns the good pages it
    # has), or fails; reading the lost bytes again fails again, at once.
    fd = os.open(p, os.O_RDONLY)
    try:
        off = LOST * CHUNK - 50
        try:
            got = os.pread(fd, 100, off)
            assert len(got) <= 50 and got == data[off : off + len(got)]
        except OSError as e:
            assert e.errno == errno.EIO
        with pytest.raises(OSError) as err:
            os.pread(fd, 1, LOST * CHUNK + 5)
        assert err.value.errno == errno.EIO
    finally:
        os.close(fd)
    # `cat`: exact bytes up to at most the lost chunk, then EIO (how much of the good prefix arrives
    # before the error depends on the kernel's readahead).
    got, err = cat(p)
    assert err == errno.EIO
    assert len(got) <= LOST * CHUNK and got == data[: len(got)]

    # The mount that knew the object before: its proven layout keeps every other chunk in place.
    drop_page_cache(p_before)
    assert chunk_reads(p_before) == expected(data)

    assert (fresh / bucket_name / "earlier.bin").stat().st_size == 1500
    for m in (fresh, before):
        log = m.log()
        lines = damage_lines(log, nuid)
        assert len(lines) == 1, lines
        assert bucket_name in lines[0] and "eight.bin" in lines[0]
        assert "Traceback" not in log
        assert m.alive
    assert "1 of 8 chunks missing" in damage_lines(fresh.log(), nuid)[0]
    assert "chunk 3 " in damage_lines(before.log(), nuid)[0]


def test_real_server_replies_prove_what_the_twin_does(nats_url, bucket_name):
    """The facts the layout checks rest on, on nats-server itself: each direct-get reply names its
    subject and sequence and counts the chunks after it; a deleted sequence holds no message."""
    data, nuid = put_eight_chunks(nats_url, bucket_name, "eight.bin")
    delete_chunk(nats_url, bucket_name, nuid, LOST)

    async def fn(store: Any) -> None:
        msgs = await store.fetch_chunks(bucket_name, nuid, 1, 10, 1 << 30)
        assert [m.subject for m in msgs] == [f"$O.{bucket_name}.C.{nuid}"] * 7
        assert [m.pending for m in msgs] == [6, 5, 4, 3, 2, 1, 0]
        seqs = [m.seq for m in msgs]
        assert seqs == [4, 5, 6, 8, 9, 10, 11]  # 1..3: the earlier object; 7: the deleted chunk
        assert b"".join(m.data for m in msgs) == data[: LOST * CHUNK] + data[(LOST + 1) * CHUNK :]
        assert await store.stored_sequences(bucket_name, 1, 12) == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
        assert await store.stored_sequences(bucket_name, 7, 8) == []
        assert await store.stored_sequences(bucket_name, 11, 100) == [11, 12]  # 12: the meta
        assert await store.chunk_index(bucket_name, nuid) == [(m.seq, len(m.data)) for m in msgs]

    with_store(nats_url, fn)


def pread_each(path: Path, chunk: int, order: int | list[int]) -> dict[int, bytes | int]:
    """Chunks of `path` read with one pread each, in `order` (a count: all of them, last first): each
    one's bytes, or the errno."""
    out: dict[int, bytes | int] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for k in reversed(range(order)) if isinstance(order, int) else order:
            try:
                out[k] = os.pread(fd, chunk, k * chunk)
            except OSError as e:
                out[k] = e.errno
    finally:
        os.close(fd)
    return out


@pytest.mark.expect_log("damaged.bin .*no gap in the stream sequences could have held the 1 missing")
def test_a_meta_counting_a_chunk_never_stored_is_eio_not_shifted(nats_url, bucket_name, mounter):
    """explore-hostile F4: the meta counts 4 chunks, 3 were stored (AAAA, BBBB, CCCC) right after another
    object's messages. The one gap before them holds no deleted message, so nothing can be placed: every
    read fails, instead of AAAA served at chunk 1 and CCCC at chunk 3."""
    from natsfs.adr20 import digest_of

    create_bucket(nats_url, bucket_name)
    raw_put(nats_url, bucket_name, "before.txt", [b"another object\n"])
    data = b"".join(bytes([65 + k]) * CHUNK for k in range(4))
    nuid = "neverstored" + "X" * 11
    raw_put(nats_url, bucket_name, "damaged.bin", [data[k * CHUNK : (k + 1) * CHUNK] for k in range(3)], nuid=nuid,
            meta_extra={"size": len(data), "chunks": 4, "digest": digest_of(data)})
    m = mounter(nats_url)
    p = m / bucket_name / "damaged.bin"
    assert p.stat().st_size == len(data)
    assert pread_each(p, CHUNK, 4) == {k: errno.EIO for k in range(4)}
    got, err = cat(p)
    assert (got, err) == (b"", errno.EIO)
    assert (m / bucket_name / "before.txt").read_bytes() == b"another object\n"
    lines = damage_lines(m.log(), nuid)
    assert len(lines) == 1 and f"{len(data)} of {len(data)} bytes cannot be read" in lines[0], lines
    assert m.alive


@pytest.mark.expect_log(r"wrong-digest .*digest mismatch", r"bigger .*the meta says 1179648 bytes in 9",
                        r"smaller .*the meta says 917504 bytes in 7")
def test_copies_of_a_meta_with_other_claims_fail_alone(nats_url, bucket_name, mounter):
    """explore-hostile F10: metas written by another client name a good object's nuid with a wrong
    digest, one chunk more, one chunk fewer. On each of two mounts (copies read first, the good object
    read first) every copy gives EIO with one ERROR line and the good object reads exactly."""
    from natsfs.adr20 import digest_of

    create_bucket(nats_url, bucket_name)
    rnd = random.Random(10)
    chunks = [rnd.randbytes(CHUNK) for _ in range(CHUNKS)]
    data = b"".join(chunks)
    nuid = "sharednuid" + "S" * 12
    raw_put(nats_url, bucket_name, "good.bin", chunks, nuid=nuid)
    copies = {"wrong-digest": {"digest": digest_of(b"nope")},
              "bigger": {"size": 9 * CHUNK, "chunks": 9},
              "smaller": {"size": 7 * CHUNK, "chunks": 7, "digest": digest_of(data[: 7 * CHUNK])}}
    for name, claims in copies.items():
        raw_put(nats_url, bucket_name, name, [], nuid=nuid,
                meta_extra={"size": len(data), "chunks": CHUNKS, "digest": digest_of(data), **claims})
    for order in (["wrong-digest", "bigger", "smaller", "good.bin"], ["good.bin", "wrong-digest", "bigger", "smaller"]):
        m = mounter(nats_url)
        for name in order + order:  # read twice: verdicts stick, and log once
            p = m / bucket_name / name
            if name == "good.bin":
                assert p.read_bytes() == data
            else:
                with pytest.raises(OSError) as err:
                    p.read_bytes()
                assert err.value.errno == errno.EIO, name
        lines = damage_lines(m.log(), nuid)
        assert sorted(name for name in copies for line in lines if f"/{name} " in line) == sorted(copies), lines
        assert len(lines) == 3, lines
        assert m.alive


def test_an_oversized_chunk_never_shifts_the_bytes_a_far_read_serves(nats_url, bucket_name, mounter):
    """Another client's object declares max_chunk_size 128 KiB but its chunk 1 holds 20,000 bytes more
    (chunk 38 as many less; sizes and digest are right: nats.go reads it whole). A tail read first, then
    a read at 30 * 128 KiB + 100: that byte is chunk 29's. Computing the layout from the first and the
    last chunk served chunk 30's there, and the kernel kept it: a later cat returned 4096 wrong bytes
    with no error."""
    create_bucket(nats_url, bucket_name)
    sizes = [CHUNK, CHUNK + 20_000] + [CHUNK] * 36 + [CHUNK - 20_000, 5000]
    chunks = [bytes([65 + k % 26]) * n for k, n in enumerate(sizes)]
    data = b"".join(chunks)
    raw_put(nats_url, bucket_name, "lookalike.bin", chunks, meta_extra={"options": {"max_chunk_size": CHUNK}})
    m = mounter(nats_url)
    p = m / bucket_name / "lookalike.bin"
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, 100, len(data) - 100) == data[-100:]
        off = 30 * CHUNK + 100
        assert os.pread(fd, 16, off) == data[off : off + 16]
    finally:
        os.close(fd)
    assert p.read_bytes() == data
    assert m.alive
