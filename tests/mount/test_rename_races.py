"""Two real mounts of one bucket racing a rename against an unlink, or two renames of one name (a tester's
rounds, F1/F2): whatever the timing, exactly one wins, the loser fails with ENOENT (or ESTALE) and leaves
nothing behind, and the bucket never holds a live name without its chunks nor two live names on one nuid.
Checked through nats-py (another client) and `natsfs fsck`; no assertion rests on timing."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import create_bucket, wait_for, with_nats

ROUNDS = 24
T = 15.0


def live_objects(url: str, bucket: str) -> dict[str, tuple[str, bytes | None]]:
    """name -> (nuid, bytes, or None when nats-py cannot get them) of every live object, as nats-py sees it."""
    import asyncio

    async def fn(nc: Any, js: Any) -> dict[str, tuple[str, bytes | None]]:
        obs = await js.object_store(bucket)
        out: dict[str, tuple[str, bytes | None]] = {}
        try:
            infos = await obs.list()
        except Exception:  # nats-py: no objects at all
            return out
        for info in infos:
            if info.deleted:
                continue
            try:
                data: bytes | None = (await asyncio.wait_for(obs.get(info.name), 10)).data
            except Exception:
                data = None
            out[info.name] = (info.nuid, data)
        return out

    return with_nats(url, fn)


def at_once(*calls: Callable[[], None]) -> list[str]:
    """Run the calls in threads released together; each one's outcome: "ok" or its errno's name."""
    barrier = threading.Barrier(len(calls))
    results = [""] * len(calls)

    def run(i: int, call: Callable[[], None]) -> None:
        barrier.wait()
        try:
            call()
            results[i] = "ok"
        except OSError as e:
            results[i] = errno.errorcode[e.errno or 0]

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def check_invariants(url: str, bucket: str) -> dict[str, bytes | None]:
    objects = live_objects(url, bucket)
    nuids = [nuid for nuid, _ in objects.values()]
    assert len(nuids) == len(set(nuids)), f"two live names on one nuid: {sorted(objects)}"
    damaged = [n for n, (_, data) in objects.items() if data is None]
    assert not damaged, f"live names whose bytes cannot be read: {damaged}"
    return {n: data for n, (_, data) in objects.items()}


def fsck_clean(url: str, bucket: str) -> None:
    # (--grace 0: the rounds' orphaned chunks, if any, are reported as orphans, never as damage)
    done = subprocess.run([sys.executable, "-m", "natsfs", "fsck", bucket, "--server", url],
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "damaged" not in out and "sharing one nuid" not in out, out


def test_a_rename_racing_an_unlink_in_another_mount_never_loses_the_renamed_file(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    a, b = mounter(nats_url), mounter(nats_url)
    for r in range(ROUNDS):
        _rename_against_unlink(nats_url, bucket_name, a.path / bucket_name, b.path / bucket_name, r)
    fsck_clean(nats_url, bucket_name)


def _rename_against_unlink(url: str, bucket: str, da: Path, db: Path, r: int) -> None:
    data = os.urandom(3000 + 40000 * (r % 4))
    f, g = f"f{r}", f"g{r}"
    (da / f).write_bytes(data)
    assert wait_for(lambda: (db / f).exists(), T)
    renamed, unlinked = at_once(lambda: os.rename(da / f, da / g), lambda: os.unlink(db / f))
    assert renamed in ("ok", "ENOENT", "ESTALE") and unlinked in ("ok", "ENOENT"), (r, renamed, unlinked)
    objects = check_invariants(url, bucket)
    assert (renamed == "ok") != (unlinked == "ok"), (r, renamed, unlinked, sorted(objects))  # exactly one wins
    assert f not in objects
    assert objects.get(g) == (data if renamed == "ok" else None), (r, renamed, unlinked)
    if renamed == "ok":
        assert wait_for(lambda: _read(db / g) == data, T)
    else:
        assert wait_for(lambda: not (da / g).exists() and not (db / g).exists(), T)


def test_two_mounts_renaming_one_file_exactly_one_wins(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    a, b = mounter(nats_url), mounter(nats_url)
    for r in range(ROUNDS):
        _rename_against_rename(nats_url, bucket_name, a.path / bucket_name, b.path / bucket_name, r)
    fsck_clean(nats_url, bucket_name)


def _rename_against_rename(url: str, bucket: str, da: Path, db: Path, r: int) -> None:
    data = os.urandom(1000 + r * 5000)
    s, to_a, to_b = f"s{r}", f"dA{r}", f"dB{r}"
    (da / s).write_bytes(data)
    assert wait_for(lambda: (db / s).exists(), T)
    ra, rb = at_once(lambda: os.rename(da / s, da / to_a), lambda: os.rename(db / s, db / to_b))
    assert sorted((ra, rb)) in (["ENOENT", "ok"], ["ESTALE", "ok"]), (r, ra, rb)
    winner = to_a if ra == "ok" else to_b
    objects = check_invariants(url, bucket)
    assert {n for n in objects if n in (s, to_a, to_b)} == {winner}
    assert objects[winner] == data
    for d in (da, db):
        assert wait_for(lambda d=d: sorted(p.name for p in d.iterdir() if p.name in (s, to_a, to_b)) == [winner], T)


def test_two_mounts_renaming_one_directory_exactly_one_wins(nats_url, bucket_name, mounter):
    create_bucket(nats_url, bucket_name)
    a, b = mounter(nats_url), mounter(nats_url)
    for r in range(ROUNDS // 3):
        _dir_rename_against_dir_rename(nats_url, bucket_name, a.path / bucket_name, b.path / bucket_name, r)
    fsck_clean(nats_url, bucket_name)


def _dir_rename_against_dir_rename(url: str, bucket: str, da: Path, db: Path, r: int) -> None:
    x, to_a, to_b = f"x{r}", f"a{r}", f"b{r}"
    (da / x).mkdir()
    for i in range(4):
        (da / x / f"f{i}").write_bytes(b"%d-%d" % (r, i))
    assert wait_for(lambda: (db / x).exists() and len(list((db / x).iterdir())) == 4, T)
    ra, rb = at_once(lambda: os.rename(da / x, da / to_a), lambda: os.rename(db / x, db / to_b))
    assert sorted((ra, rb)) in (["ENOENT", "ok"], ["ESTALE", "ok"]), (r, ra, rb)
    winner = to_a if ra == "ok" else to_b
    objects = check_invariants(url, bucket)
    mine = sorted(n for n in objects if n.split("/")[0] in (x, to_a, to_b))
    assert mine == [f"{winner}/"] + [f"{winner}/f{i}" for i in range(4)], (r, ra, rb, mine)


def _read(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None
