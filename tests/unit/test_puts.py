"""The put journal, tombstones sharing a live nuid in the index, and the ADR-20 layer's settled publishes
and bounded purges, over MemoryStreams."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest
import trio
from gowriters import put_object

from natsfs.adr20 import BytesSource, ObjectInfo, ObjectStore, chunk_subject, format_digest, meta_subject, stream_name
from natsfs.errors import BadName, Conflict, NameTooLong, NoSpace, OutcomeUnknown, TooBig, Unavailable
from natsfs.index import BucketIndex
from natsfs.memstreams import MemoryStreams
from natsfs.staging import PutJournal
from natsfs.streams import EXPECTED_LAST_MSG_ID, MSG_ID


def info(name: str, nuid: str, revision: int, *, deleted: bool = False) -> ObjectInfo:
    return ObjectInfo(bucket="b", name=name, nuid=nuid, size=0 if deleted else 5, chunks=0 if deleted else 1,
                      digest="", mtime_ns=0, revision=revision, deleted=deleted)


# ---------------------------------------------------------------- journal
def test_journal_keeps_open_records_across_runs_and_ignores_a_torn_line(tmp_path):
    path = tmp_path / "puts.journal"
    j = PutJournal(path)
    j.started("b", "N1", "done")
    j.started("b", "N2", "half")
    j.started("c", "N3", "x")
    j.finished("b", "N1")
    j.failed("c", "N3", "x", meta_unknown=True, purged=False)
    j.close()
    with open(path, "a") as f:
        f.write('{"op": "+", "b": "b", "n"')  # a killed daemon's last, torn line
    again = PutJournal(path)
    assert set(again.pending) == {("b", "N2"), ("c", "N3")}
    assert all(p.meta_unknown for p in again.pending.values())
    assert again.pending[("b", "N2")].name == "half"
    # Reopening compacted the file to its open records.
    assert len(path.read_text().splitlines()) == 2
    again.finished("b", "N2")
    again.finished("c", "N3")
    again.close()
    assert PutJournal(path).pending == {}


def test_journal_writes_a_closing_line_with_the_next_record(tmp_path, monkeypatch):
    import natsfs.staging as staging_module

    writes: list[bytes] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    j = PutJournal(tmp_path / "puts.journal")
    monkeypatch.setattr(staging_module.os, "write", counting_write)
    j.started("b", "N1", "one")
    j.finished("b", "N1")  # held back ...
    assert len(writes) == 1
    j.started("b", "N2", "two")  # ... and written with the next record: one write for both
    assert len(writes) == 2 and writes[1].count(b"\n") == 2
    j.finished("b", "N2")

    def open_in_file() -> set[str]:  # (what a run after a killed daemon would find open)
        opened: set[str] = set()
        for line in (tmp_path / "puts.journal").read_text().splitlines():
            rec = json.loads(line)
            (opened.add if rec["op"] == "+" else opened.discard)(rec["n"])
        return opened

    # A killed daemon loses the held-back line: the next run only checks that put again.
    assert open_in_file() == {"N2"}
    j.flush()  # (unmounting)
    assert open_in_file() == set()
    for i in range(staging_module._CLOSES_HELD):
        j.started("b", f"M{i}", "m")
    before = len(writes)
    for i in range(staging_module._CLOSES_HELD):
        j.finished("b", f"M{i}")
    assert len(writes) == before + 1  # never more than _CLOSES_HELD wait
    assert open_in_file() == set()


def test_journal_compacts_while_running(tmp_path, monkeypatch):
    import natsfs.staging as staging

    monkeypatch.setattr(staging, "_JOURNAL_COMPACT", 10)
    path = tmp_path / "puts.journal"
    j = PutJournal(path)
    for i in range(25):
        j.started("b", f"N{i}", "f")
        j.finished("b", f"N{i}")
    j.started("b", "open", "f")
    assert len(path.read_text().splitlines()) < 10
    j.close()
    assert set(PutJournal(path).pending) == {("b", "open")}


# ---------------------------------------------------------------- index
@pytest.mark.parametrize("tombstone_first", [False, True])
def test_index_notices_a_tombstone_carrying_a_live_nuid(tombstone_first):
    idx = BucketIndex("b")
    idx.apply(info("a", "N", 1))
    steps = [info("a", "N", 3, deleted=True), info("moved", "N", 2)]
    for step in (steps if tombstone_first else steps[::-1]):
        idx.apply(step)
    assert idx.shared_tombstones == {"a": (3, "N")}
    idx.drop_tombstone("a", 3)
    assert idx.shared_tombstones == {} and "a" not in idx.tombstones


def test_index_ignores_ordinary_tombstones():
    idx = BucketIndex("b")
    idx.apply(info("a", "N", 1))
    idx.apply(info("a", "N", 2, deleted=True))
    idx.apply(info("c", "M", 3))
    assert idx.shared_tombstones == {}
    idx.apply(info("a", "P", 4))  # the name is used again
    idx.apply(info("d", "N", 5))  # a later object with the deleted nuid: the tombstone is gone already
    assert idx.shared_tombstones == {}


# ---------------------------------------------------------------- ADR-20 layer
def run(body) -> None:
    async def main() -> None:
        ms = MemoryStreams()
        store = ObjectStore(ms, chunk_size=4, settle_timeout=0.5)
        await store.create_bucket("b")
        await body(ms, store)

    trio.run(main)


def test_put_messages_carry_their_ids_and_a_lost_meta_ack_is_success():
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        ms.lose_next_ack(subject="$O.b.M.>")
        got = await store.put("b", "f", BytesSource(b"0123456789"), expected_revision=0)
        msgs = ms.messages(stream_name("b"))
        assert [m.headers[MSG_ID] for m in msgs] == [f"{got.nuid}.0", f"{got.nuid}.1", f"{got.nuid}.2",
                                                     f"{got.nuid}.meta"]
        assert got.revision == msgs[-1].seq

    run(body)


def test_a_conflict_after_an_unanswered_attempt_is_settled_by_reading_back():
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        # Stored, ack lost, the read-back fails (server away); the retry with the same id meets the
        # expected-sequence check first (as nats-server does): Conflict, then the read-back says ours.
        ms.lose_next_ack(subject="$O.b.M.>")
        ms.fail_next("last_msg", Unavailable("away"))
        got = await store.put("b", "f", BytesSource(b"abc"), expected_revision=0)
        assert (await store.get_info("b", "f")).nuid == got.nuid
        # Another client's change is still a conflict.
        await put_object(ms, "b", "g", b"theirs")
        with pytest.raises(Conflict):
            await store.put("b", "g", BytesSource(b"mine"), expected_revision=0)
        assert ms.subjects(stream_name("b")).get(chunk_subject("b", got.nuid)) == 1

    run(body)


def test_no_answer_at_all_is_outcome_unknown_and_the_chunks_stay():
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        ms.fail_next("publish", OutcomeUnknown("away"), subject="$O.b.M.>", times=100)
        ms.fail_next("last_msg", Unavailable("away"), times=100)
        with pytest.raises(OutcomeUnknown):
            await store.put("b", "f", BytesSource(b"abcdef"), expected_revision=0)
        assert sum(n for s, n in ms.subjects(stream_name("b")).items() if ".C." in s) == 2

    run(body)


def test_rename_claims_the_old_name_with_a_tombstone_that_carries_no_live_nuid():
    """The old name gets a tombstone that expected the revision read (its claim), on a fresh nuid: nats.go's
    Delete of the old name then purges nothing of the renamed object."""
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        a = await put_object(ms, "b", "a", b"data")
        new, claim = await store.rename("b", "a", "z", expected_revision=a.revision)
        assert new.nuid == a.nuid and claim.revision > new.revision
        assert claim.deleted and claim.nuid not in ("", a.nuid)
        gone = await store.get_info("b", "a")
        assert gone is not None and gone.deleted and gone.revision == claim.revision
        assert await store.chunk_index("b", claim.nuid) == []
        assert len(await store.chunk_index("b", a.nuid)) == 1
        # A bounded purge leaves a newer meta alone.
        later = await put_object(ms, "b", "a", b"again")
        await store.purge_tombstone("b", "a", claim.revision)
        assert (await store.get_info("b", "a")).nuid == later.nuid

    run(body)


def test_names_are_checked_before_anything_is_sent():
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        before = ms.calls.copy()
        with pytest.raises(BadName):
            await store.put("b", "bad\udcff", BytesSource(b"x"))
        with pytest.raises(NameTooLong):
            await store.put("b", "n" * 3000, BytesSource(b"x"))
        assert ms.calls == before
        ms.max_payload = 1000
        with pytest.raises(TooBig):
            await store.update_meta("b", (await put_object(ms, "b", "m", b"x")).name,
                                    lambda doc: doc.update(description="d" * 900))
        assert json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", "m"))).data).get("description") is None

    run(body)


def test_a_subject_limit_learned_from_the_server_refuses_longer_names_before_anything_is_sent():
    """A server whose max_control_line is under the default dropped the connection for a subject of 600
    bytes (`Bridge.subject_limit`): names whose subjects reach that are refused as over the default are."""
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        name = "n" * 400  # its subjects: about 570 bytes, well within the default 3840
        await store.put("b", name, BytesSource(b"x"))
        ms.subject_limit = 560
        before = ms.calls.copy()
        with pytest.raises(NameTooLong) as e:
            await store.put("b", "m" * 400, BytesSource(b"x"))
        assert "over the limit of 560" in str(e.value)
        assert ms.calls == before
        await store.put("b", "m" * 300, BytesSource(b"x"))  # shorter names are sent as before

    run(body)


# ---------------------------------------------------------------- one-chunk puts in one round trip
async def _put_small_file(store: ObjectStore, tmp_path, name: str, data: bytes, **kw) -> ObjectInfo:  # type: ignore[no-untyped-def]
    path = tmp_path / f"spool-{name}"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return await store.put_file("b", name, str(path), fd, len(data), chunk_size=1024, **kw)
    finally:
        os.close(fd)


def _layout(ms: MemoryStreams) -> list[tuple[str, str]]:
    return [(m.subject, (m.headers or {}).get(MSG_ID, "")) for m in ms.messages(stream_name("b"))]


async def _stored(ms: MemoryStreams, store: ObjectStore, name: str) -> bytes:
    """The object's bytes from its chunks, checked against its meta (size, count, digest)."""
    info = await store.get_info("b", name)
    assert info is not None
    chunks = [m.data for m in ms.messages(stream_name("b")) if m.subject == chunk_subject("b", info.nuid)]
    data = b"".join(chunks)
    assert (len(chunks), len(data)) == (info.chunks, info.size)
    assert info.digest == format_digest(hashlib.sha256(data).digest())
    return data


