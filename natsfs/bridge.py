"""The one place asyncio and nats-py live: an asyncio loop on its own thread, and trio-flavoured calls.

nats-py only runs on asyncio while the daemon is trio (pyfuse3). `Bridge` starts a daemon thread
running an asyncio loop, connects nats-py there, and offers `async` methods that trio code awaits.
Each call schedules a coroutine on the loop and parks the trio task until it finishes; when trio
cancels the waiting task, the asyncio task is cancelled too. Messages for subscriptions are queued
on the asyncio side and handed to trio in batches, so a burst of messages costs one wakeup.

The connection stays up by being replaced (`_Link`): nats-py runs without its own reconnect, and when
its client is lost for any reason (a server restart, a slow-consumer kick, any `-ERR`, after which
nats-py closes the client for good), a new client is made, with a fresh reply inbox, and every
subscription is restored on it. Requests in flight on the lost client fail at once: `OutcomeUnknown`
for a publish whose acknowledgement did not come, `Unavailable` otherwise; replies addressed to an
earlier client are dropped, so none can complete a request of a later one.

A permissions violation is not a loss: the server refused one message (`-ERR 'Permissions Violation for
Publish to "<subject>"'`) and keeps the connection, and so do nats-py (its error callback) and the lean
connection (`wire`'s `on_refused`). The request waiting on that subject fails at once with `NotPermitted`
(`_Link.refused`): the oldest one, as requests are sent in order and the server answers them in order.
One line is logged per kind of refusal (`refusal`), not one per message.

Replies of batched direct gets are bounded by a byte budget (`REPLY_BUDGET`): the server drops a
client whose unread bytes pass its `max_pending`, so the bytes asked for and not yet taken by trio
must stay well under it; the first kick by a server with a smaller one drops the budget to its floor
(a lean connection lost alone is a kick only if its server takes it again: a cluster node that died
leaves the budget as it was).
They travel over a second connection, the lean one of `natsfs.wire`
(payloads received straight into their own buffers, replies handed to their waiters as they are
parsed), when the servers and credentials allow it, and over the main link otherwise (and while the
lean one is being replaced, within a small budget of their own: the main link must never be dropped). The trio thread
drives that connection itself (`_TrioReads`, TLS included): a read's request and its replies cross no
thread, which took 0.1-0.13 ms off each request's round trip on the test machine
(random 4 KiB reads 0.77-0.83 -> 0.61-0.71 ms p50) and 5-10 % off the daemon's CPU per MiB of a cold
read. A `_Link` on the asyncio thread drives it instead where the trio one cannot be made (or with
`trio_reads=False`).
The trio thread's lean connection also takes the deliveries of one-shot headers-only pull consumers
(the chunk-size scans of `JetStreams.subject_index`: `Bridge.open_deliveries`, `Deliveries`), off the
main connection and without a message object per delivery; their pull requests go from it too. What
they mean, and how much the requests ask for, is `jetstream`'s to decide: they hold no reply budget
(each scan asks for at most 512 KiB at a time, whatever the reader does), and a loss with only
deliveries in flight is no kick.

Nothing outside this module (and `natsfs.wire`, which only it imports) imports asyncio or nats; nats
exceptions become `natsfs.errors`, and nats-py internals are reached only through `natsfs.natscompat`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import trio

from . import memory, natscompat, wire
from .auth import CLIENT_CERT_WANTED, NO_TLS, Connection, client_cert_missing, tls_wanted
from .errors import JetStreamAPIError, NatsFSError, NoConnection, NotFound, NotPermitted, OutcomeUnknown, Unavailable
from .futures import wait_future
from .retry import Backoff
from .secrecy import redact_url

log = logging.getLogger(__name__)
T = TypeVar("T")

# One pending flush of publishes may hold this many bytes before nats-py flushes it itself.
_PENDING_SIZE = 8 * 1024 * 1024
# A paced subscription (a watch loading a huge bucket) may hold this many messages not yet taken by
# trio before the connection stops reading for a moment (at most _PACE_WAIT s at a time): the rest
# waits in the socket and on the server, instead of as Python objects that fragment the heap.
_PACE_HIGH = 1000
_PACE_WAIT = 0.05
# Bytes of direct-get replies asked for and not yet taken by trio, across all requests on one
# connection. The server drops a client as a slow consumer when more than its `max_pending` (64 MiB by
# default) waits unread for it; when the daemon's threads are busy, everything asked for can be
# waiting, so this stays at half of that default. Each request reserves its `max_bytes` plus one
# reply (the server may pass `max_bytes` by one message), and asks for no more than it reserved.
REPLY_BUDGET = 32 * 1024 * 1024
# The most one batched direct get may ask for, so several readers share the budget.
MAX_BATCH_BYTES = 8 * 1024 * 1024
# `max_pending` is not in the server's INFO, so a smaller one is learnt from a kick: the lean connection
# lost with replies in flight while the main one stays drops the budget to this floor (halving took five
# kicks from 32 MiB down to a 1 MB `max_pending`). That loss is taken for a kick once the same server
# takes the lean connection again (its next attempt goes there): a server that cannot be reached went
# away (a cluster node, with the main connection on another; one server going away ends both), and
# the budget stays. The floor is
# one 128 KiB request plus one more reply (a few hundred bytes of headers and protocol lines on top),
# so it holds under a `max_pending` of 512 KB. The budget doubles back after a quiet while, never again
# past half of what it was when the kick came.
MIN_REPLY_BUDGET = 256 * 1024
_BUDGET_REGROW_S = 600.0
# A lean-connection loss followed this soon by the main connection's was the server going away, not a
# kick: the budget shrunk for it (the server took the lean connection back before it went) is given back.
_SHRINK_UNDO_S = 5.0
# How the server's -ERR for a control line over its `max_control_line` reads, as nats-py reports it.
CONTROL_LINE_EXCEEDED = "maximum control line exceeded"
# A subject shorter than this cannot be what a server's max_control_line refused (it would refuse the
# mount's every request): a loss for that reason with no request in flight longer teaches nothing.
_SHORTEST_SUBJECT_LEARNED = 256
# While the lean connection is being replaced, batched direct gets go over the main connection, which
# carries the watchers and publishes: read traffic must never get it dropped, so replies in flight there
# have a budget of their own that is always the floor (the lean connection is back within moments).
FALLBACK_REPLY_BUDGET = MIN_REPLY_BUDGET
# Reconnect attempts back off from the first to the second value (seconds).
_RECONNECT_WAIT = (0.05, 2.0)
# A connection that sent nothing for this long is probed; two unanswered probes end it.
_PING_INTERVAL = 30
# How often the current client is checked for having been closed without telling (see `_Link._watch`).
_WATCH_INTERVAL = 0.25
_CHUNK_GUESS = 128 * 1024  # the largest reply assumed before one is seen
# A replaced nats-py client gets this long to finish closing by itself before `_Link._bury` ends the rest.
_BURY_GRACE = 2.0
# Closing the mount's connections at unmount waits this long for the server to take what is still queued
# for it; a server that does not read (stopped, gone without a reset) gets its socket aborted then.
CLOSE_GRACE_S = 1.0


# Kinds of permission refusals logged so far (see `refusal`), for the whole process.
_refusals_logged: set[tuple[str, str]] = set()
_refusals_lock = threading.Lock()


def refusal(kind: str, subject: str) -> NotPermitted:
    """The error for a message (or subscription) the server refused for the user's permissions; the first
    refusal of each kind is logged (a warning naming the subject), later ones are not: a read-only user's
    every write, or every read without direct-get permission, would otherwise flood the log. A kind is
    the operation and the subject's first four tokens (`$JS.API.DIRECT.GET`, `$JS.API.STREAM.MSG`, ...),
    case-folded (nats-py hands the server's text on in lower case); an object store subject's kind is its
    first three (`$O.<bucket>.C`, `$O.<bucket>.M`: the fourth is a chunk's nuid or an object's name)."""
    tokens = subject.lower().split(".")
    key = (kind, ".".join(tokens[:3] if tokens[0] == "$o" else tokens[:4]))
    with _refusals_lock:
        first = key not in _refusals_logged
        _refusals_logged.add(key)
    verb = "publish to" if kind == "publish" else "subscribe to"
    message = f"permission denied: the NATS server does not let this user {verb} {subject}"
    if first:
        log.warning("%s (further refusals of the same kind are not logged)", message)
    return NotPermitted(message, kind=kind, subject=subject)


@dataclass(slots=True)
class Msg:
    """A message as the layers above see it: no nats-py types leak out of the bridge."""

    subject: str
    reply: str
    headers: dict[str, str] | None
    data: bytes | bytearray

    @property
    def status(self) -> str | None:
        return self.headers.get("Status") if self.headers else None


def _convert(m: Any) -> Msg:
    return Msg(m.subject, m.reply or "", dict(m.headers) if m.headers else None, m.data or b"")


def _ends_batch(msg: Msg) -> bool:
    return msg.status is not None and not msg.data


def _gather(msgs: list[Msg], msg: Msg) -> bool:
    """Add a reply of a batched request to `msgs`; True when it ends the batch: 204 EOB ends it (and is
    dropped), 404/408/other statuses end it too (kept for the caller)."""
    if _ends_batch(msg):
        if msg.status != "204":
            msgs.append(msg)
        return True
    msgs.append(msg)
    return False


# ---------------------------------------------------------------------------------------------- the link
class _Reply:
    """The one reply of a request or publish on the reply inbox (asyncio side)."""

    __slots__ = ("ack", "fut", "subject")

    def __init__(self, subject: str, ack: bool):
        self.subject = subject
        self.ack = ack  # a publish into a stream: losing its ack leaves the outcome unknown
        self.fut: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    def deliver(self, msg: Msg) -> bool:
        if not self.fut.done():
            self.fut.set_result(msg)
        return True

    def fail(self, reason: str) -> None:
        if self.fut.done():
            return
        if self.ack:
            self.fut.set_exception(OutcomeUnknown(
                f"publish to {self.subject}: connection to NATS lost before the acknowledgement ({reason})"))
        else:
            self.fut.set_exception(Unavailable(f"request on {self.subject}: connection to NATS lost ({reason})"))

    def refuse(self, error: NotPermitted) -> None:
        """The server refused the message for the user's permissions: nothing of it was stored."""
        if not self.fut.done():
            self.fut.set_exception(error)

    def settle(self) -> None:
        """Mark a failure nobody waits for any more as seen (asyncio would log it otherwise)."""
        if self.fut.done() and not self.fut.cancelled():
            self.fut.exception()
        else:
            self.fut.cancel()


class _Collector:
    """Gathers the replies of one multi-message request until its end-of-batch status."""

    __slots__ = ("done", "msgs", "subject")

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.msgs: list[Msg] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def deliver(self, msg: Msg) -> bool:
        if self.done.done():
            return True
        if _gather(self.msgs, msg):
            self.done.set_result(None)
            return True
        return False

    def fail(self, reason: str) -> None:
        if not self.done.done():
            self.done.set_exception(Unavailable(f"request on {self.subject}: connection to NATS lost ({reason})"))

    def refuse(self, error: NotPermitted) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    def settle(self) -> None:
        if self.done.done() and not self.done.cancelled():
            self.done.exception()
        else:
            self.done.cancel()


class _Link:
    """The asyncio side of one logical connection: one nats-py client at a time, replaced by a new
    one when it is lost, and one reply inbox per client on which all requests get their replies."""

    def __init__(self, servers: Sequence[str], *, name: str, connect_timeout: float,
                 auth: Connection | None = None,
                 on_lost: Callable[[str], None] = lambda reason: None,
                 on_restored: Callable[[], None] = lambda: None,
                 restore: Callable[[Any], Awaitable[None]] | None = None,
                 after_msg: Callable[[int, bytes, int], Awaitable[None] | None] | None = None,
                 unclaimed_refusal: Callable[[str, str], bool] = lambda kind, subject: False,
                 quiet: bool = False, lean: bool = False):
        self.servers = list(servers)
        self.name = name
        self.connect_timeout = connect_timeout
        self.auth = auth
        self._on_lost = on_lost
        self._on_restored = on_restored
        self._restore = restore
        self._after_msg = after_msg
        self._unclaimed_refusal = unclaimed_refusal
        self._log_level = logging.DEBUG if quiet else logging.WARNING
        # Lean: the client is a `wire.WireConnection` (requests and their replies only), not nats-py.
        self.lean = lean
        self.nc: Any = None
        self.prefix = ""  # the current client's reply inbox; replies to any other are dropped
        self.generation = 0  # counts clients: work pinned to one fails once it is replaced
        # While there is no client: when it was lost, and whether a request has waited its whole timeout
        # for the next one in vain since (the `generation` of that outage; see `client`).
        self._lost_at = 0.0
        self._waited_in_vain: int | None = None
        self.server_info: dict[str, Any] = {}
        self.waiters: dict[str, Any] = {}  # token -> _Reply, _Collector or a request's Subscription
        self._ready: asyncio.Event | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closing = False
        self._next_token = 0
        self._next_server = 0
        # Replaced nats-py clients being ended (`_bury`): kept here until every task of theirs has ended.
        self.burials: set[asyncio.Task[None]] = set()

    # ---- connecting
    async def open(self) -> None:
        """The first connection: each server once; `Unavailable` saying why if none answers."""
        self._ready = asyncio.Event()
        error: Unavailable | None = None
        for server in self.servers:
            try:
                await self._connect(server)
                self._watchdog = asyncio.ensure_future(self._watch())
                return
            except Unavailable as e:
                error = error or e
        raise error or Unavailable("no NATS server given")

    async def _watch(self) -> None:
        """nats-py calls `closed_cb` at the end of closing, which an error on the dead socket can cut
        short (its final flush): a client found closed is taken as lost here too."""
        while not self._closing:
            await asyncio.sleep(_WATCH_INTERVAL)
            # (no local kept across the sleep: it would keep a replaced client alive until the next look)
            if self.nc is not None and self.nc.is_closed:
                self._lost(self.nc)

    async def _connect(self, server: str) -> None:
        if self.auth is not None:  # a password or token file rewritten since is read anew (rotation),
            # off the loop: a file on a stalled network share must not stop the loop's other connections
            self.auth = await asyncio.to_thread(self.auth.refreshed, self._log_level)
        if self.lean:
            await self._connect_lean(server)
            return
        errors: list[BaseException] = []
        client: list[Any] = []

        async def error_cb(e: Exception) -> None:
            # nats-py keeps its client after a permissions violation (and only then calls this without
            # closing it): one message was refused, not the connection lost.
            violation = wire.parse_permission_violation(str(e))
            if violation is not None and client and client[0] is self.nc:
                self.refused(*violation)
                return
            errors.append(e)
            log.debug("nats: %s", e)

        async def closed_cb() -> None:
            if client:
                self._lost(client[0])

        options: dict[str, Any] = {
            "servers": [server], "name": self.name, "connect_timeout": self.connect_timeout,
            # Reconnecting is ours (a new client): nats-py's own would keep the old reply inbox.
            "allow_reconnect": False, "max_reconnect_attempts": 1,
            "error_cb": error_cb, "closed_cb": closed_cb, "pending_size": _PENDING_SIZE,
            "ping_interval": _PING_INTERVAL, "max_outstanding_pings": 2,
            # A publish over `pending_size` waits for the flusher; never forever (see `_lost`).
            "flush_timeout": self.connect_timeout,
        }
        if self.auth is not None:
            options.update(self.auth.for_server(server).connect_options())
        nc = nats.NATS()
        if tls_wanted(server, self.auth):  # (nats-py itself would send CONNECT in clear to a server without TLS)
            natscompat.require_tls(nc, NO_TLS)
        try:
            await asyncio.wait_for(nc.connect(**options), self.connect_timeout * 2 + 2)
        except (TimeoutError, OSError, nats.errors.Error) as e:
            reason = errors[0] if errors else e
            shown = redact_url(server)
            if client_cert_missing(natscompat.server_info(nc), self.auth):
                raise Unavailable(f"cannot connect to NATS at {shown}: {CLIENT_CERT_WANTED}") from None
            raise Unavailable(f"cannot connect to NATS at {shown}: {str(reason) or type(reason).__name__}") from None
        client.append(nc)
        natscompat.guard_close(nc)
        try:
            prefix = nc.new_inbox()
            await nc.subscribe(prefix + ".*", cb=self._on_reply, pending_bytes_limit=0, pending_msgs_limit=0)
            if self._after_msg is not None:
                natscompat.hook_messages(nc, self._after_msg)
            if self._restore is not None:
                await self._restore(nc)
            if nc.is_closed or self._closing:
                raise nats.errors.ConnectionClosedError
        except BaseException as e:
            with contextlib.suppress(Exception):
                await nc.close()
            self._start_burial(nc)
            if isinstance(e, nats.errors.Error | OSError):
                shown = redact_url(server)
                raise Unavailable(f"connection to NATS at {shown} failed while it was set up: {e}") from None
            raise
        self.nc, self.prefix = nc, prefix
        self.server_info = natscompat.server_info(nc)
        assert self._ready is not None
        self._ready.set()

    async def _connect_lean(self, server: str) -> None:
        try:
            conn = await wire.connect(server, name=self.name, auth=self.auth, timeout=self.connect_timeout,
                                      on_msg=self._on_lean_reply, on_closed=self._lost, on_refused=self.refused)
        except (TimeoutError, OSError, wire.WireError) as e:  # (ssl.SSLError is an OSError)
            raise Unavailable(f"cannot connect to NATS at {redact_url(server)}: {str(e) or type(e).__name__}") from None
        if self._closing:
            await conn.close()
            raise Unavailable("the connection to NATS is closed")
        self.nc, self.prefix = conn, conn.inbox
        self.server_info = conn.server_info
        assert self._ready is not None
        self._ready.set()

    def _lost(self, nc: Any) -> None:
        """A client was closed (by the server, an error, or nats-py): fail its work, make a new one."""
        if nc is not self.nc or self._closing:
            return
        reason = str(nc.last_error or "connection closed")
        self.nc, self.prefix = None, ""
        self.generation += 1
        self._lost_at = time.monotonic()
        assert self._ready is not None
        self._ready.clear()
        log.log(self._log_level, "lost the connection to NATS (%s); reconnecting", reason)
        self._reconnecting = asyncio.ensure_future(self._reconnect(time.monotonic()))
        self._on_lost(reason)  # before the waiters fail: it may look at what was in flight
        if not self.lean:  # (a lean connection has no task of its own; its socket is closed when lost)
            natscompat.release_flushes(nc)
            self._start_burial(nc)
        self._fail_all(reason)

    def _start_burial(self, nc: Any) -> None:
        burial = asyncio.ensure_future(self._bury(nc))
        self.burials.add(burial)
        burial.add_done_callback(self.burials.discard)

    async def _bury(self, nc: Any) -> None:
        """End a replaced nats-py client for good: nats-py's close can stop half-way (its last flush to
        the dead socket fails) and leave its subscriptions' tasks waiting forever, with its socket and
        unsent publishes, until the garbage collector destroys them pending. It gets `_BURY_GRACE` to
        finish by itself; then whatever still runs is cancelled and awaited here."""
        closing = natscompat.closing_task(nc)
        if closing is not None:
            await asyncio.wait([closing], timeout=_BURY_GRACE)
        ended = natscompat.end_client(nc)
        if ended:
            done, pending = await asyncio.wait(ended, timeout=_BURY_GRACE)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: the client is gone, whatever its tasks ended with
            if pending:
                log.debug("%d tasks of a replaced NATS client did not end when cancelled", len(pending))

    def refused(self, kind: str, subject: str) -> None:
        """The server refused a message on `subject` for the user's permissions and kept the connection:
        the oldest request waiting on that subject fails (`NotPermitted`) at once instead of waiting out
        its timeout. Requests leave in order and the server checks them in order, so the oldest is the
        one refused. Subjects are compared case-folded: nats-py lowers the server's text (two requests
        in flight on subjects that differ only in case would be told apart wrongly, never lost)."""
        wanted = subject.lower()
        if kind == "publish":
            for token, waiter in list(self.waiters.items()):  # (a copy: the trio thread may drop entries)
                if waiter.subject.lower() == wanted:
                    self.waiters.pop(token, None)
                    waiter.refuse(refusal(kind, waiter.subject))
                    return
            if self._unclaimed_refusal(kind, subject):  # (a pull request of a consumer's)
                return
        refusal(kind, subject)  # (nothing waits on it: logged, once per kind)

    def _fail_all(self, reason: str) -> None:
        waiters, self.waiters = self.waiters, {}
        for waiter in list(waiters.values()):  # a copy: the trio thread may drop entries meanwhile
            try:
                waiter.fail(reason)
            except Exception:
                log.exception("failing a request after the connection was lost")

    async def _reconnect(self, since: float) -> None:
        backoff = Backoff(*_RECONNECT_WAIT, clock=time.monotonic)
        reported = since
        while not self._closing:
            server = self.servers[self._next_server % len(self.servers)]
            self._next_server += 1
            try:
                await self._connect(server)
            except Exception as e:  # whatever it was, the mount must not stay without a connection
                now = time.monotonic()
                if now - reported >= 60:
                    reported = now
                    log.log(self._log_level, "still no connection to NATS after %.0fs: %s", now - since, e)
                await asyncio.sleep(backoff.next_pause())
                continue
            log.log(min(self._log_level, logging.INFO), "reconnected to NATS at %s after %.1fs", redact_url(server),
                    time.monotonic() - since)  # (the loss was the warning)
            self._on_restored()
            return

    async def client(self, timeout: float) -> Any:
        """The current client; while there is none, waits up to `timeout` for the next one. Once a request
        has waited that long in vain, later ones of the same outage that is older than their own
        `timeout` fail at once (`NoConnection`): one `read(2)` the kernel sends as two requests, or a
        create followed by its close, must not wait a request timeout each for a server that is away."""
        nc = self.nc
        if nc is not None and nc.is_closed:
            self._lost(nc)
            nc = None
        if nc is not None:
            return nc
        if self._closing or self._ready is None:
            raise Unavailable("the connection to NATS is closed")
        away = time.monotonic() - self._lost_at
        if self._waited_in_vain == self.generation and away >= timeout:
            raise NoConnection(f"no connection to NATS (reconnecting for {away:.0f}s)")
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            self._waited_in_vain = self.generation
            raise NoConnection(f"no connection to NATS (reconnecting for {timeout:g}s and more)") from None
        return await self.client(timeout)

    async def close(self) -> None:
        self._closing = True
        for task in (self._reconnecting, self._watchdog):
            if task is not None:
                task.cancel()
        nc, self.nc = self.nc, None
        self._fail_all("closing")
        if nc is not None:
            await self._close_client(nc)
        if self.burials:
            await asyncio.wait(self.burials, timeout=2 * _BURY_GRACE)

    async def _close_client(self, nc: Any) -> None:
        """Close the current client within `CLOSE_GRACE_S` (then twice that at most, whatever the server
        does). Not nats-py's `drain`: every request was failed above, so there is nothing to wait for, and
        a drain cut short leaves a cancelled gather nobody retrieves (asyncio logs it as an ERROR), while
        its own final flush waits 10 s on a server that does not answer."""
        closing = asyncio.ensure_future(nc.close())
        done, _ = await asyncio.wait([closing], timeout=CLOSE_GRACE_S)
        if not done:
            # The server does not take the bytes still queued for it: abort the socket; nats-py's close
            # then ends at once (its wait for the socket to close returns).
            # (A lean connection's close never waits: it only closes its socket.)
            ended = natscompat.end_client(nc) if not self.lean else []
            await asyncio.wait([closing, *ended], timeout=CLOSE_GRACE_S)
            closing.cancel()
            log.debug("closed the connection to NATS: the server took nothing within %g s, its socket was aborted",
                      CLOSE_GRACE_S)
        else:
            log.debug("closed the connection to NATS")
        if closing.done() and not closing.cancelled():
            closing.exception()  # retrieved: the client is gone, whatever its close ended with
        if not self.lean:
            self._start_burial(nc)

    # ---- replies
    def token(self) -> str:
        self._next_token += 1
        return str(self._next_token)

    async def _on_reply(self, m: Any) -> None:
        self._route(m.subject, m)

    def _on_lean_reply(self, subject: str, headers: dict[str, str] | None, data: bytes | bytearray) -> None:
        self._route(subject, Msg(subject, "", headers, data))

    def _route(self, subject: str, m: Any) -> None:
        prefix = self.prefix
        if not prefix or not subject.startswith(prefix) or subject[len(prefix) : len(prefix) + 1] != ".":
            return  # addressed to an earlier client's inbox
        token = subject[len(prefix) + 1 :]
        waiter = self.waiters.get(token)
        if waiter is not None and waiter.deliver(m if isinstance(m, Msg) else _convert(m)):
            self.waiters.pop(token, None)

    async def send(self, subject: str, payload: bytes, headers: dict[str, str] | None, waiter: Any, *,
                   timeout: float, generation: int | None = None) -> str:
        """Publish with a reply to `waiter`; `Unavailable` if it certainly was not sent (no client, or a
        different one than `generation`). Returns the token the caller removes when done."""
        nc = await self.client(timeout)
        if generation is not None and generation != self.generation:
            raise Unavailable(f"{subject}: not sent, the connection to NATS was replaced meanwhile")
        token = self.token()
        self.waiters[token] = waiter
        try:
            await natscompat.publish(nc, subject, payload, reply=f"{self.prefix}.{token}", headers=headers)
        except (nats.errors.Error, wire.WireError) as e:
            self.waiters.pop(token, None)
            raise Unavailable(f"{subject}: not sent ({e})") from None
        return token

    async def reply(self, token: str, waiter: _Reply, timeout: float) -> Msg:
        """Wait for the reply of a `send`; no responders is `NotFound`."""
        try:
            msg = await asyncio.wait_for(waiter.fut, timeout)
        except TimeoutError:
            if waiter.ack:
                raise OutcomeUnknown(f"publish to {waiter.subject} not acknowledged in {timeout:g}s") from None
            raise Unavailable(f"request on {waiter.subject} timed out after {timeout:g}s") from None
        finally:
            self.waiters.pop(token, None)
            waiter.settle()
        if msg.status == "503" and not msg.data:
            raise NotFound(f"no responders on {waiter.subject}")
        return msg

    async def request(self, subject: str, payload: bytes, headers: dict[str, str] | None, timeout: float,
                      *, ack: bool = False, generation: int | None = None) -> Msg:
        waiter = _Reply(subject, ack)
        try:
            token = await self.send(subject, payload, headers, waiter, timeout=timeout, generation=generation)
        except BaseException:
            waiter.settle()
            raise
        return await self.reply(token, waiter, timeout)

    async def js_publish(self, subject: str, payload: bytes, headers: dict[str, str] | None, timeout: float,
                         generation: int | None = None) -> dict[str, Any]:
        m = await self.request(subject, payload, headers, timeout, ack=True, generation=generation)
        return _parse_ack(m, subject)

    async def js_publish_many(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]], window: int,
                              timeout: float) -> list[dict[str, Any] | NatsFSError]:
        # Like nats.go's PublishAsync: plain publishes, sent in order by this one coroutine, whose acks
        # come back to the reply inbox, at most `window` unacknowledged (the oldest is awaited before
        # the next is sent; usually its ack is there already), all on one client: once it is lost,
        # the rest are not sent.
        await self.client(timeout)
        generation = self.generation
        results: list[dict[str, Any] | NatsFSError] = [Unavailable("not acknowledged")] * len(msgs)
        waiting: collections.deque[tuple[int, str, _Reply]] = collections.deque()

        async def take_oldest() -> None:
            i, token, waiter = waiting.popleft()
            try:
                if waiter.fut.done():
                    self.waiters.pop(token, None)
                    waiter.settle()
                    msg = waiter.fut.result()
                    if msg.status == "503" and not msg.data:
                        raise NotFound(f"no responders on {waiter.subject}")
                else:
                    msg = await self.reply(token, waiter, timeout)
                results[i] = _parse_ack(msg, waiter.subject)
            except NatsFSError as e:
                results[i] = e

        try:
            for i, (subject, data, headers) in enumerate(msgs):
                if len(waiting) >= window:
                    await take_oldest()
                waiter = _Reply(subject, ack=True)
                try:
                    token = await self.send(subject, data, headers, waiter, timeout=timeout, generation=generation)
                except NatsFSError as e:
                    waiter.settle()
                    results[i] = e
                    continue
                waiting.append((i, token, waiter))
            while waiting:
                await take_oldest()
        finally:
            for _, token, waiter in waiting:  # cancelled: nobody waits for these acks any more
                self.waiters.pop(token, None)
                waiter.settle()
        return results


