"""`natsfs fsck BUCKET [--repair] [--verify]`: find (and fix what can be fixed without guessing) what
interrupted writers and hostile clients leave in an ADR-20 bucket.

Owns the bucket check and its report. What it looks at, in one pass:
- every meta subject's last message (a last-per-subject watch): metas that do not parse, fields of
  live metas a mount ignores (a POSIX attribute out of its type's range, `metadata` that is not a JSON
  object, ...: see `adr20.parse_meta`), names no client can use (a subject token that is not base64 of
  UTF-8, subjects over `max_subject_bytes`), and,
  as a note that is no problem, names a mount cannot show (`natsfs.names`: hidden there);
- which objects there are, by the rule a mount's index follows (`natsfs.index`, "One subject per
  name"): a name's meta on its canonical subject, or, while that subject holds nothing (neither a live
  meta nor a tombstone), its newest live alias (a meta under another subject: unpadded base64 of an
  old client, a token that is not base64). Every other alias is HIDDEN: no object of its own (not
  counted, its chunks not checked, it makes no name share a nuid), a note naming its subject, and,
  like every meta that is not a tombstone, it keeps its chunks from being orphans while it exists.
  Tombstones are counted on canonical subjects only (an alias's tombstone deletes only that alias);
- every chunk subject (the stream's per-subject counts): a chunk subject that no meta references is an
  ORPHAN (an interrupted put, or a purge that never happened) unless its newest message is younger
  than `grace_s` (default 300 s): then it is a put IN PROGRESS (a live mount sends chunks before the
  meta; a put never pauses that long between chunks while it runs) and left alone;
- every live object's chunks (of the metas a mount shows; headers-only scan, placed by
  `chunk_cache.place_checking_gaps`, as reads use): chunks missing, or not adding up to the meta's size
  and count;
- names sharing a live object's nuid: a TOMBSTONE carrying a live nuid (other clients' Delete or Put
  of that name purge the nuid, destroying the live object) and two live names on one nuid (a rename
  interrupted between its steps); and, as a note, a tombstone carrying only the nuid of a hidden alias
  (the holders a mount keeps chunks for, `BucketIndex.hidden_alias_holders`): other clients' Delete or
  Put of its name would purge that alias's chunks, but a hidden alias names no object, so it makes no
  tombstone dangerous (as in a mount: nothing is repaired for it);
- metas whose nuid holds a wildcard (`*`, `>`: `adr20.wildcard_nuid`) on a name's canonical subject, where
  other clients' Delete or Put of the name would purge `$O.<bucket>.C.*`, every chunk of the bucket: a
  tombstone's (when the bucket holds chunks), a live meta's or a link's (always);
- with `verify`, every intact object's bytes against its meta's SHA-256 digest.

The check runs against a bucket live mounts are using, and everything above starts from one snapshot of
the metas, so no finding is reported from a meta that has since changed: an object whose chunks look
wrong has its meta read again before it is reported, and when it was rewritten (or deleted) meanwhile
the finding is void and the new version is checked instead (a name rewritten `VERSIONS` times while
being checked is noted as changing, not checked); every other finding derived from metas is dropped
when one of the metas it came from changed by the time the metas are read a second time (after the
chunk subjects are checked; that read also turns orphans a meta now references into puts in progress).
Voided findings are counted in the summary ("changed while checked"), not reported.

`repair` purges orphan chunk subjects (checked young again just before), neutralises tombstones carrying
a live nuid by purging the tombstone's meta subject up to its revision (a newer meta stays), and rewrites
metas with a wildcard nuid on a fresh nuid expecting the revision read, as a mount does
(`ObjectStore.defuse_wildcard_nuid`: every other field kept, a link its target), all only once the
second read of the metas confirmed them. Everything else (damaged objects, shared live
names, bad names, digest mismatches) is reported and left alone: fixing it would mean guessing which
bytes or which name are right. Live objects are never touched otherwise.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from .adr20 import (
    ObjectInfo,
    ObjectStore,
    alias_wildcard_nuid,
    chunk_subject,
    decode_token,
    defused,
    format_digest,
    load_meta,
    meta_doc_of,
    meta_subject,
    parse_digest,
    parse_meta,
    skipped_wildcard_nuid,
    stream_name,
    wildcard_nuid,
)
from .chunk_cache import place_checking_gaps
from .errors import Conflict, MalformedMeta, NameTooLong, NatsFSError, StoredButSkipped
from .names import placement
from .streams import StoredMsg, literal_subject

GRACE_S = 300.0
# Objects checked at once (each one headers-only scan of its chunks; `--verify` reads them too).
PARALLEL = 8
# Versions of one name checked before it is noted as changing (each found wrong, then found replaced).
VERSIONS = 3

# Kinds of finding. Problems are everything but the NOTES.
ORPHAN = "orphan chunks"
IN_PROGRESS = "put in progress"
HIDDEN = "name a mount cannot show"
ALIAS = "hidden alias"
DAMAGED = "damaged object"
SHARED_TOMBSTONE = "tombstone sharing a live nuid"
WILDCARD_META = "live meta with a wildcard nuid"
ALIAS_TOMBSTONE = "tombstone sharing a hidden alias's nuid"
SHARED_NAMES = "names sharing one nuid"
BAD_NAME = "unusable name"
BAD_META = "unreadable meta"
BAD_FIELD = "ignored meta field"
DIGEST = "digest mismatch"
CHANGING = "changing, not checked"
NOTES = (IN_PROGRESS, HIDDEN, ALIAS, ALIAS_TOMBSTONE, CHANGING)


@dataclass
class Finding:
    kind: str
    where: str  # the object name or chunk subject concerned
    detail: str
    repairable: bool = False
    repaired: bool = False
    # The metas (subject -> the sequence of its last message) the finding was derived from: it is void
    # when one of them changed before the metas are read again (`check_bucket`).
    basis: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def line(self) -> str:
        state = " [repaired]" if self.repaired else " [repairable: --repair]" if self.repairable else ""
        return f"{self.kind}: {self.where}: {self.detail}{state}"


@dataclass
class Report:
    bucket: str
    objects: int = 0
    tombstones: int = 0
    chunk_subjects: int = 0
    aliases: int = 0  # alias meta subjects a mount does not show (see `check_bucket`)
    changed: int = 0  # findings found void: their object or meta changed while the check ran
    findings: list[Finding] = field(default_factory=list)

    @property
    def problems_left(self) -> list[Finding]:
        return [f for f in self.findings if f.kind not in NOTES and not f.repaired]

    def summary(self) -> str:
        counts: dict[str, int] = defaultdict(int)
        for f in self.findings:
            counts[f.kind + (" (repaired)" if f.repaired else "")] += 1
        head = (f"{self.bucket}: {self.objects} objects, {self.tombstones} tombstones, "
                + (f"{self.aliases} hidden aliases, " if self.aliases else "")
                + f"{self.chunk_subjects} chunk subjects"
                # (Counted before the colon: what follows it, "clean" or the findings, stays as it was.)
                + (f", {self.changed} changed while checked" if self.changed else ""))
        if not counts:
            return head + ": clean"
        return head + ": " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


class Progress(Protocol):
    """Where the check reports how far it is (a progress bar on a terminal)."""

    def start(self, label: str, total: int) -> None: ...

    def advance(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class _NoProgress:
    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


async def _meta_messages(store: ObjectStore, bucket: str) -> list[StoredMsg]:
    """The last message of every meta subject, tombstones included."""
    watch = await store.watch_metas(bucket)
    out: dict[str, StoredMsg] = {}
    try:
        while True:
            batch = await watch.next_batch(timeout=5.0)
            if batch.reset:
                out.clear()
            for m in batch.msgs:
                out[m.subject] = m
            if batch.caught_up:
                return list(out.values())
    finally:
        await watch.close()


def _doc_nuid(msg: StoredMsg) -> tuple[str, bool] | None:
    """(nuid, deleted) from a meta's JSON, even one `parse_meta` refuses; None when there is none."""
    # (As nats.go reads it, `NUID` or `nuid`, the last one; else as leniently as Python reads it: chunks a
    # meta nats.go cannot read names are still no orphans.)
    doc: Any = meta_doc_of(msg.data)
    if doc is None:
        try:
            doc = json.loads(msg.data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
    if not isinstance(doc, dict) or not isinstance(doc.get("nuid"), str) or not doc["nuid"]:
        return None
    # (Only a real `true` is a tombstone: `"deleted": "false"` makes a meta nats.go cannot read, whose
    # chunks are still not orphans.)
    return doc["nuid"], doc.get("deleted") is True


async def check_bucket(store: ObjectStore, bucket: str, *, repair: bool = False, verify: bool = False,
                       grace_s: float = GRACE_S, progress: Progress | None = None,
                       clock: Callable[[], int] = time.time_ns) -> Report:
    """Check one bucket (see the module docstring); with `repair`, fix what can be fixed safely."""
    progress = progress or _NoProgress()
    stream = stream_name(bucket)
    await store.bucket_status(bucket)  # NotFound for a bucket that does not exist
    report = Report(bucket)

    def reach_of(nuid: str) -> str:
        return f"$O.{bucket}.C.{nuid}: every chunk in the bucket" if nuid in ("*", ">") else \
            f"every chunk subject $O.{bucket}.C.{nuid} matches"

    metas = await _meta_messages(store, bucket)
    read_first = {m.subject: m.data for m in metas}  # (what a repair's rewrite is read back against)
    # By meta subject, not by name: a name's meta under an alias subject (unpadded base64 of an old
    # client) is another meta, and must not hide what the canonical subject holds.
    canonical: dict[str, ObjectInfo] = {}  # name -> the live meta on its canonical subject
    aliases: dict[str, dict[str, ObjectInfo]] = defaultdict(dict)  # name -> {alias subject: meta}
    tombstones: dict[str, tuple[ObjectInfo, str]] = {}  # subject -> (info, the subject)
    ignored_fields: dict[str, list[str]] = {}  # subject -> the fields of its live meta a mount ignores
    referenced: set[str] = set()  # nuids a meta that is not a tombstone names
    # (finding, name, subject, revision) of metas nats.go reads by a name whose nuid is a wildcard, which a
    # mount skips, or which are aliases (on another name's subject: rewritten there, `defuse_wildcard_alias`).
    skipped_wildcards: list[tuple[Finding, str, str, int]] = []
    for m in metas:
        token = m.subject.rsplit(".", 1)[-1]
        held = _doc_nuid(m)
        if held is not None and not held[1]:
            referenced.add(held[0])
        ignored: list[str] = []
        try:
            info = parse_meta(bucket, m, ignored.append)
        except MalformedMeta as e:
            why = str(e)
            if held is not None and wildcard_nuid(held[0]):
                why += (f"; another client's Put or Delete of this name would purge $O.{bucket}.C.{held[0]}: "
                        "every chunk in the bucket")
            wild = skipped_wildcard_nuid(bucket, m)  # (nats.go reads it: a repair rewrites it as a mount does)
            alias = alias_wildcard_nuid(bucket, m) if wild is None else None
            if alias is not None:
                why += (f"; another client's Put or Delete of the name this subject is for would purge "
                        f"{reach_of(alias[1])}")
            f = Finding(BAD_META, m.subject, why, repairable=wild is not None or alias is not None,
                        basis={m.subject: m.seq})
            report.findings.append(f)
            if wild is not None:
                skipped_wildcards.append((f, wild[0], m.subject, m.seq))
            elif alias is not None:
                skipped_wildcards.append((f, alias[0], m.subject, m.seq))
            continue
        if decode_token(token) is None:
            report.findings.append(Finding(BAD_NAME, info.name, "its meta subject is not base64 of UTF-8",
                                           basis={m.subject: m.seq}))
        else:
            try:
                store.check_name(bucket, info.name)
            except NameTooLong as e:
                report.findings.append(Finding(BAD_NAME, info.name[:60] + "...", str(e), basis={m.subject: m.seq}))
        if m.subject != meta_subject(bucket, info.name):
            aliases[info.name][m.subject] = info
            if info.wildcard_nuid and (alias := alias_wildcard_nuid(bucket, m)) is not None:
                f = Finding(WILDCARD_META, m.subject, f"an alias of {_short(info.name)!r} carrying the nuid "
                            f"{alias[1]!r}, a wildcard: another client's Put or Delete of the name this subject "
                            f"is for would purge {reach_of(alias[1])}", repairable=True,
                            basis={m.subject: m.seq})
                report.findings.append(f)
                skipped_wildcards.append((f, info.name, m.subject, m.seq))
        elif not info.deleted:
            canonical[info.name] = info
        if info.deleted:
            tombstones[m.subject] = (info, m.subject)
        else:
            ignored_fields[m.subject] = ignored
    # What a mount shows (`natsfs.index`): a name's canonical meta; while its canonical subject holds
    # nothing (neither a live meta nor a tombstone), its newest live alias. Every other alias is hidden:
    # no object of its own, but its chunks are kept while it exists (they are `referenced`).
    canonical_tombstones = {i.name for i, subject in tombstones.values() if subject == meta_subject(bucket, i.name)}
    shown: dict[str, tuple[str, ObjectInfo]] = {n: (meta_subject(bucket, n), i) for n, i in canonical.items()}
    hidden_aliases = 0
    hidden_live: dict[tuple[str, str], ObjectInfo] = {}  # (alias subject, name) -> its live meta, not shown
    for name, held_by in aliases.items():
        live_ones = [(subject, i) for subject, i in held_by.items() if not i.deleted]
        if name not in canonical and name not in canonical_tombstones and live_ones:
            shown[name] = max(live_ones, key=lambda si: si[1].revision)
        for subject, info in held_by.items():
            if shown.get(name, ("", None))[0] == subject:
                continue
            hidden_aliases += 1
            if not info.deleted:
                hidden_live[(subject, name)] = info
                holder = "a live meta" if name in canonical else "a tombstone"
                report.findings.append(Finding(ALIAS, subject, f"a meta of {_short(name)!r} that a mount does not "
                                               f"show (its canonical subject holds {holder}); its chunks "
                                               f"(nuid {info.nuid}) are kept while it exists",
                                               basis={subject: info.revision}))
    for subject, info in shown.values():
        report.findings.extend(Finding(BAD_FIELD, info.name, why, basis={subject: info.revision})
                               for why in ignored_fields.get(subject, ()))
        if placement(info.name, marker_candidate=info.size == 0)[0] is None:
            report.findings.append(Finding(HIDDEN, _short(info.name) or "''",
                                           "the empty name (no file name is empty)" if not info.name else
                                           "no path segment may be empty, '.', '..' or over 255 bytes, and "
                                           "escaped it is still over 255 bytes (other clients can use it)",
                                           basis={subject: info.revision}))
    live = {name: info for name, (_, info) in shown.items()}
    report.objects, report.tombstones, report.aliases = len(live), len(canonical_tombstones), hidden_aliases

    # Names sharing a nuid (hidden aliases name no object: they make no name "shared", as in a mount).
    by_nuid: dict[str, list[ObjectInfo]] = defaultdict(list)
    for info in live.values():
        if info.nuid and info.link is None:
            by_nuid[info.nuid].append(info)
    for nuid, infos in by_nuid.items():
        if len({i.name for i in infos}) > 1:
            names = ", ".join(sorted({i.name for i in infos}))
            report.findings.append(Finding(SHARED_NAMES, names, f"live names share nuid {nuid} (an interrupted "
                                           "rename?): deleting one with another client destroys the others",
                                           basis={shown[i.name][0]: i.revision for i in infos}))
    dangerous: list[tuple[Finding, str, int]] = []  # (finding, tombstone subject, its revision)
    # (finding, name, revision) of metas whose wildcard nuid a repair rewrites on a fresh one.
    wildcards: list[tuple[Finding, str, str, int]] = list(skipped_wildcards)
    chunked = sorted(i.name for i in live.values() if i.nuid and i.link is None)
    others = f" ({_short(chunked[0])!r} and {len(chunked) - 1} more)" if chunked else " (none now)"

    def reach(nuid: str) -> str:
        if nuid in ("*", ">"):
            return f"the chunks of every object in the bucket{others}"
        return f"every chunk subject $O.{bucket}.C.{nuid} matches"

    for subject, info in shown.values():
        if info.wildcard_nuid and subject == meta_subject(bucket, info.name):
            # (A mount reads it as it would without that nuid, and rewrites it on a fresh one.)
            what = "a link" if info.link is not None else \
                f"an object (its {info.size} bytes never readable)" if info.size else "an empty object"
            f = Finding(WILDCARD_META, info.name, f"{what} carrying the nuid {info.wildcard_nuid!r}, a wildcard: "
                        f"a Delete or Put of this name by another client would purge {reach(info.wildcard_nuid)}",
                        repairable=True, basis={subject: info.revision})
            report.findings.append(f)
            wildcards.append((f, info.name, subject, info.revision))
    for t, subject in tombstones.values():
        wildcard = t.wildcard_nuid
        if wildcard and subject == meta_subject(bucket, t.name):
            # (A mount ignores such a nuid; nats.go's Delete and nats.js's put of the name purge
            # `$O.<bucket>.C.` + nuid, which this one makes a filter matching every chunk subject.)
            f = Finding(SHARED_TOMBSTONE, t.name, f"carries the nuid {wildcard!r}, a wildcard: a Delete or Put of "
                        f"this name by another client would purge {reach(wildcard)}", repairable=True,
                        basis={subject: t.revision})
            report.findings.append(f)
            wildcards.append((f, t.name, subject, t.revision))
            continue
        # (A live meta of the same name under another subject is no other owner: purging this
        # tombstone would only bring that name back.)
        owners = [i.name for i in by_nuid.get(t.nuid, ()) if i.name != t.name] if t.nuid else []
        if not owners:
            holders = [key for key, alias in hidden_live.items() if t.nuid and alias.nuid == t.nuid]
            if holders:
                alias_subject, name = holders[0]
                alias_revision = hidden_live[holders[0]].revision
                report.findings.append(Finding(
                    ALIAS_TOMBSTONE, t.name,
                    f"carries the nuid of {alias_subject}, a hidden alias of {_short(name)!r}: a Delete or Put of "
                    "this name by another client would purge the chunks that alias names (a mount keeps them "
                    "while it exists); left alone, as a mount does: a hidden alias names no object, and purging "
                    "the tombstone could bring a name back from an alias",
                    basis={subject: t.revision, alias_subject: alias_revision}))
            continue
        owner = owners[0]
        owner_subject, owner_info = shown[owner]
        f = Finding(SHARED_TOMBSTONE, t.name, f"carries the nuid of live {owner!r}: a Delete or Put of this name "
                    f"by another client would purge its chunks", repairable=True,
                    basis={subject: t.revision, owner_subject: owner_info.revision})
        report.findings.append(f)
        dangerous.append((f, subject, t.revision))

    # Chunk subjects.
    counts, _, _ = await store.streams.subject_counts(stream, f"$O.{bucket}.C.>")
    report.chunk_subjects = len(counts)
    prefix = f"$O.{bucket}.C."
    unreferenced = [s for s in counts if s[len(prefix):] not in referenced]
    progress.start("chunk subjects", len(unreferenced))
    orphans: list[tuple[Finding, StoredMsg]] = []
    for subject in unreferenced:
        found = await _check_orphan(store, report, stream, subject, counts[subject], grace_s, clock)
        if found is not None:
            orphans.append(found)
        progress.advance()
    stale: set[int] = set()  # findings found void (by id)
    if orphans or any(f.basis for f in report.findings):
        # Read the metas again: a finding derived from a meta that changed since is void (another
        # client rewrote, renamed or deleted it meanwhile), and a meta stored since makes its chunks
        # no orphans.
        again = await _meta_messages(store, bucket)
        now = {m.subject: m.seq for m in again}
        stale = {id(f) for f in report.findings if any(now.get(s) != seq for s, seq in f.basis.items())}
        report.changed += len(stale)
        report.findings = [f for f in report.findings if id(f) not in stale]
        now_referenced = {held[0] for m in again if (held := _doc_nuid(m)) is not None and not held[1]}
        for f, newest in orphans:
            if f.where[len(prefix):] in now_referenced:
                f.kind, f.repairable, f.detail = IN_PROGRESS, False, "a meta referencing them was just stored"
            elif repair:
                # Only what existed when it was found old: a message stored since stays.
                await _repair(f, store.streams.purge_subject(stream, f.where, before_seq=newest.seq + 1))
    if repair:
        for f, subject, revision in dangerous:
            if id(f) not in stale:
                # Up to the tombstone's revision: a meta stored under the name since stays.
                await _repair(f, store.streams.purge_subject(stream, subject, before_seq=revision + 1))
        for f, name, subject, revision in wildcards:
            if id(f) in stale:
                continue
            # Expecting the revision read, as a mount does: a meta stored under the name since stays.
            if not await _repair(f, _rewrite_wildcard_nuid(store, bucket, name, subject, revision,
                                                           read_first[subject])):
                report.changed += 1  # (read back: another meta, no wildcard nuid: changed while checked)
                report.findings.remove(f)

    # Live objects: chunks and sizes (and digests).
    # (A live object with a wildcard nuid has no chunks of its own to check: it is reported above.)
    objects = [(subject, i) for subject, i in shown.values() if i.link is None and i.chunks > 0 and i.nuid]
    progress.start("objects", len(objects))
    limit = trio.Semaphore(PARALLEL)

    async def check(subject: str, info: ObjectInfo) -> None:
        try:
            await _check_object(store, report, subject, info, counts.get(chunk_subject(bucket, info.nuid), 0),
                                verify)
            progress.advance()
        finally:
            limit.release()

    async with trio.open_nursery() as nursery:
        for subject, info in objects:
            await limit.acquire()  # held by the task: no more tasks than run at once
            nursery.start_soon(check, subject, info)
    progress.close()
    report.findings.sort(key=lambda f: (f.kind, f.where))
    return report


def _short(name: str) -> str:
    return name[:60] + ("..." if len(name) > 60 else "")


async def _repair(finding: Finding, action: Awaitable[str | None]) -> bool:
    """Run one repair; a refusal (a sealed bucket, `deny_purge`) is noted on the finding, and the
    check goes on. An action may note how it was done (returned), or find the finding void (False)."""
    try:
        how = await action
    except _Void:
        return False
    except NatsFSError as e:
        finding.detail += f" (repair failed: {e})"
        return True
    if how:
        finding.detail += f" ({how})"
    finding.repaired = True
    return True


class _Void(Exception):
    """(`_repair`) The meta a finding came from changed, and the problem with it: no finding any more."""


async def _rewrite_wildcard_nuid(store: ObjectStore, bucket: str, name: str, subject: str, revision: int,
                                 read: bytes | bytearray) -> str | None:
    """The mount's rewrite of a meta with a wildcard nuid (`ObjectStore.defuse_wildcard_nuid`), `read` at
    `revision`. Refused (the name holds another revision now), the name's meta is read back: the same
    meta on a fresh nuid is this very rewrite, made meanwhile by a mount (or another fsck): repaired all
    the same. Another meta without a wildcard nuid makes the finding void (`_Void`: changed while
    checked); one with a wildcard nuid again is a repair that failed (`Conflict`), still a danger."""
    alias = subject != meta_subject(bucket, name)  # (rewritten in place, on that subject)
    try:
        if alias and await store.defuse_wildcard_alias(bucket, subject, revision) is not None:
            return None
        if not alias and await store.defuse_wildcard_nuid(bucket, name, revision) is not None:
            return None
    except StoredButSkipped:
        return None  # (a meta a mount skips, rewritten with its other fields kept: stored, and skipped as before)
    try:
        now = await store.get_meta_doc(bucket, name, subject)
    except MalformedMeta:
        raise _Void() from None  # (not JSON now: neither this rewrite, nor a wildcard nuid)
    if now is not None and defused(load_meta(read)[0], now[0]):
        return "rewritten meanwhile by a mount or another fsck: read back"
    if now is None or not wildcard_nuid(now[0].get("nuid")):
        raise _Void()
    raise Conflict(f"{bucket}/{name} changed since it was read")


async def _check_orphan(store: ObjectStore, report: Report, stream: str, subject: str, count: int, grace_s: float,
                        clock: Callable[[], int]) -> tuple[Finding, StoredMsg] | None:
    """An unreferenced chunk subject: a put in progress when its newest chunk is young, else orphans
    (returned with that newest chunk, for a repair). One under a wildcard subject (`$O.b.C.>`, which
    another client can publish to) is never purged: a purge by it would remove every chunk it matches."""
    if not literal_subject(subject):
        report.findings.append(Finding(ORPHAN, subject, f"{count} chunks under a wildcard subject, which no "
                                       "nuid names; left alone: a purge by this subject would remove every "
                                       "chunk subject it matches (delete its messages by sequence)"))
        return None
    newest = await store.streams.last_msg(stream, subject)
    if newest is None:
        return None  # purged meanwhile
    age = (clock() - newest.time_ns) / 1e9
    if age < grace_s:
        report.findings.append(Finding(IN_PROGRESS, subject, f"{count} chunks, the newest {age:.0f}s old "
                                       f"(younger than {grace_s:g}s: left alone)"))
        return None
    f = Finding(ORPHAN, subject, f"{count} chunks no meta references, the newest {age:.0f}s old", repairable=True)
    report.findings.append(f)
    return f, newest


async def _check_object(store: ObjectStore, report: Report, subject: str, info: ObjectInfo, count: int,
                        verify: bool) -> None:
    """Check one live object (shown from meta `subject`); a finding is reported only when the meta is
    still the one checked: a live mount replaces a version's chunks (new nuid, the old ones purged after
    the meta) while the check runs, so a version found wrong but since replaced proves nothing. The new
    version is checked instead, up to `VERSIONS` versions."""
    for attempt in range(VERSIONS):
        # (The chunk subjects were counted before: a new version's chunks are not in those counts.)
        finding = await _check_version(store, info, count if attempt == 0 else None, verify)
        if finding is None:
            return
        current = await _current_version(store, info.bucket, info.name, subject)
        if current is not None and current.revision == info.revision:
            report.findings.append(finding)
            return
        if attempt == 0:
            report.changed += 1
        if current is None or current.deleted or current.link is not None or current.chunks == 0:
            return  # deleted, or nothing left to check
        info = current
    report.findings.append(Finding(CHANGING, info.name, f"rewritten while checked, {VERSIONS} versions in a row "
                                   "(run fsck again when it is quiet)"))


async def _current_version(store: ObjectStore, bucket: str, name: str, subject: str) -> ObjectInfo | None:
    """What meta `subject` holds now, as the version a mount shows of `name`; None when it holds nothing
    or nothing readable, or when it is an alias and the name's canonical subject now holds a meta (which
    a mount shows instead)."""
    canonical = meta_subject(bucket, name)
    if subject != canonical and await store.streams.last_msg(stream_name(bucket), canonical) is not None:
        return None
    msg = await store.streams.last_msg(stream_name(bucket), subject)
    if msg is None:
        return None
    try:
        return parse_meta(bucket, msg)
    except MalformedMeta:
        return None


async def _check_version(store: ObjectStore, info: ObjectInfo, count: int | None, verify: bool) -> Finding | None:
    """What is wrong with one version's chunks (`count`: how many its chunk subject held when the
    chunk subjects were counted; None: not known), or None."""
    present = await store.chunk_index(info.bucket, info.nuid) if count is None or count else []
    placed = await place_checking_gaps(store, info, [], present)
    if not placed.intact:
        return Finding(DAMAGED, info.name, "; ".join(placed.problems) + f" ({placed.unreadable} bytes unreadable)")
    if not verify:
        return None
    want = parse_digest(info.digest)
    if want is None:
        return Finding(DIGEST, info.name, f"unreadable digest {info.digest[:40]!r}") if info.digest else None
    got = await _digest(store, info, placed.slots)
    if got is None:
        return Finding(DAMAGED, info.name, "chunks vanished while being verified")
    if got != want:
        return Finding(DIGEST, info.name, f"the bytes hash to {format_digest(got)}, the meta says {info.digest}")
    return None


async def _digest(store: ObjectStore, info: ObjectInfo, slots: list[tuple[int, int]]) -> bytes | None:
    """SHA-256 of the object's chunks, fetched in order from the first one's sequence; None when they
    vanished meanwhile (purged: the object was rewritten or deleted, or its chunks were lost)."""
    h = hashlib.sha256()
    seq = slots[0][0]
    left = len(slots)
    while left:
        msgs = await store.fetch_chunks(info.bucket, info.nuid, seq, min(left, 64), 8 << 20)
        msgs = [m for m in msgs if info.revision == 0 or m.seq < info.revision]
        if not msgs:
            return None
        for m in msgs:
            h.update(m.data)
        left -= len(msgs)
        seq = msgs[-1].seq + 1
    return h.digest()
