"""The daemon's side of the upload worker: a child process that publishes chunks from spool files.

Bulk publishing is the costliest work of the daemon, and in-process it competes with FUSE requests
for the GIL. `UploadWorker` starts `python -I -m natsfs.bridge upload-worker` (its own NATS
connection) and hands it byte ranges of spool files to send as chunks of a put session; the worker
hashes what it sends, so the digest of a session is asked of it too. Requests are JSON lines over
pipes (trio). If the worker is gone, callers fall back to publishing in-process (`alive` is False).
A put given up is dropped (`drop`) before its chunks are purged: the worker answers only once nothing
more of it can be published, and while it has not answered, the put is not settled (see `drop`).

A worker that dies (a crash, `kill -9`, the OOM killer) is reaped at once, said at WARNING, and a new
one started (`retry.Restarts`: a worker that dies at once every time is started less and less often,
and after a few in a row that is said once at ERROR; puts are published in-process meanwhile). One that
ends because it could reach no server (`bridge.WORKER_FOUND_NO_SERVER`: started while the server is away
or refuses the credentials) is started again the same way, said at DEBUG only: the daemon's own
connection reports that outage. Requests
it had not answered fail with `Unavailable`, and their callers send those files again in-process in a
new put session (the old one's chunks are purged). A put session stays with the worker process it began
on, which holds its hash: after a restart, what is left of it is refused (`Unavailable`) too.

A publish the server refuses the worker's NATS user (a permissions violation) is no failure of the
worker: it comes back as `NotPermitted`, not sent again in-process, and is logged here (`bridge.refusal`,
once per kind, as the daemon's own refusals; the worker's stderr is not the daemon's log).

A worker that stops answering (stopped by SIGSTOP, stuck in a system call) is treated as dead: while
requests wait for it, it is asked a `ping` every `PING_EVERY` seconds, which its event loop answers at
once even while it sends a large range; when nothing at all has come back from it for `HUNG_AFTER`
seconds (`retry.Silence`) it is killed (SIGKILL), said once at WARNING (it did not answer: not that the
server is slow), and replaced as above, its requests failing with `Unavailable`.

The worker runs isolated (`-I`: neither the working directory nor `$PYTHON*` variables shape its
imports), inherits no descriptors but its pipes and no `$NATS_URL`, and gets the server URLs (which
may carry credentials) and the credentials (`auth.Connection` as JSON) as the first line on its stdin,
never on its command line: the password and token as their files hold them at its start, with the
files' paths, so the worker reads them again when it connects anew (`Connection.refreshed`).
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
from .bridge import WORKER_FOUND_NO_SERVER, refusal
from .errors import JetStreamAPIError, OutcomeUnknown, Unavailable
from .jetstream import map_publish_error
from .retry import Restarts, Silence, describe_exit
from .secrecy import child_environment

log = logging.getLogger(__name__)

# A worker that answers nothing (not even a ping) for this many seconds while requests wait for it is hung:
# it is killed and replaced. Its event loop answers a ping within milliseconds, busy or not.
HUNG_AFTER = 5.0
# While requests wait for the worker, it is pinged this often (so a busy worker keeps answering something).
PING_EVERY = 1.0
# At an unmount the worker gets this long to exit once its stdin is closed (then it is killed).
EXIT_GRACE_S = 3.0


class _Child:
    """One started worker process and the requests waiting for its replies."""

    def __init__(self, proc: trio.Process, generation: int, hung_after: float):
        self.proc = proc
        self.generation = generation
        self.alive = True
        self.waiting: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self.send_lock = trio.Lock()
        self.silence = Silence(hung_after)  # of the requests in `waiting`: answered by any reply
        self.asked = trio.Event()  # a request was made (wakes the watchdog of an idle worker)
        self.hung = False  # killed because it did not answer (said so instead of its death)


class UploadWorker:
    def __init__(self, connection: Connection, restarts: Restarts | None = None, *,
                 hung_after: float = HUNG_AFTER, ping_every: float = PING_EVERY):
        self.connection = connection
        self.restarts = restarts or Restarts()
        self.hung_after = hung_after
        self.ping_every = ping_every
        self.generation = 0  # of the worker process running now (each start is a new one)
        self._child: _Child | None = None
        self._closing = False
        self._next = 0
        # The worker process each put session began on: its hash is there, so a session never moves
        # to a restarted worker (whose digest of it would be of the later ranges only).
        self._sessions: dict[str, int] = {}

    @property
    def alive(self) -> bool:
        return self._child is not None and self._child.alive and not self._closing

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the worker, and keep one running: one that dies is reaped and started again."""
        self._child = await self._spawn()
        nursery.start_soon(self._supervise, self._child)

    async def _spawn(self) -> _Child | None:
        """A new worker process (isolated, see the module docstring), or None (said at WARNING)."""
        try:
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-I", "-m", "natsfs.bridge", "upload-worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=child_environment())
        except OSError as e:
            if not self.restarts.failing:
                log.warning("upload worker not started (%s); publishing in-process", e)
            return None
        try:
            affinity.next_cpu(proc.pid)  # it hashes beside the daemon, not on its CPU
            assert proc.stdin is not None
            # The secrets as their files hold them now (the worker reads them again at each connect of
            # its own; should a file be unreadable then, it has the last good one).
            self.connection = await trio.to_thread.run_sync(self.connection.refreshed)
            await proc.stdin.send_all(self.connection.to_json().encode() + b"\n")
        except (OSError, trio.BrokenResourceError):
            pass  # it died at once: its exit is reported like any other death
        self.generation += 1
        self.restarts.started()
        return _Child(proc, self.generation, self.hung_after)

    async def _supervise(self, child: _Child | None) -> None:
        """Serve the worker's replies; when it dies, reap it at once, fail what waited for it (the callers
        send those files in-process), and start a new one after `restarts` says how long to pause."""
        while True:
            if child is not None:
                async with trio.open_nursery() as this_child:
                    this_child.start_soon(self._watch, child, this_child)
                    await self._read_replies(child)
                    this_child.cancel_scope.cancel()
                status = await child.proc.wait()  # reaped: no zombie
                if self._closing:
                    return
            if child is not None and not child.hung and status == WORKER_FOUND_NO_SERVER:
                # The server is away (or refuses our credentials): the daemon's connection says so once;
                # a line per worker start meanwhile would only repeat it as deaths and "failures".
                pause = self.restarts.no_server()
                log.debug("upload worker (pid %d) found no NATS server; starting a new one in %g s",
                          child.proc.pid, pause)
            else:
                pause = self._said_dead(child, status if child is not None else None)
            await trio.sleep(pause)
            if self._closing:
                return
            child = self._child = await self._spawn()

    def _said_dead(self, child: _Child | None, status: int | None) -> float:
        """Log a worker's death (or a start that failed: `child` None) as `restarts` sees it; the pause
        before the next start."""
        # (First: a worker that ran long enough ends a streak of failed restarts, and its death is an
        # ordinary one, said at WARNING.)
        pause = self.restarts.died()
        if child is not None:
            if child.hung and not self.restarts.failing:
                log.warning("upload worker (pid %d) did not answer for %g s (stopped, or stuck); killed it, "
                            "starting a new one (puts it was sending are sent again in-process)",
                            child.proc.pid, self.hung_after)
            elif self.restarts.failing:
                log.debug("upload worker (pid %d) %s (%s)", child.proc.pid,
                          "did not answer" if child.hung else "died", describe_exit(status))
            else:
                log.warning("upload worker (pid %d) died (%s); starting a new one (puts it was sending "
                            "are sent again in-process)", child.proc.pid, describe_exit(status))
        if self.restarts.newly_failing():
            log.error("upload worker failed %d times in a row; publishing in-process, trying again "
                      "every %g s at most", self.restarts.failures, self.restarts.cap)
        return pause

    async def _watch(self, child: _Child, nursery: trio.Nursery) -> None:
        """While requests wait for `child`, ping it every `ping_every` s; kill it when nothing at all came
        back for `hung_after` s (its output then ends, and `_supervise` replaces it). A worker busy sending
        a large range still answers pings: only a stopped or stuck one is killed."""
        while True:
            if not child.silence.waiting:
                child.asked = trio.Event()
                await child.asked.wait()
                continue
            if child.silence.hung:
                child.hung = True
                if child.proc.returncode is None:
                    child.proc.kill()
                nursery.cancel_scope.cancel()  # its output ends only when it exits (later, if it is stuck)
                return
            nursery.start_soon(self._ping, child)  # (its own task: a stuck pipe must not hold the watch)
            await trio.sleep(min(self.ping_every, child.silence.due()))

    async def _ping(self, child: _Child) -> None:
        with contextlib.suppress(Unavailable):
            await self._request(child, {"op": "ping"})

    async def _read_replies(self, child: _Child) -> None:
        assert child.proc.stdout is not None
        buf = b""
        try:
            async for data in child.proc.stdout:
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    reply = json.loads(line)
                    waiter = child.waiting.pop(reply.get("id", -1), None)
                    if waiter is not None:
                        child.silence.answered()
                    if waiter is not None:
                        waiter[1].append(reply)
                        waiter[0].set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as e:
            log.debug("upload worker output unreadable: %s", e)  # (its death is reported by the caller)
            if child.proc.returncode is None:
                child.proc.kill()  # it cannot be talked to: a new one takes over
        finally:
            child.alive = False
            for event, _ in child.waiting.values():
                event.set()  # no reply: the caller raises Unavailable
            child.waiting.clear()

    async def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        child = self._child
        session = body.get("session")
        began_on = None if session is None else self._sessions.get(session)
        if not self.alive or child is None or child.proc.stdin is None:
            raise Unavailable("upload worker is not running")
        if session is not None and began_on is None and body["op"] == "send":
            began_on = self._sessions[session] = child.generation
        if session is not None and began_on != child.generation:
            raise Unavailable("upload worker was restarted since this put began")
        reply = await self._request(child, body)
        error = reply.get("error")
        if error and error.get("kind") == "refused":
            # The server refused the worker a publish for the user's permissions: nothing of it was stored.
            # Logged here, once per kind as the daemon's own refusals are (the worker's stderr is quiet).
            raise refusal(str(error.get("refused", "publish")), str(error.get("subject", "")))
        if error and error.get("kind") in ("unavailable", "outcome_unknown"):
            # The worker's connection was lost or replaced: callers fall back to publishing in-process.
            cls = OutcomeUnknown if error["kind"] == "outcome_unknown" else Unavailable
            raise cls(str(error.get("description", "upload worker failed")))
        if error:
            refused = map_publish_error(JetStreamAPIError(error.get("description", "error"),
                                                          code=int(error.get("code", 0)),
                                                          err_code=int(error.get("err_code", 0))),
                                        body.get("subject", ""))
            if int(error.get("code", 0)) == 503 and isinstance(refused, JetStreamAPIError):
                # No responders, or a JetStream between leaders: the worker cannot tell a missing stream
                # from one between leaders; the caller sends the file again in-process, where that is
                # told apart (JetStreams.publish_many). A definite refusal that also comes with code 503
                # (the stream's limits: "maximum bytes exceeded", err_code 10077) is raised as such: sent
                # again it would only be refused again, after sending the whole file a second time.
                raise Unavailable(f"upload worker: {error.get('description', 'no responders')}")
            raise refused
        return reply

    async def _request(self, child: _Child, body: dict[str, Any]) -> dict[str, Any]:
        """Send `body` to `child` and wait for its reply (`Unavailable` when it is gone first)."""
        if not child.alive or child.proc.stdin is None:
            raise Unavailable("upload worker is not running")
        self._next += 1
        rid = body["id"] = self._next
        event, box = trio.Event(), list[dict[str, Any]]()
        child.waiting[rid] = (event, box)
        child.silence.asked()
        child.asked.set()
        try:
            try:
                async with child.send_lock:
                    await child.proc.stdin.send_all(json.dumps(body).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise Unavailable("upload worker is gone") from None
            await event.wait()
        finally:
            if child.waiting.pop(rid, None) is not None:  # not answered (cancelled, or it is gone)
                child.silence.withdrawn()
        if not box:
            raise Unavailable("upload worker is gone")
        return box[0]

    async def send_range(self, session: str, subject: str, path: str, start: int, end: int, chunk_size: int,
                         window: int) -> None:
        await self._call({"op": "send", "session": session, "subject": subject, "path": path, "start": start,
                          "end": end, "chunk_size": chunk_size, "window": window})

    async def digest(self, session: str) -> bytes:
        return bytes.fromhex((await self._call({"op": "digest", "session": session}))["digest"])

    async def drop(self, session: str) -> bool:
        """Tell the worker to give `session` up. True once nothing more of it can be published: the worker
        answered that its ranges of it stopped (and what they sent was answered), or the worker process
        it began on is gone (reaped), or it never had it. False while that is not known (no answer yet:
        the caller's deadline passed, or the worker is dying): ask again later (a drop is idempotent)."""
        began_on = self._sessions.get(session)
        if began_on is None:
            return True
        child = self._child
        if child is None or child.generation != began_on or child.proc.returncode is not None:
            del self._sessions[session]  # (its process was reaped before another was started)
            return True
        try:
            reply = await self._request(child, {"op": "drop", "session": session})
        except Unavailable:
            return False  # dying: once reaped, the next call says True
        if reply.get("error") or not reply.get("quiet"):
            return False  # (not a worker of this version: no promise that it stopped)
        self._sessions.pop(session, None)
        return True

    async def close(self) -> None:
        self._closing = True
        child, self._child = self._child, None
        if child is None:
            return
        proc = child.proc
        with trio.CancelScope(shield=True):
            if proc.stdin is not None:
                await proc.stdin.aclose()
            # It closes its connection within moments (`CLOSE_GRACE_S`, a socket aborted if the server
            # does not read); at an unmount nothing it still holds is needed: killed if it takes longer.
            with trio.move_on_after(EXIT_GRACE_S):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
