"""Two mounts of one bucket racing a rename against an unlink or another rename of the same name.

A tester with mounts A and B: A renamed f -> g while B unlinked f, and both returned 0 with g left a live
meta whose chunks B had purged (B's tombstone expected f's revision, which the rename left in place until
its purge, and B had not seen g yet). A and B renaming s -> dA and s -> dB both returned 0 with both names
live on one nuid. Now a rename claims the old name after publishing the new one (a tombstone on a fresh
nuid expecting the revision it read): of the claim, another mount's unlink tombstone and another
mount's claim, exactly one is stored. The loser takes back what it published and fails (`ENOENT`),
purging no chunk. The steps are interleaved by holding A's claim while B's operation runs.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio
from opskit import CTX, ROOT, Env, errno_of
from test_ops_write import write_file

import natsfs.index
from natsfs.adr20 import ObjectInfo, ObjectStore
from natsfs.compose import build_filesystem
from natsfs.config import Config
from natsfs.memstreams import MemoryStreams

DATA = b"the bytes of f\n" * 100


async def bucket_b(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")


async def other_mount(env: Env, tmp_path: Path) -> Env:
    """Mount B: a second filesystem core over the same MemoryStreams (its own cache, store and index)."""
    config = Config(mountpoint=Path("/nonexistent-b"), bucket="b", uid=1234, gid=5678, cache_size=64 << 20,
                    cache_dir=tmp_path / "cache-b", data_dir=tmp_path / "data-b")
    built = build_filesystem(config, env.streams)
    await built.start(env.nursery)
    return Env(env.streams, built.store, built.namespace, built.cache, built.fs, built.ops, config, env.nursery)


def before_claim_of(monkeypatch: pytest.MonkeyPatch, env: Env, name: str, action: Callable[[], Awaitable[Any]]
                    ) -> list[Any]:
    """Run `action` once, right before mount `env` publishes its claim of `name` (a tombstone there): its
    meta under the new name is stored already. Returns the list that receives `action`'s result."""
    real = env.store.publish_meta
    results: list[Any] = []

    async def publish_meta(bucket: str, doc: dict[str, Any], **kw: Any) -> ObjectInfo:
        if not results and doc.get("deleted") and doc.get("name") == name:
            results.append(await action())
        return await real(bucket, doc, **kw)

    monkeypatch.setattr(env.store, "publish_meta", publish_meta)
    return results


async def outcome(call: Awaitable[Any]) -> int:
    """0, or the errno the call failed with."""
    try:
        await call
    except pyfuse3.FUSEError as e:
        return errno_of(e)
    return 0


async def live(env: Env) -> dict[str, ObjectInfo]:
    return {n: i for n, i in (await env.store.live_objects("b")).items() if not i.deleted}


async def check_bucket(env: Env) -> dict[str, ObjectInfo]:
    """The invariants: no two live names on one nuid, every live object's chunks all there. The live names."""
    objects = await live(env)
    nuids = [i.nuid for i in objects.values() if i.chunks]
    assert len(nuids) == len(set(nuids)), f"names sharing one nuid: {sorted(objects)}"
    for info in objects.values():
        assert len(await env.store.chunk_index("b", info.nuid)) == info.chunks, f"{info.name} lost chunks"
    return objects


async def names(env: Env, path: str = "") -> list[str]:
    ino = ROOT if not path else (await env.lookup(path)).st_ino
    return (await env.listdir(ino)).names


