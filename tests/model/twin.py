"""Helpers of the model test: run one operation on two trees and compare outcomes and whole trees.

The reference tree is a plain local directory; the tree under test is a bucket directory of a natsfs
mount. An operation's *outcome* is `("ok", value)` or `("err", "ENOENT")` (the errno's name, so a
failure message reads well); both trees must give the same outcome. A *snapshot* maps every path under
a root (relative, `/`-separated) to what is there: `("dir",)` or `("file", st_size, bytes)` (bytes
only when contents are asked for).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Outcome = tuple[str, Any]
Snapshot = dict[str, tuple[Any, ...]]


def outcome(fn: Callable[..., Any], *args: Any) -> Outcome:
    """What `fn(*args)` did: its value, or the errno name of the OSError it raised."""
    try:
        return ("ok", fn(*args))
    except OSError as e:
        if e.errno is None:
            raise
        return ("err", errno.errorcode.get(e.errno, str(e.errno)))


def read_all(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def snapshot(root: Path, *, contents: bool, skip: Callable[[str], bool] = lambda rel: False) -> Snapshot:
    """Every entry under `root` (not following symlinks), sorted walk, optionally with file bytes."""
    out: Snapshot = {}

    def walk(directory: Path, prefix: str) -> None:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = prefix + entry.name
            if skip(rel):
                continue
            st = os.lstat(entry.path)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
                walk(Path(entry.path), rel + "/")
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", st.st_size, read_all(Path(entry.path))) if contents else ("file", st.st_size)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))

    walk(root, "")
    return out


def _short(entry: tuple[Any, ...] | None) -> str:
    if entry is None:
        return "missing"
    if entry[0] == "file" and len(entry) == 3:
        data: bytes = entry[2]
        head = data[:24]
        return f"file size={entry[1]} len={len(data)} head={head!r}{'...' if len(data) > 24 else ''}"
    return " ".join(str(x) for x in entry)


def first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def describe_diff(expected: Snapshot, actual: Snapshot) -> str:
    """One line per path that differs between the reference and the mount."""
    lines = []
    for rel in sorted(set(expected) | set(actual)):
        e, a = expected.get(rel), actual.get(rel)
        if e == a:
            continue
        line = f"  {rel}: local {_short(e)} | natsfs {_short(a)}"
        if e is not None and a is not None and e[0] == a[0] == "file" and len(e) == len(a) == 3:
            line += f" (first differing byte at {first_difference(e[2], a[2])})"
        lines.append(line)
    return "\n".join(lines)


def pattern(seed: int, length: int) -> bytes:
    """`length` bytes that differ from any other (seed, offset) nearby, cheap to make."""
    block = bytes((seed * 7 + i * 31 + (i >> 8)) % 251 + 1 for i in range(min(length, 4096)))
    if length <= len(block):
        return block
    reps = -(-length // len(block))
    return (block * reps)[:length]


@dataclass
class Handle:
    """One open file description on each side, opened with the same flags on the same path."""

    label: str
    local_fd: int
    mount_fd: int
    path: str  # where the file is now in the reference tree (follows renames)
    flags: int
    is_dir: bool
    ino: int  # the reference file's inode: handles with the same one share a file
    orphaned: bool = False  # its file was unlinked or replaced by a rename since it was opened
    orphaned_clean: bool = False  # ... while nothing had been written to it through the mount
    moved_clean: bool = False  # renamed (itself or a parent) while nothing had been written to it

    def close_both(self) -> tuple[Outcome, Outcome]:
        return outcome(os.close, self.local_fd), outcome(os.close, self.mount_fd)


def flags_text(flags: int) -> str:
    names = [n for n in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_EXCL", "O_TRUNC", "O_APPEND")
             if flags & getattr(os, n)]
    return "|".join(names) or "O_RDONLY"


def log_excerpt(text: str, lines: int = 25) -> str:
    """The daemon log's last warnings and errors (debug lines left out), for failure messages."""
    interesting = [ln for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln
                   or ln.startswith(("  ", "natsfs.", "pyfuse3.", "trio."))]
    if not interesting:
        return ""
    return "\n--- natsfs log (warnings/errors, last lines) ---\n" + "\n".join(interesting[-lines:])