class _TrioCollector:
    """`_Collector` for `_TrioReads`: the replies of one batched request, gathered in trio."""

    __slots__ = ("done", "error", "msgs", "subject")

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.msgs: list[Msg] = []
        self.done = trio.Event()
        self.error: Unavailable | NotPermitted | None = None

    def deliver_in_trio(self, msg: Msg) -> bool:
        if self.done.is_set():
            return True
        if _gather(self.msgs, msg):
            self.done.set()
            return True
        return False

    def fail_in_trio(self, reason: str) -> None:
        if not self.done.is_set():
            self.error = Unavailable(f"request on {self.subject}: connection to NATS lost ({reason})")
            self.done.set()

    def refuse_in_trio(self, error: NotPermitted) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


# A delivery of a consumer scan: (subject, reply subject, `Nats-Msg-Size`, header bytes), None for the
# size when the message was no headers-only delivery with a readable size; the header bytes are its
# header block's and payload's as sent (what a pull request's `max_bytes` counts besides the subjects).
Delivery = tuple[bytes, bytes, int | None, int]
# A status message on a scan's subject (no delivery): (code, description, headers), e.g. ("409",
# "Message Size Exceeds MaxBytes", {... "Nats-Pending-Bytes": "63"}).
Status = tuple[str, str, dict[str, str]]


