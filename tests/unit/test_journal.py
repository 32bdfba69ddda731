"""The write-back journal: framing, torn tails, compaction, replay order and merging of rewrites."""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import zlib
from pathlib import Path

import pytest

from natsfs.adr20 import ObjectInfo, PosixAttrs
from natsfs.journal import GROW_BYTES, WriteBackJournal, frame, read_records
from natsfs.staging import Spool, StagedFile, WriteState


def entry(entry_id: str, name: str, size: int = 0) -> dict[str, object]:
    return {"id": entry_id, "bucket": "b", "name": name, "size": size}


def test_frame_is_length_crc_payload() -> None:
    payload = b'{"id":"x"}'
    data = frame(payload)
    length, crc = struct.unpack(">II", data[:8])
    assert (length, crc, data[8:]) == (len(payload), zlib.crc32(payload), payload)
    assert read_records(data) == ([{"id": "x"}], len(data))


def test_records_survive_reopen_in_order(tmp_path: Path) -> None:
    j = WriteBackJournal(tmp_path / "wb.journal")
    j.record(entry("a", "one"))
    j.record(entry("b", "two"))
    j.record(entry("c", "three"))
    j.done("b")
    j.close()
    again = WriteBackJournal(tmp_path / "wb.journal")
    assert [r["name"] for r in again.pending.values()] == ["one", "three"]
    assert again.torn_at is None


def test_rewrite_of_a_pending_file_merges_and_moves_to_the_end(tmp_path: Path) -> None:
    j = WriteBackJournal(tmp_path / "wb.journal")
    j.record(entry("a", "one", 1))
    j.record(entry("b", "two", 2))
    j.record(entry("a", "one", 10))  # closed again: one pending upload, with the newer content
    j.close()
    again = WriteBackJournal(tmp_path / "wb.journal")
    assert [(r["id"], r["size"]) for r in again.pending.values()] == [("b", 2), ("a", 10)]


