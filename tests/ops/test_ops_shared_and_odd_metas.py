"""Metas other clients write that this mount must not let destroy good objects: several live names on
one nuid, and metas under a subject that is not their name's canonical one (unpadded base64 of old
clients, or a token that is not base64 of UTF-8)."""

from __future__ import annotations

import errno
import json
import os
from typing import Any

import pyfuse3
import pytest
from gowriters import put_object
from opskit import Ctx, Env, Fields, errno_of

from natsfs import fsck
from natsfs.adr20 import ObjectStore, chunk_subject, digest_of, meta_json, meta_subject, stream_name
from natsfs.errors import InvalidArgument
from natsfs.memstreams import MemoryStreams
from natsfs.streams import ROLLUP

OLD = b"shared bytes\n" * 20_000  # 260,000 bytes: 2 chunks




async def err(coro: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


async def stored(env: Env, name: str) -> bytes:
    """The object as nats.go reads it: the canonical meta subject, then every chunk of its nuid."""
    info = await env.store.get_info("b", name)
    assert info is not None and not info.deleted
    data = b"".join(m.data for m in await env.store.fetch_chunks("b", info.nuid, 1, 10_000, 1 << 30))
    assert digest_of(data) == info.digest and len(data) == info.size
    return data


async def doc_of(ms: MemoryStreams, name: str) -> dict[str, Any]:
    return json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", name))).data)


# ---------------------------------------------------------------- names sharing one nuid
async def three_names_one_nuid(ms: MemoryStreams, store: ObjectStore) -> None:
    """A, B and C on one nuid: what a rename cut short (or another client's copy) leaves."""
    await store.create_bucket("b")
    await store.update_bucket("b", lambda config: config.update(allow_atomic=False))
    await put_object(ms, "b", "A", OLD)
    doc = await doc_of(ms, "A")
    for other in ("B", "C"):
        await ms.publish(meta_subject("b", other), meta_json(dict(doc, name=other)), {ROLLUP: "sub"})


@pytest.mark.parametrize("how", ["overwrite", "truncate"])
def test_replacing_one_of_several_names_on_a_nuid_keeps_the_chunks_the_others_use(ops_env, how):
    async def body(env: Env):
        nuid = (await env.store.get_info("b", "A")).nuid
        f = await env.lookup("b/A")
        if how == "overwrite":
            fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
            await env.ops.write(fi.fh, 0, b"new A\n")
            await env.ops.flush(fi.fh)
            await env.ops.release(fi.fh)
        else:
            attr = pyfuse3.EntryAttributes()
            attr.st_size = 0
            await env.ops.setattr(f.st_ino, attr, Fields(update_size=True), None, Ctx())
        await env.settle()
        await env.fs.mut.settle_puts()
        new_a = b"new A\n" if how == "overwrite" else b""
        assert await stored(env, "A") == new_a
        assert (await env.store.get_info("b", "A")).nuid != nuid
        # B and C still have every byte, for this mount and for every other client.
        assert env.streams.subjects(stream_name("b")).get(chunk_subject("b", nuid)) == 2
        for other in ("B", "C"):
            assert await stored(env, other) == OLD
            assert await env.cat(f"b/{other}") == OLD
        assert await env.cat("b/A") == new_a

    ops_env(body, setup=three_names_one_nuid)


def test_replacing_the_last_name_on_a_nuid_still_purges_its_chunks(ops_env):
    async def body(env: Env):
        nuid = (await env.store.get_info("b", "A")).nuid
        b = (await env.lookup("b")).st_ino
        await env.ops.unlink(b, b"B", Ctx())
        await env.ops.unlink(b, b"C", Ctx())
        f = await env.lookup("b/A")
        fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"new A\n")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        assert await stored(env, "A") == b"new A\n"
        assert env.streams.subjects(stream_name("b")).get(chunk_subject("b", nuid)) is None

    ops_env(body, setup=three_names_one_nuid)


# ---------------------------------------------------------------- metas under a non-canonical subject
UNPADDED = "unpadded"
NOT_BASE64 = "not-base64"


