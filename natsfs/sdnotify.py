"""Telling systemd how a `Type=notify` service is doing: READY=1, STOPPING=1, STATUS=... (sd_notify(3)).

One datagram to the unix socket named by `$NOTIFY_SOCKET` (an `@` name is in the abstract namespace).
Without `$NOTIFY_SOCKET` (not under systemd) nothing happens; a failed send is logged at DEBUG and
never stops the mount.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*fields: str) -> None:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError as e:
        log.debug("cannot notify systemd at %s: %s", address, e)
