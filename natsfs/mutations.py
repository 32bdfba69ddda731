"""Everything that changes a bucket: uploads of staged files, deletes, directories, renames, attributes.

Each operation is the ADR-20 call (through `ObjectStore`) followed by applying its result to the
bucket's live index at once, so the mount sees its own changes without waiting for the watch (which
later delivers the same revisions and finds nothing new). Every meta rewrite carries the revision it
was based on, so a concurrent change by another client is refused (`Conflict`), never overwritten.

In the background it settles what puts left behind (`settle_puts`: the spool's `PutJournal` of puts
that failed, or whose meta's fate was unknown, or that a killed daemon left), purges tombstones that
carry a live object's nuid (`purge_shared_tombstones`) and rewrites metas whose nuid is a wildcard
(tombstones, live metas, links) on a fresh one (`defuse_wildcard_nuids`), once the server answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import trio

from .adr20 import (
    ABORT_CLEANUP_S,
    ATTR_MTIME,
    SMALL_PUT_MAX,
    BytesSource,
    ObjectInfo,
    ObjectStore,
    PosixAttrs,
    PutSession,
    check_same_object,
    chunk_subject,
    fields_but_nuid,
    format_digest,
    meta_json,
    metadata_of,
    set_posix_attrs,
    stream_name,
    usable_nuid,
    wildcard_reach,
)
from .config import Config
from .errors import (
    ERR_ACCOUNT_LIMITS_FOR_A_STREAM,
    ERR_STREAM_NAME_IN_USE,
    AlreadyExists,
    Conflict,
    JetStreamAPIError,
    MalformedMeta,
    MarkerShaped,
    NatsFSError,
    NoSpace,
    NotEmpty,
    NotFound,
    NotPermitted,
    ReadOnly,
    StoredButSkipped,
    Unavailable,
    single_error,
    single_errors,
)
from .index import BucketIndex, Dir, is_marker
from .names import placement
from .namespace import Namespace
from .staging import StagedFile, Staging, UnfinishedPut, WriteState

log = logging.getLogger(__name__)

Path = tuple[str, ...]
# A growing file's chunks are streamed to the server in batches of this many bytes.
STREAM_BATCH = 4 * 1024 * 1024
STREAM_PARALLEL = 3
RENAME_DIR_PARALLEL = 8  # objects of a directory renamed at once
# How long a check of a bucket's sealed state waits for the server when a state is known already (a server
# answers STREAM.INFO within milliseconds; one that is connected but stopped would cost the request
# timeout at every open for writing).
SEALED_REFRESH_WAIT_S = 0.25
# How often the unmount asks again whether the puts this run left are settled (`settle_at_unmount`).
UNMOUNT_SETTLE_POLL_S = 0.2


def _digest_of_file(fd: int, size: int) -> bytes:
    """SHA-256 of the first `size` bytes of a file (a hole at its end counts as zeros)."""
    hasher = hashlib.sha256()
    pos = 0
    while pos < size:
        data = os.pread(fd, min(1 << 20, size - pos), pos) or bytes(min(1 << 20, size - pos))
        hasher.update(data)
        pos += len(data)
    return hasher.digest()


def _nuid_rewritten(base: ObjectInfo, doc: dict[str, Any]) -> bool:
    """Whether `doc`, stored under the name after `base`, a file whose nuid was a wildcard, is `base` rewritten
    on a fresh nuid (`ObjectStore.defuse_wildcard_nuid`, by another mount or `natsfs fsck --repair`): every
    other field the same (`fields_but_nuid`), not another client's version (even of the same bytes)."""
    return (bool(base.wildcard_nuid) and base.link is None and (bool(base.digest) or not base.size)
            and doc.get("deleted") is not True
            and usable_nuid(str(doc.get("nuid") or "")) and doc.get("name") == base.name
            and fields_but_nuid(doc) == base.wildcard_fields)


# Times a rename is tried again after a rewrite of a wildcard nuid (of its source, of its target) landed
# between its read of the name and the publish that expects that revision (`Mutations.rename_object`).
_REWRITE_RETRIES = 3
# Names whose wildcard nuid one pass rewrites with a WARNING line each (per bucket); the rest of that
# pass's are summed up in one more line (`Mutations.defuse_wildcard_nuids`).
_DEFUSE_WARNINGS = 10
# Bytes a rename can add to a meta besides its longer name: `natsfs.mtime_ns` (see `_rename_change`) and
# `mtime` where the meta had none.
_MOVE_GROWTH = 128
# The most a meta can grow when written the nats.go way (`meta_json`): a character another client wrote
# as one byte (`<`) becomes a six-byte escape.
GO_ESCAPE_GROWTH = 6


def _rename_change(info: ObjectInfo, extra_metadata: dict[str, str] | None = None
                   ) -> Callable[[dict[str, Any]], None] | None:
    """What a rename changes in an object's meta besides its name: rename(2) keeps a file's mtime, but a
    new meta message gets a new timestamp, so a file keeps it as `natsfs.mtime_ns` (a directory marker's
    or link's new time is now). An object named `x/` with bytes is a file (shown as `x%2F`), not a marker.
    `extra_metadata` is set too (a moved symlink's signature, see `Filesystem._move_signatures`)."""
    keeps_mtime = info.link is None and not is_marker(info)
    if not keeps_mtime and not extra_metadata:
        return None
    mtime_ns = info.mtime_ns

    def change(doc: dict[str, Any]) -> None:
        metadata = metadata_of(doc)
        if keeps_mtime:
            metadata.setdefault(ATTR_MTIME, str(mtime_ns))
        metadata.update(extra_metadata or {})
        doc["metadata"] = metadata

    return change


def attempt_msg_id(msg_id: str, attempt: int) -> str:
    """The `Nats-Msg-Id` of one attempt of a write asked to carry `msg_id` ("": a fresh one): each attempt
    its own (a second one with the same id would be taken for a duplicate of the first and not stored),
    all of them recognisable by `is_attempt_of`."""
    return f"{msg_id}.{attempt}" if msg_id else ""


def is_attempt_of(stored_id: str | None, msg_id: str) -> bool:
    """Was `stored_id` (`ObjectStore.meta_msg_id`) published by an attempt of a write given `msg_id`?"""
    return bool(msg_id) and stored_id is not None and stored_id.rsplit(".", 1)[0] == msg_id


