"""The one place asyncio and nats-py live: an asyncio loop on its own thread, and trio-flavoured calls.

nats-py only runs on asyncio while the daemon is trio (pyfuse3). `Bridge` starts a daemon thread
running an asyncio loop, connects nats-py there, and offers `async` methods that trio code awaits.
Each call schedules a coroutine on the loop and parks the trio task until it finishes; when trio
cancels the waiting task, the asyncio task is cancelled too. Messages for subscriptions are queued
on the asyncio side and handed to trio in batches, so a burst of messages costs one wakeup.

Nothing outside this module imports asyncio or nats; nats exceptions become `natsfs.errors`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.aio.client
import nats.errors
import trio

from .errors import JetStreamAPIError, NatsFSError, NotFound, Unavailable
from .futures import wait_future
from .secrecy import redact_url, redact_urls

log = logging.getLogger(__name__)
T = TypeVar("T")

# One pending flush of publishes may hold this many bytes before nats-py flushes it itself.
_PENDING_SIZE = 8 * 1024 * 1024
# nats-py reads its socket 32 KiB at a time through a StreamReader limited to 32 KiB, so a 128 KiB
# chunk costs four reads and as many pause/resume cycles of the selector. Reading 1 MiB at a time
# makes bulk transfers markedly cheaper; the value is a module global nats-py reads at call time.
_READ_BUFFER = 1024 * 1024
nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, _READ_BUFFER)
# A paced subscription (a watch loading a huge bucket) may hold this many messages not yet taken by
# trio before the connection stops reading for a moment (at most _PACE_WAIT s at a time): the rest
# waits in the socket and on the server, instead of as Python objects that fragment the heap.
_PACE_HIGH = 1000
_PACE_WAIT = 0.05


@dataclass(slots=True)
class Msg:
    """A message as the layers above see it: no nats-py types leak out of the bridge."""

    subject: str
    reply: str
    headers: dict[str, str] | None
    data: bytes

    @property
    def status(self) -> str | None:
        return self.headers.get("Status") if self.headers else None


def _convert(m: Any) -> Msg:
    return Msg(m.subject, m.reply or "", dict(m.headers) if m.headers else None, m.data or b"")


class Subscription:
    """Messages on one subject, delivered to trio in batches. Flow-control requests are answered here."""

    def __init__(self, bridge: Bridge, subject: str):
        self.subject = subject
        self._bridge = bridge
        self._queue: collections.deque[Msg] = collections.deque()
        self._wake = trio.Event()
        self._wake_scheduled = False
        self._lock = threading.Lock()
        self._sub: Any = None
        self._stream_token: str | None = None
        self._interrupted = False
        # Paced: answer flow-control requests when `next_batch` takes what came before them, not on
        # arrival, and keep the backlog short (see _PACE_HIGH).
        self.paced = False
        self._drained: asyncio.Event | None = None
        self.closed = False

    # ---- asyncio side ----
    async def _on_msg(self, m: Any) -> None:
        await self._on_msg_converted(_convert(m))

    async def _on_msg_converted(self, msg: Msg) -> None:
        if msg.status == "100" and msg.reply and not self.paced:
            # JetStream flow control: answer at once, from the loop that owns the connection.
            await self._bridge._nc.publish(msg.reply, b"")
        stalled = msg.headers.get("Nats-Consumer-Stalled") if msg.headers else None
        if stalled:
            await self._bridge._nc.publish(stalled, b"")
        with self._lock:
            self._queue.append(msg)
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        self._bridge._to_trio(self._set_wake)

    # ---- trio side ----
    def _set_wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._wake.set()

    async def next_batch(self, timeout: float | None = None) -> list[Msg]:
        """Everything queued so far; waits up to `timeout` seconds for at least one message."""
        deadline = trio.current_time() + timeout if timeout is not None else math.inf
        while not self._queue and not self._interrupted and trio.current_time() < deadline:
            # A wakeup scheduled for an earlier batch may land on this event: hence the loop.
            self._wake = trio.Event()
            if self._queue:
                break
            with trio.move_on_at(deadline):
                await self._wake.wait()
        self._interrupted = False
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
        if self.paced:
            # Flow control answered only now that the messages before it are taken: the server never
            # runs more than its flow-control window ahead of the consumer.
            replies = [m.reply for m in batch if m.reply and m.status == "100"]
            if replies:
                await self._bridge._run(self._answer(replies))
            if batch:
                self._bridge._call_soon(self._set_drained)
        return batch

    async def _answer(self, replies: list[str]) -> None:
        for reply in replies:
            await self._bridge._nc.publish(reply, b"")

    # ---- pacing (asyncio side) ----
    def backlog(self) -> int:
        """Messages received and not yet taken by trio (ours, and nats-py's queue in front of ours)."""
        queue = getattr(self._sub, "_pending_queue", None)
        pending = queue.qsize() if queue is not None else 0
        return len(self._queue) + pending

    def _set_drained(self) -> None:
        if self._drained is not None:
            self._drained.set()

    async def wait_drained(self) -> None:
        """Called by the connection's reader: wait (briefly) while too much is waiting for trio."""
        if self.closed or self.backlog() <= _PACE_HIGH:
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
        if self._stream_token is not None:
            self._bridge._streams.pop(self._stream_token, None)
        sub = self._sub
        if sub is not None:
            self._bridge._paced.pop(getattr(sub, "_id", None), None)
            self._bridge._call_soon(self._set_drained)
            with contextlib.suppress(Exception):
                await self._bridge._run(sub.unsubscribe())


class Bridge:
    """A nats-py connection on an asyncio loop thread, used from trio."""

    def __init__(
        self,
        servers: Sequence[str],
        *,
        name: str = "natsfs",
        request_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        on_disconnect: Callable[[], None] | None = None,
        on_reconnect: Callable[[], None] | None = None,
        user_credentials: str | None = None,
    ):
        self.servers = list(servers)
        self.name = name
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.user_credentials = user_credentials
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc: Any = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._mux_prefix = ""
        self._collectors: dict[str, _Collector] = {}
        self._streams: dict[str, Subscription] = {}
        self._acks: dict[str, asyncio.Future[Msg]] = {}
        self._paced: dict[int, Subscription] = {}  # by nats-py subscription id
        self._closing = False
        self._next_token = 0
        self.connected = False

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Start the loop thread and connect; raises `Unavailable` with a readable reason."""
        self._token = trio.lowlevel.current_trio_token()
        ready = threading.Event()

        def loop_main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=loop_main, name="natsfs-asyncio", daemon=True)
        self._thread.start()
        ready.wait()
        try:
            await self._run(self._connect())
        except BaseException:
            await self.close()
            raise
        self.connected = True

    async def _connect(self) -> None:
        first_error: list[BaseException] = []

        async def error_cb(e: Exception) -> None:
            if not first_error:
                first_error.append(e)
            log.debug("nats: %s", e)

        async def disconnected_cb() -> None:
            if self.connected and not self._closing:
                log.warning("lost connection to NATS; reconnecting")
            self.connected = False
            if self.on_disconnect:
                self._to_trio(self.on_disconnect)

        async def reconnected_cb() -> None:
            self.connected = True
            log.warning("reconnected to NATS at %s", redact_url(self._nc.connected_url.geturl()) if self._nc else "?")
            if self.on_reconnect:
                self._to_trio(self.on_reconnect)

        options: dict[str, Any] = {
            "servers": self.servers,
            "name": self.name,
            "connect_timeout": self.connect_timeout,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "error_cb": error_cb,
            "disconnected_cb": disconnected_cb,
            "reconnected_cb": reconnected_cb,
            "pending_size": _PENDING_SIZE,
        }
        if self.user_credentials:
            options["user_credentials"] = self.user_credentials
        try:
            # The first connect must fail fast and say why, instead of retrying forever.
            # (nats-py treats 0 attempts as "forever", hence 1.)
            options_first = dict(options, max_reconnect_attempts=1, allow_reconnect=False)
            limit = (self.connect_timeout + 1) * 2 * len(self.servers) + 2
            nc = await asyncio.wait_for(nats.connect(**options_first), limit)
            await nc.close()
            self._nc = await nats.connect(**options)
        except (TimeoutError, nats.errors.NoServersError, OSError, nats.errors.Error) as e:
            reason = first_error[0] if first_error else e
            raise Unavailable(f"cannot connect to NATS at {redact_urls(self.servers)}: {reason}") from None
        self._mux_prefix = self._nc.new_inbox()
        await self._nc.subscribe(self._mux_prefix + ".*", cb=self._on_mux, pending_bytes_limit=0)
        self._install_pacing()

    async def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self._closing = True
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._run(self._close_nc())
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            await trio.to_thread.run_sync(self._thread.join, 5.0)
        self._loop = None
        self.connected = False

    async def _close_nc(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._nc.drain(), 2.0)
        with contextlib.suppress(Exception):
            await self._nc.close()

    # ------------------------------------------------------------------ plumbing
    def _to_trio(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the trio thread soon (from the asyncio thread); ignore a finished trio run."""
        if self._token is None:
            return
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn)

    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await an asyncio coroutine from trio; trio cancellation cancels the asyncio task."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise Unavailable("not connected to NATS")
        return await wait_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run an arbitrary nats-py coroutine factory on the loop (for tests and tools)."""

        async def wrapper() -> T:
            return await fn()

        return await self._run(wrapper())

    async def _on_mux(self, m: Any) -> None:
        token = m.subject[len(self._mux_prefix) + 1 :]
        ack = self._acks.get(token)
        if ack is not None:
            if not ack.done():
                ack.set_result(_convert(m))
            return
        collector = self._collectors.get(token)
        if collector is not None:
            collector.add(_convert(m))
            return
        stream = self._streams.get(token)
        if stream is not None:
            msg = _convert(m)
            if msg.status is not None and not msg.data:
                self._streams.pop(token, None)
            await stream._on_msg_converted(msg)

    # ------------------------------------------------------------------ requests
    async def request(
        self, subject: str, payload: bytes = b"", headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Msg:
        return await self._run(self._request(subject, payload, headers, timeout or self.request_timeout))

    async def _request(self, subject: str, payload: bytes, headers: dict[str, str] | None,
                       timeout: float) -> Msg:
        try:
            m = await self._nc.request(subject, payload, timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError:
            raise NotFound(f"no responders on {subject}") from None
        except (TimeoutError, nats.errors.TimeoutError):
            raise Unavailable(f"request on {subject} timed out after {timeout:g}s") from None
        except nats.errors.Error as e:
            raise Unavailable(f"request on {subject} failed: {e}") from None
        return _convert(m)

    async def request_many(self, subject: str, payload: bytes = b"", timeout: float | None = None) -> list[Msg]:
        """A request answered by several messages, ending with a status message (direct get batch)."""
        return await self._run(self._request_many(subject, payload, timeout or self.request_timeout))

    async def _request_many(self, subject: str, payload: bytes, timeout: float) -> list[Msg]:
        self._next_token += 1
        token = str(self._next_token)
        collector = _Collector()
        self._collectors[token] = collector
        try:
            await self._nc.publish(subject, payload, reply=f"{self._mux_prefix}.{token}")
            try:
                await asyncio.wait_for(collector.done, timeout)
            except TimeoutError:
                raise Unavailable(f"request on {subject} timed out after {timeout:g}s") from None
            return collector.msgs
        except nats.errors.Error as e:
            raise Unavailable(f"request on {subject} failed: {e}") from None
        finally:
            del self._collectors[token]

    async def request_stream(self, subject: str, payload: bytes = b"") -> Subscription:
        """A request answered by a stream of messages ending in a status message, handed over as they
        arrive (`Subscription.next_batch`); the caller stops at the first message with a status."""
        self._next_token += 1
        token = f"s{self._next_token}"
        sub = Subscription(self, subject)
        sub._stream_token = token

        async def do() -> None:
            self._streams[token] = sub
            await self._nc.publish(subject, payload, reply=f"{self._mux_prefix}.{token}")

        try:
            await self._run(do())
        except nats.errors.Error as e:
            self._streams.pop(token, None)
            raise Unavailable(f"request on {subject} failed: {e}") from None
        return sub

    async def api(self, subject: str, body: dict[str, Any] | None = None, timeout: float | None = None
                  ) -> dict[str, Any]:
        """A JetStream API request (`$JS.API.` + subject) with a JSON body; raises on an error reply."""
        payload = json.dumps(body).encode() if body is not None else b""
        m = await self.request("$JS.API." + subject, payload, timeout=timeout)
        return _parse_api_reply(m.data, subject)

    async def publish(self, subject: str, payload: bytes = b"", headers: dict[str, str] | None = None) -> None:
        """Core NATS publish, no acknowledgement."""
        await self._run(self._nc.publish(subject, payload, headers=headers))

    async def js_publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None,
                         timeout: float | None = None) -> dict[str, Any]:
        """Publish into a stream and wait for its ack (`{"stream", "seq", ...}`)."""
        m = await self.request(subject, payload, headers, timeout)
        return _parse_api_reply(m.data, subject)

    async def js_publish_many(
        self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]], window: int = 32,
        timeout: float | None = None,
    ) -> list[dict[str, Any] | NatsFSError]:
        """Publish many stream messages with at most `window` acks outstanding; results in order."""
        return await self._run(self._js_publish_many(msgs, window, timeout or self.request_timeout))

    async def _js_publish_many(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]], window: int,
                               timeout: float) -> list[dict[str, Any] | NatsFSError]:
        # Like nats.go's PublishAsync: plain publishes whose acks come back to our reply mux, at most
        # `window` unacknowledged. Much cheaper per message than one nats-py request each.
        loop = asyncio.get_running_loop()
        results: list[dict[str, Any] | NatsFSError] = [Unavailable("not acknowledged")] * len(msgs)
        sem = asyncio.Semaphore(window)
        pending: set[asyncio.Future[Msg]] = set()

        async def one(i: int, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
            await sem.acquire()
            self._next_token += 1
            token = f"a{self._next_token}"
            fut: asyncio.Future[Msg] = loop.create_future()
            self._acks[token] = fut
            pending.add(fut)
            fut.add_done_callback(lambda _: sem.release())
            try:
                await self._nc.publish(subject, data, reply=f"{self._mux_prefix}.{token}", headers=headers)
                m = await asyncio.wait_for(fut, timeout)
                results[i] = _parse_api_reply(m.data, subject) if m.data else NotFound(
                    f"no stream takes {subject}") if m.status == "503" else Unavailable(
                    f"publish to {subject}: status {m.status}")
            except TimeoutError:
                results[i] = Unavailable(f"publish to {subject} not acknowledged in {timeout:g}s")
            except NatsFSError as e:
                results[i] = e
            except nats.errors.Error as e:
                results[i] = Unavailable(f"publish to {subject} failed: {e}")
            finally:
                self._acks.pop(token, None)
                if not fut.done():
                    fut.cancel()

        await asyncio.gather(*(one(i, s, d, h) for i, (s, d, h) in enumerate(msgs)))
        return results

    async def subscribe(self, subject: str, *, paced: bool = False) -> Subscription:
        """Messages on `subject`, in batches (`Subscription.next_batch`). `paced`: for a JetStream push
        consumer with flow control, whose backlog is kept short (see `_PACE_HIGH`)."""
        sub = Subscription(self, subject)
        sub.paced = paced

        async def do() -> None:
            sub._sub = await self._nc.subscribe(subject, cb=sub._on_msg, pending_bytes_limit=0,
                                                pending_msgs_limit=0)
            if paced:
                self._paced[sub._sub._id] = sub

        await self._run(do())
        return sub

    def _call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the asyncio loop soon (from any thread)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn)

    def _install_pacing(self) -> None:
        """Let a paced subscription's backlog hold up the connection's reader for a moment.

        nats-py's reader parses the socket and hands each message to `_process_msg`; waiting there
        leaves the rest in the socket (and, bounded by the consumer's flow control, on the server)."""
        process = self._nc._process_msg
        paced = self._paced

        async def process_msg(sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
            await process(sid, subject, reply, data, headers)
            sub = paced.get(sid)
            if sub is not None:
                await sub.wait_drained()

        self._nc._process_msg = process_msg

    async def flush(self, timeout: float = 5.0) -> None:
        try:
            await self._run(self._nc.flush(timeout))
        except (TimeoutError, nats.errors.Error) as e:
            raise Unavailable(f"flush failed: {e}") from None

    def new_inbox(self) -> str:
        return self._nc.new_inbox()

    @property
    def max_payload(self) -> int:
        """The largest message the server takes, from its INFO (1 MiB by default)."""
        return int(self._nc.max_payload) if self._nc is not None else 1024 * 1024


class _Collector:
    """Gathers the replies of one multi-message request until its end-of-batch status."""

    __slots__ = ("done", "msgs")

    def __init__(self) -> None:
        self.msgs: list[Msg] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def add(self, msg: Msg) -> None:
        if self.done.done():
            return
        status = msg.status
        if status is not None and not msg.data:
            # 204 EOB ends a batch; 404/408/other statuses end it too (kept for the caller).
            if status != "204":
                self.msgs.append(msg)
            self.done.set_result(None)
            return
        self.msgs.append(msg)


def _parse_api_reply(data: bytes, subject: str) -> dict[str, Any]:
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
# are written. `python -m natsfs.bridge upload-worker URL[,URL]` is a helper process with its own
# connection that reads chunks straight from spool files, hashes them and publishes them, pipelined,
# so that work runs on another core. It speaks newline-delimited JSON on stdin/stdout
# (see natsfs.uploader for the daemon's side); requests of one session are handled in order.

_WORKER_WINDOW = 64


class _WorkerSession:
    """One put session in the worker: its hash, and the offset the next range must start at."""

    def __init__(self, window: int):
        import hashlib

        self.hasher = hashlib.sha256()
        self.next_start = 0
        self.turn = asyncio.Condition()
        self.window = asyncio.Semaphore(window)


async def _worker_send(nc: Any, req: dict[str, Any], s: _WorkerSession, inbox: str,
                       acks: dict[str, asyncio.Future[Any]]) -> dict[str, Any]:
    """Publish a file range as chunks. Ranges of a session are hashed and published strictly in offset
    order (a range waits for its turn); their acks are awaited outside that turn, so the next range is
    already being sent while this one's acks come back."""
    subject, path, start, end, chunk = req["subject"], req["path"], req["start"], req["end"], req["chunk_size"]
    # Chunk i of put `session` is message `<session>.<i>` (JetStream de-duplication, as in adr20.PutSession).
    first_index = start // chunk
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[Any]] = []
    async with s.turn:
        await asyncio.wait_for(s.turn.wait_for(lambda: s.next_start == start), 120)
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = start
            while pos < end:
                n = min(chunk, end - pos)
                data = os.pread(fd, n, pos)
                if len(data) < n:  # a hole at the end of a sparse file reads short: zeros
                    data += bytes(n - len(data))
                s.hasher.update(data)
                await s.window.acquire()
                token = f"{req['id']}_{len(pending)}"
                fut = loop.create_future()
                fut.add_done_callback(lambda _: s.window.release())
                acks[token] = fut
                pending.append(fut)
                await nc.publish(subject, data, reply=f"{inbox}.{token}",
                                 headers={"Nats-Msg-Id": f"{req['session']}.{first_index + len(pending) - 1}"})
                pos += n
        finally:
            os.close(fd)
        s.next_start = end
        s.turn.notify_all()
    replies = await asyncio.wait_for(asyncio.gather(*pending), 30 + len(pending))
    for m in replies:
        if not m.data:
            status = (m.headers or {}).get("Status", "")
            code = 503 if status == "503" else int(status or 500)
            return {"error": {"description": f"no stream takes {subject}" if status == "503" else f"status {status}",
                              "code": code, "err_code": 0}}
        try:
            _parse_api_reply(m.data, subject)
        except JetStreamAPIError as e:
            return {"error": {"description": e.description, "code": e.code, "err_code": e.err_code}}
        except NatsFSError as e:
            return {"error": {"description": str(e), "code": 503, "err_code": 0}}
    return {"chunks": len(pending), "bytes": end - start}


async def _worker_main(servers: list[str]) -> None:
    import sys

    async def quiet(e: Exception) -> None:
        pass  # stderr is the daemon's; the daemon notices a dead worker and says so itself

    options: dict[str, Any] = dict(servers=servers, name="natsfs-upload-worker", pending_size=_PENDING_SIZE,
                                   error_cb=quiet, reconnect_time_wait=0.5, connect_timeout=5)
    try:
        # A probe that fails fast (nats-py retries a first connect forever otherwise): without a
        # server the worker just exits and the daemon publishes in-process.
        probe = await nats.connect(**options, allow_reconnect=False, max_reconnect_attempts=1)
        await probe.close()
        nc = await nats.connect(**options, allow_reconnect=True, max_reconnect_attempts=-1)
    except Exception:
        raise SystemExit(1) from None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    inbox = nc.new_inbox()
    acks: dict[str, asyncio.Future[Any]] = {}

    async def on_ack(m: Any) -> None:
        fut = acks.pop(m.subject[len(inbox) + 1:], None)
        if fut is not None and not fut.done():
            fut.set_result(m)

    await nc.subscribe(inbox + ".*", cb=on_ack, pending_bytes_limit=0)
    sessions: dict[str, _WorkerSession] = {}

    async def handle(req: dict[str, Any]) -> None:
        session = req.get("session", "")
        try:
            op = req["op"]
            if op == "send":
                s = sessions.setdefault(session, _WorkerSession(req.get("window", _WORKER_WINDOW)))
                body = await _worker_send(nc, req, s, inbox, acks)
            elif op == "digest":
                s = sessions.setdefault(session, _WorkerSession(_WORKER_WINDOW))
                body = {"digest": s.hasher.digest().hex(), "bytes": s.next_start}
            elif op == "drop":
                sessions.pop(session, None)
                body = {}
            else:
                body = {"error": {"description": f"unknown op {op}", "code": 400, "err_code": 0}}
        except Exception as e:  # the daemon falls back to publishing itself
            body = {"error": {"description": f"worker: {e!r}", "code": 503, "err_code": 0}}
        out.write(json.dumps({"id": req["id"], **body}).encode() + b"\n")
        out.flush()

    tasks = set()
    while line := await reader.readline():
        task = asyncio.ensure_future(handle(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    # stdin closed: the daemon is done with us. Don't linger if the server is gone.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.drain(), 1)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 1)


def _read_worker_servers(fd: int) -> list[str]:
    """The server URLs the daemon sends as the first line on the worker's stdin (never in argv: they may
    carry credentials). Read a byte at a time, so nothing after that line is taken from the pipe."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            raise SystemExit(1)  # the daemon went away before saying which servers
        line += byte
    return [str(s) for s in json.loads(line)["servers"]]


def _main() -> None:
    import sys

    if sys.argv[1:] == ["upload-worker"]:
        asyncio.run(_worker_main(_read_worker_servers(sys.stdin.fileno())))
    else:
        raise SystemExit('usage: python -I -m natsfs.bridge upload-worker  (stdin: {"servers": [URL, ...]} first)')


if __name__ == "__main__":
    _main()
