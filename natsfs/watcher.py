"""One bucket's live index: loaded once, then kept in step with the bucket while the mount runs.

`BucketWatcher.run` opens an ordered consumer on the bucket's meta subjects (last message per subject,
then every new one) and applies each meta to the `BucketIndex` as it arrives. Three things a consumer
never delivers are caught here:

- **Purges.** A rename by another client (nats.go `UpdateMeta`) publishes the meta under the new name
  with the same nuid, then purges the old name's meta subject. When a meta arrives whose nuid a
  different live name holds, that name's meta subject is read back (direct get) a few times over a few
  seconds; once it is empty the name is dropped. Purges nothing hints at (a raw purge of a meta subject)
  are found by `reconcile`, every `reconcile_interval` seconds: when the stream changed since the last
  check, the number of meta subjects the server holds is compared with the number the index accounts
  for (one cheap request: the server counts, sends no names); only when they differ are the subjects
  listed and compared name by name.
- **Starting over.** When the watch has to start again from scratch (the stream was deleted and created
  again, lost messages, or the watch itself failed), the new snapshot is built into a fresh index off
  to the side while the old one keeps being served, and swapped in once caught up. Exactly the paths
  that differ are reported, so nothing disappears in between.
- **The server going away.** The consumer is re-created when the server comes back (and resumes after
  the last message it delivered); until then the index is served as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from .adr20 import (
    ObjectStore,
    alias_wildcard_nuid,
    decode_token,
    meta_filter,
    meta_subject,
    parse_meta,
    skipped_wildcard_nuid,
    stream_name,
)
from .config import Config
from .errors import MalformedMeta, NatsFSError, NotFound
from .index import BucketIndex, changed_paths
from .retry import Backoff
from .streams import StoredMsg

log = logging.getLogger(__name__)

Path = tuple[str, ...]

# When (seconds after the meta that showed it) a name suspected of having been renamed away is read back.
CONFIRM_DELAYS = (0.0, 0.05, 0.25, 1.0, 4.0)
# The watch counts as quiet (everything published has arrived) after this long without a message.
QUIET_S = 1.0
# Most subjects a single reconciliation fetches by hand (subjects the consumer seems to have missed).
MAX_FETCH = 1000


class BucketWatcher:
    """A bucket's index and the task (`run`) that keeps it current."""

    def __init__(self, store: ObjectStore, bucket: str, *, on_change: Callable[[Path], None] | None = None,
                 on_gone: Callable[[BucketWatcher], None] | None = None,
                 on_sealed: Callable[[float, bool], None] | None = None,
                 reconcile_interval: float = Config.reconcile_interval, default_created_ns: int = 0):
        self.store = store
        self.bucket = bucket
        self.stream = stream_name(bucket)
        self.index = BucketIndex(bucket)
        self.ready = trio.Event()
        self.error: NatsFSError | None = None
        self.cancel = trio.CancelScope()
        self.gone = False
        self.sealed: bool | None = None  # the bucket's sealed state as last read (watch start, reconcile)
        self.on_change = on_change
        self.on_gone = on_gone
        # Called with (when it was asked, time.monotonic(); the state) at each read of the sealed state.
        self.on_sealed = on_sealed
        self.reconcile_interval = reconcile_interval
        self._default_created_ns = default_created_ns
        self._side: BucketIndex | None = None  # a snapshot being built, served once caught up
        self._building_since = 0.0
        self._confirming: set[str] = set()
        self._restart = False
        self._nursery: trio.Nursery | None = None
        self._last_activity = -1e9  # trio clock
        self._verified: tuple[int, int] | None = None
        self._accepted: tuple[int, int, int, int] | None = None
        self._unknown_before: set[str] = set()
        self._ever_ready = False
        self._ints: dict[int, int] = {}
        self.stats = {"resyncs": 0, "renamed_away": 0, "purged": 0, "reconciles": 0, "listings": 0,
                      "fetched": 0}

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        with self.cancel:
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await self._run()
                    nursery.cancel_scope.cancel()
            finally:
                self.ready.set()

    def restart(self) -> None:
        """Rebuild the index from a fresh snapshot (served as is until the new one is complete)."""
        self._restart = True

    async def _run(self) -> None:
        backoff = Backoff(0.5, 5.0)
        while True:
            try:
                asked_at = time.monotonic()
                status = await self.store.bucket_status(self.bucket)
                watch = await self.store.watch_metas(self.bucket)
            except NotFound as e:
                if not self.ready.is_set():
                    self.error = e
                    return
                if await self._gone_for_sure():
                    return
                continue
            except NatsFSError as e:
                if not self.ready.is_set():
                    self.error = e
                    return
                log.log(logging.WARNING if not backoff.failures else logging.DEBUG,
                        "bucket %s: cannot open the index watch (%s); retrying", self.bucket, e)
                await backoff.pause()
                continue
            backoff.reset()
            self._saw_sealed(asked_at, bool(status.read_only))
            created = status.created_ns or self._default_created_ns
            self._start_side(created)
            try:
                await self._follow(watch)
            except NotFound:
                if await self._gone_for_sure():
                    return
            except NatsFSError as e:
                log.warning("bucket %s: index watch failed (%s); starting it again", self.bucket, e)
                await backoff.pause()
            finally:
                with trio.CancelScope(shield=True):
                    await watch.close()

    async def _gone_for_sure(self) -> bool:
        """The watch says the stream is gone: ask once more (it may have been created again already,
        which makes the index start over instead)."""
        try:
            await self.store.bucket_status(self.bucket)
            return False
        except NotFound:
            pass
        except NatsFSError:
            return False
        log.warning("bucket %s was deleted", self.bucket)
        self.gone = True
        if self.on_gone is not None:
            self.on_gone(self)
        return True

    async def _created_now(self) -> int:
        """The stream's creation time, asked when the watch started over (perhaps because the stream was
        created again: the new snapshot belongs to that incarnation, and nothing of the old one may be
        carried into it); the one known before if the server does not answer."""
        known = self._side.created_ns if self._side is not None else self.index.created_ns
        try:
            status = await self.store.bucket_status(self.bucket)
        except NatsFSError:
            return known
        return status.created_ns or known

    def _start_side(self, created_ns: int) -> None:
        side = BucketIndex(self.bucket, created_ns=created_ns)
        side.root.mtime_ns = created_ns
        self._side = side
        self._building_since = time.monotonic()

    async def _follow(self, watch) -> None:
        while True:
            if self._restart:
                self._restart = False
                self.stats["resyncs"] += 1
                return
            batch = await watch.next_batch(timeout=1.0)
            if batch.reset:
                log.info("bucket %s: the watch started over; rebuilding the index aside", self.bucket)
                self.stats["resyncs"] += 1
                self._start_side(await self._created_now())
            target = self._side if self._side is not None else self.index
            if batch.msgs:
                for m in batch.msgs:
                    self._apply(target, m)
                self._last_activity = trio.current_time()
            if self._side is not None and batch.caught_up:
                self._swap()

    # ------------------------------------------------------------------ applying metas
    def _apply(self, index: BucketIndex, m: StoredMsg) -> None:
        if self._verified is not None and m.seq <= self._verified[1]:
            # A check verified a stream state that already held this meta, against an index that did
            # not: its count matched by chance (a subject purged behind the watch's back standing in for
            # this one). Not verified after all: the next check counts, and lists, again.
            self._verified = None
        try:
            info = parse_meta(self.bucket, m, self._ignored)
        except MalformedMeta as e:
            log.warning("bucket %s: skipping malformed meta: %s", self.bucket, e)
            self._malformed(index, m)
            wild = skipped_wildcard_nuid(self.bucket, m)
            if wild is not None:  # (nats.go reads it: rewritten like any other, `index.wildcard_nuids`)
                index.wildcard_nuids[wild[0]] = (m.seq, wild[1])
            elif (alias := alias_wildcard_nuid(self.bucket, m)) is not None:
                index.alias_wildcards[m.subject] = (m.seq, alias[1], alias[0])  # (after `_malformed`)
            return
        except Exception:
            # Bad input is normal input: one meta must never stop the bucket's index.
            log.exception("bucket %s: skipping meta %s (seq %d) that could not be parsed", self.bucket,
                          m.subject, m.seq)
            self._malformed(index, m)
            return
        name = info.name
        if index.malformed:
            index.malformed.discard(m.subject)
        if info.nuid and not info.deleted:
            for other in index.other_names_with_nuid(info.nuid, name):
                self._suspect(other)
        if info.chunk_size:
            # One int object for the few chunk sizes in use, not one per object.
            info.chunk_size = self._ints.setdefault(info.chunk_size, info.chunk_size)
        # (Likewise the few hundred meta sizes a bucket's objects have.)
        info.meta_bytes = self._ints.setdefault(info.meta_bytes, info.meta_bytes)
        if m.subject and m.subject != meta_subject(self.bucket, name):
            # Not the subject nats.go reads this name from: an alias, shown only while the canonical
            # subject holds nothing, and never replacing or deleting what it holds (`BucketIndex`).
            if m.subject not in index.alias_subjects():
                log.info("bucket %s: meta %s (seq %d) names %r, whose subject is %s: shown only while that "
                         "subject holds nothing", self.bucket, m.subject, m.seq, name,
                         meta_subject(self.bucket, name))
            index.apply_alias(m.subject, info)
            alias = alias_wildcard_nuid(self.bucket, m) if info.wildcard_nuid else None
            if alias is not None:  # (nats.go's Put and Delete of the name this subject is for read it)
                index.alias_wildcards[m.subject] = (m.seq, alias[1], alias[0])
            elif index.alias_wildcards:
                index.alias_wildcards.pop(m.subject, None)
            return
        if index.alias_wildcards:
            index.alias_wildcards.pop(m.subject, None)
        index.apply(info)

    def _ignored(self, why: str) -> None:
        """A field of a meta the index ignores (see `parse_meta`): one line per meta message applied."""
        log.warning("bucket %s: %s", self.bucket, why)

    def _malformed(self, index: BucketIndex, m: StoredMsg) -> None:
        """An unusable meta replaced whatever its subject held: that object is not there any more."""
        index.malformed.add(m.subject)
        if m.subject in index.alias_subjects():
            index.drop_alias(m.subject)
            return
        name = decode_token(m.subject.rsplit(".", 1)[-1]) if m.subject else None
        if name is None or meta_subject(self.bucket, name) != m.subject or name in index.odd_subjects:
            return  # (a name shown from an alias stays: an unusable canonical meta is neither object nor tombstone)
        held = index.objects.get(name)
        if held is not None and held.revision < m.seq:
            index.remove(name)
        elif held is None:
            index.tombstones.pop(name, None)

    def _swap(self) -> None:
        new, old = self._side, self.index
        assert new is not None
        self._side = None
        took = time.monotonic() - self._building_since
        if not self._ever_ready:
            self._ever_ready = True
            new.on_change = self._report
            self.index = new
            log.info("bucket %s: %d objects indexed in %.2fs", self.bucket, len(new), took)
            self.ready.set()
            if self._nursery is not None:
                self._nursery.start_soon(self._reconcile_loop)
            return
        if new.created_ns == old.created_ns:
            # What this mount wrote itself while the snapshot was built (applied to the served index)
            # may not have reached the new one yet: carry it over.
            newest = new.last_revision
            for info in old.objects.values():
                if info.revision > newest:
                    odd = old.odd_subjects.get(info.name)
                    if odd is not None:
                        new.apply_alias(odd, info)
                    else:
                        new.apply(info)
            for name, rev in old.tombstones.items():
                if rev > newest:
                    new.forget(name, rev)
            new.carry_kept(old.root)
        paths = changed_paths(old.root, new.root)
        new.on_change = self._report
        self.index = new
        self._verified = self._accepted = None
        log.info("bucket %s: index rebuilt in %.2fs: %d objects, %d paths changed", self.bucket, took, len(new),
                 len(paths))
        for path in paths:
            self._report(path)

    def _report(self, path: Path) -> None:
        if self.on_change is not None:
            self.on_change(path)

    # ------------------------------------------------------------------ renames
    def _current(self) -> BucketIndex:
        return self._side if self._side is not None else self.index

    def _subject_of(self, index: BucketIndex, name: str) -> str:
        return index.odd_subjects.get(name) or meta_subject(self.bucket, name)

    def _suspect(self, name: str) -> None:
        """`name` shares its nuid with a meta that just arrived: it may have been renamed away."""
        if name in self._confirming or self._nursery is None:
            return
        if self.store.renaming_away(self.bucket, name):
            return  # our own rename: it drops the old name itself once its claim of the old name is stored
        held = self._current().objects.get(name)
        if held is None:
            return
        self._confirming.add(name)
        self._nursery.start_soon(self._confirm, name, held.revision)

    async def _confirm(self, name: str, revision: int) -> None:
        try:
            for delay in CONFIRM_DELAYS:
                if delay:
                    await trio.sleep(delay)
                index = self._current()
                held = index.objects.get(name)
                if held is None or held.revision != revision:
                    return
                try:
                    msg = await self.store.streams.last_msg(self.stream, self._subject_of(index, name))
                except NatsFSError as e:
                    log.debug("bucket %s: reading back the meta of %r failed: %s", self.bucket, name, e)
                    continue
                if msg is None:
                    if self._drop(name, revision):
                        self.stats["renamed_away"] += 1
                        log.info("bucket %s: %r was renamed (or purged) by another client", self.bucket, name)
                    return
                if msg.seq != revision:
                    return  # a newer meta is on its way through the watch
            log.debug("bucket %s: %r shares its nuid with another name and stays", self.bucket, name)
        finally:
            self._confirming.discard(name)

    def _drop(self, name: str, revision: int) -> bool:
        dropped = False
        for index in (self.index, self._side):
            if index is not None and index.remove_if(name, revision):
                dropped = True
        return dropped

    def _saw_sealed(self, asked_at: float, sealed: bool) -> None:
        if self.on_sealed is not None:
            self.on_sealed(asked_at, sealed)  # (first: it compares with what was known before)
        self.sealed = sealed

    # ------------------------------------------------------------------ reconciliation
    async def _reconcile_loop(self) -> None:
        interval = self.reconcile_interval
        while True:
            await trio.sleep(interval)
            if self._side is not None:
                continue
            started = time.monotonic()
            try:
                await self.reconcile()
            except NotFound:
                pass  # the watch finds out and decides
            except NatsFSError as e:
                log.debug("bucket %s: reconciliation failed: %s", self.bucket, e)
            # A check that took t seconds is not repeated before 100 t: huge buckets cost the server ~1%.
            interval = max(self.reconcile_interval, 100 * (time.monotonic() - started))

    async def reconcile(self) -> int:
        """Find meta subjects purged (or missed) behind the consumer's back; the number of names fixed."""
        streams = self.store.streams
        if self._side is not None:
            return 0
        self.stats["reconciles"] += 1
        checked_at = trio.current_time()
        quiet = checked_at - self._last_activity > QUIET_S
        asked_at = time.monotonic()
        st = await streams.stream_info(self.stream)
        self.store.note_created(self.bucket, st.created_ns)
        # (The stream's info says whether it takes writes (sealed, a mirror...), for nothing more:
        # another client may seal it.)
        self._saw_sealed(asked_at, bool(self.store.note_read_only(self.bucket, st.config)))
        index = self.index
        if index.created_ns and st.created_ns and st.created_ns != index.created_ns:
            log.warning("bucket %s: its stream was deleted and created again; rebuilding the index", self.bucket)
            self.restart()
            return 0
        state = (st.messages, st.last_seq)
        if state == self._verified:
            return 0
        filt = meta_filter(self.bucket)
        count = await streams.subject_count(self.stream, filt)
        expected = index.meta_subject_count()
        settled = quiet and self._last_activity < checked_at and self._side is None and index is self.index
        if count == expected:
            if settled:
                self._verified = state
            self._unknown_before = set()
            return 0
        if (*state, count, expected) == self._accepted:
            return 0
        self.stats["listings"] += 1
        listed, listed_seq, complete = await streams.subject_counts(self.stream, filt)
        if self.index is not index or self._side is not None:
            return 0
        fixed = await self._repair(index, listed, listed_seq, complete, quiet)
        if not fixed and settled and not self._unknown_before:
            # A difference nothing here explains (two subjects for one name): not worth a listing
            # every time, until the stream changes.
            self._accepted = (*state, count, expected)
        return fixed

    async def _repair(self, index: BucketIndex, listed: dict[str, int], listed_seq: int, complete: bool,
                      quiet: bool) -> int:
        ours: dict[str, str] = {}
        for i, name in enumerate(list(index.objects)):
            ours[self._subject_of(index, name)] = name
            if i % 5000 == 4999:
                await trio.lowlevel.checkpoint()
        fixed = 0
        # Names whose meta subject holds nothing any more: purged behind the consumer's back.
        for subject, name in ours.items():
            if subject in listed:
                continue
            held = index.objects.get(name)
            if held is None:
                continue
            if not (complete and held.revision <= listed_seq):
                # Not covered by the listing (pages, a scan outrun by writes, or the meta is newer): read it back.
                try:
                    if await self.store.streams.last_msg(self.stream, subject) is not None:
                        continue
                except NatsFSError:
                    continue
            if self._drop(name, held.revision):
                fixed += 1
                self.stats["purged"] += 1
                log.info("bucket %s: the meta of %r was purged by another client", self.bucket, name)
        for name in [n for n in index.tombstones if meta_subject(self.bucket, n) not in listed]:
            index.drop_tombstone(name, index.tombstones[name])
        # Aliases not shown (a shown one is among `ours`) whose subject holds nothing any more.
        for subject in [s for s in index.alias_subjects() if s not in listed and s not in ours]:
            alias = index.alias_at(subject)
            if alias is None:
                continue
            if not (complete and alias.revision <= listed_seq):
                try:
                    if await self.store.streams.last_msg(self.stream, subject) is not None:
                        continue
                except NatsFSError:
                    continue
            if self.index is index:
                index.drop_alias(subject)
        index.malformed.intersection_update(listed)
        # Subjects the index does not account for: the watch is behind, or missed them. Those still
        # unknown at the next quiet check are fetched by hand.
        known = set(ours)
        known.update(meta_subject(self.bucket, n) for n in index.tombstones)
        known.update(index.malformed)
        known.update(index.alias_subjects())
        unknown = {s for s in listed if s not in known}
        stale: list[str] = []
        if unknown and quiet:
            stale = sorted(unknown & self._unknown_before)[:MAX_FETCH]
            for subject in stale:
                try:
                    msg = await self.store.streams.last_msg(self.stream, subject)
                except NatsFSError:
                    continue
                if msg is not None and self.index is index:
                    log.warning("bucket %s: the watch missed %s (seq %d); applied it", self.bucket, subject, msg.seq)
                    self._apply(index, msg)
                    self.stats["fetched"] += 1
                    fixed += 1
        self._unknown_before = (unknown - set(stale)) if quiet and stale else (unknown if quiet else set())
        return fixed


def summary(watchers: list[BucketWatcher]) -> dict[str, int]:
    """Counters of all watchers, summed (for the stats xattr)."""
    out: dict[str, int] = {"objects": 0}
    for w in watchers:
        out["objects"] += len(w.index)
        for k, v in w.stats.items():
            out[k] = out.get(k, 0) + v
    return out

