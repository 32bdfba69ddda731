"""`natsfs.fsck.check_bucket` over MemoryStreams: what it finds, what `repair` fixes, what it leaves."""

from __future__ import annotations

import json

import pytest
import trio
from gowriters import delete_object, js_put_object, put_object

from natsfs import fsck
from natsfs.adr20 import (
    BytesSource,
    Link,
    ObjectStore,
    chunk_subject,
    meta_subject,
    new_nuid,
    stream_name,
    usable_nuid,
)
from natsfs.memstreams import MemoryStreams
from natsfs.streams import ROLLUP

CHUNK = 1024
S = 10**9


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000 * S

    def __call__(self) -> int:
        return self.now


def run(fn):
    async def main():
        clock = Clock()
        ms = MemoryStreams(clock=clock)
        store = ObjectStore(ms, chunk_size=CHUNK, max_subject_bytes=600)
        await store.create_bucket("b")
        return await fn(ms, store, clock)

    return trio.run(main)


def kinds(report: fsck.Report, *, left: bool = False) -> list[tuple[str, str]]:
    found = report.problems_left if left else report.findings
    return sorted((f.kind, f.where) for f in found)


async def read(store: ObjectStore, name: str) -> bytes:
    info = await store.get_info("b", name)
    msgs = await store.fetch_chunks("b", info.nuid, 0, info.chunks + 1, 1 << 30)
    return b"".join(m.data for m in msgs)


def test_a_clean_bucket_is_clean_with_verify():
    async def body(ms, store, clock):
        await store.put("b", "a", BytesSource(b"a" * 5000))
        await put_object(ms, "b", "dir/c", b"c" * 3000, chunk_size=CHUNK)
        await store.add_link("b", "l", "b", "a")
        report = await fsck.check_bucket(store, "b", verify=True)
        assert report.findings == [] and report.objects == 3 and report.summary().endswith("clean")

    run(body)


def test_finds_orphans_damage_shared_tombstones_bad_names_and_repairs_only_what_is_safe():
    async def body(ms, store, clock):
        a = b"".join(bytes([i]) * CHUNK for i in range(5))
        await store.put("b", "a", BytesSource(a))
        await store.put("b", "keep", BytesSource(b"k" * 2500))
        info_a = await store.get_info("b", "a")
        # An interrupted put (old) and a put in progress (young).
        orphan = chunk_subject("b", new_nuid())
        await ms.publish(orphan, b"o" * CHUNK)
        await ms.publish(orphan, b"o" * 10)
        clock.now += 3600 * S
        young = chunk_subject("b", new_nuid())
        await ms.publish(young, b"y" * CHUNK)
        # A meta missing a chunk.
        await store.put("b", "broken", BytesSource(b"q" * 3000))
        broken = await store.get_info("b", "broken")
        # (The middle one: the first gap, before its first chunk, holds other objects' messages.)
        victim = [m.seq for m in ms.messages(stream_name("b")) if m.subject == chunk_subject("b", broken.nuid)][1]
        await ms.delete_msg(stream_name("b"), victim)
        # A tombstone carrying live "a"'s nuid.
        tomb = {"name": "ghost", "bucket": "b", "nuid": info_a.nuid, "mtime": "0001-01-01T00:00:00Z",
                "deleted": True}
        await ms.publish(meta_subject("b", "ghost"), json.dumps(tomb).encode(), {ROLLUP: "sub"})
        # A name no client can address: a meta subject that is not base64 of UTF-8, and one too long.
        bad = {"name": "x", "bucket": "b", "nuid": "", "size": 0, "chunks": 0, "mtime": "0001-01-01T00:00:00Z"}
        await ms.publish("$O.b.M.%%%", json.dumps(bad).encode())
        long_name = "n" * 700
        doc = {"name": long_name, "bucket": "b", "nuid": "", "size": 0, "chunks": 0,
               "mtime": "0001-01-01T00:00:00Z"}
        await ms.publish(meta_subject("b", long_name), json.dumps(doc).encode())
        # A name other clients can use but a mount cannot show (a segment over 255 bytes, even escaped).
        await put_object(ms, "b", "h/" + "x" * 300, b"hidden")
        clock.now += 10 * S

        report = await fsck.check_bucket(store, "b", grace_s=300, clock=clock)
        assert kinds(report) == sorted([
            (fsck.ORPHAN, orphan), (fsck.IN_PROGRESS, young), (fsck.DAMAGED, "broken"),
            (fsck.SHARED_TOMBSTONE, "ghost"), (fsck.BAD_NAME, "x"), (fsck.BAD_NAME, "n" * 60 + "..."),
            (fsck.HIDDEN, "h/" + "x" * 58 + "..."), (fsck.HIDDEN, "n" * 60 + "...")])
        damage = next(f.detail for f in report.findings if f.kind == fsck.DAMAGED)
        # Only the deleted chunk's bytes: its empty sequence places the others, as a read does.
        assert "1 of 3 chunks missing" in damage and f"({CHUNK} bytes unreadable)" in damage, damage
        assert all(not f.repaired for f in report.findings)

        repaired = await fsck.check_bucket(store, "b", repair=True, grace_s=300, clock=clock)
        assert sorted((f.kind, f.where) for f in repaired.findings if f.repaired) == sorted([
            (fsck.ORPHAN, orphan), (fsck.SHARED_TOMBSTONE, "ghost")])
        assert ms.subjects(stream_name("b")).get(orphan) is None
        assert ms.subjects(stream_name("b")).get(young) == 1  # in progress: untouched
        assert await store.get_info("b", "ghost") is None
        assert await read(store, "a") == a and await read(store, "keep") == b"k" * 2500

        again = await fsck.check_bucket(store, "b", grace_s=300, clock=clock)
        assert kinds(again, left=True) == sorted([
            (fsck.DAMAGED, "broken"), (fsck.BAD_NAME, "x"), (fsck.BAD_NAME, "n" * 60 + "...")])

    run(body)


