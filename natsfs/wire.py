"""A lean NATS client connection for bulk replies: part of the bridge layer (only bridge.py imports it).

The daemon's reads arrive as batched direct-get replies of 128 KiB chunks. nats-py receives them through
a StreamReader, its own parser and per-message tasks, copying each byte about five times and running
Python per message that the daemon's one GIL pays for. `WireProtocol` is an `asyncio.BufferedProtocol`
that speaks just what a request/reply client needs: it parses the control lines (INFO, MSG, HMSG, PING,
PONG, +OK, -ERR) from one buffer, and `recv_into`s the rest of a large payload straight into the
`bytearray` it is handed over in, so most payload bytes are copied once (kernel to that buffer) and
none more than twice. It sends requests (PUB/HPUB) with a reply subject under its own inbox, which it
subscribes to once; replies go to one callback, synchronously, as they are parsed.

`connect` dials one server the way nats-py does for the same `auth.Connection`: TLS when the server's
INFO requires it, or when TLS is wanted (a `tls://` URL or a TLS option: `auth.tls_wanted`) and the
server offers it (with the configured CA and client certificate, or the system's trust store; a server
that does not offer wanted TLS is refused before CONNECT, so before any credential, is sent),
user/password, token (the URL's userinfo first: `Connection.for_server`), NKey seed or creds file (signing the server's
nonce with `nkeys`), and the same connection name. Nothing here reconnects: a connection that fails
calls its `on_closed` once, and the bridge's `_Link` replaces it, as it does nats-py clients. `-ERR`
closes the connection, as nats-py does, except a permissions violation (`-ERR 'Permissions Violation for
Publish to "<subject>"'`, or `for Subscription to`): the server refused that one message and keeps the
connection, so this does too, and hands the refusal to `on_refused` (as nats-py hands it to its error
callback), whose caller fails the request waiting on that subject. No message raised or kept here
contains a credential.

`connect_trio` and `TrioWireConnection` drive the same `WireProtocol` from the trio thread instead
(the bridge's `_TrioReads`): a non-blocking socket read by one task, with requests written from the
calling task, so a read's request and replies never cross to the asyncio thread. The handshake and
the CONNECT fields and TLS are the same (TLS through an `ssl.SSLObject` over memory buffers, which
decrypts straight into the buffers the protocol offers). It also subscribes subjects of its own beside
the inbox (`TrioWireConnection.subscribe`) for the deliveries of a JetStream pull consumer (a headers-only
scan: thousands of ~150-byte messages), handed with their reply subjects to a `DeliverySink`: a run of
plain headers-only frames is parsed one regular-expression match each (`_HEADERS_ONLY`, whose byte counts
are checked against what matched) and handed over as one list, anything else as a reply is.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast
from urllib.parse import unquote, urlsplit

import trio

from .auth import NO_TLS, Connection, tls_wanted

log = logging.getLogger(__name__)

# Control lines (and small payloads, and the first bytes of large ones) are read into a buffer of this
# size; the rest of a payload that does not fit is read straight into its own buffer.
CONTROL_BUFFER = 64 * 1024
# After a large payload the next one is likely large too: the next read into the control buffer asks
# for this much only (its control line and headers, a few hundred bytes), so that the next payload
# arrives in its own buffer instead of being copied there from the control buffer.
CONTROL_READ_AFTER_LARGE = 2048
# A control line longer than this is a protocol error (the server's INFO in a large cluster is the
# longest line a client gets; the server's own limit for lines it reads is 4 KiB).
MAX_CONTROL_LINE = 1024 * 1024
# `TrioWireConnection.answers` looks this often whether the server said anything.
_ANSWER_POLL_S = 0.02
# Client pings: one every this many seconds, and the connection is taken as dead when two in a row
# go unanswered (as the nats-py connection is configured by the bridge).
PING_INTERVAL = 30.0
MAX_OUTSTANDING_PINGS = 2
# The trio reader lets other tasks run after this many bytes (and whenever the socket is empty).
YIELD_EVERY = 1024 * 1024
_DEFAULT_PORT = 4222
_CRLF = b"\r\n"
_HEADER_LINE = "NATS/1.0"


def _payload_buffer_factory() -> Callable[[int], bytearray]:
    """`bytearray(size)` zero-fills its buffer, only for the socket to overwrite every byte of it: a
    pass over each payload that cost 3-5 % of the daemon's cycles in a cold read (`perf`). CPython's
    `PyByteArray_FromStringAndSize(NULL, size)` allocates without filling. A buffer made so is handed on
    only once every byte of it was received (`_finish_target`); one left half-filled by a lost
    connection is dropped with it. Elsewhere (no `pythonapi`), plain `bytearray`."""
    try:
        import ctypes

        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
        make.restype = ctypes.py_object
        make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    except (ImportError, AttributeError, OSError):
        return bytearray

    def uninitialized(size: int) -> bytearray:
        buf = make(None, size)
        if type(buf) is not bytearray or len(buf) != size:  # never seen; belt and braces
            return bytearray(size)
        return buf

    return uninitialized


payload_buffer = _payload_buffer_factory()

# on_msg(subject, headers, data): headers as a dict (with `Status` and `Description` for an inline
# status such as `404 No Messages`), None when the message has none.
OnMsg = Callable[[str, dict[str, str] | None, bytes | bytearray], None]


# on_refused(kind, subject): the server refused one message ("publish") or subscription ("subscription")
# on that subject for the user's permissions; the connection stays.
OnRefused = Callable[[str, str], None]


class DeliverySink(Protocol):
    """Where the messages on a subscription of the connection's own besides its reply inbox go (the
    deliveries of a JetStream consumer: `TrioWireConnection.subscribe`), with their reply subjects
    (a delivery's `$JS.ACK...` subject says its stream and consumer sequences and what is pending)."""

    def headers_only(self, rows: list[tuple[bytes, bytes, int, int]]) -> None:
        """Headers-only deliveries (subject, reply, `Nats-Msg-Size`: the size of the message each stands
        for, and the frame's header bytes) whose whole header block is that size, as the server sends
        them for messages without headers: the common case, parsed in one regular-expression match each
        (see `_HEADERS_ONLY`), handed over a run at a time. The list is the sink's to keep."""

    def message(self, subject: str, reply: str, headers: dict[str, str] | None, data: bytes | bytearray,
                header_size: int) -> None:
        """Any other message (more headers, a payload, a status), parsed as a reply is, except that a
        repeated header keeps its last value (the server appends `Nats-Msg-Size` to the message's own
        headers, which may hold one too); `header_size`: the bytes of its header block as sent."""


# A headers-only delivery of a message without headers of its own, in one piece: `HMSG <subject> <sid>
# <reply> <#header bytes> <#total bytes>`, the header block `NATS/1.0`, `Nats-Msg-Size: <n>`, and no payload.
# The byte counts are checked against what matched (the header block's length, no payload), so the
# frame is the server's own and not text inside another message's headers.
_HEADERS_ONLY = re.compile(rb"HMSG ([^ \r\n]+) (\d+) ([^ \r\n]+) (\d+) (\d+)\r\nNATS/1\.0\r\n"
                           rb"Nats-Msg-Size: (\d{1,18})\r\n\r\n\r\n")
# The length of such a header block besides the size's digits: `NATS/1.0\r\nNats-Msg-Size: ` and two CRLFs.
_HEADERS_ONLY_FIXED = len(b"NATS/1.0\r\nNats-Msg-Size: \r\n\r\n")
# The sid of the reply inbox's subscription (every other sid is a `DeliverySink`'s).
INBOX_SID = b"1"


class WireError(Exception):
    """The connection failed or is closed; the text names no credential."""


# The server's text: `Permissions Violation for Publish to "<subject>"` or `... for Subscription to
# "<subject>"` (with ` using queue "<queue>"` after a queue subscription's). nats-py lowercases the whole
# line before its error callback sees it, so this matches either case.
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "?([^"\s]+)"?', re.IGNORECASE)


