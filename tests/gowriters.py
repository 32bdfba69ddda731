"""Writers of ADR-20 objects exactly as nats.go publishes them, for tests only (the daemon never calls
them): `put_object`, `put_link`, `delete_object`, `rename_object` (and nats.js's `js_put_object`). They
work over any `Streams`: MemoryStreams in the unit and ops tiers, JetStreams against a real server.
Metas are written with `natsfs.adr20.meta_json`, the one nats.go-exact meta writer.
"""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Sequence
from typing import Any

from natsfs.adr20 import (
    DEFAULT_CHUNK_SIZE,
    MetaNotJSON,
    ObjectInfo,
    chunk_subject,
    digest_of,
    load_meta,
    meta_json,
    meta_subject,
    parse_meta,
    stream_name,
)
from natsfs.errors import AlreadyExists, NotFound
from natsfs.streams import ROLLUP

ZERO_TIME = "0001-01-01T00:00:00Z"  # what nats.go writes as `mtime`
_NUID_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NUID_PREFIX = "".join(secrets.choice(_NUID_ALPHABET) for _ in range(12))
_nuid_counter = itertools.count(1)


def fixture_nuid() -> str:
    """a fresh 22-character nuid (random prefix, counting suffix, like nats.go's nuid)."""
    n = next(_nuid_counter)
    tail = ""
    for _ in range(10):
        n, r = divmod(n, 62)
        tail = _NUID_ALPHABET[r] + tail
    return _NUID_PREFIX + tail


def _split(data: bytes, chunk_size: int, chunk_sizes: Sequence[int] | None) -> list[bytes]:
    if chunk_sizes is None:
        return [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]
    if sum(chunk_sizes) != len(data) or any(n <= 0 for n in chunk_sizes):
        raise ValueError(f"chunk sizes {list(chunk_sizes)} do not split {len(data)} bytes")
    out, pos = [], 0
    for n in chunk_sizes:
        out.append(data[pos : pos + n])
        pos += n
    return out


async def _current_doc(streams: Any, bucket: str, name: str, *, js: bool = False) -> dict[str, Any] | None:
    msg = await streams.last_msg(stream_name(bucket), meta_subject(bucket, name))
    if msg is None:
        return None
    if js:  # nats.js's JSON.parse: exact keys, the last one wins
        try:
            doc = json.loads(msg.data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None
    # As nats.go's json.Unmarshal reads it (`NUID` is its nuid too); None where it cannot (ErrBadObjectMeta).
    try:
        doc, wrong = load_meta(msg.data)
    except MetaNotJSON:
        return None
    return doc if wrong is None else None


async def _info(streams: Any, bucket: str, name: str) -> ObjectInfo:
    msg = await streams.last_msg(stream_name(bucket), meta_subject(bucket, name))
    assert msg is not None
    return parse_meta(bucket, msg)


async def put_object(streams: Any, bucket: str, name: str, data: bytes, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     chunk_sizes: Sequence[int] | None = None, description: str = "",
                     metadata: dict[str, str] | None = None, headers: dict[str, list[str]] | None = None,
                     nuid: str | None = None, digest: str | None = None) -> ObjectInfo:
    """put `data` as nats.go's Put does and return the object's parsed meta.

    Chunks of `chunk_size` (or exactly `chunk_sizes`, for uneven chunks) on a fresh nuid's chunk subject,
    then the meta with `Nats-Rollup: sub`, then a purge of the previous version's chunks. `digest`
    overrides the computed one (to fake corruption).
    """
    old = await _current_doc(streams, bucket, name)
    nuid = nuid or fixture_nuid()
    subject = chunk_subject(bucket, nuid)
    pieces = _split(data, chunk_size, chunk_sizes)
    for piece in pieces:
        await streams.publish(subject, piece)
    doc = {"name": name, "description": description, "headers": headers, "metadata": metadata,
           "options": {"max_chunk_size": chunk_size}, "bucket": bucket, "nuid": nuid, "size": len(data),
           "mtime": ZERO_TIME, "chunks": len(pieces), "digest": digest if digest is not None else digest_of(data)}
    await streams.publish(meta_subject(bucket, name), meta_json(doc), {ROLLUP: "sub"})
    if old is not None and not old.get("deleted") and old.get("nuid") and old.get("nuid") != nuid:
        await streams.purge_subject(stream_name(bucket), chunk_subject(bucket, str(old["nuid"])))
    return await _info(streams, bucket, name)


async def put_link(streams: Any, bucket: str, name: str, target_bucket: str, target_name: str | None = None, *,
                   style: str = "go") -> ObjectInfo:
    """a link object. `style="go"`: fresh nuid, size 0, rollup (nats.go's AddLink);
    `style="js"`: no nuid/size/chunks and no rollup header (nats.js's quirk)."""
    link: dict[str, str] = {"bucket": target_bucket}
    if target_name is not None:
        link["name"] = target_name
    if style == "js":
        payload = json.dumps({"name": name, "bucket": bucket, "options": {"link": link}}, separators=(",", ":"))
        await streams.publish(meta_subject(bucket, name), payload.encode())
    elif style == "go":
        doc = {"name": name, "options": {"link": link}, "bucket": bucket, "nuid": fixture_nuid(), "size": 0,
               "mtime": ZERO_TIME, "chunks": 0}
        await streams.publish(meta_subject(bucket, name), meta_json(doc), {ROLLUP: "sub"})
    else:
        raise ValueError(f"unknown link style {style!r}")
    return await _info(streams, bucket, name)


async def delete_object(streams: Any, bucket: str, name: str) -> None:
    """nats.go's Delete: a tombstone meta (deleted, size/chunks 0, no digest), then purge chunks."""
    doc = await _current_doc(streams, bucket, name)
    if doc is None or doc.get("deleted"):
        raise NotFound(f"no object {name!r} in {bucket}")
    tomb = dict(doc, size=0, chunks=0, digest="", deleted=True, mtime=ZERO_TIME)
    await streams.publish(meta_subject(bucket, name), meta_json(tomb), {ROLLUP: "sub"})
    if doc.get("nuid"):
        await streams.purge_subject(stream_name(bucket), chunk_subject(bucket, str(doc["nuid"])))


async def js_put_object(streams: Any, bucket: str, name: str, data: bytes) -> ObjectInfo:
    """nats.js's put: as nats.go's Put, but the previous info's nuid is purged whatever it was (a
    tombstone's, a link's too). A nuid that cannot name one chunk subject is refused (`chunk_subject`),
    as MemoryStreams refuses a purge by a wildcard: a real server would purge every subject it matches."""
    old = await _current_doc(streams, bucket, name, js=True)
    info = await put_object(streams, bucket, name, data)
    if old is not None and old.get("nuid") and old.get("nuid") != info.nuid:
        await streams.purge_subject(stream_name(bucket), chunk_subject(bucket, str(old["nuid"])))
    return info


async def rename_object(streams: Any, bucket: str, old: str, new: str) -> ObjectInfo:
    """nats.go's UpdateMeta with a new name: meta under `new` (same nuid), then purge `old`'s meta."""
    doc = await _current_doc(streams, bucket, old)
    if doc is None or doc.get("deleted"):
        raise NotFound(f"no object {old!r} in {bucket}")
    target = await _current_doc(streams, bucket, new)
    if target is not None and not target.get("deleted"):
        raise AlreadyExists(f"object {new!r} exists in {bucket}")
    await streams.publish(meta_subject(bucket, new), meta_json(dict(doc, name=new)), {ROLLUP: "sub"})
    await streams.purge_subject(stream_name(bucket), meta_subject(bucket, old))
    return await _info(streams, bucket, new)