class Deliveries:
    """What a JetStream pull consumer delivers to a subject of the trio thread's lean connection
    (`Bridge.open_deliveries`): a one-shot headers-only scan, its pull requests sent from that
    connection with this subject for their replies (`request`), read without crossing to the asyncio
    thread and without a message object per delivery (`wire.DeliverySink`). What the server may send
    is what the requests asked for (their `max_bytes`), so it is the caller's to bound: nothing here
    answers anything. Status messages (heartbeats, the end of a request) are handed over apart from
    the deliveries. `next` raises once the connection is lost (after handing over what came before),
    or when the server refused the subscription or a request."""

    def __init__(self, reads: _TrioReads, conn: wire.TrioWireConnection, subject: str):
        self.subject = subject
        self._reads = reads
        self._conn = conn
        self._rows: list[Delivery] = []
        self._statuses: list[Status] = []
        self._wake = trio.Event()
        self.error: Unavailable | NotPermitted | None = None
        self._sid: int | None = None
        self.requests_to: set[str] = set()  # subjects requests were sent to (a refusal names one)

    def _open(self) -> None:
        try:
            self._sid = self._conn.subscribe(self.subject, self)
        except wire.WireError as e:
            raise Unavailable(f"subscribe to {self.subject}: {e}") from None
        self._reads.deliveries[self.subject] = self

    def request(self, subject: str, payload: bytes) -> None:
        """Send a request whose replies come here (a pull request); `Unavailable` if it certainly was
        not sent. A refusal of the server fails `next` with `NotPermitted`."""
        if self.error is not None:
            raise self.error
        self.requests_to.add(subject.lower())
        try:
            self._conn.publish(subject, payload, reply=self.subject)
        except wire.WireError as e:
            raise Unavailable(f"{subject}: not sent ({e})") from None

    # ---- wire.DeliverySink (the reader's task)
    def headers_only(self, rows: list[tuple[bytes, bytes, int, int]]) -> None:
        self._rows += rows
        self._wake.set()

    def message(self, subject: str, reply: str, headers: dict[str, str] | None, data: bytes | bytearray,
                header_size: int) -> None:
        if headers is not None and "Status" in headers and not data and not reply:
            # (A delivery, whatever headers its message has, comes with a `$JS.ACK` reply: it is a row,
            # for the caller to judge.)
            self._statuses.append((headers["Status"], headers.get("Description", ""), headers))
            self._wake.set()
            return
        size = headers.get("Nats-Msg-Size") if headers and "Status" not in headers and not data else None
        self._rows.append((subject.encode(), reply.encode(),
                           int(size) if size is not None and size.isdigit() and len(size) < 19 else None,
                           header_size + len(data)))
        self._wake.set()

    def fail(self, error: Unavailable | NotPermitted) -> None:
        if self.error is None:
            self.error = error
        self._wake.set()

    # ---- the scan's task
    async def next(self, timeout: float) -> tuple[list[Delivery], list[Status]]:
        """The deliveries and status messages that came since the last call, waiting up to `timeout` s
        for one (empty lists when none came)."""
        with trio.move_on_after(timeout):
            while not self._rows and not self._statuses and self.error is None:
                self._wake = trio.Event()
                await self._wake.wait()
        rows, self._rows = self._rows, []
        statuses, self._statuses = self._statuses, []
        if not rows and not statuses and self.error is not None:
            raise self.error
        return rows, statuses

    def close(self) -> None:
        """Unsubscribe (the caller deletes its consumer)."""
        self._reads.deliveries.pop(self.subject, None)
        sid, self._sid = self._sid, None
        if sid is not None and not self._conn.is_closed:
            self._conn.unsubscribe(sid)


