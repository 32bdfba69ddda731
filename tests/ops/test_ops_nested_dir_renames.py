"""A rename whose directories went away meanwhile, and directory renames racing renames inside them, on one
mount: the tree stays one tree, nothing under an old name, nothing under the inode table's placeholder.

A tester renamed T <-> U in a loop while two other processes renamed T/A <-> T/A2 and T/B <-> T/B2 (and
one moved T/A/C between A and B): the kernel sent a rename whose target directory's inode no longer had a
directory behind its path (`rename(T/A -> U/A2)` just after `U` became `T`: the inode the kernel held for
`U` was one of a name that went away, or one detached when another directory took its path). The rename
moved T/A's objects under U/A2/ with no directory U: the tree split into T/ and U/ (every rename of the top
then failed ENOTEMPTY), or the objects went to `\\x00detached/<ino>/C/...`, the inode table's placeholder
for inodes whose name went away, out of everyone's sight. Now a rename's target directory must exist, as
on a local disk (ENOENT), and no path under the placeholder ever becomes an object name
(`Namespace.split`, `DetachedPath`).
"""

from __future__ import annotations

import errno
import os

import pyfuse3
import pytest
import trio
from opskit import CTX, Env, errno_of
from test_ops_changes_in_renamed_dirs import HeldWhen, jittered
from test_ops_entries_in_renamed_dirs import stored_names
from test_ops_upload_races import ino_of

from natsfs.adr20 import BytesSource, ObjectStore
from natsfs.core.filesystem import AttrChanges
from natsfs.errors import DetachedPath
from natsfs.inodes import DETACHED, InodeNo
from natsfs.memstreams import MemoryStreams

TREE = {"T/", "T/A/", "T/B/", "T/A/C/", "T/A/w1", "T/A/w2", "T/A/w3", "T/A/C/w4", "T/A/C/w5"}