def test_verify_finds_a_digest_mismatch_and_wrong_sizes_are_damage():
    async def body(ms, store, clock):
        await store.put("b", "f", BytesSource(b"f" * 3000))
        doc, rev = await store.get_meta_doc("b", "f")
        await store.publish_meta("b", dict(doc, digest="SHA-256=" + "A" * 43 + "="), expected_revision=rev)
        await store.put("b", "g", BytesSource(b"g" * 3000))
        doc, rev = await store.get_meta_doc("b", "g")
        await store.publish_meta("b", dict(doc, size=3001), expected_revision=rev)
        plain = await fsck.check_bucket(store, "b")
        assert kinds(plain) == [(fsck.DAMAGED, "g")]
        verified = await fsck.check_bucket(store, "b", verify=True)
        assert kinds(verified) == [(fsck.DAMAGED, "g"), (fsck.DIGEST, "f")]

    run(body)


def test_an_orphan_referenced_by_a_meta_stored_during_the_check_is_not_purged():
    async def body(ms, store, clock):
        nuid = new_nuid()
        await ms.publish(chunk_subject("b", nuid), b"late")
        clock.now += 3600 * S
        real_last = ms.last_msg

        async def last_msg_then_commit(stream, subject):
            got = await real_last(stream, subject)
            if subject == chunk_subject("b", nuid):
                doc = {"name": "late", "bucket": "b", "nuid": nuid, "size": 4, "chunks": 1,
                       "mtime": "0001-01-01T00:00:00Z"}
                await ms.publish(meta_subject("b", "late"), json.dumps(doc).encode(), {ROLLUP: "sub"})
            return got

        ms.last_msg = last_msg_then_commit
        report = await fsck.check_bucket(store, "b", repair=True, clock=clock)
        assert kinds(report) == [(fsck.IN_PROGRESS, chunk_subject("b", nuid))]
        assert ms.subjects(stream_name("b"))[chunk_subject("b", nuid)] == 1

    run(body)


def test_a_repair_the_bucket_refuses_is_reported_and_the_check_goes_on():
    async def body(ms, store, clock):
        orphan = chunk_subject("b", new_nuid())
        await ms.publish(orphan, b"o")
        clock.now += 3600 * S
        await store.seal_bucket("b")
        report = await fsck.check_bucket(store, "b", repair=True, clock=clock)
        assert kinds(report, left=True) == [(fsck.ORPHAN, orphan)]
        assert "repair failed" in report.findings[0].detail and "sealed" in report.findings[0].detail
        assert ms.subjects(stream_name("b"))[orphan] == 1

    run(body)


