"""One-shot commands that talk to NATS without a mount: `natsfs bucket create|ls|seal|rm`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .adr20 import ObjectStore
from .auth import OPTION_DESTS, Connection, resolve
from .bridge import Bridge
from .compose import open_store
from .config import default_data_dir, parse_duration, parse_size
from .errors import NotEmpty, Unavailable
from .jetstream import JetStreams


def resolve_connection(a: argparse.Namespace) -> Connection:
    """The connection options (also given after the subcommand), the environment and the NATS context;
    without a server, the embedded server a mount started."""
    connection = resolve({name: getattr(a, name, None) for name in OPTION_DESTS})
    connection.check_files()
    if connection.servers:
        return connection
    record = default_data_dir() / "server.json"
    try:
        return dataclasses.replace(connection, servers=(json.loads(record.read_text())["url"],))
    except (OSError, ValueError, KeyError):
        raise Unavailable("no server given: use --server, set NATS_URL, or mount first "
                          "(which starts the embedded server)") from None


@asynccontextmanager
async def connected_store(connection: Connection) -> AsyncIterator[ObjectStore]:
    bridge = Bridge(connection.servers, auth=connection)
    await bridge.connect()
    try:
        yield open_store(JetStreams(bridge))
    finally:
        await bridge.close()


async def bucket_command(a: argparse.Namespace) -> int:
    async with connected_store(resolve_connection(a)) as store:
        if a.bucket_command == "ls":
            for name in await store.list_buckets():
                st = await store.bucket_status(name)
                flags = " sealed" if st.sealed else ""
                limit = "unlimited" if st.max_bytes <= 0 else f"{st.max_bytes} max"
                print(f"{name}\t{st.size} bytes\t{limit}\t{st.storage} R{st.replicas}{flags}")
        elif a.bucket_command == "create":
            max_bytes = parse_size(a.max_bytes) if a.max_bytes not in ("-1", "") else -1
            await store.create_bucket(a.name, description=a.description, storage=a.storage,
                                      replicas=a.replicas, compression=a.compression, max_bytes=max_bytes,
                                      ttl_ns=int(parse_duration(a.ttl) * 1e9))
        elif a.bucket_command == "seal":
            await store.seal_bucket(a.name)
        elif a.bucket_command == "rm":
            if not a.force and await store.live_object_count(a.name):
                raise NotEmpty(f"bucket {a.name} holds objects (use --force)")
            await store.delete_bucket(a.name)
    return 0
