"""`natsfs mount` with one request held where an open waits: a launcher for interleaving tests.

Run as `python held_open_daemon.py DIR <natsfs arguments>`. When the file `DIR/hold` exists, the next
`Namespace.resolve` of a path ending in the name it contains (after the path was taken, before the
index is read: where an open of that inode awaits) renames it to `DIR/held` and waits until
`DIR/release` exists. Everything else is the real daemon.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from natsfs.cli import main
from natsfs.namespace import Namespace, Node


def hold_resolves(control: Path) -> None:
    real = Namespace.resolve

    async def resolve(self: Namespace, path: tuple[str, ...]) -> Node:
        hold = control / "hold"
        if path and hold.exists() and path[-1] == hold.read_text():
            hold.rename(control / "held")
            while not (control / "release").exists():
                await trio.sleep(0.005)
        return await real(self, path)

    Namespace.resolve = resolve  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_resolves(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