def test_reports_fields_a_mount_ignores_and_sizes_no_file_can_have():
    async def body(ms, store, clock):
        await put_object(ms, "b", "good", b"g", chunk_size=CHUNK)
        await put_object(ms, "b", "uid", b"u", chunk_size=CHUNK, metadata={"natsfs.uid": str(2**40)})
        await put_object(ms, "b", "rdev", b"", chunk_size=CHUNK,
                         metadata={"natsfs.type": "char", "natsfs.rdev": str(2**70)})
        await put_object(ms, "b", "mtime", b"m", chunk_size=CHUNK, metadata={"natsfs.mtime_ns": "9" * 30})
        # A time before 1970 (negative nanoseconds) is a usable time: no finding.
        await put_object(ms, "b", "pre-1970", b"p", chunk_size=CHUNK,
                         metadata={"natsfs.mtime_ns": "-14182940000000000"})
        # Descriptive fields of the wrong JSON type: ignored by a mount.
        await put_object(ms, "b", "md-list", b"l", chunk_size=CHUNK, metadata=["a"])  # type: ignore[arg-type]
        await put_object(ms, "b", "py-headers", b"p", chunk_size=CHUNK,
                         headers={"Content-Type": "text/plain"})  # type: ignore[dict-item]
        link = {"name": "link-typed-wrong", "bucket": "b", "nuid": new_nuid(), "size": 0, "chunks": 0,
                "options": {"link": {"bucket": 7, "name": ["a"]}}}
        await ms.publish(meta_subject("b", "link-typed-wrong"), json.dumps(link).encode(), {ROLLUP: "sub"})
        nuid = new_nuid()
        await ms.publish(chunk_subject("b", nuid), b"x")
        doc = {"name": "size", "bucket": "b", "nuid": nuid, "size": 2**63, "chunks": 1}
        await ms.publish(meta_subject("b", "size"), json.dumps(doc).encode(), {ROLLUP: "sub"})
        report = await fsck.check_bucket(store, "b")
        # (A link whose bucket is a number: a meta nats.go cannot read, that decides what the object is.)
        assert kinds(report, left=True) == [
            (fsck.BAD_FIELD, "md-list"), (fsck.BAD_FIELD, "mtime"), (fsck.BAD_FIELD, "py-headers"),
            (fsck.BAD_FIELD, "rdev"), (fsck.BAD_FIELD, "uid"),
            (fsck.BAD_META, meta_subject("b", "link-typed-wrong")), (fsck.BAD_META, meta_subject("b", "size"))]
        assert "natsfs.uid '1099511627776'" in next(f for f in report.findings if f.where == "uid").detail
        assert "headers['Content-Type'] 'text/plain'" in next(
            f for f in report.findings if f.where == "py-headers").detail
        assert "metadata ['a'] (not an object)" in next(f for f in report.findings if f.where == "md-list").detail

    run(body)


def test_metas_under_an_alias_subject_neither_hide_nor_make_findings_of_canonical_ones():
    """A name's meta under its unpadded subject (an old client) is another meta: it must not hide a
    damaged canonical object or a canonical tombstone that endangers another object, and a tombstone
    sharing a nuid only with a meta of its own name is no danger (purging it would bring the name back)."""
    def alias(name: str) -> str:
        subject = meta_subject("b", name)
        assert subject.endswith("=")
        return subject.rstrip("=")

    async def body(ms, store, clock):
        async def doc_of(name: str) -> dict:
            return json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", name))).data)

        await store.put("b", "damaged.tx", BytesSource(b"d" * 3000))
        await ms.purge_subject(stream_name("b"), chunk_subject("b", (await store.get_info("b", "damaged.tx")).nuid))
        await put_object(ms, "b", "scratch", b"fine alias bytes")
        fine = dict(await doc_of("scratch"), name="damaged.tx")
        await ms.purge_subject(stream_name("b"), meta_subject("b", "scratch"))
        await ms.publish(alias("damaged.tx"), json.dumps(fine).encode(), {ROLLUP: "sub"})
        # A canonical tombstone carrying live "keeper.txt"'s nuid, then an alias tombstone of its name.
        await store.put("b", "keeper.txt", BytesSource(b"k" * 10))
        kept = await doc_of("keeper.txt")
        tomb = {"name": "dangers.tx", "bucket": "b", "nuid": kept["nuid"], "mtime": "0001-01-01T00:00:00Z",
                "deleted": True}
        await ms.publish(meta_subject("b", "dangers.tx"), json.dumps(tomb).encode(), {ROLLUP: "sub"})
        await ms.publish(alias("dangers.tx"), json.dumps(dict(tomb, nuid=new_nuid())).encode(), {ROLLUP: "sub"})
        # A canonical tombstone whose nuid only its own name's alias carries.
        await store.put("b", "own-alias.t", BytesSource(b"o" * 10))
        own = await doc_of("own-alias.t")
        await ms.publish(alias("own-alias.t"), json.dumps(own).encode(), {ROLLUP: "sub"})
        await ms.publish(meta_subject("b", "own-alias.t"), json.dumps(dict(own, deleted=True)).encode(),
                         {ROLLUP: "sub"})

        report = await fsck.check_bucket(store, "b")
        found = kinds(report)
        assert (fsck.DAMAGED, "damaged.tx") in found
        assert (fsck.SHARED_TOMBSTONE, "dangers.tx") in found
        assert (fsck.SHARED_TOMBSTONE, "own-alias.t") not in found

    run(body)


