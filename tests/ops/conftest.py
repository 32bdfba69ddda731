"""The ops tier: `natsfs.fs.Operations` driven directly (no kernel) over MemoryStreams.

`ops_env(body, ...)` builds MemoryStreams → ObjectStore → Namespace + ChunkCache → Operations inside
`trio.run` with a nursery (Namespace.start and readahead need one), runs `async body(env)` and tears
everything down. `pyfuse3.readdir_reply` needs the kernel, so it is replaced by a fake that records
entries into the token it is given (an `opskit.Listing`).
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
from natsfs.chunk_cache import ChunkCache
from natsfs.config import Config
from natsfs.fs import Operations
from natsfs.memstreams import MemoryStreams
from natsfs.namespace import Namespace

Setup = Callable[[MemoryStreams, ObjectStore], Awaitable[None]]


@pytest.fixture()
def ops_env(monkeypatch, tmp_path):
    """`run(body, setup=None, bucket=None, streams=None, **config)`: build the stack in trio, run `body(env)`."""
    monkeypatch.setattr(pyfuse3, "readdir_reply", fake_readdir_reply)

    def run(body: Callable[[Env], Awaitable[Any]], *, setup: Setup | None = None, bucket: str | None = None,
            streams: MemoryStreams | None = None, **config_kw: Any) -> Any:
        async def main() -> Any:
            ms = streams or MemoryStreams()
            store = ObjectStore(ms)
            if setup is not None:
                await setup(ms, store)
            config = Config(mountpoint=Path("/nonexistent"), bucket=bucket, uid=1234, gid=5678,
                            **({"cache_size": 64 << 20, "cache_dir": tmp_path / "cache"} | config_kw))
            ns = Namespace(store, bucket=bucket)
            cache = ChunkCache(store, cache_bytes=config.cache_size, batch_bytes=config.fetch_batch_bytes,
                               parallelism=config.fetch_parallelism)
            ops = Operations(ns, cache, config)
            async with trio.open_nursery() as nursery:
                await ns.start(nursery)
                cache.start(nursery)
                try:
                    return await body(Env(ms, store, ns, cache, ops, config, nursery))
                finally:
                    nursery.cancel_scope.cancel()

        return trio.run(main)

    return run

