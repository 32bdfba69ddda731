"""staging.StagedFile: the write path as a state machine (legal moves, refused ones, what each state says)."""

from __future__ import annotations

import pytest
import trio

from natsfs.adr20 import ObjectInfo, PosixAttrs
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
                                            "kept"}
    assert WriteState("uploading") is WriteState.UPLOADING
