"""Every tunable of a mount in one frozen dataclass, plus size/duration parsing. No I/O here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .auth import Connection

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """Parse `64MiB`, `1GiB`, `512k`, `1000000` into bytes. `MB` means 10**6, `MiB` and `M` mean 2**20."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 64MiB, 1GiB, 4096)")
    number, unit, binary, b = m.groups()
    exponent = _UNITS[unit.lower()]
    # "10MB" is decimal; "10MiB", "10M" and "10m" are binary, as in most Linux tools.
    base = 1000 if (unit and b and not binary) else 1024
    value = float(number) * base**exponent
    if value != int(value) and exponent == 0:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(text: str | float) -> float:
    """Parse `30s`, `5m`, `2h`, `7d`, `250ms` or a bare number of seconds."""
    if isinstance(text, int | float):
        return float(text)
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 2h, 7d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "natsfs"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "natsfs"


@dataclass(frozen=True)
class Config:
    """What a mount needs to know; built by the CLI, read by every layer."""

    mountpoint: Path
    servers: tuple[str, ...] = ()
    bucket: str | None = None
    read_only: bool = False
    cache_dir: Path = field(default_factory=default_cache_dir)
    cache_size: int = 256 * 1024 * 1024
    spool_size: int = 16 * 1024 * 1024 * 1024
    chunk_size: int = 128 * 1024
    max_meta_bytes: int = 16 * 1024
    # Longest subject sent for an object name (its meta's direct get): the server's control line limit
    # (4096 by default, not announced in INFO) minus room for the rest of the PUB/HPUB line.
    max_subject_bytes: int = 4096 - 256
    data_dir: Path = field(default_factory=default_data_dir)
    fuse_options: tuple[str, ...] = ()
    # Kernel entry/attribute timeouts: never zero (slow and odd on Linux); changes are pushed
    # to the kernel by invalidation instead.
    entry_timeout: float = 60.0
    attr_timeout: float = 60.0
    # Readahead grows from the first to the second value while a handle reads sequentially.
    readahead_min: int = 1024 * 1024
    readahead_max: int = 32 * 1024 * 1024
    # How many chunk batches may be in flight for one mount, and how big one batch is.
    fetch_parallelism: int = 4
    # Kernel readahead for the mount (sysfs bdi setting; needs root): lets reads arrive 1 MiB at a time.
    kernel_readahead_kb: int = 1024
    fetch_batch_bytes: int = 4 * 1024 * 1024
    request_timeout: float = 10.0
    # One deadline for storing a file at close/fsync: this many seconds plus one per
    # `flush_rate_floor` bytes staged (a big file on a slow link is not cut short).
    flush_timeout: float = 10.0
    flush_rate_floor: int = 1024 * 1024
    # At unmount/SIGTERM: how long the daemon may spend storing files still open for writing.
    shutdown_timeout: float = 60.0
    # Publish written files from a helper process (its own connection, its own GIL).
    upload_worker: bool = True
    # Owner, group and permission bits (0o666/0o777 less `umask`) of objects without stored attributes.
    uid: int = 0
    gid: int = 0
    umask: int = 0o022
    # Show setuid, setgid and sticky bits stored in `natsfs.mode` metadata (any client can write
    # them, so they are masked off unless the mount is asked for them).
    allow_setuid: bool = False
    # Bucket defaults for mkdir at the root (issue 4)
    storage: str = "file"
    replicas: int = 1
    compression: bool = False
    max_bytes: int = -1
    ttl: float = 0.0
    # How to reach NATS beyond the server URLs: user/password, token, NKey, creds, TLS (natsfs/auth.py).
    credentials: Connection = field(default_factory=Connection)

    @property
    def file_mode(self) -> int:
        return 0o666 & ~self.umask

    @property
    def dir_mode(self) -> int:
        return 0o777 & ~self.umask
