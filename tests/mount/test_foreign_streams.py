"""Streams named `OBJ_<name>` that another client made and that are not the object store nats.go's
CreateObjectStore makes, on a real server through a real mount (see tests/ops/test_ops_foreign_streams.py).

Without the classification, each of them showed as a writable bucket whose every write failed only at
close (`ENOENT`: no stream takes the subject, or `EIO`: rollup not permitted), the bytes in lost+found."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time

import pytest
from helpers import create_bucket, nats_py_put, wait_for, with_nats
from nats.js.api import StreamSource, SubjectTransform
from nats.js.errors import NotFoundError


def _errno(fn) -> int:
    with pytest.raises(OSError) as e:
        fn()
    return e.value.errno


def writable(path) -> bool:
    return bool(os.stat(path).st_mode & 0o222)


@pytest.fixture
def foreign_streams(nats_url, bucket_name):
    """The streams' names; they are deleted after the test's mount is gone (this fixture is set up before
    `mounter`, so torn down after it): left on the session's server, they would put an INFO line naming
    their subjects into every later all-buckets mount's log."""
    names = {k: f"{bucket_name}_{k}" for k in "omsfn"}
    yield names

    async def drop(nc, js):
        for name in names.values():
            with contextlib.suppress(NotFoundError):  # (the test may have failed before making it)
                await js.delete_stream(f"OBJ_{name}")

    with_nats(nats_url, drop)


def test_foreign_obj_streams_are_hidden_or_read_only(nats_url, foreign_streams, mounter):
    origin, mirror, sourced = foreign_streams["o"], foreign_streams["m"], foreign_streams["s"]
    foo, norollup = foreign_streams["f"], foreign_streams["n"]
    create_bucket(nats_url, origin)
    nats_py_put(nats_url, origin, "hello", b"hi there", create=False)

    async def make(nc, js):
        # A mirror of an object store, its subjects mapped to its own bucket name (as nats.go reads it).
        await js.add_stream(name=f"OBJ_{mirror}", allow_rollup_hdrs=True, allow_direct=True, mirror_direct=True,
                            mirror=StreamSource(name=f"OBJ_{origin}", subject_transforms=[
                                SubjectTransform(src=f"$O.{origin}.>", dest=f"$O.{mirror}.>")]))
        await js.add_stream(name=f"OBJ_{sourced}", sources=[StreamSource(name=f"OBJ_{origin}")],
                            allow_rollup_hdrs=True)
        await js.add_stream(name=f"OBJ_{foo}", subjects=[f"{foo}.>"])
        await js.publish(f"{foo}.x", b"not an object")
        # deny_purge: the server then allows no rollups either.
        await js.add_stream(name=f"OBJ_{norollup}", subjects=[f"$O.{norollup}.C.>", f"$O.{norollup}.M.>"],
                            deny_purge=True)

    with_nats(nats_url, make)
    m = mounter(nats_url)
    assert wait_for(lambda: (m.path / mirror / "hello").exists())
    assert (m.path / mirror / "hello").read_bytes() == b"hi there"
    names = set(os.listdir(m.path))
    assert {origin, mirror, sourced, norollup} <= names and foo not in names
    assert _errno(lambda: os.stat(m.path / foo)) == errno.ENOENT
    assert _errno(lambda: os.mkdir(m.path / foo)) == errno.EEXIST
    assert _errno(lambda: os.rmdir(m.path / foo)) == errno.ENOENT
    for b in (mirror, sourced, norollup):
        assert not writable(m.path / b)
        # Refused at the open, not at the close: nothing goes to lost+found.
        assert _errno(lambda b=b: os.open(m.path / b / "new", os.O_WRONLY | os.O_CREAT)) == errno.EROFS
        assert _errno(lambda b=b: os.mkdir(m.path / b / "d")) == errno.EROFS
    assert not writable(m.path / mirror / "hello")
    assert _errno(lambda: os.open(m.path / mirror / "hello", os.O_RDWR)) == errno.EROFS
    assert _errno(lambda: os.unlink(m.path / mirror / "hello")) == errno.EROFS
    assert _errno(lambda: os.rename(m.path / mirror / "hello", m.path / mirror / "moved")) == errno.EROFS
    # The origin itself takes writes, and the mirror follows it.
    (m.path / origin / "later").write_bytes(b"later bytes")
    assert wait_for(lambda: (m.path / mirror / "later").exists())
    assert (m.path / mirror / "later").read_bytes() == b"later bytes"
    for _ in range(3):  # listings after the first do not log it again
        os.listdir(m.path)
        time.sleep(0.1)

    async def foo_messages(nc, js):
        return (await js.stream_info(f"OBJ_{foo}")).state.messages

    assert with_nats(nats_url, foo_messages) == 1
    assert not (m.cache_dir.exists() and any(p.is_file() for p in m.cache_dir.rglob("lost+found/**/*")))
    lines = re.findall(rf"INFO natsfs\.adr20: stream OBJ_{foo} is not an object store", m.log())
    assert len(lines) == 1
