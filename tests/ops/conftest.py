"""The ops tier: the filesystem core and its FUSE adapter driven directly (no kernel) over MemoryStreams.

`ops_env(body, ...)` builds the mount's graph with the composition root (`natsfs.compose`) over
MemoryStreams inside `trio.run`, starts every background task of a mount in a nursery (bucket watches,
readahead, streaming uploads, settling of unfinished puts; kernel invalidations are only recorded, as
no kernel is attached), runs `async body(env)` and tears everything down. `pyfuse3.readdir_reply` needs
the kernel, so it is replaced by a fake that records entries into the token it is given (an
`opskit.Listing`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio
from helpers import FIXTURES  # noqa: F401 - used by the ops tests
from opskit import Env, fake_readdir_reply

from natsfs.adr20 import ObjectStore
from natsfs.compose import build_filesystem
from natsfs.config import Config
from natsfs.memstreams import MemoryStreams

Setup = Callable[[MemoryStreams, ObjectStore], Awaitable[None]]


@pytest.fixture()
def ops_env(monkeypatch, tmp_path):
    """`run(body, setup=None, bucket=None, streams=None, clock=None, **config)`: build the stack in trio (with
    `clock`, e.g. `trio.testing.MockClock(autojump_threshold=0)` for tests of deadlines), run `body(env)`."""
    monkeypatch.setattr(pyfuse3, "readdir_reply", fake_readdir_reply)

    def run(body: Callable[[Env], Awaitable[Any]], *, setup: Setup | None = None, bucket: str | None = None,
            streams: MemoryStreams | None = None, clock: trio.abc.Clock | None = None, **config_kw: Any) -> Any:
        async def main() -> Any:
            ms = streams or MemoryStreams()
            config = Config(mountpoint=Path("/nonexistent"), bucket=bucket, uid=1234, gid=5678,
                            **({"cache_size": 64 << 20, "cache_dir": tmp_path / "cache"} | config_kw))
            built = build_filesystem(config, ms)
            if setup is not None:
                await setup(ms, built.store)
            async with trio.open_nursery() as nursery:
                await built.start(nursery)
                try:
                    return await body(Env(ms, built.store, built.namespace, built.cache, built.fs, built.ops,
                                          config, nursery))
                finally:
                    nursery.cancel_scope.cancel()

        return trio.run(main, clock=clock)

    return run

