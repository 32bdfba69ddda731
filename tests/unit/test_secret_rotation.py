"""A password or token file rewritten while mounted (rotation): read again at every connect.

`auth.resolve` keeps the file's path beside the secret read from it, `Connection.refreshed` reads it
again (the last good secret kept, with one WARNING naming the file, when it cannot be read or holds
nothing), and every connect of the bridge (nats-py's, the lean asyncio one, the trio thread's) sends
what the file holds at that moment: a fake server here records each CONNECT it gets and refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from natsfs import auth
from natsfs.bridge import _Link, _TrioReads
from natsfs.errors import Unavailable

OLD = "old-s3cr3t-91f0c2"
NEW = "new-s3cr3t-7ab3e4"


def _file(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "secret"
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def _no_secret_in(records: list[logging.LogRecord], *texts: str) -> None:
    for text in [*(r.getMessage() for r in records), *texts]:
        assert OLD not in text and NEW not in text, text


@pytest.mark.parametrize("what", ["password", "token"])
def test_the_file_is_read_again_and_a_rewritten_one_gives_the_new_secret(tmp_path, monkeypatch, what, caplog):
    path = _file(tmp_path, OLD + "\n")
    monkeypatch.chdir(tmp_path)
    c = auth.resolve({f"{what}_file": "secret", "user": "u"}, {"HOME": str(tmp_path)})
    assert getattr(c, what) == OLD and getattr(c, f"{what}_file") == str(path)  # absolute: the daemon's cwd is /
    assert auth.Connection.from_json(c.to_json()) == c  # (the path travels to the daemon and the worker)
    assert OLD not in repr(c) and str(path) in repr(c)
    assert c.refreshed() is c  # unchanged file: the same settings
    path.write_text(NEW + "\n")
    with caplog.at_level(logging.DEBUG, logger="natsfs.auth"):
        fresh = c.refreshed()
    assert getattr(fresh, what) == NEW and getattr(c, what) == OLD
    assert fresh.connect_options()[what] == NEW
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # said once: it changed (not what to)
    assert str(path) in caplog.records[0].getMessage()
    _no_secret_in(caplog.records)


def test_a_secret_given_itself_is_not_replaced_by_its_file(tmp_path):
    """`--password` wins over `--password-file` (which is then not read): nothing to read again either."""
    path = _file(tmp_path, OLD)
    c = auth.resolve({"password": "given", "password_file": str(path)}, {"HOME": str(tmp_path)})
    assert c.password == "given" and c.password_file is None
    path.write_text(NEW)
    assert c.refreshed().password == "given"


def test_a_urls_own_userinfo_still_wins_over_the_file(tmp_path):
    path = _file(tmp_path, OLD)
    c = auth.resolve({"password_file": str(path), "user": "u"}, {"HOME": str(tmp_path)})
    path.write_text(NEW)
    url = c.for_server("nats://alice:frompw@h:4222")
    assert (url.user, url.password, url.password_file) == ("alice", "frompw", None)
    assert url.refreshed().password == "frompw"
    token = c.for_server("nats://tok@h:4222")
    assert (token.token, token.password, token.refreshed().password) == ("tok", None, None)


def _break(path: Path, how: str) -> None:
    if how == "gone":
        path.unlink()
    elif how == "directory":
        path.unlink()
        path.mkdir()
    elif how == "empty":
        path.write_text(" \n")
    else:  # not UTF-8, with bytes of a secret in it
        path.write_bytes(b"\xff" + NEW.encode() + b"\xfe")


def _mend(path: Path) -> None:
    if path.is_dir():
        path.rmdir()
    path.write_text(NEW + "\n")


@pytest.mark.parametrize("how", ["gone", "directory", "empty", "not-utf8"])
def test_a_file_that_cannot_be_read_keeps_the_last_secret_with_one_warning(tmp_path, caplog, how):
    path = _file(tmp_path, OLD)
    c = auth.resolve({"password_file": str(path), "user": "u"}, {"HOME": str(tmp_path)})
    _break(path, how)
    with caplog.at_level(logging.DEBUG, logger="natsfs.auth"):
        kept = [c.refreshed() for _ in range(5)]  # five reconnect attempts
        # ... of several connections of the process (quiet ones too: the worker's link says it at DEBUG)
        kept += [c.refreshed(logging.DEBUG) for _ in range(3)]
    assert all(k.password == OLD for k in kept)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert str(path) in warnings[0].getMessage() and "keeping the password read before" in warnings[0].getMessage()
    _no_secret_in(caplog.records)
    caplog.clear()
    _mend(path)
    with caplog.at_level(logging.DEBUG, logger="natsfs.auth"):
        fresh = c.refreshed()
        assert fresh.refreshed() is fresh
    assert fresh.password == NEW
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"the password file {path} is readable again", f"the password in {path} changed: new connections use the "
        "new one"]
    caplog.clear()
    _break(path, how)  # broken again: said again, once
    with caplog.at_level(logging.DEBUG, logger="natsfs.auth"):
        assert [fresh.refreshed().password for _ in range(3)] == [NEW] * 3
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    _no_secret_in(caplog.records)
    if path.is_dir():
        path.rmdir()


def test_a_failure_said_quietly_is_said_again_at_warning(tmp_path, caplog):
    """The upload worker's link says it at DEBUG; the daemon's own connection still says it at WARNING."""
    path = _file(tmp_path, OLD)
    c = auth.resolve({"token_file": str(path)}, {"HOME": str(tmp_path)})
    path.unlink()
    with caplog.at_level(logging.DEBUG, logger="natsfs.auth"):
        c.refreshed(logging.DEBUG)
        c.refreshed()
        c.refreshed()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.WARNING]


# ---------------------------------------------------------------- each connect sends what the file holds
class RefusingServer:
    """A NATS server in a thread that records each client's CONNECT and refuses it, as a server whose
    password changed does."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connects: list[dict[str, object]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._refuse, args=(conn,), daemon=True).start()

    def _refuse(self, conn: socket.socket) -> None:
        with conn:
            conn.sendall(b'INFO {"server_id":"S","version":"2.10.0","proto":1,"max_payload":1048576,'
                         b'"headers":true,"auth_required":true}\r\n')
            line = b""
            with contextlib.suppress(OSError):
                while not line.endswith(b"\r\n"):
                    got = conn.recv(1)
                    if not got:
                        break
                    line += got
            if line.startswith(b"CONNECT "):
                self.connects.append(json.loads(line[len(b"CONNECT "):]))
            with contextlib.suppress(OSError):
                conn.sendall(b"-ERR 'Authorization Violation'\r\n")
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(10)  # (what the client sent after CONNECT is read: a close, not a reset)
                while conn.recv(4096):
                    pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
        self.sock.close()
        self.thread.join(5)


