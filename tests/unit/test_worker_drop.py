"""The upload worker's `drop` (natsfs.bridge): a put the daemon gave up is stopped before its next write,
and `drop` is answered only once nothing more of it can be published (the daemon purges after that
answer, so no chunk lands after the purge). The worker's request handling runs here in-process, over a
real `_Link` whose client is a stand-in: its transport records the frames written, and the server's acks
are held until the test delivers them."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from natsfs.bridge import _Hashing, _Link, _worker_handle, _WorkerSession

CHUNK = 1024
SUBJECT = "$O.b.C.N"


class _RecordingTransport:
    """Records the publishes written (message id and reply token of each); acks come when the test says."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []  # (msg id, reply token)
        self.written = asyncio.Event()

    def write(self, frames: Any) -> None:
        text = bytes(frames).decode("latin-1")
        for reply, msg_id in re.findall(r"HPUB \S+ _INBOX\.a\.(\d+) \d+ \d+\r\nNATS/1\.0\r\nNats-Msg-Id: (\S+)\r\n",
                                        text):
            self.published.append((msg_id, reply))
        self.written.set()

    async def drain(self) -> None:
        return None


def _link(transport: _RecordingTransport, *, connected: bool = True) -> _Link:
    link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1, quiet=True)
    link._ready = asyncio.Event()
    link.prefix = "_INBOX.a"
    client = SimpleNamespace(is_closed=False, max_payload=1 << 20, _transport=transport, _pending_data_size=0)
    if connected:
        link.nc = client
        link._ready.set()
    else:
        link.nc = None
        link.connect_later = client  # type: ignore[attr-defined]  # (the test hands it over)
    return link


def _ack(link: _Link, tokens: list[str]) -> None:
    for seq, token in enumerate(tokens, 1):
        link._on_lean_reply(f"_INBOX.a.{token}", None, f'{{"stream":"OBJ_b","seq":{seq}}}'.encode())


def _send(path: Path, start: int, end: int, window: int = 2) -> dict[str, Any]:
    return {"op": "send", "session": "N", "subject": SUBJECT, "path": str(path), "start": start, "end": end,
            "chunk_size": CHUNK, "window": window}


async def _settled(*tasks: asyncio.Task[Any]) -> None:
    """Let every ready task run until none of `tasks` can make progress without the test."""
    for _ in range(50):
        await asyncio.sleep(0)
    assert not any(t.done() and t.exception() for t in tasks)


def test_a_dropped_range_waiting_for_acks_sends_nothing_more_and_drop_answers_once_its_acks_came(tmp_path):
    spool = tmp_path / "spool"
    spool.write_bytes(bytes(range(256)) * (8 * CHUNK // 256))  # 8 chunks

    async def main() -> None:
        transport = _RecordingTransport()
        link = _link(transport)
        sessions: dict[str, _WorkerSession] = {}
        hashing = _Hashing()
        send = asyncio.ensure_future(_worker_handle(link, sessions, hashing, _send(spool, 0, 8 * CHUNK)))
        await asyncio.wait_for(transport.written.wait(), 10)
        await _settled(send)
        assert [m for m, _ in transport.published] == ["N.0", "N.1"]  # its window: the range waits for acks
        drop = asyncio.ensure_future(_worker_handle(link, sessions, hashing, {"op": "drop", "session": "N"}))
        await _settled(send, drop)
        # Two publishes were sent and not answered: one could be stored after a purge made now.
        assert not drop.done(), "drop answered while publishes of the session were unacknowledged"
        _ack(link, [token for _, token in transport.published])
        assert await asyncio.wait_for(drop, 10) == {"quiet": True}
        reply = await asyncio.wait_for(send, 10)
        assert "error" in reply  # the daemon gave it up: not a success
        await _settled()
        assert [m for m, _ in transport.published] == ["N.0", "N.1"], "publishes after the drop"
        assert "N" not in sessions
        # Asked again (the daemon could not wait for the first answer): nothing of it is left.
        again = await asyncio.wait_for(_worker_handle(link, sessions, hashing, {"op": "drop", "session": "N"}), 10)
        assert again == {"quiet": True}
        hashing.executor.shutdown()

    asyncio.run(main())


def test_a_dropped_range_waiting_for_a_connection_or_its_turn_writes_nothing(tmp_path):
    """A range past its checks but waiting for a client (a reconnect), and one waiting for the range
    before it: after the drop, neither writes a frame when the connection comes."""
    spool = tmp_path / "spool"
    spool.write_bytes(bytes(4 * CHUNK))

    async def main() -> None:
        transport = _RecordingTransport()
        link = _link(transport, connected=False)
        sessions: dict[str, _WorkerSession] = {}
        hashing = _Hashing()
        first = asyncio.ensure_future(_worker_handle(link, sessions, hashing, _send(spool, 0, 2 * CHUNK)))
        second = asyncio.ensure_future(_worker_handle(link, sessions, hashing, _send(spool, 2 * CHUNK, 4 * CHUNK)))
        await _settled(first, second)
        drop = asyncio.ensure_future(_worker_handle(link, sessions, hashing, {"op": "drop", "session": "N"}))
        await _settled(first, second, drop)
        assert not drop.done()  # the first range may still write once it has a connection
        link.nc = link.connect_later  # type: ignore[attr-defined]  # the connection is back
        assert link._ready is not None
        link._ready.set()
        assert await asyncio.wait_for(drop, 10) == {"quiet": True}
        assert "error" in await asyncio.wait_for(first, 10)
        assert "error" in await asyncio.wait_for(second, 10)  # its turn came after the drop
        await _settled()
        assert transport.published == [], "a dropped range wrote publishes"
        assert not link.waiters
        hashing.executor.shutdown()

    asyncio.run(main())


def test_a_drop_of_a_session_the_worker_does_not_have_is_answered_at_once():
    async def main() -> None:
        link = _link(_RecordingTransport())
        hashing = _Hashing()
        reply = await asyncio.wait_for(_worker_handle(link, {}, hashing, {"op": "drop", "session": "X"}), 10)
        assert reply == {"quiet": True}
        hashing.executor.shutdown()

    asyncio.run(main())
