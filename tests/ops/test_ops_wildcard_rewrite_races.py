"""A rename or unlink through the mount while the rewrite of a wildcard nuid (`Mutations.defuse_wildcard_nuids`:
this mount's own, another mount's or `natsfs fsck --repair`'s, `ObjectStore.defuse_wildcard_nuid`) lands
on the same name, between the operation's read of the name and its publish that expects that revision.
The rewrite changed nothing but the nuid (the name's content is the same), so the operation succeeds as on
a local disk: the object is never lost, and no wildcard nuid is left behind. Made deterministic by running
the rewrite from inside the operation, right before the step that expects the revision read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from opskit import Ctx, Env
from test_ops_wildcard_nuids import bucket_with_objects, meta, meta_of

from natsfs.adr20 import ROLLUP, ObjectStore, meta_subject, usable_nuid

# name -> the fields another client wrote besides name and bucket (a live meta, a link).
SOURCES: dict[str, dict[str, Any]] = {
    "dotted": {"nuid": "x.*", "description": "kept", "metadata": {"k": "v"}},
    "link": {"nuid": "*", "options": {"link": {"bucket": "b", "name": "keep1"}}},
}


async def publish(env: Env, name: str, fields: dict[str, Any]) -> None:
    await env.streams.publish(meta_subject("b", name), meta("b", name, fields), {ROLLUP: "sub"})


def rewrite_by(env: Env, who: str) -> Callable[[str], Awaitable[None]]:
    """The rewrite of `name`'s wildcard nuid: this mount's own background pass, or another mount's."""
    async def own(name: str) -> None:
        await env.fs.mut.defuse_wildcard_nuids()
        assert usable_nuid((await meta_of(env, name))[0]["nuid"])

    async def other(name: str) -> None:
        _, revision = await meta_of(env, name)
        assert await ObjectStore(env.streams).defuse_wildcard_nuid("b", name, revision) is not None

    return own if who == "own" else other


def before(env: Env, method: str, when: Callable[..., bool], action: Callable[[], Awaitable[None]]) -> None:
    """Run `action` once, right before the first call of `env.store.<method>` for which `when(*args)` holds."""
    original = getattr(env.store, method)
    done: list[bool] = []

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not done and when(*args, **kwargs):
            done.append(True)
            await action()
        return await original(*args, **kwargs)

    setattr(env.store, method, wrapped)


def assert_moved(doc: dict, fields: dict[str, Any], name: str) -> None:
    """`doc`, stored under `name`, is the source's meta with every field kept, on a fresh nuid."""
    assert usable_nuid(doc["nuid"]) and doc["name"] == name and not doc.get("deleted")
    for key, value in fields.items():
        if key == "metadata":  # (with the mtime a rename keeps, `natsfs.mtime_ns`)
            assert doc[key].items() >= value.items()
        elif key != "nuid":
            assert doc[key] == value, key