async def tree(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    for name in sorted(TREE):
        await store.put("b", name, BytesSource(b"" if name.endswith("/") else name.encode()), expected_revision=0)


async def rename_errno(env: Env, parent_old: int, old: str, parent_new: int, new: str) -> int | None:
    try:
        await env.ops.rename(parent_old, old.encode(), parent_new, new.encode(), 0, CTX)
    except pyfuse3.FUSEError as e:
        return errno_of(e)
    return None


def one_tree(names: set[str]) -> bool:
    return len({n.split("/")[0] for n in names}) == 1


def test_a_rename_into_a_directory_whose_name_a_rename_moved_away_is_refused_enoent(ops_env):
    """The kernel holds an inode for `U` from before `U` was renamed back to `T` (a lookup answered from
    before that rename): a rename of T/A into that `U` finds no directory there, and answers ENOENT as a
    local disk would. It moved T/A's objects to U/A2/ with no directory U: the tree split in two."""

    async def body(env: Env):
        top = await ino_of(env, "T")
        await env.ops.rename(1, b"T", 1, b"U", 0, CTX)
        await env.ops.rename(1, b"U", 1, b"T", 0, CTX)
        assert env.fs.inodes.path_of(InodeNo(top)) == ("T",)
        # The inode a lookup of `U` got while `U` still showed, registered after `mv U T` (a lookup
        # answered from before that rename): its path shows nothing now.
        ghost = env.fs.inodes.lookup(("U",))
        assert await rename_errno(env, top, "A", ghost, "A2") == errno.ENOENT
        await env.settle()
        assert stored_names(env) == TREE
        await env.ops.rename(1, b"T", 1, b"U", 0, CTX)  # (and the top renames on: no ENOTEMPTY)
        await env.settle()
        assert stored_names(env) == {"U" + n[1:] for n in TREE}

    ops_env(body, setup=tree, bucket="b")


def test_a_rename_into_a_detached_directory_stores_nothing_under_the_placeholder(ops_env):
    """The kernel's inode for T/B was detached (its name went away: the directory was removed, or another
    was moved onto its path): a rename of C into it answers ENOENT; C stays where it was. It stored
    `\\x00detached/<ino>/C/...`, out of everyone's sight."""

    async def body(env: Env):
        b = await ino_of(env, "T/B")
        a = await ino_of(env, "T/A")
        env.fs.inodes.detach(("T", "B"))
        assert env.fs.inodes.is_detached(InodeNo(b))
        assert await rename_errno(env, a, "C", b, "C") == errno.ENOENT
        # (and the other way: a rename out of it finds nothing there either)
        assert await rename_errno(env, b, "C", a, "C2") == errno.ENOENT
        await env.settle()
        assert stored_names(env) == TREE

    ops_env(body, setup=tree, bucket="b")


def test_no_detached_path_becomes_an_object_name(ops_env):
    """`Namespace.split`, where every mount path becomes (bucket, object name), refuses the placeholder:
    ENOENT (a `NotFound`: resolving such a path answers as before, nothing is there)."""

    async def body(env: Env):
        with pytest.raises(DetachedPath) as raised:
            env.ns.split((DETACHED, "830", "C", "w4"))
        assert raised.value.errno == errno.ENOENT
        with pytest.raises(DetachedPath):
            await env.ns.resolve((DETACHED, "73"))

    ops_env(body, setup=tree, bucket="b")


def between_the_steps_for(monkeypatch: pytest.MonkeyPatch, env: Env, name: str) -> HeldWhen:
    """Holds a rename's claim of `name` (a tombstone there): its meta under the new name is published already."""
    return HeldWhen(monkeypatch, env.store, "publish_meta",
                    lambda bucket, doc, *_: bool(doc.get("deleted")) and doc.get("name") == name)


def under(top: str, names: set[str]) -> set[str]:
    return {top + n[1:] for n in names}


RENAMED_SIBLINGS = {n.replace("T/A/", "T/A2/").replace("T/B/", "T/B2/") for n in TREE}


async def renames_by_inode(env: Env, *renames: tuple[int, str, int, str]) -> list[int | None]:
    """Each rename as the kernel sends it: by the directory inodes it holds (looked up before)."""
    codes: list[int | None] = []
    async with trio.open_nursery() as nursery:
        for parent_old, old, parent_new, new in renames:
            async def one(po: int = parent_old, o: str = old, pn: int = parent_new, n: str = new) -> None:
                codes.append(await rename_errno(env, po, o, pn, n))
            nursery.start_soon(one)
            await env.settle()  # (in this order: each has reached the gate before the next starts)
    return codes


@pytest.mark.parametrize("held", ["child first", "parent first"])
def test_a_parent_rename_and_two_sibling_renames_run_one_after_the_other(ops_env, monkeypatch, held):
    """`mv T U` while `mv T/A T/A2` and `mv T/B T/B2` run (the kernel lets them all through at once: each
    locks only its own parent). Whichever is under way first (held between its two steps for T/A/w1),
    the others wait for it, and each acts on the paths the directories have when it runs: one tree,
    U/A2 and U/B2, nothing under T/, A or B."""

    async def body(env: Env):
        t = await ino_of(env, "T")
        await ino_of(env, "T/A")
        await ino_of(env, "T/B")
        parent = (1, "T", 1, "U")
        siblings = [(t, "A", t, "A2"), (t, "B", t, "B2")]
        hold = between_the_steps_for(monkeypatch, env, "T/A/w1")
        with trio.fail_after(30):  # (a hang guard only)
            async with trio.open_nursery() as nursery:
                async def run_all() -> None:
                    order = [siblings[0], parent, siblings[1]] if held == "child first" else [parent, *siblings]
                    assert await renames_by_inode(env, *order) == [None, None, None]

                nursery.start_soon(run_all)
                await hold.held.wait()
                await env.settle()
                hold.release()
        await env.settle()
        assert stored_names(env) == under("U", RENAMED_SIBLINGS)
        assert (await env.listdir(await ino_of(env, "U"))).names == ["A2", "B2"]
        assert await env.cat("U/A2/C/w4") == b"T/A/C/w4"

    ops_env(body, setup=tree, bucket="b")


@pytest.mark.parametrize("held", ["move first", "parent first"])
def test_a_subdirectory_moved_between_siblings_while_their_parent_is_renamed_lands_in_the_renamed_tree(
        ops_env, monkeypatch, held):
    """`mv T/A/C T/B/C` (by the inodes of T/A and T/B the kernel holds) while `mv T U` runs, either under
    way first: C ends under U/B, with its files, nothing under T/ or the placeholder."""

    async def body(env: Env):
        a = await ino_of(env, "T/A")
        b = await ino_of(env, "T/B")
        await ino_of(env, "T/A/C")
        move = (a, "C", b, "C")
        parent = (1, "T", 1, "U")
        hold = between_the_steps_for(monkeypatch, env, "T/A/C/w4")
        with trio.fail_after(30):  # (a hang guard only)
            async with trio.open_nursery() as nursery:
                async def run_all() -> None:
                    order = [move, parent] if held == "move first" else [parent, move]
                    assert await renames_by_inode(env, *order) == [None, None]

                nursery.start_soon(run_all)
                await hold.held.wait()
                await env.settle()
                hold.release()
        await env.settle()
        assert stored_names(env) == under("U", {n.replace("T/A/C/", "T/B/C/") for n in TREE})
        assert await env.cat("U/B/C/w5") == b"T/A/C/w5"

    ops_env(body, setup=tree, bucket="b")


async def rename_first_found(env: Env, pairs: list[tuple[str, str]]) -> None:
    """Rename the first of `pairs` whose source shows (as `mv` after a glob would); ENOENT is a lost race."""
    for old, new in pairs:
        o_parent, _, o_name = old.rpartition("/")
        n_parent, _, n_name = new.rpartition("/")
        try:
            po = await ino_of(env, o_parent)
            pn = await ino_of(env, n_parent)
            await env.lookup(old)
        except pyfuse3.FUSEError as e:
            if errno_of(e) != errno.ENOENT:
                raise
            continue
        code = await rename_errno(env, po, o_name, pn, n_name)
        assert code in (None, errno.ENOENT), f"{old} -> {new}: errno {code}"
        return


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("move_c", [False, True], ids=["siblings", "siblings-and-C"])
def test_a_top_directory_renamed_in_a_loop_while_its_subdirectories_are_renamed_stays_one_tree(
        ops_env, monkeypatch, seed, move_c):
    """T <-> U in a loop while T/A <-> T/A2 and T/B <-> T/B2 (and C moved between A and B) run in loops,
    the store's answers coming after varied pauses: every rename succeeds or loses a race (ENOENT), and
    the bucket ends as one tree holding everything, nothing under an old top name or the placeholder,
    and nothing hangs (the timeout only guards against a hang)."""
    rounds = 20

    async def body(env: Env):
        jittered(monkeypatch, env.store, ("put_file", "get_meta_doc", "rename", "_purge_settled"), seed)
        jittered(monkeypatch, env.ns, ("resolve",), seed + 100)
        jittered(monkeypatch, env.fs.mut, ("check_writable",), seed + 200)

        async def top() -> None:
            for _ in range(rounds):
                await rename_first_found(env, [("T", "U"), ("U", "T")])

        async def sub(x: str) -> None:
            for _ in range(rounds):
                await rename_first_found(env, [(f"{t}/{a}", f"{t}/{b}") for t in "TU"
                                               for a, b in ((x, x + "2"), (x + "2", x))])

        async def mv_c() -> None:
            for _ in range(rounds):
                await rename_first_found(env, [(f"{t}/{s}/C", f"{t}/{d}/C") for t in "TU"
                                               for s in ("A", "A2", "B", "B2") for d in ("A", "A2", "B", "B2")
                                               if s[0] != d[0]])

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(top)
                nursery.start_soon(sub, "A")
                nursery.start_soon(sub, "B")
                if move_c:
                    nursery.start_soon(mv_c)
        await env.settle()
        names = stored_names(env)
        assert one_tree(names), sorted(names)
        assert not any(DETACHED in n for n in names), sorted(names)
        assert len(names) == len(TREE)
        assert {n.rsplit("/", 1)[-1] for n in names if not n.endswith("/")} == {"w1", "w2", "w3", "w4", "w5"}

    ops_env(body, setup=tree, bucket="b")


def test_a_file_open_here_whose_name_went_to_a_directory_is_still_truncated_and_stat(ops_env):
    """A file open for appending, unlinked, its name then taken by a directory: its inode is detached
    (its path is under the inode table's placeholder), yet its handle's `ftruncate` and `fstat` work, as
    on a local disk; nothing is stored under the placeholder (no name is, the file being unlinked). The
    refusal of placeholder paths (`Namespace.split`) failed them with ENOENT."""
    async def setup(ms, store: ObjectStore) -> None:
        await store.create_bucket("b")
        await store.put("b", "d/", BytesSource(b""), expected_revision=0)  # a directory "d" with a marker
        await store.put("b", "d/c", BytesSource(b"data"), expected_revision=0)

    async def body(env: Env) -> None:
        d, c = await ino_of(env, "d"), await ino_of(env, "d/c")
        fi = await env.ops.open(c, os.O_WRONLY | os.O_APPEND, CTX)
        await env.ops.unlink(d, b"c", CTX)
        await env.ops.mkdir(d, b"c", 0o755, CTX)
        assert (await env.fs.setattr(c, AttrChanges(size=7394))).size == 7394
        assert (await env.ops.getattr(c, CTX)).st_size == 7394
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert (await env.lookup("d/c")).st_mode & 0o170000 == 0o040000  # the directory
        assert not [n for n in stored_names(env) if "\x00" in n]

    ops_env(body, setup=setup, bucket="b")
