"""index.BucketIndex: placement, escaping, collisions, markers, overwrite/delete/remove, change paths."""

from __future__ import annotations

import itertools

from natsfs.adr20 import Link, ObjectInfo
from natsfs.index import BucketIndex, Dir

_rev = itertools.count(1)


def obj(name: str, size: int = 5, *, deleted: bool = False, rev: int | None = None, link: Link | None = None,
        nuid: str | None = None) -> ObjectInfo:
    r = next(_rev) if rev is None else rev
    return ObjectInfo(bucket="b", name=name, nuid=nuid or f"n{r}", size=0 if deleted else size,
                      chunks=0 if deleted or size == 0 else 1, digest="", mtime_ns=1000 + r, revision=r, link=link,
                      deleted=deleted)


def tree(d: Dir) -> dict:
    """The tree as nested dicts: directory -> dict, file -> object name."""
    return {k: tree(v) if isinstance(v, Dir) else v.name for k, v in d.children.items()}


def make(*infos: ObjectInfo) -> tuple[BucketIndex, list[tuple[str, ...]]]:
    idx = BucketIndex("b")
    changes: list[tuple[str, ...]] = []
    idx.on_change = changes.append
    for i in infos:
        idx.apply(i)
    return idx, changes


def test_paths_and_directories_from_slashes():
    idx, _ = make(obj("a/b/c.txt"), obj("a/d.txt"), obj("top.txt"))
    assert tree(idx.root) == {"a": {"b": {"c.txt": "a/b/c.txt"}, "d.txt": "a/d.txt"}, "top.txt": "top.txt"}
    assert isinstance(idx.get(("a", "b")), Dir)
    assert idx.get(("a", "b", "c.txt")).name == "a/b/c.txt"
    assert idx.get(("a", "x")) is None
    assert idx.get(("top.txt", "below")) is None
    assert idx.get(()) is idx.root
    assert len(idx) == 3
    assert sorted(i.name for i in idx.walk_files()) == ["a/b/c.txt", "a/d.txt", "top.txt"]


def test_new_directory_gets_the_mtime_of_the_object_that_made_it():
    idx, _ = make(obj("d/x", rev=500))
    assert idx.get(("d",)).mtime_ns == 1500


def test_a_markers_own_time_wins_over_its_entries_even_when_older():
    """`touch -d 2010 d` on a directory made by its first entry: the marker's natsfs.mtime_ns shows,
    here and after a remount; a marker without one shows the newer of its meta's and the entry's time."""
    import dataclasses

    from natsfs.adr20 import PosixAttrs

    explicit = dataclasses.replace(obj("d/", size=0, rev=10), mtime_ns=7, attrs=PosixAttrs(None, None, None, 7))
    idx, _ = make(obj("d/x", rev=500), explicit)
    assert idx.get(("d",)).mtime_ns == 7
    idx, _ = make(obj("d/x", rev=500), obj("e/y", rev=600), obj("d/", size=0, rev=20))
    assert idx.get(("d",)).mtime_ns == 1500


def test_hostile_names_are_escaped_flat_at_the_top():
    names = ["../escape.txt", "/abs/path.txt", "a//double.txt", ".", "..", "d/./e.txt", "dir-marker/"]
    idx, _ = make(*(obj(n) for n in names))
    assert tree(idx.root) == {"..%2Fescape.txt": "../escape.txt", "%2Fabs%2Fpath.txt": "/abs/path.txt",
                              "a%2F%2Fdouble.txt": "a//double.txt", "%2E": ".", "%2E%2E": "..",
                              "d%2F.%2Fe.txt": "d/./e.txt", "dir-marker%2F": "dir-marker/"}
    assert idx.escaped == set(names)
    assert not idx.hidden


def test_unshowable_name_is_hidden():
    idx, changes = make(obj("x" * 300), obj("ok"))
    assert tree(idx.root) == {"ok": "ok"}
    assert "x" * 300 in idx.hidden
    assert len(idx) == 2  # still a live object, just not shown
    assert changes == [("ok",)]


def test_the_empty_name_is_hidden_with_a_warning_that_says_why(caplog):
    """Another client can store the name "" (under a subject of its own): it can be no file name, and
    the warning said "a segment over 255 bytes"."""
    idx, _ = make(obj(""), obj("ok"))
    assert tree(idx.root) == {"ok": "ok"} and "" in idx.hidden
    assert [r.getMessage() for r in caplog.records if "not shown" in r.getMessage()] == [
        "bucket b: object '' is not shown: its name cannot be a file name (it is empty)"]