def test_a_tombstone_carrying_a_hidden_alias_nuid_is_noted_and_left_alone():
    """A tombstone whose nuid no live object carries but a hidden alias does (the holders a mount keeps
    chunks for, `BucketIndex.hidden_alias_holders`): another client's Delete or Put of its name would purge
    that alias's chunks. fsck notes it (before: nothing), and, as a mount, repairs nothing for it: a hidden
    alias names no object (its own name's tombstone kept it hidden; purged, it would bring the name back)."""
    def alias(name: str) -> str:
        subject = meta_subject("b", name)
        assert subject.endswith("=")
        return subject.rstrip("=")

    async def body(ms, store, clock):
        async def doc_of(name: str) -> dict:
            return json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", name))).data)

        # "holder.txt" is live (its own nuid); its alias subject holds a meta of another nuid: hidden.
        await store.put("b", "holder.txt", BytesSource(b"h" * 10))
        await put_object(ms, "b", "scratch", b"alias bytes")
        hidden = dict(await doc_of("scratch"), name="holder.txt")
        await ms.publish(alias("holder.txt"), json.dumps(hidden).encode(), {ROLLUP: "sub"})
        await ms.purge_subject(stream_name("b"), meta_subject("b", "scratch"))
        tomb = {"name": "gone", "bucket": "b", "nuid": hidden["nuid"], "mtime": "0001-01-01T00:00:00Z",
                "deleted": True}
        await ms.publish(meta_subject("b", "gone"), json.dumps(tomb).encode(), {ROLLUP: "sub"})
        # A canonical tombstone whose nuid only its own name's alias carries.
        await store.put("b", "own-alias.t", BytesSource(b"o" * 10))
        own = await doc_of("own-alias.t")
        await ms.publish(alias("own-alias.t"), json.dumps(own).encode(), {ROLLUP: "sub"})
        await ms.publish(meta_subject("b", "own-alias.t"), json.dumps(dict(own, deleted=True)).encode(),
                         {ROLLUP: "sub"})

        report = await fsck.check_bucket(store, "b", repair=True)
        found = kinds(report)
        assert (fsck.ALIAS_TOMBSTONE, "gone") in found
        assert (fsck.ALIAS_TOMBSTONE, "own-alias.t") in found
        assert not any(kind == fsck.SHARED_TOMBSTONE for kind, _ in found)
        assert report.problems_left == [] and not any(f.repaired for f in report.findings)
        note = next(f for f in report.findings if f.where == "gone")
        assert alias("holder.txt") in note.detail
        # Both tombstones are still there.
        assert json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", "gone"))).data)["deleted"]
        assert json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", "own-alias.t"))).data)["deleted"]

    run(body)


def test_the_chunks_of_a_meta_with_a_deleted_field_of_the_wrong_type_are_no_orphans():
    """`"deleted": "false"` makes a meta nats.go cannot read (unreadable), not a tombstone: a repair
    never purges the chunks it names."""
    async def body(ms, store, clock):
        nuid = new_nuid()
        await ms.publish(chunk_subject("b", nuid), b"kept")
        doc = {"name": "odd", "bucket": "b", "nuid": nuid, "size": 4, "chunks": 1, "deleted": "false"}
        await ms.publish(meta_subject("b", "odd"), json.dumps(doc).encode(), {ROLLUP: "sub"})
        clock.now += 3600 * S
        report = await fsck.check_bucket(store, "b", repair=True, clock=clock)
        assert kinds(report) == [(fsck.BAD_META, meta_subject("b", "odd"))]
        assert ms.subjects(stream_name("b"))[chunk_subject("b", nuid)] == 1

    run(body)


def rewrite_when_checked(ms: MemoryStreams, name: str, versions: list[bytes], *, at: str = "subject_index") -> None:
    """Replace `name` (as nats.go's Put does: new nuid, then the old chunks purged) with the next of
    `versions` each time fsck is about to read one of its versions' chunks (`at`: the MemoryStreams
    call): what a live mount rewriting the name does while fsck runs."""
    real = getattr(ms, at)
    left = list(versions)

    async def rewrite_then(stream, subject, *args):
        current = json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", name))).data)
        if left and subject == chunk_subject("b", current["nuid"]):
            await put_object(ms, "b", name, left.pop(0), chunk_size=CHUNK)
        return await real(stream, subject, *args)

    setattr(ms, at, rewrite_then)


