"""`Staging` finds staged files by path and by directory through its index, also after renames; the
spool hands out files created ahead and removes those left unused."""

from __future__ import annotations

import os
from pathlib import Path

from natsfs.adr20 import PosixAttrs
from natsfs.staging import Spool, StagedFile, Staging


def staged(spool: Spool, ino: int, path: tuple[str, ...]) -> StagedFile:
    return StagedFile(spool, ino=ino, path=path, bucket=path[0], name="/".join(path[1:]), base=None,
                      attrs=PosixAttrs(), new=True)


def test_lookups_by_path_and_directory_follow_adds_moves_and_removes(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    staging = Staging(spool)
    a, b, c = staged(spool, 2, ("b", "d", "a")), staged(spool, 3, ("b", "d", "b")), staged(spool, 4, ("b", "c"))
    for sf in (a, b, c):
        staging.add(sf)
    assert staging.at_path(("b", "d", "a")) is a and staging.at_path(("b", "x")) is None
    assert {sf.ino for sf in staging.children(("b", "d"))} == {2, 3}
    assert [sf.ino for sf in staging.children(("b",))] == [4]

    staging.move(a, ("b", "e", "a2"), "e/a2", None)
    assert (a.path, a.name) == (("b", "e", "a2"), "e/a2")
    assert staging.at_path(("b", "d", "a")) is None and staging.at_path(("b", "e", "a2")) is a
    assert [sf.ino for sf in staging.children(("b", "d"))] == [3]
    assert [sf.ino for sf in staging.children(("b", "e"))] == [2]

    b.unlink()  # replaced while open: no longer shown at its path, still staged by inode
    assert staging.at_path(("b", "d", "b")) is None and staging.children(("b", "d")) == []
    assert staging.get(3) is b

    newer = staged(spool, 3, ("b", "d", "b"))  # the same inode staged again (a new version)
    staging.add(newer)
    assert staging.at_path(("b", "d", "b")) is newer and staging.get(3) is newer
    staging.remove(b)  # the old one is no longer the inode's: nothing changes
    assert staging.get(3) is newer and staging.children(("b", "d")) == [newer]

    for sf in (a, newer, c):
        staging.remove(sf)
    assert len(staging) == 0
    assert staging.at_path(("b", "e", "a2")) is None and staging.children(("b",)) == []


def test_spool_files_created_ahead_are_used_first_and_the_unused_removed(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    spool.add_ready(spool.create_ahead(3))
    made = sorted(p.name for p in spool.dir.iterdir())
    assert spool.ready == 3 and len(made) == 3
    sf = staged(spool, 2, ("b", "f"))
    assert sf.spool_path.name in made and spool.ready == 2
    spool.drop_ready()
    assert spool.ready == 0 and [p.name for p in spool.dir.iterdir()] == [sf.spool_path.name]
    fd, path = spool.create()  # none ready: made on the spot
    assert path.is_file() and path.name not in made
    os.close(fd)