@pytest.mark.parametrize("b_saw_g", [False, True], ids=["B-has-not-seen-g", "B-has-seen-g"])
def test_an_unlink_stored_between_a_renames_steps_wins_and_the_rename_moves_nothing(
        ops_env, monkeypatch, tmp_path, b_saw_g):
    """F1: B's unlink of f lands after A published g and before A's claim of f. The unlink wins (0); A's
    claim is refused, A takes g back and answers ENOENT. Never a live g without its chunks."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await write_file(a, ROOT, "f", DATA)
        await a.settle()

        async def unlink_in_b() -> int:
            if b_saw_g:
                await a.settle()  # (B's index shows g on f's nuid: its delete takes the shared path)
            return await outcome(b.ops.unlink(ROOT, b"f", CTX))

        unlinked = before_claim_of(monkeypatch, a, "f", unlink_in_b)
        assert await outcome(a.ops.rename(ROOT, b"f", ROOT, b"g", 0, CTX)) == errno.ENOENT
        assert unlinked == [0]
        await a.settle()
        assert await check_bucket(a) == {}
        for mount in (a, b):
            assert await names(mount) == []
            for name in ("f", "g"):
                assert await outcome(mount.lookup(name)) == errno.ENOENT

    ops_env(body, setup=bucket_b, bucket="b")


def test_an_unlink_whose_tombstone_comes_after_a_renames_claim_is_enoent_and_purges_nothing(
        ops_env, monkeypatch, tmp_path):
    """F1, the other order: B's unlink read f before A's rename, and its tombstone comes after A's claim.
    It is refused; B reads f back (deleted), answers ENOENT and purges no chunk: g keeps its bytes."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await write_file(a, ROOT, "f", DATA)
        await a.settle()
        renamed: list[int] = []
        real = b.store.publish_meta

        async def publish_meta(bucket: str, doc: dict[str, Any], **kw: Any) -> ObjectInfo:
            if not renamed and doc.get("deleted") and doc.get("name") == "f":
                renamed.append(await outcome(a.ops.rename(ROOT, b"f", ROOT, b"g", 0, CTX)))
            return await real(bucket, doc, **kw)

        monkeypatch.setattr(b.store, "publish_meta", publish_meta)
        assert await outcome(b.ops.unlink(ROOT, b"f", CTX)) == errno.ENOENT
        assert renamed == [0]
        await a.settle()
        assert sorted(await check_bucket(a)) == ["g"]
        for mount in (a, b):
            assert await names(mount) == ["g"]
            assert await mount.cat("g") == DATA

    ops_env(body, setup=bucket_b, bucket="b")


def test_of_two_mounts_renaming_one_file_exactly_one_wins(ops_env, monkeypatch, tmp_path):
    """F2: A renames s -> dA, B renames s -> dB; B's rename runs whole between A's two steps. B wins (0), A
    takes dA back and answers ENOENT: one name, its bytes whole, both mounts show the same."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await write_file(a, ROOT, "s", DATA)
        await a.settle()
        other = before_claim_of(monkeypatch, a, "s", lambda: outcome(b.ops.rename(ROOT, b"s", ROOT, b"dB", 0, CTX)))
        assert await outcome(a.ops.rename(ROOT, b"s", ROOT, b"dA", 0, CTX)) == errno.ENOENT
        assert other == [0]
        await a.settle()
        assert sorted(await check_bucket(a)) == ["dB"]
        for mount in (a, b):
            assert await names(mount) == ["dB"]
            assert await mount.cat("dB") == DATA

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_rename_over_a_target_that_loses_its_source_puts_the_target_back(ops_env, monkeypatch, tmp_path):
    """A renames s over t while B renames s away: A's meta at t replaced t's (rollup), so taking it back
    stores t's meta again: t keeps its bytes."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await write_file(a, ROOT, "s", DATA)
        await write_file(a, ROOT, "t", b"target")
        await a.settle()
        t_before = await a.store.get_info("b", "t")
        other = before_claim_of(monkeypatch, a, "s", lambda: outcome(b.ops.rename(ROOT, b"s", ROOT, b"dB", 0, CTX)))
        assert await outcome(a.ops.rename(ROOT, b"s", ROOT, b"t", 0, CTX)) == errno.ENOENT
        assert other == [0]
        await a.settle()
        objects = await check_bucket(a)
        assert sorted(objects) == ["dB", "t"]
        assert objects["t"].nuid == t_before.nuid
        for mount in (a, b):
            assert await mount.cat("t") == b"target"
            assert await mount.cat("dB") == DATA

    ops_env(body, setup=bucket_b, bucket="b")