def alias_subject(name: str, kind: str) -> str:
    if kind == UNPADDED:
        subject = meta_subject("b", name)
        assert subject.endswith("=")  # (the names used here have padding to strip)
        return subject.rstrip("=")
    return "$O.b.M.not-base64!"


async def put_alias(ms: MemoryStreams, name: str, data: bytes, kind: str, **fields: Any) -> dict[str, Any]:
    """What another client writes: an object whose meta sits under a subject nats.go never reads for it."""
    info = await put_object(ms, "b", "scratch", data)
    doc = await doc_of(ms, "scratch")
    await ms.purge_subject(stream_name("b"), meta_subject("b", "scratch"))
    doc = dict(doc, name=name, **fields)
    await ms.publish(alias_subject(name, kind), meta_json(doc), {ROLLUP: "sub"})
    assert info.nuid
    return doc


def watcher(env: Env):
    return env.ns._buckets["b"]


async def reconcile_quietly(env: Env, times: int = 3) -> None:
    """Reconcile as the mount does every few seconds once the watch is quiet: nothing to fix, nothing fetched."""
    w = watcher(env)
    before = dict(w.stats)
    for _ in range(times):
        w._last_activity = -1e9  # quiet: every subject the index does not account for would be fetched
        assert await w.reconcile() == 0
    assert (w.stats["fetched"], w.stats["purged"]) == (before["fetched"], before["purged"])


@pytest.mark.parametrize("kind", [UNPADDED, NOT_BASE64])
def test_an_alias_of_a_name_never_overrides_its_canonical_meta(ops_env, kind, caplog):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        await put_object(ms, "b", "doc.txt", b"GOOD\n")
        await put_alias(ms, "doc.txt", b"EVIL\n", kind)  # newer than the canonical meta

    async def body(env: Env):
        assert await env.cat("b/doc.txt") == b"GOOD\n"  # what nats.go and nats-py read
        f = await env.lookup("b/doc.txt")
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = 0o100600
        await env.ops.setattr(f.st_ino, attr, Fields(update_mode=True), None, Ctx())
        fi = await env.ops.open(f.st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"BETTER\n")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.settle()
        assert await stored(env, "doc.txt") == b"BETTER\n"
        assert await env.cat("b/doc.txt") == b"BETTER\n"
        assert (await env.lookup("b/doc.txt")).st_mode & 0o777 == 0o600
        caplog.clear()
        await reconcile_quietly(env)
        assert await env.cat("b/doc.txt") == b"BETTER\n"
        assert not [r for r in caplog.records if r.levelno >= 30]  # no line repeated at every check

    ops_env(body, setup=setup)


def test_an_alias_is_shown_only_while_the_canonical_subject_holds_nothing(ops_env):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        await put_alias(ms, "old.txt", b"old client\n", UNPADDED)

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        assert await env.cat("b/old.txt") == b"old client\n"
        await put_object(env.streams, "b", "old.txt", b"nats.go\n")
        await env.settle()
        assert await env.cat("b/old.txt") == b"nats.go\n"
        assert (await env.listdir(b)).names == ["old.txt"]
        # The canonical meta is purged behind the watch's back (a raw purge): the alias shows again.
        await env.streams.purge_subject(stream_name("b"), meta_subject("b", "old.txt"))
        watcher(env)._last_activity = -1e9
        assert await watcher(env).reconcile() == 1
        assert await env.cat("b/old.txt") == b"old client\n"
        await reconcile_quietly(env)

    ops_env(body, setup=setup)