def test_a_one_chunk_put_sends_its_meta_with_its_chunk_expecting_it(tmp_path):
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        got = await _put_small_file(store, tmp_path, "f", b"small file", expected_revision=0)
        assert ms.calls["publish_each"] == 1 and ms.calls["publish"] == ms.calls["publish_many"] == 0
        msgs = ms.messages(stream_name("b"))
        assert [m.subject for m in msgs] == [chunk_subject("b", got.nuid), meta_subject("b", "f")]
        assert msgs[1].headers[EXPECTED_LAST_MSG_ID] == msgs[0].headers[MSG_ID] == f"{got.nuid}.0"
        assert await _stored(ms, store, "f") == b"small file"

    run(body)


def test_another_message_between_chunk_and_meta_refuses_the_meta_which_follows_plainly(tmp_path):
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        real = ms._publish

        def foreign_first(subject, data, headers):  # type: ignore[no-untyped-def]
            if headers and EXPECTED_LAST_MSG_ID in headers:  # another client's publish lands in between
                real("$O.b.C.someone-else", b"theirs", {MSG_ID: "x.0"})
            return real(subject, data, headers)

        ms._publish = foreign_first  # type: ignore[method-assign]
        got = await _put_small_file(store, tmp_path, "f", b"mine", expected_revision=0)
        ms._publish = real  # type: ignore[method-assign]
        assert ms.calls["publish_each"] == 1 and ms.calls["publish"] == 1
        subjects = [s for s, _ in _layout(ms)]
        assert subjects == [chunk_subject("b", got.nuid), "$O.b.C.someone-else", meta_subject("b", "f")]
        assert await _stored(ms, store, "f") == b"mine"

    run(body)


