"""What natsfs.fs.Operations asks the kernel to forget (no kernel: the notifier only records it):
nothing this mount is changing itself, everything another client changes."""

from __future__ import annotations

from opskit import ROOT, Env

from natsfs.adr20 import ObjectStore
from natsfs.memstreams import MemoryStreams, put_object


class Ctx:
    uid = 1000
    gid = 1000
    pid = 1
    umask = 0o022


async def files(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    for i in range(20):
        await put_object(ms, "b", f"dir/f{i:02d}", b"x")
    await put_object(ms, "b", "other.txt", b"one")


def test_own_changes_are_not_invalidated_others_are(ops_env):
    async def body(env: Env) -> None:
        env.ops.start(env.nursery)
        await env.settle()
        d = (await env.lookup("dir")).st_ino
        for i in range(20):
            await env.ops.lookup(d, f"f{i:02d}".encode(), None)
        other = (await env.lookup("other.txt")).st_ino
        env.ops.kernel.sent.clear()
        # This mount renames a directory: the kernel learns it from our answer.
        await env.ops.rename(ROOT, b"dir", ROOT, b"moved", 0, Ctx())
        await env.settle()
        assert env.ops.kernel.sent == []
        # Another client replaces a file: its entry, attributes and pages go.
        await put_object(env.streams, "b", "other.txt", b"two")
        await env.settle()
        assert ("entry", ROOT, b"other.txt") in env.ops.kernel.sent
        assert ("inode", other, None) in env.ops.kernel.sent

    ops_env(body, setup=files, bucket="b")