def parse_permission_violation(text: str) -> tuple[str, str] | None:
    """The kind ("publish" or "subscription") and subject of a permissions violation the server reported
    (an `-ERR` line's text, quoted or not, or nats-py's `nats: ...` error); None for any other error."""
    m = _VIOLATION.search(text)
    if m is None:
        return None
    return m.group(1).lower(), m.group(2)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One server URL, taken apart as nats-py does (no scheme means `nats://`, port 4222)."""

    host: str
    port: int
    scheme: str
    user: str | None
    password: str | None


def parse_server(url: str) -> Endpoint:
    parts = urlsplit(url if "://" in url else "nats://" + url)
    try:
        port = parts.port or _DEFAULT_PORT
    except ValueError:
        raise WireError("invalid port in the server URL") from None
    return Endpoint(parts.hostname or "localhost", port, parts.scheme.lower(),
                    unquote(parts.username) if parts.username is not None else None,
                    unquote(parts.password) if parts.password is not None else None)


def unsupported(servers: tuple[str, ...] | list[str], auth: Connection | None) -> str | None:
    """Why these servers and credentials cannot use this connection (the bridge then reads through
    nats-py); None when they can."""
    for server in servers:
        try:
            scheme = parse_server(server).scheme
        except WireError as e:
            return str(e)
        if scheme not in ("nats", "tls"):
            return f"{scheme}:// servers"
    if auth is not None and (auth.nkey_file or auth.creds_file) and importlib.util.find_spec("nkeys") is None:
        return "NKey authentication without the nkeys package"
    return None


def parse_headers(raw: bytes, *, last_wins: bool = False) -> dict[str, str] | None:
    """A header block (`NATS/1.0[ status[ description]]\\r\\nKey: Value\\r\\n...\\r\\n\\r\\n`) as a dict,
    the first value of a repeated key (the last with `last_wins`, as nats-py keeps them); an inline
    status becomes `Status` (and `Description`)."""
    lines = raw.decode("utf-8", "replace").split("\r\n")
    headers: dict[str, str] = {}
    first = lines[0]
    if first.startswith(_HEADER_LINE):
        code, _, description = first[len(_HEADER_LINE):].strip().partition(" ")
        if code:
            headers["Status"] = code
            if description.strip():
                headers["Description"] = description.strip()
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key and (last_wins or key not in headers):
            headers[key] = value.strip()
    return headers or None


def encode_headers(headers: dict[str, str]) -> bytes:
    return (_HEADER_LINE + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


class WireProtocol(asyncio.BufferedProtocol):
    """The protocol side of one connection: parses what the server sends, answers its pings, sends ours."""

    def __init__(self, on_msg: OnMsg, on_closed: Callable[[WireProtocol], None],
                 on_refused: OnRefused | None = None):
        self._on_msg = on_msg
        self._on_closed = on_closed
        self._on_refused = on_refused
        # The first subscription the server refused (during the handshake: the reply inbox, which leaves
        # the connection useless; the handshake fails with it).
        self.refused_subscription: str | None = None
        self._buf = bytearray(CONTROL_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        # A message whose header block is not complete yet: (subject, header bytes, total bytes, sid,
        # reply subject).
        self._head: tuple[str, int, int, bytes, str] | None = None
        # Subscriptions besides the reply inbox, by sid (`TrioWireConnection.subscribe`).
        self.deliveries: dict[bytes, DeliverySink] = {}
        # The payload being read straight into place: its buffer, how much of it is there, and the
        # message it belongs to.
        self._target: memoryview | None = None
        self._target_pos = 0
        self._target_msg: tuple[str, dict[str, str] | None, bytearray, bytes, str, int] | None = None
        self._skip = 0  # bytes of a payload's trailing CRLF still to come
        self._read_size = CONTROL_BUFFER  # the most one read into the control buffer asks for
        self.transport: asyncio.Transport | None = None
        self.info: dict[str, Any] = {}
        self.last_error: str | None = None
        self.closed = False
        self._info_wait: asyncio.Future[dict[str, Any]] | None = None
        self._pong_waits: list[asyncio.Future[None]] = []
        self._pings_out = 0
        self.pongs = 0  # PONGs received (the trio driver's handshake waits for the first)
        self._ping_timer: asyncio.TimerHandle | None = None

    # ---- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._target_pos:]
        if self._end == len(self._buf):
            self._make_room()
        return self._view[self._end : self._end + self._read_size]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._target is not None:
                self._target_pos += nbytes
                if self._target_pos < len(self._target):
                    return
                self._finish_target()
            else:
                self._end += nbytes
            self._parse()
        except WireError as e:
            self._fail(str(e))
        except Exception as e:  # a fault of ours: end this connection (the bridge makes a new one), loudly
            log.exception("reading from NATS failed unexpectedly")
            self._fail(f"internal error: {e!r}")

    def eof_received(self) -> bool | None:
        self.last_error = self.last_error or "the server closed the connection"
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.last_error is None:
            self.last_error = str(exc) if exc is not None and str(exc) else "connection closed"
        if self._ping_timer is not None:
            self._ping_timer.cancel()
        error = WireError(self.last_error)
        for fut in [self._info_wait, *self._pong_waits]:
            if fut is not None and not fut.done():
                fut.set_exception(error)
        self._pong_waits.clear()
        self._on_closed(self)

    # ---- parsing
    def _make_room(self) -> None:
        """Free the parsed part of the control buffer; grow it when one unparsed line fills it."""
        pending = self._end - self._start
        if self._start == 0:
            if pending >= MAX_CONTROL_LINE:
                raise WireError("protocol error: control line too long")
            bigger = bytearray(len(self._buf) * 2)
            bigger[:pending] = self._view[:pending]
            self._buf, self._view = bigger, memoryview(bigger)
        else:
            self._buf[:pending] = self._view[self._start:self._end]
            self._start, self._end = 0, pending

    def _parse(self) -> None:
        buf, view = self._buf, self._view
        while True:
            if self._skip:
                n = min(self._skip, self._end - self._start)
                self._start += n
                self._skip -= n
                if self._skip:
                    break
            if self._head is not None:
                if not self._take_payload():
                    break
                continue
            start = self._start
            if self.deliveries and buf.startswith(b"HMSG ", start) and self._headers_only(start):
                continue
            eol = buf.find(_CRLF, start, self._end)
            if eol < 0:
                break
            line = bytes(view[start:eol])
            self._start = eol + 2
            self._control(line)
        if self._start == self._end:
            self._start = self._end = 0

    def _headers_only(self, start: int) -> bool:
        """Hand the whole headers-only deliveries from `start` on to their sinks, a run of them per
        call, each parsed in one match (see `_HEADERS_ONLY`); False (nothing taken) when the first is
        not one, which the general parser then takes."""
        buf, end, match, deliveries = self._buf, self._end, _HEADERS_ONLY.match, self.deliveries
        pos = start
        sink: DeliverySink | None = None
        rows: list[tuple[bytes, bytes, int, int]] = []
        while (m := match(buf, pos, end)) is not None:
            subject, sid, reply, header_size, total, size = m.groups()
            to = deliveries.get(sid)
            if to is None or header_size != total or int(header_size) != _HEADERS_ONLY_FIXED + len(size):
                break
            if to is not sink:
                if sink is not None:
                    sink.headers_only(rows)
                    rows = []
                sink = to
            rows.append((subject, reply, int(size), _HEADERS_ONLY_FIXED + len(size)))
            pos = m.end()
        if sink is None:
            return False
        self._start = pos
        self._read_size = CONTROL_BUFFER
        sink.headers_only(rows)
        return True

    def _control(self, line: bytes) -> None:
        op, _, args = line.partition(b" ")
        op = op.upper()
        if op == b"MSG":
            # MSG <subject> <sid> [reply-to] <#bytes>
            parts = args.split()
            if len(parts) not in (3, 4):
                raise WireError("protocol error: malformed MSG")
            self._head = (parts[0].decode(), 0, int(parts[-1]), parts[1],
                          parts[2].decode() if len(parts) == 4 else "")
        elif op == b"HMSG":
            # HMSG <subject> <sid> [reply-to] <#header bytes> <#total bytes>
            parts = args.split()
            if len(parts) not in (4, 5):
                raise WireError("protocol error: malformed HMSG")
            self._head = (parts[0].decode(), int(parts[-2]), int(parts[-1]), parts[1],
                          parts[2].decode() if len(parts) == 5 else "")
        elif op == b"PING":
            self._write(b"PONG\r\n")
        elif op == b"PONG":
            self._pings_out = 0
            self.pongs += 1
            if self._pong_waits:
                fut = self._pong_waits.pop(0)
                if not fut.done():
                    fut.set_result(None)
        elif op == b"INFO":
            try:
                info = json.loads(args)
            except ValueError:
                raise WireError("protocol error: unreadable INFO") from None
            if not self.info:
                self.info = info
            if self._info_wait is not None and not self._info_wait.done():
                self._info_wait.set_result(info)
        elif op == b"-ERR":
            text = args.decode("utf-8", "replace").strip().strip("'")
            violation = parse_permission_violation(text)
            if violation is None:
                raise WireError("nats: " + text)
            # One message refused, the connection kept (by the server and by nats-py alike).
            kind, subject = violation
            if kind == "subscription" and self.refused_subscription is None:
                self.refused_subscription = subject
            if self._on_refused is not None:
                self._on_refused(kind, subject)
        elif op != b"+OK":
            raise WireError("protocol error: unknown operation from the server")
        if self._head is not None and (self._head[1] < 0 or self._head[2] < self._head[1]):
            raise WireError("protocol error: bad message sizes")

    def _take_payload(self) -> bool:
        """Take the message in `_head` from the buffer; False while its header block is incomplete."""
        assert self._head is not None
        subject, header_size, total, sid, reply = self._head
        start, end = self._start, self._end
        if end - start < header_size:
            if header_size > len(self._buf) - start:
                self._make_room()
                if header_size > len(self._buf):
                    bigger = bytearray(header_size + CONTROL_BUFFER)
                    bigger[: self._end] = self._view[: self._end]
                    self._buf, self._view = bigger, memoryview(bigger)
            return False
        self._head = None
        # (A delivery's headers keep the last value of a repeated key: a headers-only delivery of a message
        # that had a `Nats-Msg-Size` of its own carries that one first and the server's after it.)
        headers = (parse_headers(bytes(self._view[start : start + header_size]), last_wins=sid != INBOX_SID)
                   if header_size else None)
        start += header_size
        size = total - header_size
        have = min(size, end - start)
        if size == 0:
            self._start = start
            self._skip = 2
            self._dispatch(subject, headers, b"", sid, reply, header_size)
            return True
        data = payload_buffer(size)  # (not zero-filled: `have` bytes now, the rest straight from the socket)
        data[:have] = self._view[start : start + have]
        self._start = start + have
        self._read_size = CONTROL_READ_AFTER_LARGE if size >= CONTROL_BUFFER else CONTROL_BUFFER
        if have < size:
            self._target, self._target_pos = memoryview(data), have
            self._target_msg = (subject, headers, data, sid, reply, header_size)
            return False
        self._skip = 2
        self._dispatch(subject, headers, data, sid, reply, header_size)
        return True

    def _finish_target(self) -> None:
        assert self._target_msg is not None
        subject, headers, data, sid, reply, header_size = self._target_msg
        self._target, self._target_msg = None, None
        self._start = self._end = 0
        self._skip = 2
        self._dispatch(subject, headers, data, sid, reply, header_size)

    def _dispatch(self, subject: str, headers: dict[str, str] | None, data: bytes | bytearray, sid: bytes,
                  reply: str, header_size: int) -> None:
        """A whole message: the reply inbox's to `on_msg`, a delivery to its sink; one for a subscription
        since ended (`TrioWireConnection.unsubscribe`: the server may have sent it before it knew) is dropped."""
        if sid == INBOX_SID:
            self._on_msg(subject, headers, data)
            return
        sink = self.deliveries.get(sid)
        if sink is not None:
            sink.message(subject, reply, headers, data, header_size)

    # ---- sending
    def write_control(self, line: bytes) -> None:
        """Send a protocol line as it is (SUB, UNSUB); `WireError` if the connection is closed."""
        self._write(line)

    def _write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise WireError(self.last_error or "connection closed")
        self.transport.write(data)

    def publish(self, subject: str, payload: bytes, reply: str, headers: dict[str, str] | None) -> None:
        subject = f"{subject} {reply}" if reply else subject  # "<subject>[ <reply-to>]" on the line
        limit = int(self.info.get("max_payload") or 0)
        if headers:
            head = encode_headers(headers)
            size = len(head) + len(payload)
            if limit and size > limit:
                raise WireError("maximum payload exceeded")
            self._write(b"".join((f"HPUB {subject} {len(head)} {size}\r\n".encode(), head, payload,
                                  _CRLF)))
        else:
            if limit and len(payload) > limit:
                raise WireError("maximum payload exceeded")
            self._write(b"".join((f"PUB {subject} {len(payload)}\r\n".encode(), payload, _CRLF)))

    def _ping(self) -> None:
        self._ping_timer = None
        if self.ping_due():
            self._ping_timer = asyncio.get_running_loop().call_later(PING_INTERVAL, self._ping)

    def ping_due(self) -> bool:
        """Send the periodic PING, or end a connection whose last pings went unanswered; False once
        the connection is closed."""
        if self.closed:
            return False
        if self._pings_out >= MAX_OUTSTANDING_PINGS:
            self._fail("nats: stale connection")
            return False
        self._pings_out += 1
        with contextlib.suppress(WireError):
            self._write(b"PING\r\n")
        return True

    def _fail(self, reason: str) -> None:
        self.last_error = self.last_error or reason
        if self.transport is not None:
            self.transport.abort()

    # ---- the handshake (see `connect`)
    async def wait_info(self) -> dict[str, Any]:
        if self.info:
            return self.info
        self._info_wait = asyncio.get_running_loop().create_future()
        return await self._info_wait

    async def ping(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pong_waits.append(fut)
        self._write(b"PING\r\n")
        await fut

    def start_pinging(self) -> None:
        self._ping_timer = asyncio.get_running_loop().call_later(PING_INTERVAL, self._ping)


class _ConnectionState:
    """What the bridge reads of either kind of connection."""

    _protocol: WireProtocol

    @property
    def is_closed(self) -> bool:
        return self._protocol.closed

    @property
    def last_error(self) -> str | None:
        return self._protocol.last_error

    @property
    def server_info(self) -> dict[str, Any]:
        return dict(self._protocol.info)


class WireConnection(_ConnectionState):
    """One connected client: requests out, replies (on its inbox) to `on_msg`. The bridge's `_Link`
    drives it through the same few calls it makes of a nats-py client."""

    def __init__(self, protocol: WireProtocol, inbox: str):
        self._protocol = protocol
        self.inbox = inbox  # replies come to `<inbox>.<token>`

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """Send a message (a request, when `reply` is under the inbox); `WireError` if it cannot be."""
        self._protocol.publish(subject, payload, reply, headers)

    async def close(self) -> None:
        protocol = self._protocol
        protocol.last_error = protocol.last_error or "closed by the client"
        if protocol.transport is not None:
            protocol.transport.close()

    drain = close  # nothing of ours is buffered that the server still needs


def _connect_options(info: dict[str, Any], endpoint: Endpoint, auth: Connection | None, name: str) -> dict[str, Any]:
    """CONNECT's fields, chosen the way nats-py chooses them for the same settings."""
    options: dict[str, Any] = {"verbose": False, "pedantic": False, "lang": "python3", "version": "natsfs-wire",
                               "protocol": 1, "headers": True, "no_responders": True, "name": name}
    if not info.get("auth_required"):
        return options
    auth = auth or Connection()
    if info.get("nonce") and (auth.creds_file or auth.nkey_file):
        import nkeys  # type: ignore[import-untyped]

        if auth.creds_file:
            jwt, seed = _read_creds(auth.creds_file)
            options["jwt"] = jwt
        else:
            with open(auth.nkey_file or "", "rb") as f:
                seed = bytearray(f.read().strip())
        pair = nkeys.from_seed(seed)
        try:
            options["sig"] = base64.b64encode(pair.sign(info["nonce"].encode())).decode()
            if not auth.creds_file:
                options["nkey"] = pair.public_key.decode()
        finally:
            pair.wipe()
        if auth.token:
            options["auth_token"] = auth.token
    elif auth.user is not None and auth.password is not None:
        options["user"], options["pass"] = auth.user, auth.password
    elif auth.token is not None:
        options["auth_token"] = auth.token
    elif endpoint.user is not None:
        if endpoint.password is None:
            options["auth_token"] = endpoint.user
        else:
            options["user"], options["pass"] = endpoint.user, endpoint.password
    return options


