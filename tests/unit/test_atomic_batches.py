"""Atomic puts over MemoryStreams: one batch per object of up to 999 chunks in buckets that allow it,
all or nothing at the commit, the nats.go order elsewhere."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import trio
from gowriters import delete_object, put_object

from natsfs.adr20 import ATOMIC_MAX_CHUNKS, BytesSource, ObjectStore, chunk_subject, format_digest, stream_name
from natsfs.errors import Conflict, OutcomeUnknown, Unavailable
from natsfs.memstreams import MemoryStreams
from natsfs.streams import MSG_ID

CHUNK = 1024


def run(fn):
    async def main():
        ms = MemoryStreams()
        store = ObjectStore(ms, chunk_size=CHUNK)
        await store.create_bucket("b")
        await store.bucket_status("b")
        return await fn(ms, store)

    return trio.run(main)


def messages(ms: MemoryStreams) -> list:
    return ms.messages(stream_name("b"))


async def read(store: ObjectStore, name: str) -> bytes:
    info = await store.get_info("b", name)
    assert info is not None and not info.deleted
    msgs = await store.fetch_chunks("b", info.nuid, 0, info.chunks + 1, 1 << 30)
    data = b"".join(m.data for m in msgs)
    assert format_digest(hashlib.sha256(data).digest()) == info.digest
    return data


def test_a_put_that_fits_goes_as_one_batch_with_message_ids():
    async def body(ms, store):
        data = bytes(range(256)) * 20  # 5 chunks
        info = await store.put("b", "f", BytesSource(data))
        assert ms.calls["publish_batch"] == 1 and ms.calls["publish_many"] == 0
        assert await read(store, "f") == data
        ids = [m.headers[MSG_ID] for m in messages(ms)]
        assert ids == [f"{info.nuid}.{i}" for i in range(5)] + [f"{info.nuid}.meta"]

    run(body)


def test_a_bigger_object_and_a_bucket_without_the_flag_keep_the_ordered_put():
    async def body(ms, store):
        big = b"x" * (CHUNK * (ATOMIC_MAX_CHUNKS + 1))
        assert not store.batch_fits("b", len(big))
        await store.put("b", "big", BytesSource(big))
        assert ms.calls["publish_batch"] == 0 and await read(store, "big") == big
        await store.create_bucket("plain")
        await store.update_bucket("plain", lambda c: c.update(allow_atomic=False))
        assert not store.batch_fits("plain", 10)
        await store.put("plain", "p", BytesSource(b"abc"))
        assert ms.calls["publish_batch"] == 0

    run(body)


@pytest.mark.parametrize("cut_at", ["$O.b.C.>", "$O.b.M.>"])
def test_a_batch_cut_off_stores_nothing_and_the_old_version_stays(cut_at):
    async def body(ms, store):
        await store.put("b", "f", BytesSource(b"old" * 1000))
        before = len(messages(ms))
        ms.fail_next_publish(Unavailable("connection lost"), subject=cut_at)
        with pytest.raises(Unavailable):
            await store.put("b", "f", BytesSource(b"new" * 1000), expected_revision=before)
        assert len(messages(ms)) == before
        assert await read(store, "f") == b"old" * 1000

    run(body)


def test_a_refused_commit_drops_the_whole_batch():
    async def body(ms, store):
        await store.put("b", "f", BytesSource(b"v1"))
        before = messages(ms)
        with pytest.raises(Conflict):
            await store.put("b", "f", BytesSource(b"v2" * 2000), expected_revision=0)
        assert messages(ms) == before

    run(body)


def test_a_commit_without_ack_is_read_back_and_never_stored_twice():
    async def body(ms, store):
        ms.lose_next_ack(subject="$O.b.M.>")  # stored, ack lost: read back, ours
        await store.put("b", "f", BytesSource(b"z" * 3000))
        assert ms.calls["publish_batch"] == 1 and len(messages(ms)) == 4
        # The commit is lost before the server: not stored; the same batch is sent again.
        ms.fail_next_publish(OutcomeUnknown("connection lost"), subject="$O.b.M.>")
        info = await store.put("b", "g", BytesSource(b"y" * 3000))
        assert ms.calls["publish_batch"] == 3
        g = [m for m in messages(ms) if m.subject == chunk_subject("b", info.nuid)]
        assert [m.headers[MSG_ID] for m in g] == [f"{info.nuid}.{i}" for i in range(3)]
        assert await read(store, "g") == b"y" * 3000

    run(body)


def test_a_new_name_over_a_tombstone_is_put_in_one_batch_after_a_retry():
    async def body(ms, store):
        await put_object(ms, "b", "f", b"old")
        await delete_object(ms, "b", "f")  # another client's tombstone
        info = await store.put("b", "f", BytesSource(b"new" * 700), expected_revision=0, replace_tombstone=True)
        assert ms.calls["publish_batch"] == 2 and await read(store, "f") == b"new" * 700
        assert not [m for m in messages(ms) if m.subject.startswith("$O.b.C.") and info.nuid not in m.subject]

    run(body)


def test_a_new_name_over_its_own_tombstone_is_put_in_one_batch_at_once():
    async def body(ms, store):
        await put_object(ms, "b", "f", b"old")
        await store.delete("b", "f")  # this store remembers the tombstone it wrote
        await store.put("b", "f", BytesSource(b"new" * 700), expected_revision=0, replace_tombstone=True)
        assert ms.calls["publish_batch"] == 1 and await read(store, "f") == b"new" * 700

    run(body)


def test_a_stream_that_turned_the_flag_off_gets_the_ordered_put():
    async def body(ms, store):
        await ms.update_stream(dict((await ms.stream_info(stream_name("b"))).config, allow_atomic=False))
        assert store.batch_fits("b", 10)  # not known yet
        await store.put("b", "f", BytesSource(b"q" * 2500))
        assert await read(store, "f") == b"q" * 2500
        assert not store.batch_fits("b", 10)

    run(body)


def test_put_file_of_a_spool_file_is_one_batch_and_seal_keeps_the_flag(tmp_path):
    async def body(ms, store):
        path = tmp_path / "spool"
        data = bytes(range(256)) * 41
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            await store.put_file("b", "f", str(path), fd, len(data))
        finally:
            os.close(fd)
        assert ms.calls["publish_batch"] == 1 and await read(store, "f") == data
        await store.seal_bucket("b")
        assert (await ms.stream_info(stream_name("b"))).config["allow_atomic"] is True

    run(body)


def open_records(path) -> set[tuple[str, str]]:
    """The records a journal file leaves open (what the next mount would settle)."""
    records: set[tuple[str, str]] = set()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        (records.add if rec["op"] == "+" else records.discard)((rec["b"], rec["n"]))
    return records


@pytest.mark.parametrize("atomic", [True, False])
def test_the_replaced_version_is_journalled_until_its_chunks_are_purged(tmp_path, atomic):
    from natsfs.staging import PutJournal

    async def body(ms, store):
        if not atomic:
            await store.update_bucket("b", lambda c: c.update(allow_atomic=False))
        journal = PutJournal(tmp_path / "puts.journal")
        store.put_log = journal
        first = await store.put("b", "f", BytesSource(b"1" * 3000))
        seen: list[set[tuple[str, str]]] = []
        real_purge = store.purge_chunks

        async def purge(bucket: str, nuid: str) -> None:
            # A daemon killed here leaves the record: the next mount reads it back as pending.
            seen.append(open_records(tmp_path / "puts.journal"))
            await real_purge(bucket, nuid)

        store.purge_chunks = purge
        await store.put("b", "f", BytesSource(b"2" * 3000), expected_revision=first.revision, old_nuid=first.nuid)
        assert ("b", first.nuid) in seen[0]
        assert not journal.active and not journal.pending
        journal.flush()  # (closing lines wait for the next record, or the unmount)
        assert open_records(tmp_path / "puts.journal") == set()

    run(body)


def test_too_many_open_batches_fall_back_to_the_ordered_put():
    async def body(ms, store):
        ms.max_open_batches = 1
        ms.delay = 0.01  # batches overlap
        datas = {f"f{i}": bytes([i]) * 3000 for i in range(3)}
        async with trio.open_nursery() as nursery:
            for name, data in datas.items():
                nursery.start_soon(lambda n=name, d=data: store.put("b", n, BytesSource(d)))
        for name, data in datas.items():
            assert await read(store, name) == data
        assert ms.calls["publish_batch"] == 3 and ms.calls["publish_many"] >= 1
        assert store.batch_fits("b", 10)  # still atomic for the next put

    run(body)
