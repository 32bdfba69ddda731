"""Never a broken object: renames other clients cannot turn into data loss, names refused before anything
is stored, puts that fail while the server is away leave no orphans, and staged bytes of a killed daemon
are found at the next mount. Checked through real mounts and with fresh clients."""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import random
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import create_bucket, nats_py_get, wait_for, with_nats


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M." + base64.urlsafe_b64encode(name.encode()).decode()


async def _info_with_deleted(nc: Any, bucket: str, name: str) -> dict[str, Any] | None:
    """The last meta of `name`, tombstones included (nats.go `GetInfo(name, ShowDeleted)`)."""
    m = await nc.request(f"$JS.API.DIRECT.GET.OBJ_{bucket}.{_meta_subject(bucket, name)}", b"", timeout=5)
    if m.headers and m.headers.get("Status") == "404":
        return None
    return json.loads(m.data)


async def _purge(nc: Any, bucket: str, subject: str) -> None:
    await nc.request(f"$JS.API.STREAM.PURGE.OBJ_{bucket}", json.dumps({"filter": subject}).encode(), timeout=5)


def go_delete(url: str, bucket: str, name: str) -> bool:
    """nats.go's Delete(name): read the info including deleted objects, publish a tombstone carrying its
    nuid, then purge THAT nuid's chunks. False when there is nothing under the name (ErrObjectNotFound)."""

    async def fn(nc: Any, js: Any) -> bool:
        info = await _info_with_deleted(nc, bucket, name)
        if info is None:
            return False
        tomb = dict(info, deleted=True, size=0, chunks=0, digest="")
        await js.publish(_meta_subject(bucket, name), json.dumps(tomb).encode(), headers={"Nats-Rollup": "sub"})
        await _purge(nc, bucket, f"$O.{bucket}.C.{info['nuid']}")
        return True

    return with_nats(url, fn)


def _nuid_of(url: str, bucket: str, name: str) -> str:
    info = with_nats(url, lambda nc, js: _info_with_deleted(nc, bucket, name))
    assert info is not None
    return str(info["nuid"])