def test_of_two_mounts_renaming_one_directory_exactly_one_wins_and_the_loser_moves_nothing(
        ops_env, monkeypatch, tmp_path):
    """F2 for directories: A renames x -> x0 while B renames x -> y0. The directory's marker moves first,
    so its claim decides: B's rename runs whole between A's two steps for the marker, B wins, A takes its
    marker back, moves no file and answers ENOENT. Every file under y0 only."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await a.ops.mkdir(ROOT, b"x", 0o755, CTX)
        x = (await a.lookup("x")).st_ino
        for i in range(4):
            await write_file(a, x, f"f{i}", DATA + bytes([i]))
        await a.settle()
        other = before_claim_of(monkeypatch, a, "x/", lambda: outcome(b.ops.rename(ROOT, b"x", ROOT, b"y0", 0, CTX)))
        assert await outcome(a.ops.rename(ROOT, b"x", ROOT, b"x0", 0, CTX)) == errno.ENOENT
        assert other == [0]
        await a.settle()
        assert sorted(await check_bucket(a)) == ["y0/", "y0/f0", "y0/f1", "y0/f2", "y0/f3"]
        for mount in (a, b):
            assert await names(mount) == ["y0"]
            assert await names(mount, "y0") == ["f0", "f1", "f2", "f3"]
            assert await mount.cat("y0/f2") == DATA + b"\x02"

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_directory_rename_that_loses_one_file_moves_the_others_back(ops_env, monkeypatch, tmp_path):
    """A renames x -> x0; B renames x/f1 -> z between A's two steps for x/f1. A's claim of x/f1 is refused:
    A moves every object it moved (and its marker) back and answers ENOENT. Nothing under x0."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await a.ops.mkdir(ROOT, b"x", 0o755, CTX)
        x = (await a.lookup("x")).st_ino
        for i in range(4):
            await write_file(a, x, f"f{i}", DATA + bytes([i]))
        await a.settle()
        bx = (await b.lookup("x")).st_ino
        other = before_claim_of(monkeypatch, a, "x/f1", lambda: outcome(b.ops.rename(bx, b"f1", ROOT, b"z", 0, CTX)))
        assert await outcome(a.ops.rename(ROOT, b"x", ROOT, b"x0", 0, CTX)) == errno.ENOENT
        assert other == [0]
        await a.settle()
        assert sorted(await check_bucket(a)) == ["x/", "x/f0", "x/f2", "x/f3", "z"]
        for mount in (a, b):
            assert await names(mount) == ["x", "z"]
            assert await names(mount, "x") == ["f0", "f2", "f3"]
            assert await mount.cat("z") == DATA + b"\x01"

    ops_env(body, setup=bucket_b, bucket="b")


async def dir_x_with_files(a: Env, b: Env, n: int) -> int:
    """Directory x made in mount A with files f0..f<n-1> (`DATA` and the index), seen by both mounts; its inode in A."""
    await a.ops.mkdir(ROOT, b"x", 0o755, CTX)
    x = (await a.lookup("x")).st_ino
    for i in range(n):
        await write_file(a, x, f"f{i}", DATA + bytes([i]))
    await a.settle()
    await b.settle()
    return x


def rename_paused_after_marker(monkeypatch: pytest.MonkeyPatch, b: Env, old: bytes, new: bytes
                               ) -> tuple[trio.Event, trio.Event, list[int], trio.CancelScope]:
    """Start B's rename of directory `old`, held right after it moved the directory's marker (its claim of
    `old/` stored) until `go` is set. Returns (claimed, go, B's outcome once known, B's cancel scope)."""
    claimed, go = trio.Event(), trio.Event()
    results: list[int] = []
    scope = trio.CancelScope()
    real = b.fs.mut._rename_each

    async def rename_each(*args: Any, **kw: Any) -> None:
        claimed.set()
        await go.wait()
        await real(*args, **kw)

    monkeypatch.setattr(b.fs.mut, "_rename_each", rename_each)

    async def run() -> None:
        with scope:
            results.append(await outcome(b.ops.rename(ROOT, old, ROOT, new, 0, CTX)))

    b.nursery.start_soon(run)
    return claimed, go, results, scope


async def only_b_renamed(a: Any, b: Any) -> None:
    """B's rename of x to y0 is the one done: both mounts show y0 whole, and the bucket holds nothing else."""
    await a.settle()
    assert sorted(await check_bucket(a)) == ["y0/", "y0/f0", "y0/f1", "y0/f2", "y0/f3"]
    for mount in (a, b):
        assert await names(mount) == ["y0"]
        assert await mount.cat("y0/f3") == DATA + b"\x03"


