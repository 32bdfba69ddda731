"""The rule for object names a filesystem cannot show as-is.

An object name is split on `/` into path segments. It is shown at that path when every segment is
a usable file name: not empty, not `.` or `..`, no NUL, at most 255 bytes of UTF-8. A name ending
in `/` whose object is empty is a directory marker (see docs/SEMANTICS.md) and shows as a directory.

Any other name is shown flat in the bucket's top directory under an escaped name: `%` becomes
`%25`, `/` becomes `%2F`, and a whole name of `.` or `..` becomes `%2E` / `%2E%2E`. If even the
escaped name is unusable (longer than 255 bytes) the object is hidden. Escaped names never contain
`/`, so no name can place a file outside its bucket directory. Collisions are settled by the index.
"""

from __future__ import annotations

NAME_MAX = 255


def segment_ok(segment: str) -> bool:
    if not segment or segment in (".", ".."):
        return False
    if "\x00" in segment or "/" in segment:
        return False
    return len(segment.encode("utf-8", "surrogatepass")) <= NAME_MAX


def escape(name: str) -> str:
    escaped = name.replace("%", "%25").replace("/", "%2F")
    if escaped in (".", ".."):
        escaped = escaped.replace(".", "%2E")
    return escaped.replace("\x00", "%00")


def is_marker_name(name: str) -> bool:
    return name.endswith("/")


def placement(name: str, *, marker_candidate: bool = False) -> tuple[tuple[str, ...] | None, bool]:
    """Where `name` shows: (path segments, escaped?) or (None, False) when it cannot be shown.

    With `marker_candidate` (an empty object whose name ends in `/`), the path is the directory's.
    """
    if marker_candidate and name.endswith("/"):
        parts = name[:-1].split("/")
        if all(segment_ok(p) for p in parts):
            return tuple(parts), False
    parts = name.split("/")
    if all(segment_ok(p) for p in parts):
        return tuple(parts), False
    escaped = escape(name)
    if segment_ok(escaped):
        return (escaped,), True
    return None, False


def object_name(path: tuple[str, ...]) -> str:
    """The object name a (non-escaped) path stands for."""
    return "/".join(path)