@pytest.mark.parametrize("who", ["own", "other"])
@pytest.mark.parametrize("step", ["read", "claim"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_rename_while_the_sources_wildcard_nuid_is_rewritten_succeeds(ops_env, name, step, who):
    """The rewrite lands before the rename reads the source back (`read`: its revision is newer than the
    one the mount listed), or after the rename stored the new name, before its claim of the old one
    (`claim`: the claim expects the revision read). Either way the rename is done (not ESTALE), the
    new name holds the object with its fields, the old name is gone, no wildcard nuid is anywhere."""
    fields = SOURCES[name]

    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish(env, name, fields)
        await env.settle()
        assert (await meta_of(env, name))[0]["nuid"] == fields["nuid"]
        mtime_ns = (await env.lookup(f"b/{name}")).st_mtime_ns
        rewrite = rewrite_by(env, who)
        if step == "read":
            before(env, "rename", lambda *a, **k: True, lambda: rewrite(name))
        else:
            before(env, "publish_meta", lambda bucket, doc, **k: doc.get("deleted") is True and doc["name"] == name,
                   lambda: rewrite(name))
        b = (await env.lookup("b")).st_ino
        await env.ops.rename(b, name.encode(), b, b"moved", 0, Ctx())
        await env.settle()
        moved, _ = await meta_of(env, "moved")
        assert_moved(moved, fields, "moved")
        old, _ = await meta_of(env, name)
        assert old.get("deleted") is True and usable_nuid(old["nuid"])
        listed = (await env.listdir((await env.lookup("b")).st_ino)).names
        assert "moved" in listed and name not in listed
        if name == "link":  # (a link's time is the rename's)
            assert await env.ops.readlink((await env.lookup("b/moved")).st_ino, None) == b"../b/keep1"
        else:  # (a file keeps its mtime through a rename, as on a local disk)
            assert await env.cat("b/moved") == b""
            assert (await env.lookup("b/moved")).st_mtime_ns == mtime_ns
        assert await env.cat("b/keep1") == b"one" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)  # (rewritten only when called here)


@pytest.mark.parametrize("who", ["own", "other"])
def test_a_rename_over_an_object_while_the_sources_wildcard_nuid_is_rewritten_succeeds(ops_env, who):
    """The claim of the source refused (its rewrite landed after the new name was stored over keep2):
    the refused rename stores keep2 back, then the rename is done over it all the same."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish(env, "dotted", SOURCES["dotted"])
        await env.settle()
        rewrite = rewrite_by(env, who)
        before(env, "publish_meta", lambda bucket, doc, **k: doc.get("deleted") is True and doc["name"] == "dotted",
               lambda: rewrite("dotted"))
        b = (await env.lookup("b")).st_ino
        await env.ops.rename(b, b"dotted", b, b"keep2", 0, Ctx())
        await env.settle()
        moved, _ = await meta_of(env, "keep2")
        assert_moved(moved, SOURCES["dotted"], "keep2")
        assert await env.cat("b/keep2") == b""
        assert (await meta_of(env, "dotted"))[0].get("deleted") is True
        assert "dotted" not in (await env.listdir(b)).names
        assert await env.cat("b/keep1") == b"one" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


@pytest.mark.parametrize("who", ["own", "other"])
def test_a_rename_over_a_target_whose_wildcard_nuid_is_rewritten_succeeds(ops_env, who):
    """The other name of a rename: its target, a live meta with a wildcard nuid, rewritten after the
    mount listed it, before the rename's publish that expects the target's revision. The target is
    replaced, as on a local disk."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish(env, "dotted", SOURCES["dotted"])
        await env.settle()
        rewrite = rewrite_by(env, who)
        before(env, "rename", lambda *a, **k: True, lambda: rewrite("dotted"))
        b = (await env.lookup("b")).st_ino
        await env.ops.rename(b, b"keep2", b, b"dotted", 0, Ctx())
        await env.settle()
        assert await env.cat("b/dotted") == b"two" * 1000
        doc, _ = await meta_of(env, "dotted")
        assert usable_nuid(doc["nuid"]) and "description" not in doc
        assert (await meta_of(env, "keep2"))[0].get("deleted") is True
        assert await env.cat("b/keep1") == b"one" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


@pytest.mark.parametrize("who", ["own", "other"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_an_unlink_while_the_wildcard_nuid_is_rewritten_succeeds(ops_env, name, who):
    """The rewrite lands between the mount's listing of the name and the unlink's tombstone (which
    expects the revision listed): the name is removed (not ESTALE), on a fresh nuid."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish(env, name, SOURCES[name])
        await env.settle()
        rewrite = rewrite_by(env, who)
        before(env, "delete", lambda *a, **k: True, lambda: rewrite(name))
        b = (await env.lookup("b")).st_ino
        await env.ops.unlink(b, name.encode(), Ctx())
        await env.settle()
        doc, _ = await meta_of(env, name)
        assert doc.get("deleted") is True and usable_nuid(doc["nuid"])
        assert name not in (await env.listdir(b)).names
        assert await env.cat("b/keep1") == b"one" * 1000

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)


def test_the_rewrite_after_a_rename_never_brings_the_old_name_back(ops_env):
    """This mount's own rewrite stored, but its answer comes back only after a rename of the name was
    done: the rewritten meta (older than the rename's claim) is not shown under the old name."""
    async def body(env: Env) -> None:
        await env.lookup("b/keep1")
        await publish(env, "dotted", SOURCES["dotted"])
        await env.settle()
        b = (await env.lookup("b")).st_ino
        original = env.store.publish_meta

        async def rename_in_between(bucket: str, doc: dict, **kwargs: Any) -> Any:
            stored = await original(bucket, doc, **kwargs)
            if doc["name"] == "dotted" and not doc.get("deleted"):
                env.store.publish_meta = original  # type: ignore[method-assign]
                await env.ops.rename(b, b"dotted", b, b"moved", 0, Ctx())
            return stored

        env.store.publish_meta = rename_in_between  # type: ignore[method-assign]
        await env.fs.mut.defuse_wildcard_nuids()
        await env.settle()
        listed = (await env.listdir(b)).names
        assert "moved" in listed and "dotted" not in listed
        assert (await meta_of(env, "dotted"))[0]["deleted"] is True

    ops_env(body, setup=bucket_with_objects, settle_interval=3600)
