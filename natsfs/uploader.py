"""The daemon's side of the upload worker: a child process that publishes chunks from spool files.

Bulk publishing is the costliest work of the daemon, and in-process it competes with FUSE requests
for the GIL. `UploadWorker` starts `python -I -m natsfs.bridge upload-worker` (its own NATS
connection) and hands it byte ranges of spool files to send as chunks of a put session; the worker
hashes what it sends, so the digest of a session is asked of it too. Requests are JSON lines over
pipes (trio). If the worker is gone, callers fall back to publishing in-process (`alive` is False).

The worker runs isolated (`-I`: neither the working directory nor `$PYTHON*` variables shape its
imports), inherits no descriptors but its pipes and no `$NATS_URL`, and gets the server URLs (which
may carry credentials) and the credentials (`auth.Connection` as JSON) as the first line on its stdin,
never on its command line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from typing import Any

import trio

from . import affinity
from .auth import Connection
from .errors import JetStreamAPIError, NatsFSError, OutcomeUnknown, Unavailable
from .jetstream import map_publish_error
from .secrecy import child_environment

log = logging.getLogger(__name__)


class UploadWorker:
    def __init__(self, connection: Connection):
        self.connection = connection
        self.alive = False
        self._proc: trio.Process | None = None
        self._next = 0
        self._waiting: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._send_lock = trio.Lock()

    async def start(self, nursery: trio.Nursery) -> None:
        try:
            self._proc = await trio.lowlevel.open_process(
                [sys.executable, "-I", "-m", "natsfs.bridge", "upload-worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=child_environment())
            affinity.next_cpu(self._proc.pid)  # it hashes beside the daemon, not on its CPU
            assert self._proc.stdin is not None
            await self._proc.stdin.send_all(self.connection.to_json().encode() + b"\n")
        except (OSError, trio.BrokenResourceError) as e:
            log.warning("upload worker not started (%s); publishing in-process", e)
            return
        self.alive = True
        nursery.start_soon(self._read_replies)

    async def _read_replies(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        buf = b""
        try:
            async for data in self._proc.stdout:
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    reply = json.loads(line)
                    waiter = self._waiting.pop(reply.get("id", -1), None)
                    if waiter is not None:
                        waiter[1].append(reply)
                        waiter[0].set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as e:
            log.warning("upload worker output unreadable: %s", e)
        finally:
            if self.alive:
                log.warning("upload worker exited; publishing in-process from now on")
            self.alive = False
            for event, _ in self._waiting.values():
                event.set()  # no reply: the caller raises Unavailable
            self._waiting.clear()

    async def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.alive or self._proc is None or self._proc.stdin is None:
            raise Unavailable("upload worker is not running")
        self._next += 1
        rid = body["id"] = self._next
        event, box = trio.Event(), list[dict[str, Any]]()
        self._waiting[rid] = (event, box)
        try:
            async with self._send_lock:
                await self._proc.stdin.send_all(json.dumps(body).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._waiting.pop(rid, None)
            self.alive = False
            raise Unavailable("upload worker is gone") from None
        await event.wait()
        if not box:
            raise Unavailable("upload worker is gone")
        reply = box[0]
        error = reply.get("error")
        if error and error.get("kind") in ("unavailable", "outcome_unknown"):
            # The worker's connection was lost or replaced: callers fall back to publishing in-process.
            cls = OutcomeUnknown if error["kind"] == "outcome_unknown" else Unavailable
            raise cls(str(error.get("description", "upload worker failed")))
        if error and int(error.get("code", 0)) == 503:
            # No responders: the worker cannot tell a missing stream from one between leaders; the
            # caller sends the file again in-process, where that is told apart (JetStreams.publish_many).
            raise Unavailable(f"upload worker: {error.get('description', 'no responders')}")
        if error:
            raise map_publish_error(JetStreamAPIError(error.get("description", "error"), code=int(error.get("code", 0)),
                                                      err_code=int(error.get("err_code", 0))), body.get("subject", ""))
        return reply

    async def send_range(self, session: str, subject: str, path: str, start: int, end: int, chunk_size: int,
                         window: int) -> None:
        await self._call({"op": "send", "session": session, "subject": subject, "path": path, "start": start,
                          "end": end, "chunk_size": chunk_size, "window": window})

    async def digest(self, session: str) -> bytes:
        return bytes.fromhex((await self._call({"op": "digest", "session": session}))["digest"])

    async def drop(self, session: str) -> None:
        with contextlib.suppress(NatsFSError):
            await self._call({"op": "drop", "session": session})

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        self.alive = False
        if proc is None:
            return
        with trio.CancelScope(shield=True):
            if proc.stdin is not None:
                await proc.stdin.aclose()
            with trio.move_on_after(5):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
