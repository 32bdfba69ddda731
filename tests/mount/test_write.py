"""Writing through a real mount, checked by what other NATS clients (nats-py, raw JSON) see."""

from __future__ import annotations

import base64
import ctypes
import errno
import json
import os
import random
import stat
import subprocess

import pytest
from helpers import create_bucket, nats_py_get, nats_py_put, raw_put, wait_for, with_nats, with_store


def meta_json(url: str, bucket: str, name: str) -> dict | None:
    subject = f"$O.{bucket}.M." + base64.urlsafe_b64encode(name.encode()).decode()

    async def fn(nc, js):
        try:
            m = await js.get_msg(f"OBJ_{bucket}", subject=subject, direct=True)
        except Exception:
            return None
        return {"seq": m.seq, **json.loads(m.data)}

    return with_nats(url, fn)


def chunk_count(url: str, bucket: str, nuid: str) -> int:
    async def fn(nc, js):
        info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.{nuid}")
        return sum((info.state.subjects or {}).values())

    return with_nats(url, fn)


@pytest.fixture()
def wb(nats_url, bucket_name, mounter):
    """A fresh bucket and a mount; yields (mount, bucket dir path)."""
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    return m, m.path / bucket_name


# ---------------------------------------------------------------- shapes of writes
def test_new_file_is_an_object_other_clients_read_with_its_digest(nats_url, bucket_name, wb):
    _m, b = wb
    data = random.Random(1).randbytes(1_000_000)
    (b / "dir").mkdir()
    (b / "dir" / "new.bin").write_bytes(data)
    assert nats_py_get(nats_url, bucket_name, "dir/new.bin") == data  # nats-py verifies the digest
    meta = meta_json(nats_url, bucket_name, "dir/new.bin")
    assert set(meta) - {"seq"} == {"name", "options", "bucket", "nuid", "size", "mtime", "chunks", "digest"}
    assert meta["options"] == {"max_chunk_size": 131072}
    assert meta["size"] == len(data) and meta["chunks"] == 8 and meta["mtime"] == "0001-01-01T00:00:00Z"
    assert len(meta["nuid"]) == 22
    info = with_store(nats_url, lambda s: s.get_info(bucket_name, "dir/new.bin"))
    assert info.size == len(data) and not info.deleted


def test_o_excl_o_trunc_o_append_and_rdwr_copy_on_write(nats_url, bucket_name, wb):
    _m, b = wb
    p = b / "f.txt"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, b"hello world")
    os.close(fd)
    with pytest.raises(FileExistsError):
        os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with open(p, "ab") as f:
        f.write(b"!!")
    assert nats_py_get(nats_url, bucket_name, "f.txt") == b"hello world!!"
    fd = os.open(p, os.O_RDWR)
    os.pwrite(fd, b"HELLO", 0)
    assert os.pread(fd, 100, 0) == b"HELLO world!!"
    os.close(fd)
    assert nats_py_get(nats_url, bucket_name, "f.txt") == b"HELLO world!!"
    with open(p, "wb") as f:
        f.write(b"short")
    assert p.read_bytes() == b"short"
    assert nats_py_get(nats_url, bucket_name, "f.txt") == b"short"


def test_sparse_writes_and_truncate_grow_and_shrink(nats_url, bucket_name, wb):
    _m, b = wb
    p = b / "sparse.bin"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"end", 300_000)
    os.pwrite(fd, b"start", 0)
    os.close(fd)
    expected = b"start" + bytes(300_000 - 5) + b"end"
    assert p.read_bytes() == expected
    assert nats_py_get(nats_url, bucket_name, "sparse.bin") == expected
    os.truncate(p, 10)
    assert p.stat().st_size == 10
    assert nats_py_get(nats_url, bucket_name, "sparse.bin") == expected[:10]
    with open(p, "r+b") as f:
        f.truncate(20)
    assert p.read_bytes() == expected[:10] + bytes(10)
    assert nats_py_get(nats_url, bucket_name, "sparse.bin") == expected[:10] + bytes(10)