def _upgrade_to_tls(info: dict[str, Any], url: str, auth: Connection | None) -> bool:
    """Whether to go TLS after the server's INFO: when the server requires it, or when TLS is wanted
    (`auth.tls_wanted`) and the server offers it (`tls_available`). `WireError` when TLS is wanted and
    the server does not offer it: nothing, no CONNECT and so no credential, has been sent yet."""
    if info.get("tls_required"):
        return True
    if not tls_wanted(url, auth):
        return False
    if info.get("tls_available"):
        return True
    raise WireError(NO_TLS)


def _read_creds(path: str) -> tuple[str, bytearray]:
    """The user JWT and NKey seed of a creds file (the line after each BEGIN marker)."""
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    jwt: str | None = None
    seed: bytearray | None = None
    for i, line in enumerate(lines[:-1]):
        if b"BEGIN NATS USER JWT" in line:
            jwt = lines[i + 1].strip().decode()
        elif b"BEGIN USER NKEY SEED" in line:
            seed = bytearray(lines[i + 1].strip())
    if jwt is None or seed is None:
        raise WireError(f"{path} is not a creds file (no user JWT or no NKey seed)")
    return jwt, seed


_C = TypeVar("_C")


def _protocol_reporting_to(on_msg: OnMsg, on_closed: Callable[[_C], None], on_refused: OnRefused | None
                           ) -> tuple[WireProtocol, list[_C]]:
    """A protocol whose end calls `on_closed` with the connection the caller puts into the list (once
    it is made: a handshake that fails reports nothing), and whose refusals go to `on_refused` (once it
    is made, too: the handshake's own, of the reply inbox, fail it instead)."""
    made: list[_C] = []

    def closed(_: WireProtocol) -> None:
        if made:
            on_closed(made[0])

    def refused(kind: str, subject: str) -> None:
        if made and on_refused is not None:
            on_refused(kind, subject)

    return WireProtocol(on_msg, closed, refused), made


