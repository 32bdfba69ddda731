"""MemoryStreams: the JetStream semantics the ADR-20 layer relies on, and the nats.go-style fixture writers."""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from gowriters import delete_object, put_link, put_object, rename_object

from natsfs.adr20 import ObjectStore, chunk_subject, digest_of, meta_subject, stream_name
from natsfs.errors import AlreadyExists, Conflict, InvalidArgument, JetStreamAPIError, NoSpace, NotFound, ReadOnly
from natsfs.memstreams import MemoryStreams, stored_size, subject_matches, subjects_overlap
from natsfs.streams import EXPECTED_LAST_SUBJECT_SEQ, ROLLUP, Streams, Watch

CFG = {"name": "S", "subjects": ["s.>", "t.*"], "allow_rollup_hdrs": True, "discard": "new", "allow_direct": True}


def run(body: Callable[[MemoryStreams], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        ms = MemoryStreams(**kw)
        await ms.create_stream(CFG)
        return await body(ms)

    return trio.run(main)


@pytest.mark.parametrize(
    ("pattern", "subject", "ok"),
    [("a.>", "a.b", True), ("a.>", "a.b.c", True), ("a.>", "a", False), ("a.*", "a.b", True),
     ("a.*", "a.b.c", False), ("a.*.c", "a.x.c", True), ("a.b", "a.b", True), ("a.b", "a.c", False),
     (">", "x", True), ("*", "x.y", False), ("$O.b.M.>", "$O.b.M.Lg==", True), ("$O.b.C.>", "$O.b.M.x", False)],
)
def test_subject_matches(pattern, subject, ok):
    assert subject_matches(pattern, subject) is ok


@pytest.mark.parametrize(
    ("a", "b", "ok"),
    [("a.>", "a.b", True), ("a.*", "*.b", True), ("a.b", "a.c", False), ("a.>", "b.>", False), ("a.*", "a.b.c", False),
     (">", "x.y", True), ("$O.x.C.>", "$O.y.C.>", False)],
)
def test_subjects_overlap(a, b, ok):
    assert subjects_overlap(a, b) is ok and subjects_overlap(b, a) is ok


def test_sequences_timestamps_and_wildcard_routing():
    async def body(ms):
        s1 = await ms.publish("s.a", b"1")
        s2 = await ms.publish("t.x", b"2")
        s3 = await ms.publish("s.a.deep", b"3")
        assert (s1, s2, s3) == (1, 2, 3)
        with pytest.raises(NotFound):
            await ms.publish("t.x.y", b"no stream takes this")
        with pytest.raises(NotFound):
            await ms.publish("u", b"")
        msgs = ms.messages("S")
        assert [m.seq for m in msgs] == [1, 2, 3]
        assert all(msgs[i].time_ns <= msgs[i + 1].time_ns for i in range(2))
        assert msgs[0].time_ns > 1_600_000_000 * 10**9

    run(body)


def test_stream_info_accounts_bytes_consistently():
    async def body(ms):
        st = await ms.stream_info("S")
        assert (st.messages, st.bytes, st.first_seq, st.last_seq) == (0, 0, 0, 0)
        assert st.created_ns > 0 and st.config["max_bytes"] == -1 and st.name == "S"
        await ms.publish("s.a", b"xyz")
        await ms.publish("s.b", b"12345", {"K": "v"})
        st = await ms.stream_info("S")
        assert st.messages == 2 and (st.first_seq, st.last_seq) == (1, 2)
        assert st.bytes == stored_size("s.a", None, b"xyz") + stored_size("s.b", {"K": "v"}, b"12345")
        for subject in ("s.a", "s.b"):  # (a purge by a wildcard is refused: see streams.check_purge_filter)
            await ms.purge_subject("S", subject)
        st = await ms.stream_info("S")
        assert (st.messages, st.bytes, st.first_seq, st.last_seq) == (0, 0, 3, 2)
        assert (await ms.account_limits()).storage_used == 0

    run(body)


def test_rollup_sub_keeps_only_the_newest_on_that_subject():
    async def body(ms):
        await ms.publish("s.m", b"1")
        await ms.publish("s.m", b"2")
        await ms.publish("s.other", b"x")
        seq = await ms.publish("s.m", b"3", {ROLLUP: "sub"})
        assert ms.subjects("S") == {"s.m": 1, "s.other": 1}
        last = await ms.last_msg("S", "s.m")
        assert (last.seq, last.data, last.headers) == (seq, b"3", {ROLLUP: "sub"})
        await ms.publish("s.x", b"all", {ROLLUP: "all"})
        assert ms.subjects("S") == {"s.x": 1}

    run(body)


def test_rollup_needs_allow_rollup_hdrs():
    async def main():
        ms = MemoryStreams()
        await ms.create_stream({"name": "N", "subjects": ["n.>"]})
        with pytest.raises(JetStreamAPIError, match="rollup"):
            await ms.publish("n.a", b"x", {ROLLUP: "sub"})

    trio.run(main)


def test_expected_last_subject_sequence():
    async def body(ms):
        assert await ms.publish("s.m", b"first", {EXPECTED_LAST_SUBJECT_SEQ: "0"}) == 1
        with pytest.raises(Conflict):
            await ms.publish("s.m", b"x", {EXPECTED_LAST_SUBJECT_SEQ: "0"})
        await ms.publish("s.other", b"y")
        assert await ms.publish("s.m", b"second", {EXPECTED_LAST_SUBJECT_SEQ: "1"}) == 3  # refused ones take no seq
        with pytest.raises(Conflict):
            await ms.publish("s.m", b"x", {EXPECTED_LAST_SUBJECT_SEQ: "1"})  # stale revision
        assert ms.subjects("S")["s.m"] == 2

    run(body)


def test_max_bytes_discard_new_raises_nospace():
    async def main():
        ms = MemoryStreams()
        await ms.create_stream({"name": "L", "subjects": ["l.>"], "max_bytes": 200, "discard": "new"})
        await ms.publish("l.a", b"x" * 100)
        with pytest.raises(NoSpace):
            await ms.publish("l.a", b"x" * 100)
        st = await ms.stream_info("L")
        assert st.messages == 1 and st.bytes <= 200

    trio.run(main)


def test_max_bytes_discard_old_drops_the_oldest():
    async def main():
        ms = MemoryStreams()
        await ms.create_stream({"name": "L", "subjects": ["l.>"], "max_bytes": 300})
        for i in range(5):
            await ms.publish("l.a", bytes([i]) * 100)
        st = await ms.stream_info("L")
        assert st.bytes <= 300 and st.last_seq == 5 and st.first_seq == 4
        assert [m.data[0] for m in ms.messages("L")] == [3, 4]

    trio.run(main)


def test_account_storage_limit():
    async def main():
        ms = MemoryStreams(max_storage=500)
        await ms.create_stream({"name": "L", "subjects": ["l.>"]})
        await ms.publish("l.a", b"x" * 300)
        with pytest.raises(NoSpace):
            await ms.publish("l.a", b"x" * 300)
        limits = await ms.account_limits()
        assert limits.max_storage == 500 and 300 < limits.storage_used < 500

    trio.run(main)


def test_sealed_stream_refuses_publish_and_purge():
    async def body(ms):
        await ms.publish("s.a", b"1")
        st = await ms.stream_info("S")
        await ms.update_stream(dict(st.config, sealed=True))
        with pytest.raises(ReadOnly):
            await ms.publish("s.a", b"2")
        with pytest.raises(ReadOnly):
            await ms.purge_subject("S", "s.a")
        with pytest.raises(InvalidArgument):
            await ms.update_stream(dict(st.config, sealed=False))
        assert (await ms.last_msg("S", "s.a")).data == b"1"

    run(body)


def test_stream_lifecycle():
    async def body(ms):
        again = await ms.create_stream(dict(CFG))
        assert again.name == "S"
        with pytest.raises(AlreadyExists):
            await ms.create_stream(dict(CFG, max_bytes=10))
        with pytest.raises(JetStreamAPIError, match="overlap"):
            await ms.create_stream({"name": "T", "subjects": ["s.x"]})
        await ms.create_stream({"name": "T", "subjects": ["u.>"]})
        assert await ms.stream_names() == ["S", "T"]
        st = await ms.update_stream(dict(CFG, max_bytes=1000, description="d"))
        assert st.config["max_bytes"] == 1000 and st.config["description"] == "d"
        await ms.delete_stream("T")
        with pytest.raises(NotFound):
            await ms.delete_stream("T")
        with pytest.raises(NotFound):
            await ms.stream_info("T")
        with pytest.raises(NotFound):
            await ms.update_stream({"name": "T", "subjects": ["u.>"]})
        with pytest.raises(NotFound):
            await ms.last_msg("T", "u.a")
        assert await ms.stream_names() == ["S"]

    run(body)


def test_last_msg_get_batch_subject_index():
    async def body(ms):
        assert await ms.last_msg("S", "s.none") is None
        assert await ms.get_batch("S", "s.none", 1, 10, 1000) == []
        for i in range(6):
            await ms.publish("s.c", bytes([i]) * 10)
            await ms.publish("s.other", b"zz")
        seqs = [1, 3, 5, 7, 9, 11]
        assert await ms.subject_index("S", "s.c") == [(s, 10) for s in seqs]
        got = await ms.get_batch("S", "s.c", 0, 100, 10_000)
        assert [m.seq for m in got] == seqs
        assert [m.seq for m in await ms.get_batch("S", "s.c", 4, 2, 10_000)] == [5, 7]
        # Stops once max_bytes is reached, but always returns at least one.
        assert [m.seq for m in await ms.get_batch("S", "s.c", 1, 100, 25)] == [1, 3, 5]
        assert [m.seq for m in await ms.get_batch("S", "s.c", 1, 100, 1)] == [1]
        assert await ms.get_batch("S", "s.c", 12, 100, 1000) == []
        assert (await ms.last_msg("S", "s.c")).seq == 11

    run(body)


def test_direct_get_replies_carry_subject_sequence_and_pending_like_the_server():
    """As nats-server's batched direct get: `Nats-Num-Pending` counts the messages on the subject after
    each reply, at the time of the request (checked against nats-server 2.15)."""

    async def body(ms):
        for i in range(4):
            await ms.publish("s.c", bytes([i]))
            await ms.publish("s.other", b"zz")
        got = await ms.get_batch("S", "s.c", 3, 2, 10_000)
        assert [(m.seq, m.subject, m.pending) for m in got] == [(3, "s.c", 2), (5, "s.c", 1)]
        streamed = await ms.stream_batch("S", "s.c", 1, 10, 10_000)
        out = []
        while (msgs := await streamed.next()) is not None:
            out += msgs
        assert [(m.seq, m.pending) for m in out] == [(1, 3), (3, 2), (5, 1), (7, 0)]
        # The stored messages themselves are not changed by a get.
        assert all(m.pending == -1 for m in ms.messages("S"))

    run(body)


def test_delete_msg_and_sequences():
    async def body(ms):
        for i in range(5):
            await ms.publish("s.c", bytes([i]))
        await ms.delete_msg("S", 3)
        with pytest.raises(JetStreamAPIError):
            await ms.delete_msg("S", 3)
        assert await ms.subject_index("S", "s.c") == [(1, 1), (2, 1), (4, 1), (5, 1)]
        assert [m.pending for m in await ms.get_batch("S", "s.c", 1, 10, 100)] == [3, 2, 1, 0]
        assert await ms.sequences("S", 1, 5) == [1, 2, 4]
        assert await ms.sequences("S", 4, 100) == [4, 5]
        assert await ms.sequences("S", 5, 5) == []

    run(body)


def test_faults_and_call_counts():
    async def body(ms):
        ms.fail_next_publish(RuntimeError("boom"), subject="s.meta")
        await ms.publish("s.chunk", b"fine")
        with pytest.raises(RuntimeError, match="boom"):
            await ms.publish("s.meta", b"x")
        await ms.publish("s.meta", b"x")
        ms.fail_next("last_msg", NoSpace("x"), times=2)
        for _ in range(2):
            with pytest.raises(NoSpace):
                await ms.last_msg("S", "s.meta")
        assert (await ms.last_msg("S", "s.meta")).data == b"x"
        assert ms.calls["publish"] == 3 and ms.calls["last_msg"] == 3

    run(body)


# ---------------------------------------------------------------- watches
def test_watch_snapshot_last_per_subject_then_live():
    async def body(ms):
        await ms.publish("s.a", b"a1")
        await ms.publish("s.b", b"b1")
        await ms.publish("s.a", b"a2")
        await ms.publish("t.x", b"not in filter")
        w = await ms.watch("S", "s.>")
        b = await w.next_batch(timeout=0)
        assert [(m.subject, m.data) for m in b.msgs] == [("s.b", b"b1"), ("s.a", b"a2")]
        assert b.caught_up and not b.reset
        b = await w.next_batch(timeout=0)
        assert b.msgs == [] and b.caught_up
        await ms.publish("s.c", b"c1")
        await ms.publish("t.y", b"no")
        await ms.publish("s.a", b"a3")
        b = await w.next_batch(timeout=0)
        assert [m.data for m in b.msgs] == [b"c1", b"a3"] and b.caught_up
        await w.close()

    run(body)


def test_watch_all_delivers_history():
    async def body(ms):
        for d in (b"1", b"2", b"3"):
            await ms.publish("s.a", d)
        w = await ms.watch("S", "s.a", last_per_subject=False)
        b = await w.next_batch(timeout=0)
        assert [m.data for m in b.msgs] == [b"1", b"2", b"3"] and b.caught_up

    run(body)


def test_watch_empty_stream_is_caught_up_at_once():
    async def body(ms):
        w = await ms.watch("S", "s.>")
        b = await w.next_batch(timeout=5)
        assert b.msgs == [] and b.caught_up

    run(body)


def test_watch_caught_up_only_on_the_batch_with_the_last_snapshot_message():
    async def body(ms):
        for i in range(5):
            await ms.publish(f"s.{i}", b"x")
        w = await ms.watch("S", "s.>")
        seen, flags = [], []
        while True:
            b = await w.next_batch(timeout=0)
            seen += [m.subject for m in b.msgs]
            flags.append(b.caught_up)
            if b.caught_up:
                break
        assert seen == [f"s.{i}" for i in range(5)]
        assert flags == [False, False, True]

    run(body, watch_batch=2)


def test_watch_blocks_until_a_publish_wakes_it():
    async def body(ms):
        w = await ms.watch("S", "s.>")
        await w.next_batch(timeout=0)
        got: list[bytes] = []

        async def waiter():
            b = await w.next_batch()  # no timeout: waits for the publish
            got.extend(m.data for m in b.msgs)

        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            await ms.publish("s.a", b"wake")
        assert got == [b"wake"]

    run(body)


def test_watch_times_out_with_an_empty_batch():
    async def main():
        ms = MemoryStreams()
        await ms.create_stream(CFG)
        w = await ms.watch("S", "s.>")
        await w.next_batch(timeout=0)
        before = trio.current_time()
        b = await w.next_batch(timeout=3.0)
        assert b.msgs == [] and b.caught_up
        assert trio.current_time() - before >= 3.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_deleted_stream_makes_watch_raise_notfound():
    async def body(ms):
        w = await ms.watch("S", "s.>")
        await w.next_batch(timeout=0)
        errors: list[BaseException] = []

        async def waiter():
            try:
                await w.next_batch()
            except NotFound as e:
                errors.append(e)

        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            await ms.delete_stream("S")
        assert len(errors) == 1
        with pytest.raises(NotFound):
            await w.next_batch(timeout=0)
        with pytest.raises(NotFound):
            await ms.watch("S", "s.>")

    run(body)


def test_reset_watches_restarts_from_a_fresh_snapshot():
    async def body(ms):
        await ms.publish("s.a", b"1")
        w = await ms.watch("S", "s.>")
        assert (await w.next_batch(timeout=0)).caught_up
        await ms.publish("s.a", b"2")
        ms.reset_watches("S")
        b = await w.next_batch(timeout=0)
        assert b.reset and b.caught_up and [m.data for m in b.msgs] == [b"2"]

    run(body)


def test_purged_snapshot_messages_are_skipped():
    async def body(ms):
        await ms.publish("s.a", b"1")
        await ms.publish("s.b", b"2")
        w = await ms.watch("S", "s.>")
        await ms.purge_subject("S", "s.a")
        b = await w.next_batch(timeout=0)
        assert [m.data for m in b.msgs] == [b"2"] and b.caught_up

    run(body)


# ---------------------------------------------------------------- fixture writers (as nats.go)
def test_put_object_writes_what_nats_go_writes():
    async def main():
        ms = MemoryStreams()
        store = ObjectStore(ms)
        await store.create_bucket("b")
        data = bytes(range(256)) * 1000
        info = await put_object(ms, "b", "dir/f.bin", data, chunk_size=100_000, description="d",
                                metadata={"k": "v"})
        msgs = ms.messages("OBJ_b")
        assert [len(m.data) for m in msgs[:-1]] == [100_000, 100_000, 56_000]
        assert all(m.subject == chunk_subject("b", info.nuid) and m.headers is None for m in msgs[:-1])
        meta = msgs[-1]
        assert meta.subject == meta_subject("b", "dir/f.bin") == "$O.b.M.ZGlyL2YuYmlu"
        assert meta.headers == {"Nats-Rollup": "sub"}
        doc = json.loads(meta.data)
        assert list(doc) == ["name", "description", "metadata", "options", "bucket", "nuid", "size", "mtime",
                             "chunks", "digest"]
        assert doc["mtime"] == "0001-01-01T00:00:00Z" and doc["digest"] == digest_of(data)
        assert (doc["size"], doc["chunks"], doc["options"]) == (256_000, 3, {"max_chunk_size": 100_000})
        assert b'", "' not in meta.data  # compact, like Go
        assert len(info.nuid) == 22
        # Overwrite: new nuid, old chunks purged, one meta.
        info2 = await put_object(ms, "b", "dir/f.bin", b"small")
        assert info2.nuid != info.nuid
        assert ms.subjects("OBJ_b") == {chunk_subject("b", info2.nuid): 1, meta_subject("b", "dir/f.bin"): 1}
        # Uneven chunks.
        info3 = await put_object(ms, "b", "u", b"abcdefghij", chunk_sizes=[1, 6, 3])
        assert [d for _, d in await ms.subject_index("OBJ_b", chunk_subject("b", info3.nuid))] == [1, 6, 3]
        with pytest.raises(ValueError):
            await put_object(ms, "b", "bad", b"abc", chunk_sizes=[1, 1])
        # Empty object: no chunks.
        empty = await put_object(ms, "b", "e", b"")
        assert (empty.size, empty.chunks, empty.digest) == (0, 0, digest_of(b""))
        # Tombstone, as nats.go: deleted, size/chunks 0, no digest, chunks purged.
        await delete_object(ms, "b", "u")
        tomb = json.loads((await ms.last_msg("OBJ_b", meta_subject("b", "u"))).data)
        assert tomb["deleted"] is True and tomb["size"] == 0 and tomb["chunks"] == 0 and "digest" not in tomb
        assert chunk_subject("b", info3.nuid) not in ms.subjects("OBJ_b")
        with pytest.raises(NotFound):
            await delete_object(ms, "b", "u")
        assert sorted(await store.live_objects("b")) == ["dir/f.bin", "e"]

    trio.run(main)


def test_links_and_rename():
    async def main():
        ms = MemoryStreams()
        store = ObjectStore(ms)
        await store.create_bucket("b")
        await put_object(ms, "b", "t", b"target")
        go = await put_link(ms, "b", "l-go", "b", "t")
        js = await put_link(ms, "b", "l-js", "other", None, style="js")
        assert go.link is not None and go.link.name == "t" and go.nuid and go.size == 0
        assert js.link is not None and js.link.name is None and js.nuid == ""
        assert (await ms.last_msg("OBJ_b", meta_subject("b", "l-js"))).headers is None
        renamed = await rename_object(ms, "b", "t", "t2")
        assert renamed.name == "t2" and await ms.last_msg("OBJ_b", meta_subject("b", "t")) is None
        assert sorted(await store.live_objects("b")) == ["l-go", "l-js", "t2"]
        with pytest.raises(AlreadyExists):
            await rename_object(ms, "b", "l-go", "t2")

    trio.run(main)


def test_object_store_over_memory_streams():
    async def main():
        ms = MemoryStreams()
        store = ObjectStore(ms)
        st = await store.create_bucket("bk", max_bytes=10_000, description="desc", metadata={"a": "b"})
        assert (st.bucket, st.max_bytes, st.description, st.metadata, st.sealed) == ("bk", 10_000, "desc",
                                                                                      {"a": "b"}, False)
        assert await store.list_buckets() == ["bk"]
        await put_object(ms, "bk", "x", b"1" * 100)
        with pytest.raises(NoSpace):
            await put_object(ms, "bk", "y", b"2" * 20_000)
        sealed = await store.seal_bucket("bk")
        assert sealed.sealed
        with pytest.raises(ReadOnly):
            await put_object(ms, "bk", "z", b"3")
        await store.delete_bucket("bk")
        assert await store.list_buckets() == []
        with pytest.raises(NotFound):
            await store.bucket_status("bk")
        assert stream_name("bk") == "OBJ_bk"

    trio.run(main)


@pytest.mark.parametrize(("proto", "impl"), [(Streams, MemoryStreams), (Watch, "MemoryWatch")])
def test_implements_the_protocol_signatures(proto, impl):
    import natsfs.memstreams as mod

    cls = getattr(mod, impl) if isinstance(impl, str) else impl
    members = [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert members
    for name in members:
        want = list(inspect.signature(getattr(proto, name)).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        assert have == want, name
        assert inspect.iscoroutinefunction(getattr(cls, name)), name


def test_closed_watch_returns_empty_batches():
    async def body(ms):
        await ms.publish("s.a", b"1")
        w = await ms.watch("S", "s.>")
        await w.close()
        await ms.publish("s.a", b"2")
        b = await w.next_batch(timeout=0)
        assert b.msgs == []

    run(body)