def test_an_object_rewritten_while_its_chunks_are_checked_is_no_damage():
    """A live mount replaces a version (new nuid, the old chunks purged after the new meta) while fsck
    checks it: the version in fsck's meta snapshot then has no chunks left. Before, it was reported as a
    damaged object ("3 of 3 chunks missing") and fsck exited 1; now the meta is read again, the finding
    is void, and the new version is checked instead."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "busy", b"1" * 3000, chunk_size=CHUNK)
        await put_object(ms, "b", "quiet", b"q" * 2000, chunk_size=CHUNK)
        rewrite_when_checked(ms, "busy", [b"2" * 5000])
        report = await fsck.check_bucket(store, "b")
        assert report.findings == [] and report.problems_left == []  # the exit status: 0
        assert report.changed == 1
        assert report.summary() == "b: 2 objects, 0 tombstones, 2 chunk subjects, 1 changed while checked: clean"
        assert await read(store, "busy") == b"2" * 5000

    run(body)


def test_an_object_rewritten_while_verified_is_no_digest_mismatch_and_no_error():
    """With --verify, the chunks purged while they are read: before, the check stopped with an error."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "busy", b"1" * 3000, chunk_size=CHUNK)
        rewrite_when_checked(ms, "busy", [b"2" * 3000], at="get_batch")
        report = await fsck.check_bucket(store, "b", verify=True)
        assert report.findings == [] and report.changed == 1

    run(body)


def test_an_object_deleted_while_checked_is_no_damage():
    async def body(ms, store, clock):
        await put_object(ms, "b", "gone", b"g" * 3000, chunk_size=CHUNK)
        real = ms.subject_index

        async def delete_then(stream, subject):
            if await store.get_info("b", "gone") is not None:
                await store.delete("b", "gone")
            return await real(stream, subject)

        ms.subject_index = delete_then
        report = await fsck.check_bucket(store, "b")
        assert report.findings == [] and report.changed == 1

    run(body)


def test_a_name_rewritten_on_every_check_is_noted_as_changing_not_reported_as_damaged():
    async def body(ms, store, clock):
        await put_object(ms, "b", "busy", b"0" * 3000, chunk_size=CHUNK)
        rewrite_when_checked(ms, "busy", [bytes([i]) * 3000 for i in range(1, 10)])
        report = await fsck.check_bucket(store, "b")
        assert kinds(report) == [(fsck.CHANGING, "busy")] and report.problems_left == []
        assert report.changed == 1

    run(body)


def test_damage_stays_reported_when_the_meta_is_unchanged_or_the_new_version_is_damaged_too():
    """A chunk deleted under an unchanged meta is damage, with and without --verify; a name rewritten
    while checked is judged by its new version, damaged too here."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "broken", b"x" * 3000, chunk_size=CHUNK)
        broken = await store.get_info("b", "broken")
        victim = [m.seq for m in ms.messages(stream_name("b")) if m.subject == chunk_subject("b", broken.nuid)][1]
        await ms.delete_msg(stream_name("b"), victim)
        for verify in (False, True):
            report = await fsck.check_bucket(store, "b", verify=verify)
            assert kinds(report) == [(fsck.DAMAGED, "broken")] and report.changed == 0
            assert "1 of 3 chunks missing" in report.findings[0].detail

        # Rewritten while checked, into a version that has a chunk missing too.
        await put_object(ms, "b", "rewritten", b"1" * 3000, chunk_size=CHUNK)
        real = ms.subject_index
        second: list[str] = []

        async def rewrite_damaged_then(stream, subject):
            if not second and subject != chunk_subject("b", broken.nuid):
                info = await put_object(ms, "b", "rewritten", b"2" * 4000, chunk_size=CHUNK)
                second.append(info.nuid)
                seqs = [m.seq for m in ms.messages(stream_name("b")) if m.subject == chunk_subject("b", info.nuid)]
                await ms.delete_msg(stream_name("b"), seqs[0])
            return await real(stream, subject)

        ms.subject_index = rewrite_damaged_then
        report = await fsck.check_bucket(store, "b")
        found = {f.where: f for f in report.findings}
        assert sorted(found) == ["broken", "rewritten"] and report.changed == 1
        assert "1 of 4 chunks missing" in found["rewritten"].detail

    run(body)


def test_findings_from_metas_changed_before_they_are_read_again_are_void():
    """The other findings derived from fsck's meta snapshot: an ignored field that a rewrite dropped, a
    tombstone whose live owner was rewritten meanwhile (its old nuid purged: no danger left, and nothing
    to repair), an unreadable meta since replaced; and orphans a meta stored meanwhile references (also
    without --repair)."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "uid", b"u", chunk_size=CHUNK, metadata={"natsfs.uid": str(2**40)})
        owner = await put_object(ms, "b", "owner", b"o" * 10, chunk_size=CHUNK)
        tomb = {"name": "ghost", "bucket": "b", "nuid": owner.nuid, "mtime": "0001-01-01T00:00:00Z",
                "deleted": True}
        await ms.publish(meta_subject("b", "ghost"), json.dumps(tomb).encode(), {ROLLUP: "sub"})
        await ms.publish(meta_subject("b", "junk"), b"not json", {ROLLUP: "sub"})
        late = new_nuid()
        await ms.publish(chunk_subject("b", late), b"late")
        clock.now += 3600 * S
        real_counts = ms.subject_counts

        async def counts_then_change(stream, filter_subject):
            got = await real_counts(stream, filter_subject)
            await put_object(ms, "b", "uid", b"u", chunk_size=CHUNK)
            await put_object(ms, "b", "owner", b"new", chunk_size=CHUNK)
            await store.put("b", "junk", BytesSource(b"fine"))
            doc = {"name": "late", "bucket": "b", "nuid": late, "size": 4, "chunks": 1,
                   "mtime": "0001-01-01T00:00:00Z"}
            await ms.publish(meta_subject("b", "late"), json.dumps(doc).encode(), {ROLLUP: "sub"})
            return got

        ms.subject_counts = counts_then_change
        report = await fsck.check_bucket(store, "b", repair=True, clock=clock)
        assert kinds(report) == [(fsck.IN_PROGRESS, chunk_subject("b", late))] and report.problems_left == []
        # (Three findings void, and the two rewritten objects' old versions found without chunks.)
        assert report.changed == 5
        assert json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", "ghost"))).data)["deleted"]

    run(body)