def js_put(url: str, bucket: str, name: str, data: bytes) -> None:
    """nats.js's put(name): chunks on a fresh nuid, the meta, then purge of the PREVIOUS info's nuid,
    whether that info is deleted or not."""

    async def fn(nc: Any, js: Any) -> None:
        previous = await _info_with_deleted(nc, bucket, name)
        nuid = secrets.token_hex(11)
        for i in range(0, len(data), 128 * 1024):
            await js.publish(f"$O.{bucket}.C.{nuid}", data[i : i + 128 * 1024])
        import hashlib

        digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        meta = {"name": name, "bucket": bucket, "nuid": nuid, "size": len(data),
                "chunks": -(-len(data) // (128 * 1024)), "digest": digest, "mtime": "0001-01-01T00:00:00Z"}
        await js.publish(_meta_subject(bucket, name), json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
        if previous is not None and previous.get("nuid"):
            await _purge(nc, bucket, f"$O.{bucket}.C.{previous['nuid']}")

    with_nats(url, fn)


def subjects(url: str, bucket: str, pattern: str) -> dict[str, int]:
    """Subjects (and message counts) matching `pattern` in the bucket, as a fresh client sees them."""

    async def fn(nc: Any, js: Any) -> dict[str, int]:
        info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=pattern)
        return dict(info.state.subjects or {})

    return with_nats(url, fn)


@pytest.fixture()
def wb(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    return m, m.path / bucket_name


def no_errors(log: str) -> None:
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------- renames other clients can live with
def test_after_mv_other_clients_delete_or_put_of_the_old_name_leaves_the_file(nats_url, bucket_name, wb):
    m, b = wb
    data = random.Random(1).randbytes(700_000)
    (b / "a").write_bytes(data)
    os.rename(b / "a", b / "b")
    # The old name holds the rename's claim only: a tombstone on a fresh nuid that holds no chunks.
    assert subjects(nats_url, bucket_name, _meta_subject(bucket_name, "a")) == {_meta_subject(bucket_name, "a"): 1}
    claim = with_nats(nats_url, lambda nc, js: _info_with_deleted(nc, bucket_name, "a"))
    assert claim is not None and claim["deleted"] is True
    assert claim["nuid"] not in ("", _nuid_of(nats_url, bucket_name, "b"))
    # nats.go Delete("a") purges that fresh nuid: the renamed object's chunks are untouched.
    go_delete(nats_url, bucket_name, "a")
    assert nats_py_get(nats_url, bucket_name, "b") == data
    # nats.js put("a") purges the previous info's nuid: the fresh one again, never the renamed object's.
    js_put(nats_url, bucket_name, "a", b"new a")
    assert nats_py_get(nats_url, bucket_name, "b") == data
    assert wait_for(lambda: (b / "a").exists() and (b / "a").read_bytes() == b"new a")
    assert (b / "b").read_bytes() == data
    # And a directory rename the same way.
    (b / "d").mkdir()
    (b / "d" / "x").write_bytes(data[:1000])
    os.rename(b / "d", b / "e")
    go_delete(nats_url, bucket_name, "d/x")
    assert (b / "e" / "x").read_bytes() == data[:1000]
    assert nats_py_get(nats_url, bucket_name, "e/x") == data[:1000]
    no_errors(m.log())


def test_another_mount_sees_a_rename_at_once(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m1, m2 = mounter(nats_url), mounter(nats_url)
    b1, b2 = m1.path / bucket_name, m2.path / bucket_name
    (b1 / "x").write_bytes(b"payload")
    assert wait_for(lambda: (b2 / "x").exists(), 10)
    os.rename(b1 / "x", b1 / "y")
    assert wait_for(lambda: not (b2 / "x").exists() and (b2 / "y").exists(), 10)
    assert (b2 / "y").read_bytes() == b"payload"
    assert sorted(os.listdir(b2)) == ["y"]
    no_errors(m1.log())
    no_errors(m2.log())


def test_a_tombstone_an_old_natsfs_rename_left_is_purged_so_deletes_cannot_destroy(nats_url, bucket_name,
                                                                                 mounter):
    create_bucket(nats_url, bucket_name)
    data = random.Random(2).randbytes(300_000)
    js_put(nats_url, bucket_name, "old", data)

    async def legacy_rename(nc: Any, js: Any) -> None:
        info = await _info_with_deleted(nc, bucket_name, "old")
        await js.publish(_meta_subject(bucket_name, "new"), json.dumps(dict(info, name="new")).encode(),
                         headers={"Nats-Rollup": "sub"})
        tomb = dict(info, deleted=True, size=0, chunks=0, digest="")
        await js.publish(_meta_subject(bucket_name, "old"), json.dumps(tomb).encode(),
                         headers={"Nats-Rollup": "sub"})

    with_nats(nats_url, legacy_rename)
    m = mounter(nats_url)
    assert (m.path / bucket_name / "new").read_bytes() == data
    assert wait_for(lambda: subjects(nats_url, bucket_name, _meta_subject(bucket_name, "old")) == {}, 15)
    assert m.log().count("purged 1 tombstone(s) carrying the nuid of a live object") == 1
    assert "'old'" in m.log()
    assert go_delete(nats_url, bucket_name, "old") is False
    assert nats_py_get(nats_url, bucket_name, "new") == data


# ---------------------------------------------------------------- names
def test_name_limits(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url, "--max-meta-bytes", "4MiB")
    b = m.path / bucket_name
    with pytest.raises(OSError) as e:
        (b / ("x" * 256)).write_bytes(b"no")
    assert e.value.errno == errno.ENAMETOOLONG
    # A 4000-byte path (made one directory at a time, relative to the last, so the kernel's PATH_MAX
    # is not what refuses it): refused where its meta subject would pass the limit.
    parts = [f"{i:02d}" + "d" * 198 for i in range(20)]
    assert len("/".join(parts)) >= 4000
    fd = os.open(b, os.O_RDONLY | os.O_DIRECTORY)
    made = 0
    try:
        with pytest.raises(OSError) as e:
            for part in parts:
                os.mkdir(part, dir_fd=fd)
                made += 1
                fd, old_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
                os.close(old_fd)
        assert e.value.errno == errno.ENAMETOOLONG and 10 <= made < 20
        with pytest.raises(OSError) as e:
            os.open("f" * 250, os.O_WRONLY | os.O_CREAT, dir_fd=fd)
        assert e.value.errno == errno.ENAMETOOLONG
    finally:
        os.close(fd)
    (b / "after.txt").write_bytes(b"still here")
    assert (b / "after.txt").read_bytes() == b"still here"
    assert nats_py_get(nats_url, bucket_name, "after.txt") == b"still here"
    # A name that is not UTF-8: EILSEQ, and nothing in the bucket.
    before = subjects(nats_url, bucket_name, f"$O.{bucket_name}.>")
    for make in (lambda p: open(p, "wb").close(), os.mkdir, lambda p: os.symlink("after.txt", p)):
        with pytest.raises(OSError) as e:
            make(os.fsencode(b) + b"/bad\xff\xfe")
        assert e.value.errno == errno.EILSEQ
    with pytest.raises(OSError) as e:
        os.rename(b / "after.txt", os.fsencode(b) + b"/bad\xff")
    assert e.value.errno == errno.EILSEQ
    assert subjects(nats_url, bucket_name, f"$O.{bucket_name}.>") == before
    # A meta over the server's max payload (1 MiB): E2BIG, nothing stored.
    value = b"v" * 65000
    with pytest.raises(OSError) as e:
        for i in range(20):
            os.setxattr(b / "after.txt", f"user.k{i}", value)
    assert e.value.errno == errno.E2BIG
    assert nats_py_get(nats_url, bucket_name, "after.txt") == b"still here"
    assert (b / "after.txt").read_bytes() == b"still here"
    no_errors(m.log())


# ---------------------------------------------------------------- leftovers
@pytest.mark.expect_log("flush: .*(no connection to NATS|not stored within)",
                        "big.bin: closed without a successful upload")
def test_a_put_that_fails_while_the_server_is_away_leaves_no_orphan_chunks(private_server, bucket_name, mounter):
    url = private_server.url
    create_bucket(url, bucket_name, atomic=False)  # streamed puts (atomic puts are whole at close)
    m = mounter(url, "--request-timeout", "2s")
    b = m.path / bucket_name
    data = random.Random(3).randbytes(6 * 1024 * 1024)
    fd = os.open(b / "big.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, data)
        # The first 4 MiB are streamed while the file is written.
        assert wait_for(lambda: sum(subjects(url, bucket_name, f"$O.{bucket_name}.C.>").values()) >= 32, 15)
        private_server.stop()
        time.sleep(2.5)  # past the mount's cached "bucket is writable" answer
        with pytest.raises(OSError) as e:
            os.close(fd)
        assert e.value.errno == errno.EIO
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    private_server.start()  # same port, same store
    assert wait_for(lambda: sum(subjects(url, bucket_name, f"$O.{bucket_name}.C.>").values()) == 0, 30), \
        subjects(url, bucket_name, f"$O.{bucket_name}.>")
    assert subjects(url, bucket_name, f"$O.{bucket_name}.M.>") == {}
    assert wait_for(lambda: "the chunks of the unfinished put of 'big.bin'" in m.log(), 10)
    # The mount serves again, and the bytes were kept for the user.
    (b / "after.txt").write_bytes(b"ok")
    assert nats_py_get(url, bucket_name, "after.txt") == b"ok"
    kept = [p for p in (m.cache_dir.rglob("lost+found/*/*")) if p.is_file()]
    assert [p.read_bytes() for p in kept] == [data]


def test_kill_9_with_a_file_open_for_writing(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name, atomic=False)  # streamed puts (atomic puts are whole at close)
    m = mounter(nats_url)
    b = m.path / bucket_name
    data = random.Random(4).randbytes(6 * 1024 * 1024)
    assert m.proc is not None
    # (Before the open: a child process closing an inherited descriptor would flush the file.)
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(m.proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
    fd = os.open(b / "partial.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, data)
        # Its first chunks are streamed to the server while it is still open.
        assert wait_for(lambda: sum(subjects(nats_url, bucket_name, f"$O.{bucket_name}.C.>").values()) >= 32, 15)
        os.kill(m.proc.pid, signal.SIGKILL)
        m.proc.wait()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    # The upload worker ends by itself when its daemon's pipe closes.
    for pid in children:
        if not wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10):
            os.kill(pid, signal.SIGKILL)
    m.remount()  # same cache dir
    line = next((ln for ln in m.log().splitlines() if "left by an earlier run of this mount were moved to" in ln), "")
    assert line, m.log()[-3000:]
    where = line.split(" were moved to ", 1)[1].split(": ", 1)[0]
    found = [Path(p.path) for p in os.scandir(where) if p.is_file()]
    assert [p.read_bytes() for p in found] == [data]
    # The chunks it had streamed are removed by the next mount (its put journal).
    assert wait_for(lambda: sum(subjects(nats_url, bucket_name, f"$O.{bucket_name}.C.>").values()) == 0, 20)
    assert not (b / "partial.bin").exists()