def _check_inbox_taken(protocol: WireProtocol) -> None:
    """After the handshake's ping: a reply inbox the server refused to subscribe makes every request
    unanswerable, so the connection is not taken (`WireError` naming the refusal)."""
    if protocol.refused_subscription is not None:
        raise WireError(f"permission denied: the user may not subscribe to {protocol.refused_subscription}")


async def connect(url: str, *, name: str, auth: Connection | None, timeout: float, on_msg: OnMsg,
                  on_closed: Callable[[WireConnection], None], on_refused: OnRefused | None = None
                  ) -> WireConnection:
    """Connect to one server, authenticate, subscribe the reply inbox, and check with a ping that the
    server took all of it. `WireError` (or `OSError`, `ssl.SSLError`, `TimeoutError`) if that fails."""
    endpoint = parse_server(url)
    auth = auth.for_server(url) if auth is not None else None
    loop = asyncio.get_running_loop()
    inbox = f"_INBOX.{os.urandom(11).hex()}"
    protocol, connection = _protocol_reporting_to(on_msg, on_closed, on_refused)
    transport: asyncio.Transport | None = None
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(lambda: protocol, endpoint.host, endpoint.port)
            info = await protocol.wait_info()
            if _upgrade_to_tls(info, url, auth):
                wants_files = auth is not None and (auth.tls_ca or auth.tls_cert)
                context = auth.ssl_context() if auth is not None and wants_files else ssl.create_default_context()
                tls = await loop.start_tls(transport, protocol, context, server_hostname=endpoint.host)
                if tls is None:
                    raise WireError("TLS handshake failed")
                transport = protocol.transport = tls
            options = _connect_options(info, endpoint, auth, name)
            protocol.transport.write(b"CONNECT " + json.dumps(options).encode() + b"\r\nSUB "  # type: ignore[union-attr]
                                     + inbox.encode() + b".* 1\r\n")
            await protocol.ping()
            _check_inbox_taken(protocol)
    except BaseException:
        if transport is not None:
            transport.abort()
        raise
    conn = WireConnection(protocol, inbox)
    connection.append(conn)
    if protocol.closed:  # lost between the pong and now
        raise WireError(protocol.last_error or "connection closed")
    protocol.start_pinging()
    return conn


