"""Scale-out: natsfs on a 3-node NATS cluster with R3 buckets, nodes killed (SIGKILL) and restarted under
reads, writes and the Spark pipeline; two mounts (two daemons) of one bucket. Data is checked with a
fresh client; no error may reach the application or the daemon's log."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import nats_py_get, nats_py_put, stored_layout, wait_for, with_nats
from pipeline import local_summary, require_spark, run_pipeline

from natsfs.server import NatsCluster


@pytest.fixture()
def cluster(tmp_path):
    c = NatsCluster(tmp_path / "cluster")
    c.start()
    yield c
    c.stop()


def cluster_mount(mounter, cluster: NatsCluster, order: list[int]):
    return mounter(",".join(cluster.urls[i] for i in order), "--replicas", "3")


def stream_leader(cluster: NatsCluster, bucket: str) -> int:
    async def fn(nc, js):
        return (await js.stream_info(f"OBJ_{bucket}")).cluster.leader

    name = with_nats(cluster.urls[0], fn)
    return int(name.rsplit("-n", 1)[1])


def connected_node(cluster: NatsCluster, name: str = "natsfs") -> int:
    import json
    import urllib.request

    for i in range(len(cluster.nodes)):
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_ports[i]}/connz", timeout=5) as r:
            if any(c.get("name") == name for c in json.load(r)["connections"] or []):
                return i
    raise AssertionError(f"no node has a connection named {name}")


def replicas_current(cluster: NatsCluster, bucket: str) -> bool:
    """Every replica of the bucket's stream reports itself current, with no lag."""
    async def fn(nc, js):
        info = await js.stream_info(f"OBJ_{bucket}")
        replicas = info.cluster.replicas or []
        return len(replicas) == len(cluster.nodes) - 1 and all(r.current and not r.lag for r in replicas)

    try:
        return bool(with_nats(cluster.urls[0], fn))
    except Exception:
        return False


def clean_log(m) -> None:
    problems = [line for line in m.log().splitlines() if " ERROR " in line or "Traceback" in line]
    assert not problems, "\n".join(problems[:20])


def write_slowly(path: Path, data: bytes, errors: list[BaseException]) -> None:
    try:
        with open(path, "wb") as f:
            for pos in range(0, len(data), 256 * 1024):
                f.write(data[pos:pos + 256 * 1024])
                time.sleep(0.02)
    except BaseException as e:
        errors.append(e)


def read_into(path: Path, out: dict[str, bytes], errors: list[BaseException]) -> None:
    try:
        time.sleep(0.1)
        out[path.name] = path.read_bytes()
    except BaseException as e:
        errors.append(e)


