"""ADR-20 (JetStream Object Store) exactly as nats.go speaks it, on top of `natsfs.streams.Streams`.

Owns the wire format: stream and subject names, the meta JSON (parsed tolerantly of every client's
quirks, but never of a field that decides what the object is and that nats.go could not unmarshal; a
descriptive field of the wrong JSON type is ignored; written the way nats.go writes it), digests,
and the object operations (list buckets, watch metas, fetch chunks, map an object's chunks). Objects
are `ObjectInfo`: compact, because an index holds one per live object.
Meta `mtime` on the wire is ignored; the meta message's timestamp is the object's mtime.

Every write has a known outcome. Each publish carries `Nats-Msg-Id` (chunk `i` of a put is
`<nuid>.<i>`, its meta `<nuid>.meta`, any other meta rewrite a fresh id), so a retry can never store a
message twice. A meta publish whose ack does not come back is settled by reading the name's meta back:
our exact document there is success, anything else means "not stored" and the same publish is retried
until the server answers or `settle_timeout` passes (then `OutcomeUnknown`). A read-back only counts
after a barrier (`earlier_publishes_processed`): nats-server stores a stream's publishes in order from the
stream's inbound queue but answers reads elsewhere, so a meta sent without an answer may still sit in that
queue while a read says "not there" and be stored right after. A put's chunks are purged
only once its meta is known not to be stored; puts that end otherwise are handed to the `PutLog`, which
settles them later (see `natsfs.staging.PutJournal`). Names are checked before anything is sent: valid
UTF-8 (`BadName`), no request subject over `max_subject_bytes` (`NameTooLong`: an oversize control line
makes the server drop the connection), no meta over the server's max payload (`TooBig`).

Atomic puts: in a bucket whose stream allows atomic batch publish (`allow_atomic`, nats-server >= 2.12;
`create_bucket` sets it), a put of at most `ATOMIC_MAX_CHUNKS` chunks is one batch whose commit is the
meta, so it is stored whole or not at all and needs no journal record (`_put_batch`). Verified on
nats-server 2.15: the expected-last-subject-sequence header works inside a batch (a mismatch refuses the
whole batch); a message id the stream already saw refuses the whole batch (10201) instead of being
acknowledged as a duplicate, while the ids of a refused or abandoned batch are not remembered. So an
unacknowledged commit is read back and, if not stored, the same batch (same ids) is sent again: stored
at most once. Other puts keep the nats.go order (`PutSession`).

Small puts: a file of at most one chunk (and `SMALL_PUT_MAX`) is put with two plain publishes, the
chunk and the meta in one round trip, the meta stored only right after the chunk (`_publish_after`),
even where atomic batches are allowed (`_put_small`):
on a file-backed stream the server stages an atomic batch on disk and syncs it, which costs several
milliseconds per batch against a fraction of one per publish. The put journal covers it like any other put.

Timestamps: a meta's stored message carries the server's timestamp, which is its mtime unless the meta
says otherwise; reading it back costs a round trip after the ack. Callers that show their own time
(the filesystem shows a written file's last write, or the meta carries `natsfs.mtime_ns`) pass
`timestamp=False`: the returned info then carries this machine's time.

Stream limits: a bucket's stream config (any client's) may drop messages already acknowledged
(`max_msgs_per_subject`; `max_bytes` / `max_msgs` with discard old; `max_age`: `StreamLimits`). A put
the limits could never hold whole is refused before anything is sent (`check_fits`, `OverStreamLimits`);
where the stream may still cut a version after its acks, the put counts its chunks once its meta is
stored, before the version it replaced is purged, and takes back a cut one (`prove_whole`, `NotWhole`).
The limits come from each bucket's last status, read again after the server announces a config update
(`follow_stream_updates`). Buckets without such limits pay no round trip for any of it.

Own metas: the store remembers the last metas it stored itself (subject, revision, bytes; bounded).
A rewrite that expects exactly such a revision (a chmod or utime after close, a rename, a delete of
a file this mount just wrote) starts from that document instead of reading it back: the revision it
expects is checked by the server (`Nats-Expected-Last-Subject-Sequence`), so another client's change
in between is refused as before (`Conflict`), never overwritten.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from . import testpoints
from .errors import (
    ERR_ATOMIC_DISABLED,
    ERR_BATCH_DUPLICATE_ID,
    ERR_STREAM_MISMATCH,
    AlreadyExists,
    BadName,
    Conflict,
    InvalidArgument,
    JetStreamAPIError,
    MalformedMeta,
    NameTooLong,
    NatsFSError,
    NotFound,
    NotPermitted,
    NotWhole,
    OutcomeUnknown,
    OverStreamLimits,
    ReadOnly,
    StoredButSkipped,
    TooBig,
    Unavailable,
    WrongLastMsgId,
    single_errors,
)
from .retry import Backoff
from .streams import (
    BATCH_MAX_MSGS,
    EXPECTED_LAST_MSG_ID,
    EXPECTED_LAST_SUBJECT_SEQ,
    EXPECTED_STREAM,
    MAX_STREAM_NAME,
    MSG_ID,
    ROLLUP,
    AccountLimits,
    MsgBatches,
    StoredMsg,
    Streams,
    StreamState,
    literal_subject,
)

log = logging.getLogger(__name__)

# A chunk message as published: (subject, payload, headers with its `Nats-Msg-Id`).
ChunkMsg = tuple[str, bytes, dict[str, str]]

STREAM_PREFIX = "OBJ_"
DEFAULT_CHUNK_SIZE = 128 * 1024
# The server refuses a control line (PUB/HPUB/request subject, reply and sizes) over 4096 bytes by default
# and then closes the connection; INFO does not announce it. Subjects stay below it with room for the rest.
DEFAULT_MAX_SUBJECT = 4096 - 256
# Room the headers of a meta publish take next to the JSON (rollup, expected sequence, message id).
_META_HEADER_ROOM = 256
# Room the headers of a chunk publish take next to its bytes (message id, atomic batch id and sequence).
_CHUNK_HEADER_ROOM = 256
# How long an ambiguous meta publish is retried and read back: well inside the 120 s duplicate window.
SETTLE_S = 60.0
# The most chunks a put sent as one atomic batch can have: a batch holds at most 1000 messages, the
# last one being the meta.
ATOMIC_MAX_CHUNKS = BATCH_MAX_MSGS - 1
# A file of at most one chunk and at most this size is put by `_put_small` (read and hashed in place).
SMALL_PUT_MAX = 256 * 1024
# The most time `PutSession.abort` spends on a put that will not be committed (purging its chunks, telling
# the upload worker): aborts run shielded after a caller's deadline (a close past its flush timeout), so
# this is how far past that deadline the caller can return. What is not purged by then the `PutLog`
# settles later (the purge is idempotent).
ABORT_CLEANUP_S = 1.0
# How long the check that a put just stored is still whole (and taking it back if not) may take, past
# the caller's deadline (the put is stored: see `ObjectStore.prove_whole`).
PROVE_WHOLE_S = 5.0
OWN_METAS_KEPT = 4096  # metas this store stored itself, kept to rewrite them without reading them back
BUCKET_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]+$")
# Keys of a meta's `metadata` map that carry POSIX attributes written by natsfs.
ATTR_MODE = "natsfs.mode"
ATTR_UID = "natsfs.uid"
ATTR_GID = "natsfs.gid"
ATTR_MTIME = "natsfs.mtime_ns"
# An empty object that stands for a FIFO, socket or device (`SPECIAL_KINDS`), and a device's number.
ATTR_TYPE = "natsfs.type"
ATTR_RDEV = "natsfs.rdev"
# A symlink's target text, verbatim, and its signature by the mount that wrote it (natsfs/links.py).
ATTR_SYMLINK = "natsfs.symlink"
ATTR_SYMLINK_SIG = "natsfs.symlink_sig"
SPECIAL_KINDS = {"fifo": 0o010000, "socket": 0o140000, "char": 0o020000, "block": 0o060000}
# The times a file can carry: signed 64-bit nanoseconds since the epoch, negative before 1970 (as the
# kernel's), so 1677-09-21 00:12:43.145224192 to 2262-04-11 23:47:16.854775807 UTC. A time set outside is
# clamped to the nearest end (`clamp_time_ns`), as the kernel clamps to what a local filesystem can hold.
MIN_TIME_NS = -(2**63)
MAX_TIME_NS = 2**63 - 1
# Each numeric POSIX attribute must fit its kernel type (mode_t, uid_t, gid_t, the int64 nanoseconds of a
# timestamp, dev_t): a value outside [low, high) is unusable and ignored, as a value that is not a number is.
_ATTR_LIMITS = {ATTR_MODE: (0, 2**32), ATTR_UID: (0, 2**32), ATTR_GID: (0, 2**32),
                ATTR_MTIME: (MIN_TIME_NS, MAX_TIME_NS + 1), ATTR_RDEV: (0, 2**64)}
# What a numeric POSIX attribute's string must be (`natsfs.mtime_ns` alone may be negative).
_DIGITS = re.compile(r"[0-9]+")
_SIGNED_DIGITS = re.compile(r"-?[0-9]+")
# The largest size a file can show (off_t), and nats.go's bound (uint32) on a chunk count.
MAX_OBJECT_SIZE = 2**63 - 1
MAX_CHUNKS = 2**32 - 1
DIGEST_PREFIX = "SHA-256="
# nats.go never stores a real time in `mtime` (publishMeta zeroes it); neither do we.
ZERO_TIME = "0001-01-01T00:00:00Z"
_NUID_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Key order of nats.go's ObjectInfo JSON; keys other clients add are kept after these.
_META_KEYS = ("name", "description", "headers", "metadata", "options", "bucket", "nuid", "size", "mtime",
              "chunks", "digest", "deleted")


def new_nuid() -> str:
    """A fresh 22-character base62 identifier, the shape of a NATS nuid (unique per put)."""
    n = int.from_bytes(secrets.token_bytes(17), "big")
    out = []
    for _ in range(22):
        n, r = divmod(n, 62)
        out.append(_NUID_ALPHABET[r])
    return "".join(out)


def meta_doc(*, name: str, bucket: str, nuid: str, size: int, chunks: int, digest: str,
             base: dict[str, Any] | None = None, chunk_size: int | None = None, deleted: bool = False,
             link: dict[str, str] | None = None) -> dict[str, Any]:
    """A meta as nats.go writes it, keeping every field of `base` (description, headers, metadata,
    options, and keys this code does not know) that the new values do not replace."""
    base = usable_fields(base or {})
    doc: dict[str, Any] = {"name": name}
    for key in ("description", "headers", "metadata"):
        if base.get(key):
            doc[key] = base[key]
    options = dict(base.get("options") or {}) if isinstance(base.get("options"), dict) else {}
    options.pop("link", None)
    if link is not None:
        options = {"link": link}
    elif chunk_size:
        options["max_chunk_size"] = chunk_size
    if options:
        doc["options"] = options
    doc.update(bucket=bucket, nuid=nuid, size=size, mtime=ZERO_TIME, chunks=chunks)
    if digest:
        doc["digest"] = digest
    if deleted:
        doc["deleted"] = True
    for key, value in base.items():
        if key not in _META_KEYS:
            doc[key] = value
    return doc


# Go's encoding/json escapes these even in compact output (HTML safety, JavaScript line separators).
_GO_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_GO_OPTIONAL = ("description", "headers", "metadata", "options", "digest", "deleted")


def meta_json(doc: dict[str, Any]) -> bytes:
    """The bytes nats.go publishes for a meta: json.Marshal of its ObjectInfo, so struct fields in their
    declared order (`_META_KEYS`), empty `omitempty` fields left out, map keys (headers, metadata) sorted,
    compact, UTF-8, with Go's HTML escapes. Keys other clients added follow in their own order. The one
    writer of metas: the daemon, the in-memory fixtures, the test helpers and the bench all use it."""
    out: dict[str, Any] = {}
    for key in _META_KEYS:
        if key not in doc or (key in _GO_OPTIONAL and not doc[key]):
            continue
        value = doc[key]
        if key in ("headers", "metadata") and isinstance(value, dict):
            value = dict(sorted(value.items()))
        elif key == "options" and isinstance(value, dict):
            value = {k: value[k] for k in ("link", "max_chunk_size") if value.get(k)} | _others(value, _OPTIONS_FIELDS)
            if isinstance(value.get("link"), dict):
                link = value["link"]
                value["link"] = {k: link[k] for k in _LINK_FIELDS if k in link} | _others(link, _LINK_FIELDS)
            if not value:
                continue
        out[key] = value
    out.update(_others(doc, _META_FIELDS))
    text = json.dumps(out, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in _GO_ESCAPES.items():
        text = text.replace(char, escaped)
    return text.encode()


def _others(value: dict[str, Any], fields: Any) -> dict[str, Any]:
    """The keys of `value` other than `fields`, without those Go's decoder reads as one of `fields` (`NUID`,
    `Deleted`: see `load_meta`): a meta this mount stores never makes nats.go read another value than the
    one it wrote."""
    folded = {f.translate(_GO_FOLD) for f in fields}
    return {k: v for k, v in value.items() if k not in fields and k.translate(_GO_FOLD) not in folded}


def _moved_doc(doc: dict[str, Any], name: str, change: Callable[[dict[str, Any]], None] | None
               ) -> dict[str, Any]:
    """The meta of an object moved to `name` (a rename, an alias moved to its canonical subject)."""
    moved = dict(doc, name=name, mtime=ZERO_TIME)
    if change is not None:
        change(moved)
    return moved


def tombstone_doc(bucket: str, name: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The delete marker nats.go's Delete writes for an object: deleted, no size, chunks or digest."""
    options = doc.get("options")
    link = options.get("link") if isinstance(options, dict) else None
    return meta_doc(name=name, bucket=bucket, nuid=str(doc.get("nuid") or ""), size=0, chunks=0, digest="",
                    base=doc, deleted=True, link=link)


