"""Every use of nats-py internals, in one place, checked once at start-up.

natsfs relies on a few things nats-py does not offer as API: the socket read size (a module global),
a hook into its message dispatch (to pace a subscription whose consumer falls behind, and to count
the bytes of a pull consumer's deliveries as the server counts them), the server's
INFO as sent (its limits), a subscription's id, the queue of publishes waiting for a flush (a
closed client never answers them), its transport and queue of bytes for the server (large
payloads are queued, or written by the upload worker, without being copied into their frames), and a
closed client's tasks and socket (its own close can stop half-way, see `end_client`), and the server's
INFO before CONNECT (to refuse sending credentials in clear when TLS is wanted, see `require_tls`) (and
a warning asyncio logs at the end of each of its TLS connections, see `_quiet_tls_eof_warning`). Each is reached
only through a function here, and `check()` verifies that the installed nats-py still has them before
anything connects, so an incompatible upgrade fails the mount at start with one sentence instead of
misbehaving later.
`pyproject.toml` pins nats-py below the first version not checked against this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.aio.client
import nats.aio.subscription
import nats.errors

from .errors import NatsFSError

# The nats-py versions this module was checked against (keep in step with pyproject.toml).
SUPPORTED = ((2, 9), (2, 17))

# nats-py reads its socket 32 KiB at a time through a StreamReader limited to 32 KiB, so a 128 KiB
# chunk costs four reads and as many pause/resume cycles of the selector. Reading 1 MiB at a time
# makes bulk transfers markedly cheaper; the value is a module global nats-py reads at call time.
READ_BUFFER = 1024 * 1024

_PROCESS_MSG_PARAMS = ["self", "sid", "subject", "reply", "data", "headers"]
# A client's own tasks: the socket reader, the flusher, the pinger, and nats-py's reconnecting.
_CLIENT_TASKS = ("_reading_task", "_flusher_task", "_ping_interval_task", "_reconnection_task")


class IncompatibleNatsPy(NatsFSError):
    """The installed nats-py lacks something natsfs patches or reads."""


def _version() -> tuple[int, ...]:
    try:
        text = importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _info_before_connect() -> bool:
    """nats-py's handshake hands the first INFO to `_process_info` before it writes CONNECT (what
    `require_tls` relies on)."""
    try:
        source = inspect.getsource(nats.aio.client.Client._process_connect_init)
    except (AttributeError, OSError, TypeError):
        return False
    info_at = source.find("self._process_info(srv_info, initial_connection=True)")
    connect_at = source.find("self._connect_command()")
    return 0 <= info_at < connect_at


def check() -> None:
    """Raise `IncompatibleNatsPy` (one sentence) unless nats-py has everything this module uses."""
    version = _version()
    wanted = f"natsfs needs nats-py >={'.'.join(map(str, SUPPORTED[0]))},<{'.'.join(map(str, SUPPORTED[1]))}"
    if version and not (SUPPORTED[0] <= version < SUPPORTED[1]):
        raise IncompatibleNatsPy(f"{wanted}, found {'.'.join(map(str, version))}")
    missing = []
    if not isinstance(getattr(nats.aio.client, "DEFAULT_BUFFER_SIZE", None), int):
        missing.append("nats.aio.client.DEFAULT_BUFFER_SIZE")
    process = getattr(nats.aio.client.Client, "_process_msg", None)
    if not (inspect.iscoroutinefunction(process)
            and list(inspect.signature(process).parameters)[:6] == _PROCESS_MSG_PARAMS):
        missing.append("Client._process_msg(sid, subject, reply, data, headers)")
    client = nats.aio.client.Client()
    if not isinstance(getattr(client, "_server_info", None), dict):
        missing.append("Client._server_info")
    if not hasattr(client, "_flush_queue"):
        missing.append("Client._flush_queue")
    if not (hasattr(client, "_transport") and isinstance(getattr(client, "_pending", None), list)
            and isinstance(getattr(client, "_pending_data_size", None), int)
            and isinstance(getattr(client, "_max_pending_size", None), int)
            and inspect.iscoroutinefunction(getattr(client, "_flush_pending", None))):
        missing.append("Client._transport, _pending, _pending_data_size, _max_pending_size, _flush_pending")
    for name in (*_CLIENT_TASKS, "_subs", "_error_cb", "_current_server"):
        if not hasattr(client, name):
            missing.append(f"Client.{name}")
    if not inspect.iscoroutinefunction(getattr(nats.aio.client.Client, "_close", None)):
        missing.append("Client._close")
    process_info = getattr(nats.aio.client.Client, "_process_info", None)
    if not (inspect.iscoroutinefunction(process_info)
            and list(inspect.signature(process_info).parameters)[:3] == ["self", "info", "initial_connection"]
            and _info_before_connect()):
        missing.append("Client._process_info(info, initial_connection), called before CONNECT is written")
    sub = nats.aio.subscription.Subscription(None)
    if not isinstance(getattr(sub, "_id", None), int):
        missing.append("Subscription._id")
    for name in ("_wait_for_msgs_task", "_message_iterator", "_pending_next_msgs_calls"):
        if not hasattr(sub, name):
            missing.append(f"Subscription.{name}")
    if missing:
        raise IncompatibleNatsPy(f"{wanted}: the installed nats-py lacks {', '.join(missing)}")
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, READ_BUFFER)
    _quiet_tls_eof_warning()


# nats-py goes TLS by `start_tls` with a new `StreamReaderProtocol` whose `connection_made` is never called,
# so that protocol believes it is not over SSL and answers the end of every TLS connection (an unmount,
# a server going away, each `natsfs bucket` command) with `eof_received() -> True`, which asyncio's SSL
# transport reports as a WARNING: a line in the log, and on stderr, for nothing that went wrong.
_TLS_EOF_WARNING = "returning true from eof_received() has no effect when using ssl"


def _not_the_tls_eof_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != _TLS_EOF_WARNING


def _quiet_tls_eof_warning() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if _not_the_tls_eof_warning not in asyncio_log.filters:
        asyncio_log.addFilter(_not_the_tls_eof_warning)


class TlsNotOffered(nats.errors.Error):
    """TLS is wanted, and the server's INFO offers none: refused before CONNECT (credentials) is sent."""