def seen(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except FileNotFoundError:
        return False


def test_reads_and_writes_go_on_while_each_node_is_killed_and_restarted(cluster, mounter, bucket_name):
    m = cluster_mount(mounter, cluster, [0, 1, 2])
    b = m.path / bucket_name
    b.mkdir()
    rng = random.Random(14)
    sources = {f"r{i}": rng.randbytes(3_000_000 + i) for i in range(3)}
    for name, data in sources.items():  # written by another client, read first during a kill
        nats_py_put(cluster.urls[2], bucket_name, name, data, create=False)
    assert wait_for(lambda: all((b / n).exists() for n in sources))
    written = {f"w{i}": rng.randbytes(2_500_000 + i) for i in range(3)}
    # The stream's leader (an election follows), the mount's own node (a reconnect), then the third.
    victims = list(dict.fromkeys([stream_leader(cluster, bucket_name), connected_node(cluster), 0, 1, 2]))[:3]
    for round_no, victim in enumerate(victims):
        errors: list[BaseException] = []
        read_back: dict[str, bytes] = {}
        threads = [threading.Thread(target=write_slowly, args=(b / f"w{round_no}", written[f"w{round_no}"], errors)),
                   threading.Thread(target=read_into, args=(b / f"r{round_no}", read_back, errors))]
        for t in threads:
            t.start()
        time.sleep(0.05)
        cluster.kill(victim)
        for t in threads:
            t.join(90)
        cluster.restart(victim)
        assert not errors, f"round {round_no} (node {victim} killed): {errors!r}"
        assert read_back[f"r{round_no}"] == sources[f"r{round_no}"]
    for name in written:
        # What the stream holds (read from its leader, message by message)...
        layout = stored_layout(cluster.urls[round_no % 3], bucket_name, name)
        assert layout["stored_chunks"] == layout["chunks"] and layout["stored_digest_ok"], layout
    # ...then what another client reads through a consumer, once the restarted node has caught up: an
    # ordered consumer placed on a replica still catching up can miss messages (nats-py then reports a
    # digest mismatch of an object whose stored messages are exact, as checked above).
    assert wait_for(lambda: replicas_current(cluster, bucket_name), timeout=30)
    for name, data in written.items():
        assert nats_py_get(cluster.urls[round_no % 3], bucket_name, name) == data  # a fresh client
        assert (b / name).read_bytes() == data
    clean_log(m)


def test_two_mounts_of_one_bucket_see_each_others_changes_at_once(cluster, mounter, bucket_name):
    """Through the watch: generous bounds (a loaded machine), no latency asserted. The overwrite and the
    rename change no subject count, so the periodic reconciliation could not bring them: only the watch
    does."""
    a = cluster_mount(mounter, cluster, [0, 1, 2])
    b = cluster_mount(mounter, cluster, [2, 1, 0])
    (a.path / bucket_name).mkdir()
    assert wait_for(lambda: (b.path / bucket_name).is_dir(), timeout=60)
    pa, pb = a.path / bucket_name, b.path / bucket_name
    lags = []
    for i in range(5):
        data = random.Random(i).randbytes(300_000 + i)
        src, dst = (pa, pb) if i % 2 == 0 else (pb, pa)
        (src / f"f{i}").write_bytes(data)
        t0 = time.monotonic()
        target = dst / f"f{i}"
        assert wait_for(lambda t=target, d=data: seen(t, d), timeout=60, interval=0.01), f"{target} not seen"
        lags.append(time.monotonic() - t0)
    (pa / "f0").write_bytes(b"replaced")
    assert wait_for(lambda: (pb / "f0").read_bytes() == b"replaced", timeout=60, interval=0.01)
    (pb / "f1").rename(pb / "moved")
    assert wait_for(lambda: not (pa / "f1").exists() and (pa / "moved").exists(), timeout=60, interval=0.01)
    (pa / "moved").unlink()
    assert wait_for(lambda: not (pb / "moved").exists(), timeout=60, interval=0.01)
    print(f"seen by the other mount after {max(lags):.3f}s at most")
    clean_log(a)
    clean_log(b)


def test_spark_pipeline_with_a_node_killed_mid_run_reads_back_through_another_mount(
        cluster, mounter, bucket_name, tmp_path):
    require_spark()
    expected = local_summary(tmp_path.parent)
    a = cluster_mount(mounter, cluster, [0, 1, 2])
    b = cluster_mount(mounter, cluster, [1, 2, 0])
    (a.path / bucket_name).mkdir()
    assert wait_for(lambda: (b.path / bucket_name).is_dir(), timeout=60)
    victim = stream_leader(cluster, bucket_name)
    killer = threading.Timer(8.0, lambda: (cluster.kill(victim), time.sleep(3), cluster.restart(victim)))
    killer.start()
    try:
        got = run_pipeline(a.path / bucket_name / "run", read_root=b.path / bucket_name / "run",
                           log=tmp_path / "spark.log")
    finally:
        killer.join()
    assert got == expected
    assert Path(b.path / bucket_name / "run" / "output" / "region_month" / "_SUCCESS").exists()
    clean_log(a)
    clean_log(b)


def natsfs_connections(cluster: NatsCluster, i: int) -> dict[str, int]:
    """Node i's client connections named `natsfs`, by kind: "main" (nats-py) and "lean" (`natsfs.wire`)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_ports[i]}/connz", timeout=5) as r:
        conns = [c for c in json.load(r)["connections"] or [] if c.get("name") == "natsfs"]
    return {"main": sum(c.get("version") != "natsfs-wire" for c in conns),
            "lean": sum(c.get("version") == "natsfs-wire" for c in conns)}


def test_the_lean_connections_node_dying_keeps_the_reply_budget(cluster, caplog):
    """The lean connection (reads) on one node, the main one on another, replies in flight: the lean
    one's node is killed. Its loss is no slow-consumer kick: the node cannot be reached again, so the
    reply budget stays at 32 MiB (one INFO line says the server is gone), the lean connection moves on
    to the next node, and a batch of 2.5 MiB comes back in one request over it. Before, the budget
    dropped to 256 KiB for ten minutes, as for a kick."""
    import logging

    import trio

    from natsfs.bridge import REPLY_BUDGET, Bridge, _TrioReads
    from natsfs.errors import Unavailable
    from natsfs.jetstream import JetStreams

    chunks = [bytes([i]) * (128 * 1024) for i in range(20)]

    async def lean_on(node: int, bridge: Bridge) -> None:
        reads = bridge._reads
        assert isinstance(reads, _TrioReads)
        with trio.fail_after(30):
            while not (reads.nc is not None
                       and await trio.to_thread.run_sync(natsfs_connections, cluster, node) == {"main": 0, "lean": 1}):
                await trio.sleep(0.05)

    async def main() -> None:
        bridge = Bridge(cluster.urls)  # both connections on node 0 first
        await bridge.connect()
        try:
            assert bridge.reads_in_trio
            assert await trio.to_thread.run_sync(natsfs_connections, cluster, 0) == {"main": 1, "lean": 1}
            await bridge.api("STREAM.CREATE.OBJ_dies", {"name": "OBJ_dies", "subjects": ["$O.dies.C.>"],
                                                        "allow_direct": True, "num_replicas": 3})
            for c in chunks:
                await bridge.js_publish("$O.dies.C.x", c)
            reads = bridge._reads
            assert isinstance(reads, _TrioReads) and reads.nc is not None
            reads.nc.close()  # nothing in flight: the next server in turn, node 1
            await lean_on(1, bridge)
            caplog.clear()
            held = await bridge._budget.acquire(4 * 1024 * 1024)  # replies in flight
            await trio.to_thread.run_sync(cluster.kill, 1)
            await lean_on(2, bridge)
            bridge._budget.release(held)  # (as the reads that were in flight give theirs back)
            assert bridge._budget.limit == REPLY_BUDGET
            messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "natsfs.bridge"]
            gone = [m for m in messages if "is gone, not a slow-consumer kick" in m[1]]
            assert [level for level, _ in gone] == [logging.INFO], messages
            assert f"127.0.0.1:{cluster.client_ports[1]}" in gone[0][1]
            assert not [m for m in messages if m[0] >= logging.WARNING], messages
            assert bridge.connected and bridge.reconnects == 0  # the main connection never noticed
            js = JetStreams(bridge)
            got: list[Any] = []
            with trio.fail_after(30):
                while len(got) < len(chunks):
                    try:
                        got = await js.get_batch("OBJ_dies", "$O.dies.C.x", 1, 100, 8 << 20)
                    except Unavailable:  # (503: the stream's responders move off the killed node)
                        got = []
                    assert [bytes(m.data) for m in got] == chunks[: len(got)]  # (or a replica catching up)
                    await trio.sleep(0.1)
            assert [bytes(m.data) for m in got] == chunks
        finally:
            await bridge.close()

    caplog.set_level(logging.INFO, logger="natsfs.bridge")
    trio.run(main)
