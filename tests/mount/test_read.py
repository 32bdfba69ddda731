"""Reading through a real mount: objects from nats-py and raw publishes, caches, digests, errors."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random

import pytest
from helpers import create_bucket, nats_py_put, raw_put


def stats(mount) -> dict:
    return json.loads(os.getxattr(mount.path, "user.natsfs.stats"))["cache"]


@pytest.mark.parametrize("size", [0, 1, 131071, 131072, 131073, 3 * 131072, 1_000_003])
def test_objects_put_by_nats_py_read_identically(nats_url, bucket_name, mounter, size):
    data = random.Random(size).randbytes(size)
    nats_py_put(nats_url, bucket_name, f"dir/sub/obj-{size}.bin", data)
    m = mounter(nats_url)
    p = m.path / bucket_name / "dir" / "sub" / f"obj-{size}.bin"
    assert p.stat().st_size == size
    assert p.read_bytes() == data


def test_uneven_chunks_read_correctly_sequentially_and_randomly(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    rnd = random.Random(7)
    sizes = [1000, 131072, 5, 70000, 131072, 1, 250000, 17]
    chunks = [rnd.randbytes(n) for n in sizes]
    data = b"".join(chunks)
    raw_put(nats_url, bucket_name, "uneven.bin", chunks)
    m = mounter(nats_url)
    p = m.path / bucket_name / "uneven.bin"
    assert p.read_bytes() == data
    fd = os.open(p, os.O_RDONLY)
    try:
        for _ in range(200):
            off = rnd.randrange(0, len(data))
            n = rnd.randrange(1, 300000)
            assert os.pread(fd, n, off) == data[off : off + n]
        assert os.pread(fd, 10, len(data)) == b""
    finally:
        os.close(fd)


def test_random_read_far_into_a_fresh_object_fetches_only_what_it_touches(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    rnd = random.Random(3)
    chunks = [rnd.randbytes(131072) for _ in range(400)]  # 50 MiB
    raw_put(nats_url, bucket_name, "big.bin", chunks)
    m = mounter(nats_url)
    p = m.path / bucket_name / "big.bin"
    before = stats(m)
    with open(p, "rb", buffering=0) as f:
        f.seek(len(chunks) * 131072 - 4096)
        assert f.read(4096) == chunks[-1][-4096:]
    after = stats(m)
    assert after["chunks_fetched"] - before["chunks_fetched"] <= 2
    assert after["index_scans"] - before["index_scans"] == 1


def test_object_larger_than_the_cache_reads_correctly(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    rnd = random.Random(11)
    chunks = [rnd.randbytes(131072) for _ in range(24 * 8)]  # 24 MiB through a 2 MiB cache
    raw_put(nats_url, bucket_name, "large.bin", chunks)
    m = mounter(nats_url, "--cache-size", "2MiB")
    digest = hashlib.sha256()
    with open(m.path / bucket_name / "large.bin", "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    assert digest.digest() == hashlib.sha256(b"".join(chunks)).digest()
    assert stats(m)["cached_bytes"] <= 2 * 1024 * 1024


@pytest.mark.expect_log("tampered.txt .*digest mismatch")
def test_digest_mismatch_gives_eio_from_then_on(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    chunks = [random.Random(i).randbytes(131072) for i in range(64)]
    good = b"".join(chunks)
    bad_digest = "SHA-256=" + "A" * 43 + "="
    raw_put(nats_url, bucket_name, "tampered.txt", chunks, meta_extra={"digest": bad_digest})
    m = mounter(nats_url)
    p = m.path / bucket_name / "tampered.txt"
    with open(p, "rb") as f:
        assert f.read(10) == good[:10]
    with pytest.raises(OSError) as e:
        p.read_bytes()
    assert e.value.errno == errno.EIO
    # Once known bad, the version is refused on every later read too (page cache dropped).
    with pytest.raises(OSError) as e:
        p.read_bytes()
    assert e.value.errno == errno.EIO
    log = m.log()
    assert "digest mismatch" in log and bucket_name in log and "tampered.txt" in log and bad_digest in log
    assert m.alive


def test_concurrent_readers_get_the_same_bytes(nats_url, bucket_name, mounter):
    import concurrent.futures

    create_bucket(nats_url, bucket_name)
    rnd = random.Random(5)
    chunks = [rnd.randbytes(131072) for _ in range(64)]
    raw_put(nats_url, bucket_name, "shared.bin", chunks)
    m = mounter(nats_url)
    p = m.path / bucket_name / "shared.bin"
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda _: hashlib.sha256(p.read_bytes()).digest(), range(4)))
    assert set(results) == {hashlib.sha256(b"".join(chunks)).digest()}


@pytest.mark.skipif(os.geteuid() != 0, reason="raising the kernel readahead (sysfs) needs root")
def test_the_first_file_opened_on_a_fresh_mount_is_read_in_1_mib_requests(nats_url, bucket_name, mounter):
    """The kernel readahead is raised before the first open is answered (a file takes its device's
    readahead when opened): 8 MiB arrive in about 8 requests, not 64 of 128 KiB."""
    create_bucket(nats_url, bucket_name)
    chunks = [random.Random(i).randbytes(131072) for i in range(64)]
    raw_put(nats_url, bucket_name, "first.bin", chunks)
    m = mounter(nats_url)
    with open(m.path / bucket_name / "first.bin", "rb") as f:  # the mount's first open
        assert f.read() == b"".join(chunks)
    assert stats(m)["reads"] <= 16


def test_parallel_readers_through_a_small_cache_read_exactly_and_share_the_readahead(nats_url, bucket_name,
                                                                                      mounter):
    import concurrent.futures

    create_bucket(nats_url, bucket_name)
    objects = {}
    for k in range(4):
        chunks = [random.Random(100 * k + i).randbytes(131072) for i in range(96)]  # 12 MiB each
        raw_put(nats_url, bucket_name, f"par-{k}.bin", chunks)
        objects[f"par-{k}.bin"] = hashlib.sha256(b"".join(chunks)).digest()
    m = mounter(nats_url, "--cache-size", "8MiB")

    def digest_of(name: str) -> bytes:
        h = hashlib.sha256()
        with open(m.path / bucket_name / name, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.digest()

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        assert dict(zip(objects, ex.map(digest_of, objects), strict=True)) == objects
    s = stats(m)
    assert s["cached_bytes"] <= 8 << 20
    assert 0 < s["readahead_peak"] <= 4 << 20  # at most the whole budget: half the cache
    assert s["chunks_fetched"] >= 4 * 96


def test_single_bucket_mount_shows_the_bucket_as_root(nats_url, bucket_name, mounter):
    nats_py_put(nats_url, bucket_name, "a/b.txt", b"bee")
    m = mounter(nats_url, "--bucket", bucket_name)
    assert os.listdir(m.path) == ["a"]
    assert (m.path / "a" / "b.txt").read_bytes() == b"bee"


def test_large_directory_lists_every_entry(nats_url, bucket_name, mounter):
    import asyncio
    import base64

    from helpers import with_nats

    create_bucket(nats_url, bucket_name)

    async def fill(nc, js):
        futs = []
        for i in range(2000):
            name = f"many/f{i:05d}"
            meta = {"name": name, "bucket": bucket_name, "nuid": f"n{i}", "size": 0, "chunks": 0,
                    "mtime": "0001-01-01T00:00:00Z",
                    "digest": "SHA-256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU="}
            enc = base64.urlsafe_b64encode(name.encode()).decode()
            futs.append(await js.publish_async(f"$O.{bucket_name}.M.{enc}", json.dumps(meta).encode()))
        await asyncio.gather(*futs)

    with_nats(nats_url, fill)
    m = mounter(nats_url)
    names = os.listdir(m.path / bucket_name / "many")
    assert len(names) == 2000
    assert sorted(names) == [f"f{i:05d}" for i in range(2000)]
    assert all(e.stat().st_size == 0 for e in os.scandir(m.path / bucket_name / "many"))


def test_statfs_reports_something_df_can_use(nats_url, bucket_name, mounter):
    nats_py_put(nats_url, bucket_name, "x", b"x" * 5000)
    m = mounter(nats_url, "--bucket", bucket_name)
    st = os.statvfs(m.path)
    assert st.f_blocks > 0 and st.f_bavail <= st.f_blocks
    assert st.f_namemax == 255
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert used >= 5000
