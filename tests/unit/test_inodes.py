"""inodes.InodeTable: lookup counts, forget, numbers never reused, moves."""

from __future__ import annotations

import pytest

from natsfs.errors import Stale
from natsfs.inodes import ROOT_INODE, InodeTable


def test_root_is_known_and_never_forgotten():
    t = InodeTable()
    assert t.path_of(ROOT_INODE) == ()
    assert t.known(()) == ROOT_INODE
    t.lookup(())
    t.forget(ROOT_INODE, 5)
    assert t.path_of(ROOT_INODE) == ()
    assert t.lookup_count(ROOT_INODE) == 0


def test_lookup_counts_and_forget():
    t = InodeTable()
    a = t.lookup(("a",))
    assert t.lookup(("a",)) == a
    assert t.lookup_count(a) == 2
    t.forget(a, 1)
    assert t.path_of(a) == ("a",) and t.lookup_count(a) == 1
    t.forget(a, 1)
    assert t.lookup_count(a) == 0
    with pytest.raises(Stale):
        t.path_of(a)
    assert t.known(("a",)) is None


def test_forget_more_than_looked_up_drops_without_error():
    t = InodeTable()
    a = t.lookup(("a",))
    t.forget(a, 10)
    assert t.known(("a",)) is None


def test_forget_of_unknown_inode_is_harmless():
    t = InodeTable()
    t.forget(12345, 1)
    t.forget(12345, 0)
    assert len(t) == 1


def test_numbers_are_never_reused():
    t = InodeTable()
    seen = set()
    for _ in range(5):
        ino = t.lookup(("x",))
        assert ino not in seen
        seen.add(ino)
        t.forget(ino, 1)
    other = t.lookup(("y",))
    assert other not in seen and other != ROOT_INODE


def test_ino_for_does_not_count_a_lookup():
    t = InodeTable()
    ino = t.ino_for(("p",))
    assert t.lookup_count(ino) == 0
    assert t.ino_for(("p",)) == ino
    assert t.lookup(("p",)) == ino and t.lookup_count(ino) == 1


def test_move_keeps_numbers_for_the_subtree():
    t = InodeTable()
    d = t.lookup(("d",))
    f = t.lookup(("d", "f"))
    deep = t.lookup(("d", "s", "g"))
    other = t.lookup(("dd",))
    t.move(("d",), ("e",))
    assert t.path_of(d) == ("e",)
    assert t.path_of(f) == ("e", "f")
    assert t.path_of(deep) == ("e", "s", "g")
    assert t.path_of(other) == ("dd",)  # a sibling sharing a prefix of the name is untouched
    assert t.known(("d",)) is None and t.known(("e", "f")) == f
    assert t.lookup_count(f) == 1


def test_move_over_an_existing_path_detaches_it():
    t = InodeTable()
    src = t.lookup(("src",))
    dst = t.lookup(("dst",))
    below = t.lookup(("dst", "x"))
    t.move(("src",), ("dst",))
    assert t.known(("dst",)) == src
    assert t.known(("dst", "x")) is None
    # The displaced inodes are still valid numbers until forgotten, but map no reachable path.
    assert t.path_of(dst)[0].startswith("\x00")
    assert t.path_of(below)[0].startswith("\x00")
    t.forget(dst, 1)
    t.forget(below, 1)
    with pytest.raises(Stale):
        t.path_of(dst)
    assert t.known(("dst",)) == src


def test_detach():
    t = InodeTable()
    a = t.lookup(("a",))
    assert t.detach(("a",)) == a  # the caller drops the inode's cached version (core.openfiles)
    assert t.known(("a",)) is None
    assert a in t and t.is_detached(a)
    assert t.detach(("a",)) is None
    new = t.lookup(("a",))
    assert new != a
    t.forget(a, 1)
    assert t.path_of(new) == ("a",)


def test_forget_says_when_the_inode_is_gone():
    t = InodeTable()
    a = t.lookup(("a",))
    t.lookup(("a",))
    assert t.forget(a, 1) is False and a in t
    assert t.forget(a, 1) is True  # the caller then drops its cached version (core.openfiles)
    assert a not in t