# ---------------------------------------------------------------------------------------------- trio
class _TrioTransport(asyncio.Transport):
    """What `WireProtocol` writes to when the trio thread drives the connection: a non-blocking socket,
    sent to at once; what the socket does not take at once waits for `TrioWireConnection`'s sender."""

    def __init__(self, sock: socket.socket, on_abort: Callable[[str | None], None]):
        super().__init__()
        self.sock = sock
        self.pending = bytearray()
        self.want_send = trio.Event()
        self.closing = False
        self._on_abort = on_abort
        # After a TLS handshake: what is written goes through `tls`, whose records leave by `outgoing`.
        self.tls: ssl.SSLObject | None = None
        self.outgoing: ssl.MemoryBIO | None = None

    def write(self, data: Any) -> None:
        if self.closing:
            return
        if self.tls is not None and self.outgoing is not None:
            try:
                self.tls.write(data)
            except ssl.SSLError as e:
                self.abort_with(f"TLS: {e}")
                return
            data = self.outgoing.read()
        self.send_raw(data)

    def send_raw(self, data: Any) -> None:
        """Send bytes as they are (TLS records, or the plain protocol)."""
        if self.closing or not data:
            return
        if not self.pending:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self.abort_with(f"sending to NATS failed: {e}")
                return
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        self.pending += data
        self.want_send.set()

    def abort_with(self, reason: str | None) -> None:
        if not self.closing:
            self.closing = True
            self.want_send.set()
            self._on_abort(reason)

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.abort_with(None)

    close = abort