def test_a_refused_chunk_leaves_no_meta(tmp_path):
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        ms.fail_next("publish", NoSpace("full"), subject="$O.b.C.>")
        with pytest.raises(NoSpace):
            await _put_small_file(store, tmp_path, "f", b"no room", expected_revision=0)
        assert _layout(ms) == []  # neither the chunk nor the meta that expected it
        assert (ms.calls["publish_each"], ms.calls["publish"], ms.calls["publish_many"]) == (1, 0, 0)
        assert await store.get_info("b", "f") is None

    run(body)


def test_both_acks_lost_sends_the_chunk_again_and_reads_the_meta_back(tmp_path):
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        ms.lose_next_ack(times=2)  # both stored, neither acknowledged
        got = await _put_small_file(store, tmp_path, "f", b"twice asked", expected_revision=0)
        assert _layout(ms) == [(chunk_subject("b", got.nuid), f"{got.nuid}.0"),
                               (meta_subject("b", "f"), f"{got.nuid}.meta")]  # each stored once
        assert await _stored(ms, store, "f") == b"twice asked"
        # The chunk sent again (a duplicate), then the barrier (one refused publish) and the meta read
        # back: ours, not sent again.
        assert (ms.calls["publish_each"], ms.calls["publish_many"], ms.calls["publish"]) == (1, 1, 1)
        assert ms.calls["last_msg"] >= 1

    run(body)