def test_a_meta_whose_nuid_is_a_wildcard_is_dangerous_and_rewritten_as_a_mount_does():
    """nats.go's Delete and Put and nats.js's put of a name purge `$O.b.C.` + the nuid its meta carries:
    with `>` or `*` that filter matches every chunk subject. A tombstone carrying one is a tombstone
    sharing every live nuid; a live meta or a link carrying one is as dangerous. `--repair` rewrites
    each on a fresh nuid expecting the revision read, as a mount does (`defuse_wildcard_nuid`): every
    other field kept, a link still a link to its target. Then those clients' Delete and put of the names
    purge only the fresh nuid. A wildcard in an alias tombstone, which no client reads by name, is no
    danger."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "good", b"good bytes", chunk_size=CHUNK)
        await put_object(ms, "b", "more", b"more bytes" * 300, chunk_size=CHUNK)
        wild = {"bomb": {"nuid": ">", "deleted": True}, "bomb2": {"nuid": "*", "deleted": True},
                "live": {"nuid": "*", "size": 5, "chunks": 1, "digest": "SHA-256=abc", "description": "kept"},
                "empty": {"nuid": ">", "metadata": {"k": "v"}}, "dotted": {"nuid": "x.*"},
                "link": {"nuid": "*", "options": {"link": {"bucket": "b", "name": "good"}}}}
        for name, fields in wild.items():
            doc = {"name": name, "bucket": "b", "size": 0, "chunks": 0} | fields
            await ms.publish(meta_subject("b", name), json.dumps(doc).encode(), {ROLLUP: "sub"})
        doc = {"name": "alias", "bucket": "b", "nuid": ">", "size": 0, "chunks": 0, "deleted": True}
        await ms.publish(meta_subject("b", "alias").rstrip("="), json.dumps(doc).encode(), {ROLLUP: "sub"})
        report = await fsck.check_bucket(store, "b")
        assert kinds(report, left=True) == [(fsck.WILDCARD_META, "dotted"), (fsck.WILDCARD_META, "empty"),
                                            (fsck.WILDCARD_META, "link"), (fsck.WILDCARD_META, "live"),
                                            (fsck.SHARED_TOMBSTONE, "bomb"), (fsck.SHARED_TOMBSTONE, "bomb2")]
        details = {f.where: f.detail for f in report.findings}
        assert "would purge the chunks of every object" in details["bomb"]
        assert details["link"].startswith("a link carrying the nuid '*'")
        assert details["live"].startswith("an object (its 5 bytes never readable)")
        chunks = {s: n for s, n in ms.subjects(stream_name("b")).items() if ".C." in s}
        report = await fsck.check_bucket(store, "b", repair=True)
        assert report.problems_left == [] and all(f.repaired for f in report.findings)
        for name, fields in wild.items():
            msg = await ms.last_msg(stream_name("b"), meta_subject("b", name))
            doc = json.loads(msg.data)
            assert usable_nuid(doc["nuid"]) and doc["nuid"] not in chunks, name
            if not fields.get("deleted"):  # (a tombstone is rewritten as nats.go's Delete writes one)
                assert {k: v for k, v in doc.items() if k not in ("nuid", "mtime")} == \
                    {"name": name, "bucket": "b", "size": 0, "chunks": 0} | {k: v for k, v in fields.items()
                                                                            if k != "nuid"}
        assert (await store.get_info("b", "link")).link == Link("b", "good")
        # The alias stays; a second check finds the 5 bytes of "live" missing (they always were).
        assert meta_subject("b", "alias").rstrip("=") in ms.subjects(stream_name("b"))
        report = await fsck.check_bucket(store, "b")
        assert kinds(report, left=True) == [(fsck.DAMAGED, "live")]
        # nats.go's Delete of every live name, nats.js's put of every name: only the fresh nuids go.
        for name, fields in wild.items():
            if not fields.get("deleted"):
                await delete_object(ms, "b", name)
            await js_put_object(ms, "b", name, b"theirs")
        assert {s: n for s, n in ms.subjects(stream_name("b")).items() if s in chunks} == chunks
        assert await read(store, "good") == b"good bytes"
        assert await read(store, "more") == b"more bytes" * 300

    run(body)


def test_a_tombstone_with_a_wildcard_nuid_is_dangerous_while_the_bucket_holds_no_chunks_yet():
    """Its danger is the chunks stored later: nats.go's Delete of the name purges `$O.b.C.*` whenever it
    comes. So fsck reports it (and rewrites it) in a bucket with no chunk yet too, instead of calling
    the bucket clean."""
    async def body(ms, store, clock):
        doc = {"name": "bomb", "bucket": "b", "nuid": "*", "size": 0, "chunks": 0, "deleted": True}
        await ms.publish(meta_subject("b", "bomb"), json.dumps(doc).encode(), {ROLLUP: "sub"})
        report = await fsck.check_bucket(store, "b")
        assert kinds(report, left=True) == [(fsck.SHARED_TOMBSTONE, "bomb")]
        assert "the chunks of every object in the bucket (none now)" in report.findings[0].detail
        report = await fsck.check_bucket(store, "b", repair=True)
        assert report.problems_left == [] and all(f.repaired for f in report.findings)
        assert (await fsck.check_bucket(store, "b")).findings == []
        # Objects stored since, then nats.js's put of the tombstone's name: only its fresh nuid goes.
        await put_object(ms, "b", "later", b"later bytes" * 300, chunk_size=CHUNK)
        await js_put_object(ms, "b", "bomb", b"theirs")
        assert await read(store, "later") == b"later bytes" * 300

    run(body)


def test_a_meta_a_mount_skips_but_nats_go_reads_with_a_wildcard_nuid_is_rewritten_too():
    """A meta a mount skips (its size claims bytes its zero chunks cannot hold) is still read by nats.go,
    whose Delete of that name would purge `$O.b.C.*` for its nuid `*`. fsck reports it as a bad meta that
    `--repair` rewrites as a mount does (every other field kept, a fresh nuid): still a bad meta after,
    and nats.go's Delete then purges only the fresh nuid."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "good", b"good bytes", chunk_size=CHUNK)
        fields = {"name": "odd", "bucket": "b", "nuid": "*", "size": 5, "chunks": 0, "description": "odd"}
        await ms.publish(meta_subject("b", "odd"), json.dumps(fields).encode(), {ROLLUP: "sub"})
        report = await fsck.check_bucket(store, "b")
        [bad] = [f for f in report.findings if f.kind == fsck.BAD_META]
        assert bad.repairable and "would purge" in bad.detail
        chunks = {s: n for s, n in ms.subjects(stream_name("b")).items() if ".C." in s}
        report = await fsck.check_bucket(store, "b", repair=True)
        [bad] = [f for f in report.findings if f.kind == fsck.BAD_META]
        assert bad.repaired
        doc = json.loads((await ms.last_msg(stream_name("b"), meta_subject("b", "odd"))).data)
        assert usable_nuid(doc["nuid"]) and {k: v for k, v in doc.items() if k != "nuid"} == \
            {k: v for k, v in fields.items() if k != "nuid"}
        report = await fsck.check_bucket(store, "b")
        [bad] = [f for f in report.findings if f.kind == fsck.BAD_META]
        assert not bad.repairable  # (still skipped by a mount, no longer dangerous)
        await delete_object(ms, "b", "odd")
        assert {s: n for s, n in ms.subjects(stream_name("b")).items() if s in chunks} == chunks
        assert await read(store, "good") == b"good bytes"

    run(body)


