"""Object and bucket metadata as extended attributes: the mapping, in both directions.

Pure functions over a meta document (the JSON dict of an object's meta) or a bucket's stream config:

| attribute | is | writable |
|---|---|---|
| `user.<key>` | `metadata[key]` | yes |
| `user.nats.description` | `description` | yes |
| `user.nats.header.<Name>` | `headers[Name]`, values joined by newlines | yes |
| `user.nats.digest` `.nuid` `.size` `.chunks` `.chunk_size` `.revision` `.bucket` `.name` `.link` | facts | no |

Metadata keys natsfs uses for POSIX attributes (`natsfs.*`) are not shown; `user.natsfs.*` cannot be set.
Other clients may write any key: one that makes no usable attribute name (a NUL in it, over
`XATTR_NAME_MAX` bytes with its prefix, not UTF-8, or a metadata key `nats.*` whose name would be in
natsfs's own `user.nats.` namespace) is left out of listings, so the kernel never refuses a whole list.
Bucket directories show the bucket's description and metadata the same way, and read-only facts
(`user.nats.bucket.size`, `.max_bytes`, `.storage`, `.replicas`, `.sealed`, `.compression`, `.ttl`).

Read-only facts are read by name and never listed (as CephFS does for its virtual attributes): tools
that copy every listed attribute (`cp -a`, `mv` between buckets, `rsync -X`) would otherwise fail to
set them on the copy and report an error for each file.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Callable
from typing import Any

from .errors import NatsFSError

USER = "user."
NS = "user.nats."
HEADER = "user.nats.header."
DESCRIPTION = "user.nats.description"
OWN_PREFIX = "natsfs."
XATTR_CREATE = 1
XATTR_REPLACE = 2
ENOATTR = errno.ENODATA
XATTR_NAME_MAX = 255  # bytes of a whole attribute name, prefix included (longer: ERANGE in the kernel)



class NoAttribute(NatsFSError):
    errno = ENOATTR
    log_level = logging.DEBUG


def _refuse(message: str, code: int) -> NatsFSError:
    return NatsFSError(message, errno=code, log_level=logging.INFO)


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse("attribute values must be UTF-8 text (ADR-20 metadata is a string map)",
                      errno.EINVAL) from None


# ---------------------------------------------------------------- objects
def object_facts(doc: dict[str, Any], revision: int) -> dict[str, str]:
    options = doc.get("options") or {}
    link = options.get("link") if isinstance(options, dict) else None
    facts = {
        "digest": str(doc.get("digest") or ""),
        "nuid": str(doc.get("nuid") or ""),
        "size": str(doc.get("size") or 0),
        "chunks": str(doc.get("chunks") or 0),
        "chunk_size": str((options.get("max_chunk_size") if isinstance(options, dict) else 0) or ""),
        "revision": str(revision),
        "bucket": str(doc.get("bucket") or ""),
        "name": str(doc.get("name") or ""),
        "link": json.dumps(link, separators=(",", ":")) if link else "",
    }
    return {k: v for k, v in facts.items() if v}


def attribute_name(name: str) -> bytes | None:
    """`name` as the kernel takes an attribute name (UTF-8, no NUL, at most `XATTR_NAME_MAX` bytes), or
    None when it cannot be one: the kernel rejects a whole list that holds such a name."""
    if "\0" in name:
        return None
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape
        return None
    return raw if len(raw) <= XATTR_NAME_MAX else None


def list_object(doc: dict[str, Any], revision: int, left_out: Callable[[str], None] | None = None) -> list[bytes]:
    """The attribute names of an object. Keys that make no usable name are left out; `left_out` is told
    of each name (its repr, cut short)."""
    # A metadata key `nats.x` would list as `user.nats.x`, a name that reads natsfs's own facts instead.
    # An empty key would list as `user.`, a name local filesystems refuse (EINVAL): a copy would fail.
    names = [(USER + k, bool(k) and not k.startswith(NS[len(USER):])) for k in sorted(_metadata(doc))
             if not k.startswith(OWN_PREFIX)]
    if _description(doc):
        names.append((DESCRIPTION, True))
    names += [(HEADER + h, True) for h in sorted(_headers(doc))]
    out = []
    for name, addressable in names:
        raw = attribute_name(name)
        if raw is None or not addressable:
            if left_out is not None:
                left_out(_short_key(name))
            continue
        out.append(raw)
    return out  # the read-only facts are left out: see the module docstring


def _short_key(name: str) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def get_object(doc: dict[str, Any], revision: int, name: str) -> bytes:
    """An attribute's value. An empty metadata value or header (`""`, null, no values) is an empty
    attribute, as a local disk keeps `setfattr -v ""`: it is listed, so it must read. An empty
    description is no description (nats.go omits it)."""
    value: str | None
    if name == DESCRIPTION:
        value = _description(doc) or None
    elif name.startswith(HEADER):
        values = _headers(doc).get(name[len(HEADER):])
        value = "\n".join(values) if values is not None else None
    elif name.startswith(NS):
        value = object_facts(doc, revision).get(name[len(NS):])
    elif name.startswith(USER):
        key = name[len(USER):]
        value = None if key.startswith(OWN_PREFIX) else _metadata(doc).get(key)
    else:
        value = None
    if value is None:
        raise NoAttribute(name)
    return value.encode()


def _description(doc: dict[str, Any]) -> str:
    # (One of another JSON type is ignored, as `natsfs.adr20.parse_meta` does: never turned into text.)
    description = doc.get("description")
    return description if isinstance(description, str) else ""


def set_object(doc: dict[str, Any], name: str, value: bytes | None, flags: int = 0) -> None:
    """Apply a setxattr (value) or removexattr (None) to a meta document, in place."""
    exists = _exists(doc, name)
    if value is not None and flags & XATTR_CREATE and exists:
        raise _refuse(f"{name} exists", errno.EEXIST)
    if (value is None or flags & XATTR_REPLACE) and not exists:
        raise NoAttribute(name)
    if name == DESCRIPTION:
        if value is None or not value:
            doc.pop("description", None)
        else:
            doc["description"] = _text(value)
    elif name.startswith(HEADER):
        header = name[len(HEADER):]
        if not header:
            raise _refuse("empty header name", errno.EINVAL)
        headers = dict(_headers(doc))
        if value is None:
            headers.pop(header, None)
        else:
            headers[header] = _text(value).split("\n")
        _put(doc, "headers", headers)
    elif name.startswith(NS) or name.startswith(USER + OWN_PREFIX):
        raise _refuse(f"{name} is read-only", errno.EPERM)
    elif name.startswith(USER):
        key = name[len(USER):]
        if not key:
            raise _refuse("empty attribute name", errno.EINVAL)
        metadata = dict(_metadata(doc))
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = _text(value)
        _put(doc, "metadata", metadata)
    else:
        raise _refuse(f"only user.* attributes are supported ({name})", errno.EOPNOTSUPP)


def _exists(doc: dict[str, Any], name: str) -> bool:
    try:
        get_object(doc, 0, name)
    except NoAttribute:
        return False
    return True


def _metadata(doc: dict[str, Any]) -> dict[str, str]:
    m = doc.get("metadata")
    # (A null value is the empty string, as nats.go reads it. A value of another type is an entry the
    # mount ignores, as `natsfs.adr20.parse_meta` does: not shown, never turned into text.)
    if not isinstance(m, dict):
        return {}
    return {str(k): "" if v is None else v for k, v in m.items() if v is None or isinstance(v, str)}


def _headers(doc: dict[str, Any]) -> dict[str, list[str]]:
    h = doc.get("headers")
    if not isinstance(h, dict):
        return {}
    # (Null values and list items are empty, as nats.go reads them. An entry that is not a list of
    # strings is ignored, as for metadata.)
    return {str(k): [] if v is None else ["" if x is None else x for x in v] for k, v in h.items()
            if v is None or (isinstance(v, list) and all(x is None or isinstance(x, str) for x in v))}


def _put(doc: dict[str, Any], key: str, value: dict[str, Any]) -> None:
    if value:
        doc[key] = value
    else:
        doc.pop(key, None)


# ---------------------------------------------------------------- buckets
def bucket_facts(config: dict[str, Any], size: int, messages: int) -> dict[str, str]:
    return {
        "size": str(size),
        "messages": str(messages),
        "max_bytes": str(config.get("max_bytes", -1)),
        "storage": str(config.get("storage", "file")),
        "replicas": str(config.get("num_replicas", 1)),
        "sealed": "true" if config.get("sealed") else "false",
        "compression": str(config.get("compression") or "none"),
        "ttl": str(int(config.get("max_age", 0)) // 10**9) + "s",
    }


def list_bucket(config: dict[str, Any], size: int, messages: int) -> list[bytes]:
    meta = config.get("metadata")
    keys = sorted(k for k in meta if not k.startswith("_nats")) if isinstance(meta, dict) else []
    # (Keys that make no usable attribute name are left out, as for objects.)
    names = [USER + k for k in keys if k and attribute_name(USER + k) is not None and not (USER + k).startswith(NS)]
    if config.get("description"):
        names.append(DESCRIPTION)
    return [n.encode() for n in names]


def get_bucket(config: dict[str, Any], size: int, messages: int, name: str) -> bytes:
    value: Any = None
    if name == DESCRIPTION:
        value = config.get("description")
    elif name.startswith(NS + "bucket."):
        value = bucket_facts(config, size, messages).get(name[len(NS + "bucket."):])
    elif name.startswith(USER) and not name.startswith(NS):
        key = name[len(USER):]
        value = None if key.startswith("_nats") else (config.get("metadata") or {}).get(key)
    if value is None or (value == "" and name == DESCRIPTION):
        raise NoAttribute(name)
    return str(value).encode()


def set_bucket(config: dict[str, Any], name: str, value: bytes | None, flags: int = 0) -> None:
    exists = True
    try:
        get_bucket(config, 0, 0, name)
    except NoAttribute:
        exists = False
    if value is not None and flags & XATTR_CREATE and exists:
        raise _refuse(f"{name} exists", errno.EEXIST)
    if (value is None or flags & XATTR_REPLACE) and not exists:
        raise NoAttribute(name)
    if name == DESCRIPTION:
        if value:
            config["description"] = _text(value)
        else:
            config.pop("description", None)
    elif name.startswith(NS):
        raise _refuse(f"{name} is read-only", errno.EPERM)
    elif name.startswith(USER):
        key = name[len(USER):]
        if not key or key.startswith("_nats"):
            raise _refuse(f"cannot set {name}", errno.EPERM)
        metadata = dict(config.get("metadata") or {})
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = _text(value)
        config["metadata"] = metadata
    else:
        raise _refuse(f"only user.* attributes are supported ({name})", errno.EOPNOTSUPP)
