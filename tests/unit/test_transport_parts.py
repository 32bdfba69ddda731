"""The transport's pieces without a server: the reply budget, reply routing, error classification, nats-py checks."""

from __future__ import annotations

import asyncio
import errno
import logging
from types import SimpleNamespace

import pytest
import trio

from natsfs import bridge as bridge_mod
from natsfs import natscompat
from natsfs.bridge import MIN_REPLY_BUDGET, Bridge, _ByteBudget, _Link, _Reply, _TrioReads
from natsfs.errors import (
    Conflict,
    JetStreamAPIError,
    NoConnection,
    NoSpace,
    NotPermitted,
    OutcomeUnknown,
    ReadOnly,
    TooBig,
    Unavailable,
)
from natsfs.jetstream import map_publish_error

MiB = 1024 * 1024


def test_budget_is_first_come_first_served_and_never_passes_its_limit():
    async def main() -> None:
        budget = _ByteBudget(8 * MiB)
        order: list[str] = []
        assert await budget.acquire(6 * MiB) == 6 * MiB

        async def take(name: str, n: int) -> None:
            got = await budget.acquire(n)
            order.append(name)
            assert budget.used <= budget.limit
            await trio.sleep(0.01)
            budget.release(got)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, "big", 4 * MiB)
            await trio.sleep(0.01)
            nursery.start_soon(take, "small", 1 * MiB)  # would fit now, but waits its turn
            await trio.sleep(0.01)
            assert order == []
            budget.release(6 * MiB)
        assert sorted(order) == ["big", "small"]
        assert budget.used == 0
        # A request over the whole budget gets all of it, alone.
        assert await budget.acquire(100 * MiB) == 8 * MiB
        budget.release(8 * MiB)

    trio.run(main)


def test_budget_cancelled_waiter_gives_way():
    async def main() -> None:
        budget = _ByteBudget(4 * MiB)
        held = await budget.acquire(4 * MiB)
        with trio.move_on_after(0.05):
            await budget.acquire(MiB)
        budget.release(held)
        assert budget.used == 0
        assert await budget.acquire(4 * MiB) == 4 * MiB

    trio.run(main)


def test_budget_drops_to_the_floor_on_a_kick_and_grows_back_to_half_of_it(monkeypatch):
    """One kick takes the budget to the floor at once (halving took five kicks from 32 MiB to a 1 MB
    max_pending); it doubles back after a quiet while, never past half of where the kick came."""
    async def main() -> None:
        budget = _ByteBudget(32 * MiB)
        assert budget.shrink() == MIN_REPLY_BUDGET
        assert await budget.acquire(8 * MiB) == MIN_REPLY_BUDGET  # asks for no more than the floor now
        budget.release(MIN_REPLY_BUDGET)
        monkeypatch.setattr(bridge_mod, "_BUDGET_REGROW_S", 0.0)
        limits = []
        for _ in range(10):
            budget.release(await budget.acquire(MiB))
            limits.append(budget.limit)
        assert limits[:2] == [2 * MIN_REPLY_BUDGET, 4 * MIN_REPLY_BUDGET] and limits[-1] == 16 * MiB
        # A second kick at 4 MiB: it never grows past 2 MiB again.
        budget.limit = 4 * MiB
        budget.shrink()
        for _ in range(10):
            budget.release(await budget.acquire(MiB))
        assert budget.limit == 2 * MiB

    trio.run(main)


def test_budget_shrunk_for_a_server_going_away_is_given_back():
    budget = _ByteBudget(32 * MiB)
    assert not budget.shrunk_within(60)
    budget.shrink()
    assert budget.shrunk_within(60)
    budget.undo_shrink()
    assert (budget.limit, budget.ceiling) == (32 * MiB, 32 * MiB)
    assert not budget.shrunk_within(60)


class _FakeLeanConnection:
    """A stand-in `wire.TrioWireConnection`: `run` lasts until `drop`."""

    def __init__(self, url: str):
        self.url = url
        self.inbox = "_INBOX.fake"
        self.is_closed = False
        self.last_error: str | None = None
        self._dropped = trio.Event()

    def drop(self, reason: str) -> None:
        self.last_error, self.is_closed = self.last_error or reason, True
        self._dropped.set()

    def close(self) -> None:
        self.drop("closed by the client")

    async def run(self) -> None:
        await self._dropped.wait()


