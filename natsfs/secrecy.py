"""Keeping credentials out of what others can read: logs, error messages, and child processes' argv.

A NATS URL may carry credentials in its userinfo (`nats://user:password@host`, `nats://token@host`).
Every URL the daemon prints goes through `redact_url`. Children (the background daemon, the upload
worker) receive the server list through a pipe, never on their command line, and their environment
drops `$NATS_URL` and the other `$NATS_*` connection variables (they do not read them).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

REDACTED = "***"


def redact_url(url: str) -> str:
    """`url` without its secret: the password of `user:password@`, or the whole `token@`.

    Everything before the last `@` (after the scheme) is userinfo: an unencoded `@` or `/` in a
    password still never shows.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" not in rest:
        return url
    userinfo, host = rest.rsplit("@", 1)
    user, colon, _secret = userinfo.partition(":")
    shown = f"{user}:{REDACTED}" if colon else REDACTED
    return f"{scheme}{sep}{shown}@{host}"


def redact_urls(urls: Iterable[str]) -> str:
    """A server list for a message: comma separated, each URL redacted."""
    return ", ".join(redact_url(u) for u in urls)


# Connection settings children never inherit: they get them (resolved) through a pipe.
CONNECTION_ENV = frozenset({"NATS_URL", "NATS_USER", "NATS_PASSWORD", "NATS_TOKEN", "NATS_CREDS", "NATS_NKEY",
                            "NATS_CA", "NATS_CERT", "NATS_KEY", "NATS_CONTEXT"})


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: ours without the `$NATS_*` connection settings (servers and
    credentials come through a pipe)."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k not in CONNECTION_ENV}


def private_dir(directory: Path) -> Path:
    """Create `directory` and every missing parent readable by this user only (0700); directories that
    exist already are left as they are (the user may have chosen to share them). `Path.mkdir` gives
    missing parents the default mode, which would show others the names of logs, buckets and files."""
    missing = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            d.mkdir(mode=0o700)
    return directory