@contextlib.contextmanager
def refusing_server() -> Iterator[RefusingServer]:
    server = RefusingServer()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["nats-py", "lean", "trio"])
def test_each_connect_of_the_bridge_sends_what_the_file_holds_then(tmp_path, caplog, kind):
    path = _file(tmp_path, OLD)
    c = auth.resolve({"password_file": str(path), "user": "u"}, {"HOME": str(tmp_path)})
    errors: list[str] = []
    with refusing_server() as server, caplog.at_level(logging.DEBUG):
        def attempts() -> None:
            """Connect four times: the file as it was, rewritten, then gone (the last good one kept)."""
            steps = [lambda: None, lambda: path.write_text(NEW + "\n"), lambda: path.unlink(), lambda: None]
            if kind == "trio":
                reads = _TrioReads(None, [server.url], name="natsfs", auth=c, connect_timeout=5)  # type: ignore[arg-type]

                async def run() -> None:
                    for step in steps:
                        step()
                        try:
                            await reads._connect()
                        except Exception as e:  # (refused: what it says is checked below)
                            errors.append(str(e))

                trio.run(run)
            else:
                link = _Link([server.url], name="natsfs", connect_timeout=5, auth=c, lean=kind == "lean")

                async def run_asyncio() -> None:
                    for step in steps:
                        step()
                        try:
                            await link._connect(server.url)
                        except Unavailable as e:
                            errors.append(str(e))

                asyncio.run(run_asyncio())

        attempts()
    passwords = [connect.get("pass") for connect in server.connects]
    assert passwords == [OLD, NEW, NEW, NEW], passwords
    assert len(errors) == 4, errors  # (each refused)
    said = [r for r in caplog.records if r.name == "natsfs.auth" and r.levelno >= logging.WARNING]
    assert len(said) == 1 and str(path) in said[0].getMessage()
    _no_secret_in(caplog.records, *errors)
    assert not os.path.exists(path)


@pytest.mark.parametrize("what", ["password", "token"])
def test_a_secret_given_through_a_descriptor_is_never_read_again_from_that_number(tmp_path, what):
    """`--password-file <(pass show nats)` names /dev/fd/63, a pipe of the command's own: read once, at
    the start. The number means another descriptor in the daemon and the upload worker (a spool file
    with a user's bytes, a pipe of the worker's protocol): reading it again there would send whatever
    that is to the server as the secret, or block on a pipe."""
    r, w = os.pipe()
    os.write(w, (OLD + "\n").encode())
    os.close(w)
    try:
        c = auth.resolve({f"{what}_file": f"/dev/fd/{r}", "user": "u"}, {"HOME": str(tmp_path)})
    finally:
        os.close(r)
    assert getattr(c, what) == OLD and getattr(c, f"{what}_file") is None
    other = _file(tmp_path, "a user's bytes")  # (another file gets that descriptor number now)
    fd = os.open(other, os.O_RDONLY)
    try:
        if fd != r:
            os.dup2(fd, r)
        assert getattr(c.refreshed(), what) == OLD
    finally:
        os.close(fd)
        if fd != r:
            os.close(r)
