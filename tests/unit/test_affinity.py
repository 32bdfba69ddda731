"""Which CPU a mount's threads are kept on (natsfs/affinity.py)."""

from __future__ import annotations

import collections
from pathlib import Path

from natsfs import affinity


def _process(proc: Path, pid: int, cmdline: bytes, allowed: str) -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "cmdline").write_bytes(cmdline)
    (proc / str(pid) / "status").write_bytes(f"Name:\tpython3\nCpus_allowed_list:\t{allowed}\n".encode())


def test_other_mounts_are_counted_by_their_notifiers(tmp_path):
    _process(tmp_path, 10, b"python3\0-I\0-m\0natsfs.notifier\0007\0009\0", "1")
    _process(tmp_path, 11, b"python3\0-I\0-m\0natsfs.notifier\0007\00012\0", "1")
    _process(tmp_path, 12, b"python3\0-I\0-m\0natsfs.notifier\0007\00013\0", "0-3")  # --cpus any
    _process(tmp_path, 13, b"python3\0-m\0natsfs.bridge\0upload-worker\0", "2")
    _process(tmp_path, 14, b"bash\0", "3")
    (tmp_path / "15").mkdir()  # gone before its files were read
    (tmp_path / "self").mkdir()
    assert affinity.mounts_per_cpu(str(tmp_path)) == collections.Counter({1: 2})


def test_the_current_cpu_unless_another_has_fewer_mounts():
    allowed = {0, 1, 2, 3}
    assert affinity._pick(allowed, 2, collections.Counter()) == 2
    assert affinity._pick(allowed, 2, collections.Counter({2: 1})) == 0
    assert affinity._pick(allowed, 2, collections.Counter({0: 1, 2: 1})) == 1
    assert affinity._pick(allowed, 2, collections.Counter({0: 1, 1: 1, 2: 1, 3: 1})) == 2
    assert affinity._pick({0, 1}, 1, collections.Counter({1: 2, 0: 1, 5: 0})) == 0


STAT = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 {b0} 0 0 {i0} 0 0 0 0 0 0
cpu1 {b1} 0 0 {i1} 5 0 0 0 0 0
intr 12345
"""


def test_cpu_ticks_count_busy_and_total_per_cpu():
    ticks = affinity.cpu_ticks(STAT.format(b0=30, i0=70, b1=10, i1=85))
    assert ticks == {0: (30, 100), 1: (10, 100)}  # iowait counts as idle


def test_threads_move_only_off_a_cpu_that_other_work_took():
    assert affinity.better_cpu({0: 0.9, 1: 0.1}, 0, own=0.8) is None  # busy with our own work
    assert affinity.better_cpu({0: 0.9, 1: 0.1}, 0, own=0.1) == 1
    assert affinity.better_cpu({0: 0.9, 1: 0.7}, 0, own=0.1) is None  # the other one is no better
    assert affinity.better_cpu({0: 1.0, 1: 0.9, 2: 0.2, 3: 0.2}, 0, own=0.0) == 2
    assert affinity.better_cpu({0: 1.0}, 0, own=0.0) is None


def test_rebalancer_moves_when_its_cpu_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(affinity, "_original", {0, 1})
    monkeypatch.setattr(affinity, "_chosen", 0)
    moved = []
    monkeypatch.setattr(affinity.Rebalancer, "_move", lambda self, old, new: moved.append((old, new)))
    stat = tmp_path / "stat"
    rebalancer = affinity.Rebalancer(str(tmp_path))
    stat.write_text(STAT.format(b0=0, i0=0, b1=0, i1=0))
    assert rebalancer.check() is None  # the first sample only
    stat.write_text(STAT.format(b0=95, i0=5, b1=5, i1=95))  # CPU 0 taken by other work
    assert rebalancer.check() == 1 and moved == [(0, 1)] and rebalancer.moves == 1
    stat.write_text("garbage\ncpu0 x y\n")
    assert rebalancer.check() is None  # never raises


def test_rebalancer_does_nothing_when_nothing_was_pinned(tmp_path, monkeypatch):
    monkeypatch.setattr(affinity, "_original", None)
    assert affinity.Rebalancer(str(tmp_path)).check() is None
