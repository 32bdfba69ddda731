"""core.openfiles: one record per inode (opens, writers, unlinked while open, own uploads, cached version)."""

from __future__ import annotations

from natsfs.core.openfiles import OpenFileTable
from natsfs.inodes import InodeNo

A, B = InodeNo(2), InodeNo(3)


def test_opens_and_writers_are_counted_per_inode():
    t = OpenFileTable()
    t.opened(A, writing=True)
    t.opened(A, writing=False)
    t.opened(B, writing=False)
    assert t.is_open(A) and t.has_writers(A) and t.is_open(B) and not t.has_writers(B)
    assert t.released(A, writing=True) is None  # a reader is still open
    assert t.is_open(A) and not t.has_writers(A)
    last = t.released(A, writing=False)
    assert last is not None and not last.unlinked and last.purge_later is None
    assert not t.is_open(A) and t.get(A) is None  # nothing left to say: no record
    assert t.is_open(B)


def test_unlinked_while_open_ends_at_the_last_close_with_its_purge():
    t = OpenFileTable()
    t.opened(A, writing=False)
    t.opened(A, writing=False)
    t.unlinked_while_open(A, ("b", "nuid1"))
    assert t.is_unlinked(A)
    assert t.released(A, writing=False) is None and t.is_unlinked(A)
    last = t.released(A, writing=False)
    assert last is not None and last.unlinked and last.purge_later == ("b", "nuid1")
    assert not t.is_unlinked(A) and t.get(A) is None


def test_own_uploads_of_two_files_never_clear_each_other():
    t = OpenFileTable()
    with t.own_upload(A):
        with t.own_upload(B):
            assert t.uploading(A) and t.uploading(B)
        assert t.uploading(A) and not t.uploading(B)  # B's end leaves A marked
    assert not t.uploading(A)
    with t.own_upload(A), t.own_upload(A):  # two flushes of one file: marked until both end
        pass
    assert not t.uploading(A) and len(t) == 0


def test_cached_version_outlives_the_handles_until_forgotten():
    t = OpenFileTable()
    t.opened(A, writing=False)
    t.set_cached_version(A, "n1")
    t.released(A, writing=False)
    assert t.cached_version(A) == "n1"  # the next open may keep the kernel's pages
    t.forget_cached_version(A)
    assert t.cached_version(A) is None and t.get(A) is None


def test_paths_being_changed_cover_everything_under_them():
    t = OpenFileTable()
    with t.changing(("b", "d")):
        assert t.is_own(("b", "d")) and t.is_own(("b", "d", "f")) and not t.is_own(("b", "e"))
    assert not t.is_own(("b", "d"))
