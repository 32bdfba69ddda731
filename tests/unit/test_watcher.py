"""watcher.BucketWatcher over MemoryStreams: renames and purges by other clients, rebuilding aside, counts."""

from __future__ import annotations

import json

import trio
import trio.testing
from gowriters import delete_object, put_object, rename_object

from natsfs.adr20 import ObjectStore, meta_subject, stream_name
from natsfs.memstreams import MemoryStreams
from natsfs.namespace import Namespace
from natsfs.watcher import BucketWatcher


class Rig:
    def __init__(self, ms: MemoryStreams, store: ObjectStore, watcher: BucketWatcher, changes: list):
        self.ms, self.store, self.w, self.changes = ms, store, watcher, changes

    @property
    def names(self) -> set[str]:
        return set(self.w.index.objects)


def run(body, *, objects: dict[str, bytes] | None = None, ms: MemoryStreams | None = None, autojump: bool = True):
    """Build a bucket `b` holding `objects`, start a watcher on it, run `body(rig)` in trio."""

    async def main():
        streams = ms or MemoryStreams()
        store = ObjectStore(streams)
        await store.create_bucket("b")
        for name, data in (objects or {}).items():
            await put_object(streams, "b", name, data)
        changes: list[tuple[str, ...]] = []
        w = BucketWatcher(store, "b", on_change=changes.append, reconcile_interval=3600)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.run)
            await w.ready.wait()
            try:
                await body(Rig(streams, store, w, changes))
            finally:
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0) if autojump else None)


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def eventually(pred, seconds: float = 30.0) -> bool:
    with trio.move_on_after(seconds):
        while not pred():
            await trio.sleep(0.01)
    return pred()


def test_rename_by_another_client_drops_the_old_name():
    async def body(r: Rig):
        await rename_object(r.ms, "b", "dir/old.txt", "dir/new.txt")
        assert await eventually(lambda: r.names == {"dir/new.txt", "other"})
        assert ("dir", "old.txt") in r.changes and ("dir", "new.txt") in r.changes
        assert r.w.stats["renamed_away"] == 1

    run(body, objects={"dir/old.txt": b"x", "other": b"y"})


def test_rename_half_done_keeps_both_names_until_the_old_meta_is_purged():
    async def body(r: Rig):
        # The first step of UpdateMeta only: the new name, same nuid; the old meta is still there.
        msg = await r.ms.last_msg(stream_name("b"), meta_subject("b", "a"))
        doc = json.loads(msg.data) | {"name": "b"}
        await r.ms.publish(meta_subject("b", "b"), json.dumps(doc).encode(), {"Nats-Rollup": "sub"})
        await trio.sleep(60)  # every read-back has happened: "a" still exists
        assert r.names == {"a", "b"}
        assert r.w.index.names_with_nuid(doc["nuid"]) == ["a", "b"]
        # The second step comes late: the periodic reconciliation finds it.
        await r.ms.purge_subject(stream_name("b"), meta_subject("b", "a"))
        assert await r.w.reconcile() == 1
        assert r.names == {"b"}

    run(body, objects={"a": b"same chunks"})


def test_a_raw_purge_of_a_meta_subject_is_found_by_reconciliation():
    async def body(r: Rig):
        assert await r.w.reconcile() == 0
        await r.ms.purge_subject(stream_name("b"), meta_subject("b", "d/gone"))
        await settle()
        assert "d/gone" in r.names  # no consumer delivers a purge
        assert await r.w.reconcile() == 1
        assert r.names == {"kept"}
        assert ("d", "gone") in r.changes and ("d",) in r.changes
        assert r.w.stats["purged"] == 1

    run(body, objects={"d/gone": b"1", "kept": b"2"})


def test_reconciliation_costs_one_request_while_the_stream_is_unchanged():
    async def body(r: Rig):
        await trio.sleep(5)  # the watch is quiet
        await r.w.reconcile()
        calls = dict(r.ms.calls)
        await r.w.reconcile()
        assert r.ms.calls["stream_info"] == calls["stream_info"] + 1
        assert r.ms.calls["subject_count"] == calls.get("subject_count", 0)
        assert r.ms.calls["subject_counts"] == calls.get("subject_counts", 0)
        # Tombstones count as meta subjects: a delete does not make the counts differ.
        await delete_object(r.ms, "b", "x1")
        await trio.sleep(5)
        assert await r.w.reconcile() == 0
        assert r.ms.calls["subject_counts"] == calls.get("subject_counts", 0)

    run(body, objects={f"x{i}": b"." for i in range(20)})