class Mutations:
    def __init__(self, namespace: Namespace, store: ObjectStore, staging: Staging, config: Config):
        self.ns = namespace
        self.store = store
        self.staging = staging
        self.config = config
        self.file_defaults = PosixAttrs(config.file_mode, config.uid, config.gid, None)
        self.dir_defaults = PosixAttrs(config.dir_mode, config.uid, config.gid, None)
        self._sealed: dict[str, tuple[float, bool]] = {}
        self._sealed_reads: dict[str, trio.Event] = {}  # a background read of a bucket's sealed state
        # Called with a bucket whose sealed state a read found changed (what was shown with the old
        # state, its write bits, is no longer true).
        self.on_sealed_changed: Callable[[str], None] | None = None
        namespace.on_sealed = self._remember_sealed  # (the watchers read it too, at no extra cost)
        self._nursery: trio.Nursery | None = None
        # Meta-only changes (attributes, xattrs) this mount is making itself, per (bucket, name), and an
        # event set whenever one ends: an upload finding such a change stored waits for it (`_upload`).
        self._own_meta: Counter[tuple[str, str]] = Counter()
        self._own_meta_ended = trio.Event()
        # (bucket, name) of the metas with a wildcard nuid rewritten so far, and how often (the first
        # rewrite of a name is one WARNING, the second one INFO line, later ones DEBUG: another client
        # storing such metas in a loop floods no log), and of those another client changed first (one
        # INFO line per name).
        self._defused: Counter[tuple[str, str]] = Counter()
        self._defuse_lost: set[tuple[str, str]] = set()
        # Called with (bucket, object info) after this mount changed an object itself.
        self.journal = staging.spool.journal
        store.put_log = self.journal
        store.nuid_users = self._nuid_users

    # ------------------------------------------------------------------ guards
    async def check_writable(self, bucket: str) -> None:
        if self.config.read_only:
            raise ReadOnly("this mount is read-only")
        if await self.sealed(bucket):
            raise ReadOnly(f"bucket {bucket} takes no writes: {self.store.read_only_reason(bucket) or 'sealed'}")

    async def sealed(self, bucket: str) -> bool:
        """Whether `bucket` is sealed: read again at most every `sealed_ttl`. While the server cannot be
        asked (no connection, or no answer within the request timeout), the last known state stands, so
        that creating or opening a file for writing never waits on an unreachable server: a close then
        fails as it would anyway (`EIO`), and a write-back upload of a bucket found sealed later goes
        to lost+found like any refused upload. The state its watch found when it started counts as
        known; only a bucket never asked about waits (at most the request timeout) and fails.

        With a known state, the read runs in the background (when a nursery is there) and is waited
        for at most `SEALED_REFRESH_WAIT_S`: a server that answers gives the fresh state, one that is
        connected but does not answer (stopped) costs that bound, not the request timeout, per open."""
        now = time.monotonic()
        cached = self._sealed.get(bucket)
        if cached is not None and now - cached[0] < self.config.sealed_ttl:
            return cached[1]
        if cached is None and (watched := self.ns.sealed_when_watched(bucket)) is not None:
            cached = (-math.inf, watched)  # what the bucket's watch found when it started: known, not fresh
        if cached is not None and not self.store.connected:
            return cached[1]
        if cached is None or self._nursery is None:
            return await self._read_sealed(bucket, known=cached)
        done = self._sealed_reads.get(bucket)
        if done is None:
            done = self._sealed_reads[bucket] = trio.Event()
            self._nursery.start_soon(self._read_sealed_in_background, bucket, cached, done)
        with trio.move_on_after(SEALED_REFRESH_WAIT_S):
            await done.wait()
        fresh = self._sealed.get(bucket)
        return fresh[1] if fresh is not None else cached[1]

    async def _read_sealed_in_background(self, bucket: str, known: tuple[float, bool],
                                         done: trio.Event) -> None:
        try:
            await self._read_sealed(bucket, known=known)
        except NatsFSError as e:
            log.debug("bucket %s: sealed state not read again (%s); the last known one stands", bucket, e)
        finally:
            self._sealed_reads.pop(bucket, None)
            done.set()

    async def _read_sealed(self, bucket: str, known: tuple[float, bool] | None) -> bool:
        """STREAM.INFO of the bucket, within the request timeout; the state it gives is remembered."""
        asked_at = time.monotonic()
        try:
            with trio.fail_after(self.config.request_timeout):
                sealed = bool((await self.store.bucket_status(bucket)).read_only)
        except NotFound:
            sealed = False
        except (Unavailable, trio.TooSlowError) as e:
            if known is None:
                if isinstance(e, trio.TooSlowError):
                    raise Unavailable(f"bucket {bucket}: no answer to STREAM.INFO within "
                                      f"{self.config.request_timeout:g}s") from None
                raise
            log.debug("bucket %s: sealed state not read again (%s); the last known one stands", bucket, e)
            return known[1]
        self._remember_sealed(bucket, asked_at, sealed)
        return sealed

    def _remember_sealed(self, bucket: str, asked_at: float, sealed: bool) -> None:
        """A read asked at `asked_at` (time.monotonic()) found `bucket` `sealed`: remembered, unless a read
        asked later answered already; a change is reported (`on_sealed_changed`)."""
        known = self._sealed.get(bucket)
        if known is not None and known[0] > asked_at:
            return
        shown = bool(self.known_sealed(bucket))  # (what attributes answered so far: unknown shows unsealed)
        self._sealed[bucket] = (asked_at, sealed)
        if sealed != shown and self.on_sealed_changed is not None:
            self.on_sealed_changed(bucket)

    def known_sealed(self, bucket: str) -> bool | None:
        """What is known of a bucket's sealed state without asking the server: the last state this mount
        or the bucket's watcher read (None: neither ever did)."""
        cached = self._sealed.get(bucket)
        if cached is not None:
            return cached[1]
        watched = self.ns.sealed_when_watched(bucket)
        # (Else what the bucket listing's stream configs showed: a mirror shows read-only at once.)
        return watched if watched is not None else self.store.known_read_only(bucket)

    def forget_sealed(self, bucket: str) -> None:
        self._sealed.pop(bucket, None)

    def _apply(self, bucket: str, *infos: ObjectInfo) -> None:
        index = self.ns.loaded_index(bucket)
        if index is None:
            return
        for info in infos:
            index.apply(info)

    def _nuid_users(self, bucket: str, nuid: str, name: str) -> tuple[str, ...]:
        """Live names other than `name` whose meta holds `nuid` (as far as the bucket's index knows), and
        alias subjects not shown that hold it: the chunks stay for them."""
        index = self.ns.loaded_index(bucket)
        if index is None or not nuid:
            return ()
        return index.other_names_with_nuid(nuid, name) + index.hidden_alias_holders(nuid)

    async def _on_canonical(self, bucket: str, info: ObjectInfo) -> ObjectInfo:
        """`info` as stored at its name's canonical meta subject. An object shown from an alias subject
        (unpadded base64 of an old client: see `natsfs.index`) is first moved there, as nats.go would
        address it, and the alias subject purged (`ObjectStore.adopt_alias`); every change then goes
        to the canonical subject like any other."""
        index = self.ns.loaded_index(bucket)
        subject = index.odd_subjects.get(info.name) if index is not None else None
        if index is None or subject is None:
            return info
        changed = Conflict(f"{bucket}/{info.name} changed since it was read")
        held = index.objects.get(info.name)
        mtime_ns = info.mtime_ns
        if held is None or held.revision != info.revision:
            # (The in-place rewrite of the alias's wildcard nuid, seen here already, is no change.)
            rewrite = await self.store.wildcard_rewrite_of(bucket, info, subject)
            if rewrite is None:
                raise changed
            info = rewrite

        def keep_mtime(doc: dict[str, Any]) -> None:
            # The meta's new message would otherwise give the file a new mtime.
            doc["metadata"] = metadata_of(doc) | {ATTR_MTIME: str(mtime_ns)}

        keep = None if info.link is not None or is_marker(info) else keep_mtime
        try:
            moved = await self.store.adopt_alias(bucket, info.name, subject, info.revision, keep)
        except Conflict:
            # The alias's wildcard nuid rewritten in place meanwhile (another mount's, `fsck --repair`'s), and
            # nothing else changed: moved as it is now, on the fresh nuid (once: anything else is a change).
            rewrite = await self.store.wildcard_rewrite_of(bucket, info, subject)
            if rewrite is None:
                raise changed from None
            try:
                moved = await self.store.adopt_alias(bucket, info.name, subject, rewrite.revision, keep)
            except Conflict:
                raise changed from None
        log.info("bucket %s: %r moved from %s to its canonical meta subject before a change", bucket, info.name,
                 subject)
        index.apply(moved)
        index.drop_alias(subject)
        return moved

    def _shared_nuid(self, index: BucketIndex | None, info: ObjectInfo) -> bool:
        """Does another live name use the same nuid (a rename interrupted between its steps)?"""
        if index is None or not info.nuid:
            return False
        return any(n != info.name for n in index.names_with_nuid(info.nuid))

    # ------------------------------------------------------------------ files
    def start(self, nursery: trio.Nursery) -> None:
        """Streaming uploads and the settling of leftovers run in `nursery`; without one, every upload
        happens at close and nothing is settled in the background."""
        self._nursery = nursery
        if not self.config.read_only:
            nursery.start_soon(self._settle_loop)

    # ------------------------------------------------------------------ leftovers
    async def _settle_loop(self) -> None:
        if self.journal.pending:
            log.warning("%d unfinished put(s) of an earlier run: their chunks are removed unless their meta "
                        "was stored", len(self.journal.pending))
        while True:
            await trio.sleep(self.config.settle_interval)
            await self.settle_puts()
            await self.purge_shared_tombstones()
            await self.defuse_wildcard_nuids()

    async def settle_at_unmount(self, timeout: float) -> None:
        """Unmounting: settle what this run's puts left (a streamed put given up when its file was written
        out of order, a failed close) for at most `timeout`, as the background passes would have done a
        few seconds later: a clean unmount leaves the next mount no record to check, and so no warning
        about "unfinished puts of an earlier run" that only a killed daemon should cause. What is not
        settled in time (a server that does not answer) stays in the journal for the next mount."""
        if self.config.read_only or not self.store.connected:
            return  # (without a connection every pass would only wait for one)
        with trio.move_on_after(timeout):
            while self.journal.pending:
                await self.settle_puts()
                if self.journal.pending:
                    # (a purged put's chunk subject is read back `purge_check_delay` after its purge)
                    await trio.sleep(UNMOUNT_SETTLE_POLL_S)

    async def settle_puts(self) -> None:
        """One pass over the unfinished puts: keep those whose meta holds their nuid, purge the chunks of
        the others, and close each record once a read-back shows its chunk subject empty."""
        journal = self.journal
        waiting: list[tuple[str, UnfinishedPut]] = []
        error: NatsFSError | None = None
        buckets: dict[str, bool] = {}  # bucket -> exists, asked once per pass
        for key, put in list(journal.pending.items()):
            if journal.pending.get(key) is not put:
                continue
            bucket, nuid = key
            try:
                if bucket not in buckets:
                    buckets[bucket] = await self._bucket_exists(bucket)
                done = not buckets[bucket] or await self._settle_put(bucket, nuid, put)
            except (ReadOnly, NotPermitted, JetStreamAPIError) as e:
                if isinstance(e, JetStreamAPIError) and e.code != 400:
                    error = e
                    break
                # The bucket refuses purges (sealed, deny_purge), or the server refuses them to this user
                # (permissions): nothing this mount can do.
                log.warning("bucket %s: the chunks of %r (nuid %s) cannot be removed (%s); left for fsck", bucket,
                            put.name, nuid, e)
                journal.finished(bucket, nuid)
                continue
            except NatsFSError as e:
                # The server is not answering: the rest waits for the next pass, not a timeout each.
                error = e
                for (b, _), p in journal.pending.items():
                    if not p.reported:
                        p.reported = True
                        waiting.append((b, p))
                break
            if done and journal.pending.get(key) is put:
                journal.finished(bucket, nuid)
        if waiting:
            shown = ", ".join(f"{b}/{p.name}" for b, p in waiting[:5]) + (" ..." if len(waiting) > 5 else "")
            log.warning("the chunks of %d unfinished put(s) (%s) are removed once the server answers (%s)",
                        len(waiting), shown, error)

    async def _settle_put(self, bucket: str, nuid: str, put: UnfinishedPut) -> bool:
        if put.sender_busy:
            # The upload worker may still publish chunks of it (it did not answer the put's drop in time):
            # purged once it says it stopped, or once it is gone (reaped), never before.
            sender = self.store.file_sender
            if sender is not None:
                with trio.move_on_after(ABORT_CLEANUP_S):
                    put.sender_busy = not await sender.drop(nuid)
                if put.sender_busy:
                    return False
            put.sender_busy = False
            put.purged_at = None  # (anything purged before it stopped is purged again)
        if put.purged_at is None:
            if put.meta_unknown:
                # The meta may still be in the server's queue, stored after a read that did not see it:
                # only a read after the barrier's answer tells (no answer: the next pass tries again).
                await self.store.earlier_publishes_processed(bucket)
            if put.meta_unknown and await self._nuid_in_use(bucket, nuid, put.name):
                log.info("bucket %s: the put of %r (nuid %s) whose outcome was unknown was stored", bucket,
                         put.name, nuid)
                return True
            await self.store.purge_chunks(bucket, nuid)
            put.meta_unknown = False
            put.purged_at = trio.current_time()
            return False
        if trio.current_time() - put.purged_at < self.config.purge_check_delay:
            return False
        if await self.store.streams.last_msg(stream_name(bucket), chunk_subject(bucket, nuid)) is None:
            log.log(logging.INFO if put.reported else logging.DEBUG,
                    "bucket %s: the chunks of the unfinished put of %r (nuid %s) are removed", bucket, put.name, nuid)
            return True
        put.purged_at = None  # chunks arrived after the purge: purge again
        return False

    async def _bucket_exists(self, bucket: str) -> bool:
        """False only when the server says the bucket is gone (and the chunks with it)."""
        try:
            await self.store.bucket_status(bucket)
        except NotFound:
            return False
        return True

    async def _nuid_in_use(self, bucket: str, nuid: str, name: str) -> bool:
        """Does a live meta hold `nuid`: the put's own name, or another (renamed since), or an alias subject
        not shown (`_nuid_users`: a version a delete or rename of the run that died replaced may be one
        whose chunks such an alias still names)?"""
        if name:
            try:
                info = await self.store.get_info(bucket, name)
            except MalformedMeta:
                info = None
            if info is not None and not info.deleted and info.nuid == nuid:
                return True
        index = await self.ns.index(bucket)
        return bool(index.names_with_nuid(nuid) or index.hidden_alias_holders(nuid))

    def _unsettled_nuid(self, bucket: str, name: str) -> set[str]:
        return {n for (b, n), put in self.journal.pending.items() if b == bucket and put.name == name
                and put.meta_unknown}

    async def purge_shared_tombstones(self) -> None:
        """Purge tombstones that carry the nuid of a live object under another name (left by renames of
        earlier natsfs versions): another client's delete or put of that name would purge the live
        object's chunks. One log line per bucket and pass."""
        for bucket in self.ns.loaded_buckets():
            index = self.ns.loaded_index(bucket)
            if index is None or not index.shared_tombstones:
                continue
            purged: list[str] = []
            for name, (revision, nuid) in list(index.shared_tombstones.items()):
                try:
                    live_holder = await self._live_holder(bucket, index, name, nuid)
                except NatsFSError as e:
                    log.debug("bucket %s: reading back the names sharing %r's nuid failed (%s); retrying", bucket,
                              name, e)
                    continue
                if not live_holder:
                    # Shared only with a name gone from the bucket meanwhile: an ordinary tombstone.
                    index.shared_tombstones.pop(name, None)
                    continue
                try:
                    await self.store.purge_tombstone(bucket, name, revision)
                except (ReadOnly, JetStreamAPIError) as e:
                    log.info("bucket %s: cannot purge %d tombstone(s) carrying a live nuid (%s)", bucket,
                             len(index.shared_tombstones), e)
                    index.shared_tombstones.clear()
                    break
                except NatsFSError as e:
                    log.debug("bucket %s: purging the tombstone of %r failed (%s); retrying", bucket, name, e)
                    continue
                index.drop_tombstone(name, revision)
                purged.append(name)
            if purged:
                shown = ", ".join(repr(n) for n in purged[:5]) + (" ..." if len(purged) > 5 else "")
                log.warning("bucket %s: purged %d tombstone(s) carrying the nuid of a live object under another "
                            "name (left by renames of an earlier natsfs; other clients' delete of those names "
                            "would have destroyed the objects): %s", bucket, len(purged), shown)

    async def defuse_wildcard_nuids(self) -> None:
        """Rewrite metas whose nuid holds a wildcard (`*`, `>`: another client wrote them), tombstones,
        live metas and links alike, on a fresh nuid that holds no chunks, each expecting the revision the
        index holds (`ObjectStore.defuse_wildcard_nuid`, which `natsfs fsck --repair` uses too): another
        client's Delete or Put of such a name would purge `$O.<bucket>.C.*`, every chunk of the bucket
        (this mount never purges by a wildcard: `streams.check_purge_filter`). A live object reads as
        before (it never had chunks it could read); a link keeps its target. One WARNING per name (the
        same name again later: INFO); a name another client changed first is left as it is now (one INFO
        line per name). More than `_DEFUSE_WARNINGS` names in one pass are summed up in one more WARNING
        line, never a flood. A bucket that takes no writes (or a server that refuses them to this user) keeps
        them (one INFO line per bucket and pass, for `natsfs fsck`)."""
        for bucket in self.ns.loaded_buckets():
            index = self.ns.loaded_index(bucket)
            if index is None or not (index.wildcard_nuids or index.alias_wildcards):
                continue
            if self.known_sealed(bucket):
                continue  # (nothing can be written there; read again when it changes)
            warned, unwarned = 0, []
            # (name, revision, nuid, "") of names; (name its meta carries, revision, nuid, subject) of aliases.
            targets = [(name, revision, nuid, "") for name, (revision, nuid) in index.wildcard_nuids.items()]
            targets += [(name, revision, nuid, subject)
                        for subject, (revision, nuid, name) in index.alias_wildcards.items()]
            for name, revision, nuid, alias in targets:
                if (bucket, name) in self._own_meta or self._staged_named(bucket, name):
                    # This mount is changing the name itself (a file open for writing, a chmod): the rewrite
                    # would fail that change as another client's (ESTALE). Its upload stores a fresh nuid;
                    # else a later pass rewrites it.
                    continue
                skipped = False  # the rewrite stored a meta this mount skips (nats.go reads it), as before it
                try:
                    with self.own_meta_change(bucket, name):  # (an upload starting meanwhile waits for it)
                        if alias:
                            rewritten = await self.store.defuse_wildcard_alias(bucket, alias, revision)
                        else:
                            rewritten = await self.store.defuse_wildcard_nuid(bucket, name, revision)
                        if rewritten is not None and not alias:
                            for sf in self._staged_named(bucket, name):  # (opened meanwhile: based on it)
                                if sf.base is not None and sf.base_revision == revision:
                                    sf.rebase(rewritten)
                                elif sf.base is None and sf.replaces is not None and sf.replaces.revision == revision:
                                    sf.replace(rewritten)
                except (ReadOnly, NotPermitted, JetStreamAPIError) as e:
                    if isinstance(e, JetStreamAPIError) and e.code != 400:
                        log.debug("bucket %s: rewriting the meta of %r failed (%s); retrying", bucket, alias or name, e)
                        continue
                    log.info("bucket %s: cannot rewrite %d meta(s) whose nuid is a wildcard (%s); "
                             "another client's Delete or Put of those names would purge every chunk",
                             bucket, len(index.wildcard_nuids) + len(index.alias_wildcards), e)
                    index.wildcard_nuids.clear()
                    index.alias_wildcards.clear()
                    break
                except StoredButSkipped:
                    rewritten, skipped = None, True
                except NatsFSError as e:
                    log.debug("bucket %s: rewriting the meta of %r failed (%s); retrying", bucket, alias or name, e)
                    continue
                # (Rewritten, or changed meanwhile: the watch brings what the name holds now.)
                if alias and index.alias_wildcards.get(alias, (0, "", ""))[0] == revision:
                    del index.alias_wildcards[alias]
                elif not alias and index.wildcard_nuids.get(name, (0, ""))[0] == revision:
                    del index.wildcard_nuids[name]
                key = (bucket, alias or name)
                if rewritten is None and not skipped:
                    if key not in self._defuse_lost:
                        self._defuse_lost.add(key)
                        log.info("bucket %s: %r changed before its nuid %r could be rewritten; left as it is "
                                 "now", bucket, alias or name, nuid)
                    continue
                if rewritten is not None:
                    if alias:
                        index.apply_alias(alias, rewritten)
                    else:
                        self._apply(bucket, rewritten)
                first = key not in self._defused
                self._defused[key] += 1
                if first and warned >= _DEFUSE_WARNINGS:
                    unwarned.append(alias or name)
                    continue
                warned += first
                times = self._defused[key]
                level = logging.WARNING if first else logging.INFO if times == 2 else logging.DEBUG
                again = "" if times != 2 else " (again: later rewrites of this name are logged at DEBUG)"
                if alias:
                    log.log(level, "bucket %s: the meta on %s (named %r, not the name that subject is for; %s) "
                            "carried the nuid %r, which another client's Delete or Put of the name that subject is "
                            "for would purge as %s: rewritten in place on a fresh nuid%s", bucket, alias, name,
                            "skipped here, read by nats.go" if rewritten is None else "an alias", nuid,
                            wildcard_reach(bucket, nuid), again)
                    continue
                what = ("the meta (skipped here, read by nats.go)" if rewritten is None else "the tombstone"
                        if rewritten.deleted else "the link" if rewritten.link is not None else "the object")
                log.log(level, "bucket %s: %s %r carried the nuid %r, which another client's Delete or Put of that "
                        "name would purge as %s: rewritten on a fresh nuid%s", bucket, what, name, nuid,
                        wildcard_reach(bucket, nuid), again)
            if unwarned:
                shown = ", ".join(repr(n) for n in unwarned[:5]) + (" ..." if len(unwarned) > 5 else "")
                log.warning("bucket %s: %d more metas whose nuid was a wildcard rewritten on a fresh nuid: %s",
                            bucket, len(unwarned), shown)

    def _staged_named(self, bucket: str, name: str) -> list[StagedFile]:
        """This mount's staged files (not ended) of `name`."""
        return [sf for sf in self.staging.all() if sf.bucket == bucket and sf.name == name and not sf.ended]

    async def _live_holder(self, bucket: str, index: BucketIndex, name: str, nuid: str) -> bool:
        """Does a name the index holds live with `nuid` (other than `name`) still hold it in the bucket?
        The index learns of another client's rename (its new meta, then a purge of the old subject, which
        no watch delivers) only when it reads the old name back a moment later: until then a tombstone
        under the new name (deleted since) seems to share the nuid of the old one."""
        for holder in index.other_names_with_nuid(nuid, name):
            try:
                got = await self.store.get_meta_doc(bucket, holder, index.odd_subjects.get(holder))
            except MalformedMeta:
                continue
            if got is not None and not got[0].get("deleted") and got[0].get("nuid") == nuid:
                return True
        return False

    # ------------------------------------------------------------------ streaming uploads
    def after_write(self, sf: StagedFile, offset: int) -> None:
        """Called after every change of a staged file's content at `offset` (or a truncate to it)."""
        if offset < sf.stream_claimed:
            self._break_stream(sf)
        elif sf.stream_wake is not None:
            sf.stream_wake.set()  # a streamer is running: there may be more to claim
        elif self._nursery is not None and sf.may_stream(STREAM_BATCH):
            # Also in a bucket that takes atomic batches: a batch would hold the whole upload until close
            # (and the server writes a batch twice). A streamed put is the ordered put (meta last, after
            # every chunk's ack; the put journal settles the chunks of one that never commits). Files
            # closed before one STREAM_BATCH was written are still put whole, as one batch.
            sf.streaming_started()
            self._nursery.start_soon(self._stream_ahead, sf)

    async def _stream_ahead(self, sf: StagedFile) -> None:
        """Send the staged file's full chunks that nobody will change any more (it grows at the end),
        with a few ranges in flight at once. While ranges are in flight it waits for the next write
        (or the end of a send) instead of ending: a streamer that ended only once its last ranges were
        acknowledged let the pipeline run dry at every such pause."""
        chunk = self.config.chunk_size
        in_flight = trio.Semaphore(STREAM_PARALLEL)
        try:
            async with trio.open_nursery() as nursery:
                while not sf.stream_dead and not sf.ended:
                    wake = sf.stream_wake = trio.Event()
                    if sf.size - sf.stream_claimed < STREAM_BATCH:
                        if in_flight.value == STREAM_PARALLEL:
                            break  # nothing to claim and nothing in flight
                        await wake.wait()  # a write, or a send that ended
                        continue
                    await in_flight.acquire()
                    async with sf.lock:
                        if sf.stream_dead or sf.ended or sf.unlinked:
                            in_flight.release()
                            break
                        session, start, end = sf.claim_stream(
                            lambda: self.store.start_put(sf.bucket, chunk, name=sf.name), STREAM_BATCH, chunk)
                    nursery.start_soon(self._send_range, sf, session, start, end, in_flight)
        except (NatsFSError, ExceptionGroup) as e:
            log.info("%s/%s: streaming upload stopped (%s); the whole file is sent at close", sf.bucket,
                     sf.name, single_error(e))
            self._break_stream(sf)
        finally:
            sf.streaming_ended()

    async def _send_range(self, sf: StagedFile, session: PutSession, start: int, end: int,
                          in_flight: trio.Semaphore) -> None:
        try:
            await session.send_file(sf.file_path(), sf.fd, start, end)
        finally:
            in_flight.release()
            if sf.stream_wake is not None:
                sf.stream_wake.set()

    def _break_stream(self, sf: StagedFile) -> None:
        session, running = sf.break_stream()
        if session is not None and self._nursery is not None:
            self._nursery.start_soon(self._abort_after, session, running)

    async def _abort_after(self, session: PutSession, running: trio.Event | None) -> None:
        if running is not None:
            await running.wait()  # a send in flight would re-create what a purge removed
        with trio.CancelScope(shield=True):
            await session.abort()

    async def _put_whole(self, sf: StagedFile, chunk_size: int, common: dict[str, Any]) -> ObjectInfo:
        # (a file up to one small put is read through its descriptor: one in memory keeps no spool file)
        small = sf.size <= min(chunk_size, SMALL_PUT_MAX)
        return await self.store.put_file(sf.bucket, sf.name, str(sf.spool_path) if small else sf.file_path(),
                                         sf.fd, sf.size, chunk_size=chunk_size, **common)

    def discard_stream(self, sf: StagedFile) -> None:
        """Chunks streamed for a version that will never be committed are purged."""
        self._break_stream(sf)

    def discard(self, sf: StagedFile) -> None:
        """A staged file that will never be uploaded: drop its spool file and streamed chunks."""
        self._break_stream(sf)
        sf.discard()

    # ------------------------------------------------------------------ files
    async def upload(self, sf: StagedFile, chunk_size: int) -> ObjectInfo | None:
        """Put a dirty staged file as one object; `Conflict` if the object changed since it was staged."""
        if sf.stream_running is not None:
            await sf.stream_running.wait()
        async with sf.lock:
            if sf.state is not WriteState.DIRTY:
                return None
            sf.begin_upload()
            try:
                info, xattrs_stored = await self._upload(sf, chunk_size)
            except BaseException:
                sf.upload_failed()
                raise
            sf.stored(info, xattrs_stored)
            self._apply(sf.bucket, info)
            return info

    async def _upload(self, sf: StagedFile, chunk_size: int) -> tuple[ObjectInfo, int]:
        """The put of an uploading staged file (its lock held); the stored meta and how many of its
        xattr changes it holds."""
        while (sf.bucket, sf.name) in self._own_meta:
            # This mount's own chmod, chown, utime or xattr change of the name is being stored, at the
            # revision it read. Put now, and that change would fail as a conflict (ESTALE) though the only
            # change in between was ours; it rebases this file when it ends, so this put stores after it,
            # at its revision, with its attributes.
            await self._own_meta_ended.wait()
        await self.check_writable(sf.bucket)
        if sf.size == 0 and sf.name.endswith("/"):
            raise MarkerShaped(f"{sf.bucket}/{sf.name}: an empty object with this name is a directory marker, "
                               f"which would show as a directory instead of this file")
        if sf.resumed:
            sf.resumed = False
            already = await self._stored_by_earlier_run(sf)
            if already is not None:
                return already, len(sf.xattr_changes)
        if sf.base is not None or sf.replaces is not None:
            # The index must be loaded (a write-back upload replayed at start may come first): it says
            # whether other live names still use the replaced version's chunks (`_nuid_users`). Without
            # it nothing replaced may be purged, so the upload waits for a later try.
            await self.ns.index(sf.bucket)
        if sf.base is not None and sf.base.revision == sf.base_revision:
            sf.rebase(await self._on_canonical(sf.bucket, sf.base))
        if sf.base is None and sf.replaces is not None:
            # (A replaced object shown from an alias subject is moved to its canonical one first, where
            # the put expects it.)
            sf.replace(await self._on_canonical(sf.bucket, sf.replaces))
        base_doc = None
        expected, old_nuid = sf.base_revision, sf.base.nuid if sf.base is not None else ""
        replace_tombstone, own_tombstone = sf.base is None, False
        replaced = sf.replaces if sf.base is None else None
        if replaced is not None:
            # Renamed over a stored object before this first upload: the put replaces that object (a new
            # document, nothing of the replaced one's kept), as a rewrite replaces its base. Another
            # client's change of it meanwhile is a conflict.
            expected, replace_tombstone = replaced.revision, False
            shared = self._shared_nuid(self.ns.loaded_index(sf.bucket), replaced)
            old_nuid = "" if shared or replaced.link is not None else replaced.nuid  # (a link has no chunks)
        unsettled = self._unsettled_nuid(sf.bucket, sf.name)
        if replaced is not None and replaced.nuid:
            # The put expects the replaced object's revision: check that the name still holds that object
            # and not another client's at the same revision of a stream created again (see below).
            got = await self.store.get_meta_doc(sf.bucket, sf.name)
            if got is not None and got[1] == expected:
                check_same_object(sf.bucket, sf.name, got[0], replaced.nuid)
        if sf.base is not None or unsettled:
            got = await self.store.get_meta_doc(sf.bucket, sf.name)
            got_nuid = str(got[0].get("nuid") or "") if got is not None else ""
            while (got is not None and sf.base is not None and got[1] != sf.base_revision
                   and got_nuid == sf.base.nuid and (sf.bucket, sf.name) in self._own_meta):
                # The same bytes under a newer meta, while this mount's own chmod, utime or xattr change
                # of the name is finishing: that change rebases this file when it ends; not a conflict.
                await self._own_meta_ended.wait()
                got = await self.store.get_meta_doc(sf.bucket, sf.name)
                got_nuid = str(got[0].get("nuid") or "") if got is not None else ""
                expected = sf.base_revision  # rebased
            if got is not None and got[1] != sf.base_revision and got_nuid in unsettled:
                # An earlier put of this file whose outcome was unknown was stored after all: it is
                # ours, not another client's change. This put replaces it.
                self.journal.finished(sf.bucket, got_nuid)
                base_doc, expected, old_nuid, replace_tombstone = got[0], got[1], got_nuid, False
            elif sf.base is not None:
                if got is not None and got[1] > sf.base_revision and _nuid_rewritten(sf.base, got[0]):
                    # Another mount (or `natsfs fsck --repair`) rewrote the wildcard nuid of the version this
                    # file was opened at, and nothing else: no conflict, this put replaces that rewrite.
                    expected, old_nuid = got[1], got_nuid
                elif got is not None and got[1] != sf.base_revision and await self._own_failed_removal(sf, got[0]):
                    # The tombstone of this mount's own unlink of the file, which failed (no answer, none to
                    # the read-back) though it was stored: the file stayed, so this put replaces it.
                    expected, own_tombstone = got[1], True
                elif got is None or got[1] != sf.base_revision:
                    self._break_stream(sf)
                    raise Conflict(f"{sf.bucket}/{sf.name} was changed by another client since it was opened")
                if sf.base.nuid and got_nuid != sf.base.nuid and not own_tombstone:
                    # The same revision holding another object: the stream was deleted and created again
                    # (its sequences start over) and another client's object got the revision the file
                    # was opened at. The server's expected-sequence check would let this put replace it.
                    self._break_stream(sf)
                    raise Conflict(f"{sf.bucket}/{sf.name} was replaced by another client since it was opened "
                                   f"(its stream was deleted and created again)")
                base_doc = got[0]
        attrs, defaults = sf.attrs(), self.file_defaults

        changes = list(sf.xattr_changes)

        def extra(doc: dict[str, Any]) -> None:
            sf.apply_xattr_changes(doc, changes)
            set_posix_attrs(doc, attrs, defaults)

        # timestamp=False: the filesystem shows a stored file's last write (or its natsfs.mtime_ns), never
        # the meta message's time, so the put does not read the stored meta back for it.
        common: dict[str, Any] = dict(base=base_doc, expected_revision=expected, old_nuid=old_nuid,
                                      extra=extra, replace_tombstone=replace_tombstone, timestamp=False)
        session = sf.stream
        try:
            if session is not None and not sf.stream_dead and session.chunk_size == chunk_size:
                # The front was streamed while it was written: send the rest, then the meta.
                try:
                    await session.send_file(sf.file_path(), sf.fd, sf.stream_claimed, sf.size)
                    digest = await session.digest()
                except Unavailable:
                    if not session.remote:
                        raise
                    # The upload worker went away mid-file: send the whole file from here. (Only
                    # before the meta: a meta without an answer is never followed by a second put.)
                    await session.abort()
                    info = await self._put_whole(sf, chunk_size, common)
                else:
                    info = await session.commit(sf.name, digest, **common)
            else:
                self._break_stream(sf)
                info = await self._put_whole(sf, chunk_size, common)
        except BaseException:
            if session is not None and self._nursery is not None:
                # In the background: a close that ran out of time must not wait for the purge too.
                self._nursery.start_soon(self._abort_after, session, None)
            elif session is not None:
                with trio.CancelScope(shield=True):
                    await session.abort()
            raise
        finally:
            sf.reset_stream()
        return info, len(changes)

    async def _own_failed_removal(self, sf: StagedFile, doc: dict[str, Any]) -> bool:
        """Whether `doc`, the name's meta newer than `sf`'s base, is a tombstone (or a rename's claim)
        this mount published for an unlink of `sf` that failed (`sf.failed_removal`, its `Nats-Msg-Id`).
        The put log knows such a tombstone of a chunked object as this mount's own unsettled publish;
        this covers the others (an empty object, a claim): else their bytes went to lost+found with a
        warning that another client had changed the name."""
        if not sf.failed_removal or doc.get("deleted") is not True:
            return False
        return is_attempt_of(await self.store.meta_msg_id(sf.bucket, sf.name), sf.failed_removal)

    async def _stored_by_earlier_run(self, sf: StagedFile) -> ObjectInfo | None:
        """A write-back upload replayed from the journal whose object the daemon that died had stored
        already (killed between the put and the journal's `done`): the name holds a newer version than
        the record's base with exactly these bytes (size and digest). That object is this upload."""
        info = await self.store.get_info(sf.bucket, sf.name)
        if (info is None or info.deleted or info.revision == sf.base_revision or info.size != sf.size
                or (sf.replaces is not None and info.revision == sf.replaces.revision)):
            return None
        digest = await trio.to_thread.run_sync(_digest_of_file, sf.fd, sf.size)
        if info.digest != format_digest(digest):
            return None
        log.info("%s/%s: replayed write-back upload was already stored by the earlier run (revision %d)",
                 sf.bucket, sf.name, info.revision)
        return info

    async def delete(self, bucket: str, info: ObjectInfo, *, keep_chunks: bool = False, msg_id: str = "") -> None:
        """Delete an object (or link): tombstone, then purge its chunks unless another name shares them
        or `keep_chunks` (handles of this mount still read them: see `purge_unused`). A name sharing its
        nuid with another live name gets no tombstone (see `ObjectStore.delete`). `msg_id`: the
        tombstone's `Nats-Msg-Id` (see `ObjectStore.meta_msg_id`)."""
        await self.check_writable(bucket)
        index = self.ns.loaded_index(bucket)
        current = await self._on_canonical(bucket, info)
        for attempt in range(2):
            shared = self._shared_nuid(index, current)
            try:
                tomb = await self.store.delete(bucket, current.name, expected_revision=current.revision,
                                               expected_nuid=current.nuid,
                                               purge_chunks=not keep_chunks and not shared, shared=shared,
                                               msg_id=attempt_msg_id(msg_id, attempt))
                break
            except Conflict:
                # Changed since we listed it: delete what is there now (rm means "this name").
                now = await self.store.get_info(bucket, info.name)
                if attempt or now is None or now.deleted:
                    raise NotFound(f"{bucket}/{info.name}") from None
                current = now
        if tomb is not None:
            self._apply(bucket, tomb)
        elif index is not None:
            index.remove_if(current.name, current.revision)

    async def finish_claim(self, bucket: str, name: str, nuid: str) -> bool:
        """A rename of `name` cut between its two publishes (the moved meta stored under the new name, the
        old name not claimed yet: both hold `nuid`): the old name's claim is published now, as the rename
        would have (a tombstone on a fresh nuid, expecting the revision read; no chunk purged: the new name
        holds them). True when claimed; False when the name no longer holds `nuid` (another client's
        change, or claimed already): nothing is written then."""
        await self.check_writable(bucket)
        got = await self.store.get_meta_doc(bucket, name)
        if got is None or got[0].get("deleted") or not nuid or got[0].get("nuid") != nuid:
            return False
        try:
            claim = await self.store.delete(bucket, name, expected_revision=got[1], expected_nuid=nuid,
                                            purge_chunks=False, shared=True)
        except (Conflict, NotFound):
            return False  # (changed meanwhile: not this rename's to take)
        if claim is not None:
            self._apply(bucket, claim)
        return True

    async def purge_unused(self, bucket: str, nuid: str) -> None:
        """Purge the chunks of a deleted or replaced version once nothing here reads them and no live
        name uses them (the last close of a file unlinked while open)."""
        index = self.ns.loaded_index(bucket)
        if index is not None and index.names_with_nuid(nuid):
            return
        await self.store.purge_deleted(bucket, nuid)

    @contextlib.contextmanager
    def own_meta_change(self, bucket: str, name: str) -> Iterator[None]:
        """A meta-only change of `name` by this mount, from before it is stored until every staged file
        of the name is rebased on it: an upload that meanwhile finds the stored meta newer than its base
        with the same nuid waits for it instead of failing as a conflict."""
        key = (bucket, name)
        self._own_meta[key] += 1
        try:
            yield
        finally:
            self._own_meta[key] -= 1
            if not self._own_meta[key]:
                del self._own_meta[key]
            self._own_meta_ended.set()
            self._own_meta_ended = trio.Event()

    async def set_attrs(self, bucket: str, info: ObjectInfo, attrs: PosixAttrs, defaults: PosixAttrs) -> ObjectInfo:
        """Store POSIX attributes in the meta (same nuid, no data moved)."""
        await self.check_writable(bucket)
        adopted = await self._on_canonical(bucket, info)
        if adopted is not info and attrs.mtime_ns is None and adopted.attrs is not None:
            # Moved from its alias with its mtime kept as natsfs.mtime_ns (computed before the move):
            # the change keeps it too.
            attrs = dataclasses.replace(attrs, mtime_ns=adopted.attrs.mtime_ns)
        info = adopted
        new = await self.store.update_meta(bucket, info.name, lambda doc: set_posix_attrs(doc, attrs, defaults),
                                           expected_revision=info.revision, expected_nuid=info.nuid)
        self._apply(bucket, new)
        return new

    async def change_meta(self, bucket: str, info: ObjectInfo, change: Callable[[dict[str, Any]], None]) -> ObjectInfo:
        """Rewrite an object's meta (xattrs): same nuid, every other field kept, refused when the
        result would grow it over --max-meta-bytes (`ObjectStore.check_meta_size`: nothing stored)."""
        await self.check_writable(bucket)
        info = await self._on_canonical(bucket, info)
        new = await self.store.update_meta(bucket, info.name, change, expected_revision=info.revision,
                                           expected_nuid=info.nuid)
        self._apply(bucket, new)
        return new

    async def add_link(self, bucket: str, name: str, target_bucket: str, target_name: str | None, *,
                       metadata: dict[str, str] | None = None) -> ObjectInfo:
        await self.check_writable(bucket)
        info = await self.store.add_link(bucket, name, target_bucket, target_name, metadata=metadata)
        self._apply(bucket, info)
        return info

    # ------------------------------------------------------------------ buckets
    async def create_bucket(self, bucket: str) -> None:
        if self.config.read_only:
            raise ReadOnly("this mount is read-only")
        c = self.config
        try:
            await self.store.create_bucket(bucket, storage=c.storage, replicas=c.replicas, compression=c.compression,
                                           max_bytes=c.max_bytes, ttl_ns=int(c.ttl * 1e9))
        except JetStreamAPIError as e:
            if e.err_code == ERR_STREAM_NAME_IN_USE:
                raise AlreadyExists(f"bucket {bucket} exists") from None
            if e.err_code in ERR_ACCOUNT_LIMITS_FOR_A_STREAM:
                # As a full disk refuses a mkdir: ENOSPC, said once, not an EIO logged as a failure.
                raise NoSpace(f"bucket {bucket} not created: the account's JetStream limits leave no room for "
                              f"it ({e.description})") from None
            raise
        self._sealed[bucket] = (time.monotonic(), False)  # made here, unsealed: known, also offline
        await self.ns.refresh_buckets()
        with contextlib.suppress(NatsFSError):
            await self.ns.index(bucket)  # watched from now on: files can be made in it while the server is away

    async def delete_bucket(self, bucket: str) -> None:
        """rmdir of a bucket directory: only when the bucket holds no live objects."""
        if self.config.read_only:
            raise ReadOnly("this mount is read-only")
        if live := await self.store.live_object_count(bucket):
            raise NotEmpty(f"bucket {bucket} holds {live} objects (counting those this mount does not show)")
        await self.store.delete_bucket(bucket)
        self.forget_sealed(bucket)
        await self.ns.refresh_buckets()

    async def change_bucket(self, bucket: str, change: Callable[[dict[str, Any]], None]) -> None:
        await self.check_writable(bucket)
        await self.store.update_bucket(bucket, change)

    # ------------------------------------------------------------------ directories
    async def mkdir(self, bucket: str, rel: Path, attrs: PosixAttrs) -> ObjectInfo:
        """A directory that persists: an empty marker object named `<dir>/`."""
        return await self._put_empty(bucket, "/".join(rel) + "/", attrs, self.dir_defaults)

    async def make_special(self, bucket: str, name: str, attrs: PosixAttrs,
                           metadata: dict[str, str] | None = None) -> ObjectInfo:
        """A FIFO, socket, device node or symlink: an empty object with its type in the metadata."""
        return await self._put_empty(bucket, name, attrs, self.file_defaults, metadata)

    async def _put_empty(self, bucket: str, name: str, attrs: PosixAttrs, defaults: PosixAttrs,
                         metadata: dict[str, str] | None = None) -> ObjectInfo:
        """A new empty object (a directory marker or a special file); `AlreadyExists` if the name is live."""
        await self.check_writable(bucket)

        def extra(doc: dict[str, Any]) -> None:
            set_posix_attrs(doc, attrs, defaults)
            if metadata:
                doc["metadata"] = metadata_of(doc) | metadata

        try:
            # (Not read back for its timestamp: a new directory's or special file's time is now.)
            info = await self.store.put(bucket, name, BytesSource(b""), expected_revision=0, extra=extra,
                                        replace_tombstone=True, timestamp=False)
        except Conflict:
            raise AlreadyExists(f"{bucket}/{name}") from None
        self._apply(bucket, info)
        return info

    async def rmdir(self, bucket: str, rel: Path, directory: Dir, mount_path: Path) -> None:
        await self.check_writable(bucket)
        if directory.children or self.staging.children(mount_path):
            raise NotEmpty(f"{bucket}/{'/'.join(rel)}")
        if directory.marker is not None:
            await self.delete(bucket, directory.marker)
        else:
            index = self.ns.loaded_index(bucket)
            if index is not None:
                index.drop_empty(rel)  # (kept by this mount only: nothing stored to delete)

    async def set_dir_attrs(self, bucket: str, rel: Path, directory: Dir, attrs: PosixAttrs) -> None:
        if directory.marker is None:
            await self.mkdir(bucket, rel, attrs)
        else:
            await self.set_attrs(bucket, directory.marker, attrs, self.dir_defaults)

    # ------------------------------------------------------------------ renames
    async def rename_object(self, bucket: str, info: ObjectInfo, new_name: str,
                            target: ObjectInfo | None, *, keep_target_chunks: bool = False,
                            extra_metadata: dict[str, str] | None = None, msg_id: str = "") -> ObjectInfo:
        """Metadata-only rename; replaces `target` (a live object at the new name) as POSIX requires.

        Order (see adr20.ObjectStore.rename): new meta, then the claim of the old name (a tombstone on a
        fresh nuid that expects the revision read), then the replaced target's chunks. A crash in
        between leaves the object reachable under one name or both, and at worst orphaned chunks of the
        replaced target, never a loss. A claim refused (another client deleted or renamed the old name
        meanwhile, `NotFound`; changed it, `Conflict`) takes the new meta back: nothing moved, no chunk
        purged, and the replaced target stays. `msg_id`: the new meta's `Nats-Msg-Id` (see
        `ObjectStore.meta_msg_id`).
        """
        await self.check_writable(bucket)
        index = self.ns.loaded_index(bucket)
        info = await self._on_canonical(bucket, info)
        if target is not None:
            target = await self._on_canonical(bucket, target)
        # The replaced target's chunks are recorded in the put journal before anything is published (as a
        # put's replaced version is): a daemon killed before their purge leaves them to the next mount,
        # which purges them unless a live name still holds them (they were orphans for `fsck --repair`).
        noted = ""
        if (target is not None and target.link is None and target.nuid and target.nuid != info.nuid
                and target.size and not self._shared_nuid(index, target)
                and self.store.note_replacing(bucket, target.nuid, "", target.name)):
            noted = target.nuid
        try:
            renamed = await self._rename_attempts(bucket, info, new_name, target, extra_metadata, msg_id)
        except BaseException:
            if noted:
                assert self.store.put_log is not None and target is not None
                if keep_target_chunks:
                    self.store.put_log.finished(bucket, noted)
                else:  # (settled: purged only if the rename turns out stored and no name holds them)
                    self.store.put_log.failed(bucket, noted, target.name, meta_unknown=True, purged=False)
            raise
        new_info, info, target = renamed
        if noted and (target is None or target.nuid != noted):
            assert self.store.put_log is not None  # (the target renamed on a fresh nuid: not these chunks)
            self.store.put_log.finished(bucket, noted)
            noted = ""
        # (With `keep_target_chunks` the record stays open: `purge_unused` ends it at their last close.)
        if index is not None:
            # A hidden alias of the old name on the same nuid (an `adopt_alias` cut short, or a copy)
            # would show at the old name once its canonical subject is empty: it moves too.
            for subject, alias in list(index.hidden_aliases(info.name)):
                if alias.nuid == info.nuid:
                    await self.store.purge_alias(bucket, subject, alias.revision)
                    index.drop_alias(subject)
        if (target is not None and target.link is None and target.nuid and target.nuid != info.nuid
                and not keep_target_chunks
                and not self._shared_nuid(index, target)):
            await self.store.end_replacing(bucket, target.nuid, target.name, bool(noted), stored=True)
        return new_info

    async def _rename_attempts(self, bucket: str, info: ObjectInfo, new_name: str, target: ObjectInfo | None,
                               extra_metadata: dict[str, str] | None, msg_id: str
                               ) -> tuple[ObjectInfo, ObjectInfo, ObjectInfo | None]:
        """`ObjectStore.rename`, again on the fresh nuid of a source or target whose wildcard nuid was
        rewritten meanwhile; (the new meta, the source and the target as renamed)."""
        stored_new: list[ObjectInfo] = []  # (what a try stored under the new name: its meta, an undo)

        def stored(meta: ObjectInfo) -> None:
            if meta.name == new_name:
                stored_new.append(meta)
            self._apply(bucket, meta)

        for attempt in range(_REWRITE_RETRIES + 1):
            stored_new.clear()
            try:
                new_info, _claim = await self.store.rename(
                    bucket, info.name, new_name, expected_revision=info.revision, expected_nuid=info.nuid,
                    target_revision=target.revision if target is not None else 0,
                    change=_rename_change(info, extra_metadata),
                    target_change=_rename_change(target) if target is not None else None,
                    stored=stored, msg_id=attempt_msg_id(msg_id, attempt))
                break
            except Conflict:
                # A rewrite of the source's or the target's wildcard nuid landed meanwhile: it changed
                # nothing but the nuid, so the rename moves the name's content as it is now, as on a
                # local disk (the claim refused took its new meta back first). Any other change stays
                # a conflict.
                undone = stored_new[1] if target is not None and len(stored_new) > 1 else None
                again = (await self._rewritten_since(bucket, info, target, undone) if attempt < _REWRITE_RETRIES
                         else None)
                if again is None:
                    raise
                info, target = again
        return new_info, info, target

    async def _rewritten_since(self, bucket: str, info: ObjectInfo, target: ObjectInfo | None,
                               undone: ObjectInfo | None) -> tuple[ObjectInfo, ObjectInfo | None] | None:
        """After a rename of `info` over `target` was refused as a conflict: the two as stored now when
        at least one of them is the same as read but for a wildcard nuid rewritten since (every other
        field kept: `ObjectStore.wildcard_rewrite_of`), and the other is unchanged (a target may also be
        `undone`, the very meta the refused rename stored back there, nothing written since); else None
        (another client changed either, even keeping its nuid)."""
        source = await self.store.wildcard_rewrite_of(bucket, info)
        changed = source is not None
        if source is not None:
            source = dataclasses.replace(source, mtime_ns=info.mtime_ns)
        else:
            now = await self.store.get_info(bucket, info.name)
            if now is None or now.revision != info.revision:
                return None
            source = info
        if target is None:
            return (source, None) if changed else None
        replaced = await self.store.wildcard_rewrite_of(bucket, target)
        if replaced is None:
            held = await self.store.get_info(bucket, target.name)
            if held is None or held.deleted:
                return None
            if undone is not None and held.revision == undone.revision:
                replaced = held  # (stored back by the refused rename, as it read it)
            elif held.revision == target.revision:
                replaced = target
            else:
                return None
        replaced = dataclasses.replace(replaced, mtime_ns=target.mtime_ns)
        changed = changed or replaced.revision != target.revision
        return (source, replaced) if changed else None

    async def rename_dir(self, bucket: str, old_rel: Path, directory: Dir, new_rel: Path,
                         target: Dir | None, extra_metadata: dict[str, dict[str, str]] | None = None) -> None:
        """Move every object under a directory (and its marker) to the new prefix, one object at a time;
        `extra_metadata` by object name is set on those objects as they move.

        A directory another client's rename holds (`BucketIndex.renamed_away`: it claimed the marker) is
        theirs: `NotFound`, nothing moves. The caller checks that first, and it is checked again here once
        nothing awaits any more before the moves are read from the directory: a claim may come while this
        awaits (the bucket's sealed state, read again every 2 s; the target's marker)."""
        await self.check_writable(bucket)
        if target is not None:
            if target.children:
                raise NotEmpty(f"{bucket}/{'/'.join(new_rel)}")
            if target.marker is not None:
                await self.delete(bucket, target.marker)
        index = self.ns.loaded_index(bucket)
        if index is not None and index.renamed_away(old_rel):
            # (Built from what it shows now, the moves would hold no marker: nothing would decide the race,
            # and both renames moved part of the directory, the other's marker back at the old name.)
            raise NotFound(f"{bucket}/{'/'.join(old_rel)}: another client is renaming this directory")
        old_prefix = "/".join(old_rel) + "/"
        new_prefix = "/".join(new_rel) + "/"
        moves: list[ObjectInfo] = []
        stack = [directory]
        while stack:
            d = stack.pop()
            if d.marker is not None:
                moves.append(d.marker)
            for child in d.children.values():
                if isinstance(child, Dir):
                    stack.append(child)
                else:
                    moves.append(child)
        # Objects first, the marker of the moved directory itself last: until the end the old
        # directory stays visible and nothing is lost if the daemon stops half way.
        moves.sort(key=lambda o: o.name == old_prefix)
        for info in moves:  # every new name is checked before anything moves
            if info.name.startswith(old_prefix):
                self.store.check_name(bucket, new_prefix + info.name[len(old_prefix):])
        await self._check_renamed_sizes(bucket, moves, old_prefix, new_prefix)
        movable = []
        for info in moves:
            if info.name.startswith(old_prefix):
                movable.append(info)
            else:
                log.warning("rename: %s/%r is shown under %s but named otherwise; left in place", bucket,
                            info.name, old_prefix)
        self._refuse_markers_over_files(bucket, moves, old_prefix, new_prefix)
        marker = movable.pop() if movable and movable[-1].name == old_prefix else None
        # The directory's own marker moves first: its claim decides a race with another client's rename
        # (or rmdir) of the directory before any object moves, so that exactly one of them wins and the
        # other moves nothing. (The old directory stays visible through the objects not moved yet.)
        moved_marker = await self.rename_object(bucket, marker, new_prefix, None) if marker is not None else None
        try:
            await self._rename_each(bucket, movable, old_prefix, new_prefix, extra_metadata or {})
        except NatsFSError:
            if marker is not None and moved_marker is not None:
                await self._move_back(bucket, [(marker, moved_marker)])
            raise

    def _refuse_markers_over_files(self, bucket: str, moves: list[ObjectInfo], old_prefix: str,
                                   new_prefix: str) -> None:
        """`MarkerShaped` before anything moves when a moved directory marker would land on another
        client's object with bytes under that name (`e/`, shown as the file `e%2F`): its rename would
        replace that file (the server refused it as a change by another client, `ESTALE`, which nothing
        was)."""
        index = self.ns.loaded_index(bucket)
        if index is None:
            return
        for info in moves:
            if not is_marker(info) or not info.name.startswith(old_prefix):
                continue
            new_name = new_prefix + info.name[len(old_prefix):]
            held = index.objects.get(new_name)
            if held is not None and not held.deleted and not is_marker(held):
                raise MarkerShaped(f"{bucket}/{new_name}: an object with bytes holds the name the moved "
                                   f"directory's marker needs (it shows as "
                                   f"{'/'.join(placement(new_name)[0] or ())!r}); nothing moved")

    async def _check_renamed_sizes(self, bucket: str, moves: list[ObjectInfo], old_prefix: str,
                                   new_prefix: str) -> None:
        """`TooBig` before anything moves when the meta of an object would grow over --max-meta-bytes
        under its new name (`ObjectStore.check_meta_size`), as `check_name` does for names. Only metas
        that could come near the limit are read: a moved meta grows by the longer name and at most
        `_MOVE_GROWTH` bytes of fields a rename writes, and a meta another client wrote can grow by
        `GO_ESCAPE_GROWTH` times when written the nats.go way (`meta_json`)."""
        limit = self.store.max_meta_bytes
        if not limit:
            return
        growth = max(0, len(meta_json({"name": new_prefix})) - len(meta_json({"name": old_prefix})))
        near = [info for info in moves if info.name.startswith(old_prefix)
                and (not info.meta_bytes or info.meta_bytes * GO_ESCAPE_GROWTH + growth + _MOVE_GROWTH > limit)]
        if not near:
            return
        limiter = trio.CapacityLimiter(RENAME_DIR_PARALLEL)

        async def check(info: ObjectInfo) -> None:
            async with limiter:
                await self.store.check_rename_size(bucket, info.name, new_prefix + info.name[len(old_prefix):],
                                                   expected_revision=info.revision, change=_rename_change(info))

        with single_errors():
            async with trio.open_nursery() as nursery:
                for info in near:
                    nursery.start_soon(check, info)

    async def _rename_each(self, bucket: str, moves: list[ObjectInfo], old_prefix: str, new_prefix: str,
                           extra_metadata: dict[str, dict[str, str]]) -> None:
        """Rename objects of a directory, `RENAME_DIR_PARALLEL` at a time (each is two round trips, and a
        Spark task commit renames a directory of several files). The first failure (another client
        deleted, renamed or changed an object meanwhile; the server not answering) starts no more
        renames, lets those under way end (a rename cut between its steps would leave two names), moves
        the objects already moved back to their old names, and is raised: a failed rename moved nothing."""
        limiter = trio.CapacityLimiter(RENAME_DIR_PARALLEL)
        moved: list[tuple[ObjectInfo, ObjectInfo]] = []
        failures: list[NatsFSError] = []

        async def move(info: ObjectInfo) -> None:
            async with limiter:
                if failures:
                    return
                try:
                    new_info = await self.rename_object(bucket, info, new_prefix + info.name[len(old_prefix):], None,
                                                        extra_metadata=extra_metadata.get(info.name))
                except NatsFSError as e:
                    failures.append(e)
                    return
                moved.append((info, new_info))

        async with trio.open_nursery() as nursery:
            for info in moves:
                nursery.start_soon(move, info)
        if failures:
            await self._move_back(bucket, moved)
            raise failures[0]

    async def _move_back(self, bucket: str, moved: list[tuple[ObjectInfo, ObjectInfo]]) -> None:
        """Rename objects a failed directory rename moved back to their old names (each a rename like
        any other: its claim of the new name expects the meta the rename stored there). One that cannot
        be moved back (another client changed it meanwhile, the server not answering) stays where it is,
        one log line each: never lost."""
        limiter = trio.CapacityLimiter(RENAME_DIR_PARALLEL)

        async def back(old: ObjectInfo, new: ObjectInfo) -> None:
            async with limiter:
                try:
                    await self.rename_object(bucket, new, old.name, None)
                except NatsFSError as e:
                    log.warning("bucket %s: a failed directory rename could not move %r back to %r (%s); it "
                                "stays under the new name", bucket, new.name, old.name, e)

        # (Shielded, so that a cancelled rename does not stop half way back; bounded, so that a server that
        # does not answer holds it no longer than two settled publishes.)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 2 * self.store.settle_timeout):
            async with trio.open_nursery() as nursery:
                for old, new in moved:
                    nursery.start_soon(back, old, new)
