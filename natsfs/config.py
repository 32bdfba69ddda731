"""Every tunable of a mount in one frozen dataclass, plus size/duration parsing. No I/O here."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

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


def parse_octal(text: str | int) -> int:
    """`022` or `0o022` → 0o22 (a umask)."""
    if isinstance(text, int):
        return text
    try:
        value = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise ValueError(f"not an octal number: {text!r} (use e.g. 022)") from None
    if not 0 <= value <= 0o777:
        raise ValueError(f"not a umask: {text!r} (000 to 777)")
    return value


def parse_integer(text: str | int) -> int:
    """A whole number (`1000`, `-1`)."""
    if isinstance(text, int):
        return text
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None


KiB, MiB = 1024, 1024 * 1024
# The largest payload a nats-server takes (its max_payload setting is capped there): no chunk or meta is
# bigger. (Chunk sizes above the connected server's max_payload are lowered at mount, mount.py.)
MAX_PAYLOAD_CAP = 64 * MiB
# Ids the kernel takes: 32 bits, less (uid_t)-1, which means "no change" to chown and is nobody's id.
MAX_ID = 2**32 - 2
MAX_SIZE = 2**63 - 1
# Durations longer than this (about 100 years) are typos, and overflow the kernel's and trio's timers.
MAX_DURATION = 100 * 365 * 86400.0


def check_bounds(name: str, value: Any, bounds: tuple[float, float] | None) -> None:
    """`ValueError` (one sentence, naming the option) if the parsed `value` is outside `bounds`. -1 is
    "no limit" for `max_bytes`, let through by its own parser."""
    if bounds is None or not isinstance(value, int | float) or (name == "max_bytes" and value == -1):
        return
    low, high = bounds

    def shown(x: float) -> str:
        return f"{x:g} s" if isinstance(value, float) else str(int(x))

    if value < low:
        raise ValueError(f"{shown(value)} is too small (at least {shown(low)})")
    if value > high:
        raise ValueError(f"{shown(value)} is too large (at most {shown(high)})")


def parse_bytes_limit(text: str | int) -> int:
    """A size, or -1 (or empty) for no limit."""
    return -1 if text in ("-1", "", -1) else parse_size(text)


def option(default: Any = MISSING, *, help: str, parse: Callable[[str], Any] | None = None,
           shown: str | None = None, choices: tuple[str, ...] | None = None, optional: str | None = None,
           default_factory: Callable[[], Any] | None = None, bounds: tuple[float, float] | None = None) -> Any:
    """A `Config` field that is also a `natsfs mount` option (`--name-with-dashes`, and `-o name=value`).

    `parse` turns the command-line text into the field's value (default: the text itself; booleans are
    flags); `shown` is how the default reads in `--help` (e.g. `256MiB` for 268435456); an option with
    `optional` may be given without a value (`--write-back`, `-o write_back`), meaning that text.
    `bounds` (lowest, highest) is the range a parsed number must be in (`check_bounds`): a value the
    layers below cannot take (a uid beyond 32 bits, a chunk size of 0) is refused when the mount starts,
    not met as an error by every later request.
    """
    metadata = {"help": help, "parse": parse, "shown": shown, "choices": choices, "optional": optional,
                "bounds": bounds}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Config:
    """What a mount needs to know; built by the CLI, read by every layer.

    Fields made with `option(...)` are the `natsfs mount` options: the CLI generates its parser (flags,
    defaults, help, parsing) from them (natsfs/cli.py `add_config_options`), so a new tunable is one
    field here. The others are set by the CLI from other input (mountpoint, servers, credentials) or are
    internal knobs that tests may change.
    """

    mountpoint: Path
    servers: tuple[str, ...] = ()
    bucket: str | None = option(None, help="mount only this bucket, as the root")
    read_only: bool = option(False, help="refuse every change with EROFS (mount option: ro)")
    cache_dir: Path = option(help="where writes are staged before they are stored", parse=Path,
                             shown="~/.cache/natsfs", default_factory=default_cache_dir)
    cache_size: int = option(256 * 1024 * 1024, help="chunk cache size in memory", parse=parse_size,
                             shown="256MiB", bounds=(64 * KiB, MAX_SIZE))
    spool_size: int = option(16 * 1024 * 1024 * 1024, help="local disk for staged writes", parse=parse_size,
                             shown="16GiB", bounds=(1 * MiB, MAX_SIZE))
    chunk_size: int = option(128 * 1024, help="chunk size of objects written through the mount",
                             parse=parse_size, shown="128KiB", bounds=(1 * KiB, MAX_PAYLOAD_CAP))
    max_meta_bytes: int = option(16 * 1024, help="largest meta a change by the mount may grow to", parse=parse_size,
                                 shown="16KiB", bounds=(1 * KiB, MAX_PAYLOAD_CAP))
    # Longest subject sent for an object name (its meta's direct get): the server's control line limit
    # (4096 by default, not announced in INFO) minus room for the rest of the PUB/HPUB line.
    max_subject_bytes: int = 4096 - 256
    data_dir: Path = option(help="where the embedded nats-server keeps its store, and the daemon its log",
                            parse=Path, shown="~/.local/share/natsfs", default_factory=default_data_dir)
    fuse_options: tuple[str, ...] = ()
    # Kernel entry/attribute timeouts: never zero (slow and odd on Linux); changes are pushed
    # to the kernel by invalidation instead. The CLI sets both from --entry-timeout.
    entry_timeout: float = option(60.0, help="how long the kernel may keep names and attributes without asking "
                                  "(changes are pushed to it anyway)", parse=parse_duration, shown="60s",
                                  bounds=(0.001, MAX_DURATION))
    attr_timeout: float = 60.0
    # Readahead grows from the first to the second value while a handle reads sequentially.
    readahead_min: int = 1024 * 1024
    readahead_max: int = 32 * 1024 * 1024
    # Bytes all sequential readers together may fetch ahead (at most half the cache), shared equally by
    # the versions being read; how many batched requests one version may have in flight, and how big one
    # batch is.
    readahead_budget: int = 32 * 1024 * 1024
    fetch_parallelism: int = 4
    # Kernel readahead for the mount (sysfs bdi setting; needs root): lets reads arrive 1 MiB at a time.
    kernel_readahead_kb: int = 1024
    fetch_batch_bytes: int = 4 * 1024 * 1024
    request_timeout: float = option(10.0, help="how long a request to the server may take (an unanswered "
                                    "write is settled for 3 times this)", parse=parse_duration, shown="10s",
                                    bounds=(0.001, MAX_DURATION))
    # One deadline for storing a file at close/fsync: this many seconds plus one per
    # `flush_rate_floor` bytes staged (a big file on a slow link is not cut short).
    # (The CLI's default is `default_flush_timeout(servers)`.)
    flush_timeout: float = option(10.0, help="close/fsync fail with EIO when a file is not stored within this "
                                  "(plus 1 s per MiB)", parse=parse_duration,
                                  shown="10s, 30s with several servers (a cluster's election after a node loss)",
                                  bounds=(0.001, MAX_DURATION))
    flush_rate_floor: int = 1024 * 1024
    # At unmount/SIGTERM: how long the daemon may spend storing files still open for writing.
    shutdown_timeout: float = option(60.0, help="at unmount or SIGTERM, how long to spend storing files "
                                     "still open for writing", parse=parse_duration, shown="60s",
                                     bounds=(0, MAX_DURATION))
    # Background timers (seconds). How often the bucket list is read again (buckets other clients
    # created or deleted); how often each loaded bucket's index is checked against the server for metas
    # purged behind its watch's back; how long a bucket's sealed state is trusted before it is read
    # again; how often unfinished puts are settled; how long after purging a put's chunks their subject
    # is checked empty (chunks still on their way from the upload worker land meanwhile).
    bucket_poll_interval: float = 2.0
    reconcile_interval: float = 5.0
    sealed_ttl: float = 2.0
    settle_interval: float = 2.0
    purge_check_delay: float = 3.0
    # Write-back mode (--write-back[=DELAY]): None is off (close returns once the object is stored);
    # otherwise close returns once the bytes and a journal record are fsynced on local disk, and a
    # background uploader puts the file this many seconds later (a rewrite meanwhile merges into one put).
    write_back: float | None = option(None, help="close returns once the bytes are durable on local disk (spool "
                                      "file and journal fsynced); they are uploaded in the background DELAY "
                                      "later (default 0s) and replayed by the next mount with the same "
                                      "--cache-dir if the daemon dies", parse=parse_duration, optional="0s",
                                      shown="off", bounds=(0, MAX_DURATION))
    # One CPU for the FUSE and NATS threads (natsfs/affinity.py), or wherever the kernel puts them.
    cpus: str = option("one", help="run the daemon's FUSE and NATS threads on one CPU (the one it starts on, or "
                       "one with fewer natsfs mounts; a hand-off between them then wakes no other CPU), or on any",
                       choices=("one", "any"))
    # Publish written files from a helper process (its own connection, its own GIL).
    upload_worker: bool = True
    # Owner, group and permission bits (0o666/0o777 less `umask`) of objects without stored attributes.
    # The CLI's default is the mounting user and group.
    uid: int = option(0, help="owner of objects without stored attributes", parse=parse_integer, shown="yours",
                      bounds=(0, MAX_ID))
    gid: int = option(0, help="group of objects without stored attributes", parse=parse_integer, shown="yours",
                      bounds=(0, MAX_ID))
    umask: int = option(0o022, help="permission bits masked off objects without stored attributes (octal)",
                        parse=parse_octal, shown="022")
    # Show setuid and setgid bits stored in `natsfs.mode` metadata (any client can write them, so they
    # are masked off unless the mount is asked for them; the sticky bit only takes rights away and
    # always shows).
    allow_setuid: bool = option(False, help="show setuid and setgid bits stored in object metadata "
                                "(masked off by default)")
    # Bucket defaults for mkdir at the root (issue 4)
    storage: str = option("file", help="storage of new buckets", choices=("file", "memory"))
    replicas: int = option(1, help="replicas of new buckets", parse=parse_integer, bounds=(1, 5))
    compression: bool = option(False, help="compress new buckets (s2)")
    max_bytes: int = option(-1, help="size limit of new buckets (-1: none)", parse=parse_bytes_limit,
                            bounds=(1, MAX_SIZE))
    ttl: float = option(0.0, help="object TTL of new buckets (e.g. 7d; 0: none)", parse=parse_duration,
                        shown="0", bounds=(0, MAX_DURATION))
    # How to reach NATS beyond the server URLs: user/password, token, NKey, creds, TLS (natsfs/auth.py).
    credentials: Connection = field(default_factory=Connection)

    @property
    def file_mode(self) -> int:
        return 0o666 & ~self.umask

    @property
    def dir_mode(self) -> int:
        return 0o777 & ~self.umask


def option_fields() -> list[Any]:
    """The `Config` fields that are `natsfs mount` options, in declaration order."""
    return [f for f in fields(Config) if "help" in f.metadata]


def default_flush_timeout(servers: tuple[str, ...]) -> float:
    """10 s; 30 s given several servers: after a cluster node dies, its streams need an election (up to
    ~10 s of nats-server's Raft timeouts) before they take publishes again, and a close should wait
    that out rather than fail."""
    return 30.0 if len(servers) > 1 else 10.0