def require_tls(nc: Any, reason: str) -> None:
    """Make this (not yet connected) client go TLS whatever the server's INFO says: nats-py upgrades
    only when the INFO says `tls_required`, and otherwise sends CONNECT, credentials and all, in clear.
    Its handshake hands the INFO to `_process_info` after reading it and before deciding on TLS and
    writing CONNECT: there a server that only offers TLS (`tls_available`) is marked as requiring it
    (nats-py upgrades to it), and one that does not offer it at all fails the connect with
    `TlsNotOffered(reason)`, its socket closed, before anything else is written. Only the first INFO
    of a handshake is checked (later ones are cluster updates over the established connection); the
    bridge never lets nats-py reconnect (each new connection is a new client, hooked anew)."""
    process_info = nc._process_info

    async def process_info_requiring_tls(info: dict[str, Any], initial_connection: bool = False) -> None:
        scheme = nc._current_server.uri.scheme if nc._current_server is not None else ""
        if initial_connection and scheme == "ws":  # (nats-py never goes TLS on a ws:// connection)
            with contextlib.suppress(Exception):
                nc._transport.close()
            raise TlsNotOffered(f"{reason} (a ws:// URL is never TLS: use wss://)")
        if initial_connection and scheme != "wss" and not info.get("tls_required"):  # (wss: TLS already)
            if not info.get("tls_available"):
                with contextlib.suppress(Exception):
                    nc._transport.close()
                raise TlsNotOffered(reason)
            info["tls_required"] = True  # (the dict nats-py keeps as `_server_info` and decides by)
        await process_info(info, initial_connection)

    nc._process_info = process_info_requiring_tls


def server_info(nc: Any) -> dict[str, Any]:
    """The INFO the server sent on this connection (limits such as `max_payload`), as a copy."""
    return dict(nc._server_info or {})


def release_flushes(nc: Any) -> None:
    """Let publishes waiting for a forced flush of a closed client return: its flusher is gone, and
    without `flush_timeout` they would wait forever (and hold whatever their caller holds)."""
    queue = getattr(nc, "_flush_queue", None)
    while queue is not None and not queue.empty():
        waiting = queue.get_nowait()
        if not waiting.done():
            waiting.set_result(None)


def subscription_id(sub: Any) -> int:
    """The protocol id (sid) of a nats-py subscription: the key `hook_messages` callbacks get."""
    return int(sub._id)


