"""What an ADR-20 link shows as: a symlink target computed only from validated parts.

A link meta is written by any client, so its `bucket` and `name` are untrusted text. The target is
never built from that text directly:

- the bucket must pass the bucket-name rule (`adr20.valid_bucket_name`: `[A-Za-z0-9_-]+`);
- the object name goes through the names rule (`names.placement`), which yields path segments that are
  each a usable file name (never empty, `.` or `..`), exactly where the object itself shows.

A target inside the mount is `../` once per directory between the link and the mount root, then those
validated segments, so it can only end inside the mount. A target that cannot be shown inside the
mount reads as a relative path in the link's own directory whose first segment starts with
`nats-object:` (never `..`): a link into another bucket of a `--bucket` mount reads as
`nats-object:<bucket>/<name segments>`, and a link whose bucket fails the bucket-name rule or whose
name cannot be shown reads as `nats-object:?/invalid-link` (`?` is never part of a bucket name).
Neither leaves the mount: the kernel resolves them inside the link's directory, where they dangle.

A symlink made with `ln -s` carries its target text verbatim in `natsfs.symlink` (see
`symlink_text`). That text is also written by any client, so it shows verbatim only when it stays in
the mount (relative, with `..` only at its start and never above the mount root; or absolute under
this mountpoint, without `..`), or when it carries this user's signature (`natsfs.symlink_sig`, an
HMAC of the bucket and the text under a key only this user's cache dir holds): `ln -s /usr/bin/python3`
through this mount is the user's own choice, as on a local disk, and survives a remount; the same
text from another client's meta does not lead out of the mount. Any other text reads like the ADR-20
link's computed target if the object is also a link, else as `nats-object:?/outside-link`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from .adr20 import Link, valid_bucket_name
from .names import placement

FOREIGN_PREFIX = "nats-object:"
INVALID_TARGET = FOREIGN_PREFIX + "?/invalid-link"
OUTSIDE_TARGET = FOREIGN_PREFIX + "?/outside-link"
PATH_MAX = 4096


@dataclass(frozen=True, slots=True)
class LinkTarget:
    """A symlink target, and why it does not point into the mount (None when it does)."""

    text: str
    outside: str | None = None
    hostile: bool = False


def link_target(link: Link, link_path: tuple[str, ...], single_bucket: str | None) -> LinkTarget:
    """The symlink target of `link`, shown at mount path `link_path` (its own, validated, segments).

    `single_bucket` is the bucket of a `--bucket` mount (None for an all-buckets mount).
    """
    if not valid_bucket_name(link.bucket):
        return LinkTarget(INVALID_TARGET, f"its bucket {link.bucket!r} is not a valid bucket name", hostile=True)
    segments: tuple[str, ...] = ()
    if link.name is not None:
        placed, _escaped = placement(link.name)
        if placed is None:
            return LinkTarget(INVALID_TARGET, f"its object name {link.name!r} cannot be shown", hostile=True)
        segments = placed
    if single_bucket is not None and link.bucket != single_bucket:
        text = FOREIGN_PREFIX + link.bucket + "/" + "/".join(segments)
        return LinkTarget(text, f"it points into bucket {link.bucket!r}, outside this --bucket mount")
    in_mount = segments if single_bucket is not None else (link.bucket, *segments)
    up = "../" * (len(link_path) - 1)
    return LinkTarget((up + "/".join(in_mount)) or ".")



def stays_in_mount(text: str, link_path: tuple[str, ...], mountpoint: str) -> bool:
    """Whether symlink `text`, shown at mount path `link_path`, names something inside the mount
    however the kernel resolves it: `..` only before every other segment (after a segment that may
    itself be a symlink, `..` could climb anywhere), and never above the mount root."""
    if not text or "\0" in text or len(os.fsencode(text)) >= PATH_MAX:
        return False
    if text.startswith("/"):
        root = mountpoint.rstrip("/")
        if text != root and not text.startswith(root + "/"):
            return False
        segments, depth = text[len(root):].split("/"), 0
    else:
        segments, depth = text.split("/"), len(link_path) - 1
    descended = False
    for seg in segments:
        if seg in ("", "."):
            continue
        if seg == "..":
            depth -= 1
            if descended or depth < 0:
                return False
        else:
            descended = True
    return True


class SymlinkSigner:
    """Signs symlink texts this user writes, with a key kept in the cache dir (created 0600)."""

    def __init__(self, key_path: Path):
        self._key_path = key_path
        self._key: bytes | None = None

    def _load(self) -> bytes:
        if self._key is None:
            self._key_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self._key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                self._key = self._key_path.read_bytes()
            else:
                key = secrets.token_bytes(32)
                with os.fdopen(fd, "wb") as f:
                    f.write(key)
                self._key = key
        return self._key

    def sign(self, bucket: str, text: str) -> str:
        msg = bucket.encode() + b"\0" + text.encode("utf-8", "surrogatepass")
        return hmac.new(self._load(), msg, hashlib.sha256).hexdigest()

    def verify(self, bucket: str, text: str, signature: str | None) -> bool:
        if not signature:
            return False
        try:
            return hmac.compare_digest(self.sign(bucket, text), signature)
        except OSError:
            return False