def test_reconciliation_fetches_a_meta_the_watch_missed():
    async def body(r: Rig):
        index = r.w.index
        lost = index.objects["m"]
        # Pretend the consumer never delivered "m" (as if its message had been lost on the way).
        del index.objects["m"]
        index.root.children.pop("m")
        await trio.sleep(5)
        assert await r.w.reconcile() == 0  # first sighting: maybe the watch is just behind
        await trio.sleep(5)
        assert await r.w.reconcile() == 1
        assert index.objects["m"].revision == lost.revision
        assert r.w.stats["fetched"] == 1

    run(body, objects={"m": b"missed", "n": b"seen"})


def test_unusable_meta_replacing_an_object_removes_it_and_counts_as_a_subject():
    async def body(r: Rig):
        await r.ms.publish(meta_subject("b", "f"), b"{not json", {"Nats-Rollup": "sub"})
        await settle()
        assert r.names == {"g"}
        assert r.w.index.meta_subject_count() == 2
        await trio.sleep(5)
        assert await r.w.reconcile() == 0

    run(body, objects={"f": b"1", "g": b"2"})


def test_reset_rebuilds_aside_without_phantom_deletions():
    objects = {f"d{i % 7}/f{i:04d}": b"%d" % i for i in range(700)}
    ms = MemoryStreams(watch_batch=50)

    async def body(r: Rig):
        r.ms.delay = 0.0005  # every operation takes a little time, so the rebuild spans many steps
        before = dict(r.w.index.objects)
        # Behind the consumer's back, then the watch has to start over.
        await r.ms.purge_subject(stream_name("b"), meta_subject("b", "d2/f0002"))
        r.ms.reset_watches()
        for _ in range(10_000):
            if r.w._side is not None:
                break
            await trio.sleep(0)
        assert r.w._side is not None
        building = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(put_object, r.ms, "b", "d1/f0001", b"changed")  # while it is built
            while r.w._side is not None:
                # Served all along: nothing disappears while the new snapshot is built.
                assert set(before) <= set(r.w.index.objects)
                building += 1
                await trio.sleep(0)
        assert building > 3  # the rebuild spanned several batches
        assert await eventually(lambda: r.w.index.objects["d1/f0001"].size == len(b"changed"))
        assert set(r.names) == set(before) - {"d2/f0002"}
        # Exactly what differs is reported, nothing else.
        assert set(r.changes) == {("d1", "f0001"), ("d2", "f0002")}
        assert r.w.stats["resyncs"] == 1

    run(body, objects=objects, ms=ms, autojump=False)


def test_stream_deleted_and_created_again_is_rebuilt():
    async def body(r: Rig):
        await r.store.delete_bucket("b")
        await r.store.create_bucket("b")
        await put_object(r.ms, "b", "second", b"2")
        assert await eventually(lambda: r.names == {"second"})
        assert not r.w.gone
        assert ("first",) in r.changes and ("second",) in r.changes

    run(body, objects={"first": b"1"})


def test_deleted_bucket_stops_its_watcher_and_is_reported():
    async def main():
        ms = MemoryStreams()
        store = ObjectStore(ms)
        await store.create_bucket("gone")
        await put_object(ms, "gone", "f", b"1")
        ns = Namespace(store, reconcile_interval=3600)
        seen: list = []
        ns.on_change = lambda b, p: seen.append((b, p))
        async with trio.open_nursery() as nursery:
            await ns.start(nursery)
            await ns.index("gone")
            assert ns.loaded_buckets() == ["gone"]
            await store.delete_bucket("gone")
            await settle()
            assert ns.loaded_buckets() == [] and ns.loaded_index("gone") is None
            assert ("gone", None) in seen
            assert not await ns.bucket_exists("gone")
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_bucket_missing_from_one_listing_is_kept_until_confirmed_gone():
    async def main():
        ms = MemoryStreams()
        store = ObjectStore(ms)
        await store.create_bucket("stays")
        ns = Namespace(store)
        async with trio.open_nursery() as nursery:
            await ns.start(nursery)
            real = ms.stream_names

            async def flaky() -> list[str]:
                return []

            ms.stream_names = flaky  # a server that lists nothing for a moment
            assert await ns.refresh_buckets() == {"stays"}
            ms.stream_names = real
            await store.delete_bucket("stays")
            assert await ns.refresh_buckets() == set()
            nursery.cancel_scope.cancel()

    trio.run(main)
