"""Stream limits another client sets on a mounted bucket, against a real nats-server: the server's
advisory makes the mount read the config again, a version the stream could never hold whole is refused
at close (`E2BIG`, bytes in lost+found) before anything is sent, and the version it would have replaced
stays whole for other clients (nats-py reads it back)."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
from helpers import create_bucket, nats_py_get, nats_py_put, stored_layout, wait_for, with_nats


def _set_limits(url: str, bucket: str, **changes: Any) -> None:
    async def fn(nc: Any, js: Any) -> None:
        config = (await js.stream_info(f"OBJ_{bucket}")).config
        for key, value in changes.items():
            setattr(config, key, value)
        await js.update_stream(config)

    with_nats(url, fn)


def _rewrite(path: Any, data: bytes) -> int:
    """Write `data` over `path` and close: the close's errno (0: stored)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, data)
    finally:
        try:
            os.close(fd)
        except OSError as e:
            return e.errno or 0
    return 0


@pytest.mark.parametrize("limit", ["max_msgs_per_subject", "max_bytes"])
def test_a_version_the_stream_cannot_hold_whole_is_refused_and_the_old_one_stays(nats_url, bucket_name, mounter,
                                                                                 limit):
    from nats.js.api import DiscardPolicy

    create_bucket(nats_url, bucket_name)
    # (A version the limit cuts is cut by the config change itself: the server applies it at once.)
    old = os.urandom(100_000 if limit == "max_msgs_per_subject" else 300_000)
    nats_py_put(nats_url, bucket_name, "a.bin", old, create=False)
    m = mounter(nats_url)
    assert (m.path / bucket_name / "a.bin").read_bytes() == old
    if limit == "max_msgs_per_subject":
        _set_limits(nats_url, bucket_name, max_msgs_per_subject=1)
        new = os.urandom(300_000)  # 3 chunks
    else:
        _set_limits(nats_url, bucket_name, max_bytes=400_000, discard=DiscardPolicy.OLD)
        new = os.urandom(600_000)
    # The server announces the update; the mount reads the bucket's config again before its next put.
    assert wait_for(lambda: f"bucket {bucket_name}: its stream config was updated" in m.log())
    m.expect_log(r"a\.bin: closed without a successful upload \(a version of")
    assert _rewrite(m.path / bucket_name / "a.bin", new) == errno.E2BIG
    assert nats_py_get(nats_url, bucket_name, "a.bin") == old
    layout = stored_layout(nats_url, bucket_name, "a.bin")
    assert (layout["stored_size"], layout["stored_digest_ok"]) == (len(old), True)
    assert (m.path / bucket_name / "a.bin").read_bytes() == old
    kept = [p for p in m.cache_dir.rglob("lost+found/*/*") if p.is_file()]
    assert [p.read_bytes() for p in kept] == [new]
    assert f"the stream's {limit} is" in m.log()