def hook_messages(nc: Any, after: Callable[[int, bytes, int], Awaitable[None] | None]) -> None:
    """Call `after(sid, reply, size)` once each message has been handed to its subscription, in the
    connection's reader: `size` is what the server counts of it against a pull request's `max_bytes`
    (subject, reply subject, header block as sent, payload). A returned awaitable is awaited there,
    holding the reader (and the socket) for that long."""
    process = nc._process_msg

    async def process_msg(sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        await process(sid, subject, reply, data, headers)
        waiting = after(sid, reply, len(subject) + len(reply) + len(headers or b"") + len(data))
        if waiting is not None:
            await waiting

    nc._process_msg = process_msg


async def raw_transport(nc: Any, timeout: float) -> Any | None:
    """The transport nats-py writes `nc`'s protocol to, for frames the caller builds itself (the upload
    worker's chunk publishes: nats-py would copy each payload three times, joining it with its header
    and then with every other pending frame). Whatever nats-py still holds for the server (a
    subscription, a pong) is flushed first, so nothing the caller writes can overtake it; nats-py's own
    writes are whole frames too, so frames never interleave. None for a transport without
    `write`/`drain` (websocket): then publish through nats-py."""
    transport = nc._transport
    if transport is None or not hasattr(transport, "write") or not hasattr(transport, "drain"):
        return None
    if nc._pending_data_size:
        await nc.flush(timeout)
    return transport


# Payloads from this size on are queued without being joined to their frame (`publish`).
_LARGE_PAYLOAD = 64 * 1024


async def publish(nc: Any, subject: str, payload: bytes, *, reply: str, headers: dict[str, str] | None) -> None:
    """`nc.publish`, but a large payload is not copied into a new frame: nats-py's `publish` joins the
    frame's header, payload and CRLF into new bytes (two copies of the payload). Here the three parts
    are queued as they are, together (no await in between, so no other frame can come between them),
    for nats-py's flusher, which writes them with everything else pending. Same errors as `publish`
    (nats-py's own validation is skipped: our subjects and headers are our own)."""
    if len(payload) < _LARGE_PAYLOAD or not isinstance(nc, nats.aio.client.Client):
        await nc.publish(subject, payload, reply=reply, headers=headers)
        return
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if len(payload) > nc.max_payload:
        raise nats.errors.MaxPayloadError
    if headers:
        header = b"NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n"
        line = b"HPUB %s %s %d %d\r\n%s" % (subject.encode(), reply.encode(), len(header), len(header) + len(payload),
                                              header)
    else:
        line = b"PUB %s %s %d\r\n" % (subject.encode(), reply.encode(), len(payload))
    nc._pending += (line, payload, b"\r\n")
    nc._pending_data_size += len(line) + len(payload) + 2
    if nc._max_pending_size > 0 and nc._pending_data_size > nc._max_pending_size:
        await nc._flush_pending(force_flush=True)
    elif nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


def guard_close(nc: Any) -> None:
    """Keep nats-py's closing of this client from ending in an exception nobody retrieves.

    nats-py closes a client in `_close`, run in its socket reader (after a read error) or in a task of
    its own that nothing keeps (after `-ERR`). Its last flush to a socket the server already reset
    raises there, and the exception ends the task: asyncio reports it when the task is collected. Such
    a close stopped half-way is finished by `end_client`."""
    close = nc._close

    async def close_guarded(status: int, do_cbs: bool = True) -> None:
        try:
            await close(status, do_cbs)
        except Exception as e:  # (OSError, mostly) the client is closed either way
            with contextlib.suppress(Exception):
                await nc._error_cb(e)

    nc._close = close_guarded


def closing_task(nc: Any) -> asyncio.Task[Any] | None:
    """The task in which nats-py may still be closing this client (its socket reader), unless done."""
    task = nc._reading_task
    return task if task is not None and not task.done() else None


def end_client(nc: Any) -> list[asyncio.Future[Any]]:
    """End whatever of a closed client still runs, which nats-py's close leaves when it stopped half-way
    (its final flush failed or waits on a dead socket): cancel its tasks, its subscriptions' message
    tasks, iterators and `next_msg` waits, drop its subscriptions and its unsent publishes, abort its
    socket. Returns every task and future of the client, for the caller to await (so none is destroyed
    pending, and exceptions they ended with count as retrieved)."""
    ended: list[asyncio.Future[Any]] = []
    for name in _CLIENT_TASKS:
        task = getattr(nc, name, None)
        if task is not None:
            task.cancel()
            ended.append(task)
    for sub in list(nc._subs.values()):
        if sub._wait_for_msgs_task is not None:
            sub._wait_for_msgs_task.cancel()
            ended.append(sub._wait_for_msgs_task)
        if sub._message_iterator is not None:
            sub._message_iterator._cancel()
        for waiting in list((sub._pending_next_msgs_calls or {}).values()):
            waiting.cancel()
            ended.append(waiting)
        if sub._pending_next_msgs_calls:
            sub._pending_next_msgs_calls.clear()
    nc._subs.clear()
    nc._pending, nc._pending_data_size = [], 0
    transport = nc._transport
    writer = getattr(transport, "_io_writer", None)
    with contextlib.suppress(Exception):
        if writer is not None:
            writer.transport.abort()
        elif transport is not None:
            transport.close()
    release_flushes(nc)
    return ended