def test_handles_share_one_staged_state(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "shared.txt").write_bytes(b"0123456789")
    reader = os.open(b / "shared.txt", os.O_RDONLY)
    writer = os.open(b / "shared.txt", os.O_WRONLY)
    try:
        os.pwrite(writer, b"abc", 3)
        # Not uploaded yet, but visible to the other handle of this mount.
        assert os.pread(reader, 10, 0) == b"012abc6789"
        assert nats_py_get(nats_url, bucket_name, "shared.txt") == b"0123456789"
    finally:
        os.close(writer)
        os.close(reader)
    assert nats_py_get(nats_url, bucket_name, "shared.txt") == b"012abc6789"


def test_read_only_open_and_close_uploads_nothing(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "r.txt").write_bytes(b"data")
    before = meta_json(nats_url, bucket_name, "r.txt")
    for flags in (os.O_RDONLY, os.O_RDWR):
        fd = os.open(b / "r.txt", flags)
        os.read(fd, 4)
        os.close(fd)
    assert meta_json(nats_url, bucket_name, "r.txt")["seq"] == before["seq"]


def test_chunk_size_option_and_a_large_file(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--chunk-size", "64KiB")
    data = random.Random(2).randbytes(5 * 1024 * 1024 + 17)
    (m.path / bucket_name / "big.bin").write_bytes(data)
    meta = meta_json(nats_url, bucket_name, "big.bin")
    assert meta["options"]["max_chunk_size"] == 65536 and meta["chunks"] == 81
    assert chunk_count(nats_url, bucket_name, meta["nuid"]) == 81
    assert nats_py_get(nats_url, bucket_name, "big.bin") == data


def test_overwrite_purges_the_old_chunks(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "o.bin").write_bytes(b"first" * 100_000)
    first = meta_json(nats_url, bucket_name, "o.bin")
    (b / "o.bin").write_bytes(b"second" * 100_000)
    second = meta_json(nats_url, bucket_name, "o.bin")
    assert first["nuid"] != second["nuid"]
    assert chunk_count(nats_url, bucket_name, first["nuid"]) == 0
    assert chunk_count(nats_url, bucket_name, second["nuid"]) == second["chunks"]


# ---------------------------------------------------------------- errors at close
def _close_errno(path, data: bytes) -> int | None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    os.write(fd, data)
    try:
        os.close(fd)
    except OSError as e:
        return e.errno
    return None


@pytest.mark.expect_log("huge.bin: closed without a successful upload")
def test_bucket_max_bytes_gives_enospc_at_close_and_leaves_no_partial_object(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name, max_bytes=1024 * 1024)
    m = mounter(nats_url)
    b = m.path / bucket_name
    (b / "small.txt").write_bytes(b"fits")
    assert _close_errno(b / "huge.bin", os.urandom(3 * 1024 * 1024)) == errno.ENOSPC
    assert meta_json(nats_url, bucket_name, "huge.bin") is None
    assert (b / "small.txt").read_bytes() == b"fits"
    assert "huge.bin" not in os.listdir(b)
    assert "refused by the server" in m.log() or "maximum bytes" in m.log()
    # (No subject of the bucket, a base64 meta subject: the file and its bucket are named. Other buckets'
    # subjects may show: another test's stream OBJ_... that is no object store is named with its subjects.)
    assert f"$O.{bucket_name}." not in m.log()
    # The server's bucket holds no orphans of the refused put.
    status = with_store(nats_url, lambda s: s.bucket_status(bucket_name))
    assert status.size < 64 * 1024


@pytest.mark.expect_log("closed without a successful upload")
def test_a_full_bucket_logs_one_line_per_refused_file_and_the_refusal_once(nats_url, bucket_name, mounter):
    """Closes refused by a full bucket: one line per file naming it, why, and where in lost+found its
    bytes are; the refusal the closes return is said once for the run (the same text for every file, so
    the repeat filter merges it), and no line carries a meta subject."""
    create_bucket(nats_url, bucket_name, max_bytes=1024 * 1024)
    m = mounter(nats_url)
    b = m.path / bucket_name
    names = [f"n{i}" for i in range(4)]
    for name in names:
        assert _close_errno(b / name, os.urandom(1536 * 1024)) == errno.ENOSPC
    refusal = f"bucket {bucket_name}: refused by the server: maximum bytes exceeded"
    # (the line that says where the bytes went comes at the release, which close() does not wait for)
    assert wait_for(lambda: m.log().count("closed without a successful upload") == len(names), 10), m.log()
    lines = m.log().splitlines()
    assert len([line for line in lines if line.endswith(f"flush: {refusal}")]) == 1, m.log()
    per_file = [line for line in lines if "closed without a successful upload" in line]
    assert [line.split(" natsfs.core.filesystem: ", 1)[1].split(":", 1)[0] for line in per_file] == \
        [f"{bucket_name}/{n}" for n in names]
    assert all(f"({refusal}); the bytes are kept at " in line and "lost+found" in line for line in per_file)
    assert f"$O.{bucket_name}." not in m.log()


def update_stream(url: str, bucket: str, **changes: object) -> None:
    """Change the bucket's stream config as another client (an operator) would."""
    async def fn(nc, js):
        cfg = (await js.stream_info(f"OBJ_{bucket}")).config
        for key, value in changes.items():
            setattr(cfg, key, value)
        await js.update_stream(cfg)

    with_nats(url, fn)


@pytest.mark.expect_log("big: closed without a successful upload")
@pytest.mark.parametrize(("limit", "undo", "refused"), [
    ({"max_bytes": 64 * 1024, "discard": "new"}, {"max_bytes": -1}, errno.ENOSPC),
    ({"max_msg_size": 64 * 1024}, {"max_msg_size": -1}, errno.E2BIG),
], ids=["full", "message-too-big"])
def test_a_new_file_whose_first_close_was_refused_can_be_created_again(nats_url, bucket_name, wb, limit, undo,
                                                                        refused):
    """The first close of a new file is refused by a limit of the bucket; once the limit is lifted,
    writing the same name again (open with O_CREAT|O_TRUNC) creates it and stores its bytes, as on a
    local disk. The kernel kept the name's entry for the given-up file's inode, and that open failed
    ENOENT until the entry expired."""
    from nats.js.api import DiscardPolicy

    m, b = wb
    update_stream(nats_url, bucket_name, **{k: DiscardPolicy.NEW if v == "new" else v for k, v in limit.items()})
    assert _close_errno(b / "big", os.urandom(256 * 1024)) == refused
    update_stream(nats_url, bucket_name, **undo)
    # (its release, which close() does not wait for, gives the bytes to lost+found and the name up)
    assert wait_for(lambda: "big: closed without a successful upload" in m.log(), 10), m.log()
    (b / "big").write_bytes(b"fine")
    assert nats_py_get(nats_url, bucket_name, "big") == b"fine"
    assert (b / "big").read_bytes() == b"fine"
    assert sorted(os.listdir(b)) == ["big"]


def test_sealed_bucket_refuses_with_erofs(nats_url, bucket_name, wb, mounter):
    _m, b = wb
    (b / "before.txt").write_bytes(b"kept")
    with_store(nats_url, lambda s: s.seal_bucket(bucket_name))
    # An open for writing is refused once the mount has re-read the bucket's state (at most every 2 s).
    assert wait_for(lambda: _open_errno(b / "before.txt", os.O_WRONLY | os.O_APPEND) == errno.EROFS, 10)
    for attempt in (lambda: (b / "x.txt").write_bytes(b"x"), lambda: (b / "before.txt").unlink(),
                    lambda: (b / "d").mkdir(), lambda: open(b / "before.txt", "ab").close()):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    assert (b / "before.txt").read_bytes() == b"kept"
    assert sorted(os.listdir(b)) == ["before.txt"]
    # A mount that finds the bucket sealed shows its files without write permission.
    fresh = mounter(nats_url)
    assert _mode_no_write(fresh.path / bucket_name) and _mode_no_write(fresh.path / bucket_name / "before.txt")


@pytest.mark.parametrize("single", [False, True], ids=["all-buckets", "--bucket"])
def test_a_bucket_another_client_seals_shows_without_write_bits_soon(nats_url, bucket_name, mounter, single):
    """Another client seals the bucket: stats of its entries (files, directories, the bucket's own
    directory, also a `--bucket` mount's root, which nothing looks up) show no write bits within a few
    seconds, without any write attempt. The sealed state was re-read only at a lookup of the bucket
    directory, which the kernel caches for a minute (never in a `--bucket` mount)."""
    create_bucket(nats_url, bucket_name)
    for name in ("f", "d/x", "d/y"):
        nats_py_put(nats_url, bucket_name, name, b"data", create=False)
    m = mounter(nats_url, *(["--bucket", bucket_name] if single else []))
    b = m.path if single else m.path / bucket_name
    assert not any(_mode_no_write(p) for p in (b, b / "f", b / "d", b / "d" / "x"))
    with_store(nats_url, lambda s: s.seal_bucket(bucket_name))
    # Each stat of "f" is answered from what the kernel caches until the mount, having re-read the state
    # in the background, tells it to drop the attributes.
    assert wait_for(lambda: _mode_no_write(b / "f"), 10), oct(os.stat(b / "f").st_mode)
    assert all(_mode_no_write(p) for p in (b, b / "d", b / "d" / "x", b / "d" / "y")), \
        [oct(os.stat(p).st_mode) for p in (b, b / "d", b / "d" / "x", b / "d" / "y")]


def _open_errno(p, flags: int) -> int:
    try:
        os.close(os.open(p, flags))
    except OSError as e:
        return e.errno or 0
    return 0


def _mode_no_write(p) -> bool:
    return not (os.stat(p).st_mode & 0o222)


def test_spool_full_gives_enospc_from_write(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--spool-size", "1MiB")
    fd = os.open(m.path / bucket_name / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x" * 500_000)
        with pytest.raises(OSError) as e:
            rest = b"y" * 1_000_000
            while rest:  # the kernel may accept a short first part before the spool says no
                rest = rest[os.write(fd, rest):]
        assert e.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert nats_py_get(nats_url, bucket_name, "f")[:500_000] == b"x" * 500_000
    assert "spool is full" in m.log()


def test_concurrent_writer_never_silently_wins(nats_url, bucket_name, wb, tmp_path):
    m, b = wb
    (b / "doc.txt").write_bytes(b"version 1")
    fd = os.open(b / "doc.txt", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"mount's version")
    nats_py_put(nats_url, bucket_name, "doc.txt", b"other client's version")
    with pytest.raises(OSError) as e:
        os.close(fd)
    assert e.value.errno == errno.ESTALE
    assert nats_py_get(nats_url, bucket_name, "doc.txt") == b"other client's version"
    log = m.log()
    kept = [line.split("kept at ")[-1].strip() for line in log.splitlines() if "your bytes are kept at" in line]
    assert kept, log
    with open(kept[-1], "rb") as f:
        assert f.read() == b"mount's version"


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_stream_created_again_under_an_open_writer_never_loses_the_new_object(nats_url, bucket_name, mounter,
                                                                                 mode):
    """The tester's case byte for byte: nats-py puts f = 1000 A's (stream sequence 2), the mount opens it
    `r+b` and writes 10 W's, nats-py deletes the stream, creates the bucket again and puts f = 1000 B's
    (sequence 2 again), then the writer closes. The B object stays what nats-py reads; the W's (on the
    old A's) go to lost+found, with one line: the close fails ESTALE, or in write-back mode the upload
    is refused after the close returned. (Before: the close returned 0 and f read W's and A's.)"""
    a, b_data, w = b"A" * 1000, b"B" * 1000, b"W" * 10
    nats_py_put(nats_url, bucket_name, "f", a)
    m = mounter(nats_url, "--bucket", bucket_name, *(["--write-back"] if mode == "write-back" else []))
    writer = open(m.path / "f", "r+b", buffering=0)  # noqa: SIM115 - closed below, where the error is
    writer.write(w)

    async def recreate(nc, js):
        await js.delete_stream(f"OBJ_{bucket_name}")
        obs = await js.create_object_store(bucket_name)
        await obs.put("f", b_data)
        meta = f"$O.{bucket_name}.M." + base64.urlsafe_b64encode(b"f").decode()
        assert (await js.get_last_msg(f"OBJ_{bucket_name}", meta)).seq == 2  # the revision the mount read

    with_nats(nats_url, recreate)
    if mode == "write-through":
        with pytest.raises(OSError) as e:
            writer.close()
        assert e.value.errno == errno.ESTALE
    else:
        writer.close()
    assert wait_for(lambda: "your bytes are kept at" in m.log(), timeout=30), m.log()
    assert nats_py_get(nats_url, bucket_name, "f") == b_data
    assert wait_for(lambda: (m.path / "f").read_bytes() == b_data)
    kept = [line.split("kept at ")[-1].strip() for line in m.log().splitlines() if "your bytes are kept at" in line]
    assert len(kept) == 1
    with open(kept[0], "rb") as f:
        assert f.read() == w + a[len(w):]


# ---------------------------------------------------------------- namespace
def test_unlink_is_an_adr20_delete(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "gone.txt").write_bytes(b"bye" * 50_000)
    nuid = meta_json(nats_url, bucket_name, "gone.txt")["nuid"]
    (b / "gone.txt").unlink()
    meta = meta_json(nats_url, bucket_name, "gone.txt")
    assert meta["deleted"] is True and meta["size"] == 0 and meta["chunks"] == 0 and "digest" not in meta
    assert chunk_count(nats_url, bucket_name, nuid) == 0
    assert not (b / "gone.txt").exists()
    with pytest.raises(FileNotFoundError):
        (b / "gone.txt").unlink()


def test_mkdir_persists_is_visible_elsewhere_and_rmdir_refuses_non_empty(nats_url, bucket_name, wb, mounter):
    m, b = wb
    (b / "empty").mkdir()
    (b / "full").mkdir()
    (b / "full" / "f").write_bytes(b"f")
    other = mounter(nats_url)
    assert wait_for(lambda: (other.path / bucket_name / "empty").is_dir(), 10)
    with pytest.raises(OSError) as e:
        (b / "full").rmdir()
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(FileExistsError):
        (b / "empty").mkdir()
    m.remount()
    assert (b / "empty").is_dir() and os.listdir(b / "empty") == []
    assert sorted(os.listdir(b)) == ["empty", "full"]  # markers never show as files
    (b / "empty").rmdir()
    assert not (b / "empty").exists()
    assert meta_json(nats_url, bucket_name, "empty/")["deleted"] is True
    m.remount()
    assert sorted(os.listdir(b)) == ["full"]


def test_rename_is_metadata_only_and_replaces_the_target(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "a.bin").write_bytes(b"A" * 300_000)
    (b / "b.bin").write_bytes(b"B" * 10)
    a = meta_json(nats_url, bucket_name, "a.bin")
    old_b = meta_json(nats_url, bucket_name, "b.bin")
    mtime = os.stat(b / "a.bin").st_mtime_ns
    os.rename(b / "a.bin", b / "b.bin")
    new_b = meta_json(nats_url, bucket_name, "b.bin")
    assert new_b["nuid"] == a["nuid"] and new_b["size"] == 300_000
    # The rename's claim of the old name: a tombstone on a fresh nuid that holds no chunks (nats.go's
    # Delete or a nats.js put of a.bin purge that nuid, never the renamed object's).
    claim = meta_json(nats_url, bucket_name, "a.bin")
    assert claim["deleted"] is True and claim["nuid"] not in ("", a["nuid"])
    assert chunk_count(nats_url, bucket_name, claim["nuid"]) == 0
    assert chunk_count(nats_url, bucket_name, old_b["nuid"]) == 0
    assert chunk_count(nats_url, bucket_name, a["nuid"]) == a["chunks"]
    assert nats_py_get(nats_url, bucket_name, "b.bin") == b"A" * 300_000
    assert os.stat(b / "b.bin").st_mtime_ns == mtime  # rename keeps the mtime
    assert sorted(os.listdir(b)) == ["b.bin"]


def test_a_rename_or_unlink_racing_the_files_close_holds(nats_url, bucket_name, wb):
    """A second thread renames (or unlinks) a file, or its directory, while its close is uploading it.
    Whatever the interleaving, as on a local disk: both calls return 0, the new name
    holds the bytes here and for other clients, the old name is gone (an unlinked file stays gone), a
    rewritten file is never ESTALE nor a mix of its versions. (Before the fix the upload stored under the
    old name after the rename, and brought unlinked files back, in about half of the rounds.)"""
    import threading

    _m, b = wb
    v1, v2 = b"1" * 300_000, b"2" * 300_000

    def race(path, data: bytes, change) -> tuple[object, object]:
        results: dict[str, object] = {}
        f = open(path, "r+b" if path.exists() else "wb")  # noqa: SIM115 - closed by the race itself
        f.write(data)

        def other():
            try:
                change()
                results["change"] = 0
            except OSError as e:
                results["change"] = e.errno

        t = threading.Thread(target=other)
        t.start()
        try:
            f.close()
            results["close"] = 0
        except OSError as e:
            results["close"] = e.errno
        t.join()
        return results["close"], results["change"]

    for i in range(8):
        (b / f"e{i}").write_bytes(v1)
    for i in range(8):
        new = b / f"n{i}"
        assert race(new, v2, lambda new=new, i=i: os.rename(new, b / f"g{i}")) == (0, 0)
        assert race(b / f"e{i}", v2, lambda i=i: os.rename(b / f"e{i}", b / f"h{i}")) == (0, 0)
        gone = b / f"u{i}"
        assert race(gone, v2, lambda gone=gone: os.unlink(gone)) == (0, 0)
        (b / f"d{i}").mkdir()
        assert race(b / f"d{i}" / "f", v2, lambda i=i: os.rename(b / f"d{i}", b / f"D{i}")) == (0, 0)
    for i in range(8):
        for name in (f"g{i}", f"h{i}", f"D{i}/f"):
            assert (b / name).read_bytes() == v2, name
            assert nats_py_get(nats_url, bucket_name, name) == v2, name
        for name in (f"n{i}", f"e{i}", f"u{i}", f"d{i}/f"):
            assert not (b / name).exists(), name
            meta = meta_json(nats_url, bucket_name, name)
            assert meta is None or meta.get("deleted"), name


def test_directory_rename_moves_everything(nats_url, bucket_name, wb):
    m, b = wb
    (b / "src" / "sub").mkdir(parents=True)
    (b / "src" / "x").write_bytes(b"x")
    (b / "src" / "sub" / "y").write_bytes(b"y")
    os.rename(b / "src", b / "dst")
    assert not (b / "src").exists()
    assert (b / "dst" / "x").read_bytes() == b"x" and (b / "dst" / "sub" / "y").read_bytes() == b"y"
    m.remount()
    assert sorted(os.listdir(b)) == ["dst"]
    assert sorted(os.listdir(b / "dst")) == ["sub", "x"]
    assert nats_py_get(nats_url, bucket_name, "dst/sub/y") == b"y"


def test_rename_across_buckets_is_exdev_and_mv_copies(nats_url, bucket_name, wb):
    m, b = wb
    other = bucket_name + "_2"
    create_bucket(nats_url, other)
    assert wait_for(lambda: (m.path / other).is_dir(), 10)
    (b / "f.txt").write_bytes(b"moving")
    with pytest.raises(OSError) as e:
        os.rename(b / "f.txt", m.path / other / "f.txt")
    assert e.value.errno == errno.EXDEV
    subprocess.run(["mv", str(b / "f.txt"), str(m.path / other / "f.txt")], check=True)
    assert nats_py_get(nats_url, other, "f.txt") == b"moving"
    assert not (b / "f.txt").exists()


def _renameat2(old, new, flags: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD = -100
    r = libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags)
    return 0 if r == 0 else ctypes.get_errno()


def test_rename_flags(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "one").write_bytes(b"1")
    (b / "two").write_bytes(b"2")
    assert _renameat2(b / "one", b / "two", 1) == errno.EEXIST  # RENAME_NOREPLACE
    assert _renameat2(b / "one", b / "three", 1) == 0
    assert _renameat2(b / "three", b / "two", 2) == errno.EINVAL  # RENAME_EXCHANGE
    assert _renameat2(b / "three", b / "two", 4) == errno.EINVAL  # RENAME_WHITEOUT (was a plain rename)
    assert (b / "three").read_bytes() == b"1" and (b / "two").read_bytes() == b"2"


def test_attributes_stick_across_remounts(nats_url, bucket_name, wb):
    m, b = wb
    p = b / "script.sh"
    p.write_bytes(b"#!/bin/sh\n")
    os.chmod(p, 0o750)
    os.chown(p, 1234, 5678)
    os.utime(p, ns=(1_600_000_000_000_000_000, 1_600_000_000_123_456_789))
    (b / "d").mkdir()
    os.chmod(b / "d", 0o700)
    m.remount()
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o750 and (st.st_uid, st.st_gid) == (1234, 5678)
    assert st.st_mtime_ns == 1_600_000_000_123_456_789
    assert stat.S_IMODE(os.stat(b / "d").st_mode) == 0o700
    meta = meta_json(nats_url, bucket_name, "script.sh")
    assert meta["metadata"]["natsfs.mode"] == "750"
    assert nats_py_get(nats_url, bucket_name, "script.sh") == b"#!/bin/sh\n"  # same bytes, same digest


def test_objects_from_other_clients_get_sane_defaults(nats_url, bucket_name, wb):
    _m, b = wb
    raw_put(nats_url, bucket_name, "plain.txt", [b"plain"])
    assert wait_for(lambda: (b / "plain.txt").exists(), 10)
    st = os.stat(b / "plain.txt")
    assert stat.S_IMODE(st.st_mode) == 0o644 and st.st_uid == os.getuid()


def test_hard_links_are_eperm(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "f").write_bytes(b"f")
    with pytest.raises(OSError) as e:
        os.link(b / "f", b / "g")
    assert e.value.errno == errno.EPERM


def test_spark_style_commit_by_hand(nats_url, bucket_name, wb):
    m, b = wb
    out = b / "out"
    task = out / "_temporary" / "0" / "task_0"
    task.mkdir(parents=True)
    (task / "part-00000").write_bytes(b"row1\nrow2\n")
    (task / ".part-00000.crc").write_bytes(b"crc")
    for f in task.iterdir():
        os.rename(f, out / f.name)
    subprocess.run(["rm", "-rf", str(out / "_temporary")], check=True)
    (out / "_SUCCESS").write_bytes(b"")
    m.remount()
    assert sorted(os.listdir(out)) == [".part-00000.crc", "_SUCCESS", "part-00000"]
    assert (out / "part-00000").read_bytes() == b"row1\nrow2\n"
    assert (out / "_SUCCESS").read_bytes() == b""


def test_tar_extracts_many_files(nats_url, bucket_name, wb, tmp_path):
    m, b = wb
    src = tmp_path / "src"
    for i in range(60):
        d = src / f"d{i % 6}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_bytes(f"file {i}\n".encode())
    subprocess.run(["tar", "-cf", str(tmp_path / "a.tar"), "-C", str(src), "."], check=True)
    subprocess.run(["tar", "-xf", str(tmp_path / "a.tar"), "-C", str(b)], check=True)
    m.remount()
    for i in range(60):
        assert (b / f"d{i % 6}" / f"f{i}.txt").read_bytes() == f"file {i}\n".encode()
    r = subprocess.run(["diff", "-r", str(src), str(b)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_writes_survive_the_upload_worker_dying(nats_url, bucket_name, wb):
    """Bulk publishing runs in a helper process; if it dies, the mount starts another (and publishes by
    itself meanwhile). See also tests/mount/test_child_restarts.py."""
    import signal

    m, b = wb
    children = subprocess.run(["pgrep", "-P", str(m.proc.pid), "-f", "upload-worker"], capture_output=True, text=True)
    pids = [int(p) for p in children.stdout.split()]
    assert pids, "the mount should run an upload worker"
    big = random.Random(9).randbytes(9 * 1024 * 1024)
    (b / "before.bin").write_bytes(big)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: all(f"upload worker (pid {pid}) died" in m.log() for pid in pids), 10)
    (b / "after.bin").write_bytes(big[::-1])
    assert nats_py_get(nats_url, bucket_name, "before.bin") == big
    assert nats_py_get(nats_url, bucket_name, "after.bin") == big[::-1]


# ---------------------------------------------------------------- open files under this mount's own changes
# (found by the Hypothesis machine in tests/model; each behaves as on a local disk)
def test_renaming_an_open_file_keeps_its_handles_on_the_file(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "f").write_bytes(b"hello")
    fd = os.open(b / "f", os.O_RDWR)
    os.rename(b / "f", b / "g")
    os.pwrite(fd, b"J", 0)
    os.close(fd)
    assert (b / "g").read_bytes() == b"Jello"
    assert nats_py_get(nats_url, bucket_name, "g") == b"Jello"
    assert not (b / "f").exists()


def test_an_open_file_this_mount_unlinks_stays_readable_and_its_writes_go_nowhere(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "f").write_bytes(b"hello" * 30_000)
    nuid = meta_json(nats_url, bucket_name, "f")["nuid"]
    fd = os.open(b / "f", os.O_RDWR)
    os.unlink(b / "f")
    assert os.pread(fd, 5, 0) == b"hello"
    os.pwrite(fd, b"J", 0)
    assert os.pread(fd, 5, 0) == b"Jello"
    os.close(fd)
    assert not (b / "f").exists()
    assert meta_json(nats_url, bucket_name, "f")["deleted"] is True
    assert wait_for(lambda: chunk_count(nats_url, bucket_name, nuid) == 0, 10)  # purged at the last close


def test_truncate_by_path_of_a_file_open_only_for_reading_is_stored(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "f").write_bytes(b"hello")
    fd = os.open(b / "f", os.O_RDONLY)
    os.truncate(b / "f", 2)
    os.close(fd)
    assert nats_py_get(nats_url, bucket_name, "f") == b"he"


def test_renaming_a_directory_onto_one_holding_a_file_being_written_is_enotempty(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "a").mkdir()
    (b / "b").mkdir()
    fd = os.open(b / "b" / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"new")
    with pytest.raises(OSError) as e:
        os.rename(b / "a", b / "b")
    os.close(fd)
    assert e.value.errno == errno.ENOTEMPTY
    assert (b / "b" / "f").read_bytes() == b"new" and (b / "a").is_dir()


def test_an_unlinked_open_file_can_still_be_truncated_and_stat_while_its_name_is_reused(nats_url, bucket_name, wb):
    _m, b = wb
    (b / "d").mkdir()
    (b / "d" / "c").write_bytes(b"data")
    fd = os.open(b / "d" / "c", os.O_WRONLY | os.O_APPEND)
    os.unlink(b / "d" / "c")
    (b / "d" / "c").mkdir()  # the name now belongs to a directory
    os.ftruncate(fd, 7394)
    st = os.fstat(fd)
    assert st.st_size == 7394 and st.st_nlink == 0
    os.close(fd)
    assert (b / "d" / "c").is_dir() and os.listdir(b / "d" / "c") == []