def test_torn_tail_skips_only_the_torn_record(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    for i in range(3):
        j.record(entry(f"id{i}", f"file{i}"))
    j.close()
    data = path.read_bytes()
    end = read_records(data)[1]
    last = len(frame(json.dumps({**entry("id2", "file2"), "op": "put"}, separators=(",", ":")).encode()))
    path.write_bytes(data[: end - last // 2])  # cut mid-record
    again = WriteBackJournal(path)
    assert [r["name"] for r in again.pending.values()] == ["file0", "file1"]
    assert again.torn_at == end - last
    # The torn bytes are gone: new records after it are readable by the next run.
    again.record(entry("id3", "file3"))
    again.close()
    assert [r["name"] for r in WriteBackJournal(path).pending.values()] == ["file0", "file1", "file3"]


def test_a_flipped_byte_fails_the_crc(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    j.record(entry("a", "one"))
    j.record(entry("b", "two"))
    j.close()
    data = bytearray(path.read_bytes())
    data[read_records(bytes(data))[1] - 3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert [r["name"] for r in WriteBackJournal(path).pending.values()] == ["one"]


def test_garbage_length_is_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    path.write_bytes(frame(b'{"id":"a","op":"put"}') + b"\xff\xff\xff\xff\x00\x00")
    j = WriteBackJournal(path)
    assert list(j.pending) == ["a"]
    assert j.torn_at is not None


def test_compaction_keeps_live_records_only(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    j.record(entry("keep", "kept"))
    for i in range(200):
        j.record(entry(f"t{i}", f"tmp{i}"))
        j.done(f"t{i}")
    size = read_records(path.read_bytes())[1]
    assert size < 40 * len(frame(json.dumps(entry("t0", "tmp0")).encode()))  # rewritten, not 401 records
    j.record(entry("last", "after"))
    j.close()
    assert [r["name"] for r in WriteBackJournal(path).pending.values()] == ["kept", "after"]


def test_done_of_an_unknown_id_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    j.done("nothing")
    j.close()
    assert path.read_bytes() == b""


def test_a_staged_file_resumes_from_its_journal_entry(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    base = ObjectInfo(bucket="b", name="d/f", nuid="N1", size=3, chunks=1, digest="SHA-256=x", mtime_ns=5,
                      revision=42, chunk_size=128)
    sf = StagedFile(spool, ino=7, path=("d", "f"), bucket="b", name="d/f", base=base,
                    attrs=PosixAttrs(0o640, 10, 20, 99))
    sf.skip_copy()
    os.pwrite(sf.fd, b"new bytes", 0)
    sf.size = 9
    sf.touch()
    sf.change_xattr("user.k", b"\x00v")
    sf.change_xattr("user.gone", None)
    j = WriteBackJournal(tmp_path / "wb.journal")
    j.record(sf.journal_entry())
    j.close()
    entry = next(iter(WriteBackJournal(tmp_path / "wb.journal").pending.values()))
    again = StagedFile.resume(Spool(tmp_path, 1 << 20), entry, ino=9, path=("d", "f"))
    assert again.state is WriteState.DIRTY and again.unstored and again.serves_reads
    assert (again.base, again.base_revision, again.size) == (base, 42, 9)
    assert (again.mode, again.uid, again.gid, again.mtime_ns) == (0o640, 10, 20, sf.mtime_ns)
    assert again.xattr_changes == [("user.k", b"\x00v"), ("user.gone", None)]
    assert os.pread(again.fd, 9, 0) == b"new bytes"
    assert again.spool_path == sf.spool_path


def test_records_written_together_share_one_sync_and_done_records_none(tmp_path: Path, monkeypatch) -> None:
    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    j = WriteBackJournal(tmp_path / "wb.journal")
    j.record_many([entry(f"e{i}", f"n{i}") for i in range(5)])
    assert len(syncs) == 1
    j.done("e0")
    j.done("e1", compact=False)
    assert len(syncs) == 1
    j.close()
    assert [r["name"] for r in WriteBackJournal(tmp_path / "wb.journal").pending.values()] == ["n2", "n3", "n4"]


def test_a_small_files_record_carries_its_bytes_and_resume_restores_them(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    sf = StagedFile(spool, ino=5, path=("b", "f"), bucket="b", name="f", base=None, attrs=PosixAttrs(), new=True)
    os.pwrite(sf.fd, b"closed bytes", 0)
    sf.size = 12
    j = WriteBackJournal(tmp_path / "wb.journal")
    j.record(sf.journal_entry(sf.read_all()))
    j.close()
    sf.spool_path.write_bytes(b"")  # the spool file was never synced: lost with the machine
    (rec,) = WriteBackJournal(tmp_path / "wb.journal").pending.values()
    again = StagedFile.resume(spool, rec, ino=5, path=("b", "f"))
    assert (again.size, again.read_all(), again.resumed) == (12, b"closed bytes", True)


def test_the_file_grows_ahead_in_zeros_and_a_record_torn_in_them_is_found(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    j.record(entry("a", "one"))
    j.record(entry("b", "two"))
    j.close()
    data = path.read_bytes()
    records, end = read_records(data)
    assert [r["id"] for r in records] == ["a", "b"]
    assert len(data) >= GROW_BYTES > end and data[end:] == bytes(len(data) - end)
    again = WriteBackJournal(path)  # zeros after the records are no torn tail
    assert (list(again.pending), again.torn_at) == (["a", "b"], None)
    again.record(entry("c", "three"))  # written over the zeros, in place
    again.close()
    assert path.stat().st_size == len(data)
    data = path.read_bytes()
    end = read_records(data)[1]
    # A crash in the middle of writing the last record: its tail never reached the disk (still zeros).
    path.write_bytes(data[: end - 5] + bytes(len(data) - end + 5))
    torn = WriteBackJournal(path)
    assert list(torn.pending) == ["a", "b"] and torn.torn_at is not None


def test_a_record_written_without_compaction_leaves_it_to_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    for i in range(100):
        j.record_many([entry(f"t{i}", f"tmp{i}")], compact=False)
        j.done(f"t{i}", compact=False)
    j.record_many([entry("live", "kept")], compact=False)
    assert j.wants_compaction
    assert len(read_records(path.read_bytes())[0]) == 201  # nothing rewritten yet
    j.compact()
    assert not j.wants_compaction
    assert [r["id"] for r in read_records(path.read_bytes())[0]] == ["live"]
    j.close()
    assert list(WriteBackJournal(path).pending) == ["live"]


def test_commit_closes_records_in_order_with_one_write_and_leaves_out_dones_of_nothing(tmp_path: Path) -> None:
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    j.record(entry("a", "f"))
    # A pending file replaced by a rename: its record closed before the replacing file's, in one commit.
    j.commit([{"op": "done", "id": "a"}, {"op": "put", **entry("b", "f")}])
    before = read_records(path.read_bytes())[0]
    j.commit([{"op": "done", "id": "a"}, {"op": "done", "id": "never"}])  # nothing live: nothing written
    assert read_records(path.read_bytes())[0] == before
    j.commit([{"op": "put", **entry("c", "g")}, {"op": "done", "id": "c"}])  # (a put closed later in one batch)
    j.close()
    assert [(r["op"], r["id"]) for r in read_records(path.read_bytes())[0]] == [
        ("put", "a"), ("done", "a"), ("put", "b"), ("put", "c"), ("done", "c")]
    assert list(WriteBackJournal(path).pending) == ["b"]


def test_a_compaction_the_disk_has_no_room_for_fails_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A local disk full to the last page still takes records (they go into the zeros grown ahead), but
    not the copy a compaction writes: the records written are durable all the same, so the record (a
    close) must not fail, and nothing of the copy may stay behind. Seen on a full tmpfs cache dir: every
    close of a rewritten pending file returned ENOSPC, and the last one was uploaded after a crash."""
    path = tmp_path / "wb.journal"
    j = WriteBackJournal(path)
    j.record(entry("live", "kept"))
    real_write = os.write
    disk_full = True

    def write(fd: int, data: bytes) -> int:
        if disk_full and os.readlink(f"/proc/self/fd/{fd}").endswith(".compact"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with caplog.at_level(logging.INFO, logger="natsfs.journal"):
        for i in range(150):  # compaction is due (and fails) many times over
            j.record(entry(f"t{i}", f"tmp{i}"))
            j.done(f"t{i}")
        j.record(entry("last", "after"))
        assert not path.with_suffix(".compact").exists()
        assert len(read_records(path.read_bytes())[0]) == 302  # nothing rewritten, nothing lost
        assert [r.getMessage() for r in caplog.records if "not compacted" in r.getMessage()] == [
            f"write-back journal {path}: not compacted (No space left on device); records go on into it as it "
            "is, the compaction is tried again later"]
        disk_full = False  # room again: the next compaction due succeeds
        for i in range(70):
            j.record(entry(f"u{i}", f"more{i}"))
            j.done(f"u{i}")
    records = read_records(path.read_bytes())[0]
    assert [r["id"] for r in records[:2]] == ["live", "last"] and not any(r["id"].startswith("t") for r in records)
    assert any(r.getMessage() == f"write-back journal {path}: compacted" for r in caplog.records)
    j.close()
    assert [r["name"] for r in WriteBackJournal(path).pending.values()] == ["kept", "after"]