def test_a_directory_rename_after_anothers_claim_of_its_marker_moves_nothing(ops_env, monkeypatch, tmp_path):
    """A CI run: B's rename of x claimed x's marker, and A learned of it (its view of x: no marker, the
    files B had yet to move) before A renamed x itself. A moved the files (no marker to claim, so nothing
    decided the race), B's moves of them failed and B moved its marker back: A's x0 had no marker and x
    came back empty. Now A sees that another client's rename holds x (its claim is newer than every entry
    left) and answers ENOENT, moving nothing; B's rename completes."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await dir_x_with_files(a, b, 4)
        claimed, go, results, _ = rename_paused_after_marker(monkeypatch, b, b"x", b"y0")
        await claimed.wait()
        await a.settle()
        assert sorted(await names(a, "x")) == ["f0", "f1", "f2", "f3"]  # (B's moves are yet to come)
        assert await outcome(a.ops.rename(ROOT, b"x", ROOT, b"x0", 0, CTX)) == errno.ENOENT
        go.set()
        while not results:
            await trio.sleep(0.01)
        assert results == [0]
        await only_b_renamed(a, b)

    ops_env(body, setup=bucket_b, bucket="b")


@pytest.mark.parametrize("why", ["claim-old", "entry-after-claim"])
def test_entries_a_claimed_directory_still_holds_are_renamed_when_no_rename_can_be_moving_them(
        ops_env, monkeypatch, tmp_path, why):
    """B died right after claiming x's marker (its files stay under x). Once the claim is older than any
    directory rename takes, or x holds an entry stored after the claim (not one that rename moves), A's
    rename of x moves what x holds."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        x = await dir_x_with_files(a, b, 2)
        claimed, _, _, b_dies = rename_paused_after_marker(monkeypatch, b, b"x", b"y0")
        await claimed.wait()
        b_dies.cancel()
        await a.settle()
        if why == "claim-old":
            monkeypatch.setattr(natsfs.index, "CLAIMED_DIR_MOVING_S", 0.0)
            expected = ["x0/f0", "x0/f1"]
        else:
            await write_file(a, x, "late", b"late")
            await a.settle()
            expected = ["x0/f0", "x0/f1", "x0/late"]
        assert await outcome(a.ops.rename(ROOT, b"x", ROOT, b"x0", 0, CTX)) == 0
        await a.settle()
        assert sorted(await check_bucket(a)) == sorted(["y0/", *expected])
        assert await a.cat("x0/f1") == DATA + b"\x01"

    ops_env(body, setup=bucket_b, bucket="b")


def test_a_claim_of_the_marker_that_comes_while_a_directory_rename_starts_moves_nothing(
        ops_env, monkeypatch, tmp_path):
    """The window the check above left: A's rename of x saw x's marker (no claim yet), then its first
    await in the move (the bucket's sealed state, read again every 2 s) let B's claim of the marker in.
    A then built its moves from x as it showed: no marker, so nothing decided the race, and A moved the
    files while B's moves of them failed (both moved part of the directory). Now A checks for a claim
    again once nothing awaits before it reads what to move: it answers ENOENT and moves nothing."""
    async def body(a: Env):
        b = await other_mount(a, tmp_path)
        await dir_x_with_files(a, b, 4)
        b_results: list[list[int]] = []
        go: list[trio.Event] = []
        in_move = [False]
        real_rename_dir, real_check = a.fs.mut.rename_dir, a.fs.mut.check_writable

        async def rename_dir(*args: Any, **kw: Any) -> None:
            in_move[0] = True
            await real_rename_dir(*args, **kw)

        async def check_writable(bucket: str) -> None:
            if in_move[0] and not b_results:
                # B's rename claims x's marker (and waits before moving the files); A learns of it.
                claimed, go_b, results, _ = rename_paused_after_marker(monkeypatch, b, b"x", b"y0")
                b_results.append(results)
                go.append(go_b)
                await claimed.wait()
                await a.settle()
            await real_check(bucket)

        monkeypatch.setattr(a.fs.mut, "rename_dir", rename_dir)
        monkeypatch.setattr(a.fs.mut, "check_writable", check_writable)
        assert await outcome(a.ops.rename(ROOT, b"x", ROOT, b"x0", 0, CTX)) == errno.ENOENT
        assert b_results, "B's rename never ran inside A's"
        go[0].set()
        while not b_results[0]:
            await trio.sleep(0.01)
        assert b_results[0] == [0]
        await only_b_renamed(a, b)

    ops_env(body, setup=bucket_b, bucket="b")
