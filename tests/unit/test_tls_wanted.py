"""TLS asked for (a `tls://` URL, or a TLS CA / client certificate / key) and a server that does not offer
it: every connection natsfs makes refuses before it writes anything, so no CONNECT (no password) ever
leaves in clear. The server here is a plaintext stand-in on a loopback socket that sends the INFO a
server without TLS sends and records every byte each client writes to it; it answers PINGs, so a
client that does go ahead (TLS not asked: the control case) completes its handshake and is seen
sending its CONNECT."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
import trio
import trustme

from natsfs import natscompat, wire
from natsfs.auth import NO_TLS, Connection, tls_wanted
from natsfs.bridge import WORKER_FOUND_NO_SERVER, _Link, _worker_main
from natsfs.errors import Unavailable

PASSWORD = "S3cret,pw@/:%#?"  # (every kind of character that must never leave in clear)
QUOTED = quote(PASSWORD, safe="")  # (as it is written in a URL)


class PlaintextServer:
    """Accepts connections on loopback, sends each `INFO <info>`, records what each client writes and
    answers each PING with a PONG."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = {"server_id": "FAKE", "version": "2.10.0", "proto": 1, "headers": True,
                     "max_payload": 1048576, "auth_required": True, **info}
        self.received: list[bytearray] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._clients: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._clients.append(conn)
            got = bytearray()
            self.received.append(got)
            threading.Thread(target=self._serve, args=(conn, got), daemon=True).start()

    def _serve(self, conn: socket.socket, got: bytearray) -> None:
        try:
            conn.sendall(b"INFO " + json.dumps(self.info).encode() + b"\r\n")
            pings = 0
            while data := conn.recv(65536):
                got += data
                for _ in range(got.count(b"PING\r\n") - pings):
                    conn.sendall(b"PONG\r\n")
                pings = got.count(b"PING\r\n")
        except OSError:
            pass

    def all_received(self) -> bytes:
        return b"".join(bytes(r) for r in self.received)

    def close(self) -> None:
        self._listener.close()
        for c in self._clients:
            c.close()


@pytest.fixture
def plain_server() -> Iterator[PlaintextServer]:
    server = PlaintextServer({})
    yield server
    server.close()


@pytest.fixture
def tls_files(tmp_path) -> dict[str, str]:
    """A CA file and a client certificate and key, all loadable (so what fails is the server's answer)."""
    ca = trustme.CA()
    client = ca.issue_cert("natsfs-client")
    paths = {"tls_ca": tmp_path / "ca.pem", "tls_cert": tmp_path / "client.pem", "tls_key": tmp_path / "client.key"}
    ca.cert_pem.write_to_path(str(paths["tls_ca"]))
    client.cert_chain_pems[0].write_to_path(str(paths["tls_cert"]))
    client.private_key_pem.write_to_path(str(paths["tls_key"]))
    return {k: str(v) for k, v in paths.items()}


# The ways TLS is asked for (nats.go's `Secure`): a tls:// URL, one tls:// URL anywhere in the list (nats.go
# turns TLS on for its whole pool), a CA (`RootCAs`), a client certificate and key (`ClientCert`), a key.
HOW = ["tls-url", "tls-url-elsewhere-in-the-list", "ca", "client-cert", "key"]


def _tls_asked(port: int, how: str, files: dict[str, str]) -> tuple[str, Connection]:
    """A server URL and its credentials (a password in the URL or as options), TLS asked as `how` says."""
    if how == "tls-url":
        url = f"tls://alice:{QUOTED}@127.0.0.1:{port}"
        return url, Connection(servers=(url,))
    url = f"nats://127.0.0.1:{port}"
    if how == "tls-url-elsewhere-in-the-list":
        return url, Connection(servers=(url, "tls://127.0.0.1:1"), user="alice", password=PASSWORD)
    tls = {"ca": {"tls_ca": files["tls_ca"]}, "key": {"tls_key": files["tls_key"]},
           "client-cert": {"tls_cert": files["tls_cert"], "tls_key": files["tls_key"]}}[how]
    return url, Connection(servers=(url,), user="alice", password=PASSWORD, **tls)


def test_tls_is_wanted_as_nats_go_wants_it(tls_files):
    assert tls_wanted("tls://h", None)
    assert tls_wanted("TLS://h", None)
    assert not tls_wanted("nats://h", None)
    assert not tls_wanted("nats://h", Connection(servers=("nats://h",), user="u", password="p"))
    for how in HOW:
        assert tls_wanted(*_tls_asked(1, how, tls_files)), how


def _assert_nothing_sent(server: PlaintextServer, error: BaseException | str) -> None:
    assert server.received, "the client did not even connect"
    assert server.all_received() == b""  # no CONNECT, so no password; not a byte
    assert NO_TLS in str(error) and "S3cret" not in str(error)