def test_a_tombstone_under_an_alias_subject_neither_hides_nor_purges_the_live_object(ops_env, caplog):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        keep = await put_object(ms, "b", "keep.txt", b"keep\n")
        await put_object(ms, "b", "victim.txt", b"precious data\n")
        tomb = {"name": "victim.txt", "bucket": "b", "nuid": keep.nuid, "size": 0, "chunks": 0,
                "mtime": "0001-01-01T00:00:00Z", "deleted": True}
        await ms.publish(alias_subject("victim.txt", UNPADDED), meta_json(tomb), {ROLLUP: "sub"})

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        assert (await env.listdir(b)).names == ["keep.txt", "victim.txt"]
        assert await env.cat("b/victim.txt") == b"precious data\n"
        caplog.clear()
        for _ in range(2):
            await env.fs.mut.purge_shared_tombstones()
            await reconcile_quietly(env)
        assert await stored(env, "victim.txt") == b"precious data\n"
        assert await stored(env, "keep.txt") == b"keep\n"
        assert not [r for r in caplog.records if r.levelno >= 30]

    ops_env(body, setup=setup)


F3_NAMES = ["chmod-me.tx", "rm-me.tx", "mv-me.tx", "write-me.tx", "xattr-me.tx"]


def test_an_object_only_under_an_alias_subject_can_be_changed_and_moves_to_its_canonical_subject(ops_env):
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        for name in F3_NAMES:
            await put_alias(ms, name, b"old client bytes\n", UNPADDED)

    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        assert (await env.listdir(b)).names == sorted(F3_NAMES)
        moved_mtime = (await env.lookup("b/mv-me.tx")).st_mtime_ns
        chmod_mtime = (await env.lookup("b/chmod-me.tx")).st_mtime_ns
        rm_nuid = (await env.ns.index("b")).objects["rm-me.tx"].nuid
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = 0o100600
        await env.ops.setattr((await env.lookup("b/chmod-me.tx")).st_ino, attr, Fields(update_mode=True), None,
                              Ctx())
        await env.ops.unlink(b, b"rm-me.tx", Ctx())
        await env.ops.rename(b, b"mv-me.tx", b, b"moved.txt", 0, Ctx())
        fi = await env.ops.open((await env.lookup("b/write-me.tx")).st_ino, os.O_WRONLY | os.O_TRUNC, Ctx())
        await env.ops.write(fi.fh, 0, b"new bytes\n")
        await env.ops.flush(fi.fh)
        await env.ops.release(fi.fh)
        await env.ops.setxattr((await env.lookup("b/xattr-me.tx")).st_ino, b"user.k", b"v", Ctx())
        await env.settle()

        assert (await env.listdir(b)).names == ["chmod-me.tx", "moved.txt", "write-me.tx", "xattr-me.tx"]
        # What nats.go sees: every surviving object at its canonical subject, no alias subject left.
        subjects = env.streams.subjects(stream_name("b"))
        for name in F3_NAMES:
            assert alias_subject(name, UNPADDED) not in subjects
        assert await stored(env, "chmod-me.tx") == b"old client bytes\n"
        chmodded = await env.lookup("b/chmod-me.tx")
        assert chmodded.st_mtime_ns == chmod_mtime  # chmod(2) keeps the mtime, also when moving from an alias
        assert chmodded.st_mode & 0o777 == 0o600
        assert await stored(env, "moved.txt") == b"old client bytes\n"
        assert (await env.lookup("b/moved.txt")).st_mtime_ns == moved_mtime  # rename(2) keeps the mtime
        assert await stored(env, "write-me.tx") == b"new bytes\n"
        assert (await doc_of(env.streams, "xattr-me.tx"))["metadata"]["k"] == "v"
        info = await env.store.get_info("b", "rm-me.tx")
        assert info is None or info.deleted
        assert chunk_subject("b", rm_nuid) not in subjects
        assert not (env.fs.staging.spool.lost_found / "b").exists()  # no bytes went to lost+found
        await reconcile_quietly(env)

    ops_env(body, setup=setup)