class _TrioReads:
    """The lean connection for batched direct gets, driven by the trio thread itself
    (`wire.TrioWireConnection`): a read's request is written, and its replies parsed and handed to
    their collector or subscription, without crossing to the asyncio thread and back. Like `_Link`
    it keeps one connection at a time and replaces a lost one (quietly: the main connection reports
    a server going away), failing what waited on it at once. Its task is a trio system task, ended by
    `close`.

    A new connection goes to the next server in turn, except after a loss the bridge cannot yet tell a
    slow-consumer kick from the server's death (`Bridge.reads_lost_in_trio`): the first attempt then
    goes to the same server again, and its outcome is the bridge's verdict (`reads_retried_in_trio`)."""

    def __init__(self, bridge: Bridge, servers: Sequence[str], *, name: str, auth: Connection | None,
                 connect_timeout: float):
        self._bridge = bridge
        self.servers = list(servers)
        self.name = name
        self.auth = auth
        self.connect_timeout = connect_timeout
        self.nc: wire.TrioWireConnection | None = None
        self.prefix = ""
        self.waiters: dict[str, _TrioCollector | Subscription] = {}
        self.deliveries: dict[str, Deliveries] = {}  # by subject
        self._next_token = 0
        self._next_server = 0
        self._server_index = 0  # in `servers`, of the current connection (or the last one)
        # The server whose connection was lost with a verdict pending: the next attempt goes there again.
        self._verdict_on: int | None = None
        self._closing = False
        self._cancel = trio.CancelScope()
        self._ended = trio.Event()
        self._fault_logged = False

    async def open(self) -> None:
        """The first connection (each server once), then the task that serves and replaces it;
        `Unavailable` if no server takes it."""
        error: Exception | None = None
        for _ in self.servers:
            try:
                await self._connect()
                break
            except (Unavailable, wire.WireError) as e:
                error = error or e
        else:
            raise Unavailable(str(error) if error else "no NATS server given")
        trio.lowlevel.spawn_system_task(self._serve, name="natsfs-reads")

    async def _connect(self) -> None:
        index = self._next_server % len(self.servers)
        server = self.servers[index]
        self._next_server = index + 1
        if self.auth is not None:  # a password or token file rewritten since is read anew (rotation),
            # off the trio thread (a file on a stalled network share must not stop the FUSE requests)
            self.auth = await trio.to_thread.run_sync(self.auth.refreshed)
        try:
            conn = await wire.connect_trio(server, name=self.name, auth=self.auth, timeout=self.connect_timeout,
                                           on_msg=self._on_msg, on_closed=self._on_closed, on_refused=self._refused)
        except (TimeoutError, trio.TooSlowError, OSError) as e:
            raise Unavailable(f"cannot connect to NATS at {redact_url(server)}: {str(e) or type(e).__name__}") from None
        self.nc, self.prefix = conn, conn.inbox
        self._server_index = index

    async def _serve(self) -> None:
        try:
            with self._cancel:
                backoff = Backoff(*_RECONNECT_WAIT, clock=trio.current_time)
                while not self._closing:
                    conn = self.nc
                    if conn is not None:
                        backoff.reset()
                        try:
                            await conn.run()
                        except Exception:  # a fault of ours: the connection ends, reads go on without it
                            log.exception("reading from NATS failed unexpectedly")
                            conn.close()
                        self._on_closed(conn)
                        continue
                    await trio.sleep(backoff.next_pause())
                    retried, self._verdict_on = self._verdict_on, None
                    try:
                        await self._connect()
                    except (Unavailable, wire.WireError) as e:
                        log.debug("lean connection to NATS: %s", e)
                    except Exception:  # a fault of ours: reads go over the main connection meanwhile
                        if not self._fault_logged:
                            self._fault_logged = True
                            log.exception("connecting the lean connection to NATS failed unexpectedly")
                    if retried is not None:  # (no checkpoint since `_connect`: no read took the new one yet)
                        self._bridge.reads_retried_in_trio(self.nc is not None, self.servers[retried])
        finally:
            self._ended.set()

    def _on_closed(self, conn: wire.TrioWireConnection) -> None:
        if conn is not self.nc:
            return
        reason = conn.last_error or "connection closed"
        self.nc, self.prefix = None, ""
        log.debug("lost the lean connection to NATS (%s)", reason)
        if self._bridge.reads_lost_in_trio():  # a kick or the server's death: its server again first
            self._verdict_on = self._next_server = self._server_index
        self._fail_all(reason)

    def _refused(self, kind: str, subject: str) -> None:
        """`_Link.refused` for this connection (the trio thread parses its `-ERR`)."""
        wanted = subject.lower()
        if kind == "subscription":
            for d in list(self.deliveries.values()):
                if d.subject.lower() == wanted:
                    # (Not `refusal`: its one line per kind would be one per scan, each subject being
                    # new; the caller scans another way and remembers.)
                    del self.deliveries[d.subject]
                    log.debug("the server refused the subscription to %s (deliveries of a scan)", d.subject)
                    d.fail(NotPermitted(f"permission denied: the NATS server does not let this user subscribe "
                                        f"to {d.subject}", kind=kind, subject=d.subject))
                    return
        if kind == "publish":
            for d in self.deliveries.values():
                if wanted in d.requests_to:  # (kept: a refusal of its next request is its too)
                    log.debug("the server refused a request to %s (of a scan)", subject)
                    d.fail(NotPermitted(f"permission denied: the NATS server does not let this user publish "
                                        f"to {subject}", kind=kind, subject=subject))
                    return
            for token, waiter in self.waiters.items():
                if waiter.subject.lower() == wanted:
                    del self.waiters[token]
                    waiter.refuse_in_trio(refusal(kind, waiter.subject))
                    return
        refusal(kind, subject)

    def _fail_all(self, reason: str) -> None:
        waiters, self.waiters = self.waiters, {}
        for waiter in waiters.values():
            waiter.fail_in_trio(reason)
        deliveries, self.deliveries = self.deliveries, {}
        for d in deliveries.values():
            d.fail(Unavailable(f"deliveries to {d.subject}: connection to NATS lost ({reason})"))

    def _on_msg(self, subject: str, headers: dict[str, str] | None, data: bytes | bytearray) -> None:
        prefix = self.prefix
        if not prefix or not subject.startswith(prefix) or subject[len(prefix) : len(prefix) + 1] != ".":
            return  # addressed to an earlier connection's inbox
        token = subject[len(prefix) + 1 :]
        waiter = self.waiters.get(token)
        if waiter is not None and waiter.deliver_in_trio(Msg(subject, "", headers, data)):
            self.waiters.pop(token, None)

    def send(self, subject: str, payload: bytes, waiter: _TrioCollector | Subscription) -> str:
        """Send a request whose replies go to `waiter`; `Unavailable` if it certainly was not sent."""
        conn = self.nc
        if conn is None or conn.is_closed:
            raise Unavailable(f"{subject}: not sent, the lean connection to NATS is being replaced")
        self._next_token += 1
        token = str(self._next_token)
        self.waiters[token] = waiter
        try:
            conn.publish(subject, payload, reply=f"{self.prefix}.{token}")
        except wire.WireError as e:
            self.waiters.pop(token, None)
            raise Unavailable(f"{subject}: not sent ({e})") from None
        return token

    async def check_answering(self, timeout: float) -> None:
        """Before a request: `NoConnection` at once, instead of a wait of its own, when a request has
        waited `timeout` (the request timeout) without the server sending anything at all since, and
        the server does not answer a PING within `ANSWER_PROBE_S` either (stopped, or a network that
        drops packets without a reset: the connection stays up and nothing comes). One `read(2)` the
        kernel sends as two requests, or a read's next try, must not each wait a whole deadline for
        such a server. Anything it sends ends that verdict."""
        conn = self.nc
        if conn is None or conn.is_closed:
            return  # (`send` says so)
        silent = conn.silent_for()
        if silent < timeout:
            return
        if await conn.answers(ANSWER_PROBE_S):
            return
        if self.nc is not conn or conn.is_closed:
            return  # (it ended meanwhile: the request waits for the next connection, as after any loss)
        raise NoConnection(f"the server has not answered for {silent:.0f}s")

    def open_deliveries(self) -> Deliveries:
        """A fresh subject of this connection for a consumer's deliveries (`Bridge.open_deliveries`).
        It is under the reply inbox's prefix but one token deeper, so the inbox's `<prefix>.*`
        subscription does not get them too."""
        conn = self.nc
        if conn is None or conn.is_closed:
            raise Unavailable("the lean connection to NATS is being replaced")
        self._next_token += 1
        d = Deliveries(self, conn, f"{self.prefix}.d.{self._next_token}")
        d._open()
        return d

    async def request_many(self, subject: str, payload: bytes, timeout: float) -> list[Msg]:
        collector = _TrioCollector(subject)
        token = self.send(subject, payload, collector)
        try:
            with trio.move_on_after(timeout):
                await collector.done.wait()
        finally:
            self.waiters.pop(token, None)
        if collector.error is not None:
            raise collector.error
        if not collector.done.is_set():
            raise Unavailable(f"request on {subject} timed out after {timeout:g}s")
        return collector.msgs

    async def close(self) -> None:
        self._closing = True
        self._fail_all("closing")
        conn, self.nc = self.nc, None
        if conn is not None:
            conn.close()
        self._cancel.cancel()
        with trio.move_on_after(2.0):
            await self._ended.wait()


def _parse_ack(m: Msg, subject: str) -> dict[str, Any]:
    if not m.data:
        raise Unavailable(f"publish to {subject}: status {m.status}")
    return _parse_api_reply(m.data, subject)