def test_real_name_beats_escaped_name_either_order():
    idx, _ = make(obj("."), obj("%2E"))
    assert idx.get(("%2E",)).name == "%2E"
    assert "." in idx.hidden
    idx2, _ = make(obj("%2E"), obj("."))
    assert idx2.get(("%2E",)).name == "%2E"
    assert "." in idx2.hidden
    # The real one goes away: the escaped one is shown again.
    idx.apply(obj("%2E", deleted=True))
    assert idx.get(("%2E",)).name == "."
    assert not idx.hidden


def test_directory_beats_file_and_the_file_returns():
    idx, changes = make(obj("clash"), obj("clash/inner.txt"))
    assert tree(idx.root) == {"clash": {"inner.txt": "clash/inner.txt"}}
    assert "clash" in idx.hidden
    assert ("clash",) in changes
    changes.clear()
    idx.apply(obj("clash/inner.txt", deleted=True))
    assert tree(idx.root) == {"clash": "clash"}
    assert not idx.hidden
    assert ("clash", "inner.txt") in changes and ("clash",) in changes


def test_directory_beats_file_arriving_later():
    idx, _ = make(obj("clash/inner.txt"), obj("clash"))
    assert tree(idx.root) == {"clash": {"inner.txt": "clash/inner.txt"}}
    assert "clash" in idx.hidden
    idx.remove("clash/inner.txt")
    assert tree(idx.root) == {"clash": "clash"}


def test_deep_collision_file_in_the_way_of_a_deeper_path():
    idx, _ = make(obj("a/b"), obj("a/b/c/d"))
    assert tree(idx.root) == {"a": {"b": {"c": {"d": "a/b/c/d"}}}}
    idx.apply(obj("a/b/c/d", deleted=True))
    assert tree(idx.root) == {"a": {"b": "a/b"}}


def test_hidden_file_overwritten_while_hidden_stays_hidden_then_returns_new_version():
    idx, _ = make(obj("clash"), obj("clash/x"))
    newer = obj("clash", size=9)
    idx.apply(newer)
    assert isinstance(idx.get(("clash",)), Dir)
    idx.apply(obj("clash/x", deleted=True))
    assert idx.get(("clash",)) is newer