class _FakeServers:
    """Stand-in servers for `wire.connect_trio`: the ones `up` take a connection, the others refuse it;
    a connection to one in `held` waits for `gate` first."""

    def __init__(self, urls: list[str]):
        self.up = set(urls)
        self.held: set[str] = set()
        self.gate = trio.Event()
        self.attempts: list[str] = []

    async def connect_trio(self, url: str, **_: object) -> _FakeLeanConnection:
        self.attempts.append(url)
        if url in self.held:
            await self.gate.wait()
        await trio.lowlevel.checkpoint()
        if url not in self.up:
            raise ConnectionRefusedError(111, "Connection refused")
        return _FakeLeanConnection(url)


async def _until(done: object) -> None:
    with trio.fail_after(10):
        while not done():  # type: ignore[operator]
            await trio.sleep(0.005)


SERVERS = ["nats://n0:4222", "nats://n1:4222", "nats://n2:4222"]


@pytest.mark.parametrize("what", ["kick", "server died", "both lost", "main lost first"])
def test_a_lost_lean_connection_shrinks_the_budget_only_when_its_server_takes_it_back(monkeypatch, caplog, what):
    """The lean connection lost with replies in flight while the main one stays: its next attempt goes to
    the same server. A server that takes it back dropped it, a kick: the budget drops to its floor (the
    WARNING). One that refuses it went away (a cluster node died, the main connection is on another):
    the budget stays, one INFO line, and the connection moves on to the next server. The main
    connection lost meanwhile is the server going away as well: no shrink, whatever the retry finds; so
    is the main connection lost moments before, even when it is back by the time the lean loss is seen."""
    fake = _FakeServers(SERVERS)
    monkeypatch.setattr(bridge_mod.wire, "connect_trio", fake.connect_trio)
    caplog.set_level(logging.DEBUG, logger="natsfs.bridge")

    async def main() -> None:
        bridge = Bridge(SERVERS)
        reads = _TrioReads(bridge, SERVERS, name="natsfs", auth=None, connect_timeout=1)
        bridge._reads, bridge.connected = reads, True
        await reads.open()
        try:
            first = reads.nc
            assert isinstance(first, _FakeLeanConnection) and first.url == SERVERS[0]
            held = await bridge._budget.acquire(4 * MiB)  # replies in flight
            if what == "server died":
                fake.up.discard(SERVERS[0])
            if what == "both lost":
                fake.held.add(SERVERS[0])
            if what == "main lost first":
                bridge._lost_in_trio(0)
                bridge._restored_in_trio()
            first.drop("Slow Consumer" if what == "kick" else "unexpected EOF")
            if what == "both lost":
                await _until(lambda: len(fake.attempts) == 2)  # the retry is under way ...
                bridge._lost_in_trio(0)  # ... when the main connection is lost too
                fake.gate.set()
            await _until(lambda: reads.nc not in (None, first))
            shrunk = [r for r in caplog.records if "at most 256 KiB in flight" in r.getMessage()]
            gone = [r for r in caplog.records if "is gone, not a slow-consumer kick" in r.getMessage()]
            if what == "kick":
                assert fake.attempts == [SERVERS[0], SERVERS[0]]
                assert bridge._budget.limit == MIN_REPLY_BUDGET
                assert [r.levelno for r in shrunk] == [logging.WARNING] and not gone
            elif what == "server died":
                assert fake.attempts == [SERVERS[0], SERVERS[0], SERVERS[1]]
                assert bridge._budget.limit == 32 * MiB and not shrunk
                assert [r.levelno for r in gone] == [logging.INFO]
                assert "n0:4222" in gone[0].getMessage()
            elif what == "both lost":
                assert fake.attempts == [SERVERS[0], SERVERS[0]]
                assert bridge._budget.limit == 32 * MiB and not shrunk and not gone
            else:  # no verdict to wait for: the next server in turn
                assert fake.attempts == [SERVERS[0], SERVERS[1]]
                assert bridge._budget.limit == 32 * MiB and not shrunk and not gone
            # A loss with no replies in flight leaves no verdict to wait for: the next server in turn.
            bridge._budget.release(held)
            bridge.connected = True
            tried = len(fake.attempts)
            now = reads.nc
            assert isinstance(now, _FakeLeanConnection)
            now.drop("unexpected EOF")
            await _until(lambda: reads.nc not in (None, now))
            after = SERVERS[(SERVERS.index(now.url) + 1) % len(SERVERS)]
            assert fake.attempts[tried:] == [after]
        finally:
            await reads.close()

    trio.run(main)


