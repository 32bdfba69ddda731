"""The lean NATS connection's protocol (natsfs.wire) without a server: what it parses from any split of
the byte stream, what it answers and sends, and how it fails."""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import nkeys
import pytest

from natsfs.auth import Connection
from natsfs.wire import (
    CONTROL_BUFFER,
    WireProtocol,
    _connect_options,
    parse_headers,
    parse_permission_violation,
    parse_server,
    payload_buffer,
    unsupported,
)


class FakeTransport(asyncio.Transport):
    """What the protocol writes, and whether it ended the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.aborted = False

    def write(self, data: Any) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    close = abort


class Harness:
    """A protocol fed the way asyncio feeds a BufferedProtocol: into the buffer it offers, `step` bytes
    (or fewer, as that buffer allows) per `recv_into`."""

    def __init__(self) -> None:
        self.msgs: list[tuple[str, dict[str, str] | None, bytes | bytearray]] = []
        self.closed = 0
        self.refused: list[tuple[str, str]] = []
        self.protocol = WireProtocol(lambda s, h, d: self.msgs.append((s, h, d)), self._closed,
                                     lambda kind, subject: self.refused.append((kind, subject)))
        self.transport = FakeTransport()
        self.protocol.connection_made(self.transport)

    def _closed(self, _: Any) -> None:
        self.closed += 1

    def feed(self, stream: bytes, step: int) -> None:
        pos = 0
        while pos < len(stream) and not self.transport.aborted:
            buf = self.protocol.get_buffer(-1)
            n = min(step, len(buf), len(stream) - pos)
            assert n > 0
            buf[:n] = stream[pos : pos + n]
            self.protocol.buffer_updated(n)
            pos += n

    def feed_split(self, stream: bytes, *cuts: int) -> None:
        """Feed in pieces ending at `cuts` (each piece maybe further cut by the offered buffer's size)."""
        last = 0
        for cut in [*cuts, len(stream)]:
            if cut > last:
                self.feed(stream[last:cut], cut - last)
            last = cut


def hmsg(subject: str, headers: bytes, payload: bytes, reply: str = "") -> bytes:
    head = f"HMSG {subject} 1 {reply + ' ' if reply else ''}{len(headers)} {len(headers) + len(payload)}\r\n"
    return head.encode() + headers + payload + b"\r\n"


def msg(subject: str, payload: bytes, reply: str = "") -> bytes:
    return f"MSG {subject} 1 {reply + ' ' if reply else ''}{len(payload)}\r\n".encode() + payload + b"\r\n"


CHUNK_HEADERS = (b"NATS/1.0\r\nNats-Stream: OBJ_b\r\nNats-Subject: $O.b.C.n1\r\nNats-Sequence: 7\r\n"
                 b"Nats-Time-Stamp: 2026-11-23T07:55:12.5Z\r\nNats-Num-Pending: 2\r\nNats-Last-Sequence: 6\r\n\r\n")

STREAM = b"".join([
    b"INFO {\"server_id\":\"S\",\"max_payload\":1048576,\"headers\":true}\r\n",
    b"PING\r\n",
    msg("_INBOX.x.1", b"plain payload"),
    msg("_INBOX.x.2", b"", reply="r.1"),
    hmsg("_INBOX.x.3", CHUNK_HEADERS, b"chunk bytes \r\n with CRLF inside"),
    b"+OK\r\n",
    hmsg("_INBOX.x.3", b"NATS/1.0 404 No Messages\r\n\r\n", b""),
    hmsg("_INBOX.x.3", b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 3\r\n\r\n", b""),
    hmsg("_INBOX.x.3", b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 0\r\nNats-Last-Sequence: 7\r\n\r\n", b""),
    b"PONG\r\n",
    hmsg("_INBOX.x.4", b"NATS/1.0 503\r\n\r\n", b""),
])

EXPECTED = [
    ("_INBOX.x.1", None, b"plain payload"),
    ("_INBOX.x.2", None, b""),
    ("_INBOX.x.3", {"Nats-Stream": "OBJ_b", "Nats-Subject": "$O.b.C.n1", "Nats-Sequence": "7",
                    "Nats-Time-Stamp": "2026-11-23T07:55:12.5Z", "Nats-Num-Pending": "2", "Nats-Last-Sequence": "6"},
     b"chunk bytes \r\n with CRLF inside"),
    ("_INBOX.x.3", {"Status": "404", "Description": "No Messages"}, b""),
    ("_INBOX.x.3", {"Status": "408", "Description": "Request Timeout", "Nats-Pending-Messages": "3"}, b""),
    ("_INBOX.x.3", {"Status": "204", "Description": "EOB", "Nats-Num-Pending": "0", "Nats-Last-Sequence": "7"}, b""),
    ("_INBOX.x.4", {"Status": "503"}, b""),
]


def test_every_kind_of_line_in_one_piece():
    h = Harness()
    h.feed(STREAM, len(STREAM))
    assert h.msgs == EXPECTED
    assert h.protocol.info["server_id"] == "S"
    assert bytes(h.transport.written) == b"PONG\r\n"  # the server's ping answered
    assert not h.transport.aborted and h.closed == 0


def test_split_at_every_byte_boundary():
    for cut in range(1, len(STREAM)):
        h = Harness()
        h.feed_split(STREAM, cut)
        assert h.msgs == EXPECTED, cut
        assert not h.transport.aborted


def test_split_at_every_pair_of_boundaries_in_a_chunk_reply():
    payload = os.urandom(300)
    stream = hmsg("_INBOX.x.3", CHUNK_HEADERS, payload) + msg("_INBOX.x.1", b"after")
    want = [("_INBOX.x.3", EXPECTED[2][1], payload), ("_INBOX.x.1", None, b"after")]
    for a in range(1, len(stream), 7):
        for b in range(a + 1, len(stream), 5):
            h = Harness()
            h.feed_split(stream, a, b)
            assert h.msgs == want, (a, b)


def test_one_byte_at_a_time():
    h = Harness()
    h.feed(STREAM, 1)
    assert h.msgs == EXPECTED


def test_huge_payloads_arrive_whole_in_their_own_buffer():
    big = os.urandom(5 * CONTROL_BUFFER + 17)
    other = os.urandom(128 * 1024)
    stream = hmsg("_INBOX.x.9", CHUNK_HEADERS, big) + msg("_INBOX.x.9", other) + hmsg("_INBOX.x.9", CHUNK_HEADERS, big)
    for step in (1 << 20, 65536, 4093, 100_000):
        h = Harness()
        h.feed(stream, step)
        delivered = [d for _, _, d in h.msgs]
        assert delivered == [big, other, big], step
        assert all(isinstance(d, bytearray) for d in delivered)  # handed over as received: no copy to bytes


def test_payload_buffers_are_filled_by_the_socket_alone_and_never_handed_over_half_received():
    # Payload buffers are not zero-filled: one made from memory just freed would show stale bytes
    # wherever the socket did not write, so only a whole payload may be handed over.
    for _ in range(3):
        stale = bytearray(b"\xab" * (256 * 1024))
        del stale
        buf = payload_buffer(200 * 1024)
        assert type(buf) is bytearray and len(buf) == 200 * 1024
    big = os.urandom(3 * CONTROL_BUFFER)
    whole = hmsg("_INBOX.x.9", CHUNK_HEADERS, big)
    h = Harness()
    h.feed(whole[: len(whole) - 1000], 4096)  # the connection is lost inside the payload
    assert h.msgs == []
    h.protocol.connection_lost(ConnectionResetError("reset"))
    assert h.msgs == [] and h.closed == 1
    h = Harness()
    h.feed(whole, 4096)
    assert h.msgs == [("_INBOX.x.9", parse_headers(CHUNK_HEADERS), big)]


def test_a_control_line_longer_than_the_buffer():
    info = b"INFO " + (b'{"connect_urls":["' + b"x" * (3 * CONTROL_BUFFER) + b'"],"max_payload":5}') + b"\r\n"
    h = Harness()
    h.feed(info + msg("_INBOX.x.1", b"hi"), 10_000)
    assert h.protocol.info["max_payload"] == 5
    assert h.msgs == [("_INBOX.x.1", None, b"hi")]


def test_err_from_the_server_ends_the_connection_with_its_text():
    h = Harness()
    h.feed(msg("_INBOX.x.1", b"a") + b"-ERR 'Maximum Control Line Exceeded'\r\n" + msg("_INBOX.x.1", b"b"), 1000)
    assert h.msgs == [("_INBOX.x.1", None, b"a")]  # nothing after the error is taken
    assert h.transport.aborted
    assert h.protocol.last_error == "nats: Maximum Control Line Exceeded"
    h.protocol.connection_lost(None)
    assert h.closed == 1 and h.protocol.closed
    h.protocol.connection_lost(None)
    assert h.closed == 1  # once


def test_a_permissions_violation_refuses_one_message_and_keeps_the_connection():
    h = Harness()
    stream = (msg("_INBOX.x.1", b"a")
              + b"-ERR 'Permissions Violation for Publish to \"$JS.API.DIRECT.GET.OBJ_b\"'\r\n"
              + msg("_INBOX.x.2", b"b")
              + b"-ERR 'Permissions Violation for Subscription to \"$O.b.>\"'\r\n"
              + b"PING\r\n")
    for step in (1, 7, 1000):  # (the line split anywhere)
        h = Harness()
        h.feed(stream, step)
        assert h.refused == [("publish", "$JS.API.DIRECT.GET.OBJ_b"), ("subscription", "$O.b.>")]
        assert h.msgs == [("_INBOX.x.1", None, b"a"), ("_INBOX.x.2", None, b"b")]
        assert not h.transport.aborted and h.closed == 0 and h.protocol.last_error is None
        assert h.transport.written == b"PONG\r\n"  # still serving
        assert h.protocol.refused_subscription == "$O.b.>"


@pytest.mark.parametrize(("text", "expected"), [
    ("'Permissions Violation for Publish to \"$O.b.C.AbC\"'", ("publish", "$O.b.C.AbC")),
    ('Permissions Violation for Publish to "$O.b.M.YQ=="', ("publish", "$O.b.M.YQ==")),
    # nats-py hands its error callback the line lowered, prefixed with "nats: "
    ('nats: permissions violation for publish to "$js.api.direct.get.obj_b"', ("publish", "$js.api.direct.get.obj_b")),
    ('Permissions Violation for Subscription to "foo.>" using queue "q"', ("subscription", "foo.>")),
    ("Permissions Violation for Publish to $O.b.C.x", ("publish", "$O.b.C.x")),
    ("Maximum Control Line Exceeded", None),
    ("Authorization Violation", None),
    ("Permissions Violation", None),
])
def test_parse_permission_violation(text, expected):
    assert parse_permission_violation(text) == expected


@pytest.mark.parametrize("garbage", [b"HELLO there\r\n", b"MSG onlysubject\r\n", b"HMSG s 1 10 5\r\n"])
def test_garbage_is_a_protocol_error(garbage):
    h = Harness()
    h.feed(garbage, 100)
    assert h.transport.aborted and h.protocol.last_error is not None
    assert h.protocol.last_error.startswith("protocol error")


@pytest.mark.expect_log("reading from NATS failed unexpectedly")
def test_a_fault_in_the_receiver_ends_the_connection_loudly(caplog):
    h = Harness()

    def broken(*_: Any) -> None:
        raise RuntimeError("bug")

    h.protocol._on_msg = broken  # type: ignore[assignment]
    h.feed(msg("_INBOX.x.1", b"a"), 100)
    assert h.transport.aborted
    assert "reading from NATS failed unexpectedly" in caplog.text


def test_requests_are_sent_as_pub_or_hpub():
    h = Harness()
    h.feed(b'INFO {"max_payload":64}\r\n', 100)
    h.protocol.publish("$JS.API.DIRECT.GET.OBJ_b", b'{"seq":1}', "_INBOX.x.5", None)
    h.protocol.publish("svc", b"", "", {"A": "1"})
    head = b"NATS/1.0\r\nA: 1\r\n\r\n"
    assert bytes(h.transport.written) == (b'PUB $JS.API.DIRECT.GET.OBJ_b _INBOX.x.5 9\r\n{"seq":1}\r\n'
                                          + f"HPUB svc {len(head)} {len(head)}\r\n".encode() + head + b"\r\n")
    from natsfs.wire import WireError

    with pytest.raises(WireError, match="maximum payload"):
        h.protocol.publish("svc", b"x" * 65, "", None)
    h.protocol.connection_lost(ConnectionResetError("reset by peer"))
    with pytest.raises(WireError, match="reset by peer"):
        h.protocol.publish("svc", b"", "", None)


def test_parse_headers_keeps_the_first_of_a_repeated_key():
    assert parse_headers(b"NATS/1.0\r\nA: 1\r\nA: 2\r\nB:  x y \r\n\r\n") == {"A": "1", "B": "x y"}
    assert parse_headers(b"NATS/1.0\r\n\r\n") is None
    assert parse_headers(b"NATS/1.0 100 Idle Heartbeat\r\n\r\n") == {"Status": "100", "Description": "Idle Heartbeat"}


def test_server_urls_are_read_as_nats_py_reads_them():
    e = parse_server("127.0.0.1:4333")
    assert (e.host, e.port, e.scheme, e.user, e.password) == ("127.0.0.1", 4333, "nats", None, None)
    e = parse_server("tls://u%40x:p%3Aw@example.org")
    assert (e.host, e.port, e.scheme, e.user, e.password) == ("example.org", 4222, "tls", "u@x", "p:w")
    e = parse_server("nats://tok@[::1]:5000")
    assert (e.host, e.port, e.user, e.password) == ("::1", 5000, "tok", None)
    assert unsupported(["nats://a", "tls://b"], None) is None
    assert unsupported(["ws://a:8080"], None) == "ws:// servers"


def test_connect_sends_the_credentials_nats_py_would():
    endpoint = parse_server("nats://h")
    name = "natsfs"
    assert "user" not in _connect_options({}, endpoint, Connection(user="u", password="p"), name)  # not asked
    asked = {"auth_required": True}
    options = _connect_options(asked, endpoint, Connection(user="u", password="p"), name)
    assert (options["user"], options["pass"]) == ("u", "p")
    assert _connect_options(asked, endpoint, Connection(token="t"), name)["auth_token"] == "t"
    from_url = _connect_options(asked, parse_server("nats://tok@h"), None, name)
    assert from_url["auth_token"] == "tok" and from_url["name"] == "natsfs" and from_url["headers"] is True
    from_url = _connect_options(asked, parse_server("nats://a:b@h"), None, name)
    assert (from_url["user"], from_url["pass"]) == ("a", "b")


def test_an_nkey_signs_the_servers_nonce(tmp_path):
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    pair = nkeys.from_seed(bytearray(seed))
    public = pair.public_key
    path = tmp_path / "user.nk"
    path.write_bytes(seed + b"\n")
    options = _connect_options({"auth_required": True, "nonce": "abc123"}, parse_server("h"),
                               Connection(nkey_file=str(path)), "natsfs")
    assert options["nkey"] == public.decode()
    assert pair.verify(b"abc123", base64.b64decode(options["sig"]))
    creds = tmp_path / "user.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\nJWT.PART.X\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")
    options = _connect_options({"auth_required": True, "nonce": "n2"}, parse_server("h"),
                               Connection(creds_file=str(creds)), "natsfs")
    assert options["jwt"] == "JWT.PART.X" and "nkey" not in options
    assert pair.verify(b"n2", base64.b64decode(options["sig"]))


def test_the_trio_driver_reads_sends_what_the_socket_did_not_take_and_ends_once():
    """`TrioWireConnection` over a socket pair: replies reach `on_msg`, a request larger than the
    socket's buffer goes out whole (the rest by the sender task), and the peer closing ends `run`
    with `on_closed` called once."""
    import socket

    import trio

    from natsfs.wire import TrioWireConnection

    ours, peer = socket.socketpair()
    ours.setblocking(False)
    msgs: list[tuple[str, bytes]] = []
    closed: list[object] = []
    protocol = WireProtocol(lambda s, h, d: msgs.append((s, bytes(d))), closed.append)
    conn = TrioWireConnection(ours, protocol, "_INBOX.t")
    big = os.urandom(8 << 20)

    async def main() -> None:
        peer_stream = trio.socket.from_stdlib_socket(peer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.run)
            await peer_stream.send(msg("_INBOX.t.1", b"hello"))
            conn.publish("svc.big", big, reply="_INBOX.t.2")
            assert conn._transport.pending  # (the socket took only part of it)
            want = f"PUB svc.big _INBOX.t.2 {len(big)}\r\n".encode() + big + b"\r\n"
            got = bytearray()
            with trio.fail_after(10):
                while len(got) < len(want):
                    got += await peer_stream.recv(1 << 20)
            assert got == want
            with trio.fail_after(30):
                while not msgs:
                    await trio.sleep(0.01)
            peer_stream.close()
        assert msgs == [("_INBOX.t.1", b"hello")]
        assert len(closed) == 1 and conn.is_closed

    trio.run(main)


class Sink:
    """A `DeliverySink` that notes what it was handed, both ways alike: (subject, reply, Nats-Msg-Size,
    header bytes) for a headers-only delivery whose only header is the size, else (subject, reply,
    headers, data, header bytes)."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, ...]] = []
        self.runs = 0  # lists handed over by the one-match path

    def headers_only(self, rows: list[tuple[bytes, bytes, int, int]]) -> None:
        self.runs += 1
        self.got += [(s.decode(), r.decode(), n, hb) for s, r, n, hb in rows]

    def message(self, subject: str, reply: str, headers: dict[str, str] | None, data: bytes | bytearray,
                header_size: int) -> None:
        if headers is not None and list(headers) == ["Nats-Msg-Size"] and not data:
            self.got.append((subject, reply, int(headers["Nats-Msg-Size"]), header_size))
        else:
            self.got.append((subject, reply, headers, bytes(data), header_size))


def delivery(subject: str, sid: int, reply: str, headers: bytes) -> bytes:
    return f"HMSG {subject} {sid} {reply} {len(headers)} {len(headers)}\r\n".encode() + headers + b"\r\n"


def ack(seq: int, pending: int) -> str:
    return f"$JS.ACK.OBJ_b.scan.1.{seq}.{seq}.1795544086202843333.{pending}"


# A scan's deliveries on sid 2 among a request's replies on the inbox (sid 1): plain headers-only frames
# (the one-match path), one whose message had headers of its own, one whose header value is the text of
# a whole plain frame (only the byte counts tell it is not one), a status message, and a delivery for a
# sid nobody subscribed (dropped). Each handed over with its header block's length.
FAKE_FRAME = delivery("$O.b.C.n", 2, ack(99, 0), b"NATS/1.0\r\nNats-Msg-Size: 1\r\n\r\n").decode()
FAKE_FRAME = FAKE_FRAME.replace("\r\n", " ").strip()  # (a header value has no CRLF)
DELIVERIES = b"".join([
    delivery("$O.b.C.n", 2, ack(1, 5), b"NATS/1.0\r\nNats-Msg-Size: 131072\r\n\r\n"),
    delivery("$O.b.C.n", 2, ack(2, 4), b"NATS/1.0\r\nNats-Msg-Size: 0\r\n\r\n"),
    msg("_INBOX.x.1", b"a reply between deliveries"),
    delivery("$O.b.C.n", 2, ack(3, 3), b"NATS/1.0\r\nX-Own: yes\r\nNats-Msg-Size: 7\r\n\r\n"),
    delivery("$O.b.C.n", 2, ack(4, 2), f"NATS/1.0\r\nX-Text: {FAKE_FRAME}\r\nNats-Msg-Size: 5\r\n\r\n".encode()),
    delivery("_INBOX.x.d.2", 2, "$JS.FC.OBJ_b.scan.Ab1", b"NATS/1.0 100 FlowControl Request\r\n\r\n"),
    delivery("$O.b.C.n", 3, ack(9, 0), b"NATS/1.0\r\nNats-Msg-Size: 9\r\n\r\n"),
    delivery("$O.b.C.n", 2, ack(5, 1), b"NATS/1.0\r\nNats-Msg-Size: 1000\r\n\r\n"),
    delivery("$O.b.C.n", 2, ack(6, 0), b"NATS/1.0\r\nNats-Msg-Size: 3\r\n\r\n"),
])

DELIVERED = [
    ("$O.b.C.n", ack(1, 5), 131072, len(b"NATS/1.0\r\nNats-Msg-Size: 131072\r\n\r\n")),
    ("$O.b.C.n", ack(2, 4), 0, len(b"NATS/1.0\r\nNats-Msg-Size: 0\r\n\r\n")),
    ("$O.b.C.n", ack(3, 3), {"X-Own": "yes", "Nats-Msg-Size": "7"}, b"",
     len(b"NATS/1.0\r\nX-Own: yes\r\nNats-Msg-Size: 7\r\n\r\n")),
    ("$O.b.C.n", ack(4, 2), {"X-Text": FAKE_FRAME, "Nats-Msg-Size": "5"}, b"",
     len(f"NATS/1.0\r\nX-Text: {FAKE_FRAME}\r\nNats-Msg-Size: 5\r\n\r\n")),
    ("_INBOX.x.d.2", "$JS.FC.OBJ_b.scan.Ab1", {"Status": "100", "Description": "FlowControl Request"}, b"",
     len(b"NATS/1.0 100 FlowControl Request\r\n\r\n")),
    ("$O.b.C.n", ack(5, 1), 1000, len(b"NATS/1.0\r\nNats-Msg-Size: 1000\r\n\r\n")),
    ("$O.b.C.n", ack(6, 0), 3, len(b"NATS/1.0\r\nNats-Msg-Size: 3\r\n\r\n")),
]


def test_deliveries_on_a_subscription_reach_its_sink_whole_and_in_order_from_any_split():
    """What a scan's subscription gets is the same whether a frame came whole (one match, handed over a
    run at a time) or cut anywhere (the general parser), and the inbox's replies still go to `on_msg`."""
    whole = Harness()
    sink = Sink()
    whole.protocol.deliveries[b"2"] = sink
    whole.feed(DELIVERIES, len(DELIVERIES))
    assert sink.got == DELIVERED and sink.runs == 2  # (the first two plain frames, then the last two)
    assert whole.msgs == [("_INBOX.x.1", None, b"a reply between deliveries")]
    for cut in range(1, len(DELIVERIES)):
        h = Harness()
        h.protocol.deliveries[b"2"] = sink = Sink()
        h.feed_split(DELIVERIES, cut)
        assert sink.got == DELIVERED, cut
        assert len(h.msgs) == 1 and not h.transport.aborted
    one = Harness()
    one.protocol.deliveries[b"2"] = sink = Sink()
    one.feed(DELIVERIES, 1)
    assert sink.got == DELIVERED and sink.runs == 0


def test_a_headers_only_frame_whose_counts_do_not_match_goes_to_the_general_parser():
    """A frame that looks plain but says a longer header block (or a payload) is read by its byte
    counts, as any message is."""
    headers = b"NATS/1.0\r\nNats-Msg-Size: 12\r\n\r\n"
    odd = f"HMSG $O.b.C.n 2 {ack(1, 0)} {len(headers)} {len(headers) + 4}\r\n".encode() + headers + b"data\r\n"
    h = Harness()
    h.protocol.deliveries[b"2"] = sink = Sink()
    h.feed(odd, len(odd))
    assert sink.got == [("$O.b.C.n", ack(1, 0), {"Nats-Msg-Size": "12"}, b"data", len(headers))] and sink.runs == 0


def test_a_delivery_whose_message_had_a_size_header_of_its_own_gets_the_servers():
    """The server appends `Nats-Msg-Size` to the message's own headers: a delivery's repeated header
    keeps its last value (a reply's, its first, as before)."""
    own = b"NATS/1.0\r\nNats-Msg-Size: 5\r\nX-A: 1\r\nNats-Msg-Size: 100\r\n\r\n"
    stream = delivery("$O.b.C.n", 2, ack(1, 0), own) + hmsg("_INBOX.x.1", b"NATS/1.0\r\nK: 1\r\nK: 2\r\n\r\n", b"")
    h = Harness()
    h.protocol.deliveries[b"2"] = sink = Sink()
    h.feed(stream, len(stream))
    assert sink.got == [("$O.b.C.n", ack(1, 0), {"Nats-Msg-Size": "100", "X-A": "1"}, b"", len(own))]
    assert h.msgs == [("_INBOX.x.1", {"K": "1"}, b"")]