# ---------------------------------------------------------------------------------------------- trio side
class _ByteBudget:
    """Bytes of replies in flight on one connection (trio side): first come, first served; a request
    larger than the whole budget gets it all."""

    def __init__(self, limit: int):
        self.full = limit
        self.limit = limit
        self.ceiling = limit  # how far it grows back (half the limit a kick came at)
        self.used = 0
        self._queue: collections.deque[list[Any]] = collections.deque()  # [bytes, trio.Event]
        self._changed_at = 0.0
        self._before_shrink: tuple[int, int] | None = None  # (limit, ceiling) before the last shrink

    async def acquire(self, want: int) -> int:
        """Wait for `want` bytes (at most the whole limit); returns what was granted."""
        self._regrow()
        entry: list[Any] = [min(want, self.limit), trio.Event()]
        self._queue.append(entry)
        self._grant()
        try:
            await entry[1].wait()
        except BaseException:
            if entry[1].is_set():
                self.release(entry[0])
            else:
                self._queue.remove(entry)
                self._grant()
            raise
        return int(entry[0])

    def release(self, n: int) -> None:
        if n > 0:
            self.used -= n
            self._grant()

    def _grant(self) -> None:
        while self._queue:
            entry = self._queue[0]
            entry[0] = min(entry[0], self.limit)
            if self.used and self.used + entry[0] > self.limit:
                return
            self._queue.popleft()
            self.used += entry[0]
            entry[1].set()

    def shrink(self) -> int:
        """A kick: down to the floor at once; it grows back to half of what it was at most."""
        self._before_shrink = (self.limit, self.ceiling)
        self.ceiling = max(MIN_REPLY_BUDGET, min(self.ceiling, self.limit // 2))
        self.limit = MIN_REPLY_BUDGET
        self._changed_at = time.monotonic()
        return self.limit

    def shrunk_within(self, seconds: float) -> bool:
        return self._before_shrink is not None and time.monotonic() - self._changed_at <= seconds

    def undo_shrink(self) -> None:
        """The last shrink was for a loss that was no kick: back to the limit before it."""
        if self._before_shrink is not None:
            self.limit, self.ceiling = self._before_shrink
            self._before_shrink = None
            self._grant()

    def _regrow(self) -> None:
        if self.limit < self.ceiling and time.monotonic() - self._changed_at > _BUDGET_REGROW_S:
            self.limit = min(self.ceiling, self.limit * 2)
            self._changed_at = time.monotonic()
            self._before_shrink = None
            log.info("replies in flight may reach %s again", _size(self.limit))


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


class Subscription:
    """Messages on one subject, delivered to trio in batches. Flow-control requests are answered here.

    Made by `Bridge.subscribe` (restored on every new connection) or `Bridge.request_stream` (the
    replies of one request: it fails, after what arrived before, when its connection is lost)."""

    def __init__(self, bridge: Bridge, subject: str):
        self.subject = subject
        self._bridge = bridge
        self._queue: collections.deque[Msg] = collections.deque()
        self._wake = trio.Event()
        self._wake_scheduled = False
        self._lock = threading.Lock()
        self.nats_sub: Any = None  # nats-py's subscription (set by the bridge)
        self.stream_token: str | None = None  # a request_stream's reply token
        self.stream_link: _Link | _TrioReads | None = None  # and the link it was sent on
        self._interrupted = False
        self._error: NatsFSError | None = None
        self.reserved = 0  # budget bytes held for replies not yet taken (set by the bridge)
        self.budget: _ByteBudget | None = None  # ... and the budget they are held from
        # Paced: answer flow-control requests when `next_batch` takes what came before them, not on
        # arrival, and keep the backlog short (see _PACE_HIGH).
        self.paced = False
        # Pulled: the deliveries of a pull consumer, asked for by `pull`; the bytes of those read from
        # the socket so far, as the server counts them against the requests' `max_bytes` (written by the
        # asyncio thread, read by trio), and the subjects requests went to (a refusal names one).
        self.pulled = False
        self.received_bytes = 0
        self.requests_to: set[str] = set()
        self._drained: asyncio.Event | None = None
        # Pacing starts with trio's first `next_batch`: until then nobody takes the backlog, and holding
        # the reader up would also hold up the reply that lets trio start (a consumer's CREATE answer
        # arriving behind its first thousand deliveries); the consumer's flow control bounds it meanwhile.
        self._taking = False
        self.closed = False

    # ---- asyncio side
    async def on_msg(self, m: Any) -> None:
        msg = _convert(m)
        nc = self._bridge.current_client()
        if msg.status == "100" and msg.reply and not self.paced and nc is not None:
            # JetStream flow control: answer at once, from the loop that owns the connection.
            await nc.publish(msg.reply, b"")
        stalled = msg.headers.get("Nats-Consumer-Stalled") if msg.headers else None
        if stalled and nc is not None:
            await nc.publish(stalled, b"")
        self._enqueue(msg)

    def deliver(self, msg: Msg) -> bool:
        """A reply of this subscription's request (from the reply inbox); True once it ended."""
        self._bridge.note_reply_size(len(msg.data))
        self._enqueue(msg)
        return _ends_batch(msg)

    def fail(self, reason: str) -> None:
        self._error = Unavailable(f"request on {self.subject}: connection to NATS lost ({reason})")
        self._bridge.call_in_trio(self.interrupt)

    def refuse(self, error: NotPermitted) -> None:
        """This request was refused for the user's permissions (see `_Link.refused`)."""
        self._error = error
        self._bridge.call_in_trio(self.interrupt)

    def _enqueue(self, msg: Msg) -> None:
        with self._lock:
            self._queue.append(msg)
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        self._bridge.call_in_trio(self._set_wake)

    # ---- trio side
    def deliver_in_trio(self, msg: Msg) -> bool:
        """`deliver` for a reply read by the trio thread itself (`_TrioReads`): no hand-off."""
        self._bridge.note_reply_size(len(msg.data))
        with self._lock:
            self._queue.append(msg)
        self._wake.set()
        return _ends_batch(msg)

    def fail_in_trio(self, reason: str) -> None:
        self._error = Unavailable(f"request on {self.subject}: connection to NATS lost ({reason})")
        self.interrupt()

    def refuse_in_trio(self, error: NotPermitted) -> None:
        self._error = error
        self.interrupt()

    def _set_wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._wake.set()

    async def next_batch(self, timeout: float | None = None) -> list[Msg]:
        """Everything queued so far; waits up to `timeout` seconds for at least one message. A request's
        replies raise `Unavailable` once those that came before its connection was lost are taken."""
        self._taking = True
        deadline = trio.current_time() + timeout if timeout is not None else math.inf
        while not self._queue and not self._interrupted and self._error is None and trio.current_time() < deadline:
            # A wakeup scheduled for an earlier batch may land on this event: hence the loop.
            self._wake = trio.Event()
            if self._queue or self._error is not None:
                break
            with trio.move_on_at(deadline):
                await self._wake.wait()
        self._interrupted = False
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
        if not batch and self._error is not None:
            raise self._error
        if self.reserved:
            taken = min(self.reserved, sum(len(m.data) for m in batch))
            self.reserved -= taken
            self._release(taken)
        if self.paced:
            # Flow control answered only now that the messages before it are taken: the server never
            # runs more than its flow-control window ahead of the consumer.
            replies = [m.reply for m in batch if m.reply and m.status == "100"]
            if replies:
                await self._bridge.run_on_loop(self._answer(replies))
            if batch:
                self._bridge.call_on_loop(self._set_drained)
        return batch

    async def pull(self, subject: str, payload: bytes) -> None:
        """Send a request whose replies come to this subscription (a pull consumer's request for more
        deliveries); `Unavailable` if it certainly was not sent. A refusal for the user's permissions
        fails `next_batch` with `NotPermitted`."""
        self.requests_to.add(subject.lower())

        async def send() -> None:
            nc = self._bridge.current_client()
            if nc is None:
                raise Unavailable(f"{subject}: not sent, no connection to NATS")
            try:
                await nc.publish(subject, payload, reply=self.subject)
            except nats.errors.Error as e:
                raise Unavailable(f"{subject}: not sent ({e})") from None

        await self._bridge.run_on_loop(send())

    def _release(self, n: int) -> None:
        """Give back reply budget held for replies now handed over."""
        if self.budget is not None:
            self.budget.release(n)

    async def _answer(self, replies: list[str]) -> None:
        nc = self._bridge.current_client()
        if nc is None:
            return  # the consumer is re-created on the next connection anyway
        for reply in replies:
            await nc.publish(reply, b"")

    # ---- pacing (asyncio side)
    def backlog(self) -> int:
        """Messages received and not yet taken by trio (ours, and nats-py's queue in front of ours)."""
        pending = self.nats_sub.pending_msgs if self.nats_sub is not None else 0
        return len(self._queue) + pending

    def _set_drained(self) -> None:
        if self._drained is not None:
            self._drained.set()

    async def wait_drained(self) -> None:
        """Called by the connection's reader: wait (briefly) while too much is waiting for trio."""
        if self.closed or not self._taking or self.backlog() <= _PACE_HIGH:
            return
        if self._drained is None:
            self._drained = asyncio.Event()
        self._drained.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), _PACE_WAIT)

    def interrupt(self) -> None:
        """Make a `next_batch` that is waiting return now (with whatever is queued, maybe nothing)."""
        self._interrupted = True
        self._wake.set()

    async def unsubscribe(self) -> None:
        if self.closed:
            return
        self.closed = True
        bridge = self._bridge
        self._release(self.reserved)
        self.reserved = 0
        if self.stream_token is not None:
            if self.stream_link is not None:
                bridge.drop_stream_waiter(self.stream_link, self.stream_token)
            return
        bridge.forget_subscription(self)
        sub = self.nats_sub
        if sub is not None:
            bridge.call_on_loop(self._set_drained)
            with contextlib.suppress(Exception):
                await bridge.run_on_loop(sub.unsubscribe())


