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