def test_replies_to_an_earlier_inbox_complete_nothing():
    async def main() -> None:
        link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1)
        link.prefix = "_INBOX.new"
        waiter = _Reply("subj", ack=True)
        link.waiters["1"] = waiter
        msg = SimpleNamespace(subject="_INBOX.old.1", reply="", headers=None, data=b"stale")
        await link._on_reply(msg)
        assert not waiter.fut.done()
        await link._on_reply(SimpleNamespace(subject="_INBOX.newer.1", reply="", headers=None, data=b"x"))
        assert not waiter.fut.done()
        await link._on_reply(SimpleNamespace(subject="_INBOX.new.1", reply="", headers=None, data=b"ok"))
        assert waiter.fut.result().data == b"ok"
        assert "1" not in link.waiters

    asyncio.run(main())


def test_losing_the_client_fails_acks_as_outcome_unknown_and_requests_as_unavailable():
    async def main() -> None:
        link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1, quiet=True)
        link._ready = asyncio.Event()
        closed = SimpleNamespace(last_error="nats: unexpected EOF", is_closed=True, _flush_queue=None)
        link.nc, link.prefix = closed, "_INBOX.a"
        ack, request = _Reply("$O.b.C.x", ack=True), _Reply("$JS.API.INFO", ack=False)
        link.waiters.update({"1": ack, "2": request})
        link._closing = False
        link._reconnect = _no_reconnect  # type: ignore[method-assign]
        link._bury = _no_bury  # type: ignore[method-assign]  # (a stand-in client: nothing of nats-py to end)
        link._lost(closed)
        assert isinstance(ack.fut.exception(), OutcomeUnknown)
        exc = request.fut.exception()
        assert isinstance(exc, Unavailable) and not isinstance(exc, OutcomeUnknown)
        assert link.nc is None and link.prefix == "" and link.generation == 1 and not link.waiters
        await asyncio.sleep(0)

    asyncio.run(main())


def test_a_permission_refusal_fails_the_oldest_request_on_its_subject_and_keeps_the_connection(caplog):
    caplog.set_level(logging.WARNING, logger="natsfs.bridge")
    bridge_mod._refusals_logged.clear()

    async def main() -> None:
        link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1, quiet=True)
        client = SimpleNamespace(last_error=None, is_closed=False)
        link.nc, link.prefix = client, "_INBOX.a"
        other = _Reply("$O.b.C.Other", ack=True)
        first, second = _Reply("$O.b.C.AbC", ack=True), _Reply("$O.b.C.AbC", ack=True)
        link.waiters.update({"1": other, "2": first, "3": second})
        link.refused("publish", "$o.b.c.abc")  # (as nats-py's error callback has it: lowered)
        exc = first.fut.exception()
        assert isinstance(exc, NotPermitted) and exc.errno == errno.EACCES and exc.subject == "$O.b.C.AbC"
        assert not other.fut.done() and not second.fut.done()
        assert list(link.waiters) == ["1", "3"]
        link.refused("publish", "$O.b.C.AbC")
        assert isinstance(second.fut.exception(), NotPermitted)
        link.refused("publish", "$O.b.M.YQ==")  # nothing waits on it: logged only
        assert link.nc is client and link.generation == 0 and list(link.waiters) == ["1"]
        other.settle()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "permission denied" in r.getMessage()]
    # one line per kind ($O.b.C, $O.b.M), not one per refused message
    assert len(lines) == 2 and "$O.b.C.AbC" in lines[0] and "$O.b.M.YQ==" in lines[1]


async def _no_reconnect(since: float) -> None:
    return None


def test_once_a_request_waited_in_vain_for_a_connection_the_next_ones_of_that_outage_fail_at_once():
    """The kernel sends one read(2) as two requests (readahead, then the page): the second must not wait
    another request timeout for a server that is away. A new outage waits again."""

    async def main() -> None:
        link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1, quiet=True)
        link._ready = asyncio.Event()
        link._closing = False
        link._reconnect = _no_reconnect  # type: ignore[method-assign]
        link._bury = _no_bury  # type: ignore[method-assign]
        gone = SimpleNamespace(last_error="nats: unexpected EOF", is_closed=True, _flush_queue=None)
        link.nc = gone
        link._lost(gone)
        link._lost_at -= 10_000  # the outage is older than any timeout below
        with pytest.raises(NoConnection):
            await link.client(0.01)  # the first waits its whole timeout
        # The next one fails without waiting (an hour-long timeout would otherwise end the test).
        with pytest.raises(NoConnection):
            await asyncio.wait_for(link.client(3600), 60)
        again = SimpleNamespace(last_error="nats: unexpected EOF", is_closed=True, _flush_queue=None)
        link.nc = again  # a connection came back, and was lost again: a new outage, waited for again
        link._lost(again)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(link.client(3600), 0.01)
        await asyncio.sleep(0)

    asyncio.run(main())


async def _no_bury(nc: object) -> None:
    return None