def test_xattrs_of_an_object_shown_from_an_alias_are_read_from_its_alias(ops_env):
    """getxattr and listxattr read the meta where the object is shown from (they gave ENOENT)."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        await put_alias(ms, "tag-them.tx", b"old client bytes\n", UNPADDED, metadata={"owner": "infra"})

    async def body(env: Env):
        ino = (await env.lookup("b/tag-them.tx")).st_ino
        assert await env.ops.getxattr(ino, b"user.owner", Ctx()) == b"infra"
        assert b"user.owner" in await env.ops.listxattr(ino, Ctx())
        assert await env.ops.getxattr(ino, b"user.nats.name", Ctx()) == b"tag-them.tx"

    ops_env(body, setup=setup)


def test_an_unusable_canonical_meta_leaves_the_alias_shown(ops_env):
    """Another client writes a meta that is not JSON at the canonical subject of a name shown from an
    alias: neither object nor tombstone, so the alias stays, and is not fetched or logged again."""
    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await store.create_bucket("b")
        await put_alias(ms, "old.txt", b"old client\n", UNPADDED)

    async def body(env: Env):
        assert await env.cat("b/old.txt") == b"old client\n"
        await env.streams.publish(meta_subject("b", "old.txt"), b"not json", {ROLLUP: "sub"})
        await env.settle()
        assert await env.cat("b/old.txt") == b"old client\n"
        await reconcile_quietly(env)

    ops_env(body, setup=setup)


async def canonical_and_hidden_alias_on_one_nuid(ms: MemoryStreams, store: ObjectStore) -> None:
    """An `adopt_alias` cut short (or another client's copy): `victim.txt` at its canonical subject and
    under its unpadded alias, both on one nuid; the alias is not shown."""
    await store.create_bucket("b")
    await put_object(ms, "b", "victim.txt", b"victim bytes\n")
    await ms.publish(alias_subject("victim.txt", UNPADDED), meta_json(await doc_of(ms, "victim.txt")),
                     {ROLLUP: "sub"})
    await put_object(ms, "b", "other.txt", b"other bytes\n")


@pytest.mark.parametrize("how", ["rm", "mv"])
def test_a_name_removed_through_the_mount_stays_gone_beside_its_hidden_alias(ops_env, how):
    """rm/mv returned 0 and the name came straight back: the hidden alias made it look "shared", so no
    tombstone was written and the alias showed. The chunks stay while the alias names them."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        nuid = (await env.store.get_info("b", "victim.txt")).nuid
        if how == "rm":
            await env.ops.unlink(b, b"victim.txt", Ctx())
        else:
            await env.ops.rename(b, b"victim.txt", b, b"moved.txt", 0, Ctx())
            assert await env.cat("b/moved.txt") == b"victim bytes\n"
        await env.settle()
        await reconcile_quietly(env)
        assert await errno_of_lookup(env, "b/victim.txt") == errno.ENOENT
        info = await env.store.get_info("b", "victim.txt")
        assert info is None or info.deleted  # what nats.go reads
        assert await env.store.chunk_index("b", nuid)  # the alias still names them

    ops_env(body, setup=canonical_and_hidden_alias_on_one_nuid)


def test_another_clients_delete_beside_a_hidden_alias_is_not_undone(ops_env):
    """Another client deletes the canonical object: its tombstone carries the nuid the hidden alias
    also carries. The mount purged that tombstone as "shared" and showed the alias again."""
    async def body(env: Env):
        assert await env.cat("b/victim.txt") == b"victim bytes\n"
        doc = await doc_of(env.streams, "victim.txt")
        await env.streams.publish(meta_subject("b", "victim.txt"),
                                  meta_json(dict(doc, deleted=True, size=0, chunks=0, digest="")), {ROLLUP: "sub"})
        await env.settle()
        await reconcile_quietly(env)
        assert await errno_of_lookup(env, "b/victim.txt") == errno.ENOENT
        assert (await env.store.get_info("b", "victim.txt")).deleted  # the tombstone stays
        assert await env.cat("b/other.txt") == b"other bytes\n"

    ops_env(body, setup=canonical_and_hidden_alias_on_one_nuid)


async def errno_of_lookup(env: Env, path: str) -> int:
    try:
        await env.lookup(path)
    except pyfuse3.FUSEError as e:
        return errno_of(e)
    return 0


# ---------------------------------------------------------------- fsck agrees with the mount
async def hostile_aliases(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    # A canonical object, and a hidden alias of its name whose chunks are gone.
    await put_object(ms, "b", "both.txt", b"canonical bytes\n")
    broken = await put_alias(ms, "both.txt", b"alias bytes, purged\n", UNPADDED)
    await ms.purge_subject(stream_name("b"), chunk_subject("b", broken["nuid"]))
    # A live alias behind a canonical tombstone: the name is deleted; the alias's chunks stay.
    behind = await put_alias(ms, "gone.txt", b"hidden behind a tombstone\n", UNPADDED)
    tomb = {"name": "gone.txt", "bucket": "b", "nuid": "", "size": 0, "chunks": 0,
            "mtime": "0001-01-01T00:00:00Z", "deleted": True}
    await ms.publish(meta_subject("b", "gone.txt"), meta_json(tomb), {ROLLUP: "sub"})
    # A name only an alias holds (an old client's object): live.
    await put_alias(ms, "only.txt", b"old client only\n", UNPADDED)
    # A hidden alias of "others.txt" on "twin.txt"'s nuid: no two names share that nuid.
    await put_object(ms, "b", "twin.txt", b"twin\n")
    await put_object(ms, "b", "others.txt", b"others\n")
    await ms.publish(alias_subject("others.txt", UNPADDED),
                     meta_json(dict(await doc_of(ms, "twin.txt"), name="others.txt")), {ROLLUP: "sub"})
    ms.behind_nuid = behind["nuid"]  # type: ignore[attr-defined]


def test_fsck_counts_and_reports_aliases_as_the_mount_shows_them(ops_env):
    """A hidden alias is no object of its own (not counted, not checked, no "names sharing one nuid"),
    a note names it, and its chunks are no orphans while it exists; a name only an alias holds is a
    live object. fsck's counts are the mount's (it counted 5 objects here, and reported the hidden
    alias's missing chunks as a damaged "both.txt" and "others.txt, twin.txt" as sharing a nuid)."""
    async def body(env: Env):
        index = await env.ns.index("b")
        assert sorted(index.objects) == ["both.txt", "only.txt", "others.txt", "twin.txt"]
        for repair in (False, True):
            report = await fsck.check_bucket(env.store, "b", repair=repair, grace_s=0)
            assert (report.objects, report.tombstones, report.aliases) == (len(index.objects), 1, 3)
            assert report.problems_left == [], report.findings
            assert sorted(f.where for f in report.findings if f.kind == fsck.ALIAS) == sorted(
                alias_subject(n, UNPADDED) for n in ("both.txt", "gone.txt", "others.txt"))
            assert "4 objects, 1 tombstones, 3 hidden aliases" in report.summary()
        assert await env.store.chunk_index("b", env.streams.behind_nuid)  # not purged as orphans
        assert await env.cat("b/only.txt") == b"old client only\n"

    ops_env(body, setup=hostile_aliases)


# ---------------------------------------------------------------- metas and chunks under wildcard subjects
WILDCARD_NAMES = ["a.txt", "b.txt", "dir/c.txt"]


async def wildcard_metas(ms: MemoryStreams, store: ObjectStore) -> None:
    """Another client published to `$O.b.M.*` and `$O.b.M.>` (no rollup: with one, the server itself
    purges every meta the subject matches) and to `$O.b.C.*`: JetStream stores each under that very
    subject, which a purge by it would apply to every meta (or chunk) subject it matches."""
    await store.create_bucket("b")
    for name in WILDCARD_NAMES:
        await put_object(ms, "b", name, f"{name} bytes\n".encode())
    victim = await doc_of(ms, "a.txt")
    for token, name in (("*", "star"), (">", "gt")):
        await ms.publish(f"$O.b.M.{token}", meta_json(dict(victim, name=name)))
    await ms.publish("$O.b.C.*", b"junk")


@pytest.mark.expect_log(r"meta \$O\.b\.M\.\* \(seq \d+\) is under a wildcard subject")
def test_metas_and_chunks_under_wildcard_subjects_never_make_the_mount_or_fsck_purge_others(ops_env, caplog):
    """Shown as aliases, a chmod of `star` moved it to its canonical subject and purged `$O.b.M.*`: the
    meta of every object in the bucket. fsck --repair purged `$O.b.C.*` as an orphan: every chunk."""
    async def body(env: Env):
        b = (await env.lookup("b")).st_ino
        assert (await env.listdir(b)).names == ["a.txt", "b.txt", "dir"]
        assert await err(env.lookup("b/star")) == errno.ENOENT
        report = await fsck.check_bucket(env.store, "b", repair=True, grace_s=0)
        kinds = {f.where: f.kind for f in report.findings}
        assert kinds == {"$O.b.M.*": fsck.BAD_META, "$O.b.M.>": fsck.BAD_META, "$O.b.C.*": fsck.ORPHAN}
        assert not any(f.repaired for f in report.findings)
        with pytest.raises(InvalidArgument):
            await env.streams.purge_subject(stream_name("b"), "$O.b.M.*")
        for name in WILDCARD_NAMES:
            assert await stored(env, name) == f"{name} bytes\n".encode()
            assert await env.cat(f"b/{name}") == f"{name} bytes\n".encode()
        assert {"$O.b.M.*", "$O.b.M.>", "$O.b.C.*"} <= set(env.streams.subjects(stream_name("b")))

    ops_env(body, setup=wildcard_metas)



@pytest.mark.parametrize("how", ["rm", "mv"])
def test_a_removal_killed_before_its_purge_leaves_the_chunks_a_hidden_alias_names(ops_env, how):
    """The daemon dies once the unlink's tombstone of `victim.txt` is stored (or a rename over it stored
    its meta there), before the purge: the put journal recorded the replaced version's nuid first, and
    the next mount settles it. Its hidden alias (an `adopt_alias` cut short, or another client's copy)
    still names those chunks: they stay, as they do when the call is not cut short
    (`Mutations._nuid_users`). The settle purged them."""
    import trio

    ms = MemoryStreams()
    nuids: dict[str, str] = {}

    async def setup(ms: MemoryStreams, store: ObjectStore) -> None:
        await canonical_and_hidden_alias_on_one_nuid(ms, store)
        for name in ("victim.txt", "other.txt"):
            info = await store.get_info("b", name)
            assert info is not None
            nuids[name] = info.nuid

    async def first(env: Env):
        async def dies(*args: Any, **kwargs: Any) -> None:
            await trio.sleep_forever()

        env.store.end_replacing = dies  # type: ignore[method-assign]
        env.fs.mut.purge_unused = dies  # type: ignore[method-assign]
        publish_meta = env.store.publish_meta

        async def dies_before_the_claim(bucket: str, doc: dict[str, Any], **kwargs: Any) -> Any:
            if doc.get("name") == "other.txt" and doc.get("deleted"):
                await trio.sleep_forever()
            return await publish_meta(bucket, doc, **kwargs)

        env.store.publish_meta = dies_before_the_claim  # type: ignore[method-assign]
        b = (await env.lookup("b")).st_ino
        if how == "rm":
            env.nursery.start_soon(env.ops.unlink, b, b"victim.txt", None)
        else:
            env.nursery.start_soon(env.ops.rename, b, b"other.txt", b, b"victim.txt", 0, None)
        with trio.fail_after(10):
            while (info := await env.store.get_info("b", "victim.txt")) is not None and (
                    not info.deleted and info.nuid == nuids["victim.txt"]):
                await trio.sleep(0.01)
        assert env.fs.mut.journal.active or env.fs.mut.journal.pending

    async def second(env: Env):
        assert env.fs.mut.journal.pending  # (the record the run that died left)
        await env.fs.mut.settle_puts()
        await env.fs.mut.settle_puts()
        assert await env.store.chunk_index("b", nuids["victim.txt"])  # the alias still names them
        assert await env.store.chunk_index("b", nuids["other.txt"])
        assert not env.fs.mut.journal.pending

    ops_env(first, setup=setup, streams=ms)
    ops_env(second, streams=ms, purge_check_delay=0.0)