class TrioWireConnection(_ConnectionState):
    """`WireProtocol` driven by the trio thread itself: replies are parsed and handed to `on_msg` in
    the task that reads the socket, and requests are written from the calling task, so a read crosses
    no thread (the asyncio one costs two hand-offs per request, about 0.1 ms each way on the test
    machine). `run` reads, sends what the socket did not take at once, and pings, until the
    connection ends; then `on_closed` is called once, as for `WireConnection`. TLS, when the server
    asks for it, goes through an `ssl.SSLObject` (`start_tls`)."""

    def __init__(self, sock: socket.socket, protocol: WireProtocol, inbox: str):
        self._sock = sock
        self._protocol = protocol
        self.inbox = inbox
        self._transport = _TrioTransport(sock, self._aborted)
        protocol.transport = self._transport
        self._closed_sock = False
        self._stop = trio.Event()
        self._unyielded = 0  # bytes read since the reader last let other tasks run
        self._incoming: ssl.MemoryBIO | None = None  # (TLS: what the socket brought, not yet decrypted)
        self._next_sid = int(INBOX_SID)  # (`subscribe`'s sids follow the inbox's)
        # Whether the server still answers (`silent_for`): when it last sent anything, and since when a
        # request sent after that has been waiting for it to say anything at all.
        self.heard_at = -math.inf
        self._waiting_since: float | None = None

    def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                headers: dict[str, str] | None = None) -> None:
        """Send a request now (what the socket does not take waits for `run`); `WireError` if the
        connection is closed or the message too large."""
        self._protocol.publish(subject, payload, reply, headers)
        if reply and (self._waiting_since is None or self.heard_at >= self._waiting_since):
            self._waiting_since = trio.current_time()

    def silent_for(self) -> float:
        """How long a request has been waiting without the server sending anything at all since it
        was sent (0 when the server spoke after the oldest such request, or none waits)."""
        since = self._waiting_since
        if since is None or self.heard_at >= since:
            return 0.0
        return trio.current_time() - since

    async def answers(self, timeout: float) -> bool:
        """Whether the server sends anything (the PONG to a PING sent now, or any other bytes)
        within `timeout`."""
        heard = self.heard_at
        try:
            self._protocol.write_control(b"PING\r\n")
        except WireError:
            return False
        with trio.move_on_after(timeout):
            while self.heard_at == heard:
                if self.is_closed:
                    return False  # (ended meanwhile: nothing more will come)
                await trio.sleep(_ANSWER_POLL_S)
            return True
        return False

    def subscribe(self, subject: str, sink: DeliverySink) -> int:
        """Subscribe `subject` (not under the reply inbox) for `sink`; its sid. `WireError` if the
        connection is closed. A refusal of the server comes later, to `on_refused`."""
        self._next_sid += 1
        sid = self._next_sid
        self._protocol.deliveries[str(sid).encode()] = sink
        try:
            self._protocol.write_control(f"SUB {subject} {sid}\r\n".encode())
        except WireError:
            del self._protocol.deliveries[str(sid).encode()]
            raise
        return sid

    def unsubscribe(self, sid: int) -> None:
        """End a `subscribe`: nothing more reaches its sink (what the server sent before it took the
        UNSUB is dropped)."""
        if self._protocol.deliveries.pop(str(sid).encode(), None) is not None:
            with contextlib.suppress(WireError):
                self._protocol.write_control(f"UNSUB {sid}\r\n".encode())

    def close(self) -> None:
        self._protocol.last_error = self._protocol.last_error or "closed by the client"
        self._transport.abort()

    def _aborted(self, reason: str | None) -> None:
        """The protocol or the transport gave up on the connection: wake every task of `run`."""
        if reason is not None:
            self._protocol.last_error = self._protocol.last_error or reason
        self._stop.set()
        if not self._closed_sock:
            self._closed_sock = True
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()

    async def receive_until(self, done: Callable[[], bool]) -> None:
        """Read and parse until `done()` (the handshake) or the connection ends."""
        while not done() and not self._protocol.closed:
            if not await self._receive_once():
                return

    async def _receive_once(self) -> bool:
        """Read what the socket has (or wait until it has something) and parse it; False once the
        connection ended."""
        read = self._read_plain if self._transport.tls is None else self._read_tls
        protocol = self._protocol
        try:
            try:
                handed = read()
            except BlockingIOError:
                self._unyielded = 0
                await trio.lowlevel.wait_readable(self._sock)
                return True
            if handed is None:
                protocol.eof_received()
                self._end(None)
                return False
            self.heard_at = trio.current_time()
            if protocol.closed or self._closed_sock:
                return False
            self._unyielded += handed
            if self._unyielded >= YIELD_EVERY:
                # Let the replies handed over be served (a checkpoint is a pass of trio's scheduler
                # and a poll: once per read would cost more than the read).
                self._unyielded = 0
                await trio.lowlevel.checkpoint()
            return True
        except ssl.SSLError as e:  # (before OSError, which it is too)
            protocol.last_error = protocol.last_error or f"TLS: {e}"
            self._end(None)
            return False
        except (OSError, trio.ClosedResourceError) as e:
            self._end(e if isinstance(e, OSError) else None)
            return False

    def _read_plain(self) -> int | None:
        """Hand the protocol what the socket has, received straight into its buffers (replies go to
        `on_msg` from here, synchronously): the bytes handed over, None at the end of the stream,
        `BlockingIOError` when there is nothing."""
        n = self._sock.recv_into(self._protocol.get_buffer(-1))
        if n == 0:
            return None
        self._protocol.buffer_updated(n)
        return n

    def _read_tls(self) -> int | None:
        """`_read_plain` through TLS: the socket's bytes go into the TLS object, which decrypts them
        straight into the buffers the protocol offers."""
        protocol, tls, outgoing = self._protocol, self._transport.tls, self._transport.outgoing
        assert tls is not None and outgoing is not None and self._incoming is not None
        raw = self._sock.recv(CONTROL_BUFFER)
        if not raw:
            return None
        self._incoming.write(raw)
        handed = 0
        while not protocol.closed and not self._closed_sock:
            buf = protocol.get_buffer(-1)
            try:
                # (with a buffer, `read` returns the count: typeshed says bytes)
                n = cast(int, tls.read(len(buf), buf))
            except ssl.SSLWantReadError:
                break
            if n == 0:  # (the server ended the TLS session)
                return None
            protocol.buffer_updated(n)
            handed += n
        if outgoing.pending:
            self._transport.send_raw(outgoing.read())  # (what TLS itself had to answer)
        return handed

    async def start_tls(self, context: ssl.SSLContext, hostname: str) -> None:
        """The TLS handshake, after the server's INFO asked for it; from then on everything goes
        through it. `ssl.SSLError` or `OSError` if it fails."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_hostname=hostname)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            await _send_all(self._sock, outgoing.read())
            raw = await _receive_some(self._sock)
            if not raw:
                raise WireError("the server closed the connection during the TLS handshake")
            incoming.write(raw)
        await _send_all(self._sock, outgoing.read())
        self._incoming = incoming
        self._transport.tls, self._transport.outgoing = tls, outgoing

    def _end(self, exc: OSError | None) -> None:
        if not self._closed_sock:
            self._closed_sock = True
            self._stop.set()
            with contextlib.suppress(OSError):
                trio.lowlevel.notify_closing(self._sock)
                self._sock.close()
        self._protocol.connection_lost(exc)

    async def run(self) -> None:
        """Serve the connection until it ends (returns then, never raises for the connection's sake)."""
        async def receive() -> None:
            while await self._receive_once():
                pass
            nursery.cancel_scope.cancel()

        async def send() -> None:
            transport = self._transport
            while not transport.closing:
                await transport.want_send.wait()
                transport.want_send = trio.Event()
                while transport.pending and not transport.closing:
                    try:
                        await trio.lowlevel.wait_writable(self._sock)
                        sent = self._sock.send(transport.pending)
                    except BlockingIOError:
                        continue
                    except (OSError, trio.ClosedResourceError) as e:
                        transport.abort_with(f"sending to NATS failed: {e}")
                        break
                    del transport.pending[:sent]

        async def ping() -> None:
            while True:
                await trio.sleep(PING_INTERVAL)
                if not self._protocol.ping_due():
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            nursery.start_soon(send)
            nursery.start_soon(ping)
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        if not self._protocol.closed:
            self._end(None)


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def _receive_some(sock: socket.socket) -> bytes:
    while True:
        try:
            return sock.recv(CONTROL_BUFFER)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def connect_trio(url: str, *, name: str, auth: Connection | None, timeout: float, on_msg: OnMsg,
                       on_closed: Callable[[TrioWireConnection], None], on_refused: OnRefused | None = None
                       ) -> TrioWireConnection:
    """`connect` for the trio thread: the same handshake (CONNECT as nats-py sends it, the reply inbox,
    TLS when the server's INFO requires it, a ping to check the server took it). `WireError` (or
    `OSError`, `ssl.SSLError`, `TimeoutError`) if that fails."""
    endpoint = parse_server(url)
    auth = auth.for_server(url) if auth is not None else None
    inbox = f"_INBOX.{os.urandom(11).hex()}"
    protocol, connection = _protocol_reporting_to(on_msg, on_closed, on_refused)
    sock: socket.socket | None = None
    conn: TrioWireConnection | None = None
    try:
        with trio.fail_after(timeout):
            infos = await trio.socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
            if not infos:
                raise WireError(f"cannot resolve {endpoint.host}")
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.connect(address)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err)) from None
            conn = TrioWireConnection(sock, protocol, inbox)
            await conn.receive_until(lambda: bool(protocol.info))
            if not protocol.info:
                raise WireError(protocol.last_error or "the server closed the connection")
            if _upgrade_to_tls(protocol.info, url, auth):
                wants_files = auth is not None and (auth.tls_ca or auth.tls_cert)
                context = auth.ssl_context() if auth is not None and wants_files else ssl.create_default_context()
                await conn.start_tls(context, endpoint.host)
            options = _connect_options(protocol.info, endpoint, auth, name)
            conn._transport.write(b"CONNECT " + json.dumps(options).encode() + b"\r\nSUB " + inbox.encode()
                                  + b".* 1\r\nPING\r\n")
            await conn.receive_until(lambda: protocol.pongs > 0)
            if protocol.closed or protocol.pongs == 0:
                raise WireError(protocol.last_error or "the server closed the connection")
            _check_inbox_taken(protocol)
    except BaseException:
        if conn is not None:
            conn.close()
        elif sock is not None:
            sock.close()
        raise
    connection.append(conn)
    return conn
