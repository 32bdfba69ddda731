"""link() is refused (EPERM: see docs/SEMANTICS.md) with one INFO line per mount, not one per call.

git tries link() for every object it writes (then falls back to rename): a clone of 217 files wrote
219 identical INFO lines. The first refusal says that further ones are logged at DEBUG only.
"""

from __future__ import annotations

import errno
import logging

import pyfuse3
import pytest
from gowriters import put_object
from opskit import CTX, ROOT, Env, errno_of

from natsfs.adr20 import ObjectStore
from natsfs.memstreams import MemoryStreams


async def bucket_b(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "obj", b"an object\n")


def test_many_refused_links_log_one_info_line(ops_env, caplog):
    caplog.set_level(logging.DEBUG)

    async def body(env: Env):
        attr = await env.lookup("obj")
        for i in range(50):
            with pytest.raises(pyfuse3.FUSEError) as e:
                await env.ops.link(attr.st_ino, ROOT, f"tmp_obj_{i}".encode(), CTX)
            assert errno_of(e.value) == errno.EPERM

    ops_env(body, setup=bucket_b, bucket="b")
    refusals = [r for r in caplog.records if "hard links are not supported" in r.getMessage()]
    assert len(refusals) == 50  # every one is still there at DEBUG
    info = [r.getMessage() for r in refusals if r.levelno >= logging.INFO]
    assert len(info) == 1 and "further" in info[0]
