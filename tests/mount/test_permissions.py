"""A NATS user the server grants less than everything (publish/subscribe permissions): what the mount
may not do fails with EACCES at once, one log line per kind of refusal, nothing of a refused write is
left in the bucket, and the connections stay (a permissions violation refuses one message, it does not
end the connection: the server keeps it, and so must the mount)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import trio
from helpers import create_bucket, nats_py_put, wait_for, with_nats
from test_lean_reads import put_object, read_both_ways

from natsfs.bridge import Bridge
from natsfs.errors import NotPermitted
from natsfs.jetstream import JetStreams
from natsfs.server import NatsServer

REQUEST_TIMEOUT = 20  # (a refusal that waited it out would be the defect; nothing here waits that long)
# What a request, a batch or a store that waited out its deadline says (an EIO, never an EACCES).
WAITED_OUT = re.compile(r"timed out after|no reply in|not stored within")

PERMISSIONS = """
accounts {
  APP {
    jetstream: enabled
    users: [
      { user: admin, password: admin }
      { user: ro, password: ro, permissions: { publish: { allow: ["$JS.API.>", "_INBOX.>"] },
                                              subscribe: { allow: ["_INBOX.>", "$O.>"] } } }
      { user: nodirect, password: nodirect, permissions: { publish: { allow: [">"], deny: ["$JS.API.DIRECT.GET.>"] },
                                                          subscribe: { allow: [">"] } } }
      { user: noget, password: noget,
        permissions: { publish: { allow: [">"], deny: ["$JS.API.DIRECT.GET.>", "$JS.API.STREAM.MSG.GET.>"] },
                       subscribe: { allow: [">"] } } }
      { user: nometa, password: nometa, permissions: { publish: { allow: [">"], deny: ["$O.*.M.>"] },
                                                      subscribe: { allow: [">"] } } }
      { user: nopurge, password: nopurge,
        permissions: { publish: { allow: [">"], deny: ["$O.*.M.>", "$JS.API.STREAM.PURGE.>"] },
                       subscribe: { allow: [">"] } } }
    ]
  }
  SYS { users: [{ user: sys, password: sys }] }
}
system_account: SYS
"""

A = os.urandom(600_000)  # five chunks
B = os.urandom(3000)


@pytest.fixture(scope="module")
def perm_server(tmp_path_factory: Any) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("perm-nats"), config=PERMISSIONS)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def as_user(server: NatsServer, user: str) -> str:
    return f"nats://{user}:{user}@{server.host}:{server.port}"


def stored_subjects(admin: str, bucket: str) -> dict[str, int]:
    async def fn(nc: Any, js: Any) -> dict[str, int]:
        info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=">")
        return dict(info.state.subjects or {})

    return with_nats(admin, fn)


def closed_connections(server: NatsServer, user: str) -> int:
    """Connections of `user` the server has seen closed (its monitoring of closed connections: state 1 is closed)."""
    async def main() -> int:
        nc = await nats.connect(as_user(server, "sys"))
        try:
            r = await nc.request("$SYS.REQ.SERVER.PING.CONNZ",
                                 json.dumps({"state": 1, "auth": True, "limit": 1024}).encode(), timeout=5)
            reply = json.loads(r.data)
            assert "data" in reply, reply
            conns = reply["data"]["connections"] or []
            return sum(c.get("authorized_user") == user for c in conns)
        finally:
            await nc.close()

    return asyncio.run(main())


closed_before: dict[str, int] = {}


def dropped_connections(server: NatsServer, user: str) -> int:
    """Connections of `user` closed since its mount was made (`mount_as`)."""
    return closed_connections(server, user) - closed_before[user]


def errno_of(action: Any) -> int | None:
    try:
        action()
    except OSError as e:
        return e.errno
    return None


def write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def refusal_lines(log: str, kind: str) -> int:
    return sum("WARNING natsfs.bridge: permission denied: the NATS server does not let this user" in line
               and kind in line
               for line in log.splitlines())


@pytest.fixture()
def objects(perm_server: NatsServer, bucket_name: str) -> dict[str, int]:
    admin = as_user(perm_server, "admin")
    create_bucket(admin, bucket_name)
    nats_py_put(admin, bucket_name, "a", A, create=False)
    nats_py_put(admin, bucket_name, "b", B, create=False)
    return stored_subjects(admin, bucket_name)


def mount_as(mounter: Any, server: NatsServer, bucket: str, user: str, *args: str) -> Any:
    closed_before[user] = closed_connections(server, user)  # (earlier tests' mounts of this user)
    return mounter(f"nats://{server.host}:{server.port}", "--bucket", bucket, "--user", user, "--password", user,
                   "--request-timeout", str(REQUEST_TIMEOUT), "--flush-timeout", str(REQUEST_TIMEOUT), *args)


def test_reads_without_direct_get_permission_go_through_msg_get_on_the_same_connections(
        perm_server, mounter, bucket_name, objects):
    m = mount_as(mounter, perm_server, bucket_name, "nodirect")
    assert (m / "a").read_bytes() == A
    assert (m / "b").read_bytes() == B
    assert (m / "a").read_bytes() == A
    log = m.log()
    assert refusal_lines(log, "$JS.API.DIRECT.GET") == 1
    assert dropped_connections(perm_server, "nodirect") == 0  # no connection was dropped for it
    assert "lost the lean connection" not in log and "replies in flight" not in log  # nor the budget shrunk


def test_reads_without_any_get_permission_fail_with_eacces_and_keep_the_connections(
        perm_server, mounter, bucket_name, objects):
    m = mount_as(mounter, perm_server, bucket_name, "noget")
    assert sorted(os.listdir(m.path)) == ["a", "b"]  # (the listing comes from the watch)
    for _ in range(3):
        assert errno_of(lambda: (m / "a").read_bytes()) == errno.EACCES
        assert errno_of(lambda: (m / "b").read_bytes()) == errno.EACCES
    log = m.log()
    # Refused at once, not waited out: each refusal ended the request it was for (EACCES, which only a
    # refusal gives), and no request waited for its deadline.
    assert not WAITED_OUT.search(log), WAITED_OUT.search(log)
    assert refusal_lines(log, "$JS.API.DIRECT.GET") == 1
    assert refusal_lines(log, "$JS.API.STREAM.MSG.GET") == 1
    assert dropped_connections(perm_server, "noget") == 0
    assert "lost the lean connection" not in log and "replies in flight" not in log
    assert m.alive


@pytest.mark.expect_log(r"closed without a successful upload \(permission denied")
def test_a_read_only_user_gets_eacces_for_every_change_and_the_bucket_keeps_what_it_had(
        perm_server, mounter, bucket_name, objects):
    m = mount_as(mounter, perm_server, bucket_name, "ro")
    assert errno_of(lambda: write(m / "c", b"c" * 1000)) == errno.EACCES
    assert errno_of(lambda: write(m / "b", b"B" * 3000)) == errno.EACCES
    assert errno_of(lambda: write(m / "big", os.urandom(6 << 20))) == errno.EACCES  # (sent by the upload worker)
    assert errno_of(lambda: os.unlink(m / "a")) == errno.EACCES
    assert errno_of(lambda: os.mkdir(m / "d")) == errno.EACCES
    assert not WAITED_OUT.search(m.log()), WAITED_OUT.search(m.log())  # refused at once, not waited out
    assert sorted(os.listdir(m.path)) == ["a", "b"]
    assert (m / "a").read_bytes() == A and (m / "b").read_bytes() == B  # the mount still serves reads
    assert stored_subjects(as_user(perm_server, "admin"), bucket_name) == objects  # nothing left behind
    log = m.log()
    assert refusal_lines(log, f"$O.{bucket_name}.C.") == 1  # one line per kind, not per message
    assert refusal_lines(log, f"$O.{bucket_name}.M.") == 1
    assert "may or may not be stored" not in log and "unreachable" not in log
    assert dropped_connections(perm_server, "ro") == 0


@pytest.mark.expect_log(r"closed without a successful upload \(permission denied")
def test_chunks_stored_before_the_meta_was_refused_are_purged(perm_server, mounter, bucket_name, objects):
    m = mount_as(mounter, perm_server, bucket_name, "nometa")
    assert errno_of(lambda: write(m / "c", os.urandom(300_000))) == errno.EACCES
    assert errno_of(lambda: write(m / "b", b"B" * 3000)) == errno.EACCES
    assert (m / "b").read_bytes() == B
    # The chunks were stored (this user may publish them), the meta was not: the put purged them.
    assert stored_subjects(as_user(perm_server, "admin"), bucket_name) == objects
    log = m.log()
    assert refusal_lines(log, f"$O.{bucket_name}.M.") == 1
    assert "are removed once the server answers" not in log and "may or may not be stored" not in log


@pytest.mark.expect_log(r"closed without a successful upload \(permission denied")
def test_chunks_whose_purge_is_refused_too_are_left_for_fsck_with_one_line(perm_server, mounter, bucket_name):
    admin = as_user(perm_server, "admin")
    # Without atomic batches the chunks are stored before the meta is sent (a refused batch stores nothing).
    create_bucket(admin, bucket_name, atomic=False)
    m = mount_as(mounter, perm_server, bucket_name, "nopurge")
    assert errno_of(lambda: write(m / "c", os.urandom(300_000))) == errno.EACCES
    left = "cannot be removed (permission denied"
    assert wait_for(lambda: left in m.log(), 60), m.log()  # (the put journal's next pass)
    stored = stored_subjects(admin, bucket_name)
    assert list(stored.values()) == [3] and next(iter(stored)).startswith(f"$O.{bucket_name}.C.")  # c's chunks
    log = m.log()
    assert sum(left in line for line in log.splitlines()) == 1  # given up, not retried every pass
    assert "are removed once the server answers" not in log
    assert refusal_lines(log, "$JS.API.STREAM.PURGE") == 1
    assert sorted(os.listdir(m.path)) == []


def test_write_back_gives_a_refused_upload_up_to_lost_and_found(perm_server, mounter, bucket_name, objects):
    m = mount_as(mounter, perm_server, bucket_name, "ro", "--write-back")
    write(m / "c", b"c" * 1000)  # (accepted locally: refused when uploaded)
    write(m / "b", b"B" * 3000)

    def kept() -> list[str]:
        return sorted(p.name.split(".")[0] for p in m.cache_dir.rglob(f"lost+found/{bucket_name}/*"))

    assert wait_for(lambda: kept() == ["b", "c"], 60), m.log()
    log = m.log()
    for name in ("b", "c"):  # once each: given up, not retried
        assert sum(f"{bucket_name}/{name}: not stored by the write-back uploader (permission denied" in line
                   for line in log.splitlines()) == 1
    assert stored_subjects(as_user(perm_server, "admin"), bucket_name) == objects
    assert "are removed once the server answers" not in log
    assert (m / "b").read_bytes() == B  # the bucket's version again
    assert dropped_connections(perm_server, "ro") == 0


@pytest.mark.expect_log(r"closed without a successful upload \(permission denied")
def test_a_publish_refused_to_the_upload_worker_is_reported_by_the_daemon(perm_server, mounter, bucket_name):
    admin = as_user(perm_server, "admin")
    create_bucket(admin, bucket_name, atomic=False)  # (a bucket taking batches has them sent in-process)
    m = mount_as(mounter, perm_server, bucket_name, "ro")
    assert errno_of(lambda: write(m / "c", os.urandom(300_000))) == errno.EACCES  # (sent by the upload worker)
    assert errno_of(lambda: write(m / "d", os.urandom(300_000))) == errno.EACCES
    assert stored_subjects(admin, bucket_name) == {}
    assert refusal_lines(m.log(), f"$O.{bucket_name}.C.") == 1  # the worker's stderr is not the log
    assert dropped_connections(perm_server, "ro") == 0


@pytest.mark.parametrize("in_trio", [True, False], ids=["trio", "asyncio"])
def test_a_refused_request_fails_at_once_on_either_connection_and_neither_is_replaced(perm_server, bucket_name,
                                                                                       in_trio):
    """The lean connection (driven by trio or by asyncio) and the main one (nats-py) alike: the refused
    request fails with NotPermitted, the next one on the same connection is answered, nothing reconnects."""
    chunks = put_object(as_user(perm_server, "admin"), bucket_name)

    async def main() -> None:
        closed_at_start = await trio.to_thread.run_sync(closed_connections, perm_server, "nodirect")
        bridge = Bridge([as_user(perm_server, "nodirect")], request_timeout=REQUEST_TIMEOUT, trio_reads=in_trio)
        await bridge.connect()
        try:
            assert bridge.lean_reads and bridge.reads_in_trio == in_trio
            lean = bridge._reads.nc if bridge._reads is not None else None
            body = json.dumps({"seq": 1, "next_by_subj": f"$O.{bucket_name}.C.>", "batch": 2}).encode()
            with trio.fail_after(REQUEST_TIMEOUT / 2):
                for _ in range(3):  # over the lean connection
                    with pytest.raises(NotPermitted) as refused:
                        await bridge.request_many(f"$JS.API.DIRECT.GET.OBJ_{bucket_name}", body, max_bytes=1 << 20)
                    assert refused.value.errno == errno.EACCES
                    with pytest.raises(NotPermitted):  # over the main connection
                        await bridge.api(f"DIRECT.GET.OBJ_{bucket_name}", {"seq": 1})
                    assert "limits" in await bridge.api("INFO")
            whole, streamed = await read_both_ways(JetStreams(bridge), bucket_name)  # through STREAM.MSG.GET
            assert [bytes(d) for *_, d in whole] == chunks == [bytes(d) for *_, d in streamed]
            assert bridge._reads is not None and bridge._reads.nc is lean  # the same lean connection
            assert bridge.connected and bridge.reconnects == 0
            assert await trio.to_thread.run_sync(closed_connections, perm_server, "nodirect") == closed_at_start
        finally:
            await bridge.close()

    trio.run(main)
