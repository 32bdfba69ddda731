"""handles: FileHandle readahead planning, DirHandle snapshots, handle numbers.

(The digest check that used to live in handles.Verifier is now done per version by the chunk cache;
its tests are in test_chunk_cache.py.)
"""

from __future__ import annotations

from natsfs.adr20 import ObjectInfo, digest_of
from natsfs.handles import DirHandle, FileHandle, HandleTable


def info() -> ObjectInfo:
    return ObjectInfo(bucket="b", name="f.bin", nuid="n", size=10 << 20, chunks=80, digest=digest_of(b""),
                      mtime_ns=1, revision=1)


def test_readahead_grows_while_sequential_and_collapses_on_seek():
    h = FileHandle(ino=5, info=info())
    size = 128 * 1024
    lo, hi = 1 << 20, 8 << 20
    assert h.plan_readahead(0, size, lo, hi) == lo
    assert h.plan_readahead(size, size, lo, hi) == 2 * lo
    assert h.plan_readahead(2 * size, size, lo, hi) == 4 * lo
    assert h.plan_readahead(3 * size, size, lo, hi) == hi
    assert h.plan_readahead(4 * size, size, lo, hi) == hi
    assert h.plan_readahead(1 << 30, size, lo, hi) == 0  # a seek far ahead
    assert h.plan_readahead((1 << 30) + size, size, lo, hi) == lo  # sequential again: starts small


def test_small_jitter_keeps_readahead_but_a_seek_back_drops_it():
    h = FileHandle(ino=5, info=info())
    size = 4096
    base = 100 * size
    h.readahead, h.next_offset = 0, base
    h.plan_readahead(base, size, 1000, 8000)
    h.plan_readahead(base + size, size, 1000, 8000)
    assert h.readahead == 2000
    assert h.plan_readahead(base + 3 * size, size, 1000, 8000) == 2000  # a little out of order: unchanged
    assert h.plan_readahead(0, size, 1000, 8000) == 0  # far behind


def test_a_page_read_again_far_behind_within_the_window_neither_collapses_nor_moves_the_reader():
    """The kernel reads a single page again, megabytes behind, when it dropped it from its page cache
    before the reader got there: the reader is still sequential."""
    h = FileHandle(ino=5, info=info())
    size = 1 << 20
    lo, hi = 1 << 20, 32 << 20
    for k in range(8):
        h.plan_readahead(k * size, size, lo, hi)
    assert h.readahead == hi
    assert h.plan_readahead(5 * size, 4096, lo, hi) == hi  # a stray page, 3 MiB behind
    assert h.plan_readahead(8 * size, size, lo, hi) == hi  # where the reader is: still sequential
    assert h.next_offset == 9 * size
    assert h.plan_readahead(100 * size, size, lo, hi) == 0  # a real seek, beyond the window


def test_handle_numbers_are_unique_and_not_reused():
    t = HandleTable()
    a = t.add(DirHandle(1, ()))
    b = t.add(FileHandle(2, info()))
    assert a != b and len(t) == 2
    assert isinstance(t.get(b), FileHandle) and isinstance(t.get(a), DirHandle)
    assert t.pop(a) is not None and t.pop(a) is None and t.get(a) is None
    c = t.add(DirHandle(1, ()))
    assert c not in (a, b) and len(t) == 2


def test_dir_handle_keeps_its_own_snapshot():
    entries = [("x", ("d", "x"), None)]
    h = DirHandle(7, ("d",), list(entries))
    entries.append(("y", ("d", "y"), None))
    assert [e[0] for e in h.entries] == ["x"]
    assert DirHandle(7, ("d",)).entries == []