def test_an_odd_name_updated_again_and_again_is_logged_once_until_it_goes_away(caplog):
    """Another client rewriting an escaped (`x/` with bytes) or a hidden (a file where a directory is) object
    over and over gets one line each, not one per version (a status file put every second logged a line
    every second); once the name is deleted and comes back, it is logged again."""
    caplog.set_level("INFO", logger="natsfs.index")
    idx, _ = make(obj("clash/x"))
    for _ in range(5):
        idx.apply(obj("esc/"))
        idx.apply(obj("clash"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bucket b: object 'esc/' is shown as 'esc%2F'",
                     "bucket b: object 'clash' is not shown: a directory 'clash' has the same path"]
    idx.apply(obj("esc/", deleted=True))
    idx.apply(obj("clash", deleted=True))
    idx.apply(obj("esc/"))
    idx.apply(obj("clash"))
    assert [r.getMessage() for r in caplog.records][2:] == lines
    assert tree(idx.root) == {"clash": {"x": "clash/x"}, "esc%2F": "esc/"}


def test_hidden_file_deleted_while_hidden_does_not_come_back():
    idx, _ = make(obj("clash"), obj("clash/x"))
    idx.apply(obj("clash", deleted=True))
    idx.apply(obj("clash/x", deleted=True))
    assert tree(idx.root) == {}
    assert not idx.hidden and len(idx) == 0


def test_empty_marker_is_a_directory():
    idx, changes = make(obj("a/b/", size=0))
    assert tree(idx.root) == {"a": {"b": {}}}
    d = idx.get(("a", "b"))
    assert isinstance(d, Dir) and d.marker is not None and d.marker.name == "a/b/"
    assert ("a", "b") in changes
    assert list(idx.walk_files()) == []


def test_marker_with_content_is_an_escaped_file():
    idx, _ = make(obj("a/b/", size=3))
    assert tree(idx.root) == {"a%2Fb%2F": "a/b/"}


def test_marker_keeps_directory_after_its_files_go():
    idx, _ = make(obj("d/", size=0), obj("d/f"))
    idx.apply(obj("d/f", deleted=True))
    assert tree(idx.root) == {"d": {}}
    idx.apply(obj("d/", size=0, deleted=True))
    assert tree(idx.root) == {}


def test_marker_removed_directory_stays_while_files_remain():
    idx, _ = make(obj("d/", size=0), obj("d/f"))
    idx.apply(obj("d/", deleted=True))
    assert tree(idx.root) == {"d": {"f": "d/f"}}
    assert idx.get(("d",)).marker is None
    idx.apply(obj("d/f", deleted=True))
    assert tree(idx.root) == {}


def test_marker_beats_file_at_same_path():
    idx, _ = make(obj("m"), obj("m/", size=0))
    assert isinstance(idx.get(("m",)), Dir)
    assert "m" in idx.hidden
    idx.apply(obj("m/", deleted=True))
    assert idx.get(("m",)).name == "m"


def test_marker_becoming_content_turns_into_escaped_file():
    idx, _ = make(obj("m/", size=0))
    idx.apply(obj("m/", size=4))
    assert tree(idx.root) == {"m%2F": "m/"}


def test_overwrite_replaces_in_place_and_old_revisions_are_ignored():
    first = obj("f", rev=10)
    idx, changes = make(first)
    second = obj("f", size=99, rev=20)
    assert idx.apply(second)
    assert idx.get(("f",)) is second
    assert not idx.apply(obj("f", size=1, rev=15))  # older than what we hold
    assert not idx.apply(obj("f", size=1, rev=20))  # same revision: replayed
    assert idx.get(("f",)).size == 99
    assert changes == [("f",), ("f",)]  # placed, then replaced (reported once)


def test_a_new_version_is_reported_once_with_the_path_already_showing_it():
    """Replacing an object's entry is one update: the report comes after it, never while the path has no
    entry (the layer above would take a chmod of this mount's own for a deletion and detach the inode)."""
    first = obj("a/b/f", rev=10, nuid="N")
    idx = BucketIndex("b")
    idx.apply(first)
    seen: list[tuple[tuple[str, ...], object]] = []
    idx.on_change = lambda path: seen.append((path, idx.get(path)))
    chmodded = obj("a/b/f", rev=11, nuid="N")  # same nuid: a meta-only change
    assert idx.apply(chmodded)
    # The old entry's removal pruned a/b and a, and the new one made them again: each path once, and
    # each already showing what it shows after the update.
    assert [p for p, _ in seen] == [("a", "b", "f"), ("a", "b"), ("a",)]
    assert seen[0][1] is chmodded
    assert all(isinstance(entry, Dir) for _, entry in seen[1:])


def test_a_removal_is_reported_after_the_entry_is_gone():
    idx, _ = make(obj("go/x", rev=5))
    seen: list[object] = []
    idx.on_change = lambda path: seen.append(idx.get(path))
    assert idx.remove("go/x")
    assert seen == [None, None]  # go/x, then the pruned go


def test_delete_drops_and_prunes_empty_directories():
    idx, changes = make(obj("a/b/c"))
    changes.clear()
    assert idx.apply(obj("a/b/c", deleted=True))
    assert tree(idx.root) == {}
    assert changes == [("a", "b", "c"), ("a", "b"), ("a",)]
    assert not idx.apply(obj("never/seen", deleted=True))
    assert not idx.apply(obj("a/b/c", deleted=True))


def test_delete_keeps_directories_with_other_children():
    idx, _ = make(obj("a/b/c"), obj("a/x"))
    idx.apply(obj("a/b/c", deleted=True))
    assert tree(idx.root) == {"a": {"x": "a/x"}}


def test_remove_for_a_purged_meta_subject():
    idx, changes = make(obj("go/old-name.txt"), obj("go/other"))
    changes.clear()
    assert idx.remove("go/old-name.txt")
    assert not idx.remove("go/old-name.txt")
    assert tree(idx.root) == {"go": {"other": "go/other"}}
    assert changes == [("go", "old-name.txt")]


def test_links_are_entries():
    idx, _ = make(obj("js/link", size=0, link=Link("other", "t.txt")))
    entry = idx.get(("js", "link"))
    assert entry.link == Link("other", "t.txt")


def test_clear_forgets_everything():
    idx, _ = make(obj("a/b"), obj("."), obj("x" * 300))
    idx.clear()
    assert tree(idx.root) == {} and not idx.hidden and not idx.escaped and len(idx) == 0


def test_change_paths_for_new_nested_object():
    _, changes = make(obj("p/q/r.txt"))
    assert changes == [("p",), ("p", "q"), ("p", "q", "r.txt")]


def test_interop_fixture_order_gives_the_documented_tree():
    names = ["go/hello.txt", "go/multi.bin", "go/renamed.txt", "go/overwritten.txt", "js/a.txt", "clash",
             "clash/inner.txt", "dir-marker/", "..", ".", "py/empty.txt", "x" * 300]
    idx, _ = make(*(obj(n, size=0 if n == "py/empty.txt" else 5) for n in names))
    t = tree(idx.root)
    assert sorted(t) == ["%2E", "%2E%2E", "clash", "dir-marker%2F", "go", "js", "py"]
    assert t["clash"] == {"inner.txt": "clash/inner.txt"}
    assert sorted(idx.hidden) == ["clash", "x" * 300]


def test_escaped_set_holds_shown_names():
    idx, _ = make(obj("."), obj("a//b"))
    assert idx.escaped == {".", "a//b"}
    idx.apply(obj(".", deleted=True))
    assert idx.escaped == {"a//b"}


def test_escaped_set_forgets_a_hidden_escaped_object_when_deleted():
    idx, _ = make(obj("%2E"), obj("."))
    assert "." in idx.hidden
    idx.apply(obj(".", deleted=True))
    assert "." not in idx.escaped


# ---------------------------------------------------------------- what the watcher relies on
def test_names_sharing_a_nuid_are_tracked():
    idx, _ = make(obj("a", nuid="N1"), obj("b", nuid="N2"))
    assert idx.names_with_nuid("N1") == ["a"]
    idx.apply(obj("renamed", nuid="N1"))  # first step of a rename by another client
    assert idx.names_with_nuid("N1") == ["a", "renamed"]
    assert idx.remove("a")
    assert idx.names_with_nuid("N1") == ["renamed"]
    idx.apply(obj("renamed", nuid="N3"))  # overwritten: a new nuid
    assert idx.names_with_nuid("N1") == [] and idx.names_with_nuid("N3") == ["renamed"]
    idx.apply(obj("b", deleted=True))
    assert idx.names_with_nuid("N2") == []
    assert idx.names_with_nuid("") == []


def test_a_stale_message_never_resurrects_a_deleted_or_purged_name():
    idx, _ = make(obj("f", rev=10))
    assert idx.apply(obj("f", deleted=True, rev=20))
    assert not idx.apply(obj("f", rev=15))  # delivered late, older than the tombstone
    assert idx.get(("f",)) is None and idx.tombstones == {"f": 20}
    assert idx.apply(obj("f", rev=30))  # a real new version
    assert idx.tombstones == {}
    assert idx.remove("f")
    assert not idx.apply(obj("f", rev=30))
    assert idx.apply(obj("f", rev=31))


def test_remove_if_only_drops_the_revision_it_was_asked_about():
    idx, _ = make(obj("f", rev=10))
    assert not idx.remove_if("f", 9)
    assert idx.remove_if("f", 10)
    assert not idx.remove_if("f", 10)


def test_forget_applies_a_deletion_known_only_by_revision():
    idx, changes = make(obj("d/f", rev=10), obj("g", rev=11))
    changes.clear()
    assert not idx.forget("g", 5)  # older than what is shown
    assert idx.forget("d/f", 12)
    assert tree(idx.root) == {"g": "g"} and idx.tombstones == {"d/f": 12}
    assert changes == [("d", "f"), ("d",)]


def test_meta_subject_count_covers_live_tombstones_and_malformed():
    idx, _ = make(obj("a"), obj("b"), obj("x" * 300))
    idx.apply(obj("b", deleted=True))
    idx.malformed.add("$O.b.M.garbage")
    assert idx.meta_subject_count() == 4  # a, the hidden one, b's tombstone, the garbage


def test_changed_paths_between_two_trees():
    from natsfs.index import changed_paths

    same = obj("keep/same", rev=1)
    old, _ = make(same, obj("keep/changed", rev=2), obj("gone/deep/f", rev=3), obj("kind", rev=4),
                  obj("m/", size=0, rev=5))
    new, _ = make(obj("keep/same", rev=101, nuid=same.nuid), obj("keep/changed", size=9, rev=102),
                  obj("kind/now-a-dir", rev=103), obj("fresh/x", rev=104), obj("m/", size=0, rev=105))
    # Same version under a new revision (a recreated stream) is not a change; a marker's mtime is.
    new.objects["keep/same"].mtime_ns = same.mtime_ns
    assert sorted(changed_paths(old.root, new.root)) == [
        ("fresh",), ("gone",), ("keep", "changed"), ("kind",), ("m",)]
    assert changed_paths(old.root, old.root) == []


# ---------------------------------------------------------------- aliases (non-canonical meta subjects)
ALIAS = "$O.b.M.ZG9jLnR4dA"  # unpadded base64 of "doc.txt"
ALIAS2 = "$O.b.M.not-base64!"


def test_the_canonical_meta_wins_over_an_alias_whatever_their_order_or_revisions():
    for order in ("canonical first", "alias first"):
        idx = BucketIndex("b")
        canonical, alias = obj("doc.txt", rev=5), obj("doc.txt", rev=9)
        if order == "canonical first":
            idx.apply(canonical)
            idx.apply_alias(ALIAS, alias)
        else:
            idx.apply_alias(ALIAS, obj("doc.txt", rev=3))
            assert idx.objects["doc.txt"].revision == 3 and idx.odd_subjects == {"doc.txt": ALIAS}
            idx.apply(canonical)
            idx.apply_alias(ALIAS, alias)
        assert idx.objects["doc.txt"] is canonical and idx.odd_subjects == {}
        assert idx.meta_subject_count() == 2  # both subjects accounted for


def test_an_alias_tombstone_deletes_only_its_own_alias():
    idx = BucketIndex("b")
    live = obj("doc.txt", rev=1, nuid="keep")
    idx.apply(obj("keep.txt", rev=2, nuid="keep"))
    idx.apply(live)
    idx.apply_alias(ALIAS, obj("doc.txt", rev=7, deleted=True, nuid="keep"))
    assert idx.objects["doc.txt"] is live and not idx.shared_tombstones and not idx.tombstones
    # An object shown from one alias, deleted there, falls back to another alias, then to nothing.
    idx2 = BucketIndex("b")
    idx2.apply_alias(ALIAS, a1 := obj("doc.txt", rev=1))
    idx2.apply_alias(ALIAS2, a2 := obj("doc.txt", rev=2))
    assert idx2.objects["doc.txt"] is a2 and idx2.odd_subjects == {"doc.txt": ALIAS2}
    idx2.apply_alias(ALIAS2, obj("doc.txt", rev=3, deleted=True))
    assert idx2.objects["doc.txt"] is a1 and idx2.odd_subjects == {"doc.txt": ALIAS}
    idx2.drop_alias(ALIAS)
    assert "doc.txt" not in idx2.objects and idx2.get(("doc.txt",)) is None
    assert idx2.meta_subject_count() == 1  # the alias tombstone's subject


def test_an_alias_shows_once_the_canonical_subject_holds_nothing():
    idx = BucketIndex("b")
    alias = obj("doc.txt", rev=1)
    idx.apply_alias(ALIAS, alias)
    idx.apply(obj("doc.txt", rev=2))
    assert idx.remove("doc.txt")  # the canonical meta purged (renamed away)
    assert idx.objects["doc.txt"] is alias and idx.odd_subjects == {"doc.txt": ALIAS}
    idx.apply(obj("doc.txt", rev=3, deleted=True))  # a canonical tombstone hides it (nats.go: not found)
    assert "doc.txt" not in idx.objects and idx.odd_subjects == {}
    idx.drop_tombstone("doc.txt", 3)
    assert idx.objects["doc.txt"] is alias


def test_an_alias_not_shown_holds_its_nuid_without_making_the_name_shared():
    """An `adopt_alias` cut short leaves the canonical meta and the alias of one name on one nuid: the
    alias is not shown (the canonical one wins) and makes no other name, but its chunks must stay."""
    idx, _ = make(obj("doc.txt", rev=5, nuid="shared"))
    idx.apply_alias(ALIAS, obj("doc.txt", rev=2, nuid="shared"))
    assert idx.get(("doc.txt",)).revision == 5
    assert idx.hidden_alias_holders("shared") == (ALIAS,)
    assert idx.other_names_with_nuid("shared", "doc.txt") == () and idx.names_with_nuid("shared") == ["doc.txt"]
    assert idx.hidden_alias_holders("other") == ()
    idx.apply_alias(ALIAS, obj("doc.txt", rev=6, nuid="shared", deleted=True))
    assert idx.hidden_alias_holders("shared") == ()


# ---------------------------------------------------------------- implied directories this mount emptied
def test_a_directory_emptied_by_an_own_removal_is_kept_and_one_emptied_by_another_client_goes():
    a, b = obj("zz/a"), obj("zz/b")
    idx, changes = make(a, b)
    with idx.own_removal(("zz",)):
        # The watch may deliver this mount's tombstone before the removal ends: still not pruned.
        idx.apply(obj("zz/a", deleted=True))
    assert tree(idx.root) == {"zz": {"b": "zz/b"}}
    changes.clear()
    idx.apply(obj("zz/b", deleted=True))  # another client's removal of the last entry
    assert tree(idx.root) == {}
    assert changes == [("zz", "b"), ("zz",)]
    idx, changes = make(obj("p/zz/a"))
    changes.clear()
    with idx.own_removal(("p", "zz")):
        idx.apply(obj("p/zz/a", deleted=True))
    assert tree(idx.root) == {"p": {"zz": {}}}
    assert changes == [("p", "zz", "a")]  # (the directory never reported as gone)
    idx.drop_empty(("p", "zz"))  # this mount's rmdir of it: its implied parent goes with it (not held)
    assert tree(idx.root) == {}


def test_a_failed_own_removal_leaves_an_emptied_directory_to_go():
    idx, _ = make(obj("zz/a"))
    try:
        with idx.own_removal(("zz",)):
            idx.apply(obj("zz/a", deleted=True))  # another client deleted it meanwhile
            raise RuntimeError("the delete was refused")
    except RuntimeError:
        pass
    assert tree(idx.root) == {}
    with idx.own_removal(("zz",)):  # (no such directory: nothing held)
        pass
    idx, _ = make(obj("zz/a"))
    with idx.own_removal(("zz",)):
        idx.apply(obj("zz/a", deleted=True))
    try:
        with idx.own_removal(("zz",)):  # a rename into the kept directory, taken back as it failed
            idx.apply(obj("zz/n"))
            idx.apply(obj("zz/n", deleted=True))
            raise RuntimeError("the claim was refused")
    except RuntimeError:
        pass
    assert tree(idx.root) == {"zz": {}}


def test_kept_directories_survive_an_index_rebuilt_aside():
    idx, _ = make(obj("p/zz/a"), obj("p/x"))
    with idx.own_removal(("p", "zz")):
        idx.apply(obj("p/zz/a", deleted=True))
    rebuilt, _ = make(obj("p/x"))
    rebuilt.carry_kept(idx.root)
    assert tree(rebuilt.root) == {"p": {"x": "p/x", "zz": {}}}
    moved, _ = make(obj("q/y"))  # (a parent gone meanwhile: nothing to keep it in)
    moved.carry_kept(idx.root)
    assert tree(moved.root) == {"q": {"y": "q/y"}}


def test_metas_with_a_wildcard_nuid_are_listed_until_the_name_holds_another():
    """Tombstones, live metas and links whose nuid is a wildcard (for the mount's rewrite), by the revision
    of their meta; another meta of the name, a purge of its subject or a deletion known without its meta
    drop them."""
    def wild(name: str, nuid: str, *, deleted: bool = False, size: int = 5, link: Link | None = None) -> ObjectInfo:
        info = obj(name, size, deleted=deleted, link=link)
        info.nuid, info.wildcard_nuid = "", nuid
        return info

    idx, _ = make()
    live, tomb, link = wild("live", "*"), wild("tomb", ">", deleted=True), wild("link", "*", size=0,
                                                                                  link=Link("b", "live"))
    for info in (live, tomb, link):
        idx.apply(info)
    assert idx.wildcard_nuids == {"live": (live.revision, "*"), "tomb": (tomb.revision, ">"),
                                  "link": (link.revision, "*")}
    assert idx.objects["live"].size == 5 and idx.objects["link"].link == Link("b", "live")
    idx.apply(obj("live"))  # (rewritten on a fresh nuid)
    idx.remove("link")
    idx.forget("tomb", tomb.revision + 1)
    assert idx.wildcard_nuids == {}