class _AckingClient:
    """A stand-in nats-py client that stores every publish and acknowledges it a moment later, counting
    the publishes sent and not acknowledged yet."""

    is_closed = False

    def __init__(self, link: _Link):
        self.link = link
        self.in_flight = 0
        self.most_in_flight = 0
        self.subjects: list[str] = []
        self.payloads: list[bytes] = []
        self.acks: set[asyncio.Future[None]] = set()

    async def publish(self, subject: str, payload: bytes, *, reply: str, headers: dict[str, str] | None) -> None:
        self.subjects.append(subject)
        self.payloads.append(bytes(payload))
        seq = len(self.payloads)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        asyncio.get_running_loop().call_later(0.0005 * (seq % 3), self._ack, reply, seq)

    def _ack(self, reply: str, seq: int) -> None:
        self.in_flight -= 1
        data = f'{{"stream":"OBJ_b","seq":{seq}}}'.encode()
        ack = asyncio.ensure_future(self.link._on_reply(SimpleNamespace(subject=reply, reply="", headers=None,
                                                                        data=data)))
        self.acks.add(ack)
        ack.add_done_callback(self.acks.discard)


def test_publish_many_keeps_at_most_its_window_unacknowledged_and_sends_in_order():
    size = 1000

    async def main() -> None:
        link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1)
        client = _AckingClient(link)
        link.nc, link.prefix = client, "_INBOX.a"
        msgs = [(f"$O.b.C.n{i}", bytes([i]) * size, {"Nats-Msg-Id": f"n.{i}"}) for i in range(200)]
        results = await link.js_publish_many(msgs, 8, timeout=5)
        assert [r["seq"] for r in results] == list(range(1, 201))  # type: ignore[index]
        assert client.subjects == [m[0] for m in msgs] and client.payloads == [m[1] for m in msgs]
        assert client.most_in_flight == 8  # pipelined up to the window, never past it
        assert not link.waiters

    asyncio.run(main())


@pytest.mark.parametrize(("err_code", "expected"), [
    (10071, Conflict), (10164, Conflict), (10109, ReadOnly), (10077, NoSpace), (10002, NoSpace),
    (10023, NoSpace), (10047, NoSpace), (10028, NoSpace), (10054, TooBig), (10097, TooBig),
    (10158, OutcomeUnknown),
])
def test_publish_errors_are_classified_by_err_code(err_code, expected):
    # The description says nothing useful on purpose: only the err_code may decide.
    assert isinstance(map_publish_error(JetStreamAPIError("x", code=400, err_code=err_code), "s"), expected)


def test_publish_error_text_alone_decides_nothing():
    e = JetStreamAPIError("maximum bytes exceeded, wrong last sequence, sealed", code=500, err_code=10999)
    assert map_publish_error(e, "s") is e


def test_installed_nats_py_has_what_natscompat_uses():
    natscompat.check()
    import nats.aio.client

    assert nats.aio.client.DEFAULT_BUFFER_SIZE >= natscompat.READ_BUFFER


def test_natscompat_refuses_an_unchecked_version(monkeypatch):
    monkeypatch.setattr(natscompat, "_version", lambda: (2, 17))
    with pytest.raises(natscompat.IncompatibleNatsPy, match=r"nats-py >=2\.9,<2\.17, found 2\.17"):
        natscompat.check()


def test_natscompat_names_what_is_missing(monkeypatch):
    import nats.aio.client

    monkeypatch.delattr(nats.aio.client.Client, "_process_msg")
    with pytest.raises(natscompat.IncompatibleNatsPy, match="_process_msg"):
        natscompat.check()


@pytest.mark.parametrize("headers", [None, {"Nats-Msg-Id": "nuid.7", "Nats-Expected-Last-Subject-Sequence": "3"}])
def test_a_large_payload_is_queued_as_the_frame_nats_py_would_send(headers):
    import nats.aio.client
    from nats.protocol.command import hpub_cmd, pub_cmd

    async def main() -> None:
        payload = bytes(range(256)) * 1024  # 256 KiB: queued in parts, not joined
        nc = nats.aio.client.Client()
        await natscompat.publish(nc, "$O.b.C.x", payload, reply="_INBOX.a.1", headers=headers)
        assert any(part is payload for part in nc._pending)  # not copied
        if headers is None:
            expected = pub_cmd("$O.b.C.x", "_INBOX.a.1", payload)
        else:
            hdr = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n"
            expected = hpub_cmd("$O.b.C.x", "_INBOX.a.1", hdr, payload)
        assert b"".join(nc._pending) == expected and nc._pending_data_size == len(expected)

    asyncio.run(main())
