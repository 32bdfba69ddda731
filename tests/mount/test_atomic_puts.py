"""Atomic puts on a real server (nats-server >= 2.12): natsfs-created buckets allow atomic batches (and keep
the flag when sealed), a file closed before the streaming threshold is one batch, and a put of a few
hundred chunks (streamed while written) cut off by `kill -9` of the daemon at several points leaves the
old version or the new one, never a mix, and never orphans once the mount is back."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from helpers import create_bucket, nats_py_get, nats_py_put, wait_for, with_nats, with_store

MiB = 1024 * 1024


def stream_config(url: str, bucket: str) -> Any:
    async def fn(nc: Any, js: Any) -> Any:
        return (await js.stream_info(f"OBJ_{bucket}")).config

    return with_nats(url, fn)


def chunk_total(url: str, bucket: str) -> int:
    async def fn(nc: Any, js: Any) -> int:
        info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
        return sum((info.state.subjects or {}).values())

    return with_nats(url, fn)


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M." + base64.urlsafe_b64encode(name.encode()).decode()


def fsck_clean(url: str, bucket: str) -> bool:
    r = subprocess.run([sys.executable, "-m", "natsfs", "fsck", bucket, "--server", url, "--grace", "0", "--verify"],
                       capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and r.stdout.strip().endswith(": clean")


def test_natsfs_buckets_allow_atomic_batches_and_keep_the_flag(nats_url, bucket_name):
    create_bucket(nats_url, bucket_name)
    assert stream_config(nats_url, bucket_name).allow_atomic is True
    with_store(nats_url, lambda s: s.update_bucket(bucket_name, lambda c: c.update(description="d")))
    with_store(nats_url, lambda s: s.seal_bucket(bucket_name))
    cfg = stream_config(nats_url, bucket_name)
    assert cfg.allow_atomic is True and cfg.sealed and cfg.description == "d"
    plain = bucket_name + "_plain"
    subprocess.run([sys.executable, "-m", "natsfs", "bucket", "--server", nats_url, "create", plain, "--no-atomic"],
                   check=True, timeout=60)
    assert not stream_config(nats_url, plain).allow_atomic


def test_a_mount_puts_a_small_file_as_one_batch(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    data = random.Random(7).randbytes(3 * MiB)  # 24 chunks, under the 4 MiB streaming threshold: one batch
    (m.path / bucket_name / "f.bin").write_bytes(data)
    assert nats_py_get(nats_url, bucket_name, "f.bin") == data

    async def batch_headers(nc: Any, js: Any) -> list[dict[str, str]]:
        obs = await js.object_store(bucket_name)
        info = await obs.get_info("f.bin")
        out = []
        for subject in (f"$O.{bucket_name}.C.{info.nuid}", meta_subject(bucket_name, "f.bin")):
            msg = await js.get_last_msg(f"OBJ_{bucket_name}", subject)
            out.append({k: v for k, v in (msg.headers or {}).items() if k.startswith("Nats-")})
        return out

    last_chunk, meta = with_nats(nats_url, batch_headers)
    # The server stores the batch headers with the messages: the last chunk and the meta were one batch.
    assert last_chunk["Nats-Batch-Id"] == meta["Nats-Batch-Id"]
    assert last_chunk["Nats-Batch-Sequence"] == "24" and meta["Nats-Batch-Sequence"] == "25"
    assert meta["Nats-Batch-Commit"] == "1"
    assert "ERROR" not in m.log()


def _put_and_kill(url: str, bucket: str, m: Any, data: bytes, delay: float | None) -> float:
    """Write `data` over f.bin and close it on a thread; kill -9 the daemon `delay` s after the close
    began (None: right after the meta changed). Returns how long the close ran (if it returned first)."""
    assert m.proc is not None
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(m.proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
    fd = os.open(m.path / bucket / "f.bin", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, data)
    started = time.monotonic()
    done = threading.Event()

    ran: list[float] = []

    def close() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)
        ran.append(time.monotonic() - started)
        done.set()

    t = threading.Thread(target=close)
    t.start()
    if delay is None:
        before = with_store(url, lambda s: s.get_info(bucket, "f.bin")).revision
        wait_for(lambda: with_store(url, lambda s: s.get_info(bucket, "f.bin")).revision != before, 30,
                 interval=0.001)
    else:
        done.wait(delay)
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait()
    t.join(30)
    for pid in children:  # the idle upload worker and notifier would end by themselves a little later
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return ran[0]


def _digest(data: bytes) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


def _stored_version(url: str, bucket: str) -> tuple[str, int, int]:
    """(digest, chunks) the meta of f.bin names, and how many chunks its nuid has on the server."""

    async def fn(nc: Any, js: Any) -> tuple[str, int, int]:
        info = await (await js.object_store(bucket)).get_info("f.bin")
        st = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.{info.nuid}")
        return info.digest, info.chunks, sum((st.state.subjects or {}).values())

    return with_nats(url, fn)


def test_kill_9_at_several_points_of_an_atomic_put_leaves_old_or_new(nats_url, bucket_name, mounter):
    url, b = nats_url, bucket_name
    create_bucket(url, b)
    old = random.Random(8).randbytes(300_000)
    nats_py_put(url, b, "f.bin", old, create=False)
    m = mounter(url)
    rng = random.Random(9)
    size = 16 * MiB  # 128 chunks
    # How long one put of this size takes here (killed only after its close returned).
    versions = [old, rng.randbytes(size)]
    full = _put_and_kill(url, b, m, versions[-1], 60.0)
    outcomes = []
    for point in (0.05, 0.3, 0.6, 0.9, None):  # early chunks, late chunks, around the commit, after it
        m.remount()
        current = _stored_version(url, b)
        new = rng.randbytes(size)
        versions.append(new)
        _put_and_kill(url, b, m, new, None if point is None else point * full)
        digest, chunks, stored = _stored_version(url, b)
        assert digest in (current[0], _digest(new)) and stored == chunks, "a mix of versions"
        outcomes.append("new" if digest == _digest(new) else "old")
    assert outcomes[-1] == "new", outcomes  # killed after the meta changed
    # The old version's chunks a kill right after the commit left are the next mount's to purge.
    m.remount()
    assert wait_for(lambda: fsck_clean(url, b), 30)
    assert chunk_total(url, b) == 128
    final = nats_py_get(url, b, "f.bin")
    assert final in versions and (m.path / b / "f.bin").read_bytes() == final
