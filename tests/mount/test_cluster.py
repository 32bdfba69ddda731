"""Scale-out: natsfs on a 3-node NATS cluster with R3 buckets, nodes killed (SIGKILL) and restarted under
reads, writes and the Spark pipeline; two mounts (two daemons) of one bucket. Data is checked with a
fresh client; no error may reach the application or the daemon's log."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

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
    a = cluster_mount(mounter, cluster, [0, 1, 2])
    b = cluster_mount(mounter, cluster, [2, 1, 0])
    (a.path / bucket_name).mkdir()
    assert wait_for(lambda: (b.path / bucket_name).is_dir(), timeout=5)
    pa, pb = a.path / bucket_name, b.path / bucket_name
    lags = []
    for i in range(5):
        data = random.Random(i).randbytes(300_000 + i)
        src, dst = (pa, pb) if i % 2 == 0 else (pb, pa)
        (src / f"f{i}").write_bytes(data)
        t0 = time.monotonic()
        target = dst / f"f{i}"
        assert wait_for(lambda t=target, d=data: seen(t, d), timeout=5, interval=0.01), f"{target} not seen"
        lags.append(time.monotonic() - t0)
    (pa / "f0").write_bytes(b"replaced")
    assert wait_for(lambda: (pb / "f0").read_bytes() == b"replaced", timeout=5, interval=0.01)
    (pb / "f1").rename(pb / "moved")
    assert wait_for(lambda: not (pa / "f1").exists() and (pa / "moved").exists(), timeout=5, interval=0.01)
    (pa / "moved").unlink()
    assert wait_for(lambda: not (pb / "moved").exists(), timeout=5, interval=0.01)
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
    assert wait_for(lambda: (b.path / bucket_name).is_dir(), timeout=5)
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
