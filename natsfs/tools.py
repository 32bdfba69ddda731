"""One-shot commands that talk to NATS without a mount: `natsfs bucket create|ls|seal|rm`, `natsfs fsck`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from .adr20 import ObjectStore
from .auth import OPTION_DESTS, Connection, resolve
from .bridge import Bridge
from .compose import open_store
from .config import default_data_dir, parse_duration, parse_size
from .errors import NotEmpty, Unavailable
from .jetstream import JetStreams
from .server import read_record


def resolve_connection(a: argparse.Namespace) -> Connection:
    """The connection options (also given after the subcommand), the environment and the NATS context;
    without a server, the embedded server a mount started."""
    connection = resolve({name: getattr(a, name, None) for name in OPTION_DESTS})
    connection.check_files()
    if connection.servers:
        return connection
    try:
        url, auth, _ = read_record(default_data_dir() / "server.json")
    except (OSError, ValueError, KeyError, TypeError):
        raise Unavailable("no server given: use --server, set NATS_URL, or mount first "
                          "(which starts the embedded server)") from None
    user, password = auth if auth is not None else (None, None)
    return Connection(servers=(url,), user=user, password=password)


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
                flags = " sealed" if st.sealed else f" read-only ({st.read_only})" if st.read_only else ""
                limit = "unlimited" if st.max_bytes <= 0 else f"{st.max_bytes} max"
                print(f"{name}\t{st.size} bytes\t{limit}\t{st.storage} R{st.replicas}{flags}")
        elif a.bucket_command == "create":
            max_bytes = parse_size(a.max_bytes) if a.max_bytes not in ("-1", "") else -1
            await store.create_bucket(a.name, description=a.description, storage=a.storage,
                                      replicas=a.replicas, compression=a.compression, max_bytes=max_bytes,
                                      ttl_ns=int(parse_duration(a.ttl) * 1e9), atomic=not a.no_atomic)
        elif a.bucket_command == "seal":
            await store.seal_bucket(a.name)
        elif a.bucket_command == "rm":
            if not a.force and await store.live_object_count(a.name):
                raise NotEmpty(f"bucket {a.name} holds objects (use --force)")
            await store.delete_bucket(a.name)
    return 0


class _Bar:
    """`fsck.Progress` as a tqdm bar on stderr (only on a terminal)."""

    def __init__(self) -> None:
        self._bar: Any = None

    def start(self, label: str, total: int) -> None:
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=total, desc=label, unit="", file=sys.stderr, leave=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


async def fsck_command(a: argparse.Namespace) -> int:
    from .fsck import check_bucket

    async with connected_store(resolve_connection(a)) as store:
        report = await check_bucket(store, a.bucket, repair=a.repair, verify=a.verify,
                                    grace_s=parse_duration(a.grace),
                                    progress=_Bar() if sys.stderr.isatty() else None)
    for finding in report.findings:
        print(finding.line())
    print(report.summary())
    return 1 if report.problems_left else 0
