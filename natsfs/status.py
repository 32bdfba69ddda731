"""`natsfs status`: what a running daemon reports about itself, and the recent problems it keeps for that.

Channel: the daemon serves its figures as JSON in the `user.natsfs.stats` extended attribute of the
mount root (fs.py). `natsfs status` reads it with getxattr(2) from its own process (never from the
daemon, so it cannot deadlock the mount), on a thread with a deadline: a daemon that does not answer
is reported, not waited on forever. `RecentProblems` is a logging handler in the daemon that keeps
the last warnings and errors (already redacted, like every log line) for that report.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any, ClassVar

XATTR = "user.natsfs.stats"
_KEPT = 10


class RecentProblems(logging.Handler):
    """The last `_KEPT` WARNING-or-worse log lines of this process."""

    lines: ClassVar[collections.deque[str]] = collections.deque(maxlen=_KEPT)

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        self.lines.append(f"{when} {record.levelname} {record.getMessage()}")


def recent_problems() -> list[str]:
    return list(RecentProblems.lines)


def natsfs_mounts() -> list[str]:
    """Mountpoints of natsfs mounts this process can see."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "fuse.natsfs":
                found.append(fields[1].replace("\\040", " "))
    return found


def read_stats(mountpoint: str, timeout: float = 10.0) -> dict[str, Any]:
    """The daemon's figures; raises `OSError` (the mount's errno) or `TimeoutError`."""
    box: list[bytes | OSError] = []

    def ask() -> None:
        try:
            box.append(os.getxattr(mountpoint, XATTR))
        except OSError as e:
            box.append(e)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        raise TimeoutError(f"the daemon of {mountpoint} did not answer within {timeout:g}s")
    if isinstance(box[0], OSError):
        raise box[0]
    return dict(json.loads(box[0]))


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_status(mountpoint: str, stats: dict[str, Any]) -> str:
    cache = stats.get("cache", {})
    fs = stats.get("fs", {})
    hits, misses = cache.get("hits", 0), cache.get("misses", 0)
    rate = f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"
    buckets = stats.get("namespace", {}).get("buckets") or []
    lines = [
        f"mount:            {mountpoint}",
        f"server:           {stats.get('servers') or '-'}",
        f"buckets in use:   {', '.join(buckets) if buckets else '-'}",
        f"cache:            {_size(cache.get('cached_bytes', 0))} of {_size(cache.get('cache_limit', 0))}, "
        f"hit rate {rate} ({hits} hits, {misses} misses)",
        f"read:             {_size(cache.get('read_bytes', 0))} in {cache.get('reads', 0)} reads, "
        f"{_size(cache.get('bytes_fetched', 0))} fetched from NATS",
        f"written:          {_size(fs.get('write_bytes', 0))} in {fs.get('writes', 0)} writes, "
        f"{_size(fs.get('upload_bytes', 0))} stored in {fs.get('uploads', 0)} uploads",
        f"pending uploads:  {stats.get('staged_files', 0)} files, {_size(stats.get('spool_bytes', 0))} staged",
    ]
    problems = stats.get("recent_errors") or []
    lines.append(f"recent errors:    {len(problems) or 'none'}")
    lines += [f"  {p}" for p in problems]
    return "\n".join(lines)


def prometheus_text(mountpoint: str, stats: dict[str, Any]) -> str:
    """The figures in Prometheus' text format (for node_exporter's textfile collector, `--prometheus`)."""
    cache, fs = stats.get("cache", {}), stats.get("fs", {})
    label = '{mountpoint="' + mountpoint.replace("\\", "\\\\").replace('"', '\\"') + '"}'
    metrics = [
        ("natsfs_cache_bytes", "gauge", "bytes in the chunk cache", cache.get("cached_bytes", 0)),
        ("natsfs_cache_limit_bytes", "gauge", "chunk cache size", cache.get("cache_limit", 0)),
        ("natsfs_cache_hits_total", "counter", "chunk cache hits", cache.get("hits", 0)),
        ("natsfs_cache_misses_total", "counter", "chunk cache misses", cache.get("misses", 0)),
        ("natsfs_read_bytes_total", "counter", "bytes read through the mount", cache.get("read_bytes", 0)),
        ("natsfs_fetched_bytes_total", "counter", "bytes fetched from NATS", cache.get("bytes_fetched", 0)),
        ("natsfs_written_bytes_total", "counter", "bytes written through the mount", fs.get("write_bytes", 0)),
        ("natsfs_uploaded_bytes_total", "counter", "bytes stored in NATS", fs.get("upload_bytes", 0)),
        ("natsfs_pending_uploads", "gauge", "files staged but not stored yet", stats.get("staged_files", 0)),
        ("natsfs_spool_bytes", "gauge", "bytes staged on local disk", stats.get("spool_bytes", 0)),
        ("natsfs_recent_problems", "gauge", "warnings and errors kept for status",
         len(stats.get("recent_errors") or [])),
    ]
    lines = []
    for name, kind, text, value in metrics:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    return "\n".join(lines)
