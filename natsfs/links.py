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
"""

from __future__ import annotations

from dataclasses import dataclass

from .adr20 import Link, valid_bucket_name
from .names import placement

FOREIGN_PREFIX = "nats-object:"
INVALID_TARGET = FOREIGN_PREFIX + "?/invalid-link"


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

