"""A cache disk (a 4 MiB tmpfs) too full for lost+found: a refused close keeps its bytes staged, the
daemon says so in one line and stays up, and the bytes land in lost+found once space frees (here: at
unmount). Needs root for the tmpfs."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from helpers import create_bucket, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs as the cache disk needs root")


def fill(directory: Path) -> Path:
    """A file that takes every free byte of `directory`'s file system."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        block = bytes(64 * 1024)
        while True:
            try:
                os.write(fd, block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    return filler
                block = block[: len(block) // 2]
    finally:
        os.close(fd)


@pytest.mark.expect_log(r"f\.bin: its bytes \(50000\) could not be written to .*lost\+found \(No space left on device")
def test_a_refused_close_on_a_full_cache_disk_keeps_its_bytes_once_space_frees(nats_url, bucket_name, mounter,
                                                                                tmp_path):
    create_bucket(nats_url, bucket_name, max_bytes=1000)  # refuses the put below: the close fails
    cache = tmp_path / "cache0"  # the first mount's cache dir
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(cache)], check=True)
    m = None
    try:
        m = mounter(nats_url, "--bucket", bucket_name)
        data = os.urandom(50_000)  # a small new file: held in memory until its close
        fd = os.open(m / "f.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, data)
        filler = fill(cache)
        with pytest.raises(OSError) as e:
            os.close(fd)
        assert e.value.errno == errno.ENOSPC
        assert wait_for(lambda: "could not be written to" in m.log())  # the release after the close
        assert m.alive and not list(cache.rglob("f.bin*"))  # nothing partial that looks kept
        os.unlink(filler)
        m.stop()  # the unmount keeps what is held
        kept = list(cache.rglob("lost+found/*/f.bin.*"))
        assert [p.read_bytes() for p in kept] == [data]
        assert "its bytes are now kept at" in m.log()
    finally:
        if m is not None:
            m.stop()  # (before the tmpfs goes; the fixture's own stop then finds nothing to do)
        subprocess.run(["umount", str(cache)], check=False)