def test_a_chunk_lost_on_the_way_is_sent_again_before_any_meta(tmp_path):
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        ms.fail_next("publish", OutcomeUnknown("cut off"), subject="$O.b.C.>")  # not stored, no ack
        got = await _put_small_file(store, tmp_path, "f", b"late chunk", expected_revision=0)
        assert _layout(ms) == [(chunk_subject("b", got.nuid), f"{got.nuid}.0"),
                               (meta_subject("b", "f"), f"{got.nuid}.meta")]
        assert await _stored(ms, store, "f") == b"late chunk"
        # The chunk sent again, the barrier before the read-back, the meta sent again on its own.
        assert (ms.calls["publish_each"], ms.calls["publish_many"], ms.calls["publish"]) == (1, 1, 2)

    run(body)


def test_no_server_at_all_leaves_the_meta_unknown_and_never_sends_it_alone(tmp_path):
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        ms.fail_next("publish", OutcomeUnknown("away"), times=1000)
        ms.fail_next("last_msg", Unavailable("away"), times=1000)
        with pytest.raises(Unavailable):
            await _put_small_file(store, tmp_path, "f", b"nowhere", expected_revision=0)
        assert _layout(ms) == []

    run(body)


def test_spool_journal_and_lost_found_are_private(tmp_path):
    """Their names are bucket and file names: only this user may list or read them."""
    from natsfs.staging import Spool

    root = tmp_path / "cache" / "mnt%2Fx"
    spool = Spool(root, limit=1 << 20)
    spool.journal.started("b", "nuid1", "secret-project/salaries.xlsx")
    kept = spool.keep_data(b"bytes", "b", "secret-project/salaries.xlsx")
    for d in (tmp_path / "cache", root, spool.dir, spool.lost_found, kept.parent):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert spool.journal.path.stat().st_mode & 0o777 == 0o600
    assert kept.stat().st_mode & 0o077 == 0


@pytest.mark.expect_log(r"cannot be moved to .*lost\+found/leftover \(No space left on device\)")
def test_leftovers_stay_in_the_spool_when_lost_found_cannot_be_made(tmp_path, monkeypatch, caplog):
    """A next mount on a disk still full starts: the leftovers stay where they are, one ERROR line."""
    from helpers import full_local_disk

    from natsfs.staging import Spool

    root = tmp_path / "cache" / "mnt"
    Spool(root, limit=1 << 20)
    (root / "spool" / "0123abcd").write_bytes(b"bytes of a daemon that died")
    free = full_local_disk(monkeypatch)
    assert Spool(root, limit=1 << 20).rescue_leftovers() == []
    assert (root / "spool" / "0123abcd").read_bytes() == b"bytes of a daemon that died"
    assert [r.levelname for r in caplog.records if r.name == "natsfs.staging"] == ["ERROR"]
    free()
    kept = Spool(root, limit=1 << 20).rescue_leftovers()
    assert [p.read_bytes() for p in kept] == [b"bytes of a daemon that died"]


def test_a_journal_that_cannot_be_rewritten_at_start_is_appended_to(tmp_path, monkeypatch, caplog):
    """A full disk at the next mount: the journal stays as it is, new records follow its torn line on
    lines of their own, and the mount starts (it failed with ENOSPC)."""
    path = tmp_path / "puts.journal"
    j = PutJournal(path)
    j.started("b", "N1", "half")
    j.close()
    with open(path, "a") as f:
        f.write('{"op": "+", "b": "b", "n"')  # a killed daemon's last, torn line

    def full(self: PutJournal) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PutJournal, "_rewrite", full)
    again = PutJournal(path)
    assert set(again.pending) == {("b", "N1")}
    again.started("b", "N2", "new")
    again.close()
    monkeypatch.undo()
    assert set(PutJournal(path).pending) == {("b", "N1"), ("b", "N2")}
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_a_tombstone_purge_never_reaches_another_object_of_a_stream_created_again():
    """The revision of a tombstone read from the old stream may name another client's live meta of the
    same name in the new one (sequences start over): that meta stays."""
    async def body(ms: MemoryStreams, store: ObjectStore) -> None:
        a = await put_object(ms, "b", "a", b"data")
        tomb = await store.delete("b", "a", expected_revision=a.revision)
        assert tomb is not None
        ms.recreate_stream(stream_name("b"))
        await put_object(ms, "b", "x", b"")  # (no chunk: one meta)
        theirs = await put_object(ms, "b", "a", b"theirs")
        assert theirs.revision == tomb.revision
        await store.purge_tombstone("b", "a", tomb.revision)
        assert (await store.get_info("b", "a")).nuid == theirs.nuid

    run(body)
