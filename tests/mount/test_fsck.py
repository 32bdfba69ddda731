"""`natsfs fsck` against a real server: injected orphans, a meta missing a chunk and a tombstone sharing a
live nuid are found, `--repair` fixes what it can and leaves real objects byte-exact; a `kill -9` in the
middle of a large put leaves no partial object, and the leftovers go with `fsck --repair` or the next mount."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
from typing import Any

from helpers import create_bucket, nats_py_get, nats_py_put, wait_for, with_nats, with_store

from natsfs.fsck import IN_PROGRESS, check_bucket


def fsck(url: str, bucket: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "natsfs", "fsck", bucket, "--server", url, *args],
                          capture_output=True, text=True, timeout=120)


def chunk_counts(url: str, bucket: str) -> dict[str, int]:
    async def fn(nc: Any, js: Any) -> dict[str, int]:
        info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
        return dict(info.state.subjects or {})

    return with_nats(url, fn)


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M." + base64.urlsafe_b64encode(name.encode()).decode()


def test_fsck_finds_injected_damage_and_repairs_what_it_can(nats_url, bucket_name):
    url, b = nats_url, bucket_name
    create_bucket(url, b)
    a = random.Random(1).randbytes(300_000)
    keep = random.Random(2).randbytes(50_000)
    nats_py_put(url, b, "a", a, create=False)
    nats_py_put(url, b, "keep", keep, create=False)
    orphan_nuid = secrets.token_hex(11)

    async def inject(nc: Any, js: Any) -> str:
        # An interrupted put: chunks no meta references.
        for _ in range(3):
            await js.publish(f"$O.{b}.C.{orphan_nuid}", b"o" * 1000)
        # A meta whose second chunk is gone.
        nuid = secrets.token_hex(11)
        seqs = [(await js.publish(f"$O.{b}.C.{nuid}", bytes([i]) * 1000)).seq for i in range(3)]
        meta = {"name": "broken", "bucket": b, "nuid": nuid, "size": 3000, "chunks": 3,
                "mtime": "0001-01-01T00:00:00Z", "digest": ""}
        await js.publish(meta_subject(b, "broken"), json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
        await nc.request(f"$JS.API.STREAM.MSG.DELETE.OBJ_{b}", json.dumps({"seq": seqs[1]}).encode(), timeout=5)
        # A tombstone carrying live "a"'s nuid (as an old rename left them).
        obs = await js.object_store(b)
        live = await obs.get_info("a")
        tomb = {"name": "ghost", "bucket": b, "nuid": live.nuid, "size": 0, "chunks": 0,
                "mtime": "0001-01-01T00:00:00Z", "deleted": True}
        await js.publish(meta_subject(b, "ghost"), json.dumps(tomb).encode(), headers={"Nats-Rollup": "sub"})
        return live.nuid

    with_nats(url, inject)
    orphan = f"$O.{b}.C.{orphan_nuid}"

    # Young chunks without a meta are a put in progress (a live mount's), not orphans.
    young = fsck(url, b)
    assert young.returncode == 1, young.stdout + young.stderr
    assert f"put in progress: {orphan}: 3 chunks" in young.stdout
    assert "damaged object: broken: 1 of 3 chunks missing" in young.stdout
    assert "tombstone sharing a live nuid: ghost" in young.stdout

    found = fsck(url, b, "--grace", "0")
    assert found.returncode == 1
    assert f"orphan chunks: {orphan}: 3 chunks no meta references" in found.stdout
    assert orphan in chunk_counts(url, b)  # reported, not touched

    repaired = fsck(url, b, "--repair", "--grace", "0")
    assert repaired.returncode == 1, repaired.stdout  # the damaged object cannot be repaired without guessing
    assert f"orphan chunks: {orphan}" in repaired.stdout and "tombstone sharing" in repaired.stdout
    assert repaired.stdout.count("[repaired]") == 2
    assert orphan not in chunk_counts(url, b)
    assert nats_py_get(url, b, "a") == a and nats_py_get(url, b, "keep") == keep

    async def ghost_gone(nc: Any, js: Any) -> bool:
        m = await nc.request(f"$JS.API.DIRECT.GET.OBJ_{b}.{meta_subject(b, 'ghost')}", b"", timeout=5)
        return bool(m.headers) and m.headers.get("Status") == "404"

    assert with_nats(url, ghost_gone)

    async def delete_broken(nc: Any, js: Any) -> None:
        await (await js.object_store(b)).delete("broken")

    with_nats(url, delete_broken)
    clean = fsck(url, b, "--verify", "--grace", "0")
    assert clean.returncode == 0, clean.stdout
    assert clean.stdout.strip().endswith(": clean")


def test_fsck_of_a_missing_bucket_or_server_is_an_error(nats_url, bucket_name):
    r = fsck(nats_url, bucket_name)
    assert r.returncode == 2 and "natsfs fsck:" in r.stderr and "Traceback" not in r.stderr


def _kill_mid_put(url: str, bucket: str, mounter) -> tuple[Any, bytes]:
    """A mount killed with -9 while a large file's chunks are being sent (a bucket without atomic
    batches: streamed while written)."""
    create_bucket(url, bucket, atomic=False)
    nats_py_put(url, bucket, "big.bin", b"old version", create=False)
    m = mounter(url)
    assert m.proc is not None
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(m.proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
    data = random.Random(5).randbytes(12 * 1024 * 1024)
    fd = os.open(m.path / bucket / "big.bin", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, data)
        assert wait_for(lambda: sum(chunk_counts(url, bucket).values()) >= 32, 15)
        os.kill(m.proc.pid, signal.SIGKILL)
        m.proc.wait()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    for pid in children:  # the upload worker ends when its daemon's pipe closes
        if not wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10):
            os.kill(pid, signal.SIGKILL)
    # No partial object: other clients see the old version.
    assert nats_py_get(url, bucket, "big.bin") == b"old version"
    return m, data


def test_kill_9_mid_put_then_fsck_repair_removes_the_leftovers(nats_url, bucket_name, mounter):
    m, _ = _kill_mid_put(nats_url, bucket_name, mounter)
    m.stop()  # the dead mount's kernel side (no remount: its journal is not replayed)
    found = fsck(nats_url, bucket_name, "--grace", "0")
    assert found.returncode == 1 and "orphan chunks:" in found.stdout, found.stdout
    repaired = fsck(nats_url, bucket_name, "--repair", "--grace", "0")
    assert repaired.returncode == 0, repaired.stdout
    assert fsck(nats_url, bucket_name, "--grace", "0").stdout.strip().endswith(": clean")
    assert nats_py_get(nats_url, bucket_name, "big.bin") == b"old version"


def test_kill_9_mid_put_then_the_next_mount_removes_the_leftovers(nats_url, bucket_name, mounter):
    m, _ = _kill_mid_put(nats_url, bucket_name, mounter)
    m.remount()  # same cache dir: its put journal names the unfinished put
    assert wait_for(lambda: fsck(nats_url, bucket_name, "--grace", "0").returncode == 0, 30), \
        fsck(nats_url, bucket_name, "--grace", "0").stdout
    assert (m.path / bucket_name / "big.bin").read_bytes() == b"old version"
    assert nats_py_get(nats_url, bucket_name, "big.bin") == b"old version"


def test_fsck_repair_leaves_a_put_in_progress_alone(nats_url, bucket_name, mounter):
    url, b = nats_url, bucket_name
    create_bucket(url, b, atomic=False)  # streamed while written: chunks without a meta for a while
    m = mounter(url)
    data = random.Random(6).randbytes(6 * 1024 * 1024)
    fd = os.open(m.path / b / "growing.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, data)
        assert wait_for(lambda: sum(chunk_counts(url, b).values()) >= 32, 15)
        # In this process: a child would close the inherited descriptor at exec, which flushes the file.
        report = with_store(url, lambda store: check_bucket(store, b, repair=True))
        assert [(f.kind, f.repaired) for f in report.findings] == [(IN_PROGRESS, False)]
        assert not report.problems_left
    finally:
        os.close(fd)
    assert nats_py_get(url, b, "growing.bin") == data
    assert fsck(url, b, "--grace", "0").stdout.strip().endswith(": clean")
    assert "ERROR" not in m.log()
