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
`nats-object:<bucket>/<name segments>`, and a link whose bucket fails the bucket-name rule, whose
name cannot be shown, or whose target would be `PATH_MAX` bytes or more (no symlink the kernel takes)
reads as `nats-object:?/invalid-link` (`?` is never part of a bucket name).
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

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .adr20 import Link, valid_bucket_name
from .errors import NatsFSError, PermissionDenied
from .names import placement
from .secrecy import private_dir

log = logging.getLogger(__name__)

FOREIGN_PREFIX = "nats-object:"
INVALID_TARGET = FOREIGN_PREFIX + "?/invalid-link"
OUTSIDE_TARGET = FOREIGN_PREFIX + "?/outside-link"
# A link whose object does not show at its own path: another entry (a real name its escaped form
# collides with, or a directory of the same path) holds that path and would be served instead.
HIDDEN_TARGET = FOREIGN_PREFIX + "?/hidden-link"
PATH_MAX = 4096


@dataclass(frozen=True, slots=True)
class LinkTarget:
    """A symlink target, and why it does not point into the mount (None when it does)."""

    text: str
    outside: str | None = None
    hostile: bool = False


def link_target(link: Link, link_path: tuple[str, ...], single_bucket: str | None, *,
                marker: bool = False) -> LinkTarget:
    """The symlink target of `link`, shown at mount path `link_path` (its own, validated, segments).

    `single_bucket` is the bucket of a `--bucket` mount (None for an all-buckets mount). `marker`: the
    linked object is a directory marker (an empty object named `dir/`), which shows as its directory.
    """
    if not valid_bucket_name(link.bucket):
        return LinkTarget(INVALID_TARGET, f"its bucket {link.bucket!r} is not a valid bucket name", hostile=True)
    segments: tuple[str, ...] = ()
    if link.name is not None:
        placed, _escaped = placement(link.name, marker_candidate=marker)
        if placed is None:
            return LinkTarget(INVALID_TARGET, f"its object name {link.name!r} cannot be shown", hostile=True)
        segments = placed
    if single_bucket is not None and link.bucket != single_bucket:
        text = FOREIGN_PREFIX + link.bucket + "/" + "/".join(segments)
        target = LinkTarget(text, f"it points into bucket {link.bucket!r}, outside this --bucket mount")
    else:
        in_mount = segments if single_bucket is not None else (link.bucket, *segments)
        up = "../" * (len(link_path) - 1)
        target = LinkTarget((up + "/".join(in_mount)) or ".")
    if len(os.fsencode(target.text)) >= PATH_MAX:
        # The kernel takes no symlink text of PATH_MAX bytes or more (readlink failed with EIO, and
        # nothing was logged): the name of a link another client wrote can be that long.
        return LinkTarget(INVALID_TARGET, f"its target would be {len(os.fsencode(target.text))} bytes, more "
                                          f"than a symlink holds ({PATH_MAX - 1})", hostile=True)
    return target



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
    """Signs symlink texts this user writes, with a key kept in the cache dir.

    The key decides which texts may lead out of the mount, so a key file is used only when it is this
    user's own regular file (opened without following a symlink), private (0600 at most), in a
    directory this user owns, and exactly `KEY_BYTES` long. A new key is written whole to a temporary
    file, synced, and linked into place, so no reader ever sees a partial key (a disk that fills up
    mid-write leaves no key at all). A key file of this user that is short, long or readable by others
    is replaced (its old signatures stop counting); any other failing check refuses to sign (`EACCES`)
    and verifies nothing, with one log line."""

    KEY_BYTES = 32

    def __init__(self, key_path: Path):
        self._key_path = key_path
        self._key: bytes | None = None
        self._refused: str | None = None

    def _load(self) -> bytes:
        if self._key is None:
            if self._refused is None:
                try:
                    self._key = self._read_or_create()
                    return self._key
                except OSError as e:  # a full or failing disk: worth trying again later
                    raise NatsFSError(f"cannot write the symlink signing key {self._key_path}: {e.strerror}",
                                      errno=e.errno or errno.EIO, log_level=logging.WARNING) from None
                except PermissionDenied as e:
                    self._refused = str(e)
                    log.warning("%s", e)
            # Said once above; each refused request after that only gets its errno.
            raise PermissionDenied(self._refused, log_level=logging.DEBUG)
        return self._key

    def _read_or_create(self) -> bytes:
        directory = self._key_path.parent
        private_dir(directory)
        st = os.stat(directory)
        if st.st_uid != os.geteuid():
            raise PermissionDenied(f"symlinks leading out of the mount are refused: {directory} (which holds "
                                   f"their signing key) belongs to another user")
        for _ in range(3):
            key = self._read()
            if key is not None:
                return key
            if self._create():
                key = self._read()
                if key is not None:
                    return key
        raise PermissionDenied(f"symlinks leading out of the mount are refused: no usable key at {self._key_path}")

    def _read(self) -> bytes | None:
        """The key, None where there is none (a bad one of this user's is removed first)."""
        try:
            fd = os.open(self._key_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PermissionDenied(f"symlinks leading out of the mount are refused: cannot open their "
                                   f"signing key {self._key_path} ({e.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionDenied(f"symlinks leading out of the mount are refused: their signing key "
                                       f"{self._key_path} is not this user's own file")
            key = f.read(self.KEY_BYTES + 1)
        if len(key) == self.KEY_BYTES and not st.st_mode & 0o077:
            return key
        log.warning("replacing the symlink signing key %s (%s): symlinks this user made that lead out of "
                    "the mount read as %s until made again", self._key_path,
                    "readable by others" if st.st_mode & 0o077 else f"{len(key)} bytes", OUTSIDE_TARGET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._key_path)
        return None

    def _create(self) -> bool:
        """Write a new key into place; False when another process put one there first."""
        fd, temp = tempfile.mkstemp(prefix=".symlink.key.", dir=self._key_path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(self.KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(temp, self._key_path)
            except FileExistsError:
                return False
            return True
        finally:
            os.unlink(temp)

    def sign(self, bucket: str, text: str) -> str:
        msg = bucket.encode() + b"\0" + text.encode("utf-8", "surrogatepass")
        return hmac.new(self._load(), msg, hashlib.sha256).hexdigest()

    def verify(self, bucket: str, text: str, signature: str | None) -> bool:
        if not signature:
            return False
        try:
            return hmac.compare_digest(self.sign(bucket, text), signature)
        except (OSError, NatsFSError):
            return False
