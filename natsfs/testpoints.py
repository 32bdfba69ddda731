"""Named pause points for crash tests (`tests/mount/test_writeback_crashfuzz.py`), so that a `kill -9`
lands in a window a few microseconds wide (between an unlink's tombstone and its journal record, between
a rename's two publishes, ...).

Started with `NATSFS_TEST_PAUSE_AT=<point>[:<n>]` in its environment, the daemon lets `n` (default 0)
passes through that point go by, then stops the task at the next one for good (the other tasks go on),
after writing the point's name to the file `NATSFS_TEST_PAUSE_FILE` names: the test kills it then. Without
that variable (every real mount) `ACTIVE` is False, and each call site costs one attribute test:
`if testpoints.ACTIVE: await testpoints.pause("...")`.
"""

from __future__ import annotations

import os

import trio

# Every point a call site names (a name not listed here is a mistake in the test).
POINTS = (
    "unlink.deleted",  # an unlink's tombstone stored, before the journal closes the unlinked pending file
    "rename.stored",  # a rename stored in the bucket, before its pending files' records follow it
    "rename.between_publishes",  # the meta under the new name stored, the old name's claim not yet
    "delete.before_purge",  # a tombstone stored, the deleted version's chunks not purged yet
    "put.before_purge",  # a put's meta stored, the replaced version's chunks not purged yet
    "upload.stored",  # a write-back upload stored, before its journal record is closed
)

_SPEC = os.environ.get("NATSFS_TEST_PAUSE_AT", "")
ACTIVE = bool(_SPEC)
_POINT, _, _SKIP = _SPEC.partition(":")
if ACTIVE and _POINT not in POINTS:
    raise SystemExit(f"NATSFS_TEST_PAUSE_AT: no point {_POINT!r} (known: {', '.join(POINTS)})")
_left = int(_SKIP or 0)


async def pause(point: str) -> None:
    """Stop here for good when this is the point (and pass) the environment names; else return."""
    global _left
    if point != _POINT or _left < 0:
        return
    if _left > 0:
        _left -= 1
        return
    _left = -1  # (once)
    marker = os.environ.get("NATSFS_TEST_PAUSE_FILE")
    if marker:
        with open(marker, "w") as f:
            f.write(point)
    await trio.sleep_forever()
