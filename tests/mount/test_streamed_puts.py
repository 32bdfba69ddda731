"""Large files written through the mount are streamed while they are written, in atomic buckets too, and
what another client reads back is exact: after `cp`, after `kill -9` of the daemon in the middle of a `cp`
(no meta, no orphan chunk once the next mount has settled its put journal), and after a server restart
in the middle of a `cp`. The upload worker keeps at most its window of acks outstanding (its own count)
and publishes byte-exact chunks with their message ids."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import create_bucket, nats_py_get, wait_for, with_nats

MiB = 1024 * 1024
CHUNK = 128 * 1024


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M." + base64.urlsafe_b64encode(name.encode()).decode()


def subjects(url: str, bucket: str, filt: str) -> dict[str, int]:
    async def fn(nc: Any, js: Any) -> dict[str, int]:
        info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=filt)
        return dict(info.state.subjects or {})

    return with_nats(url, fn)


def chunk_total(url: str, bucket: str) -> int:
    return sum(subjects(url, bucket, f"$O.{bucket}.C.>").values())


def meta_of(url: str, bucket: str, name: str) -> dict[str, Any] | None:
    """The meta another client finds under `name` (None: nothing stored there)."""

    async def fn(nc: Any, js: Any) -> dict[str, Any] | None:
        m = await nc.request(f"$JS.API.DIRECT.GET.OBJ_{bucket}.{_meta_subject(bucket, name)}", b"", timeout=5)
        if m.headers and m.headers.get("Status") == "404":
            return None
        return json.loads(m.data)

    return with_nats(url, fn)


def last_chunk_headers(url: str, bucket: str, nuid: str) -> dict[str, str]:
    async def fn(nc: Any, js: Any) -> dict[str, str]:
        msg = await js.get_last_msg(f"OBJ_{bucket}", f"$O.{bucket}.C.{nuid}")
        return dict(msg.headers or {})

    return with_nats(url, fn)


def digest(data: bytes) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


class FifoCp:
    """`cp FIFO DEST` in a child process, fed from this test: a `cp` that can be caught in the middle."""

    def __init__(self, tmp: Path, dest: Path):
        self.fifo = tmp / "src.fifo"
        os.mkfifo(self.fifo)
        self.proc = subprocess.Popen(["cp", str(self.fifo), str(dest)], stderr=subprocess.PIPE)
        self.fd = os.open(self.fifo, os.O_WRONLY)  # opens once cp has opened the other end

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def finish(self) -> int:
        os.close(self.fd)
        return self.proc.wait(60)

    def abandon(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def children_of(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def test_cp_into_an_atomic_bucket_is_streamed_and_read_back_byte_for_byte(nats_url, bucket_name, mounter, tmp_path):
    create_bucket(nats_url, bucket_name)  # allows atomic batches: a file past 4 MiB is streamed anyway
    m = mounter(nats_url)
    data = random.Random(11).randbytes(20 * MiB + 12345)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    subprocess.run(["cp", str(src), str(m.path / bucket_name / "big.bin")], check=True, timeout=120)
    meta = meta_of(nats_url, bucket_name, "big.bin")
    assert meta is not None
    assert meta["size"] == len(data) and meta["chunks"] == -(-len(data) // CHUNK) and meta["digest"] == digest(data)
    assert nats_py_get(nats_url, bucket_name, "big.bin") == data
    # Streamed in the nats.go order, not held for one batch at close; every chunk has its message id.
    headers = last_chunk_headers(nats_url, bucket_name, meta["nuid"])
    assert "Nats-Batch-Id" not in headers and headers["Nats-Msg-Id"] == f"{meta['nuid']}.{meta['chunks'] - 1}"
    assert chunk_total(nats_url, bucket_name) == meta["chunks"]  # nothing else left behind
    assert (m.path / bucket_name / "big.bin").read_bytes() == data


def test_kill_9_in_the_middle_of_a_cp_leaves_no_meta_and_no_orphan_chunks(nats_url, bucket_name, mounter, tmp_path):
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    assert m.proc is not None
    helpers_before = children_of(m.proc.pid)  # (before cp starts: it is a child of this test, not the daemon)
    data = random.Random(12).randbytes(12 * MiB)
    cp = FifoCp(tmp_path, m.path / bucket_name / "partial.bin")
    try:
        cp.feed(data)
        # Its first ranges are on the server while cp still has the file open.
        assert wait_for(lambda: chunk_total(nats_url, bucket_name) >= 32, 30)
        assert meta_of(nats_url, bucket_name, "partial.bin") is None
        os.kill(m.proc.pid, signal.SIGKILL)
        m.proc.wait()
    finally:
        cp.abandon()
    assert cp.proc.returncode != 0  # the mount went away under it
    for pid in helpers_before:  # the upload worker and notifier end by themselves once the daemon is gone
        if not wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10):
            os.kill(pid, signal.SIGKILL)
    assert meta_of(nats_url, bucket_name, "partial.bin") is None  # never a meta without all its chunks
    m.remount()  # same cache dir: its put journal names the streamed nuid
    assert wait_for(lambda: chunk_total(nats_url, bucket_name) == 0, 30), subjects(nats_url, bucket_name, ">")
    assert meta_of(nats_url, bucket_name, "partial.bin") is None
    assert not (m.path / bucket_name / "partial.bin").exists()
    # The bytes that reached the daemon were kept for the user.
    kept = [p for p in m.cache_dir.rglob("lost+found/leftover/*") if p.is_file()]
    assert len(kept) == 1 and data.startswith(kept[0].read_bytes()) and kept[0].stat().st_size >= 4 * MiB


@pytest.mark.expect_log("streaming upload stopped")
def test_a_server_restart_in_the_middle_of_a_cp_stores_the_whole_file(private_server, bucket_name, mounter,
                                                                      tmp_path):
    url = private_server.url
    create_bucket(url, bucket_name)
    m = mounter(url)
    rng = random.Random(13)
    head, tail = rng.randbytes(10 * MiB), rng.randbytes(6 * MiB + 777)
    cp = FifoCp(tmp_path, m.path / bucket_name / "f.bin")
    try:
        cp.feed(head)
        assert wait_for(lambda: chunk_total(url, bucket_name) >= 32, 30)
        private_server.stop()
        private_server.start()  # same port, same store
        cp.feed(tail)
        assert cp.finish() == 0, cp.proc.stderr.read() if cp.proc.stderr else ""
    finally:
        cp.abandon()
    data = head + tail
    meta = meta_of(url, bucket_name, "f.bin")
    assert meta is not None and meta["digest"] == digest(data)
    assert nats_py_get(url, bucket_name, "f.bin") == data
    # Chunks of the interrupted stream are settled by the mount: only the stored version's stay.
    assert wait_for(lambda: chunk_total(url, bucket_name) == meta["chunks"], 30), subjects(url, bucket_name, ">")


def test_the_upload_worker_keeps_at_most_its_window_of_acks_outstanding(nats_url, bucket_name, tmp_path):
    create_bucket(nats_url, bucket_name, atomic=False)
    data = random.Random(14).randbytes(6 * MiB + 1000)
    spool = tmp_path / "spool.bin"
    spool.write_bytes(data)
    nuid, window = "WorkerWindowTest0000000", 8
    subject = f"$O.{bucket_name}.C.{nuid}"
    proc = subprocess.Popen([sys.executable, "-I", "-m", "natsfs.bridge", "upload-worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps({"servers": [nats_url]}).encode() + b"\n")
        replies = []
        for rid, (start, end) in enumerate(((0, 4 * MiB), (4 * MiB, len(data))), 1):
            req = {"id": rid, "op": "send", "session": nuid, "subject": subject, "path": str(spool), "start": start,
                   "end": end, "chunk_size": CHUNK, "window": window}
            proc.stdin.write(json.dumps(req).encode() + b"\n")
        proc.stdin.flush()
        replies += [json.loads(proc.stdout.readline()) for _ in range(2)]
        # (As the daemon does: the digest once its ranges are answered.)
        proc.stdin.write(json.dumps({"id": 3, "op": "digest", "session": nuid}).encode() + b"\n")
        proc.stdin.flush()
        replies.append(json.loads(proc.stdout.readline()))
    finally:
        proc.stdin.close()
        proc.wait(30)
    by_id = {r["id"]: r for r in replies}
    assert "error" not in by_id[1] and "error" not in by_id[2], replies
    assert by_id[1]["chunks"] + by_id[2]["chunks"] == -(-len(data) // CHUNK)
    # Pipelined, and never more than the window unacknowledged (the worker's own count).
    assert 1 < by_id[2]["most_in_flight"] <= window
    assert bytes.fromhex(by_id[3]["digest"]) == hashlib.sha256(data).digest()

    async def read_back(nc: Any, js: Any) -> tuple[bytes, list[str]]:
        sub = await js.subscribe(subject, ordered_consumer=True)
        out, ids = [], []
        for _ in range(-(-len(data) // CHUNK)):
            msg = await sub.next_msg(timeout=10)
            out.append(msg.data)
            ids.append((msg.headers or {}).get("Nats-Msg-Id", ""))
        await sub.unsubscribe()
        return b"".join(out), ids

    stored, ids = with_nats(nats_url, read_back)
    assert stored == data
    assert ids == [f"{nuid}.{i}" for i in range(len(ids))]