async def _unless_cancelled(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` for a trio caller: once the caller has cancelled it, it ends cancelled even when what it
    awaited failed at the same moment (a request refused or lost just as its waiter went away: asyncio
    lets `wait_for` raise that instead). The cancelled future that linked it to trio never reads such
    an outcome, and asyncio would log it as "never retrieved"."""
    try:
        return await coro
    except Exception:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError from None
        raise


def _unwind_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what still runs on a stopped loop and let it unwind (briefly), as `asyncio.run` does: no
    task is destroyed while pending (a request cut short by the unmount logs nothing)."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        done, _ = loop.run_until_complete(asyncio.wait(tasks, timeout=2.0))
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: the connection is going away, whatever it was
    with contextlib.suppress(Exception):
        loop.run_until_complete(loop.shutdown_asyncgens())


class Bridge:
    """A connection to NATS on an asyncio loop thread, used from trio; it survives losing its client."""

    def __init__(
        self,
        servers: Sequence[str],
        *,
        name: str = "natsfs",
        request_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        on_disconnect: Callable[[], None] | None = None,
        on_reconnect: Callable[[], None] | None = None,
        auth: Connection | None = None,
        reply_budget: int = REPLY_BUDGET,
        lean_reads: bool = True,
        trio_reads: bool = True,
    ):
        self.servers = list(servers)
        self.name = name
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.auth = auth
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._link: _Link | None = None
        # Batched direct gets (the bytes of reads) go over a second, lean connection (`wire`) when the
        # servers and credentials allow it; None: over `_link`.
        self._lean_reads = lean_reads
        # ... and that connection is driven by the trio thread (`_TrioReads`), else by the asyncio one.
        self._trio_reads = trio_reads
        self._reads: _Link | _TrioReads | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._subs: set[Subscription] = set()  # restored on every new connection
        self._paced: dict[int, Subscription] = {}  # by nats-py subscription id
        self._pulled: dict[int, Subscription] = {}  # ... and those of pull consumers' deliveries
        self._budget = _ByteBudget(reply_budget)  # of the connection that carries reads
        # ... and of the main connection while the lean one is being replaced (never shrunk)
        self._fallback_budget = _ByteBudget(min(FALLBACK_REPLY_BUDGET, reply_budget))
        # Replies in flight when the lean connection of the trio thread was lost while the main one stayed,
        # until a retry of its server tells a kick (shrink for them) from the server's death (no shrink).
        self._kick_verdict: int | None = None
        self._main_lost_at = -1e9  # (monotonic) when the main connection was last lost
        # The longest subject the server is known to take, learned when it dropped the main connection
        # for a control line over its `max_control_line` (which INFO does not announce): None until then.
        self.subject_limit: int | None = None
        self._largest_reply = _CHUNK_GUESS
        self.connected = False
        self.reconnects = 0

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Start the loop thread and connect; raises `Unavailable` with a readable reason."""
        natscompat.check()
        self._token = trio.lowlevel.current_trio_token()
        ready = threading.Event()

        def loop_main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            ready.set()
            loop.run_forever()
            _unwind_tasks(loop)
            loop.close()

        self._thread = threading.Thread(target=loop_main, name="natsfs-asyncio", daemon=True)
        self._thread.start()
        ready.wait()
        self._link = _Link(self.servers, name=self.name, connect_timeout=self.connect_timeout,
                           auth=self.auth, on_lost=self._lost,
                           on_restored=self._restored, restore=self._restore, after_msg=self._after_msg,
                           unclaimed_refusal=self._pull_refused)
        try:
            await self.run_on_loop(self._link.open())
            await self._open_reads()
        except BaseException:
            await self.close()
            raise
        self.connected = True

    async def _open_reads(self) -> None:
        """The lean connection for replies in bulk, beside nats-py's; without it (servers or credentials
        it does not speak, or a server that refuses a second connection) reads go through nats-py."""
        why_not = wire.unsupported(self.servers, self.auth) if self._lean_reads else "turned off"
        if why_not is not None:
            log.debug("reads go through nats-py (lean connection: %s)", why_not)
            return
        if self._trio_reads:
            in_trio = _TrioReads(self, self.servers, name=self.name, auth=self.auth,
                                 connect_timeout=self.connect_timeout)
            try:
                await in_trio.open()
            except Unavailable as e:  # (whatever it was: the asyncio one may do)
                log.debug("reads do not go over a connection of the trio thread: %s", e)
            else:
                self._reads = in_trio
                return
        reads = _Link(self.servers, name=self.name, connect_timeout=self.connect_timeout, auth=self.auth,
                      on_lost=self._reads_lost, quiet=True, lean=True)
        try:
            await self.run_on_loop(reads.open())
        except Unavailable as e:
            log.info("reads go through nats-py: %s", e)
            return
        self._reads = reads

    @property
    def lean_reads(self) -> bool:
        """Whether batched direct gets use the lean connection."""
        return self._reads is not None

    @property
    def reads_in_trio(self) -> bool:
        """Whether that connection is driven by the trio thread (`_TrioReads`)."""
        return isinstance(self._reads, _TrioReads)

    async def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        for link in (self._reads, self._link):
            if isinstance(link, _TrioReads):
                await link.close()
            elif link is not None:
                with contextlib.suppress(Exception):
                    await self.run_on_loop(link.close())
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            await trio.to_thread.run_sync(self._thread.join, 5.0)
        self._loop = None
        self.connected = False

    @property
    def server_info(self) -> dict[str, Any]:
        """The INFO of the server last connected to (`max_payload`, `version`, ...)."""
        return self._link.server_info if self._link is not None else {}

    # ---- connection events (asyncio side, then trio)
    def _lost(self, reason: str) -> None:
        if CONTROL_LINE_EXCEEDED in reason.lower():
            self._learn_subject_limit()
        # With a lean connection the main one carries reads only within the fallback budget, which no
        # server's `max_pending` minds: its loss is no kick.
        in_flight = self._budget.used if self._reads is None else 0
        self.call_in_trio(lambda: self._lost_in_trio(in_flight))

    def _learn_subject_limit(self) -> None:
        """The server dropped the main connection for a control line over its `max_control_line` (smaller
        than the default 4096 the names are checked against): the longest subject of the requests in
        flight was that line's, or as long (the rest of a line, its reply subject and sizes, is about the
        same for every request). Subjects as long as it are refused from now on (`NameTooLong`, checked
        before anything is sent) rather than sent again, each time losing the connection and everything
        in flight on it. (Runs on the asyncio thread before the waiters fail: they are still listed.)"""
        assert self._link is not None
        waiters = list(self._link.waiters.values())
        longest = max((len(str(getattr(waiter, "subject", "")).encode()) for waiter in waiters), default=0)
        if longest < _SHORTEST_SUBJECT_LEARNED:
            return  # the line was no request's (no waiter's subject is long): nothing to learn of names
        limit = longest - 1
        if self.subject_limit is None or limit < self.subject_limit:
            self.subject_limit = limit
            log.warning("the server refused a control line over its max_control_line (a request on a "
                        "%d-byte subject): names whose subjects would be over %d bytes are refused "
                        "(ENAMETOOLONG) from now on", limit + 1, limit)

    def _reads_lost(self, reason: str) -> None:
        """The lean connection of the asyncio thread was lost (it reconnects on its own, quietly: a server
        going away is reported by the main connection); with replies in flight the reply budget shrinks
        at once, taken as a slow-consumer kick (see `reads_lost_in_trio` for how the trio one tells)."""
        in_flight = self._budget.used
        self.call_in_trio(lambda: self._lean_lost_in_trio(in_flight))

    def reads_lost_in_trio(self) -> bool:
        """The lean connection of the trio thread (`_TrioReads`) was lost: True when that waits for a
        verdict, its server to be tried again first. Lost with replies in flight that a shrink would cut
        while the main connection stays, it was a slow-consumer kick, or that server died (a cluster
        node, with the main connection on another) or an admin dropped the client: a server that
        takes the lean connection again dropped it (`reads_retried_in_trio`). Meanwhile reads go over
        the main connection within the fallback budget."""
        in_flight = self._budget.used
        if not (self.connected and self._would_shrink(in_flight)) or self._main_lost_lately():
            return False
        self._kick_verdict = in_flight
        return True

    def reads_retried_in_trio(self, reached: bool, server: str) -> None:
        """The verdict of `reads_lost_in_trio`: the lost connection's server took a new one (`reached`),
        so it dropped the client, a kick; or it could not be reached, so it went away: the budget
        stays, and the lean connection moves on to the next server."""
        in_flight, self._kick_verdict = self._kick_verdict, None
        if in_flight is None:  # (settled meanwhile: the main connection was lost too)
            return
        if reached:
            self._shrink_budget(in_flight)
        else:
            log.info("the server of the lean connection (%s) is gone, not a slow-consumer kick: reads move "
                     "to the next server, replies in flight may still reach %s", redact_url(server),
                     _size(self._budget.limit))

    def _lean_lost_in_trio(self, in_flight: int) -> None:
        if self.connected and not self._main_lost_lately():  # (the main one gone too: the server went away)
            self._shrink_budget(in_flight)

    def _main_lost_lately(self) -> bool:
        """The main connection was lost moments ago: a loss of the lean one now is the same event (a
        restart, or a kick of every connection of ours) even when the main one is already back, which
        under load can come before the lean connection's loss reaches trio; no slow-consumer kick."""
        return time.monotonic() - self._main_lost_at <= _SHRINK_UNDO_S

    def _lost_in_trio(self, in_flight: int) -> None:
        self.connected = False
        self._main_lost_at = time.monotonic()
        # A lean-connection loss still waiting for its verdict was the server going away too, no kick,
        # whatever the retry of its server finds.
        self._kick_verdict = None
        if self._reads is not None and self._budget.shrunk_within(_SHRINK_UNDO_S):
            # The lean connection went just before: the server went away, it was no kick.
            self._budget.undo_shrink()
            log.info("the connection to NATS was lost as a whole: replies in flight may reach %s again",
                     _size(self._budget.limit))
        self._shrink_budget(in_flight)
        if self.on_disconnect:
            self.on_disconnect()

    def _would_shrink(self, in_flight: int) -> bool:
        return in_flight >= MIN_REPLY_BUDGET and self._budget.limit > MIN_REPLY_BUDGET

    def _shrink_budget(self, in_flight: int) -> None:
        if self._would_shrink(in_flight):
            limit = self._budget.shrink()
            log.warning("the connection was lost with %.1f MiB of replies in flight (a server with a small "
                        "max_pending drops clients that fall behind): at most %s in flight from now on",
                        in_flight / 2**20, _size(limit))

    def _restored(self) -> None:
        self.call_in_trio(self._restored_in_trio)

    def _restored_in_trio(self) -> None:
        self.connected = True
        self.reconnects += 1
        if self.on_reconnect:
            self.on_reconnect()

    async def _restore(self, nc: Any) -> None:
        """Subscribe every live subscription again on a new client."""
        self._paced.clear()
        self._pulled.clear()
        for sub in list(self._subs):
            if sub.closed:
                continue
            sub.nats_sub = await nc.subscribe(sub.subject, cb=sub.on_msg, pending_bytes_limit=0, pending_msgs_limit=0)
            self._note_kind(sub)

    def _note_kind(self, sub: Subscription) -> None:
        sid = natscompat.subscription_id(sub.nats_sub)
        if sub.paced:
            self._paced[sid] = sub
        if sub.pulled:
            self._pulled[sid] = sub

    def _after_msg(self, sid: int, reply: bytes, size: int) -> Awaitable[None] | None:
        """Let a paced subscription's backlog hold up the connection's reader for a moment: the rest
        waits in the socket and (bounded by the consumer's flow control) on the server. Count the bytes
        of a pull consumer's delivery (not of a status message: those come without a reply subject) as
        read from the socket: what its pull requests asked for that the server no longer holds."""
        sub = self._paced.get(sid)
        if sub is not None:
            return sub.wait_drained()
        sub = self._pulled.get(sid)
        if sub is not None and reply.startswith(b"$JS.ACK."):
            sub.received_bytes += size
        return None

    def _pull_refused(self, kind: str, subject: str) -> bool:
        """The server refused a message on `subject` that no request waits for: if it is a pull request
        of a consumer's (`Subscription.pull`), that subscription fails (`NotPermitted`); True then."""
        if kind != "publish":
            return False
        wanted = subject.lower()
        for sub in list(self._pulled.values()):
            if wanted in sub.requests_to:
                # (Not logged here: the consumer catches up another way, and says so.)
                sub.refuse(NotPermitted(f"permission denied: the NATS server does not let this user publish to "
                                        f"{subject}", kind=kind, subject=subject))
                return True
        return False

    # ------------------------------------------------------------------ plumbing
    def call_in_trio(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the trio thread soon (from the asyncio thread); ignore a finished trio run."""
        if self._token is None:
            return
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn)

    async def run_on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await an asyncio coroutine from trio; trio cancellation cancels the asyncio task."""
        loop = self._loop
        if loop is None or self._link is None:
            coro.close()
            raise Unavailable("not connected to NATS")
        return await wait_future(asyncio.run_coroutine_threadsafe(_unless_cancelled(coro), loop))

    def call_on_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the asyncio loop soon (from any thread)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn)

    # ---- what a Subscription needs of its bridge
    def current_client(self) -> Any:
        """The nats-py client of the current connection, None while there is none."""
        return self._link.nc if self._link is not None else None

    def note_reply_size(self, size: int) -> None:
        """Remember the largest reply seen (budget reservations leave room for one more of them)."""
        self._largest_reply = max(self._largest_reply, size)

    def drop_stream_waiter(self, link: _Link | _TrioReads, token: str) -> None:
        """A `request_stream` subscription closed: its replies are no longer routed to it."""
        if isinstance(link, _TrioReads):
            link.waiters.pop(token, None)
        else:
            self.call_on_loop(lambda: link.waiters.pop(token, None))

    def forget_subscription(self, sub: Subscription) -> None:
        """A `subscribe` subscription closed: it is not restored on the next connection or paced."""
        self._subs.discard(sub)
        if sub.nats_sub is not None:
            self._paced.pop(natscompat.subscription_id(sub.nats_sub), None)
            self._pulled.pop(natscompat.subscription_id(sub.nats_sub), None)

    def _link_now(self) -> _Link:
        if self._link is None:
            raise Unavailable("not connected to NATS")
        return self._link

    def _bulk_route(self) -> tuple[_Link | _TrioReads, _ByteBudget]:
        """The link for requests answered in bulk (batched direct gets) and the budget of their replies:
        the lean one while it has a connection; while it is being replaced, the main one within the
        small fallback budget (reads never wait for the lean one alone, and never get the main one,
        which carries the watchers, dropped); without a lean connection, the main one."""
        reads = self._reads
        if reads is not None and reads.nc is not None:
            return reads, self._budget
        return self._link_now(), self._fallback_budget if reads is not None else self._budget

    async def _reserve(self, max_bytes: int) -> tuple[_Link | _TrioReads, _ByteBudget, int]:
        """The route of a bulk request and the bytes held from its budget for `max_bytes` and one more
        reply (nothing for 0): a route that changed while the request waited is taken afresh."""
        while True:
            _, budget = self._bulk_route()
            held = await budget.acquire(max_bytes + self._largest_reply) if max_bytes else 0
            link, now = self._bulk_route()
            if now is budget:
                return link, budget, held
            budget.release(held)

    def _asked(self, max_bytes: int, held: int) -> int:
        """What a request may ask for within the `held` bytes it was granted (less than it wanted
        when the budget shrank meanwhile)."""
        return min(max_bytes, max(1, held - self._largest_reply)) if max_bytes else 0

    # ------------------------------------------------------------------ requests
    async def request(
        self, subject: str, payload: bytes = b"", headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Msg:
        """One request, one reply. `NotFound` when nothing answers on `subject`."""
        link = self._link_now()
        return await self.run_on_loop(link.request(subject, payload, headers, timeout or self.request_timeout))

    @property
    def max_batch_bytes(self) -> int:
        """The most one batched request may ask for now (within `MAX_BATCH_BYTES` and the budget)."""
        return max(1, min(MAX_BATCH_BYTES, self._budget.limit - self._largest_reply))

    async def request_many(self, subject: str, payload: bytes | Callable[[int], bytes] = b"",
                           timeout: float | None = None, *, max_bytes: int = 0) -> list[Msg]:
        """A request answered by several messages, ending with a status message (direct get batch).
        `max_bytes`: what the request asks for, held from the reply budget until it ends; a callable
        `payload` is given what it may ask for now (the budget may have shrunk while it waited)."""
        link, budget, held = await self._reserve(max_bytes)
        try:
            if callable(payload):
                payload = payload(self._asked(max_bytes, held))
            if isinstance(link, _TrioReads):
                await link.check_answering(self.request_timeout)
                msgs = await link.request_many(subject, payload, timeout or self.request_timeout)
            else:
                msgs = await self.run_on_loop(self._request_many(link, subject, payload,
                                                                 timeout or self.request_timeout))
        finally:
            budget.release(held)
        for m in msgs:
            if len(m.data) > self._largest_reply:
                self._largest_reply = len(m.data)
        return msgs

    @staticmethod
    async def _request_many(link: _Link, subject: str, payload: bytes, timeout: float) -> list[Msg]:
        collector = _Collector(subject)
        token = await link.send(subject, payload, None, collector, timeout=timeout)
        try:
            await asyncio.wait_for(collector.done, timeout)
        except TimeoutError:
            raise Unavailable(f"request on {subject} timed out after {timeout:g}s") from None
        finally:
            link.waiters.pop(token, None)
            collector.settle()
        return collector.msgs

    async def request_stream(self, subject: str, payload: bytes | Callable[[int], bytes] = b"", *,
                             max_bytes: int = 0) -> Subscription:
        """A request answered by a stream of messages ending in a status message, handed over as they
        arrive (`Subscription.next_batch`); the caller stops at the first message with a status and
        unsubscribes. `max_bytes` is held from the reply budget and given back as replies are taken;
        a callable `payload` is given what it may ask for now."""
        sub = Subscription(self, subject)
        link, sub.budget, sub.reserved = await self._reserve(max_bytes)
        sub.stream_link = link
        try:
            if callable(payload):
                payload = payload(self._asked(max_bytes, sub.reserved))
            if isinstance(link, _TrioReads):
                await link.check_answering(self.request_timeout)
                sub.stream_token = link.send(subject, payload, sub)
            else:
                sub.stream_token = await self.run_on_loop(link.send(subject, payload, None, sub,
                                                                    timeout=self.request_timeout))
        except BaseException:
            sub.budget.release(sub.reserved)
            sub.reserved = 0
            raise
        return sub

    async def api(self, subject: str, body: dict[str, Any] | None = None, timeout: float | None = None
                  ) -> dict[str, Any]:
        """A JetStream API request (`$JS.API.` + subject) with a JSON body; raises on an error reply."""
        payload = json.dumps(body).encode() if body is not None else b""
        m = await self.request("$JS.API." + subject, payload, timeout=timeout)
        return _parse_api_reply(m.data, subject)

    async def js_publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None,
                         timeout: float | None = None) -> dict[str, Any]:
        """Publish into a stream and wait for its ack (`{"stream", "seq", ...}`). `OutcomeUnknown` when
        it was sent and no ack came; `Unavailable` when it certainly was not sent."""
        return await self.run_on_loop(self._link_now().js_publish(subject, payload, headers,
                                                           timeout or self.request_timeout))

    async def js_publish_many(
        self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]], window: int = 32,
        timeout: float | None = None,
    ) -> list[dict[str, Any] | NatsFSError]:
        """Publish many stream messages with at most `window` acks outstanding; results in order, each
        an ack, or an error as `js_publish` raises it."""
        return await self.run_on_loop(self._link_now().js_publish_many(msgs, window, timeout or self.request_timeout))

    async def subscribe(self, subject: str, *, paced: bool = False, pulled: bool = False) -> Subscription:
        """Messages on `subject`, in batches (`Subscription.next_batch`), on every connection from now on
        until unsubscribed. `paced`: for a JetStream push consumer with flow control, whose backlog is
        kept short (see `_PACE_HIGH`); `pulled`: for the deliveries of a pull consumer, whose requests
        go out with `Subscription.pull` and whose bytes are counted as read (`received_bytes`)."""
        link = self._link_now()
        sub = Subscription(self, subject)
        sub.paced = paced
        sub.pulled = pulled

        async def do() -> None:
            nc = await link.client(self.request_timeout)
            try:
                sub.nats_sub = await nc.subscribe(subject, cb=sub.on_msg, pending_bytes_limit=0, pending_msgs_limit=0)
            except nats.errors.Error as e:
                raise Unavailable(f"subscribe to {subject}: {e}") from None
            self._note_kind(sub)
            self._subs.add(sub)

        await self.run_on_loop(do())
        return sub

    def new_inbox(self) -> str:
        return f"_INBOX.{os.urandom(11).hex()}"

    def open_deliveries(self) -> Deliveries:
        """A subject on the trio thread's lean connection for the deliveries of a one-shot pull
        consumer (a headers-only scan; its requests sent with `Deliveries.request`), subscribed now;
        `Unavailable` when there is no such connection (none is used, it is driven by the asyncio
        thread, or it is being replaced): the caller then scans over the main connection. Close it
        when done."""
        reads = self._reads
        if not isinstance(reads, _TrioReads):
            raise Unavailable("no lean connection of the trio thread")
        return reads.open_deliveries()

    @property
    def max_payload(self) -> int:
        """The largest message the server takes, from its INFO (1 MiB by default)."""
        return int(self.server_info.get("max_payload") or 1024 * 1024)


def _parse_api_reply(data: bytes | bytearray, subject: str) -> dict[str, Any]:
    try:
        reply = json.loads(data) if data else {}
    except ValueError:
        raise Unavailable(f"unreadable JetStream reply on {subject}: {data[:80]!r}") from None
    err = reply.get("error") if isinstance(reply, dict) else None
    if err:
        raise JetStreamAPIError(str(err.get("description", "error")), code=int(err.get("code", 0)),
                                err_code=int(err.get("err_code", 0)))
    return reply


# ---------------------------------------------------------------------------------------------- upload worker
# The daemon's FUSE thread and its NATS thread share one GIL, and bulk publishing (copying 128 KiB
# chunks through nats-py and asyncio's transport) is the costliest thing the daemon does when files
# are written. `python -I -m natsfs.bridge upload-worker` (the connection as JSON on its first stdin
# line) is a helper process with its own connection that reads chunks straight from spool files into
# the frames it writes to the connection, hashes them on a thread of its own and publishes them,
# pipelined, so that work runs on other cores. It speaks newline-delimited JSON on stdin/stdout
# (see natsfs.uploader for the daemon's side): `send` (a range of a session; the reply counts its
# chunks and says the most publishes of the session that were unacknowledged at once, never above its
# window), `digest`, `drop`, `ping` (answered at once: the daemon kills a worker that stops answering);
# ranges of one session are sent in offset order. `drop` stops the session's ranges before their next
# write (one waiting for a window slot or its turn included) and is answered (`quiet`) only once none of
# them can publish anything more and the publishes they sent were answered (or waited for
# `_WORKER_ACK_TIMEOUT`): the daemon purges a put it gives up on only after that, so no chunk lands
# after its purge. Its connection is a
# `_Link` too: when it is lost, the chunks in flight fail at once (their outcome unknown), the rest of
# the session is refused, and the next put uses the new connection.

_WORKER_WINDOW = 64
# Acks of a range come back within milliseconds on a healthy server; one missing after this long (a
# server restarting just then) leaves the put's outcome unknown, and the daemon sends it again.
_WORKER_ACK_TIMEOUT = 15.0
# A range is read from its spool file this many bytes at a time (one pread, sliced into chunks).
_WORKER_READ = 1024 * 1024


class _WorkerSession:
    """One put session in the worker: its hash (fed on the hashing thread, in offset order), the offset
    the next range must start at, and its window of unacknowledged publishes."""

    def __init__(self, window: int, hashing: _Hashing):
        import hashlib

        self.hasher = hashlib.sha256()
        self.hashing = hashing  # one thread: updates run in the order they are submitted
        self.hashed: collections.deque[asyncio.Future[None]] = collections.deque()
        self.next_start = 0
        self.turn = asyncio.Condition()
        self.window = window
        self.in_flight = 0  # publishes sent and not acknowledged (never above `window`)
        self.most_in_flight = 0
        self.slot = asyncio.Event()
        self.failed: dict[str, Any] | None = None  # the error that ended this session, for later ranges
        self.dropped = False  # the daemon gave the put up: nothing more of it is written
        self.ranges = 0  # ranges being sent or waiting for their turn or their acks
        self.idle = asyncio.Event()  # set while `ranges` is 0
        self.idle.set()

    def hash(self, pieces: list[memoryview], buffer: bytearray) -> None:
        """Feed `pieces` (of `buffer`) to the hash on the hashing thread (hashlib drops the GIL for large
        buffers), so it runs next to the publishing; the caller keeps at most two reads waiting to be
        hashed. `buffer` is free again afterwards."""
        done = asyncio.get_running_loop().run_in_executor(self.hashing.executor, _hash_all, self.hasher, pieces)
        done.add_done_callback(lambda _: self.hashing.done_with(buffer))
        self.hashed.append(done)

    async def hashed_upto(self, pending: int) -> None:
        while len(self.hashed) > pending:
            await self.hashed.popleft()

    async def take_slot(self) -> None:
        while self.in_flight >= self.window and not self.dropped:  # (a drop wakes it: see `drop`)
            self.slot.clear()
            await self.slot.wait()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def free_slots(self, n: int) -> None:
        self.in_flight -= n
        self.slot.set()

    async def drop(self) -> None:
        """Stop the session's ranges before their next write, and wait until none is left (the acks of
        what they sent answered, or waited for `_WORKER_ACK_TIMEOUT`): nothing more of it is published."""
        self.dropped = True
        if self.failed is None:
            self.failed = {"description": "upload worker: the put was given up", "code": 503, "err_code": 0,
                           "kind": "unavailable"}
        self.slot.set()  # a range waiting for a window slot stops
        async with self.turn:
            self.turn.notify_all()  # ranges waiting for their turn stop
        await self.idle.wait()


class _Dropped(Exception):
    """A range's session was dropped: its next publishes are not written."""


def _hash_all(hasher: Any, pieces: list[memoryview]) -> None:
    for piece in pieces:
        hasher.update(piece)


# Up to Python 3.11, asyncio's socket transport copies what the socket does not take at once into a
# buffer of its own, so a frame buffer may be written over as soon as `write` returned; later versions
# keep a view of the caller's buffer until it is sent.
_TRANSPORT_COPIES = sys.version_info < (3, 12)


class _Hashing:
    """The worker's hashing thread, and the frame buffers it is done with: a buffer is reused once its
    chunks are hashed (they were written to the transport before, see `_TRANSPORT_COPIES`), because a
    fresh megabyte costs a page fault per page on every read."""

    def __init__(self) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="natsfs-sha256")
        self.free: list[bytearray] = []

    def done_with(self, buffer: bytearray) -> None:
        if _TRANSPORT_COPIES:
            self.free.append(buffer)

    def buffer(self, size: int) -> bytearray:
        while self.free:
            buf = self.free.pop()
            if len(buf) >= size:
                return buf
        return bytearray(size + 4096)  # room for longer headers next time


class _RangeAcks:
    """The acks of one range's publishes, all sent with this one waiter (a waiter per chunk costs a
    future, a task and a timer each): counts them, keeps the first refusal, frees a window slot per
    ack, and is done once every ack came or the connection was lost (`OutcomeUnknown`)."""

    __slots__ = ("acked", "done", "error", "fut", "s", "sent", "subject", "tokens")
    ack = True

    def __init__(self, subject: str, s: _WorkerSession):
        self.subject = subject
        self.s = s
        self.sent = 0
        self.acked = 0
        self.done = False  # every publish has been sent
        self.tokens: list[str] = []
        self.error: NatsFSError | None = None
        self.fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def deliver(self, msg: Msg) -> bool:
        if self.fut.done():
            return True
        self.acked += 1
        self.s.free_slots(1)
        if msg.data.startswith(b'{"stream":') and b'"error"' not in msg.data:
            self.check()  # an ack (a stream name holds no quote): nothing in it the worker needs
            return True
        try:
            if msg.status == "503" and not msg.data:
                raise NotFound(f"no responders on {self.subject}")
            _parse_ack(msg, self.subject)
        except NatsFSError as e:
            self.error = self.error or e
        self.check()
        return True

    def fail(self, reason: str) -> None:
        if self.fut.done():
            return
        self.s.free_slots(self.sent - self.acked)
        self.error = OutcomeUnknown(f"publish to {self.subject}: connection to NATS lost before the "
                                    f"acknowledgement ({reason})")
        self.fut.set_result(None)

    def refuse(self, error: NotPermitted) -> None:
        """One of the publishes was refused for the user's permissions: answered, and not stored."""
        if self.fut.done():
            return
        self.acked += 1
        self.s.free_slots(1)
        self.error = self.error or error
        self.check()

    def check(self) -> None:
        if self.done and self.acked == self.sent and not self.fut.done():
            self.fut.set_result(None)

    def settle(self, link: _Link) -> None:
        """Stop waiting: forget the tokens still registered and give their window slots back."""
        for token in self.tokens:
            link.waiters.pop(token, None)
        if not self.fut.done():
            self.s.free_slots(self.sent - self.acked)
            self.fut.set_result(None)


async def _send_piece(link: _Link, s: _WorkerSession, acks: _RangeAcks, fd: int, pos: int, sizes: list[int],
                      msg_ids: list[str], generation: int) -> None:
    """Publish the next chunks of a spool file (`sizes` of them from `pos`), each with its `Nats-Msg-Id`
    and its ack to `acks`. Their frames are laid out in one buffer and the chunks read straight into
    their places (`preadv`), hashed there on the hashing thread and written to the connection's
    transport at once: no copy of a payload in this process, one write for the lot."""
    subject = acks.subject
    nc = await link.client(30)
    if generation != link.generation:
        raise Unavailable(f"{subject}: not sent, the connection to NATS was replaced meanwhile")
    if max(sizes) > nc.max_payload:
        raise Unavailable(f"{subject}: a chunk of {max(sizes)} bytes is over the server's max payload")
    try:
        transport = await natscompat.raw_transport(nc, 30)
    except (nats.errors.Error, TimeoutError) as e:
        raise Unavailable(f"{subject}: not sent ({str(e) or type(e).__name__})") from None
    if generation != link.generation:  # replaced while nats-py's queue was flushed
        raise Unavailable(f"{subject}: not sent, the connection to NATS was replaced meanwhile")
    tokens = [link.token() for _ in sizes]
    prefix, subj = link.prefix.encode(), subject.encode()
    heads = []
    for token, size, msg_id in zip(tokens, sizes, msg_ids, strict=True):
        header = b"NATS/1.0\r\nNats-Msg-Id: %s\r\n\r\n" % msg_id.encode()
        heads.append(b"HPUB %s %s.%s %d %d\r\n%s" % (subj, prefix, token.encode(), len(header),
                                                       len(header) + size, header))
    length = sum(map(len, heads)) + sum(sizes) + 2 * len(sizes)
    buffer = s.hashing.buffer(length)
    frames = memoryview(buffer)[:length]
    payloads = []
    at = 0
    for head, size in zip(heads, sizes, strict=True):
        frames[at : at + len(head)] = head
        at += len(head)
        payloads.append(frames[at : at + size])
        at += size
        frames[at : at + 2] = b"\r\n"
        at += 2
    missing = sum(sizes) - os.preadv(fd, payloads, pos)
    for payload in reversed(payloads):  # a hole at the end of a sparse file reads short: zeros
        if missing <= 0:
            break
        zeros = min(missing, len(payload))
        payload[len(payload) - zeros :] = bytes(zeros)
        missing -= zeros
    if transport is None:  # (a transport nats-py does not let us write to: publish through it, copied)
        copies = [bytes(payload) for payload in payloads]
        s.hash(payloads, buffer)
        for data, msg_id in zip(copies, msg_ids, strict=True):
            if s.dropped:
                raise _Dropped
            acks.tokens.append(await link.send(subject, data, {"Nats-Msg-Id": msg_id}, acks, timeout=30,
                                               generation=generation))
            acks.sent += 1
        return
    if s.dropped:  # (checked after the last await: a drop answered since must see nothing more written)
        s.hashing.done_with(buffer)
        raise _Dropped
    s.hash(payloads, buffer)  # (the buffer is reused only after this is hashed: it is written before that)
    for token in tokens:
        link.waiters[token] = acks
    acks.sent += len(tokens)
    acks.tokens += tokens
    transport.write(frames)
    try:
        await transport.drain()
    except (ConnectionError, OSError) as e:  # the link notices the lost client and fails the acks
        raise Unavailable(f"{subject}: not sent ({e})") from None


def _worker_error(e: BaseException, subject: str) -> dict[str, Any]:
    """An error reply for the daemon; `kind` says whether the publish may have happened."""
    if isinstance(e, JetStreamAPIError):
        return {"description": e.description, "code": e.code, "err_code": e.err_code}
    if isinstance(e, NotFound):
        return {"description": f"no stream takes {subject}", "code": 503, "err_code": 0}
    if isinstance(e, NotPermitted):
        return {"description": str(e), "code": 403, "err_code": 0, "kind": "refused", "subject": e.subject,
                "refused": e.kind}
    kind = "outcome_unknown" if isinstance(e, OutcomeUnknown) else "unavailable"
    return {"description": f"upload worker: {e}", "code": 503, "err_code": 0, "kind": kind}


async def _worker_send(link: _Link, req: dict[str, Any], s: _WorkerSession) -> dict[str, Any]:
    """Publish a file range as chunks. Ranges of a session are read and published strictly in offset
    order (a range waits for its turn) on one connection, with at most the session's window of acks
    outstanding; the bytes are hashed on the hashing thread meanwhile. A range's acks are awaited
    outside its turn, so the next range is already being sent while this one's acks come back. A
    dropped session's range stops before its next write and still waits for the acks of what it sent."""
    s.ranges += 1
    s.idle.clear()
    try:
        return await _send_range(link, req, s)
    finally:
        s.ranges -= 1
        if not s.ranges:
            s.idle.set()


async def _send_range(link: _Link, req: dict[str, Any], s: _WorkerSession) -> dict[str, Any]:
    subject, path, start, end, chunk = req["subject"], req["path"], req["start"], req["end"], req["chunk_size"]
    # Chunk i of put `session` is message `<session>.<i>` (JetStream de-duplication, as in adr20.PutSession).
    first_index = start // chunk
    acks = _RangeAcks(subject, s)
    async with s.turn:
        await asyncio.wait_for(s.turn.wait_for(lambda: s.next_start == start or s.failed is not None), 120)
        if s.failed is not None:
            return {"error": s.failed}
        generation = link.generation
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = start
            per_piece = max(1, min(s.window, _WORKER_READ // chunk))
            while pos < end and not s.dropped:
                sizes = [min(chunk, end - p) for p in range(pos, min(end, pos + per_piece * chunk), chunk)]
                sent_before, taken = acks.sent, 0
                try:
                    for _ in sizes:
                        await s.take_slot()
                        taken += 1
                    if s.dropped:
                        raise _Dropped
                    msg_ids = [f"{req['session']}.{first_index + acks.sent + i}" for i in range(len(sizes))]
                    await _send_piece(link, s, acks, fd, pos, sizes, msg_ids, generation)
                except BaseException:
                    s.free_slots(taken - (acks.sent - sent_before))
                    raise
                await s.hashed_upto(1)
                pos += sum(sizes)
        except _Dropped:
            pass  # what was sent is still waited for below
        except Exception as e:
            acks.settle(link)
            s.failed = _worker_error(e, subject)
            return {"error": s.failed}
        finally:
            os.close(fd)
            s.turn.notify_all()
        if not s.dropped:
            s.next_start = end
    acks.done = True
    acks.check()
    try:
        await asyncio.wait_for(asyncio.shield(acks.fut), _WORKER_ACK_TIMEOUT)
    except TimeoutError:
        acks.error = acks.error or OutcomeUnknown(
            f"publish to {subject} not acknowledged in {_WORKER_ACK_TIMEOUT:g}s")
    finally:
        acks.settle(link)
    if s.dropped:
        assert s.failed is not None
        return {"error": s.failed}
    if acks.error is not None:
        s.failed = _worker_error(acks.error, subject)
        async with s.turn:
            s.turn.notify_all()
        return {"error": s.failed}
    return {"chunks": acks.sent, "bytes": end - start, "most_in_flight": s.most_in_flight}


# A server that sent nothing for a whole request timeout while a request waited (`_TrioReads
# .check_answering`) is given this long to answer a PING before a request fails without waiting.
ANSWER_PROBE_S = 2.0

# The upload worker's exit status when it could connect to no server (EX_TEMPFAIL): an outage the daemon's
# own connection reports, not a death of the worker to log (see uploader.UploadWorker).
WORKER_FOUND_NO_SERVER = 75


async def _worker_main(connection: Connection) -> None:
    # Quiet: stderr is the daemon's; the daemon notices a dead worker or failed ranges and says so itself.
    link = _Link(connection.servers, name="natsfs-upload-worker", connect_timeout=5, quiet=True,
                 auth=connection)
    try:
        # Without a server the worker just exits (saying so by its status) and the daemon publishes
        # in-process.
        await link.open()
    except Unavailable:
        raise SystemExit(WORKER_FOUND_NO_SERVER) from None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    sessions: dict[str, _WorkerSession] = {}
    hashing = _Hashing()

    async def handle(req: dict[str, Any]) -> None:
        body = await _worker_handle(link, sessions, hashing, req)
        out.write(json.dumps({"id": req["id"], **body}).encode() + b"\n")
        out.flush()

    tasks = set()
    while line := await reader.readline():
        task = asyncio.ensure_future(handle(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    # stdin closed: the daemon is done with us. Don't linger if the server is gone.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(link.close(), 2)  # (within the daemon's wait for us, uploader.EXIT_GRACE_S)


async def _worker_handle(link: _Link, sessions: dict[str, _WorkerSession], hashing: _Hashing,
                         req: dict[str, Any]) -> dict[str, Any]:
    """The reply to one request of the daemon (without its id)."""
    session = req.get("session", "")
    try:
        op = req["op"]
        if op == "send":
            s = sessions.get(session) or sessions.setdefault(
                session, _WorkerSession(req.get("window", _WORKER_WINDOW), hashing))
            return await _worker_send(link, req, s)
        if op == "digest":
            s = sessions.get(session) or sessions.setdefault(session, _WorkerSession(_WORKER_WINDOW, hashing))
            await s.hashed_upto(0)
            return {"digest": s.hasher.digest().hex(), "bytes": s.next_start}
        if op == "drop":
            # Answered once nothing more of the session is published (the daemon purges the put after
            # this); a session unknown here has nothing in flight. Dropped again (the daemon asks again
            # when it could not wait for the first answer): answered once the first drop is done too.
            dropped = sessions.get(session)
            if dropped is not None:
                await dropped.drop()
                if sessions.get(session) is dropped:
                    del sessions[session]
            return {"quiet": True}
        if op == "ping":  # the daemon's check that this loop still runs (see natsfs.uploader)
            return {}
        return {"error": {"description": f"unknown op {op}", "code": 400, "err_code": 0}}
    except Exception as e:  # the daemon falls back to publishing itself
        return {"error": {"description": f"upload worker: {e!r}", "code": 503, "err_code": 0,
                          "kind": "unavailable"}}


def _read_worker_connection(fd: int) -> Connection:
    """The connection settings (servers and credentials) the daemon sends as the first line on the
    worker's stdin (never in argv or the environment: they may carry secrets). Read a byte at a time, so
    nothing after that line is taken from the pipe."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            raise SystemExit(1)  # the daemon went away before saying which servers
        line += byte
    return Connection.from_json(line)


def _main() -> None:
    if sys.argv[1:] == ["upload-worker"]:
        memory.keep_freed_buffers()
        asyncio.run(_worker_main(_read_worker_connection(sys.stdin.fileno())))
    else:
        raise SystemExit("usage: python -I -m natsfs.bridge upload-worker  (stdin: the connection as JSON first)")


if __name__ == "__main__":
    _main()