def claim_doc(bucket: str, name: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The delete marker a rename writes under the name it takes away (its claim on that name), and the
    delete of a name that shares its nuid with another live name: a tombstone as nats.go's Delete writes
    it, but on a fresh nuid that holds no chunks. Another client's Delete or Put of the name purges the
    nuid it finds there (nats.go, nats.js): that purges nothing, so the moved object is never destroyed."""
    return tombstone_doc(bucket, name, dict(doc, nuid=new_nuid()))


def usable_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` without the descriptive fields and entries of the wrong JSON type that `parse_meta` ignores
    (`headers` a string, a metadata value that is a number, ...: `_descriptive_fields`): a rewrite of such
    a meta stores them as absent, or proper where it puts something there, so nats.go can read it. `doc`
    itself when every field is usable."""
    return _descriptive_fields(doc)[0]


def metadata_of(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of the meta's `metadata` map (empty when there is none or it is not a JSON object)."""
    metadata = doc.get("metadata")
    return dict(metadata) if isinstance(metadata, dict) else {}


def set_posix_attrs(doc: dict[str, Any], attrs: PosixAttrs, defaults: PosixAttrs) -> None:
    """Record POSIX attributes in the meta's metadata, only where they differ from the defaults."""
    metadata = metadata_of(doc)
    for key, value, default, fmt in (
        (ATTR_MODE, attrs.mode, defaults.mode, "o"),
        (ATTR_UID, attrs.uid, defaults.uid, "d"),
        (ATTR_GID, attrs.gid, defaults.gid, "d"),
        (ATTR_MTIME, attrs.mtime_ns, None, "d"),
        (ATTR_RDEV, attrs.rdev, 0, "d"),
    ):
        if value is None or value == default:
            metadata.pop(key, None)
        else:
            metadata[key] = format(value, fmt)
    if attrs.kind in SPECIAL_KINDS:
        metadata[ATTR_TYPE] = attrs.kind
    else:
        metadata.pop(ATTR_TYPE, None)
    if metadata:
        doc["metadata"] = metadata
    else:
        doc.pop("metadata", None)


def stream_name(bucket: str) -> str:
    return STREAM_PREFIX + bucket


def encode_name(name: str) -> str:
    """Meta subject token: URL-safe base64 with padding, of the UTF-8 name (as nats.go)."""
    return base64.urlsafe_b64encode(name.encode("utf-8", "surrogatepass")).decode("ascii")


def decode_token(token: str) -> str | None:
    """The object name of a meta subject token, or None when it is not valid base64 of UTF-8."""
    padded = token + "=" * (-len(token) % 4)
    try:
        return base64.b64decode(padded.encode("ascii"), altchars=b"-_", validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{encode_name(name)}"


def last_meta_request_subject(bucket: str, name: str) -> str:
    """The longest subject natsfs sends for a name: the direct get of its last meta."""
    return f"$JS.API.DIRECT.GET.{stream_name(bucket)}.{meta_subject(bucket, name)}"


def meta_filter(bucket: str) -> str:
    return f"$O.{bucket}.M.>"


def chunk_size_within(chunk_size: int, max_payload: int) -> int:
    """`chunk_size`, or less where a chunk and its headers would be over the server's max payload: the
    largest multiple of 4 KiB that fits (a server that takes less than 8 KiB gets 4 KiB chunks and
    refuses them, with its own error)."""
    fits = (max_payload - _CHUNK_HEADER_ROOM) // 4096 * 4096
    return chunk_size if chunk_size <= fits else max(fits, 4096)


# A nuid names one chunk subject: a single subject token of these characters (nats.go's are 22 of
# them). Anything else (`>`, `*`, a dot) would make a subject filter matching other objects' chunks.
_NUID = re.compile(r"[A-Za-z0-9_-]+")


def usable_nuid(nuid: str) -> bool:
    return bool(_NUID.fullmatch(nuid))


def wildcard_nuid(nuid: object) -> bool:
    """Whether a meta's `nuid` holds a wildcard token (`*`, `>`, `a.*`, ...): other clients' Delete or Put
    of its name purge `$O.<bucket>.C.` + that nuid, a subject filter matching other objects' chunk subjects
    (`*` and `>`: every chunk of the bucket). See `ObjectStore.defuse_wildcard_nuid`."""
    return isinstance(nuid, str) and any(token in ("*", ">") for token in nuid.split("."))


def defused(original: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether `current` (what a meta subject holds now, `ObjectStore.get_meta_doc`) is `original` (the raw
    meta read there before), whose nuid was a wildcard, rewritten on a fresh nuid by
    `ObjectStore.defuse_wildcard_nuid` (a mount's, another fsck's) and changed in nothing else: a tombstone
    rewritten as a tombstone of the same name, a live meta or a link with every other field kept."""
    nuid = current.get("nuid")
    if not wildcard_nuid(original.get("nuid")) or not isinstance(nuid, str) or not usable_nuid(nuid):
        return False
    if original.get("deleted") is True:
        return current.get("deleted") is True and current.get("name") == original.get("name")
    return fields_but_nuid(current) == fields_but_nuid(original)


def fields_but_nuid(doc: dict[str, Any]) -> bytes:
    """The meta `doc` (as `load_meta` reads it: each field under its canonical key, the last of Go's
    case-insensitive duplicates) as a rewrite stores it, without its nuid: every other field, byte for byte
    (its `mtime` too). A rewrite of a wildcard nuid (`ObjectStore.defuse_wildcard_nuid`, `..._alias`)
    keeps all of them, so a meta with the same is that meta rewritten; any other client's change (a Put of
    the same bytes, a header, a description) differs at least in its `mtime`."""
    return meta_json({k: v for k, v in usable_fields(doc).items() if k != "nuid"})


def wildcard_reach(bucket: str, nuid: str) -> str:
    """What a purge by the chunk subject of a wildcard nuid would remove, in words (for log lines)."""
    if nuid in ("*", ">"):
        return f"$O.{bucket}.C.{nuid}, every chunk of the bucket"
    return f"$O.{bucket}.C.{nuid}, every chunk subject that filter matches"


def without_wildcard_nuid(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` on a fresh nuid that holds no chunks when its nuid is a wildcard (`wildcard_nuid`), else `doc`
    itself: this mount never stores a meta that would make other clients purge by a wildcard."""
    return dict(doc, nuid=new_nuid()) if wildcard_nuid(doc.get("nuid")) else doc


def chunk_subject(bucket: str, nuid: str) -> str:
    if not usable_nuid(nuid):  # (parse_meta keeps such nuids out: this is the last guard)
        raise MalformedMeta(f"the nuid {_short(nuid)} cannot name a chunk subject")
    return f"$O.{bucket}.C.{nuid}"


def _delete_marker(data: bytes) -> bool:
    """Whether a meta message is a delete marker (a tombstone), as nats.go reads it (`Deleted` too)."""
    doc = meta_doc_of(data)
    return doc is not None and doc.get("deleted") is True


def valid_bucket_name(name: str) -> bool:
    return bool(BUCKET_NAME_RE.match(name))


def _subject_covers(wide: str, narrow: str) -> bool:
    """Whether every subject that matches the filter `narrow` also matches the filter `wide`."""
    w, n = wide.split("."), narrow.split(".")
    for i, tok in enumerate(w):
        if tok == ">":
            return i < len(n)
        if i >= len(n) or n[i] == ">" or (tok != "*" and (n[i] == "*" or tok != n[i])):
            return False
    return len(w) == len(n)


def _takes_bucket_subjects(bucket: str, config: dict[str, Any]) -> bool:
    """Whether the stream's own subjects take every chunk and meta subject of `bucket` (publishes there
    are stored in it), as nats.go's `$O.<bucket>.C.>` and `$O.<bucket>.M.>` do (wider ones do too)."""
    subjects = [s for s in config.get("subjects") or [] if isinstance(s, str)]
    return all(any(_subject_covers(s, want) for s in subjects)
               for want in (f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"))


def _origins(config: dict[str, Any]) -> tuple[str, list[str]]:
    """(the stream a mirror copies, "" when it is none; the streams it is sourced from)."""
    mirror = config.get("mirror")
    mirrored = str(mirror.get("name") or "?") if isinstance(mirror, dict) else ""
    sources = [str(s.get("name") or "?") if isinstance(s, dict) else "?" for s in config.get("sources") or []]
    return mirrored, sources


def not_an_object_store(bucket: str, config: dict[str, Any]) -> str:
    """Why the stream `OBJ_<bucket>` with this config is no object store at all ("": it is one), which a
    mount then does not show. nats.go binds any stream of that name (`ObjectStore(bucket)` checks
    nothing but its existence) and lists those whose subjects match `$O.*.C.>`; a stream whose subjects
    do not take `$O.<bucket>.C.>` and `$O.<bucket>.M.>` (another tool's stream that happens to be
    called `OBJ_...`) can hold no object of the bucket and take none. A mirror, or a stream with
    sources, gets its messages from other streams: it is an object store, one that takes no writes
    unless its own subjects take the bucket's (`refuses_writes`)."""
    mirrored, sources = _origins(config)
    if mirrored or sources or _takes_bucket_subjects(bucket, config):
        return ""
    subjects = [str(s) for s in config.get("subjects") or []]
    return (f"its subjects ({', '.join(subjects) or 'none'}) are not $O.{bucket}.C.> and $O.{bucket}.M.>, "
            f"and it is neither a mirror nor sourced")


def refuses_writes(bucket: str, config: dict[str, Any]) -> str:
    """Why the object store `bucket` (its stream's config) takes no writes ("": it does): sealed; a mirror
    (the server refuses publishes to it), or a stream with sources whose own subjects do not take the
    bucket's; a stream that does not allow rollup headers, which every meta an ADR-20 client writes
    carries (also any stream with `deny_purge`: the server allows no rollups there). A mount shows such
    a bucket without write bits and refuses every change with `EROFS` at once, as a sealed one."""
    if config.get("sealed"):
        return "sealed"
    mirrored, sources = _origins(config)
    if mirrored:
        return f"a mirror of stream {mirrored}"
    if not _takes_bucket_subjects(bucket, config):
        return f"sourced from {', '.join(sources)}, with no subjects of its own that take publishes"
    if not config.get("allow_rollup_hdrs"):
        return ("its stream does not allow rollup headers (allow_rollup_hdrs), which every meta carries"
                + (", and denies purges (deny_purge)" if config.get("deny_purge") else ""))
    return ""


def digest_of(data: bytes) -> str:
    return DIGEST_PREFIX + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode("ascii")


def format_digest(raw: bytes) -> str:
    return DIGEST_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii")


def parse_digest(digest: str) -> bytes | None:
    """The raw 32 bytes of a `SHA-256=` digest (any case of the prefix, padded or not), or None."""
    if not digest or "=" not in digest:
        return None
    algo, _, value = digest.partition("=")
    if algo.upper() != "SHA-256":
        return None
    value = value.strip()
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


@dataclass(slots=True, frozen=True)
class Link:
    bucket: str
    name: str | None  # None: a link to the whole bucket


def clamp_time_ns(ns: int) -> int:
    """A time set by utimensat as the mount can keep it: within [MIN_TIME_NS, MAX_TIME_NS]."""
    return min(max(ns, MIN_TIME_NS), MAX_TIME_NS)


@dataclass(slots=True, frozen=True)
class PosixAttrs:
    """POSIX attributes natsfs keeps in an object's metadata; None fields fall back to defaults."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    mtime_ns: int | None = None
    kind: str | None = None  # a key of SPECIAL_KINDS: the empty object is that kind of file
    rdev: int | None = None  # a device's number (st_rdev)
    symlink: str | None = None  # the target text of a symlink (an empty object or an ADR-20 link)
    symlink_sig: str | None = None


@dataclass(slots=True)
class ObjectInfo:
    """One object's meta, as much of it as the index needs to keep in memory."""

    bucket: str
    name: str
    nuid: str
    size: int
    chunks: int
    digest: str
    mtime_ns: int  # the meta message's timestamp (or natsfs.mtime_ns when set)
    revision: int  # stream sequence of the meta message
    link: Link | None = None
    deleted: bool = False
    chunk_size: int = 0
    attrs: PosixAttrs | None = None
    meta_bytes: int = 0  # the size of the meta message (0: not known), see `ObjectStore.check_meta_size`
    # The nuid as written when it holds a wildcard token, `*` or `>` (`nuid` is then ""), in a live meta,
    # a link or a tombstone: other clients' Delete or Put of the name would purge `$O.<bucket>.C.*`,
    # every chunk of the bucket (see `ObjectStore.defuse_wildcard_nuid`). Such a live object has no
    # chunks that can be read (none can be published to its subject as its own).
    wildcard_nuid: str = ""
    # With a wildcard nuid only: the meta's other fields as stored (`fields_but_nuid`), to tell its rewrite
    # on a fresh nuid (the same fields) from another client's change (`ObjectStore.wildcard_rewrite_of`).
    wildcard_fields: bytes = b""


@dataclass
class BucketStatus:
    bucket: str
    description: str
    metadata: dict[str, str]
    sealed: bool
    size: int
    max_bytes: int
    storage: str
    replicas: int
    compressed: bool
    ttl_ns: int
    messages: int = 0
    created_ns: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    # Why the bucket takes no writes ("": it does), see `refuses_writes`: sealed, a mirror, ...
    read_only: str = ""


@dataclass(frozen=True)
class StreamLimits:
    """The limits of a bucket's stream that can cut a version short (from its config; unset: -1 / 0).

    nats-server applies them after storing each message, oldest first: `max_msgs_per_subject` on the
    one subject all chunks of a version share, and with discard old (the server's default policy)
    `max_bytes` and `max_msgs` over the whole stream; `max_age` at any time. With discard new the
    server refuses a message over `max_bytes` / `max_msgs` instead (a refused put, `ENOSPC`)."""

    per_subject: int = -1
    max_bytes: int = -1  # with discard old only
    max_msgs: int = -1  # with discard old only
    max_age_ns: int = 0

    @classmethod
    def of(cls, config: dict[str, Any]) -> StreamLimits:
        def num(key: str) -> int:
            value = config.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else -1

        discard_old = config.get("discard") != "new"
        return cls(per_subject=num("max_msgs_per_subject"),
                   max_bytes=num("max_bytes") if discard_old else -1,
                   max_msgs=num("max_msgs") if discard_old else -1,
                   max_age_ns=max(num("max_age"), 0))

    @property
    def may_evict(self) -> bool:
        """Whether the stream may drop the first chunks of a version after they were acknowledged (to make
        room for later messages, its own or another client's, or by age): a put is then checked after
        its meta (`ObjectStore.prove_whole`) before the version it replaces is purged."""
        return self.max_bytes > 0 or self.max_msgs > 0 or self.max_age_ns > 0

    def describe(self) -> str:
        parts = [f"max_bytes {self.max_bytes} with discard old" if self.max_bytes > 0 else "",
                 f"max_msgs {self.max_msgs} with discard old" if self.max_msgs > 0 else "",
                 f"max_age {self.max_age_ns / 1e9:g} s" if self.max_age_ns > 0 else ""]
        return ", ".join(p for p in parts if p)

    def refusal(self, chunks: int, stored_bytes: int) -> str | None:
        """Why a version of `chunks` chunks taking at least `stored_bytes` in the stream can never be held
        whole (None: it can). `stored_bytes` is a lower bound (payloads and subjects): a version just
        under a limit is not refused here, and is caught after its meta if the stream cut it."""
        if 0 < self.per_subject < chunks:
            return (f"the stream's max_msgs_per_subject is {self.per_subject} and a version's {chunks} chunks "
                    f"share one subject: only its last {self.per_subject} would be kept")
        if 0 < self.max_bytes < stored_bytes:
            return (f"the stream's max_bytes is {self.max_bytes} with discard old, and the version takes at least "
                    f"{stored_bytes} bytes: its first chunks would be dropped to make room for the rest")
        if 0 < self.max_msgs < chunks + 1:
            return (f"the stream's max_msgs is {self.max_msgs} with discard old, and the version is {chunks + 1} "
                    f"messages: its first chunks would be dropped to make room for the rest")
        return None


NO_LIMITS = StreamLimits()


def _short(value: Any) -> str:
    """A value for a log line: its repr, cut short (another client may have written megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Told of what a meta's parse ignores as unusable: one message for its descriptive fields of the wrong JSON
# type, one per unusable POSIX attribute.
Ignored = Callable[[str], None]


def _attrs_from(metadata: dict[str, Any], name: str, ignored: Ignored | None) -> PosixAttrs | None:
    if not any(isinstance(k, str) and k.startswith("natsfs.") for k in metadata):
        return None

    def unusable(key: str, raw: Any) -> None:
        if ignored is not None:
            ignored(f"meta for {name!r} has an unusable {key} {_short(raw)} (ignored: the default applies)")

    def num(key: str, base: int = 10) -> int | None:
        raw = metadata.get(key)
        if raw is None:
            return None
        if not isinstance(raw, str):
            unusable(key, raw)  # not the string another client should have written
            return None
        # ASCII digits only (a sign only where the value may be negative): int() alone also takes
        # "0o777", " 755", "7_5_5", "+755" and digits of other scripts ("٧٥٥"), which no writer means.
        if not (_SIGNED_DIGITS if key == ATTR_MTIME else _DIGITS).fullmatch(raw):
            unusable(key, raw)
            return None
        try:
            v = int(raw, base)
        except ValueError:
            unusable(key, raw)  # an 8 or a 9 in an octal mode
            return None
        low, high = _ATTR_LIMITS[key]
        if not low <= v < high:
            unusable(key, raw)
            return None
        return v

    def text(key: str) -> str | None:
        raw = metadata.get(key)
        if raw is not None and not isinstance(raw, str):
            unusable(key, raw)
            return None
        return raw

    kind = text(ATTR_TYPE)
    if kind is not None and kind not in SPECIAL_KINDS:
        unusable(ATTR_TYPE, kind)
        kind = None
    return PosixAttrs(num(ATTR_MODE, 8), num(ATTR_UID), num(ATTR_GID), num(ATTR_MTIME), kind, num(ATTR_RDEV),
                      text(ATTR_SYMLINK), text(ATTR_SYMLINK_SIG))


# The JSON type nats.go's ObjectInfo declares for each field of a meta, as a check and its name. A meta
# where one has another type is one nats.go cannot unmarshal at all (GetInfo answers ErrBadObjectMeta,
# Watch and List skip it). natsfs splits the fields:
# - those that decide what the object IS (its name, bucket, nuid, size, chunks, digest, whether it is
#   deleted, the link it is): of the wrong type, the meta is malformed and skipped (`load_meta`), so
#   such a value is never turned into text (a link to bucket `7` named `['a']`);
# - the descriptive ones (description, headers, metadata, options, options.max_chunk_size, mtime): of the
#   wrong type, that field or map entry is ignored and the object shows (`_descriptive_fields`): nats.py
#   stores whatever a user passes (`headers={"Content-Type": "text/plain"}`), and objects from every
#   client read through the mount.
# `null` is accepted wherever nats.go accepts it (the zero value: an absent field, an empty string in a
# map or list). Keys nats.go does not know may hold anything. `mtime` is any string: nats.go parses it as
# a time, but natsfs ignores it and nats.py writes "" in its tombstones.
_TypeCheck = tuple[Callable[[Any], bool], str]


def _text_type(value: Any) -> bool:
    return isinstance(value, str)


def _bool_type(value: Any) -> bool:
    return isinstance(value, bool)


def _uint_type(bits: int) -> Callable[[Any], bool]:
    # (exactly int: not a bool, nor `-0`, which Go's decoder refuses as unsigned)
    return lambda value: type(value) is int and 0 <= value < 1 << bits


def _object_type(value: Any) -> bool:
    return isinstance(value, dict)


def _text_list_type(value: Any) -> bool:
    return isinstance(value, list) and all(v is None or isinstance(v, str) for v in value)


_TEXT: _TypeCheck = (_text_type, "a string")
_OBJECT: _TypeCheck = (_object_type, "an object")
_STRICT_META_TYPES: dict[str, _TypeCheck] = {
    "name": _TEXT, "bucket": _TEXT, "nuid": _TEXT, "size": (_uint_type(64), "an unsigned 64-bit number"),
    "chunks": (_uint_type(32), "an unsigned 32-bit number"), "digest": _TEXT, "deleted": (_bool_type, "a boolean"),
}
_STRICT_OPTIONS_TYPES: dict[str, _TypeCheck] = {"link": _OBJECT}
_STRICT_LINK_TYPES: dict[str, _TypeCheck] = {"bucket": _TEXT, "name": _TEXT}
# Descriptive fields: the field itself, and for a map the type of each of its values.
_DESCRIPTIVE_TYPES: dict[str, _TypeCheck] = {"description": _TEXT, "headers": _OBJECT, "metadata": _OBJECT,
                                             "options": _OBJECT, "mtime": _TEXT}
_DESCRIPTIVE_VALUE_TYPES: dict[str, _TypeCheck] = {"headers": (_text_list_type, "a list of strings"),
                                                   "metadata": _TEXT}
_MAX_CHUNK_SIZE_TYPE: _TypeCheck = (_uint_type(32), "an unsigned 32-bit number")
# The metadata keys `_attrs_from` reads: it reports a value of the wrong type there itself.
_ATTR_KEYS = frozenset({ATTR_MODE, ATTR_UID, ATTR_GID, ATTR_MTIME, ATTR_TYPE, ATTR_RDEV, ATTR_SYMLINK,
                        ATTR_SYMLINK_SIG})


def _descriptive_fields(doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`doc` without its descriptive fields and map entries of the wrong JSON type (see above), and what
    was left out, one text each (empty, and `doc` itself, when nothing was). A metadata entry
    `_attrs_from` reads is left out of that list: it reports the entry itself."""
    out: dict[str, Any] | None = None
    dropped: list[str] = []

    def replace(key: str, value: Any) -> None:
        nonlocal out
        if out is None:
            out = dict(doc)
        if value is None:
            del out[key]
        else:
            out[key] = value

    for key, (check, kind) in _DESCRIPTIVE_TYPES.items():
        value = doc.get(key)
        if value is None:
            continue
        if not check(value):
            dropped.append(f"{key} {_short(value)} (not {kind})")
            replace(key, None)
            continue
        entry_type = _DESCRIPTIVE_VALUE_TYPES.get(key)
        if entry_type is not None:
            entry_check, entry_kind = entry_type
            bad = [k for k, v in value.items() if v is not None and not entry_check(v)]
            if bad:
                dropped += [f"{key}[{_short(k)}] {_short(value[k])} (not {entry_kind})" for k in bad
                            if not (key == "metadata" and k in _ATTR_KEYS)]
                bad_keys = set(bad)  # (not the list: thousands of bad entries would cost quadratic time)
                replace(key, {k: v for k, v in value.items() if k not in bad_keys})
        elif key == "options" and "max_chunk_size" in value:
            chunk_check, chunk_kind = _MAX_CHUNK_SIZE_TYPE
            chunk_size = value["max_chunk_size"]
            if chunk_size is not None and not chunk_check(chunk_size):
                dropped.append(f"options.max_chunk_size {_short(chunk_size)} (not {chunk_kind})")
                replace(key, {k: v for k, v in value.items() if k != "max_chunk_size"})
    return (doc if out is None else out), dropped


# ---------------------------------------------------------------- metas read as Go's encoding/json reads them
# nats.go reads a meta with `json.Unmarshal` into its ObjectInfo. Where Go's decoder and Python's
# `json.loads` differ, another client could make natsfs and nats.go see different objects: natsfs defusing
# one nuid while nats.go's Delete purges another (`{"nuid":"abc","NUID":"*"}` is nuid `*` to nats.go).
# `load_meta` reads a meta as Go does where that decides what the object is:
# - the bytes are UTF-8 only: a byte order mark (or UTF-16, UTF-32, which `json.loads` guesses) is no JSON
#   to Go; an invalid byte in a string is U+FFFD, one per byte, and so is an escaped lone surrogate;
# - NaN and Infinity are no JSON; a number of any length is one (Python's `int()` stops at 4300 digits:
#   such a number is no usable value, and an unknown key holding one is dropped); nesting deeper than
#   Go's 10000 levels is no JSON, and what is nested deeper than `_KEPT_DEPTH` is cut (`_shallow`, which
#   checks that what it cuts is JSON too: Python's parser cannot take the thousands of levels Go's can);
# - a key names a field of a struct (the meta, its `options`, `options.link`) exactly or folded as Go
#   folds it (ASCII letters in either case, `ſ` U+017F as `s`, `K` U+212A as `k`); every key naming a field
#   sets it in turn, so the last one wins; `null` leaves a string, number or boolean as it was and makes
#   an object or map absent; an object or map given twice (`options`, `link`, `headers`, `metadata`) is
#   merged key by key, as Go decodes into the one it already holds;
# - a value of another JSON type than a field that decides what the object is declares fails Go's whole
#   decode even where a later key sets the field right: `load_meta` reports the first one.
# The result holds each known field under its canonical (lower-case) key, so a rewrite stores no
# case-variant duplicates. Map keys (headers, metadata) and unknown keys are kept as written.
class MetaNotJSON(ValueError):
    """A meta Go's decoder refuses as JSON, or one that is no JSON object (the text says which)."""


class _Pairs(list[tuple[str, Any]]):
    """A JSON object's members in their order, duplicates kept (json's `object_pairs_hook`)."""


class _Huge:
    """A number Python will not convert (over 4300 digits, or a float out of range)."""


_HUGE = _Huge()
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Go's foldName, as far as it can make a key equal to an ASCII field name: ASCII letters upper-cased, and
# the two runes whose case-folding orbit holds an ASCII letter (every other rune folds to a non-ASCII one).
_GO_FOLD = {c: c - 32 for c in range(ord("a"), ord("z") + 1)} | {0x17F: ord("S"), 0x212A: ord("K")}
_GO_MAX_DEPTH = 10_000
_KEPT_DEPTH = 64
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
# The structs of nats.go's ObjectInfo: canonical key -> a struct's fields, "map", or None (a value).
_LINK_FIELDS: dict[str, Any] = {"bucket": None, "name": None}
_OPTIONS_FIELDS: dict[str, Any] = {"link": _LINK_FIELDS, "max_chunk_size": None}
_META_FIELDS: dict[str, Any] = {"name": None, "description": None, "headers": "map", "metadata": "map",
                                "options": _OPTIONS_FIELDS, "bucket": None, "nuid": None, "size": None,
                                "mtime": None, "chunks": None, "digest": None, "deleted": None}
# Each struct's fields by their folded names.
_FOLDED = {id(fields): {f.translate(_GO_FOLD): f for f in fields}
           for fields in (_LINK_FIELDS, _OPTIONS_FIELDS, _META_FIELDS)}


def _go_utf8_errors(e: UnicodeError) -> tuple[str, int]:
    # Go's decoder replaces invalid UTF-8 byte by byte (utf8.DecodeRune: RuneError of size 1).
    assert isinstance(e, UnicodeDecodeError)
    return "\ufffd", e.start + 1


codecs.register_error("natsfs.go_utf8", _go_utf8_errors)


def _fix(value: Any) -> Any:
    """`value` with each lone surrogate in its strings (and keys) as U+FFFD, as Go's decoder reads them."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, _Pairs):
        return _Pairs((_fix(k), _fix(v)) for k, v in value)
    if isinstance(value, list):
        return [_fix(v) for v in value]
    return value


class _MinusZero(int):
    """`-0`: zero, but no unsigned number to Go (`strconv.ParseUint` takes no sign)."""


def _int(text: str) -> Any:
    if len(text) > 4300:
        return _HUGE
    return _MinusZero(0) if text == "-0" else int(text)


def _float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _HUGE


def _not_json(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _plain(value: Any, huge: list[bool]) -> Any:
    """`value` with objects as dicts (the last of duplicate keys wins) and unusable numbers as None (noted
    in `huge`)."""
    kind = type(value)
    if kind is _Pairs:
        return {k: _plain(v, huge) for k, v in value}
    if kind is list:
        return [_plain(v, huge) for v in value]
    if value is _HUGE:
        huge.append(True)
        return None
    return value


def _go_struct(pairs: _Pairs, fields: dict[str, Any], strict: dict[str, _TypeCheck], path: str,
               wrong: list[str], into: dict[str, Any] | None) -> dict[str, Any]:
    """A struct of ObjectInfo decoded from `pairs` into `into` (in place: a struct or map given again is
    merged into the one decoded so far, never copied, or thousands of repeats of a big one would cost
    quadratic time), as Go's decoder does."""
    out = into if into is not None else {}
    folded = _FOLDED[id(fields)]
    for key, value in pairs:
        name = key if key in fields else folded.get(key.translate(_GO_FOLD))
        if name is None:  # a key nats.go does not know: kept as written (not one holding a huge number)
            huge: list[bool] = []
            plain = _plain(value, huge)
            if not huge:
                out[key] = plain
            continue
        kind = fields[name]
        if value is None:  # a pointer or map is nil then; a string, number or boolean unchanged
            if kind is not None or name not in out:
                out[name] = None
            continue
        previous = out.get(name)
        if isinstance(value, _Pairs) and isinstance(kind, dict):
            out[name] = _go_struct(value, kind, _STRICT_LINK_TYPES if kind is _LINK_FIELDS else
                                   _STRICT_OPTIONS_TYPES, f"{path}{name}.", wrong,
                                   previous if isinstance(previous, dict) else None)
            continue
        if isinstance(value, _Pairs) and kind == "map":
            merged = _plain(value, [])
            if isinstance(previous, dict):  # (a dict this decode made: merged into in place)
                previous.update(merged)
                merged = previous
            out[name] = merged
            continue
        check = strict.get(name)
        if check is not None and not wrong and (value is _HUGE or not check[0](value)):
            wrong.append(f"its {path}{name} is {'a number too long' if value is _HUGE else _short(value)}, "
                         f"not {check[1]}")
        out[name] = _plain(value, [])
    return out


def _shallow(text: str) -> str:
    """`text` with each array or object nested deeper than `_KEPT_DEPTH` levels replaced by `[]`: deeper
    than any field of a meta, so only keys nats.go ignores (or a value of the wrong type) hold one, and
    Python's parser cannot take the thousands of levels Go's can. `MetaNotJSON` over Go's limit, and where
    what was cut is no JSON: Go refuses the whole meta then (`[[...[1,]...]]`, `NaN` 2000 levels deep)."""
    # One pass cuts `text` into bands of `_KEPT_DEPTH` levels: the first is the result, each other one a
    # value cut out of the band above it (with what is nested deeper in it cut out as well), parsed here
    # only to see that it is JSON. Each byte is scanned and parsed once, and nothing recurses.
    cut: list[str] = []
    bands: list[tuple[list[str], int]] = [([], 0)]  # the open ones: their parts so far, where the rest starts
    depth = 0
    for m in _JSON_TOKEN.finditer(text):
        char = m.group()
        if char in "[{":
            depth += 1
            if depth > _GO_MAX_DEPTH:
                raise MetaNotJSON("is not JSON nats.go can read (nested deeper than 10000 levels)")
            if depth % _KEPT_DEPTH == 1 and depth > 1:
                parts, start = bands[-1]
                parts += [text[start:m.start()], "[]"]
                bands.append(([], m.start()))
        elif char in "]}":
            if depth % _KEPT_DEPTH == 1 and depth > 1:
                parts, start = bands.pop()
                cut.append("".join(parts) + text[start:m.end()])
                bands[-1] = (bands[-1][0], m.end())
            depth -= 1
    while len(bands) > 1:  # (brackets left open: the bands cut open are no JSON, nor is the rest)
        parts, start = bands.pop()
        cut.append("".join(parts) + text[start:])
        bands[-1] = (bands[-1][0], len(text))
    for band in cut:
        try:
            json.loads(band, parse_int=str, parse_float=str, parse_constant=_not_json)
        except ValueError:
            raise MetaNotJSON("is not JSON") from None
    parts, start = bands[0]
    return "".join(parts) + text[start:]


_LOADS: dict[str, Any] = {"object_pairs_hook": _Pairs, "parse_int": _int, "parse_float": _float,
                          "parse_constant": _not_json}


def _read_meta(text: str) -> tuple[dict[str, Any], str | None]:
    try:
        raw = json.loads(text, **_LOADS)
    except ValueError:  # (not RecursionError: `load_meta` cuts the text then)
        raise MetaNotJSON("is not JSON") from None
    if "\\u" in text:  # (only an escape makes a lone surrogate: UTF-8 has none)
        raw = _fix(raw)
    if not isinstance(raw, _Pairs):
        raise MetaNotJSON("is not a JSON object")
    wrong: list[str] = []
    return _go_struct(raw, _META_FIELDS, _STRICT_META_TYPES, "", wrong, None), (wrong[0] if wrong else None)


def read_by_a_name(bucket: str, subject: str) -> bool:
    """Whether `subject` is the meta subject nats.go reads for some object name X (`$O.<bucket>.M.` +
    padded URL-safe base64 of X's bytes, any bytes: Go's names need not be UTF-8): its `Put(X)` and
    `Delete(X)` read the last meta there (`GetInfo`, which never checks the meta's own `name`) and purge
    `$O.<bucket>.C.` + the nuid it holds."""
    prefix = f"$O.{bucket}.M."
    token = subject[len(prefix):] if subject.startswith(prefix) else ""
    if not token or "." in token:
        return False
    try:
        raw = base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return False
    return bool(raw) and base64.urlsafe_b64encode(raw).decode("ascii") == token


def alias_wildcard_nuid(bucket: str, msg: StoredMsg) -> tuple[str, str] | None:
    """(its name, "" when that is no string; its nuid) of a meta under a subject that is not its own name's
    canonical one (an alias shown here when its token is no UTF-8 name's; else skipped here as under
    "another name's subject") that nats.go reads, when its nuid holds a wildcard (`wildcard_nuid`) and the
    subject is the one nats.go's `Put(X)` and `Delete(X)` read for some name X (`read_by_a_name`): they
    would purge by that wildcard, every chunk of the bucket, so the mount rewrites it in place
    (`ObjectStore.defuse_wildcard_alias`), its own name and every other field kept. None for anything else."""
    try:
        doc, why = load_meta(msg.data)
    except (ValueError, RecursionError):  # (`MetaNotJSON`; and whatever else refusing bad bytes may raise)
        return None
    name, nuid = doc.get("name"), doc.get("nuid")
    if why is not None or not wildcard_nuid(nuid) or not read_by_a_name(bucket, msg.subject):
        return None
    if isinstance(name, str) and name:
        try:
            if msg.subject == meta_subject(bucket, name):
                return None  # (its name's own subject: see `skipped_wildcard_nuid`, `ObjectInfo.wildcard_nuid`)
        except NatsFSError:
            pass
    assert isinstance(nuid, str)
    return (name if isinstance(name, str) else ""), nuid


def skipped_wildcard_nuid(bucket: str, msg: StoredMsg) -> tuple[str, str] | None:
    """(name, nuid) of a meta this mount skips (`parse_meta` refused it) that nats.go reads, on its name's
    own subject, with a wildcard nuid (`wildcard_nuid`): another client's Delete or Put of that name would
    purge by that wildcard, so the mount rewrites it as well (`ObjectStore.defuse_wildcard_nuid`). None
    for anything else."""
    try:
        doc, why = load_meta(msg.data)
    except (ValueError, RecursionError):  # (`MetaNotJSON`; and whatever else refusing bad bytes may raise)
        return None
    name, nuid = doc.get("name"), doc.get("nuid")
    if why is not None or not isinstance(name, str) or not name or not wildcard_nuid(nuid):
        return None
    try:
        if msg.subject != meta_subject(bucket, name):
            return None
    except NatsFSError:  # (a name no subject can carry)
        return None
    assert isinstance(nuid, str)
    return name, nuid


def load_meta(data: bytes | bytearray) -> tuple[dict[str, Any], str | None]:
    """The meta document in `data` as nats.go's `json.Unmarshal` reads it (see above), and why nats.go
    could not read it at all: the first value of the wrong JSON type for a field that decides what the
    object is (None when there is none). `MetaNotJSON` when Go refuses the bytes, or they hold no object."""
    text = bytes(data).decode("utf-8", "natsfs.go_utf8")
    if text.startswith("\ufeff"):
        raise MetaNotJSON("is not JSON nats.go can read (it starts with a byte order mark)")
    if text.count("[") + text.count("{") > _KEPT_DEPTH:
        # Maybe nested deeper than any field of a meta (Go takes 10000 levels): read it cut, always, not
        # only where Python's parser or a walk of the result would run out of stack, so what a meta reads
        # as (and a rewrite stores) never depends on how deep in the stack it is read.
        text = _shallow(text)
    try:
        return _read_meta(text)
    except RecursionError:  # (only with the stack all but used up already)
        raise MetaNotJSON("is not JSON") from None


def meta_doc_of(data: bytes | bytearray) -> dict[str, Any] | None:
    """`load_meta`'s document, or None where Go's decoder refuses the bytes or they hold no object."""
    try:
        return load_meta(data)[0]
    except MetaNotJSON:
        return None


def parse_meta(bucket: str, msg: StoredMsg, ignored: Ignored | None = None) -> ObjectInfo:
    """Parse a meta message leniently (all three clients' quirks); `MalformedMeta` when unusable, as
    is a meta whose name, bucket, nuid, size, chunks, digest, deleted or link is of a JSON type nats.go
    could not unmarshal (`load_meta`: also where an earlier key of the same field had the wrong type and
    a later one the right type).

    A value that cannot be used but leaves the object usable is ignored: a descriptive field or map entry
    of the wrong JSON type (`headers` a string, a metadata value that is a number, `options` a list, ...:
    `_descriptive_fields`), a POSIX attribute of the metadata that is not a number or out of its type's
    range. The object shows as if it were absent (the attribute's default applies), and `ignored` is
    told why: once for the fields of the wrong type, once per unusable attribute."""
    if msg.subject and not literal_subject(msg.subject):
        # Stored as published (`$O.b.M.>`), but no client can address it, and any change of it would
        # purge its subject, which matches every meta subject in the bucket.
        raise MalformedMeta(f"meta {msg.subject} (seq {msg.seq}) is under a wildcard subject")
    token = msg.subject.rsplit(".", 1)[-1] if msg.subject else ""
    try:
        doc, wrong = load_meta(msg.data)
    except MetaNotJSON as e:
        raise MalformedMeta(f"meta {msg.subject} (seq {msg.seq}) {e}") from None
    name = doc.get("name")
    subject_name = decode_token(token)
    if wrong is not None:
        shown = name if isinstance(name, str) else subject_name
        where = f"for {_short(shown)} ({msg.subject}, seq {msg.seq})" if shown is not None else \
            f"{msg.subject} (seq {msg.seq})"
        raise MalformedMeta(f"meta {where} is not one nats.go can read: {wrong}")
    if not isinstance(name, str):
        if subject_name is None:
            raise MalformedMeta(f"meta {msg.subject} (seq {msg.seq}) has no name")
        name = subject_name
    elif subject_name is not None and subject_name != name:
        raise MalformedMeta(f"meta {msg.subject} (seq {msg.seq}) names {name!r}, its subject another name")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # JSON allows lone surrogates ("\ud800"); no client can address such a name by subject.
        raise MalformedMeta(f"meta {msg.subject} (seq {msg.seq}) has a name that is not valid UTF-8") from None

    def integer(key: str, limit: int) -> int:
        v = doc.get(key, 0)
        if v is None:
            return 0
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= limit:
            raise MalformedMeta(f"meta for {name!r} has a bad {key}: {_short(v)}")
        return v

    usable, dropped = _descriptive_fields(doc)
    if dropped and ignored is not None:
        listed = dropped if len(dropped) <= 5 else [*dropped[:5], f"and {len(dropped) - 5} more"]
        ignored(f"meta for {name!r} has fields of the wrong JSON type (ignored): {'; '.join(listed)}")
    deleted = bool(doc.get("deleted"))
    options = usable.get("options") or {}
    link = None
    raw_link = options.get("link") or {}
    if raw_link.get("bucket"):
        link = Link(raw_link["bucket"], raw_link.get("name") or None)
    size, chunks = integer("size", MAX_OBJECT_SIZE), integer("chunks", MAX_CHUNKS)
    nuid = doc.get("nuid") or ""
    wild = nuid if wildcard_nuid(nuid) else ""
    if nuid and not usable_nuid(nuid) and (deleted or link is not None or wild):
        # A tombstone's or a link's nuid names no chunks of its own, nor does a wildcard (no chunk is
        # published to a subject filter as one object's): never a subject filter.
        nuid = ""
    if not deleted and link is None:
        if (chunks or size) and not nuid and not wild:
            raise MalformedMeta(f"meta for {name!r} claims {chunks} chunks but has no nuid")
        if nuid and not usable_nuid(nuid):
            raise MalformedMeta(f"meta for {name!r} has an unusable nuid {_short(nuid)}")
        if chunks == 0 and size > 0:
            raise MalformedMeta(f"meta for {name!r} has {size} bytes in 0 chunks")
    digest = doc.get("digest") or ""
    # (The metadata as written: `_attrs_from` reports a POSIX attribute of the wrong type itself.)
    metadata = doc.get("metadata")
    attrs = _attrs_from(metadata, name, ignored) if isinstance(metadata, dict) else None
    chunk_size = options.get("max_chunk_size") or 0
    mtime_ns = msg.time_ns
    if attrs is not None and attrs.mtime_ns is not None:
        mtime_ns = attrs.mtime_ns
    return ObjectInfo(
        bucket=bucket, name=name, nuid=nuid, size=size, chunks=chunks, digest=digest, mtime_ns=mtime_ns,
        revision=msg.seq, link=link, deleted=deleted, chunk_size=chunk_size, attrs=attrs,
        meta_bytes=len(msg.data), wildcard_nuid=wild, wildcard_fields=fields_but_nuid(doc) if wild else b"",
    )


def bucket_status(bucket: str, st: StreamState) -> BucketStatus:
    cfg = st.config
    return BucketStatus(
        bucket=bucket,
        description=cfg.get("description") or "",
        metadata={k: v for k, v in (cfg.get("metadata") or {}).items() if not k.startswith("_nats")},
        sealed=st.sealed,
        size=st.bytes,
        max_bytes=st.max_bytes,
        storage=str(cfg.get("storage", "file")),
        replicas=int(cfg.get("num_replicas", 1)),
        compressed=str(cfg.get("compression", "none")) not in ("none", ""),
        ttl_ns=int(cfg.get("max_age", 0)),
        messages=st.messages,
        created_ns=st.created_ns,
        config=cfg,
        read_only=refuses_writes(bucket, cfg),
    )


class _ChunkUnsettled(Unavailable):
    """(`ObjectStore._publish_after`) Neither the chunk's nor the meta's ack came back."""


def check_same_object(bucket: str, name: str, doc: dict[str, Any], expected_nuid: str) -> None:
    """`Conflict` when the meta read at the revision a change expects holds another nuid than the version
    the change was made to (`expected_nuid`; "" checks nothing). Within one stream a revision names one
    message, so this happens only when the stream was deleted and created again: the new stream numbers
    its messages from 1 again, and another client's object can sit at the very revision this mount read
    from the old one, where `Nats-Expected-Last-Subject-Sequence` alone would let the change replace it."""
    if expected_nuid and str(doc.get("nuid") or "") != expected_nuid:
        raise Conflict(f"{bucket}/{name} is another object at the same revision (its stream was deleted and "
                       f"created again)")


class ObjectStore:
    """The ADR-20 operations the filesystem uses, over any `Streams`."""

    def __init__(self, streams: Streams, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 file_sender: FileSender | None = None, max_subject_bytes: int = DEFAULT_MAX_SUBJECT,
                 settle_timeout: float = SETTLE_S, max_meta_bytes: int = 0):
        self.streams = streams
        # The mount's --max-meta-bytes (0: no limit but the server's max payload): see `check_meta_size`.
        self.max_meta_bytes = max_meta_bytes
        self.chunk_size = chunk_size
        self.file_sender = file_sender
        self.max_subject_bytes = max_subject_bytes
        self.settle_timeout = settle_timeout
        # Told of every put that sends chunks, so that no put can leave orphan chunks unnoticed.
        self.put_log: PutLog | None = None
        # Whether each bucket's stream allows atomic batch publish (from its last status).
        self._atomic: dict[str, bool] = {}
        # The limits of each bucket's stream that can cut a version short (from its last status: as
        # fresh as that, see `check_fits`); a bucket not in it has none known.
        self._limits: dict[str, StreamLimits] = {}
        # Buckets whose stream config the server announced changed since their status was last read
        # (`follow_stream_updates`): read again before their next put (`check_fits`).
        self._stale: set[str] = set()
        # bucket -> why its stream is not an object store ("": it is one), as its config last showed
        # (`list_buckets`, `bucket_status`); a bucket not in it was not looked at yet.
        self._shapes: dict[str, str] = {}
        # bucket -> why it takes no writes ("": it does), as its config last showed (`note_read_only`).
        self._read_only: dict[str, str] = {}
        # Metas this store stored itself: meta subject -> (revision, payload), most recent last. A
        # revision is a stream sequence, which a stream deleted and created again reuses: the entries of
        # a bucket are dropped when its stream turns out to be another incarnation (`note_created`).
        self._own_metas: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        # bucket -> its stream's creation time as last seen (the incarnation its revisions belong to).
        self._created_ns: dict[str, int] = {}
        # (bucket, old name) -> renames of it under way here (see `renaming_away`).
        self._renaming: Counter[tuple[str, str]] = Counter()
        # (bucket, nuid, name) -> the live names other than `name` whose meta holds `nuid` (the layer
        # that keeps the index sets it): chunks another name still uses are never purged.
        self.nuid_users: Callable[[str, str, str], tuple[str, ...]] | None = None

    @property
    def max_payload(self) -> int:
        """The largest message the server takes."""
        return self.streams.max_payload

    @property
    def connected(self) -> bool:
        """Whether there is a connection to the server now (False while it is being replaced)."""
        return self.streams.connected

    # ---------------------------------------------------------------- names
    def check_name(self, bucket: str, name: str) -> None:
        """Refuse a name no client could use (`BadName`) or whose requests the server would refuse
        (`NameTooLong`), before anything is sent."""
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = name.encode("utf-8", "backslashreplace").decode("utf-8")
            raise BadName(f"{bucket}/{shown}: the name is not UTF-8 (no ADR-20 client could use it)") from None
        longest = len(last_meta_request_subject(bucket, name))
        if longest > self.subject_limit:
            raise NameTooLong(f"{bucket}/{name[:40]}...: the name's subjects would be {longest} bytes, over the "
                              f"limit of {self.subject_limit}")

    @property
    def subject_limit(self) -> int:
        """The longest subject sent: `max_subject_bytes`, or less where the server turned out to take less
        (a `max_control_line` under its default, which INFO does not announce)."""
        learned = self.streams.subject_limit
        return self.max_subject_bytes if learned is None else min(self.max_subject_bytes, learned)

    def check_meta_payload(self, bucket: str, doc: dict[str, Any], data: bytes | None = None) -> None:
        """`TooBig` when a meta would be over the server's max payload (with room for its headers)."""
        size = len(data if data is not None else meta_json(doc))
        limit = self.max_payload - _META_HEADER_ROOM
        if size > limit:
            raise TooBig(f"the meta of {bucket}/{str(doc.get('name'))[:60]!r} would be {size} bytes, over the "
                         f"server's limit of {limit}")

    def check_meta_size(self, bucket: str, doc: dict[str, Any], data: bytes | None = None, *,
                        replaced_bytes: int = 0) -> None:
        """Every meta this store writes passes here (`publish_meta`, the atomic put) and so do the checks
        made ahead of a change (a directory rename, an xattr of a file not stored yet). `TooBig` when
        the meta would be over the server's max payload, or over `max_meta_bytes` AND larger than the
        meta it replaces (`replaced_bytes`, 0 for a new object): a change that does not grow a meta is
        never refused, so an oversized meta (another client's, or one an older version let through) can
        always be shrunk or fixed. A tombstone is never refused by the limit: deleting always works."""
        data = data if data is not None else meta_json(doc)
        self.check_meta_payload(bucket, doc, data)
        size, limit = len(data), self.max_meta_bytes
        if limit and size > limit and size > replaced_bytes and not doc.get("deleted"):
            grows = f", and larger than the {replaced_bytes} bytes it replaces" if replaced_bytes else ""
            raise TooBig(f"the meta of {bucket}/{str(doc.get('name'))[:60]!r} would be {size} bytes, over "
                         f"--max-meta-bytes {limit}{grows}", log_level=logging.WARNING)

    async def _check_meta_size_replacing(self, bucket: str, doc: dict[str, Any], data: bytes,
                                         replaces: tuple[str, int | None]) -> None:
        """`check_meta_size` of a meta that replaces the one at (meta subject, revision): that meta's
        size is read (from the metas this store wrote itself, else from the server) only when the new
        one is over the limit, so the common case costs nothing."""
        if not self.max_meta_bytes or len(data) <= self.max_meta_bytes or doc.get("deleted"):
            self.check_meta_payload(bucket, doc, data)
            return
        self.check_meta_size(bucket, doc, data, replaced_bytes=await self._live_meta_bytes(bucket, *replaces))

    async def _live_meta_bytes(self, bucket: str, subject: str, revision: int | None) -> int:
        """The size of the live meta at `subject` (at `revision`, when given), 0 when there is none
        (nothing, a tombstone, another revision: the publish that expects it is refused anyway)."""
        if revision == 0:
            return 0
        own = self._own_metas.get(subject)
        data: bytes | bytearray
        if own is not None and (revision is None or own[0] == revision):
            data = own[1]
        else:
            msg = await self.streams.last_msg(stream_name(bucket), subject)
            if msg is None or (revision is not None and msg.seq != revision):
                return 0
            data = msg.data
        doc = meta_doc_of(data)
        return len(data) if doc is not None and not doc.get("deleted") else 0

    def _meta_subject(self, bucket: str, name: str) -> str:
        self.check_name(bucket, name)
        return meta_subject(bucket, name)

    # ---------------------------------------------------------------- whole versions
    async def previous_version(self, bucket: str, name: str, old_nuid: str, base: dict[str, Any] | None,
                               expected_revision: int | None) -> dict[str, Any] | None:
        """In a bucket whose stream may cut a version after its acks (`StreamLimits.may_evict`): the meta
        of the version a put replaces (`old_nuid` at `expected_revision`), kept to be stored again if the
        new one turns out cut (`prove_whole`): `base` when it is that meta, else read (its rollup removes
        it). None elsewhere, without a round trip."""
        if not old_nuid or not expected_revision or not self.limits(bucket).may_evict:
            return None
        if base is None or base.get("nuid") != old_nuid:
            try:
                got = await self._doc_at(bucket, name, expected_revision)
            except NatsFSError:
                return None
            if got is None or got[1] != expected_revision:
                return None
            base = got[0]
        # (A copy: the new meta is built from `base` and may change what it shares with it.)
        previous = meta_doc_of(meta_json(base))
        return previous if previous is not None and previous.get("nuid") == old_nuid else None

    async def prove_whole(self, bucket: str, name: str, nuid: str, chunks: int, revision: int,
                          previous: dict[str, Any] | None) -> bool:
        """After the meta of a put (stored at `revision`) in a bucket whose stream may drop its first chunks
        after they were acknowledged (`StreamLimits.may_evict`; anywhere else: True at once, no round
        trip): whether the stream still holds all `chunks` chunks of `nuid` (one STREAM.INFO counting the
        chunk subject's messages). True: whole, the version it replaced may be purged. False: not known
        (no answer within `PROVE_WHOLE_S`): the caller keeps the replaced version's chunks (one warning;
        `natsfs fsck` finds them). A cut version is taken back (`previous`, the replaced meta, is stored
        again expecting `revision`, or a new name gets a tombstone; its chunks left are purged) and
        `NotWhole` raised: the caller keeps the replaced version and reports the put as failed."""
        limits = self.limits(bucket)
        if not chunks or not limits.may_evict:
            return True
        subject = chunk_subject(bucket, nuid)
        kept, why = -1, "no answer"
        with trio.CancelScope(shield=True, deadline=trio.current_time() + PROVE_WHOLE_S):
            try:
                counts, _, _ = await self.streams.subject_counts(stream_name(bucket), subject)
                kept = counts.get(subject, 0)
            except NatsFSError as e:
                why = str(e)
        if kept < 0:
            log.warning("%s/%s: stored, but whether the stream (%s) still holds all of it is not known (%s); the "
                        "chunks of the version it replaced are kept (for fsck)", bucket, name, limits.describe(), why)
            return False
        if kept >= chunks:
            return True
        undone = "it could not be taken back in time; the version it replaced keeps its chunks"
        with trio.CancelScope(shield=True, deadline=trio.current_time() + PROVE_WHOLE_S):
            undone = await self._take_back(bucket, name, nuid, revision, previous)
        raise NotWhole(f"{bucket}/{name}: not stored whole: the stream dropped {chunks - kept} of its {chunks} "
                       f"chunks right after storing them ({limits.describe()}); {undone}")

    async def _take_back(self, bucket: str, name: str, nuid: str, revision: int,
                         previous: dict[str, Any] | None) -> str:
        """Undo a put stored at `revision` whose version the stream cut: what was done, for the log. The
        version it replaced (`previous`) is stored again when the stream still holds it whole; else (the
        stream drops the oldest messages first, so it usually went before the new one's) the name gets
        a tombstone: no client is left reading a version that cannot be whole."""
        try:
            if previous is not None and await self._holds_whole(bucket, previous):
                await self.publish_meta(bucket, previous, expected_revision=revision, timestamp=False)
                undone = "the version it replaced is the name's again"
            else:
                current = await self._doc_at(bucket, name, revision)
                if current is None or current[1] != revision:
                    raise Conflict("changed meanwhile")
                await self.publish_meta(bucket, tombstone_doc(bucket, name, current[0]), expected_revision=revision,
                                        timestamp=False)
                undone = ("the name is deleted (the stream had dropped the version it replaced too)"
                          if previous is not None else "the name is deleted again")
        except NatsFSError as e:
            return f"it could not be taken back ({e}); the version it replaced keeps its chunks"
        await self.purge_chunks_later_if_needed(bucket, nuid, name)
        return undone

    async def _holds_whole(self, bucket: str, doc: dict[str, Any]) -> bool:
        """Whether the stream holds every chunk the meta `doc` names (its chunk subject's message count)."""
        nuid, chunks = str(doc.get("nuid") or ""), doc.get("chunks")
        if not isinstance(chunks, int) or not chunks:
            return True
        if not usable_nuid(nuid):
            return False
        subject = chunk_subject(bucket, nuid)
        counts, _, _ = await self.streams.subject_counts(stream_name(bucket), subject)
        return counts.get(subject, 0) >= chunks

    # ---------------------------------------------------------------- buckets
    async def list_buckets(self) -> list[str]:
        """The buckets: streams `OBJ_<name>` that are object stores (see `not_an_object_store`). Whether a
        stream is one is read from its config the first time its name is listed (one STREAM.LIST for all
        new names), and again after the server announced its config updated, or when its status is read."""
        names = [n[len(STREAM_PREFIX):] for n in await self.streams.stream_names()
                 if n.startswith(STREAM_PREFIX) and valid_bucket_name(n[len(STREAM_PREFIX):])]
        for gone in set(self._shapes) - set(names):  # (one made again under that name is looked at anew)
            del self._shapes[gone]
            self._read_only.pop(gone, None)
        new = [b for b in names if b not in self._shapes]
        if new:
            try:
                for st in await self.streams.stream_infos():
                    if st.name.startswith(STREAM_PREFIX) and valid_bucket_name(st.name[len(STREAM_PREFIX):]):
                        bucket = st.name[len(STREAM_PREFIX):]
                        if not self._note_shape(bucket, st.config):
                            self.note_read_only(bucket, st.config)  # (known before its first lookup)
            except NotPermitted as e:
                log.debug("stream configs not listed (%s): each new stream OBJ_... is asked on its own", e)
                for b in new:
                    with contextlib.suppress(NotFound, NotPermitted):
                        self._note_shape(b, (await self.streams.stream_info(stream_name(b))).config)
        # (A stream the listing did not describe, gone meanwhile or without a leader, is listed as it
        # is named: its status, read when it is used, tells.)
        return sorted(b for b in names if not self._shapes.get(b))

    def _note_shape(self, bucket: str, config: dict[str, Any]) -> str:
        """Remember whether `bucket`'s stream is an object store (see `not_an_object_store`); a stream
        found not to be one is logged once (INFO), again only when the reason changes."""
        why = not_an_object_store(bucket, config)
        if why and self._shapes.get(bucket) != why:
            log.info("stream %s is not an object store (%s): not shown as a bucket", stream_name(bucket), why)
        self._shapes[bucket] = why
        return why

    async def account_limits(self) -> AccountLimits:
        """The account's JetStream limits and usage (what all buckets together may hold)."""
        return await self.streams.account_limits()

    async def bucket_status(self, bucket: str) -> BucketStatus:
        if not valid_bucket_name(bucket):
            raise NotFound(f"no bucket {bucket!r}")
        stale = bucket in self._stale
        self._stale.discard(bucket)  # (an update announced while this read is under way marks it again)
        try:
            st = await self.streams.stream_info(stream_name(bucket))
        except BaseException:
            if stale:
                self._stale.add(bucket)
            raise
        if why := self._note_shape(bucket, st.config):
            raise NotFound(f"no bucket {bucket!r}: its stream {stream_name(bucket)} is not an object store ({why})")
        self._atomic[bucket] = bool(st.config.get("allow_atomic"))
        self.note_created(bucket, st.created_ns)
        return self._noted(bucket, st)

    def note_created(self, bucket: str, created_ns: int) -> bool:
        """The bucket's stream was seen with creation time `created_ns`. True when that is another
        incarnation than the one seen before (deleted and created again: its sequences start over, so a
        revision read from the old stream names some other message of the new one); the metas this
        store remembers writing to the old one are then forgotten, never expected again."""
        if not created_ns:
            return False
        known = self._created_ns.get(bucket)
        self._created_ns[bucket] = created_ns
        if known is None or known == created_ns:
            return False
        prefix = meta_filter(bucket)[:-1]  # "$O.<bucket>.M."
        for subject in [s for s in self._own_metas if s.startswith(prefix)]:
            del self._own_metas[subject]
        return True

    async def follow_stream_updates(self) -> None:
        """For the mount's life: the buckets whose stream config the server announces updated (by any
        client) are marked, and their status is read again before their next put (`check_fits`), so
        limits another client sets are known at once, not only at the next periodic read. Where the
        advisories cannot be followed, the periodic reads are all there is (see `check_fits`)."""
        backoff = Backoff(1.0, 30.0)
        while True:
            try:
                updates = await self.streams.stream_updates()
            except NatsFSError as e:
                log.debug("stream config updates not followed (%s); trying again", e)
                await backoff.pause()
                continue
            try:
                while True:
                    for name in await updates.next():
                        if name.startswith(STREAM_PREFIX):
                            self._stale.add(name[len(STREAM_PREFIX):])
                            self._shapes.pop(name[len(STREAM_PREFIX):], None)  # (read at the next listing)
                            log.debug("bucket %s: its stream config was updated; read again before its next put",
                                      name[len(STREAM_PREFIX):])
                    backoff.reset()
            except NatsFSError as e:
                log.debug("stream config updates not followed (%s); trying again", e)
            finally:
                with trio.CancelScope(shield=True), contextlib.suppress(NatsFSError):
                    await updates.close()
            await backoff.pause()

    def _noted(self, bucket: str, st: StreamState) -> BucketStatus:
        """A bucket's status, remembering the limits of its stream that can cut a version short."""
        limits = StreamLimits.of(st.config)
        if limits != NO_LIMITS:
            self._limits[bucket] = limits
        else:
            self._limits.pop(bucket, None)
        self.note_read_only(bucket, st.config)
        return bucket_status(bucket, st)

    def note_read_only(self, bucket: str, config: dict[str, Any]) -> str:
        """Why `bucket` takes no writes as its stream's `config` shows ("": it does), remembered for
        `read_only_reason`."""
        why = refuses_writes(bucket, config)
        self._read_only[bucket] = why
        return why

    def read_only_reason(self, bucket: str) -> str:
        """Why `bucket` took no writes when its stream's config was last read ("": it did, or not read)."""
        return self._read_only.get(bucket, "")

    def known_read_only(self, bucket: str) -> bool | None:
        """Whether `bucket` took no writes when its stream's config was last read (None: never read)."""
        why = self._read_only.get(bucket)
        return None if why is None else bool(why)

    def limits(self, bucket: str) -> StreamLimits:
        """The stream limits of `bucket` as its last status gave them."""
        return self._limits.get(bucket, NO_LIMITS)

    async def check_fits(self, bucket: str, name: str, size: int, chunks: int) -> None:
        """`OverStreamLimits` when a version of `size` bytes in `chunks` chunks can never be held whole by
        the bucket's stream (see `StreamLimits.refusal`), before any of it is sent. Costs nothing for a
        bucket without such limits. Checked against the config of the bucket's last status: read again
        first when the server announced a config update of the stream since (`follow_stream_updates`),
        and before refusing; otherwise as fresh as the periodic read (at most `sealed_ttl` before an
        upload starts, see `Mutations.sealed`), which is all there is where the advisories cannot be
        followed (then a limit set within that time is not seen yet)."""
        fresh = False
        if bucket in self._stale:
            with contextlib.suppress(NatsFSError):
                await self.bucket_status(bucket)
                fresh = True
        limits = self._limits.get(bucket)
        if limits is None:
            return
        stored = size + chunks * len(chunk_subject(bucket, "x" * 22))
        if limits.refusal(chunks, stored) is None:
            return
        if not fresh:
            with contextlib.suppress(NatsFSError):
                await self.bucket_status(bucket)
        why = self.limits(bucket).refusal(chunks, stored)
        if why is not None:
            raise OverStreamLimits(f"{bucket}/{name}: a version of {size} bytes in {chunks} chunks "
                                   f"cannot be held whole by the bucket ({why})")

    async def create_bucket(self, bucket: str, *, description: str = "", storage: str = "file",
                            replicas: int = 1, compression: bool = False, max_bytes: int = -1,
                            ttl_ns: int = 0, metadata: dict[str, str] | None = None,
                            atomic: bool = True) -> BucketStatus:
        """Create a bucket with the stream config nats.go's CreateObjectStore uses, plus (`atomic`) the
        flag that lets puts of up to `ATOMIC_MAX_CHUNKS` chunks go as one atomic batch."""
        if not valid_bucket_name(bucket):
            raise InvalidArgument(f"invalid bucket name {bucket!r} (letters, digits, - and _ only)")
        if len(stream_name(bucket)) > MAX_STREAM_NAME:  # (a bucket name of up to 251 characters)
            raise NameTooLong(f"bucket name of {len(bucket)} characters: its stream {STREAM_PREFIX}<name> "
                              f"would be over JetStream's {MAX_STREAM_NAME}")
        config: dict[str, Any] = {
            "name": stream_name(bucket),
            "description": description or None,
            "subjects": [f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"],
            "retention": "limits",
            "max_consumers": -1,
            "max_msgs": -1,
            "max_bytes": max_bytes if max_bytes > 0 else -1,
            "max_age": ttl_ns,
            "max_msgs_per_subject": -1,
            "max_msg_size": -1,
            "storage": storage,
            "num_replicas": replicas,
            "discard": "new",
            "duplicate_window": 120 * 10**9,
            "allow_rollup_hdrs": True,
            "allow_direct": True,
            "compression": "s2" if compression else "none",
            # Servers before 2.12 ignore it.
            "allow_atomic": atomic,
        }
        if metadata:
            config["metadata"] = metadata
        config = {k: v for k, v in config.items() if v is not None}
        return self._noted(bucket, await self.streams.create_stream(config))

    async def delete_bucket(self, bucket: str) -> None:
        """Delete the bucket's stream; never a stream `OBJ_<bucket>` that is not an object store
        (`NotFound`, see `not_an_object_store`): another tool's stream of that name is not a bucket."""
        await self.bucket_status(bucket)
        await self.streams.delete_stream(stream_name(bucket))

    async def seal_bucket(self, bucket: str) -> BucketStatus:
        st = await self.streams.stream_info(stream_name(bucket))
        config = dict(st.config, sealed=True)
        return self._noted(bucket, await self.streams.update_stream(config))

    # ---------------------------------------------------------------- metas
    async def get_info(self, bucket: str, name: str) -> ObjectInfo | None:
        """The current meta of `name` (tombstones included), or None if the name was never used."""
        msg = await self.streams.last_msg(stream_name(bucket), self._meta_subject(bucket, name))
        if msg is None:
            return None
        return parse_meta(bucket, msg)

    async def wildcard_rewrite_of(self, bucket: str, base: ObjectInfo, subject: str = "") -> ObjectInfo | None:
        """The live meta now on `base`'s subject (or `subject`: an alias) when it is `base`, a live meta or
        a link whose nuid was a wildcard, rewritten since on a fresh nuid with every other field kept
        (`defuse_wildcard_nuid`, `defuse_wildcard_alias`: any mount's, `natsfs fsck --repair`'s): the same
        `fields_but_nuid`. None for anything else (another client's change, a tombstone, nothing)."""
        if not base.wildcard_nuid or not base.wildcard_fields or base.deleted:
            return None
        msg = await self.streams.last_msg(stream_name(bucket), subject or self._meta_subject(bucket, base.name))
        if msg is None or msg.seq <= base.revision:
            return None
        try:
            now = parse_meta(bucket, msg)
            doc = load_meta(msg.data)[0]
        except (MalformedMeta, MetaNotJSON):
            return None
        if now.deleted or now.wildcard_nuid or not now.nuid or fields_but_nuid(doc) != base.wildcard_fields:
            return None
        return now

    async def get_meta_doc(self, bucket: str, name: str, subject: str | None = None
                           ) -> tuple[dict[str, Any], int] | None:
        """The raw meta JSON of `name` and its revision, for rewrites that must keep every field; from
        `subject` instead of the name's canonical one when given (an alias: see `natsfs.index`)."""
        msg = await self.streams.last_msg(stream_name(bucket), subject or self._meta_subject(bucket, name))
        if msg is None:
            return None
        try:
            doc = load_meta(msg.data)[0]
        except MetaNotJSON as e:
            raise MalformedMeta(f"meta of {name!r} in {bucket} {e}") from None
        # (As nats.go reads it, each field under its canonical key: a rewrite stores no case variants.)
        # A field of the wrong type (metadata that is a list, ...) is absent for every rewrite.
        return usable_fields(doc), msg.seq

    async def meta_msg_id(self, bucket: str, name: str) -> str | None:
        """The `Nats-Msg-Id` the current meta of `name` was published with ("" without one; None: the
        name was never used). A write-back replay tells by it whether a tombstone or a rename's meta
        there is the one the run that died published for a call it did not finish (see
        `WriteBack.settle_moves`)."""
        msg = await self.streams.last_msg(stream_name(bucket), self._meta_subject(bucket, name))
        if msg is None:
            return None
        return (msg.headers or {}).get(MSG_ID, "")

    async def watch_metas(self, bucket: str):  # -> Watch
        return await self.streams.watch(stream_name(bucket), meta_filter(bucket), last_per_subject=True)

    async def live_objects(self, bucket: str) -> dict[str, ObjectInfo]:
        """Every live object of a bucket (one pass of a last-per-subject watch)."""
        watch = await self.watch_metas(bucket)
        live: dict[str, ObjectInfo] = {}
        try:
            while True:
                batch = await watch.next_batch(timeout=5.0)
                for m in batch.msgs:
                    try:
                        info = parse_meta(bucket, m)
                    except MalformedMeta:
                        continue
                    if info.deleted:
                        live.pop(info.name, None)
                    else:
                        live[info.name] = info
                if batch.caught_up:
                    return live
        finally:
            await watch.close()

    async def live_object_count(self, bucket: str) -> int:
        """How many objects deleting the bucket would destroy: every meta subject whose last message is not
        a delete marker, also one this mount skips (see `parse_meta`) that other clients still list (nats.go
        lists a meta whose nuid names no subject, or one under another name's subject). Counting only the
        objects this mount shows had `rmdir` of a bucket that looked empty delete such objects."""
        watch = await self.watch_metas(bucket)
        live: dict[str, bool] = {}  # by subject: the watch may deliver older metas of a subject first
        try:
            while True:
                batch = await watch.next_batch(timeout=5.0)
                if batch.reset:
                    live.clear()
                live.update((m.subject, not _delete_marker(m.data)) for m in batch.msgs)
                if batch.caught_up:
                    return sum(live.values())
        finally:
            await watch.close()

    # ---------------------------------------------------------------- chunks
    async def fetch_chunks(self, bucket: str, nuid: str, start_seq: int, count: int,
                           max_bytes: int) -> list[StoredMsg]:
        """Up to `count` chunks of object `nuid`, starting at stream sequence `start_seq`."""
        return await self.streams.get_batch(stream_name(bucket), chunk_subject(bucket, nuid), start_seq,
                                            count, max_bytes)

    async def stream_chunks(self, bucket: str, nuid: str, start_seq: int, count: int, max_bytes: int) -> MsgBatches:
        """Like `fetch_chunks`, handing chunks over as they arrive."""
        return await self.streams.stream_batch(stream_name(bucket), chunk_subject(bucket, nuid), start_seq, count,
                                               max_bytes)

    async def chunk_index(self, bucket: str, nuid: str) -> list[tuple[int, int]]:
        """(sequence, size) of every chunk of object `nuid`, in order, without their data."""
        return await self.streams.subject_index(stream_name(bucket), chunk_subject(bucket, nuid))

    async def stored_sequences(self, bucket: str, start_seq: int, stop_seq: int) -> list[int]:
        """The sequences in [start_seq, stop_seq) of the bucket's stream that hold a message."""
        return await self.streams.sequences(stream_name(bucket), start_seq, stop_seq)


    # ---------------------------------------------------------------- writes
    async def publish_meta(self, bucket: str, doc: dict[str, Any], *, expected_revision: int | None = None,
                           msg_id: str = "", timestamp: bool = True, after: ChunkMsg | None = None,
                           replaces: tuple[str, int | None] | None = None, subject: str = "") -> ObjectInfo:
        """Publish a meta with `Nats-Rollup: sub` and `Nats-Msg-Id` (`msg_id`, or a fresh one), on its
        name's meta subject (or `subject`: an alias rewritten in place); with
        `expected_revision`, only if the name's meta subject still ends at that sequence (0: never
        written), else `Conflict`. An ambiguous outcome is settled (see `_publish_settled`). With
        `after`, the version's one chunk goes in the same round trip, right before it (`_publish_after`).
        Its size is checked first (`check_meta_size`) against the meta it replaces: `replaces` (meta
        subject, revision: a rename's old name), by default what its own subject holds at
        `expected_revision`."""
        subject = subject or self._meta_subject(bucket, doc["name"])
        asked, doc = doc, without_wildcard_nuid(doc)
        data = meta_json(doc)
        # (A fresh nuid in place of a wildcard grows the meta by a few bytes: --max-meta-bytes judges the
        # change as asked, or the rewrite of a meta just under the limit would be refused at every pass.)
        await self._check_meta_size_replacing(bucket, asked, data if asked is doc else meta_json(asked),
                                              replaces or (subject, expected_revision))
        if asked is not doc:
            self.check_meta_payload(bucket, doc, data)
        headers = {ROLLUP: "sub", MSG_ID: msg_id or new_nuid()}
        if expected_revision is not None:
            headers[EXPECTED_LAST_SUBJECT_SEQ] = str(expected_revision)
        stored = await self._publish_settled(bucket, subject, data, headers, expected_revision, timestamp=timestamp,
                                             after=after)
        try:
            return parse_meta(bucket, stored)
        except MalformedMeta as e:  # (only a rewrite of another client's meta, fields kept, stores one)
            raise StoredButSkipped(str(e)) from None

    async def _publish_settled(self, bucket: str, subject: str, data: bytes, headers: dict[str, str],
                               expected_revision: int | None, *, timestamp: bool = True,
                               after: ChunkMsg | None = None) -> StoredMsg:
        stored = await self._publish_settled_once(bucket, subject, data, headers, expected_revision,
                                                  timestamp=timestamp, after=after)
        self._remember_meta(subject, stored.seq, data)
        return stored

    def _remember_meta(self, subject: str, revision: int, data: bytes) -> None:
        self._own_metas[subject] = (revision, data)
        self._own_metas.move_to_end(subject)
        if len(self._own_metas) > OWN_METAS_KEPT:
            self._own_metas.popitem(last=False)

    def _own_tombstone(self, bucket: str, name: str) -> int:
        """The revision of the tombstone this store last wrote for `name` (0: none remembered): where a
        new object replaces a deleted one (rm, then create), the put expects it at once."""
        own = self._own_metas.get(meta_subject(bucket, name))
        if own is None:
            return 0
        doc = meta_doc_of(own[1])
        return own[0] if doc is not None and doc.get("deleted") else 0

    async def _free_or_deleted_at(self, bucket: str, name: str, tried: int | None) -> int | None:
        """After a publish of a new object at `name` (one that may replace a deleted object) was refused
        on its expected sequence `tried`: read the name's meta subject back. The sequence to expect
        instead when the subject holds a tombstone (its revision) or nothing (0: purged by another
        client, perhaps the tombstone this store remembers writing), or None when a retry would not
        help (a live meta is there, or that is what was tried already)."""
        subject = self._meta_subject(bucket, name)
        current = await self.get_info(bucket, name)
        if current is not None and not current.deleted:
            return None
        revision = current.revision if current is not None else 0
        own = self._own_metas.get(subject)
        if own is not None and own[0] != revision:
            del self._own_metas[subject]  # gone from the server (purged): never expected again
        return None if revision == tried else revision

    async def _doc_at(self, bucket: str, name: str, expected_revision: int | None
                      ) -> tuple[dict[str, Any], int] | None:
        """`get_meta_doc`, or without a round trip the meta this store stored itself at exactly
        `expected_revision` (the server checks that revision again when the rewrite is published)."""
        if expected_revision:
            own = self._own_metas.get(meta_subject(bucket, name))
            if own is not None and own[0] == expected_revision:
                doc = meta_doc_of(own[1])
                if doc is not None:
                    return usable_fields(doc), own[0]
        return await self.get_meta_doc(bucket, name)

    async def _publish_settled_once(self, bucket: str, subject: str, data: bytes, headers: dict[str, str],
                                    expected_revision: int | None, *, timestamp: bool = True,
                                    after: ChunkMsg | None = None) -> StoredMsg:
        """Publish a meta and know whether it was stored.

        No ack (`Unavailable`, `OutcomeUnknown`): the name's meta is read back; our document there is
        success, anything else means "not stored" and the same message (same id) is sent again, until
        `settle_timeout` passes (`OutcomeUnknown`). A `Conflict` after such an attempt is settled the
        same way: the message in the way may be our own earlier attempt. With `after` (the version's
        one chunk), the first attempt is `_publish_after`; the meta is only ever sent again once the
        chunk is acknowledged."""
        deadline = trio.current_time() + self.settle_timeout
        backoff = Backoff(timeout=self.settle_timeout)
        ambiguous: NatsFSError | None = None
        chunk = after
        while True:
            try:
                if after is not None:
                    after = None
                    assert chunk is not None
                    seq = await self._publish_after(chunk, subject, data, headers)
                else:
                    seq = await self.streams.publish(subject, data, headers)
            except WrongLastMsgId:
                continue  # not stored, and its chunk is acknowledged: the plain publish follows
            except _ChunkUnsettled as e:
                # Neither ack came. The chunk is sent again (same id: stored once) before anything else;
                # if that fails too, its error goes up with the meta's outcome unknown.
                assert chunk is not None
                self._refuse_unsendable(bucket, subject, e)
                await self.streams.publish_many([chunk], 1)
                ambiguous = e
                mine = await self._read_back(bucket, subject, data, expected_revision, deadline, e)
                if mine is not None:
                    return mine
                continue
            except Conflict:
                if ambiguous is None:
                    raise
                mine = await self._read_back(bucket, subject, data, expected_revision, deadline, ambiguous)
                if mine is None:
                    raise
                return mine
            except Unavailable as e:
                self._refuse_unsendable(bucket, subject, e)
                log.debug("%s: the meta publish got no answer (%s); reading it back", subject, e)
                ambiguous = e
                mine = await self._read_back(bucket, subject, data, expected_revision, deadline, e)
                if mine is not None:
                    return mine
                if backoff.expired:
                    raise OutcomeUnknown(f"{subject}: the meta publish got no answer ({e}) and was not stored "
                                         f"within {self.settle_timeout:g}s") from None
                await backoff.pause()
                continue
            if not timestamp:
                return StoredMsg(seq, subject, headers, data, time.time_ns())
            try:
                stored = await self.streams.last_msg(stream_name(bucket), subject)
            except NatsFSError:
                stored = None  # stored for sure (acknowledged); only the server's timestamp is unknown
            if stored is not None and stored.seq == seq:
                return stored
            return StoredMsg(seq, subject, headers, data, time.time_ns())

    def _refuse_unsendable(self, bucket: str, subject: str, cause: NatsFSError) -> None:
        """After a meta publish on `subject` got no answer: where the connection was lost meanwhile for a
        control line over the server's `max_control_line` (see `Bridge.subject_limit`), a subject over
        what the server takes was that line, or as long: never processed, so not stored (`NameTooLong`);
        sent again, or read back by a direct get on a longer subject, it would only drop the connection
        again, every 2 s until `settle_timeout`. A publish that fits but whose read-back would not is
        `OutcomeUnknown` at once."""
        limit = self.subject_limit
        if len(subject) > limit:
            raise NameTooLong(f"{subject[:60]}...: not stored: the server takes no subject over {limit} bytes "
                              f"(its max_control_line) and dropped the connection ({cause})")
        if len(f"$JS.API.DIRECT.GET.{stream_name(bucket)}.{subject}") > limit:
            raise OutcomeUnknown(f"{subject[:60]}...: the meta publish got no answer ({cause}), and the server "
                                 f"takes no subject as long as its read-back (over {limit} bytes): it may or "
                                 f"may not be stored")

    async def _publish_after(self, chunk: ChunkMsg, subject: str, data: bytes, headers: dict[str, str]) -> int:
        """A one-chunk put's meta sent right behind its chunk, both in flight at once: one round trip, as
        nats.go sends a put's meta without waiting for its chunks' acks. Unlike nats.go's, the meta
        expects the chunk to be the stream's last message (`Nats-Expected-Last-Msg-Id`: the chunk's id,
        fresh with its nuid), so the server stores it only right after the chunk: never a meta without
        its chunk, whatever happens to the chunk. Returns the meta's sequence (stored: so is the chunk);
        raises the chunk's refusal (then the meta is not stored either), `WrongLastMsgId` (another
        message came between them; the chunk is acknowledged), `_ChunkUnsettled` (neither ack came),
        or the meta's own error (the chunk is acknowledged)."""
        expecting = dict(headers)
        expecting[EXPECTED_LAST_MSG_ID] = chunk[2][MSG_ID]
        try:
            chunk_outcome, meta_outcome = await self.streams.publish_each([chunk, (subject, data, expecting)])
        except NatsFSError as e:  # (no connection to send on: nothing is known of either)
            raise _ChunkUnsettled(f"{chunk[0]}: not sent ({e})") from None
        if isinstance(meta_outcome, int):
            return meta_outcome
        if isinstance(chunk_outcome, Unavailable | NotFound):
            raise _ChunkUnsettled(f"{chunk[0]}: no ack ({chunk_outcome})")
        if isinstance(chunk_outcome, NatsFSError):
            raise chunk_outcome
        raise meta_outcome

    async def _read_back(self, bucket: str, subject: str, data: bytes, expected_revision: int | None,
                         deadline: float, cause: NatsFSError) -> StoredMsg | None:
        """The stored message if the name's meta is exactly `data` (written after `expected_revision`),
        None if it is something else; `OutcomeUnknown` if the server does not answer before `deadline`."""
        backoff = Backoff(timeout=max(0.0, deadline - trio.current_time()))
        while True:
            try:
                await self.earlier_publishes_processed(bucket)
                msg = await self.streams.last_msg(stream_name(bucket), subject)
            except Unavailable as e:
                if backoff.expired:
                    raise OutcomeUnknown(f"{subject}: the meta publish got no answer ({cause}) and could not be "
                                         f"read back ({e}): it may or may not be stored") from None
                await backoff.pause()
                continue
            if msg is not None and msg.data == data and (expected_revision is None or msg.seq > expected_revision):
                return msg
            return None

    async def earlier_publishes_processed(self, bucket: str) -> None:
        """Return once the server has processed (stored or refused) every publish sent on this store's
        connection to `bucket`'s stream before the call: only then can a read say that such a publish
        whose answer never came was not stored. `Unavailable` (or `NotFound`) when the server does not
        answer: then a publish sent earlier may still be stored later.

        The barrier is a publish the server refuses in the same place and order in which it stores
        publishes (the stream's inbound queue, `processJetStreamMsg`; verified on nats-server 2.15):
        `Nats-Expected-Stream` names a stream that cannot exist. Its refusal ("expected stream does not
        match", 10060) comes after every earlier publish of the connection to that stream was handled.
        It goes to a fresh chunk subject, so that even a server that ignored the header would only leave
        an empty orphan message, which is purged."""
        subject = chunk_subject(bucket, new_nuid())
        try:
            await self.streams.publish(subject, b"", {EXPECTED_STREAM: _NO_SUCH_STREAM})
        except JetStreamAPIError as e:
            if e.err_code == ERR_STREAM_MISMATCH:
                return
            raise
        except ReadOnly:
            return  # sealed: refused in the same place (and nothing sent earlier can be stored any more)
        # Stored (a server without the header): still processed in order, so the barrier holds.
        log.warning("bucket %s: the server stored a publish expecting stream %r; removing it", bucket,
                    _NO_SUCH_STREAM)
        await self.streams.purge_subject(stream_name(bucket), subject)

    def start_put(self, bucket: str, chunk_size: int | None = None, window: int = 64, name: str = "") -> PutSession:
        """Begin a put (of `name`, if known yet) whose chunks can be sent as they become available."""
        return PutSession(self, bucket, chunk_size or self.chunk_size, window, name)

    async def put(self, bucket: str, name: str, source: ChunkSource, *, base: dict[str, Any] | None = None,
                  expected_revision: int | None = None, old_nuid: str = "", chunk_size: int | None = None,
                  window: int = 64, extra: Callable[[dict[str, Any]], None] | None = None,
                  replace_tombstone: bool = False, timestamp: bool = True) -> ObjectInfo:
        """Store an object the way nats.go's Put does: chunks on a fresh nuid (pipelined, at most
        `window` acks outstanding), then the meta (rollup; optimistic concurrency when
        `expected_revision` is given), then purge of the old nuid's chunks. If anything fails before
        the meta is stored, the new chunks are purged and the previous version stays intact.
        With `replace_tombstone`, a new name (expected revision 0) may replace a deleted object."""
        self.check_name(bucket, name)
        chunk_size = chunk_size or self.chunk_size
        commit: dict[str, Any] = dict(base=base, expected_revision=expected_revision, old_nuid=old_nuid,
                                      extra=extra, replace_tombstone=replace_tombstone, timestamp=timestamp)
        head: list[bytes] = []
        if self.batch_fits(bucket, 1, chunk_size):
            # Read up to one batch ahead: a source that ends within it is put atomically.
            while len(head) <= ATOMIC_MAX_CHUNKS and (more := await source.read_batch(
                    chunk_size, ATOMIC_MAX_CHUNKS + 1 - len(head))):
                head += more
            if 0 < len(head) <= ATOMIC_MAX_CHUNKS:
                read = head
                await self.check_fits(bucket, name, sum(len(c) for c in head), len(head))

                async def replay(hasher: Any) -> AsyncIterator[bytes]:
                    for chunk in read:
                        hasher.update(chunk)
                        yield chunk

                return await self._put_batch(bucket, name, replay, chunk_size, window, **commit)
        session = self.start_put(bucket, chunk_size, window, name)
        try:
            await session.send(head)
            await self._send_all(session, source, window)
            return await session.commit(name, source.digest(), **commit)
        except BaseException:
            with trio.CancelScope(shield=True):
                await session.abort()
            raise

    async def put_file(self, bucket: str, name: str, path: str, fd: int, size: int, **kwargs: Any) -> ObjectInfo:
        """`put` of the first `size` bytes of a local file (a spool file): one atomic batch when the
        bucket allows it and the object fits, else by the upload worker if any."""
        self.check_name(bucket, name)
        chunk_size = kwargs.pop("chunk_size", None) or self.chunk_size
        window = kwargs.pop("window", 64)
        await self.check_fits(bucket, name, size, -(-size // chunk_size))
        if size <= min(chunk_size, SMALL_PUT_MAX):
            return await self._put_small(bucket, name, fd, size, chunk_size, **kwargs)
        if self.batch_fits(bucket, size, chunk_size):

            def file_chunks(hasher: Any) -> AsyncIterator[bytes]:
                return _file_chunks(fd, size, chunk_size, hasher)

            return await self._put_batch(bucket, name, file_chunks, chunk_size, window, **kwargs)
        session = self.start_put(bucket, chunk_size, window, name)
        try:
            try:
                await session.send_file(path, fd, 0, size)
                digest = await session.digest()
            except Unavailable as e:
                if not session.remote:
                    raise
                # The worker lost its server, or the stream its leader, or it died (it is restarted for
                # later puts): send from here, where unanswered publishes are sent again while a cluster
                # elects a new leader (publish_many).
                log.info("%s/%s: the upload worker could not send it (%s); sending it in-process", bucket, name, e)
                await session.abort()
                session = self.start_put(bucket, chunk_size, window, name)
                session.remote = False
                await session.send_file(path, fd, 0, size)
                digest = await session.digest()
            return await session.commit(name, digest, **kwargs)
        except BaseException:
            with trio.CancelScope(shield=True):
                await session.abort()
            raise

    async def _put_small(self, bucket: str, name: str, fd: int, size: int, chunk_size: int, **commit: Any
                         ) -> ObjectInfo:
        """A put of at most one chunk from a local file, in-process: the chunk (recorded in the put
        journal first), then the meta once the chunk is acknowledged (see the module docstring)."""
        data = os.pread(fd, size, 0) if size else b""  # small: read and hashed here, no worker thread
        if len(data) < size:  # a hole at the end of a sparse file reads short: zeros
            data += bytes(size - len(data))
        session = self.start_put(bucket, chunk_size, 1, name)
        session.remote = False
        session.hasher.update(data)
        try:
            if data:
                return await session.send_and_commit(data, name, session.hasher.digest(), **commit)
            return await session.commit(name, session.hasher.digest(), **commit)
        except BaseException:
            with trio.CancelScope(shield=True):
                await session.abort()
            raise

    # ---------------------------------------------------------------- atomic puts
    def batch_fits(self, bucket: str, size: int, chunk_size: int | None = None) -> bool:
        """Whether a put of `size` bytes into `bucket` goes as one atomic batch: the bucket is known to
        allow atomic publish (`allow_atomic`, seen in its status) and the chunks and meta fit one batch."""
        chunks = -(-size // (chunk_size or self.chunk_size))
        return self._atomic.get(bucket, False) and chunks <= ATOMIC_MAX_CHUNKS

    async def _put_batch(self, bucket: str, name: str, chunks_of: Callable[[Any], AsyncIterator[bytes]],
                         chunk_size: int, window: int, *, base: dict[str, Any] | None = None,
                         expected_revision: int | None = None, old_nuid: str = "",
                         extra: Callable[[dict[str, Any]], None] | None = None,
                         replace_tombstone: bool = False, timestamp: bool = True) -> ObjectInfo:
        """A put as one atomic batch: chunks `<nuid>.<i>` and the meta (rollup, expected revision) are
        stored together at the commit or not at all, so no crash leaves a partial version or orphan
        chunks, and no put journal record is needed. `chunks_of(hasher)` yields the chunks (fed to the
        hasher) and is called again for each attempt.

        - A tombstone in the way of a new name: the batch is sent again on the tombstone's revision.
        - A commit without an ack (`OutcomeUnknown`): the name's meta is read back; ours is success;
          anything else and the same batch (same message ids, new batch id) is sent again until
          `settle_timeout`. A batch stored meanwhile makes the server refuse the resend as a duplicate
          (`ERR_BATCH_DUPLICATE_ID`), which is read back too: a batch is never stored twice.
        - A batch the server does not take as such (atomic publish turned off, too many batches in
          flight): the ordinary put, unless an earlier attempt's outcome is still unknown."""
        meta_subj = self._meta_subject(bucket, name)
        expected = expected_revision
        if replace_tombstone and expected == 0:
            expected = self._own_tombstone(bucket, name)
        nuid = new_nuid()
        subject = chunk_subject(bucket, nuid)
        ambiguous: NatsFSError | None = None
        deadline = 0.0
        backoff = Backoff()  # given the settle timeout once an attempt's outcome is unknown
        attempt = 0
        sent: dict[str, bytes] = {}
        previous = await self.previous_version(bucket, name, old_nuid, base, expected_revision)
        noted = self.note_replacing(bucket, old_nuid, nuid, name)
        try:
            while True:
                attempt += 1

                async def messages(expected: int | None = expected) -> AsyncIterator[tuple[str, bytes, dict[str, str]]]:
                    # (A fresh hasher each time: the streams may ask for the messages again, see publish_batch.)
                    hasher = hashlib.sha256()
                    size = count = 0
                    async for chunk in chunks_of(hasher):
                        yield subject, chunk, {MSG_ID: f"{nuid}.{count}"}
                        size += len(chunk)
                        count += 1
                    doc = meta_doc(name=name, bucket=bucket, nuid=nuid, size=size, chunks=count,
                                   digest=format_digest(hasher.digest()), base=base, chunk_size=chunk_size)
                    if extra is not None:
                        extra(doc)
                    data = meta_json(doc)
                    await self._check_meta_size_replacing(bucket, doc, data, (meta_subj, expected))
                    headers = {ROLLUP: "sub", MSG_ID: f"{nuid}.meta"}
                    if expected is not None:
                        headers[EXPECTED_LAST_SUBJECT_SEQ] = str(expected)
                    sent["meta"] = data
                    yield meta_subj, data, headers

                try:
                    seq = await self.streams.publish_batch(f"{nuid}.{attempt}", messages)
                    break
                except OutcomeUnknown as e:
                    if ambiguous is None:
                        ambiguous, deadline = e, trio.current_time() + self.settle_timeout
                        backoff = Backoff(timeout=self.settle_timeout)
                    mine = await self._read_back(bucket, meta_subj, sent["meta"], expected, deadline, e)
                    if mine is not None:
                        seq = mine.seq
                        break
                except Conflict:
                    if ambiguous is not None:
                        mine = await self._read_back(bucket, meta_subj, sent["meta"], expected, deadline,
                                                     ambiguous)
                        if mine is not None:
                            seq = mine.seq
                            break
                        raise
                    if not (replace_tombstone and expected_revision == 0 and attempt == 1):
                        raise
                    retry_on = await self._free_or_deleted_at(bucket, name, expected)
                    if retry_on is None:
                        raise
                    expected = retry_on
                    continue
                except JetStreamAPIError as e:
                    if ambiguous is not None:
                        mine = await self._read_back(bucket, meta_subj, sent["meta"], expected, deadline,
                                                     ambiguous)
                        if mine is not None:
                            seq = mine.seq
                            break
                        if e.err_code == ERR_BATCH_DUPLICATE_ID:
                            raise Conflict(f"{bucket}/{name}: stored, then changed by another client") from None
                        raise
                    if e.err_code == ERR_ATOMIC_DISABLED:
                        self._atomic[bucket] = False
                    log.info("%s/%s: the server did not take the put as one batch (%s); putting it in order",
                             bucket, name, e.description)
                    sent.clear()  # that batch was refused: nothing of it can be stored
                    return await self._put_in_order(bucket, name, chunks_of, chunk_size, window, base=base,
                                                    expected_revision=expected_revision, old_nuid=old_nuid, extra=extra,
                                                    replace_tombstone=replace_tombstone, timestamp=timestamp)
                except Unavailable:
                    if ambiguous is None:
                        raise  # cut off before the commit: nothing of this put is stored
                if backoff.expired:
                    raise OutcomeUnknown(f"{bucket}/{name}: the put's commit got no answer ({ambiguous}) and was "
                                         f"not stored within {self.settle_timeout:g}s")
                await backoff.pause()
        except BaseException as e:
            if "meta" in sent and (isinstance(e, OutcomeUnknown) or not isinstance(e, NatsFSError)):
                # The commit may have been sent and stored (no answer, or cancelled by the caller's deadline).
                self._journal_unknown(bucket, nuid, name)
            with trio.CancelScope(shield=True):
                await self.end_replacing(bucket, old_nuid, name, noted, stored=False)
            raise
        stored_msg = (await self._stored_meta(bucket, meta_subj, seq, sent["meta"]) if timestamp
                      else StoredMsg(seq, meta_subj, None, sent["meta"], time.time_ns()))
        self._remember_meta(meta_subj, seq, sent["meta"])
        info = parse_meta(bucket, stored_msg)
        try:
            whole = await self.prove_whole(bucket, name, nuid, info.chunks, seq, previous)
        except NotWhole:
            with trio.CancelScope(shield=True):
                await self.end_replacing(bucket, old_nuid, name, noted, stored=False)
            raise
        if old_nuid and old_nuid != nuid:
            await self.end_replacing(bucket, old_nuid, name, noted, stored=whole)
        return info

    def _journal_unknown(self, bucket: str, nuid: str, name: str) -> None:
        """A batch whose commit may have been stored: the `PutLog` settles it like an unfinished put
        (kept if the name holds it, else its chunk subject is purged: empty, as nothing was stored)."""
        if self.put_log is not None:
            self.put_log.started(bucket, nuid, name)
            self.put_log.failed(bucket, nuid, name, meta_unknown=True, purged=False)

    async def _stored_meta(self, bucket: str, meta_subj: str, seq: int, data: bytes) -> StoredMsg:
        """The meta just stored at `seq`, with the server's timestamp when it can be read."""
        try:
            stored = await self.streams.last_msg(stream_name(bucket), meta_subj)
        except NatsFSError:
            stored = None
        if stored is not None and stored.seq == seq:
            return stored
        return StoredMsg(seq, meta_subj, None, data, time.time_ns())

    async def _put_in_order(self, bucket: str, name: str, chunks_of: Callable[[Any], AsyncIterator[bytes]],
                            chunk_size: int, window: int, **commit: Any) -> ObjectInfo:
        """The ordinary put (chunks, then meta) of what `chunks_of` yields."""
        session = self.start_put(bucket, chunk_size, window, name)
        hasher = hashlib.sha256()
        try:
            group: list[bytes] = []
            async for chunk in chunks_of(hasher):
                group.append(chunk)
                if len(group) >= max(1, window // 2):
                    await session.send(group)
                    group = []
            await session.send(group)
            return await session.commit(name, hasher.digest(), **commit)
        except BaseException:
            with trio.CancelScope(shield=True):
                await session.abort()
            raise

    async def _send_all(self, session: PutSession, source: ChunkSource, window: int) -> None:
        """Read the next batch while the previous one is being published."""
        with single_errors():
            async with trio.open_nursery() as nursery:
                send, receive = trio.open_memory_channel[list[bytes]](2)

                async def produce() -> None:
                    async with send:
                        while batch := await source.read_batch(session.chunk_size, max(1, window // 2)):
                            await send.send(batch)

                nursery.start_soon(produce)
                async with receive:
                    async for batch in receive:
                        await session.send(batch)

    async def publish_replacing(self, bucket: str, doc: dict[str, Any], expected_revision: int | None,
                                replace_tombstone: bool, msg_id: str = "", *, timestamp: bool = True,
                                after: ChunkMsg | None = None,
                                replaces: tuple[str, int | None] | None = None) -> ObjectInfo:
        """`publish_meta`; with `replace_tombstone`, a name whose current meta is a tombstone (a deleted
        object) counts as free (`expected_revision` 0) and is replaced at the tombstone's revision
        (expected at once when this store wrote that tombstone itself, else read back after a refusal)."""
        msg_id = msg_id or new_nuid()
        own_tombstone = self._own_tombstone(bucket, doc["name"]) if replace_tombstone and expected_revision == 0 else 0
        try:
            return await self.publish_meta(bucket, doc, expected_revision=own_tombstone or expected_revision,
                                           msg_id=msg_id, timestamp=timestamp, after=after, replaces=replaces)
        except Conflict:
            if not (replace_tombstone and expected_revision == 0):
                raise
            retry_on = await self._free_or_deleted_at(bucket, doc["name"], own_tombstone or expected_revision)
            if retry_on is None:
                raise
            return await self.publish_meta(bucket, doc, expected_revision=retry_on, msg_id=msg_id,
                                           timestamp=timestamp, replaces=replaces)

    async def delete(self, bucket: str, name: str, *, expected_revision: int | None = None,
                     expected_nuid: str = "", purge_chunks: bool = True, shared: bool = False,
                     msg_id: str = "") -> ObjectInfo | None:
        """ADR-20 delete: a tombstone meta (rollup), then purge of the object's chunks. When another live
        name `shared` the nuid (a rename interrupted between its steps), no tombstone may carry it (other
        clients purge the nuid they find under a deleted name): the tombstone gets a fresh nuid instead
        (`claim_doc`) and no chunk is purged. Either tombstone expects the revision read, so of the
        writes that expect it (this delete, another client's, a rename's claim of the name) exactly one
        is stored (`Conflict` for the others). `msg_id`: the tombstone's `Nats-Msg-Id` (see `meta_msg_id`)."""
        current = await self._doc_at(bucket, name, expected_revision)
        if current is None:
            raise NotFound(f"{bucket}/{name}")
        doc, revision = current
        if doc.get("deleted"):
            raise NotFound(f"{bucket}/{name} is already deleted")
        if expected_revision is not None and revision != expected_revision:
            raise Conflict(f"{bucket}/{name} changed since it was read")
        check_same_object(bucket, name, doc, expected_nuid)
        nuid = str(doc.get("nuid") or "")
        if shared and nuid:
            return await self.publish_meta(bucket, claim_doc(bucket, name, doc), expected_revision=revision,
                                           msg_id=msg_id, timestamp=False)
        options = doc.get("options")
        is_link = isinstance(options, dict) and isinstance(options.get("link"), dict)
        # (An empty object has no chunks, and a link none of its own: deleting it leaves its target and
        # anything its nuid may claim alone.)
        chunked = bool(nuid and not is_link and (doc.get("chunks") or doc.get("size")))
        # Recorded first, as a put that replaces a version is (`note_replacing`): a daemon killed between
        # the tombstone and the purge (this one, or the caller's later one without `purge_chunks`:
        # `purge_deleted`) leaves the chunks to the next mount, which purges them unless a live name
        # still holds them (they were left as orphans for `natsfs fsck --repair`).
        noted = self.note_replacing(bucket, nuid, "", name) if chunked else False
        try:
            # (A tombstone's time is shown nowhere: not read back.)
            info = await self.publish_meta(bucket, tombstone_doc(bucket, name, doc), expected_revision=revision,
                                           msg_id=msg_id, timestamp=False)
        except BaseException as e:
            if noted:
                assert self.put_log is not None
                if isinstance(e, (Conflict, NotFound)):
                    self.put_log.finished(bucket, nuid)  # (not stored: the chunks are the name's still)
                else:  # (settled later: purged if the tombstone turns out stored)
                    self.put_log.failed(bucket, nuid, name, meta_unknown=True, purged=False)
            raise
        if testpoints.ACTIVE:
            await testpoints.pause("delete.before_purge")
        if chunked and purge_chunks:
            await self.end_replacing(bucket, nuid, name, noted, stored=True)
        return info

    async def purge_deleted(self, bucket: str, nuid: str) -> None:
        """The purge a `delete` without `purge_chunks` left to its caller (the last close of a file this
        mount held open), unless another live name holds the chunks; ends the record `delete` made."""
        await self.end_replacing(bucket, nuid, "", self.put_log is not None, stored=True)

    async def rename(self, bucket: str, old: str, new: str, *, expected_revision: int | None = None,
                     expected_nuid: str = "", target_revision: int = 0,
                     change: Callable[[dict[str, Any]], None] | None = None,
                     target_change: Callable[[dict[str, Any]], None] | None = None,
                     stored: Callable[[ObjectInfo], None] | None = None, msg_id: str = ""
                     ) -> tuple[ObjectInfo, ObjectInfo]:
        """Metadata-only rename (same nuid, no data moved), in nats.go's UpdateMeta order, the old name
        taken by a claim instead of a purge:
        1. the meta under the new name (rollup; expects the target's revision, so another client's
           object there is never replaced unseen),
        2. the claim of the old name: a tombstone on a fresh nuid (`claim_doc`) that expects the
           revision read. Another client's delete of the old name, or its rename of it, expects that
           revision too, so exactly one of them is stored. A tombstone carrying the live nuid would make
           other clients' Delete or Put of the old name purge the renamed object's chunks; this one
           carries none.
        A claim refused (the old name was deleted, renamed or changed meanwhile) means this rename lost:
        the meta it published under the new name is taken back (`_undo_move`, chunks never purged: the
        nuid belongs to whoever won), and `NotFound` (the old name holds a tombstone or nothing) or
        `Conflict` (another meta) is raised. A crash between the steps leaves the object under both
        names. `stored` is called with every meta this stores (the new one, the claim, an undo), as it
        is stored; `msg_id` is the new meta's `Nats-Msg-Id` (see `meta_msg_id`). Returns (new info, the
        claim). The caller purges a replaced target's chunks."""
        doc, revision = await self._live_doc(bucket, old, expected_revision, expected_nuid)
        self.check_name(bucket, new)
        moved = _moved_doc(doc, new, change)
        # The replaced target's meta, stored again should the claim be refused (the new meta's rollup
        # removes it): a round trip only when this store did not write that meta itself.
        target = await self._live_target(bucket, new, target_revision) if target_revision else None
        key = (bucket, old)
        self._renaming[key] += 1
        try:
            # (Not read back for its timestamp: a renamed file keeps its mtime in natsfs.mtime_ns, and a
            # directory marker's or link's new time is now, as this machine's clock has it.)
            new_info = await self.publish_replacing(bucket, moved, target_revision, True, msg_id, timestamp=False,
                                                    replaces=(meta_subject(bucket, old), revision))
            if stored is not None:
                stored(new_info)
            if testpoints.ACTIVE:
                await testpoints.pause("rename.between_publishes")
            try:
                claim = await self.publish_meta(bucket, claim_doc(bucket, old, doc), expected_revision=revision,
                                                timestamp=False)
            except Conflict:
                undone = await self._undo_move(bucket, new_info, moved, target, target_change)
                if undone is not None and stored is not None:
                    stored(undone)
                raise await self._lost_claim(bucket, old) from None
            if stored is not None:
                stored(claim)
        finally:
            self._renaming[key] -= 1
            if not self._renaming[key]:
                del self._renaming[key]
        return new_info, claim

    async def _live_target(self, bucket: str, name: str, revision: int) -> dict[str, Any] | None:
        """The live meta of a rename's target at `revision` (None: anything else, which the rename's
        publish refuses anyway, or a meta that cannot be read)."""
        try:
            current = await self._doc_at(bucket, name, revision)
        except MalformedMeta:
            return None
        if current is None or current[1] != revision or current[0].get("deleted"):
            return None
        return current[0]

    async def _undo_move(self, bucket: str, new_info: ObjectInfo, moved: dict[str, Any],
                         target: dict[str, Any] | None,
                         target_change: Callable[[dict[str, Any]], None] | None) -> ObjectInfo | None:
        """Take back the meta a rename that lost its old name stored under the new one: the target it
        replaced is stored again, else a tombstone on a fresh nuid (announced by the watch, so other
        mounts drop the name at once; the moved nuid's chunks are never touched). It expects exactly
        the rename's own meta: anything written there since stays. Shielded, so that a cancelled rename
        does not leave two names; one that cannot be stored is logged and left (as after a crash)."""
        if target is not None:
            restored = dict(target, mtime=ZERO_TIME)
            if target_change is not None:
                target_change(restored)
        else:
            restored = claim_doc(bucket, new_info.name, moved)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.settle_timeout):
            try:
                return await self.publish_meta(bucket, restored, expected_revision=new_info.revision,
                                               timestamp=False)
            except Conflict:
                return None  # written over meanwhile by another client: theirs stays
            except NatsFSError as e:
                log.warning("bucket %s: a rename to %r lost its source to another client, and the meta it "
                            "stored there could not be taken back (%s): both names hold nuid %s (fsck "
                            "reports it)", bucket, new_info.name, e, new_info.nuid)
                return None
        log.warning("bucket %s: a rename to %r lost its source to another client, and the meta it stored there "
                    "was not taken back in time: both names may hold nuid %s (fsck reports it)", bucket,
                    new_info.name, new_info.nuid)
        return None

    async def _lost_claim(self, bucket: str, old: str) -> NatsFSError:
        """Why a rename's claim of `old` was refused: `NotFound` when the name is deleted now (a tombstone,
        or nothing: another client deleted it, or renamed it away), else `Conflict` (changed)."""
        changed = Conflict(f"{bucket}/{old} changed since it was read")
        try:
            now = await self.get_info(bucket, old)
        except NatsFSError:
            return changed  # (not readable now: it changed, at least)
        if now is None or now.deleted:
            return NotFound(f"{bucket}/{old} was deleted or renamed by another client meanwhile")
        return changed

    async def check_rename_size(self, bucket: str, old: str, new: str, *, expected_revision: int,
                                change: Callable[[dict[str, Any]], None] | None = None) -> None:
        """`TooBig` when `rename` would refuse the meta of `old` under `new` for its size (checked before
        a directory rename moves anything). A meta that changed meanwhile is left to the rename itself."""
        current = await self._doc_at(bucket, old, expected_revision)
        if current is None or current[1] != expected_revision or current[0].get("deleted"):
            return
        moved = _moved_doc(current[0], new, change)
        self.check_meta_size(bucket, moved, replaced_bytes=await self._live_meta_bytes(
            bucket, meta_subject(bucket, old), expected_revision))

    async def adopt_alias(self, bucket: str, name: str, subject: str, revision: int,
                          change: Callable[[dict[str, Any]], None] | None = None) -> ObjectInfo:
        """Move the meta of `name` from a non-canonical `subject` (where it is at `revision`: else
        `Conflict`) to the name's canonical subject, which must hold nothing (expected revision 0), then
        purge `subject` up to `revision`, the two steps of a rename (same nuid, no data moved). A crash in
        between leaves it under both subjects, where the canonical one wins. Returns the canonical meta."""
        msg = await self.streams.last_msg(stream_name(bucket), subject)
        if msg is None or msg.seq != revision:
            raise Conflict(f"{bucket}/{name} changed since it was read")
        try:
            doc = load_meta(msg.data)[0]
        except MetaNotJSON as e:
            raise MalformedMeta(f"meta {subject} {e}") from None
        if doc.get("deleted"):
            raise Conflict(f"{bucket}/{name} changed since it was read")
        moved = _moved_doc(usable_fields(doc), name, change)
        info = await self.publish_meta(bucket, moved, expected_revision=0, timestamp=False,
                                       replaces=(subject, revision))
        await self._purge_settled(bucket, subject, revision + 1)
        return info

    def renaming_away(self, bucket: str, name: str) -> bool:
        """Whether this store is renaming `name` away right now (its new meta may already be in the
        watch; the caller drops the old name itself once the rename is done)."""
        return (bucket, name) in self._renaming

    async def defuse_wildcard_nuid(self, bucket: str, name: str, revision: int) -> ObjectInfo | None:
        """Rewrite the meta of `name` at `revision`, whose nuid holds a wildcard (`*`, `>`: another client
        wrote it, see `wildcard_nuid`), on a fresh nuid that holds no chunks, expecting that revision:
        other clients' Delete or Put of the name purge the nuid they find there, and `$O.<bucket>.C.*`
        would be every chunk of the bucket. A tombstone becomes a tombstone as a rename's claim writes it
        (`claim_doc`); a live meta or a link keeps every other field (a link its target; a live object
        its size, which it could never read: no chunk is published to a wildcard as its own, and none
        is under the fresh nuid). None when the name holds something else now (changed meanwhile, or a
        `Conflict` with another client's newer revision: nothing is written). Shared by the mount
        (`Mutations.defuse_wildcard_nuids`) and `natsfs fsck --repair`."""
        current = await self.get_meta_doc(bucket, name)
        if current is None or current[1] != revision:
            return None
        doc = current[0]
        if not wildcard_nuid(doc.get("nuid")):
            return None
        # (A live meta's nuid is replaced by `publish_meta`, whose size check judges the rewrite as not growing.)
        rewritten = claim_doc(bucket, name, doc) if doc.get("deleted") is True else usable_fields(doc)
        try:
            return await self.publish_meta(bucket, rewritten, expected_revision=revision, timestamp=False)
        except Conflict:
            return None

    async def defuse_wildcard_alias(self, bucket: str, subject: str, revision: int) -> ObjectInfo | None:
        """Rewrite the alias on `subject` at `revision` (`alias_wildcard_nuid`: nats.go's Put and Delete of
        the name that subject is for would purge by its wildcard nuid) in place, on a fresh nuid that holds
        no chunks, expecting that revision: every other field kept, its own `name` (another name's) and a
        tombstone's `deleted` too. None when the subject holds something else now (nothing written);
        `StoredButSkipped` for an alias this mount skips (stored, skipped as before). Shared by the mount
        (`Mutations.defuse_wildcard_nuids`) and `natsfs fsck --repair`."""
        msg = await self.streams.last_msg(stream_name(bucket), subject)
        if msg is None or msg.seq != revision or alias_wildcard_nuid(bucket, msg) is None:
            return None
        doc = usable_fields(load_meta(msg.data)[0])
        try:
            # (Its wildcard nuid given as it is: `publish_meta` stores a fresh one, and judges the few bytes
            # that adds as not growing the meta, as for any rewrite of a wildcard nuid.)
            return await self.publish_meta(bucket, doc, expected_revision=revision, timestamp=False,
                                           subject=subject)
        except Conflict:
            return None

    async def purge_tombstone(self, bucket: str, name: str, revision: int) -> None:
        """Remove a tombstone (and anything older) from `name`'s meta subject; a newer meta stays. Only
        when the subject still ends at that tombstone: a stream deleted and created again numbers its
        messages from 1 again, and a purge up to a revision of the old one could remove another client's
        object from the new one."""
        subject = self._meta_subject(bucket, name)
        msg = await self.streams.last_msg(stream_name(bucket), subject)
        if msg is None or msg.seq != revision:
            return
        try:
            if not parse_meta(bucket, msg).deleted:
                return
        except MalformedMeta:
            return
        await self.streams.purge_subject(stream_name(bucket), subject, before_seq=revision + 1)

    async def purge_alias(self, bucket: str, subject: str, revision: int) -> None:
        """Remove an alias meta (a name's meta under a non-canonical subject) up to `revision`; a newer
        message there stays."""
        await self._purge_settled(bucket, subject, revision + 1)

    async def _live_doc(self, bucket: str, name: str, expected_revision: int | None,
                        expected_nuid: str = "") -> tuple[dict[str, Any], int]:
        """The meta of a live object, checked against the revision (and nuid) the caller read
        (`Conflict`)."""
        current = await self._doc_at(bucket, name, expected_revision)
        if current is None or current[0].get("deleted"):
            raise NotFound(f"{bucket}/{name}")
        doc, revision = current
        if expected_revision is not None and revision != expected_revision:
            raise Conflict(f"{bucket}/{name} changed since it was read")
        check_same_object(bucket, name, doc, expected_nuid)
        return doc, revision

    async def update_meta(self, bucket: str, name: str, change: Callable[[dict[str, Any]], None], *,
                          expected_revision: int | None = None, expected_nuid: str = "") -> ObjectInfo:
        """Rewrite an object's meta in place (same nuid), keeping every field `change` leaves alone.
        Not read back for its timestamp: without `natsfs.mtime_ns`, its time is now, as this machine's
        clock has it."""
        doc, revision = await self._live_doc(bucket, name, expected_revision, expected_nuid)
        doc = dict(doc, mtime=ZERO_TIME)
        change(doc)
        return await self.publish_meta(bucket, doc, expected_revision=revision, timestamp=False)

    async def add_link(self, bucket: str, name: str, target_bucket: str, target_name: str | None, *,
                       metadata: dict[str, str] | None = None) -> ObjectInfo:
        """AddLink / AddBucketLink as nats.go writes them (fresh nuid, size 0, no chunks). The caller has
        checked the target (a live object that is not a link, or a bucket); here the name is checked:
        a live regular object there is `AlreadyExists`, a link or a deleted object is replaced."""
        current = await self.get_meta_doc(bucket, name)
        revision = 0
        if current is not None:
            doc, revision = current
            is_link = isinstance(doc.get("options"), dict) and bool(doc["options"].get("link"))
            if not doc.get("deleted") and not is_link:
                raise AlreadyExists(f"{bucket}/{name} is an object")
        link = {"bucket": target_bucket} | ({"name": target_name} if target_name else {})
        doc = meta_doc(name=name, bucket=bucket, nuid=new_nuid(), size=0, chunks=0, digest="", link=link,
                       base={"metadata": metadata} if metadata else None)
        return await self.publish_meta(bucket, doc, expected_revision=revision)

    async def update_bucket(self, bucket: str, change: Callable[[dict[str, Any]], None]) -> BucketStatus:
        """Change a bucket's stream config (description, metadata) and keep the rest as it is."""
        st = await self.streams.stream_info(stream_name(bucket))
        config = dict(st.config)
        change(config)
        return self._noted(bucket, await self.streams.update_stream(config))

    async def purge_chunks(self, bucket: str, nuid: str) -> None:
        await self.streams.purge_subject(stream_name(bucket), chunk_subject(bucket, nuid))

    async def purge_chunks_later_if_needed(self, bucket: str, nuid: str, name: str) -> bool:
        """Purge the chunks of a version no meta uses any more; if the server does not answer, hand
        them to the `PutLog` (settled once it answers) instead of leaving them behind. True if purged
        (or kept because another live name still uses them: two names on one nuid, a rename cut short
        or a copy by another client, must never lose their bytes when one of them is replaced)."""
        if not usable_nuid(nuid):
            return True  # no chunk subject of its own (a hostile meta's `>`): nothing to purge
        users = self.nuid_users(bucket, nuid, name) if self.nuid_users is not None else ()
        if users:
            shown = ", ".join(repr(n) for n in users[:3]) + (" ..." if len(users) > 3 else "")
            log.info("bucket %s: the chunks of nuid %s (replaced or deleted under %r) stay: %s still use them",
                     bucket, nuid, name, shown)
            return True
        try:
            await self.purge_chunks(bucket, nuid)
            return True
        except NatsFSError as e:
            if self.put_log is not None:
                log.debug("purge of %s/%s failed (%s); settled later", bucket, nuid, e)
                self.put_log.orphaned(bucket, nuid, name)
            else:
                log.warning("could not purge the chunks of %s/%s (left for fsck): %s", bucket, nuid, e)
            return False

    def note_replacing(self, bucket: str, old_nuid: str, new_nuid: str, name: str) -> bool:
        """Record the version a put replaces before the meta that replaces it is sent: a daemon killed
        between that meta and the purge of the old chunks leaves them to the next mount (which keeps
        them when the name still holds them). True when recorded (end it with `end_replacing`)."""
        if self.put_log is None or not old_nuid or old_nuid == new_nuid:
            return False
        self.put_log.started(bucket, old_nuid, name)
        return True

    async def end_replacing(self, bucket: str, old_nuid: str, name: str, noted: bool, *, stored: bool,
                            deadline: float | None = None) -> None:
        """After the meta of a put that replaces `old_nuid`: stored (purge the old chunks) or not (the
        old version stays). A meta whose fate stays unknown counts as not stored here: if it turns out
        stored, the old chunks are left for `natsfs fsck` (the record is not kept: a pending record
        under the name would make a later close of the file take another client's change for its own)."""
        if stored and testpoints.ACTIVE:
            await testpoints.pause("put.before_purge")
        if stored:
            # The put is stored: nothing may turn that into a failure for its caller now (a close's
            # deadline, an interrupted write-back upload: the file would count as not stored, and its
            # next put as a conflict with itself). So this purge is shielded, and bounded by
            # ABORT_CLEANUP_S (`deadline`, when the caller has one); the `PutLog` purges what it left.
            bound = deadline if deadline is not None else trio.current_time() + ABORT_CLEANUP_S
            with trio.CancelScope(shield=True, deadline=bound) as bounded:
                purged = await self.purge_chunks_later_if_needed(bucket, old_nuid, name)
            if bounded.cancelled_caught:
                log.debug("purge of %s/%s got no answer within %g s; settled later", bucket, old_nuid,
                          ABORT_CLEANUP_S)
                if self.put_log is not None:
                    self.put_log.orphaned(bucket, old_nuid, name)
            elif purged and noted:
                assert self.put_log is not None
                self.put_log.finished(bucket, old_nuid)
        elif noted:
            assert self.put_log is not None
            self.put_log.finished(bucket, old_nuid)

    async def _purge_settled(self, bucket: str, subject: str, before_seq: int) -> None:
        """A purge (idempotent) retried while the server does not answer, for at most `settle_timeout`."""
        backoff = Backoff(timeout=self.settle_timeout)
        while True:
            try:
                await self.streams.purge_subject(stream_name(bucket), subject, before_seq=before_seq)
                return
            except Unavailable:
                if backoff.expired:
                    raise
                await backoff.pause()


class FileSender(Protocol):
    """Publishes byte ranges of local files as chunks, hashing them (the upload worker)."""

    @property
    def alive(self) -> bool: ...

    async def send_range(self, session: str, subject: str, path: str, start: int, end: int, chunk_size: int,
                         window: int) -> None: ...

    async def digest(self, session: str) -> bytes: ...

    async def drop(self, session: str) -> bool:
        """Stop sending `session` and forget it: True once nothing more of it can be published (False:
        not known yet, ask again later)."""
        ...


class PutLog(Protocol):
    """Where puts are recorded while their chunks may be orphans (see `natsfs.staging.PutJournal`)."""

    def started(self, bucket: str, nuid: str, name: str) -> None:
        """Chunks of `nuid` are about to be sent."""

    def finished(self, bucket: str, nuid: str) -> None:
        """The put's meta is stored: its chunks are in use."""

    def failed(self, bucket: str, nuid: str, name: str, *, meta_unknown: bool, purged: bool,
               sender_busy: bool = False) -> None:
        """The put ended without a stored meta (or without knowing): its chunks must be settled later;
        with `sender_busy`, only once the store's `FileSender` says it sends nothing more of it (`drop`)."""

    def orphaned(self, bucket: str, nuid: str, name: str) -> None:
        """Chunks of a version that was `name` (replaced or deleted) could not be purged: settle later."""


# A stream name no stream can have (stream names may not contain "."): see `earlier_publishes_processed`.
_NO_SUCH_STREAM = "natsfs.barrier"

# Where a put's meta stands: not sent yet, sent without a known outcome, refused by the server, stored.
_META_UNSENT, _META_SENT, _META_REFUSED, _META_STORED = range(4)


class PutSession:
    """One put in progress: chunks on a fresh nuid, sent in batches, then committed with the meta.

    Chunks come either as bytes (`send`, hashed here by the caller's `hasher`) or as ranges of a
    local file (`send_file`), which the store's `FileSender` (the upload worker) reads, hashes and
    publishes when there is one, and this process does otherwise. A session uses one way throughout.
    Chunk `i` is published with message id `<nuid>.<i>`, the meta with `<nuid>.meta`. Any chunk without
    an ack fails the put: the meta is only sent when every chunk was acknowledged. `abort` purges what
    was sent, but only when the meta is known not to be stored and the `FileSender` sends nothing more
    of it (its `drop` said so: asked first); the store's `PutLog` is told of every
    put that sent chunks and did not end with a stored meta, so leftovers are settled later.
    """

    def __init__(self, store: ObjectStore, bucket: str, chunk_size: int, window: int, name: str = ""):
        self.store = store
        self.bucket = bucket
        self.name = name
        self.chunk_size = chunk_size
        self.window = window
        self.nuid = new_nuid()
        self.subject = chunk_subject(bucket, self.nuid)
        self.size = 0
        self.chunks = 0
        self.done = False
        self.hasher = hashlib.sha256()
        self.remote: bool | None = None  # hashed by the FileSender (True) or here (False)
        self._next_start = 0  # local hashing takes file ranges strictly in order
        self._advanced = trio.Event()
        self._next_index = 0  # of the next chunk sent in-process
        self._logged = False
        self.meta_state = _META_UNSENT

    def _log_started(self) -> None:
        if not self._logged:
            self._logged = True
            if self.store.put_log is not None:
                self.store.put_log.started(self.bucket, self.nuid, self.name)

    async def send(self, batch: list[bytes]) -> None:
        if not batch:
            return
        await self.store.check_fits(self.bucket, self.name, self.size + sum(len(c) for c in batch),
                                    self.chunks + len(batch))
        self._log_started()
        first = self._next_index
        self._next_index += len(batch)
        self.chunks += len(batch)
        self.size += sum(len(c) for c in batch)
        await self.store.streams.publish_many(
            [(self.subject, c, {MSG_ID: f"{self.nuid}.{first + i}"}) for i, c in enumerate(batch)], self.window)

    async def send_and_commit(self, data: bytes, name: str, digest: bytes, **commit: Any) -> ObjectInfo:
        """The last (for a small file: the only) chunk and the meta in one round trip: see
        `ObjectStore._publish_after`, which never lets the meta be stored without it."""
        await self.store.check_fits(self.bucket, name, self.size + len(data), self.chunks + 1)
        self._log_started()
        chunk_id = f"{self.nuid}.{self._next_index}"
        self._next_index += 1
        self.chunks += 1
        self.size += len(data)
        return await self.commit(name, digest, after=(self.subject, bytes(data), {MSG_ID: chunk_id}), **commit)

    async def send_file(self, path: str, fd: int, start: int, end: int) -> None:
        """Send bytes [start, end) of a local file as chunks (start is on a chunk boundary)."""
        if end <= start:
            return
        await self.store.check_fits(self.bucket, self.name, self.size + end - start,
                                    self.chunks + -(-(end - start) // self.chunk_size))
        sender = self.store.file_sender
        if self.remote is None:
            self.remote = sender is not None and sender.alive
        if self.remote:
            assert sender is not None
            self._log_started()
            self.chunks += -(-(end - start) // self.chunk_size)
            self.size += end - start
            await sender.send_range(self.nuid, self.subject, path, start, end, self.chunk_size, self.window)
            return
        while self._next_start != start:  # ranges may be sent concurrently; they are hashed in order
            await self._advanced.wait()
        pos = start
        while pos < end:
            stop = min(end, pos + self.chunk_size * max(1, self.window // 2))
            batch = await trio.to_thread.run_sync(_read_chunks, fd, pos, stop, self.chunk_size, self.hasher)
            await self.send(batch)
            pos = stop
        self._next_start = end
        advanced, self._advanced = self._advanced, trio.Event()
        advanced.set()

    async def digest(self) -> bytes:
        if self.remote:
            assert self.store.file_sender is not None
            return await self.store.file_sender.digest(self.nuid)
        return self.hasher.digest()

    async def commit(self, name: str, digest: bytes, *, base: dict[str, Any] | None = None,
                     expected_revision: int | None = None, old_nuid: str = "",
                     extra: Callable[[dict[str, Any]], None] | None = None,
                     replace_tombstone: bool = False, timestamp: bool = True,
                     after: ChunkMsg | None = None) -> ObjectInfo:
        self.name = name
        doc = meta_doc(name=name, bucket=self.bucket, nuid=self.nuid, size=self.size, chunks=self.chunks,
                       digest=format_digest(digest), base=base, chunk_size=self.chunk_size)
        if extra is not None:
            extra(doc)
        previous = await self.store.previous_version(self.bucket, name, old_nuid, base, expected_revision)
        self.meta_state = _META_SENT
        noted = self.store.note_replacing(self.bucket, old_nuid, self.nuid, name)
        try:
            info = await self.store.publish_replacing(self.bucket, doc, expected_revision, replace_tombstone,
                                                       msg_id=f"{self.nuid}.meta", timestamp=timestamp,
                                                       after=after)
        except BaseException as e:
            if isinstance(e, NatsFSError) and not isinstance(e, Unavailable):
                self.meta_state = _META_REFUSED  # the server said no (or nothing was sent): not stored
            with trio.CancelScope(shield=True):
                await self.store.end_replacing(self.bucket, old_nuid, name, noted, stored=False)
            raise
        self.meta_state = _META_STORED
        self.done = True
        if self._logged and self.store.put_log is not None:
            self.store.put_log.finished(self.bucket, self.nuid)
        try:
            whole = await self.store.prove_whole(self.bucket, name, self.nuid, self.chunks, info.revision, previous)
        except NotWhole:
            with trio.CancelScope(shield=True):
                await self.store.end_replacing(self.bucket, old_nuid, name, noted, stored=False)
                with trio.CancelScope(deadline=trio.current_time() + ABORT_CLEANUP_S):
                    await self._forget()
            raise
        # Stored: its cleanup is shielded and bounded (see `ObjectStore.end_replacing`), so that a caller's
        # deadline passing now cannot make this put look failed.
        with trio.CancelScope(shield=True):
            deadline = trio.current_time() + ABORT_CLEANUP_S
            if old_nuid and old_nuid != self.nuid:
                await self.store.end_replacing(self.bucket, old_nuid, name, noted, stored=whole, deadline=deadline)
            with trio.CancelScope(deadline=deadline):
                await self._forget()
        return info

    async def abort(self) -> None:
        """End a put that will not be committed: purge its chunks when its meta is known not to be
        stored, and hand it to the `PutLog` to settle what could not be settled now."""
        if self.done:
            return
        self.done = True
        meta_unknown = self.meta_state == _META_SENT
        purged = False
        deadline = trio.current_time() + ABORT_CLEANUP_S
        sender_quiet = True
        if self.remote and self.store.file_sender is not None:
            # The upload worker first stops sending it (a range of it may still be publishing as acks
            # come): a chunk it published after the purge would be an orphan no record covers. Not told
            # in time that it stopped: no purge now, the `PutLog` purges once it says so (or is gone).
            sender_quiet = False
            with trio.CancelScope(deadline=deadline):
                sender_quiet = await self.store.file_sender.drop(self.nuid)
            if not sender_quiet:
                log.debug("%s: the upload worker did not say within %g s that it stopped sending it; purged "
                          "once it does", self.subject, ABORT_CLEANUP_S)
        # (Not while there is no connection: the purge would only wait for one. The `PutLog` purges later.)
        if self._logged and not meta_unknown and sender_quiet and self.store.connected:
            with trio.CancelScope(deadline=deadline) as scope:
                try:
                    await self.store.streams.purge_subject(stream_name(self.bucket), self.subject)
                    purged = True
                except NatsFSError as e:
                    log.debug("%s: purge of an unfinished put failed: %s", self.subject, e)
            if scope.cancelled_caught:
                log.debug("%s: purge of an unfinished put got no answer within %g s", self.subject,
                          ABORT_CLEANUP_S)
        if self._logged:
            put_log = self.store.put_log
            if put_log is not None:
                put_log.failed(self.bucket, self.nuid, self.name, meta_unknown=meta_unknown, purged=purged,
                               sender_busy=not sender_quiet)
            elif not purged:
                log.warning("%s: chunks of an unfinished put are left (for fsck)", self.subject)

    async def _forget(self) -> None:
        if self.remote and self.store.file_sender is not None:
            await self.store.file_sender.drop(self.nuid)


def _read_chunks(fd: int, start: int, end: int, chunk_size: int, hasher: Any) -> list[bytes]:
    """Bytes [start, end) of a file as chunks, fed to `hasher` in order (call on a worker thread)."""
    out = []
    pos = start
    while pos < end:
        n = min(chunk_size, end - pos)
        data = os.pread(fd, n, pos)
        if len(data) < n:  # a hole at the end of a sparse file reads short: zeros
            data += bytes(n - len(data))
        hasher.update(data)
        out.append(data)
        pos += n
    return out


async def _file_chunks(fd: int, size: int, chunk_size: int, hasher: Any) -> AsyncIterator[bytes]:
    """The first `size` bytes of a file as chunks, read and hashed on a worker thread a few at a time."""
    pos = 0
    step = chunk_size * 16
    while pos < size:
        stop = min(size, pos + step)
        for chunk in await trio.to_thread.run_sync(_read_chunks, fd, pos, stop, chunk_size, hasher):
            yield chunk
        pos = stop


class ChunkSource(Protocol):
    """Where a put reads its bytes: batches of chunks, hashed as they are read."""

    size: int
    chunks: int

    async def read_batch(self, chunk_size: int, max_chunks: int) -> list[bytes]: ...

    def digest(self) -> bytes: ...


# A batch at least this big is hashed on a worker thread, off the trio thread.
_THREAD_HASH_BYTES = 1024 * 1024


def _hash_all(hasher: Any, pieces: list[bytes]) -> None:
    for piece in pieces:
        hasher.update(piece)


class BytesSource:
    """A `ChunkSource` over bytes in memory (small objects, markers, tests)."""

    def __init__(self, data: bytes):
        self._data = data
        self._pos = 0
        self._hash = hashlib.sha256()
        self.size = 0
        self.chunks = 0

    async def read_batch(self, chunk_size: int, max_chunks: int) -> list[bytes]:
        out: list[bytes] = []
        while self._pos < len(self._data) and len(out) < max_chunks:
            piece = self._data[self._pos : self._pos + chunk_size]
            self._pos += len(piece)
            self.size += len(piece)
            self.chunks += 1
            out.append(piece)
        if sum(map(len, out)) >= _THREAD_HASH_BYTES:
            await trio.to_thread.run_sync(_hash_all, self._hash, out)  # hashlib drops the GIL
        else:
            _hash_all(self._hash, out)
        return out

    def digest(self) -> bytes:
        return self._hash.digest()