async def _open_link(url: str, auth: Connection, *, lean: bool) -> _Link:
    link = _Link([url], name="t", connect_timeout=2, auth=auth, quiet=True, lean=lean)
    await link.open()
    return link


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("lean", [False, True], ids=["nats-py", "lean-wire"])
def test_a_link_refuses_a_server_without_tls_before_connect(plain_server, tls_files, how, lean):
    url, auth = _tls_asked(plain_server.port, how, tls_files)
    with pytest.raises(Unavailable) as e:
        asyncio.run(_open_link(url, auth, lean=lean))
    _assert_nothing_sent(plain_server, e.value)
    assert str(e.value).startswith("cannot connect to NATS at ")


@pytest.mark.parametrize("how", HOW)
def test_the_trio_wire_connection_refuses_a_server_without_tls_before_connect(plain_server, tls_files, how):
    url, auth = _tls_asked(plain_server.port, how, tls_files)

    async def connect() -> None:
        await wire.connect_trio(url, name="t", auth=auth, timeout=5, on_msg=lambda *a: None,
                                on_closed=lambda c: None)

    with pytest.raises(wire.WireError) as e:
        trio.run(connect)
    _assert_nothing_sent(plain_server, e.value)


def test_the_upload_worker_refuses_a_server_without_tls_before_connect(plain_server):
    url = f"tls://alice:{QUOTED}@127.0.0.1:{plain_server.port}"
    with pytest.raises(SystemExit) as e:
        asyncio.run(_worker_main(Connection(servers=(url,))))
    assert e.value.code == WORKER_FOUND_NO_SERVER
    assert plain_server.received and plain_server.all_received() == b""


@pytest.mark.parametrize("lean", [False, True], ids=["nats-py", "lean-wire"])
def test_without_tls_asked_the_same_server_gets_the_credentials(plain_server, lean):
    """The control: the stand-in does record a CONNECT (a client that goes ahead is seen)."""
    url = f"nats://alice:{QUOTED}@127.0.0.1:{plain_server.port}"

    async def connect_and_close() -> None:
        link = await _open_link(url, Connection(servers=(url,)), lean=lean)
        await link.close()

    asyncio.run(connect_and_close())
    assert b"CONNECT" in plain_server.all_received()
    assert json.dumps(PASSWORD).encode() in plain_server.all_received()


@pytest.mark.parametrize("lean", [False, True], ids=["nats-py", "lean-wire"])
def test_a_server_that_offers_tls_without_requiring_it_is_spoken_to_in_tls(lean):
    """`tls_available` (a server with `allow_non_tls`): the client starts a TLS handshake (a ClientHello
    is the first thing it writes), not a CONNECT in clear. (The stand-in speaks no TLS: the handshake
    then fails.)"""
    server = PlaintextServer({"tls_available": True})
    try:
        url = f"tls://alice:{QUOTED}@127.0.0.1:{server.port}"
        with pytest.raises(Unavailable):
            asyncio.run(_open_link(url, Connection(servers=(url,)), lean=lean))
        sent = server.all_received()
        assert sent[:2] == b"\x16\x03" and b"CONNECT" not in sent  # a TLS handshake record
    finally:
        server.close()


def test_natscompat_finds_the_info_hook_in_the_installed_nats_py():
    natscompat.check()
    assert natscompat._info_before_connect()


class _HookedClient:
    """What `natscompat.require_tls` touches of a nats-py client: its current server, transport and
    `_process_info` (which records the INFOs it is handed)."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlparse

        self._current_server = type("Srv", (), {"uri": urlparse(url)})()
        self._transport = type("T", (), {"close": lambda self: None})()
        self.infos: list[dict[str, Any]] = []

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        self.infos.append(dict(info))


@pytest.mark.parametrize(("url", "info", "outcome"), [
    ("tls://h", {}, "refused"),
    ("tls://h", {"tls_available": True}, "tls"),  # offered, not required: nats-py is told it is required
    ("tls://h", {"tls_required": True}, "tls"),
    ("ws://h", {"tls_required": True}, "refused"),  # nats-py never upgrades a ws:// connection
    ("wss://h", {}, "as-is"),  # TLS already, below the websocket
])
def test_the_nats_py_hook_decides_before_connect(url, info, outcome):
    nc = _HookedClient(url)
    natscompat.require_tls(nc, NO_TLS)
    if outcome == "refused":
        with pytest.raises(natscompat.TlsNotOffered, match="does not offer TLS"):
            asyncio.run(nc._process_info(dict(info), True))
        assert nc.infos == []
    else:
        asyncio.run(nc._process_info(dict(info), True))
        assert nc.infos == [{**info, "tls_required": True} if outcome == "tls" else info]
    # Later INFOs (cluster updates over the established connection) pass as they are.
    asyncio.run(nc._process_info({"connect_urls": []}, False))
    assert nc.infos[-1] == {"connect_urls": []}
