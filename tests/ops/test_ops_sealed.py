"""A bucket another client seals (or that was sealed before the mount): its entries show without write
bits, soon, without any write attempt, in an all-buckets and in a `--bucket` mount.

The sealed state is read again in the background when a lookup or getattr of any entry of the bucket
comes, at most every `sealed_ttl` per bucket (the request answers from the last known state and never
waits), and by the bucket's watcher at each reconciliation (its STREAM.INFO says it anyway). A read that
finds the state changed has the kernel drop the attributes of every inode of the bucket it knows, so the
next stat asks and shows the new mode (the kernel caches attributes for a minute)."""

from __future__ import annotations

import stat
from typing import Any

import pytest
from opskit import ROOT, Env
from test_ops_upload_races import bucket_b

BUCKET_MODES = pytest.mark.parametrize("single", [False, True], ids=["all-buckets", "--bucket"])


def counting_sealed_reads(monkeypatch: pytest.MonkeyPatch, env: Env) -> list[str]:
    """The STREAM.INFO requests the mount sends to learn whether a bucket is sealed (not the watcher's)."""
    reads: list[str] = []
    real = env.store.bucket_status

    async def counted(bucket: str) -> Any:
        reads.append(bucket)
        return await real(bucket)

    monkeypatch.setattr(env.store, "bucket_status", counted)
    return reads


def writable(attrs: Any) -> bool:
    return bool(stat.S_IMODE(attrs.st_mode) & 0o222)


def prefix(single: bool) -> str:
    return "" if single else "b/"


@BUCKET_MODES
def test_a_getattr_of_any_entry_rereads_the_sealed_state_in_the_background_and_drops_stale_modes(
        ops_env, single):
    """After another client sealed the bucket, a getattr of a file answers at once from the state known
    (with write bits) and has it read again; that read finds the seal and has the kernel drop the
    attributes of the bucket's inodes it knows (the file, its directory, the bucket's directory or a
    `--bucket` mount's root), whose next getattr shows them without write bits. Only a lookup of the
    bucket directory read it again (the kernel caches it for a minute; a `--bucket` mount never looks
    its bucket up)."""
    async def body(env: Env) -> None:
        p = prefix(single)
        f = await env.lookup(f"{p}old")
        d = await env.lookup(f"{p}d")
        top = ROOT if single else (await env.lookup("b")).st_ino
        assert writable(f) and writable(d)
        await env.settle()
        await env.store.seal_bucket("b")
        env.fs.kernel.sent.clear()
        assert writable(await env.ops.getattr(f.st_ino, None))  # (answered from what was known)
        await env.settle()
        dropped = {ino for kind, ino, _ in env.fs.kernel.sent if kind == "attr"}
        assert {f.st_ino, d.st_ino, top} <= dropped
        for ino in (f.st_ino, d.st_ino, top):
            assert not writable(await env.ops.getattr(ino, None))

    ops_env(body, setup=bucket_b, bucket="b" if single else None, sealed_ttl=0)


@BUCKET_MODES
def test_lookups_and_getattrs_reread_the_sealed_state_at_most_once_per_sealed_ttl(ops_env, monkeypatch, single):
    """However many lookups and getattrs come, the state is read again at most once per `sealed_ttl`
    per bucket (here an hour: once, at the first of them), and none of them waits for it."""
    async def body(env: Env) -> None:
        reads = counting_sealed_reads(monkeypatch, env)
        p = prefix(single)
        f = await env.lookup(f"{p}old")
        await env.settle()
        before = len(reads)
        await env.store.seal_bucket("b")
        for _ in range(20):
            assert writable(await env.lookup(f"{p}old"))
            assert writable(await env.ops.getattr(f.st_ino, None))
            await env.settle()
        assert len(reads) == before  # the last read is less than an hour old: the known state stands

    ops_env(body, setup=bucket_b, bucket="b" if single else None, sealed_ttl=3600)


@BUCKET_MODES
def test_the_watchers_reconciliation_notices_a_seal_and_drops_stale_modes(ops_env, monkeypatch, single):
    """With no request to have it read again (the kernel answers stats from what it caches), the bucket's
    watcher notices the seal at its next reconciliation, whose STREAM.INFO says so: the kernel drops the
    attributes of the bucket's inodes, and they show without write bits, with no read of the mount's own."""
    async def body(env: Env) -> None:
        reads = counting_sealed_reads(monkeypatch, env)
        p = prefix(single)
        f = await env.lookup(f"{p}old")
        await env.settle()
        before = len(reads)
        await env.store.seal_bucket("b")
        env.fs.kernel.sent.clear()
        await env.ns._buckets["b"].reconcile()
        assert f.st_ino in {ino for kind, ino, _ in env.fs.kernel.sent if kind == "attr"}
        assert not writable(await env.ops.getattr(f.st_ino, None))
        assert not writable(await env.lookup(f"{p}d"))
        assert len(reads) == before

    ops_env(body, setup=bucket_b, bucket="b" if single else None, sealed_ttl=3600)


@BUCKET_MODES
def test_a_bucket_sealed_before_the_mount_shows_without_write_bits_from_the_start(ops_env, single):
    """The state the bucket's watch found when it started counts: nothing else need be read."""
    async def seal_first(ms: Any, store: Any) -> None:
        await bucket_b(ms, store)
        await store.seal_bucket("b")

    async def body(env: Env) -> None:
        p = prefix(single)
        assert not writable(await env.lookup(f"{p}old"))
        assert not writable(await env.lookup(f"{p}d"))
        assert not writable(await env.ops.getattr(ROOT if single else (await env.lookup("b")).st_ino, None))

    ops_env(body, setup=seal_first, bucket="b" if single else None, sealed_ttl=3600)