def test_a_wildcard_nuid_rewritten_before_the_repair_is_read_back():
    """Between the check and its repair (the repair's rewrite expects the revision read) the name's meta
    changed: the same meta on a fresh nuid (a mount's rewrite, another fsck's) is repaired all the same;
    another client's meta without a wildcard nuid makes the finding void (changed while checked); one
    with a wildcard nuid again is a repair that failed, still a problem."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "good", b"good bytes", chunk_size=CHUNK)
        for name in ("mounts", "theirs", "again"):
            doc = {"name": name, "bucket": "b", "size": 0, "chunks": 0, "nuid": "*", "metadata": {"k": "v"}}
            await ms.publish(meta_subject("b", name), json.dumps(doc).encode(), {ROLLUP: "sub"})
        defuse = store.defuse_wildcard_nuid

        async def meanwhile(bucket: str, name: str, revision: int, *args, **kwargs):
            if name == "mounts":
                assert await ObjectStore(ms).defuse_wildcard_nuid(bucket, name, revision) is not None
            else:  # (another client's empty object: on a usable nuid, or on a wildcard one again)
                doc = {"name": name, "bucket": "b", "size": 0, "chunks": 0,
                       "nuid": new_nuid() if name == "theirs" else ">"}
                await ms.publish(meta_subject("b", name), json.dumps(doc).encode(), {ROLLUP: "sub"})
            return await defuse(bucket, name, revision, *args, **kwargs)

        store.defuse_wildcard_nuid = meanwhile
        report = await fsck.check_bucket(store, "b", repair=True)
        assert kinds(report) == [(fsck.WILDCARD_META, "again"), (fsck.WILDCARD_META, "mounts")]
        assert kinds(report, left=True) == [(fsck.WILDCARD_META, "again")]
        found = {f.where: f for f in report.findings}
        assert found["mounts"].repaired and "read back" in found["mounts"].detail
        assert "repair failed" in found["again"].detail
        assert report.changed == 1

    run(body)


def test_an_alias_with_a_wildcard_nuid_on_a_subject_nats_go_reads_by_name_is_rewritten_in_place():
    """nats.go's Put(X) and Delete(X) read whatever meta X's subject holds (`GetInfo` never checks its name)
    and purge its nuid: an alias there (named Y; skipped by a mount, or shown when the token is no UTF-8
    name's) with a wildcard nuid is a danger; `--repair` rewrites it in place, every other field kept
    (its own name too). An alias on an unpadded subject, which no name's subject is, stays a note."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "good", b"good bytes", chunk_size=CHUNK)
        written = {meta_subject("b", "x"): {"name": "y", "nuid": "*", "description": "kept"},
                   "$O.b.M.__4=": {"name": "w", "nuid": ">"},
                   meta_subject("b", "t"): {"name": "u", "nuid": "*", "deleted": True},
                   meta_subject("b", "alias").rstrip("="): {"name": "v", "nuid": "*"}}
        for subject, fields in written.items():
            doc = {"name": "", "bucket": "b", "size": 0, "chunks": 0} | fields
            await ms.publish(subject, json.dumps(doc).encode(), {ROLLUP: "sub"})
        report = await fsck.check_bucket(store, "b")
        dangers = sorted(f.where for f in report.problems_left if f.repairable)
        assert dangers == sorted(list(written)[:3])
        chunks = {s: n for s, n in ms.subjects(stream_name("b")).items() if ".C." in s}
        report = await fsck.check_bucket(store, "b", repair=True)
        assert all(f.repaired for f in report.findings if f.repairable)
        for subject, fields in written.items():
            doc = json.loads((await ms.last_msg(stream_name("b"), subject)).data)
            assert (doc["nuid"] == "*") == subject.endswith("YWxpYXM"), subject
            assert {**doc, "nuid": fields["nuid"]} == {"name": "", "bucket": "b", "size": 0, "chunks": 0} | fields
        report = await fsck.check_bucket(store, "b")
        assert [f for f in report.findings if f.repairable] == []
        await delete_object(ms, "b", "x")
        await js_put_object(ms, "b", "t", b"theirs")
        assert {s: n for s, n in ms.subjects(stream_name("b")).items() if s in chunks} == chunks
        assert await read(store, "good") == b"good bytes"

    run(body)


@pytest.mark.parametrize("odd", [{"description": ""}, {"headers": {}}, {"Metadata": {"k": "w"}},
                                 {"options": None}])
def test_a_rewrite_read_back_is_repaired_whatever_the_original_meta_held_that_it_drops(odd):
    """A mount's rewrite stores the meta as nats.go writes it (an empty field left out, a case variant of a
    key under its own name): read back by the repair, that is still the same meta on a fresh nuid."""
    async def body(ms, store, clock):
        await put_object(ms, "b", "good", b"good bytes", chunk_size=CHUNK)
        doc = {"name": "mounts", "bucket": "b", "size": 0, "chunks": 0, "nuid": "*", "metadata": {"k": "v"}} | odd
        await ms.publish(meta_subject("b", "mounts"), json.dumps(doc).encode(), {ROLLUP: "sub"})
        defuse = store.defuse_wildcard_nuid

        async def meanwhile(bucket: str, name: str, revision: int, *args, **kwargs):
            assert await ObjectStore(ms).defuse_wildcard_nuid(bucket, name, revision) is not None
            return await defuse(bucket, name, revision, *args, **kwargs)

        store.defuse_wildcard_nuid = meanwhile
        report = await fsck.check_bucket(store, "b", repair=True)
        found = {f.where: f for f in report.findings}
        assert found["mounts"].repaired and "read back" in found["mounts"].detail, found["mounts"].detail
        assert report.changed == 0 and kinds(report, left=True) == []

    run(body)
