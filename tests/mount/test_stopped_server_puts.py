"""Closes while the server is stopped (SIGSTOP: the connection stays open, nothing is answered): every
close fails with EIO on time, and once the server goes on (SIGCONT) and the daemon has settled the puts
it could not finish, the bucket holds for every file either no meta or a meta whose every chunk is there
with the right bytes. The server stores a stream's publishes in order from a queue but answers reads and
purges elsewhere: a settle that read "no meta" while the meta still sat in that queue purged the chunks,
and the meta was stored after them (a meta without chunks: nats-py `get()` hangs, the mount says ESTALE).

Real mount, real server, fresh nats-py reads with timeouts (a broken object fails the test, never hangs it).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import create_bucket, stop_process, wait_for, with_nats

ROUNDS = 6

# Writes the bytes of argv[2] into argv[1] (created), fsyncs when argv[3] == "fsync", closes; prints the
# outcome of each step ("ok" or the errno's name).
_WRITER = """
import errno, os, sys
data = open(sys.argv[2], "rb").read()
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, data)
out = []
if sys.argv[3] == "fsync":
    try:
        os.fsync(fd)
        out.append("fsync ok")
    except OSError as e:
        out.append("fsync " + errno.errorcode[e.errno])
try:
    os.close(fd)
    out.append("close ok")
except OSError as e:
    out.append("close " + errno.errorcode[e.errno])
print(" ".join(out), flush=True)
"""

# name -> (size, fsync before close): as the fault tester's t11 (one large file through the upload
# worker, two small ones put with one round trip).
FILES = {"a": (4 * 1024 * 1024, False), "b": (100_000, True), "c": (1000, False)}



def _unfinished_puts(mountpoint: Path) -> int:
    return int(json.loads(os.getxattr(mountpoint, "user.natsfs.stats"))["unfinished_puts"])


def _orphan_chunk_subjects(url: str, bucket: str) -> list[str]:
    """The chunk subjects of `bucket` no live meta references (read by a fresh nats-py client)."""

    async def fn(nc: Any, js: Any) -> list[str]:
        stream = f"OBJ_{bucket}"
        request = json.dumps({"subjects_filter": f"$O.{bucket}.>"}).encode()
        info = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{stream}", request, timeout=10)).data)
        subjects = info["state"].get("subjects") or {}
        in_use = set()
        for subject in subjects:
            if f"$O.{bucket}.M." in subject:
                meta = json.loads((await nc.request(f"$JS.API.DIRECT.GET.{stream}.{subject}", b"", timeout=10)).data)
                if not meta.get("deleted"):
                    in_use.add(f"$O.{bucket}.C.{meta['nuid']}")
        return sorted(s for s in subjects if f"$O.{bucket}.C." in s and s not in in_use)

    return with_nats(url, lambda nc, js: asyncio.wait_for(fn(nc, js), 60))


def _what_the_bucket_holds(url: str, bucket: str, name: str) -> dict[str, Any] | None:
    """None if `name` has no live meta; else its meta's size, chunk count and digest, and what its chunk
    subject holds (count, bytes' digest), read one message at a time with a timeout on each request."""

    async def fn(nc: Any, js: Any) -> dict[str, Any] | None:
        stream = f"OBJ_{bucket}"
        key = base64.urlsafe_b64encode(name.encode()).decode()
        reply = await nc.request(f"$JS.API.DIRECT.GET.{stream}.$O.{bucket}.M.{key}", b"", timeout=10)
        if reply.headers and reply.headers.get("Status") == "404":
            return None
        meta = json.loads(reply.data)
        if meta.get("deleted"):
            return None
        subject = f"$O.{bucket}.C.{meta['nuid']}"
        hasher = hashlib.sha256()
        count = 0
        seq = 1
        while count <= int(meta.get("chunks", 0)):  # bounded: one more than the meta says, at most
            body = json.dumps({"seq": seq, "next_by_subj": subject}).encode()
            msg = await nc.request(f"$JS.API.DIRECT.GET.{stream}", body, timeout=10)
            if msg.headers and msg.headers.get("Status") == "404":
                break
            hasher.update(msg.data or b"")
            count += 1
            seq = int(msg.headers["Nats-Sequence"]) + 1
        digest = "SHA-256=" + base64.urlsafe_b64encode(hasher.digest()).decode()
        return {"size": meta.get("size"), "chunks": meta.get("chunks"), "digest": meta.get("digest"),
                "stored_chunks": count, "stored_digest": digest}

    return with_nats(url, lambda nc, js: asyncio.wait_for(fn(nc, js), 60))


@pytest.mark.expect_log(
    r"(flush|fsync): b/r\d+/[abc]: not stored within",
    r"b/r\d+/[abc]: closed without a successful upload",
)
def test_closes_while_the_server_is_stopped_leave_no_meta_without_its_chunks(private_server, mounter, tmp_path):
    url = private_server.url
    create_bucket(url, "b")
    m = mounter(url, "--flush-timeout", "2s")
    assert private_server.proc is not None
    server_pid = private_server.proc.pid
    for r in range(ROUNDS):
        (m.path / "b" / f"r{r}").mkdir()
        want: dict[str, bytes] = {}
        for name, (size, _) in FILES.items():
            want[name] = os.urandom(size)
            (tmp_path / f"want.{name}").write_bytes(want[name])
        stop_process(server_pid)
        try:
            writers = {name: subprocess.Popen(
                [sys.executable, "-c", _WRITER, str(m.path / "b" / f"r{r}" / name), str(tmp_path / f"want.{name}"),
                 "fsync" if fsync else "-"], stdout=subprocess.PIPE, text=True)
                for name, (_, fsync) in FILES.items()}
            outcomes = {name: w.communicate(timeout=120)[0].strip() for name, w in writers.items()}
        finally:
            os.kill(server_pid, signal.SIGCONT)
        for name, outcome in outcomes.items():
            assert outcome.endswith("close EIO"), (r, name, outcome)  # on time, the bytes in lost+found
        assert wait_for(lambda: _unfinished_puts(m.path) == 0, timeout=120, interval=0.2), m.log()[-3000:]
        # Settled: no chunk of a put that was given up is left (not even one the upload worker published
        # after the put's purge: it is purged only once the worker said it sends nothing more of it).
        assert _orphan_chunk_subjects(url, "b") == [], r
        for name in FILES:
            held = _what_the_bucket_holds(url, "b", f"r{r}/{name}")
            if held is None:
                continue  # not stored: fine, the close said EIO
            whole = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(want[name]).digest()).decode()
            assert held == {"size": len(want[name]), "chunks": held["chunks"], "digest": whole,
                            "stored_chunks": held["chunks"], "stored_digest": whole}, (r, name)
