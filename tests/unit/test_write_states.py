"""staging.StagedFile: the write path as a state machine (legal moves, refused ones, what each state says)."""

from __future__ import annotations

import errno

import pytest
import trio
from helpers import full_local_disk

from natsfs.adr20 import ObjectInfo, PosixAttrs
from natsfs.errors import NotKept
from natsfs.staging import IllegalTransition, Spool, StagedFile, WriteState


def info(revision: int = 3, size: int = 5) -> ObjectInfo:
    return ObjectInfo(bucket="b", name="f", nuid="N1", size=size, chunks=1, digest="", mtime_ns=1, revision=revision)


def staged(tmp_path, *, base: ObjectInfo | None = None, new: bool = False, unlinked: bool = False) -> StagedFile:
    return StagedFile(Spool(tmp_path, 1 << 20), ino=2, path=("f",), bucket="b", name="f", base=base,
                      attrs=PosixAttrs(), new=new, unlinked=unlinked)


def test_a_new_file_is_dirty_and_stored_once_uploaded(tmp_path):
    async def main() -> None:
        sf = staged(tmp_path, new=True)
        assert sf.state is WriteState.DIRTY and sf.unstored and sf.shadows_index and sf.never_stored
        sf.change_xattr("user.k", b"v")
        sf.begin_upload()
        assert sf.state is WriteState.UPLOADING and sf.unstored  # a close meanwhile waits for it
        sf.stored(info(), xattrs_stored=1)
        assert sf.state is WriteState.STORED and not sf.unstored and not sf.shadows_index
        assert sf.base_revision == 3 and sf.xattr_changes == [] and not sf.never_stored
        await sf.write(0, b"more")
        assert sf.state is WriteState.DIRTY and sf.unstored
        sf.begin_upload()
        sf.upload_failed()  # error, conflict or cancelled: still unstored
        assert sf.state is WriteState.DIRTY
        sf.keep()
        assert sf.state is WriteState.KEPT and sf.ended and not sf.unstored

    trio.run(main)


def test_copy_on_write_then_unlinked_while_open(tmp_path):
    async def main() -> None:
        sf = staged(tmp_path, base=info(size=5))
        assert sf.state is WriteState.UNCHANGED and not sf.copied and not sf.serves_reads and not sf.unstored

        async def read(offset: int, size: int) -> bytes:
            return b"hello"[offset : offset + size]

        await sf.fill(read)
        assert sf.copied and sf.serves_reads and sf.state is WriteState.UNCHANGED
        await sf.write(5, b"!")
        assert sf.state is WriteState.DIRTY and await sf.read(0, 10) == b"hello!"
        sf.unlink()
        await sf.write(0, b"J")  # writes still land (its handles read them) but are never stored
        assert sf.state is WriteState.UNLINKED and sf.shown and not sf.shadows_index and not sf.unstored
        with pytest.raises(IllegalTransition):
            sf.begin_upload()
        sf.discard()
        assert sf.state is WriteState.DISCARDED and sf.ended
        sf.discard()  # a second discard changes nothing

    trio.run(main)


def test_unstored_bytes_are_never_discarded(tmp_path):
    sf = staged(tmp_path, new=True)
    with pytest.raises(IllegalTransition):
        sf.discard()
    assert sf.state is WriteState.DIRTY and sf.spool_path.exists()
    sf.begin_upload()
    with pytest.raises(IllegalTransition):
        sf.touch()  # content never changes while an upload holds the lock
    sf.unlink()  # unlinked during its upload: the upload's outcome leaves it unlinked
    sf.stored(info(), xattrs_stored=0)
    assert sf.state is WriteState.UNLINKED and sf.base_revision == 3


def test_states_are_plain_strings_for_a_journal():
    assert {s.value for s in WriteState} == {"unchanged", "dirty", "uploading", "stored", "unlinked", "discarded",
                                            "kept", "unkept"}
    assert WriteState("uploading") is WriteState.UPLOADING


@pytest.mark.parametrize("in_memory", [True, False])
def test_bytes_lost_found_cannot_take_stay_staged_until_a_retry_keeps_them(tmp_path, monkeypatch, in_memory):
    async def main() -> None:
        spool = Spool(tmp_path, 1 << 20)
        sf = StagedFile(spool, ino=2, path=("f",), bucket="b", name="f", base=None, attrs=PosixAttrs(), new=True,
                        memory_limit=64 * 1024 if in_memory else 0)
        data = bytes(range(256)) * 200  # 51,200 bytes: more than the one page a full disk takes
        await sf.write(0, data)
        assert sf.in_memory is in_memory
        used, memory_used = spool.used, spool.memory_used
        if in_memory:
            (spool.lost_found / "b").mkdir(parents=True)  # so the copy starts, and is cut short
        free = full_local_disk(monkeypatch)
        for _ in range(2):  # the first try, and a retry while the disk is still full
            with pytest.raises(NotKept) as e:
                sf.keep()
            assert e.value.errno == errno.ENOSPC and "b/f" in str(e.value)
            assert sf.state is WriteState.UNKEPT and sf.unkept and not sf.ended and not sf.unstored
            # Nothing that looks kept, the bytes where they were, still counted against the budgets.
            assert [p for p in spool.lost_found.rglob("*") if p.is_file()] == []
            assert sf.read_all() == data and (spool.used, spool.memory_used) == (used, memory_used)
            with pytest.raises(IllegalTransition):
                sf.discard()  # held bytes are never dropped
        free()
        kept = sf.keep()
        assert sf.state is WriteState.KEPT and kept.read_bytes() == data
        assert [p for p in spool.lost_found.rglob("*") if p.is_file()] == [kept]
        assert (spool.used, spool.memory_used) == (0, 0) and list(spool.dir.iterdir()) == []

    trio.run(main)
